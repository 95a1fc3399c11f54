//! The segment log: an append-only, checksummed key-value log over fixed-size segment files.
//!
//! * Writes go to the *active* segment. A batch of records is encoded into one aligned buffer that
//!   starts with a copy of the partially filled last block, so small records share blocks and every
//!   write is aligned (ready for O_DIRECT). `put` returns once the write is in the kernel; `sync`
//!   makes everything before it durable.
//! * When the next record does not fit, the active segment is *sealed*: its data is fdatasync'ed,
//!   then a footer index (one entry per record) and a trailer are written at its end. Opening a store
//!   reads trailers and footers and scans only unsealed segments.
//! * The in-memory index maps each live key to its record's location. Per-segment live bytes drive
//!   garbage collection: a segment with nothing live (and no tombstone still needed) is deleted, and
//!   [`SegmentLog::compact`] relocates live records out of segments less than half live.
//!
//! See `docs/architecture.md` for the write and recovery paths step by step, and `docs/format.md`
//! for the bytes.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

// The index and writer locks come from the sync shim, so the store's loom models see every log call
// that touches the index (a read racing a removal, for one) as a step to interleave.
use crate::sync::{AtomicBool, AtomicU64, Mutex, MutexGuard, Ordering, RwLock};

use bytes::Bytes;

use crate::backend::{Backend, BufResult, DirLock, PipelinedRead, PortableBackend};
use crate::buf::AlignedBuf;
use crate::error::{Error, Result};
use crate::format::{self, align_down, align_up, FooterEntry, RecordHeader, Salt, RECORD_ALIGN};
use crate::key::{IndexKey, KeyHasher, KeyMap};
use crate::value::Frames;

/// Name of the sub-directory holding segment files.
pub const SEGMENTS_DIR: &str = "segments";
/// Smallest accepted segment size.
pub const MIN_SEGMENT_BYTES: u64 = 64 * 1024;
/// Read window used when scanning unsealed segments.
const SCAN_WINDOW: usize = 1 << 20;
/// Largest write buffer kept for reuse between writes.
const MAX_SPARE_BUF: usize = 64 << 20;
/// With a backend that queues writes, records are encoded and written in groups of about this size,
/// up to `WRITES_IN_FLIGHT` at once (see `write_chunk`). Measured for 1 MiB values in batches of 16
/// on io_uring with O_DIRECT: 0.72x fio as one 16 MiB write, 0.77x as 4 MiB groups 4 in flight,
/// 0.86-0.91x as 1 MiB groups 16 in flight (fio: 1 MiB writes, QD16).
const WRITE_GROUP_BYTES: u64 = 1 << 20;
/// Writes of one chunk in flight at once.
const WRITES_IN_FLIGHT: usize = 16;
/// A chunk holding a value at least this large is written gathered (no staging copy) where the
/// backend supports it.
const GATHER_MIN_BYTES: u64 = 256 << 10;
/// Forgotten records at least this large are hole-punched (with `LogOptions::punch_forgotten`).
const PUNCH_MIN_BYTES: u64 = 256 << 10;
/// Default `LogOptions::parallel_crc_min_bytes`.
const PARALLEL_CRC_MIN_BYTES: u64 = 4 << 20;
/// A single-frame, uncompressed value at least this large gets its payload padded to start at a
/// multiple of 512 in the file ([`format::PAYLOAD_PAD_LIMIT`]): reading it without its head is then
/// a read of whole sectors, 4096 bytes for a 4 KiB value instead of 4608 (its head in a sector of
/// its own). On this machine's disk a 4 KiB random read runs at 1.2x the IOPS of a 4608-byte one
/// (`docs/benchmarks.md`). The padding (at most 448 bytes) costs a 4 KiB value 9 % more disk.
const ALIGN_PAYLOAD_MIN: u64 = 4096;
/// Memory page size (x86-64, aarch64 with 4 KiB pages): the alignment of O_DIRECT read buffers.
const PAGE_BYTES: u64 = 4096;
/// Zeros for padding in gathered writes.
static ZEROS: [u8; 4096] = [0; 4096];
/// Largest `LogOptions::write_behind_bytes`.
pub const MAX_WRITE_BEHIND_BYTES: u64 = 64 << 20;
/// `SegmentLog::pending` when no record is pending.
const NOTHING_PENDING: u64 = u64::MAX;

/// `SegmentLog::pending` while records of `segment` from offset `written_end` on are pending.
/// Offsets fit in 32 bits (segments are smaller than 4 GiB).
fn pending_key(segment: u32, written_end: u64) -> u64 {
    ((segment as u64) << 32) | (written_end & 0xffff_ffff)
}
/// Values smaller than this are never compressed.
const MIN_COMPRESS_BYTES: u64 = 256;

/// Per-record payload compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// Store payloads as they are.
    #[default]
    None,
    /// lz4-compress each payload, kept only when it saves at least 1/8 of the bytes.
    Lz4,
}

/// Options for [`SegmentLog::open`].
#[derive(Debug, Clone)]
pub struct LogOptions {
    /// Size of each segment file (rounded up to the I/O alignment). A record too large for an empty
    /// segment gets a segment of its own, sized to fit.
    pub segment_bytes: u64,
    /// Payload compression for new records.
    pub compression: Compression,
    /// Create the store directory if it does not exist.
    pub create_if_missing: bool,
    /// Largest value accepted, in bytes.
    pub max_value_bytes: u64,
    /// Compact automatically when a segment is sealed and sealed segments hold more dead than live bytes.
    pub auto_compact: bool,
    /// With a backend that queues writes (io_uring), a batch is encoded and written in groups of about
    /// this many bytes, several in flight at once, so encoding overlaps writing. Default 1 MiB.
    pub write_group_bytes: u64,
    /// With a backend that writes gathered slices (buffered portable files), a batch holding a value
    /// of at least this many bytes is written with one `pwritev` straight from the values' buffers,
    /// without copying them into a staging buffer. Default 256 KiB.
    pub gather_min_bytes: u64,
    /// In such a gathered write, large values adding up to at least this many bytes get their crcs
    /// computed on a helper thread while the write copies them into the page cache, and their record
    /// heads are written last. Default 4 MiB; `u64::MAX` keeps everything on the calling thread.
    pub parallel_crc_min_bytes: u64,
    /// I/O alignment override (power of two, 512..=65536); `None` asks the backend (statx).
    pub alignment: Option<usize>,
    /// Release a forgotten record's blocks at once with a hole punch (`fallocate`), for values of
    /// 256 KiB and more. For logs whose contents die with the process (a spill store), where it frees
    /// disk space and page cache the way unlinking a file would. A punched record no longer reads back,
    /// so such a log should not be reopened: the store discards it at open instead.
    pub punch_forgotten: bool,
    /// At open, delete whatever segments the directory holds instead of recovering them (after taking
    /// the directory's lock): for a spill store, whose data dies with its process. Files in
    /// `segments/` that are not named like segments are left alone (with a warning), as recovery does.
    pub discard_existing: bool,
    /// fdatasync on its own where crash consistency needs it: before sealing a segment and before
    /// deleting one. Turn off for data that dies with the process (a spill store); `sync()` still
    /// syncs when called.
    pub durable: bool,
    /// Write-behind: small batches are kept in memory, encoded, until this many bytes are pending,
    /// and then written together, so a stream of small puts costs one write per this many bytes
    /// instead of one per put. 0 (the default) writes every batch before `put` returns. Pending
    /// records are readable at once (a read of one copies it out of memory); `sync`, sealing a
    /// segment, `stored_value` and dropping the log write them too. The price: a process crash loses the pending bytes, which a spill store, whose
    /// data dies with its process anyway, does not mind. At most 64 MiB.
    pub write_behind_bytes: u64,
}

impl Default for LogOptions {
    fn default() -> Self {
        LogOptions {
            segment_bytes: 64 << 20,
            compression: Compression::None,
            create_if_missing: true,
            max_value_bytes: MAX_VALUE_BYTES,
            auto_compact: true,
            alignment: None,
            write_group_bytes: WRITE_GROUP_BYTES,
            gather_min_bytes: GATHER_MIN_BYTES,
            parallel_crc_min_bytes: PARALLEL_CRC_MIN_BYTES,
            punch_forgotten: false,
            discard_existing: false,
            durable: true,
            write_behind_bytes: 0,
        }
    }
}

/// The stored form of a value arriving from a peer, for [`SegmentLog::put_stream`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamedValue {
    /// The payload is an lz4 block of the laid-out frames.
    pub lz4: bool,
    /// Length of each frame.
    pub frame_lens: Vec<u64>,
    /// Length of the laid-out frames ([`format::frame_layout`]).
    pub raw_len: u64,
    /// Bytes that follow on the stream.
    pub stored_len: u64,
    /// crc32 of those bytes.
    pub payload_crc: u32,
}

/// A value's stored form on disk (see [`SegmentLog::stored_value`]).
pub struct StoredValue<F> {
    /// The segment file (kept open while this is held, even if the segment is deleted meanwhile).
    pub file: Arc<F>,
    /// Path of the segment file, for error messages.
    pub path: PathBuf,
    /// Offset of the payload in the file.
    pub payload_offset: u64,
    /// The record's metadata: what a receiver needs besides the payload bytes.
    pub meta: StreamedValue,
    /// Keeps `forget` from punching the record's blocks while it is being sent.
    _pin: SendPin,
}

/// Values streaming into segments of their own, by key: (sequence number, overtaken) of each (see
/// [`SegmentLog::put_stream`]).
type Streams = HashMap<Vec<u8>, Vec<(u64, bool)>>;

/// Records being sent ([`SegmentLog::stored_value`]), by (segment, offset), with a count.
type SendPins = Arc<Mutex<HashMap<(u32, u64), u32>>>;

/// One pin of a record being sent: while it lives, `forget` leaves the record's blocks alone (the
/// sender reads them from the file after the key may have been forgotten).
struct SendPin {
    pins: SendPins,
    at: (u32, u64),
}

impl SendPin {
    fn new(pins: &SendPins, at: (u32, u64)) -> Self {
        *lock(pins).entry(at).or_insert(0) += 1;
        SendPin { pins: pins.clone(), at }
    }
}

impl Drop for SendPin {
    fn drop(&mut self) {
        let mut p = lock(&self.pins);
        if let Some(n) = p.get_mut(&self.at) {
            *n -= 1;
            if *n == 0 {
                p.remove(&self.at);
            }
        }
    }
}

/// Where a live record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Segment id.
    pub segment: u32,
    /// Byte offset of the record in the segment.
    pub offset: u64,
    /// Unpadded record length.
    pub len: u64,
}

/// What the index knows of a record beyond where it is: enough to read a single-frame,
/// uncompressed value without its head (its payload's crc and padding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct RecordFacts {
    /// The payload crc, for a value read without its head: single frame, not lz4, not empty.
    direct_crc: Option<u32>,
    /// The payload padding (`aux` of a value record), a multiple of 64 below 512.
    pad: u32,
}

impl RecordFacts {
    /// The facts of the record a footer entry describes.
    fn of_entry(e: &FooterEntry) -> Self {
        let pad = if e.flags & format::FLAG_TOMBSTONE != 0 { 0 } else { e.aux as u64 };
        let stored = e.record_len.saturating_sub(format::head_len(e.frame_count as usize, e.key.len()) + pad);
        Self::of(e.flags, e.frame_count, e.payload_crc, e.aux, stored)
    }

    /// The facts of a record with these header fields.
    fn of(flags: u8, frame_count: u16, payload_crc: u32, aux: u32, stored_len: u64) -> Self {
        let value = flags & (format::FLAG_TOMBSTONE | format::FLAG_SYNC_MARK) == 0;
        let direct = value && flags & format::FLAG_LZ4 == 0 && frame_count == 1 && stored_len > 0;
        RecordFacts { direct_crc: direct.then_some(payload_crc), pad: if value { aux } else { 0 } }
    }
}

/// A [`Location`] and its [`RecordFacts`] as the index stores them, in 16 bytes (1 M keys: the
/// hash table's entries stay 40 bytes), with a flag saying whether the key's oldest segment is
/// another one (see [`SegMeta::firsts`]). Offsets fit 32 bits because a segment is at most
/// [`MAX_SEGMENT_BYTES`] (a jumbo segment holds one record, at its start), and their low 6 bits are
/// free for flags because records start at multiples of 64; lengths fit because values are at most
/// [`MAX_VALUE_BYTES`].
#[derive(Debug, Clone, Copy)]
struct PackedLoc {
    segment: u32,
    /// The offset, with `LOC_*` flags and the payload padding / 64 in its low 6 bits.
    offset_bits: u32,
    len: u32,
    /// The payload crc when `LOC_DIRECT` is set.
    crc: u32,
}

/// `PackedLoc` flag: the value can be read without its head (`crc` is its payload crc).
const LOC_DIRECT: u32 = 1;
/// `PackedLoc` flag: the key's oldest segment is an older one, listed in the segment's `firsts`.
const LOC_FIRST: u32 = 2;
/// `PackedLoc`: the payload padding / 64 is in these bits.
const LOC_PAD_SHIFT: u32 = 2;
const LOC_PAD_MASK: u32 = 7;
const _: () = assert!(format::PAYLOAD_PAD_LIMIT / 64 <= LOC_PAD_MASK as u64 + 1);
const _: () = assert!(RECORD_ALIGN >= 64);

impl PackedLoc {
    /// `l` must pack: the writer places records so (`fits`, `MAX_RECORD_BYTES`), and recovery drops
    /// entries that do not (see `recover`).
    fn new(l: Location, facts: RecordFacts, first_elsewhere: bool) -> Self {
        debug_assert!(l.offset <= u32::MAX as u64 && l.len <= u32::MAX as u64, "{l:?} does not pack");
        debug_assert!(l.offset % RECORD_ALIGN == 0 && facts.pad % 64 == 0 && facts.pad / 64 <= LOC_PAD_MASK);
        let mut bits = l.offset as u32 | (facts.pad / 64) << LOC_PAD_SHIFT;
        if facts.direct_crc.is_some() {
            bits |= LOC_DIRECT;
        }
        if first_elsewhere {
            bits |= LOC_FIRST;
        }
        PackedLoc { segment: l.segment, offset_bits: bits, len: l.len as u32, crc: facts.direct_crc.unwrap_or(0) }
    }

    fn offset(&self) -> u64 {
        (self.offset_bits & !63) as u64
    }

    fn loc(&self) -> Location {
        Location { segment: self.segment, offset: self.offset(), len: self.len as u64 }
    }

    fn facts(&self) -> RecordFacts {
        RecordFacts {
            direct_crc: (self.offset_bits & LOC_DIRECT != 0).then_some(self.crc),
            pad: (self.offset_bits >> LOC_PAD_SHIFT & LOC_PAD_MASK) * 64,
        }
    }

    fn first_elsewhere(&self) -> bool {
        self.offset_bits & LOC_FIRST != 0
    }
}

impl From<PackedLoc> for Location {
    fn from(p: PackedLoc) -> Self {
        p.loc()
    }
}

/// `SegmentLog::warned` bits. A full file system is warned about again after a write succeeded.
const WARN_FULL: u64 = 1;
const WARN_PUNCH: u64 = 2;
const WARN_COMPACT: u64 = 4;
const WARN_GC: u64 = 8;

/// The highest sequence number a log writes: one whose records reach it opens read-only (see
/// `recover`). Below it, a log's life cannot exhaust the counter (2^63 more writes).
const SEQ_LIMIT: u64 = 1 << 63;

/// Largest segment size accepted (offsets in the index are 32-bit).
pub const MAX_SEGMENT_BYTES: u64 = (4 << 30) - (1 << 20);
/// Largest value accepted (record lengths in the index are 32-bit).
pub const MAX_VALUE_BYTES: u64 = (4 << 30) - (1 << 20);
/// Largest record (value, frame table, key and gaps): the index holds lengths in 32 bits.
const MAX_RECORD_BYTES: u64 = u32::MAX as u64;

/// `put_stream` reads a value of at most this many stored bytes, or an eighth of a segment if that
/// is more, into memory, then writes it under the writer lock; a larger one goes into a segment of
/// its own without the lock. (An eighth of a segment: each segment is an open file, and a stream of
/// values of a few MiB must not cost a file each.)
const STREAM_BUFFERED_MAX: u64 = 1 << 20;

/// The error of a peer that stopped before the whole value arrived.
fn stopped_early() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "the sender stopped before the whole value arrived")
}

/// Fill `buf` from `src` (a value's payload from a peer), retrying interrupted reads.
fn read_payload(src: &mut dyn io::Read, buf: &mut [u8]) -> Result<()> {
    let mut at = 0;
    while at < buf.len() {
        match src.read(&mut buf[at..]) {
            Ok(0) => return Err(Error::io("receive value", None, stopped_early())),
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io("receive value", None, e)),
        }
    }
    Ok(())
}
/// Largest segment file the writer makes: a jumbo segment (see `rotate`) for the largest record with
/// the longest key, at the largest alignment. A segment header claiming more is damage.
const MAX_SEGMENT_FILE_BYTES: u64 = {
    const ALIGN: u64 = 65536;
    let data = align_up(align_up(ALIGN + MAX_RECORD_BYTES, RECORD_ALIGN), ALIGN);
    let footer_entry = align_up((format::FOOTER_ENTRY_FIXED_LEN + format::MAX_KEY_BYTES) as u64, format::FOOTER_ALIGN);
    data + align_up(footer_entry + format::TRAILER_LEN as u64, ALIGN)
};
const _: () = assert!(MAX_SEGMENT_FILE_BYTES >= MAX_SEGMENT_BYTES);

/// What recovery found when the log was opened.
#[derive(Debug, Clone, Default)]
pub struct RecoveryReport {
    /// Segments whose footer was used.
    pub sealed_segments: u32,
    /// Segments that were scanned record by record.
    pub scanned_segments: u32,
    /// Records found (live and dead, tombstones included).
    pub records: u64,
    /// Bytes of a torn or garbage tail that were cut off an unsealed segment.
    pub truncated_bytes: u64,
    /// Damaged regions found while scanning, as (segment, offset, reason).
    pub corrupt: Vec<(u32, u64, String)>,
}

/// Space accounting, as reported by [`SegmentLog::stats`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogStats {
    /// Segment files.
    pub segments: u64,
    /// Sealed segment files.
    pub sealed_segments: u64,
    /// Records in all segments (live, superseded and tombstones).
    pub records: u64,
    /// Live keys.
    pub live_records: u64,
    /// Bytes of live records (padded), plus tombstones that are still needed.
    pub live_bytes: u64,
    /// Bytes of records that are superseded, deleted, or tombstones no longer needed.
    pub dead_bytes: u64,
    /// Tombstone records on disk.
    pub tombstones: u64,
    /// Bytes of all segment files (preallocated size).
    pub disk_bytes: u64,
    /// Bytes used by records in all segments.
    pub used_bytes: u64,
}

/// A problem found by [`SegmentLog::verify`].
#[derive(Debug, Clone)]
pub struct VerifyProblem {
    /// Segment id.
    pub segment: u32,
    /// Byte offset.
    pub offset: u64,
    /// The record's key, when known.
    pub key: Option<Vec<u8>>,
    /// What is wrong.
    pub error: String,
}

/// What [`SegmentLog::compact`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompactStats {
    /// Segments rewritten and deleted.
    pub segments_compacted: u64,
    /// Records relocated.
    pub records_moved: u64,
    /// Bytes relocated.
    pub bytes_moved: u64,
    /// Segments deleted (including empty ones).
    pub segments_deleted: u64,
    /// Disk bytes released.
    pub bytes_freed: u64,
}

#[derive(Debug, Clone)]
struct SegMeta {
    /// File size.
    size: u64,
    data_start: u64,
    /// End of the record area (`data_start` for empty).
    data_end: u64,
    sealed: bool,
    records: u64,
    live_records: u64,
    live_bytes: u64,
    tombstones: u64,
    tombstone_bytes: u64,
    /// Smallest `aux` over the segment's tombstones.
    min_shadow: u32,
    /// Bytes of forgotten records whose blocks were released with a hole punch (they occupy no disk
    /// space, so compaction does not count them as dead space to reclaim).
    punched: u64,
    /// Some record of this segment was superseded by a record still pending in memory
    /// (write-behind): deleting the segment must wait until that record is written.
    superseded_by_pending: bool,
    /// The oldest segment of live keys of this segment whose oldest segment is an older one (a key
    /// overwritten while an older copy of it exists, or a record relocated by compaction), as
    /// (offset, oldest segment), by offset. Their index entries carry `LOC_FIRST`; any other key's
    /// oldest segment is its record's own. (Kept here, not in every index entry: 4 more bytes per
    /// entry would make the index's hash table entries 48 bytes instead of 40.) Entries of records
    /// that died stay until the segment goes.
    firsts: Vec<(u32, u32)>,
    /// A record compaction had to move (a live value, or a needed tombstone) could not be moved,
    /// its bytes being damaged, so the segment stays: compaction leaves it alone from then on (it
    /// would find it sparse and copy its needed tombstones again every time). A damaged live value
    /// keeps the segment by being live; a damaged tombstone by staying counted, while it is needed.
    unmovable: bool,
}

impl SegMeta {
    fn new(size: u64, data_start: u64) -> Self {
        SegMeta {
            size,
            data_start,
            data_end: data_start,
            sealed: false,
            records: 0,
            live_records: 0,
            live_bytes: 0,
            tombstones: 0,
            tombstone_bytes: 0,
            min_shadow: u32::MAX,
            punched: 0,
            superseded_by_pending: false,
            firsts: Vec::new(),
            unmovable: false,
        }
    }
}

/// The oldest segment that may hold a record of the key whose live record `p` is (see
/// [`SegMeta::firsts`]): the tombstone that deletes the key must shadow back to it.
fn first_segment(segs: &BTreeMap<u32, SegMeta>, p: &PackedLoc) -> u32 {
    if !p.first_elsewhere() {
        return p.segment;
    }
    let at = p.offset() as u32;
    let found = segs.get(&p.segment).and_then(|m| {
        let i = m.firsts.binary_search_by_key(&at, |&(o, _)| o).ok()?;
        Some(m.firsts[i].1)
    });
    debug_assert!(found.is_some(), "a LOC_FIRST entry without its segment's note");
    // Without its note (a bug), the oldest segment there can be: a tombstone then shadows too far
    // back, which keeps it longer but never lets an old copy come back.
    found.unwrap_or(0)
}

/// Note that the live record at `offset` of segment `segment` belongs to a key whose oldest
/// segment is `first`; returns whether that is another segment (the index entry's `LOC_FIRST`).
fn note_first_segment(segs: &mut BTreeMap<u32, SegMeta>, segment: u32, offset: u64, first: u32) -> bool {
    if first == segment {
        return false;
    }
    let m = segs.get_mut(&segment).expect("a record's segment has metadata");
    let at = offset as u32;
    match m.firsts.last() {
        Some(&(o, _)) if o >= at => {
            // Not in offset order (never by the writer, which appends): keep the list sorted.
            let i = m.firsts.partition_point(|&(o, _)| o < at);
            if m.firsts.get(i).is_some_and(|&(o, _)| o == at) {
                m.firsts[i].1 = first;
            } else {
                m.firsts.insert(i, (at, first));
            }
        }
        _ => m.firsts.push((at, first)),
    }
    true
}

