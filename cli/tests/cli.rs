//! Black-box tests of the `spillway` admin command: the exact interface users and scripts rely on,
//! and bad input of every kind (none of which may panic).

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

fn spillway(args: &[&str], stdin: Option<&[u8]>) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_spillway"));
    cmd.args(args).stdin(Stdio::piped()).stdout(Stdio::piped()).stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("run spillway");
    let mut pipe = child.stdin.take().unwrap();
    if let Some(data) = stdin {
        pipe.write_all(data).unwrap();
    }
    drop(pipe);
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "spillway {args:?} panicked: {stderr}");
    out
}

fn code(o: &Output) -> i32 {
    o.status.code().expect("exited normally, not by a signal")
}

fn d(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn put_get_ls_rm_round_trip() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let s = d(&dir);
    assert_eq!(code(&spillway(&["put", s, "alpha", "--segment-size", "64KiB"], Some(b"from stdin"))), 0);
    let file = tmp.path().join("value.bin");
    let big: Vec<u8> = (0..300_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&file, &big).unwrap();
    assert_eq!(code(&spillway(&["put", s, "beta", d(&file), "--sync"], None)), 0);
    assert_eq!(code(&spillway(&["put", s, "empty"], Some(b""))), 0);

    let o = spillway(&["get", s, "alpha"], None);
    assert_eq!((code(&o), o.stdout.as_slice()), (0, &b"from stdin"[..]));
    let o = spillway(&["get", s, "beta"], None);
    assert_eq!(code(&o), 0);
    assert!(o.stdout == big, "a 300 KB value (larger than a segment) must round-trip");
    let o = spillway(&["get", s, "empty"], None);
    assert_eq!((code(&o), o.stdout.len()), (0, 0));

    let o = spillway(&["ls", s], None);
    assert_eq!(String::from_utf8(o.stdout).unwrap(), "alpha\nbeta\nempty\n");

    let o = spillway(&["get", s, "missing"], None);
    assert_eq!(code(&o), 2);
    assert!(String::from_utf8_lossy(&o.stderr).contains("not found"));

    assert_eq!(code(&spillway(&["rm", s, "alpha", "--sync"], None)), 0);
    assert_eq!(code(&spillway(&["rm", s, "alpha"], None)), 2);
    assert_eq!(code(&spillway(&["get", s, "alpha"], None)), 2);
    let o = spillway(&["ls", s], None);
    assert_eq!(String::from_utf8(o.stdout).unwrap(), "beta\nempty\n");

    let o = spillway(&["stats", s, "--json"], None);
    assert_eq!(code(&o), 0);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["live_records"], 2);
    assert!(v["dead_bytes"].as_u64().unwrap() > 0, "the removed value and its tombstone are dead bytes");
    assert_eq!(code(&spillway(&["stats", s], None)), 0);
    let o = spillway(&["compact", s], None);
    assert_eq!(code(&o), 0, "{}", String::from_utf8_lossy(&o.stderr));
    let o = spillway(&["verify", s], None);
    assert_eq!(code(&o), 0, "{}", String::from_utf8_lossy(&o.stdout));
    let o = spillway(&["get", s, "beta"], None);
    assert!(o.stdout == big);
}

#[test]
fn corruption_is_reported_with_segment_and_offset() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let s = d(&dir);
    let marker = b"MARKER-0123456789-MARKER-0123456789";
    assert_eq!(code(&spillway(&["put", s, "good", "--segment-size", "64KiB"], Some(b"fine value"))), 0);
    assert_eq!(code(&spillway(&["put", s, "bad", "--sync"], Some(marker))), 0);
    let seg = std::fs::read_dir(dir.join("segments")).unwrap().next().unwrap().unwrap().path();
    let mut bytes = std::fs::read(&seg).unwrap();
    let at = bytes.windows(marker.len()).position(|w| w == marker).unwrap();
    bytes[at + 3] ^= 0x10;
    std::fs::write(&seg, &bytes).unwrap();

    let o = spillway(&["get", s, "bad"], None);
    assert_eq!(code(&o), 1);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("segment 1") && err.contains("offset"), "{err}");
    let o = spillway(&["get", s, "good"], None);
    assert_eq!((code(&o), o.stdout.as_slice()), (0, &b"fine value"[..]));
    let o = spillway(&["verify", s], None);
    assert_eq!(code(&o), 1);
    let listing = String::from_utf8_lossy(&o.stdout);
    assert!(listing.contains("segment 1 offset") && listing.contains("bad"), "{listing}");
}

