//! Streamed puts (`put_stream`): a value read from a socket or file. Small values are read into memory
//! and appended under the writer lock; large ones go to a segment of their own written without the
//! lock, published only if no newer write of the key overtook them.

use std::collections::HashMap;
use std::io;
use std::path::Path;
use std::sync::Arc;

use crate::backend::Backend;
use crate::buf::AlignedBuf;
use crate::error::{Error, Result};
use crate::format::{align_down, align_up, FooterEntry, RecordHeader};
use crate::stored::StreamedValue;
use crate::sync::{AtomicBool, Mutex, Ordering};
use crate::value::Frames;
use crate::{format, stored};

use super::gc::reclaim;
use super::location::{Location, RecordFacts};
use super::record::{fence_failed_write, publish_chunk, NewRecord, Payload, Placed, Prepared};
use super::segments::flush_pending;
use super::segments::{
    erase_aborted, fits, footer_entry_len, release_spare_files, rotate, write_seal, write_segment_header, WriterState,
};
use super::table::padded;
use super::table::SegMeta;
use super::{lock, SegmentLog, MAX_RECORD_BYTES};

/// Each key's streams: (sequence number, overtaken).
type StreamsByKey = HashMap<Vec<u8>, Vec<(u64, bool)>>;

/// The values streaming into segments of their own ([`SegmentLog::put_stream`]), by key: each
/// stream's sequence number, and whether a newer write of its key (a put, a delete, a forget, a
/// stream begun later) was published meanwhile, which makes its record dead on arrival.
pub(super) struct Streams {
    by_key: Mutex<StreamsByKey>,
    /// `by_key` is not empty: read without its lock wherever a key is written.
    any: AtomicBool,
}

impl Streams {
    pub(super) fn new() -> Self {
        Streams { by_key: Mutex::new(HashMap::new()), any: AtomicBool::new(false) }
    }

    /// A stream of `key` with sequence number `seq` begins. Called under the writer lock, so that
    /// every write of the key published after it has a larger sequence number and marks it.
    pub(super) fn begin(&self, key: &[u8], seq: u64) {
        lock(&self.by_key).entry(key.to_vec()).or_default().push((seq, false));
        self.any.store(true, Ordering::Release);
    }

    /// A write of `key` with sequence number `seq` (`u64::MAX`: a forget, newer than everything)
    /// was published: the streams of `key` that began before it are overtaken.
    pub(super) fn written_meanwhile(&self, key: &[u8], seq: u64) {
        if !self.any.load(Ordering::Acquire) {
            return;
        }
        if let Some(streams) = lock(&self.by_key).get_mut(key) {
            for (s, overtaken) in streams.iter_mut() {
                *overtaken |= *s < seq;
            }
        }
    }

    /// Whether a value of `key` is streaming into a segment of its own. That segment is newer than
    /// the active one and not in the segment table yet, and may hold a whole record of the key on
    /// disk before the stream ends: a tombstone of the key written meanwhile, whose range ends at
    /// its own older segment, is then all that deletes it at the next open. Compaction keeps such
    /// tombstones while the stream lasts (`compact::records_to_keep`).
    pub(super) fn streaming(&self, key: &[u8]) -> bool {
        self.any.load(Ordering::Acquire) && lock(&self.by_key).contains_key(key)
    }

    /// Whether any value is streaming into a segment of its own (see [`Streams::streaming`]):
    /// garbage collection keeps the segments holding tombstones meanwhile (`gc::collect_garbage`).
    pub(super) fn in_progress(&self) -> bool {
        self.any.load(Ordering::Acquire)
    }

    /// Whether a newer write of `key` overtook its stream with sequence number `seq` (once it has,
    /// it stays overtaken).
    pub(super) fn overtaken(&self, key: &[u8], seq: u64) -> bool {
        lock(&self.by_key).get(key).is_some_and(|streams| streams.iter().any(|&(s, overtaken)| s == seq && overtaken))
    }

    /// The stream of `key` with sequence number `seq` is over: forget it. Returns whether a newer
    /// write of its key overtook it.
    pub(super) fn ended(&self, key: &[u8], seq: u64) -> bool {
        let mut by_key = lock(&self.by_key);
        let Some(streams) = by_key.get_mut(key) else { return false };
        let i = streams.iter().position(|&(s, _)| s == seq).expect("registered by begin");
        let (_, overtaken) = streams.swap_remove(i);
        if streams.is_empty() {
            by_key.remove(key);
            if by_key.is_empty() {
                self.any.store(false, Ordering::Release);
            }
        }
        overtaken
    }
}

