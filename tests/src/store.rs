//! The store tests' codec, configurations and gated backend and codec (which park a spill write or a
//! serialization until the test lets it go), shared by the `store_*` test files.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use bytes::Bytes;
use spillway::{Codec, CodecError, Frames, LogOptions, SimBackend, Store, StoreConfig, Tier};

/// Values are byte vectors; serialized as a 1-byte header frame plus the bytes. Values starting with
/// `unpicklable` fail to serialize, values starting with `panicky` make it panic; serialized data starting with `undeserializable` fails to deserialize.
/// Values starting with `bloated` weigh 20 times their length as objects.
#[derive(Default)]
pub struct TestCodec {
    /// Values serialized so far.
    pub serialized: AtomicUsize,
    /// Values deserialized so far.
    pub deserialized: AtomicUsize,
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

/// `v` serialized as [`TestCodec`] serializes it.
pub fn ser(v: &[u8]) -> Frames {
    Frames(vec![Bytes::from_static(b"H"), Bytes::copy_from_slice(v)])
}

/// A spill store's configuration with `target` bytes and 1 MiB segments.
pub fn cfg(target: u64) -> StoreConfig {
    StoreConfig {
        target_bytes: target,
        log: LogOptions { segment_bytes: 1 << 20, ..Default::default() },
        ..Default::default()
    }
}

/// [`cfg`], persistent.
pub fn persistent(target: u64) -> StoreConfig {
    StoreConfig { persistent: true, ..cfg(target) }
}

/// A store on a fresh simulated disk with `max_spill_bytes` set.
pub fn open_max_spill(max_spill: u64, target: u64) -> Store<TestCodec, SimBackend> {
    let c = StoreConfig { max_spill_bytes: Some(max_spill), ..cfg(target) };
    Store::open(TestCodec::default(), SimBackend::new(), "/s", c).unwrap()
}

/// A store of [`cfg`]`(target)` on a fresh simulated disk, and the disk.
pub fn open(target: u64) -> (Store<TestCodec, SimBackend>, SimBackend) {
    let be = SimBackend::new();
    (Store::open(TestCodec::default(), be.clone(), "/store", cfg(target)).unwrap(), be)
}

/// `n` bytes of `c`.
pub fn val(c: u8, n: usize) -> Vec<u8> {
    vec![c; n]
}

/// A store with a 5000-byte target and 2000-byte values `first`, 1, ..., 10: the first spill creates
/// the segment, then 3..=10 spill one after another. Returns the store and the backend's operation
/// count from before the puts of 3..=10.
pub fn spill_ten(be: &SimBackend, c: StoreConfig) -> (Store<TestCodec, SimBackend>, u64) {
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

/// Where a test parks a thread in the middle of a store operation (a spill write, a serialization)
/// to look at what the rest of the store does meanwhile.
#[derive(Clone, Default)]
pub struct Gate(pub Arc<(std::sync::Mutex<GateState>, std::sync::Condvar)>);

/// A gate's state.
#[derive(Default)]
pub struct GateState {
    /// Threads that pass now wait.
    pub armed: bool,
    /// Threads waiting at the gate.
    pub parked: usize,
}

impl Gate {
    /// Hold every thread that reaches [`Gate::pass`] from now on, until [`Gate::release`].
    pub fn arm(&self) {
        self.0 .0.lock().unwrap().armed = true;
    }
    /// Wait here while the gate is armed.
    pub fn pass(&self) {
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
    pub fn wait_parked(&self) -> bool {
        let (m, c) = &*self.0;
        let g = c.wait_timeout_while(m.lock().unwrap(), std::time::Duration::from_secs(20), |s| s.parked == 0).unwrap();
        g.0.parked > 0
    }
    /// Let every parked thread go, and later ones pass.
    pub fn release(&self) {
        let (m, c) = &*self.0;
        m.lock().unwrap().armed = false;
        c.notify_all();
    }
}

/// A simulated disk whose writes pass a [`Gate`].
#[derive(Clone, Default)]
pub struct GatedBackend {
    /// The disk.
    pub inner: SimBackend,
    /// Passed by every write.
    pub gate: Gate,
    /// Passed by every `sync_data`, after the write it makes durable has landed.
    pub sync_gate: Gate,
}

impl spillway::backend::sealed::Sealed for GatedBackend {}

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
    fn allocate(&self, f: &Self::File, len: u64) -> std::io::Result<bool> {
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

/// A store on a [`GatedBackend`].
pub type GatedStore = Store<TestCodec, GatedBackend>;

/// A store whose next put spills `b"old"` with its write parked at the gate; returns the thread
/// doing that put (it finishes once the gate is released).
pub fn park_a_spill_of_old(s: &Arc<GatedStore>, be: &GatedBackend) -> std::thread::JoinHandle<spillway::Result<()>> {
    s.put(b"old", val(b'o', 3000)).unwrap();
    be.gate.arm();
    let s2 = s.clone();
    let t = std::thread::spawn(move || s2.put(b"new", val(b'n', 3000)));
    assert!(be.gate.wait_parked(), "the spill write never reached the disk");
    t
}

/// With a thread parked: get `parked_key` (whose eviction is parked), put and remove another key, get
/// `new`, all on another thread within a bounded time. Returns the lengths of the two values got.
pub fn meanwhile<C: Codec<Value = Vec<u8>>, B: spillway::Backend>(
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
pub fn without_waiting<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || tx.send(f()).unwrap());
    rx.recv_timeout(std::time::Duration::from_secs(20)).expect("blocked behind the spill write")
}

/// A codec whose serialization of values starting with `slow`, and deserialization of values
/// starting with `gate`, park at a gate while it is armed.
#[derive(Default)]
pub struct GatedCodec {
    /// The codec it wraps.
    pub inner: TestCodec,
    /// Where slow serializations and gated deserializations park.
    pub gate: Gate,
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

/// Values that can be changed in place (as a numpy array can), serialized as their bytes.
#[derive(Default)]
pub struct MutCodec;

impl Codec for MutCodec {
    type Value = std::sync::Mutex<Vec<u8>>;
    fn serialize(&self, v: &Self::Value) -> Result<Frames, CodecError> {
        Ok(Frames::single(v.lock().unwrap().clone()))
    }
    fn deserialize(&self, f: Frames) -> Result<Self::Value, CodecError> {
        Ok(std::sync::Mutex::new(f.concat().to_vec()))
    }
    fn size_of(&self, v: &Self::Value) -> u64 {
        v.lock().unwrap().len() as u64
    }
}
