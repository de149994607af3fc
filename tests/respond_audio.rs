//! The agents hear, through the real engine on the tiny Qwen2.5-Omni: `merg respond` on a
//! dialogue with per-turn audio (a WAV file and an mp4 clip's track) runs, every agent's output
//! parses, the trace lists the clips, acoustic cues point at real clips and later agents take
//! the clips from the prefix cache; `--no-audio` is recorded; a backbone that does not hear
//! notes that it ignored the audio; bad audio names its file or, with `--skip-bad-media`, is a
//! note; and `/v1/merg/respond` takes per-turn base64 audio.
#![cfg(feature = "video")]

mod common;
#[cfg(feature = "serve")]
#[path = "common/server.rs"]
mod server;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use candle_core::{DType, Device};
use common::*;
use merg::checkpoint::Checkpoint;
use merg::dialogue::Dialogue;
use merg::pipeline::frames::{self, FrameOptions, FrameReport};
use merg::pipeline::hearing::{self, AudioReport};
use merg::pipeline::prompt::{Prompts, SharedContext};
use merg::pipeline::Trace;
use serde_json::{json, Value};

const OMNI: &str = "qwen2_5_omni";

fn media(name: &str) -> PathBuf {
    fixtures().join("media").join(name)
}

/// Three turns: T1 with its own WAV, T2 with an mp4 clip (keyframe and audio track), T3 text.
fn write_dialogue(dir: &Path) -> PathBuf {
    let d = json!({
        "id": "heard-1",
        "turns": [
            {"speaker": "Monica", "text": "So how did the interview go?", "audio": media("omni_clip_a.wav")},
            {"speaker": "Rachel", "text": "They hired someone else.", "video": media("tone.mp4")},
            {"speaker": "Monica", "text": "Oh no. I am so sorry."}
        ],
        "next_speaker": "Rachel"
    });
    let p = dir.join("d.json");
    std::fs::write(&p, d.to_string()).unwrap();
    p
}

fn respond(family: &str, dialogue: &Path, trace: &Path, extra: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_merg"))
        .args(["respond", "--model", tiny_dir(family).to_str().unwrap(), "--dialogue"])
        .arg(dialogue)
        // The tiny random model fills every cue list to its bound (3 textual, 3 visual, 3 acoustic):
        // MPA needs more than the 240 tokens of the keyframe-only tests (whose models' context
        // holds no more).
        .args(["--trace", trace.to_str().unwrap(), "--max-new-tokens", if family == OMNI { "400" } else { "240" }])
        .args(["--max-field-chars", "16", "--kv-memory", "blocks:512", "--top-k", "0"])
        .args(extra)
        .output()
        .unwrap()
}

fn trace_of(out: &Output, trace: &Path) -> Trace {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    serde_json::from_str(&std::fs::read_to_string(trace).unwrap()).unwrap()
}

fn calls(t: &Trace) -> Vec<&merg::pipeline::trace::AgentRecord> {
    t.rounds.iter().flat_map(|r| r.calls.iter()).collect()
}

/// Prompt tokens of the shared prefix up to the end of the last clip, counted by the
/// checkpoint's own processor.
fn prefix_tokens(dialogue: &Path) -> usize {
    let d = Dialogue::from_json_file(dialogue).unwrap();
    let opts = FrameOptions::default();
    let kf = frames::collect(&d, &opts, &mut FrameReport::default()).unwrap();
    let clips = hearing::collect(&d, &opts, &mut AudioReport::default()).unwrap();
    let shared = SharedContext::build_heard(&Prompts::builtin(), &d, &kf, &clips).unwrap();
    let last = shared.parts.iter().rposition(|p| *p == merg::chat::ContentPart::Audio).unwrap();
    let files = merg::hub::resolve(tiny_dir(OMNI).to_str().unwrap(), None).unwrap();
    let processor = Checkpoint::load(files, &Device::Cpu, Some(DType::F32)).unwrap().processor;
    let upto = vec![merg::chat::Message::text("system", shared.system.clone()), merg::chat::Message::new("user", shared.parts[..=last].to_vec())];
    processor.count_tokens_with(&upto, &shared.media).unwrap()
}

