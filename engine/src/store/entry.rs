//! An entry and its accounting: the [`Tier`] a value is in, the entry (tier, weight, LRU tick,
//! slot, disk copy), the totals per tier that every change goes through (`Inner::count_in` and
//! `count_out`), the LRU order, and in-memory lz4 blocks.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::key::{KeyMap, KeySet};
use crate::slot::Slot;
use crate::stored;
use crate::value::Frames;

use super::evict::SpillFailure;
use super::{Codec, Revive, Store};

/// Where an entry's value is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tier {
    /// Materialized object.
    Materialized,
    /// Serialized frames in memory.
    Serialized,
    /// lz4-compressed frames in memory.
    Compressed,
    /// A record in the segment log.
    Disk,
}

pub(super) const TIERS: [Tier; 4] = [Tier::Materialized, Tier::Serialized, Tier::Compressed, Tier::Disk];

impl Tier {
    pub(super) fn idx(self) -> usize {
        self as usize
    }
    /// Lower-case name (metrics labels).
    pub fn name(self) -> &'static str {
        match self {
            Tier::Materialized => "materialized",
            Tier::Serialized => "serialized",
            Tier::Compressed => "compressed",
            Tier::Disk => "disk",
        }
    }
}

#[derive(Clone)]
pub(super) struct Compressed {
    pub(super) block: Bytes,
    pub(super) frame_lens: Vec<u64>,
    pub(super) raw_len: u64,
}

/// An entry's slot: its value once materialized, and what tells one entry of a key from the next.
pub(super) type EntrySlot<V> = Arc<Slot<V, Error>>;

/// A weak handle on an evicted object ([`Codec::keep_weak`]), for the entry of `slot`.
pub(super) struct WeakHandle<V> {
    pub(super) slot: EntrySlot<V>,
    pub(super) revive: Revive<V>,
}

pub(super) struct Entry<V> {
    pub(super) slot: Arc<Slot<V, Error>>,
    pub(super) tier: Tier,
    pub(super) frames: Option<Frames>,
    /// Boxed: rarely present, and inline it would make every entry of the store's map 56 bytes
    /// larger (see `entries_stay_small`).
    pub(super) compressed: Option<Box<Compressed>>,
    /// The value's weight: `size_of` of the object, or the frames' byte length. In memory it counts
    /// in the memory total; on disk it is kept (the spilled weight, dask's `spilled_total.memory`).
    pub(super) weight: u64,
    /// Serialized size of the value's copy on disk (for `spilled_total`), 0 when it has none. A value
    /// read back from disk keeps its disk copy (same bytes), so evicting it again costs no write.
    pub(super) disk_raw: u64,
    /// Bytes the log holds for it (record length), 0 otherwise.
    pub(super) disk_bytes: u64,
    /// LRU position (memory-resident entries only).
    pub(super) tick: u64,
    /// When the value entered the place it is in (memory or disk), on the clock of `tick`: the
    /// order in which [`Store::keys_by_place`] lists each place, as dask's store iterates `fast`
    /// and `slow` (a read moves an entry in the LRU order, not in this one).
    pub(super) placed: u64,
    /// Heavier than the target on arrival: lives on disk, served without promotion.
    pub(super) large: bool,
    /// Eviction of this entry failed (max_spill, serialize or disk error): skip it until things change.
    pub(super) stuck: bool,
    /// Its serialize failure was logged (once per entry, as dask logs a pickle error once per key).
    pub(super) logged_serialize: bool,
    /// Its evicted object was found alive and got back ([`Codec::keep_weak`]): the object may have
    /// changed since it was written, so its record is no copy of it.
    pub(super) revived: bool,
}

impl<V> Entry<V> {
    pub(super) fn new(slot: Slot<V, Error>, tier: Tier, weight: u64) -> Self {
        Entry {
            slot: Arc::new(slot),
            tier,
            frames: None,
            compressed: None,
            weight,
            disk_raw: 0,
            disk_bytes: 0,
            tick: 0,
            placed: 0,
            large: false,
            stuck: false,
            logged_serialize: false,
            revived: false,
        }
    }

