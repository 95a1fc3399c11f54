//! [`SigpipeHeld`]: SIGPIPE held back while the transfer server splices into a socket. Its libc
//! signal calls are unsafe, so they live in a module of their own (see `docs/safety.md`).

#![allow(unsafe_code)]

/// SIGPIPE held back on this thread while it splices into a socket. A socket write from std
/// passes `MSG_NOSIGNAL`; a splice cannot, so a peer that resets the connection would raise
/// SIGPIPE, whose default action kills the process (Rust and Python programs ignore it, but a
/// host process embedding the engine may not). While the guard lives, SIGPIPE is blocked; when it
/// drops, a SIGPIPE the splice raised (pending now, not before) is taken off the thread, and the
/// old mask comes back. The splice itself reports the EPIPE.
pub(crate) struct SigpipeHeld {
    old: libc::sigset_t,
    pending_before: bool,
}

impl SigpipeHeld {
    pub(crate) fn new() -> Self {
        // SAFETY: sigset_t is plain data that sigemptyset initializes; every pointer passed points
        // to a live local; pthread_sigmask and sigpending change or read only this thread's mask
        // and pending set.
        unsafe {
            let mut set: libc::sigset_t = std::mem::zeroed();
            libc::sigemptyset(&mut set);
            libc::sigaddset(&mut set, libc::SIGPIPE);
            let mut old: libc::sigset_t = std::mem::zeroed();
            libc::pthread_sigmask(libc::SIG_BLOCK, &set, &mut old);
            SigpipeHeld { old, pending_before: sigpipe_pending() }
        }
    }
}

/// Whether SIGPIPE is pending for this thread (or the process).
fn sigpipe_pending() -> bool {
    // SAFETY: `pending` is a live local that sigpending fills.
    unsafe {
        let mut pending: libc::sigset_t = std::mem::zeroed();
        libc::sigpending(&mut pending) == 0 && libc::sigismember(&pending, libc::SIGPIPE) == 1
    }
}

impl Drop for SigpipeHeld {
    fn drop(&mut self) {
        // SAFETY: as in `new`; the zero timeout makes sigtimedwait return at once, taking only a
        // SIGPIPE that is pending (blocked, so nothing else could have taken it).
        unsafe {
            if !self.pending_before && sigpipe_pending() {
                let mut set: libc::sigset_t = std::mem::zeroed();
                libc::sigemptyset(&mut set);
                libc::sigaddset(&mut set, libc::SIGPIPE);
                let zero = libc::timespec { tv_sec: 0, tv_nsec: 0 };
                libc::sigtimedwait(&set, std::ptr::null_mut(), &zero);
            }
            libc::pthread_sigmask(libc::SIG_SETMASK, &self.old, std::ptr::null_mut());
        }
    }
}
