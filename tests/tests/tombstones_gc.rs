//! Deletes, overwrites and garbage collection across reopen.

use std::collections::BTreeMap;

use spillway::backend::{Fault, FaultKind, FaultOp};
use spillway::{CompactionPolicy, Frames, LogOptions, PortableBackend, SegmentLog, SimBackend};
use spillway_tests::{frames_for, streamed, Rng};

const SEG: u64 = 64 * 1024;

fn opts() -> LogOptions {
    LogOptions { segment_bytes: SEG, auto_compact: false, ..Default::default() }
}

#[test]
fn deleted_keys_stay_deleted_and_overwrites_keep_the_newest() {
    let tmp = tempfile::tempdir().unwrap();
    {
        let log = SegmentLog::open(PortableBackend::new(), tmp.path(), opts()).unwrap();
        // `old` lives in the first segment, which stays alive because `pinned` is next to it.
        log.put(b"old", &Frames::from(b"v1".to_vec())).unwrap();
        log.put(b"pinned", &Frames::from(b"p".to_vec())).unwrap();
        for i in 0..200 {
            let k = format!("filler-{i}").into_bytes();
            log.put(&k, &frames_for(&k, 1000)).unwrap();
        }
        // Overwrite several times across segments, then delete `old` from a later segment.
        for v in 2..6u8 {
            log.put(b"over", &Frames::from(vec![v; 3000])).unwrap();
            for i in 0..20 {
                log.put(format!("more-{v}-{i}").as_bytes(), &Frames::from(vec![0u8; 1000])).unwrap();
            }
        }
        assert!(log.delete(b"old").unwrap());
        assert!(log.location(b"pinned").unwrap().segment < log.location(b"over").unwrap().segment);
    }
    let log = SegmentLog::open(PortableBackend::new(), tmp.path(), opts()).unwrap();
    assert_eq!(log.get(b"old").unwrap(), None, "a deleted key came back after reopen");
    assert_eq!(log.get(b"over").unwrap().unwrap().concat(), vec![5u8; 3000]);
    assert_eq!(log.get(b"pinned").unwrap().unwrap().concat(), &b"p"[..]);
    // Compaction must carry the needed tombstone along: `old` stays deleted after compact + reopen.
    for i in 0..200 {
        log.delete(format!("filler-{i}").as_bytes()).unwrap();
    }
    log.compact().unwrap();
    drop(log);
    let log = SegmentLog::open(PortableBackend::new(), tmp.path(), opts()).unwrap();
    assert_eq!(log.get(b"old").unwrap(), None, "a deleted key came back after compaction");
    assert_eq!(log.get(b"pinned").unwrap().unwrap().concat(), &b"p"[..]);
}

#[test]
fn a_segment_with_nothing_live_is_deleted() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    for i in 0..100 {
        log.put(format!("a-{i}").as_bytes(), &Frames::from(vec![1u8; 2000])).unwrap();
    }
    let first = log.location(b"a-0").unwrap().segment;
    let first_path = std::path::Path::new("/s/segments").join(format!("{first:08x}.seg"));
    assert!(be.files().contains(&first_path));
    let in_first: Vec<String> =
        (0..100).map(|i| format!("a-{i}")).filter(|k| log.location(k.as_bytes()).unwrap().segment == first).collect();
    for k in &in_first {
        log.delete(k.as_bytes()).unwrap();
    }
    assert!(!be.files().contains(&first_path), "an all-dead segment must be deleted");
    drop(log);
    let log = SegmentLog::open(be, "/s", opts()).unwrap();
    for i in 0..100 {
        let k = format!("a-{i}");
        assert_eq!(log.get(k.as_bytes()).unwrap().is_some(), !in_first.contains(&k));
    }
}

