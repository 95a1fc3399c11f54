//! Hole punching of forgotten records (`LogOptions::punch_forgotten`, on for spill stores): a large
//! forgotten record's blocks are released at once, neighbours are untouched, and a reopened log steps
//! over the punched record instead of losing what follows it.

use std::os::unix::fs::MetadataExt;

use spillway::{Backend, LogOptions, PortableBackend, SegmentLog, SimBackend};
use spillway_tests::frames_for;

fn opts() -> LogOptions {
    LogOptions { punch_forgotten: true, durable: false, segment_bytes: 16 << 20, ..Default::default() }
}

/// Puts big `a`, small `b`, big `c`, small `d`; forgets `a` and `c`; returns the keys kept.
fn workload<B: Backend>(log: &SegmentLog<B>) {
    log.put(b"a", &frames_for(b"a", 3 << 20)).unwrap();
    log.put(b"b", &frames_for(b"b", 5000)).unwrap();
    log.put(b"c", &frames_for(b"c", (1 << 20) + 123)).unwrap();
    log.put(b"d", &frames_for(b"d", 300)).unwrap();
    assert!(log.forget(b"a").unwrap());
    assert!(log.forget(b"c").unwrap());
}

/// 512-byte blocks allocated to the segment files under `dir`.
fn segment_blocks(dir: &std::path::Path) -> u64 {
    std::fs::read_dir(dir.join("segments")).unwrap().map(|e| e.unwrap().metadata().unwrap().blocks()).sum()
}

fn check_kept<B: Backend>(log: &SegmentLog<B>) {
    assert_eq!(log.get(b"b").unwrap(), Some(frames_for(b"b", 5000)));
    assert_eq!(log.get(b"d").unwrap(), Some(frames_for(b"d", 300)));
}

#[test]
fn forgetting_a_large_record_releases_its_blocks_on_disk() {
    let tmp = tempfile::tempdir().unwrap();
    let blocks = || segment_blocks(tmp.path());
    let log = SegmentLog::open(PortableBackend::new(), tmp.path(), opts()).unwrap();
    log.put(b"a", &frames_for(b"a", 3 << 20)).unwrap();
    log.put(b"b", &frames_for(b"b", 5000)).unwrap();
    let before = blocks();
    assert!(log.forget(b"a").unwrap());
    log.settle_punches();
    let after = blocks();
    // 512-byte blocks: about 3 MiB fewer (the record's head block and partial blocks stay).
    assert!(before - after >= (3 << 20) / 512 - 16, "released {} of {before} blocks", before - after);
    assert_eq!(log.get(b"a").unwrap(), None);
    assert_eq!(log.get(b"b").unwrap(), Some(frames_for(b"b", 5000)));
    // Without the option, forgetting releases nothing until the segment dies.
    let tmp2 = tempfile::tempdir().unwrap();
    let log2 =
        SegmentLog::open(PortableBackend::new(), tmp2.path(), LogOptions { punch_forgotten: false, ..opts() }).unwrap();
    log2.put(b"a", &frames_for(b"a", 3 << 20)).unwrap();
    log2.put(b"b", &frames_for(b"b", 5000)).unwrap();
    let blocks2 = || segment_blocks(tmp2.path());
    let before2 = blocks2();
    log2.forget(b"a").unwrap();
    log2.settle_punches();
    assert_eq!(blocks2(), before2);
}

/// A large value alone in the active segment (a spill of one big value, then its unspill): forgetting
/// it empties the segment, which is not deleted while it is active, so its blocks are punched all
/// the same. (Otherwise they would stay, on disk and dirty in the page cache, until the next write
/// sealed it.)
#[test]
fn forgetting_the_last_record_of_the_active_segment_releases_its_blocks() {
    let tmp = tempfile::tempdir().unwrap();
    let blocks = || segment_blocks(tmp.path());
    let log = SegmentLog::open(PortableBackend::new(), tmp.path(), opts()).unwrap();
    log.put(b"big", &frames_for(b"big", 3 << 20)).unwrap();
    let before = blocks();
    assert!(log.forget(b"big").unwrap());
    log.settle_punches();
    let released = before - blocks();
    assert!(released >= (3 << 20) / 512 - 16, "released {released} of {before} blocks");
    log.put(b"next", &frames_for(b"next", 100)).unwrap();
    assert_eq!(log.get(b"next").unwrap(), Some(frames_for(b"next", 100)));
}

