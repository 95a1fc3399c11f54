//! loom models of the materialization slot (`spillway::slot::Slot`), the production code compiled with
//! `--cfg spillway_loom` so its atomics, locks and cells are loom's. Each model is small (2-3 threads,
//! a few operations) and explored exhaustively up to loom's preemption bound (see docs/testing.md).
#![cfg(spillway_loom)]

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;
use spillway::slot::{Slot, SlotState};

type S = Slot<u64, &'static str>;

/// Two threads get the same serialized value: exactly one deserialize, and both receive the same Arc.
#[test]
fn two_concurrent_gets_deserialize_once() {
    loom::model(|| {
        let slot = Arc::new(S::new());
        let calls = Arc::new(AtomicUsize::new(0));
        let get = |slot: &S, calls: &AtomicUsize| {
            slot.get_or_materialize(|| {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok(42)
            })
            .unwrap()
        };
        let t = {
            let (slot, calls) = (slot.clone(), calls.clone());
            thread::spawn(move || get(&slot, &calls))
        };
        let a = get(&slot, &calls);
        let b = t.join().unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(Arc::ptr_eq(&a, &b));
        assert_eq!(*a, 42);
        assert_eq!(slot.state(), SlotState::Ready);
    });
}

/// Three threads: still one deserialize, one Arc.
#[test]
fn three_concurrent_gets_deserialize_once() {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(2);
    b.check(|| {
        let slot = Arc::new(S::new());
        let calls = Arc::new(AtomicUsize::new(0));
        let spawn = || {
            let (slot, calls) = (slot.clone(), calls.clone());
            thread::spawn(move || {
                slot.get_or_materialize(|| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    Ok(7)
                })
                .unwrap()
            })
        };
        let (t1, t2) = (spawn(), spawn());
        let c = slot.get_or_materialize(|| {
            calls.fetch_add(1, Ordering::SeqCst);
            Ok(7)
        });
        let (a, b) = (t1.join().unwrap(), t2.join().unwrap());
        let c = c.unwrap();
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(Arc::ptr_eq(&a, &b) && Arc::ptr_eq(&b, &c));
    });
}

/// A reader on the lock-free ready path races eviction: the reader gets the value or nothing, never a
/// freed one; eviction either takes the value or backs off; the final state is consistent.
#[test]
fn ready_path_races_eviction() {
    loom::model(|| {
        let slot = Arc::new(S::ready(Arc::new(5)));
        let t = {
            let slot = slot.clone();
            thread::spawn(move || slot.try_get())
        };
        let evicted = slot.evict();
        let read = t.join().unwrap();
        if let Some(v) = &read {
            assert_eq!(**v, 5);
        }
        match &evicted {
            Some(v) => {
                assert_eq!(**v, 5);
                assert_eq!(slot.state(), SlotState::Idle);
            }
            None => {
                // Backed off because the reader was inside the fast path.
                assert!(read.is_some());
                assert_eq!(slot.state(), SlotState::Ready);
            }
        }
    });
}

/// Materialization racing eviction and a later get: whatever the interleaving, every caller gets the
/// right value and no waiter is left asleep.
#[test]
fn get_races_evict_then_rematerialize() {
    loom::model(|| {
        let slot = Arc::new(S::new());
        let calls = Arc::new(AtomicUsize::new(0));
        let t = {
            let (slot, calls) = (slot.clone(), calls.clone());
            thread::spawn(move || {
                let v = slot
                    .get_or_materialize(|| {
                        calls.fetch_add(1, Ordering::SeqCst);
                        Ok(9)
                    })
                    .unwrap();
                assert_eq!(*v, 9);
            })
        };
        let _ = slot.evict();
        let v = slot
            .get_or_materialize(|| {
                calls.fetch_add(1, Ordering::SeqCst);
                Ok(9)
            })
            .unwrap();
        assert_eq!(*v, 9);
        t.join().unwrap();
        let n = calls.load(Ordering::SeqCst);
        assert!((1..=2).contains(&n), "one deserialize per materialization, at most one re-materialization");
    });
}

