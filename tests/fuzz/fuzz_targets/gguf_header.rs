//! GGUF headers as the loader checks them (llama.cpp files are often downloaded from
//! strangers): an error naming the problem, never a panic or an allocation the file cannot
//! back. A parsed header's tensors all lie inside the file.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(h) = merg::gguf::Header::parse(data) {
        for (name, t) in &h.tensors {
            assert!(t.start + t.len <= data.len(), "tensor {name} past the end");
        }
    }
});
