//! Peer transfer for Python: a server that sends granted values from any `Log` of the process, and
//! the client calls that fetch one into memory or straight into a `Log`. `spillway.dask` runs one
//! server per worker. Every call releases the GIL while it waits on the network or the disk.

use std::net::TcpListener;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use spillway::transfer::{self, Access, Client, Outgoing, Source, Ticket, TransferOptions};
use spillway::{AutoBackend, Error, SegmentLog, StoredValue};

use crate::store::{Store, StoreInner};
use crate::{frames_to_list, to_py, Inner, Log};

/// What a grant sends from: a `Log`'s records, or a `Store`'s values. Each `Log` and `Store` keeps
/// one of these while it is open (grants hold it weakly: a closed log or store is not kept for a
/// grant).
pub(crate) enum Granted {
    Log(Arc<Inner>),
    Store(Arc<StoreInner>),
}

impl Source for Granted {
    type Backend = AutoBackend;
    fn log_holding(&self, value: &StoredValue<<AutoBackend as spillway::Backend>::File>) -> &SegmentLog<AutoBackend> {
        match self {
            Granted::Log(l) => &l.log,
            Granted::Store(s) => Source::log_holding(&**s, value),
        }
    }
    fn outgoing(&self, key: &[u8]) -> spillway::Result<Option<Outgoing<<AutoBackend as spillway::Backend>::File>>> {
        match self {
            Granted::Log(l) => Source::outgoing(&l.log, key),
            Granted::Store(s) => Source::outgoing(&**s, key),
        }
    }
}

/// A caller's duration: a positive number of seconds, at most a year (anything longer is a
/// mistake, and unchecked it would overflow the deadlines made from it).
fn seconds(s: f64, what: &str) -> PyResult<Duration> {
    const YEAR: f64 = 365.0 * 24.0 * 3600.0;
    Duration::try_from_secs_f64(s).ok().filter(|d| !d.is_zero() && s <= YEAR).ok_or_else(|| {
        PyValueError::new_err(format!("{what} must be a positive number of seconds, at most a year, not {s}"))
    })
}

fn ticket_of(b: &[u8]) -> PyResult<Ticket> {
    Ticket::from_bytes(b)
        .ok_or_else(|| PyValueError::new_err(format!("a ticket is {} bytes, not {}", transfer::TICKET_BYTES, b.len())))
}

/// A transfer server on `host:port` (port 0: a free one) that sends values only to requests with
/// a ticket from [`TransferServer::grant`]: one key, once, within `lifetime` seconds. Values of
/// `splice_min_bytes` or more go file -> pipe -> socket with splice(2), never through memory;
/// smaller ones are copied a piece at a time.
#[pyclass(frozen, module = "spillway._core")]
pub(crate) struct TransferServer {
    access: Arc<Access<Granted>>,
    listener: TcpListener,
    host: String,
    port: u16,
    thread: Mutex<Option<JoinHandle<spillway::Result<()>>>>,
}

#[pymethods]
impl TransferServer {
    #[new]
    #[allow(clippy::too_many_arguments)] // Python keyword arguments
    #[pyo3(signature = (host = "127.0.0.1", port = 0, *, lifetime = 60.0, timeout = 30.0, max_connections = 64, max_connections_per_peer = 16, min_bytes_per_sec = 1 << 20, splice_min_bytes = 8 << 20))]
    fn new(
        py: Python<'_>,
        host: &str,
        port: u16,
        lifetime: f64,
        timeout: f64,
        max_connections: usize,
        max_connections_per_peer: usize,
        min_bytes_per_sec: u64,
        splice_min_bytes: u64,
    ) -> PyResult<Self> {
        crate::logging::install(py);
        let opts = TransferOptions {
            timeout: seconds(timeout, "timeout")?,
            max_connections,
            max_connections_per_peer,
            min_bytes_per_sec,
            splice_min_bytes,
            max_value_bytes: u64::MAX,
            ..TransferOptions::default()
        };
        let access = Arc::new(Access::grants_only(seconds(lifetime, "lifetime")?));
        let host = host.to_string();
        py.allow_threads(move || {
            let listener = TcpListener::bind((host.as_str(), port))
                .map_err(|e| to_py(Error::io("listen for transfers", None, e)))?;
            let bound = listener.local_addr().map_err(|e| to_py(Error::io("read the bound address", None, e)))?;
            let serving = listener.try_clone().map_err(|e| to_py(Error::io("clone the listener", None, e)))?;
            let served = access.clone();
            let thread = std::thread::Builder::new()
                .name("spillway-transfer".into())
                .spawn(move || transfer::serve(served, serving, opts))
                .map_err(|e| to_py(Error::io("start the transfer server", None, e)))?;
            Ok(TransferServer { access, listener, host, port: bound.port(), thread: Mutex::new(Some(thread)) })
        })
    }

    /// `(host, port)` the server listens on.
    #[getter]
    fn address(&self) -> (String, u16) {
        (self.host.clone(), self.port)
    }

