//! Eviction: planning a round under the lock (LRU victims, the [`EvictionPolicy`]), carrying it out
//! without the lock (serialize, compress, write a batch), and settling it under the lock again;
//! `max_spill`, failed spills and stuck entries.

use std::sync::Arc;
use std::time::Instant;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::slot::Slot;
use crate::sync::{self, MutexGuard};
use crate::value::Frames;

use super::entry::{compress, decompress, Compressed, EntrySlot, Source, Table, Tier};
use super::metrics::Activity;
use super::remove::{drop_entry, drop_stale_record};
use super::Inner;
use super::{key_str, log_due, panic_message, vanished, Codec, Revive, Store};

/// Entries looked at per eviction round.
pub(super) const EVICT_SCAN: usize = 256;

/// Eviction rounds (each with its spill write) one call to `enforce` runs at most.
pub(super) const ENFORCE_ROUNDS: usize = 16;

/// An object to demote to serialized form, planned under the store's lock and serialized without it
/// (the object stays readable in its slot meanwhile).
pub(super) struct Demotion<V> {
    key: Arc<[u8]>,
    value: sync::Arc<V>,
    /// Identifies the entry, as in [`Planned`].
    slot: Arc<Slot<V, Error>>,
    weight: u64,
    /// The entry's LRU tick when planned: a get meanwhile makes it recent, and it is not demoted.
    tick: u64,
    /// The crc of its verified copy on disk ([`EvictionPolicy::verify_copies`]): frames with it are
    /// not written again.
    copy_crc: Option<u32>,
}

/// An object an eviction round let go of (its entry, identified by its slot, keeps a disk copy).
pub(super) struct Released<V> {
    key: Arc<[u8]>,
    slot: EntrySlot<V>,
    value: sync::Arc<V>,
}

/// What one eviction round leaves to do without the store's lock.
pub(super) struct Plan<V> {
    writes: Vec<Planned<V>>,
    demotions: Vec<Demotion<V>>,
    /// Objects the round let go of (they had a disk copy), to take weak handles on
    /// ([`Codec::keep_weak`]) once the lock is released.
    released: Vec<Released<V>>,
}

impl<V> Plan<V> {
    pub(super) fn new(writes: Vec<Planned<V>>) -> Self {
        Plan { writes, demotions: Vec::new(), released: Vec::new() }
    }

    pub(super) fn is_empty(&self) -> bool {
        self.writes.is_empty() && self.demotions.is_empty() && self.released.is_empty()
    }
}

/// A key a persistent store's `flush` is to write: the key, the slot that identifies its entry (a
/// `remove` or a new `put` replaces it), and whether that is still the entry the flush listed when
/// it began (what it promises to make durable).
pub(super) type Listed<V> = (Arc<[u8]>, Arc<Slot<V, Error>>, bool);

/// What is left to do once each key of a written batch is settled (see `end_settle`).
pub(super) struct Settled<'r> {
    /// The write's result.
    result: &'r Result<()>,
    /// The batch's first key, to report a failure that followed a write that landed.
    first: Option<&'r Arc<[u8]>>,
    /// Some record landed.
    landed: bool,
    /// Space reserved against max_spill was given back.
    freed: bool,
    /// Keys to mark stuck.
    stuck: Vec<Arc<[u8]>>,
    /// Keys whose new record nobody wants (removed or replaced meanwhile).
    stale: Vec<Arc<[u8]>>,
    /// The write's panic, to go on with.
    panicked: Option<Box<dyn std::any::Any + Send>>,
}

impl<'r> Settled<'r> {
    /// The write's result.
    pub(super) fn result(&self) -> &'r Result<()> {
        self.result
    }

    /// Nothing settled yet after the write that ended with `result` (and `panicked`, if it did).
    pub(super) fn new(
        result: &'r Result<()>,
        first: Option<&'r Arc<[u8]>>,
        panicked: Option<Box<dyn std::any::Any + Send>>,
    ) -> Self {
        Settled { result, first, landed: false, freed: false, stuck: Vec::new(), stale: Vec::new(), panicked }
    }
}

/// One value of a spill batch, planned under the store's lock and written without it.
pub(super) struct Planned<V> {
    pub(super) key: Arc<[u8]>,
    /// The value's frames, or its compressed block (decompressed without the lock, for the write).
    pub(super) data: Source,
    /// Serialized length (what the write puts on disk before any on-disk compression).
    pub(super) raw: u64,
    /// Identifies the entry that was planned: a `remove` or a new `put` meanwhile replaces it.
    pub(super) slot: Arc<Slot<V, Error>>,
    pub(super) weight: u64,
    /// The weight of the object these frames were serialized from (a `put` heavier than the
    /// target), which the entry keeps once on disk.
    pub(super) object_weight: Option<u64>,
    /// The key's record that this write supersedes, left in the log until then (a persistent
    /// store's `put_large`), where it is (its log's number and its location): found there after
    /// the write, it is not this write's.
    pub(super) replaces: Option<(usize, crate::log::Location)>,
}

