//! Peer transfer over 127.0.0.1: splice and copy send paths, the three receive paths, and every way a
//! peer can misbehave (bad greeting, oversized lengths, hang-ups mid-value, wrong checksums).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use spillway::transfer::{self, Client, TransferOptions};
use spillway::{Compression, Frames, LogOptions, PortableBackend, SegmentLog, StreamedValue};
use spillway_tests::{fake_server, fake_server_answering, frames_for, open_to, raw_request, value_for, TICKET};

fn opts() -> TransferOptions {
    TransferOptions { timeout: Duration::from_secs(10), ..Default::default() }
}

fn log_at(dir: &std::path::Path, compression: Compression) -> SegmentLog {
    SegmentLog::open(
        PortableBackend::new(),
        dir,
        LogOptions { segment_bytes: 8 << 20, compression, ..Default::default() },
    )
    .unwrap()
}

/// A server on an ephemeral loopback port, serving `log` from a background thread.
fn start_server(log: SegmentLog, copy: bool) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let o = TransferOptions { copy, splice_min_bytes: 0, ..opts() };
    std::thread::spawn(move || transfer::serve(open_to(Arc::new(log)), listener, o));
    addr
}

fn sizes() -> Vec<(String, usize)> {
    [0usize, 1, 63, 64, 65, 4096, 100_000, 5 << 20, 33 << 20].iter().map(|&n| (format!("v{n}"), n)).collect()
}

#[test]
fn values_arrive_intact_by_every_path_on_both_send_paths() {
    for (copy, compression) in [(false, Compression::None), (true, Compression::None), (false, Compression::Lz4)] {
        let src = tempfile::tempdir().unwrap();
        let log = log_at(src.path(), compression);
        for (k, n) in sizes() {
            log.put(k.as_bytes(), &frames_for(k.as_bytes(), n)).unwrap();
        }
        // Which records the sender stores compressed (the receiver must store the same form).
        let sent_lz4: Vec<bool> =
            sizes().iter().map(|(k, _)| log.stored_value(k.as_bytes()).unwrap().unwrap().meta.lz4).collect();
        assert_eq!(sent_lz4.iter().any(|&z| z), compression == Compression::Lz4);
        let addr = start_server(log, copy);
        let dst = tempfile::tempdir().unwrap();
        let into = log_at(dst.path(), Compression::None);
        let mut c = Client::connect(&addr, TICKET, opts()).unwrap();
        for (k, n) in sizes() {
            let want = frames_for(k.as_bytes(), n);
            assert_eq!(c.get(k.as_bytes()).unwrap().as_ref(), Some(&want), "{k} into memory");
            assert!(c.get_into(k.as_bytes(), &into, k.as_bytes()).unwrap(), "{k} into a log");
            assert_eq!(into.get(k.as_bytes()).unwrap().as_ref(), Some(&want), "{k} read back from the log");
            let mut out = Vec::new();
            assert!(c.get_to(k.as_bytes(), &mut out).unwrap());
            assert_eq!(out, want.concat(), "{k} streamed");
        }
        assert_eq!(c.get(b"absent").unwrap(), None);
        assert!(!c.get_into(b"absent", &into, b"absent").unwrap());
        assert!(into.verify().unwrap().is_empty());
        // The stored form travels as is: a received lz4 record is still lz4 on the receiver's disk
        // (whose log does not compress), and reads back after a reopen.
        drop(into);
        let into = log_at(dst.path(), Compression::None);
        assert_eq!(into.len(), sizes().len());
        for ((k, n), lz4) in sizes().iter().zip(&sent_lz4) {
            assert_eq!(into.stored_value(k.as_bytes()).unwrap().unwrap().meta.lz4, *lz4, "{k}");
            assert_eq!(into.get(k.as_bytes()).unwrap(), Some(frames_for(k.as_bytes(), *n)), "{k}");
        }
    }
}

fn meta(len: u64, crc: u32) -> StreamedValue {
    StreamedValue { lz4: false, frame_lens: vec![len], raw_len: len, stored_len: len, payload_crc: crc }
}

#[test]
fn a_sender_that_hangs_up_mid_value_leaves_nothing_behind() {
    let payload = value_for(b"cut", 3 << 20);
    let mut resp = transfer::encode_value_response(&meta(10 << 20, 0));
    resp.extend_from_slice(&payload); // 3 of the announced 10 MiB
    let addr = fake_server(resp);
    let dst = tempfile::tempdir().unwrap();
    let log = log_at(dst.path(), Compression::None);
    log.put(b"before", &Frames::from(b"kept".to_vec())).unwrap();
    let mut c = Client::connect(&addr, TICKET, opts()).unwrap();
    let err = c.get_into(b"k", &log, b"k").unwrap_err();
    assert_eq!(err.io_kind(), Some(std::io::ErrorKind::UnexpectedEof), "{err}");
    assert!(log.get(b"k").unwrap().is_none(), "no partial value is visible");
    // The log keeps working, and a reopen finds neither the partial value nor damage.
    log.put(b"after", &Frames::from(b"also kept".to_vec())).unwrap();
    drop(log);
    let log = log_at(dst.path(), Compression::None);
    assert!(log.get(b"k").unwrap().is_none());
    assert_eq!(log.get(b"before").unwrap().unwrap().concat(), &b"kept"[..]);
    assert_eq!(log.get(b"after").unwrap().unwrap().concat(), &b"also kept"[..]);
    assert!(log.verify().unwrap().is_empty());
    assert_eq!(log.recovery_report().truncated_bytes, 0, "the aborted bytes were zeroed, not left as a torn tail");
}

/// An ERROR response is a whole message: the connection stays usable for the next request. A
/// response cut short is not, and the client says so instead of reading out of step.
#[test]
fn the_connection_survives_an_error_response_but_not_a_short_one() {
    let error = |msg: &str| {
        let mut r = vec![2u8]; // ERROR
        r.extend_from_slice(&(msg.len() as u32).to_le_bytes());
        r.extend_from_slice(msg.as_bytes());
        r
    };
    let payload = value_for(b"after", 5000);
    let mut value =
        transfer::encode_value_response(&meta(payload.len() as u64, spillway::format::payload_crc(&payload)));
    value.extend_from_slice(&payload);
    let mut c =
        Client::connect(fake_server_answering(vec![error("no such luck"), value.clone()]), TICKET, opts()).unwrap();
    let e = c.get(b"first").unwrap_err();
    assert!(e.to_string().contains("server error: no such luck"), "{e}");
    assert_eq!(c.get(b"after").unwrap().unwrap().concat(), &payload[..]);
    // A value cut short: an error, and the connection is not used again.
    let mut c = Client::connect(fake_server(value[..100].to_vec()), TICKET, opts()).unwrap();
    assert!(c.get(b"cut").is_err());
    let e = c.get(b"after").unwrap_err();
    assert!(e.to_string().contains("unusable"), "{e}");
}