#[test]
fn merg_respond_hears_each_turns_audio_and_later_agents_take_it_from_the_cache() {
    let dir = tempfile::tempdir().unwrap();
    let d = write_dialogue(dir.path());
    let trace = dir.path().join("t.json");
    let t = trace_of(&respond(OMNI, &d, &trace, &["--t-max", "0"]), &trace);
    assert_eq!(t.audio.kept, [media("omni_clip_a.wav").display().to_string(), media("tone.mp4").display().to_string()]);
    assert!(t.audio.cut.is_empty() && t.audio.dropped.is_empty(), "{:?}", t.audio);
    assert_eq!(t.frames.kept.len(), 1, "T2's clip gives a keyframe too");
    for c in calls(&t) {
        assert!(c.output.is_some(), "{} did not parse: {:?} {}", c.agent, c.error, c.raw);
    }
    // MPA was offered acoustic cues, and each one it gave points at one of the two clips.
    let mpa = calls(&t)[0].output.clone().unwrap();
    let cues = mpa["acoustic_cues"].as_array().expect("the schema requires acoustic_cues with audio");
    assert!(cues.iter().all(|c| (1..=2).contains(&c["clip"].as_u64().unwrap())), "{cues:?}");
    let caef = calls(&t)[1].output.clone().unwrap();
    assert!(caef["audio_emotion"].is_string(), "{caef}");
    // Every later agent takes the whole prefix through the last clip from the cache.
    let prefix = prefix_tokens(&d);
    let later: Vec<usize> = calls(&t)[1..].iter().map(|c| c.cached_tokens).collect();
    println!("prefix through the last clip: {prefix} tokens; later agents' cached tokens: {later:?}; first call {} tokens", calls(&t)[0].prompt_tokens);
    assert!(later.iter().all(|&c| c + 32 >= prefix), "cached {later:?} of a {prefix}-token prefix");
    // --no-audio: the same dialogue unheard, recorded in the trace.
    let off = dir.path().join("off.json");
    let u = trace_of(&respond(OMNI, &d, &off, &["--t-max", "0", "--no-gra", "--no-audio"]), &off);
    assert!(!u.config.use_audio && u.audio.kept.is_empty());
    assert!(u.audio.notes[0].starts_with("hearing is off"), "{:?}", u.audio.notes);
    assert!(calls(&u)[0].output.as_ref().unwrap().get("acoustic_cues").is_none());
    assert!(calls(&u)[0].prompt_tokens + 100 < calls(&t)[0].prompt_tokens, "no audio tokens");
}

#[test]
fn a_backbone_that_does_not_hear_ignores_the_audio_with_a_note() {
    let dir = tempfile::tempdir().unwrap();
    let d = write_dialogue(dir.path());
    let trace = dir.path().join("t.json");
    let t = trace_of(&respond("qwen2_5_vl", &d, &trace, &["--t-max", "0", "--no-gra"]), &trace);
    assert!(t.audio.kept.is_empty() && t.audio.dropped.len() == 2, "{:?}", t.audio);
    assert!(t.audio.notes[0].contains("does not hear") && t.audio.notes[0].contains("ignored 2 audio clips"), "{:?}", t.audio.notes);
    assert!(calls(&t)[0].output.as_ref().unwrap().get("acoustic_cues").is_none());
}

#[test]
fn bad_audio_names_the_file_or_with_skip_bad_media_is_a_note() {
    let dir = tempfile::tempdir().unwrap();
    let d = write_dialogue(dir.path());
    let garbage = dir.path().join("garbage.mp3");
    std::fs::write(&garbage, b"ID3 but nothing else that an mp3 decoder could use").unwrap();
    let empty = dir.path().join("empty.wav");
    let spec = hound::WavSpec { channels: 1, sample_rate: 16000, bits_per_sample: 16, sample_format: hound::SampleFormat::Int };
    hound::WavWriter::create(&empty, spec).unwrap().finalize().unwrap();
    let wav = media("omni_clip_b.wav");
    let trace = dir.path().join("t.json");
    for bad in [garbage.clone(), media("clip.mp4"), empty.clone()] {
        let files = [wav.to_str().unwrap(), bad.to_str().unwrap(), wav.to_str().unwrap()];
        let mut args = vec!["--audio"];
        args.extend(files);
        let out = respond(OMNI, &d, &trace, &args);
        let e = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && e.contains(bad.to_str().unwrap()) && e.contains("audio of turn 2") && !e.contains("panicked"), "{e}");
    }
    // --audio overrides the dialogue's audio; a bad one is skipped with a note.
    let mut args = vec!["--audio", wav.to_str().unwrap(), garbage.to_str().unwrap(), wav.to_str().unwrap()];
    args.extend(["--skip-bad-media", "--t-max", "0", "--no-gra", "--no-psp", "--no-caef"]);
    let t = trace_of(&respond(OMNI, &d, &trace, &args), &trace);
    assert_eq!(t.audio.kept, [wav.display().to_string(), wav.display().to_string()]);
    assert!(t.audio.notes.iter().any(|n| n.starts_with("skipped unreadable audio") && n.contains("garbage.mp3")), "{:?}", t.audio.notes);
    let mut acoustic = calls(&t)[0].output.clone().unwrap()["acoustic_cues"].as_array().unwrap().clone();
    acoustic.retain(|c| !(1..=2).contains(&c["clip"].as_u64().unwrap()));
    assert!(acoustic.is_empty());
    // One file per turn, or an error naming the flag.
    let out = respond(OMNI, &d, &trace, &["--audio", wav.to_str().unwrap()]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && e.contains("--audio: 1 files given, but the dialogue has 3 turns"), "{e}");
}

