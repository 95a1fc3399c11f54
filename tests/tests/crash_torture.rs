//! Crash torture: a child process writes and syncs records in a loop and reports each acknowledged key
//! on stdout; the parent kills it with SIGKILL after a random number of acknowledgements (so the kill
//! lands at a random point of the next put/sync), reopens the store, and checks that every key ever
//! acknowledged reads back exactly, that no key returns wrong bytes, and that `verify` is clean. The
//! next cycle's child reopens the same store, so recovery runs after every kill. The seed is printed;
//! `SPILLWAY_TORTURE_SEED=<n>` reproduces a run.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use spillway::{LogOptions, PortableBackend, SegmentLog};
use spillway_tests::{child_arg, frames_for, Rng};

fn opts() -> LogOptions {
    LogOptions { segment_bytes: 256 * 1024, ..Default::default() }
}

fn size_of(key: &str) -> usize {
    // Deterministic from the key, so parent and child agree without talking.
    let mut r = Rng::new(key.bytes().fold(7u64, |h, b| h.wrapping_mul(31).wrapping_add(b as u64)));
    r.below(20_000) as usize
}

/// The child: `dir cycle` in the environment; writes until killed.
#[test]
fn torture_child() {
    let Some(arg) = child_arg() else { return };
    let (dir, cycle) = arg.split_once(' ').unwrap();
    let log = SegmentLog::open(PortableBackend::new(), dir, opts()).unwrap();
    let out = std::io::stdout();
    for i in 0..100_000u64 {
        let key = format!("c{cycle}-{i}");
        log.put(key.as_bytes(), &frames_for(key.as_bytes(), size_of(&key))).unwrap();
        if i % 3 == 0 {
            // Overwrite and delete keys of this cycle too, so recovery sees tombstones and dead records.
            let old = format!("c{cycle}-{}", i / 2);
            log.delete(old.as_bytes()).unwrap();
        }
        log.sync().unwrap();
        let mut o = out.lock();
        writeln!(o, "ACK {key} {}", if i % 3 == 0 { format!("DEL c{cycle}-{}", i / 2) } else { String::new() })
            .unwrap();
        o.flush().unwrap();
    }
}

#[test]
fn sigkill_at_random_points_loses_no_acknowledged_record() {
    let seed: u64 = std::env::var("SPILLWAY_TORTURE_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    println!("crash torture seed {seed} (SPILLWAY_TORTURE_SEED={seed} reproduces)");
    let cycles: u64 = std::env::var("SPILLWAY_TORTURE_CYCLES").ok().and_then(|s| s.parse().ok()).unwrap_or(50);
    let mut rng = Rng::new(seed);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("store");
    let mut live: BTreeMap<String, usize> = BTreeMap::new();
    let mut deleted: std::collections::BTreeSet<String> = Default::default();
    let exe = std::env::current_exe().unwrap();
    for cycle in 0..cycles {
        let acks_wanted = 1 + rng.below(40);
        let mut child = Command::new(&exe)
            .args(["torture_child", "--exact", "--nocapture", "--test-threads=1"])
            .env("SPILLWAY_TEST_CHILD", format!("{} {cycle}", dir.display()))
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut acks = 0;
        let mut last_acked: Option<u64> = None;
        let apply = |line: &str,
                     live: &mut BTreeMap<String, usize>,
                     last: &mut Option<u64>,
                     deleted: &mut std::collections::BTreeSet<String>| {
            let mut parts = line.split_whitespace();
            if parts.next() != Some("ACK") {
                return false;
            }
            let key = parts.next().unwrap().to_string();
            *last = key.rsplit('-').next().and_then(|n| n.parse().ok());
            let size = size_of(&key);
            deleted.remove(&key);
            live.insert(key, size);
            if parts.next() == Some("DEL") {
                let d = parts.next().unwrap();
                live.remove(d);
                deleted.insert(d.to_string());
            }
            true
        };
        while acks < acks_wanted {
            match lines.next() {
                Some(Ok(line)) => {
                    if apply(&line, &mut live, &mut last_acked, &mut deleted) {
                        acks += 1;
                    }
                }
                _ => panic!("seed {seed} cycle {cycle}: child ended before being killed"),
            }
        }
        child.kill().unwrap(); // SIGKILL
                               // Acknowledgements printed before the kill count too.
        for line in lines.map_while(Result::ok) {
            apply(&line, &mut live, &mut last_acked, &mut deleted);
        }
        let _ = child.wait();
        // The step after the last acknowledged one may have happened without its acknowledgement: its
        // put (checked below as a non-phantom) and, every third step, a delete of an earlier key.
        let next = last_acked.map_or(0, |l| l + 1);
        let maybe_deleted = (next % 3 == 0).then(|| format!("c{cycle}-{}", next / 2));

        let log = SegmentLog::open(PortableBackend::new(), &dir, opts())
            .unwrap_or_else(|e| panic!("seed {seed} cycle {cycle}: reopen failed: {e}"));
        for (k, size) in live.clone() {
            let got = log.get(k.as_bytes()).unwrap_or_else(|e| panic!("seed {seed} cycle {cycle}: {k}: {e}"));
            if got.is_none() && maybe_deleted.as_deref() == Some(k.as_str()) {
                live.remove(&k); // its unacknowledged delete made it to disk
                continue;
            }
            assert_eq!(got, Some(frames_for(k.as_bytes(), size)), "seed {seed} cycle {cycle}: {k}");
        }
        for k in log.keys() {
            let k = String::from_utf8(k).unwrap();
            assert!(!deleted.contains(&k), "seed {seed} cycle {cycle}: deleted key {k} came back");
            if !live.contains_key(&k) {
                // Written but not acknowledged (killed between put and ACK): must hold its own bytes.
                assert_eq!(
                    log.get(k.as_bytes()).unwrap(),
                    Some(frames_for(k.as_bytes(), size_of(&k))),
                    "seed {seed}: phantom {k}"
                );
                live.insert(k.clone(), size_of(&k)); // it exists now; later cycles must keep it
            }
        }
        let problems = log.verify().unwrap();
        assert!(problems.is_empty(), "seed {seed} cycle {cycle}: verify after recovery: {problems:?}");
    }
}