/// A value the receiving log refuses before reading its payload (a key too long to store under, here)
/// leaves the payload unread on the connection: the connection must not be used again, or the next
/// request reads payload bytes as its response (a payload byte of 1 would be a false "not found").
#[test]
fn a_value_refused_by_the_receiving_log_leaves_the_connection_unusable() {
    let payload = vec![1u8; 5000]; // 1 = NOT_FOUND, were it read as a status
    let mut value =
        transfer::encode_value_response(&meta(payload.len() as u64, spillway::format::payload_crc(&payload)));
    value.extend_from_slice(&payload);
    let mut c = Client::connect(fake_server_answering(vec![value.clone(), value]), TICKET, opts()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let log = log_at(tmp.path(), Compression::None);
    let long = vec![b'k'; spillway::format::MAX_KEY_BYTES + 1];
    let e = c.get_into(b"k", &log, &long).unwrap_err();
    assert!(matches!(e, spillway::Error::KeyTooLarge { .. }), "{e}");
    let e = c.get(b"next").unwrap_err();
    assert!(e.to_string().contains("unusable"), "{e}");
    // A key refused before anything was sent keeps the connection in step.
    let mut c = Client::connect(fake_server_answering(vec![vec![1u8]]), TICKET, opts()).unwrap();
    assert!(matches!(c.get(&long).unwrap_err(), spillway::Error::KeyTooLarge { .. }));
    assert!(c.get(b"k").unwrap().is_none());
}

#[test]
fn a_wrong_checksum_is_an_error_and_stores_nothing() {
    let payload = value_for(b"crc", 200_000);
    let good = spillway::format::payload_crc(&payload);
    let mut resp = transfer::encode_value_response(&meta(payload.len() as u64, good ^ 1));
    resp.extend_from_slice(&payload);
    let dst = tempfile::tempdir().unwrap();
    let log = log_at(dst.path(), Compression::None);
    let mut c = Client::connect(fake_server(resp.clone()), TICKET, opts()).unwrap();
    let err = c.get_into(b"k", &log, b"k").unwrap_err();
    assert!(matches!(err, spillway::Error::ChecksumMismatch { .. }), "{err}");
    assert_eq!(err.location(), None, "bytes from a peer have no place on disk: {err}");
    assert!(err.to_string().contains("received from a peer"), "{err}");
    assert!(log.get(b"k").unwrap().is_none());
    let mut c = Client::connect(fake_server(resp), TICKET, opts()).unwrap();
    assert!(matches!(c.get(b"k").unwrap_err(), spillway::Error::ChecksumMismatch { .. }));
}

#[test]
fn oversized_and_malformed_responses_are_refused_before_allocating() {
    let o = TransferOptions { max_value_bytes: 1 << 20, ..opts() };
    // Announces 1 TiB.
    let mut c =
        Client::connect(fake_server(transfer::encode_value_response(&meta(1 << 40, 0))), TICKET, o.clone()).unwrap();
    assert!(matches!(c.get(b"k").unwrap_err(), spillway::Error::Protocol(_)));
    // Frame lengths that do not lay out to the announced length.
    let mut bad = meta(100, 0);
    bad.frame_lens = vec![50, 49];
    let mut c = Client::connect(fake_server(transfer::encode_value_response(&bad)), TICKET, o.clone()).unwrap();
    assert!(matches!(c.get(b"k").unwrap_err(), spillway::Error::Protocol(_)));
    // An lz4 value of 10 bytes announcing 1 MiB (within max_value_bytes, but more than lz4 can
    // expand 10 bytes to): refused before the 1 MiB is allocated.
    let mut lz = meta(1 << 20, 0);
    lz.lz4 = true;
    lz.stored_len = 10;
    let mut c = Client::connect(fake_server(transfer::encode_value_response(&lz)), TICKET, o.clone()).unwrap();
    assert!(
        matches!(c.get(b"k").unwrap_err(), spillway::Error::Protocol(m) if m.contains("cannot be the compression"))
    );
    // An lz4 "block" of 1 MiB for a 64-byte value: longer than any compression of 64 bytes (the
    // LZ4 bound), refused before the 1 MiB is allocated or read.
    let mut lz = meta(64, 0);
    lz.lz4 = true;
    lz.stored_len = 1 << 20;
    let mut c = Client::connect(fake_server(transfer::encode_value_response(&lz)), TICKET, o.clone()).unwrap();
    assert!(
        matches!(c.get(b"k").unwrap_err(), spillway::Error::Protocol(m) if m.contains("cannot be the compression"))
    );
    // An unknown status byte.
    let mut c = Client::connect(fake_server(vec![9]), TICKET, o).unwrap();
    assert!(matches!(c.get(b"k").unwrap_err(), spillway::Error::Protocol(_)));
}

#[test]
fn the_server_refuses_bad_peers_and_keeps_serving() {
    let src = tempfile::tempdir().unwrap();
    let log = log_at(src.path(), Compression::None);
    log.put(b"k", &frames_for(b"k", 8 << 20)).unwrap();
    let addr = start_server(log, false);
    // Wrong magic: an error response, then the connection closes.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(b"HTTP/1.1").unwrap();
    let mut got = Vec::new();
    s.read_to_end(&mut got).unwrap();
    assert!(String::from_utf8_lossy(&got).contains("bad magic"), "{got:?}");
    // A future protocol version.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut h = transfer::greeting();
    h[4] = 99;
    s.write_all(&h).unwrap();
    let mut got = Vec::new();
    s.read_to_end(&mut got).unwrap();
    assert!(String::from_utf8_lossy(&got).contains("version 99"), "{}", String::from_utf8_lossy(&got));
    // A key length over the limit.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    s.write_all(&transfer::greeting()).unwrap();
    let mut req = raw_request(&TICKET, b"");
    req[1 + transfer::TICKET_BYTES..].copy_from_slice(&[0xff, 0xff, 0xff, 0x7f]);
    s.write_all(&req).unwrap();
    let mut got = Vec::new();
    s.read_to_end(&mut got).unwrap();
    assert!(String::from_utf8_lossy(&got).contains("malformed request"));
    // A client that hangs up mid-value: the server drops that connection only.
    let mut s = TcpStream::connect(&addr).unwrap();
    s.write_all(&transfer::greeting()).unwrap();
    s.write_all(&raw_request(&TICKET, b"k")).unwrap();
    let mut part = vec![0u8; 100_000];
    s.read_exact(&mut part).unwrap();
    drop(s);
    // Still serving, correctly.
    let mut c = Client::connect(&addr, TICKET, opts()).unwrap();
    assert_eq!(c.get(b"k").unwrap().unwrap(), frames_for(b"k", 8 << 20));
}

#[test]
fn a_short_lz4_block_is_an_error_not_a_panic_and_the_client_stops_reading() {
    // A valid lz4 block of 10 bytes announced as a 1000-byte value, with a matching checksum.
    let block = lz4_flex::block::compress(&[7u8; 10]);
    let m = StreamedValue {
        lz4: true,
        frame_lens: vec![1000],
        raw_len: 1000,
        stored_len: block.len() as u64,
        payload_crc: spillway::format::payload_crc(&block),
    };
    let mut resp = transfer::encode_value_response(&m);
    resp.extend_from_slice(&block);
    for path in ["memory", "writer"] {
        let mut c = Client::connect(fake_server(resp.clone()), TICKET, opts()).unwrap();
        let err = match path {
            "memory" => c.get(b"k").unwrap_err(),
            _ => c.get_to(b"k", &mut Vec::new()).unwrap_err(),
        };
        assert!(matches!(err, spillway::Error::Protocol(_)), "{path}: {err}");
        // The connection may be out of step: later calls refuse instead of misreading.
        assert!(matches!(c.get(b"k").unwrap_err(), spillway::Error::Protocol(m) if m.contains("unusable")));
    }
}

/// An lz4 block with the right checksum that does not decompress to the length its header
/// announces is refused by a receiving log before it replaces anything, whether it is read into
/// memory first (small) or streamed into a segment of its own (over 1 MiB): the key keeps its old
/// value, and the log goes on.
#[test]
fn an_lz4_block_that_does_not_decode_is_not_stored_and_the_old_value_stays() {
    use rand::{RngCore, SeedableRng};
    let mut noise = vec![0u8; 2 << 20];
    rand::rngs::StdRng::seed_from_u64(1).fill_bytes(&mut noise);
    // Each block decompresses to 64 bytes less than announced.
    for data in [vec![7u8; 936], noise] {
        let block = lz4_flex::block::compress(&data);
        let raw = data.len() as u64 + 64;
        let m = StreamedValue {
            lz4: true,
            frame_lens: vec![raw],
            raw_len: raw,
            stored_len: block.len() as u64,
            payload_crc: spillway::format::payload_crc(&block),
        };
        let mut resp = transfer::encode_value_response(&m);
        resp.extend_from_slice(&block);
        let dst = tempfile::tempdir().unwrap();
        let log = log_at(dst.path(), Compression::None);
        log.put(b"k", &frames_for(b"old", 100)).unwrap();
        let mut c = Client::connect(fake_server(resp), TICKET, opts()).unwrap();
        let err = c.get_into(b"k", &log, b"k").unwrap_err();
        assert!(
            matches!(&err, spillway::Error::Protocol(m) if m.contains("does not decompress")),
            "{} stored bytes: {err}",
            block.len()
        );
        assert_eq!(log.get(b"k").unwrap(), Some(frames_for(b"old", 100)), "{} stored bytes", block.len());
        log.put(b"after", &frames_for(b"after", 100)).unwrap();
        assert_eq!(log.get(b"after").unwrap(), Some(frames_for(b"after", 100)));
    }
}

/// A fake server on an ephemeral loopback port that answers one request (for a key of `key_len`
/// bytes) with the header of `m` and then runs `rest` on the connection. Returns its address.
fn announce_then(m: StreamedValue, key_len: usize, rest: impl FnOnce(&mut TcpStream) + Send + 'static) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; 8];
        s.read_exact(&mut hello).unwrap();
        s.write_all(&transfer::greeting()).unwrap();
        let mut req = vec![0u8; raw_request(&TICKET, &vec![0; key_len]).len()];
        s.read_exact(&mut req).unwrap();
        s.write_all(&transfer::encode_value_response(&m)).unwrap();
        rest(&mut s);
    });
    addr
}

