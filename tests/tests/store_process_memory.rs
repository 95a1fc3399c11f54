//! The process target (`engine/src/store/pressure.rs`): a store also evicts when its process's RSS is
//! above a target of its own, and learns what spilling does not bring down. The RSS is scripted with
//! [`Store::set_rss_probe`].

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};

use spillway::{EvictionPolicy, LogOptions, SimBackend, Store, StoreConfig, Tier, RSS_CHECK_BYTES};
use spillway_tests::store::*;

const MIB: u64 = 1 << 20;

type S = Store<TestCodec, SimBackend>;

/// dask's policy, a store target far above what the tests put (only the process target counts).
fn open() -> Arc<S> {
    let c = StoreConfig {
        eviction: EvictionPolicy::dask(),
        log: LogOptions { segment_bytes: 64 << 20, ..Default::default() },
        ..cfg(1 << 30)
    };
    Arc::new(Store::open(TestCodec::default(), SimBackend::new(), "/s", c).unwrap())
}

/// A value of about 1 MiB, tagged.
fn mib(tag: u8) -> Vec<u8> {
    val(tag, MIB as usize - 1) // weighs 1 MiB by the codec
}

fn on_disk(s: &S, n: u8) -> usize {
    (0..n).filter(|i| s.tier(&[*i]) == Some(Tier::Disk)).count()
}

/// The RSS as a process whose memory is `other` bytes besides what the store holds in memory.
fn rss_tracking(s: &Arc<S>, other: u64) {
    let w: Weak<S> = Arc::downgrade(s);
    s.set_rss_probe(Arc::new(move || w.upgrade().map(|s| other + s.memory_bytes())));
}

#[test]
fn a_process_above_its_target_spills_the_oldest_values_down_to_it() {
    let s = open();
    rss_tracking(&s, 90 * MIB);
    s.set_process_target(Some(100 * MIB));
    for i in 0..40u8 {
        s.put(&[i], mib(i)).unwrap();
        // Checked once per RSS_CHECK_BYTES of change: within one value's weight of the target.
        assert!(s.memory_bytes() <= 10 * MIB + RSS_CHECK_BYTES, "{i}: {}", s.memory_bytes());
    }
    assert!(on_disk(&s, 40) >= 29, "{}", on_disk(&s, 40));
    // The RSS fell as values were spilled: nothing was learned out of reach.
    assert_eq!(s.process_out_of_reach(), 0);
    // The newest values are the ones in memory.
    assert_eq!(s.tier(&[39]), Some(Tier::Materialized));
    assert_eq!(s.tier(&[0]), Some(Tier::Disk));
    for i in 0..40u8 {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), mib(i));
    }
    s.check_accounting().unwrap();
}

#[test]
fn with_a_trigger_the_process_spills_only_above_it_and_then_down_to_the_target() {
    // dask's memory monitor: nothing below the `spill` threshold; above it, down to `target`.
    let s = open();
    rss_tracking(&s, 90 * MIB);
    s.set_process_target(Some(100 * MIB));
    s.set_process_trigger(Some(110 * MIB));
    assert_eq!(s.process_trigger(), Some(110 * MIB));
    for i in 0..20u8 {
        s.put(&[i], mib(i)).unwrap(); // RSS 91 .. 110 MiB: at most the trigger
    }
    assert_eq!(on_disk(&s, 20), 0, "nothing spilled at or below the trigger");
    s.put(&[20], mib(20)).unwrap(); // RSS 111 MiB: above it
                                    // Down to the target (within one check's worth), not just below the trigger.
    assert!(s.memory_bytes() <= 10 * MIB + RSS_CHECK_BYTES, "{}", s.memory_bytes());
    assert!(on_disk(&s, 21) >= 10, "{}", on_disk(&s, 21));
    // A trigger below the target is the target.
    s.set_process_trigger(Some(MIB));
    assert_eq!(s.process_trigger(), Some(100 * MIB));
    s.check_accounting().unwrap();
}

#[test]
fn puts_that_replace_what_tasks_release_are_checked_too() {
    // A worker's tasks put outputs as fast as they release inputs: the store's weight stays the same
    // while the process's memory grows. The RSS is read per MiB brought in, not per MiB of change.
    let s = open();
    let rss = Arc::new(AtomicU64::new(0));
    let r = rss.clone();
    s.set_rss_probe(Arc::new(move || Some(r.load(Ordering::Relaxed))));
    s.set_process_target(Some(100 * MIB));
    for i in 0..4u8 {
        s.put(&[i], mib(i)).unwrap();
    }
    rss.store(120 * MIB, Ordering::Relaxed); // grown by what the store does not hold
    for i in 4..8u8 {
        s.remove(&[i - 4]).unwrap();
        s.put(&[i], mib(i)).unwrap();
    }
    assert!(on_disk(&s, 8) > 0, "the process is above its target: older values go");
    assert_eq!(s.tier(&[7]), Some(Tier::Materialized));
    s.check_accounting().unwrap();
}

