//! The io_uring backend: one driver thread owns the ring; callers hand it operations and wait.
//!
//! ## Shape
//! * **Driver.** [`UringBackend::new`] creates the ring, registers a [`BufPool`] and a sparse table of
//!   files, and starts a thread that owns the ring for its whole life. Callers (any thread) push
//!   requests on a mutex-protected queue and kick an `eventfd` only when the driver sleeps; the
//!   driver keeps a read of that eventfd armed in the ring, so it can block in `io_uring_enter` waiting
//!   for either a completion or new work. It never spins: when nothing is reaped it sleeps in the
//!   kernel. Every pass moves every queued request into the submission queue at once (batched
//!   submission, one `io_uring_enter` for many operations).
//! * **Operations.** An operation owns its [`AlignedBuf`] and a reference to its file from the moment
//!   it is queued until the driver reaps its last completion. `user_data` is the operation's key in a
//!   [`Slab`] plus a piece number. A transfer larger than [`PIECE`] is cut into pieces submitted
//!   together; a short read or write resubmits the rest; `EAGAIN`/`EINTR` resubmit; a zero-length
//!   result is `UnexpectedEof` (read) or `WriteZero` (write); any other error fails the operation once
//!   its pieces in flight have completed.
//! * **Waiting.** The caller holds a [`UringOp`] future. [`Backend::read_at`]/`write_at` wait for it
//!   with [`crate::task::block_on`] (the blocking API, callable from many threads); async callers
//!   `.await` it. Dropping the future early does not free the buffer: the driver still owns it and
//!   drops it only after the kernel's completion is reaped. Safe code therefore cannot touch or free
//!   memory the kernel may write.
//! * **Shutdown.** Dropping the backend sets a flag and kicks the driver, which submits one
//!   `AsyncCancel` matching every request, reaps until nothing is in flight (cancelled or finished),
//!   and only then drops the ring, the registered pool and the buffers.
//!
//! ## Fallbacks
//! * No io_uring (`ENOSYS`, `EPERM` from seccomp, `kernel.io_uring_disabled`): [`UringBackend::new`]
//!   fails with a message saying which; [`super::AutoBackend`] logs it and uses the portable backend.
//! * Buffer registration refused (`RLIMIT_MEMLOCK` without `CAP_IPC_LOCK`): the pool is halved until
//!   registration succeeds; with none registered, I/O uses plain `Read`/`Write` on unregistered memory.
//! * O_DIRECT refused by the file system: files stay buffered (see [`super::enable_direct`]).
//! * IOPOLL is never used: virtio disks without poll queues fail polled reads with `EOPNOTSUPP`.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::Path;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::Duration;

use super::doorbell::Doorbell;

use io_uring::{opcode, squeue, types, IoUring, Probe};
use slab::Slab;

use super::{Backend, BufResult, DirLock, IoFuture, PipelinedRead, PortableBackend, ReadReq};
use crate::buf::{AlignedBuf, BufPool, PoolShared};
use crate::task::block_on;

/// Largest single submission; bigger transfers are cut into pieces of this size, submitted together.
pub const PIECE: usize = 4 << 20;

const WAKE: u64 = u64::MAX;
const CANCEL: u64 = u64::MAX - 1;
const PIECE_BITS: u32 = 24;

/// Settings of an [`UringBackend`].
#[derive(Debug, Clone)]
pub struct UringOptions {
    /// Submission queue entries (the completion queue gets twice as many). Also the most pieces in
    /// flight at once.
    pub entries: u32,
    /// Buffers in the registered pool (0: no pool). Halved on registration failure.
    pub pool_buffers: usize,
    /// Size of each pool buffer.
    pub pool_buffer_size: usize,
    /// Open segment files with O_DIRECT (falls back to buffered I/O where refused).
    pub direct: bool,
    /// Slots in the registered file table (0: use plain file descriptors).
    pub file_slots: u32,
    /// Run the blocking single-operation calls ([`Backend::read_at`], [`Backend::write_at`]) as
    /// `pread`/`pwrite` on the calling thread instead of through the ring. A lone blocking operation
    /// gains nothing from a queue, and the hand-off to the driver thread and back (two cross-CPU
    /// wake-ups) cost 60-80 µs per call on the 2-vCPU VM we measure on: 4 KiB spills from Python ran
    /// 6x faster inline. Batches ([`Backend::read_many`]) and async reads always use the ring.
    pub inline_blocking: bool,
}

impl Default for UringOptions {
    fn default() -> Self {
        UringOptions {
            entries: 256,
            pool_buffers: 8,
            pool_buffer_size: 1 << 20,
            direct: false,
            file_slots: 1024,
            inline_blocking: true,
        }
    }
}

/// What the driver ended up with (fallbacks taken at start-up).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UringInfo {
    /// Registered pool buffers (0 when registration failed or was not asked for).
    pub registered_buffers: usize,
    /// Size of each registered buffer.
    pub buffer_size: usize,
    /// Whether a registered file table is in use.
    pub fixed_files: bool,
    /// Whether completions run as deferred task work of the driver (Linux 6.1+).
    pub deferred_taskrun: bool,
}

/// io_uring I/O through a driver thread that owns the ring. See the module documentation.
pub struct UringBackend {
    shared: Arc<Shared>,
    driver: Option<JoinHandle<()>>,
    pool: Option<BufPool>,
    info: UringInfo,
    direct: bool,
    direct_refused: Arc<AtomicBool>,
    inline_blocking: bool,
    portable: PortableBackend,
    /// What it was started with (for [`Backend::fresh`]).
    opts: UringOptions,
}

/// A file opened by an [`UringBackend`].
#[derive(Clone)]
pub struct UringFile(Arc<FileInner>);

struct FileInner {
    file: File,
    /// Opened with O_DIRECT: a read that ends short at an offset the device cannot address (not a
    /// multiple of 512) has met the end of the file.
    direct: bool,
    /// Slot in the registered file table, when one was free.
    slot: Option<u32>,
    /// Set by the driver once the slot holds this file; read only by the driver.
    registered: AtomicBool,
    shared: Arc<Shared>,
}

impl Drop for FileInner {
    fn drop(&mut self) {
        if let Some(slot) = self.slot {
            // No operation refers to this file any more (each holds an Arc of it), so clearing the slot
            // cannot race with a submission that uses it.
            self.shared.send(vec![Request::Unregister { slot }]);
        }
    }
}

impl UringFile {
    /// The underlying std file.
    pub fn file(&self) -> &File {
        &self.0.file
    }

    /// Whether the file was opened with O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.0.direct
    }
}

enum Request {
    Io(IoOp),
    Register {
        file: Arc<FileInner>,
    },
    Unregister {
        slot: u32,
    },
    /// Makes the driver panic (tests of what callers see when it dies).
    #[cfg(test)]
    Panic,
}

