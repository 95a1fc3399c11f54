//! What the transfer server logs when `accept` keeps failing (its own test binary: the logger and
//! the descriptor limit are the process's): once, then at most every `ACCEPT_WARN_EVERY`, where it
//! used to log every 10 ms for as long as the condition lasted.

use std::net::{TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use spillway::transfer::{self, TransferOptions};
use spillway::SegmentLog;

static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;
impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, r: &log::Record<'_>) {
        LINES.lock().unwrap().push(format!("{} {}", r.level(), r.args()));
    }
    fn flush(&self) {}
}

fn open_descriptors() -> u64 {
    std::fs::read_dir("/proc/self/fd").unwrap().count() as u64
}

#[test]
fn an_accept_that_keeps_failing_is_logged_once_not_every_try() {
    log::set_logger(&Capture).unwrap();
    log::set_max_level(log::LevelFilter::Warn);
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
    let failed: Vec<String> = LINES.lock().unwrap().iter().filter(|l| l.contains("accept failed")).cloned().collect();
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert!(failed[0].contains("Too many open files"), "{failed:?}");
}