    /// A one-time ticket (bytes) for `key`'s value in `log` (a `Log`, or a `Store`: then a value
    /// on disk is sent from its segment, one in memory from its frames) as it is now, or None if it
    /// does not have it; with `peer` (an IP address), redeemable from that address only. The record
    /// stays pinned (a delete or overwrite meanwhile does not change what is sent) until the ticket
    /// is redeemed, revoked or expires.
    #[pyo3(signature = (log, key, peer = None))]
    fn grant<'py>(
        &self,
        py: Python<'py>,
        log: &Bound<'py, PyAny>,
        key: &[u8],
        peer: Option<&str>,
    ) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let to = peer
            .map(|p| p.parse::<std::net::IpAddr>())
            .transpose()
            .map_err(|e| PyValueError::new_err(format!("peer {peer:?} is not an IP address: {e}")))?;
        let src = if let Ok(l) = log.downcast::<Log>() {
            l.get().granted()?
        } else if let Ok(s) = log.downcast::<Store>() {
            s.get().granted()?
        } else {
            return Err(pyo3::exceptions::PyTypeError::new_err("grant needs a Log or a Store"));
        };
        let t = py.allow_threads(|| self.access.grant(&src, key, to)).map_err(to_py)?;
        Ok(t.map(|t| PyBytes::new(py, &t.to_bytes())))
    }

    /// Drop a ticket's grant (and its pin) if it is still live; returns whether it was.
    fn revoke(&self, ticket: &[u8]) -> PyResult<bool> {
        Ok(self.access.revoke(&ticket_of(ticket)?))
    }

    /// Grants live now.
    #[getter]
    fn live_grants(&self) -> usize {
        self.access.live_grants()
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(&self, py: Python<'_>, _t: PyObject, _v: PyObject, _tb: PyObject) -> PyResult<()> {
        self.close(py)
    }

    /// Stop accepting, cut the transfers under way, drop every grant, and wait for the accept loop
    /// to end (idempotent): afterwards the server holds no `Log` and no record, so closing a log
    /// does not wait for a peer.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        self.access.close();
        let thread = self.thread.lock().unwrap_or_else(PoisonError::into_inner).take();
        let Some(thread) = thread else { return Ok(()) };
        py.allow_threads(|| {
            let _ = transfer::shutdown_listener(&self.listener);
            match thread.join() {
                Ok(r) => r.map_err(to_py),
                Err(_) => Ok(()), // a panic was reported by the thread itself
            }
        })
    }
}

impl Drop for TransferServer {
    fn drop(&mut self) {
        if self.thread.get_mut().unwrap_or_else(PoisonError::into_inner).is_some() {
            self.access.close();
            let _ = transfer::shutdown_listener(&self.listener);
        }
    }
}

/// Options of a fetch of a value of `nbytes` (its frames' total, as its sender announced it): the
/// stored form may be that plus the 64-byte gaps between frames, or lz4's expansion of it, and
/// nothing larger is accepted (or allocated).
fn client_options(
    timeout: f64,
    connect_timeout: Option<f64>,
    min_bytes_per_sec: u64,
    nbytes: u64,
) -> PyResult<TransferOptions> {
    let laid_out = nbytes.saturating_add(64 * spillway::MAX_FRAMES as u64);
    Ok(TransferOptions {
        timeout: seconds(timeout, "timeout")?,
        connect_timeout: connect_timeout.map(|t| seconds(t, "connect_timeout")).transpose()?,
        min_bytes_per_sec,
        max_value_bytes: laid_out.saturating_add(laid_out / 255 + 16),
        ..TransferOptions::default()
    })
}

/// A fetch of a value of `nbytes` (its frames' total, as its sender announced it) from the server at
/// `address` with `ticket`, as the `fetch*` functions take it from Python.
struct Fetch {
    address: (String, u16),
    ticket: Ticket,
    opts: TransferOptions,
    nbytes: u64,
}

impl Fetch {
    fn new(
        address: (String, u16),
        ticket: &[u8],
        nbytes: u64,
        timeout: f64,
        connect_timeout: Option<f64>,
        min_bytes_per_sec: u64,
    ) -> PyResult<Fetch> {
        let opts = client_options(timeout, connect_timeout, min_bytes_per_sec, nbytes)?;
        Ok(Fetch { address, ticket: ticket_of(ticket)?, opts, nbytes })
    }

    /// A client of the server that refuses a value whose frames do not add up to `nbytes` as its
    /// header arrives (`expect_frames_total`): nothing of it is stored, and a key's old value stays.
    fn connect(self) -> spillway::Result<Client> {
        let mut c = Client::connect((self.address.0.as_str(), self.address.1), self.ticket, self.opts)?;
        c.expect_frames_total(self.nbytes);
        Ok(c)
    }
}

/// The error for a received value whose frames do not add up to what its sender announced.
fn wrong_size(announced: u64, got: u64) -> PyErr {
    crate::SpillwayError::new_err(format!("the peer announced {announced} bytes and sent a value of {got}"))
}

