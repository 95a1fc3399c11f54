//! loom models of the store (`spillway::Store`) as it is: compiled with `--cfg spillway_loom`, its lock,
//! its metrics counters and every value's `Arc` and slot come from loom through the sync shim.
//!
//! The store runs on the simulated (in-memory) backend. The segment log's index and writer locks come
//! from the shim too, so loom also preempts between a store operation and the log calls it makes (the
//! windows where a reader holds no store lock); the simulated disk's own state is plain memory. The
//! log's write-behind handshake has its own models in `log.rs`.
#![cfg(spillway_loom)]

mod common;

use bytes::Bytes;
use common::bounded;
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;
use spillway::{Codec, CodecError, Frames, SimBackend, Store, StoreConfig, Tier};

/// Values are byte strings; the codec counts its calls.
#[derive(Default)]
struct Counting {
    deserialized: AtomicUsize,
}

impl Codec for Counting {
    type Value = Vec<u8>;
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
}

type S = Store<Counting, SimBackend>;

/// Target 100 bytes: two 64-byte values do not fit, one does.
fn store() -> Arc<S> {
    let cfg = StoreConfig { target_bytes: 100, ..StoreConfig::default() };
    Arc::new(Store::open(Counting::default(), SimBackend::new(), "/loom", cfg).unwrap())
}

fn val(tag: u8, len: usize) -> Vec<u8> {
    vec![tag; len]
}

/// `a` (64 bytes of 1) on disk, `b` (64 bytes of 2) serialized in memory.
fn store_with_a_spilled() -> Arc<S> {
    let s = store();
    s.put_serialized(b"a", Frames(vec![Bytes::from(val(1, 64))])).unwrap();
    s.put_serialized(b"b", Frames(vec![Bytes::from(val(2, 64))])).unwrap();
    assert_eq!(s.tier(b"a"), Some(Tier::Disk));
    assert_eq!(s.tier(b"b"), Some(Tier::Serialized));
    s
}

fn deserialized(s: &S) -> usize {
    s.codec().deserialized.load(Ordering::SeqCst)
}

/// Two threads get a spilled key: one disk read, one deserialize, the same `Arc` for both, and the
/// promotion leaves the accounting exact. Both threads run long paths (store lock, slot, log index,
/// promotion), so this model is explored under a preemption bound (see `bounded`).
#[test]
fn concurrent_gets_of_a_spilled_key_read_and_deserialize_once() {
    bounded().check(|| {
        let s = store();
        s.put_serialized(b"a", Frames(vec![Bytes::from(val(1, 64))])).unwrap();
        assert_eq!(s.evict().unwrap(), 64);
        assert_eq!(s.tier(b"a"), Some(Tier::Disk));
        let t = {
            let s = s.clone();
            thread::spawn(move || s.get(b"a").unwrap().unwrap())
        };
        let x = s.get(b"a").unwrap().unwrap();
        let y = t.join().unwrap();
        assert!(Arc::ptr_eq(&x, &y));
        assert_eq!(*x, val(1, 64));
        assert_eq!(deserialized(&s), 1);
        let m = s.metrics();
        assert_eq!(m.activity("disk-read").count, 1);
        assert_eq!(m.activity("deserialize").count, 1);
        assert_eq!(s.tier(b"a"), Some(Tier::Materialized));
        assert_eq!(s.memory_bytes(), 64);
        s.check_accounting().unwrap();
    });
}

/// Two threads get a value heavier than the target. It is served without promotion, so once both gets
/// return, its slot must be empty again, even if one get was inside the slot's fast path when the
/// other tried to empty it: an object left there would be memory nobody accounts for, and the next get
/// would return it without deserializing.
#[test]
fn concurrent_gets_of_a_heavy_value_leave_its_slot_empty() {
    bounded().check(|| {
        let s = store();
        s.put_serialized(b"a", Frames(vec![Bytes::from(val(1, 128))])).unwrap();
        assert_eq!(s.tier(b"a"), Some(Tier::Disk));
        let t = {
            let s = s.clone();
            thread::spawn(move || s.get(b"a").unwrap().unwrap())
        };
        let x = s.get(b"a").unwrap().unwrap();
        assert_eq!(*t.join().unwrap(), val(1, 128));
        assert_eq!(*x, val(1, 128));
        drop(x);
        assert_eq!(s.tier(b"a"), Some(Tier::Disk));
        assert_eq!(s.memory_bytes(), 0);
        let before = deserialized(&s);
        assert_eq!(*s.get(b"a").unwrap().unwrap(), val(1, 128));
        assert_eq!(deserialized(&s), before + 1, "the heavy object stayed cached in its slot");
        s.check_accounting().unwrap();
    });
}

