//! `spillway._core`: the segment log (`Log`, here) and the three-tier store (`Store`, `store.rs`)
//! for Python; `spillway.SpillBuffer` (python/spillway/buffer.py) is dask's mapping over `Store`.
//!
//! * `put` takes the frames of a pickle protocol 5 dump (header plus out-of-band buffers) without
//!   joining or copying them: each frame is borrowed through the buffer protocol for the duration of
//!   the call, and the log copies it once, into its aligned write buffer.
//! * `get` returns one `memoryview` per frame over the engine's read buffer, without copying.
//! * The GIL is released while the engine reads, writes or waits.
//!
//! The `unsafe` here is the buffer protocol in both directions; each site names its invariant.
#![allow(unsafe_code)]

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ffi::{c_int, c_void};
use std::sync::{mpsc, Arc, Condvar, Mutex, PoisonError, RwLock};

use bytes::Bytes;
use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyBufferError, PyException, PyKeyError, PyOSError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyMemoryView};
use spillway::backend::UringOptions;
use spillway::{AutoBackend, Backend, BackendKind, Compression, Error, Frames, LogOptions, SegmentLog};

mod logging;
mod store;
mod transfer;

create_exception!(
    _core,
    SpillwayError,
    PyException,
    "An engine error that is not an OSError (corruption, checksum mismatch, ...)."
);
create_exception!(
    _core,
    DiskFull,
    SpillwayError,
    "Writing would exceed the log's max_disk_bytes; nothing was written."
);
create_exception!(
    _core,
    Corrupt,
    SpillwayError,
    "Bytes on disk failed their checksum or are not a valid record (or were written by an unknown \
     version of the format). The message names the segment and offset; other keys are unaffected."
);
create_exception!(
    _core,
    SerializeError,
    SpillwayError,
    "A value could not be serialized (a Store's put of a value heavier than its target, or \
     get_serialized of an object); the codec's own exception is its __cause__."
);
create_exception!(
    _core,
    ReadOnly,
    SpillwayError,
    "An earlier write or fdatasync failed, so the log refuses writes (reads go on). Reopen the \
     directory to recover what was acknowledged."
);

fn to_py(e: Error) -> PyErr {
    match &e {
        Error::Io { source, .. } => match source.raw_os_error() {
            Some(errno) => PyOSError::new_err((errno, e.to_string())),
            None => PyOSError::new_err(e.to_string()),
        },
        Error::InvalidConfig(_) | Error::KeyTooLarge { .. } | Error::ValueTooLarge { .. } => {
            PyValueError::new_err(e.to_string())
        }
        Error::ChecksumMismatch { .. } | Error::Corrupt { .. } | Error::UnsupportedVersion { .. } => {
            Corrupt::new_err(e.to_string())
        }
        Error::Poisoned { .. } => ReadOnly::new_err(e.to_string()),
        _ => SpillwayError::new_err(e.to_string()),
    }
}

/// The simulated disk's fault for `_inject_fault` (of `Log` and `Store`): `op` "read", "write",
/// "sync", "allocate", "create", "open", "remove" or "any"; `kind` "eio", "enospc", "torn-write" or
/// "torn-enospc".
fn fault(op: &str, after: u64, kind: &str, sticky: bool) -> PyResult<spillway::backend::Fault> {
    use spillway::backend::{Fault, FaultKind, FaultOp};
    let op = match op {
        "read" => FaultOp::Read,
        "write" => FaultOp::Write,
        "sync" => FaultOp::Sync,
        "allocate" => FaultOp::Allocate,
        "create" => FaultOp::Create,
        "open" => FaultOp::Open,
        "remove" => FaultOp::Remove,
        "any" => FaultOp::Any,
        other => return Err(PyValueError::new_err(format!("unknown operation '{other}'"))),
    };
    let kind = match kind {
        "eio" => FaultKind::Eio,
        "enospc" => FaultKind::Enospc,
        "torn-write" => FaultKind::TornWrite,
        "torn-enospc" => FaultKind::TornEnospc,
        other => return Err(PyValueError::new_err(format!("unknown fault '{other}'"))),
    };
    Ok(Fault { op, after, kind, sticky })
}