struct Active<F> {
    id: u32,
    file: Arc<F>,
    size: u64,
    /// Next record offset (64-aligned).
    data_end: u64,
    /// Bytes `[base, data_end)`, where `base` is `written_end` rounded down to the alignment: the
    /// partial block the next write rewrites, and any pending (write-behind) records after it.
    tail: Vec<u8>,
    /// Everything before this offset has been written to the file; records at or after it are pending
    /// in `tail` (write-behind). Equal to `data_end` when nothing is pending.
    written_end: u64,
    footer: Vec<u8>,
    footer_entries: u64,
    max_epoch: u32,
    /// Written since the last fdatasync.
    dirty: bool,
    /// The last record written is a sync mark (another one would prove nothing new).
    last_is_mark: bool,
}

struct WriterState<F> {
    active: Option<Active<F>>,
    segs: BTreeMap<u32, SegMeta>,
    next_segment: u32,
    next_seq: u64,
    epoch: u32,
    /// Segments were created or deleted since the segments directory was last fsync'ed.
    dir_dirty: bool,
    /// Segments were created since then (a subset of `dir_dirty`): a segment must not be unlinked
    /// before their entries are durable (see `delete_segment`).
    dir_new_segments: bool,
    /// A seal made compaction worthwhile; run it at the end of the current append.
    compact_pending: bool,
    /// Compaction is running (its own appends must not start another).
    compacting: bool,
    /// Sealed segments whose footer and trailer are not yet fdatasync'ed (done by the next `sync`).
    unsynced_sealed: Vec<Arc<F>>,
    /// The last write buffer, kept for reuse.
    /// Write buffers kept for reuse (a fresh multi-MiB buffer costs a page fault per 4 KiB).
    spare_bufs: Vec<AlignedBuf>,
}

/// A record ready to be appended.
enum NewRecord<'a> {
    Value {
        key: &'a [u8],
        frames: &'a Frames,
    },
    Tombstone {
        key: &'a [u8],
        aux: u32,
    },
    /// Written by `sync` before the fdatasync (see [`format::FLAG_SYNC_MARK`]).
    SyncMark,
    /// A verified record copied from another segment (compaction): bytes and parsed header.
    Relocated {
        bytes: &'a [u8],
        header: RecordHeader,
        key: &'a [u8],
        /// Where it is copied from (segment, offset): the copy becomes the key's live record only if
        /// the index still points there when it is published (`forget` does not wait for the writer
        /// lock that compaction holds).
        from: (u32, u64),
    },
}

impl NewRecord<'_> {
    fn key(&self) -> &[u8] {
        match self {
            NewRecord::Value { key, .. } | NewRecord::Tombstone { key, .. } | NewRecord::Relocated { key, .. } => key,
            NewRecord::SyncMark => &[],
        }
    }
}

/// The stored form of a value payload: borrowed frames or an owned compressed block.
enum Payload<'a> {
    Frames(&'a Frames),
    Compressed(Vec<u8>),
    Relocated(&'a [u8]),
    Empty,
}

/// Where a record of a chunk was placed, and the header fields its footer entry and index entry
/// keep.
#[derive(Debug, Clone, Copy)]
struct Placed {
    offset: u64,
    /// The header written there.
    h: RecordHeader,
}

impl Placed {
    fn new(offset: u64, h: &RecordHeader) -> Self {
        Placed { offset, h: *h }
    }
}

struct Prepared<'a> {
    rec: NewRecord<'a>,
    payload: Payload<'a>,
    /// Record length where the record was last placed ([`Prepared::place`]), padding included.
    len: u64,
    /// Payload padding where the record was last placed.
    pad: u64,
    /// The head length (without padding) of a value whose payload the writer aligns (see
    /// [`ALIGN_PAYLOAD_MIN`]); 0 for any other record.
    align_head: u64,
}

impl Prepared<'_> {
    /// The most the record can take, wherever it is placed.
    fn max_len(&self) -> u64 {
        let most = if self.align_head > 0 { format::PAYLOAD_PAD_LIMIT - format::FRAME_ALIGN } else { 0 };
        self.len - self.pad + most
    }

    /// Place the record at `pos`: a value whose payload is aligned gets the padding that starts its
    /// payload at a multiple of [`format::PAYLOAD_PAD_LIMIT`].
    fn place(&mut self, pos: u64) {
        if self.align_head > 0 {
            let bare = self.len - self.pad;
            self.pad = format::payload_pad(pos, self.align_head);
            self.len = bare + self.pad;
        }
    }
}

/// The segment log. All methods take `&self` and are safe to call from many threads: writes are
/// serialized by one writer lock; reads only take the index's read lock for a lookup.
pub struct SegmentLog<B: Backend = PortableBackend> {
    backend: B,
    dir: PathBuf,
    seg_dir: PathBuf,
    opts: LogOptions,
    align: u64,
    /// Alignment of single-record reads (the O_DIRECT minimum; divides `align`).
    read_align: u64,
    index: RwLock<KeyMap<IndexKey, PackedLoc>>,
    files: RwLock<KeyMap<u32, Arc<B::File>>>,
    state: Mutex<WriterState<B::File>>,
    /// Records forgotten while the writer lock was busy (a long write, compaction): their index
    /// entries are gone at once;
    /// their space accounting, garbage collection and hole punching wait for the next taker of the
    /// writer lock ([`SegmentLog::writer`]). So `forget` never waits for a write.
    forgotten: Mutex<Vec<Location>>,
    /// `forgotten` is not empty (read without its lock at every writer-lock acquisition).
    any_forgotten: AtomicBool,
    /// Records being sent: not punched when forgotten (see [`SendPin`]).
    sending: SendPins,
    /// Values streaming into segments of their own (`put_stream`), by key: each stream's sequence
    /// number, and whether a newer write of its key (a put, a delete, a forget, a stream begun
    /// later) was published meanwhile, which makes its record dead on arrival.
    streaming: Mutex<Streams>,
    /// `streaming` is not empty (read without its lock wherever a key is written).
    any_streaming: AtomicBool,
    /// Write-behind: `pending_key(segment, written_end)` while records of the active segment at or
    /// after `written_end` are pending in its tail, else `NOTHING_PENDING`. Stored before those records
    /// are published in the index and reset after they are written, so a reader that found a record
    /// in the index and then sees no pending range for it can read it from the file.
    pending: AtomicU64,
    poisoned: OnceLock<String>,
    /// Warnings already logged (`WARN_*` bits), so that a condition that lasts is logged once per
    /// log, not once per call.
    warned: AtomicU64,
    recovery: RecoveryReport,
    /// The log's salt (see [`Salt`]): learned from its segments at open, or drawn for a log without
    /// any; every record head is written and verified with it.
    salt: Salt,
    _lock: DirLock,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The writer lock, held (see [`SegmentLog::writer`]). A panic that unwinds while it is held (a bug
/// in a backend or in the log, part-way through a write) leaves the active segment in a state the
/// log cannot account for: bytes of an unpublished chunk may be in the file, or still in flight,
/// and nothing fenced them off as a failed write is fenced. So the log turns read-only, as after a
/// failed write (`Error::Poisoned` from then on); what it had published stays readable. A panic
/// caught inside the lock (`put_stream`'s reader) is not this: it is settled, and the lock dropped,
/// before the panic goes on.
struct Writer<'a, B: Backend> {
    st: MutexGuard<'a, WriterState<B::File>>,
    log: &'a SegmentLog<B>,
    /// Whether the thread was already unwinding when it took the lock (a drop during a panic):
    /// then a panic seen at the end is not one of this lock's.
    panicking: bool,
}

impl<B: Backend> std::ops::Deref for Writer<'_, B> {
    type Target = WriterState<B::File>;
    fn deref(&self) -> &Self::Target {
        &self.st
    }
}

impl<B: Backend> std::ops::DerefMut for Writer<'_, B> {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.st
    }
}

impl<B: Backend> Drop for Writer<'_, B> {
    fn drop(&mut self) {
        if !self.panicking && std::thread::panicking() {
            let e = io::Error::other("it panicked part-way (a bug in the backend or the log)");
            self.log.poison(Error::io("write", None, e));
        }
    }
}

fn seg_file_name(id: u32) -> String {
    format!("{id:08x}.seg")
}

fn parse_seg_file_name(name: &str) -> Option<u32> {
    let hex = name.strip_suffix(".seg")?;
    if hex.len() != 8 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u32::from_str_radix(hex, 16).ok()
}

/// Length of `frames` laid out at [`format::FRAME_ALIGN`] boundaries (the uncompressed payload).
fn laid_out_len(frames: &Frames) -> u64 {
    format::frame_layout(frames.iter().map(|f| f.len() as u64)).map_or(u64::MAX, |(_, n)| n)
}

fn padded(len: u64) -> u64 {
    align_up(len, RECORD_ALIGN)
}

/// Everything recovery learns from one segment.
struct SegmentScan {
    meta: SegMeta,
    entries: Vec<FooterEntry>,
    max_epoch: u32,
    /// For unsealed segments: bytes of the last partial block before `data_end`.
    tail: Vec<u8>,
    /// The end of a torn or garbage tail cut off at `data_end` (its bytes are still in the file).
    cut: Option<u64>,
    /// The last record kept is a sync mark (a `sync` then needs no new one, only an fdatasync).
    ends_with_mark: bool,
    /// Damaged records that no sync mark follows were dropped (see `scan_segment`), not cut: they
    /// lie before `data_end`.
    dropped_unsynced: bool,
    /// Its header decoded (with the log's salt). Records written after a damaged one could not be
    /// verified by a later open that draws a fresh salt, so such a segment is never continued.
    header_ok: bool,
    /// Its header block is all zeros and nothing follows it: a segment whose creation a crash cut
    /// short before the header was written. Not damage, and nothing in it (see `recover`).
    never_written: bool,
}

impl<B: Backend> SegmentLog<B> {
    /// Open (and recover) the log in `dir`, creating it if allowed.
    pub fn open(backend: B, dir: impl AsRef<Path>, opts: LogOptions) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let seg_dir = dir.join(SEGMENTS_DIR);
        if !backend.is_dir(&seg_dir) {
            if !opts.create_if_missing {
                let reason = if backend.is_dir(&dir) {
                    "no segments directory".to_string()
                } else {
                    "no such directory".to_string()
                };
                return Err(Error::NotAStore { path: dir, reason });
            }
            backend.create_dir_all(&seg_dir).map_err(|e| Error::io("create store directory", seg_dir.clone(), e))?;
            // Make the new directories themselves durable.
            backend.sync_dir(&dir).map_err(|e| Error::io("fsync directory", dir.clone(), e))?;
        }
        let lock = backend.lock_dir(&dir).map_err(|e| {
            if e.kind() == io::ErrorKind::WouldBlock {
                Error::Locked { path: dir.clone() }
            } else {
                Error::io("lock store directory", dir.clone(), e)
            }
        })?;
        if opts.discard_existing {
            // A spill store's data died with its process: drop it unread (its records may have been
            // hole-punched, so recovering them would only report damage). Only segment files: anything
            // else in the directory is not ours to delete (recovery ignores it the same way), and its name
            // may not even be UTF-8, so the name `list_dir` gives may not open.
            let names = backend.list_dir(&seg_dir).map_err(|e| Error::io("list segments", seg_dir.clone(), e))?;
            for name in names {
                if parse_seg_file_name(&name).is_none() {
                    log::warn!("ignoring unexpected file {:?} in {}", name, seg_dir.display());
                    continue;
                }
                let path = seg_dir.join(name);
                backend.remove_file(&path).map_err(|e| Error::io("remove segment", path, e))?;
            }
        }
        let align = match opts.alignment {
            Some(a) if a.is_power_of_two() && (512..=65536).contains(&a) => a as u64,
            Some(a) => return Err(Error::InvalidConfig(format!("alignment {a} is not a power of two in 512..=65536"))),
            None => backend.alignment(&dir).clamp(512, 65536) as u64,
        };
        let read_align = (backend.read_alignment(&dir).clamp(format::FRAME_ALIGN as usize, 65536) as u64).min(align);
        if opts.segment_bytes > MAX_SEGMENT_BYTES || opts.max_value_bytes > MAX_VALUE_BYTES {
            return Err(Error::InvalidConfig(format!(
                "segment_bytes {} and max_value_bytes {} must be at most {MAX_SEGMENT_BYTES} and {MAX_VALUE_BYTES}",
                opts.segment_bytes, opts.max_value_bytes
            )));
        }
        if opts.write_behind_bytes > MAX_WRITE_BEHIND_BYTES {
            return Err(Error::InvalidConfig(format!(
                "write_behind_bytes {} is above the maximum {MAX_WRITE_BEHIND_BYTES}",
                opts.write_behind_bytes
            )));
        }
        if opts.segment_bytes < MIN_SEGMENT_BYTES {
            return Err(Error::InvalidConfig(format!(
                "segment_bytes {} is below the minimum {MIN_SEGMENT_BYTES}",
                opts.segment_bytes
            )));
        }
        let mut opts = opts;
        opts.segment_bytes = align_up(opts.segment_bytes, align);

