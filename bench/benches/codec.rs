//! Criterion micro-benchmarks of the CPU paths under every spill and unspill: record encode and
//! decode (header, frame table, both checksums), crc32 of payloads, and lz4 compress/decompress.
//!
//! `cargo bench -p spillway-bench --bench codec` (add `-- --quick` for a short run).
// criterion_group! generates an undocumented public function.
#![allow(missing_docs)]

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use spillway::format::{self, RecordHeader, Salt};

/// Any salt: what the codec costs does not depend on it.
const SALT: Salt = Salt(0x0123_4567_89ab_cdef);

fn payload(len: usize) -> Vec<u8> {
    // Text-like: compressible about 2-3x, like pickled numeric data with repeated structure.
    let words: [&[u8]; 6] = [b"spill ", b"worker ", b"task-", b"0123 ", b"frame ", b"segment "];
    let mut v = Vec::with_capacity(len + 8);
    let mut x = 0x9E37_79B9u32;
    while v.len() < len {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        v.extend_from_slice(words[(x % 6) as usize]);
    }
    v.truncate(len);
    v
}

fn encode(key: &[u8], frames: &[&[u8]], out: &mut Vec<u8>) {
    let lens: Vec<u64> = frames.iter().map(|f| f.len() as u64).collect();
    let (_, raw) = format::frame_layout(lens.iter().copied()).expect("small frames");
    let len = format::record_len(frames.len(), key.len(), raw) as usize;
    out.clear();
    out.resize(len, 0);
    let po = len - raw as usize;
    format::lay_out_frames(&mut out[po..], frames.iter().copied());
    let h = RecordHeader {
        flags: 0,
        frame_count: frames.len() as u16,
        key_len: key.len() as u32,
        segment: 1,
        epoch: 1,
        payload_crc: format::payload_crc(&out[po..]),
        seq: 42,
        raw_len: raw,
        stored_len: raw,
        aux: 0,
    };
    format::write_record_head(out, &h, &lens, key, SALT);
}

fn sizes() -> [usize; 4] {
    [4 << 10, 64 << 10, 1 << 20, 16 << 20]
}

fn record_codec(c: &mut Criterion) {
    let mut g = c.benchmark_group("record");
    for size in sizes() {
        let p = payload(size);
        // Two frames, the first of an odd length, as a pickle header plus one buffer would be.
        let (a, b) = p.split_at(size / 4 + 3);
        let frames: [&[u8]; 2] = [a, b];
        let mut out = Vec::new();
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(BenchmarkId::new("encode", size), &size, |bch, _| {
            bch.iter(|| encode(black_box(b"task-key-0001"), black_box(&frames), &mut out))
        });
        encode(b"task-key-0001", &frames, &mut out);
        g.bench_with_input(BenchmarkId::new("decode+verify", size), &size, |bch, _| {
            bch.iter(|| format::decode_record(black_box(&out), SALT).expect("valid record").payload.len())
        });
    }
    g.finish();
}

fn checksums(c: &mut Criterion) {
    let mut g = c.benchmark_group("crc32");
    for size in sizes() {
        let p = payload(size);
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(BenchmarkId::from_parameter(size), &p, |bch, p| {
            bch.iter(|| format::payload_crc(black_box(p)))
        });
    }
    g.finish();
}

fn lz4(c: &mut Criterion) {
    let mut g = c.benchmark_group("lz4");
    for size in sizes() {
        let p = payload(size);
        let z = lz4_flex::block::compress(&p);
        let mut out = vec![0u8; size];
        g.throughput(Throughput::Bytes(size as u64));
        g.bench_with_input(BenchmarkId::new("compress", size), &p, |bch, p| {
            bch.iter(|| lz4_flex::block::compress(black_box(p)).len())
        });
        g.bench_with_input(BenchmarkId::new("decompress", size), &z, |bch, z| {
            bch.iter(|| lz4_flex::block::decompress_into(black_box(z), &mut out).expect("valid block"))
        });
    }
    g.finish();
}

criterion_group!(benches, record_codec, checksums, lz4);
criterion_main!(benches);
