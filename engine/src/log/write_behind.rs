//! Write-behind: small batches may stay in a pending buffer (up to `LogOptions::write_behind_bytes`,
//! at most [`MAX_WRITE_BEHIND_BYTES`]) until it fills, a read needs them, or a sync; reads of a
//! pending record are served from the buffer (`segments::flush_pending` writes it).

use bytes::Bytes;

use crate::backend::Backend;
use crate::buf::AlignedBuf;
use crate::error::Result;
use crate::format::{self};
use crate::sync::{AtomicU64, Ordering};

use super::location::Location;
use super::record::{encode_record, publish_chunk, seq_for, Placed, Prepared};
use super::segments::WriterState;
use super::table::padded;
use super::{lock, SegmentLog};

/// Largest `LogOptions::write_behind_bytes`.
pub const MAX_WRITE_BEHIND_BYTES: u64 = 64 << 20;

/// Where records are pending (write-behind), for readers that take no lock: set to the active
/// segment and its `written_end` before the first pending record is published in the index, and
/// cleared after they are written, so a reader that found a record in the index and then sees no
/// pending range for it can read it from the file.
pub(super) struct PendingMark(AtomicU64);

/// [`PendingMark`]'s value when no record is pending.
const NOTHING_PENDING: u64 = u64::MAX;

impl PendingMark {
    pub(super) fn new() -> Self {
        PendingMark(AtomicU64::new(NOTHING_PENDING))
    }

    /// Records of `segment` from offset `written_end` on are pending. Offsets fit in 32 bits
    /// (segments are smaller than 4 GiB).
    fn set(&self, segment: u32, written_end: u64) {
        self.0.store(((segment as u64) << 32) | (written_end & 0xffff_ffff), Ordering::Release);
    }

    /// Nothing is pending any more.
    pub(super) fn clear(&self) {
        self.0.store(NOTHING_PENDING, Ordering::Release);
    }

    /// Whether `loc` may be a record pending in memory. False means it is in the file.
    pub(super) fn may_hold(&self, loc: Location) -> bool {
        let p = self.0.load(Ordering::Acquire);
        p != NOTHING_PENDING && (p >> 32) as u32 == loc.segment && loc.offset >= p & 0xffff_ffff
    }
}

/// Write-behind ([`LogOptions::write_behind_bytes`]): encode `chunk` at the end of the active
/// segment's tail, in memory, and publish it without writing. Its bytes reach the file with the
/// next write, or `flush_pending`.
pub(super) fn defer_chunk<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    chunk: &[Prepared<'_>],
) -> Result<Vec<Location>> {
    let epoch = st.epoch;
    let (id, data_end, written_end, mut tail) = {
        let a = st.active.as_mut().expect("active segment");
        (a.id, a.data_end, a.written_end, std::mem::take(&mut a.tail))
    };
    let mut placed: Vec<Placed> = Vec::with_capacity(chunk.len());
    let mut pos = data_end;
    for p in chunk {
        let seq = seq_for(st, &p.rec);
        let at = tail.len();
        // Zeros: the padding after the record; encode_record writes every byte of the record.
        tail.resize(at + padded(p.len) as usize, 0);
        let h = encode_record(log, p, &mut tail[at..at + p.len as usize], id, epoch, seq);
        placed.push(Placed::new(pos, &h));
        pos = padded(pos + p.len);
    }
    if written_end == data_end {
        // The first pending record: readers must learn it before they can find it in the index.
        log.pending.set(id, written_end);
    }
    publish_chunk(log, st, chunk, &placed, pos, tail, epoch, true)
}

/// For a record that may be pending (write-behind): its bytes copied out of memory, 64-byte
/// aligned like a read's, or `None` if it is in the file. A copy of one record costs less than
/// writing everything pending early, and an early write would also cut the batch short: the
/// page cache keeps the shape of the writes that first touched it (large folios for large
/// writes), and a 64 KiB read from pages written 64 KiB at a time costs 1.5x one from pages
/// written 2 MiB at a time (`docs/benchmarks.md`).
pub(super) fn pending_record<B: Backend>(log: &SegmentLog<B>, loc: Location) -> Result<Option<Bytes>> {
    if !log.pending.may_hold(loc) {
        return Ok(None);
    }
    let st = lock(&log.state);
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
