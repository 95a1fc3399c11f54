//! Writes: validate, prepare (lay out and maybe compress) and append records in batches, as many
//! per segment as fit; encode each group into one aligned buffer, keep up to `WRITES_IN_FLIGHT`
//! writes in flight, and publish the batch (`record.rs`) once its writes are in the kernel. Deletes
//! write tombstones; `forget` drops a key without one; `sync` writes a sync mark and makes
//! everything before it durable.

use std::io;
use std::sync::Arc;

use crate::backend::Backend;
use crate::buf::AlignedBuf;
use crate::error::{Error, Result};
use crate::format::{align_down, align_up};
use crate::value::Frames;
use crate::{format, stored};

use super::gather::write_chunk_gathered;
use super::gc::{release_forgotten, settle_forgotten};
use super::location::Location;
use super::options::Compression;
use super::record::{encode_record, fence_failed_write, publish_chunk, seq_for, NewRecord, Payload, Placed, Prepared};
use super::segments::{
    fits, flush_pending, footer_entry_len, rotate, sync_active, sync_dir_if_dirty, write_buffer, WriterState,
    WRITES_IN_FLIGHT,
};
use super::table::padded;
use super::write_behind::defer_chunk;
use super::{laid_out_len, SegmentLog, Writer, MAX_RECORD_BYTES, MAX_SPARE_BUF};

/// A single-frame, uncompressed value at least this large gets its payload padded to start at a
/// multiple of 512 in the file ([`format::PAYLOAD_PAD_LIMIT`]): reading it without its head is then
/// a read of whole sectors, 4096 bytes for a 4 KiB value instead of 4608 (its head in a sector of
/// its own). On this machine's disk a 4 KiB random read runs at 1.2x the IOPS of a 4608-byte one
/// (`docs/benchmarks.md`). The padding (at most 448 bytes) costs a 4 KiB value 9 % more disk.
pub(super) const ALIGN_PAYLOAD_MIN: u64 = 4096;

/// Values smaller than this are never compressed.
pub(super) const MIN_COMPRESS_BYTES: u64 = 256;

