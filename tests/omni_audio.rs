//! Audio through the engine on the tiny Qwen2.5-Omni: the goldens' own clips, read from WAV files
//! (32-bit float, the very samples transformers was given), go through merg's processor (log-mel
//! features, chat template, placeholder expansion) and the paged engine, and must give
//! transformers' prompt ids, features and 32 greedy tokens; a clip heard twice is encoded once and
//! its placeholder tokens come from the prefix cache, while a different clip of the same length
//! does not match them.

mod common;

use candle_core::{DType, Device};
use common::cli;
use common::*;
use merg::chat::{ContentPart, Message};
use merg::checkpoint::Checkpoint;
use merg::engine::{ChatRequest, Engine, EngineConfig, KvMemory};
use merg::generate::SamplingParams;
use merg::vision::Media;

const FAMILY: &str = "qwen2_5_omni";

fn checkpoint() -> Checkpoint {
    let files = merg::hub::resolve(tiny_dir(FAMILY).to_str().unwrap(), None).unwrap();
    Checkpoint::load(files, &Device::Cpu, Some(DType::F32)).unwrap()
}

fn clip(name: &str) -> Media {
    Media::Audio(merg::audio::load_audio(&fixtures().join("media").join(format!("omni_{name}.wav"))).unwrap())
}

/// The golden's conversation as merg's messages and media (clips from their WAV files).
fn conversation(meta: &serde_json::Value) -> (Vec<Message>, Vec<Media>) {
    let mut media = vec![];
    let messages = meta["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            let parts = m["content"].as_array().unwrap().iter().map(|c| match c["type"].as_str().unwrap() {
                "text" => ContentPart::Text(c["text"].as_str().unwrap().into()),
                "audio" => {
                    media.push(clip(c["audio"].as_str().unwrap()));
                    ContentPart::Audio
                }
                "image" => {
                    media.push(Media::Image(merg::vision::load_image(&fixtures().join("media").join(c["image"].as_str().unwrap())).unwrap()));
                    ContentPart::Image
                }
                other => panic!("case kind {other} is not used here"),
            });
            Message::new(m["role"].as_str().unwrap(), parts.collect())
        })
        .collect();
    (messages, media)
}

fn greedy(n: usize) -> SamplingParams {
    SamplingParams { max_new_tokens: n, stop_token_ids: vec![u32::MAX], ..Default::default() }
}

#[test]
fn wav_files_to_prompt_ids_and_features_equal_transformers() {
    let ck = checkpoint();
    let p = &ck.processor;
    assert!(p.hears());
    for case in ["audio", "image_audio"] {
        let (g, meta) = golden(FAMILY, case);
        let (messages, media) = conversation(&meta);
        let items: Vec<_> = media.iter().map(|m| p.preprocess(m).unwrap()).collect();
        let grids: Vec<_> = items.iter().map(|i| i.grid.clone()).collect();
        let ids = p.encode_prompt(&messages, &grids).unwrap();
        let want: Vec<u32> = ids_i64(&g["input_ids"]).into_iter().map(|i| i as u32).collect();
        assert_eq!(ids, want, "{case}: prompt ids");
        assert_eq!(p.count_tokens_with(&messages, &media).unwrap(), want.len(), "{case}: counted without features");
        // The one clip's log-mel rows against the processor's input_features (cut to its frames).
        let audio = items.iter().find(|i| i.grid.is_audio()).unwrap();
        let frames = audio.grid.audio_frames;
        let golden = g["input_features"].get(0).unwrap().narrow(1, 0, frames).unwrap();
        let err = max_abs_diff(&audio.patches.to_tensor(&Device::Cpu).unwrap(), &golden);
        assert!(err < 1e-4, "{case}: log-mel features differ by {err}");
    }
}

