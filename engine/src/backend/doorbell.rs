//! The sleep/wake handshake between the io_uring driver thread and the threads that queue requests
//! for it. It is the driver's one piece of lock-free shared state, kept apart so that `loom-tests/`
//! can model it as it is (its atomic comes from `crate::sync`).
//!
//! The driver only sleeps in the kernel after announcing it with `idle = true` and then finding the
//! request queue empty; a sender first queues, then clears `idle` and rings (an `eventfd` write) only
//! if it was set. Both steps are `SeqCst`, so one of two things holds for every request: the driver's
//! re-check sees it, or the sender sees `idle` and rings. A request is never left queued while the
//! driver sleeps for lack of a wake-up. Extra rings only cause a spurious wake-up.

use crate::sync::{AtomicBool, Ordering};

/// The `idle` flag and its protocol (see the module documentation).
#[derive(Debug, Default)]
pub struct Doorbell {
    /// True while the driver is (about to be) asleep; whoever flips it back rings.
    idle: AtomicBool,
}

impl Doorbell {
    /// A doorbell whose sleeper is awake.
    pub fn new() -> Doorbell {
        Doorbell { idle: AtomicBool::new(false) }
    }

    /// Sender side, called after the request is queued: whether the caller must ring (wake the
    /// sleeper).
    pub fn must_ring(&self) -> bool {
        // `swap(false)` would say the same for a bool, but loom 0.7 can let a `swap` read a value older
        // than one that happens-before it (tokio-rs/loom#254, #389), which shows up in the model as a
        // lost wake-up that cannot happen; its compare-exchange is modelled correctly.
        self.idle.compare_exchange(true, false, Ordering::SeqCst, Ordering::SeqCst).is_ok()
    }

    /// Sleeper side: announce the intent to sleep, then re-check for queued work with `work_queued`.
    /// Returns whether the sleeper may now block until rung; if not, it must take the queued work.
    pub fn may_sleep(&self, work_queued: impl FnOnce() -> bool) -> bool {
        self.idle.store(true, Ordering::SeqCst);
        if work_queued() {
            self.idle.store(false, Ordering::SeqCst);
            return false;
        }
        true
    }

    /// Sleeper side: it woke up (rung, or for another reason).
    pub fn awake(&self) {
        self.idle.store(false, Ordering::SeqCst);
    }
}
