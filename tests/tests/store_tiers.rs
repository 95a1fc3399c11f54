//! The store's tiers: LRU demotion and the target, values heavier than the target, overwrites and
//! deletes, in-memory compression, manual eviction, read-back copies, the eviction policy, metrics.

use std::sync::atomic::Ordering;

use spillway::{Activity, EvictionPolicy, SimBackend, Store, StoreConfig, Tier};
use spillway_tests::store::*;

#[test]
fn lru_entries_are_demoted_first_and_memory_stays_under_target() {
    let (s, _) = open(10_000);
    for (i, c) in b"abcde".iter().enumerate() {
        s.put(&[*c], val(*c, 2999)).unwrap();
        assert!(s.memory_bytes() <= 10_000, "after put {i}: {}", s.memory_bytes());
    }
    // 5 x 3000 bytes into 10000: the two least recently used went to disk.
    assert_eq!(s.tier(b"a"), Some(Tier::Disk));
    assert_eq!(s.tier(b"b"), Some(Tier::Disk));
    for k in [b"c", b"d", b"e"] {
        assert_eq!(s.tier(k), Some(Tier::Materialized));
    }
    let m = s.metrics();
    assert_eq!(m.memory_bytes, 9000);
    assert_eq!(m.spilled_memory_bytes, 2 * 3000, "serialized size of what is on disk: header frame + value");
    assert!(m.spilled_disk_bytes > m.spilled_memory_bytes, "records add headers");
}

#[test]
fn reads_refresh_recency_and_promote() {
    let (s, _) = open(10_000);
    for c in b"abc" {
        s.put(&[*c], val(*c, 2999)).unwrap();
    }
    assert_eq!(*s.get(b"a").unwrap().unwrap(), val(b'a', 2999));
    s.put(b"d", val(b'd', 2999)).unwrap();
    assert_eq!(s.tier(b"b"), Some(Tier::Disk), "b is now the least recently used");
    assert_eq!(s.tier(b"a"), Some(Tier::Materialized));
    // Reading b back promotes it (and demotes the new LRU, c).
    assert_eq!(*s.get(b"b").unwrap().unwrap(), val(b'b', 2999));
    assert_eq!(s.tier(b"b"), Some(Tier::Materialized));
    assert_eq!(s.tier(b"c"), Some(Tier::Disk));
    assert!(s.memory_bytes() <= 10_000);
    assert_eq!(s.metrics().activity("disk-read").count, 1);
}

#[test]
fn a_value_heavier_than_the_target_goes_straight_to_disk_and_is_not_promoted() {
    let (s, _) = open(10_000);
    s.put(b"small", val(1, 100)).unwrap();
    s.put(b"big", val(2, 50_000)).unwrap();
    assert_eq!(s.tier(b"big"), Some(Tier::Disk));
    assert_eq!(s.tier(b"small"), Some(Tier::Materialized), "a large put must not flush the small ones");
    assert_eq!(*s.get(b"big").unwrap().unwrap(), val(2, 50_000));
    assert_eq!(s.tier(b"big"), Some(Tier::Disk), "served from disk without promotion");
    assert_eq!(s.memory_bytes(), 101);
    assert_eq!(s.get_serialized(b"big").unwrap().unwrap(), ser(&val(2, 50_000)));
    assert_eq!(s.tier(b"big"), Some(Tier::Disk));
    s.put_serialized(b"big2", ser(&val(3, 20_000))).unwrap();
    assert_eq!(s.tier(b"big2"), Some(Tier::Disk));
}

#[test]
fn overwriting_a_spilled_key_replaces_it_everywhere() {
    let (s, _) = open(5_000);
    s.put(b"k", val(1, 3000)).unwrap();
    s.put(b"x", val(9, 3000)).unwrap();
    assert_eq!(s.tier(b"k"), Some(Tier::Disk));
    s.put(b"k", val(2, 100)).unwrap();
    assert_eq!(*s.get(b"k").unwrap().unwrap(), val(2, 100));
    assert_eq!(s.log().get(b"k").unwrap(), None, "the old record is gone from the log");
    let m = s.metrics();
    assert_eq!(m.spilled_memory_bytes, 0);
    assert_eq!(m.spilled_disk_bytes, 0);
}

#[test]
fn deleting_a_spilled_key_updates_accounting() {
    let (s, _) = open(5_000);
    s.put(b"k", val(1, 3000)).unwrap();
    s.put(b"x", val(9, 3000)).unwrap();
    assert_eq!(s.tier(b"k"), Some(Tier::Disk));
    assert!(s.metrics().spilled_disk_bytes > 0);
    assert!(s.remove(b"k").unwrap());
    assert!(!s.contains(b"k"));
    assert!(!s.remove(b"k").unwrap());
    let m = s.metrics();
    assert_eq!((m.spilled_memory_bytes, m.spilled_disk_bytes), (0, 0));
    assert_eq!(m.tier_entries.iter().find(|(t, _)| *t == "disk").unwrap().1, 0);
    assert_eq!(s.len(), 1);
    assert_eq!(s.memory_bytes(), 3001);
}