/// A Python buffer held for the length of one `put`: the frame's bytes, borrowed without a copy.
struct Borrowed(PyBuffer<u8>);

impl AsRef<[u8]> for Borrowed {
    fn as_ref(&self) -> &[u8] {
        if self.0.len_bytes() == 0 {
            return &[]; // an exporter may hand out a null pointer for an empty buffer
        }
        // SAFETY: `PyBuffer::get` succeeded and was checked C-contiguous, so `buf_ptr()` points to
        // `len_bytes()` readable bytes that the exporter keeps alive (and in place: a buffer export
        // forbids resizing) until the PyBuffer is released, which happens when `self` drops.
        unsafe { std::slice::from_raw_parts(self.0.buf_ptr() as *const u8, self.0.len_bytes()) }
    }
}

/// Each buffer of the iterable `frames`, borrowed without a copy when it is C-contiguous (copied
/// otherwise). Drop the result with the GIL held: releasing a buffer calls into its exporter.
fn borrow_frames(py: Python<'_>, frames: &Bound<'_, PyAny>) -> PyResult<Frames> {
    let mut parts = Vec::new();
    for f in frames.try_iter()? {
        let f = f?;
        let buf = PyBuffer::<u8>::get(&f)?;
        if buf.is_c_contiguous() {
            parts.push(Bytes::from_owner(Borrowed(buf)));
        } else {
            parts.push(Bytes::from(buf.to_vec(py)?));
        }
    }
    Ok(Frames(parts))
}

/// crc32 of `frames` laid out as a record's payload (the `payload_crc` an uncompressed record of them
/// has), computed without copying them and with the GIL released. `SpillBuffer` compares it to
/// tell whether a value read back from disk still serializes to the bytes of its record.
#[pyfunction]
fn frames_crc(py: Python<'_>, frames: &Bound<'_, PyAny>) -> PyResult<u32> {
    let frames = borrow_frames(py, frames)?;
    let crc = py.allow_threads(|| spillway::laid_out_crc(frames.iter().map(|b| &b[..])));
    drop(frames); // the borrowed buffers are released here, with the GIL held
    Ok(crc)
}

