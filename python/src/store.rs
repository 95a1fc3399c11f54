//! `spillway._core.Store`: the engine's three-tier store (`spillway::Store`) for Python, with a codec
//! that calls Python (by default `spillway.codec`: pickle protocol 5 with out-of-band buffers and
//! dask's `sizeof`).
//!
//! * Every call releases the GIL before it touches the store; the codec takes it back only inside
//!   `dumps`, `loads`, `sizeof` and the weak references it keeps of evicted objects, none of which
//!   the store runs under its lock. So a thread waiting for the store's lock never holds the GIL, and
//!   readers of a key being deserialized wait in its slot without it.
//! * Frames given by Python are held without a copy: each through a memoryview of our own, which
//!   keeps the exporter's memory in place. One dropped by the store without the GIL is released by
//!   pyo3 the next time a thread takes it (never under the store's lock); the process target's
//!   check takes it before it reads the RSS (`Codec::release_dropped`).
//! * Frames handed to `loads` are memoryviews over the engine's buffers: writable when they were read
//!   from disk for that call (so an array read back is writeable without a copy), read-only when the
//!   store keeps them (the codec copies them if values must be writeable).
#![allow(unsafe_code)]

use std::sync::{Arc, PoisonError, RwLock};

use bytes::Bytes;
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyKeyError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyMemoryView, PyTuple};
use spillway::backend::UringOptions;
use spillway::{
    Activity, AutoBackend, Backend, BackendKind, Codec, CodecError, Compression, Error, EvictionPolicy, Frames,
    LogOptions, Revive, SpillFailureKind, StoreConfig,
};

use crate::transfer::Granted;
use crate::{drop_without_gil, frames_to_list, to_py};

/// The weight of a value whose `sizeof` failed in a way the codec did not handle itself (as
/// `distributed.sizeof.safe_sizeof`).
const SIZEOF_FALLBACK_BYTES: u64 = 1_000_000;

/// A frame the store holds whose memory Python owns.
struct PyOwned {
    /// A memoryview of our own over the frame: while it is alive its export keeps the memory in
    /// place (an exporter may not resize or free memory it has exported).
    _view: Py<PyAny>,
    ptr: *const u8,
    len: usize,
}

// SAFETY: the bytes behind `ptr` stay valid and in place for as long as `_view` (its export) is
// alive, whichever thread holds this; `Py<PyAny>` itself is Send and Sync, and its drop without the
// GIL is deferred by pyo3 to a thread that holds it. The bytes are only read through `as_ref`, and
// the store's contract (dask's rule for task data) is that a value is not changed in place while
// the store holds it: Python writing these bytes meanwhile breaks that contract, as it would
// tear a write to disk in any store that does not copy.
unsafe impl Send for PyOwned {}
// SAFETY: as for Send: shared access only reads the bytes.
unsafe impl Sync for PyOwned {}

impl AsRef<[u8]> for PyOwned {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[]; // an exporter may hand out a null pointer for an empty buffer
        }
        // SAFETY: `ptr` and `len` come from a C-contiguous export of `_view`, which this struct keeps
        // alive (see the Send impl): `len` readable bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// Each buffer of the iterable `frames`, held without a copy when it is C-contiguous (copied
/// otherwise).
fn own_frames(py: Python<'_>, frames: &Bound<'_, PyAny>) -> PyResult<Frames> {
    let mut parts = Vec::new();
    for f in frames.try_iter()? {
        let mut view = PyMemoryView::from(&f?)?;
        if view.getattr("format")?.extract::<String>()? != "B" {
            // A buffer of other items (a numpy array, say): its bytes, as a view of the same memory.
            view = view.call_method1("cast", ("B",))?.downcast_into::<PyMemoryView>()?;
        }
        let buf = PyBuffer::<u8>::get(&view)?;
        if buf.is_c_contiguous() {
            let (ptr, len) = (buf.buf_ptr() as *const u8, buf.len_bytes());
            drop(buf); // our view keeps its own export of the memory
            parts.push(Bytes::from_owner(PyOwned { _view: view.into_any().unbind(), ptr, len }));
        } else {
            parts.push(Bytes::from(buf.to_vec(py)?));
        }
    }
    Ok(Frames(parts))
}

