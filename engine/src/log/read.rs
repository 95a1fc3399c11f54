//! Reads: the index lookup, the read plan (one aligned read of header + key + payload), decode and
//! checksum (in parallel for large payloads), pipelined and async reads, and the stored form of a
//! value for sending ([`StoredValue`], pinned so its bytes stay put while a send reads them).

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use bytes::Bytes;

use crate::backend::{Backend, BufResult, PipelinedRead};
use crate::buf::AlignedBuf;
use crate::error::{Error, Result};
use crate::format::{align_down, align_up, Salt};
use crate::stored::StreamedValue;
use crate::sync::Mutex;
use crate::value::Frames;
use crate::{format, stored};

use super::location::{Location, PackedLoc};
use super::segments::flush_pending;
use super::write_behind::pending_record;
use super::{lock, SegmentLog};

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

/// Records being sent ([`SegmentLog::stored_value`]), by (segment, offset), with a count.
type SendPins = Arc<Mutex<HashMap<(u32, u64), u32>>>;

/// What is being sent from the log's files, and what was: the records pinned while a sender reads
/// them (`forget` does not punch them), and the segments values were handed out from. Those files
/// are never reused for new segments: a `splice` into a socket leaves references to the file's
/// pages in the socket's queue after it returns, and writing over the file would change what the
/// peer still receives.
pub(super) struct Sends {
    pins: SendPins,
    from: Mutex<BTreeSet<u32>>,
}

impl Sends {
    pub(super) fn new() -> Self {
        Sends { pins: Arc::new(Mutex::new(HashMap::new())), from: Mutex::new(BTreeSet::new()) }
    }

    /// Pin the record at `at` (segment, offset) for as long as the pin lives.
    pub(super) fn pin(&self, at: (u32, u64)) -> SendPin {
        *lock(&self.pins).entry(at).or_insert(0) += 1;
        SendPin { pins: self.pins.clone(), at }
    }

    /// Whether the record at `at` is being sent.
    pub(super) fn pinned(&self, at: (u32, u64)) -> bool {
        lock(&self.pins).contains_key(&at)
    }

    /// A value was handed out from `segment` for sending.
    pub(super) fn sent_from(&self, segment: u32) {
        lock(&self.from).insert(segment);
    }

    /// Whether a value was handed out from `segment` (deleted now: it is forgotten here).
    pub(super) fn take_sent_from(&self, segment: u32) -> bool {
        lock(&self.from).remove(&segment)
    }
}

/// One pin of a record being sent: while it lives, `forget` leaves the record's blocks alone (the
/// sender reads them from the file after the key may have been forgotten).
pub(super) struct SendPin {
    pins: SendPins,
    at: (u32, u64),
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

/// A read of a record, planned by `plan_read`.
#[derive(Debug, Clone, Copy)]
pub(super) struct ReadPlan {
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
    pub(super) fn finish(&self, buf: Bytes, key: &[u8], salt: Salt) -> Result<Frames> {
        self.finish_with_crc(buf, key, salt).map(|(frames, _)| frames)
    }

    /// [`ReadPlan::finish`], with the crc the value was checked against (see
    /// [`SegmentLog::get_with_crc`]).
    pub(super) fn finish_with_crc(&self, buf: Bytes, key: &[u8], salt: Salt) -> Result<(Frames, Option<u32>)> {
        let at = (self.from - self.start) as usize;
        let raw = buf.slice(at..at + self.len as usize);
        let Some(expected) = self.crc else {
            return decode_read_with_crc(raw, self.loc, key, salt);
        };
        self.finish_payload(buf, expected, format::payload_crc(&raw))
    }

