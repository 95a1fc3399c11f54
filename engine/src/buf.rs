//! Aligned, owned I/O buffers.
//!
//! O_DIRECT and io_uring registered buffers need memory aligned to the device's DMA alignment, which
//! `Vec<u8>` does not promise. [`AlignedBuf`] is a fixed-capacity heap buffer with a chosen power-of-two
//! alignment and a length (`len <= capacity`). It is the unit of ownership that moves into an I/O
//! operation and comes back out of it (see [`crate::backend::Backend`]), and it converts into
//! [`bytes::Bytes`] without copying so readers can hand slices of a read buffer to consumers.
//!
//! This module is one of the few that contain `unsafe`; each site names its invariant.
#![allow(unsafe_code)]

use std::alloc::{self, Layout};
use std::fmt;
use std::io;
use std::mem::MaybeUninit;
use std::os::fd::AsFd;
use std::ptr::NonNull;
use std::sync::{Arc, PoisonError};

// The free list's lock and condvar come from the sync shim, so `loom-tests/` models check-out and
// check-in as they are.
use crate::sync::{Condvar, Mutex};

use bytes::Bytes;

/// A heap buffer whose start address is a multiple of `align`.
///
/// Invariants: `ptr` points to `cap` bytes that `self` owns exclusively until it drops: either
/// `offset` bytes into an allocation from `alloc::alloc_zeroed(layout)` or `alloc::alloc(layout)`
/// then filled by a read (`Owner::Heap`, `offset + cap <= layout.size()`, see `heap`), or one
/// checked-out slot of a [`BufPool`] arena (`Owner::Pool`), or nothing (`Owner::Empty`, `cap == 0`,
/// dangling but aligned). `len <= cap`, and every byte in `0..cap` is initialized (zeroed when the
/// memory was allocated, later only overwritten).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    cap: usize,
    align: usize,
    owner: Owner,
}

enum Owner {
    Empty,
    /// `ptr` is `offset` bytes into an allocation of `layout`.
    Heap {
        layout: Layout,
        offset: usize,
    },
    Pool {
        pool: Arc<PoolShared>,
        index: u32,
    },
}

/// The panic message of a buffer size that does not fit the address space (as `Vec`'s "capacity
/// overflow": a programming error, never reached from data on disk or from a peer, whose lengths
/// are bounded first).
const OVERFLOW: &str = "buffer size overflows";

/// `len` rounded up to a multiple of `align` (a power of two), panicking on overflow: a wrapped
/// size would give a buffer smaller than its length.
fn round_up(len: usize, align: usize) -> usize {
    len.checked_next_multiple_of(align).expect(OVERFLOW)
}

/// Largest alignment carved out of a plain allocation (see [`heap`]).
const CARVED_ALIGN_MAX: usize = 64;

/// A heap allocation for `capacity` (non-zero) bytes at an `align`-aligned address: the address, and
/// its owner for `Drop`. Alignments up to [`CARVED_ALIGN_MAX`] are carved out of a plain allocation
/// `align` bytes larger (malloc's 16-byte alignment, at most 64 bytes wasted), because glibc serves an
/// aligned allocation (`posix_memalign`) by cutting it out of a larger chunk and freeing the rest:
/// with buffered reads into carved 64-aligned buffers instead of 512-aligned ones, a store get of a
/// spilled 4 KiB value took 3.15-3.22 µs instead of 3.47-3.67 µs (criterion, the two builds
/// alternating). Larger alignments (O_DIRECT) use an aligned allocation. The allocation may be one
/// freed recently (see [`recycle`]), zeroed here if asked for.
fn heap(capacity: usize, align: usize, zeroed: bool) -> (NonNull<u8>, Owner) {
    let carve = align > 16 && align <= CARVED_ALIGN_MAX;
    let layout = if carve {
        Layout::from_size_align(size_class(capacity.checked_add(align).expect(OVERFLOW)), 16)
    } else {
        Layout::from_size_align(size_class(capacity), align)
    }
    .expect(OVERFLOW);
    let raw = match recycled_take(layout) {
        Some(raw) if zeroed => {
            // SAFETY: `raw` is a live allocation of `layout` that no one else refers to.
            unsafe { raw.as_ptr().write_bytes(0, layout.size()) };
            raw.as_ptr()
        }
        Some(raw) => raw.as_ptr(),
        // SAFETY: `layout` has a non-zero size (`capacity` is non-zero, the callers check).
        None => unsafe { if zeroed { alloc::alloc_zeroed(layout) } else { alloc::alloc(layout) } },
    };
    if raw.is_null() {
        alloc::handle_alloc_error(layout);
    }
    let offset = if carve { raw.align_offset(align) } else { 0 };
    // `align_offset` of a byte pointer is below `align`, so `offset + capacity <= layout.size()`.
    assert!(offset < align, "align_offset of a byte pointer is below the alignment");
    // SAFETY: `offset + capacity <= layout.size()` (just above), so the result stays in the allocation.
    let ptr = unsafe { raw.add(offset) };
    (NonNull::new(ptr).expect("checked non-null"), Owner::Heap { layout, offset })
}

