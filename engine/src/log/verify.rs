//! Inspection: [`LogStats`] and `verify`, which reads every record back and lists
//! [`VerifyProblem`]s without changing anything.

use std::sync::Arc;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::format;

use super::location::Location;
use super::read::read_record_bytes;
use super::scan::{entry_matches, RecoveryReport, FOOTER_MISMATCH};
use super::segments::{flush_pending, tombstones_needed, PUNCH_MIN_BYTES};
use super::SegmentLog;

/// Space accounting, as reported by [`SegmentLog::stats`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogStats {
    /// Segment files.
    pub segments: u64,
    /// Sealed segment files.
    pub sealed_segments: u64,
    /// Records in all segments (live, superseded and tombstones).
    pub records: u64,
    /// Live keys.
    pub live_records: u64,
    /// Bytes of live records (padded), plus tombstones that are still needed.
    pub live_bytes: u64,
    /// Bytes of records that are superseded, deleted, or tombstones no longer needed.
    pub dead_bytes: u64,
    /// Tombstone records on disk.
    pub tombstones: u64,
    /// Bytes of all segment files (preallocated size).
    pub disk_bytes: u64,
    /// Bytes used by records in all segments.
    pub used_bytes: u64,
    /// Files of deleted segments kept for reuse (`LogOptions::recycle_segments`); their bytes count
    /// in `disk_bytes`.
    pub spare_files: u64,
}

/// A problem found by [`SegmentLog::verify`].
#[derive(Debug, Clone)]
pub struct VerifyProblem {
    /// Segment id.
    pub segment: u32,
    /// Byte offset.
    pub offset: u64,
    /// The record's key, when known.
    pub key: Option<Vec<u8>>,
    /// What is wrong.
    pub error: String,
}

pub(super) fn stats<B: Backend>(log: &SegmentLog<B>) -> LogStats {
    let st = log.writer();
    let mut s = LogStats::default();
    for (&id, m) in st.segs.iter() {
        s.segments += 1;
        s.sealed_segments += m.is_sealed() as u64;
        s.records += m.records();
        s.live_records += m.live_records();
        let tomb = if tombstones_needed(&st, id) { m.tombstone_bytes() } else { 0 };
        s.live_bytes += m.live_bytes() + tomb;
        let used = m.data_end() - m.data_start();
        s.used_bytes += used;
        s.dead_bytes += used.saturating_sub(m.live_bytes() + tomb);
        s.tombstones += m.tombstones();
        s.disk_bytes += m.size();
    }
    s.spare_files = st.spare_files.len() as u64;
    s.disk_bytes += s.spare_files * log.opts.segment_bytes;
    s
}

pub(super) fn verify<B: Backend>(log: &SegmentLog<B>) -> Result<Vec<VerifyProblem>> {
    // Hold the writer lock so the active segment is not changing under the scan, and check the
    // file with nothing pending in memory (write-behind).
    let mut st = log.writer();
    flush_pending(log, &mut st)?;
    let mut problems: Vec<VerifyProblem> = log
        .recovery
        .corrupt
        .iter()
        .map(|(s, o, r)| VerifyProblem { segment: *s, offset: *o, key: None, error: r.clone() })
        .collect();
    let ids: Vec<(u32, Arc<B::File>)> = {
        let files = log.files.read().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<_> = files.iter().map(|(&id, f)| (id, f.clone())).collect();
        v.sort_by_key(|(id, _)| *id);
        v
    };
    for (id, file) in ids {
        let mut report = RecoveryReport::default();
        let scan = match log.reader().load_segment(id, &file, &mut report) {
            Ok(s) => s,
            Err(e) => {
                problems.push(VerifyProblem { segment: id, offset: 0, key: None, error: e.to_string() });
                continue;
            }
        };
        for e in scan.entries {
            let loc = Location { segment: id, offset: e.offset, len: e.record_len };
            // A dead large record: forgetting it may have punched its payload out, so only its
            // head (which a punch keeps) is checked.
            let head_only = log.opts.punch_forgotten
                && e.record_len >= PUNCH_MIN_BYTES
                && e.flags & format::FLAG_TOMBSTONE == 0
                && log.location(&e.key).is_none_or(|l| l.segment != id || l.offset != e.offset);
            let err = match read_record_bytes(log, &file, loc) {
                Ok(raw) if head_only => match format::peek_record_header(&raw)
                    .and_then(|h| format::verify_record_head(&raw, &h, log.salt).map(|_| h))
                {
                    Ok(h) if entry_matches(&e, &h) => None,
                    Ok(_) => Some(Error::Corrupt { segment: id, offset: e.offset, reason: FOOTER_MISMATCH.into() }),
                    Err(d) => Some(d.at(id, e.offset)),
                },
                Ok(raw) => match format::decode_record(&raw, log.salt) {
                    Ok(r) if r.key == e.key.as_slice() && entry_matches(&e, &r.header) => None,
                    Ok(_) => Some(Error::Corrupt { segment: id, offset: e.offset, reason: FOOTER_MISMATCH.into() }),
                    Err(d) => Some(d.at(id, e.offset)),
                },
                Err(err) => Some(err),
            };
            if let Some(err) = err {
                problems.push(VerifyProblem {
                    segment: id,
                    offset: e.offset,
                    key: Some(e.key),
                    error: err.to_string(),
                });
            }
        }
    }
    // One line per place; prefer the entry that knows the key.
    problems.sort_by_key(|p| (p.segment, p.offset, p.key.is_none()));
    problems.dedup_by_key(|p| (p.segment, p.offset));
    Ok(problems)
}
