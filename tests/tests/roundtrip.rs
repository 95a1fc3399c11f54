//! Round trip: many keys of sizes 0 B to 64 MiB, across segment rotation (and values larger than a
//! segment), written by one process and read back by a fresh one after reopen. Runs on the portable
//! backend (real files) and on the simulated backend.

use spillway::{Compression, Frames, LogOptions, PortableBackend, SegmentLog, SimBackend};
use spillway_tests::{child_arg, frames_for, run_child, Rng};

fn sizes() -> Vec<(Vec<u8>, usize)> {
    let mut v: Vec<usize> =
        vec![0, 1, 7, 8, 9, 100, 511, 512, 513, 4095, 4096, 4097, 65536, 1 << 20, 3 << 20, 16 << 20, 64 << 20];
    let mut rng = Rng::new(7);
    for _ in 0..400 {
        v.push(rng.below(20_000) as usize);
    }
    v.into_iter().enumerate().map(|(i, s)| (format!("key-{i:04}-{s}").into_bytes(), s)).collect()
}

fn opts(compression: Compression) -> LogOptions {
    LogOptions { segment_bytes: 1 << 20, compression, ..Default::default() }
}

fn write_all(log: &SegmentLog<impl spillway::Backend>) {
    for (k, s) in sizes() {
        log.put(&k, &frames_for(&k, s)).unwrap();
    }
    // Overwrite some, so reopen must pick the newest.
    for (k, s) in sizes().into_iter().step_by(7) {
        log.put(&k, &frames_for(&k, s / 2)).unwrap();
    }
    log.sync().unwrap();
}

fn expected_size(i: usize, s: usize) -> usize {
    if i % 7 == 0 {
        s / 2
    } else {
        s
    }
}

fn check_all(log: &SegmentLog<impl spillway::Backend>) {
    let all = sizes();
    assert_eq!(log.len(), all.len());
    for (i, (k, s)) in all.into_iter().enumerate() {
        let got = log.get(&k).unwrap().unwrap_or_else(|| panic!("key {:?} missing", String::from_utf8_lossy(&k)));
        let want = frames_for(&k, expected_size(i, s));
        assert_eq!(got.total_len(), want.total_len(), "length of {:?}", String::from_utf8_lossy(&k));
        assert_eq!(got, want, "frames of {:?}", String::from_utf8_lossy(&k));
    }
}

/// The child half of `round_trip_across_processes`: writes, syncs and exits.
#[test]
fn child_writer() {
    let Some(dir) = child_arg() else { return };
    let compression = if dir.ends_with("lz4") { Compression::Lz4 } else { Compression::None };
    let log = SegmentLog::open(PortableBackend::new(), &dir, opts(compression)).unwrap();
    write_all(&log);
    println!("CHILD-DONE");
}

#[test]
fn round_trip_across_processes() {
    for name in ["plain", "lz4"] {
        let tmp = tempfile::tempdir().unwrap();
        let dir = tmp.path().join(name);
        let (status, out) = run_child("child_writer", dir.to_str().unwrap());
        assert!(status.success() && out.contains("CHILD-DONE"), "child failed: {status:?}\n{out}");
        let log = SegmentLog::open(PortableBackend::new(), &dir, opts(Compression::None)).unwrap();
        assert!(log.stats().segments > 3, "the data set must span several segments");
        check_all(&log);
        assert!(log.verify().unwrap().is_empty());
    }
}

#[test]
fn round_trip_sim_backend_with_512_byte_alignment() {
    let be = SimBackend::with_alignment(512);
    {
        let log = SegmentLog::open(be.clone(), "/store", opts(Compression::Lz4)).unwrap();
        write_all(&log);
        check_all(&log);
    }
    // Power loss after sync: everything synced survives.
    let be = be.crash(None);
    let log = SegmentLog::open(be, "/store", opts(Compression::Lz4)).unwrap();
    check_all(&log);
}

