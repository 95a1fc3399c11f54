//! Persistent stores: reopening finds what was spilled, `sync_spills`, a spill store starting empty,
//! `flush` of values held only in memory.

use std::sync::Arc;

use spillway::backend::{Fault, FaultKind, FaultOp};
use spillway::{Error, SimBackend, Store, StoreConfig, Tier};
use spillway_tests::store::*;

/// In a persistent store a remove writes a tombstone. If that write fails, the remove fails and the
/// key stays, value and accounting alike; once the write can succeed, the remove does.
#[test]
fn a_persistent_remove_that_cannot_write_keeps_the_key() {
    let be = SimBackend::new();
    let s = Store::open(TestCodec::default(), be.clone(), "/store", persistent(5_000)).unwrap();
    for i in 0..10u8 {
        s.put(&[i], val(i, 2000)).unwrap();
    }
    let k = (0..10u8).find(|&i| s.tier(&[i]) == Some(Tier::Disk)).expect("something spilled");
    be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Enospc, sticky: true });
    let e = s.remove(&[k]).unwrap_err();
    assert!(e.is_no_space(), "{e}");
    assert!(s.contains(&[k]));
    assert_eq!(*s.get(&[k]).unwrap().unwrap(), val(k, 2000));
    s.check_accounting().unwrap();
    be.clear_faults();
    assert!(s.remove(&[k]).unwrap());
    assert!(!s.contains(&[k]));
    s.check_accounting().unwrap();
    let on_disk: Vec<u8> = (0..10u8).filter(|&i| s.tier(&[i]) == Some(Tier::Disk)).collect();
    drop(s);
    let s = Store::open(TestCodec::default(), be, "/store", persistent(5_000)).unwrap();
    assert!(!s.contains(&[k]), "the remove survives a reopen");
    let found: Vec<u8> = (0..10u8).filter(|&i| s.contains(&[i])).collect();
    assert_eq!(found, on_disk);
}

#[test]
fn a_persistent_store_never_defers_writes() {
    let be = SimBackend::new();
    let c = StoreConfig { target_bytes: 5_000, persistent: true, ..Default::default() };
    assert!(c.log.write_behind_bytes > 0, "the default config defers");
    let (s, ops) = spill_ten(&be, c);
    let spilled = (3..=10u8).filter(|&i| s.tier(&[i]) == Some(Tier::Disk)).count() as u64;
    assert!(spilled >= 5 && be.op_count() >= ops + spilled / 2, "{spilled} spilled in {} ops", be.op_count() - ops);
}

/// `sync_spills`: every spill batch is synced, so what was spilled survives a power cut without a
/// `flush`. A sync that fails leaves the spilled values readable (the log refuses further writes),
/// and the batch still counts as written in the metrics.
#[test]
fn sync_spills_makes_each_spill_durable() {
    let be = SimBackend::new();
    let c = StoreConfig { sync_spills: true, ..persistent(3_000) };
    let spilled: Vec<u8> = {
        let s = Store::open(TestCodec::default(), be.clone(), "/store", c.clone()).unwrap();
        for i in 0..6u8 {
            s.put(&[i], val(i, 1000)).unwrap();
        }
        (0..6u8).filter(|i| s.tier(&[*i]) == Some(Tier::Disk)).collect()
    }; // dropped without a flush
    assert!(!spilled.is_empty());
    let s = Store::open(TestCodec::default(), be.crash(None), "/store", c.clone()).unwrap();
    for i in &spilled {
        assert_eq!(s.tier(&[*i]), Some(Tier::Disk), "key {i} lost in the power cut");
        assert_eq!(*s.get(&[*i]).unwrap().unwrap(), val(*i, 1000));
    }
    drop(s);

    let be = SimBackend::new();
    let s = Store::open(TestCodec::default(), be.clone(), "/sync-fails", c).unwrap();
    be.inject(Fault { op: FaultOp::Sync, after: 0, kind: FaultKind::Eio, sticky: true });
    let mut i = 0u8;
    while s.metrics().activity("disk-write").count == 0 {
        s.put(&[i], val(i, 1000)).unwrap(); // never an error: the failure is reported
        i += 1;
        assert!(i < 20, "nothing was spilled");
    }
    // The batch whose sync failed is counted as written (it was) and reported as a failure.
    let m = s.metrics();
    assert_eq!(m.spill_failures, 1, "{m:?}");
    for i in i..6 {
        s.put(&[i], val(i, 1000)).unwrap();
    }
    for i in 0..6u8 {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 1000));
    }
    s.check_accounting().unwrap();
}

