//! Metrics: the [`Activity`] counters (count, bytes, time), and [`MetricsSnapshot`] with the
//! accounting, in Prometheus text with dask's names.
//!
//! Every count also goes to a ledger of the thread that did the work ([`take_thread_metrics`]): a
//! store call does its work on the caller's thread, so what the ledger gained across a call is that
//! call's own work (its serializing, writing, reading...), whatever other threads did meanwhile.
//! An embedding reports it under the activity that made the call (dask's `context_meter`).

use std::time::Instant;

use crate::sync::{AtomicU64, Ordering};

use super::entry::{Totals, TIERS};

/// What the store spends its time on: each has a count, bytes and time in the metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Activity {
    /// `Codec::serialize` of an object being spilled.
    Serialize,
    /// lz4 compression of frames kept in memory (`compress_in_memory`).
    Compress,
    /// Writing records to the log.
    DiskWrite,
    /// Reading records back from the log.
    DiskRead,
    /// Decompressing an in-memory lz4 block.
    Decompress,
    /// `Codec::deserialize` on a get.
    Deserialize,
    /// A get answered from memory: an object (bytes: its weight) or frames (their length).
    MemoryRead,
    /// An eviction that wrote nothing: the value's verified copy on disk is what it serializes to
    /// ([`EvictionPolicy::verify_copies`](crate::EvictionPolicy::verify_copies)).
    DiskWriteSaved,
}

impl Activity {
    /// Every activity, in the order metrics list them.
    pub const ALL: [Activity; 8] = [
        Activity::Serialize,
        Activity::Compress,
        Activity::DiskWrite,
        Activity::DiskRead,
        Activity::Decompress,
        Activity::Deserialize,
        Activity::MemoryRead,
        Activity::DiskWriteSaved,
    ];

    /// The activity's name in metrics (`disk-write`, ...), as dask names its spill activities.
    pub fn name(self) -> &'static str {
        match self {
            Activity::Serialize => "serialize",
            Activity::Compress => "compress",
            Activity::DiskWrite => "disk-write",
            Activity::DiskRead => "disk-read",
            Activity::Decompress => "decompress",
            Activity::Deserialize => "deserialize",
            Activity::MemoryRead => "memory-read",
            Activity::DiskWriteSaved => "disk-write-saved",
        }
    }
}

/// Count, bytes and time of one activity.
#[derive(Debug, Default)]
pub(super) struct Counter {
    count: AtomicU64,
    bytes: AtomicU64,
    ns: AtomicU64,
}

impl Counter {
    pub(super) fn snap(&self) -> ActivityStats {
        ActivityStats {
            count: self.count.load(Ordering::Relaxed),
            bytes: self.bytes.load(Ordering::Relaxed),
            ns: self.ns.load(Ordering::Relaxed),
        }
    }
}

#[derive(Debug, Default)]
pub(super) struct Metrics {
    acts: [Counter; Activity::ALL.len()],
    max_spill_refusals: AtomicU64,
    spill_failures: AtomicU64,
}

impl Metrics {
    /// Count a spill `max_spill` refused.
    pub(super) fn max_spill_refused(&self) {
        self.max_spill_refusals.fetch_add(1, Ordering::Relaxed);
    }

    /// Count a spill that failed (the value could not be serialized, or the disk refused it).
    pub(super) fn spill_failed(&self) {
        self.spill_failures.fetch_add(1, Ordering::Relaxed);
    }

    pub(super) fn counter(&self, a: Activity) -> &Counter {
        &self.acts[a as usize]
    }
    /// Count one `a` of `bytes` that started at `since`.
    pub(super) fn record(&self, a: Activity, bytes: u64, since: Instant) {
        self.add(a, 1, bytes, since.elapsed().as_nanos() as u64);
    }
    /// Count `count` of `a`, of `bytes` in all, that took `ns`.
    pub(super) fn add(&self, a: Activity, count: u64, bytes: u64, ns: u64) {
        let c = self.counter(a);
        c.count.fetch_add(count, Ordering::Relaxed);
        c.bytes.fetch_add(bytes, Ordering::Relaxed);
        if ns > 0 {
            c.ns.fetch_add(ns, Ordering::Relaxed);
        }
        note_thread(a, count, bytes, ns);
    }
}

