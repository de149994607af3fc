//! Dialogue JSON (all three accepted shapes): an error or a valid dialogue, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(d) = merg::dialogue::Dialogue::from_json_str(text) {
            assert!(!d.turns.is_empty(), "an accepted dialogue has turns");
            d.validate().expect("an accepted dialogue validates");
        }
    }
});