#[test]
fn frames_are_kept_apart_and_empty_values_work() {
    let tmp = tempfile::tempdir().unwrap();
    let log = SegmentLog::open(PortableBackend::new(), tmp.path(), opts(Compression::None)).unwrap();
    let v = Frames(vec![bytes::Bytes::from_static(b""), bytes::Bytes::from_static(b"ab"), bytes::Bytes::new()]);
    log.put(b"", &v).unwrap();
    log.put(b"empty", &Frames::default()).unwrap();
    let got = log.get(b"").unwrap().unwrap();
    assert_eq!(got.len(), 3);
    assert_eq!(got, v);
    assert_eq!(log.get(b"empty").unwrap().unwrap().len(), 0);
}

#[test]
fn oversized_inputs_are_rejected_with_typed_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let o = LogOptions { max_value_bytes: 1000, ..opts(Compression::None) };
    let log = SegmentLog::open(PortableBackend::new(), tmp.path(), o).unwrap();
    let big_key = vec![b'k'; spillway::MAX_KEY_BYTES + 1];
    assert!(matches!(log.put(&big_key, &Frames::from(b"x".to_vec())), Err(spillway::Error::KeyTooLarge { .. })));
    assert!(matches!(log.put(b"k", &Frames::from(vec![0u8; 1001])), Err(spillway::Error::ValueTooLarge { .. })));
    let max_key = vec![b'k'; spillway::MAX_KEY_BYTES];
    log.put(&max_key, &Frames::from(b"x".to_vec())).unwrap();
    assert_eq!(log.get(&max_key).unwrap().unwrap().concat(), &b"x"[..]);
    // The lock keeps a second opener out.
    assert!(matches!(
        SegmentLog::open(PortableBackend::new(), tmp.path(), LogOptions::default()),
        Err(spillway::Error::Locked { .. })
    ));
}

/// A value just under the value limit in many odd-sized frames: the record around it (frame table,
/// 64-byte gaps) is over 4 GiB, more than the index's 32-bit lengths hold. Refused with a typed error
/// before anything is encoded (the frames share one 64 KiB buffer, so the test costs no memory).
#[test]
fn a_record_too_long_for_the_index_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let log = SegmentLog::open(PortableBackend::new(), tmp.path(), opts(Compression::None)).unwrap();
    let frame = bytes::Bytes::from(vec![7u8; 65_473]); // laid out in 65,536 bytes
    let frames = Frames((0..65_535).map(|_| frame.clone()).collect());
    assert!(frames.total_len() <= spillway::MAX_VALUE_BYTES);
    match log.put(b"k", &frames) {
        Err(spillway::Error::ValueTooLarge { len, max, .. }) => assert!(len > max && max == u32::MAX as u64),
        r => panic!("{r:?}"),
    }
    assert_eq!(log.stats().live_records, 0);
}

#[test]
fn round_trip_io_uring_direct_and_buffered_then_reopen_portable() {
    for (direct, inline_blocking) in [(true, false), (false, false), (true, true)] {
        let opts_u = spillway::backend::UringOptions { direct, inline_blocking, ..Default::default() };
        let Some(be) = spillway_tests::uring_or_skip("round_trip_io_uring", opts_u) else { return };
        let tmp = tempfile::tempdir().unwrap();
        {
            let log = SegmentLog::open(be, tmp.path(), opts(Compression::None)).unwrap();
            write_all(&log);
            check_all(&log);
        }
        // The same files read by the other backend, and by io_uring again after reopen.
        check_all(&SegmentLog::open(PortableBackend::new(), tmp.path(), opts(Compression::None)).unwrap());
        let be = spillway_tests::uring_direct_or_skip("round_trip_io_uring", direct).unwrap();
        check_all(&SegmentLog::open(be, tmp.path(), opts(Compression::Lz4)).unwrap());
    }
}

