//! `spillway._core`: the segment log for Python (`spillway.SpillBuffer` is written in Python on top).
//!
//! * `put` takes the frames of a pickle protocol 5 dump (header plus out-of-band buffers) without
//!   joining or copying them: each frame is borrowed through the buffer protocol for the duration of
//!   the call, and the log copies it once, into its aligned write buffer.
//! * `get` returns one `memoryview` per frame over the engine's read buffer, without copying.
//! * The GIL is released while the engine reads, writes or waits.
//!
//! The `unsafe` here is the buffer protocol in both directions; each site names its invariant.
#![allow(unsafe_code)]

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{c_int, c_void};
use std::sync::{mpsc, Arc, Mutex, PoisonError, RwLock};

use bytes::Bytes;
use pyo3::buffer::PyBuffer;
use pyo3::create_exception;
use pyo3::exceptions::{PyBufferError, PyException, PyKeyError, PyOSError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyMemoryView};
use spillway::backend::UringOptions;
use spillway::{AutoBackend, Backend, BackendKind, Compression, Error, Frames, LogOptions, SegmentLog};

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

fn to_py(e: Error) -> PyErr {
    match &e {
        Error::Io { source, .. } => match source.raw_os_error() {
            Some(errno) => PyOSError::new_err((errno, e.to_string())),
            None => PyOSError::new_err(e.to_string()),
        },
        Error::InvalidConfig(_) | Error::KeyTooLarge { .. } | Error::ValueTooLarge { .. } => {
            PyValueError::new_err(e.to_string())
        }
        _ => SpillwayError::new_err(e.to_string()),
    }
}

/// A Python buffer held for the length of one `put`: the frame's bytes, borrowed without a copy.
struct Borrowed(PyBuffer<u8>);

impl AsRef<[u8]> for Borrowed {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `PyBuffer::get` succeeded and was checked C-contiguous, so `buf_ptr()` points to
        // `len_bytes()` readable bytes that the exporter keeps alive (and in place: a buffer export
        // forbids resizing) until the PyBuffer is released, which happens when `self` drops.
        unsafe { std::slice::from_raw_parts(self.0.buf_ptr() as *const u8, self.0.len_bytes()) }
    }
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
}

struct Inner {
    log: SegmentLog<AutoBackend>,
    sizes: Mutex<Sizes>,
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
/// back at once; closing the log writes them. A full disk fails only the put that met it; deleting
/// keys frees space.
#[pyclass(frozen, module = "spillway._core")]
struct Log {
    inner: RwLock<Option<Arc<Inner>>>,
    /// Disconnected once the log has been dropped: `close` waits on it for the operations that were
    /// running on other threads (each holds the log until it returns).
    closed: Mutex<mpsc::Receiver<()>>,
    backend: &'static str,
}

thread_local! {
    /// Log operations running on this thread: a `close` called from inside one (from a frame
    /// iterator, or a signal handler) must not wait for it, which would never end.
    static RUNNING: Cell<usize> = const { Cell::new(0) };
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
        RUNNING.with(|r| r.set(r.get() - 1));
        if let Some(last) = self.0.take().and_then(Arc::into_inner) {
            Python::with_gil(|py| py.allow_threads(move || drop(last)));
        }
    }
}

