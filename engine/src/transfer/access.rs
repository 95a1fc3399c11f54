//! Who may read what from a transfer server: tickets and the grants behind them.
//!
//! Every request carries a [`Ticket`]: a 64-bit id and a 128-bit secret drawn from the operating
//! system's random source. A server answers a request only if its [`Access`] accepts the ticket:
//!
//! * a **standing** ticket (id 0) opens every key of the server's source (the CLI's
//!   `spillway serve --token`);
//! * a **grant** opens one key, once, for a short time, optionally to one peer address only:
//!   [`Access::grant`] pins the key's record (the value sent is the one granted, whatever happens
//!   to the key afterwards) and returns the ticket the owner hands to one requester. Redeeming it,
//!   revoking it or its expiry drops the pin.
//!
//! Secrets are compared in constant time; a refused request learns nothing about why it was
//! refused (unknown id, wrong secret, another key, another peer, used, expired all read "not
//! authorized").

use std::collections::HashMap;
use std::fmt;
use std::net::{IpAddr, Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, PoisonError, Weak};
use std::time::{Duration, Instant};

use crate::backend::Backend;
use crate::error::{Error, Result};

use super::{Outgoing, Source, MAX_WAIT};

/// Bytes of a [`Ticket`] on the wire: the id (u64, little-endian), then the secret.
pub const TICKET_BYTES: usize = 24;

/// Live grants an [`Access`] holds at most; a grant beyond fails with [`Error::Exhausted`] until
/// some are redeemed, revoked or expired.
pub const MAX_GRANTS: usize = 16384;

/// A request's credential: an id naming a grant (0: the standing ticket) and its secret. Its
/// `Debug` shows the id only.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Ticket {
    id: u64,
    secret: [u8; 16],
}

impl fmt::Debug for Ticket {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Ticket({:#x}, secret hidden)", self.id)
    }
}

fn random_bytes(out: &mut [u8]) -> Result<()> {
    let mut at = 0;
    while at < out.len() {
        match rustix::rand::getrandom(&mut out[at..], rustix::rand::GetRandomFlags::empty()) {
            Ok(n) => at += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(Error::io("draw random bytes", None, e.into())),
        }
    }
    Ok(())
}

impl Ticket {
    /// A ticket from its parts (for tools and tests; servers draw theirs with [`Ticket::standing`]
    /// and [`Access::grant`]).
    pub const fn new(id: u64, secret: [u8; 16]) -> Ticket {
        Ticket { id, secret }
    }

    /// A fresh standing ticket (id 0, a random secret), for [`Access::standing`].
    pub fn standing() -> Result<Ticket> {
        let mut secret = [0u8; 16];
        random_bytes(&mut secret)?;
        Ok(Ticket { id: 0, secret })
    }

    /// The id: 0 for a standing ticket, else the grant's.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The ticket as it goes on the wire.
    pub fn to_bytes(&self) -> [u8; TICKET_BYTES] {
        let mut b = [0u8; TICKET_BYTES];
        b[..8].copy_from_slice(&self.id.to_le_bytes());
        b[8..].copy_from_slice(&self.secret);
        b
    }

    /// A ticket from its wire form; `None` unless `b` is [`TICKET_BYTES`] long.
    pub fn from_bytes(b: &[u8]) -> Option<Ticket> {
        let b: &[u8; TICKET_BYTES] = b.try_into().ok()?;
        Some(Ticket { id: u64::from_le_bytes(b[..8].try_into().ok()?), secret: b[8..].try_into().ok()? })
    }