/// A Python exception the codec raised, kept whole so that the caller of the store call that met it
/// gets the same exception back (see [`to_py_err`]), with its text and its causes' (`__cause__`)
/// read while the GIL is held: the engine formats errors under its lock, where no Python may run.
#[derive(Debug)]
struct PyCodecError {
    err: PyErr,
    text: String,
}

impl std::fmt::Display for PyCodecError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.text)
    }
}

impl std::error::Error for PyCodecError {}

fn codec_error(e: PyErr) -> CodecError {
    let text = Python::with_gil(|py| {
        let mut text = e.to_string();
        let mut cause = e.cause(py);
        for _ in 0..8 {
            let Some(c) = cause else { break };
            text.push_str(&format!(", caused by {c}"));
            cause = c.cause(py);
        }
        text
    });
    Box::new(PyCodecError { err: e, text })
}

/// An engine error as a Python exception: a failed serialize is a `SerializeError` whose
/// `__cause__` is the codec's own exception; a failed deserialize raises the codec's exception as
/// it was; anything else as `to_py` maps it.
fn to_py_err(py: Python<'_>, e: Error) -> PyErr {
    if let Error::Codec { op, source, .. } = &e {
        if let Some(PyCodecError { err, .. }) = source.downcast_ref::<PyCodecError>() {
            if *op != "serialize" {
                return err.clone_ref(py);
            }
            let wrapped = crate::SerializeError::new_err(e.to_string());
            wrapped.set_cause(py, Some(err.clone_ref(py)));
            return wrapped;
        }
    }
    to_py(e)
}

/// The codec's own exception behind a failed serialize (for `take_failures`), else `to_py_err`.
fn codec_cause(py: Python<'_>, e: Error) -> PyErr {
    if let Error::Codec { source, .. } = &e {
        if let Some(PyCodecError { err, .. }) = source.downcast_ref::<PyCodecError>() {
            return err.clone_ref(py);
        }
    }
    to_py_err(py, e)
}

/// The codec: four Python callables.
pub(crate) struct PyCodec {
    /// `dumps(value) -> list of frames`.
    dumps: Py<PyAny>,
    /// `loads(frames, writeable) -> value`; with `writeable`, read-only buffers are copied first.
    loads: Py<PyAny>,
    /// `sizeof(value) -> int`.
    sizeof: Py<PyAny>,
    /// `weakref.ref`.
    weakref: Py<PyAny>,
    /// Values built on frames the store keeps must get writeable buffers (copies).
    writeable: bool,
}

impl PyCodec {
    fn load(&self, frames: Frames, writable_frames: bool) -> Result<Py<PyAny>, CodecError> {
        Python::with_gil(|py| {
            let list = frames_to_list(py, frames, writable_frames).map_err(codec_error)?;
            // Frames read for this call are writable already: nothing to copy.
            let copy = self.writeable && !writable_frames;
            self.loads.call1(py, (list, copy)).map_err(codec_error)
        })
    }
}

impl Codec for PyCodec {
    type Value = Py<PyAny>;
    const KEEPS_WEAK: bool = true;

    fn serialize(&self, value: &Py<PyAny>) -> Result<Frames, CodecError> {
        Python::with_gil(|py| {
            let frames = self.dumps.call1(py, (value,)).map_err(codec_error)?;
            own_frames(py, frames.bind(py)).map_err(codec_error)
        })
    }

    fn deserialize(&self, frames: Frames) -> Result<Py<PyAny>, CodecError> {
        self.load(frames, false)
    }

    fn deserialize_owned(&self, frames: Frames) -> Result<Py<PyAny>, CodecError> {
        self.load(frames, true)
    }

    fn size_of(&self, value: &Py<PyAny>) -> u64 {
        Python::with_gil(|py| {
            self.sizeof.call1(py, (value,)).and_then(|n| n.extract::<u64>(py)).unwrap_or(SIZEOF_FALLBACK_BYTES)
        })
    }

    fn release_dropped(&self) {
        // Taking the GIL runs the decrefs pyo3 deferred for objects dropped without it.
        Python::with_gil(|_| ());
    }

