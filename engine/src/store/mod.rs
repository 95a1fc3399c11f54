//! The three-tier store: materialized objects, serialized frames in memory (optionally lz4), and
//! records in the segment log on disk. Data that arrives serialized stays serialized until a task asks
//! for the object; then it is deserialized exactly once (see `crate::slot`).
//!
//! ## Tiers and weights
//! * **materialized**: an `Arc<V>`, weight `codec.size_of(v)` (an estimate, as dask's `sizeof`);
//! * **serialized**: frames in memory, weight = their exact byte length;
//! * **compressed**: one lz4 block of the frames (with `compress_in_memory`), weight = its length;
//! * **disk**: a record in the segment log; no memory weight (the value's weight is kept, as the
//!   spilled weight: dask's `spilled_total.memory`).
//!
//! Above `target_bytes`, least-recently-used entries are demoted object -> serialized (-> compressed)
//! -> disk (or object -> disk in one round under [`EvictionPolicy::dask`]), on the calling thread,
//! before `put` returns: a producer pays for the eviction it causes
//! (dask measured that spilling asynchronously without back-pressure made workers reach their pause
//! threshold sooner). Only values the disk refuses (`max_spill` reached, a full or failed disk, a
//! serialize failure) stay above the target; they are retried when this store frees disk space
//! (a removed or replaced spilled value) or when one of them is read. A value heavier than the target goes
//! straight to disk and is served from there without being promoted (a read back is judged by the
//! weight of the object it deserializes to).
//!
//! ## Failures
//! `max_spill` full, a serialize failure or a disk failure while evicting *another* key keep that key
//! in memory (logged, counted in the metrics) and never fail the caller: "Spill file on disk reached
//! capacity" and "Spill to disk failed" at most every 10 s each, a serialize failure once per entry. A serialize failure of the
//! key being inserted fails that `put` and the store forgets the key. Nothing is dropped silently.
//!
//! ## Locking
//! One mutex guards the key map, the LRU order and the accounting; it is held for lookups, LRU updates
//! and eviction decisions, and never during disk I/O, (de)serialization or (de)compression. An
//! eviction round is planned under the lock (its keys marked as being written), carried out without
//! it (objects serialized, values written, see `Store::spill`), and settled under it again.
//! Materialization happens in the per-key `Slot`, whose ready path is lock-free.
//!
//! ## Where each rule lives
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | [`Store`], the [`Codec`] trait, the state under the lock (`Inner`), opening, lookups |
//! | `config.rs` | [`StoreConfig`], [`EvictionPolicy`] |
//! | `entry.rs` | entries, [`Tier`]s, the entry table (`Table`): the only writer of the totals and the LRU order |
//! | `put.rs` | `put`, `put_serialized`, `remove`, heavy values straight to disk |
//! | `evict.rs` | eviction rounds: plan, write, settle; `max_spill`, stuck entries |
//! | `receive.rs` | [`Store::receive`] and `put_stream`: values arriving in stored form; the transfers in progress (`Transfers`) |
//! | `get.rs` | `get`, `get_many`, `get_async`, `get_serialized`; deserialize once |
//! | `writes.rs` | the spill writes in flight: one per key, tickets for `flush`, the bytes they reserve |
//! | `persist.rs` | `flush` of a persistent store |
//! | `logs.rs` | the log spills go to, and a fresh one after a failed write left it read-only |
//! | `pressure.rs` | the process target: eviction when the process's RSS is above it, memory out of reach |
//! | `metrics.rs` | [`Activity`] counters and [`MetricsSnapshot`] |
//! | `check.rs` | `check_accounting`: the table's own check, the writes in flight and the log |

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::backend::{Backend, PortableBackend};
use crate::error::Result;
use crate::log::SegmentLog;
use crate::slot::Slot;
// Locks, counters and the values' `Arc` come from the sync shim, so the loom models in `loom-tests/`
// run this code as it is (keys and slots are plain `Arc`s: only their contents are shared state).
use self::entry::{Entry, Table};
use self::metrics::Metrics;
use self::receive::Transfers;
use self::writes::Writes;
use crate::sync::{self, Condvar, Mutex, MutexGuard};
use crate::value::Frames;

#[cfg(feature = "testing")]
mod check;
mod config;
mod entry;
mod evict;
mod get;
mod logs;
mod metrics;
mod persist;
mod pressure;
mod put;
mod receive;
mod writes;