        let mut log = SegmentLog {
            backend,
            dir,
            seg_dir,
            opts,
            align,
            read_align,
            index: RwLock::new(KeyMap::default()),
            files: RwLock::new(KeyMap::default()),
            state: Mutex::new(WriterState {
                active: None,
                segs: BTreeMap::new(),
                next_segment: 1,
                next_seq: 1,
                epoch: 1,
                dir_dirty: false,
                dir_new_segments: false,
                compact_pending: false,
                compacting: false,
                unsynced_sealed: Vec::new(),
                spare_bufs: Vec::new(),
            }),
            forgotten: Mutex::new(Vec::new()),
            any_forgotten: AtomicBool::new(false),
            sending: Arc::new(Mutex::new(HashMap::new())),
            streaming: Mutex::new(HashMap::new()),
            any_streaming: AtomicBool::new(false),
            pending: AtomicU64::new(NOTHING_PENDING),
            poisoned: OnceLock::new(),
            warned: AtomicU64::new(0),
            recovery: RecoveryReport::default(),
            salt: Salt(0),
            _lock: lock,
        };
        log.recover()?;
        Ok(log)
    }

    /// The store directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The backend in use.
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// I/O alignment in use.
    pub fn alignment(&self) -> u64 {
        self.align
    }

    /// The options in force (segment size rounded to the alignment).
    pub fn options(&self) -> &LogOptions {
        &self.opts
    }

    /// Why the log refuses writes, if an earlier write or fdatasync failed (every write then fails
    /// with [`Error::Poisoned`]; reads go on, and reopening recovers what was acknowledged). `None`
    /// while it is writable.
    pub fn poisoned(&self) -> Option<&str> {
        self.poisoned.get().map(String::as_str)
    }

    /// What recovery found at open.
    pub fn recovery_report(&self) -> &RecoveryReport {
        &self.recovery
    }

    fn seg_path(&self, id: u32) -> PathBuf {
        self.seg_dir.join(seg_file_name(id))
    }

    // -----------------------------------------------------------------------------------------------
    // Recovery
    // -----------------------------------------------------------------------------------------------

    fn recover(&mut self) -> Result<()> {
        let names =
            self.backend.list_dir(&self.seg_dir).map_err(|e| Error::io("list segments", self.seg_dir.clone(), e))?;
        let mut ids: Vec<u32> = Vec::new();
        for name in &names {
            match parse_seg_file_name(name) {
                Some(id) => ids.push(id),
                None => log::warn!("ignoring unexpected file {:?} in {}", name, self.seg_dir.display()),
            }
        }
        ids.sort_unstable();

        let mut report = RecoveryReport::default();
        let mut opened = Vec::with_capacity(ids.len());
        for &id in &ids {
            let path = self.seg_path(id);
            if self.backend.is_dir(&path) {
                // Named like a segment, but the log never makes directories: not one of its files,
                // left alone like any other stray name.
                log::warn!("{} is a directory, not a segment; leaving it alone", path.display());
                report.corrupt.push((id, 0, "a directory named like a segment; left alone".into()));
                continue;
            }
            // A segment file that cannot be opened fails the open. Skipping it would be worse than
            // not opening: its records would not count towards the next sequence number (so new
            // records could reuse its seqs, and lose to its older ones once it is readable again),
            // its tombstones would not delete (their keys' older values come back), and its keys
            // would read as absent or as older values.
            let file = self.backend.open(&path, false).map_err(|e| Error::io("open segment", path.clone(), e))?;
            opened.push((id, file));
        }
        let salt_learned;
        (self.salt, salt_learned) = self.learn_salt(&opened)?;
        let mut scans: BTreeMap<u32, SegmentScan> = BTreeMap::new();
        let mut max_epoch = 0u32;
        let mut files = KeyMap::default();
        for (id, file) in opened {
            let mut scan = self.load_segment(id, &file, &mut report)?;
            // The index holds offsets and lengths in 32 bits. A segment may be a little over 4 GiB (a
            // jumbo segment, whose one record starts at its start), so a record further in, or
            // longer, is one no writer made: damage, not an entry whose offset would wrap.
            let before = scan.entries.len();
            scan.entries.retain(|e| {
                let addressable = e.offset <= u32::MAX as u64 && e.record_len <= MAX_RECORD_BYTES;
                if !addressable {
                    report.corrupt.push((id, e.offset, "a record beyond what the index addresses (32 bits)".into()));
                }
                addressable
            });
            if scan.entries.len() != before {
                scan.meta.records = scan.entries.len() as u64;
            }
            max_epoch = max_epoch.max(scan.max_epoch);
            files.insert(id, Arc::new(file));
            scans.insert(id, scan);
        }
        // A newest segment that a crash left before its header was written holds nothing: it goes
        // (new records go to a new segment, whose header holds the salt). Its id is not reused.
        if let Some((&last, scan)) = scans.iter().next_back() {
            if scan.never_written {
                let path = self.seg_path(last);
                files.remove(&last);
                scans.remove(&last);
                match self.backend.remove_file(&path) {
                    Ok(()) => log::info!("removed {}: its creation never wrote its header", path.display()),
                    Err(e) => log::warn!("could not remove {}, whose header was never written: {e}", path.display()),
                }
            }
        }

        // Newest record (highest seq) per key wins; remember the oldest segment each key appears in.
        struct Winner {
            seq: u64,
            segment: u32,
            offset: u64,
            len: u64,
            tombstone: bool,
            facts: RecordFacts,
            first_segment: u32,
        }
        let mut winners: HashMap<&[u8], Winner> = HashMap::new();
        let mut max_seq = 0u64;
        for (&id, scan) in &scans {
            for e in &scan.entries {
                max_seq = max_seq.max(e.seq);
                report.records += 1;
                let cand = Winner {
                    seq: e.seq,
                    segment: id,
                    offset: e.offset,
                    len: e.record_len,
                    tombstone: e.flags & format::FLAG_TOMBSTONE != 0,
                    facts: RecordFacts::of_entry(e),
                    first_segment: id,
                };
                match winners.get_mut(e.key.as_slice()) {
                    Some(w) => {
                        let first = w.first_segment.min(id);
                        if e.seq > w.seq {
                            *w = cand;
                        }
                        w.first_segment = first;
                    }
                    None => {
                        winners.insert(e.key.as_slice(), cand);
                    }
                }
            }
        }

        let mut segs: BTreeMap<u32, SegMeta> = scans.iter().map(|(&id, s)| (id, s.meta.clone())).collect();
        let mut index = KeyMap::with_capacity_and_hasher(winners.len(), KeyHasher::default());
        for (key, w) in winners {
            if w.tombstone {
                continue;
            }
            let m = segs.get_mut(&w.segment).expect("winner segment was scanned");
            m.live_records += 1;
            m.live_bytes += padded(w.len);
            let elsewhere = w.first_segment != w.segment;
            if elsewhere {
                m.firsts.push((w.offset as u32, w.first_segment));
            }
            let loc = Location { segment: w.segment, offset: w.offset, len: w.len };
            index.insert(IndexKey::from(key), PackedLoc::new(loc, w.facts, elsewhere));
        }
        for m in segs.values_mut() {
            m.firsts.sort_unstable();
        }
        for (&id, scan) in &scans {
            let m = segs.get_mut(&id).expect("scanned");
            for e in scan.entries.iter().filter(|e| e.flags & format::FLAG_TOMBSTONE != 0) {
                m.tombstones += 1;
                m.tombstone_bytes += padded(e.record_len);
                m.min_shadow = m.min_shadow.min(e.aux);
            }
        }

        // The newest segment continues as the active one if it is unsealed.
        let mut active = None;
        let mut unsynced_closed = Vec::new();
        if let Some((&last, scan)) = scans.iter_mut().next_back() {
            let meta = segs.get(&last).expect("scanned");
            let footer_len: u64 = scan.entries.iter().map(|e| FooterEntry::encoded_len(e.key.len())).sum();
            // Sealing needs room for the footer and the trailer after the records (`seal_active`).
            // The writer keeps that room at every record (`fits`), but records with valid checksums
            // from elsewhere (a crafted file) need not have left it.
            let footer_fits = align_up(meta.data_end, self.align)
                .checked_add(footer_len + format::TRAILER_LEN as u64)
                .is_some_and(|end| end <= meta.size);
            // With a salt drawn fresh, what the scan cut may be records of a lost salt (every header
            // that held it damaged): left as they are, not erased and not written over.
            let unverifiable = !salt_learned && scan.cut.is_some();
            if !meta.sealed && (scan.dropped_unsynced || !footer_fits || unverifiable || !scan.header_ok) {
                // Writing goes on in a new segment. After a dropped record, so that this one's bytes,
                // and with them what the scan decided, stay as they are: a sync mark written after a
                // dropped record would make the next scan take it for synced damage, and it would
                // hide its key's value again. Without room for the footer, because it cannot be
                // sealed. The segment stays unsealed behind the active one (as after a crash during
                // sealing): readable, compacted and deleted like any other.
                log::warn!(
                    "segment {last} of {}: {}; new records go to a new segment",
                    self.dir.display(),
                    if unverifiable {
                        "no segment header or trailer holds the log's salt, and the segment holds bytes that \
                         may be records under it (left as they are)"
                    } else if !scan.header_ok {
                        "its header is damaged (records after it would not be verifiable once no other \
                         segment holds the log's salt)"
                    } else if footer_fits {
                        "a damaged record no sync followed was dropped"
                    } else {
                        "no room for its footer"
                    }
                );
                if self.opts.durable {
                    // What was recovered from it may be in the page cache only: the next `sync`
                    // fdatasyncs it, as it would the active segment.
                    unsynced_closed.push(files.get(&last).expect("opened").clone());
                }
            } else if !meta.sealed {
                let file = files.get(&last).expect("opened").clone();
                if let (Some(cut_end), true) = (scan.cut, self.opts.durable) {
                    let end = align_up(cut_end, self.align).min(meta.size);
                    self.erase_durably(&file, last, meta.data_end, &scan.tail, end)?;
                }
                let mut footer = Vec::new();
                for e in &scan.entries {
                    format::encode_footer_entry(&mut footer, e);
                }
                active = Some(Active {
                    id: last,
                    file,
                    size: meta.size,
                    data_end: meta.data_end,
                    tail: std::mem::take(&mut scan.tail),
                    written_end: meta.data_end,
                    footer,
                    footer_entries: scan.entries.len() as u64,
                    max_epoch: scan.max_epoch,
                    // Its records may be in the page cache only (a process crash, or a close without
                    // `sync`): the next sync or seal must fdatasync it.
                    dirty: self.opts.durable,
                    last_is_mark: scan.ends_with_mark,
                });
            }
        }

        *self.index.get_mut().unwrap_or_else(|p| p.into_inner()) = index;
        *self.files.get_mut().unwrap_or_else(|p| p.into_inner()) = files;
        let st = self.state.get_mut().unwrap_or_else(|p| p.into_inner());
        st.next_segment = ids.last().map_or(1, |l| l.saturating_add(1));
        // A record's seq or epoch at (or near) its maximum leaves no higher one for new records to win
        // with: such a log opens read-only, its values readable. A writer of this log never gets
        // there (2^63 writes; 2^32 opens and failed writes), so it is damage that passed the
        // checksums, and no reason to refuse the values that are there.
        let (next_seq, epoch) = (max_seq.checked_add(1).filter(|&s| s <= SEQ_LIMIT), max_epoch.checked_add(1));
        st.next_seq = next_seq.unwrap_or(SEQ_LIMIT);
        st.epoch = epoch.unwrap_or(u32::MAX);
        if next_seq.is_none() || epoch.is_none() {
            let what =
                if next_seq.is_none() { format!("sequence number {max_seq}") } else { format!("epoch {max_epoch}") };
            let reason = format!(
                "a record of {} holds {what}, which leaves no higher one for new records: the log is \
                 read-only (copy its values into a new log to write again)",
                self.dir.display()
            );
            log::error!("{reason}");
            let _ = self.poisoned.set(reason);
        }
        st.segs = segs;
        st.active = active;
        st.unsynced_sealed = unsynced_closed;
        // The directory entries of the segments found may be unsynced too (a crash before the first
        // `sync`): a durable log's first sync fsyncs the directory once.
        st.dir_dirty = self.opts.durable && !ids.is_empty();
        st.dir_new_segments = st.dir_dirty;
        if !report.corrupt.is_empty() {
            log::warn!("recovery of {} found {} damaged region(s)", self.dir.display(), report.corrupt.len());
        }
        self.recovery = report;
        Ok(())
    }

    /// The log's salt: the one in the newest segment header that decodes or, if no header does, in
    /// the newest trailer that does; a fresh one for a log that has neither (a new log, or one whose
    /// only segment's header never landed: a crash before the first `sync`, which is the first
    /// fdatasync of a segment's header, so none of its records was acknowledged). A segment whose
    /// header or trailer holds another salt belongs to another log: the open fails on it
    /// ([`Self::load_segment`]).
    /// Also returns whether the salt was learned (false: drawn fresh).
    fn learn_salt(&self, segments: &[(u32, B::File)]) -> Result<(Salt, bool)> {
        let mut trailer_salt = None;
        for (id, file) in segments.iter().rev() {
            let path = self.seg_path(*id);
            let len = self.backend.file_len(file).map_err(|e| Error::io("stat segment", path.clone(), e))?;
            let len = align_down(len, self.align);
            if len < self.align {
                continue;
            }
            let head = self.read_aligned(file, 0, self.align as usize, &path)?;
            if let Ok(h) = format::decode_segment_header(&head) {
                if h.segment == *id {
                    return Ok((h.salt, true));
                }
            }
            if trailer_salt.is_none() && len >= 2 * self.align {
                let last = self.read_aligned(file, len - self.align, self.align as usize, &path)?;
                if let Ok(t) = format::decode_trailer(&last[self.align as usize - format::TRAILER_LEN..], *id, len) {
                    trailer_salt = Some(t.salt);
                }
            }
        }
        Ok(match trailer_salt {
            Some(salt) => (salt, true),
            None => (Salt::random(self.dir.as_os_str().as_encoded_bytes()), false),
        })
    }

    /// The error for a segment whose header or trailer holds a salt other than the log's.
    fn foreign_segment(&self, id: u32, what: &str) -> Error {
        Error::Corrupt {
            segment: id,
            offset: 0,
            reason: format!(
                "its {what} holds another salt than the newest segment's header: segments of different \
                 logs are in {} (move the other log's out to open this one)",
                self.seg_dir.display()
            ),
        }
    }

    /// Read a segment's footer if it is sealed, or scan its records if not.
    fn load_segment(&self, id: u32, file: &B::File, report: &mut RecoveryReport) -> Result<SegmentScan> {
        let path = self.seg_path(id);
        let file_len = self.backend.file_len(file).map_err(|e| Error::io("stat segment", path.clone(), e))?;
        let file_len_aligned = align_down(file_len, self.align);
        // The header tells size, alignment and where data starts; fall back to defaults if damaged.
        let mut zero_header = None; // an all-zero header block's decode error, reported after the scan
        let header = if file_len_aligned >= self.align {
            let buf = self.read_aligned(file, 0, self.align as usize, &path)?;
            match format::decode_segment_header(&buf) {
                Ok(h) if h.segment == id && h.salt != self.salt => return Err(self.foreign_segment(id, "header")),
                Ok(h) if h.segment == id => Some(h),
                Ok(_) => {
                    report.corrupt.push((id, 0, "segment header names another segment".into()));
                    None
                }
                Err(format::DecodeError::UnsupportedVersion(v)) => {
                    return Err(Error::UnsupportedVersion {
                        what: "segment",
                        found: v,
                        supported: format::FORMAT_VERSION as u32,
                    })
                }
                Err(e) if buf.iter().all(|&b| b == 0) => {
                    zero_header = Some(e);
                    None
                }
                Err(e) => {
                    report.corrupt.push((id, 0, format!("segment header: {e:?}")));
                    None
                }
            }
        } else {
            None
        };
        let fallback = (align_up(file_len, self.align).max(self.align * 2), self.align);
        let (size, data_start) = match header {
            Some(h)
                if h.segment_bytes % self.align == 0
                    && h.data_start % RECORD_ALIGN == 0
                    && h.data_start < h.segment_bytes
                    // Bounded by what the writer makes: the file is extended to this size below,
                    // and a crc-valid header (a crafted one) must not have that ask for exabytes.
                    && h.segment_bytes <= MAX_SEGMENT_FILE_BYTES =>
            {
                (h.segment_bytes, h.data_start)
            }
            Some(h) => {
                report.corrupt.push((
                    id,
                    0,
                    format!(
                        "segment header: impossible geometry (segment_bytes {}, data_start {}, alignment {})",
                        h.segment_bytes, h.data_start, self.align
                    ),
                ));
                fallback
            }
            None => fallback,
        };
        let sealed_candidate = file_len >= size;
        if file_len < size {
            // A truncated file, or a crash during preallocation: give it its size back so every
            // aligned read inside the segment succeeds (the lost part reads as zeros).
            self.backend.allocate(file, size).map_err(|e| Error::io("fallocate", path.clone(), e))?;
        }

        // Sealed? The trailer is the last TRAILER_LEN bytes of the file.
        if sealed_candidate {
            let last_block = self.read_aligned(file, size - self.align, self.align as usize, &path)?;
            let tb = &last_block[self.align as usize - format::TRAILER_LEN..];
            if let Ok(t) = format::decode_trailer(tb, id, size) {
                if t.salt != self.salt {
                    return Err(self.foreign_segment(id, "trailer"));
                }
                if let Some(entries) = self.read_footer(file, id, size, &t, &path)? {
                    let mut meta = SegMeta::new(size, data_start);
                    meta.data_end = t.data_end;
                    meta.sealed = true;
                    meta.records = entries.len() as u64;
                    report.sealed_segments += 1;
                    return Ok(SegmentScan {
                        meta,
                        entries,
                        max_epoch: t.max_epoch,
                        tail: Vec::new(),
                        cut: None,
                        ends_with_mark: false,
                        dropped_unsynced: false,
                        header_ok: header.is_some(),
                        never_written: false,
                    });
                }
                report.corrupt.push((id, t.footer_offset, "footer checksum mismatch; scanning records".into()));
            }
        }
        report.scanned_segments += 1;
        let mut scan = self.scan_segment(id, file, size, data_start, report)?;
        scan.header_ok = header.is_some();
        if let Some(e) = zero_header {
            if scan.entries.is_empty() && scan.cut.is_none() {
                scan.never_written = true;
            } else {
                report.corrupt.push((id, 0, format!("segment header: {e:?} (all zeros, before records)")));
            }
        }
        Ok(scan)
    }

    fn read_footer(
        &self,
        file: &B::File,
        id: u32,
        size: u64,
        t: &format::Trailer,
        path: &Path,
    ) -> Result<Option<Vec<FooterEntry>>> {
        let start = align_down(t.footer_offset, self.align);
        let end = align_up(t.footer_offset + t.footer_len, self.align);
        let buf = self.read_aligned(file, start, (end - start) as usize, path)?;
        let fb = &buf[(t.footer_offset - start) as usize..(t.footer_offset - start + t.footer_len) as usize];
        if format::footer_crc(fb) != t.footer_crc {
            return Ok(None);
        }
        match format::decode_footer(fb, t.entry_count, size) {
            // A tombstone's `aux` is at most its own segment (see `format::peek_record_header`); a
            // footer saying otherwise is not trusted (the scan checks each record on its own).
            Ok(e) if e.iter().any(|e| e.flags & format::FLAG_TOMBSTONE != 0 && e.aux > id) => {
                log::warn!("segment {id}: footer lists a tombstone shadowing a later segment; scanning");
                Ok(None)
            }
            Ok(e) => Ok(Some(e)),
            Err(err) => {
                log::warn!("segment {id}: footer passes its checksum but does not decode ({err:?}); scanning");
                Ok(None)
            }
        }
    }

    /// Zero `data_end..end` of a segment that writing continues in (what recovery cut off as a torn
    /// tail, or what a failed write left past the end; `tail` holds the bytes of the block before
    /// `data_end`), and sync it, before anything new is written there. The epoch rule rejects a stale
    /// record only after a newer one: a stale record *at* the published end (the head of a torn
    /// write, say) would, after a power cut that kept later pages of the next write but not its
    /// first, be taken for a damaged record in the middle of the log, and win over its key's synced
    /// value. Only durable logs do this (it runs only after a crash or a failed write). A failed sync
    /// is an error (an fdatasync is never retried); a failed erase only a warning.
    fn erase_durably(&self, file: &B::File, id: u32, data_end: u64, tail: &[u8], end: u64) -> Result<()> {
        if end <= data_end {
            return Ok(());
        }
        if let Err(e) = self.erase_aborted(file, data_end - tail.len() as u64, tail, end) {
            log::warn!("segment {id}: could not erase bytes {data_end}..{end} past the end of its records: {e}");
            return Ok(());
        }
        self.backend.sync_data(file).map_err(|e| Error::io("sync segment", self.seg_path(id), e))
    }

    /// Walk the records of an unsealed segment from `data_start`, verifying each. A region that does
    /// not parse is skipped by searching for the next valid record header of this segment and epoch;
    /// if none follows, the region is a torn tail and the segment ends there.
    fn scan_segment(
        &self,
        id: u32,
        file: &B::File,
        size: u64,
        data_start: u64,
        report: &mut RecoveryReport,
    ) -> Result<SegmentScan> {
        let path = self.seg_path(id);
        let mut win = ScanWindow::new(self, file, &path, size);
        let mut entries = Vec::new();
        let mut intact_flags = Vec::new();
        let mut corrupt = Vec::new();
        let mut pos = data_start;
        let mut prev_epoch = 0u32;
        let mut max_epoch_any = 0u32;
        let mut marks = None; // where this segment's sync marks are, once a search needs them
                              // The end of what is cut off as a torn tail, if anything is.
        let mut cut_end = 0u64;
        loop {
            match self.try_record_at(&mut win, id, pos, prev_epoch, true)? {
                Probe::Record(e, h, intact) => {
                    if !intact {
                        corrupt.push((id, pos, "record payload checksum mismatch".to_string()));
                    }
                    intact_flags.push(intact);
                    prev_epoch = h.epoch;
                    max_epoch_any = max_epoch_any.max(h.epoch);
                    pos = padded(pos + e.record_len);
                    entries.push(e);
                }
                Probe::Invalid { stale_epoch } => {
                    max_epoch_any = max_epoch_any.max(stale_epoch);
                    if win.is_zero_from(pos)? {
                        // The end of the written area, unless a write left records beyond a zero
                        // gap: its earlier part never landed (an earlier group of a batch failed, or
                        // the process died with groups in flight), so they were never acknowledged.
                        // They are cut, and their epochs counted, so that the next life's epoch is
                        // higher and a later scan never takes them for records of its own (with an
                        // equal epoch and higher sequence numbers they would win over newer values).
                        //
                        // Unless a sync mark lies beyond: then the zeros are damage to records that
                        // were written and synced (a zeroed range of the file), not an end. A sync
                        // mark is only ever written at the end of the published records, and a
                        // failed batch's orphans never have one after them: `sync` refuses to run on
                        // a poisoned log, and after a failed write that left the log writable the
                        // next records (and marks) go to the published end, in front of the orphans,
                        // with a higher epoch. So the gap is reported and the scan goes on with the
                        // first acceptable record after it.
                        let clean = align_up(pos + 1, self.align).min(win.limit);
                        match self.search_past_clean_end(
                            &mut win,
                            id,
                            pos,
                            prev_epoch,
                            &mut max_epoch_any,
                            &mut marks,
                        )? {
                            PastEnd::Synced { next } => {
                                corrupt.push((
                                    id,
                                    pos,
                                    format!("zeroed bytes up to offset {next}, before synced records"),
                                ));
                                pos = next;
                                continue;
                            }
                            PastEnd::Orphans { end } => {
                                if end > clean {
                                    report.truncated_bytes += end - pos;
                                    cut_end = cut_end.max(end);
                                }
                            }
                        }
                        break;
                    }
                    // Garbage: search the rest of the segment for the next record.
                    match self.resync(&mut win, id, pos, prev_epoch, &mut max_epoch_any)? {
                        Resync::Record(next) => {
                            corrupt.push((id, pos, format!("unreadable bytes up to offset {next}")));
                            pos = next;
                        }
                        Resync::Garbage { end } => {
                            report.truncated_bytes += end.saturating_sub(pos);
                            cut_end = cut_end.max(end);
                            break;
                        }
                    }
                }
            }
        }
        // A damaged record with nothing valid after it is the torn end of the last write, not a bit
        // flip in the middle of the log: cut it off like the rest of the tail.
        while intact_flags.last() == Some(&false) {
            intact_flags.pop();
            let e = entries.pop().expect("one entry per flag");
            cut_end = cut_end.max(pos);
            report.truncated_bytes += pos - e.offset;
            pos = e.offset;
            corrupt.retain(|c| c.1 != e.offset);
        }
        // A damaged record with valid records after it, but no sync mark, was never synced either,
        // and is dropped (the torn record of a batch whose later group of writes landed, or that a
        // power cut or a SIGKILL with io_uring writes in flight cut short). Kept, it had the highest
        // seq of its key and hid the key's synced value behind a checksum error.
        //
        // The rule: a record is acknowledged as durable only by a `sync` that returned, and `sync`
        // writes a sync mark after the records it covers (before its fdatasync). So a damaged record
        // that a mark follows was synced, and its damage is decay of stored data: it stays, and
        // reading its key reports the damage (an older value would be silently stale). One that no
        // mark follows was never synced: its damage is what a write that did not complete leaves,
        // and its key falls back to its previous version, as if that write had never started
        // (intact records after it stay: each key reads as its old or its new value). This holds for
        // non-durable logs too: they fdatasync only in `sync`, which writes its mark all the same.
        // Sealing also fdatasyncs (in a durable log), without a mark, but a sealed segment is read
        // through its footer; only if its footer and trailer are lost as well is a damaged record
        // of its last, unmarked part taken for an unsynced one.
        //
        // Not covered: the mark is written before the fdatasync, so a power cut during it (or the
        // kernel's own writeback before it) can keep the mark's block and lose an earlier one. The
        // records there were not acknowledged, yet their damage counts as synced: their keys read as
        // checksum errors (not as other bytes) until they are written again.
        let last_mark = entries.iter().rposition(|e| e.flags & format::FLAG_SYNC_MARK != 0);
        let unsynced_from = last_mark.map_or(0, |i| i + 1);
        let dropped: Vec<u64> = entries[unsynced_from..]
            .iter()
            .zip(&intact_flags[unsynced_from..])
            .filter(|(_, &intact)| !intact)
            .map(|(e, _)| e.offset)
            .collect();
        if !dropped.is_empty() {
            entries.retain(|e| !dropped.contains(&e.offset));
            for c in corrupt.iter_mut().filter(|c| dropped.contains(&c.1)) {
                c.2 = "record payload checksum mismatch in a record no sync followed; dropped (its key keeps \
                       its previous value)"
                    .to_string();
            }
        }
        report.corrupt.extend(corrupt);
        let ends_with_mark = entries.last().is_some_and(|e| e.flags & format::FLAG_SYNC_MARK != 0);
        entries.retain(|e| e.flags & format::FLAG_SYNC_MARK == 0);
        let mut meta = SegMeta::new(size, data_start);
        meta.data_end = pos;
        meta.records = entries.len() as u64;
        let tail_start = align_down(pos, self.align);
        let tail = if pos > tail_start { win.bytes(tail_start, pos - tail_start)?.to_vec() } else { Vec::new() };
        let cut = (cut_end > pos).then_some(cut_end);
        let dropped_unsynced = !dropped.is_empty();
        // (`header_ok` and `never_written` are `load_segment`'s, which read the header.)
        let (header_ok, never_written) = (true, false);
        Ok(SegmentScan {
            meta,
            entries,
            max_epoch: max_epoch_any,
            tail,
            cut,
            ends_with_mark,
            dropped_unsynced,
            header_ok,
            never_written,
        })
    }

    /// The record at `pos`, if its head is valid. With `payload`, whether its payload is intact is
    /// checked (a crc over it); without, it is reported intact: for searches that only need to know
    /// where records are, so that a search costs the heads it looks at, not the payloads they claim.
    fn try_record_at(
        &self,
        win: &mut ScanWindow<'_, B>,
        id: u32,
        pos: u64,
        prev_epoch: u32,
        payload: bool,
    ) -> Result<Probe> {
        let invalid = Probe::Invalid { stale_epoch: 0 };
        if pos + format::RECORD_HEADER_LEN as u64 > win.limit {
            return Ok(invalid);
        }
        let head = win.bytes(pos, format::RECORD_HEADER_LEN as u64)?;
        let h = match format::peek_record_header(head) {
            Ok(h) => h,
            Err(_) => return Ok(invalid),
        };
        let len = h.record_len();
        if pos.checked_add(len).is_none_or(|end| end > win.limit) {
            return Ok(invalid);
        }
        let head_len = h.payload_offset();
        let head = win.bytes(pos, head_len)?;
        if format::verify_record_head(head, &h, self.salt).is_err() {
            return Ok(invalid);
        }
        let key = head[h.key_offset()..h.key_offset() + h.key_len as usize].to_vec();
        if h.segment != id || h.epoch < prev_epoch {
            // A valid record, but from an earlier life of this file or from before a torn tail was cut.
            // (Sequence numbers are not monotonic along a segment: compaction keeps a record's seq.)
            return Ok(Probe::Invalid { stale_epoch: h.epoch });
        }
        let intact = !payload || win.crc_of(pos + head_len, h.stored_len)? == h.payload_crc;
        let e = FooterEntry {
            key,
            flags: h.flags,
            frame_count: h.frame_count,
            payload_crc: h.payload_crc,
            offset: pos,
            record_len: len,
            seq: h.seq,
            aux: h.aux,
        };
        Ok(Probe::Record(e, h, intact))
    }

    /// Search for the next acceptable record after unparseable bytes at `from`, to the end of the
    /// segment. All-zero blocks are skipped, not taken for the end: a value may hold whole blocks of
    /// zeros (a zero-filled array, a punched hole), and a damaged head in front of one must not cost
    /// the records behind it. If nothing acceptable follows, the garbage ends with the last block
    /// that is not all zero: that much is cut (and, in a durable log, erased).
    fn resync(
        &self,
        win: &mut ScanWindow<'_, B>,
        id: u32,
        from: u64,
        prev_epoch: u32,
        max_epoch_any: &mut u32,
    ) -> Result<Resync> {
        let mut garbage_end = align_up(from + 1, self.align).min(win.limit);
        let mut pos = from + RECORD_ALIGN;
        while pos + format::RECORD_HEADER_LEN as u64 <= win.limit {
            if pos % self.align == 0 {
                if win.is_zero_block(pos)? {
                    pos += self.align; // no record starts inside a zero block
                    continue;
                }
                garbage_end = garbage_end.max((pos + self.align).min(win.limit));
            }
            if win.bytes(pos, 4)? == b"SPRC" {
                match self.try_record_at(win, id, pos, prev_epoch, false)? {
                    Probe::Record(..) => return Ok(Resync::Record(pos)),
                    Probe::Invalid { stale_epoch } => *max_epoch_any = (*max_epoch_any).max(stale_epoch),
                }
            }
            pos += RECORD_ALIGN;
        }
        Ok(Resync::Garbage { end: garbage_end })
    }

    /// Search the rest of the segment after a clean end at `from` (zeros to the end of the next
    /// whole block). If an acceptable sync mark (this segment, epoch at least `prev_epoch`) lies
    /// beyond, the zeros were damage: returns the first acceptable record after them. Otherwise
    /// everything beyond is an orphan of a batch that never completed: returns the end of the last
    /// block that is not all zero (what is cut). The epochs of all records seen are counted.
    ///
    /// Where the sync marks are is learned once per segment (`marks`, by the first search); each
    /// search then only walks to the first record after its zeros. Walking to the next sync mark
    /// each time cost a full pass per zeroed region of a segment with one sync mark at its end.
    fn search_past_clean_end(
        &self,
        win: &mut ScanWindow<'_, B>,
        id: u32,
        from: u64,
        prev_epoch: u32,
        max_epoch_any: &mut u32,
        marks: &mut Option<SyncMarks>,
    ) -> Result<PastEnd> {
        if marks.is_none() {
            *marks = Some(self.find_sync_marks(win, id, from)?);
        }
        let synced = marks.as_ref().is_some_and(|m| m.acceptable_beyond(from, prev_epoch));
        let mut garbage_end = align_up(from + 1, self.align).min(win.limit);
        let mut pos = from + RECORD_ALIGN;
        while pos + format::RECORD_HEADER_LEN as u64 <= win.limit {
            if pos % self.align == 0 {
                if win.is_zero_block(pos)? {
                    pos += self.align;
                    continue;
                }
                garbage_end = garbage_end.max((pos + self.align).min(win.limit));
            }
            if win.bytes(pos, 4)? == b"SPRC" {
                match self.try_record_at(win, id, pos, prev_epoch, false)? {
                    Probe::Record(_, h, _) => {
                        *max_epoch_any = (*max_epoch_any).max(h.epoch);
                        if synced {
                            return Ok(PastEnd::Synced { next: pos });
                        }
                    }
                    Probe::Invalid { stale_epoch } => *max_epoch_any = (*max_epoch_any).max(stale_epoch),
                }
            }
            pos += RECORD_ALIGN;
        }
        // (With `synced`, the mark itself is an acceptable record after `from`: not reached.)
        Ok(PastEnd::Orphans { end: garbage_end })
    }

    /// The sync marks of this segment at or after `from`, wherever their heads are valid: one pass,
    /// which looks at the heads of records flagged as sync marks only.
    fn find_sync_marks(&self, win: &mut ScanWindow<'_, B>, id: u32, from: u64) -> Result<SyncMarks> {
        let mut found = Vec::new();
        let mut pos = from + RECORD_ALIGN;
        while pos + format::RECORD_HEADER_LEN as u64 <= win.limit {
            if pos % self.align == 0 && win.is_zero_block(pos)? {
                pos += self.align;
                continue;
            }
            if win.bytes(pos, 4)? == b"SPRC" {
                let head = win.bytes(pos, format::RECORD_HEADER_LEN as u64)?;
                let is_mark = format::peek_record_header(head).is_ok_and(|h| h.is_sync_mark());
                if is_mark {
                    if let Probe::Record(_, h, _) = self.try_record_at(win, id, pos, 0, false)? {
                        found.push((pos, h.epoch));
                    }
                }
            }
            pos += RECORD_ALIGN;
        }
        Ok(SyncMarks::new(found))
    }

    fn read_aligned(&self, file: &B::File, offset: u64, len: usize, path: &Path) -> Result<AlignedBuf> {
        debug_assert!(offset % self.align == 0 && len as u64 % self.align == 0);
        let buf = AlignedBuf::zeroed(len, self.align as usize);
        let (r, buf) = self.backend.read_at(file, offset, buf);
        r.map_err(|e| Error::io("read segment", path.to_path_buf(), e))?;
        Ok(buf)
    }

    // -----------------------------------------------------------------------------------------------
    // Reads
    // -----------------------------------------------------------------------------------------------

    /// The value stored under `key`, or `None`. A damaged record is an error naming its segment and
    /// offset; other records are unaffected.
    pub fn get(&self, key: &[u8]) -> Result<Option<Frames>> {
        Ok(self.get_with_crc(key)?.map(|(frames, _)| frames))
    }

    /// As [`SegmentLog::get`], with the crc this read checked the value against when the record is
    /// not compressed: [`format::laid_out_crc`] of the frames returned (`None` for an lz4 record,
    /// whose crc covers the compressed bytes). A caller that needs to know later whether a value
    /// still serializes to these bytes gets it without another pass over them.
    pub fn get_with_crc(&self, key: &[u8]) -> Result<Option<(Frames, Option<u32>)>> {
        let mut tries = 0;
        loop {
            let Some((p, file)) = self.lookup(key) else {
                return Ok(None);
            };
            let loc = p.loc();
            let got = match self.pending_record(loc)? {
                Some(raw) => decode_read_with_crc(raw, loc, key, self.salt),
                None => self.read_planned(&file, self.plan_read(&p, key.len()), key),
            };
            match got {
                Err(e) if tries < 8 && self.moved_under_read(&e, key, loc) => tries += 1,
                got => return got.map(Some),
            }
        }
    }

    /// Whether `e`, the failure of a read of `key`'s record at `loc`, may come from the key being
    /// forgotten or moved while it was read rather than from damage: a forget may punch the record's
    /// blocks once the index no longer points there. Then the reader looks the key up again instead
    /// of reporting damage that is not there.
    fn moved_under_read(&self, e: &Error, key: &[u8], loc: Location) -> bool {
        matches!(e, Error::Corrupt { .. } | Error::ChecksumMismatch { .. })
            && self.location(key).is_none_or(|l| (l.segment, l.offset) != (loc.segment, loc.offset))
    }

    /// Where `key`'s record is, if it is live.
    pub fn location(&self, key: &[u8]) -> Option<Location> {
        self.index.read().unwrap_or_else(|p| p.into_inner()).get(key).map(|&p| Location::from(p))
    }

    fn lookup(&self, key: &[u8]) -> Option<(PackedLoc, Arc<B::File>)> {
        // Hold the index lock while taking the file handle: a segment is only deleted after the index
        // stopped pointing at it, so the pair is consistent (and an unlinked file stays readable).
        let index = self.index.read().unwrap_or_else(|p| p.into_inner());
        let p = *index.get(key)?;
        let file = self.files.read().unwrap_or_else(|p| p.into_inner()).get(&p.segment)?.clone();
        Some((p, file))
    }

    /// What to read for the record `p` of a key of `key_len` bytes: a value the index can check
    /// (single frame, not compressed) is read without its head, only its payload, which the writer
    /// put at a sector boundary when it is large (see [`ALIGN_PAYLOAD_MIN`]); any other record whole.
    fn plan_read(&self, p: &PackedLoc, key_len: usize) -> ReadPlan {
        let loc = p.loc();
        let facts = p.facts();
        let head = format::head_len(1, key_len) + facts.pad as u64;
        let (from, len, crc) = match facts.direct_crc {
            Some(crc) if head < loc.len => (loc.offset + head, loc.len - head, Some(crc)),
            _ => (loc.offset, loc.len, None),
        };
        let start = align_down(from, self.read_align);
        let end = align_up(from + len, self.read_align);
        ReadPlan { loc, start, end, from, len, crc }
    }

    /// Alignment of a buffer for a read of `len` bytes. O_DIRECT reads (`read_align` of 512 or
    /// more) of a page or more get page-aligned buffers: into a buffer that is only 512-aligned, a
    /// 4 KiB read spans two pages, and on this machine 4 KiB random reads (QD32) ran at 0.87-0.91x
    /// the IOPS and 64 KiB ones (QD16) at 0.87-0.91x the bandwidth of the same reads into
    /// page-aligned buffers (`docs/benchmarks.md`). Buffered reads keep 64-byte alignment.
    fn buf_align(&self, len: u64) -> usize {
        if self.read_align >= 512 && len >= PAGE_BYTES {
            PAGE_BYTES.max(self.read_align) as usize
        } else {
            self.read_align as usize
        }
    }

    /// Read what `plan` says and decode it.
    fn read_planned(&self, file: &B::File, plan: ReadPlan, key: &[u8]) -> Result<(Frames, Option<u32>)> {
        let buf = self
            .backend
            .read_new(file, plan.start, (plan.end - plan.start) as usize, self.buf_align(plan.end - plan.start))
            .map_err(|e| Error::io("read segment", self.seg_path(plan.loc.segment), e))?;
        plan.finish_with_crc(buf.freeze(), key, self.salt)
    }

    /// Read the raw bytes of the record at `loc` (aligned read, zero-copy slice).
    fn read_record_bytes(&self, file: &B::File, loc: Location) -> Result<Bytes> {
        let start = align_down(loc.offset, self.read_align);
        let end = align_up(loc.offset + loc.len, self.read_align);
        let len = (end - start) as usize;
        let buf = self
            .backend
            .read_new(file, start, len, self.buf_align(len as u64))
            .map_err(|e| Error::io("read segment", self.seg_path(loc.segment), e))?;
        let b = buf.freeze();
        Ok(b.slice((loc.offset - start) as usize..(loc.offset - start + loc.len) as usize))
    }

    /// As [`SegmentLog::get`], but the read runs as a future: with the io_uring backend many reads
    /// from one thread are in flight at once (the index lookup happens before the first poll). The
    /// future owns everything it needs, so it may outlive borrows of the log; dropping it early is
    /// safe (the backend keeps the buffer until the kernel is done with it). Unlike `get`, it cannot
    /// look the key up again after a failed read: a read racing a `forget` of the same key may report
    /// the punched record as damaged. ([`Store::get_async`](crate::Store::get_async) checks whether
    /// the key is still there before it reports an error.)
    pub fn get_async(&self, key: &[u8]) -> impl Future<Output = Result<Option<Frames>>> + Send + 'static {
        let started = self.lookup(key).map(|(p, file)| {
            // A pending record (write-behind) is served from memory.
            let plan = self.plan_read(&p, key.len());
            let from_memory = self.pending_record(plan.loc)?;
            let read = from_memory.is_none().then(|| {
                let buf =
                    self.backend.alloc_buf((plan.end - plan.start) as usize, self.buf_align(plan.end - plan.start));
                self.backend.read_at_async(&file, plan.start, buf)
            });
            Ok((plan, from_memory, read, self.seg_path(plan.loc.segment)))
        });
        let key = key.to_vec();
        let salt = self.salt;
        async move {
            let Some(started) = started else {
                return Ok(None);
            };
            let (plan, from_memory, read, path) = started?;
            let Some(read) = read else {
                return decode_read(from_memory.expect("a pending record"), plan.loc, &key, salt).map(Some);
            };
            let (r, buf) = read.await;
            r.map_err(|e| Error::io("read segment", path, e))?;
            plan.finish(buf.freeze(), &key, salt).map(Some)
        }
    }

    /// Read many keys with up to `depth` reads in flight, on the calling thread: `keys` is drained
    /// lazily, and `on_value` receives every key with its result, in completion order (an absent
    /// key right away, as `Ok(None)`). With the io_uring backend the calling thread owns a ring for
    /// the call and submits and reaps itself ([`Backend::read_pipelined`]); the portable backend
    /// reads one key after another. The bulk form of [`SegmentLog::get`]: unspilling a batch,
    /// sending many keys to a peer.
    pub fn get_pipelined(
        &self,
        depth: usize,
        keys: &mut dyn Iterator<Item = Vec<u8>>,
        on_value: &mut dyn FnMut(Vec<u8>, Result<Option<Frames>>),
    ) -> Result<()> {
        let pending: RefCell<slab::Slab<(Vec<u8>, ReadPlan)>> = RefCell::new(slab::Slab::new());
        let on_value = RefCell::new(on_value);
        let mut next = || loop {
            let key = keys.next()?;
            match self.lookup(&key) {
                None => (on_value.borrow_mut())(key, Ok(None)),
                // A pending record (write-behind): served from memory.
                Some((p, _)) if self.may_be_pending(p.loc()) => {
                    let res = match self.pending_record(p.loc()) {
                        Ok(Some(raw)) => decode_read(raw, p.loc(), &key, self.salt).map(Some),
                        Ok(None) => self.get(&key), // written meanwhile: read as usual
                        Err(e) => Err(e),
                    };
                    (on_value.borrow_mut())(key, res)
                }
                Some((p, file)) => {
                    let plan = self.plan_read(&p, key.len());
                    let buf =
                        self.backend.alloc_buf((plan.end - plan.start) as usize, self.buf_align(plan.end - plan.start));
                    let offset = plan.start;
                    let tag = pending.borrow_mut().insert((key, plan)) as u64;
                    return Some(PipelinedRead { file, offset, buf, tag });
                }
            }
        };
        let mut done = |tag: u64, (r, buf): BufResult| {
            let (key, plan) = pending.borrow_mut().remove(tag as usize);
            let res = match r {
                Err(e) => Err(Error::io("read segment", self.seg_path(plan.loc.segment), e)),
                Ok(()) => match plan.finish(buf.freeze(), &key, self.salt) {
                    // Forgotten or moved while being read: as a fresh `get` finds it now.
                    Err(e) if self.moved_under_read(&e, &key, plan.loc) => self.get(&key),
                    got => got.map(Some),
                },
            };
            (on_value.borrow_mut())(key, res);
        };
        self.backend.read_pipelined(depth, &mut next, &mut done).map_err(|e| Error::io("read pipeline", None, e))
    }

    /// Where `key`'s stored form is on disk, for sending it without reading it into memory: the
    /// segment file, the payload's offset in it, and the record's metadata (header checksum
    /// verified). `None` if the key is absent.
    pub fn stored_value(&self, key: &[u8]) -> Result<Option<StoredValue<B::File>>> {
        let mut tries = 0;
        let (loc, file, pin) = loop {
            let Some((loc, file)) = self.lookup(key).map(|(p, f)| (p.loc(), f)) else { return Ok(None) };
            // Pinned before the index is checked again: a forget that removed the key before the
            // check makes it absent; one after it finds the pin and does not punch what is being
            // sent.
            let pin = SendPin::new(&self.sending, (loc.segment, loc.offset));
            match self.location(key) {
                None => return Ok(None),
                Some(l) if (l.segment, l.offset) == (loc.segment, loc.offset) => break (loc, file, pin),
                // Rewritten (a put, or compaction moving it) meanwhile: the new record is looked up.
                Some(_) if tries < 64 => tries += 1,
                Some(_) => {
                    let why = io::Error::new(io::ErrorKind::WouldBlock, "the key is rewritten too often to pin");
                    return Err(Error::io("pin a record to send", None, why));
                }
            }
        };
        if self.may_be_pending(loc) {
            // Pending (write-behind): written out first. If that write fails, it is in memory, not in
            // a file (`Error::Poisoned`, or a full file system: the transfer sources then send it
            // from memory).
            let mut st = self.writer();
            if st.active.as_ref().is_some_and(|a| a.id == loc.segment && loc.offset >= a.written_end) {
                self.flush_pending(&mut st)?;
            }
        }
        let fixed = self.read_range(&file, loc, 0, format::RECORD_HEADER_LEN as u64)?;
        let h = format::peek_record_header(&fixed).map_err(|e| e.at(loc.segment, loc.offset))?;
        let head = self.read_range(&file, loc, 0, h.payload_offset())?;
        let frame_lens = format::verify_record_head(&head, &h, self.salt).map_err(|e| e.at(loc.segment, loc.offset))?;
        let k = &head[h.key_offset()..h.key_offset() + h.key_len as usize];
        if k != key || h.segment != loc.segment || h.is_tombstone() {
            return Err(Error::Corrupt {
                segment: loc.segment,
                offset: loc.offset,
                reason: "record does not match the index (key, segment or kind)".into(),
            });
        }
        Ok(Some(StoredValue {
            file,
            path: self.seg_path(loc.segment),
            payload_offset: loc.offset + h.payload_offset(),
            meta: StreamedValue {
                lz4: h.is_lz4(),
                frame_lens,
                raw_len: h.raw_len,
                stored_len: h.stored_len,
                payload_crc: h.payload_crc,
            },
            _pin: pin,
        }))
    }

    /// The stored payload of `sv` read into memory (the transfer's copy path).
    pub fn read_stored(&self, sv: &StoredValue<B::File>) -> Result<Bytes> {
        self.read_stored_part(sv, 0, sv.meta.stored_len)
    }

    /// `len` bytes of `sv`'s stored payload from `from` (an aligned read, sliced): the payload a
    /// piece at a time, for a sender that must not hold a whole value in memory.
    pub fn read_stored_part(&self, sv: &StoredValue<B::File>, from: u64, len: u64) -> Result<Bytes> {
        if from.checked_add(len).is_none_or(|end| end > sv.meta.stored_len) {
            return Err(Error::InvalidConfig(format!(
                "bytes {from}..+{len} are outside a payload of {}",
                sv.meta.stored_len
            )));
        }
        let a = sv.payload_offset + from;
        let start = align_down(a, self.read_align);
        let end = align_up(a + len, self.read_align);
        let buf = self.backend.alloc_buf((end - start) as usize, self.buf_align(end - start));
        let (r, buf) = self.backend.read_at(&sv.file, start, buf);
        r.map_err(|e| Error::io("read segment", sv.path.clone(), e))?;
        Ok(buf.freeze().slice((a - start) as usize..(a - start + len) as usize))
    }

    /// `len` bytes from `from` within the record at `loc` (an aligned read, sliced).
    fn read_range(&self, file: &B::File, loc: Location, from: u64, len: u64) -> Result<Bytes> {
        let a = loc.offset + from;
        let start = align_down(a, self.read_align);
        let end = align_up(a + len, self.read_align);
        let buf = AlignedBuf::zeroed((end - start) as usize, self.buf_align(end - start));
        let (r, buf) = self.backend.read_at(file, start, buf);
        r.map_err(|e| Error::io("read segment", self.seg_path(loc.segment), e))?;
        Ok(buf.freeze().slice((a - start) as usize..(a - start + len) as usize))
    }

    /// Whether `key` is live.
    pub fn contains(&self, key: &[u8]) -> bool {
        self.index.read().unwrap_or_else(|p| p.into_inner()).contains_key(key)
    }

    /// Number of live keys.
    pub fn len(&self) -> usize {
        self.index.read().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// True when no key is live.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All live keys, sorted.
    pub fn keys(&self) -> Vec<Vec<u8>> {
        let mut k: Vec<Vec<u8>> =
            self.index.read().unwrap_or_else(|p| p.into_inner()).keys().map(|k| k.to_vec()).collect();
        k.sort_unstable();
        k
    }

    // -----------------------------------------------------------------------------------------------
    // Writes
    // -----------------------------------------------------------------------------------------------

    fn check_writable(&self) -> Result<()> {
        match self.poisoned.get() {
            Some(cause) => Err(Error::Poisoned { cause: cause.clone() }),
            None => Ok(()),
        }
    }

    /// A write of records succeeded: a full file system met later is warned about again.
    fn wrote(&self) {
        if self.warned.load(Ordering::Relaxed) & WARN_FULL != 0 {
            self.warned.fetch_and(!WARN_FULL, Ordering::Relaxed);
        }
    }

    /// Whether the warning `bit` is still to be logged for this log (and from now on, is not).
    fn warn_once(&self, bit: u64) -> bool {
        self.warned.fetch_or(bit, Ordering::Relaxed) & bit == 0
    }

    fn poison(&self, e: Error) -> Error {
        let _ = self.poisoned.set(e.to_string());
        log::error!("segment log {} is now read-only: {e}", self.dir.display());
        e
    }

    /// The error for a failed write of records that were not published (or, for write-behind, are
    /// still pending in memory). A full file system (ENOSPC, EDQUOT) is an error for this call only:
    /// the bytes the write may have left lie at or after the segment's published end, which the next
    /// write of the segment overwrites, so nothing on disk needs undoing, and freeing space (forgetting
    /// or deleting data) lets the same write succeed. Any other failure (EIO, ...) leaves the file in
    /// an unknown state and makes the log read-only.
    fn write_failed(&self, op: &'static str, path: PathBuf, e: io::Error) -> Error {
        if crate::error::io_no_space(&e) {
            if self.warn_once(WARN_FULL) {
                log::warn!(
                    "segment log {}: {op} failed, the file system is full ({e}); the log stays writable",
                    self.dir.display()
                );
            }
            return Error::io(op, path, e);
        }
        self.poison(Error::io(op, path, e))
    }

    /// Whether `value` can be stored under `key`: what [`put_many`](Self::put_many) checks for
    /// every item before it writes any (key and value limits, frame count, record length).
    pub fn validate(&self, key: &[u8], frames: &Frames) -> Result<()> {
        if key.len() > format::MAX_KEY_BYTES {
            return Err(Error::KeyTooLarge { len: key.len(), max: format::MAX_KEY_BYTES });
        }
        if frames.len() > format::MAX_FRAMES {
            return Err(Error::ValueTooLarge {
                len: frames.len() as u64,
                max: format::MAX_FRAMES as u64,
                unit: "frames",
            });
        }
        if frames.total_len() > self.opts.max_value_bytes {
            return Err(Error::ValueTooLarge {
                len: frames.total_len(),
                max: self.opts.max_value_bytes,
                unit: "bytes",
            });
        }
        // The record around the value (header, frame table, key, 64-byte frame gaps) must fit the
        // index's 32-bit length too: near the value limit, many frames can push it over.
        // (With the largest payload padding the writer may add.)
        let len = format::record_len(frames.len(), key.len(), laid_out_len(frames)) + format::PAYLOAD_PAD_LIMIT
            - format::FRAME_ALIGN;
        if len > MAX_RECORD_BYTES {
            return Err(Error::ValueTooLarge { len, max: MAX_RECORD_BYTES, unit: "record bytes" });
        }
        Ok(())
    }

    /// Store `value` under `key`, replacing any previous value. Returns once the record is written to
    /// the kernel (it survives a process crash); call [`sync`](Self::sync) for power-loss durability.
    /// With [`LogOptions::write_behind_bytes`], a small record may instead be pending in memory when
    /// this returns (readable at once, written with a later write, `sync` or drop).
    pub fn put(&self, key: &[u8], value: &Frames) -> Result<()> {
        self.put_many(&[(key, value)])
    }

    /// Store several values with as few writes as possible (one aligned write per segment touched).
    /// Not atomic across segments: if it fails, the values of the segments written before the failure
    /// are stored, the others are not (each value is either its old or its new one, never damaged).
    pub fn put_many(&self, items: &[(&[u8], &Frames)]) -> Result<()> {
        for (k, v) in items {
            self.validate(k, v)?;
        }
        let recs: Vec<NewRecord<'_>> = items.iter().map(|(key, frames)| NewRecord::Value { key, frames }).collect();
        let mut st = self.writer();
        self.append(&mut st, recs).map(|_| ())
    }

    /// Store a value whose stored form arrives from `src` (a peer's socket), without holding it in
    /// memory (beyond 1 MiB, or an eighth of a segment) and without holding the writer lock while it
    /// arrives: a value of at most that many stored bytes is read first, then appended like any
    /// record; a larger one is written into a segment of its own as the bytes arrive (see
    /// `put_stream_apart`). The payload checksum is computed on the way, and the key is published
    /// only when all `meta.stored_len` bytes arrived and match `meta.payload_crc`. On a short read
    /// (the sender hung up), a read error or a checksum mismatch, nothing becomes visible, nothing
    /// of the value stays on disk, and the log stays usable. A write of the key published while the
    /// value arrives wins over it (the streamed record is dead on arrival).
    pub fn put_stream(&self, key: &[u8], meta: &StreamedValue, src: &mut dyn io::Read) -> Result<()> {
        if key.len() > format::MAX_KEY_BYTES {
            return Err(Error::KeyTooLarge { len: key.len(), max: format::MAX_KEY_BYTES });
        }
        let invalid = |why: &str| Error::Protocol(format!("streamed value: {why}"));
        if meta.frame_lens.len() > format::MAX_FRAMES {
            return Err(invalid("too many frames"));
        }
        let laid_out = format::frame_layout(meta.frame_lens.iter().copied()).map(|(_, n)| n);
        if laid_out != Some(meta.raw_len) {
            return Err(invalid("frame lengths do not lay out to raw_len"));
        }
        if !meta.lz4 && meta.stored_len != meta.raw_len {
            return Err(invalid("uncompressed value with stored_len != raw_len"));
        }
        if meta.lz4 && !format::lz4_lengths_fit(meta.stored_len, meta.raw_len) {
            return Err(invalid("lz4 lengths that no compression of raw_len has"));
        }
        let total: u64 = meta.frame_lens.iter().sum();
        if total > self.opts.max_value_bytes || meta.stored_len > self.opts.max_value_bytes + (1 << 20) {
            return Err(Error::ValueTooLarge {
                len: total.max(meta.stored_len),
                max: self.opts.max_value_bytes,
                unit: "bytes",
            });
        }
        let len = format::record_len(meta.frame_lens.len(), key.len(), meta.stored_len);
        if len > MAX_RECORD_BYTES {
            return Err(Error::ValueTooLarge { len, max: MAX_RECORD_BYTES, unit: "record bytes" });
        }
        if meta.stored_len > STREAM_BUFFERED_MAX.max(self.opts.segment_bytes / 8) {
            return self.put_stream_apart(key, meta, src, len);
        }
        // Small: into memory first, so that the writer lock is held for a write, never for a peer.
        let mut payload = vec![0u8; meta.stored_len as usize];
        read_payload(src, &mut payload)?;
        self.put_stream_locked(key, meta, &mut &payload[..], len)
    }

    /// The header and the encoded head (header, frame table, key: everything before the payload)
    /// of a streamed value's record in segment `segment`. A streamed payload is never padded
    /// (`aux` 0): it is written as it arrives.
    fn streamed_head(
        &self,
        key: &[u8],
        meta: &StreamedValue,
        segment: u32,
        epoch: u32,
        seq: u64,
    ) -> (RecordHeader, Vec<u8>) {
        let h = RecordHeader {
            flags: if meta.lz4 { format::FLAG_LZ4 } else { 0 },
            frame_count: meta.frame_lens.len() as u16,
            key_len: key.len() as u32,
            segment,
            epoch,
            payload_crc: meta.payload_crc,
            seq,
            raw_len: meta.raw_len,
            stored_len: meta.stored_len,
            aux: 0,
        };
        let mut head = vec![0u8; h.payload_offset() as usize];
        format::write_record_head(&mut head, &h, &meta.frame_lens, key, self.salt);
        (h, head)
    }

    /// `put_stream` of a value read from `src` while holding the writer lock (its bytes are in
    /// memory already: see `put_stream`), appended to the active segment.
    fn put_stream_locked(&self, key: &[u8], meta: &StreamedValue, src: &mut dyn io::Read, len: u64) -> Result<()> {
        let mut guard = self.writer();
        // Checked under the writer lock: a write or fsync that failed while this call waited for
        // the lock poisoned the log, and nothing may be written (or an fsync retried) after that.
        self.check_writable()?;
        let st = &mut *guard;
        let need_new = match &st.active {
            Some(a) => !self.fits(a, len, key.len()),
            None => true,
        };
        if need_new {
            self.rotate(st, len, key.len())?;
        }
        // The value is streamed straight to the file, after what is pending (write-behind).
        self.flush_pending(st)?;
        let epoch = st.epoch;
        let seq = st.next_seq;
        st.next_seq += 1;
        let align = self.align as usize;
        let a = st.active.as_ref().expect("active after rotate");
        let (id, start, old_tail) = (a.id, a.data_end, a.tail.clone());
        let base = align_down(start, self.align);
        let (h, head) = self.streamed_head(key, meta, id, epoch, seq);
        let po = head.len();

        const CHUNK: usize = 1 << 20;
        // Chunks are written `fill` bytes at a time (a multiple of the alignment); the extra block of
        // capacity leaves room for the last record's padding.
        let fill = CHUNK.max(align_up((old_tail.len() + po) as u64, self.align) as usize);
        let cap = fill + align;
        let mut buf = self.backend.alloc_buf(cap, align);
        buf.set_len(0);
        buf.extend_from_slice(&old_tail);
        buf.extend_from_slice(&head);
        let mut buf_base = base;
        let mut crc = crc32fast::Hasher::new();
        let mut left = meta.stored_len;
        let file = &a.file;
        let end = start + len;
        // A panic of the caller's reader is caught, so that what this value wrote is erased below
        // like after any other failure, and then goes on unwinding.
        let mut panicked: Option<Box<dyn std::any::Any + Send>> = None;
        let result: Result<()> = (|| {
            loop {
                // Fill the buffer from the peer, then write it whole (it is a multiple of `align`).
                while left > 0 && buf.len() < fill {
                    let at = buf.len();
                    let want = ((fill - at) as u64).min(left) as usize;
                    buf.set_len(at + want);
                    let read =
                        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| src.read(&mut buf[at..at + want])));
                    let n = match read {
                        Ok(Ok(n)) => n,
                        Ok(Err(e)) if e.kind() == io::ErrorKind::Interrupted => {
                            buf.set_len(at);
                            continue;
                        }
                        Ok(Err(e)) => {
                            buf.set_len(at);
                            return Err(Error::io("receive value", None, e));
                        }
                        Err(panic) => {
                            buf.set_len(at);
                            panicked = Some(panic);
                            return Err(Error::io("receive value", None, io::Error::other("the reader panicked")));
                        }
                    };
                    buf.set_len(at + n);
                    if n == 0 && want > 0 {
                        return Err(Error::io(
                            "receive value",
                            None,
                            io::Error::new(
                                io::ErrorKind::UnexpectedEof,
                                "the sender stopped before the whole value arrived",
                            ),
                        ));
                    }
                    crc.update(&buf[at..at + n]);
                    left -= n as u64;
                }
                if left == 0 {
                    break;
                }
                let (r, b) =
                    self.backend.write_at(file, buf_base, std::mem::replace(&mut buf, AlignedBuf::zeroed(0, align)));
                buf = b;
                r.map_err(|e| self.write_failed("write segment", self.seg_path(id), e))?;
                buf_base += buf.len() as u64;
                buf.set_len(0);
            }
            Ok(())
        })();
        let result = result.and_then(|()| {
            let actual = crc.finalize();
            if actual != meta.payload_crc {
                // Bad bytes from the peer, not damage on disk (the record is zeroed below): segment 0.
                return Err(Error::ChecksumMismatch {
                    segment: 0,
                    offset: 0,
                    what: "streamed value payload",
                    expected: meta.payload_crc,
                    actual,
                });
            }
            // Last piece: pad the record and the block, write, keep the new tail block.
            let at = buf.len();
            let rec_end = (end - buf_base) as usize;
            debug_assert_eq!(at, rec_end);
            let block_end = (align_up(padded(end), self.align) - buf_base) as usize;
            buf.set_len(block_end.max(at));
            buf[at..].fill(0);
            let (r, b) =
                self.backend.write_at(file, buf_base, std::mem::replace(&mut buf, AlignedBuf::zeroed(0, align)));
            buf = b;
            r.map_err(|e| self.write_failed("write segment", self.seg_path(id), e))
        });
        if let Err(e) = result {
            // Nothing was published: erase what this value wrote, so neither the next records nor
            // recovery ever see a partial record.
            let erase_end = align_up(end, self.align).min(buf_base + buf.capacity() as u64);
            let erased = self.erase_aborted(file, base, &old_tail, erase_end);
            self.fence_failed_write(st, None); // (erased just above)
            let failed = match erased {
                Err(we) => self.write_failed("erase an aborted value", self.seg_path(id), we),
                Ok(()) if self.opts.durable && self.poisoned.get().is_none() => {
                    // As in `erase_durably`: the aborted record's head sat at the published end.
                    let file = st.active.as_ref().expect("still active").file.clone();
                    match self.backend.sync_data(&file) {
                        Err(se) => self.poison(Error::io("sync segment", self.seg_path(id), se)),
                        Ok(()) => e,
                    }
                }
                Ok(()) => e,
            };
            if let Some(panic) = panicked {
                drop(guard);
                std::panic::resume_unwind(panic);
            }
            return Err(failed);
        }
        // The record's padding is part of the tail block the next write rewrites.
        let pend = padded(end);
        let tail_start = align_down(pend, self.align);
        let tail = buf[(tail_start - buf_base) as usize..(pend - buf_base) as usize].to_vec();
        let empty = Frames::default();
        let rec = NewRecord::Value { key, frames: &empty };
        let chunk = [Prepared { rec, payload: Payload::Empty, len, pad: 0, align_head: 0 }];
        self.publish_chunk(st, &chunk, &[Placed::new(start, &h)], pend, tail, epoch, false)?;
        self.compact_if_pending(st);
        Ok(())
    }

    /// `put_stream` of a large value: into a segment of its own, created for it, without the writer
    /// lock (taken only to reserve the segment id and the sequence number, then to publish), so that
    /// writes go on while the value arrives. The segment is written whole (its header, the record,
    /// the footer and the trailer: sealed) before it joins the log. A put, delete or forget of the
    /// key while the value arrives is newer: the streamed record is then dead on arrival (the
    /// record a later recovery would pick agrees: the other operation's sequence number is higher,
    /// or, after a forget, a spill log may bring either back). Compaction may move the key's old
    /// record meanwhile: a move keeps its sequence number and does not overtake the stream.
    fn put_stream_apart(&self, key: &[u8], meta: &StreamedValue, src: &mut dyn io::Read, len: u64) -> Result<()> {
        let data_start = self.align;
        let size = align_up(padded(data_start + len), self.align)
            + align_up(Self::footer_entry_len(key.len()) + format::TRAILER_LEN as u64, self.align);
        let (id, seq, epoch) = {
            let mut st = self.writer();
            self.check_writable()?;
            let id = st.next_segment;
            st.next_segment = id.checked_add(1).ok_or_else(|| Error::Exhausted("segment ids".into()))?;
            let seq = st.next_seq;
            st.next_seq += 1;
            // Registered under the writer lock: every write of the key published after this one
            // has a larger sequence number and marks it.
            lock(&self.streaming).entry(key.to_vec()).or_default().push((seq, false));
            self.any_streaming.store(true, Ordering::Release);
            (id, seq, st.epoch)
        };
        let path = self.seg_path(id);
        let written = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            self.write_streamed_segment(&path, id, size, key, meta, seq, epoch, src)
        }));
        let mut guard = self.writer();
        let st = &mut *guard;
        let (file, h) = match written {
            Ok(Ok(w)) => w,
            Ok(Err(e)) => {
                self.stream_ended(key, seq);
                return Err(e);
            }
            Err(panic) => {
                // (Its file may be there: a reader that panics is the caller's bug, and the
                // segment goes like any torn one at the next open if this removal fails.)
                let _ = self.backend.remove_file(&path);
                self.stream_ended(key, seq);
                drop(guard);
                std::panic::resume_unwind(panic);
            }
        };
        if let Err(e) = self.check_writable() {
            // Poisoned meanwhile: the log changes nothing on disk any more, and takes no segment.
            drop(file);
            let _ = self.backend.remove_file(&path);
            self.stream_ended(key, seq);
            return Err(e);
        }
        let file = Arc::new(file);
        st.dir_dirty = true;
        st.dir_new_segments = true;
        self.files.write().unwrap_or_else(|p| p.into_inner()).insert(id, file.clone());
        let mut m = SegMeta::new(size, data_start);
        m.data_end = padded(data_start + len);
        m.sealed = true;
        m.records = 1;
        st.segs.insert(id, m);
        st.unsynced_sealed.push(file);
        let mut emptied = Vec::new();
        {
            let mut index = self.index.write().unwrap_or_else(|p| p.into_inner());
            // Under the index lock, as `forget` marks streams: none can come between.
            let overtaken = self.stream_ended(key, seq);
            if !overtaken {
                // A write of the key, for the streams of it that began before this one.
                self.written_meanwhile(key, seq);
                let loc = Location { segment: id, offset: data_start, len };
                let first = index.get(key).map_or(id, |o| first_segment(&st.segs, o).min(id));
                let elsewhere = note_first_segment(&mut st.segs, id, data_start, first);
                let facts = RecordFacts::of(h.flags, h.frame_count, h.payload_crc, h.aux, h.stored_len);
                if let Some(old) = index.insert(IndexKey::from(key), PackedLoc::new(loc, facts, elsewhere)) {
                    Self::release(st, old.into(), &mut emptied);
                }
                let m = st.segs.get_mut(&id).expect("inserted above");
                m.live_records = 1;
                m.live_bytes = padded(len);
            }
        }
        self.wrote();
        // The old record's segment, or this one if a newer operation made it dead on arrival.
        self.reclaim(st);
        Ok(())
    }

    /// A write of `key` with sequence number `seq` (`u64::MAX`: a forget, newer than everything)
    /// was published: the streams of `key` that began before it are overtaken.
    fn written_meanwhile(&self, key: &[u8], seq: u64) {
        if !self.any_streaming.load(Ordering::Acquire) {
            return;
        }
        if let Some(streams) = lock(&self.streaming).get_mut(key) {
            for (s, overtaken) in streams.iter_mut() {
                *overtaken |= *s < seq;
            }
        }
    }

    /// The stream of `key` with sequence number `seq` is over: forget it. Returns whether a newer
    /// write of its key overtook it.
    fn stream_ended(&self, key: &[u8], seq: u64) -> bool {
        let mut streaming = lock(&self.streaming);
        let Some(streams) = streaming.get_mut(key) else { return false };
        let i = streams.iter().position(|&(s, _)| s == seq).expect("registered by put_stream_apart");
        let (_, overtaken) = streams.swap_remove(i);
        if streams.is_empty() {
            streaming.remove(key);
            if streaming.is_empty() {
                self.any_streaming.store(false, Ordering::Release);
            }
        }
        overtaken
    }

    /// The segment of a `put_stream_apart`: created at `path`, its header, the record (its payload
    /// from `src`, checked against `meta.payload_crc`), made durable first in a durable log, then
    /// its footer and trailer. On failure the file is removed (it was never part of the log).
    #[allow(clippy::too_many_arguments)] // one value's record, as `put_stream_apart` placed it
    fn write_streamed_segment(
        &self,
        path: &Path,
        id: u32,
        size: u64,
        key: &[u8],
        meta: &StreamedValue,
        seq: u64,
        epoch: u32,
        src: &mut dyn io::Read,
    ) -> Result<(B::File, RecordHeader)> {
        let file = self.backend.open(path, true).map_err(|e| Error::io("create segment", path.to_path_buf(), e))?;
        let data_start = self.align;
        let align = self.align as usize;
        // As on every write path: a full file system fails this call alone, any other failure
        // makes the log read-only (see `write_failed`).
        let io_err = |op: &'static str| move |e: io::Error| self.write_failed(op, path.to_path_buf(), e);
        let written = (|| -> Result<RecordHeader> {
            self.backend.allocate(&file, size).map_err(io_err("fallocate"))?;
            let mut hb = AlignedBuf::zeroed(align, align);
            let header = format::SegmentHeader {
                segment: id,
                segment_bytes: size,
                align: align as u32,
                epoch,
                data_start,
                salt: self.salt,
            };
            hb[..format::SEGMENT_HEADER_LEN].copy_from_slice(&format::encode_segment_header(&header));
            self.backend.write_at(&file, 0, hb).0.map_err(io_err("write segment header"))?;
            let (h, head) = self.streamed_head(key, meta, id, epoch, seq);
            let po = head.len();
            const CHUNK: usize = 1 << 20;
            // Pieces of `fill` bytes (a multiple of the alignment), the last one padded.
            let fill = CHUNK.max(align_up(po as u64, self.align) as usize);
            let mut buf = self.backend.alloc_buf(fill + align, align);
            buf.set_len(0);
            buf.extend_from_slice(&head);
            let (mut at, mut left) = (data_start, meta.stored_len);
            let mut crc = crc32fast::Hasher::new();
            loop {
                while left > 0 && buf.len() < fill {
                    let from = buf.len();
                    let want = ((fill - from) as u64).min(left) as usize;
                    buf.set_len(from + want);
                    let n = match src.read(&mut buf[from..]) {
                        Ok(0) => {
                            buf.set_len(from);
                            return Err(Error::io("receive value", None, stopped_early()));
                        }
                        Ok(n) => n,
                        Err(e) if e.kind() == io::ErrorKind::Interrupted => 0,
                        Err(e) => {
                            buf.set_len(from);
                            return Err(Error::io("receive value", None, e));
                        }
                    };
                    buf.set_len(from + n);
                    crc.update(&buf[from..from + n]);
                    left -= n as u64;
                }
                if left == 0 {
                    break;
                }
                let (r, b) =
                    self.backend.write_at(&file, at, std::mem::replace(&mut buf, AlignedBuf::zeroed(0, align)));
                buf = b;
                r.map_err(io_err("write segment"))?;
                at += buf.len() as u64;
                buf.set_len(0);
            }
            let actual = crc.finalize();
            if actual != meta.payload_crc {
                // Bad bytes from the peer, not damage on disk: segment 0.
                let what = "streamed value payload";
                return Err(Error::ChecksumMismatch {
                    segment: 0,
                    offset: 0,
                    what,
                    expected: meta.payload_crc,
                    actual,
                });
            }
            let end = buf.len();
            buf.set_len(align_up(end as u64, self.align) as usize);
            buf[end..].fill(0);
            self.backend.write_at(&file, at, buf).0.map_err(io_err("write segment"))?;
            if self.opts.durable {
                self.backend.sync_data(&file).map_err(io_err("sync segment"))?;
            }
            let mut footer = Vec::new();
            let entry = FooterEntry {
                key: key.to_vec(),
                flags: h.flags & format::FLAG_LZ4,
                frame_count: h.frame_count,
                payload_crc: h.payload_crc,
                offset: data_start,
                record_len: h.record_len(),
                seq,
                aux: 0,
            };
            format::encode_footer_entry(&mut footer, &entry);
            let data_end = padded(data_start + h.record_len());
            self.write_seal(&file, id, size, data_end, &footer, 1, epoch).map_err(io_err("write footer"))?;
            Ok(h)
        })();
        match written {
            Ok(h) => Ok((file, h)),
            Err(e) => {
                drop(file);
                let _ = self.backend.remove_file(path);
                Err(e)
            }
        }
    }

    /// Erase `base..end` of the active segment after an aborted `put_stream`: the block at `base` gets
    /// the previous tail back (published records) and zeros after it; the rest is punched out, which
    /// needs no free space (zero writes into blocks the aborted write never reached would, on a full
    /// disk), or zeroed where the file system cannot punch.
    fn erase_aborted(&self, file: &B::File, base: u64, old_tail: &[u8], end: u64) -> io::Result<()> {
        let align = self.align as usize;
        let mut pos = base;
        if !old_tail.is_empty() {
            let mut z = AlignedBuf::zeroed(align, align);
            z[..old_tail.len()].copy_from_slice(old_tail);
            self.backend.write_at(file, base, z).0?;
            pos += self.align;
        }
        if pos >= end {
            return Ok(());
        }
        match self.backend.punch_hole(file, pos, end - pos) {
            Err(e) if e.kind() == io::ErrorKind::Unsupported => {}
            r => return r,
        }
        const CHUNK: u64 = 1 << 20;
        let mut z = AlignedBuf::zeroed(CHUNK.min(end - pos) as usize, align);
        while pos < end {
            let n = (end - pos).min(CHUNK) as usize;
            z.set_len(n);
            let (r, b) = self.backend.write_at(file, pos, z);
            z = b;
            r?;
            pos += n as u64;
        }
        Ok(())
    }

    /// Delete `key`. Returns whether it was live. Writes a tombstone so the deletion survives reopen.
    pub fn delete(&self, key: &[u8]) -> Result<bool> {
        if key.len() > format::MAX_KEY_BYTES {
            return Err(Error::KeyTooLarge { len: key.len(), max: format::MAX_KEY_BYTES });
        }
        let mut st = self.writer();
        let Some(packed) = self.index.read().unwrap_or_else(|p| p.into_inner()).get(key).copied() else {
            return Ok(false);
        };
        let first = first_segment(&st.segs, &packed);
        self.append(&mut st, vec![NewRecord::Tombstone { key, aux: first }])?;
        Ok(true)
    }

    /// Drop `key` from the index *without* writing a tombstone: its space is reclaimed like a deleted
    /// record's, but the deletion does not survive a reopen (the old record may come back). For stores
    /// whose contents die with the process (a worker's spill directory), where a tombstone per delete
    /// would be wasted I/O.
    ///
    /// Forgetting writes nothing, so it works on a log that refuses writes too (after an I/O error),
    /// where the space is not reclaimed. Reclaiming space (deleting a segment that holds nothing live
    /// any more) is a side effect: if it fails, the key is forgotten all the same, the failure is
    /// logged, and the segment goes at a later garbage collection.
    pub fn forget(&self, key: &[u8]) -> Result<bool> {
        let old = {
            let mut index = self.index.write().unwrap_or_else(|p| p.into_inner());
            let old = index.remove(key);
            if old.is_some() {
                self.written_meanwhile(key, u64::MAX); // (under the index lock, as publishing is)
            }
            old
        };
        let Some(old) = old.map(Location::from) else { return Ok(false) };
        let st = match self.state.try_lock() {
            Ok(st) => st,
            Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => {
                // A write holds the lock (a large one, or compaction): the
                // key is gone from the index already; the rest is left to the writer lock's next
                // taker.
                let mut f = lock(&self.forgotten);
                f.push(old);
                self.any_forgotten.store(true, Ordering::Release);
                return Ok(true);
            }
        };
        // Guarded like `writer`: releasing a record can delete a segment (a punch, an unlink, an
        // fsync, and a write of what is pending).
        let mut st = Writer { st, log: self, panicking: std::thread::panicking() };
        self.settle_forgotten(&mut st);
        self.release_forgotten(&mut st, old);
        Ok(true)
    }

    /// The writer lock, after settling what `forget` left for it while it was busy.
    fn writer(&self) -> Writer<'_, B> {
        let mut st = Writer { st: lock(&self.state), log: self, panicking: std::thread::panicking() };
        self.settle_forgotten(&mut st);
        st
    }

    fn settle_forgotten(&self, st: &mut WriterState<B::File>) {
        if !self.any_forgotten.load(Ordering::Acquire) {
            return;
        }
        let locs = {
            let mut f = lock(&self.forgotten);
            self.any_forgotten.store(false, Ordering::Release);
            std::mem::take(&mut *f)
        };
        for old in locs {
            self.release_forgotten(st, old);
        }
    }

    /// Account for a forgotten record (its index entry already removed): its segment's live count,
    /// garbage collection, and the punch that releases its blocks.
    fn release_forgotten(&self, st: &mut WriterState<B::File>, old: Location) {
        let mut emptied = Vec::new();
        Self::release(st, old, &mut emptied);
        if self.poisoned.get().is_some() {
            return; // read-only: nothing on disk changes any more
        }
        if !emptied.is_empty() {
            self.reclaim(st);
        }
        // Punch unless the record's segment is gone: an emptied segment may stay (the active one is
        // never deleted, and a deletion can fail), and then the record's blocks would stay with it.
        if self.opts.punch_forgotten
            && old.len >= PUNCH_MIN_BYTES
            && st.segs.contains_key(&old.segment)
            && self.poisoned.get().is_none()
        {
            self.punch(st, old);
        }
    }

    /// Release the whole blocks inside a forgotten record (`LogOptions::punch_forgotten`): its disk
    /// space and page-cache pages go at once, as a deleted file's would, instead of staying (dirty) until
    /// the whole segment dies or is compacted. Only blocks that lie entirely inside the record are
    /// punched. Neighbouring records, the segment header and the tail block that the next write
    /// rewrites are never touched. Advisory: a failure is logged once and changes nothing else.
    fn punch(&self, st: &mut WriterState<B::File>, old: Location) {
        if st.active.as_ref().is_some_and(|a| a.id == old.segment && old.offset >= a.written_end) {
            return; // pending (write-behind): not in the file yet, nothing to release
        }
        if lock(&self.sending).contains_key(&(old.segment, old.offset)) {
            return; // being sent: its blocks go when the segment does
        }
        let Some(file) = self.files.read().unwrap_or_else(|p| p.into_inner()).get(&old.segment).cloned() else {
            return;
        };
        // Keep the record's head (header, frame table, key) readable, so that recovery of a reopened
        // log still finds the record boundary and steps over it (reporting a damaged payload) instead
        // of taking the zeros for the end of the segment. One small read finds where the head ends; a
        // head longer than that (a huge key or frame table) is rare, and its record is not punched.
        let probe = old.len.min(4 << 10);
        let start_read = align_down(old.offset, self.read_align);
        let end_read = align_up(old.offset + probe, self.read_align);
        let Ok(buf) = self.backend.read_new(
            &file,
            start_read,
            (end_read - start_read) as usize,
            self.buf_align(end_read - start_read),
        ) else {
            return;
        };
        let at = (old.offset - start_read) as usize;
        let Ok(h) = format::peek_record_header(&buf[at..]) else { return };
        if h.payload_offset() > probe {
            return;
        }
        let start = align_up(old.offset + h.payload_offset(), self.align);
        let end = align_down(old.offset + old.len, self.align);
        if end <= start {
            return;
        }
        match self.backend.punch_hole(&file, start, end - start) {
            Ok(()) => {
                if let Some(m) = st.segs.get_mut(&old.segment) {
                    m.punched += end - start;
                }
            }
            Err(e) => {
                if self.warn_once(WARN_PUNCH) {
                    log::warn!("cannot punch holes in segment files ({e}); forgotten records keep their space until compaction");
                }
            }
        }
    }

    fn prepare<'a>(&self, rec: NewRecord<'a>) -> Prepared<'a> {
        let key_len = rec.key().len();
        let (payload, frame_count, stored) = match &rec {
            NewRecord::Tombstone { .. } | NewRecord::SyncMark => (Payload::Empty, 0, 0),
            NewRecord::Relocated { bytes, .. } => {
                let bytes: &'a [u8] = bytes;
                return Prepared {
                    len: bytes.len() as u64,
                    payload: Payload::Relocated(bytes),
                    rec,
                    pad: 0,
                    align_head: 0,
                };
            }
            NewRecord::Value { frames, .. } => {
                let raw = laid_out_len(frames);
                let frames: &'a Frames = frames;
                if self.opts.compression == Compression::Lz4 && raw >= MIN_COMPRESS_BYTES {
                    let mut joined = vec![0u8; raw as usize];
                    format::lay_out_frames(&mut joined, frames.iter().map(|f| &f[..]));
                    let c = lz4_flex::block::compress(&joined);
                    if (c.len() as u64) <= raw - raw / 8 {
                        let n = c.len() as u64;
                        (Payload::Compressed(c), frames.len(), n)
                    } else {
                        (Payload::Frames(frames), frames.len(), raw)
                    }
                } else {
                    (Payload::Frames(frames), frames.len(), raw)
                }
            }
        };
        let aligned = matches!(payload, Payload::Frames(f) if f.len() == 1) && stored >= ALIGN_PAYLOAD_MIN;
        let align_head = if aligned { format::head_len(frame_count, key_len) } else { 0 };
        Prepared { len: format::record_len(frame_count, key_len, stored), payload, rec, pad: 0, align_head }
    }

    /// Room the footer will need for one more entry with this key.
    fn footer_entry_len(key_len: usize) -> u64 {
        FooterEntry::encoded_len(key_len)
    }

    /// Whether a record of `len` bytes (and its footer entry) fits in the active segment.
    fn fits(&self, a: &Active<B::File>, len: u64, key_len: usize) -> bool {
        let data_end = padded(a.data_end + len);
        let footer = a.footer.len() as u64 + Self::footer_entry_len(key_len);
        // The index holds offsets in 32 bits: after a jumbo record, nothing more goes in its segment.
        a.data_end <= u32::MAX as u64 && align_up(data_end, self.align) + footer + format::TRAILER_LEN as u64 <= a.size
    }

    /// The automatic compaction a sealed segment asked for, run after the caller's records are
    /// written. It is housekeeping: its failure does not fail the write that triggered it (the
    /// records are published), it is logged, and it is tried again at the next seal.
    fn compact_if_pending(&self, st: &mut WriterState<B::File>) {
        if st.compact_pending && !st.compacting {
            st.compact_pending = false;
            if let Err(e) = self.compact_locked(st) {
                if self.warn_once(WARN_COMPACT) {
                    log::warn!("segment log {}: automatic compaction failed: {e}", self.dir.display());
                }
            }
        }
    }

    fn append(&self, st: &mut WriterState<B::File>, recs: Vec<NewRecord<'_>>) -> Result<Vec<Location>> {
        self.check_writable()?;
        let mut prepared: Vec<Prepared<'_>> = recs.into_iter().map(|r| self.prepare(r)).collect();
        let mut out = Vec::with_capacity(prepared.len());
        let mut i = 0;
        while i < prepared.len() {
            // Make sure the active segment can take at least the next record.
            let need_new = match &st.active {
                Some(a) => !self.fits(a, prepared[i].max_len(), prepared[i].rec.key().len()),
                None => true,
            };
            if need_new {
                self.rotate(st, prepared[i].max_len(), prepared[i].rec.key().len())?;
            }
            // Take as many records as fit into this segment.
            let a = st.active.as_ref().expect("active after rotate");
            let mut j = i;
            let mut end = a.data_end;
            let mut footer = a.footer.len() as u64;
            while j < prepared.len() {
                let p = &mut prepared[j];
                p.place(end);
                let new_end = padded(end + p.len);
                let new_footer = footer + Self::footer_entry_len(p.rec.key().len());
                if end > u32::MAX as u64
                    || align_up(new_end, self.align) + new_footer + format::TRAILER_LEN as u64 > a.size
                {
                    break;
                }
                end = new_end;
                footer = new_footer;
                j += 1;
            }
            assert!(j > i, "a freshly rotated segment must fit the next record");
            let locs = self.write_chunk(st, &prepared[i..j])?;
            out.extend(locs);
            i = j;
        }
        self.compact_if_pending(st);
        Ok(out)
    }

    /// Encode `chunk` into one aligned buffer, write it, then publish the new locations.
    fn write_chunk(&self, st: &mut WriterState<B::File>, chunk: &[Prepared<'_>]) -> Result<Vec<Location>> {
        // Write-behind: keep a small batch pending in the tail if it fits the budget (writing what is
        // pending first if the batch would overflow it); any other batch writes what is pending first.
        let budget = self.opts.write_behind_bytes;
        let defer = budget > 0 && chunk.iter().all(|p| !matches!(p.rec, NewRecord::SyncMark));
        let total: u64 = chunk.iter().map(|p| padded(p.len)).sum();
        let pending_len = |st: &WriterState<B::File>| st.active.as_ref().map_or(0, |a| a.tail.len() as u64);
        if defer && pending_len(st) + total > budget {
            self.flush_pending(st)?;
        }
        if defer && pending_len(st) + total <= budget {
            return self.defer_chunk(st, chunk);
        }
        self.flush_pending(st)?;
        // The chunk is encoded in groups of about WRITE_GROUP_BYTES. Each group's write covers its
        // whole blocks only; its last, partial block is rewritten by the next group (or, for the last
        // group, written with it). So the writes of one chunk never overlap, several can be in flight
        // at once (up to WRITES_IN_FLIGHT, through `write_at_async`), and group k+1 is encoded while
        // group k is being written. The chunk is published only when every write has completed.
        if self.backend.gathers_writes()
            && chunk
                .iter()
                .any(|p| matches!(p.payload, Payload::Frames(f) if laid_out_len(f) >= self.opts.gather_min_bytes))
        {
            return self.write_chunk_gathered(st, chunk);
        }
        let epoch = st.epoch;
        let align = self.align;
        let (id, file, mut data_end) = {
            let a = st.active.as_ref().expect("active segment");
            (a.id, a.file.clone(), a.data_end)
        };
        // The partial block the next group rewrites: the active segment's own tail until a group is
        // encoded (which stays in place, so that a failed write leaves the segment as it was).
        let mut tail: Option<Vec<u8>> = None;
        let mut placed: Vec<Placed> = Vec::with_capacity(chunk.len());
        let mut in_flight: std::collections::VecDeque<crate::backend::IoFuture> = std::collections::VecDeque::new();
        let mut failure: Option<io::Error> = None;
        // Without a submission queue, one write per chunk (several would only add syscalls).
        let group_bytes = if self.backend.queues_writes() { self.opts.write_group_bytes.max(1) } else { u64::MAX };
        let mut i = 0;
        while i < chunk.len() {
            let mut j = i;
            let mut total = 0u64;
            while j < chunk.len() && (j == i || total + padded(chunk[j].len) <= group_bytes) {
                total += padded(chunk[j].len);
                j += 1;
            }
            let group = &chunk[i..j];
            let last = j == chunk.len();
            let base = align_down(data_end, align);
            let end = data_end + total;
            let needed = (align_up(end, align) - base) as usize;
            let mut buf = self.write_buffer(st, needed);
            let prev: &[u8] = match &tail {
                Some(t) => t,
                None => &st.active.as_ref().expect("active segment").tail,
            };
            buf[..prev.len()].copy_from_slice(prev);
            let mut pos = data_end;
            for p in group {
                let seq = Self::seq_for(st, &p.rec);
                let at = (pos - base) as usize;
                let h = self.encode_record(p, &mut buf[at..at + p.len as usize], id, epoch, seq);
                placed.push(Placed::new(pos, &h));
                let rec_end = (pos + p.len - base) as usize;
                pos = padded(pos + p.len);
                buf[rec_end..(pos - base) as usize].fill(0); // padding between records
            }
            debug_assert_eq!(pos, end);
            buf[(end - base) as usize..].fill(0); // padding up to the aligned end
            let tail_start = align_down(end, align);
            tail = Some(buf[(tail_start - base) as usize..(end - base) as usize].to_vec());
            // Whole blocks only, except for the last group (the next group rewrites this partial block).
            let write_len = if last { needed } else { (tail_start - base) as usize };
            data_end = end;
            i = j;
            if write_len == 0 {
                st.spare_bufs.push(buf);
                continue;
            }
            buf.set_len(write_len);
            while in_flight.len() >= WRITES_IN_FLIGHT {
                let w = in_flight.pop_front().expect("non-empty");
                self.reap_write(st, w, &mut failure);
            }
            if failure.is_some() {
                st.spare_bufs.push(buf);
                break;
            }
            if last && in_flight.is_empty() {
                // Nothing to overlap with: a plain blocking write (inline on io_uring, no hand-off).
                let (r, buf) = self.backend.write_at(&file, base, buf);
                if buf.capacity() <= MAX_SPARE_BUF {
                    st.spare_bufs.push(buf);
                }
                if let Err(e) = r {
                    Self::note_failure(&mut failure, e);
                }
                break;
            }
            in_flight.push_back(self.backend.write_at_async(&file, base, buf));
        }
        while let Some(w) = in_flight.pop_front() {
            self.reap_write(st, w, &mut failure);
        }
        if let Some(e) = failure {
            // Nothing of the chunk is published, and the active segment is as it was.
            self.fence_failed_write(st, crate::error::io_no_space(&e).then_some(data_end));
            return Err(self.write_failed("write segment", self.seg_path(id), e));
        }
        let tail = tail.expect("a non-empty chunk encodes a group");
        self.publish_chunk(st, chunk, &placed, data_end, tail, epoch, false)
    }

    /// Write-behind ([`LogOptions::write_behind_bytes`]): encode `chunk` at the end of the active
    /// segment's tail, in memory, and publish it without writing. Its bytes reach the file with the
    /// next write, or [`Self::flush_pending`].
    fn defer_chunk(&self, st: &mut WriterState<B::File>, chunk: &[Prepared<'_>]) -> Result<Vec<Location>> {
        let epoch = st.epoch;
        let (id, data_end, written_end, mut tail) = {
            let a = st.active.as_mut().expect("active segment");
            (a.id, a.data_end, a.written_end, std::mem::take(&mut a.tail))
        };
        let mut placed: Vec<Placed> = Vec::with_capacity(chunk.len());
        let mut pos = data_end;
        for p in chunk {
            let seq = Self::seq_for(st, &p.rec);
            let at = tail.len();
            // Zeros: the padding after the record; encode_record writes every byte of the record.
            tail.resize(at + padded(p.len) as usize, 0);
            let h = self.encode_record(p, &mut tail[at..at + p.len as usize], id, epoch, seq);
            placed.push(Placed::new(pos, &h));
            pos = padded(pos + p.len);
        }
        if written_end == data_end {
            // The first pending record: readers must learn it before they can find it in the index.
            self.pending.store(pending_key(id, written_end), Ordering::Release);
        }
        self.publish_chunk(st, chunk, &placed, pos, tail, epoch, true)
    }

    /// Write the records pending in the active segment's tail (write-behind), if any. On failure the
    /// log is poisoned and the records stay pending, readable from memory.
    fn flush_pending(&self, st: &mut WriterState<B::File>) -> Result<()> {
        let Some(a) = st.active.as_ref() else { return Ok(()) };
        if a.written_end == a.data_end {
            return Ok(());
        }
        self.check_writable()?;
        let (id, file, data_end) = (a.id, a.file.clone(), a.data_end);
        let base = data_end - a.tail.len() as u64;
        debug_assert_eq!(base % self.align, 0, "the tail starts at a block boundary");
        let needed = (align_up(data_end, self.align) - base) as usize;
        let r = if self.backend.gathers_writes() {
            // Buffered files: straight from the tail, no copy into a staging buffer first (the tail
            // holds every pending byte, encoded once; copying it again cost as much as encoding).
            let mut parts: Vec<&[u8]> = vec![&a.tail];
            let mut zeros = needed - a.tail.len();
            while zeros > 0 {
                let k = zeros.min(ZEROS.len());
                parts.push(&ZEROS[..k]);
                zeros -= k;
            }
            self.backend.write_gather_at(&file, base, &parts)
        } else {
            let mut buf = self.write_buffer(st, needed);
            let a = st.active.as_ref().expect("active segment");
            buf[..a.tail.len()].copy_from_slice(&a.tail);
            buf[a.tail.len()..].fill(0);
            let (r, buf) = self.backend.write_at(&file, base, buf);
            if buf.capacity() <= MAX_SPARE_BUF {
                st.spare_bufs.push(buf);
            }
            r
        };
        if let Err(e) = r {
            // The records stay pending in the tail, readable from memory.
            return Err(self.write_failed("write segment", self.seg_path(id), e));
        }
        let a = st.active.as_mut().expect("active segment");
        a.tail.drain(..(align_down(data_end, self.align) - base) as usize);
        a.written_end = data_end;
        self.pending.store(NOTHING_PENDING, Ordering::Release);
        self.wrote();
        for m in st.segs.values_mut() {
            m.superseded_by_pending = false;
        }
        Ok(())
    }

    /// Whether `loc` may be a record pending in memory (write-behind). False means it is in the file.
    fn may_be_pending(&self, loc: Location) -> bool {
        let p = self.pending.load(Ordering::Acquire);
        p != NOTHING_PENDING && (p >> 32) as u32 == loc.segment && loc.offset >= p & 0xffff_ffff
    }

    /// For a record that may be pending (write-behind): its bytes copied out of memory, 64-byte
    /// aligned like a read's, or `None` if it is in the file. A copy of one record costs less than
    /// writing everything pending early, and an early write would also cut the batch short: the
    /// page cache keeps the shape of the writes that first touched it (large folios for large
    /// writes), and a 64 KiB read from pages written 64 KiB at a time costs 1.5x one from pages
    /// written 2 MiB at a time (`docs/benchmarks.md`).
    fn pending_record(&self, loc: Location) -> Result<Option<Bytes>> {
        if !self.may_be_pending(loc) {
            return Ok(None);
        }
        let st = lock(&self.state);
        let still = st.active.as_ref().is_some_and(|a| a.id == loc.segment && loc.offset >= a.written_end);
        if !still {
            return Ok(None);
        }
        let a = st.active.as_ref().expect("active segment");
        let base = a.data_end - a.tail.len() as u64;
        let from = (loc.offset - base) as usize;
        let buf = AlignedBuf::copied(&a.tail[from..from + loc.len as usize], format::FRAME_ALIGN as usize);
        Ok(Some(buf.freeze()))
    }

    /// [`Self::write_chunk`] for a chunk holding large values, on a backend that writes gathered
    /// slices (buffered files): the same bytes at the same offsets, but each large value's frames go to
    /// the kernel from their own buffers instead of being copied into a staging buffer first. Headers,
    /// small records and padding are built in a small arena.
    ///
    /// When the large payloads add up to [`LogOptions::parallel_crc_min_bytes`] or more, their crcs
    /// are computed on a helper thread while this one writes the payloads; everything else (the
    /// rewritten partial block, every record head, small records, padding) is written after, once
    /// the crcs are in the heads. A crash in between leaves nothing but payload bytes past the
    /// published end: no record of this chunk parses, so recovery ends the segment there as at a torn
    /// tail, and what lay past the end before (zeros, or the head of a record cut off as torn at an
    /// earlier recovery) is still followed by nothing valid, so it is cut again. On this machine the
    /// crc of 16 MiB costs about a third of copying it into the page cache.
    fn write_chunk_gathered(&self, st: &mut WriterState<B::File>, chunk: &[Prepared<'_>]) -> Result<Vec<Location>> {
        enum Part<'a> {
            Arena(std::ops::Range<usize>),
            Frame(&'a [u8]),
            Zeros(usize),
        }
        /// A large record whose head waits for its payload crc.
        struct Large<'a> {
            head: std::ops::Range<usize>,
            header: RecordHeader,
            frame_lens: Vec<u64>,
            key: &'a [u8],
            frames: &'a Frames,
            /// Its entry in `placed`, whose crc is filled in with the head's.
            placed: usize,
        }
        let epoch = st.epoch;
        let align = self.align;
        let (id, file, data_end, tail) = {
            // A copy of the tail (less than a block): a failed write leaves the active segment as it was.
            let a = st.active.as_ref().expect("active segment");
            (a.id, a.file.clone(), a.data_end, a.tail.clone())
        };
        let base = align_down(data_end, align);
        // The partial block before `data_end` is rewritten with the new records, as in `write_chunk`.
        let mut arena: Vec<u8> = tail;
        let mut parts: Vec<Part<'_>> = vec![Part::Arena(0..arena.len())];
        // Whether each part belongs to a large record's payload.
        let mut payload: Vec<bool> = vec![false];
        let mut large: Vec<Large<'_>> = Vec::new();
        let mut placed: Vec<Placed> = Vec::with_capacity(chunk.len());
        let mut pos = data_end;
        for p in chunk {
            let seq = Self::seq_for(st, &p.rec);
            match (&p.rec, &p.payload) {
                (NewRecord::Value { key, .. }, Payload::Frames(frames))
                    if laid_out_len(frames) >= self.opts.gather_min_bytes =>
                {
                    let frame_lens: Vec<u64> = frames.iter().map(|f| f.len() as u64).collect();
                    let (offsets, raw_len) = format::frame_layout(frame_lens.iter().copied()).expect("prepared");
                    let po = (format::head_len(frame_lens.len(), key.len()) + p.pad) as usize;
                    let header = RecordHeader {
                        flags: 0,
                        frame_count: frame_lens.len() as u16,
                        key_len: key.len() as u32,
                        segment: id,
                        epoch,
                        payload_crc: 0, // below, once known
                        seq,
                        raw_len,
                        stored_len: raw_len,
                        aux: p.pad as u32,
                    };
                    debug_assert_eq!(p.len, po as u64 + raw_len);
                    let start = arena.len();
                    arena.resize(start + po, 0);
                    large.push(Large {
                        head: start..start + po,
                        header,
                        frame_lens,
                        key,
                        frames,
                        placed: placed.len(),
                    });
                    placed.push(Placed::new(pos, &header));
                    parts.push(Part::Arena(start..start + po));
                    payload.push(false);
                    // The payload: each frame and the zeros before it.
                    let mut at = 0u64;
                    for (f, &off) in frames.iter().zip(&offsets) {
                        if off > at {
                            parts.push(Part::Zeros((off - at) as usize));
                            payload.push(true);
                        }
                        parts.push(Part::Frame(f));
                        payload.push(true);
                        at = off + f.len() as u64;
                    }
                }
                _ => {
                    let start = arena.len();
                    arena.resize(start + p.len as usize, 0);
                    let h = self.encode_record(p, &mut arena[start..], id, epoch, seq);
                    parts.push(Part::Arena(start..start + p.len as usize));
                    payload.push(false);
                    placed.push(Placed::new(pos, &h));
                }
            }
            let next = padded(pos + p.len);
            parts.push(Part::Zeros((next - pos - p.len) as usize)); // padding between records
            payload.push(false);
            pos = next;
        }
        let end = pos;
        parts.push(Part::Zeros((align_up(end, align) - end) as usize)); // up to the aligned end
        payload.push(false);

        // The slices of `parts`, back to back from `base`, each with the index of its part.
        fn slices_of<'a>(arena: &'a [u8], parts: &'a [Part<'a>]) -> Vec<(usize, &'a [u8])> {
            let mut slices = Vec::with_capacity(parts.len() + 1);
            for (i, part) in parts.iter().enumerate() {
                match part {
                    Part::Arena(r) => slices.push((i, &arena[r.clone()])),
                    Part::Frame(f) => slices.push((i, *f)),
                    Part::Zeros(mut n) => {
                        while n > 0 {
                            let k = n.min(ZEROS.len());
                            slices.push((i, &ZEROS[..k]));
                            n -= k;
                        }
                    }
                }
            }
            slices
        }
        let payload_bytes: u64 = large.iter().map(|l| l.header.raw_len).sum();
        // `None`: every part, in one gathered write. `Some(p)`: the parts whose `payload` flag is `p`,
        // one gathered write per run of consecutive ones.
        let write = |arena: &[u8], payloads: Option<bool>| -> io::Result<()> {
            let slices = slices_of(arena, &parts);
            let Some(want) = payloads else {
                let all: Vec<&[u8]> = slices.iter().map(|&(_, s)| s).collect();
                return self.backend.write_gather_at(&file, base, &all);
            };
            let mut at = base;
            let mut run: Vec<&[u8]> = Vec::new();
            let mut run_at = base;
            for &(part, sl) in &slices {
                if payload[part] == want {
                    if run.is_empty() {
                        run_at = at;
                    }
                    run.push(sl);
                } else if !run.is_empty() {
                    self.backend.write_gather_at(&file, run_at, &run)?;
                    run.clear();
                }
                at += sl.len() as u64;
            }
            if !run.is_empty() {
                self.backend.write_gather_at(&file, run_at, &run)?;
            }
            Ok(())
        };
        let crc_of = |l: &Large<'_>| -> u32 { format::laid_out_crc(l.frames.iter().map(|f| &f[..])) };
        let mut written = Ok(());
        let mut crcs: Option<Vec<u32>> = None;
        if payload_bytes >= self.opts.parallel_crc_min_bytes {
            let large_ref = &large;
            let arena_ref = &arena;
            std::thread::scope(|s| {
                let helper = std::thread::Builder::new()
                    .name("spillway-crc".into())
                    .spawn_scoped(s, || large_ref.iter().map(crc_of).collect::<Vec<u32>>());
                // Without a helper thread (resource limits), everything is written in order below.
                if let Ok(h) = helper {
                    written = write(arena_ref, Some(true));
                    crcs = Some(h.join().expect("crc32 does not panic"));
                }
            });
        }
        let deferred = crcs.is_some();
        let crcs = crcs.unwrap_or_else(|| large.iter().map(crc_of).collect());
        for (l, crc) in large.iter().zip(crcs) {
            let h = RecordHeader { payload_crc: crc, ..l.header };
            format::write_record_head(&mut arena[l.head.clone()], &h, &l.frame_lens, l.key, self.salt);
            placed[l.placed].h.payload_crc = crc;
        }
        if written.is_ok() {
            written = write(&arena, deferred.then_some(false));
        }
        if let Err(e) = written {
            // Nothing of the chunk is published, and the active segment is as it was.
            self.fence_failed_write(st, crate::error::io_no_space(&e).then_some(end));
            return Err(self.write_failed("write segment", self.seg_path(id), e));
        }
        // The new tail: the bytes of the last, partial block, gathered from the end of the slices.
        let tail_start = align_down(end, align);
        let mut new_tail = vec![0u8; (end - tail_start) as usize];
        let mut from = 0u64; // file offset of the current slice, relative to `base`
        for (_, sl) in slices_of(&arena, &parts) {
            let (s0, s1) = (base + from, base + from + sl.len() as u64);
            let (lo, hi) = (s0.max(tail_start), s1.min(end));
            if lo < hi {
                new_tail[(lo - tail_start) as usize..(hi - tail_start) as usize]
                    .copy_from_slice(&sl[(lo - s0) as usize..(hi - s0) as usize]);
            }
            from += sl.len() as u64;
        }
        debug_assert_eq!(base + from, align_up(end, align));
        self.publish_chunk(st, chunk, &placed, end, new_tail, epoch, false)
    }

    /// The sequence number of a record being written: a relocated record keeps its own, any other
    /// takes the next one.
    fn seq_for(st: &mut WriterState<B::File>, rec: &NewRecord<'_>) -> u64 {
        match rec {
            NewRecord::Relocated { header, .. } => header.seq,
            _ => {
                let s = st.next_seq;
                st.next_seq += 1;
                s
            }
        }
    }

    /// Encode one prepared record into `dst` (exactly `p.len` bytes): header, frame table, key and
    /// payload, with both checksums.
    fn encode_record(&self, p: &Prepared<'_>, dst: &mut [u8], segment: u32, epoch: u32, seq: u64) -> RecordHeader {
        match (&p.rec, &p.payload) {
            (NewRecord::Relocated { header, .. }, Payload::Relocated(bytes)) => {
                dst.copy_from_slice(bytes);
                format::relocate_record(dst, header, segment, epoch, self.salt);
                RecordHeader { segment, epoch, ..*header }
            }
            (rec, payload) => {
                let key = rec.key();
                let (flags, aux, frame_lens, raw_len): (u8, u32, Vec<u64>, u64) = match (rec, payload) {
                    (NewRecord::Tombstone { aux, .. }, _) => (format::FLAG_TOMBSTONE, *aux, Vec::new(), 0),
                    (NewRecord::SyncMark, _) => (format::FLAG_SYNC_MARK, 0, Vec::new(), 0),
                    (NewRecord::Value { frames, .. }, Payload::Compressed(_)) => (
                        format::FLAG_LZ4,
                        p.pad as u32,
                        frames.iter().map(|f| f.len() as u64).collect(),
                        laid_out_len(frames),
                    ),
                    (NewRecord::Value { frames, .. }, _) => {
                        (0, p.pad as u32, frames.iter().map(|f| f.len() as u64).collect(), laid_out_len(frames))
                    }
                    (NewRecord::Relocated { .. }, _) => {
                        unreachable!("relocated records carry their bytes")
                    }
                };
                let po = (format::head_len(frame_lens.len(), key.len()) + p.pad) as usize;
                let stored_len = p.len - po as u64;
                let w = po;
                match payload {
                    Payload::Frames(frames) => {
                        let n = laid_out_len(frames) as usize;
                        format::lay_out_frames(&mut dst[w..w + n], frames.iter().map(|f| &f[..]));
                    }
                    Payload::Compressed(c) => dst[w..w + c.len()].copy_from_slice(c),
                    Payload::Empty | Payload::Relocated(_) => {}
                }
                let h = RecordHeader {
                    flags,
                    frame_count: frame_lens.len() as u16,
                    key_len: key.len() as u32,
                    segment,
                    epoch,
                    payload_crc: format::payload_crc(&dst[po..]),
                    seq,
                    raw_len,
                    stored_len,
                    aux,
                };
                format::write_record_head(dst, &h, &frame_lens, key, self.salt);
                h
            }
        }
    }

    /// Wait for one write of `write_chunk`, keep its buffer for reuse, remember the first failure.
    fn reap_write(&self, st: &mut WriterState<B::File>, w: crate::backend::IoFuture, failure: &mut Option<io::Error>) {
        let (r, buf) = crate::task::block_on(w);
        if buf.capacity() <= MAX_SPARE_BUF {
            st.spare_bufs.push(buf);
        }
        if let Err(e) = r {
            Self::note_failure(failure, e);
        }
    }

    /// After a write of new records failed: whole records of it may lie in the file past the published
    /// end, beyond what the next write covers. Later records get a higher epoch, and recovery's scan
    /// drops a record whose epoch is lower than the one before it (as it does for a torn tail's
    /// leftovers), so those records never come back once anything was written after them. After a
    /// full file system (`erase_to`: the end of the failed write; the log stays writable), a durable
    /// log also zeroes and syncs what the write left, for the reason recovery does (see
    /// [`Self::erase_durably`]): a leftover *at* the end is not covered by the epoch rule; a failed
    /// sync then makes the log read-only. (After any other failure the log is read-only already, and
    /// recovery erases the leftovers at the next open.)
    fn fence_failed_write(&self, st: &mut WriterState<B::File>, erase_to: Option<u64>) {
        if let Some(e) = st.epoch.checked_add(1) {
            st.epoch = e;
        }
        let (Some(end), true) = (erase_to, self.opts.durable) else { return };
        let Some(a) = &st.active else { return };
        debug_assert_eq!(a.written_end, a.data_end, "pending records are written before new ones");
        let end = align_up(end, self.align).min(a.size);
        if let Err(e) = self.erase_durably(&a.file, a.id, a.data_end, &a.tail, end) {
            self.poison(e);
        }
    }

    /// Keep the first failure of a chunk's writes, unless a later one is worse than a full file
    /// system (which leaves the log writable, see [`Self::write_failed`]).
    fn note_failure(failure: &mut Option<io::Error>, e: io::Error) {
        match failure {
            Some(f) if crate::error::io_no_space(f) && !crate::error::io_no_space(&e) => *failure = Some(e),
            Some(_) => {}
            None => *failure = Some(e),
        }
    }

    /// A write buffer of `needed` bytes: a spare one if large enough, else a new one with slack.
    fn write_buffer(&self, st: &mut WriterState<B::File>, needed: usize) -> AlignedBuf {
        if let Some(k) = st.spare_bufs.iter().position(|b| b.capacity() >= needed) {
            let mut b = st.spare_bufs.swap_remove(k);
            b.set_len(needed);
            return b;
        }
        // Room to grow: the next batch of same-sized values needs a little more or less depending on
        // where the last one ended in its block. Without the slack, writing 8 MiB values alternated
        // between reusing the buffer and allocating (and faulting in) a fresh one; profiled in a dask
        // worker, that was a quarter of the spill time.
        st.spare_bufs.truncate(WRITES_IN_FLIGHT);
        let cap = (needed + (needed / 8).max(64 << 10)).min(MAX_SPARE_BUF.max(needed));
        let mut b = self.backend.alloc_buf(cap, self.align as usize);
        b.set_len(needed);
        b
    }

    /// After the bytes of `chunk` are written at `placed` (offset, len, seq) up to `end` (or, if
    /// `deferred`, encoded in `tail` and pending): update the active segment (tail, footer,
    /// metadata), then the index and the live accounting.
    #[allow(clippy::too_many_arguments)]
    fn publish_chunk(
        &self,
        st: &mut WriterState<B::File>,
        chunk: &[Prepared<'_>],
        placed: &[Placed],
        end: u64,
        tail: Vec<u8>,
        epoch: u32,
        deferred: bool,
    ) -> Result<Vec<Location>> {
        let a = st.active.as_mut().expect("active segment");
        a.dirty = true;
        a.last_is_mark = chunk.last().is_some_and(|p| matches!(p.rec, NewRecord::SyncMark));
        a.tail = tail;
        let a = st.active.as_mut().expect("active segment");
        a.data_end = end;
        if !deferred {
            a.written_end = end;
            self.wrote();
        }
        a.max_epoch = a.max_epoch.max(epoch);
        let id = a.id;
        for (p, pl) in chunk.iter().zip(placed) {
            if matches!(p.rec, NewRecord::SyncMark) {
                continue; // not in the footer: it indexes nothing
            }
            let h = &pl.h;
            let e = FooterEntry {
                key: p.rec.key().to_vec(),
                flags: h.flags & (format::FLAG_TOMBSTONE | format::FLAG_LZ4),
                frame_count: h.frame_count,
                payload_crc: if h.is_tombstone() { 0 } else { h.payload_crc },
                offset: pl.offset,
                record_len: h.record_len(),
                seq: h.seq,
                aux: h.aux,
            };
            format::encode_footer_entry(&mut a.footer, &e);
            a.footer_entries += 1;
        }
        {
            let m = st.segs.get_mut(&id).expect("active segment has metadata");
            m.data_end = end;
            m.records += chunk.iter().filter(|p| !matches!(p.rec, NewRecord::SyncMark)).count() as u64;
        }

        // Publish: update the index and the live accounting.
        let mut locs = Vec::with_capacity(chunk.len());
        let mut emptied = Vec::new();
        {
            let mut index = self.index.write().unwrap_or_else(|p| p.into_inner());
            for (p, pl) in chunk.iter().zip(placed) {
                let key = p.rec.key();
                let (offset, len, h) = (pl.offset, pl.h.record_len(), &pl.h);
                let loc = Location { segment: id, offset, len };
                match &p.rec {
                    NewRecord::Tombstone { aux, .. } => {
                        self.written_meanwhile(key, h.seq);
                        if let Some(old) = index.remove(key) {
                            Self::release(st, old.into(), &mut emptied);
                            if deferred {
                                Self::superseded_by_pending(st, old.into());
                            }
                        }
                        let m = st.segs.get_mut(&id).expect("active");
                        m.tombstones += 1;
                        m.tombstone_bytes += padded(len);
                        m.min_shadow = m.min_shadow.min(*aux);
                        locs.push(loc);
                    }
                    NewRecord::SyncMark => locs.push(loc),
                    NewRecord::Relocated { header, .. } if header.is_tombstone() => {
                        let m = st.segs.get_mut(&id).expect("active");
                        m.tombstones += 1;
                        m.tombstone_bytes += padded(len);
                        m.min_shadow = m.min_shadow.min(header.aux);
                        locs.push(loc);
                    }
                    NewRecord::Relocated { from, .. }
                        if index.get(key).is_none_or(|l| (l.segment, l.offset()) != *from) =>
                    {
                        // Forgotten while compaction copied it: the copy is dead on arrival.
                        locs.push(loc);
                    }
                    _ => {
                        if matches!(p.rec, NewRecord::Value { .. }) {
                            self.written_meanwhile(key, h.seq);
                        }
                        let first = index.get(key).map_or(id, |o| first_segment(&st.segs, o).min(id));
                        let elsewhere = note_first_segment(&mut st.segs, id, offset, first);
                        let facts = RecordFacts::of(h.flags, h.frame_count, h.payload_crc, h.aux, h.stored_len);
                        if let Some(old) = index.insert(IndexKey::from(key), PackedLoc::new(loc, facts, elsewhere)) {
                            Self::release(st, old.into(), &mut emptied);
                            if deferred {
                                Self::superseded_by_pending(st, old.into());
                            }
                        }
                        let m = st.segs.get_mut(&id).expect("active");
                        m.live_records += 1;
                        m.live_bytes += padded(len);
                        locs.push(loc);
                    }
                }
            }
        }
        if !emptied.is_empty() {
            self.reclaim(st);
        }
        Ok(locs)
    }

    /// Garbage collection after a change was published (a write, a delete, a forget): housekeeping,
    /// whose failure must not fail the change. It is logged, and the dead segment is deleted at a
    /// later garbage collection.
    fn reclaim(&self, st: &mut WriterState<B::File>) {
        if let Err(e) = self.collect_garbage(st) {
            if self.warn_once(WARN_GC) {
                log::warn!(
                    "segment log {}: cannot delete a dead segment yet ({e}); retrying at the next garbage collection",
                    self.dir.display()
                );
            }
        }
    }

    fn superseded_by_pending(st: &mut WriterState<B::File>, old: Location) {
        if let Some(m) = st.segs.get_mut(&old.segment) {
            m.superseded_by_pending = true;
        }
    }

    fn release(st: &mut WriterState<B::File>, old: Location, emptied: &mut Vec<u32>) {
        if let Some(m) = st.segs.get_mut(&old.segment) {
            m.live_records -= 1;
            m.live_bytes -= padded(old.len);
            if m.live_records == 0 {
                emptied.push(old.segment);
            }
        }
    }

    /// Whether some tombstone of segment `id` may still shadow an older record.
    fn tombstones_needed(st: &WriterState<B::File>, id: u32) -> bool {
        let m = &st.segs[&id];
        // `min_shadow <= id` always (recovery refuses a tombstone that shadows a later segment than
        // its own); checked anyway, since `range` panics on a reversed range.
        m.tombstones > 0 && m.min_shadow < id && st.segs.range(m.min_shadow..id).next().is_some()
    }

    /// Delete every non-active segment with nothing live and no tombstone still needed. Deleting one
    /// can make another's tombstones unneeded, so repeat until nothing changes.
    fn collect_garbage(&self, st: &mut WriterState<B::File>) -> Result<u64> {
        let mut deleted = 0;
        // Segments that could not be deleted this time: the others still go (on a full disk, one that
        // waits for pending records to be written must not keep the rest from freeing the space).
        let mut failed: Vec<u32> = Vec::new();
        let mut first_error = None;
        loop {
            // A log made read-only by a failed write or fdatasync changes nothing on disk any more.
            // Above all, it deletes no segment: deleting one needs the records that replaced its
            // contents to be durable, and after a failed fdatasync nothing says they are (a retry can
            // report success for pages the kernel dropped after reporting the first failure). One
            // failed deletion here may be the fdatasync that poisoned the log.
            if let Err(e) = self.check_writable() {
                first_error.get_or_insert(e);
                break;
            }
            let active = st.active.as_ref().map(|a| a.id);
            let victim = st
                .segs
                .iter()
                .filter(|(&id, m)| Some(id) != active && m.live_records == 0 && !failed.contains(&id))
                .map(|(&id, _)| id)
                .find(|&id| !Self::tombstones_needed(st, id));
            let Some(id) = victim else { break };
            match self.delete_segment(st, id) {
                Ok(()) => deleted += 1,
                Err(e) => {
                    failed.push(id);
                    first_error.get_or_insert(e);
                }
            }
        }
        match first_error {
            Some(e) => Err(e),
            None => Ok(deleted),
        }
    }

    fn delete_segment(&self, st: &mut WriterState<B::File>, id: u32) -> Result<()> {
        // Never after a failed write or fdatasync: the fdatasync below must not be a retry of one
        // that failed, and without it the segment may hold the only durable copy of its records.
        self.check_writable()?;
        // The records that made this segment dead may still be pending in memory (write-behind:
        // overwrites, or compaction's copies of its live records): write them before the old copies
        // disappear, so a process crash cannot lose both. With `durable`, also make them durable,
        // so a power cut cannot either. Only a segment some of whose records were superseded by
        // pending ones needs that write: deleting any other must not need a write, because on a full
        // file system deleting dead segments is how the pending records get room. A log whose data
        // dies with the process (`discard_existing`) has nothing to lose in a crash at all.
        let superseded = st.segs.get(&id).is_some_and(|m| m.superseded_by_pending);
        if superseded && !self.opts.discard_existing {
            self.flush_pending(st)?;
        }
        if self.opts.durable {
            if superseded {
                self.sync_active(st)?;
            } else if let Some(a) = st.active.as_ref().filter(|a| a.dirty) {
                // What superseded this segment's records is written (or they were deleted): make
                // it durable without writing what is pending, which a full disk may refuse. `dirty`
                // stays set, for the pending records.
                if let Err(e) = self.backend.sync_data(&a.file) {
                    return Err(self.poison(Error::io("fdatasync", self.seg_path(a.id), e)));
                }
            }
        }
        if self.opts.durable && st.dir_new_segments {
            // The records that replaced this segment's may live in a segment created since the
            // directory's last fsync: its entry must be durable before this unlink can be, or a
            // power cut could keep the unlink and lose the new file. (File systems that journal
            // directory operations in order do not need this; nothing promises it.)
            self.sync_dir_if_dirty(st)?;
        }
        let path = self.seg_path(id);
        match self.backend.remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            // Still a segment (in `files` and `segs`): a later garbage collection tries again.
            Err(e) => return Err(Error::io("remove segment", path, e)),
        }
        if let Some(file) = self.files.write().unwrap_or_else(|p| p.into_inner()).remove(&id) {
            // A deleted segment needs no sync. Its handle must go too: while a descriptor is open,
            // the unlinked file keeps its blocks, and a log that is never synced (a spill store)
            // would hold every dead segment's disk space until it closed.
            st.unsynced_sealed.retain(|f| !Arc::ptr_eq(f, &file));
        }
        st.segs.remove(&id);
        st.dir_dirty = true;
        Ok(())
    }

    fn sync_active(&self, st: &mut WriterState<B::File>) -> Result<()> {
        // Records pending under write-behind are part of what must be durable (sealing, `sync`, and
        // deleting a segment whose contents they superseded all rely on it).
        self.flush_pending(st)?;
        if let Some(a) = st.active.as_mut() {
            if a.dirty {
                // Never after a failed write or fdatasync (it could report success for lost data).
                self.check_writable()?;
                if let Err(e) = self.backend.sync_data(&a.file) {
                    return Err(self.poison(Error::io("fdatasync", self.seg_path(a.id), e)));
                }
                a.dirty = false;
            }
        }
        Ok(())
    }

    fn sync_dir_if_dirty(&self, st: &mut WriterState<B::File>) -> Result<()> {
        if st.dir_dirty {
            if let Err(e) = self.backend.sync_dir(&self.seg_dir) {
                return Err(self.poison(Error::io("fsync directory", self.seg_dir.clone(), e)));
            }
            st.dir_dirty = false;
            st.dir_new_segments = false;
        }
        Ok(())
    }

    /// Seal the active segment (if any) and create a new one that can hold a record of `len` bytes.
    fn rotate(&self, st: &mut WriterState<B::File>, len: u64, key_len: usize) -> Result<()> {
        if st.active.is_some() {
            self.seal_active(st)?;
            if self.opts.auto_compact && self.wants_compaction(st) {
                // Run after the caller's records are written, not in the middle of its batch (and
                // asked for here, so that a failure to create the next segment does not lose it).
                st.compact_pending = true;
            }
        }
        let data_start = self.align;
        let need = align_up(padded(data_start + len), self.align)
            + align_up(Self::footer_entry_len(key_len) + format::TRAILER_LEN as u64, self.align);
        let size = self.opts.segment_bytes.max(need);
        let id = st.next_segment;
        st.next_segment = id.checked_add(1).ok_or_else(|| Error::InvalidConfig("segment ids exhausted".into()))?;
        let path = self.seg_path(id);
        let file = self.backend.open(&path, true).map_err(|e| Error::io("create segment", path.clone(), e))?;
        let cleanup = |e: Error| {
            let _ = self.backend.remove_file(&path);
            e
        };
        self.backend.allocate(&file, size).map_err(|e| cleanup(Error::io("fallocate", path.clone(), e)))?;
        let mut hb = AlignedBuf::zeroed(self.align as usize, self.align as usize);
        let header = format::SegmentHeader {
            segment: id,
            segment_bytes: size,
            align: self.align as u32,
            epoch: st.epoch,
            data_start,
            salt: self.salt,
        };
        hb[..format::SEGMENT_HEADER_LEN].copy_from_slice(&format::encode_segment_header(&header));
        let (r, _) = self.backend.write_at(&file, 0, hb);
        r.map_err(|e| cleanup(Error::io("write segment header", path.clone(), e)))?;
        st.dir_dirty = true;
        st.dir_new_segments = true;
        let file = Arc::new(file);
        self.files.write().unwrap_or_else(|p| p.into_inner()).insert(id, file.clone());
        st.segs.insert(id, SegMeta::new(size, data_start));
        st.active = Some(Active {
            id,
            file,
            size,
            data_end: data_start,
            tail: Vec::new(),
            written_end: data_start,
            footer: Vec::new(),
            footer_entries: 0,
            max_epoch: st.epoch,
            dirty: true,
            last_is_mark: false,
        });
        Ok(())
    }

    /// Write the footer and the trailer of segment `id` (`size` bytes, records up to `data_end`):
    /// the trailer last (in its own write, or at the end of the only one), so that without it the
    /// segment is still an unsealed one whose records end at `data_end`.
    #[allow(clippy::too_many_arguments)] // the segment's facts, from an `Active` or a stream
    fn write_seal(
        &self,
        file: &B::File,
        id: u32,
        size: u64,
        data_end: u64,
        footer: &[u8],
        entries: u64,
        max_epoch: u32,
    ) -> io::Result<()> {
        let footer_offset = align_up(data_end, self.align);
        let footer_len = footer.len() as u64;
        let trailer = format::Trailer {
            segment: id,
            max_epoch,
            footer_offset,
            footer_len,
            entry_count: entries,
            data_end,
            footer_crc: format::footer_crc(footer),
            salt: self.salt,
        };
        let tb = format::encode_trailer(&trailer);
        let footer_end = align_up(footer_offset + footer_len, self.align);
        let trailer_block = size - self.align;
        let write = |offset: u64, buf: AlignedBuf| -> io::Result<()> { self.backend.write_at(file, offset, buf).0 };
        if footer_end <= trailer_block {
            let mut fb = AlignedBuf::zeroed((footer_end - footer_offset) as usize, self.align as usize);
            fb[..footer.len()].copy_from_slice(footer);
            let written = if footer_len > 0 { write(footer_offset, fb) } else { Ok(()) };
            written.and_then(|()| {
                let mut t = AlignedBuf::zeroed(self.align as usize, self.align as usize);
                t[self.align as usize - format::TRAILER_LEN..].copy_from_slice(&tb);
                write(trailer_block, t)
            })
        } else {
            let mut fb = AlignedBuf::zeroed((size - footer_offset) as usize, self.align as usize);
            fb[..footer.len()].copy_from_slice(footer);
            let n = fb.len();
            fb[n - format::TRAILER_LEN..].copy_from_slice(&tb);
            write(footer_offset, fb)
        }
    }

    /// Seal the active segment: data durable first, then footer and trailer.
    fn seal_active(&self, st: &mut WriterState<B::File>) -> Result<()> {
        self.flush_pending(st)?;
        if self.opts.durable {
            self.sync_active(st)?;
            self.sync_dir_if_dirty(st)?;
        }
        let a = st.active.as_ref().expect("active segment to seal");
        if align_up(a.data_end, self.align) + a.footer.len() as u64 + format::TRAILER_LEN as u64 > a.size {
            // Never for segments this log wrote (`fits` keeps the room) nor recovered (`recover`
            // does not continue one without it); an error, not a panic, all the same.
            return Err(Error::Corrupt {
                segment: a.id,
                offset: a.data_end,
                reason: "no room for the segment's footer and trailer after its records".into(),
            });
        }
        let a = st.active.take().expect("active segment to seal");
        let written = self.write_seal(&a.file, a.id, a.size, a.data_end, &a.footer, a.footer_entries, a.max_epoch);
        if let Err(e) = written {
            // The trailer comes last (in its own write, or at the end of the only one), so without it
            // the segment is still an unsealed one whose records end at `data_end`: it stays active.
            let err = self.write_failed("write footer", self.seg_path(a.id), e);
            st.active = Some(a);
            return Err(err);
        }
        let m = st.segs.get_mut(&a.id).expect("active has metadata");
        m.sealed = true;
        st.unsynced_sealed.push(a.file);
        Ok(())
    }

    /// Make every record written before this call durable: fdatasync the active segment, and fsync the
    /// segments directory if segments were created or removed since the last sync.
    pub fn sync(&self) -> Result<()> {
        let mut st = self.writer();
        // Under the writer lock: a sync that failed while this one waited poisoned the log, and a
        // failed fdatasync must never be retried (it can report success for data that was dropped).
        self.check_writable()?;
        if st.active.as_ref().is_some_and(|a| a.dirty && !a.last_is_mark) {
            self.append(&mut st, vec![NewRecord::SyncMark])?;
        }
        self.flush_pending(&mut st)?;
        self.sync_active(&mut st)?;
        for f in std::mem::take(&mut st.unsynced_sealed) {
            if let Err(e) = self.backend.sync_data(&f) {
                return Err(self.poison(Error::io("fdatasync", self.seg_dir.clone(), e)));
            }
        }
        self.sync_dir_if_dirty(&mut st)
    }

    // -----------------------------------------------------------------------------------------------
    // Compaction
    // -----------------------------------------------------------------------------------------------

    fn wants_compaction(&self, st: &WriterState<B::File>) -> bool {
        st.segs.iter().any(|(&id, m)| Self::closed(st, id, m) && self.is_sparse(st, id, m))
    }

    /// Whether segment `id` takes no more records: sealed, or an unsealed one that recovery found
    /// behind the newest (its footer did not land before a crash). Such segments can be compacted.
    fn closed(st: &WriterState<B::File>, id: u32, m: &SegMeta) -> bool {
        m.sealed || st.active.as_ref().is_none_or(|a| a.id != id)
    }

    fn is_sparse(&self, st: &WriterState<B::File>, id: u32, m: &SegMeta) -> bool {
        if m.unmovable {
            return false;
        }
        let tomb = if Self::tombstones_needed(st, id) { m.tombstone_bytes } else { 0 };
        (m.live_bytes + tomb) * 2 < m.size - m.punched.min(m.size)
    }

    /// Relocate the live records of every sealed segment (or unsealed one behind the active one, see
    /// `closed`) that is less than half live, then delete it. Afterwards every such segment holds at
    /// least half its size in live data (see
    /// `docs/architecture.md` for the resulting space-amplification bound).
    pub fn compact(&self) -> Result<CompactStats> {
        let mut st = self.writer();
        self.check_writable()?; // under the lock, as in `sync`
        self.compact_locked(&mut st)
    }

    fn compact_locked(&self, st: &mut WriterState<B::File>) -> Result<CompactStats> {
        st.compacting = true;
        let r = self.compact_inner(st);
        st.compacting = false;
        r
    }

    fn compact_inner(&self, st: &mut WriterState<B::File>) -> Result<CompactStats> {
        let mut stats = CompactStats::default();
        let before: u64 = st.segs.values().map(|m| m.size).sum();
        let before_ids: Vec<u32> = st.segs.keys().copied().collect();
        self.collect_garbage(st)?;
        let victims: Vec<u32> = st
            .segs
            .iter()
            .filter(|(&id, m)| Self::closed(st, id, m) && self.is_sparse(st, id, m))
            .map(|(&id, _)| id)
            .collect();
        for id in victims {
            if !st.segs.contains_key(&id) {
                continue;
            }
            let (moved, bytes) = self.relocate_segment(st, id)?;
            stats.records_moved += moved;
            stats.bytes_moved += bytes;
            stats.segments_compacted += 1;
            self.collect_garbage(st)?;
        }
        // Deletions also happen inside appends (a relocation can empty a segment): count by difference.
        stats.segments_deleted = before_ids.iter().filter(|id| !st.segs.contains_key(id)).count() as u64;
        let after: u64 = st.segs.values().map(|m| m.size).sum();
        stats.bytes_freed = before.saturating_sub(after);
        Ok(stats)
    }

    /// Copy the live records and needed tombstones of segment `id` to the active segment.
    fn relocate_segment(&self, st: &mut WriterState<B::File>, id: u32) -> Result<(u64, u64)> {
        let file = match self.files.read().unwrap_or_else(|p| p.into_inner()).get(&id) {
            Some(f) => f.clone(),
            None => return Ok((0, 0)),
        };
        let mut report = RecoveryReport::default();
        let scan = self.load_segment(id, &file, &mut report)?;
        let index_snapshot: Vec<(FooterEntry, bool)> = {
            let index = self.index.read().unwrap_or_else(|p| p.into_inner());
            scan.entries
                .into_iter()
                .map(|e| {
                    let keep = if e.flags & format::FLAG_TOMBSTONE != 0 {
                        // Needed while a segment it shadows exists, unless the key is live again with
                        // a record whose own (future) tombstone will shadow at least as far back. A key
                        // deleted and then put again gets a `first_segment` after this tombstone's
                        // `aux`: dropping the tombstone then let an old copy come back once the new
                        // record was deleted too (found by the `log_model` fuzz target).
                        e.aux < id
                            && st.segs.range(e.aux..id).next().is_some()
                            && index.get(e.key.as_slice()).is_none_or(|l| first_segment(&st.segs, l) > e.aux)
                    } else {
                        index.get(e.key.as_slice()).is_some_and(|l| l.segment == id && l.offset() == e.offset)
                    };
                    (e, keep)
                })
                .collect()
        };
        let mut moved = 0;
        let mut bytes = 0;
        // Relocate in bounded batches so memory stays proportional to the batch, not the segment.
        let mut batch: Vec<(Bytes, u64)> = Vec::new();
        let mut batch_bytes = 0u64;
        let flush = |st: &mut WriterState<B::File>, batch: &mut Vec<(Bytes, u64)>| -> Result<()> {
            let recs: Vec<NewRecord<'_>> = batch
                .iter()
                .map(|(b, offset)| {
                    let header = format::peek_record_header(b).expect("verified before relocation");
                    NewRecord::Relocated {
                        bytes: b,
                        header,
                        key: &b[header.key_offset()..header.key_offset() + header.key_len as usize],
                        from: (id, *offset),
                    }
                })
                .collect();
            self.append(st, recs)?;
            batch.clear();
            Ok(())
        };
        // Tombstones to keep that could not be moved (damaged): the segment must keep them. Their
        // count, bytes and oldest shadowed segment. And whether any record to keep could not be.
        let (mut stuck_tombstones, mut stuck_bytes, mut stuck_shadow) = (0u64, 0u64, u32::MAX);
        let mut stuck = false;
        for (e, keep) in index_snapshot {
            if !keep {
                continue;
            }
            let loc = Location { segment: id, offset: e.offset, len: e.record_len };
            let raw = self.read_record_bytes(&file, loc)?;
            let checked = format::decode_record(&raw, self.salt).and_then(|r| {
                // The index entry of the copy comes from the header, its place from the footer
                // entry: they must agree (only a crafted footer with a valid crc can differ).
                entry_matches(&e, &r.header).then_some(()).ok_or(format::DecodeError::Invalid(FOOTER_MISMATCH))
            });
            if let Err(err) = checked {
                // A damaged record stays where it is (its segment is kept) and is reported. A live
                // value keeps its segment by being live; a tombstone does by its count, below.
                log::warn!("compaction leaves damaged record in place: {}", err.at(id, e.offset));
                stuck = true;
                if e.flags & format::FLAG_TOMBSTONE != 0 {
                    stuck_tombstones += 1;
                    stuck_bytes += padded(e.record_len);
                    stuck_shadow = stuck_shadow.min(e.aux);
                }
                continue;
            }
            moved += 1;
            bytes += e.record_len;
            batch_bytes += e.record_len;
            batch.push((raw, e.offset));
            if batch_bytes >= 8 << 20 {
                flush(st, &mut batch)?;
                batch_bytes = 0;
            }
        }
        if !batch.is_empty() {
            flush(st, &mut batch)?;
        }
        // Tombstones moved out: this segment's tombstones are no longer needed here, except those
        // that could not be moved. They stay counted, so the segment (and with it each damaged
        // tombstone, which recovery still honours through the footer) is kept while they are needed.
        let pending = st.active.as_ref().is_some_and(|a| a.written_end != a.data_end);
        if let Some(m) = st.segs.get_mut(&id) {
            // Copies still pending in memory (write-behind) stand in for this segment's records,
            // its tombstones included: the segment may go only once they are written.
            m.superseded_by_pending |= pending;
            m.tombstones = stuck_tombstones;
            m.tombstone_bytes = stuck_bytes;
            m.min_shadow = stuck_shadow;
            m.unmovable |= stuck;
        }
        Ok((moved, bytes))
    }

    // -----------------------------------------------------------------------------------------------
    // Inspection
    // -----------------------------------------------------------------------------------------------

    /// Space accounting.
    pub fn stats(&self) -> LogStats {
        let st = self.writer();
        let mut s = LogStats::default();
        for (&id, m) in &st.segs {
            s.segments += 1;
            s.sealed_segments += m.sealed as u64;
            s.records += m.records;
            s.live_records += m.live_records;
            let tomb = if Self::tombstones_needed(&st, id) { m.tombstone_bytes } else { 0 };
            s.live_bytes += m.live_bytes + tomb;
            let used = m.data_end - m.data_start;
            s.used_bytes += used;
            s.dead_bytes += used.saturating_sub(m.live_bytes + tomb);
            s.tombstones += m.tombstones;
            s.disk_bytes += m.size;
        }
        s
    }

    /// Read every record of every segment and check its checksums. Returns the problems found (empty
    /// when the store is clean), including damaged regions found at open.
    pub fn verify(&self) -> Result<Vec<VerifyProblem>> {
        // Hold the writer lock so the active segment is not changing under the scan, and check the
        // file with nothing pending in memory (write-behind).
        let mut st = self.writer();
        self.flush_pending(&mut st)?;
        let mut problems: Vec<VerifyProblem> = self
            .recovery
            .corrupt
            .iter()
            .map(|(s, o, r)| VerifyProblem { segment: *s, offset: *o, key: None, error: r.clone() })
            .collect();
        let ids: Vec<(u32, Arc<B::File>)> = {
            let files = self.files.read().unwrap_or_else(|p| p.into_inner());
            let mut v: Vec<_> = files.iter().map(|(&id, f)| (id, f.clone())).collect();
            v.sort_by_key(|(id, _)| *id);
            v
        };
        for (id, file) in ids {
            let mut report = RecoveryReport::default();
            let scan = match self.load_segment(id, &file, &mut report) {
                Ok(s) => s,
                Err(e) => {
                    problems.push(VerifyProblem { segment: id, offset: 0, key: None, error: e.to_string() });
                    continue;
                }
            };
            for e in scan.entries {
                let loc = Location { segment: id, offset: e.offset, len: e.record_len };
                // A dead large record: forgetting it may have punched its payload out, so only its
                // head (which a punch keeps) is checked.
                let head_only = self.opts.punch_forgotten
                    && e.record_len >= PUNCH_MIN_BYTES
                    && e.flags & format::FLAG_TOMBSTONE == 0
                    && self.location(&e.key).is_none_or(|l| l.segment != id || l.offset != e.offset);
                let err = match self.read_record_bytes(&file, loc) {
                    Ok(raw) if head_only => match format::peek_record_header(&raw)
                        .and_then(|h| format::verify_record_head(&raw, &h, self.salt).map(|_| h))
                    {
                        Ok(h) if entry_matches(&e, &h) => None,
                        Ok(_) => Some(Error::Corrupt { segment: id, offset: e.offset, reason: FOOTER_MISMATCH.into() }),
                        Err(d) => Some(d.at(id, e.offset)),
                    },
                    Ok(raw) => match format::decode_record(&raw, self.salt) {
                        Ok(r) if r.key == e.key.as_slice() && entry_matches(&e, &r.header) => None,
                        Ok(_) => Some(Error::Corrupt { segment: id, offset: e.offset, reason: FOOTER_MISMATCH.into() }),
                        Err(d) => Some(d.at(id, e.offset)),
                    },
                    Err(err) => Some(err),
                };
                if let Some(err) = err {
                    problems.push(VerifyProblem {
                        segment: id,
                        offset: e.offset,
                        key: Some(e.key),
                        error: err.to_string(),
                    });
                }
            }
        }
        // One line per place; prefer the entry that knows the key.
        problems.sort_by_key(|p| (p.segment, p.offset, p.key.is_none()));
        problems.dedup_by_key(|p| (p.segment, p.offset));
        Ok(problems)
    }
}

