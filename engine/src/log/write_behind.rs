//! Write-behind: small batches may stay in a pending buffer (up to `LogOptions::write_behind_bytes`,
//! at most [`MAX_WRITE_BEHIND_BYTES`]) until it fills, a read needs them, or a sync; reads of a
//! pending record are served from the buffer.

use bytes::Bytes;

use crate::backend::Backend;
use crate::buf::AlignedBuf;
use crate::error::Result;
use crate::format::{self, align_down, align_up};
use crate::sync::{AtomicU64, Ordering};

use super::index::Location;
use super::segments::WriterState;
use super::write::{encode_record, publish_chunk, seq_for, write_buffer, Placed, Prepared};
use super::{lock, padded, SegmentLog, MAX_SPARE_BUF, ZEROS};

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
    fn clear(&self) {
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

/// Write the records pending in the active segment's tail (write-behind), if any. On failure the
/// log is poisoned and the records stay pending, readable from memory.
pub(super) fn flush_pending<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>) -> Result<()> {
    let Some(a) = st.active.as_ref() else { return Ok(()) };
    if a.written_end == a.data_end {
        return Ok(());
    }
    log.health.check_writable()?;
    let (id, file, data_end) = (a.id, a.file.clone(), a.data_end);
    let base = data_end - a.tail.len() as u64;
    debug_assert_eq!(base % log.align, 0, "the tail starts at a block boundary");
    let needed = (align_up(data_end, log.align) - base) as usize;
    let r = if log.backend.gathers_writes() {
        // Buffered files: straight from the tail, no copy into a staging buffer first (the tail
        // holds every pending byte, encoded once; copying it again costs as much as encoding).
        let mut parts: Vec<&[u8]> = vec![&a.tail];
        let mut zeros = needed - a.tail.len();
        while zeros > 0 {
            let k = zeros.min(ZEROS.len());
            parts.push(&ZEROS[..k]);
            zeros -= k;
        }
        log.backend.write_gather_at(&file, base, &parts)
    } else {
        let mut buf = write_buffer(log, st, needed);
        let a = st.active.as_ref().expect("active segment");
        buf[..a.tail.len()].copy_from_slice(&a.tail);
        buf[a.tail.len()..].fill(0);
        let (r, buf) = log.backend.write_at(&file, base, buf);
        if buf.capacity() <= MAX_SPARE_BUF {
            st.spare_bufs.push(buf);
        }
        r
    };
    if let Err(e) = r {
        // The records stay pending in the tail, readable from memory.
        return Err(log.health.write_failed("write segment", log.seg_path(id), e));
    }
    let a = st.active.as_mut().expect("active segment");
    a.tail.drain(..(align_down(data_end, log.align) - base) as usize);
    a.written_end = data_end;
    log.pending.clear();
    log.health.wrote();
    st.segs.pending_written();
    Ok(())
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