    /// The wire form in lower-case hex (48 characters), for a command line or an environment
    /// variable.
    pub fn to_hex(&self) -> String {
        self.to_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// A ticket from [`Ticket::to_hex`]'s form.
    pub fn from_hex(s: &str) -> Result<Ticket> {
        let bad = || Error::InvalidConfig(format!("a ticket is {} hex digits", 2 * TICKET_BYTES));
        let s = s.trim();
        if s.len() != 2 * TICKET_BYTES || !s.is_ascii() {
            return Err(bad());
        }
        let bytes: Option<Vec<u8>> =
            (0..TICKET_BYTES).map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()).collect();
        bytes.as_deref().and_then(Ticket::from_bytes).ok_or_else(bad)
    }
}

/// Whether two secrets are equal, in time that does not depend on where they differ.
fn same_secret(a: &[u8; 16], b: &[u8; 16]) -> bool {
    let diff = a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y));
    // Through black_box: the compiler may not turn the fold back into an early-exit comparison.
    std::hint::black_box(diff) == 0
}

type FileOf<S> = <<S as Source>::Backend as Backend>::File;

struct Grant<S: Source> {
    secret: [u8; 16],
    key: Vec<u8>,
    /// The only peer address the grant may be redeemed from, if any.
    to: Option<IpAddr>,
    expires: Instant,
    /// The source the value came from: not kept alive by the grant (closing it is not held up by
    /// grants nobody redeems; redeeming one after it closed is refused).
    src: Weak<S>,
    /// The value as granted: its record pinned, or its frames.
    value: Outgoing<FileOf<S>>,
}

/// What a request was let through to: the source and, for a grant, the value granted.
pub(crate) struct Admitted<S: Source> {
    src: Arc<S>,
    value: Option<Outgoing<FileOf<S>>>,
}

impl<S: Source> Admitted<S> {
    /// The source, and the value granted (none for a request of the source's own values).
    pub(crate) fn into_parts(self) -> (Arc<S>, Option<Outgoing<FileOf<S>>>) {
        (self.src, self.value)
    }
}

/// Why [`Access::admit`] did not let a request through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Refused {
    /// The ticket does not open the key (answered "not authorized"); a grant named is used up.
    NotAuthorized,
    /// The ticket opens the key, but the connection lost its place before it was admitted (see
    /// [`serve`](super::serve)): nothing was used up, the ticket is good for another connection.
    Cut,
}

/// The grants of an [`Access`], and when the first of them expires (so that expired ones are
/// swept as soon as there are any, and only then).
struct Grants<S: Source> {
    live: HashMap<u64, Grant<S>>,
    first_expiry: Option<Instant>,
}

impl<S: Source> Grants<S> {
    /// Drop the grants that expired (and their pins).
    fn sweep(&mut self, now: Instant) {
        if self.first_expiry.is_some_and(|t| t <= now) {
            self.live.retain(|_, g| g.expires > now);
            self.first_expiry = self.live.values().map(|g| g.expires).min();
        }
    }
}

/// The tickets a server accepts: an optional standing ticket and one-time grants (see the module
/// documentation); and the connections being served, which [`Access::close`] cuts.
pub struct Access<S: Source> {
    standing: Option<([u8; 16], Arc<S>)>,
    grants: Mutex<Grants<S>>,
    lifetime: Duration,
    closed: AtomicBool,
    /// The connections being served (a handle of each), by a number of their own.
    serving: Mutex<(u64, HashMap<u64, TcpStream>)>,
}

/// A connection's place in [`Access`]'s `serving`, given back when it drops.
pub(crate) struct Serving<'a, S: Source> {
    access: &'a Access<S>,
    id: u64,
}

impl<S: Source> Drop for Serving<'_, S> {
    fn drop(&mut self) {
        self.access.serving.lock().unwrap_or_else(PoisonError::into_inner).1.remove(&self.id);
    }
}

impl<S: Source> Access<S> {
    /// Access to every key of `src` with `ticket` (whose id must be 0), and to grants.
    pub fn standing(src: Arc<S>, ticket: Ticket) -> Result<Access<S>> {
        if ticket.id != 0 {
            return Err(Error::InvalidConfig("a standing ticket has id 0".into()));
        }
        Ok(Access { standing: Some((ticket.secret, src)), ..Access::grants_only(Duration::from_secs(60)) })
    }