pub(super) fn validate<B: Backend>(log: &SegmentLog<B>, key: &[u8], frames: &Frames) -> Result<()> {
    if key.len() > format::MAX_KEY_BYTES {
        return Err(Error::KeyTooLarge { len: key.len(), max: format::MAX_KEY_BYTES });
    }
    if frames.len() > format::MAX_FRAMES {
        return Err(Error::ValueTooLarge { len: frames.len() as u64, max: format::MAX_FRAMES as u64, unit: "frames" });
    }
    if frames.total_len() > log.opts.max_value_bytes {
        return Err(Error::ValueTooLarge { len: frames.total_len(), max: log.opts.max_value_bytes, unit: "bytes" });
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

pub(super) fn put<B: Backend>(log: &SegmentLog<B>, key: &[u8], value: &Frames) -> Result<()> {
    log.put_many(&[(key, value)])
}

pub(super) fn put_many<B: Backend>(log: &SegmentLog<B>, items: &[(&[u8], &Frames)]) -> Result<()> {
    for (k, v) in items {
        log.validate(k, v)?;
    }
    let recs: Vec<NewRecord<'_>> = items.iter().map(|(key, frames)| NewRecord::Value { key, frames }).collect();
    let mut st = log.writer();
    append(log, &mut st, recs).map(|_| ())
}

pub(super) fn delete<B: Backend>(log: &SegmentLog<B>, key: &[u8]) -> Result<bool> {
    if key.len() > format::MAX_KEY_BYTES {
        return Err(Error::KeyTooLarge { len: key.len(), max: format::MAX_KEY_BYTES });
    }
    let mut st = log.writer();
    let Some(packed) = log.index.get(key) else {
        return Ok(false);
    };
    let first = st.segs.first_segment(&packed);
    // A tombstone shadows segments up to its own only (recovery refuses one whose `aux` names a
    // later segment). A value streamed into a segment of its own lies in a segment newer than the
    // active one, into which its tombstone goes: it then shadows from there (the streamed
    // segment, holding that one dead record, goes before it: at the garbage collection this
    // delete runs, or at the next open, `recover::stranded_streams`).
    let aux = st.active.as_ref().map_or(first, |a| first.min(a.id));
    append(log, &mut st, vec![NewRecord::Tombstone { key, aux }])?;
    Ok(true)
}

pub(super) fn forget<B: Backend>(log: &SegmentLog<B>, key: &[u8]) -> Result<bool> {
    // The streams of the key are marked under the index lock, as publishing marks them.
    let Some(old) = log.index.forget(key, || log.streams.written_meanwhile(key, u64::MAX)) else {
        return Ok(false);
    };
    let st = match log.state.try_lock() {
        Ok(st) => st,
        Err(std::sync::TryLockError::Poisoned(p)) => p.into_inner(),
        Err(std::sync::TryLockError::WouldBlock) => {
            // A write holds the lock (a large one, or compaction): the
            // key is gone from the index already; the rest is left to the writer lock's next
            // taker.
            log.forgotten.push(old);
            return Ok(true);
        }
    };
    // Guarded like `writer`: releasing a record can delete a segment (a punch, an unlink, an
    // fsync, and a write of what is pending).
    let mut st = Writer { st, log, panicking: std::thread::panicking() };
    settle_forgotten(log, &mut st);
    release_forgotten(log, &mut st, old);
    Ok(true)
}

pub(super) fn settle_punches<B: Backend>(log: &SegmentLog<B>) {
    log.punches.settle();
}

pub(super) fn prepare<'a, B: Backend>(log: &SegmentLog<B>, rec: NewRecord<'a>) -> Prepared<'a> {
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
            if log.opts.compression == Compression::Lz4 && raw >= MIN_COMPRESS_BYTES {
                let (c, _) = stored::compress(frames);
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

pub(super) fn append<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    recs: Vec<NewRecord<'_>>,
) -> Result<Vec<Location>> {
    log.health.check_writable()?;
    let mut prepared: Vec<Prepared<'_>> = recs.into_iter().map(|r| prepare(log, r)).collect();
    let mut out = Vec::with_capacity(prepared.len());
    let mut i = 0;
    while i < prepared.len() {
        // Make sure the active segment can take at least the next record.
        let need_new = match &st.active {
            Some(a) => !fits(log, a, prepared[i].max_len(), prepared[i].rec.key().len()),
            None => true,
        };
        if need_new {
            rotate(log, st, prepared[i].max_len(), prepared[i].rec.key().len())?;
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
            let new_footer = footer + footer_entry_len(p.rec.key().len());
            if end > u32::MAX as u64 || align_up(new_end, log.align) + new_footer + format::TRAILER_LEN as u64 > a.size
            {
                break;
            }
            end = new_end;
            footer = new_footer;
            j += 1;
        }
        assert!(j > i, "a freshly rotated segment must fit the next record");
        let locs = write_chunk(log, st, &prepared[i..j])?;
        out.extend(locs);
        i = j;
    }
    log.compact_if_pending(st);
    Ok(out)
}

/// Write `chunk`, then publish the new locations: kept pending in the active segment's tail
/// (write-behind) if it is small, written from its own frames if a payload is large
/// (`write_chunk_gathered`), else encoded and written in groups (`write_chunk_grouped`).
pub(super) fn write_chunk<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    chunk: &[Prepared<'_>],
) -> Result<Vec<Location>> {
    // Write-behind: keep a small batch pending in the tail if it fits the budget (writing what is
    // pending first if the batch would overflow it); any other batch writes what is pending first.
    let budget = log.opts.write_behind_bytes;
    let defer = budget > 0
        && st.active.as_ref().is_some_and(|a| a.reserved)
        && chunk.iter().all(|p| !matches!(p.rec, NewRecord::SyncMark));
    let total: u64 = chunk.iter().map(|p| padded(p.len)).sum();
    let pending_len = |st: &WriterState<B::File>| st.active.as_ref().map_or(0, |a| a.tail.len() as u64);
    if defer && pending_len(st) + total > budget {
        flush_pending(log, st)?;
    }
    if defer && pending_len(st) + total <= budget {
        return defer_chunk(log, st, chunk);
    }
    flush_pending(log, st)?;
    if log.backend.gathers_writes()
        && chunk.iter().any(|p| matches!(p.payload, Payload::Frames(f) if laid_out_len(f) >= log.opts.gather_min_bytes))
    {
        return write_chunk_gathered(log, st, chunk);
    }
    write_chunk_grouped(log, st, chunk)
}

/// Write `chunk` encoded in groups of about `write_group_bytes`. Each group's write covers its
/// whole blocks only; its last, partial block is rewritten by the next group (or, for the last
/// group, written with it). So the writes of one chunk never overlap, several can be in flight
/// at once (up to WRITES_IN_FLIGHT, through `write_at_async`), and group k+1 is encoded while
/// group k is being written. The chunk is published only when every write has completed.
fn write_chunk_grouped<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    chunk: &[Prepared<'_>],
) -> Result<Vec<Location>> {
    let epoch = st.epoch;
    let align = log.align;
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
    let group_bytes = if log.backend.queues_writes() { log.opts.write_group_bytes.max(1) } else { u64::MAX };
    let mut i = 0;
    while i < chunk.len() {
        let (j, total) = group_end(chunk, i, group_bytes);
        let group = &chunk[i..j];
        let last = j == chunk.len();
        let base = align_down(data_end, align);
        let end = data_end + total;
        let needed = (align_up(end, align) - base) as usize;
        let at = GroupAt { id, epoch, base, data_end };
        let mut buf = encode_group(log, st, group, tail.as_deref(), at, needed, &mut placed);
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
        if !submit_group(log, st, &file, (base, buf), last, &mut in_flight, &mut failure) {
            break;
        }
    }
    while let Some(w) = in_flight.pop_front() {
        reap_write(st, w, &mut failure);
    }
    if let Some(e) = failure {
        // Nothing of the chunk is published, and the active segment is as it was.
        fence_failed_write(log, st, crate::error::io_no_space(&e).then_some(data_end));
        return Err(log.health.write_failed("write segment", log.seg_path(id), e));
    }
    let tail = tail.expect("a non-empty chunk encodes a group");
    publish_chunk(log, st, chunk, &placed, data_end, tail, epoch, false)
}

/// Submit the write of one group's buffer at its offset, after waiting for the oldest while
/// [`WRITES_IN_FLIGHT`] are out; the `last` group, with nothing in flight to overlap with, is a
/// plain blocking write (inline on io_uring, no hand-off). Returns whether the chunk goes on
/// (false after its last group, or once a write failed).
fn submit_group<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    file: &Arc<B::File>,
    (base, buf): (u64, AlignedBuf),
    last: bool,
    in_flight: &mut std::collections::VecDeque<crate::backend::IoFuture>,
    failure: &mut Option<io::Error>,
) -> bool {
    while in_flight.len() >= WRITES_IN_FLIGHT {
        let w = in_flight.pop_front().expect("non-empty");
        reap_write(st, w, failure);
    }
    if failure.is_some() {
        st.spare_bufs.push(buf);
        return false;
    }
    if last && in_flight.is_empty() {
        let (r, buf) = log.backend.write_at(file, base, buf);
        if buf.capacity() <= MAX_SPARE_BUF {
            st.spare_bufs.push(buf);
        }
        if let Err(e) = r {
            note_failure(failure, e);
        }
        return false;
    }
    in_flight.push_back(log.backend.write_at_async(file, base, buf));
    true
}