#[test]
fn get_serialized_never_deserializes() {
    let (s, _) = open(1 << 20);
    s.put_serialized(b"net", ser(&val(1, 1000))).unwrap();
    s.evict().unwrap();
    assert_eq!(s.tier(b"net"), Some(Tier::Disk));
    assert_eq!(s.get_serialized(b"net").unwrap().unwrap(), ser(&val(1, 1000)));
    assert_eq!(s.tier(b"net"), Some(Tier::Serialized), "promoted to the serialized tier");
    assert_eq!(s.get_serialized(b"net").unwrap().unwrap(), ser(&val(1, 1000)));
    assert_eq!(s.codec().deserialized.load(Ordering::SeqCst), 0);
    // A materialized value is serialized for sending but stays materialized.
    s.put(b"obj", val(2, 10)).unwrap();
    assert_eq!(s.get_serialized(b"obj").unwrap().unwrap(), ser(&val(2, 10)));
    assert_eq!(s.tier(b"obj"), Some(Tier::Materialized));
}

#[test]
fn in_memory_compression_is_a_tier_between_serialized_and_disk() {
    let be = SimBackend::new();
    let c = StoreConfig { compress_in_memory: true, ..cfg(10_000) };
    let s = Store::open(TestCodec::default(), be, "/store", c).unwrap();
    s.put(b"a", val(b'a', 6000)).unwrap();
    s.put(b"b", val(b'b', 6000)).unwrap();
    assert_eq!(s.tier(b"a"), Some(Tier::Compressed), "compressing freed enough: no disk write");
    assert!(s.memory_bytes() <= 10_000);
    assert_eq!(s.metrics().activity("disk-write").count, 0);
    assert_eq!(*s.get(b"a").unwrap().unwrap(), val(b'a', 6000));
    assert!(s.metrics().activity("decompress").count >= 1);
}

#[test]
fn manual_evict_spills_the_lru_entry_and_reports_bytes_freed() {
    let (s, _) = open(1 << 20);
    assert_eq!(s.evict().unwrap(), 0, "nothing to evict");
    s.put(b"old", val(1, 500)).unwrap();
    s.put(b"new", val(2, 700)).unwrap();
    assert_eq!(s.evict().unwrap(), 501);
    assert_eq!(s.tier(b"old"), Some(Tier::Disk));
    assert_eq!(s.tier(b"new"), Some(Tier::Materialized));
    assert_eq!(s.evict().unwrap(), 701);
    assert_eq!(s.evict().unwrap(), 0);
}

#[test]
fn metrics_and_prometheus_exposition() {
    let (s, _) = open(4_000);
    for i in 0..4u8 {
        s.put(&[i], val(i, 1500)).unwrap();
    }
    s.get(&[0]).unwrap().unwrap();
    let m = s.metrics();
    assert!(m.activity("serialize").count >= 1);
    assert!(m.activity("disk-write").bytes >= 1501);
    assert_eq!(m.activity("disk-read").count, 1);
    assert_eq!(m.activity("deserialize").count, 1);
    let text = m.prometheus();
    assert!(text.contains("spillway_spill_bytes_total{activity=\"disk-write\"}"), "{text}");
    assert!(text.contains("spillway_spill_time_seconds_total{activity=\"deserialize\"}"));
    assert!(text.contains("spillway_entries{tier=\"disk\"}"));
}

#[test]
fn a_value_read_back_from_disk_is_evicted_again_without_a_write() {
    let (s, _) = open(5_000);
    s.put(b"a", val(1, 3000)).unwrap();
    s.put(b"b", val(2, 3000)).unwrap();
    assert_eq!(s.tier(b"a"), Some(Tier::Disk));
    let writes = s.metrics().activity("disk-write").count;
    assert_eq!(*s.get(b"a").unwrap().unwrap(), val(1, 3000)); // promotes a, evicts b (a write)
    assert_eq!(s.tier(b"b"), Some(Tier::Disk));
    assert_eq!(s.metrics().activity("disk-write").count, writes + 1);
    assert_eq!(*s.get(b"b").unwrap().unwrap(), val(2, 3000)); // promotes b, evicts a: no write
    assert_eq!(s.tier(b"a"), Some(Tier::Disk));
    assert_eq!(s.metrics().activity("disk-write").count, writes + 1);
    assert_eq!(*s.get(b"a").unwrap().unwrap(), val(1, 3000));
}

/// A value whose object is heavier than the target, though its serialized bytes are light, is
/// served by `get` without promotion, as a `put` of the object would have kept it on disk:
/// promoting it would push every other entry down a tier, then demote the value itself.
#[test]
fn a_get_does_not_promote_an_object_heavier_than_the_target() {
    let (s, _) = open(10_000);
    let mut x = b"bloated".to_vec();
    x.resize(800, b'x'); // 16,000 bytes as an object
    s.put_serialized(b"x", ser(&x)).unwrap();
    s.put_serialized(b"s1", ser(&val(1, 2_000))).unwrap();
    s.put_serialized(b"s2", ser(&val(2, 2_000))).unwrap();
    for _ in 0..2 {
        assert_eq!(*s.get(b"x").unwrap().unwrap(), x);
    }
    assert_eq!(s.tier(b"x"), Some(Tier::Serialized));
    assert_eq!(s.tier(b"s1"), Some(Tier::Serialized), "not pushed to disk");
    assert_eq!(s.tier(b"s2"), Some(Tier::Serialized));
    assert_eq!(s.metrics().activity("disk-write").count, 0);
    assert!(s.memory_bytes() <= 10_000);
}

