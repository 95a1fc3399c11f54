//! Failures while storing: `max_spill`, serialize failures and codec panics, disk failures and a full
//! disk, failed write-behind, stuck keys. None of them loses a value or fails another caller.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use spillway::backend::{Fault, FaultKind, FaultOp};
use spillway::{Error, LogOptions, SimBackend, Store, StoreConfig, Tier};
use spillway_tests::store::*;

#[test]
fn max_spill_refusal_keeps_data_in_memory_and_is_reported() {
    let be = SimBackend::new();
    let c = StoreConfig { max_spill_bytes: Some(7_000), ..cfg(4_000) };
    let s = Store::open(TestCodec::default(), be, "/store", c).unwrap();
    for i in 0..6u8 {
        s.put(&[i], val(i, 2999)).unwrap(); // never an error
    }
    let m = s.metrics();
    assert!(m.max_spill_refusals > 0);
    assert!(m.spilled_memory_bytes <= 7_000, "{m:?}");
    assert!(m.memory_bytes > 4_000, "refused entries stay in memory above the target");
    s.check_accounting().unwrap(); // stuck entries are out of the LRU order, and listed
    for i in 0..6u8 {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 2999), "nothing is lost");
    }
    // Freeing disk space lets evictions proceed again.
    let on_disk: Vec<u8> = (0..6u8).filter(|i| s.tier(&[*i]) == Some(Tier::Disk)).collect();
    for i in &on_disk {
        s.remove(&[*i]).unwrap();
    }
    s.put(b"new", val(7, 10)).unwrap();
    assert!(s.metrics().spilled_memory_bytes > 0);
    s.check_accounting().unwrap();
}

#[test]
fn serialize_failure_of_the_inserted_key_is_an_error_and_the_key_is_forgotten() {
    let (s, _) = open(1_000);
    let mut v = b"unpicklable".to_vec();
    v.resize(5_000, 0);
    let err = s.put(b"bad", v.clone()).unwrap_err();
    assert!(matches!(err, Error::Codec { op: "serialize", .. }), "{err}");
    assert!(!s.contains(b"bad"));
    assert_eq!(s.memory_bytes(), 0);
    // Over an existing key: the key is forgotten, not left at its old value.
    s.put(b"bad", val(1, 100)).unwrap();
    assert!(s.put(b"bad", v).is_err());
    assert!(!s.contains(b"bad"));
    s.check_accounting().unwrap();
}

/// A store holding `stubborn` (3000 bytes starting with `prefix`) in memory after a put that had to
/// evict it (target 5000) and could not serialize it.
fn with_a_stubborn_key(prefix: &[u8]) -> (Store<TestCodec, SimBackend>, Vec<u8>) {
    let (s, _) = open(5_000);
    let mut v = prefix.to_vec();
    v.resize(3_000, 0);
    s.put(b"stubborn", v.clone()).unwrap();
    s.put(b"next", val(1, 3000)).unwrap(); // must evict: stubborn can't be serialized, so next goes
    assert_eq!(s.tier(b"stubborn"), Some(Tier::Materialized));
    assert!(s.metrics().spill_failures >= 1);
    (s, v)
}

#[test]
fn serialize_failure_while_evicting_another_key_keeps_it_in_memory() {
    let (s, v) = with_a_stubborn_key(b"unpicklable");
    assert_eq!(*s.get(b"stubborn").unwrap().unwrap(), v);
    assert_eq!(s.len(), 2);
}

/// A codec that panics while evicting a key is a failed serialize like any other: the key stays in
/// memory and the eviction finishes, so the key is not left marked as being written (a put of it
/// would then wait forever). The caller whose put triggered the eviction sees no error; a put of
/// the panicking value itself straight to disk is a codec error for that put.
#[test]
fn a_codec_panic_while_evicting_is_a_serialize_failure() {
    let (s, _) = with_a_stubborn_key(b"panicky");
    // Not left marked as being written: a put of the same key returns.
    s.put(b"stubborn", val(2, 100)).unwrap();
    assert_eq!(*s.get(b"stubborn").unwrap().unwrap(), val(2, 100));
    let mut big = b"panicky".to_vec();
    big.resize(6_000, 0); // heavier than the target: serialized at once, for the disk
    let err = s.put(b"big", big).unwrap_err();
    assert!(matches!(err, Error::Codec { op: "serialize", .. }) && err.to_string().contains("panic"), "{err}");
    assert!(!s.contains(b"big"));
    s.check_accounting().unwrap();
}

