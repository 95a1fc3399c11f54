//! Fault injection with the simulated backend. A failed write (EIO) or fdatasync leaves the file in
//! an unknown state, so the log must refuse further writes (never retry an fsync) while reads go on,
//! and a reopen must find every record acknowledged before the fault. A full file system (ENOSPC,
//! from fallocate or from a write, whole or torn) is an error for that call only: what a failed write
//! left lies past the published end, and the next write overwrites it.

use spillway::backend::{Fault, FaultKind, FaultOp};
use spillway::{Error, Frames, LogOptions, SegmentLog, SimBackend};
use spillway_tests::frames_for;

fn opts() -> LogOptions {
    LogOptions { segment_bytes: 64 * 1024, ..Default::default() }
}

/// The write paths the workload tests run on, as (grouped, gathered, write-behind bytes): one write
/// per batch; batches cut into 8 KiB groups written "in flight" (the io_uring path: the sim backend
/// claims a queue, so a fault can hit any group of a batch); every value written gathered from its
/// own buffers (the buffered portable path; batches of 4 KiB or more with their crcs computed during
/// the write and the record heads written last); and write-behind (small batches pending in memory until
/// 16 KiB are, or until a sync).
const WRITE_PATHS: [(bool, bool, u64); 4] =
    [(false, false, 0), (true, false, 0), (false, true, 0), (false, false, 16 << 10)];

fn path_backend(grouped: bool, gathered: bool) -> SimBackend {
    let be = SimBackend::new();
    be.set_queue_writes(grouped);
    be.set_gather_writes(gathered);
    be
}

fn path_opts(write_behind: u64) -> LogOptions {
    LogOptions {
        write_group_bytes: 8 << 10,
        gather_min_bytes: 1024,
        // Gathered writes of 4 KiB or more compute their crcs on a helper thread and write the
        // record heads last: two writes, either of which can fail.
        parallel_crc_min_bytes: 4096,
        write_behind_bytes: write_behind,
        ..opts()
    }
}

#[test]
fn failed_write_poisons_writes_but_not_reads() {
    for kind in [FaultKind::Eio, FaultKind::TornWrite] {
        let be = SimBackend::new();
        let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
        for i in 0..10 {
            let k = format!("k{i}");
            log.put(k.as_bytes(), &frames_for(k.as_bytes(), 3000)).unwrap();
        }
        be.inject(Fault { op: FaultOp::Write, after: 0, kind, sticky: false });
        let err = log.put(b"doomed", &Frames::from(vec![1u8; 100])).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{kind:?}: {err}");
        assert!(be.fault_fired());
        // The fault is gone, but the log stays read-only: the file's state after a failed write is unknown.
        let err = log.put(b"after", &Frames::from(vec![1u8; 100])).unwrap_err();
        assert!(matches!(err, Error::Poisoned { .. }), "{kind:?}: {err}");
        assert!(matches!(log.sync(), Err(Error::Poisoned { .. })));
        for i in 0..10 {
            let k = format!("k{i}");
            assert_eq!(log.get(k.as_bytes()).unwrap(), Some(frames_for(k.as_bytes(), 3000)));
        }
        assert_eq!(log.get(b"doomed").unwrap(), None);
        drop(log);
        let log = SegmentLog::open(be, "/s", opts()).unwrap();
        for i in 0..10 {
            let k = format!("k{i}");
            assert_eq!(log.get(k.as_bytes()).unwrap(), Some(frames_for(k.as_bytes(), 3000)));
        }
        assert_eq!(log.get(b"doomed").unwrap(), None, "{kind:?}: a failed put must not appear");
        log.put(b"after", &Frames::from(vec![1u8; 100])).unwrap();
    }
}

#[test]
fn failed_fsync_poisons() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"a", &Frames::from(vec![1u8; 100])).unwrap();
    be.inject(Fault { op: FaultOp::Sync, after: 0, kind: FaultKind::Eio, sticky: false });
    assert!(matches!(log.sync(), Err(Error::Io { .. })));
    assert!(matches!(log.sync(), Err(Error::Poisoned { .. })), "fsync must never be retried");
    assert!(matches!(log.put(b"b", &Frames::from(vec![1u8; 1])), Err(Error::Poisoned { .. })));
    assert!(log.get(b"a").unwrap().is_some());
}

