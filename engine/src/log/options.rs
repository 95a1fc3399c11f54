//! What a log is opened with: [`LogOptions`], the [`Compression`] choice, the
//! [`CompactionPolicy`], and the defaults of the write path's sizes.

use crate::error::{Error, Result};

use super::MAX_VALUE_BYTES;

/// Per-record payload compression.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// Store payloads as they are.
    #[default]
    None,
    /// lz4-compress each payload, kept only when it saves at least 1/8 of the bytes.
    Lz4,
}

/// Options for [`SegmentLog::open`](crate::SegmentLog::open).
#[derive(Debug, Clone)]
pub struct LogOptions {
    /// Size of each segment file (rounded up to the I/O alignment). A record too large for an empty
    /// segment gets a segment of its own, sized to fit.
    pub segment_bytes: u64,
    /// Payload compression for new records.
    pub compression: Compression,
    /// Create the store directory if it does not exist.
    pub create_if_missing: bool,
    /// Largest value accepted, in bytes.
    pub max_value_bytes: u64,
    /// Compact automatically when a segment is sealed and a closed segment is sparse by `compaction`.
    pub auto_compact: bool,
    /// Which closed segments compaction relocates (the default keeps them at least half live).
    pub compaction: CompactionPolicy,
    /// With a backend that queues writes (io_uring), a batch is encoded and written in groups of about
    /// this many bytes, several in flight at once, so encoding overlaps writing. Default 1 MiB.
    pub write_group_bytes: u64,
    /// With a backend that writes gathered slices (buffered portable files), a batch holding a value
    /// of at least this many bytes is written with one `pwritev` straight from the values' buffers,
    /// without copying them into a staging buffer. Default 256 KiB.
    pub gather_min_bytes: u64,
    /// In such a gathered write, large values adding up to at least this many bytes get their crcs
    /// computed on a helper thread while the write copies them into the page cache, and their record
    /// heads are written last. Default 4 MiB; `u64::MAX` keeps everything on the calling thread.
    pub parallel_crc_min_bytes: u64,
    /// I/O alignment override (power of two, 512..=65536); `None` asks the backend (statx).
    pub alignment: Option<usize>,
    /// Release a forgotten record's blocks with a hole punch (`fallocate`), for values of
    /// 256 KiB and more. For logs whose contents die with the process (a spill store), where it frees
    /// disk space and page cache the way unlinking a file would. A punched record no longer reads back,
    /// so such a log should not be reopened: the store discards it at open instead. On real files
    /// the punch runs on the log's punch thread and `forget` does not wait for it;
    /// [`SegmentLog::settle_punches`](crate::SegmentLog::settle_punches) does.
    pub punch_forgotten: bool,
    /// At open, delete whatever segments the directory holds instead of recovering them (after taking
    /// the directory's lock): for a spill store, whose data dies with its process. Files in
    /// `segments/` that are not named like segments are left alone (with a warning), as recovery does.
    pub discard_existing: bool,
    /// Reuse the files of deleted segments as new segments (up to 4 kept, renamed
    /// when reused) instead of unlinking them and creating and preallocating new ones. Overwriting
    /// blocks that were written before costs the file system nothing beyond the write, while a fresh
    /// preallocated file costs a creation, an unwritten-extent conversion on every write, and an
    /// unlink (a discard, on file systems mounted with `discard`) when it dies. A reused file keeps
    /// the bytes of its earlier life past what is written, so only a log that is never recovered may
    /// do it: it requires `discard_existing`. At open, the files of the last run's segments that
    /// have the usual size (up to 256 of them) are kept the same way instead of deleted, and held
    /// until new segments take them or the log closes. Needs [`Backend::rename`](crate::Backend::rename) (otherwise files
    /// are unlinked).
    pub recycle_segments: bool,
    /// fdatasync on its own where crash consistency needs it: before sealing a segment and before
    /// deleting one. Turn off for data that dies with the process (a spill store); `sync()` still
    /// syncs when called.
    pub durable: bool,
    /// Write-behind: small batches are kept in memory, encoded, until this many bytes are pending,
    /// and then written together, so a stream of small puts costs one write per this many bytes
    /// instead of one per put. 0 (the default) writes every batch before `put` returns. Pending
    /// records are readable at once (a read of one copies it out of memory); `sync`, sealing a
    /// segment, `stored_value` and dropping the log write them too. The price: a process crash loses the pending bytes, which a spill store, whose
    /// data dies with its process anyway, does not mind. At most 64 MiB.
    pub write_behind_bytes: u64,
}

