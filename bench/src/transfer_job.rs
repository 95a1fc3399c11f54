//! `--rw transfer`: send spilled values of `--bs` from a sender store to a receiver over 127.0.0.1,
//! once with splice and once with the copy path, and report throughput and both sides' peak RSS
//! growth.
//!
//! The sender is a child process (`spillway-bench --serve-dir DIR`), so its memory is measured
//! alone: before each run its peak-RSS counter is reset (`/proc/PID/clear_refs` = 5) and afterwards
//! `VmHWM - VmRSS(before)` is its growth. The receiver (this process) stores each value straight
//! into its own segment log (`Client::get_into`), and its growth is measured the same way.

use std::io::BufRead;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use rand::{RngCore, SeedableRng};
use serde_json::json;
use spillway::transfer::{Access, Client, Ticket, TransferOptions};
use spillway::units::format_size;
use spillway::{AutoBackend, BackendKind, Frames, LogOptions, SegmentLog};

fn status_kib(pid: &str, field: &str) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).context("reading /proc status")?;
    let line = s.lines().find(|l| l.starts_with(field)).with_context(|| format!("{field} missing"))?;
    Ok(line.split_whitespace().nth(1).context("malformed status line")?.parse()?)
}

fn reset_peak(pid: &str) -> Result<()> {
    std::fs::write(format!("/proc/{pid}/clear_refs"), "5").context("resetting the peak RSS (clear_refs)")
}

struct Server(Child, String);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_server(dir: &Path, copy: bool, ticket: &Ticket) -> Result<Server> {
    let exe = std::env::current_exe()?;
    let mut cmd = Command::new(exe);
    cmd.arg("--serve-dir").arg(dir).stdout(Stdio::piped()).env("SPILLWAY_TOKEN", ticket.to_hex());
    if copy {
        cmd.arg("--serve-copy");
    }
    let mut child = cmd.spawn().context("starting the sender process")?;
    let mut line = String::new();
    std::io::BufReader::new(child.stdout.take().context("sender stdout")?).read_line(&mut line)?;
    let Some(addr) = line.trim().strip_prefix("listening on ") else {
        let _ = child.kill();
        bail!("the sender did not start: {line:?}");
    };
    Ok(Server(child, addr.to_string()))
}

/// The child side: serve `dir` until killed, to requests with the ticket in `$SPILLWAY_TOKEN`.
pub(crate) fn serve(dir: &Path, copy: bool) -> Result<()> {
    let ticket = Ticket::from_hex(&std::env::var("SPILLWAY_TOKEN").context("SPILLWAY_TOKEN")?)?;
    let log = SegmentLog::open(AutoBackend::new(BackendKind::Auto, false)?, dir, LogOptions::default())?;
    let access = std::sync::Arc::new(Access::standing(std::sync::Arc::new(log), ticket)?);
    let listener = std::net::TcpListener::bind("127.0.0.1:0")?;
    println!("listening on {}", listener.local_addr()?);
    use std::io::Write;
    std::io::stdout().flush()?;
    // Pure paths for the comparison: splice every value (the server default copies values under 8 MiB).
    let opts = TransferOptions { copy, max_value_bytes: 1 << 40, splice_min_bytes: 0, ..Default::default() };
    spillway::transfer::serve(access, listener, opts)?;
    Ok(())
}

pub(crate) fn run(bs: u64, size: u64, dir: &Path, human: bool) -> Result<serde_json::Value> {
    let n = (size / bs).max(1);
    let src = dir.join("sender");
    {
        let log = SegmentLog::open(AutoBackend::new(BackendKind::Auto, false)?, &src, LogOptions::default())?;
        let mut rng = rand::rngs::SmallRng::seed_from_u64(7);
        let mut v = vec![0u8; bs as usize];
        rng.fill_bytes(&mut v);
        let frames = Frames::from(v);
        for i in 0..n {
            log.put(format!("v{i}").as_bytes(), &frames)?;
        }
        log.sync()?;
    }
    if human {
        println!(
            "transfer: {n} spilled value(s) of {} from a sender process to this one over 127.0.0.1",
            format_size(bs)
        );
    }
    let mut out = Vec::new();
    let me = std::process::id().to_string();
    for (path, copy) in [("splice", false), ("copy", true)] {
        let ticket = Ticket::standing()?;
        let server = start_server(&src, copy, &ticket)?;
        let pid = server.0.id().to_string();
        let dst = dir.join(format!("receiver-{path}"));
        let into = SegmentLog::open(AutoBackend::new(BackendKind::Auto, false)?, &dst, LogOptions::default())?;
        let opts = TransferOptions { max_value_bytes: 1 << 40, ..Default::default() };
        let mut client = Client::connect(&server.1, ticket, opts)?;
        let (s_before, r_before) = (status_kib(&pid, "VmRSS:")?, status_kib(&me, "VmRSS:")?);
        reset_peak(&pid)?;
        reset_peak(&me)?;
        let t = Instant::now();
        for i in 0..n {
            let k = format!("v{i}");
            if !client.get_into(k.as_bytes(), &into, k.as_bytes())? {
                bail!("key {k} missing on the sender");
            }
        }
        let secs = t.elapsed().as_secs_f64();
        let s_growth = status_kib(&pid, "VmHWM:")?.saturating_sub(s_before) * 1024;
        let r_growth = status_kib(&me, "VmHWM:")?.saturating_sub(r_before) * 1024;
        let bytes = n * bs;
        if human {
            println!(
                "  {path:<6} {:>10}/s  sender peak RSS growth {:>10}  receiver peak RSS growth {:>10}",
                format_size((bytes as f64 / secs) as u64),
                format_size(s_growth),
                format_size(r_growth)
            );
        }
        out.push(json!({
            "path": path, "values": n, "bs": bs, "bytes": bytes, "seconds": secs,
            "bw_bytes": (bytes as f64 / secs) as u64,
            "sender_peak_rss_growth_bytes": s_growth, "receiver_peak_rss_growth_bytes": r_growth,
        }));
        drop(into);
        std::fs::remove_dir_all(&dst)?;
    }
    std::fs::remove_dir_all(&src)?;
    let ratio = out[0]["bw_bytes"].as_f64().unwrap_or(0.0) / out[1]["bw_bytes"].as_f64().unwrap_or(1.0).max(1.0);
    if human {
        println!("  splice / copy throughput: {ratio:.2}x");
    }
    Ok(json!({"jobname": "transfer", "runs": out, "splice_over_copy": ratio}))
}
