//! The segments and their accounting: `SegMeta` (records, live records and bytes, tombstones,
//! punched bytes, the notes of keys' oldest segments) in a `SegmentTable`, whose methods are the
//! only writers of those counts.

use std::collections::BTreeMap;

use super::location::{Location, PackedLoc};
use crate::format::{align_up, RECORD_ALIGN};

/// A record's bytes in its segment, padded to the record alignment.
pub(super) fn padded(len: u64) -> u64 {
    align_up(len, RECORD_ALIGN)
}

#[derive(Debug, Clone)]
pub(super) struct SegMeta {
    /// File size.
    size: u64,
    data_start: u64,
    /// End of the record area (`data_start` for empty).
    data_end: u64,
    sealed: bool,
    records: u64,
    live_records: u64,
    live_bytes: u64,
    tombstones: u64,
    tombstone_bytes: u64,
    /// Smallest `aux` over the segment's tombstones.
    min_shadow: u32,
    /// Bytes of forgotten records whose blocks were released with a hole punch (they occupy no disk
    /// space, so compaction does not count them as dead space to reclaim).
    punched: u64,
    /// Some record of this segment was superseded by a record still pending in memory
    /// (write-behind): deleting the segment must wait until that record is written.
    superseded_by_pending: bool,
    /// The oldest segment of live keys of this segment whose oldest segment is an older one (a key
    /// overwritten while an older copy of it exists, or a record relocated by compaction), as
    /// (offset, oldest segment), by offset. Their index entries carry `LOC_FIRST`; any other key's
    /// oldest segment is its record's own. (Kept here, not in every index entry: 4 more bytes per
    /// entry would make the index's hash table entries 48 bytes instead of 40.) Entries of records
    /// that died stay until the segment goes.
    firsts: Vec<(u32, u32)>,
    /// The file's space was reserved when the segment was made (fallocate); false for a file the
    /// file system could only extend sparsely (not enough free space, or no fallocate).
    reserved: bool,
    /// A record compaction had to move (a live value, or a needed tombstone) could not be moved,
    /// its bytes being damaged, so the segment stays: compaction leaves it alone from then on (it
    /// would find it sparse and copy its needed tombstones again every time). A damaged live value
    /// keeps the segment by being live; a damaged tombstone by staying counted, while it is needed.
    unmovable: bool,
}

impl SegMeta {
    pub(super) fn new(size: u64, data_start: u64) -> Self {
        SegMeta {
            size,
            data_start,
            data_end: data_start,
            sealed: false,
            records: 0,
            live_records: 0,
            live_bytes: 0,
            tombstones: 0,
            tombstone_bytes: 0,
            min_shadow: u32::MAX,
            punched: 0,
            superseded_by_pending: false,
            firsts: Vec::new(),
            reserved: true,
            unmovable: false,
        }
    }

    /// A segment found holding `records` records up to `data_end`: sealed (its trailer read, or a
    /// value streamed into it whole), or not (scanned record by record).
    pub(super) fn holding(size: u64, data_start: u64, data_end: u64, records: u64, sealed: bool) -> Self {
        SegMeta { data_end, records, sealed, ..SegMeta::new(size, data_start) }
    }

    /// The same segment, its file extended sparsely (no space reserved for it).
    pub(super) fn unreserved(self) -> Self {
        SegMeta { reserved: false, ..self }
    }

    /// The same segment, recovery having dropped records it cannot address: `records` left.
    pub(super) fn with_records(self, records: u64) -> Self {
        SegMeta { records, ..self }
    }

    /// File size.
    pub(super) fn size(&self) -> u64 {
        self.size
    }

    /// Where the record area starts.
    pub(super) fn data_start(&self) -> u64 {
        self.data_start
    }

    /// End of the record area (`data_start` for empty).
    pub(super) fn data_end(&self) -> u64 {
        self.data_end
    }