    /// A payload read without its head (`buf` holds the file range `start..end`), whose crc is
    /// `actual`, checked against the index's `expected`: the value's one frame.
    pub(super) fn finish_payload(&self, buf: Bytes, expected: u32, actual: u32) -> Result<(Frames, Option<u32>)> {
        if actual != expected {
            let e = format::DecodeError::Checksum { what: "record payload", expected, actual };
            return Err(e.at(self.loc.segment, self.loc.offset));
        }
        let at = (self.from - self.start) as usize;
        let raw = buf.slice(at..at + self.len as usize);
        // One frame, no gaps: its crc is the laid-out crc.
        Ok((Frames(std::iter::once(raw).collect()), Some(actual)))
    }
}

/// Check the record bytes read for `key` at `loc` and cut them into frames (decompressing if needed).
pub(super) fn decode_read(raw: Bytes, loc: Location, key: &[u8], salt: Salt) -> Result<Frames> {
    decode_read_with_crc(raw, loc, key, salt).map(|(frames, _)| frames)
}

/// [`decode_read`], with the payload crc when the record is not compressed (the laid-out crc of the
/// frames, which `decode_record` checked).
pub(super) fn decode_read_with_crc(raw: Bytes, loc: Location, key: &[u8], salt: Salt) -> Result<(Frames, Option<u32>)> {
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
    let payload = raw.slice(po..po + h.stored_len as usize);
    let frames = stored::decode(payload, h.is_lz4(), h.raw_len, &r.frame_lens).map_err(|m| Error::Corrupt {
        segment: loc.segment,
        offset: loc.offset,
        reason: m.reason().into(),
    })?;
    Ok((frames, (!h.is_lz4()).then_some(h.payload_crc)))
}

pub(super) fn get<B: Backend>(log: &SegmentLog<B>, key: &[u8]) -> Result<Option<Frames>> {
    Ok(log.get_with_crc(key)?.map(|(frames, _)| frames))
}

pub(super) fn get_with_crc<B: Backend>(log: &SegmentLog<B>, key: &[u8]) -> Result<Option<(Frames, Option<u32>)>> {
    let mut tries = 0;
    loop {
        let Some((p, file)) = lookup(log, key) else {
            return Ok(None);
        };
        let loc = p.loc();
        let got = match pending_record(log, loc)? {
            Some(raw) => decode_read_with_crc(raw, loc, key, log.salt),
            None => read_planned(log, &file, plan_read(log, &p, key.len()), key),
        };
        match got {
            Err(e) if tries < 8 && moved_under_read(log, &e, key, loc) => tries += 1,
            got => return got.map(Some),
        }
    }
}

/// Whether `e`, the failure of a read of `key`'s record at `loc`, may come from the key being
/// forgotten or moved while it was read rather than from damage: a forget may punch the record's
/// blocks once the index no longer points there. Then the reader looks the key up again instead
/// of reporting damage that is not there.
pub(super) fn moved_under_read<B: Backend>(log: &SegmentLog<B>, e: &Error, key: &[u8], loc: Location) -> bool {
    matches!(e, Error::Corrupt { .. } | Error::ChecksumMismatch { .. })
        && log.location(key).is_none_or(|l| (l.segment, l.offset) != (loc.segment, loc.offset))
}

pub(super) fn location<B: Backend>(log: &SegmentLog<B>, key: &[u8]) -> Option<Location> {
    log.index.get(key).map(Location::from)
}

pub(super) fn lookup<B: Backend>(log: &SegmentLog<B>, key: &[u8]) -> Option<(PackedLoc, Arc<B::File>)> {
    // Hold the index lock while taking the file handle: a segment is only deleted after the index
    // stopped pointing at it, so the pair is consistent (and an unlinked file stays readable).
    log.index.get_then(key, |p| {
        let file = log.files.read().unwrap_or_else(|p| p.into_inner()).get(&p.segment())?.clone();
        Some((p, file))
    })
}

/// What to read for the record `p` of a key of `key_len` bytes: a value the index can check
/// (single frame, not compressed) is read without its head, only its payload, which the writer
/// put at a sector boundary when it is large (see [`ALIGN_PAYLOAD_MIN`]); any other record whole.
pub(super) fn plan_read<B: Backend>(log: &SegmentLog<B>, p: &PackedLoc, key_len: usize) -> ReadPlan {
    let loc = p.loc();
    let facts = p.facts();
    let head = format::head_len(1, key_len) + facts.pad() as u64;
    let (from, len, crc) = match facts.direct_crc() {
        Some(crc) if head < loc.len => (loc.offset + head, loc.len - head, Some(crc)),
        _ => (loc.offset, loc.len, None),
    };
    let start = align_down(from, log.read_align);
    let end = align_up(from + len, log.read_align);
    ReadPlan { loc, start, end, from, len, crc }
}

/// Read what `plan` says and decode it.
/// A payload read without its head is checksummed by the backend as it reads
/// ([`Backend::read_new_crc`]: a large one in two halves at once).
pub(super) fn read_planned<B: Backend>(
    log: &SegmentLog<B>,
    file: &B::File,
    plan: ReadPlan,
    key: &[u8],
) -> Result<(Frames, Option<u32>)> {
    let (len, align) = ((plan.end - plan.start) as usize, log.buf_align(plan.end - plan.start));
    let io_err = |e| Error::io("read segment", log.seg_path(plan.loc.segment), e);
    let Some(expected) = plan.crc else {
        let buf = log.backend.read_new(file, plan.start, len, align).map_err(io_err)?;
        return plan.finish_with_crc(buf.freeze(), key, log.salt);
    };
    let at = (plan.from - plan.start) as usize;
    let (buf, actual) =
        log.backend.read_new_crc(file, plan.start, len, align, at..at + plan.len as usize).map_err(io_err)?;
    plan.finish_payload(buf.freeze(), expected, actual)
}

/// Read the raw bytes of the record at `loc` (aligned read, zero-copy slice).
pub(super) fn read_record_bytes<B: Backend>(log: &SegmentLog<B>, file: &B::File, loc: Location) -> Result<Bytes> {
    let start = align_down(loc.offset, log.read_align);
    let end = align_up(loc.offset + loc.len, log.read_align);
    let len = (end - start) as usize;
    let buf = log
        .backend
        .read_new(file, start, len, log.buf_align(len as u64))
        .map_err(|e| Error::io("read segment", log.seg_path(loc.segment), e))?;
    let b = buf.freeze();
    Ok(b.slice((loc.offset - start) as usize..(loc.offset - start + loc.len) as usize))
}

pub(super) fn get_async<B: Backend>(
    log: &SegmentLog<B>,
    key: &[u8],
) -> impl Future<Output = Result<Option<Frames>>> + Send + 'static {
    let started = lookup(log, key).map(|(p, file)| {
        // A pending record (write-behind) is served from memory.
        let plan = plan_read(log, &p, key.len());
        let from_memory = pending_record(log, plan.loc)?;
        let read = from_memory.is_none().then(|| {
            let buf = log.backend.alloc_buf((plan.end - plan.start) as usize, log.buf_align(plan.end - plan.start));
            log.backend.read_at_async(&file, plan.start, buf)
        });
        // The handle goes with the future until the read completes: a segment file something
        // holds is never reused for another segment (`keep_as_spare`) while the read is in flight.
        Ok((plan, from_memory, read.map(|r| (r, file)), log.seg_path(plan.loc.segment)))
    });
    let key = key.to_vec();
    let salt = log.salt;
    async move {
        let Some(started) = started else {
            return Ok(None);
        };
        let (plan, from_memory, read, path) = started?;
        let Some((read, file)) = read else {
            return decode_read(from_memory.expect("a pending record"), plan.loc, &key, salt).map(Some);
        };
        let (r, buf) = read.await;
        drop(file);
        r.map_err(|e| Error::io("read segment", path, e))?;
        plan.finish(buf.freeze(), &key, salt).map(Some)
    }
}

