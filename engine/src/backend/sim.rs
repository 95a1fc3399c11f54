//! A deterministic in-memory file system for tests: crash simulation and fault injection.
//!
//! Every file keeps two images: what a reader sees now (`cur`) and what would survive a power loss
//! (`durable`, updated by `sync_data`). Directory entries are likewise durable only after `sync_dir`
//! of their parent. [`SimBackend::crash`] returns a new file system holding only durable state,
//! optionally with a seeded prefix of the unsynced writes applied (the last one torn at a 512-byte
//! sector boundary), which is what a power cut can leave behind.
//!
//! Faults are scripted with [`Fault`]: "the n-th matching operation from now fails with EIO / ENOSPC /
//! a torn write", once or from then on. Everything is deterministic for a given script and seed.

use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use super::{Backend, BufResult, DirLock};
use crate::buf::AlignedBuf;

/// Which operations a [`Fault`] applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultOp {
    /// `read_at`.
    Read,
    /// `write_at`.
    Write,
    /// `sync_data` and `sync_dir`.
    Sync,
    /// `allocate`.
    Allocate,
    /// `open` with create.
    Create,
    /// `open` without create (an existing file). Not counted by `Any` (nor by
    /// [`SimBackend::op_count`]), so adding it changed no existing fault schedule.
    Open,
    /// `remove_file`.
    Remove,
    /// `punch_hole`. Not counted by `Any` (nor by [`SimBackend::op_count`]): the log treats most
    /// punches as advisory, so a fault there is often not an error to its caller.
    Punch,
    /// Every counted operation.
    Any,
}

/// What an injected fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// Fail with EIO, changing nothing.
    Eio,
    /// Fail with ENOSPC, changing nothing.
    Enospc,
    /// Write the first half of the buffer (rounded down to 512 bytes), then fail with EIO.
    TornWrite,
    /// Write the first half of the buffer (rounded down to 512 bytes), then fail with ENOSPC: a file
    /// system that filled up in the middle of a write.
    TornEnospc,
    /// Panic, changing nothing: a bug in a backend, for the code that must survive one.
    Panic,
}

/// A scripted failure: the operation matching `op` after `after` successful matching operations fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// Operations this fault counts and hits.
    pub op: FaultOp,
    /// Matching operations that succeed before the fault fires.
    pub after: u64,
    /// What happens when it fires.
    pub kind: FaultKind,
    /// Keep failing every matching operation once fired (until [`SimBackend::clear_faults`]).
    pub sticky: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpKind {
    Read,
    Write,
    Sync,
    Allocate,
    Create,
    Open,
    Remove,
    Punch,
}

impl FaultOp {
    fn matches(self, op: OpKind) -> bool {
        matches!(
            (self, op),
            (
                FaultOp::Any,
                OpKind::Read | OpKind::Write | OpKind::Sync | OpKind::Allocate | OpKind::Create | OpKind::Remove
            ) | (FaultOp::Punch, OpKind::Punch)
                | (FaultOp::Read, OpKind::Read)
                | (FaultOp::Write, OpKind::Write)
                | (FaultOp::Sync, OpKind::Sync)
                | (FaultOp::Allocate, OpKind::Allocate)
                | (FaultOp::Create, OpKind::Create)
                | (FaultOp::Open, OpKind::Open)
                | (FaultOp::Remove, OpKind::Remove)
        )
    }
}

#[derive(Debug, Default)]
struct InodeData {
    cur: Vec<u8>,
    durable: Vec<u8>,
    /// Writes since the last sync, in order: (offset, bytes).
    pending: Vec<(u64, Vec<u8>)>,
}

#[derive(Debug, Default)]
struct Inode {
    data: Mutex<InodeData>,
}

impl Inode {
    fn lock(&self) -> MutexGuard<'_, InodeData> {
        self.data.lock().unwrap_or_else(|p| p.into_inner())
    }
}

#[derive(Debug)]
struct FaultState {
    fault: Fault,
    remaining: u64,
    fired: bool,
}

