//! Hearing in the pipeline with a scripted model double (the real engine on the tiny Omni
//! checkpoint is tests/respond_audio.rs): where each clip sits in the shared prefix, what the
//! agents are asked and allowed to answer with audio and without, hearing off and a model
//! without ears, clips cut to the audio window and dropped oldest first when the context is
//! short; and `hearing::collect` / `from_recording` on real files, bad ones included.

mod common;

use std::sync::Mutex;

use anyhow::Result;
use merg::audio::Pcm;
use merg::chat::{ContentPart, Message};
use merg::dialogue::{Dialogue, Turn};
use merg::engine::block_manager::CacheStats;
use merg::generate::FinishReason;
use merg::pipeline::frames::{FrameReport, Keyframe};
use merg::pipeline::hearing::{AudioReport, Clip};
use merg::pipeline::model::{AgentCall, AgentModel, AgentReply};
use merg::pipeline::prompt::Prompts;
use merg::pipeline::{Pipeline, PipelineConfig, Trace};
use merg::vision::Media;
use serde_json::{json, Value};

/// One call as the double saw it.
#[derive(Clone)]
struct Seen {
    agent: String,
    messages: Vec<Message>,
    media: Vec<Media>,
    schema: Value,
}

/// Answers every agent with a fixed valid output; hears when `window` is set; counts an image
/// as 64 tokens and audio as 25 tokens a second (Qwen2.5-Omni's rate).
struct Double {
    window: Option<f64>,
    context: usize,
    /// Count media tokens only (so a test can size the context for its media exactly).
    media_only: bool,
    seen: Mutex<Vec<Seen>>,
}

impl Double {
    fn new(window: Option<f64>) -> Self {
        Double { window, context: 32768, media_only: false, seen: Mutex::new(vec![]) }
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }

    fn first(&self, agent: &str) -> Seen {
        self.seen().into_iter().find(|s| s.agent == agent).unwrap()
    }
}

fn answer(agent: &str, n_audio: usize) -> String {
    match agent {
        "mpa" if n_audio > 0 => json!({"textual_cues": [{"turn": 2, "cue": "t"}], "visual_cues": [], "acoustic_cues": [{"clip": n_audio, "cue": "sighs"}]}),
        "mpa" => json!({"textual_cues": [{"turn": 2, "cue": "t"}], "visual_cues": []}),
        "caef" if n_audio > 0 => json!({"text_emotion": "sadness", "visual_emotion": "none", "audio_emotion": "anger", "consistency": "conflict", "rationale": "r", "emotion": "sadness"}),
        "caef" => json!({"text_emotion": "sadness", "visual_emotion": "none", "consistency": "no_visual", "rationale": "r", "emotion": "sadness"}),
        "psp" => json!({"goal": "comfort", "stance": "supportive", "tactic": "validate", "tone": "warm"}),
        "sgrg" => json!({"reply": "I am sorry."}),
        "gra" => {
            let ok = json!({"pass": true, "correction": ""});
            json!({"mpa": ok, "caef": ok, "psp": ok, "sgrg": ok})
        }
        other => panic!("unexpected agent {other}"),
    }
    .to_string()
}

impl AgentModel for Double {
    fn call(&self, call: AgentCall) -> Result<AgentReply> {
        let n_audio = call.media.iter().filter(|m| m.is_audio()).count();
        let out = answer(call.agent, n_audio);
        self.seen.lock().unwrap().push(Seen { agent: call.agent.into(), messages: call.messages, media: call.media, schema: call.schema });
        Ok(AgentReply { tokens: out.bytes().map(u32::from).collect(), logprobs: vec![-1.0; out.len()], text: out, finish: FinishReason::Stop, prompt_tokens: 100, cached_tokens: 60, ms: 0.0 })
    }

