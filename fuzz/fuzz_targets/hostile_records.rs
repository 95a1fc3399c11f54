//! Recovery against records with valid checksums and hostile fields. Random byte edits (the
//! `segment_recovery` target) almost never make a record whose crcs verify; this target builds
//! them: a store of acknowledged values (sealed segments and an unsealed one, synced) gets, past the
//! synced end of its unsealed segment (where a crash leaves records that were never acknowledged),
//! records made with the format's own encoder and the log's salt — what someone who can read the
//! segment files can write — whose fields the input picks: kind (value, tombstone, sync mark),
//! flags, lengths and frame tables that disagree with the payload, `segment`, `epoch`, `seq`
//! (including their maximums), `aux`, and zero gaps between them. Their keys are in a namespace of
//! their own.
//!
//! Then the store must open (such records are never a reason to refuse the log), every
//! acknowledged key must read back exactly as it was acknowledged (its value, or absent when it was
//! deleted), a forged key reads as absent, an error or one of the values forged for it, never
//! a panic, and `verify` runs to the end. If the log is still writable, an acknowledged key written
//! again and synced reads as its new value after another open (a forged seq must not make new
//! records lose), with every other acknowledged value.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spillway::format::{self, RecordHeader, Salt};
use spillway::{Frames, LogOptions, SegmentLog, SimBackend};

fn value(i: u8) -> Vec<u8> {
    (0..(i as usize * 397) % 9000).map(|j| (j as u8).wrapping_mul(i).wrapping_add(7)).collect()
}

/// The input, read a field at a time (zeros once it runs out).
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        let mut b = [0u8; N];
        let n = N.min(self.0.len());
        b[..n].copy_from_slice(&self.0[..n]);
        self.0 = &self.0[n..];
        b
    }
    fn u8(&mut self) -> u8 {
        self.bytes::<1>()[0]
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes(self.bytes())
    }
    fn u32(&mut self) -> u32 {
        u32::from_le_bytes(self.bytes())
    }
    fn u64(&mut self) -> u64 {
        u64::from_le_bytes(self.bytes())
    }
}

const KEYS: u8 = 30;