/// A full file system at any write of a workload (a record batch, write-behind's pending records, a
/// footer, a segment header, compaction's copies; whole or torn): that call fails with an error that
/// says so, the log stays writable, and the same call succeeds once there is room. Every value then
/// reads back as last acknowledged, the files verify clean, and a reopen (clean, or after a power
/// cut) finds the same.
#[test]
fn full_file_system_at_any_write_fails_that_call_only() {
    use std::collections::BTreeMap;
    // Retry a call once if it failed for lack of space (the fault fires once).
    fn retry<T>(failures: &mut u32, mut f: impl FnMut() -> spillway::Result<T>) -> spillway::Result<T> {
        match f() {
            Err(e) if e.is_no_space() => {
                *failures += 1;
                f()
            }
            r => r,
        }
    }
    fn workload(
        log: &SegmentLog<SimBackend>,
        model: &mut BTreeMap<String, usize>,
        failures: &mut u32,
    ) -> spillway::Result<()> {
        for i in 0..60usize {
            let k = format!("k{}", i % 23); // overwrites: dead records for compaction
            let size = 600 + 97 * (i % 40);
            if i % 10 == 5 {
                let extra: Vec<String> = (0..4).map(|j| format!("b{i}-{j}")).collect();
                let values: Vec<Frames> = extra.iter().map(|e| frames_for(e.as_bytes(), 2500)).collect();
                let items: Vec<(&[u8], &Frames)> = extra.iter().zip(&values).map(|(e, v)| (e.as_bytes(), v)).collect();
                retry(failures, || log.put_many(&items))?;
                for e in extra {
                    model.insert(e, 2500);
                }
            }
            retry(failures, || log.put(k.as_bytes(), &frames_for(k.as_bytes(), size)))?;
            model.insert(k, size);
            if i % 7 == 3 {
                let d = format!("k{}", (i + 5) % 23);
                retry(failures, || log.delete(d.as_bytes()))?;
                model.remove(&d);
            }
            if i % 20 == 19 {
                retry(failures, || log.sync())?;
            }
        }
        retry(failures, || log.compact().map(|_| ()))?;
        retry(failures, || log.sync())
    }
    fn check(log: &SegmentLog<SimBackend>, model: &BTreeMap<String, usize>, what: &str) {
        for (k, &size) in model {
            assert_eq!(
                log.get(k.as_bytes()).unwrap_or_else(|e| panic!("{what}: {k}: {e}")),
                Some(frames_for(k.as_bytes(), size)),
                "{what}: {k}"
            );
        }
        assert_eq!(log.len(), model.len(), "{what}: keys");
    }
    for (grouped, gathered, write_behind) in WRITE_PATHS {
        // Automatic compaction is housekeeping whose failure no caller sees (it is logged); here
        // every write belongs to a call, so the one that hits the fault must say so.
        let opts = || LogOptions { auto_compact: false, ..path_opts(write_behind) };
        let clean = path_backend(grouped, gathered);
        let writes_before = clean.write_count();
        workload(&SegmentLog::open(clean.clone(), "/s", opts()).unwrap(), &mut BTreeMap::new(), &mut 0).unwrap();
        let writes = clean.write_count() - writes_before;
        assert!(writes > 20);
        for step in 0..writes {
            for kind in [FaultKind::Enospc, FaultKind::TornEnospc] {
                let what =
                    format!("write {step} {kind:?} grouped={grouped} gathered={gathered} write_behind={write_behind}");
                let be = path_backend(grouped, gathered);
                let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
                be.inject(Fault { op: FaultOp::Write, after: step, kind, sticky: false });
                let (mut model, mut failures) = (BTreeMap::new(), 0);
                workload(&log, &mut model, &mut failures).unwrap_or_else(|e| panic!("{what}: {e}"));
                assert!(be.fault_fired(), "{what}");
                // With write-behind, garbage collection writes the pending records before it deletes
                // a segment; when that write fails, the segment waits and the records stay pending
                // (written by the next write): housekeeping, not the caller's error.
                let expected = if write_behind == 0 { 1..=1 } else { 0..=1 };
                assert!(expected.contains(&failures), "{what}: {failures} calls failed");
                check(&log, &model, &what);
                let problems = log.verify().unwrap();
                assert!(problems.is_empty(), "{what}: {problems:?}");
                drop(log);
                let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap_or_else(|e| panic!("{what}: reopen: {e}"));
                check(&log, &model, &format!("{what}, reopened"));
                drop(log);
                // The workload ended with a sync: a power cut loses nothing either.
                let log = SegmentLog::open(be.crash(Some(step)), "/s", opts()).unwrap();
                check(&log, &model, &format!("{what}, after a power cut"));
            }
        }
    }
}

