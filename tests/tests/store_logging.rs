//! What the store logs when it keeps data in memory (its own test binary: the logger is global to the
//! process). Each condition is logged in dask's words, and one condition does not silence another: a
//! disk failure after a full `max_spill` is logged too.

use bytes::Bytes;
use spillway::backend::{Fault, FaultKind, FaultOp};
use spillway::{Codec, CodecError, Frames, SimBackend, Store, StoreConfig};

fn count(prefix: &str) -> usize {
    spillway_tests::logs::lines_with(prefix).len()
}

/// Values are byte vectors; those starting with `unpicklable` fail to serialize.
struct Codec1;
impl Codec for Codec1 {
    type Value = Vec<u8>;
    fn serialize(&self, v: &Vec<u8>) -> Result<Frames, CodecError> {
        if v.starts_with(b"unpicklable") {
            return Err("cannot pickle this".into());
        }
        Ok(Frames::single(Bytes::from(v.clone())))
    }
    fn deserialize(&self, f: Frames) -> Result<Vec<u8>, CodecError> {
        Ok(f.iter().flat_map(|b| b.iter().copied()).collect())
    }
    fn size_of(&self, v: &Vec<u8>) -> u64 {
        v.len() as u64
    }
}

#[test]
fn each_condition_is_logged_and_rate_limited_on_its_own() {
    spillway_tests::logs::capture(log::LevelFilter::Debug);
    let be = SimBackend::new();
    // (No fresh log after the EIO: this is about the messages of a store that keeps its log.)
    let mut cfg =
        StoreConfig { target_bytes: 4_000, max_spill_bytes: Some(3_000), fresh_logs: 0, ..Default::default() };
    cfg.log.write_behind_bytes = 0; // every spill batch is written at once (and meets the fault)
    let s = Store::open(Codec1, be.clone(), "/store", cfg).unwrap();
    // max_spill: refused again and again, logged once within the rate limit.
    for i in 0..8u8 {
        s.put(&[i], vec![i; 2_000]).unwrap();
    }
    assert!(s.metrics().max_spill_refusals >= 3);
    assert_eq!(count("Spill file on disk reached capacity; keeping data in memory"), 1);
    // A disk failure afterwards is logged too, not silenced by the capacity warning.
    for i in 0..8u8 {
        s.remove(&[i]).unwrap();
    }
    be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Eio, sticky: true });
    for i in 10..40u8 {
        s.put(&[i], vec![i; 400]).unwrap(); // small batches, within max_spill: they reach the disk
    }
    assert!(s.metrics().spill_failures >= 1);
    assert_eq!(count("Spill to disk failed; keeping data in memory"), 1, "{:?}", spillway_tests::logs::lines());
    drop(s);

    // A value that cannot be serialized, retried after space is freed: logged once.
    let s =
        Store::open(Codec1, SimBackend::new(), "/store2", StoreConfig { target_bytes: 4_000, ..Default::default() })
            .unwrap();
    let mut bad = b"unpicklable".to_vec();
    bad.resize(3_000, 0);
    s.put(b"bad", bad).unwrap();
    for i in 0..6u8 {
        s.put(&[i], vec![i; 1_500]).unwrap();
        s.remove(&[i]).unwrap(); // frees disk space: eviction of "bad" is retried
    }
    assert!(s.metrics().spill_failures >= 2, "{:?}", s.metrics());
    assert_eq!(count("Failed to serialize \"bad\""), 1, "{:?}", spillway_tests::logs::lines());
}