#[test]
fn a_read_back_spills_others_but_not_itself() {
    let s = open();
    for i in 0..4u8 {
        s.put(&[i], mib(i)).unwrap();
    }
    assert_eq!(s.evict_bytes(4 * MIB, None).unwrap(), 4 * MIB);
    for i in 4..12u8 {
        s.put(&[i], mib(i)).unwrap();
    }
    rss_tracking(&s, 0);
    s.set_process_target(Some(8 * MIB)); // 8 MiB in memory: at the target
                                         // Reading 0 back brings 1 MiB in: the process is over by 1 MiB, and 4 (the oldest in memory)
                                         // goes; 0, just read, stays.
    assert_eq!(*s.get(&[0]).unwrap().unwrap(), mib(0));
    assert_eq!(s.tier(&[0]), Some(Tier::Materialized));
    assert_eq!(s.tier(&[4]), Some(Tier::Disk));
    assert_eq!(s.memory_bytes(), 8 * MIB);
    s.check_accounting().unwrap();
}

#[test]
fn memory_that_spilling_does_not_give_back_is_not_chased() {
    // An RSS that stays up whatever is spilled (objects freed into the allocator's arenas, values
    // referenced elsewhere) is learned as out of reach: spilling stops once it has covered the
    // excess, instead of spilling every older value at every put.
    let s = open();
    s.set_rss_probe(Arc::new(|| Some(110 * MIB))); // never falls
    s.set_process_target(Some(100 * MIB));
    for i in 0..20u8 {
        s.put(&[i], mib(i)).unwrap();
    }
    let spilled = on_disk(&s, 20);
    assert!((10..=12).contains(&spilled), "the 10 MiB excess, once; not 19: {spilled}");
    assert_eq!(s.process_out_of_reach(), 10 * MIB);
    // What was learned never exceeds a quarter of the target.
    let t = open();
    t.set_rss_probe(Arc::new(|| Some(1 << 40)));
    t.set_process_target(Some(40 * MIB));
    for i in 0..30u8 {
        t.put(&[i], mib(i)).unwrap();
    }
    assert_eq!(t.process_out_of_reach(), 10 * MIB);
    for i in 0..20u8 {
        assert_eq!(*s.get(&[i]).unwrap().unwrap(), mib(i));
    }
    s.check_accounting().unwrap();
}

#[test]
fn memory_out_of_reach_is_forgotten_as_the_rss_falls() {
    let s = open();
    let rss = Arc::new(AtomicU64::new(110 * MIB));
    let r = rss.clone();
    s.set_rss_probe(Arc::new(move || Some(r.load(Ordering::Relaxed))));
    s.set_process_target(Some(100 * MIB));
    for i in 0..20u8 {
        s.put(&[i], mib(i)).unwrap();
    }
    assert_eq!(s.process_out_of_reach(), 10 * MIB);
    // The RSS falls to 104 MiB: at most the 4 MiB above the target can still be out of reach.
    rss.store(104 * MIB, Ordering::Relaxed);
    s.put(&[20], mib(20)).unwrap();
    s.put(&[21], mib(21)).unwrap();
    assert_eq!(s.process_out_of_reach(), 4 * MIB);
    s.check_accounting().unwrap();
}

#[test]
fn without_a_process_target_only_the_store_target_counts() {
    let s = open();
    s.set_rss_probe(Arc::new(|| Some(1 << 40)));
    assert_eq!(s.process_target(), None);
    assert_eq!(s.process_headroom(), None);
    for i in 0..8u8 {
        s.put(&[i], mib(i)).unwrap();
    }
    assert_eq!(on_disk(&s, 8), 0);
    // Turned on, then off again.
    s.set_process_target(Some(MIB));
    s.put(&[8], mib(8)).unwrap();
    assert!(on_disk(&s, 9) > 0);
    s.set_process_target(None);
    let before = on_disk(&s, 9);
    s.put(&[9], mib(9)).unwrap();
    s.put(&[10], mib(10)).unwrap();
    assert_eq!(on_disk(&s, 11), before);
    s.check_accounting().unwrap();
}

#[test]
fn headroom_is_the_target_less_the_rss_plus_what_is_out_of_reach() {
    let s = open();
    s.set_rss_probe(Arc::new(|| Some(90 * MIB)));
    s.set_process_target(Some(100 * MIB));
    assert_eq!(s.process_headroom(), Some(10 * MIB));
    s.set_process_target(Some(80 * MIB));
    assert_eq!(s.process_headroom(), Some(0));
}