fuzz_target!(|data: &[u8]| {
    let be = SimBackend::new();
    let opts = LogOptions { segment_bytes: 64 << 10, auto_compact: false, ..Default::default() };
    let mut acknowledged: Vec<Option<Vec<u8>>> = Vec::new();
    {
        let log = SegmentLog::open(be.clone(), "/s", opts.clone()).unwrap();
        for i in 0..KEYS {
            log.put(&[b'k', i], &Frames::from(value(i))).unwrap();
            acknowledged.push(Some(value(i)));
            if i % 7 == 3 {
                log.delete(&[b'k', i - 2]).unwrap();
                acknowledged[(i - 2) as usize] = None;
            }
        }
        log.sync().unwrap();
    }
    let mut segs: Vec<_> = be.files().into_iter().filter(|p| p.extension().is_some_and(|e| e == "seg")).collect();
    segs.sort();
    let newest = segs.last().expect("segments").clone();
    let id = u32::from_str_radix(newest.file_stem().unwrap().to_str().unwrap(), 16).unwrap();
    let bytes = be.file_contents(&newest).unwrap();
    let header = format::decode_segment_header(&bytes[..format::SEGMENT_HEADER_LEN]).unwrap();
    let salt: Salt = header.salt;
    // The synced end: the unsealed segment holds zeros after its records.
    let limit = bytes.len() as u64 - format::TRAILER_LEN as u64;
    let last = bytes[..limit as usize].iter().rposition(|&b| b != 0).unwrap_or(0) as u64;
    let mut at = format::align_up(last + 1, 64);

    let mut input = Input(data);
    let mut forged: Vec<(u8, Vec<u8>, bool)> = Vec::new();
    while !input.0.is_empty() && at < limit {
        let kind = input.u8();
        // Zero gap before the record, in 64-byte steps (a clean end, or a zeroed range).
        at += 64 * (input.u8() as u64 % 8);
        let flags = match kind & 3 {
            0 => 0,
            1 => format::FLAG_TOMBSTONE,
            2 => format::FLAG_SYNC_MARK,
            _ => input.u8(), // anything, unknown bits included
        } | if kind & 4 != 0 { format::FLAG_LZ4 } else { 0 };
        let key_byte = input.u8();
        let key = if flags & format::FLAG_SYNC_MARK != 0 && kind & 8 == 0 { Vec::new() } else { vec![b'x', key_byte] };
        let payload: Vec<u8> = (0..input.u8() as usize * 3).map(|j| (j as u8) ^ key_byte).collect();
        let frames: Vec<u64> = match input.u8() % 4 {
            0 => vec![],
            1 => vec![payload.len() as u64],                             // the truth
            2 => vec![input.u16() as u64, input.u16() as u64],           // lies
            _ => vec![payload.len() as u64 / 2, payload.len() as u64 / 2], // close to the truth
        };
        let pick32 = |x: u8, v: u32, cur: u32| match x % 6 {
            0 => cur,
            1 => cur.wrapping_add(1),
            2 => u32::MAX,
            3 => 0,
            4 => cur.wrapping_sub(1),
            _ => v,
        };
        let pick64 = |x: u8, v: u64| match x % 6 {
            0 => 1000 + v % 64,
            1 => u64::MAX,
            2 => 1 << 63,
            3 => (1 << 63) - 1,
            4 => 0,
            _ => v,
        };
        let (sx, ex, qx, ax) = (input.u8(), input.u8(), input.u8(), input.u8());
        let (sv, ev, qv, av) = (input.u32(), input.u32(), input.u64(), input.u32());
        let h = RecordHeader {
            flags,
            frame_count: frames.len() as u16,
            key_len: key.len() as u32,
            segment: pick32(sx, sv, id),
            epoch: pick32(ex, ev, header.epoch),
            payload_crc: if kind & 16 == 0 { format::payload_crc(&payload) } else { input.u32() },
            seq: pick64(qx, qv),
            raw_len: if kind & 32 == 0 { payload.len() as u64 } else { input.u64() },
            stored_len: payload.len() as u64,
            aux: match ax % 4 {
                0 => 0,
                1 => 64 * (av % 8),
                2 => id.saturating_sub(av % 4),
                _ => av,
            },
        };
        let po = h.payload_offset();
        if po > 4096 {
            continue; // a padding no record can have: nothing to write
        }
        let len = format::align_up(po + payload.len() as u64, 64);
        if at + len > limit {
            break;
        }
        let mut rec = vec![0u8; len as usize];
        rec[po as usize..po as usize + payload.len()].copy_from_slice(&payload);
        format::write_record_head(&mut rec, &h, &frames, &key, salt);
        be.poke(&newest, at, &rec).unwrap();
        if !key.is_empty() {
            forged.push((key_byte, payload, h.is_lz4()));
        }
        at += len;
    }

    let check = |log: &SegmentLog<SimBackend>, acknowledged: &[Option<Vec<u8>>]| {
        for (i, want) in acknowledged.iter().enumerate() {
            let got = log.get(&[b'k', i as u8]).unwrap_or_else(|e| panic!("acknowledged key {i}: {e}"));
            assert_eq!(got.map(|f| f.concat().to_vec()), *want, "acknowledged key {i}");
        }
    };
    let log = SegmentLog::open(be.clone(), "/s", opts.clone()).unwrap_or_else(|e| panic!("open failed: {e}"));
    check(&log, &acknowledged);
    for k in 0..=255u8 {
        if let Ok(Some(got)) = log.get(&[b'x', k]) {
            let got = got.concat();
            // A value read back is bytes of a record forged for this key: its frames, which may be
            // fewer bytes than its payload when the frame table says so, or what its lz4 block
            // decompresses to.
            assert!(
                forged.iter().any(|(fk, p, lz4)| *fk == k && (*lz4 || p.len() >= got.len())),
                "forged key {k} read back as {} bytes that were not forged for it",
                got.len()
            );
        }
    }
    let _ = log.verify();
    if log.poisoned().is_none() {
        // An acknowledged key written again: the new value must win, after another open too.
        log.put(b"k\x01", &Frames::from(value(200))).unwrap();
        log.sync().unwrap();
        drop(log);
        acknowledged[1] = Some(value(200));
        let log = SegmentLog::open(be, "/s", opts).unwrap_or_else(|e| panic!("second open failed: {e}"));
        check(&log, &acknowledged);
    }
});
