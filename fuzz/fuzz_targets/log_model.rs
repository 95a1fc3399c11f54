//! Model-based: op sequences (put, put_many, get, delete, forget, sync, compact, clean reopen) run
//! against a `SegmentLog` on the simulated disk and against a `BTreeMap`; every read must agree with
//! the model, before and after reopening. With a fault armed (the first input byte says after how many
//! I/O steps, and which kind), the same ops run until the log fails; then a power cut and a reopen must
//! still return every record that was synced before the fault (and not deleted since), byte for byte.
//! The top bit of the first op code turns on write-behind (`LogOptions::write_behind_bytes`); the
//! next one gathered writes (values of 1 KiB or more written from their own buffers), with the crcs
//! of gathered batches of 4 KiB or more computed on a helper thread and their heads written last.
#![no_main]

use std::collections::BTreeMap;

use libfuzzer_sys::fuzz_target;
use spillway::backend::{Fault, FaultKind, FaultOp};
use spillway::{Frames, LogOptions, SegmentLog, SimBackend};

fn value(key: u8, len: usize, gen: u32) -> Frames {
    let v: Vec<u8> = (0..len).map(|i| (i as u32).wrapping_mul(31).wrapping_add(key as u32 * 7 + gen) as u8).collect();
    // Two frames when long enough, as a pickle header plus a buffer would be.
    if len > 10 {
        let b = bytes::Bytes::from(v);
        Frames(vec![b.slice(..3), b.slice(3..)])
    } else {
        Frames::from(v)
    }
}

