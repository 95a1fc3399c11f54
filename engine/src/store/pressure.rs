//! Process memory: a store whose process holds other memory too (a dask worker's heap, the
//! allocator's arenas, values referenced elsewhere) also spills when the process's resident set is
//! above a threshold of its own ([`Store::set_process_trigger`]), down to a target
//! ([`Store::set_process_target`]): what dask's memory monitor does every 100 ms from its event
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
//!   released what the round dropped ([`Codec::release_dropped`]: Python frees an object dropped
//!   without the GIL only when a thread next takes it); read before, the last values evicted count as
//!   out of reach, and the process is left above its target by their weight.
//!
//! The settings and the state live outside the store's lock (std's atomics and mutex: they are
//! settings and a hint, not part of the store's shared state in the loom models, which leave the
//! process target off).

use std::sync::atomic::{AtomicU64 as StdAtomicU64, Ordering as StdOrdering};
use std::sync::Arc;
use std::sync::Mutex as StdMutex;

use crate::backend::Backend;

use super::{Codec, Store};

/// Bytes of memory weight brought in (put or read back) between two reads of the process's RSS (a
/// read, a `pread` of `/proc/self/statm`, costs about 2 µs).
pub const RSS_CHECK_BYTES: u64 = 1 << 20;

/// How a store reads its process's resident set size in bytes; `None` when it cannot. The default
/// reads `/proc/self/statm` ([`read_rss`]); an embedding may count memory its own way.
pub type RssProbe = Arc<dyn Fn() -> Option<u64> + Send + Sync>;

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

impl<C: Codec, B: Backend> Store<C, B> {
    /// Also evict when the process's RSS is above `bytes` (see the `pressure` notes in the store's
    /// docs); `None` (or 0) turns it off. Applies from the next put or read back.
    pub fn set_process_target(&self, bytes: Option<u64>) {
        self.process.target.store(bytes.unwrap_or(0), StdOrdering::Relaxed);
    }

    /// The process target, if one is set.
    pub fn process_target(&self) -> Option<u64> {
        Some(self.process.target.load(StdOrdering::Relaxed)).filter(|&t| t > 0)
    }

    /// Evict for process memory only once the RSS is above `bytes` (and then down to the process
    /// target), as dask's memory monitor starts at its `spill` threshold and stops below its
    /// `target`; `None` (or anything below the target): at the target itself.
    pub fn set_process_trigger(&self, bytes: Option<u64>) {
        self.process.trigger.store(bytes.unwrap_or(0), StdOrdering::Relaxed);
    }

    /// The RSS above which process memory is relieved: the trigger, at least the target; `None`
    /// without a process target.
    pub fn process_trigger(&self) -> Option<u64> {
        let goal = self.process_target()?;
        Some(self.process.trigger.load(StdOrdering::Relaxed).max(goal))
    }

    /// Read the process's RSS with `probe` instead of `/proc/self/statm`.
    pub fn set_rss_probe(&self, probe: RssProbe) {
        *self.process.probe.lock().unwrap_or_else(|p| p.into_inner()) = probe;
    }

    fn rss_probe(&self) -> RssProbe {
        self.process.probe.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// How many bytes the process may still grow by before it is above the trigger, the RSS read
    /// now (less what was learned out of reach); `None` without a target or an RSS. For deciding
    /// where data about to arrive should go.
    pub fn process_headroom(&self) -> Option<u64> {
        let trigger = self.process_trigger()?;
        let rss = self.rss_probe()()?;
        let reach = self.process.out_of_reach.load(StdOrdering::Relaxed);
        Some((trigger + reach).saturating_sub(rss))
    }

    /// RSS above what spilling brought down, learned so far (see the `pressure` notes).
    pub fn process_out_of_reach(&self) -> u64 {
        self.process.out_of_reach.load(StdOrdering::Relaxed)
    }

    /// After a put or a get that brought `added` bytes of weight into memory: evict for the
    /// process's memory if it is above the trigger, down to the process target (sparing `spare`).
    /// Never fails: a spill that does not happen is reported as any other.
    pub(super) fn relieve_process_memory(&self, spare: Option<&[u8]>, added: u64) {
        let (Some(goal), Some(trigger)) = (self.process_target(), self.process_trigger()) else { return };
        if self.process.added.fetch_add(added, StdOrdering::Relaxed) + added < RSS_CHECK_BYTES {
            return;
        }
        let Ok(_checking) = self.process.checking.try_lock() else { return };
        self.process.added.store(0, StdOrdering::Relaxed);
        let probe = self.rss_probe();
        let Some(rss) = probe() else { return };
        let over = rss.saturating_sub(goal);
        let reach = self.process.out_of_reach.load(StdOrdering::Relaxed).min(over);
        let excess = if rss - reach > trigger { over - reach } else { 0 };
        if excess > 0 {
            let freed = self.evict_bytes(excess, spare).unwrap_or(0);
            if freed > 0 {
                self.codec.release_dropped();
                let fell = probe().map_or(0, |now| rss.saturating_sub(now));
                if fell < freed / 2 {
                    let learned = (reach + freed - fell).min(goal / 4);
                    self.process.out_of_reach.store(learned, StdOrdering::Relaxed);
                    return;
                }
            }
        }
        self.process.out_of_reach.store(reach, StdOrdering::Relaxed);
    }
}