/// [`announce_then`] with a 1 GiB value, for key "k".
fn announce_a_gib_then(rest: impl FnOnce(&mut TcpStream) + Send + 'static) -> String {
    let m =
        StreamedValue { lz4: false, frame_lens: vec![1 << 30], raw_len: 1 << 30, stored_len: 1 << 30, payload_crc: 0 };
    announce_then(m, 1, rest)
}

/// A peer that announces a large value and stalls holds little of the receiver's disk, and not for
/// long: the receiving log reserves its segment's space as the bytes arrive (at most 64 MiB past
/// them), not as announced, and the transfer must keep its pace from the first byte (`timeout +
/// bytes so far / min_bytes_per_sec`), so a trickle is cut off after about `timeout` however much
/// it announced. Nothing of the value stays behind.
#[test]
fn a_peer_that_announces_a_large_value_and_stalls_holds_little_disk_and_is_cut_off() {
    // Disk: the value's own segment, while 4 KiB of the announced 1 GiB have arrived.
    let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
    let addr = announce_a_gib_then(move |s| {
        s.write_all(&[1u8; 4096]).unwrap();
        let _ = go_rx.recv_timeout(Duration::from_secs(60)); // then hang up
    });
    let dst = tempfile::tempdir().unwrap();
    let log = Arc::new(log_at(dst.path(), Compression::None));
    let receiving = {
        let log = log.clone();
        std::thread::spawn(move || {
            let o = TransferOptions { timeout: Duration::from_secs(60), ..opts() };
            Client::connect(&addr, TICKET, o).unwrap().get_into(b"k", &log, b"k").map_err(|e| e.to_string())
        })
    };
    let largest = || {
        std::fs::read_dir(dst.path().join("segments"))
            .unwrap()
            .filter_map(|e| e.ok()?.metadata().ok())
            .map(|m| {
                use std::os::unix::fs::MetadataExt;
                (m.len(), m.blocks() * 512)
            })
            .max()
    };
    // The value's segment has its first reservation once it has a size: poll for it, bounded.
    let seen = (0..6000).find_map(|_| match largest() {
        Some((len, blocks)) if len > (8 << 20) || blocks > (8 << 20) => Some((len, blocks)),
        _ => {
            std::thread::sleep(Duration::from_millis(10));
            None
        }
    });
    let (len, blocks) = seen.expect("the value's segment appears");
    assert!(len <= (65 << 20) && blocks <= (65 << 20), "{len} bytes long, {blocks} allocated, for 4 KiB received");
    go_tx.send(()).unwrap();
    let err = receiving.join().unwrap().unwrap_err();
    assert!(err.contains("stopped before the whole value"), "{err}");
    assert_eq!(log.get(b"k").unwrap(), None);

    // Time: a byte every 100 ms, each within the 1 s socket timeout, for 10 s at most.
    let addr = announce_a_gib_then(|s| {
        for _ in 0..100 {
            if s.write_all(&[1u8]).is_err() {
                return; // cut off
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    });
    let o = TransferOptions { timeout: Duration::from_secs(1), min_bytes_per_sec: 1 << 20, ..opts() };
    let err = Client::connect(&addr, TICKET, o).unwrap().get_into(b"k", &log, b"k").unwrap_err().to_string();
    assert!(err.contains("not through in time"), "the trickle of a value announced as 1 GiB ran out: {err}");
    assert_eq!(log.get(b"k").unwrap(), None);
}

/// A server of one key ("k" = "v") with `max_connections = 1`, and the client that holds that
/// place (having read the key once). The temporary directory lives as long as the first item.
fn serve_with_one_place_taken() -> (tempfile::TempDir, String, Client) {
    let src = tempfile::tempdir().unwrap();
    let log = log_at(src.path(), Compression::None);
    log.put(b"k", &Frames::from(b"v".to_vec())).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let o = TransferOptions { max_connections: 1, ..opts() };
    std::thread::spawn(move || transfer::serve(open_to(Arc::new(log)), listener, o));
    let mut first = Client::connect(&addr, TICKET, opts()).unwrap();
    assert_eq!(first.get(b"k").unwrap().unwrap().concat(), &b"v"[..]);
    (src, addr, first)
}

#[test]
fn connections_over_the_limit_are_told_why() {
    let (_src, addr, first) = serve_with_one_place_taken();
    let err = Client::connect(&addr, TICKET, opts()).and_then(|mut c| c.get(b"k")).unwrap_err();
    assert!(err.to_string().contains("too many connections"), "{err}");
    drop(first);
}

/// Threads of this process named `name` (as /proc shows it: 15 bytes at most).
fn threads_named(name: &str) -> usize {
    std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|comm| comm.trim_end() == name)
        .count()
}

/// A flood of connections over the limit costs at most `MAX_REFUSING` refusing threads (each waits
/// up to a second for a greeting that never comes); the rest are closed unanswered. Every flooding
/// client is answered or closed, and the server still serves once its place is free.
#[test]
fn a_flood_over_the_limit_costs_a_bounded_number_of_threads() {
    let (_src, addr, first) = serve_with_one_place_taken();
    // Silent clients: no greeting, so each refusal would wait out its second.
    let flood: Vec<TcpStream> = (0..64).map(|_| TcpStream::connect(&addr).unwrap()).collect();
    let mut most = 0;
    for _ in 0..200 {
        most = most.max(threads_named("spillway-refuse"));
        std::thread::sleep(Duration::from_millis(2));
    }
    // One more may belong to `connections_over_the_limit_are_told_why`, running alongside.
    assert!(most <= transfer::MAX_REFUSING + 1, "{most} refusing threads at once");
    for mut s in flood {
        s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
        let mut buf = Vec::new();
        // EOF or a reset (closed unanswered), or the greeting and the refusal, then EOF.
        match s.read_to_end(&mut buf) {
            Ok(_) => assert!(buf.is_empty() || String::from_utf8_lossy(&buf).contains("too many connections")),
            Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
        }
    }
    drop(first);
    // The place is given back when the first connection's thread sees it close: bounded retries.
    let mut served = false;
    for _ in 0..200 {
        if let Ok(mut c) = Client::connect(&addr, TICKET, opts()) {
            if let Ok(Some(v)) = c.get(b"k") {
                assert_eq!(v.concat(), &b"v"[..]);
                served = true;
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(served, "the server serves again once its place is free");
}

/// `serve` returns `Ok` when its listener is shut down from another thread; connections it was
/// serving go on.
#[test]
fn a_shut_down_listener_ends_serve() {
    let src = tempfile::tempdir().unwrap();
    let log = log_at(src.path(), Compression::None);
    log.put(b"k", &Frames::from(b"v".to_vec())).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let handle = listener.try_clone().unwrap();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(transfer::serve(open_to(Arc::new(log)), listener, opts()));
    });
    let mut c = Client::connect(addr.as_str(), TICKET, opts()).unwrap();
    assert_eq!(c.get(b"k").unwrap().unwrap().concat(), &b"v"[..]);
    transfer::shutdown_listener(&handle).unwrap();
    let ended = done_rx.recv_timeout(std::time::Duration::from_secs(30)).expect("serve returned");
    assert!(ended.is_ok(), "{ended:?}");
    // The connection being served when it stopped still works.
    assert_eq!(c.get(b"k").unwrap().unwrap().concat(), &b"v"[..]);
}

/// A server whose segment files are O_DIRECT sends its values whole by both paths: splicing from an
/// O_DIRECT file at a payload offset that is only 64-byte aligned must not fail the connection.
#[test]
fn values_arrive_intact_from_o_direct_segments() {
    let src = tempfile::tempdir().unwrap();
    let log = SegmentLog::open(
        PortableBackend::with_direct(true),
        src.path(),
        LogOptions { segment_bytes: 8 << 20, ..Default::default() },
    )
    .unwrap();
    if !log.backend().direct() {
        eprintln!("skipped: O_DIRECT refused in {}", src.path().display());
        return;
    }
    let sizes = [100_000usize, (1 << 20) + 3, 5 << 20];
    for n in sizes {
        let k = format!("v{n}");
        log.put(k.as_bytes(), &frames_for(k.as_bytes(), n)).unwrap();
    }
    let addr = start_server(log, false);
    let mut c = Client::connect(&addr, TICKET, opts()).unwrap();
    for n in sizes {
        let k = format!("v{n}");
        let want = frames_for(k.as_bytes(), n);
        assert_eq!(c.get(k.as_bytes()).unwrap().as_ref(), Some(&want), "{k}");
    }
}

/// A signal handler that runs on the serving thread or the receiving thread in the middle of a
/// value (a profiler's timer, SIGCHLD) does not cut the value short: a socket call on a socket with
/// timeouts is never restarted after a handler, whatever SA_RESTART, so the splices and reads get
/// EINTR, which they retry instead of giving up.
#[test]
fn signal_handlers_running_mid_value_do_not_cut_it_short() {
    extern "C" fn nothing(_: libc::c_int) {}
    // SAFETY: a zeroed `sigaction` is a valid value of the C struct; the handler does nothing (so
    // it is async-signal-safe), and SIGUSR1 is used by nothing else in this test process.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = nothing as extern "C" fn(libc::c_int) as libc::sighandler_t;
        sa.sa_flags = libc::SA_RESTART;
        assert_eq!(libc::sigaction(libc::SIGUSR1, &sa, std::ptr::null_mut()), 0);
    }
    let src = tempfile::tempdir().unwrap();
    let log = log_at(src.path(), Compression::None);
    let n = 32 << 20;
    log.put(b"big", &frames_for(b"big", n)).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let server = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        // SAFETY: pthread_self has no preconditions.
        tid_tx.send(unsafe { libc::pthread_self() }).unwrap();
        transfer::serve_connection(&open_to(Arc::new(log)), s, &TransferOptions { splice_min_bytes: 0, ..opts() })
    });
    let mut c = Client::connect(&addr, TICKET, opts()).unwrap();
    // SAFETY: as above.
    let threads = [tid_rx.recv().unwrap(), unsafe { libc::pthread_self() }];
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let signaller = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            let mut sent = 0u32;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) && sent < 100_000 {
                for &t in &threads {
                    // SAFETY: both threads are alive until `stop` is set (the server's until the
                    // client below hangs up, after this thread is joined).
                    unsafe { libc::pthread_kill(t, libc::SIGUSR1) };
                }
                sent += 1;
                std::thread::sleep(Duration::from_micros(500));
            }
        })
    };
    /// Takes its time, so the server often waits in splice for room in the socket.
    struct Slow(Vec<u8>);
    impl Write for Slow {
        fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
            std::thread::sleep(Duration::from_micros(300));
            self.0.extend_from_slice(b);
            Ok(b.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut out = Slow(Vec::new());
    let got = c.get_to(b"big", &mut out);
    let again = c.get(b"big");
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    signaller.join().unwrap();
    assert!(got.unwrap(), "the value arrived");
    assert!(out.0 == frames_for(b"big", n).concat(), "whole and intact");
    assert_eq!(again.unwrap().map(|f| f.concat().to_vec()), Some(out.0), "the connection stays usable");
    drop(c);
    server.join().unwrap().unwrap();
}

/// A key that is rewritten while a peer asks for it is sent (its old or new value), never
/// answered NOT_FOUND (as a server would that looked the key up, pinned the record, then saw that
/// the key had moved meanwhile and reported it absent).
#[test]
fn a_key_rewritten_while_it_is_requested_is_never_reported_absent() {
    let src = tempfile::tempdir().unwrap();
    let log = Arc::new(log_at(src.path(), Compression::None));
    let value = frames_for(b"k", 100);
    log.put(b"k", &value).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let served = log.clone();
    std::thread::spawn(move || {
        transfer::serve(open_to(served), listener, TransferOptions { splice_min_bytes: 0, ..opts() })
    });
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (log, stop, value) = (log.clone(), stop.clone(), value.clone());
        std::thread::spawn(move || {
            let mut puts = 0u32;
            while !stop.load(std::sync::atomic::Ordering::SeqCst) && puts < 2_000_000 {
                log.put(b"k", &value).unwrap();
                puts += 1;
            }
        })
    };
    let mut c = Client::connect(&addr, TICKET, opts()).unwrap();
    let answers: Vec<Option<Frames>> = (0..3000).map(|_| c.get(b"k").unwrap()).collect();
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    writer.join().unwrap();
    let absent = answers.iter().filter(|a| a.is_none()).count();
    assert_eq!(absent, 0, "{absent} of {} requests answered NOT_FOUND", answers.len());
    assert!(answers.iter().all(|a| a.as_ref() == Some(&value)));
}