/// Forks this process went through, counted in each child (a `pthread_atfork` handler, installed
/// with the first backend). A backend belongs to the process that made it: its ring and its driver
/// thread are that process's, and a child of a fork has no driver thread (a fork copies only the
/// thread that called it) while its copy of the ring maps the same kernel ring as the parent's.
/// So in a child, an inherited backend refuses every operation at once (instead of queueing it for
/// a driver that does not exist there, and waiting forever) and never touches the ring; a backend
/// the child makes itself works.
static FORKS: AtomicU64 = AtomicU64::new(0);

extern "C" fn count_fork_in_child() {
    FORKS.fetch_add(1, Ordering::Relaxed);
}

/// Install the fork counter (once per process) and return the forks so far.
fn forks() -> u64 {
    static INSTALL: std::sync::Once = std::sync::Once::new();
    INSTALL.call_once(|| {
        // SAFETY: `pthread_atfork` registers a handler for the child side of later forks; it takes
        // no pointer of ours but the function's. The handler only increments an atomic, which is
        // async-signal-safe, as what runs in the child of a multithreaded process's fork must be.
        let r = unsafe { libc::pthread_atfork(None, None, Some(count_fork_in_child)) };
        if r != 0 {
            log::warn!("io_uring: pthread_atfork failed ({r}): a forked child may wait on its parent's ring");
        }
    });
    FORKS.load(Ordering::Relaxed)
}

fn forked_error() -> io::Error {
    io::Error::other(
        "this io_uring backend belongs to the process this one was forked from (its ring and driver \
         thread are that process's): open the log again in this process",
    )
}

struct Shared {
    /// [`FORKS`] when the backend was made: any other value means this is a forked child.
    forks: u64,
    /// Requests for the driver; `None` once the driver has died (panicked), so that a request sent
    /// afterwards fails at once instead of waiting for a driver that is gone.
    queue: Mutex<Option<Vec<Request>>>,
    /// The driver's sleep/wake handshake (loom-modelled in `loom-tests/tests/doorbell.rs`).
    idle: Doorbell,
    shutdown: AtomicBool,
    eventfd: OwnedFd,
    free_slots: Mutex<Vec<u32>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl Shared {
    /// Whether this process is a fork of the one that made the backend.
    fn forked(&self) -> bool {
        FORKS.load(Ordering::Relaxed) != self.forks
    }

    fn send(&self, reqs: Vec<Request>) {
        if self.forked() {
            // Not even the queue's lock: another thread of the parent may have held it at the fork.
            for r in reqs {
                if let Request::Io(op) = r {
                    op.comp.complete((Err(forked_error()), op.buf));
                }
            }
            return;
        }
        let refused = match &mut *lock(&self.queue) {
            Some(q) => {
                q.extend(reqs);
                None
            }
            None => Some(reqs),
        };
        if let Some(reqs) = refused {
            // The driver is gone. These operations never reached the kernel: their buffers go back to
            // their callers with the error. (Outside the queue's lock: dropping a request can drop the
            // last handle of a file, whose `Drop` sends again.)
            for r in reqs {
                if let Request::Io(op) = r {
                    op.comp.complete((Err(driver_died()), op.buf));
                }
            }
            return;
        }
        if self.idle.must_ring() {
            self.kick();
        }
    }

    /// The requests queued for the driver (empty once it died).
    fn take_queue(&self) -> Vec<Request> {
        lock(&self.queue).as_mut().map(std::mem::take).unwrap_or_default()
    }

    fn queue_is_empty(&self) -> bool {
        lock(&self.queue).as_ref().is_none_or(Vec::is_empty)
    }

    fn kick(&self) {
        // An eventfd write only fails when the counter would overflow, which a wake-up counter that the
        // driver drains cannot reach; a lost kick would show as a hang, so report it loudly.
        if let Err(e) = rustix::io::write(&self.eventfd, &1u64.to_ne_bytes()) {
            log::error!("io_uring driver: eventfd write failed: {e}");
        }
    }
}

/// The result slot an operation's future waits on.
struct Completion<T> {
    state: Mutex<(Option<T>, Option<Waker>)>,
}

impl<T> Completion<T> {
    fn new() -> Arc<Self> {
        Arc::new(Completion { state: Mutex::new((None, None)) })
    }

