//! The three-tier store: LRU and threshold semantics, large values, max_spill, failure paths, exact
//! accounting, deserialize-exactly-once under concurrency, and metrics. Each test names the case it pins.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use bytes::Bytes;
use spillway::backend::{Fault, FaultKind, FaultOp};
use spillway::{Backend, Codec, CodecError, Error, Frames, LogOptions, SimBackend, Store, StoreConfig, Tier};

/// Values are byte vectors; serialized as a 1-byte header frame plus the bytes. Values starting with
/// `unpicklable` fail to serialize, values starting with `panicky` make it panic; serialized data starting with `undeserializable` fails to deserialize.
/// Values starting with `bloated` weigh 20 times their length as objects.
#[derive(Default)]
struct TestCodec {
    serialized: AtomicUsize,
    deserialized: AtomicUsize,
}

impl Codec for TestCodec {
    type Value = Vec<u8>;
    fn serialize(&self, v: &Vec<u8>) -> Result<Frames, CodecError> {
        if v.starts_with(b"unpicklable") {
            return Err("cannot pickle this".into());
        }
        if v.starts_with(b"panicky") {
            panic!("the test codec panics on this value");
        }
        self.serialized.fetch_add(1, Ordering::SeqCst);
        Ok(Frames(vec![Bytes::from_static(b"H"), Bytes::from(v.clone())]))
    }
    fn deserialize(&self, f: Frames) -> Result<Vec<u8>, CodecError> {
        self.deserialized.fetch_add(1, Ordering::SeqCst);
        if f.len() != 2 || f.0[0] != b"H"[..] {
            return Err("bad frames".into());
        }
        if f.0[1].starts_with(b"undeserializable") {
            return Err("cannot unpickle this".into());
        }
        Ok(f.0[1].to_vec())
    }
    fn size_of(&self, v: &Vec<u8>) -> u64 {
        if v.starts_with(b"bloated") {
            return 20 * v.len() as u64; // an object much heavier than its serialized form
        }
        v.len() as u64 + 1
    }
}

fn ser(v: &[u8]) -> Frames {
    Frames(vec![Bytes::from_static(b"H"), Bytes::copy_from_slice(v)])
}

fn cfg(target: u64) -> StoreConfig {
    StoreConfig {
        target_bytes: target,
        log: LogOptions { segment_bytes: 1 << 20, ..Default::default() },
        ..Default::default()
    }
}

fn persistent(target: u64) -> StoreConfig {
    StoreConfig { persistent: true, ..cfg(target) }
}

/// A store on a fresh simulated disk with `max_spill_bytes` set.
fn open_max_spill(max_spill: u64, target: u64) -> Store<TestCodec, SimBackend> {
    let c = StoreConfig { max_spill_bytes: Some(max_spill), ..cfg(target) };
    Store::open(TestCodec::default(), SimBackend::new(), "/s", c).unwrap()
}

fn open(target: u64) -> (Store<TestCodec, SimBackend>, SimBackend) {
    let be = SimBackend::new();
    (Store::open(TestCodec::default(), be.clone(), "/store", cfg(target)).unwrap(), be)
}

fn val(c: u8, n: usize) -> Vec<u8> {
    vec![c; n]
}

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
fn max_spill_refusal_keeps_data_in_memory_and_is_reported() {
    let be = SimBackend::new();
    let c = StoreConfig { max_spill_bytes: Some(7_000), ..cfg(4_000) };
    let s = Store::open(TestCodec::default(), be, "/store", c).unwrap();
    for i in 0..6u8 {
        s.put(&[i], val(i, 2999)).unwrap(); // never an error
    }
    let m = s.metrics();
    assert!(m.max_spill_refusals > 0);
    assert!(m.spilled_memory_bytes <= 7_000, "{m:?}");
    assert!(m.memory_bytes > 4_000, "refused entries stay in memory above the target");
    s.check_accounting().unwrap(); // stuck entries are out of the LRU order, and listed
    for i in 0..6u8 {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 2999), "nothing is lost");
    }
    // Freeing disk space lets evictions proceed again.
    let on_disk: Vec<u8> = (0..6u8).filter(|i| s.tier(&[*i]) == Some(Tier::Disk)).collect();
    for i in &on_disk {
        s.remove(&[*i]).unwrap();
    }
    s.put(b"new", val(7, 10)).unwrap();
    assert!(s.metrics().spilled_memory_bytes > 0);
    s.check_accounting().unwrap();
}

/// While a stream is being received, its size counts against `max_spill`, so evictions meanwhile can
/// be refused. When the stream fails (the peer hung up), that space is free again and those keys
/// can be spilled: they are not left stuck in memory for good.
#[test]
fn an_aborted_stream_gives_its_max_spill_space_back() {
    struct HangsUp<'a> {
        store: &'a Store<TestCodec, SimBackend>,
        sent: usize,
    }
    impl std::io::Read for HangsUp<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.sent == 0 {
                // Meanwhile, puts push memory over the target; max_spill refuses their evictions.
                // (Each refusal must hold: an eviction allowed here would write to the log, whose
                // writer lock this stream holds. 6000 + 2501 > 8000 leaves a margin of 500 bytes.)
                for i in 0..4u8 {
                    self.store.put(&[i], val(i, 2_500)).unwrap();
                }
                self.sent = 100.min(buf.len());
                buf[..self.sent].fill(0);
                return Ok(self.sent);
            }
            Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "peer hung up"))
        }
    }
    let c = StoreConfig { max_spill_bytes: Some(8_000), ..cfg(4_000) };
    let s = Store::open(TestCodec::default(), SimBackend::new(), "/store", c).unwrap();
    let meta = spillway::StreamedValue {
        lz4: false,
        frame_lens: vec![6_000],
        raw_len: 6_000,
        stored_len: 6_000,
        payload_crc: 0,
    };
    let err = s.put_stream(b"streamed", &meta, &mut HangsUp { store: &s, sent: 0 }).unwrap_err();
    assert!(!s.contains(b"streamed"), "{err}");
    assert!(s.metrics().max_spill_refusals > 0, "the test needs evictions refused during the stream");
    assert!(s.memory_bytes() > 4_000);
    // The next eviction finds room on disk again.
    s.put(b"small", val(9, 10)).unwrap();
    assert!(s.memory_bytes() <= 4_000, "{:?}", s.metrics());
    for i in 0..4u8 {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 2_500));
    }
    s.check_accounting().unwrap();
}

/// A value streaming in from a peer holds the log's writer lock for as long as the peer takes. A
/// remove (or overwrite) of a spilled key meanwhile must not wait for it while holding the store's
/// lock: that stalled every get and put of the store until the transfer ended, however slow the
/// peer. Here the peer, mid-value, waits for another thread to remove a spilled key and read
/// another one (bounded wait, so a regression fails instead of hanging).
#[test]
fn removing_a_spilled_key_does_not_wait_for_a_value_streaming_in() {
    struct Peer<'a> {
        store: &'a Arc<Store<TestCodec, SimBackend>>,
        payload: &'a [u8],
        sent: usize,
        others_done: Option<bool>,
    }
    impl std::io::Read for Peer<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if self.others_done.is_none() {
                let (tx, rx) = std::sync::mpsc::channel();
                let store = self.store.clone();
                std::thread::spawn(move || {
                    assert!(store.remove(b"spilled").unwrap());
                    assert_eq!(*store.get(b"in-memory").unwrap().unwrap(), val(2, 1_000));
                    store.put(b"new", val(3, 500)).unwrap();
                    let _ = tx.send(());
                });
                self.others_done = Some(rx.recv_timeout(std::time::Duration::from_secs(20)).is_ok());
            }
            let n = buf.len().min(self.payload.len() - self.sent).min(1000);
            buf[..n].copy_from_slice(&self.payload[self.sent..self.sent + n]);
            self.sent += n;
            Ok(n)
        }
    }
    let s = Arc::new(Store::open(TestCodec::default(), SimBackend::new(), "/store", cfg(4_000)).unwrap());
    s.put(b"spilled", val(1, 3_000)).unwrap();
    s.put(b"in-memory", val(2, 1_000)).unwrap();
    s.put(b"pusher", val(4, 2_000)).unwrap();
    assert_eq!(s.tier(b"spilled"), Some(Tier::Disk));
    let frames = ser(&val(7, 6_000)); // heavier than the target: streamed to disk
    let (payload, meta) = spillway_tests::streamed(&frames);
    let mut peer = Peer { store: &s, payload: &payload, sent: 0, others_done: None };
    s.put_stream(b"streamed", &meta, &mut peer).unwrap();
    assert_eq!(peer.others_done, Some(true), "the remove waited for the stream");
    assert_eq!(s.tier(b"streamed"), Some(Tier::Disk));
    assert!(!s.contains(b"spilled"));
    assert_eq!(*s.get(b"streamed").unwrap().unwrap(), val(7, 6_000));
    assert_eq!(*s.get(b"new").unwrap().unwrap(), val(3, 500));
    s.check_accounting().unwrap();
    // The log released the removed record once its writer lock was free again.
    assert_eq!(s.log().get(b"spilled").unwrap(), None);
    assert_eq!(s.log().stats().live_records, s.log().len() as u64, "{:?}", s.log().stats());
}

/// A value streamed from a peer that `max_spill` refuses is received into memory instead: one
/// refusal counted (not one for the stream and another for the fallback), nothing lost.
#[test]
fn a_streamed_value_refused_by_max_spill_is_counted_once_and_kept_in_memory() {
    let c = StoreConfig { max_spill_bytes: Some(3_000), ..cfg(4_000) };
    let s = Store::open(TestCodec::default(), SimBackend::new(), "/store", c).unwrap();
    let frames = ser(&val(7, 6_000)); // heavier than the target and than max_spill
    let (payload, meta) = spillway_tests::streamed(&frames);
    s.put_stream(b"k", &meta, &mut &payload[..]).unwrap();
    assert_eq!(s.metrics().max_spill_refusals, 1);
    assert_ne!(s.tier(b"k"), Some(Tier::Disk));
    assert_eq!(*s.get(b"k").unwrap().unwrap(), val(7, 6_000));
    s.check_accounting().unwrap();
}

