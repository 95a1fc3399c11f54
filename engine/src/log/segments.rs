//! Segments as the writer sees them: the active segment and the writer's state (with the segment
//! table, table.rs), and the segment lifecycle: fit, rotate, seal (footer and trailer). Also what the
//! layers above build on: a superseded record's accounting and which tombstones are still needed,
//! which closed segments are sparse, the write buffers, writing the records pending in the active
//! segment's tail, and erasing what an aborted write left past the published end.

use std::io;
use std::path::Path;
use std::sync::Arc;

use crate::backend::Backend;
use crate::buf::AlignedBuf;
use crate::error::{Error, Result};
use crate::format::{self, align_down, align_up, FooterEntry};

use super::health::{WARN_PUNCH, WARN_REUSE};
use super::location::Location;

use super::table::{padded, SegMeta, SegmentTable};
use super::{SegmentLog, MAX_SPARE_BUF, ZEROS};

/// Writes of one chunk in flight at once.
pub(super) const WRITES_IN_FLIGHT: usize = 16;

pub(super) struct Active<F> {
    pub(super) id: u32,
    pub(super) file: Arc<F>,
    pub(super) size: u64,
    /// Next record offset (64-aligned).
    pub(super) data_end: u64,
    /// Bytes `[base, data_end)`, where `base` is `written_end` rounded down to the alignment: the
    /// partial block the next write rewrites, and any pending (write-behind) records after it.
    pub(super) tail: Vec<u8>,
    /// Everything before this offset has been written to the file; records at or after it are pending
    /// in `tail` (write-behind). Equal to `data_end` when nothing is pending.
    pub(super) written_end: u64,
    pub(super) footer: Vec<u8>,
    pub(super) footer_entries: u64,
    pub(super) max_epoch: u32,
    /// Written since the last fdatasync.
    pub(super) dirty: bool,
    /// The last record written is a sync mark (another one would prove nothing new).
    pub(super) last_is_mark: bool,
    /// Its file's space is reserved (see [`SegMeta::reserved`]): only then may writes stay pending
    /// (write-behind). In a sparse file a write can fail for want of space, and a spill that did
    /// not reach the disk must fail at once, as it would with nothing pending.
    pub(super) reserved: bool,
}

pub(super) struct WriterState<F> {
    pub(super) active: Option<Active<F>>,
    pub(super) segs: SegmentTable,
    pub(super) next_segment: u32,
    pub(super) next_seq: u64,
    pub(super) epoch: u32,
    /// Segments were created or deleted since the segments directory was last fsync'ed.
    pub(super) dir_dirty: bool,
    /// Segments were created since then (a subset of `dir_dirty`): a segment must not be unlinked
    /// before their entries are durable (see `delete_segment`).
    pub(super) dir_new_segments: bool,
    /// A seal made compaction worthwhile; run it at the end of the current append.
    pub(super) compact_pending: bool,
    /// Compaction is running (its own appends must not start another).
    pub(super) compacting: bool,
    /// Sealed segments whose footer and trailer are not yet fdatasync'ed (done by the next `sync`).
    pub(super) unsynced_sealed: Vec<Arc<F>>,
    /// The last write buffer, kept for reuse.
    /// Write buffers kept for reuse (a fresh multi-MiB buffer costs a page fault per 4 KiB).
    pub(super) spare_bufs: Vec<AlignedBuf>,
    /// Files of deleted segments kept for reuse (`LogOptions::recycle_segments`), still under their
    /// old names, each `segment_bytes` long.
    pub(super) spare_files: Vec<SpareFile<F>>,
    /// The backend cannot rename files: dead segments are unlinked, not kept.
    pub(super) no_rename: bool,
}

