//! Puts and removes: `put` (an object), `put_serialized` (frames), a value heavier than the
//! target straight to disk (`put_large`), and waiting for a key's write in flight.

use std::sync::Arc;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::slot::Slot;
use crate::sync::{self, MutexGuard};
use crate::value::Frames;

use super::entry::{Entry, Tier, WeakHandle};
use super::evict::{Plan, Planned};
use super::get::Source;
use super::Inner;
use super::{Codec, Revive, Store};

impl<C: Codec, B: Backend> Store<C, B> {
    /// Store a materialized value. If it is heavier than the target it is serialized and written to disk
    /// at once; a serialize failure then fails this call and the key is forgotten.
    pub fn put(&self, key: &[u8], value: C::Value) -> Result<()> {
        let weight = self.codec.size_of(&value);
        let done = self.put_object(key, value, weight);
        self.relieve_process_memory(Some(key), weight);
        done
    }

    fn put_object(&self, key: &[u8], value: C::Value, weight: u64) -> Result<()> {
        if weight > self.target() {
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
            // Handed back by a get while something else still holds it (as an evicted object is).
            let value = sync::Arc::new(value);
            let weak = if C::KEEPS_WEAK { self.keep_weak(&value) } else { None };
            return self.put_large(self.lock(), key, frames, Some((value, weight)), true, weak);
        }
        let mut inner = self.lock();
        let e = Entry::new(Slot::ready(sync::Arc::new(value)), Tier::Materialized, weight);
        let slot = e.slot.clone();
        self.insert(&mut inner, key, e)?;
        self.enforce(inner, Some(&slot))
    }

    /// Store serialized frames (data from a peer or from disk): they stay serialized until a `get`.
    pub fn put_serialized(&self, key: &[u8], frames: Frames) -> Result<()> {
        let weight = frames.total_len();
        let mut inner = self.lock();
        let done = if weight > self.target() {
            self.put_large(inner, key, frames, None, true, None)
        } else {
            let e = Entry::serialized(frames, false);
            let slot = e.slot.clone();
            self.insert(&mut inner, key, e).and_then(|_| self.enforce(inner, Some(&slot)))
        };
        self.relieve_process_memory(Some(key), weight);
        done
    }

    /// Store frames straight on disk, whatever their size (as a value heavier than the target goes):
    /// for data passing through that should not take memory.
    pub fn put_serialized_on_disk(&self, key: &[u8], frames: Frames) -> Result<()> {
        let large = frames.total_len() > self.target();
        self.put_large(self.lock(), key, frames, None, large, None)
    }

