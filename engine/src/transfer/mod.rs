//! Peer transfer: send stored values to another spillway over TCP, without reading them into memory.
//!
//! The protocol is in `docs/wire.md`. In short: both sides open with `SPWY` and a version; the client
//! sends `GET key` requests; the server answers each with the value's *stored form* (lz4 flag, frame
//! lengths, laid-out length, stored length, payload crc) followed by the stored bytes, so the receiver
//! verifies them and can keep them as they are. Every length is checked against a bound before
//! anything is allocated.
//!
//! Send path: the payload goes file -> pipe -> socket with `splice(2)`, a pipe's worth (1 MiB) at a
//! time, so the sender's memory stays flat whatever the value size; `copy` mode reads the stored
//! payload into memory and writes it (the baseline, and the path for backends without descriptors).
//! Receive paths: into memory ([`Client::get`]), straight into a segment log in 1 MiB chunks
//! ([`Client::get_into`], [`SegmentLog::put_stream`]), or streamed to a writer ([`Client::get_to`]).
//!
//! Every request carries a [`Ticket`] that the server's [`Access`] must accept: a standing ticket
//! for every key, or a one-time grant for one key (see [`access`]). Limits: connections in total
//! and per peer address, a deadline for each request's head and one for each payload, bounds on
//! every length before anything is allocated.
//!
//! Connections are served by blocking threads (one per connection, bounded). A peer that hangs up
//! mid-value ends that connection only; a partial value is never published.

pub mod access;

pub use access::{Access, Ticket, MAX_GRANTS, TICKET_BYTES};

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::format::{self, MAX_FRAMES, MAX_KEY_BYTES};
use crate::log::{SegmentLog, StoredValue, StreamedValue};
use crate::store::{Codec, Store, Tier};
use crate::stored;
use crate::value::Frames;

/// Protocol version spoken by this build.
pub const PROTOCOL_VERSION: u16 = 2;
const MAGIC: [u8; 4] = *b"SPWY";
const OP_GET: u8 = 1;
const ST_VALUE: u8 = 0;
const ST_NOT_FOUND: u8 = 1;
const ST_ERROR: u8 = 2;
const MAX_ERROR_BYTES: usize = 4096;
/// Bytes moved per splice round (the pipe is resized to this where the system allows).
const PIPE_BYTES: usize = 1 << 20;

/// Settings of a server or a client.
#[derive(Debug, Clone)]
pub struct TransferOptions {
    /// Largest stored value accepted (receiving) or sent.
    pub max_value_bytes: u64,
    /// Server: read each payload into memory and write it, instead of splicing it.
    pub copy: bool,
    /// Socket read and write timeout.
    pub timeout: Duration,
    /// Server: connections served at once; more are refused with an error response (at most
    /// [`MAX_REFUSING`] at a time; beyond that they are closed unanswered).
    pub max_connections: usize,
    /// Server: connections served at once from one peer address (refused like those over
    /// `max_connections`), so that one peer cannot hold every place.
    pub max_connections_per_peer: usize,
    /// Server: values smaller than this are copied (read and written 1 MiB at a time)
    /// rather than spliced. Measured on loopback into a receiving log: splice ran at 0.35x the copy
    /// path for 1 MiB values, 1.1x for 64 MiB and 5.4x for 1 GiB when copying read a value whole
    /// (docs/benchmarks.md has the current numbers).
    pub splice_min_bytes: u64,
    /// Slowest average rate, in bytes per second, at which a value's payload may arrive (client)
    /// or leave (server); 0 for no limit. A payload of `n` bytes must be through within
    /// `timeout + n / min_bytes_per_sec`, or the transfer fails with `TimedOut`. The socket
    /// timeout bounds each call only: a peer that sends (or reads) a byte every few seconds would
    /// otherwise hold the transfer, its connection slot and, for a value streamed into a log, the
    /// log's writer lock, for good.
    pub min_bytes_per_sec: u64,
}

impl TransferOptions {
    /// How long a payload of `bytes` may take (see [`TransferOptions::min_bytes_per_sec`]);
    /// `None` for no limit.
    fn allowance(&self, bytes: u64) -> Option<Duration> {
        if self.min_bytes_per_sec == 0 {
            return None;
        }
        let pace = Duration::from_secs_f64((bytes as f64 / self.min_bytes_per_sec as f64).min(1e9));
        Some(self.timeout.saturating_add(pace))
    }
}

/// A socket (or any reader or writer) whose calls fail with `TimedOut` once an allowance, counted
/// from its first call, has passed: it bounds a whole payload, where the socket timeout bounds each
/// call. Counting from the first call leaves out a wait before it (a receiving log's writer lock).
struct Paced<'a, S> {
    inner: &'a mut S,
    allowance: Option<Duration>,
    deadline: Option<Instant>,
}

impl<'a, S> Paced<'a, S> {
    fn new(inner: &'a mut S, allowance: Option<Duration>) -> Self {
        Paced { inner, allowance, deadline: None }
    }