#[test]
fn serialize_failure_of_the_inserted_key_is_an_error_and_the_key_is_forgotten() {
    let (s, _) = open(1_000);
    let mut v = b"unpicklable".to_vec();
    v.resize(5_000, 0);
    let err = s.put(b"bad", v.clone()).unwrap_err();
    assert!(matches!(err, Error::Codec { op: "serialize", .. }), "{err}");
    assert!(!s.contains(b"bad"));
    assert_eq!(s.memory_bytes(), 0);
    // Over an existing key: the key is forgotten, not left at its old value.
    s.put(b"bad", val(1, 100)).unwrap();
    assert!(s.put(b"bad", v).is_err());
    assert!(!s.contains(b"bad"));
    s.check_accounting().unwrap();
}

/// A store holding `stubborn` (3000 bytes starting with `prefix`) in memory after a put that had to
/// evict it (target 5000) and could not serialize it.
fn with_a_stubborn_key(prefix: &[u8]) -> (Store<TestCodec, SimBackend>, Vec<u8>) {
    let (s, _) = open(5_000);
    let mut v = prefix.to_vec();
    v.resize(3_000, 0);
    s.put(b"stubborn", v.clone()).unwrap();
    s.put(b"next", val(1, 3000)).unwrap(); // must evict: stubborn can't be serialized, so next goes
    assert_eq!(s.tier(b"stubborn"), Some(Tier::Materialized));
    assert!(s.metrics().spill_failures >= 1);
    (s, v)
}

#[test]
fn serialize_failure_while_evicting_another_key_keeps_it_in_memory() {
    let (s, v) = with_a_stubborn_key(b"unpicklable");
    assert_eq!(*s.get(b"stubborn").unwrap().unwrap(), v);
    assert_eq!(s.len(), 2);
}

/// A codec that panics while evicting a key is a failed serialize like any other: the key stays in
/// memory and the eviction finishes, so the key is not left marked as being written (a put of it
/// would then wait forever). The caller whose put triggered the eviction sees no error; a put of
/// the panicking value itself straight to disk is a codec error for that put.
#[test]
fn a_codec_panic_while_evicting_is_a_serialize_failure() {
    let (s, _) = with_a_stubborn_key(b"panicky");
    // Not left marked as being written: a put of the same key returns.
    s.put(b"stubborn", val(2, 100)).unwrap();
    assert_eq!(*s.get(b"stubborn").unwrap().unwrap(), val(2, 100));
    let mut big = b"panicky".to_vec();
    big.resize(6_000, 0); // heavier than the target: serialized at once, for the disk
    let err = s.put(b"big", big).unwrap_err();
    assert!(matches!(err, Error::Codec { op: "serialize", .. }) && err.to_string().contains("panic"), "{err}");
    assert!(!s.contains(b"big"));
    s.check_accounting().unwrap();
}

#[test]
fn disk_failure_keeps_data_in_memory() {
    let (s, be) = open(5_000);
    be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Eio, sticky: true });
    for i in 0..5u8 {
        s.put(&[i], val(i, 2000)).unwrap();
    }
    assert!(s.metrics().spill_failures >= 1);
    for i in 0..5u8 {
        assert_ne!(s.tier(&[i]), Some(Tier::Disk));
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 2000));
    }
}

/// A panic in the backend's write (a bug in a backend) reaches the put whose eviction ran the write,
/// but only after the store has settled the batch as a failed write: no key is left marked as being
/// written (a `flush`, or a put of the key, would wait for it forever) and nothing is lost. The log,
/// which cannot know what the panicking write left in the file, turns read-only as after an EIO:
/// later spills fail and keep their values in memory.
#[test]
fn a_backend_panic_while_spilling_leaves_no_key_waiting_for_its_write() {
    for write_behind in [0, 64 << 10] {
        let be = SimBackend::new();
        let mut c = cfg(5_000);
        c.log.write_behind_bytes = write_behind;
        let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/store", c).unwrap());
        s.put(b"early", val(b'e', 1000)).unwrap();
        be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Panic, sticky: false });
        let mut panics = 0;
        for i in 0..40u8 {
            match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.put(&[i], val(i, 2000)))) {
                Ok(r) => r.unwrap(),
                Err(_) => panics += 1,
            }
        }
        assert!(be.fault_fired(), "write_behind={write_behind}: the write was attempted");
        assert_eq!(panics, 1, "write_behind={write_behind}: the panic reached one caller");
        assert!(s.metrics().spill_failures >= 1, "write_behind={write_behind}: reported as a failed spill");
        let poisoned = s.log().poisoned().map(str::to_string);
        assert!(
            poisoned.as_deref().is_some_and(|p| p.contains("panicked")),
            "write_behind={write_behind}: {poisoned:?}"
        );
        assert_eq!(*s.get(b"early").unwrap().unwrap(), val(b'e', 1000));
        for i in 0..40u8 {
            assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 2000), "write_behind={write_behind}: key {i}");
        }
        // A flush waits for every spill write older than itself: with a key still marked as being
        // written it would never return. Bounded here, so that the bug fails the test instead of
        // hanging it. It returns an error: the log refuses to sync after the panic.
        let (tx, rx) = std::sync::mpsc::channel();
        let flusher = s.clone();
        std::thread::spawn(move || tx.send(flusher.flush().is_ok()).unwrap());
        let flushed = rx.recv_timeout(std::time::Duration::from_secs(30));
        assert_eq!(flushed, Ok(false), "write_behind={write_behind}: flush still waiting for the panicked write");
        s.check_accounting().unwrap();
        // Later spills fail (the log is read-only) and keep their values in memory.
        let failures = s.metrics().spill_failures;
        s.put(b"next", val(99, 2000)).unwrap();
        assert!(s.metrics().spill_failures > failures, "write_behind={write_behind}");
        for i in 0..40u8 {
            assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 2000), "write_behind={write_behind}: key {i} after");
        }
        s.check_accounting().unwrap();
    }
    // The same in a persistent store's `flush`, which writes disk copies of what it holds in memory:
    // the next flush returns (with the error), the values stay readable, and what an earlier flush
    // made durable survives a power cut.
    let be = SimBackend::new();
    let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/p", persistent(100_000)).unwrap());
    s.put(b"durable", val(b'd', 1000)).unwrap();
    s.flush().unwrap();
    for i in 0..5u8 {
        s.put(&[i], val(i, 1000)).unwrap();
    }
    be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Panic, sticky: false });
    assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| s.flush())).is_err());
    assert!(be.fault_fired());
    s.check_accounting().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    let flusher = s.clone();
    std::thread::spawn(move || tx.send(flusher.flush().map_err(|e| e.to_string())).unwrap());
    let flushed = rx.recv_timeout(std::time::Duration::from_secs(30)).expect("the second flush returns");
    assert!(flushed.is_err(), "nothing could be written after the panic");
    for i in 0..5u8 {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 1000), "key {i}");
    }
    s.check_accounting().unwrap();
    drop(s);
    let s = Store::open(TestCodec::default(), be.crash(None), "/p", persistent(100_000)).unwrap();
    assert_eq!(*s.get(b"durable").unwrap().unwrap(), val(b'd', 1000), "flushed before the panic");
}

/// A full file system is not a broken disk: spills fail and keep their values in memory while it
/// lasts, and once there is room again (here: the fault cleared; in life: spilled keys removed) the
/// store spills again and memory goes back under the target. Nothing is lost on the way.
#[test]
fn a_full_disk_keeps_data_in_memory_until_there_is_room_again() {
    for write_behind in [0, 64 << 10] {
        let be = SimBackend::new();
        let mut c = cfg(5_000);
        c.log.write_behind_bytes = write_behind;
        let s = Store::open(TestCodec::default(), be.clone(), "/store", c).unwrap();
        for i in 0..10u8 {
            s.put(&[i], val(i, 2000)).unwrap();
        }
        be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Enospc, sticky: true });
        for i in 10..40u8 {
            s.put(&[i], val(i, 2000)).unwrap(); // a spill failure is never the caller's error
        }
        assert!(s.metrics().spill_failures >= 1, "write_behind={write_behind}");
        assert!(s.memory_bytes() > 5_000, "the values that could not be spilled stay in memory");
        for i in 0..40u8 {
            assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 2000), "write_behind={write_behind}: key {i}");
        }
        be.clear_faults();
        // Removing a spilled key frees space and lets stuck evictions try again.
        let spilled = (0..40u8).find(|&i| s.tier(&[i]) == Some(Tier::Disk));
        if let Some(k) = spilled {
            assert!(s.remove(&[k]).unwrap());
        }
        s.put(b"next", val(99, 2000)).unwrap();
        assert!(
            s.memory_bytes() <= 5_000,
            "write_behind={write_behind}: spilling resumed ({} bytes)",
            s.memory_bytes()
        );
        assert!(s.flush().is_ok(), "the log is writable");
        for i in (0..40u8).filter(|&i| Some(i) != spilled) {
            assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 2000), "write_behind={write_behind}: key {i}");
        }
        s.check_accounting().unwrap();
    }
}

/// In a persistent store a remove writes a tombstone. If that write fails, the remove fails and the
/// key stays, value and accounting alike; once the write can succeed, the remove does.
#[test]
fn a_persistent_remove_that_cannot_write_keeps_the_key() {
    let be = SimBackend::new();
    let s = Store::open(TestCodec::default(), be.clone(), "/store", persistent(5_000)).unwrap();
    for i in 0..10u8 {
        s.put(&[i], val(i, 2000)).unwrap();
    }
    let k = (0..10u8).find(|&i| s.tier(&[i]) == Some(Tier::Disk)).expect("something spilled");
    be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Enospc, sticky: true });
    let e = s.remove(&[k]).unwrap_err();
    assert!(e.is_no_space(), "{e}");
    assert!(s.contains(&[k]));
    assert_eq!(*s.get(&[k]).unwrap().unwrap(), val(k, 2000));
    s.check_accounting().unwrap();
    be.clear_faults();
    assert!(s.remove(&[k]).unwrap());
    assert!(!s.contains(&[k]));
    s.check_accounting().unwrap();
    let on_disk: Vec<u8> = (0..10u8).filter(|&i| s.tier(&[i]) == Some(Tier::Disk)).collect();
    drop(s);
    let s = Store::open(TestCodec::default(), be, "/store", persistent(5_000)).unwrap();
    assert!(!s.contains(&[k]), "the remove survives a reopen");
    let found: Vec<u8> = (0..10u8).filter(|&i| s.contains(&[i])).collect();
    assert_eq!(found, on_disk);
}

