//! A spill store whose log a failed write left read-only opens a fresh log (`engine/src/store/logs.rs`):
//! the write that failed and the later ones go there, the read-only log keeps serving its records,
//! a key has its record in one log at a time, and after `fresh_logs` replacements the data stays in
//! memory. On the simulated backend each fresh log gets a fresh simulated disk, so a fault is scripted
//! on the log it is meant for.

use std::sync::Arc;

use spillway::backend::{Fault, FaultKind, FaultOp};
use spillway::transfer::{Outgoing, Source};
use spillway::{EvictionPolicy, SimBackend, SpillFailureKind, Store, StoreConfig, Tier};
use spillway_tests::store::*;

type S = Store<TestCodec, SimBackend>;

fn open(c: StoreConfig) -> Arc<S> {
    Arc::new(Store::open(TestCodec::default(), SimBackend::new(), "/store", c).unwrap())
}

/// Target 5000: a third 2000-byte value spills the oldest, and only it.
fn spill_cfg() -> StoreConfig {
    // dask's rules: no slack, so each put past the target spills exactly one value.
    let mut c = StoreConfig { report_failures: true, eviction: EvictionPolicy::dask(), ..cfg(5_000) };
    c.log.write_behind_bytes = 0; // every spill meets the disk at once
    c
}

fn eio_on(s: &S) {
    let be = s.log().backend();
    be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Eio, sticky: true });
}

fn put_all(s: &S, keys: std::ops::Range<u8>) {
    for i in keys {
        s.put(&[i], val(i, 1999)).unwrap(); // weighs 2000
    }
}

fn read_all(s: &S, keys: std::ops::Range<u8>) {
    for i in keys {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 1999), "key {i}");
    }
}

#[test]
fn the_write_that_made_the_log_read_only_goes_to_a_fresh_log_and_so_do_later_ones() {
    let s = open(spill_cfg());
    put_all(&s, 0..3); // 0 spilled
    assert_eq!(s.tier(&[0]), Some(Tier::Disk));
    eio_on(&s);
    put_all(&s, 3..4); // 1 spilled: meets the EIO
    let logs = s.logs();
    assert_eq!(logs.len(), 2);
    assert!(logs[0].poisoned().is_some() && logs[1].poisoned().is_none());
    assert_eq!(logs[1].dir(), std::path::Path::new("/store/fresh-1"));
    assert_eq!(s.tier(&[1]), Some(Tier::Disk), "the spill that met the EIO was written to the fresh log");
    assert!(s.take_failures().is_empty(), "nothing failed in the end");
    assert_eq!((logs[0].len(), logs[1].len()), (1, 1));
    put_all(&s, 4..5);
    assert_eq!(logs[1].len(), 2);
    assert!(std::ptr::eq(s.log(), logs[1]), "spills go to the fresh log");
    s.check_accounting().unwrap();
    // The read-only log serves its record; read back, the value keeps no copy there (evicted again,
    // it is written to the fresh log).
    assert_eq!(s.log_of(&[0]).map(|l| l.dir()), Some(logs[0].dir()));
    assert_eq!(*s.get(&[0]).unwrap().unwrap(), val(0, 1999));
    assert_eq!(logs[0].len(), 0);
    read_all(&s, 0..5);
    assert!(s.log_of(&[0]).is_none_or(|l| l.dir() == logs[1].dir()));
    s.remove(&[0]).unwrap();
    s.check_accounting().unwrap();
}

#[test]
fn a_record_removed_from_the_read_only_log_needs_no_write() {
    let s = open(spill_cfg());
    put_all(&s, 0..3);
    eio_on(&s);
    put_all(&s, 3..4);
    let logs = s.logs();
    assert_eq!(logs[0].len(), 1);
    s.remove(&[0]).unwrap();
    assert_eq!(logs[0].len(), 0);
    assert!(!s.contains(&[0]));
    s.check_accounting().unwrap();
}

#[test]
fn a_rewrite_that_lands_where_the_old_record_was_in_the_old_log_counts_as_written() {
    // A fresh log's first record has the location the old log's first one had: the store tells
    // them apart by their log.
    let c = StoreConfig { eviction: EvictionPolicy::dask(), ..spill_cfg() };
    let s = Store::open(MutCodec, SimBackend::new(), "/store", StoreConfig { target_bytes: 1 << 20, ..c }).unwrap();
    s.put(b"a", std::sync::Mutex::new(vec![1; 100])).unwrap();
    s.evict().unwrap();
    s.get(b"a").unwrap().unwrap().lock().unwrap()[0] = 9; // read back (a verified copy) and changed
    s.log().backend().inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Eio, sticky: true });
    assert_eq!(s.evict().unwrap(), 100, "written to the fresh log");
    assert!(s.take_failures().is_empty());
    assert_eq!(s.tier(b"a"), Some(Tier::Disk));
    assert_eq!(s.log_of(b"a").map(|l| l.dir().to_path_buf()), Some("/store/fresh-1".into()));
    assert_eq!(s.get(b"a").unwrap().unwrap().lock().unwrap()[..2], [9, 1]);
    s.check_accounting().unwrap();
}

