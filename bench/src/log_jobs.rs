//! The fio-like jobs on a bare segment log: sequential and random writes and reads, a read/write
//! mix, with per-operation latency histograms and fio's JSON output.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};
use serde_json::json;
use spillway::units::format_size;
use spillway::{AutoBackend, Backend, Compression, Frames, LogOptions, SegmentLog};

use crate::{depth, Args, CompressArg, LogOp, OutputFormat, Payload};

/// Latency and volume of one direction (read or write) of a job.
pub struct Side {
    hist: Histogram<u64>,
    bytes: u64,
    ops: u64,
}

impl Side {
    pub fn new() -> Self {
        Side { hist: Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds"), bytes: 0, ops: 0 }
    }
    pub fn record(&mut self, ns: u64, bytes: u64) {
        self.hist.saturating_record(ns.max(1));
        self.bytes += bytes;
        self.ops += 1;
    }
    pub fn merge(&mut self, other: &Side) {
        self.hist.add(&other.hist).expect("same bounds");
        self.bytes += other.bytes;
        self.ops += other.ops;
    }
    /// fio's JSON for one direction. The latency of an operation is measured from its issue to its
    /// completion, so `clat_ns` and `lat_ns` carry the same distribution and `slat_ns` is zero (there
    /// is no separate submission step to time). A direction without I/O has a zero runtime, as in fio.
    fn json(&self, runtime: Duration) -> serde_json::Value {
        let secs = runtime.as_secs_f64().max(1e-9);
        let none = self.ops == 0;
        // fio's default percentile list.
        const PERCENTILES: [f64; 17] =
            [1.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 70.0, 80.0, 90.0, 95.0, 99.0, 99.5, 99.9, 99.95, 99.99];
        let percentile: serde_json::Map<String, serde_json::Value> = PERCENTILES
            .iter()
            .map(|&p| (format!("{p:.6}"), json!(if none { 0 } else { self.hist.value_at_quantile(p / 100.0) })))
            .collect();
        let lat = json!({
            "min": if none { 0 } else { self.hist.min() },
            "max": if none { 0 } else { self.hist.max() },
            "mean": if none { 0.0 } else { self.hist.mean() },
            "stddev": if none { 0.0 } else { self.hist.stdev() },
            "N": self.ops,
            "percentile": percentile,
        });
        json!({
            "io_bytes": self.bytes,
            "io_kbytes": self.bytes / 1024,
            "bw_bytes": (self.bytes as f64 / secs) as u64,
            "bw": (self.bytes as f64 / secs / 1024.0) as u64,
            "iops": self.ops as f64 / secs,
            "runtime": if none { 0 } else { runtime.as_millis() as u64 },
            "total_ios": self.ops,
            "slat_ns": {"min": 0, "max": 0, "mean": 0.0, "stddev": 0.0, "N": 0},
            "clat_ns": lat.clone(),
            "lat_ns": lat,
        })
    }
    fn human(&self, name: &str, runtime: Duration) -> String {
        let secs = runtime.as_secs_f64().max(1e-9);
        let q = |x: f64| self.hist.value_at_quantile(x) as f64 / 1000.0;
        format!(
            "  {name:<5} {:>10}/s  {:>9.0} IOPS  lat p50 {:.1} us  p99 {:.1} us  p99.9 {:.1} us  max {:.1} us",
            format_size((self.bytes as f64 / secs) as u64),
            self.ops as f64 / secs,
            q(0.5),
            q(0.99),
            q(0.999),
            self.hist.max() as f64 / 1000.0
        )
    }
}

pub struct JobResult {
    name: String,
    read: Side,
    write: Side,
    runtime: Duration,
}

fn make_value(payload: Payload, bs: usize, rng: &mut rand::rngs::SmallRng) -> Frames {
    let mut v = vec![0u8; bs];
    match payload {
        Payload::Zeros => {}
        Payload::Random => rng.fill(&mut v[..]),
        Payload::Text => {
            const WORDS: [&[u8]; 8] =
                [b"spill ", b"worker ", b"task ", b"memory ", b"disk ", b"frame ", b"segment ", b"value "];
            let mut at = 0;
            while at < bs {
                let w = WORDS[rng.gen_range(0..WORDS.len())];
                let n = w.len().min(bs - at);
                v[at..at + n].copy_from_slice(&w[..n]);
                at += n;
            }
        }
    }
    Frames::from(v)
}

pub fn key(job: usize, i: u64) -> Vec<u8> {
    format!("j{job:03}-k{i:012}").into_bytes()
}

/// Run `rw` on `numjobs` threads, each over its own key range.
fn run_job(
    log: &Arc<SegmentLog<AutoBackend>>,
    args: &Args,
    rw: LogOp,
    progress: bool,
    layout: bool,
) -> Result<JobResult> {
    let nkeys = (args.size / args.bs).max(1);
    let deadline = (args.runtime > 0 && !layout).then(|| Instant::now() + Duration::from_secs(args.runtime));
    let layout_args;
    let args = if layout {
        layout_args = Args { time_based: false, ..args.clone() };
        &layout_args
    } else {
        args
    };
    let done_bytes = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let reporter = progress.then(|| {
        let done = done_bytes.clone();
        std::thread::spawn(move || {
            let mut last = Instant::now();
            loop {
                std::thread::sleep(Duration::from_millis(200));
                let d = done.load(Ordering::Relaxed);
                if d == u64::MAX {
                    break;
                }
                if start.elapsed() > Duration::from_secs(3) && last.elapsed() >= Duration::from_secs(1) {
                    last = Instant::now();
                    let rate = d as f64 / start.elapsed().as_secs_f64();
                    eprint!(
                        "\r  {:?}: {} done, {}/s, {:.0}s   ",
                        rw,
                        format_size(d),
                        format_size(rate as u64),
                        start.elapsed().as_secs_f64()
                    );
                }
            }
        })
    });
    let results: Vec<Result<(Side, Side)>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..args.numjobs)
            .map(|job| {
                let log = log.clone();
                let done = done_bytes.clone();
                s.spawn(move || -> Result<(Side, Side)> {
                    let mut rng = rand::rngs::SmallRng::seed_from_u64(job as u64 + 1);
                    let value = make_value(args.payload, args.bs as usize, &mut rng);
                    let j = depth::Job { log: &log, args, rw, job, nkeys, deadline, done: &done };
                    if args.iodepth > 1 && matches!(rw, LogOp::Read | LogOp::Randread) {
                        return depth::reads(&j, &mut rng);
                    }
                    if args.iodepth > 1 && matches!(rw, LogOp::Write | LogOp::Randwrite) {
                        return depth::writes(&j, &mut rng, &value);
                    }
                    let (mut r, mut w) = (Side::new(), Side::new());
                    let mut i = 0u64;
                    loop {
                        if i >= nkeys && !(args.time_based && deadline.is_some()) {
                            break;
                        }
                        if deadline.is_some_and(|d| Instant::now() >= d) {
                            break;
                        }
                        let seq_i = i % nkeys;
                        let is_read = match rw {
                            LogOp::Write | LogOp::Randwrite => false,
                            LogOp::Read | LogOp::Randread => true,
                            LogOp::Randrw => rng.gen_range(0..100) < args.rwmixread,
                        };
                        let k = match rw {
                            LogOp::Write | LogOp::Read => key(job, seq_i),
                            _ => key(job, rng.gen_range(0..nkeys)),
                        };
                        let t = Instant::now();
                        if is_read {
                            let v =
                                log.get(&k)?.with_context(|| format!("key {} missing", String::from_utf8_lossy(&k)))?;
                            r.record(t.elapsed().as_nanos() as u64, v.total_len());
                        } else {
                            log.put(&k, &value)?;
                            w.record(t.elapsed().as_nanos() as u64, args.bs);
                        }
                        done.fetch_add(args.bs, Ordering::Relaxed);
                        i += 1;
                    }
                    Ok((r, w))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("job thread panicked")).collect()
    });
    let runtime = start.elapsed();
    done_bytes.store(u64::MAX, Ordering::Relaxed);
    if let Some(h) = reporter {
        let _ = h.join();
        if runtime > Duration::from_secs(3) {
            eprintln!();
        }
    }
    let (mut read, mut write) = (Side::new(), Side::new());
    for r in results {
        let (rr, ww) = r?;
        read.merge(&rr);
        write.merge(&ww);
    }
    Ok(JobResult { name: format!("{rw:?}").to_lowercase(), read, write, runtime })
}

/// Drop the cached pages of every file in `dir` (written back already), as fio's `invalidate`.
fn drop_cached_pages(dir: &std::path::Path) -> Result<()> {
    for entry in std::fs::read_dir(dir)? {
        let f = std::fs::File::open(entry?.path())?;
        rustix::fs::fadvise(&f, 0, None, rustix::fs::Advice::DontNeed)?;
    }
    Ok(())
}

/// Run the log jobs: `op` after a layout write (or a write alone), or, with `None`, the default set
/// (a write, then a random read of what it wrote), on a log in `store_dir`.
pub fn run(args: &Args, op: Option<LogOp>, store_dir: &std::path::Path) -> Result<()> {
    let opts = LogOptions {
        segment_bytes: args.segment_size,
        compression: match args.compress {
            CompressArg::None => Compression::None,
            CompressArg::Lz4 => Compression::Lz4,
        },
        durable: args.durable,
        discard_existing: args.spill_log,
        recycle_segments: args.spill_log && args.recycle_segments,
        ..Default::default()
    };
    let backend = AutoBackend::new(args.backend, args.direct).context("starting the I/O backend")?;
    let backend_name = backend.name();
    let direct = backend.direct();
    let log = Arc::new(SegmentLog::open(backend, store_dir, opts).context("opening the store")?);
    // Read and overwrite jobs need data: a write lays it out first. Like fio's layout phase it is
    // not one of the jobs asked for: it is reported apart (JSON: `spillway.layout`). The default set
    // runs two jobs, a write and a random read of what it wrote.
    let (jobs, laid_out): (Vec<LogOp>, bool) = match op {
        Some(LogOp::Write) => (vec![LogOp::Write], false),
        Some(op) => (vec![LogOp::Write, op], true),
        None => (vec![LogOp::Write, LogOp::Randread], false),
    };
    let human = args.output_format == OutputFormat::Normal;
    if human {
        println!(
            "spillway-bench: backend {backend_name}{}, bs {}, iodepth {}, size {} x {} job(s), compress {:?}, payload {:?}, dir {}",
            if direct { " (O_DIRECT)" } else { "" },
            format_size(args.bs),
            args.iodepth,
            format_size(args.size),
            args.numjobs,
            args.compress,
            args.payload,
            store_dir.display()
        );
    }
    let mut results = Vec::new();
    let mut layout_result = None;
    let mut invalidated = false;
    let njobs = jobs.len();
    for (i, rw) in jobs.into_iter().enumerate() {
        // A write that lays out data for the next job writes `--size` once (no `--runtime`).
        let layout = rw == LogOp::Write && i + 1 < njobs;
        let mut r = run_job(&log, args, rw, human, layout)?;
        if rw == LogOp::Write {
            log.sync()?;
            if layout && args.invalidate && !direct {
                drop_cached_pages(&store_dir.join("segments")).context("dropping the store's cached pages")?;
                invalidated = true;
            }
        }
        if layout && laid_out {
            r.name = "layout".into();
        }
        if human {
            println!("{} ({:.2} s):", r.name, r.runtime.as_secs_f64());
            if r.write.ops > 0 {
                println!("{}", r.write.human("write", r.runtime));
            }
            if r.read.ops > 0 {
                println!("{}", r.read.human("read", r.runtime));
            }
        }
        if layout && laid_out {
            layout_result = Some(r);
        } else {
            results.push(r);
        }
    }
    let stats = log.stats();
    if human {
        println!(
            "store: {} segment(s), {} live key(s), {} live, {} on disk",
            stats.segments,
            stats.live_records,
            format_size(stats.live_bytes),
            format_size(stats.disk_bytes)
        );
    } else {
        let jobs: Vec<_> = results
            .iter()
            .map(|r| {
                json!({
                    "jobname": r.name,
                    "groupid": 0,
                    "error": 0,
                    "job options": {
                        "rw": r.name, "bs": args.bs.to_string(), "size": args.size.to_string(),
                        "numjobs": args.numjobs.to_string(), "iodepth": args.iodepth.to_string(),
                        "direct": if direct { "1" } else { "0" }, "ioengine": format!("spillway-{backend_name}"),
                    },
                    "read": r.read.json(r.runtime),
                    "write": r.write.json(r.runtime),
                    "job_runtime": r.runtime.as_millis() as u64,
                })
            })
            .collect();
        let out = json!({
            "fio version": concat!("spillway-bench-", env!("CARGO_PKG_VERSION")),
            "timestamp": std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            "jobs": jobs,
            "spillway": {
                "segments": stats.segments, "live_bytes": stats.live_bytes, "disk_bytes": stats.disk_bytes,
                "layout": layout_result.as_ref().map(|r| json!({
                    "write": r.write.json(r.runtime), "runtime": r.runtime.as_millis() as u64,
                })),
                "invalidate": invalidated,
            },
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
    }
    drop(log);
    Ok(())
}