/// A client that hangs up in the middle of a spliced value, in the way that makes the server's
/// next splice fail with EPIPE (its own shutdown first, so the server is in CLOSE_WAIT, then a
/// close with unread data, a reset), does not kill the serving process with SIGPIPE where SIGPIPE
/// has its default action (a host process embedding the engine; Rust and Python programs ignore
/// it). std's socket writes pass MSG_NOSIGNAL; a splice cannot. Runs in a child process, which
/// restores the default action; the server reports the broken connection as an error.
#[test]
fn a_client_hanging_up_mid_splice_does_not_kill_the_server_with_sigpipe() {
    const NAME: &str = "a_client_hanging_up_mid_splice_does_not_kill_the_server_with_sigpipe";
    if spillway_tests::child_arg().is_none() {
        let (status, out) = spillway_tests::run_child(NAME, "child");
        assert!(status.success(), "the serving process died: {status:?}\n{out}");
        assert!(out.contains("served: broken connection"), "{out}");
        return;
    }
    // SAFETY: SIG_DFL is a valid disposition; this child process runs only this test.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let src = tempfile::tempdir().unwrap();
    let log = log_at(src.path(), Compression::None);
    log.put(b"big", &frames_for(b"big", 64 << 20)).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        transfer::serve_connection(&open_to(Arc::new(log)), s, &TransferOptions { splice_min_bytes: 0, ..opts() })
    });
    let mut sock = TcpStream::connect(addr).unwrap();
    sock.write_all(&transfer::greeting()).unwrap();
    let mut greeting = [0u8; 8];
    sock.read_exact(&mut greeting).unwrap();
    sock.write_all(&raw_request(&TICKET, b"big")).unwrap();
    let mut first = vec![0u8; 1 << 20];
    sock.read_exact(&mut first).unwrap();
    sock.shutdown(std::net::Shutdown::Write).unwrap();
    drop(sock); // unread data: a reset
    let served = server.join().unwrap();
    assert!(served.is_err(), "the value cannot have been sent whole");
    println!("served: broken connection ({})", served.unwrap_err());
}