#[derive(Debug)]
struct SimState {
    dirs: BTreeSet<PathBuf>,
    names: BTreeMap<PathBuf, Arc<Inode>>,
    durable_names: BTreeMap<PathBuf, Arc<Inode>>,
    locks: BTreeSet<PathBuf>,
    faults: Vec<FaultState>,
    /// Faults that fired so far.
    fired: u64,
    ops: u64,
    writes: u64,
    align: usize,
    /// Report `queues_writes`, so the log uses its grouped write path (writes still run in order).
    queue_writes: bool,
    gather_writes: bool,
    /// Reads (offset, length) since `record_reads(true)`, when recording.
    reads: Option<Vec<(u64, usize)>>,
}

/// An open simulated file.
#[derive(Debug, Clone)]
pub struct SimFile {
    inode: Arc<Inode>,
}

/// The simulated backend. Cloning shares the same file system.
#[derive(Debug, Clone)]
pub struct SimBackend {
    state: Arc<Mutex<SimState>>,
}

impl Default for SimBackend {
    fn default() -> Self {
        Self::new()
    }
}

impl SimBackend {
    /// An empty file system with 4 KiB alignment.
    pub fn new() -> Self {
        Self::with_alignment(4096)
    }

    /// An empty file system reporting `align` as its I/O alignment.
    pub fn with_alignment(align: usize) -> Self {
        assert!(align.is_power_of_two());
        SimBackend {
            state: Arc::new(Mutex::new(SimState {
                dirs: BTreeSet::new(),
                names: BTreeMap::new(),
                durable_names: BTreeMap::new(),
                locks: BTreeSet::new(),
                faults: Vec::new(),
                fired: 0,
                ops: 0,
                writes: 0,
                align,
                queue_writes: false,
                gather_writes: false,
                reads: None,
            })),
        }
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Claim a submission queue (`Backend::queues_writes`), so the log writes batches as groups the
    /// way it does on io_uring; the writes themselves still happen one by one, in order.
    pub fn set_queue_writes(&self, on: bool) {
        self.lock().queue_writes = on;
    }

    /// Claim gathered writes (`Backend::gathers_writes`), so the log writes chunks holding large values
    /// from the values' own buffers the way it does on buffered portable files; the simulated write
    /// itself still copies (and faults) like any other write.
    pub fn set_gather_writes(&self, on: bool) {
        self.lock().gather_writes = on;
    }

    /// Start (or stop) recording the offset and length of every read, for tests of what the log
    /// reads; starting clears what was recorded.
    pub fn record_reads(&self, on: bool) {
        self.lock().reads = on.then(Vec::new);
    }

    /// The reads recorded since the last call (or since recording started), as (offset, length).
    pub fn take_reads(&self) -> Vec<(u64, usize)> {
        self.lock().reads.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Schedule a fault.
    pub fn inject(&self, fault: Fault) {
        self.lock().faults.push(FaultState { fault, remaining: fault.after, fired: false });
    }

    /// Remove every scheduled or sticky fault.
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// Number of I/O operations performed so far (reads, writes, syncs, allocations, creates, removes).
    pub fn op_count(&self) -> u64 {
        self.lock().ops
    }

    /// Number of writes performed so far (what a [`FaultOp::Write`] fault counts).
    pub fn write_count(&self) -> u64 {
        self.lock().writes
    }

    /// Whether any injected fault has fired.
    pub fn fault_fired(&self) -> bool {
        self.lock().fired > 0
    }

    fn check(&self, op: OpKind) -> Option<FaultKind> {
        let mut st = self.lock();
        if op != OpKind::Punch && op != OpKind::Open {
            st.ops += 1;
        }
        if op == OpKind::Write {
            st.writes += 1;
        }
        let mut hit = None;
        let mut fired = 0;
        st.faults.retain_mut(|f| {
            if !f.fault.op.matches(op) {
                return true;
            }
            if f.fired && f.fault.sticky {
                hit = hit.or(Some(f.fault.kind));
                fired += 1;
                return true;
            }
            if f.remaining == 0 {
                f.fired = true;
                hit = hit.or(Some(f.fault.kind));
                fired += 1;
                return f.fault.sticky;
            }
            f.remaining -= 1;
            true
        });
        st.fired += fired;
        drop(st);
        if hit == Some(FaultKind::Panic) {
            panic!("injected backend panic ({op:?})");
        }
        hit
    }

    fn fault_error(kind: FaultKind) -> io::Error {
        match kind {
            FaultKind::Enospc | FaultKind::TornEnospc => io::Error::from_raw_os_error(28),
            FaultKind::Eio | FaultKind::TornWrite | FaultKind::Panic => io::Error::from_raw_os_error(5),
        }
    }

    /// The file system a power cut would leave: only synced data and synced directory entries.
    ///
    /// With `Some(seed)`, a seeded number of the unsynced writes of each file are applied in order
    /// on top of its durable image, the last of them cut at a random 512-byte boundary (a torn write).
    pub fn crash(&self, seed: Option<u64>) -> SimBackend {
        let st = self.lock();
        let mut rng = seed.unwrap_or(0) | 1;
        let mut next = move || {
            // xorshift64*: deterministic, dependency-free.
            rng ^= rng >> 12;
            rng ^= rng << 25;
            rng ^= rng >> 27;
            rng.wrapping_mul(0x2545_F491_4F6C_DD1D)
        };
        let mut names = BTreeMap::new();
        for (path, inode) in &st.durable_names {
            let d = inode.lock();
            let mut image = d.durable.clone();
            if seed.is_some() && !d.pending.is_empty() {
                let keep = (next() % (d.pending.len() as u64 + 1)) as usize;
                for (i, (off, bytes)) in d.pending.iter().take(keep).enumerate() {
                    let mut bytes = &bytes[..];
                    if i + 1 == keep {
                        let sectors = bytes.len().div_ceil(512) as u64;
                        let cut = ((next() % (sectors + 1)) * 512).min(bytes.len() as u64) as usize;
                        bytes = &bytes[..cut];
                    }
                    let end = *off as usize + bytes.len();
                    if image.len() < end {
                        image.resize(end, 0);
                    }
                    image[*off as usize..end].copy_from_slice(bytes);
                }
            }
            let fresh = Inode::default();
            {
                let mut f = fresh.lock();
                f.cur = image.clone();
                f.durable = image;
            }
            names.insert(path.clone(), Arc::new(fresh));
        }
        SimBackend {
            state: Arc::new(Mutex::new(SimState {
                dirs: st.dirs.clone(),
                durable_names: names.clone(),
                names,
                locks: BTreeSet::new(),
                faults: Vec::new(),
                fired: 0,
                ops: 0,
                writes: 0,
                align: st.align,
                queue_writes: st.queue_writes,
                gather_writes: st.gather_writes,
                reads: None,
            })),
        }
    }

    /// The current contents of a file (test helper).
    pub fn file_contents(&self, path: &Path) -> Option<Vec<u8>> {
        let st = self.lock();
        st.names.get(path).map(|i| i.lock().cur.clone())
    }

    /// Overwrite bytes of a file directly, durable at once (test helper: bit flips, garbage).
    pub fn poke(&self, path: &Path, offset: u64, bytes: &[u8]) -> io::Result<()> {
        let st = self.lock();
        let inode = st.names.get(path).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let mut guard = inode.lock();
        let d = &mut *guard;
        let end = offset as usize + bytes.len();
        for img in [&mut d.cur, &mut d.durable] {
            if img.len() < end {
                img.resize(end, 0);
            }
            img[offset as usize..end].copy_from_slice(bytes);
        }
        Ok(())
    }

    /// Truncate a file, durable at once (test helper).
    pub fn truncate(&self, path: &Path, len: u64) -> io::Result<()> {
        let st = self.lock();
        let inode = st.names.get(path).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        let mut d = inode.lock();
        d.cur.truncate(len as usize);
        d.durable.truncate(len as usize);
        d.pending.clear();
        Ok(())
    }

    /// Paths of all files (test helper).
    pub fn files(&self) -> Vec<PathBuf> {
        self.lock().names.keys().cloned().collect()
    }
}

struct SimLock {
    state: Arc<Mutex<SimState>>,
    dir: PathBuf,
}

impl Drop for SimLock {
    fn drop(&mut self) {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        st.locks.remove(&self.dir);
    }
}

impl super::sealed::Sealed for SimBackend {}

impl Backend for SimBackend {
    type File = SimFile;

    fn name(&self) -> &'static str {
        "sim"
    }

    /// A fresh simulated disk with the same alignment (its faults are scripted apart: a test fails
    /// one log's disk and sees the next one work).
    fn fresh(&self) -> io::Result<Self> {
        Ok(SimBackend::with_alignment(self.lock().align))
    }

    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        let mut st = self.lock();
        let mut p = Some(path);
        while let Some(d) = p {
            if st.names.contains_key(d) {
                return Err(io::Error::new(io::ErrorKind::AlreadyExists, "a file is in the way"));
            }
            st.dirs.insert(d.to_path_buf());
            p = d.parent().filter(|x| !x.as_os_str().is_empty());
        }
        Ok(())
    }