    fn check(&mut self) -> io::Result<()> {
        let Some(allowance) = self.allowance else { return Ok(()) };
        let deadline = *self.deadline.get_or_insert_with(|| Instant::now() + allowance);
        check_deadline(Some(deadline))
    }
}

/// `TimedOut` once `deadline` has passed.
fn check_deadline(deadline: Option<Instant>) -> io::Result<()> {
    if deadline.is_some_and(|d| Instant::now() > d) {
        return Err(io::Error::new(
            io::ErrorKind::TimedOut,
            "the value was not through in time (timeout + size / min_bytes_per_sec)",
        ));
    }
    Ok(())
}

impl<S: Read> Read for Paced<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.check()?;
        self.inner.read(buf)
    }
}

impl<S: Write> Write for Paced<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.check()?;
        self.inner.write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

impl Default for TransferOptions {
    fn default() -> Self {
        TransferOptions {
            max_value_bytes: 4 << 30,
            copy: false,
            timeout: Duration::from_secs(30),
            max_connections: 64,
            max_connections_per_peer: 16,
            splice_min_bytes: 8 << 20,
            min_bytes_per_sec: 1 << 20,
        }
    }
}

fn io_err(op: &'static str, e: io::Error) -> Error {
    Error::io(op, None, e)
}

/// A received payload whose crc32 differs from the one its header announced.
fn received_crc_mismatch(what: &'static str, expected: u32, actual: u32) -> Error {
    Error::ChecksumMismatch { segment: 0, offset: 0, what, expected, actual }
}

fn proto(msg: impl Into<String>) -> Error {
    Error::Protocol(msg.into())
}

fn hello() -> [u8; 8] {
    let mut h = [0u8; 8];
    h[..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    h
}

fn check_hello(h: &[u8; 8]) -> Result<()> {
    if h[..4] != MAGIC {
        return Err(proto("peer is not a spillway transfer endpoint (bad magic)"));
    }
    let v = u16::from_le_bytes([h[4], h[5]]);
    if v != PROTOCOL_VERSION {
        return Err(Error::UnsupportedVersion {
            what: "transfer protocol",
            found: v as u32,
            supported: PROTOCOL_VERSION as u32,
        });
    }
    Ok(())
}

/// The fixed part of a VALUE response after its status byte.
fn value_header(m: &StreamedValue) -> Vec<u8> {
    let mut h = Vec::with_capacity(32 + 8 * m.frame_lens.len());
    h.push(u8::from(m.lz4));
    h.extend_from_slice(&[0u8; 3]);
    h.extend_from_slice(&(m.frame_lens.len() as u32).to_le_bytes());
    h.extend_from_slice(&m.raw_len.to_le_bytes());
    h.extend_from_slice(&m.stored_len.to_le_bytes());
    h.extend_from_slice(&m.payload_crc.to_le_bytes());
    h.extend_from_slice(&[0u8; 4]);
    for l in &m.frame_lens {
        h.extend_from_slice(&l.to_le_bytes());
    }
    h
}

/// Parse the header of a VALUE response (after its status byte) from `r`, applying every bound the
/// client applies (`max` stored bytes). Public for fuzzing and for tools speaking the protocol.
pub fn read_value_header(r: &mut impl Read, max: u64) -> Result<StreamedValue> {
    let mut h = [0u8; 32];
    r.read_exact(&mut h).map_err(|e| io_err("receive value header", e))?;
    let flags = h[0];
    if flags & !1 != 0 || h[1..4] != [0, 0, 0] {
        return Err(proto(format!("unknown value flags {flags:#x}")));
    }
    let n = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes")) as usize;
    let raw_len = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
    let stored_len = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
    let payload_crc = u32::from_le_bytes(h[24..28].try_into().expect("4 bytes"));
    if n > MAX_FRAMES {
        return Err(proto(format!("{n} frames is over the limit of {MAX_FRAMES}")));
    }
    if stored_len > max || raw_len > max.saturating_add(64 * n as u64) {
        return Err(proto(format!("value of {stored_len} stored bytes is over the limit of {max}")));
    }
    let mut lens = vec![0u8; 8 * n];
    r.read_exact(&mut lens).map_err(|e| io_err("receive frame table", e))?;
    let frame_lens: Vec<u64> =
        lens.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
    if format::frame_layout(frame_lens.iter().copied()).map(|(_, l)| l) != Some(raw_len) {
        return Err(proto("frame lengths do not lay out to the announced length"));
    }
    let lz4 = flags & 1 != 0;
    if !lz4 && stored_len != raw_len {
        return Err(proto("uncompressed value whose stored length differs from its length"));
    }
    // Before any receive path allocates `raw_len` for the decompressed value.
    if lz4 && !format::lz4_lengths_fit(stored_len, raw_len) {
        return Err(proto(format!("lz4 value of {stored_len} bytes cannot be the compression of {raw_len}")));
    }
    Ok(StreamedValue { lz4, frame_lens, raw_len, stored_len, payload_crc })
}

/// What a server sends values from: a [`SegmentLog`] (everything on disk) or a [`Store`] (values on
/// disk, serialized in memory, or materialized).
pub trait Source: Send + Sync + 'static {
    /// The backend of the log that holds spilled values.
    type Backend: Backend;
    /// That log.
    fn log(&self) -> &SegmentLog<Self::Backend>;
    /// How `key`'s value goes on the wire, or `None` if there is no such key.
    fn outgoing(&self, key: &[u8]) -> Result<Option<Outgoing<<Self::Backend as Backend>::File>>>;
}

