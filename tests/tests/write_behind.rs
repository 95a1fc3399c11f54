//! Write-behind (`LogOptions::write_behind_bytes`): small batches stay encoded in memory until the
//! budget is full and are then written together. It changes when bytes reach the file, never which
//! bytes: every read path sees a pending record at once, a dropped log has written everything, the
//! files are byte-identical to those of a log written without it, and a failed write of pending
//! records leaves them readable from memory.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use spillway::backend::{Fault, FaultKind, FaultOp};
use spillway::{Error, LogOptions, PortableBackend, SegmentLog, SimBackend};
use spillway_tests::{assert_same_files, child_arg, frames_for, run_child, Rng};

const BUDGET: u64 = 64 << 10;

fn opts(write_behind_bytes: u64) -> LogOptions {
    LogOptions { segment_bytes: 256 << 10, write_behind_bytes, ..Default::default() }
}

fn key(i: usize) -> Vec<u8> {
    format!("key-{i}").into_bytes()
}

/// Size of value `i`: mostly small, every 37th larger than the whole budget.
fn size(i: usize) -> usize {
    if i % 37 == 36 {
        (BUDGET as usize) + 5000
    } else {
        100 + (i * 131) % 3000
    }
}

#[test]
fn small_puts_share_writes() {
    let count_ops = |budget: u64| {
        let be = SimBackend::new();
        let log = SegmentLog::open(be.clone(), "/s", opts(budget)).unwrap();
        let before = be.op_count();
        for i in 0..200 {
            log.put(&key(i), &frames_for(&key(i), 1000)).unwrap();
        }
        be.op_count() - before
    };
    let plain = count_ops(0);
    let behind = count_ops(BUDGET);
    // 200 records of about 1.1 KiB: one write each without write-behind; with a 64 KiB budget,
    // one write per ~58 records (plus the operations of creating a segment).
    assert!(plain >= 200, "{plain} operations for 200 puts without write-behind");
    assert!(behind <= 12, "{behind} operations for 200 puts with write-behind");
}

#[test]
fn pending_records_read_back_on_every_path() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts(BUDGET)).unwrap();
    log.put(b"first", &frames_for(b"first", 10)).unwrap(); // creates the segment
    let check = |i: usize| {
        let expected = frames_for(&key(i), 1000);
        let ops = be.op_count();
        log.put(&key(i), &expected).unwrap();
        assert_eq!(be.op_count(), ops, "the put was not deferred");
        assert!(log.contains(&key(i)));
        expected
    };
    // Reads copy a pending record out of memory: no I/O, and the batch stays pending.
    let unwritten = |what: &str, ops: u64| assert_eq!(be.op_count(), ops, "{what} of a pending record did I/O");
    let e = check(0);
    let ops = be.op_count();
    assert_eq!(log.get(&key(0)).unwrap(), Some(e));
    unwritten("get", ops);
    let e = check(1);
    assert_eq!(spillway::task::block_on(log.get_async(&key(1))).unwrap(), Some(e));
    unwritten("get_async", ops);
    let e = check(2);
    let mut got = Vec::new();
    log.get_pipelined(4, &mut [key(2), key(0), b"absent".to_vec()].into_iter(), &mut |k, r| got.push((k, r.unwrap())))
        .unwrap();
    unwritten("get_pipelined", ops);
    got.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(got[2], (key(2), Some(e)));
    assert_eq!(got[1], (key(0), Some(frames_for(&key(0), 1000))));
    assert_eq!(got[0], (b"absent".to_vec(), None));
    let e = check(3);
    // stored_value needs the bytes in the file (for splice): it writes what is pending.
    let sv = log.stored_value(&key(3)).unwrap().expect("present");
    assert!(be.op_count() > ops, "stored_value did not write the pending records");
    let payload = log.read_stored(&sv).unwrap();
    assert_eq!(payload.len() as u64, sv.meta.stored_len);
    assert_eq!(spillway::format::payload_crc(&payload), sv.meta.payload_crc);
    let (offsets, _) = spillway::format::frame_layout(sv.meta.frame_lens.iter().copied()).unwrap();
    for (f, &at) in e.iter().zip(&offsets) {
        assert_eq!(&payload[at as usize..at as usize + f.len()], &f[..]);
    }
    // A delete and an overwrite of pending records are pending too, and win.
    check(4);
    log.delete(&key(4)).unwrap();
    assert_eq!(log.get(&key(4)).unwrap(), None);
    check(5);
    let newer = frames_for(b"newer", 700);
    log.put(&key(5), &newer).unwrap();
    assert_eq!(log.get(&key(5)).unwrap(), Some(newer));
}

