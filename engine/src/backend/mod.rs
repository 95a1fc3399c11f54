//! I/O backends: the only place the log touches files.
//!
//! The segment log is generic over [`Backend`]. Four implementations:
//!
//! * [`PortableBackend`]: blocking `pread`/`pwrite`/`fdatasync`, works on every Linux kernel and in
//!   containers that block io_uring.
//! * [`SimBackend`]: in-memory files with a durable/volatile split, crash simulation and deterministic
//!   fault injection, for tests and fuzzing.
//! * [`UringBackend`]: a driver thread that owns an io_uring, a registered buffer pool and a
//!   registered file table; blocking and async APIs over the same driver.
//! * [`AutoBackend`]: io_uring where it works, otherwise portable, with one log line saying why.
//!
//! ## Why buffers move in and out by value
//! `read_at` and `write_at` take an `AlignedBuf` by value and hand it back with the result (the
//! "buffer result" shape of tokio-uring). With io_uring the buffer must belong to the in-flight
//! operation until its completion is reaped; an API that borrowed `&mut [u8]` could not express that
//! without unsafe contracts on every caller. With ownership passing, a completion-based backend keeps
//! the buffer inside its op table and returns it only when the kernel is done, and registered buffers
//! from a pool are just `AlignedBuf`s that the backend recognizes. [`Backend::read_many`] is the batch
//! form (one submission for many reads); the default loops.

use std::future::Future;
use std::io;
use std::ops::Range;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;

use crate::buf::AlignedBuf;

mod auto;
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod doorbell;
#[cfg(not(feature = "testing"))]
pub(crate) mod doorbell;
mod portable;
mod sim;
mod uring;

pub use auto::{AutoBackend, AutoFile, BackendKind};
pub(crate) use portable::enable_direct;
pub use portable::PortableBackend;
pub use sim::{Fault, FaultKind, FaultOp, SimBackend, SimFile};
pub use uring::{UringBackend, UringFile, UringInfo, UringOptions};
/// Plumbing the crate's own tests reach (`testing` feature); not the API.
#[cfg(feature = "testing")]
#[doc(hidden)]
pub use {
    portable::dio_alignment,
    uring::{UringOp, PIECE},
};

/// The seal on [`Backend`]: only this crate's backends implement it (with the `testing` feature,
/// the crate's own tests implement it too, for backends that wrap one of these).
#[cfg(feature = "testing")]
#[doc(hidden)]
pub mod sealed {
    /// Implemented by every [`Backend`](super::Backend).
    pub trait Sealed {}
}
#[cfg(not(feature = "testing"))]
mod sealed {
    /// Implemented by every [`Backend`](super::Backend).
    pub trait Sealed {}
}

mod pipeline;

/// A read or write in flight, resolving to its outcome and buffer.
#[doc(hidden)]
pub type IoFuture = Pin<Box<dyn Future<Output = BufResult> + Send + 'static>>;

/// A buffer handed back by an I/O call together with the call's outcome.
#[doc(hidden)]
pub type BufResult = (io::Result<()>, AlignedBuf);

/// A held store-directory lock; dropping it releases the lock.
#[doc(hidden)]
pub type DirLock = Box<dyn std::any::Any + Send + Sync>;

/// One read of a batch: `buf.len()` bytes from `offset` of `file`.
#[doc(hidden)]
pub struct ReadReq<'a, F> {
    /// The file to read.
    pub file: &'a F,
    /// Byte offset in the file.
    pub offset: u64,
    /// Destination; its length is the number of bytes to read.
    pub buf: AlignedBuf,
}

/// A gathered write done the plain way: copy `parts` into one buffer, then [`Backend::write_at`].
pub(crate) fn gather_by_copy<B: Backend + ?Sized>(
    b: &B,
    file: &B::File,
    offset: u64,
    parts: &[&[u8]],
) -> io::Result<()> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut buf = b.alloc_buf(len, 4096);
    buf.set_len(0);
    for p in parts {
        buf.extend_from_slice(p);
    }
    b.write_at(file, offset, buf).0
}

/// Checked ranges at least this large are read in two halves on two threads
/// ([`read_new_checked`]): below it, starting a thread costs more than half the read saves.
pub(crate) const SPLIT_READ_MIN_BYTES: usize = 4 << 20;