    fn complete(&self, v: T) {
        let waker = {
            let mut s = lock(&self.state);
            s.0 = Some(v);
            s.1.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// An operation in flight: resolves to the operation's result and its buffer.
///
/// Dropping it before it resolves is allowed and safe: the driver keeps the buffer until the kernel
/// is done with it, then frees it.
pub struct UringOp {
    comp: Arc<Completion<BufResult>>,
}

impl std::future::Future for UringOp {
    type Output = BufResult;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<BufResult> {
        let mut s = lock(&self.comp.state);
        if let Some(v) = s.0.take() {
            return Poll::Ready(v);
        }
        match &s.1 {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => s.1 = Some(cx.waker().clone()),
        }
        Poll::Pending
    }
}

struct IoOp {
    write: bool,
    file: Arc<FileInner>,
    offset: u64,
    buf: AlignedBuf,
    /// Byte ranges of the buffer still to submit.
    todo: VecDeque<(usize, usize)>,
    /// The range of each piece number (for matching completions). A piece number is reused once its
    /// completion is reaped (`free_pieces`), so numbers stay below the pieces in flight at once, however
    /// many times short transfers are resubmitted.
    pieces: Vec<(usize, usize)>,
    free_pieces: Vec<usize>,
    inflight: usize,
    queued: bool,
    error: Option<io::Error>,
    comp: Arc<Completion<BufResult>>,
}

impl IoOp {
    /// Account the completion `res` of the piece `start..start + len`: the first error is kept (and
    /// nothing more is submitted), a retryable or short transfer puts what is left back to submit.
    /// Returns whether the operation must be queued again.
    fn settle_piece(&mut self, start: usize, len: usize, res: i32) -> bool {
        let mut requeue = false;
        if res < 0 {
            let errno = -res;
            if (errno == libc::EAGAIN || errno == libc::EINTR) && self.error.is_none() {
                self.todo.push_back((start, len));
                requeue = true;
            } else if self.error.is_none() {
                self.error = Some(io::Error::from_raw_os_error(errno));
            }
        } else if res == 0 {
            let (kind, what) = if self.write {
                (io::ErrorKind::WriteZero, "write returned 0 bytes")
            } else {
                (io::ErrorKind::UnexpectedEof, "read met end of file")
            };
            self.error.get_or_insert_with(|| io::Error::new(kind, what));
        } else if (res as usize) < len {
            let done = res as usize;
            if !self.write && self.file.direct && (self.offset + (start + done) as u64) % 512 != 0 {
                // The rest cannot even be asked for (O_DIRECT needs aligned offsets): end of file.
                self.error.get_or_insert_with(|| io::Error::new(io::ErrorKind::UnexpectedEof, "read met end of file"));
            } else {
                self.todo.push_back((start + done, len - done));
                requeue = true;
            }
        }
        if self.error.is_some() {
            self.todo.clear();
            return false;
        }
        requeue
    }
}

/// What an operation gets when the driver thread died (panicked) before finishing it.
fn driver_died() -> io::Error {
    io::Error::other("the io_uring driver thread died (panicked); see the log")
}

fn io_error(kind: io::ErrorKind, msg: String) -> io::Error {
    io::Error::new(kind, msg)
}

/// Whether the kernel forbids io_uring outright (`kernel.io_uring_disabled = 2`).
fn disabled_by_sysctl() -> bool {
    std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled").map(|s| s.trim() == "2").unwrap_or(false)
}

/// The ring, with `entries` submission entries and twice as many completions, and whether it
/// defers completions to the driver's waits (`DEFER_TASKRUN`; the ring is then created disabled,
/// for the driver to enable as its single issuer).
fn setup_ring(entries: u32) -> io::Result<(IoUring, bool)> {
    // Completions run as deferred task work on the driver, processed in batches when it enters the
    // kernel to wait (DEFER_TASKRUN, which needs a single submitting task: the driver enables the
    // ring itself). Kernels before 6.1 refuse the flags: plain setup then.
    let tuned = IoUring::builder()
        .setup_cqsize(entries * 2)
        .setup_r_disabled()
        .setup_single_issuer()
        .setup_defer_taskrun()
        // Flags pending task work in the submission ring, so a submit that does not wait still
        // runs it (posts the completions) when there is some.
        .setup_taskrun_flag()
        .build(entries);
    let (ring, deferred) = match tuned {
        Ok(r) => (Ok(r), true),
        Err(e) => {
            log::debug!("io_uring: DEFER_TASKRUN/SINGLE_ISSUER refused ({e}); plain ring");
            (IoUring::builder().setup_cqsize(entries * 2).build(entries), false)
        }
    };
    let ring = ring.map_err(|e| {
        let why = match e.raw_os_error() {
            Some(libc::ENOSYS) => "the kernel has no io_uring (ENOSYS)".to_string(),
            Some(libc::EPERM) => {
                "io_uring is not permitted here (EPERM: seccomp filter or kernel.io_uring_disabled)".into()
            }
            _ => format!("io_uring_setup failed: {e}"),
        };
        io_error(e.kind(), why)
    })?;
    Ok((ring, deferred))
}

/// Fail unless the kernel has every opcode the driver uses.
fn check_opcodes(ring: &IoUring) -> io::Result<()> {
    let mut probe = Probe::new();
    ring.submitter()
        .register_probe(&mut probe)
        .map_err(|e| io_error(e.kind(), format!("io_uring probe failed: {e}")))?;
    for (code, name) in [
        (opcode::Read::CODE, "READ"),
        (opcode::Write::CODE, "WRITE"),
        (opcode::ReadFixed::CODE, "READ_FIXED"),
        (opcode::WriteFixed::CODE, "WRITE_FIXED"),
        (opcode::AsyncCancel::CODE, "ASYNC_CANCEL"),
    ] {
        if !probe.is_supported(code) {
            return Err(io_error(io::ErrorKind::Unsupported, format!("io_uring lacks opcode {name}")));
        }
    }
    Ok(())
}

/// The registered buffer pool: `wanted` buffers of `size` bytes, halved on failure (RLIMIT_MEMLOCK,
/// or no memory for it), none at all as the last resort.
fn register_pool(ring: &IoUring, wanted: usize, size: usize) -> Option<BufPool> {
    let mut count = wanted;
    while count > 0 {
        let p = match BufPool::try_new(count, size.max(4096), 4096) {
            Ok(p) => p,
            Err(layout) => {
                log::warn!("io_uring: no memory for a pool of {count} buffers ({} bytes); trying fewer", layout.size());
                count /= 2;
                continue;
            }
        };
        let iovecs: Vec<libc::iovec> =
            p.regions().into_iter().map(|(base, len)| libc::iovec { iov_base: base.cast(), iov_len: len }).collect();
        // SAFETY: every iovec describes one slot of `p`'s arena, which stays allocated while the driver
        // holds `p.keep_alive()`; the driver keeps that handle until after the ring (and with it the
        // registration) is dropped.
        match unsafe { ring.submitter().register_buffers(&iovecs) } {
            Ok(()) => {
                if count < wanted {
                    log::warn!("io_uring: registered {count} of {} buffers (RLIMIT_MEMLOCK too low for more)", wanted);
                }
                return Some(p);
            }
            Err(e) if count > 1 => {
                log::debug!("io_uring: registering {count} buffers failed ({e}); trying fewer");
                count /= 2;
            }
            Err(e) => {
                log::warn!("io_uring: buffer registration failed ({e}); using unregistered buffers");
                count = 0;
            }
        }
    }
    None
}

/// A sparse table of `slots` registered files; false (plain descriptors then) if refused.
fn register_file_table(ring: &IoUring, slots: u32) -> bool {
    match ring.submitter().register_files_sparse(slots) {
        Ok(()) => true,
        Err(e) => {
            log::warn!("io_uring: registering a file table failed ({e}); using plain descriptors");
            false
        }
    }
}

/// Start the driver thread on `ring`. The driver enables the ring itself (it is the single issuer)
/// and says whether that worked before any request can reach it.
fn start_driver(ring: IoUring, driver: Driver, deferred: bool) -> io::Result<std::thread::JoinHandle<()>> {
    let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel::<io::Result<()>>(1);
    let handle = std::thread::Builder::new().name("spillway-uring".into()).spawn(move || {
        if deferred {
            if let Err(e) = ring.submitter().register_enable_rings() {
                let _ = ready_tx.send(Err(e));
                return;
            }
        }
        let _ = ready_tx.send(Ok(()));
        driver.run(ring)
    })?;
    match ready_rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            let _ = handle.join();
            return Err(io_error(e.kind(), format!("io_uring: enabling the ring failed: {e}")));
        }
        Err(_) => {
            let _ = handle.join();
            return Err(io_error(io::ErrorKind::Other, "io_uring driver thread died at start-up".into()));
        }
    }
    Ok(handle)
}

impl UringBackend {
    /// Start a driver with `opts`. Fails, with a message saying why, when io_uring cannot be used here.
    pub fn new(opts: UringOptions) -> io::Result<UringBackend> {
        if disabled_by_sysctl() {
            return Err(io_error(
                io::ErrorKind::Unsupported,
                "io_uring is disabled (kernel.io_uring_disabled = 2)".into(),
            ));
        }
        let entries = opts.entries.clamp(8, 4096);
        let (ring, deferred) = setup_ring(entries)?;
        check_opcodes(&ring)?;
        let pool = register_pool(&ring, opts.pool_buffers, opts.pool_buffer_size);
        let fixed_files = opts.file_slots > 0 && register_file_table(&ring, opts.file_slots);
        let free_slots = if fixed_files { (0..opts.file_slots).rev().collect() } else { Vec::new() };

        let eventfd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)?;
        let shared = Arc::new(Shared {
            forks: forks(),
            queue: Mutex::new(Some(Vec::new())),
            idle: Doorbell::new(),
            shutdown: AtomicBool::new(false),
            eventfd,
            free_slots: Mutex::new(free_slots),
        });
        let info = UringInfo {
            registered_buffers: pool.as_ref().map_or(0, |p| p.count()),
            buffer_size: pool.as_ref().map_or(0, |p| p.buf_size()),
            fixed_files,
            deferred_taskrun: deferred,
        };
        let driver = Driver {
            shared: shared.clone(),
            ops: Slab::new(),
            ready: VecDeque::new(),
            inflight: 0,
            max_inflight: entries as usize,
            wake_buf: Box::new([0u8; 8]),
            wake_armed: false,
            cancel_inflight: false,
            cancel_sent: false,
            pool: pool.clone(),
            _pool_alive: pool.as_ref().map(|p| p.keep_alive()),
            enter_failures: EnterBackoff::default(),
        };
        let handle = start_driver(ring, driver, deferred)?;
        Ok(UringBackend {
            shared,
            driver: Some(handle),
            pool,
            info,
            direct: opts.direct,
            direct_refused: Arc::new(AtomicBool::new(false)),
            inline_blocking: opts.inline_blocking,
            portable: PortableBackend::new(),
            opts,
        })
    }

