//! Reusing the files of deleted segments (`LogOptions::recycle_segments`): a spill log that keeps
//! overwriting its keys writes into files it has written before instead of creating, preallocating
//! and unlinking one per segment, and still reads back exactly what it holds.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use spillway::backend::{BufResult, DirLock, Fault, FaultKind, FaultOp};
use spillway::buf::AlignedBuf;
use spillway::{Backend, Error, Frames, LogOptions, PortableBackend, SegmentLog, SimBackend};
use spillway_tests::value_for;

const SEG: u64 = 256 << 10;

fn spill_opts(recycle: bool) -> LogOptions {
    LogOptions {
        segment_bytes: SEG,
        discard_existing: true,
        durable: false,
        recycle_segments: recycle,
        ..Default::default()
    }
}

/// A real disk that counts the file creations, preallocations, removals and renames the log asks for.
#[derive(Default)]
struct Counting {
    inner: PortableBackend,
    n: Arc<Counts>,
    /// The punch the log's punch thread runs, instead of the portable backend's.
    punch: Option<spillway::backend::DetachedPunch<std::fs::File>>,
}

/// Held by a test to hold up the punches of a gated [`Counting`] backend.
static PUNCH_GATE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A punch that waits for [`PUNCH_GATE`] first.
fn gated_punch(f: &std::fs::File, offset: u64, len: u64) -> io::Result<()> {
    let _open = PUNCH_GATE.lock().unwrap_or_else(|p| p.into_inner());
    PortableBackend::new().punch_hole(f, offset, len)
}

#[derive(Default)]
struct Counts {
    creates: AtomicU64,
    allocates: AtomicU64,
    removes: AtomicU64,
    renames: AtomicU64,
}

impl spillway::backend::sealed::Sealed for Counting {}

impl Backend for Counting {
    type File = std::fs::File;
    fn name(&self) -> &'static str {
        "counting"
    }
    fn create_dir_all(&self, p: &Path) -> io::Result<()> {
        self.inner.create_dir_all(p)
    }
    fn is_dir(&self, p: &Path) -> bool {
        self.inner.is_dir(p)
    }
    fn list_dir(&self, p: &Path) -> io::Result<Vec<String>> {
        self.inner.list_dir(p)
    }
    fn open(&self, p: &Path, create: bool) -> io::Result<Self::File> {
        if create {
            self.n.creates.fetch_add(1, Ordering::Relaxed);
        }
        self.inner.open(p, create)
    }
    fn remove_file(&self, p: &Path) -> io::Result<()> {
        self.n.removes.fetch_add(1, Ordering::Relaxed);
        self.inner.remove_file(p)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.n.renames.fetch_add(1, Ordering::Relaxed);
        self.inner.rename(from, to)
    }
    fn sync_dir(&self, p: &Path) -> io::Result<()> {
        self.inner.sync_dir(p)
    }
    fn file_len(&self, f: &Self::File) -> io::Result<u64> {
        self.inner.file_len(f)
    }
    fn allocate(&self, f: &Self::File, len: u64) -> io::Result<bool> {
        self.n.allocates.fetch_add(1, Ordering::Relaxed);
        self.inner.allocate(f, len)
    }
    fn read_at(&self, f: &Self::File, offset: u64, buf: AlignedBuf) -> BufResult {
        self.inner.read_at(f, offset, buf)
    }
    fn write_at(&self, f: &Self::File, offset: u64, buf: AlignedBuf) -> BufResult {
        self.inner.write_at(f, offset, buf)
    }
    fn sync_data(&self, f: &Self::File) -> io::Result<()> {
        self.inner.sync_data(f)
    }
    fn lock_dir(&self, dir: &Path) -> io::Result<DirLock> {
        self.inner.lock_dir(dir)
    }
    fn alignment(&self, dir: &Path) -> usize {
        self.inner.alignment(dir)
    }
    fn punch_hole(&self, f: &Self::File, offset: u64, len: u64) -> io::Result<()> {
        self.inner.punch_hole(f, offset, len)
    }
    fn detached_punch(&self) -> Option<spillway::backend::DetachedPunch<Self::File>> {
        self.punch.or_else(|| self.inner.detached_punch())
    }
}

