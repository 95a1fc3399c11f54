//! What the transfer server logs when `accept` keeps failing (its own test binary: the logger and
//! the descriptor limit are the process's): once, then at most every `ACCEPT_WARN_EVERY`, not at
//! every try (every 10 ms) for as long as the condition lasts.

use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use spillway::transfer::{self, TransferOptions};
use spillway::SegmentLog;

/// Lower the process's descriptor limit to its highest open descriptor and take every free number
/// under it, so that nothing can open a descriptor until the returned files are dropped (a count of
/// the open descriptors is not enough: numbers under the highest may be free).
fn use_up_descriptors() -> Vec<std::fs::File> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let highest = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u64>().ok())
        .max()
        .unwrap();
    setrlimit(Resource::Nofile, Rlimit { current: Some(highest + 1), maximum: getrlimit(Resource::Nofile).maximum })
        .unwrap();
    let mut taken = Vec::new();
    loop {
        match std::fs::File::open("/dev/null") {
            Ok(f) => taken.push(f),
            Err(e) => {
                assert_eq!(e.raw_os_error(), Some(libc::EMFILE), "{e}");
                return taken;
            }
        }
    }
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
    // No descriptor left for the accepts (EMFILE) for half a second: about 50 tries. None to spare
    // from before the server starts: had it one, or had it taken the waiting connections first,
    // its accepts would not fail.
    use rustix::process::{getrlimit, setrlimit, Resource};
    let limit = getrlimit(Resource::Nofile);
    let fillers = use_up_descriptors();
    let server = std::thread::spawn(move || transfer::serve(access, listener, opts));
    std::thread::sleep(Duration::from_millis(500));
    drop(fillers);
    setrlimit(Resource::Nofile, limit).unwrap();
    transfer::shutdown_listener(&stopper).unwrap();
    server.join().unwrap().unwrap();
    drop(waiting);
    let failed: Vec<String> = spillway_tests::logs::lines_with("accept failed");
    assert_eq!(failed.len(), 1, "{:?}", spillway_tests::logs::lines());
    assert!(failed[0].contains("Too many open files"), "{failed:?}");
}