/// A deserialize fails while another thread waits: the waiter gets the same error (or, if it came
/// after the failure, retries itself); the slot ends idle or ready, and a retry then succeeds.
#[test]
fn failure_wakes_waiters_with_the_error_and_retry_succeeds() {
    loom::model(|| {
        let slot = Arc::new(S::new());
        let calls = Arc::new(AtomicUsize::new(0));
        let t = {
            let (slot, calls) = (slot.clone(), calls.clone());
            thread::spawn(move || {
                slot.get_or_materialize(|| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    Err("corrupt")
                })
            })
        };
        let mine = slot.get_or_materialize(|| {
            calls.fetch_add(1, Ordering::SeqCst);
            Err("corrupt")
        });
        let theirs = t.join().unwrap();
        assert_eq!(mine.unwrap_err(), "corrupt");
        assert_eq!(theirs.unwrap_err(), "corrupt");
        let n = calls.load(Ordering::SeqCst);
        assert!(n == 1 || n == 2, "a waiter of a failed attempt shares its error; a later caller retries");
        assert_eq!(slot.state(), SlotState::Idle);
        assert_eq!(*slot.get_or_materialize(|| Ok(1)).unwrap(), 1);
    });
}

/// States are reported as they are (inside the deserialize: materializing), the debug form shows
/// state and reader count, and an eviction with no reader in the fast path takes the value out.
#[test]
fn states_debug_form_and_uncontended_eviction() {
    loom::model(|| {
        let slot = Arc::new(S::new());
        assert_eq!(slot.state(), SlotState::Idle);
        let inner = slot.clone();
        let v = slot
            .get_or_materialize(|| {
                assert_eq!(inner.state(), SlotState::Materializing);
                Ok(7)
            })
            .unwrap();
        assert_eq!(*v, 7);
        assert_eq!(slot.state(), SlotState::Ready);
        assert_eq!(format!("{:?}", *slot), "Slot { state: 2, readers: 0 }");
        assert_eq!(slot.evict().as_deref(), Some(&7), "nobody reads: eviction must succeed");
        assert_eq!(slot.state(), SlotState::Idle);
        assert_eq!(format!("{:?}", *slot), "Slot { state: 0, readers: 0 }");
        assert!(slot.evict().is_none(), "nothing left to evict");
    });
}

/// An old failure is never reported for a later attempt: after a failed deserialize, two threads get
/// again while a third evicts. Whoever waited on the (successful) second attempt and then finds the
/// slot idle (evicted) must deserialize again, not return the first attempt's error.
#[test]
fn a_stale_failure_is_not_reported_after_a_later_success() {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(2);
    b.check(|| {
        let slot = Arc::new(S::new());
        assert_eq!(slot.get_or_materialize(|| Err("first attempt")).unwrap_err(), "first attempt");
        let getter = |slot: Arc<S>| thread::spawn(move || slot.get_or_materialize(|| Ok(5)).map(|v| *v));
        let a = getter(slot.clone());
        let b = getter(slot.clone());
        let evictor = {
            let slot = slot.clone();
            thread::spawn(move || {
                slot.evict();
            })
        };
        assert_eq!(a.join().unwrap(), Ok(5));
        assert_eq!(b.join().unwrap(), Ok(5));
        evictor.join().unwrap();
    });
}

/// A value that is evicted as soon as it is materialized (the store does this with a value heavier
/// than its target): a thread that was already waiting for that materialization gets its value, and
/// does not deserialize again because the slot is idle by the time it wakes.
#[test]
fn a_waiter_gets_the_value_even_if_it_was_evicted_before_it_woke() {
    loom::model(|| {
        let slot = Arc::new(S::new());
        let calls = Arc::new(AtomicUsize::new(0));
        let waited = Arc::new(loom::sync::atomic::AtomicBool::new(false));
        let get_then_evict = |slot: &S, calls: &AtomicUsize, waited: &loom::sync::atomic::AtomicBool| {
            let v = slot
                .get_or_materialize(|| {
                    calls.fetch_add(1, Ordering::SeqCst);
                    // Someone registered as a waiter for this materialization.
                    if slot.waiters() > 0 {
                        waited.store(true, Ordering::SeqCst);
                    }
                    Ok(9)
                })
                .unwrap();
            slot.evict();
            v
        };
        let t = {
            let (slot, calls, waited) = (slot.clone(), calls.clone(), waited.clone());
            thread::spawn(move || get_then_evict(&slot, &calls, &waited))
        };
        let a = get_then_evict(&slot, &calls, &waited);
        let b = t.join().unwrap();
        if waited.load(Ordering::SeqCst) {
            assert_eq!(calls.load(Ordering::SeqCst), 1, "a waiter deserialized again");
            assert!(Arc::ptr_eq(&a, &b));
        }
        assert_eq!((*a, *b), (9, 9));
    });
}
