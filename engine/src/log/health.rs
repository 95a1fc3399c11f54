//! Whether the log may still write: poisoned (read-only from then on) by a write or fdatasync that
//! failed, and which lasting conditions were already warned about.

use std::io;
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::error::{Error, Result};
use crate::sync::{AtomicU64, Ordering};

/// Warning bits ([`Health::warn_once`]). A full file system is warned about again after a write
/// succeeded.
pub(super) const WARN_FULL: u64 = 1;
pub(super) const WARN_PUNCH: u64 = 2;
pub(super) const WARN_COMPACT: u64 = 4;
pub(super) const WARN_GC: u64 = 8;
/// A kept segment file could not be reused.
pub(super) const WARN_REUSE: u64 = 16;

/// The log's health: why it refuses writes, if it does, and the warnings already logged (so that a
/// condition that lasts is logged once per log, not once per call).
pub(super) struct Health {
    /// The log's directory, for messages.
    dir: PathBuf,
    poisoned: OnceLock<String>,
    warned: AtomicU64,
}

impl Health {
    /// A log in `dir`, read-only from the start for `read_only`'s reason if there is one.
    pub(super) fn new(dir: PathBuf, read_only: Option<String>) -> Self {
        let poisoned = OnceLock::new();
        if let Some(reason) = read_only {
            let _ = poisoned.set(reason);
        }
        Health { dir, poisoned, warned: AtomicU64::new(0) }
    }

    /// Why the log refuses writes, if it does.
    pub(super) fn poisoned(&self) -> Option<&str> {
        self.poisoned.get().map(String::as_str)
    }

    pub(super) fn is_poisoned(&self) -> bool {
        self.poisoned.get().is_some()
    }

    /// `Error::Poisoned` if the log refuses writes.
    pub(super) fn check_writable(&self) -> Result<()> {
        match self.poisoned.get() {
            Some(cause) => Err(Error::Poisoned { cause: cause.clone() }),
            None => Ok(()),
        }
    }

    /// A write of records succeeded: a full file system met later is warned about again.
    pub(super) fn wrote(&self) {
        if self.warned.load(Ordering::Relaxed) & WARN_FULL != 0 {
            self.warned.fetch_and(!WARN_FULL, Ordering::Relaxed);
        }
    }

    /// Whether the warning `bit` is still to be logged for this log (and from now on, is not).
    pub(super) fn warn_once(&self, bit: u64) -> bool {
        self.warned.fetch_or(bit, Ordering::Relaxed) & bit == 0
    }

    /// The log turns read-only because of `e`, which is returned.
    pub(super) fn poison(&self, e: Error) -> Error {
        let _ = self.poisoned.set(e.to_string());
        log::error!("segment log {} is now read-only: {e}", self.dir.display());
        e
    }

    /// The error for a failed write of records that were not published (or, for write-behind, are
    /// still pending in memory). A full file system (ENOSPC, EDQUOT) is an error for this call only:
    /// the bytes the write may have left lie at or after the segment's published end, which the next
    /// write of the segment overwrites, so nothing on disk needs undoing, and freeing space (forgetting
    /// or deleting data) lets the same write succeed. Any other failure (EIO, ...) leaves the file in
    /// an unknown state and makes the log read-only.
    pub(super) fn write_failed(&self, op: &'static str, path: PathBuf, e: io::Error) -> Error {
        if crate::error::io_no_space(&e) {
            if self.warn_once(WARN_FULL) {
                log::warn!(
                    "segment log {}: {op} failed, the file system is full ({e}); the log stays writable",
                    self.dir.display()
                );
            }
            return Error::io(op, path, e);
        }
        self.poison(Error::io(op, path, e))
    }
}
