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
//!   [`SegmentLog::compact`] relocates live records out of segments the [`CompactionPolicy`] finds
//!   sparse (by default, less than half live).
//!
//! Where each rule lives:
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | [`SegmentLog`] and its public methods, opening (built from what recovery found), the writer lock, running the compaction a seal asked for |
//! | `health.rs` | poisoning after a failed write, warnings logged once (`Health`) |
//! | `options.rs` | [`LogOptions`], [`Compression`], [`CompactionPolicy`] |
//! | `location.rs` | [`Location`] and the packed index entry |
//! | `table.rs` | the segment table (`SegmentTable` of `SegMeta`: the only writer of per-segment accounting) |
//! | `index.rs` | the index (`Index`): each live key's record, changed with its segment's accounting in one step (`Publisher`) |
//! | `segments.rs` | the active segment and its pending tail, rotate / seal, write buffers |
//! | `recover.rs` | opening: footers, scans, which record of a key wins, torn tails (`SegmentReader`) |
//! | `scan.rs` | reading a segment record by record, resync past damage (`Scanner`); [`RecoveryReport`] |
//! | `read.rs` | gets, pipelined and async reads, the stored form for sending |
//! | `write.rs` | puts, deletes, sync, batching into segments and write groups |
//! | `record.rs` | a record on its way into a segment: encoding, publishing a written chunk through the index, fencing a failed write |
//! | `gather.rs` | large payloads written from their own frames |
//! | `write_behind.rs` | small writes held in a pending buffer |
//! | `stream.rs` | `put_stream`: values read from a socket or file |
//! | `gc.rs` | releasing dead records, hole punching, deleting empty segments or keeping their files for reuse |
//! | `compact.rs` | relocation out of sparse segments |
//! | `verify.rs` | stats and read-back verification |
//!
//! See `docs/architecture.md` for the write and recovery paths step by step, and `docs/format.md`
//! for the bytes.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

// The index and writer locks come from the sync shim, so the store's loom models see every log call
// that touches the index (a read racing a removal, for one) as a step to interleave.
use crate::sync::{Mutex, MutexGuard, RwLock};

use self::gc::{discard_segments, settle_forgotten, Forgotten, Punches, SegmentFiles};
use self::health::{Health, WARN_COMPACT};
use self::index::Index;
use self::read::Sends;
use self::recover::SegmentReader;
use self::segments::{flush_pending, WriterState};
use self::stream::Streams;
use self::write_behind::PendingMark;
use crate::backend::{Backend, DirLock, PortableBackend};
use crate::error::{Error, Result};
use crate::format::{self, align_up, Salt, RECORD_ALIGN};
use crate::value::Frames;
use bytes::Bytes;
use std::future::Future;

mod compact;
mod gather;
mod gc;
mod health;
mod index;
mod location;
mod options;
mod read;
mod record;
mod recover;
mod scan;
mod segments;
mod stream;
mod table;
mod verify;
mod write;
mod write_behind;

pub use self::compact::CompactStats;
pub use self::location::Location;
pub use self::options::{CompactionPolicy, Compression, LogOptions};
pub use self::read::StoredValue;
pub use self::scan::RecoveryReport;
pub use self::verify::{LogStats, VerifyProblem};
pub use self::write_behind::MAX_WRITE_BEHIND_BYTES;
pub use crate::stored::StreamedValue;

/// Name of the sub-directory holding segment files.
pub const SEGMENTS_DIR: &str = "segments";

/// Smallest accepted segment size.
pub const MIN_SEGMENT_BYTES: u64 = 64 * 1024;

/// Largest write buffer kept for reuse between writes.
const MAX_SPARE_BUF: usize = 64 << 20;

/// Memory page size (x86-64, aarch64 with 4 KiB pages): the alignment of O_DIRECT read buffers.
const PAGE_BYTES: u64 = 4096;

/// Zeros for padding in gathered writes.
static ZEROS: [u8; 4096] = [0; 4096];

