//! Recovery's edge cases, one test (or two) per case:
//!
//! * garbage collection never retries an fdatasync that failed, nor deletes a segment after one.
//! * a tombstone whose `aux` names a later segment than its own is damage, not a panic.
//! * a segment file that cannot be opened fails the open; it is not skipped.
//! * a zeroed region inside synced records is damage: the records after it are kept.
//! * a damaged record that no sync mark follows was never synced: its key keeps its synced value.
//! * a damaged live value does not make every compaction copy its segment's tombstones again.
//! * a segment header with an absurd `segment_bytes` is damage, not an allocation of that size.
//! * a recovered segment with no room left for its footer is not sealed (and does not panic).
//! * many zeroed regions in front of one sync mark cost an open a bounded number of passes.
//! * a record forged inside a value (crc32-valid, as its author can make it) is not taken for one
//!   when recovery searches the value's bytes after a torn head.
//! * a record whose seq or epoch is at its maximum opens the log read-only instead of failing every
//!   open (epoch) or wrapping the next seq to 0 (seq).
//! * a segment of another log (another salt) fails the open with an error that says so.
//! * a record past 4 GiB into a segment (which the index cannot address) is damage; its offset does
//!   not wrap to another record's.
//! * a store of the previous format version (3, which has no salt) is refused with an error that
//!   names both versions, and nothing in it is changed.
//! * a log whose only salt is in a damaged header keeps the bytes it cannot verify: they are neither
//!   erased nor written over.
//! * a segment whose header is damaged is never continued: records written after it would not
//!   verify once no segment held the salt.
//! * a value streamed into a segment of its own that a crash cut short leaves a file shorter than
//!   its header announces: it is removed, not extended to that size and continued.

use std::path::PathBuf;

use spillway::backend::{Fault, FaultKind, FaultOp};
use spillway::format::{self, FooterEntry, RecordHeader, Salt};
use spillway::{Backend, Error, Frames, LogOptions, SegmentLog, SimBackend, StreamedValue};
use spillway_tests::value_for;

fn opts() -> LogOptions {
    LogOptions { segment_bytes: 64 * 1024, auto_compact: false, ..Default::default() }
}

fn seg_path(id: u32) -> PathBuf {
    PathBuf::from(format!("/s/segments/{id:08x}.seg"))
}

fn one(key: &[u8], n: usize) -> Frames {
    Frames::from(value_for(key, n))
}

/// An fdatasync that fails while garbage collection deletes a dead segment poisons the log, and
/// garbage collection stops there: going on to the next dead segment would fdatasync again (a retry
/// can report success for pages the kernel dropped after the first failure) and delete it, while
/// the records that replaced its contents may be lost.
#[test]
fn a_failed_fdatasync_during_garbage_collection_deletes_nothing_more() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    let (a_big, b_big, c_big) = (one(b"a", 40 << 10), one(b"b", 40 << 10), one(b"c", 40 << 10));
    log.put(b"a", &a_big).unwrap();
    log.put(b"b", &b_big).unwrap();
    log.put(b"c", &c_big).unwrap();
    let segs: Vec<u32> = [&b"a"[..], b"b", b"c"].iter().map(|k| log.location(k).unwrap().segment).collect();
    assert_eq!(segs, vec![1, 2, 3], "one segment each");
    log.sync().unwrap();
    be.inject(Fault { op: FaultOp::Sync, after: 0, kind: FaultKind::Eio, sticky: false });
    let (a_small, b_small) = (one(b"a2", 100), one(b"b2", 100));
    // Both values are written (to the kernel); segments 1 and 2 hold nothing live any more. Deleting
    // segment 1 needs an fdatasync of segment 3 first, which fails.
    log.put_many(&[(&b"a"[..], &a_small), (&b"b"[..], &b_small)]).unwrap();
    assert!(be.fault_fired());
    assert!(be.files().contains(&seg_path(1)), "segment 1 is kept");
    assert!(be.files().contains(&seg_path(2)), "segment 2 was deleted after a failed fdatasync");
    let e = log.put(b"d", &one(b"d", 10)).unwrap_err();
    assert!(matches!(e, Error::Poisoned { .. }), "{e}");
    assert_eq!(log.get(b"a").unwrap(), Some(a_small.clone()));
    drop(log);
    // A process crash keeps what was written to the kernel.
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    assert_eq!(log.get(b"a").unwrap(), Some(a_small));
    assert_eq!(log.get(b"b").unwrap(), Some(b_small));
    drop(log);
    // A power cut keeps what was synced last.
    let log = SegmentLog::open(be.crash(None), "/s", opts()).unwrap();
    assert_eq!(log.get(b"a").unwrap(), Some(a_big));
    assert_eq!(log.get(b"b").unwrap(), Some(b_big));
    assert_eq!(log.get(b"c").unwrap(), Some(c_big));
}