/// The file of a deleted segment, kept to become a new segment. Nothing reads it: it was kept only
/// when the log's handle was the last one, and it is out of the `files` map.
pub(super) struct SpareFile<F> {
    /// The id it had (its file is still named after it).
    id: u32,
    file: Arc<F>,
    /// Some of its space is not reserved (holes were punched in it for forgotten large records, or it
    /// was made sparse): its blocks are reserved again on reuse.
    punched: bool,
}

impl<F> SpareFile<F> {
    /// The file of segment `id`, kept for reuse (`punched`: some of its space may not be
    /// reserved).
    pub(super) fn new(id: u32, file: Arc<F>, punched: bool) -> Self {
        SpareFile { id, file, punched }
    }

    /// The id it had.
    pub(super) fn id(&self) -> u32 {
        self.id
    }
}

/// Most files of deleted segments kept for reuse: segments die about as fast as new ones are needed,
/// so a few cover the gap between a delete and the next rotation.
pub(super) const MAX_SPARE_FILES: usize = 4;

/// Most files of a spill log's last run kept at open for its new segments (`discard_segments`): 16
/// GiB of the default 64 MiB segments. Beyond that a log that reopens its directory gives the space
/// back at once.
pub(super) const MAX_KEPT_AT_OPEN: usize = 256;

/// Room the footer will need for one more entry with this key.
pub(super) fn footer_entry_len(key_len: usize) -> u64 {
    FooterEntry::encoded_len(key_len)
}

/// Whether a record of `len` bytes (and its footer entry) fits in the active segment.
pub(super) fn fits<B: Backend>(log: &SegmentLog<B>, a: &Active<B::File>, len: u64, key_len: usize) -> bool {
    let data_end = padded(a.data_end + len);
    let footer = a.footer.len() as u64 + footer_entry_len(key_len);
    // The index holds offsets in 32 bits: after a jumbo record, nothing more goes in its segment.
    a.data_end <= u32::MAX as u64 && align_up(data_end, log.align) + footer + format::TRAILER_LEN as u64 <= a.size
}

pub(super) fn sync_active<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>) -> Result<()> {
    // Records pending under write-behind are part of what must be durable (sealing, `sync`, and
    // deleting a segment whose contents they superseded all rely on it).
    flush_pending(log, st)?;
    if let Some(a) = st.active.as_mut() {
        if a.dirty {
            // Never after a failed write or fdatasync (it could report success for lost data).
            log.health.check_writable()?;
            if let Err(e) = log.backend.sync_data(&a.file) {
                return Err(log.health.poison(Error::io("fdatasync", log.seg_path(a.id), e)));
            }
            a.dirty = false;
        }
    }
    Ok(())
}

pub(super) fn sync_dir_if_dirty<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>) -> Result<()> {
    if st.dir_dirty {
        if let Err(e) = log.backend.sync_dir(&log.seg_dir) {
            return Err(log.health.poison(Error::io("fsync directory", log.seg_dir.clone(), e)));
        }
        st.dir_dirty = false;
        st.dir_new_segments = false;
    }
    Ok(())
}

/// Seal the active segment (if any) and create a new one that can hold a record of `len` bytes.
pub(super) fn rotate<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    len: u64,
    key_len: usize,
) -> Result<()> {
    if st.active.is_some() {
        seal_active(log, st)?;
        if log.opts.auto_compact && wants_compaction(log, st) {
            // Run after the caller's records are written, not in the middle of its batch (and
            // asked for here, so that a failure to create the next segment does not lose it).
            st.compact_pending = true;
        }
    }
    let data_start = log.align;
    let need = align_up(padded(data_start + len), log.align)
        + align_up(footer_entry_len(key_len) + format::TRAILER_LEN as u64, log.align);
    let size = log.opts.segment_bytes.max(need);
    let id = st.next_segment;
    st.next_segment = id.checked_add(1).ok_or_else(|| Error::Exhausted("segment ids".into()))?;
    let path = log.seg_path(id);
    let cleanup = |e: Error| {
        let _ = log.backend.remove_file(&path);
        e
    };
    let (file, reserved) = match reuse_spare_file(log, st, &path, size) {
        Some(reused) => reused,
        None => create_segment_file(log, st, &path, size)?,
    };
    write_segment_header(log, &file, id, size, st.epoch)
        .map_err(|e| cleanup(Error::io("write segment header", path.clone(), e)))?;
    st.dir_dirty = true;
    st.dir_new_segments = true;
    log.files.write().unwrap_or_else(|p| p.into_inner()).insert(id, file.clone());
    let meta = SegMeta::new(size, data_start);
    st.segs.insert(id, if reserved { meta } else { meta.unreserved() });
    st.active = Some(Active {
        id,
        file,
        size,
        data_end: data_start,
        tail: Vec::new(),
        written_end: data_start,
        footer: Vec::new(),
        footer_entries: 0,
        max_epoch: st.epoch,
        dirty: true,
        last_is_mark: false,
        reserved,
    });
    Ok(())
}