#[test]
fn enospc_creating_a_segment_is_retryable() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"first", &Frames::from(vec![1u8; 100])).unwrap();
    be.inject(Fault { op: FaultOp::Allocate, after: 0, kind: FaultKind::Enospc, sticky: true });
    // Fill the active segment until a new one is needed.
    let mut failed_at = None;
    for i in 0..100 {
        if let Err(e) = log.put(format!("k{i}").as_bytes(), &Frames::from(vec![2u8; 4000])) {
            assert_eq!(e.io_kind(), Some(std::io::ErrorKind::StorageFull), "{e}");
            failed_at = Some(i);
            break;
        }
    }
    let failed_at = failed_at.expect("segment rotation must hit the fault");
    be.clear_faults();
    // Space is back: the same put now succeeds, and nothing acknowledged was lost.
    log.put(format!("k{failed_at}").as_bytes(), &Frames::from(vec![2u8; 4000])).unwrap();
    log.sync().unwrap();
    drop(log);
    let log = SegmentLog::open(be, "/s", opts()).unwrap();
    for i in 0..=failed_at {
        assert!(log.get(format!("k{i}").as_bytes()).unwrap().is_some());
    }
    assert!(log.get(b"first").unwrap().is_some());
}

#[test]
fn failure_at_every_io_step_of_a_workload_never_panics_and_loses_no_synced_record() {
    fn workload(log: &SegmentLog<SimBackend>, synced: &mut Vec<String>) -> spillway::Result<()> {
        let mut pending = Vec::new();
        for i in 0..60 {
            let k = format!("k{i}");
            if i % 10 == 5 {
                // A batch spanning several 8 KiB groups.
                let extra: Vec<String> = (0..4).map(|j| format!("b{i}-{j}")).collect();
                let values: Vec<Frames> = extra.iter().map(|e| frames_for(e.as_bytes(), 2500)).collect();
                let mut items: Vec<(&[u8], &Frames)> =
                    extra.iter().zip(&values).map(|(e, v)| (e.as_bytes(), v)).collect();
                let v = frames_for(k.as_bytes(), 2500);
                items.push((k.as_bytes(), &v));
                log.put_many(&items)?;
                pending.extend(extra);
            } else {
                log.put(k.as_bytes(), &frames_for(k.as_bytes(), 2500))?;
            }
            pending.push(k);
            if i % 3 == 2 {
                // A delete that fails may still have reached the disk (a torn write can carry the
                // whole tombstone), so the key stops being expected before the attempt.
                pending.retain(|p| *p != format!("k{}", i - 2));
                synced.retain(|p| *p != format!("k{}", i - 2));
                log.delete(format!("k{}", i - 2).as_bytes())?;
            }
            if i % 10 == 9 {
                log.sync()?;
                synced.append(&mut pending);
            }
        }
        log.compact()?;
        log.sync()?;
        Ok(())
    }
    for (grouped, gathered, write_behind) in WRITE_PATHS {
        let opts = || path_opts(write_behind);
        // Count the I/O steps of a clean run, then fail each one in turn.
        let clean = path_backend(grouped, gathered);
        let ops_before = clean.op_count();
        workload(&SegmentLog::open(clean.clone(), "/s", opts()).unwrap(), &mut Vec::new()).unwrap();
        let steps = clean.op_count() - ops_before;
        assert!(steps > 20);
        for step in 0..steps {
            for kind in [FaultKind::Eio, FaultKind::Enospc, FaultKind::TornWrite, FaultKind::TornEnospc] {
                let be = path_backend(grouped, gathered);
                let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
                be.inject(Fault { op: FaultOp::Any, after: step, kind, sticky: false });
                let mut synced = Vec::new();
                let r = workload(&log, &mut synced);
                if be.fault_fired() {
                    assert!(r.is_err(), "step {step} {kind:?}: a fault fired but the workload succeeded");
                }
                drop(log);
                // Power cut after the fault: every record synced (and not deleted) before it is readable.
                let be = be.crash(Some(step));
                let log = SegmentLog::open(be, "/s", opts()).unwrap_or_else(|e| panic!("step {step}: reopen: {e}"));
                for k in &synced {
                    assert_eq!(
                        log.get(k.as_bytes()).unwrap_or_else(|e| panic!("step {step} {kind:?}: {k}: {e}")),
                        Some(frames_for(k.as_bytes(), 2500)),
                        "step {step} {kind:?} grouped={grouped} gathered={gathered} write_behind={write_behind}: synced record {k} lost"
                    );
                }
            }
        }
    }
}