pub use self::config::{EvictionPolicy, StoreConfig, SPILL_WRITE_BEHIND_BYTES};
pub use self::entry::Tier;
pub use self::evict::{SpillFailure, SpillFailureKind, MAX_REPORTED_FAILURES};
pub use self::get::{GET_MANY_BATCH, GET_MANY_DEPTH};
pub use self::logs::MAX_FRESH_LOGS;
pub use self::metrics::{take_thread_metrics, Activity, ActivityStats, MetricsSnapshot};
pub use self::pressure::{read_rss, RssProbe, RSS_CHECK_BYTES};

/// One of a store's segment logs, as [`Store::log_info`] describes it.
#[derive(Debug, Clone)]
pub struct LogInfo {
    /// Its directory.
    pub dir: std::path::PathBuf,
    /// Why it refuses writes (an earlier write or fdatasync failed), if it does.
    pub read_only: Option<String>,
    /// Records it holds: values on disk, and the copies that values read back keep.
    pub records: usize,
}

/// A codec's error.
pub type CodecError = Box<dyn std::error::Error + Send + Sync>;

/// How values cross the engine boundary.
pub trait Codec: Send + Sync + 'static {
    /// The materialized type.
    type Value: Send + Sync + 'static;
    /// Serialize a value into frames (a small header plus large buffers, kept apart). A panic here is
    /// caught and handled as a serialize error: it often runs while evicting some other caller's
    /// value, and must not leave that eviction half done.
    fn serialize(&self, value: &Self::Value) -> std::result::Result<Frames, CodecError>;
    /// Rebuild a value from frames; the frames' buffers may be kept without copying.
    fn deserialize(&self, frames: Frames) -> std::result::Result<Self::Value, CodecError>;
    /// [`Codec::deserialize`] of frames that nothing else holds (read from disk, or decompressed, for
    /// this call): the value may be built on their memory and change it in place, where frames held
    /// in the store must first be copied by a codec whose values are mutable (a numpy array).
    /// Default: `deserialize`.
    fn deserialize_owned(&self, frames: Frames) -> std::result::Result<Self::Value, CodecError> {
        self.deserialize(frames)
    }
    /// Memory weight of a materialized value in bytes.
    fn size_of(&self, value: &Self::Value) -> u64;
    /// Whether [`Codec::keep_weak`] may give handles: when false (the default) the store takes none
    /// and an eviction that only drops objects (their disk copies are current) stays under its lock.
    const KEEPS_WEAK: bool = false;

    /// A weak handle on `value`, taken (without the store's lock) when the store evicts it: a later
    /// get of the key that finds the value still alive elsewhere returns it without reading or
    /// deserializing, as dask's store does with Python weak references. Default: none.
    fn keep_weak(&self, _value: &sync::Arc<Self::Value>) -> Option<Revive<Self::Value>> {
        None
    }

    /// Release now the values (and frames) the store has dropped, where the codec's runtime defers
    /// that: a Python object dropped without the GIL is freed only when some thread next takes it.
    /// Called before the store measures what an eviction gave back to the system (the process
    /// target's RSS check), which would otherwise miss the last values evicted. Default: nothing
    /// (Rust values are freed when dropped).
    fn release_dropped(&self) {}
}

/// A way back to a value the store let go of while something else may still hold it (see
/// [`Codec::keep_weak`]): `None` once it is gone.
pub type Revive<V> = Arc<dyn Fn() -> Option<sync::Arc<V>> + Send + Sync>;

/// The three-tier store. All methods take `&self`; share it across threads with an `Arc`.
pub struct Store<C: Codec, B: Backend = PortableBackend> {
    codec: C,
    /// The log spills go to, and the read-only ones failed writes left (`logs.rs`).
    logs: logs::Logs<B>,
    cfg: StoreConfig,
    inner: Mutex<Inner<C::Value>>,
    /// Signalled (with `inner`) whenever a spill write lands.
    written: Condvar,
    /// `Inner::failures` is not empty (read without the lock by `take_failures`). A hint, not a
    /// synchronization (the list itself is read under the lock): std's atomic, outside the loom
    /// models' state.
    failures_pending: std::sync::atomic::AtomicBool,
    /// The memory target (`StoreConfig::target_bytes` at open; [`Store::set_target`]): a setting,
    /// read relaxed, std's atomic like `failures_pending`.
    target: std::sync::atomic::AtomicU64,
    /// The process target and what was learned of the process's memory (`pressure.rs`).
    process: pressure::ProcessMemory,
    metrics: Metrics,
}

