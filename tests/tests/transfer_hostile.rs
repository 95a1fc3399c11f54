//! Peer transfer against hostile peers (its own test binary: one test reads the process's peak
//! virtual memory): silent connections that would cut off a peer holding a ticket, and a server
//! that announces a value it never sends.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use spillway::transfer::{self, Client, TransferOptions};
use spillway::{Compression, Frames, LogOptions, PortableBackend, SegmentLog, StreamedValue};
use spillway_tests::{fake_server, frames_for, raw_request, streamed, TICKET};

fn opts() -> TransferOptions {
    TransferOptions { timeout: Duration::from_secs(60), ..Default::default() }
}

fn log_at(dir: &std::path::Path) -> SegmentLog {
    let o = LogOptions { segment_bytes: 8 << 20, compression: Compression::None, ..Default::default() };
    SegmentLog::open(PortableBackend::new(), dir, o).unwrap()
}

/// A grants-only server on an ephemeral loopback port, with `o`: its access and address.
fn serve_grants(o: TransferOptions) -> (Arc<transfer::Access<SegmentLog>>, SocketAddr) {
    let access = Arc::new(transfer::Access::grants_only(Duration::from_secs(60)));
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let serving = access.clone();
    std::thread::spawn(move || transfer::serve(serving, listener, o));
    (access, addr)
}

/// A connection to `addr` from the loopback address `from` (127.0.0.x: each one its own peer
/// address to the server), which sends nothing.
fn connect_from(from: [u8; 4], addr: SocketAddr) -> TcpStream {
    use rustix::net::{bind, connect, socket, AddressFamily, SocketType};
    let fd = socket(AddressFamily::INET, SocketType::STREAM, None).unwrap();
    bind(&fd, &SocketAddr::from((from, 0))).unwrap();
    connect(&fd, &addr).unwrap();
    TcpStream::from(fd)
}

/// Whether the server cut `s` off: end of file (or a reset) before `wait`.
fn cut_off(s: &mut TcpStream, wait: Duration) -> bool {
    s.set_read_timeout(Some(wait)).unwrap();
    let mut rest = Vec::new();
    s.read_to_end(&mut rest).map_or_else(|e| e.kind() == std::io::ErrorKind::ConnectionReset, |_| rest.is_empty())
}

/// Silent connections (they connect and send nothing) from four other addresses, under the
/// per-address limit, filling every place and renewed again and again, never cut off a peer with
/// a ticket that has greeted: they take each other's places, oldest first, and its request is
/// served in full with its grant. (Before, each new connection took the place of the oldest
/// connection not yet admitted, which the ticket holder became once the older silent ones were
/// gone: eight new ones cut it off.)
#[test]
fn silent_connections_never_cut_off_a_peer_with_a_ticket() {
    let src = tempfile::tempdir().unwrap();
    let log = Arc::new(log_at(src.path()));
    log.put(b"k", &frames_for(b"k", 1 << 20)).unwrap();
    let o = TransferOptions { max_connections: 8, max_connections_per_peer: 4, ..opts() };
    let (access, addr) = serve_grants(o);
    let ticket = access.grant(&log, b"k", None).unwrap().unwrap();
    let from = |i: usize| [127, 0, 0, 2 + (i % 4) as u8];
    // Every place taken by a silent connection, two from each address. The server accepts in
    // the order of the connects.
    let _first: Vec<TcpStream> = (0..8).map(|i| connect_from(from(i), addr)).collect();
    // The ticket holder takes the oldest one's place; `connect` returns once the server has read
    // its greeting and answered it.
    let mut holder = Client::connect(addr, ticket, opts()).unwrap();
    // Nine more: the first seven take the places of the seven older silent ones, the next two
    // those of the oldest of the new (so the first of them is cut off once the eighth is placed;
    // before, the eighth cut off the ticket holder, the ninth the first new one).
    let mut more: Vec<TcpStream> = (0..9).map(|i| connect_from(from(i), addr)).collect();
    assert!(cut_off(&mut more[0], Duration::from_secs(30)), "the server did not place the new connections");
    let got = holder.get(b"k").map_err(|e| e.to_string());
    assert_eq!(got, Ok(Some(frames_for(b"k", 1 << 20))), "the ticket holder was cut off");
    assert_eq!(access.live_grants(), 0, "the grant was used");
}

