//! Store-level jobs: `spill-unspill` (with a file-per-key baseline in the same run) and `materialize`.

use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use bytes::Bytes;
use hdrhistogram::Histogram;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};
use spillway::units::format_size;
use spillway::{
    AutoBackend, Backend, BackendKind, Codec, CodecError, Frames, LogOptions, MetricsSnapshot, PortableBackend,
    SegmentLog, Store, StoreConfig,
};

/// The cheapest honest codec for bytes: serialize and deserialize share buffers (no copy), so the
/// benchmark measures the store, not the codec. Counts deserializations.
#[derive(Default)]
pub struct BytesCodec {
    deserialized: AtomicUsize,
}

impl Codec for BytesCodec {
    type Value = Bytes;
    fn serialize(&self, v: &Bytes) -> Result<Frames, CodecError> {
        Ok(Frames::single(v.clone()))
    }
    fn deserialize(&self, f: Frames) -> Result<Bytes, CodecError> {
        self.deserialized.fetch_add(1, Ordering::Relaxed);
        Ok(f.concat())
    }
    fn size_of(&self, v: &Bytes) -> u64 {
        v.len() as u64
    }
}

/// Parameters shared by the store jobs.
pub struct StoreJob<'a> {
    /// Value size.
    pub bs: u64,
    /// Total bytes of values.
    pub size: u64,
    /// Memory target of the store.
    pub target: u64,
    /// Threads (materialize job).
    pub numjobs: usize,
    /// Measured rounds (spill-unspill job).
    pub loops: usize,
    /// O_DIRECT on both sides (spill-unspill job): spillway's segment files and the baseline's files.
    pub direct: bool,
    /// Segment size.
    pub segment_size: u64,
    /// The store's I/O backend (spill-unspill job).
    pub backend: BackendKind,
    /// Values fetched per `get_many` in the unspill phase (1: one `get` per value).
    pub batch: usize,
    /// Write every dirty page back before the unspill phase (spill-unspill job).
    pub written_back: bool,
    /// Where to put the stores.
    pub dir: &'a Path,
    /// Print a human summary.
    pub human: bool,
}

struct Phase {
    ops: u64,
    bytes: u64,
    elapsed: Duration,
}

impl Phase {
    fn json(&self) -> Value {
        let s = self.elapsed.as_secs_f64().max(1e-9);
        json!({"ops": self.ops, "bytes": self.bytes, "seconds": s, "ops_per_s": self.ops as f64 / s, "bytes_per_s": self.bytes as f64 / s})
    }
    fn rate(&self) -> f64 {
        self.ops as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

fn values(n: u64, bs: u64) -> Vec<Bytes> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(42);
    // A handful of distinct random payloads, reused: generation cost stays out of the timings.
    let distinct: Vec<Bytes> = (0..16)
        .map(|_| {
            let mut v = vec![0u8; bs as usize];
            rng.fill(&mut v[..]);
            Bytes::from(v)
        })
        .collect();
    (0..n).map(|i| distinct[(i % 16) as usize].clone()).collect()
}

/// One side's measured phases.
struct Sides {
    spill: Phase,
    unspill: Phase,
}

/// Write back every dirty page of the system (untimed). Before each spill phase, so that it does not
/// pay for the writeback of the gigabyte the phase before it left in the page cache (left to chance,
/// the kernel throttled whichever writer came next). Before each unspill phase with
/// `--written-back`.
fn settle() {
    // SAFETY: sync(2) takes no arguments, has no preconditions and cannot fail.
    unsafe {
        libc::sync();
    }
}

impl StoreJob<'_> {
    /// The store configuration of the job's stores: the default, with the job's segment size and
    /// memory target `target`.
    fn store_config(&self, target: u64) -> StoreConfig {
        StoreConfig {
            target_bytes: target,
            log: LogOptions { segment_bytes: self.segment_size, ..StoreConfig::default().log },
            ..Default::default()
        }
    }
}

