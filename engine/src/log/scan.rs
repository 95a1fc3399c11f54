//! Scanning a segment record by record (unsealed segments, and sealed ones whose footer is
//! unusable): the read window, probing a record at an offset, resynchronising past damage at the
//! next sync mark, and telling a torn tail from damage in the middle; what a scan finds
//! (`SegmentScan`) and what opening found in all segments ([`RecoveryReport`]).

use std::path::Path;

use crate::backend::Backend;
use crate::buf::AlignedBuf;
use crate::error::{Error, Result};
use crate::format::{self, align_down, align_up, FooterEntry, RecordHeader, Salt, RECORD_ALIGN};

use super::table::padded;
use super::table::SegMeta;

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

/// Everything recovery learns from one segment.
pub(super) struct SegmentScan {
    pub(super) meta: SegMeta,
    pub(super) entries: Vec<FooterEntry>,
    pub(super) max_epoch: u32,
    /// For unsealed segments: bytes of the last partial block before `data_end`.
    pub(super) tail: Vec<u8>,
    /// The end of a torn or garbage tail cut off at `data_end` (its bytes are still in the file).
    pub(super) cut: Option<u64>,
    /// The last record kept is a sync mark (a `sync` then needs no new one, only an fdatasync).
    pub(super) ends_with_mark: bool,
    /// Damaged records that no sync mark follows were dropped (see `scan_segment`), not cut: they
    /// lie before `data_end`.
    pub(super) dropped_unsynced: bool,
    /// Its header decoded (with the log's salt). Records written after a damaged one could not be
    /// verified by a later open that draws a fresh salt, so such a segment is never continued.
    pub(super) header_ok: bool,
    /// Its header block is all zeros and nothing follows it: a segment whose creation a crash cut
    /// short before the header was written. Not damage, and nothing in it (see `recover`).
    pub(super) never_written: bool,
    /// It holds no record, and a crash cut its writing short: its file is shorter than its header
    /// announces, or it was sized for one record that never became whole (see
    /// `SegmentReader::cut_short`). Removed at open (see `recover`), neither extended to the size
    /// its header announces nor continued.
    pub(super) cut_short: bool,
}

/// Read window used when scanning unsealed segments.
pub(super) const SCAN_WINDOW: usize = 1 << 20;

pub(super) const FOOTER_MISMATCH: &str = "record differs from its footer entry";

/// Whether footer entry `e` says what record header `h` says: recovery builds index entries (the
/// payload crc, frame count and padding that reads without the head trust) from footer entries.
pub(super) fn entry_matches(e: &FooterEntry, h: &RecordHeader) -> bool {
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

pub(super) enum Probe {
    Record(FooterEntry, RecordHeader, bool),
    Invalid { stale_epoch: u32 },
}

/// How a search after unparseable bytes ended.
pub(super) enum Resync {
    /// An acceptable record starts here.
    Record(u64),
    /// Nothing acceptable follows: the unparseable bytes end here.
    Garbage { end: u64 },
}

/// What lies past a clean end (zeros to the end of the next whole block) of a segment's records.
pub(super) enum PastEnd {
    /// A sync mark lies beyond, so the zeros are damage; the scan goes on at `next`, the first
    /// acceptable record after them.
    Synced { next: u64 },
    /// Nothing synced lies beyond: records there are orphans of a batch that never completed, and
    /// everything up to `end` is cut.
    Orphans { end: u64 },
}

/// The sync marks of a segment being scanned, as (offset, epoch) in file order, and for each the
/// highest epoch among it and those after it.
pub(super) struct SyncMarks {
    marks: Vec<(u64, u32)>,
    max_epoch_after: Vec<u32>,
}

impl SyncMarks {
    pub(super) fn new(marks: Vec<(u64, u32)>) -> Self {
        let mut max_epoch_after = vec![0; marks.len()];
        let mut max = 0;
        for (i, &(_, epoch)) in marks.iter().enumerate().rev() {
            max = max.max(epoch);
            max_epoch_after[i] = max;
        }
        SyncMarks { marks, max_epoch_after }
    }

    /// Whether a sync mark lies after `pos` with an epoch of at least `epoch`.
    pub(super) fn acceptable_beyond(&self, pos: u64, epoch: u32) -> bool {
        let i = self.marks.partition_point(|&(at, _)| at <= pos);
        i < self.marks.len() && self.max_epoch_after[i] >= epoch
    }
}

/// The scanner: what walking a segment's records needs of its log, all of it fixed at open (the
/// backend, the alignment, the salt every record head is verified with). It reads; it changes
/// nothing, and returns what it found.
pub(super) struct Scanner<'a, B: Backend> {
    backend: &'a B,
    align: u64,
    salt: Salt,
}

