//! The portable backend: blocking positional I/O through std and rustix.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use rustix::fs::{AtFlags, FallocateFlags, FlockOperation, StatxFlags, CWD};

use super::{Backend, BufResult, DirLock};
use crate::buf::AlignedBuf;

/// Safe default I/O alignment when the file system does not report one.
pub const DEFAULT_ALIGN: usize = 4096;

/// Blocking `pread`/`pwrite`. Works everywhere. Buffered (page cache) by default; with
/// [`PortableBackend::with_direct`], O_DIRECT where the file system allows it.
#[derive(Debug, Clone, Default)]
pub struct PortableBackend {
    direct: bool,
    direct_refused: Arc<AtomicBool>,
}

impl PortableBackend {
    /// A new portable backend doing buffered I/O.
    pub fn new() -> Self {
        Self::default()
    }

    /// A portable backend that opens files with O_DIRECT (buffered where the file system refuses).
    pub fn with_direct(direct: bool) -> Self {
        PortableBackend { direct, direct_refused: Arc::default() }
    }

    /// Whether files are opened with O_DIRECT (false also after the file system refused it).
    pub fn direct(&self) -> bool {
        self.direct && !self.direct_refused.load(Ordering::Relaxed)
    }
}

/// Switch an open file to O_DIRECT. Returns false, after logging once per process why, when the file
/// system refuses (tmpfs before 6.6, some FUSE and network file systems); the file stays buffered.
pub(crate) fn enable_direct(file: &File, path: &Path) -> bool {
    static WARNED: AtomicBool = AtomicBool::new(false);
    let r = rustix::fs::fcntl_getfl(file).and_then(|fl| rustix::fs::fcntl_setfl(file, fl | rustix::fs::OFlags::DIRECT));
    match r {
        Ok(()) => true,
        Err(e) => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                log::warn!("O_DIRECT refused for {} ({e}); using buffered I/O", path.display());
            }
            false
        }
    }
}

impl super::sealed::Sealed for PortableBackend {}

impl Backend for PortableBackend {
    type File = File;

    fn name(&self) -> &'static str {
        "portable"
    }

    fn fresh(&self) -> io::Result<Self> {
        Ok(PortableBackend::with_direct(self.direct))
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        std::fs::create_dir_all(path)
    }

    fn is_dir(&self, path: &Path) -> bool {
        path.is_dir()
    }

    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        let mut names = Vec::new();
        for entry in std::fs::read_dir(path)? {
            names.push(entry?.file_name().to_string_lossy().into_owned());
        }
        Ok(names)
    }

    fn open(&self, path: &Path, create: bool) -> io::Result<File> {
        let mut o = OpenOptions::new();
        o.read(true).write(true);
        if create {
            o.create_new(true);
        }
        let f = o.open(path)?;
        if !f.metadata()?.is_file() {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"));
        }
        if self.direct() && !enable_direct(&f, path) {
            self.direct_refused.store(true, Ordering::Relaxed);
        }
        Ok(f)
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        std::fs::remove_file(path)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        std::fs::rename(from, to)
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        File::open(path)?.sync_all()
    }

    fn file_len(&self, file: &File) -> io::Result<u64> {
        Ok(file.metadata()?.len())
    }

    fn allocate(&self, file: &File, len: u64) -> io::Result<bool> {
        allocate_file(file, len)
    }

    fn as_fd<'a>(&self, file: &'a File) -> Option<std::os::fd::BorrowedFd<'a>> {
        Some(std::os::fd::AsFd::as_fd(file))
    }

    fn read_at(&self, file: &File, offset: u64, mut buf: AlignedBuf) -> BufResult {
        // `read_exact_at` loops over short reads and EINTR and reports EOF as UnexpectedEof.
        let r = file.read_exact_at(&mut buf, offset);
        (r, buf)
    }

    fn write_at(&self, file: &File, offset: u64, buf: AlignedBuf) -> BufResult {
        // `write_all_at` loops over short writes and EINTR; a zero-length write is an error.
        let r = file.write_all_at(&buf, offset);
        (r, buf)
    }

    fn punch_hole(&self, file: &File, offset: u64, len: u64) -> io::Result<()> {
        punch_hole(file, offset, len)
    }

    fn detached_punch(&self) -> Option<super::DetachedPunch<File>> {
        Some(punch_hole)
    }

    fn read_new(&self, file: &File, offset: u64, len: usize, align: usize) -> io::Result<AlignedBuf> {
        AlignedBuf::read_exact_at(file, offset, len, buffered_align(self.direct(), align))
    }

    fn read_new_crc(
        &self,
        file: &File,
        offset: u64,
        len: usize,
        align: usize,
        check: std::ops::Range<usize>,
    ) -> io::Result<(AlignedBuf, u32)> {
        super::read_new_checked(file, offset, len, buffered_align(self.direct(), align), check)
    }

    fn gathers_writes(&self) -> bool {
        !self.direct()
    }

    fn write_gather_at(&self, file: &File, offset: u64, parts: &[&[u8]]) -> io::Result<()> {
        write_gather(file, offset, parts)
    }

    fn sync_data(&self, file: &File) -> io::Result<()> {
        file.sync_data()
    }

    fn lock_dir(&self, dir: &Path) -> io::Result<DirLock> {
        let f = OpenOptions::new().read(true).write(true).create(true).truncate(false).open(dir.join("LOCK"))?;
        rustix::fs::flock(&f, FlockOperation::NonBlockingLockExclusive).map_err(io::Error::from)?;
        Ok(Box::new(f))
    }

    fn alignment(&self, dir: &Path) -> usize {
        alignment(dir, self.direct())
    }

    fn read_alignment(&self, dir: &Path) -> usize {
        read_alignment(dir, self.direct())
    }
}

