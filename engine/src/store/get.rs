//! Gets: the per-key slot that deserializes once, reading back from disk (one read, or a batch of
//! pipelined reads for `get_many`), async gets, and `get_serialized` (frames, never an object).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::slot::Slot;
use crate::sync;
use crate::value::Frames;

use super::entry::{decompress, Source, Tier};
use super::evict::{enforce, keep_weak, serialize};
use super::metrics::Activity;
use super::{key_str, metrics, vanished, Codec, Inner, Revive, Store};

/// How a get goes on after looking the key up.
pub(super) enum GetStart<V> {
    /// Answered under the lock: the ready value, or `None` for an absent key.
    Done(Option<sync::Arc<V>>),
    /// Materialize through `slot` from `source`, or from `revive` if the evicted object is still
    /// alive.
    Read { key: Arc<[u8]>, slot: Arc<Slot<V, Error>>, source: Source, revive: Option<Revive<V>> },
}

/// How a `get_serialized` goes on after looking the key up.
pub(super) enum SerStart<V> {
    /// Answered under the lock (`None`: absent key).
    Done(Option<Frames>),
    /// A materialized value without frames: serialize it, outside the lock.
    Object(Arc<[u8]>, sync::Arc<V>),
    /// Read from `source`.
    Read { key: Arc<[u8]>, slot: Arc<Slot<V, Error>>, source: Source, large: bool },
}

/// Reads in flight at once in [`Store::get_many`] (on io_uring).
pub const GET_MANY_DEPTH: usize = 32;

/// Keys per batch of [`Store::get_many`]: what is read before being materialized.
pub const GET_MANY_BATCH: usize = 4 * GET_MANY_DEPTH;

pub(super) fn get<C: Codec, B: Backend>(store: &Store<C, B>, key: &[u8]) -> Result<Option<sync::Arc<C::Value>>> {
    loop {
        let (k, slot, source, revive) = match begin_get(store, key)? {
            GetStart::Done(v) => return Ok(v),
            GetStart::Read { key, slot, source, revive } => (key, slot, source, revive),
        };
        let mut crc = None;
        let got = slot.get_or_install(|| {
            if let Some(v) = revive_weak(store, &k, &slot, revive) {
                return Ok(v);
            }
            let owned = !matches!(source, Source::Frames(_));
            let (frames, read_crc) = fetch_with_crc(store, &k, source)?;
            crc = copy_crc_of(store, &k, &frames, read_crc);
            deserialize(store, &k, frames, owned).map(sync::Arc::new)
        });
        if let Some(v) = finish_get(store, &k, &slot, got, crc)? {
            return Ok(Some(v));
        }
    }
}

/// With [`EvictionPolicy::verify_copies`] (and no max_spill), the crc a copy of `k`'s value read
/// as `frames` is kept with: the one the read checked (`read`), or computed before anything is
/// built on the frames, which may change them. None for frames held in memory by an entry with no
/// copy on disk (a peer's value, a serialized put): there is no copy to keep, and a crc of a large
/// value would cost its get a pass over every byte. (Should a copy land meanwhile, the promotion
/// finds no crc and drops it, as it drops any copy it cannot vouch for.)
fn copy_crc_of<C: Codec, B: Backend>(store: &Store<C, B>, k: &[u8], frames: &Frames, read: Option<u32>) -> Option<u32> {
    if !store.cfg.eviction.verify_copies || store.cfg.max_spill_bytes.is_some() {
        return None;
    }
    if read.is_some() {
        return read;
    }
    if store.lock().table.get(k).is_none_or(|e| e.disk_raw == 0) {
        return None;
    }
    Some(crate::format::laid_out_crc(frames.iter().map(|b| &b[..])))
}