/// The bound `CompactionPolicy` documents: after `compact`, no closed segment is sparse, so disk
/// bytes stay within `disk_bound(live)` (twice the live bytes plus one segment by default, 4/3 of them
/// at 75 percent). The same deletes leave less on disk under the stricter policy.
#[test]
fn compaction_brings_disk_use_within_the_documented_bound() {
    let mut after = Vec::new();
    for policy in [CompactionPolicy::default(), CompactionPolicy { min_live_percent: 75 }] {
        let tmp = tempfile::tempdir().unwrap();
        let opts = || LogOptions { compaction: policy, ..opts() };
        let log = SegmentLog::open(PortableBackend::new(), tmp.path(), opts()).unwrap();
        let mut rng = Rng::new(5);
        let mut live: BTreeMap<Vec<u8>, usize> = BTreeMap::new();
        for i in 0..3000 {
            let k = format!("k-{i}").into_bytes();
            let s = 200 + rng.below(3000) as usize;
            log.put(&k, &frames_for(&k, s)).unwrap();
            live.insert(k, s);
        }
        let full = log.stats();
        let keys: Vec<Vec<u8>> = live.keys().cloned().collect();
        for k in keys {
            if rng.below(10) < 7 {
                assert!(log.delete(&k).unwrap());
                live.remove(&k);
            }
        }
        let c = log.compact().unwrap();
        let s = log.stats();
        assert!(c.segments_deleted > 0 && c.bytes_freed > 0, "{c:?}");
        let bound = policy.disk_bound(s.live_bytes, SEG);
        assert!(s.disk_bytes <= bound, "{policy:?}: disk {} > bound {bound}: {s:?}", s.disk_bytes);
        assert!(s.disk_bytes < full.disk_bytes, "disk use must drop: before {full:?}, after {s:?}");
        let on_disk: u64 =
            std::fs::read_dir(tmp.path().join("segments")).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum();
        assert_eq!(on_disk, s.disk_bytes, "stats must match the files");
        for (k, sz) in &live {
            assert_eq!(log.get(k).unwrap(), Some(frames_for(k, *sz)));
        }
        drop(log);
        let log = SegmentLog::open(PortableBackend::new(), tmp.path(), opts()).unwrap();
        assert_eq!(log.len(), live.len());
        for (k, sz) in &live {
            assert_eq!(log.get(k).unwrap(), Some(frames_for(k, *sz)));
        }
        assert!(log.verify().unwrap().is_empty());
        after.push(s.disk_bytes);
    }
    assert!(after[1] < after[0], "75 percent must leave less on disk than 50: {after:?}");
}

/// A compaction policy outside 1..=99 percent is refused at open.
#[test]
fn a_compaction_policy_out_of_range_is_refused() {
    for min_live_percent in [0, 100, 255] {
        let opts = LogOptions { compaction: CompactionPolicy { min_live_percent }, ..opts() };
        match SegmentLog::open(SimBackend::new(), "/s", opts) {
            Err(spillway::Error::InvalidConfig(msg)) => assert!(msg.contains("min_live_percent"), "{msg}"),
            other => panic!("{min_live_percent}: {:?}", other.map(|_| ())),
        }
    }
}

/// A spill-like workload where keys come and go, except one in 40 that stays: every segment keeps
/// a little live data, so no segment ever empties on its own and only compaction can reclaim the
/// rest. With automatic compaction disk use stays within the documented bound; without it (the
/// control) it does not.
#[test]
fn automatic_compaction_keeps_a_churning_store_bounded() {
    for auto_compact in [true, false] {
        let be = SimBackend::new();
        let log = SegmentLog::open(be, "/s", LogOptions { auto_compact, ..opts() }).unwrap();
        let mut rng = Rng::new(1);
        let stays = |i: u64| i % 40 == 0;
        for i in 0..5000u64 {
            let k = format!("k-{i}");
            log.put(k.as_bytes(), &Frames::from(vec![3u8; 1000 + rng.below(1000) as usize])).unwrap();
            if i >= 50 && !stays(i - 50) {
                log.delete(format!("k-{}", i - 50).as_bytes()).unwrap();
            }
        }
        let s = log.stats();
        let live = 50 + (0..4950).filter(|&i| stays(i)).count() as u64;
        assert_eq!(s.live_records, live);
        let bounded = s.disk_bytes <= 2 * s.live_bytes + 2 * SEG;
        assert_eq!(bounded, auto_compact, "auto_compact {auto_compact}: {s:?}");
    }
}

