//! The on-disk byte layout of segment files: segment header, records, footer index and trailer.
//!
//! This module owns every byte the log writes; nothing else encodes or decodes them. All integers are
//! little-endian. `docs/format.md` is the same description in prose and must stay in step.
//!
//! ```text
//! segment file (segment_bytes, preallocated)
//! +--------------------+  0
//! | segment header     |  64 B, padded to one alignment block (`data_start`)
//! +--------------------+  data_start
//! | record             |  each record starts 64-byte aligned; records are contiguous
//! | record             |
//! | ...                |
//! +--------------------+  data_end            (sealed segments only from here)
//! | footer entries     |  starts aligned; one entry per key record (sync marks get none)
//! +--------------------+
//! | ... zeros ...      |
//! | trailer            |  last 64 B of the file
//! +--------------------+  segment_bytes
//!
//! record (56 B header)
//!  off size field
//!    0   4  magic        "SPRC"
//!    4   1  version      4
//!    5   1  flags        bit0 LZ4 payload, bit1 TOMBSTONE, bit2 SYNC_MARK; other bits zero
//!    6   2  frame_count  number of frames in the value
//!    8   4  key_len
//!   12   4  segment      id of the segment this copy of the record lives in
//!   16   4  epoch        open epoch of the writer; non-decreasing along a segment
//!   20   4  payload_crc  crc32 of the stored payload bytes
//!   24   8  seq          sequence number: a new record takes the next one; a compaction copy keeps
//!                        its original's (so along a segment seq is not monotonic)
//!   32   8  raw_len      length of the laid-out frames (uncompressed payload, see below)
//!   40   8  stored_len   payload bytes that follow the key and its padding
//!   48   4  aux          tombstone: oldest segment that may hold an older version of the key;
//!                        value: payload padding, a multiple of 64 below 512 (PAYLOAD_PAD_LIMIT);
//!                        sync mark: 0
//!   52   4  header_crc   crc32 of the log's salt (8 bytes), then bytes 0..52 and 56..payload start
//!                        (frame table, key, padding)
//!   56  8*n frame table  frame lengths (u64 each)
//!    .      key
//!    .      zero padding to the next multiple of 64 (FRAME_ALIGN) from the record start, then
//!           `aux` more zero bytes for a value (the writer puts a large single-frame payload at a
//!           multiple of 512 in the file, so that it can be read without its head)
//!    .      payload      stored_len bytes: the frames laid out with each one starting at a multiple of
//!                        64 from the payload start, zeros between (or an lz4 block of that layout)
//!    .      zero padding to the next multiple of 64 (records start at multiples of 64)
//!
//! Records start at multiples of 64 in the file and segment data starts aligned, so every frame read
//! back into an aligned buffer starts 64-byte aligned: consumers (numpy, Arrow) wrap it without a copy,
//! and SIMD code sees the same alignment whichever tier the value comes from (numpy's float sums
//! depend on it, so unaligned frames would make results differ in the last bit from dask's own store).
//!
//! footer entry (40 B + key, padded to 8 = FOOTER_ALIGN)
//!    0   4  key_len     4  1 flags (LZ4, TOMBSTONE)   5  1 reserved   6  2 frame_count
//!    8   8  offset      16 8 record_len (unpadded)   24 8 seq   32 4 aux   36 4 payload_crc
//!   40   .  key
//!
//! trailer (last 64 B of a sealed segment)
//!    0   4  magic "SPTR"   4 2 version   6 2 reserved   8 4 segment   12 4 max_epoch
//!   16   8  footer_offset  24 8 footer_len  32 8 entry_count  40 8 data_end
//!   48   4  footer_crc     52 8 salt        60 4 trailer_crc (of bytes 0..60)
//!
//! segment header (first 64 B)
//!    0   8  magic "SPILLSEG"  8 4 version  12 4 segment  16 8 segment_bytes  24 4 align
//!   28   4  epoch   32 8 data_start   40 8 salt   48 12 reserved   60 4 header_crc (of bytes 0..60)
//! ```
//!
//! The salt is a random number a log draws when it opens without a segment that names one, and
//! writes into every segment header and trailer. It is mixed into every record's header crc, so that bytes a value's
//! author chose cannot pass for a record (see [`Salt`]).

/// Format version written by this build (records, footers, trailers, segment headers).
pub const FORMAT_VERSION: u8 = 4;
/// Longest key accepted, in bytes.
pub const MAX_KEY_BYTES: usize = 64 * 1024;
/// Most frames a value may have.
pub const MAX_FRAMES: usize = u16::MAX as usize;
/// Fixed part of a record.
pub const RECORD_HEADER_LEN: usize = 56;
/// Fixed part of a footer entry.
pub const FOOTER_ENTRY_FIXED_LEN: usize = 40;
/// Size of the trailer at the end of a sealed segment.
pub const TRAILER_LEN: usize = 64;
/// Size of the segment header at the start of every segment.
pub const SEGMENT_HEADER_LEN: usize = 64;
/// Records start at multiples of this (and so do their payloads and frames).
pub const RECORD_ALIGN: u64 = 64;
/// Frames start at multiples of this from the payload start; the payload at a multiple of it from the
/// record start.
pub const FRAME_ALIGN: u64 = 64;
/// Footer entries are padded to multiples of this.
pub const FOOTER_ALIGN: u64 = 8;
/// A value record's payload padding (`aux`) is below this; the writer uses it to start a large
/// single-frame payload at a multiple of this in the file, so that a read of the value alone is a
/// read of whole sectors (4096 bytes for a 4 KiB value instead of 4608 with its head).
pub const PAYLOAD_PAD_LIMIT: u64 = 512;

const RECORD_MAGIC: [u8; 4] = *b"SPRC";
const TRAILER_MAGIC: [u8; 4] = *b"SPTR";
const SEGMENT_MAGIC: [u8; 8] = *b"SPILLSEG";