/// spillway: put every value (far more than the target, so most are spilled), then get each back in
/// `order` and remove it (a task consumed its input). Returns the phases, how many values were on
/// disk after the puts, and the store's metrics.
fn run_spillway(
    job: &StoreJob<'_>,
    vals: &[Bytes],
    order: &[u64],
) -> Result<(Sides, u64, MetricsSnapshot, &'static str)> {
    let n = vals.len() as u64;
    let cfg = job.store_config(job.target);
    let sdir = job.dir.join("spill-unspill-store");
    let backend = AutoBackend::new(job.backend, job.direct).context("starting the I/O backend")?;
    let backend_name = backend.name();
    let store = Store::open(BytesCodec::default(), backend, &sdir, cfg)?;
    if job.direct && !store.log().backend().direct() {
        anyhow::bail!("O_DIRECT was refused in {}", sdir.display());
    }
    settle();
    let t = Instant::now();
    for (i, v) in vals.iter().enumerate() {
        store.put(format!("key-{i}").as_bytes(), v.clone())?;
    }
    let spill = Phase { ops: n, bytes: n * job.bs, elapsed: t.elapsed() };
    let spilled = store.metrics().tier_entries.iter().find(|(t, _)| *t == "disk").map_or(0, |x| x.1);
    if job.written_back {
        settle();
    }
    let t = Instant::now();
    if job.batch <= 1 {
        for &i in order {
            let k = format!("key-{i}");
            let v = store.get(k.as_bytes())?.context("value missing")?;
            assert_eq!(v.len() as u64, job.bs);
            store.remove(k.as_bytes())?;
        }
    } else {
        for chunk in order.chunks(job.batch) {
            let ks: Vec<String> = chunk.iter().map(|i| format!("key-{i}")).collect();
            let keys: Vec<&[u8]> = ks.iter().map(|k| k.as_bytes()).collect();
            for v in store.get_many(&keys) {
                assert_eq!(v?.context("value missing")?.len() as u64, job.bs);
            }
            for k in keys {
                store.remove(k)?;
            }
        }
    }
    // The phase ends when the removed values' space is released, as the baseline's unlinks release it
    // in the call: the log punches forgotten records on a thread of its own.
    store.log().settle_punches();
    let unspill = Phase { ops: n, bytes: n * job.bs, elapsed: t.elapsed() };
    let metrics = store.metrics();
    drop(store);
    std::fs::remove_dir_all(&sdir).ok();
    Ok((Sides { spill, unspill }, spilled, metrics, backend_name))
}

/// The baseline: one file per key with a plain write, then a plain read and unlink, as dask's
/// `zict.File` does.
fn run_file_per_key(job: &StoreJob<'_>, vals: &[Bytes], order: &[u64]) -> Result<Sides> {
    if job.direct {
        return run_file_per_key_direct(job, vals, order);
    }
    let n = vals.len() as u64;
    let bdir = job.dir.join("spill-unspill-files");
    std::fs::create_dir_all(&bdir)?;
    settle();
    let t = Instant::now();
    for (i, v) in vals.iter().enumerate() {
        std::fs::write(bdir.join(format!("key-{i}")), v)?;
    }
    let spill = Phase { ops: n, bytes: n * job.bs, elapsed: t.elapsed() };
    if job.written_back {
        settle();
    }
    let t = Instant::now();
    for &i in order {
        let p = bdir.join(format!("key-{i}"));
        let v = std::fs::read(&p)?;
        assert_eq!(v.len() as u64, job.bs);
        std::fs::remove_file(&p)?;
    }
    let unspill = Phase { ops: n, bytes: n * job.bs, elapsed: t.elapsed() };
    std::fs::remove_dir_all(&bdir).ok();
    Ok(Sides { spill, unspill })
}

/// The baseline with O_DIRECT: each value written from and read into a 4096-aligned buffer (so `--bs`
/// must be a multiple of 4096), one file per key.
fn run_file_per_key_direct(job: &StoreJob<'_>, vals: &[Bytes], order: &[u64]) -> Result<Sides> {
    use spillway::buf::AlignedBuf;
    use std::io::{Read, Write};
    use std::os::unix::fs::OpenOptionsExt;
    anyhow::ensure!(job.bs % 4096 == 0, "--direct needs --bs to be a multiple of 4096");
    let n = vals.len() as u64;
    let bdir = job.dir.join("spill-unspill-files");
    std::fs::create_dir_all(&bdir)?;
    let open = |p: &Path, write: bool| {
        std::fs::OpenOptions::new()
            .read(!write)
            .write(write)
            .create(write)
            .truncate(write)
            .custom_flags(libc::O_DIRECT)
            .open(p)
            .with_context(|| format!("O_DIRECT open of {}", p.display()))
    };
    settle();
    let t = Instant::now();
    for (i, v) in vals.iter().enumerate() {
        // The copy into an aligned buffer is the baseline's share of what O_DIRECT demands.
        let mut buf = AlignedBuf::with_capacity(v.len(), 4096);
        buf.extend_from_slice(v);
        open(&bdir.join(format!("key-{i}")), true)?.write_all(&buf)?;
    }
    let spill = Phase { ops: n, bytes: n * job.bs, elapsed: t.elapsed() };
    if job.written_back {
        settle();
    }
    let t = Instant::now();
    for &i in order {
        let p = bdir.join(format!("key-{i}"));
        let mut buf = AlignedBuf::zeroed(job.bs as usize, 4096);
        open(&p, false)?.read_exact(&mut buf)?;
        std::fs::remove_file(&p)?;
    }
    let unspill = Phase { ops: n, bytes: n * job.bs, elapsed: t.elapsed() };
    std::fs::remove_dir_all(&bdir).ok();
    Ok(Sides { spill, unspill })
}