/// A value on its way out.
pub enum Outgoing<F> {
    /// In the log: the stored form is sent as it is on disk (spliced when large).
    Stored(StoredValue<F>),
    /// In memory: the frames are sent from their buffers, laid out as on disk (uncompressed).
    Frames(Frames),
}

impl<B: Backend> Source for SegmentLog<B> {
    type Backend = B;
    fn log(&self) -> &SegmentLog<B> {
        self
    }
    fn outgoing(&self, key: &[u8]) -> Result<Option<Outgoing<B::File>>> {
        match self.stored_value(key) {
            Ok(v) => Ok(v.map(Outgoing::Stored)),
            // A record pending under write-behind that the log could not write (it is poisoned, or
            // the file system is full) is only in memory: send it from there.
            Err(e) if matches!(e, Error::Poisoned { .. }) || e.is_no_space() => {
                Ok(self.get(key)?.map(Outgoing::Frames))
            }
            Err(e) => Err(e),
        }
    }
}

impl<C: Codec, B: Backend> Source for Store<C, B> {
    type Backend = B;
    fn log(&self) -> &SegmentLog<B> {
        Store::log(self)
    }
    /// A spilled value is sent from its segment (never read back into memory); a value in memory is
    /// sent from its serialized frames (a materialized one is serialized once for this).
    fn outgoing(&self, key: &[u8]) -> Result<Option<Outgoing<B::File>>> {
        if self.tier(key) == Some(Tier::Disk) {
            match Store::log(self).stored_value(key) {
                Ok(Some(sv)) => return Ok(Some(Outgoing::Stored(sv))),
                // Only in memory (write-behind, and the log could not write it): served below.
                Ok(None) => {}
                Err(e) if matches!(e, Error::Poisoned { .. }) || e.is_no_space() => {}
                Err(e) => return Err(e),
            }
        }
        Ok(self.get_serialized(key)?.map(Outgoing::Frames))
    }
}

/// Connections over `max_connections` that [`serve`] answers "too many connections" at once, each
/// from a short-lived thread (it waits up to a second for the client's greeting). Beyond that, such
/// connections are closed unanswered: a flood costs no more than this many threads.
pub const MAX_REFUSING: usize = 8;