/// Wait for one write of `write_chunk`, keep its buffer for reuse, remember the first failure.
pub(super) fn reap_write<F>(st: &mut WriterState<F>, w: crate::backend::IoFuture, failure: &mut Option<io::Error>) {
    let (r, buf) = crate::task::block_on(w);
    if buf.capacity() <= MAX_SPARE_BUF {
        st.spare_bufs.push(buf);
    }
    if let Err(e) = r {
        note_failure(failure, e);
    }
}

/// Keep the first failure of a chunk's writes, unless a later one is worse than a full file
/// system (which leaves the log writable, see `Health::write_failed`).
pub(super) fn note_failure(failure: &mut Option<io::Error>, e: io::Error) {
    match failure {
        Some(f) if crate::error::io_no_space(f) && !crate::error::io_no_space(&e) => *failure = Some(e),
        Some(_) => {}
        None => *failure = Some(e),
    }
}

/// A write buffer of `needed` bytes: a spare one if large enough, else a new one with slack.
/// Encode `group` at `at.data_end` of the active segment into an aligned buffer of `needed`
/// bytes from `at.base`: first the partial block before it (`prev`, else the segment's own
/// tail), then each record and the zeros after it, to the aligned end. Each record's place goes
/// to `placed`.
fn encode_group<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    group: &[Prepared<'_>],
    prev: Option<&[u8]>,
    at: GroupAt,
    needed: usize,
    placed: &mut Vec<Placed>,
) -> AlignedBuf {
    let GroupAt { id, epoch, base, data_end } = at;
    let mut buf = write_buffer(log, st, needed);
    let prev = prev.unwrap_or_else(|| &st.active.as_ref().expect("active segment").tail);
    buf[..prev.len()].copy_from_slice(prev);
    let mut pos = data_end;
    for p in group {
        let seq = seq_for(st, &p.rec);
        let from = (pos - base) as usize;
        let h = encode_record(log, p, &mut buf[from..from + p.len as usize], id, epoch, seq);
        placed.push(Placed::new(pos, &h));
        let rec_end = (pos + p.len - base) as usize;
        pos = padded(pos + p.len);
        buf[rec_end..(pos - base) as usize].fill(0); // padding between records
    }
    debug_assert_eq!(align_up(pos, log.align) - base, needed as u64, "the group fills the buffer");
    buf[(pos - base) as usize..].fill(0); // padding up to the aligned end
    buf
}

