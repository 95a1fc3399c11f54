//! The smallest executor: [`block_on`] runs one future on the calling thread.
//!
//! The io_uring backend's blocking API is its async API waited on with this: one completion path,
//! whether the caller is a thread or a task.

use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::{self, Thread};

struct ThreadWaker(Thread);

impl Wake for ThreadWaker {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.0.unpark();
    }
}

/// Poll `f` to completion, parking the thread between wake-ups.
pub fn block_on<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    let waker = Waker::from(Arc::new(ThreadWaker(thread::current())));
    let mut cx = Context::from_waker(&waker);
    loop {
        match f.as_mut().poll(&mut cx) {
            Poll::Ready(v) => return v,
            // A spurious unpark only costs another poll.
            Poll::Pending => thread::park(),
        }
    }
}
