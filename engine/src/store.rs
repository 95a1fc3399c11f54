//! The three-tier store: materialized objects, serialized frames in memory (optionally lz4), and
//! records in the segment log on disk. Data that arrives serialized stays serialized until a task asks
//! for the object; then it is deserialized exactly once (see [`crate::slot`]).
//!
//! ## Tiers and weights
//! * **materialized**: an `Arc<V>`, weight `codec.size_of(v)` (an estimate, as dask's `sizeof`);
//! * **serialized**: frames in memory, weight = their exact byte length;
//! * **compressed**: one lz4 block of the frames (with `compress_in_memory`), weight = its length;
//! * **disk**: a record in the segment log, weight 0.
//!
//! Above `target_bytes`, least-recently-used entries are demoted object -> serialized (-> compressed)
//! -> disk, on the calling thread, before `put` returns: a producer pays for the eviction it causes
//! (dask measured that spilling asynchronously without back-pressure made workers reach their pause
//! threshold sooner). Only values the disk refuses (`max_spill` reached, a full or failed disk, a
//! serialize failure) stay above the target; they are retried when this store frees disk space
//! (a removed or replaced spilled value) or when one of them is read. A value heavier than the target goes
//! straight to disk and is served from there without being promoted.
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
//! Materialization happens in the per-key [`Slot`], whose ready path is lock-free.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use crate::backend::{Backend, PortableBackend};
use crate::buf::AlignedBuf;
use crate::error::{Error, Result};
use crate::format;
use crate::key::{KeyMap, KeySet};
use crate::log::{LogOptions, SegmentLog, StreamedValue};
use crate::slot::Slot;
// Locks, counters and the values' `Arc` come from the sync shim, so the loom models in `loom-tests/`
// run this code as it is (keys and slots are plain `Arc`s: only their contents are shared state).
use crate::sync::{self, AtomicU64, Condvar, Mutex, MutexGuard, Ordering};
use crate::value::Frames;

/// Entries looked at per eviction round.
const EVICT_SCAN: usize = 256;
/// Eviction rounds (each with its spill write) one call to `enforce` runs at most.
const ENFORCE_ROUNDS: usize = 16;
/// Passes of a persistent store's `flush` (write a disk copy of everything, wait for the writes)
/// while values are left in memory without their disk copy.
const FLUSH_PASSES: usize = 4;
/// At most this much below the target is evicted at once (batches spill writes).
const EVICT_SLACK_BYTES: u64 = 4 << 20;

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
    /// Memory weight of a materialized value in bytes.
    fn size_of(&self, value: &Self::Value) -> u64;
}

/// Store configuration.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Memory weight above which least-recently-used entries are demoted.
    pub target_bytes: u64,
    /// Most bytes of spilled data on disk; `None` for no limit.
    pub max_spill_bytes: Option<u64>,
    /// Keep demoted values lz4-compressed in memory before spilling them to disk.
    pub compress_in_memory: bool,
    /// fdatasync after every spill batch (otherwise only `flush` syncs).
    pub sync_spills: bool,
    /// The segment log's options (segment size, on-disk compression, ...). The default defers
    /// [`SPILL_WRITE_BEHIND_BYTES`] of small spill batches ([`LogOptions::write_behind_bytes`]);
    /// a persistent store never defers writes.
    pub log: LogOptions,
    /// Keep the contents across reopen: what was spilled, and after [`Store::flush`] everything
    /// (values held only in memory are not written until they are evicted or flushed). When false
    /// (a worker's spill store, whose data dies with it), records left by an earlier process are
    /// discarded at open and removals write no tombstones.
    pub persistent: bool,
}

/// Default write-behind budget of a spill store's log ([`LogOptions::write_behind_bytes`]). Small
/// spill batches (a low target evicts a few values at a time) are written together, 2 MiB at a
/// time: fewer writes, and the page cache keeps what they wrote in large folios, which later reads
/// copy out faster (a 4 KiB get 4.0-4.4 -> 3.5 µs, a 64 KiB get 10.7-11.1 -> 8.6 µs with a 256 KiB
/// target; `docs/benchmarks.md`). The pending bytes live in the log's tail, outside the store's
/// memory accounting, and read back from there.
pub const SPILL_WRITE_BEHIND_BYTES: u64 = 2 << 20;

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            target_bytes: 1 << 30,
            max_spill_bytes: None,
            compress_in_memory: false,
            sync_spills: false,
            log: LogOptions { write_behind_bytes: SPILL_WRITE_BEHIND_BYTES, ..LogOptions::default() },
            persistent: false,
        }
    }
}

/// Where an entry's value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Materialized object.
    Materialized,
    /// Serialized frames in memory.
    Serialized,
    /// lz4-compressed frames in memory.
    Compressed,
    /// A record in the segment log.
    Disk,
}

const TIERS: [Tier; 4] = [Tier::Materialized, Tier::Serialized, Tier::Compressed, Tier::Disk];

impl Tier {
    fn idx(self) -> usize {
        self as usize
    }
    /// Lower-case name (metrics labels).
    pub fn name(self) -> &'static str {
        match self {
            Tier::Materialized => "materialized",
            Tier::Serialized => "serialized",
            Tier::Compressed => "compressed",
            Tier::Disk => "disk",
        }
    }
}

#[derive(Clone)]
struct Compressed {
    block: Bytes,
    frame_lens: Vec<u64>,
    raw_len: u64,
}

struct Entry<V> {
    slot: Arc<Slot<V, Error>>,
    tier: Tier,
    frames: Option<Frames>,
    /// Boxed: rarely present, and inline it would make every entry of the store's map 56 bytes
    /// larger (see `entries_stay_small`).
    compressed: Option<Box<Compressed>>,
    /// Memory weight currently accounted for this entry.
    weight: u64,
    /// Serialized size of the value's copy on disk (for `spilled_total`), 0 when it has none. A value
    /// read back from disk keeps its disk copy (same bytes), so evicting it again costs no write.
    disk_raw: u64,
    /// Bytes the log holds for it (record length), 0 otherwise.
    disk_bytes: u64,
    /// LRU position (memory-resident entries only).
    tick: u64,
    /// Heavier than the target on arrival: lives on disk, served without promotion.
    large: bool,
    /// Eviction of this entry failed (max_spill, serialize or disk error): skip it until things change.
    stuck: bool,
    /// Its serialize failure was logged (once per entry, as dask logs a pickle error once per key).
    logged_serialize: bool,
}

impl<V> Entry<V> {
    fn new(slot: Slot<V, Error>, tier: Tier, weight: u64) -> Self {
        Entry {
            slot: Arc::new(slot),
            tier,
            frames: None,
            compressed: None,
            weight,
            disk_raw: 0,
            disk_bytes: 0,
            tick: 0,
            large: false,
            stuck: false,
            logged_serialize: false,
        }
    }

    fn serialized(frames: Frames, large: bool) -> Self {
        let mut e = Self::new(Slot::new(), Tier::Serialized, frames.total_len());
        e.frames = Some(frames);
        e.large = large;
        e
    }
}

struct Inner<V> {
    map: KeyMap<Arc<[u8]>, Entry<V>>,
    lru: BTreeMap<u64, Arc<[u8]>>,
    next_tick: u64,
    mem_bytes: u64,
    tier_bytes: [u64; 4],
    tier_count: [u64; 4],
    disk_bytes: u64,
    disk_raw: u64,
    /// When "reached capacity" (max_spill) and "Spill to disk failed" were last logged: each is
    /// logged at most every [`LOG_EVERY`], independently of the other.
    logged_full: Option<Instant>,
    logged_disk: Option<Instant>,
    /// Keys marked stuck since the last `unstick` (some may have been unstuck since; removed keys
    /// leave it). A stuck entry is out of the LRU order, so eviction does not walk past it again
    /// and again.
    stuck: KeySet<Arc<[u8]>>,
    /// Keys whose spill write runs right now, outside the lock. A key is in at most one write at a
    /// time: eviction skips these keys, and a direct write of one (`put_large`, `put_stream`) waits.
    /// Each write has a ticket (from `next_write`): `flush` waits for the writes older than itself.
    writing: KeyMap<Arc<[u8]>, u64>,
    next_write: u64,
    /// Keys whose new value is arriving from a peer into memory (`receive_serialized`): a direct
    /// write of the key, or a second transfer, waits as for `writing`; `flush` does not.
    receiving: KeySet<Arc<[u8]>>,
    /// Memory weight and serialized bytes of the entries in those writes, as planned. The weight
    /// still counts in `mem_bytes` (the bytes are still in memory) until the write lands.
    writing_weight: u64,
    writing_raw: u64,
    /// Keys a `put_stream` is receiving right now (absent from `map` meanwhile).
    streams: KeyMap<Arc<[u8]>, Stream>,
}

/// A `put_stream` in progress.
struct Stream {
    /// A put or remove of the key came after the transfer started: it wins over the transfer.
    superseded: bool,
    /// The key had a value when the transfer started (set aside meanwhile).
    has_old: bool,
    /// Memory weight and spilled bytes of that value, still counted in `mem_bytes` and
    /// `disk_raw` (it may come back).
    aside_weight: u64,
    aside_raw: u64,
}

impl<V> Inner<V> {
    fn account(&mut self, e: &Entry<V>, sign: i64) {
        self.account_acct(Acct::of(e), sign);
    }

    fn account_acct(&mut self, e: Acct, sign: i64) {
        let t = e.tier.idx();
        let apply = |x: &mut u64, d: u64| {
            if sign > 0 {
                *x += d
            } else {
                *x -= d
            }
        };
        apply(&mut self.tier_count[t], 1);
        apply(&mut self.tier_bytes[t], if e.tier == Tier::Disk { e.disk_bytes } else { e.weight });
        apply(&mut self.mem_bytes, e.weight);
        apply(&mut self.disk_bytes, e.disk_bytes);
        apply(&mut self.disk_raw, e.disk_raw);
    }
}

/// What the accounting and the LRU order know of an entry.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Acct {
    tier: Tier,
    tick: u64,
    weight: u64,
    disk_bytes: u64,
    disk_raw: u64,
    stuck: bool,
}

impl Acct {
    fn of<V>(e: &Entry<V>) -> Acct {
        Acct {
            tier: e.tier,
            tick: e.tick,
            weight: e.weight,
            disk_bytes: e.disk_bytes,
            disk_raw: e.disk_raw,
            stuck: e.stuck,
        }
    }
    fn in_lru(&self) -> bool {
        self.tier != Tier::Disk && !self.stuck
    }
}

/// Count, bytes and time of one activity.
#[derive(Debug, Default)]
struct Activity {
    count: AtomicU64,
    bytes: AtomicU64,
    ns: AtomicU64,
}