/// A key deleted, put again and deleted again must stay deleted after compaction and reopen. The
/// first tombstone shadows the key's oldest copy; the re-put record's own tombstone shadows only
/// segments from the re-put on. Compaction must not drop the first tombstone because the key is
/// live again: the oldest copy would come back (a case the `log_model` fuzz target reaches).
#[test]
fn a_reput_key_deleted_again_stays_deleted_after_compaction() {
    let be = SimBackend::new();
    let opts = || LogOptions { segment_bytes: 64 << 10, ..Default::default() };
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    let v = |n: usize| Frames::from(vec![9u8; n]);
    log.put(b"k", &v(10_000)).unwrap(); // oldest copy, segment 1
    log.put(b"keep-1", &v(40_000)).unwrap(); // keeps segment 1 alive
    for i in 0..4 {
        log.put(format!("fill{i}").as_bytes(), &v(20_000)).unwrap(); // rotate on
    }
    log.delete(b"k").unwrap(); // tombstone shadowing segment 1, in segment S
    log.put(b"k", &v(5_000)).unwrap(); // live again in S, first_segment = S
    for i in 0..4 {
        log.put(format!("after{i}").as_bytes(), &v(20_000)).unwrap(); // seal S
    }
    for i in 0..4 {
        log.delete(format!("fill{i}").as_bytes()).unwrap();
        log.delete(format!("after{i}").as_bytes()).unwrap();
    }
    log.compact().unwrap(); // S is sparse: its live record and needed tombstones move on
    log.delete(b"k").unwrap(); // tombstone shadowing only segments from S on
    for i in 0..4 {
        log.put(format!("more{i}").as_bytes(), &v(20_000)).unwrap();
    }
    log.compact().unwrap();
    log.sync().unwrap();
    assert!(log.get(b"k").unwrap().is_none());
    drop(log);
    let log = SegmentLog::open(be, "/s", opts()).unwrap();
    assert!(log.get(b"k").unwrap().is_none(), "the deleted key's oldest copy came back");
    assert!(log.get(b"keep-1").unwrap().is_some());
}

/// A key overwritten in a later segment than its first copy: its tombstone must shadow back to the
/// first copy's segment (which the log keeps per segment, not in the key's index entry), whether
/// the overwrite was indexed by the write or, after a reopen, by recovery.
#[test]
fn the_tombstone_of_an_overwritten_key_shadows_its_first_copy() {
    for reopen_before_delete in [false, true] {
        let be = SimBackend::new();
        let opts = || LogOptions { segment_bytes: 64 << 10, auto_compact: false, ..Default::default() };
        let mut log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
        let v = |n: usize| Frames::from(vec![7u8; n]);
        log.put(b"k", &v(10_000)).unwrap(); // first copy, segment A
        log.put(b"keep", &v(40_000)).unwrap(); // keeps A alive
        let a = log.location(b"k").unwrap().segment;
        let mut i = 0;
        while log.location(b"k").unwrap().segment == a {
            log.put(format!("fill{i}").as_bytes(), &v(20_000)).unwrap();
            log.put(b"k", &v(3_000)).unwrap(); // the overwrite ends up in a later segment B
            i += 1;
        }
        let b = log.location(b"k").unwrap().segment;
        if reopen_before_delete {
            log.sync().unwrap();
            drop(log);
            log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
        }
        log.delete(b"k").unwrap(); // tombstone in B or later, which must shadow A
        for j in 0..i {
            log.delete(format!("fill{j}").as_bytes()).unwrap();
        }
        // Seal the tombstone's segment, then compact: every segment from B on is sparse or empty,
        // so a tombstone shadowing only from B would be dropped while A still holds the old copy.
        for j in 0..4 {
            log.put(format!("later{j}").as_bytes(), &v(20_000)).unwrap();
        }
        log.compact().unwrap();
        log.sync().unwrap();
        assert!(log.stats().segments >= 2 && log.location(b"keep").unwrap().segment == a);
        assert!(b > a && log.get(b"k").unwrap().is_none());
        drop(log);
        let log = SegmentLog::open(be, "/s", opts()).unwrap();
        assert!(log.get(b"k").unwrap().is_none(), "reopen {reopen_before_delete}: the first copy came back");
        assert!(log.get(b"keep").unwrap().is_some());
    }
}

