//! Puts and removes: `put` (an object), `put_serialized` (frames), `remove` (through
//! `remove::drop_entry`), a value heavier than the target straight to disk (`put_large`), and
//! waiting for a key's write in flight.

use std::sync::Arc;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::slot::Slot;
use crate::sync::{self, MutexGuard};
use crate::value::Frames;

use super::entry::{Entry, Source, Tier};
use super::evict::{enforce, enforce_sparing, keep_weak, serialize, set_stuck, spill, spill_allowed, Plan, Planned};
use super::remove::{drop_entry, drop_superseded_record, take_entry_keeping_record};
use super::Inner;
use super::{Codec, Revive, Store};

pub(super) fn put<C: Codec, B: Backend>(store: &Store<C, B>, key: &[u8], value: C::Value) -> Result<()> {
    let weight = store.codec.size_of(&value);
    let done = put_object(store, key, value, weight, true).map(|_| ());
    store.relieve_process_memory(Some(key), weight);
    done
}

/// `put` without the eviction that follows it: the memory not already being written, if it is over
/// the target or a check of the process's memory is due (what `enforce_target`, on another
/// thread, then does), else None. A value heavier than the target is still written at once.
pub(super) fn put_deferred<C: Codec, B: Backend>(
    store: &Store<C, B>,
    key: &[u8],
    value: C::Value,
) -> Result<Option<u64>> {
    let weight = store.codec.size_of(&value);
    let pending = put_object(store, key, value, weight, false)?;
    Ok(due(store, weight, pending))
}

/// After a deferred put of `weight`: the memory not being written, if an eviction (it is over the
/// target) or a check of the process's memory is due.
fn due<C: Codec, B: Backend>(store: &Store<C, B>, weight: u64, pending: u64) -> Option<u64> {
    let check = store.process.note_added(weight);
    (check || store.cfg.eviction.excess(pending, store.target()) > 0).then_some(pending)
}

/// Evict down to the target (and relieve the process's memory where that is configured), on the
/// caller's thread: what a deferred put left to do.
pub(super) fn enforce_target<C: Codec, B: Backend>(store: &Store<C, B>) -> Result<()> {
    let done = enforce(store, store.lock(), None);
    store.relieve_process_memory(None, 0);
    done
}

/// The memory not already being written.
fn pending<V>(inner: &Inner<V>) -> u64 {
    inner.table.totals().mem_bytes().saturating_sub(inner.writes.weight())
}

/// Put an object; with `enforce_now`, evict down to the target before returning (0 then), else
/// return the memory not already being written.
fn put_object<C: Codec, B: Backend>(
    store: &Store<C, B>,
    key: &[u8],
    value: C::Value,
    weight: u64,
    enforce_now: bool,
) -> Result<u64> {
    if weight > store.target() {
        let frames = match serialize(store, key, &value) {
            Ok(f) => f,
            Err(e) => {
                // As for a value that fails when its eviction serializes it: the key is forgotten,
                // not left holding its previous value.
                let mut inner = store.lock();
                let _ = drop_entry(store, &mut inner, key);
                return Err(e);
            }
        };
        // Handed back by a get while something else still holds it (as an evicted object is).
        let value = sync::Arc::new(value);
        let weak = if C::KEEPS_WEAK { keep_weak(store, &value) } else { None };
        return put_large(store, store.lock(), key, frames, Some((value, weight)), true, weak).map(|_| 0);
    }
    let mut inner = store.lock();
    let e = Entry::new(Slot::ready(sync::Arc::new(value)), Tier::Materialized, weight);
    let slot = e.slot.clone();
    insert(store, &mut inner, key, e)?;
    if enforce_now {
        return enforce(store, inner, Some(&slot)).map(|_| 0);
    }
    Ok(pending(&inner))
}

pub(super) fn put_serialized<C: Codec, B: Backend>(store: &Store<C, B>, key: &[u8], frames: Frames) -> Result<()> {
    let weight = frames.total_len();
    let done = put_frames(store, key, frames, true).map(|_| ());
    store.relieve_process_memory(Some(key), weight);
    done
}

/// `put_serialized` without the eviction that follows it, as [`put_deferred`].
pub(super) fn put_serialized_deferred<C: Codec, B: Backend>(
    store: &Store<C, B>,
    key: &[u8],
    frames: Frames,
) -> Result<Option<u64>> {
    let weight = frames.total_len();
    let pending = put_frames(store, key, frames, false)?;
    Ok(due(store, weight, pending))
}

/// Put frames; with `enforce_now`, evict down to the target before returning (0 then), else return
/// the memory not already being written.
fn put_frames<C: Codec, B: Backend>(store: &Store<C, B>, key: &[u8], frames: Frames, enforce_now: bool) -> Result<u64> {
    let mut inner = store.lock();
    if frames.total_len() > store.target() {
        return put_large(store, inner, key, frames, None, true, None).map(|_| 0);
    }
    let e = Entry::serialized(frames, false);
    let slot = e.slot.clone();
    insert(store, &mut inner, key, e)?;
    if enforce_now {
        return enforce(store, inner, Some(&slot)).map(|_| 0);
    }
    Ok(pending(&inner))
}

pub(super) fn put_serialized_on_disk<C: Codec, B: Backend>(
    store: &Store<C, B>,
    key: &[u8],
    frames: Frames,
) -> Result<()> {
    let large = frames.total_len() > store.target();
    put_large(store, store.lock(), key, frames, None, large, None)
}

