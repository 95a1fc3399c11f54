//! `get_many`: answers like `get`, deserializes each value once, reads disk values in one pipeline,
//! reports a damaged record for its key only.

use std::sync::atomic::Ordering;
use std::sync::{Arc, Barrier};

use spillway::{Backend, Error, Store, Tier};
use spillway_tests::store::*;

/// A value heavier than the target is not kept in memory after a get. Listed twice in one
/// `get_many`, it is still read and deserialized once, and both answers are the same `Arc`.
#[test]
fn get_many_of_a_large_key_listed_twice_deserializes_it_once() {
    let (s, _) = open(10_000);
    s.put_serialized(b"big", ser(&val(3, 50_000))).unwrap();
    s.put(b"small", val(4, 100)).unwrap();
    assert_eq!(s.tier(b"big"), Some(Tier::Disk));
    let got = s.get_many(&[b"big", b"small", b"big", b"absent", b"small"]);
    let got: Vec<_> = got.into_iter().map(|r| r.unwrap()).collect();
    assert_eq!(s.codec().deserialized.load(Ordering::SeqCst), 1);
    let (a, b) = (got[0].as_ref().unwrap(), got[2].as_ref().unwrap());
    assert!(Arc::ptr_eq(a, b));
    assert_eq!(**a, val(3, 50_000));
    assert_eq!(*got[1].clone().unwrap(), val(4, 100));
    assert!(got[3].is_none());
    assert_eq!(s.tier(b"big"), Some(Tier::Disk), "still not kept in memory");
}

/// A store whose values 0..8 are on disk (serialized first, then evicted one by one), with an object
/// in memory and a value heavier than the target on disk.
fn spread_over_tiers<B: spillway::Backend>(s: &Store<TestCodec, B>) {
    for i in 0..8u8 {
        s.put_serialized(&[i], ser(&val(i, 2000 + i as usize))).unwrap();
    }
    while s.evict().unwrap() > 0 {}
    s.put(b"large", val(9, 2 << 20)).unwrap(); // heavier than the target: straight to disk
    s.put(b"object", val(42, 1000)).unwrap();
    assert!((0..8u8).all(|i| s.tier(&[i]) == Some(Tier::Disk)));
}

fn expected(key: &[u8]) -> Option<Vec<u8>> {
    match key {
        b"large" => Some(val(9, 2 << 20)),
        b"object" => Some(val(42, 1000)),
        [i] if *i < 8 => Some(val(*i, 2000 + *i as usize)),
        _ => None,
    }
}

fn check_get_many<B: spillway::Backend>(s: &Store<TestCodec, B>) {
    spread_over_tiers(s);
    let keys: Vec<&[u8]> = vec![b"large", &[0], b"object", &[3], b"absent", &[0], &[7], &[1], &[2], &[4], &[5], &[6]];
    let before = s.codec().deserialized.load(Ordering::SeqCst);
    let got = s.get_many(&keys);
    assert_eq!(got.len(), keys.len());
    for (k, g) in keys.iter().zip(&got) {
        assert_eq!(g.as_ref().unwrap().as_deref(), expected(k).as_ref(), "{k:?}");
    }
    // Every value not materialized yet was deserialized once, the listed-twice key too.
    assert_eq!(s.codec().deserialized.load(Ordering::SeqCst) - before, 9);
    let (a, b) = (got[1].as_ref().unwrap().as_ref().unwrap(), got[5].as_ref().unwrap().as_ref().unwrap());
    assert!(Arc::ptr_eq(a, b));
    // Promoted as `get` promotes: the small values are materialized now, the large one stays on disk.
    assert_eq!(s.tier(&[0]), Some(Tier::Materialized));
    assert_eq!(s.tier(b"large"), Some(Tier::Disk));
    assert!(Arc::ptr_eq(a, &s.get(&[0]).unwrap().unwrap()));
    assert_eq!(s.metrics().activity("disk-read").count, 9);
    s.check_accounting().unwrap();
}

#[test]
fn get_many_answers_like_get_and_deserializes_each_value_once() {
    let (s, _) = open(1 << 20);
    check_get_many(&s);
}

