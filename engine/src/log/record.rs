//! A record on its way into a segment: what a writer prepares ([`NewRecord`], and in [`Prepared`]
//! its payload and layout), its sequence number, its encoding into an aligned write buffer and,
//! once the writes of its chunk are in the kernel, publishing it to the index and the segment
//! accounting, or fencing off a write that failed. Every path that writes records (`write.rs`,
//! `write_behind.rs`, `gather.rs`, `stream.rs`) builds on these.

use crate::backend::Backend;
use crate::error::Result;
use crate::format;
use crate::format::{align_up, FooterEntry, RecordHeader};
use crate::value::Frames;

use super::gc::reclaim;
use super::location::{Location, RecordFacts};
use super::segments::WriterState;
use super::{laid_out_len, SegmentLog};

/// A record ready to be appended.
pub(super) enum NewRecord<'a> {
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
    pub(super) fn key(&self) -> &[u8] {
        match self {
            NewRecord::Value { key, .. } | NewRecord::Tombstone { key, .. } | NewRecord::Relocated { key, .. } => key,
            NewRecord::SyncMark => &[],
        }
    }
}

/// The stored form of a value payload: borrowed frames or an owned compressed block.
pub(super) enum Payload<'a> {
    Frames(&'a Frames),
    Compressed(Vec<u8>),
    Relocated(&'a [u8]),
    Empty,
}

/// Where a record of a chunk was placed, and the header fields its footer entry and index entry
/// keep.
#[derive(Debug, Clone, Copy)]
pub(super) struct Placed {
    offset: u64,
    /// The header written there.
    h: RecordHeader,
}

impl Placed {
    pub(super) fn new(offset: u64, h: &RecordHeader) -> Self {
        Placed { offset, h: *h }
    }

    /// The payload crc of the record, computed after its place was set (a gathered write's crcs
    /// are taken on a helper thread).
    pub(super) fn set_payload_crc(&mut self, crc: u32) {
        self.h.payload_crc = crc;
    }
}

pub(super) struct Prepared<'a> {
    pub(super) rec: NewRecord<'a>,
    pub(super) payload: Payload<'a>,
    /// Record length where the record was last placed ([`Prepared::place`]), padding included.
    pub(super) len: u64,
    /// Payload padding where the record was last placed.
    pub(super) pad: u64,
    /// The head length (without padding) of a value whose payload the writer aligns (see
    /// [`ALIGN_PAYLOAD_MIN`]); 0 for any other record.
    pub(super) align_head: u64,
}

impl Prepared<'_> {
    /// The most the record can take, wherever it is placed.
    pub(super) fn max_len(&self) -> u64 {
        let most = if self.align_head > 0 { format::PAYLOAD_PAD_LIMIT - format::FRAME_ALIGN } else { 0 };
        self.len - self.pad + most
    }

    /// Place the record at `pos`: a value whose payload is aligned gets the padding that starts its
    /// payload at a multiple of [`format::PAYLOAD_PAD_LIMIT`].
    pub(super) fn place(&mut self, pos: u64) {
        if self.align_head > 0 {
            let bare = self.len - self.pad;
            self.pad = format::payload_pad(pos, self.align_head);
            self.len = bare + self.pad;
        }
    }
}

/// The sequence number of a record being written: a relocated record keeps its own, any other
/// takes the next one.
pub(super) fn seq_for<F>(st: &mut WriterState<F>, rec: &NewRecord<'_>) -> u64 {
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
pub(super) fn encode_record<B: Backend>(
    log: &SegmentLog<B>,
    p: &Prepared<'_>,
    dst: &mut [u8],
    segment: u32,
    epoch: u32,
    seq: u64,
) -> RecordHeader {
    match (&p.rec, &p.payload) {
        (NewRecord::Relocated { header, .. }, Payload::Relocated(bytes)) => {
            dst.copy_from_slice(bytes);
            format::relocate_record(dst, header, segment, epoch, log.salt);
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
            format::write_record_head(dst, &h, &frame_lens, key, log.salt);
            h
        }
    }
}

/// After a write of new records failed: whole records of it may lie in the file past the published
/// end, beyond what the next write covers. Later records get a higher epoch, and recovery's scan
/// drops a record whose epoch is lower than the one before it (as it does for a torn tail's
/// leftovers), so those records never come back once anything was written after them. After a
/// full file system (`erase_to`: the end of the failed write; the log stays writable), a durable
/// log also zeroes and syncs what the write left, for the reason recovery does (see
/// `SegmentReader::erase_durably`): a leftover *at* the end is not covered by the epoch rule; a failed
/// sync then makes the log read-only. (After any other failure the log is read-only already, and
/// recovery erases the leftovers at the next open.)
pub(super) fn fence_failed_write<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    erase_to: Option<u64>,
) {
    if let Some(e) = st.epoch.checked_add(1) {
        st.epoch = e;
    }
    let (Some(end), true) = (erase_to, log.opts.durable) else { return };
    let Some(a) = &st.active else { return };
    debug_assert_eq!(a.written_end, a.data_end, "pending records are written before new ones");
    let end = align_up(end, log.align).min(a.size);
    if let Err(e) = log.reader().erase_durably(&a.file, a.id, a.data_end, &a.tail, end) {
        log.health.poison(e);
    }
}

