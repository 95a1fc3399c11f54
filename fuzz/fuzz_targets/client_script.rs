//! The client against a scripted server that sends arbitrary bytes: every call returns (an error,
//! never a panic, an abort or an allocation past `max_value_bytes`); the first call's result is
//! what the bytes decode to by the plain in-memory reader (`read_value_header`, `stored::read`),
//! whichever way the client receives it (`get`, `get_into` a log, `get_to` a writer, `get` with an
//! expected size); a failed `get_into` leaves the key's old value; and after a failure that may
//! have left a response half read, every later call is refused rather than misreading.
//!
//! Input: byte 0 picks the calls (2 bits each: get, get_into, get_to, get with an expected size),
//! byte 1 bit 0 prepends a valid greeting to the script, bit 1 makes the expected size one off;
//! the rest is what the server sends after reading nothing. It is a real socket on 127.0.0.1 (the
//! server thread, started once, takes one script per connection).
#![no_main]

use libfuzzer_sys::fuzz_target;
use spillway::transfer::{self, Client, Ticket, TransferOptions};
use spillway::{Frames, LogOptions, SegmentLog, SimBackend};
use std::io::Write;
use std::net::{Shutdown, TcpListener};
use std::sync::mpsc::{sync_channel, SyncSender};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

const MAX: u64 = 1 << 20;

/// The scripted server: its address and where to hand it the next connection's script.
fn scripted() -> &'static (String, Mutex<SyncSender<Vec<u8>>>) {
    static SERVER: OnceLock<(String, Mutex<SyncSender<Vec<u8>>>)> = OnceLock::new();
    SERVER.get_or_init(|| {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (tx, rx) = sync_channel::<Vec<u8>>(1);
        std::thread::spawn(move || {
            for script in rx {
                let (mut s, _) = listener.accept().unwrap();
                s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
                // The client may close before reading it all.
                let _ = s.write_all(&script);
                let _ = s.shutdown(Shutdown::Write);
                let _ = std::io::copy(&mut s, &mut std::io::sink()); // until the client is done
            }
        });
        (addr, Mutex::new(tx))
    })
}

/// What the plain reader makes of a response: `Err` for anything malformed or an ERROR.
fn reference(mut r: &[u8]) -> Result<Option<Frames>, ()> {
    let (&status, rest) = r.split_first().ok_or(())?;
    r = rest;
    match status {
        0 => {
            let m = transfer::read_value_header(&mut r, MAX).map_err(|_| ())?;
            spillway::stored::read(&m, &mut r, MAX).map(Some).map_err(|_| ())
        }
        1 => Ok(None),
        _ => Err(()),
    }
}

fuzz_target!(|data: &[u8]| {
    let [calls, flags, script @ ..] = data else { return };
    let mut sent = Vec::new();
    if flags & 1 != 0 {
        sent.extend_from_slice(&transfer::greeting());
    }
    sent.extend_from_slice(script);
    let (addr, tx) = scripted();
    tx.lock().unwrap().send(sent.clone()).unwrap();
    let opts = TransferOptions { timeout: Duration::from_secs(5), max_value_bytes: MAX, ..Default::default() };
    // A greeting is 8 bytes: magic and version, then 2 reserved ones nobody checks (docs/wire.md).
    let greeted = sent.len() >= 8 && sent[..6] == transfer::greeting()[..6];
    let Ok(mut c) = Client::connect(addr.as_str(), Ticket::new(0, [1; 16]), opts) else {
        assert!(!greeted, "refused a valid greeting");
        return;
    };
    assert!(greeted, "took an invalid greeting");
    let want = reference(&sent[8..]);

    let log =
        SegmentLog::open(SimBackend::new(), "/s", LogOptions { segment_bytes: 1 << 20, ..Default::default() }).unwrap();
    let mut old = Frames::from(b"old".to_vec());
    log.put(b"k", &old).unwrap();
    let mut must_refuse = false;
    for i in 0..4 {
        let op = (calls >> (2 * i)) & 3;
        let got: Result<Option<Frames>, String> = match op {
            0 => c.get(b"x").map_err(|e| e.to_string()),
            1 => match c.get_into(b"x", &log, b"k") {
                Ok(true) => {
                    old = log.get(b"k").unwrap().expect("stored");
                    Ok(Some(old.clone()))
                }
                Ok(false) => Ok(None),
                Err(e) => {
                    assert_eq!(log.get(b"k").unwrap().as_ref(), Some(&old), "a failed fetch lost the old value: {e}");
                    Err(e.to_string())
                }
            },
            2 => {
                let mut out = Vec::new();
                c.get_to(b"x", &mut out).map(|had| had.then(|| Frames::from(out))).map_err(|e| e.to_string())
            }
            _ => {
                let total = match &want {
                    Ok(Some(v)) => v.total_len() as u64,
                    _ => 0,
                };
                c.expect_frames_total(total + u64::from(flags & 2 != 0));
                c.get(b"x").map_err(|e| e.to_string())
            }
        };
        if must_refuse {
            assert!(matches!(&got, Err(e) if e.contains("unusable")), "call {i} after a failure: {got:?}");
        }
        if i == 0 {
            let expected = match &want {
                Ok(Some(_)) if op == 3 && flags & 2 != 0 => Err(()),
                Ok(Some(v)) if op == 2 => Ok(Some(Frames::from(v.concat().to_vec()))),
                other => other.clone(),
            };
            match (&got, &expected) {
                (Ok(g), Ok(w)) => assert_eq!(g, w, "the client received other bytes"),
                (Err(_), Err(())) => {}
                _ => panic!("op {op}: the client says {got:?}, the plain reader {expected:?}"),
            }
        }
        // A failure that was not a whole ERROR response leaves the connection out of step.
        if matches!(&got, Err(e) if !e.contains("server error:")) {
            must_refuse = true;
        }
    }
});