    /// What start-up ended with (registered buffers, file table).
    pub fn info(&self) -> &UringInfo {
        &self.info
    }

    /// The registered buffer pool, if registration succeeded. Buffers checked out of it make reads
    /// and writes use `ReadFixed`/`WriteFixed`.
    #[doc(hidden)]
    pub fn pool(&self) -> Option<&BufPool> {
        self.pool.as_ref()
    }

    /// Whether files are opened with O_DIRECT (false also after the file system refused it).
    pub fn direct(&self) -> bool {
        self.direct && !self.direct_refused.load(Ordering::Relaxed)
    }

    /// Start reading `buf.len()` bytes at `offset` of `file`.
    #[doc(hidden)]
    pub fn read(&self, file: &UringFile, offset: u64, buf: AlignedBuf) -> UringOp {
        self.submit(false, file, offset, buf)
    }

    /// Start writing all of `buf` at `offset` of `file`.
    #[doc(hidden)]
    pub fn write(&self, file: &UringFile, offset: u64, buf: AlignedBuf) -> UringOp {
        self.submit(true, file, offset, buf)
    }

    fn make_op(write: bool, file: &UringFile, offset: u64, buf: AlignedBuf) -> (Option<IoOp>, UringOp) {
        let comp = Completion::new();
        let fut = UringOp { comp: comp.clone() };
        if buf.is_empty() {
            comp.complete((Ok(()), buf));
            return (None, fut);
        }
        let len = buf.len();
        let todo = (0..len).step_by(PIECE).map(|s| (s, PIECE.min(len - s))).collect();
        let op = IoOp {
            write,
            file: file.0.clone(),
            offset,
            buf,
            todo,
            pieces: Vec::new(),
            free_pieces: Vec::new(),
            inflight: 0,
            queued: false,
            error: None,
            comp,
        };
        (Some(op), fut)
    }

    fn submit(&self, write: bool, file: &UringFile, offset: u64, buf: AlignedBuf) -> UringOp {
        let (op, fut) = Self::make_op(write, file, offset, buf);
        if let Some(op) = op {
            self.shared.send(vec![Request::Io(op)]);
        }
        fut
    }
}

impl Drop for UringBackend {
    fn drop(&mut self) {
        if self.shared.forked() {
            // The driver thread is the parent's: nothing to stop or join here, and the eventfd
            // would wake the parent's. What the driver owns (the ring) is left as it is.
            if let Some(h) = self.driver.take() {
                std::mem::forget(h);
            }
            return;
        }
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.kick();
        if let Some(h) = self.driver.take() {
            if h.join().is_err() {
                log::error!("io_uring driver thread panicked");
            }
        }
    }
}

impl std::fmt::Debug for UringBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringBackend").field("info", &self.info).field("direct", &self.direct()).finish()
    }
}

impl super::sealed::Sealed for UringBackend {}

impl Backend for UringBackend {
    type File = UringFile;