pub(super) fn get_pipelined<B: Backend>(
    log: &SegmentLog<B>,
    depth: usize,
    keys: &mut dyn Iterator<Item = Vec<u8>>,
    on_value: &mut dyn FnMut(Vec<u8>, Result<Option<Frames>>),
) -> Result<()> {
    let pending: RefCell<slab::Slab<(Vec<u8>, ReadPlan)>> = RefCell::new(slab::Slab::new());
    let on_value = RefCell::new(on_value);
    let mut next = || loop {
        let key = keys.next()?;
        match lookup(log, &key) {
            None => (on_value.borrow_mut())(key, Ok(None)),
            // A pending record (write-behind): served from memory.
            Some((p, _)) if log.pending.may_hold(p.loc()) => {
                let res = match pending_record(log, p.loc()) {
                    Ok(Some(raw)) => decode_read(raw, p.loc(), &key, log.salt).map(Some),
                    Ok(None) => log.get(&key), // written meanwhile: read as usual
                    Err(e) => Err(e),
                };
                (on_value.borrow_mut())(key, res)
            }
            Some((p, file)) => {
                let plan = plan_read(log, &p, key.len());
                let buf = log.backend.alloc_buf((plan.end - plan.start) as usize, log.buf_align(plan.end - plan.start));
                let offset = plan.start;
                let tag = pending.borrow_mut().insert((key, plan)) as u64;
                return Some(PipelinedRead { file, offset, buf, tag });
            }
        }
    };
    let mut done = |tag: u64, (r, buf): BufResult| {
        let (key, plan) = pending.borrow_mut().remove(tag as usize);
        let res = match r {
            Err(e) => Err(Error::io("read segment", log.seg_path(plan.loc.segment), e)),
            Ok(()) => match plan.finish(buf.freeze(), &key, log.salt) {
                // Forgotten or moved while being read: as a fresh `get` finds it now.
                Err(e) if moved_under_read(log, &e, &key, plan.loc) => log.get(&key),
                got => got.map(Some),
            },
        };
        (on_value.borrow_mut())(key, res);
    };
    log.backend.read_pipelined(depth, &mut next, &mut done).map_err(|e| Error::io("read pipeline", None, e))
}