/// `frames` as a list of memoryviews over their buffers (no copy), `writable` ones only over
/// buffers nothing else uses (a read's own).
fn frames_to_list(py: Python<'_>, frames: Frames, writable: bool) -> PyResult<Bound<'_, PyList>> {
    let views = frames
        .0
        .into_iter()
        .map(|data| {
            let f = Bound::new(py, Frame { data, writable })?;
            PyMemoryView::from(f.as_any())
        })
        .collect::<PyResult<Vec<_>>>()?;
    PyList::new(py, views)
}

/// One frame returned by `get`, exported to Python through the buffer protocol.
#[pyclass(frozen, module = "spillway._core")]
struct Frame {
    data: Bytes,
    writable: bool,
}

#[pymethods]
impl Frame {
    /// Export `data` as a one-dimensional unsigned-byte buffer.
    ///
    /// # Safety
    /// Called by the interpreter with a valid `view` to fill, as the buffer protocol specifies.
    unsafe fn __getbuffer__(slf: Bound<'_, Self>, view: *mut ffi::Py_buffer, flags: c_int) -> PyResult<()> {
        if view.is_null() {
            return Err(PyBufferError::new_err("null Py_buffer"));
        }
        let me = slf.get();
        if flags & ffi::PyBUF_WRITABLE == ffi::PyBUF_WRITABLE && !me.writable {
            return Err(PyBufferError::new_err("frame is read-only"));
        }
        // SAFETY: `view` is non-null and the interpreter hands us exclusive use of it for this call.
        // The exported pointer stays valid while the view holds its reference to `slf` (`obj`), which
        // owns the `Bytes` and with it the allocation. Writes through a writable view are sound: a
        // writable frame is a slice of a read buffer allocated for the `get` that created it, no Rust
        // code keeps a reference into it, and the frames of one read cover disjoint ranges.
        unsafe {
            (*view).obj = slf.clone().into_any().into_ptr();
            (*view).buf = me.data.as_ptr() as *mut c_void;
            (*view).len = me.data.len() as ffi::Py_ssize_t;
            (*view).readonly = c_int::from(!me.writable);
            (*view).itemsize = 1;
            (*view).format = if flags & ffi::PyBUF_FORMAT == ffi::PyBUF_FORMAT {
                c"B".as_ptr() as *mut _
            } else {
                std::ptr::null_mut()
            };
            (*view).ndim = 1;
            (*view).shape =
                if flags & ffi::PyBUF_ND == ffi::PyBUF_ND { &mut (*view).len } else { std::ptr::null_mut() };
            (*view).strides = if flags & ffi::PyBUF_STRIDES == ffi::PyBUF_STRIDES {
                &mut (*view).itemsize
            } else {
                std::ptr::null_mut()
            };
            (*view).suboffsets = std::ptr::null_mut();
            (*view).internal = std::ptr::null_mut();
        }
        Ok(())
    }

    /// Nothing to release: the view's reference to this object keeps the bytes alive.
    ///
    /// # Safety
    /// Called by the interpreter with the view it got from `__getbuffer__`.
    unsafe fn __releasebuffer__(&self, _view: *mut ffi::Py_buffer) {}

    fn __len__(&self) -> usize {
        self.data.len()
    }
}

struct Sizes {
    /// Payload bytes of each live key.
    map: HashMap<Vec<u8>, u64>,
    total: u64,
    /// Bytes of puts in flight (counted against `max_disk_bytes`).
    reserved: u64,
    /// Keys a put or delete is working on: another put or delete of the same key waits (on
    /// `Inner::settled`), so the sizes follow the log's order of operations on each key.
    busy: HashSet<Vec<u8>>,
}

struct Inner {
    log: SegmentLog<AutoBackend>,
    sizes: Mutex<Sizes>,
    settled: Condvar,
    max_disk: Option<u64>,
    durable: bool,
    /// Dropped with the log (after it: fields drop in order), which tells `Log.close` that the
    /// log is closed.
    _closed: mpsc::Sender<()>,
}

impl Inner {
    fn sizes(&self) -> std::sync::MutexGuard<'_, Sizes> {
        self.sizes.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// During `key`'s claim: reserve `n` bytes for its new value against `max_disk_bytes` (the old
    /// value's bytes count as free), or `DiskFull` saying it would not fit. The reservation ends
    /// when dropped; [`Reserved::stored`] makes the value `key`'s size.
    fn reserve(&self, key: &[u8], n: u64, doing: &str) -> PyResult<Reserved<'_>> {
        let mut s = self.sizes();
        if let Some(max) = self.max_disk {
            let old = s.map.get(key).copied().unwrap_or(0);
            if s.total - old + s.reserved + n > max {
                return Err(DiskFull::new_err(format!(
                    "{doing} {n} bytes would exceed max_disk_bytes {max} ({} stored)",
                    s.total
                )));
            }
        }
        s.reserved += n;
        Ok(Reserved { inner: self, n })
    }

    /// Wait until no other put or delete of `key` is running; `key` is then busy until the
    /// returned claim drops (on every path, a panic included).
    fn claim<'a>(&'a self, key: &'a [u8]) -> Claim<'a> {
        let mut s = self.sizes();
        while s.busy.contains(key) {
            s = self.settled.wait(s).unwrap_or_else(PoisonError::into_inner);
        }
        s.busy.insert(key.to_vec());
        Claim { inner: self, key }
    }
}

/// Bytes reserved for a value being written (see [`Inner::reserve`]).
struct Reserved<'a> {
    inner: &'a Inner,
    n: u64,
}

impl Reserved<'_> {
    /// The value is written: it is `key`'s now, of `n` bytes.
    fn stored(self, key: &[u8]) {
        let mut s = self.inner.sizes();
        let old = s.map.insert(key.to_vec(), self.n).unwrap_or(0);
        s.total = s.total - old + self.n;
    }
}