/// Serve what `access` lets through on `listener`: one thread per connection, at most
/// `opts.max_connections` at once and `opts.max_connections_per_peer` from one address.
/// Returns `Ok(())` once the listener is shut down ([`shutdown_listener`] on a clone of it, from
/// another thread), or the error if `accept` fails in a way that will not pass (the descriptor is
/// not a listening socket). Failures that concern one connection or pass (an aborted handshake,
/// out of descriptors or memory) are logged and serving goes on.
pub fn serve<S: Source>(access: Arc<Access<S>>, listener: TcpListener, opts: TransferOptions) -> Result<()> {
    /// A place in a count of threads (`max_connections`, [`MAX_REFUSING`]), given back when the
    /// thread ends however it ends (a panic included), or with its closure if it never starts.
    struct Held(Arc<AtomicUsize>);
    impl Drop for Held {
        fn drop(&mut self) {
            self.0.fetch_sub(1, Ordering::SeqCst);
        }
    }
    /// A place in the count of one peer address's connections.
    struct PeerHeld(Arc<Mutex<HashMap<IpAddr, usize>>>, IpAddr);
    impl Drop for PeerHeld {
        fn drop(&mut self) {
            let mut peers = self.0.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(n) = peers.get_mut(&self.1) {
                *n -= 1;
                if *n == 0 {
                    peers.remove(&self.1);
                }
            }
        }
    }
    let active = Arc::new(AtomicUsize::new(0));
    let refusing = Arc::new(AtomicUsize::new(0));
    let peers: Arc<Mutex<HashMap<IpAddr, usize>>> = Arc::default();
    loop {
        let (stream, peer) = match listener.accept() {
            Ok(c) => c,
            // shutdown(2) on a listening socket makes accept fail with EINVAL: the way to stop.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EBADF | libc::ENOTSOCK | libc::EOPNOTSUPP)) => {
                return Err(io_err("accept", e));
            }
            Err(e) => {
                // Out of descriptors, an aborted handshake...: this connection only. Back off a little
                // so a persistent condition does not spin.
                log::warn!("transfer: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let peer_held = {
            let mut p = peers.lock().unwrap_or_else(PoisonError::into_inner);
            let n = p.entry(peer.ip()).or_insert(0);
            if *n < opts.max_connections_per_peer {
                *n += 1;
                Some(PeerHeld(peers.clone(), peer.ip()))
            } else {
                None
            }
        };
        let why = match &peer_held {
            None => Some("too many connections from this peer"),
            Some(_) if active.fetch_add(1, Ordering::SeqCst) >= opts.max_connections => {
                active.fetch_sub(1, Ordering::SeqCst);
                Some("too many connections")
            }
            Some(_) => None,
        };
        if let Some(why) = why {
            drop(peer_held);
            if refusing.fetch_add(1, Ordering::SeqCst) >= MAX_REFUSING {
                // A flood: close it unanswered rather than start a thread per connection.
                refusing.fetch_sub(1, Ordering::SeqCst);
                log::debug!("transfer: closing {peer}: {why}, and too many being refused");
                continue;
            }
            // Refusing waits for the client's greeting (up to a second): not on the accept loop.
            let held = Held(refusing.clone());
            let refused = std::thread::Builder::new().name("spillway-refuse".into()).spawn(move || {
                let _held = held;
                let mut stream = stream;
                let _ = refuse(&mut stream, why);
            });
            if let Err(e) = refused {
                log::warn!("transfer: cannot start a thread to refuse {peer}: {e}");
            }
            continue;
        }
        let (access, opts, held) = (access.clone(), opts.clone(), (Held(active.clone()), peer_held));
        let spawned = std::thread::Builder::new().name(format!("spillway-serve-{peer}")).spawn(move || {
            let _held = held;
            if let Err(e) = serve_connection(&access, stream, &opts) {
                log::info!("transfer: connection from {peer} ended: {e}");
            }
        });
        if let Err(e) = spawned {
            log::warn!("transfer: cannot start a thread for {peer}: {e}");
        }
    }
}

/// Stop a [`serve`] loop running on `listener` (or on another handle of the same socket, such as the
/// one `TcpListener::try_clone` gives): `accept` then fails with EINVAL and `serve` returns `Ok`.
/// Connections being served run to their end.
pub fn shutdown_listener(listener: &TcpListener) -> io::Result<()> {
    rustix::net::shutdown(listener, rustix::net::Shutdown::Read).map_err(io::Error::from)
}

fn refuse(stream: &mut TcpStream, why: &str) -> io::Result<()> {
    // Read the client's greeting first: closing with unread data would reset the connection and the
    // client might never see the reason.
    stream.set_read_timeout(Some(Duration::from_secs(1)))?;
    let mut h = [0u8; 8];
    let _ = stream.read_exact(&mut h);
    send_refusal(stream, why)
}

/// Greeting and ERROR `why`, for a client whose greeting was read.
fn send_refusal(stream: &mut TcpStream, why: &str) -> io::Result<()> {
    let mut out = hello().to_vec();
    out.push(ST_ERROR);
    out.extend_from_slice(&(why.len() as u32).to_le_bytes());
    out.extend_from_slice(why.as_bytes());
    stream.write_all(&out)
}

/// Fill `buf` from `stream` before `deadline` (each read waits at most until then, and at most
/// `timeout`): a peer that trickles a message a byte at a time cannot stretch it past the deadline.
fn read_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant, timeout: Duration) -> io::Result<()> {
    let mut at = 0;
    let result = loop {
        if at == buf.len() {
            break Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            break Err(io::Error::new(io::ErrorKind::TimedOut, "the request was not through in time"));
        }
        if let Err(e) = stream.set_read_timeout(Some(left.min(timeout))) {
            break Err(e);
        }
        match stream.read(&mut buf[at..]) {
            Ok(0) => break Err(io::Error::new(io::ErrorKind::UnexpectedEof, "the peer closed mid-request")),
            Ok(n) => at += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut) => {}
            Err(e) => break Err(e),
        }
    };
    stream.set_read_timeout(Some(timeout))?;
    result
}

/// Bytes of a request before its key: op (1), ticket ([`TICKET_BYTES`]), key length (4).
const REQUEST_HEAD: usize = 1 + TICKET_BYTES + 4;

