//! Jobs with more than one operation in flight per thread (`--iodepth`).
//!
//! Reads: [`SegmentLog::get_pipelined`] with `iodepth` reads in flight per job thread. On io_uring
//! the job thread owns a ring, as fio's io_uring engine does; on the portable backend reads run one
//! after another, so depth buys nothing there (as with fio's psync engine).
//!
//! Writes: batches of `iodepth` values per `put_many`, which the log lays out as one aligned write;
//! with O_DIRECT the block layer splits it into requests that the device serves in parallel. Each value
//! of a batch is recorded with the batch's latency (its completion time).

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Result;
use rand::rngs::SmallRng;
use rand::Rng;
use spillway::{AutoBackend, Frames, SegmentLog};

use crate::log_jobs::{key, Side};
use crate::{Args, LogOp};

fn more(args: &Args, issued: u64, nkeys: u64, deadline: Option<Instant>) -> bool {
    if deadline.is_some_and(|d| Instant::now() >= d) {
        return false;
    }
    issued < nkeys || (args.time_based && deadline.is_some())
}

/// What one job thread works on.
pub(crate) struct Job<'a> {
    pub log: &'a Arc<SegmentLog<AutoBackend>>,
    pub args: &'a Args,
    pub rw: LogOp,
    /// Index of the job thread (its key range).
    pub job: usize,
    /// Keys per job thread.
    pub nkeys: u64,
    pub deadline: Option<Instant>,
    /// Bytes done by all jobs (for the progress line).
    pub done: &'a AtomicU64,
}

/// `--iodepth` reads per job thread, through [`SegmentLog::get_pipelined`]: on io_uring the job
/// thread owns a ring and keeps `iodepth` reads in flight, submitting and reaping itself.
pub(crate) fn reads(j: &Job<'_>, rng: &mut SmallRng) -> Result<(Side, Side)> {
    let Job { log, args, rw, job, nkeys, deadline, done } = *j;
    let mut issued = 0u64;
    // Start times of the reads in flight, by key, oldest first. Only keys in flight have an entry,
    // so the map stays as small as the depth. A random key may be in flight twice, and its reads
    // may complete in either order: the oldest start is then given to the first completion, which
    // can swap two latencies (the statistics only, never a result).
    let mut started: HashMap<Vec<u8>, VecDeque<Instant>> = HashMap::new();
    let mut r = Side::new();
    let mut failure: Option<anyhow::Error> = None;
    let started_ref = std::cell::RefCell::new(&mut started);
    let mut keys = std::iter::from_fn(|| {
        if !more(args, issued, nkeys, deadline) {
            return None;
        }
        let k = if rw == LogOp::Read { key(job, issued % nkeys) } else { key(job, rng.gen_range(0..nkeys)) };
        issued += 1;
        started_ref.borrow_mut().entry(k.clone()).or_default().push_back(Instant::now());
        Some(k)
    });
    log.get_pipelined(args.iodepth, &mut keys, &mut |k, res| {
        let t = {
            let mut started = started_ref.borrow_mut();
            let times = started.get_mut(&k).expect("started");
            let t = times.pop_front().expect("started");
            if times.is_empty() {
                started.remove(&k);
            }
            t
        };
        match res {
            Ok(Some(v)) => {
                r.record(t.elapsed().as_nanos() as u64, v.total_len());
                done.fetch_add(args.bs, Ordering::Relaxed);
            }
            Ok(None) => {
                failure.get_or_insert_with(|| anyhow::anyhow!("key {} missing", String::from_utf8_lossy(&k)));
            }
            Err(e) => {
                failure.get_or_insert(e.into());
            }
        }
    })?;
    match failure {
        Some(e) => Err(e),
        None => Ok((r, Side::new())),
    }
}

/// `--iodepth` values per `put_many`.
pub(crate) fn writes(j: &Job<'_>, rng: &mut SmallRng, value: &Frames) -> Result<(Side, Side)> {
    let Job { log, args, rw, job, nkeys, deadline, done } = *j;
    let mut w = Side::new();
    let mut issued = 0u64;
    while more(args, issued, nkeys, deadline) {
        let n = if args.time_based { args.iodepth as u64 } else { (args.iodepth as u64).min(nkeys - issued) };
        let keys: Vec<Vec<u8>> = (0..n)
            .map(
                |j| if rw == LogOp::Write { key(job, (issued + j) % nkeys) } else { key(job, rng.gen_range(0..nkeys)) },
            )
            .collect();
        let items: Vec<(&[u8], &Frames)> = keys.iter().map(|k| (&k[..], value)).collect();
        let t = Instant::now();
        log.put_many(&items)?;
        let ns = t.elapsed().as_nanos() as u64;
        for _ in 0..n {
            w.record(ns, args.bs);
        }
        done.fetch_add(args.bs * n, Ordering::Relaxed);
        issued += n;
    }
    Ok((Side::new(), w))
}