/// A sender that trickles a value (a byte every 20 ms, each well within the socket timeout) is cut
/// off once it falls behind its pace (`timeout + bytes so far / min_bytes_per_sec`); the receiving
/// log, whose writer lock the stream holds, takes other puts again. Without the bound, the transfer
/// (and the lock) would be held for as long as the trickle lasted.
#[test]
fn a_trickling_sender_is_cut_off_and_the_receiving_log_goes_on() {
    let announced = 1 << 20;
    let (payload, meta) = spillway_tests::streamed(&frames_for(b"slow", announced));
    let addr = announce_then(meta, b"slow".len(), move |s| {
        for b in payload.iter().take(10_000) {
            if s.write_all(std::slice::from_ref(b)).is_err() {
                return; // the receiver gave up
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    let dst = tempfile::tempdir().unwrap();
    let log = Arc::new(log_at(dst.path(), Compression::None));
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    {
        let log = log.clone();
        std::thread::spawn(move || {
            // 1 s + the bytes so far at 1 MiB/s: cut off about 1 s after the header.
            let o = TransferOptions { timeout: Duration::from_secs(1), min_bytes_per_sec: 1 << 20, ..opts() };
            let r = Client::connect(&addr, TICKET, o).unwrap().get_into(b"slow", &log, b"slow");
            done_tx.send(r.map_err(|e| e.to_string())).unwrap();
        });
    }
    let r = done_rx.recv_timeout(Duration::from_secs(60)).expect("the trickle is cut off");
    let err = r.unwrap_err();
    assert!(err.contains("not through in time"), "{err}");
    assert_eq!(log.get(b"slow").unwrap(), None, "nothing published");
    log.put(b"after", &frames_for(b"after", 100)).unwrap();
    assert_eq!(log.get(b"after").unwrap(), Some(frames_for(b"after", 100)));
}

/// A server for one connection that cuts off a peer not through with a value within 1 s + size at
/// 4 MiB/s (3 s for 8 MiB), serving `log`; a raw client connected to it that has asked for "big".
/// Returns the client's socket and where the server's result arrives.
fn request_big_from_a_strict_server(
    log: Arc<SegmentLog>,
) -> (TcpStream, std::sync::mpsc::Receiver<Result<(), String>>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        let o = TransferOptions {
            timeout: Duration::from_secs(1),
            min_bytes_per_sec: 4 << 20,
            splice_min_bytes: 0,
            ..opts()
        };
        done_tx.send(transfer::serve_connection(&open_to(log), s, &o).map_err(|e| e.to_string())).unwrap();
    });
    let mut sock = TcpStream::connect(addr).unwrap();
    sock.write_all(&transfer::greeting()).unwrap();
    let mut greeting = [0u8; 8];
    sock.read_exact(&mut greeting).unwrap();
    sock.write_all(&raw_request(&TICKET, b"big")).unwrap();
    (sock, done_rx)
}

/// A client that reads a spliced value very slowly is cut off by the server once the value is not
/// through within `timeout + size / min_bytes_per_sec`: its connection slot is not held for good.
#[test]
fn a_client_reading_too_slowly_is_cut_off_by_the_server() {
    let src = tempfile::tempdir().unwrap();
    let log = log_at(src.path(), Compression::None);
    log.put(b"big", &frames_for(b"big", 8 << 20)).unwrap();
    let (mut sock, done_rx) = request_big_from_a_strict_server(Arc::new(log));
    let mut chunk = [0u8; 4096];
    let served = loop {
        if let Ok(r) = done_rx.try_recv() {
            break r;
        }
        match sock.read(&mut chunk) {
            Ok(0) | Err(_) => break done_rx.recv_timeout(Duration::from_secs(60)).expect("the server ends"),
            Ok(_) => std::thread::sleep(Duration::from_millis(20)), // about 200 KB/s
        }
    };
    let err = served.unwrap_err();
    assert!(err.contains("not through in time"), "{err}");
}

/// A reader that hands out `first` bytes of `payload`, says so on `started`, then waits for `go`
/// before the rest: a peer that holds a value back mid-stream.
struct HeldBack {
    payload: std::io::Cursor<Vec<u8>>,
    first: u64,
    started: Option<std::sync::mpsc::Sender<()>>,
    go: std::sync::mpsc::Receiver<()>,
}

impl Read for HeldBack {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let at = self.payload.position();
        if at >= self.first {
            if let Some(started) = self.started.take() {
                started.send(()).unwrap();
                self.go.recv().unwrap();
            }
        }
        let n = if at < self.first { buf.len().min((self.first - at) as usize) } else { buf.len() };
        self.payload.read(&mut buf[..n])
    }
}

/// Stream `frames` into `log` under `key` from a thread, held back after 1 MiB; returns once the
/// first MiB is in, with the way to let the rest go and the thread's result.
fn stream_held_back(
    log: &Arc<SegmentLog>,
    key: &'static [u8],
    frames: &Frames,
) -> (std::sync::mpsc::Sender<()>, std::thread::JoinHandle<spillway::Result<()>>) {
    let (payload, meta) = spillway_tests::streamed(frames);
    let (started, wait) = std::sync::mpsc::channel();
    let (go, held) = std::sync::mpsc::channel();
    let log = log.clone();
    let streaming = std::thread::spawn(move || {
        let mut src =
            HeldBack { payload: std::io::Cursor::new(payload), first: 1 << 20, started: Some(started), go: held };
        log.put_stream(key, &meta, &mut src)
    });
    wait.recv().unwrap();
    (go, streaming)
}

/// While a large value streams in from a peer that holds it back, the log takes puts, deletes,
/// other streams (large and small), reads and compaction: none waits for the peer (the value goes
/// into a segment of its own, without the writer lock). Everything is there after a reopen.
#[test]
fn writes_go_on_while_a_large_value_streams_in() {
    let dir = tempfile::tempdir().unwrap();
    let log = Arc::new(log_at(dir.path(), Compression::None));
    log.put(b"old", &frames_for(b"old", 1000)).unwrap();
    let (go, streaming) = stream_held_back(&log, b"big", &frames_for(b"big", 5 << 20));
    log.put(b"during", &frames_for(b"during", 3 << 20)).unwrap();
    assert!(log.delete(b"old").unwrap());
    for (k, n) in [(&b"small"[..], 10_000), (&b"second"[..], 3 << 20)] {
        let (payload, meta) = spillway_tests::streamed(&frames_for(k, n));
        log.put_stream(k, &meta, &mut &payload[..]).unwrap();
    }
    log.compact().unwrap();
    assert_eq!(log.get(b"big").unwrap(), None, "not before it is whole");
    go.send(()).unwrap();
    streaming.join().unwrap().unwrap();
    let check = |log: &SegmentLog| {
        assert_eq!(log.get(b"big").unwrap(), Some(frames_for(b"big", 5 << 20)));
        assert_eq!(log.get(b"during").unwrap(), Some(frames_for(b"during", 3 << 20)));
        assert_eq!(log.get(b"small").unwrap(), Some(frames_for(b"small", 10_000)));
        assert_eq!(log.get(b"second").unwrap(), Some(frames_for(b"second", 3 << 20)));
    };
    check(&log);
    assert!(log.verify().unwrap().is_empty());
    drop(Arc::into_inner(log).unwrap());
    let log = log_at(dir.path(), Compression::None);
    check(&log);
    assert_eq!(log.get(b"old").unwrap(), None);
}

/// Of two streams of one key, the one begun later wins, whichever ends first (as a recovery, which
/// goes by sequence numbers, would decide).
#[test]
fn of_two_streams_of_a_key_the_later_one_wins() {
    for later_ends_first in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let log = Arc::new(log_at(dir.path(), Compression::None));
        let (go_first, first) = stream_held_back(&log, b"k", &frames_for(b"first", 3 << 20));
        let (go_second, second) = stream_held_back(&log, b"k", &frames_for(b"second", 3 << 20));
        if later_ends_first {
            go_second.send(()).unwrap();
            second.join().unwrap().unwrap();
            go_first.send(()).unwrap();
            first.join().unwrap().unwrap();
        } else {
            go_first.send(()).unwrap();
            first.join().unwrap().unwrap();
            go_second.send(()).unwrap();
            second.join().unwrap().unwrap();
        }
        assert_eq!(log.get(b"k").unwrap(), Some(frames_for(b"second", 3 << 20)), "later_ends_first={later_ends_first}");
        drop(Arc::into_inner(log).unwrap());
        let log = log_at(dir.path(), Compression::None);
        assert_eq!(log.get(b"k").unwrap(), Some(frames_for(b"second", 3 << 20)), "later_ends_first={later_ends_first}");
    }
}

/// A crash while a value streams into its own segment: the reopened log has the key's old value,
/// reports no damage, and takes the same stream again.
#[test]
fn a_crash_mid_stream_leaves_the_old_value() {
    use spillway::SimBackend;
    let be = SimBackend::new();
    let o = || LogOptions { segment_bytes: 8 << 20, durable: true, ..Default::default() };
    let log = Arc::new(SegmentLog::open(be.clone(), "/s", o()).unwrap());
    log.put(b"k", &frames_for(b"old", 1000)).unwrap();
    log.sync().unwrap();
    let (payload, meta) = spillway_tests::streamed(&frames_for(b"new", 3 << 20));
    let (started, wait) = std::sync::mpsc::channel();
    let (go, held) = std::sync::mpsc::channel();
    let streaming = {
        let log = log.clone();
        let payload = payload.clone();
        let meta = meta.clone();
        std::thread::spawn(move || {
            let mut src =
                HeldBack { payload: std::io::Cursor::new(payload), first: 2 << 20, started: Some(started), go: held };
            log.put_stream(b"k", &meta, &mut src)
        })
    };
    wait.recv().unwrap();
    for seed in [None, Some(1), Some(2), Some(3)] {
        let crashed = SegmentLog::open(be.crash(seed), "/s", o()).unwrap();
        assert_eq!(crashed.get(b"k").unwrap(), Some(frames_for(b"old", 1000)), "{seed:?}");
        assert!(crashed.recovery_report().corrupt.is_empty(), "{seed:?}: {:?}", crashed.recovery_report());
        assert!(crashed.verify().unwrap().is_empty(), "{seed:?}");
        crashed.put_stream(b"k", &meta, &mut &payload[..]).unwrap();
        assert_eq!(crashed.get(b"k").unwrap(), Some(frames_for(b"new", 3 << 20)), "{seed:?}");
    }
    go.send(()).unwrap();
    streaming.join().unwrap().unwrap();
}