    fn is_dir(&self, path: &Path) -> bool {
        self.lock().dirs.contains(path)
    }

    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        let st = self.lock();
        if !st.dirs.contains(path) {
            return Err(io::Error::from(io::ErrorKind::NotFound));
        }
        let files = st.names.keys();
        let dirs = st.dirs.iter();
        Ok(files
            .chain(dirs)
            .filter(|p| p.parent() == Some(path))
            .filter_map(|p| p.file_name().map(|n| n.to_string_lossy().into_owned()))
            .collect())
    }

    fn open(&self, path: &Path, create: bool) -> io::Result<SimFile> {
        if let Some(kind) = self.check(if create { OpKind::Create } else { OpKind::Open }) {
            return Err(Self::fault_error(kind));
        }
        let mut st = self.lock();
        if st.dirs.contains(path) {
            return Err(io::Error::new(io::ErrorKind::InvalidInput, "not a regular file"));
        }
        match (st.names.get(path), create) {
            (Some(_), true) => Err(io::Error::from(io::ErrorKind::AlreadyExists)),
            (Some(i), false) => Ok(SimFile { inode: i.clone() }),
            (None, false) => Err(io::Error::from(io::ErrorKind::NotFound)),
            (None, true) => {
                let parent = path.parent().unwrap_or(Path::new(""));
                if !st.dirs.contains(parent) {
                    return Err(io::Error::from(io::ErrorKind::NotFound));
                }
                let inode = Arc::new(Inode::default());
                st.names.insert(path.to_path_buf(), inode.clone());
                Ok(SimFile { inode })
            }
        }
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        if let Some(kind) = self.check(OpKind::Remove) {
            return Err(Self::fault_error(kind));
        }
        let mut st = self.lock();
        st.names.remove(path).map(|_| ()).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        if let Some(kind) = self.check(OpKind::Remove) {
            return Err(Self::fault_error(kind));
        }
        let mut st = self.lock();
        let inode = st.names.remove(from).ok_or_else(|| io::Error::from(io::ErrorKind::NotFound))?;
        st.names.insert(to.to_path_buf(), inode);
        Ok(())
    }

    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        if let Some(kind) = self.check(OpKind::Sync) {
            return Err(Self::fault_error(kind));
        }
        let mut st = self.lock();
        let st = &mut *st;
        st.durable_names.retain(|p, _| p.parent() != Some(path));
        for (p, i) in &st.names {
            if p.parent() == Some(path) {
                st.durable_names.insert(p.clone(), i.clone());
            }
        }
        Ok(())
    }

    fn file_len(&self, file: &SimFile) -> io::Result<u64> {
        Ok(file.inode.lock().cur.len() as u64)
    }

    fn allocate(&self, file: &SimFile, len: u64) -> io::Result<bool> {
        if let Some(kind) = self.check(OpKind::Allocate) {
            return Err(Self::fault_error(kind));
        }
        let mut d = file.inode.lock();
        if (d.cur.len() as u64) < len {
            d.cur.resize(len as usize, 0);
        }
        // fallocate's size change is metadata that fdatasync persists; model it as durable at once.
        if (d.durable.len() as u64) < len {
            d.durable.resize(len as usize, 0);
        }
        Ok(true)
    }

    fn read_at(&self, file: &SimFile, offset: u64, mut buf: AlignedBuf) -> BufResult {
        if let Some(kind) = self.check(OpKind::Read) {
            return (Err(Self::fault_error(kind)), buf);
        }
        if let Some(r) = self.lock().reads.as_mut() {
            r.push((offset, buf.len()));
        }
        let d = file.inode.lock();
        let end = offset as usize + buf.len();
        if end > d.cur.len() {
            return (Err(io::Error::from(io::ErrorKind::UnexpectedEof)), buf);
        }
        buf.copy_from_slice(&d.cur[offset as usize..end]);
        (Ok(()), buf)
    }

    /// True, so that tests drive the callers' batched read paths (the reads themselves run one after
    /// another, through the default `read_pipelined`).
    fn pipelines_reads(&self) -> bool {
        true
    }

    fn queues_writes(&self) -> bool {
        self.lock().queue_writes
    }

    fn gathers_writes(&self) -> bool {
        self.lock().gather_writes
    }

    fn punch_hole(&self, file: &SimFile, offset: u64, len: u64) -> io::Result<()> {
        // Like a write of zeros (and, as a write, volatile until a sync). A torn fault zeroes the
        // first half (rounded down to 512 bytes), then fails.
        let fault = self.check(OpKind::Punch);
        let len = match fault {
            Some(FaultKind::TornWrite | FaultKind::TornEnospc) => (len / 2) / 512 * 512,
            Some(kind) => return Err(Self::fault_error(kind)),
            None => len,
        };
        let mut d = file.inode.lock();
        let end = (offset + len).min(d.cur.len() as u64) as usize;
        if (offset as usize) < end {
            d.cur[offset as usize..end].fill(0);
            d.pending.push((offset, vec![0; end - offset as usize]));
        }
        match fault {
            Some(kind) => Err(Self::fault_error(kind)),
            None => Ok(()),
        }
    }

    fn write_at(&self, file: &SimFile, offset: u64, buf: AlignedBuf) -> BufResult {
        let fault = self.check(OpKind::Write);
        let n = match fault {
            Some(FaultKind::TornWrite | FaultKind::TornEnospc) => (buf.len() / 2) / 512 * 512,
            Some(kind) => return (Err(Self::fault_error(kind)), buf),
            None => buf.len(),
        };
        let mut d = file.inode.lock();
        let end = offset as usize + n;
        if d.cur.len() < end {
            d.cur.resize(end, 0);
        }
        d.cur[offset as usize..end].copy_from_slice(&buf[..n]);
        d.pending.push((offset, buf[..n].to_vec()));
        match fault {
            Some(kind) => (Err(Self::fault_error(kind)), buf),
            None => (Ok(()), buf),
        }
    }

    fn sync_data(&self, file: &SimFile) -> io::Result<()> {
        if let Some(kind) = self.check(OpKind::Sync) {
            return Err(Self::fault_error(kind));
        }
        let mut guard = file.inode.lock();
        let InodeData { cur, durable, pending } = &mut *guard;
        for (off, bytes) in pending.drain(..) {
            let end = off as usize + bytes.len();
            if durable.len() < end {
                durable.resize(end, 0);
            }
            durable[off as usize..end].copy_from_slice(&bytes);
        }
        durable.resize(cur.len(), 0);
        debug_assert!(durable == cur);
        Ok(())
    }

    fn lock_dir(&self, dir: &Path) -> io::Result<DirLock> {
        let mut st = self.lock();
        if !st.locks.insert(dir.to_path_buf()) {
            return Err(io::Error::from(io::ErrorKind::WouldBlock));
        }
        Ok(Box::new(SimLock { state: self.state.clone(), dir: dir.to_path_buf() }))
    }

    fn alignment(&self, _dir: &Path) -> usize {
        self.lock().align
    }
}