#[test]
fn a_value_written_again_leaves_no_record_in_the_read_only_log() {
    let c = StoreConfig { eviction: EvictionPolicy::dask(), ..spill_cfg() };
    let s = Store::open(MutCodec, SimBackend::new(), "/store", StoreConfig { target_bytes: 1 << 20, ..c }).unwrap();
    s.put(b"a", std::sync::Mutex::new(vec![1; 100])).unwrap();
    s.evict().unwrap();
    s.log().backend().inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Eio, sticky: true });
    s.put(b"b", std::sync::Mutex::new(vec![2; 100])).unwrap();
    s.evict().unwrap(); // meets the EIO: b goes to the fresh log
    let logs = s.logs();
    assert_eq!((logs.len(), logs[0].len(), logs[1].len()), (2, 1, 1));
    // a comes back (its record kept as a copy in the read-only log), is changed in place and
    // evicted: written again, to the fresh log, and the old record is forgotten.
    s.get(b"a").unwrap().unwrap().lock().unwrap()[0] = 9;
    s.evict().unwrap();
    assert_eq!(s.tier(b"a"), Some(Tier::Disk));
    assert_eq!((logs[0].len(), logs[1].len()), (0, 2), "the stale record of a is gone");
    assert_eq!(s.log_of(b"a").map(|l| l.dir()), Some(logs[1].dir()));
    assert_eq!(s.get(b"a").unwrap().unwrap().lock().unwrap()[..2], [9, 1]);
    s.check_accounting().unwrap();
}

#[test]
fn get_many_reads_keys_from_both_logs() {
    let s = open(spill_cfg());
    put_all(&s, 0..4);
    eio_on(&s);
    put_all(&s, 4..8); // 2, 3, 4, 5 spilled: 2 meets the EIO, all go to the fresh log
    let on_disk: Vec<u8> = (0..8).filter(|i| s.tier(&[*i]) == Some(Tier::Disk)).collect();
    assert!(s.logs()[0].len() >= 2 && s.logs()[1].len() >= 2, "{on_disk:?}");
    let keys: Vec<[u8; 1]> = (0..8u8).map(|i| [i]).collect();
    let refs: Vec<&[u8]> = keys.iter().map(|k| &k[..]).collect();
    for (i, got) in s.get_many(&refs).into_iter().enumerate() {
        assert_eq!(*got.unwrap().unwrap(), val(i as u8, 1999), "key {i}");
    }
    s.check_accounting().unwrap();
}

#[test]
fn after_its_last_fresh_log_fails_the_store_keeps_data_in_memory() {
    let s = open(StoreConfig { fresh_logs: 2, ..spill_cfg() });
    put_all(&s, 0..3);
    for round in 0..3 {
        eio_on(&s); // the log spills go to now
        put_all(&s, 3 + round..4 + round);
    }
    let logs = s.logs();
    assert_eq!(logs.len(), 3, "the first log and two fresh ones");
    assert!(logs.iter().all(|l| l.poisoned().is_some()));
    let failures = s.take_failures();
    assert!(!failures.is_empty() && failures.iter().all(|f| f.kind == SpillFailureKind::Disk), "{failures:?}");
    // Later spills fail and keep their values in memory; no other log is opened.
    put_all(&s, 6..9);
    assert_eq!(s.logs().len(), 3);
    assert!(s.tier(&[8]) != Some(Tier::Disk));
    read_all(&s, 0..9);
    s.check_accounting().unwrap();
}

#[test]
fn a_persistent_store_keeps_its_one_log() {
    let s = open(StoreConfig { persistent: true, ..spill_cfg() });
    put_all(&s, 0..3);
    eio_on(&s);
    put_all(&s, 3..6);
    assert_eq!(s.logs().len(), 1, "its durable contents are in that log");
    assert!(s.log().poisoned().is_some());
    read_all(&s, 0..6);
}

#[test]
fn a_peer_is_sent_a_record_from_the_log_that_holds_it() {
    let s = open(spill_cfg());
    put_all(&s, 0..3);
    eio_on(&s);
    put_all(&s, 3..4);
    let logs = s.logs();
    for (key, log) in [(0u8, logs[0]), (1, logs[1])] {
        let Some(Outgoing::Stored(sv)) = Source::outgoing(&*s, &[key]).unwrap() else {
            panic!("key {key} is sent from its record")
        };
        assert_eq!(Source::log_holding(&*s, &sv).dir(), log.dir(), "key {key}");
    }
}

#[test]
fn a_spill_store_reopened_in_its_directory_starts_empty_with_one_log() {
    let be = SimBackend::new();
    {
        let s = Store::open(TestCodec::default(), be.clone(), "/store", spill_cfg()).unwrap();
        put_all(&s, 0..3);
        eio_on(&s);
        put_all(&s, 3..5);
        assert_eq!(s.logs().len(), 2);
    }
    be.clear_faults();
    let s = Store::open(TestCodec::default(), be, "/store", spill_cfg()).unwrap();
    assert!(s.is_empty() && s.logs().len() == 1 && s.log().poisoned().is_none());
    put_all(&s, 0..5);
    read_all(&s, 0..5);
    s.check_accounting().unwrap();
}
