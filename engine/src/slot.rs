//! The materialization slot: one per stored value, guaranteeing that a serialized value is
//! deserialized exactly once however many threads ask for it at the same moment.
//!
//! ```text
//!            try_begin (under the wait lock)        success: publish value
//!   IDLE ----------------------------------> MATERIALIZING ----------------> READY
//!    ^  \                                         |                           |
//!    |   `<-------- failure: record error --------'                           |
//!    |                                                                        | evict (no readers)
//!    `---------------------------- EVICTING <---------------------------------'
//! ```
//!
//! One `AtomicU64` packs the state (low 2 bits) and a count of readers inside the ready fast path
//! (the rest). The fast path is one `fetch_add`, an `Arc` clone and one `fetch_sub`: no lock. A reader
//! counted in the word pins the value: eviction only succeeds by a compare-exchange that expects
//! `READY` with zero readers, so the value cannot be freed under a reader.
//!
//! Slow paths use a mutex and condition variable: becoming the materializer (IDLE -> MATERIALIZING)
//! happens under the mutex together with bumping the attempt counter, so a waiter knows exactly which
//! attempt it waits for; a failed attempt records its error under the mutex, and every thread waiting
//! for *that* attempt returns the same error. The deserialize itself runs with no lock held.
//!
//! All atomics, locks and cells come from `crate::sync`, so `loom-tests/` model-checks this code as
//! it is. This module contains `unsafe` for the value cell; each site names its invariant.
#![allow(unsafe_code)]

use crate::sync::{yield_now, Arc, AtomicU64, Condvar, Mutex, Ordering, UnsafeCell};

const STATE_MASK: u64 = 0b11;
const IDLE: u64 = 0;
const MATERIALIZING: u64 = 1;
const READY: u64 = 2;
const EVICTING: u64 = 3;
const READER: u64 = 4;
// IDLE is the zero state: moving out of it adds the new state, moving into it subtracts the old one.
const _: () = assert!(IDLE == 0);

/// The state of a slot, as observed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotState {
    /// No materialized value (the value lives serialized, in memory or on disk).
    Idle,
    /// One thread is deserializing; others wait for it.
    Materializing,
    /// The value is materialized and shared.
    Ready,
    /// The value is being taken out by eviction (transient).
    Evicting,
}

struct Wait<V, E> {
    /// Number of materialization attempts started.
    attempt: u64,
    /// The most recent successful attempt and its value, kept only while threads that waited for
    /// it have not taken it: the value may be evicted as soon as it is published (a value heavier
    /// than the store's target is handed to its callers and not kept), and a waiter must not then
    /// deserialize it again. Cleared when the last waiter leaves.
    success: Option<(u64, Arc<V>)>,
    /// The most recent failed attempt and its error. Boxed: failures are rare, and inline the error
    /// would make a store entry's `Arc<Slot>` a 128-byte allocation, which glibc frees through its
    /// coalescing path once its per-thread cache is full (fast bins stop at 120-byte requests), as
    /// it is when a worker removes many keys. Boxed, it is 72 bytes.
    failure: Option<Box<(u64, E)>>,
    /// Threads blocked in `cond.wait`. A finishing materializer notifies only when there are some:
    /// `notify_all` is a futex system call even with nobody waiting, and the common get has no
    /// waiters. Changed and read under `wait`, so a waiter is counted before it can miss a notify.
    waiters: u32,
}

/// A per-value materialization slot. `V` is the materialized type, `E` the (cloneable) error a failed
/// deserialize reports to every waiter.
pub struct Slot<V, E> {
    word: AtomicU64,
    /// Written only by the thread that moved the state to MATERIALIZING (before publishing READY) or to
    /// EVICTING (after readers drained); read only by readers counted in `word` while it is READY.
    value: UnsafeCell<Option<Arc<V>>>,
    wait: Mutex<Wait<V, E>>,
    cond: Condvar,
}