    /// Whether its footer and trailer are written.
    pub(super) fn is_sealed(&self) -> bool {
        self.sealed
    }

    /// Records in it (values, tombstones), live or not.
    pub(super) fn records(&self) -> u64 {
        self.records
    }

    /// Records the index points at.
    pub(super) fn live_records(&self) -> u64 {
        self.live_records
    }

    /// Padded bytes of the records the index points at.
    pub(super) fn live_bytes(&self) -> u64 {
        self.live_bytes
    }

    /// Tombstones in it.
    pub(super) fn tombstones(&self) -> u64 {
        self.tombstones
    }

    /// Padded bytes of its tombstones.
    pub(super) fn tombstone_bytes(&self) -> u64 {
        self.tombstone_bytes
    }

    /// Smallest `aux` over its tombstones (`u32::MAX` without any).
    pub(super) fn min_shadow(&self) -> u32 {
        self.min_shadow
    }

    /// Bytes released with a hole punch.
    pub(super) fn punched(&self) -> u64 {
        self.punched
    }

    /// Whether a record of it was superseded by one still pending in memory.
    pub(super) fn superseded_by_pending(&self) -> bool {
        self.superseded_by_pending
    }

    /// Whether its file's space was reserved.
    pub(super) fn reserved(&self) -> bool {
        self.reserved
    }

    /// Whether compaction found a record in it it could not move.
    pub(super) fn unmovable(&self) -> bool {
        self.unmovable
    }
}

/// The segments and their accounting ([`SegMeta`]): its methods are the only writers of a
/// segment's counts (records, live records and bytes, tombstones, punched bytes, the notes of
/// keys' oldest segments), so the garbage collector and compaction, which act on them, see what
/// every write, release and punch left. Readers see the map itself (`Deref`), never a `&mut`.
#[derive(Default)]
pub(super) struct SegmentTable(BTreeMap<u32, SegMeta>);