/// Puts of mixed sizes (some over the budget), deletes and a few syncs.
fn mixed_workload<B: spillway::Backend>(log: &SegmentLog<B>) {
    let mut rng = Rng::new(7);
    for i in 0..400 {
        log.put(&key(i), &frames_for(&key(i), size(i))).unwrap();
        match rng.below(10) {
            0 => {
                log.delete(&key(rng.below(i as u64 + 1) as usize)).unwrap();
            }
            1 if i % 50 == 0 => log.sync().unwrap(),
            _ => {}
        }
    }
}

#[test]
fn files_are_identical_to_a_log_without_write_behind() {
    let write = |budget: u64| {
        let be = SimBackend::new();
        let log = SegmentLog::open(be.clone(), "/s", opts(budget)).unwrap();
        mixed_workload(&log);
        drop(log);
        let mut files: Vec<(std::path::PathBuf, Vec<u8>)> =
            be.files().into_iter().map(|p| (p.clone(), be.file_contents(&p).unwrap())).collect();
        files.sort();
        (be, files)
    };
    let (_, plain) = write(0);
    let (be, behind) = write(BUDGET);
    assert_same_files(&plain, &behind, "write-behind against plain writes");
    // And the reopened log has every live record.
    let log = SegmentLog::open(be, "/s", opts(BUDGET)).unwrap();
    assert!(log.verify().unwrap().is_empty());
}

/// The same on buffered files of the portable backend, where pending records are written straight
/// from the tail (`write_gather_at`) rather than through a staging buffer.
#[test]
fn buffered_files_are_identical_to_a_log_without_write_behind() {
    let write = |budget: u64| {
        let dir = tempfile::tempdir().unwrap();
        let log = SegmentLog::open(PortableBackend::new(), dir.path(), opts(budget)).unwrap();
        mixed_workload(&log);
        drop(log);
        // Every file under the directory (segments may sit in subdirectories), by relative path.
        let mut files: Vec<(std::path::PathBuf, Vec<u8>)> = Vec::new();
        let mut dirs = vec![dir.path().to_path_buf()];
        while let Some(d) = dirs.pop() {
            for e in std::fs::read_dir(&d).unwrap() {
                let p = e.unwrap().path();
                if p.is_dir() {
                    dirs.push(p);
                } else if p.file_name().is_some_and(|n| n != "LOCK") {
                    let data = std::fs::read(&p).unwrap();
                    files.push((p.strip_prefix(dir.path()).unwrap().to_path_buf(), data));
                }
            }
        }
        files.sort();
        files
    };
    assert_same_files(&write(0), &write(BUDGET), "buffered write-behind against plain writes");
}

#[test]
fn sync_makes_pending_records_durable() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts(BUDGET)).unwrap();
    for i in 0..20 {
        log.put(&key(i), &frames_for(&key(i), 500)).unwrap();
    }
    log.sync().unwrap();
    let crashed = be.crash(Some(1));
    drop(log);
    let log = SegmentLog::open(crashed, "/s", opts(0)).unwrap();
    for i in 0..20 {
        assert_eq!(log.get(&key(i)).unwrap(), Some(frames_for(&key(i), 500)), "key {i}");
    }
}

