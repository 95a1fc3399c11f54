//! `spillway`: the admin command of a spillway store.
//!
//! Every command opens the store, which runs recovery, so a crash between two commands is repaired by
//! the next one. Exit codes: 0 success; 1 error (including corruption, named by segment and offset);
//! 2 key not found (and command-line usage errors).

use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use spillway::units::{format_size, parse_size};
use spillway::{AutoBackend, BackendKind, Frames, LogOptions, SegmentLog};

#[derive(Parser)]
#[command(name = "spillway", version, about = "Inspect and edit a spillway store")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Store a value (from FILE, or stdin) under KEY, creating the store if needed.
    Put {
        /// Store directory.
        dir: PathBuf,
        /// Key (bytes of the argument).
        key: std::ffi::OsString,
        /// File holding the value; stdin when absent.
        file: Option<PathBuf>,
        /// fdatasync before exiting: the value survives power loss once the command returns 0.
        #[arg(long)]
        sync: bool,
        /// Size of new segment files (e.g. 64MiB).
        #[arg(long, value_parser = parse_size, default_value = "64MiB")]
        segment_size: u64,
    },
    /// Write the value of KEY to stdout.
    Get {
        /// Store directory.
        dir: PathBuf,
        /// Key.
        key: std::ffi::OsString,
    },
    /// Delete KEY.
    Rm {
        /// Store directory.
        dir: PathBuf,
        /// Key.
        key: std::ffi::OsString,
        /// fdatasync before exiting.
        #[arg(long)]
        sync: bool,
    },
    /// List keys, one per line.
    Ls {
        /// Store directory.
        dir: PathBuf,
    },
    /// Relocate live records out of sparse segments and delete dead ones.
    Compact {
        /// Store directory.
        dir: PathBuf,
    },
    /// Check every record's checksums; exit 1 listing each damaged record.
    Verify {
        /// Store directory.
        dir: PathBuf,
    },
    /// Serve the store in DIR to peers (see `spillway fetch`) until killed. Values of 8 MiB or more
    /// are sent with splice (file -> pipe -> socket, never read into memory); smaller ones are copied.
    /// Requests must carry the server's token: --token, else $SPILLWAY_TOKEN, else a fresh one,
    /// printed as "token HEX" after the address.
    Serve {
        /// Store directory.
        dir: PathBuf,
        /// Address to listen on (port 0 picks a free port; the bound address is printed).
        #[arg(long, default_value = "127.0.0.1:7878")]
        listen: String,
        /// Allow listening on a non-loopback address (requests are authenticated, but nothing is
        /// encrypted: the token and the values cross the network in the clear).
        #[arg(long)]
        allow_remote: bool,
        /// The token requests must carry (48 hex digits, as `serve` prints it).
        #[arg(long, env = "SPILLWAY_TOKEN", hide_env_values = true)]
        token: Option<String>,
        /// Read each value into memory and write it, instead of splicing it (for comparison).
        #[arg(long)]
        copy: bool,
    },
    /// Fetch KEY from a server: to stdout, or with --into DIR2 straight into the store at DIR2.
    Fetch {
        /// Server address (host:port).
        addr: String,
        /// Key.
        key: std::ffi::OsString,
        /// Store the value into this store directory (created if needed) instead of printing it.
        #[arg(long)]
        into: Option<PathBuf>,
        /// Connect, read and write timeout in seconds.
        #[arg(long, default_value_t = 30)]
        timeout: u64,
        /// The server's token (as `serve` prints it).
        #[arg(long, env = "SPILLWAY_TOKEN", hide_env_values = true)]
        token: String,
    },
    /// Segments, records, live and dead bytes.
    Stats {
        /// Store directory.
        dir: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

/// A failure with its own exit code.
struct Exit(u8);

fn open(dir: &Path, create: bool, segment_bytes: Option<u64>) -> Result<SegmentLog<AutoBackend>> {
    let mut opts = LogOptions { create_if_missing: create, ..Default::default() };
    if let Some(s) = segment_bytes {
        opts.segment_bytes = s;
    }
    // io_uring where the kernel allows it (`SPILLWAY_BACKEND=portable` forces the portable backend).
    let backend = AutoBackend::new(BackendKind::Auto, false).context("starting the I/O backend")?;
    let log = SegmentLog::open(backend, dir, opts).with_context(|| format!("opening {}", dir.display()))?;
    let r = log.recovery_report();
    if r.truncated_bytes > 0 {
        eprintln!("spillway: recovery cut a torn tail of {} bytes", r.truncated_bytes);
    }
    Ok(log)
}

fn run(cli: Cli) -> Result<Option<Exit>> {
    match cli.cmd {
        Cmd::Put { dir, key, file, sync, segment_size } => {
            let mut value = Vec::new();
            match &file {
                Some(f) => {
                    value = std::fs::read(f).with_context(|| format!("reading {}", f.display()))?;
                }
                None => {
                    io::stdin().lock().read_to_end(&mut value).context("reading stdin")?;
                }
            }
            let log = open(&dir, true, Some(segment_size))?;
            log.put(key.as_bytes(), &Frames::from(value))?;
            if sync {
                log.sync()?;
            }
        }
        Cmd::Get { dir, key } => {
            let log = open(&dir, false, None)?;
            match log.get(key.as_bytes())? {
                Some(frames) => {
                    let mut out = io::stdout().lock();
                    for f in frames.iter() {
                        out.write_all(f).context("writing stdout")?;
                    }
                    out.flush().context("writing stdout")?;
                }
                None => {
                    eprintln!("spillway: key {:?} not found", key);
                    return Ok(Some(Exit(2)));
                }
            }
        }
        Cmd::Rm { dir, key, sync } => {
            let log = open(&dir, false, None)?;
            let existed = log.delete(key.as_bytes())?;
            if sync {
                log.sync()?;
            }
            if !existed {
                eprintln!("spillway: key {:?} not found", key);
                return Ok(Some(Exit(2)));
            }
        }
        Cmd::Ls { dir } => {
            let log = open(&dir, false, None)?;
            let mut out = io::stdout().lock();
            for k in log.keys() {
                out.write_all(&k).and_then(|_| out.write_all(b"\n")).context("writing stdout")?;
            }
            out.flush().context("writing stdout")?;
        }
        Cmd::Compact { dir } => {
            let log = open(&dir, false, None)?;
            let c = log.compact()?;
            log.sync()?;
            println!(
                "compacted {} segment(s), moved {} record(s) ({}), deleted {} segment(s), freed {}",
                c.segments_compacted,
                c.records_moved,
                format_size(c.bytes_moved),
                c.segments_deleted,
                format_size(c.bytes_freed)
            );
        }
        Cmd::Verify { dir } => {
            let log = open(&dir, false, None)?;
            let problems = log.verify()?;
            let n = log.stats().records;
            if problems.is_empty() {
                println!("ok: {n} record(s) verified");
            } else {
                for p in &problems {
                    let key =
                        p.key.as_ref().map(|k| format!(" key {:?}", String::from_utf8_lossy(k))).unwrap_or_default();
                    println!("segment {} offset {}{key}: {}", p.segment, p.offset, p.error);
                }
                eprintln!("spillway: {} damaged record(s) or region(s)", problems.len());
                return Ok(Some(Exit(1)));
            }
        }
        Cmd::Serve { dir, listen, allow_remote, copy, token } => {
            let addrs: Vec<std::net::SocketAddr> = std::net::ToSocketAddrs::to_socket_addrs(&listen)
                .with_context(|| format!("resolving {listen}"))?
                .collect();
            if !allow_remote {
                if let Some(a) = addrs.iter().find(|a| !a.ip().is_loopback()) {
                    eprintln!(
                        "spillway: refusing to listen on non-loopback address {a} without --allow-remote (the protocol is not encrypted)"
                    );
                    return Ok(Some(Exit(2)));
                }
            }
            let ticket = match &token {
                Some(t) => spillway::transfer::Ticket::from_hex(t).context("reading --token")?,
                None => spillway::transfer::Ticket::standing()?,
            };
            let log = std::sync::Arc::new(open(&dir, false, None)?);
            let access = std::sync::Arc::new(spillway::transfer::Access::standing(log, ticket).context("--token")?);
            let listener = std::net::TcpListener::bind(&addrs[..]).with_context(|| format!("listening on {listen}"))?;
            let bound = listener.local_addr().context("reading the bound address")?;
            println!("listening on {bound}");
            if token.is_none() {
                println!("token {}", ticket.to_hex());
            }
            io::stdout().flush().context("writing stdout")?;
            let opts = spillway::transfer::TransferOptions { copy, ..Default::default() };
            spillway::transfer::serve(access, listener, opts)?;
        }
        Cmd::Fetch { addr, key, into, timeout, token } => {
            let ticket = spillway::transfer::Ticket::from_hex(&token).context("reading --token")?;
            let opts = spillway::transfer::TransferOptions {
                timeout: std::time::Duration::from_secs(timeout.max(1)),
                ..Default::default()
            };
            let mut client = spillway::transfer::Client::connect(&addr, ticket, opts)
                .with_context(|| format!("connecting to {addr}"))?;
            let found = match into {
                Some(dir2) => {
                    let log = open(&dir2, true, None)?;
                    let found = client.get_into(key.as_bytes(), &log, key.as_bytes())?;
                    log.sync()?;
                    found
                }
                None => {
                    let mut out = io::stdout().lock();
                    let found = client.get_to(key.as_bytes(), &mut out)?;
                    out.flush().context("writing stdout")?;
                    found
                }
            };
            if !found {
                eprintln!("spillway: key {:?} not found on {addr}", key);
                return Ok(Some(Exit(2)));
            }
        }
        Cmd::Stats { dir, json } => {
            let log = open(&dir, false, None)?;
            let s = log.stats();
            if json {
                let v = serde_json::json!({
                    "segments": s.segments,
                    "sealed_segments": s.sealed_segments,
                    "records": s.records,
                    "live_records": s.live_records,
                    "tombstones": s.tombstones,
                    "live_bytes": s.live_bytes,
                    "dead_bytes": s.dead_bytes,
                    "used_bytes": s.used_bytes,
                    "disk_bytes": s.disk_bytes,
                });
                println!("{v}");
            } else {
                println!("segments:      {} ({} sealed)", s.segments, s.sealed_segments);
                println!("records:       {} ({} live keys, {} tombstones)", s.records, s.live_records, s.tombstones);
                println!("live bytes:    {}", format_size(s.live_bytes));
                println!("dead bytes:    {}", format_size(s.dead_bytes));
                println!("disk bytes:    {}", format_size(s.disk_bytes));
            }
        }
    }
    Ok(None)
}

fn main() -> ExitCode {
    env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("warn")).init();
    let cli = Cli::parse();
    match run(cli) {
        Ok(None) => ExitCode::SUCCESS,
        Ok(Some(Exit(code))) => ExitCode::from(code),
        Err(e) => {
            // Broken pipe on stdout (e.g. `| head`) is not worth a message.
            if e.chain().any(|c| c.downcast_ref::<io::Error>().is_some_and(|io| io.kind() == io::ErrorKind::BrokenPipe))
            {
                return ExitCode::from(1);
            }
            eprintln!("spillway: {e:#}");
            ExitCode::from(1)
        }
    }
}