/// Failures kept for [`Store::take_failures`] at most; more are counted in the metrics only.
pub const MAX_REPORTED_FAILURES: usize = 256;

/// What kind of spill did not happen.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SpillFailureKind {
    /// max_spill had no room for it.
    MaxSpill,
    /// The codec could not serialize it.
    Serialize,
    /// Writing it failed.
    Disk,
}

/// A spill that did not happen: the value stayed in memory ([`Store::take_failures`]).
#[derive(Debug, Clone)]
pub struct SpillFailure {
    /// The key.
    pub key: Vec<u8>,
    /// What went wrong.
    pub kind: SpillFailureKind,
    /// The error (the codec's, for a serialize failure); none for max_spill.
    pub error: Option<Error>,
}

/// What became of an object planned for demotion, once serialized without the lock.
pub(super) enum Demoted {
    /// It failed to serialize.
    Failed(Error),
    /// Its frames (and lz4 block, with `compress_in_memory`), to hold in memory.
    InMemory(Frames, Option<Compressed>),
    /// Its frames, written in this round's batch ([`EvictionPolicy::direct_to_disk`]).
    ToDisk(Frames),
    /// Its frames are those of its copy on disk: dropped from memory without a write.
    Same(u64),
    /// Not written: the log refuses the value (the error), or max_spill has no room for it (`None`).
    Refused(Option<Error>),
    /// Not taken: a value before it in the round could not go (`failed_spill_ends_round`).
    Abandoned,
}

/// The entries an eviction round looks at: the single key it is given, or the LRU order walked
/// lazily from the oldest tick (a round usually needs one or two entries, and collecting
/// `EVICT_SCAN` candidates up front cost a lookup and an `Arc` clone each, on every put or
/// promotion above the target). Entries re-attached during the round keep their tick, which the
/// cursor has passed, so none is visited twice.
struct Candidates {
    only: bool,
    single: Option<Arc<[u8]>>,
    cursor: u64,
}

impl Candidates {
    fn next<V>(&mut self, table: &Table<V>) -> Option<Arc<[u8]>> {
        if self.only {
            return self.single.take();
        }
        let (tick, key) = table.lru_from(self.cursor)?;
        self.cursor = tick + 1;
        Some(key.clone())
    }
}

/// A spill of `key` was refused or failed: its entry stays in memory, out of the LRU order,
/// until the table unsticks it. Under [`EvictionPolicy::failed_spill_ends_round`] it keeps its place
/// in the LRU order instead, and the eviction that met the failure stops.
pub(super) fn set_stuck<C: Codec, B: Backend>(store: &Store<C, B>, inner: &mut Inner<C::Value>, key: &Arc<[u8]>) {
    if store.cfg.eviction.failed_spill_ends_round {
        inner.round_failed = true;
        return;
    }
    inner.table.set_stuck(key);
}