    /// The weight this entry counts in memory: 0 on disk.
    pub(super) fn mem_weight(&self) -> u64 {
        if self.tier == Tier::Disk {
            0
        } else {
            self.weight
        }
    }

    pub(super) fn serialized(frames: Frames, large: bool) -> Self {
        let mut e = Self::new(Slot::new(), Tier::Serialized, frames.total_len());
        e.frames = Some(frames);
        e.large = large;
        e
    }
}

pub(super) struct Inner<V> {
    pub(super) map: KeyMap<Arc<[u8]>, Entry<V>>,
    pub(super) lru: BTreeMap<u64, Arc<[u8]>>,
    pub(super) next_tick: u64,
    pub(super) mem_bytes: u64,
    pub(super) tier_bytes: [u64; 4],
    pub(super) tier_count: [u64; 4],
    pub(super) disk_bytes: u64,
    pub(super) disk_raw: u64,
    /// Weight of the entries on disk (see `Entry::weight`).
    pub(super) disk_weight: u64,
    /// Serialized bytes of the entries on disk (`disk_raw` without the copies of values in memory).
    pub(super) spilled_raw: u64,
    /// When "reached capacity" (max_spill) and "Spill to disk failed" were last logged: each is
    /// logged at most every [`LOG_EVERY`], independently of the other.
    pub(super) logged_full: Option<Instant>,
    pub(super) logged_disk: Option<Instant>,
    /// Keys marked stuck since the last `unstick` (some may have been unstuck since; removed keys
    /// leave it). A stuck entry is out of the LRU order, so eviction does not walk past it again
    /// and again.
    pub(super) stuck: KeySet<Arc<[u8]>>,
    /// Keys whose spill write runs right now, outside the lock. A key is in at most one write at a
    /// time: eviction skips these keys, and a direct write of one (`put_large`, `put_stream`) waits.
    /// Each write has a ticket (from `next_write`): `flush` waits for the writes older than itself.
    pub(super) writing: KeyMap<Arc<[u8]>, u64>,
    pub(super) next_write: u64,
    /// Keys whose new value is arriving from a peer into memory (`receive_serialized`): a direct
    /// write of the key, or a second transfer, waits as for `writing`; `flush` does not.
    pub(super) receiving: KeySet<Arc<[u8]>>,
    /// Memory weight and serialized bytes of the entries in those writes, as planned. The weight
    /// still counts in `mem_bytes` (the bytes are still in memory) until the write lands.
    pub(super) writing_weight: u64,
    pub(super) writing_raw: u64,
    /// Keys a `put_stream` is receiving right now (absent from `map` meanwhile).
    pub(super) streams: KeyMap<Arc<[u8]>, Stream>,
    /// Bytes of values admitted into memory as they arrive ([`Store::admit`]) and not yet stored
    /// or let go of.
    pub(super) admitted: u64,
    /// Gets answered with an object in memory: (count, weight), part of `Activity::MemoryRead`.
    pub(super) object_reads: (u64, u64),
    /// A spill failed since the current eviction began ([`EvictionPolicy::failed_spill_ends_round`]).
    pub(super) round_failed: bool,
    /// Spills that did not happen, for [`Store::take_failures`] (with `StoreConfig::report_failures`).
    pub(super) failures: Vec<SpillFailure>,
    /// The crc of each read-back copy (with [`EvictionPolicy::verify_copies`]): the `laid_out_crc`
    /// of the frames the object was read from.
    pub(super) copy_crc: KeyMap<Arc<[u8]>, u32>,
    /// Weak handles on evicted objects ([`Codec::keep_weak`]), with the slot of the entry they
    /// belong to.
    pub(super) weak: KeyMap<Arc<[u8]>, WeakHandle<V>>,
}

/// A `put_stream` in progress.
pub(super) struct Stream {
    /// A put or remove of the key came after the transfer started: it wins over the transfer.
    pub(super) superseded: bool,
    /// The key had a value when the transfer started (set aside meanwhile).
    pub(super) has_old: bool,
    /// Memory weight and spilled bytes of that value, still counted in `mem_bytes` and
    /// `disk_raw` (it may come back): what `check_accounting` adds back.
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(super) aside_weight: u64,
    #[cfg_attr(not(feature = "testing"), allow(dead_code))]
    pub(super) aside_raw: u64,
}

