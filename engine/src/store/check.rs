//! `check_accounting`: recompute every total from the entries and compare (tests and fuzzing).

use crate::backend::Backend;

use super::entry::Tier;
use super::{key_str, Codec, Store};

impl<C: Codec, B: Backend> Store<C, B> {
    /// Recompute the accounting from the entries and compare it with the running totals, the LRU order
    /// and the log's index. `Err` names the first difference. For tests and debugging: it walks every
    /// entry under the store's lock.
    #[doc(hidden)]
    pub fn check_accounting(&self) -> std::result::Result<(), String> {
        let inner = self.lock();
        let (mut mem, mut disk, mut raw, mut spilled, mut spilled_raw) = (0u64, 0u64, 0u64, 0u64, 0u64);
        let (mut count, mut bytes) = ([0u64; 4], [0u64; 4]);
        let mut in_lru = 0usize;
        for (k, e) in &inner.map {
            let name = key_str(k);
            count[e.tier.idx()] += 1;
            bytes[e.tier.idx()] += if e.tier == Tier::Disk { e.disk_bytes } else { e.weight };
            mem += e.mem_weight();
            if e.tier == Tier::Disk {
                spilled += e.weight;
                spilled_raw += e.disk_raw;
            }
            disk += e.disk_bytes;
            raw += e.disk_raw;
            let logged = self.logs.location(k).map(|l| l.len);
            // A key being written (or streamed, its old record set aside) may or may not have its
            // new record in the log yet.
            let settled = !inner.writing.contains_key(k) && !inner.streams.contains_key(k);
            if settled && ((e.disk_bytes > 0) != logged.is_some() || logged.is_some_and(|l| l != e.disk_bytes)) {
                return Err(format!("{name:?}: accounted {} bytes on disk, the log has {logged:?}", e.disk_bytes));
            }
            match e.tier {
                Tier::Disk => {
                    if e.frames.is_some() || e.compressed.is_some() || e.disk_bytes == 0 {
                        return Err(format!("{name:?}: disk entry with memory state or no record"));
                    }
                }
                _ if e.stuck => {
                    if inner.lru.get(&e.tick).is_some_and(|l| l == k) {
                        return Err(format!("{name:?}: stuck but in the LRU"));
                    }
                    if !inner.stuck.contains(&k[..]) {
                        return Err(format!("{name:?}: stuck but not listed for unsticking"));
                    }
                }
                _ => {
                    in_lru += 1;
                    if inner.lru.get(&e.tick).is_none_or(|l| l != k) {
                        return Err(format!("{name:?}: in memory but not in the LRU at its tick {}", e.tick));
                    }
                }
            }
            let has_bytes = match e.tier {
                Tier::Materialized => e.slot.state() == crate::slot::SlotState::Ready,
                Tier::Serialized => e.frames.as_ref().is_some_and(|f| f.total_len() == e.weight),
                Tier::Compressed => e.compressed.as_ref().is_some_and(|c| c.block.len() as u64 == e.weight),
                Tier::Disk => true,
            };
            if !has_bytes {
                return Err(format!("{name:?}: {} entry without its value (or with a wrong weight)", e.tier.name()));
            }
        }
        if in_lru != inner.lru.len() {
            return Err(format!("LRU holds {} keys, {in_lru} entries are in memory", inner.lru.len()));
        }
        if inner.stuck.len() > inner.map.len() {
            return Err(format!("{} keys listed as stuck, {} entries", inner.stuck.len(), inner.map.len()));
        }
        // Values set aside by transfers in progress still count.
        for st in inner.streams.values() {
            mem += st.aside_weight;
            raw += st.aside_raw;
        }
        if (mem, disk, raw, spilled, spilled_raw, count, bytes)
            != (
                inner.mem_bytes,
                inner.disk_bytes,
                inner.disk_raw,
                inner.disk_weight,
                inner.spilled_raw,
                inner.tier_count,
                inner.tier_bytes,
            )
        {
            return Err(format!(
                "totals drifted: recomputed mem {mem} disk {disk} raw {raw} spilled weight {spilled} counts {count:?} \
                 bytes {bytes:?}, running mem {} disk {} raw {} spilled weight {} counts {:?} bytes {:?}",
                inner.mem_bytes,
                inner.disk_bytes,
                inner.disk_raw,
                inner.disk_weight,
                inner.tier_count,
                inner.tier_bytes
            ));
        }
        if !inner.writing.is_empty() {
            return Ok(()); // records of writes in flight may or may not be in the log yet
        }
        if (inner.writing_weight, inner.writing_raw) != (0, 0) {
            return Err(format!(
                "no write in flight, but {} weight and {} bytes counted as being written",
                inner.writing_weight, inner.writing_raw
            ));
        }
        if self.logs.len() != inner.map.values().filter(|e| e.disk_bytes > 0).count() {
            return Err(format!("the log holds {} keys the store does not know of", self.logs.len()));
        }
        Ok(())
    }
}