/// The salt in the header of `bytes` (a segment file): what a crafted record needs to pass for one
/// of the log's (its header crc covers it).
fn salt_in(bytes: &[u8]) -> Salt {
    format::decode_segment_header(&bytes[..format::SEGMENT_HEADER_LEN]).expect("a segment header").salt
}

/// Offsets of the records in `bytes` (a segment file) whose header parses and passes its crc.
fn records_in(bytes: &[u8]) -> Vec<(u64, RecordHeader)> {
    let salt = salt_in(bytes);
    let mut out = Vec::new();
    let mut at = 0;
    while at + format::RECORD_HEADER_LEN <= bytes.len() {
        if let Ok(h) = format::peek_record_header(&bytes[at..]) {
            if format::verify_record_head(&bytes[at..], &h, salt).is_ok() {
                out.push((at as u64, h));
            }
        }
        at += 64;
    }
    out
}

/// The tombstone of `key` in segment `id`: its offset, header, and head bytes.
fn tombstone_of(be: &SimBackend, id: u32, key: &[u8]) -> (u64, RecordHeader, Vec<u8>) {
    let bytes = be.file_contents(&seg_path(id)).unwrap();
    let (at, h) = records_in(&bytes)
        .into_iter()
        .find(|(at, h)| {
            let ko = *at as usize + h.key_offset();
            h.is_tombstone() && &bytes[ko..ko + h.key_len as usize] == key
        })
        .expect("the tombstone");
    let head = bytes[at as usize..at as usize + h.payload_offset() as usize].to_vec();
    (at, h, head)
}

/// In a scanned segment: a tombstone whose header passes its crc but whose `aux` names a segment
/// after its own would make `BTreeMap::range` panic (in `stats`, garbage collection and compaction).
/// It is damage, reported with its location.
#[test]
fn a_tombstone_shadowing_a_later_segment_is_damage_not_a_panic() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"gone", &one(b"gone", 100)).unwrap();
    log.put(b"kept", &one(b"kept", 100)).unwrap();
    assert!(log.delete(b"gone").unwrap());
    log.sync().unwrap();
    drop(log);
    let (at, mut h, head) = tombstone_of(&be, 1, b"gone");
    assert_eq!(h.aux, 1);
    h.aux = 7;
    let mut crafted = head.clone();
    format::write_record_head(&mut crafted, &h, &[], b"gone", salt_in(&be.file_contents(&seg_path(1)).unwrap()));
    be.poke(&seg_path(1), at, &crafted).unwrap();

    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    let _ = log.stats();
    log.compact().unwrap();
    assert!(log.recovery_report().corrupt.iter().any(|c| c.0 == 1 && c.1 == at), "{:?}", log.recovery_report());
    assert_eq!(log.get(b"kept").unwrap(), Some(one(b"kept", 100)));
    log.put(b"more", &one(b"more", 100)).unwrap();
    log.sync().unwrap();
}

/// In a sealed segment: the same `aux` in a footer entry (footer and trailer crcs valid). The footer
/// is not trusted; the segment is scanned, where the tombstone's own record is intact.
#[test]
fn a_footer_entry_shadowing_a_later_segment_is_damage_not_a_panic() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"gone", &one(b"gone", 100)).unwrap();
    assert!(log.delete(b"gone").unwrap());
    log.put(b"pinned", &one(b"pinned", 100)).unwrap();
    let mut i = 0;
    while log.stats().sealed_segments == 0 {
        let k = format!("fill-{i}");
        log.put(k.as_bytes(), &one(k.as_bytes(), 3000)).unwrap();
        i += 1;
    }
    log.sync().unwrap();
    drop(log);
    // Rewrite segment 1's footer entry of the tombstone with aux = 9, with valid crcs.
    let path = seg_path(1);
    let bytes = be.file_contents(&path).unwrap();
    let size = bytes.len() as u64;
    let t = format::decode_trailer(&bytes[bytes.len() - format::TRAILER_LEN..], 1, size).unwrap();
    let (fo, fl) = (t.footer_offset as usize, t.footer_len as usize);
    let mut entries = format::decode_footer(&bytes[fo..fo + fl], t.entry_count, size).unwrap();
    let e = entries.iter_mut().find(|e| e.flags & format::FLAG_TOMBSTONE != 0).expect("the tombstone's entry");
    assert_eq!(e.aux, 1);
    e.aux = 9;
    let mut footer = Vec::new();
    for e in &entries {
        format::encode_footer_entry(&mut footer, e);
    }
    assert_eq!(footer.len(), fl);
    let t = format::Trailer { footer_crc: format::footer_crc(&footer), ..t };
    be.poke(&path, fo as u64, &footer).unwrap();
    be.poke(&path, size - format::TRAILER_LEN as u64, &format::encode_trailer(&t)).unwrap();

    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    let _ = log.stats();
    log.compact().unwrap();
    assert!(log.recovery_report().corrupt.iter().any(|c| c.0 == 1), "{:?}", log.recovery_report());
    assert_eq!(log.get(b"gone").unwrap(), None, "the tombstone's record still deletes the key");
    assert_eq!(log.get(b"pinned").unwrap(), Some(one(b"pinned", 100)));
    log.put(b"more", &one(b"more", 100)).unwrap();
    log.sync().unwrap();
}