#[test]
fn a_reopened_store_finds_its_spilled_data() {
    let be = SimBackend::new();
    {
        let s = Store::open(TestCodec::default(), be.clone(), "/store", persistent(3_000)).unwrap();
        for i in 0..5u8 {
            s.put(&[i], val(i, 1000)).unwrap();
        }
        s.put(b"big", val(9, 5000)).unwrap(); // heavier than the target: straight to disk
        s.flush().unwrap();
    }
    let s = Store::open(TestCodec::default(), be.crash(None), "/store", persistent(3_000)).unwrap();
    let on_disk: Vec<u8> = (0..5u8).filter(|i| s.tier(&[*i]) == Some(Tier::Disk)).collect();
    assert!(!on_disk.is_empty());
    for i in on_disk {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 1000));
    }
    // Still heavier than the target after the reopen: served from disk, not promoted, so reading it
    // does not push the values read back before it out of memory.
    let in_memory: Vec<u8> = (0..5u8).filter(|i| s.tier(&[*i]).is_some_and(|t| t != Tier::Disk)).collect();
    assert!(!in_memory.is_empty());
    assert_eq!(*s.get(b"big").unwrap().unwrap(), val(9, 5000));
    assert_eq!(s.tier(b"big"), Some(Tier::Disk));
    for i in in_memory {
        assert_ne!(s.tier(&[i]), Some(Tier::Disk), "key {i} was evicted to make room for the large value");
    }
    s.check_accounting().unwrap();
}

#[test]
fn a_spill_store_starts_empty_and_a_persistent_one_keeps_deletes() {
    let be = SimBackend::new();
    {
        let s = Store::open(TestCodec::default(), be.clone(), "/store", cfg(1_000)).unwrap();
        for i in 0..5u8 {
            s.put(&[i], val(i, 800)).unwrap();
        }
    }
    let s = Store::open(TestCodec::default(), be.clone(), "/store", cfg(1_000)).unwrap();
    assert!(s.is_empty(), "a non-persistent store discards what an earlier process spilled");
    drop(s);
    {
        let s = Store::open(TestCodec::default(), be.clone(), "/p", persistent(1_000)).unwrap();
        for i in 0..5u8 {
            s.put(&[i], val(i, 800)).unwrap();
        }
        assert_eq!(s.tier(&[0]), Some(Tier::Disk));
        // Read back (the disk copy is kept), then remove: the removal must survive reopen.
        assert_eq!(*s.get(&[0]).unwrap().unwrap(), val(0, 800));
        assert!(s.remove(&[0]).unwrap());
        s.flush().unwrap();
    }
    let s = Store::open(TestCodec::default(), be, "/p", persistent(1_000)).unwrap();
    assert!(!s.contains(&[0]));
    assert!(s.contains(&[1]));
}