fn max_abs_diff(a: &candle_core::Tensor, b: &candle_core::Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

#[test]
fn engine_hears_and_greedy_tokens_equal_transformers() {
    let cfg = EngineConfig { kv_memory: KvMemory::Blocks(256), ..Default::default() };
    let mut eng = Engine::new(checkpoint(), cfg).unwrap();
    let cases = ["audio", "image_audio"];
    let reqs = cases
        .iter()
        .map(|case| {
            let (messages, media) = conversation(&golden(FAMILY, case).1);
            ChatRequest::new(messages, media, greedy(32))
        })
        .collect();
    for (case, out) in cases.iter().zip(eng.run_all(reqs)) {
        let meta = golden(FAMILY, case).1;
        let want: Vec<u32> = meta["greedy_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        assert_eq!(out.unwrap().tokens, want, "{case}: 32 greedy tokens");
    }
}

/// A request about `clip` with an agent's instruction after it.
fn ask(clip_name: &str, agent: &str) -> ChatRequest {
    let content = vec![ContentPart::Text("Turn 1, A: Why did you say that?\n".into()), ContentPart::Audio, ContentPart::Text(agent.into())];
    ChatRequest::new(vec![Message::new("user", content)], vec![clip(clip_name)], greedy(4))
}

#[test]
fn a_clip_heard_twice_is_encoded_once_and_shared_through_the_prefix_cache() {
    let cfg = |prefix_caching| EngineConfig { kv_memory: KvMemory::Blocks(256), prefix_caching, block_size: 4, ..Default::default() };
    let mut eng = Engine::new(checkpoint(), cfg(true)).unwrap();
    let first = eng.run_all(vec![ask("clip_a", "Describe the voice.")]).pop().unwrap().unwrap();
    let again = eng.run_all(vec![ask("clip_a", "Name the emotion.")]).pop().unwrap().unwrap();
    let other = eng.run_all(vec![ask("clip_b", "Name the emotion.")]).pop().unwrap().unwrap();
    let stats = eng.stats();
    assert_eq!((stats.vision_misses, stats.vision_hits), (2, 1), "clip_a encoded once, clip_b once");
    // Where clip_a's placeholders lie in the prompt: the second request takes all of them (whole
    // blocks up to the instruction) from the cache; clip_b matches nothing from its first one on.
    let ck = checkpoint();
    let req = ask("clip_a", "Name the emotion.");
    let grids: Vec<_> = req.media.iter().map(|m| ck.processor.grid_of(m).unwrap()).collect();
    let ids = ck.processor.encode_prompt(&req.messages, &grids).unwrap();
    let pad = ck.processor.tokenizer.special().audio_pad;
    let (start, end) = (ids.iter().position(|&t| t == pad).unwrap(), ids.iter().rposition(|&t| t == pad).unwrap() + 1);
    assert_eq!(end - start, 132, "5.3 s = 530 mel frames = 132 audio tokens");
    assert_eq!((again.prompt_tokens, first.tokens.len()), (ids.len(), 4));
    assert!(again.cached_tokens >= end / 4 * 4, "cached {} of {}, audio ends at {end}", again.cached_tokens, again.prompt_tokens);
    assert!(other.cached_tokens <= start, "a different clip matched {} tokens; its audio starts at {start}", other.cached_tokens);
    assert!(other.cached_tokens >= start / 4 * 4 - 4, "the text before the clip is shared: {} of {start}", other.cached_tokens);
    // Cache on = off, token for token.
    let mut off = Engine::new(checkpoint(), cfg(false)).unwrap();
    let plain: Vec<_> = off.run_all(vec![ask("clip_a", "Name the emotion."), ask("clip_b", "Name the emotion.")]).into_iter().map(|r| r.unwrap().tokens).collect();
    assert_eq!(plain, vec![again.tokens, other.tokens]);
}

fn generate(model: &str, audio: &str) -> cli::Run {
    let dir = tiny_dir(model);
    let args = ["generate", "--model", dir.to_str().unwrap(), "--prompt", "How does it sound?", "--max-new-tokens", "4", "--json", "--audio"];
    let mut args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    args.push(fixtures().join("media").join(audio).display().to_string());
    cli::run(&args)
}

#[test]
fn merg_generate_hears_a_file_and_names_what_it_cannot() {
    let run = generate(FAMILY, "omni_clip_b.wav");
    assert!(run.ok, "{}", run.stderr);
    let out: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    // The same turn through the engine.
    let mut eng = Engine::new(checkpoint(), EngineConfig::default()).unwrap();
    let content = vec![ContentPart::Audio, ContentPart::Text("How does it sound?".into())];
    let sampling = SamplingParams { max_new_tokens: 4, ..Default::default() };
    let want = eng.run_all(vec![ChatRequest::new(vec![Message::new("user", content)], vec![clip("clip_b")], sampling)]).pop().unwrap().unwrap();
    assert_eq!(out["prompt_tokens"].as_u64(), Some(want.prompt_tokens as u64));
    assert_eq!(out["tokens"], serde_json::json!(want.tokens));
    let deaf = generate("qwen2_5_vl", "omni_clip_b.wav");
    assert!(!deaf.ok && deaf.stderr.contains("--audio") && deaf.stderr.contains("no audio encoder"), "{}", deaf.stderr);
    let silent = generate(FAMILY, "clip.mp4");
    assert!(!silent.ok && silent.stderr.contains("clip.mp4 has no audio stream"), "{}", silent.stderr);
}
