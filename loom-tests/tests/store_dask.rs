//! loom models of the store's paths for dask's contract: an evicted object brought back through its
//! weak handle ([`Codec::keep_weak`]) while the key is replaced or memory is evicted, and
//! [`EvictionPolicy::dask`]'s failed spill ending a round while two puts evict at once. Compiled with
//! `--cfg spillway_loom`, as `store.rs` (whose header says what loom sees of the store).
#![cfg(spillway_loom)]

mod common;

use bytes::Bytes;
use common::bounded;
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;
use spillway::{
    Codec, CodecError, EvictionPolicy, Frames, Revive, SimBackend, SpillFailureKind, Store, StoreConfig, Tier,
};

/// Values are byte strings; the codec counts deserializations and keeps a handle on every evicted
/// object, as Python's weak references do while the object is alive elsewhere (here: always).
#[derive(Default)]
struct Weakly {
    deserialized: AtomicUsize,
}

impl Codec for Weakly {
    type Value = Vec<u8>;
    const KEEPS_WEAK: bool = true;
    fn serialize(&self, v: &Vec<u8>) -> Result<Frames, CodecError> {
        Ok(Frames(vec![Bytes::from(v.clone())]))
    }
    fn deserialize(&self, f: Frames) -> Result<Vec<u8>, CodecError> {
        self.deserialized.fetch_add(1, Ordering::SeqCst);
        Ok(f.0.iter().flat_map(|b| b.iter().copied()).collect())
    }
    fn size_of(&self, v: &Vec<u8>) -> u64 {
        v.len() as u64
    }
    fn keep_weak(&self, v: &Arc<Vec<u8>>) -> Option<Revive<Vec<u8>>> {
        let v = v.clone();
        Some(std::sync::Arc::new(move || Some(v.clone())))
    }
}

type S = Store<Weakly, SimBackend>;

fn val(tag: u8, len: usize) -> Vec<u8> {
    vec![tag; len]
}

/// dask's policy, target 100 bytes: two 64-byte values do not fit, one does.
fn store(max_spill: Option<u64>) -> Arc<S> {
    let cfg = StoreConfig {
        target_bytes: 100,
        max_spill_bytes: max_spill,
        eviction: EvictionPolicy::dask(),
        report_failures: true,
        ..StoreConfig::default()
    };
    Arc::new(Store::open(Weakly::default(), SimBackend::new(), "/loom", cfg).unwrap())
}

/// `a` (64 bytes of 1) evicted to disk, its object still alive (a weak handle kept).
fn store_with_a_evicted() -> Arc<S> {
    let s = store(None);
    s.put(b"a", val(1, 64)).unwrap();
    assert_eq!(s.evict().unwrap(), 64);
    assert_eq!(s.tier(b"a"), Some(Tier::Disk));
    s
}

fn deserialized(s: &S) -> usize {
    s.codec().deserialized.load(Ordering::SeqCst)
}

/// A get that revives `a`'s evicted object races a put of a new value of `a`. The getter sees the
/// old value or the new one, never a mix; afterwards the new value is the one read, the revived
/// object never resurrects the old entry, the old record is gone from the log (the accounting check
/// compares the log's keys with the entries that have a disk copy), and nothing was deserialized
/// (the old object was alive).
#[test]
fn revive_races_put_of_the_same_key() {
    bounded().check(|| {
        let s = store_with_a_evicted();
        let getter = {
            let s = s.clone();
            thread::spawn(move || s.get(b"a").unwrap().map(|v| (*v).clone()))
        };
        s.put(b"a", val(3, 16)).unwrap();
        let seen = getter.join().unwrap().expect("a is present throughout");
        assert!(seen == val(1, 64) || seen == val(3, 16));
        assert_eq!(*s.get(b"a").unwrap().unwrap(), val(3, 16));
        assert_eq!(deserialized(&s), 0);
        s.check_accounting().unwrap();
    });
}

/// A get that revives `a`'s evicted object races a put of `b` whose eviction may take `a` again as
/// soon as it is back (its record dropped by the revival: the object may have changed since it was
/// written, so it must be written again). However the steps interleave, both values read back whole,
/// none is read from disk while its object lives, and the accounting is exact.
#[test]
fn revive_races_an_eviction_of_the_revived_key() {
    bounded().check(|| {
        let s = store_with_a_evicted();
        let getter = {
            let s = s.clone();
            thread::spawn(move || s.get(b"a").unwrap().map(|v| (*v).clone()))
        };
        s.put(b"b", val(2, 64)).unwrap();
        assert_eq!(getter.join().unwrap(), Some(val(1, 64)));
        s.check_accounting().unwrap();
        assert_eq!(*s.get(b"a").unwrap().unwrap(), val(1, 64));
        assert_eq!(*s.get(b"b").unwrap().unwrap(), val(2, 64));
        assert_eq!(deserialized(&s), 0);
        s.check_accounting().unwrap();
    });
}

/// dask's failed spill ends the round, under two puts that evict at once with room on disk for one
/// value (`max_spill` 64 bytes). Each put keeps its own value; whichever victim the disk refuses
/// stays in memory, reported as a `max_spill` failure; the disk never holds more than `max_spill`;
/// every value reads back whole and the accounting is exact.
#[test]
fn failed_spill_ends_round_under_two_putters() {
    bounded().check(|| {
        let s = store(Some(64));
        s.put(b"a", val(1, 64)).unwrap();
        let putter = {
            let s = s.clone();
            thread::spawn(move || s.put(b"b", val(2, 64)).unwrap())
        };
        s.put(b"c", val(3, 64)).unwrap();
        putter.join().unwrap();
        s.check_accounting().unwrap();
        let m = s.metrics();
        assert!(m.spilled_memory_bytes <= 64, "max_spill is 64 bytes, the disk holds {}", m.spilled_memory_bytes);
        let on_disk = [&b"a"[..], b"b", b"c"].iter().filter(|k| s.tier(k) == Some(Tier::Disk)).count();
        assert!(on_disk <= 1);
        // Three 64-byte values over a 100-byte target: at least one spill was tried and refused.
        let failures = s.take_failures();
        assert!(!failures.is_empty());
        assert!(failures.iter().all(|f| f.kind == SpillFailureKind::MaxSpill), "{failures:?}");
        for (k, tag) in [(&b"a"[..], 1), (b"b", 2), (b"c", 3)] {
            assert_eq!(*s.get(k).unwrap().unwrap(), val(tag, 64));
        }
        s.check_accounting().unwrap();
    });
}