/// The write and layout alignment for segment files in `dir` ([`Backend::alignment`]) for a backend
/// that opens them with O_DIRECT (`direct`) or not: the larger of the read alignment and the file
/// system block. Shared by every file backend, so that io_uring's direct files get their O_DIRECT
/// alignment too.
pub(crate) fn alignment(dir: &Path, direct: bool) -> usize {
    let dio = read_alignment(dir, direct);
    let block = rustix::fs::statx(CWD, dir, AtFlags::empty(), StatxFlags::BASIC_STATS)
        .map(|st| st.stx_blksize as usize)
        .unwrap_or(DEFAULT_ALIGN);
    if block.is_power_of_two() {
        dio.max(block.clamp(512, 65536))
    } else {
        dio.max(DEFAULT_ALIGN)
    }
}

/// The offset alignment of reads from segment files in `dir`: the O_DIRECT alignment for direct
/// files; for buffered ones the frame alignment (64), so a read covers its record and little more
/// (a 4 KiB value's record is read as 4224 bytes instead of 4608-5120).
pub(crate) fn read_alignment(dir: &Path, direct: bool) -> usize {
    if !direct {
        return crate::format::FRAME_ALIGN as usize;
    }
    // STATX_DIOALIGN is reported for regular files: ask about the lock file when it exists.
    dio_alignment(&dir.join("LOCK")).or_else(|| dio_alignment(dir)).unwrap_or(DEFAULT_ALIGN)
}

/// The memory alignment a read of `align`-aligned ranges needs: `align` for O_DIRECT files (DMA);
/// for buffered ones at most the frame alignment (64), so that frames read back stay 64-byte aligned
/// (record offsets are multiples of 64) while the buffer comes from a plain allocation, which glibc
/// serves far faster than an aligned one (see `buf::heap`).
pub(crate) fn buffered_align(direct: bool, align: usize) -> usize {
    if direct {
        align
    } else {
        align.min(crate::format::FRAME_ALIGN as usize)
    }
}

/// The O_DIRECT offset alignment the file system reports for `path` (statx `STATX_DIOALIGN`, Linux
/// 6.1+): the larger of its offset and memory alignments, clamped to 512..=65536 (the log's range);
/// `None` when unknown. Devices with 8 or 16 KiB logical blocks report more than 4096, and reads at
/// a smaller alignment would fail with EINVAL there.
pub fn dio_alignment(path: &Path) -> Option<usize> {
    let st = rustix::fs::statx(CWD, path, AtFlags::empty(), StatxFlags::DIOALIGN).ok()?;
    if !StatxFlags::from_bits_retain(st.stx_mask).contains(StatxFlags::DIOALIGN) {
        return None;
    }
    dio_align_of(st.stx_dio_offset_align, st.stx_dio_mem_align)
}

/// [`dio_alignment`] from statx's two fields.
fn dio_align_of(offset_align: u32, mem_align: u32) -> Option<usize> {
    let a = offset_align.max(mem_align) as usize;
    if a == 0 || !a.is_power_of_two() {
        return None;
    }
    Some(a.clamp(512, 65536))
}

