//! Reads of a value without its head. A single-frame, uncompressed value is read as its payload
//! alone and checked against the payload crc the index keeps (from the write, a footer entry or a
//! recovery scan); the writer starts a payload of 4 KiB or more at a multiple of 512 in the file, so
//! that a 4 KiB value is one 4096-byte, sector-aligned read (with its head it would be 4608 bytes, which
//! this machine's disk serves at 0.8x the IOPS). Any other value is read whole, head included.

use bytes::Bytes;
use spillway::{format, Compression, Frames, LogOptions, SegmentLog, SimBackend};

fn opts() -> LogOptions {
    LogOptions { segment_bytes: 256 * 1024, auto_compact: false, ..Default::default() }
}

fn one_frame(seed: u64, n: usize) -> Frames {
    let bytes: Vec<u8> = (0..n as u64).map(|i| (i.wrapping_mul(31) ^ seed.wrapping_mul(0x9e37)) as u8).collect();
    Frames(vec![Bytes::from(bytes)])
}

fn seg_path(id: u32) -> std::path::PathBuf {
    std::path::PathBuf::from(format!("/s/segments/{id:08x}.seg"))
}

/// Flip the bits of `mask` in the byte at `at` of segment `id`.
fn flip_bits(be: &SimBackend, id: u32, at: u64, mask: u8) {
    let byte = be.file_contents(&seg_path(id)).unwrap()[at as usize];
    be.poke(&seg_path(id), at, &[byte ^ mask]).unwrap();
}

/// What `get(key)` returns, and the reads (offset, length) it made.
fn get_with_reads(be: &SimBackend, log: &SegmentLog<SimBackend>, key: &[u8]) -> (Option<Frames>, Vec<(u64, usize)>) {
    be.record_reads(true);
    let v = log.get(key).unwrap();
    let reads = be.take_reads();
    be.record_reads(false);
    (v, reads)
}

/// 4 KiB values among small ones of many sizes (so that the 4 KiB records start at every offset
/// modulo 512), spread over sealed segments and the active one.
fn write_mixed(log: &SegmentLog<SimBackend>) -> Vec<(Vec<u8>, Frames)> {
    let mut big = Vec::new();
    for i in 0..150u64 {
        let k = format!("value-{i}").into_bytes();
        let v = one_frame(i, 4096);
        log.put(&k, &v).unwrap();
        log.put(format!("small-{i}").as_bytes(), &one_frame(i, (i * 37 % 700) as usize)).unwrap();
        big.push((k, v));
    }
    log.sync().unwrap();
    big
}

fn assert_one_sector_read_each(be: &SimBackend, log: &SegmentLog<SimBackend>, big: &[(Vec<u8>, Frames)], when: &str) {
    for (k, v) in big {
        let (got, reads) = get_with_reads(be, log, k);
        assert_eq!(got.as_ref(), Some(v), "{when}: {k:?}");
        assert_eq!(reads.len(), 1, "{when}: {k:?}: {reads:?}");
        let (offset, len) = reads[0];
        assert_eq!((offset % 512, len), (0, 4096), "{when}: {k:?} read at {offset}, {len} bytes");
    }
}

#[test]
fn a_4k_value_is_one_aligned_4096_byte_read_when_written_after_reopen_and_after_a_scan() {
    let be = SimBackend::with_alignment(512);
    let big = {
        let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
        let big = write_mixed(&log);
        let stats = log.stats();
        assert!(stats.sealed_segments >= 2 && stats.segments > stats.sealed_segments, "{stats:?}");
        assert_one_sector_read_each(&be, &log, &big, "as written");
        big
    };
    // Reopened: sealed segments are indexed from their footers, the unsealed one by a scan.
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    assert!(log.recovery_report().scanned_segments >= 1 && log.recovery_report().sealed_segments >= 2);
    assert_one_sector_read_each(&be, &log, &big, "after reopen");

    // The batched and async reads take the same path.
    be.record_reads(true);
    let mut keys = big.iter().map(|(k, _)| k.clone());
    let mut n = 0;
    log.get_pipelined(8, &mut keys, &mut |k, got| {
        let want = &big.iter().find(|(bk, _)| *bk == k).unwrap().1;
        assert_eq!(got.unwrap().as_ref(), Some(want));
        n += 1;
    })
    .unwrap();
    assert_eq!(n, big.len());
    let (k, v) = &big[7];
    assert_eq!(spillway::task::block_on(log.get_async(k)).unwrap().as_ref(), Some(v));
    let reads = be.take_reads();
    assert_eq!(reads.len(), big.len() + 1);
    assert!(reads.iter().all(|&(o, l)| o % 512 == 0 && l == 4096), "{reads:?}");
}

