//! The index: each live key's record, behind the index lock, kept true to the accounting of the
//! segments (`SegmentTable`) the records are in.
//!
//! The log's central invariant lives here: every entry of the index is counted live in its
//! segment, and a record the index stops pointing at is released from its segment's accounting in
//! the same step. Records are published through a [`Publisher`], which holds the index's write
//! lock and the writer's segment table together: each of its methods changes the index and the
//! accounting at once, and nothing else writes the index. Two paths build or change it apart from
//! a publisher, each with the accounting taken care of by its own rule: recovery builds the map and
//! the table together (`recover::settle_winners`), and `forget`, which may not wait for the writer
//! lock, takes a key out here and leaves its record's release to the writer lock's next taker
//! (`Forgotten`, gc.rs).

use super::location::{Location, PackedLoc, RecordFacts};
use super::table::SegmentTable;
use crate::key::{IndexKey, KeyMap};
use crate::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Each live key's record (see the module's documentation).
pub(super) struct Index {
    map: RwLock<KeyMap<IndexKey, PackedLoc>>,
}

/// A consistent view of the index for several lookups, under its read lock.
pub(super) struct IndexView<'a>(RwLockReadGuard<'a, KeyMap<IndexKey, PackedLoc>>);

impl IndexView<'_> {
    /// `key`'s entry.
    pub(super) fn get(&self, key: &[u8]) -> Option<PackedLoc> {
        self.0.get(key).copied()
    }
}

/// Publishing records: the index's write lock and the writer's segment table, held together. What
/// the caller does while holding it (marking streams overtaken, say) happens under the index lock.
pub(super) struct Publisher<'a> {
    map: RwLockWriteGuard<'a, KeyMap<IndexKey, PackedLoc>>,
    segs: &'a mut SegmentTable,
}

impl Index {
    /// The index recovery built (with the segment table that counts its records).
    pub(super) fn new(map: KeyMap<IndexKey, PackedLoc>) -> Self {
        Index { map: RwLock::new(map) }
    }

    fn read(&self) -> RwLockReadGuard<'_, KeyMap<IndexKey, PackedLoc>> {
        self.map.read().unwrap_or_else(|p| p.into_inner())
    }

    /// `key`'s entry.
    pub(super) fn get(&self, key: &[u8]) -> Option<PackedLoc> {
        self.read().get(key).copied()
    }

    /// `key`'s entry, and `then` run on it under the read lock (a segment is deleted only after
    /// the index stopped pointing at it: what `then` looks up of the segment is still there).
    pub(super) fn get_then<R>(&self, key: &[u8], then: impl FnOnce(PackedLoc) -> Option<R>) -> Option<R> {
        let map = self.read();
        then(*map.get(key)?)
    }

    /// A view for several lookups that must agree with each other.
    pub(super) fn view(&self) -> IndexView<'_> {
        IndexView(self.read())
    }

    /// Whether `key` has a live record.
    pub(super) fn contains(&self, key: &[u8]) -> bool {
        self.read().contains_key(key)
    }

    /// Live keys.
    pub(super) fn len(&self) -> usize {
        self.read().len()
    }

    /// Every live key, sorted.
    pub(super) fn keys(&self) -> Vec<Vec<u8>> {
        let mut k: Vec<Vec<u8>> = self.read().keys().map(|k| k.to_vec()).collect();
        k.sort_unstable();
        k
    }

    /// Take `key` out of the index without the writer lock (`forget`); `marked` runs under the
    /// index lock when it was there. The caller releases the record returned from its segment's
    /// accounting under the writer lock, now or through `Forgotten`.
    pub(super) fn forget(&self, key: &[u8], marked: impl FnOnce()) -> Option<Location> {
        let mut map = self.map.write().unwrap_or_else(|p| p.into_inner());
        let old = map.remove(key)?;
        marked();
        Some(old.into())
    }

    /// Start publishing records counted in `segs` (the writer's table: the caller holds the writer
    /// lock).
    pub(super) fn publisher<'a>(&'a self, segs: &'a mut SegmentTable) -> Publisher<'a> {
        Publisher { map: self.map.write().unwrap_or_else(|p| p.into_inner()), segs }
    }
}

impl Publisher<'_> {
    /// `key`'s value record at `loc` becomes its live record: counted live in its segment, the
    /// key's oldest segment noted, and the record it replaces released (its segment pushed to
    /// `emptied` when nothing live is left in it; marked superseded by a pending record when the
    /// new one is still `pending` in memory).
    pub(super) fn value(
        &mut self,
        key: &[u8],
        loc: Location,
        facts: RecordFacts,
        pending: bool,
        emptied: &mut Vec<u32>,
    ) {
        let id = loc.segment;
        let first = self.map.get(key).map_or(id, |o| self.segs.first_segment(o).min(id));
        let elsewhere = self.segs.note_first(id, loc.offset, first);
        if let Some(old) = self.map.insert(IndexKey::from(key), PackedLoc::new(loc, facts, elsewhere)) {
            self.release(old.into(), pending, emptied);
        }
        self.segs.add_live(id, loc.len);
    }

    /// A tombstone of `key` at `loc`, shadowing segments from `shadow` on: the key's live record
    /// (if any) released as in [`Publisher::value`], the tombstone counted in its segment.
    pub(super) fn tombstone(&mut self, key: &[u8], loc: Location, shadow: u32, pending: bool, emptied: &mut Vec<u32>) {
        if let Some(old) = self.map.remove(key) {
            self.release(old.into(), pending, emptied);
        }
        self.segs.add_tombstone(loc.segment, loc.len, shadow);
    }

    /// A tombstone copied by compaction to `loc`: counted, the index unchanged.
    pub(super) fn tombstone_copy(&mut self, loc: Location, shadow: u32) {
        self.segs.add_tombstone(loc.segment, loc.len, shadow);
    }

    /// Whether `key`'s live record is the one at `(segment, offset)`.
    pub(super) fn points_at(&self, key: &[u8], (segment, offset): (u32, u64)) -> bool {
        self.map.get(key).is_some_and(|l| (l.segment(), l.offset()) == (segment, offset))
    }

    fn release(&mut self, old: Location, pending: bool, emptied: &mut Vec<u32>) {
        if self.segs.release(old) {
            emptied.push(old.segment);
        }
        if pending {
            self.segs.superseded_by_pending(old.segment);
        }
    }
}
