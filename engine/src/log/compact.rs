//! Compaction: relocating the live records of the segments the [`CompactionPolicy`] finds sparse,
//! so the segments can be deleted.

use bytes::Bytes;

use crate::backend::Backend;
use crate::error::Result;
use crate::format::{self, FooterEntry};

use super::gc::collect_garbage;
use super::location::Location;
use super::read::read_record_bytes;
use super::record::NewRecord;
use super::scan::{entry_matches, RecoveryReport, FOOTER_MISMATCH};
use super::segments::{closed, is_sparse, WriterState};
use super::table::padded;
use super::write::append;
use super::SegmentLog;

/// What [`SegmentLog::compact`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CompactStats {
    /// Segments rewritten and deleted.
    pub segments_compacted: u64,
    /// Records relocated.
    pub records_moved: u64,
    /// Bytes relocated.
    pub bytes_moved: u64,
    /// Segments deleted (including empty ones).
    pub segments_deleted: u64,
    /// Disk bytes released.
    pub bytes_freed: u64,
}

/// Records to keep that compaction could not move (damaged): the segment must keep them. The
/// tombstones among them: their count, bytes and oldest shadowed segment.
struct Stuck {
    tombstones: u64,
    bytes: u64,
    shadow: u32,
    /// Any record to keep could not be moved.
    any: bool,
}

pub(super) fn compact<B: Backend>(log: &SegmentLog<B>) -> Result<CompactStats> {
    let mut st = log.writer();
    log.health.check_writable()?; // under the lock, as in `sync`
    compact_locked(log, &mut st)
}

pub(super) fn compact_locked<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>) -> Result<CompactStats> {
    st.compacting = true;
    let r = compact_inner(log, st);
    st.compacting = false;
    r
}

pub(super) fn compact_inner<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>) -> Result<CompactStats> {
    let mut stats = CompactStats::default();
    let before: u64 = st.segs.values().map(|m| m.size()).sum();
    let before_ids: Vec<u32> = st.segs.keys().copied().collect();
    collect_garbage(log, st)?;
    let victims: Vec<u32> =
        st.segs.iter().filter(|(&id, m)| closed(st, id, m) && is_sparse(log, st, id, m)).map(|(&id, _)| id).collect();
    for id in victims {
        if !st.segs.contains_key(&id) {
            continue;
        }
        let (moved, bytes) = relocate_segment(log, st, id)?;
        stats.records_moved += moved;
        stats.bytes_moved += bytes;
        stats.segments_compacted += 1;
        collect_garbage(log, st)?;
    }
    // Deletions also happen inside appends (a relocation can empty a segment): count by difference.
    stats.segments_deleted = before_ids.iter().filter(|id| !st.segs.contains_key(id)).count() as u64;
    let after: u64 = st.segs.values().map(|m| m.size()).sum();
    stats.bytes_freed = before.saturating_sub(after);
    Ok(stats)
}