/// Serve one connection until the peer closes it (`Ok`) or breaks the protocol (`Err`, after an
/// error response where one can still be sent). The greeting, and each request from its first
/// byte to its last, must arrive within `opts.timeout`; a request `access` refuses is answered
/// "not authorized" and ends the connection.
pub fn serve_connection<S: Source>(access: &Access<S>, mut stream: TcpStream, opts: &TransferOptions) -> Result<()> {
    let Some(_serving) = access.enter(&stream) else { return Ok(()) }; // closed
    stream.set_read_timeout(Some(opts.timeout)).map_err(|e| io_err("set timeout", e))?;
    stream.set_write_timeout(Some(opts.timeout)).map_err(|e| io_err("set timeout", e))?;
    let _ = stream.set_nodelay(true);
    let peer = stream.peer_addr().ok().map(|a| a.ip());
    let mut h = [0u8; 8];
    read_by(&mut stream, &mut h, Instant::now() + opts.timeout, opts.timeout)
        .map_err(|e| io_err("receive hello", e))?;
    if let Err(e) = check_hello(&h) {
        let _ = send_refusal(&mut stream, &e.to_string()); // its greeting was just read
        return Err(e);
    }
    stream.write_all(&hello()).map_err(|e| io_err("send hello", e))?;
    let mut pipe = None;
    loop {
        let mut req = [0u8; REQUEST_HEAD];
        match stream.read(&mut req[..1]) {
            Ok(0) => return Ok(()), // the client is done
            Ok(_) => {}
            // A signal handler ran: a socket with timeouts is never restarted, whatever SA_RESTART.
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_err("receive request", e)),
        }
        let deadline = Instant::now() + opts.timeout;
        read_by(&mut stream, &mut req[1..], deadline, opts.timeout).map_err(|e| io_err("receive request", e))?;
        let ticket = Ticket::from_bytes(&req[1..1 + TICKET_BYTES]).expect("ticket-sized");
        let key_len = u32::from_le_bytes(req[1 + TICKET_BYTES..].try_into().expect("4 bytes")) as usize;
        if req[0] != OP_GET || key_len > MAX_KEY_BYTES {
            let e = proto(format!("malformed request (op {}, key of {key_len} bytes)", req[0]));
            let _ = send_error(&mut stream, &e.to_string());
            return Err(e);
        }
        let mut key = vec![0u8; key_len];
        read_by(&mut stream, &mut key, deadline, opts.timeout).map_err(|e| io_err("receive key", e))?;
        let Some(admitted) = access.admit(&ticket, &key, peer) else {
            let _ = send_error(&mut stream, NOT_AUTHORIZED);
            return Err(proto(format!("a request with ticket {ticket:?} was refused")));
        };
        let outgoing = match admitted.value {
            Some(v) => Ok(Some(v)),
            None => admitted.src.outgoing(&key),
        };
        send_outgoing(admitted.src.log(), &mut stream, opts, &mut pipe, outgoing)?;
    }
}

/// The message of the ERROR response to a request its server's [`Access`] refused.
pub const NOT_AUTHORIZED: &str = "not authorized";

/// Answer one request with `outgoing` (the source's answer for its key): VALUE, NOT_FOUND or ERROR.
fn send_outgoing<B: Backend>(
    log: &SegmentLog<B>,
    stream: &mut TcpStream,
    opts: &TransferOptions,
    pipe: &mut Option<Pipe>,
    outgoing: Result<Option<Outgoing<B::File>>>,
) -> Result<()> {
    let sv = match outgoing {
        Ok(Some(Outgoing::Stored(sv))) if sv.meta.stored_len <= opts.max_value_bytes => sv,
        Ok(Some(Outgoing::Stored(sv))) => {
            return send_error(stream, &format!("value of {} bytes is over the limit", sv.meta.stored_len));
        }
        Ok(Some(Outgoing::Frames(frames))) => {
            // A value held in memory was never checked by a log: the frame count and the laid-out
            // length (frames plus their 64-byte gaps) are what a client checks.
            let laid_out = format::frame_layout(frames.iter().map(|f| f.len() as u64)).map(|(_, n)| n);
            return match laid_out {
                _ if frames.len() > format::MAX_FRAMES => {
                    let msg = format!("value of {} frames is over the limit of {}", frames.len(), format::MAX_FRAMES);
                    send_error(stream, &msg)
                }
                Some(n) if n <= opts.max_value_bytes => {
                    send_frames(&mut Paced::new(stream, opts.allowance(n)), &frames)
                }
                _ => send_error(stream, &format!("value of {} bytes is over the limit", frames.total_len())),
            };
        }
        Ok(None) => return stream.write_all(&[ST_NOT_FOUND]).map_err(|e| io_err("send response", e)),
        Err(e) => {
            // The peer learns what failed; the server's log says where (paths stay here).
            log::warn!("transfer: serving a value failed: {e}");
            return send_error(stream, &e.peer_message());
        }
    };
    stream.write_all(&encode_value_response(&sv.meta)).map_err(|e| io_err("send value header", e))?;
    // splice(2) reads an O_DIRECT file with direct I/O, which refuses the payload's offset (only
    // 64-byte aligned): splice from a buffered descriptor of the same file instead (copy if there
    // is none). Looked at only for a value that is to be spliced.
    let fd = log.backend().as_fd(&sv.file).filter(|_| !opts.copy && sv.meta.stored_len >= opts.splice_min_bytes);
    let direct =
        fd.is_some_and(|fd| rustix::fs::fcntl_getfl(fd).map_or(true, |f| f.contains(rustix::fs::OFlags::DIRECT)));
    let buffered = match fd {
        Some(fd) if direct => reopen_buffered(fd).ok(),
        _ => None,
    };
    let splice_fd = match &buffered {
        Some(f) => Some(std::os::fd::AsFd::as_fd(f)),
        None if direct => None,
        None => fd,
    };
    let deadline = opts.allowance(sv.meta.stored_len).map(|a| Instant::now() + a);
    let sent = match splice_fd {
        Some(fd) => {
            if pipe.is_none() {
                *pipe = Some(make_pipe().map_err(|e| io_err("create pipe", e))?);
            }
            let (r, w) = pipe.as_ref().expect("just made");
            splice_out(fd, sv.payload_offset, sv.meta.stored_len, r, w, stream, deadline)
                .map_err(|e| io_err("splice value", e))
        }
        None => copy_out(log, &sv, stream, deadline),
    };
    if sent.is_err() {
        // Part of the value may have gone out (or be stuck in the pipe): the connection cannot
        // continue in step.
        let _ = stream.shutdown(Shutdown::Both);
    }
    sent
}