/// Record flag: the payload is an lz4 block of the laid-out frames (each at a multiple of 64).
pub const FLAG_LZ4: u8 = 1;
/// Record flag: the record deletes its key.
pub const FLAG_TOMBSTONE: u8 = 2;
/// Record flag: a sync mark, written by `sync()` just before the fdatasync. It has no key and no
/// payload and is never indexed; it proves to recovery that the records before it were complete, so
/// damage to them is corruption to report, not a torn tail to cut.
pub const FLAG_SYNC_MARK: u8 = 4;
const KNOWN_FLAGS: u8 = FLAG_LZ4 | FLAG_TOMBSTONE | FLAG_SYNC_MARK;

const _: () = assert!(RECORD_HEADER_LEN % 8 == 0);
const _: () = assert!(FOOTER_ENTRY_FIXED_LEN as u64 % FOOTER_ALIGN == 0);
const _: () = assert!(RECORD_ALIGN % FRAME_ALIGN == 0);
const _: () = assert!(SEGMENT_HEADER_LEN <= 512 && TRAILER_LEN <= 512);

/// Why bytes failed to decode. Locations are added by the caller, which knows the segment and offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DecodeError {
    /// Fewer bytes than the structure needs.
    Truncated {
        /// Bytes needed.
        need: u64,
        /// Bytes available.
        have: u64,
    },
    /// The magic number is wrong: not this structure at all.
    BadMagic,
    /// A version this build does not know.
    UnsupportedVersion(u32),
    /// A field holds an impossible value.
    Invalid(&'static str),
    /// A checksum does not match.
    Checksum {
        /// What the checksum covers.
        what: &'static str,
        /// Stored value.
        expected: u32,
        /// Computed value.
        actual: u32,
    },
}

impl DecodeError {
    /// Attach the location the bytes came from.
    pub fn at(self, segment: u32, offset: u64) -> crate::Error {
        use crate::Error;
        match self {
            DecodeError::Checksum { what, expected, actual } => {
                Error::ChecksumMismatch { segment, offset, what, expected, actual }
            }
            DecodeError::UnsupportedVersion(found) => {
                Error::UnsupportedVersion { what: "segment", found, supported: FORMAT_VERSION as u32 }
            }
            DecodeError::Truncated { need, have } => {
                Error::Corrupt { segment, offset, reason: format!("truncated: need {need} bytes, have {have}") }
            }
            DecodeError::BadMagic => Error::Corrupt { segment, offset, reason: "bad magic".into() },
            DecodeError::Invalid(why) => Error::Corrupt { segment, offset, reason: why.into() },
        }
    }
}

/// Round `n` up to a multiple of `align` (a power of two).
pub const fn align_up(n: u64, align: u64) -> u64 {
    (n + align - 1) & !(align - 1)
}

/// Round `n` down to a multiple of `align` (a power of two).
pub const fn align_down(n: u64, align: u64) -> u64 {
    n & !(align - 1)
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes(b[at..at + 2].try_into().expect("2 bytes"))
}
fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}
fn u64_at(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}
fn put_u16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_le_bytes());
}
fn put_u32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_le_bytes());
}
fn put_u64(b: &mut [u8], at: usize, v: u64) {
    b[at..at + 8].copy_from_slice(&v.to_le_bytes());
}

/// The log's secret, mixed into every record header crc (it is the first 8 bytes the crc covers).
///
/// Recovery searches for records at 64-byte positions after damage, and a value's bytes are the
/// bytes of its author, who may have put a record there that passes a plain crc32: a key with a
/// winning sequence number, or an epoch or sequence number at its maximum. Not knowing the salt, the
/// author cannot compute a header crc that verifies: each crafted record passes with a chance of
/// 2^-32 (the crc's state after the salt is what the author would have to guess). The salt is no
/// secret from whoever can read the segment files: it is in their headers and trailers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Salt(pub u64);

impl Salt {
    /// A fresh random salt: a hash of the time, the process and `seed` under the standard library's
    /// randomly keyed SipHash (`RandomState`, seeded from the operating system's random source).
    pub fn random(seed: &[u8]) -> Salt {
        use std::hash::{BuildHasher, RandomState};
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        Salt(RandomState::new().hash_one((now.as_nanos(), std::process::id(), seed)))
    }
}

fn header_crc(salt: Salt, fixed: &[u8], rest: &[u8]) -> u32 {
    crc(&[&salt.0.to_le_bytes(), fixed, rest])
}

fn crc(parts: &[&[u8]]) -> u32 {
    let mut h = crc32fast::Hasher::new();
    for p in parts {
        h.update(p);
    }
    h.finalize()
}

// ---------------------------------------------------------------------------------------------------
// Records
// ---------------------------------------------------------------------------------------------------

/// The fixed fields of a record header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordHeader {
    /// `FLAG_*` bits.
    pub flags: u8,
    /// Number of frames (entries in the frame table).
    pub frame_count: u16,
    /// Key length in bytes.
    pub key_len: u32,
    /// Segment this copy lives in.
    pub segment: u32,
    /// Writer's open epoch.
    pub epoch: u32,
    /// crc32 of the stored payload.
    pub payload_crc: u32,
    /// Sequence number.
    pub seq: u64,
    /// Length of the laid-out frames (the uncompressed payload: frames at multiples of 64, zeros
    /// between), which is at least the sum of the frame lengths.
    pub raw_len: u64,
    /// Payload bytes on disk.
    pub stored_len: u64,
    /// Tombstones: oldest segment that may hold an older version of the key. Values: zero bytes
    /// between the key's padding and the payload (a multiple of 64 below [`PAYLOAD_PAD_LIMIT`]).
    /// Sync marks: 0.
    pub aux: u32,
}