/// A store with a 5000-byte target and 2000-byte values `first`, 1, ..., 10: the first spill creates
/// the segment, then 3..=10 spill one after another. Returns the store and the backend's operation
/// count from before the puts of 3..=10.
fn spill_ten(be: &SimBackend, c: StoreConfig) -> (Store<TestCodec, SimBackend>, u64) {
    let s = Store::open(TestCodec::default(), be.clone(), "/store", c).unwrap();
    s.put(b"first", val(0, 2000)).unwrap();
    s.put(&[1], val(1, 2000)).unwrap();
    s.put(&[2], val(2, 2000)).unwrap();
    assert_eq!(s.tier(b"first"), Some(Tier::Disk), "the first spill creates the segment");
    let ops = be.op_count();
    for i in 3..=10u8 {
        s.put(&[i], val(i, 2000)).unwrap();
    }
    (s, ops)
}

/// A spill store's default log defers small spill batches (write-behind). A failed write of
/// deferred batches loses nothing: values already handed to the log read back from its memory,
/// later spills fail and keep their values in memory, and the store reports the failure.
#[test]
fn failed_write_behind_of_a_spill_store_loses_nothing() {
    let be = SimBackend::new();
    let c = StoreConfig {
        target_bytes: 5_000,
        log: LogOptions { segment_bytes: 1 << 20, write_behind_bytes: 64 << 10, ..Default::default() },
        ..Default::default()
    };
    let (s, ops) = spill_ten(&be, c);
    let deferred: Vec<u8> = (1..=10u8).filter(|&i| s.tier(&[i]) == Some(Tier::Disk)).collect();
    assert!(deferred.len() >= 5, "{deferred:?} spilled");
    assert_eq!(be.op_count(), ops, "small spill batches were written at once");
    be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Eio, sticky: true });
    for i in 11..=60u8 {
        s.put(&[i], val(i, 2000)).unwrap(); // past the budget: the deferred bytes' write fails
    }
    assert!(s.metrics().spill_failures >= 1);
    for i in 0..=60u8 {
        let k: &[u8] = if i == 0 { b"first" } else { &[i] };
        assert_eq!(*s.get(k).unwrap().unwrap(), val(i, 2000), "key {i}");
    }
    assert!(s.flush().is_err(), "flush reports that the log can no longer write");
}

#[test]
fn a_persistent_store_never_defers_writes() {
    let be = SimBackend::new();
    let c = StoreConfig { target_bytes: 5_000, persistent: true, ..Default::default() };
    assert!(c.log.write_behind_bytes > 0, "the default config defers");
    let (s, ops) = spill_ten(&be, c);
    let spilled = (3..=10u8).filter(|&i| s.tier(&[i]) == Some(Tier::Disk)).count() as u64;
    assert!(spilled >= 5 && be.op_count() >= ops + spilled / 2, "{spilled} spilled in {} ops", be.op_count() - ops);
}

#[test]
fn concurrent_gets_of_one_key_deserialize_once() {
    for spilled in [false, true] {
        for round in 0..20 {
            let (s, _) = open(1 << 20);
            s.put_serialized(b"k", ser(&val(5, 100_000))).unwrap();
            if spilled {
                assert!(s.evict().unwrap() > 0);
                assert_eq!(s.tier(b"k"), Some(Tier::Disk));
            }
            let s = Arc::new(s);
            let barrier = Arc::new(Barrier::new(8));
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let (s, b) = (s.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        b.wait();
                        s.get(b"k").unwrap().unwrap()
                    })
                })
                .collect();
            let vals: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            assert_eq!(s.codec().deserialized.load(Ordering::SeqCst), 1, "spilled={spilled} round {round}");
            assert!(vals.iter().all(|v| Arc::ptr_eq(v, &vals[0])));
            assert_eq!(s.metrics().activity("deserialize").count, 1);
        }
    }
}

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

#[test]
fn a_failed_deserialize_reports_the_error_and_keeps_the_bytes() {
    let (s, _) = open(1 << 20);
    let bad = ser(b"undeserializable!");
    s.put_serialized(b"k", bad.clone()).unwrap();
    let err = s.get(b"k").unwrap_err();
    assert!(matches!(err, Error::Codec { op: "deserialize", .. }), "{err}");
    assert_eq!(s.get_serialized(b"k").unwrap().unwrap(), bad, "the serialized bytes stay intact");
    assert_eq!(s.tier(b"k"), Some(Tier::Serialized));
    assert!(s.get(b"k").is_err(), "a retry runs the codec again");
    assert_eq!(s.codec().deserialized.load(Ordering::SeqCst), 2);
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

/// `sync_spills`: every spill batch is synced, so what was spilled survives a power cut without a
/// `flush`. A sync that fails leaves the spilled values readable (the log refuses further writes),
/// and the batch still counts as written in the metrics.
#[test]
fn sync_spills_makes_each_spill_durable() {
    let be = SimBackend::new();
    let c = StoreConfig { sync_spills: true, ..persistent(3_000) };
    let spilled: Vec<u8> = {
        let s = Store::open(TestCodec::default(), be.clone(), "/store", c.clone()).unwrap();
        for i in 0..6u8 {
            s.put(&[i], val(i, 1000)).unwrap();
        }
        (0..6u8).filter(|i| s.tier(&[*i]) == Some(Tier::Disk)).collect()
    }; // dropped without a flush
    assert!(!spilled.is_empty());
    let s = Store::open(TestCodec::default(), be.crash(None), "/store", c.clone()).unwrap();
    for i in &spilled {
        assert_eq!(s.tier(&[*i]), Some(Tier::Disk), "key {i} lost in the power cut");
        assert_eq!(*s.get(&[*i]).unwrap().unwrap(), val(*i, 1000));
    }
    drop(s);

    let be = SimBackend::new();
    let s = Store::open(TestCodec::default(), be.clone(), "/sync-fails", c).unwrap();
    be.inject(Fault { op: FaultOp::Sync, after: 0, kind: FaultKind::Eio, sticky: true });
    let mut i = 0u8;
    while s.metrics().activity("disk-write").count == 0 {
        s.put(&[i], val(i, 1000)).unwrap(); // never an error: the failure is reported
        i += 1;
        assert!(i < 20, "nothing was spilled");
    }
    // The batch whose sync failed is counted as written (it was) and reported as a failure.
    let m = s.metrics();
    assert_eq!(m.spill_failures, 1, "{m:?}");
    for i in i..6 {
        s.put(&[i], val(i, 1000)).unwrap();
    }
    for i in 0..6u8 {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 1000));
    }
    s.check_accounting().unwrap();
}

#[test]
fn a_reopened_store_finds_its_spilled_data() {
    let be = SimBackend::new();
    {
        let s = Store::open(TestCodec::default(), be.clone(), "/store", persistent(3_000)).unwrap();
        for i in 0..5u8 {
            s.put(&[i], val(i, 1000)).unwrap();
        }
        s.put(b"big", val(9, 5000)).unwrap(); // heavier than the target: straight to disk
        s.flush().unwrap();
    }
    let s = Store::open(TestCodec::default(), be.crash(None), "/store", persistent(3_000)).unwrap();
    let on_disk: Vec<u8> = (0..5u8).filter(|i| s.tier(&[*i]) == Some(Tier::Disk)).collect();
    assert!(!on_disk.is_empty());
    for i in on_disk {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 1000));
    }
    // Still heavier than the target after the reopen: served from disk, not promoted, so reading it
    // does not push the values read back before it out of memory.
    let in_memory: Vec<u8> = (0..5u8).filter(|i| s.tier(&[*i]).is_some_and(|t| t != Tier::Disk)).collect();
    assert!(!in_memory.is_empty());
    assert_eq!(*s.get(b"big").unwrap().unwrap(), val(9, 5000));
    assert_eq!(s.tier(b"big"), Some(Tier::Disk));
    for i in in_memory {
        assert_ne!(s.tier(&[i]), Some(Tier::Disk), "key {i} was evicted to make room for the large value");
    }
    s.check_accounting().unwrap();
}