pub(super) fn peek<C: Codec, B: Backend>(store: &Store<C, B>, key: &[u8]) -> Result<Option<sync::Arc<C::Value>>> {
    loop {
        let (k, slot, source, revive) = {
            let inner = store.lock();
            let Some((k, e)) = inner.table.get_key_value(key) else { return Ok(None) };
            if let Some(v) = e.slot.try_get() {
                return Ok(Some(v));
            }
            let source = match (e.tier, &e.frames, &e.compressed) {
                (Tier::Disk, ..) => Source::Disk,
                (_, Some(f), _) => Source::Frames(f.clone()),
                (_, None, Some(c)) => Source::Compressed(c.clone()),
                _ => continue, // being promoted this instant: look again
            };
            let revive = inner.table.weak_of(key, &e.slot);
            (k.clone(), e.slot.clone(), source, revive)
        };
        if let Some(v) = revive.and_then(|r| r()) {
            return Ok(Some(v));
        }
        let owned = !matches!(source, Source::Frames(_));
        match fetch(store, &k, source) {
            Ok(frames) => return deserialize(store, &k, frames, owned).map(|v| Some(sync::Arc::new(v))),
            // Removed, replaced or brought back into memory while being read: look again.
            Err(_)
                if !store.lock().table.get(&k).is_some_and(|e| Arc::ptr_eq(&e.slot, &slot) && e.tier == Tier::Disk) =>
            {
                continue
            }
            Err(e) => return Err(e),
        }
    }
}

pub(super) async fn get_async<C: Codec, B: Backend>(
    store: &Store<C, B>,
    key: &[u8],
) -> Result<Option<sync::Arc<C::Value>>> {
    loop {
        let (k, slot, source, revive) = match begin_get(store, key)? {
            GetStart::Done(v) => return Ok(v),
            GetStart::Read { key, slot, source, revive } => (key, slot, source, revive),
        };
        // Read the bytes without holding anything, unless another caller has already started
        // materializing (then its result is waited for and no read is needed), or the evicted
        // object may still be alive.
        let frames = match source {
            Source::Disk if revive.is_none() && slot.state() == crate::slot::SlotState::Idle => {
                Some(fetch_disk_async(store, &k).await)
            }
            _ => None,
        };
        let mut crc = None;
        let got = slot.get_or_install(|| {
            if let Some(v) = revive_weak(store, &k, &slot, revive) {
                return Ok(v);
            }
            let owned = !matches!(source, Source::Frames(_));
            let (frames, read_crc) = match frames {
                Some(f) => (f?, None),
                None => fetch_with_crc(store, &k, source)?,
            };
            crc = copy_crc_of(store, &k, &frames, read_crc);
            deserialize(store, &k, frames, owned).map(sync::Arc::new)
        });
        if let Some(v) = finish_get(store, &k, &slot, got, crc)? {
            return Ok(Some(v));
        }
    }
}

pub(super) fn get_many<C: Codec, B: Backend>(
    store: &Store<C, B>,
    keys: &[&[u8]],
) -> Vec<Result<Option<sync::Arc<C::Value>>>> {
    // A key listed more than once is got once and answered from that: a value heavier than the
    // target is not kept in memory, so a second get of it would read and deserialize it again.
    let mut first: HashMap<&[u8], usize> = HashMap::with_capacity(keys.len());
    let unique: Vec<&[u8]> = keys
        .iter()
        .copied()
        .filter(|k| {
            let n = first.len();
            *first.entry(k).or_insert(n) == n
        })
        .collect();
    let got: Vec<Result<Option<sync::Arc<C::Value>>>> =
        if !store.logs.current().backend().pipelines_reads() || store.logs.replaced() {
            unique.iter().map(|k| store.get(k)).collect()
        } else {
            // In batches: the bytes read for a batch are held until its values are materialized, so
            // a long key list must not hold all of its values' bytes at once.
            unique.chunks(GET_MANY_BATCH).flat_map(|batch| get_batch(store, batch)).collect()
        };
    if unique.len() == keys.len() {
        return got;
    }
    keys.iter().map(|k| got[first[k]].clone()).collect()
}