/// A get of a spilled key races its removal: the get returns the value or nothing, never an error (the
/// record it was about to read may be gone), and nothing of the key is left in memory, on disk or in
/// the accounting.
#[test]
fn get_races_remove_of_a_spilled_key() {
    loom::model(|| {
        let s = store_with_a_spilled();
        let t = {
            let s = s.clone();
            thread::spawn(move || s.get(b"a").unwrap())
        };
        assert!(s.remove(b"a").unwrap());
        if let Some(v) = t.join().unwrap() {
            assert_eq!(*v, val(1, 64));
        }
        assert!(!s.contains(b"a"));
        assert!(s.get(b"a").unwrap().is_none());
        assert_eq!(s.len(), 1);
        s.check_accounting().unwrap();
    });
}

/// A get of a key held serialized in memory races its removal, with the same guarantees.
#[test]
fn get_races_remove_of_a_serialized_key() {
    loom::model(|| {
        let s = store_with_a_spilled();
        let t = {
            let s = s.clone();
            thread::spawn(move || s.get(b"b").unwrap())
        };
        assert!(s.remove(b"b").unwrap());
        if let Some(v) = t.join().unwrap() {
            assert_eq!(*v, val(2, 64));
        }
        assert!(s.get(b"b").unwrap().is_none());
        s.check_accounting().unwrap();
    });
}

/// `remove` then a new `put` of the same key, racing a get: the get returns the old value, nothing or
/// the new value; once it has seen the new put complete, only the new value. The new generation is
/// put in memory (`large == false`) or straight to disk (`large == true`, heavier than the target).
/// Explored under the preemption bound: the large put releases the store lock for its write, and the
/// unbounded exploration ran for over 15 minutes.
fn remove_then_put_races_get(large: bool) {
    bounded().check(move || {
        let s = store_with_a_spilled();
        let done = Arc::new(AtomicBool::new(false));
        let new = if large { val(3, 128) } else { val(3, 64) };
        let writer = {
            let (s, done, new) = (s.clone(), done.clone(), new.clone());
            thread::spawn(move || {
                assert!(s.remove(b"a").unwrap());
                s.put(b"a", new).unwrap();
                done.store(true, Ordering::Release);
            })
        };
        let seen_done = done.load(Ordering::Acquire);
        let got = s.get(b"a").unwrap();
        match got.as_deref() {
            Some(v) if *v == new => {}
            Some(v) => {
                assert_eq!(*v, val(1, 64), "a value of neither generation");
                assert!(!seen_done, "old generation returned after the new put completed");
            }
            None => assert!(!seen_done, "nothing returned after the new put completed"),
        }
        writer.join().unwrap();
        assert_eq!(*s.get(b"a").unwrap().unwrap(), new);
        s.check_accounting().unwrap();
    });
}

#[test]
fn remove_then_put_in_memory_races_get() {
    remove_then_put_races_get(false);
}

#[test]
fn remove_then_put_to_disk_races_get() {
    remove_then_put_races_get(true);
}

/// A get materializing a key held serialized races `evict` (the memory monitor's manual spill): the
/// value is never lost or corrupted, at most one deserialize runs per materialization, and the
/// accounting ends exact whichever tier the key ends in.
#[test]
fn get_races_evict() {
    loom::model(|| {
        let s = store();
        s.put_serialized(b"a", Frames(vec![Bytes::from(val(1, 64))])).unwrap();
        let t = {
            let s = s.clone();
            thread::spawn(move || s.evict().unwrap())
        };
        let v = s.get(b"a").unwrap().unwrap();
        let freed = t.join().unwrap();
        assert_eq!(*v, val(1, 64));
        assert!(freed <= 64);
        s.check_accounting().unwrap();
        assert_eq!(*s.get(b"a").unwrap().unwrap(), val(1, 64));
        let m = s.metrics();
        assert_eq!(m.activity("deserialize").count as usize, deserialized(&s));
        assert!(deserialized(&s) <= 2);
        s.check_accounting().unwrap();
    });
}

/// Metrics counters updated from two threads sum exactly: each thread puts and gets its own key.
#[test]
fn metrics_counters_sum_exactly() {
    loom::model(|| {
        let s = store();
        let work = |s: &S, k: &[u8], tag: u8| {
            s.put_serialized(k, Frames(vec![Bytes::from(val(tag, 16))])).unwrap();
            assert_eq!(*s.get(k).unwrap().unwrap(), val(tag, 16));
        };
        let t = {
            let s = s.clone();
            thread::spawn(move || work(&s, b"x", 7))
        };
        work(&s, b"y", 8);
        t.join().unwrap();
        let m = s.metrics();
        assert_eq!(m.activity("deserialize").count, 2);
        assert_eq!(m.activity("deserialize").bytes, 32);
        assert_eq!(m.activity("memory-read").count, 2);
        assert_eq!(m.memory_bytes, 32);
        s.check_accounting().unwrap();
    });
}

