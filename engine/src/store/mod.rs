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
//! it (objects serialized, values written, see `evict::spill`), and settled under it again.
//! Materialization happens in the per-key `Slot`, whose ready path is lock-free.
//!
//! ## Where each rule lives
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | [`Store`], the [`Codec`] trait, the state under the lock (`Inner`), opening, lookups |
//! | `config.rs` | [`StoreConfig`], [`EvictionPolicy`] |
//! | `entry.rs` | entries, [`Tier`]s, the entry table (`Table`): the only writer of the totals and the LRU order |
//! | `remove.rs` | removing a key's entry and record; dropping a record nobody wants |
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
use crate::error::{Error, Result};
use crate::log::SegmentLog;
// Locks, counters and the values' `Arc` come from the sync shim, so the loom models in `loom-tests/`
// run this code as it is (keys and slots are plain `Arc`s: only their contents are shared state).
use self::entry::{Entry, Table};
use self::metrics::Metrics;
use self::receive::Transfers;
use self::writes::Writes;
use crate::stored::StreamedValue;
use crate::sync::{self, Condvar, Mutex, MutexGuard};
use crate::value::Frames;

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
mod remove;
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

/// The error of a read whose record was removed from the log after the reader looked the key up (a
/// racing `remove`); readers then start over, so callers never see it.
pub(super) fn vanished(key: &[u8]) -> Error {
    Error::Vanished { key: key_str(key) }
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
            // (`large` by the record's length: its serialized size plus a header, close enough to
            // keep a value heavier than the target on disk when it is read, as it was before the
            // reopen)
            let e = Entry::on_disk(0, (len, len), len > cfg.target_bytes);
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

    /// Store a materialized value. If it is heavier than the target it is serialized and written to disk
    /// at once; a serialize failure then fails this call and the key is forgotten.
    pub fn put(&self, key: &[u8], value: C::Value) -> Result<()> {
        put::put(self, key, value)
    }

    /// Store a materialized value as [`Store::put`] does, without evicting for it: returns the
    /// memory not already being written if it is over the target or the process's memory is due a
    /// check, which [`Store::enforce_target`] (on a thread that may wait for the writes) then
    /// does; else None. A value heavier than the target is still written at once.
    pub fn put_deferred(&self, key: &[u8], value: C::Value) -> Result<Option<u64>> {
        put::put_deferred(self, key, value)
    }

    /// [`Store::put_serialized`] without evicting for it, as [`Store::put_deferred`].
    pub fn put_serialized_deferred(&self, key: &[u8], frames: Frames) -> Result<Option<u64>> {
        put::put_serialized_deferred(self, key, frames)
    }

    /// Evict down to the target and relieve the process's memory, as a put does after storing its
    /// value.
    pub fn enforce_target(&self) -> Result<()> {
        put::enforce_target(self)
    }

    /// Store serialized frames (data from a peer or from disk): they stay serialized until a `get`.
    pub fn put_serialized(&self, key: &[u8], frames: Frames) -> Result<()> {
        put::put_serialized(self, key, frames)
    }

    /// Store frames straight on disk, whatever their size (as a value heavier than the target goes):
    /// for data passing through that should not take memory.
    pub fn put_serialized_on_disk(&self, key: &[u8], frames: Frames) -> Result<()> {
        put::put_serialized_on_disk(self, key, frames)
    }

    /// Delete `key` from every tier. Returns whether it existed.
    pub fn remove(&self, key: &[u8]) -> Result<bool> {
        put::remove(self, key)
    }

    /// The materialized value of `key`, deserializing it (exactly once, whatever the concurrency) if it
    /// is held serialized. A value read back from disk is promoted to memory unless it is heavier than
    /// the target.
    ///
    /// A get that races a `remove` (or a new `put`) of the key returns the old value, `None` or the new
    /// value, never an error caused by the race: if reading fails and the entry it was reading has been
    /// removed or replaced meanwhile, the get starts over.
    pub fn get(&self, key: &[u8]) -> Result<Option<sync::Arc<C::Value>>> {
        get::get(self, key)
    }

    /// The value of `key` without changing anything: no promotion, no LRU move, no metrics of a
    /// memory read. For inspection (dask's `fast`/`slow` views): a value held serialized or on disk
    /// is deserialized for this caller alone (an evicted object still alive elsewhere is returned
    /// as it is), outside the key's slot, so a concurrent `get` may deserialize it too.
    pub fn peek(&self, key: &[u8]) -> Result<Option<sync::Arc<C::Value>>> {
        get::peek(self, key)
    }

    /// The values of `keys`, in order, as [`Store::get`] would return them one by one (the same
    /// single deserialize, the same promotion). Where reads wait for the device
    /// ([`Backend::pipelines_reads`]: io_uring with O_DIRECT), the values on disk are read together,
    /// up to [`GET_MANY_DEPTH`] in flight ([`SegmentLog::get_pipelined`]), in batches of
    /// [`GET_MANY_BATCH`] keys: 3.4x the rate of single gets for 4 KiB values here. Otherwise it is
    /// the gets one after another, which is faster for reads served from the page cache. For a task
    /// that needs many inputs, or a peer asking for many keys. Each key gets its own result, so one
    /// damaged record does not hide the others.
    pub fn get_many(&self, keys: &[&[u8]]) -> Vec<Result<Option<sync::Arc<C::Value>>>> {
        get::get_many(self, keys)
    }

    /// The serialized frames of `key`, never deserializing: for data that is only passing through (to a
    /// peer). A materialized value is serialized (its object stays); a value on disk is read and, unless
    /// heavier than the target or [`EvictionPolicy::serialized_reads_promote`] is off, promoted to
    /// the serialized tier.
    pub fn get_serialized(&self, key: &[u8]) -> Result<Option<Frames>> {
        get::get_serialized(self, key)
    }

    /// [`Store::get_serialized`] that moves the value as a [`Store::get`] would, whatever the
    /// policy: to the end of the LRU order, and, from disk, back into memory (as its frames, not
    /// deserialized) unless it is heavier than the target, others being evicted for it. For a
    /// caller that stands in for a get (dask's `get_data` reads `data[key]`, which unspills).
    pub fn get_serialized_promoting(&self, key: &[u8]) -> Result<Option<Frames>> {
        get::get_serialized_promoting(self, key)
    }

    /// The async form of [`Store::get`], over the same slots: the same value, the same single
    /// deserialize shared with concurrent sync and async callers. A disk read runs as a future (on
    /// io_uring the driver thread does it and the calling task is not blocked). Then the polling thread
    /// deserializes, because that is CPU work. If another caller is deserializing the same value at that
    /// moment, the polling thread waits for it rather than deserializing twice. Dropping the future
    /// part-way is safe: the backend keeps the read's buffer until the kernel is done with it, and
    /// nothing of the store changes until the read has completed.
    pub async fn get_async(&self, key: &[u8]) -> Result<Option<sync::Arc<C::Value>>> {
        get::get_async(self, key).await
    }

    /// The async form of [`Store::get_serialized`]: a disk read runs as a future; nothing is
    /// deserialized. Dropping the future part-way is safe (see [`Store::get_async`]).
    pub async fn get_serialized_async(&self, key: &[u8]) -> Result<Option<Frames>> {
        get::get_serialized_async(self, key).await
    }

    /// Take in a value arriving in stored form (from a peer, a file: `meta` announces it, `src`
    /// yields its stored bytes). One that fits under `target_bytes` is kept in memory, serialized
    /// (deserialized only when a task asks for it), as `put_serialized` would keep it; one that does
    /// not is written straight into the log without being held in memory ([`Store::put_stream`]).
    /// In memory, the bytes arrive without the store's lock, with the key held as being received (a
    /// second transfer of it, or a direct write, waits; `flush` does not); its old value stays
    /// readable meanwhile. A `put` or `remove` of the key while the bytes arrive wins: the received
    /// value is dropped, and `Ok(false)` says so (`Ok(true)`: the value is now the key's). On any
    /// failure nothing is stored and the key's old value, if any, stays.
    pub fn receive(&self, key: &[u8], meta: &StreamedValue, src: &mut dyn std::io::Read) -> Result<bool> {
        receive::receive(self, key, meta, src)
    }

    /// Store a value arriving from a peer (`src`, in the stored form `meta` announces) straight into
    /// the log, never holding it in memory: for a receiver over its target. The value is then on
    /// disk, like a spilled one. When `max_spill` refuses it, it is received into memory instead
    /// (serialized). The bytes arrive without the store's lock held (other operations go on); nothing
    /// of the value is visible until it arrived whole and verified. The old value of `key`, if any,
    /// stays the key's, readable where it is (it is neither spilled nor promoted meanwhile), until
    /// the new one replaces it; it stays if the transfer fails. If a `put` of the same key lands
    /// during the transfer, or a `remove`, the newer operation wins: the streamed record is dropped
    /// and `Ok(false)` says so (`Ok(true)`: the value is now the key's). In a persistent store that
    /// drop (a tombstone over the streamed record) is written when the transfer ends.
    pub fn put_stream(&self, key: &[u8], meta: &StreamedValue, src: &mut dyn std::io::Read) -> Result<bool> {
        receive::put_stream(self, key, meta, src)
    }

    /// Whether a value of `nbytes` (its frames' total) arriving from a peer is to be kept in memory,
    /// serialized: it fits under the target with what the store holds in memory and what it
    /// admitted before and is still arriving or waiting to be stored, and under the process's
    /// headroom ([`Store::process_headroom`]) with what it admitted. If so, its bytes count as
    /// admitted until [`Store::release_admitted`] (once it is stored, or let go of); if not, it is
    /// to go straight to disk ([`Store::put_stream`]), never held in memory.
    pub fn admit(&self, nbytes: u64) -> bool {
        receive::admit(self, nbytes)
    }

    /// `nbytes` admitted by [`Store::admit`] are stored now, or let go of.
    pub fn release_admitted(&self, nbytes: u64) {
        receive::release_admitted(self, nbytes)
    }

    /// Spill the least-recently-used memory-resident entry to disk (for a worker's memory monitor).
    /// Returns the memory weight freed; 0 when nothing could be evicted. Never fails for a spill
    /// problem (the entry then stays in memory and the condition is reported).
    pub fn evict(&self) -> Result<u64> {
        evict::evict(self)
    }

    /// Evict least-recently-used values, whatever the target, until `bytes` of memory weight have
    /// been planned out (or nothing more can go): for a process whose memory is above its own limit
    /// while the store is under its target (dask's memory monitor evicts until the process is back
    /// under it). `spare` (the key just put or read) is passed over. Returns the weight evicted; a
    /// value whose spill fails stays in memory, reported as any failed spill, and is counted in
    /// neither.
    pub fn evict_bytes(&self, bytes: u64, spare: Option<&[u8]>) -> Result<u64> {
        evict::evict_bytes(self, bytes, spare)
    }

    /// [`Store::evict`], telling "nothing was evicted" (`None`: nothing in memory could go, or its
    /// spill failed) from the eviction of a value that weighs nothing (`Some(0)`).
    pub fn evict_one(&self) -> Result<Option<u64>> {
        evict::evict_one(self)
    }

    /// The spills that did not happen since the last call (with `StoreConfig::report_failures`),
    /// oldest first. Cheap when there are none.
    pub fn take_failures(&self) -> Vec<SpillFailure> {
        evict::take_failures(self)
    }

    /// Make everything spilled so far durable (fdatasync of the log), spill writes in flight
    /// included (they are waited for; writes that start meanwhile are not).
    ///
    /// A persistent store first writes a disk copy of every value it holds only in memory when the
    /// call begins, and keeps the value in memory (its later eviction then costs no write; a value
    /// heavier than the target goes to the disk tier), so that once `flush` returns its contents as
    /// of the call survive a crash and reopen; without a flush, only what was spilled does. Values
    /// that cannot be written (`max_spill` reached, a full disk, a serialize failure) stay in memory,
    /// readable, and `flush` then fails with [`Error::NotPersisted`] after syncing the rest. It ends
    /// by enforcing the memory target (values kept above it can now be dropped for free).
    pub fn flush(&self) -> Result<()> {
        persist::flush(self)
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

    /// The backend of each of this store's logs, the first (in the store's directory) first and
    /// the one spills go to last: a [`SimBackend`](crate::SimBackend) under a test takes its
    /// faults here. Writing through one writes around the store.
    pub fn backends(&self) -> Vec<&B> {
        self.logs.all().map(|l| l.backend()).collect()
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
        self.lock().table.totals().mem_bytes()
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
            Tier::Compressed => e.compressed.as_ref().map(|c| c.raw_len()),
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
    /// order and the logs' indexes. `Err` names the first difference. For tests and debugging: it
    /// walks every entry under the store's lock.
    pub fn check_accounting(&self) -> std::result::Result<(), String> {
        check::check_accounting(&self.lock(), &self.logs)
    }

    /// Threads waiting in `key`'s slot for another thread's materialization of its value (a
    /// diagnostic: how many `get`s of `key` wait on one deserialization now).
    pub fn waiters(&self, key: &[u8]) -> u32 {
        let slot = self.lock().table.get(key).map(|e| e.slot.clone());
        slot.map_or(0, |s| s.waiters())
    }

    /// Entries in memory and on disk.
    pub fn counts(&self) -> (u64, u64) {
        let inner = self.lock();
        let disk = inner.table.totals().tier_count(Tier::Disk);
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