    fn count_tokens(&self, messages: &[Message], media: &[Media]) -> Result<usize> {
        let media: usize = media.iter().map(|m| if let Media::Audio(p) = m { (p.seconds() * 25.0) as usize } else { 64 }).sum();
        Ok(if self.media_only { media } else { merg::pipeline::model::text_chars(messages) / 4 + media })
    }

    fn context_window(&self) -> usize {
        self.context
    }

    fn decoded_offsets(&self, tokens: &[u32]) -> Result<Vec<usize>> {
        Ok((1..=tokens.len()).collect())
    }

    fn cache_stats(&self) -> Option<CacheStats> {
        None
    }

    fn audio_window(&self) -> Option<f64> {
        self.window
    }
}

fn dialogue() -> Dialogue {
    Dialogue {
        id: Some("d".into()),
        turns: vec![Turn::new("Ann", "How was it?"), Turn::new("Bo", "They hired someone else."), Turn::new("Ann", "Oh no.")],
        next_speaker: "Bo".into(),
        video: None,
        frames: vec![],
    }
}

/// `secs` of a seeded ramp, different per turn so every clip has its own content.
fn clip(turn: usize, secs: f64) -> Clip {
    let n = (secs * 16000.0) as usize;
    let samples = (0..n).map(|i| ((i * (turn + 3)) % 97) as f32 / 97.0 - 0.5).collect();
    Clip { turn, source: format!("t{turn}.wav"), pcm: Pcm { samples, source: format!("t{turn}.wav").into() } }
}

fn keyframe(turn: usize) -> Keyframe {
    Keyframe { turn: Some(turn), source: format!("f{turn}.png"), image: image::RgbImage::new(28, 28) }
}

fn config() -> PipelineConfig {
    PipelineConfig { t_max: 0, top_k: 0, ..Default::default() }
}

fn run(model: &Double, cfg: &PipelineConfig, frames: Vec<Keyframe>, clips: Vec<Clip>) -> Trace {
    let prompts = Prompts::builtin();
    let p = Pipeline { model, prompts: &prompts, memory: None, cfg };
    p.respond_heard(&dialogue(), frames, FrameReport::default(), clips, AudioReport::default()).unwrap()
}

/// The user message's parts, media as `<image>` / `<audio>`.
fn layout(m: &[Message]) -> Vec<String> {
    m[1].content.iter().map(|p| match p {
        ContentPart::Text(t) => t.clone(),
        ContentPart::Image => "<image>".into(),
        ContentPart::Audio => "<audio>".into(),
        ContentPart::Video => "<video>".into(),
    }).collect()
}