impl Drop for Reserved<'_> {
    fn drop(&mut self) {
        self.inner.sizes().reserved -= self.n;
    }
}

/// A put's or delete's turn on its key (see [`Inner::claim`]).
struct Claim<'a> {
    inner: &'a Inner,
    key: &'a [u8],
}

impl Drop for Claim<'_> {
    fn drop(&mut self) {
        self.inner.sizes().busy.remove(self.key);
        self.inner.settled.notify_all();
    }
}

/// Write-behind budget of a `Log` that is not durable: large enough that the page cache holds the
/// values in large folios (a 64 KiB `Log.get` took 9.3-9.5 µs with 128 KiB, 7.8-8.0 µs with 2 MiB;
/// see `docs/architecture.md`), small next to a worker's memory.
const DEFAULT_WRITE_BEHIND: u64 = 2 << 20;

/// An append-only segment log in one directory: keys (bytes) to lists of frames.
///
/// Thread-safe; the GIL is released during I/O. `durable=False` (the default, for spill data that
/// dies with its worker) skips fsyncs and tombstones, and releases a deleted value's disk blocks at
/// once: reopening such a directory may bring deleted keys back, or report them as damaged. It also
/// writes small puts behind (`write_behind_bytes`, default 2 MiB when not durable, else 0): they
/// are kept in memory, encoded, and written together once that many bytes are pending, so that a
/// stream of small spills costs one write per 2 MiB instead of one per value, and the page cache
/// holds them in large folios, which later reads copy out faster. Pending values read
/// back at once; closing the log writes them. `durable=True` writes tombstones for deletes and
/// never writes behind; `sync()` makes what was put so far durable. A full disk met by a write fails
/// only the put that met it, and deleting keys frees space; a failed fdatasync (of any kind, a
/// full disk included) makes the log read-only, since the kernel may have dropped the pages.
#[pyclass(frozen, module = "spillway._core")]
struct Log {
    inner: RwLock<Option<Arc<Inner>>>,
    /// Disconnected once the log has been dropped: `close` waits on it for the operations that were
    /// running on other threads (each holds the log until it returns).
    closed: Mutex<mpsc::Receiver<()>>,
    backend: &'static str,
    /// The log's identity in `RUNNING` (its `Inner`'s address, unique while it is alive).
    id: usize,
    /// What transfer grants of this log send from, while it is open.
    granted: Mutex<Option<Arc<transfer::Granted>>>,
}

thread_local! {
    /// Log operations running on this thread, by log (`Arc::as_ptr`): a `close` of a log called
    /// from inside an operation on it (from a frame iterator, or a signal handler) must not wait for
    /// that operation, which would never end. A close of another log waits as usual.
    static RUNNING: RefCell<HashMap<usize, usize>> = RefCell::new(HashMap::new());
}

fn log_id(inner: &Arc<Inner>) -> usize {
    Arc::as_ptr(inner) as usize
}

/// A running operation's hold on the log. The last hold, after `close`, drops the log without the
/// GIL (that writes the pending values and joins the io_uring driver).
struct Held(Option<Arc<Inner>>);

impl std::ops::Deref for Held {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        self.0.as_ref().expect("held until dropped")
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let id = log_id(self.0.as_ref().expect("held until dropped"));
        RUNNING.with(|r| {
            let mut r = r.borrow_mut();
            let n = r.get_mut(&id).expect("counted when taken");
            *n -= 1;
            if *n == 0 {
                r.remove(&id);
            }
        });
        drop_without_gil(self.0.take());
    }
}

impl Drop for Log {
    /// A log collected without `close`: dropped here without the GIL (that writes its pending values
    /// and joins the io_uring driver, whose thread may need the GIL meanwhile, to log).
    fn drop(&mut self) {
        drop(self.granted.get_mut().unwrap_or_else(PoisonError::into_inner).take());
        drop_without_gil(self.inner.get_mut().unwrap_or_else(PoisonError::into_inner).take());
    }
}

