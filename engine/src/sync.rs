//! The sync shim: std's atomics and locks normally, loom's under `--cfg spillway_loom`.
//!
//! Every lock-free structure in the engine takes its atomics and cells from here, so the loom models in
//! `loom-tests/` check the production code, not a copy. The cfg is crate-specific (never the bare
//! `loom` cfg, which would also switch dependencies that know it).

#[cfg(not(spillway_loom))]
pub use std::sync::{
    atomic::{AtomicBool, AtomicU64, Ordering},
    Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
};

#[cfg(spillway_loom)]
pub use loom::sync::{
    atomic::{AtomicBool, AtomicU64, Ordering},
    Arc, Condvar, Mutex, MutexGuard, RwLock, RwLockReadGuard, RwLockWriteGuard,
};

/// Yield the thread (loom's yield under the loom cfg, so spin loops are explored).
pub fn yield_now() {
    #[cfg(spillway_loom)]
    loom::thread::yield_now();
    #[cfg(not(spillway_loom))]
    std::thread::yield_now();
}

/// An `UnsafeCell` with loom's closure-based API, backed by `std::cell::UnsafeCell` normally, so the
/// same code is checked by loom's access tracking under the loom cfg.
#[cfg(not(spillway_loom))]
#[derive(Debug, Default)]
pub struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(spillway_loom))]
impl<T> UnsafeCell<T> {
    /// Wrap a value.
    pub fn new(v: T) -> Self {
        UnsafeCell(std::cell::UnsafeCell::new(v))
    }
    /// Call `f` with a shared raw pointer to the contents.
    pub fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }
    /// Call `f` with a mutable raw pointer to the contents.
    pub fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

#[cfg(spillway_loom)]
pub use loom::cell::UnsafeCell;