/// `put_stream` reads a value of at most this many stored bytes, or an eighth of a segment if that
/// is more, into memory, then writes it under the writer lock; a larger one goes into a segment of
/// its own without the lock. (An eighth of a segment: each segment is an open file, and a stream of
/// values of a few MiB must not cost a file each.)
pub(super) const STREAM_BUFFERED_MAX: u64 = 1 << 20;

/// A value streamed into a segment of its own has the segment's space reserved (`fallocate`) at
/// most this far past the bytes that arrived, not all of it as the value's header announced.
pub(super) const STREAM_RESERVE_AHEAD: u64 = 64 << 20;

/// The error of a peer that stopped before the whole value arrived.
pub(super) fn stopped_early() -> io::Error {
    io::Error::new(io::ErrorKind::UnexpectedEof, "the sender stopped before the whole value arrived")
}

/// Fill `buf` from `src` (a value's payload from a peer), retrying interrupted reads.
pub(super) fn read_payload(src: &mut dyn io::Read, buf: &mut [u8]) -> Result<()> {
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

/// Where a streamed record goes in the active segment: segment `id`, the block it starts in
/// (`base`) with the bytes before it there (`old_tail`), and where it ends.
struct StreamAt {
    id: u32,
    base: u64,
    old_tail: Vec<u8>,
    end: u64,
}

/// A value's payload arriving from a source (a peer's socket, a file): read into write buffers a
/// piece at a time, checked as it comes (`stored::PayloadCheck`), refused if the source ends early.
struct Incoming<'a> {
    src: &'a mut dyn io::Read,
    meta: &'a StreamedValue,
    /// `None` once [`Incoming::finish`] ran.
    check: Option<stored::PayloadCheck>,
    /// Payload bytes still to come.
    left: u64,
    /// What the source panicked with (`fill_caught`): the caller settles the log, then unwinds.
    panicked: Option<Box<dyn std::any::Any + Send>>,
}

impl<'a> Incoming<'a> {
    fn new(src: &'a mut dyn io::Read, meta: &'a StreamedValue) -> Self {
        Incoming { src, meta, check: Some(stored::PayloadCheck::new(meta)), left: meta.stored_len, panicked: None }
    }

    /// After the last piece: the payload's checksum (and lz4 block) against what was announced.
    fn finish(&mut self) -> Result<()> {
        let check = self.check.take().expect("finished once");
        check.finish(self.meta, "streamed value payload")
    }

    /// Read into `buf` until it holds `fill` bytes or the payload is all in; returns whether it is
    /// (the last piece, to be padded).
    fn fill(&mut self, buf: &mut AlignedBuf, fill: usize) -> Result<bool> {
        while self.left > 0 && buf.len() < fill {
            let from = buf.len();
            let want = ((fill - from) as u64).min(self.left) as usize;
            buf.set_len(from + want);
            let n = match self.src.read(&mut buf[from..]) {
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
            if let Some(c) = &mut self.check {
                c.update(&buf[from..from + n]);
            }
            self.left -= n as u64;
        }
        Ok(self.left == 0)
    }

    /// [`Incoming::fill`], with a panic of the source caught and kept (`panicked`) and returned
    /// as an error.
    fn fill_caught(&mut self, buf: &mut AlignedBuf, fill: usize) -> Result<bool> {
        let from = buf.len();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.fill(buf, fill))) {
            Ok(r) => r,
            Err(panic) => {
                buf.set_len(from);
                self.panicked = Some(panic);
                Err(Error::io("receive value", None, io::Error::other("the reader panicked")))
            }
        }
    }
}

/// The space of a streamed segment's file, reserved as its value arrives, at most
/// [`STREAM_RESERVE_AHEAD`] past it: a peer that announces gigabytes and stalls holds little of the
/// disk (and only while it keeps the transfer's pace).
struct ReserveAhead {
    /// The file's size.
    size: u64,
    reserved_to: u64,
    /// The log's files kept for reuse were given back to make room (done once).
    spares_released: bool,
}