/// Open descriptors of deleted files under `dir`, from `/proc/self/fd`.
fn deleted_files_held_open(dir: &std::path::Path) -> usize {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|t| t.starts_with(dir) && t.to_string_lossy().ends_with(" (deleted)"))
        .count()
}

/// A deleted segment's file is closed: while a descriptor stays open, an unlinked file keeps its
/// blocks. Sealed segments wait for the next `sync` to fdatasync their footers; were their files
/// kept open until then, a log that is never synced (a spill store's) would keep every dead
/// segment's descriptor, and its disk space, until it closed.
#[test]
fn deleted_segments_give_their_disk_space_back_without_a_sync() {
    for durable in [false, true] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().canonicalize().unwrap();
        let log = SegmentLog::open(PortableBackend::new(), &dir, LogOptions { durable, ..opts() }).unwrap();
        let keys: Vec<Vec<u8>> = (0..300).map(|i| format!("k{i}").into_bytes()).collect();
        for k in &keys {
            log.put(k, &frames_for(k, 1000)).unwrap();
        }
        assert!(log.stats().segments >= 4, "several sealed segments");
        for k in &keys {
            assert!(log.forget(k).unwrap());
        }
        assert!(log.stats().segments <= 1, "dead segments deleted");
        assert_eq!(deleted_files_held_open(&dir), 0, "durable={durable}: deleted segments still open");
    }
}

/// A power cut between sealing a segment and the next `sync` can leave the segment without its
/// footer: recovery finds it unsealed, behind the newest one. Compaction takes it like a sealed one,
/// so the space bound holds. (Skipping it until all of it is dead would break the bound.)
#[test]
fn an_unsealed_segment_behind_the_active_one_is_compacted() {
    use spillway::Backend;
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    let keys: Vec<Vec<u8>> = (0..60).map(|i| format!("k{i}").into_bytes()).collect();
    for k in &keys {
        log.put(k, &frames_for(k, 1000)).unwrap();
    }
    for i in 0..20 {
        let k = format!("next{i}").into_bytes();
        log.put(&k, &frames_for(&k, 4000)).unwrap();
    }
    log.sync().unwrap();
    let first = log.location(&keys[0]).unwrap().segment;
    assert!(log.location(b"next19").unwrap().segment > first, "the workload spans two segments");
    drop(log);
    // The footer's trailer lost, as a power cut before the next sync could leave it.
    let path = format!("/s/segments/{first:08}.seg");
    let f = be.open(std::path::Path::new(&path), false).unwrap();
    let len = be.file_len(&f).unwrap();
    be.write_at(&f, len - 4096, spillway::buf::AlignedBuf::zeroed(4096, 4096)).0.unwrap();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    let report = log.recovery_report();
    assert!(report.scanned_segments >= 2, "{report:?}");
    for k in &keys[5..] {
        assert!(log.delete(k).unwrap());
    }
    let stats = log.compact().unwrap();
    assert!(stats.segments_compacted >= 1, "{stats:?}");
    assert!(log.location(&keys[0]).unwrap().segment > first, "its live records moved");
    for k in &keys[..5] {
        assert_eq!(log.get(k).unwrap(), Some(frames_for(k, 1000)));
    }
    for k in &keys[5..] {
        assert_eq!(log.get(k).unwrap(), None);
    }
}