/// What walking a segment's records found, before the rules for damaged records at its end.
struct Walked {
    entries: Vec<FooterEntry>,
    /// Whether each entry's payload is intact.
    intact: Vec<bool>,
    corrupt: Vec<(u32, u64, String)>,
    /// Where the records end.
    pos: u64,
    /// The end of what is cut off as a torn tail, if anything is.
    cut_end: u64,
    max_epoch: u32,
    /// The epoch of the last record found (while walking).
    prev_epoch: u32,
    /// Where this segment's sync marks are, once a search needed them.
    marks: Option<SyncMarks>,
}

impl Walked {
    /// A damaged record with nothing valid after it is the torn end of the last write, not a bit
    /// flip in the middle of the log: cut it off like the rest of the tail.
    fn cut_torn_end(&mut self, report: &mut RecoveryReport) {
        while self.intact.last() == Some(&false) {
            self.intact.pop();
            let e = self.entries.pop().expect("one entry per flag");
            self.cut_end = self.cut_end.max(self.pos);
            report.truncated_bytes += self.pos - e.offset;
            self.pos = e.offset;
            self.corrupt.retain(|c| c.1 != e.offset);
        }
    }

    /// A damaged record with valid records after it, but no sync mark, was never synced either,
    /// and is dropped (the torn record of a batch whose later group of writes landed, or that a
    /// power cut or a SIGKILL with io_uring writes in flight cut short). Kept, it would have the
    /// highest seq of its key and hide the key's synced value behind a checksum error. Returns
    /// whether any was dropped.
    ///
    /// The rule: a record is acknowledged as durable only by a `sync` that returned, and `sync`
    /// writes a sync mark after the records it covers (before its fdatasync). So a damaged record
    /// that a mark follows was synced, and its damage is decay of stored data: it stays, and
    /// reading its key reports the damage (an older value would be silently stale). One that no
    /// mark follows was never synced: its damage is what a write that did not complete leaves,
    /// and its key falls back to its previous version, as if that write had never started
    /// (intact records after it stay: each key reads as its old or its new value). This holds for
    /// non-durable logs too: they fdatasync only in `sync`, which writes its mark all the same.
    /// Sealing also fdatasyncs (in a durable log), without a mark, but a sealed segment is read
    /// through its footer; only if its footer and trailer are lost as well is a damaged record
    /// of its last, unmarked part taken for an unsynced one.
    ///
    /// Not covered: the mark is written before the fdatasync, so a power cut during it (or the
    /// kernel's own writeback before it) can keep the mark's block and lose an earlier one. The
    /// records there were not acknowledged, yet their damage counts as synced: their keys read as
    /// checksum errors (not as other bytes) until they are written again.
    fn drop_unsynced_damage(&mut self) -> bool {
        let last_mark = self.entries.iter().rposition(|e| e.flags & format::FLAG_SYNC_MARK != 0);
        let unsynced_from = last_mark.map_or(0, |i| i + 1);
        let dropped: Vec<u64> = self.entries[unsynced_from..]
            .iter()
            .zip(&self.intact[unsynced_from..])
            .filter(|(_, &intact)| !intact)
            .map(|(e, _)| e.offset)
            .collect();
        if dropped.is_empty() {
            return false;
        }
        self.entries.retain(|e| !dropped.contains(&e.offset));
        for c in self.corrupt.iter_mut().filter(|c| dropped.contains(&c.1)) {
            c.2 = "record payload checksum mismatch in a record no sync followed; dropped (its key keeps \
                   its previous value)"
                .to_string();
        }
        true
    }
}

/// A sliding read window over a segment file, for scanning.
pub(super) struct ScanWindow<'a, B: Backend> {
    pub(super) scanner: &'a Scanner<'a, B>,
    pub(super) file: &'a B::File,
    pub(super) path: &'a Path,
    /// Segment size: reads stay below it.
    pub(super) size: u64,
    /// Records must end at or before this (the trailer's bytes are never record bytes).
    pub(super) limit: u64,
    pub(super) start: u64,
    pub(super) buf: Option<AlignedBuf>,
}

impl<'a, B: Backend> ScanWindow<'a, B> {
    pub(super) fn new(scanner: &'a Scanner<'a, B>, file: &'a B::File, path: &'a Path, size: u64) -> Self {
        let limit = size.saturating_sub(format::TRAILER_LEN as u64);
        ScanWindow { scanner, file, path, size, limit, start: 0, buf: None }
    }