    fn keep_weak(&self, value: &Arc<Py<PyAny>>) -> Option<Revive<Py<PyAny>>> {
        Python::with_gil(|py| {
            // A TypeError for types without weak references (int, list, ...): no handle.
            let r = self.weakref.call1(py, (&**value,)).ok()?;
            let revive: Revive<Py<PyAny>> = Arc::new(move || {
                Python::with_gil(|py| {
                    let obj = r.call0(py).ok()?;
                    (!obj.is_none(py)).then(|| Arc::new(obj))
                })
            });
            Some(revive)
        })
    }
}

/// The engine's store, as the binding runs it.
pub(crate) type StoreInner = spillway::Store<PyCodec, AutoBackend>;
type Inner = StoreInner;

/// The engine's three-tier store: objects, frames in memory, records in a segment log on disk.
///
/// Keys are bytes. Values are Python objects, weighed with the codec's `sizeof`; above `target`
/// bytes of weight the least recently used are pickled and written to disk (`policy="dask"`: as
/// dask's store does, straight to disk, exactly down to the target, never the value being put;
/// `"batched"`: through frames in memory, a slack below the target). A get of a key held as frames
/// or on disk deserializes it exactly once, whatever the number of threads asking; an evicted
/// object still alive elsewhere comes back without a read. `codec` is an object with `dumps`,
/// `loads` and `sizeof` (default `spillway.codec`). The directory's earlier contents are discarded.
#[pyclass(frozen, module = "spillway._core")]
pub(crate) struct Store {
    inner: RwLock<Option<Arc<Inner>>>,
    backend: &'static str,
    /// What transfer grants send from, while the store is open.
    granted: std::sync::Mutex<Option<Arc<Granted>>>,
}

/// Room a store gave in memory to a value arriving from a peer (`Store.admit`): counted in the
/// store's placement of the next arrivals until released (once the value is set in the store, or
/// let go of), or collected.
#[pyclass(frozen, module = "spillway._core")]
pub(crate) struct Admission {
    held: std::sync::Mutex<Option<(Arc<Inner>, u64)>>,
}

#[pymethods]
impl Admission {
    /// Give the room back (once; later calls do nothing).
    fn release(&self) {
        give_back(self.held.lock().unwrap_or_else(PoisonError::into_inner).take());
    }
}

impl Drop for Admission {
    fn drop(&mut self) {
        give_back(self.held.get_mut().unwrap_or_else(PoisonError::into_inner).take());
    }
}

/// An admission's room back to its store, without the GIL (the store's lock may be held by a thread
/// that waits for it), which may be the store's last reference.
fn give_back(held: Option<(Arc<Inner>, u64)>) {
    if let Some((store, nbytes)) = held {
        Python::with_gil(|py| {
            py.allow_threads(move || {
                store.release_admitted(nbytes);
                drop(store);
            })
        });
    }
}

/// A call's hold on the store. The last hold (after `close`) drops the store without the GIL:
/// that writes the pending values and joins the io_uring driver, whose thread may itself need the
/// GIL meanwhile (to log).
struct Held(Option<Arc<Inner>>);

impl std::ops::Deref for Held {
    type Target = Inner;
    fn deref(&self) -> &Inner {
        self.0.as_ref().expect("held until dropped")
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        drop_without_gil(self.0.take());
    }
}

impl Store {
    /// The store itself, for a call that outlives this one's hold (a transfer).
    pub(crate) fn arc(&self) -> PyResult<Arc<Inner>> {
        let s = self.inner.read().unwrap_or_else(PoisonError::into_inner).clone();
        s.ok_or_else(|| PyValueError::new_err("the store is closed"))
    }

    /// What transfer grants of this store send from (one while it is open).
    pub(crate) fn granted(&self) -> PyResult<Arc<Granted>> {
        let mut g = self.granted.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(g) = &*g {
            return Ok(g.clone());
        }
        let made = Arc::new(Granted::Store(self.arc()?));
        *g = Some(made.clone());
        Ok(made)
    }

    fn inner(&self) -> PyResult<Held> {
        let s = self.inner.read().unwrap_or_else(PoisonError::into_inner).clone();
        s.map(|s| Held(Some(s))).ok_or_else(|| PyValueError::new_err("the store is closed"))
    }