#[test]
fn each_clip_follows_its_turn_and_its_keyframes_and_every_agent_hears_it() {
    let model = Double::new(Some(30.0));
    let t = run(&model, &config(), vec![keyframe(0), keyframe(2)], vec![clip(1, 1.0), clip(2, 2.0)]);
    let mpa = model.first("mpa");
    let parts = layout(&mpa.messages);
    let at = |s: &str| parts.iter().position(|p| p.starts_with(s)).unwrap_or_else(|| panic!("{s} in {parts:?}"));
    assert!(parts[0].contains("2 keyframes, 2 audio clips") && parts[0].contains("[A1]..[A2]"), "{}", parts[0]);
    assert_eq!(parts[at("[A1] audio of T2: ") + 1], "<audio>");
    assert!(at("[T2]") < at("[A1]") && at("[A1]") < at("[T3]"), "T2's clip sits after T2's text");
    assert!(at("[F2] keyframe of T3") < at("[A2] audio of T3") && parts[at("[A2]") + 1] == "<audio>", "a turn's clip follows its keyframes");
    let kinds: Vec<&str> = mpa.media.iter().map(|m| if m.is_audio() { "audio" } else { "image" }).collect();
    assert_eq!(kinds, ["image", "audio", "image", "audio"]);
    let Media::Audio(a2) = &mpa.media[3] else { unreachable!() };
    assert_eq!(a2.samples, clip(2, 2.0).pcm.samples, "T3's own samples");
    // The shared prefix (everything but the agent's text) is the same for every agent.
    for s in model.seen() {
        assert_eq!(s.messages[1].content[..parts.len() - 1], mpa.messages[1].content[..parts.len() - 1], "{}", s.agent);
        assert_eq!(s.media.len(), 4);
    }
    // MPA is asked for acoustic cues, bounded by the clips; CAEF for the voice's emotion; GRA audits them.
    let ac = &mpa.schema["properties"]["acoustic_cues"];
    assert_eq!((ac["maxItems"].as_u64(), ac["items"]["properties"]["clip"]["maximum"].as_u64()), (Some(3), Some(2)));
    assert!(layout(&mpa.messages).last().unwrap().contains("Acoustic cues: tone of voice"));
    let caef = model.first("caef");
    assert_eq!(caef.schema["required"][2], "audio_emotion");
    assert_eq!(caef.schema["properties"]["consistency"]["enum"], json!(["agree", "conflict", "no_visual"]));
    let caef_text = layout(&caef.messages).last().unwrap().clone();
    assert!(caef_text.contains("the emotion the voice suggests") && caef_text.contains("- [A2] sighs"), "{caef_text}");
    assert!(layout(&model.first("psp").messages).last().unwrap().contains("the voice suggests anger"));
    assert!(layout(&model.first("gra").messages).last().unwrap().contains("text, visual and acoustic cues"));
    // The trace lists the clips and the parsed acoustic cue.
    assert_eq!(t.audio.kept, ["t1.wav", "t2.wav"]);
    assert_eq!(t.rounds[0].evidence.as_ref().unwrap().acoustic_cues[0].clip, 2);
    assert_eq!(t.rounds[0].forecast.as_ref().unwrap().audio_emotion.as_deref(), Some("anger"));
}

/// The calls of a run without the timings: messages, media kinds, schemas.
fn calls(model: &Double) -> Vec<(String, Vec<String>, Value)> {
    model.seen().into_iter().map(|s| (s.agent, layout(&s.messages), s.schema)).collect()
}

#[test]
fn without_hearing_every_call_is_the_no_audio_call() {
    let plain = Double::new(None);
    let t0 = run(&plain, &config(), vec![keyframe(1)], vec![]);
    let no_audio = calls(&plain);
    assert!(no_audio.iter().all(|(_, parts, schema)| {
        let text = parts.join("");
        !text.contains("audio") && !text.contains("acoustic") && schema["properties"].get("acoustic_cues").is_none() && schema["properties"].get("audio_emotion").is_none()
    }));
    assert!(t0.audio.notes.is_empty() && t0.audio.kept.is_empty());
    // A model without ears: the clips are ignored, noted, and nothing else changes.
    let deaf = Double::new(None);
    let t = run(&deaf, &config(), vec![keyframe(1)], vec![clip(0, 1.0), clip(2, 1.0)]);
    assert_eq!(calls(&deaf), no_audio);
    assert!(t.audio.notes[0].contains("does not hear") && t.audio.notes[0].contains("ignored 2 audio clips"), "{:?}", t.audio.notes);
    assert_eq!(t.audio.dropped, ["t0.wav", "t2.wav"]);
    // Hearing off on a model that hears: the same, and the configuration says so.
    let off = Double::new(Some(30.0));
    let cfg = PipelineConfig { use_audio: false, ..config() };
    let t = run(&off, &cfg, vec![keyframe(1)], vec![clip(0, 1.0)]);
    assert_eq!(calls(&off), no_audio);
    assert!(!t.config.use_audio && t.audio.notes[0].starts_with("hearing is off (use_audio false)"), "{:?}", t.audio.notes);
    let json = serde_json::to_value(&t).unwrap();
    assert_eq!(json["config"]["use_audio"], false);
    // Without keyframes, CAEF with a voice may not answer "no_visual" (the voice is a second cue).
    let heard = Double::new(Some(30.0));
    run(&heard, &config(), vec![], vec![clip(2, 1.0)]);
    assert_eq!(heard.first("caef").schema["properties"]["consistency"]["enum"], json!(["agree", "conflict"]));
}