/// Whole records of a write that failed for lack of space may lie in the file past the published
/// end (here: half of the batch landed). Once something is written after them they never come back,
/// neither at a clean reopen (which scans the unsealed segment) nor after a power cut. A durable log
/// erases them at once (zeroed and synced); a non-durable one leaves them to the epoch rule.
#[test]
fn records_of_a_failed_write_do_not_come_back_after_a_later_write() {
    for (gathered, durable) in [(false, false), (true, false), (false, true), (true, true)] {
        let be = SimBackend::new();
        be.set_gather_writes(gathered);
        let o = || LogOptions { gather_min_bytes: 1024, auto_compact: false, durable, ..opts() };
        let log = SegmentLog::open(be.clone(), "/s", o()).unwrap();
        log.put(b"first", &frames_for(b"first", 100)).unwrap();
        log.sync().unwrap();
        be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::TornEnospc, sticky: false });
        let one = |k: &[u8], n| Frames::from(spillway_tests::value_for(k, n)); // one frame: contiguous
        let (a, b, c) = (one(b"a", 4500), one(b"b", 200), one(b"c", 8000));
        let items: [(&[u8], &Frames); 3] = [(b"a", &a), (b"b", &b), (b"c", &c)];
        assert!(log.put_many(&items).unwrap_err().is_no_space());
        // The torn write left `b` whole in the file, past what the next write covers (unless erased).
        let seg = be.files().into_iter().max().unwrap();
        let contents = be.file_contents(&seg).unwrap();
        let left = contents.windows(200).any(|w| w == &b.concat()[..]);
        assert_eq!(left, !durable, "gathered={gathered} durable={durable}: b is in the file");
        log.put(b"d", &frames_for(b"d", 100)).unwrap();
        log.sync().unwrap();
        drop(log);
        for (what, be) in [("reopened", be.clone()), ("after a power cut", be.crash(Some(7)))] {
            let log = SegmentLog::open(be, "/s", o()).unwrap();
            for k in [&b"a"[..], b"b", b"c"] {
                assert_eq!(log.get(k).unwrap(), None, "gathered={gathered}, {what}: {:?} came back", k);
            }
            assert_eq!(log.get(b"d").unwrap(), Some(frames_for(b"d", 100)));
            assert_eq!(log.get(b"first").unwrap(), Some(frames_for(b"first", 100)));
            assert_eq!(log.len(), 2, "gathered={gathered}, {what}");
        }
    }
}

/// A value streamed from a peer that meets a full disk part-way fails alone: erasing what it wrote
/// in the active segment needs no space (a punch), a segment of its own is removed, the log stays
/// writable, and the same value streams in once there is room. Both paths: a value of 1 MiB (read
/// first, then written under the writer lock in two writes) and one of 3 MiB (its own segment).
#[test]
fn a_streamed_value_that_meets_a_full_disk_fails_alone() {
    for n in [1 << 20, 3 << 20] {
        a_streamed_value_of_n_bytes_that_meets_a_full_disk_fails_alone(n);
    }
}

