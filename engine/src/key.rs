//! [`IndexKey`]: how the index holds a key, without a heap allocation for short keys.

use std::borrow::Borrow;
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};

/// The hasher of every map keyed by a key or a segment id: foldhash, seeded per map. Keys come from
/// the worker's own task graph and its peers, not from an adversary, so SipHash's DoS resistance
/// buys nothing here, while it cost 5-8% of a spilled 4 KiB get + remove (its hashing of short keys
/// showed at the top of the profile; docs/benchmarks.md, "Measured choices in the read path").
pub(crate) type KeyHasher = foldhash::fast::RandomState;

/// A map with [`KeyHasher`].
pub(crate) type KeyMap<K, V> = HashMap<K, V, KeyHasher>;

/// A set with [`KeyHasher`].
pub(crate) type KeySet<K> = HashSet<K, KeyHasher>;

/// Longest key stored inline.
pub const INLINE_KEY_BYTES: usize = 22;

/// A key as the index stores it: up to [`INLINE_KEY_BYTES`] bytes inline (24 bytes in all, no heap
/// block), longer keys boxed. Hashes and compares as the `[u8]` it holds, so the index can be
/// queried with `&[u8]`. Dask keys (`"('x-4f3a...', 3, 7)"`-like strings) are often longer; their
/// heap block is the key's own bytes plus the allocator's rounding.
#[derive(Clone)]
pub enum IndexKey {
    /// A short key.
    Inline {
        /// Bytes used.
        len: u8,
        /// The key, zero-padded.
        bytes: [u8; INLINE_KEY_BYTES],
    },
    /// A longer key.
    Heap(Box<[u8]>),
}

impl IndexKey {
    /// The key's bytes.
    pub fn as_slice(&self) -> &[u8] {
        match self {
            IndexKey::Inline { len, bytes } => &bytes[..*len as usize],
            IndexKey::Heap(b) => b,
        }
    }
}

impl From<&[u8]> for IndexKey {
    fn from(k: &[u8]) -> Self {
        if k.len() <= INLINE_KEY_BYTES {
            let mut bytes = [0u8; INLINE_KEY_BYTES];
            bytes[..k.len()].copy_from_slice(k);
            IndexKey::Inline { len: k.len() as u8, bytes }
        } else {
            IndexKey::Heap(Box::from(k))
        }
    }
}

impl std::ops::Deref for IndexKey {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Borrow<[u8]> for IndexKey {
    fn borrow(&self) -> &[u8] {
        self.as_slice()
    }
}

impl Hash for IndexKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        // Must hash exactly as `[u8]` does, for lookups through `Borrow<[u8]>`.
        self.as_slice().hash(state);
    }
}

impl PartialEq for IndexKey {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for IndexKey {}

impl std::fmt::Debug for IndexKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}", String::from_utf8_lossy(self.as_slice()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn short_keys_are_inline_and_lookups_by_slice_work() {
        assert_eq!(std::mem::size_of::<IndexKey>(), 24);
        let mut m: HashMap<IndexKey, u32> = HashMap::new();
        let keys: Vec<Vec<u8>> = (0..60).map(|n| vec![b'k'; n]).collect();
        for (i, k) in keys.iter().enumerate() {
            let ik = IndexKey::from(&k[..]);
            assert_eq!(matches!(ik, IndexKey::Inline { .. }), k.len() <= INLINE_KEY_BYTES);
            m.insert(ik, i as u32);
        }
        for (i, k) in keys.iter().enumerate() {
            assert_eq!(m.get(&k[..]), Some(&(i as u32)), "key of {} bytes", k.len());
        }
        // Equal prefixes of different lengths stay distinct ("" vs "\0").
        m.insert(IndexKey::from(&b"\0"[..]), 99);
        assert_eq!(m.get(&b""[..]), Some(&0));
        assert_eq!(m.get(&b"\0"[..]), Some(&99));
    }
}