/// Give a new segment file its size, reserving its blocks (`fallocate`) where the file system can.
/// Writes into reserved blocks need no block allocation on the way. Measured here on ext4, buffered
/// `pwrite`s of 128 KiB / 1 MiB / 16 MiB into a fresh file (1 GiB, best of 8 rounds) took
/// 20 / 166 / 2240 µs into a fallocated file against 29 / 226 / 3180 µs into a sparse or growing one,
/// and store spills went 13-36% faster (docs/benchmarks.md, "Measured choices in the write path").
/// On a file system too full for the whole segment, the file is extended sparsely instead, so that
/// the records that still fit can be written: the full disk then shows up as an ENOSPC from a write,
/// which fails only that call (for O_DIRECT files too: a direct write into a hole allocates its
/// blocks on the way).
pub(crate) fn allocate_file(file: &File, len: u64) -> io::Result<bool> {
    use rustix::io::Errno;
    match rustix::fs::fallocate(file, FallocateFlags::empty(), 0, len) {
        Ok(()) => return Ok(true),
        // File systems without fallocate (some FUSE, old NFS): a sparse extension instead.
        Err(Errno::OPNOTSUPP | Errno::NOSYS | Errno::NOSPC | Errno::DQUOT) => {}
        Err(e) => return Err(e.into()),
    }
    if file.metadata()?.len() < len {
        file.set_len(len)?;
    }
    Ok(false)
}

/// `pwritev` of `parts` at `offset`, at most `IOV_MAX` slices per call, resuming after short writes
/// and EINTR; a write of zero bytes is `WriteZero`.
pub(crate) fn write_gather(file: &File, mut offset: u64, parts: &[&[u8]]) -> io::Result<()> {
    const IOV_MAX: usize = 1024;
    let mut parts: Vec<&[u8]> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
    let mut first = 0;
    while first < parts.len() {
        let iov: Vec<io::IoSlice<'_>> = parts[first..].iter().take(IOV_MAX).map(|p| io::IoSlice::new(p)).collect();
        let mut n = match rustix::io::pwritev(file, &iov, offset) {
            Ok(0) => return Err(io::Error::new(io::ErrorKind::WriteZero, "pwritev wrote nothing")),
            Ok(n) => n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        };
        offset += n as u64;
        while n > 0 {
            let p = parts[first];
            if n >= p.len() {
                n -= p.len();
                first += 1;
            } else {
                parts[first] = &p[n..];
                n = 0;
            }
        }
    }
    Ok(())
}

/// `fallocate(PUNCH_HOLE | KEEP_SIZE)`.
pub(crate) fn punch_hole(file: &File, offset: u64, len: u64) -> io::Result<()> {
    rustix::fs::fallocate(file, FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE, offset, len)
        .map_err(io::Error::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A device with 8 or 16 KiB logical blocks reports that as its O_DIRECT alignment; reads at a
    /// smaller one (4096, say, were the alignment capped at that) fail with EINVAL there.
    #[test]
    fn dio_alignment_keeps_large_device_blocks() {
        assert_eq!(dio_align_of(512, 4), Some(512));
        assert_eq!(dio_align_of(512, 4096), Some(4096));
        assert_eq!(dio_align_of(8192, 512), Some(8192));
        assert_eq!(dio_align_of(16384, 16384), Some(16384));
        assert_eq!(dio_align_of(1 << 20, 512), Some(65536), "clamped to the log's range");
        assert_eq!(dio_align_of(1, 1), Some(512), "at least a sector");
        assert_eq!(dio_align_of(0, 0), None, "not reported");
        assert_eq!(dio_align_of(3000, 512), None, "not a power of two");
    }

    /// Direct files are laid out at least at their O_DIRECT alignment; buffered reads need only 64.
    #[test]
    fn direct_alignment_covers_the_dio_alignment() {
        let tmp = tempfile::tempdir().unwrap();
        std::fs::write(tmp.path().join("LOCK"), b"").unwrap();
        let direct = alignment(tmp.path(), true);
        assert!(direct.is_power_of_two() && (512..=65536).contains(&direct), "{direct}");
        if let Some(dio) = dio_alignment(&tmp.path().join("LOCK")) {
            assert_eq!(read_alignment(tmp.path(), true), dio);
            assert_eq!(direct % dio, 0, "{direct} is not a multiple of the O_DIRECT alignment {dio}");
        }
        assert_eq!(read_alignment(tmp.path(), false), crate::format::FRAME_ALIGN as usize);
        assert!(alignment(tmp.path(), false) >= 512);
    }
}