#[test]
fn multi_frame_and_compressed_values_are_read_whole() {
    let be = SimBackend::with_alignment(512);
    let lz4 = LogOptions { compression: Compression::Lz4, ..opts() };
    let log = SegmentLog::open(be.clone(), "/s", lz4).unwrap();
    let two = Frames(vec![Bytes::from(vec![1u8; 3000]), Bytes::from(vec![2u8; 3000])]);
    let text = Frames(vec![Bytes::from("spillway ".repeat(1000))]);
    log.put(b"two", &two).unwrap();
    log.put(b"text", &text).unwrap();
    log.sync().unwrap();
    for (k, v) in [(&b"two"[..], &two), (&b"text"[..], &text)] {
        let loc = log.location(k).unwrap();
        let (got, reads) = get_with_reads(&be, &log, k);
        assert_eq!(got.as_ref(), Some(v));
        assert_eq!(reads.len(), 1);
        let (offset, len) = reads[0];
        assert!(offset <= loc.offset && offset + len as u64 >= loc.offset + loc.len, "{k:?}: {reads:?} for {loc:?}");
    }
}

#[test]
fn a_damaged_payload_read_without_its_head_is_an_error_at_its_record() {
    let be = SimBackend::with_alignment(512);
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    let big = write_mixed(&log);
    let (k, _) = &big[3];
    let loc = log.location(k).unwrap();
    flip_bits(&be, loc.segment, loc.offset + loc.len - 100, 0x10); // in the payload
    let e = log.get(k).unwrap_err();
    assert_eq!(e.location(), Some((loc.segment, loc.offset)), "{e}");
    assert!(e.to_string().contains("checksum"), "{e}");
    // The other values are untouched.
    for (other, v) in big.iter().filter(|(o, _)| o != k) {
        assert_eq!(log.get(other).unwrap().as_ref(), Some(v));
    }
}

#[test]
fn damage_to_the_head_of_a_value_read_without_it_is_found_by_verify() {
    let be = SimBackend::with_alignment(512);
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    let big = write_mixed(&log);
    let (k, v) = &big[5];
    let loc = log.location(k).unwrap();
    flip_bits(&be, loc.segment, loc.offset + 60, 1); // the frame table
                                                     // The value itself is intact, and its payload is all that is read.
    assert_eq!(log.get(k).unwrap().as_ref(), Some(v));
    let problems = log.verify().unwrap();
    assert!(problems.iter().any(|p| (p.segment, p.offset) == (loc.segment, loc.offset)), "{problems:?}");
}

#[test]
fn values_moved_by_compaction_read_back_exactly() {
    let be = SimBackend::with_alignment(512);
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    let big = write_mixed(&log);
    // Delete most keys, so that compaction moves the rest (to offsets with another alignment).
    for (i, (k, _)) in big.iter().enumerate() {
        if i % 4 != 0 {
            log.delete(k).unwrap();
        }
    }
    let before: Vec<_> = big.iter().step_by(4).map(|(k, _)| log.location(k).unwrap()).collect();
    let stats = log.compact().unwrap();
    assert!(stats.records_moved > 0, "{stats:?}");
    let mut moved = 0;
    for ((k, v), old) in big.iter().step_by(4).zip(before) {
        if log.location(k).unwrap() != old {
            moved += 1;
        }
        let (got, reads) = get_with_reads(&be, &log, k);
        assert_eq!(got.as_ref(), Some(v));
        // Moved as they were, their payload may be off a sector boundary: at most one sector more.
        assert!(reads.len() == 1 && reads[0].1 <= 4096 + 512, "{reads:?}");
    }
    assert!(moved > 0);
    drop(log);
    let log = SegmentLog::open(be, "/s", opts()).unwrap();
    for (i, (k, v)) in big.iter().enumerate() {
        assert_eq!(log.get(k).unwrap().as_ref(), (i % 4 == 0).then_some(v), "{k:?}");
    }
}