/// One batch of [`Store::get_many`]: the disk values read together, then materialized.
pub(super) fn get_batch<C: Codec, B: Backend>(
    store: &Store<C, B>,
    keys: &[&[u8]],
) -> Vec<Result<Option<sync::Arc<C::Value>>>> {
    enum Plan<V> {
        Done(Result<Option<sync::Arc<V>>>),
        /// Read from disk in the batch (index into `batch`).
        Batched(Arc<[u8]>, Arc<Slot<V, Error>>, usize),
        /// Anything else (in memory, or already being materialized): as `get` does.
        Single,
    }
    let mut batch: Vec<Vec<u8>> = Vec::new();
    let mut batched_slots: HashMap<*const Slot<C::Value, Error>, usize> = HashMap::new();
    let plans: Vec<Plan<C::Value>> = keys
        .iter()
        .map(|key| match begin_get(store, key) {
            Err(e) => Plan::Done(Err(e)),
            Ok(GetStart::Done(v)) => Plan::Done(Ok(v)),
            Ok(GetStart::Read { key: k, slot, source: Source::Disk, revive: None })
                if slot.state() == crate::slot::SlotState::Idle =>
            {
                // A key listed twice is read once.
                let at = *batched_slots.entry(Arc::as_ptr(&slot)).or_insert_with(|| {
                    batch.push(k.to_vec());
                    batch.len() - 1
                });
                Plan::Batched(k, slot, at)
            }
            Ok(GetStart::Read { .. }) => Plan::Single,
        })
        .collect();
    let mut read = read_batch(store, &batch);
    plans
        .into_iter()
        .zip(keys)
        .map(|(plan, key)| match plan {
            Plan::Done(r) => r,
            Plan::Single => store.get(key),
            Plan::Batched(k, slot, at) => {
                // The frames read in the batch, unless someone else materializes first (then
                // theirs is the value, as for any get).
                let frames = read[at].take();
                let mut crc = None;
                let got = slot.get_or_materialize(|| {
                    // A batch read that failed is read again alone (the record may have moved to
                    // a fresh log meanwhile: the batch reads the one it started on).
                    let (frames, read_crc) = match frames {
                        Some(Ok(f)) => (f, None),
                        _ => fetch_with_crc(store, &k, Source::Disk)?,
                    };
                    crc = copy_crc_of(store, &k, &frames, read_crc);
                    deserialize(store, &k, frames, true)
                });
                match finish_get(store, &k, &slot, got, crc) {
                    Ok(Some(v)) => Ok(Some(v)),
                    // Removed or replaced meanwhile, and the read failed: start over, as get does.
                    Ok(None) => store.get(key),
                    Err(e) => Err(e),
                }
            }
        })
        .collect()
}

/// Read the keys of `batch` from the current log with several reads in flight: each key's frames,
/// its error, or `None` where the pipeline failed before reading it (the caller reads those
/// alone).
fn read_batch<C: Codec, B: Backend>(store: &Store<C, B>, batch: &[Vec<u8>]) -> Vec<Option<Result<Frames>>> {
    let mut read: Vec<Option<Result<Frames>>> = (0..batch.len()).map(|_| None).collect();
    if batch.is_empty() {
        return read;
    }
    let positions: HashMap<&[u8], usize> = batch.iter().enumerate().map(|(i, k)| (&k[..], i)).collect();
    let t = Instant::now();
    let mut keys_iter = batch.iter().cloned();
    let r = store.logs.current().get_pipelined(GET_MANY_DEPTH, &mut keys_iter, &mut |k, res| {
        let i = positions[&k[..]];
        read[i] = Some(res.and_then(|f| f.ok_or_else(|| vanished(&k))));
    });
    // Disk-read time is the batch's wall time, shared out over its reads.
    let ok: Vec<u64> = read.iter().flatten().filter_map(|r| r.as_ref().ok().map(|f| f.total_len())).collect();
    store.metrics.add(Activity::DiskRead, ok.len() as u64, ok.iter().sum(), t.elapsed().as_nanos() as u64);
    if let Err(e) = r {
        // The pipeline itself failed (its ring could not be set up): what was not read yet
        // is read one by one by `get_batch`.
        log::warn!("batched read failed ({e}); reading one by one");
    }
    read
}

/// First half of a get, under the store's lock: the value if it is ready (or the key absent),
/// otherwise what to materialize it from.
pub(super) fn begin_get<C: Codec, B: Backend>(store: &Store<C, B>, key: &[u8]) -> Result<GetStart<C::Value>> {
    let mut inner = store.lock();
    let Some((k, e)) = inner.table.get_key_value(key) else { return Ok(GetStart::Done(None)) };
    let k = k.clone();
    if let Some(v) = e.slot.try_get() {
        // Counted under the lock this path holds anyway: no atomic on a get's fastest path.
        let w = e.weight;
        inner.object_reads.0 += 1;
        inner.object_reads.1 += w;
        metrics::note_thread(Activity::MemoryRead, 1, w, 0);
        inner.table.touch(&k);
        return Ok(GetStart::Done(Some(v)));
    }
    let source = match (e.tier, &e.frames, &e.compressed) {
        (Tier::Disk, ..) => Source::Disk,
        (_, Some(f), _) => Source::Frames(f.clone()),
        (_, None, Some(c)) => Source::Compressed(c.clone()),
        // A materialized entry always has a ready slot while the store lock is held.
        _ => return Err(Error::Internal(format!("{:?}: materialized entry without a value", key_str(key)))),
    };
    let slot = e.slot.clone();
    if e.tier != Tier::Disk {
        inner.table.touch(&k); // (disk entries are not in the LRU: no second lookup)
    }
    let revive = inner.table.weak_of(key, &slot);
    Ok(GetStart::Read { key: k, slot, source, revive })
}

