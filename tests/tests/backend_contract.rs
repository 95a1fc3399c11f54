//! The `Backend` contract, checked the same way against every backend: portable (buffered and
//! O_DIRECT), io_uring (buffered and O_DIRECT), the automatic choice, and the simulated disk. The log
//! relies on each of these rules; a backend that breaks one fails here by name.

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use spillway::backend::{PipelinedRead, UringOptions};
use spillway::buf::AlignedBuf;
use spillway::task::block_on;
use spillway::{AutoBackend, Backend, BackendKind, PortableBackend, SimBackend};
use spillway_tests::{uring_or_skip, Rng};

/// A buffer of `len` bytes at the backend's alignment, filled from `seed`.
fn filled<B: Backend>(b: &B, align: usize, len: usize, seed: u64) -> AlignedBuf {
    let mut buf = b.alloc_buf(len, align);
    let mut rng = Rng::new(seed);
    for x in buf.iter_mut() {
        *x = rng.next_u64() as u8;
    }
    buf
}

fn read<B: Backend>(b: &B, f: &B::File, offset: u64, len: usize, align: usize) -> io::Result<Vec<u8>> {
    let (r, buf) = b.read_at(f, offset, b.alloc_buf(len, align));
    r.map(|()| buf.to_vec())
}

/// Every rule of the contract, in `dir` (a real directory, or a path of the simulated disk).
fn contract<B: Backend>(name: &str, b: &B, dir: &Path) {
    let at = |what: &str| format!("{name}: {what}");
    // Directories.
    let sub = dir.join("d");
    assert!(!b.is_dir(&sub), "{}", at("a missing directory is not a directory"));
    b.create_dir_all(&sub.join("e")).unwrap();
    assert!(b.is_dir(&sub) && b.is_dir(&sub.join("e")), "{}", at("create_dir_all creates parents"));
    b.create_dir_all(&sub).expect("create_dir_all of an existing directory succeeds");

    // Alignment.
    let align = b.alignment(&sub);
    let read_align = b.read_alignment(&sub);
    assert!(align.is_power_of_two() && align >= 512, "{}", at(&format!("alignment {align}")));
    assert!(read_align.is_power_of_two() && align % read_align == 0, "{}", at(&format!("read alignment {read_align}")));

    // Open: create fails on an existing file, open fails on a missing one.
    let path = sub.join("f");
    assert_eq!(b.open(&path, false).err().map(|e| e.kind()), Some(io::ErrorKind::NotFound), "{}", at("open missing"));
    let f = b.open(&path, true).unwrap();
    assert_eq!(
        b.open(&path, true).err().map(|e| e.kind()),
        Some(io::ErrorKind::AlreadyExists),
        "{}",
        at("create twice")
    );
    assert_eq!(b.file_len(&f).unwrap(), 0, "{}", at("a new file is empty"));
    assert!(b.list_dir(&sub).unwrap().contains(&"f".to_string()), "{}", at("list_dir names the file"));

    // allocate extends the file to `len`.
    let len = 64 * align;
    b.allocate(&f, len as u64).unwrap();
    assert_eq!(b.file_len(&f).unwrap(), len as u64, "{}", at("allocate sets the length"));

    // write_at / read_at move exactly the buffer, at the offset, and hand the buffer back.
    let w = filled(b, align, 8 * align, 1);
    let want = w.to_vec();
    let (r, back) = b.write_at(&f, 4 * align as u64, w);
    r.unwrap();
    assert_eq!(back.len(), want.len(), "{}", at("write_at hands its buffer back"));
    assert_eq!(
        read(b, &f, 4 * align as u64, 8 * align, align).unwrap(),
        want,
        "{}",
        at("read_at reads what was written")
    );
    assert!(read(b, &f, 0, align, align).unwrap().iter().all(|&x| x == 0), "{}", at("allocated bytes read as zeros"));
    let (r, got) = b.read_at(&f, 4 * align as u64, b.alloc_buf(read_align, read_align));
    r.unwrap();
    assert_eq!(&got[..], &want[..read_align], "{}", at("a read at the read alignment"));
    let got = b.read_new(&f, 4 * align as u64, 2 * align, align).unwrap();
    assert_eq!(&got[..], &want[..2 * align], "{}", at("read_new"));

    // read_new_crc: read_new's bytes and the payload crc of the range asked for, small or large (the
    // file backends read a large one in two halves on two threads).
    let g = b.open(&sub.join("g"), true).unwrap();
    let big = 5 << 20;
    let w = filled(b, align, big, 3);
    let want_big = w.to_vec();
    b.write_at(&g, 0, w).0.unwrap();
    for (len, check) in [(2 * align, 100..2 * align - 7), (big, 0..big), (big, 4097..big - 3), (big, 0..0)] {
        let (got, crc) = b.read_new_crc(&g, 0, len, align, check.clone()).unwrap();
        assert_eq!(&got[..], &want_big[..len], "{}", at(&format!("read_new_crc of {len} bytes")));
        let expected = spillway::format::payload_crc(&want_big[check.clone()]);
        assert_eq!(crc, expected, "{}", at(&format!("read_new_crc's crc of {check:?}")));
    }
    let e = b.read_new_crc(&g, (big - align) as u64, big, align, 0..big).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{}", at(&format!("read_new_crc past the end: {e}")));
    drop(g);

    // A read past the end fails with UnexpectedEof.
    let e = read(b, &f, len as u64 - align as u64, 2 * align, align).unwrap_err();
    assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof, "{}", at(&format!("a read past the end: {e}")));

    // The async forms agree with the blocking ones, and so do a gathered write and pipelined reads.
    let f = Arc::new(f);
    let w = filled(b, align, 2 * align, 2);
    let want2 = w.to_vec();
    block_on(b.write_at_async(&f, 16 * align as u64, w)).0.unwrap();
    let (r, got) = block_on(b.read_at_async(&f, 16 * align as u64, b.alloc_buf(2 * align, align)));
    r.unwrap();
    assert_eq!(got.to_vec(), want2, "{}", at("async write then async read"));
    // A backend that gathers writes takes the caller's slices as they are (the log hands it values'
    // own buffers); one that does not (O_DIRECT files need aligned memory) is given aligned parts.
    let parts: Vec<AlignedBuf> = (0..3).map(|i| AlignedBuf::copied(&vec![i as u8 + 1; align], align)).collect();
    let loose: Vec<Vec<u8>> = parts.iter().map(|p| p.to_vec()).collect();
    let slices: Vec<&[u8]> = if b.gathers_writes() {
        loose.iter().map(|p| &p[..]).collect()
    } else {
        parts.iter().map(|p| &p[..]).collect()
    };
    b.write_gather_at(&f, 32 * align as u64, &slices).unwrap();
    assert_eq!(read(b, &f, 32 * align as u64, 3 * align, align).unwrap(), loose.concat(), "{}", at("write_gather_at"));
    let mut next_i = 0u64;
    let mut seen = Vec::new();
    let file = f.clone();
    b.read_pipelined(
        4,
        &mut || {
            (next_i < 8).then(|| {
                next_i += 1;
                let i = next_i - 1;
                PipelinedRead {
                    file: file.clone(),
                    offset: (4 + i) * align as u64,
                    buf: b.alloc_buf(align, align),
                    tag: i,
                }
            })
        },
        &mut |tag, (r, buf)| {
            r.unwrap();
            seen.push((tag, buf.to_vec()));
        },
    )
    .unwrap();
    seen.sort_by_key(|(t, _)| *t);
    assert_eq!(seen.len(), 8, "{}", at("every pipelined read completes once"));
    for (tag, got) in &seen {
        let o = *tag as usize * align;
        assert_eq!(got, &want[o..o + align], "{}", at(&format!("pipelined read {tag}")));
    }

    // Syncs succeed on a healthy disk.
    b.sync_data(&f).unwrap();
    b.sync_dir(&sub).unwrap();

    // A punched hole reads as zeros and leaves the length; a backend may not support punching.
    match b.punch_hole(&f, 4 * align as u64, 2 * align as u64) {
        Ok(()) => {
            assert!(read(b, &f, 4 * align as u64, 2 * align, align).unwrap().iter().all(|&x| x == 0), "{}", at("hole"));
            assert_eq!(
                read(b, &f, 6 * align as u64, align, align).unwrap(),
                want[2 * align..3 * align],
                "{}",
                at("past the hole")
            );
            assert_eq!(b.file_len(&f).unwrap(), len as u64, "{}", at("a hole keeps the length"));
        }
        Err(e) => assert_eq!(e.kind(), io::ErrorKind::Unsupported, "{}", at(&format!("punch_hole: {e}"))),
    }

    // The directory lock is exclusive and released on drop.
    let lock = b.lock_dir(&sub).unwrap();
    let e = b.lock_dir(&sub).err().map(|e| e.kind());
    assert_eq!(e, Some(io::ErrorKind::WouldBlock), "{}", at("a held directory lock is refused"));
    drop(lock);
    drop(b.lock_dir(&sub).expect("a released lock can be taken again"));

    // rename moves the name (the file keeps its bytes), or is unsupported.
    let moved = sub.join("g");
    match b.rename(&path, &moved) {
        Ok(()) => {
            let names = b.list_dir(&sub).unwrap();
            assert!(names.contains(&"g".to_string()) && !names.contains(&"f".to_string()), "{}", at("rename"));
            let g = b.open(&moved, false).unwrap();
            // (Past the hole punched above.)
            let got = read(b, &g, 6 * align as u64, 2 * align, align).unwrap();
            assert!(got == want[2 * align..4 * align], "{}", at("a renamed file keeps its bytes"));
            b.rename(&moved, &path).unwrap();
        }
        Err(e) => assert_eq!(e.kind(), io::ErrorKind::Unsupported, "{}", at(&format!("rename: {e}"))),
    }

    // remove_file unlinks the name.
    drop(f);
    b.remove_file(&path).unwrap();
    assert!(!b.list_dir(&sub).unwrap().contains(&"f".to_string()), "{}", at("a removed file is not listed"));
    assert_eq!(b.open(&path, false).err().map(|e| e.kind()), Some(io::ErrorKind::NotFound), "{}", at("removed"));
}

