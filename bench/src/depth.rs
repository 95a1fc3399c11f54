//! Jobs with more than one operation in flight per thread (`--iodepth`).
//!
//! Reads: `iodepth` [`SegmentLog::get_async`] futures per job thread, driven by a small poll loop
//! whose wakers queue the slot that became ready; a finished slot immediately starts the next read.
//! On io_uring the reads are really concurrent; on the portable backend a read completes inside
//! `get_async`, so depth buys nothing there (as with fio's psync engine).
//!
//! Writes: batches of `iodepth` values per `put_many`, which the log lays out as one aligned write;
//! with O_DIRECT the block layer splits it into requests that the device serves in parallel. Each value
//! of a batch is recorded with the batch's latency (its completion time).

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::{Context, Poll, Wake, Waker};
use std::thread::{self, Thread};
use std::time::Instant;

use anyhow::{Context as _, Result};
use rand::rngs::SmallRng;
use rand::Rng;
use spillway::{AutoBackend, Frames, SegmentLog};

use crate::{key, Args, Rw, Side};

type ReadFut = Pin<Box<dyn Future<Output = spillway::Result<Option<Frames>>> + Send>>;

struct SlotWaker {
    slot: usize,
    ready: Arc<Mutex<Vec<usize>>>,
    thread: Thread,
}

impl Wake for SlotWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.ready.lock().unwrap_or_else(PoisonError::into_inner).push(self.slot);
        self.thread.unpark();
    }
}

fn more(args: &Args, issued: u64, nkeys: u64, deadline: Option<Instant>) -> bool {
    if deadline.is_some_and(|d| Instant::now() >= d) {
        return false;
    }
    issued < nkeys || (args.time_based && deadline.is_some())
}

/// `--iodepth` reads per job thread.
#[allow(clippy::too_many_arguments)]
pub(crate) fn reads(
    log: &Arc<SegmentLog<AutoBackend>>,
    args: &Args,
    rw: Rw,
    job: usize,
    nkeys: u64,
    deadline: Option<Instant>,
    done: &AtomicU64,
    rng: &mut SmallRng,
) -> Result<(Side, Side)> {
    let depth = args.iodepth;
    let ready = Arc::new(Mutex::new(Vec::new()));
    let wakers: Vec<Waker> = (0..depth)
        .map(|slot| Waker::from(Arc::new(SlotWaker { slot, ready: ready.clone(), thread: thread::current() })))
        .collect();
    let mut slots: Vec<Option<(Instant, Vec<u8>, ReadFut)>> = (0..depth).map(|_| None).collect();
    let mut issued = 0u64;
    let mut start = |issued: &mut u64| -> (Instant, Vec<u8>, ReadFut) {
        let k = if rw == Rw::Read { key(job, *issued % nkeys) } else { key(job, rng.gen_range(0..nkeys)) };
        *issued += 1;
        let t = Instant::now();
        let fut: ReadFut = Box::pin(log.get_async(&k));
        (t, k, fut)
    };
    let mut to_poll = Vec::new();
    for (i, s) in slots.iter_mut().enumerate() {
        if more(args, issued, nkeys, deadline) {
            *s = Some(start(&mut issued));
            to_poll.push(i);
        }
    }
    let mut r = Side::new();
    let mut active = to_poll.len();
    while active > 0 {
        if to_poll.is_empty() {
            to_poll = std::mem::take(&mut *ready.lock().unwrap_or_else(PoisonError::into_inner));
            if to_poll.is_empty() {
                thread::park();
                continue;
            }
        }
        let mut again = Vec::new();
        for i in to_poll.drain(..) {
            let Some((t, k, fut)) = &mut slots[i] else { continue };
            let Poll::Ready(res) = fut.as_mut().poll(&mut Context::from_waker(&wakers[i])) else { continue };
            let v = res?.with_context(|| format!("key {} missing", String::from_utf8_lossy(k)))?;
            r.record(t.elapsed().as_nanos() as u64, v.total_len());
            done.fetch_add(args.bs, Ordering::Relaxed);
            if more(args, issued, nkeys, deadline) {
                slots[i] = Some(start(&mut issued));
                again.push(i);
            } else {
                slots[i] = None;
                active -= 1;
            }
        }
        to_poll = again;
    }
    Ok((r, Side::new()))
}

/// `--iodepth` values per `put_many`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn writes(
    log: &Arc<SegmentLog<AutoBackend>>,
    args: &Args,
    rw: Rw,
    job: usize,
    nkeys: u64,
    deadline: Option<Instant>,
    done: &AtomicU64,
    rng: &mut SmallRng,
    value: &Frames,
) -> Result<(Side, Side)> {
    let mut w = Side::new();
    let mut issued = 0u64;
    while more(args, issued, nkeys, deadline) {
        let n = if args.time_based { args.iodepth as u64 } else { (args.iodepth as u64).min(nkeys - issued) };
        let keys: Vec<Vec<u8>> = (0..n)
            .map(|j| if rw == Rw::Write { key(job, (issued + j) % nkeys) } else { key(job, rng.gen_range(0..nkeys)) })
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
