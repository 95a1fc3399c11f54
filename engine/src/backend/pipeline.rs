//! Pipelined reads on a ring owned by the calling thread ([`super::Backend::read_pipelined`]).
//!
//! The driver thread of [`super::UringBackend`] serves many threads, at the price of two cross-thread
//! wake-ups per operation. A thread that has many reads to do gains more from doing what fio does:
//! own a ring, keep `depth` reads in flight, submit and reap in the same loop. The ring lives for one
//! call (creating one costs tens of microseconds, nothing next to a stream of reads).
//!
//! Where the ring cannot be created (a memlock or file limit, say), [`ring`] fails and the caller
//! reads one after another instead, saying so once in the log.
//!
//! Buffer ownership: each read's buffer sits in this call's slab from submission until its
//! completion is reaped. If `next` or `done` panics, [`Pipeline`]'s `Drop` reaps every read still in
//! flight before the slab (and with it the buffers) is freed, so the kernel never writes into freed
//! memory.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};

use io_uring::{opcode, types, IoUring};
use slab::Slab;

use super::{BufResult, PipelinedRead};
use crate::buf::AlignedBuf;

struct Op<F> {
    read: PipelinedRead<F>,
    /// Bytes already read.
    done: usize,
}

impl<F> Op<F> {
    /// The read's completion `res` came (of a file opened with O_DIRECT or not): `Some` with its
    /// result if it is over, `None` if the rest is to be read (a short read, EAGAIN or EINTR).
    fn completed(&mut self, res: i32, o_direct: bool) -> Option<io::Result<()>> {
        if res < 0 {
            let errno = -res;
            return if errno == libc::EAGAIN || errno == libc::EINTR {
                None
            } else {
                Some(Err(io::Error::from_raw_os_error(errno)))
            };
        }
        if res == 0 {
            return Some(Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read met end of file")));
        }
        self.done += res as usize;
        let end = self.read.offset + self.done as u64;
        if self.done == self.read.buf.len() {
            Some(Ok(()))
        } else if o_direct && end % 512 != 0 {
            // An O_DIRECT read that ended short at an unaligned offset: the rest cannot even be
            // asked for (O_DIRECT needs aligned offsets), so it is the end of the file.
            Some(Err(io::Error::new(io::ErrorKind::UnexpectedEof, "read met end of file")))
        } else {
            None
        }
    }
}

struct Pipeline<F> {
    // Declared first: dropped after `Drop::drop` drained it, before `ops` (field order).
    ring: IoUring,
    ops: Slab<Op<F>>,
}

impl<F> Pipeline<F> {
    /// Queue (the rest of) op `key`'s read; the kernel sees it at the next submit.
    fn push(&mut self, key: usize, (fd, _): (RawFd, bool)) {
        let op = &mut self.ops[key];
        let len = (op.read.buf.len() - op.done).min(1 << 30);
        // SAFETY: `done + len <= buf.len()`, so the pointer stays inside the buffer.
        let ptr = unsafe { op.read.buf.as_mut_ptr().add(op.done) };
        let e = opcode::Read::new(types::Fd(fd), ptr, len as u32)
            .offset(op.read.offset + op.done as u64)
            .build()
            .user_data(key as u64);
        // SAFETY: the buffer belongs to `self.ops[key]` until this read's completion is reaped (an op
        // leaves the slab only then, in `run` or in `drop`), and `op.read.file` keeps the fd open. The
        // submission queue has `depth` entries and each op has at most one read in flight, so it
        // cannot be full.
        unsafe { self.ring.submission().push(&e) }.expect("one entry per op fits");
    }