/// A segment file that cannot be opened (an EIO from `open`) fails the open with an error naming
/// it. Skipping it would reuse its sequence numbers, and once it was readable again its older
/// records would win over newer writes (and its tombstones would be lost meanwhile). Once it opens
/// again, everything is there.
#[test]
fn a_segment_that_cannot_be_opened_fails_the_open() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"a", &one(b"a", 40 << 10)).unwrap();
    log.put(b"b", &one(b"b", 40 << 10)).unwrap();
    assert_eq!(log.location(b"b").unwrap().segment, 2);
    log.sync().unwrap();
    drop(log);
    // Segment 1 opens, segment 2 does not.
    be.inject(Fault { op: FaultOp::Open, after: 1, kind: FaultKind::Eio, sticky: false });
    let e = match SegmentLog::open(be.clone(), "/s", opts()) {
        Ok(_) => panic!("the open succeeded without segment 2"),
        Err(e) => e,
    };
    assert!(matches!(e, Error::Io { .. }), "{e}");
    assert!(e.to_string().contains("00000002.seg"), "{e}");
    let log = SegmentLog::open(be, "/s", opts()).unwrap();
    assert_eq!(log.get(b"b").unwrap(), Some(one(b"b", 40 << 10)));
    assert_eq!(log.get(b"a").unwrap(), Some(one(b"a", 40 << 10)));
}

/// A directory named like a segment is not one of the log's files: it is left alone, with a
/// warning, like any other stray name, and the open goes on.
#[test]
fn a_directory_named_like_a_segment_is_left_alone() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"a", &one(b"a", 100)).unwrap();
    log.sync().unwrap();
    drop(log);
    be.create_dir_all(&seg_path(9)).unwrap();
    let log = SegmentLog::open(be, "/s", opts()).unwrap();
    assert_eq!(log.get(b"a").unwrap(), Some(one(b"a", 100)));
}

/// A zeroed region (two whole blocks and more) inside synced records looks like the clean end of
/// the segment, and a search past it could take every record beyond for an orphan of a failed batch
/// and erase it durably: synced records, erased at open. A sync mark beyond the zeros
/// (of this segment, at an epoch no lower than the records before them) proves they are damage, not
/// an end: the region is reported, and the records after it are kept.
#[test]
fn zeroed_blocks_inside_synced_records_do_not_erase_the_records_after_them() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"a", &one(b"a", 100)).unwrap();
    log.sync().unwrap();
    log.put(b"b", &one(b"b", 12 << 10)).unwrap();
    log.put(b"c", &one(b"c", 100)).unwrap();
    log.sync().unwrap();
    let b = log.location(b"b").unwrap();
    drop(log);
    // Zero b's record: from its start to past the end of the next whole block, all zeros.
    assert!(b.offset + b.len >= (b.offset / 4096 + 2) * 4096, "{b:?} spans two whole blocks");
    be.poke(&seg_path(1), b.offset, &vec![0u8; b.len as usize]).unwrap();

    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    assert_eq!(log.get(b"c").unwrap(), Some(one(b"c", 100)), "a synced record after the zeros");
    assert_eq!(log.get(b"a").unwrap(), Some(one(b"a", 100)));
    assert_eq!(log.get(b"b").unwrap(), None, "a record whose head is gone is unreadable (a known limit)");
    let report = log.recovery_report();
    assert_eq!(report.truncated_bytes, 0, "{report:?}");
    assert!(report.corrupt.iter().any(|c| c.0 == 1 && c.1 == b.offset), "{report:?}");
    // The log goes on, and the next open finds the same.
    log.put(b"d", &one(b"d", 100)).unwrap();
    log.sync().unwrap();
    drop(log);
    let log = SegmentLog::open(be.crash(None), "/s", opts()).unwrap();
    for k in [&b"a"[..], b"c", b"d"] {
        assert_eq!(log.get(k).unwrap(), Some(one(k, 100)), "{k:?}");
    }
}