/// A new file for segment `path` of `size` bytes, its space reserved (`true`) where the backend
/// can; files kept for reuse are let go first when they cannot become it (a segment sized for one
/// large record) or when they hold the space it needs. A file it cannot reserve space for is removed.
fn create_segment_file<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    path: &Path,
    size: u64,
) -> Result<(Arc<B::File>, bool)> {
    if size != log.opts.segment_bytes {
        release_spare_files(log, st);
    }
    let file = log.backend.open(path, true).map_err(|e| Error::io("create segment", path.to_path_buf(), e))?;
    let mut reserved = log.backend.allocate(&file, size);
    if !matches!(reserved, Ok(true)) && release_spare_files(log, st) {
        reserved = log.backend.allocate(&file, size);
    }
    match reserved {
        Ok(reserved) => Ok((Arc::new(file), reserved)),
        Err(e) => {
            let _ = log.backend.remove_file(path);
            Err(Error::io("fallocate", path.to_path_buf(), e))
        }
    }
}

/// Write the header of segment `id` (`size` bytes, its records from `log.align` on, written in
/// `epoch`) at the start of `file`.
pub(super) fn write_segment_header<B: Backend>(
    log: &SegmentLog<B>,
    file: &B::File,
    id: u32,
    size: u64,
    epoch: u32,
) -> io::Result<()> {
    let header = format::SegmentHeader {
        segment: id,
        segment_bytes: size,
        align: log.align as u32,
        epoch,
        data_start: log.align,
        salt: log.salt,
    };
    let mut hb = AlignedBuf::zeroed(log.align as usize, log.align as usize);
    hb[..format::SEGMENT_HEADER_LEN].copy_from_slice(&format::encode_segment_header(&header));
    log.backend.write_at(file, 0, hb).0
}

/// The file of a deleted segment, renamed to `path`, for a new segment of `size` bytes, and
/// whether its space is reserved: `None` if none is kept or the size differs (a segment sized
/// for one large record). A file that cannot be renamed is unlinked instead.
pub(super) fn reuse_spare_file<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    path: &Path,
    size: u64,
) -> Option<(Arc<B::File>, bool)> {
    if size != log.opts.segment_bytes {
        return None;
    }
    while let Some(spare) = st.spare_files.pop() {
        let old = log.seg_path(spare.id);
        let reserved = if spare.punched { log.backend.allocate(&spare.file, size) } else { Ok(true) };
        match reserved.and_then(|r| log.backend.rename(&old, path).map(|()| r)) {
            Ok(reserved) => return Some((spare.file, reserved)),
            Err(e) => {
                if e.kind() == io::ErrorKind::Unsupported {
                    st.no_rename = true;
                } else if log.health.warn_once(WARN_REUSE) {
                    log::warn!(
                        "segment log {}: reusing {} failed ({e}); unlinking it",
                        log.dir.display(),
                        old.display()
                    );
                }
                let _ = log.backend.remove_file(&old);
            }
        }
    }
    None
}