const FOOTER_MISMATCH: &str = "record differs from its footer entry";

/// Whether footer entry `e` says what record header `h` says: recovery builds index entries (the
/// payload crc, frame count and padding that reads without the head trust) from footer entries.
fn entry_matches(e: &FooterEntry, h: &RecordHeader) -> bool {
    let kind = format::FLAG_TOMBSTONE | format::FLAG_LZ4;
    let crc_ok = if h.is_tombstone() {
        e.payload_crc == 0 || e.payload_crc == h.payload_crc
    } else {
        e.payload_crc == h.payload_crc
    };
    e.seq == h.seq
        && e.record_len == h.record_len()
        && e.flags & kind == h.flags & kind
        && e.frame_count == h.frame_count
        && e.aux == h.aux
        && crc_ok
}

enum Probe {
    Record(FooterEntry, RecordHeader, bool),
    Invalid { stale_epoch: u32 },
}

/// How a search after unparseable bytes ended.
enum Resync {
    /// An acceptable record starts here.
    Record(u64),
    /// Nothing acceptable follows: the unparseable bytes end here.
    Garbage { end: u64 },
}

/// What lies past a clean end (zeros to the end of the next whole block) of a segment's records.
enum PastEnd {
    /// A sync mark lies beyond, so the zeros are damage; the scan goes on at `next`, the first
    /// acceptable record after them.
    Synced { next: u64 },
    /// Nothing synced lies beyond: records there are orphans of a batch that never completed, and
    /// everything up to `end` is cut.
    Orphans { end: u64 },
}

