//! Process memory: a store whose process holds other memory too (a dask worker's heap, the
//! allocator's arenas, values referenced elsewhere) also spills when the process's resident set is
//! above a threshold of its own (`Store::set_process_trigger`), down to a target
//! (`Store::set_process_target`): what dask's memory monitor does every 100 ms from its event
//! loop (above the `spill` fraction of the memory limit, down to the `target` fraction), done here
//! as memory grows.
//!
//! * After a put, or a get that brought a value into memory, the RSS is read once per
//!   [`RSS_CHECK_BYTES`] of weight brought in (puts and reads back, whatever was removed meanwhile: a
//!   worker whose tasks put outputs as fast as they release inputs keeps the same weight while its
//!   RSS grows); above the trigger, least-recently-used values are evicted (sparing the key just put
//!   or read) until their weight covers the excess over the target.
//! * Memory that spilling does not give back to the system is learned as *out of reach*: a round that
//!   evicted W bytes of weight while the RSS fell by less than W/2 adds the difference, and later
//!   checks evict only for the RSS above it (it shrinks again as the RSS falls, and never exceeds a
//!   quarter of the target). Without this, a process whose RSS stays high whatever is spilled spills
//!   and reads back everything over and over. The RSS after a round is read once the codec has
//!   released what the round dropped (`Codec::release_dropped`: Python frees an object dropped
//!   without the GIL only when a thread next takes it); read before, the last values evicted count as
//!   out of reach, and the process is left above its target by their weight.
//!
//! The settings and the state live outside the store's lock (std's atomics and mutex: they are
//! settings and a hint, not part of the store's shared state in the loom models, which leave the
//! process target off).

use std::sync::atomic::{AtomicU64 as StdAtomicU64, Ordering as StdOrdering};
use std::sync::Arc;
use std::sync::Mutex as StdMutex;

/// Bytes of memory weight brought in (put or read back) between two reads of the process's RSS (a
/// read, a `pread` of `/proc/self/statm`, costs about 2 µs).
pub const RSS_CHECK_BYTES: u64 = 1 << 20;

/// How a store reads its process's resident set size in bytes; `None` when it cannot. The default
/// reads `/proc/self/statm` ([`read_rss`]); an embedding may count memory its own way.
pub type RssProbe = Arc<dyn Fn() -> Option<u64> + Send + Sync>;

/// The process-memory relief: its settings, what it learned, and the check's state.
pub(super) struct ProcessMemory {
    /// The process target in bytes; 0 when off.
    target: StdAtomicU64,
    /// The RSS above which to evict (down to the target); 0: the target itself.
    trigger: StdAtomicU64,
    /// RSS above the target that spilling did not bring down (see the module's notes).
    out_of_reach: StdAtomicU64,
    /// How the RSS is read (held only to clone it).
    probe: StdMutex<RssProbe>,
    /// Weight brought in since the RSS was last read.
    added: StdAtomicU64,
    /// Held by the thread checking. Taken with `try_lock` after a put or a get (a thread already
    /// checking covers the others), never while the store's lock is held.
    checking: StdMutex<()>,
}

impl Default for ProcessMemory {
    fn default() -> Self {
        let probe: RssProbe = Arc::new(read_rss);
        ProcessMemory {
            target: StdAtomicU64::new(0),
            trigger: StdAtomicU64::new(0),
            out_of_reach: StdAtomicU64::new(0),
            probe: StdMutex::new(probe),
            added: StdAtomicU64::new(0),
            checking: StdMutex::new(()),
        }
    }
}

/// This process's resident set size in bytes (what dask's memory monitor and nanny watch), from
/// `/proc/self/statm`; `None` where there is none.
pub fn read_rss() -> Option<u64> {
    use std::os::unix::fs::FileExt;
    static STATM: std::sync::OnceLock<Option<std::fs::File>> = std::sync::OnceLock::new();
    let file = STATM.get_or_init(|| std::fs::File::open("/proc/self/statm").ok()).as_ref()?;
    let mut buf = [0u8; 128];
    let n = file.read_at(&mut buf, 0).ok()?;
    let pages: u64 = std::str::from_utf8(&buf[..n]).ok()?.split_ascii_whitespace().nth(1)?.parse().ok()?;
    Some(pages * rustix::param::page_size() as u64)
}