#[test]
fn a_spill_store_starts_empty_and_a_persistent_one_keeps_deletes() {
    let be = SimBackend::new();
    {
        let s = Store::open(TestCodec::default(), be.clone(), "/store", cfg(1_000)).unwrap();
        for i in 0..5u8 {
            s.put(&[i], val(i, 800)).unwrap();
        }
    }
    let s = Store::open(TestCodec::default(), be.clone(), "/store", cfg(1_000)).unwrap();
    assert!(s.is_empty(), "a non-persistent store discards what an earlier process spilled");
    drop(s);
    {
        let s = Store::open(TestCodec::default(), be.clone(), "/p", persistent(1_000)).unwrap();
        for i in 0..5u8 {
            s.put(&[i], val(i, 800)).unwrap();
        }
        assert_eq!(s.tier(&[0]), Some(Tier::Disk));
        // Read back (the disk copy is kept), then remove: the removal must survive reopen.
        assert_eq!(*s.get(&[0]).unwrap().unwrap(), val(0, 800));
        assert!(s.remove(&[0]).unwrap());
        s.flush().unwrap();
    }
    let s = Store::open(TestCodec::default(), be, "/p", persistent(1_000)).unwrap();
    assert!(!s.contains(&[0]));
    assert!(s.contains(&[1]));
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

/// A store served to a peer: each tier goes out as it is held (a spilled value from its segment, a
/// serialized one from its frames, a materialized one serialized once); the receiver keeps values
/// serialized while under its target and stores them straight to disk once over it. Nothing is
/// deserialized on either side.
#[test]
fn transfer_between_stores_by_tier_without_deserializing() {
    use spillway::transfer::{self, Client, TransferOptions};
    use spillway_tests::{open_to, TICKET};
    let tmp = tempfile::tempdir().unwrap();
    let sender = Arc::new(
        Store::open(TestCodec::default(), spillway::PortableBackend::new(), tmp.path(), cfg(100_000)).unwrap(),
    );
    sender.put(b"materialized", val(b'm', 5_000)).unwrap();
    sender.put_serialized(b"serialized", ser(&val(b's', 7_000))).unwrap();
    sender.put_serialized(b"large", ser(&val(b'l', 300_000))).unwrap(); // heavier than target: on disk
    for i in 0..40u8 {
        sender.put_serialized(&[b'x', i], ser(&val(i, 9_000))).unwrap(); // pushes older ones to disk
    }
    assert_eq!(sender.tier(b"large"), Some(Tier::Disk));
    let on_disk = (0..40u8).find(|&i| sender.tier(&[b'x', i]) == Some(Tier::Disk)).expect("some spilled");
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let opts = TransferOptions { splice_min_bytes: 0, ..Default::default() };
    let served = sender.clone();
    std::thread::spawn(move || transfer::serve(open_to(served), listener, opts));

    let receiver = Store::open(TestCodec::default(), SimBackend::new(), "/r", cfg(20_000)).unwrap();
    let mut c = Client::connect(&addr, TICKET, TransferOptions::default()).unwrap();
    for key in [&b"materialized"[..], b"serialized"] {
        assert!(c.get_into_store(key, &receiver).unwrap());
        assert_eq!(receiver.tier(key), Some(Tier::Serialized), "under target: kept serialized");
    }
    assert!(c.get_into_store(b"large", &receiver).unwrap());
    assert_eq!(receiver.tier(b"large"), Some(Tier::Disk), "over target: straight to disk");
    assert!(c.get_into_store(&[b'x', on_disk], &receiver).unwrap());
    assert!(!c.get_into_store(b"absent", &receiver).unwrap());
    assert_eq!(receiver.codec().deserialized.load(Ordering::SeqCst), 0, "nothing deserialized on arrival");
    assert_eq!(sender.codec().deserialized.load(Ordering::SeqCst), 0, "nothing deserialized to send");
    assert!(sender.memory_bytes() <= 100_000);
    assert!(receiver.memory_bytes() <= 20_000);
    assert_eq!(*receiver.get(b"materialized").unwrap().unwrap(), val(b'm', 5_000));
    assert_eq!(*receiver.get(b"serialized").unwrap().unwrap(), val(b's', 7_000));
    assert_eq!(*receiver.get(b"large").unwrap().unwrap(), val(b'l', 300_000));
    assert_eq!(*receiver.get(&[b'x', on_disk]).unwrap().unwrap(), val(on_disk, 9_000));
    let m = receiver.metrics();
    assert!(m.activity("disk-write").bytes >= 300_000, "the large value was written on arrival");
}

/// A transfer streamed straight to disk (the receiver is over its target) that the peer cuts off
/// leaves the receiver's old value of the key as it was, in memory or on disk: it used to be
/// dropped when the transfer started.
#[test]
fn a_failed_transfer_into_a_store_keeps_the_old_value() {
    use spillway::transfer::{self, Client, TransferOptions};
    use spillway_tests::TICKET;
    for (old, tier) in [(val(b'o', 5_000), Tier::Serialized), (val(b'O', 30_000), Tier::Disk)] {
        let s = Store::open(TestCodec::default(), SimBackend::new(), "/r", cfg(20_000)).unwrap();
        s.put_serialized(b"k", ser(&old)).unwrap();
        assert_eq!(s.tier(b"k"), Some(tier));
        let (mem, disk) = (s.memory_bytes(), s.metrics().spilled_disk_bytes);
        let (payload, meta) = spillway_tests::streamed(&ser(&val(b'n', 1 << 20)));
        let mut cut = transfer::encode_value_response(&meta);
        cut.extend_from_slice(&payload[..10_000]);
        let mut c = Client::connect(spillway_tests::fake_server(cut), TICKET, TransferOptions::default()).unwrap();
        assert!(c.get_into_store(b"k", &s).is_err());
        assert_eq!(s.tier(b"k"), Some(tier), "the old value is back where it was");
        assert_eq!((s.memory_bytes(), s.metrics().spilled_disk_bytes), (mem, disk));
        assert_eq!(*s.get(b"k").unwrap().unwrap(), old);
    }
}

/// A `remove` of a key while a transfer of it is streamed to disk wins over the transfer, as a
/// `put` does: the key stays absent, and the streamed record is dropped.
#[test]
fn a_remove_during_a_transfer_into_a_store_wins() {
    use spillway::transfer::{self, Client, TransferOptions};
    use spillway_tests::TICKET;
    use std::io::{Read, Write};
    let s = Arc::new(Store::open(TestCodec::default(), SimBackend::new(), "/r", cfg(20_000)).unwrap());
    s.put_serialized(b"k", ser(&val(b'o', 5_000))).unwrap();
    let (payload, meta) = spillway_tests::streamed(&ser(&val(b'n', 1 << 20)));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (go_on, wait) = std::sync::mpsc::channel::<()>();
    let server = std::thread::spawn(move || {
        let (mut sock, _) = listener.accept().unwrap();
        let mut hello = [0u8; 8];
        sock.read_exact(&mut hello).unwrap();
        sock.write_all(&transfer::greeting()).unwrap();
        let mut req = vec![0u8; spillway_tests::raw_request(&TICKET, b"k").len()];
        sock.read_exact(&mut req).unwrap();
        sock.write_all(&transfer::encode_value_response(&meta)).unwrap();
        sock.write_all(&payload[..4096]).unwrap();
        wait.recv().unwrap();
        sock.write_all(&payload[4096..]).unwrap();
        let _ = sock.read(&mut [0u8; 1]); // until the client hangs up
    });
    let receiver = {
        let s = s.clone();
        std::thread::spawn(move || Client::connect(addr, TICKET, TransferOptions::default())?.get_into_store(b"k", &s))
    };
    let held = s.memory_bytes();
    // The transfer has started once the old value is out of sight.
    let mut spins = 0u64;
    while s.contains(b"k") {
        spins += 1;
        assert!(spins < 50_000_000, "the transfer never started");
        std::thread::yield_now();
    }
    assert_eq!(s.memory_bytes(), held, "the old value set aside still counts");
    assert!(s.remove(b"k").unwrap(), "the old value set aside is removed");
    assert!(!s.remove(b"k").unwrap(), "only once");
    go_on.send(()).unwrap();
    assert!(receiver.join().unwrap().unwrap(), "the server had the key");
    server.join().unwrap();
    assert!(!s.contains(b"k"), "the remove wins over the transfer");
    assert!(s.get(b"k").unwrap().is_none());
    assert_eq!((s.memory_bytes(), s.metrics().spilled_disk_bytes), (0, 0));
}

/// A reader that panics in the middle of `put_stream` leaves the store as it was: the old value
/// readable, and the key not held as being written (a flush, or a large put of the key, would
/// wait for that write forever).
#[test]
fn a_reader_panicking_in_put_stream_leaves_the_store_usable() {
    struct Panics<'a>(&'a [u8]);
    impl std::io::Read for Panics<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            assert!(!self.0.is_empty(), "the reader panics");
            let n = buf.len().min(self.0.len()).min(8192);
            buf[..n].copy_from_slice(&self.0[..n]);
            self.0 = &self.0[n..];
            Ok(n)
        }
    }
    let s = Arc::new(open(20_000).0);
    s.put_serialized(b"k", ser(&val(b'o', 5_000))).unwrap();
    let held = s.memory_bytes();
    let (payload, meta) = spillway_tests::streamed(&ser(&val(b'n', 100_000)));
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        s.put_stream(b"k", &meta, &mut Panics(&payload[..50_000]))
    }));
    assert!(r.is_err(), "the panic goes on to the caller");
    assert_eq!(*s.get(b"k").unwrap().unwrap(), val(b'o', 5_000));
    assert_eq!(s.memory_bytes(), held);
    let (done, finished) = std::sync::mpsc::channel();
    let s2 = s.clone();
    std::thread::spawn(move || {
        s2.flush().unwrap();
        s2.put_serialized(b"k", ser(&val(b'x', 30_000))).unwrap(); // over the target: written at once
        done.send(()).unwrap();
    });
    finished.recv_timeout(std::time::Duration::from_secs(60)).expect("flush and put do not wait forever");
    assert_eq!(*s.get(b"k").unwrap().unwrap(), val(b'x', 30_000));
    assert_eq!(s.tier(b"k"), Some(Tier::Disk));
}

/// A value streamed over a spilled value of the same key is not refused by `max_spill` for the
/// bytes of the record it replaces.
#[test]
fn put_stream_over_a_spilled_key_counts_only_the_difference_against_max_spill() {
    let s = open_max_spill(5_000, 3_000);
    s.put_serialized(b"k", ser(&val(b'o', 4_000))).unwrap();
    assert_eq!(s.tier(b"k"), Some(Tier::Disk));
    let (payload, meta) = spillway_tests::streamed(&ser(&val(b'n', 4_000)));
    s.put_stream(b"k", &meta, &mut &payload[..]).unwrap();
    assert_eq!(s.tier(b"k"), Some(Tier::Disk), "streamed to disk, not kept in memory");
    assert_eq!(s.metrics().max_spill_refusals, 0);
    assert_eq!(*s.get(b"k").unwrap().unwrap(), val(b'n', 4_000));
}

/// A value whose object is heavier than the target, though its serialized bytes are light, is
/// served by `get` without promotion, as a `put` of the object would have kept it on disk:
/// promoting it pushed every other entry down a tier, then demoted the value itself.
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

/// A value the log cannot store (here larger than its `max_value_bytes`) fails its eviction alone:
/// the other values planned for the same write still go to disk. It used to fail the whole batch,
/// leaving every value in it stuck in memory and counted as a failed spill.
#[test]
fn a_value_the_log_refuses_does_not_fail_the_others_spilled_with_it() {
    let mut c = cfg(9_000);
    c.log.max_value_bytes = 4_500;
    let s = Store::open(TestCodec::default(), SimBackend::new(), "/s", c).unwrap();
    s.put_serialized(b"a", ser(&val(b'a', 1_000))).unwrap();
    s.put_serialized(b"big", ser(&val(b'g', 5_000))).unwrap(); // more than the log takes
    s.put_serialized(b"b", ser(&val(b'b', 4_000))).unwrap(); // over the target: a and big are evicted
    assert_eq!(s.tier(b"a"), Some(Tier::Disk));
    assert_eq!(s.tier(b"big"), Some(Tier::Serialized), "kept in memory");
    assert_eq!(s.tier(b"b"), Some(Tier::Disk), "evicted next, since big is stuck");
    assert_eq!(s.metrics().spill_failures, 1, "one failure: big's");
    for (k, v) in [(&b"a"[..], val(b'a', 1_000)), (b"big", val(b'g', 5_000)), (b"b", val(b'b', 4_000))] {
        assert_eq!(*s.get(k).unwrap().unwrap(), v);
    }
}

