//! Opening a log: list the segment files, learn the salt, read sealed segments' footers, scan the
//! unsealed ones, settle which record of each key wins (sequence numbers), erase torn tails durably,
//! and build the index and the segment accounting. [`SegmentReader`] does it with the parts of the
//! log fixed at open and returns what it found ([`Recovered`]); the log is built from that. The
//! outcome is a [`RecoveryReport`].

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::format::{self, align_down, align_up, FooterEntry, Salt, RECORD_ALIGN};
use crate::key::{IndexKey, KeyHasher, KeyMap};

use super::location::{Location, PackedLoc, RecordFacts};
use super::options::LogOptions;
use super::scan::{RecoveryReport, Scanner, SegmentScan};
use super::segments::{erase_aborted, Active};
use super::table::{SegMeta, SegmentTable};
use super::{parse_seg_file_name, segment_path, MAX_RECORD_BYTES, MAX_SEGMENT_FILE_BYTES, SEQ_LIMIT};

/// A segment's geometry, as its header gives it (see `SegmentReader::geometry`).
struct Geometry {
    size: u64,
    data_start: u64,
    /// The header decoded (with the log's salt).
    header_ok: bool,
    /// The error of an all-zero header block, reported after the scan if records follow.
    zero_header: Option<format::DecodeError>,
}

/// The ids of the segment files found at open (those left alone too: their ids are not reused), and
/// the segments opened, by id.
type Found<F> = (Vec<u32>, Vec<(u32, F)>);

/// The segments found at open, scanned: what each holds, its file, and the highest epoch seen.
struct Scanned<F> {
    scans: BTreeMap<u32, SegmentScan>,
    files: KeyMap<u32, Arc<F>>,
    max_epoch: u32,
}

/// The newest segment continued as the active one, if it is, and the segments a durable log must
/// fdatasync at its next sync.
struct Newest<F> {
    active: Option<Active<F>>,
    unsynced: Vec<Arc<F>>,
}

/// What the records of every segment say once each key's newest record wins: the index, each
/// segment's accounting, the highest sequence number seen, and the segments left by a value
/// streamed in that a delete overtook (see `stranded_streams`).
struct Settled {
    index: KeyMap<IndexKey, PackedLoc>,
    segs: SegmentTable,
    max_seq: u64,
    stranded: Vec<u32>,
}

/// The record of a key that wins so far (see `settle_winners`), and the oldest segment that holds
/// a record of the key.
struct Winner {
    seq: u64,
    segment: u32,
    offset: u64,
    len: u64,
    tombstone: bool,
    facts: RecordFacts,
    first_segment: u32,
}

/// The segments whose every record is a value that a tombstone of its key in an older segment
/// deletes: what a value streamed into a segment of its own (`put_stream`) leaves when a delete
/// of its key overtook it and the process died before the segment was removed. A tombstone
/// shadows older segments only (its range ends at its own), so none covers such a segment, and
/// garbage collection could remove the tombstone's segment first: the value would come back at
/// the next open. Nothing else leaves one: every other record is written to, or copied into, the
/// active segment, never older than the segment of a tombstone written before it.
fn stranded_streams(scans: &BTreeMap<u32, SegmentScan>, winners: &HashMap<&[u8], Winner>) -> Vec<u32> {
    let deleted_before = |id: u32, e: &FooterEntry| {
        e.flags & format::FLAG_TOMBSTONE == 0
            && winners.get(e.key.as_slice()).is_some_and(|w| w.tombstone && w.segment < id)
    };
    scans
        .iter()
        .filter(|(&id, scan)| !scan.entries.is_empty() && scan.entries.iter().all(|e| deleted_before(id, e)))
        .map(|(&id, _)| id)
        .collect()
}

