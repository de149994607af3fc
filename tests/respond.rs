//! The pipeline through the real engine on the tiny checkpoint: `merg respond` on the example
//! dialogue with keyframes writes a valid trace, a seed makes it deterministic, and the prefix
//! cache serves most prompt tokens of agents 2..5 and of refinement rounds.

mod common;

use std::process::Command;

use anyhow::Result;
use candle_core::{DType, Device};
use common::*;
use merg::chat::Message;
use merg::dialogue::Dialogue;
use merg::engine::block_manager::CacheStats;
use merg::engine::{Engine, EngineConfig, EngineThread, KvMemory};
use merg::pipeline::frames::{self, FrameOptions, FrameReport};
use merg::pipeline::model::{AgentCall, AgentModel, AgentReply, EngineModel};
use merg::pipeline::prompt::Prompts;
use merg::pipeline::retrieval::Memory;
use merg::pipeline::{Pipeline, PipelineConfig, Trace};
use merg::checkpoint::Checkpoint;
use serde_json::Value;

fn example(name: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("examples").join(name)
}

fn engine_thread() -> EngineThread {
    let files = merg::hub::resolve(tiny_dir("qwen2_5_vl").to_str().unwrap(), None).unwrap();
    let rt = Checkpoint::load(files, &Device::Cpu, Some(DType::F32)).unwrap();
    EngineThread::spawn(Engine::new(rt, EngineConfig { kv_memory: KvMemory::Blocks(512), ..Default::default() }).unwrap())
}

fn config() -> PipelineConfig {
    let mut cfg = PipelineConfig { max_field_chars: 16, ..Default::default() };
    cfg.sampling.max_new_tokens = 240;
    cfg
}

fn respond(model: &dyn AgentModel, cfg: &PipelineConfig) -> Trace {
    let d = Dialogue::from_json_file(&example("dialogue.json")).unwrap();
    let mut report = FrameReport::default();
    let opts = FrameOptions::default();
    let kf = frames::collect(&d, &opts, &mut report).unwrap();
    assert_eq!(kf.len(), 4);
    let memory = Memory::from_jsonl(&example("memory.jsonl")).unwrap();
    let prompts = Prompts::builtin();
    Pipeline { model, prompts: &prompts, memory: Some(&memory), cfg }.respond(&d, kf, report).unwrap()
}

/// Every agent output in the trace parsed, the reply is the selected round's.
fn check_trace(t: &Trace) {
    assert!(!t.rounds.is_empty() && t.selected_round < t.rounds.len());
    assert!(!t.reply.trim().is_empty());
    assert_eq!(t.reply, t.rounds[t.selected_round].reply);
    for r in &t.rounds {
        for c in &r.calls {
            assert!(c.output.is_some(), "{} round {} did not parse: {:?} {}", c.agent, c.round, c.error, c.raw);
        }
    }
    let labels = config().labels;
    assert!(labels.contains(t.emotion.as_ref().unwrap()));
}

/// Outputs of a trace without timings (which legitimately differ run to run).
fn outputs(t: &Trace) -> Vec<(String, usize, String)> {
    t.rounds.iter().flat_map(|r| r.calls.iter().map(|c| (c.agent.clone(), c.round, c.raw.clone()))).collect()
}

#[test]
fn respond_is_valid_and_deterministic_for_a_seed() {
    let th = engine_thread();
    let model = EngineModel::new(th.handle.clone()).unwrap();
    let a = respond(&model, &config());
    check_trace(&a);
    // Same engine (now with a warm cache) and a fresh one: identical outputs.
    let b = respond(&model, &config());
    let th2 = engine_thread();
    let c = respond(&EngineModel::new(th2.handle.clone()).unwrap(), &config());
    assert_eq!(outputs(&a), outputs(&b));
    assert_eq!(outputs(&a), outputs(&c));
    assert_eq!(a.reply_logprobs, c.reply_logprobs);
    // Another seed samples differently.
    let mut other = config();
    other.sampling.seed = 99;
    assert_ne!(outputs(&respond(&model, &other)), outputs(&a));
}

/// The real engine, except that round 0's verdict is overridden to blame CAEF, so a
/// refinement round runs through the engine whatever the random model says.
struct BlameCaefOnce(EngineModel);

impl AgentModel for BlameCaefOnce {
    fn call(&self, call: AgentCall) -> Result<AgentReply> {
        let (agent, round) = (call.agent, call.round);
        let mut r = self.0.call(call)?;
        if agent == "gra" && round == 0 {
            let ok = serde_json::json!({"pass": true, "correction": ""});
            r.text = serde_json::json!({"mpa": ok, "caef": {"pass": false, "correction": "look at F3"}, "psp": ok, "sgrg": ok}).to_string();
        }
        Ok(r)
    }
    fn count_tokens(&self, m: &[Message], d: &[merg::vision::Media]) -> Result<usize> {
        self.0.count_tokens(m, d)
    }
    fn context_window(&self) -> usize {
        self.0.context_window()
    }
    fn decoded_offsets(&self, tokens: &[u32]) -> Result<Vec<usize>> {
        self.0.decoded_offsets(tokens)
    }
    fn cache_stats(&self) -> Option<CacheStats> {
        self.0.cache_stats()
    }
}