#[test]
fn disk_failure_keeps_data_in_memory() {
    let (s, be) = open(5_000);
    be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Eio, sticky: true });
    for i in 0..5u8 {
        s.put(&[i], val(i, 2000)).unwrap();
    }
    assert!(s.metrics().spill_failures >= 1);
    for i in 0..5u8 {
        assert_ne!(s.tier(&[i]), Some(Tier::Disk));
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 2000));
    }
}

/// A panic in the backend's write (a bug in a backend) reaches the put whose eviction ran the write,
/// but only after the store has settled the batch as a failed write: no key is left marked as being
/// written (a `flush`, or a put of the key, would wait for it forever) and nothing is lost. The log,
/// which cannot know what the panicking write left in the file, turns read-only as after an EIO:
/// in a store that opens no fresh log (`fresh_logs: 0`; `store_fresh_logs.rs` has the others), later
/// spills fail and keep their values in memory.
#[test]
fn a_backend_panic_while_spilling_leaves_no_key_waiting_for_its_write() {
    for write_behind in [0, 64 << 10] {
        let be = SimBackend::new();
        let mut c = StoreConfig { fresh_logs: 0, ..cfg(5_000) };
        c.log.write_behind_bytes = write_behind;
        let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/store", c).unwrap());
        s.put(b"early", val(b'e', 1000)).unwrap();
        be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Panic, sticky: false });
        let mut panics = 0;
        for i in 0..40u8 {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.put(&[i], val(i, 2000)))) {
                Ok(r) => r.unwrap(),
                Err(_) => panics += 1,
            }
        }
        assert!(be.fault_fired(), "write_behind={write_behind}: the write was attempted");
        assert_eq!(panics, 1, "write_behind={write_behind}: the panic reached one caller");
        assert!(s.metrics().spill_failures >= 1, "write_behind={write_behind}: reported as a failed spill");
        let poisoned = s.log().poisoned().map(str::to_string);
        assert!(
            poisoned.as_deref().is_some_and(|p| p.contains("panicked")),
            "write_behind={write_behind}: {poisoned:?}"
        );
        assert_eq!(*s.get(b"early").unwrap().unwrap(), val(b'e', 1000));
        for i in 0..40u8 {
            assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 2000), "write_behind={write_behind}: key {i}");
        }
        // A flush waits for every spill write older than itself: with a key still marked as being
        // written it would never return. Bounded here, so that a key left marked fails the test
        // instead of hanging it. It returns an error: the log refuses to sync after the panic.
        let (tx, rx) = std::sync::mpsc::channel();
        let flusher = s.clone();
        std::thread::spawn(move || tx.send(flusher.flush().is_ok()).unwrap());
        let flushed = rx.recv_timeout(std::time::Duration::from_secs(30));
        assert_eq!(flushed, Ok(false), "write_behind={write_behind}: flush still waiting for the panicked write");
        s.check_accounting().unwrap();
        // Later spills fail (the log is read-only) and keep their values in memory.
        let failures = s.metrics().spill_failures;
        s.put(b"next", val(99, 2000)).unwrap();
        assert!(s.metrics().spill_failures > failures, "write_behind={write_behind}");
        for i in 0..40u8 {
            assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 2000), "write_behind={write_behind}: key {i} after");
        }
        s.check_accounting().unwrap();
    }
    // The same in a persistent store's `flush`, which writes disk copies of what it holds in memory:
    // the next flush returns (with the error), the values stay readable, and what an earlier flush
    // made durable survives a power cut.
    let be = SimBackend::new();
    let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/p", persistent(100_000)).unwrap());
    s.put(b"durable", val(b'd', 1000)).unwrap();
    s.flush().unwrap();
    for i in 0..5u8 {
        s.put(&[i], val(i, 1000)).unwrap();
    }
    be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Panic, sticky: false });
    assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.flush())).is_err());
    assert!(be.fault_fired());
    s.check_accounting().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let flusher = s.clone();
    std::thread::spawn(move || tx.send(flusher.flush().map_err(|e| e.to_string())).unwrap());
    let flushed = rx.recv_timeout(std::time::Duration::from_secs(30)).expect("the second flush returns");
    assert!(flushed.is_err(), "nothing could be written after the panic");
    for i in 0..5u8 {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 1000), "key {i}");
    }
    s.check_accounting().unwrap();
    drop(s);
    let s = Store::open(TestCodec::default(), be.crash(None), "/p", persistent(100_000)).unwrap();
    assert_eq!(*s.get(b"durable").unwrap().unwrap(), val(b'd', 1000), "flushed before the panic");
}