#[test]
fn the_default_probe_reads_this_process() {
    // At least the 16 MiB touched here. (Not compared with a reading taken before: the other tests
    // of this binary run on threads of the same process and free memory meanwhile.)
    let v = vec![1u8; 16 << 20];
    let rss = spillway::read_rss().expect("/proc/self/statm");
    assert!(rss >= 16 * MIB, "{rss}");
    assert_eq!(v.iter().map(|&b| b as u64).sum::<u64>(), 16 * MIB);
}

/// Memory of a [`DeferredCodec`]'s values: held by live values, or dropped and not yet released.
#[derive(Default)]
struct Ledger {
    live: AtomicU64,
    dropped: AtomicU64,
}

/// A value whose memory its runtime frees only later (a Python object dropped without the GIL).
struct Deferred {
    bytes: Vec<u8>,
    ledger: Arc<Ledger>,
}

impl Drop for Deferred {
    fn drop(&mut self) {
        let n = self.bytes.len() as u64;
        self.ledger.live.fetch_sub(n, Ordering::SeqCst);
        self.ledger.dropped.fetch_add(n, Ordering::SeqCst);
    }
}

/// [`TestCodec`]'s frames; its values release their memory only in `release_dropped`.
#[derive(Default)]
struct DeferredCodec {
    inner: TestCodec,
    ledger: Arc<Ledger>,
}

impl DeferredCodec {
    fn value(&self, bytes: Vec<u8>) -> Deferred {
        self.ledger.live.fetch_add(bytes.len() as u64, Ordering::SeqCst);
        Deferred { bytes, ledger: self.ledger.clone() }
    }
}

impl spillway::Codec for DeferredCodec {
    type Value = Deferred;
    fn serialize(&self, v: &Deferred) -> Result<spillway::Frames, spillway::CodecError> {
        self.inner.serialize(&v.bytes)
    }
    fn deserialize(&self, f: spillway::Frames) -> Result<Deferred, spillway::CodecError> {
        Ok(self.value(self.inner.deserialize(f)?))
    }
    fn size_of(&self, v: &Deferred) -> u64 {
        self.inner.size_of(&v.bytes)
    }
    fn release_dropped(&self) {
        self.ledger.dropped.store(0, Ordering::SeqCst);
    }
}

#[test]
fn values_a_codec_releases_late_count_as_freed() {
    // The RSS after an eviction is read once the codec has released what the store dropped: read
    // before, the memory of the last values evicted would be learned as out of reach, and later
    // checks would stop spilling for RSS that spilling does bring down.
    let c = StoreConfig { eviction: EvictionPolicy::dask(), ..cfg(1 << 30) };
    let s = Arc::new(Store::open(DeferredCodec::default(), SimBackend::new(), "/s", c).unwrap());
    let ledger = s.codec().ledger.clone();
    let l = ledger.clone();
    s.set_rss_probe(Arc::new(move || {
        Some(90 * MIB + l.live.load(Ordering::SeqCst) + l.dropped.load(Ordering::SeqCst))
    }));
    s.set_process_target(Some(100 * MIB));
    for i in 0..30u8 {
        let v = s.codec().value(mib(i));
        s.put(&[i], v).unwrap();
    }
    assert_eq!(s.process_out_of_reach(), 0);
    assert!(s.memory_bytes() <= 10 * MIB + RSS_CHECK_BYTES, "{}", s.memory_bytes());
    for i in 0..30u8 {
        assert_eq!(s.get(&[i]).unwrap().unwrap().bytes, mib(i));
    }
    s.check_accounting().unwrap();
}

#[test]
fn deferred_puts_count_toward_the_process_check_that_enforce_target_makes() {
    let s = open();
    rss_tracking(&s, 90 * MIB);
    s.set_process_target(Some(100 * MIB));
    let mut due = 0;
    for i in 0..40u8 {
        due += s.put_deferred(&[i], mib(i)).unwrap().is_some() as usize;
    }
    // Far under the store's own target, but each MiB put makes a process check due; none ran.
    assert_eq!(due, 40);
    assert_eq!(on_disk(&s, 40), 0);
    s.enforce_target().unwrap();
    assert!(s.memory_bytes() <= 10 * MIB, "{}", s.memory_bytes());
    assert!(on_disk(&s, 40) >= 30, "{}", on_disk(&s, 40));
    assert_eq!(s.tier(&[39]), Some(Tier::Materialized));
    s.check_accounting().unwrap();
}