/// The unspill floor: each value read back with one `pread` (into fresh, unzeroed memory, as the
/// log reads) from one file that holds them all back to back, written 2 MiB at a time (the page
/// cache's best shape). No index, no checksum, no bookkeeping, no unlink: the most a store that reads
/// each value with one system call can reach on this machine. Buffered files only. Best of two passes.
fn run_read_floor(job: &StoreJob<'_>, vals: &[Bytes], order: &[u64]) -> Result<Phase> {
    use spillway::buf::AlignedBuf;
    use std::os::unix::fs::FileExt;
    let n = vals.len() as u64;
    let path = job.dir.join("spill-unspill-floor");
    let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(&path)?;
    let mut chunk: Vec<u8> = Vec::with_capacity(2 << 20);
    let mut at = 0u64;
    for v in vals {
        chunk.extend_from_slice(v);
        if chunk.len() >= 2 << 20 {
            file.write_all_at(&chunk, at)?;
            at += chunk.len() as u64;
            chunk.clear();
        }
    }
    file.write_all_at(&chunk, at)?;
    if job.written_back {
        settle();
    }
    let mut fastest: Option<Phase> = None;
    for _ in 0..2 {
        let t = Instant::now();
        for &i in order {
            let v = AlignedBuf::read_exact_at(&file, i * job.bs, job.bs as usize, 64)?;
            assert_eq!(v.len() as u64, job.bs);
        }
        fastest = Some(best(fastest, Phase { ops: n, bytes: n * job.bs, elapsed: t.elapsed() }));
    }
    drop(file);
    std::fs::remove_file(&path).ok();
    Ok(fastest.expect("a pass ran"))
}

/// The log's share of the unspill: the values written to a log opened as the store opens its own
/// ([`StoreConfig::log_options`]), in batches of about 2 MiB as the store's spills are, then each
/// read back with [`SegmentLog::get_with_crc`] and forgotten, in the unspill's order: the index
/// lookup, the read, the checksum and the forget, without the store's map, slots, promotion or
/// accounting. Between the floor and the store, it says which layer a get's time is spent in.
/// Buffered files only. Best of two passes.
fn run_log_only(job: &StoreJob<'_>, vals: &[Bytes], order: &[u64]) -> Result<Phase> {
    let n = vals.len() as u64;
    let opts = job.store_config(job.target).log_options();
    let dir = job.dir.join("spill-unspill-log");
    let keys: Vec<String> = (0..n).map(|i| format!("key-{i}")).collect();
    let per_batch = ((2 << 20) / job.bs).max(1) as usize;
    let mut fastest: Option<Phase> = None;
    for _ in 0..2 {
        let backend = AutoBackend::new(job.backend, false).context("starting the I/O backend")?;
        let log = SegmentLog::open(backend, &dir, opts.clone())?;
        for (ks, vs) in keys.chunks(per_batch).zip(vals.chunks(per_batch)) {
            let frames: Vec<Frames> = vs.iter().map(|v| Frames::single(v.clone())).collect();
            let items: Vec<(&[u8], &Frames)> = ks.iter().map(|k| k.as_bytes()).zip(&frames).collect();
            log.put_many(&items)?;
        }
        if job.written_back {
            settle();
        }
        let t = Instant::now();
        for &i in order {
            let k = format!("key-{i}");
            let (v, _) = log.get_with_crc(k.as_bytes())?.context("value missing")?;
            assert_eq!(v.total_len(), job.bs);
            log.forget(k.as_bytes())?;
        }
        log.settle_punches();
        fastest = Some(best(fastest, Phase { ops: n, bytes: n * job.bs, elapsed: t.elapsed() }));
        drop(log);
        std::fs::remove_dir_all(&dir).ok();
    }
    Ok(fastest.expect("a pass ran"))
}