/// With every other place admitted, a silent connection does not take the place of a ticket
/// holder that has greeted (before, it did: the ticket holder was the oldest connection not yet
/// admitted): it waits for its greeting, and having sent none is refused, told why. The ticket
/// holder is then served.
#[test]
fn a_silent_connection_does_not_take_the_place_of_a_peer_that_greeted() {
    let src = tempfile::tempdir().unwrap();
    let log = Arc::new(log_at(src.path()));
    log.put(b"k", &frames_for(b"k", 100_000)).unwrap();
    let o = TransferOptions { max_connections: 2, max_connections_per_peer: 4, ..opts() };
    let (access, addr) = serve_grants(o);
    let mut admitted = Client::connect(addr, access.grant(&log, b"k", None).unwrap().unwrap(), opts()).unwrap();
    assert_eq!(admitted.get(b"k").unwrap(), Some(frames_for(b"k", 100_000)));
    let mut holder = Client::connect(addr, access.grant(&log, b"k", None).unwrap().unwrap(), opts()).unwrap();
    let mut silent = connect_from([127, 0, 0, 2], addr);
    // Refused after the server waited (a second) for its greeting; before, it was served in the
    // ticket holder's place, and waited on for the server's timeout (60 s).
    silent.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut answer = Vec::new();
    let _ = silent.read_to_end(&mut answer);
    assert!(String::from_utf8_lossy(&answer).contains("too many connections"), "{answer:?}");
    let got = holder.get(b"k").map_err(|e| e.to_string());
    assert_eq!(got, Ok(Some(frames_for(b"k", 100_000))), "the ticket holder was cut off");
    assert_eq!(access.live_grants(), 0);
}

/// The process's peak virtual memory (`VmPeak`), in bytes.
fn vm_peak() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmPeak:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse::<u64>().unwrap() * 1024
}

/// A server that announces a value of 1 TiB (within the client's `max_value_bytes`), lz4 or not,
/// sends 4 KiB of it and hangs up: `get` and `get_to` fail with `UnexpectedEof`, having allocated
/// nothing like what was announced (before, they allocated the announced stored length first:
/// an allocation the system refuses aborts the process, and one it grants shows in `VmPeak`).
#[test]
fn an_announced_terabyte_is_not_allocated_before_it_arrives() {
    const TIB: u64 = 1 << 40;
    let o = TransferOptions { max_value_bytes: 2 * TIB, timeout: Duration::from_secs(10), ..Default::default() };
    for (lz4, path) in [(true, "get"), (true, "get_to"), (false, "get")] {
        let m = StreamedValue { lz4, frame_lens: vec![TIB], raw_len: TIB, stored_len: TIB, payload_crc: 0 };
        let mut response = transfer::encode_value_response(&m);
        response.extend_from_slice(&[7u8; 4096]);
        let mut c = Client::connect(fake_server(response), TICKET, o.clone()).unwrap();
        let err = match path {
            "get" => c.get(b"k").map(|_| ()).unwrap_err(),
            _ => c.get_to(b"k", &mut std::io::sink()).map(|_| ()).unwrap_err(),
        };
        assert_eq!(err.io_kind(), Some(std::io::ErrorKind::UnexpectedEof), "lz4 {lz4}, {path}: {err}");
    }
    let peak = vm_peak();
    assert!(peak < TIB / 4, "peak virtual memory {peak} bytes: the announcement was allocated");
}

/// `get_to` of a value of many frames (some empty) whose payload arrives in small pieces writes
/// every frame, back to back, exactly: each read looks at the frames it reaches, not at all of them.
#[test]
fn get_to_writes_many_frames_arriving_in_small_pieces() {
    let frames = Frames((0..3000u32).map(|i| Bytes::from(vec![(i % 251) as u8; (i as usize * 37) % 150])).collect());
    let (payload, m) = streamed(&frames);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        s.set_nodelay(true).unwrap();
        let mut hello = [0u8; 8];
        s.read_exact(&mut hello).unwrap();
        s.write_all(&transfer::greeting()).unwrap();
        let mut req = vec![0u8; raw_request(&TICKET, b"k").len()];
        s.read_exact(&mut req).unwrap();
        s.write_all(&transfer::encode_value_response(&m)).unwrap();
        for piece in payload.chunks(61) {
            s.write_all(piece).unwrap();
        }
    });
    let mut out = Vec::new();
    assert!(Client::connect(addr, TICKET, opts()).unwrap().get_to(b"k", &mut out).unwrap());
    assert!(out[..] == frames.concat()[..], "{} bytes written, {} expected", out.len(), frames.concat().len());
}
