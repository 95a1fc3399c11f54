//! The client: [`Client`] connects, greets, and fetches values into memory, into a log, into a
//! store ([`Store::receive`]) or to a writer, checking every announced length and checksum.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream, ToSocketAddrs};
use std::time::Duration;

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::format::MAX_KEY_BYTES;
use crate::log::{SegmentLog, StreamedValue};
use crate::store::{Codec, Store};
use crate::value::Frames;
use crate::{format, stored};

use super::access::Ticket;
use super::server::PIPE_BYTES;
use super::wire::{check_hello, hello, read_value_header, MAX_ERROR_BYTES, OP_GET, ST_ERROR, ST_NOT_FOUND, ST_VALUE};
use super::{io_err, proto, Paced, TransferOptions};

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
    /// What the next value's frames must add up to ([`Client::expect_frames_total`]).
    expect_frames: Option<u64>,
}

impl Client {
    /// Connect (within `opts.timeout`) and exchange the protocol greeting. Requests carry `ticket`
    /// (see [`Client::set_ticket`]).
    pub fn connect(addr: impl ToSocketAddrs, ticket: Ticket, opts: TransferOptions) -> Result<Client> {
        let addrs: Vec<_> = addr.to_socket_addrs().map_err(|e| io_err("resolve address", e))?.collect();
        let mut last = io::Error::new(io::ErrorKind::InvalidInput, "no address to connect to");
        let greet = opts.connect_timeout.unwrap_or(opts.timeout);
        for a in addrs {
            match TcpStream::connect_timeout(&a, greet) {
                Ok(mut stream) => {
                    let set = |s: &TcpStream, t: Duration| -> Result<()> {
                        s.set_read_timeout(Some(t)).map_err(|e| io_err("set timeout", e))?;
                        s.set_write_timeout(Some(t)).map_err(|e| io_err("set timeout", e))
                    };
                    set(&stream, greet)?;
                    let _ = stream.set_nodelay(true);
                    stream.write_all(&hello()).map_err(|e| io_err("send hello", e))?;
                    let mut h = [0u8; 8];
                    Paced::head(&mut stream, greet).read_exact(&mut h).map_err(|e| io_err("receive hello", e))?;
                    check_hello(&h)?;
                    set(&stream, opts.timeout)?;
                    return Ok(Client {
                        stream,
                        opts,
                        ticket,
                        broken: false,
                        answered_error: false,
                        sent: false,
                        expect_frames: None,
                    });
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

    /// The next request's value must have frames adding up to `bytes` (what its sender announced
    /// elsewhere): a value header that says otherwise fails the request as it arrives, before any
    /// of the value is read or stored, so a fetch into a key never replaces its old value with a
    /// value it then has to take back.
    pub fn expect_frames_total(&mut self, bytes: u64) {
        self.expect_frames = Some(bytes);
    }

    /// Run `f` (one request and its response), marking the connection unusable if it fails midway.
    pub(super) fn guarded<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
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

    pub(super) fn request(&mut self, key: &[u8]) -> Result<Option<StreamedValue>> {
        if key.len() > MAX_KEY_BYTES {
            return Err(Error::KeyTooLarge { len: key.len(), max: MAX_KEY_BYTES });
        }
        let mut req = vec![OP_GET];
        req.extend_from_slice(&self.ticket.to_bytes());
        req.extend_from_slice(&(key.len() as u32).to_le_bytes());
        req.extend_from_slice(key);
        let expect = self.expect_frames.take();
        self.sent = true;
        self.stream.write_all(&req).map_err(|e| io_err("send request", e))?;
        // The response's head (status, an error's text, a value's header and frame table) under
        // one deadline, however the peer paces its bytes; the payload then has its own.
        let timeout = self.opts.timeout;
        let mut head = Paced::head(&mut self.stream, timeout);
        let mut st = [0u8; 1];
        head.read_exact(&mut st).map_err(|e| io_err("receive response", e))?;
        match st[0] {
            ST_VALUE => {
                let m = read_value_header(&mut head, self.opts.max_value_bytes)?;
                let total: u64 = m.frame_lens.iter().sum();
                match expect {
                    Some(n) if n != total => {
                        Err(proto(format!("the peer announced {n} bytes and sends a value of {total}")))
                    }
                    _ => Ok(Some(m)),
                }
            }
            ST_NOT_FOUND => Ok(None),
            ST_ERROR => {
                let mut l = [0u8; 4];
                head.read_exact(&mut l).map_err(|e| io_err("receive error", e))?;
                let len = u32::from_le_bytes(l) as usize;
                let mut msg = vec![0u8; len.min(MAX_ERROR_BYTES)];
                head.read_exact(&mut msg).map_err(|e| io_err("receive error", e))?;
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

    pub(super) fn get_inner(&mut self, key: &[u8]) -> Result<Option<Frames>> {
        let Some(m) = self.request(key)? else { return Ok(None) };
        self.receive_whole(&m).map(Some)
    }

    /// Read the stored payload announced by `m` into memory, verify it, decompress it, cut it into
    /// frames (bounded by `max_value_bytes`, checked when the header was read).
    pub(super) fn receive_whole(&mut self, m: &StreamedValue) -> Result<Frames> {
        stored::read(m, &mut Paced::payload(&mut self.stream, &self.opts), self.opts.max_value_bytes)
    }

    /// Fetch `key` straight into `log` under `as_key`, in stored form, never holding the value in
    /// memory. Returns whether the server had it; on any failure nothing is stored.
    pub fn get_into<B: Backend>(&mut self, key: &[u8], log: &SegmentLog<B>, as_key: &[u8]) -> Result<bool> {
        self.guarded(|c| {
            let Some(m) = c.request(key)? else { return Ok(false) };
            let opts = c.opts.clone();
            log.put_stream(as_key, &m, &mut Paced::payload(&mut c.stream, &opts)).map(|()| true)
        })
    }

    /// Fetch `key` straight onto `store`'s disk under `as_key` ([`Store::put_stream`]), never
    /// holding it in memory (unless max_spill has no room for it: then into memory, serialized).
    /// `Ok(false)` if the server does not have it; [`Error::Superseded`] if a put or remove of
    /// `as_key` came meanwhile (nothing stored).
    pub fn stream_into_store<C: Codec, B: Backend>(
        &mut self,
        key: &[u8],
        store: &Store<C, B>,
        as_key: &[u8],
    ) -> Result<bool> {
        self.guarded(|c| {
            let Some(m) = c.request(key)? else { return Ok(false) };
            let opts = c.opts.clone();
            let stored = store.put_stream(as_key, &m, &mut Paced::payload(&mut c.stream, &opts))?;
            stored
                .then_some(true)
                .ok_or_else(|| Error::Superseded { key: String::from_utf8_lossy(as_key).into_owned() })
        })
    }

    /// Fetch `key` into `store` under the same key ([`Store::receive`] decides between memory and
    /// disk). Returns whether the server had the key; on any failure nothing is stored, and the
    /// key's old value, if any, stays ([`Error::Superseded`]: a put or remove of the key came
    /// meanwhile, and stands).
    pub fn get_into_store<C: Codec, B: Backend>(&mut self, key: &[u8], store: &Store<C, B>) -> Result<bool> {
        self.guarded(|c| {
            let Some(m) = c.request(key)? else { return Ok(false) };
            let opts = c.opts.clone();
            let stored = store.receive(key, &m, &mut Paced::payload(&mut c.stream, &opts))?;
            stored.then_some(true).ok_or_else(|| Error::Superseded { key: String::from_utf8_lossy(key).into_owned() })
        })
    }

    /// Fetch `key` and write its frames, back to back, to `out`, streaming uncompressed values in
    /// pieces. The checksum is checked at the end: on a mismatch the bytes are already written and
    /// the error says so. Returns whether the server had the key.
    pub fn get_to(&mut self, key: &[u8], out: &mut dyn Write) -> Result<bool> {
        self.guarded(|c| c.get_to_inner(key, out))
    }

    pub(super) fn get_to_inner(&mut self, key: &[u8], out: &mut dyn Write) -> Result<bool> {
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
        // The first span not yet written out whole: each read looks at the spans it reaches from
        // there, so a value of 65535 frames costs 65535 looks in all, not per read.
        let mut next = 0;
        let mut src = Paced::payload(&mut self.stream, &self.opts);
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
            while let Some(&(a, b)) = spans.get(next).filter(|&&(a, _)| a < hi) {
                let (s, e) = (a.max(lo), b.min(hi));
                if s < e {
                    out.write_all(&buf[(s - lo) as usize..(e - lo) as usize]).map_err(|e| io_err("write output", e))?;
                }
                if b > hi {
                    break; // the rest of this frame comes with the next read
                }
                next += 1;
            }
            pos = hi;
        }
        let actual = crc.finalize();
        if actual != m.payload_crc {
            return Err(Error::peer_checksum("received value (already written out)", m.payload_crc, actual));
        }
        Ok(true)
    }
}