/// The sync marks of a segment being scanned, as (offset, epoch) in file order, and for each the
/// highest epoch among it and those after it.
struct SyncMarks {
    marks: Vec<(u64, u32)>,
    max_epoch_after: Vec<u32>,
}

impl SyncMarks {
    fn new(marks: Vec<(u64, u32)>) -> Self {
        let mut max_epoch_after = vec![0; marks.len()];
        let mut max = 0;
        for (i, &(_, epoch)) in marks.iter().enumerate().rev() {
            max = max.max(epoch);
            max_epoch_after[i] = max;
        }
        SyncMarks { marks, max_epoch_after }
    }

    /// Whether a sync mark lies after `pos` with an epoch of at least `epoch`.
    fn acceptable_beyond(&self, pos: u64, epoch: u32) -> bool {
        let i = self.marks.partition_point(|&(at, _)| at <= pos);
        i < self.marks.len() && self.max_epoch_after[i] >= epoch
    }
}

/// A sliding read window over a segment file, for scanning.
struct ScanWindow<'a, B: Backend> {
    log: &'a SegmentLog<B>,
    file: &'a B::File,
    path: &'a Path,
    /// Segment size: reads stay below it.
    size: u64,
    /// Records must end at or before this (the trailer's bytes are never record bytes).
    limit: u64,
    start: u64,
    buf: Option<AlignedBuf>,
}