/// After the bytes of `chunk` are written at `placed` (offset, len, seq) up to `end` (or, if
/// `deferred`, encoded in `tail` and pending): update the active segment (tail, footer,
/// metadata), then the index and the live accounting.
#[allow(clippy::too_many_arguments)]
pub(super) fn publish_chunk<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    chunk: &[Prepared<'_>],
    placed: &[Placed],
    end: u64,
    tail: Vec<u8>,
    epoch: u32,
    deferred: bool,
) -> Result<Vec<Location>> {
    let id = note_in_active(st, chunk, placed, end, tail, epoch, deferred);
    if !deferred {
        log.health.wrote();
    }
    let (locs, emptied) = publish_to_index(log, st, chunk, placed, id, deferred);
    if !emptied.is_empty() {
        reclaim(log, st);
    }
    Ok(locs)
}

/// Publish a chunk written (or pending) in segment `id`: the index, and the live and tombstone
/// accounting. Returns each record's location and the segments left with nothing live.
fn publish_to_index<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    chunk: &[Prepared<'_>],
    placed: &[Placed],
    id: u32,
    deferred: bool,
) -> (Vec<Location>, Vec<u32>) {
    let mut locs = Vec::with_capacity(chunk.len());
    let mut emptied = Vec::new();
    let mut index = log.index.publisher(&mut st.segs);
    for (p, pl) in chunk.iter().zip(placed) {
        let key = p.rec.key();
        let h = &pl.h;
        let loc = Location { segment: id, offset: pl.offset, len: h.record_len() };
        match &p.rec {
            NewRecord::Tombstone { aux, .. } => {
                log.streams.written_meanwhile(key, h.seq);
                index.tombstone(key, loc, *aux, deferred, &mut emptied);
            }
            NewRecord::SyncMark => {}
            NewRecord::Relocated { header, .. } if header.is_tombstone() => index.tombstone_copy(loc, header.aux),
            // Forgotten while compaction copied it: the copy is dead on arrival.
            NewRecord::Relocated { from, .. } if !index.points_at(key, *from) => {}
            _ => {
                if matches!(p.rec, NewRecord::Value { .. }) {
                    log.streams.written_meanwhile(key, h.seq);
                }
                let facts = RecordFacts::of(h.flags, h.frame_count, h.payload_crc, h.aux, h.stored_len);
                index.value(key, loc, facts, deferred, &mut emptied);
            }
        }
        locs.push(loc);
    }
    (locs, emptied)
}

/// A chunk written (or pending, `deferred`) up to `end` of the active segment, `tail` its partial
/// last block: the segment's ends, its footer entries and its record count. Returns its id.
fn note_in_active<F>(
    st: &mut WriterState<F>,
    chunk: &[Prepared<'_>],
    placed: &[Placed],
    end: u64,
    tail: Vec<u8>,
    epoch: u32,
    deferred: bool,
) -> u32 {
    let a = st.active.as_mut().expect("active segment");
    a.dirty = true;
    a.last_is_mark = chunk.last().is_some_and(|p| matches!(p.rec, NewRecord::SyncMark));
    a.tail = tail;
    a.data_end = end;
    if !deferred {
        a.written_end = end;
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
    st.segs.extend(id, end, chunk.iter().filter(|p| !matches!(p.rec, NewRecord::SyncMark)).count() as u64);
    id
}
