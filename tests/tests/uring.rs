//! The io_uring driver on its own: multi-piece transfers, end of file, registered buffers, abandoned
//! futures, many threads, errors, and the log's async reads. Each test prints why it skipped when the
//! kernel refuses io_uring (and fails instead under `SPILLWAY_REQUIRE_URING=1`).

use std::sync::Arc;

use spillway::backend::{UringBackend, UringOptions, PIECE};
use spillway::buf::AlignedBuf;
use spillway::task::block_on;
use spillway::{AutoBackend, Backend, BackendKind, Frames, LogOptions, SegmentLog};
use spillway_tests::{frames_for, uring_or_skip, value_for, Rng};

fn filled(data: &[u8]) -> AlignedBuf {
    let mut b = AlignedBuf::with_capacity(data.len(), 4096);
    b.extend_from_slice(data);
    b
}

/// The ring for every call, blocking ones included (the default runs lone blocking calls inline).
fn backend(test: &str, direct: bool) -> Option<UringBackend> {
    uring_or_skip(test, UringOptions { direct, pool_buffers: 4, inline_blocking: false, ..Default::default() })
}

#[test]
fn transfers_larger_than_a_piece_round_trip() {
    for direct in [false, true] {
        let Some(be) = backend("transfers_larger_than_a_piece_round_trip", direct) else { return };
        let tmp = tempfile::tempdir().unwrap();
        let f = be.open(&tmp.path().join("f"), true).unwrap();
        let len = 2 * PIECE + 3 * 4096;
        let data = value_for(b"big", len);
        let (r, _) = be.write_at(&f, 8192, filled(&data));
        r.unwrap();
        let (r, got) = be.read_at(&f, 8192, AlignedBuf::zeroed(len, 4096));
        r.unwrap();
        assert!(got[..] == data[..], "read back differs (direct={direct})");
        assert_eq!(be.file_len(&f).unwrap(), 8192 + len as u64);
    }
}

#[test]
fn reading_past_the_end_is_unexpected_eof_and_zero_length_is_a_no_op() {
    let Some(be) = backend("reading_past_the_end", false) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let f = be.open(&tmp.path().join("f"), true).unwrap();
    be.write_at(&f, 0, filled(&[7u8; 8192])).0.unwrap();
    // A short read (8 KiB of 16) is resubmitted, then meets end of file.
    let (r, _) = be.read_at(&f, 0, AlignedBuf::zeroed(16384, 4096));
    assert_eq!(r.unwrap_err().kind(), std::io::ErrorKind::UnexpectedEof);
    let (r, _) = be.read_at(&f, 1 << 20, AlignedBuf::zeroed(4096, 4096));
    assert_eq!(r.unwrap_err().kind(), std::io::ErrorKind::UnexpectedEof);
    let (r, b) = be.read_at(&f, 0, AlignedBuf::zeroed(0, 4096));
    r.unwrap();
    assert!(b.is_empty());
}

#[test]
fn registered_pool_buffers_carry_data_both_ways() {
    let Some(be) = backend("registered_pool_buffers", true) else { return };
    let Some(pool) = be.pool().cloned() else {
        println!("SKIPPED registered_pool_buffers: buffer registration refused (RLIMIT_MEMLOCK)");
        return;
    };
    assert_eq!(be.info().registered_buffers, pool.count());
    let tmp = tempfile::tempdir().unwrap();
    let f = be.open(&tmp.path().join("f"), true).unwrap();
    let mut w = be.alloc_buf(64 << 10, 4096);
    assert!(w.pool_index(&pool).is_some(), "a pool slot fits 64 KiB");
    let data = value_for(b"fixed", 64 << 10);
    w.copy_from_slice(&data);
    be.write_at(&f, 0, w).0.unwrap();
    let r = be.alloc_buf(64 << 10, 4096);
    assert!(r.pool_index(&pool).is_some());
    let (res, r) = be.read_at(&f, 0, r);
    res.unwrap();
    assert!(r[..] == data[..]);
    drop(r);
    assert_eq!(pool.available(), pool.count(), "slots come back when buffers drop");
    // Larger than a slot: a heap buffer, plain Read/Write.
    assert!(be.alloc_buf(2 << 20, 4096).pool_index(&pool).is_none());
}