/// A persistent store's `flush` writes what it holds only in memory, so its whole contents survive
/// a crash and reopen: values that were never evicted, and a small value that overwrote a spilled
/// one (whose old record is tombstoned at once, so without the flush the key would come back
/// neither old nor new). The values stay in memory, in their tiers, with a disk copy: reading them
/// reads nothing from disk, and evicting them afterwards writes nothing (a flush that evicted
/// everything would leave every later get a disk read).
#[test]
fn a_persistent_flush_writes_what_is_held_only_in_memory() {
    let be = SimBackend::new();
    {
        let s = Store::open(TestCodec::default(), be.clone(), "/store", persistent(10_000)).unwrap();
        s.put(b"over", val(b'o', 20_000)).unwrap(); // heavier than the target: on disk
        s.put(b"over", val(b'n', 100)).unwrap(); // now in memory only
        for i in 0..5u8 {
            s.put(&[i], val(i, 1000)).unwrap();
        }
        s.put_serialized(b"ser", ser(&val(b's', 500))).unwrap();
        assert_eq!(s.tier(&[0]), Some(Tier::Materialized), "nothing evicted before the flush");
        let memory = s.memory_bytes();
        s.flush().unwrap();
        s.check_accounting().unwrap();
        assert_eq!(s.memory_bytes(), memory, "the flush evicted nothing");
        for i in 0..5u8 {
            assert_eq!(s.tier(&[i]), Some(Tier::Materialized), "key {i}");
        }
        assert_eq!(s.tier(b"ser"), Some(Tier::Serialized));
        let m = s.metrics();
        assert_eq!(m.spilled_memory_bytes, 5 * 1001 + 101 + 501, "every value has its disk copy");
        let reads = m.activity("disk-read").count;
        assert_eq!(*s.get(&[3]).unwrap().unwrap(), val(3, 1000), "still readable after the flush");
        assert_eq!(*s.get(b"ser").unwrap().unwrap(), val(b's', 500));
        assert_eq!(s.metrics().activity("disk-read").count, reads, "served from memory");
        let writes = be.write_count();
        while s.evict().unwrap() > 0 {}
        assert_eq!(s.memory_bytes(), 0);
        assert_eq!(be.write_count(), writes, "evicting values that have their disk copy writes nothing");
        s.check_accounting().unwrap();
    }
    let s = Store::open(TestCodec::default(), be.crash(None), "/store", persistent(10_000)).unwrap();
    assert_eq!(s.len(), 7);
    assert_eq!(*s.get(b"over").unwrap().unwrap(), val(b'n', 100));
    for i in 0..5u8 {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 1000));
    }
    assert_eq!(*s.get(b"ser").unwrap().unwrap(), val(b's', 500));
    s.check_accounting().unwrap();
}

/// A value heavier than the target that `max_spill` kept in memory lives on disk once a `flush`
/// (after space was freed) writes it: it does not stay in memory above the target.
#[test]
fn a_persistent_flush_moves_a_heavy_value_it_writes_to_disk() {
    let c = StoreConfig { max_spill_bytes: Some(6_000), ..persistent(3_000) };
    let s = Store::open(TestCodec::default(), SimBackend::new(), "/store", c).unwrap();
    s.put(b"a", val(b'a', 5_000)).unwrap();
    assert_eq!(s.tier(b"a"), Some(Tier::Disk));
    s.put(b"b", val(b'b', 5_000)).unwrap(); // refused by max_spill: kept in memory, as the object
    assert_eq!(s.tier(b"b"), Some(Tier::Materialized));
    assert!(s.memory_bytes() > 3_000);
    assert!(s.remove(b"a").unwrap());
    s.flush().unwrap();
    assert_eq!(s.tier(b"b"), Some(Tier::Disk));
    assert_eq!(s.memory_bytes(), 0);
    assert_eq!(*s.get(b"b").unwrap().unwrap(), val(b'b', 5_000));
    s.check_accounting().unwrap();
}

/// Values a persistent store cannot write at `flush` (here `max_spill` is reached) stay in memory,
/// readable, and `flush` says how many would not survive a restart.
#[test]
fn a_persistent_flush_reports_values_it_could_not_write() {
    let c = StoreConfig { max_spill_bytes: Some(1_500), ..persistent(10_000) };
    let s = Store::open(TestCodec::default(), SimBackend::new(), "/store", c).unwrap();
    for i in 0..3u8 {
        s.put(&[i], val(i, 1000)).unwrap();
    }
    let err = s.flush().unwrap_err();
    assert!(matches!(err, Error::NotPersisted { keys: 2 }), "{err}");
    for i in 0..3u8 {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 1000));
    }
    s.check_accounting().unwrap();
}