impl<'a, B: Backend> ScanWindow<'a, B> {
    fn new(log: &'a SegmentLog<B>, file: &'a B::File, path: &'a Path, size: u64) -> Self {
        let limit = size.saturating_sub(format::TRAILER_LEN as u64);
        ScanWindow { log, file, path, size, limit, start: 0, buf: None }
    }

    /// `len` bytes at `off` (must be within `limit`).
    fn bytes(&mut self, off: u64, len: u64) -> Result<&[u8]> {
        let have = self.buf.as_ref().is_some_and(|b| off >= self.start && off + len <= self.start + b.len() as u64);
        if !have {
            let align = self.log.align;
            let start = align_down(off, align);
            let need_end = align_up(off + len, align);
            let end = (start + SCAN_WINDOW as u64).min(self.size).max(need_end);
            let buf = self.log.read_aligned(self.file, start, (end - start) as usize, self.path)?;
            self.start = start;
            self.buf = Some(buf);
        }
        let b = self.buf.as_ref().expect("window filled");
        let from = (off - self.start) as usize;
        Ok(&b[from..from + len as usize])
    }

    fn crc_of(&mut self, off: u64, len: u64) -> Result<u32> {
        let mut h = crc32fast::Hasher::new();
        let mut at = off;
        while at < off + len {
            let n = (off + len - at).min(SCAN_WINDOW as u64);
            h.update(self.bytes(at, n)?);
            at += n;
        }
        Ok(h.finalize())
    }