/// Layouts up to this size are kept for reuse when freed (a 16 KiB value's record, read at 64-byte
/// granularity, plus the carving slack).
const RECYCLE_MAX_BYTES: usize = (16 << 10) + 1024;
/// Freed allocations kept per thread: at most 8 x 17 KiB of memory, whatever the workload.
const RECYCLE_SLOTS: usize = 8;

/// Allocations this thread freed, kept for [`heap`] to hand out again. A get of a small spilled
/// value allocates one read buffer, and its value frees one when dropped. From glibc, each of those
/// is a large-chunk allocation that coalesces with its neighbours and sweeps the fast bins first; in
/// a get-then-remove loop of 4 KiB values glibc was 13% of the samples, and recycling (with the
/// slot's smaller allocation, see `slot.rs`) took a get + remove from 3.92-4.24 to 3.57-3.77 µs (see
/// `docs/benchmarks.md`, "Measured choices in the read path", for the loop and the command that shows it).
/// Only exact layouts are reused, so a recycled allocation is freed with the layout it was made with.
struct Recycled(Vec<(Layout, NonNull<u8>)>);

impl Drop for Recycled {
    fn drop(&mut self) {
        for (layout, raw) in self.0.drain(..) {
            // SAFETY: every entry is a live allocation of `layout` that `recycle` took over from its
            // only owner; it is freed once, here.
            unsafe { alloc::dealloc(raw.as_ptr(), layout) }
        }
    }
}

thread_local! {
    static RECYCLED: std::cell::RefCell<Recycled> =
        const { std::cell::RefCell::new(Recycled(Vec::new())) };
}

/// Freed allocations from this size up are large: the process keeps the last few ([`KEPT`]). From
/// here glibc maps each allocation afresh (its mmap threshold, which a dask worker's
/// `MALLOC_TRIM_THRESHOLD_` pins), so a read into fresh memory first faults in and zeroes every page.
const KEEP_MIN_BYTES: usize = 128 << 10;
/// The most memory the kept large allocations hold together (and so the largest one kept).
const KEEP_BYTES: usize = 32 << 20;
/// The most large allocations kept.
const KEEP_SLOTS: usize = 4;

/// Freed large allocations, oldest first: at most [`KEEP_SLOTS`], of [`KEEP_BYTES`] together.
struct Kept(Vec<(Layout, NonNull<u8>)>);

impl Kept {
    /// The bytes the kept allocations hold.
    fn bytes(&self) -> usize {
        self.0.iter().map(|(l, _)| l.size()).sum()
    }
}

// SAFETY: `Kept` holds the only reference to each of its allocations (`recycle`'s contract), which
// any thread may reuse or free.
unsafe impl Send for Kept {}

/// The large allocations freed last, by any thread (a value read on one thread is often dropped on
/// another). Reading a 16 MiB spilled value into fresh memory took 10 ms here, into memory touched
/// before 1 ms: see `docs/benchmarks.md`, "Large read buffers are reused".
static KEPT: std::sync::Mutex<Kept> = std::sync::Mutex::new(Kept(Vec::new()));

/// The size allocated for `n` bytes: `n` itself below [`KEEP_MIN_BYTES`], else `n` rounded up to an
/// eighth of the power of two below it, so that values of about one size (the pieces of a shuffle)
/// share a layout and reuse each other's memory ([`KEPT`]). The rounding is at most an eighth of `n`,
/// and pages of it that no read writes are never touched.
fn size_class(n: usize) -> usize {
    if n < KEEP_MIN_BYTES {
        return n;
    }
    round_up(n, 1 << (n.ilog2() - 3))
}

/// A recycled allocation of exactly `layout`, if this thread holds one (or, a large one, the process
/// keeps one: the newest); no one else refers to it. Treat its bytes as uninitialized: they may be an
/// earlier buffer's, or never written (buffers of different alignments can share a layout, with
/// different offsets).
fn recycled_take(layout: Layout) -> Option<NonNull<u8>> {
    if layout.size() >= KEEP_MIN_BYTES {
        let mut kept = KEPT.lock().unwrap_or_else(PoisonError::into_inner);
        let i = kept.0.iter().rposition(|(l, _)| *l == layout)?;
        return Some(kept.0.remove(i).1);
    }
    if layout.size() > RECYCLE_MAX_BYTES {
        return None;
    }
    RECYCLED
        .try_with(|r| {
            let mut r = r.borrow_mut();
            let i = r.0.iter().rposition(|(l, _)| *l == layout)?;
            Some(r.0.swap_remove(i).1)
        })
        .ok()
        .flatten()
}

/// Keep the large allocation `raw` of `layout` in [`KEPT`], freeing the oldest kept ones beyond its
/// bounds; one larger than [`KEEP_BYTES`] is freed.
///
/// # Safety
/// As [`recycle`].
unsafe fn keep_large(raw: NonNull<u8>, layout: Layout) {
    let mut freed = Vec::new();
    if layout.size() > KEEP_BYTES {
        freed.push((layout, raw));
    } else {
        let mut kept = KEPT.lock().unwrap_or_else(PoisonError::into_inner);
        kept.0.push((layout, raw));
        while kept.bytes() > KEEP_BYTES || kept.0.len() > KEEP_SLOTS {
            freed.push(kept.0.remove(0));
        }
    }
    for (layout, raw) in freed {
        // SAFETY: the caller's allocation, or one `KEPT` held the only reference to (the contract
        // under which `recycle` put it there), taken out of it; each is freed once, here.
        unsafe { alloc::dealloc(raw.as_ptr(), layout) }
    }
}

