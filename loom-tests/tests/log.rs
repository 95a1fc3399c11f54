//! loom model of the segment log's write-behind handshake (`LogOptions::write_behind_bytes`): the
//! `pending` word that tells a reader whether a record it found in the index is in the file yet. The
//! log's index and writer locks and that word come from loom through the sync shim; the simulated
//! backend's files are plain memory.
#![cfg(spillway_loom)]

use loom::sync::Arc;
use loom::thread;
use spillway::{Frames, LogOptions, SegmentLog, SimBackend};

fn value(tag: u8, len: usize) -> Frames {
    Frames::from(vec![tag; len])
}

/// A 4 KiB budget: a 100-byte record is written behind, a 5000-byte one writes what is pending.
fn log() -> Arc<SegmentLog<SimBackend>> {
    let opts = LogOptions { segment_bytes: 64 << 10, write_behind_bytes: 4096, ..LogOptions::default() };
    Arc::new(SegmentLog::open(SimBackend::new(), "/loom", opts).unwrap())
}

/// A reader races a put that stays pending and the later put that writes it: the reader gets nothing
/// or the value, never an error from reading bytes that are not in the file yet; a record written
/// before the race stays readable throughout. Storing `pending` after publishing the index entry
/// instead of before makes this model fail.
#[test]
fn reads_race_a_put_written_behind_and_its_write() {
    loom::model(|| {
        let log = log();
        log.put(b"first", &value(1, 100)).unwrap();
        log.sync().unwrap(); // nothing pending: the writer's next put is the first pending record
        let writer = {
            let log = log.clone();
            thread::spawn(move || {
                log.put(b"k", &value(2, 100)).unwrap(); // pending
                log.put(b"big", &value(3, 5000)).unwrap(); // over the budget: writes what is pending
            })
        };
        let got = log.get(b"k").unwrap();
        assert!(got.is_none() || got == Some(value(2, 100)), "{got:?}");
        assert_eq!(log.get(b"first").unwrap(), Some(value(1, 100)));
        writer.join().unwrap();
        assert_eq!(log.get(b"k").unwrap(), Some(value(2, 100)));
        assert_eq!(log.get(b"big").unwrap(), Some(value(3, 5000)));
    });
}

/// Two readers of pending records race each other (each copies its record out of the tail under the
/// writer lock) and a writer adding more: every acknowledged record reads back.
#[test]
fn concurrent_readers_of_pending_records_race_a_writer() {
    loom::model(|| {
        let log = log();
        log.put(b"a", &value(1, 100)).unwrap();
        log.put(b"b", &value(2, 100)).unwrap();
        let readers: Vec<_> = [(&b"a"[..], 1u8), (&b"b"[..], 2u8)]
            .into_iter()
            .map(|(k, tag)| {
                let log = log.clone();
                thread::spawn(move || assert_eq!(log.get(k).unwrap(), Some(value(tag, 100))))
            })
            .collect();
        log.put(b"c", &value(3, 100)).unwrap();
        for r in readers {
            r.join().unwrap();
        }
        assert_eq!(log.get(b"c").unwrap(), Some(value(3, 100)));
        assert!(log.verify().unwrap().is_empty());
    });
}

/// `forget` does not wait for the writer lock (a large write or compaction may hold it): it drops the index entry at once and leaves the space accounting to the lock's
/// next taker. Compaction, which holds that lock while it copies live records, must then not bring
/// a record forgotten meanwhile back: its copy counts only if the index still points at the original
/// when the copy is published. Without that check this model fails (the forgotten key reads back).
/// Afterwards the accounting settles: as many live records as index entries.
#[test]
fn forget_races_compaction_and_the_key_stays_forgotten() {
    loom::model(|| {
        let opts = LogOptions { segment_bytes: 64 << 10, auto_compact: false, ..LogOptions::default() };
        let log = Arc::new(SegmentLog::open(SimBackend::new(), "/loom", opts).unwrap());
        log.put(b"k", &value(1, 100)).unwrap();
        log.put(b"kept", &value(2, 100)).unwrap();
        for i in 0..3u8 {
            log.put(&[b'f', i], &value(3, 20 << 10)).unwrap(); // the third one seals the first segment
        }
        for i in 0..3u8 {
            log.forget(&[b'f', i]).unwrap();
        }
        let compactor = {
            let log = log.clone();
            thread::spawn(move || {
                log.compact().unwrap();
            })
        };
        assert!(log.forget(b"k").unwrap());
        compactor.join().unwrap();
        assert_eq!(log.get(b"k").unwrap(), None);
        assert_eq!(log.get(b"kept").unwrap(), Some(value(2, 100)));
        let stats = log.stats();
        assert_eq!(stats.live_records, log.len() as u64, "{stats:?}");
    });
}

/// A large value streamed in (`put_stream`: a segment of its own, the writer lock taken only to
/// begin and to publish) races a put and a delete of its key. Whatever the order, the running log
/// and a reopen of its files agree on the key's value, since both go by sequence numbers: the
/// stream's, drawn when it began, against the put's and the delete's. Publishing the stream without
/// asking whether a newer write of its key came meanwhile makes this model fail.
#[test]
fn a_stream_races_a_put_and_a_delete_of_its_key_and_a_reopen_agrees() {
    loom::model(|| {
        let opts = || LogOptions { segment_bytes: 64 << 10, ..LogOptions::default() };
        let be = SimBackend::new();
        let log = Arc::new(SegmentLog::open(be.clone(), "/loom", opts()).unwrap());
        log.put(b"d", &value(1, 100)).unwrap();
        let streamed = value(7, (1 << 20) + 100); // over 1 MiB: a segment of its own
        let (_, raw_len) = spillway::format::frame_layout([streamed.total_len()]).unwrap();
        let meta = spillway::StreamedValue {
            lz4: false,
            frame_lens: vec![raw_len],
            raw_len,
            stored_len: raw_len,
            payload_crc: spillway::format::payload_crc(&streamed.0[0]),
        };
        let streamer = {
            let (log, meta, payload) = (log.clone(), meta.clone(), streamed.0[0].clone());
            thread::spawn(move || {
                log.put_stream(b"k", &meta, &mut &payload[..]).unwrap();
                log.put_stream(b"d", &meta, &mut &payload[..]).unwrap();
            })
        };
        log.put(b"k", &value(2, 100)).unwrap();
        log.delete(b"d").unwrap();
        streamer.join().unwrap();
        let (k, d) = (log.get(b"k").unwrap(), log.get(b"d").unwrap());
        assert!(k == Some(value(2, 100)) || k == Some(streamed.clone()), "{k:?}");
        assert!(d.is_none() || d == Some(streamed.clone()), "{d:?}");
        drop(log); // the last handle (the streamer's went with its thread)
        let reopened = SegmentLog::open(be, "/loom", opts()).unwrap();
        assert_eq!(reopened.get(b"k").unwrap(), k);
        assert_eq!(reopened.get(b"d").unwrap(), d);
    });
}