    /// Whether everything from `off` to the end of the next full block is zero (or past the limit).
    fn is_zero_from(&mut self, off: u64) -> Result<bool> {
        let end = (align_up(off + 1, self.log.align) + self.log.align).min(self.limit);
        if off >= end {
            return Ok(true);
        }
        Ok(self.bytes(off, end - off)?.iter().all(|&b| b == 0))
    }

    fn is_zero_block(&mut self, off: u64) -> Result<bool> {
        let end = (off + self.log.align).min(self.limit);
        if off >= end {
            return Ok(true);
        }
        Ok(self.bytes(off, end - off)?.iter().all(|&b| b == 0))
    }
}

impl<B: Backend> Drop for SegmentLog<B> {
    /// Writes what is pending (write-behind), so that a log dropped without `sync` has handed every
    /// record to the kernel, as without write-behind.
    fn drop(&mut self) {
        let mut st = self.writer();
        if let Err(e) = self.flush_pending(&mut st) {
            log::error!("segment log {}: pending records not written at close: {e}", self.dir.display());
        }
    }
}

/// A read of a record, planned by [`SegmentLog::plan_read`].
#[derive(Debug, Clone, Copy)]
struct ReadPlan {
    loc: Location,
    /// The aligned file range to read.
    start: u64,
    end: u64,
    /// The bytes wanted in it: the record, or its payload.
    from: u64,
    len: u64,
    /// With only the payload read: its crc, from the index.
    crc: Option<u32>,
}