/// The copy path: the stored payload read and written [`PIPE_BYTES`] at a time (never the whole
/// value in memory), within `deadline`.
fn copy_out<B: Backend>(
    log: &SegmentLog<B>,
    sv: &StoredValue<B::File>,
    stream: &mut TcpStream,
    deadline: Option<Instant>,
) -> Result<()> {
    let mut at = 0u64;
    while at < sv.meta.stored_len {
        check_deadline(deadline).map_err(|e| io_err("send value", e))?;
        let n = (sv.meta.stored_len - at).min(PIPE_BYTES as u64);
        let part = log.read_stored_part(sv, at, n)?;
        stream.write_all(&part).map_err(|e| io_err("send value", e))?;
        at += n;
    }
    Ok(())
}

/// Send in-memory frames as an uncompressed VALUE: the same layout as on disk (each frame at a
/// 64-byte boundary, zeros between), written from the frames' own buffers.
fn send_frames(stream: &mut impl Write, frames: &Frames) -> Result<()> {
    const ZEROS: [u8; format::FRAME_ALIGN as usize] = [0; format::FRAME_ALIGN as usize];
    let frame_lens: Vec<u64> = frames.iter().map(|f| f.len() as u64).collect();
    let (offsets, total) = format::frame_layout(frame_lens.iter().copied()).expect("in-memory frames fit");
    let mut crc = crc32fast::Hasher::new();
    let mut at = 0u64;
    for (f, &o) in frames.iter().zip(&offsets) {
        crc.update(&ZEROS[..(o - at) as usize]);
        crc.update(f);
        at = o + f.len() as u64;
    }
    let meta = StreamedValue { lz4: false, frame_lens, raw_len: total, stored_len: total, payload_crc: crc.finalize() };
    stream.write_all(&encode_value_response(&meta)).map_err(|e| io_err("send value header", e))?;
    let mut at = 0u64;
    for (f, &o) in frames.iter().zip(&offsets) {
        stream.write_all(&ZEROS[..(o - at) as usize]).map_err(|e| io_err("send value", e))?;
        stream.write_all(f).map_err(|e| io_err("send value", e))?;
        at = o + f.len() as u64;
    }
    Ok(())
}

fn send_error(stream: &mut TcpStream, msg: &str) -> Result<()> {
    let mut cut = msg.len().min(MAX_ERROR_BYTES);
    while !msg.is_char_boundary(cut) {
        cut -= 1;
    }
    let msg = &msg.as_bytes()[..cut];
    let mut out = vec![ST_ERROR];
    out.extend_from_slice(&(msg.len() as u32).to_le_bytes());
    out.extend_from_slice(msg);
    stream.write_all(&out).map_err(|e| io_err("send error response", e))
}

type Pipe = (std::os::fd::OwnedFd, std::os::fd::OwnedFd);

fn make_pipe() -> io::Result<Pipe> {
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    // Larger pipes move more per splice; the system may cap the size (fs.pipe-max-size).
    let _ = rustix::pipe::fcntl_setpipe_size(&w, PIPE_BYTES);
    Ok((r, w))
}