#[test]
fn frames_read_back_start_64_byte_aligned() {
    // Consumers wrap frames without copying (numpy, Arrow); SIMD results can depend on alignment.
    for compression in [Compression::None, Compression::Lz4] {
        let tmp = tempfile::tempdir().unwrap();
        let log = SegmentLog::open(PortableBackend::new(), tmp.path(), opts(compression)).unwrap();
        for (i, key) in ["a", "odd-key-length", ""].iter().enumerate() {
            let frames = Frames(
                [3usize, 1000, 65537, 0, 5].iter().map(|&n| bytes::Bytes::from(vec![b'a' + i as u8; n + i])).collect(),
            );
            log.put(key.as_bytes(), &frames).unwrap();
            let got = log.get(key.as_bytes()).unwrap().unwrap();
            assert_eq!(got, frames);
            for f in got.iter().filter(|f| !f.is_empty()) {
                assert_eq!(f.as_ptr() as usize % 64, 0, "frame of {} bytes under {key:?} ({compression:?})", f.len());
            }
        }
    }
}

/// Gathered writes (large values handed to the kernel from their own buffers, no staging copy) must
/// produce the same segment files, byte for byte, as staged writes: small and large values, frames of
/// odd lengths (padding between frames), batches, overwrites, a delete, rotation, compaction. Then a
/// fresh log reads every value back from the gathered files. Gathered writes whose large values get
/// their crcs computed on a helper thread (heads written last) are checked the same way.
#[test]
fn gathered_writes_produce_identical_segments() {
    use bytes::Bytes;
    let value = |seed: u8, lens: &[usize]| {
        Frames(lens.iter().enumerate().map(|(i, &n)| Bytes::from(vec![seed.wrapping_add(i as u8); n])).collect())
    };
    let values: Vec<(Vec<u8>, Frames)> = (0..40u8)
        .map(|i| {
            let lens: &[usize] = match i % 5 {
                0 => &[10],
                1 => &[3, 70_001, 1, 300_007],
                2 => &[1 << 20],
                3 => &[5000, 64],
                _ => &[999, 2_500_000],
            };
            (format!("key-{i}").into_bytes(), value(i, lens))
        })
        .collect();
    let run = |gather: bool, parallel_crc_min_bytes: u64| {
        let be = SimBackend::new();
        be.set_gather_writes(gather);
        let opts =
            LogOptions { segment_bytes: 4 << 20, gather_min_bytes: 1000, parallel_crc_min_bytes, ..Default::default() };
        let log = SegmentLog::open(be.clone(), "/g", opts).unwrap();
        for (k, v) in &values[..10] {
            log.put(k, v).unwrap();
        }
        let batch: Vec<(&[u8], &Frames)> = values[10..30].iter().map(|(k, v)| (&k[..], v)).collect();
        log.put_many(&batch).unwrap();
        log.delete(&values[3].0).unwrap();
        for (k, v) in &values[30..] {
            log.put(k, v).unwrap();
        }
        log.put(&values[1].0, &values[2].1).unwrap(); // overwrite
        log.compact().unwrap();
        log.sync().unwrap();
        drop(log);
        let mut files = be.files();
        files.sort();
        let contents: Vec<_> = files.iter().map(|p| (p.clone(), be.file_contents(p).unwrap())).collect();
        (be, contents)
    };
    let (_, staged) = run(false, u64::MAX);
    let (_, gathered) = run(true, u64::MAX);
    spillway_tests::assert_same_files(&staged, &gathered, "gathered segment against the staged one");
    // 1 MiB: single puts of 2.5 MB values, and the batch (several large values with small ones between).
    let (be, parallel) = run(true, 1 << 20);
    spillway_tests::assert_same_files(&staged, &parallel, "gathered segment with parallel crcs against the staged one");
    let log = SegmentLog::open(be, "/g", LogOptions::default()).unwrap();
    for (i, (k, v)) in values.iter().enumerate() {
        let want = match i {
            3 => None,
            1 => Some(values[2].1.clone()),
            _ => Some(v.clone()),
        };
        assert_eq!(log.get(k).unwrap(), want, "key-{i}");
    }
}
