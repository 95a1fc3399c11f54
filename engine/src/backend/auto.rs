//! [`AutoBackend`]: io_uring where the kernel allows it, the portable backend otherwise.

use std::fs::File;
use std::io;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use super::{
    Backend, BufResult, DirLock, IoFuture, PipelinedRead, PortableBackend, ReadReq, SimBackend, SimFile, UringBackend,
    UringFile, UringOptions,
};
use crate::buf::AlignedBuf;
use std::os::fd::AsRawFd;

/// Which backend to run on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// io_uring if it can be set up here, else portable (logging why).
    #[default]
    Auto,
    /// io_uring or an error.
    Uring,
    /// Blocking pread/pwrite.
    Portable,
    /// The simulated disk, in memory ([`SimBackend`]): for tests of code that runs on an
    /// `AutoBackend` (the Python bindings), with its scripted faults. Nothing is written to disk.
    Sim,
}

impl FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(BackendKind::Auto),
            "uring" | "io_uring" | "io-uring" => Ok(BackendKind::Uring),
            "portable" => Ok(BackendKind::Portable),
            "sim" => Ok(BackendKind::Sim),
            other => Err(format!("unknown backend '{other}' (expected auto, uring, portable or sim)")),
        }
    }
}

/// A backend chosen at run time. See [`AutoBackend::new`].
#[derive(Debug)]
pub enum AutoBackend {
    /// The io_uring driver.
    Uring(UringBackend),
    /// Blocking positional I/O.
    Portable(PortableBackend),
    /// The simulated disk (see [`BackendKind::Sim`]).
    Sim(SimBackend),
}

/// A file of an [`AutoBackend`].
pub enum AutoFile {
    /// Opened by the io_uring backend.
    Uring(UringFile),
    /// Opened by the portable backend.
    Portable(File),
    /// Opened by the simulated backend.
    Sim(SimFile),
}

impl AutoBackend {
    /// A backend of `kind`. With [`BackendKind::Auto`], failure to set up io_uring (no kernel support,
    /// seccomp, `kernel.io_uring_disabled`, a missing opcode) is logged once with its reason and the
    /// portable backend is used; with [`BackendKind::Uring`] it is an error.
    pub fn new(kind: BackendKind, direct: bool) -> io::Result<AutoBackend> {
        Self::with_options(kind, UringOptions { direct, ..UringOptions::default() })
    }

    /// As [`AutoBackend::new`] with explicit io_uring settings (`opts.direct` applies to both).
    ///
    /// [`BackendKind::Auto`] first looks at the `SPILLWAY_BACKEND` environment variable (`uring` or
    /// `portable`), so an operator can force a backend for every spillway user of a process.
    pub fn with_options(kind: BackendKind, opts: UringOptions) -> io::Result<AutoBackend> {
        let direct = opts.direct;
        let kind = match (kind, std::env::var("SPILLWAY_BACKEND")) {
            (BackendKind::Auto, Ok(v)) if !v.is_empty() => v
                .parse()
                .map_err(|e: String| io::Error::new(io::ErrorKind::InvalidInput, format!("SPILLWAY_BACKEND: {e}")))?,
            (k, _) => k,
        };
        match kind {
            BackendKind::Portable => Ok(AutoBackend::Portable(PortableBackend::with_direct(direct))),
            BackendKind::Sim => Ok(AutoBackend::Sim(SimBackend::new())),
            BackendKind::Uring => UringBackend::new(opts).map(AutoBackend::Uring),
            BackendKind::Auto => match UringBackend::new(opts) {
                Ok(u) => Ok(AutoBackend::Uring(u)),
                Err(e) => {
                    log::warn!("io_uring unavailable: {e}; using the portable backend");
                    Ok(AutoBackend::Portable(PortableBackend::with_direct(direct)))
                }
            },
        }
    }

    /// The io_uring backend, when that is what runs.
    pub fn as_uring(&self) -> Option<&UringBackend> {
        match self {
            AutoBackend::Uring(u) => Some(u),
            _ => None,
        }
    }

    /// The simulated backend, when that is what runs (to script its faults).
    pub fn as_sim(&self) -> Option<&SimBackend> {
        match self {
            AutoBackend::Sim(s) => Some(s),
            _ => None,
        }
    }

    /// Whether files are opened with O_DIRECT.
    pub fn direct(&self) -> bool {
        match self {
            AutoBackend::Uring(u) => u.direct(),
            AutoBackend::Portable(p) => p.direct(),
            AutoBackend::Sim(_) => false,
        }
    }
}

fn mismatch() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "file opened by another backend")
}

/// `$call` on the backend and file of the same kind, as `$b.$call($f, ...)`; `$err` for a file of
/// another backend.
macro_rules! with_file {
    ($self:ident, $file:ident, |$b:ident, $f:ident| $call:expr, $err:expr) => {
        match ($self, $file) {
            (AutoBackend::Uring($b), AutoFile::Uring($f)) => $call,
            (AutoBackend::Portable($b), AutoFile::Portable($f)) => $call,
            (AutoBackend::Sim($b), AutoFile::Sim($f)) => $call,
            _ => $err,
        }
    };
}