/// A spill store (not persistent) releases the disk blocks of a removed large value, as unlinking its
/// file would (on the log's punch thread: once `settle_punches` returns); the values around it still
/// read back, and a reopened spill store starts empty.
#[test]
fn a_spill_store_releases_removed_values_blocks() {
    use std::os::unix::fs::MetadataExt;
    let tmp = tempfile::tempdir().unwrap();
    let blocks = || -> u64 {
        std::fs::read_dir(tmp.path().join("segments")).unwrap().map(|e| e.unwrap().metadata().unwrap().blocks()).sum()
    };
    let c = StoreConfig { target_bytes: 1 << 20, ..Default::default() };
    let s = Store::open(TestCodec::default(), spillway::PortableBackend::new(), tmp.path(), c.clone()).unwrap();
    for i in 0..8u8 {
        s.put(&[i], val(i, 512 << 10)).unwrap();
    }
    let on_disk: Vec<u8> = (0..8u8).filter(|&i| s.tier(&[i]) == Some(Tier::Disk)).collect();
    assert!(on_disk.len() >= 4, "{on_disk:?}");
    let before = blocks();
    for &i in &on_disk[..2] {
        assert!(s.remove(&[i]).unwrap());
    }
    s.log().settle_punches();
    let released = before - blocks();
    assert!(released >= 2 * (500 << 10) / 512, "{released} blocks of 512 B released");
    for &i in &on_disk[2..] {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 512 << 10));
    }
    s.check_accounting().unwrap();
    drop(s);
    let s = Store::open(TestCodec::default(), spillway::PortableBackend::new(), tmp.path(), c).unwrap();
    assert!(s.is_empty());
}

/// The eviction policy's slack: by default a round evicts `min(target / 16, 4 MiB)` below the
/// target, so spill writes come in batches; with no slack, eviction stops as soon as memory is back
/// at the target (dask's rule), one value at a time.
#[test]
fn eviction_goes_as_far_below_the_target_as_the_policy_says() {
    let target = 1 << 20;
    let mut lowest = Vec::new();
    for policy in [EvictionPolicy { max_slack_bytes: 0, ..EvictionPolicy::default() }, EvictionPolicy::default()] {
        let c = StoreConfig { eviction: policy, ..cfg(target) };
        let s = Store::open(TestCodec::default(), SimBackend::new(), "/s", c).unwrap();
        let mut low = u64::MAX;
        for i in 0..3000u32 {
            s.put(&i.to_le_bytes(), val(7, 999)).unwrap();
            let m = s.memory_bytes();
            assert!(m <= target, "{policy:?}: {m} over the target after put {i}");
            if s.metrics().of(Activity::DiskWrite).count > 0 {
                low = low.min(m);
            }
        }
        s.check_accounting().unwrap();
        lowest.push(low);
    }
    let slack = EvictionPolicy::default().slack(target);
    assert!(lowest[0] > target - 2 * 1000, "no slack evicts one value at a time, reached {}", lowest[0]);
    assert!(
        lowest[1] <= target - slack + 1000,
        "the default slack of {slack} evicts in batches, reached {}",
        lowest[1]
    );
}

#[test]
fn a_deferred_put_leaves_the_eviction_to_enforce_target() {
    let (s, _) = open(10_000);
    for c in b"abc" {
        assert_eq!(s.put_deferred(&[*c], val(*c, 2999)).unwrap(), None, "under the target");
    }
    // Over the target: nothing is evicted until enforce_target, on whichever thread calls it.
    assert_eq!(s.put_deferred(b"d", val(b'd', 2999)).unwrap(), Some(4 * 3000));
    assert_eq!(s.put_serialized_deferred(b"e", ser(&val(b'e', 2999))).unwrap(), Some(5 * 3000));
    assert_eq!(s.memory_bytes(), 5 * 3000);
    assert!(b"abcde".iter().all(|c| s.tier(&[*c]) != Some(Tier::Disk)));
    std::thread::scope(|t| {
        t.spawn(|| s.enforce_target().unwrap());
    });
    assert!(s.memory_bytes() <= 10_000, "{}", s.memory_bytes());
    assert_eq!(s.tier(b"a"), Some(Tier::Disk), "the least recently used first");
    assert_eq!(s.tier(b"e"), Some(Tier::Serialized));
    // A value heavier than the target is still written at once.
    assert_eq!(s.put_deferred(b"big", val(2, 50_000)).unwrap(), None);
    assert_eq!(s.tier(b"big"), Some(Tier::Disk));
    for c in b"abcde" {
        assert_eq!(*s.get(&[*c]).unwrap().unwrap(), val(*c, 2999));
    }
    s.check_accounting().unwrap();
}
