//! `spillway-bench`: a fio-like benchmark of the spillway engine.
//!
//! With no arguments it runs the default job set on a temporary directory (sequential write, then
//! random read of what was written) and prints a short human summary. Options follow fio's names and
//! typed sizes (`--bs 64KiB`, `--size 1GiB`); `--output-format json` prints fio-shaped JSON
//! (`jobs[].write.bw_bytes`, `iops`, `clat_ns.percentile`, ...) so fio tooling can read it.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::builder::PossibleValue;
use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, ValueEnum};
use serde_json::json;
use spillway::units::parse_size;
use spillway::BackendKind;

mod depth;
mod log_jobs;
mod open_job;
mod store_jobs;
mod transfer_job;

/// A job of a bare segment log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogOp {
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
}

/// The job `--rw` asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Job {
    /// A fio-like job on a bare segment log.
    Log(LogOp),
    /// Store: put values far beyond `--target`, get them back in random order; file-per-key baseline.
    SpillUnspill,
    /// Store: `--numjobs` threads get the same serialized keys; deserializations must equal keys.
    Materialize,
    /// Peer transfer of spilled values over 127.0.0.1: splice vs copy, throughput and peak RSS.
    Transfer,
    /// Scale: index memory per key (`--keys`) and the open time of a `--size` store.
    Open,
}

impl Job {
    const ALL: [Job; 9] = [
        Job::Log(LogOp::Write),
        Job::Log(LogOp::Read),
        Job::Log(LogOp::Randread),
        Job::Log(LogOp::Randwrite),
        Job::Log(LogOp::Randrw),
        Job::SpillUnspill,
        Job::Materialize,
        Job::Transfer,
        Job::Open,
    ];

    /// Its `--rw` name and help.
    fn describe(self) -> (&'static str, &'static str) {
        match self {
            Job::Log(LogOp::Write) => ("write", "Sequential writes of new keys."),
            Job::Log(LogOp::Read) => ("read", "Reads of every key in write order (laid out by a write first)."),
            Job::Log(LogOp::Randread) => ("randread", "Reads of random keys."),
            Job::Log(LogOp::Randwrite) => ("randwrite", "Overwrites of random keys."),
            Job::Log(LogOp::Randrw) => ("randrw", "Random mix of reads and overwrites (--rwmixread percent reads)."),
            Job::SpillUnspill => {
                ("spill-unspill", "Store: put values far beyond --target, get them back; file-per-key baseline.")
            }
            Job::Materialize => ("materialize", "Store: --numjobs threads get the same serialized keys."),
            Job::Transfer => ("transfer", "Peer transfer of spilled values over 127.0.0.1: splice vs copy."),
            Job::Open => ("open", "Scale: index memory per key (--keys) and the open time of a --size store."),
        }
    }
}

impl ValueEnum for Job {
    fn value_variants<'a>() -> &'a [Self] {
        &Job::ALL
    }
    fn to_possible_value(&self) -> Option<PossibleValue> {
        let (name, help) = self.describe();
        Some(PossibleValue::new(name).help(help))
    }
}

/// `--backend`: auto, uring or portable (the engine's own names).
fn parse_backend(s: &str) -> Result<BackendKind, String> {
    match s.parse()? {
        BackendKind::Sim => Err("the simulated backend is for tests, not benchmarks".into()),
        kind => Ok(kind),
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
    rw: Option<Job>,
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
    /// I/O backend: auto (io_uring where available, else portable, logging why), uring (an error
    /// where unavailable) or portable (blocking pread/pwrite).
    #[arg(long, default_value = "auto", value_parser = parse_backend)]
    backend: BackendKind,
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
    /// Open the log as a spill store's: discard what the directory holds, and reuse the files of
    /// deleted segments for new ones (`LogOptions::recycle_segments`) with `--recycle-segments 1`
    /// (the default), or unlink them and create new ones with `--recycle-segments 0`.
    #[arg(long)]
    spill_log: bool,
    /// With `--spill-log`: reuse the files of deleted segments (1) or not (0).
    #[arg(long, default_value = "true", action = clap::ArgAction::Set, value_parser = parse_bool01)]
    recycle_segments: bool,
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

/// Refuse options given on the command line that the job does not read, rather than ignore them.
fn check_options(matches: &ArgMatches, rw: Option<Job>) -> Result<()> {
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
        "spill_log",
        "recycle_segments",
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
        Some(Job::Log(LogOp::Write)) => log_job("write", false, false),
        Some(Job::Log(LogOp::Read)) => log_job("read", true, false),
        Some(Job::Log(LogOp::Randread)) => log_job("randread", true, false),
        Some(Job::Log(LogOp::Randwrite)) => log_job("randwrite", false, false),
        Some(Job::Log(LogOp::Randrw)) => log_job("randrw", true, true),
        Some(Job::SpillUnspill) => (
            "spill-unspill",
            vec!["bs", "target", "loops", "batch", "written_back", "direct", "segment_size", "backend"],
        ),
        Some(Job::Materialize) => ("materialize", vec!["bs", "numjobs", "segment_size"]),
        Some(Job::Transfer) => ("transfer", vec!["bs"]),
        Some(Job::Open) => ("open", vec!["keys"]),
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
    if matches.value_source("recycle_segments") == Some(ValueSource::CommandLine) && !args.spill_log {
        bail!("--recycle-segments applies only with --spill-log");
    }
    if args.rw == Some(Job::Log(LogOp::Randrw)) && args.iodepth > 1 {
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
    let human = args.output_format == OutputFormat::Normal;
    let out = match args.rw {
        Some(Job::Open) => {
            std::fs::create_dir_all(&dir)?;
            Some(open_job::run(args.keys, args.size, &dir, human)?)
        }
        Some(Job::Transfer) => {
            std::fs::create_dir_all(&dir)?;
            Some(transfer_job::run(args.bs, args.size, &dir, human)?)
        }
        Some(job @ (Job::SpillUnspill | Job::Materialize)) => {
            std::fs::create_dir_all(&dir)?;
            let store_job = store_jobs::StoreJob {
                bs: args.bs,
                size: args.size,
                target: args.target,
                numjobs: args.numjobs,
                loops: args.loops,
                direct: args.direct,
                segment_size: args.segment_size,
                backend: args.backend,
                batch: args.batch,
                written_back: args.written_back,
                dir: &dir,
                human,
            };
            Some(if job == Job::SpillUnspill {
                store_jobs::spill_unspill(&store_job)?
            } else {
                store_jobs::materialize(&store_job)?
            })
        }
        Some(Job::Log(op)) => {
            log_jobs::run(&args, Some(op), &store_dir)?;
            None
        }
        None => {
            log_jobs::run(&args, None, &store_dir)?;
            None
        }
    };
    if let Some(out) = out {
        // The store, transfer and open jobs print their own summary; JSON wraps it as fio's does.
        if !human {
            println!("{}", serde_json::to_string_pretty(&json!({"jobs": [out]}))?);
        }
        if let Some(t) = tmp {
            t.close().context("removing the temporary directory")?;
        }
        return Ok(());
    }
    match (args.keep, tmp) {
        (true, Some(t)) => eprintln!("kept {}", t.keep().display()),
        (false, Some(t)) => t.close().context("removing the temporary directory")?,
        (true, None) => {}
        (false, None) => std::fs::remove_dir_all(&store_dir).context("removing the store")?,
    }
    Ok(())
}