#[test]
fn long_clips_are_cut_to_the_window_and_short_contexts_drop_the_oldest_media() {
    let model = Double::new(Some(2.0));
    let t = run(&model, &config(), vec![], vec![clip(0, 1.0), clip(2, 3.5)]);
    let Media::Audio(a) = &model.first("mpa").media[1] else { panic!("T3's clip is the second item") };
    assert_eq!(a.samples.len(), 32000, "cut to the model's 2 s window");
    assert_eq!(a.samples[..100], clip(2, 3.5).pcm.samples[..100], "from the turn's start");
    assert_eq!(t.audio.cut.len(), 1);
    assert!(t.audio.cut[0].starts_with("t2.wav: 3.5 s") && t.audio.cut[0].contains("cut to 0.0..2.0 s"), "{:?}", t.audio.cut);
    // A context that holds 70 tokens of media besides the agents' budget: T1's clip (25 tokens)
    // and T2's keyframe (64) go, oldest first; T3's 50 s clip, cut to 2 s (50 tokens), stays.
    let mut small = Double::new(Some(2.0));
    small.media_only = true;
    small.context = 3 * config().sampling.max_new_tokens + 70;
    let t = run(&small, &config(), vec![keyframe(1)], vec![clip(0, 1.0), clip(2, 50.0)]);
    assert_eq!(t.audio.dropped, ["t0.wav"]);
    assert_eq!(t.frames.dropped, ["f1.png"]);
    assert_eq!(t.audio.kept, ["t2.wav"]);
    assert!(t.audio.notes.iter().any(|n| n.starts_with("1 of 2 audio clips did not fit the context window")), "{:?}", t.audio.notes);
    let parts = layout(&small.first("mpa").messages);
    assert!(parts.iter().any(|p| p == "[A1] audio of T3: ") && !parts.iter().any(|p| p == "<image>"), "{parts:?}");
}

/// Real files (the mp4 clips need the `video` feature).
#[cfg(feature = "video")]
mod files {
    use super::*;
    use merg::pipeline::frames::FrameOptions;
    use merg::pipeline::hearing;

    fn media(name: &str) -> std::path::PathBuf {
        common::fixtures().join("media").join(name)
    }

    /// A dialogue whose turns carry the given audio files and clips.
    fn dialogue_with(sources: &[(Option<&str>, Option<&str>)]) -> Dialogue {
        let mut d = dialogue();
        d.turns = sources
            .iter()
            .enumerate()
            .map(|(i, (a, v))| Turn { audio: a.map(media), video: v.map(media), ..Turn::new(if i % 2 == 0 { "Ann" } else { "Bo" }, format!("turn {i}")) })
            .collect();
        d
    }

    #[test]
    fn collect_takes_files_and_clip_tracks_notes_silent_clips_and_keeps_the_most_recent() {
        let d = dialogue_with(&[(Some("omni_clip_b.wav"), None), (None, Some("tone.mp4")), (None, Some("clip.mp4")), (Some("omni_clip_a.wav"), Some("clip.mp4")), (None, None)]);
        let mut r = AudioReport::default();
        let clips = hearing::collect(&d, &FrameOptions::default(), &mut r).unwrap();
        assert_eq!(clips.iter().map(|c| c.turn).collect::<Vec<_>>(), [0, 1, 3], "T3's clip has no audio stream; T4's own file wins over its clip");
        assert_eq!(clips[2].pcm, merg::audio::load_audio(&media("omni_clip_a.wav")).unwrap());
        assert_eq!(clips[1].pcm, merg::audio::load_clip_audio(&media("tone.mp4")).unwrap());
        assert!(r.notes.iter().any(|n| n.starts_with("T3: the clip") && n.contains("clip.mp4 has no audio stream")), "{:?}", r.notes);
        assert_eq!(r.kept.len(), 3);
        // At most two: the newest are decoded, the oldest is not read at all.
        let mut r = AudioReport::default();
        let two = hearing::collect(&d, &FrameOptions { max_audio: 2, ..Default::default() }, &mut r).unwrap();
        assert_eq!(two.iter().map(|c| c.turn).collect::<Vec<_>>(), [1, 3]);
        assert!(r.dropped[0].ends_with("omni_clip_b.wav") && r.notes.iter().any(|n| n.contains("max_audio 2")), "{r:?}");
    }