/// A batch whose first group of writes was torn while its second landed (io_uring: group 2 is
/// submitted before group 1's result is reaped; a power cut or a SIGKILL with writes in flight does
/// the same) leaves a torn record of `k` followed by an intact record. The torn record is not the
/// end of the log, but keeping it as damage, with the highest seq, would make `k` read as a checksum
/// error instead of its synced value. No sync mark follows it, so it was never synced: it is
/// dropped, and `k` keeps its synced value, at this open and at every later one.
#[test]
fn a_torn_record_of_a_failed_batch_does_not_hide_the_synced_value() {
    let be = SimBackend::new();
    be.set_queue_writes(true);
    let o = || LogOptions { write_group_bytes: 8 << 10, alignment: Some(4096), ..opts() };
    let log = SegmentLog::open(be.clone(), "/s", o()).unwrap();
    let v1 = one(b"v1", 1000);
    log.put(b"k", &v1).unwrap();
    log.sync().unwrap();
    be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::TornWrite, sticky: false });
    let (v2, x) = (one(b"v2", 32 << 10), one(b"x", 100));
    assert!(log.put_many(&[(&b"k"[..], &v2), (&b"x"[..], &x)]).is_err());
    assert!(matches!(log.put(b"y", &x), Err(Error::Poisoned { .. })));
    drop(log);

    let log = SegmentLog::open(be.clone(), "/s", o()).unwrap();
    assert_eq!(log.get(b"k").unwrap(), Some(v1.clone()), "the synced value");
    let report = log.recovery_report().clone();
    assert!(!report.corrupt.is_empty(), "the torn record is reported: {report:?}");
    // The log goes on (and syncs, which writes a sync mark after the torn record, were it written
    // into the same segment); the torn record never wins later either.
    log.put(b"z", &x).unwrap();
    log.sync().unwrap();
    drop(log);
    for what in ["reopened", "after a power cut"] {
        let be = if what == "reopened" { be.clone() } else { be.crash(None) };
        let log = SegmentLog::open(be, "/s", o()).unwrap();
        assert_eq!(log.get(b"k").unwrap(), Some(v1.clone()), "{what}");
        assert_eq!(log.get(b"z").unwrap(), Some(x.clone()), "{what}");
        assert!(log.verify().is_ok());
    }
}

/// The other side of the case above: damage to a record that a sync mark follows is damage to
/// synced data. It is reported when the key is read, never replaced by an older value.
#[test]
fn damage_to_a_synced_record_of_the_unsealed_segment_is_an_error_not_an_older_value() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"k", &one(b"v1", 1000)).unwrap();
    log.sync().unwrap();
    log.put(b"k", &one(b"v2", 1000)).unwrap();
    log.put(b"after", &one(b"after", 100)).unwrap();
    log.sync().unwrap();
    let loc = log.location(b"k").unwrap();
    drop(log);
    be.poke(&seg_path(loc.segment), loc.offset + loc.len - 10, b"garbage").unwrap();
    let log = SegmentLog::open(be, "/s", opts()).unwrap();
    let e = log.get(b"k").unwrap_err();
    assert_eq!(e.location(), Some((loc.segment, loc.offset)), "{e}");
    assert_eq!(log.get(b"after").unwrap(), Some(one(b"after", 100)));
}

/// A segment header with a valid crc and an absurd `segment_bytes` must not be believed: the file
/// would be extended to that size (an allocation of that much, here one that cannot even be asked
/// for). A size beyond the largest segment the writer makes (a jumbo segment for the largest record) is
/// damage: reported, and the file's own length is used instead.
#[test]
fn a_segment_header_with_an_absurd_size_is_damage() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"a", &one(b"a", 1000)).unwrap();
    log.sync().unwrap();
    drop(log);
    let path = seg_path(1);
    let bytes = be.file_contents(&path).unwrap();
    let mut h = format::decode_segment_header(&bytes[..format::SEGMENT_HEADER_LEN]).unwrap();
    // Sizes the simulated file system refuses at once (a plausible one, say 64 GiB, it would try to
    // allocate, were the check ever lost).
    for size in [!4095u64, 1 << 63] {
        h.segment_bytes = size;
        be.poke(&path, 0, &format::encode_segment_header(&h)).unwrap();
        let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
        assert!(log.recovery_report().corrupt.iter().any(|c| c.0 == 1 && c.1 == 0), "{:?}", log.recovery_report());
        assert_eq!(log.get(b"a").unwrap(), Some(one(b"a", 1000)), "size {size}");
        assert_eq!(be.file_contents(&path).unwrap().len(), bytes.len(), "size {size}: the file keeps its size");
    }
}

/// A record with valid checksums under `salt`: `key`, one frame `value`, in `segment` at `epoch`.
fn crafted_record(key: &[u8], value: &[u8], segment: u32, epoch: u32, seq: u64, salt: Salt) -> Vec<u8> {
    let h = RecordHeader {
        flags: 0,
        frame_count: 1,
        key_len: key.len() as u32,
        segment,
        epoch,
        payload_crc: format::payload_crc(value),
        seq,
        raw_len: value.len() as u64,
        stored_len: value.len() as u64,
        aux: 0,
    };
    let len = h.record_len() as usize;
    let mut b = vec![0u8; format::align_up(len as u64, 64) as usize];
    b[h.payload_offset() as usize..len].copy_from_slice(value);
    format::write_record_head(&mut b, &h, &[value.len() as u64], key, salt);
    b
}