/// The highest sequence number a log writes: one whose records reach it opens read-only (see
/// `recover`). Below it, a log's life cannot exhaust the counter (2^63 more writes).
const SEQ_LIMIT: u64 = 1 << 63;

/// Largest segment size accepted (offsets in the index are 32-bit).
pub const MAX_SEGMENT_BYTES: u64 = (4 << 30) - (1 << 20);

/// Largest value accepted (record lengths in the index are 32-bit).
pub const MAX_VALUE_BYTES: u64 = (4 << 30) - (1 << 20);

/// Largest record (value, frame table, key and gaps): the index holds lengths in 32 bits.
const MAX_RECORD_BYTES: u64 = u32::MAX as u64;

/// Largest segment file the writer makes: a jumbo segment (see `rotate`) for the largest record with
/// the longest key, at the largest alignment. A segment header claiming more is damage.
const MAX_SEGMENT_FILE_BYTES: u64 = {
    const ALIGN: u64 = 65536;
    let data = align_up(align_up(ALIGN + MAX_RECORD_BYTES, RECORD_ALIGN), ALIGN);
    let footer_entry = align_up((format::FOOTER_ENTRY_FIXED_LEN + format::MAX_KEY_BYTES) as u64, format::FOOTER_ALIGN);
    data + align_up(footer_entry + format::TRAILER_LEN as u64, ALIGN)
};

const _: () = assert!(MAX_SEGMENT_FILE_BYTES >= MAX_SEGMENT_BYTES);

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
    index: Index,
    files: SegmentFiles<B::File>,
    state: Mutex<WriterState<B::File>>,
    /// Hole punches of forgotten records, off the caller's thread.
    punches: Punches<B::File>,
    /// Records forgotten while the writer lock was busy.
    forgotten: Forgotten,
    /// What is being sent from the log's files, and what was (`stored_value`).
    sends: Sends,
    /// Values streaming into segments of their own (`put_stream`).
    streams: Streams,
    /// Where records are pending in the active segment's tail (write-behind).
    pending: PendingMark,
    /// Whether it may still write, and the warnings already logged.
    health: Health,
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
            self.log.health.poison(Error::io("write", None, e));
        }
    }
}

fn seg_file_name(id: u32) -> String {
    format!("{id:08x}.seg")
}