impl ReserveAhead {
    /// Make sure the file's space is reserved past `upto`: with at least half the window
    /// reserved beyond it, nothing to do (one fallocate per 32 MiB, not per piece written).
    fn reserve<B: Backend>(&mut self, log: &SegmentLog<B>, file: &B::File, upto: u64) -> io::Result<()> {
        let ahead = upto.saturating_add(STREAM_RESERVE_AHEAD / 2).min(self.size);
        let upto = upto.saturating_add(STREAM_RESERVE_AHEAD).min(self.size);
        if ahead <= self.reserved_to {
            return Ok(());
        }
        let mut reserved = log.backend.allocate(file, upto);
        if !matches!(reserved, Ok(true)) && !self.spares_released {
            // Files kept for reuse may hold the space this stream's own segment needs.
            self.spares_released = true;
            if release_spare_files(log, &mut log.writer()) {
                reserved = log.backend.allocate(file, upto);
            }
        }
        reserved?;
        self.reserved_to = upto;
        Ok(())
    }
}

pub(super) fn put_stream<B: Backend>(
    log: &SegmentLog<B>,
    key: &[u8],
    meta: &StreamedValue,
    src: &mut dyn io::Read,
) -> Result<()> {
    if key.len() > format::MAX_KEY_BYTES {
        return Err(Error::KeyTooLarge { len: key.len(), max: format::MAX_KEY_BYTES });
    }
    stored::check_announced(meta)?;
    let total: u64 = meta.frame_lens.iter().sum(); // laid out within u64: checked above
    if total > log.opts.max_value_bytes || meta.stored_len > log.opts.max_value_bytes + (1 << 20) {
        return Err(Error::ValueTooLarge {
            len: total.max(meta.stored_len),
            max: log.opts.max_value_bytes,
            unit: "bytes",
        });
    }
    let len = format::record_len(meta.frame_lens.len(), key.len(), meta.stored_len);
    if len > MAX_RECORD_BYTES {
        return Err(Error::ValueTooLarge { len, max: MAX_RECORD_BYTES, unit: "record bytes" });
    }
    if meta.stored_len > STREAM_BUFFERED_MAX.max(log.opts.segment_bytes / 8) {
        return put_stream_apart(log, key, meta, src, len);
    }
    // Small: into memory first, so that the writer lock is held for a write, never for a peer.
    let mut payload = vec![0u8; meta.stored_len as usize];
    read_payload(src, &mut payload)?;
    put_stream_locked(log, key, meta, &mut &payload[..], len)
}

/// The header and the encoded head (header, frame table, key: everything before the payload)
/// of a streamed value's record in segment `segment`. A streamed payload is never padded
/// (`aux` 0): it is written as it arrives.
pub(super) fn streamed_head<B: Backend>(
    log: &SegmentLog<B>,
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
    format::write_record_head(&mut head, &h, &meta.frame_lens, key, log.salt);
    (h, head)
}

/// `put_stream` of a value read from `src` while holding the writer lock (its bytes are in
/// memory already: see `put_stream`), appended to the active segment.
pub(super) fn put_stream_locked<B: Backend>(
    log: &SegmentLog<B>,
    key: &[u8],
    meta: &StreamedValue,
    src: &mut dyn io::Read,
    len: u64,
) -> Result<()> {
    let mut guard = log.writer();
    // Checked under the writer lock: a write or fsync that failed while this call waited for
    // the lock poisoned the log, and nothing may be written (or an fsync retried) after that.
    log.health.check_writable()?;
    let st = &mut *guard;
    let need_new = match &st.active {
        Some(a) => !fits(log, a, len, key.len()),
        None => true,
    };
    if need_new {
        rotate(log, st, len, key.len())?;
    }
    // The value is streamed straight to the file, after what is pending (write-behind).
    flush_pending(log, st)?;
    let epoch = st.epoch;
    let seq = st.next_seq;
    st.next_seq += 1;
    let a = st.active.as_ref().expect("active after rotate");
    let (id, start, file) = (a.id, a.data_end, a.file.clone());
    let at = StreamAt { id, base: align_down(start, log.align), old_tail: a.tail.clone(), end: start + len };
    let (h, head) = streamed_head(log, key, meta, id, epoch, seq);
    // A panic of the caller's reader is caught, so that what this value wrote is erased below
    // like after any other failure, and then goes on unwinding.
    let mut incoming = Incoming::new(src, meta);
    let (last, last_base) = match stream_into_active(log, &file, &at, &head, &mut incoming) {
        Ok(last) => last,
        Err((e, written_to)) => {
            let failed = abort_stream(log, st, &file, &at, written_to, e);
            if let Some(panic) = incoming.panicked.take() {
                drop(guard);
                std::panic::resume_unwind(panic);
            }
            return Err(failed);
        }
    };
    // The record's padding is part of the tail block the next write rewrites.
    let pend = padded(at.end);
    let tail_start = align_down(pend, log.align);
    let tail = last[(tail_start - last_base) as usize..(pend - last_base) as usize].to_vec();
    let empty = Frames::default();
    let rec = NewRecord::Value { key, frames: &empty };
    let chunk = [Prepared { rec, payload: Payload::Empty, len, pad: 0, align_head: 0 }];
    publish_chunk(log, st, &chunk, &[Placed::new(start, &h)], pend, tail, epoch, false)?;
    log.compact_if_pending(st);
    Ok(())
}