#[test]
fn prefix_cache_serves_later_agents_and_refinement_rounds() {
    let th = engine_thread();
    let model = BlameCaefOnce(EngineModel::new(th.handle.clone()).unwrap());
    let mut cfg = config();
    cfg.t_max = 1;
    let t = respond(&model, &cfg);
    assert_eq!(t.rounds.len(), 2, "round 0 blamed CAEF");
    assert_eq!(t.rounds[1].calls.iter().map(|c| c.agent.as_str()).collect::<Vec<_>>(), ["caef", "psp", "sgrg", "gra"]);
    let sum = |calls: Vec<&merg::pipeline::trace::AgentRecord>| {
        (calls.iter().map(|c| c.cached_tokens).sum::<usize>(), calls.iter().map(|c| c.prompt_tokens).sum::<usize>())
    };
    let first = &t.rounds[0].calls[0];
    assert_eq!(first.cached_tokens, 0, "the very first call computes everything");
    let (c0, p0) = sum(t.rounds[0].calls[1..].iter().collect());
    let (c1, p1) = sum(t.rounds[1].calls.iter().collect());
    println!("agents 2..5 of round 0: {c0}/{p0} cached; round 1: {c1}/{p1} cached; first call {} tokens", first.prompt_tokens);
    // The shared prefix (system, 6 turns, 4 keyframes) is most of every prompt.
    assert!(c0 * 100 >= p0 * 55, "agents 2..5: {c0}/{p0} prompt tokens from cache");
    assert!(c1 * 100 >= p1 * 55, "refinement round: {c1}/{p1} prompt tokens from cache");
    // Every cached call reused at least the whole shared prefix of the first call.
    let prefix = t.rounds[0].calls.iter().skip(1).map(|c| c.cached_tokens).min().unwrap();
    assert!(prefix >= first.prompt_tokens / 2, "{prefix} of {}", first.prompt_tokens);
}

/// `merg respond` on the example dialogue and memory with a tiny checkpoint, writing `trace`.
fn respond_example(family: &str, trace: &std::path::Path) -> std::process::Output {
    respond_with(tiny_dir(family).to_str().unwrap(), trace)
}

fn respond_with(model: &str, trace: &std::path::Path) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_merg"))
        .args(["respond", "--model", model, "--dialogue"])
        .arg(example("dialogue.json"))
        .args(["--memory"])
        .arg(example("memory.jsonl"))
        .args(["--trace", trace.to_str().unwrap(), "--max-new-tokens", "240", "--max-field-chars", "16", "--kv-memory", "blocks:512"])
        .output()
        .unwrap()
}

#[test]
fn merg_respond_cli_writes_a_trace() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.json");
    let out = respond_example("qwen2_5_vl", &trace);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let t: Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let reply = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(t["reply"].as_str().unwrap().trim(), reply);
    assert_eq!(t["config"]["t_max"], 2);
    assert_eq!(t["exemplars"][0][0], "example/mem/4");
    assert!(t["rounds"][0]["calls"].as_array().unwrap().len() >= 5);
    assert!(stderr.contains("prompt tokens from the prefix cache"));
    // The MELD-row form of a dialogue works too; bad input fails cleanly.
    let rows = Command::new(env!("CARGO_BIN_EXE_merg"))
        .args(["respond", "--model", tiny_dir("qwen2_5_vl").to_str().unwrap(), "--no-gra", "--dialogue"])
        .arg(example("dialogue_rows.json"))
        .args(["--trace", dir.path().join("r.json").to_str().unwrap(), "--max-new-tokens", "240", "--max-field-chars", "16"])
        .output()
        .unwrap();
    assert!(rows.status.success(), "{}", String::from_utf8_lossy(&rows.stderr));
    let bad = dir.path().join("bad.json");
    std::fs::write(&bad, b"{\"turns\": [], \"next_speaker\": \"A\"}").unwrap();
    let missing_frame = dir.path().join("mf.json");
    std::fs::write(&missing_frame, br#"{"turns":[{"speaker":"A","text":"hi","frames":["nope.png"]}],"next_speaker":"B"}"#).unwrap();
    let not_utf8 = dir.path().join("nu.json");
    std::fs::write(&not_utf8, b"{\"turns\":[{\"speaker\":\"A\",\"text\":\"\xff\xfe\"}],\"next_speaker\":\"B\"}").unwrap();
    for (file, msg) in [(&bad, "history is empty"), (&missing_frame, "nope.png"), (&not_utf8, "not UTF-8")] {
        let o = Command::new(env!("CARGO_BIN_EXE_merg"))
            .args(["respond", "--model", tiny_dir("qwen2_5_vl").to_str().unwrap(), "--dialogue"])
            .arg(file)
            .output()
            .unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && e.contains(msg) && !e.contains("panicked"), "{file:?}: {e}");
    }
}