/// Total size of the segment files in `dir`.
fn segment_bytes_on_disk(dir: &Path) -> u64 {
    std::fs::read_dir(dir.join("segments")).unwrap().map(|e| e.unwrap().metadata().unwrap().len()).sum()
}

fn value(key: &[u8], round: u32) -> Frames {
    let mut tagged = key.to_vec();
    tagged.extend_from_slice(&round.to_le_bytes());
    Frames::from(value_for(&tagged, 20 << 10))
}

/// Overwrite 16 keys of 20 KiB round after round: every old segment dies. With recycling, the log
/// creates and preallocates a few files and then renames the files of dead segments into new ones;
/// without it, every segment is a new file, preallocated, and unlinked when it dies. Either way every
/// key reads its newest value, `verify` is clean, and `stats` counts the bytes the files hold.
#[test]
fn a_spill_log_overwriting_its_keys_reuses_the_files_of_dead_segments() {
    let mut counts = Vec::new();
    for recycle in [true, false] {
        let tmp = tempfile::tempdir().unwrap();
        let be = Counting::default();
        let n = be.n.clone();
        let log = SegmentLog::open(be, tmp.path(), spill_opts(recycle)).unwrap();
        for round in 0..60u32 {
            for k in 0..16u32 {
                let key = format!("k{k}").into_bytes();
                log.put(&key, &value(&key, round)).unwrap();
            }
        }
        for k in 0..16u32 {
            let key = format!("k{k}").into_bytes();
            assert_eq!(log.get(&key).unwrap(), Some(value(&key, 59)), "recycle {recycle}: key {k}");
        }
        assert!(log.verify().unwrap().is_empty(), "recycle {recycle}: {:?}", log.verify());
        let s = log.stats();
        assert_eq!(s.disk_bytes, segment_bytes_on_disk(tmp.path()), "recycle {recycle}: stats must count every file");
        drop(log);
        let files = std::fs::read_dir(tmp.path().join("segments")).unwrap().count() as u64;
        assert_eq!(files, s.segments, "recycle {recycle}: files kept for reuse go with the log");
        let c = |a: &AtomicU64| a.load(Ordering::Relaxed);
        counts.push((c(&n.creates), c(&n.allocates), c(&n.removes), c(&n.renames)));
    }
    let (with, without) = (counts[0], counts[1]);
    // 60 rounds of 320 KiB go through about 75 segments of 256 KiB.
    assert!(without.0 >= 60 && without.1 >= 60 && without.2 >= 55 && without.3 == 0, "without: {without:?}");
    assert!(with.0 <= 8 && with.1 <= 8 && with.3 >= 55, "with: {with:?}");
}