#[test]
fn neighbours_survive_and_a_reopened_log_steps_over_punched_records() {
    // Real files.
    let tmp = tempfile::tempdir().unwrap();
    let log = SegmentLog::open(PortableBackend::new(), tmp.path(), opts()).unwrap();
    workload(&log);
    check_kept(&log);
    // Punched records are dead, not damage.
    let problems = log.verify().unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    log.sync().unwrap();
    drop(log);
    let log = SegmentLog::open(PortableBackend::new(), tmp.path(), opts()).unwrap();
    check_kept(&log);
    for k in [&b"a"[..], b"c"] {
        // A forgotten record may come back (no tombstone), but never as other bytes.
        if let Ok(Some(f)) = log.get(k) {
            panic!("{k:?} came back readable with {} bytes", f.total_len());
        }
    }
    // Simulated disk, where a punch writes zeros.
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/p", opts()).unwrap();
    workload(&log);
    check_kept(&log);
    let problems = log.verify().unwrap();
    assert!(problems.is_empty(), "{problems:?}");
    log.sync().unwrap();
    drop(log);
    let log = SegmentLog::open(be, "/p", opts()).unwrap();
    check_kept(&log);
}

#[test]
fn discard_existing_opens_empty() {
    let tmp = tempfile::tempdir().unwrap();
    let log = SegmentLog::open(PortableBackend::new(), tmp.path(), opts()).unwrap();
    workload(&log);
    drop(log);
    let log =
        SegmentLog::open(PortableBackend::new(), tmp.path(), LogOptions { discard_existing: true, ..opts() }).unwrap();
    assert!(log.is_empty());
    assert_eq!(std::fs::read_dir(tmp.path().join("segments")).unwrap().count(), 0, "old segments deleted");
    log.put(b"x", &frames_for(b"x", 10)).unwrap();
    assert_eq!(log.get(b"x").unwrap(), Some(frames_for(b"x", 10)));
}

/// Discarding deletes segment files only. A file of someone else's in `segments/` is left alone,
/// also one whose name is not UTF-8 (its lossy name would not open, which would fail the open).
#[test]
fn discard_existing_leaves_other_files_alone() {
    use std::os::unix::ffi::OsStrExt;
    let tmp = tempfile::tempdir().unwrap();
    let log = SegmentLog::open(PortableBackend::new(), tmp.path(), opts()).unwrap();
    workload(&log);
    drop(log);
    let seg = tmp.path().join("segments");
    let odd = seg.join(std::ffi::OsStr::from_bytes(b"not-utf8-\xff.seg"));
    std::fs::write(&odd, b"theirs").unwrap();
    std::fs::write(seg.join("notes.txt"), b"theirs too").unwrap();
    let log =
        SegmentLog::open(PortableBackend::new(), tmp.path(), LogOptions { discard_existing: true, ..opts() }).unwrap();
    assert!(log.is_empty());
    let mut left: Vec<_> = std::fs::read_dir(&seg).unwrap().map(|e| e.unwrap().file_name()).collect();
    left.sort();
    assert_eq!(left, [odd.file_name().unwrap().to_owned(), std::ffi::OsString::from("notes.txt")]);
    assert_eq!(std::fs::read(&odd).unwrap(), b"theirs");
    log.put(b"x", &frames_for(b"x", 10)).unwrap();
    assert_eq!(log.get(b"x").unwrap(), Some(frames_for(b"x", 10)));
}

/// A punch that fails (EIO, a full disk, or a punch torn half-way) is advisory: `forget` still
/// succeeds, the log stays writable, the neighbours read back, `verify` finds nothing wrong, and a
/// reopened log (a clean one, and one after a power cut) has every kept key.
#[test]
fn a_failed_punch_changes_nothing_but_the_space() {
    use spillway::backend::{Fault, FaultKind, FaultOp};
    for kind in [FaultKind::Eio, FaultKind::Enospc, FaultKind::TornWrite] {
        let be = SimBackend::new();
        let log = SegmentLog::open(be.clone(), "/p", opts()).unwrap();
        be.inject(Fault { op: FaultOp::Punch, after: 0, kind, sticky: true });
        workload(&log);
        assert!(be.fault_fired(), "{kind:?}: the punches were attempted");
        check_kept(&log);
        assert_eq!(log.get(b"a").unwrap(), None);
        log.put(b"e", &frames_for(b"e", 7000)).unwrap();
        let problems = log.verify().unwrap();
        assert!(problems.is_empty(), "{kind:?}: {problems:?}");
        log.sync().unwrap();
        drop(log);
        for be in [be.clone(), be.crash(None)] {
            let log = SegmentLog::open(be, "/p", opts()).unwrap();
            check_kept(&log);
            assert_eq!(log.get(b"e").unwrap(), Some(frames_for(b"e", 7000)), "{kind:?}");
        }
    }
}