#[test]
fn failed_write_of_pending_records_keeps_them_readable() {
    for kind in [FaultKind::Eio, FaultKind::Enospc, FaultKind::TornWrite] {
        let be = SimBackend::new();
        let log = SegmentLog::open(be.clone(), "/s", opts(BUDGET)).unwrap();
        log.put(b"written", &frames_for(b"written", 1000)).unwrap();
        log.sync().unwrap();
        for i in 0..20 {
            log.put(&key(i), &frames_for(&key(i), 1000)).unwrap();
        }
        be.inject(Fault { op: FaultOp::Write, after: 0, kind, sticky: true });
        // Overflowing the budget writes what is pending: that write fails, and so does this put.
        let err = log.put(b"overflow", &frames_for(b"overflow", BUDGET as usize)).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{kind:?}: {err}");
        // EIO makes the log read-only; a full file system fails each write for as long as it lasts.
        let no_space = kind == FaultKind::Enospc;
        assert_eq!(err.is_no_space(), no_space, "{kind:?}: {err}");
        // A small put that fits the budget needs no write: it is accepted (pending) while the file
        // system is full, but refused by a read-only log.
        match log.put(b"later", &frames_for(b"later", 10)) {
            Ok(()) if no_space => assert_eq!(log.get(b"later").unwrap(), Some(frames_for(b"later", 10))),
            Err(Error::Poisoned { .. }) if !no_space => {}
            r => panic!("{kind:?}: {r:?}"),
        }
        assert_eq!(log.get(b"overflow").unwrap(), None);
        // Everything acknowledged still reads back: the pending records from memory.
        assert_eq!(log.get(b"written").unwrap(), Some(frames_for(b"written", 1000)));
        for i in 0..20 {
            assert_eq!(log.get(&key(i)).unwrap(), Some(frames_for(&key(i), 1000)), "{kind:?} key {i}");
        }
        assert_eq!(spillway::task::block_on(log.get_async(&key(3))).unwrap(), Some(frames_for(&key(3), 1000)));
        let mut n = 0;
        log.get_pipelined(8, &mut (0..20).map(key), &mut |k, r| {
            let i: usize = std::str::from_utf8(&k).unwrap()[4..].parse().unwrap();
            assert_eq!(r.unwrap(), Some(frames_for(&k, 1000)), "key {i}");
            n += 1;
        })
        .unwrap();
        assert_eq!(n, 20);
        // Sending from the file is impossible for a record only in memory: a typed error, and the
        // transfer source sends it from memory instead.
        match log.stored_value(&key(0)) {
            Err(e) if no_space => assert!(e.is_no_space(), "{e}"),
            Err(Error::Poisoned { .. }) => {}
            r => panic!("{kind:?}: {:?}", r.map(|v| v.is_some())),
        }
        match spillway::transfer::Source::outgoing(&log, &key(0)).unwrap() {
            Some(spillway::transfer::Outgoing::Frames(f)) => assert_eq!(f, frames_for(&key(0), 1000)),
            _ => panic!("{kind:?}: a pending record must go out from memory"),
        }
        if no_space {
            // Room again: the pending records are written, and everything reads back from the file.
            be.clear_faults();
            log.sync().unwrap();
            assert!(matches!(
                spillway::transfer::Source::outgoing(&log, &key(0)).unwrap(),
                Some(spillway::transfer::Outgoing::Stored(_))
            ));
            drop(log);
            let log = SegmentLog::open(be.clone(), "/s", opts(BUDGET)).unwrap();
            for i in 0..20 {
                assert_eq!(log.get(&key(i)).unwrap(), Some(frames_for(&key(i), 1000)), "reopened: key {i}");
            }
            assert_eq!(log.get(b"later").unwrap(), Some(frames_for(b"later", 10)));
            continue;
        }
        // Dropping logs the failure instead of panicking.
        drop(log);
    }
}