/// Punches of forgotten records run on the log's punch thread (`LogOptions::punch_forgotten`), so
/// a segment can die, and its file become a new segment, while punches of its records are still
/// queued. Those punches must not run on the file any more: the values written into it afterwards
/// read back whole once every punch has run. (The punches are held up until then.)
#[test]
fn queued_punches_never_reach_a_reused_file() {
    let tmp = tempfile::tempdir().unwrap();
    let be = Counting { punch: Some(gated_punch), ..Default::default() };
    let n = be.n.clone();
    let opts = LogOptions { segment_bytes: 4 << 20, punch_forgotten: true, ..spill_opts(true) };
    let log = SegmentLog::open(be, tmp.path(), opts).unwrap();
    let big = |key: &[u8]| Frames::from(value_for(key, (700 << 10) + key.len() * 512));
    let keys: Vec<Vec<u8>> = (0..16).map(|i| format!("k{i}").into_bytes()).collect();
    for k in &keys {
        log.put(k, &big(k)).unwrap();
    }
    let segment = |k: &[u8]| log.location(k).unwrap().segment;
    let (first, second) = (segment(&keys[0]), segment(&keys[8]));
    assert!(first < second && second < segment(&keys[15]), "three segments at least");
    let dying: Vec<&Vec<u8>> = keys.iter().filter(|k| segment(k) == second).collect();
    let gate = PUNCH_GATE.lock().unwrap();
    // A punch of the first segment, held up: everything queued after it waits.
    assert!(log.forget(&keys[0]).unwrap());
    // The second segment dies with punches of it queued; its file is kept for reuse.
    for k in &dying {
        assert!(log.forget(k).unwrap());
    }
    let renames = n.renames.load(Ordering::Relaxed);
    let fresh: Vec<Vec<u8>> = (0..12).map(|i| format!("new{i}").into_bytes()).collect();
    for k in &fresh {
        log.put(k, &big(k)).unwrap();
    }
    assert!(n.renames.load(Ordering::Relaxed) > renames, "the dead segment's file was reused");
    drop(gate);
    log.settle_punches();
    for k in fresh.iter().chain(keys.iter().filter(|k| log.location(k).is_some())) {
        assert_eq!(
            log.get(k).unwrap(),
            Some(big(k)),
            "{}: punched after its file was reused",
            String::from_utf8_lossy(k)
        );
    }
    assert!(log.verify().unwrap().is_empty(), "{:?}", log.verify());
}

/// A backend whose punch function panics on the punch thread: the thread ends, `settle_punches`
/// returns instead of waiting for punches that will never run, later punches run on the caller's
/// thread, and the log goes on (every kept value reads back, `verify` is clean).
#[test]
fn a_punch_thread_that_panics_leaves_the_log_working() {
    fn panicking_punch(_: &std::fs::File, _: u64, _: u64) -> io::Result<()> {
        panic!("a backend's punch panicked (on purpose, in a test)");
    }
    let tmp = tempfile::tempdir().unwrap();
    let be = Counting { punch: Some(panicking_punch), ..Default::default() };
    let opts = LogOptions { segment_bytes: 4 << 20, punch_forgotten: true, ..spill_opts(true) };
    let log = Arc::new(SegmentLog::open(be, tmp.path(), opts).unwrap());
    let big = |key: &[u8]| Frames::from(value_for(key, (700 << 10) + key.len() * 512));
    let keys: Vec<Vec<u8>> = (0..12).map(|i| format!("k{i}").into_bytes()).collect();
    for k in &keys {
        log.put(k, &big(k)).unwrap();
    }
    for k in keys.iter().step_by(2) {
        assert!(log.forget(k).unwrap());
        // Bounded: a settle that waited for punches that never run would hang here.
        let (done, settled) = std::sync::mpsc::channel();
        let l = log.clone();
        std::thread::spawn(move || {
            l.settle_punches();
            let _ = done.send(());
        });
        settled.recv_timeout(std::time::Duration::from_secs(60)).expect("settle_punches returned");
    }
    for k in keys.iter().skip(1).step_by(2) {
        assert_eq!(log.get(k).unwrap(), Some(big(k)));
    }
    log.put(b"after", &big(b"after")).unwrap();
    assert_eq!(log.get(b"after").unwrap(), Some(big(b"after")));
    assert!(log.verify().unwrap().is_empty(), "{:?}", log.verify());
}

/// A value being sent from a segment keeps that segment's file out of reuse: when the segment dies
/// meanwhile, its file is unlinked as usual (and stays readable through the held handle), never
/// written over, so the send reads the bytes it was promised.
#[test]
fn a_segment_being_sent_from_is_not_reused() {
    let tmp = tempfile::tempdir().unwrap();
    let be = Counting::default();
    let n = be.n.clone();
    let log = SegmentLog::open(be, tmp.path(), spill_opts(true)).unwrap();
    let want = Frames::from(value_for(b"sent", 20 << 10));
    log.put(b"sent", &want).unwrap();
    let sv = log.stored_value(b"sent").unwrap().unwrap();
    for round in 0..40u32 {
        for k in 0..16u32 {
            let key = format!("k{k}").into_bytes();
            log.put(&key, &value(&key, round)).unwrap();
        }
        if round == 0 {
            assert!(log.delete(b"sent").unwrap());
        }
    }
    assert!(n.renames.load(Ordering::Relaxed) >= 30, "the other dead segments' files were reused");
    let stored = log.read_stored(&sv).unwrap();
    assert!(stored[..] == want.concat()[..], "the held segment was written over");
}