#[test]
fn get_many_on_io_uring_reads_the_disk_values_in_one_pipeline() {
    // O_DIRECT: where the store pipelines reads (buffered files read one after another).
    let Some(be) = spillway_tests::uring_direct_or_skip("get_many_on_io_uring", true) else { return };
    assert!(be.pipelines_reads());
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(TestCodec::default(), be, dir.path(), cfg(1 << 20)).unwrap();
    check_get_many(&s);
}

#[test]
fn get_many_reports_a_damaged_record_for_its_key_only() {
    let (s, be) = open(1 << 20);
    spread_over_tiers(&s);
    let loc = s.log().location(&[3]).unwrap();
    let path = format!("/store/segments/{:08x}.seg", loc.segment);
    be.poke(std::path::Path::new(&path), loc.offset + loc.len - 1, &[0xff]).unwrap();
    let ids: Vec<[u8; 1]> = (0..8u8).map(|i| [i]).collect();
    let keys: Vec<&[u8]> = ids.iter().map(|k| &k[..]).collect();
    let got = s.get_many(&keys);
    for (i, g) in got.iter().enumerate() {
        if i == 3 {
            assert!(matches!(g, Err(Error::ChecksumMismatch { .. })), "{g:?}");
        } else {
            assert_eq!(g.as_ref().unwrap().as_deref(), expected(&[i as u8]).as_ref());
        }
    }
    assert_eq!(s.tier(&[3]), Some(Tier::Disk), "the damaged value stays where it was");
    s.check_accounting().unwrap();
}

#[test]
fn concurrent_get_many_and_get_deserialize_each_value_once() {
    for round in 0..10 {
        let (s, _) = open(1 << 20);
        spread_over_tiers(&s);
        let s = Arc::new(s);
        let barrier = Arc::new(Barrier::new(4));
        let handles: Vec<_> = (0..4u8)
            .map(|t| {
                let (s, b) = (s.clone(), barrier.clone());
                std::thread::spawn(move || {
                    b.wait();
                    if t == 0 {
                        (0..8u8).map(|i| s.get(&[i]).unwrap().unwrap()).collect::<Vec<_>>()
                    } else {
                        // Overlapping batches, in different orders.
                        let order: Vec<u8> = (0..8u8).map(|i| (i + 3 * t) % 8).collect();
                        let keys: Vec<&[u8]> = order.iter().map(std::slice::from_ref).collect();
                        let mut got: Vec<_> = s.get_many(&keys).into_iter().zip(&order).collect();
                        got.sort_by_key(|(_, &i)| i);
                        got.into_iter().map(|(g, _)| g.unwrap().unwrap()).collect()
                    }
                })
            })
            .collect();
        let vals: Vec<Vec<_>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(s.codec().deserialized.load(Ordering::SeqCst), 8, "round {round}");
        for i in 0..8 {
            assert!(vals.iter().all(|v| Arc::ptr_eq(&v[i], &vals[0][i])), "round {round} key {i}");
        }
        s.check_accounting().unwrap();
    }
}

/// A key list longer than one batch of `get_many` (read, then materialized, batch by batch) still
/// answers every key in order.
#[test]
fn get_many_of_more_keys_than_a_batch_answers_all_in_order() {
    let (s, _) = open(1 << 20);
    let n = spillway::store::GET_MANY_BATCH * 2 + 7;
    let names: Vec<Vec<u8>> = (0..n).map(|i| format!("k{i}").into_bytes()).collect();
    for (i, k) in names.iter().enumerate() {
        s.put_serialized(k, ser(&val(i as u8, 100 + i % 50))).unwrap();
    }
    while s.evict().unwrap() > 0 {}
    let mut keys: Vec<&[u8]> = names.iter().map(|k| &k[..]).rev().collect();
    keys.push(b"absent");
    let got = s.get_many(&keys);
    assert_eq!(got.len(), n + 1);
    for (j, g) in got[..n].iter().enumerate() {
        let i = n - 1 - j;
        assert_eq!(g.as_ref().unwrap().as_deref(), Some(&val(i as u8, 100 + i % 50)), "key {i}");
    }
    assert!(got[n].as_ref().unwrap().is_none());
    assert_eq!(s.codec().deserialized.load(Ordering::SeqCst), n);
    s.check_accounting().unwrap();
}
