//! OpenAI `input_audio` parts on `merg serve`: a base64 WAV reaches the audio tower of a model
//! that hears (Qwen2.5-Omni, tiny), its placeholder tokens are counted and cached like an
//! image's; a model that does not hear, a bad clip, an unknown format and too many clips get a
//! 400 naming the part.

mod common;
#[path = "common/server.rs"]
mod server;

use base64::Engine as _;
use common::tiny_dir;
use merg::serve::Limits;
use server::*;
use serde_json::{json, Value};

fn clip_b64(name: &str) -> String {
    let bytes = std::fs::read(common::fixtures().join("media").join(name)).unwrap();
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn audio_part(data: &str, format: &str) -> Value {
    json!({"type": "input_audio", "input_audio": {"data": data, "format": format}})
}

fn ask(audio: Value) -> Value {
    chat_body(json!([{"type": "text", "text": "Turn 1, A: Why did you say that?\n"}, audio, {"type": "text", "text": "How does A sound?"}]), 4)
}

#[test]
fn a_clip_is_heard_counted_and_cached() {
    let s = TestServer::start_family("qwen2_5_omni", Limits::default(), None);
    let body = ask(audio_part(&clip_b64("omni_clip_a.wav"), "wav"));
    let (status, first) = s.post("/v1/chat/completions", &body);
    assert_eq!(status, 200, "{first}");
    let (_, text_only) = s.post("/v1/chat/completions", &chat_body(json!([{"type": "text", "text": "Turn 1, A: Why did you say that?\n"}, {"type": "text", "text": "How does A sound?"}]), 4));
    // 5.3 s = 132 audio tokens between <|audio_bos|> and <|audio_eos|>.
    let tokens = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert_eq!(tokens(&first), tokens(&text_only) + 132 + 2, "{first}\n{text_only}");
    let (_, again) = s.post("/v1/chat/completions", &body);
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached >= tokens(&first) - 16, "the same clip again: {cached} of {} tokens cached", tokens(&first));
    assert_eq!(first["choices"][0]["message"], again["choices"][0]["message"], "greedy: same answer");
}

#[test]
fn bad_clips_and_formats_are_400s_naming_the_part() {
    let s = TestServer::start_family("qwen2_5_omni", Limits { max_audio: 1, ..Limits::default() }, None);
    let wav = clip_b64("omni_clip_b.wav");
    let garbage = base64::engine::general_purpose::STANDARD.encode([7u8; 4096]);
    let cases = [
        (ask(audio_part("%%%", "wav")), "not valid base64"),
        (ask(audio_part(&garbage, "wav")), "messages[0].content[1]"),
        (ask(audio_part(&wav, "aac")), "input_audio.format must be one of"),
        (ask(json!({"type": "input_audio"})), "needs input_audio.data"),
        (chat_body(json!([audio_part(&wav, "wav"), audio_part(&wav, "wav")]), 4), "2 audio clips; the server's limit is 1"),
    ];
    for (body, want) in cases {
        let (status, out) = s.post("/v1/chat/completions", &body);
        assert_eq!(status, 400, "{want}: {out}");
        assert!(out.to_string().contains(want), "{want}: {out}");
    }
    let (status, _) = s.post("/v1/chat/completions", &ask(audio_part(&wav, "WAV")));
    assert_eq!(status, 200, "the format name is case-insensitive and the server still serves");
}

#[test]
fn a_model_that_does_not_hear_refuses_audio_by_name() {
    let s = TestServer::start(Limits::default(), None);
    let (status, out) = s.post("/v1/chat/completions", &ask(audio_part(&clip_b64("omni_clip_b.wav"), "wav")));
    assert_eq!(status, 400, "{out}");
    assert!(out.to_string().contains("takes no audio"), "{out}");
}
