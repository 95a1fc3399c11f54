//! Values arriving in stored form: where they go ([`Store::admit`]: the one rule, for this store's
//! own transfers and for an embedding that receives them itself), [`Store::receive`] (memory or
//! disk), and `put_stream` (straight into the log), with a put or remove of the key meanwhile
//! winning over the arrival.

use std::sync::Arc;
use std::time::Instant;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::key::{KeyMap, KeySet};
use crate::log::StreamedValue;
use crate::stored;
use crate::sync::MutexGuard;

use super::entry::Entry;
use super::evict::{enforce, set_stuck, spill_allowed};
use super::metrics::Activity;
use super::put::{insert, put_large, wait_unwritten};
use super::remove::drop_stale_record;
use super::Inner;
use super::{Codec, Store};

/// The values arriving for keys right now: which keys have a transfer in progress (each loses to a
/// put or remove of its key that comes meanwhile: `true` once superseded), which of them arrive into
/// memory (a direct write of the key waits for them), and the bytes admitted into memory
/// ([`Store::admit`]) and not yet stored or let go of. A key's old value, if any, stays its value,
/// readable, until the new one lands.
#[derive(Default)]
pub(super) struct Transfers {
    streams: KeyMap<Arc<[u8]>, bool>,
    receiving: KeySet<Arc<[u8]>>,
    admitted: u64,
}

impl Transfers {
    /// A transfer of `k` begins, into the log.
    fn begin(&mut self, k: Arc<[u8]>) {
        self.streams.insert(k, false);
    }

    /// A transfer of `k` begins, into memory.
    fn begin_receiving(&mut self, k: Arc<[u8]>) {
        self.begin(k.clone());
        self.receiving.insert(k);
    }

    /// The transfer of `k` is over; returns whether a put or remove of the key superseded it.
    fn end(&mut self, k: &[u8]) -> bool {
        self.receiving.remove(k);
        self.streams.remove(k).expect("a transfer in progress")
    }

    /// A put or remove of `key` came: a transfer of it in progress loses.
    pub(super) fn supersede(&mut self, key: &[u8]) {
        if let Some(s) = self.streams.get_mut(key) {
            *s = true;
        }
    }

    /// Whether a transfer of `key` is in progress.
    pub(super) fn contains(&self, key: &[u8]) -> bool {
        self.streams.contains_key(key)
    }

    /// Whether `key`'s value is arriving into memory.
    pub(super) fn receiving(&self, key: &[u8]) -> bool {
        self.receiving.contains(key)
    }
}

pub(super) fn put_stream<C: Codec, B: Backend>(
    store: &Store<C, B>,
    key: &[u8],
    meta: &StreamedValue,
    src: &mut dyn std::io::Read,
) -> Result<bool> {
    let raw = meta.frame_lens.iter().try_fold(0u64, |a, &l| a.checked_add(l)).ok_or(Error::ValueTooLarge {
        len: u64::MAX,
        max: store.logs.current().options().max_value_bytes,
        unit: "bytes",
    })?;
    let mut inner = wait_unwritten(store, store.lock(), key);
    // The record it replaces (if any) stops counting against max_spill once this one lands.
    let replaced = inner.table.get(key).map_or(0, |e| e.disk_raw);
    if !spill_allowed(store, &mut inner, key, raw.saturating_sub(replaced)) {
        return receive_serialized(store, inner, key, meta, src, true);
    }
    // The old value (if any) stays the key's, readable where it is, until the streamed record is
    // published whole; a failed transfer publishes nothing. Being in `writes`, the key is not
    // spilled meanwhile (its eviction, or a `put_large`, waits for this write), nor promoted by a
    // read (`get::finish_get`): its entry and its record stay as they are.
    let k: Arc<[u8]> = Arc::from(key);
    inner.transfers.begin(k.clone());
    inner.writes.begin(k.clone(), 0, raw);
    drop(inner);
    let t = Instant::now();
    // A panic of the caller's reader (or the log) still settles the store before it goes on.
    let streamed = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.logs.put_stream(key, meta, src)));
    let mut inner = store.lock();
    inner.writes.end(&k, 0, raw);
    store.written.notify_all();
    // A put of the key (in memory: its eviction waited for this write) or a remove came
    // meanwhile.
    let superseded = inner.transfers.end(&k);
    let streamed = match streamed {
        Ok(streamed) => streamed,
        Err(panic) => {
            inner.table.unstick();
            drop(inner);
            std::panic::resume_unwind(panic);
        }
    };
    if let Err(e) = streamed {
        if !e.is_no_space() {
            // The space this stream reserved against max_spill is free again (unless the disk
            // is full, when retrying the refused evictions would only fail again).
            inner.table.unstick();
        }
        return Err(e);
    }
    store.metrics.add(Activity::DiskWrite, 1, raw, t.elapsed().as_nanos() as u64);
    settle_streamed(store, &mut inner, key, raw, superseded)
}