    fn name(&self) -> &'static str {
        "uring"
    }
    /// A driver of its own, started with the same options.
    fn fresh(&self) -> io::Result<Self> {
        UringBackend::new(self.opts.clone())
    }
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        self.portable.create_dir_all(path)
    }
    fn is_dir(&self, path: &Path) -> bool {
        self.portable.is_dir(path)
    }
    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        self.portable.list_dir(path)
    }

    fn open(&self, path: &Path, create: bool) -> io::Result<UringFile> {
        let file = self.portable.open(path, create)?;
        let mut direct = self.direct && !self.direct_refused.load(Ordering::Relaxed);
        if direct && !super::enable_direct(&file, path) {
            self.direct_refused.store(true, Ordering::Relaxed);
            direct = false;
        }
        let slot = lock(&self.shared.free_slots).pop();
        let inner =
            Arc::new(FileInner { file, direct, slot, registered: AtomicBool::new(false), shared: self.shared.clone() });
        if slot.is_some() {
            self.shared.send(vec![Request::Register { file: inner.clone() }]);
        }
        Ok(UringFile(inner))
    }

    fn remove_file(&self, path: &Path) -> io::Result<()> {
        self.portable.remove_file(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.portable.rename(from, to)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        self.portable.sync_dir(path)
    }
    fn file_len(&self, file: &UringFile) -> io::Result<u64> {
        self.portable.file_len(&file.0.file)
    }
    fn allocate(&self, file: &UringFile, len: u64) -> io::Result<bool> {
        super::portable::allocate_file(&file.0.file, len)
    }

    fn as_fd<'a>(&self, file: &'a UringFile) -> Option<std::os::fd::BorrowedFd<'a>> {
        Some(std::os::fd::AsFd::as_fd(file.file()))
    }

    fn read_at(&self, file: &UringFile, offset: u64, buf: AlignedBuf) -> BufResult {
        if self.inline_blocking {
            return self.portable.read_at(&file.0.file, offset, buf);
        }
        block_on(self.read(file, offset, buf))
    }

    fn write_at(&self, file: &UringFile, offset: u64, buf: AlignedBuf) -> BufResult {
        if self.inline_blocking {
            return self.portable.write_at(&file.0.file, offset, buf);
        }
        block_on(self.write(file, offset, buf))
    }

    fn sync_data(&self, file: &UringFile) -> io::Result<()> {
        file.0.file.sync_data()
    }
    fn lock_dir(&self, dir: &Path) -> io::Result<DirLock> {
        self.portable.lock_dir(dir)
    }
    fn alignment(&self, dir: &Path) -> usize {
        super::portable::alignment(dir, self.direct())
    }
    fn read_alignment(&self, dir: &Path) -> usize {
        super::portable::read_alignment(dir, self.direct())
    }

    fn alloc_buf(&self, len: usize, align: usize) -> AlignedBuf {
        // Registered slots only for what fits, and never waiting: log buffers live long, so blocking on
        // an empty pool here could wait forever. Streaming users check out with back-pressure instead.
        if let Some(pool) = &self.pool {
            if len <= pool.buf_size() && align <= 4096 {
                if let Some(mut b) = pool.try_check_out() {
                    b.set_len(len);
                    return b;
                }
            }
        }
        AlignedBuf::zeroed(len, align)
    }

    fn read_at_async(&self, file: &Arc<UringFile>, offset: u64, buf: AlignedBuf) -> IoFuture {
        Box::pin(self.read(file, offset, buf))
    }

    fn pipelines_reads(&self) -> bool {
        self.direct()
    }

    fn queues_writes(&self) -> bool {
        // Buffered writes with inline blocking calls are page-cache copies: queueing them only hands
        // them to io-wq workers (buffered writes cannot complete without blocking), which on this
        // 2-vCPU VM made a store's 64 KiB spill 36% slower than one inline pwrite per batch. With
        // O_DIRECT, writes in flight overlap at the device.
        self.direct() || !self.inline_blocking
    }

    fn punch_hole(&self, file: &UringFile, offset: u64, len: u64) -> io::Result<()> {
        super::portable::punch_hole(&file.0.file, offset, len)
    }

    fn detached_punch(&self) -> Option<super::DetachedPunch<UringFile>> {
        Some(|file, offset, len| super::portable::punch_hole(&file.0.file, offset, len))
    }

    fn read_new(&self, file: &UringFile, offset: u64, len: usize, align: usize) -> io::Result<AlignedBuf> {
        if self.inline_blocking {
            // A lone blocking read runs inline as pread (see `inline_blocking`): into fresh memory.
            let align = super::portable::buffered_align(self.direct(), align);
            return AlignedBuf::read_exact_at(&file.0.file, offset, len, align);
        }
        super::read_by_alloc(self, file, offset, len, align)
    }

    fn read_new_crc(
        &self,
        file: &UringFile,
        offset: u64,
        len: usize,
        align: usize,
        check: std::ops::Range<usize>,
    ) -> io::Result<(AlignedBuf, u32)> {
        if self.inline_blocking {
            // As `read_new`: a lone blocking read runs inline, as pread.
            let align = super::portable::buffered_align(self.direct(), align);
            return super::read_new_checked(&file.0.file, offset, len, align, check);
        }
        self.read_new(file, offset, len, align).map(|buf| super::with_crc(buf, check))
    }

    /// Buffered files with inline blocking calls: a chunk holding large values is one inline
    /// `pwritev` from the values' buffers. Copying into the page cache is the whole cost of a buffered
    /// write, so overlapping it with encoding on the ring buys nothing, and the staging copy it saves is
    /// as large as the write.
    fn gathers_writes(&self) -> bool {
        self.inline_blocking && !self.direct()
    }

    fn write_gather_at(&self, file: &UringFile, offset: u64, parts: &[&[u8]]) -> io::Result<()> {
        if self.inline_blocking {
            return super::portable::write_gather(&file.0.file, offset, parts);
        }
        super::gather_by_copy(self, file, offset, parts)
    }

    fn write_at_async(&self, file: &Arc<UringFile>, offset: u64, buf: AlignedBuf) -> IoFuture {
        Box::pin(self.write(file, offset, buf))
    }

    fn read_pipelined(
        &self,
        depth: usize,
        next: &mut dyn FnMut() -> Option<PipelinedRead<UringFile>>,
        done: &mut dyn FnMut(u64, BufResult),
    ) -> io::Result<()> {
        match super::pipeline::ring(depth) {
            Ok(ring) => {
                super::pipeline::run(ring, depth, |f: &UringFile| (f.0.file.as_raw_fd(), f.0.direct), next, done)
            }
            Err(e) => {
                super::pipeline::warn_no_ring(&e);
                while let Some(r) = next() {
                    done(r.tag, self.read_at(&r.file, r.offset, r.buf));
                }
                Ok(())
            }
        }
    }

    fn read_many(&self, reqs: Vec<ReadReq<'_, UringFile>>) -> Vec<BufResult> {
        let mut futs = Vec::with_capacity(reqs.len());
        let mut batch = Vec::with_capacity(reqs.len());
        for r in reqs {
            let (op, fut) = Self::make_op(false, r.file, r.offset, r.buf);
            batch.extend(op.map(Request::Io));
            futs.push(fut);
        }
        self.shared.send(batch);
        futs.into_iter().map(block_on).collect()
    }
}

/// The driver thread's state. Only the driver thread touches it.
struct Driver {
    shared: Arc<Shared>,
    ops: Slab<IoOp>,
    /// Operations with ranges left to submit, in arrival order.
    ready: VecDeque<usize>,
    /// Pieces submitted and not yet reaped.
    inflight: usize,
    max_inflight: usize,
    /// Target of the armed eventfd read; boxed so its address is stable while the read is in flight.
    wake_buf: Box<[u8; 8]>,
    wake_armed: bool,
    cancel_inflight: bool,
    cancel_sent: bool,
    pool: Option<BufPool>,
    /// Keeps the registered arena allocated until the driver (and the ring before it) is gone.
    _pool_alive: Option<Arc<PoolShared>>,
    /// Failed `io_uring_enter` calls in a row, and how the driver waits and logs because of them.
    enter_failures: EnterBackoff,
}

/// What the driver does while `io_uring_enter` keeps failing with an error it cannot act on (not
/// EINTR, EAGAIN or EBUSY). It cannot give up: the kernel may still use the buffers of operations
/// in flight, so they cannot be handed back. It retries, sleeping twice as long after each failure
/// in a row (from 1 ms up to `MAX_SLEEP`), and logs the first failure and then one in
/// `LOG_EVERY`, so that a persistent error costs neither a core nor the log.
#[derive(Debug, Default)]
struct EnterBackoff {
    in_a_row: u32,
}

impl EnterBackoff {
    const MAX_SLEEP: Duration = Duration::from_millis(100);
    const LOG_EVERY: u32 = 100;

    /// A failed enter: how long to sleep before the next, and whether to log this one.
    fn failed(&mut self) -> (Duration, bool) {
        self.in_a_row = self.in_a_row.saturating_add(1);
        let shift = (self.in_a_row - 1).min(7);
        let sleep = (Duration::from_millis(1) * (1u32 << shift)).min(Self::MAX_SLEEP);
        (sleep, self.in_a_row == 1 || self.in_a_row % Self::LOG_EVERY == 0)
    }

    /// A successful enter (after failures: worth a line saying so).
    fn succeeded(&mut self) -> Option<u32> {
        let n = std::mem::take(&mut self.in_a_row);
        (n > 0).then_some(n)
    }
}

macro_rules! rw_entry {
    ($fd:expr, $write:expr, $ptr:expr, $len:expr, $index:expr, $off:expr) => {
        match ($write, $index) {
            (false, Some(i)) => opcode::ReadFixed::new($fd, $ptr, $len, i).offset($off).build(),
            (false, None) => opcode::Read::new($fd, $ptr, $len).offset($off).build(),
            (true, Some(i)) => opcode::WriteFixed::new($fd, $ptr as *const u8, $len, i).offset($off).build(),
            (true, None) => opcode::Write::new($fd, $ptr as *const u8, $len).offset($off).build(),
        }
    };
}

