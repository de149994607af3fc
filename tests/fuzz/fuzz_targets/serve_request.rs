//! `merg serve` request bodies: the same bytes as the body of `/v1/chat/completions`,
//! `/api/chat`, `/api/generate` and `/v1/merg/respond`, through each endpoint's parsing and
//! checks (images decoded) up to what the engine or the pipeline would get, under the
//! server's default limits. Each answer is a 4xx or a request within those limits; never a
//! panic, a 5xx, or an allocation past libFuzzer's limit (scripts/fuzz.sh: 2 GiB).
#![no_main]
use libfuzzer_sys::fuzz_target;
use merg::chat::{ContentPart, Message};
use merg::engine::ChatRequest;
use merg::pipeline::frames::FrameOptions;
use merg::pipeline::PipelineConfig;
use merg::serve::{ollama, openai, respond, ApiError, Limits};

fn refused_as_the_client_s_fault(api: &str, e: ApiError) {
    assert!((400..500).contains(&e.status), "{api}: status {} for a bad body: {}", e.status, e.message);
    assert!(!e.message.is_empty(), "{api}: a {} without a message", e.status);
}

/// What every accepted chat request keeps to: images within the limit, one per image part,
/// a token budget within the limit.
fn within_limits(api: &str, chat: &ChatRequest, l: &Limits) {
    let parts = |m: &Message| m.content.iter().filter(|p| matches!(p, ContentPart::Image)).count();
    let image_parts: usize = chat.messages.iter().map(parts).sum();
    assert!(!chat.messages.is_empty(), "{api}: accepted without messages");
    assert!(chat.media.len() <= l.max_images && chat.media.len() == image_parts, "{api}: {} images, {image_parts} parts", chat.media.len());
    let n = chat.sampling.max_new_tokens;
    assert!((1..=l.max_tokens).contains(&n), "{api}: max_new_tokens {n}");
}

fuzz_target!(|data: &[u8]| {
    let l = Limits::default();
    match openai::parse_request(data, &l) {
        Ok(c) => {
            within_limits("openai", &c.chat, &l);
            assert!(c.opts.stop.len() <= 4);
        }
        Err(e) => refused_as_the_client_s_fault("openai", e),
    }
    for (api, parsed) in [("ollama chat", ollama::parse_chat(data, &l)), ("ollama generate", ollama::parse_generate(data, &l))] {
        match parsed {
            Ok(Some(c)) => within_limits(api, &c.chat, &l),
            Ok(None) => {} // no input: Ollama's "model loaded" answer
            Err(e) => refused_as_the_client_s_fault(api, e),
        }
    }
    match respond::parse_request(data, &PipelineConfig::default(), &FrameOptions::default(), &l) {
        Ok(c) => {
            assert!(c.keyframes.len() <= l.max_images, "respond: {} keyframes", c.keyframes.len());
            c.dialogue.validate().expect("an accepted dialogue validates");
            c.cfg.validate().expect("an accepted pipeline configuration validates");
        }
        Err(e) => refused_as_the_client_s_fault("respond", e),
    }
});