/// [`Backend::read_new_crc`] for a file read with `pread` (buffered or O_DIRECT, `align` the buffer's
/// alignment): a checked range of [`SPLIT_READ_MIN_BYTES`] or more, on a machine with more than one
/// core, is read and checksummed in two halves at once ([`AlignedBuf::read_exact_at_split`]), the
/// halves' crcs combined; a smaller one is read, then checksummed.
pub(crate) fn read_new_checked(
    file: &(impl std::os::fd::AsFd + Sync),
    offset: u64,
    len: usize,
    align: usize,
    check: Range<usize>,
) -> io::Result<(AlignedBuf, u32)> {
    use crate::format::PayloadCrc;
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    if check.len() < SPLIT_READ_MIN_BYTES || cores < 2 {
        let buf = AlignedBuf::read_exact_at(file, offset, len, align)?;
        let crc = crate::format::payload_crc(&buf[check]);
        return Ok((buf, crc));
    }
    // Split on a page (and `align`) boundary, so that both halves stay aligned for O_DIRECT.
    let unit = align.max(4096);
    let split = (len / 2) / unit * unit;
    let (buf, a, b) = AlignedBuf::read_exact_at_split(file, offset, len, align, split, |range, bytes| {
        let from = check.start.clamp(range.start, range.end);
        let to = check.end.clamp(range.start, range.end);
        PayloadCrc::of(&bytes[from - range.start..to - range.start])
    })?;
    Ok((buf, a.then(&b).value()))
}

/// `read_new` done the plain way: a buffer from [`Backend::alloc_buf`], then [`Backend::read_at`].
pub(crate) fn read_by_alloc<B: Backend + ?Sized>(
    b: &B,
    file: &B::File,
    offset: u64,
    len: usize,
    align: usize,
) -> io::Result<AlignedBuf> {
    let (r, buf) = b.read_at(file, offset, b.alloc_buf(len, align));
    r.map(|()| buf)
}

/// One read of a pipelined stream (see [`Backend::read_pipelined`]).
#[doc(hidden)]
pub struct PipelinedRead<F> {
    /// The file to read (kept open until the read completes).
    pub file: Arc<F>,
    /// Byte offset in the file.
    pub offset: u64,
    /// Destination; its length is the number of bytes to read.
    pub buf: AlignedBuf,
    /// Caller's tag, handed back with the result.
    pub tag: u64,
}

/// `buf` with the payload crc of its bytes `check`: [`Backend::read_new_crc`] of a backend that
/// reads first and checksums after.
pub(crate) fn with_crc(buf: AlignedBuf, check: Range<usize>) -> (AlignedBuf, u32) {
    let crc = crate::format::payload_crc(&buf[check]);
    (buf, crc)
}

/// A hole punch that needs only the file (see [`Backend::detached_punch`]).
#[doc(hidden)]
pub type DetachedPunch<F> = fn(&F, u64, u64) -> io::Result<()>;