/// The faster of two measurements of one phase.
fn best(a: Option<Phase>, b: Phase) -> Phase {
    match a {
        Some(a) if a.rate() >= b.rate() => a,
        _ => b,
    }
}

/// `--rw spill-unspill`: put N values (far more than the target), then get them all back in random
/// order, each get followed by a remove. Baseline: one file per key (see [`run_file_per_key`]); both
/// sides buffered, no fsync.
///
/// On a VM, the first pass over fresh memory (page cache pages, buffers) is several times slower than
/// later ones, because the host backs guest pages on first touch. Whichever side ran first used to
/// pay for that, so a 16 MiB ratio swung between 0.24x and 0.85x from run to run. So the job first runs
/// an unmeasured baseline pass, then `loops` rounds, alternating which side goes first, and reports
/// each side's best round per phase. Every round is in the JSON. Each spill phase starts with no dirty
/// pages (see [`settle`]); with `--written-back` each unspill phase too.
pub fn spill_unspill(job: &StoreJob<'_>) -> Result<Value> {
    let n = (job.size / job.bs).max(1);
    let vals = values(n, job.bs);
    let mut order: Vec<u64> = (0..n).collect();
    order.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(7));

    run_file_per_key(job, &vals, &order)?; // warm-up, not measured
    let (mut s_spill, mut s_unspill, mut b_spill, mut b_unspill) = (None, None, None, None);
    let mut rounds = Vec::new();
    let mut spilled = 0;
    let mut metrics = MetricsSnapshot::default();
    let mut backend_name = "";
    for round in 0..job.loops.max(1) {
        let spillway_first = round % 2 == 0;
        let mut s = None;
        let mut b = None;
        for side in 0..2 {
            if (side == 0) == spillway_first {
                let (x, sp, m, name) = run_spillway(job, &vals, &order)?;
                (spilled, metrics, backend_name) = (sp, m, name);
                s = Some(x);
            } else {
                b = Some(run_file_per_key(job, &vals, &order)?);
            }
        }
        let (s, b) = (s.expect("ran"), b.expect("ran"));
        rounds.push(json!({
            "spillway_first": spillway_first,
            "spillway": {"spill": s.spill.json(), "unspill": s.unspill.json()},
            "baseline_file_per_key": {"spill": b.spill.json(), "unspill": b.unspill.json()},
        }));
        s_spill = Some(best(s_spill, s.spill));
        s_unspill = Some(best(s_unspill, s.unspill));
        b_spill = Some(best(b_spill, b.spill));
        b_unspill = Some(best(b_unspill, b.unspill));
    }
    let (s_spill, s_unspill) = (s_spill.expect("a round ran"), s_unspill.expect("a round ran"));
    let (b_spill, b_unspill) = (b_spill.expect("a round ran"), b_unspill.expect("a round ran"));

    let r_spill = s_spill.rate() / b_spill.rate();
    let r_unspill = s_unspill.rate() / b_unspill.rate();
    let floor = if job.direct { None } else { Some(run_read_floor(job, &vals, &order)?) };
    let log_only = if job.direct { None } else { Some(run_log_only(job, &vals, &order)?) };
    if job.human {
        println!(
            "spill-unspill: {n} values of {} (target {}), {spilled} spilled; best of {} rounds after a warm-up; backend {}{}{}{}",
            format_size(job.bs),
            format_size(job.target),
            job.loops.max(1),
            backend_name,
            if job.direct { "; O_DIRECT on both sides" } else { "" },
            if job.batch > 1 { format!("; unspill by get_many of {}", job.batch) } else { String::new() },
            if job.written_back { "; written back before the unspill" } else { "" }
        );
        for (name, s, b, r) in [("spill", &s_spill, &b_spill, r_spill), ("unspill", &s_unspill, &b_unspill, r_unspill)]
        {
            println!(
                "  {name:<8} spillway {:>10.0} ops/s {:>10}/s   file-per-key {:>10.0} ops/s {:>10}/s   ratio {:.2}x",
                s.rate(),
                format_size((s.bytes as f64 / s.elapsed.as_secs_f64()) as u64),
                b.rate(),
                format_size((b.bytes as f64 / b.elapsed.as_secs_f64()) as u64),
                r
            );
        }
        if let Some(f) = &floor {
            println!(
                "  unspill floor: one pread per value from one file {:>10.0} ops/s {:>10}/s   ratio {:.2}x (the most one read per get can reach)",
                f.rate(),
                format_size((f.bytes as f64 / f.elapsed.as_secs_f64()) as u64),
                f.rate() / b_unspill.rate()
            );
            println!(
                "  unspill, time per get + remove against the floor's read: spillway {:.2}x{}",
                f.rate() / s_unspill.rate(),
                log_only.as_ref().map_or(String::new(), |l| format!(
                    ", of which its log (get_with_crc + forget, {:.0} ops/s) {:.2}x",
                    l.rate(),
                    f.rate() / l.rate()
                ))
            );
        }
    }
    Ok(json!({
        "jobname": "spill-unspill",
        "bs": job.bs, "values": n, "target": job.target, "spilled": spilled, "loops": job.loops.max(1), "direct": job.direct,
        "backend": backend_name, "batch": job.batch.max(1), "written_back": job.written_back,
        "spillway": {"spill": s_spill.json(), "unspill": s_unspill.json()},
        "baseline_file_per_key": {"spill": b_spill.json(), "unspill": b_unspill.json()},
        "ratio": {"spill": r_spill, "unspill": r_unspill},
        "unspill_floor": floor.as_ref().map(|f| json!({"unspill": f.json(), "ratio": f.rate() / b_unspill.rate(), "spillway_time_ratio": f.rate() / s_unspill.rate()})),
        "unspill_log_only": log_only.as_ref().map(|l| json!({"unspill": l.json(), "time_ratio_to_floor": floor.as_ref().map(|f| f.rate() / l.rate())})),
        "rounds": rounds,
        "disk_write_bytes": metrics.activity("disk-write").bytes,
        "disk_read_bytes": metrics.activity("disk-read").bytes,
    }))
}

