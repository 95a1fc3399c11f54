//! What a store is opened with: [`StoreConfig`], and the [`EvictionPolicy`] that says how room is
//! made when memory is over the target.

use crate::log::LogOptions;

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
    /// Keep the contents across reopen: what was spilled, and after [`Store::flush`](crate::Store::flush) everything
    /// (values held only in memory are not written until they are evicted or flushed). When false
    /// (a worker's spill store, whose data dies with it), records left by an earlier process are
    /// discarded at open and removals write no tombstones.
    pub persistent: bool,
    /// How room is made when memory is over the target.
    pub eviction: EvictionPolicy,
    /// Spills that do not happen (max_spill, a serialize failure, a disk error) are kept for
    /// [`Store::take_failures`](crate::Store::take_failures) instead of being logged: for an embedding that reports them in its
    /// own words (dask's messages, with the caller's exception). Default false.
    pub report_failures: bool,
    /// How many times a spill store whose log a failed write left read-only (an EIO) opens a fresh
    /// log, in a subdirectory of its own, for the spills that follow (the read-only ones keep
    /// serving their records). At most [`MAX_FRESH_LOGS`](crate::store::MAX_FRESH_LOGS); a persistent store never does. Default 3.
    pub fresh_logs: u32,
}

/// How the store makes room when memory is over `target_bytes`: the rules of eviction, in one place.
///
/// * Victims are taken least recently used first; an entry in use (being written, received or
///   materialized) or one the disk refused (`stuck`, retried when disk space frees) is passed over.
/// * A round demotes each victim one tier: an object to serialized frames in memory (compressed with
///   `compress_in_memory`), frames to a record on disk; with [`EvictionPolicy::direct_to_disk`] an
///   object goes to disk in the same round. Frames whose disk record is still current are dropped
///   without a write.
/// * A value heavier than the target goes straight to disk when put, and is served from there
///   without being promoted. If it cannot be written, the other values are evicted instead.
/// * A round evicts the excess over the target plus a *slack*, so that spill writes come in batches
///   rather than one per put: [`EvictionPolicy::slack`].
/// * With [`EvictionPolicy::keep_own_key`], the eviction a `put` runs never takes the value being
///   put.
/// * With [`EvictionPolicy::serialized_reads_promote`], `get_serialized` of a value on disk brings its
///   frames back into memory.
///
/// [`EvictionPolicy::dask`] is dask's `SpillBuffer` (zict's LRU over a pickling file store).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvictionPolicy {
    /// The most a round evicts below the target: the slack is `min(target / 16, max_slack_bytes)`.
    /// 0 evicts exactly down to the target, as dask's own store does. Default 4 MiB.
    pub max_slack_bytes: u64,
    /// An evicted object is serialized and written to disk in one round, never held as frames in
    /// memory in between (dask's store has no such tier). Default false.
    pub direct_to_disk: bool,
    /// The eviction a `put` of a value not heavier than the target runs passes over that value, even
    /// when everything older is in use: memory stays above the target until a later round, as in
    /// dask (zict's LRU evicts from its head; the value just put is its tail). Default false.
    pub keep_own_key: bool,
    /// `get_serialized` of a value on disk brings its frames back into memory (unless it is heavier
    /// than the target), so that forwarding it again costs no read. dask's store leaves it on disk.
    /// Default true.
    pub serialized_reads_promote: bool,
    /// A spill that fails (or that max_spill refuses) ends the eviction that met it, and the value
    /// keeps its place in the LRU order (the next eviction tries it first again), as in dask. When
    /// false, the value is set aside (`stuck`) until disk space frees or it is read, and eviction
    /// goes on with the next value. Default false.
    pub failed_spill_ends_round: bool,
    /// A value read back from disk keeps its record as a copy only with the crc of what was read;
    /// evicting it again serializes it and drops it without a write only if the new frames have that
    /// crc (it was not changed in place), else writes them. With max_spill set it keeps no copy (the
    /// copy's bytes would count against it). When false, a copy is kept and trusted: evicting the
    /// value again drops it without serializing. Default false.
    pub verify_copies: bool,
}

impl Default for EvictionPolicy {
    fn default() -> Self {
        EvictionPolicy {
            max_slack_bytes: 4 << 20,
            direct_to_disk: false,
            keep_own_key: false,
            serialized_reads_promote: true,
            failed_spill_ends_round: false,
            verify_copies: false,
        }
    }
}

impl EvictionPolicy {
    /// dask's rules: no slack (evict exactly down to the target), objects straight to disk, a put
    /// never evicts the value it puts, reading a value's frames leaves it where it is, and a failed
    /// spill ends the eviction.
    pub fn dask() -> Self {
        EvictionPolicy {
            max_slack_bytes: 0,
            direct_to_disk: true,
            keep_own_key: true,
            serialized_reads_promote: false,
            failed_spill_ends_round: true,
            verify_copies: true,
        }
    }

    /// How far below `target` a round of eviction goes.
    pub fn slack(&self, target: u64) -> u64 {
        (target / 16).min(self.max_slack_bytes)
    }

    /// How many bytes a round evicts when `pending` bytes of memory (not counting writes in flight)
    /// are held against `target`: 0 at or under the target.
    pub fn excess(&self, pending: u64, target: u64) -> u64 {
        if pending <= target {
            0
        } else {
            pending - target + self.slack(target)
        }
    }
}

impl StoreConfig {
    /// The options the store opens its log with: `log`, adjusted to what the store is. A spill
    /// store's data dies with the process, so its log never fsyncs on its own (`durable` is
    /// ignored), starts empty (`discard_existing`), releases a removed value's blocks at once
    /// (`punch_forgotten`), as unlinking a file per key would, and reuses dead segments' files
    /// (`recycle_segments`: never recovered, so their old bytes past the new records are never
    /// read; a written-over file writes at the device's speed, a fresh preallocated one at about
    /// half of it on ext4). A put into a persistent store is in the file when it returns (a
    /// process crash keeps it): no write-behind.
    pub fn log_options(&self) -> LogOptions {
        LogOptions {
            durable: self.log.durable && self.persistent,
            punch_forgotten: self.log.punch_forgotten || !self.persistent,
            discard_existing: self.log.discard_existing || !self.persistent,
            recycle_segments: self.log.recycle_segments || !self.persistent,
            write_behind_bytes: if self.persistent { 0 } else { self.log.write_behind_bytes },
            ..self.log.clone()
        }
    }
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
            eviction: EvictionPolicy::default(),
            report_failures: false,
            fresh_logs: 3,
        }
    }
}
