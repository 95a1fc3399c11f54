//! The spill writes in flight: at most one per key, each with a ticket (a `flush` waits for the
//! writes older than itself), and the memory weight and serialized bytes they carry (the bytes count
//! against `max_spill` until the write lands).

use std::sync::Arc;

use crate::key::KeyMap;

/// The writes running outside the store's lock. Each is begun with the weight and bytes it
/// carries and ended with the same, so both totals are 0 when no write runs (see
/// [`Writes::check`]).
#[derive(Default)]
pub(super) struct Writes {
    /// Each key being written, with its write's ticket.
    keys: KeyMap<Arc<[u8]>, u64>,
    next_ticket: u64,
    /// Memory weight of the values being written: still counted in memory (the bytes are still
    /// there) until the write lands.
    weight: u64,
    /// Serialized bytes being written (reserved against `max_spill`).
    raw: u64,
}

impl Writes {
    /// `key` is being written from now on, carrying `weight` and `raw` (either may be added
    /// later: [`Writes::reserve`]). A key is in at most one write: the caller has checked.
    pub(super) fn begin(&mut self, key: Arc<[u8]>, weight: u64, raw: u64) {
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        let before = self.keys.insert(key, ticket);
        debug_assert!(before.is_none(), "a key in two writes");
        self.weight += weight;
        self.raw += raw;
    }

    /// The write of `key` is over: the inverse of [`Writes::begin`] with the same amounts.
    pub(super) fn end(&mut self, key: &[u8], weight: u64, raw: u64) {
        self.keys.remove(key);
        self.weight -= weight;
        self.raw -= raw;
    }

    /// Reserve `raw` more serialized bytes for writes begun (learned once they are serialized).
    pub(super) fn reserve(&mut self, raw: u64) {
        self.raw += raw;
    }

    /// Give back bytes taken by [`Writes::reserve`].
    pub(super) fn release(&mut self, raw: u64) {
        self.raw -= raw;
    }

    /// Whether a write of `key` runs.
    pub(super) fn contains(&self, key: &[u8]) -> bool {
        self.keys.contains_key(key)
    }

    /// The ticket the next write will get: the writes running now are those before it.
    pub(super) fn next_ticket(&self) -> u64 {
        self.next_ticket
    }

    /// Whether a write begun before `ticket` still runs.
    pub(super) fn any_before(&self, ticket: u64) -> bool {
        self.keys.values().any(|&t| t < ticket)
    }

    /// Memory weight of the values being written.
    pub(super) fn weight(&self) -> u64 {
        self.weight
    }

    /// Serialized bytes being written or reserved.
    pub(super) fn raw(&self) -> u64 {
        self.raw
    }

    /// Whether no write runs.
    pub(super) fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// With no write running, nothing may be counted as being written.
    pub(super) fn check(&self) -> Result<(), String> {
        if self.keys.is_empty() && (self.weight, self.raw) != (0, 0) {
            return Err(format!(
                "no write in flight, but {} weight and {} bytes counted as being written",
                self.weight, self.raw
            ));
        }
        Ok(())
    }
}
