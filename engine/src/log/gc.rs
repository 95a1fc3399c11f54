//! Reclaiming space: releasing forgotten records, punching holes in
//! closed segments for large dead records, deleting segments with nothing live and no needed
//! tombstone, or keeping their files to become new segments (`LogOptions::recycle_segments`).

use std::io;
use std::path::Path;
use std::sync::Arc;

use crate::backend::{Backend, DetachedPunch};
use crate::error::{Error, Result};
use crate::format::{self, align_down, align_up};
use crate::key::KeyMap;
use crate::sync::{AtomicBool, Mutex, Ordering, RwLock};

use super::health::WARN_GC;
use super::location::Location;
use super::options::LogOptions;
use super::segments::{
    flush_pending, punch_range, release, sync_active, sync_dir_if_dirty, tombstones_needed, SpareFile, WriterState,
    MAX_KEPT_AT_OPEN, MAX_SPARE_FILES, PUNCH_MIN_BYTES,
};
use super::{lock, parse_seg_file_name, SegmentLog};

/// Records forgotten while the writer lock was busy (a long write, compaction): their index entries
/// are gone at once; their space accounting, garbage collection and hole punching wait for the next
/// taker of the writer lock (`SegmentLog::writer`). So `forget` never waits for a write.
pub(super) struct Forgotten {
    locs: Mutex<Vec<Location>>,
    /// `locs` is not empty: read without its lock at every writer-lock acquisition.
    any: AtomicBool,
}

impl Forgotten {
    pub(super) fn new() -> Self {
        Forgotten { locs: Mutex::new(Vec::new()), any: AtomicBool::new(false) }
    }

    /// Leave the record at `loc` for the writer lock's next taker.
    pub(super) fn push(&self, loc: Location) {
        let mut locs = lock(&self.locs);
        locs.push(loc);
        self.any.store(true, Ordering::Release);
    }

    /// The records left so far (none without taking the lock, the common case).
    pub(super) fn take(&self) -> Vec<Location> {
        if !self.any.load(Ordering::Acquire) {
            return Vec::new();
        }
        let mut locs = lock(&self.locs);
        self.any.store(false, Ordering::Release);
        std::mem::take(&mut *locs)
    }
}

/// Account for the records `forget` left while the writer lock was busy.
pub(super) fn settle_forgotten<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>) {
    for old in log.forgotten.take() {
        release_forgotten(log, st, old);
    }
}

/// Account for a forgotten record (its index entry already removed): its segment's live count,
/// garbage collection, and the punch that releases its blocks.
pub(super) fn release_forgotten<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>, old: Location) {
    let mut emptied = Vec::new();
    release(st, old, &mut emptied);
    if log.health.is_poisoned() {
        return; // read-only: nothing on disk changes any more
    }
    if !emptied.is_empty() {
        reclaim(log, st);
    }
    // Punch unless the record's segment is gone: an emptied segment may stay (the active one is
    // never deleted, and a deletion can fail), and then the record's blocks would stay with it.
    if log.opts.punch_forgotten
        && old.len >= PUNCH_MIN_BYTES
        && st.segs.contains_key(&old.segment)
        && !log.health.is_poisoned()
    {
        punch(log, st, old);
    }
}

