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
//! ([`Client::get_into`], [`SegmentLog::put_stream`](crate::SegmentLog::put_stream)), or streamed to a writer ([`Client::get_to`]).
//!
//! Every request carries a [`Ticket`] that the server's [`Access`] must accept: a standing ticket
//! for every key, or a one-time grant for one key (see `access`). Limits: connections in total
//! and per peer address, a deadline for each request's head and one for each payload, bounds on
//! every length before anything is allocated.
//!
//! Connections are served by blocking threads (one per connection, bounded). A peer that hangs up
//! mid-value ends that connection only; a partial value is never published.
//!
//! | file | owns |
//! |---|---|
//! | `mod.rs` | [`TransferOptions`] (limits, deadlines), the paced reader/writer that enforces them |
//! | `wire.rs` | the bytes on the wire: greeting, request head, VALUE header and its bounds |
//! | `access.rs` | who may read what: [`Ticket`], [`Access`], grants |
//! | `server.rs` | [`Source`], [`serve`], connection limits, the splice and copy send paths |
//! | `client.rs` | [`Client`]: fetch into memory, a log, a store or a writer |

mod access;
mod client;
mod server;
mod wire;

pub use access::{Access, Ticket, MAX_GRANTS, TICKET_BYTES};
pub use client::Client;
pub use server::{serve, serve_connection, shutdown_listener, Outgoing, Source, MAX_REFUSING};
/// The wire's parts the crate's own tests and fuzz targets speak directly (`testing` feature); not
/// the API: a peer speaks to a [`serve`]r through a [`Client`].
#[cfg(feature = "testing")]
#[doc(hidden)]
pub use wire::{encode_value_response, greeting, read_value_header, NOT_AUTHORIZED, PROTOCOL_VERSION};

use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

use crate::error::Error;
/// Settings of a server or a client.
#[derive(Debug, Clone)]
pub struct TransferOptions {
    /// Largest stored value accepted (receiving) or sent.
    pub max_value_bytes: u64,
    /// Server: read each payload into memory and write it, instead of splicing it.
    pub copy: bool,
    /// Socket read and write timeout.
    pub timeout: Duration,
    /// Client: how long connecting, and the server's greeting, may take; `None`: `timeout`. A peer
    /// whose port is blocked (a firewall dropping packets) costs this, not `timeout`.
    pub connect_timeout: Option<Duration>,
    /// Server: connections served at once. One more takes the place of a connection not yet
    /// admitted (no request of it admitted by a ticket), which is cut off: the oldest that has sent
    /// nothing; failing that, once the newcomer has greeted (it waits up to a second for that, one
    /// of at most [`MAX_REFUSING`] at a time; beyond that they are closed unanswered), the one that
    /// greeted longest ago. If every place is admitted, it is refused with an error response.
    /// A connection that has greeted is never cut off by one that has sent nothing, nor an admitted
    /// one at all (see [`serve`]).
    pub max_connections: usize,
    /// Server: connections not yet admitted from one peer address; one more takes the place of
    /// one of that address's, chosen as for `max_connections`. Admitted connections are not
    /// counted: the workers of one host share its address.
    pub max_connections_per_peer: usize,
    /// Server: values smaller than this are copied (read and written 1 MiB at a time)
    /// rather than spliced. Measured on loopback into a receiving log: splice ran at 0.35x the copy
    /// path for 1 MiB values, 1.1x for 64 MiB and 5.4x for 1 GiB when copying read a value whole
    /// (docs/benchmarks.md has the current numbers).
    pub splice_min_bytes: u64,
    /// Slowest average rate, in bytes per second, at which a value's payload may arrive (client)
    /// or leave (server); 0 for no limit. A payload must keep pace from its first byte on: `n`
    /// bytes of it through within `timeout + n / min_bytes_per_sec`, or the transfer fails with
    /// `TimedOut`. The socket timeout bounds each call only: a peer that sends (or reads) a byte
    /// every few seconds would otherwise hold the transfer, its connection slot, a receiving
    /// store's room for the value and the disk reserved for it, for good; counted by the bytes so
    /// far, not the size announced, a peer that announces gigabytes and stalls is cut off after
    /// about `timeout`.
    pub min_bytes_per_sec: u64,
}