/// Unlink every file kept for reuse, giving its disk space back: before a new file is
/// preallocated where the space may be short (a segment sized for one large record, a full file
/// system). Whether there was any.
pub(super) fn release_spare_files<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>) -> bool {
    let any = !st.spare_files.is_empty();
    for spare in std::mem::take(&mut st.spare_files) {
        let _ = log.backend.remove_file(&log.seg_path(spare.id));
    }
    any
}

/// Write the footer and the trailer of segment `id` (`size` bytes, records up to `data_end`):
/// the trailer last (in its own write, or at the end of the only one), so that without it the
/// segment is still an unsealed one whose records end at `data_end`.
#[allow(clippy::too_many_arguments)] // the segment's facts, from an `Active` or a stream
pub(super) fn write_seal<B: Backend>(
    log: &SegmentLog<B>,
    file: &B::File,
    id: u32,
    size: u64,
    data_end: u64,
    footer: &[u8],
    entries: u64,
    max_epoch: u32,
) -> io::Result<std::ops::Range<u64>> {
    let footer_offset = align_up(data_end, log.align);
    let footer_len = footer.len() as u64;
    let trailer = format::Trailer {
        segment: id,
        max_epoch,
        footer_offset,
        footer_len,
        entry_count: entries,
        data_end,
        footer_crc: format::footer_crc(footer),
        salt: log.salt,
    };
    let tb = format::encode_trailer(&trailer);
    let footer_end = align_up(footer_offset + footer_len, log.align);
    let trailer_block = size - log.align;
    let write = |offset: u64, buf: AlignedBuf| -> io::Result<()> { log.backend.write_at(file, offset, buf).0 };
    if footer_end <= trailer_block {
        let mut fb = AlignedBuf::zeroed((footer_end - footer_offset) as usize, log.align as usize);
        fb[..footer.len()].copy_from_slice(footer);
        let written = if footer_len > 0 { write(footer_offset, fb) } else { Ok(()) };
        written.and_then(|()| {
            let mut t = AlignedBuf::zeroed(log.align as usize, log.align as usize);
            t[log.align as usize - format::TRAILER_LEN..].copy_from_slice(&tb);
            write(trailer_block, t)
        })?;
        Ok(footer_end..trailer_block)
    } else {
        let mut fb = AlignedBuf::zeroed((size - footer_offset) as usize, log.align as usize);
        fb[..footer.len()].copy_from_slice(footer);
        let n = fb.len();
        fb[n - format::TRAILER_LEN..].copy_from_slice(&tb);
        write(footer_offset, fb)?;
        Ok(size..size)
    }
}

/// Forgotten records at least this large are hole-punched (with `LogOptions::punch_forgotten`).
pub(super) const PUNCH_MIN_BYTES: u64 = 256 << 10;

/// Release `len` bytes of segment `segment`'s `file` from `start` (block-aligned, holding no
/// record anyone reads), on the punch thread where the backend has one, and count them as punched
/// (space that neither compaction nor the disk accounting counts as the segment's any more).
pub(super) fn punch_range<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    segment: u32,
    file: &Arc<B::File>,
    start: u64,
    len: u64,
) {
    let punched = match log.backend.detached_punch() {
        Some(punch) if log.punches.queue(punch, &log.files, segment, file, start, len) => Ok(()),
        _ => log.backend.punch_hole(file, start, len),
    };
    match punched {
        Ok(()) => st.segs.punched(segment, len),
        Err(e) => {
            if log.health.warn_once(WARN_PUNCH) {
                log::warn!(
                    "cannot punch holes in segment files ({e}); forgotten records keep their space until compaction"
                );
            }
        }
    }
}