impl Default for LogOptions {
    fn default() -> Self {
        LogOptions {
            segment_bytes: 64 << 20,
            compression: Compression::None,
            create_if_missing: true,
            max_value_bytes: MAX_VALUE_BYTES,
            auto_compact: true,
            compaction: CompactionPolicy::default(),
            alignment: None,
            write_group_bytes: WRITE_GROUP_BYTES,
            gather_min_bytes: GATHER_MIN_BYTES,
            parallel_crc_min_bytes: PARALLEL_CRC_MIN_BYTES,
            punch_forgotten: false,
            discard_existing: false,
            recycle_segments: false,
            durable: true,
            write_behind_bytes: 0,
        }
    }
}

/// Which closed segments compaction relocates: the rule behind the log's space bound.
///
/// A closed segment is *sparse* when its live bytes, plus the tombstone bytes it must keep, are
/// less than `min_live_percent` percent of its size (less the bytes already punched out of it).
/// [`SegmentLog::compact`](crate::SegmentLog::compact) relocates the live records of every sparse closed segment and deletes it,
/// so afterwards every closed segment is at least `min_live_percent` live and
/// `disk bytes <= live bytes * 100 / min_live_percent + the active segment`
/// ([`CompactionPolicy::disk_bound`]; docs/architecture.md, "Bound"). The default, 50 percent, bounds
/// disk use to twice the live bytes plus one segment;
/// `compaction_brings_disk_use_within_the_documented_bound` (tests/tests/tombstones_gc.rs) checks it.
/// A higher percentage trades more copying for a tighter bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompactionPolicy {
    /// Smallest live share, in percent (1..=99), that a closed segment keeps without compaction.
    pub min_live_percent: u8,
}

impl Default for CompactionPolicy {
    fn default() -> Self {
        CompactionPolicy { min_live_percent: 50 }
    }
}

impl CompactionPolicy {
    /// Whether a closed segment holding `kept` bytes that must stay (live records and needed
    /// tombstones) out of `size` usable bytes is worth compacting.
    pub fn is_sparse(&self, kept: u64, size: u64) -> bool {
        kept as u128 * 100 < size as u128 * self.min_live_percent as u128
    }

    /// The most disk bytes a log holding `live` bytes uses right after [`SegmentLog::compact`](crate::SegmentLog::compact),
    /// with segments of `segment_bytes`: every closed segment at least `min_live_percent` live, plus
    /// the active segment (with `LogOptions::recycle_segments`, plus up to 4 files kept for reuse).
    pub fn disk_bound(&self, live: u64, segment_bytes: u64) -> u64 {
        (live as u128 * 100 / self.min_live_percent.max(1) as u128) as u64 + segment_bytes
    }

    pub(super) fn validate(&self) -> Result<()> {
        if (1..=99).contains(&self.min_live_percent) {
            Ok(())
        } else {
            Err(Error::InvalidConfig(format!("compaction min_live_percent {} is not in 1..=99", self.min_live_percent)))
        }
    }
}

/// With a backend that queues writes, records are encoded and written in groups of about this size,
/// up to `WRITES_IN_FLIGHT` at once (see `write_chunk`). Measured for 1 MiB values in batches of 16
/// on io_uring with O_DIRECT: 0.72x fio as one 16 MiB write, 0.77x as 4 MiB groups 4 in flight,
/// 0.86-0.91x as 1 MiB groups 16 in flight (fio: 1 MiB writes, QD16).
const WRITE_GROUP_BYTES: u64 = 1 << 20;

/// Default `LogOptions::parallel_crc_min_bytes`.
const PARALLEL_CRC_MIN_BYTES: u64 = 4 << 20;

/// A chunk holding a value at least this large is written gathered (no staging copy) where the
/// backend supports it.
const GATHER_MIN_BYTES: u64 = 256 << 10;