impl Log {
    fn inner(&self) -> PyResult<Held> {
        let inner = self
            .inner
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
            .ok_or_else(|| PyValueError::new_err("the log is closed"))?;
        RUNNING.with(|r| r.set(r.get() + 1));
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
            let sizes = Mutex::new(Sizes { map, total, reserved: 0 });
            let inner = Inner { log, sizes, max_disk: max_disk_bytes, durable, _closed: tx };
            Ok(Log { inner: RwLock::new(Some(Arc::new(inner))), closed: Mutex::new(rx), backend: name })
        })
    }

    /// Store `frames` (objects with the buffer protocol) under `key`, replacing any previous value.
    /// Returns the payload bytes stored (before compression).
    fn put(&self, py: Python<'_>, key: &[u8], frames: &Bound<'_, PyAny>) -> PyResult<u64> {
        let inner = self.inner()?;
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
        let frames = Frames(parts);
        let n = frames.total_len();
        let key = key.to_vec();
        let result = py.allow_threads(|| {
            if let Some(max) = inner.max_disk {
                let mut s = inner.sizes();
                let old = s.map.get(&key).copied().unwrap_or(0);
                if s.total - old + s.reserved + n > max {
                    return Err(DiskFull::new_err(format!(
                        "storing {n} bytes would exceed max_disk_bytes {max} ({} stored)",
                        s.total
                    )));
                }
                s.reserved += n;
            }
            let r = inner.log.put(&key, &frames).map_err(to_py);
            let mut s = inner.sizes();
            if inner.max_disk.is_some() {
                s.reserved -= n;
            }
            if r.is_ok() {
                let old = s.map.insert(key, n).unwrap_or(0);
                s.total = s.total - old + n;
            }
            r
        });
        // The borrowed buffers are released here, with the GIL held.
        drop(frames);
        result.map(|()| n)
    }

    /// The frames of `key` as writable memoryviews over the engine's read buffer (no copy).
    /// KeyError when absent.
    fn get<'py>(&self, py: Python<'py>, key: &[u8]) -> PyResult<Bound<'py, PyList>> {
        let inner = self.inner()?;
        let frames = py.allow_threads(|| inner.log.get(key)).map_err(to_py)?;
        let Some(frames) = frames else {
            return Err(PyKeyError::new_err(PyBytes::new(py, key).unbind()));
        };
        let views = frames
            .0
            .into_iter()
            .map(|data| {
                let f = Bound::new(py, Frame { data, writable: true })?;
                PyMemoryView::from(f.as_any())
            })
            .collect::<PyResult<Vec<_>>>()?;
        PyList::new(py, views)
    }

    /// Remove `key`; True if it existed.
    fn delete(&self, py: Python<'_>, key: &[u8]) -> PyResult<bool> {
        let inner = self.inner()?;
        py.allow_threads(|| {
            let r = if inner.durable { inner.log.delete(key) } else { inner.log.forget(key) };
            let existed = r.map_err(to_py)?;
            let mut s = inner.sizes();
            if let Some(n) = s.map.remove(key) {
                s.total -= n;
            }
            Ok(existed)
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

    /// The backend in use: "uring" or "portable".
    #[getter]
    fn backend(&self) -> &'static str {
        self.backend
    }

    /// Close the log (idempotent). Later calls raise ValueError. Operations already running on
    /// other threads finish first, and `close` returns once the log is closed (its pending values
    /// written, its files closed), so the caller may then remove its directory.
    fn close(&self, py: Python<'_>) {
        let taken = self.inner.write().unwrap_or_else(PoisonError::into_inner).take();
        // Called from inside an operation on this thread, which cannot end while this waits: the
        // log closes when that operation returns.
        let wait = RUNNING.with(|r| r.get()) == 0;
        // Dropping the log joins the io_uring driver, and running operations may take a while:
        // wait without the GIL. The last of them to return drops the log.
        py.allow_threads(|| {
            drop(taken);
            if wait {
                // Disconnected (an error) when the log is dropped: nothing is ever sent. A second
                // `close` waits here after the first, then returns at once.
                let _ = self.closed.lock().unwrap_or_else(PoisonError::into_inner).recv();
            }
        });
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _t: PyObject, _v: PyObject, _tb: PyObject) {
        self.close(py);
    }
}

/// The segment log behind `spillway.SpillBuffer`.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Log>()?;
    m.add_class::<Frame>()?;
    m.add("SpillwayError", m.py().get_type::<SpillwayError>())?;
    m.add("DiskFull", m.py().get_type::<DiskFull>())?;
    Ok(())
}