/// Write a streamed record into the active segment's `file` at `at`: the tail block before it
/// and its `head` first, then its payload from `incoming`, in pieces of at least 1 MiB (each a
/// multiple of the alignment), the last one padded to the block. Returns the last piece and its
/// offset; on failure, the error and the offset up to which bytes may have been written.
fn stream_into_active<B: Backend>(
    log: &SegmentLog<B>,
    file: &B::File,
    at: &StreamAt,
    head: &[u8],
    incoming: &mut Incoming<'_>,
) -> std::result::Result<(AlignedBuf, u64), (Error, u64)> {
    const CHUNK: usize = 1 << 20;
    let align = log.align as usize;
    // The extra block of capacity leaves room for the last record's padding.
    let fill = CHUNK.max(align_up((at.old_tail.len() + head.len()) as u64, log.align) as usize);
    let mut buf = log.backend.alloc_buf(fill + align, align);
    buf.set_len(0);
    buf.extend_from_slice(&at.old_tail);
    buf.extend_from_slice(head);
    let mut buf_base = at.base;
    let write = |buf: &mut AlignedBuf, base: u64| -> Result<()> {
        let (r, b) = log.backend.write_at(file, base, std::mem::replace(buf, AlignedBuf::zeroed(0, align)));
        *buf = b;
        r.map_err(|e| log.health.write_failed("write segment", log.seg_path(at.id), e))
    };
    let result = (|| {
        // Fill the buffer from the peer, then write it whole (it is a multiple of `align`).
        while !incoming.fill_caught(&mut buf, fill)? {
            write(&mut buf, buf_base)?;
            buf_base += buf.len() as u64;
            buf.set_len(0);
        }
        // Bad bytes from the peer (the record is zeroed by the caller).
        incoming.finish()?;
        // Last piece: pad the record and the block, write, keep the new tail block.
        let from = buf.len();
        debug_assert_eq!(from, (at.end - buf_base) as usize);
        let block_end = (align_up(padded(at.end), log.align) - buf_base) as usize;
        buf.set_len(block_end.max(from));
        buf[from..].fill(0);
        write(&mut buf, buf_base)
    })();
    match result {
        Ok(()) => Ok((buf, buf_base)),
        Err(e) => Err((e, align_up(at.end, log.align).min(buf_base + buf.capacity() as u64))),
    }
}

/// A streamed record into the active segment failed with `e`: nothing was published. Erase
/// what it wrote (up to `written_to`), so neither the next records nor recovery ever see a
/// partial record, and fence the write. Returns the error to report.
fn abort_stream<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    file: &B::File,
    at: &StreamAt,
    written_to: u64,
    e: Error,
) -> Error {
    let erased = erase_aborted(&log.backend, log.align, file, at.base, &at.old_tail, written_to);
    fence_failed_write(log, st, None); // (erased just above)
    match erased {
        Err(we) => log.health.write_failed("erase an aborted value", log.seg_path(at.id), we),
        Ok(()) if log.opts.durable && !log.health.is_poisoned() => {
            // As in `erase_durably`: the aborted record's head sat at the published end.
            let file = st.active.as_ref().expect("still active").file.clone();
            match log.backend.sync_data(&file) {
                Err(se) => log.health.poison(Error::io("sync segment", log.seg_path(at.id), se)),
                Ok(()) => e,
            }
        }
        Ok(()) => e,
    }
}

