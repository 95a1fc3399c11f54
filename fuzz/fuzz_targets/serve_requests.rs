//! The server on arbitrary bytes from a connection: whatever a peer sends (a greeting or not,
//! requests whole, cut short, malformed, with or without the ticket), the server answers only with
//! whole, well-formed responses (after its greeting: VALUE with exactly the bytes of a key it
//! holds, NOT_FOUND, or ERROR with at most 4096 bytes of text), then closes; it never panics, and a
//! client with the ticket is served the right value after every input.
//!
//! Input: byte 0 chooses a preamble (bit 0: a valid greeting; bit 1: then a valid request with the
//! ticket for the key of bits 2-3), the rest is sent raw after it. The server is a real
//! `transfer::serve` on 127.0.0.1 over a log on disk, started once per process.
#![no_main]

use libfuzzer_sys::fuzz_target;
use spillway::transfer::{self, Access, Client, Ticket, TransferOptions};
use spillway::{Compression, Frames, LogOptions, PortableBackend, SegmentLog};
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The server's standing ticket (the seeds carry it, so the fuzzer starts past authorization).
const TICKET: Ticket = Ticket::new(0, [0x5a; 16]);
/// Responses' largest stored value as this oracle reads them.
const MAX: u64 = 1 << 20;

struct Server {
    addr: String,
    values: Vec<(Vec<u8>, Frames)>,
}

fn server() -> &'static Server {
    static SERVER: OnceLock<Server> = OnceLock::new();
    SERVER.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("spillway-fuzz-serve-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let opts = LogOptions { segment_bytes: 1 << 20, compression: Compression::Lz4, ..Default::default() };
        let log = SegmentLog::open(PortableBackend::new(), &dir, opts).unwrap();
        // One frame; two frames; a compressible value stored as lz4; an empty value.
        let values: Vec<(Vec<u8>, Frames)> = vec![
            (b"a".to_vec(), Frames::from(b"alpha".to_vec())),
            (b"b".to_vec(), Frames(vec![vec![1u8; 100].into(), vec![2u8; 3].into()])),
            (b"z".to_vec(), Frames::from(vec![b'z'; 64 << 10])),
            (b"e".to_vec(), Frames(vec![])),
        ];
        for (k, v) in &values {
            log.put(k, v).unwrap();
        }
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let access = Arc::new(Access::standing(Arc::new(log), TICKET).unwrap());
        // Splice every value (the copy path is the one below 0 bytes: none).
        let topts = TransferOptions { timeout: Duration::from_secs(2), splice_min_bytes: 0, ..Default::default() };
        std::thread::spawn(move || transfer::serve(access, listener, topts));
        Server { addr, values }
    })
}

fn request(key: &[u8]) -> Vec<u8> {
    let mut r = vec![1u8]; // GET
    r.extend_from_slice(&TICKET.to_bytes());
    r.extend_from_slice(&(key.len() as u32).to_le_bytes());
    r.extend_from_slice(key);
    r
}

/// Take `n` bytes off the front of `r`, or say what was cut short.
fn take<'a>(r: &mut &'a [u8], n: usize, what: &str) -> &'a [u8] {
    assert!(r.len() >= n, "the server sent part of {what} and closed");
    let (a, b) = r.split_at(n);
    *r = b;
    a
}

fuzz_target!(|data: &[u8]| {
    let Some((&pre, rest)) = data.split_first() else { return };
    let srv = server();
    let mut sent = Vec::new();
    if pre & 1 != 0 {
        sent.extend_from_slice(&transfer::greeting());
        if pre & 2 != 0 {
            sent.extend_from_slice(&request(&srv.values[(pre >> 2) as usize & 3].0));
        }
    }
    sent.extend_from_slice(rest);

    let mut s = TcpStream::connect(&srv.addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    // The server may close before reading everything (a bad greeting, a malformed request).
    let _ = s.write_all(&sent);
    let _ = s.shutdown(Shutdown::Write);
    let mut got = Vec::new();
    if let Err(e) = s.read_to_end(&mut got) {
        // A reset after the server closed with our bytes unread is a close; a timeout is a hang.
        assert_ne!(e.kind(), std::io::ErrorKind::WouldBlock, "the server neither answered nor closed");
    }

    // What it said: nothing, or its greeting and whole responses.
    let mut r = &got[..];
    if !r.is_empty() {
        assert_eq!(take(&mut r, 8, "its greeting"), &transfer::greeting()[..], "not the greeting");
    }
    let mut first = true;
    while let Some((&status, after)) = r.split_first() {
        r = after;
        match status {
            0 => {
                let m = transfer::read_value_header(&mut r, MAX).expect("a well-formed VALUE header");
                let payload = take(&mut r, m.stored_len as usize, "a value");
                let mut src = payload;
                let frames = spillway::stored::read(&m, &mut src, MAX).expect("a value that verifies and decodes");
                assert!(srv.values.iter().any(|(_, v)| *v == frames), "a value no key holds");
                if first && pre & 3 == 3 {
                    assert_eq!(frames, srv.values[(pre >> 2) as usize & 3].1, "not the value asked for");
                }
            }
            1 => {}
            2 => {
                let len = u32::from_le_bytes(take(&mut r, 4, "an error's length").try_into().unwrap()) as usize;
                assert!(len <= 4096, "an error of {len} bytes");
                let text = take(&mut r, len, "an error's text");
                assert!(std::str::from_utf8(text).is_ok(), "an error that is not text");
            }
            other => panic!("unknown status {other}"),
        }
        first = false;
    }

    // The server still serves.
    let mut c =
        Client::connect(&srv.addr, TICKET, TransferOptions { timeout: Duration::from_secs(10), ..Default::default() })
            .expect("the server accepts after the input");
    assert_eq!(c.get(b"a").unwrap(), Some(srv.values[0].1.clone()), "the server serves after the input");
});