    #[test]
    fn bad_audio_names_the_file_or_is_skipped_with_a_note() {
        let dir = tempfile::tempdir().unwrap();
        let garbage = dir.path().join("garbage.wav");
        std::fs::write(&garbage, b"this is not audio at all, just bytes").unwrap();
        let empty = dir.path().join("empty.wav");
        let spec = hound::WavSpec { channels: 1, sample_rate: 16000, bits_per_sample: 16, sample_format: hound::SampleFormat::Int };
        hound::WavWriter::create(&empty, spec).unwrap().finalize().unwrap();
        for (file, what) in [(garbage.clone(), "does not decode"), (media("clip.mp4"), "has no audio stream"), (empty.clone(), "empty")] {
            let mut d = dialogue();
            d.turns[1].audio = Some(file.clone());
            let e = hearing::collect(&d, &FrameOptions::default(), &mut AudioReport::default()).unwrap_err();
            let msg = format!("{e:#}");
            assert!(msg.contains(&file.display().to_string()) && msg.contains(what) && msg.contains("audio of turn 2"), "{msg}");
            let mut r = AudioReport::default();
            let clips = hearing::collect(&d, &FrameOptions { skip_bad_media: true, ..Default::default() }, &mut r).unwrap();
            assert!(clips.is_empty() && r.notes[0].starts_with("skipped unreadable audio") && r.notes[0].contains(&file.display().to_string()), "{r:?}");
        }
    }

    #[test]
    fn a_recording_is_cut_per_history_turn_and_never_reaches_the_answered_turn() {
        let rec = media("tone.mp4");
        let all = merg::audio::load_clip_audio(&rec).unwrap();
        let dur = all.seconds();
        let spans = [(0.0, dur * 0.3), (dur * 0.3, dur * 0.6), (dur * 0.6, dur * 0.9)];
        let until = dur * 0.5;
        let mut r = AudioReport::default();
        let clips = hearing::from_recording(&rec, &spans, until, &FrameOptions::default(), &mut r).unwrap();
        assert_eq!(clips.iter().map(|c| c.turn).collect::<Vec<_>>(), [0, 1], "T3 starts after the answered turn");
        let at = |t: f64| (t * 16000.0).round() as usize;
        assert_eq!(clips[0].pcm.samples, all.samples[..at(dur * 0.3)]);
        assert_eq!(clips[1].pcm.samples, all.samples[at(dur * 0.3)..at(until)], "T2 is cut where the answered turn starts");
        assert_eq!(r.cut.len(), 2);
        assert!(r.kept[1].contains("tone.mp4@"), "{:?}", r.kept);
        let mut r = AudioReport::default();
        let one = hearing::from_recording(&rec, &spans, until, &FrameOptions { max_audio: 1, ..Default::default() }, &mut r).unwrap();
        assert_eq!((one.len(), one[0].turn, r.dropped.len()), (1, 1, 1));
        // A recording without sound is no audio, not an error.
        let mut r = AudioReport::default();
        assert!(hearing::from_recording(&media("clip.mp4"), &spans, until, &FrameOptions::default(), &mut r).unwrap().is_empty());
        assert!(r.notes[0].contains("no audio stream"), "{:?}", r.notes);
    }
}