/// The evicted object of `key`, if `revive` finds it still alive; its entry is marked so that
/// its promotion drops the record (the object may have changed since it was written). Runs
/// inside the slot's materialization, before the value is published.
fn revive_weak<C: Codec, B: Backend>(
    store: &Store<C, B>,
    k: &Arc<[u8]>,
    slot: &Arc<Slot<C::Value, Error>>,
    revive: Option<Revive<C::Value>>,
) -> Option<sync::Arc<C::Value>> {
    let v = revive?()?;
    let t = Instant::now();
    let mut inner = store.lock();
    if !inner.table.get(k).is_some_and(|e| Arc::ptr_eq(&e.slot, slot)) {
        return None; // removed or replaced meanwhile: not this entry's value any more
    }
    inner.table.set_revived(k, true);
    drop(inner);
    store.metrics.record(Activity::MemoryRead, 0, t);
    Some(v)
}

/// `owned`: nothing else holds `frames` (see [`Codec::deserialize_owned`]).
pub(super) fn deserialize<C: Codec, B: Backend>(
    store: &Store<C, B>,
    key: &[u8],
    frames: Frames,
    owned: bool,
) -> Result<C::Value> {
    let t = Instant::now();
    let n = frames.total_len();
    let r = if owned { store.codec.deserialize_owned(frames) } else { store.codec.deserialize(frames) };
    let v = r.map_err(|e| Error::Codec { op: "deserialize", key: key_str(key), source: Arc::from(e) })?;
    store.metrics.record(Activity::Deserialize, n, t);
    Ok(v)
}

/// Second half of a get: `None` to start over (the entry was removed or replaced while it was
/// being read, and the read failed); otherwise the value, after promoting it (or, for a large
/// value, letting the caller keep the only reference).
pub(super) fn finish_get<C: Codec, B: Backend>(
    store: &Store<C, B>,
    k: &Arc<[u8]>,
    slot: &Arc<Slot<C::Value, Error>>,
    got: Result<sync::Arc<C::Value>>,
    crc: Option<u32>,
) -> Result<Option<sync::Arc<C::Value>>> {
    // Weighed before the lock is taken: a codec's `size_of` may be slow, or wait (for the GIL,
    // in Python), and must not hold up every other caller of the store meanwhile.
    let got = got.map(|v| {
        let weight = store.codec.size_of(&v);
        (v, weight)
    });
    // A value served from disk without promotion is handed back by the next get while the
    // caller still holds it (as dask's store does): a weak handle, made before the lock (the
    // codec's may wait too).
    let weak = match &got {
        Ok((v, weight)) if *weight > store.target() => keep_weak(store, v),
        _ => None,
    };
    let mut inner = store.lock();
    let current = inner.table.get(k).filter(|e| Arc::ptr_eq(&e.slot, slot));
    let (v, weight) = match got {
        Ok(got) => got,
        Err(_) if current.is_none() => return Ok(None),
        Err(e) => return Err(e),
    };
    let Some(e) = current else { return Ok(Some(v)) };
    let (tier, revived, disk_bytes) = (e.tier, e.revived, e.disk_bytes);
    if revived {
        // Settled here, whichever way the entry goes: a later get of it reads its record.
        inner.table.set_revived(k, false);
    }
    // Already promoted by another reader of the same materialization; or promoted and then evicted
    // again (slot idle) between our materialization and this lock: then the entry stays where it is,
    // since promoting it would leave a materialized entry without a value.
    if tier == Tier::Materialized || slot.state() != crate::slot::SlotState::Ready {
        return Ok(Some(v));
    }
    // Served without promotion: an object heavier than the target stays where its value is,
    // as a `put` of it would go to disk. (Judged by the object, as dask judges a read back:
    // frames heavier than the target whose object is light come back into memory.) So does the
    // old value of a key whose new value is streaming in (`put_stream`): its entry and record
    // stay as they are until the new record replaces them.
    if weight > store.target() || inner.transfers.contains(k) {
        slot.evict();
        if let Some(revive) = weak {
            inner.table.keep_weak(k.clone(), slot.clone(), revive);
        }
        return Ok(Some(v));
    }
    promote(store, &mut inner, k, weight, crc, revived, disk_bytes);
    enforce(store, inner, None)?;
    store.relieve_process_memory(Some(k), weight);
    Ok(Some(v))
}

