//! Helpers shared by the integration tests: deterministic values and small process utilities.

use bytes::Bytes;
use spillway::Frames;

pub mod logs;
pub mod store;

/// A deterministic pseudo-random generator (xorshift64*), so a child process and its parent can agree
/// on a value's bytes from its key alone.
pub struct Rng(u64);

impl Rng {
    /// Seeded generator (a zero seed is replaced).
    pub fn new(seed: u64) -> Self {
        Rng(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }
    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    /// Uniform in `0..n` (n > 0).
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

fn seed_of(key: &[u8]) -> u64 {
    key.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

/// `size` deterministic bytes derived from `key` (mixed runs of text and noise, so lz4 has work to do).
pub fn value_for(key: &[u8], size: usize) -> Vec<u8> {
    let mut rng = Rng::new(seed_of(key) ^ size as u64);
    let mut v = Vec::with_capacity(size);
    while v.len() < size {
        let x = rng.next_u64();
        if x % 4 == 0 {
            v.extend_from_slice(&[b'a' + (x >> 8) as u8 % 26; 16]);
        } else {
            v.extend_from_slice(&x.to_le_bytes());
        }
    }
    v.truncate(size);
    v
}

/// The value of [`value_for`] cut into 1 to 3 frames (deterministically), as a codec would produce.
pub fn frames_for(key: &[u8], size: usize) -> Frames {
    let v = Bytes::from(value_for(key, size));
    let n = 1 + (seed_of(key) % 3) as usize;
    let mut frames = Vec::with_capacity(n);
    let mut at = 0;
    for i in 0..n {
        let end = if i + 1 == n { size } else { (at + size / n).min(size) };
        frames.push(v.slice(at..end));
        at = end;
    }
    Frames(frames)
}

/// When this process was started by [`run_child`], the value of the child's argument.
pub fn child_arg() -> Option<String> {
    std::env::var("SPILLWAY_TEST_CHILD").ok()
}

/// Re-run the current test binary, running only test `name`, with `arg` passed through the
/// environment (see [`child_arg`]). Returns the child's status and stdout.
pub fn run_child(name: &str, arg: &str) -> (std::process::ExitStatus, String) {
    let exe = std::env::current_exe().expect("test binary path");
    let out = std::process::Command::new(exe)
        .args([name, "--exact", "--nocapture", "--test-threads=1"])
        .env("SPILLWAY_TEST_CHILD", arg)
        .output()
        .expect("spawn child test process");
    (out.status, String::from_utf8_lossy(&out.stdout).into_owned())
}

/// An io_uring backend, or `None` after printing why the test is skipped. When the environment sets
/// `SPILLWAY_REQUIRE_URING=1` (CI does, where the kernel allows io_uring) a missing io_uring fails the
/// test instead, so nothing is skipped silently.
pub fn uring_or_skip(test: &str, opts: spillway::backend::UringOptions) -> Option<spillway::backend::UringBackend> {
    match spillway::backend::UringBackend::new(opts) {
        Ok(b) => Some(b),
        Err(e) if std::env::var("SPILLWAY_REQUIRE_URING").is_ok_and(|v| v == "1") => {
            panic!("{test}: io_uring required (SPILLWAY_REQUIRE_URING=1) but unavailable: {e}")
        }
        Err(e) => {
            println!("SKIPPED {test}: io_uring unavailable: {e}");
            None
        }
    }
}

/// [`uring_or_skip`] with default options and O_DIRECT as given.
pub fn uring_direct_or_skip(test: &str, direct: bool) -> Option<spillway::backend::UringBackend> {
    uring_or_skip(test, spillway::backend::UringOptions { direct, ..Default::default() })
}

/// Asserts that two sets of files (path, contents), each sorted by path, are the same files with the
/// same bytes; `what` names the comparison in the failure message. At least 4 files are expected:
/// the workloads that use this span several segments.
/// Each log draws its own salt, so the bytes that depend on it (see [`salt_free`]) are left out.
pub fn assert_same_files(a: &[(std::path::PathBuf, Vec<u8>)], b: &[(std::path::PathBuf, Vec<u8>)], what: &str) {
    assert!(a.len() > 3, "the workload spans several segments");
    assert_eq!(a.len(), b.len(), "{what}: file count");
    for ((p, x), (q, y)) in a.iter().zip(b) {
        assert_eq!(p, q);
        assert!(salt_free(x) == salt_free(y), "{}: {what}: contents differ", p.display());
    }
}

/// A segment file's bytes with what depends on its log's salt zeroed: the salt and crc of its header
/// and trailer, and the header crc of every record that verifies under the salt. Two logs that wrote
/// the same records give the same bytes. (A file without a valid segment header is returned as is.)
pub fn salt_free(file: &[u8]) -> Vec<u8> {
    use spillway::format;
    let mut out = file.to_vec();
    let Some(h) = file.get(..format::SEGMENT_HEADER_LEN).and_then(|b| format::decode_segment_header(b).ok()) else {
        return out;
    };
    out[40..48].fill(0);
    out[60..64].fill(0);
    let mut at = h.data_start as usize;
    while at + format::RECORD_HEADER_LEN <= file.len() {
        let ok = format::peek_record_header(&file[at..])
            .is_ok_and(|r| format::verify_record_head(&file[at..], &r, h.salt).is_ok());
        if ok {
            out[at + 52..at + 56].fill(0);
        }
        at += format::RECORD_ALIGN as usize;
    }
    if file.len() >= format::TRAILER_LEN {
        let t = file.len() - format::TRAILER_LEN;
        if format::decode_trailer(&file[t..], h.segment, file.len() as u64).is_ok() {
            out[t + 52..].fill(0);
        }
    }
    out
}

/// `frames` laid out (64-byte frame alignment) as a plain, not lz4, value streamed from a peer: the
/// payload bytes and the metadata that announces them.
pub fn streamed(frames: &Frames) -> (Vec<u8>, spillway::StreamedValue) {
    let lens: Vec<u64> = frames.iter().map(|f| f.len() as u64).collect();
    let (_, raw_len) = spillway::format::frame_layout(lens.iter().copied()).expect("frames lay out");
    let mut payload = vec![0u8; raw_len as usize];
    spillway::format::lay_out_frames(&mut payload, frames.iter().map(|f| &f[..]));
    let meta = spillway::StreamedValue {
        lz4: false,
        frame_lens: lens,
        raw_len,
        stored_len: raw_len,
        payload_crc: spillway::format::payload_crc(&payload),
    };
    (payload, meta)
}

/// A fake transfer server on an ephemeral loopback port that greets, reads one request, answers
/// The standing ticket test servers accept ([`open_to`]) and test clients send.
pub const TICKET: spillway::transfer::Ticket = spillway::transfer::Ticket::new(0, *b"spillway-tests!!");

/// Access to every key of `src` with [`TICKET`].
pub fn open_to<S: spillway::transfer::Source>(src: std::sync::Arc<S>) -> std::sync::Arc<spillway::transfer::Access<S>> {
    std::sync::Arc::new(spillway::transfer::Access::standing(src, TICKET).unwrap())
}

/// A raw GET request for `key` with `ticket`, as a client sends it.
pub fn raw_request(ticket: &spillway::transfer::Ticket, key: &[u8]) -> Vec<u8> {
    let mut r = vec![1u8];
    r.extend_from_slice(&ticket.to_bytes());
    r.extend_from_slice(&(key.len() as u32).to_le_bytes());
    r.extend_from_slice(key);
    r
}

/// with `response` (raw bytes), then hangs up. Returns its address.
pub fn fake_server(response: Vec<u8>) -> String {
    fake_server_answering(vec![response])
}

/// A fake transfer server that answers one connection's requests with `responses` (raw bytes), in
/// order, then hangs up: mid-value if a response is short.
pub fn fake_server_answering(responses: Vec<Vec<u8>>) -> String {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; 8];
        s.read_exact(&mut hello).unwrap();
        s.write_all(&spillway::transfer::greeting()).unwrap();
        for response in responses {
            let mut req = [0u8; 1 + spillway::transfer::TICKET_BYTES + 4];
            if s.read_exact(&mut req).is_err() {
                return;
            }
            let n = req.len();
            let mut key = vec![0u8; u32::from_le_bytes(req[n - 4..].try_into().unwrap()) as usize];
            s.read_exact(&mut key).unwrap();
            let _ = s.write_all(&response);
        }
    });
    addr
}