/// A value being sent to a peer (`stored_value`, then reads of its payload from the file) whose key
/// is forgotten meanwhile is still sent whole: the punch that would release its blocks waits for the
/// segment to go. Punching them at once would zero them under the sender, which the receiver would
/// take for damage. A key forgotten before its stored form is taken is absent.
#[test]
fn a_record_being_sent_is_not_punched_under_the_sender() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/p", opts()).unwrap();
    let v = frames_for(b"big", 3 << 20);
    log.put(b"big", &v).unwrap();
    log.put(b"other", &frames_for(b"other", 5000)).unwrap();
    let sv = log.stored_value(b"big").unwrap().unwrap();
    assert!(log.forget(b"big").unwrap());
    let sent = log.read_stored(&sv).unwrap();
    assert_eq!(spillway::format::payload_crc(&sent), sv.meta.payload_crc, "the payload was punched while being sent");
    drop(sv);
    assert!(log.stored_value(b"big").unwrap().is_none());
    // Without a send in progress, a forget still punches (the simulated disk zeroes the blocks).
    log.put(b"big2", &frames_for(b"big2", 3 << 20)).unwrap();
    let loc = log.location(b"big2").unwrap();
    let file =
        be.files().into_iter().find(|f| f.to_string_lossy().ends_with(&format!("{:08x}.seg", loc.segment))).unwrap();
    let middle =
        |be: &SimBackend| be.file_contents(&file).unwrap()[(loc.offset + (1 << 20)) as usize..][..4096].to_vec();
    assert!(middle(&be).iter().any(|&b| b != 0));
    assert!(log.forget(b"big2").unwrap());
    assert!(middle(&be).iter().all(|&b| b == 0), "not punched");
}

/// A get racing a forget of the same key returns the value or nothing, never damage: the forget
/// may punch the record's blocks while the get is reading them, and the get then finds the key gone
/// instead of reporting a checksum error. Both read paths: `get` and `get_pipelined`.
#[test]
fn a_get_racing_a_forget_sees_the_value_or_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let log = SegmentLog::open(PortableBackend::new(), tmp.path(), opts()).unwrap();
    let value = frames_for(b"k", 512 << 10);
    let done = std::sync::atomic::AtomicBool::new(false);
    let (mut found, mut absent) = (0u32, 0u32);
    std::thread::scope(|s| {
        s.spawn(|| {
            for _ in 0..300 {
                log.put(b"k", &value).unwrap();
                assert!(log.forget(b"k").unwrap());
            }
            done.store(true, std::sync::atomic::Ordering::SeqCst);
        });
        let mut check = |got: spillway::Result<Option<spillway::Frames>>| match got {
            Ok(Some(v)) => {
                assert!(v == value, "a value read back whole is the value put");
                found += 1;
            }
            Ok(None) => absent += 1,
            Err(e) => panic!("a get racing a forget reported {e}"),
        };
        while !done.load(std::sync::atomic::Ordering::SeqCst) {
            check(log.get(b"k"));
            let mut keys = std::iter::once(b"k".to_vec());
            log.get_pipelined(4, &mut keys, &mut |_, got| check(got)).unwrap();
        }
    });
    println!("{found} found, {absent} absent");
}

/// The segment file of the lowest id under `dir`, and its 512-byte blocks.
fn first_segment_blocks(dir: &std::path::Path) -> u64 {
    let mut files: Vec<_> = std::fs::read_dir(dir.join("segments")).unwrap().map(|e| e.unwrap().path()).collect();
    files.sort();
    std::fs::metadata(&files[0]).unwrap().blocks()
}

/// A segment sealed because the next record did not fit leaves the rest of its preallocated space
/// unused. A log that punches releases that space at the seal, and so does not count it as dead:
/// compaction leaves the segment's live records where they are. A log that does not punch reclaims
/// the space by compacting, moving them.
#[test]
fn a_segment_sealed_early_releases_its_unused_space_instead_of_being_compacted() {
    for punch in [true, false] {
        let tmp = tempfile::tempdir().unwrap();
        let o = LogOptions { punch_forgotten: punch, auto_compact: false, ..opts() };
        let log = SegmentLog::open(PortableBackend::new(), tmp.path(), o).unwrap();
        log.put(b"a", &frames_for(b"a", 7 << 20)).unwrap();
        // 10 MiB does not fit in the 16 MiB segment after `a`: the segment is sealed, 7/16 live.
        log.put(b"b", &frames_for(b"b", 10 << 20)).unwrap();
        log.settle_punches();
        let blocks = first_segment_blocks(tmp.path());
        let stats = log.compact().unwrap();
        if punch {
            assert!(blocks * 512 < (7 << 20) + (1 << 20), "the sealed segment keeps {blocks} blocks");
            assert_eq!(stats.records_moved, 0, "{stats:?}");
        } else {
            assert!(blocks * 512 >= 16 << 20, "the sealed segment keeps {blocks} blocks");
            assert_eq!(stats.records_moved, 1, "{stats:?}");
        }
        assert_eq!(log.get(b"a").unwrap(), Some(frames_for(b"a", 7 << 20)));
        assert_eq!(log.get(b"b").unwrap(), Some(frames_for(b"b", 10 << 20)));
    }
}