// SAFETY: `value` is accessed only under the protocol described on the field: exclusive writers
// (MATERIALIZING or EVICTING owner) never overlap counted readers, and readers only take `&Arc<V>`
// to clone it. With `V: Send + Sync` the shared `Arc<V>` may move between threads; `E` is behind a
// Mutex.
unsafe impl<V: Send + Sync, E: Send> Sync for Slot<V, E> {}
// SAFETY: all fields are owned; sending the slot sends an `Option<Arc<V>>` and `E`s.
unsafe impl<V: Send + Sync, E: Send> Send for Slot<V, E> {}

impl<V, E: Clone> Default for Slot<V, E> {
    fn default() -> Self {
        Self::new()
    }
}

impl<V, E: Clone> Slot<V, E> {
    /// An idle slot (the value exists only in serialized form).
    pub fn new() -> Self {
        Slot {
            word: AtomicU64::new(IDLE),
            value: UnsafeCell::new(None),
            wait: Mutex::new(Wait { attempt: 0, success: None, failure: None, waiters: 0 }),
            cond: Condvar::new(),
        }
    }

    /// A ready slot holding `v` (a value put in materialized form).
    pub fn ready(v: Arc<V>) -> Self {
        let s = Self::new();
        s.value.with_mut(|p| {
            // SAFETY: the slot is not shared yet; we are its only user.
            unsafe { *p = Some(v) }
        });
        s.word.store(READY, Ordering::Release);
        s
    }

    /// The current state.
    pub fn state(&self) -> SlotState {
        match self.word.load(Ordering::Acquire) & STATE_MASK {
            IDLE => SlotState::Idle,
            MATERIALIZING => SlotState::Materializing,
            READY => SlotState::Ready,
            _ => SlotState::Evicting,
        }
    }

    /// Threads waiting for the materialization in progress (for tests and diagnostics).
    pub fn waiters(&self) -> u32 {
        self.wait.lock().unwrap_or_else(|p| p.into_inner()).waiters
    }

    /// The fast path: the materialized value if the slot is ready. No lock.
    pub fn try_get(&self) -> Option<Arc<V>> {
        let w = self.word.fetch_add(READER, Ordering::Acquire);
        let v = if w & STATE_MASK == READY {
            self.value.with(|p| {
                // SAFETY: we are a counted reader and observed READY (Acquire pairs with the Release
                // that published it). Eviction needs zero readers to take the value, and nobody else
                // writes it in READY, so the value is initialized and stays alive while we clone it.
                unsafe { (*p).clone() }
            })
        } else {
            None
        };
        self.word.fetch_sub(READER, Ordering::Release);
        v
    }

    /// Return the materialized value, running `materialize` if needed. Exactly one concurrent caller
    /// runs it; the others wait and receive the same `Arc`, or the same error if it fails (the slot is
    /// then idle again, so a later call retries).
    pub fn get_or_materialize(&self, materialize: impl FnOnce() -> Result<V, E>) -> Result<Arc<V>, E> {
        self.get_or_install(|| materialize().map(Arc::new))
    }