/// The path of segment `id` in the segments directory `seg_dir`.
fn segment_path(seg_dir: &Path, id: u32) -> PathBuf {
    seg_dir.join(seg_file_name(id))
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

/// The log's directory and its segments directory, made if allowed (`create_if_missing`) and
/// missing.
fn create_dirs<B: Backend>(backend: &B, dir: &Path, seg_dir: &Path, create_if_missing: bool) -> Result<()> {
    if !backend.is_dir(seg_dir) {
        if !create_if_missing {
            let reason =
                if backend.is_dir(dir) { "no segments directory".to_string() } else { "no such directory".to_string() };
            return Err(Error::NotAStore { path: dir.to_path_buf(), reason });
        }
        backend.create_dir_all(seg_dir).map_err(|e| Error::io("create store directory", seg_dir.to_path_buf(), e))?;
        // Make the new directories themselves durable.
        backend.sync_dir(dir).map_err(|e| Error::io("fsync directory", dir.to_path_buf(), e))?;
    }
    Ok(())
}

/// Options no log accepts: sizes beyond the index's 32 bits or below the minimum, a write-behind
/// budget above its maximum, a compaction policy out of range, reuse without discarding.
fn check_options(opts: &LogOptions) -> Result<()> {
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
    opts.compaction.validate()?;
    if opts.recycle_segments && !opts.discard_existing {
        return Err(Error::InvalidConfig(
            "recycle_segments needs discard_existing: a reused file keeps old bytes recovery would read".into(),
        ));
    }
    if opts.segment_bytes < MIN_SEGMENT_BYTES {
        return Err(Error::InvalidConfig(format!(
            "segment_bytes {} is below the minimum {MIN_SEGMENT_BYTES}",
            opts.segment_bytes
        )));
    }
    Ok(())
}

impl<B: Backend> Drop for SegmentLog<B> {
    /// Writes what is pending (write-behind), so that a log dropped without `sync` has handed every
    /// record to the kernel, as without write-behind. (For a log opened with `discard_existing`, a
    /// spill log, a failure is only a debug message: its records die with it.)
    fn drop(&mut self) {
        let mut st = self.writer();
        if let Err(e) = flush_pending(self, &mut st) {
            let level = if self.opts.discard_existing { log::Level::Debug } else { log::Level::Error };
            log::log!(level, "segment log {}: pending records not written at close: {e}", self.dir.display());
        }
        // Files kept for reuse hold nothing live: they go with the log.
        for spare in std::mem::take(&mut st.spare_files) {
            let _ = self.backend.remove_file(&self.seg_path(spare.id()));
        }
        drop(st);
        self.punches.stop();
    }
}

impl<B: Backend> SegmentLog<B> {
    /// Open (and recover) the log in `dir`, creating it if allowed.
    pub fn open(backend: B, dir: impl AsRef<Path>, opts: LogOptions) -> Result<Self> {
        let dir = dir.as_ref().to_path_buf();
        let seg_dir = dir.join(SEGMENTS_DIR);
        create_dirs(&backend, &dir, &seg_dir, opts.create_if_missing)?;
        let lock = backend.lock_dir(&dir).map_err(|e| {
            if e.kind() == io::ErrorKind::WouldBlock {
                Error::Locked { path: dir.clone() }
            } else {
                Error::io("lock store directory", dir.clone(), e)
            }
        })?;
        let align = match opts.alignment {
            Some(a) if a.is_power_of_two() && (512..=65536).contains(&a) => a as u64,
            Some(a) => return Err(Error::InvalidConfig(format!("alignment {a} is not a power of two in 512..=65536"))),
            None => backend.alignment(&dir).clamp(512, 65536) as u64,
        };
        let read_align = (backend.read_alignment(&dir).clamp(format::FRAME_ALIGN as usize, 65536) as u64).min(align);
        check_options(&opts)?;
        let mut opts = opts;
        opts.segment_bytes = align_up(opts.segment_bytes, align);
        // A spill log starts empty; with `recycle_segments` the files of its last run's segments
        // become spare files for its new ones.
        let spare_files = if opts.discard_existing { discard_segments(&backend, &seg_dir, &opts)? } else { Vec::new() };
        let spares: Vec<u32> = spare_files.iter().map(|s| s.id()).collect();
        let reader = SegmentReader::new(&backend, (&dir, &seg_dir), &opts, align, Salt(0));
        let found = reader.recover(&spares)?;
        // Above the spare files' ids too: a reused file is renamed, and must never replace a segment.
        let next_segment = spares.iter().map(|id| id + 1).fold(found.next_segment, u32::max);
        let health = Health::new(dir.clone(), found.read_only);
        Ok(SegmentLog {
            backend,
            dir,
            seg_dir,
            opts,
            align,
            read_align,
            index: Index::new(found.index),
            files: Arc::new(RwLock::new(found.files)),
            punches: Punches::new(),
            state: Mutex::new(WriterState {
                active: found.active,
                segs: found.segs,
                next_segment,
                next_seq: found.next_seq,
                epoch: found.epoch,
                dir_dirty: found.dir_dirty,
                dir_new_segments: found.dir_dirty,
                compact_pending: false,
                compacting: false,
                unsynced_sealed: found.unsynced,
                spare_bufs: Vec::new(),
                spare_files,
                no_rename: false,
            }),
            forgotten: Forgotten::new(),
            sends: Sends::new(),
            streams: Streams::new(),
            pending: PendingMark::new(),
            health,
            recovery: found.report,
            salt: found.salt,
            _lock: lock,
        })
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
        self.health.poisoned()
    }

    /// What recovery found at open.
    pub fn recovery_report(&self) -> &RecoveryReport {
        &self.recovery
    }

    fn seg_path(&self, id: u32) -> PathBuf {
        segment_path(&self.seg_dir, id)
    }

    /// The segment reader, for what rereads a segment from its file (`verify`, compaction, erasing
    /// what a failed write left).
    fn reader(&self) -> SegmentReader<'_, B> {
        SegmentReader::new(&self.backend, (&self.dir, &self.seg_dir), &self.opts, self.align, self.salt)
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

    /// The writer lock, after settling what `forget` left for it while it was busy.
    fn writer(&self) -> Writer<'_, B> {
        let mut st = Writer { st: lock(&self.state), log: self, panicking: std::thread::panicking() };
        settle_forgotten(self, &mut st);
        st
    }

    /// The automatic compaction a sealed segment asked for, run after the caller's records are
    /// written. It is housekeeping: its failure does not fail the write that triggered it (the
    /// records are published), it is logged, and it is tried again at the next seal.
    fn compact_if_pending(&self, st: &mut WriterState<B::File>) {
        if st.compact_pending && !st.compacting {
            st.compact_pending = false;
            if let Err(e) = compact::compact_locked(self, st) {
                if self.health.warn_once(WARN_COMPACT) {
                    log::warn!("segment log {}: automatic compaction failed: {e}", self.dir.display());
                }
            }
        }
    }

    /// Store `value` under `key`, replacing any previous value. Returns once the record is written to
    /// the kernel (it survives a process crash); call [`sync`](Self::sync) for power-loss durability.
    /// With [`LogOptions::write_behind_bytes`], a small record may instead be pending in memory when
    /// this returns (readable at once, written with a later write, `sync` or drop).
    pub fn put(&self, key: &[u8], value: &Frames) -> Result<()> {
        write::put(self, key, value)
    }

    /// Store several values with as few writes as possible (one aligned write per segment touched).
    /// Not atomic across segments: if it fails, the values of the segments written before the failure
    /// are stored, the others are not (each value is either its old or its new one, never damaged).
    pub fn put_many(&self, items: &[(&[u8], &Frames)]) -> Result<()> {
        write::put_many(self, items)
    }

    /// Whether `value` can be stored under `key`: what [`put_many`](Self::put_many) checks for
    /// every item before it writes any (key and value limits, frame count, record length).
    pub fn validate(&self, key: &[u8], frames: &Frames) -> Result<()> {
        write::validate(self, key, frames)
    }

    /// Delete `key`. Returns whether it was live. Writes a tombstone so the deletion survives reopen.
    pub fn delete(&self, key: &[u8]) -> Result<bool> {
        write::delete(self, key)
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
        write::forget(self, key)
    }

    /// Store a value whose stored form arrives from `src` (a peer's socket), without holding it in
    /// memory (beyond 1 MiB, or an eighth of a segment) and without holding the writer lock while it
    /// arrives: a value of at most that many stored bytes is read first, then appended like any
    /// record; a larger one is written into a segment of its own as the bytes arrive (see
    /// `put_stream_apart`). The payload checksum is computed on the way, and the key is published
    /// only when all `meta.stored_len` bytes arrived, match `meta.payload_crc` and, for an lz4
    /// block, decompress to `meta.raw_len` (`stored::PayloadCheck`). On a short read
    /// (the sender hung up), a read error or a checksum mismatch, nothing becomes visible, nothing
    /// of the value stays on disk, and the log stays usable. A write of the key published while the
    /// value arrives wins over it (the streamed record is dead on arrival).
    pub fn put_stream(&self, key: &[u8], meta: &StreamedValue, src: &mut dyn io::Read) -> Result<()> {
        stream::put_stream(self, key, meta, src)
    }

    /// Make every record written before this call durable: fdatasync the active segment, and fsync the
    /// segments directory if segments were created or removed since the last sync.
    pub fn sync(&self) -> Result<()> {
        write::sync(self)
    }

    /// Wait until the hole punches of the records forgotten so far have run
    /// ([`LogOptions::punch_forgotten`]: they run on the log's punch thread, and `forget` returns
    /// without waiting). After it, the files' allocated blocks no longer count those records.
    pub fn settle_punches(&self) {
        write::settle_punches(self)
    }

    /// The value stored under `key`, or `None`. A damaged record is an error naming its segment and
    /// offset; other records are unaffected.
    pub fn get(&self, key: &[u8]) -> Result<Option<Frames>> {
        read::get(self, key)
    }

    /// As [`SegmentLog::get`], with the crc this read checked the value against when the record is
    /// not compressed: [`format::laid_out_crc`] of the frames returned (`None` for an lz4 record,
    /// whose crc covers the compressed bytes). A caller that needs to know later whether a value
    /// still serializes to these bytes gets it without another pass over them.
    pub fn get_with_crc(&self, key: &[u8]) -> Result<Option<(Frames, Option<u32>)>> {
        read::get_with_crc(self, key)
    }

    /// As [`SegmentLog::get`], but the read runs as a future: with the io_uring backend many reads
    /// from one thread are in flight at once (the index lookup happens before the first poll). The
    /// future owns everything it needs, so it may outlive borrows of the log; dropping it early is
    /// safe (the backend keeps the buffer until the kernel is done with it). Unlike `get`, it cannot
    /// look the key up again after a failed read: a read racing a `forget` of the same key may report
    /// the punched record as damaged. ([`Store::get_async`](crate::Store::get_async) checks whether
    /// the key is still there before it reports an error.)
    pub fn get_async(&self, key: &[u8]) -> impl Future<Output = Result<Option<Frames>>> + Send + 'static {
        read::get_async(self, key)
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
        read::get_pipelined(self, depth, keys, on_value)
    }

    /// Where `key`'s record is, if it is live.
    pub fn location(&self, key: &[u8]) -> Option<Location> {
        read::location(self, key)
    }

    /// Whether `key` is live.
    pub fn contains(&self, key: &[u8]) -> bool {
        read::contains(self, key)
    }

    /// Number of live keys.
    pub fn len(&self) -> usize {
        read::len(self)
    }

    /// True when no key is live.
    pub fn is_empty(&self) -> bool {
        read::is_empty(self)
    }

    /// All live keys, sorted.
    pub fn keys(&self) -> Vec<Vec<u8>> {
        read::keys(self)
    }

    /// Where `key`'s stored form is on disk, for sending it without reading it into memory: the
    /// segment file, the payload's offset in it, and the record's metadata (header checksum
    /// verified). `None` if the key is absent.
    pub fn stored_value(&self, key: &[u8]) -> Result<Option<StoredValue<B::File>>> {
        read::stored_value(self, key)
    }

    /// The stored payload of `sv` read into memory (the transfer's copy path).
    pub fn read_stored(&self, sv: &StoredValue<B::File>) -> Result<Bytes> {
        read::read_stored(self, sv)
    }

    /// `len` bytes of `sv`'s stored payload from `from` (an aligned read, sliced): the payload a
    /// piece at a time, for a sender that must not hold a whole value in memory.
    pub fn read_stored_part(&self, sv: &StoredValue<B::File>, from: u64, len: u64) -> Result<Bytes> {
        read::read_stored_part(self, sv, from, len)
    }

    /// Relocate the live records of every sealed segment (or unsealed one behind the active one, see
    /// `closed`) that the [`CompactionPolicy`] finds sparse, then delete it. Afterwards no closed
    /// segment is sparse, which bounds disk use ([`CompactionPolicy::disk_bound`]).
    pub fn compact(&self) -> Result<CompactStats> {
        compact::compact(self)
    }

    /// Space accounting.
    pub fn stats(&self) -> LogStats {
        verify::stats(self)
    }

    /// Read every record of every segment and check its checksums. Returns the problems found (empty
    /// when the store is clean), including damaged regions found at open.
    pub fn verify(&self) -> Result<Vec<VerifyProblem>> {
        verify::verify(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SimBackend;
    use bytes::Bytes;

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