/// Do a round's plan with the store's lock released: serialize (and compress) the objects to
/// demote, write the planned batch. Then settle each entry under the lock again.
///
/// Meanwhile gets read the values from memory (objects from their slots, frames from their
/// entries), and eviction skips the keys. A written entry removed or replaced meanwhile leaves a
/// record nobody wants, which is dropped from the log; one promoted by a get meanwhile stays in
/// memory and keeps the record as its disk copy; one whose record did not land stays in memory,
/// stuck, and the failure is reported. An object is demoted only if its entry is unchanged and
/// was not read meanwhile; one that fails to serialize stays in memory, stuck and reported, unless
/// it is `protect` (the value being put), whose key is then forgotten and the error returned.
pub(super) fn spill<'a, C: Codec, B: Backend>(
    store: &'a Store<C, B>,
    inner: MutexGuard<'a, Inner<C::Value>>,
    plan: Plan<C::Value>,
    protect: Option<&Arc<Slot<C::Value, Error>>>,
) -> (MutexGuard<'a, Inner<C::Value>>, Option<Error>) {
    drop(inner);
    let Plan { writes: batch, demotions, released } = plan;
    // Weak handles on the objects leaving memory, taken here because a codec may need a lock of
    // its own for them (the GIL).
    let released: Vec<_> =
        released.into_iter().filter_map(|r| keep_weak(store, &r.value).map(|revive| (r.key, r.slot, revive))).collect();
    let weak: Vec<Option<Revive<C::Value>>> = demotions.iter().map(|d| keep_weak(store, &d.value)).collect();
    let demoted = demote(store, &demotions);
    let data = batch_frames(store, &batch);
    let items: Vec<(&[u8], &Frames)> = batch
        .iter()
        .zip(&data)
        .filter_map(|(p, d)| d.as_ref().ok().map(|f| (&*p.key, f)))
        .chain(demotions.iter().zip(&demoted).filter_map(|(d, r)| match r {
            Demoted::ToDisk(f) => Some((&*d.key, f)),
            _ => None,
        }))
        .collect();
    // Where each object going to disk had a record before (a copy that no longer matches it): a
    // place after the write that differs is its new record (a place names its log: a fresh
    // log's first record has the location an old log's first one had).
    let before: Vec<Option<(usize, crate::log::Location)>> = demotions
        .iter()
        .zip(&demoted)
        .map(|(d, r)| match r {
            Demoted::ToDisk(_) => store.logs.place(&d.key),
            _ => None,
        })
        .collect();
    let (result, panicked) = write_batch(store, &items);
    drop(items);
    let mut inner = store.lock();
    for (k, slot, revive) in released {
        if inner.table.get(&k).is_some_and(|e| Arc::ptr_eq(&e.slot, &slot) && e.tier == Tier::Disk) {
            inner.table.keep_weak(k, slot, revive);
        }
    }
    let mut settled = Settled::new(&result, batch.first().map(|p| &p.key), panicked);
    let mut protect_failed = None;
    for (((d, r), weak), before) in demotions.into_iter().zip(demoted).zip(weak).zip(before) {
        match r {
            Demoted::Failed(err) if protect.is_some_and(|p| Arc::ptr_eq(p, &d.slot)) => {
                end_demotion(&mut inner, &d);
                if inner.table.get(&d.key).is_some_and(|e| Arc::ptr_eq(&e.slot, &d.slot)) {
                    // In memory (no disk copy), so dropping it touches no log record.
                    let _ = drop_entry(store, &mut inner, &d.key);
                }
                protect_failed = Some(err);
            }
            Demoted::ToDisk(frames) => settle_direct(store, &mut inner, d, frames, weak, before, &mut settled),
            r => settle_demotion(store, &mut inner, d, r, weak, &mut settled),
        }
    }
    for (p, d) in batch.iter().zip(&data) {
        settle_write(store, &mut inner, p, d, &mut settled);
    }
    (end_settle(store, inner, settled), protect_failed)
}

/// Serialize (and compress, or validate for the log) the objects a round demotes, without the
/// store's lock; those going straight to disk are then reserved against max_spill. Under
/// `failed_spill_ends_round`, the values after one that cannot go are not taken: the eviction
/// ends there, as one that evicts a value at a time would.
fn demote<C: Codec, B: Backend>(store: &Store<C, B>, demotions: &[Demotion<C::Value>]) -> Vec<Demoted> {
    let direct = store.cfg.eviction.direct_to_disk;
    let ends = store.cfg.eviction.failed_spill_ends_round;
    let mut ended = false;
    let mut demoted: Vec<Demoted> = demotions
        .iter()
        .map(|d| {
            if ended {
                return Demoted::Abandoned;
            }
            match serialize(store, &d.key, &d.value) {
                Err(e) => {
                    ended = ends;
                    Demoted::Failed(e)
                }
                Ok(frames)
                    if d.copy_crc.is_some_and(|c| c == crate::format::laid_out_crc(frames.iter().map(|b| &b[..]))) =>
                {
                    Demoted::Same(frames.total_len())
                }
                Ok(frames) if direct => match store.logs.current().validate(&d.key, &frames) {
                    Ok(()) => Demoted::ToDisk(frames),
                    Err(e) => {
                        ended = ends;
                        Demoted::Refused(Some(e))
                    }
                },
                Ok(frames) => {
                    let compressed = store.cfg.compress_in_memory.then(|| {
                        let t = Instant::now();
                        let c = compress(&frames);
                        store.metrics.record(Activity::Compress, frames.total_len(), t);
                        c
                    });
                    Demoted::InMemory(frames, compressed)
                }
            }
        })
        .collect();
    if demoted.iter().any(|d| matches!(d, Demoted::ToDisk(_))) {
        // Objects going straight to disk are reserved against max_spill now that their size is
        // known (the round planned them without it).
        let mut inner = store.lock();
        let mut refused = false;
        for (dm, d) in demotions.iter().zip(&mut demoted) {
            if let Demoted::ToDisk(f) = d {
                let raw = f.total_len();
                if refused {
                    *d = Demoted::Abandoned;
                } else if spill_allowed(store, &mut inner, &dm.key, raw) {
                    inner.writes.reserve(raw);
                } else {
                    *d = Demoted::Refused(None);
                    refused = ends;
                }
            }
        }
    }
    demoted
}