/// A put or delete of the key while its value streams in is the newer operation: the streamed
/// value is dead on arrival, before and after a reopen, and its segment goes.
#[test]
fn a_write_of_the_key_while_it_streams_in_wins() {
    for durable in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let o = LogOptions { segment_bytes: 8 << 20, durable, ..Default::default() };
        let log = Arc::new(SegmentLog::open(PortableBackend::new(), dir.path(), o.clone()).unwrap());
        let (go, put_meanwhile) = stream_held_back(&log, b"k", &frames_for(b"streamed", 3 << 20));
        log.put(b"k", &frames_for(b"put", 1000)).unwrap();
        go.send(()).unwrap();
        put_meanwhile.join().unwrap().unwrap();
        let (go, deleted_meanwhile) = stream_held_back(&log, b"gone", &frames_for(b"streamed", 3 << 20));
        log.put(b"gone", &frames_for(b"gone", 10)).unwrap();
        assert!(log.delete(b"gone").unwrap());
        go.send(()).unwrap();
        deleted_meanwhile.join().unwrap().unwrap();
        let check = |log: &SegmentLog| {
            assert_eq!(log.get(b"k").unwrap(), Some(frames_for(b"put", 1000)), "durable={durable}");
            assert_eq!(log.get(b"gone").unwrap(), None, "durable={durable}");
        };
        check(&log);
        log.sync().unwrap();
        let segments = log.stats().segments;
        drop(Arc::into_inner(log).unwrap());
        let log = SegmentLog::open(PortableBackend::new(), dir.path(), o).unwrap();
        check(&log);
        assert_eq!(log.stats().segments, segments, "the dead streamed segments are gone");
    }
}

/// A served log whose reads of one key fail with an I/O error naming the server's segment file.
struct FailingRead(SegmentLog);

impl transfer::Source for FailingRead {
    type Backend = PortableBackend;
    fn log_holding(&self, _: &spillway::StoredValue<<PortableBackend as spillway::Backend>::File>) -> &SegmentLog {
        &self.0
    }
    fn outgoing(
        &self,
        key: &[u8],
    ) -> spillway::Result<Option<transfer::Outgoing<<PortableBackend as spillway::Backend>::File>>> {
        if key == b"broken" {
            let path = std::path::PathBuf::from("/srv/secret-store/segments/00000001.seg");
            return Err(spillway::Error::io("read segment", path, std::io::Error::from_raw_os_error(libc::EIO)));
        }
        self.0.outgoing(key)
    }
}

/// What a server tells a peer about a failure says what failed, not where: the error names the
/// operation and the errno, never the server's paths; the connection goes on serving.
#[test]
fn an_error_response_names_what_failed_without_the_servers_paths() {
    let dir = tempfile::tempdir().unwrap();
    let log = log_at(dir.path(), Compression::None);
    let v = frames_for(b"fine", 3000);
    log.put(b"fine", &v).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || transfer::serve(open_to(Arc::new(FailingRead(log))), listener, opts()));
    let mut c = Client::connect(&addr, TICKET, opts()).unwrap();
    let e = c.get(b"broken").unwrap_err().to_string();
    assert!(e.contains("read segment") && e.contains("os error 5"), "{e}");
    assert!(!e.contains("/srv") && !e.contains("secret") && !e.contains(".seg"), "{e}");
    assert_eq!(c.get(b"fine").unwrap(), Some(v));
}

/// Descriptors of this process that point at `path` after it was unlinked.
fn open_deleted(path: &std::path::Path) -> usize {
    let deleted = format!("{} (deleted)", path.display());
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|target| target.to_string_lossy() == deleted)
        .count()
}

/// A value being sent to a peer that stops reading keeps its segment file open after the key is
/// forgotten and the segment deleted (the send reads the file, never memory): the disk space stays
/// taken, but only until the send's deadline (`timeout + size / min_bytes_per_sec`) cuts the peer
/// off. Then nothing holds the deleted file.
#[test]
fn a_stalled_peer_holds_a_deleted_segment_only_until_its_send_is_cut_off() {
    let src = tempfile::tempdir().unwrap();
    let log = Arc::new(
        SegmentLog::open(
            PortableBackend::new(),
            src.path(),
            LogOptions { segment_bytes: 1 << 20, durable: false, punch_forgotten: true, ..Default::default() },
        )
        .unwrap(),
    );
    log.put(b"big", &frames_for(b"big", 8 << 20)).unwrap();
    let mut i = 0;
    while log.location(b"small").is_none_or(|l| l.segment == log.location(b"big").unwrap().segment) {
        log.put(b"small", &frames_for(b"small", 1000 + i)).unwrap(); // until writes went on in another segment
        i += 1;
        assert!(i < 10_000, "writes never left the big value's segment");
    }
    let small = frames_for(b"small", 999 + i);
    let big = log.location(b"big").unwrap().segment;
    assert_ne!(big, log.location(b"small").unwrap().segment, "the big value's segment is not the active one");
    let seg = src.path().join(format!("segments/{big:08x}.seg"));
    let (mut sock, done_rx) = request_big_from_a_strict_server(log.clone());
    let mut first = vec![0u8; 64 << 10];
    sock.read_exact(&mut first).unwrap(); // the send is under way; the peer stops reading here

    assert!(log.forget(b"big").unwrap());
    assert!(!seg.exists(), "the dead segment is deleted");
    assert_eq!(open_deleted(&seg), 1, "the send holds the deleted file");
    let err = done_rx.recv_timeout(Duration::from_secs(60)).expect("the server ends").unwrap_err();
    assert!(err.contains("not through in time"), "{err}");
    assert_eq!(open_deleted(&seg), 0, "nothing holds the deleted file once the send is cut off");
    drop(sock);
    assert_eq!(log.get(b"small").unwrap(), Some(small));
}

/// A server on an ephemeral loopback port serving `access` from a background thread.
fn serve_access<S: transfer::Source>(access: Arc<transfer::Access<S>>, o: TransferOptions) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    std::thread::spawn(move || transfer::serve(access, listener, o));
    addr
}

fn refused(r: spillway::Result<Option<Frames>>) -> bool {
    matches!(r, Err(spillway::Error::Protocol(m)) if m.contains(transfer::NOT_AUTHORIZED))
}

/// Without the server's ticket nothing is served: no ticket (all zeros), a wrong secret, a forged
/// grant id. Each refusal ends its connection only; the right ticket is served meanwhile.
#[test]
fn requests_without_the_right_ticket_are_refused_and_others_are_served() {
    let src = tempfile::tempdir().unwrap();
    let log = log_at(src.path(), Compression::None);
    log.put(b"k", &frames_for(b"k", 100_000)).unwrap();
    let addr = serve_access(open_to(Arc::new(log)), opts());
    let mut good = Client::connect(&addr, TICKET, opts()).unwrap();
    let wrong = [
        transfer::Ticket::new(0, [0; 16]),
        transfer::Ticket::new(0, *b"spillway-tests!?"),
        transfer::Ticket::new(7, *b"spillway-tests!!"),
    ];
    for t in wrong {
        let mut c = Client::connect(&addr, t, opts()).unwrap();
        assert!(refused(c.get(b"k")), "{t:?} was not refused");
        assert!(c.get(b"k").is_err(), "a refused connection is closed");
        assert_eq!(good.get(b"k").unwrap().unwrap(), frames_for(b"k", 100_000));
    }
}