/// The writer keeps room for a segment's footer at every record, but a recovered unsealed
/// segment's records can leave less (records with valid checksums and long keys, written by no
/// writer of this log). Sealing it would panic (`copy_from_slice` of a footer longer than the room
/// left). It is not continued instead: it stays unsealed, its records readable, and new records go
/// to a new segment.
#[test]
fn a_recovered_segment_without_room_for_its_footer_is_not_sealed() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"a", &one(b"a", 100)).unwrap();
    log.sync().unwrap();
    let a = log.location(b"a").unwrap();
    drop(log);
    let path = seg_path(1);
    let limit = be.file_contents(&path).unwrap().len() as u64 - format::TRAILER_LEN as u64;
    let mut at = format::align_up(a.offset + a.len, 64);
    let mut keys = Vec::new();
    let salt = salt_in(&be.file_contents(&path).unwrap());
    loop {
        let key = format!("{:02000}", keys.len()).into_bytes();
        let rec = crafted_record(&key, b"crafted", 1, 1, 1000 + keys.len() as u64, salt);
        if at + rec.len() as u64 > limit {
            break;
        }
        be.poke(&path, at, &rec).unwrap();
        at += rec.len() as u64;
        keys.push(key);
    }
    assert!(keys.len() > 20);

    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    for k in &keys {
        assert_eq!(log.get(k).unwrap(), Some(Frames::from(b"crafted".to_vec())));
    }
    log.put(b"b", &one(b"b", 100)).unwrap();
    assert_eq!(log.location(b"b").unwrap().segment, 2, "a new segment");
    log.sync().unwrap();
    assert!(log.verify().unwrap().is_empty());
    drop(log);
    let log = SegmentLog::open(be, "/s", opts()).unwrap();
    for k in &keys {
        assert_eq!(log.get(k).unwrap(), Some(Frames::from(b"crafted".to_vec())));
    }
    assert_eq!(log.get(b"a").unwrap(), Some(one(b"a", 100)));
    assert_eq!(log.get(b"b").unwrap(), Some(one(b"b", 100)));
    log.compact().unwrap();
}

/// A segment with many zeroed regions in front of its one sync mark (damage, or a segment built
/// to slow an open down). Each region looks like a clean end; a search past it that walked to the
/// sync mark, reading the rest of the segment again and checksumming every payload on the way, would
/// make one pass per region, an open quadratic in the segment's size. The marks are found once per
/// segment, and each search walks only to the first record after its zeros.
#[test]
fn many_zeroed_regions_before_one_sync_mark_cost_an_open_a_bounded_number_of_passes() {
    let be = SimBackend::new();
    let o = || LogOptions { segment_bytes: 16 << 20, auto_compact: false, ..Default::default() };
    let log = SegmentLog::open(be.clone(), "/s", o()).unwrap();
    let n = 600;
    let keys: Vec<Vec<u8>> = (0..n).map(|i| format!("k{i:04}").into_bytes()).collect();
    for k in &keys {
        log.put(k, &one(k, 12 << 10)).unwrap();
    }
    log.sync().unwrap();
    let locs: Vec<_> = keys.iter().map(|k| log.location(k).unwrap()).collect();
    let seg = locs[0].segment;
    assert!(locs.iter().all(|l| l.segment == seg), "one segment");
    drop(log);
    for l in locs.iter().step_by(2) {
        assert!(l.offset + l.len >= (l.offset / 4096 + 2) * 4096, "{l:?} spans two whole blocks");
        be.poke(&seg_path(seg), l.offset, &vec![0u8; l.len as usize]).unwrap();
    }
    let size = be.file_contents(&seg_path(seg)).unwrap().len() as u64;

    be.record_reads(true);
    let log = SegmentLog::open(be.clone(), "/s", o()).unwrap();
    let read: u64 = be.take_reads().iter().map(|&(_, len)| len as u64).sum();
    be.record_reads(false);
    assert!(read <= 4 * size, "the open read {read} bytes for a segment of {size}");
    for (i, k) in keys.iter().enumerate() {
        let want = if i % 2 == 0 { None } else { Some(one(k, 12 << 10)) };
        assert_eq!(log.get(k).unwrap(), want, "key {i}");
    }
    let report = log.recovery_report();
    assert_eq!(report.truncated_bytes, 0, "{report:?}");
    assert_eq!(report.corrupt.len(), n / 2, "one zeroed region per zeroed record");
}

