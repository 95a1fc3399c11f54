//! Concurrency: deserialize once under concurrent gets (sync and async), gets, puts and removes that
//! do not wait for a spill write, keys removed or overwritten while their write runs, and random
//! concurrent operations with exact accounting.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};

use spillway::backend::{Fault, FaultKind, FaultOp};
use spillway::{SimBackend, Store, StoreConfig, Tier};
use spillway_tests::store::*;

#[test]
fn concurrent_gets_of_one_key_deserialize_once() {
    for spilled in [false, true] {
        for round in 0..20 {
            let (s, _) = open(1 << 20);
            s.put_serialized(b"k", ser(&val(5, 100_000))).unwrap();
            if spilled {
                assert!(s.evict().unwrap() > 0);
                assert_eq!(s.tier(b"k"), Some(Tier::Disk));
            }
            let s = Arc::new(s);
            let barrier = Arc::new(Barrier::new(8));
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let (s, b) = (s.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        b.wait();
                        s.get(b"k").unwrap().unwrap()
                    })
                })
                .collect();
            let vals: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            assert_eq!(s.codec().deserialized.load(Ordering::SeqCst), 1, "spilled={spilled} round {round}");
            assert!(vals.iter().all(|v| Arc::ptr_eq(v, &vals[0])));
            assert_eq!(s.metrics().activity("deserialize").count, 1);
        }
    }
}