/// The pace a transfer must keep, counted from its first call: `done` bytes through within
/// `timeout + done / min_bytes_per_sec` (see [`TransferOptions::min_bytes_per_sec`]).
#[derive(Debug, Clone, Copy)]
pub(super) struct Pace {
    start: Option<Instant>,
    timeout: Duration,
    /// 0: no bound at all.
    min_bytes_per_sec: u64,
    /// What the error says was too late.
    late: &'static str,
}

impl Pace {
    /// A payload's pace (none if `opts.min_bytes_per_sec` is 0).
    pub(super) fn payload(opts: &TransferOptions) -> Pace {
        Pace {
            start: None,
            timeout: opts.timeout,
            min_bytes_per_sec: opts.min_bytes_per_sec,
            late: server::PAYLOAD_LATE,
        }
    }

    /// The head of a response (its status, an error's text, a value's header and frame table) or
    /// a greeting: all of it within `timeout`, however a peer paces its bytes.
    fn head(timeout: Duration) -> Pace {
        let late = "the response was not through in time (timeout)";
        Pace { start: None, timeout, min_bytes_per_sec: u64::MAX, late }
    }

    /// `TimedOut` if `done` bytes are behind the pace.
    pub(super) fn check(&mut self, done: u64) -> io::Result<()> {
        if self.min_bytes_per_sec == 0 {
            return Ok(());
        }
        let start = *self.start.get_or_insert_with(Instant::now);
        let owed = Duration::try_from_secs_f64(done as f64 / self.min_bytes_per_sec as f64).unwrap_or(MAX_WAIT);
        if start.elapsed() > self.timeout.saturating_add(owed) {
            return Err(io::Error::new(io::ErrorKind::TimedOut, self.late));
        }
        Ok(())
    }
}

/// A socket (or any reader or writer) whose calls fail with `TimedOut` once the bytes through it
/// fall behind a [`Pace`]: it bounds a whole payload or head, where the socket timeout bounds each
/// call. Counting from the first call leaves out a wait before it (a receiving log's writer lock).
struct Paced<'a, S> {
    inner: &'a mut S,
    pace: Pace,
    done: u64,
}

impl<'a, S> Paced<'a, S> {
    /// For a payload (see [`TransferOptions::min_bytes_per_sec`]).
    fn payload(inner: &'a mut S, opts: &TransferOptions) -> Self {
        Paced { inner, pace: Pace::payload(opts), done: 0 }
    }

    /// For a head: see [`Pace::head`].
    fn head(inner: &'a mut S, timeout: Duration) -> Self {
        Paced { inner, pace: Pace::head(timeout), done: 0 }
    }
}

/// The longest wait any deadline of a transfer is set to: a duration from a caller (a lifetime,
/// a timeout) of any size makes a deadline this far off at most, never an `Instant` overflow.
#[doc(hidden)]
pub const MAX_WAIT: Duration = Duration::from_secs(100 * 365 * 24 * 3600);

/// `d` from now (at most [`MAX_WAIT`]).
pub(crate) fn after(d: Duration) -> Instant {
    Instant::now() + d.min(MAX_WAIT)
}

impl<S: Read> Read for Paced<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.pace.check(self.done)?;
        let n = self.inner.read(buf)?;
        self.done += n as u64;
        Ok(n)
    }
}

impl<S: Write> Write for Paced<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.pace.check(self.done)?;
        let n = self.inner.write(buf)?;
        self.done += n as u64;
        Ok(n)
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
            connect_timeout: None,
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

fn proto(msg: impl Into<String>) -> Error {
    Error::Protocol(msg.into())
}
