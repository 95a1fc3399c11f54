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
use std::ptr::NonNull;

use bytes::Bytes;

/// A heap buffer whose start address is a multiple of `align`.
///
/// Invariants: `ptr` was returned by `alloc::alloc_zeroed(layout)` with `layout.size() == capacity`
/// (or is dangling when `capacity == 0`), `len <= capacity`, and every byte in `0..capacity` is
/// initialized (zeroed at allocation, later only overwritten).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
}

// SAFETY: AlignedBuf uniquely owns its allocation (like Vec<u8>); no interior mutability or shared
// pointers exist, so moving it to or sharing `&AlignedBuf` with another thread is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: see Send: `&AlignedBuf` only permits reads of initialized bytes.
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A zero-filled buffer of `capacity` bytes (rounded up to a multiple of `align`), length 0.
    ///
    /// Panics if `align` is not a power of two; that is a programming error, not an input error.
    pub fn with_capacity(capacity: usize, align: usize) -> Self {
        assert!(align.is_power_of_two(), "alignment {align} is not a power of two");
        let capacity = capacity.div_ceil(align) * align;
        let layout = Layout::from_size_align(capacity, align).expect("buffer size overflows isize");
        let ptr = if capacity == 0 {
            // A dangling but well-aligned pointer: never dereferenced for a zero-capacity buffer.
            NonNull::new(align as *mut u8).expect("alignment is non-zero")
        } else {
            // SAFETY: `layout` has a non-zero size (checked just above).
            let raw = unsafe { alloc::alloc_zeroed(layout) };
            match NonNull::new(raw) {
                Some(p) => p,
                None => alloc::handle_alloc_error(layout),
            }
        };
        AlignedBuf { ptr, len: 0, layout }
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
        self.layout.size()
    }

    /// The alignment of the start address.
    pub fn align(&self) -> usize {
        self.layout.align()
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
        if self.layout.size() != 0 {
            // SAFETY: `ptr` came from `alloc_zeroed(self.layout)` and is freed exactly once, here.
            unsafe { alloc::dealloc(self.ptr.as_ptr(), self.layout) }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alignment_and_zeroing() {
        for align in [512usize, 4096] {
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
    fn truncate_and_zero_clears_tail() {
        let mut b = AlignedBuf::zeroed(16, 8);
        b.fill(0xff);
        b.truncate_and_zero(4);
        assert_eq!(b.len(), 4);
        assert_eq!(&b.spare_full()[..8], &[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0]);
    }
}