/// The head of a value's record is torn (garbage where it should be; its payload landed), so
/// recovery searches the record's bytes for the next record. The value's author filled it with
/// records for another key with a winning seq, their checksums right for every salt they could
/// guess. None is taken: the key keeps its value. The same records made with the log's salt (what
/// only a reader of the segment files knows) are taken: the search does look there.
#[test]
fn a_record_forged_inside_a_value_is_not_taken_for_one_after_a_torn_head() {
    for knows_the_salt in [false, true] {
        let be = SimBackend::new();
        let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
        log.put(b"victim", &one(b"victim", 100)).unwrap();
        log.sync().unwrap();
        let salt = salt_in(&be.file_contents(&seg_path(1)).unwrap());
        let guesses = if knows_the_salt {
            vec![salt]
        } else {
            vec![Salt(0), Salt(1), Salt(u64::MAX), Salt(salt.0 ^ 1), Salt(salt.0.rotate_left(32))]
        };
        let mut payload = Vec::new();
        for (i, guess) in guesses.iter().enumerate() {
            payload.extend(crafted_record(b"victim", b"forged", 1, 1, (1 << 40) + i as u64, *guess));
        }
        log.put(b"author", &Frames::from(payload)).unwrap();
        log.sync().unwrap();
        let at = log.location(b"author").unwrap().offset;
        drop(log);
        be.poke(&seg_path(1), at, &[0xA5; 64]).unwrap();

        let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
        let victim = log.get(b"victim").unwrap();
        if knows_the_salt {
            assert_eq!(victim, Some(Frames::from(b"forged".to_vec())), "the search never looked inside the value");
        } else {
            assert_eq!(victim, Some(one(b"victim", 100)), "{:?}", log.recovery_report());
            assert!(log.recovery_report().corrupt.iter().any(|c| c.1 == at), "{:?}", log.recovery_report());
        }
    }
}

/// A record (crc-valid: damage, or the work of someone who can write the segment files) whose seq
/// is `u64::MAX` would make the next seq wrap to 0, so that every later write lost to older records;
/// one whose epoch is `u32::MAX` would fail every later open ("epoch counter exhausted"). Either
/// opens the log read-only instead, every value readable, and keeps opening.
#[test]
fn a_record_with_an_exhausted_seq_or_epoch_opens_the_log_read_only() {
    for (seq, epoch) in [(u64::MAX, 1), (1 << 63, 1), (7, u32::MAX)] {
        let be = SimBackend::new();
        let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
        log.put(b"a", &one(b"a", 100)).unwrap();
        let a = log.location(b"a").unwrap();
        drop(log); // no sync: "a" ends the records
        let salt = salt_in(&be.file_contents(&seg_path(1)).unwrap());
        let at = format::align_up(a.offset + a.len, 64);
        be.poke(&seg_path(1), at, &crafted_record(b"max", b"max", 1, epoch, seq, salt)).unwrap();

        for _ in 0..2 {
            let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
            let why = log.poisoned().unwrap_or_else(|| panic!("seq {seq}, epoch {epoch}: writable"));
            assert!(why.contains("read-only") && why.contains("new records"), "{why}");
            assert_eq!(log.get(b"a").unwrap(), Some(one(b"a", 100)));
            assert_eq!(log.get(b"max").unwrap(), Some(Frames::from(b"max".to_vec())));
            assert!(matches!(log.put(b"b", &one(b"b", 10)), Err(Error::Poisoned { .. })));
            assert!(matches!(log.delete(b"a"), Err(Error::Poisoned { .. })));
        }
    }
    // One below the limit is a log like any other.
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"a", &one(b"a", 100)).unwrap();
    let a = log.location(b"a").unwrap();
    drop(log);
    let salt = salt_in(&be.file_contents(&seg_path(1)).unwrap());
    let at = format::align_up(a.offset + a.len, 64);
    be.poke(&seg_path(1), at, &crafted_record(b"max", b"max", 1, 1, (1 << 63) - 1, salt)).unwrap();
    let log = SegmentLog::open(be, "/s", opts()).unwrap();
    assert_eq!(log.poisoned(), None);
    log.put(b"max", &one(b"max", 10)).unwrap();
    assert_eq!(log.get(b"max").unwrap(), Some(one(b"max", 10)), "the new record wins");
}

/// A segment file copied in from another log: its records verify with its own salt only, so
/// taking it for one of this log's would lose them all. The open fails and says why.
#[test]
fn a_segment_of_another_log_fails_the_open_with_an_error_that_says_so() {
    let be = SimBackend::new();
    let other = SegmentLog::open(be.clone(), "/other", opts()).unwrap();
    let mut i = 0;
    while other.stats().sealed_segments == 0 {
        other.put(format!("o{i}").as_bytes(), &one(b"o", 4000)).unwrap();
        i += 1;
    }
    other.sync().unwrap();
    drop(other);
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"a", &one(b"a", 100)).unwrap();
    log.sync().unwrap();
    drop(log);
    let bytes = be.file_contents(&PathBuf::from("/other/segments/00000002.seg")).unwrap();
    let copy = seg_path(2);
    let f = be.open(&copy, true).unwrap();
    be.allocate(&f, bytes.len() as u64).unwrap();
    drop(f);
    be.poke(&copy, 0, &bytes).unwrap();

    let e = SegmentLog::open(be.clone(), "/s", opts()).err().expect("the open fails");
    assert!(e.to_string().contains("different logs"), "{e}");
    be.remove_file(&copy).unwrap();
    let log = SegmentLog::open(be, "/s", opts()).unwrap();
    assert_eq!(log.get(b"a").unwrap(), Some(one(b"a", 100)));
}