impl RecordHeader {
    /// True for a delete marker.
    pub fn is_tombstone(&self) -> bool {
        self.flags & FLAG_TOMBSTONE != 0
    }
    /// True for a sync mark.
    pub fn is_sync_mark(&self) -> bool {
        self.flags & FLAG_SYNC_MARK != 0
    }
    /// True when the payload is lz4-compressed.
    pub fn is_lz4(&self) -> bool {
        self.flags & FLAG_LZ4 != 0
    }
    /// Offset of the key from the record start.
    pub fn key_offset(&self) -> usize {
        RECORD_HEADER_LEN + 8 * self.frame_count as usize
    }
    /// Offset of the payload from the record start: after the key, padded to [`FRAME_ALIGN`], and
    /// after a value's payload padding (`aux`).
    pub fn payload_offset(&self) -> u64 {
        let pad = if self.is_tombstone() { 0 } else { self.aux as u64 };
        align_up(self.key_offset() as u64 + self.key_len as u64, FRAME_ALIGN) + pad
    }
    /// Unpadded record length.
    pub fn record_len(&self) -> u64 {
        self.payload_offset() + self.stored_len
    }
}

/// Unpadded length of a record with these parts, without payload padding.
pub fn record_len(frame_count: usize, key_len: usize, stored_len: u64) -> u64 {
    head_len(frame_count, key_len) + stored_len
}

/// Offset of the payload from the record start without payload padding: header, frame table and
/// key, padded to [`FRAME_ALIGN`].
pub fn head_len(frame_count: usize, key_len: usize) -> u64 {
    align_up((RECORD_HEADER_LEN + 8 * frame_count + key_len) as u64, FRAME_ALIGN)
}

/// The payload padding that starts the payload of a record at `offset` in the file, whose head
/// (without padding) is `head_len` bytes, at a multiple of [`PAYLOAD_PAD_LIMIT`].
pub fn payload_pad(offset: u64, head_len: u64) -> u64 {
    let at = offset + head_len;
    align_up(at, PAYLOAD_PAD_LIMIT) - at
}

/// Where each frame starts in the laid-out payload, and the layout's total length: frame `i` starts at
/// the first multiple of [`FRAME_ALIGN`] at or after the end of frame `i - 1`. `None` on overflow.
pub fn frame_layout(lens: impl IntoIterator<Item = u64>) -> Option<(Vec<u64>, u64)> {
    let mut offsets = Vec::new();
    let mut end: u64 = 0;
    for l in lens {
        let start = end.checked_add(FRAME_ALIGN - 1)? & !(FRAME_ALIGN - 1);
        offsets.push(start);
        end = start.checked_add(l)?;
    }
    Some((offsets, end))
}

/// Copy `frames` into `dst` at their [`frame_layout`] offsets, zeroing the gaps; `dst` must be exactly
/// the layout's length.
pub fn lay_out_frames<'a>(dst: &mut [u8], frames: impl IntoIterator<Item = &'a [u8]>) {
    let mut at = 0usize;
    for f in frames {
        let start = align_up(at as u64, FRAME_ALIGN) as usize;
        dst[at..start].fill(0);
        dst[start..start + f.len()].copy_from_slice(f);
        at = start + f.len();
    }
    debug_assert_eq!(at, dst.len(), "destination is the layout's length");
}

/// crc32 of `frames` laid out as `lay_out_frames` lays them out (zero gaps included), without
/// copying them: the `payload_crc` of an uncompressed record holding these frames.
pub fn laid_out_crc<'a>(frames: impl IntoIterator<Item = &'a [u8]>) -> u32 {
    const GAP: [u8; FRAME_ALIGN as usize] = [0; FRAME_ALIGN as usize];
    let mut h = crc32fast::Hasher::new();
    let mut at = 0u64;
    for f in frames {
        let start = align_up(at, FRAME_ALIGN);
        h.update(&GAP[..(start - at) as usize]);
        h.update(f);
        at = start + f.len() as u64;
    }
    h.finalize()
}

/// Write header, frame table and key of a record into `dst[..payload_offset]` and compute the header
/// crc with the log's `salt`. The payload must already be at `dst[payload_offset..]` and
/// `h.payload_crc` must be its crc.
pub fn write_record_head(dst: &mut [u8], h: &RecordHeader, frame_lens: &[u64], key: &[u8], salt: Salt) {
    assert_eq!(frame_lens.len(), h.frame_count as usize, "frame table length");
    assert_eq!(key.len(), h.key_len as usize, "key length");
    dst[0..4].copy_from_slice(&RECORD_MAGIC);
    dst[4] = FORMAT_VERSION;
    dst[5] = h.flags;
    put_u16(dst, 6, h.frame_count);
    put_u32(dst, 8, h.key_len);
    put_u32(dst, 12, h.segment);
    put_u32(dst, 16, h.epoch);
    put_u32(dst, 20, h.payload_crc);
    put_u64(dst, 24, h.seq);
    put_u64(dst, 32, h.raw_len);
    put_u64(dst, 40, h.stored_len);
    put_u32(dst, 48, h.aux);
    for (i, l) in frame_lens.iter().enumerate() {
        put_u64(dst, RECORD_HEADER_LEN + 8 * i, *l);
    }
    let ko = h.key_offset();
    dst[ko..ko + key.len()].copy_from_slice(key);
    let po = h.payload_offset() as usize;
    dst[ko + key.len()..po].fill(0);
    let c = header_crc(salt, &dst[0..52], &dst[RECORD_HEADER_LEN..po]);
    put_u32(dst, 52, c);
}

/// crc32 of a payload, as stored in `payload_crc`.
pub fn payload_crc(payload: &[u8]) -> u32 {
    crc(&[payload])
}