/// The store's state under its lock: the entries and their accounting ([`Table`]), the spill writes
/// and transfers in flight, and the failures to report.
struct Inner<V> {
    table: Table<V>,
    /// When "reached capacity" (max_spill) and "Spill to disk failed" were last logged: each is
    /// logged at most every [`LOG_EVERY`], independently of the other.
    logged_full: Option<Instant>,
    logged_disk: Option<Instant>,
    /// The spill writes running outside the lock (`writes.rs`): eviction skips their keys, a
    /// direct write of one (`put_large`, `put_stream`) waits, and `flush` waits for those older
    /// than itself.
    writes: Writes,
    /// The transfers in progress and the bytes admitted into memory (`receive.rs`).
    transfers: Transfers,
    /// Gets answered with an object in memory: (count, weight), part of `Activity::MemoryRead`.
    object_reads: (u64, u64),
    /// A spill failed since the current eviction began ([`EvictionPolicy::failed_spill_ends_round`]).
    round_failed: bool,
    /// Spills that did not happen, for [`Store::take_failures`] (with `StoreConfig::report_failures`).
    failures: Vec<SpillFailure>,
}

/// "Reached capacity" and "Spill to disk failed" are each logged at most this often (as the Python
/// `SpillBuffer` does).
const LOG_EVERY: std::time::Duration = std::time::Duration::from_secs(10);

/// Whether a rate-limited message last logged at `last` is due again; if so, `last` becomes now.
fn log_due(last: &mut Option<Instant>) -> bool {
    if last.is_some_and(|t| t.elapsed() < LOG_EVERY) {
        return false;
    }
    *last = Some(Instant::now());
    true
}

/// The text of a panic's payload, if it has one.
fn panic_message(payload: &(dyn std::any::Any + Send)) -> &str {
    match payload.downcast_ref::<&'static str>() {
        Some(s) => s,
        None => payload.downcast_ref::<String>().map_or("(no message)", |s| s.as_str()),
    }
}

fn key_str(k: &[u8]) -> String {
    String::from_utf8_lossy(k).into_owned()
}