/// `merg eval` on MELD with a video root: each history turn's utterance clip is heard through
/// its video path; a clip without sound is noted, not an error.
#[test]
fn merg_eval_on_meld_hears_the_utterance_clips() {
    let dir = tempfile::tempdir().unwrap();
    let clips = dir.path().join("clips");
    std::fs::create_dir(&clips).unwrap();
    std::fs::copy(media("tone.mp4"), clips.join("dia0_utt0.mp4")).unwrap();
    std::fs::copy(media("clip.mp4"), clips.join("dia0_utt1.mp4")).unwrap();
    let out = dir.path().join("run");
    let o = Command::new(env!("CARGO_BIN_EXE_merg"))
        .args(["eval", "--dataset", "meld", "--split", "test", "--quiet", "--data-dir"])
        .arg(fixtures().join("data/meld/clean"))
        .arg("--video-root")
        .arg(&clips)
        .args(["--model", tiny_dir(OMNI).to_str().unwrap(), "--out"])
        .arg(&out)
        .args(["--no-bertscore", "--no-emotion-polarity", "--max-new-tokens", "400", "--max-field-chars", "16", "--kv-memory", "blocks:512"])
        .args(["--t-max", "0", "--no-gra", "--no-psp", "--limit", "2"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let records: Vec<Value> = std::fs::read_to_string(out.join("results.jsonl")).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let rec = |key: &str| records.iter().find(|r| r["key"] == key).unwrap_or_else(|| panic!("{key} in {records:?}"));
    for key in ["meld/test/dia0_utt1", "meld/test/dia0_utt2"] {
        let r = rec(key);
        assert!(r["error"].is_null(), "{r}");
        assert_eq!(r["trace"]["audio_clips"], 1, "{key}: utt0's clip is heard: {r}");
    }
    let notes = rec("meld/test/dia0_utt2")["trace"]["notes"].to_string();
    assert!(notes.contains("dia0_utt1.mp4 has no audio stream"), "{notes}");
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!((cfg["max_audio"].as_u64(), cfg["pipeline"]["use_audio"].as_bool()), (Some(4), Some(true)));
}

#[cfg(feature = "serve")]
#[test]
fn the_merg_endpoint_takes_per_turn_base64_audio() {
    use base64::Engine as _;
    let b64 = |p: &Path| base64::engine::general_purpose::STANDARD.encode(std::fs::read(p).unwrap());
    let srv = server::TestServer::start_family(OMNI, merg::serve::Limits::default(), None);
    let body = |t0: String, skip: bool| {
        json!({
            "dialogue": {"turns": [
                {"speaker": "A", "text": "How was it?", "audio": t0},
                {"speaker": "B", "text": "They hired someone else.", "audio": format!("data:audio/wav;base64,{}", b64(&media("omni_clip_b.wav")))}
            ], "next_speaker": "A"},
            "pipeline": {"t_max": 0, "use_gra": false, "use_psp": false},
            "frames": {"skip_bad_media": skip}
        })
    };
    // Two clips against a server that takes one per request: refused, unless the request's own
    // policy keeps only one.
    let one = merg::serve::Limits { max_audio: 1, ..Default::default() };
    let (defaults, policy) = (merg::pipeline::PipelineConfig::default(), FrameOptions::default());
    let two = body(b64(&media("omni_clip_a.wav")), false).to_string();
    let e = merg::serve::respond::parse_request(two.as_bytes(), &defaults, &policy, &one).err().expect("over the server's limit");
    assert!(e.status == 400 && e.message.contains("the server's limit is 1 per request"), "{}", e.message);
    let kept = merg::serve::respond::parse_request(two.as_bytes(), &defaults, &FrameOptions { max_audio: 1, ..policy }, &one).unwrap_or_else(|e| panic!("{}", e.message));
    assert_eq!(kept.audio.report.kept, ["dialogue.turns[1].audio"]);
    let (status, v) = srv.post("/v1/merg/respond", &body(b64(&media("omni_clip_a.wav")), false));
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["trace"]["audio"]["kept"], json!(["dialogue.turns[0].audio", "dialogue.turns[1].audio"]));
    let mpa = &v["trace"]["rounds"][0]["calls"][0];
    assert!(mpa["output"]["acoustic_cues"].is_array() && mpa["cached_tokens"] == 0, "{mpa}");
    assert!(v["trace"]["rounds"][0]["calls"][1]["cached_tokens"].as_u64().unwrap() > 0);
    // Not base64, and bytes that are no audio: 400 naming the field; skipped with a note.
    for (bad, what) in [("%%%".to_string(), "not base64"), (base64::engine::general_purpose::STANDARD.encode(b"RIFF....WAVEjunk"), "does not decode")] {
        let (status, v) = srv.post("/v1/merg/respond", &body(bad.clone(), false));
        let msg = v["error"]["message"].as_str().unwrap_or_default().to_string();
        assert!(status == 400 && msg.contains("dialogue.turns[0].audio") && msg.contains(what), "{status} {v}");
        let (status, v) = srv.post("/v1/merg/respond", &body(bad, true));
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["trace"]["audio"]["kept"], json!(["dialogue.turns[1].audio"]));
        let notes: Vec<Value> = v["trace"]["audio"]["notes"].as_array().unwrap().clone();
        assert!(notes.iter().any(|n| n.as_str().unwrap().contains("dialogue.turns[0].audio")), "{notes:?}");
    }
}