/// Release the whole blocks inside a forgotten record (`LogOptions::punch_forgotten`): its disk
/// space and page-cache pages go at once, as a deleted file's would, instead of staying (dirty) until
/// the whole segment dies or is compacted. Only blocks that lie entirely inside the record are
/// punched. Neighbouring records, the segment header and the tail block that the next write
/// rewrites are never touched. Advisory: a failure is logged once and changes nothing else.
/// Where the backend can punch without itself ([`Backend::detached_punch`]), the punch runs on
/// the log's punch thread ([`Punches`]), and the caller does not wait for it.
pub(super) fn punch<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>, old: Location) {
    if st.active.as_ref().is_some_and(|a| a.id == old.segment && old.offset >= a.written_end) {
        return; // pending (write-behind): not in the file yet, nothing to release
    }
    if log.sends.pinned((old.segment, old.offset)) {
        return; // being sent: its blocks go when the segment does
    }
    let Some(file) = log.files.read().unwrap_or_else(|p| p.into_inner()).get(&old.segment).cloned() else {
        return;
    };
    // Keep the record's head (header, frame table, key) readable, so that recovery of a reopened
    // log still finds the record boundary and steps over it (reporting a damaged payload) instead
    // of taking the zeros for the end of the segment. One small read finds where the head ends; a
    // head longer than that (a huge key or frame table) is rare, and its record is not punched.
    let probe = old.len.min(4 << 10);
    let start_read = align_down(old.offset, log.read_align);
    let end_read = align_up(old.offset + probe, log.read_align);
    let Ok(buf) =
        log.backend.read_new(&file, start_read, (end_read - start_read) as usize, log.buf_align(end_read - start_read))
    else {
        return;
    };
    let at = (old.offset - start_read) as usize;
    let Ok(h) = format::peek_record_header(&buf[at..]) else { return };
    if h.payload_offset() > probe {
        return;
    }
    let start = align_up(old.offset + h.payload_offset(), log.align);
    let end = align_down(old.offset + old.len, log.align);
    if end > start {
        punch_range(log, st, old.segment, &file, start, end - start);
    }
}

/// Garbage collection after a change was published (a write, a delete, a forget): housekeeping,
/// whose failure must not fail the change. It is logged, and the dead segment is deleted at a
/// later garbage collection.
pub(super) fn reclaim<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>) {
    if let Err(e) = collect_garbage(log, st) {
        if log.health.warn_once(WARN_GC) {
            log::warn!(
                "segment log {}: cannot delete a dead segment yet ({e}); retrying at the next garbage collection",
                log.dir.display()
            );
        }
    }
}

/// Delete every non-active segment with nothing live and no tombstone still needed. Deleting one
/// can make another's tombstones unneeded, so repeat until nothing changes.
pub(super) fn collect_garbage<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>) -> Result<u64> {
    let mut deleted = 0;
    // Segments that could not be deleted this time: the others still go (on a full disk, one that
    // waits for pending records to be written must not keep the rest from freeing the space).
    let mut failed: Vec<u32> = Vec::new();
    let mut first_error = None;
    loop {
        // A log made read-only by a failed write or fdatasync changes nothing on disk any more.
        // Above all, it deletes no segment: deleting one needs the records that replaced its
        // contents to be durable, and after a failed fdatasync nothing says they are (a retry can
        // report success for pages the kernel dropped after reporting the first failure). One
        // failed deletion here may be the fdatasync that poisoned the log.
        if let Err(e) = log.health.check_writable() {
            first_error.get_or_insert(e);
            break;
        }
        let active = st.active.as_ref().map(|a| a.id);
        // While a value streams into a segment of its own, a tombstone of its key written
        // meanwhile is all that deletes it at the next open, and its range does not reach the
        // stream's newer segment (see `Streams::streaming`): segments holding tombstones wait
        // (compaction moves the tombstones of streaming keys instead).
        let streaming = log.streams.in_progress();
        let victim = st
            .segs
            .iter()
            .filter(|(&id, m)| Some(id) != active && m.live_records() == 0 && !failed.contains(&id))
            .filter(|(_, m)| !(streaming && m.tombstones() > 0))
            .map(|(&id, _)| id)
            .find(|&id| !tombstones_needed(st, id));
        let Some(id) = victim else { break };
        match delete_segment(log, st, id) {
            Ok(()) => deleted += 1,
            Err(e) => {
                failed.push(id);
                first_error.get_or_insert(e);
            }
        }
    }
    match first_error {
        Some(e) => Err(e),
        None => Ok(deleted),
    }
}