/// A value held in memory that no log checked, with more frames than the wire format carries, is
/// answered with an ERROR the client reads, and the connection stays in step: the server used to
/// send it, and the client rejected the header as malformed and dropped the connection.
#[test]
fn a_value_in_memory_over_the_wire_limits_is_refused_by_the_server_not_the_client() {
    use spillway::transfer::{self, Client, TransferOptions};
    use spillway_tests::{open_to, TICKET};
    let sender = Arc::new(Store::open(TestCodec::default(), SimBackend::new(), "/s", cfg(10 << 20)).unwrap());
    let many = Frames((0..70_000).map(|_| Bytes::from_static(b"x")).collect());
    sender.put_serialized(b"many", many).unwrap();
    sender.put_serialized(b"ok", ser(&val(b'o', 100))).unwrap();
    assert_eq!(sender.tier(b"many"), Some(Tier::Serialized));
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let served = sender.clone();
    std::thread::spawn(move || transfer::serve(open_to(served), listener, TransferOptions::default()));
    let mut c = Client::connect(&addr, TICKET, TransferOptions::default()).unwrap();
    let err = c.get(b"many").unwrap_err().to_string();
    assert!(err.contains("70000 frames"), "{err}");
    assert_eq!(c.get(b"ok").unwrap(), Some(ser(&val(b'o', 100))), "the connection is still in step");
}

/// A value re-read while `max_spill` refuses its eviction is marked stuck again on every round:
/// the list of stuck keys holds each key once (it grew by one per round, without bound).
#[test]
fn stuck_keys_are_listed_once_however_often_they_are_refused() {
    let s = open_max_spill(0, 1_000);
    for k in [b"a", b"b", b"c"] {
        s.put_serialized(k, ser(&val(k[0], 600))).unwrap();
    }
    assert!(s.metrics().max_spill_refusals > 0);
    for _ in 0..1_000 {
        assert_eq!(*s.get(b"a").unwrap().unwrap(), val(b'a', 600));
    }
    s.check_accounting().unwrap();
}

/// While a transfer streams over a spilled value, that value's spilled bytes still count against
/// `max_spill` (it comes back if the transfer fails): other spills meanwhile are refused rather
/// than take its room, and after the failure the total stays within the limit.
#[test]
fn a_failed_put_stream_over_a_spilled_value_does_not_overshoot_max_spill() {
    struct FailsAfterPuts(Arc<Store<TestCodec, SimBackend>>);
    impl std::io::Read for FailsAfterPuts {
        fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
            // Other threads put (and try to spill) while the transfer is in progress. A spill
            // allowed now would wait for the log's writer lock, which this transfer holds: give up
            // on them after a while, which then lets them spill into the room of the old value.
            let (done, finished) = std::sync::mpsc::channel();
            let s = self.0.clone();
            std::thread::spawn(move || {
                for i in 0..3u8 {
                    s.put_serialized(&[b'x', i], ser(&val(i, 3_000))).unwrap();
                }
                let _ = done.send(());
            });
            let _ = finished.recv_timeout(std::time::Duration::from_secs(5));
            Err(std::io::Error::new(std::io::ErrorKind::ConnectionReset, "the peer hung up"))
        }
    }
    let s = Arc::new(open_max_spill(10_000, 4_000));
    s.put_serialized(b"k", ser(&val(b'o', 8_000))).unwrap();
    assert_eq!(s.tier(b"k"), Some(Tier::Disk));
    let (_, meta) = spillway_tests::streamed(&ser(&val(b'n', 100)));
    assert!(s.put_stream(b"k", &meta, &mut FailsAfterPuts(s.clone())).is_err());
    assert_eq!(*s.get(b"k").unwrap().unwrap(), val(b'o', 8_000));
    let x: Vec<u8> = vec![b'x', 2];
    let _ = s.get(&x); // whatever the puts' thread did, it is done once its last key exists
    let mut spins = 0u64;
    while !s.contains(&x) {
        spins += 1;
        assert!(spins < 50_000_000, "the puts never finished");
        std::thread::yield_now();
    }
    s.flush().unwrap();
    let m = s.metrics();
    assert!(m.spilled_memory_bytes <= 10_000, "spilled {} over max_spill 10000", m.spilled_memory_bytes);
    s.check_accounting().unwrap();
}

