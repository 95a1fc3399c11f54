//! Recovery on damaged segments: a small store (sealed segments with footers, an unsealed tail) is
//! written on the simulated disk, the input overwrites bytes of its segment files (and may cut one
//! short), and opening it must then either fail with an error or succeed; when it opens, every key
//! reads back as its value, as absent, or as an error, never anything else and never a panic, and
//! `verify` runs to the end.
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
    let mut segs: Vec<_> = be.files().into_iter().filter(|p| p.extension().is_some_and(|e| e == "seg")).collect();
    segs.sort();
    // Each 4-byte group: which segment, where (in units of 8 bytes), which byte.
    for op in data.chunks_exact(4) {
        let seg = &segs[op[0] as usize % segs.len()];
        let len = be.file_contents(seg).map_or(0, |c| c.len() as u64);
        if len == 0 {
            continue;
        }
        let at = (u16::from_le_bytes([op[1], op[2]]) as u64 * 8) % len;
        if op[0] & 0x80 != 0 && op[3] == 0 {
            let _ = be.truncate(seg, at);
        } else {
            let _ = be.poke(seg, at, &[op[3]]);
        }
    }
    let Ok(log) = SegmentLog::open(be, "/s", opts) else { return };
    for i in 0..40u8 {
        if let Ok(Some(got)) = log.get(&[b'k', i]) {
            assert_eq!(got.concat(), value(i), "key {i} read back as other bytes");
        }
    }
    let _ = log.verify();
});
