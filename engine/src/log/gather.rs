//! Gathered writes: a large payload is written from its own frames (vectored, aligned where the
//! frames allow) instead of being copied into the write buffer.

use std::io;

use crate::backend::Backend;
use crate::error::Result;
use crate::format::{self, align_down, align_up, RecordHeader};
use crate::value::Frames;

use super::location::Location;
use super::record::{encode_record, fence_failed_write, publish_chunk, seq_for, NewRecord, Payload, Placed, Prepared};
use super::segments::WriterState;
use super::table::padded;
use super::{laid_out_len, SegmentLog, ZEROS};

/// `write_chunk` for a chunk holding large values, on a backend that writes gathered
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
pub(super) fn write_chunk_gathered<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    chunk: &[Prepared<'_>],
) -> Result<Vec<Location>> {
    let epoch = st.epoch;
    let (id, file, data_end, tail) = {
        // A copy of the tail (less than a block): a failed write leaves the active segment as it was.
        let a = st.active.as_ref().expect("active segment");
        (a.id, a.file.clone(), a.data_end, a.tail.clone())
    };
    let mut g = lay_out_gathered(log, st, chunk, id, epoch, data_end, tail);
    let crc_of = |l: &Large<'_>| -> u32 { format::laid_out_crc(l.frames.iter().map(|f| &f[..])) };
    let mut written = Ok(());
    let mut crcs: Option<Vec<u32>> = None;
    let payload_bytes: u64 = g.large.iter().map(|l| l.header.raw_len).sum();
    if payload_bytes >= log.opts.parallel_crc_min_bytes {
        let g_ref = &g;
        std::thread::scope(|s| {
            let helper = std::thread::Builder::new()
                .name("spillway-crc".into())
                .spawn_scoped(s, || g_ref.large.iter().map(crc_of).collect::<Vec<u32>>());
            // Without a helper thread (resource limits), everything is written in order below.
            if let Ok(h) = helper {
                written = write_parts(log, &file, g_ref, Some(true));
                crcs = Some(h.join().expect("crc32 does not panic"));
            }
        });
    }
    let deferred = crcs.is_some();
    let crcs = crcs.unwrap_or_else(|| g.large.iter().map(crc_of).collect());
    g.fill_crcs(crcs, log.salt);
    if written.is_ok() {
        written = write_parts(log, &file, &g, deferred.then_some(false));
    }
    if let Err(e) = written {
        // Nothing of the chunk is published, and the active segment is as it was.
        fence_failed_write(log, st, crate::error::io_no_space(&e).then_some(g.end));
        return Err(log.health.write_failed("write segment", log.seg_path(id), e));
    }
    let new_tail = g.tail(log.align);
    publish_chunk(log, st, chunk, &g.placed, g.end, new_tail, epoch, false)
}

/// The bytes of `chunk` from the aligned block before `data_end` (its `tail` rewritten first),
/// as parts: record heads, small records and padding in an arena, large payloads as their own
/// frames, zeros. A large record's head waits for its payload crc ([`Gathered::fill_crcs`]).
fn lay_out_gathered<'a, B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    chunk: &'a [Prepared<'a>],
    id: u32,
    epoch: u32,
    data_end: u64,
    tail: Vec<u8>,
) -> Gathered<'a> {
    let parts = vec![Part::Arena(0..tail.len())];
    let mut g = Gathered {
        base: align_down(data_end, log.align),
        end: data_end,
        arena: tail,
        parts,
        payload: vec![false],
        large: Vec::new(),
        placed: Vec::with_capacity(chunk.len()),
    };
    let mut pos = data_end;
    for p in chunk {
        let seq = seq_for(st, &p.rec);
        match (&p.rec, &p.payload) {
            (NewRecord::Value { key, .. }, Payload::Frames(frames))
                if laid_out_len(frames) >= log.opts.gather_min_bytes =>
            {
                g.push_large(p, key, frames, (id, epoch, seq), pos)
            }
            _ => {
                let start = g.arena.len();
                g.arena.resize(start + p.len as usize, 0);
                let h = encode_record(log, p, &mut g.arena[start..], id, epoch, seq);
                g.push(Part::Arena(start..start + p.len as usize), false);
                g.placed.push(Placed::new(pos, &h));
            }
        }
        let next = padded(pos + p.len);
        g.push(Part::Zeros((next - pos - p.len) as usize), false); // padding between records
        pos = next;
    }
    g.end = pos;
    g.push(Part::Zeros((align_up(pos, log.align) - pos) as usize), false); // up to the aligned end
    g
}