/// `$call` on whichever backend runs, as `$b.$call(...)`.
macro_rules! on_backend {
    ($self:ident, |$b:ident| $call:expr) => {
        match $self {
            AutoBackend::Uring($b) => $call,
            AutoBackend::Portable($b) => $call,
            AutoBackend::Sim($b) => $call,
        }
    };
}

impl super::sealed::Sealed for AutoBackend {}

impl Backend for AutoBackend {
    type File = AutoFile;

    fn name(&self) -> &'static str {
        on_backend!(self, |b| b.name())
    }
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        match self {
            AutoBackend::Sim(s) => s.create_dir_all(path),
            _ => PortableBackend::new().create_dir_all(path),
        }
    }
    fn is_dir(&self, path: &Path) -> bool {
        match self {
            AutoBackend::Sim(s) => s.is_dir(path),
            _ => path.is_dir(),
        }
    }
    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        match self {
            AutoBackend::Sim(s) => s.list_dir(path),
            _ => PortableBackend::new().list_dir(path),
        }
    }
    fn open(&self, path: &Path, create: bool) -> io::Result<AutoFile> {
        match self {
            AutoBackend::Uring(u) => u.open(path, create).map(AutoFile::Uring),
            AutoBackend::Portable(p) => p.open(path, create).map(AutoFile::Portable),
            AutoBackend::Sim(s) => s.open(path, create).map(AutoFile::Sim),
        }
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        match self {
            AutoBackend::Sim(s) => s.remove_file(path),
            _ => std::fs::remove_file(path),
        }
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        match self {
            AutoBackend::Sim(s) => s.rename(from, to),
            _ => std::fs::rename(from, to),
        }
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        match self {
            AutoBackend::Sim(s) => s.sync_dir(path),
            _ => PortableBackend::new().sync_dir(path),
        }
    }
    fn file_len(&self, file: &AutoFile) -> io::Result<u64> {
        with_file!(self, file, |b, f| b.file_len(f), Err(mismatch()))
    }
    fn allocate(&self, file: &AutoFile, len: u64) -> io::Result<bool> {
        with_file!(self, file, |b, f| b.allocate(f, len), Err(mismatch()))
    }
    fn as_fd<'a>(&self, file: &'a AutoFile) -> Option<std::os::fd::BorrowedFd<'a>> {
        match file {
            AutoFile::Uring(u) => Some(std::os::fd::AsFd::as_fd(u.file())),
            AutoFile::Portable(p) => Some(std::os::fd::AsFd::as_fd(p)),
            AutoFile::Sim(_) => None,
        }
    }

    fn read_at(&self, file: &AutoFile, offset: u64, buf: AlignedBuf) -> BufResult {
        with_file!(self, file, |b, f| b.read_at(f, offset, buf), (Err(mismatch()), buf))
    }
    fn write_at(&self, file: &AutoFile, offset: u64, buf: AlignedBuf) -> BufResult {
        with_file!(self, file, |b, f| b.write_at(f, offset, buf), (Err(mismatch()), buf))
    }
    fn sync_data(&self, file: &AutoFile) -> io::Result<()> {
        with_file!(self, file, |b, f| b.sync_data(f), Err(mismatch()))
    }
    fn lock_dir(&self, dir: &Path) -> io::Result<DirLock> {
        match self {
            AutoBackend::Sim(s) => s.lock_dir(dir),
            _ => PortableBackend::new().lock_dir(dir),
        }
    }
    fn alignment(&self, dir: &Path) -> usize {
        on_backend!(self, |b| b.alignment(dir))
    }
    /// Of the same kind; a driver that cannot be started for the fresh log (its locked memory, say)
    /// falls back to the portable backend, as [`AutoBackend::new`] does.
    fn fresh(&self) -> io::Result<Self> {
        Ok(match self {
            AutoBackend::Uring(b) => match b.fresh() {
                Ok(u) => AutoBackend::Uring(u),
                Err(e) => {
                    log::warn!("io_uring unavailable for a fresh log ({e}); it uses the portable backend");
                    AutoBackend::Portable(PortableBackend::with_direct(b.direct()))
                }
            },
            AutoBackend::Portable(b) => AutoBackend::Portable(b.fresh()?),
            AutoBackend::Sim(b) => AutoBackend::Sim(b.fresh()?),
        })
    }
    fn read_alignment(&self, dir: &Path) -> usize {
        on_backend!(self, |b| b.read_alignment(dir))
    }
    fn alloc_buf(&self, len: usize, align: usize) -> AlignedBuf {
        on_backend!(self, |b| b.alloc_buf(len, align))
    }
    fn read_at_async(&self, file: &Arc<AutoFile>, offset: u64, buf: AlignedBuf) -> IoFuture {
        match (self, &**file) {
            (AutoBackend::Uring(u), AutoFile::Uring(f)) => Box::pin(u.read(f, offset, buf)),
            _ => Box::pin(std::future::ready(self.read_at(file, offset, buf))),
        }
    }
    fn pipelines_reads(&self) -> bool {
        on_backend!(self, |b| b.pipelines_reads())
    }

    fn queues_writes(&self) -> bool {
        on_backend!(self, |b| b.queues_writes())
    }

    fn punch_hole(&self, file: &AutoFile, offset: u64, len: u64) -> io::Result<()> {
        with_file!(self, file, |b, f| b.punch_hole(f, offset, len), Err(io::ErrorKind::Unsupported.into()))
    }

    fn detached_punch(&self) -> Option<super::DetachedPunch<AutoFile>> {
        match self {
            // Both punch with `fallocate` on the file they hold; the simulated disk counts its
            // operations in order, so its punches stay on the caller's thread.
            AutoBackend::Uring(_) | AutoBackend::Portable(_) => Some(|file, offset, len| match file {
                AutoFile::Uring(f) => super::portable::punch_hole(f.file(), offset, len),
                AutoFile::Portable(f) => super::portable::punch_hole(f, offset, len),
                AutoFile::Sim(_) => Err(io::ErrorKind::Unsupported.into()),
            }),
            AutoBackend::Sim(_) => None,
        }
    }

    fn read_new(&self, file: &AutoFile, offset: u64, len: usize, align: usize) -> io::Result<AlignedBuf> {
        with_file!(
            self,
            file,
            |b, f| b.read_new(f, offset, len, align),
            super::read_by_alloc(self, file, offset, len, align)
        )
    }

    fn read_new_crc(
        &self,
        file: &AutoFile,
        offset: u64,
        len: usize,
        align: usize,
        check: std::ops::Range<usize>,
    ) -> io::Result<(AlignedBuf, u32)> {
        with_file!(
            self,
            file,
            |b, f| b.read_new_crc(f, offset, len, align, check.clone()),
            super::read_by_alloc(self, file, offset, len, align).map(|buf| super::with_crc(buf, check))
        )
    }

    fn gathers_writes(&self) -> bool {
        on_backend!(self, |b| b.gathers_writes())
    }

    fn write_gather_at(&self, file: &AutoFile, offset: u64, parts: &[&[u8]]) -> io::Result<()> {
        with_file!(
            self,
            file,
            |b, f| b.write_gather_at(f, offset, parts),
            super::gather_by_copy(self, file, offset, parts)
        )
    }

    fn write_at_async(&self, file: &Arc<AutoFile>, offset: u64, buf: AlignedBuf) -> IoFuture {
        match (self, &**file) {
            (AutoBackend::Uring(u), AutoFile::Uring(f)) => Box::pin(u.write(f, offset, buf)),
            _ => Box::pin(std::future::ready(self.write_at(file, offset, buf))),
        }
    }

    fn read_pipelined(
        &self,
        depth: usize,
        next: &mut dyn FnMut() -> Option<PipelinedRead<AutoFile>>,
        done: &mut dyn FnMut(u64, BufResult),
    ) -> io::Result<()> {
        match self {
            // Any open file works on a ring of the calling thread.
            AutoBackend::Uring(u) => match super::pipeline::ring(depth) {
                Ok(ring) => super::pipeline::run(
                    ring,
                    depth,
                    |f: &AutoFile| match f {
                        AutoFile::Uring(f) => (f.file().as_raw_fd(), f.is_direct()),
                        AutoFile::Portable(p) => (p.as_raw_fd(), u.direct()),
                        AutoFile::Sim(_) => (-1, false), // (never: a uring backend opens no sim file)
                    },
                    next,
                    done,
                ),
                Err(e) => {
                    super::pipeline::warn_no_ring(&e);
                    while let Some(r) = next() {
                        done(r.tag, self.read_at(&r.file, r.offset, r.buf));
                    }
                    Ok(())
                }
            },
            AutoBackend::Portable(_) | AutoBackend::Sim(_) => {
                while let Some(r) = next() {
                    done(r.tag, self.read_at(&r.file, r.offset, r.buf));
                }
                Ok(())
            }
        }
    }

    fn read_many(&self, reqs: Vec<ReadReq<'_, AutoFile>>) -> Vec<BufResult> {
        if let AutoBackend::Uring(u) = self {
            if reqs.iter().all(|r| matches!(r.file, AutoFile::Uring(_))) {
                let reqs = reqs
                    .into_iter()
                    .filter_map(|r| match r.file {
                        AutoFile::Uring(f) => Some(ReadReq { file: f, offset: r.offset, buf: r.buf }),
                        _ => None,
                    })
                    .collect();
                return u.read_many(reqs);
            }
        }
        reqs.into_iter().map(|r| self.read_at(r.file, r.offset, r.buf)).collect()
    }
}