/// Which record of each key wins (the newest: highest sequence number; a tombstone wins by
/// deleting), and what that makes of each segment's accounting: its live records and bytes, its
/// tombstones, and the oldest segment each live key also appears in (`firsts`).
fn settle_winners(scans: &BTreeMap<u32, SegmentScan>, report: &mut RecoveryReport) -> Settled {
    let mut winners: HashMap<&[u8], Winner> = HashMap::new();
    let mut max_seq = 0u64;
    for (&id, scan) in scans {
        for e in &scan.entries {
            max_seq = max_seq.max(e.seq);
            report.records += 1;
            let cand = Winner {
                seq: e.seq,
                segment: id,
                offset: e.offset,
                len: e.record_len,
                tombstone: e.flags & format::FLAG_TOMBSTONE != 0,
                facts: RecordFacts::of_entry(e),
                first_segment: id,
            };
            match winners.get_mut(e.key.as_slice()) {
                Some(w) => {
                    let first = w.first_segment.min(id);
                    if e.seq > w.seq {
                        *w = cand;
                    }
                    w.first_segment = first;
                }
                None => {
                    winners.insert(e.key.as_slice(), cand);
                }
            }
        }
    }
    let stranded = stranded_streams(scans, &winners);
    let mut segs: SegmentTable = scans.iter().map(|(&id, s)| (id, s.meta.clone())).collect();
    let mut index = KeyMap::with_capacity_and_hasher(winners.len(), KeyHasher::default());
    for (key, w) in winners {
        if w.tombstone {
            continue;
        }
        segs.add_live(w.segment, w.len);
        let elsewhere = w.first_segment != w.segment;
        if elsewhere {
            segs.recovered_first(w.segment, w.offset, w.first_segment);
        }
        let loc = Location { segment: w.segment, offset: w.offset, len: w.len };
        index.insert(IndexKey::from(key), PackedLoc::new(loc, w.facts, elsewhere));
    }
    segs.sort_firsts();
    for (&id, scan) in scans {
        for e in scan.entries.iter().filter(|e| e.flags & format::FLAG_TOMBSTONE != 0) {
            segs.add_tombstone(id, e.record_len, e.aux);
        }
    }
    Settled { index, segs, max_seq, stranded }
}

/// Why the newest segment, unsealed, cannot go on as the active one (`None` if it can): what the
/// scan found in it (`scan`, `meta`) forbids writing after its records.
fn why_not_continued(scan: &SegmentScan, meta: &SegMeta, align: u64, salt_learned: bool) -> Option<&'static str> {
    let footer_len: u64 = scan.entries.iter().map(|e| FooterEntry::encoded_len(e.key.len())).sum();
    // Sealing needs room for the footer and the trailer after the records (`seal_active`). The
    // writer keeps that room at every record (`fits`), but records with valid checksums from
    // elsewhere (a crafted file) need not have left it.
    let footer_fits = align_up(meta.data_end(), align)
        .checked_add(footer_len + format::TRAILER_LEN as u64)
        .is_some_and(|end| end <= meta.size());
    // With a salt drawn fresh, what the scan cut may be records of a lost salt (every header
    // that held it damaged): left as they are, not erased and not written over.
    if !salt_learned && scan.cut.is_some() {
        Some(
            "no segment header or trailer holds the log's salt, and the segment holds bytes that may be \
             records under it (left as they are)",
        )
    } else if !scan.header_ok {
        Some(
            "its header is damaged (records after it would not be verifiable once no other segment holds \
             the log's salt)",
        )
    } else if !footer_fits {
        Some("no room for its footer")
    } else if scan.dropped_unsynced {
        Some("a damaged record no sync followed was dropped")
    } else {
        None
    }
}

/// What recovery found: everything a log is built from at open.
pub(super) struct Recovered<F> {
    pub(super) salt: Salt,
    pub(super) index: KeyMap<IndexKey, PackedLoc>,
    pub(super) files: KeyMap<u32, Arc<F>>,
    pub(super) segs: SegmentTable,
    /// The newest segment, continued.
    pub(super) active: Option<Active<F>>,
    /// Segments a durable log must fdatasync at its next sync.
    pub(super) unsynced: Vec<Arc<F>>,
    /// Above every segment id found.
    pub(super) next_segment: u32,
    pub(super) next_seq: u64,
    pub(super) epoch: u32,
    /// Why the log opens read-only, if it does (a record's seq or epoch at its maximum).
    pub(super) read_only: Option<String>,
    /// The directory entries of the segments found may be unsynced (a durable log's first sync
    /// fsyncs the directory).
    pub(super) dir_dirty: bool,
    pub(super) report: RecoveryReport,
}

