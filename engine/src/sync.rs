//! The sync shim: std's atomics and locks normally, loom's under `--cfg spillway_loom`.
//!
//! Every lock-free structure in the engine takes its atomics and cells from here, so the loom models in
//! `loom-tests/` check the production code, not a copy. The cfg is crate-specific (never the bare
//! `loom` cfg, which would also switch dependencies that know it).

#[cfg(not(spillway_loom))]
pub use std::sync::{
    atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering},
    Arc, Condvar, Mutex, MutexGuard,
};

#[cfg(spillway_loom)]
pub use loom::sync::{
    atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering},
    Arc, Condvar, Mutex, MutexGuard,
};