    /// `len` bytes at `off` (must be within `limit`).
    pub(super) fn bytes(&mut self, off: u64, len: u64) -> Result<&[u8]> {
        let have = self.buf.as_ref().is_some_and(|b| off >= self.start && off + len <= self.start + b.len() as u64);
        if !have {
            let align = self.scanner.align;
            let start = align_down(off, align);
            let need_end = align_up(off + len, align);
            let end = (start + SCAN_WINDOW as u64).min(self.size).max(need_end);
            let buf = self.scanner.read_aligned(self.file, start, (end - start) as usize, self.path)?;
            self.start = start;
            self.buf = Some(buf);
        }
        let b = self.buf.as_ref().expect("window filled");
        let from = (off - self.start) as usize;
        Ok(&b[from..from + len as usize])
    }

    pub(super) fn crc_of(&mut self, off: u64, len: u64) -> Result<u32> {
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
    pub(super) fn is_zero_from(&mut self, off: u64) -> Result<bool> {
        let align = self.scanner.align;
        let end = (align_up(off + 1, align) + align).min(self.limit);
        if off >= end {
            return Ok(true);
        }
        Ok(self.bytes(off, end - off)?.iter().all(|&b| b == 0))
    }

    pub(super) fn is_zero_block(&mut self, off: u64) -> Result<bool> {
        let end = (off + self.scanner.align).min(self.limit);
        if off >= end {
            return Ok(true);
        }
        Ok(self.bytes(off, end - off)?.iter().all(|&b| b == 0))
    }
}

impl<'a, B: Backend> Scanner<'a, B> {
    /// A scanner of segments of `align`-byte blocks, their record heads checked with `salt`.
    pub(super) fn new(backend: &'a B, align: u64, salt: Salt) -> Self {
        Scanner { backend, align, salt }
    }

    /// Walk the records of an unsealed segment (`id`, at `path`) from `data_start`, verifying each. A
    /// region that does not parse is skipped by searching for the next valid record header of this
    /// segment and epoch; if none follows, the region is a torn tail and the segment ends there.
    pub(super) fn scan_segment(
        &self,
        id: u32,
        file: &B::File,
        path: &Path,
        size: u64,
        data_start: u64,
        report: &mut RecoveryReport,
    ) -> Result<SegmentScan> {
        let mut win = ScanWindow::new(self, file, path, size);
        let mut w = self.walk(&mut win, id, data_start, report)?;
        w.cut_torn_end(report);
        let dropped_unsynced = w.drop_unsynced_damage();
        report.corrupt.extend(std::mem::take(&mut w.corrupt));
        let Walked { mut entries, pos, cut_end, max_epoch, .. } = w;
        let ends_with_mark = entries.last().is_some_and(|e| e.flags & format::FLAG_SYNC_MARK != 0);
        entries.retain(|e| e.flags & format::FLAG_SYNC_MARK == 0);
        let meta = SegMeta::holding(size, data_start, pos, entries.len() as u64, false);
        let tail_start = align_down(pos, self.align);
        let tail = if pos > tail_start { win.bytes(tail_start, pos - tail_start)?.to_vec() } else { Vec::new() };
        let cut = (cut_end > pos).then_some(cut_end);
        // (`header_ok`, `never_written` and `cut_short` are `load_segment`'s, which read the header.)
        let (header_ok, never_written, cut_short) = (true, false, false);
        Ok(SegmentScan {
            meta,
            entries,
            max_epoch,
            tail,
            cut,
            ends_with_mark,
            dropped_unsynced,
            header_ok,
            never_written,
            cut_short,
        })
    }