/// Write `g`'s parts to `file` from its base. `None`: every part, in one gathered write.
/// `Some(p)`: the parts whose payload flag is `p`, one gathered write per run of consecutive ones.
fn write_parts<B: Backend>(
    log: &SegmentLog<B>,
    file: &B::File,
    g: &Gathered<'_>,
    payloads: Option<bool>,
) -> io::Result<()> {
    let slices = g.slices();
    let Some(want) = payloads else {
        let all: Vec<&[u8]> = slices.iter().map(|&(_, s)| s).collect();
        return log.backend.write_gather_at(file, g.base, &all);
    };
    let mut at = g.base;
    let mut run: Vec<&[u8]> = Vec::new();
    let mut run_at = g.base;
    for &(part, sl) in &slices {
        if g.payload[part] == want {
            if run.is_empty() {
                run_at = at;
            }
            run.push(sl);
        } else if !run.is_empty() {
            log.backend.write_gather_at(file, run_at, &run)?;
            run.clear();
        }
        at += sl.len() as u64;
    }
    if !run.is_empty() {
        log.backend.write_gather_at(file, run_at, &run)?;
    }
    Ok(())
}

/// A part of a gathered chunk's bytes.
enum Part<'a> {
    /// Bytes of the arena: the rewritten partial block, record heads, small records.
    Arena(std::ops::Range<usize>),
    /// A frame of a large payload, written from its own buffer.
    Frame(&'a [u8]),
    /// Alignment and padding.
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

/// A chunk laid out for a gathered write (`lay_out_gathered`).
struct Gathered<'a> {
    /// Where its bytes start in the file: the aligned block before the old end.
    base: u64,
    /// The end of its last record (the segment's new `data_end`).
    end: u64,
    arena: Vec<u8>,
    parts: Vec<Part<'a>>,
    /// Whether each part belongs to a large record's payload.
    payload: Vec<bool>,
    large: Vec<Large<'a>>,
    placed: Vec<Placed>,
}

impl<'a> Gathered<'a> {
    /// A record whose payload is written from its own `frames`: its head (room in the arena,
    /// encoded once its payload crc is known), then each frame after the zeros before it. `at`:
    /// its segment, epoch and sequence number; `pos`: its offset.
    fn push_large(&mut self, p: &Prepared<'_>, key: &'a [u8], frames: &'a Frames, at: (u32, u32, u64), pos: u64) {
        let (id, epoch, seq) = at;
        let frame_lens: Vec<u64> = frames.iter().map(|f| f.len() as u64).collect();
        let (offsets, raw_len) = format::frame_layout(frame_lens.iter().copied()).expect("prepared");
        let po = (format::head_len(frame_lens.len(), key.len()) + p.pad) as usize;
        let header = RecordHeader {
            flags: 0,
            frame_count: frame_lens.len() as u16,
            key_len: key.len() as u32,
            segment: id,
            epoch,
            payload_crc: 0, // once known: `fill_crcs`
            seq,
            raw_len,
            stored_len: raw_len,
            aux: p.pad as u32,
        };
        debug_assert_eq!(p.len, po as u64 + raw_len);
        let start = self.arena.len();
        self.arena.resize(start + po, 0);
        self.large.push(Large { head: start..start + po, header, frame_lens, key, frames, placed: self.placed.len() });
        self.placed.push(Placed::new(pos, &header));
        self.push(Part::Arena(start..start + po), false);
        // The payload: each frame and the zeros before it.
        let mut at = 0u64;
        for (f, &off) in frames.iter().zip(&offsets) {
            if off > at {
                self.push(Part::Zeros((off - at) as usize), true);
            }
            self.push(Part::Frame(f), true);
            at = off + f.len() as u64;
        }
    }

    fn push(&mut self, part: Part<'a>, payload: bool) {
        self.parts.push(part);
        self.payload.push(payload);
    }

    /// The slices of the parts, back to back from `base`, each with the index of its part.
    fn slices(&self) -> Vec<(usize, &[u8])> {
        let mut slices = Vec::with_capacity(self.parts.len() + 1);
        for (i, part) in self.parts.iter().enumerate() {
            match part {
                Part::Arena(r) => slices.push((i, &self.arena[r.clone()])),
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

    /// Each large record's head, now that its payload crc (`crcs`, in order) is known.
    fn fill_crcs(&mut self, crcs: Vec<u32>, salt: format::Salt) {
        for (l, crc) in self.large.iter().zip(crcs) {
            let h = RecordHeader { payload_crc: crc, ..l.header };
            format::write_record_head(&mut self.arena[l.head.clone()], &h, &l.frame_lens, l.key, salt);
            self.placed[l.placed].set_payload_crc(crc);
        }
    }

    /// The segment's new tail: the bytes of the last, partial block, gathered from the end of the
    /// slices.
    fn tail(&self, align: u64) -> Vec<u8> {
        let tail_start = align_down(self.end, align);
        let mut new_tail = vec![0u8; (self.end - tail_start) as usize];
        let mut from = 0u64; // file offset of the current slice, relative to `base`
        for (_, sl) in self.slices() {
            let (s0, s1) = (self.base + from, self.base + from + sl.len() as u64);
            let (lo, hi) = (s0.max(tail_start), s1.min(self.end));
            if lo < hi {
                new_tail[(lo - tail_start) as usize..(hi - tail_start) as usize]
                    .copy_from_slice(&sl[(lo - s0) as usize..(hi - s0) as usize]);
            }
            from += sl.len() as u64;
        }
        debug_assert_eq!(self.base + from, align_up(self.end, align));
        new_tail
    }
}