/// A new, buffered (not O_DIRECT) read-only descriptor of the file behind `fd`, through
/// `/proc/self/fd` (which works for a segment already unlinked, too).
fn reopen_buffered(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    std::fs::File::open(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// `len` bytes at `offset` of `file` into `sock`, through the pipe, never through user memory.
fn splice_out(
    file: std::os::fd::BorrowedFd<'_>,
    offset: u64,
    len: u64,
    r: &std::os::fd::OwnedFd,
    w: &std::os::fd::OwnedFd,
    sock: &TcpStream,
    deadline: Option<Instant>,
) -> io::Result<()> {
    use rustix::pipe::{splice, SpliceFlags};
    let _held = crate::sigpipe::SigpipeHeld::new();
    let mut off = offset;
    let mut left = len;
    while left > 0 {
        check_deadline(deadline)?;
        let want = (left as usize).min(PIPE_BYTES);
        // EINTR (a signal handler ran) retries: splice is never restarted after a handler.
        let n = match splice(file, Some(&mut off), w, None, want, SpliceFlags::empty()) {
            Ok(n) => n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        };
        if n == 0 {
            return Err(io::Error::new(io::ErrorKind::UnexpectedEof, "segment file shorter than its record"));
        }
        let mut in_pipe = n;
        // MORE (MSG_MORE) only while more of the value follows: on the last piece it would hold the
        // final partial segment back (about 200 ms per value for values of a pipe or less).
        let flags = if left > n as u64 { SpliceFlags::MORE } else { SpliceFlags::empty() };
        while in_pipe > 0 {
            check_deadline(deadline)?;
            let m = match splice(r, None, sock, None, in_pipe, flags) {
                Ok(m) => m,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(e.into()),
            };
            if m == 0 {
                return Err(io::Error::new(io::ErrorKind::WriteZero, "peer closed the connection"));
            }
            in_pipe -= m;
        }
        left -= n as u64;
    }
    Ok(())
}

/// A connection to a spillway server.
pub struct Client {
    stream: TcpStream,
    opts: TransferOptions,
    /// Sent with every request.
    ticket: Ticket,
    /// Set after an error that may have left part of a response unread: the connection is out of
    /// step and every later call fails instead of misreading.
    broken: bool,
    /// The last request ended with a whole ERROR response: the connection is still in step.
    answered_error: bool,
    /// The current request has been (or may have been) sent: after that, a failure leaves the
    /// connection in step only if it was a whole ERROR response.
    sent: bool,
}

impl Client {
    /// Connect (within `opts.timeout`) and exchange the protocol greeting. Requests carry `ticket`
    /// (see [`Client::set_ticket`]).
    pub fn connect(addr: impl ToSocketAddrs, ticket: Ticket, opts: TransferOptions) -> Result<Client> {
        let addrs: Vec<_> = addr.to_socket_addrs().map_err(|e| io_err("resolve address", e))?.collect();
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to connect to");
        for a in addrs {
            match TcpStream::connect_timeout(&a, opts.timeout) {
                Ok(mut stream) => {
                    stream.set_read_timeout(Some(opts.timeout)).map_err(|e| io_err("set timeout", e))?;
                    stream.set_write_timeout(Some(opts.timeout)).map_err(|e| io_err("set timeout", e))?;
                    let _ = stream.set_nodelay(true);
                    stream.write_all(&hello()).map_err(|e| io_err("send hello", e))?;
                    let mut h = [0u8; 8];
                    stream.read_exact(&mut h).map_err(|e| io_err("receive hello", e))?;
                    check_hello(&h)?;
                    return Ok(Client { stream, opts, ticket, broken: false, answered_error: false, sent: false });
                }
                Err(e) => last = e,
            }
        }
        Err(io_err("connect", last))
    }

    /// The ticket later requests carry (a grant is good for one request).
    pub fn set_ticket(&mut self, ticket: Ticket) {
        self.ticket = ticket;
    }

    /// Run `f` (one request and its response), marking the connection unusable if it fails midway.
    fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if self.broken {
            return Err(proto("the connection is unusable after an earlier error; connect again"));
        }
        self.answered_error = false;
        self.sent = false;
        let r = f(self);
        // A request refused before it was sent, or answered by a whole ERROR response, leaves the
        // stream in step: the connection goes on. Any other failure may have left it mid-message
        // (a value its receiver refused before reading the payload, for one).
        if r.is_err() && std::mem::take(&mut self.sent) && !std::mem::take(&mut self.answered_error) {
            self.broken = true;
            let _ = self.stream.shutdown(Shutdown::Both);
        }
        r
    }

    fn request(&mut self, key: &[u8]) -> Result<Option<StreamedValue>> {
        if key.len() > MAX_KEY_BYTES {
            return Err(Error::KeyTooLarge { len: key.len(), max: MAX_KEY_BYTES });
        }
        let mut req = vec![OP_GET];
        req.extend_from_slice(&self.ticket.to_bytes());
        req.extend_from_slice(&(key.len() as u32).to_le_bytes());
        req.extend_from_slice(key);
        self.sent = true;
        self.stream.write_all(&req).map_err(|e| io_err("send request", e))?;
        let mut st = [0u8; 1];
        self.stream.read_exact(&mut st).map_err(|e| io_err("receive response", e))?;
        match st[0] {
            ST_VALUE => read_value_header(&mut self.stream, self.opts.max_value_bytes).map(Some),
            ST_NOT_FOUND => Ok(None),
            ST_ERROR => {
                let mut l = [0u8; 4];
                self.stream.read_exact(&mut l).map_err(|e| io_err("receive error", e))?;
                let len = u32::from_le_bytes(l) as usize;
                let mut msg = vec![0u8; len.min(MAX_ERROR_BYTES)];
                self.stream.read_exact(&mut msg).map_err(|e| io_err("receive error", e))?;
                // A server never sends more than MAX_ERROR_BYTES; past that the rest is unread.
                self.answered_error = len <= MAX_ERROR_BYTES;
                Err(proto(format!("server error: {}", String::from_utf8_lossy(&msg))))
            }
            other => Err(proto(format!("unknown response status {other}"))),
        }
    }

    /// Fetch `key` into memory (verified, decompressed). `None` if the server does not have it.
    pub fn get(&mut self, key: &[u8]) -> Result<Option<Frames>> {
        self.guarded(|c| c.get_inner(key))
    }

    fn get_inner(&mut self, key: &[u8]) -> Result<Option<Frames>> {
        let Some(m) = self.request(key)? else { return Ok(None) };
        self.receive_whole(&m).map(Some)
    }

    /// Read the stored payload announced by `m` into memory, verify it, decompress it, cut it into
    /// frames (bounded by `max_value_bytes`, checked when the header was read).
    fn receive_whole(&mut self, m: &StreamedValue) -> Result<Frames> {
        let allowance = self.opts.allowance(m.stored_len);
        stored::read(m, &mut Paced::new(&mut self.stream, allowance), self.opts.max_value_bytes)
    }

    /// Fetch `key` straight into `log` under `as_key`, in stored form, never holding the value in
    /// memory. Returns whether the server had it; on any failure nothing is stored.
    pub fn get_into<B: Backend>(&mut self, key: &[u8], log: &SegmentLog<B>, as_key: &[u8]) -> Result<bool> {
        self.guarded(|c| {
            let Some(m) = c.request(key)? else { return Ok(false) };
            let allowance = c.opts.allowance(m.stored_len);
            log.put_stream(as_key, &m, &mut Paced::new(&mut c.stream, allowance)).map(|()| true)
        })
    }

    /// Fetch `key` into `store` under the same key ([`Store::receive`] decides between memory and
    /// disk). Returns whether
    /// the server had the key; on any failure nothing is stored, and the key's old value, if any,
    /// stays.
    pub fn get_into_store<C: Codec, B: Backend>(&mut self, key: &[u8], store: &Store<C, B>) -> Result<bool> {
        self.guarded(|c| {
            let Some(m) = c.request(key)? else { return Ok(false) };
            let allowance = c.opts.allowance(m.stored_len);
            store.receive(key, &m, &mut Paced::new(&mut c.stream, allowance)).map(|()| true)
        })
    }

    /// Fetch `key` and write its frames, back to back, to `out`, streaming uncompressed values in
    /// pieces. The checksum is checked at the end: on a mismatch the bytes are already written and
    /// the error says so. Returns whether the server had the key.
    pub fn get_to(&mut self, key: &[u8], out: &mut dyn Write) -> Result<bool> {
        self.guarded(|c| c.get_to_inner(key, out))
    }

    fn get_to_inner(&mut self, key: &[u8], out: &mut dyn Write) -> Result<bool> {
        let Some(m) = self.request(key)? else { return Ok(false) };
        if m.lz4 {
            // An lz4 block decompresses only whole: bounded by `max_value_bytes`.
            for f in self.receive_whole(&m)?.iter() {
                out.write_all(f).map_err(|e| io_err("write output", e))?;
            }
            return Ok(true);
        }
        let (offsets, _) = format::frame_layout(m.frame_lens.iter().copied()).expect("checked");
        // Payload positions that belong to frames (the rest is alignment padding).
        let spans: Vec<(u64, u64)> = m.frame_lens.iter().zip(offsets).map(|(&l, at)| (at, at + l)).collect();
        let mut crc = crc32fast::Hasher::new();
        let mut buf = vec![0u8; PIPE_BYTES];
        let mut pos = 0u64;
        let mut src = Paced::new(&mut self.stream, self.opts.allowance(m.stored_len));
        while pos < m.stored_len {
            let want = ((m.stored_len - pos) as usize).min(buf.len());
            let n = match src.read(&mut buf[..want]) {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_err("receive value", e)),
            };
            if n == 0 {
                return Err(io_err(
                    "receive value",
                    io::Error::new(io::ErrorKind::UnexpectedEof, "the sender stopped before the whole value arrived"),
                ));
            }
            crc.update(&buf[..n]);
            let (lo, hi) = (pos, pos + n as u64);
            for &(a, b) in &spans {
                let (s, e) = (a.max(lo), b.min(hi));
                if s < e {
                    out.write_all(&buf[(s - lo) as usize..(e - lo) as usize]).map_err(|e| io_err("write output", e))?;
                }
            }
            pos = hi;
        }
        let actual = crc.finalize();
        if actual != m.payload_crc {
            return Err(received_crc_mismatch("received value (already written out)", m.payload_crc, actual));
        }
        Ok(true)
    }
}

/// The head of a VALUE response (status byte, header, frame table); the stored bytes follow. Used by
/// the server, and by tests and tools that speak the protocol by hand.
pub fn encode_value_response(meta: &StreamedValue) -> Vec<u8> {
    let mut v = vec![ST_VALUE];
    v.extend_from_slice(&value_header(meta));
    v
}

/// The greeting both sides send first.
pub fn greeting() -> [u8; 8] {
    hello()
}