    /// Like [`get_or_materialize`](Self::get_or_materialize), with a closure that provides the `Arc`
    /// itself (used to put an evicted object back when its demotion failed).
    pub fn get_or_install(&self, materialize: impl FnOnce() -> Result<Arc<V>, E>) -> Result<Arc<V>, E> {
        let mut materialize = Some(materialize);
        loop {
            if let Some(v) = self.try_get() {
                return Ok(v);
            }
            let mut w = self.wait.lock().unwrap_or_else(|p| p.into_inner());
            match self.word.load(Ordering::Acquire) & STATE_MASK {
                IDLE => {
                    if !self.claim() {
                        continue; // lost to an evictor finishing or a racing publish: look again
                    }
                    w.attempt += 1;
                    let attempt = w.attempt;
                    drop(w);
                    let f = materialize.take().expect("a caller materializes at most once");
                    // If `f` panics (a codec's bug), the panic goes to this caller, and the slot must
                    // not stay MATERIALIZING with its waiters asleep for good: the guard makes it idle
                    // and wakes them, and one of them tries again.
                    let guard = Unwinding(self);
                    let r = f();
                    std::mem::forget(guard);
                    return self.finish(attempt, r);
                }
                MATERIALIZING => {
                    let seen = w.attempt;
                    w.waiters += 1;
                    while self.word.load(Ordering::Acquire) & STATE_MASK == MATERIALIZING {
                        w = self.cond.wait(w).unwrap_or_else(|p| p.into_inner());
                    }
                    w.waiters -= 1;
                    // The attempt this thread waited for: its value, even if it was evicted since,
                    // or its error, even if another thread has started a new attempt since (every
                    // waiter of one attempt gets the same answer, whatever the timing).
                    let answer = match (&w.success, w.failure.as_deref()) {
                        (Some((a, v)), _) if *a == seen => Some(Ok(v.clone())),
                        (_, Some((a, e))) if *a == seen => Some(Err(e.clone())),
                        _ => None,
                    };
                    if w.waiters == 0 {
                        w.success = None; // nobody left to hand it to
                    }
                    if let Some(answer) = answer {
                        return answer;
                    }
                }
                _ => {
                    // READY: published since `try_get` above, so loop to take it. EVICTING is a few
                    // instructions long and never waits on anything: spin.
                    drop(w);
                    yield_now();
                }
            }
        }
    }

    /// Become the materializer: IDLE -> MATERIALIZING, keeping the reader count. False if the slot
    /// left IDLE first.
    fn claim(&self) -> bool {
        let mut cur = self.word.load(Ordering::Acquire);
        while cur & STATE_MASK == IDLE {
            match self.word.compare_exchange_weak(cur, cur + MATERIALIZING, Ordering::AcqRel, Ordering::Acquire) {
                Ok(_) => return true,
                Err(actual) => cur = actual,
            }
        }
        false
    }

    /// The materializer unwound out of its closure: back to IDLE, waiters woken (they find no answer
    /// for their attempt and start over).
    fn abandon(&self) {
        let w = self.wait.lock().unwrap_or_else(|p| p.into_inner());
        self.word.fetch_sub(MATERIALIZING, Ordering::AcqRel);
        if w.waiters > 0 {
            self.cond.notify_all();
        }
    }

    fn finish(&self, attempt: u64, r: Result<Arc<V>, E>) -> Result<Arc<V>, E> {
        match r {
            Ok(v) => {
                self.value.with_mut(|p| {
                    // SAFETY: we own the MATERIALIZING state: readers do not read in this state and no
                    // other writer exists until we publish READY below.
                    unsafe { *p = Some(v.clone()) }
                });
                self.word.fetch_add(READY - MATERIALIZING, Ordering::AcqRel);
                let mut w = self.wait.lock().unwrap_or_else(|p| p.into_inner());
                if w.waiters > 0 {
                    w.success = Some((attempt, v.clone()));
                    self.cond.notify_all();
                }
                Ok(v)
            }
            Err(e) => {
                let mut w = self.wait.lock().unwrap_or_else(|p| p.into_inner());
                w.failure = Some(Box::new((attempt, e.clone())));
                self.word.fetch_sub(MATERIALIZING, Ordering::AcqRel);
                if w.waiters > 0 {
                    self.cond.notify_all();
                }
                Err(e)
            }
        }
    }

    /// Take the materialized value out (READY -> IDLE), for demotion to serialized form. Fails (returns
    /// `None`) if the slot is not ready or a reader is inside the fast path at this instant.
    pub fn evict(&self) -> Option<Arc<V>> {
        if self.word.compare_exchange(READY, EVICTING, Ordering::AcqRel, Ordering::Acquire).is_err() {
            return None;
        }
        let v = self.value.with_mut(|p| {
            // SAFETY: we moved READY (zero readers) -> EVICTING: new readers see EVICTING and do not
            // read, and no other writer exists in this state.
            unsafe { (*p).take() }
        });
        self.word.fetch_sub(EVICTING, Ordering::AcqRel);
        v
    }
}