/// `--rw materialize --numjobs T`: T threads get the same serialized keys at the same time; every key
/// must be deserialized exactly once.
pub fn materialize(job: &StoreJob<'_>) -> Result<Value> {
    let n = (job.size / job.bs).max(1);
    if n > 100_000 {
        anyhow::bail!("materialize: {n} keys (--size / --bs); at most 100000");
    }
    let vals = values(n, job.bs);
    let cfg = job.store_config(u64::MAX / 2);
    let sdir = job.dir.join("materialize-store");
    let store = Arc::new(Store::open(BytesCodec::default(), PortableBackend::new(), &sdir, cfg)?);
    for (i, v) in vals.iter().enumerate() {
        store.put_serialized(format!("key-{i}").as_bytes(), Frames::single(v.clone()))?;
    }
    let barrier = Arc::new(Barrier::new(job.numjobs));
    let t = Instant::now();
    let hists: Vec<Result<Histogram<u64>>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..job.numjobs)
            .map(|j| {
                let (store, barrier) = (store.clone(), barrier.clone());
                s.spawn(move || -> Result<Histogram<u64>> {
                    let mut order: Vec<u64> = (0..n).collect();
                    order.shuffle(&mut rand::rngs::SmallRng::seed_from_u64(j as u64));
                    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
                    barrier.wait();
                    for i in order {
                        let t = Instant::now();
                        store.get(format!("key-{i}").as_bytes())?.context("missing")?;
                        h.saturating_record(t.elapsed().as_nanos() as u64);
                    }
                    Ok(h)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("thread")).collect()
    });
    let elapsed = t.elapsed();
    let mut h = Histogram::<u64>::new_with_bounds(1, 60_000_000_000, 3)?;
    for x in hists {
        h.add(x?)?;
    }
    let deserialize_count = store.codec().deserialized.load(Ordering::Relaxed) as u64;
    drop(store);
    std::fs::remove_dir_all(&sdir).ok();
    if job.human {
        println!(
            "materialize: {n} keys x {} threads in {:.3} s: {} deserializations (must equal keys); get latency p50 {:.1} us p99 {:.1} us max {:.1} us",
            job.numjobs,
            elapsed.as_secs_f64(),
            deserialize_count,
            h.value_at_quantile(0.5) as f64 / 1e3,
            h.value_at_quantile(0.99) as f64 / 1e3,
            h.max() as f64 / 1e3
        );
    }
    anyhow::ensure!(deserialize_count == n, "deserialized {deserialize_count} times for {n} keys");
    Ok(json!({
        "jobname": "materialize", "keys": n, "threads": job.numjobs, "deserialize_count": deserialize_count,
        "seconds": elapsed.as_secs_f64(),
        "wait_ns": {"p50": h.value_at_quantile(0.5), "p99": h.value_at_quantile(0.99), "p99.9": h.value_at_quantile(0.999), "max": h.max()},
    }))
}