#[test]
fn readers_see_every_acknowledged_record_while_a_writer_defers() {
    let dir = tempfile::tempdir().unwrap();
    let log = SegmentLog::open(PortableBackend::new(), dir.path(), opts(BUDGET)).unwrap();
    let acked = AtomicUsize::new(0);
    let done = AtomicBool::new(false);
    std::thread::scope(|s| {
        for t in 0..2u64 {
            let (log, acked, done) = (&log, &acked, &done);
            s.spawn(move || {
                let mut rng = Rng::new(t + 1);
                let mut reads = 0;
                while !done.load(Ordering::Acquire) || reads < 100 {
                    let n = acked.load(Ordering::Acquire);
                    if n == 0 {
                        std::thread::yield_now();
                        continue;
                    }
                    // The newest records are the likeliest to be pending.
                    let i = if rng.below(2) == 0 { n - 1 } else { rng.below(n as u64) as usize };
                    assert_eq!(log.get(&key(i)).unwrap(), Some(frames_for(&key(i), size(i) % 4000)), "key {i}");
                    reads += 1;
                }
            });
        }
        for i in 0..3000 {
            log.put(&key(i), &frames_for(&key(i), size(i) % 4000)).unwrap();
            acked.store(i + 1, Ordering::Release);
        }
        done.store(true, Ordering::Release);
    });
    drop(log);
    let log = SegmentLog::open(PortableBackend::new(), dir.path(), opts(0)).unwrap();
    assert_eq!(log.len(), 3000);
    for i in (0..3000).step_by(7) {
        assert_eq!(log.get(&key(i)).unwrap(), Some(frames_for(&key(i), size(i) % 4000)));
    }
}

#[test]
fn write_behind_budget_is_bounded() {
    let dir = tempfile::tempdir().unwrap();
    let r = SegmentLog::open(PortableBackend::new(), dir.path(), opts(spillway::log::MAX_WRITE_BEHIND_BYTES + 1));
    assert!(matches!(r, Err(Error::InvalidConfig(_))));
}

/// The child of [`a_segment_emptied_by_pending_records_is_deleted_only_after_they_are_written`]: a
/// spill log (not durable) whose first segment's keys are all overwritten by small records that stay
/// pending, which empties that segment; then the process ends without dropping the log (as kill -9).
#[test]
fn child_empties_a_segment_with_pending_overwrites() {
    let Some(dir) = child_arg() else { return };
    let opts = LogOptions { segment_bytes: 64 << 10, durable: false, ..opts(BUDGET) };
    let log = SegmentLog::open(PortableBackend::new(), &dir, opts).unwrap();
    for i in 0..10 {
        log.put(&key(i), &frames_for(&key(i), 3000)).unwrap();
    }
    for i in 10..40 {
        log.put(&key(i), &frames_for(&key(i), 3000)).unwrap(); // fills segment 1, rotates
    }
    assert!(log.stats().segments >= 2);
    let first = log.location(&key(0)).unwrap().segment;
    for i in 0..40 {
        if log.location(&key(i)).unwrap().segment == first {
            log.put(&key(i), &frames_for(b"newer", 100)).unwrap(); // pending overwrites
        }
    }
    assert!(log.location(&key(0)).unwrap().segment != first);
    println!("CHILD-DONE");
    std::process::exit(0); // no drop: whatever is still pending dies with the process
}

/// Run child test `name` on a log in a new directory (it ends its process without dropping the log),
/// then open that log again.
fn reopen_after_child(name: &str) -> (tempfile::TempDir, SegmentLog<PortableBackend>) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("log");
    let (status, out) = run_child(name, dir.to_str().unwrap());
    assert!(status.success() && out.contains("CHILD-DONE"), "child failed: {status:?}\n{out}");
    let log = SegmentLog::open(PortableBackend::new(), &dir, opts(0)).unwrap();
    (tmp, log)
}

/// Garbage collection deletes a segment once nothing in it is live. If what superseded its records
/// were still pending in memory, a process crash right after would lose both the old and the new
/// values: the pending records are written first.
#[test]
fn a_segment_emptied_by_pending_records_is_deleted_only_after_they_are_written() {
    let (_tmp, log) = reopen_after_child("child_empties_a_segment_with_pending_overwrites");
    for i in 0..40 {
        let got = log.get(&key(i)).unwrap().unwrap_or_else(|| panic!("key {i} lost"));
        assert!(got == frames_for(&key(i), 3000) || got == frames_for(b"newer", 100), "key {i}");
    }
}