/// IEMOCAP-style: one recording of the dialog; keyframes come from the history turns' spans
/// and never from the answered turn onward.
#[cfg(feature = "video")]
#[test]
fn recording_keyframes_stop_before_the_answered_turn() {
    let clip = fixtures().join("media/clip.mp4");
    let all = merg::vision::load_video_frames_with_factor(&clip, 1e6, 10_000, 1).unwrap();
    assert_eq!(all.indices, (0..all.total_frames).collect::<Vec<_>>(), "every frame decoded");
    let fps = all.source_fps as f64;
    let dur = all.total_frames as f64 / fps;
    let spans = [(0.0, dur * 0.3), (dur * 0.3, dur * 0.6)];
    let until = dur * 0.5;
    let opts = FrameOptions { frames_per_turn: 2, max_frames: 8, skip_bad_media: false, ..Default::default() };
    let mut report = FrameReport::default();
    let kf = frames::from_recording(&clip, &spans, until, &opts, &mut report).unwrap();
    assert_eq!(kf.iter().map(|k| k.turn).collect::<Vec<_>>(), [Some(0), Some(0), Some(1), Some(1)]);
    // Turn 1's span is cut at `until`: its frames sit at 0.35 and 0.45 of the clip.
    let expect = [0.075, 0.225, 0.35, 0.45].map(|x| ((x * dur * fps).floor() as usize).min(all.total_frames - 1));
    for (k, i) in kf.iter().zip(expect) {
        assert!(k.image == all.frames[i], "{} is frame {i}", k.source);
        assert!((i as f64) / fps < until);
    }
    // Capped to the most recent, and a missing recording is an error or a note.
    let mut r = FrameReport::default();
    let capped = frames::from_recording(&clip, &spans, until, &FrameOptions { max_frames: 3, ..opts.clone() }, &mut r).unwrap();
    assert_eq!(capped.len(), 3);
    assert_eq!(capped[0].turn, Some(0));
    let missing = fixtures().join("media/none.avi");
    assert!(frames::from_recording(&missing, &spans, until, &opts, &mut FrameReport::default()).is_err());
    let mut r = FrameReport::default();
    let none = frames::from_recording(&missing, &spans, until, &FrameOptions { skip_bad_media: true, ..opts }, &mut r).unwrap();
    assert!(none.is_empty() && r.notes.iter().any(|n| n.contains("none.avi")));
}

/// `merg respond` on the example dialogue (four keyframes) with the tiny Qwen3-VL,
/// Qwen3-VL-MoE, Qwen3.5, LLaVA-NeXT and Gemma 3 checkpoints: every agent's output parses, and
/// later agents reuse the prefix (Qwen3.5: K/V blocks plus the recurrent-state snapshot after
/// the keyframes; Gemma 3: its system text folded into the first user turn by its template).
#[test]
fn merg_respond_runs_on_every_family() {
    for family in ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "llava_next", "gemma3"] {
        let dir = tempfile::tempdir().unwrap();
        let trace = dir.path().join("t.json");
        let out = respond_example(family, &trace);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{family}: {stderr}");
        let t: Trace = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
        check_trace(&t);
        assert_eq!(t.reply.trim(), String::from_utf8_lossy(&out.stdout).trim(), "{family}");
        // Every call after the first starts from the shared dialogue + keyframe prefix.
        let calls: Vec<_> = t.rounds.iter().flat_map(|r| r.calls.iter()).collect();
        let later = &calls[1..];
        let (cached, prompt): (usize, usize) = (later.iter().map(|c| c.cached_tokens).sum(), later.iter().map(|c| c.prompt_tokens).sum());
        println!("{family}: {:?}; later calls {cached}/{prompt} prompt tokens cached", t.totals);
        assert!(later.iter().all(|c| c.cached_tokens > 0), "{family}: every later agent reuses the prefix");
        assert!(cached * 2 > prompt, "{family}: later agents take most of their prompt from the cache: {cached}/{prompt}");
    }
}

/// `merg respond` from llama.cpp files alone: a Q8_0 GGUF text model with its projector found
/// beside it, tokenizer and chat template from the GGUF metadata (the agents' JSON schemas
/// compile against that rebuilt tokenizer), quantized matmuls on the file's own blocks.
#[test]
fn merg_respond_runs_on_gguf_files() {
    for (dir, file) in [("qwen2-vl", "tiny-qwen2-vl-q8_0.gguf"), ("qwen3_5", "tiny-qwen3_5-q8_0.gguf")] {
        let tmp = tempfile::tempdir().unwrap();
        let model = common::fixtures().join("gguf").join(dir).join(file);
        let trace = tmp.path().join("t.json");
        let out = respond_with(model.to_str().unwrap(), &trace);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{dir}: {stderr}");
        assert!(stderr.contains("KV cache: 512 blocks"), "{dir}: {stderr}");
        let t: Trace = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
        check_trace(&t);
        assert_eq!(t.reply.trim(), String::from_utf8_lossy(&out.stdout).trim(), "{dir}");
    }
}