impl ReadPlan {
    /// Decode what was read (`buf` holds the file range `start..end`) into the key's value. A
    /// payload read without its head is checked against the crc the index keeps; it is the one
    /// frame of the value.
    fn finish(&self, buf: Bytes, key: &[u8], salt: Salt) -> Result<Frames> {
        self.finish_with_crc(buf, key, salt).map(|(frames, _)| frames)
    }

    /// [`ReadPlan::finish`], with the crc the value was checked against (see
    /// [`SegmentLog::get_with_crc`]).
    fn finish_with_crc(&self, buf: Bytes, key: &[u8], salt: Salt) -> Result<(Frames, Option<u32>)> {
        let at = (self.from - self.start) as usize;
        let raw = buf.slice(at..at + self.len as usize);
        let Some(expected) = self.crc else {
            return decode_read_with_crc(raw, self.loc, key, salt);
        };
        let actual = format::payload_crc(&raw);
        if actual != expected {
            let e = format::DecodeError::Checksum { what: "record payload", expected, actual };
            return Err(e.at(self.loc.segment, self.loc.offset));
        }
        // One frame, no gaps: its crc is the laid-out crc.
        Ok((Frames(std::iter::once(raw).collect()), Some(actual)))
    }
}

/// Check the record bytes read for `key` at `loc` and cut them into frames (decompressing if needed).
fn decode_read(raw: Bytes, loc: Location, key: &[u8], salt: Salt) -> Result<Frames> {
    decode_read_with_crc(raw, loc, key, salt).map(|(frames, _)| frames)
}

/// [`decode_read`], with the payload crc when the record is not compressed (the laid-out crc of the
/// frames, which `decode_record` checked).
fn decode_read_with_crc(raw: Bytes, loc: Location, key: &[u8], salt: Salt) -> Result<(Frames, Option<u32>)> {
    let r = format::decode_record(&raw, salt).map_err(|e| e.at(loc.segment, loc.offset))?;
    if r.key != key || r.header.segment != loc.segment || r.header.is_tombstone() {
        return Err(Error::Corrupt {
            segment: loc.segment,
            offset: loc.offset,
            reason: "record does not match the index (key, segment or kind)".into(),
        });
    }
    let h = r.header;
    let po = h.payload_offset() as usize;
    let data: Bytes = if h.is_lz4() {
        let mut out = AlignedBuf::zeroed(h.raw_len as usize, 64);
        match lz4_flex::block::decompress_into(r.payload, &mut out) {
            Ok(n) if n as u64 == h.raw_len => out.freeze(),
            Ok(_) | Err(_) => {
                return Err(Error::Corrupt {
                    segment: loc.segment,
                    offset: loc.offset,
                    reason: "lz4 payload does not decompress to its recorded length".into(),
                })
            }
        }
    } else {
        raw.slice(po..po + h.stored_len as usize)
    };
    let (offsets, _) = format::frame_layout(r.frame_lens.iter().copied()).expect("checked when decoding");
    let frames = r.frame_lens.iter().zip(offsets).map(|(&l, at)| data.slice(at as usize..(at + l) as usize)).collect();
    Ok((Frames(frames), (!h.is_lz4()).then_some(h.payload_crc)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SimBackend;

    fn opts() -> LogOptions {
        LogOptions { segment_bytes: 64 * 1024, ..Default::default() }
    }

    #[test]
    fn put_get_delete_reopen_sim() {
        let be = SimBackend::new();
        let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
        log.put(b"a", &Frames::from(b"one".to_vec())).unwrap();
        log.put(b"b", &Frames(vec![Bytes::from_static(b"x"), Bytes::from_static(b"yz")])).unwrap();
        log.put(b"a", &Frames::from(b"two".to_vec())).unwrap();
        assert!(log.delete(b"b").unwrap());
        assert!(!log.delete(b"nope").unwrap());
        assert_eq!(log.get(b"a").unwrap().unwrap().concat(), &b"two"[..]);
        assert!(log.get(b"b").unwrap().is_none());
        drop(log);
        let log = SegmentLog::open(be, "/s", opts()).unwrap();
        assert_eq!(log.get(b"a").unwrap().unwrap().concat(), &b"two"[..]);
        assert!(log.get(b"b").unwrap().is_none());
        assert_eq!(log.keys(), vec![b"a".to_vec()]);
    }

    #[test]
    fn get_with_crc_gives_the_laid_out_crc_it_checked() {
        let values: Vec<Frames> = vec![
            Frames(vec![Bytes::from_static(b"x"), Bytes::from_static(b"yz"), Bytes::new()]),
            Frames::from(vec![5u8; 5000]), // one frame of 4 KiB or more: read without its head
            Frames::from(Vec::<u8>::new()),
        ];
        for write_behind_bytes in [0, 1 << 20] {
            let log = SegmentLog::open(SimBackend::new(), "/s", LogOptions { write_behind_bytes, ..opts() }).unwrap();
            for (i, v) in values.iter().enumerate() {
                log.put(format!("k{i}").as_bytes(), v).unwrap();
            }
            for (i, v) in values.iter().enumerate() {
                let (frames, crc) = log.get_with_crc(format!("k{i}").as_bytes()).unwrap().unwrap();
                assert_eq!(frames.0, v.0);
                assert_eq!(crc, Some(format::laid_out_crc(v.iter().map(|b| &b[..]))), "value {i}");
            }
        }
        // An lz4 record's crc covers its compressed bytes: none is given.
        let log =
            SegmentLog::open(SimBackend::new(), "/z", LogOptions { compression: Compression::Lz4, ..opts() }).unwrap();
        log.put(b"z", &Frames::from(vec![0u8; 4096])).unwrap();
        let (frames, crc) = log.get_with_crc(b"z").unwrap().unwrap();
        assert_eq!(frames.concat(), vec![0u8; 4096]);
        assert_eq!(crc, None);
    }

    #[test]
    fn seg_names() {
        assert_eq!(parse_seg_file_name(&seg_file_name(0xabc)), Some(0xabc));
        assert_eq!(parse_seg_file_name("zz.seg"), None);
        assert_eq!(parse_seg_file_name("0000000g.seg"), None);
    }
}