#[test]
fn abandoned_futures_keep_their_buffers_until_the_kernel_is_done() {
    let Some(be) = backend("abandoned_futures", true) else { return };
    let Some(pool) = be.pool().cloned() else {
        println!("SKIPPED abandoned_futures: buffer registration refused (RLIMIT_MEMLOCK)");
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let f = be.open(&tmp.path().join("f"), true).unwrap();
    be.write_at(&f, 0, filled(&vec![1u8; 4 << 20])).0.unwrap();
    for i in 0..pool.count().min(4) as u64 {
        let mut b = pool.check_out();
        b.set_len(1 << 20);
        drop(be.read(&f, i << 20, b)); // given up at once
    }
    // Until their completions are reaped the slots stay with the driver; dropping the backend drains
    // them, after which every slot is back.
    drop(be);
    assert_eq!(pool.available(), pool.count());
}

#[test]
fn many_threads_and_many_futures_share_one_driver() {
    let Some(be) = backend("many_threads", true) else { return };
    let be = Arc::new(be);
    let tmp = tempfile::tempdir().unwrap();
    let f = Arc::new(be.open(&tmp.path().join("f"), true).unwrap());
    let block = 16 << 10;
    let threads: Vec<_> = (0..6u64)
        .map(|t| {
            let (be, f) = (be.clone(), f.clone());
            std::thread::spawn(move || {
                let mut rng = Rng::new(t + 1);
                for i in 0..150u64 {
                    let slot = t * 1000 + rng.below(64);
                    // Each round's bytes differ, so a lost write or a stale read cannot match.
                    let data = value_for(&(slot << 16 | i).to_le_bytes(), block);
                    be.write_at(&f, slot * block as u64, filled(&data)).0.unwrap();
                    let (r, got) = be.read_at(&f, slot * block as u64, AlignedBuf::zeroed(block, 4096));
                    r.unwrap();
                    assert!(got[..] == data[..], "thread {t} slot {slot}");
                }
            })
        })
        .collect();
    // Meanwhile, one thread with 128 operations in flight at once.
    let futs: Vec<_> = (0..128u64).map(|i| be.write(&f, (1 << 30) + i * 4096, filled(&[i as u8; 4096]))).collect();
    for fut in futs {
        block_on(fut).0.unwrap();
    }
    let reads: Vec<_> =
        (0..128u64).map(|i| be.read(&f, (1 << 30) + i * 4096, AlignedBuf::zeroed(4096, 4096))).collect();
    for (i, fut) in reads.into_iter().enumerate().rev() {
        let (r, b) = block_on(fut);
        r.unwrap();
        assert!(b.iter().all(|&x| x == i as u8));
    }
    for t in threads {
        t.join().unwrap();
    }
}

/// O_DIRECT: a file whose size is not a multiple of the block. A read past its end comes back short
/// at an offset O_DIRECT cannot ask for again: end of file, not the EINVAL a resubmission would get.
#[test]
fn an_o_direct_read_past_an_unaligned_end_is_unexpected_eof() {
    let Some(be) = backend("o_direct_unaligned_end", true) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("f");
    std::fs::write(&path, value_for(b"tail", 4096 + 100)).unwrap();
    let f = be.open(&path, false).unwrap();
    if !be.direct() {
        println!("SKIPPED o_direct_unaligned_end: the file system refused O_DIRECT");
        return;
    }
    let (r, _) = be.read_at(&f, 0, AlignedBuf::zeroed(8192, 4096));
    assert_eq!(r.unwrap_err().kind(), std::io::ErrorKind::UnexpectedEof);
    // A read that fits is whole.
    let (r, got) = be.read_at(&f, 0, AlignedBuf::zeroed(4096, 4096));
    r.unwrap();
    assert_eq!(&got[..], &value_for(b"tail", 4096 + 100)[..4096]);
    // The same through a pipeline of the calling thread: the short read is end of file too.
    let got = pipelined(&be, &Arc::new(f), &[(0, 8192), (0, 4096)]);
    assert_eq!(got[0].as_ref().unwrap_err().kind(), std::io::ErrorKind::UnexpectedEof);
    assert_eq!(&got[1].as_ref().unwrap()[..], &value_for(b"tail", 4096 + 100)[..4096]);
}

/// Read `(offset, len)` pairs with `read_pipelined`, results in the order asked.
fn pipelined(
    be: &UringBackend,
    f: &Arc<spillway::backend::UringFile>,
    reads: &[(u64, usize)],
) -> Vec<std::io::Result<AlignedBuf>> {
    let mut it = reads.iter().enumerate();
    let mut out: Vec<Option<std::io::Result<AlignedBuf>>> = reads.iter().map(|_| None).collect();
    be.read_pipelined(
        8,
        &mut || {
            it.next().map(|(i, &(offset, len))| spillway::backend::PipelinedRead {
                file: f.clone(),
                offset,
                buf: AlignedBuf::zeroed(len, 4096),
                tag: i as u64,
            })
        },
        &mut |tag, (r, b)| out[tag as usize] = Some(r.map(|()| b)),
    )
    .unwrap();
    out.into_iter().map(|r| r.expect("every read reported")).collect()
}

/// Where no ring can be created for a pipeline (here: no file descriptor left), the reads run one
/// after another on the backend instead, with the same results. Runs in a child process, since it
/// lowers the process's descriptor limit.
#[test]
fn pipelined_reads_fall_back_when_no_ring_can_be_created() {
    let data = value_for(b"noring", 4 * 4096);
    if spillway_tests::child_arg().is_some() {
        let be = backend("pipelined_noring", false).expect("the parent checked io_uring");
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        std::fs::write(&path, &data).unwrap();
        let f = Arc::new(be.open(&path, false).unwrap());
        // The lowest free descriptor number becomes the limit: no new descriptor can be made.
        let probe = std::fs::File::open("/dev/null").unwrap();
        let lowest_free = std::os::fd::AsRawFd::as_raw_fd(&probe) as u64;
        drop(probe);
        let old = rustix::process::getrlimit(rustix::process::Resource::Nofile);
        let low = rustix::process::Rlimit { current: Some(lowest_free), maximum: old.maximum };
        rustix::process::setrlimit(rustix::process::Resource::Nofile, low).unwrap();
        assert!(std::fs::File::open("/dev/null").is_err(), "no descriptor is left");
        let got = pipelined(&be, &f, &[(4096, 8192), (0, 4096), (0, 5 * 4096)]);
        rustix::process::setrlimit(rustix::process::Resource::Nofile, old).unwrap();
        assert_eq!(&got[0].as_ref().unwrap()[..], &data[4096..3 * 4096]);
        assert_eq!(&got[1].as_ref().unwrap()[..], &data[..4096]);
        assert_eq!(got[2].as_ref().unwrap_err().kind(), std::io::ErrorKind::UnexpectedEof);
        println!("NORING-FALLBACK-OK");
        return;
    }
    if backend("pipelined_noring", false).is_none() {
        return;
    }
    let (status, out) = spillway_tests::run_child("pipelined_reads_fall_back_when_no_ring_can_be_created", "");
    assert!(status.success() && out.contains("NORING-FALLBACK-OK"), "child: {status}\n{out}");
}

/// A buffered pipelined read that comes back short is read on; one past the end is end of file.
#[test]
fn pipelined_reads_resubmit_short_reads_and_report_end_of_file() {
    let Some(be) = backend("pipelined_short_reads", false) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("f");
    let data = value_for(b"pipe", 3 * 4096 + 100);
    std::fs::write(&path, &data).unwrap();
    let f = Arc::new(be.open(&path, false).unwrap());
    let got = pipelined(&be, &f, &[(100, 3 * 4096), (0, 4 * 4096), (1 << 20, 10), (7, 0)]);
    assert_eq!(&got[0].as_ref().unwrap()[..], &data[100..]);
    assert_eq!(got[1].as_ref().unwrap_err().kind(), std::io::ErrorKind::UnexpectedEof);
    assert_eq!(got[2].as_ref().unwrap_err().kind(), std::io::ErrorKind::UnexpectedEof);
    assert!(got[3].as_ref().unwrap().is_empty());
}

#[test]
fn kernel_errors_come_back_typed() {
    let Some(be) = backend("kernel_errors", true) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let f = be.open(&tmp.path().join("f"), true).unwrap();
    if !be.direct() {
        println!("SKIPPED kernel_errors: the file system refused O_DIRECT");
        return;
    }
    // O_DIRECT with a length that is not a multiple of the block size: EINVAL from the kernel.
    let (r, _) = be.write_at(&f, 0, filled(&[1u8; 100]));
    assert_eq!(r.unwrap_err().raw_os_error(), Some(22), "EINVAL");
    // The driver keeps working after an error.
    be.write_at(&f, 0, filled(&[2u8; 4096])).0.unwrap();
}

#[test]
fn log_reads_many_keys_concurrently_through_get_async() {
    let Some(be) = backend("log_get_async", true) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let log = SegmentLog::open(be, tmp.path(), LogOptions { segment_bytes: 4 << 20, ..Default::default() }).unwrap();
    let keys: Vec<Vec<u8>> = (0..600).map(|i| format!("k{i}").into_bytes()).collect();
    for (i, k) in keys.iter().enumerate() {
        log.put(k, &frames_for(k, (i * 37) % 20000)).unwrap();
    }
    let futs: Vec<_> = keys.iter().map(|k| log.get_async(k)).collect();
    let missing = log.get_async(b"absent");
    for (i, fut) in futs.into_iter().enumerate().rev() {
        let got = block_on(fut).unwrap().unwrap();
        assert_eq!(got, frames_for(&keys[i], (i * 37) % 20000));
    }
    assert!(block_on(missing).unwrap().is_none());
}

#[test]
fn auto_backend_names_its_choice_and_refuses_unknown_kinds() {
    let p = AutoBackend::new(BackendKind::Portable, false).unwrap();
    assert_eq!(p.name(), "portable");
    assert!("fast".parse::<BackendKind>().unwrap_err().contains("unknown backend"));
    let auto = AutoBackend::new(BackendKind::Auto, true).unwrap();
    if uring_or_skip("auto_backend", UringOptions::default()).is_some() {
        assert_eq!(auto.name(), "uring");
    }
    let tmp = tempfile::tempdir().unwrap();
    let log = SegmentLog::open(auto, tmp.path(), LogOptions::default()).unwrap();
    log.put(b"a", &Frames::from(b"b".to_vec())).unwrap();
    assert_eq!(log.get(b"a").unwrap().unwrap().concat(), &b"b"[..]);
}

#[test]
fn pipelined_gets_return_every_key_once_on_every_backend() {
    let tmp = tempfile::tempdir().unwrap();
    let keys: Vec<Vec<u8>> = (0..500).map(|i| format!("p{i}").into_bytes()).collect();
    {
        let log = SegmentLog::open(spillway::PortableBackend::new(), tmp.path(), LogOptions::default()).unwrap();
        for (i, k) in keys.iter().enumerate() {
            log.put(k, &frames_for(k, (i * 53) % 9000)).unwrap();
        }
        log.sync().unwrap();
    }
    let mut backends = vec![AutoBackend::new(BackendKind::Portable, false).unwrap()];
    if uring_or_skip("pipelined_gets", UringOptions::default()).is_some() {
        backends.push(AutoBackend::new(BackendKind::Uring, true).unwrap());
    }
    for be in backends {
        let name = be.name();
        let log = SegmentLog::open(be, tmp.path(), LogOptions::default()).unwrap();
        let mut wanted: Vec<Vec<u8>> = keys.iter().rev().cloned().collect();
        wanted.push(b"absent".to_vec());
        let mut seen = std::collections::HashMap::new();
        log.get_pipelined(32, &mut wanted.into_iter(), &mut |k, r| {
            assert!(seen.insert(k, r.unwrap()).is_none(), "{name}: a key came back twice");
        })
        .unwrap();
        assert_eq!(seen.len(), keys.len() + 1, "{name}");
        assert_eq!(seen[&b"absent"[..]], None);
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(seen[k].as_ref(), Some(&frames_for(k, (i * 53) % 9000)), "{name}: {k:?}");
        }
    }
}

