//! Bit flips. One bit of one segment file is flipped at a random offset (sealed segments and the
//! unsealed active segment alike), then the store is reopened. Guarantees pinned here:
//!
//! * opening never fails and never panics;
//! * a flip inside a record of a *sealed* segment makes reading that record fail with an error naming
//!   its segment and offset, and every other key reads back exactly. The exception: a single-frame
//!   value is read without its head (its payload crc is in the index), so a flip in its head leaves
//!   it readable, exactly, and `verify` reports the damage with its location;
//! * a flip in the *unsealed* segment's record payload is reported the same way; a flip in an unsealed
//!   record's header makes that record unreadable (its key reads as absent) and is reported, with its
//!   location, by recovery and `verify`; every other key reads back exactly;
//! * damage to the very last record of the unsealed segment cannot be told apart from a torn write:
//!   recovery cuts it as a torn tail and reports the cut bytes;
//! * flips in headers, footers, trailers or padding lose nothing.

use std::collections::BTreeMap;

use spillway::{LogOptions, SegmentLog, SimBackend};
use spillway_tests::{frames_for, Rng};

fn opts() -> LogOptions {
    LogOptions { segment_bytes: 64 * 1024, auto_compact: false, ..Default::default() }
}

#[test]
fn random_bit_flips_damage_only_the_record_they_hit() {
    let be = SimBackend::new();
    let mut expected: BTreeMap<Vec<u8>, usize> = BTreeMap::new();
    let mut rng = Rng::new(99);
    let (locs, sealed) = {
        let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
        for i in 0..200 {
            let k = format!("key-{i}").into_bytes();
            let s = rng.below(2500) as usize;
            log.put(&k, &frames_for(&k, s)).unwrap();
            expected.insert(k, s);
        }
        log.sync().unwrap();
        let locs: BTreeMap<Vec<u8>, spillway::Location> =
            expected.keys().map(|k| (k.clone(), log.location(k).unwrap())).collect();
        let stats = log.stats();
        assert!(stats.sealed_segments >= 3, "need several sealed segments, got {stats:?}");
        (locs, stats.sealed_segments)
    };
    let active = locs.values().map(|l| l.segment).max().unwrap();
    let last_offset = locs.values().filter(|l| l.segment == active).map(|l| l.offset).max().unwrap();
    let files = be.files();
    let mut hit_sealed_record = 0;
    for trial in 0..400 {
        let crashed = be.crash(None);
        let file = &files[rng.below(files.len() as u64) as usize];
        let seg: u32 = u32::from_str_radix(file.file_stem().unwrap().to_str().unwrap(), 16).unwrap();
        let len = crashed.file_contents(file).unwrap().len() as u64;
        let off = rng.below(len);
        let bit = rng.below(8) as u8;
        let mut byte = [crashed.file_contents(file).unwrap()[off as usize]];
        byte[0] ^= 1 << bit;
        crashed.poke(file, off, &byte).unwrap();

        let log = SegmentLog::open(crashed, "/s", opts())
            .unwrap_or_else(|e| panic!("trial {trial}: open failed after flip at {seg}:{off}: {e}"));
        let hit = locs.iter().find(|(_, l)| l.segment == seg && off >= l.offset && off < l.offset + l.len);
        for (k, s) in &expected {
            let got = log.get(k);
            match hit {
                Some((hk, l)) if hk == k => {
                    if seg != active {
                        hit_sealed_record += 1;
                    }
                    match got {
                        Err(e) => assert_eq!(e.location(), Some((l.segment, l.offset)), "trial {trial}: {e}"),
                        Ok(None) if seg == active && l.offset == last_offset => {
                            // The last record of the unsealed tail cannot be told from a torn write:
                            // recovery cuts it and says so.
                            assert!(log.recovery_report().truncated_bytes > 0, "trial {trial}: silent cut");
                        }
                        Ok(None) if seg == active => {
                            // Header damage in the unsealed tail: reported with its location.
                            let problems = log.verify().unwrap();
                            assert!(
                                problems.iter().any(|p| p.segment == seg && p.offset == l.offset),
                                "trial {trial}: unreported damage at {seg}:{}: {problems:?}",
                                l.offset
                            );
                        }
                        Ok(Some(v))
                            if v.0.len() == 1 && off < l.offset + l.len - *s as u64 && v == frames_for(k, *s) =>
                        {
                            // Read without its head, which the flip hit: the value is intact.
                            let problems = log.verify().unwrap();
                            assert!(
                                problems.iter().any(|p| p.segment == seg && p.offset == l.offset),
                                "trial {trial}: unreported head damage at {seg}:{}: {problems:?}",
                                l.offset
                            );
                        }
                        other => panic!("trial {trial}: flip at {seg}:{off} in {k:?} gave {other:?}"),
                    }
                }
                _ => {
                    let v = got.unwrap_or_else(|e| panic!("trial {trial}: flip at {seg}:{off} broke {k:?}: {e}"));
                    assert_eq!(v, Some(frames_for(k, *s)), "trial {trial}: flip at {seg}:{off}");
                }
            }
        }
    }
    assert!(hit_sealed_record > 50, "the sample must hit sealed records often ({hit_sealed_record}; {sealed} sealed)");
}

