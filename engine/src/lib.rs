//! # spillway
//!
//! A memory-and-disk store for the workers of a distributed data-processing engine (dask's worker is
//! the model). Values live as materialized objects, as serialized frames in memory, or as records in an
//! append-only log of segment files on disk.
//!
//! This crate is layered:
//!
//! * `format` (internal): the byte layout of segment files (records, footers, trailers), and nothing
//!   else.
//! * `stored` (internal): the stored form of a value (its frames laid out, maybe one lz4 block), which
//!   the log, the store and the transfer protocol all write and read through.
//! * [`backend`]: the I/O backends the log runs on: io_uring ([`UringBackend`](backend::UringBackend)),
//!   [`PortableBackend`] (`pread`/`pwrite`), [`SimBackend`] (in memory, with fault injection and power
//!   cuts), and [`AutoBackend`], which picks io_uring and falls back to portable where it is unavailable.
//! * [`log`]: the [`SegmentLog`], an append-only, checksummed key-value log with crash recovery,
//!   tombstones, garbage collection and compaction.
//! * [`store`]: the three-tier [`Store`] (objects, serialized frames, records on disk), and the
//!   (internal) slot that makes a concurrent get deserialize once.
//! * [`transfer`]: sending stored values to a peer with `splice` (file to pipe to socket) and
//!   receiving them, straight to disk when memory is short; `docs/wire.md` is the protocol.
//!
//! `unsafe` code lives only in `buf` (aligned buffers, the buffer pool), `slot` (the
//! materialization slot's cell), the io_uring backend (`backend/uring.rs`, `backend/pipeline.rs`) and
//! `sigpipe.rs` (SIGPIPE held back during a splice into a socket); see `docs/safety.md`.
#![deny(unsafe_code)]

pub mod backend;
pub mod error;
pub(crate) mod key;
pub mod log;
mod sigpipe;
pub mod store;
pub(crate) mod sync;
pub mod transfer;
pub mod units;
pub mod value;

/// Internal modules: crate-private, or public and hidden from the docs with the `testing` feature
/// (tests, fuzz targets, loom models and benchmarks reach them; they are not the API).
macro_rules! internal {
    ($($(#[$a:meta])* $m:ident;)*) => {$(
        $(#[$a])* #[cfg(feature = "testing")] #[doc(hidden)] pub mod $m;
        $(#[$a])* #[cfg(not(feature = "testing"))] #[allow(dead_code, unreachable_pub)] pub(crate) mod $m;
    )*};
}
internal! {
    buf;
    format;
    slot;
    stored;
    task;
}

pub use backend::{AutoBackend, Backend, BackendKind, PortableBackend, SimBackend};
pub use error::{Error, Result};
pub use format::{laid_out_crc, MAX_FRAMES, MAX_KEY_BYTES};
pub use log::{
    CompactStats, CompactionPolicy, Compression, Location, LogOptions, LogStats, RecoveryReport, SegmentLog,
    StoredValue, StreamedValue, VerifyProblem, MAX_SEGMENT_BYTES, MAX_VALUE_BYTES,
};
pub use store::{
    read_rss, take_thread_metrics, Activity, ActivityStats, Codec, CodecError, EvictionPolicy, LogInfo,
    MetricsSnapshot, Revive, RssProbe, SpillFailure, SpillFailureKind, Store, StoreConfig, Tier, RSS_CHECK_BYTES,
    SPILL_WRITE_BEHIND_BYTES,
};
pub use value::Frames;

/// The README's Rust examples, compiled by `cargo test` (as doctests) so they stay true to the API.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeExamples;