/// The [`payload_crc`] of a payload checked piece by piece, possibly on several threads: each
/// consecutive piece's [`PayloadCrc::of`], combined in order with [`PayloadCrc::then`].
#[derive(Clone)]
pub struct PayloadCrc(crc32fast::Hasher);

impl PayloadCrc {
    /// The crc state of one piece.
    pub fn of(piece: &[u8]) -> Self {
        let mut h = crc32fast::Hasher::new();
        h.update(piece);
        PayloadCrc(h)
    }

    /// The crc state of this piece followed by `next`.
    pub fn then(mut self, next: &PayloadCrc) -> Self {
        self.0.combine(&next.0);
        self
    }

    /// The crc of the pieces combined so far.
    pub fn value(self) -> u32 {
        self.0.finalize()
    }
}

/// Decode and verify the 56-byte fixed header only (no crc: that needs the frame table and key).
/// Used to learn how many bytes the full header needs.
pub fn peek_record_header(b: &[u8]) -> Result<RecordHeader, DecodeError> {
    if b.len() < RECORD_HEADER_LEN {
        return Err(DecodeError::Truncated { need: RECORD_HEADER_LEN as u64, have: b.len() as u64 });
    }
    if b[0..4] != RECORD_MAGIC {
        return Err(DecodeError::BadMagic);
    }
    if b[4] != FORMAT_VERSION {
        // Records are read only from segments whose header's version was checked at open: another
        // version byte here is damage (reported with the record's location), not a newer format.
        return Err(DecodeError::Invalid("record version differs from its segment's format version"));
    }
    let h = RecordHeader {
        flags: b[5],
        frame_count: u16_at(b, 6),
        key_len: u32_at(b, 8),
        segment: u32_at(b, 12),
        epoch: u32_at(b, 16),
        payload_crc: u32_at(b, 20),
        seq: u64_at(b, 24),
        raw_len: u64_at(b, 32),
        stored_len: u64_at(b, 40),
        aux: u32_at(b, 48),
    };
    if h.flags & !KNOWN_FLAGS != 0 {
        return Err(DecodeError::Invalid("unknown record flags"));
    }
    if h.key_len as usize > MAX_KEY_BYTES {
        return Err(DecodeError::Invalid("key length over the limit"));
    }
    if h.stored_len > (1u64 << 48) || h.raw_len > (1u64 << 48) {
        return Err(DecodeError::Invalid("payload length out of range"));
    }
    if (h.is_tombstone() || h.is_sync_mark()) && (h.frame_count != 0 || h.stored_len != 0 || h.raw_len != 0) {
        return Err(DecodeError::Invalid("tombstone or sync mark with a payload"));
    }
    if h.is_sync_mark() && (h.key_len != 0 || h.flags != FLAG_SYNC_MARK || h.aux != 0) {
        return Err(DecodeError::Invalid("sync mark with a key, other flags or aux"));
    }
    if !h.is_tombstone() && (h.aux as u64 % FRAME_ALIGN != 0 || h.aux as u64 >= PAYLOAD_PAD_LIMIT) {
        return Err(DecodeError::Invalid("payload padding not a multiple of 64 below 512"));
    }
    if h.is_tombstone() && h.aux > h.segment {
        // A tombstone shadows older segments only: the oldest segment that may hold an older version
        // of its key is at most its own (a compaction copy keeps the original's, which is older
        // still). The log looks up the segments in `aux..segment`.
        return Err(DecodeError::Invalid("tombstone shadows a segment after its own"));
    }
    if h.is_lz4() && !lz4_lengths_fit(h.stored_len, h.raw_len) {
        // A reader allocates `raw_len` bytes to decompress into: a header with valid checksums (a
        // crafted one) must not make it ask for terabytes.
        return Err(DecodeError::Invalid("lz4 raw_len beyond what its payload can expand to"));
    }
    if !h.is_lz4() && h.raw_len != h.stored_len {
        return Err(DecodeError::Invalid("uncompressed record with raw_len != stored_len"));
    }
    Ok(h)
}

/// Verify the header crc (with the log's `salt`) over the fixed header, frame table and key; `b` must
/// hold at least `h.payload_offset()` bytes. Returns the frame lengths.
pub fn verify_record_head(b: &[u8], h: &RecordHeader, salt: Salt) -> Result<Vec<u64>, DecodeError> {
    let need = h.payload_offset();
    if (b.len() as u64) < need {
        return Err(DecodeError::Truncated { need, have: b.len() as u64 });
    }
    let key_end = h.key_offset() + h.key_len as usize;
    if b[key_end..need as usize].iter().any(|&x| x != 0) {
        return Err(DecodeError::Invalid("non-zero padding after the key"));
    }
    let actual = header_crc(salt, &b[0..52], &b[RECORD_HEADER_LEN..need as usize]);
    let expected = u32_at(b, 52);
    if actual != expected {
        return Err(DecodeError::Checksum { what: "record header", expected, actual });
    }
    let frames: Vec<u64> = (0..h.frame_count as usize).map(|i| u64_at(b, RECORD_HEADER_LEN + 8 * i)).collect();
    let (_, laid_out) = frame_layout(frames.iter().copied()).ok_or(DecodeError::Invalid("frame lengths overflow"))?;
    if laid_out != h.raw_len {
        return Err(DecodeError::Invalid("laid-out frame lengths do not match raw_len"));
    }
    Ok(frames)
}

/// A record decoded from a byte slice, borrowing key and payload from it.
#[derive(Debug)]
pub struct RecordRef<'a> {
    /// Fixed fields.
    pub header: RecordHeader,
    /// Frame lengths.
    pub frame_lens: Vec<u64>,
    /// The key.
    pub key: &'a [u8],
    /// The stored payload (compressed when `header.is_lz4()`).
    pub payload: &'a [u8],
}