/// Fetch `key`, a value of `nbytes` (its frames' total), from the server at `(host, port)` with
/// `ticket`, into memory: its frames as writable memoryviews, checked against the sender's crc. A
/// value larger than announced is refused before it is read; one whose frames add up to anything
/// else is an error. None if the server has no such key.
/// `connect_timeout` bounds connecting and the server's greeting (default: `timeout`).
#[pyfunction]
#[pyo3(signature = (address, ticket, key, nbytes, *, timeout = 30.0, connect_timeout = None, min_bytes_per_sec = 1 << 20))]
#[allow(clippy::too_many_arguments)] // Python keyword arguments
fn fetch<'py>(
    py: Python<'py>,
    address: (String, u16),
    ticket: &[u8],
    key: &[u8],
    nbytes: u64,
    timeout: f64,
    connect_timeout: Option<f64>,
    min_bytes_per_sec: u64,
) -> PyResult<Option<Bound<'py, PyList>>> {
    crate::logging::install(py);
    let fetch = Fetch::new(address, ticket, nbytes, timeout, connect_timeout, min_bytes_per_sec)?;
    let got = py.allow_threads(|| fetch.connect()?.get(key)).map_err(to_py)?;
    match got {
        Some(frames) if frames.total_len() != nbytes => Err(wrong_size(nbytes, frames.total_len())),
        got => got.map(|frames| frames_to_list(py, frames, true)).transpose(),
    }
}

/// Fetch `key`, a value of `nbytes` (its frames' total), from the server at `(host, port)` with
/// `ticket` straight into `log` under `as_key`, in its stored form, never holding the value in
/// memory. Returns the value's payload bytes (as `Log.put` does), or None if the server has no
/// such key. `nbytes` is reserved against the log's `max_disk_bytes` first; a value larger than
/// that is refused before it is read, one whose frames add up to anything else is an error. On any
/// failure nothing is stored and `as_key`'s old value, if any, stays.
/// `connect_timeout` bounds connecting and the server's greeting (default: `timeout`).
#[pyfunction]
#[pyo3(signature = (log, address, ticket, key, as_key, nbytes, *, timeout = 30.0, connect_timeout = None, min_bytes_per_sec = 1 << 20))]
#[allow(clippy::too_many_arguments)] // Python keyword arguments
fn fetch_into(
    py: Python<'_>,
    log: &Log,
    address: (String, u16),
    ticket: &[u8],
    key: &[u8],
    as_key: &[u8],
    nbytes: u64,
    timeout: f64,
    connect_timeout: Option<f64>,
    min_bytes_per_sec: u64,
) -> PyResult<Option<u64>> {
    crate::logging::install(py);
    let fetch = Fetch::new(address, ticket, nbytes, timeout, connect_timeout, min_bytes_per_sec)?;
    let inner = log.inner()?;
    py.allow_threads(|| {
        let _turn = inner.claim(as_key);
        let reserved = inner.reserve(as_key, nbytes, "receiving")?;
        let found = fetch.connect().and_then(|mut c| c.get_into(key, &inner.log, as_key)).map_err(to_py)?;
        if !found {
            return Ok(None);
        }
        reserved.stored(as_key);
        Ok(Some(nbytes))
    })
}

/// Fetch `key`, a value of `nbytes` (its frames' total), from the server at `(host, port)` with
/// `ticket` straight onto `store`'s disk under `as_key`, never holding it in memory (unless
/// max_spill has no room for it: then into memory, serialized). Returns the value's bytes, or None
/// if the server has no such key. A value whose frames add up to anything else than `nbytes` is
/// refused and not kept; on any failure `as_key`'s old value, if any, stays.
/// `connect_timeout` bounds connecting and the server's greeting (default: `timeout`).
#[pyfunction]
#[pyo3(signature = (store, address, ticket, key, as_key, nbytes, *, timeout = 30.0, connect_timeout = None, min_bytes_per_sec = 1 << 20))]
#[allow(clippy::too_many_arguments)] // Python keyword arguments
fn fetch_into_store(
    py: Python<'_>,
    store: &Store,
    address: (String, u16),
    ticket: &[u8],
    key: &[u8],
    as_key: &[u8],
    nbytes: u64,
    timeout: f64,
    connect_timeout: Option<f64>,
    min_bytes_per_sec: u64,
) -> PyResult<Option<u64>> {
    crate::logging::install(py);
    let fetch = Fetch::new(address, ticket, nbytes, timeout, connect_timeout, min_bytes_per_sec)?;
    let s = store.arc()?;
    py.allow_threads(|| {
        let found = fetch.connect().and_then(|mut c| c.stream_into_store(key, &s, as_key)).map_err(to_py)?;
        Ok(found.then_some(nbytes))
    })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<TransferServer>()?;
    m.add_function(wrap_pyfunction!(fetch, m)?)?;
    m.add_function(wrap_pyfunction!(fetch_into, m)?)?;
    m.add_function(wrap_pyfunction!(fetch_into_store, m)?)?;
    Ok(())
}