fn tmp() -> (tempfile::TempDir, PathBuf) {
    let t = tempfile::tempdir().unwrap();
    let p = t.path().to_path_buf();
    (t, p)
}

#[test]
fn the_portable_backend_keeps_the_contract() {
    let (_t, dir) = tmp();
    contract("portable", &PortableBackend::new(), &dir);
}

#[test]
fn the_portable_backend_keeps_the_contract_with_o_direct() {
    let (_t, dir) = tmp();
    let b = PortableBackend::with_direct(true);
    contract("portable O_DIRECT", &b, &dir);
    // Where the file system refuses O_DIRECT the backend falls back to buffered files: the contract
    // holds either way, and the test says which it checked.
    println!("portable O_DIRECT: files were {}", if b.direct() { "O_DIRECT" } else { "buffered (refused)" });
}

#[test]
fn the_io_uring_backend_keeps_the_contract() {
    for direct in [false, true] {
        let Some(b) = uring_or_skip("io_uring contract", UringOptions { direct, ..Default::default() }) else { return };
        let (_t, dir) = tmp();
        contract(&format!("io_uring direct={direct}"), &b, &dir);
    }
}

#[test]
fn the_automatic_backend_keeps_the_contract() {
    let (_t, dir) = tmp();
    let b = AutoBackend::new(BackendKind::Auto, false).unwrap();
    contract(&format!("auto ({})", b.name()), &b, &dir);
}

#[test]
fn the_simulated_backend_keeps_the_contract() {
    contract("sim", &SimBackend::new(), Path::new("/sim"));
    let b = AutoBackend::new(BackendKind::Sim, false).unwrap();
    contract("auto sim", &b, Path::new("/sim"));
}