/// Drop `held` if this is its last reference, with the GIL released: dropping a log or a store
/// writes its pending values and joins its io_uring driver, whose thread may need the GIL meanwhile
/// (to log).
pub(crate) fn drop_without_gil<T: Send>(held: Option<Arc<T>>) {
    if let Some(last) = held.and_then(Arc::into_inner) {
        Python::with_gil(|py| py.allow_threads(move || drop(last)));
    }
}

impl Log {
    /// What transfer grants of this log send from (one while it is open).
    fn granted(&self) -> PyResult<Arc<transfer::Granted>> {
        let mut g = self.granted.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(g) = &*g {
            return Ok(g.clone());
        }
        let inner = self.inner.read().unwrap_or_else(PoisonError::into_inner).clone();
        let inner = inner.ok_or_else(|| PyValueError::new_err("the log is closed"))?;
        let made = Arc::new(transfer::Granted::Log(inner));
        *g = Some(made.clone());
        Ok(made)
    }

    fn inner(&self) -> PyResult<Held> {
        let inner = self
            .inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| PyValueError::new_err("the log is closed"))?;
        RUNNING.with(|r| *r.borrow_mut().entry(log_id(&inner)).or_insert(0) += 1);
        Ok(Held(Some(inner)))
    }
}

#[pymethods]
impl Log {
    #[new]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments
    #[pyo3(signature = (path, *, segment_bytes = 64 << 20, compression = "none", backend = "auto", max_disk_bytes = None, durable = false, direct = false, write_behind_bytes = None))]
    fn new(
        py: Python<'_>,
        path: std::path::PathBuf,
        segment_bytes: u64,
        compression: &str,
        backend: &str,
        max_disk_bytes: Option<u64>,
        durable: bool,
        direct: bool,
        write_behind_bytes: Option<u64>,
    ) -> PyResult<Self> {
        logging::install(py);
        let compression = match compression {
            "none" => Compression::None,
            "lz4" => Compression::Lz4,
            other => return Err(PyValueError::new_err(format!("unknown compression '{other}' (none or lz4)"))),
        };
        let kind: BackendKind = backend.parse().map_err(PyValueError::new_err)?;
        // Spill data (not durable): a deleted value's blocks are released at once, like an unlinked file.
        let write_behind_bytes = write_behind_bytes.unwrap_or(if durable { 0 } else { DEFAULT_WRITE_BEHIND });
        let opts = LogOptions {
            segment_bytes,
            compression,
            durable,
            punch_forgotten: !durable,
            write_behind_bytes,
            ..LogOptions::default()
        };
        py.allow_threads(move || {
            // A small registered pool: a process may hold many logs (one per SpillBuffer).
            let uring = UringOptions { pool_buffers: 2, direct, ..UringOptions::default() };
            let be = AutoBackend::with_options(kind, uring).map_err(|e| to_py(Error::io("start backend", None, e)))?;
            let name = be.name();
            let log = SegmentLog::open(be, &path, opts).map_err(to_py)?;
            let mut map = HashMap::new();
            let mut total = 0;
            for k in log.keys() {
                // The size from the record's head (header and frame table, checked by the header's
                // crc), without reading the value. A record whose head is damaged counts with its
                // length on disk; a `get` of it reports the damage, and the other keys are unaffected.
                let n = match log.stored_value(&k) {
                    Ok(Some(sv)) => sv.meta.frame_lens.iter().sum(),
                    Ok(None) => continue,
                    Err(_) => log.location(&k).map_or(0, |l| l.len),
                };
                total += n;
                map.insert(k, n);
            }
            let (tx, rx) = mpsc::channel();
            let sizes = Mutex::new(Sizes { map, total, reserved: 0, busy: HashSet::new() });
            let inner = Inner { log, sizes, settled: Condvar::new(), max_disk: max_disk_bytes, durable, _closed: tx };
            let inner = Arc::new(inner);
            let id = log_id(&inner);
            Ok(Log {
                inner: RwLock::new(Some(inner)),
                closed: Mutex::new(rx),
                backend: name,
                id,
                granted: Mutex::new(None),
            })
        })
    }