impl Drop for Driver {
    fn drop(&mut self) {
        if std::thread::panicking() {
            // The ring is leaked (see `run`), so the kernel may still complete the armed wake-up read
            // into `wake_buf`: leak it too.
            std::mem::forget(std::mem::replace(&mut self.wake_buf, Box::new([0; 8])));
            // From now on requests fail at once; those still queued never reached the kernel, so
            // their buffers go back to their callers.
            let queued = lock(&self.shared.queue).take().unwrap_or_default();
            for r in queued {
                if let Request::Io(op) = r {
                    op.comp.complete((Err(driver_died()), op.buf));
                }
            }
            if !self.ops.is_empty() {
                log::error!(
                    "io_uring driver panicked with {} operations in flight; leaking their buffers",
                    self.ops.len()
                );
                // The kernel may still write into these buffers: each is leaked, and its caller is
                // woken with the error and an empty buffer instead of waiting for good.
                for (_, op) in std::mem::take(&mut self.ops) {
                    // Dropping the op's file handle may close its descriptor: harmless, since each
                    // submitted entry holds its own reference to the file in the kernel, and the
                    // leaked ring is never entered again.
                    let IoOp { buf, comp, .. } = op;
                    std::mem::forget(buf);
                    comp.complete((Err(driver_died()), AlignedBuf::zeroed(0, 1)));
                }
            }
        }
    }
}

impl Driver {
    fn run(mut self, ring: IoUring) {
        // If the loop below panicked, unwinding would drop the ring (whose exit does not wait for
        // the kernel to finish with our memory) and then the buffers of operations in flight. Both
        // are leaked instead (`ManuallyDrop` here, `Drop for Driver`): a bug costs memory, never
        // memory safety.
        let mut kept = std::mem::ManuallyDrop::new(ring);
        let ring: &mut IoUring = &mut kept;
        self.arm_wake(ring);
        let mut cqes: Vec<(u64, i32)> = Vec::with_capacity(self.max_inflight * 2);
        loop {
            // A wake-up read that completed while the submission queue was full is re-armed here
            // (`fill` always leaves room for it and for the shutdown cancel).
            if !self.wake_armed && !self.shared.shutdown.load(Ordering::SeqCst) {
                self.arm_wake(ring);
            }
            self.take_requests(ring);
            self.fill(ring);
            // After `fill`, so the cancel also covers what this pass submitted (the requests taken
            // in the pass that first sees the shutdown). `fill` leaves its slot free.
            if self.shared.shutdown.load(Ordering::SeqCst) && !self.cancel_sent {
                self.cancel_sent = true;
                let e = opcode::AsyncCancel2::new(types::CancelBuilder::any()).build().user_data(CANCEL);
                // SAFETY: a cancel entry refers to no memory.
                if unsafe { ring.submission().push(&e) }.is_ok() {
                    self.cancel_inflight = true;
                }
            }
            cqes.clear();
            cqes.extend(ring.completion().map(|c| (c.user_data(), c.result())));
            for &(ud, res) in &cqes {
                self.complete(ring, ud, res);
            }
            if self.shared.shutdown.load(Ordering::SeqCst)
                && self.ops.is_empty()
                && !self.wake_armed
                && !self.cancel_inflight
                && self.shared.queue_is_empty()
            {
                break;
            }
            if !cqes.is_empty() {
                if !ring.submission().is_empty() {
                    self.enter(ring, 0);
                }
                continue;
            }
            if !self.shared.idle.may_sleep(|| !self.shared.queue_is_empty()) {
                // More requests arrived. What `fill` queued is submitted now, not when requests stop
                // coming; and with DEFER_TASKRUN completions are posted only inside io_uring_enter,
                // so a steady stream of requests must not keep the driver out of it. With every
                // piece slot taken, wait for a completion instead of spinning.
                if self.inflight >= self.max_inflight {
                    self.enter(ring, 1);
                } else if self.inflight > 0 || !ring.submission().is_empty() {
                    self.enter(ring, 0);
                }
                continue;
            }
            self.enter(ring, 1);
            self.shared.idle.awake();
        }
        // Nothing is in flight: the ring (and its registrations) can go, then the pool.
        // SAFETY: `kept` is dropped exactly once, here, and not used afterwards.
        unsafe { std::mem::ManuallyDrop::drop(&mut kept) };
        drop(self);
    }

