//! A store's segment logs: the one spills go to, and the read-only ones failed writes left behind.
//!
//! A write that fails with an I/O error (EIO) leaves a log read-only for good: it cannot tell what
//! reached the file (`SegmentLog::poisoned`). A spill store whose log turned read-only would keep
//! everything in memory from then on, and its process would run out of memory, while one failed write
//! to dask's file-per-key store fails only that write. So a spill store opens a *fresh* log in a
//! subdirectory (`fresh-1`, `fresh-2`, ...: new segment files, through a backend made by
//! [`Backend::fresh`]), retries the write that failed there, and sends later writes there too. The
//! read-only log keeps serving its records (each read checks its crc) until they are read back,
//! removed or replaced; a key has its record in one log at a time (a write to a newer log forgets it
//! in the older ones). After [`StoreConfig::fresh_logs`](crate::StoreConfig::fresh_logs) fresh logs (a disk that fails that often is
//! failing), the last read-only one stays: spills fail as disk errors, and that data is kept in memory
//! from now on is logged once. A persistent store never replaces its log: its durable contents are in
//! that log, and a read-only log is the safe answer to a failed fsync.
//!
//! The fresh logs live in slots set once and never emptied before the store is dropped; which one is
//! written is an index that only grows. Both are settings outside the loom models' state (which
//! never replace a log): readers of the index see either log, and a write to the log that just
//! turned read-only fails and is retried like any failed write.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool as StdAtomicBool, AtomicUsize as StdAtomicUsize, Ordering as StdOrdering};
use std::sync::{Mutex as StdMutex, OnceLock};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::log::{Location, LogOptions, SegmentLog, StreamedValue};
use crate::value::Frames;

/// Most fresh logs a store can open in its life (the cap of [`StoreConfig::fresh_logs`](crate::StoreConfig::fresh_logs)).
pub const MAX_FRESH_LOGS: u32 = 8;

pub(super) struct Logs<B: Backend> {
    first: SegmentLog<B>,
    /// Boxed: a log is large, and a store is built on the stack (on a loom model's small one too).
    fresh: [OnceLock<Box<SegmentLog<B>>>; MAX_FRESH_LOGS as usize],
    /// The slot spills go to.
    current: StdAtomicUsize,
    /// Fresh logs this store may open (0 for a persistent store).
    allowed: usize,
    /// The store's directory (the first log's), under which fresh logs go.
    dir: PathBuf,
    opts: LogOptions,
    /// Held while a fresh log is opened (one thread replaces; the others then use it).
    replacing: StdMutex<()>,
    /// No fresh log will be opened any more (the last allowed one failed, or one could not be
    /// opened); said once.
    exhausted: StdAtomicBool,
}

impl<B: Backend> Logs<B> {
    pub(super) fn new(first: SegmentLog<B>, dir: PathBuf, opts: LogOptions, allowed: u32) -> Self {
        Logs {
            first,
            fresh: std::array::from_fn(|_| OnceLock::new()),
            current: StdAtomicUsize::new(0),
            allowed: allowed.min(MAX_FRESH_LOGS) as usize,
            dir,
            opts,
            replacing: StdMutex::new(()),
            exhausted: StdAtomicBool::new(allowed == 0),
        }
    }

    fn at(&self, i: usize) -> &SegmentLog<B> {
        match i {
            0 => &self.first,
            _ => self.fresh[i - 1].get().expect("a slot up to `current` holds a log"),
        }
    }

    fn current_index(&self) -> usize {
        self.current.load(StdOrdering::Acquire)
    }

    /// The log spills go to.
    pub(super) fn current(&self) -> &SegmentLog<B> {
        self.at(self.current_index())
    }

    /// Every log, the first (the store's directory) first.
    pub(super) fn all(&self) -> impl Iterator<Item = &SegmentLog<B>> {
        std::iter::once(&self.first).chain(self.fresh.iter().map_while(|s| s.get().map(|b| &**b)))
    }

    /// Whether a failed write has made the store open a fresh log.
    pub(super) fn replaced(&self) -> bool {
        self.current_index() > 0
    }

    /// The log that holds `key`'s record, if any (the newest first; a store that never replaced
    /// its log answers its one log without a lookup).
    pub(super) fn of(&self, key: &[u8]) -> Option<&SegmentLog<B>> {
        let cur = self.current_index();
        if cur == 0 {
            return Some(self.at(0));
        }
        (0..=cur).rev().map(|i| self.at(i)).find(|l| l.location(key).is_some())
    }

    pub(super) fn location(&self, key: &[u8]) -> Option<Location> {
        self.of(key).and_then(|l| l.location(key))
    }

    /// The log that holds `key`'s record (its number) and the record's location in it.
    pub(super) fn place(&self, key: &[u8]) -> Option<(usize, Location)> {
        let cur = self.current_index();
        (0..=cur).rev().find_map(|i| self.at(i).location(key).map(|loc| (i, loc)))
    }

    /// Whether `key`'s record, if it has one, is in the log spills go to.
    pub(super) fn in_current(&self, key: &[u8]) -> bool {
        self.current().location(key).is_some()
    }

