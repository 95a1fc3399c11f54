//! loom model of the registered buffer pool's free list (`spillway::buf::BufPool`): its mutex and
//! condvar come from loom through the sync shim. The pool is not lock-free (an empty pool must block,
//! which is back-pressure), so what needs checking is that no check-in is lost and no waiter sleeps
//! forever (loom reports a deadlock when every thread is blocked), and that a buffer is never handed
//! to two holders at once.
#![cfg(spillway_loom)]

use loom::thread;
use spillway::buf::BufPool;

/// One buffer, three threads that each take it (blocking while it is out), stamp it, check the stamp
/// is still theirs, and give it back.
#[test]
fn one_buffer_three_blocking_holders() {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(|| {
        let pool = BufPool::new(1, 512, 512);
        let use_it = |pool: &BufPool, tag: u8| {
            let mut buf = pool.check_out();
            assert_eq!(buf.len(), 0);
            buf.extend_from_slice(&[tag; 8]);
            thread::yield_now();
            assert_eq!(&buf[..], &[tag; 8], "two holders of one buffer");
        };
        let ts: Vec<_> = (1..=2u8)
            .map(|tag| {
                let pool = pool.clone();
                thread::spawn(move || use_it(&pool, tag))
            })
            .collect();
        use_it(&pool, 3);
        for t in ts {
            t.join().unwrap();
        }
        assert_eq!(pool.available(), 1);
    });
}

/// `try_check_out` never blocks and never hands out a buffer that is out.
#[test]
fn try_check_out_races_check_in() {
    loom::model(|| {
        let pool = BufPool::new(1, 512, 512);
        let held = pool.check_out();
        let t = {
            let pool = pool.clone();
            thread::spawn(move || pool.try_check_out().map(|b| b.capacity()))
        };
        drop(held);
        if let Some(cap) = t.join().unwrap() {
            assert_eq!(cap, 512);
        }
        assert_eq!(pool.available(), 1);
        assert!(pool.try_check_out().is_some());
    });
}
