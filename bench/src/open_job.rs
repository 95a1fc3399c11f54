//! `--rw open`: the scale numbers of the segment log.
//!
//! 1. Index memory: put `--keys` keys (16-byte keys, 64-byte values), reopen the store, and report the
//!    process's RSS growth across the reopen (the index rebuilt from footers, nothing else; freed heap
//!    returned with `malloc_trim` before both readings) per key, minus the key's own length. Target:
//!    <= 100 bytes per key plus the key.
//! 2. Open time: write `--size` of 1 MiB values, sync, close, and time a reopen. Sealed segments are
//!    opened from their footers, so the time follows the number of segments, not the bytes.

use std::path::Path;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::json;
use spillway::units::format_size;
use spillway::{AutoBackend, BackendKind, Frames, LogOptions, SegmentLog};

fn rss_bytes() -> Result<u64> {
    let s = std::fs::read_to_string("/proc/self/status").context("reading /proc/self/status")?;
    let kib: u64 = s
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .context("VmRSS missing")?
        .parse()?;
    Ok(kib * 1024)
}

/// Give free heap memory back to the system (glibc keeps it otherwise), so RSS measures live memory.
fn trim() {
    // SAFETY: malloc_trim only releases free memory of the allocator; it has no preconditions.
    unsafe {
        libc::malloc_trim(0);
    }
}

fn open(dir: &Path) -> Result<SegmentLog<AutoBackend>> {
    let opts = LogOptions { durable: false, ..Default::default() };
    Ok(SegmentLog::open(AutoBackend::new(BackendKind::Auto, false)?, dir, opts)?)
}

pub(crate) fn run(keys: u64, size: u64, dir: &Path, human: bool) -> Result<serde_json::Value> {
    // 1. Index memory per key.
    let idx_dir = dir.join("index");
    {
        let log = open(&idx_dir)?;
        let value = Frames::from(vec![7u8; 64]);
        let batch = 1024u64;
        let mut i = 0;
        while i < keys {
            let n = batch.min(keys - i);
            let ks: Vec<Vec<u8>> = (i..i + n).map(|j| format!("key-{j:012}").into_bytes()).collect();
            let items: Vec<(&[u8], &Frames)> = ks.iter().map(|k| (&k[..], &value)).collect();
            log.put_many(&items)?;
            i += n;
        }
        log.sync()?;
    }
    trim();
    let before = rss_bytes()?;
    let t = Instant::now();
    let log = open(&idx_dir)?;
    let index_open_s = t.elapsed().as_secs_f64();
    // Opening reads every footer into temporary tables; return their freed memory to the system so
    // RSS shows what stays: the index.
    trim();
    let after = rss_bytes()?;
    assert_eq!(log.len() as u64, keys, "every key is back after reopen");
    let per_key = (after.saturating_sub(before)) as f64 / keys as f64;
    let key_len = 16.0;
    drop(log);
    std::fs::remove_dir_all(&idx_dir)?;
    if human {
        println!(
            "index: {keys} keys: RSS +{} after reopen = {per_key:.1} B/key ({:.1} B/key beyond the 16-byte key; target <= 100); reopen {index_open_s:.2} s",
            format_size(after.saturating_sub(before)),
            per_key - key_len
        );
    }

    // 2. Open time of a large store.
    let big_dir = dir.join("big");
    let n = (size >> 20).max(1);
    let t = Instant::now();
    {
        let log = open(&big_dir)?;
        let value = Frames::from(vec![0x5au8; 1 << 20]);
        for i in 0..n {
            log.put(format!("v{i:08}").as_bytes(), &value)?;
        }
        log.sync()?;
    }
    let write_s = t.elapsed().as_secs_f64();
    let t = Instant::now();
    let log = open(&big_dir)?;
    let open_s = t.elapsed().as_secs_f64();
    let stats = log.stats();
    assert_eq!(log.len() as u64, n);
    drop(log);
    std::fs::remove_dir_all(&big_dir)?;
    if human {
        println!(
            "open: {} in {} segment(s) (written in {write_s:.1} s) reopened in {:.3} s (target <= 1 s for 10 GiB)",
            format_size(n << 20),
            stats.segments,
            open_s
        );
    }
    Ok(json!({
        "jobname": "open",
        "index": {"keys": keys, "rss_growth_bytes": after.saturating_sub(before), "bytes_per_key": per_key,
                  "bytes_per_key_beyond_key": per_key - key_len, "reopen_seconds": index_open_s},
        "open": {"bytes": n << 20, "segments": stats.segments, "open_seconds": open_s, "write_seconds": write_s},
    }))
}