/// A segment deleted right after a reopen, while what superseded its records sits in the segment
/// that writing continues in, unsynced (the process crashed, or closed without `sync`); then a
/// `sync`. A power cut after it must find the new values: the deletion is durable by then, so the
/// old copies are gone for good. (Were the recovered segment counted as synced, the `sync` would
/// make the deletion durable but not the new values, and every key would be lost.)
#[test]
fn a_segment_deleted_after_a_reopen_loses_nothing_once_synced() {
    let be = SimBackend::new();
    let keys: Vec<Vec<u8>> = (0..40).map(|i| format!("k{i}").into_bytes()).collect();
    {
        let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
        log.put(b"pinned", &frames_for(b"pinned", 100)).unwrap(); // keeps the first segment alive
        for k in &keys {
            log.put(k, &frames_for(k, 1500)).unwrap();
        }
        log.put(b"rotate", &frames_for(b"rotate", 8000)).unwrap();
        assert!(log.location(b"rotate").unwrap().segment > log.location(b"pinned").unwrap().segment);
        log.sync().unwrap();
        // New values of the first segment's keys, in the next one. Not synced.
        for k in &keys {
            log.put(k, &frames_for(b"new", 1500)).unwrap();
        }
    } // closed without a sync
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    let first = log.location(b"pinned").unwrap().segment;
    assert!(log.location(&keys[0]).unwrap().segment > first);
    // Forgetting the last live record writes nothing; the emptied first segment is deleted.
    assert!(log.forget(b"pinned").unwrap());
    assert!(!be.files().iter().any(|p| p.to_string_lossy().ends_with(&format!("{first:08}.seg"))));
    log.sync().unwrap();
    drop(log);
    let log = SegmentLog::open(be.crash(None), "/s", opts()).unwrap();
    for k in &keys {
        assert_eq!(log.get(k).unwrap(), Some(frames_for(b"new", 1500)), "{k:?}");
    }
}

/// A log whose second segment holds the tombstones of `gone-key` and five `other-N` (all put in the
/// first segment, next to `pinned`) and `extra` if given, then is sealed and made sparse (its
/// fillers forgotten) and synced, so compaction wants to empty it. Returns the second segment's id.
fn a_sparse_segment_of_tombstones(log: &SegmentLog<SimBackend>, extra: Option<(&[u8], &Frames)>) -> u32 {
    log.put(b"gone-key", &Frames::from(b"v1".to_vec())).unwrap();
    log.put(b"pinned", &Frames::from(b"p".to_vec())).unwrap();
    for i in 0..5 {
        log.put(format!("other-{i}").as_bytes(), &Frames::from(b"o".to_vec())).unwrap();
    }
    let first = log.location(b"pinned").unwrap().segment;
    let mut fillers = Vec::new();
    let mut fill_past = |segment: u32| {
        while fillers.last().is_none_or(|k: &Vec<u8>| log.location(k).unwrap().segment == segment) {
            let k = format!("filler-{}", fillers.len()).into_bytes();
            log.put(&k, &frames_for(&k, 1000)).unwrap();
            fillers.push(k);
        }
    };
    fill_past(first); // so that the deletes land in the second segment
    assert!(log.delete(b"gone-key").unwrap());
    for i in 0..5 {
        assert!(log.delete(format!("other-{i}").as_bytes()).unwrap());
    }
    if let Some((k, v)) = extra {
        log.put(k, v).unwrap();
    }
    let second = first + 1;
    assert_eq!(log.location(b"pinned").unwrap().segment, first);
    fill_past(second); // seals it
    for k in &fillers {
        if log.location(k).unwrap().segment == second {
            log.forget(k).unwrap();
        }
    }
    log.sync().unwrap();
    second
}

fn seg_path(id: u32) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("/s/segments/{id:08x}.seg"))
}

/// After the damaged-record tests below: a reopen finds every deleted key still deleted.
fn deletes_survive_a_reopen(be: SimBackend) -> SegmentLog<SimBackend> {
    let log = SegmentLog::open(be, "/s", opts()).unwrap();
    assert_eq!(log.get(b"gone-key").unwrap(), None, "a deleted key came back");
    for i in 0..5 {
        assert_eq!(log.get(format!("other-{i}").as_bytes()).unwrap(), None);
    }
    assert_eq!(log.get(b"pinned").unwrap(), Some(Frames::from(b"p".to_vec())));
    log
}