/// A persistent store's `flush` that runs while another thread's eviction is demoting a value
/// (object -> compressed frames, no disk write) still writes that value before it returns: its
/// first pass had to skip it, being demoted.
#[test]
fn a_persistent_flush_writes_a_value_another_thread_was_demoting() {
    let be = SimBackend::new();
    let c = StoreConfig { compress_in_memory: true, ..persistent(4_000) };
    let s = Arc::new(Store::open(GatedCodec::default(), be.clone(), "/store", c.clone()).unwrap());
    let mut slow = b"slow".to_vec();
    slow.resize(3000, b's');
    s.put(b"slow", slow.clone()).unwrap();
    s.codec().gate.arm();
    let putter = {
        let s = s.clone();
        std::thread::spawn(move || s.put(b"x", val(b'x', 1500)))
    };
    assert!(s.codec().gate.wait_parked(), "the demotion never started");
    let flusher = {
        let s = s.clone();
        std::thread::spawn(move || s.flush())
    };
    // The flush has made its first pass once it has written `x`; `slow` it had to skip.
    let mut spins = 0u64;
    while s.log().location(b"x").is_none() {
        spins += 1;
        assert!(spins < 50_000_000, "the flush never wrote x");
        std::thread::yield_now();
    }
    s.codec().gate.release();
    putter.join().unwrap().unwrap();
    flusher.join().unwrap().unwrap();
    drop(s);
    let s = Store::open(GatedCodec::default(), be.crash(None), "/store", c).unwrap();
    assert_eq!(*s.get(b"slow").unwrap().unwrap(), slow, "flushed before the power cut");
    assert_eq!(*s.get(b"x").unwrap().unwrap(), val(b'x', 1500));
}

/// A persistent store's put of a value heavier than the target, over a key whose value is on disk:
/// the new record is written before the old one goes (the newer record supersedes it, by its
/// sequence number at the next open too), so a crash at any point of the put leaves the old value
/// or the new one, never neither. The crash: every disk operation from the `crash_at`-th of the
/// put on fails (the process died there), and the store is opened again on what was written.
#[test]
fn a_crash_during_a_large_put_leaves_the_old_value_or_the_new_one() {
    let (old, new) = (val(1, 8000), val(2, 9000));
    for crash_at in 0.. {
        let be = SimBackend::new();
        let s = Store::open(TestCodec::default(), be.clone(), "/store", persistent(5_000)).unwrap();
        s.put(b"k", old.clone()).unwrap(); // heavier than the target: straight to disk
        s.flush().unwrap();
        assert_eq!(s.tier(b"k"), Some(Tier::Disk));
        be.inject(Fault { op: FaultOp::Any, after: crash_at, kind: FaultKind::Eio, sticky: true });
        let put = s.put(b"k", new.clone());
        let crashed = be.fault_fired();
        s.check_accounting().unwrap();
        drop(s);
        be.clear_faults();
        let s = Store::open(TestCodec::default(), be, "/store", persistent(5_000)).unwrap();
        let got = s.get(b"k").unwrap_or_else(|e| panic!("crash at operation {crash_at}: {e}"));
        let got = got.map(|v| v.to_vec());
        assert!(
            got.as_ref() == Some(&old) || got.as_ref() == Some(&new),
            "crash at operation {crash_at} (the put: {put:?}): the key holds {:?} bytes",
            got.as_ref().map(|v| v.len())
        );
        if !crashed {
            assert_eq!(got, Some(new.clone()), "no crash: the new value");
            break;
        }
        assert!(crash_at < 50, "the put never ends");
    }
}
