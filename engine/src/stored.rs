//! The stored form of a value, in one place.
//!
//! A value's frames are *laid out* one after another, each at a [`format::FRAME_ALIGN`] (64-byte)
//! boundary with zeros between them ([`format::frame_layout`] gives the offsets). The stored form is
//! that layout as it is, or one lz4 block of it. The log writes it into records and reads it back,
//! the store keeps it in memory (`compress_in_memory`), and the transfer protocol sends and receives
//! it; all of them lay out, compress and cut it back into frames through this module, so a frame
//! read back starts 64-byte aligned wherever it came from.
//!
//! Errors here say what is wrong with the bytes ([`Malformed`]); each caller names where they came
//! from (a segment and offset, a peer, memory).

use std::io::Read;

use bytes::Bytes;

use crate::buf::AlignedBuf;
use crate::error::{Error, Result};
use crate::format;
use crate::log::StreamedValue;
use crate::value::Frames;

/// What is wrong with bytes that claim to be a stored form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Malformed {
    /// The lz4 block does not decompress to the announced length.
    Lz4,
    /// The frame lengths do not lay out to the announced length.
    Layout,
}

impl Malformed {
    /// The problem, in words.
    pub fn reason(self) -> &'static str {
        match self {
            Malformed::Lz4 => "lz4 payload does not decompress to its stated length",
            Malformed::Layout => "frame lengths do not lay out to the stated length",
        }
    }
}

/// The laid-out length of `frames` (frames plus the gaps that align them), `None` if it overflows.
pub fn laid_out_len(frames: &Frames) -> Option<u64> {
    format::frame_layout(frames.iter().map(|f| f.len() as u64)).map(|(_, n)| n)
}

/// `frames` laid out in one buffer.
pub fn lay_out(frames: &Frames) -> Vec<u8> {
    let raw = laid_out_len(frames).expect("frames in memory lay out within u64");
    let mut joined = vec![0u8; raw as usize];
    format::lay_out_frames(&mut joined, frames.iter().map(|f| &f[..]));
    joined
}

/// One lz4 block of `frames` laid out, and the laid-out length it decompresses to.
pub fn compress(frames: &Frames) -> (Vec<u8>, u64) {
    let joined = lay_out(frames);
    (lz4_flex::block::compress(&joined), joined.len() as u64)
}

/// Cut a laid-out payload into its frames, without copying.
pub fn cut(data: &Bytes, frame_lens: &[u64]) -> Result<Frames, Malformed> {
    let (offsets, total) = format::frame_layout(frame_lens.iter().copied()).ok_or(Malformed::Layout)?;
    if total != data.len() as u64 {
        return Err(Malformed::Layout);
    }
    Ok(Frames(frame_lens.iter().zip(offsets).map(|(&l, at)| data.slice(at as usize..(at + l) as usize)).collect()))
}

/// The frames of a stored form: `stored` itself when it is not compressed, else its lz4 block
/// decompressed into a 64-byte-aligned buffer of `raw_len` bytes.
pub fn decode(stored: Bytes, lz4: bool, raw_len: u64, frame_lens: &[u64]) -> Result<Frames, Malformed> {
    let data = if lz4 {
        let mut out = AlignedBuf::zeroed(raw_len as usize, format::FRAME_ALIGN as usize);
        match lz4_flex::block::decompress_into(&stored, &mut out) {
            Ok(n) if n as u64 == raw_len => out.freeze(),
            _ => return Err(Malformed::Lz4),
        }
    } else {
        stored
    };
    cut(&data, frame_lens)
}