/// Reuse is refused for a log that may be recovered: a reused file keeps old bytes past its end.
#[test]
fn recycling_needs_a_log_that_is_never_recovered() {
    let opts = LogOptions { discard_existing: false, ..spill_opts(true) };
    match SegmentLog::open(SimBackend::new(), "/s", opts) {
        Err(Error::InvalidConfig(msg)) => assert!(msg.contains("discard_existing"), "{msg}"),
        other => panic!("{:?}", other.map(|_| ())),
    }
}

/// A rename that fails (the first one here) costs the reuse, not the write:
/// the spare file is unlinked, a new segment is created, and every value stays readable.
#[test]
fn a_failed_rename_falls_back_to_a_new_file() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", spill_opts(true)).unwrap();
    for k in 0..16u32 {
        log.put(format!("k{k}").as_bytes(), &Frames::from(vec![1u8; 20 << 10])).unwrap();
    }
    be.inject(Fault { op: FaultOp::Remove, after: 0, kind: FaultKind::Eio, sticky: false });
    for round in 0..30u8 {
        for k in 0..16u32 {
            log.put(format!("k{k}").as_bytes(), &Frames::from(vec![round; 20 << 10])).unwrap();
        }
    }
    for k in 0..16u32 {
        assert_eq!(log.get(format!("k{k}").as_bytes()).unwrap(), Some(Frames::from(vec![29u8; 20 << 10])));
    }
    assert!(log.verify().unwrap().is_empty());
}

/// Fill a spill log with 16 keys of 20 KiB over `rounds` rounds of overwrites.
fn churn<B: Backend>(log: &SegmentLog<B>, rounds: std::ops::Range<u32>) {
    for round in rounds {
        for k in 0..16u32 {
            let key = format!("k{k}").into_bytes();
            log.put(&key, &value(&key, round)).unwrap();
        }
    }
}

/// A segment a value was handed out from for sending is unlinked when it dies, never reused, even
/// after the `StoredValue` is gone: a splice leaves references to the file's pages in the socket,
/// which writing over the file would change. So is one an async read still holds.
#[test]
fn segments_sent_from_or_read_asynchronously_are_unlinked_not_reused() {
    for how in ["sent", "async read"] {
        let tmp = tempfile::tempdir().unwrap();
        let be = Counting::default();
        let n = be.n.clone();
        let log = SegmentLog::open(be, tmp.path(), spill_opts(true)).unwrap();
        let want = Frames::from(value_for(b"held", 20 << 10));
        log.put(b"held", &want).unwrap();
        let pending = match how {
            "sent" => {
                drop(log.stored_value(b"held").unwrap().unwrap());
                None
            }
            _ => Some(log.get_async(b"held")),
        };
        churn(&log, 0..1);
        assert!(log.delete(b"held").unwrap());
        let removes = n.removes.load(Ordering::Relaxed);
        churn(&log, 1..40);
        assert!(n.renames.load(Ordering::Relaxed) >= 30, "{how}: the other dead segments were reused");
        assert!(n.removes.load(Ordering::Relaxed) > removes, "{how}: the held segment was unlinked");
        if let Some(fut) = pending {
            assert_eq!(spillway::task::block_on(fut).unwrap(), Some(want), "{how}");
        }
        assert!(log.verify().unwrap().is_empty());
    }
}