/// `put_stream` of a large value: into a segment of its own, created for it, without the writer
/// lock (taken only to reserve the segment id and the sequence number, then to publish), so that
/// writes go on while the value arrives. The segment is written whole (its header, the record,
/// the footer and the trailer: sealed) before it joins the log. A put, delete or forget of the
/// key while the value arrives is newer: the streamed record is then dead on arrival (the
/// record a later recovery would pick agrees: the other operation's sequence number is higher,
/// or, after a forget, a spill log may bring either back). Compaction may move the key's old
/// record meanwhile: a move keeps its sequence number and does not overtake the stream.
pub(super) fn put_stream_apart<B: Backend>(
    log: &SegmentLog<B>,
    key: &[u8],
    meta: &StreamedValue,
    src: &mut dyn io::Read,
    len: u64,
) -> Result<()> {
    let data_start = log.align;
    let size = align_up(padded(data_start + len), log.align)
        + align_up(footer_entry_len(key.len()) + format::TRAILER_LEN as u64, log.align);
    let (id, seq, epoch) = {
        let mut st = log.writer();
        log.health.check_writable()?;
        let id = st.next_segment;
        st.next_segment = id.checked_add(1).ok_or_else(|| Error::Exhausted("segment ids".into()))?;
        let seq = st.next_seq;
        st.next_seq += 1;
        log.streams.begin(key, seq);
        (id, seq, st.epoch)
    };
    let path = log.seg_path(id);
    let written = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        write_streamed_segment(log, &path, id, size, key, meta, seq, epoch, src)
    }));
    let mut guard = log.writer();
    let st = &mut *guard;
    let (file, h) = match written {
        Ok(Ok(w)) => w,
        Ok(Err(e)) => {
            end_unpublished(log, st, key, seq);
            return Err(e);
        }
        Err(panic) => {
            // (Its file may be there: a reader that panics is the caller's bug, and the
            // segment goes like any torn one at the next open if this removal fails.)
            let _ = log.backend.remove_file(&path);
            log.streams.ended(key, seq);
            drop(guard);
            std::panic::resume_unwind(panic);
        }
    };
    if let Err(e) = log.health.check_writable() {
        // Poisoned meanwhile: the log changes nothing on disk any more, and takes no segment.
        drop(file);
        let _ = log.backend.remove_file(&path);
        log.streams.ended(key, seq);
        return Err(e);
    }
    if removed_overtaken(log, st, key, seq, &path) {
        return Ok(());
    }
    let file = Arc::new(file);
    st.dir_dirty = true;
    st.dir_new_segments = true;
    log.files.write().unwrap_or_else(|p| p.into_inner()).insert(id, file.clone());
    st.segs.insert(id, SegMeta::holding(size, data_start, padded(data_start + len), 1, true));
    st.unsynced_sealed.push(file);
    publish_streamed(log, st, key, seq, Location { segment: id, offset: data_start, len }, &h);
    log.health.wrote();
    // The old record's segment, or this one if a newer operation made it dead on arrival.
    reclaim(log, st);
    Ok(())
}

/// Remove the segment (its file at `path`) of a stream of `key` (sequence number `seq`) that a
/// newer write of its key overtook, before the stream ends. A tombstone written meanwhile lies in
/// an older segment than the stream's, and its range does not reach it: garbage collection and
/// compaction keep it only while the stream lasts (`Streams::streaming`), so the stream's segment
/// must be gone first, durably first in a durable log (the directory is fsync'ed before another
/// segment is removed: `gc::delete_segment`). Returns whether it was removed; if not (not
/// overtaken, or the removal failed), the segment joins the log as any streamed one.
fn removed_overtaken<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    key: &[u8],
    seq: u64,
    path: &Path,
) -> bool {
    if !log.streams.overtaken(key, seq) || log.backend.remove_file(path).is_err() {
        return false;
    }
    // The segment's creation and its removal, unsynced in the directory.
    st.dir_dirty = true;
    st.dir_new_segments = true;
    end_unpublished(log, st, key, seq);
    true
}

/// The stream of `key` (sequence number `seq`) ends without its record joining the log: it is
/// forgotten, and the garbage collection that waited for it runs (see `Streams::in_progress`),
/// unless the log is read-only.
fn end_unpublished<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>, key: &[u8], seq: u64) {
    log.streams.ended(key, seq);
    if !log.health.is_poisoned() {
        reclaim(log, st);
    }
}