impl Activity {
    fn add(&self, bytes: u64, since: Instant) {
        self.count.fetch_add(1, Ordering::Relaxed);
        self.bytes.fetch_add(bytes, Ordering::Relaxed);
        self.ns.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
    fn snap(&self) -> ActivityStats {
        ActivityStats {
            count: self.count.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            ns: self.ns.load(Ordering::Relaxed),
        }
    }
}

const ACTIVITIES: [&str; 7] =
    ["serialize", "compress", "disk-write", "disk-read", "decompress", "deserialize", "memory-read"];

#[derive(Debug, Default)]
struct Metrics {
    acts: [Activity; 7],
    max_spill_refusals: AtomicU64,
    spill_failures: AtomicU64,
}

const SERIALIZE: usize = 0;
const COMPRESS: usize = 1;
const DISK_WRITE: usize = 2;
const DISK_READ: usize = 3;
const DECOMPRESS: usize = 4;
const DESERIALIZE: usize = 5;
const MEMORY_READ: usize = 6;

/// Count, bytes and nanoseconds of one activity.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ActivityStats {
    /// Times it happened.
    pub count: u64,
    /// Bytes it processed (serialized size).
    pub bytes: u64,
    /// Nanoseconds spent.
    pub ns: u64,
}

/// A snapshot of the store's metrics.
#[derive(Debug, Clone, Default)]
pub struct MetricsSnapshot {
    /// Per activity (`serialize`, `compress`, `disk-write`, `disk-read`, `decompress`, `deserialize`,
    /// `memory-read`).
    pub activities: Vec<(&'static str, ActivityStats)>,
    /// Memory weight per tier (disk: bytes of records).
    pub tier_bytes: Vec<(&'static str, u64)>,
    /// Entries per tier.
    pub tier_entries: Vec<(&'static str, u64)>,
    /// Total memory weight.
    pub memory_bytes: u64,
    /// Serialized size of what is on disk.
    pub spilled_memory_bytes: u64,
    /// Bytes on disk for what is spilled.
    pub spilled_disk_bytes: u64,
    /// Spills refused because `max_spill_bytes` would be exceeded.
    pub max_spill_refusals: u64,
    /// Evictions that failed (serialize or disk error) and kept the value in memory.
    pub spill_failures: u64,
}

impl MetricsSnapshot {
    /// The activity with this name.
    pub fn activity(&self, name: &str) -> ActivityStats {
        self.activities.iter().find(|(n, _)| *n == name).map(|(_, a)| *a).unwrap_or_default()
    }

    /// Prometheus text exposition, with dask's metric names where they exist.
    pub fn prometheus(&self) -> String {
        let mut s = String::new();
        s.push_str(
            "# HELP spillway_spill_count_total Operations per activity.\n# TYPE spillway_spill_count_total counter\n",
        );
        for (n, a) in &self.activities {
            s.push_str(&format!("spillway_spill_count_total{{activity=\"{n}\"}} {}\n", a.count));
        }
        s.push_str(
            "# HELP spillway_spill_bytes_total Bytes per activity.\n# TYPE spillway_spill_bytes_total counter\n",
        );
        for (n, a) in &self.activities {
            s.push_str(&format!("spillway_spill_bytes_total{{activity=\"{n}\"}} {}\n", a.bytes));
        }
        s.push_str("# HELP spillway_spill_time_seconds_total Seconds per activity.\n# TYPE spillway_spill_time_seconds_total counter\n");
        for (n, a) in &self.activities {
            s.push_str(&format!("spillway_spill_time_seconds_total{{activity=\"{n}\"}} {:.9}\n", a.ns as f64 / 1e9));
        }
        s.push_str("# HELP spillway_memory_bytes Memory weight per tier.\n# TYPE spillway_memory_bytes gauge\n");
        for (n, b) in &self.tier_bytes {
            s.push_str(&format!("spillway_memory_bytes{{tier=\"{n}\"}} {b}\n"));
        }
        s.push_str("# HELP spillway_entries Entries per tier.\n# TYPE spillway_entries gauge\n");
        for (n, c) in &self.tier_entries {
            s.push_str(&format!("spillway_entries{{tier=\"{n}\"}} {c}\n"));
        }
        s.push_str(&format!(
            "# TYPE spillway_spilled_bytes gauge\nspillway_spilled_bytes{{kind=\"memory\"}} {}\nspillway_spilled_bytes{{kind=\"disk\"}} {}\n",
            self.spilled_memory_bytes, self.spilled_disk_bytes
        ));
        s.push_str(&format!(
            "# TYPE spillway_max_spill_refusals_total counter\nspillway_max_spill_refusals_total {}\n",
            self.max_spill_refusals
        ));
        s.push_str(&format!(
            "# TYPE spillway_spill_failures_total counter\nspillway_spill_failures_total {}\n",
            self.spill_failures
        ));
        s
    }
}

/// The error of a read whose record was removed from the log after the reader looked the key up (a
/// racing `remove`); readers then start over, so callers never see it.
fn vanished(key: &[u8]) -> Error {
    Error::Corrupt {
        segment: 0,
        offset: 0,
        reason: format!("{:?} vanished from the log while being read", key_str(key)),
    }
}

/// How a get goes on after looking the key up.
enum GetStart<V> {
    /// Answered under the lock: the ready value, or `None` for an absent key.
    Done(Option<sync::Arc<V>>),
    /// Materialize through `slot` from `source`.
    Read { key: Arc<[u8]>, slot: Arc<Slot<V, Error>>, source: Source },
}

/// How a `get_serialized` goes on after looking the key up.
enum SerStart<V> {
    /// Answered under the lock (`None`: absent key).
    Done(Option<Frames>),
    /// A materialized value without frames: serialize it, outside the lock.
    Object(Arc<[u8]>, sync::Arc<V>),
    /// Read from `source`.
    Read { key: Arc<[u8]>, slot: Arc<Slot<V, Error>>, source: Source, large: bool },
}

/// Where a reader finds the bytes of a non-materialized entry.
enum Source {
    Frames(Frames),
    Compressed(Box<Compressed>),
    Disk,
}

/// Reads in flight at once in [`Store::get_many`] (on io_uring).
pub const GET_MANY_DEPTH: usize = 32;
/// Keys per batch of [`Store::get_many`]: what is read before being materialized.
pub const GET_MANY_BATCH: usize = 4 * GET_MANY_DEPTH;

/// The three-tier store. All methods take `&self`; share it across threads with an `Arc`.
pub struct Store<C: Codec, B: Backend = PortableBackend> {
    codec: C,
    log: SegmentLog<B>,
    cfg: StoreConfig,
    inner: Mutex<Inner<C::Value>>,
    /// Signalled (with `inner`) whenever a spill write lands.
    written: Condvar,
    metrics: Metrics,
}

/// An object to demote to serialized form, planned under the store's lock and serialized without it
/// (the object stays readable in its slot meanwhile).
struct Demotion<V> {
    key: Arc<[u8]>,
    value: sync::Arc<V>,
    /// Identifies the entry, as in [`Planned`].
    slot: Arc<Slot<V, Error>>,
    weight: u64,
    /// The entry's LRU tick when planned: a get meanwhile makes it recent, and it is not demoted.
    tick: u64,
}

/// What one eviction round leaves to do without the store's lock.
struct Plan<V> {
    writes: Vec<Planned<V>>,
    demotions: Vec<Demotion<V>>,
}

impl<V> Plan<V> {
    fn is_empty(&self) -> bool {
        self.writes.is_empty() && self.demotions.is_empty()
    }
}

/// A key a persistent store's `flush` is to write: the key, the slot that identifies its entry (a
/// `remove` or a new `put` replaces it), and whether that is still the entry the flush listed when
/// it began (what it promises to make durable).
type Listed<V> = (Arc<[u8]>, Arc<Slot<V, Error>>, bool);

/// What is left to do once each key of a written batch is settled (see `Store::end_settle`).
struct Settled<'r> {
    /// The write's result.
    result: &'r Result<()>,
    /// The batch's first key, to report a failure that followed a write that landed.
    first: Option<&'r Arc<[u8]>>,
    /// Some record landed.
    landed: bool,
    /// Space reserved against max_spill was given back.
    freed: bool,
    /// Keys to mark stuck.
    stuck: Vec<Arc<[u8]>>,
    /// Keys whose new record nobody wants (removed or replaced meanwhile).
    stale: Vec<Arc<[u8]>>,
    /// The write's panic, to go on with.
    panicked: Option<Box<dyn std::any::Any + Send>>,
}

/// One value of a spill batch, planned under the store's lock and written without it.
struct Planned<V> {
    key: Arc<[u8]>,
    /// The value's frames, or its compressed block (decompressed without the lock, for the write).
    data: Source,
    /// Serialized length (what the write puts on disk before any on-disk compression).
    raw: u64,
    /// Identifies the entry that was planned: a `remove` or a new `put` meanwhile replaces it.
    slot: Arc<Slot<V, Error>>,
    weight: u64,
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

fn compress(frames: &Frames) -> Compressed {
    // The same layout as on disk: each frame at a 64-byte boundary, so decompressed frames come back
    // aligned like frames read from a segment.
    let lens: Vec<u64> = frames.iter().map(|f| f.len() as u64).collect();
    let (_, raw_len) = format::frame_layout(lens.iter().copied()).expect("in-memory frames fit in u64");
    let mut joined = vec![0u8; raw_len as usize];
    format::lay_out_frames(&mut joined, frames.iter().map(|f| &f[..]));
    Compressed { block: Bytes::from(lz4_flex::block::compress(&joined)), frame_lens: lens, raw_len }
}

fn decompress(c: &Compressed) -> Result<Frames> {
    let mut out = AlignedBuf::zeroed(c.raw_len as usize, format::FRAME_ALIGN as usize);
    match lz4_flex::block::decompress_into(&c.block, &mut out) {
        Ok(n) if n as u64 == c.raw_len => {}
        _ => return Err(Error::InvalidConfig("in-memory lz4 block does not decompress".into())),
    }
    let data = out.freeze();
    let (offsets, _) = format::frame_layout(c.frame_lens.iter().copied()).expect("laid out when compressed");
    Ok(Frames(c.frame_lens.iter().zip(offsets).map(|(&l, at)| data.slice(at as usize..(at + l) as usize)).collect()))
}

impl<C: Codec, B: Backend> Store<C, B> {
    /// Open a store in `dir`. A persistent store (`cfg.persistent`) finds the records already in
    /// the log as disk-tier entries; a spill store (the default) discards them and starts empty. A
    /// spill store's log never fsyncs (`cfg.log.durable` is ignored), and releases a removed value's
    /// blocks at once.
    pub fn open(codec: C, backend: B, dir: impl AsRef<Path>, cfg: StoreConfig) -> Result<Self> {
        // A spill store's data dies with the process: the log need not fsync on its own.
        // It also starts empty (`discard_existing`) and releases a removed value's blocks at once
        // (`punch_forgotten`), as unlinking a file per key would.
        let log_opts = LogOptions {
            durable: cfg.log.durable && cfg.persistent,
            punch_forgotten: cfg.log.punch_forgotten || !cfg.persistent,
            discard_existing: cfg.log.discard_existing || !cfg.persistent,
            // A put into a persistent store is in the file when it returns (a process crash keeps it).
            write_behind_bytes: if cfg.persistent { 0 } else { cfg.log.write_behind_bytes },
            ..cfg.log.clone()
        };
        let log = SegmentLog::open(backend, dir, log_opts)?;
        let mut inner = Inner {
            map: KeyMap::default(),
            lru: BTreeMap::new(),
            next_tick: 0,
            mem_bytes: 0,
            tier_bytes: [0; 4],
            tier_count: [0; 4],
            disk_bytes: 0,
            disk_raw: 0,
            logged_full: None,
            logged_disk: None,
            stuck: KeySet::default(),
            writing: KeyMap::default(),
            next_write: 0,
            receiving: KeySet::default(),
            writing_weight: 0,
            writing_raw: 0,
            streams: KeyMap::default(),
        };
        for k in log.keys() {
            let len = log.location(&k).map_or(0, |l| l.len);
            let mut e = Entry::new(Slot::new(), Tier::Disk, 0);
            e.disk_raw = len;
            e.disk_bytes = len;
            // (the record's length: its serialized size plus a header, close enough to keep a value
            // heavier than the target on disk when it is read, as it was before the reopen)
            e.large = len > cfg.target_bytes;
            inner.account(&e, 1);
            inner.map.insert(Arc::from(k.as_slice()), e);
        }
        Ok(Store { codec, log, cfg, inner: Mutex::new(inner), written: Condvar::new(), metrics: Metrics::default() })
    }

    fn lock(&self) -> MutexGuard<'_, Inner<C::Value>> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The underlying segment log.
    pub fn log(&self) -> &SegmentLog<B> {
        &self.log
    }

    /// The codec.
    pub fn codec(&self) -> &C {
        &self.codec
    }

    /// The configuration.
    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    fn touch(inner: &mut Inner<C::Value>, key: &Arc<[u8]>) {
        let tick = inner.next_tick;
        inner.next_tick += 1;
        let e = inner.map.get_mut(key).expect("touched key exists");
        if e.tier != Tier::Disk {
            let in_lru = Acct::of(e).in_lru();
            if in_lru {
                inner.lru.remove(&e.tick);
            }
            e.tick = tick;
            if in_lru {
                inner.lru.insert(tick, key.clone());
            }
        }
    }

    fn insert(&self, inner: &mut Inner<C::Value>, key: &[u8], mut e: Entry<C::Value>) -> Result<Arc<[u8]>> {
        if key.len() > crate::MAX_KEY_BYTES {
            return Err(Error::KeyTooLarge { len: key.len(), max: crate::MAX_KEY_BYTES });
        }
        self.drop_entry(inner, key)?;
        let k: Arc<[u8]> = Arc::from(key);
        if e.tier != Tier::Disk {
            e.tick = inner.next_tick;
            inner.next_tick += 1;
            if !e.stuck {
                inner.lru.insert(e.tick, k.clone());
            }
        }
        inner.account(&e, 1);
        inner.map.insert(k.clone(), e);
        Ok(k)
    }

    /// Remove `key`'s entry from memory and disk; returns whether it existed. If the log cannot drop
    /// the record (a persistent store's tombstone write failed), the entry stays as it was.
    fn drop_entry(&self, inner: &mut Inner<C::Value>, key: &[u8]) -> Result<bool> {
        // Every put and remove comes here. A transfer of the key in progress loses to it (once the
        // old record, if any, is dropped: a remove that fails changes nothing); the old value a
        // transfer set aside counts as existing.
        let supersede = |inner: &mut Inner<C::Value>| {
            inner.streams.get_mut(key).is_some_and(|s| !std::mem::replace(&mut s.superseded, true) && s.has_old)
        };
        let Some(disk_bytes) = inner.map.get(key).map(|e| e.disk_bytes) else { return Ok(supersede(inner)) };
        if disk_bytes > 0 {
            if self.cfg.persistent {
                self.log.delete(key)?;
            } else {
                self.log.forget(key)?;
            }
        }
        supersede(inner);
        Self::take_entry(inner, key);
        if disk_bytes > 0 {
            Self::unstick(inner);
        }
        Ok(true)
    }

    /// Take `key`'s entry out of the map, the accounting and the LRU order, leaving its record (if
    /// any) in the log.
    fn take_entry(inner: &mut Inner<C::Value>, key: &[u8]) -> Option<Entry<C::Value>> {
        let (_, e) = inner.map.remove_entry(key)?;
        inner.account(&e, -1);
        if Acct::of(&e).in_lru() {
            inner.lru.remove(&e.tick);
        }
        // Listed keys that are no longer stuck (a get promoted them) leave the list here too.
        if !inner.stuck.is_empty() {
            inner.stuck.remove(key);
        }
        Some(e)
    }

    /// Disk space was freed, or space reserved for a write was given back unused: retry the
    /// evictions that max_spill or a full disk refused.
    fn unstick(inner: &mut Inner<C::Value>) {
        for k in std::mem::take(&mut inner.stuck) {
            if inner.map.get(&k).is_some_and(|e| e.stuck) {
                Self::modify_entry(inner, &k, |e| e.stuck = false);
            }
        }
    }

    /// A spill of `key` was refused or failed: its entry stays in memory, out of the LRU order,
    /// until [`Self::unstick`].
    fn set_stuck(inner: &mut Inner<C::Value>, key: &Arc<[u8]>) {
        if inner.map.get(key).is_some_and(|e| !e.stuck) {
            Self::modify_entry(inner, key, |e| e.stuck = true);
            inner.stuck.insert(key.clone());
        }
    }

    /// Store a materialized value. If it is heavier than the target it is serialized and written to disk
    /// at once; a serialize failure then fails this call and the key is forgotten.
    pub fn put(&self, key: &[u8], value: C::Value) -> Result<()> {
        let weight = self.codec.size_of(&value);
        if weight > self.cfg.target_bytes {
            let frames = match self.serialize(key, &value) {
                Ok(f) => f,
                Err(e) => {
                    // As for a value that fails when its eviction serializes it: the key is forgotten,
                    // not left holding its previous value.
                    let mut inner = self.lock();
                    let _ = self.drop_entry(&mut inner, key);
                    return Err(e);
                }
            };
            return self.put_large(self.lock(), key, frames);
        }
        let mut inner = self.lock();
        let e = Entry::new(Slot::ready(sync::Arc::new(value)), Tier::Materialized, weight);
        let slot = e.slot.clone();
        self.insert(&mut inner, key, e)?;
        self.enforce(inner, Some(&slot))
    }

    /// Store serialized frames (data from a peer or from disk): they stay serialized until a `get`.
    pub fn put_serialized(&self, key: &[u8], frames: Frames) -> Result<()> {
        let mut inner = self.lock();
        if frames.total_len() > self.cfg.target_bytes {
            return self.put_large(inner, key, frames);
        }
        let e = Entry::serialized(frames, false);
        let slot = e.slot.clone();
        self.insert(&mut inner, key, e)?;
        self.enforce(inner, Some(&slot))
    }

    /// A value heavier than the target: straight to disk, written outside the lock like any spill
    /// (meanwhile it is served from memory). If it cannot be written (max_spill, disk error) it stays
    /// in memory, serialized, and the condition is reported.
    fn put_large<'a>(&'a self, inner: MutexGuard<'a, Inner<C::Value>>, key: &[u8], frames: Frames) -> Result<()> {
        let raw = frames.total_len();
        let mut inner = self.wait_unwritten(inner, key);
        let e = Entry::serialized(frames.clone(), true);
        let slot = e.slot.clone();
        let k = self.insert(&mut inner, key, e)?;
        if !self.spill_allowed(&mut inner, raw) {
            Self::set_stuck(&mut inner, &k);
            return Ok(());
        }
        let planned = Planned { key: k, data: Source::Frames(frames), raw, slot, weight: raw };
        Self::mark_writing(&mut inner, &planned);
        drop(self.spill(inner, Plan { writes: vec![planned], demotions: Vec::new() }, None));
        Ok(())
    }

    /// Wait (releasing the lock) until no spill write of `key` is running: a value written to the log
    /// directly must not race an older value's write of the same key.
    fn wait_unwritten<'a>(
        &'a self,
        mut inner: MutexGuard<'a, Inner<C::Value>>,
        key: &[u8],
    ) -> MutexGuard<'a, Inner<C::Value>> {
        while inner.writing.contains_key(key) || inner.receiving.contains(key) {
            inner = self.written.wait(inner).unwrap_or_else(|p| p.into_inner());
        }
        inner
    }