impl std::ops::Deref for SegmentTable {
    type Target = BTreeMap<u32, SegMeta>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl SegmentTable {
    /// A new segment, with what is known of it (a streamed segment comes sealed, with its one
    /// record: see [`SegmentTable::add_live`]).
    pub(super) fn insert(&mut self, id: u32, m: SegMeta) {
        self.0.insert(id, m);
    }

    /// A deleted segment.
    pub(super) fn remove(&mut self, id: u32) -> Option<SegMeta> {
        self.0.remove(&id)
    }

    fn get_mut(&mut self, id: u32) -> &mut SegMeta {
        self.0.get_mut(&id).expect("a record's segment has metadata")
    }

    /// Records `[.., data_end)` were written to segment `id`, `records` of them new.
    pub(super) fn extend(&mut self, id: u32, data_end: u64, records: u64) {
        let m = self.get_mut(id);
        m.data_end = data_end;
        m.records += records;
    }

    /// Segment `id` was sealed (its footer and trailer written).
    pub(super) fn seal(&mut self, id: u32) {
        self.get_mut(id).sealed = true;
    }

    /// A live record of `len` bytes in segment `id`.
    pub(super) fn add_live(&mut self, id: u32, len: u64) {
        let m = self.get_mut(id);
        m.live_records += 1;
        m.live_bytes += padded(len);
    }

    /// The live record at `old` died. Returns whether its segment holds no live record any more.
    pub(super) fn release(&mut self, old: Location) -> bool {
        let Some(m) = self.0.get_mut(&old.segment) else { return false };
        m.live_records -= 1;
        m.live_bytes -= padded(old.len);
        m.live_records == 0
    }

    /// A tombstone of `len` bytes in segment `id`, shadowing back to segment `shadow`.
    pub(super) fn add_tombstone(&mut self, id: u32, len: u64, shadow: u32) {
        let m = self.get_mut(id);
        m.tombstones += 1;
        m.tombstone_bytes += padded(len);
        m.min_shadow = m.min_shadow.min(shadow);
    }

    /// Compaction moved segment `id`'s tombstones out, except those in `kept` (see
    /// `compact::Stuck`); `pending`: copies of its records are still pending in memory.
    pub(super) fn tombstones_moved(&mut self, id: u32, kept: (u64, u64, u32), unmovable: bool, pending: bool) {
        if let Some(m) = self.0.get_mut(&id) {
            // Copies still pending in memory (write-behind) stand in for this segment's records,
            // its tombstones included: the segment may go only once they are written.
            m.superseded_by_pending |= pending;
            (m.tombstones, m.tombstone_bytes, m.min_shadow) = kept;
            m.unmovable |= unmovable;
        }
    }

    /// `bytes` of segment `segment` were released with a hole punch.
    pub(super) fn punched(&mut self, segment: u32, bytes: u64) {
        if let Some(m) = self.0.get_mut(&segment) {
            m.punched += bytes;
        }
    }

    /// A record of segment `segment` was superseded by a record still pending in memory.
    pub(super) fn superseded_by_pending(&mut self, segment: u32) {
        if let Some(m) = self.0.get_mut(&segment) {
            m.superseded_by_pending = true;
        }
    }

    /// Every pending record was written.
    pub(super) fn pending_written(&mut self) {
        for m in self.0.values_mut() {
            m.superseded_by_pending = false;
        }
    }

    /// At open: the live record at `offset` of `segment` belongs to a key whose oldest segment is
    /// `first`, another one. Noted in any order; [`SegmentTable::sort_firsts`] orders them.
    pub(super) fn recovered_first(&mut self, segment: u32, offset: u64, first: u32) {
        self.get_mut(segment).firsts.push((offset as u32, first));
    }

    /// Order the notes [`SegmentTable::recovered_first`] made.
    pub(super) fn sort_firsts(&mut self) {
        for m in self.0.values_mut() {
            m.firsts.sort_unstable();
        }
    }

    /// The oldest segment that may hold a record of the key whose live record `p` is (see
    /// [`SegMeta::firsts`]): the tombstone that deletes the key must shadow back to it.
    pub(super) fn first_segment(&self, p: &PackedLoc) -> u32 {
        if !p.first_elsewhere() {
            return p.segment();
        }
        let at = p.offset() as u32;
        let found = self.0.get(&p.segment()).and_then(|m| {
            let i = m.firsts.binary_search_by_key(&at, |&(o, _)| o).ok()?;
            Some(m.firsts[i].1)
        });
        debug_assert!(found.is_some(), "a LOC_FIRST entry without its segment's note");
        // Without its note (a bug), the oldest segment there can be: a tombstone then shadows too far
        // back, which keeps it longer but never lets an old copy come back.
        found.unwrap_or(0)
    }

    /// Note that the live record at `offset` of segment `segment` belongs to a key whose oldest
    /// segment is `first`; returns whether that is another segment (the index entry's `LOC_FIRST`).
    pub(super) fn note_first(&mut self, segment: u32, offset: u64, first: u32) -> bool {
        if first == segment {
            return false;
        }
        let m = self.0.get_mut(&segment).expect("a record's segment has metadata");
        let at = offset as u32;
        match m.firsts.last() {
            Some(&(o, _)) if o >= at => {
                // Not in offset order (never by the writer, which appends): keep the list sorted.
                let i = m.firsts.partition_point(|&(o, _)| o < at);
                if m.firsts.get(i).is_some_and(|&(o, _)| o == at) {
                    m.firsts[i].1 = first;
                } else {
                    m.firsts.insert(i, (at, first));
                }
            }
            _ => m.firsts.push((at, first)),
        }
        true
    }
}

impl FromIterator<(u32, SegMeta)> for SegmentTable {
    fn from_iter<I: IntoIterator<Item = (u32, SegMeta)>>(iter: I) -> Self {
        SegmentTable(iter.into_iter().collect())
    }
}