    pub(super) fn get(&self, key: &[u8]) -> Result<Option<Frames>> {
        self.of(key).map_or(Ok(None), |l| l.get(key))
    }

    pub(super) fn get_with_crc(&self, key: &[u8]) -> Result<Option<(Frames, Option<u32>)>> {
        self.of(key).map_or(Ok(None), |l| l.get_with_crc(key))
    }

    pub(super) async fn get_async(&self, key: &[u8]) -> Result<Option<Frames>> {
        match self.of(key) {
            Some(l) => l.get_async(key).await,
            None => Ok(None),
        }
    }

    /// Drop `key`'s record without a tombstone, from whichever log holds it.
    pub(super) fn forget(&self, key: &[u8]) -> Result<bool> {
        let cur = self.current_index();
        let mut any = false;
        for i in (0..=cur).rev() {
            any |= self.at(i).forget(key)?;
        }
        Ok(any)
    }

    /// Records in every log (for `check_accounting`).
    pub(super) fn len(&self) -> usize {
        self.all().map(|l| l.len()).sum()
    }

    /// Write `items` to the current log. If the write fails and leaves that log read-only, open a
    /// fresh log (unless the store may not, or has opened its last) and write them there. Returns
    /// the log they went to. A write that fails may still have stored some of them (a log's
    /// `put_many` is not atomic across segments): each such key keeps only its newest record.
    pub(super) fn put_many(&self, items: &[(&[u8], &Frames)]) -> Result<&SegmentLog<B>> {
        let mut i = self.current_index();
        loop {
            let log = self.at(i);
            let r = log.put_many(items);
            self.forget_older(i, items.iter().map(|(k, _)| *k));
            match r {
                Ok(()) => return Ok(log),
                Err(e) if log.poisoned().is_some() => match self.replace(i) {
                    Some(next) => i = next,
                    None => return Err(e),
                },
                Err(e) => return Err(e),
            }
        }
    }

    /// [`SegmentLog::put_stream`] into the current log. The source cannot be read twice: a stream
    /// that made the log read-only is not retried, but the next write goes to a fresh log.
    pub(super) fn put_stream(&self, key: &[u8], meta: &StreamedValue, src: &mut dyn std::io::Read) -> Result<()> {
        let mut i = self.current_index();
        if self.at(i).poisoned().is_some() {
            // Made read-only by something other than a spill (a sync, another stream): the fresh
            // log is opened before the stream starts, not after it failed.
            i = self.replace(i).unwrap_or(i);
        }
        let log = self.at(i);
        let r = log.put_stream(key, meta, src);
        match &r {
            Ok(()) => self.forget_older(i, std::iter::once(key)),
            Err(_) if log.poisoned().is_some() => {
                let _ = self.replace(i);
            }
            Err(_) => {}
        }
        r
    }

    /// Keys just written to log `i`: those it holds have stale records in older logs.
    fn forget_older<'k>(&self, i: usize, keys: impl Iterator<Item = &'k [u8]>) {
        if i == 0 {
            return;
        }
        let log = self.at(i);
        for k in keys.filter(|k| log.location(k).is_some()) {
            for old in (0..i).map(|j| self.at(j)) {
                if old.location(k).is_some() {
                    let _ = old.forget(k); // (writes nothing: it cannot fail on a read-only log)
                }
            }
        }
    }

    /// Log `failed` turned read-only: the index of the log to write to now, opening a fresh one
    /// unless another thread did; `None` if there is none.
    fn replace(&self, failed: usize) -> Option<usize> {
        let _one = self.replacing.lock().unwrap_or_else(|p| p.into_inner());
        let cur = self.current_index();
        if cur != failed {
            return Some(cur); // another thread replaced it meanwhile
        }
        let old = self.at(cur);
        if self.exhausted.load(StdOrdering::Relaxed) {
            return None;
        }
        let reason = old.poisoned().unwrap_or("a failed write");
        if cur >= self.allowed {
            self.exhausted.store(true, StdOrdering::Relaxed);
            log::error!(
                "the spill log in {} is read-only ({reason}) and {} fresh logs failed before it; keeping data in \
                 memory from now on",
                old.dir().display(),
                self.allowed
            );
            return None;
        }
        let n = cur + 1;
        let dir = self.dir.join(format!("fresh-{n}"));
        let opened = old
            .backend()
            .fresh()
            .map_err(|e| Error::io("open a backend for a fresh log", dir.clone(), e))
            .and_then(|b| SegmentLog::open(b, &dir, self.opts.clone()));
        match opened {
            Ok(log) => {
                let _ = self.fresh[n - 1].set(Box::new(log));
                self.current.store(n, StdOrdering::Release);
                log::error!(
                    "the spill log in {} is read-only ({reason}); spilling to a fresh log in {} ({n} of {})",
                    old.dir().display(),
                    dir.display(),
                    self.allowed
                );
                Some(n)
            }
            Err(e) => {
                // Not retried at every failed write: the store keeps data in memory from now on.
                self.exhausted.store(true, StdOrdering::Relaxed);
                log::error!(
                    "the spill log in {} is read-only ({reason}) and no fresh log could be opened in {} ({e}); \
                     keeping data in memory from now on",
                    old.dir().display(),
                    dir.display()
                );
                None
            }
        }
    }
}