/// Armed while a materializer runs its closure; dropped only if the closure unwinds.
struct Unwinding<'a, V, E: Clone>(&'a Slot<V, E>);

impl<V, E: Clone> Drop for Unwinding<'_, V, E> {
    fn drop(&mut self) {
        self.0.abandon();
    }
}

impl<V, E> std::fmt::Debug for Slot<V, E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let w = self.word.load(Ordering::Relaxed);
        f.debug_struct("Slot").field("state", &(w & STATE_MASK)).field("readers", &(w >> 2)).finish()
    }
}

#[cfg(all(test, not(spillway_loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn concurrent_gets_deserialize_once() {
        for _ in 0..50 {
            let slot: Arc<Slot<Vec<u8>, String>> = Arc::new(Slot::new());
            let calls = Arc::new(AtomicUsize::new(0));
            let barrier = Arc::new(std::sync::Barrier::new(8));
            let handles: Vec<_> = (0..8)
                .map(|_| {
                    let (slot, calls, barrier) = (slot.clone(), calls.clone(), barrier.clone());
                    std::thread::spawn(move || {
                        barrier.wait();
                        slot.get_or_materialize(|| {
                            calls.fetch_add(1, Ordering::SeqCst);
                            Ok(vec![1, 2, 3])
                        })
                        .unwrap()
                    })
                })
                .collect();
            let vals: Vec<Arc<Vec<u8>>> = handles.into_iter().map(|h| h.join().unwrap()).collect();
            assert_eq!(calls.load(Ordering::SeqCst), 1);
            assert!(vals.iter().all(|v| Arc::ptr_eq(v, &vals[0])));
        }
    }

    #[test]
    fn failure_reaches_waiters_and_retry_succeeds() {
        let slot: Slot<u32, String> = Slot::new();
        assert_eq!(slot.get_or_materialize(|| Err("bad".to_string())), Err("bad".to_string()));
        assert_eq!(slot.state(), SlotState::Idle);
        assert_eq!(*slot.get_or_materialize(|| Ok(7)).unwrap(), 7);
        assert_eq!(slot.state(), SlotState::Ready);
        let v = slot.evict().unwrap();
        assert_eq!(*v, 7);
        assert_eq!(slot.state(), SlotState::Idle);
        assert!(slot.try_get().is_none());
        assert!(slot.evict().is_none());
    }

    /// A materializer that panics (a codec's bug): the panic reaches its caller, the slot is idle
    /// again, and a thread that was waiting for it materializes instead of sleeping for good.
    #[test]
    fn a_panicking_materializer_leaves_the_slot_usable() {
        let slot: Arc<Slot<u32, String>> = Arc::new(Slot::new());
        let r =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| slot.get_or_materialize(|| panic!("codec bug"))));
        assert!(r.is_err());
        assert_eq!(slot.state(), SlotState::Idle);
        assert_eq!(*slot.get_or_materialize(|| Ok(3)).unwrap(), 3);
        // With a waiter: the materializer panics once the other thread is waiting for it.
        let slot: Arc<Slot<u32, String>> = Arc::new(Slot::new());
        let waiter = std::sync::Mutex::new(None);
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            slot.get_or_materialize(|| {
                let s = slot.clone();
                *waiter.lock().unwrap() = Some(std::thread::spawn(move || *s.get_or_materialize(|| Ok(5)).unwrap()));
                while slot.waiters() == 0 {
                    std::thread::yield_now();
                }
                panic!("codec bug")
            })
        }));
        assert!(r.is_err());
        let t = waiter.lock().unwrap().take().unwrap();
        assert_eq!(t.join().unwrap(), 5, "the waiter materialized after the panic");
        assert_eq!(slot.state(), SlotState::Ready);
    }
}