/// With `write_behind`, small batches stay pending in memory until 8 KiB are (reads, syncs,
/// compaction and reopening must not notice, except through a power cut before a sync).
fn opts(write_behind: bool) -> LogOptions {
    LogOptions {
        segment_bytes: 64 << 10,
        write_group_bytes: 4 << 10,
        write_behind_bytes: if write_behind { 8 << 10 } else { 0 },
        gather_min_bytes: 1024,
        parallel_crc_min_bytes: 4096,
        ..Default::default()
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, ops)) = data.split_first() else { return };
    let be = SimBackend::new();
    be.set_queue_writes(mode & 1 == 1);
    // The first byte's bits all have a use; an op code only uses its low three bits.
    let write_behind = ops.first().is_some_and(|c| c & 0x80 != 0);
    be.set_gather_writes(ops.first().is_some_and(|c| c & 0x40 != 0));
    let mut log = SegmentLog::open(be.clone(), "/s", opts(write_behind)).unwrap();
    let faulty = mode & 0x80 != 0;
    if faulty {
        let kind = [FaultKind::Eio, FaultKind::Enospc, FaultKind::TornWrite, FaultKind::TornEnospc][(mode as usize >> 1) % 4];
        be.inject(Fault { op: FaultOp::Any, after: ((mode >> 3) & 0x0f) as u64 * 3, kind, sticky: false });
    }
    let mut model: BTreeMap<u8, Frames> = BTreeMap::new();
    // What a power cut must keep: the model as of the last successful sync.
    let mut synced: BTreeMap<u8, Frames> = BTreeMap::new();
    let mut gen = 0u32;
    let mut failed = false;
    // Keys written or deleted since the last sync, including by the failing operation: after a power
    // cut any prefix of the unsynced writes may have landed (a torn write can carry whole records), so
    // only keys untouched since the last sync have one right answer.
    let mut dirty: std::collections::BTreeSet<u8> = std::collections::BTreeSet::new();
    // Keys of a call that failed for lack of space (the log stays writable and the run goes on): its
    // records may have reached the file past the published end, so after a power cut they may come
    // back, until a later successful write of the key supersedes them.
    let mut uncertain: std::collections::BTreeSet<u8> = std::collections::BTreeSet::new();
    for op in ops.chunks(3) {
        let [code, key, size] = [op[0], *op.get(1).unwrap_or(&0), *op.get(2).unwrap_or(&0)];
        let key = key % 16;
        let k = [b'k', key];
        gen += 1;
        match code % 8 {
            0 | 1 | 3 => {
                dirty.insert(key);
            }
            2 => {
                dirty.extend([key, (key + 1) % 16, (key + 5) % 16]);
            }
            _ => {}
        }
        let r: spillway::Result<()> = match code % 8 {
            0 | 1 => {
                let v = value(key, size as usize * 37, gen);
                log.put(&k, &v).map(|()| {
                    model.insert(key, v);
                })
            }
            2 => {
                let keys = [key, (key + 1) % 16, (key + 5) % 16];
                let vals: Vec<Frames> = keys.iter().map(|&kk| value(kk, size as usize * 53, gen)).collect();
                let names: Vec<[u8; 2]> = keys.iter().map(|&kk| [b'k', kk]).collect();
                let items: Vec<(&[u8], &Frames)> = names.iter().zip(&vals).map(|(n, v)| (&n[..], v)).collect();
                log.put_many(&items).map(|()| {
                    for (kk, v) in keys.iter().zip(vals) {
                        model.insert(*kk, v);
                    }
                })
            }
            3 => {
                synced.remove(&key);
                log.delete(&k).map(|existed| {
                    assert_eq!(existed, model.remove(&key).is_some());
                })
            }
            4 => log.get(&k).map(|got| {
                if !failed {
                    assert_eq!(got.as_ref(), model.get(&key), "get of {key}");
                }
            }),
            5 => log.sync().map(|()| {
                synced = model.clone();
                dirty.clear();
            }),
            6 => log.compact().map(|_| ()),
            _ => {
                if faulty {
                    Ok(())
                } else {
                    drop(log);
                    log = SegmentLog::open(be.clone(), "/s", opts(write_behind)).unwrap();
                    for (key, v) in &model {
                        assert_eq!(log.get(&[b'k', *key]).unwrap().as_ref(), Some(v), "after reopen");
                    }
                    assert_eq!(log.len(), model.len());
                    Ok(())
                }
            }
        };
        let touched: Vec<u8> = match code % 8 {
            0 | 1 | 3 => vec![key],
            2 => vec![key, (key + 1) % 16, (key + 5) % 16],
            _ => vec![],
        };
        match r {
            Ok(()) => {
                for k in touched {
                    uncertain.remove(&k);
                }
            }
            // A write refused for lack of space changed nothing the log serves: go on.
            Err(e) if e.is_no_space() && code % 8 != 5 => {
                assert!(faulty, "no fault armed, yet {e}");
                if code % 8 == 2 {
                    // `put_many` is not atomic across segments: each value is its old or its new one.
                    for &kk in &touched {
                        let got = log.get(&[b'k', kk]).expect("reads work on a full file system");
                        let new = value(kk, size as usize * 53, gen);
                        assert!(got.as_ref() == model.get(&kk) || got.as_ref() == Some(&new), "put_many of {kk}");
                        if got.as_ref() == Some(&new) {
                            model.insert(kk, new);
                        }
                    }
                }
                uncertain.extend(touched);
            }
            Err(e) => {
                assert!(faulty, "no fault armed, yet {e}");
                failed = true;
                break;
            }
        }
    }
    if faulty {
        drop(log);
        let be = be.crash(Some(gen as u64));
        let log = SegmentLog::open(be, "/s", opts(write_behind)).expect("reopen after a power cut");
        // Every key untouched since the last sync reads as synced: its value, or absent (never
        // written, or deleted and synced: a tombstone must not be lost).
        for key in 0..16u8 {
            if !dirty.contains(&key) && !uncertain.contains(&key) {
                assert_eq!(log.get(&[b'k', key]).unwrap().as_ref(), synced.get(&key), "synced state of {key}");
            }
        }
    } else {
        assert!(!failed);
    }
});