/// Seal the active segment: data durable first, then footer and trailer.
pub(super) fn seal_active<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>) -> Result<()> {
    flush_pending(log, st)?;
    if log.opts.durable {
        sync_active(log, st)?;
        sync_dir_if_dirty(log, st)?;
    }
    let a = st.active.as_ref().expect("active segment to seal");
    if align_up(a.data_end, log.align) + a.footer.len() as u64 + format::TRAILER_LEN as u64 > a.size {
        // Never for segments this log wrote (`fits` keeps the room) nor recovered (`recover`
        // does not continue one without it); an error, not a panic, all the same.
        return Err(Error::Corrupt {
            segment: a.id,
            offset: a.data_end,
            reason: "no room for the segment's footer and trailer after its records".into(),
        });
    }
    let a = st.active.take().expect("active segment to seal");
    let unused = match write_seal(log, &a.file, a.id, a.size, a.data_end, &a.footer, a.footer_entries, a.max_epoch) {
        Ok(unused) => unused,
        Err(e) => {
            // The trailer comes last (in its own write, or at the end of the only one), so without
            // it the segment is still an unsealed one whose records end at `data_end`: it stays
            // active.
            let err = log.health.write_failed("write footer", log.seg_path(a.id), e);
            st.active = Some(a);
            return Err(err);
        }
    };
    st.segs.seal(a.id);
    // A segment sealed early (the next record did not fit) leaves its preallocated space between
    // footer and trailer unused. A log that punches releases it now: otherwise the space counts
    // against the segment as dead, and compaction copies the segment's live records elsewhere
    // only to free space no record ever held.
    if log.opts.punch_forgotten && unused.end - unused.start >= PUNCH_MIN_BYTES {
        punch_range(log, st, a.id, &a.file, unused.start, unused.end - unused.start);
    }
    st.unsynced_sealed.push(a.file);
    Ok(())
}

/// Erase `base..end` of a segment (the active one after an aborted `put_stream`, or a tail that
/// recovery cut): the block at `base` gets the previous tail back (published records) and zeros
/// after it; the rest is punched out, which needs no free space (zero writes into blocks the aborted
/// write never reached would, on a full disk), or zeroed where the file system cannot punch.
pub(super) fn erase_aborted<B: Backend>(
    backend: &B,
    align: u64,
    file: &B::File,
    base: u64,
    old_tail: &[u8],
    end: u64,
) -> io::Result<()> {
    let block = align;
    let align = align as usize;
    let mut pos = base;
    if !old_tail.is_empty() {
        let mut z = AlignedBuf::zeroed(align, align);
        z[..old_tail.len()].copy_from_slice(old_tail);
        backend.write_at(file, base, z).0?;
        pos += block;
    }
    if pos >= end {
        return Ok(());
    }
    match backend.punch_hole(file, pos, end - pos) {
        Err(e) if e.kind() == io::ErrorKind::Unsupported => {}
        r => return r,
    }
    const CHUNK: u64 = 1 << 20;
    let mut z = AlignedBuf::zeroed(CHUNK.min(end - pos) as usize, align);
    while pos < end {
        let n = (end - pos).min(CHUNK) as usize;
        z.set_len(n);
        let (r, b) = backend.write_at(file, pos, z);
        z = b;
        r?;
        pos += n as u64;
    }
    Ok(())
}

pub(super) fn release<F>(st: &mut WriterState<F>, old: Location, emptied: &mut Vec<u32>) {
    if st.segs.release(old) {
        emptied.push(old.segment);
    }
}

/// Whether some tombstone of segment `id` may still shadow an older record.
pub(super) fn tombstones_needed<F>(st: &WriterState<F>, id: u32) -> bool {
    let m = &st.segs[&id];
    // `min_shadow <= id` always (recovery refuses a tombstone that shadows a later segment than
    // its own); checked anyway, since `range` panics on a reversed range.
    m.tombstones() > 0 && m.min_shadow() < id && st.segs.range(m.min_shadow()..id).next().is_some()
}

pub(super) fn wants_compaction<B: Backend>(log: &SegmentLog<B>, st: &WriterState<B::File>) -> bool {
    st.segs.iter().any(|(&id, m)| closed(st, id, m) && is_sparse(log, st, id, m))
}