/// A value streamed to disk whole (`raw` bytes laid out) becomes `key`'s entry on disk, unless a
/// put or remove of the key came meanwhile (`superseded`): then its record is dropped. Either frees
/// disk space when something was superseded, so spills refused for want of it may try again.
/// Returns whether the value is now the key's.
fn settle_streamed<C: Codec, B: Backend>(
    store: &Store<C, B>,
    inner: &mut Inner<C::Value>,
    key: &[u8],
    raw: u64,
    superseded: bool,
) -> Result<bool> {
    if superseded {
        inner.table.unstick();
        drop_stale_record(store, key);
        return Ok(false);
    }
    // The streamed record replaced the old one in the log (and in older logs: `Logs::put_stream`):
    // the old entry leaves the table without touching the log.
    if inner.table.take(key).is_some_and(|old| old.disk_bytes > 0) {
        inner.table.unstick();
    }
    let len = store.logs.location(key).map_or(0, |l| l.len);
    let e = Entry::on_disk(raw, (raw, len), raw > store.target());
    insert(store, inner, key, e)?;
    Ok(true)
}

pub(super) fn receive<C: Codec, B: Backend>(
    store: &Store<C, B>,
    key: &[u8],
    meta: &StreamedValue,
    src: &mut dyn std::io::Read,
) -> Result<bool> {
    stored::check_announced(meta)?;
    let total: u64 = meta.frame_lens.iter().sum(); // laid out within u64: checked above
    if !store.admit(total) {
        return store.put_stream(key, meta, src);
    }
    /// The admission, let go of however the receive ends.
    struct Admitted<'a, C: Codec, B: Backend>(&'a Store<C, B>, u64);
    impl<C: Codec, B: Backend> Drop for Admitted<'_, C, B> {
        fn drop(&mut self) {
            self.0.release_admitted(self.1);
        }
    }
    let _admitted = Admitted(store, total);
    receive_serialized(store, store.lock(), key, meta, src, false)
}

pub(super) fn admit<C: Codec, B: Backend>(store: &Store<C, B>, nbytes: u64) -> bool {
    let headroom = store.process_headroom(); // (reads the RSS: without the lock)
    let mut inner = store.lock();
    let admitted = inner.transfers.admitted.saturating_add(nbytes);
    let fits = inner.table.totals().mem_bytes().saturating_add(admitted) <= store.target()
        && headroom.is_none_or(|h| admitted <= h);
    if fits {
        inner.transfers.admitted = admitted;
    }
    fits
}

pub(super) fn release_admitted<C: Codec, B: Backend>(store: &Store<C, B>, nbytes: u64) {
    let mut inner = store.lock();
    inner.transfers.admitted = inner.transfers.admitted.saturating_sub(nbytes);
}

/// [`Store::receive`] into memory, with the store's lock held on entry. `put_stream` calls it for a value
/// `refused` by `max_spill`, which stays in memory as `put_large` keeps a refused value, without
/// asking `max_spill` (and counting a refusal) again. Returns whether the value is now the key's.
pub(super) fn receive_serialized<'a, C: Codec, B: Backend>(
    store: &'a Store<C, B>,
    inner: MutexGuard<'a, Inner<C::Value>>,
    key: &[u8],
    meta: &StreamedValue,
    src: &mut dyn std::io::Read,
    refused: bool,
) -> Result<bool> {
    let mut inner = wait_unwritten(store, inner, key);
    let k: Arc<[u8]> = Arc::from(key);
    inner.transfers.begin_receiving(k.clone());
    drop(inner);
    let max = store.logs.current().options().max_value_bytes;
    let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| stored::read(meta, src, max)));
    let mut inner = store.lock();
    let superseded = inner.transfers.end(&k);
    store.written.notify_all();
    let frames = match got {
        Ok(frames) => frames?,
        Err(panic) => {
            drop(inner);
            std::panic::resume_unwind(panic);
        }
    };
    if superseded {
        return Ok(false);
    }
    if frames.total_len() > store.target() {
        if !refused {
            return put_large(store, inner, key, frames, None, true, None).map(|()| true);
        }
        let k = insert(store, &mut inner, key, Entry::serialized(frames, true))?;
        set_stuck(store, &mut inner, &k);
        return Ok(true);
    }
    let e = Entry::serialized(frames, false);
    let slot = e.slot.clone();
    insert(store, &mut inner, key, e)?;
    enforce(store, inner, Some(&slot)).map(|()| true)
}