/// Four threads run a random mix of every operation over a few keys, with a target small enough that
/// values move between all tiers. A value's first byte names its key and generation, so a read can
/// check it belongs to the key it asked for. No operation may fail (a get racing a remove of a spilled
/// key once reported a "vanished" error), and the accounting must end exact. A persistent store also
/// flushes now and then (writing disk copies of values other threads are evicting, reading and
/// removing), and after a last flush its contents survive a power cut.
#[test]
fn random_concurrent_operations_never_fail_and_keep_exact_accounting() {
    for (compress, persist) in [(false, false), (true, false), (false, true), (true, true)] {
        let be = SimBackend::new();
        let c = StoreConfig { compress_in_memory: compress, persistent: persist, ..cfg(20_000) };
        let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/store", c.clone()).unwrap());
        let handles: Vec<_> = (0..4u64)
            .map(|t| {
                let s = s.clone();
                std::thread::spawn(move || {
                    let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (t + 1);
                    for i in 0..3000u64 {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let k = (x % 6) as u8;
                        let key = [b'k', k];
                        let len = [500usize, 5_000, 25_000][(x >> 8) as usize % 3];
                        let v = {
                            let mut v = val(k, len);
                            v[1] = (i % 251) as u8; // generation, for debugging
                            v
                        };
                        let check = |got: &[u8]| assert_eq!(got[0], k, "a value of another key");
                        match (x >> 16) % 7 {
                            0 => s.put(&key, v).unwrap(),
                            1 => s.put_serialized(&key, ser(&v)).unwrap(),
                            2 | 3 => {
                                if let Some(got) = s.get(&key).unwrap() {
                                    check(&got);
                                }
                            }
                            4 => {
                                if let Some(f) = s.get_serialized(&key).unwrap() {
                                    check(&f.0[1]);
                                }
                            }
                            5 => {
                                s.remove(&key).unwrap();
                            }
                            _ if persist && (x >> 24) % 2 == 0 => s.flush().unwrap(),
                            _ => {
                                s.evict().unwrap();
                            }
                        }
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        s.check_accounting().unwrap();
        for k in 0..6u8 {
            if let Some(v) = s.get(&[b'k', k]).unwrap() {
                assert_eq!(v[0], k);
            }
        }
        s.check_accounting().unwrap();
        if persist {
            s.flush().unwrap();
            let before: Vec<Option<Vec<u8>>> =
                (0..6u8).map(|k| s.get(&[b'k', k]).unwrap().map(|v| v.to_vec())).collect();
            drop(s);
            let s = Store::open(TestCodec::default(), be.crash(None), "/store", c).unwrap();
            for (k, want) in (0..6u8).zip(before) {
                assert_eq!(s.get(&[b'k', k]).unwrap().map(|v| v.to_vec()), want, "compress={compress}: key {k}");
            }
            s.check_accounting().unwrap();
        }
    }
}

/// The async forms agree with the sync ones on every tier (materialized, serialized, compressed, on
/// disk, large), share one materialization through the key's slot, and leave the accounting exact.
#[test]
fn async_gets_agree_with_sync_gets_on_every_tier() {
    use spillway::task::block_on;
    for compress in [false, true] {
        let c = StoreConfig { compress_in_memory: compress, ..cfg(10_000) };
        let s = Store::open(TestCodec::default(), SimBackend::new(), "/store", c).unwrap();
        s.put(b"large", val(9, 20_000)).unwrap(); // heavier than the target: straight to disk
        for i in 0..8u8 {
            s.put_serialized(&[i], ser(&val(i, 2000))).unwrap();
        }
        s.put(b"object", val(42, 1000)).unwrap();
        let tiers: std::collections::HashSet<Tier> = (0..8u8).filter_map(|i| s.tier(&[i])).collect();
        assert!(tiers.contains(&Tier::Disk) && tiers.len() >= 2, "{tiers:?}");
        fn is_send<T: Send>(_: &T) {}
        is_send(&s.get_async(b"large"));
        is_send(&s.get_serialized_async(b"large"));
        for key in [&b"large"[..], b"object", &[0], &[3], &[7], b"absent"] {
            let f_async = block_on(s.get_serialized_async(key)).unwrap();
            assert_eq!(f_async, s.get_serialized(key).unwrap(), "{key:?}");
            let a = block_on(s.get_async(key)).unwrap();
            let b = s.get(key).unwrap();
            assert_eq!(a.as_deref(), b.as_deref(), "{key:?}");
            // Outside the large value (never kept materialized), the async get materialized the value
            // in the key's slot, and the sync get found it there.
            if let (Some(a), Some(b)) = (&a, &b) {
                assert_eq!(Arc::ptr_eq(a, b), key != b"large", "{key:?}");
            }
            s.check_accounting().unwrap();
        }
    }
}

/// Sync and async gets of one spilled key from eight threads at once: one deserialize, one `Arc`.
#[test]
fn concurrent_sync_and_async_gets_deserialize_once() {
    use spillway::task::block_on;
    for round in 0..20 {
        let (s, _) = open(1 << 20);
        s.put_serialized(b"k", ser(&val(5, 100_000))).unwrap();
        assert!(s.evict().unwrap() > 0);
        let s = Arc::new(s);
        let barrier = Arc::new(Barrier::new(8));
        let handles: Vec<_> = (0..8)
            .map(|t| {
                let (s, b) = (s.clone(), barrier.clone());
                std::thread::spawn(move || {
                    b.wait();
                    if t % 2 == 0 {
                        block_on(s.get_async(b"k")).unwrap().unwrap()
                    } else {
                        s.get(b"k").unwrap().unwrap()
                    }
                })
            })
            .collect();
        let vals: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
        assert_eq!(s.codec().deserialized.load(Ordering::SeqCst), 1, "round {round}");
        assert!(vals.iter().all(|v| Arc::ptr_eq(v, &vals[0])));
        s.check_accounting().unwrap();
    }
}

/// An async get dropped after its first poll (a task cancelled mid-read) changes nothing: the value is
/// still there and the accounting is exact. On io_uring with O_DIRECT the read is still in flight at
/// the first poll (the simulated backend completes at once, so it cannot show this); the rounds repeat
/// until one was, and at least one must be.
#[test]
fn a_dropped_get_async_leaves_the_store_as_it_was() {
    use std::future::Future;
    use std::task::{Context, Waker};
    let Some(be) = spillway_tests::uring_direct_or_skip("a_dropped_get_async_leaves_the_store_as_it_was", true) else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let s = Store::open(TestCodec::default(), be, dir.path(), cfg(1 << 20)).unwrap();
    s.put_serialized(b"k", ser(&val(5, 100_000))).unwrap();
    let mut dropped_in_flight = 0;
    for _ in 0..20 {
        assert!(s.evict().unwrap() > 0);
        assert_eq!(s.tier(b"k"), Some(Tier::Disk));
        let mut cx = Context::from_waker(Waker::noop());
        let mut f = Box::pin(s.get_async(b"k"));
        let first = f.as_mut().poll(&mut cx);
        drop(f);
        s.check_accounting().unwrap();
        if first.is_pending() {
            dropped_in_flight += 1;
            assert_eq!(s.tier(b"k"), Some(Tier::Disk), "a dropped read promotes nothing");
        }
        assert_eq!(*s.get(b"k").unwrap().unwrap(), val(5, 100_000));
        s.check_accounting().unwrap();
        if dropped_in_flight >= 3 {
            break;
        }
    }
    assert!(dropped_in_flight > 0, "no read was still in flight at its first poll");
}

/// A spill store (not persistent) releases the disk blocks of a removed large value at once, as
/// unlinking its file would; the values around it still read back, and a reopened spill store starts
/// empty.
#[test]
fn a_spill_store_releases_removed_values_blocks_at_once() {
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

/// Where a test parks a thread in the middle of a store operation (a spill write, a serialization)
/// to look at what the rest of the store does meanwhile.
#[derive(Clone, Default)]
struct Gate(Arc<(std::sync::Mutex<GateState>, std::sync::Condvar)>);

#[derive(Default)]
struct GateState {
    armed: bool,
    parked: usize,
}

impl Gate {
    /// Hold every thread that reaches [`Gate::pass`] from now on, until [`Gate::release`].
    fn arm(&self) {
        self.0 .0.lock().unwrap().armed = true;
    }
    /// Wait here while the gate is armed.
    fn pass(&self) {
        let (m, c) = &*self.0;
        let mut g = m.lock().unwrap();
        if g.armed {
            g.parked += 1;
            c.notify_all();
            g = c.wait_while(g, |s| s.armed).unwrap();
            g.parked -= 1;
        }
    }
    /// Wait (bounded) until a thread is parked at the gate.
    fn wait_parked(&self) -> bool {
        let (m, c) = &*self.0;
        let g = c.wait_timeout_while(m.lock().unwrap(), std::time::Duration::from_secs(20), |s| s.parked == 0).unwrap();
        g.0.parked > 0
    }
    fn release(&self) {
        let (m, c) = &*self.0;
        m.lock().unwrap().armed = false;
        c.notify_all();
    }
}

/// A simulated disk whose writes pass a [`Gate`].
#[derive(Clone, Default)]
struct GatedBackend {
    inner: SimBackend,
    gate: Gate,
    /// Passed by every `sync_data`, after the write it makes durable has landed.
    sync_gate: Gate,
}

impl spillway::Backend for GatedBackend {
    type File = spillway::backend::SimFile;
    fn name(&self) -> &'static str {
        "gated-sim"
    }
    fn create_dir_all(&self, p: &std::path::Path) -> std::io::Result<()> {
        self.inner.create_dir_all(p)
    }
    fn is_dir(&self, p: &std::path::Path) -> bool {
        self.inner.is_dir(p)
    }
    fn list_dir(&self, p: &std::path::Path) -> std::io::Result<Vec<String>> {
        self.inner.list_dir(p)
    }
    fn open(&self, p: &std::path::Path, create: bool) -> std::io::Result<Self::File> {
        self.inner.open(p, create)
    }
    fn remove_file(&self, p: &std::path::Path) -> std::io::Result<()> {
        self.inner.remove_file(p)
    }
    fn sync_dir(&self, p: &std::path::Path) -> std::io::Result<()> {
        self.inner.sync_dir(p)
    }
    fn file_len(&self, f: &Self::File) -> std::io::Result<u64> {
        self.inner.file_len(f)
    }
    fn allocate(&self, f: &Self::File, len: u64) -> std::io::Result<()> {
        self.inner.allocate(f, len)
    }
    fn read_at(&self, f: &Self::File, offset: u64, buf: spillway::buf::AlignedBuf) -> spillway::backend::BufResult {
        self.inner.read_at(f, offset, buf)
    }
    fn write_at(&self, f: &Self::File, offset: u64, buf: spillway::buf::AlignedBuf) -> spillway::backend::BufResult {
        self.gate.pass();
        self.inner.write_at(f, offset, buf)
    }
    fn sync_data(&self, f: &Self::File) -> std::io::Result<()> {
        self.sync_gate.pass();
        self.inner.sync_data(f)
    }
    fn lock_dir(&self, dir: &std::path::Path) -> std::io::Result<spillway::backend::DirLock> {
        self.inner.lock_dir(dir)
    }
    fn alignment(&self, dir: &std::path::Path) -> usize {
        self.inner.alignment(dir)
    }
    fn punch_hole(&self, f: &Self::File, offset: u64, len: u64) -> std::io::Result<()> {
        self.inner.punch_hole(f, offset, len)
    }
}

type GatedStore = Store<TestCodec, GatedBackend>;

/// A store whose next put spills `b"old"` with its write parked at the gate; returns the thread
/// doing that put (it finishes once the gate is released).
fn park_a_spill_of_old(s: &Arc<GatedStore>, be: &GatedBackend) -> std::thread::JoinHandle<spillway::Result<()>> {
    s.put(b"old", val(b'o', 3000)).unwrap();
    be.gate.arm();
    let s2 = s.clone();
    let t = std::thread::spawn(move || s2.put(b"new", val(b'n', 3000)));
    assert!(be.gate.wait_parked(), "the spill write never reached the disk");
    t
}

/// With a thread parked: get `parked_key` (whose eviction is parked), put and remove another key, get
/// `new`, all on another thread within a bounded time. Returns the lengths of the two values got.
fn meanwhile<C: Codec<Value = Vec<u8>>, B: spillway::Backend>(
    s: &Arc<Store<C, B>>,
    parked_key: &'static [u8],
) -> (Option<usize>, Option<usize>) {
    let s = s.clone();
    without_waiting(move || {
        let parked = s.get(parked_key).unwrap().map(|v| v.len());
        s.put(b"small", val(b's', 10)).unwrap();
        assert!(s.remove(b"small").unwrap());
        (parked, s.get(b"new").unwrap().map(|v| v.len()))
    })
}

/// Run `f` on another thread and give it a bounded time: it must not wait for the parked write.
fn without_waiting<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(f()).unwrap());
    rx.recv_timeout(std::time::Duration::from_secs(20)).expect("blocked behind the spill write")
}

#[test]
fn gets_puts_and_removes_do_not_wait_for_a_spill_write() {
    let be = GatedBackend::default();
    let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/store", cfg(4000)).unwrap());
    let t = park_a_spill_of_old(&s, &be);
    // The value being written is still served, from memory; other keys come and go freely.
    assert_eq!(meanwhile(&s, b"old"), (Some(3000), Some(3000)));
    be.gate.release();
    t.join().unwrap().unwrap();
    s.check_accounting().unwrap();
    assert_eq!(s.get(b"old").unwrap().unwrap().len(), 3000);
    assert!(s.log().location(b"old").is_some(), "the spilled value keeps its disk copy");
}

#[test]
fn a_key_removed_while_its_spill_write_runs_leaves_no_record() {
    for persistent_store in [false, true] {
        let be = GatedBackend::default();
        let c = if persistent_store { persistent(4000) } else { cfg(4000) };
        let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/store", c.clone()).unwrap());
        let t = park_a_spill_of_old(&s, &be);
        let s2 = s.clone();
        assert!(without_waiting(move || s2.remove(b"old").unwrap()));
        be.gate.release();
        t.join().unwrap().unwrap();
        assert!(!s.contains(b"old"));
        assert_eq!(s.log().location(b"old"), None, "the orphaned record was dropped from the log");
        s.check_accounting().unwrap();
        if persistent_store {
            drop(s);
            let s = Store::open(TestCodec::default(), be.clone(), "/store", c).unwrap();
            assert!(!s.contains(b"old"), "a removed key came back after reopening");
        }
    }
}

/// The same race in a persistent store on a full disk: the record of the removed key cannot get its
/// tombstone, so the store forgets it instead. The store and its log still agree.
#[test]
fn a_key_removed_while_its_spill_write_runs_on_a_full_disk_leaves_no_record_in_the_index() {
    let be = GatedBackend::default();
    let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/store", persistent(4000)).unwrap());
    s.put(b"pre", val(b'p', 5000)).unwrap(); // heavier than the target: on disk, the segment exists
    let t = park_a_spill_of_old(&s, &be);
    let s2 = s.clone();
    assert!(without_waiting(move || s2.remove(b"old").unwrap()));
    // The parked spill write succeeds; the tombstone after it finds the disk full.
    be.inner.inject(Fault { op: FaultOp::Write, after: 1, kind: FaultKind::Enospc, sticky: true });
    be.gate.release();
    t.join().unwrap().unwrap();
    assert!(be.inner.fault_fired(), "the tombstone write met the full disk");
    assert!(!s.contains(b"old"));
    assert_eq!(s.log().location(b"old"), None, "the orphaned record was dropped from the index");
    s.check_accounting().unwrap();
}

#[test]
fn a_key_overwritten_while_its_spill_write_runs_keeps_the_new_value() {
    let be = GatedBackend::default();
    let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/store", cfg(4000)).unwrap());
    let t = park_a_spill_of_old(&s, &be);
    let s2 = s.clone();
    without_waiting(move || s2.put(b"old", val(b'2', 100)).unwrap());
    be.gate.release();
    t.join().unwrap().unwrap();
    assert_eq!(*s.get(b"old").unwrap().unwrap(), val(b'2', 100));
    assert_eq!(s.log().location(b"old"), None, "the stale record of the old value was dropped");
    s.check_accounting().unwrap();
    // Spilled later, the new value is the one read back.
    s.evict().unwrap();
    s.evict().unwrap();
    assert_eq!(s.tier(b"old"), Some(Tier::Disk));
    assert_eq!(*s.get(b"old").unwrap().unwrap(), val(b'2', 100));
}

#[test]
fn a_large_put_of_a_key_being_spilled_waits_for_that_write_and_wins() {
    let be = GatedBackend::default();
    let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/store", cfg(4000)).unwrap());
    let t = park_a_spill_of_old(&s, &be);
    // A value over the target goes straight to disk: it must not race the parked write of "old".
    let serialized = s.codec().serialized.load(Ordering::SeqCst);
    let s2 = s.clone();
    let large = std::thread::spawn(move || s2.put(b"old", val(b'L', 9000)));
    // Released only once the large put has serialized its value: from there it goes to the store,
    // where the parked write of the same key makes it wait.
    let mut spins = 0u64;
    while s.codec().serialized.load(Ordering::SeqCst) == serialized {
        spins += 1;
        assert!(spins < 50_000_000, "the large put never serialized");
        std::thread::yield_now();
    }
    be.gate.release();
    t.join().unwrap().unwrap();
    large.join().unwrap().unwrap();
    assert_eq!(s.tier(b"old"), Some(Tier::Disk));
    assert_eq!(*s.get(b"old").unwrap().unwrap(), val(b'L', 9000));
    let st = s.log().stats();
    assert_eq!(st.live_records, s.log().len() as u64, "one record per key: the older write's was dropped");
    s.check_accounting().unwrap();
}

/// Back-pressure with spill writes running outside the lock: however many threads put at once, memory
/// stays within the target plus the batches in flight (at most one per putting thread, each about
/// one value plus the eviction slack of target / 16). Each put checks the bound when it returns.
#[test]
fn concurrent_puts_keep_memory_within_target_plus_writes_in_flight() {
    const THREADS: u64 = 4;
    const VALUE: u64 = 3000 + 1; // the codec's size_of adds one byte
    let target = 40_000;
    let (s, _) = open(target);
    let s = Arc::new(s);
    let bound = target + THREADS * 2 * (VALUE + target / 16);
    let barrier = Arc::new(Barrier::new(THREADS as usize));
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (s, barrier) = (s.clone(), barrier.clone());
            std::thread::spawn(move || {
                barrier.wait();
                let mut peak = 0;
                for i in 0..300u32 {
                    s.put(format!("t{t}-{i}").as_bytes(), val(t as u8, 3000)).unwrap();
                    peak = peak.max(s.memory_bytes());
                }
                peak
            })
        })
        .collect();
    let peak = handles.into_iter().map(|h| h.join().unwrap()).max().unwrap();
    assert!(peak <= bound, "memory reached {peak} bytes, bound {bound}");
    assert!(s.memory_bytes() <= target, "after the last put returned: {}", s.memory_bytes());
    assert_eq!(s.len(), (THREADS * 300) as usize);
    s.check_accounting().unwrap();
}

/// The same rule when the value being put is not heavier than the target but eviction reaches it (the
/// older entries do not free enough): its serialization, which runs without the store lock, fails,
/// so the put fails and the key is forgotten.
#[test]
fn serialize_failure_of_the_inserted_key_during_eviction_is_an_error_and_the_key_is_forgotten() {
    let (s, _) = open(5_000);
    s.put(b"a", val(b'a', 99)).unwrap();
    let mut v = b"unpicklable".to_vec();
    v.resize(4_949, 0);
    let err = s.put(b"bad", v).unwrap_err();
    assert!(matches!(err, Error::Codec { op: "serialize", .. }), "{err}");
    assert!(!s.contains(b"bad"));
    assert_eq!(*s.get(b"a").unwrap().unwrap(), val(b'a', 99));
    s.check_accounting().unwrap();
}

/// A codec whose serialization of values starting with `slow`, and deserialization of values
/// starting with `gate`, park at a gate while it is armed.
#[derive(Default)]
struct GatedCodec {
    inner: TestCodec,
    gate: Gate,
}

impl Codec for GatedCodec {
    type Value = Vec<u8>;
    fn serialize(&self, v: &Vec<u8>) -> Result<Frames, CodecError> {
        if v.starts_with(b"slow") {
            self.gate.pass();
        }
        self.inner.serialize(v)
    }
    fn deserialize(&self, f: Frames) -> Result<Vec<u8>, CodecError> {
        if f.len() == 2 && f.0[1].starts_with(b"gate") {
            self.gate.pass();
        }
        self.inner.deserialize(f)
    }
    fn size_of(&self, v: &Vec<u8>) -> u64 {
        self.inner.size_of(v)
    }
}

#[test]
fn gets_and_puts_do_not_wait_for_an_evicted_objects_serialization() {
    let be = SimBackend::new();
    let s = Arc::new(Store::open(GatedCodec::default(), be, "/store", cfg(4000)).unwrap());
    let mut slow = b"slow".to_vec();
    slow.resize(3000, b's');
    s.put(b"slow", slow.clone()).unwrap();
    s.codec().gate.arm();
    let putter = {
        let s = s.clone();
        std::thread::spawn(move || s.put(b"new", val(b'n', 3000)))
    };
    assert!(s.codec().gate.wait_parked(), "the eviction never serialized `slow`");
    // While `slow` is being serialized: it is still served as the object it is, and other keys
    // come and go.
    assert_eq!(meanwhile(&s, b"slow"), (Some(3000), Some(3000)));
    s.codec().gate.release();
    putter.join().unwrap().unwrap();
    assert!(s.memory_bytes() <= 4000, "{}", s.memory_bytes());
    assert_eq!(*s.get(b"slow").unwrap().unwrap(), slow);
    s.check_accounting().unwrap();
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

/// A get that started before a transfer set the key's old value aside materializes that value
/// meanwhile and finds no entry to promote. When the transfer fails, the old value comes back as it
/// was: on disk, not with the object that get left in its slot (memory nobody accounted for, which
/// later gets returned without ever reading the disk again).
#[test]
fn a_failed_transfer_brings_the_old_value_back_without_a_stray_object() {
    struct HangsUp {
        gate: Gate,
        getter: Option<std::thread::JoinHandle<usize>>,
    }
    impl std::io::Read for HangsUp {
        fn read(&mut self, _: &mut [u8]) -> std::io::Result<usize> {
            // The old value is set aside now: let the get finish, then hang up.
            self.gate.release();
            if let Some(g) = self.getter.take() {
                assert_eq!(g.join().unwrap(), 30_004);
            }
            Err(std::io::ErrorKind::ConnectionReset.into())
        }
    }
    let codec = GatedCodec::default();
    let gate = codec.gate.clone();
    let s = Arc::new(Store::open(codec, SimBackend::new(), "/g", cfg(20_000)).unwrap());
    let old = [b"gate".as_slice(), &val(b'o', 30_000)].concat();
    s.put_serialized(b"k", ser(&old)).unwrap();
    assert_eq!(s.tier(b"k"), Some(Tier::Disk), "heavier than the target");
    gate.arm();
    let getter = {
        let s = s.clone();
        std::thread::spawn(move || s.get(b"k").unwrap().unwrap().len())
    };
    assert!(gate.wait_parked(), "the get never reached deserialize");
    let (_, meta) = spillway_tests::streamed(&ser(&val(b'n', 100_000)));
    assert!(s.put_stream(b"k", &meta, &mut HangsUp { gate, getter: Some(getter) }).is_err());
    assert_eq!(s.tier(b"k"), Some(Tier::Disk));
    assert_eq!(s.memory_bytes(), 0);
    let reads = s.metrics().activity("disk-read").count;
    assert_eq!(*s.get(b"k").unwrap().unwrap(), old);
    assert_eq!(s.metrics().activity("disk-read").count, reads + 1, "served from disk, not from a stray object");
    s.check_accounting().unwrap();
}

/// A value `max_spill` refuses to stream to disk is received into memory instead. A `put` of the
/// key while it arrives wins over it, as over a value streamed to disk: the older transfer must not
/// overwrite the newer value.
#[test]
fn a_put_during_a_transfer_refused_by_max_spill_wins() {
    struct PutsFirst<'a> {
        store: &'a Store<TestCodec, SimBackend>,
        payload: &'a [u8],
        put: bool,
    }
    impl std::io::Read for PutsFirst<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if !std::mem::replace(&mut self.put, true) {
                self.store.put(b"k", val(b'p', 10)).unwrap();
            }
            let n = buf.len().min(self.payload.len());
            buf[..n].copy_from_slice(&self.payload[..n]);
            self.payload = &self.payload[n..];
            Ok(n)
        }
    }
    let s = open_max_spill(3_000, 4_000);
    s.put_serialized(b"k", ser(&val(b'o', 100))).unwrap();
    let (payload, meta) = spillway_tests::streamed(&ser(&val(b'n', 6_000)));
    s.put_stream(b"k", &meta, &mut PutsFirst { store: &s, payload: &payload, put: false }).unwrap();
    assert_eq!(s.metrics().max_spill_refusals, 1, "the transfer went to memory");
    assert_eq!(*s.get(b"k").unwrap().unwrap(), val(b'p', 10), "the newer put wins");
    s.check_accounting().unwrap();
}