/// Give up the allocation `raw` of `layout`: keep it for reuse (a small one by this thread, a large one
/// by any), or free it.
///
/// # Safety
/// `raw` is a live allocation of `layout` from `alloc::alloc` or `alloc::alloc_zeroed`, and the
/// caller gives up every pointer into it.
unsafe fn recycle(raw: NonNull<u8>, layout: Layout) {
    if layout.size() >= KEEP_MIN_BYTES {
        // SAFETY: the caller's contract.
        return unsafe { keep_large(raw, layout) };
    }
    let kept = layout.size() <= RECYCLE_MAX_BYTES
        && RECYCLED
            .try_with(|r| {
                let mut r = r.borrow_mut();
                let room = r.0.len() < RECYCLE_SLOTS;
                if room {
                    r.0.push((layout, raw));
                }
                room
            })
            .unwrap_or(false); // the thread is exiting: free it
    if !kept {
        // SAFETY: the caller's contract: a live allocation of `layout`, no longer referred to.
        unsafe { alloc::dealloc(raw.as_ptr(), layout) }
    }
}

// SAFETY: AlignedBuf uniquely owns its memory (a heap allocation or a checked-out pool slot, like
// Vec<u8>); no interior mutability or shared pointers to the bytes exist, so moving it to or sharing
// `&AlignedBuf` with another thread is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: see Send: `&AlignedBuf` only permits reads of initialized bytes.
unsafe impl Sync for AlignedBuf {}

/// An allocation from [`heap`] that no `AlignedBuf` owns yet, freed on drop unless disarmed (taking
/// the owner out): the error paths of reads into fresh memory.
struct Unfilled(NonNull<u8>, Option<Owner>);

impl Drop for Unfilled {
    fn drop(&mut self) {
        if let Some(Owner::Heap { layout, offset }) = self.1.take() {
            // SAFETY: `self.0` is `offset` bytes into an allocation of `layout` made by `heap`, which
            // no `AlignedBuf` owns; it is freed once, here.
            unsafe { alloc::dealloc(self.0.as_ptr().sub(offset), layout) }
        }
    }
}