fn a_streamed_value_of_n_bytes_that_meets_a_full_disk_fails_alone(n: usize) {
    let be = SimBackend::new();
    let o = || LogOptions { segment_bytes: 8 << 20, ..opts() };
    let log = SegmentLog::open(be.clone(), "/s", o()).unwrap();
    log.put(b"before", &frames_for(b"before", 1000)).unwrap();
    let (payload, meta) = spillway_tests::streamed(&Frames::from(spillway_tests::value_for(b"big", n)));
    // The second 1 MiB write fails, and so does every write after it until there is room again.
    be.inject(Fault { op: FaultOp::Write, after: 1, kind: FaultKind::TornEnospc, sticky: true });
    let e = log.put_stream(b"big", &meta, &mut &payload[..]).unwrap_err();
    assert!(e.is_no_space(), "{e}");
    be.clear_faults();
    assert_eq!(log.get(b"big").unwrap(), None);
    log.put_stream(b"big", &meta, &mut &payload[..]).unwrap();
    log.put(b"after", &frames_for(b"after", 1000)).unwrap();
    drop(log);
    let log = SegmentLog::open(be, "/s", o()).unwrap();
    assert_eq!(log.get(b"big").unwrap().unwrap().concat(), &payload[..]);
    assert_eq!(log.get(b"before").unwrap(), Some(frames_for(b"before", 1000)));
    assert_eq!(log.get(b"after").unwrap(), Some(frames_for(b"after", 1000)));

    // Any other write error while a value streams in makes the log read-only, as on every write path
    // (a log that stayed writable would go on over a file in an unknown state). Reads go on.
    an_eio_during_a_stream_makes_the_log_read_only(&payload, &meta);
}

fn an_eio_during_a_stream_makes_the_log_read_only(payload: &[u8], meta: &spillway::StreamedValue) {
    let be = SimBackend::new();
    let o = || LogOptions { segment_bytes: 8 << 20, ..opts() };
    let log = SegmentLog::open(be.clone(), "/s", o()).unwrap();
    log.put(b"before", &frames_for(b"before", 1000)).unwrap();
    assert_eq!(log.poisoned(), None);
    be.inject(Fault { op: FaultOp::Write, after: 1, kind: FaultKind::Eio, sticky: false });
    let e = log.put_stream(b"big", meta, &mut &payload[..]).unwrap_err();
    assert!(!e.is_no_space(), "{e}");
    assert!(log.poisoned().is_some_and(|why| why.contains("write segment")), "{:?}", log.poisoned());
    let e = log.put(b"after", &frames_for(b"after", 10)).unwrap_err();
    assert!(matches!(e, spillway::Error::Poisoned { .. }), "{e}");
    assert_eq!(log.get(b"before").unwrap(), Some(frames_for(b"before", 1000)));
}

/// A streamed value that meets a full disk, and whose erase fails too (a punch on a full file system
/// can need a block to split an extent). As after any failed write on a full disk, the call fails
/// alone and the log stays writable (a failed erase is a warning, see `erase_durably`); the next
/// write goes over the partial record. Nothing acknowledged is lost, and the partial value never
/// shows, neither before nor after a reopen or a power cut.
#[test]
fn a_streamed_value_whose_erase_fails_loses_nothing() {
    for (n, durable) in [(1 << 20, false), (1 << 20, true), (3 << 20, false), (3 << 20, true)] {
        let (payload, meta) = spillway_tests::streamed(&Frames::from(spillway_tests::value_for(b"big", n)));
        let be = SimBackend::new();
        let o = || LogOptions { segment_bytes: 8 << 20, durable, ..opts() };
        let log = SegmentLog::open(be.clone(), "/s", o()).unwrap();
        log.put(b"big", &frames_for(b"big", 2000)).unwrap();
        log.put(b"before", &frames_for(b"before", 1000)).unwrap();
        log.sync().unwrap();
        be.inject(Fault { op: FaultOp::Write, after: 1, kind: FaultKind::TornEnospc, sticky: true });
        be.inject(Fault { op: FaultOp::Punch, after: 0, kind: FaultKind::Enospc, sticky: true });
        let e = log.put_stream(b"big", &meta, &mut &payload[..]).unwrap_err();
        assert!(e.is_no_space(), "durable={durable}: {e}");
        be.clear_faults();
        assert_eq!(log.get(b"big").unwrap(), Some(frames_for(b"big", 2000)), "durable={durable}");
        log.put(b"after", &frames_for(b"after", 1000)).unwrap();
        log.sync().unwrap();
        drop(log);
        for be in [be.clone(), be.crash(None)] {
            let log = SegmentLog::open(be, "/s", o()).unwrap();
            assert_eq!(log.get(b"big").unwrap(), Some(frames_for(b"big", 2000)), "durable={durable}");
            assert_eq!(log.get(b"before").unwrap(), Some(frames_for(b"before", 1000)), "durable={durable}");
            assert_eq!(log.get(b"after").unwrap(), Some(frames_for(b"after", 1000)), "durable={durable}");
        }
    }
}