/// Four threads run a random mix of every operation over a few keys, with a target small enough that
/// values move between all tiers. A value's first byte names its key and generation, so a read can
/// check it belongs to the key it asked for. No operation may fail (a get racing a remove of a spilled
/// key must not report a "vanished" error), and the accounting must end exact. A persistent store also
/// flushes now and then (writing disk copies of values other threads are evicting, reading and
/// removing), and after a last flush its contents survive a power cut.
#[test]
fn random_concurrent_operations_never_fail_and_keep_exact_accounting() {
    for (compress, persist) in [(false, false), (true, false), (false, true), (true, true)] {
        let be = SimBackend::new();
        let c = StoreConfig { compress_in_memory: compress, persistent: persist, ..cfg(20_000) };
        let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/store", c.clone()).unwrap());
        let handles: Vec<_> = (0..4u64)
            .map(|t| {
                let s = s.clone();
                std::thread::spawn(move || {
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t + 1);
                    for i in 0..3000u64 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let k = (x % 6) as u8;
                        let key = [b'k', k];
                        let len = [500usize, 5_000, 25_000][(x >> 8) as usize % 3];
                        let v = {
                            let mut v = val(k, len);
                            v[1] = (i % 251) as u8; // generation, for debugging
                            v
                        };
                        let check = |got: &[u8]| assert_eq!(got[0], k, "a value of another key");
                        match (x >> 16) % 7 {
                            0 => s.put(&key, v).unwrap(),
                            1 => s.put_serialized(&key, ser(&v)).unwrap(),
                            2 | 3 => {
                                if let Some(got) = s.get(&key).unwrap() {
                                    check(&got);
                                }
                            }
                            4 => {
                                if let Some(f) = s.get_serialized(&key).unwrap() {
                                    check(&f.0[1]);
                                }
                            }
                            5 => {
                                s.remove(&key).unwrap();
                            }
                            _ if persist && (x >> 24) % 2 == 0 => s.flush().unwrap(),
                            _ => {
                                s.evict().unwrap();
                            }
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        s.check_accounting().unwrap();
        for k in 0..6u8 {
            if let Some(v) = s.get(&[b'k', k]).unwrap() {
                assert_eq!(v[0], k);
            }
        }
        s.check_accounting().unwrap();
        if persist {
            s.flush().unwrap();
            let before: Vec<Option<Vec<u8>>> =
                (0..6u8).map(|k| s.get(&[b'k', k]).unwrap().map(|v| v.to_vec())).collect();
            drop(s);
            let s = Store::open(TestCodec::default(), be.crash(None), "/store", c).unwrap();
            for (k, want) in (0..6u8).zip(before) {
                assert_eq!(s.get(&[b'k', k]).unwrap().map(|v| v.to_vec()), want, "compress={compress}: key {k}");
            }
            s.check_accounting().unwrap();
        }
    }
}

/// The async forms agree with the sync ones on every tier (materialized, serialized, compressed, on
/// disk, large), share one materialization through the key's slot, and leave the accounting exact.
#[test]
fn async_gets_agree_with_sync_gets_on_every_tier() {
    use spillway::task::block_on;
    for compress in [false, true] {
        let c = StoreConfig { compress_in_memory: compress, ..cfg(10_000) };
        let s = Store::open(TestCodec::default(), SimBackend::new(), "/store", c).unwrap();
        s.put(b"large", val(9, 20_000)).unwrap(); // heavier than the target: straight to disk
        for i in 0..8u8 {
            s.put_serialized(&[i], ser(&val(i, 2000))).unwrap();
        }
        s.put(b"object", val(42, 1000)).unwrap();
        let tiers: std::collections::HashSet<Tier> = (0..8u8).filter_map(|i| s.tier(&[i])).collect();
        assert!(tiers.contains(&Tier::Disk) && tiers.len() >= 2, "{tiers:?}");
        fn is_send<T: Send>(_: &T) {}
        is_send(&s.get_async(b"large"));
        is_send(&s.get_serialized_async(b"large"));
        for key in [&b"large"[..], b"object", &[0], &[3], &[7], b"absent"] {
            let f_async = block_on(s.get_serialized_async(key)).unwrap();
            assert_eq!(f_async, s.get_serialized(key).unwrap(), "{key:?}");
            let a = block_on(s.get_async(key)).unwrap();
            let b = s.get(key).unwrap();
            assert_eq!(a.as_deref(), b.as_deref(), "{key:?}");
            // Outside the large value (never kept materialized), the async get materialized the value
            // in the key's slot, and the sync get found it there.
            if let (Some(a), Some(b)) = (&a, &b) {
                assert_eq!(Arc::ptr_eq(a, b), key != b"large", "{key:?}");
            }
            s.check_accounting().unwrap();
        }
    }
}

/// Sync and async gets of one spilled key from eight threads at once: one deserialize, one `Arc`.
#[test]
fn concurrent_sync_and_async_gets_deserialize_once() {
    use spillway::task::block_on;
    for round in 0..20 {
        let (s, _) = open(1 << 20);
        s.put_serialized(b"k", ser(&val(5, 100_000))).unwrap();
        assert!(s.evict().unwrap() > 0);
        let s = Arc::new(s);
        let barrier = Arc::new(Barrier::new(8));
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let (s, b) = (s.clone(), barrier.clone());
                std::thread::spawn(move || {
                    b.wait();
                    if t % 2 == 0 {
                        block_on(s.get_async(b"k")).unwrap().unwrap()
                    } else {
                        s.get(b"k").unwrap().unwrap()
                    }
                })
            })
            .collect();
        let vals: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(s.codec().deserialized.load(Ordering::SeqCst), 1, "round {round}");
        assert!(vals.iter().all(|v| Arc::ptr_eq(v, &vals[0])));
        s.check_accounting().unwrap();
    }
}

/// An async get dropped after its first poll (a task cancelled mid-read) changes nothing: the value is
/// still there and the accounting is exact. On io_uring with O_DIRECT the read is still in flight at
/// the first poll (the simulated backend completes at once, so it cannot show this); the rounds repeat
/// until one was, and at least one must be.
#[test]
fn a_dropped_get_async_leaves_the_store_as_it_was() {
    use std::future::Future;
    use std::task::{Context, Waker};
    let Some(be) = spillway_tests::uring_direct_or_skip("a_dropped_get_async_leaves_the_store_as_it_was", true) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(TestCodec::default(), be, dir.path(), cfg(1 << 20)).unwrap();
    s.put_serialized(b"k", ser(&val(5, 100_000))).unwrap();
    let mut dropped_in_flight = 0;
    for _ in 0..20 {
        assert!(s.evict().unwrap() > 0);
        assert_eq!(s.tier(b"k"), Some(Tier::Disk));
        let mut cx = Context::from_waker(Waker::noop());
        let mut f = Box::pin(s.get_async(b"k"));
        let first = f.as_mut().poll(&mut cx);
        drop(f);
        s.check_accounting().unwrap();
        if first.is_pending() {
            dropped_in_flight += 1;
            assert_eq!(s.tier(b"k"), Some(Tier::Disk), "a dropped read promotes nothing");
        }
        assert_eq!(*s.get(b"k").unwrap().unwrap(), val(5, 100_000));
        s.check_accounting().unwrap();
        if dropped_in_flight >= 3 {
            break;
        }
    }
    assert!(dropped_in_flight > 0, "no read was still in flight at its first poll");
}

#[test]
fn gets_puts_and_removes_do_not_wait_for_a_spill_write() {
    let be = GatedBackend::default();
    let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/store", cfg(4000)).unwrap());
    let t = park_a_spill_of_old(&s, &be);
    // The value being written is still served, from memory; other keys come and go freely.
    assert_eq!(meanwhile(&s, b"old"), (Some(3000), Some(3000)));
    be.gate.release();
    t.join().unwrap().unwrap();
    s.check_accounting().unwrap();
    assert_eq!(s.get(b"old").unwrap().unwrap().len(), 3000);
    assert!(s.log().location(b"old").is_some(), "the spilled value keeps its disk copy");
}

#[test]
fn a_key_removed_while_its_spill_write_runs_leaves_no_record() {
    for persistent_store in [false, true] {
        let be = GatedBackend::default();
        let c = if persistent_store { persistent(4000) } else { cfg(4000) };
        let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/store", c.clone()).unwrap());
        let t = park_a_spill_of_old(&s, &be);
        let s2 = s.clone();
        assert!(without_waiting(move || s2.remove(b"old").unwrap()));
        be.gate.release();
        t.join().unwrap().unwrap();
        assert!(!s.contains(b"old"));
        assert_eq!(s.log().location(b"old"), None, "the orphaned record was dropped from the log");
        s.check_accounting().unwrap();
        if persistent_store {
            drop(s);
            let s = Store::open(TestCodec::default(), be.clone(), "/store", c).unwrap();
            assert!(!s.contains(b"old"), "a removed key came back after reopening");
        }
    }
}

/// The same race in a persistent store on a full disk: the record of the removed key cannot get its
/// tombstone, so the store forgets it instead. The store and its log still agree.
#[test]
fn a_key_removed_while_its_spill_write_runs_on_a_full_disk_leaves_no_record_in_the_index() {
    let be = GatedBackend::default();
    let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/store", persistent(4000)).unwrap());
    s.put(b"pre", val(b'p', 5000)).unwrap(); // heavier than the target: on disk, the segment exists
    let t = park_a_spill_of_old(&s, &be);
    let s2 = s.clone();
    assert!(without_waiting(move || s2.remove(b"old").unwrap()));
    // The parked spill write succeeds; the tombstone after it finds the disk full.
    be.inner.inject(Fault { op: FaultOp::Write, after: 1, kind: FaultKind::Enospc, sticky: true });
    be.gate.release();
    t.join().unwrap().unwrap();
    assert!(be.inner.fault_fired(), "the tombstone write met the full disk");
    assert!(!s.contains(b"old"));
    assert_eq!(s.log().location(b"old"), None, "the orphaned record was dropped from the index");
    s.check_accounting().unwrap();
}

#[test]
fn a_key_overwritten_while_its_spill_write_runs_keeps_the_new_value() {
    let be = GatedBackend::default();
    let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/store", cfg(4000)).unwrap());
    let t = park_a_spill_of_old(&s, &be);
    let s2 = s.clone();
    without_waiting(move || s2.put(b"old", val(b'2', 100)).unwrap());
    be.gate.release();
    t.join().unwrap().unwrap();
    assert_eq!(*s.get(b"old").unwrap().unwrap(), val(b'2', 100));
    assert_eq!(s.log().location(b"old"), None, "the stale record of the old value was dropped");
    s.check_accounting().unwrap();
    // Spilled later, the new value is the one read back.
    s.evict().unwrap();
    s.evict().unwrap();
    assert_eq!(s.tier(b"old"), Some(Tier::Disk));
    assert_eq!(*s.get(b"old").unwrap().unwrap(), val(b'2', 100));
}

#[test]
fn a_large_put_of_a_key_being_spilled_waits_for_that_write_and_wins() {
    let be = GatedBackend::default();
    let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/store", cfg(4000)).unwrap());
    let t = park_a_spill_of_old(&s, &be);
    // A value over the target goes straight to disk: it must not race the parked write of "old".
    let serialized = s.codec().serialized.load(Ordering::SeqCst);
    let s2 = s.clone();
    let large = std::thread::spawn(move || s2.put(b"old", val(b'L', 9000)));
    // Released only once the large put has serialized its value: from there it goes to the store,
    // where the parked write of the same key makes it wait.
    let mut spins = 0u64;
    while s.codec().serialized.load(Ordering::SeqCst) == serialized {
        spins += 1;
        assert!(spins < 50_000_000, "the large put never serialized");
        std::thread::yield_now();
    }
    be.gate.release();
    t.join().unwrap().unwrap();
    large.join().unwrap().unwrap();
    assert_eq!(s.tier(b"old"), Some(Tier::Disk));
    assert_eq!(*s.get(b"old").unwrap().unwrap(), val(b'L', 9000));
    let st = s.log().stats();
    assert_eq!(st.live_records, s.log().len() as u64, "one record per key: the older write's was dropped");
    s.check_accounting().unwrap();
}

/// Back-pressure with spill writes running outside the lock: however many threads put at once, memory
/// stays within the target plus the batches in flight (at most one per putting thread, each about
/// one value plus the eviction slack of target / 16). Each put checks the bound when it returns.
#[test]
fn concurrent_puts_keep_memory_within_target_plus_writes_in_flight() {
    const THREADS: u64 = 4;
    const VALUE: u64 = 3000 + 1; // the codec's size_of adds one byte
    let target = 40_000;
    let (s, _) = open(target);
    let s = Arc::new(s);
    let bound = target + THREADS * 2 * (VALUE + target / 16);
    let barrier = Arc::new(Barrier::new(THREADS as usize));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (s, barrier) = (s.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let mut peak = 0;
                for i in 0..300u32 {
                    s.put(format!("t{t}-{i}").as_bytes(), val(t as u8, 3000)).unwrap();
                    peak = peak.max(s.memory_bytes());
                }
                peak
            })
        })
        .collect();
    let peak = handles.into_iter().map(|h| h.join().unwrap()).max().unwrap();
    assert!(peak <= bound, "memory reached {peak} bytes, bound {bound}");
    assert!(s.memory_bytes() <= target, "after the last put returned: {}", s.memory_bytes());
    assert_eq!(s.len(), (THREADS * 300) as usize);
    s.check_accounting().unwrap();
}