/// The child of [`a_tombstone_copied_by_compaction_is_written_before_its_segment_goes`]: segment 2
/// holds only a tombstone (for a key whose old record segment 1 still holds) and dead records.
/// Compaction copies the tombstone to the active segment, where it stays pending; then the process
/// ends without dropping the log.
#[test]
fn child_compacts_a_tombstone_into_a_pending_copy() {
    let Some(dir) = child_arg() else { return };
    let opts = LogOptions { segment_bytes: 64 << 10, durable: false, auto_compact: false, ..opts(BUDGET) };
    let log = SegmentLog::open(PortableBackend::new(), &dir, opts).unwrap();
    // Segment 1: full, all live but key 0 (so compaction leaves it alone), with key 0's old record.
    let mut i = 0;
    while log.stats().segments < 2 {
        log.put(&key(i), &frames_for(&key(i), 3000)).unwrap();
        i += 1;
    }
    let opened_segment_2 = i - 1;
    assert!(log.delete(&key(0)).unwrap()); // the tombstone goes to segment 2
                                           // The rest of segment 2: records that then die, overwritten by values too large to defer (so
                                           // nothing of segment 2 is superseded by a pending record).
    let mut fillers = vec![opened_segment_2];
    let mut i = 100;
    while log.stats().segments < 3 {
        log.put(&key(i), &frames_for(&key(i), 3000)).unwrap();
        fillers.push(i);
        i += 1;
    }
    for &f in &fillers {
        log.put(&key(f), &frames_for(&key(f), 2 * BUDGET as usize)).unwrap();
    }
    let stats = log.compact().unwrap();
    assert!(stats.segments_compacted >= 1, "{stats:?}");
    println!("CHILD-DONE");
    std::process::exit(0); // no drop: whatever is still pending dies with the process
}

/// Compaction copies a needed tombstone out of a segment it is emptying. If the copy were still
/// pending in memory when the segment is deleted, a process crash would lose the deletion and the
/// old record would come back: the pending records are written first.
#[test]
fn a_tombstone_copied_by_compaction_is_written_before_its_segment_goes() {
    let (_tmp, log) = reopen_after_child("child_compacts_a_tombstone_into_a_pending_copy");
    assert_eq!(log.get(&key(0)).unwrap(), None, "a deleted key came back");
    for i in 1..10 {
        assert_eq!(log.get(&key(i)).unwrap(), Some(frames_for(&key(i), 3000)), "key {i}");
    }
}

/// A 4 MiB tmpfs for the test (mounting needs the right to: `None` otherwise), unmounted on drop.
struct Tmpfs(tempfile::TempDir);

impl Tmpfs {
    fn mount() -> Option<Tmpfs> {
        let dir = tempfile::tempdir().ok()?;
        let ok = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
            .arg(dir.path())
            .output()
            .is_ok_and(|o| o.status.success());
        ok.then_some(Tmpfs(dir))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(self.0.path()).status();
    }
}

#[test]
fn a_segment_the_file_system_could_not_reserve_defers_nothing() {
    // A segment larger than the file system is made sparse (its space cannot be reserved). A record
    // left pending there would be acknowledged without space behind it: once the file system is
    // full, a put must fail at once (ENOSPC), as it would with nothing pending.
    let Some(fs) = Tmpfs::mount() else {
        eprintln!("skipped: cannot mount a tmpfs here");
        return;
    };
    let opts = LogOptions { segment_bytes: 64 << 20, write_behind_bytes: 2 << 20, ..Default::default() };
    let log = SegmentLog::open(PortableBackend::new(), fs.0.path().join("log"), opts).unwrap();
    log.put(b"first", &frames_for(b"first", 100_000)).unwrap();
    {
        use std::io::Write;
        let mut filler = std::fs::File::create(fs.0.path().join("filler")).unwrap();
        for size in [64 << 10, 512, 1] {
            while filler.write_all(&vec![0; size]).is_ok() {}
        }
    }
    let err = log.put(b"second", &frames_for(b"second", 50_000)).unwrap_err();
    assert!(err.is_no_space(), "{err}");
    assert_eq!(log.get(b"first").unwrap().unwrap(), frames_for(b"first", 100_000));
    assert!(log.get(b"second").unwrap().is_none());
    std::fs::remove_file(fs.0.path().join("filler")).unwrap();
    log.put(b"second", &frames_for(b"second", 50_000)).unwrap();
    assert_eq!(log.get(b"second").unwrap().unwrap(), frames_for(b"second", 50_000));
}
