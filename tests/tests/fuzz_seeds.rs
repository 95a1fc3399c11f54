//! The seed corpus of the `record_decode` fuzz target holds records of this build's format: a seed
//! that does not decode (one of another format version) would leave the fuzzer to start from nothing.

use spillway::format;

#[test]
fn the_record_decode_seeds_decode() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/record_decode");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let input = std::fs::read(&path).unwrap();
        // As the target reads its input: the log's salt, then the record.
        let (salt, record) = input.split_first_chunk::<8>().expect("8 bytes of salt");
        let salt = format::Salt(u64::from_le_bytes(*salt));
        format::decode_record(record, salt).unwrap_or_else(|e| panic!("{}: {e:?}", path.display()));
        seen += 1;
    }
    assert!(seen >= 3, "{seen} seeds in {}", dir.display());
}