#[test]
fn gets_and_puts_do_not_wait_for_an_evicted_objects_serialization() {
    let be = SimBackend::new();
    let s = Arc::new(Store::open(GatedCodec::default(), be, "/store", cfg(4000)).unwrap());
    let mut slow = b"slow".to_vec();
    slow.resize(3000, b's');
    s.put(b"slow", slow.clone()).unwrap();
    s.codec().gate.arm();
    let putter = {
        let s = s.clone();
        std::thread::spawn(move || s.put(b"new", val(b'n', 3000)))
    };
    assert!(s.codec().gate.wait_parked(), "the eviction never serialized `slow`");
    // While `slow` is being serialized: it is still served as the object it is, and other keys
    // come and go.
    assert_eq!(meanwhile(&s, b"slow"), (Some(3000), Some(3000)));
    s.codec().gate.release();
    putter.join().unwrap().unwrap();
    assert!(s.memory_bytes() <= 4000, "{}", s.memory_bytes());
    assert_eq!(*s.get(b"slow").unwrap().unwrap(), slow);
    s.check_accounting().unwrap();
}

/// `check_accounting` while a spill's record is in the log but the spill has not settled yet (its
/// sync is parked): the key is being written, so its entry may or may not have its disk copy yet.
#[test]
fn accounting_checks_pass_while_a_spill_write_settles() {
    let be = GatedBackend::default();
    let c = StoreConfig { sync_spills: true, ..cfg(5_000) };
    let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/g", c).unwrap());
    s.put(b"old", val(b'o', 3000)).unwrap();
    be.sync_gate.arm();
    let t = {
        let s = s.clone();
        std::thread::spawn(move || s.put(b"new", val(b'n', 3000)))
    };
    assert!(be.sync_gate.wait_parked(), "the spill never reached its sync");
    assert!(s.log().location(b"old").is_some(), "the record landed");
    s.check_accounting().unwrap();
    be.sync_gate.release();
    t.join().unwrap().unwrap();
    assert_eq!(s.tier(b"old"), Some(Tier::Disk));
    s.check_accounting().unwrap();
}