/// Check what `m` announces before anything is allocated for it: at most `MAX_FRAMES` frames whose
/// lengths lay out to `raw_len`; an uncompressed value stored as it is; an lz4 block whose length
/// some compression of `raw_len` bytes can have (so `raw_len` is bounded by the stored length).
pub fn check_announced(m: &StreamedValue) -> Result<()> {
    let invalid = |why: &str| Err(Error::Protocol(format!("announced value: {why}")));
    if m.frame_lens.len() > format::MAX_FRAMES {
        return invalid("too many frames");
    }
    if format::frame_layout(m.frame_lens.iter().copied()).map(|(_, n)| n) != Some(m.raw_len) {
        return invalid("frame lengths do not lay out to raw_len");
    }
    if !m.lz4 && m.stored_len != m.raw_len {
        return invalid("uncompressed value with stored_len != raw_len");
    }
    if m.lz4 && !format::lz4_lengths_fit(m.stored_len, m.raw_len) {
        return invalid("lz4 lengths that no compression of raw_len has");
    }
    Ok(())
}

/// Read the stored form `m` announces from `src` into memory (at most `max` stored bytes;
/// [`check_announced`] first), check it against the announced checksum, and decode it. A source that breaks its announcement (too long,
/// a wrong checksum, a block that does not decode) is an error and yields nothing.
pub fn read(m: &StreamedValue, src: &mut dyn Read, max: u64) -> Result<Frames> {
    if m.stored_len > max {
        return Err(Error::Protocol(format!("value of {} stored bytes is over the limit of {max}", m.stored_len)));
    }
    check_announced(m)?;
    let mut buf = AlignedBuf::zeroed(m.stored_len as usize, format::FRAME_ALIGN as usize);
    src.read_exact(&mut buf).map_err(|e| Error::io("receive value", None, e))?;
    let actual = format::payload_crc(&buf);
    if actual != m.payload_crc {
        return Err(Error::ChecksumMismatch {
            segment: 0,
            offset: 0,
            what: "received value",
            expected: m.payload_crc,
            actual,
        });
    }
    decode(buf.freeze(), m.lz4, m.raw_len, &m.frame_lens).map_err(|e| Error::Protocol(e.reason().into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frames(lens: &[usize]) -> Frames {
        Frames(lens.iter().enumerate().map(|(i, &n)| Bytes::from(vec![i as u8 + 1; n])).collect())
    }

    /// Both forms give the frames back; an lz4 block decompresses into an aligned buffer, so its
    /// frames start 64-byte aligned, and a plain payload's frames are 64-byte aligned within it.
    #[test]
    fn a_value_comes_back_from_both_forms_with_aligned_frames() {
        let aligned = |f: &Bytes, base: usize| (f.as_ptr() as usize - base) % format::FRAME_ALIGN as usize == 0;
        for lens in [&[][..], &[0], &[1], &[100, 3, 0, 4096]] {
            let v = frames(lens);
            let lens64: Vec<u64> = lens.iter().map(|&n| n as u64).collect();
            let plain = Bytes::from(lay_out(&v));
            let (block, raw) = compress(&v);
            assert_eq!(raw, plain.len() as u64);
            let got = decode(plain.clone(), false, raw, &lens64).unwrap();
            assert_eq!(got, v);
            assert!(got.iter().all(|f| aligned(f, plain.as_ptr() as usize)), "{lens:?}");
            let got = decode(Bytes::from(block), true, raw, &lens64).unwrap();
            assert_eq!(got, v);
            assert!(got.iter().filter(|f| !f.is_empty()).all(|f| aligned(f, 0)), "{lens:?}");
        }
    }

    #[test]
    fn bytes_that_break_their_announcement_are_malformed() {
        let v = frames(&[10, 20]);
        let (block, raw) = compress(&v);
        assert_eq!(decode(Bytes::from(block.clone()), true, raw + 1, &[10, 20]), Err(Malformed::Lz4));
        assert_eq!(decode(Bytes::from(block[..block.len() - 1].to_vec()), true, raw, &[10, 20]), Err(Malformed::Lz4));
        assert_eq!(decode(Bytes::from(lay_out(&v)), false, raw, &[10, 21]), Err(Malformed::Layout));
        assert_eq!(cut(&Bytes::from(vec![0u8; 5]), &[u64::MAX, 1]), Err(Malformed::Layout));
    }
}
