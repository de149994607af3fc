//! safetensors headers as the weight loader checks them, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = merg::weights::safetensors::float_tensor_names(data, "fuzz.safetensors");
});
