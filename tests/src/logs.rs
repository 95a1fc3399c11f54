//! The process's log records from spillway, kept for a test binary to look at (the logger is global
//! to the process, so a test that captures it runs in a binary of its own).

use std::sync::Mutex;

static LINES: Mutex<Vec<String>> = Mutex::new(Vec::new());

struct Capture;

impl log::Log for Capture {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, r: &log::Record<'_>) {
        if r.target().starts_with("spillway") {
            LINES.lock().unwrap().push(format!("{} {}", r.level(), r.args()));
        }
    }
    fn flush(&self) {}
}

/// Keep every record from spillway at `level` or above ("LEVEL message"); once per process.
pub fn capture(level: log::LevelFilter) {
    log::set_logger(&Capture).expect("the first logger of this process");
    log::set_max_level(level);
}

/// The records kept so far that contain `part`.
pub fn lines_with(part: &str) -> Vec<String> {
    LINES.lock().unwrap().iter().filter(|l| l.contains(part)).cloned().collect()
}

/// Every record kept so far.
pub fn lines() -> Vec<String> {
    LINES.lock().unwrap().clone()
}