    /// `key` is being written (to the log, outside the store's lock) from now on.
    fn begin_write(inner: &mut Inner<C::Value>, key: Arc<[u8]>) {
        let ticket = inner.next_write;
        inner.next_write += 1;
        inner.writing.insert(key, ticket);
    }

    fn mark_writing(inner: &mut Inner<C::Value>, p: &Planned<C::Value>) {
        Self::begin_write(inner, p.key.clone());
        inner.writing_weight += p.weight;
        inner.writing_raw += p.raw;
    }

    /// Do a round's plan with the store's lock released: serialize (and compress) the objects to
    /// demote, write the planned batch. Then settle each entry under the lock again.
    ///
    /// Meanwhile gets read the values from memory (objects from their slots, frames from their
    /// entries), and eviction skips the keys. A written entry removed or replaced meanwhile leaves a
    /// record nobody wants, which is dropped from the log; one promoted by a get meanwhile stays in
    /// memory and keeps the record as its disk copy; one whose record did not land stays in memory,
    /// stuck, and the failure is reported. An object is demoted only if its entry is unchanged and
    /// was not read meanwhile; one that fails to serialize stays in memory, stuck and reported, unless
    /// it is `protect` (the value being put), whose key is then forgotten and the error returned.
    fn spill<'a>(
        &'a self,
        inner: MutexGuard<'a, Inner<C::Value>>,
        plan: Plan<C::Value>,
        protect: Option<&Arc<Slot<C::Value, Error>>>,
    ) -> (MutexGuard<'a, Inner<C::Value>>, Option<Error>) {
        drop(inner);
        let Plan { writes: batch, demotions } = plan;
        let serialized: Vec<Result<(Frames, Option<Compressed>)>> = demotions
            .iter()
            .map(|d| {
                let frames = self.serialize(&d.key, &d.value)?;
                let compressed = self.cfg.compress_in_memory.then(|| {
                    let t = Instant::now();
                    let c = compress(&frames);
                    self.metrics.acts[COMPRESS].add(frames.total_len(), t);
                    c
                });
                Ok((frames, compressed))
            })
            .collect();
        // A compressed value is written decompressed (the log compresses on its own if configured).
        // A value the log cannot store (too large, too many frames) fails alone, before the write:
        // in the batch it would fail every other value with it.
        let data: Vec<Result<Frames>> = batch
            .iter()
            .map(|p| {
                let f = match &p.data {
                    Source::Frames(f) => f.clone(),
                    Source::Compressed(c) => {
                        let t = Instant::now();
                        let f = decompress(c)?;
                        self.metrics.acts[DECOMPRESS].add(f.total_len(), t);
                        f
                    }
                    Source::Disk => unreachable!("only in-memory values are planned for writing"),
                };
                self.log.validate(&p.key, &f).map(|()| f)
            })
            .collect();
        let items: Vec<(&[u8], &Frames)> =
            batch.iter().zip(&data).filter_map(|(p, d)| d.as_ref().ok().map(|f| (&*p.key, f))).collect();
        let (result, panicked) = self.write_batch(&items);
        let mut inner = self.lock();
        let mut protect_failed = None;
        // Keys this round failed to spill: marked stuck at the end, after any unsticking.
        let mut stuck: Vec<Arc<[u8]>> = Vec::new();
        for (d, r) in demotions.into_iter().zip(serialized) {
            inner.writing.remove(&d.key);
            inner.writing_weight -= d.weight;
            let same = inner.map.get(&d.key).is_some_and(|e| Arc::ptr_eq(&e.slot, &d.slot));
            match r {
                Err(err) if protect.is_some_and(|p| Arc::ptr_eq(p, &d.slot)) => {
                    if same {
                        // In memory (no disk copy), so dropping it touches no log record.
                        let _ = self.drop_entry(&mut inner, &d.key);
                    }
                    protect_failed = Some(err);
                }
                Err(err) => {
                    if same {
                        self.metrics.spill_failures.fetch_add(1, Ordering::Relaxed);
                        let e = inner.map.get_mut(&d.key).expect("present");
                        if !std::mem::replace(&mut e.logged_serialize, true) {
                            log::error!("Failed to serialize {:?}; keeping it in memory: {err}", key_str(&d.key));
                        }
                        stuck.push(d.key.clone());
                    }
                }
                Ok((frames, compressed)) => {
                    let unchanged =
                        same && inner.map.get(&d.key).is_some_and(|e| e.tier == Tier::Materialized && e.tick == d.tick);
                    // `evict` fails if a reader is inside the slot's fast path this instant: skip.
                    if !unchanged || d.slot.evict().is_none() {
                        continue;
                    }
                    Self::modify_entry(&mut inner, &d.key, |ne| match compressed {
                        Some(c) => {
                            ne.weight = c.block.len() as u64;
                            ne.compressed = Some(Box::new(c));
                            ne.tier = Tier::Compressed;
                        }
                        None => {
                            ne.weight = frames.total_len();
                            ne.frames = Some(frames);
                            ne.tier = Tier::Serialized;
                        }
                    });
                }
            }
        }
        let mut freed = false;
        let mut landed = false;
        let mut stale: Vec<Arc<[u8]>> = Vec::new();
        for (p, d) in batch.iter().zip(&data) {
            let raw = p.raw;
            inner.writing.remove(&p.key);
            inner.writing_weight -= p.weight;
            inner.writing_raw -= raw;
            let ours = inner.map.get(&p.key).is_some_and(|e| Arc::ptr_eq(&e.slot, &p.slot));
            match (ours, self.log.location(&p.key)) {
                (true, Some(loc)) => {
                    Self::note_landed(&mut inner, &p.key, raw, loc.len, false);
                    landed = true;
                }
                (true, None) => {
                    let err = match d {
                        Err(e) => e.clone(),
                        Ok(_) => result.clone().err().unwrap_or_else(|| vanished(&p.key)),
                    };
                    self.spill_failed(&mut inner, &p.key, &err);
                    stuck.push(p.key.clone());
                }
                (false, Some(_)) => {
                    stale.push(p.key.clone());
                    freed = true;
                }
                (false, None) => freed |= result.is_ok(),
            }
        }
        let first = batch.first().map(|p| &p.key);
        let inner = self.end_settle(inner, Settled { result: &result, first, landed, freed, stuck, stale, panicked });
        (inner, protect_failed)
    }

    /// A record of `key` (`raw` serialized bytes, `len` in the log) landed: the entry gets its disk
    /// copy, and a serialized or compressed entry moves to the disk tier: every such entry for a
    /// spill, only one heavier than the target (which lives on disk) with `only_large`, for a flush.
    fn note_landed(inner: &mut Inner<C::Value>, key: &Arc<[u8]>, raw: u64, len: u64, only_large: bool) {
        Self::modify_entry(inner, key, |ne| {
            if (ne.large || !only_large) && matches!(ne.tier, Tier::Serialized | Tier::Compressed) {
                ne.tier = Tier::Disk;
                ne.frames = None;
                ne.compressed = None;
                ne.weight = 0;
            }
            ne.disk_raw = raw;
            ne.disk_bytes = len;
        });
    }

    /// Write a batch (spill or flush) with the store's lock released. A panic in the write (a bug in
    /// a backend) must not leave the batch's keys marked as being written: their puts and `flush`
    /// would wait for them forever. So it becomes an I/O error for the batch, which then settles as
    /// a failed write, and the panic is handed back to go on after that ([`Self::end_settle`]).
    fn write_batch(&self, items: &[(&[u8], &Frames)]) -> (Result<()>, Option<Box<dyn std::any::Any + Send>>) {
        if items.is_empty() {
            return (Ok(()), None);
        }
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.write_disk(items))) {
            Ok(r) => (r, None),
            Err(p) => {
                let msg = format!("the write panicked: {}", panic_message(&*p));
                (Err(Error::io("spill write", None, std::io::Error::other(msg))), Some(p))
            }
        }
    }

    /// The end of settling a written batch, once each key is settled (`spill`, `persist_round`).
    fn end_settle<'a>(
        &'a self,
        mut inner: MutexGuard<'a, Inner<C::Value>>,
        s: Settled<'_>,
    ) -> MutexGuard<'a, Inner<C::Value>> {
        if let (Err(e), true, Some(key)) = (s.result, s.landed, s.first) {
            // The records were written (and stay readable), but what followed failed: the sync of
            // `sync_spills`. Reported like any failed spill.
            self.spill_failed(&mut inner, key, e);
        }
        if s.freed {
            // Space reserved against max_spill for a record nobody wants any more is free again.
            Self::unstick(&mut inner);
        }
        for k in s.stuck {
            Self::set_stuck(&mut inner, &k);
        }
        self.written.notify_all();
        // Last, with every key of the batch settled and its waiters woken: dropping a record writes
        // a tombstone in a persistent store, a backend write that may fail (or panic) on its own.
        // Still under the lock, so that no new record of the key can be written before the drop.
        for k in s.stale {
            self.drop_stale_record(&k);
        }
        if let Some(p) = s.panicked {
            drop(inner);
            std::panic::resume_unwind(p);
        }
        inner
    }

    /// Store a value arriving from a peer (`src`, in the stored form `meta` announces) straight into
    /// the log, never holding it in memory: for a receiver over its target. The value is then on
    /// disk, like a spilled one. When `max_spill` refuses it, it is received into memory instead
    /// (serialized). The bytes arrive without the store's lock held (other operations go on); nothing
    /// of the value is visible until it arrived whole and verified. The old value of `key`, if any,
    /// is out of sight during the transfer (the key reads as absent, as a key being fetched does)
    /// and is back as it was if the transfer fails. (A value `max_spill` refuses is received into
    /// memory instead, as [`Client::get_into_store`](crate::transfer::Client::get_into_store)
    /// receives one under the target: then the old value stays readable until the new one
    /// replaces it.) If a `put` of the same key lands during the
    /// transfer, or a `remove`, the newer operation wins: the streamed record (or, on failure, the
    /// old value) is dropped. In a persistent store that drop (a tombstone over the old record)
    /// is written when the transfer ends, when the store settles the key: a crash before then
    /// brings the old value back at the next open.
    pub fn put_stream(&self, key: &[u8], meta: &StreamedValue, src: &mut dyn std::io::Read) -> Result<()> {
        let raw = meta.frame_lens.iter().try_fold(0u64, |a, &l| a.checked_add(l)).ok_or(Error::ValueTooLarge {
            len: u64::MAX,
            max: self.log.options().max_value_bytes,
            unit: "bytes",
        })?;
        let mut inner = self.wait_unwritten(self.lock(), key);
        // The record it replaces (if any) stops counting against max_spill once this one lands.
        let replaced = inner.map.get(key).map_or(0, |e| e.disk_raw);
        if !self.spill_allowed(&mut inner, raw.saturating_sub(replaced)) {
            return self.receive_serialized(inner, key, meta, src, true);
        }
        // The old value leaves the map but keeps its record (if any) in the log: a streamed record
        // that arrives whole supersedes that record; a failed transfer publishes nothing, and the
        // old entry goes back. (Being in `writing`, the key is not spilled meanwhile: its eviction,
        // or a `put_large`, waits for this write.) Its memory stays counted until then.
        // Its record's spilled bytes stay counted against max_spill too: on failure it comes back
        // with them, so other spills must not take that room meanwhile.
        let old = Self::take_entry(&mut inner, key);
        let (aside_weight, aside_raw) = old.as_ref().map_or((0, 0), |o| (o.weight, o.disk_raw));
        inner.mem_bytes += aside_weight;
        inner.disk_raw += aside_raw;
        let k: Arc<[u8]> = Arc::from(key);
        let stream = Stream { superseded: false, has_old: old.is_some(), aside_weight, aside_raw };
        inner.streams.insert(k.clone(), stream);
        Self::begin_write(&mut inner, k.clone());
        inner.writing_raw += raw;
        drop(inner);
        let t = Instant::now();
        // A panic of the caller's reader (or the log) still settles the store before it goes on.
        let streamed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.log.put_stream(key, meta, src)));
        let mut inner = self.lock();
        inner.mem_bytes -= aside_weight;
        inner.disk_raw -= aside_raw;
        inner.writing.remove(&k);
        inner.writing_raw -= raw;
        self.written.notify_all();
        // A put of the key (in memory: its eviction waited for this write) or a remove came
        // meanwhile.
        let superseded = inner.streams.remove(&k).expect("registered above").superseded;
        let streamed = match streamed {
            Ok(streamed) => streamed,
            Err(panic) => {
                Self::unstick(&mut inner);
                self.settle_failed_stream(&mut inner, key, old, superseded);
                drop(inner);
                std::panic::resume_unwind(panic);
            }
        };
        if let Err(e) = streamed {
            if !e.is_no_space() {
                // The space this stream reserved against max_spill is free again (unless the disk
                // is full, when retrying the refused evictions would only fail again).
                Self::unstick(&mut inner);
            }
            self.settle_failed_stream(&mut inner, key, old, superseded);
            return Err(e);
        }
        let m = &self.metrics.acts[DISK_WRITE];
        m.count.fetch_add(1, Ordering::Relaxed);
        m.bytes.fetch_add(raw, Ordering::Relaxed);
        m.ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        if superseded || old.is_some_and(|o| o.disk_bytes > 0) {
            // Disk space comes free: the streamed record, or the old one it superseded.
            Self::unstick(&mut inner);
        }
        if superseded {
            self.drop_stale_record(key);
            return Ok(());
        }
        let mut e = Entry::new(Slot::new(), Tier::Disk, 0);
        e.disk_raw = raw;
        e.disk_bytes = self.log.location(key).map_or(0, |l| l.len);
        e.large = raw > self.cfg.target_bytes;
        self.insert(&mut inner, key, e)?;
        Ok(())
    }

    /// Receive a value in stored form into memory, serialized, and store it as `put_serialized`
    /// would (for `Client::get_into_store`). The bytes arrive without the store's lock, with the key
    /// held as being received (a second transfer of it, or a direct write, waits; `flush` does not);
    /// its old value stays readable meanwhile. A `put` or `remove` of the key while the bytes arrive wins: the received value is
    /// dropped.
    pub(crate) fn put_received(&self, key: &[u8], meta: &StreamedValue, src: &mut dyn std::io::Read) -> Result<()> {
        self.receive_serialized(self.lock(), key, meta, src, false)
    }

    /// [`Self::put_received`] with the store's lock held on entry. `put_stream` calls it for a value
    /// `refused` by `max_spill`, which stays in memory as `put_large` keeps a refused value, without
    /// asking `max_spill` (and counting a refusal) again.
    fn receive_serialized<'a>(
        &'a self,
        inner: MutexGuard<'a, Inner<C::Value>>,
        key: &[u8],
        meta: &StreamedValue,
        src: &mut dyn std::io::Read,
        refused: bool,
    ) -> Result<()> {
        let mut inner = self.wait_unwritten(inner, key);
        let k: Arc<[u8]> = Arc::from(key);
        inner.streams.insert(k.clone(), Stream { superseded: false, has_old: false, aside_weight: 0, aside_raw: 0 });
        inner.receiving.insert(k.clone());
        drop(inner);
        let max = self.log.options().max_value_bytes;
        let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            crate::transfer::read_stored_form(meta, src, max)
        }));
        let mut inner = self.lock();
        inner.receiving.remove(&k);
        self.written.notify_all();
        let superseded = inner.streams.remove(&k).expect("registered above").superseded;
        let frames = match got {
            Ok(frames) => frames?,
            Err(panic) => {
                drop(inner);
                std::panic::resume_unwind(panic);
            }
        };
        if superseded {
            return Ok(());
        }
        if frames.total_len() > self.cfg.target_bytes {
            if !refused {
                return self.put_large(inner, key, frames);
            }
            let k = self.insert(&mut inner, key, Entry::serialized(frames, true))?;
            Self::set_stuck(&mut inner, &k);
            return Ok(());
        }
        let e = Entry::serialized(frames, false);
        let slot = e.slot.clone();
        self.insert(&mut inner, key, e)?;
        self.enforce(inner, Some(&slot))
    }

    /// After a failed `put_stream`: the old value goes back as it was, unless a put or remove of
    /// the key came meanwhile; then its record (if any) must not outlive the newer operation.
    fn settle_failed_stream(
        &self,
        inner: &mut Inner<C::Value>,
        key: &[u8],
        old: Option<Entry<C::Value>>,
        superseded: bool,
    ) {
        match old {
            Some(mut old) if !superseded => {
                // Retried like every other entry: a refusal may have been lifted meanwhile.
                old.stuck = false;
                // A get that started before the value was set aside may have materialized it into
                // this slot meanwhile, and found no entry to promote: an entry that is not
                // materialized must not come back with a cached object nobody accounts for.
                if old.tier != Tier::Materialized {
                    old.slot = Arc::new(Slot::new());
                }
                // It held a valid key before, so inserting it cannot fail.
                drop(self.insert(inner, key, old));
            }
            Some(old) if old.disk_bytes > 0 => self.drop_stale_record(key),
            _ => {}
        }
    }

    /// Drop the record a spill or stream wrote for `key` after the key was removed or replaced
    /// meanwhile. A persistent store writes a tombstone; if it cannot (a full disk), the record is
    /// forgotten instead, so the store and its log agree for as long as the process lives, and the
    /// failure is logged: after a restart the old value could come back.
    fn drop_stale_record(&self, key: &[u8]) {
        if self.cfg.persistent {
            match self.log.delete(key) {
                Ok(_) => return,
                Err(e) => log::error!(
                    "Failed to delete the record of {:?}, removed while it was written ({e}); forgetting it instead, so it may come back after a restart",
                    key_str(key)
                ),
            }
        }
        if let Err(e) = self.log.forget(key) {
            log::error!("Failed to drop the record of {:?}, removed while it was written: {e}", key_str(key));
        }
    }

    fn spill_allowed(&self, inner: &mut Inner<C::Value>, bytes: u64) -> bool {
        match self.cfg.max_spill_bytes {
            Some(max) if inner.disk_raw + inner.writing_raw + bytes > max => {
                self.metrics.max_spill_refusals.fetch_add(1, Ordering::Relaxed);
                if log_due(&mut inner.logged_full) {
                    log::warn!("Spill file on disk reached capacity; keeping data in memory");
                }
                false
            }
            _ => true,
        }
    }

    fn spill_failed(&self, inner: &mut Inner<C::Value>, key: &[u8], err: &Error) {
        self.metrics.spill_failures.fetch_add(1, Ordering::Relaxed);
        if log_due(&mut inner.logged_disk) {
            log::error!("Spill to disk failed; keeping data in memory ({:?}: {err})", key_str(key));
        }
    }

    fn serialize(&self, key: &[u8], v: &C::Value) -> Result<Frames> {
        let t = Instant::now();
        // A panicking codec is a failed serialize: `spill` runs it with keys marked as being written,
        // and unwinding out of it would leave them marked (their puts waiting forever).
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.codec.serialize(v)))
            .unwrap_or_else(|panic| Err(format!("the codec panicked: {}", panic_message(&*panic)).into()));
        let f = r.map_err(|e| Error::Codec { op: "serialize", key: key_str(key), source: Arc::from(e) })?;
        self.metrics.acts[SERIALIZE].add(f.total_len(), t);
        Ok(f)
    }

    fn write_disk(&self, items: &[(&[u8], &Frames)]) -> Result<()> {
        let t = Instant::now();
        let bytes: u64 = items.iter().map(|(_, f)| f.total_len()).sum();
        self.log.put_many(items)?;
        // Written (and readable) even if the sync below fails: counted either way.
        let synced = if self.cfg.sync_spills { self.log.sync() } else { Ok(()) };
        let m = &self.metrics.acts[DISK_WRITE];
        m.count.fetch_add(items.len() as u64, Ordering::Relaxed);
        m.bytes.fetch_add(bytes, Ordering::Relaxed);
        m.ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
        synced
    }

    /// Demote least-recently-used entries until memory, not counting what is being written to disk
    /// right now, is at or below the target. Spill writes run with the lock released (see
    /// `Store::spill`); the caller's guard is consumed. `protect` is the slot of the value being
    /// inserted: if *its* serialization fails, it is forgotten and the error returned.
    ///
    /// Memory can exceed the target by the writes in flight: at most one batch per thread inside
    /// `enforce`, each about `target / 16` (at most 4 MiB) over the excess it was planned for.
    fn enforce<'a>(
        &'a self,
        mut inner: MutexGuard<'a, Inner<C::Value>>,
        protect: Option<&Arc<Slot<C::Value, Error>>>,
    ) -> Result<()> {
        // Evict a little below the target so that spill writes come in batches, not one per put.
        let slack = (self.cfg.target_bytes / 16).min(EVICT_SLACK_BYTES);
        // Bounded: with the lock released during writes, other threads keep adding; each of them
        // enforces the target for its own puts.
        for _ in 0..ENFORCE_ROUNDS {
            let pending = inner.mem_bytes.saturating_sub(inner.writing_weight);
            if pending <= self.cfg.target_bytes {
                break;
            }
            let (freed, plan) = self.evict_round(&mut inner, pending - self.cfg.target_bytes + slack, None)?;
            if plan.is_empty() {
                if freed == 0 {
                    break; // nothing evictable: everything left is stuck, in use or being written
                }
                continue;
            }
            let (guard, protect_failed) = self.spill(inner, plan, protect);
            inner = guard;
            if let Some(err) = protect_failed {
                return Err(err);
            }
        }
        Ok(())
    }

    /// One eviction round over the LRU order (or over the single key `only`): drops values that
    /// still have their disk copy, and plans the demotion of objects and the spill writes of
    /// serialized values, without doing them (`Store::spill` does). Returns the weight freed or
    /// planned, and the plan (its keys already marked as being written).
    fn evict_round(
        &self,
        inner: &mut Inner<C::Value>,
        excess: u64,
        only: Option<&Arc<[u8]>>,
    ) -> Result<(u64, Plan<C::Value>)> {
        let mut demotions = Vec::new();
        let mut freed = 0u64;
        let mut batch: Vec<(Arc<[u8]>, Source, u64, u64)> = Vec::new();
        // Walk the LRU order lazily from the oldest tick: a round usually needs one or two entries,
        // and collecting EVICT_SCAN candidates up front cost a lookup and an Arc clone each, on every
        // put or promotion above the target. Entries re-attached below keep their tick, which the
        // cursor has passed, so none is visited twice.
        let mut cursor = 0u64;
        let mut scanned = 0usize;
        let mut single = only.cloned();
        while freed < excess && scanned < EVICT_SCAN {
            let key = if only.is_some() {
                let Some(k) = single.take() else { break };
                k
            } else {
                let Some((&tick, key)) = inner.lru.range(cursor..).next() else { break };
                cursor = tick + 1;
                key.clone()
            };
            let Some(e) = inner.map.get(&key) else { continue };
            if e.stuck || e.tier == Tier::Disk || inner.writing.contains_key(&key) {
                continue;
            }
            scanned += 1;
            // A value that still has its disk copy (it was read back) is dropped from memory for free.
            if e.disk_bytes > 0 {
                if e.tier == Tier::Materialized && e.slot.evict().is_none() {
                    continue;
                }
                freed += Self::modify_entry(inner, &key, |ne| {
                    let w = ne.weight;
                    ne.tier = Tier::Disk;
                    ne.weight = 0;
                    ne.frames = None;
                    ne.compressed = None;
                    w
                });
                continue;
            }
            // Step 1: object -> serialized (-> compressed), planned here and done without the lock.
            if e.tier == Tier::Materialized {
                let Some(value) = e.slot.try_get() else { continue };
                let d = Demotion { key: key.clone(), value, slot: e.slot.clone(), weight: e.weight, tick: e.tick };
                freed += d.weight;
                Self::begin_write(inner, key.clone());
                inner.writing_weight += d.weight;
                demotions.push(d);
                continue;
            }
            // Step 2: serialized / compressed -> disk (batched below).
            let (data, raw) = match (&e.frames, &e.compressed) {
                (Some(f), _) => (Source::Frames(f.clone()), f.total_len()),
                (None, Some(c)) => (Source::Compressed(c.clone()), c.frame_lens.iter().sum()),
                (None, None) => continue,
            };
            freed += e.weight;
            batch.push((key.clone(), data, raw, e.weight));
        }
        if batch.is_empty() {
            return Ok((freed, Plan { writes: Vec::new(), demotions }));
        }
        // max_spill: keep what does not fit in memory.
        let mut planned = Vec::with_capacity(batch.len());
        let mut bytes = 0u64;
        for (k, data, raw, weight) in batch {
            if self.spill_allowed(inner, bytes + raw) {
                bytes += raw;
                let slot = inner.map[&k].slot.clone();
                planned.push(Planned { key: k, data, raw, slot, weight });
            } else {
                freed = freed.saturating_sub(inner.map[&k].weight);
                Self::set_stuck(inner, &k);
            }
        }
        for p in &planned {
            Self::mark_writing(inner, p);
        }
        Ok((freed, Plan { writes: planned, demotions }))
    }

    /// Change `key`'s entry in place with `f`, keeping the accounting and the LRU order in step (the
    /// entry's tick is its LRU position: set it in `f` to move the entry). One hash lookup, where
    /// detaching and re-attaching the entry cost a removal and an insertion.
    fn modify_entry<R>(inner: &mut Inner<C::Value>, key: &Arc<[u8]>, f: impl FnOnce(&mut Entry<C::Value>) -> R) -> R {
        let e = inner.map.get_mut(key).expect("entry present");
        let before = Acct::of(e);
        let r = f(e);
        let after = Acct::of(e);
        if before != after {
            inner.account_acct(before, -1);
            inner.account_acct(after, 1);
            let moved = before.tick != after.tick;
            if before.in_lru() && (moved || !after.in_lru()) {
                inner.lru.remove(&before.tick);
            }
            if after.in_lru() && (moved || !before.in_lru()) {
                inner.lru.insert(after.tick, key.clone());
            }
        }
        r
    }

    /// The materialized value of `key`, deserializing it (exactly once, whatever the concurrency) if it
    /// is held serialized. A value read back from disk is promoted to memory unless it is heavier than
    /// the target.
    ///
    /// A get that races a `remove` (or a new `put`) of the key returns the old value, `None` or the new
    /// value, never an error caused by the race: if reading fails and the entry it was reading has been
    /// removed or replaced meanwhile, the get starts over.
    pub fn get(&self, key: &[u8]) -> Result<Option<sync::Arc<C::Value>>> {
        loop {
            let (k, slot, source) = match self.begin_get(key)? {
                GetStart::Done(v) => return Ok(v),
                GetStart::Read { key, slot, source } => (key, slot, source),
            };
            let got = slot.get_or_materialize(|| {
                let frames = self.fetch(&k, source)?;
                self.deserialize(&k, frames)
            });
            if let Some(v) = self.finish_get(&k, &slot, got)? {
                return Ok(Some(v));
            }
        }
    }

    /// The async form of [`Store::get`], over the same slots: the same value, the same single
    /// deserialize shared with concurrent sync and async callers. A disk read runs as a future (on
    /// io_uring the driver thread does it and the calling task is not blocked). Then the polling thread
    /// deserializes, because that is CPU work. If another caller is deserializing the same value at that
    /// moment, the polling thread waits for it rather than deserializing twice. Dropping the future
    /// part-way is safe: the backend keeps the read's buffer until the kernel is done with it, and
    /// nothing of the store changes until the read has completed.
    pub async fn get_async(&self, key: &[u8]) -> Result<Option<sync::Arc<C::Value>>> {
        loop {
            let (k, slot, source) = match self.begin_get(key)? {
                GetStart::Done(v) => return Ok(v),
                GetStart::Read { key, slot, source } => (key, slot, source),
            };
            // Read the bytes without holding anything, unless another caller has already started
            // materializing (then its result is waited for and no read is needed).
            let frames = match source {
                Source::Disk if slot.state() == crate::slot::SlotState::Idle => Some(self.fetch_disk_async(&k).await),
                _ => None,
            };
            let got = slot.get_or_materialize(|| {
                let frames = match frames {
                    Some(f) => f?,
                    None => self.fetch(&k, source)?,
                };
                self.deserialize(&k, frames)
            });
            if let Some(v) = self.finish_get(&k, &slot, got)? {
                return Ok(Some(v));
            }
        }
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
        // A key listed more than once is got once and answered from that: a value heavier than the
        // target is not kept in memory, so a second get of it would read and deserialize it again.
        let mut first: HashMap<&[u8], usize> = HashMap::with_capacity(keys.len());
        let unique: Vec<&[u8]> = keys
            .iter()
            .copied()
            .filter(|k| {
                let n = first.len();
                *first.entry(k).or_insert(n) == n
            })
            .collect();
        let got: Vec<Result<Option<sync::Arc<C::Value>>>> = if !self.log.backend().pipelines_reads() {
            unique.iter().map(|k| self.get(k)).collect()
        } else {
            // In batches: the bytes read for a batch are held until its values are materialized, so
            // a long key list must not hold all of its values' bytes at once.
            unique.chunks(GET_MANY_BATCH).flat_map(|batch| self.get_batch(batch)).collect()
        };
        if unique.len() == keys.len() {
            return got;
        }
        keys.iter().map(|k| got[first[k]].clone()).collect()
    }

    /// One batch of [`Store::get_many`]: the disk values read together, then materialized.
    fn get_batch(&self, keys: &[&[u8]]) -> Vec<Result<Option<sync::Arc<C::Value>>>> {
        enum Plan<V> {
            Done(Result<Option<sync::Arc<V>>>),
            /// Read from disk in the batch (index into `batch`).
            Batched(Arc<[u8]>, Arc<Slot<V, Error>>, usize),
            /// Anything else (in memory, or already being materialized): as `get` does.
            Single,
        }
        let mut batch: Vec<Vec<u8>> = Vec::new();
        let mut batched_slots: HashMap<*const Slot<C::Value, Error>, usize> = HashMap::new();
        let plans: Vec<Plan<C::Value>> = keys
            .iter()
            .map(|key| match self.begin_get(key) {
                Err(e) => Plan::Done(Err(e)),
                Ok(GetStart::Done(v)) => Plan::Done(Ok(v)),
                Ok(GetStart::Read { key: k, slot, source: Source::Disk })
                    if slot.state() == crate::slot::SlotState::Idle =>
                {
                    // A key listed twice is read once.
                    let at = *batched_slots.entry(Arc::as_ptr(&slot)).or_insert_with(|| {
                        batch.push(k.to_vec());
                        batch.len() - 1
                    });
                    Plan::Batched(k, slot, at)
                }
                Ok(GetStart::Read { .. }) => Plan::Single,
            })
            .collect();
        let mut read: Vec<Option<Result<Frames>>> = (0..batch.len()).map(|_| None).collect();
        if !batch.is_empty() {
            let positions: HashMap<&[u8], usize> = batch.iter().enumerate().map(|(i, k)| (&k[..], i)).collect();
            let t = Instant::now();
            let mut keys_iter = batch.clone().into_iter();
            let r = self.log.get_pipelined(GET_MANY_DEPTH, &mut keys_iter, &mut |k, res| {
                let i = positions[&k[..]];
                read[i] = Some(res.and_then(|f| f.ok_or_else(|| vanished(&k))));
            });
            // Disk-read time is the batch's wall time, shared out over its reads.
            let m = &self.metrics.acts[DISK_READ];
            let ok: Vec<u64> = read.iter().flatten().filter_map(|r| r.as_ref().ok().map(|f| f.total_len())).collect();
            m.count.fetch_add(ok.len() as u64, Ordering::Relaxed);
            m.bytes.fetch_add(ok.iter().sum(), Ordering::Relaxed);
            m.ns.fetch_add(t.elapsed().as_nanos() as u64, Ordering::Relaxed);
            if let Err(e) = r {
                // The pipeline itself failed (its ring could not be set up): what was not read yet
                // is read one by one below.
                log::warn!("batched read failed ({e}); reading one by one");
            }
        }
        plans
            .into_iter()
            .zip(keys)
            .map(|(plan, key)| match plan {
                Plan::Done(r) => r,
                Plan::Single => self.get(key),
                Plan::Batched(k, slot, at) => {
                    // The frames read in the batch, unless someone else materializes first (then
                    // theirs is the value, as for any get).
                    let frames = read[at].take();
                    let got = slot.get_or_materialize(|| {
                        let frames = match frames {
                            Some(f) => f?,
                            None => self.fetch(&k, Source::Disk)?,
                        };
                        self.deserialize(&k, frames)
                    });
                    match self.finish_get(&k, &slot, got) {
                        Ok(Some(v)) => Ok(Some(v)),
                        // Removed or replaced meanwhile, and the read failed: start over, as get does.
                        Ok(None) => self.get(key),
                        Err(e) => Err(e),
                    }
                }
            })
            .collect()
    }

    /// First half of a get, under the store's lock: the value if it is ready (or the key absent),
    /// otherwise what to materialize it from.
    fn begin_get(&self, key: &[u8]) -> Result<GetStart<C::Value>> {
        let mut inner = self.lock();
        let Some((k, e)) = inner.map.get_key_value(key) else { return Ok(GetStart::Done(None)) };
        let k = k.clone();
        if let Some(v) = e.slot.try_get() {
            Self::touch(&mut inner, &k);
            return Ok(GetStart::Done(Some(v)));
        }
        let source = match (e.tier, &e.frames, &e.compressed) {
            (Tier::Disk, ..) => Source::Disk,
            (_, Some(f), _) => Source::Frames(f.clone()),
            (_, None, Some(c)) => Source::Compressed(c.clone()),
            // A materialized entry always has a ready slot while the store lock is held.
            _ => return Err(Error::InvalidConfig(format!("{:?}: materialized entry without a value", key_str(key)))),
        };
        let slot = e.slot.clone();
        if e.tier != Tier::Disk {
            Self::touch(&mut inner, &k); // (disk entries are not in the LRU: no second lookup)
        }
        Ok(GetStart::Read { key: k, slot, source })
    }

    fn deserialize(&self, key: &[u8], frames: Frames) -> Result<C::Value> {
        let t = Instant::now();
        let n = frames.total_len();
        let v = self.codec.deserialize(frames).map_err(|e| Error::Codec {
            op: "deserialize",
            key: key_str(key),
            source: Arc::from(e),
        })?;
        self.metrics.acts[DESERIALIZE].add(n, t);
        Ok(v)
    }

    /// Second half of a get: `None` to start over (the entry was removed or replaced while it was
    /// being read, and the read failed); otherwise the value, after promoting it (or, for a large
    /// value, letting the caller keep the only reference).
    fn finish_get(
        &self,
        k: &Arc<[u8]>,
        slot: &Arc<Slot<C::Value, Error>>,
        got: Result<sync::Arc<C::Value>>,
    ) -> Result<Option<sync::Arc<C::Value>>> {
        let mut inner = self.lock();
        let current = inner.map.get(k).filter(|e| Arc::ptr_eq(&e.slot, slot));
        let v = match got {
            Ok(v) => v,
            Err(_) if current.is_none() => return Ok(None),
            Err(e) => return Err(e),
        };
        let Some(e) = current else { return Ok(Some(v)) };
        // Already promoted by another reader of the same materialization; or promoted and then evicted
        // again (slot idle) between our materialization and this lock: then the entry stays where it is,
        // since promoting it would leave a materialized entry without a value.
        if e.tier == Tier::Materialized || e.slot.state() != crate::slot::SlotState::Ready {
            return Ok(Some(v));
        }
        let weight = self.codec.size_of(&v);
        if e.large || weight > self.cfg.target_bytes {
            // Served without promotion: a value heavier than the target (as bytes, or as the object
            // its bytes deserialize to) stays where it is, as a `put` of it would go to disk.
            e.slot.evict();
            return Ok(Some(v));
        }
        let tick = inner.next_tick;
        inner.next_tick += 1;
        // A value read back from disk keeps its disk copy (disk_* fields unchanged): evicting it again
        // costs no write.
        Self::modify_entry(&mut inner, k, |ne| {
            ne.tier = Tier::Materialized;
            ne.frames = None;
            ne.compressed = None;
            ne.weight = weight;
            ne.stuck = false;
            ne.tick = tick;
        });
        self.enforce(inner, None)?;
        Ok(Some(v))
    }

    /// Read `key`'s record from the log as a future (see [`SegmentLog::get_async`]).
    async fn fetch_disk_async(&self, key: &[u8]) -> Result<Frames> {
        let t = Instant::now();
        let f = self.log.get_async(key).await?.ok_or_else(|| vanished(key))?;
        self.metrics.acts[DISK_READ].add(f.total_len(), t);
        Ok(f)
    }

    fn fetch(&self, key: &[u8], source: Source) -> Result<Frames> {
        match source {
            Source::Frames(f) => {
                let t = Instant::now();
                self.metrics.acts[MEMORY_READ].add(f.total_len(), t);
                Ok(f)
            }
            Source::Compressed(c) => {
                let t = Instant::now();
                let f = decompress(&c)?;
                self.metrics.acts[DECOMPRESS].add(f.total_len(), t);
                Ok(f)
            }
            Source::Disk => {
                let t = Instant::now();
                let f = self.log.get(key)?.ok_or_else(|| vanished(key))?;
                self.metrics.acts[DISK_READ].add(f.total_len(), t);
                Ok(f)
            }
        }
    }

    /// The serialized frames of `key`, never deserializing: for data that is only passing through (to a
    /// peer). A materialized value is serialized (its object stays); a value on disk is read and, unless
    /// heavier than the target, promoted to the serialized tier.
    pub fn get_serialized(&self, key: &[u8]) -> Result<Option<Frames>> {
        loop {
            let (k, slot, source, large) = match self.begin_get_serialized(key)? {
                SerStart::Done(f) => return Ok(f),
                SerStart::Object(k, v) => return self.serialize(&k, &v).map(Some),
                SerStart::Read { key, slot, source, large } => (key, slot, source, large),
            };
            let was_disk = matches!(source, Source::Disk);
            let got = self.fetch(&k, source);
            if !was_disk {
                return got.map(Some); // in-memory sources cannot vanish under a reader
            }
            if let Some(f) = self.finish_get_serialized(&k, &slot, large, got)? {
                return Ok(Some(f));
            }
        }
    }

    /// The async form of [`Store::get_serialized`]: a disk read runs as a future; nothing is
    /// deserialized. Dropping the future part-way is safe (see [`Store::get_async`]).
    pub async fn get_serialized_async(&self, key: &[u8]) -> Result<Option<Frames>> {
        loop {
            let (k, slot, source, large) = match self.begin_get_serialized(key)? {
                SerStart::Done(f) => return Ok(f),
                SerStart::Object(k, v) => return self.serialize(&k, &v).map(Some),
                SerStart::Read { key, slot, source, large } => (key, slot, source, large),
            };
            if !matches!(source, Source::Disk) {
                return self.fetch(&k, source).map(Some);
            }
            let got = self.fetch_disk_async(&k).await;
            if let Some(f) = self.finish_get_serialized(&k, &slot, large, got)? {
                return Ok(Some(f));
            }
        }
    }

    /// First half of `get_serialized`, under the store's lock.
    fn begin_get_serialized(&self, key: &[u8]) -> Result<SerStart<C::Value>> {
        let mut inner = self.lock();
        let Some((k, e)) = inner.map.get_key_value(key) else { return Ok(SerStart::Done(None)) };
        let k = k.clone();
        let large = e.large;
        let slot = e.slot.clone();
        let source = match (e.tier, &e.frames, &e.compressed) {
            (Tier::Disk, ..) => Source::Disk,
            (_, Some(f), _) => Source::Frames(f.clone()),
            (_, None, Some(c)) => Source::Compressed(c.clone()),
            (Tier::Materialized, None, None) => match e.slot.try_get() {
                Some(v) => {
                    Self::touch(&mut inner, &k);
                    return Ok(SerStart::Object(k, v)); // serialized outside the lock
                }
                None => Source::Disk, // unreachable in practice: materialized entries have a value
            },
            _ => Source::Disk,
        };
        Self::touch(&mut inner, &k);
        Ok(SerStart::Read { key: k, slot, source, large })
    }

    /// Second half of `get_serialized` after a disk read: `None` to start over (the entry was removed
    /// or replaced while being read, and the read failed); otherwise the frames, after promoting them
    /// to the serialized tier unless the value is heavier than the target.
    fn finish_get_serialized(
        &self,
        k: &Arc<[u8]>,
        slot: &Arc<Slot<C::Value, Error>>,
        large: bool,
        got: Result<Frames>,
    ) -> Result<Option<Frames>> {
        let mut inner = self.lock();
        let current = inner.map.get(k).is_some_and(|e| Arc::ptr_eq(&e.slot, slot));
        let frames = match got {
            Ok(f) => f,
            Err(_) if !current => return Ok(None),
            Err(e) => return Err(e),
        };
        if !large && current && inner.map.get(k).is_some_and(|e| e.tier == Tier::Disk) {
            let tick = inner.next_tick;
            inner.next_tick += 1;
            Self::modify_entry(&mut inner, k, |ne| {
                ne.tier = Tier::Serialized;
                ne.weight = frames.total_len();
                ne.frames = Some(frames.clone());
                ne.tick = tick;
            }); // keeps its disk copy, like `get`
            self.enforce(inner, None)?;
        }
        Ok(Some(frames))
    }

    /// Delete `key` from every tier. Returns whether it existed.
    pub fn remove(&self, key: &[u8]) -> Result<bool> {
        // A spill write of the key in flight is not waited for: its record is dropped when it
        // settles (a tombstone in a persistent store), and `flush` waits for that.
        let mut inner = self.lock();
        self.drop_entry(&mut inner, key)
    }

    /// Whether `key` is stored (in any tier).
    pub fn contains(&self, key: &[u8]) -> bool {
        self.lock().map.contains_key(key)
    }

    /// Number of keys.
    pub fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// True when empty.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// All keys (unordered).
    pub fn keys(&self) -> Vec<Vec<u8>> {
        self.lock().map.keys().map(|k| k.to_vec()).collect()
    }

    /// The tier `key` is in.
    pub fn tier(&self, key: &[u8]) -> Option<Tier> {
        self.lock().map.get(key).map(|e| e.tier)
    }

    /// Recompute the accounting from the entries and compare it with the running totals, the LRU order
    /// and the log's index. `Err` names the first difference. For tests and debugging: it walks every
    /// entry under the store's lock.
    pub fn check_accounting(&self) -> std::result::Result<(), String> {
        let inner = self.lock();
        let (mut mem, mut disk, mut raw) = (0u64, 0u64, 0u64);
        let (mut count, mut bytes) = ([0u64; 4], [0u64; 4]);
        let mut in_lru = 0usize;
        for (k, e) in &inner.map {
            let name = key_str(k);
            count[e.tier.idx()] += 1;
            bytes[e.tier.idx()] += if e.tier == Tier::Disk { e.disk_bytes } else { e.weight };
            mem += e.weight;
            disk += e.disk_bytes;
            raw += e.disk_raw;
            let logged = self.log.location(k).map(|l| l.len);
            // A key being written (or streamed, its old record set aside) may or may not have its
            // new record in the log yet.
            let settled = !inner.writing.contains_key(k) && !inner.streams.contains_key(k);
            if settled && ((e.disk_bytes > 0) != logged.is_some() || logged.is_some_and(|l| l != e.disk_bytes)) {
                return Err(format!("{name:?}: accounted {} bytes on disk, the log has {logged:?}", e.disk_bytes));
            }
            match e.tier {
                Tier::Disk => {
                    if e.weight != 0 || e.frames.is_some() || e.compressed.is_some() || e.disk_bytes == 0 {
                        return Err(format!("{name:?}: disk entry with memory state or no record"));
                    }
                }
                _ if e.stuck => {
                    if inner.lru.get(&e.tick).is_some_and(|l| l == k) {
                        return Err(format!("{name:?}: stuck but in the LRU"));
                    }
                    if !inner.stuck.contains(&k[..]) {
                        return Err(format!("{name:?}: stuck but not listed for unsticking"));
                    }
                }
                _ => {
                    in_lru += 1;
                    if inner.lru.get(&e.tick).is_none_or(|l| l != k) {
                        return Err(format!("{name:?}: in memory but not in the LRU at its tick {}", e.tick));
                    }
                }
            }
            let has_bytes = match e.tier {
                Tier::Materialized => e.slot.state() == crate::slot::SlotState::Ready,
                Tier::Serialized => e.frames.as_ref().is_some_and(|f| f.total_len() == e.weight),
                Tier::Compressed => e.compressed.as_ref().is_some_and(|c| c.block.len() as u64 == e.weight),
                Tier::Disk => true,
            };
            if !has_bytes {
                return Err(format!("{name:?}: {} entry without its value (or with a wrong weight)", e.tier.name()));
            }
        }
        if in_lru != inner.lru.len() {
            return Err(format!("LRU holds {} keys, {in_lru} entries are in memory", inner.lru.len()));
        }
        if inner.stuck.len() > inner.map.len() {
            return Err(format!("{} keys listed as stuck, {} entries", inner.stuck.len(), inner.map.len()));
        }
        // Values set aside by transfers in progress still count.
        for st in inner.streams.values() {
            mem += st.aside_weight;
            raw += st.aside_raw;
        }
        if (mem, disk, raw, count, bytes)
            != (inner.mem_bytes, inner.disk_bytes, inner.disk_raw, inner.tier_count, inner.tier_bytes)
        {
            return Err(format!(
                "totals drifted: recomputed mem {mem} disk {disk} raw {raw} counts {count:?} bytes {bytes:?}, \
                 running mem {} disk {} raw {} counts {:?} bytes {:?}",
                inner.mem_bytes, inner.disk_bytes, inner.disk_raw, inner.tier_count, inner.tier_bytes
            ));
        }
        if !inner.writing.is_empty() {
            return Ok(()); // records of writes in flight may or may not be in the log yet
        }
        if (inner.writing_weight, inner.writing_raw) != (0, 0) {
            return Err(format!(
                "no write in flight, but {} weight and {} bytes counted as being written",
                inner.writing_weight, inner.writing_raw
            ));
        }
        if self.log.len() != inner.map.values().filter(|e| e.disk_bytes > 0).count() {
            return Err(format!("the log holds {} keys the store does not know of", self.log.len()));
        }
        Ok(())
    }

    /// Total memory weight.
    pub fn memory_bytes(&self) -> u64 {
        self.lock().mem_bytes
    }

    /// Spill the least-recently-used memory-resident entry to disk (for a worker's memory monitor).
    /// Returns the memory weight freed; 0 when nothing could be evicted. Never fails for a spill
    /// problem (the entry then stays in memory and the condition is reported).
    pub fn evict(&self) -> Result<u64> {
        let mut inner = self.lock();
        let Some(key) = inner
            .lru
            .values()
            .find(|k| !inner.writing.contains_key(*k) && inner.map.get(*k).is_some_and(|e| !e.stuck))
            .cloned()
        else {
            return Ok(0);
        };
        let (weight, slot) = {
            let e = &inner.map[&key];
            (e.weight, e.slot.clone())
        };
        // Demote this one entry all the way: object -> serialized -> disk.
        for _ in 0..2 {
            let live =
                inner.map.get(&key).is_some_and(|e| Arc::ptr_eq(&e.slot, &slot) && e.tier != Tier::Disk && !e.stuck);
            if !live || inner.writing.contains_key(&key) {
                break;
            }
            let (_, plan) = self.evict_round(&mut inner, weight.max(1), Some(&key))?;
            if !plan.is_empty() {
                inner = self.spill(inner, plan, None).0;
            }
        }
        let left = inner.map.get(&key).filter(|e| Arc::ptr_eq(&e.slot, &slot)).map_or(0, |e| e.weight);
        Ok(weight.saturating_sub(left))
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
        let mut inner = self.lock();
        if !self.cfg.persistent {
            inner = self.wait_for_writes(inner);
            drop(inner);
            return self.log.sync();
        }
        // An explicit request to persist: values refused before are tried again.
        Self::unstick(&mut inner);
        // What this flush must write: the values held only in memory when it began (values put
        // meanwhile are the next flush's). Each is written by this flush, or by another thread's
        // eviction while this flush waits for it.
        let mut pending: Vec<Listed<C::Value>> = inner
            .map
            .iter()
            .filter(|(_, e)| e.tier != Tier::Disk && e.disk_bytes == 0)
            .map(|(k, e)| (k.clone(), e.slot.clone(), true))
            .collect();
        // Several passes: a key another thread was writing (or demoting, object -> frames, which
        // leaves it in memory) is skipped, waited for, and tried again. Bounded, in case other
        // threads' evictions keep demoting the same keys.
        for _ in 0..FLUSH_PASSES {
            for chunk in pending.chunks(EVICT_SCAN) {
                inner = self.persist_round(inner, chunk);
                // Let other threads in between rounds.
                drop(inner);
                inner = self.lock();
            }
            inner = self.wait_for_writes(inner);
            // Still to write: the listed keys still held only in memory, with whatever value they
            // hold now (a failed transfer brings an old value back under a new slot; a key replaced
            // meanwhile is written with its new value), and keys a transfer has set aside right now
            // (it may bring the old value back).
            pending.retain_mut(|(k, slot, original)| match inner.map.get(k) {
                Some(e) if e.tier != Tier::Disk && e.disk_bytes == 0 => {
                    if !Arc::ptr_eq(slot, &e.slot) {
                        *slot = e.slot.clone();
                        *original = false;
                    }
                    true
                }
                Some(_) => false,
                None => inner.streams.contains_key(k),
            });
            if pending.iter().all(|(k, ..)| inner.map.get(k).is_some_and(|e| e.stuck)) {
                break;
            }
        }
        // Values that replaced a listed one meanwhile were written if they could be, but are not
        // this flush's promise: only the listed values count.
        let only_in_memory = pending
            .iter()
            .filter(|(k, slot, original)| *original && inner.map.get(k).is_some_and(|e| Arc::ptr_eq(&e.slot, slot)))
            .count();
        // A value the flush wrote may have been kept in memory above the target (refused by
        // max_spill until now): it can be dropped for free now.
        let enforced = self.enforce(inner, None);
        self.log.sync()?;
        enforced?;
        match only_in_memory {
            0 => Ok(()),
            keys => Err(Error::NotPersisted { keys }),
        }
    }

    /// Wait for the spill writes that started before this call.
    fn wait_for_writes<'a>(&'a self, mut inner: MutexGuard<'a, Inner<C::Value>>) -> MutexGuard<'a, Inner<C::Value>> {
        let now = inner.next_write;
        while inner.writing.values().any(|&w| w < now) {
            inner = self.written.wait(inner).unwrap_or_else(|p| p.into_inner());
        }
        inner
    }

    /// For a persistent store's `flush`: write a disk copy of each value of `keys` (each with the
    /// slot that identifies its entry) that is still held only in memory, leaving it in memory. A
    /// key removed or replaced since, stuck, or being written by another thread is skipped.
    /// Serialization and the write run without the store's lock, the keys marked as being written
    /// (eviction skips them, a direct write of one waits).
    ///
    /// Settled as a spill batch is: a value removed or replaced meanwhile leaves a record nobody wants,
    /// which is dropped; one whose record did not land (max_spill, a full disk, a serialize failure)
    /// stays as it was, stuck and reported. A value heavier than the target goes to the disk tier,
    /// where it lives.
    fn persist_round<'a>(
        &'a self,
        mut inner: MutexGuard<'a, Inner<C::Value>>,
        keys: &[Listed<C::Value>],
    ) -> MutexGuard<'a, Inner<C::Value>> {
        enum Copy<V> {
            Object(sync::Arc<V>),
            Frames(Frames),
            Compressed(Box<Compressed>),
        }
        struct Job<V> {
            key: Arc<[u8]>,
            /// Identifies the entry, as in [`Planned`].
            slot: Arc<Slot<V, Error>>,
            copy: Copy<V>,
        }
        let mut todo: Vec<Job<C::Value>> = Vec::new();
        for (key, slot, _) in keys {
            let Some(e) = inner.map.get(key).filter(|e| Arc::ptr_eq(&e.slot, slot)) else { continue };
            if e.stuck || e.disk_bytes > 0 || inner.writing.contains_key(key) {
                continue;
            }
            let copy = match (e.tier, &e.frames, &e.compressed) {
                (Tier::Materialized, ..) => match e.slot.try_get() {
                    Some(v) => Copy::Object(v),
                    None => continue,
                },
                (Tier::Disk, ..) => continue,
                (_, Some(f), _) => Copy::Frames(f.clone()),
                (_, None, Some(c)) => Copy::Compressed(c.clone()),
                (_, None, None) => continue,
            };
            Self::begin_write(&mut inner, key.clone());
            todo.push(Job { key: key.clone(), slot: slot.clone(), copy });
        }
        if todo.is_empty() {
            return inner;
        }
        drop(inner);
        let data: Vec<Result<Frames>> = todo
            .iter()
            .map(|Job { key: k, copy, .. }| {
                let f = match copy {
                    Copy::Object(v) => self.serialize(k, v)?,
                    Copy::Frames(f) => f.clone(),
                    Copy::Compressed(c) => {
                        let t = Instant::now();
                        let f = decompress(c)?;
                        self.metrics.acts[DECOMPRESS].add(f.total_len(), t);
                        f
                    }
                };
                self.log.validate(k, &f).map(|()| f)
            })
            .collect();
        // max_spill: reserve what is written, as an eviction's batch does.
        let mut inner = self.lock();
        let mut reserved = 0u64;
        let allowed: Vec<bool> = data
            .iter()
            .map(|d| match d {
                Ok(f) if self.spill_allowed(&mut inner, reserved + f.total_len()) => {
                    reserved += f.total_len();
                    true
                }
                _ => false,
            })
            .collect();
        inner.writing_raw += reserved;
        drop(inner);
        let items: Vec<(&[u8], &Frames)> = todo
            .iter()
            .zip(&data)
            .zip(&allowed)
            .filter_map(|((j, d), &ok)| d.as_ref().ok().filter(|_| ok).map(|f| (&*j.key, f)))
            .collect();
        let (result, panicked) = self.write_batch(&items);
        let mut inner = self.lock();
        inner.writing_raw -= reserved;
        let mut stuck: Vec<Arc<[u8]>> = Vec::new();
        let mut stale: Vec<Arc<[u8]>> = Vec::new();
        let mut freed = false;
        let mut landed = false;
        for ((Job { key, slot, .. }, d), &ok) in todo.iter().zip(&data).zip(&allowed) {
            inner.writing.remove(key);
            let ours = inner.map.get(key).is_some_and(|e| Arc::ptr_eq(&e.slot, slot));
            let loc = if ok { self.log.location(key) } else { None };
            match (ours, loc) {
                (true, Some(loc)) => {
                    let raw = d.as_ref().map_or(0, |f| f.total_len());
                    Self::note_landed(&mut inner, key, raw, loc.len, true);
                    landed = true;
                }
                (true, None) => {
                    match d {
                        Err(err @ Error::Codec { .. }) => {
                            self.metrics.spill_failures.fetch_add(1, Ordering::Relaxed);
                            let e = inner.map.get_mut(key).expect("present");
                            if !std::mem::replace(&mut e.logged_serialize, true) {
                                log::error!("Failed to serialize {:?}; keeping it in memory: {err}", key_str(key));
                            }
                        }
                        Err(err) => self.spill_failed(&mut inner, key, err),
                        // Refused by max_spill (counted and logged there).
                        Ok(_) if !ok => {}
                        Ok(_) => {
                            let err = result.clone().err().unwrap_or_else(|| vanished(key));
                            self.spill_failed(&mut inner, key, &err);
                        }
                    }
                    stuck.push(key.clone());
                }
                (false, Some(_)) => {
                    stale.push(key.clone());
                    freed = true;
                }
                (false, None) => freed |= ok && result.is_ok(),
            }
        }
        let first = todo.first().map(|j| &j.key);
        self.end_settle(inner, Settled { result: &result, first, landed, freed, stuck, stale, panicked })
    }

    /// A snapshot of the metrics and the current accounting. The accounting is read under the store's
    /// lock and is consistent; the activity counters are read one after another while other threads may
    /// be bumping them, so two counters of one snapshot need not be from the same instant.
    pub fn metrics(&self) -> MetricsSnapshot {
        let inner = self.lock();
        MetricsSnapshot {
            activities: ACTIVITIES.iter().zip(&self.metrics.acts).map(|(n, a)| (*n, a.snap())).collect(),
            tier_bytes: TIERS.iter().map(|t| (t.name(), inner.tier_bytes[t.idx()])).collect(),
            tier_entries: TIERS.iter().map(|t| (t.name(), inner.tier_count[t.idx()])).collect(),
            memory_bytes: inner.mem_bytes,
            spilled_memory_bytes: inner.disk_raw,
            spilled_disk_bytes: inner.disk_bytes,
            max_spill_refusals: self.metrics.max_spill_refusals.load(Ordering::Relaxed),
            spill_failures: self.metrics.spill_failures.load(Ordering::Relaxed),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store's memory per key is mostly its map bucket (key handle and entry), one per key of
    /// every tier, so a million spilled keys cost a million of them: keep it within 96 bytes (it was
    /// 152 with the compressed block inline).
    #[test]
    fn entries_stay_small() {
        let bucket = std::mem::size_of::<(Arc<[u8]>, Entry<Bytes>)>();
        assert!(bucket <= 96, "a map bucket takes {bucket} bytes");
    }
}