/// A grant opens one key once: the value as it was granted (the record stays pinned through a
/// delete and an overwrite), never another key, never twice, never after it expired or was revoked.
#[test]
fn a_grant_serves_its_key_once_as_granted() {
    let src = tempfile::tempdir().unwrap();
    let log = Arc::new(log_at(src.path(), Compression::None));
    log.put(b"a", &frames_for(b"a", 3 << 20)).unwrap();
    log.put(b"b", &frames_for(b"b", 1000)).unwrap();
    let access = Arc::new(transfer::Access::grants_only(Duration::from_secs(60)));
    let addr = serve_access(access.clone(), TransferOptions { splice_min_bytes: 0, ..opts() });
    assert_eq!(access.grant(&log, b"missing", None).unwrap(), None);

    let t = access.grant(&log, b"a", None).unwrap().unwrap();
    assert!(log.delete(b"a").unwrap());
    log.put(b"a", &frames_for(b"new", 10)).unwrap();
    let mut c = Client::connect(&addr, t, opts()).unwrap();
    assert_eq!(c.get(b"a").unwrap().unwrap(), frames_for(b"a", 3 << 20), "the value as granted");
    assert!(refused(Client::connect(&addr, t, opts()).unwrap().get(b"a")), "used once");
    // The standing ticket of another server means nothing here.
    assert!(refused(Client::connect(&addr, TICKET, opts()).unwrap().get(b"b")));

    let t = access.grant(&log, b"b", None).unwrap().unwrap();
    assert!(refused(Client::connect(&addr, t, opts()).unwrap().get(b"a")), "another key");
    assert!(refused(Client::connect(&addr, t, opts()).unwrap().get(b"b")), "burnt by the attempt");

    // Bound to another peer address: refused from 127.0.0.1; bound to it: served.
    let t = access.grant(&log, b"b", Some("10.1.2.3".parse().unwrap())).unwrap().unwrap();
    assert!(refused(Client::connect(&addr, t, opts()).unwrap().get(b"b")), "another peer");
    let t = access.grant(&log, b"b", Some("127.0.0.1".parse().unwrap())).unwrap().unwrap();
    assert_eq!(Client::connect(&addr, t, opts()).unwrap().get(b"b").unwrap().unwrap(), frames_for(b"b", 1000));

    let t = access.grant(&log, b"b", None).unwrap().unwrap();
    assert!(access.revoke(&t) && !access.revoke(&t));
    assert!(refused(Client::connect(&addr, t, opts()).unwrap().get(b"b")), "revoked");

    let short = Arc::new(transfer::Access::grants_only(Duration::from_millis(1)));
    let short_addr = serve_access(short.clone(), opts());
    let t = short.grant(&log, b"b", None).unwrap().unwrap();
    let mut c = Client::connect(&short_addr, t, opts()).unwrap();
    let granted = std::time::Instant::now();
    while granted.elapsed() < Duration::from_millis(2) {
        std::thread::yield_now();
    }
    assert!(refused(c.get(b"b")), "expired");

    // Every grant above was used, revoked or expired: none is left holding a record.
    assert_eq!(access.live_grants(), 0);
    let t = access.grant(&log, b"b", None).unwrap().unwrap();
    assert_eq!(Client::connect(&addr, t, opts()).unwrap().get(b"b").unwrap().unwrap(), frames_for(b"b", 1000));
}

/// A grant names the source it was made from without keeping it alive: a grant outstanding when
/// its log is dropped is refused, and the log's files are closed.
#[test]
fn a_grant_does_not_keep_its_log_alive() {
    let src = tempfile::tempdir().unwrap();
    let log = Arc::new(log_at(src.path(), Compression::None));
    log.put(b"a", &frames_for(b"a", 1000)).unwrap();
    let access = Arc::new(transfer::Access::grants_only(Duration::from_secs(60)));
    let addr = serve_access(access.clone(), opts());
    let t = access.grant(&log, b"a", None).unwrap().unwrap();
    let weak = Arc::downgrade(&log);
    drop(log);
    assert!(weak.upgrade().is_none(), "the grant holds no reference to the log");
    assert!(refused(Client::connect(&addr, t, opts()).unwrap().get(b"a")));
}

/// A request whose head trickles in, a byte at a time within the socket timeout, is cut off once
/// the whole request is not in within the timeout: it cannot hold a connection place for good, and
/// the place then serves others.
#[test]
fn a_trickled_request_is_cut_off_by_its_deadline() {
    let src = tempfile::tempdir().unwrap();
    let log = Arc::new(log_at(src.path(), Compression::None));
    log.put(b"k", &frames_for(b"k", 1000)).unwrap();
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let (s, _) = listener.accept().unwrap();
        let o = TransferOptions { timeout: Duration::from_millis(500), ..opts() };
        done_tx.send(transfer::serve_connection(&open_to(log), s, &o).map_err(|e| e.to_string())).unwrap();
    });
    let mut sock = TcpStream::connect(addr).unwrap();
    sock.write_all(&transfer::greeting()).unwrap();
    let mut greeting = [0u8; 8];
    sock.read_exact(&mut greeting).unwrap();
    let started = std::time::Instant::now();
    let mut sent = 0;
    let result = 'trickle: {
        for b in raw_request(&TICKET, b"k") {
            // Each byte comes well within the 500 ms socket timeout.
            if let Ok(r) = done_rx.recv_timeout(Duration::from_millis(100)) {
                break 'trickle r;
            }
            if sock.write_all(&[b]).is_err() {
                break 'trickle done_rx.recv_timeout(Duration::from_secs(10)).unwrap();
            }
            sent += 1;
        }
        panic!("the whole request trickled in over {:?} and was served", started.elapsed());
    };
    let err = result.unwrap_err();
    assert!(err.contains("receive request") || err.contains("receive key"), "{err}");
    assert!(err.contains("in time"), "{err}");
    assert!(sent < raw_request(&TICKET, b"k").len());

    // Through `serve` with one place: a peer that sends the first byte of a request and stalls
    // does not keep another client out.
    let src = tempfile::tempdir().unwrap();
    let log = log_at(src.path(), Compression::None);
    log.put(b"k", &frames_for(b"k", 1000)).unwrap();
    let o = TransferOptions { timeout: Duration::from_millis(500), max_connections: 1, ..opts() };
    let addr = serve_access(open_to(Arc::new(log)), o.clone());
    let mut stalled = TcpStream::connect(&addr).unwrap();
    stalled.write_all(&transfer::greeting()).unwrap();
    stalled.read_exact(&mut greeting).unwrap();
    stalled.write_all(&raw_request(&TICKET, b"k")[..1]).unwrap();
    let served =
        (0..1000).find_map(|_| match Client::connect(&addr, TICKET, o.clone()).and_then(|mut c| c.get(b"k")) {
            Ok(got) => Some(got),
            Err(_) => {
                std::thread::sleep(Duration::from_millis(10));
                None
            }
        });
    assert_eq!(served, Some(Some(frames_for(b"k", 1000))), "the stalled request kept the only place");
    drop(stalled);
}

/// Connections that have not had a request admitted (no ticket shown) give their places up, oldest
/// first, to newer ones: past `max_connections_per_peer` of them from one address, or past
/// `max_connections` in all. Admitted connections are not counted per address (the workers of one
/// host share it) and keep their places: with every place admitted, one more is refused.
#[test]
fn unadmitted_connections_give_their_places_up_to_peers_with_tickets() {
    let src = tempfile::tempdir().unwrap();
    let log = log_at(src.path(), Compression::None);
    log.put(b"k", &frames_for(b"k", 1000)).unwrap();
    let o = TransferOptions {
        max_connections: 4,
        max_connections_per_peer: 2,
        timeout: Duration::from_secs(120),
        ..opts()
    };
    let addr = serve_access(open_to(Arc::new(log)), o);
    // Two connections that greet and then say nothing: the per-address share of 127.0.0.1.
    let mut idle: Vec<TcpStream> = (0..2)
        .map(|_| {
            let mut s = TcpStream::connect(&addr).unwrap();
            s.write_all(&transfer::greeting()).unwrap();
            let mut greeting = [0u8; 8];
            s.read_exact(&mut greeting).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
            s
        })
        .collect();
    let cut_off = |s: &mut TcpStream| {
        let mut rest = Vec::new();
        // End of file (or a reset) well before the server's 120 s timeout would close it.
        s.read_to_end(&mut rest).map_or_else(|e| e.kind() == std::io::ErrorKind::ConnectionReset, |_| rest.is_empty())
    };
    // Peers with a ticket from the same address: the first takes the oldest idle one's place,
    // the next two find free places, the fourth takes the other idle one's.
    let mut served = Vec::new();
    for i in 0..4 {
        let mut c = Client::connect(&addr, TICKET, opts()).unwrap();
        assert_eq!(c.get(b"k").unwrap(), Some(frames_for(b"k", 1000)), "client {i} was kept out");
        served.push(c);
        if i == 0 {
            assert!(cut_off(&mut idle[0]), "the oldest idle connection keeps its place");
        }
    }
    assert!(cut_off(&mut idle[1]), "an idle connection keeps its place against a peer with a ticket");
    // Every place admitted: one more is refused, and told why.
    let err = Client::connect(&addr, TICKET, opts()).and_then(|mut c| c.get(b"k")).unwrap_err();
    assert!(err.to_string().contains("too many connections"), "{err}");
    for c in &mut served {
        assert_eq!(c.get(b"k").unwrap(), Some(frames_for(b"k", 1000)), "an admitted connection was cut off");
    }
}

