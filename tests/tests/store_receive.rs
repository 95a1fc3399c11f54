//! Values arriving in stored form: `Store::receive` (memory or disk), `put_stream`, transfers between
//! stores, and what wins when a put, a remove or a failure meets an arrival.

use std::sync::atomic::Ordering;
use std::sync::Arc;

use bytes::Bytes;
use spillway::backend::{Fault, FaultKind, FaultOp};
use spillway::{Frames, SimBackend, Store, StoreConfig, Tier};
use spillway_tests::store::*;

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
/// lock: that would stall every get and put of the store until the transfer ended, however slow
/// the peer. Here the peer, mid-value, waits for another thread to remove a spilled key and read
/// another one (bounded wait, so that a remove that does wait fails the test instead of hanging it).
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
/// leaves the receiver's old value of the key as it was, in memory or on disk: it is not dropped
/// when the transfer starts.
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

/// While a transfer of a key is streamed to disk, the key keeps its old value, readable where it is
/// (in memory or on disk), neither promoted nor spilled; a `remove` meanwhile wins over the
/// transfer, as a `put` does: the key stays absent, the streamed record is dropped, and the
/// transfer says that its value was not stored.
#[test]
fn a_key_keeps_its_old_value_during_a_transfer_and_a_remove_wins() {
    /// A peer that sends a first piece, says so, and sends the rest once told to.
    struct Gated {
        payload: Vec<u8>,
        sent: usize,
        started: Option<std::sync::mpsc::Sender<()>>,
        go_on: std::sync::mpsc::Receiver<()>,
    }
    impl std::io::Read for Gated {
        fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            if let Some(started) = self.started.take() {
                started.send(()).unwrap();
                self.go_on.recv().unwrap();
            }
            let n = buf.len().min(self.payload.len() - self.sent).min(4096);
            buf[..n].copy_from_slice(&self.payload[self.sent..self.sent + n]);
            self.sent += n;
            Ok(n)
        }
    }
    for (old, tier) in [(val(b'o', 5_000), Tier::Serialized), (val(b'O', 30_000), Tier::Disk)] {
        let s = Arc::new(Store::open(TestCodec::default(), SimBackend::new(), "/r", cfg(20_000)).unwrap());
        s.put_serialized(b"k", ser(&old)).unwrap();
        let (payload, meta) = spillway_tests::streamed(&ser(&val(b'n', 1 << 20)));
        let (started, has_started) = std::sync::mpsc::channel::<()>();
        let (go_on, wait) = std::sync::mpsc::channel::<()>();
        let peer = Gated { payload, sent: 0, started: Some(started), go_on: wait };
        let receiver = {
            let s = s.clone();
            std::thread::spawn(move || s.put_stream(b"k", &meta, &mut { peer }))
        };
        has_started.recv_timeout(std::time::Duration::from_secs(30)).expect("the transfer never started");
        let (mem, disk) = (s.memory_bytes(), s.metrics().spilled_disk_bytes);
        for _ in 0..2 {
            assert!(s.contains(b"k"), "the old value stays in sight during the transfer");
            assert_eq!(*s.get(b"k").unwrap().unwrap(), old);
            assert_eq!(s.tier(b"k"), Some(tier), "neither promoted nor spilled meanwhile");
        }
        assert_eq!((s.memory_bytes(), s.metrics().spilled_disk_bytes), (mem, disk));
        s.check_accounting().unwrap();
        assert!(s.remove(b"k").unwrap(), "the old value is removed");
        assert!(!s.remove(b"k").unwrap(), "only once");
        go_on.send(()).unwrap();
        assert!(!receiver.join().unwrap().unwrap(), "the transfer lost to the remove");
        assert!(!s.contains(b"k"), "the remove wins over the transfer");
        assert!(s.get(b"k").unwrap().is_none());
        assert_eq!((s.memory_bytes(), s.metrics().spilled_disk_bytes), (0, 0));
        s.check_accounting().unwrap();
    }
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

/// A value held in memory that no log checked, with more frames than the wire format carries, is
/// answered with an ERROR the client reads, and the connection stays in step: were it sent, the
/// client would reject the header as malformed and drop the connection.
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