#[test]
fn a_panicking_callback_drains_the_pipeline_before_buffers_are_freed() {
    let Some(be) = backend("pipeline_panic", true) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let f = Arc::new(be.open(&tmp.path().join("f"), true).unwrap());
    be.write_at(&f, 0, filled(&vec![9u8; 8 << 20])).0.unwrap();
    let mut issued = 0u64;
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let _ = be.read_pipelined(
            64,
            &mut || {
                issued += 1;
                (issued <= 1000).then(|| spillway::backend::PipelinedRead {
                    file: f.clone(),
                    offset: (issued % 2000) * 4096,
                    buf: AlignedBuf::zeroed(4096, 4096),
                    tag: issued,
                })
            },
            &mut |tag, _| assert!(tag < 10, "deliberate panic with reads in flight"),
        );
    }));
    assert!(r.is_err(), "the callback panicked");
    // The ring was drained on unwind; the backend and the file are still usable.
    let (res, b) = be.read_at(&f, 0, AlignedBuf::zeroed(4096, 4096));
    res.unwrap();
    assert!(b.iter().all(|&x| x == 9));
}

#[test]
fn a_batch_larger_than_the_ring_completes_and_the_driver_still_wakes() {
    // 16 entries, 200 reads in one batch: the queue fills while the wake-up read completes; the
    // driver must still re-arm it, or later requests and shutdown would never wake it.
    let opts = UringOptions { entries: 16, inline_blocking: false, ..Default::default() };
    let Some(be) = uring_or_skip("batch_larger_than_ring", opts) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let f = be.open(&tmp.path().join("f"), true).unwrap();
    be.write_at(&f, 0, filled(&value_for(b"batch", 200 * 4096))).0.unwrap();
    for _ in 0..3 {
        let reqs = (0..200u64)
            .map(|i| spillway::backend::ReadReq { file: &f, offset: i * 4096, buf: AlignedBuf::zeroed(4096, 4096) })
            .collect();
        let data = value_for(b"batch", 200 * 4096);
        for (i, (r, b)) in be.read_many(reqs).into_iter().enumerate() {
            r.unwrap();
            assert!(b[..] == data[i * 4096..(i + 1) * 4096], "read {i}");
        }
        be.write_at(&f, 0, filled(&data[..4096])).0.unwrap();
    }
    drop(be); // joins the driver: hangs if it can no longer be woken
}