/// The frames to write for a round's planned batch, without the store's lock: a compressed
/// value is written decompressed (the log compresses on its own if configured). A value the log
/// cannot store (too large, too many frames) fails alone, before the write: in the batch it
/// would fail every other value with it.
fn batch_frames<C: Codec, B: Backend>(store: &Store<C, B>, batch: &[Planned<C::Value>]) -> Vec<Result<Frames>> {
    batch
        .iter()
        .map(|p| {
            let f = match &p.data {
                Source::Frames(f) => f.clone(),
                Source::Compressed(c) => {
                    let t = Instant::now();
                    let f = decompress(c)?;
                    store.metrics.record(Activity::Decompress, f.total_len(), t);
                    f
                }
                Source::Disk => unreachable!("only in-memory values are planned for writing"),
            };
            store.logs.current().validate(&p.key, &f).map(|()| f)
        })
        .collect()
}

/// A demotion is over (whatever became of it): its key is no longer being written.
fn end_demotion<V>(inner: &mut Inner<V>, d: &Demotion<V>) {
    inner.writes.end(&d.key, d.weight, 0);
}

/// Under the lock again: an object demoted in memory, or not demoted. It leaves memory only if
/// its entry is unchanged and was not read meanwhile; one that failed to serialize, or that the
/// log or max_spill refused, is stuck and reported.
fn settle_demotion<C: Codec, B: Backend>(
    store: &Store<C, B>,
    inner: &mut Inner<C::Value>,
    d: Demotion<C::Value>,
    r: Demoted,
    weak: Option<Revive<C::Value>>,
    settled: &mut Settled<'_>,
) {
    end_demotion(inner, &d);
    let same = inner.table.get(&d.key).is_some_and(|e| Arc::ptr_eq(&e.slot, &d.slot));
    let unchanged = same && inner.table.get(&d.key).is_some_and(|e| e.tier == Tier::Materialized && e.tick == d.tick);
    match r {
        Demoted::Failed(err) => {
            if same {
                store.metrics.spill_failed();
                let first = inner.table.first_serialize_failure(&d.key);
                if !report(store, inner, &d.key, SpillFailureKind::Serialize, Some(&err)) && first {
                    log::error!("Failed to serialize {:?}; keeping it in memory: {err}", key_str(&d.key));
                }
                settled.stuck.push(d.key.clone());
            }
        }
        Demoted::Refused(err) => {
            if same {
                if let Some(err) = err {
                    spill_failed(store, inner, &d.key, &err);
                }
                settled.stuck.push(d.key.clone());
            }
        }
        Demoted::InMemory(frames, compressed) => {
            // `evict` fails if a reader is inside the slot's fast path this instant: skip.
            if !unchanged || d.slot.evict().is_none() {
                return;
            }
            if let Some(revive) = weak {
                inner.table.keep_weak(d.key.clone(), d.slot.clone(), revive);
            }
            inner.table.hold_serialized(&d.key, frames, compressed);
        }
        Demoted::Abandoned => {}
        Demoted::Same(raw) => {
            if unchanged && d.slot.evict().is_some() {
                store.metrics.add(Activity::DiskWriteSaved, 1, raw, 0);
                if let Some(revive) = weak {
                    inner.table.keep_weak(d.key.clone(), d.slot.clone(), revive);
                }
                inner.table.forget_copy_crc(&d.key);
                inner.table.leave_for_disk_copy(&d.key);
            }
        }
        Demoted::ToDisk(_) => unreachable!("settled by settle_direct"),
    }
}

/// Under the lock again: an object written straight to disk (`before`: where its key's record
/// was). A record that landed is the value's disk copy, and the object leaves memory unless it
/// was read meanwhile; one that did not land leaves it stuck and reported; one whose entry was
/// removed or replaced meanwhile is stale.
fn settle_direct<C: Codec, B: Backend>(
    store: &Store<C, B>,
    inner: &mut Inner<C::Value>,
    d: Demotion<C::Value>,
    frames: Frames,
    weak: Option<Revive<C::Value>>,
    before: Option<(usize, crate::log::Location)>,
    settled: &mut Settled<'_>,
) {
    end_demotion(inner, &d);
    let raw = frames.total_len();
    inner.writes.release(raw);
    let written = store.logs.place(&d.key).filter(|at| Some(*at) != before).map(|(_, loc)| loc);
    let loc = match landing(inner, &d.key, &d.slot, written, settled.result.is_ok(), settled) {
        Landing::Landed(loc) => loc,
        Landing::Failed => {
            if before.is_some() {
                // The new frames did not land; the record there is an old copy, no longer known to
                // match (the next eviction writes again).
                inner.table.forget_copy_crc(&d.key);
            }
            let err = settled.result.clone().err().unwrap_or_else(|| vanished(&d.key));
            return spill_failed(store, inner, &d.key, &err);
        }
        Landing::Elsewhere => return,
    };
    // A copy the object was read from is superseded: no crc is known for the new record if the
    // object stays (it is written again next time).
    inner.table.forget_copy_crc(&d.key);
    // The record is the value's disk copy; the object leaves memory unless it was read meanwhile
    // (then it stays, and a later eviction costs no write).
    let unchanged = inner.table.get(&d.key).is_some_and(|e| e.tier == Tier::Materialized && e.tick == d.tick);
    let drop_object = unchanged && d.slot.evict().is_some();
    if let Some(revive) = weak.filter(|_| drop_object) {
        inner.table.keep_weak(d.key.clone(), d.slot.clone(), revive);
    }
    inner.table.object_written(&d.key, raw, loc.len, drop_object);
}