/// Publish the record at `loc` (header `h`) of a stream of `key` (sequence number `seq`) in a
/// segment of its own, unless a newer write of the key overtook it (then it is dead on
/// arrival, and its segment goes at the next garbage collection).
fn publish_streamed<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    key: &[u8],
    seq: u64,
    loc: Location,
    h: &RecordHeader,
) {
    let mut index = log.index.publisher(&mut st.segs);
    // Under the index lock, as `forget` marks streams: none can come between.
    if log.streams.ended(key, seq) {
        return;
    }
    // A write of the key, for the streams of it that began before this one.
    log.streams.written_meanwhile(key, seq);
    let facts = RecordFacts::of(h.flags, h.frame_count, h.payload_crc, h.aux, h.stored_len);
    // A segment the old record leaves empty goes at the next garbage collection.
    index.value(key, loc, facts, false, &mut Vec::new());
}

/// The segment of a `put_stream_apart`: created at `path`, its header, the record (its payload
/// from `src`, checked by `stored::PayloadCheck`), made durable first in a durable log, then
/// its footer and trailer. On failure the file is removed (it was never part of the log).
#[allow(clippy::too_many_arguments)] // one value's record, as `put_stream_apart` placed it
pub(super) fn write_streamed_segment<B: Backend>(
    log: &SegmentLog<B>,
    path: &Path,
    id: u32,
    size: u64,
    key: &[u8],
    meta: &StreamedValue,
    seq: u64,
    epoch: u32,
    src: &mut dyn io::Read,
) -> Result<(B::File, RecordHeader)> {
    let file = log.backend.open(path, true).map_err(|e| Error::io("create segment", path.to_path_buf(), e))?;
    let data_start = log.align;
    let align = log.align as usize;
    // As on every write path: a full file system fails this call alone, any other failure
    // makes the log read-only (see `write_failed`).
    let io_err = |op: &'static str| move |e: io::Error| log.health.write_failed(op, path.to_path_buf(), e);
    let mut space = ReserveAhead { size, reserved_to: 0, spares_released: false };
    let mut reserve = |upto: u64| space.reserve(log, &file, upto).map_err(io_err("fallocate"));
    let written = (|| -> Result<RecordHeader> {
        reserve(0)?;
        write_segment_header(log, &file, id, size, epoch).map_err(io_err("write segment header"))?;
        let (h, head) = streamed_head(log, key, meta, id, epoch, seq);
        let po = head.len();
        const CHUNK: usize = 1 << 20;
        // Pieces of `fill` bytes (a multiple of the alignment), the last one padded.
        let fill = CHUNK.max(align_up(po as u64, log.align) as usize);
        let mut buf = log.backend.alloc_buf(fill + align, align);
        buf.set_len(0);
        buf.extend_from_slice(&head);
        let mut at = data_start;
        let mut incoming = Incoming::new(&mut *src, meta);
        while !incoming.fill(&mut buf, fill)? {
            reserve(at + buf.len() as u64)?;
            let (r, b) = log.backend.write_at(&file, at, std::mem::replace(&mut buf, AlignedBuf::zeroed(0, align)));
            buf = b;
            r.map_err(io_err("write segment"))?;
            at += buf.len() as u64;
            buf.set_len(0);
        }
        incoming.finish()?;
        reserve(size)?;
        let end = buf.len();
        buf.set_len(align_up(end as u64, log.align) as usize);
        buf[end..].fill(0);
        log.backend.write_at(&file, at, buf).0.map_err(io_err("write segment"))?;
        if log.opts.durable {
            log.backend.sync_data(&file).map_err(io_err("sync segment"))?;
        }
        seal_streamed(log, &file, id, size, key, &h, epoch).map_err(io_err("write footer"))?;
        Ok(h)
    })();
    match written {
        Ok(h) => Ok((file, h)),
        Err(e) => {
            drop(file);
            let _ = log.backend.remove_file(path);
            Err(e)
        }
    }
}

/// Seal a streamed segment (`size` bytes): its footer, the entry of its one record (`key`,
/// with header `h`), and its trailer.
fn seal_streamed<B: Backend>(
    log: &SegmentLog<B>,
    file: &B::File,
    id: u32,
    size: u64,
    key: &[u8],
    h: &RecordHeader,
    epoch: u32,
) -> io::Result<()> {
    let data_start = log.align;
    let mut footer = Vec::new();
    let entry = FooterEntry {
        key: key.to_vec(),
        flags: h.flags & format::FLAG_LZ4,
        frame_count: h.frame_count,
        payload_crc: h.payload_crc,
        offset: data_start,
        record_len: h.record_len(),
        seq: h.seq,
        aux: 0,
    };
    format::encode_footer_entry(&mut footer, &entry);
    let data_end = padded(data_start + h.record_len());
    write_seal(log, file, id, size, data_end, &footer, 1, epoch).map(|_| ())
}