/// The segment reader: what reading a log's segments from scratch needs of the log, all of it fixed
/// at open. Recovery runs on it ([`Self::recover`]), and so do the checks that reload a segment
/// (`verify`, compaction). It reads, erases what recovery cuts, and returns what it found.
pub(super) struct SegmentReader<'a, B: Backend> {
    backend: &'a B,
    dir: &'a Path,
    seg_dir: &'a Path,
    opts: &'a LogOptions,
    align: u64,
    /// The log's salt (a placeholder until [`Self::recover`] learns it).
    salt: Salt,
}

impl<'a, B: Backend> SegmentReader<'a, B> {
    /// The reader of the segments of the log in `dir` (its segment files in `seg_dir`), of
    /// `align`-byte blocks, their record heads checked with `salt` (any, before `recover` learns
    /// it).
    pub(super) fn new(
        backend: &'a B,
        (dir, seg_dir): (&'a Path, &'a Path),
        opts: &'a LogOptions,
        align: u64,
        salt: Salt,
    ) -> Self {
        SegmentReader { backend, dir, seg_dir, opts, align, salt }
    }

    /// Open the log's segments: list and open their files (those of `spares`, kept for reuse, are
    /// not segments), learn the salt, scan them, settle which record of each key wins, and continue
    /// the newest segment if it can be.
    pub(super) fn recover(mut self, spares: &[u32]) -> Result<Recovered<B::File>> {
        let mut report = RecoveryReport::default();
        let (ids, opened) = self.open_segment_files(spares, &mut report)?;
        let salt_learned;
        (self.salt, salt_learned) = self.learn_salt(&opened)?;
        let Scanned { mut scans, mut files, max_epoch } = self.scan_segments(opened, &mut report)?;
        let Settled { index, mut segs, max_seq, stranded } = settle_winners(&scans, &mut report);
        // Before anything could remove the segment of the tombstone that deletes their value.
        for id in stranded {
            segs.remove(id);
            let why = "a value streamed in that a delete overtook (a tombstone in an older segment deletes it)";
            self.remove_segment(id, &mut scans, &mut files, why);
        }
        let Newest { active, unsynced } = self.continue_newest(&mut scans, &segs, &files, salt_learned)?;

        // A record's seq or epoch at (or near) its maximum leaves no higher one for new records to win
        // with: such a log opens read-only, its values readable. A writer of this log never gets
        // there (2^63 writes; 2^32 opens and failed writes), so it is damage that passed the
        // checksums, and no reason to refuse the values that are there.
        let (next_seq, epoch) = (max_seq.checked_add(1).filter(|&s| s <= SEQ_LIMIT), max_epoch.checked_add(1));
        let read_only = (next_seq.is_none() || epoch.is_none()).then(|| {
            let what =
                if next_seq.is_none() { format!("sequence number {max_seq}") } else { format!("epoch {max_epoch}") };
            let reason = format!(
                "a record of {} holds {what}, which leaves no higher one for new records: the log is \
                 read-only (copy its values into a new log to write again)",
                self.dir.display()
            );
            log::error!("{reason}");
            reason
        });
        if !report.corrupt.is_empty() {
            log::warn!("recovery of {} found {} damaged region(s)", self.dir.display(), report.corrupt.len());
        }
        Ok(Recovered {
            salt: self.salt,
            index,
            files,
            segs,
            active,
            unsynced,
            next_segment: ids.last().map_or(1, |l| l.saturating_add(1)),
            next_seq: next_seq.unwrap_or(SEQ_LIMIT),
            epoch: epoch.unwrap_or(u32::MAX),
            read_only,
            // The directory entries of the segments found may be unsynced too (a crash before the
            // first `sync`): a durable log's first sync fsyncs the directory once.
            dir_dirty: self.opts.durable && !ids.is_empty(),
            report,
        })
    }

