//! What the transfer server logs when `accept` keeps failing (its own test binary: the logger and
//! the descriptor limit are the process's): once, then at most every `ACCEPT_WARN_EVERY`, not at
//! every try (every 10 ms) for as long as the condition lasts.

use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use spillway::transfer::{self, TransferOptions};
use spillway::SegmentLog;

fn open_descriptors() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as u64
}

#[test]
fn an_accept_that_keeps_failing_is_logged_once_not_every_try() {
    spillway_tests::logs::capture(log::LevelFilter::Warn);
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let stopper = listener.try_clone().unwrap();
    // Connections the kernel completes in the listen queue, waiting for an accept.
    let waiting: Vec<TcpStream> = (0..4).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let access = Arc::new(transfer::Access::<SegmentLog>::grants_only(Duration::from_secs(60)));
    let opts = TransferOptions { timeout: Duration::from_secs(5), ..TransferOptions::default() };
    // No descriptor left for the accepts (EMFILE) for half a second: about 50 tries.
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Nofile);
    let server = std::thread::spawn(move || transfer::serve(access, listener, opts));
    let full = open_descriptors();
    setrlimit(Resource::Nofile, Rlimit { current: Some(full), maximum: limit.maximum }).unwrap();
    std::thread::sleep(Duration::from_millis(500));
    setrlimit(Resource::Nofile, limit).unwrap();
    transfer::shutdown_listener(&stopper).unwrap();
    server.join().unwrap().unwrap();
    drop(waiting);
    let failed: Vec<String> = spillway_tests::logs::lines_with("accept failed");
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(failed[0].contains("Too many open files"), "{failed:?}");
}
