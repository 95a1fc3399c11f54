//! Footer and trailer decoding never panic, and decoded footers re-encode byte-identically.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spillway::format;

fuzz_target!(|data: &[u8]| {
    if data.len() < 8 {
        return;
    }
    let (count, rest) = data.split_at(8);
    let count = u64::from_le_bytes(count.try_into().unwrap()) % 1024;
    if let Ok(entries) = format::decode_footer(rest, count, 1 << 30) {
        let mut out = Vec::new();
        for e in &entries {
            format::encode_footer_entry(&mut out, e);
        }
        // Re-encoding zeroes reserved bytes and padding, so compare the decoded meaning, not the bytes.
        assert_eq!(format::decode_footer(&out, count, 1 << 30).unwrap(), entries);
    }
    let _ = format::decode_trailer(rest, 1, 1 << 30);
    let _ = format::decode_segment_header(rest);
});
