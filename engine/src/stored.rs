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
use crate::value::Frames;

/// The stored form of a value announced before its bytes arrive (a peer's VALUE header): what
/// `read` and `PayloadCheck` check the bytes against, and what
/// [`SegmentLog::put_stream`](crate::SegmentLog::put_stream) stores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamedValue {
    /// The payload is an lz4 block of the laid-out frames.
    pub lz4: bool,
    /// Length of each frame.
    pub frame_lens: Vec<u64>,
    /// Length of the laid-out frames (`format::frame_layout`).
    pub raw_len: u64,
    /// Bytes that follow on the stream.
    pub stored_len: u64,
    /// crc32 of those bytes.
    pub payload_crc: u32,
}

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

/// Checks a stored form as it arrives, a piece at a time, before it replaces anything: its crc32
/// against the one announced and, for an lz4 block, that it decompresses to exactly `raw_len` bytes
/// (see [`Lz4Check`]). The streamed puts of the log use it, so that what they publish reads back.
pub struct PayloadCheck {
    crc: crc32fast::Hasher,
    lz4: Option<Lz4Check>,
}

impl PayloadCheck {
    /// A check of the stored form `m` announces.
    pub fn new(m: &StreamedValue) -> Self {
        PayloadCheck { crc: crc32fast::Hasher::new(), lz4: m.lz4.then(|| Lz4Check::new(m.raw_len)) }
    }

    /// The next piece of the stored form.
    pub fn update(&mut self, piece: &[u8]) {
        self.crc.update(piece);
        if let Some(c) = &mut self.lz4 {
            c.update(piece);
        }
    }

    /// After the last piece: a crc32 other than `m`'s is [`Error::peer_checksum`] about `what`; an
    /// lz4 block that does not decompress to
    /// `raw_len` a `Protocol` error.
    pub fn finish(self, m: &StreamedValue, what: &'static str) -> Result<()> {
        let actual = self.crc.finalize();
        if actual != m.payload_crc {
            return Err(Error::peer_checksum(what, m.payload_crc, actual));
        }
        if self.lz4.is_some_and(|c| !c.finish()) {
            return Err(Error::Protocol(format!("{what}: {}", Malformed::Lz4.reason())));
        }
        Ok(())
    }
}

/// Whether bytes are an lz4 block (`lz4_flex::block`) that decompresses to exactly `raw_len`
/// bytes, decided a piece at a time in constant memory, without decompressing. Whether a block
/// decodes does not depend on the bytes it produces, only on its sequences: each a token, a
/// literal length (extended by bytes while they are 255), the literals, then, unless the block
/// ends right there, a 2-byte match offset (neither 0 nor reaching before the start of the output)
/// and a match length (extended the same way). The output may never pass `raw_len`, and must end
/// exactly at it. These are the rules `lz4_flex::block::decompress_into`, which every read of a
/// stored form decodes with, applies; a test holds the two to the same verdicts.
#[derive(Debug, Clone)]
pub struct Lz4Check {
    raw_len: u64,
    /// Bytes the block has produced so far.
    out: u64,
    state: Lz4State,
    bad: bool,
}

/// Where in a sequence an [`Lz4Check`] is. `matched`: the match length the token gave (its low
/// nibble + 4; 19 means more bytes follow the offset).
#[derive(Debug, Clone, Copy)]
enum Lz4State {
    Token,
    LiteralLen {
        len: u64,
        matched: u64,
    },
    Literals {
        left: u64,
        matched: u64,
    },
    /// Right after a sequence's literals: the block may end here.
    Offset {
        matched: u64,
    },
    OffsetHigh {
        low: u8,
        matched: u64,
    },
    MatchLen {
        len: u64,
    },
}

/// lz4's shortest match.
const LZ4_MIN_MATCH: u64 = 4;

impl Lz4Check {
    /// A check of a block that must decompress to `raw_len` bytes.
    pub fn new(raw_len: u64) -> Self {
        Lz4Check { raw_len, out: 0, state: Lz4State::Token, bad: false }
    }