/// A get that started before a transfer set the key's old value aside materializes that value
/// meanwhile and finds no entry to promote. When the transfer fails, the old value comes back as it
/// was: on disk, not with the object that get left in its slot (memory nobody accounted for, which
/// later gets would return without ever reading the disk again).
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
    let stored = s.put_stream(b"k", &meta, &mut PutsFirst { store: &s, payload: &payload, put: false }).unwrap();
    assert!(!stored, "superseded");
    assert_eq!(s.metrics().max_spill_refusals, 1, "the transfer went to memory");
    assert_eq!(*s.get(b"k").unwrap().unwrap(), val(b'p', 10), "the newer put wins");
    s.check_accounting().unwrap();
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
    let stored =
        s.put_stream(b"k", &meta, &mut RemovesFirst { store: &s, be: &be, payload: &payload, removed: false }).unwrap();
    assert!(stored, "a failed remove does not supersede");
    assert_eq!(s.metrics().max_spill_refusals, 1, "received into memory");
    assert_eq!(*s.get(b"k").unwrap().unwrap(), val(b'n', 6_000), "the failed remove did not win");
    s.check_accounting().unwrap();
}

/// `Store::receive` checks what it is told before allocating for it: an lz4 value announcing far
/// more bytes than any compression of its stored length could give, frame lengths that do not lay
/// out to the announced length, or an uncompressed value stored longer than it is, are each a
/// `Protocol` error; nothing is read from the source and nothing is stored.
#[test]
fn a_forged_announcement_is_refused_before_anything_is_allocated() {
    let (s, _) = open(1 << 20);
    let lie = |lz4: bool, frame_lens: Vec<u64>, raw_len: u64, stored_len: u64| spillway::StreamedValue {
        lz4,
        frame_lens,
        raw_len,
        stored_len,
        payload_crc: 0,
    };
    for meta in [
        lie(true, vec![1 << 40], 1 << 40, 100),
        lie(false, vec![10, 10], 20, 20),
        lie(false, vec![100], 100, 200),
        lie(false, vec![u64::MAX, 2], 1, 1),
    ] {
        let mut src: &[u8] = &[0u8; 256];
        match s.receive(b"k", &meta, &mut src) {
            Err(spillway::Error::Protocol(_)) => {}
            other => panic!("{meta:?}: {other:?}"),
        }
        assert_eq!(src.len(), 256, "{meta:?}: read from the source");
        assert!(!s.contains(b"k"));
    }
}

/// One rule places every arrival (`Store::admit`): a value goes into memory if it fits under the
/// target with what is in memory and what was admitted before and not yet released; `receive`
/// follows it too, so a value another receiver holds room for pushes the next one to disk.
#[test]
fn arrivals_are_placed_by_one_rule_that_counts_what_is_still_arriving() {
    let s = Store::open(TestCodec::default(), SimBackend::new(), "/r", cfg(20_000)).unwrap();
    s.put_serialized(b"held", ser(&val(b'h', 4_000))).unwrap();
    let weight = s.memory_bytes();
    assert!(s.admit(20_000 - weight), "exactly what fits");
    assert!(!s.admit(1), "nothing more while that room is held");
    s.release_admitted(20_000 - weight);
    assert!(s.admit(9_000));
    // An arrival through `receive` that fits with what is in memory, but not with what is admitted:
    // straight to disk.
    let (payload, meta) = spillway_tests::streamed(&ser(&val(b'n', 9_000)));
    s.receive(b"n", &meta, &mut &payload[..]).unwrap();
    assert_eq!(s.tier(b"n"), Some(Tier::Disk), "the room held for the first arrival counts");
    s.release_admitted(9_000);
    s.remove(b"n").unwrap();
    s.receive(b"m", &meta, &mut &payload[..]).unwrap();
    assert_eq!(s.tier(b"m"), Some(Tier::Serialized), "released: in memory");
    assert!(s.admit(20_000 - s.memory_bytes()), "a receive lets go of its own room");
    assert_eq!(*s.get(b"m").unwrap().unwrap(), val(b'n', 9_000));
}