    /// Run `f` on the simulated disk of log number `log` (the one spills go to by default).
    fn sim_disk(&self, log: Option<usize>, f: impl FnOnce(&spillway::SimBackend)) -> PyResult<()> {
        let s = self.inner()?;
        let backends = s.backends();
        let b = match log {
            Some(i) => *backends.get(i).ok_or_else(|| PyValueError::new_err(format!("no log number {i}")))?,
            None => *backends.last().expect("a store has a log"),
        };
        let sim = b.as_sim().ok_or_else(|| PyValueError::new_err("faults need backend='sim'"))?;
        f(sim);
        Ok(())
    }
}

impl Drop for Store {
    /// A store collected without `close`: closed here, without the GIL.
    fn drop(&mut self) {
        let granted = self.granted.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(Granted::Store(s)) = granted.and_then(Arc::into_inner) {
            drop_without_gil(Some(s));
        }
        drop_without_gil(self.inner.get_mut().unwrap_or_else(PoisonError::into_inner).take());
    }
}

fn key_error(py: Python<'_>, key: &[u8]) -> PyErr {
    PyKeyError::new_err(PyBytes::new(py, key).unbind())
}

#[pymethods]
impl Store {
    #[new]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments
    #[pyo3(signature = (directory, target, max_spill = None, *, policy = "dask", compression = "none", backend = "auto", segment_bytes = 64 << 20, writeable = true, codec = None, report_failures = false, fresh_logs = 3))]
    fn new(
        py: Python<'_>,
        directory: std::path::PathBuf,
        target: u64,
        max_spill: Option<u64>,
        policy: &str,
        compression: &str,
        backend: &str,
        segment_bytes: u64,
        writeable: bool,
        codec: Option<Bound<'_, PyAny>>,
        report_failures: bool,
        fresh_logs: u32,
    ) -> PyResult<Self> {
        crate::logging::install(py);
        let eviction = match policy {
            "dask" => EvictionPolicy::dask(),
            "batched" => EvictionPolicy::default(),
            other => return Err(PyValueError::new_err(format!("unknown policy '{other}' (dask or batched)"))),
        };
        let compression = match compression {
            "none" => Compression::None,
            "lz4" => Compression::Lz4,
            other => return Err(PyValueError::new_err(format!("unknown compression '{other}' (none or lz4)"))),
        };
        let kind: BackendKind = backend.parse().map_err(PyValueError::new_err)?;
        let codec = match codec {
            Some(c) => c,
            None => py.import("spillway.codec")?.into_any(),
        };
        let codec = PyCodec {
            dumps: codec.getattr("dumps")?.unbind(),
            loads: codec.getattr("loads")?.unbind(),
            sizeof: codec.getattr("sizeof")?.unbind(),
            weakref: py.import("weakref")?.getattr("ref")?.unbind(),
            writeable,
        };
        let cfg = StoreConfig {
            target_bytes: target,
            max_spill_bytes: max_spill,
            eviction,
            report_failures,
            fresh_logs,
            log: LogOptions { segment_bytes, compression, ..StoreConfig::default().log },
            ..StoreConfig::default()
        };
        py.allow_threads(move || {
            // A small registered pool: a process may hold many stores.
            let uring = UringOptions { pool_buffers: 2, ..UringOptions::default() };
            let be = AutoBackend::with_options(kind, uring).map_err(|e| to_py(Error::io("start backend", None, e)))?;
            let name = be.name();
            let store = Inner::open(codec, be, &directory, cfg).map_err(to_py)?;
            Ok(Store { inner: RwLock::new(Some(Arc::new(store))), backend: name, granted: std::sync::Mutex::new(None) })
        })
    }

    /// Store the object `value` under `key` (replacing any value), then evict while above the
    /// target. A value heavier than the target is pickled and written at once; if it cannot be
    /// pickled, the pickling error is raised and the key is forgotten.
    fn put(&self, py: Python<'_>, key: &[u8], value: Py<PyAny>) -> PyResult<()> {
        let s = self.inner()?;
        py.allow_threads(|| s.put(key, value)).map_err(|e| to_py_err(py, e))
    }

