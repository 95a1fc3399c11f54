//! Recovery on damaged segments: a small store (sealed segments with footers, an unsealed tail) is
//! written on the simulated disk, the input overwrites bytes of its segment files (and may cut one
//! short), and opening it must then either fail with an error or succeed; when it opens, every key
//! reads back as its value, as absent, or as an error, never anything else and never a panic, and
//! `verify` runs to the end. Damage elsewhere must not cost an intact record: with no segment header
//! block touched and no file cut short, the store opens, and every live key whose record bytes (and
//! segment header) are untouched reads back as its value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spillway::{Frames, LogOptions, SegmentLog, SimBackend};

fn value(i: u8) -> Vec<u8> {
    (0..(i as usize * 397) % 9000).map(|j| (j as u8).wrapping_mul(i).wrapping_add(7)).collect()
}

fuzz_target!(|data: &[u8]| {
    let be = SimBackend::new();
    let opts = LogOptions { segment_bytes: 64 << 10, ..Default::default() };
    {
        let log = SegmentLog::open(be.clone(), "/s", opts.clone()).unwrap();
        for i in 0..40u8 {
            log.put(&[b'k', i], &Frames::from(value(i))).unwrap();
            if i % 7 == 3 {
                log.delete(&[b'k', i - 2]).unwrap();
            }
        }
        log.sync().unwrap();
    }
    // Where each live key's record is, before any damage.
    let live: Vec<(u8, spillway::log::Location)> = {
        let log = SegmentLog::open(be.clone(), "/s", opts.clone()).unwrap();
        (0..40u8).filter_map(|i| log.location(&[b'k', i]).map(|l| (i, l))).collect()
    };
    let mut segs: Vec<_> = be.files().into_iter().filter(|p| p.extension().is_some_and(|e| e == "seg")).collect();
    segs.sort();
    let seg_id = |p: &std::path::Path| u32::from_str_radix(p.file_stem().unwrap().to_str().unwrap(), 16).unwrap();
    // Damage done: bytes changed (segment, offset), segments cut short.
    let mut poked: Vec<(u32, u64)> = Vec::new();
    let mut cut: Vec<u32> = Vec::new();
    // Each 4-byte group: which segment, where (in units of 8 bytes), which byte.
    for op in data.chunks_exact(4) {
        let seg = &segs[op[0] as usize % segs.len()];
        let contents = be.file_contents(seg).unwrap_or_default();
        if contents.is_empty() {
            continue;
        }
        let at = (u16::from_le_bytes([op[1], op[2]]) as u64 * 8) % contents.len() as u64;
        if op[0] & 0x80 != 0 && op[3] == 0 {
            if be.truncate(seg, at).is_ok() {
                cut.push(seg_id(seg));
            }
        } else if contents[at as usize] != op[3] && be.poke(seg, at, &[op[3]]).is_ok() {
            poked.push((seg_id(seg), at));
        }
    }
    // The segment header lies in the first aligned block (at most 4 KiB).
    let header_hit = |seg: u32| poked.iter().any(|&(s, at)| s == seg && at < 4096);
    let log = match SegmentLog::open(be, "/s", opts) {
        Ok(log) => log,
        Err(e) => {
            let headers: Vec<u32> = poked.iter().map(|p| p.0).filter(|&s| header_hit(s)).collect();
            assert!(!cut.is_empty() || !headers.is_empty(), "open failed on damage to records only: {e}");
            return;
        }
    };
    for i in 0..40u8 {
        if let Ok(Some(got)) = log.get(&[b'k', i]) {
            assert_eq!(got.concat(), value(i), "key {i} read back as other bytes");
        }
    }
    for (i, l) in &live {
        let touched = poked.iter().any(|&(s, at)| s == l.segment && at >= l.offset && at < l.offset + l.len);
        if touched || header_hit(l.segment) || cut.contains(&l.segment) {
            continue;
        }
        let got = log.get(&[b'k', *i]);
        assert!(
            matches!(&got, Ok(Some(f)) if f.concat() == value(*i)),
            "intact record of key {i} (segment {}, offset {}) read back as {got:?}",
            l.segment,
            l.offset
        );
    }
    let _ = log.verify();
});