/// The version byte of a record in a sealed segment: any flip of it is damage to that record, reported
/// with its location (the segment's header already said which format the segment is in), never an
/// "unsupported version" error that names no place.
#[test]
fn a_flipped_record_version_byte_is_damage_with_a_location() {
    for bit in 0..8u8 {
        let be = SimBackend::new();
        let keys: Vec<Vec<u8>> = (0..100).map(|i| format!("key-{i}").into_bytes()).collect();
        let loc = {
            let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
            for k in &keys {
                log.put(k, &frames_for(k, 2000)).unwrap();
            }
            log.sync().unwrap();
            log.location(&keys[3]).unwrap()
        };
        let file = be
            .files()
            .into_iter()
            .find(|f| f.file_stem().unwrap().to_str().unwrap() == format!("{:08x}", loc.segment))
            .unwrap();
        let at = loc.offset + 4; // the version byte
        let b = be.file_contents(&file).unwrap()[at as usize] ^ (1 << bit);
        be.poke(&file, at, &[b]).unwrap();
        let log = SegmentLog::open(be, "/s", opts()).unwrap();
        let e = log.get(&keys[3]).unwrap_err();
        assert!(e.is_corruption(), "bit {bit}: {e}");
        assert_eq!(e.location(), Some((loc.segment, loc.offset)), "bit {bit}: {e}");
        for k in keys.iter().filter(|k| **k != keys[3]) {
            assert_eq!(log.get(k).unwrap(), Some(frames_for(k, 2000)));
        }
    }
}

/// A flipped header bit in the unsealed segment, in a record whose value holds whole blocks of zeros
/// (a zero-filled array, or a punched hole), loses that record only. The scan that searches for the
/// next record after the damage must not take the value's zero blocks for the end of the segment:
/// every record after it was written, synced and acknowledged.
#[test]
fn a_damaged_header_before_zero_blocks_loses_only_that_record() {
    let zeros = |n: usize| spillway::Frames::single(vec![0u8; n]);
    let opts = LogOptions { segment_bytes: 1 << 20, auto_compact: false, ..Default::default() };
    for (what, at) in [("magic", 0u64), ("stored_len", 41), ("key", 64)] {
        let be = SimBackend::new();
        let mut expected: Vec<(Vec<u8>, spillway::Frames)> = vec![(b"zeros-a".to_vec(), zeros(20_000))];
        for i in 0..6 {
            let k = format!("after-{i}").into_bytes();
            let v = if i % 2 == 0 { frames_for(&k, 3000) } else { zeros(9000 + i * 1000) };
            expected.push((k, v));
        }
        let loc = {
            let log = SegmentLog::open(be.clone(), "/s", opts.clone()).unwrap();
            for (k, v) in &expected {
                log.put(k, v).unwrap();
            }
            log.sync().unwrap();
            assert_eq!(log.stats().sealed_segments, 0, "all records stay in the unsealed segment");
            log.location(b"zeros-a").unwrap()
        };
        let file = be
            .files()
            .into_iter()
            .find(|f| f.file_stem().unwrap().to_str().unwrap() == format!("{:08x}", loc.segment))
            .unwrap();
        let off = loc.offset + at;
        let b = be.file_contents(&file).unwrap()[off as usize] ^ 0x10;
        be.poke(&file, off, &[b]).unwrap();

        let log = SegmentLog::open(be, "/s", opts.clone()).unwrap();
        assert_eq!(log.recovery_report().truncated_bytes, 0, "{what}: nothing after the damage is a torn tail");
        assert!(log.get(b"zeros-a").unwrap().is_none(), "{what}: the damaged record is unreadable");
        for (k, v) in &expected[1..] {
            assert_eq!(
                log.get(k).unwrap_or_else(|e| panic!("{what}: {e}")).as_ref(),
                Some(v),
                "{what}: {:?} after the damaged record",
                String::from_utf8_lossy(k)
            );
        }
        let problems = log.verify().unwrap();
        assert!(problems.iter().any(|p| p.segment == loc.segment && p.offset == loc.offset), "{what}: {problems:?}");
    }
}