/// A full file system is not a broken disk: spills fail and keep their values in memory while it
/// lasts, and once there is room again (here: the fault cleared; in life: spilled keys removed) the
/// store spills again and memory goes back under the target. Nothing is lost on the way.
#[test]
fn a_full_disk_keeps_data_in_memory_until_there_is_room_again() {
    for write_behind in [0, 64 << 10] {
        let be = SimBackend::new();
        let mut c = cfg(5_000);
        c.log.write_behind_bytes = write_behind;
        let s = Store::open(TestCodec::default(), be.clone(), "/store", c).unwrap();
        for i in 0..10u8 {
            s.put(&[i], val(i, 2000)).unwrap();
        }
        be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Enospc, sticky: true });
        for i in 10..40u8 {
            s.put(&[i], val(i, 2000)).unwrap(); // a spill failure is never the caller's error
        }
        assert!(s.metrics().spill_failures >= 1, "write_behind={write_behind}");
        assert!(s.memory_bytes() > 5_000, "the values that could not be spilled stay in memory");
        for i in 0..40u8 {
            assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 2000), "write_behind={write_behind}: key {i}");
        }
        be.clear_faults();
        // Removing a spilled key frees space and lets stuck evictions try again.
        let spilled = (0..40u8).find(|&i| s.tier(&[i]) == Some(Tier::Disk));
        if let Some(k) = spilled {
            assert!(s.remove(&[k]).unwrap());
        }
        s.put(b"next", val(99, 2000)).unwrap();
        assert!(
            s.memory_bytes() <= 5_000,
            "write_behind={write_behind}: spilling resumed ({} bytes)",
            s.memory_bytes()
        );
        assert!(s.flush().is_ok(), "the log is writable");
        for i in (0..40u8).filter(|&i| Some(i) != spilled) {
            assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 2000), "write_behind={write_behind}: key {i}");
        }
        s.check_accounting().unwrap();
    }
}

/// A spill store's default log defers small spill batches (write-behind). A failed write of
/// deferred batches loses nothing: values already handed to the log read back from its memory,
/// later spills fail and keep their values in memory, and the store reports the failure.
#[test]
fn failed_write_behind_of_a_spill_store_loses_nothing() {
    let be = SimBackend::new();
    let c = StoreConfig {
        target_bytes: 5_000,
        log: LogOptions { segment_bytes: 1 << 20, write_behind_bytes: 64 << 10, ..Default::default() },
        fresh_logs: 0, // (a fresh log would take the spills: `store_fresh_logs.rs`)
        ..Default::default()
    };
    let (s, ops) = spill_ten(&be, c);
    let deferred: Vec<u8> = (1..=10u8).filter(|&i| s.tier(&[i]) == Some(Tier::Disk)).collect();
    assert!(deferred.len() >= 5, "{deferred:?} spilled");
    assert_eq!(be.op_count(), ops, "small spill batches were written at once");
    be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Eio, sticky: true });
    for i in 11..=60u8 {
        s.put(&[i], val(i, 2000)).unwrap(); // past the budget: the deferred bytes' write fails
    }
    assert!(s.metrics().spill_failures >= 1);
    for i in 0..=60u8 {
        let k: &[u8] = if i == 0 { b"first" } else { &[i] };
        assert_eq!(*s.get(k).unwrap().unwrap(), val(i, 2000), "key {i}");
    }
    assert!(s.flush().is_err(), "flush reports that the log can no longer write");
}