/// Promote `k`'s entry, read back, to the object tier with its `weight`. It keeps its disk
/// copy (`disk_bytes` of record, read with `crc`), so evicting it again costs no write, unless
/// the copy is not to be relied on: the record then goes (a persistent store keeps it, as the
/// key's durable value).
fn promote<C: Codec, B: Backend>(
    store: &Store<C, B>,
    inner: &mut Inner<C::Value>,
    k: &Arc<[u8]>,
    weight: u64,
    crc: Option<u32>,
    revived: bool,
    disk_bytes: u64,
) {
    // A revived object is not known to match its record. Under `verify_copies`, a copy is kept only with the crc of what was read (this reader's:
    // one that promotes a value another reader read has none).
    let unverified = store.cfg.eviction.verify_copies && crc.is_none();
    // A record left in a log that a failed write made read-only goes too: evicted again, the value
    // is written to the log spills go to, and the failing one is not relied on for it.
    let off_current = disk_bytes > 0 && store.logs.replaced() && !store.logs.in_current(k);
    let drop_record = (revived || unverified || off_current)
        && disk_bytes > 0
        && !store.cfg.persistent
        && store.logs.forget(k).is_ok();
    if let (Some(c), false) = (crc, drop_record) {
        if disk_bytes > 0 {
            inner.table.note_copy_crc(k.clone(), c);
        }
    }
    let tick = inner.table.tick();
    inner.table.drop_weak(k);
    inner.table.materialized(k, weight, tick, drop_record);
    if drop_record {
        inner.table.unstick();
    }
}

/// Read `key`'s record from the log as a future (see [`SegmentLog::get_async`]).
async fn fetch_disk_async<C: Codec, B: Backend>(store: &Store<C, B>, key: &[u8]) -> Result<Frames> {
    let t = Instant::now();
    let f = store.logs.get_async(key).await?.ok_or_else(|| vanished(key))?;
    store.metrics.record(Activity::DiskRead, f.total_len(), t);
    Ok(f)
}

/// `fetch`, with the crc a disk read checked the frames against (`None` for other
/// sources, and for an lz4 record).
pub(super) fn fetch_with_crc<C: Codec, B: Backend>(
    store: &Store<C, B>,
    key: &[u8],
    source: Source,
) -> Result<(Frames, Option<u32>)> {
    match source {
        Source::Disk => {
            let t = Instant::now();
            let (f, crc) = store.logs.get_with_crc(key)?.ok_or_else(|| vanished(key))?;
            store.metrics.record(Activity::DiskRead, f.total_len(), t);
            Ok((f, crc))
        }
        other => Ok((fetch(store, key, other)?, None)),
    }
}

pub(super) fn fetch<C: Codec, B: Backend>(store: &Store<C, B>, key: &[u8], source: Source) -> Result<Frames> {
    match source {
        Source::Frames(f) => {
            let t = Instant::now();
            store.metrics.record(Activity::MemoryRead, f.total_len(), t);
            Ok(f)
        }
        Source::Compressed(c) => {
            let t = Instant::now();
            let f = decompress(&c)?;
            store.metrics.record(Activity::Decompress, f.total_len(), t);
            Ok(f)
        }
        Source::Disk => {
            let t = Instant::now();
            let f = store.logs.get(key)?.ok_or_else(|| vanished(key))?;
            store.metrics.record(Activity::DiskRead, f.total_len(), t);
            Ok(f)
        }
    }
}

pub(super) fn get_serialized<C: Codec, B: Backend>(store: &Store<C, B>, key: &[u8]) -> Result<Option<Frames>> {
    get_serialized_as(store, key, store.cfg.eviction.serialized_reads_promote)
}

pub(super) fn get_serialized_promoting<C: Codec, B: Backend>(
    store: &Store<C, B>,
    key: &[u8],
) -> Result<Option<Frames>> {
    get_serialized_as(store, key, true)
}