/// Under the lock again: a value of the round's planned batch (`data`: its frames, or why the
/// log refused them). A record that landed for the entry planned is its disk copy; none leaves
/// the entry stuck and reported; one for an entry removed or replaced meanwhile is stale.
fn settle_write<C: Codec, B: Backend>(
    store: &Store<C, B>,
    inner: &mut Inner<C::Value>,
    p: &Planned<C::Value>,
    data: &Result<Frames>,
    settled: &mut Settled<'_>,
) {
    inner.writes.end(&p.key, p.weight, p.raw);
    let written = store.logs.place(&p.key).filter(|at| Some(*at) != p.replaces).map(|(_, loc)| loc);
    match landing(inner, &p.key, &p.slot, written, settled.result.is_ok(), settled) {
        Landing::Landed(loc) => inner.table.landed(&p.key, (p.raw, loc.len), false, p.object_weight),
        Landing::Failed => {
            let err = match data {
                Err(e) => e.clone(),
                Ok(_) => settled.result.clone().err().unwrap_or_else(|| vanished(&p.key)),
            };
            spill_failed(store, inner, &p.key, &err);
        }
        Landing::Elsewhere => {}
    }
}

/// How a write of an entry ended (see [`landing`]).
pub(super) enum Landing {
    /// The entry is still the one written, and its record landed here: the caller notes it as
    /// the entry's disk copy.
    Landed(crate::log::Location),
    /// The entry is still the one written, and no record landed: it is stuck, and the caller
    /// counts and reports why.
    Failed,
    /// The entry was removed or replaced meanwhile: a record written for it is stale (the round
    /// drops it), and either way the write freed what it held.
    Elsewhere,
}

/// Under the lock again, after a write of `key`'s entry (`slot` its slot when planned; `written`
/// the record of the key the write left, if any; `wrote` whether the write went through): how it
/// ended, with the round's bookkeeping done (`settled`: landed, stuck, stale, freed). The one
/// rule for every write of an entry: a spill, an object written straight to disk, a flush's copy.
pub(super) fn landing<V>(
    inner: &Inner<V>,
    key: &Arc<[u8]>,
    slot: &EntrySlot<V>,
    written: Option<crate::log::Location>,
    wrote: bool,
    settled: &mut Settled<'_>,
) -> Landing {
    let ours = inner.table.get(key).is_some_and(|e| Arc::ptr_eq(&e.slot, slot));
    match (ours, written) {
        (true, Some(loc)) => {
            settled.landed = true;
            Landing::Landed(loc)
        }
        (true, None) => {
            settled.stuck.push(key.clone());
            Landing::Failed
        }
        (false, Some(_)) => {
            settled.stale.push(key.clone());
            settled.freed = true;
            Landing::Elsewhere
        }
        (false, None) => {
            settled.freed |= wrote;
            Landing::Elsewhere
        }
    }
}

/// Write a batch (spill or flush) with the store's lock released. A panic in the write (a bug in
/// a backend) must not leave the batch's keys marked as being written: their puts and `flush`
/// would wait for them forever. So it becomes an I/O error for the batch, which then settles as
/// a failed write, and the panic is handed back to go on after that (`end_settle`).
pub(super) fn write_batch<C: Codec, B: Backend>(
    store: &Store<C, B>,
    items: &[(&[u8], &Frames)],
) -> (Result<()>, Option<Box<dyn std::any::Any + Send>>) {
    if items.is_empty() {
        return (Ok(()), None);
    }
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| write_disk(store, items))) {
        Ok(r) => (r, None),
        Err(p) => {
            let msg = format!("the write panicked: {}", panic_message(&*p));
            (Err(Error::io("spill write", None, std::io::Error::other(msg))), Some(p))
        }
    }
}

