//! The receiving side of the transfer protocol on arbitrary bytes: parsing a VALUE header never
//! panics or over-allocates, and streaming the rest into a log (simulated disk) either stores exactly
//! a value whose checksum matched and that decodes, served back as exactly the frames the bytes
//! decode to, or stores nothing, leaving the log usable.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spillway::{format, Frames, LogOptions, SegmentLog, SimBackend};

fuzz_target!(|data: &[u8]| {
    let mut r = data;
    let Ok(meta) = spillway::transfer::read_value_header(&mut r, 1 << 20) else { return };
    let be = SimBackend::new();
    let log = SegmentLog::open(be, "/s", LogOptions { segment_bytes: 1 << 20, ..Default::default() }).unwrap();
    log.put(b"before", &Frames::from(b"x".to_vec())).unwrap();
    let mut payload = r;
    match log.put_stream(b"k", &meta, &mut payload) {
        Ok(()) => {
            let stored = &r[..meta.stored_len as usize];
            assert_eq!(format::payload_crc(stored), meta.payload_crc, "stored a value whose checksum did not match");
            // What the bytes decode to by the receive-into-memory path (framing, lz4): the log must
            // have checked that they decode, and serve exactly that.
            let mut src = stored;
            let want = spillway::stored::read(&meta, &mut src, 1 << 20).expect("stored a value that does not decode");
            assert_eq!(log.get(b"k").unwrap(), Some(want), "stored other bytes");
        }
        Err(_) => assert!(log.get(b"k").unwrap().is_none(), "a failed receive published the key"),
    }
    // Either way the log keeps working.
    log.put(b"after", &Frames::from(b"y".to_vec())).unwrap();
    assert_eq!(log.get(b"before").unwrap().unwrap().concat(), &b"x"[..]);
});
