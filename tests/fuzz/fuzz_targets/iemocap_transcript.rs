//! IEMOCAP transcript lines and EmoEvaluation files, never a panic.
#![no_main]
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    for line in text.lines() {
        if let Some(u) = merg::data::iemocap::parse_transcript_line(line) {
            let _ = merg::data::iemocap::speaker_of(&u.id);
        }
        let _ = merg::data::iemocap::map_label(line);
    }
    let _ = merg::data::iemocap::parse_evaluation(&text, std::path::Path::new("fuzz.txt"));
});