    fn literals(left: u64, matched: u64) -> Lz4State {
        if left == 0 {
            Lz4State::Offset { matched }
        } else {
            Lz4State::Literals { left, matched }
        }
    }

    /// The next piece of the block.
    pub fn update(&mut self, mut piece: &[u8]) {
        use Lz4State::*;
        while let Some((&b, rest)) = piece.split_first() {
            if self.bad {
                return;
            }
            self.state = match self.state {
                Token => {
                    piece = rest;
                    let matched = (b & 15) as u64 + LZ4_MIN_MATCH;
                    match b >> 4 {
                        15 => LiteralLen { len: 15, matched },
                        n => Self::literals(n as u64, matched),
                    }
                }
                LiteralLen { len, matched } => {
                    piece = rest;
                    match b {
                        255 => LiteralLen { len: len + 255, matched },
                        b => Self::literals(len + b as u64, matched),
                    }
                }
                Literals { left, matched } => {
                    let n = left.min(piece.len() as u64);
                    piece = &piece[n as usize..];
                    self.out += n;
                    Self::literals(left - n, matched)
                }
                Offset { matched } => {
                    piece = rest;
                    OffsetHigh { low: b, matched }
                }
                OffsetHigh { low, matched } => {
                    piece = rest;
                    let offset = u16::from_le_bytes([low, b]) as u64;
                    if offset == 0 || offset > self.out {
                        self.bad = true;
                        return;
                    }
                    if matched == 15 + LZ4_MIN_MATCH {
                        MatchLen { len: matched }
                    } else {
                        self.out += matched;
                        Token
                    }
                }
                MatchLen { len } => {
                    piece = rest;
                    match b {
                        255 => MatchLen { len: len + 255 },
                        b => {
                            self.out += len + b as u64;
                            Token
                        }
                    }
                }
            };
            if self.out > self.raw_len {
                self.bad = true;
            }
        }
    }