/// A tombstone that compaction cannot move (its bytes are damaged) keeps its segment: skipping it
/// with a warning, counting the segment's tombstones as moved and deleting the segment would bring
/// the deleted key's older value back at the next open. The footer still lists the tombstone, and
/// recovery honours it. The segment's other tombstones are moved once: later compactions leave the
/// segment alone instead of copying them again every time.
#[test]
fn a_damaged_tombstone_keeps_its_segment_through_compaction() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    let second = a_sparse_segment_of_tombstones(&log, None);
    let bytes = be.file_contents(&seg_path(second)).expect("the second segment");
    let at = bytes.windows(8).position(|w| w == b"gone-key").expect("the tombstone's key") as u64;
    be.poke(&seg_path(second), at, b"G").unwrap();
    let moved = log.compact().unwrap().records_moved;
    assert!(moved >= 5, "the other tombstones move ({moved})");
    let tombstones = log.stats().tombstones;
    for _ in 0..2 {
        assert_eq!(log.compact().unwrap().records_moved, 0, "nothing is copied again");
    }
    assert_eq!(log.stats().tombstones, tombstones);
    drop(log);
    deletes_survive_a_reopen(be);
}

/// A live value that compaction cannot move (its bytes are damaged) keeps its segment, as a
/// damaged tombstone does. The segment's other records, its needed tombstones included, are moved
/// once; later compactions leave the segment alone instead of finding it sparse again every time
/// and copying its tombstones again (the tombstones are still needed, and the damaged value still
/// keeps the segment).
#[test]
fn a_damaged_live_value_does_not_make_every_compaction_copy_its_tombstones() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    let hurt_value = frames_for(b"hurt", 500);
    let second = a_sparse_segment_of_tombstones(&log, Some((b"hurt", &hurt_value)));
    let hurt = log.location(b"hurt").unwrap();
    assert_eq!(hurt.segment, second);
    be.poke(&seg_path(second), hurt.offset + hurt.len - 1, &[0xee]).unwrap();
    let moved = log.compact().unwrap().records_moved;
    assert!(moved >= 6, "the tombstones move ({moved})");
    let tombstones = log.stats().tombstones;
    for round in 2..4 {
        assert_eq!(log.compact().unwrap().records_moved, 0, "compaction {round} copies nothing again");
    }
    assert_eq!(log.stats().tombstones, tombstones);
    assert_eq!(log.get(b"hurt").unwrap_err().location(), Some((second, hurt.offset)));
    drop(log);
    let log = deletes_survive_a_reopen(be);
    assert_eq!(log.get(b"hurt").unwrap_err().location(), Some((second, hurt.offset)));
}

/// The bytes of a value streamed in (`payload`), whose first read runs `meanwhile` (once): what
/// other threads do while the value arrives.
struct Meanwhile<'a, F: FnOnce()> {
    payload: &'a [u8],
    meanwhile: Option<F>,
}

impl<F: FnOnce()> std::io::Read for Meanwhile<'_, F> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if let Some(f) = self.meanwhile.take() {
            f();
        }
        let n = buf.len().min(self.payload.len());
        buf[..n].copy_from_slice(&self.payload[..n]);
        self.payload = &self.payload[n..];
        Ok(n)
    }
}

/// What a crash leaves of a log where `k` was deleted while a value of it streamed into a segment
/// of its own: the process dies at the `crash_at`-th disk operation from the delete on (that one
/// and every later one fail). With `compact`, the delete's segment is sealed meanwhile (a value
/// that does not fit after it) and compacted. Returns the disk, whether the delete and the put of
/// `fill` were acknowledged, and whether the crash came before the end.
fn deleted_while_streaming(crash_at: u64, compact: bool) -> (SimBackend, bool, bool, bool) {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"k", &frames_for(b"k", 1000)).unwrap();
    log.sync().unwrap();
    let (payload, meta) = streamed(&frames_for(b"streamed", (1 << 20) + 4096)); // a segment of its own
    let (deleted, filled) = (std::cell::Cell::new(false), std::cell::Cell::new(false));
    let meanwhile = || {
        be.inject(Fault { op: FaultOp::Any, after: crash_at, kind: FaultKind::Eio, sticky: true });
        deleted.set(matches!(log.delete(b"k"), Ok(true)));
        if compact {
            filled.set(log.put(b"fill", &frames_for(b"fill", 60_000)).is_ok());
            let _ = log.compact();
        }
    };
    let _ = log.put_stream(b"k", &meta, &mut Meanwhile { payload: &payload, meanwhile: Some(meanwhile) });
    let crashed = be.fault_fired();
    drop(log);
    be.clear_faults();
    (be, deleted.get(), filled.get(), crashed)
}