    /// Access to grants only, each valid for `lifetime` after it was made.
    pub fn grants_only(lifetime: Duration) -> Access<S> {
        Access {
            standing: None,
            grants: Mutex::new(Grants { live: HashMap::new(), first_expiry: None }),
            lifetime,
            closed: AtomicBool::new(false),
            serving: Mutex::new((0, HashMap::new())),
        }
    }

    /// The grants, with the expired ones swept.
    fn grants(&self) -> std::sync::MutexGuard<'_, Grants<S>> {
        let mut g = self.grants.lock().unwrap_or_else(PoisonError::into_inner);
        g.sweep(Instant::now());
        g
    }

    /// Close: refuse every request from now on, drop every grant, and cut the connections being
    /// served (a value being sent stops at once), so that nothing holds the sources any longer.
    /// [`serve`](super::serve) keeps accepting until its listener is shut down, and closes each new
    /// connection at once.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        self.revoke_all();
        let serving = std::mem::take(&mut self.serving.lock().unwrap_or_else(PoisonError::into_inner).1);
        for stream in serving.values() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// Register a connection being served (cut by [`Access::close`]); `None` once closed.
    pub(crate) fn enter(&self, stream: &TcpStream) -> Option<Serving<'_, S>> {
        let handle = stream.try_clone().ok()?;
        let id = {
            let mut serving = self.serving.lock().unwrap_or_else(PoisonError::into_inner);
            serving.0 += 1;
            let id = serving.0;
            serving.1.insert(id, handle);
            id
        };
        let entered = Serving { access: self, id };
        // Checked after registering: a close that ran before has not seen this connection.
        (!self.closed.load(Ordering::SeqCst)).then_some(entered)
    }

    /// A one-time ticket for `key`'s value in `src` as it is now, to be redeemed from the peer
    /// address `to` only (any, if `None`): its record is pinned (a delete, an overwrite or
    /// compaction meanwhile does not change what is sent) until the ticket is redeemed, revoked or
    /// expires. `None` if `src` has no such key.
    pub fn grant(&self, src: &Arc<S>, key: &[u8], to: Option<IpAddr>) -> Result<Option<Ticket>> {
        let Some(value) = src.outgoing(key)? else { return Ok(None) };
        let mut raw = [0u8; TICKET_BYTES];
        let now = Instant::now();
        if self.closed.load(Ordering::SeqCst) {
            let closed = std::io::Error::new(std::io::ErrorKind::NotConnected, "the transfer server is closed");
            return Err(Error::io("grant a transfer", None, closed));
        }
        let mut grants = self.grants();
        if grants.live.len() >= MAX_GRANTS {
            return Err(Error::Exhausted(format!("{MAX_GRANTS} transfer grants are live")));
        }
        let id = loop {
            random_bytes(&mut raw)?;
            let t = Ticket::from_bytes(&raw).expect("ticket-sized");
            if t.id != 0 && !grants.live.contains_key(&t.id) {
                break t;
            }
        };
        let g = Grant {
            secret: id.secret,
            key: key.to_vec(),
            to,
            expires: now + self.lifetime.min(MAX_WAIT),
            src: Arc::downgrade(src),
            value,
        };
        grants.first_expiry = Some(grants.first_expiry.map_or(g.expires, |t| t.min(g.expires)));
        grants.live.insert(id.id, g);
        Ok(Some(id))
    }

    /// Drop `ticket`'s grant (and its pin) if it is still live. Returns whether it was.
    pub fn revoke(&self, ticket: &Ticket) -> bool {
        let mut grants = self.grants();
        match grants.live.get(&ticket.id) {
            Some(g) if same_secret(&g.secret, &ticket.secret) => grants.live.remove(&ticket.id).is_some(),
            _ => false,
        }
    }

    /// Drop every grant.
    pub fn revoke_all(&self) {
        let all = std::mem::take(&mut self.grants().live);
        drop(all); // (the pins go here, outside the lock)
    }

    /// Grants live now.
    pub fn live_grants(&self) -> usize {
        self.grants().live.len()
    }

    /// Drop the grants that expired (and their pins) now; how long until the next one expires
    /// (`None`: no grant is live).
    pub(crate) fn sweep_expired(&self) -> Option<Duration> {
        let g = self.grants();
        g.first_expiry.map(|t| t.saturating_duration_since(Instant::now()))
    }

    /// What a request for `key` with `ticket` from the peer address `peer` may read. A grant is
    /// used up by any attempt to redeem it, except one whose connection has lost its place:
    /// `hold` runs once the ticket is found good, under the lock of the grants, and admits the
    /// connection to its place (never cut off from then on) or returns false if it was cut off
    /// already; then nothing is used up (`Refused::Cut`). So a grant is never used up by a
    /// connection that is cut off before its value is sent.
    pub(crate) fn admit(
        &self,
        ticket: &Ticket,
        key: &[u8],
        peer: Option<IpAddr>,
        hold: &dyn Fn() -> bool,
    ) -> std::result::Result<Admitted<S>, Refused> {
        if ticket.id == 0 {
            let (secret, src) = self.standing.as_ref().ok_or(Refused::NotAuthorized)?;
            if !same_secret(secret, &ticket.secret) {
                return Err(Refused::NotAuthorized);
            }
            return if hold() { Ok(Admitted { src: src.clone(), value: None }) } else { Err(Refused::Cut) };
        }
        if self.closed.load(Ordering::SeqCst) {
            return Err(Refused::NotAuthorized);
        }
        let mut grants = self.grants();
        let g = grants.live.get(&ticket.id).ok_or(Refused::NotAuthorized)?;
        let ok = same_secret(&g.secret, &ticket.secret)
            && g.key == key
            && g.to.is_none_or(|to| Some(to) == peer)
            && g.expires > Instant::now();
        let src = if ok { g.src.upgrade() } else { None };
        if src.is_some() && !hold() {
            drop(grants);
            return Err(Refused::Cut);
        }
        let g = grants.live.remove(&ticket.id).expect("looked up under the same lock");
        drop(grants); // (a grant refused drops its pin here, outside the lock)
        let src = src.ok_or(Refused::NotAuthorized)?;
        Ok(Admitted { src, value: Some(g.value) })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::SimBackend;
    use crate::log::{LogOptions, SegmentLog};
    use crate::value::Frames;

    /// A grant is not used up by a request whose connection lost its place before it was
    /// admitted (`hold` says so): the ticket serves the holder's next connection. A request the
    /// ticket does not open uses it up without asking `hold`.
    #[test]
    fn a_grant_is_not_used_up_by_a_connection_cut_off_before_it_is_admitted() {
        let opts = LogOptions { segment_bytes: 64 * 1024, ..Default::default() };
        let log = Arc::new(SegmentLog::open(SimBackend::new(), "/s", opts).unwrap());
        log.put(b"k", &Frames::from(b"v".to_vec())).unwrap();
        let access = Access::grants_only(Duration::from_secs(60));
        let t = access.grant(&log, b"k", None).unwrap().unwrap();
        assert_eq!(access.admit(&t, b"k", None, &|| false).err(), Some(Refused::Cut));
        assert_eq!(access.live_grants(), 1, "the grant is still there");
        assert!(access.admit(&t, b"k", None, &|| true).is_ok());
        assert_eq!(access.live_grants(), 0, "used");
        let t = access.grant(&log, b"k", None).unwrap().unwrap();
        let asked = || -> bool { panic!("`hold` is not asked about a ticket that does not open the key") };
        assert_eq!(access.admit(&t, b"other", None, &asked).err(), Some(Refused::NotAuthorized));
        assert_eq!(access.live_grants(), 0, "used up by the attempt");
    }
}