    /// Hand queued entries to the kernel without waiting for any completion.
    fn submit_only(&mut self) -> io::Result<()> {
        match self.ring.submit() {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    fn wait(&mut self) -> io::Result<()> {
        match self.ring.submit_and_wait(1) {
            Ok(_) => Ok(()),
            Err(e) if matches!(e.raw_os_error(), Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)) => Ok(()),
            Err(e) => Err(e),
        }
    }
}

impl<F> Drop for Pipeline<F> {
    fn drop(&mut self) {
        // Reap every read still in flight before the buffers go. Each op has exactly one read in
        // flight, so each completion retires one op.
        while !self.ops.is_empty() {
            if let Err(e) = self.wait() {
                // The ring is unusable: leaking the buffers is the only sound choice left.
                log::error!("io_uring pipeline: cannot drain reads in flight ({e}); leaking their buffers");
                std::mem::forget(std::mem::take(&mut self.ops));
                return;
            }
            let done: Vec<u64> = self.ring.completion().map(|c| c.user_data()).collect();
            for key in done {
                self.ops.try_remove(key as usize);
            }
        }
    }
}

/// A ring for [`run`] with room for `depth` reads in flight.
pub(super) fn ring(depth: usize) -> io::Result<IoUring> {
    let entries = (depth.clamp(1, 4096) as u32).next_power_of_two();
    // One thread submits and waits: let completions run when it waits (fewer wake-ups); kernels
    // before 6.1 refuse the flags, then plain setup.
    IoUring::builder()
        .setup_single_issuer()
        .setup_defer_taskrun()
        .build(entries)
        .or_else(|_| IoUring::builder().build(entries))
}

/// Log, once per process, that pipelined reads run one after another because `e` kept [`ring`] from
/// creating a ring.
pub(super) fn warn_no_ring(e: &io::Error) {
    static WARNED: AtomicBool = AtomicBool::new(false);
    if !WARNED.swap(true, Ordering::Relaxed) {
        log::warn!("io_uring: creating a ring for pipelined reads failed ({e}); reading one after another");
    }
}

/// Run a stream of reads with up to `depth` in flight on `ring` (from [`ring`]), owned by the calling
/// thread. `file_of` gives a read's descriptor and whether it was opened with O_DIRECT.
pub(super) fn run<F>(
    ring: IoUring,
    depth: usize,
    file_of: impl Fn(&F) -> (RawFd, bool),
    next: &mut dyn FnMut() -> Option<PipelinedRead<F>>,
    done: &mut dyn FnMut(u64, BufResult),
) -> io::Result<()> {
    let depth = depth.clamp(1, 4096);
    let mut p = Pipeline { ring, ops: Slab::with_capacity(depth) };
    let mut exhausted = false;
    let mut cqes: Vec<(u64, i32)> = Vec::with_capacity(depth);
    let mut finished: Vec<(u64, io::Result<()>, AlignedBuf)> = Vec::with_capacity(depth);
    // Start reads from `next` until `depth` are in flight. Each is handed to the kernel at once, as
    // fio does by default: measured against submitting every 4 or 8 or a whole refill at once, the
    // device idled least this way (4 KiB random reads, QD32: 58-60k IOPS against 53-59k, 56-63k and
    // 52-53k), because it completes in bursts and a burst's refill takes a while to build.
    let mut fill = |p: &mut Pipeline<F>, exhausted: &mut bool, done: &mut dyn FnMut(u64, BufResult)| {
        while !*exhausted && p.ops.len() < depth {
            match next() {
                Some(r) if r.buf.is_empty() => done(r.tag, (Ok(()), r.buf)),
                Some(r) => {
                    let fd = file_of(&r.file);
                    let key = p.ops.insert(Op { read: r, done: 0 });
                    p.push(key, fd);
                    p.submit_only()?;
                }
                None => *exhausted = true,
            }
        }
        io::Result::Ok(())
    };
    loop {
        fill(&mut p, &mut exhausted, done)?;
        if p.ops.is_empty() {
            return Ok(());
        }
        p.wait()?;
        cqes.clear();
        cqes.extend(p.ring.completion().map(|c| (c.user_data(), c.result())));
        // Settle every reaped completion before calling back: should `done` panic, no op whose
        // completion was already consumed is left in the slab for the drain to wait on.
        for &(ud, res) in &cqes {
            let key = ud as usize;
            let op = &mut p.ops[key];
            let o_direct = file_of(&op.read.file).1;
            match op.completed(res, o_direct) {
                // Short read, EAGAIN or EINTR: read the rest.
                None => {
                    let fd = file_of(&op.read.file);
                    p.push(key, fd);
                }
                Some(result) => {
                    let op = p.ops.remove(key);
                    finished.push((op.read.tag, result, op.read.buf));
                }
            }
        }
        // Refill before handing the finished reads to `done` (checksums, decoding, the caller's
        // work): the device often completes a whole burst at once, and would otherwise sit idle while
        // the burst is processed.
        fill(&mut p, &mut exhausted, done)?;
        for (tag, result, buf) in finished.drain(..) {
            done(tag, (result, buf));
        }
    }
}