    /// `put` without the eviction that follows it: the memory not already being written if it is
    /// over the target or a check of the process's memory is due (for `enforce_target` on
    /// another thread), else None. A value heavier than the target is still pickled and written
    /// at once.
    fn put_deferred(&self, py: Python<'_>, key: &[u8], value: Py<PyAny>) -> PyResult<Option<u64>> {
        let s = self.inner()?;
        py.allow_threads(|| s.put_deferred(key, value)).map_err(|e| to_py_err(py, e))
    }

    /// `put_serialized` (not to disk) without the eviction that follows it, as `put_deferred`.
    fn put_serialized_deferred(&self, py: Python<'_>, key: &[u8], frames: &Bound<'_, PyAny>) -> PyResult<Option<u64>> {
        let s = self.inner()?;
        let frames = own_frames(py, frames)?;
        py.allow_threads(|| s.put_serialized_deferred(key, frames)).map_err(|e| to_py_err(py, e))
    }

    /// Evict down to the target, as a put does after storing its value.
    fn enforce_target(&self, py: Python<'_>) -> PyResult<()> {
        let s = self.inner()?;
        py.allow_threads(|| s.enforce_target()).map_err(|e| to_py_err(py, e))
    }

    /// Store pickled frames (`[header, *buffers]`, any objects with the buffer protocol) under
    /// `key` without unpickling them; they are held without a copy. With `to_disk`, they are
    /// written at once whatever their size.
    #[pyo3(signature = (key, frames, to_disk = false))]
    fn put_serialized(&self, py: Python<'_>, key: &[u8], frames: &Bound<'_, PyAny>, to_disk: bool) -> PyResult<()> {
        let s = self.inner()?;
        let frames = own_frames(py, frames)?;
        py.allow_threads(|| if to_disk { s.put_serialized_on_disk(key, frames) } else { s.put_serialized(key, frames) })
            .map_err(|e| to_py_err(py, e))
    }

    /// The memory target (settable: the next put or read back evicts down to it).
    #[getter]
    fn get_target(&self) -> PyResult<u64> {
        Ok(self.inner()?.target())
    }

    #[setter]
    fn set_target(&self, bytes: u64) -> PyResult<()> {
        self.inner()?.set_target(bytes);
        Ok(())
    }

    /// Bytes of process memory (RSS) above which a put or a read back also evicts, until the weight
    /// evicted covers the excess (`engine/src/store/pressure.rs`); `None`: off (the default).
    #[getter]
    fn get_process_target(&self) -> PyResult<Option<u64>> {
        Ok(self.inner()?.process_target())
    }

    #[setter]
    fn set_process_target(&self, bytes: Option<u64>) -> PyResult<()> {
        self.inner()?.set_process_target(bytes);
        Ok(())
    }

    /// Bytes of process memory (RSS) above which process memory is relieved (down to
    /// `process_target`): dask's `spill` threshold; `None`: `process_target` itself.
    #[getter]
    fn get_process_trigger(&self) -> PyResult<Option<u64>> {
        Ok(self.inner()?.process_trigger())
    }

    #[setter]
    fn set_process_trigger(&self, bytes: Option<u64>) -> PyResult<()> {
        self.inner()?.set_process_trigger(bytes);
        Ok(())
    }

    /// Room in memory for a value of `nbytes` arriving from a peer, if the store keeps it there
    /// (engine/src/store/receive.rs, `Store::admit`: it fits under the target and the process's
    /// headroom, counting what was admitted before and not yet released); None if it is to go
    /// straight to disk (`fetch_into_store`). The room is held until the `Admission` is released
    /// or collected.
    fn admit(&self, py: Python<'_>, nbytes: u64) -> PyResult<Option<Admission>> {
        let s = self.arc()?;
        let admitted = py.allow_threads(|| s.admit(nbytes));
        Ok(admitted.then(|| Admission { held: std::sync::Mutex::new(Some((s, nbytes))) }))
    }

    /// Bytes of RSS above `process_target` that evicting was found not to bring down (memory the
    /// process holds elsewhere): checks evict only for the RSS above it.
    #[getter]
    fn process_out_of_reach(&self) -> PyResult<u64> {
        Ok(self.inner()?.process_out_of_reach())
    }