/// `Access::close` cuts a value being sent, so that the source is no longer held (a closing log
/// does not wait for a slow peer), refuses grants and requests from then on, and closes new
/// connections at once. Expired grants are swept without any request.
#[test]
fn closing_an_access_cuts_its_transfers_and_lets_go_of_its_sources() {
    let src = tempfile::tempdir().unwrap();
    let log = Arc::new(log_at(src.path(), Compression::None));
    log.put(b"big", &frames_for(b"big", 32 << 20)).unwrap();
    let access = Arc::new(transfer::Access::grants_only(Duration::from_secs(60)));
    let addr = serve_access(access.clone(), TransferOptions { splice_min_bytes: 0, ..opts() });
    let t = access.grant(&log, b"big", None).unwrap().unwrap();
    let spare = access.grant(&log, b"big", None).unwrap().unwrap();
    let mut sock = TcpStream::connect(&addr).unwrap();
    sock.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    sock.write_all(&transfer::greeting()).unwrap();
    let mut greeting = [0u8; 8];
    sock.read_exact(&mut greeting).unwrap();
    sock.write_all(&raw_request(&t, b"big")).unwrap();
    let mut first = vec![0u8; 1 << 20];
    sock.read_exact(&mut first).unwrap(); // the send is under way, and holds the log
    assert!(Arc::strong_count(&log) > 1);
    access.close();
    let mut rest = Vec::new();
    let _ = sock.read_to_end(&mut rest); // ends (cut), long before 32 MiB
    assert!(rest.len() < 31 << 20, "the send was not cut: {} more bytes", rest.len());
    let freed = (0..1000).any(|_| {
        let one = Arc::strong_count(&log) == 1;
        if !one {
            std::thread::sleep(Duration::from_millis(10));
        }
        one
    });
    assert!(freed, "the serving thread still holds the log");
    assert_eq!(access.live_grants(), 0, "the spare grant went with the close");
    assert!(access.grant(&log, b"big", None).is_err(), "no grant after close");
    let refused = Client::connect(&addr, spare, opts()).and_then(|mut c| c.get(b"big"));
    assert!(refused.is_err(), "a request after close is not served");

    let short = transfer::Access::grants_only(Duration::from_millis(1));
    for _ in 0..3 {
        short.grant(&log, b"big", None).unwrap().unwrap();
    }
    let granted = std::time::Instant::now();
    while granted.elapsed() < Duration::from_millis(2) {
        std::thread::yield_now();
    }
    assert_eq!(short.live_grants(), 0, "expired grants are swept");
}

/// Durations from a caller of any size (a lifetime, a timeout, `Duration::MAX`) make deadlines
/// at most `MAX_WAIT` away: a grant, a served request and a fetch go on as usual, no `Instant`
/// overflows (which panicked the grant table under its lock, every server connection, and the
/// client).
#[test]
fn durations_of_any_size_never_overflow_a_deadline() {
    let src = tempfile::tempdir().unwrap();
    let log = Arc::new(log_at(src.path(), Compression::None));
    log.put(b"a", &frames_for(b"a", 100_000)).unwrap();
    let access = Arc::new(transfer::Access::grants_only(Duration::MAX));
    let huge = TransferOptions { timeout: Duration::MAX, splice_min_bytes: 0, min_bytes_per_sec: 1, ..opts() };
    let addr = serve_access(access.clone(), huge.clone());
    let t = access.grant(&log, b"a", None).unwrap().unwrap();
    let client_opts = TransferOptions { connect_timeout: Some(Duration::MAX), ..huge };
    let mut c = Client::connect(&addr, t, client_opts).unwrap();
    assert_eq!(c.get(b"a").unwrap().unwrap(), frames_for(b"a", 100_000));
}

/// A value whose frames say when they are let go of.
struct Pinned(Arc<std::sync::atomic::AtomicBool>);
impl AsRef<[u8]> for Pinned {
    fn as_ref(&self) -> &[u8] {
        b"pinned value"
    }
}
impl Drop for Pinned {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// A source whose one value is in memory, as `Pinned` frames.
struct Held {
    log: SegmentLog,
    released: Arc<std::sync::atomic::AtomicBool>,
}

impl transfer::Source for Held {
    type Backend = spillway::PortableBackend;
    fn log_holding(&self, _: &spillway::StoredValue<std::fs::File>) -> &SegmentLog {
        &self.log
    }
    fn outgoing(&self, _key: &[u8]) -> spillway::Result<Option<transfer::Outgoing<std::fs::File>>> {
        let frames = Frames(vec![bytes::Bytes::from_owner(Pinned(self.released.clone()))]);
        Ok(Some(transfer::Outgoing::Frames(frames)))
    }
}

/// A grant nobody redeems lets go of its value when it expires, with no request or grant to sweep
/// the table meanwhile (a requester that takes a reply and never comes kept a deleted segment's
/// descriptor, and its blocks, for as long as the server saw no other traffic).
#[test]
fn an_expired_grant_lets_go_of_its_value_without_other_traffic() {
    let dir = tempfile::tempdir().unwrap();
    let released = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let src = Arc::new(Held { log: log_at(dir.path(), Compression::None), released: released.clone() });
    let access = Arc::new(transfer::Access::grants_only(Duration::from_millis(100)));
    let _addr = serve_access(access.clone(), opts());
    let t = access.grant(&src, b"k", None).unwrap().unwrap();
    assert!(!released.load(std::sync::atomic::Ordering::SeqCst), "held by the grant");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !released.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(std::time::Instant::now() < deadline, "the expired grant still holds its value");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!access.revoke(&t), "expired");
}

/// A peer that paces the head of its answer (the greeting; a value's status, header and frame
/// table) one byte at a time, each well within the socket timeout, is cut off once the head as a
/// whole has taken the timeout: it cannot hold a client for a timeout per byte.
#[test]
fn a_trickled_greeting_or_response_head_is_cut_off_by_its_deadline() {
    let (payload, meta) = spillway_tests::streamed(&frames_for(b"k", 100));
    let head = transfer::encode_value_response(&meta);
    assert!(head.len() >= 10, "the head takes over 1 s at 200 ms a byte");
    let trickle = |s: &mut TcpStream, bytes: &[u8]| {
        for b in bytes {
            if s.write_all(std::slice::from_ref(b)).is_err() {
                return false; // the client gave up
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        true
    };
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        // First connection: the greeting trickles.
        let (mut s, _) = listener.accept().unwrap();
        let mut hello = [0u8; 8];
        s.read_exact(&mut hello).unwrap();
        trickle(&mut s, &transfer::greeting());
        // Second: the greeting comes at once, the value's head trickles, then the payload.
        let (mut s, _) = listener.accept().unwrap();
        s.read_exact(&mut hello).unwrap();
        s.write_all(&transfer::greeting()).unwrap();
        let mut req = vec![0u8; raw_request(&TICKET, b"k").len()];
        s.read_exact(&mut req).unwrap();
        if trickle(&mut s, &head) {
            let _ = s.write_all(&payload);
        }
    });
    let o = TransferOptions { timeout: Duration::from_secs(1), ..opts() };
    let err = Client::connect(addr, TICKET, o.clone()).err().expect("the trickled greeting is cut off").to_string();
    assert!(err.contains("receive hello") && err.contains("in time"), "{err}");
    let mut c = Client::connect(addr, TICKET, o).unwrap();
    let err = c.get(b"k").unwrap_err().to_string();
    assert!(err.contains("not through in time"), "{err}");
}
