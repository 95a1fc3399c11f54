//! Black-box tests of `spillway-bench`'s interface: the fio-shaped JSON that fio tooling reads, and
//! options a job does not read are refused rather than silently ignored.

use std::process::{Command, Output};

fn bench(args: &[&str]) -> Output {
    let out = Command::new(env!("CARGO_BIN_EXE_spillway-bench"))
        .args(args)
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("run spillway-bench");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("panicked"), "spillway-bench {args:?} panicked: {stderr}");
    out
}

fn json(out: &Output) -> serde_json::Value {
    assert!(out.status.success(), "failed: {}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&out.stdout).expect("stdout is one JSON document")
}

/// A read job reports exactly the job asked for (the layout write goes under `spillway.layout`, as
/// fio's layout phase is no job), with fio's field names and units, and leaves `--dir` clean.
#[test]
fn a_read_job_reports_one_fio_shaped_job() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let out = bench(&["--rw", "randread", "--bs", "64KiB", "--size", "4MiB", "--dir", d, "--output-format", "json"]);
    let v = json(&out);
    let jobs = v["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 1, "{v}");
    let job = &jobs[0];
    assert_eq!(job["jobname"], "randread");
    let read = &job["read"];
    assert_eq!(read["total_ios"], 64);
    assert_eq!(read["io_bytes"], 4 << 20);
    for lat in ["clat_ns", "lat_ns"] {
        let p = read[lat]["percentile"].as_object().unwrap();
        assert_eq!(p.len(), 17, "fio's default percentile list");
        assert!(p.contains_key("99.500000") && p.contains_key("50.000000"));
        assert!(read[lat]["max"].as_u64().unwrap() >= p["50.000000"].as_u64().unwrap());
    }
    assert_eq!(read["slat_ns"]["max"], 0);
    assert_eq!(job["write"]["total_ios"], 0);
    assert_eq!(job["write"]["runtime"], 0, "no writes: zero runtime, as in fio");
    assert_eq!(v["spillway"]["layout"]["write"]["total_ios"], 64);
    assert_eq!(v["spillway"]["invalidate"], true);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "the store is removed without --keep");
    let kept_cache =
        ["--rw", "read", "--bs", "64KiB", "--size", "1MiB", "--invalidate", "0", "--output-format", "json"];
    let v = json(&bench(&kept_cache));
    assert_eq!(v["spillway"]["invalidate"], false);
    assert_eq!(v["jobs"][0]["read"]["total_ios"], 16);
}

/// Options a job does not read are refused with a message that names them; so is a depth the job
/// cannot honour.
#[test]
fn options_a_job_does_not_read_are_refused() {
    for (args, msg) in [
        (&["--rw", "open", "--bs", "4KiB"][..], "--bs does not apply to open"),
        (&["--rw", "spill-unspill", "--compress", "lz4"], "--compress does not apply to spill-unspill"),
        (&["--rw", "transfer", "--direct"], "--direct does not apply to transfer"),
        (&["--rw", "materialize", "--keep"], "--keep does not apply to materialize"),
        (&["--rw", "write", "--target", "1MiB"], "--target does not apply to write"),
        (&["--rw", "write", "--invalidate", "0"], "--invalidate does not apply to write"),
        (&["--rw", "randread", "--rwmixread", "70"], "--rwmixread does not apply to randread"),
        (&["--rw", "randrw", "--iodepth", "4"], "not supported for randrw"),
        (&["--rw", "materialize", "--bs", "1", "--size", "1MiB"], "at most 100000"),
    ] {
        let out = bench(args);
        assert_eq!(out.status.code(), Some(1), "{args:?}");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains(msg), "{args:?}: {stderr}");
    }
}

/// A spill-unspill job reports each layer of the unspill beside the floor in the same run: the
/// store's get + remove, and its log's get + forget of the same values, each every value once, and
/// leaves `--dir` clean.
#[test]
fn a_spill_unspill_job_reports_the_logs_share_beside_the_floor() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let args = ["--rw", "spill-unspill", "--bs", "4KiB", "--size", "1MiB", "--target", "256KiB", "--dir", d];
    let v = json(&bench(&[&args[..], &["--output-format", "json"]].concat()));
    let job = &v["jobs"][0];
    for part in [&job["spillway"]["unspill"], &job["unspill_floor"]["unspill"], &job["unspill_log_only"]["unspill"]] {
        assert_eq!(part["ops"], 256, "{job}");
        assert_eq!(part["bytes"], 1 << 20, "{job}");
    }
    let floor = job["unspill_floor"]["unspill"]["ops_per_s"].as_f64().unwrap();
    let log = &job["unspill_log_only"];
    let log_rate = log["unspill"]["ops_per_s"].as_f64().unwrap();
    assert!((log["time_ratio_to_floor"].as_f64().unwrap() - floor / log_rate).abs() < 1e-9, "{job}");
    let store_rate = job["spillway"]["unspill"]["ops_per_s"].as_f64().unwrap();
    assert!((job["unspill_floor"]["spillway_time_ratio"].as_f64().unwrap() - floor / store_rate).abs() < 1e-9);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0, "every phase removes its files");
}
