//! Record decoding never panics on arbitrary bytes, and whatever decodes re-encodes byte-identically.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spillway::format;

fuzz_target!(|data: &[u8]| {
    let Ok(r) = format::decode_record(data) else { return };
    let len = r.header.record_len() as usize;
    let mut out = vec![0u8; len];
    let po = r.header.payload_offset() as usize;
    out[po..].copy_from_slice(r.payload);
    format::write_record_head(&mut out, &r.header, &r.frame_lens, r.key);
    assert_eq!(&out[..], &data[..len], "decode/encode round trip changed bytes");
});
