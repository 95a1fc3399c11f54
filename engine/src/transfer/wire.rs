//! The bytes on the wire (`docs/wire.md`): the greeting, a request's head, the VALUE header and the
//! bounds it is checked against before anything is allocated, the status bytes.

use std::io::Read;

use crate::error::{Error, Result};
use crate::format::{self, MAX_FRAMES};
use crate::log::StreamedValue;

use super::access::TICKET_BYTES;
use super::{io_err, proto};

/// Protocol version spoken by this build.
pub const PROTOCOL_VERSION: u16 = 2;

pub(super) const MAGIC: [u8; 4] = *b"SPWY";

pub(super) const OP_GET: u8 = 1;

pub(super) const ST_VALUE: u8 = 0;

pub(super) const ST_NOT_FOUND: u8 = 1;

pub(super) const ST_ERROR: u8 = 2;

pub(super) const MAX_ERROR_BYTES: usize = 4096;

pub(super) fn hello() -> [u8; 8] {
    let mut h = [0u8; 8];
    h[..4].copy_from_slice(&MAGIC);
    h[4..6].copy_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    h
}

pub(super) fn check_hello(h: &[u8; 8]) -> Result<()> {
    if h[..4] != MAGIC {
        return Err(proto("peer is not a spillway transfer endpoint (bad magic)"));
    }
    let v = u16::from_le_bytes([h[4], h[5]]);
    if v != PROTOCOL_VERSION {
        return Err(Error::UnsupportedVersion {
            what: "transfer protocol",
            found: v as u32,
            supported: PROTOCOL_VERSION as u32,
        });
    }
    Ok(())
}

/// The fixed part of a VALUE response after its status byte.
pub(super) fn value_header(m: &StreamedValue) -> Vec<u8> {
    let mut h = Vec::with_capacity(32 + 8 * m.frame_lens.len());
    h.push(u8::from(m.lz4));
    h.extend_from_slice(&[0u8; 3]);
    h.extend_from_slice(&(m.frame_lens.len() as u32).to_le_bytes());
    h.extend_from_slice(&m.raw_len.to_le_bytes());
    h.extend_from_slice(&m.stored_len.to_le_bytes());
    h.extend_from_slice(&m.payload_crc.to_le_bytes());
    h.extend_from_slice(&[0u8; 4]);
    for l in &m.frame_lens {
        h.extend_from_slice(&l.to_le_bytes());
    }
    h
}

/// Parse the header of a VALUE response (after its status byte) from `r`, applying every bound the
/// client applies (`max` stored bytes). Public for fuzzing and for tools speaking the protocol.
pub fn read_value_header(r: &mut impl Read, max: u64) -> Result<StreamedValue> {
    let mut h = [0u8; 32];
    r.read_exact(&mut h).map_err(|e| io_err("receive value header", e))?;
    let flags = h[0];
    if flags & !1 != 0 || h[1..4] != [0, 0, 0] {
        return Err(proto(format!("unknown value flags {flags:#x}")));
    }
    let n = u32::from_le_bytes(h[4..8].try_into().expect("4 bytes")) as usize;
    let raw_len = u64::from_le_bytes(h[8..16].try_into().expect("8 bytes"));
    let stored_len = u64::from_le_bytes(h[16..24].try_into().expect("8 bytes"));
    let payload_crc = u32::from_le_bytes(h[24..28].try_into().expect("4 bytes"));
    if n > MAX_FRAMES {
        return Err(proto(format!("{n} frames is over the limit of {MAX_FRAMES}")));
    }
    if stored_len > max || raw_len > max.saturating_add(64 * n as u64) {
        return Err(proto(format!("value of {stored_len} stored bytes is over the limit of {max}")));
    }
    let mut lens = vec![0u8; 8 * n];
    r.read_exact(&mut lens).map_err(|e| io_err("receive frame table", e))?;
    let frame_lens: Vec<u64> =
        lens.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect();
    if format::frame_layout(frame_lens.iter().copied()).map(|(_, l)| l) != Some(raw_len) {
        return Err(proto("frame lengths do not lay out to the announced length"));
    }
    let lz4 = flags & 1 != 0;
    if !lz4 && stored_len != raw_len {
        return Err(proto("uncompressed value whose stored length differs from its length"));
    }
    // Before any receive path allocates `raw_len` for the decompressed value.
    if lz4 && !format::lz4_lengths_fit(stored_len, raw_len) {
        return Err(proto(format!("lz4 value of {stored_len} bytes cannot be the compression of {raw_len}")));
    }
    Ok(StreamedValue { lz4, frame_lens, raw_len, stored_len, payload_crc })
}

/// Bytes of a request before its key: op (1), ticket ([`TICKET_BYTES`]), key length (4).
pub(super) const REQUEST_HEAD: usize = 1 + TICKET_BYTES + 4;

/// The message of the ERROR response to a request its server's [`Access`](crate::transfer::Access) refused.
pub const NOT_AUTHORIZED: &str = "not authorized";

/// The head of a VALUE response (status byte, header, frame table); the stored bytes follow. Used by
/// the server, and by tests and tools that speak the protocol by hand.
pub fn encode_value_response(meta: &StreamedValue) -> Vec<u8> {
    let mut v = vec![ST_VALUE];
    v.extend_from_slice(&value_header(meta));
    v
}

/// The greeting both sides send first (for tests that speak the protocol by hand).
#[cfg(feature = "testing")]
pub fn greeting() -> [u8; 8] {
    hello()
}