    /// A value heavier than the target: straight to disk, written outside the lock like any spill
    /// (meanwhile it is served from memory). On disk it keeps the weight of `object` (the object and
    /// its weight, when it was put as one) or the frames' length. `large`: served from disk without
    /// promotion (heavier than the target). If it cannot be written (max_spill, disk error) it stays
    /// in memory (as the object it was put as, else serialized), the condition is reported, and the
    /// other values are evicted instead.
    pub(super) fn put_large<'a>(
        &'a self,
        inner: MutexGuard<'a, Inner<C::Value>>,
        key: &[u8],
        frames: Frames,
        object: Option<(sync::Arc<C::Value>, u64)>,
        large: bool,
        weak: Option<Revive<C::Value>>,
    ) -> Result<()> {
        let raw = frames.total_len();
        let object_weight = object.as_ref().map(|(_, w)| *w);
        let mut inner = self.wait_unwritten(inner, key);
        let e = Entry::serialized(frames.clone(), large);
        let slot = e.slot.clone();
        let k = self.insert(&mut inner, key, e)?;
        if let Some(revive) = weak {
            inner.table.weak.insert(k.clone(), WeakHandle { slot: slot.clone(), revive });
        }
        if !self.spill_allowed(&mut inner, key, raw) {
            let slot = match object {
                Some(o) => Self::keep_object(&mut inner, &k, &slot, o),
                None => slot,
            };
            self.set_stuck(&mut inner, &k);
            // It stays in memory, over the target: the others are evicted instead, as dask does.
            return self.enforce_sparing(inner, None, Some(&slot));
        }
        let planned = Planned {
            key: k.clone(),
            data: Source::Frames(frames),
            raw,
            slot: slot.clone(),
            weight: raw,
            object_weight,
        };
        inner.writes.begin(planned.key.clone(), planned.weight, planned.raw);
        let (mut inner, _) = self.spill(inner, Plan::new(vec![planned]), None);
        let slot = match object {
            Some(o) => Self::keep_object(&mut inner, &k, &slot, o),
            None => slot,
        };
        // Memory may be over the target still (values that could not go before), or again (the
        // value did not go to disk, a disk error): the others are evicted, as dask does.
        self.enforce_sparing(inner, None, Some(&slot))
    }

    /// After `put_large` of an object: if its frames are still in memory (the write was refused or
    /// failed), the entry of `slot` holds the object again, with its weight, as dask's store keeps
    /// the object it could not spill (the same object for the caller, weighed as it weighs it).
    /// A fresh ready slot: a reader already materializing the frames finds its entry replaced and
    /// keeps what it made. Returns the entry's slot.
    fn keep_object(
        inner: &mut Inner<C::Value>,
        k: &Arc<[u8]>,
        slot: &Arc<Slot<C::Value, Error>>,
        (value, weight): (sync::Arc<C::Value>, u64),
    ) -> Arc<Slot<C::Value, Error>> {
        let serialized = inner
            .table
            .get(k)
            .is_some_and(|e| Arc::ptr_eq(&e.slot, slot) && e.tier == Tier::Serialized && e.disk_bytes == 0);
        if !serialized {
            return slot.clone();
        }
        let fresh = Arc::new(Slot::ready(value));
        inner.table.modify(k, |ne| {
            ne.slot = fresh.clone();
            ne.tier = Tier::Materialized;
            ne.frames = None;
            ne.weight = weight;
        });
        if !inner.table.weak.is_empty() {
            inner.table.weak.remove(k);
        }
        fresh
    }

    /// Wait (releasing the lock) until no spill write of `key` is running: a value written to the log
    /// directly must not race an older value's write of the same key.
    pub(super) fn wait_unwritten<'a>(
        &'a self,
        mut inner: MutexGuard<'a, Inner<C::Value>>,
        key: &[u8],
    ) -> MutexGuard<'a, Inner<C::Value>> {
        while inner.writes.contains(key) || inner.transfers.receiving(key) {
            inner = self.written.wait(inner).unwrap_or_else(|p| p.into_inner());
        }
        inner
    }

    /// Delete `key` from every tier. Returns whether it existed.
    pub fn remove(&self, key: &[u8]) -> Result<bool> {
        // A spill write of the key in flight is not waited for: its record is dropped when it
        // settles (a tombstone in a persistent store), and `flush` waits for that.
        let mut inner = self.lock();
        self.drop_entry(&mut inner, key)
    }

    /// Put `e` under `key`, dropping the key's old entry (and its record) first.
    pub(super) fn insert(&self, inner: &mut Inner<C::Value>, key: &[u8], e: Entry<C::Value>) -> Result<Arc<[u8]>> {
        if key.len() > crate::MAX_KEY_BYTES {
            return Err(Error::KeyTooLarge { len: key.len(), max: crate::MAX_KEY_BYTES });
        }
        self.drop_entry(inner, key)?;
        let k: Arc<[u8]> = Arc::from(key);
        inner.table.insert(k.clone(), e);
        Ok(k)
    }

    /// Remove `key`'s entry from memory and disk; returns whether it existed. If the log cannot drop
    /// the record (a persistent store's tombstone write failed), the entry stays as it was.
    pub(super) fn drop_entry(&self, inner: &mut Inner<C::Value>, key: &[u8]) -> Result<bool> {
        // Every put and remove comes here. A transfer of the key in progress loses to it (once the
        // old record, if any, is dropped: a remove that fails changes nothing); the old value a
        // transfer set aside counts as existing.
        let Some(disk_bytes) = inner.table.get(key).map(|e| e.disk_bytes) else {
            return Ok(inner.transfers.supersede(key));
        };
        if disk_bytes > 0 {
            if self.cfg.persistent {
                self.logs.current().delete(key)?;
            } else {
                self.logs.forget(key)?;
            }
        }
        inner.transfers.supersede(key);
        inner.table.take(key);
        if disk_bytes > 0 {
            inner.table.unstick();
        }
        Ok(true)
    }
}