/// Put k (500 bytes) and sync; then a newer value of k whose write is torn: its head reaches the
/// file, not all of its payload (the log is then read-only, and dropped).
fn end_with_a_torn_record_of_k(be: &SimBackend, opts: LogOptions) {
    let log = SegmentLog::open(be.clone(), "/s", opts).unwrap();
    log.put(b"k", &frames_for(b"k", 500)).unwrap();
    log.sync().unwrap();
    be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::TornWrite, sticky: false });
    assert!(log.put(b"k", &frames_for(b"k-new", 3000)).is_err());
}

/// A gathered write whose crcs are computed during the write puts the large payloads down first and
/// everything else (record heads, small records, the partial block) after. A crash anywhere in that
/// sequence (here: one of its writes fails, and the files are reopened as they are) must recover
/// cleanly: nothing reported corrupt, each of the batch's records either absent or whole (none was
/// acknowledged), and a key whose newer record was torn, exactly where the batch began, still reads
/// its older synced value. Writing the small records with the payloads (or the heads alone last)
/// fails this: the torn head stays in front of a valid record, so it is taken for a damaged record
/// in the middle of the log, and wins.
#[test]
fn a_crash_between_the_payloads_and_the_heads_of_a_parallel_crc_write_recovers_cleanly() {
    let opts = || LogOptions { gather_min_bytes: 1024, parallel_crc_min_bytes: 4096, ..opts() };
    let (big, small) = (frames_for(b"big", 6000), frames_for(b"small", 100));
    // A log whose active segment ends with a torn record of k, cut off at the last reopen.
    let setup = || {
        let be = SimBackend::new();
        be.set_gather_writes(true);
        end_with_a_torn_record_of_k(&be, opts());
        let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
        assert_eq!(log.get(b"k").unwrap(), Some(frames_for(b"k", 500)));
        assert!(log.recovery_report().truncated_bytes > 0, "the torn record was cut off");
        (be, log)
    };
    let (be, log) = setup();
    let before = be.write_count();
    log.put_many(&[(&b"big"[..], &big), (&b"small"[..], &small)]).unwrap();
    let writes = be.write_count() - before;
    assert!(writes >= 2, "the payloads, then the rest");
    drop(log);
    for step in 0..writes {
        let (be, log) = setup();
        be.inject(Fault { op: FaultOp::Write, after: step, kind: FaultKind::Eio, sticky: false });
        assert!(log.put_many(&[(&b"big"[..], &big), (&b"small"[..], &small)]).is_err(), "step {step}");
        drop(log);
        let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
        assert!(log.recovery_report().corrupt.is_empty(), "step {step}: {:?}", log.recovery_report());
        assert_eq!(log.get(b"k").unwrap(), Some(frames_for(b"k", 500)), "step {step}");
        for (k, v) in [(&b"big"[..], &big), (&b"small"[..], &small)] {
            let got = log.get(k).unwrap();
            assert!(got.is_none() || got.as_ref() == Some(v), "step {step}: {k:?}");
        }
        assert!(log.verify().unwrap().is_empty(), "step {step}");
        // And the log goes on from there.
        log.put_many(&[(&b"big"[..], &big), (&b"small"[..], &small)]).unwrap();
        drop(log);
        let log = SegmentLog::open(be, "/s", opts()).unwrap();
        assert_eq!(log.get(b"big").unwrap().as_ref(), Some(&big));
        assert_eq!(log.get(b"small").unwrap().as_ref(), Some(&small));
        assert_eq!(log.get(b"k").unwrap(), Some(frames_for(b"k", 500)));
    }
}