pub(super) fn delete_segment<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>, id: u32) -> Result<()> {
    // Never after a failed write or fdatasync: the fdatasync below must not be a retry of one
    // that failed, and without it the segment may hold the only durable copy of its records.
    log.health.check_writable()?;
    // The records that made this segment dead may still be pending in memory (write-behind:
    // overwrites, or compaction's copies of its live records): write them before the old copies
    // disappear, so a process crash cannot lose both. With `durable`, also make them durable,
    // so a power cut cannot either. Only a segment some of whose records were superseded by
    // pending ones needs that write: deleting any other must not need a write, because on a full
    // file system deleting dead segments is how the pending records get room. A log whose data
    // dies with the process (`discard_existing`) has nothing to lose in a crash at all.
    let superseded = st.segs.get(&id).is_some_and(|m| m.superseded_by_pending());
    if superseded && !log.opts.discard_existing {
        flush_pending(log, st)?;
    }
    if log.opts.durable {
        if superseded {
            sync_active(log, st)?;
        } else if let Some(a) = st.active.as_ref().filter(|a| a.dirty) {
            // What superseded this segment's records is written (or they were deleted): make
            // it durable without writing what is pending, which a full disk may refuse. `dirty`
            // stays set, for the pending records.
            if let Err(e) = log.backend.sync_data(&a.file) {
                return Err(log.health.poison(Error::io("fdatasync", log.seg_path(a.id), e)));
            }
        }
    }
    if log.opts.durable && st.dir_new_segments {
        // The records that replaced this segment's may live in a segment created since the
        // directory's last fsync: its entry must be durable before this unlink can be, or a
        // power cut could keep the unlink and lose the new file. (File systems that journal
        // directory operations in order do not need this; nothing promises it.)
        sync_dir_if_dirty(log, st)?;
    }
    if keep_as_spare(log, st, id) {
        return Ok(());
    }
    let path = log.seg_path(id);
    match log.backend.remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        // Still a segment (in `files` and `segs`): a later garbage collection tries again.
        Err(e) => return Err(Error::io("remove segment", path, e)),
    }
    if let Some(file) = log.files.write().unwrap_or_else(|p| p.into_inner()).remove(&id) {
        // A deleted segment needs no sync. Its handle must go too: while a descriptor is open,
        // the unlinked file keeps its blocks, and a log that is never synced (a spill store)
        // would hold every dead segment's disk space until it closed.
        st.unsynced_sealed.retain(|f| !Arc::ptr_eq(f, &file));
    }
    st.segs.remove(id);
    st.dir_dirty = true;
    Ok(())
}

/// With `recycle_segments`, keep the file of dead segment `id` for a new segment instead of
/// unlinking it, if it has the usual size and nothing else holds it (a reader that looked it up
/// before it died, a value being sent from it): its bytes are overwritten when it is reused.
pub(super) fn keep_as_spare<B: Backend>(log: &SegmentLog<B>, st: &mut WriterState<B::File>, id: u32) -> bool {
    if !log.opts.recycle_segments
        || st.no_rename
        || st.spare_files.len() >= MAX_SPARE_FILES
        || st.segs.get(&id).is_none_or(|m| m.size() != log.opts.segment_bytes)
    {
        return false;
    }
    if log.sends.take_sent_from(id) {
        return false;
    }
    let punched = st.segs.get(&id).is_some_and(|m| m.punched() > 0 || !m.reserved());
    let mut files = log.files.write().unwrap_or_else(|p| p.into_inner());
    let Some(file) = files.get(&id) else { return false };
    let unsynced = st.unsynced_sealed.iter().filter(|f| Arc::ptr_eq(f, file)).count();
    if Arc::strong_count(file) != 1 + unsynced {
        return false;
    }
    let file = files.remove(&id).expect("looked up above");
    drop(files);
    st.unsynced_sealed.retain(|f| !Arc::ptr_eq(f, &file));
    st.segs.remove(id);
    st.spare_files.push(SpareFile::new(id, file, punched));
    true
}