    /// Walk the records from `data_start` to where they end (a clean end, or garbage nothing
    /// acceptable follows), skipping damage that acceptable records follow.
    fn walk(
        &self,
        win: &mut ScanWindow<'_, B>,
        id: u32,
        data_start: u64,
        report: &mut RecoveryReport,
    ) -> Result<Walked> {
        let mut w = Walked {
            entries: Vec::new(),
            intact: Vec::new(),
            corrupt: Vec::new(),
            pos: data_start,
            cut_end: 0,
            max_epoch: 0,
            prev_epoch: 0,
            marks: None,
        };
        loop {
            match self.try_record_at(win, id, w.pos, w.prev_epoch, true)? {
                Probe::Record(e, h, intact) => {
                    if !intact {
                        w.corrupt.push((id, w.pos, "record payload checksum mismatch".to_string()));
                    }
                    w.intact.push(intact);
                    w.prev_epoch = h.epoch;
                    w.max_epoch = w.max_epoch.max(h.epoch);
                    w.pos = padded(w.pos + e.record_len);
                    w.entries.push(e);
                }
                Probe::Invalid { stale_epoch } => {
                    w.max_epoch = w.max_epoch.max(stale_epoch);
                    let go_on = if win.is_zero_from(w.pos)? {
                        self.past_zeros(win, id, &mut w, report)?
                    } else {
                        self.past_garbage(win, id, &mut w, report)?
                    };
                    if !go_on {
                        break;
                    }
                }
            }
        }
        Ok(w)
    }

    /// Zeros from `w.pos`: the end of the written area, unless a write left records beyond a zero
    /// gap: its earlier part never landed (an earlier group of a batch failed, or the process died
    /// with groups in flight), so they were never acknowledged. They are cut, and their epochs
    /// counted, so that the next life's epoch is higher and a later scan never takes them for
    /// records of its own (with an equal epoch and higher sequence numbers they would win over
    /// newer values).
    ///
    /// Unless a sync mark lies beyond: then the zeros are damage to records that were written and
    /// synced (a zeroed range of the file), not an end. A sync mark is only ever written at the end
    /// of the published records, and a failed batch's orphans never have one after them: `sync`
    /// refuses to run on a poisoned log, and after a failed write that left the log writable the
    /// next records (and marks) go to the published end, in front of the orphans, with a higher
    /// epoch. So the gap is reported and the walk goes on with the first acceptable record after
    /// it. Returns whether the walk goes on.
    fn past_zeros(
        &self,
        win: &mut ScanWindow<'_, B>,
        id: u32,
        w: &mut Walked,
        report: &mut RecoveryReport,
    ) -> Result<bool> {
        let pos = w.pos;
        let clean = align_up(pos + 1, self.align).min(win.limit);
        match self.search_past_clean_end(win, id, pos, w.prev_epoch, &mut w.max_epoch, &mut w.marks)? {
            PastEnd::Synced { next } => {
                w.corrupt.push((id, pos, format!("zeroed bytes up to offset {next}, before synced records")));
                w.pos = next;
                Ok(true)
            }
            PastEnd::Orphans { end } => {
                if end > clean {
                    report.truncated_bytes += end - pos;
                    w.cut_end = w.cut_end.max(end);
                }
                Ok(false)
            }
        }
    }

    /// Garbage at `w.pos`: the walk goes on at the next record the rest of the segment holds, or
    /// stops, the rest cut as a torn tail. Returns whether the walk goes on.
    fn past_garbage(
        &self,
        win: &mut ScanWindow<'_, B>,
        id: u32,
        w: &mut Walked,
        report: &mut RecoveryReport,
    ) -> Result<bool> {
        let pos = w.pos;
        match self.resync(win, id, pos, w.prev_epoch, &mut w.max_epoch)? {
            Resync::Record(next) => {
                w.corrupt.push((id, pos, format!("unreadable bytes up to offset {next}")));
                w.pos = next;
                Ok(true)
            }
            Resync::Garbage { end } => {
                report.truncated_bytes += end.saturating_sub(pos);
                w.cut_end = w.cut_end.max(end);
                Ok(false)
            }
        }
    }

    /// The record at `pos`, if its head is valid. With `payload`, whether its payload is intact is
    /// checked (a crc over it); without, it is reported intact: for searches that only need to know
    /// where records are, so that a search costs the heads it looks at, not the payloads they claim.
    pub(super) fn try_record_at(
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
    pub(super) fn resync(
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
    /// each time would cost a full pass per zeroed region of a segment with one sync mark at its end.
    pub(super) fn search_past_clean_end(
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
    pub(super) fn find_sync_marks(&self, win: &mut ScanWindow<'_, B>, id: u32, from: u64) -> Result<SyncMarks> {
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

    pub(super) fn read_aligned(&self, file: &B::File, offset: u64, len: usize, path: &Path) -> Result<AlignedBuf> {
        debug_assert!(offset % self.align == 0 && len as u64 % self.align == 0);
        let buf = AlignedBuf::zeroed(len, self.align as usize);
        let (r, buf) = self.backend.read_at(file, offset, buf);
        r.map_err(|e| Error::io("read segment", path.to_path_buf(), e))?;
        Ok(buf)
    }
}