/// Recovery of a durable log zeroes what it cut off the end of the segment that writing continues
/// in, and syncs that, before anything new is written there: a stale record head at the published
/// end could otherwise, after a power cut that kept later pages of the next write but not its first,
/// be taken for a damaged record in the middle of the log and win over its key's synced value.
#[test]
fn recovery_erases_the_cut_tail_of_the_segment_it_continues() {
    let be = SimBackend::new();
    end_with_a_torn_record_of_k(&be, opts());
    let seg = be.files().into_iter().find(|p| p.to_string_lossy().ends_with(".seg")).expect("a segment");
    let heads = |be: &SimBackend| be.file_contents(&seg).unwrap().windows(4).filter(|w| w == b"SPRC").count();
    let before = heads(&be); // the synced record, its sync mark and the torn record's head
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    assert!(log.recovery_report().truncated_bytes > 0);
    assert_eq!(heads(&be), before - 1, "the torn record's head is erased");
    // Durably: a power cut now still finds it erased.
    assert_eq!(heads(&be.crash(Some(7))), before - 1);
    assert_eq!(log.get(b"k").unwrap(), Some(frames_for(b"k", 500)));
    log.put(b"k2", &frames_for(b"k2", 700)).unwrap();
    drop(log);
    let log = SegmentLog::open(be, "/s", opts()).unwrap();
    assert_eq!(log.get(b"k2").unwrap(), Some(frames_for(b"k2", 700)));
    assert!(log.recovery_report().corrupt.is_empty());
}

/// After a full file system, a durable log zeroes what the failed write left and syncs it. If that
/// sync fails, the log becomes read-only (an fdatasync is never retried: the kernel may have dropped
/// the dirty pages it could not write), and reads go on.
#[test]
fn a_failed_sync_of_the_erase_after_a_full_disk_makes_the_log_read_only() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"a", &frames_for(b"a", 1000)).unwrap();
    log.sync().unwrap();
    be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::TornEnospc, sticky: false });
    be.inject(Fault { op: FaultOp::Sync, after: 0, kind: FaultKind::Eio, sticky: false });
    assert!(log.put(b"b", &frames_for(b"b", 3000)).unwrap_err().is_no_space());
    assert!(be.fault_fired());
    let err = log.put(b"c", &frames_for(b"c", 100)).unwrap_err();
    assert!(matches!(err, spillway::Error::Poisoned { .. }), "{err}");
    assert_eq!(log.get(b"a").unwrap(), Some(frames_for(b"a", 1000)));
}

/// After a reopen, what was recovered may be in the page cache only (the process crashed, or the log
/// was closed without `sync`): records of the segment that writing continues in, and the directory
/// entries of the segments. A `sync` right after the reopen makes them durable. (Were the recovered
/// segment counted as synced, that `sync` would do nothing.)
#[test]
fn a_sync_after_a_reopen_makes_what_was_recovered_durable() {
    let be = SimBackend::new();
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.put(b"a", &frames_for(b"a", 1000)).unwrap();
    drop(log); // no sync
    assert_eq!(SegmentLog::open(be.crash(None), "/s", opts()).unwrap().get(b"a").unwrap(), None, "not durable yet");
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    log.sync().unwrap();
    drop(log);
    let log = SegmentLog::open(be.crash(None), "/s", opts()).unwrap();
    assert_eq!(log.get(b"a").unwrap(), Some(frames_for(b"a", 1000)));
    // A sync after a reopen of a log whose last record is a sync mark writes nothing (it syncs):
    // opening and syncing over and over does not grow the segment.
    drop(log);
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    let writes = be.write_count();
    log.sync().unwrap();
    assert_eq!(be.write_count(), writes, "no new sync mark");
}