/// A stuck key that a get promotes leaves the list of stuck keys when it is removed: the list must
/// not keep keys the store no longer has.
#[test]
fn a_promoted_stuck_key_leaves_the_stuck_list_when_removed() {
    let s = open_max_spill(0, 1_000);
    s.put_serialized(b"a", ser(&val(b'a', 600))).unwrap();
    s.put_serialized(b"b", ser(&val(b'b', 600))).unwrap();
    assert_eq!(s.get(b"a").unwrap().unwrap().len(), 600);
    assert!(s.remove(b"a").unwrap());
    assert!(s.remove(b"b").unwrap());
    assert!(s.is_empty());
    s.check_accounting().unwrap();
}

/// `check_accounting` while a spill's record is in the log but the spill has not settled yet (its
/// sync is parked): the key is being written, so its entry may or may not have its disk copy yet.
#[test]
fn accounting_checks_pass_while_a_spill_write_settles() {
    let be = GatedBackend::default();
    let c = StoreConfig { sync_spills: true, ..cfg(5_000) };
    let s = Arc::new(Store::open(TestCodec::default(), be.clone(), "/g", c).unwrap());
    s.put(b"old", val(b'o', 3000)).unwrap();
    be.sync_gate.arm();
    let t = {
        let s = s.clone();
        std::thread::spawn(move || s.put(b"new", val(b'n', 3000)))
    };
    assert!(be.sync_gate.wait_parked(), "the spill never reached its sync");
    assert!(s.log().location(b"old").is_some(), "the record landed");
    s.check_accounting().unwrap();
    be.sync_gate.release();
    t.join().unwrap().unwrap();
    assert_eq!(s.tier(b"old"), Some(Tier::Disk));
    s.check_accounting().unwrap();
}

