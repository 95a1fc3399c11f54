//! Values as lists of frames.

use bytes::{Bytes, BytesMut};

/// A serialized value: a small header frame plus zero or more large buffers (pickle protocol 5
/// out-of-band buffers are the model). Frames are stored and moved without being joined; frames read
/// back from disk are zero-copy slices of one read buffer.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Frames(pub Vec<Bytes>);

impl Frames {
    /// A value of one frame.
    pub fn single(b: impl Into<Bytes>) -> Self {
        Frames(vec![b.into()])
    }

    /// Total bytes over all frames (the exact in-memory weight of the serialized value).
    pub fn total_len(&self) -> u64 {
        self.0.iter().map(|f| f.len() as u64).sum()
    }

    /// Number of frames.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// True when there are no frames.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// The frames.
    pub fn iter(&self) -> impl Iterator<Item = &Bytes> {
        self.0.iter()
    }

    /// All frames joined into one buffer (copies unless there is exactly one frame).
    pub fn concat(&self) -> Bytes {
        match self.0.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            many => {
                let mut b = BytesMut::with_capacity(self.total_len() as usize);
                for f in many {
                    b.extend_from_slice(f);
                }
                b.freeze()
            }
        }
    }
}

impl From<Vec<Bytes>> for Frames {
    fn from(v: Vec<Bytes>) -> Self {
        Frames(v)
    }
}

impl From<Vec<u8>> for Frames {
    fn from(v: Vec<u8>) -> Self {
        Frames::single(v)
    }
}

impl From<&[u8]> for Frames {
    fn from(v: &[u8]) -> Self {
        Frames::single(Bytes::copy_from_slice(v))
    }
}
