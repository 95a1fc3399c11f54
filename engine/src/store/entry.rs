//! Entries and their accounting: the [`Tier`] a value is in, the entry (tier, weight, LRU tick,
//! slot, disk copy), in-memory lz4 blocks, and the [`Table`] of entries: the only writer of the
//! entries, their per-tier [`Totals`] and the LRU order, which it keeps in step.

use std::collections::BTreeMap;
use std::sync::Arc;

use bytes::Bytes;

use crate::error::{Error, Result};
use crate::key::{KeyMap, KeySet};
use crate::slot::Slot;
use crate::stored;
use crate::value::Frames;

use super::Revive;

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
    block: Bytes,
    frame_lens: Vec<u64>,
    raw_len: u64,
}

impl Compressed {
    /// Bytes of the lz4 block (the entry's weight in memory).
    pub(super) fn block_len(&self) -> u64 {
        self.block.len() as u64
    }

    /// Bytes of the frames it decompresses to.
    pub(super) fn raw_len(&self) -> u64 {
        self.raw_len
    }
}

/// An entry's slot: its value once materialized, and what tells one entry of a key from the next.
pub(super) type EntrySlot<V> = Arc<Slot<V, Error>>;

/// A weak handle on an evicted object ([`Codec::keep_weak`]), for the entry of `slot`.
pub(super) struct WeakHandle<V> {
    slot: EntrySlot<V>,
    revive: Revive<V>,
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

    /// A value only on disk, of `weight`, its record `raw` serialized bytes and `len` in the log;
    /// `large`: heavier than the target (it lives on disk).
    pub(super) fn on_disk(weight: u64, (raw, len): (u64, u64), large: bool) -> Self {
        let mut e = Self::new(Slot::new(), Tier::Disk, weight);
        e.disk_raw = raw;
        e.disk_bytes = len;
        e.large = large;
        e
    }

    pub(super) fn serialized(frames: Frames, large: bool) -> Self {
        let mut e = Self::new(Slot::new(), Tier::Serialized, frames.total_len());
        e.frames = Some(frames);
        e.large = large;
        e
    }
}

/// What the accounting and the LRU order know of an entry.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) struct Acct {
    tier: Tier,
    tick: u64,
    weight: u64,
    disk_bytes: u64,
    disk_raw: u64,
    stuck: bool,
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

/// The totals every entry counts in, kept by [`Table`].
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
pub(super) struct Totals {
    /// Entries per tier.
    tier_count: [u64; 4],
    /// Bytes per tier: the weight in memory, the record's length on disk.
    tier_bytes: [u64; 4],
    /// Weight of the entries in memory.
    mem_bytes: u64,
    /// Weight of the entries on disk (see `Entry::weight`).
    disk_weight: u64,
    /// Serialized bytes of the entries on disk (`disk_raw` without the copies of values in memory).
    spilled_raw: u64,
    /// Bytes the log holds for the entries.
    disk_bytes: u64,
    /// Serialized bytes of every disk copy, of entries on disk and in memory.
    disk_raw: u64,
}

impl Totals {
    /// Entries in tier `t`.
    pub(super) fn tier_count(&self, t: Tier) -> u64 {
        self.tier_count[t.idx()]
    }

    /// Bytes in tier `t`: the weight in memory, the records' length on disk.
    pub(super) fn tier_bytes(&self, t: Tier) -> u64 {
        self.tier_bytes[t.idx()]
    }

    /// Weight of the entries in memory.
    pub(super) fn mem_bytes(&self) -> u64 {
        self.mem_bytes
    }

    /// Weight of the entries on disk.
    pub(super) fn disk_weight(&self) -> u64 {
        self.disk_weight
    }

    /// Serialized bytes of the entries on disk.
    pub(super) fn spilled_raw(&self) -> u64 {
        self.spilled_raw
    }

    /// Bytes the log holds for the entries.
    pub(super) fn disk_bytes(&self) -> u64 {
        self.disk_bytes
    }

    /// Serialized bytes of every disk copy.
    pub(super) fn disk_raw(&self) -> u64 {
        self.disk_raw
    }
}

impl Totals {
    /// Count an entry in.
    fn count_in(&mut self, e: Acct) {
        for (total, share) in self.shares(e) {
            *total += share;
        }
    }

