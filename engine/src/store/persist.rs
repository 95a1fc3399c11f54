//! `flush` of a persistent store: every value held only in memory is written and synced.

use std::sync::Arc;
use std::time::Instant;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::slot::Slot;
use crate::sync::{self, MutexGuard};
use crate::value::Frames;

use super::entry::{decompress, Compressed, Tier};
use super::evict::{
    end_settle, enforce, landing, serialize, spill_allowed, spill_failed, write_batch, Landing, Listed, Settled,
    EVICT_SCAN,
};
use super::metrics::Activity;
use super::Inner;
use super::{key_str, vanished, Codec, Store};

/// Passes of a persistent store's `flush` (write a disk copy of everything, wait for the writes)
/// while values are left in memory without their disk copy.
pub(super) const FLUSH_PASSES: usize = 4;

/// What a value's disk copy is made from.
enum Copy<V> {
    Object(sync::Arc<V>),
    Frames(Frames),
    Compressed(Box<Compressed>),
}

/// A disk copy `flush` writes.
struct Job<V> {
    key: Arc<[u8]>,
    /// Identifies the entry, as in [`Planned`](super::evict::Planned).
    slot: Arc<Slot<V, Error>>,
    copy: Copy<V>,
}

pub(super) fn flush<C: Codec, B: Backend>(store: &Store<C, B>) -> Result<()> {
    let mut inner = store.lock();
    if !store.cfg.persistent {
        inner = wait_for_writes(store, inner);
        drop(inner);
        return store.logs.current().sync();
    }
    // An explicit request to persist: values refused before are tried again.
    inner.table.unstick();
    // What this flush must write: the values held only in memory when it began (values put
    // meanwhile are the next flush's). Each is written by this flush, or by another thread's
    // eviction while this flush waits for it.
    let mut pending: Vec<Listed<C::Value>> = inner
        .table
        .iter()
        .filter(|(_, e)| e.tier != Tier::Disk && e.disk_bytes == 0)
        .map(|(k, e)| (k.clone(), e.slot.clone(), true))
        .collect();
    // Several passes: a key another thread was writing (or demoting, object -> frames, which
    // leaves it in memory) is skipped, waited for, and tried again. Bounded, in case other
    // threads' evictions keep demoting the same keys.
    for _ in 0..FLUSH_PASSES {
        for chunk in pending.chunks(EVICT_SCAN) {
            inner = persist_round(store, inner, chunk);
            // Let other threads in between rounds.
            drop(inner);
            inner = store.lock();
        }
        inner = wait_for_writes(store, inner);
        // Still to write: the listed keys still held only in memory, with whatever value they
        // hold now (a key replaced meanwhile is written with its new value).
        pending.retain_mut(|(k, slot, original)| match inner.table.get(k) {
            Some(e) if e.tier != Tier::Disk && e.disk_bytes == 0 => {
                if !Arc::ptr_eq(slot, &e.slot) {
                    *slot = e.slot.clone();
                    *original = false;
                }
                true
            }
            _ => false,
        });
        if pending.iter().all(|(k, ..)| inner.table.get(k).is_some_and(|e| e.stuck)) {
            break;
        }
    }
    // Values that replaced a listed one meanwhile were written if they could be, but are not
    // this flush's promise: only the listed values count.
    let only_in_memory = pending
        .iter()
        .filter(|(k, slot, original)| *original && inner.table.get(k).is_some_and(|e| Arc::ptr_eq(&e.slot, slot)))
        .count();
    // A value the flush wrote may have been kept in memory above the target (refused by
    // max_spill until now): it can be dropped for free now.
    let enforced = enforce(store, inner, None);
    store.logs.current().sync()?;
    enforced?;
    match only_in_memory {
        0 => Ok(()),
        keys => Err(Error::NotPersisted { keys }),
    }
}