/// Fill `mem` with the bytes of `file` from `offset`: short reads and EINTR are resumed; end of file is
/// `UnexpectedEof`. On Ok every byte of `mem` was written.
fn pread_exact(file: &impl AsFd, mem: &mut [MaybeUninit<u8>], offset: u64) -> io::Result<()> {
    let mut done = 0;
    while done < mem.len() {
        match rustix::io::pread(file, &mut mem[done..], offset + done as u64) {
            Ok(([], _)) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok((init, _)) => done += init.len(),
            Err(rustix::io::Errno::INTR) => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

impl AlignedBuf {
    /// A zero-filled buffer of `capacity` bytes (rounded up to a multiple of `align`), length 0.
    ///
    /// Panics if `align` is not a power of two; that is a programming error, not an input error.
    pub fn with_capacity(capacity: usize, align: usize) -> Self {
        assert!(align.is_power_of_two(), "alignment {align} is not a power of two");
        let capacity = round_up(capacity, align);
        if capacity == 0 {
            // A dangling but well-aligned pointer: never dereferenced for a zero-capacity buffer.
            let ptr = NonNull::new(align as *mut u8).expect("alignment is non-zero");
            return AlignedBuf { ptr, len: 0, cap: 0, align, owner: Owner::Empty };
        }
        let (ptr, owner) = heap(capacity, align, true);
        AlignedBuf { ptr, len: 0, cap: capacity, align, owner }
    }

    /// A buffer of length `len` (capacity rounded up to `align`) holding the `len` bytes of `file` at
    /// `offset`, read with `pread` straight into fresh memory: no zero-fill first, which for a large
    /// value is a whole extra pass over memory. Short reads and EINTR are resumed; end of file is
    /// `UnexpectedEof`. On error nothing is kept.
    pub fn read_exact_at(file: &impl AsFd, offset: u64, len: usize, align: usize) -> io::Result<Self> {
        assert!(align.is_power_of_two(), "alignment {align} is not a power of two");
        let capacity = round_up(len, align);
        if capacity == 0 {
            return Ok(Self::with_capacity(0, align));
        }
        let (ptr, owner) = heap(capacity, align, false);
        let mut guard = Unfilled(ptr, Some(owner));
        let raw = ptr.as_ptr();
        // SAFETY: `raw` points to `capacity` bytes we own; `MaybeUninit<u8>` needs no initialization.
        let mem: &mut [MaybeUninit<u8>] = unsafe { std::slice::from_raw_parts_mut(raw.cast(), capacity) };
        mem[len..].fill(MaybeUninit::new(0)); // the rounding tail is zeroed, as in `with_capacity`
        pread_exact(file, &mut mem[..len], offset)?;
        let owner = guard.1.take().expect("armed");
        // Every byte of `0..capacity` is now initialized: `0..len` by the kernel (`pread_exact` covered
        // it), `len..capacity` by the fill above. So the type invariant holds.
        Ok(AlignedBuf { ptr, len, cap: capacity, align, owner })
    }

    /// As [`Self::read_exact_at`], in two parts read at once: `0..split` on the calling thread and
    /// `split..len` on a scoped thread, each handed to `each` (with its range in the buffer) as soon
    /// as it is read, while its bytes are still in the cache. For large values a copy out of the page
    /// cache runs at what one core can copy, so two cores read (and check) one value in about half
    /// the time. If no thread can be started, the calling thread reads both parts. `split` must be a
    /// multiple of `align` (both parts stay aligned for O_DIRECT) and at most `len`.
    pub fn read_exact_at_split<T: Send>(
        file: &(impl AsFd + Sync),
        offset: u64,
        len: usize,
        align: usize,
        split: usize,
        each: impl Fn(std::ops::Range<usize>, &[u8]) -> T + Sync,
    ) -> io::Result<(Self, T, T)> {
        assert!(align.is_power_of_two(), "alignment {align} is not a power of two");
        assert!(split <= len && split % align == 0, "split {split} of {len} bytes is not a multiple of {align}");
        let capacity = round_up(len, align);
        if capacity == 0 {
            return Ok((Self::with_capacity(0, align), each(0..0, &[]), each(0..0, &[])));
        }
        let (ptr, owner) = heap(capacity, align, false);
        let mut guard = Unfilled(ptr, Some(owner));
        // SAFETY: `ptr` points to `capacity` bytes we own (the guard frees them on error) and nothing
        // else refers to; `MaybeUninit<u8>` needs no initialization.
        let mem: &mut [MaybeUninit<u8>] = unsafe { std::slice::from_raw_parts_mut(ptr.as_ptr().cast(), capacity) };
        mem[len..].fill(MaybeUninit::new(0)); // the rounding tail is zeroed, as in `with_capacity`
        let (first, second) = mem[..len].split_at_mut(split);
        let read_part = |part: &mut [MaybeUninit<u8>], at: usize| -> io::Result<T> {
            pread_exact(file, part, offset + at as u64)?;
            // SAFETY: `pread_exact` returned Ok, so the kernel wrote every byte of `part`.
            let bytes = unsafe { std::slice::from_raw_parts(part.as_ptr().cast::<u8>(), part.len()) };
            Ok(each(at..at + part.len(), bytes))
        };
        // The second part goes to whichever thread takes it: the helper, or this one if the helper
        // could not be started.
        let second = std::sync::Mutex::new(Some(second));
        let take = || second.lock().unwrap_or_else(PoisonError::into_inner).take();
        let (a, b) = std::thread::scope(|s| {
            let helper = std::thread::Builder::new()
                .name("spillway-read".into())
                .spawn_scoped(s, || take().map(|part| read_part(part, split)))
                .ok();
            let a = read_part(first, 0);
            let b = match helper.map(|h| h.join()) {
                Some(Ok(Some(b))) => b,
                Some(Err(panic)) => std::panic::resume_unwind(panic),
                Some(Ok(None)) | None => read_part(take().expect("the second part is read once"), split),
            };
            (a, b)
        });
        let (a, b) = (a?, b?);
        let owner = guard.1.take().expect("armed");
        // Every byte of `0..capacity` is now initialized: `0..split` and `split..len` by the two reads,
        // `len..capacity` by the fill above. So the type invariant holds.
        Ok((AlignedBuf { ptr, len, cap: capacity, align, owner }, a, b))
    }

    /// A buffer of length `data.len()` (capacity rounded up to `align`) holding a copy of `data`,
    /// written into fresh memory without a zero-fill first (as [`Self::read_exact_at`]). A zeroed
    /// allocation of this size is a `calloc` that glibc serves by sweeping its fast bins first.
    pub fn copied(data: &[u8], align: usize) -> Self {
        assert!(align.is_power_of_two(), "alignment {align} is not a power of two");
        let len = data.len();
        let capacity = round_up(len, align);
        if capacity == 0 {
            return Self::with_capacity(0, align);
        }
        let (ptr, owner) = heap(capacity, align, false);
        let raw = ptr.as_ptr();
        // SAFETY: `heap` gave us `capacity >= len` bytes at `raw` that nothing else refers to, and
        // `data` is a live slice of `len` bytes that cannot overlap memory allocated just now.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), raw, len) };
        // SAFETY: as above, `raw` points to `capacity` bytes we own; `MaybeUninit<u8>` needs no
        // initialization.
        let tail: &mut [MaybeUninit<u8>] = unsafe { std::slice::from_raw_parts_mut(raw.cast(), capacity) };
        tail[len..].fill(MaybeUninit::new(0)); // the rounding tail is zeroed, as in `with_capacity`
                                               // Every byte of `0..capacity` is initialized: `0..len` by the copy, the rest by the fill.
        AlignedBuf { ptr, len, cap: capacity, align, owner }
    }

    /// A zero-filled buffer of length `len` (capacity rounded up to `align`).
    pub fn zeroed(len: usize, align: usize) -> Self {
        let mut b = Self::with_capacity(len, align);
        b.len = len;
        b
    }

    /// Bytes currently in use.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True when no bytes are in use.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Total bytes allocated.
    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// The alignment of the start address.
    pub fn align(&self) -> usize {
        self.align
    }

    /// When this buffer is a slot of `pool`, its index there (the registered-buffer index an io_uring
    /// backend passes to `ReadFixed`/`WriteFixed`).
    pub fn pool_index(&self, pool: &BufPool) -> Option<u32> {
        match &self.owner {
            Owner::Pool { pool: p, index } if Arc::ptr_eq(p, &pool.shared) => Some(*index),
            _ => None,
        }
    }

    /// Set the length; bytes between the old and new length keep whatever they held (zero or earlier
    /// contents), never uninitialized memory. Panics if `len > capacity`.
    pub fn set_len(&mut self, len: usize) {
        assert!(len <= self.capacity(), "length {len} exceeds capacity {}", self.capacity());
        self.len = len;
    }

    /// Zero bytes `from..capacity`, and set the length to `from`.
    pub fn truncate_and_zero(&mut self, from: usize) {
        assert!(from <= self.capacity());
        self.spare_full()[from..].fill(0);
        self.len = from;
    }

    /// Append `data`, panicking if it does not fit (callers size buffers up front).
    pub fn extend_from_slice(&mut self, data: &[u8]) {
        let end = self.len + data.len();
        assert!(end <= self.capacity(), "append of {} bytes overflows buffer", data.len());
        let start = self.len;
        self.spare_full()[start..end].copy_from_slice(data);
        self.len = end;
    }

    /// The whole capacity as a mutable slice (every byte is initialized).
    pub fn spare_full(&mut self) -> &mut [u8] {
        // SAFETY: by the type invariant `ptr` points to `capacity` initialized bytes owned by `self`,
        // and `&mut self` guarantees exclusive access for the returned lifetime.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.capacity()) }
    }

    /// Raw pointer to the start, for handing to the kernel. The caller must keep `self` alive (and not
    /// touch it) until the kernel is done with the memory.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Freeze into `Bytes` without copying; the allocation is freed when the last `Bytes` drops.
    pub fn freeze(self) -> Bytes {
        Bytes::from_owner(self)
    }
}

impl std::ops::Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len <= capacity` initialized bytes owned by `self`; shared borrow of `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl std::ops::DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        let len = self.len;
        &mut self.spare_full()[..len]
    }
}

impl AsRef<[u8]> for AlignedBuf {
    fn as_ref(&self) -> &[u8] {
        self
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        match &self.owner {
            Owner::Empty => {}
            // SAFETY: `ptr` is `offset` bytes into an allocation of `layout` made by `heap`
            // (`alloc_zeroed` or `alloc`), and is given up exactly once, here.
            Owner::Heap { layout, offset } => unsafe {
                recycle(NonNull::new_unchecked(self.ptr.as_ptr().sub(*offset)), *layout)
            },
            Owner::Pool { pool, index } => pool.check_in(*index),
        }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("capacity", &self.capacity())
            .field("align", &self.align())
            .finish()
    }
}

/// A fixed arena of equal, aligned buffers, made once and reused: the registered buffer pool of the
/// io_uring backend (its arena is registered with the ring, so `ReadFixed`/`WriteFixed` skip the page
/// pinning a plain read or write pays on every call).
///
/// [`BufPool::check_out`] hands out a slot as an [`AlignedBuf`] (length 0, capacity `buf_size`, stale
/// but initialized contents) and blocks while every slot is out: an empty pool is back-pressure, not an
/// allocation. [`BufPool::try_check_out`] never blocks. Dropping the buffer checks the slot back in.
/// The arena is freed when the pool, every checked-out buffer and every [`PoolShared`] holder (the
/// ring's registration) are gone, so memory the kernel may still use cannot be freed from safe code.
#[derive(Clone)]
pub struct BufPool {
    shared: Arc<PoolShared>,
}

/// The shared state of a [`BufPool`]; holding an `Arc` of it keeps the arena alive.
pub struct PoolShared {
    base: NonNull<u8>,
    layout: Layout,
    buf_size: usize,
    align: usize,
    free: Mutex<Vec<u32>>,
    freed: Condvar,
}

// SAFETY: the arena is plain memory; each slot is handed to at most one `AlignedBuf` at a time (the free
// list is behind a mutex), so sharing the pool between threads gives no thread unsynchronized access to
// the same bytes.
unsafe impl Send for PoolShared {}
// SAFETY: see Send; `&PoolShared` only exposes the mutex-protected free list and raw addresses.
unsafe impl Sync for PoolShared {}

impl BufPool {
    /// A pool of `count` zeroed buffers of `buf_size` bytes (rounded up to `align`), each aligned to
    /// `align` (a power of two). Panics on a zero count or size, or a size that overflows
    /// (programming errors), and aborts if the memory cannot be allocated, as `Vec` does.
    pub fn new(count: usize, buf_size: usize, align: usize) -> BufPool {
        Self::try_new(count, buf_size, align).unwrap_or_else(|layout| alloc::handle_alloc_error(layout))
    }

    /// As [`BufPool::new`], but a pool that cannot be allocated is `Err` with the layout asked
    /// for, so the caller can ask for a smaller one.
    pub fn try_new(count: usize, buf_size: usize, align: usize) -> Result<BufPool, Layout> {
        assert!(count > 0 && buf_size > 0 && count <= u32::MAX as usize, "empty buffer pool");
        assert!(align.is_power_of_two(), "alignment {align} is not a power of two");
        let buf_size = round_up(buf_size, align);
        let total = buf_size.checked_mul(count).expect(OVERFLOW);
        let layout = Layout::from_size_align(total, align.max(4096)).expect(OVERFLOW);
        // SAFETY: `layout` has a non-zero size: count and buf_size are non-zero, and rounding
        // buf_size up cannot wrap to zero (checked).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(base) = NonNull::new(raw) else { return Err(layout) };
        let free = (0..count as u32).rev().collect();
        Ok(BufPool {
            shared: Arc::new(PoolShared {
                base,
                layout,
                buf_size,
                align,
                free: Mutex::new(free),
                freed: Condvar::new(),
            }),
        })
    }

    /// Number of buffers.
    pub fn count(&self) -> usize {
        self.shared.layout.size() / self.shared.buf_size
    }

    /// Size of each buffer.
    pub fn buf_size(&self) -> usize {
        self.shared.buf_size
    }

    /// Buffers currently checked in.
    pub fn available(&self) -> usize {
        self.shared.free.lock().unwrap_or_else(PoisonError::into_inner).len()
    }

    /// `(address, length)` of every buffer in index order, for registering the arena with a kernel
    /// interface. Whoever registers must also hold [`BufPool::keep_alive`] until it unregisters.
    pub fn regions(&self) -> Vec<(*mut u8, usize)> {
        let s = &self.shared;
        (0..self.count())
            .map(|i| {
                // SAFETY: `i * buf_size < layout.size()`, so the offset stays inside the arena allocation.
                let p = unsafe { s.base.as_ptr().add(i * s.buf_size) };
                (p, s.buf_size)
            })
            .collect()
    }

    /// A handle that keeps the arena allocated (for a ring that registered it).
    pub fn keep_alive(&self) -> Arc<PoolShared> {
        self.shared.clone()
    }

    /// Take a buffer, waiting while none is free.
    pub fn check_out(&self) -> AlignedBuf {
        let mut free = self.shared.free.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(i) = free.pop() {
                return self.make(i);
            }
            free = self.shared.freed.wait(free).unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Take a buffer if one is free.
    pub fn try_check_out(&self) -> Option<AlignedBuf> {
        let i = self.shared.free.lock().unwrap_or_else(PoisonError::into_inner).pop()?;
        Some(self.make(i))
    }

    fn make(&self, index: u32) -> AlignedBuf {
        let s = &self.shared;
        // SAFETY: `index < count`, so the slot lies inside the arena; it was just removed from the free
        // list, so no other AlignedBuf refers to it until this one drops and checks it back in.
        let ptr = unsafe { NonNull::new_unchecked(s.base.as_ptr().add(index as usize * s.buf_size)) };
        AlignedBuf { ptr, len: 0, cap: s.buf_size, align: s.align, owner: Owner::Pool { pool: s.clone(), index } }
    }
}

impl PoolShared {
    fn check_in(&self, index: u32) {
        self.free.lock().unwrap_or_else(PoisonError::into_inner).push(index);
        self.freed.notify_one();
    }
}

impl Drop for PoolShared {
    fn drop(&mut self) {
        // SAFETY: `base` came from `alloc_zeroed(self.layout)`; this is the last handle (no buffer, pool or
        // registration holds the Arc any more), so nothing can use the memory after this.
        unsafe { alloc::dealloc(self.base.as_ptr(), self.layout) }
    }
}

impl fmt::Debug for BufPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BufPool").field("count", &self.count()).field("buf_size", &self.buf_size()).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A size whose rounding (up to the alignment, or the carving slack) overflows panics, as
    /// `Vec` does: wrapping would leave a small allocation behind a buffer claiming the huge length.
    #[test]
    fn sizes_that_overflow_panic_instead_of_wrapping() {
        for (cap, align) in [(usize::MAX, 4096), (usize::MAX - 63, 64), (usize::MAX - 10, 16)] {
            assert!(std::panic::catch_unwind(|| AlignedBuf::with_capacity(cap, align)).is_err(), "{cap} at {align}");
        }
        assert!(std::panic::catch_unwind(|| AlignedBuf::zeroed(usize::MAX, 4096)).is_err());
        assert!(std::panic::catch_unwind(|| BufPool::new(1, usize::MAX, 4096)).is_err());
        // More than the address space: an error the caller can act on (ask for less), not an abort.
        assert!(BufPool::try_new(1, 1 << 62, 4096).is_err());
        assert_eq!(BufPool::try_new(2, 1000, 512).map(|p| (p.count(), p.buf_size())).ok(), Some((2, 1024)));
    }

    #[test]
    fn read_exact_at_reads_into_fresh_memory_and_reports_eof() {
        use std::io::Write;
        let mut f = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect();
        f.write_all(&data).unwrap();
        for (offset, len, align) in [(0usize, 10_000usize, 512usize), (100, 1000, 4096), (9_999, 1, 64), (0, 0, 512)] {
            let b = AlignedBuf::read_exact_at(&f, offset as u64, len, align).unwrap();
            assert_eq!(&b[..], &data[offset..offset + len]);
            assert_eq!(b.as_ptr() as usize % align, 0);
            assert_eq!(b.capacity(), len.div_ceil(align) * align);
            let mut b = b;
            let cap = b.capacity();
            assert!(b.spare_full()[len..cap].iter().all(|&x| x == 0), "rounding tail zeroed");
        }
        for align in [64, 512] {
            // (64: carved out of a plain allocation, which the error path frees the same way)
            let e = AlignedBuf::read_exact_at(&f, 9_000, 2_000, align).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof);
        }
    }

    #[test]
    fn read_exact_at_split_reads_what_one_read_does_and_hands_each_part_over_once() {
        use std::io::Write;
        let mut f = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..20_000u32).map(|i| (i * 13 % 241) as u8).collect();
        f.write_all(&data).unwrap();
        for (offset, len, align, split) in [
            (0usize, 20_000usize, 512usize, 8192usize),
            (100, 9000, 4096, 4096),
            (7, 5000, 64, 0),
            (7, 5000, 64, 4992),
            (0, 0, 512, 0),
        ] {
            let seen = std::sync::Mutex::new(Vec::new());
            let (b, x, y) = AlignedBuf::read_exact_at_split(&f, offset as u64, len, align, split, |range, bytes| {
                assert_eq!(bytes, &data[offset + range.start..offset + range.end], "part {range:?}");
                seen.lock().unwrap().push(range.clone());
                range
            })
            .unwrap();
            assert_eq!(&b[..], &data[offset..offset + len]);
            assert_eq!(b.as_ptr() as usize % align, 0);
            assert_eq!((x, y), (0..split, split..len));
            let mut seen = seen.into_inner().unwrap();
            seen.sort_by_key(|r| r.start);
            assert_eq!(seen, vec![0..split, split..len], "each part once");
            let mut b = b;
            let cap = b.capacity();
            assert!(b.spare_full()[len..cap].iter().all(|&x| x == 0), "rounding tail zeroed");
        }
        // End of file in either part is an error, and nothing leaks or panics.
        for split in [0, 512, 1536] {
            let e = AlignedBuf::read_exact_at_split(&f, 18_000, 3_000, 512, split, |_, b| b.len()).unwrap_err();
            assert_eq!(e.kind(), std::io::ErrorKind::UnexpectedEof, "split {split}");
        }
    }

    #[test]
    fn copied_holds_the_bytes_aligned_with_a_zeroed_tail_even_in_recycled_memory() {
        let data: Vec<u8> = (0..5000u32).map(|i| (i * 31 % 253) as u8 + 1).collect();
        for (len, align) in [(5000usize, 64usize), (4097, 512), (1, 64), (0, 64)] {
            // A freed buffer of the same layout, full of non-zero bytes, is what `copied` may reuse.
            let mut old = AlignedBuf::read_exact_at(&tempfile_of(&[0xAB; 8192]), 0, len, align).unwrap();
            let cap = old.capacity();
            old.spare_full().fill(0xAB);
            drop(old);
            let mut b = AlignedBuf::copied(&data[..len], align);
            assert_eq!(&b[..], &data[..len]);
            assert_eq!(b.as_ptr() as usize % align, 0);
            assert_eq!(b.capacity(), cap);
            assert!(b.spare_full()[len..cap].iter().all(|&x| x == 0), "rounding tail zeroed");
        }
    }

    fn tempfile_of(bytes: &[u8]) -> std::fs::File {
        use std::io::Write;
        let mut f = tempfile::tempfile().unwrap();
        f.write_all(bytes).unwrap();
        f
    }

    #[test]
    fn freed_read_buffers_are_reused_by_this_thread_and_bounded() {
        use std::io::Write;
        let mut f = tempfile::tempfile().unwrap();
        let data: Vec<u8> = (0..64_000u32).map(|i| (i * 13 % 251) as u8).collect();
        f.write_all(&data).unwrap();
        let held = || RECYCLED.with(|r| r.borrow().0.len());
        // A read, freed, then a read of the same layout: the same memory, holding the new bytes only
        // (the rounding tail zeroed again, not the old record's bytes).
        let a = AlignedBuf::read_exact_at(&f, 0, 4200, 64).unwrap();
        let addr = a.as_ptr() as usize;
        drop(a);
        assert_eq!(held(), 1);
        let mut b = AlignedBuf::read_exact_at(&f, 10_000, 4190, 64).unwrap(); // capacity 4224 too
        assert_eq!(b.as_ptr() as usize, addr, "same layout: recycled");
        assert_eq!(&b[..], &data[10_000..14_190]);
        let cap = b.capacity();
        assert!(b.spare_full()[4190..cap].iter().all(|&x| x == 0), "rounding tail zeroed");
        drop(b);
        // A zeroed buffer may come from the recycled ones: zeroed, not holding the old bytes.
        let mut z = AlignedBuf::with_capacity(4224, 64);
        assert_eq!(z.as_ptr() as usize, addr, "same layout: recycled");
        assert_eq!(held(), 0);
        assert!(z.spare_full().iter().all(|&x| x == 0), "zeroed");
        drop(z);
        assert_eq!(held(), 1);
        // Bounded: however many are freed, at most RECYCLE_SLOTS are kept; large ones never.
        let many: Vec<AlignedBuf> =
            (0..3 * RECYCLE_SLOTS).map(|i| AlignedBuf::read_exact_at(&f, i as u64, 3000, 64).unwrap()).collect();
        drop(many);
        assert_eq!(held(), RECYCLE_SLOTS);
        let big = AlignedBuf::read_exact_at(&f, 0, 40_000, 64).unwrap();
        drop(big);
        assert_eq!(held(), RECYCLE_SLOTS);
        // Another thread has its own: exiting frees them (the thread-local's destructor).
        std::thread::scope(|s| {
            s.spawn(|| {
                drop(AlignedBuf::read_exact_at(&f, 0, 4200, 64).unwrap());
                assert_eq!(held(), 1);
            });
        });
        assert_eq!(held(), RECYCLE_SLOTS);
    }

    #[test]
    fn freed_large_buffers_are_reused_by_any_thread_and_bounded() {
        let data: Vec<u8> = (0..(2u32 << 20)).map(|i| (i * 7 % 249) as u8 + 1).collect();
        let f = tempfile_of(&data);
        let len = (3 << 19) + 60_000; // sizes no other test uses: tests run at once in one process
        // A read freed on another thread, then a read of a few KiB less here: the same memory,
        // holding the new bytes; then a zeroed buffer of it holds zeros, not the old bytes. (Other
        // tests free large buffers too; one of a few tries sees few enough of them in between.)
        let reused = (0..20).any(|i| {
            let a = AlignedBuf::read_exact_at(&f, 0, len, 64).unwrap();
            let addr = a.as_ptr() as usize;
            std::thread::scope(|s| s.spawn(move || drop(a)).join().unwrap());
            let (at, smaller) = (1000 + i, len - 5000); // the same size class (`size_class`)
            let b = AlignedBuf::read_exact_at(&f, at as u64, smaller, 64).unwrap();
            assert_eq!(&b[..], &data[at..at + smaller]);
            let again = b.as_ptr() as usize == addr;
            drop(b);
            let mut z = AlignedBuf::with_capacity(len, 64);
            assert!(z.spare_full().iter().all(|&x| x == 0), "zeroed");
            again && z.as_ptr() as usize == addr
        });
        assert!(reused, "a freed large buffer is reused");
        // Bounded: at most KEEP_SLOTS allocations of KEEP_BYTES together; a larger one is freed.
        f.set_len(KEEP_BYTES as u64 + 1).unwrap();
        for n in [9 << 20, 9 << 20, 9 << 20, 9 << 20, 300 << 10, 200 << 10, KEEP_BYTES + 1] {
            drop(AlignedBuf::read_exact_at(&f, 0, n, 64).unwrap());
            let kept = KEPT.lock().unwrap();
            assert!(kept.0.len() <= KEEP_SLOTS);
            assert!(kept.bytes() <= KEEP_BYTES);
        }
    }

    #[test]
    fn alignment_and_zeroing() {
        // 32 and 64 are carved out of plain allocations (`heap`), 512 and 4096 allocated aligned.
        for align in [32usize, 64, 512, 4096] {
            let mut b = AlignedBuf::with_capacity(1000, align);
            assert_eq!(b.as_mut_ptr() as usize % align, 0);
            assert_eq!(b.capacity(), align.max(1024).div_ceil(align) * align);
            assert!(b.spare_full().iter().all(|&x| x == 0));
            b.extend_from_slice(b"hello");
            assert_eq!(&b[..], b"hello");
            let bytes = b.freeze();
            assert_eq!(&bytes[..], b"hello");
        }
        let z = AlignedBuf::with_capacity(0, 4096);
        assert!(z.is_empty());
        assert_eq!(z.freeze().len(), 0);
    }

    #[test]
    fn pool_checks_out_distinct_slots_and_takes_them_back() {
        let pool = BufPool::new(3, 1000, 512);
        assert_eq!(pool.buf_size(), 1024);
        let mut a = pool.check_out();
        let mut b = pool.try_check_out().unwrap();
        let c = pool.check_out();
        assert!(pool.try_check_out().is_none(), "three slots, three out");
        assert_eq!(a.capacity(), 1024);
        assert_eq!(a.as_mut_ptr() as usize % 512, 0);
        assert_ne!(a.as_mut_ptr(), b.as_mut_ptr());
        let ia = a.pool_index(&pool).unwrap();
        assert_eq!(pool.regions()[ia as usize].0, a.as_mut_ptr());
        assert_eq!(AlignedBuf::zeroed(8, 8).pool_index(&pool), None);
        assert_eq!(BufPool::new(1, 8, 8).check_out().pool_index(&pool), None, "another pool's slot");
        a.extend_from_slice(b"frozen");
        let bytes = a.freeze();
        drop(b);
        assert_eq!(pool.available(), 1);
        // A blocked check-out resumes when a slot comes back.
        let p2 = pool.clone();
        let waiter = std::thread::spawn(move || {
            let _x = p2.check_out();
            let _y = p2.check_out(); // may block until `c` or `bytes` comes back
        });
        drop(c);
        assert_eq!(&bytes[..], b"frozen");
        drop(bytes);
        waiter.join().unwrap();
        assert_eq!(pool.available(), 3);
    }

    #[test]
    fn truncate_and_zero_clears_tail() {
        let mut b = AlignedBuf::zeroed(16, 8);
        b.fill(0xff);
        b.truncate_and_zero(4);
        assert_eq!(b.len(), 4);
        assert_eq!(&b.spare_full()[..8], &[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]);
    }
}
