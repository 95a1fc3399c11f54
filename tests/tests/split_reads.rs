//! Large single-frame values are read and checksummed in two halves at once on the file backends
//! (`Backend::read_new_crc`): what comes back is the value, exactly, whatever its length, and damage
//! in either half is the record's checksum error, with its location, on every file backend.

use spillway::{AutoBackend, Backend, BackendKind, LogOptions, PortableBackend, SegmentLog};
use spillway_tests::frames_for;

/// Around the split threshold (4 MiB), odd lengths included (a tail past the last block, a split
/// point that is not the middle).
const SIZES: [usize; 4] = [(4 << 20) - 4096 + 1, 4 << 20, (4 << 20) + 1, (9 << 20) + 123];

fn opts() -> LogOptions {
    LogOptions { durable: false, segment_bytes: 64 << 20, ..Default::default() }
}

/// Starts a backend.
type Start = fn() -> AutoBackend;

/// The file backends here (io_uring where the kernel allows it), by name, and a way to start each.
fn backends() -> Vec<(&'static str, Start)> {
    let mut v: Vec<(&'static str, Start)> =
        vec![("portable", || AutoBackend::new(BackendKind::Portable, false).unwrap())];
    if AutoBackend::new(BackendKind::Uring, false).is_ok() {
        v.push(("uring", || AutoBackend::new(BackendKind::Uring, false).unwrap()));
    }
    v
}

fn round_trip<B: Backend>(name: &str, be: impl Fn() -> B) {
    let tmp = tempfile::tempdir().unwrap();
    {
        let log = SegmentLog::open(be(), tmp.path(), opts()).unwrap();
        for (i, n) in SIZES.iter().enumerate() {
            let k = format!("v{i}");
            log.put(k.as_bytes(), &frames_for(k.as_bytes(), *n)).unwrap();
        }
        for (i, n) in SIZES.iter().enumerate() {
            let k = format!("v{i}");
            assert_eq!(log.get(k.as_bytes()).unwrap(), Some(frames_for(k.as_bytes(), *n)), "{name}: {n} bytes");
        }
        log.sync().unwrap();
    }
    // Reopened: the payloads are read without their heads, checked against the index's crcs.
    let log = SegmentLog::open(be(), tmp.path(), opts()).unwrap();
    for (i, n) in SIZES.iter().enumerate() {
        let k = format!("v{i}");
        let (got, crc) = log.get_with_crc(k.as_bytes()).unwrap().expect("present");
        assert_eq!(got, frames_for(k.as_bytes(), *n), "{name}: {n} bytes after reopen");
        assert_eq!(crc, Some(spillway::format::laid_out_crc(got.iter().map(|b| &b[..]))), "{name}: crc");
    }
}

#[test]
fn large_values_read_in_two_halves_come_back_exactly() {
    for (name, be) in backends() {
        round_trip(name, be);
    }
    round_trip("portable (plain)", PortableBackend::new);
}

#[test]
fn damage_in_either_half_of_a_large_value_is_a_checksum_error_at_its_record() {
    use std::os::unix::fs::FileExt;
    let n = 8 << 20;
    for (name, be) in backends() {
        for at in [1 << 20, 7 << 20] {
            let tmp = tempfile::tempdir().unwrap();
            let loc = {
                let log = SegmentLog::open(be(), tmp.path(), opts()).unwrap();
                log.put(b"big", &frames_for(b"big", n)).unwrap();
                log.put(b"small", &frames_for(b"small", 700)).unwrap();
                log.sync().unwrap();
                log.location(b"big").unwrap()
            };
            let seg = std::fs::read_dir(tmp.path().join("segments"))
                .unwrap()
                .map(|e| e.unwrap().path())
                .find(|p| u32::from_str_radix(p.file_stem().unwrap().to_str().unwrap(), 16) == Ok(loc.segment))
                .expect("the value's segment file");
            let f = std::fs::OpenOptions::new().read(true).write(true).open(&seg).unwrap();
            // A byte of the payload (its last `n` bytes in the record), `at` bytes in.
            let off = loc.offset + loc.len - n as u64 + at;
            let mut b = [0u8];
            f.read_exact_at(&mut b, off).unwrap();
            f.write_all_at(&[b[0] ^ 0x10], off).unwrap();
            drop(f);
            let log = SegmentLog::open(be(), tmp.path(), opts()).unwrap();
            let e = log.get(b"big").expect_err("damage must not read back");
            assert_eq!(e.location(), Some((loc.segment, loc.offset)), "{name}, {at}: {e}");
            assert!(matches!(e, spillway::Error::ChecksumMismatch { .. }), "{name}, {at}: {e}");
            assert_eq!(log.get(b"small").unwrap(), Some(frames_for(b"small", 700)), "{name}: the neighbour");
        }
    }
}