/// The store's async gets on io_uring: many spilled values read by futures from several threads at
/// once, each deserialized once, all correct.
#[test]
fn store_get_async_on_io_uring() {
    use spillway::{Codec, CodecError, Store, StoreConfig};
    struct Plain;
    impl Codec for Plain {
        type Value = Vec<u8>;
        fn serialize(&self, v: &Vec<u8>) -> Result<Frames, CodecError> {
            Ok(Frames(vec![bytes::Bytes::from(v.clone())]))
        }
        fn deserialize(&self, f: Frames) -> Result<Vec<u8>, CodecError> {
            Ok(f.concat().to_vec())
        }
        fn size_of(&self, v: &Vec<u8>) -> u64 {
            v.len() as u64
        }
    }
    let Some(be) = backend("store_get_async_on_io_uring", false) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let cfg = StoreConfig { target_bytes: 256 << 10, ..Default::default() };
    let s = Arc::new(Store::open(Plain, be, tmp.path(), cfg).unwrap());
    let keys: Vec<Vec<u8>> = (0..64).map(|i| format!("key-{i}").into_bytes()).collect();
    for k in &keys {
        s.put(k, value_for(k, 20_000)).unwrap();
    }
    let spilled = s.metrics().tier_entries.iter().find(|(t, _)| *t == "disk").map_or(0, |x| x.1);
    assert!(spilled > 40, "{spilled} spilled");
    let handles: Vec<_> = (0..4)
        .map(|t| {
            let (s, keys) = (s.clone(), keys.clone());
            std::thread::spawn(move || {
                for k in keys.iter().skip(t).step_by(4) {
                    assert_eq!(*block_on(s.get_async(k)).unwrap().unwrap(), value_for(k, 20_000));
                    assert_eq!(block_on(s.get_serialized_async(k)).unwrap().unwrap().concat(), value_for(k, 20_000));
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    s.check_accounting().unwrap();
}

/// Which write path the log takes is the backend's call, and `AutoBackend` must pass it through: with
/// buffered files, queued writes only hand page-cache copies to io-wq workers (a store's 64 KiB spill
/// ran 25-30% slower that way), so they are written inline; with O_DIRECT, writes in flight overlap
/// at the device.
#[test]
fn auto_backend_passes_the_write_strategy_through() {
    let portable = AutoBackend::new(BackendKind::Portable, false).unwrap();
    assert!(!portable.queues_writes());
    for direct in [false, true] {
        let Some(u) = spillway_tests::uring_direct_or_skip("auto_backend_passes_the_write_strategy_through", direct)
        else {
            return;
        };
        let (queues, gathers) = (u.queues_writes(), u.gathers_writes());
        assert_eq!(queues, direct, "direct={direct}");
        assert_eq!(gathers, !direct, "direct={direct}");
        let auto =
            AutoBackend::with_options(BackendKind::Uring, UringOptions { direct, ..Default::default() }).unwrap();
        assert_eq!((auto.queues_writes(), auto.gathers_writes()), (queues, gathers), "direct={direct}");
    }
}

/// io_uring's direct files are laid out and read at the same O_DIRECT alignment as the portable
/// backend's (not at the buffered answer, only the file system block), and the auto backend answers
/// as the backend it wraps.
#[test]
fn direct_files_get_the_same_alignment_on_every_file_backend() {
    let Some(be) = backend("direct_files_get_the_same_alignment", true) else { return };
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("LOCK"), b"").unwrap();
    let portable = spillway::PortableBackend::with_direct(true);
    assert_eq!(be.alignment(tmp.path()), portable.alignment(tmp.path()));
    assert_eq!(be.read_alignment(tmp.path()), portable.read_alignment(tmp.path()));
    if let Some(dio) = spillway::backend::dio_alignment(&tmp.path().join("LOCK")) {
        assert_eq!(be.alignment(tmp.path()) % dio, 0);
    }
    let auto = AutoBackend::Uring(be);
    assert_eq!(auto.alignment(tmp.path()), portable.alignment(tmp.path()));
}

/// A file opened by one io_uring backend and used with another goes to that file: its registered
/// slot number belongs to the first backend's file table. Submitted against the second's own table,
/// where the same slot holds a file of its own, the write would land in that file.
#[test]
fn a_file_of_one_backend_used_with_another_reaches_the_right_file() {
    let Some(a) = backend("a_file_of_one_backend_used_with_another", false) else { return };
    let Some(b) = backend("a_file_of_one_backend_used_with_another", false) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let fa = a.open(&tmp.path().join("a"), true).unwrap();
    let fb = b.open(&tmp.path().join("b"), true).unwrap();
    // Each backend's first file takes slot 0 of its own table; a write through each registers it.
    a.write_at(&fa, 0, filled(&[b'a'; 4096])).0.unwrap();
    b.write_at(&fb, 0, filled(&[b'b'; 4096])).0.unwrap();
    b.write_at(&fa, 0, filled(&[b'A'; 4096])).0.unwrap();
    let (r, got) = b.read_at(&fa, 0, AlignedBuf::zeroed(4096, 4096));
    r.unwrap();
    assert!(got.iter().all(|&c| c == b'A'), "read through b from a's file");
    assert_eq!(std::fs::read(tmp.path().join("a")).unwrap(), vec![b'A'; 4096], "a's file holds the write");
    assert_eq!(std::fs::read(tmp.path().join("b")).unwrap(), vec![b'b'; 4096], "b's file is untouched");
}

/// On Linux 6.1 and later the driver's ring runs completions as deferred task work (with the
/// task-run flag, so a submit that does not wait still posts them): the kernel must accept that
/// combination of setup flags, or the backend silently falls back to a plain ring.
#[test]
fn the_tuned_ring_is_used_where_the_kernel_has_it() {
    let Some(be) = backend("the_tuned_ring_is_used_where_the_kernel_has_it", false) else { return };
    let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap();
    let mut parts = release.trim().split(|c: char| !c.is_ascii_digit()).map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    if (major, minor) < (6, 1) {
        println!("SKIPPED the_tuned_ring_is_used_where_the_kernel_has_it: Linux {major}.{minor} has no DEFER_TASKRUN");
        return;
    }
    assert!(be.info().deferred_taskrun, "Linux {major}.{minor} refused the ring's setup flags");
}