impl<V> Inner<V> {
    /// Count an entry into the totals (per tier, memory, disk).
    pub(super) fn count_in(&mut self, e: Acct) {
        for (total, share) in self.shares(e) {
            *total += share;
        }
    }

    /// Take an entry out of the totals: the inverse of [`Inner::count_in`] for the same `Acct`.
    pub(super) fn count_out(&mut self, e: Acct) {
        for (total, share) in self.shares(e) {
            *total -= share;
        }
    }

    /// Each total an entry counts in, with its share of it.
    pub(super) fn shares(&mut self, e: Acct) -> [(&mut u64, u64); 7] {
        let t = e.tier.idx();
        let on_disk = e.tier == Tier::Disk;
        let tier_weight = if on_disk { e.disk_bytes } else { e.weight };
        [
            (&mut self.tier_count[t], 1),
            (&mut self.tier_bytes[t], tier_weight),
            (&mut self.mem_bytes, if on_disk { 0 } else { e.weight }),
            (&mut self.disk_weight, if on_disk { e.weight } else { 0 }),
            (&mut self.spilled_raw, if on_disk { e.disk_raw } else { 0 }),
            (&mut self.disk_bytes, e.disk_bytes),
            (&mut self.disk_raw, e.disk_raw),
        ]
    }
}

/// What the accounting and the LRU order know of an entry.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct Acct {
    pub(super) tier: Tier,
    pub(super) tick: u64,
    pub(super) weight: u64,
    pub(super) disk_bytes: u64,
    pub(super) disk_raw: u64,
    pub(super) stuck: bool,
}

impl Acct {
    pub(super) fn of<V>(e: &Entry<V>) -> Acct {
        Acct {
            tier: e.tier,
            tick: e.tick,
            weight: e.weight,
            disk_bytes: e.disk_bytes,
            disk_raw: e.disk_raw,
            stuck: e.stuck,
        }
    }
    pub(super) fn in_lru(&self) -> bool {
        self.tier != Tier::Disk && !self.stuck
    }
}

pub(super) fn compress(frames: &Frames) -> Compressed {
    let (block, raw_len) = stored::compress(frames);
    Compressed { block: Bytes::from(block), frame_lens: frames.iter().map(|f| f.len() as u64).collect(), raw_len }
}

pub(super) fn decompress(c: &Compressed) -> Result<Frames> {
    stored::decode(c.block.clone(), true, c.raw_len, &c.frame_lens)
        .map_err(|m| Error::Internal(format!("an in-memory lz4 block: {}", m.reason())))
}

impl<C: Codec, B: Backend> Store<C, B> {
    pub(super) fn touch(inner: &mut Inner<C::Value>, key: &Arc<[u8]>) {
        let tick = inner.next_tick;
        inner.next_tick += 1;
        let e = inner.map.get_mut(key).expect("touched key exists");
        if e.tier != Tier::Disk {
            let in_lru = Acct::of(e).in_lru();
            if in_lru {
                inner.lru.remove(&e.tick);
            }
            e.tick = tick;
            if in_lru {
                inner.lru.insert(tick, key.clone());
            }
        }
    }

    pub(super) fn insert(&self, inner: &mut Inner<C::Value>, key: &[u8], mut e: Entry<C::Value>) -> Result<Arc<[u8]>> {
        if key.len() > crate::MAX_KEY_BYTES {
            return Err(Error::KeyTooLarge { len: key.len(), max: crate::MAX_KEY_BYTES });
        }
        self.drop_entry(inner, key)?;
        let k: Arc<[u8]> = Arc::from(key);
        e.placed = inner.next_tick;
        if e.tier != Tier::Disk {
            e.tick = inner.next_tick;
            if !e.stuck {
                inner.lru.insert(e.tick, k.clone());
            }
        }
        inner.next_tick += 1;
        inner.count_in(Acct::of(&e));
        inner.map.insert(k.clone(), e);
        Ok(k)
    }