    /// `(keys in memory, keys on disk)`, each in the order the keys entered that place.
    #[allow(clippy::type_complexity)]
    fn keys_by_place<'py>(&self, py: Python<'py>) -> PyResult<(Vec<Bound<'py, PyBytes>>, Vec<Bound<'py, PyBytes>>)> {
        let s = self.inner()?;
        let (mem, disk) = py.allow_threads(|| s.keys_by_place());
        let b = |v: Vec<Vec<u8>>| v.iter().map(|k| PyBytes::new(py, k)).collect();
        Ok((b(mem), b(disk)))
    }

    /// `(entries in memory, entries on disk)`.
    fn counts(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        let s = self.inner()?;
        Ok(py.allow_threads(|| s.counts()))
    }

    /// Threads waiting in `key`'s slot for another's deserialization of it (for tests).
    fn _waiters(&self, key: &[u8]) -> PyResult<u32> {
        Ok(self.inner()?.waiters(key))
    }

    /// The serialized bytes of `key`'s value if it is on disk, else None.
    fn spilled_bytes(&self, py: Python<'_>, key: &[u8]) -> PyResult<Option<u64>> {
        let s = self.inner()?;
        Ok(py.allow_threads(|| s.spilled_bytes(key)))
    }

    /// The spills that did not happen since the last call (with `report_failures=True`):
    /// `[(key, kind, exception or None)]`, kind `"max_spill"`, `"serialize"` (the codec's own
    /// exception) or `"disk"` (an OSError or SpillwayError).
    #[allow(clippy::type_complexity)]
    fn take_failures(&self, py: Python<'_>) -> PyResult<Vec<(Py<PyBytes>, &'static str, Option<PyObject>)>> {
        let s = self.inner()?;
        let failures = s.take_failures();
        Ok(failures
            .into_iter()
            .map(|f| {
                let kind = match f.kind {
                    SpillFailureKind::MaxSpill => "max_spill",
                    SpillFailureKind::Serialize => "serialize",
                    SpillFailureKind::Disk => "disk",
                };
                let exc = f.error.map(|e| codec_cause(py, e).into_value(py).into_any());
                (PyBytes::new(py, &f.key).unbind(), kind, exc)
            })
            .collect())
    }

    /// `(records, payload bytes)` of the logs: their live records (values on disk and the copies
    /// that values read back keep) and their serialized bytes.
    #[getter]
    fn log_records(&self, py: Python<'_>) -> PyResult<(usize, u64)> {
        let s = self.inner()?;
        let m = py.allow_threads(|| s.metrics());
        Ok((s.log_info().iter().map(|l| l.records).sum(), m.spilled_memory_bytes))
    }

    /// Write what the log holds back (write-behind) and fdatasync it.
    fn sync(&self, py: Python<'_>) -> PyResult<()> {
        let s = self.inner()?;
        py.allow_threads(|| s.sync()).map_err(to_py)
    }

    /// Why the log refuses writes (an earlier write or sync failed), or None.
    #[getter]
    fn read_only(&self) -> PyResult<Option<String>> {
        Ok(self.inner()?.read_only())
    }

    /// The object of `key` (KeyError if absent), deserialized once if it is held as frames or on
    /// disk, and kept in memory unless heavier than the target.
    fn get(&self, py: Python<'_>, key: &[u8]) -> PyResult<Py<PyAny>> {
        let s = self.inner()?;
        match py.allow_threads(|| s.get(key)) {
            Ok(Some(v)) => Ok(v.clone_ref(py)),
            Ok(None) => Err(key_error(py, key)),
            Err(e) => Err(to_py_err(py, e)),
        }
    }

    /// The pickled frames of `key` as read-only memoryviews (KeyError if absent), never
    /// unpickling: an object is pickled, frames are returned as they are, a record is read. With
    /// `promote`, the value moves as a `get` would move it (from disk back into memory, as frames,
    /// unless heavier than the target).
    #[pyo3(signature = (key, promote = false))]
    fn get_serialized<'py>(&self, py: Python<'py>, key: &[u8], promote: bool) -> PyResult<Bound<'py, PyList>> {
        let s = self.inner()?;
        let got = py.allow_threads(|| if promote { s.get_serialized_promoting(key) } else { s.get_serialized(key) });
        match got {
            Ok(Some(f)) => frames_to_list(py, f, false),
            Ok(None) => Err(key_error(py, key)),
            Err(e) => Err(to_py_err(py, e)),
        }
    }

    /// Forget `key` in every tier; True if it was there.
    fn remove(&self, py: Python<'_>, key: &[u8]) -> PyResult<bool> {
        let s = self.inner()?;
        py.allow_threads(|| s.remove(key)).map_err(to_py)
    }

    /// Evict the least recently used value in memory to disk, even below the target. Returns its
    /// weight, or -1 if nothing could be evicted (nothing in memory, or its spill failed).
    fn evict(&self, py: Python<'_>) -> PyResult<i64> {
        let s = self.inner()?;
        let got = py.allow_threads(|| s.evict_one()).map_err(|e| to_py_err(py, e))?;
        Ok(got.map_or(-1, |w| w as i64))
    }

    /// The object of `key` without changing its tier, its place in the LRU order or the metrics
    /// (KeyError if absent): for inspection. A value held as frames or on disk is deserialized for
    /// this call alone.
    fn peek(&self, py: Python<'_>, key: &[u8]) -> PyResult<Py<PyAny>> {
        let s = self.inner()?;
        match py.allow_threads(|| s.peek(key)) {
            Ok(Some(v)) => Ok(v.clone_ref(py)),
            Ok(None) => Err(key_error(py, key)),
            Err(e) => Err(to_py_err(py, e)),
        }
    }

    /// Evict least recently used values, whatever the target, until `nbytes` of weight have left
    /// memory or nothing more can (for process memory above its limit), never `spare` (the key
    /// just set or read). Returns the weight evicted.
    #[pyo3(signature = (nbytes, spare = None))]
    fn evict_bytes(&self, py: Python<'_>, nbytes: u64, spare: Option<&[u8]>) -> PyResult<u64> {
        let s = self.inner()?;
        py.allow_threads(|| s.evict_bytes(nbytes, spare)).map_err(|e| to_py_err(py, e))
    }

    /// For tests, on a store opened with `backend="sim"`: script a fault of the simulated disk of
    /// log number `log` (see `logs`; by default the one spills go to), as `Log._inject_fault` does.
    #[pyo3(signature = (op, after, kind, sticky = false, log = None))]
    fn _inject_fault(&self, op: &str, after: u64, kind: &str, sticky: bool, log: Option<usize>) -> PyResult<()> {
        let fault = crate::fault(op, after, kind, sticky)?;
        self.sim_disk(log, |sim| sim.inject(fault))
    }

    /// For tests: remove the faults `_inject_fault` scripted on log number `log` (by default the one
    /// spills go to).
    #[pyo3(signature = (log = None))]
    fn _clear_faults(&self, log: Option<usize>) -> PyResult<()> {
        self.sim_disk(log, |sim| sim.clear_faults())
    }

    /// The store's logs, oldest first, as `(directory, why it is read-only or None, records)`: the
    /// last is the one spills go to; the others are logs a failed write left read-only, which keep
    /// serving their records.
    #[getter]
    fn logs(&self, py: Python<'_>) -> PyResult<Vec<(std::path::PathBuf, Option<String>, usize)>> {
        let s = self.inner()?;
        Ok(py.allow_threads(|| s.log_info().into_iter().map(|l| (l.dir, l.read_only, l.records)).collect()))
    }

    /// `"materialized"`, `"serialized"`, `"compressed"` or `"disk"`; None if absent.
    fn tier(&self, py: Python<'_>, key: &[u8]) -> PyResult<Option<&'static str>> {
        let s = self.inner()?;
        Ok(py.allow_threads(|| s.tier(key)).map(|t| t.name()))
    }

    fn __contains__(&self, py: Python<'_>, key: &[u8]) -> PyResult<bool> {
        let s = self.inner()?;
        Ok(py.allow_threads(|| s.contains(key)))
    }

    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        let s = self.inner()?;
        Ok(py.allow_threads(|| s.len()))
    }

    /// Every key, in no order.
    fn keys<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let s = self.inner()?;
        let keys = py.allow_threads(|| s.keys());
        Ok(keys.iter().map(|k| PyBytes::new(py, k)).collect())
    }

    /// Weight of what is in memory.
    #[getter]
    fn memory_bytes(&self, py: Python<'_>) -> PyResult<u64> {
        let s = self.inner()?;
        Ok(py.allow_threads(|| s.memory_bytes()))
    }

    /// dask's `spilled_total`: `(weight, serialized bytes)`, the weight of the values that are on
    /// disk only (each one's weight when it was last in memory: what dask subtracts from the managed
    /// memory it counts in memory) and the serialized bytes of every record on disk, the copies that
    /// values read back keep included (what dask shows as spilled).
    #[getter]
    fn spilled(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        let s = self.inner()?;
        let m = py.allow_threads(|| s.metrics());
        Ok((m.spilled_weight, m.spilled_memory_bytes))
    }

    /// Cumulative metrics with dask's labels: `{(activity, unit): value}` for activities
    /// `serialize`, `deserialize`, `disk-write`, `disk-read`, `memory-read`, `compress`,
    /// `decompress` and units `count`, `bytes` and `seconds`.
    fn metrics<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner()?;
        let m = py.allow_threads(|| s.metrics());
        let d = PyDict::new(py);
        for a in Activity::ALL {
            let st = m.of(a);
            d.set_item(PyTuple::new(py, [a.name(), "count"])?, st.count)?;
            d.set_item(PyTuple::new(py, [a.name(), "bytes"])?, st.bytes)?;
            d.set_item(PyTuple::new(py, [a.name(), "seconds"])?, st.ns as f64 * 1e-9)?;
        }
        Ok(d)
    }

    /// The I/O backend in use (`"uring"`, `"portable"`, ...).
    #[getter]
    fn backend(&self) -> &'static str {
        self.backend
    }

    /// The log's compression of spilled values: `"none"` or `"lz4"`.
    #[getter]
    fn compression(&self) -> PyResult<&'static str> {
        Ok(match self.inner()?.config().log.compression {
            Compression::None => "none",
            Compression::Lz4 => "lz4",
        })
    }

    /// Recompute the accounting from the entries; ValueError naming the difference (for tests).
    fn check_accounting(&self, py: Python<'_>) -> PyResult<()> {
        let s = self.inner()?;
        py.allow_threads(|| s.check_accounting()).map_err(PyValueError::new_err)
    }

    /// Close the store. Idempotent; calls running on other threads finish first (the last of them
    /// closes the log).
    fn close(&self, py: Python<'_>) {
        let granted = self.granted.lock().unwrap_or_else(PoisonError::into_inner).take();
        let taken = self.inner.write().unwrap_or_else(PoisonError::into_inner).take();
        py.allow_threads(move || drop(granted));
        // Dropping the store drops its Python values (deferred by pyo3, without the GIL) and joins
        // the io_uring driver: without the GIL. Calls running on other threads hold the store until
        // they return; the last of them drops it.
        py.allow_threads(move || drop(taken));
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _t: PyObject, _v: PyObject, _tb: PyObject) {
        self.close(py)
    }
}

/// What the stores of this process did on the calling thread since the last call on it:
/// `[(activity, unit, value)]` for what moved (seconds as floats), dask's labels. A store call does
/// its work on its caller's thread, so taken after each call this is that call's own work, for a
/// caller that reports it under the activity that made the call (dask's `context_meter`).
#[pyfunction]
pub(crate) fn take_thread_metrics(py: Python<'_>) -> PyResult<Vec<(&'static str, &'static str, PyObject)>> {
    let mut out = Vec::new();
    for (a, st) in spillway::take_thread_metrics() {
        if st.count != 0 {
            out.push((a.name(), "count", st.count.into_pyobject(py)?.into_any().unbind()));
        }
        if st.bytes != 0 {
            out.push((a.name(), "bytes", st.bytes.into_pyobject(py)?.into_any().unbind()));
        }
        if st.ns != 0 {
            out.push((a.name(), "seconds", (st.ns as f64 * 1e-9).into_pyobject(py)?.into_any().unbind()));
        }
    }
    Ok(out)
}