/// At the open of a log with `discard_existing`: delete the segments `seg_dir` holds, unread (a
/// spill log's data died with its process, and its records may have been hole-punched, so
/// recovering them would only report damage). With `recycle_segments`, the files of the usual size
/// are kept instead, as spare files for the new segments: their blocks were written, so writing over
/// them costs what fio's overwrite of a laid-out file costs, where a new preallocated file costs an
/// unwritten-extent conversion per write (docs/benchmarks.md, "Sustained writes"). They hold the
/// disk space of the last run's segments until new segments take them or the log closes (or a
/// preallocation runs short of space). Only segment files: anything else in the directory is not
/// ours to delete (recovery ignores it the same way), and its name may not even be UTF-8, so the
/// name `list_dir` gives may not open.
pub(super) fn discard_segments<B: Backend>(
    backend: &B,
    seg_dir: &Path,
    opts: &LogOptions,
) -> Result<Vec<SpareFile<B::File>>> {
    let names = backend.list_dir(seg_dir).map_err(|e| Error::io("list segments", seg_dir.to_path_buf(), e))?;
    let mut kept = Vec::new();
    for name in names {
        let Some(id) = parse_seg_file_name(&name) else {
            log::warn!("ignoring unexpected file {:?} in {}", name, seg_dir.display());
            continue;
        };
        let path = seg_dir.join(name);
        // A kept file's id stays below every new segment's (`next_segment` starts above them), so
        // renaming one into a new segment's name never replaces another.
        if opts.recycle_segments && kept.len() < MAX_KEPT_AT_OPEN && id < u32::MAX {
            let file = backend.open(&path, false).ok();
            if let Some(file) = file.filter(|f| backend.file_len(f).is_ok_and(|n| n == opts.segment_bytes)) {
                // It may have holes (punched records): reserved again when it is reused.
                kept.push(SpareFile::new(id, Arc::new(file), true));
                continue;
            }
        }
        backend.remove_file(&path).map_err(|e| Error::io("remove segment", path, e))?;
    }
    Ok(kept)
}

/// The files of a log's segments by id, shared with its punch thread.
pub(super) type SegmentFiles<F> = Arc<RwLock<KeyMap<u32, Arc<F>>>>;

/// One punch for the punch thread: `len` bytes at `offset` of segment `segment`, if that segment
/// still has the file `file` when the punch runs.
struct PunchJob<F> {
    segment: u32,
    file: std::sync::Weak<F>,
    offset: u64,
    len: u64,
}

/// Hole punches of forgotten records, run on a thread of the log's own (started at the first punch),
/// so that a `forget` returns without waiting for the kernel to free a large record's blocks and
/// pages: 1.7-1.9 ms for 16 MiB here, longer than reading it (docs/benchmarks.md, "What bounds the
/// unspill").
///
/// A punch must never reach a file that holds other data by then. A segment's file is reused for a
/// new segment only once nothing but the log holds it (`keep_as_spare` counts its references under
/// the `files` write lock); the punch thread takes its reference under the read lock, from the map,
/// and only if the segment is still there with the same file. So a punch runs on the live segment
/// whose dead record it releases, or not at all (the segment died meanwhile, and its blocks went or
/// will be overwritten with it); a segment that dies while its punch runs is unlinked, not reused.
pub(super) struct Punches<F> {
    thread: std::sync::Mutex<PunchThread<F>>,
    pending: Arc<Pending>,
}

/// Clears the count of queued punches when the punch thread ends, also by a panic (a backend's punch
/// function may panic): what is still queued will never run, and `settle` must not wait for it.
/// Punches queued after that fail to send and run on the caller's thread.
struct Ended(Arc<Pending>);