    /// Remove `key`'s entry from memory and disk; returns whether it existed. If the log cannot drop
    /// the record (a persistent store's tombstone write failed), the entry stays as it was.
    pub(super) fn drop_entry(&self, inner: &mut Inner<C::Value>, key: &[u8]) -> Result<bool> {
        // Every put and remove comes here. A transfer of the key in progress loses to it (once the
        // old record, if any, is dropped: a remove that fails changes nothing); the old value a
        // transfer set aside counts as existing.
        let supersede = |inner: &mut Inner<C::Value>| {
            inner.streams.get_mut(key).is_some_and(|s| !std::mem::replace(&mut s.superseded, true) && s.has_old)
        };
        let Some(disk_bytes) = inner.map.get(key).map(|e| e.disk_bytes) else { return Ok(supersede(inner)) };
        if disk_bytes > 0 {
            if self.cfg.persistent {
                self.logs.current().delete(key)?;
            } else {
                self.logs.forget(key)?;
            }
        }
        supersede(inner);
        Self::take_entry(inner, key);
        if disk_bytes > 0 {
            Self::unstick(inner);
        }
        Ok(true)
    }

    /// Take `key`'s entry out of the map, the accounting and the LRU order, leaving its record (if
    /// any) in the log.
    pub(super) fn take_entry(inner: &mut Inner<C::Value>, key: &[u8]) -> Option<Entry<C::Value>> {
        let (_, e) = inner.map.remove_entry(key)?;
        inner.count_out(Acct::of(&e));
        if Acct::of(&e).in_lru() {
            inner.lru.remove(&e.tick);
        }
        // Listed keys that are no longer stuck (a get promoted them) leave the list here too.
        if !inner.stuck.is_empty() {
            inner.stuck.remove(key);
        }
        if !inner.weak.is_empty() {
            inner.weak.remove(key);
        }
        if !inner.copy_crc.is_empty() {
            inner.copy_crc.remove(key);
        }
        Some(e)
    }

    /// Disk space was freed, or space reserved for a write was given back unused: retry the
    /// evictions that max_spill or a full disk refused.
    pub(super) fn unstick(inner: &mut Inner<C::Value>) {
        for k in std::mem::take(&mut inner.stuck) {
            if inner.map.get(&k).is_some_and(|e| e.stuck) {
                Self::modify_entry(inner, &k, |e| e.stuck = false);
            }
        }
    }

    /// A spill of `key` was refused or failed: its entry stays in memory, out of the LRU order,
    /// until [`Self::unstick`]. Under [`EvictionPolicy::failed_spill_ends_round`] it keeps its place
    /// in the LRU order instead, and the eviction that met the failure stops.
    pub(super) fn set_stuck(&self, inner: &mut Inner<C::Value>, key: &Arc<[u8]>) {
        if self.cfg.eviction.failed_spill_ends_round {
            inner.round_failed = true;
            return;
        }
        if inner.map.get(key).is_some_and(|e| !e.stuck) {
            Self::modify_entry(inner, key, |e| e.stuck = true);
            inner.stuck.insert(key.clone());
        }
    }

    /// Change `key`'s entry in place with `f`, keeping the accounting, the LRU order and the entry's
    /// `placed` stamp in step (the entry's tick is its LRU position: set it in `f` to move the entry;
    /// an entry that moves between memory and disk is stamped anew). One hash lookup, where
    /// detaching and re-attaching the entry cost a removal and an insertion.
    pub(super) fn modify_entry<R>(
        inner: &mut Inner<C::Value>,
        key: &Arc<[u8]>,
        f: impl FnOnce(&mut Entry<C::Value>) -> R,
    ) -> R {
        let e = inner.map.get_mut(key).expect("entry present");
        let before = Acct::of(e);
        let r = f(e);
        let after = Acct::of(e);
        if (before.tier == Tier::Disk) != (after.tier == Tier::Disk) {
            e.placed = inner.next_tick;
            inner.next_tick += 1;
        }
        if before != after {
            inner.count_out(before);
            inner.count_in(after);
            let moved = before.tick != after.tick;
            if before.in_lru() && (moved || !after.in_lru()) {
                inner.lru.remove(&before.tick);
            }
            if after.in_lru() && (moved || !before.in_lru()) {
                inner.lru.insert(after.tick, key.clone());
            }
        }
        r
    }
}
