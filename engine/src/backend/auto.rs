//! [`AutoBackend`]: io_uring where the kernel allows it, the portable backend otherwise.

use std::fs::File;
use std::io;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;

use super::{
    Backend, BufResult, DirLock, IoFuture, PipelinedRead, PortableBackend, ReadReq, UringBackend, UringFile,
    UringOptions,
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
}

impl FromStr for BackendKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(BackendKind::Auto),
            "uring" | "io_uring" | "io-uring" => Ok(BackendKind::Uring),
            "portable" => Ok(BackendKind::Portable),
            other => Err(format!("unknown backend '{other}' (expected auto, uring or portable)")),
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
}

/// A file of an [`AutoBackend`].
pub enum AutoFile {
    /// Opened by the io_uring backend.
    Uring(UringFile),
    /// Opened by the portable backend.
    Portable(File),
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
            AutoBackend::Portable(_) => None,
        }
    }

    /// Whether files are opened with O_DIRECT.
    pub fn direct(&self) -> bool {
        match self {
            AutoBackend::Uring(u) => u.direct(),
            AutoBackend::Portable(p) => p.direct(),
        }
    }
}

fn mismatch() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, "file opened by another backend")
}

macro_rules! with_file {
    ($self:ident, $file:ident, $u:ident, $uf:ident => $ue:expr, $p:ident, $pf:ident => $pe:expr, $err:expr) => {
        match ($self, $file) {
            (AutoBackend::Uring($u), AutoFile::Uring($uf)) => $ue,
            (AutoBackend::Portable($p), AutoFile::Portable($pf)) => $pe,
            _ => $err,
        }
    };
}

impl Backend for AutoBackend {
    type File = AutoFile;

    fn name(&self) -> &'static str {
        match self {
            AutoBackend::Uring(u) => u.name(),
            AutoBackend::Portable(p) => p.name(),
        }
    }
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        PortableBackend::new().create_dir_all(path)
    }
    fn is_dir(&self, path: &Path) -> bool {
        path.is_dir()
    }
    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        PortableBackend::new().list_dir(path)
    }
    fn open(&self, path: &Path, create: bool) -> io::Result<AutoFile> {
        match self {
            AutoBackend::Uring(u) => u.open(path, create).map(AutoFile::Uring),
            AutoBackend::Portable(p) => p.open(path, create).map(AutoFile::Portable),
        }
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        PortableBackend::new().sync_dir(path)
    }
    fn file_len(&self, file: &AutoFile) -> io::Result<u64> {
        with_file!(self, file, u, f => u.file_len(f), p, f => p.file_len(f), Err(mismatch()))
    }
    fn allocate(&self, file: &AutoFile, len: u64) -> io::Result<()> {
        with_file!(self, file, u, f => u.allocate(f, len), p, f => p.allocate(f, len), Err(mismatch()))
    }
    fn as_fd<'a>(&self, file: &'a AutoFile) -> Option<std::os::fd::BorrowedFd<'a>> {
        Some(match file {
            AutoFile::Uring(u) => std::os::fd::AsFd::as_fd(u.file()),
            AutoFile::Portable(p) => std::os::fd::AsFd::as_fd(p),
        })
    }

    fn read_at(&self, file: &AutoFile, offset: u64, buf: AlignedBuf) -> BufResult {
        with_file!(self, file, u, f => u.read_at(f, offset, buf), p, f => p.read_at(f, offset, buf), (Err(mismatch()), buf))
    }
    fn write_at(&self, file: &AutoFile, offset: u64, buf: AlignedBuf) -> BufResult {
        with_file!(self, file, u, f => u.write_at(f, offset, buf), p, f => p.write_at(f, offset, buf), (Err(mismatch()), buf))
    }
    fn sync_data(&self, file: &AutoFile) -> io::Result<()> {
        with_file!(self, file, u, f => u.sync_data(f), p, f => p.sync_data(f), Err(mismatch()))
    }
    fn lock_dir(&self, dir: &Path) -> io::Result<DirLock> {
        PortableBackend::new().lock_dir(dir)
    }
    fn alignment(&self, dir: &Path) -> usize {
        match self {
            AutoBackend::Uring(u) => u.alignment(dir),
            AutoBackend::Portable(p) => p.alignment(dir),
        }
    }
    fn read_alignment(&self, dir: &Path) -> usize {
        match self {
            AutoBackend::Uring(u) => u.read_alignment(dir),
            AutoBackend::Portable(p) => p.read_alignment(dir),
        }
    }
    fn alloc_buf(&self, len: usize, align: usize) -> AlignedBuf {
        match self {
            AutoBackend::Uring(u) => u.alloc_buf(len, align),
            AutoBackend::Portable(p) => p.alloc_buf(len, align),
        }
    }
    fn read_at_async(&self, file: &Arc<AutoFile>, offset: u64, buf: AlignedBuf) -> IoFuture {
        match (self, &**file) {
            (AutoBackend::Uring(u), AutoFile::Uring(f)) => Box::pin(u.read(f, offset, buf)),
            _ => Box::pin(std::future::ready(self.read_at(file, offset, buf))),
        }
    }
    fn pipelines_reads(&self) -> bool {
        match self {
            AutoBackend::Portable(p) => p.pipelines_reads(),
            AutoBackend::Uring(u) => u.pipelines_reads(),
        }
    }

    fn queues_writes(&self) -> bool {
        match self {
            AutoBackend::Portable(p) => p.queues_writes(),
            AutoBackend::Uring(u) => u.queues_writes(),
        }
    }

    fn punch_hole(&self, file: &AutoFile, offset: u64, len: u64) -> io::Result<()> {
        match (self, file) {
            (AutoBackend::Portable(p), AutoFile::Portable(f)) => p.punch_hole(f, offset, len),
            (AutoBackend::Uring(u), AutoFile::Uring(f)) => u.punch_hole(f, offset, len),
            _ => Err(io::ErrorKind::Unsupported.into()),
        }
    }

    fn read_new(&self, file: &AutoFile, offset: u64, len: usize, align: usize) -> io::Result<AlignedBuf> {
        match (self, file) {
            (AutoBackend::Portable(p), AutoFile::Portable(f)) => p.read_new(f, offset, len, align),
            (AutoBackend::Uring(u), AutoFile::Uring(f)) => u.read_new(f, offset, len, align),
            _ => super::read_by_alloc(self, file, offset, len, align),
        }
    }

    fn gathers_writes(&self) -> bool {
        match self {
            AutoBackend::Portable(p) => p.gathers_writes(),
            AutoBackend::Uring(u) => u.gathers_writes(),
        }
    }

    fn write_gather_at(&self, file: &AutoFile, offset: u64, parts: &[&[u8]]) -> io::Result<()> {
        match (self, file) {
            (AutoBackend::Portable(p), AutoFile::Portable(f)) => p.write_gather_at(f, offset, parts),
            (AutoBackend::Uring(u), AutoFile::Uring(f)) => u.write_gather_at(f, offset, parts),
            _ => super::gather_by_copy(self, file, offset, parts),
        }
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
            AutoBackend::Portable(p) => {
                while let Some(r) = next() {
                    let res = match &*r.file {
                        AutoFile::Portable(f) => p.read_at(f, r.offset, r.buf),
                        AutoFile::Uring(_) => (Err(mismatch()), r.buf),
                    };
                    done(r.tag, res);
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
                        AutoFile::Portable(_) => None,
                    })
                    .collect();
                return u.read_many(reqs);
            }
        }
        reqs.into_iter().map(|r| self.read_at(r.file, r.offset, r.buf)).collect()
    }
}