/// The index holds offsets in 32 bits, and a segment header may claim a little over 4 GiB (a
/// jumbo segment's size). A footer (trailer and footer crcs valid) that lists a record past 4 GiB
/// would have it indexed at its offset modulo 2^32: here another key's record, whose bytes a read of
/// the far key would then return (a panic in debug builds). It is damage, and the other records read.
/// A real file, sparse: the 4 GiB cost no disk and no memory.
#[test]
fn a_record_past_what_the_index_addresses_is_damage() {
    use std::os::unix::fs::FileExt;
    let tmp = tempfile::tempdir().unwrap();
    let o = || LogOptions { segment_bytes: 64 * 1024, auto_compact: false, ..Default::default() };
    let log = SegmentLog::open(spillway::PortableBackend::new(), tmp.path(), o()).unwrap();
    log.put(b"a", &one(b"a", 100)).unwrap();
    log.sync().unwrap();
    let a = log.location(b"a").unwrap();
    drop(log);
    let path = tmp.path().join("segments/00000001.seg");
    let file = std::fs::OpenOptions::new().read(true).write(true).open(&path).unwrap();
    let read = |at: u64, n: usize| {
        let mut b = vec![0u8; n];
        file.read_exact_at(&mut b, at).unwrap();
        b
    };
    let mut h = format::decode_segment_header(&read(0, format::SEGMENT_HEADER_LEN)).unwrap();
    let ra = format::peek_record_header(&read(a.offset, format::RECORD_HEADER_LEN)).unwrap();
    h.segment_bytes = (1 << 32) + (128 << 10);
    file.write_all_at(&format::encode_segment_header(&h), 0).unwrap();
    file.set_len(h.segment_bytes).unwrap();
    // "a" where it is, and "far" as a copy of it 4 GiB further on.
    let entry = |key: &[u8], offset: u64| FooterEntry {
        key: key.to_vec(),
        flags: ra.flags,
        frame_count: ra.frame_count,
        payload_crc: ra.payload_crc,
        offset,
        record_len: a.len,
        seq: ra.seq + offset / 4096,
        aux: ra.aux,
    };
    let far = (1u64 << 32) + a.offset;
    let mut footer = Vec::new();
    format::encode_footer_entry(&mut footer, &entry(b"a", a.offset));
    format::encode_footer_entry(&mut footer, &entry(b"far", far));
    let footer_offset = h.segment_bytes - (64 << 10);
    let trailer = format::Trailer {
        segment: 1,
        max_epoch: 1,
        footer_offset,
        footer_len: footer.len() as u64,
        entry_count: 2,
        data_end: format::align_up(far + a.len, 64),
        footer_crc: format::footer_crc(&footer),
        salt: h.salt,
    };
    file.write_all_at(&footer, footer_offset).unwrap();
    file.write_all_at(&format::encode_trailer(&trailer), h.segment_bytes - format::TRAILER_LEN as u64).unwrap();
    drop(file);

    let log = SegmentLog::open(spillway::PortableBackend::new(), tmp.path(), o()).unwrap();
    assert_eq!(log.recovery_report().sealed_segments, 1, "read through its footer");
    assert!(log.recovery_report().corrupt.iter().any(|c| c.0 == 1 && c.1 == far), "{:?}", log.recovery_report());
    assert_eq!(log.get(b"far").unwrap(), None);
    assert_eq!(log.get(b"a").unwrap(), Some(one(b"a", 100)));
    log.put(b"b", &one(b"b", 100)).unwrap();
    log.sync().unwrap();
    assert_eq!(log.get(b"b").unwrap(), Some(one(b"b", 100)));
}

/// A segment header of format version 3 (which has no salt), its crc valid: the open fails with
/// `UnsupportedVersion` naming both versions, and leaves the file as it was.
#[test]
fn a_store_of_the_previous_format_version_is_refused_with_a_clear_error() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"a", &one(b"a", 100)).unwrap();
    log.sync().unwrap();
    drop(log);
    let mut head = be.file_contents(&seg_path(1)).unwrap()[..format::SEGMENT_HEADER_LEN].to_vec();
    head[8..12].copy_from_slice(&3u32.to_le_bytes());
    head[40..48].fill(0); // reserved in version 3
    let crc = format::payload_crc(&head[..60]); // (the plain crc32 of the bytes)
    head[60..64].copy_from_slice(&crc.to_le_bytes());
    be.poke(&seg_path(1), 0, &head).unwrap();
    let before = be.file_contents(&seg_path(1)).unwrap();

    let e = SegmentLog::open(be.clone(), "/s", opts()).err().expect("the open fails");
    assert!(matches!(e, Error::UnsupportedVersion { found: 3, supported: 4, .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains('3') && msg.contains('4'), "{msg}");
    assert!(be.file_contents(&seg_path(1)).unwrap() == before, "the refused store is left as it was");
}

/// The log's one segment, its header block zeroed (the only copy of the salt: an unsealed segment
/// has no trailer). Its records cannot be verified under a fresh salt, so a durable log could take
/// them for a torn tail, erase them and write over them. They are left as they are, and writing goes
/// on in a new segment.
#[test]
fn records_under_a_lost_salt_are_left_as_they_are() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"a", &one(b"a", 3000)).unwrap();
    log.sync().unwrap();
    drop(log);
    be.poke(&seg_path(1), 0, &[0u8; format::SEGMENT_HEADER_LEN]).unwrap();
    let before = be.file_contents(&seg_path(1)).unwrap();

    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    assert_eq!(log.get(b"a").unwrap(), None, "unverifiable under the new salt");
    log.put(b"b", &one(b"b", 100)).unwrap();
    log.sync().unwrap();
    assert_eq!(log.location(b"b").unwrap().segment, 2, "a new segment");
    drop(log);
    let after = be.file_contents(&seg_path(1)).unwrap();
    assert!(after[4096..] == before[4096..], "the records are not erased or written over");
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    assert_eq!(log.get(b"b").unwrap(), Some(one(b"b", 100)));
    assert!(be.file_contents(&seg_path(1)).unwrap()[4096..] == before[4096..]);
}

