//! The in-memory index entry: a record's [`Location`] and its packed form (`PackedLoc`, 16 bytes
//! per key), plus the facts a record's header gives the index (`RecordFacts`).

use crate::format::{self, FooterEntry, RECORD_ALIGN};

/// Where a live record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Location {
    /// Segment id.
    pub segment: u32,
    /// Byte offset of the record in the segment.
    pub offset: u64,
    /// Unpadded record length.
    pub len: u64,
}

/// What the index knows of a record beyond where it is: enough to read a single-frame,
/// uncompressed value without its head (its payload's crc and padding).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct RecordFacts {
    direct_crc: Option<u32>,
    pad: u32,
}

impl RecordFacts {
    /// The payload crc, for a value read without its head: single frame, not lz4, not empty.
    pub(super) fn direct_crc(&self) -> Option<u32> {
        self.direct_crc
    }

    /// The payload padding (`aux` of a value record), a multiple of 64 below 512.
    pub(super) fn pad(&self) -> u32 {
        self.pad
    }

    /// The facts of the record a footer entry describes.
    pub(super) fn of_entry(e: &FooterEntry) -> Self {
        let pad = if e.flags & format::FLAG_TOMBSTONE != 0 { 0 } else { e.aux as u64 };
        let stored = e.record_len.saturating_sub(format::head_len(e.frame_count as usize, e.key.len()) + pad);
        Self::of(e.flags, e.frame_count, e.payload_crc, e.aux, stored)
    }

    /// The facts of a record with these header fields.
    pub(super) fn of(flags: u8, frame_count: u16, payload_crc: u32, aux: u32, stored_len: u64) -> Self {
        let value = flags & (format::FLAG_TOMBSTONE | format::FLAG_SYNC_MARK) == 0;
        let direct = value && flags & format::FLAG_LZ4 == 0 && frame_count == 1 && stored_len > 0;
        RecordFacts { direct_crc: direct.then_some(payload_crc), pad: if value { aux } else { 0 } }
    }
}

/// A [`Location`] and its [`RecordFacts`] as the index stores them, in 16 bytes (1 M keys: the
/// hash table's entries stay 40 bytes), with a flag saying whether the key's oldest segment is
/// another one (see [`SegMeta::firsts`]). Offsets fit 32 bits because a segment is at most
/// [`MAX_SEGMENT_BYTES`] (a jumbo segment holds one record, at its start), and their low 6 bits are
/// free for flags because records start at multiples of 64; lengths fit because values are at most
/// [`MAX_VALUE_BYTES`].
#[derive(Debug, Clone, Copy)]
pub(super) struct PackedLoc {
    segment: u32,
    /// The offset, with `LOC_*` flags and the payload padding / 64 in its low 6 bits.
    offset_bits: u32,
    len: u32,
    /// The payload crc when `LOC_DIRECT` is set.
    crc: u32,
}

/// `PackedLoc` flag: the value can be read without its head (`crc` is its payload crc).
pub(super) const LOC_DIRECT: u32 = 1;

/// `PackedLoc` flag: the key's oldest segment is an older one, listed in the segment's `firsts`.
pub(super) const LOC_FIRST: u32 = 2;

/// `PackedLoc`: the payload padding / 64 is in these bits.
pub(super) const LOC_PAD_SHIFT: u32 = 2;

pub(super) const LOC_PAD_MASK: u32 = 7;

const _: () = assert!(format::PAYLOAD_PAD_LIMIT / 64 <= LOC_PAD_MASK as u64 + 1);

const _: () = assert!(RECORD_ALIGN >= 64);

impl PackedLoc {
    /// `l` must pack: the writer places records so (`fits`, `MAX_RECORD_BYTES`), and recovery drops
    /// entries that do not (see `recover`).
    pub(super) fn new(l: Location, facts: RecordFacts, first_elsewhere: bool) -> Self {
        debug_assert!(l.offset <= u32::MAX as u64 && l.len <= u32::MAX as u64, "{l:?} does not pack");
        debug_assert!(l.offset % RECORD_ALIGN == 0 && facts.pad % 64 == 0 && facts.pad / 64 <= LOC_PAD_MASK);
        let mut bits = l.offset as u32 | (facts.pad / 64) << LOC_PAD_SHIFT;
        if facts.direct_crc.is_some() {
            bits |= LOC_DIRECT;
        }
        if first_elsewhere {
            bits |= LOC_FIRST;
        }
        PackedLoc { segment: l.segment, offset_bits: bits, len: l.len as u32, crc: facts.direct_crc.unwrap_or(0) }
    }

    /// The segment the record is in.
    pub(super) fn segment(&self) -> u32 {
        self.segment
    }

    /// The record's offset in its segment (without the flags kept in the low bits).
    pub(super) fn offset(&self) -> u64 {
        (self.offset_bits & !63) as u64
    }

    pub(super) fn loc(&self) -> Location {
        Location { segment: self.segment, offset: self.offset(), len: self.len as u64 }
    }

    pub(super) fn facts(&self) -> RecordFacts {
        RecordFacts {
            direct_crc: (self.offset_bits & LOC_DIRECT != 0).then_some(self.crc),
            pad: (self.offset_bits >> LOC_PAD_SHIFT & LOC_PAD_MASK) * 64,
        }
    }

    pub(super) fn first_elsewhere(&self) -> bool {
        self.offset_bits & LOC_FIRST != 0
    }
}

impl From<PackedLoc> for Location {
    fn from(p: PackedLoc) -> Self {
        p.loc()
    }
}