std::thread_local! {
    /// This thread's ledger (see the module's notes).
    static THREAD: std::cell::RefCell<[ActivityStats; Activity::ALL.len()]> =
        const { std::cell::RefCell::new([ActivityStats { count: 0, bytes: 0, ns: 0 }; Activity::ALL.len()]) };
}

/// Add to this thread's ledger only (work counted in the store's totals another way).
pub(super) fn note_thread(a: Activity, count: u64, bytes: u64, ns: u64) {
    THREAD.with(|t| {
        let mut t = t.borrow_mut();
        let s = &mut t[a as usize];
        s.count += count;
        s.bytes += bytes;
        s.ns += ns;
    });
}

/// What the stores of this process counted on this thread since the last call on it, per activity
/// that moved (see the module's notes); the ledger starts again from zero.
pub fn take_thread_metrics() -> Vec<(Activity, ActivityStats)> {
    THREAD.with(|t| {
        let taken = std::mem::take(&mut *t.borrow_mut());
        Activity::ALL.iter().map(|&a| (a, taken[a as usize])).filter(|(_, s)| *s != ActivityStats::default()).collect()
    })
}

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
    /// Weight of what is on disk: each value's weight when it was last in memory (`size_of` of an
    /// object, a length for frames), as dask's `spilled_total.memory` counts it.
    pub spilled_weight: u64,
    /// Serialized bytes of the values on disk, not counting the copies that values read back
    /// keep (`spilled_memory_bytes` counts those too).
    pub spilled_raw: u64,
    /// Bytes on disk for what is spilled.
    pub spilled_disk_bytes: u64,
    /// Spills refused because `max_spill_bytes` would be exceeded.
    pub max_spill_refusals: u64,
    /// Evictions that failed (serialize or disk error) and kept the value in memory.
    pub spill_failures: u64,
}

impl MetricsSnapshot {
    /// The stats of activity `a`.
    pub fn of(&self, a: Activity) -> ActivityStats {
        self.activity(a.name())
    }

    /// The activity with this name ([`Activity::name`]).
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

impl Metrics {
    /// A snapshot of the counters with the store's `totals` and the gets answered with an object
    /// in memory (`object_reads`: count and weight, part of [`Activity::MemoryRead`]). The counters
    /// are read one after another while other threads may be bumping them, so two counters of one
    /// snapshot need not be from the same instant.
    pub(super) fn snapshot(&self, totals: &Totals, object_reads: (u64, u64)) -> MetricsSnapshot {
        MetricsSnapshot {
            activities: Activity::ALL
                .iter()
                .map(|&a| {
                    let mut st = self.counter(a).snap();
                    if a == Activity::MemoryRead {
                        st.count += object_reads.0;
                        st.bytes += object_reads.1;
                    }
                    (a.name(), st)
                })
                .collect(),
            tier_bytes: TIERS.iter().map(|t| (t.name(), totals.tier_bytes(*t))).collect(),
            tier_entries: TIERS.iter().map(|t| (t.name(), totals.tier_count(*t))).collect(),
            memory_bytes: totals.mem_bytes(),
            spilled_memory_bytes: totals.disk_raw(),
            spilled_weight: totals.disk_weight(),
            spilled_raw: totals.spilled_raw(),
            spilled_disk_bytes: totals.disk_bytes(),
            max_spill_refusals: self.max_spill_refusals.load(Ordering::Relaxed),
            spill_failures: self.spill_failures.load(Ordering::Relaxed),
        }
    }
}
