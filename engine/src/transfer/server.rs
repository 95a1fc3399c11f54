//! The server: what it serves ([`Source`]: a log's records or a store's values, [`Outgoing`]),
//! accepting within the connection limits, reading requests by their deadlines, checking tickets
//! ([`Access`]), and the send paths: `splice` (file -> pipe -> socket) or copy, 1 MiB at a time.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::format::{self, MAX_KEY_BYTES};
use crate::log::{SegmentLog, StoredValue, StreamedValue};
use crate::store::{Codec, Store, Tier};
use crate::value::Frames;

use super::access::{Access, Refused, Ticket, TICKET_BYTES};
use super::wire::{
    check_hello, encode_value_response, hello, MAX_ERROR_BYTES, NOT_AUTHORIZED, OP_GET, REQUEST_HEAD, ST_ERROR,
    ST_NOT_FOUND,
};
use super::{after, io_err, proto, Pace, Paced, TransferOptions};

/// Bytes moved per splice round (the pipe is resized to this where the system allows).
pub(super) const PIPE_BYTES: usize = 1 << 20;

/// What a server sends values from: a [`SegmentLog`] (everything on disk) or a [`Store`] (values on
/// disk, serialized in memory, or materialized).
pub trait Source: Send + Sync + 'static {
    /// The backend of the logs that hold spilled values.
    type Backend: Backend;
    /// The log `value` (an [`Outgoing::Stored`] of this source) was found in: its file is sent through
    /// that log's backend.
    fn log_holding(&self, value: &StoredValue<<Self::Backend as Backend>::File>) -> &SegmentLog<Self::Backend>;
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
    fn log_holding(&self, _: &StoredValue<B::File>) -> &SegmentLog<B> {
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
    /// A store may have more than one log (a fresh one after a failed write): the one whose segments
    /// directory holds the value's file.
    fn log_holding(&self, value: &StoredValue<B::File>) -> &SegmentLog<B> {
        let dir = value.path.parent().and_then(std::path::Path::parent);
        self.all_logs().into_iter().rev().find(|l| Some(l.dir()) == dir).unwrap_or_else(|| self.current_log())
    }
    /// A spilled value is sent from its segment (never read back into memory); a value in memory is
    /// sent from its serialized frames (a materialized one is serialized once for this).
    fn outgoing(&self, key: &[u8]) -> Result<Option<Outgoing<B::File>>> {
        if self.tier(key) == Some(Tier::Disk) {
            let Some(log) = self.log_holding_key(key) else {
                return Ok(self.get_serialized(key)?.map(Outgoing::Frames));
            };
            match log.stored_value(key) {
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

/// Connections that found no place as they came (see [`serve`]) kept waiting for their greeting
/// at once, each on a short-lived thread (up to a second), to be served if a place is theirs once
/// they have greeted, else answered "too many connections". Beyond that, such connections are
/// closed unanswered: a flood costs no more than this many threads.
pub const MAX_REFUSING: usize = 8;

/// How long a connection that found no place as it came may take to greet ([`wait_apart`]).
const GREETING_WAIT: Duration = Duration::from_secs(1);

/// The connections [`serve`] is serving, oldest first. A connection is *unadmitted* until a ticket
/// of its is admitted: until then it has proved nothing, and it gives its place up to a newer one
/// that has come as far as it has. While *silent* (its greeting neither read by its thread nor
/// waiting on its socket) it gives it up to any newer connection; once it has greeted, only to a
/// newer connection that has greeted too, the one that greeted longest ago first. Admitted, it
/// is never cut off.
#[derive(Default)]
struct Places {
    /// The next connection's id, and the next greeting's number.
    next_id: u64,
    taken: Vec<Place>,
}

struct Place {
    id: u64,
    ip: IpAddr,
    /// A handle to cut the connection off with, while it is unadmitted; `None` once admitted.
    unadmitted: Option<TcpStream>,
    /// When its greeting was seen (read, or waiting on its socket as it was accepted), as a number
    /// from `next_id` (a later greeting has a larger one); `None` before.
    greeted: Option<u64>,
}

/// What a new connection from `ip` gets (see [`serve`]).
enum Room {
    Free,
    /// The place at this index, cut off.
    Taken(usize),
    /// No place it may take (now): why.
    Refused(&'static str),
}

impl Places {
    /// What a new connection from `ip` gets; `greeted`: its greeting has arrived (it waits on its
    /// socket, or was read while it waited for a place: see [`wait_apart`]).
    fn room_for(&self, ip: IpAddr, greeted: bool, opts: &TransferOptions) -> Room {
        let from_ip = self.taken.iter().filter(|p| p.unadmitted.is_some() && p.ip == ip).count();
        let (of, why) = if from_ip >= opts.max_connections_per_peer {
            (Some(ip), "too many connections from this peer")
        } else if self.taken.len() >= opts.max_connections {
            (None, "too many connections")
        } else {
            return Room::Free;
        };
        self.to_cut(of, greeted).map_or(Room::Refused(why), Room::Taken)
    }

    /// The unadmitted place (of the address `of`, or of any) that a new connection takes: the
    /// oldest silent one; failing that, for a connection that has greeted, the one that greeted
    /// longest ago (one whose greeting waits on its socket, not yet read, counts as the latest).
    fn to_cut(&self, of: Option<IpAddr>, greeted: bool) -> Option<usize> {
        let mut spoke: Option<(u64, usize)> = None;
        for (i, p) in self.taken.iter().enumerate() {
            let Some(handle) = p.unadmitted.as_ref().filter(|_| of.is_none_or(|ip| p.ip == ip)) else { continue };
            let order = match p.greeted {
                Some(order) => order,
                None if bytes_waiting(handle) => u64::MAX,
                None => return Some(i),
            };
            if spoke.is_none_or(|(o, _)| order < o) {
                spoke = Some((order, i));
            }
        }
        spoke.filter(|_| greeted).map(|(_, i)| i)
    }

    /// `id`'s connection has greeted.
    fn greeted(&mut self, id: u64) {
        let order = self.next_id;
        self.next_id += 1;
        if let Some(p) = self.taken.iter_mut().find(|p| p.id == id) {
            p.greeted = Some(order);
        }
    }

    /// Admit `id`'s connection: it is never cut off from then on. False if it was cut off already.
    fn admitted(&mut self, id: u64) -> bool {
        match self.taken.iter_mut().find(|p| p.id == id) {
            Some(p) => {
                p.unadmitted = None;
                true
            }
            None => false,
        }
    }

    fn give_back(&mut self, id: u64) {
        self.taken.retain(|p| p.id != id);
    }
}

/// Serve what `access` lets through on `listener`: one thread per connection, at most
/// `opts.max_connections` at once, of which at most `opts.max_connections_per_peer` from one
/// address unadmitted (before a request of theirs is admitted). A connection over either limit
/// takes the place of the oldest unadmitted one that is *silent* (has not sent its greeting), of
/// its own address for the per-address limit, which is cut off. If there is none, it waits for
/// its greeting on a thread of its own ([`MAX_REFUSING`] at most, a second at most); greeted, it
/// takes the place of the oldest silent one or, failing that, of the one that greeted longest ago;
/// if every place is admitted, it is refused ("too many connections"). So connections that prove
/// nothing, however many and however renewed, never keep out a peer with a ticket; connections that
/// send nothing never cut off one that has greeted, so a ticket holder, which greets at once and
/// sends its request a round trip later, is not cut off by them before its ticket is seen; and a
/// request is admitted (its grant used up) only while its connection holds its place, which it
/// then keeps: a grant is never used up by a connection that is cut off. The workers of one host
/// (one address) are not limited to one peer's share.
/// Returns `Ok(())` once the listener is shut down ([`shutdown_listener`] on a clone of it, from
/// another thread), or the error if `accept` fails in a way that will not pass (the descriptor is
/// not a listening socket). Failures that concern one connection or pass (an aborted handshake,
/// out of descriptors or memory) are logged and serving goes on.
pub fn serve<S: Source>(access: Arc<Access<S>>, listener: TcpListener, opts: TransferOptions) -> Result<()> {
    // Grants expire on time whether or not a request comes: their pins go with them.
    let _sweeper = Sweeper::start(access.clone());
    let refusing = Arc::new(AtomicUsize::new(0));
    let places: Arc<Mutex<Places>> = Arc::default();
    let mut failed_accepts = FailedAccepts::default();
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
                failed_accepts.note(&e);
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        // One whose greeting is in already has greeted, as far as places go (its thread reads it).
        let greeted = bytes_waiting(&stream);
        let held = match take_place(&places, &stream, peer, greeted, &opts) {
            Some(Ok(held)) => held,
            Some(Err(why)) => {
                wait_apart(&refusing, &places, &access, stream, peer, &opts, why);
                continue;
            }
            None => continue,
        };
        spawn_serving(access.clone(), stream, peer, opts.clone(), held, false);
    }
}

/// Serve `stream` from `peer` in its place `held` on a thread of its own (`greeted`: its greeting
/// was read already).
fn spawn_serving<S: Source>(
    access: Arc<Access<S>>,
    stream: TcpStream,
    peer: SocketAddr,
    opts: TransferOptions,
    held: Held,
    greeted: bool,
) {
    let spawned = std::thread::Builder::new().name(format!("spillway-serve-{peer}")).spawn(move || {
        if let Err(e) = serve_admitting(&access, stream, &opts, Some(&held), greeted) {
            log::info!("transfer: connection from {peer} ended: {e}");
        }
    });
    if let Err(e) = spawned {
        log::warn!("transfer: cannot start a thread for {peer}: {e}");
    }
}

/// Failed accepts, logged at most every [`ACCEPT_WARN_EVERY`], with how many were not.
#[derive(Default)]
struct FailedAccepts {
    warned: Option<Instant>,
    unlogged: u64,
}

impl FailedAccepts {
    fn note(&mut self, e: &io::Error) {
        if self.warned.is_none_or(|t| t.elapsed() >= ACCEPT_WARN_EVERY) {
            let unlogged = self.unlogged;
            let more = if unlogged > 0 { format!(" ({unlogged} more since the last message)") } else { String::new() };
            log::warn!("transfer: accept failed: {e}{more}");
            self.warned = Some(Instant::now());
            self.unlogged = 0;
        } else {
            self.unlogged += 1;
        }
    }
}

/// A connection's place in [`Places`], given back when its thread ends however it ends (a panic
/// included), or with its closure if it never starts.
struct Held(Arc<Mutex<Places>>, u64);

impl Held {
    fn places(&self) -> std::sync::MutexGuard<'_, Places> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Its connection has greeted: only a connection that has greeted too may take its place.
    fn greeted(&self) {
        self.places().greeted(self.1);
    }

    /// Admit its connection ([`Places::admitted`]); false if it was cut off already.
    fn admit(&self) -> bool {
        self.places().admitted(self.1)
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        self.places().give_back(self.1);
    }
}

/// A place in the count of refusing threads ([`MAX_REFUSING`]), given back as [`Held`] is.
struct Refusing(Arc<AtomicUsize>);

impl Drop for Refusing {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// A place for the connection `stream` from `peer` among `places` (`greeted`: its greeting has
/// arrived), cutting off an unadmitted one if that is the rule (see [`serve`]); `Err` with why if
/// there is none, `None` if the connection is closed at once (no handle of it could be kept).
fn take_place(
    places: &Arc<Mutex<Places>>,
    stream: &TcpStream,
    peer: SocketAddr,
    greeted: bool,
    opts: &TransferOptions,
) -> Option<std::result::Result<Held, &'static str>> {
    let mut p = places.lock().unwrap_or_else(PoisonError::into_inner);
    let room = p.room_for(peer.ip(), greeted, opts);
    match room {
        Room::Refused(why) => return Some(Err(why)),
        Room::Taken(i) => {
            let cut = p.taken.remove(i);
            log::debug!("transfer: cutting off an unadmitted connection from {} for {peer}", cut.ip);
            if let Some(s) = cut.unadmitted {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
        Room::Free => {}
    }
    match stream.try_clone() {
        Ok(handle) => {
            let id = p.next_id;
            p.next_id += 1;
            p.taken.push(Place { id, ip: peer.ip(), unadmitted: Some(handle), greeted: greeted.then_some(id) });
            Some(Ok(Held(places.clone(), id)))
        }
        Err(e) => {
            log::warn!("transfer: closing {peer}: cannot hold a handle of its connection: {e}");
            None
        }
    }
}

/// `stream` from `peer` found no place as it came (`why`: no silent one to take, see [`serve`]):
/// on a thread of its own, not on the accept loop, wait for its greeting (up to
/// [`GREETING_WAIT`]); greeted, it asks again as a connection that has greeted and is served in
/// the place it gets. Otherwise it is refused, after its greeting was read or waited for (closing
/// with unread data would reset the connection and the client might never see the reason). In a
/// flood (more than [`MAX_REFUSING`] waiting) it is closed unanswered rather than starting a
/// thread per connection.
fn wait_apart<S: Source>(
    refusing: &Arc<AtomicUsize>,
    places: &Arc<Mutex<Places>>,
    access: &Arc<Access<S>>,
    mut stream: TcpStream,
    peer: SocketAddr,
    opts: &TransferOptions,
    why: &'static str,
) {
    if refusing.fetch_add(1, Ordering::SeqCst) >= MAX_REFUSING {
        refusing.fetch_sub(1, Ordering::SeqCst);
        log::debug!("transfer: closing {peer}: {why}, and too many waiting");
        return;
    }
    let held = Refusing(refusing.clone());
    let (places, access, opts) = (places.clone(), access.clone(), opts.clone());
    let waiting = std::thread::Builder::new().name("spillway-refuse".into()).spawn(move || {
        let _held = held;
        let mut h = [0u8; 8];
        let greeting = read_by(&mut stream, &mut h, after(GREETING_WAIT), GREETING_WAIT);
        let why = match greeting.map(|()| check_hello(&h)) {
            Err(_) => why.to_string(),
            Ok(Err(e)) => e.to_string(),
            Ok(Ok(())) => match take_place(&places, &stream, peer, true, &opts) {
                Some(Ok(place)) => return spawn_serving(access, stream, peer, opts, place, true),
                Some(Err(why)) => why.to_string(),
                None => return,
            },
        };
        let _ = send_refusal(&mut stream, &why);
    });
    if let Err(e) = waiting {
        log::warn!("transfer: cannot start a thread for {peer} to wait on: {e}");
    }
}

/// Stop a [`serve`] loop running on `listener` (or on another handle of the same socket, such as the
/// one `TcpListener::try_clone` gives): `accept` then fails with EINVAL and `serve` returns `Ok`.
/// Connections being served run to their end.
pub fn shutdown_listener(listener: &TcpListener) -> io::Result<()> {
    rustix::net::shutdown(listener, rustix::net::Shutdown::Read).map_err(io::Error::from)
}

/// Whether bytes from the peer of `stream` wait to be read, looked at without taking them and
/// without waiting (`MSG_PEEK | MSG_DONTWAIT`): a connection whose greeting has arrived has spoken,
/// before its thread reads it.
fn bytes_waiting(stream: &TcpStream) -> bool {
    use rustix::net::{recv, RecvFlags};
    let mut byte = [0u8; 1];
    matches!(recv(stream, &mut byte, RecvFlags::PEEK | RecvFlags::DONTWAIT), Ok((n, _)) if n > 0)
}

/// Greeting and ERROR `why`, for a client whose greeting was read.
pub(super) fn send_refusal(stream: &mut TcpStream, why: &str) -> io::Result<()> {
    let mut out = hello().to_vec();
    out.push(ST_ERROR);
    out.extend_from_slice(&(why.len() as u32).to_le_bytes());
    out.extend_from_slice(why.as_bytes());
    stream.write_all(&out)
}

/// While a server runs, a thread of its own drops its grants as they expire (at most
/// [`SWEEP_EVERY`] late), so that a ticket nobody redeems stops pinning its record on time, not
/// when the next request or grant happens to sweep. Stopped (and joined) when dropped.
struct Sweeper {
    stop: Arc<(Mutex<bool>, std::sync::Condvar)>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// The longest a [`Sweeper`] sleeps.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

impl Sweeper {
    fn start<S: Source>(access: Arc<Access<S>>) -> Sweeper {
        let stop: Arc<(Mutex<bool>, std::sync::Condvar)> = Arc::default();
        let stopped = stop.clone();
        let thread = std::thread::Builder::new()
            .name("spillway-grants".into())
            .spawn(move || loop {
                let wait = access.sweep_expired().unwrap_or(SWEEP_EVERY).clamp(Duration::from_millis(1), SWEEP_EVERY);
                let (lock, cv) = &*stopped;
                let g = lock.lock().unwrap_or_else(PoisonError::into_inner);
                let (g, _) = cv.wait_timeout_while(g, wait, |s| !*s).unwrap_or_else(PoisonError::into_inner);
                if *g {
                    return;
                }
            })
            .ok(); // no thread: grants are swept by requests and grants, as before
        Sweeper { stop, thread }
    }
}

impl Drop for Sweeper {
    fn drop(&mut self) {
        *self.stop.0.lock().unwrap_or_else(PoisonError::into_inner) = true;
        self.stop.1.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What a payload that fell behind its pace fails with.
pub(super) const PAYLOAD_LATE: &str = "the value was not through in time (timeout + bytes so far / min_bytes_per_sec)";

/// A failed `accept` (out of descriptors, say) is logged at most this often.
pub const ACCEPT_WARN_EVERY: Duration = Duration::from_secs(10);

/// Fill `buf` from `stream` before `deadline` (each read waits at most until then, and at most
/// `timeout`): a peer that trickles a message a byte at a time cannot stretch it past the deadline.
pub(super) fn read_by(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant, timeout: Duration) -> io::Result<()> {
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

/// Serve one connection until the peer closes it (`Ok`) or breaks the protocol (`Err`, after an
/// error response where one can still be sent). The greeting, and each request from its first
/// byte to its last, must arrive within `opts.timeout`; a request `access` refuses is answered
/// "not authorized" and ends the connection.
pub fn serve_connection<S: Source>(access: &Access<S>, stream: TcpStream, opts: &TransferOptions) -> Result<()> {
    serve_admitting(access, stream, opts, None, false)
}

/// [`serve_connection`] in a place of [`serve`]'s (`held`): marked greeted once the greeting is
/// read (`greeted`: it was, only the server's is sent), and admitted as the first request with a
/// good ticket is, before anything is used up ([`Access::admit`]).
fn serve_admitting<S: Source>(
    access: &Access<S>,
    mut stream: TcpStream,
    opts: &TransferOptions,
    held: Option<&Held>,
    greeted: bool,
) -> Result<()> {
    let Some(_serving) = access.enter(&stream) else { return Ok(()) }; // closed
    stream.set_read_timeout(Some(opts.timeout)).map_err(|e| io_err("set timeout", e))?;
    stream.set_write_timeout(Some(opts.timeout)).map_err(|e| io_err("set timeout", e))?;
    let _ = stream.set_nodelay(true);
    let peer = stream.peer_addr().ok().map(|a| a.ip());
    if !greeted {
        let mut h = [0u8; 8];
        read_by(&mut stream, &mut h, after(opts.timeout), opts.timeout).map_err(|e| io_err("receive hello", e))?;
        if let Err(e) = check_hello(&h) {
            let _ = send_refusal(&mut stream, &e.to_string()); // its greeting was just read
            return Err(e);
        }
        if let Some(place) = held {
            place.greeted(); // before the server's greeting: the client sends its request after it
        }
    }
    stream.write_all(&hello()).map_err(|e| io_err("send hello", e))?;
    let mut pipe = None;
    let mut told = false;
    loop {
        let mut req = [0u8; REQUEST_HEAD];
        match stream.read(&mut req[..1]) {
            Ok(0) => return Ok(()), // the client is done
            Ok(_) => {}
            // A signal handler ran: a socket with timeouts is never restarted, whatever SA_RESTART.
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(io_err("receive request", e)),
        }
        let deadline = after(opts.timeout);
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
        let hold = || told || held.is_none_or(Held::admit);
        let admitted = match access.admit(&ticket, &key, peer, &hold) {
            Ok(admitted) => admitted,
            Err(Refused::Cut) => return Err(proto("cut off for a newer connection before a request was admitted")),
            Err(Refused::NotAuthorized) => {
                let _ = send_error(&mut stream, NOT_AUTHORIZED);
                return Err(proto(format!("a request with ticket {ticket:?} was refused")));
            }
        };
        told = true;
        let (src, granted) = admitted.into_parts();
        let outgoing = match granted {
            Some(v) => Ok(Some(v)),
            None => src.outgoing(&key),
        };
        send_outgoing(&*src, &mut stream, opts, &mut pipe, outgoing)?;
    }
}

/// Answer one request with `outgoing` (the source's answer for its key): VALUE, NOT_FOUND or ERROR.
pub(super) fn send_outgoing<S: Source + ?Sized>(
    src: &S,
    stream: &mut TcpStream,
    opts: &TransferOptions,
    pipe: &mut Option<Pipe>,
    outgoing: Result<Option<Outgoing<<S::Backend as Backend>::File>>>,
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
                Some(n) if n <= opts.max_value_bytes => send_frames(&mut Paced::payload(stream, opts), &frames),
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
    let log = src.log_holding(&sv);
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
    let pace = Pace::payload(opts);
    let sent = match splice_fd {
        Some(fd) => {
            if pipe.is_none() {
                *pipe = Some(make_pipe().map_err(|e| io_err("create pipe", e))?);
            }
            let (r, w) = pipe.as_ref().expect("just made");
            splice_out(fd, sv.payload_offset, sv.meta.stored_len, r, w, stream, pace)
                .map_err(|e| io_err("splice value", e))
        }
        None => copy_out(log, &sv, stream, pace),
    };
    if sent.is_err() {
        // Part of the value may have gone out (or be stuck in the pipe): the connection cannot
        // continue in step.
        let _ = stream.shutdown(Shutdown::Both);
    }
    sent
}

/// The copy path: the stored payload read and written [`PIPE_BYTES`] at a time (never the whole
/// value in memory), keeping `pace`.
pub(super) fn copy_out<B: Backend>(
    log: &SegmentLog<B>,
    sv: &StoredValue<B::File>,
    stream: &mut TcpStream,
    pace: Pace,
) -> Result<()> {
    let mut out = Paced { inner: stream, pace, done: 0 };
    let mut at = 0u64;
    while at < sv.meta.stored_len {
        out.pace.check(at).map_err(|e| io_err("send value", e))?;
        let n = (sv.meta.stored_len - at).min(PIPE_BYTES as u64);
        let part = log.read_stored_part(sv, at, n)?;
        out.write_all(&part).map_err(|e| io_err("send value", e))?;
        at += n;
    }
    Ok(())
}

/// Send in-memory frames as an uncompressed VALUE: the same layout as on disk (each frame at a
/// 64-byte boundary, zeros between), written from the frames' own buffers.
pub(super) fn send_frames(stream: &mut impl Write, frames: &Frames) -> Result<()> {
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

pub(super) fn send_error(stream: &mut TcpStream, msg: &str) -> Result<()> {
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

pub(super) type Pipe = (std::os::fd::OwnedFd, std::os::fd::OwnedFd);

pub(super) fn make_pipe() -> io::Result<Pipe> {
    let (r, w) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC)?;
    // Larger pipes move more per splice; the system may cap the size (fs.pipe-max-size).
    let _ = rustix::pipe::fcntl_setpipe_size(&w, PIPE_BYTES);
    Ok((r, w))
}

/// A new, buffered (not O_DIRECT) read-only descriptor of the file behind `fd`, through
/// `/proc/self/fd` (which works for a segment already unlinked, too).
pub(super) fn reopen_buffered(fd: std::os::fd::BorrowedFd<'_>) -> io::Result<std::fs::File> {
    use std::os::fd::AsRawFd;
    std::fs::File::open(format!("/proc/self/fd/{}", fd.as_raw_fd()))
}

/// `len` bytes at `offset` of `file` into `sock`, through the pipe, never through user memory.
pub(super) fn splice_out(
    file: std::os::fd::BorrowedFd<'_>,
    offset: u64,
    len: u64,
    r: &std::os::fd::OwnedFd,
    w: &std::os::fd::OwnedFd,
    sock: &TcpStream,
    mut pace: Pace,
) -> io::Result<()> {
    use rustix::pipe::{splice, SpliceFlags};
    let _held = crate::sigpipe::SigpipeHeld::new();
    let mut off = offset;
    let mut left = len;
    while left > 0 {
        pace.check(len - left)?;
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
            pace.check(len - left + (n - in_pipe) as u64)?;
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
