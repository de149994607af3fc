//! Exemplar memory JSONL, then a BM25 search over whatever parsed, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(m) = merg::pipeline::retrieval::Memory::from_jsonl_reader(data, "fuzz.jsonl") {
        let _ = m.search("I lost my job today and I feel awful", 3, None);
    }
});