/// A batch whose first group of writes failed while a later group landed leaves records beyond a
/// zero gap. They were never acknowledged. Recovery stops at the gap and counts their epoch: without
/// it, the next life would write with the same epoch and lower sequence numbers; once its records
/// came close, a later scan would resync onto the old ones, accept them, and the old value of `k`
/// would win over the one put and synced after it.
#[test]
fn records_beyond_a_failed_group_never_come_back_over_newer_values() {
    let be = SimBackend::new();
    be.set_queue_writes(true);
    let o = LogOptions {
        segment_bytes: 1 << 20,
        alignment: Some(4096),
        write_group_bytes: 16 << 10,
        write_behind_bytes: 0,
        ..Default::default()
    };
    let log = SegmentLog::open(be.clone(), "/s", o.clone()).unwrap();
    log.put(b"x", &Frames::from(vec![1u8; 100])).unwrap();
    log.sync().unwrap();
    drop(log);

    let log = SegmentLog::open(be.clone(), "/s", o.clone()).unwrap();
    be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Eio, sticky: false });
    let big: Vec<Frames> = (0..4u8).map(|i| Frames::from(vec![i; 4000])).collect();
    let old = Frames::from(b"old".to_vec());
    let mut items: Vec<(&[u8], &Frames)> = vec![(b"a1", &big[0]), (b"a2", &big[1]), (b"a3", &big[2]), (b"a4", &big[3])];
    items.push((b"k", &old));
    assert!(log.put_many(&items).is_err(), "the first group fails");
    drop(log);

    let log = SegmentLog::open(be.clone(), "/s", o.clone()).unwrap();
    assert_eq!(log.get(b"k").unwrap(), None, "never acknowledged");
    let new = Frames::from(b"new".to_vec());
    log.put(b"k", &new).unwrap();
    log.put(b"f1", &big[0]).unwrap();
    log.put(b"f2", &big[1]).unwrap();
    log.sync().unwrap();
    drop(log);

    let log = SegmentLog::open(be, "/s", o).unwrap();
    assert_eq!(log.get(b"k").unwrap(), Some(new), "the value put and synced last");
    assert_eq!(log.get(b"a4").unwrap(), None, "never acknowledged");
    assert_eq!(log.get(b"x").unwrap(), Some(Frames::from(vec![1u8; 100])));
}

/// A reader that panics part-way through `put_stream` (after whole chunks of the value reached the
/// file) leaves the segment as a reader that fails does: what the value wrote is erased, so neither
/// the next records nor a recovery see a partial record. The panic still reaches the caller.
#[test]
fn a_reader_panicking_in_put_stream_leaves_no_partial_record() {
    /// Gives `ok` bytes of `payload`, then fails (an error or a panic).
    struct Stops<'a> {
        payload: &'a [u8],
        ok: usize,
        panic: bool,
    }
    impl std::io::Read for Stops<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.ok == 0 {
                assert!(!self.panic, "the reader panics");
                return Err(std::io::ErrorKind::ConnectionReset.into());
            }
            let n = buf.len().min(self.ok).min(64 << 10);
            buf[..n].copy_from_slice(&self.payload[..n]);
            self.payload = &self.payload[n..];
            self.ok -= n;
            Ok(n)
        }
    }
    let (payload, meta) = spillway_tests::streamed(&Frames::from(spillway_tests::value_for(b"big", 3 << 20)));
    let segments = |panic: bool| {
        let be = SimBackend::new();
        let log = SegmentLog::open(be.clone(), "/s", LogOptions { segment_bytes: 8 << 20, ..opts() }).unwrap();
        log.put(b"before", &frames_for(b"before", 1000)).unwrap();
        let mut src = Stops { payload: &payload, ok: 2 << 20, panic };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| log.put_stream(b"big", &meta, &mut src)));
        assert_eq!(r.is_err(), panic, "a panic goes on to the caller");
        if !panic {
            assert!(r.unwrap().is_err());
        }
        assert_eq!(log.get(b"before").unwrap(), Some(frames_for(b"before", 1000)));
        assert_eq!(log.get(b"big").unwrap(), None);
        drop(log);
        be.files().into_iter().map(|f| spillway_tests::salt_free(&be.file_contents(&f).unwrap())).collect::<Vec<_>>()
    };
    let after_error = segments(false);
    assert!(after_error == segments(true), "a panic left other bytes in the segment than an error does");
}