/// Two gets of a key held serialized race `evict`. One get can promote the value, the eviction can
/// demote it again (the slot is emptied), and the second get then finishes with the value it shared.
/// It must not promote the entry a second time: that would leave a materialized entry whose slot
/// holds nothing.
#[test]
fn two_gets_race_evict() {
    bounded().check(|| {
        let s = store();
        s.put_serialized(b"a", Frames(vec![Bytes::from(val(1, 64))])).unwrap();
        let getter = {
            let s = s.clone();
            thread::spawn(move || s.get(b"a").unwrap().unwrap())
        };
        let evicter = {
            let s = s.clone();
            thread::spawn(move || s.evict().unwrap())
        };
        let v = s.get(b"a").unwrap().unwrap();
        assert_eq!(*getter.join().unwrap(), val(1, 64));
        evicter.join().unwrap();
        assert_eq!(*v, val(1, 64));
        s.check_accounting().unwrap();
        assert_eq!(*s.get(b"a").unwrap().unwrap(), val(1, 64));
        s.check_accounting().unwrap();
    });
}

/// A put's spill write runs without the store lock. Meanwhile the key being written is removed and put
/// again (in memory, or straight to disk when `large`). However the steps interleave, the new value is
/// the one read afterwards, the stale record is gone from the log (the accounting check compares the
/// log's keys with the entries that have a disk copy), and the accounting is exact.
fn spill_write_races_overwrite(large: bool) {
    bounded().check(move || {
        let s = store();
        s.put_serialized(b"a", Frames(vec![Bytes::from(val(1, 64))])).unwrap();
        let spiller = {
            let s = s.clone();
            // 64 + 64 > 100: this put spills `a`, the least recently used.
            thread::spawn(move || s.put_serialized(b"b", Frames(vec![Bytes::from(val(2, 64))])).unwrap())
        };
        let new = if large { val(3, 128) } else { val(3, 16) };
        s.remove(b"a").unwrap();
        s.put(b"a", new.clone()).unwrap();
        spiller.join().unwrap();
        assert_eq!(*s.get(b"a").unwrap().unwrap(), new);
        assert_eq!(*s.get(b"b").unwrap().unwrap(), val(2, 64));
        s.check_accounting().unwrap();
    });
}

#[test]
fn spill_write_races_overwrite_in_memory() {
    spill_write_races_overwrite(false);
}

#[test]
fn spill_write_races_overwrite_to_disk() {
    spill_write_races_overwrite(true);
}

/// `get_many` of a spilled key races a plain `get` of it. On the simulated backend `get_many` reads
/// its disk keys as one batch first and materializes afterwards through the key's slot, so the
/// window between its read and its materialization is explored too: one deserialize, the same `Arc`,
/// and a key listed twice still reads once.
#[test]
fn get_many_races_get_of_a_spilled_key() {
    bounded().check(|| {
        let s = store();
        s.put_serialized(b"a", Frames(vec![Bytes::from(val(1, 64))])).unwrap();
        assert_eq!(s.evict().unwrap(), 64);
        let t = {
            let s = s.clone();
            thread::spawn(move || s.get(b"a").unwrap().unwrap())
        };
        let many = s.get_many(&[b"a", b"absent", b"a"]);
        let y = t.join().unwrap();
        let x = many[0].as_ref().unwrap().as_ref().unwrap();
        assert!(many[1].as_ref().unwrap().is_none());
        assert!(Arc::ptr_eq(x, many[2].as_ref().unwrap().as_ref().unwrap()));
        assert!(Arc::ptr_eq(x, &y));
        assert_eq!(deserialized(&s), 1);
        assert_eq!(s.tier(b"a"), Some(Tier::Materialized));
        s.check_accounting().unwrap();
    });
}

/// A value streams in for a key that has one on disk (`put_stream`, the store's lock not held while
/// the bytes arrive) while another thread reads the key and then removes it. The read sees the old
/// value or the new one, never nothing (the old value stays the key's until the new record
/// replaces it); the remove wins over the stream if the stream was under way (the key ends absent,
/// `put_stream` returns `false` if its value was not settled yet), and a superseded value never
/// comes back. The accounting adds up.
/// Taking the old entry out of the table for the transfer makes the read see nothing.
#[test]
fn a_streamed_value_races_a_read_and_a_remove_of_its_key() {
    bounded().check(|| {
        let s = store_with_a_spilled();
        let new = val(9, 200); // over the target: streamed to disk
        let (_, raw_len) = spillway::format::frame_layout([new.len() as u64]).unwrap();
        let meta = spillway::StreamedValue {
            lz4: false,
            frame_lens: vec![raw_len],
            raw_len,
            stored_len: raw_len,
            payload_crc: spillway::format::payload_crc(&new),
        };
        let streamer = {
            let (s, payload) = (s.clone(), new.clone());
            thread::spawn(move || s.put_stream(b"a", &meta, &mut &payload[..]).unwrap())
        };
        let seen = s.get(b"a").unwrap().expect("the key has a value throughout");
        assert!(*seen == val(1, 64) || *seen == new, "{seen:?}");
        assert!(s.remove(b"a").unwrap());
        let stored = streamer.join().unwrap();
        // The remove wins over a stream under way; a stream that began after it stores its value.
        match s.get(b"a").unwrap() {
            None => assert!(!s.contains(b"a")),
            Some(v) => assert!(stored && *v == new, "a superseded value came back: {v:?}"),
        }
        assert_eq!(s.len(), if s.contains(b"a") { 2 } else { 1 });
        s.check_accounting().unwrap();
    });
}