/// Decode a whole record from the start of `b` and verify both checksums (the header's with `salt`).
pub fn decode_record(b: &[u8], salt: Salt) -> Result<RecordRef<'_>, DecodeError> {
    let header = peek_record_header(b)?;
    let frame_lens = verify_record_head(b, &header, salt)?;
    let len = header.record_len();
    if (b.len() as u64) < len {
        return Err(DecodeError::Truncated { need: len, have: b.len() as u64 });
    }
    let ko = header.key_offset();
    let po = header.payload_offset() as usize;
    let payload = &b[po..len as usize];
    let actual = payload_crc(payload);
    if actual != header.payload_crc {
        return Err(DecodeError::Checksum { what: "record payload", expected: header.payload_crc, actual });
    }
    Ok(RecordRef { header, frame_lens, key: &b[ko..ko + header.key_len as usize], payload })
}

/// Rewrite, in place, the `segment` and `epoch` of a verified record copy and recompute its header
/// crc. Used when compaction relocates a record: payload, key, seq and payload crc are unchanged.
pub fn relocate_record(b: &mut [u8], h: &RecordHeader, segment: u32, epoch: u32, salt: Salt) {
    put_u32(b, 12, segment);
    put_u32(b, 16, epoch);
    let c = header_crc(salt, &b[0..52], &b[RECORD_HEADER_LEN..h.payload_offset() as usize]);
    put_u32(b, 52, c);
}

// ---------------------------------------------------------------------------------------------------
// Footer and trailer
// ---------------------------------------------------------------------------------------------------

/// One footer entry: where a record of the segment is and what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FooterEntry {
    /// The record's key.
    pub key: Vec<u8>,
    /// Record flags: TOMBSTONE and LZ4 (never SYNC_MARK: sync marks have no entry).
    pub flags: u8,
    /// The record's frame count (0 for a tombstone).
    pub frame_count: u16,
    /// The record's payload crc (0 for a tombstone): the index keeps it, so that a value can be
    /// read and checked without its head.
    pub payload_crc: u32,
    /// Record offset in the segment.
    pub offset: u64,
    /// Unpadded record length.
    pub record_len: u64,
    /// Record sequence number.
    pub seq: u64,
    /// Record aux field.
    pub aux: u32,
}

impl FooterEntry {
    /// Encoded length, padded to 8.
    pub fn encoded_len(key_len: usize) -> u64 {
        align_up((FOOTER_ENTRY_FIXED_LEN + key_len) as u64, FOOTER_ALIGN)
    }
}

/// Append the encoding of `e` to `out`.
pub fn encode_footer_entry(out: &mut Vec<u8>, e: &FooterEntry) {
    let start = out.len();
    out.resize(start + FooterEntry::encoded_len(e.key.len()) as usize, 0);
    let b = &mut out[start..];
    put_u32(b, 0, e.key.len() as u32);
    b[4] = e.flags;
    put_u16(b, 6, e.frame_count);
    put_u64(b, 8, e.offset);
    put_u64(b, 16, e.record_len);
    put_u64(b, 24, e.seq);
    put_u32(b, 32, e.aux);
    put_u32(b, 36, e.payload_crc);
    b[FOOTER_ENTRY_FIXED_LEN..FOOTER_ENTRY_FIXED_LEN + e.key.len()].copy_from_slice(&e.key);
}

/// Decode `count` footer entries from `b`, checking every length against `b` and `segment_bytes`.
pub fn decode_footer(b: &[u8], count: u64, segment_bytes: u64) -> Result<Vec<FooterEntry>, DecodeError> {
    // Each entry takes at least FOOTER_ENTRY_FIXED_LEN bytes: bound the allocation by the input.
    if count > (b.len() / FOOTER_ENTRY_FIXED_LEN) as u64 {
        return Err(DecodeError::Invalid("footer entry count larger than the footer"));
    }
    let mut out = Vec::with_capacity(count as usize);
    let mut pos = 0usize;
    for _ in 0..count {
        if b.len() - pos < FOOTER_ENTRY_FIXED_LEN {
            return Err(DecodeError::Truncated { need: (pos + FOOTER_ENTRY_FIXED_LEN) as u64, have: b.len() as u64 });
        }
        let e = &b[pos..];
        let key_len = u32_at(e, 0) as usize;
        if key_len > MAX_KEY_BYTES {
            return Err(DecodeError::Invalid("footer key length over the limit"));
        }
        let len = FooterEntry::encoded_len(key_len) as usize;
        if e.len() < len {
            return Err(DecodeError::Truncated { need: (pos + len) as u64, have: b.len() as u64 });
        }
        let entry = FooterEntry {
            key: e[FOOTER_ENTRY_FIXED_LEN..FOOTER_ENTRY_FIXED_LEN + key_len].to_vec(),
            flags: e[4],
            frame_count: u16_at(e, 6),
            payload_crc: u32_at(e, 36),
            offset: u64_at(e, 8),
            record_len: u64_at(e, 16),
            seq: u64_at(e, 24),
            aux: u32_at(e, 32),
        };
        if entry.flags & !(FLAG_LZ4 | FLAG_TOMBSTONE) != 0 {
            return Err(DecodeError::Invalid("unknown flags in footer entry"));
        }
        if entry.flags & FLAG_TOMBSTONE != 0 && entry.frame_count != 0 {
            return Err(DecodeError::Invalid("footer entry of a tombstone with a payload"));
        }
        if entry.flags & FLAG_TOMBSTONE == 0
            && (entry.aux as u64 % FRAME_ALIGN != 0 || entry.aux as u64 >= PAYLOAD_PAD_LIMIT)
        {
            return Err(DecodeError::Invalid("footer entry with a bad payload padding"));
        }
        let end = entry.offset.checked_add(entry.record_len);
        if entry.offset % RECORD_ALIGN != 0 || end.is_none_or(|end| end > segment_bytes) {
            return Err(DecodeError::Invalid("footer entry points outside the segment"));
        }
        // Records are listed in file order and do not overlap (the writer appends; recovery keeps
        // per-offset notes that two entries at one offset would confuse).
        if out.last().is_some_and(|p: &FooterEntry| entry.offset < p.offset + p.record_len.max(1)) {
            return Err(DecodeError::Invalid("footer entries overlap or are out of order"));
        }
        out.push(entry);
        pos += len;
    }
    Ok(out)
}