pub(super) fn stored_value<B: Backend>(log: &SegmentLog<B>, key: &[u8]) -> Result<Option<StoredValue<B::File>>> {
    let mut tries = 0;
    let (loc, file, pin) = loop {
        let Some((loc, file)) = lookup(log, key).map(|(p, f)| (p.loc(), f)) else { return Ok(None) };
        // Pinned before the index is checked again: a forget that removed the key before the
        // check makes it absent; one after it finds the pin and does not punch what is being
        // sent.
        let pin = log.sends.pin((loc.segment, loc.offset));
        match log.location(key) {
            None => return Ok(None),
            Some(l) if (l.segment, l.offset) == (loc.segment, loc.offset) => {
                if log.opts.recycle_segments {
                    log.sends.sent_from(loc.segment);
                }
                break (loc, file, pin);
            }
            // Rewritten (a put, or compaction moving it) meanwhile: the new record is looked up.
            Some(_) if tries < 64 => tries += 1,
            Some(_) => {
                let why = io::Error::new(io::ErrorKind::WouldBlock, "the key is rewritten too often to pin");
                return Err(Error::io("pin a record to send", None, why));
            }
        }
    };
    if log.pending.may_hold(loc) {
        // Pending (write-behind): written out first. If that write fails, it is in memory, not in
        // a file (`Error::Poisoned`, or a full file system: the transfer sources then send it
        // from memory).
        let mut st = log.writer();
        if st.active.as_ref().is_some_and(|a| a.id == loc.segment && loc.offset >= a.written_end) {
            flush_pending(log, &mut st)?;
        }
    }
    let fixed = read_range(log, &file, loc, 0, format::RECORD_HEADER_LEN as u64)?;
    let h = format::peek_record_header(&fixed).map_err(|e| e.at(loc.segment, loc.offset))?;
    let head = read_range(log, &file, loc, 0, h.payload_offset())?;
    let frame_lens = format::verify_record_head(&head, &h, log.salt).map_err(|e| e.at(loc.segment, loc.offset))?;
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
        path: log.seg_path(loc.segment),
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

pub(super) fn read_stored<B: Backend>(log: &SegmentLog<B>, sv: &StoredValue<B::File>) -> Result<Bytes> {
    log.read_stored_part(sv, 0, sv.meta.stored_len)
}

pub(super) fn read_stored_part<B: Backend>(
    log: &SegmentLog<B>,
    sv: &StoredValue<B::File>,
    from: u64,
    len: u64,
) -> Result<Bytes> {
    if from.checked_add(len).is_none_or(|end| end > sv.meta.stored_len) {
        return Err(Error::Internal(format!("bytes {from}..+{len} are outside a payload of {}", sv.meta.stored_len)));
    }
    let a = sv.payload_offset + from;
    let start = align_down(a, log.read_align);
    let end = align_up(a + len, log.read_align);
    let buf = log.backend.alloc_buf((end - start) as usize, log.buf_align(end - start));
    let (r, buf) = log.backend.read_at(&sv.file, start, buf);
    r.map_err(|e| Error::io("read segment", sv.path.clone(), e))?;
    Ok(buf.freeze().slice((a - start) as usize..(a - start + len) as usize))
}

/// `len` bytes from `from` within the record at `loc` (an aligned read, sliced).
pub(super) fn read_range<B: Backend>(
    log: &SegmentLog<B>,
    file: &B::File,
    loc: Location,
    from: u64,
    len: u64,
) -> Result<Bytes> {
    let a = loc.offset + from;
    let start = align_down(a, log.read_align);
    let end = align_up(a + len, log.read_align);
    let buf = AlignedBuf::zeroed((end - start) as usize, log.buf_align(end - start));
    let (r, buf) = log.backend.read_at(file, start, buf);
    r.map_err(|e| Error::io("read segment", log.seg_path(loc.segment), e))?;
    Ok(buf.freeze().slice((a - start) as usize..(a - start + len) as usize))
}

pub(super) fn contains<B: Backend>(log: &SegmentLog<B>, key: &[u8]) -> bool {
    log.index.contains(key)
}

pub(super) fn len<B: Backend>(log: &SegmentLog<B>) -> usize {
    log.index.len()
}

pub(super) fn is_empty<B: Backend>(log: &SegmentLog<B>) -> bool {
    log.len() == 0
}

pub(super) fn keys<B: Backend>(log: &SegmentLog<B>) -> Vec<Vec<u8>> {
    log.index.keys()
}