/// Open `be` after a crash: an acknowledged delete holds, an acknowledged value reads back.
fn reopened(be: &SimBackend, deleted: bool, filled: bool, what: &str) -> SegmentLog<SimBackend> {
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap_or_else(|e| panic!("{what}: {e}"));
    let k = log.get(b"k").unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(!deleted || k.is_none(), "{what}: the deleted key came back");
    if filled {
        assert_eq!(log.get(b"fill").unwrap(), Some(frames_for(b"fill", 60_000)), "{what}");
    }
    log
}

/// A key deleted while a value of it streams into a segment of its own stays deleted through a
/// crash at any point: the streamed record may be whole on disk before the stream ends (and is
/// dead on arrival), in a segment newer than the tombstone's, which no tombstone's range reaches.
/// So the tombstone is kept (compaction copies it) while the stream lasts, the stream's segment is
/// removed before the stream ends, and an open removes such a segment that a crash left. Then a
/// second life collects garbage and dies after its first segment removal: the stream's segment
/// must not outlive the tombstone's there either.
#[test]
fn a_key_deleted_while_its_value_streams_in_stays_deleted_through_crashes() {
    for compact in [false, true] {
        for crash_at in 0.. {
            let (be, deleted, filled, crashed) = deleted_while_streaming(crash_at, compact);
            let what = format!("compact={compact}, crash at operation {crash_at}");
            let log = reopened(&be, deleted, filled, &what);
            be.inject(Fault { op: FaultOp::Remove, after: 1, kind: FaultKind::Eio, sticky: true });
            let _ = log.compact();
            drop(log);
            be.clear_faults();
            drop(reopened(&be, deleted, filled, &format!("{what}, then a crash in garbage collection")));
            if !crashed {
                assert!(deleted, "{what}");
                break;
            }
            assert!(crash_at < 200, "{what}: the stream never ends");
        }
    }
}

/// A value streamed into a segment of its own lies in a segment newer than the active one, where
/// its key's tombstone goes when it is deleted: a tombstone's `aux` names no segment after its own
/// (recovery refuses such a tombstone, and the key would come back). Deleted, the key stays
/// deleted after a crash right after the delete was written, with the streamed segment still on
/// disk, and the open finds no damage.
#[test]
fn a_streamed_value_deleted_stays_deleted_after_a_crash() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"a", &frames_for(b"a", 1000)).unwrap();
    let (payload, meta) = streamed(&frames_for(b"k", (1 << 20) + 4096)); // a segment of its own
    log.put_stream(b"k", &meta, &mut &payload[..]).unwrap();
    assert!(log.location(b"k").unwrap().segment > log.location(b"a").unwrap().segment);
    // The process dies right after the tombstone's write, before the streamed segment goes.
    be.inject(Fault { op: FaultOp::Any, after: 1, kind: FaultKind::Eio, sticky: true });
    assert!(log.delete(b"k").unwrap());
    assert!(be.fault_fired());
    drop(log);
    be.clear_faults();
    let log = SegmentLog::open(be, "/s", opts()).unwrap();
    assert_eq!(log.get(b"k").unwrap(), None, "the deleted key came back");
    let report = log.recovery_report();
    assert!(report.corrupt.is_empty() && report.truncated_bytes == 0, "{report:?}");
    assert_eq!(log.get(b"a").unwrap(), Some(frames_for(b"a", 1000)));
}