impl<C: Codec, B: Backend> Store<C, B> {
    /// Open a store in `dir`. A persistent store (`cfg.persistent`) finds the records already in
    /// the log as disk-tier entries; a spill store (the default) discards them and starts empty. A
    /// spill store's log never fsyncs (`cfg.log.durable` is ignored), and releases a removed value's
    /// blocks at once (see [`StoreConfig::log_options`]).
    pub fn open(codec: C, backend: B, dir: impl AsRef<Path>, cfg: StoreConfig) -> Result<Self> {
        let log_opts = cfg.log_options();
        let log = SegmentLog::open(backend, dir.as_ref(), log_opts.clone())?;
        let mut inner = Inner {
            table: Table::default(),
            logged_full: None,
            logged_disk: None,
            writes: Writes::default(),
            transfers: Transfers::default(),
            round_failed: false,
            object_reads: (0, 0),
            failures: Vec::new(),
        };
        for k in log.keys() {
            let len = log.location(&k).map_or(0, |l| l.len);
            let mut e = Entry::new(Slot::new(), Tier::Disk, 0);
            e.disk_raw = len;
            e.disk_bytes = len;
            // (the record's length: its serialized size plus a header, close enough to keep a value
            // heavier than the target on disk when it is read, as it was before the reopen)
            e.large = len > cfg.target_bytes;
            inner.table.insert(Arc::from(k.as_slice()), e);
        }
        let target = std::sync::atomic::AtomicU64::new(cfg.target_bytes);
        let fresh_logs = if cfg.persistent { 0 } else { cfg.fresh_logs };
        Ok(Store {
            codec,
            logs: logs::Logs::new(log, dir.as_ref().to_path_buf(), log_opts, fresh_logs),
            cfg,
            inner: Mutex::new(inner),
            written: Condvar::new(),
            failures_pending: std::sync::atomic::AtomicBool::new(false),
            target,
            process: pressure::ProcessMemory::default(),
            metrics: Metrics::default(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner<C::Value>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The segment log spills go to now (the first, unless a failed write left it read-only and
    /// the store opened a fresh one: see [`StoreConfig::fresh_logs`]). With the `testing` feature
    /// only: a caller that wrote to it would write around the store's accounting.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn log(&self) -> &SegmentLog<B> {
        self.logs.current()
    }

    /// Every log of this store (`testing` only, as [`Store::log`]).
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn logs(&self) -> Vec<&SegmentLog<B>> {
        self.all_logs()
    }

    /// The log that holds `key`'s record, if it has one (`testing` only, as [`Store::log`]).
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn log_of(&self, key: &[u8]) -> Option<&SegmentLog<B>> {
        self.log_holding_key(key)
    }

    /// Every log of this store, the first (in the store's directory) first and the one spills go to
    /// last; the others are read-only and serve the records they still hold.
    pub(crate) fn all_logs(&self) -> Vec<&SegmentLog<B>> {
        self.logs.all().collect()
    }

    /// The log that holds `key`'s record, if it has one.
    pub(crate) fn log_holding_key(&self, key: &[u8]) -> Option<&SegmentLog<B>> {
        self.logs.of(key).filter(|l| l.location(key).is_some())
    }

    /// The log spills go to now.
    pub(crate) fn current_log(&self) -> &SegmentLog<B> {
        self.logs.current()
    }

    /// Write back what the log spills go to holds in memory, and fdatasync it (a persistent store's
    /// `flush` does this for every value; this is for a spill store whose files someone else reads).
    pub fn sync(&self) -> Result<()> {
        self.logs.current().sync()
    }

    /// The store's logs, the first (in the store's directory) first and the one spills go to last:
    /// the others are read-only and serve the records they still hold.
    pub fn log_info(&self) -> Vec<LogInfo> {
        self.logs
            .all()
            .map(|l| LogInfo {
                dir: l.dir().to_path_buf(),
                read_only: l.poisoned().map(str::to_string),
                records: l.len(),
            })
            .collect()
    }

    /// Why the log spills go to refuses writes (an earlier write or fdatasync failed), if it does;
    /// a spill store then writes to a fresh log ([`StoreConfig::fresh_logs`]) while it may.
    pub fn read_only(&self) -> Option<String> {
        self.logs.current().poisoned().map(|e| e.to_string())
    }

    /// The codec.
    pub fn codec(&self) -> &C {
        &self.codec
    }

    /// The configuration.
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    /// Whether `key` is stored (in any tier).
    pub fn contains(&self, key: &[u8]) -> bool {
        self.lock().table.contains(key)
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.lock().table.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All keys (unordered).
    pub fn keys(&self) -> Vec<Vec<u8>> {
        self.lock().table.iter().map(|(k, _)| k.to_vec()).collect()
    }

    /// The tier `key` is in.
    pub fn tier(&self, key: &[u8]) -> Option<Tier> {
        self.lock().table.get(key).map(|e| e.tier)
    }

    /// Total memory weight.
    pub fn memory_bytes(&self) -> u64 {
        self.lock().table.totals().mem_bytes
    }

    /// The memory target now.
    pub fn target(&self) -> u64 {
        self.target.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Change the memory target. Nothing is evicted now: the next put or promotion evicts down to
    /// it (as dask's store does when its `target` is changed); a value's being heavier than the
    /// target is judged when it arrives.
    pub fn set_target(&self, bytes: u64) {
        self.target.store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Also evict when the process's RSS is above `bytes` (see the `pressure` notes in the store's
    /// docs); `None` (or 0) turns it off. Applies from the next put or read back.
    pub fn set_process_target(&self, bytes: Option<u64>) {
        self.process.set_target(bytes);
    }

    /// The process target, if one is set.
    pub fn process_target(&self) -> Option<u64> {
        self.process.target()
    }

    /// Evict for process memory only once the RSS is above `bytes` (and then down to the process
    /// target), as dask's memory monitor starts at its `spill` threshold and stops below its
    /// `target`; `None` (or anything below the target): at the target itself.
    pub fn set_process_trigger(&self, bytes: Option<u64>) {
        self.process.set_trigger(bytes);
    }

    /// The RSS above which process memory is relieved: the trigger, at least the target; `None`
    /// without a process target.
    pub fn process_trigger(&self) -> Option<u64> {
        self.process.trigger()
    }

    /// Read the process's RSS with `probe` instead of `/proc/self/statm`.
    pub fn set_rss_probe(&self, probe: RssProbe) {
        self.process.set_probe(probe);
    }

    /// How many bytes the process may still grow by before it is above the trigger, the RSS read
    /// now (less what was learned out of reach); `None` without a target or an RSS. For deciding
    /// where data about to arrive should go.
    pub fn process_headroom(&self) -> Option<u64> {
        self.process.headroom()
    }

    /// RSS above what spilling brought down, learned so far (see the `pressure` notes).
    pub fn process_out_of_reach(&self) -> u64 {
        self.process.out_of_reach()
    }

    /// After a put or a get that brought `added` bytes of weight into memory: evict for the
    /// process's memory if it is above the trigger, down to the process target (sparing `spare`).
    /// Never fails: a spill that does not happen is reported as any other.
    fn relieve_process_memory(&self, spare: Option<&[u8]>, added: u64) {
        let evict = |excess| self.evict_bytes(excess, spare).unwrap_or(0);
        self.process.relieve(added, evict, || self.codec.release_dropped());
    }

    /// Keys in memory (any in-memory tier) and keys on disk, each in the order they entered that
    /// place (as dask's store iterates `fast` and `slow`: a key set, or read back, enters memory
    /// last; reading a key in memory does not move it here, only in the LRU order).
    pub fn keys_by_place(&self) -> (Vec<Vec<u8>>, Vec<Vec<u8>>) {
        let mut stamped = {
            let inner = self.lock();
            let mut all: Vec<(bool, u64, Vec<u8>)> = Vec::with_capacity(inner.table.len());
            for (k, e) in inner.table.iter() {
                all.push((e.tier == Tier::Disk, e.placed, k.to_vec()));
            }
            all
        };
        stamped.sort_unstable_by_key(|(on_disk, placed, _)| (*on_disk, *placed));
        let split = stamped.partition_point(|(on_disk, _, _)| !on_disk);
        let disk = stamped.split_off(split);
        let keys = |v: Vec<(bool, u64, Vec<u8>)>| v.into_iter().map(|(_, _, k)| k).collect();
        (keys(stamped), keys(disk))
    }

    /// The serialized bytes of `key`'s value if it is on disk (what a peer is sent), else `None`.
    pub fn spilled_bytes(&self, key: &[u8]) -> Option<u64> {
        self.lock().table.get(key).filter(|e| e.tier == Tier::Disk).map(|e| e.disk_raw)
    }

    /// The serialized length of `key`'s value where the store holds it serialized (frames in
    /// memory, an lz4 block, a record on disk); `None` for an object or an absent key.
    pub fn stored_len(&self, key: &[u8]) -> Option<u64> {
        let inner = self.lock();
        let e = inner.table.get(key)?;
        match e.tier {
            Tier::Disk => Some(e.disk_raw),
            Tier::Serialized => e.frames.as_ref().map(|f| f.total_len()),
            Tier::Compressed => e.compressed.as_ref().map(|c| c.raw_len),
            Tier::Materialized => None,
        }
    }

    /// A snapshot of the metrics and the current accounting. The accounting is read under the
    /// store's lock and is consistent; the activity counters are read one after another while other
    /// threads may be bumping them, so two counters of one snapshot need not be from the same instant.
    pub fn metrics(&self) -> MetricsSnapshot {
        let inner = self.lock();
        self.metrics.snapshot(inner.table.totals(), inner.object_reads)
    }

    /// Recompute the accounting from the entries and compare it with the running totals, the LRU
    /// order and the log's index. `Err` names the first difference. For tests and debugging: it
    /// walks every entry under the store's lock.
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn check_accounting(&self) -> std::result::Result<(), String> {
        check::check_accounting(&self.lock(), &self.logs)
    }

    /// Threads waiting in `key`'s slot for another thread's materialization of its value (`testing`
    /// only).
    #[cfg(feature = "testing")]
    #[doc(hidden)]
    pub fn waiters(&self, key: &[u8]) -> u32 {
        let slot = self.lock().table.get(key).map(|e| e.slot.clone());
        slot.map_or(0, |s| s.waiters())
    }

    /// Entries in memory and on disk.
    pub fn counts(&self) -> (u64, u64) {
        let inner = self.lock();
        let disk = inner.table.totals().tier_count[Tier::Disk.idx()];
        (inner.table.len() as u64 - disk, disk)
    }
}

#[cfg(test)]
mod tests {
    use self::entry::Entry;
    use super::*;
    use bytes::Bytes;

    /// A store's memory per key is mostly its map bucket (key handle and entry), one per key of
    /// every tier, so a million spilled keys cost a million of them: keep it within 104 bytes (it
    /// would be 160 with the compressed block inline).
    #[test]
    fn entries_stay_small() {
        let bucket = std::mem::size_of::<(Arc<[u8]>, Entry<Bytes>)>();
        assert!(bucket <= 104, "a map bucket takes {bucket} bytes");
    }
}