#[test]
fn a_failed_deserialize_reports_the_error_and_keeps_the_bytes() {
    let (s, _) = open(1 << 20);
    let bad = ser(b"undeserializable!");
    s.put_serialized(b"k", bad.clone()).unwrap();
    let err = s.get(b"k").unwrap_err();
    assert!(matches!(err, Error::Codec { op: "deserialize", .. }), "{err}");
    assert_eq!(s.get_serialized(b"k").unwrap().unwrap(), bad, "the serialized bytes stay intact");
    assert_eq!(s.tier(b"k"), Some(Tier::Serialized));
    assert!(s.get(b"k").is_err(), "a retry runs the codec again");
    assert_eq!(s.codec().deserialized.load(Ordering::SeqCst), 2);
}

/// A value the log cannot store (here larger than its `max_value_bytes`) fails its eviction alone:
/// the other values planned for the same write still go to disk. Failing the whole batch would
/// leave every value in it stuck in memory and counted as a failed spill.
#[test]
fn a_value_the_log_refuses_does_not_fail_the_others_spilled_with_it() {
    let mut c = cfg(9_000);
    c.log.max_value_bytes = 4_500;
    let s = Store::open(TestCodec::default(), SimBackend::new(), "/s", c).unwrap();
    s.put_serialized(b"a", ser(&val(b'a', 1_000))).unwrap();
    s.put_serialized(b"big", ser(&val(b'g', 5_000))).unwrap(); // more than the log takes
    s.put_serialized(b"b", ser(&val(b'b', 4_000))).unwrap(); // over the target: a and big are evicted
    assert_eq!(s.tier(b"a"), Some(Tier::Disk));
    assert_eq!(s.tier(b"big"), Some(Tier::Serialized), "kept in memory");
    assert_eq!(s.tier(b"b"), Some(Tier::Disk), "evicted next, since big is stuck");
    assert_eq!(s.metrics().spill_failures, 1, "one failure: big's");
    for (k, v) in [(&b"a"[..], val(b'a', 1_000)), (b"big", val(b'g', 5_000)), (b"b", val(b'b', 4_000))] {
        assert_eq!(*s.get(k).unwrap().unwrap(), v);
    }
}

/// A value re-read while `max_spill` refuses its eviction is marked stuck again on every round:
/// the list of stuck keys holds each key once (one entry per round would grow it without bound).
#[test]
fn stuck_keys_are_listed_once_however_often_they_are_refused() {
    let s = open_max_spill(0, 1_000);
    for k in [b"a", b"b", b"c"] {
        s.put_serialized(k, ser(&val(k[0], 600))).unwrap();
    }
    assert!(s.metrics().max_spill_refusals > 0);
    for _ in 0..1_000 {
        assert_eq!(*s.get(b"a").unwrap().unwrap(), val(b'a', 600));
    }
    s.check_accounting().unwrap();
}

/// The same rule when the value being put is not heavier than the target but eviction reaches it (the
/// older entries do not free enough): its serialization, which runs without the store lock, fails,
/// so the put fails and the key is forgotten.
#[test]
fn serialize_failure_of_the_inserted_key_during_eviction_is_an_error_and_the_key_is_forgotten() {
    let (s, _) = open(5_000);
    s.put(b"a", val(b'a', 99)).unwrap();
    let mut v = b"unpicklable".to_vec();
    v.resize(4_949, 0);
    let err = s.put(b"bad", v).unwrap_err();
    assert!(matches!(err, Error::Codec { op: "serialize", .. }), "{err}");
    assert!(!s.contains(b"bad"));
    assert_eq!(*s.get(b"a").unwrap().unwrap(), val(b'a', 99));
    s.check_accounting().unwrap();
}

/// A stuck key that a get promotes leaves the list of stuck keys when it is removed: the list must
/// not keep keys the store no longer has.
#[test]
fn a_promoted_stuck_key_leaves_the_stuck_list_when_removed() {
    let s = open_max_spill(0, 1_000);
    s.put_serialized(b"a", ser(&val(b'a', 600))).unwrap();
    s.put_serialized(b"b", ser(&val(b'b', 600))).unwrap();
    assert_eq!(s.get(b"a").unwrap().unwrap().len(), 600);
    assert!(s.remove(b"a").unwrap());
    assert!(s.remove(b"b").unwrap());
    assert!(s.is_empty());
    s.check_accounting().unwrap();
}
