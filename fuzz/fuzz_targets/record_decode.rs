//! Record decoding never panics on arbitrary bytes and salts, and whatever decodes re-encodes
//! byte-identically.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spillway::format;

fuzz_target!(|input: &[u8]| {
    // The first 8 bytes are the log's salt, the rest the record.
    let Some((salt, data)) = input.split_first_chunk::<8>() else { return };
    let salt = format::Salt(u64::from_le_bytes(*salt));
    let Ok(r) = format::decode_record(data, salt) else { return };
    let len = r.header.record_len() as usize;
    let mut out = vec![0u8; len];
    let po = r.header.payload_offset() as usize;
    out[po..].copy_from_slice(r.payload);
    format::write_record_head(&mut out, &r.header, &r.frame_lens, r.key, salt);
    assert_eq!(&out[..], &data[..len], "decode/encode round trip changed bytes");
});