/// Wait for the spill writes that started before this call.
pub(super) fn wait_for_writes<'a, C: Codec, B: Backend>(
    store: &'a Store<C, B>,
    mut inner: MutexGuard<'a, Inner<C::Value>>,
) -> MutexGuard<'a, Inner<C::Value>> {
    let now = inner.writes.next_ticket();
    while inner.writes.any_before(now) {
        inner = store.written.wait(inner).unwrap_or_else(|p| p.into_inner());
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
pub(super) fn persist_round<'a, C: Codec, B: Backend>(
    store: &'a Store<C, B>,
    mut inner: MutexGuard<'a, Inner<C::Value>>,
    keys: &[Listed<C::Value>],
) -> MutexGuard<'a, Inner<C::Value>> {
    let todo = plan_copies(&mut inner, keys);
    if todo.is_empty() {
        return inner;
    }
    drop(inner);
    let data: Vec<Result<Frames>> = todo.iter().map(|job| copy_frames(store, job)).collect();
    // max_spill: reserve what is written, as an eviction's batch does.
    let mut inner = store.lock();
    let mut reserved = 0u64;
    let allowed: Vec<bool> = data
        .iter()
        .zip(&todo)
        .map(|(d, job)| match d {
            Ok(f) if spill_allowed(store, &mut inner, &job.key, reserved + f.total_len()) => {
                reserved += f.total_len();
                true
            }
            _ => false,
        })
        .collect();
    inner.writes.reserve(reserved);
    drop(inner);
    let items: Vec<(&[u8], &Frames)> = todo
        .iter()
        .zip(&data)
        .zip(&allowed)
        .filter_map(|((j, d), &ok)| d.as_ref().ok().filter(|_| ok).map(|f| (&*j.key, f)))
        .collect();
    let (result, panicked) = write_batch(store, &items);
    let mut inner = store.lock();
    inner.writes.release(reserved);
    let mut settled = Settled::new(&result, todo.first().map(|j| &j.key), panicked);
    for ((job, d), &ok) in todo.iter().zip(&data).zip(&allowed) {
        settle_copy(store, &mut inner, job, d, ok, &mut settled);
    }
    end_settle(store, inner, settled)
}

/// The values of `keys` that still need a disk copy, each marked as being written, with what
/// it is copied from.
fn plan_copies<V>(inner: &mut Inner<V>, keys: &[Listed<V>]) -> Vec<Job<V>> {
    let mut todo = Vec::new();
    for (key, slot, _) in keys {
        let Some(e) = inner.table.get(key).filter(|e| Arc::ptr_eq(&e.slot, slot)) else { continue };
        if e.stuck || e.disk_bytes > 0 || inner.writes.contains(key) {
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
        inner.writes.begin(key.clone(), 0, 0);
        todo.push(Job { key: key.clone(), slot: slot.clone(), copy });
    }
    todo
}

/// The frames `job` writes (serialized or decompressed, without the store's lock), checked
/// against the log's limits.
fn copy_frames<C: Codec, B: Backend>(store: &Store<C, B>, job: &Job<C::Value>) -> Result<Frames> {
    let f = match &job.copy {
        Copy::Object(v) => serialize(store, &job.key, v)?,
        Copy::Frames(f) => f.clone(),
        Copy::Compressed(c) => {
            let t = Instant::now();
            let f = decompress(c)?;
            store.metrics.record(Activity::Decompress, f.total_len(), t);
            f
        }
    };
    store.logs.current().validate(&job.key, &f).map(|()| f)
}

/// Settle one copy after the batch `settled.result` wrote: landed (the entry keeps its value
/// and gains its disk copy), failed (the entry stays without one: stuck, the failure counted
/// and logged), or no longer the entry's (replaced or removed meanwhile: a record written for
/// it is dropped). `data` is what was to be written, `allowed` whether max_spill let it.
fn settle_copy<C: Codec, B: Backend>(
    store: &Store<C, B>,
    inner: &mut Inner<C::Value>,
    Job { key, slot, .. }: &Job<C::Value>,
    data: &Result<Frames>,
    allowed: bool,
    settled: &mut Settled<'_>,
) {
    inner.writes.end(key, 0, 0);
    let written = if allowed { store.logs.location(key) } else { None };
    match landing(inner, key, slot, written, allowed && settled.result().is_ok(), settled) {
        Landing::Landed(loc) => {
            let raw = data.as_ref().map_or(0, |f| f.total_len());
            inner.table.landed(key, (raw, loc.len), true, None);
        }
        Landing::Failed => match data {
            Err(err @ Error::Codec { .. }) => {
                store.metrics.spill_failed();
                if inner.table.first_serialize_failure(key) {
                    log::error!("Failed to serialize {:?}; keeping it in memory: {err}", key_str(key));
                }
            }
            Err(err) => spill_failed(store, inner, key, err),
            // Refused by max_spill (counted and logged there).
            Ok(_) if !allowed => {}
            Ok(_) => {
                let err = settled.result().clone().err().unwrap_or_else(|| vanished(key));
                spill_failed(store, inner, key, &err);
            }
        },
        Landing::Elsewhere => {}
    }
}