    /// Store `frames` (objects with the buffer protocol) under `key`, replacing any previous value.
    /// Returns the payload bytes stored (before compression).
    fn put(&self, py: Python<'_>, key: &[u8], frames: &Bound<'_, PyAny>) -> PyResult<u64> {
        let inner = self.inner()?;
        let frames = borrow_frames(py, frames)?;
        let n = frames.total_len();
        let key = key.to_vec();
        let result = py.allow_threads(|| {
            let _turn = inner.claim(&key);
            let reserved = inner.reserve(&key, n, "storing")?;
            inner.log.put(&key, &frames).map_err(to_py)?;
            reserved.stored(&key);
            Ok(())
        });
        // The borrowed buffers are released here, with the GIL held.
        drop(frames);
        result.map(|()| n)
    }

    /// The frames of `key` as writable memoryviews over the engine's read buffer (no copy).
    /// KeyError when absent.
    fn get<'py>(&self, py: Python<'py>, key: &[u8]) -> PyResult<Bound<'py, PyList>> {
        Ok(self.get_with_crc(py, key)?.0)
    }

    /// `(get(key), crc)`: `crc` is the `frames_crc` of the frames, which the read checked them
    /// against, or None for an lz4-compressed record (its crc covers the compressed bytes).
    fn get_with_crc<'py>(&self, py: Python<'py>, key: &[u8]) -> PyResult<(Bound<'py, PyList>, Option<u32>)> {
        let inner = self.inner()?;
        let got = py.allow_threads(|| inner.log.get_with_crc(key)).map_err(to_py)?;
        let Some((frames, crc)) = got else {
            return Err(PyKeyError::new_err(PyBytes::new(py, key).unbind()));
        };
        Ok((frames_to_list(py, frames, true)?, crc))
    }

    /// Remove `key`; True if it existed.
    fn delete(&self, py: Python<'_>, key: &[u8]) -> PyResult<bool> {
        let inner = self.inner()?;
        py.allow_threads(|| {
            let _turn = inner.claim(key);
            let r = if inner.durable { inner.log.delete(key) } else { inner.log.forget(key) };
            let mut s = inner.sizes();
            if r.is_ok() {
                if let Some(n) = s.map.remove(key) {
                    s.total -= n;
                }
            }
            r.map_err(to_py)
        })
    }

    fn __contains__(&self, key: &[u8]) -> PyResult<bool> {
        Ok(self.inner()?.log.contains(key))
    }

    fn __len__(&self) -> PyResult<usize> {
        Ok(self.inner()?.log.len())
    }

    /// Every live key.
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let inner = self.inner()?;
        let keys = inner.log.keys();
        Ok(keys.iter().map(|k| PyBytes::new(py, k)).collect())
    }

    /// Payload bytes of `key` (KeyError when absent).
    fn stored_bytes(&self, py: Python<'_>, key: &[u8]) -> PyResult<u64> {
        let inner = self.inner()?;
        let n = inner.sizes().map.get(key).copied();
        n.ok_or_else(|| PyKeyError::new_err(PyBytes::new(py, key).unbind()))
    }

    /// Sum of the payload bytes of live keys.
    #[getter]
    fn disk_bytes(&self) -> PyResult<u64> {
        Ok(self.inner()?.sizes().total)
    }

    /// Bytes of the segment files on disk (preallocated size included).
    #[getter]
    fn file_bytes(&self, py: Python<'_>) -> PyResult<u64> {
        let inner = self.inner()?;
        // Without the GIL: the log's statistics wait for its writer, which a large `put` on another
        // thread holds for the whole write.
        Ok(py.allow_threads(|| inner.log.stats().disk_bytes))
    }

    /// Make every value put so far durable (fdatasync of the active segment; the values written
    /// behind are written first). For a log opened with `durable=True`; on one that is not, the
    /// data is synced but deletes are not (they write no tombstones).
    fn sync(&self, py: Python<'_>) -> PyResult<()> {
        let inner = self.inner()?;
        py.allow_threads(|| inner.log.sync()).map_err(to_py)
    }

    /// Why the log refuses writes (an earlier write or fdatasync failed: puts and deletes raise
    /// ReadOnly, reads go on), or None while it is writable.
    #[getter]
    fn read_only(&self) -> PyResult<Option<String>> {
        Ok(self.inner()?.log.poisoned().map(str::to_owned))
    }

    /// The backend in use: "uring", "portable" or "sim".
    #[getter]
    fn backend(&self) -> &'static str {
        self.backend
    }

    /// For tests, on a log opened with `backend="sim"` (the simulated disk, in memory): make the
    /// operation `op` ("read", "write", "sync", "allocate", "create", "open", "remove" or "any")
    /// fail with `kind` ("eio", "enospc", "torn-write" or "torn-enospc") after `after` more
    /// operations of that kind succeed; with `sticky`, every later one fails too, until
    /// `_clear_faults`. ValueError on any other backend.
    #[pyo3(signature = (op, after, kind, sticky = false))]
    fn _inject_fault(&self, op: &str, after: u64, kind: &str, sticky: bool) -> PyResult<()> {
        let fault = fault(op, after, kind, sticky)?;
        let inner = self.inner()?;
        let sim = inner.log.backend().as_sim().ok_or_else(|| PyValueError::new_err("faults need backend='sim'"))?;
        sim.inject(fault);
        Ok(())
    }

    /// For tests: remove the faults `_inject_fault` scripted (sticky ones included).
    fn _clear_faults(&self) -> PyResult<()> {
        let inner = self.inner()?;
        let sim = inner.log.backend().as_sim().ok_or_else(|| PyValueError::new_err("faults need backend='sim'"))?;
        sim.clear_faults();
        Ok(())
    }

    /// Close the log (idempotent). Later calls raise ValueError. Operations already running on
    /// other threads finish first, and `close` returns once the log is closed (its pending values
    /// written, its files closed), so the caller may then remove its directory. A durable log is
    /// synced first; if that fails the log is closed all the same and the error is raised.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let granted = self.granted.lock().unwrap_or_else(PoisonError::into_inner).take();
        drop(granted); // (grants hold it weakly: after this, only running calls hold the log)
        let taken = self.inner.write().unwrap_or_else(PoisonError::into_inner).take();
        // Called from inside an operation on this log on this thread, which cannot end while this
        // waits: the log closes when that operation returns.
        let wait = RUNNING.with(|r| !r.borrow().contains_key(&self.id));
        // Dropping the log joins the io_uring driver, and running operations may take a while:
        // wait without the GIL. The last of them to return drops the log.
        py.allow_threads(|| {
            // A durable log is synced as it closes: what was put is then acknowledged as durable
            // (and a record damaged later reads as damage, not as its key's previous value).
            let synced = match &taken {
                Some(t) if t.durable => t.log.sync(),
                _ => Ok(()),
            };
            drop(taken);
            if wait {
                // Disconnected (an error) when the log is dropped: nothing is ever sent. A second
                // `close` waits here after the first, then returns at once.
                let _ = self.closed.lock().unwrap_or_else(PoisonError::into_inner).recv();
            }
            synced
        })
        .map_err(to_py)
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _t: PyObject, _v: PyObject, _tb: PyObject) -> PyResult<()> {
        self.close(py)
    }
}

/// The segment log behind `spillway.SpillBuffer`.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(logging::flush_logs, m)?)?;
    m.add_function(wrap_pyfunction!(store::take_thread_metrics, m)?)?;
    m.add_class::<Log>()?;
    m.add_class::<Frame>()?;
    m.add_class::<store::Store>()?;
    m.add_class::<store::Admission>()?;
    m.add_function(wrap_pyfunction!(frames_crc, m)?)?;
    transfer::register(m)?;
    m.add("SpillwayError", m.py().get_type::<SpillwayError>())?;
    m.add("DiskFull", m.py().get_type::<DiskFull>())?;
    m.add("Corrupt", m.py().get_type::<Corrupt>())?;
    m.add("ReadOnly", m.py().get_type::<ReadOnly>())?;
    m.add("SerializeError", m.py().get_type::<SerializeError>())?;
    Ok(())
}