/// The fixed-size trailer that marks a segment sealed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Trailer {
    /// Segment id.
    pub segment: u32,
    /// Highest writer epoch that wrote to the segment, its creator's included (so it may exceed
    /// every record's epoch).
    pub max_epoch: u32,
    /// Where the footer starts.
    pub footer_offset: u64,
    /// Footer length in bytes.
    pub footer_len: u64,
    /// Number of footer entries.
    pub entry_count: u64,
    /// End of the record area.
    pub data_end: u64,
    /// crc32 of the footer bytes.
    pub footer_crc: u32,
    /// The log's salt (a second copy of the segment header's).
    pub salt: Salt,
}

/// Encode a trailer into 64 bytes.
pub fn encode_trailer(t: &Trailer) -> [u8; TRAILER_LEN] {
    let mut b = [0u8; TRAILER_LEN];
    b[0..4].copy_from_slice(&TRAILER_MAGIC);
    put_u16(&mut b, 4, FORMAT_VERSION as u16);
    put_u32(&mut b, 8, t.segment);
    put_u32(&mut b, 12, t.max_epoch);
    put_u64(&mut b, 16, t.footer_offset);
    put_u64(&mut b, 24, t.footer_len);
    put_u64(&mut b, 32, t.entry_count);
    put_u64(&mut b, 40, t.data_end);
    put_u32(&mut b, 48, t.footer_crc);
    put_u64(&mut b, 52, t.salt.0);
    let c = crc(&[&b[0..60]]);
    put_u32(&mut b, 60, c);
    b
}

/// Decode a trailer and check it against the segment it was read from.
pub fn decode_trailer(b: &[u8], segment: u32, segment_bytes: u64) -> Result<Trailer, DecodeError> {
    if b.len() < TRAILER_LEN {
        return Err(DecodeError::Truncated { need: TRAILER_LEN as u64, have: b.len() as u64 });
    }
    if b[0..4] != TRAILER_MAGIC {
        return Err(DecodeError::BadMagic);
    }
    let expected = u32_at(b, 60);
    let actual = crc(&[&b[0..60]]);
    if expected != actual {
        return Err(DecodeError::Checksum { what: "trailer", expected, actual });
    }
    let version = u16_at(b, 4) as u32;
    if version != FORMAT_VERSION as u32 {
        return Err(DecodeError::UnsupportedVersion(version));
    }
    let t = Trailer {
        segment: u32_at(b, 8),
        max_epoch: u32_at(b, 12),
        footer_offset: u64_at(b, 16),
        footer_len: u64_at(b, 24),
        entry_count: u64_at(b, 32),
        data_end: u64_at(b, 40),
        footer_crc: u32_at(b, 48),
        salt: Salt(u64_at(b, 52)),
    };
    if t.segment != segment {
        return Err(DecodeError::Invalid("trailer belongs to another segment"));
    }
    let footer_end = t.footer_offset.checked_add(t.footer_len);
    if t.data_end > t.footer_offset || footer_end.is_none_or(|e| e > segment_bytes - TRAILER_LEN as u64) {
        return Err(DecodeError::Invalid("trailer footer range outside the segment"));
    }
    Ok(t)
}

/// crc32 of footer bytes, as stored in the trailer.
pub fn footer_crc(footer: &[u8]) -> u32 {
    crc(&[footer])
}

// ---------------------------------------------------------------------------------------------------
// Segment header
// ---------------------------------------------------------------------------------------------------

/// The header at the start of every segment file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentHeader {
    /// Segment id (also in the file name).
    pub segment: u32,
    /// File size.
    pub segment_bytes: u64,
    /// I/O alignment the segment was written with.
    pub align: u32,
    /// Epoch of the writer that created it.
    pub epoch: u32,
    /// Offset of the first record.
    pub data_start: u64,
    /// The log's salt.
    pub salt: Salt,
}

/// Encode a segment header into 64 bytes.
pub fn encode_segment_header(h: &SegmentHeader) -> [u8; SEGMENT_HEADER_LEN] {
    let mut b = [0u8; SEGMENT_HEADER_LEN];
    b[0..8].copy_from_slice(&SEGMENT_MAGIC);
    put_u32(&mut b, 8, FORMAT_VERSION as u32);
    put_u32(&mut b, 12, h.segment);
    put_u64(&mut b, 16, h.segment_bytes);
    put_u32(&mut b, 24, h.align);
    put_u32(&mut b, 28, h.epoch);
    put_u64(&mut b, 32, h.data_start);
    put_u64(&mut b, 40, h.salt.0);
    let c = crc(&[&b[0..60]]);
    put_u32(&mut b, 60, c);
    b
}

/// Decode a segment header: magic, then crc, then version (an unknown version with a valid crc is
/// refused with `UnsupportedVersion` rather than misread).
pub fn decode_segment_header(b: &[u8]) -> Result<SegmentHeader, DecodeError> {
    if b.len() < SEGMENT_HEADER_LEN {
        return Err(DecodeError::Truncated { need: SEGMENT_HEADER_LEN as u64, have: b.len() as u64 });
    }
    if b[0..8] != SEGMENT_MAGIC {
        return Err(DecodeError::BadMagic);
    }
    let expected = u32_at(b, 60);
    let actual = crc(&[&b[0..60]]);
    if expected != actual {
        return Err(DecodeError::Checksum { what: "segment header", expected, actual });
    }
    let version = u32_at(b, 8);
    if version != FORMAT_VERSION as u32 {
        return Err(DecodeError::UnsupportedVersion(version));
    }
    let h = SegmentHeader {
        segment: u32_at(b, 12),
        segment_bytes: u64_at(b, 16),
        align: u32_at(b, 24),
        epoch: u32_at(b, 28),
        data_start: u64_at(b, 32),
        salt: Salt(u64_at(b, 40)),
    };
    if !h.align.is_power_of_two() || h.align < 512 || h.data_start < SEGMENT_HEADER_LEN as u64 {
        return Err(DecodeError::Invalid("segment header alignment or data start"));
    }
    Ok(h)
}

