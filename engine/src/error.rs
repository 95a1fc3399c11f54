//! The engine's error type.
//!
//! One hand-written, `#[non_exhaustive]` enum. Corruption read from disk is always an `Err` naming the
//! segment and byte offset where it was found; it is never an assertion.

use std::fmt;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

/// The result type of every fallible engine call.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in the engine. Cloneable (OS errors are shared behind an `Arc`), so one
/// failure can be handed to every thread waiting on the same operation.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Error {
    /// A system call failed.
    Io {
        /// What the engine was doing (`"write segment"`, `"fdatasync"`, ...).
        op: &'static str,
        /// The file or directory involved, when there is one.
        path: Option<PathBuf>,
        /// The operating system's error.
        source: Arc<io::Error>,
    },
    /// A stored checksum did not match the bytes it covers. Segment 0 (no segment has id 0) means
    /// the bytes were received from a peer, whose announced checksum they failed.
    ChecksumMismatch {
        /// Segment id; 0 for bytes received from a peer.
        segment: u32,
        /// Byte offset of the record (or structure) in the segment file.
        offset: u64,
        /// Which checksum failed (`"record header"`, `"record payload"`, `"footer"`).
        what: &'static str,
        /// The checksum stored on disk.
        expected: u32,
        /// The checksum of the bytes actually read.
        actual: u32,
    },
    /// Bytes on disk are not a valid structure (bad magic, impossible length, key mismatch ...).
    Corrupt {
        /// Segment id.
        segment: u32,
        /// Byte offset of the bad structure in the segment file.
        offset: u64,
        /// What is wrong, in words.
        reason: String,
    },
    /// A structure was written by a newer (or unknown) version of the format.
    UnsupportedVersion {
        /// What was being decoded.
        what: &'static str,
        /// The version found on disk.
        found: u32,
        /// The newest version this build understands.
        supported: u32,
    },
    /// A key is longer than [`crate::MAX_KEY_BYTES`].
    KeyTooLarge {
        /// Length of the rejected key.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// A value is larger than the configured maximum, or has too many frames.
    ValueTooLarge {
        /// Size (bytes) or frame count of the rejected value.
        len: u64,
        /// The limit.
        max: u64,
        /// `"bytes"` or `"frames"`.
        unit: &'static str,
    },
    /// An earlier write or fsync failed, so the log refuses further writes: the state of the file after a
    /// failed fsync is unknown, and retrying an fsync can report success for data that was dropped.
    Poisoned {
        /// The first failure, in words.
        cause: String,
    },
    /// Another process (or another handle in this process) holds the store directory's lock.
    Locked {
        /// The store directory.
        path: PathBuf,
    },
    /// The directory is not a spillway store, or does not exist and creation was not requested.
    NotAStore {
        /// The path given.
        path: PathBuf,
        /// Why it was rejected.
        reason: String,
    },
    /// An invalid configuration value.
    InvalidConfig(String),
    /// A peer broke the transfer protocol (bad magic, unknown version, a length over its bound, a
    /// malformed frame) or reported an error of its own.
    Protocol(String),
    /// A persistent store's `flush` could not write some values held only in memory (`max_spill`
    /// reached, a full disk, a serialize failure): they stay in memory, readable, but would not
    /// survive a restart. Everything else was written and synced.
    NotPersisted {
        /// How many values are held only in memory.
        keys: usize,
    },
    /// A bounded resource is used up (live transfer grants, a counter): nothing was done; it may
    /// succeed once some is given back.
    Exhausted(String),
    /// A value's record was removed or replaced (a racing `remove` or `put`) between finding it and
    /// reading it. Not damage: the store's readers start over and never pass it on.
    Vanished {
        /// The key, lossily printed.
        key: String,
    },
    /// A value arriving for a key lost to a `put` or `remove` of that key that came while it
    /// arrived: it was not stored (the newer operation stands). Not a failure of the transfer.
    Superseded {
        /// The key, lossily printed.
        key: String,
    },
    /// An internal invariant did not hold (a bug in spillway, not bad input or bad bytes): the call
    /// failed and changed nothing it could not undo.
    Internal(String),
    /// The codec failed to serialize or deserialize a value.
    Codec {
        /// `"serialize"` or `"deserialize"`.
        op: &'static str,
        /// The key involved, lossily printed.
        key: String,
        /// The codec's error.
        source: Arc<dyn std::error::Error + Send + Sync>,
    },
}

impl Error {
    /// Wrap an I/O error with the operation and path it came from.
    pub fn io(op: &'static str, path: impl Into<Option<PathBuf>>, source: io::Error) -> Self {
        Error::Io { op, path: path.into(), source: Arc::new(source) }
    }