/// Kept files give their space back before the log preallocates a segment they cannot become (one
/// sized for a record larger than a segment).
#[test]
fn kept_files_are_released_before_a_larger_segment_is_made() {
    let tmp = tempfile::tempdir().unwrap();
    let log = SegmentLog::open(PortableBackend::new(), tmp.path(), spill_opts(true)).unwrap();
    churn(&log, 0..20);
    // Let the live keys' segments die too, with no new writes to take their files.
    for k in 0..16u32 {
        assert!(log.delete(format!("k{k}").as_bytes()).unwrap());
    }
    churn(&log, 0..1);
    assert!(log.stats().spare_files > 0, "{:?}", log.stats());
    let big = Frames::from(value_for(b"big", 2 * SEG as usize));
    log.put(b"big", &big).unwrap();
    let s = log.stats();
    assert_eq!(s.spare_files, 0, "{s:?}");
    assert_eq!(s.disk_bytes, segment_bytes_on_disk(tmp.path()));
    assert_eq!(log.get(b"big").unwrap(), Some(big));
}

/// Inode numbers of the segment files in `dir`.
fn segment_inodes(dir: &Path) -> std::collections::BTreeSet<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir.join("segments")).unwrap().map(|e| e.unwrap().metadata().unwrap().ino()).collect()
}

/// A spill log reopened in the directory of its last run starts empty, and with recycling its new
/// segments are written into the last run's segment files (blocks written before, not new
/// preallocated files); a file of another size (a segment sized for one large record) is deleted.
/// Without recycling every old file is deleted at open.
#[test]
fn a_reopened_spill_log_writes_its_new_segments_into_the_last_runs_files() {
    let many = |log: &SegmentLog<Counting>, round: u32| {
        for k in 0..64u32 {
            let key = format!("k{k}").into_bytes();
            log.put(&key, &value(&key, round)).unwrap();
        }
    };
    for recycle in [true, false] {
        let tmp = tempfile::tempdir().unwrap();
        let log = SegmentLog::open(Counting::default(), tmp.path(), spill_opts(recycle)).unwrap();
        many(&log, 0);
        log.put(b"big", &Frames::from(value_for(b"big", 2 * SEG as usize))).unwrap();
        many(&log, 1);
        let left = log.stats().segments;
        drop(log);
        let old = segment_inodes(tmp.path());
        assert_eq!(old.len() as u64, left, "recycle {recycle}: the live segments stay on disk after a close");

        let be = Counting::default();
        let n = be.n.clone();
        let log = SegmentLog::open(be, tmp.path(), spill_opts(recycle)).unwrap();
        assert_eq!(log.get(b"k0").unwrap(), None, "recycle {recycle}: a spill log starts empty");
        assert_eq!(log.get(b"big").unwrap(), None, "recycle {recycle}");
        let kept = log.stats().spare_files;
        assert_eq!(kept, if recycle { left - 1 } else { 0 }, "recycle {recycle}: all but the large record's file");
        assert_eq!(log.stats().disk_bytes, segment_bytes_on_disk(tmp.path()), "recycle {recycle}");
        let creates_at_open = n.creates.load(Ordering::Relaxed);
        many(&log, 2);
        many(&log, 3);
        let created = n.creates.load(Ordering::Relaxed) - creates_at_open;
        let now = segment_inodes(tmp.path());
        if recycle {
            assert!(created <= 1, "new segments went into the old files: {created} created");
            assert!(now.intersection(&old).count() as u64 >= kept - 1, "{old:?} {now:?}");
        } else {
            assert!(created >= left - 1, "{created} created");
        }
        for k in 0..64u32 {
            let key = format!("k{k}").into_bytes();
            assert_eq!(log.get(&key).unwrap(), Some(value(&key, 3)), "recycle {recycle}: key {k}");
        }
        assert!(log.verify().unwrap().is_empty(), "recycle {recycle}: {:?}", log.verify());
        let s = log.stats();
        assert_eq!(s.disk_bytes, segment_bytes_on_disk(tmp.path()), "recycle {recycle}");
        drop(log);
        let files = std::fs::read_dir(tmp.path().join("segments")).unwrap().count() as u64;
        assert_eq!(files, s.segments, "recycle {recycle}: files still kept for reuse go with the log");
    }
}