    /// Take an entry out: the inverse of [`Totals::count_in`] for the same `Acct`.
    fn count_out(&mut self, e: Acct) {
        for (total, share) in self.shares(e) {
            *total -= share;
        }
    }

    /// Each total an entry counts in, with its share of it.
    fn shares(&mut self, e: Acct) -> [(&mut u64, u64); 7] {
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

/// The entries, their [`Totals`] and the LRU order, kept in step. Only its methods change an entry
/// (`insert`, `take`, `modify`, `touch`, `set_stuck`, `unstick`), so no other code can move a value
/// between tiers or change its weight without the totals and the order following.
///
/// The LRU order holds the entries in memory that are not stuck, by tick; every entry also has a
/// `placed` stamp, the order in which it entered memory or disk.
pub(super) struct Table<V> {
    map: KeyMap<Arc<[u8]>, Entry<V>>,
    lru: BTreeMap<u64, Arc<[u8]>>,
    /// The clock of ticks and `placed` stamps.
    next_tick: u64,
    totals: Totals,
    /// Keys marked stuck since the last `unstick` (some may have been unstuck since; removed keys
    /// leave it). A stuck entry is out of the LRU order, so eviction does not walk past it again
    /// and again.
    stuck: KeySet<Arc<[u8]>>,
    /// The crc of each read-back copy (with [`EvictionPolicy::verify_copies`]): the `laid_out_crc`
    /// of the frames the object was read from. Leaves with its entry.
    ///
    /// [`EvictionPolicy::verify_copies`]: super::EvictionPolicy::verify_copies
    copy_crc: KeyMap<Arc<[u8]>, u32>,
    /// Weak handles on evicted objects ([`Codec::keep_weak`]), with the slot of the entry they
    /// belong to. Leave with their entry.
    ///
    /// [`Codec::keep_weak`]: super::Codec::keep_weak
    weak: KeyMap<Arc<[u8]>, WeakHandle<V>>,
}

impl<V> Default for Table<V> {
    fn default() -> Self {
        Table {
            map: KeyMap::default(),
            lru: BTreeMap::new(),
            next_tick: 0,
            totals: Totals::default(),
            stuck: KeySet::default(),
            copy_crc: KeyMap::default(),
            weak: KeyMap::default(),
        }
    }
}

impl<V> Table<V> {
    // The entries' transitions: each change of an entry's tier, with what goes with it, is one
    // of these methods (through `modify`, which keeps the totals and the LRU order in step).

    /// `key`'s evicted object is held serialized: its `frames`, or their lz4 block.
    pub(super) fn hold_serialized(&mut self, key: &Arc<[u8]>, frames: Frames, compressed: Option<Compressed>) {
        self.modify(key, |e| match compressed {
            Some(c) => {
                e.weight = c.block_len();
                e.compressed = Some(Box::new(c));
                e.tier = Tier::Compressed;
            }
            None => {
                e.weight = frames.total_len();
                e.frames = Some(frames);
                e.tier = Tier::Serialized;
            }
        })
    }

    /// `key`'s value leaves memory for the copy it has on disk. Returns its weight.
    pub(super) fn leave_for_disk_copy(&mut self, key: &Arc<[u8]>) -> u64 {
        self.modify(key, |e| {
            e.tier = Tier::Disk;
            e.frames = None;
            e.compressed = None;
            e.weight
        })
    }

    /// A record of `key`'s object landed (`raw` serialized bytes, `len` in the log): its disk copy;
    /// the object went with it (`object_left`) or stays.
    pub(super) fn object_written(&mut self, key: &Arc<[u8]>, raw: u64, len: u64, object_left: bool) {
        self.modify(key, |e| {
            e.disk_raw = raw;
            e.disk_bytes = len;
            if object_left {
                e.tier = Tier::Disk;
            }
        })
    }

    /// A record of `key` (`raw` serialized bytes, `len` in the log) landed: the entry gets its disk
    /// copy, and a serialized or compressed entry moves to the disk tier: every such entry for a
    /// spill, only one heavier than the target (which lives on disk) with `only_large`, for a flush,
    /// which also moves there an object heavier than the target (kept in memory when its own write
    /// was refused) unless a reader holds its slot right now. `weight` is the value's weight from
    /// then on (an object's, for frames it was serialized into).
    pub(super) fn landed(&mut self, key: &Arc<[u8]>, (raw, len): (u64, u64), only_large: bool, weight: Option<u64>) {
        self.modify(key, |e| {
            let demote = match e.tier {
                Tier::Serialized | Tier::Compressed => e.large || !only_large,
                Tier::Materialized => only_large && e.large && e.slot.evict().is_some(),
                Tier::Disk => false,
            };
            if demote {
                e.tier = Tier::Disk;
                e.frames = None;
                e.compressed = None;
                if let Some(w) = weight {
                    e.weight = w;
                }
            }
            e.disk_raw = raw;
            e.disk_bytes = len;
        })
    }

    /// `key`'s value, read back, is an object in memory again (of `weight`, at LRU position
    /// `tick`), no longer stuck; its record was dropped with `drop_record`.
    pub(super) fn materialized(&mut self, key: &Arc<[u8]>, weight: u64, tick: u64, drop_record: bool) {
        self.modify(key, |e| {
            e.tier = Tier::Materialized;
            e.frames = None;
            e.compressed = None;
            e.weight = weight;
            e.stuck = false;
            e.tick = tick;
            if drop_record {
                e.disk_raw = 0;
                e.disk_bytes = 0;
            }
        })
    }

    /// `key`'s frames, read back, are held in memory (at LRU position `tick`); it keeps its disk
    /// copy.
    pub(super) fn hold_read_back(&mut self, key: &Arc<[u8]>, frames: &Frames, tick: u64) {
        self.modify(key, |e| {
            e.tier = Tier::Serialized;
            e.weight = frames.total_len();
            e.frames = Some(frames.clone());
            e.tick = tick;
        })
    }

    /// `key`'s frames give way to their object (in the fresh slot `slot`, of `weight`).
    pub(super) fn materialized_in(&mut self, key: &Arc<[u8]>, slot: EntrySlot<V>, weight: u64) {
        self.modify(key, |e| {
            e.slot = slot;
            e.tier = Tier::Materialized;
            e.frames = None;
            e.weight = weight;
        })
    }

    /// Whether `key`'s evicted object came back through its weak handle (then its record is no
    /// copy of it): set when it does, cleared once settled.
    pub(super) fn set_revived(&mut self, key: &Arc<[u8]>, revived: bool) {
        self.modify(key, |e| e.revived = revived)
    }

    /// Note that `key`'s value failed to serialize; whether that is the first time (logged once
    /// per entry).
    pub(super) fn first_serialize_failure(&mut self, key: &Arc<[u8]>) -> bool {
        !self.modify(key, |e| std::mem::replace(&mut e.logged_serialize, true))
    }

    /// `key`'s record is a copy of its object whose frames have crc `crc`
    /// (`EvictionPolicy::verify_copies`); it leaves with the entry.
    pub(super) fn note_copy_crc(&mut self, key: Arc<[u8]>, crc: u32) {
        self.copy_crc.insert(key, crc);
    }

    /// The crc of `key`'s copy on disk, if known.
    pub(super) fn copy_crc(&self, key: &[u8]) -> Option<u32> {
        self.copy_crc.get(key).copied()
    }

    /// `key`'s record is no longer known to be a copy of its object.
    pub(super) fn forget_copy_crc(&mut self, key: &[u8]) {
        self.copy_crc.remove(key);
    }

    /// Keep a way back to `key`'s evicted object (`Codec::keep_weak`) for the entry of `slot`; it
    /// leaves with that entry, or when the object comes back.
    pub(super) fn keep_weak(&mut self, key: Arc<[u8]>, slot: EntrySlot<V>, revive: Revive<V>) {
        self.weak.insert(key, WeakHandle { slot, revive });
    }

    /// The way back to `key`'s evicted object, if one is kept for the entry of `slot`.
    pub(super) fn weak_of(&self, key: &[u8], slot: &EntrySlot<V>) -> Option<Revive<V>> {
        if self.weak.is_empty() {
            return None;
        }
        self.weak.get(key).filter(|w| Arc::ptr_eq(&w.slot, slot)).map(|w| w.revive.clone())
    }

    /// `key`'s object is back in memory: no way back to it is kept any more.
    pub(super) fn drop_weak(&mut self, key: &[u8]) {
        if !self.weak.is_empty() {
            self.weak.remove(key);
        }
    }

    pub(super) fn get(&self, key: &[u8]) -> Option<&Entry<V>> {
        self.map.get(key)
    }

    pub(super) fn get_key_value(&self, key: &[u8]) -> Option<(&Arc<[u8]>, &Entry<V>)> {
        self.map.get_key_value(key)
    }

    pub(super) fn contains(&self, key: &[u8]) -> bool {
        self.map.contains_key(key)
    }

    pub(super) fn len(&self) -> usize {
        self.map.len()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&Arc<[u8]>, &Entry<V>)> {
        self.map.iter()
    }

    /// The least recently used entry in the LRU order at tick `from` or later, with its tick.
    pub(super) fn lru_from(&self, from: u64) -> Option<(u64, &Arc<[u8]>)> {
        self.lru.range(from..).next().map(|(&t, k)| (t, k))
    }

    /// The keys in the LRU order, least recently used first.
    pub(super) fn lru_keys(&self) -> impl Iterator<Item = &Arc<[u8]>> {
        self.lru.values()
    }

    pub(super) fn totals(&self) -> &Totals {
        &self.totals
    }

    /// A tick after every tick given so far: set as an entry's `tick` (in [`Table::modify`]), it
    /// makes the entry the most recently used.
    pub(super) fn tick(&mut self) -> u64 {
        let t = self.next_tick;
        self.next_tick += 1;
        t
    }

    /// Make `key`'s entry the most recently used (an entry on disk is in no LRU order: only its
    /// tick moves).
    pub(super) fn touch(&mut self, key: &Arc<[u8]>) {
        let tick = self.tick();
        let e = self.map.get_mut(key).expect("touched key exists");
        if e.tier != Tier::Disk {
            let in_lru = Acct::of(e).in_lru();
            if in_lru {
                self.lru.remove(&e.tick);
            }
            e.tick = tick;
            if in_lru {
                self.lru.insert(tick, key.clone());
            }
        }
    }

    /// Add `e` under `key`, which has no entry: stamped as placed now and, in memory, the most
    /// recently used.
    pub(super) fn insert(&mut self, key: Arc<[u8]>, mut e: Entry<V>) {
        debug_assert!(!self.map.contains_key(&key), "insert over an entry");
        let tick = self.tick();
        e.placed = tick;
        if e.tier != Tier::Disk {
            e.tick = tick;
            if !e.stuck {
                self.lru.insert(tick, key.clone());
            }
        }
        self.totals.count_in(Acct::of(&e));
        self.map.insert(key, e);
    }

    /// Take `key`'s entry out of the map, the totals and the LRU order (with its side tables),
    /// leaving its record (if any) in the log.
    pub(super) fn take(&mut self, key: &[u8]) -> Option<Entry<V>> {
        let (_, e) = self.map.remove_entry(key)?;
        self.totals.count_out(Acct::of(&e));
        if Acct::of(&e).in_lru() {
            self.lru.remove(&e.tick);
        }
        // Listed keys that are no longer stuck (a get promoted them) leave the list here too.
        if !self.stuck.is_empty() {
            self.stuck.remove(key);
        }
        if !self.weak.is_empty() {
            self.weak.remove(key);
        }
        if !self.copy_crc.is_empty() {
            self.copy_crc.remove(key);
        }
        Some(e)
    }

    /// Disk space was freed, or space reserved for a write was given back unused: the entries
    /// marked stuck go back into the LRU order, to be tried again.
    pub(super) fn unstick(&mut self) {
        for k in std::mem::take(&mut self.stuck) {
            if self.map.get(&k).is_some_and(|e| e.stuck) {
                self.modify(&k, |e| e.stuck = false);
            }
        }
    }

    /// Mark `key`'s entry stuck: out of the LRU order until [`Table::unstick`].
    pub(super) fn set_stuck(&mut self, key: &Arc<[u8]>) {
        if self.map.get(key).is_some_and(|e| !e.stuck) {
            self.modify(key, |e| e.stuck = true);
            self.stuck.insert(key.clone());
        }
    }

    /// Change `key`'s entry in place with `f`, keeping the totals, the LRU order and the entry's
    /// `placed` stamp in step (the entry's tick is its LRU position: set it in `f`, from
    /// [`Table::tick`], to move the entry; an entry that moves between memory and disk is stamped
    /// anew). One hash lookup, where detaching and re-attaching the entry cost a removal and an
    /// insertion.
    fn modify<R>(&mut self, key: &Arc<[u8]>, f: impl FnOnce(&mut Entry<V>) -> R) -> R {
        let e = self.map.get_mut(key).expect("entry present");
        let before = Acct::of(e);
        let r = f(e);
        let after = Acct::of(e);
        if (before.tier == Tier::Disk) != (after.tier == Tier::Disk) {
            e.placed = self.next_tick;
            self.next_tick += 1;
        }
        if before != after {
            self.totals.count_out(before);
            self.totals.count_in(after);
            let moved = before.tick != after.tick;
            if before.in_lru() && (moved || !after.in_lru()) {
                self.lru.remove(&before.tick);
            }
            if after.in_lru() && (moved || !before.in_lru()) {
                self.lru.insert(after.tick, key.clone());
            }
        }
        r
    }

    /// Recompute the totals from the entries and compare them, the LRU order and the stuck list
    /// with what is kept. `record_len` is the length of a key's record in the log, checked for
    /// keys `settled` says no write is changing. `Err` names the first difference.
    pub(super) fn check(
        &self,
        record_len: impl Fn(&[u8]) -> Option<u64>,
        settled: impl Fn(&[u8]) -> bool,
    ) -> std::result::Result<(), String> {
        let mut sum = Totals::default();
        let mut in_lru = 0usize;
        for (k, e) in &self.map {
            let name = super::key_str(k);
            sum.count_in(Acct::of(e));
            let logged = record_len(k);
            if settled(k) && ((e.disk_bytes > 0) != logged.is_some() || logged.is_some_and(|l| l != e.disk_bytes)) {
                return Err(format!("{name:?}: accounted {} bytes on disk, the log has {logged:?}", e.disk_bytes));
            }
            match e.tier {
                Tier::Disk => {
                    if e.frames.is_some() || e.compressed.is_some() || e.disk_bytes == 0 {
                        return Err(format!("{name:?}: disk entry with memory state or no record"));
                    }
                }
                _ if e.stuck => {
                    if self.lru.get(&e.tick).is_some_and(|l| l == k) {
                        return Err(format!("{name:?}: stuck but in the LRU"));
                    }
                    if !self.stuck.contains(&k[..]) {
                        return Err(format!("{name:?}: stuck but not listed for unsticking"));
                    }
                }
                _ => {
                    in_lru += 1;
                    if self.lru.get(&e.tick).is_none_or(|l| l != k) {
                        return Err(format!("{name:?}: in memory but not in the LRU at its tick {}", e.tick));
                    }
                }
            }
            let has_bytes = match e.tier {
                Tier::Materialized => e.slot.state() == crate::slot::SlotState::Ready,
                Tier::Serialized => e.frames.as_ref().is_some_and(|f| f.total_len() == e.weight),
                Tier::Compressed => e.compressed.as_ref().is_some_and(|c| c.block.len() as u64 == e.weight),
                Tier::Disk => true,
            };
            if !has_bytes {
                return Err(format!("{name:?}: {} entry without its value (or with a wrong weight)", e.tier.name()));
            }
        }
        if in_lru != self.lru.len() {
            return Err(format!("LRU holds {} keys, {in_lru} entries are in memory", self.lru.len()));
        }
        if self.stuck.len() > self.map.len() {
            return Err(format!("{} keys listed as stuck, {} entries", self.stuck.len(), self.map.len()));
        }
        if sum != self.totals {
            return Err(format!("totals drifted: recomputed {sum:?}, running {:?}", self.totals));
        }
        Ok(())
    }
}

/// Where a reader finds the bytes of a non-materialized entry.
pub(super) enum Source {
    Frames(Frames),
    Compressed(Box<Compressed>),
    Disk,
}