/// An lz4 block never expands more than this (each 255 bytes of a match cost at least one byte).
const LZ4_MAX_RATIO: u64 = 256;

/// Whether an lz4 block of `stored` bytes can be the compression of `raw` bytes: it is no longer
/// than the LZ4 bound of `raw` (`lz4_flex::block::get_maximum_output_size`, about `raw + raw/255 +
/// 16`), and `raw ≤ 256 · stored + 4096`. Checked before anything of either length is allocated.
pub fn lz4_lengths_fit(stored: u64, raw: u64) -> bool {
    let bound = usize::try_from(raw).map_or(u64::MAX, |r| lz4_flex::block::get_maximum_output_size(r) as u64);
    stored <= bound && raw <= stored.saturating_mul(LZ4_MAX_RATIO).saturating_add(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SALT: Salt = Salt(0x5eed_cafe_f00d_d00d);

    #[test]
    fn laid_out_crc_is_the_crc_of_the_laid_out_payload() {
        let cases: [&[&[u8]]; 5] = [&[], &[b""], &[b"abcde", b"", b"fghijk"], &[b"x", b""], &[&[7u8; 200], &[1u8; 64]]];
        for frames in cases {
            let (_, total) = frame_layout(frames.iter().map(|f| f.len() as u64)).unwrap();
            let mut payload = vec![0xAAu8; total as usize];
            lay_out_frames(&mut payload, frames.iter().copied());
            assert_eq!(laid_out_crc(frames.iter().copied()), payload_crc(&payload), "{frames:?}");
        }
        // Frame boundaries count: the same bytes cut differently lay out differently.
        assert_ne!(laid_out_crc([&b"ab"[..], b"c"]), laid_out_crc([&b"a"[..], b"bc"]));
    }

    fn build(key: &[u8], frames: &[&[u8]], flags: u8) -> Vec<u8> {
        build_padded(key, frames, flags, 0)
    }

    fn build_padded(key: &[u8], frames: &[&[u8]], flags: u8, aux: u32) -> Vec<u8> {
        let lens: Vec<u64> = frames.iter().map(|f| f.len() as u64).collect();
        let (_, total) = frame_layout(lens.iter().copied()).unwrap();
        let mut payload = vec![0xAAu8; total as usize];
        lay_out_frames(&mut payload, frames.iter().copied());
        let h = RecordHeader {
            flags,
            frame_count: lens.len() as u16,
            key_len: key.len() as u32,
            segment: 7,
            epoch: 3,
            payload_crc: payload_crc(&payload),
            seq: 42,
            raw_len: payload.len() as u64,
            stored_len: payload.len() as u64,
            aux,
        };
        let mut b = vec![0u8; h.record_len() as usize];
        let po = h.payload_offset() as usize;
        b[po..].copy_from_slice(&payload);
        write_record_head(&mut b, &h, &lens, key, SALT);
        b
    }

    #[test]
    fn record_round_trip() {
        let b = build(b"key", &[b"hello", b"", b"world!"], 0);
        let r = decode_record(&b, SALT).unwrap();
        assert_eq!(r.key, b"key");
        assert_eq!(r.frame_lens, vec![5, 0, 6]);
        let (offs, total) = frame_layout(r.frame_lens.iter().copied()).unwrap();
        assert_eq!(offs, vec![0, 64, 64]);
        assert_eq!(total, 70);
        assert_eq!(&r.payload[0..5], b"hello");
        assert!(r.payload[5..64].iter().all(|&x| x == 0), "gaps are zeroed");
        assert_eq!(&r.payload[64..70], b"world!");
        assert_eq!(r.header.payload_offset() % FRAME_ALIGN, 0);
        assert_eq!(r.header.seq, 42);
    }

    #[test]
    fn every_bit_flip_is_detected() {
        let b = build(b"some-key", &[b"payload bytes", b"more"], 0);
        for byte in 0..b.len() {
            for bit in 0..8 {
                let mut c = b.clone();
                c[byte] ^= 1 << bit;
                assert!(decode_record(&c, SALT).is_err(), "flip at byte {byte} bit {bit} went unnoticed");
            }
        }
    }

    #[test]
    fn an_lz4_record_cannot_claim_more_than_its_payload_expands_to() {
        let (key, lens) = (b"k", [1u64 << 40]);
        let h = RecordHeader {
            flags: FLAG_LZ4,
            frame_count: 1,
            key_len: 1,
            segment: 7,
            epoch: 3,
            payload_crc: payload_crc(&[0u8; 10]),
            seq: 1,
            raw_len: 1 << 40,
            stored_len: 10,
            aux: 0,
        };
        let mut b = vec![0u8; h.record_len() as usize];
        write_record_head(&mut b, &h, &lens, key, SALT);
        let e = decode_record(&b, SALT).unwrap_err();
        assert!(matches!(e, DecodeError::Invalid(m) if m.contains("lz4 raw_len")), "{e:?}");
        // The bound holds for what lz4 really does to the most compressible input.
        let zeros = vec![0u8; 16 << 20];
        let c = lz4_flex::block::compress(&zeros);
        assert!(zeros.len() as u64 <= c.len() as u64 * LZ4_MAX_RATIO, "{} -> {}", zeros.len(), c.len());
    }

    #[test]
    fn a_tombstone_shadowing_a_later_segment_is_invalid() {
        let tombstone = |aux: u32| {
            let h = RecordHeader {
                flags: FLAG_TOMBSTONE,
                frame_count: 0,
                key_len: 1,
                segment: 7,
                epoch: 3,
                payload_crc: payload_crc(&[]),
                seq: 1,
                raw_len: 0,
                stored_len: 0,
                aux,
            };
            let mut b = vec![0u8; h.record_len() as usize];
            write_record_head(&mut b, &h, &[], b"k", SALT);
            b
        };
        assert_eq!(decode_record(&tombstone(7), SALT).unwrap().header.aux, 7);
        let e = decode_record(&tombstone(8), SALT).unwrap_err();
        assert!(matches!(e, DecodeError::Invalid(m) if m.contains("after its own")), "{e:?}");
    }

    #[test]
    fn a_value_payload_starts_after_its_padding() {
        let b = build_padded(b"key", &[b"hello"], 0, 192);
        let r = decode_record(&b, SALT).unwrap();
        assert_eq!(r.header.payload_offset(), 128 + 192);
        assert_eq!(r.payload, b"hello");
        assert_eq!(b.len(), 128 + 192 + 5);
        // The padding is covered by the header crc and must be zeros.
        let mut bad = b.clone();
        bad[100] = 1;
        assert!(decode_record(&bad, SALT).is_err());
        for aux in [32, 512, 4096] {
            let e = decode_record(&build_padded(b"key", &[b"hello"], 0, aux), SALT).unwrap_err();
            assert!(matches!(e, DecodeError::Invalid(m) if m.contains("padding")), "{aux}: {e:?}");
        }
        assert_eq!(payload_pad(0, 128), 384);
        assert_eq!(payload_pad(384, 128), 0);
        assert_eq!(payload_pad(4608, 128), 384);
    }

    #[test]
    fn overlapping_footer_entries_are_invalid() {
        let entry = |offset, record_len| FooterEntry {
            key: b"k".to_vec(),
            flags: 0,
            frame_count: 1,
            payload_crc: 0,
            offset,
            record_len,
            seq: 1,
            aux: 0,
        };
        let footer = |entries: &[FooterEntry]| {
            let mut out = Vec::new();
            for e in entries {
                encode_footer_entry(&mut out, e);
            }
            decode_footer(&out, entries.len() as u64, 1 << 20)
        };
        assert!(footer(&[entry(4096, 128), entry(4224, 100)]).is_ok());
        for second in [4096, 4160, 0] {
            let e = footer(&[entry(4096, 128), entry(second, 100)]).unwrap_err();
            assert!(matches!(e, DecodeError::Invalid(m) if m.contains("overlap")), "{second}: {e:?}");
        }
    }

    #[test]
    fn truncation_is_an_error_not_a_panic() {
        let b = build(b"k", &[b"abcdefgh"], 0);
        for n in 0..b.len() {
            assert!(decode_record(&b[..n], SALT).is_err());
        }
    }

    #[test]
    fn a_record_verifies_only_under_the_salt_it_was_written_with() {
        // What a value's author can do: a record whose header crc is right for any salt but the log's.
        let b = build(b"k", &[b"abc"], 0);
        assert!(decode_record(&b, SALT).is_ok());
        for other in [Salt(0), Salt(SALT.0 ^ 1), Salt(SALT.0.rotate_left(32))] {
            let e = decode_record(&b, other).unwrap_err();
            assert!(matches!(e, DecodeError::Checksum { what: "record header", .. }), "{e:?}");
        }
        // A random salt is drawn fresh each time.
        assert_ne!(Salt::random(b"x"), Salt::random(b"x"));
    }

    #[test]
    fn relocation_keeps_record_valid() {
        let mut b = build(b"k", &[b"abc"], 0);
        let h = peek_record_header(&b).unwrap();
        relocate_record(&mut b, &h, 99, 5, SALT);
        let r = decode_record(&b, SALT).unwrap();
        assert_eq!((r.header.segment, r.header.epoch, r.header.seq), (99, 5, 42));
    }

    #[test]
    fn footer_and_trailer_round_trip() {
        let entries = vec![
            FooterEntry {
                key: b"a".to_vec(),
                flags: 0,
                frame_count: 2,
                payload_crc: 0xdead_beef,
                offset: 4096,
                record_len: 100,
                seq: 1,
                aux: 0,
            },
            FooterEntry {
                key: vec![],
                flags: FLAG_TOMBSTONE,
                frame_count: 0,
                payload_crc: 0,
                offset: 4224,
                record_len: 64,
                seq: 2,
                aux: 3,
            },
        ];
        let mut out = Vec::new();
        for e in &entries {
            encode_footer_entry(&mut out, e);
        }
        assert_eq!(decode_footer(&out, 2, 1 << 20).unwrap(), entries);
        assert!(decode_footer(&out, 3, 1 << 20).is_err());
        assert!(decode_footer(&out, u64::MAX, 1 << 20).is_err());
        let t = Trailer {
            segment: 9,
            max_epoch: 2,
            footer_offset: 8192,
            footer_len: out.len() as u64,
            entry_count: 2,
            data_end: 4256,
            footer_crc: footer_crc(&out),
            salt: SALT,
        };
        let tb = encode_trailer(&t);
        assert_eq!(decode_trailer(&tb, 9, 1 << 20).unwrap(), t);
        assert!(decode_trailer(&tb, 8, 1 << 20).is_err());
        let sh =
            SegmentHeader { segment: 9, segment_bytes: 1 << 20, align: 4096, epoch: 1, data_start: 4096, salt: SALT };
        assert_eq!(decode_segment_header(&encode_segment_header(&sh)).unwrap(), sh);
    }
}
