//! The engine's `log` records in Python's `logging`, as loggers named after the Rust modules under
//! distributed's hierarchy (`distributed.spillway.store.evict`, ...; see `spillway/messages.py`), so
//! that dask's logging config and a worker's log handlers cover them.
//!
//! The bridge is installed by the first log, store, transfer server or fetch a process makes (not
//! by importing the module: a client or scheduler that only imports spillway gets no thread), at
//! the level Python's `distributed.spillway` logger has then: records below it are not even
//! formatted.
//!
//! The engine logs under its locks (a failed spill is reported while the store settles it). Taking
//! the GIL there would run Python code under the lock: logging handlers, and any finalizer that
//! pyo3's deferred reference counts release when the GIL is taken, which may call back into the
//! store and deadlock on its lock. So a record is only queued where it is logged (never blocking:
//! a full queue drops it and counts it), and one thread of its own takes the GIL to emit it.

use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Condvar, Mutex, Once, OnceLock, PoisonError};
use std::time::Duration;

use pyo3::prelude::*;

/// Records waiting to be emitted at most; more are dropped (and counted in the next one emitted).
const QUEUE: usize = 1024;

struct Msg {
    logger: String,
    level: u32,
    text: String,
}

/// How many records were queued and how many have been emitted (or dropped), for `flush`.
#[derive(Default)]
struct Progress {
    queued: u64,
    done: u64,
    dropped: u64,
}

struct Bridge {
    tx: SyncSender<Msg>,
    progress: Mutex<Progress>,
    emitted: Condvar,
}

static BRIDGE: OnceLock<Bridge> = OnceLock::new();

/// Python's level number for a `log` level.
fn py_level(l: log::Level) -> u32 {
    match l {
        log::Level::Error => 40,
        log::Level::Warn => 30,
        log::Level::Info => 20,
        log::Level::Debug => 10,
        log::Level::Trace => 5,
    }
}

struct Logger;

impl log::Log for Logger {
    fn enabled(&self, m: &log::Metadata<'_>) -> bool {
        m.level() <= log::max_level()
    }

    fn log(&self, r: &log::Record<'_>) {
        let Some(b) = BRIDGE.get() else { return };
        if !self.enabled(r.metadata()) {
            return;
        }
        let msg = Msg {
            logger: format!("distributed.{}", r.target().replace("::", ".")),
            level: py_level(r.level()),
            text: r.args().to_string(),
        };
        let mut p = b.progress.lock().unwrap_or_else(PoisonError::into_inner);
        match b.tx.try_send(msg) {
            Ok(()) => p.queued += 1,
            Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => p.dropped += 1,
        }
    }

    fn flush(&self) {}
}

fn emit(rx: Receiver<Msg>) {
    while let Ok(m) = rx.recv() {
        let b = BRIDGE.get().expect("set before the thread starts");
        let dropped = std::mem::take(&mut b.progress.lock().unwrap_or_else(PoisonError::into_inner).dropped);
        Python::with_gil(|py| {
            let text = if dropped > 0 { format!("{} ({dropped} earlier records dropped)", m.text) } else { m.text };
            // A failing handler is Python's business; nothing of it reaches the engine.
            let _ = py
                .import("logging")
                .and_then(|logging| logging.call_method1("getLogger", (m.logger.as_str(),)))
                .and_then(|logger| logger.call_method1("log", (m.level, "%s", text)));
        });
        let mut p = b.progress.lock().unwrap_or_else(PoisonError::into_inner);
        p.done += 1;
        b.emitted.notify_all();
    }
}

/// The `log` level filter for a Python logging level (records at or above it pass).
fn level_filter(py_level: i64) -> log::LevelFilter {
    match py_level {
        l if l <= 5 => log::LevelFilter::Trace,
        l if l <= 10 => log::LevelFilter::Debug,
        l if l <= 20 => log::LevelFilter::Info,
        l if l <= 30 => log::LevelFilter::Warn,
        l if l <= 40 => log::LevelFilter::Error,
        _ => log::LevelFilter::Off,
    }
}

static INSTALL: Once = Once::new();

/// Install the bridge, once per process, at the effective level of Python's `distributed.spillway`
/// logger (another `log` logger already installed leaves things as they are).
pub(crate) fn install(py: Python<'_>) {
    INSTALL.call_once(|| {
        let level = py
            .import("logging")
            .and_then(|logging| logging.call_method1("getLogger", ("distributed.spillway",)))
            .and_then(|logger| logger.call_method0("getEffectiveLevel"))
            .and_then(|l| l.extract::<i64>())
            .unwrap_or(20);
        let (tx, rx) = sync_channel(QUEUE);
        if BRIDGE.set(Bridge { tx, progress: Mutex::new(Progress::default()), emitted: Condvar::new() }).is_err() {
            return;
        }
        if std::thread::Builder::new().name("spillway-log".into()).spawn(move || emit(rx)).is_err() {
            return; // no thread: records stay queued until the queue is full, then are dropped
        }
        if log::set_logger(&Logger).is_ok() {
            log::set_max_level(level_filter(level));
        }
    });
}

/// Wait (without the GIL, at most `timeout` seconds) until every engine log record queued before
/// this call has reached Python's `logging`. Returns whether they all did.
#[pyfunction]
#[pyo3(name = "_flush_logs", signature = (timeout = 10.0))]
pub(crate) fn flush_logs(py: Python<'_>, timeout: f64) -> PyResult<bool> {
    if timeout.is_nan() {
        return Err(pyo3::exceptions::PyValueError::new_err("timeout must be a number of seconds, not nan"));
    }
    let Some(b) = BRIDGE.get() else { return Ok(true) };
    let wait = Duration::from_secs_f64(timeout.clamp(0.0, 1e6));
    Ok(py.allow_threads(|| {
        let p = b.progress.lock().unwrap_or_else(PoisonError::into_inner);
        let target = p.queued;
        let (p, _) = b.emitted.wait_timeout_while(p, wait, |p| p.done < target).unwrap_or_else(PoisonError::into_inner);
        p.done >= target
    }))
}