#[test]
fn a_torn_tail_from_a_crash_is_recovered_by_the_next_command() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let s = d(&dir);
    assert_eq!(code(&spillway(&["put", s, "kept", "--segment-size", "64KiB"], Some(b"kept value"))), 0);
    assert_eq!(code(&spillway(&["put", s, "torn"], Some(&[9u8; 5000]))), 0);
    let seg = std::fs::read_dir(dir.join("segments")).unwrap().next().unwrap().unwrap().path();
    let bytes = std::fs::read(&seg).unwrap();
    let end = bytes.iter().rposition(|&b| b == 9).unwrap();
    // Zero the second half of the last record, as an interrupted write would leave it.
    let mut torn = bytes.clone();
    torn[end - 2500..=end].fill(0);
    std::fs::write(&seg, &torn).unwrap();
    let o = spillway(&["ls", s], None);
    assert_eq!(String::from_utf8_lossy(&o.stdout), "kept\n");
    assert_eq!(code(&spillway(&["get", s, "torn"], None)), 2);
    assert_eq!(code(&spillway(&["verify", s], None)), 0);
    assert_eq!(code(&spillway(&["put", s, "next"], Some(b"n"))), 0);
    let o = spillway(&["ls", s], None);
    assert_eq!(String::from_utf8_lossy(&o.stdout), "kept\nnext\n");
}

#[test]
fn bad_input_gets_clear_errors_never_panics() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    // A directory that does not exist.
    let o = spillway(&["get", d(&t.join("nope")), "k"], None);
    assert_eq!(code(&o), 1);
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a spillway store"));
    for cmd in ["ls", "verify", "stats", "compact"] {
        assert_eq!(code(&spillway(&[cmd, d(&t.join("nope"))], None)), 1, "{cmd}");
    }
    // A file where the store directory should be.
    std::fs::write(t.join("afile"), b"x").unwrap();
    assert_eq!(code(&spillway(&["put", d(&t.join("afile")), "k"], Some(b"v"))), 1);
    assert_eq!(code(&spillway(&["ls", d(&t.join("afile"))], None)), 1);
    // A key over the limit.
    let dir = t.join("store");
    let s = d(&dir);
    let huge = "k".repeat(70_000);
    let o = spillway(&["put", s, &huge], Some(b"v"));
    assert_eq!(code(&o), 1);
    assert!(String::from_utf8_lossy(&o.stderr).contains("exceeds the limit"));
    assert_eq!(code(&spillway(&["put", s, "ok", "--segment-size", "64KiB"], Some(b"v"))), 0);
    // Garbage in the store: stray files, a segment-named file of junk, a truncated copy, a directory.
    std::fs::write(dir.join("README"), b"hello").unwrap();
    std::fs::write(dir.join("segments").join("notes.txt"), b"hello").unwrap();
    std::fs::write(dir.join("segments").join("000000a0.seg"), vec![0xA5u8; 10_000]).unwrap();
    std::fs::write(dir.join("segments").join("000000a1.seg"), b"").unwrap();
    std::fs::create_dir(dir.join("segments").join("000000a2.seg")).unwrap();
    let first = dir.join("segments").join("00000001.seg");
    let mut half = std::fs::read(&first).unwrap();
    half.truncate(3000);
    std::fs::write(dir.join("segments").join("00000090.seg"), &half).unwrap();
    for args in [vec!["ls", s], vec!["get", s, "ok"], vec!["stats", s], vec!["verify", s], vec!["compact", s]] {
        let o = spillway(&args, None);
        assert!(code(&o) <= 2, "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
    }
    let o = spillway(&["get", s, "ok"], None);
    assert_eq!((code(&o), o.stdout.as_slice()), (0, &b"v"[..]));
    // Unknown flags and missing arguments are usage errors.
    assert_eq!(code(&spillway(&["get", s], None)), 2);
    assert_eq!(code(&spillway(&["frobnicate"], None)), 2);
}