    /// After the last piece: whether the block decompresses to exactly `raw_len` bytes.
    pub fn finish(&self) -> bool {
        !self.bad && matches!(self.state, Lz4State::Offset { .. }) && self.out == self.raw_len
    }
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

/// Memory [`read`] allocates for a value before any of it has arrived: its buffer starts at this
/// (or at the announced length, if that is less) and doubles as the bytes arrive, so an
/// announcement costs at most this, or twice the bytes that came, whatever it says. An lz4 block
/// is decompressed into more than this and twice its own length only once it is known to decode to
/// exactly the announced length ([`Lz4Check`]). A value of up to this size is read into one
/// buffer, without a copy.
pub const READ_AHEAD_BYTES: u64 = 64 << 20;

/// Read the stored form `m` announces from `src` into memory (at most `max` stored bytes;
/// [`check_announced`] first), check it against the announced checksum, and decode it. A source that breaks its announcement (too long,
/// a wrong checksum, a block that does not decode) is an error and yields nothing. Memory is
/// allocated as the bytes arrive, not as announced (see [`READ_AHEAD_BYTES`]).
pub fn read(m: &StreamedValue, src: &mut dyn Read, max: u64) -> Result<Frames> {
    if m.stored_len > max {
        return Err(Error::Protocol(format!("value of {} stored bytes is over the limit of {max}", m.stored_len)));
    }
    check_announced(m)?;
    let buf = read_growing(src, m.stored_len)?;
    let actual = format::payload_crc(&buf);
    if actual != m.payload_crc {
        return Err(Error::peer_checksum("received value", m.payload_crc, actual));
    }
    // A block that claims far more than arrived is checked before its output is allocated.
    if m.lz4 && m.raw_len > READ_AHEAD_BYTES.max(m.stored_len.saturating_mul(2)) {
        let mut check = Lz4Check::new(m.raw_len);
        check.update(&buf);
        if !check.finish() {
            return Err(Error::Protocol(Malformed::Lz4.reason().into()));
        }
    }
    decode(buf.freeze(), m.lz4, m.raw_len, &m.frame_lens).map_err(|e| Error::Protocol(e.reason().into()))
}

/// The `len` bytes `src` sends, in one 64-byte-aligned buffer allocated as they arrive: at first
/// [`READ_AHEAD_BYTES`] at most, then, each time it is full, twice what it holds (at most `len`),
/// the bytes so far copied over. A source that ends early is `UnexpectedEof`.
fn read_growing(src: &mut dyn Read, len: u64) -> Result<AlignedBuf> {
    let align = format::FRAME_ALIGN as usize;
    let mut buf = AlignedBuf::zeroed(len.min(READ_AHEAD_BYTES) as usize, align);
    let mut at = 0;
    loop {
        src.read_exact(&mut buf[at..]).map_err(|e| Error::io("receive value", None, e))?;
        at = buf.len();
        if at as u64 == len {
            return Ok(buf);
        }
        let grown = len.min((at as u64).saturating_mul(2)) as usize;
        let mut more = AlignedBuf::with_capacity(grown, align);
        more.extend_from_slice(&buf);
        more.set_len(grown); // (zeros past the copy: `with_capacity` zero-fills)
        buf = more;
    }
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

    /// `Lz4Check`'s verdict, fed in pieces split at random, against whether
    /// `lz4_flex::block::decompress_into` decodes the same bytes to exactly `raw_len`: over real
    /// blocks of data of every compressibility, and those blocks damaged (a byte changed, cut short,
    /// one byte longer, announced a byte shorter or longer), and random bytes.
    #[test]
    fn the_lz4_check_agrees_with_the_decoder_on_every_block() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let decodes = |block: &[u8], raw_len: u64| {
            let mut out = vec![0u8; raw_len as usize];
            matches!(lz4_flex::block::decompress_into(block, &mut out), Ok(n) if n as u64 == raw_len)
        };
        let (mut good, mut bad) = (0, 0);
        for _ in 0..20_000 {
            // Runs of a repeated byte among random ones: from all runs to all noise.
            let len = rng.gen_range(0..3000usize);
            let noise = rng.gen_range(0.0..1.0);
            let mut data = Vec::with_capacity(len);
            while data.len() < len {
                if rng.gen_bool(noise) {
                    data.push(rng.gen());
                } else {
                    let b: u8 = rng.gen();
                    data.extend(std::iter::repeat_n(b, rng.gen_range(1..300)));
                }
            }
            data.truncate(len);
            let block = lz4_flex::block::compress(&data);
            let raw = data.len() as u64;
            let mut cases = vec![(block.clone(), raw)];
            let mut changed = block.clone();
            let at = rng.gen_range(0..changed.len());
            changed[at] = rng.gen();
            cases.push((changed, raw));
            cases.push((block[..rng.gen_range(0..block.len())].to_vec(), raw));
            cases.push(([&block[..], &[rng.gen()]].concat(), raw));
            cases.push((block.clone(), raw + 1));
            cases.push((block.clone(), raw.saturating_sub(1)));
            cases.push(((0..rng.gen_range(0..64)).map(|_| rng.gen()).collect(), rng.gen_range(0..256)));
            for (bytes, raw_len) in cases {
                let mut check = Lz4Check::new(raw_len);
                let mut rest = &bytes[..];
                while !rest.is_empty() {
                    let (piece, after) = rest.split_at(rng.gen_range(1..=rest.len()));
                    check.update(piece);
                    rest = after;
                }
                let expected = decodes(&bytes, raw_len);
                assert_eq!(check.finish(), expected, "{bytes:?} to {raw_len} bytes");
                if expected {
                    good += 1;
                } else {
                    bad += 1;
                }
            }
        }
        assert!(good > 20_000 && bad > 60_000, "both verdicts well covered: {good} good, {bad} bad");
    }
}