fn get_serialized_as<C: Codec, B: Backend>(store: &Store<C, B>, key: &[u8], promote: bool) -> Result<Option<Frames>> {
    loop {
        let (k, slot, source, large) = match begin_get_serialized(store, key)? {
            SerStart::Done(f) => return Ok(f),
            SerStart::Object(k, v) => return serialize(store, &k, &v).map(Some),
            SerStart::Read { key, slot, source, large } => (key, slot, source, large),
        };
        let was_disk = matches!(source, Source::Disk);
        let got = fetch(store, &k, source);
        if !was_disk {
            return got.map(Some); // in-memory sources cannot vanish under a reader
        }
        if let Some(f) = finish_get_serialized(store, &k, &slot, large, got, promote)? {
            return Ok(Some(f));
        }
    }
}

pub(super) async fn get_serialized_async<C: Codec, B: Backend>(
    store: &Store<C, B>,
    key: &[u8],
) -> Result<Option<Frames>> {
    loop {
        let (k, slot, source, large) = match begin_get_serialized(store, key)? {
            SerStart::Done(f) => return Ok(f),
            SerStart::Object(k, v) => return serialize(store, &k, &v).map(Some),
            SerStart::Read { key, slot, source, large } => (key, slot, source, large),
        };
        if !matches!(source, Source::Disk) {
            return fetch(store, &k, source).map(Some);
        }
        let got = fetch_disk_async(store, &k).await;
        let promote = store.cfg.eviction.serialized_reads_promote;
        if let Some(f) = finish_get_serialized(store, &k, &slot, large, got, promote)? {
            return Ok(Some(f));
        }
    }
}

/// First half of `get_serialized`, under the store's lock.
pub(super) fn begin_get_serialized<C: Codec, B: Backend>(
    store: &Store<C, B>,
    key: &[u8],
) -> Result<SerStart<C::Value>> {
    let mut inner = store.lock();
    let Some((k, e)) = inner.table.get_key_value(key) else { return Ok(SerStart::Done(None)) };
    let k = k.clone();
    let large = e.large;
    let slot = e.slot.clone();
    let source = match (e.tier, &e.frames, &e.compressed) {
        (Tier::Disk, ..) => Source::Disk,
        (_, Some(f), _) => Source::Frames(f.clone()),
        (_, None, Some(c)) => Source::Compressed(c.clone()),
        (Tier::Materialized, None, None) => match e.slot.try_get() {
            Some(v) => {
                inner.table.touch(&k);
                return Ok(SerStart::Object(k, v)); // serialized outside the lock
            }
            None => Source::Disk, // unreachable in practice: materialized entries have a value
        },
        _ => Source::Disk,
    };
    inner.table.touch(&k);
    Ok(SerStart::Read { key: k, slot, source, large })
}

/// Second half of `get_serialized` after a disk read: `None` to start over (the entry was removed
/// or replaced while being read, and the read failed); otherwise the frames, after promoting them
/// to the serialized tier (with `promote`) unless the value is heavier than the target.
pub(super) fn finish_get_serialized<C: Codec, B: Backend>(
    store: &Store<C, B>,
    k: &Arc<[u8]>,
    slot: &Arc<Slot<C::Value, Error>>,
    large: bool,
    got: Result<Frames>,
    promote: bool,
) -> Result<Option<Frames>> {
    let mut inner = store.lock();
    let current = inner.table.get(k).is_some_and(|e| Arc::ptr_eq(&e.slot, slot));
    // Still on disk, the entry is what was read: a failed read is its failure. Otherwise it was
    // removed, replaced, or brought back into memory (a revived object drops its record)
    // meanwhile, and the caller starts over.
    let on_disk = current && inner.table.get(k).is_some_and(|e| e.tier == Tier::Disk);
    let frames = match got {
        Ok(f) => f,
        Err(_) if !on_disk => return Ok(None),
        Err(e) => return Err(e),
    };
    // (Not the old value of a key whose new value is streaming in: see `finish_get`.)
    if !large && promote && on_disk && !inner.transfers.contains(k) {
        let tick = inner.table.tick();
        inner.table.hold_read_back(k, &frames, tick); // keeps its disk copy, like `get`
        enforce(store, inner, None)?;
    }
    Ok(Some(frames))
}