    fn enter(&mut self, ring: &IoUring, want: usize) {
        match ring.submit_and_wait(want) {
            Ok(_) => {
                if let Some(n) = self.enter_failures.succeeded() {
                    log::warn!("io_uring_enter works again after {n} failure(s) in a row");
                }
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => {}
            Err(e) => {
                // Nothing sensible to do but report and retry (see `EnterBackoff`): the buffers of
                // operations in flight must not be released while the kernel may still use them.
                let (sleep, log_it) = self.enter_failures.failed();
                if log_it {
                    log::error!(
                        "io_uring_enter failed ({} in a row): {e}; retrying every {} ms at most",
                        self.enter_failures.in_a_row,
                        EnterBackoff::MAX_SLEEP.as_millis()
                    );
                }
                std::thread::sleep(sleep);
            }
        }
    }

    fn arm_wake(&mut self, ring: &mut IoUring) {
        let e = opcode::Read::new(types::Fd(self.shared.eventfd.as_raw_fd()), self.wake_buf.as_mut_ptr(), 8)
            .build()
            .user_data(WAKE);
        // SAFETY: `wake_buf` is a boxed field of the driver, which outlives the ring (the ring is dropped
        // first in `run`), and nothing else reads or writes it while the read is armed.
        if unsafe { ring.submission().push(&e) }.is_ok() {
            self.wake_armed = true;
        }
    }

    fn take_requests(&mut self, ring: &IoUring) {
        // Operations first, into the slab: should anything below panic, `Drop for Driver` finds them
        // there and wakes their callers.
        let mut rest = Vec::new();
        for r in self.shared.take_queue() {
            match r {
                Request::Io(op) => {
                    let key = self.ops.insert(op);
                    self.queue_op(key);
                }
                other => rest.push(other),
            }
        }
        for r in rest {
            match r {
                #[cfg(test)]
                Request::Panic => panic!("deliberate io_uring driver panic (test)"),
                Request::Io(_) => unreachable!("taken above"),
                Request::Register { file } => {
                    let slot = file.slot.expect("registered files have a slot");
                    match ring.submitter().register_files_update(slot, &[file.file.as_raw_fd()]) {
                        Ok(_) => file.registered.store(true, Ordering::Relaxed),
                        Err(e) => log::debug!("io_uring: file slot {slot} not registered ({e}); using its fd"),
                    }
                }
                Request::Unregister { slot } => {
                    if let Err(e) = ring.submitter().register_files_update(slot, &[-1]) {
                        log::debug!("io_uring: clearing file slot {slot} failed ({e})");
                    }
                    lock(&self.shared.free_slots).push(slot);
                }
            }
        }
    }

    fn queue_op(&mut self, key: usize) {
        let op = &mut self.ops[key];
        if !op.queued {
            op.queued = true;
            self.ready.push_back(key);
        }
    }

    /// Move ready ranges into the submission queue while it and the in-flight budget have room.
    fn fill(&mut self, ring: &mut IoUring) {
        let mut sq = ring.submission();
        while let Some(&key) = self.ready.front() {
            let Some(op) = self.ops.get_mut(key) else {
                // Failed and completed while still listed; its key may even be reused (then listed twice).
                self.ready.pop_front();
                continue;
            };
            while let Some(&(start, len)) = op.todo.front() {
                // Two entries stay free for the wake-up read and the shutdown cancel.
                if sq.len() + 2 >= sq.capacity() || self.inflight >= self.max_inflight {
                    return;
                }
                let piece = op.free_pieces.last().copied().unwrap_or(op.pieces.len()) as u64;
                // Piece numbers stay below the pieces in flight (at most the ring's 4096 entries), and
                // slab keys below the live operations: both fit their bits with room to spare. A
                // collision would hand a completion to the wrong operation, so this is a hard check.
                assert!(piece < (1 << PIECE_BITS) && (key as u64) < (1 << (64 - PIECE_BITS)) - 2);
                let ud = (key as u64) << PIECE_BITS | piece;
                let index = self.pool.as_ref().and_then(|p| op.buf.pool_index(p)).map(|i| i as u16);
                // SAFETY: `start + len <= buf.len() <= capacity`, so the pointer stays inside the buffer.
                let ptr = unsafe { op.buf.as_mut_ptr().add(start) };
                let off = op.offset + start as u64;
                let n = len as u32;
                // A fixed slot indexes this driver's own file table: a file opened by another
                // backend (its slot numbers are of another table) goes by its descriptor.
                let own_slot = Arc::ptr_eq(&op.file.shared, &self.shared) && op.file.registered.load(Ordering::Relaxed);
                let e = if own_slot {
                    let fd = types::Fixed(op.file.slot.expect("registered files have a slot"));
                    rw_entry!(fd, op.write, ptr, n, index, off)
                } else {
                    let fd = types::Fd(op.file.file.as_raw_fd());
                    rw_entry!(fd, op.write, ptr, n, index, off)
                };
                let e: squeue::Entry = e.user_data(ud);
                // SAFETY: the entry points into `op.buf`, which the op (in `self.ops`) owns until this
                // piece's completion is reaped: ops leave the slab only in `complete` once `inflight` is 0,
                // and the driver outlives every submitted entry (shutdown drains before dropping). The
                // file (fd, or a slot of this driver's table, which holds it until the file's Drop
                // unregisters it) is kept open by the op's Arc<FileInner>. Fixed buffer `index`
                // is set only when the buffer is a slot of the registered pool.
                unsafe { sq.push(&e) }.expect("checked not full");
                op.todo.pop_front();
                match op.free_pieces.pop() {
                    Some(p) => op.pieces[p] = (start, len),
                    None => op.pieces.push((start, len)),
                }
                op.inflight += 1;
                self.inflight += 1;
            }
            op.queued = false;
            self.ready.pop_front();
        }
    }

    fn complete(&mut self, ring: &mut IoUring, ud: u64, res: i32) {
        match ud {
            WAKE => {
                self.wake_armed = false;
                if !self.shared.shutdown.load(Ordering::SeqCst) {
                    self.arm_wake(ring);
                }
                return;
            }
            CANCEL => {
                self.cancel_inflight = false;
                if res == -libc::EINVAL {
                    // Kernels before 5.19 have no IORING_ASYNC_CANCEL_ANY: the operations in flight
                    // (file I/O) finish on their own, and the shutdown waits for them.
                    log::debug!("io_uring: cancel-any unsupported; draining operations in flight");
                }
                return;
            }
            _ => {}
        }
        let key = (ud >> PIECE_BITS) as usize;
        let piece = (ud & ((1 << PIECE_BITS) - 1)) as usize;
        self.inflight -= 1;
        let Some(op) = self.ops.get_mut(key) else {
            log::error!("io_uring: completion for unknown operation {key}");
            return;
        };
        op.inflight -= 1;
        let (start, len) = op.pieces[piece];
        op.free_pieces.push(piece);
        if op.settle_piece(start, len, res) {
            self.queue_op(key);
            return;
        }
        let op = &self.ops[key];
        if op.inflight == 0 && op.todo.is_empty() {
            let op = self.ops.remove(key);
            let result = match op.error {
                Some(e) => Err(e),
                None => Ok(()),
            };
            op.comp.complete((result, op.buf));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A persistent `io_uring_enter` error: the driver's sleeps double up to 100 ms (about ten
    /// calls a second, not a spinning core) and it logs the first failure and one in 100, not each.
    #[test]
    fn a_persistent_enter_error_backs_off_and_is_logged_rarely() {
        let mut b = EnterBackoff::default();
        let rounds: Vec<(Duration, bool)> = (0..1000).map(|_| b.failed()).collect();
        let ms: Vec<u128> = rounds.iter().take(9).map(|r| r.0.as_millis()).collect();
        assert_eq!(ms, [1, 2, 4, 8, 16, 32, 64, 100, 100]);
        assert!(rounds.iter().all(|r| r.0 <= EnterBackoff::MAX_SLEEP));
        let logged: Vec<usize> = rounds.iter().enumerate().filter(|r| r.1 .1).map(|r| r.0 + 1).collect();
        assert_eq!(logged, [1, 100, 200, 300, 400, 500, 600, 700, 800, 900, 1000]);
        let spent: Duration = rounds.iter().map(|r| r.0).sum();
        assert!(spent >= Duration::from_secs(99), "1000 failures in a row take {spent:?} of sleep");
        assert_eq!(b.succeeded(), Some(1000));
        assert_eq!(b.succeeded(), None);
        assert_eq!(b.failed(), (Duration::from_millis(1), true), "a new run of failures starts over");
    }

    /// A backend whose blocking calls go through the ring, or `None` after printing why `test` is
    /// skipped (a panic instead under `SPILLWAY_REQUIRE_URING=1`).
    fn backend_or_skip(test: &str) -> Option<UringBackend> {
        match UringBackend::new(UringOptions { inline_blocking: false, ..Default::default() }) {
            Ok(b) => Some(b),
            Err(e) if std::env::var("SPILLWAY_REQUIRE_URING").is_ok_and(|v| v == "1") => {
                panic!("io_uring required (SPILLWAY_REQUIRE_URING=1) but unavailable: {e}")
            }
            Err(e) => {
                println!("SKIPPED {test}: io_uring unavailable: {e}");
                None
            }
        }
    }

    /// Whether the running kernel is at least `major.minor`.
    fn kernel_at_least(major: u32, minor: u32) -> bool {
        let release = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
        let mut parts = release.trim().split(|c: char| !c.is_ascii_digit()).map(|p| p.parse::<u32>().unwrap_or(0));
        (parts.next().unwrap_or(0), parts.next().unwrap_or(0)) >= (major, minor)
    }

    /// The read end of an empty pipe as a file of `be`, and the write end (a read stays in flight
    /// until data arrives, which it never does while the write end is open).
    fn empty_pipe(be: &UringBackend) -> (UringFile, OwnedFd) {
        let (rx, tx) = rustix::pipe::pipe().unwrap();
        let f = UringFile(Arc::new(FileInner {
            file: File::from(rx),
            direct: false,
            slot: None,
            registered: AtomicBool::new(false),
            shared: be.shared.clone(),
        }));
        (f, tx)
    }

    /// When the driver thread dies (a bug), its callers are not left waiting: an operation queued or
    /// in flight fails with an error (an in-flight one's buffer is leaked, since the kernel may still
    /// write into it, and an empty one comes back), and later operations fail at once.
    #[test]
    fn callers_get_an_error_when_the_driver_dies() {
        let Some(be) = backend_or_skip("callers_get_an_error_when_the_driver_dies") else { return };
        let (f, tx) = empty_pipe(&be);
        let pending = be.read(&f, 0, AlignedBuf::zeroed(8, 8));
        // Another read in the same batch as the panic: taken by the driver, never submitted.
        let (op, taken) = UringBackend::make_op(false, &f, 0, AlignedBuf::zeroed(8, 8));
        be.shared.send(vec![Request::Io(op.expect("not empty")), Request::Panic]);
        let (r, _) = block_on(taken);
        assert!(r.is_err_and(|e| e.to_string().contains("driver thread died")));
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let (r, b) = block_on(pending);
            done_tx.send((r.map_err(|e| e.to_string()), b.len())).unwrap();
        });
        let (r, len) = done_rx.recv_timeout(std::time::Duration::from_secs(60)).expect("the caller is woken");
        assert!(r.as_ref().is_err_and(|e| e.contains("driver thread died")), "{r:?}");
        assert_eq!(len, 0, "the in-flight buffer is leaked, not handed back");
        // Afterwards an operation fails at once and gets its (never submitted) buffer back.
        let (r, b) = block_on(be.read(&f, 0, AlignedBuf::zeroed(8, 8)));
        assert!(r.is_err_and(|e| e.to_string().contains("driver thread died")));
        assert_eq!(b.len(), 8);
        drop(f);
        drop(be); // joins the dead driver (and logs that it panicked)
        drop(tx);
    }

    /// Dropping the backend cancels reads that would otherwise never complete, also one sent just
    /// before the drop and taken by the driver in the same pass that sees the shutdown (its cancel is
    /// pushed after that pass submits the read: pushed before, it would miss the read, and the drop
    /// would wait for it forever).
    #[test]
    fn dropping_the_backend_cancels_reads_sent_just_before() {
        if !kernel_at_least(5, 19) {
            // No cancel-any: a read that never completes keeps the drop waiting (file I/O does not).
            println!("SKIPPED dropping_the_backend_cancels_reads_sent_just_before: kernel before 5.19");
            return;
        }
        for round in 0..20 {
            let Some(be) = backend_or_skip("dropping_the_backend_cancels_reads_sent_just_before") else { return };
            let (f, tx) = empty_pipe(&be);
            let pending = be.read(&f, 0, AlignedBuf::zeroed(8, 8));
            let (done_tx, done_rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                drop(be);
                done_tx.send(()).unwrap();
            });
            done_rx
                .recv_timeout(std::time::Duration::from_secs(60))
                .unwrap_or_else(|_| panic!("round {round}: the drop waits for a read that never completes"));
            let (r, _) = block_on(pending);
            assert!(r.is_err(), "round {round}: the read was cancelled");
            drop(f);
            drop(tx);
        }
    }