/// The file system operations the segment log needs.
///
/// Sealed: the log runs on the backends of this module ([`AutoBackend`], [`PortableBackend`],
/// [`UringBackend`], [`SimBackend`]); a caller picks one and hands it to
/// [`SegmentLog::open`](crate::SegmentLog::open) or [`Store::open`](crate::Store::open). Its methods
/// are the log's plumbing (they move the crate's own aligned buffers), not an API to call.
///
/// Contract for `read_at`/`write_at`: the call transfers exactly `buf.len()` bytes or fails; short
/// transfers are retried inside the backend, and a read that meets end-of-file fails with
/// `UnexpectedEof`. Offsets and lengths the log passes are multiples of [`Backend::alignment`].
pub trait Backend: sealed::Sealed + Send + Sync + 'static {
    /// An open file.
    type File: Send + Sync + 'static;

    /// Short name for logs and metrics (`"portable"`, `"sim"`, `"uring"`).
    fn name(&self) -> &'static str;
    /// Create a directory and its parents.
    fn create_dir_all(&self, path: &Path) -> io::Result<()>;
    /// Whether `path` exists and is a directory.
    fn is_dir(&self, path: &Path) -> bool;
    /// Names of the entries of a directory.
    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>>;
    /// Open a file for reading and writing; with `create`, create it and fail if it exists.
    fn open(&self, path: &Path, create: bool) -> io::Result<Self::File>;
    /// Remove a file.
    fn remove_file(&self, path: &Path) -> io::Result<()>;
    /// Give a file another name (replacing nothing: the log renames only to names not in use). Like
    /// a creation or a removal, durable after [`Backend::sync_dir`]. Unsupported by default, which
    /// keeps a log from reusing the files of deleted segments.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let _ = (from, to);
        Err(io::ErrorKind::Unsupported.into())
    }
    /// Make directory entry changes (creations, removals) durable.
    fn sync_dir(&self, path: &Path) -> io::Result<()>;
    /// Current length of a file.
    fn file_len(&self, file: &Self::File) -> io::Result<u64>;
    /// Reserve `len` bytes of disk for a file (fallocate), extending it. Returns whether the space
    /// is reserved: `false` when the file system cannot reserve it (no fallocate, or not enough free
    /// space) and the file was extended sparsely instead, so that writes into it may still fail with
    /// ENOSPC.
    fn allocate(&self, file: &Self::File, len: u64) -> io::Result<bool>;
    /// Read `buf.len()` bytes at `offset`.
    fn read_at(&self, file: &Self::File, offset: u64, buf: AlignedBuf) -> BufResult;
    /// Write all of `buf` at `offset`.
    fn write_at(&self, file: &Self::File, offset: u64, buf: AlignedBuf) -> BufResult;
    /// Make the file's written data durable (fdatasync).
    fn sync_data(&self, file: &Self::File) -> io::Result<()>;
    /// Take the exclusive lock of a store directory, failing with `WouldBlock` if it is held.
    fn lock_dir(&self, dir: &Path) -> io::Result<DirLock>;
    /// I/O alignment for files in `dir` (offsets, lengths and buffer addresses) of writes and of
    /// everything the log lays out: the larger of the O_DIRECT alignment and the file system block,
    /// because ext4 serializes (and zero-fills around) O_DIRECT writes that are not block-aligned.
    fn alignment(&self, dir: &Path) -> usize;

    /// Another backend of the same kind and settings, for a log that replaces one a failed write
    /// left read-only (a spill store's fresh log, `store/logs.rs`). Unsupported by default: a store
    /// on such a backend keeps its one log.
    fn fresh(&self) -> io::Result<Self>
    where
        Self: Sized,
    {
        Err(io::ErrorKind::Unsupported.into())
    }

    /// Alignment of reads of single records: the O_DIRECT minimum (often 512 B) for direct files,
    /// as little as 64 (the frame alignment) for buffered ones. Smaller than [`Backend::alignment`]
    /// so a small record costs fewer bytes to read. Must divide it; the log uses at least 64.
    fn read_alignment(&self, dir: &Path) -> usize {
        self.alignment(dir)
    }

    /// The file's descriptor, for zero-copy transfers (splice); `None` for files without one.
    fn as_fd<'a>(&self, file: &'a Self::File) -> Option<std::os::fd::BorrowedFd<'a>> {
        let _ = file;
        None
    }

    /// A buffer for an I/O of `len` bytes aligned to `align`: length `len`, contents initialized but
    /// unspecified. A backend with a registered pool hands out pool slots when one is free.
    fn alloc_buf(&self, len: usize, align: usize) -> AlignedBuf {
        AlignedBuf::zeroed(len, align)
    }

    /// Start a read and return its future; the default performs it synchronously. Dropping the
    /// future early is safe: a completion-based backend keeps the buffer until the kernel is done.
    fn read_at_async(&self, file: &Arc<Self::File>, offset: u64, buf: AlignedBuf) -> IoFuture {
        Box::pin(std::future::ready(self.read_at(file, offset, buf)))
    }

    /// Deallocate `len` bytes at `offset` (a hole: reads return zeros, the file keeps its size), so
    /// their disk space and page cache are freed. Unsupported by default.
    fn punch_hole(&self, file: &Self::File, offset: u64, len: u64) -> io::Result<()> {
        let _ = (file, offset, len);
        Err(io::ErrorKind::Unsupported.into())
    }

    /// [`Backend::punch_hole`] as a plain function of the file, so that the log can run punches on a
    /// thread of its own: a punch frees the blocks and page-cache pages of its range in the call,
    /// which takes milliseconds for a large record. `None` (the default): the log punches on the
    /// caller's thread, through `punch_hole`.
    fn detached_punch(&self) -> Option<DetachedPunch<Self::File>> {
        None
    }

    /// Read `len` bytes at `offset` into a new buffer aligned to `align`. The default allocates a
    /// zeroed buffer and calls [`Backend::read_at`]; the portable backend reads into fresh memory
    /// without zeroing it first.
    fn read_new(&self, file: &Self::File, offset: u64, len: usize, align: usize) -> io::Result<AlignedBuf> {
        read_by_alloc(self, file, offset, len, align)
    }

    /// [`Backend::read_new`], with the `crate::format::payload_crc` of the bytes `check` of the
    /// buffer read. The default reads, then checksums; the file backends read and checksum a large
    /// range in two halves on two threads at once (`read_new_checked`).
    fn read_new_crc(
        &self,
        file: &Self::File,
        offset: u64,
        len: usize,
        align: usize,
        check: Range<usize>,
    ) -> io::Result<(AlignedBuf, u32)> {
        self.read_new(file, offset, len, align).map(|buf| with_crc(buf, check))
    }

    /// Whether [`Backend::write_gather_at`] writes straight from the caller's slices. The log then writes
    /// chunks that hold large values with it, in one blocking call, without copying those values into
    /// a staging buffer first (buffered files only: O_DIRECT needs aligned memory). Takes precedence
    /// over [`Backend::queues_writes`] for those chunks.
    fn gathers_writes(&self) -> bool {
        false
    }

    /// Write `parts` back to back at `offset`, all of them or fail (short writes are retried). The
    /// default copies them into one buffer and calls [`Backend::write_at`].
    fn write_gather_at(&self, file: &Self::File, offset: u64, parts: &[&[u8]]) -> io::Result<()> {
        gather_by_copy(self, file, offset, parts)
    }

    /// Whether `write_at_async` really overlaps writes (a submission queue). The log then writes a
    /// batch as many smaller writes in flight at once; otherwise as one large write.
    fn queues_writes(&self) -> bool {
        false
    }

    /// Start a write and return its future; the default performs it synchronously. As with reads, the
    /// backend owns the buffer until the write completes, even if the future is dropped.
    fn write_at_async(&self, file: &Arc<Self::File>, offset: u64, buf: AlignedBuf) -> IoFuture {
        Box::pin(std::future::ready(self.write_at(file, offset, buf)))
    }

    /// A stream of reads with up to `depth` in flight, all on the calling thread: `next` supplies reads
    /// until it returns `None`, `done` receives each result (in completion order) with its tag. The
    /// default runs them one after another. The io_uring backend keeps `depth` in flight on a ring
    /// of the calling thread, submitting and reaping itself (fio's loop, no hand-off to another
    /// thread): the fastest way to read many small records from one thread.
    fn read_pipelined(
        &self,
        depth: usize,
        next: &mut dyn FnMut() -> Option<PipelinedRead<Self::File>>,
        done: &mut dyn FnMut(u64, BufResult),
    ) -> io::Result<()> {
        let _ = depth;
        while let Some(r) = next() {
            done(r.tag, self.read_at(&r.file, r.offset, r.buf));
        }
        Ok(())
    }

    /// Whether [`Backend::read_pipelined`] with many reads beats reading them one after another: true
    /// where reads wait for the device (io_uring with O_DIRECT). With buffered files a read that hits
    /// the page cache is a copy, and a ring per call only adds its setup (a `Store::get_many` of 32
    /// cached 4 KiB values ran at half the speed of 32 gets).
    fn pipelines_reads(&self) -> bool {
        false
    }

    /// Many reads at once; backends with a submission queue submit them together.
    fn read_many(&self, reqs: Vec<ReadReq<'_, Self::File>>) -> Vec<BufResult> {
        reqs.into_iter().map(|r| self.read_at(r.file, r.offset, r.buf)).collect()
    }
}