/// The end of settling a written batch, once each key is settled (`spill`, `persist_round`).
pub(super) fn end_settle<'a, C: Codec, B: Backend>(
    store: &'a Store<C, B>,
    mut inner: MutexGuard<'a, Inner<C::Value>>,
    s: Settled<'_>,
) -> MutexGuard<'a, Inner<C::Value>> {
    if let (Err(e), true, Some(key)) = (s.result, s.landed, s.first) {
        // The records were written (and stay readable), but what followed failed: the sync of
        // `sync_spills`. Reported like any failed spill.
        spill_failed(store, &mut inner, key, e);
    }
    if s.freed {
        // Space reserved against max_spill for a record nobody wants any more is free again.
        inner.table.unstick();
    }
    for k in s.stuck {
        set_stuck(store, &mut inner, &k);
    }
    store.written.notify_all();
    // Last, with every key of the batch settled and its waiters woken: dropping a record writes
    // a tombstone in a persistent store, a backend write that may fail (or panic) on its own.
    // Still under the lock, so that no new record of the key can be written before the drop.
    for k in s.stale {
        drop_stale_record(store, &k);
    }
    if let Some(p) = s.panicked {
        drop(inner);
        std::panic::resume_unwind(p);
    }
    inner
}

/// Whether `bytes` more of `key` fit under max_spill; a refusal is reported.
pub(super) fn spill_allowed<C: Codec, B: Backend>(
    store: &Store<C, B>,
    inner: &mut Inner<C::Value>,
    key: &[u8],
    bytes: u64,
) -> bool {
    match store.cfg.max_spill_bytes {
        Some(max) if inner.table.totals().disk_raw() + inner.writes.raw() + bytes > max => {
            store.metrics.max_spill_refused();
            if !report(store, inner, key, SpillFailureKind::MaxSpill, None) && log_due(&mut inner.logged_full) {
                log::warn!("Spill file on disk reached capacity; keeping data in memory");
            }
            false
        }
        _ => true,
    }
}

pub(super) fn spill_failed<C: Codec, B: Backend>(
    store: &Store<C, B>,
    inner: &mut Inner<C::Value>,
    key: &[u8],
    err: &Error,
) {
    store.metrics.spill_failed();
    if !report(store, inner, key, SpillFailureKind::Disk, Some(err)) && log_due(&mut inner.logged_disk) {
        log::error!("Spill to disk failed; keeping data in memory ({:?}: {err})", key_str(key));
    }
}

/// With `report_failures`, keep a failure for [`Store::take_failures`] (at most
/// [`MAX_REPORTED_FAILURES`] pending; more are counted in the metrics only) and return true:
/// the caller logs nothing.
pub(super) fn report<C: Codec, B: Backend>(
    store: &Store<C, B>,
    inner: &mut Inner<C::Value>,
    key: &[u8],
    kind: SpillFailureKind,
    error: Option<&Error>,
) -> bool {
    if !store.cfg.report_failures {
        return false;
    }
    if inner.failures.len() < MAX_REPORTED_FAILURES {
        inner.failures.push(SpillFailure { key: key.to_vec(), kind, error: error.cloned() });
        store.failures_pending.store(true, std::sync::atomic::Ordering::Release);
    }
    true
}

pub(super) fn take_failures<C: Codec, B: Backend>(store: &Store<C, B>) -> Vec<SpillFailure> {
    if !store.failures_pending.swap(false, std::sync::atomic::Ordering::Acquire) {
        return Vec::new();
    }
    std::mem::take(&mut store.lock().failures)
}

/// The codec's weak handle on `v`; none if the codec panics (as in `serialize`, unwinding here
/// would leave the round's keys marked as being written).
pub(super) fn keep_weak<C: Codec, B: Backend>(
    store: &Store<C, B>,
    v: &sync::Arc<C::Value>,
) -> Option<Revive<C::Value>> {
    if !C::KEEPS_WEAK {
        return None;
    }
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.codec.keep_weak(v))).unwrap_or(None)
}

pub(super) fn serialize<C: Codec, B: Backend>(store: &Store<C, B>, key: &[u8], v: &C::Value) -> Result<Frames> {
    let t = Instant::now();
    // A panicking codec is a failed serialize: `spill` runs it with keys marked as being written,
    // and unwinding out of it would leave them marked (their puts waiting forever).
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| store.codec.serialize(v)))
        .unwrap_or_else(|panic| Err(format!("the codec panicked: {}", panic_message(&*panic)).into()));
    let f = r.map_err(|e| Error::Codec { op: "serialize", key: key_str(key), source: Arc::from(e) })?;
    store.metrics.record(Activity::Serialize, f.total_len(), t);
    Ok(f)
}

pub(super) fn write_disk<C: Codec, B: Backend>(store: &Store<C, B>, items: &[(&[u8], &Frames)]) -> Result<()> {
    let t = Instant::now();
    let bytes: u64 = items.iter().map(|(_, f)| f.total_len()).sum();
    let log = store.logs.put_many(items)?;
    // Written (and readable) even if the sync below fails: counted either way. The sync is of
    // the log the batch went to (another thread's failed write may have replaced it since).
    let synced = if store.cfg.sync_spills { log.sync() } else { Ok(()) };
    store.metrics.add(Activity::DiskWrite, items.len() as u64, bytes, t.elapsed().as_nanos() as u64);
    synced
}

