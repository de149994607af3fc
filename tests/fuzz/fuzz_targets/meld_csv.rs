//! MELD CSV rows: validation errors or rows with MELD labels, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut report = merg::data::LoadReport::default();
    let _ = merg::data::meld::read_rows_from(data, "fuzz.csv", &mut report);
});