/// The log's one segment has a torn header and no records (a crash right after it was created).
/// Continued with a salt drawn at that open, its new records would be written under a salt no
/// header held, and the next open (drawing another) could verify none of them: acknowledged values
/// lost. The empty segment is removed (kept, it would be reported as damage at every open, and by
/// `verify`), and writing goes on in a new segment, whose header holds the salt.
#[test]
fn a_segment_with_a_damaged_header_is_not_continued() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"a", &one(b"a", 100)).unwrap();
    log.sync().unwrap();
    drop(log);
    let len = be.file_contents(&seg_path(1)).unwrap().len();
    be.poke(&seg_path(1), 0, &vec![0u8; len]).unwrap(); // header and records gone: zeros

    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    assert!(log.recovery_report().corrupt.is_empty(), "a creation cut short is not damage");
    assert!(be.file_contents(&seg_path(1)).is_none(), "the segment that never got its header is gone");
    log.put(b"b", &one(b"b", 100)).unwrap();
    log.sync().unwrap();
    assert_ne!(log.location(b"b").unwrap().segment, 1, "not in the segment without a header");
    drop(log);
    let log = SegmentLog::open(be.crash(None), "/s", opts()).unwrap();
    assert_eq!(log.get(b"b").unwrap(), Some(one(b"b", 100)), "the synced value, after a power cut");
}

/// The bytes of a value streamed in, endless, until `left` of them were read: then the process dies
/// (every disk operation from then on fails, the removal of what it was writing included), while
/// the bytes keep coming.
struct DiesAfter<'a> {
    be: &'a SimBackend,
    left: usize,
}

impl std::io::Read for DiesAfter<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.left == 0 {
            self.be.inject(Fault { op: FaultOp::Any, after: 0, kind: FaultKind::Eio, sticky: true });
            self.left = usize::MAX;
        }
        let n = buf.len().min(self.left);
        buf[..n].fill(0x5a);
        self.left -= n;
        Ok(n)
    }
}

/// A value streamed into a segment of its own has the size it announces in the segment's header,
/// and its space reserved as its bytes arrive, 64 MiB ahead of them. A process killed part-way
/// leaves a file shorter than its header says, its one record torn. The next open removes it: it is
/// neither extended to the size announced (up to 4 GiB) nor continued as an active segment of that
/// size. The acknowledged values read back, and writing goes on in a segment of the usual size.
#[test]
fn a_streamed_segment_cut_short_is_removed_not_grown_to_its_announced_size() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"kept", &one(b"kept", 3000)).unwrap();
    log.sync().unwrap();
    // Just over what is reserved ahead of a stream's bytes: its file is shorter than announced.
    let n = (64 << 20) + (1 << 20);
    let meta = StreamedValue { lz4: false, frame_lens: vec![n], raw_len: n, stored_len: n, payload_crc: 0 };
    assert!(log.put_stream(b"big", &meta, &mut DiesAfter { be: &be, left: 2 << 20 }).is_err());
    drop(log);
    be.clear_faults();
    let torn = seg_path(2);
    let len = be.file_len(&be.open(&torn, false).unwrap()).unwrap();
    assert!(len < n, "the stream's file ({len} bytes) is shorter than the value it announced");

    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    assert!(!be.files().contains(&torn), "the segment of the stream cut short is removed");
    assert_eq!(log.get(b"kept").unwrap(), Some(one(b"kept", 3000)));
    assert_eq!(log.get(b"big").unwrap(), None);
    assert!(log.stats().disk_bytes <= opts().segment_bytes, "{:?}", log.stats());
    log.put(b"after", &one(b"after", 3000)).unwrap();
    assert_ne!(log.location(b"after").unwrap().segment, 2, "not in the stream's segment");
    log.sync().unwrap();
    drop(log);
    let log = SegmentLog::open(be, "/s", opts()).unwrap();
    assert_eq!(log.get(b"kept").unwrap(), Some(one(b"kept", 3000)));
    assert_eq!(log.get(b"after").unwrap(), Some(one(b"after", 3000)));
}