/// Demote least-recently-used entries until memory, not counting what is being written to disk
/// right now, is at or below the target. Spill writes run with the lock released (see
/// `spill`); the caller's guard is consumed. `protect` is the slot of the value being
/// inserted: if *its* serialization fails, it is forgotten and the error returned.
///
/// Memory can exceed the target by the writes in flight: at most one batch per thread inside
/// `enforce`, each about the [`EvictionPolicy::slack`] over the excess it was planned for.
pub(super) fn enforce<'a, C: Codec, B: Backend>(
    store: &'a Store<C, B>,
    inner: MutexGuard<'a, Inner<C::Value>>,
    protect: Option<&Arc<Slot<C::Value, Error>>>,
) -> Result<()> {
    // The value being put is not this eviction's to take, under `keep_own_key`.
    let spare = if store.cfg.eviction.keep_own_key { protect } else { None };
    enforce_sparing(store, inner, protect, spare)
}

/// `enforce`, passing over the entry of `spare` (a value that could not be written,
/// whose spill the others make up for).
pub(super) fn enforce_sparing<'a, C: Codec, B: Backend>(
    store: &'a Store<C, B>,
    mut inner: MutexGuard<'a, Inner<C::Value>>,
    protect: Option<&Arc<Slot<C::Value, Error>>>,
    spare: Option<&Arc<Slot<C::Value, Error>>>,
) -> Result<()> {
    inner.round_failed = false;
    // Bounded: with the lock released during writes, other threads keep adding; each of them
    // enforces the target for its own puts.
    for _ in 0..ENFORCE_ROUNDS {
        let pending = inner.table.totals().mem_bytes().saturating_sub(inner.writes.weight());
        let excess = store.cfg.eviction.excess(pending, store.target());
        if excess == 0 {
            break;
        }
        let (freed, plan) = evict_round(store, &mut inner, excess, None, spare)?;
        if plan.is_empty() && inner.round_failed {
            break;
        }
        if plan.is_empty() {
            if freed == 0 {
                break; // nothing evictable: everything left is stuck, in use or being written
            }
            continue;
        }
        let (guard, protect_failed) = spill(store, inner, plan, protect);
        inner = guard;
        if let Some(err) = protect_failed {
            return Err(err);
        }
        if inner.round_failed {
            break; // a failed spill ends the eviction (`failed_spill_ends_round`)
        }
    }
    Ok(())
}

/// One eviction round over the LRU order (or over the single key `only`): drops values that
/// still have their disk copy, and plans the demotion of objects and the spill writes of
/// serialized values, without doing them (`spill` does). The entry of the slot `spare` is
/// passed over. Returns the weight freed or planned, and the plan (its keys already marked as
/// being written).
pub(super) fn evict_round<C: Codec, B: Backend>(
    store: &Store<C, B>,
    inner: &mut Inner<C::Value>,
    excess: u64,
    only: Option<&Arc<[u8]>>,
    spare: Option<&Arc<Slot<C::Value, Error>>>,
) -> Result<(u64, Plan<C::Value>)> {
    let mut demotions = Vec::new();
    let mut released = Vec::new();
    let mut freed = 0u64;
    let mut batch: Vec<(Arc<[u8]>, Source, u64, u64)> = Vec::new();
    let mut walk = Candidates { only: only.is_some(), single: only.cloned(), cursor: 0 };
    let mut scanned = 0usize;
    while freed < excess && scanned < EVICT_SCAN {
        let Some(key) = walk.next(&inner.table) else { break };
        let Some(e) = inner.table.get(&key) else { continue };
        // (A value being deserialized is about to be used: a get has it in hand.)
        if e.stuck
            || e.tier == Tier::Disk
            || inner.writes.contains(&key)
            || spare.is_some_and(|s| Arc::ptr_eq(s, &e.slot))
            || e.slot.state() == crate::slot::SlotState::Materializing
        {
            continue;
        }
        scanned += 1;
        // A value whose copy must be verified is serialized again, and written only if it changed.
        let copy_crc = if store.cfg.eviction.verify_copies && e.tier == Tier::Materialized && e.disk_bytes > 0 {
            inner.table.copy_crc(&key)
        } else {
            None
        };
        // A value that still has its disk copy (it was read back) is dropped from memory for free.
        let must_verify = store.cfg.eviction.verify_copies && e.tier == Tier::Materialized;
        if e.disk_bytes > 0 && !must_verify {
            if e.tier == Tier::Materialized {
                let Some(value) = e.slot.evict() else { continue };
                if C::KEEPS_WEAK {
                    released.push(Released { key: key.clone(), slot: e.slot.clone(), value });
                }
            }
            freed += inner.table.leave_for_disk_copy(&key);
            continue;
        }
        // Step 1: object -> serialized (-> compressed), planned here and done without the lock.
        if e.tier == Tier::Materialized {
            let Some(value) = e.slot.try_get() else { continue };
            let d =
                Demotion { key: key.clone(), value, slot: e.slot.clone(), weight: e.weight, tick: e.tick, copy_crc };
            freed += d.weight;
            inner.writes.begin(key.clone(), d.weight, 0);
            demotions.push(d);
            continue;
        }
        // Step 2: serialized / compressed -> disk (batched below).
        let (data, raw) = match (&e.frames, &e.compressed) {
            (Some(f), _) => (Source::Frames(f.clone()), f.total_len()),
            (None, Some(c)) => (Source::Compressed(c.clone()), c.raw_len()),
            (None, None) => continue,
        };
        freed += e.weight;
        batch.push((key.clone(), data, raw, e.weight));
    }
    let (writes, refused) = admit_writes(store, inner, batch);
    Ok((freed.saturating_sub(refused), Plan { writes, demotions, released }))
}

