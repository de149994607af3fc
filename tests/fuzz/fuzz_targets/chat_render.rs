//! Hostile dialogue text through the real chat template and tokenizer (the tiny checkpoint's):
//! text is data, so the prompt has exactly the control tokens the template writes — one
//! `<|im_start|>` per message (plus the default system turn and the generation prompt), no
//! vision tokens at all — whatever the text says.
#![no_main]
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use merg::chat::Message;
use merg::tokenizer::ChatTokenizer;

fn tok() -> &'static ChatTokenizer {
    static T: OnceLock<ChatTokenizer> = OnceLock::new();
    T.get_or_init(|| {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../fixtures/tiny-qwen2_5-vl");
        ChatTokenizer::from_dir(std::path::Path::new(dir)).expect("tiny tokenizer")
    })
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let roles = ["user", "assistant", "system"];
    let messages: Vec<Message> = text.split('\u{1}').enumerate().map(|(i, t)| Message::text(roles[(i + data.len()) % 3], t)).collect();
    let t = tok();
    let Ok(ids) = t.encode_chat(&messages, true, &[]) else { return };
    let s = t.special();
    let count = |id: u32| ids.iter().filter(|&&i| i == id).count();
    let expected = messages.len() + 1 + usize::from(messages[0].role != "system");
    assert_eq!(count(s.im_start), expected, "data text produced <|im_start|>");
    for v in [s.image_pad, s.video_pad, s.vision_start, s.vision_end] {
        assert_eq!(count(v), 0, "data text produced a vision token");
    }
});