    /// This error as a server tells it to a peer: what failed, without the server's paths, the
    /// causes it logged, or the codec's own message (which may quote stored data).
    pub fn peer_message(&self) -> String {
        match self {
            Error::Io { op, source, .. } => match source.raw_os_error() {
                Some(errno) => format!("server I/O error in {op} ({:?}, os error {errno})", source.kind()),
                None => format!("server I/O error in {op} ({:?})", source.kind()),
            },
            Error::ChecksumMismatch { .. } | Error::Corrupt { .. } | Error::UnsupportedVersion { .. } => {
                "the stored value is damaged on the server".into()
            }
            Error::Poisoned { .. } => "the server's log refuses writes after an I/O failure".into(),
            Error::Locked { .. } | Error::NotAStore { .. } => "the server's store is unavailable".into(),
            Error::Codec { op, .. } => format!("the server failed to {op} the value"),
            Error::KeyTooLarge { .. }
            | Error::ValueTooLarge { .. }
            | Error::InvalidConfig(_)
            | Error::Protocol(_)
            | Error::Exhausted(_)
            | Error::Vanished { .. }
            | Error::Superseded { .. }
            | Error::Internal(_)
            | Error::NotPersisted { .. } => self.to_string(),
        }
    }

    /// Bytes received from a peer (about `what`) whose crc32 is `actual`, not the `expected` their
    /// sender announced: a [`Error::ChecksumMismatch`] of segment 0, which no segment has, so it is
    /// never taken for damage on disk.
    pub fn peer_checksum(what: &'static str, expected: u32, actual: u32) -> Error {
        Error::ChecksumMismatch { segment: 0, offset: 0, what, expected, actual }
    }

    /// True when this error reports bytes on disk that failed validation.
    pub fn is_corruption(&self) -> bool {
        match self {
            // Segment 0: bytes received from a peer, not damage on disk.
            Error::ChecksumMismatch { segment, .. } => *segment != 0,
            Error::Corrupt { .. } | Error::UnsupportedVersion { .. } => true,
            _ => false,
        }
    }

    /// The `(segment, offset)` a corruption error points at, if this is one (not for bytes received
    /// from a peer, which have no place on disk).
    pub fn location(&self) -> Option<(u32, u64)> {
        match self {
            Error::ChecksumMismatch { segment, offset, .. } | Error::Corrupt { segment, offset, .. }
                if *segment != 0 =>
            {
                Some((*segment, *offset))
            }
            _ => None,
        }
    }

    /// True for an I/O error saying the file system is full or the quota is used up (ENOSPC,
    /// EDQUOT). From a write (or from creating a segment) it fails only that call: the log stays
    /// writable, and once deleting or forgetting data frees space the same write can succeed. From
    /// an fdatasync or a directory fsync it poisons the log like any other sync failure (the kernel
    /// may have dropped the dirty pages): later writes fail with [`Error::Poisoned`].
    pub fn is_no_space(&self) -> bool {
        matches!(self, Error::Io { source, .. } if io_no_space(source))
    }

    /// The underlying OS error kind, for I/O errors.
    pub fn io_kind(&self) -> Option<io::ErrorKind> {
        match self {
            Error::Io { source, .. } => Some(source.kind()),
            _ => None,
        }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Io { op, path: Some(p), source } => write!(f, "{op} {}: {source}", p.display()),
            Error::Io { op, path: None, source } => write!(f, "{op}: {source}"),
            Error::ChecksumMismatch { segment: 0, what, expected, actual, .. } => write!(
                f,
                "data received from a peer failed its {what} checksum (announced {expected:#010x}, \
                 computed {actual:#010x})"
            ),
            Error::ChecksumMismatch { segment, offset, what, expected, actual } => write!(
                f,
                "corrupt record in segment {segment} at offset {offset}: {what} checksum mismatch \
                 (stored {expected:#010x}, computed {actual:#010x})"
            ),
            Error::Corrupt { segment, offset, reason } => {
                write!(f, "corrupt data in segment {segment} at offset {offset}: {reason}")
            }
            Error::UnsupportedVersion { what, found, supported } => {
                write!(f, "unsupported {what} format version {found} (this build reads version {supported})")
            }
            Error::KeyTooLarge { len, max } => write!(f, "key of {len} bytes exceeds the limit of {max} bytes"),
            Error::ValueTooLarge { len, max, unit } => {
                write!(f, "value of {len} {unit} exceeds the limit of {max} {unit}")
            }
            Error::Poisoned { cause } => {
                write!(f, "the log refuses writes after an earlier I/O failure ({cause}); reopen the store")
            }
            Error::Locked { path } => write!(f, "store {} is locked by another process", path.display()),
            Error::NotAStore { path, reason } => write!(f, "{} is not a spillway store: {reason}", path.display()),
            Error::InvalidConfig(msg) => write!(f, "invalid configuration: {msg}"),
            Error::Protocol(msg) => write!(f, "transfer protocol: {msg}"),
            Error::Exhausted(what) => write!(f, "used up: {what}"),
            Error::Vanished { key } => write!(f, "{key:?} was removed while being read"),
            Error::Superseded { key } => {
                write!(f, "the value arriving for {key:?} was dropped: the key was set or removed meanwhile")
            }
            Error::Internal(msg) => write!(f, "internal error (a bug in spillway): {msg}"),
            Error::NotPersisted { keys } => {
                write!(f, "{keys} value(s) could not be written to disk and are held only in memory")
            }
            Error::Codec { op, key, source } => write!(f, "failed to {op} {key:?}: {source}"),
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io { source, .. } => Some(&**source),
            Error::Codec { source, .. } => Some(&**source),
            _ => None,
        }
    }
}

/// Whether `e` says the file system is full or the quota is used up (ENOSPC, EDQUOT).
pub(crate) fn io_no_space(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) || e.kind() == io::ErrorKind::StorageFull
}