    /// A read dropped while in flight keeps its registered pool slot until the kernel is done with
    /// it: the slot is not free while the read waits (an empty pipe), and comes back once the read
    /// completes (the pipe's write end closes: end of file).
    #[test]
    fn a_dropped_read_keeps_its_pool_slot_until_the_kernel_is_done() {
        let Some(be) = backend_or_skip("a_dropped_read_keeps_its_pool_slot_until_the_kernel_is_done") else { return };
        let Some(pool) = be.pool().cloned() else {
            println!("SKIPPED a_dropped_read_keeps_its_pool_slot_until_the_kernel_is_done: no registered pool");
            return;
        };
        let (f, tx) = empty_pipe(&be);
        let buf = be.alloc_buf(4096, 4096);
        assert!(buf.pool_index(&pool).is_some(), "a pool slot");
        assert_eq!(pool.available(), pool.count() - 1);
        drop(be.read(&f, 0, buf));
        // The driver holds the slot for the read in flight (the kernel may still write into it).
        for _ in 0..100 {
            std::thread::yield_now();
            assert_eq!(pool.available(), pool.count() - 1, "a slot came back while its read was in flight");
        }
        drop(tx); // the read completes (end of file), and the slot comes back
        let mut spins = 0u64;
        while pool.available() != pool.count() {
            spins += 1;
            assert!(spins < 50_000_000, "the slot never came back");
            std::thread::yield_now();
        }
        drop(f);
    }

    /// Operations sent from other threads while the driver dies, at whatever moment each lands
    /// (before the panic, in the batch it panics on, between the panic and the queue's closing,
    /// after it): each one completes, with its data or with the driver's death, and none waits for
    /// good. Once a thread has seen the death, every later operation fails at once.
    #[test]
    fn operations_racing_the_driver_death_all_complete() {
        let Some(be) = backend_or_skip("operations_racing_the_driver_death_all_complete") else { return };
        let be = Arc::new(be);
        let tmp = tempfile::tempdir().unwrap();
        let path = tmp.path().join("f");
        std::fs::write(&path, [7u8; 4096]).unwrap();
        let f = be.open(&path, false).unwrap();
        const THREADS: usize = 4;
        let start = Arc::new(std::sync::Barrier::new(THREADS + 1));
        let (done_tx, done_rx) = std::sync::mpsc::channel();
        for _ in 0..THREADS {
            let (be, f, start, done_tx) = (be.clone(), f.clone(), start.clone(), done_tx.clone());
            std::thread::spawn(move || {
                start.wait();
                let mut ok = 0u64;
                // Bounded: the driver dies within the first few of these.
                for _ in 0..1_000_000 {
                    let (r, b) = block_on(be.read(&f, 0, AlignedBuf::zeroed(4096, 4096)));
                    match r {
                        Ok(()) => {
                            assert!(b.iter().all(|&x| x == 7), "a completed read has the file's data");
                            ok += 1;
                        }
                        Err(e) => {
                            assert!(e.to_string().contains("driver thread died"), "{e}");
                            // From now on, at once, with the buffer back (never submitted).
                            let (r, b) = block_on(be.read(&f, 0, AlignedBuf::zeroed(4096, 4096)));
                            assert!(r.is_err_and(|e| e.to_string().contains("driver thread died")));
                            assert_eq!(b.len(), 4096);
                            done_tx.send(Some(ok)).unwrap();
                            return;
                        }
                    }
                }
                done_tx.send(None).unwrap();
            });
        }
        start.wait();
        be.shared.send(vec![Request::Panic]);
        for _ in 0..THREADS {
            let got = done_rx.recv_timeout(std::time::Duration::from_secs(60)).expect("every caller completes");
            assert!(got.is_some(), "a thread never saw the driver's death");
        }
        drop(f);
        drop(be);
    }
}