/// A value heavier than the target: straight to disk, written outside the lock like any spill
/// (meanwhile it is served from memory). On disk it keeps the weight of `object` (the object and
/// its weight, when it was put as one) or the frames' length. `large`: served from disk without
/// promotion (heavier than the target). If it cannot be written (max_spill, disk error) it stays
/// in memory (as the object it was put as, else serialized), the condition is reported, and the
/// other values are evicted instead.
pub(super) fn put_large<'a, C: Codec, B: Backend>(
    store: &'a Store<C, B>,
    inner: MutexGuard<'a, Inner<C::Value>>,
    key: &[u8],
    frames: Frames,
    object: Option<(sync::Arc<C::Value>, u64)>,
    large: bool,
    weak: Option<Revive<C::Value>>,
) -> Result<()> {
    let raw = frames.total_len();
    let object_weight = object.as_ref().map(|(_, w)| *w);
    let mut inner = wait_unwritten(store, inner, key);
    // In a persistent store the old value's record stays in the log until the new one is written,
    // which supersedes it (its higher sequence number wins at recovery too): a crash in between
    // leaves the old value. If the new record does not land, the old one goes then.
    let keep_old = store.cfg.persistent && inner.table.get(key).is_some_and(|e| e.disk_bytes > 0);
    let e = Entry::serialized(frames.clone(), large);
    let slot = e.slot.clone();
    let k = if keep_old { insert_keeping_record(&mut inner, key, e) } else { insert(store, &mut inner, key, e)? };
    if let Some(revive) = weak {
        inner.table.keep_weak(k.clone(), slot.clone(), revive);
    }
    if !spill_allowed(store, &mut inner, key, raw) {
        if keep_old {
            drop_superseded_record(store, &inner, key);
        }
        let slot = match object {
            Some(o) => keep_object(&mut inner, &k, &slot, o),
            None => slot,
        };
        set_stuck(store, &mut inner, &k);
        // It stays in memory, over the target: the others are evicted instead, as dask does.
        return enforce_sparing(store, inner, None, Some(&slot));
    }
    let replaces = if keep_old { store.logs.place(key) } else { None };
    let data = Source::Frames(frames);
    let planned = Planned { key: k.clone(), data, raw, slot: slot.clone(), weight: raw, object_weight, replaces };
    inner.writes.begin(planned.key.clone(), planned.weight, planned.raw);
    let (mut inner, _) = spill(store, inner, Plan::new(vec![planned]), None);
    if keep_old {
        drop_superseded_record(store, &inner, key);
    }
    let slot = match object {
        Some(o) => keep_object(&mut inner, &k, &slot, o),
        None => slot,
    };
    // Memory may be over the target still (values that could not go before), or again (the
    // value did not go to disk, a disk error): the others are evicted, as dask does.
    enforce_sparing(store, inner, None, Some(&slot))
}

/// After `put_large` of an object: if its frames are still in memory (the write was refused or
/// failed), the entry of `slot` holds the object again, with its weight, as dask's store keeps
/// the object it could not spill (the same object for the caller, weighed as it weighs it).
/// A fresh ready slot: a reader already materializing the frames finds its entry replaced and
/// keeps what it made. Returns the entry's slot.
fn keep_object<V>(
    inner: &mut Inner<V>,
    k: &Arc<[u8]>,
    slot: &Arc<Slot<V, Error>>,
    (value, weight): (sync::Arc<V>, u64),
) -> Arc<Slot<V, Error>> {
    let serialized = inner
        .table
        .get(k)
        .is_some_and(|e| Arc::ptr_eq(&e.slot, slot) && e.tier == Tier::Serialized && e.disk_bytes == 0);
    if !serialized {
        return slot.clone();
    }
    let fresh = Arc::new(Slot::ready(value));
    inner.table.materialized_in(k, fresh.clone(), weight);
    inner.table.drop_weak(k);
    fresh
}

/// Wait (releasing the lock) until no spill write of `key` is running: a value written to the log
/// directly must not race an older value's write of the same key.
pub(super) fn wait_unwritten<'a, C: Codec, B: Backend>(
    store: &'a Store<C, B>,
    mut inner: MutexGuard<'a, Inner<C::Value>>,
    key: &[u8],
) -> MutexGuard<'a, Inner<C::Value>> {
    while inner.writes.contains(key) || inner.transfers.receiving(key) {
        inner = store.written.wait(inner).unwrap_or_else(|p| p.into_inner());
    }
    inner
}

pub(super) fn remove<C: Codec, B: Backend>(store: &Store<C, B>, key: &[u8]) -> Result<bool> {
    // A spill write of the key in flight is not waited for: its record is dropped when it
    // settles (a tombstone in a persistent store), and `flush` waits for that.
    let mut inner = store.lock();
    drop_entry(store, &mut inner, key)
}

/// Put `e` under `key` in place of its entry, whose record stays in the log for a new record to
/// supersede (see `put_large`).
fn insert_keeping_record<V>(inner: &mut Inner<V>, key: &[u8], e: Entry<V>) -> Arc<[u8]> {
    take_entry_keeping_record(inner, key);
    let k: Arc<[u8]> = Arc::from(key);
    inner.table.insert(k.clone(), e);
    k
}

/// Put `e` under `key`, dropping the key's old entry (and its record) first.
pub(super) fn insert<C: Codec, B: Backend>(
    store: &Store<C, B>,
    inner: &mut Inner<C::Value>,
    key: &[u8],
    e: Entry<C::Value>,
) -> Result<Arc<[u8]>> {
    if key.len() > crate::MAX_KEY_BYTES {
        return Err(Error::KeyTooLarge { len: key.len(), max: crate::MAX_KEY_BYTES });
    }
    drop_entry(store, inner, key)?;
    let k: Arc<[u8]> = Arc::from(key);
    inner.table.insert(k.clone(), e);
    Ok(k)
}