/// The end of the group of `chunk` that starts at record `i`: the records that fit in
/// `group_bytes` (at least one), and their padded length.
fn group_end(chunk: &[Prepared<'_>], i: usize, group_bytes: u64) -> (usize, u64) {
    let (mut j, mut total) = (i, 0u64);
    while j < chunk.len() && (j == i || total + padded(chunk[j].len) <= group_bytes) {
        total += padded(chunk[j].len);
        j += 1;
    }
    (j, total)
}

/// Where a group of records goes (see `encode_group`): the active segment, the epoch
/// its records are written in, the block boundary its write starts at, and where the records start.
#[derive(Clone, Copy)]
struct GroupAt {
    id: u32,
    epoch: u32,
    base: u64,
    data_end: u64,
}

pub(super) fn sync<B: Backend>(log: &SegmentLog<B>) -> Result<()> {
    let mut st = log.writer();
    // Under the writer lock: a sync that failed while this one waited poisoned the log, and a
    // failed fdatasync must never be retried (it can report success for data that was dropped).
    log.health.check_writable()?;
    if st.active.as_ref().is_some_and(|a| a.dirty && !a.last_is_mark) {
        append(log, &mut st, vec![NewRecord::SyncMark])?;
    }
    flush_pending(log, &mut st)?;
    sync_active(log, &mut st)?;
    for f in std::mem::take(&mut st.unsynced_sealed) {
        if let Err(e) = log.backend.sync_data(&f) {
            return Err(log.health.poison(Error::io("fdatasync", log.seg_dir.clone(), e)));
        }
    }
    sync_dir_if_dirty(log, &mut st)
}