/// Whether segment `id` takes no more records: sealed, or an unsealed one that recovery found
/// behind the newest (its footer did not land before a crash). Such segments can be compacted.
pub(super) fn closed<F>(st: &WriterState<F>, id: u32, m: &SegMeta) -> bool {
    m.is_sealed() || st.active.as_ref().is_none_or(|a| a.id != id)
}

pub(super) fn is_sparse<B: Backend>(log: &SegmentLog<B>, st: &WriterState<B::File>, id: u32, m: &SegMeta) -> bool {
    if m.unmovable() {
        return false;
    }
    let tomb = if tombstones_needed(st, id) { m.tombstone_bytes() } else { 0 };
    log.opts.compaction.is_sparse(m.live_bytes() + tomb, m.size() - m.punched().min(m.size()))
}

/// Write the records pending in the active segment's tail (write-behind), if any. On failure the
/// log is poisoned and the records stay pending, readable from memory.
pub(super) fn flush_pending<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>) -> Result<()> {
    let Some(a) = st.active.as_ref() else { return Ok(()) };
    if a.written_end == a.data_end {
        return Ok(());
    }
    log.health.check_writable()?;
    let (id, file, data_end) = (a.id, a.file.clone(), a.data_end);
    let base = data_end - a.tail.len() as u64;
    debug_assert_eq!(base % log.align, 0, "the tail starts at a block boundary");
    let needed = (align_up(data_end, log.align) - base) as usize;
    let r = if log.backend.gathers_writes() {
        // Buffered files: straight from the tail, no copy into a staging buffer first (the tail
        // holds every pending byte, encoded once; copying it again costs as much as encoding).
        let mut parts: Vec<&[u8]> = vec![&a.tail];
        let mut zeros = needed - a.tail.len();
        while zeros > 0 {
            let k = zeros.min(ZEROS.len());
            parts.push(&ZEROS[..k]);
            zeros -= k;
        }
        log.backend.write_gather_at(&file, base, &parts)
    } else {
        let mut buf = write_buffer(log, st, needed);
        let a = st.active.as_ref().expect("active segment");
        buf[..a.tail.len()].copy_from_slice(&a.tail);
        buf[a.tail.len()..].fill(0);
        let (r, buf) = log.backend.write_at(&file, base, buf);
        if buf.capacity() <= MAX_SPARE_BUF {
            st.spare_bufs.push(buf);
        }
        r
    };
    if let Err(e) = r {
        // The records stay pending in the tail, readable from memory.
        return Err(log.health.write_failed("write segment", log.seg_path(id), e));
    }
    let a = st.active.as_mut().expect("active segment");
    a.tail.drain(..(align_down(data_end, log.align) - base) as usize);
    a.written_end = data_end;
    log.pending.clear();
    log.health.wrote();
    st.segs.pending_written();
    Ok(())
}

pub(super) fn write_buffer<B: Backend>(
    log: &SegmentLog<B>,
    st: &mut WriterState<B::File>,
    needed: usize,
) -> AlignedBuf {
    if let Some(k) = st.spare_bufs.iter().position(|b| b.capacity() >= needed) {
        let mut b = st.spare_bufs.swap_remove(k);
        b.set_len(needed);
        return b;
    }
    // Room to grow: the next batch of same-sized values needs a little more or less depending on
    // where the last one ended in its block. Without the slack, writing 8 MiB values would
    // alternate between reusing the buffer and allocating (and faulting in) a fresh one; profiled
    // in a dask worker, that was a quarter of the spill time.
    st.spare_bufs.truncate(WRITES_IN_FLIGHT);
    let cap = (needed + (needed / 8).max(64 << 10)).min(MAX_SPARE_BUF.max(needed));
    let mut b = log.backend.alloc_buf(cap, log.align as usize);
    b.set_len(needed);
    b
}