/// A persistent store's `flush` writes what it holds only in memory, so its whole contents survive
/// a crash and reopen: values that were never evicted, and a small value that overwrote a spilled
/// one (whose old record is tombstoned at once, so without the flush the key would come back
/// neither old nor new). The values stay in memory, in their tiers, with a disk copy: reading them
/// reads nothing from disk, and evicting them afterwards writes nothing (the flush used to evict
/// everything, leaving every later get a disk read).
#[test]
fn a_persistent_flush_writes_what_is_held_only_in_memory() {
    let be = SimBackend::new();
    {
        let s = Store::open(TestCodec::default(), be.clone(), "/store", persistent(10_000)).unwrap();
        s.put(b"over", val(b'o', 20_000)).unwrap(); // heavier than the target: on disk
        s.put(b"over", val(b'n', 100)).unwrap(); // now in memory only
        for i in 0..5u8 {
            s.put(&[i], val(i, 1000)).unwrap();
        }
        s.put_serialized(b"ser", ser(&val(b's', 500))).unwrap();
        assert_eq!(s.tier(&[0]), Some(Tier::Materialized), "nothing evicted before the flush");
        let memory = s.memory_bytes();
        s.flush().unwrap();
        s.check_accounting().unwrap();
        assert_eq!(s.memory_bytes(), memory, "the flush evicted nothing");
        for i in 0..5u8 {
            assert_eq!(s.tier(&[i]), Some(Tier::Materialized), "key {i}");
        }
        assert_eq!(s.tier(b"ser"), Some(Tier::Serialized));
        let m = s.metrics();
        assert_eq!(m.spilled_memory_bytes, 5 * 1001 + 101 + 501, "every value has its disk copy");
        let reads = m.activity("disk-read").count;
        assert_eq!(*s.get(&[3]).unwrap().unwrap(), val(3, 1000), "still readable after the flush");
        assert_eq!(*s.get(b"ser").unwrap().unwrap(), val(b's', 500));
        assert_eq!(s.metrics().activity("disk-read").count, reads, "served from memory");
        let writes = be.write_count();
        while s.evict().unwrap() > 0 {}
        assert_eq!(s.memory_bytes(), 0);
        assert_eq!(be.write_count(), writes, "evicting values that have their disk copy writes nothing");
        s.check_accounting().unwrap();
    }
    let s = Store::open(TestCodec::default(), be.crash(None), "/store", persistent(10_000)).unwrap();
    assert_eq!(s.len(), 7);
    assert_eq!(*s.get(b"over").unwrap().unwrap(), val(b'n', 100));
    for i in 0..5u8 {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 1000));
    }
    assert_eq!(*s.get(b"ser").unwrap().unwrap(), val(b's', 500));
    s.check_accounting().unwrap();
}

/// A value heavier than the target that `max_spill` kept in memory lives on disk once a `flush`
/// (after space was freed) writes it: it does not stay in memory above the target.
#[test]
fn a_persistent_flush_moves_a_heavy_value_it_writes_to_disk() {
    let c = StoreConfig { max_spill_bytes: Some(6_000), ..persistent(3_000) };
    let s = Store::open(TestCodec::default(), SimBackend::new(), "/store", c).unwrap();
    s.put(b"a", val(b'a', 5_000)).unwrap();
    assert_eq!(s.tier(b"a"), Some(Tier::Disk));
    s.put(b"b", val(b'b', 5_000)).unwrap(); // refused by max_spill: kept in memory, serialized
    assert_eq!(s.tier(b"b"), Some(Tier::Serialized));
    assert!(s.memory_bytes() > 3_000);
    assert!(s.remove(b"a").unwrap());
    s.flush().unwrap();
    assert_eq!(s.tier(b"b"), Some(Tier::Disk));
    assert_eq!(s.memory_bytes(), 0);
    assert_eq!(*s.get(b"b").unwrap().unwrap(), val(b'b', 5_000));
    s.check_accounting().unwrap();
}

/// Values a persistent store cannot write at `flush` (here `max_spill` is reached) stay in memory,
/// readable, and `flush` says how many would not survive a restart.
#[test]
fn a_persistent_flush_reports_values_it_could_not_write() {
    let c = StoreConfig { max_spill_bytes: Some(1_500), ..persistent(10_000) };
    let s = Store::open(TestCodec::default(), SimBackend::new(), "/store", c).unwrap();
    for i in 0..3u8 {
        s.put(&[i], val(i, 1000)).unwrap();
    }
    let err = s.flush().unwrap_err();
    assert!(matches!(err, Error::NotPersisted { keys: 2 }), "{err}");
    for i in 0..3u8 {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), val(i, 1000));
    }
    s.check_accounting().unwrap();
}

/// A persistent store's `flush` that runs while another thread's eviction is demoting a value
/// (object -> compressed frames, no disk write) still writes that value before it returns: its
/// first pass had to skip it, being demoted.
#[test]
fn a_persistent_flush_writes_a_value_another_thread_was_demoting() {
    let be = SimBackend::new();
    let c = StoreConfig { compress_in_memory: true, ..persistent(4_000) };
    let s = Arc::new(Store::open(GatedCodec::default(), be.clone(), "/store", c.clone()).unwrap());
    let mut slow = b"slow".to_vec();
    slow.resize(3000, b's');
    s.put(b"slow", slow.clone()).unwrap();
    s.codec().gate.arm();
    let putter = {
        let s = s.clone();
        std::thread::spawn(move || s.put(b"x", val(b'x', 1500)))
    };
    assert!(s.codec().gate.wait_parked(), "the demotion never started");
    let flusher = {
        let s = s.clone();
        std::thread::spawn(move || s.flush())
    };
    // The flush has made its first pass once it has written `x`; `slow` it had to skip.
    let mut spins = 0u64;
    while s.log().location(b"x").is_none() {
        spins += 1;
        assert!(spins < 50_000_000, "the flush never wrote x");
        std::thread::yield_now();
    }
    s.codec().gate.release();
    putter.join().unwrap().unwrap();
    flusher.join().unwrap().unwrap();
    drop(s);
    let s = Store::open(GatedCodec::default(), be.crash(None), "/store", c).unwrap();
    assert_eq!(*s.get(b"slow").unwrap().unwrap(), slow, "flushed before the power cut");
    assert_eq!(*s.get(b"x").unwrap().unwrap(), val(b'x', 1500));
}

/// A value arriving from a peer into memory writes nothing to disk: a `flush` meanwhile does not
/// wait for the peer.
#[test]
fn a_flush_does_not_wait_for_a_value_received_into_memory() {
    struct FlushesFirst<'a> {
        store: &'a Arc<Store<TestCodec, SimBackend>>,
        payload: &'a [u8],
        flushed: bool,
    }
    impl std::io::Read for FlushesFirst<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if !std::mem::replace(&mut self.flushed, true) {
                let s = self.store.clone();
                without_waiting(move || s.flush().unwrap());
            }
            let n = buf.len().min(self.payload.len());
            buf[..n].copy_from_slice(&self.payload[..n]);
            self.payload = &self.payload[n..];
            Ok(n)
        }
    }
    let s = Arc::new(open_max_spill(0, 10_000));
    let (payload, meta) = spillway_tests::streamed(&ser(&val(b'n', 6_000)));
    s.put_stream(b"k", &meta, &mut FlushesFirst { store: &s, payload: &payload, flushed: false }).unwrap();
    assert_eq!(*s.get(b"k").unwrap().unwrap(), val(b'n', 6_000));
    s.check_accounting().unwrap();
}

/// A `remove` that fails (its tombstone cannot be written) changes nothing: a value arriving for
/// the key meanwhile is not dropped as if the remove had won.
#[test]
fn a_failed_remove_during_a_transfer_does_not_drop_the_received_value() {
    struct RemovesFirst<'a> {
        store: &'a Store<TestCodec, SimBackend>,
        be: &'a SimBackend,
        payload: &'a [u8],
        removed: bool,
    }
    impl std::io::Read for RemovesFirst<'_> {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if !std::mem::replace(&mut self.removed, true) {
                self.be.inject(Fault { op: FaultOp::Write, after: 0, kind: FaultKind::Enospc, sticky: false });
                assert!(self.store.remove(b"k").is_err(), "the tombstone cannot be written");
            }
            let n = buf.len().min(self.payload.len());
            buf[..n].copy_from_slice(&self.payload[..n]);
            self.payload = &self.payload[n..];
            Ok(n)
        }
    }
    let be = SimBackend::new();
    let c = StoreConfig { max_spill_bytes: Some(5_000), ..persistent(3_000) };
    let s = Store::open(TestCodec::default(), be.clone(), "/store", c).unwrap();
    s.put_serialized(b"k", ser(&val(b'o', 4_000))).unwrap();
    assert_eq!(s.tier(b"k"), Some(Tier::Disk));
    let (payload, meta) = spillway_tests::streamed(&ser(&val(b'n', 6_000)));
    s.put_stream(b"k", &meta, &mut RemovesFirst { store: &s, be: &be, payload: &payload, removed: false }).unwrap();
    assert_eq!(s.metrics().max_spill_refusals, 1, "received into memory");
    assert_eq!(*s.get(b"k").unwrap().unwrap(), val(b'n', 6_000), "the failed remove did not win");
    s.check_accounting().unwrap();
}
