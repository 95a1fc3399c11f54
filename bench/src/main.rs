//! `spillway-bench`: a fio-like benchmark of the spillway engine.
//!
//! With no arguments it runs the default job set on a temporary directory (sequential write, then
//! random read of what was written) and prints a short human summary. Options follow fio's names and
//! typed sizes (`--bs 64KiB`, `--size 1GiB`); `--output-format json` prints fio-shaped JSON
//! (`jobs[].write.bw_bytes`, `iops`, `clat_ns.percentile`, ...) so fio tooling can read it.

use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, ValueEnum};
use hdrhistogram::Histogram;
use rand::{Rng, SeedableRng};
use serde_json::json;
use spillway::units::{format_size, parse_size};
use spillway::{AutoBackend, Backend, BackendKind, Compression, Frames, LogOptions, SegmentLog};

mod depth;
mod open_job;
mod store_jobs;
mod transfer_job;

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Rw {
    /// Sequential writes of new keys.
    Write,
    /// Reads of every key in write order (the keys are laid out by a write first).
    Read,
    /// Reads of random keys.
    Randread,
    /// Overwrites of random keys.
    Randwrite,
    /// Random mix of reads and overwrites (`--rwmixread` percent reads).
    Randrw,
    /// Store: put values far beyond `--target`, get them back in random order; file-per-key baseline.
    SpillUnspill,
    /// Store: `--numjobs` threads get the same serialized keys; deserializations must equal keys.
    Materialize,
    /// Peer transfer of spilled values over 127.0.0.1: splice vs copy, throughput and peak RSS.
    Transfer,
    /// Scale: index memory per key (`--keys`) and the open time of a `--size` store.
    Open,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum BackendArg {
    /// io_uring where available, else portable (the reason is logged).
    Auto,
    /// io_uring (an error where unavailable).
    Uring,
    /// Blocking pread/pwrite.
    Portable,
}

impl From<BackendArg> for BackendKind {
    fn from(b: BackendArg) -> BackendKind {
        match b {
            BackendArg::Auto => BackendKind::Auto,
            BackendArg::Uring => BackendKind::Uring,
            BackendArg::Portable => BackendKind::Portable,
        }
    }
}

fn parse_bool01(s: &str) -> Result<bool, String> {
    match s {
        "1" | "true" | "yes" => Ok(true),
        "0" | "false" | "no" => Ok(false),
        other => Err(format!("expected 0 or 1, got '{other}'")),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum CompressArg {
    None,
    Lz4,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Payload {
    /// Incompressible bytes.
    Random,
    /// All zeros (maximally compressible).
    Zeros,
    /// Text-like bytes (compresses about 2-3x with lz4).
    Text,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum OutputFormat {
    Normal,
    Json,
}

/// A fio-like benchmark of the spillway segment log.
#[derive(Parser, Debug, Clone)]
#[command(name = "spillway-bench", version)]
struct Args {
    /// Job to run; without it, the default set runs: write, then randread.
    #[arg(long, value_enum)]
    rw: Option<Rw>,
    /// Value (block) size.
    #[arg(long, value_parser = parse_size, default_value = "64KiB")]
    bs: u64,
    /// Total bytes of values per job thread.
    #[arg(long, value_parser = parse_size, default_value = "256MiB")]
    size: u64,
    /// Threads running the job at once.
    #[arg(long, default_value_t = 1)]
    numjobs: usize,
    /// Stop after this many seconds (0 = when `--size` is done).
    #[arg(long, default_value_t = 0)]
    runtime: u64,
    /// With --runtime, loop over the data until the time is up.
    #[arg(long)]
    time_based: bool,
    /// Measured rounds of `spill-unspill` (alternating which side runs first; the best round of each
    /// side is reported).
    #[arg(long, default_value_t = 2)]
    loops: usize,
    /// `spill-unspill`: values fetched per `Store::get_many` in the unspill phase (1: one `get` per
    /// value, as the baseline reads one file per value).
    #[arg(long, default_value_t = 1)]
    batch: usize,
    /// `spill-unspill`: write every dirty page back (sync) before the unspill phase, as a worker's
    /// spilled data is once the kernel's writeback has caught up (after 30 s by default). Without
    /// it, values read back are still dirty in the page cache and have no disk blocks yet (ext4's
    /// delayed allocation), which makes the baseline's unlink nearly free.
    #[arg(long)]
    written_back: bool,
    /// Percentage of reads in randrw.
    #[arg(long, default_value_t = 50)]
    rwmixread: u32,
    /// I/O backend.
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendArg,
    /// Operations in flight per job: reads are pipelined on a ring the job thread owns (io_uring;
    /// the portable backend reads one after another); writes go in batches of that many values
    /// (one aligned write the block layer splits). Not for randrw.
    #[arg(long, default_value_t = 1)]
    iodepth: usize,
    /// Drop the store's cached pages after the layout write, before a buffered read job (as fio's
    /// `invalidate=1`, its default), so reads come from the disk; `--invalidate 0` reads what the
    /// page cache holds.
    #[arg(long, default_value = "true", action = clap::ArgAction::Set, value_parser = parse_bool01)]
    invalidate: bool,
    /// O_DIRECT segment files (`--direct` or `--direct=1`), bypassing the page cache.
    #[arg(long, default_value = "false", num_args = 0..=1, default_missing_value = "true", value_parser = parse_bool01)]
    direct: bool,
    /// Payload compression in the log.
    #[arg(long, value_enum, default_value = "none")]
    compress: CompressArg,
    /// Value contents.
    #[arg(long, value_enum, default_value = "random")]
    payload: Payload,
    /// Segment file size.
    #[arg(long, value_parser = parse_size, default_value = "64MiB")]
    segment_size: u64,
    /// Directory for the store (default: a new temporary directory, removed afterwards).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// Keep the store directory afterwards.
    #[arg(long)]
    keep: bool,
    /// Output format.
    #[arg(long, value_enum, default_value = "normal")]
    output_format: OutputFormat,
    /// fdatasync each segment as it is sealed (the log's default for embedded use). Off by default:
    /// a spill store does not need durability, and fio does not fsync unless asked either.
    #[arg(long)]
    durable: bool,
    /// Keys for `--rw open`'s index-memory measurement.
    #[arg(long, default_value_t = 1_000_000)]
    keys: u64,
    /// Internal: serve this store directory to peers (the sender process of `--rw transfer`).
    #[arg(long, hide = true)]
    serve_dir: Option<PathBuf>,
    /// Internal: with --serve-dir, use the copy path.
    #[arg(long, hide = true)]
    serve_copy: bool,
    /// Memory target of the store (store jobs).
    #[arg(long, value_parser = parse_size, default_value = "16MiB")]
    target: u64,
}

/// Latency and volume of one direction (read or write) of a job.
struct Side {
    hist: Histogram<u64>,
    bytes: u64,
    ops: u64,
}

impl Side {
    fn new() -> Self {
        Side { hist: Histogram::new_with_bounds(1, 60_000_000_000, 3).expect("histogram bounds"), bytes: 0, ops: 0 }
    }
    fn record(&mut self, ns: u64, bytes: u64) {
        self.hist.saturating_record(ns.max(1));
        self.bytes += bytes;
        self.ops += 1;
    }
    fn merge(&mut self, other: &Side) {
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

struct JobResult {
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

fn key(job: usize, i: u64) -> Vec<u8> {
    format!("j{job:03}-k{i:012}").into_bytes()
}

/// Run `rw` on `numjobs` threads, each over its own key range.
fn run_job(log: &Arc<SegmentLog<AutoBackend>>, args: &Args, rw: Rw, progress: bool, layout: bool) -> Result<JobResult> {
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
                    if args.iodepth > 1 && matches!(rw, Rw::Read | Rw::Randread) {
                        return depth::reads(&j, &mut rng);
                    }
                    if args.iodepth > 1 && matches!(rw, Rw::Write | Rw::Randwrite) {
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
                            Rw::Write | Rw::Randwrite => false,
                            Rw::Read | Rw::Randread => true,
                            Rw::SpillUnspill | Rw::Materialize | Rw::Transfer | Rw::Open => {
                                unreachable!("store and transfer jobs run elsewhere")
                            }
                            Rw::Randrw => rng.gen_range(0..100) < args.rwmixread,
                        };
                        let k = match rw {
                            Rw::Write | Rw::Read => key(job, seq_i),
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

/// Refuse options given on the command line that the job does not read, rather than ignore them.
fn check_options(matches: &ArgMatches, rw: Option<Rw>) -> Result<()> {
    const ANY: &[&str] = &["rw", "dir", "output_format", "size", "serve_dir", "serve_copy"];
    const LOG: &[&str] = &[
        "bs",
        "numjobs",
        "runtime",
        "time_based",
        "backend",
        "iodepth",
        "direct",
        "compress",
        "payload",
        "segment_size",
        "keep",
        "durable",
    ];
    // A log job reads --invalidate if it reads what a layout wrote, --rwmixread if it mixes.
    let log_job = |name: &'static str, invalidate: bool, mix: bool| {
        let mut used = LOG.to_vec();
        used.extend(invalidate.then_some("invalidate"));
        used.extend(mix.then_some("rwmixread"));
        (name, used)
    };
    let (job, used): (&str, Vec<&str>) = match rw {
        None => log_job("the default jobs", true, false),
        Some(Rw::Write) => log_job("write", false, false),
        Some(Rw::Read) => log_job("read", true, false),
        Some(Rw::Randread) => log_job("randread", true, false),
        Some(Rw::Randwrite) => log_job("randwrite", false, false),
        Some(Rw::Randrw) => log_job("randrw", true, true),
        Some(Rw::SpillUnspill) => (
            "spill-unspill",
            vec!["bs", "target", "loops", "batch", "written_back", "direct", "segment_size", "backend"],
        ),
        Some(Rw::Materialize) => ("materialize", vec!["bs", "numjobs", "segment_size"]),
        Some(Rw::Transfer) => ("transfer", vec!["bs"]),
        Some(Rw::Open) => ("open", vec!["keys"]),
    };
    let cmd = Args::command();
    for id in cmd.get_arguments().map(|a| a.get_id().as_str()) {
        if matches.value_source(id) == Some(ValueSource::CommandLine) && !ANY.contains(&id) && !used.contains(&id) {
            bail!("--{} does not apply to {job}", id.replace('_', "-"));
        }
    }
    Ok(())
}

fn main() -> Result<()> {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let matches = Args::command().get_matches();
    let args = Args::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    if let Some(dir) = &args.serve_dir {
        return transfer_job::serve(dir, args.serve_copy);
    }
    if args.bs == 0 || args.size == 0 || args.numjobs == 0 {
        bail!("--bs, --size and --numjobs must be positive");
    }
    check_options(&matches, args.rw)?;
    if args.rw == Some(Rw::Randrw) && args.iodepth > 1 {
        bail!("--iodepth above 1 is not supported for randrw (reads and writes would not mix in flight)");
    }
    let mut tmp = None;
    let dir = match &args.dir {
        Some(d) => d.clone(),
        None => {
            let t = tempfile::Builder::new()
                .prefix("spillway-bench-")
                .tempdir()
                .context("creating a temporary directory")?;
            let p = t.path().to_path_buf();
            tmp = Some(t);
            p
        }
    };
    let store_dir = dir.join("store");
    if matches!(args.rw, Some(Rw::Transfer | Rw::Open)) {
        std::fs::create_dir_all(&dir)?;
        let human = args.output_format == OutputFormat::Normal;
        let out = if args.rw == Some(Rw::Open) {
            open_job::run(args.keys, args.size, &dir, human)?
        } else {
            transfer_job::run(args.bs, args.size, &dir, human)?
        };
        if args.output_format == OutputFormat::Json {
            println!("{}", serde_json::to_string_pretty(&json!({"jobs": [out]}))?);
        }
        if let Some(t) = tmp {
            t.close().context("removing the temporary directory")?;
        }
        return Ok(());
    }
    if matches!(args.rw, Some(Rw::SpillUnspill | Rw::Materialize)) {
        std::fs::create_dir_all(&dir)?;
        let job = store_jobs::StoreJob {
            bs: args.bs,
            size: args.size,
            target: args.target,
            numjobs: args.numjobs,
            loops: args.loops,
            direct: args.direct,
            segment_size: args.segment_size,
            backend: args.backend.into(),
            batch: args.batch,
            written_back: args.written_back,
            dir: &dir,
            human: args.output_format == OutputFormat::Normal,
        };
        let out = if args.rw == Some(Rw::SpillUnspill) {
            store_jobs::spill_unspill(&job)?
        } else {
            store_jobs::materialize(&job)?
        };
        if args.output_format == OutputFormat::Json {
            println!("{}", serde_json::to_string_pretty(&json!({"jobs": [out]}))?);
        }
        if let Some(t) = tmp {
            t.close().context("removing the temporary directory")?;
        }
        return Ok(());
    }
    let opts = LogOptions {
        segment_bytes: args.segment_size,
        compression: match args.compress {
            CompressArg::None => Compression::None,
            CompressArg::Lz4 => Compression::Lz4,
        },
        durable: args.durable,
        ..Default::default()
    };
    let backend = AutoBackend::new(args.backend.into(), args.direct).context("starting the I/O backend")?;
    let backend_name = backend.name();
    let direct = backend.direct();
    let log = Arc::new(SegmentLog::open(backend, &store_dir, opts).context("opening the store")?);
    // Read and overwrite jobs need data: a write lays it out first. Like fio's layout phase it is
    // not one of the jobs asked for: it is reported apart (JSON: `spillway.layout`). The default set
    // runs two jobs, a write and a random read of what it wrote.
    let (jobs, laid_out): (Vec<Rw>, bool) = match args.rw {
        Some(Rw::Write) => (vec![Rw::Write], false),
        Some(rw) => (vec![Rw::Write, rw], true),
        None => (vec![Rw::Write, Rw::Randread], false),
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
        let layout = rw == Rw::Write && i + 1 < njobs;
        let mut r = run_job(&log, &args, rw, human, layout)?;
        if rw == Rw::Write {
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
    match (args.keep, tmp) {
        (true, Some(t)) => eprintln!("kept {}", t.keep().display()),
        (false, Some(t)) => t.close().context("removing the temporary directory")?,
        (true, None) => {}
        (false, None) => std::fs::remove_dir_all(&store_dir).context("removing the store")?,
    }
    Ok(())
}