    fn seg_path(&self, id: u32) -> PathBuf {
        segment_path(self.seg_dir, id)
    }

    /// The scanner of this log's segments.
    fn scanner(&self) -> Scanner<'_, B> {
        Scanner::new(self.backend, self.align, self.salt)
    }

    /// The ids of the segment files in the directory, sorted, and those files opened. Stray names,
    /// files kept for reuse (`spares`) and directories are left alone.
    fn open_segment_files(&self, spares: &[u32], report: &mut RecoveryReport) -> Result<Found<B::File>> {
        let names = self
            .backend
            .list_dir(self.seg_dir)
            .map_err(|e| Error::io("list segments", self.seg_dir.to_path_buf(), e))?;
        let mut ids: Vec<u32> = Vec::new();
        for name in &names {
            match parse_seg_file_name(name) {
                Some(id) => ids.push(id),
                None => log::warn!("ignoring unexpected file {:?} in {}", name, self.seg_dir.display()),
            }
        }
        // Files kept at open for new segments (`discard_segments`) are not segments.
        ids.retain(|id| !spares.contains(id));
        ids.sort_unstable();
        let mut opened = Vec::with_capacity(ids.len());
        for &id in &ids {
            let path = self.seg_path(id);
            if self.backend.is_dir(&path) {
                // Named like a segment, but the log never makes directories: not one of its files,
                // left alone like any other stray name.
                log::warn!("{} is a directory, not a segment; leaving it alone", path.display());
                report.corrupt.push((id, 0, "a directory named like a segment; left alone".into()));
                continue;
            }
            // A segment file that cannot be opened fails the open. Skipping it would be worse than
            // not opening: its records would not count towards the next sequence number (so new
            // records could reuse its seqs, and lose to its older ones once it is readable again),
            // its tombstones would not delete (their keys' older values come back), and its keys
            // would read as absent or as older values.
            let file = self.backend.open(&path, false).map_err(|e| Error::io("open segment", path.clone(), e))?;
            opened.push((id, file));
        }
        Ok((ids, opened))
    }

    /// Scan (or read the footer of) each opened segment: what it holds, its files by id, and the
    /// highest epoch seen. A newest segment that a crash left before its header was written goes,
    /// and so does any segment whose writing a crash cut short (`SegmentScan::cut_short`).
    fn scan_segments(&self, opened: Vec<(u32, B::File)>, report: &mut RecoveryReport) -> Result<Scanned<B::File>> {
        let mut scans: BTreeMap<u32, SegmentScan> = BTreeMap::new();
        let mut max_epoch = 0u32;
        let mut files = KeyMap::default();
        for (id, file) in opened {
            let mut scan = self.load_segment(id, &file, report)?;
            // The index holds offsets and lengths in 32 bits. A segment may be a little over 4 GiB (a
            // jumbo segment, whose one record starts at its start), so a record further in, or
            // longer, is one no writer made: damage, not an entry whose offset would wrap.
            let before = scan.entries.len();
            scan.entries.retain(|e| {
                let addressable = e.offset <= u32::MAX as u64 && e.record_len <= MAX_RECORD_BYTES;
                if !addressable {
                    report.corrupt.push((id, e.offset, "a record beyond what the index addresses (32 bits)".into()));
                }
                addressable
            });
            if scan.entries.len() != before {
                scan.meta = scan.meta.with_records(scan.entries.len() as u64);
            }
            // Sized for one record (a jumbo segment, a value streamed into a segment of its own)
            // and holding none: that record never became whole. Continued, it would be an active
            // segment of that size (up to 4 GiB).
            let one_record = scan.meta.size() > self.opts.segment_bytes;
            if scan.header_ok && !scan.meta.is_sealed() && before == 0 && one_record {
                scan.cut_short = true;
            }
            max_epoch = max_epoch.max(scan.max_epoch);
            files.insert(id, Arc::new(file));
            scans.insert(id, scan);
        }
        // Holding nothing, wherever they are, they go (their ids are not reused). (First: the
        // newest segment then is the one the check below is about.)
        let cut: Vec<u32> = scans.iter().filter(|(_, s)| s.cut_short).map(|(&id, _)| id).collect();
        for id in cut {
            self.remove_segment(id, &mut scans, &mut files, "a crash cut its writing short, and it holds no record");
        }
        // A newest segment that a crash left before its header was written holds nothing: it goes
        // (new records go to a new segment, whose header holds the salt). Its id is not reused.
        if let Some((&last, scan)) = scans.iter().next_back() {
            if scan.never_written {
                let path = self.seg_path(last);
                files.remove(&last);
                scans.remove(&last);
                match self.backend.remove_file(&path) {
                    Ok(()) => log::info!("removed {}: its creation never wrote its header", path.display()),
                    Err(e) => log::warn!("could not remove {}, whose header was never written: {e}", path.display()),
                }
            }
        }
        Ok(Scanned { scans, files, max_epoch })
    }

    /// Take segment `id`, which holds nothing the log needs, out of what recovery found, and remove
    /// its file (`why` says what it was). Its id is not reused: new segments' ids are above every
    /// id found. A failed removal is only a warning: the next open finds the file again.
    fn remove_segment(
        &self,
        id: u32,
        scans: &mut BTreeMap<u32, SegmentScan>,
        files: &mut KeyMap<u32, Arc<B::File>>,
        why: &str,
    ) {
        scans.remove(&id);
        files.remove(&id);
        let path = self.seg_path(id);
        match self.backend.remove_file(&path) {
            Ok(()) => log::info!("removed {}: {why}", path.display()),
            Err(e) => log::warn!("could not remove {} ({why}): {e}", path.display()),
        }
    }

    /// The newest segment, if unsealed, continues as the active one, unless what the scan found in
    /// it forbids writing after its records (then new records go to a new segment, and a durable
    /// log fdatasyncs it at the next sync: the second value returned).
    fn continue_newest(
        &self,
        scans: &mut BTreeMap<u32, SegmentScan>,
        segs: &SegmentTable,
        files: &KeyMap<u32, Arc<B::File>>,
        salt_learned: bool,
    ) -> Result<Newest<B::File>> {
        let mut unsynced = Vec::new();
        let Some((&last, scan)) = scans.iter_mut().next_back() else { return Ok(Newest { active: None, unsynced }) };
        let meta = segs.get(&last).expect("scanned");
        if meta.is_sealed() {
            return Ok(Newest { active: None, unsynced });
        }
        if let Some(why) = why_not_continued(scan, meta, self.align, salt_learned) {
            // Writing goes on in a new segment. After a dropped record, so that this one's bytes,
            // and with them what the scan decided, stay as they are: a sync mark written after a
            // dropped record would make the next scan take it for synced damage, and it would hide
            // its key's value again. Without room for the footer, because it cannot be sealed. The
            // segment stays unsealed behind the active one (as after a crash during sealing):
            // readable, compacted and deleted like any other.
            log::warn!("segment {last} of {}: {why}; new records go to a new segment", self.dir.display());
            if self.opts.durable {
                // What was recovered from it may be in the page cache only: the next `sync`
                // fdatasyncs it, as it would the active segment.
                unsynced.push(files.get(&last).expect("opened").clone());
            }
            return Ok(Newest { active: None, unsynced });
        }
        let file = files.get(&last).expect("opened").clone();
        if let (Some(cut_end), true) = (scan.cut, self.opts.durable) {
            let end = align_up(cut_end, self.align).min(meta.size());
            self.erase_durably(&file, last, meta.data_end(), &scan.tail, end)?;
        }
        let mut footer = Vec::new();
        for e in &scan.entries {
            format::encode_footer_entry(&mut footer, e);
        }
        let active = Active {
            id: last,
            file,
            size: meta.size(),
            data_end: meta.data_end(),
            tail: std::mem::take(&mut scan.tail),
            written_end: meta.data_end(),
            footer,
            footer_entries: scan.entries.len() as u64,
            max_epoch: scan.max_epoch,
            // Its records may be in the page cache only (a process crash, or a close without
            // `sync`): the next sync or seal must fdatasync it.
            dirty: self.opts.durable,
            last_is_mark: scan.ends_with_mark,
            // Whether its file was made sparse is not recorded: taken as reserved, as it was made (a
            // write that meets a full file system fails then, its records still pending and
            // readable).
            reserved: true,
        };
        Ok(Newest { active: Some(active), unsynced })
    }

    /// The log's salt: the one in the newest segment header that decodes or, if no header does, in
    /// the newest trailer that does; a fresh one for a log that has neither (a new log, or one whose
    /// only segment's header never landed: a crash before the first `sync`, which is the first
    /// fdatasync of a segment's header, so none of its records was acknowledged). A segment whose
    /// header or trailer holds another salt belongs to another log: the open fails on it
    /// ([`Self::load_segment`]).
    /// Also returns whether the salt was learned (false: drawn fresh).
    pub(super) fn learn_salt(&self, segments: &[(u32, B::File)]) -> Result<(Salt, bool)> {
        let mut trailer_salt = None;
        for (id, file) in segments.iter().rev() {
            let path = self.seg_path(*id);
            let len = self.backend.file_len(file).map_err(|e| Error::io("stat segment", path.clone(), e))?;
            let len = align_down(len, self.align);
            if len < self.align {
                continue;
            }
            let head = self.scanner().read_aligned(file, 0, self.align as usize, &path)?;
            if let Ok(h) = format::decode_segment_header(&head) {
                if h.segment == *id {
                    return Ok((h.salt, true));
                }
            }
            if trailer_salt.is_none() && len >= 2 * self.align {
                let last = self.scanner().read_aligned(file, len - self.align, self.align as usize, &path)?;
                if let Ok(t) = format::decode_trailer(&last[self.align as usize - format::TRAILER_LEN..], *id, len) {
                    trailer_salt = Some(t.salt);
                }
            }
        }
        Ok(match trailer_salt {
            Some(salt) => (salt, true),
            None => (Salt::random(self.dir.as_os_str().as_encoded_bytes()), false),
        })
    }

    /// The error for a segment whose header or trailer holds a salt other than the log's.
    pub(super) fn foreign_segment(&self, id: u32, what: &str) -> Error {
        Error::Corrupt {
            segment: id,
            offset: 0,
            reason: format!(
                "its {what} holds another salt than the newest segment's header: segments of different \
                 logs are in {} (move the other log's out to open this one)",
                self.seg_dir.display()
            ),
        }
    }

    /// Read a segment's footer if it is sealed, or scan its records if not.
    pub(super) fn load_segment(&self, id: u32, file: &B::File, report: &mut RecoveryReport) -> Result<SegmentScan> {
        let path = self.seg_path(id);
        let file_len = self.backend.file_len(file).map_err(|e| Error::io("stat segment", path.clone(), e))?;
        let Geometry { size, data_start, header_ok, zero_header } = self.geometry(id, file, file_len, &path, report)?;
        if align_up(file_len, self.align) < size && header_ok {
            if let Some(scan) = self.cut_short(id, file, &path, (file_len, size), data_start)? {
                return Ok(scan);
            }
        }
        let sealed_candidate = file_len >= size;
        if file_len < size {
            // A truncated file, or a crash during preallocation: give it its size back so every
            // aligned read inside the segment succeeds (the lost part reads as zeros).
            self.backend.allocate(file, size).map_err(|e| Error::io("fallocate", path.clone(), e))?;
        }

        // Sealed? The trailer is the last TRAILER_LEN bytes of the file.
        if sealed_candidate {
            let last_block = self.scanner().read_aligned(file, size - self.align, self.align as usize, &path)?;
            let tb = &last_block[self.align as usize - format::TRAILER_LEN..];
            if let Ok(t) = format::decode_trailer(tb, id, size) {
                if t.salt != self.salt {
                    return Err(self.foreign_segment(id, "trailer"));
                }
                if let Some(entries) = self.read_footer(file, id, size, &t, &path)? {
                    let meta = SegMeta::holding(size, data_start, t.data_end, entries.len() as u64, true);
                    report.sealed_segments += 1;
                    return Ok(SegmentScan {
                        meta,
                        entries,
                        max_epoch: t.max_epoch,
                        tail: Vec::new(),
                        cut: None,
                        ends_with_mark: false,
                        dropped_unsynced: false,
                        header_ok,
                        never_written: false,
                        cut_short: false,
                    });
                }
                report.corrupt.push((id, t.footer_offset, "footer checksum mismatch; scanning records".into()));
            }
        }
        report.scanned_segments += 1;
        let mut scan = self.scanner().scan_segment(id, file, &path, size, data_start, report)?;
        scan.header_ok = header_ok;
        if let Some(e) = zero_header {
            if scan.entries.is_empty() && scan.cut.is_none() {
                scan.never_written = true;
            } else {
                report.corrupt.push((id, 0, format!("segment header: {e:?} (all zeros, before records)")));
            }
        }
        Ok(scan)
    }

    /// A segment whose file is shorter than its header announces (`size`), if nothing in the file
    /// is a record: a crash cut its writing short. A value streamed into a segment of its own
    /// (`put_stream`) announces its whole size in the header, up to 4 GiB, but has its space
    /// reserved only as its bytes arrive: a process killed part-way leaves such a file, its one
    /// record torn. It is returned empty and `cut_short` (`scan_segments` removes it), never
    /// extended to the size it announces. `None` if a record lies in the file (a truncated
    /// segment): it is then loaded as any other, extended to its size.
    fn cut_short(
        &self,
        id: u32,
        file: &B::File,
        path: &Path,
        (file_len, size): (u64, u64),
        data_start: u64,
    ) -> Result<Option<SegmentScan>> {
        // The file as it is and a block more (the scan keeps a segment's last 64 bytes for its
        // trailer, and a record may end at the file's end), never beyond the announced size.
        let len = (align_up(file_len, self.align) + self.align).min(size);
        if len <= data_start {
            return Ok(None);
        }
        self.backend.allocate(file, len).map_err(|e| Error::io("fallocate", path.to_path_buf(), e))?;
        // With a report of its own: a segment that goes is no damage to report.
        let mut scratch = RecoveryReport::default();
        let scan = self.scanner().scan_segment(id, file, path, len, data_start, &mut scratch)?;
        if !scan.entries.is_empty() {
            return Ok(None);
        }
        Ok(Some(SegmentScan { cut_short: true, ..scan }))
    }

    /// A segment's size and where its data starts, from its header, or defaults if the header is
    /// damaged (reported) or its geometry impossible.
    fn geometry(
        &self,
        id: u32,
        file: &B::File,
        file_len: u64,
        path: &Path,
        report: &mut RecoveryReport,
    ) -> Result<Geometry> {
        let file_len_aligned = align_down(file_len, self.align);
        // The header tells size, alignment and where data starts; fall back to defaults if damaged.
        let mut zero_header = None; // an all-zero header block's decode error, reported after the scan
        let header = if file_len_aligned >= self.align {
            let buf = self.scanner().read_aligned(file, 0, self.align as usize, path)?;
            match format::decode_segment_header(&buf) {
                Ok(h) if h.segment == id && h.salt != self.salt => return Err(self.foreign_segment(id, "header")),
                Ok(h) if h.segment == id => Some(h),
                Ok(_) => {
                    report.corrupt.push((id, 0, "segment header names another segment".into()));
                    None
                }
                Err(format::DecodeError::UnsupportedVersion(v)) => {
                    return Err(Error::UnsupportedVersion {
                        what: "segment",
                        found: v,
                        supported: format::FORMAT_VERSION as u32,
                    })
                }
                Err(e) if buf.iter().all(|&b| b == 0) => {
                    zero_header = Some(e);
                    None
                }
                Err(e) => {
                    report.corrupt.push((id, 0, format!("segment header: {e:?}")));
                    None
                }
            }
        } else {
            None
        };
        let fallback = (align_up(file_len, self.align).max(self.align * 2), self.align);
        let (size, data_start) = match header {
            Some(h)
                if h.segment_bytes % self.align == 0
                    && h.data_start % RECORD_ALIGN == 0
                    && h.data_start < h.segment_bytes
                    // Bounded by what the writer makes: `load_segment` extends the file to this size,
                    // and a crc-valid header (a crafted one) must not have that ask for exabytes.
                    && h.segment_bytes <= MAX_SEGMENT_FILE_BYTES =>
            {
                (h.segment_bytes, h.data_start)
            }
            Some(h) => {
                report.corrupt.push((
                    id,
                    0,
                    format!(
                        "segment header: impossible geometry (segment_bytes {}, data_start {}, alignment {})",
                        h.segment_bytes, h.data_start, self.align
                    ),
                ));
                fallback
            }
            None => fallback,
        };
        Ok(Geometry { size, data_start, header_ok: header.is_some(), zero_header })
    }

    pub(super) fn read_footer(
        &self,
        file: &B::File,
        id: u32,
        size: u64,
        t: &format::Trailer,
        path: &Path,
    ) -> Result<Option<Vec<FooterEntry>>> {
        let start = align_down(t.footer_offset, self.align);
        let end = align_up(t.footer_offset + t.footer_len, self.align);
        let buf = self.scanner().read_aligned(file, start, (end - start) as usize, path)?;
        let fb = &buf[(t.footer_offset - start) as usize..(t.footer_offset - start + t.footer_len) as usize];
        if format::footer_crc(fb) != t.footer_crc {
            return Ok(None);
        }
        match format::decode_footer(fb, t.entry_count, size) {
            // A tombstone's `aux` is at most its own segment (see `format::peek_record_header`); a
            // footer saying otherwise is not trusted (the scan checks each record on its own).
            Ok(e) if e.iter().any(|e| e.flags & format::FLAG_TOMBSTONE != 0 && e.aux > id) => {
                log::warn!("segment {id}: footer lists a tombstone shadowing a later segment; scanning");
                Ok(None)
            }
            Ok(e) => Ok(Some(e)),
            Err(err) => {
                log::warn!("segment {id}: footer passes its checksum but does not decode ({err:?}); scanning");
                Ok(None)
            }
        }
    }

    /// Zero `data_end..end` of a segment that writing continues in (what recovery cut off as a torn
    /// tail, or what a failed write left past the end; `tail` holds the bytes of the block before
    /// `data_end`), and sync it, before anything new is written there. The epoch rule rejects a stale
    /// record only after a newer one: a stale record *at* the published end (the head of a torn
    /// write, say) would, after a power cut that kept later pages of the next write but not its
    /// first, be taken for a damaged record in the middle of the log, and win over its key's synced
    /// value. Only durable logs do this (it runs only after a crash or a failed write). A failed sync
    /// is an error (an fdatasync is never retried); a failed erase only a warning.
    pub(super) fn erase_durably(&self, file: &B::File, id: u32, data_end: u64, tail: &[u8], end: u64) -> Result<()> {
        if end <= data_end {
            return Ok(());
        }
        if let Err(e) = erase_aborted(self.backend, self.align, file, data_end - tail.len() as u64, tail, end) {
            log::warn!("segment {id}: could not erase bytes {data_end}..{end} past the end of its records: {e}");
            return Ok(());
        }
        self.backend.sync_data(file).map_err(|e| Error::io("sync segment", self.seg_path(id), e))
    }
}