impl ProcessMemory {
    /// Evict also when the RSS is above `bytes`; `None` (or 0) turns it off.
    pub(super) fn set_target(&self, bytes: Option<u64>) {
        self.target.store(bytes.unwrap_or(0), StdOrdering::Relaxed);
    }

    /// The process target, if one is set.
    pub(super) fn target(&self) -> Option<u64> {
        Some(self.target.load(StdOrdering::Relaxed)).filter(|&t| t > 0)
    }

    /// Evict only once the RSS is above `bytes` (then down to the target); `None`: at the target.
    pub(super) fn set_trigger(&self, bytes: Option<u64>) {
        self.trigger.store(bytes.unwrap_or(0), StdOrdering::Relaxed);
    }

    /// The RSS above which memory is relieved: the trigger, at least the target; `None` without a
    /// target.
    pub(super) fn trigger(&self) -> Option<u64> {
        let goal = self.target()?;
        Some(self.trigger.load(StdOrdering::Relaxed).max(goal))
    }

    pub(super) fn set_probe(&self, probe: RssProbe) {
        *self.probe.lock().unwrap_or_else(|p| p.into_inner()) = probe;
    }

    fn probe(&self) -> RssProbe {
        self.probe.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many bytes the process may still grow by before it is above the trigger, the RSS read
    /// now (less what was learned out of reach); `None` without a target or an RSS.
    pub(super) fn headroom(&self) -> Option<u64> {
        let trigger = self.trigger()?;
        let rss = self.probe()()?;
        let reach = self.out_of_reach.load(StdOrdering::Relaxed);
        Some((trigger + reach).saturating_sub(rss))
    }

    /// RSS above what spilling brought down, learned so far.
    pub(super) fn out_of_reach(&self) -> u64 {
        self.out_of_reach.load(StdOrdering::Relaxed)
    }

    /// Count `added` bytes of weight brought into memory toward the next check without checking
    /// now (a deferred put: `relieve` runs later, on the thread that spills for it). Whether a check
    /// is due.
    pub(super) fn note_added(&self, added: u64) -> bool {
        if self.target().is_none() || self.trigger().is_none() {
            return false;
        }
        self.added.fetch_add(added, StdOrdering::Relaxed) + added >= RSS_CHECK_BYTES
    }

    /// After `added` bytes of weight were brought into memory: if the RSS is above the trigger,
    /// `evict(excess)` evicts that much weight and returns what it freed, then `release_dropped()`
    /// lets the codec give back what the eviction dropped before the RSS is read again (to learn
    /// what is out of reach). At most one thread checks at a time; the others go on.
    pub(super) fn relieve(&self, added: u64, evict: impl FnOnce(u64) -> u64, release_dropped: impl FnOnce()) {
        let (Some(goal), Some(trigger)) = (self.target(), self.trigger()) else { return };
        if self.added.fetch_add(added, StdOrdering::Relaxed) + added < RSS_CHECK_BYTES {
            return;
        }
        let Ok(_checking) = self.checking.try_lock() else { return };
        self.added.store(0, StdOrdering::Relaxed);
        let probe = self.probe();
        let Some(rss) = probe() else { return };
        let over = rss.saturating_sub(goal);
        let reach = self.out_of_reach.load(StdOrdering::Relaxed).min(over);
        let excess = if rss - reach > trigger { over - reach } else { 0 };
        if excess > 0 {
            let freed = evict(excess);
            if freed > 0 {
                release_dropped();
                let fell = probe().map_or(0, |now| rss.saturating_sub(now));
                if fell < freed / 2 {
                    let learned = (reach + freed - fell).min(goal / 4);
                    self.out_of_reach.store(learned, StdOrdering::Relaxed);
                    return;
                }
            }
        }
        self.out_of_reach.store(reach, StdOrdering::Relaxed);
    }
}