/// Rewrite the footer of sealed segment `id` (keeping its crcs valid): what a crafted footer can do.
fn rewrite_footer(be: &SimBackend, id: u32, edit: impl FnOnce(&mut Vec<format::FooterEntry>)) {
    let path = seg_path(id);
    let file = be.file_contents(&path).unwrap();
    let size = file.len() as u64;
    let mut t = format::decode_trailer(&file[file.len() - format::TRAILER_LEN..], id, size).unwrap();
    let (from, len) = (t.footer_offset as usize, t.footer_len as usize);
    let mut entries = format::decode_footer(&file[from..from + len], t.entry_count, size).unwrap();
    edit(&mut entries);
    let mut footer = Vec::new();
    for e in &entries {
        format::encode_footer_entry(&mut footer, e);
    }
    assert_eq!(footer.len(), len, "the edit keeps the footer's length");
    t.footer_crc = format::footer_crc(&footer);
    be.poke(&path, from as u64, &footer).unwrap();
    be.poke(&path, size - format::TRAILER_LEN as u64, &format::encode_trailer(&t)).unwrap();
}

/// Recovery trusts a sealed segment's footer (its crc is valid) for what a read without the head
/// needs: a footer that disagrees with its records is reported by `verify`, a wrong payload crc
/// makes the read fail instead of returning anything, and compaction does not move a record whose
/// footer entry gives it another length.
#[test]
fn a_footer_that_disagrees_with_its_records_is_reported_and_never_trusted_into_wrong_data() {
    let be = SimBackend::with_alignment(512);
    let (crc_key, id) = {
        let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
        let big = write_mixed(&log);
        let id = log.location(&big[0].0).unwrap().segment;
        assert!(log.stats().sealed_segments >= 2);
        (big[0].0.clone(), id)
    };
    // The last entry's record has nothing after it, so a longer length still lists records in
    // order (an entry overlapping the next one makes the whole footer invalid, and the segment is
    // scanned instead).
    let mut len_key = Vec::new();
    rewrite_footer(&be, id, |entries| {
        for e in entries.iter_mut() {
            if e.key == crc_key {
                e.payload_crc ^= 1;
            }
        }
        let last = entries.last_mut().unwrap();
        last.record_len += 64;
        len_key = last.key.clone();
    });
    let log = SegmentLog::open(be.clone(), "/s", opts()).unwrap();
    assert!(log.get(&crc_key).is_err(), "a payload checked against a wrong crc is an error");
    let problems = log.verify().unwrap();
    for k in [&crc_key, &len_key] {
        let loc = log.location(k).unwrap();
        assert!(
            problems.iter().any(|p| (p.segment, p.offset) == (loc.segment, loc.offset) && p.error.contains("footer")),
            "{k:?}: {problems:?}"
        );
    }
    // Make the segment sparse, then compact: the mismatched record stays where it is.
    let before = log.location(&len_key).unwrap();
    let keys = (0..150).flat_map(|i| [format!("small-{i}").into_bytes(), format!("value-{i}").into_bytes()]);
    for k in keys.filter(|k| *k != len_key && *k != crc_key) {
        log.delete(&k).unwrap();
    }
    let stats = log.compact().unwrap();
    assert!(stats.segments_compacted > 0, "{stats:?}");
    assert_eq!(log.location(&len_key), Some(before));
}