impl Drop for Ended {
    fn drop(&mut self) {
        *self.0.count.lock().unwrap_or_else(|p| p.into_inner()) = 0;
        self.0.changed.notify_all();
    }
}

/// Punches queued and not yet run, with the condition `settle` waits on.
#[derive(Default)]
struct Pending {
    count: std::sync::Mutex<u64>,
    changed: std::sync::Condvar,
}

impl Pending {
    fn add(&self, n: i64) {
        let mut count = self.count.lock().unwrap_or_else(|p| p.into_inner());
        *count = count.saturating_add_signed(n);
        self.changed.notify_all();
    }
}

enum PunchThread<F> {
    NotStarted,
    Running(std::sync::mpsc::Sender<PunchJob<F>>, std::thread::JoinHandle<()>),
    /// It could not be started: punches run on the caller's thread.
    Unavailable,
}

impl<F: Send + Sync + 'static> Punches<F> {
    pub(super) fn new() -> Self {
        Punches { thread: std::sync::Mutex::new(PunchThread::NotStarted), pending: Arc::default() }
    }

    /// Queue a punch of `segment` (whose file is `file`); false if there is no punch thread (it
    /// could not be started), and the caller punches itself.
    pub(super) fn queue(
        &self,
        punch: DetachedPunch<F>,
        files: &SegmentFiles<F>,
        segment: u32,
        file: &Arc<F>,
        offset: u64,
        len: u64,
    ) -> bool {
        let mut thread = self.thread.lock().unwrap_or_else(|p| p.into_inner());
        if let PunchThread::NotStarted = *thread {
            *thread = self.start(punch, files.clone());
        }
        let PunchThread::Running(tx, _) = &*thread else { return false };
        self.pending.add(1);
        if tx.send(PunchJob { segment, file: Arc::downgrade(file), offset, len }).is_err() {
            // The thread is gone (a backend's punch function panicked on it): punch here from now on.
            self.pending.add(-1);
            *thread = PunchThread::Unavailable;
            return false;
        }
        true
    }

    fn start(&self, punch: DetachedPunch<F>, files: SegmentFiles<F>) -> PunchThread<F> {
        let (tx, rx) = std::sync::mpsc::channel::<PunchJob<F>>();
        let pending = self.pending.clone();
        let run = move || {
            let _ended = Ended(pending.clone());
            let warned = std::cell::Cell::new(false);
            for job in rx {
                let file = files
                    .read()
                    .unwrap_or_else(|p| p.into_inner())
                    .get(&job.segment)
                    .filter(|f| std::ptr::eq(Arc::as_ptr(f), job.file.as_ptr()))
                    .cloned();
                if let Some(file) = file {
                    if let Err(e) = punch(&file, job.offset, job.len) {
                        if !warned.replace(true) {
                            log::warn!("cannot punch holes in segment files ({e}); forgotten records keep their space until compaction");
                        }
                    }
                }
                pending.add(-1);
            }
        };
        match std::thread::Builder::new().name("spillway-punch".into()).spawn(run) {
            Ok(handle) => PunchThread::Running(tx, handle),
            Err(e) => {
                log::warn!("cannot start the hole-punch thread ({e}); punching on the caller's thread");
                PunchThread::Unavailable
            }
        }
    }

    /// Wait until every punch queued so far has run.
    pub(super) fn settle(&self) {
        let mut n = self.pending.count.lock().unwrap_or_else(|p| p.into_inner());
        while *n > 0 {
            n = self.pending.changed.wait(n).unwrap_or_else(|p| p.into_inner());
        }
    }

    /// Run what is queued and stop the thread (the log is closing).
    pub(super) fn stop(&self) {
        let old =
            std::mem::replace(&mut *self.thread.lock().unwrap_or_else(|p| p.into_inner()), PunchThread::Unavailable);
        if let PunchThread::Running(tx, handle) = old {
            drop(tx);
            let _ = handle.join();
        }
    }
}