/// The spill writes of a round's `batch` (key, source, serialized bytes, weight) that
/// max_spill admits, each marked as being written; the others stay in memory, stuck. Returns
/// the writes and the weight refused.
fn admit_writes<C: Codec, B: Backend>(
    store: &Store<C, B>,
    inner: &mut Inner<C::Value>,
    batch: Vec<(Arc<[u8]>, Source, u64, u64)>,
) -> (Vec<Planned<C::Value>>, u64) {
    let mut planned = Vec::with_capacity(batch.len());
    let (mut bytes, mut refused_weight) = (0u64, 0u64);
    let mut refused = false;
    for (k, data, raw, weight) in batch {
        if !refused && spill_allowed(store, inner, &k, bytes + raw) {
            bytes += raw;
            let slot = inner.table.get(&k).expect("present").slot.clone();
            planned.push(Planned { key: k, data, raw, slot, weight, object_weight: None, replaces: None });
        } else {
            refused_weight += weight;
            if !refused {
                set_stuck(store, inner, &k);
            }
            // Under `failed_spill_ends_round`, the first refusal ends the round: the values
            // after it stay where they are, untouched.
            refused |= store.cfg.eviction.failed_spill_ends_round;
        }
    }
    for p in &planned {
        inner.writes.begin(p.key.clone(), p.weight, p.raw);
    }
    (planned, refused_weight)
}

pub(super) fn evict_bytes<C: Codec, B: Backend>(store: &Store<C, B>, bytes: u64, spare: Option<&[u8]>) -> Result<u64> {
    let mut inner = store.lock();
    let spare = spare.and_then(|k| inner.table.get(k)).map(|e| e.slot.clone());
    let mut freed = 0u64;
    for _ in 0..ENFORCE_ROUNDS {
        if freed >= bytes {
            break;
        }
        let before = inner.table.totals().mem_bytes();
        let (planned, plan) = evict_round(store, &mut inner, bytes - freed, None, spare.as_ref())?;
        if plan.is_empty() {
            if planned == 0 {
                break;
            }
            freed += planned;
            continue;
        }
        inner = spill(store, inner, plan, None).0;
        // What actually left memory in this round (puts of other threads meanwhile aside).
        freed += before.saturating_sub(inner.table.totals().mem_bytes()).min(planned);
        if inner.table.totals().mem_bytes() >= before {
            break; // nothing left: every write failed
        }
    }
    Ok(freed)
}

pub(super) fn evict<C: Codec, B: Backend>(store: &Store<C, B>) -> Result<u64> {
    Ok(store.evict_one()?.unwrap_or(0))
}

pub(super) fn evict_one<C: Codec, B: Backend>(store: &Store<C, B>) -> Result<Option<u64>> {
    let mut inner = store.lock();
    let Some(key) = inner
        .table
        .lru_keys()
        .find(|k| !inner.writes.contains(k) && inner.table.get(k).is_some_and(|e| !e.stuck))
        .cloned()
    else {
        return Ok(None);
    };
    let (weight, slot) = {
        let e = inner.table.get(&key).expect("present");
        (e.weight, e.slot.clone())
    };
    // Demote this one entry all the way: object -> serialized -> disk.
    for _ in 0..2 {
        let live =
            inner.table.get(&key).is_some_and(|e| Arc::ptr_eq(&e.slot, &slot) && e.tier != Tier::Disk && !e.stuck);
        if !live || inner.writes.contains(&key) {
            break;
        }
        let (_, plan) = evict_round(store, &mut inner, weight.max(1), Some(&key), None)?;
        if !plan.is_empty() {
            inner = spill(store, inner, plan, None).0;
        }
    }
    let entry = inner.table.get(&key).filter(|e| Arc::ptr_eq(&e.slot, &slot));
    if entry.is_some_and(|e| e.tier != Tier::Disk) {
        return Ok(None); // still in memory: its spill failed
    }
    Ok(Some(weight))
}
