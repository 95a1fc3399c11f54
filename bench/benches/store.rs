//! Criterion micro-benchmarks of the store's unspill path, against the floor of the same run: one
//! `pread` of a record-sized range of a cached file. What the store adds on top of that read (index
//! lookups, buffer allocation, checksum, materialization slot, accounting) is the gap.
//!
//! Also: a get of an in-memory value while another thread spills (`contended/`).
//!
//! `cargo bench -p spillway-bench --bench store` (add `-- --quick` for a short run).
// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use std::os::unix::fs::FileExt;

use bytes::Bytes;
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use spillway::{Codec, CodecError, Frames, PortableBackend, Store, StoreConfig};

/// Values are their own serialized form: the benchmark measures the store, not a codec.
struct Raw;

impl Codec for Raw {
    type Value = Bytes;
    fn serialize(&self, v: &Bytes) -> Result<Frames, CodecError> {
        Ok(Frames::single(v.clone()))
    }
    fn deserialize(&self, f: Frames) -> Result<Bytes, CodecError> {
        Ok(f.iter().next().cloned().unwrap_or_default())
    }
    fn size_of(&self, v: &Bytes) -> u64 {
        v.len() as u64
    }
}

/// Bytes of values spilled before the timed gets.
const POOL_BYTES: usize = 64 << 20;

/// A permutation of `0..n` (xorshift; the order only has to be scattered, not random).
fn scattered(n: usize, seed: u64) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    let mut x = seed | 1;
    for i in (1..n).rev() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        v.swap(i, (x % (i as u64 + 1)) as usize);
    }
    v
}

fn unspill(c: &mut Criterion) {
    let mut g = c.benchmark_group("unspill");
    for bs in [4096usize, 65536] {
        g.throughput(Throughput::Elements(1));
        let value = Bytes::from(vec![0x5au8; bs]);
        let dir = tempfile::tempdir().expect("temp dir");
        // A target far below the pool's bytes: all but the last few values are on disk.
        let cfg = StoreConfig { target_bytes: 256 << 10, ..Default::default() };
        let store = Store::open(Raw, PortableBackend::new(), dir.path(), cfg).expect("open store");
        let pool = POOL_BYTES / bs;
        let keys: Vec<Vec<u8>> = (0..pool).map(|i| format!("key-{i}").into_bytes()).collect();
        let order = scattered(pool, 0x9e37_79b9);
        for k in &keys {
            store.put(k, value.clone()).expect("put");
        }
        // Clean pages: the timed reads must not compete with the write-back of the puts.
        store.flush().expect("flush");
        // Steady state: a get reads the record, promotes the value, and the next get's eviction drops
        // it again for free (it still has its disk copy), so every get goes to disk.
        g.bench_function(BenchmarkId::new("store_get", bs), |b| {
            let mut i = 0usize;
            b.iter(|| {
                i = (i + 1) % pool;
                let v = store.get(&keys[order[i]]).expect("get").expect("present");
                assert_eq!(v.len(), bs);
            })
        });
        // The floor: one pread per value, of a record's size, at scattered offsets of a cached file.
        let rec = bs + 512;
        let path = dir.path().join("plain");
        std::fs::write(&path, vec![0x5au8; rec * pool]).expect("write plain file");
        let file = std::fs::File::open(&path).expect("open plain file");
        let mut buf = vec![0u8; rec];
        g.bench_function(BenchmarkId::new("pread", bs), |b| {
            let mut i = 0usize;
            b.iter(|| {
                i = (i + 1) % pool;
                file.read_exact_at(&mut buf, (order[i] * rec) as u64).expect("pread");
            })
        });
    }
    g.finish();
}

/// A get of a value held in memory while another thread keeps spilling 1 MiB values: what a task
/// thread of a worker sees while the worker is spilling. With spill writes under the store lock, each
/// get could wait for a whole batch write; now it waits at most for an eviction decision.
fn get_while_spilling(c: &mut Criterion) {
    let mut g = c.benchmark_group("contended");
    g.throughput(Throughput::Elements(1));
    let dir = tempfile::tempdir().expect("temp dir");
    let cfg = StoreConfig { target_bytes: 16 << 20, ..Default::default() };
    let store = Store::open(Raw, PortableBackend::new(), dir.path(), cfg).expect("open store");
    store.put(b"hot", Bytes::from(vec![1u8; 4096])).expect("put");
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        s.spawn(|| {
            let value = Bytes::from(vec![0x5au8; 1 << 20]);
            let mut i = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let k = format!("bulk-{}", i % 512);
                store.put(k.as_bytes(), value.clone()).expect("put");
                i += 1;
            }
        });
        g.bench_function("get_memory_while_spilling", |b| b.iter(|| store.get(b"hot").expect("get").expect("present")));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
    g.finish();
}

criterion_group!(benches, unspill, get_while_spilling);
criterion_main!(benches);