/// Copy the live records and needed tombstones of segment `id` to the active segment.
pub(super) fn relocate_segment<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    id: u32,
) -> Result<(u64, u64)> {
    let file = match log.files.read().unwrap_or_else(|p| p.into_inner()).get(&id) {
        Some(f) => f.clone(),
        None => return Ok((0, 0)),
    };
    let mut report = RecoveryReport::default();
    let scan = log.reader().load_segment(id, &file, &mut report)?;
    let index_snapshot = records_to_keep(log, st, id, scan.entries);
    let mut moved = 0;
    let mut bytes = 0;
    // Relocate in bounded batches so memory stays proportional to the batch, not the segment.
    let mut batch: Vec<(Bytes, u64)> = Vec::new();
    let mut batch_bytes = 0u64;
    let mut stuck = Stuck { tombstones: 0, bytes: 0, shadow: u32::MAX, any: false };
    for (e, keep) in index_snapshot {
        if !keep {
            continue;
        }
        let loc = Location { segment: id, offset: e.offset, len: e.record_len };
        let raw = read_record_bytes(log, &file, loc)?;
        let checked = format::decode_record(&raw, log.salt).and_then(|r| {
            // The index entry of the copy comes from the header, its place from the footer
            // entry: they must agree (only a crafted footer with a valid crc can differ).
            entry_matches(&e, &r.header).then_some(()).ok_or(format::DecodeError::Invalid(FOOTER_MISMATCH))
        });
        if let Err(err) = checked {
            // A damaged record stays where it is (its segment is kept) and is reported. A live
            // value keeps its segment by being live; a tombstone does by its count, below.
            log::warn!("compaction leaves damaged record in place: {}", err.at(id, e.offset));
            stuck.any = true;
            if e.flags & format::FLAG_TOMBSTONE != 0 {
                stuck.tombstones += 1;
                stuck.bytes += padded(e.record_len);
                stuck.shadow = stuck.shadow.min(e.aux);
            }
            continue;
        }
        moved += 1;
        bytes += e.record_len;
        batch_bytes += e.record_len;
        batch.push((raw, e.offset));
        if batch_bytes >= 8 << 20 {
            append_relocated(log, st, id, &mut batch)?;
            batch_bytes = 0;
        }
    }
    // Every record is read: let go of the file before the last batch is published, which may
    // delete the segment (and keep its file for reuse, which a handle held here would prevent).
    drop(file);
    if !batch.is_empty() {
        append_relocated(log, st, id, &mut batch)?;
    }
    // Tombstones moved out: this segment's tombstones are no longer needed here, except those
    // that could not be moved. They stay counted, so the segment (and with it each damaged
    // tombstone, which recovery still honours through the footer) is kept while they are needed.
    let pending = st.active.as_ref().is_some_and(|a| a.written_end != a.data_end);
    st.segs.tombstones_moved(id, (stuck.tombstones, stuck.bytes, stuck.shadow), stuck.any, pending);
    Ok((moved, bytes))
}

/// Append the records of `batch` (each read whole from segment `id`, with its offset there) as
/// relocated copies of the originals, then empty it.
fn append_relocated<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    id: u32,
    batch: &mut Vec<(Bytes, u64)>,
) -> Result<()> {
    let recs: Vec<NewRecord<'_>> = batch
        .iter()
        .map(|(b, offset)| {
            let header = format::peek_record_header(b).expect("verified before relocation");
            NewRecord::Relocated {
                bytes: b,
                header,
                key: &b[header.key_offset()..header.key_offset() + header.key_len as usize],
                from: (id, *offset),
            }
        })
        .collect();
    append(log, st, recs)?;
    batch.clear();
    Ok(())
}

/// Each record of segment `id` (its footer entries or scan), with whether compaction keeps it:
/// a value the index still points at, or a tombstone still needed.
fn records_to_keep<B: Backend>(
    log: &SegmentLog<B>,
    st: &WriterState<B::File>,
    id: u32,
    entries: Vec<FooterEntry>,
) -> Vec<(FooterEntry, bool)> {
    let index = log.index.view();
    entries
        .into_iter()
        .map(|e| {
            let keep = if e.flags & format::FLAG_TOMBSTONE != 0 {
                // Needed while a segment it shadows exists, unless the key is live again with
                // a record whose own (future) tombstone will shadow at least as far back. A key
                // deleted and then put again gets a `first_segment` after this tombstone's
                // `aux`: dropping the tombstone then would let an old copy come back once the
                // new record is deleted too (a case the `log_model` fuzz target reaches). Needed
                // too while its key streams into a segment of its own: that newer segment, out of
                // every range, may hold a record of the key it deletes (`Streams::streaming`).
                (e.aux < id
                    && st.segs.range(e.aux..id).next().is_some()
                    && index.get(e.key.as_slice()).is_none_or(|l| st.segs.first_segment(&l) > e.aux))
                    || log.streams.streaming(&e.key)
            } else {
                index.get(e.key.as_slice()).is_some_and(|l| l.segment() == id && l.offset() == e.offset)
            };
            (e, keep)
        })
        .collect()
}
