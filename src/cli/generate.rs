//! `merg generate`: one chat turn (text plus optional images / a video / audio clips) through the
//! engine.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use merg::chat::{ContentPart, Message};
use merg::engine::{ChatRequest, Engine};
use merg::vision::{load_media, Media};

use super::{with_hint, EngineArgs, ModelArgs, SamplingArgs};

#[derive(Args)]
#[command(mut_arg("model", |a| a.required(true)))]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// The user message.
    #[arg(long)]
    prompt: String,
    /// Optional system message (the chat template's default otherwise).
    #[arg(long)]
    system: Option<String>,
    /// Image files, shown before the prompt in this order.
    #[arg(long = "image")]
    images: Vec<PathBuf>,
    /// An mp4 video, shown after the images.
    #[arg(long)]
    video: Option<PathBuf>,
    /// Frames per second sampled from --video.
    #[arg(long, default_value_t = 2.0)]
    fps: f64,
    #[arg(long, default_value_t = 32)]
    max_frames: usize,
    /// Audio files (WAV, FLAC, MP3, … or an mp4's audio track), heard after the images and
    /// video in this order; the model must have an audio encoder (Qwen2.5-Omni).
    #[arg(long = "audio")]
    audio: Vec<PathBuf>,
    /// Print a JSON record (text, token ids, log-probs, finish reason) instead of the text.
    #[arg(long)]
    json: bool,
    #[command(flatten)]
    engine: EngineArgs,
}

/// An error about "media item i" also names the file it came from.
fn name_media(e: anyhow::Error, sources: &[String]) -> anyhow::Error {
    let msg = format!("{e:#}");
    match sources.iter().enumerate().find(|(i, _)| msg.contains(&format!("media item {i}:"))) {
        Some((i, s)) => e.context(format!("media item {i} is {s}")),
        None => e,
    }
}

pub fn cmd_generate(a: GenerateArgs) -> Result<()> {
    let params = a.sampling.params();
    params.validate()?;
    let cfg = a.engine.config()?;
    let mut media = load_media(&a.images, a.video.as_ref(), a.fps, a.max_frames)?;
    for p in &a.audio {
        media.push(Media::Audio(load_audio_any(p).map_err(|e| anyhow::anyhow!("--audio {}: {e}", p.display()))?));
    }
    let ckpt = a.model.load()?;
    if !a.audio.is_empty() && !ckpt.processor.hears() {
        anyhow::bail!("--audio: the model {} has no audio encoder, so it cannot hear {}", ckpt.model.spec().model_type, a.audio[0].display());
    }
    let mut content: Vec<ContentPart> = media
        .iter()
        .map(|m| match m {
            Media::Image(_) => ContentPart::Image,
            Media::Video { .. } => ContentPart::Video,
            Media::Audio(_) => ContentPart::Audio,
        })
        .collect();
    content.push(ContentPart::Text(a.prompt.clone()));
    let mut messages = vec![];
    if let Some(s) = &a.system {
        messages.push(Message::text("system", s.clone()));
    }
    messages.push(Message::new("user", content));
    let mut engine = Engine::new(ckpt, cfg)?;
    let sources: Vec<String> = a.images.iter().chain(a.video.iter()).chain(a.audio.iter()).map(|p| p.display().to_string()).collect();
    let reply = engine
        .run_all(vec![ChatRequest::new(messages, media, params)])
        .pop()
        .expect("one request")
        .map_err(|e| name_media(with_hint(e), &sources))?;
    if a.json {
        let rec = serde_json::json!({
            "text": reply.text,
            "tokens": reply.tokens,
            "logprobs": reply.logprobs,
            "finish": reply.finish,
            "prompt_tokens": reply.prompt_tokens,
        });
        println!("{}", serde_json::to_string(&rec)?);
    } else {
        println!("{}", reply.text);
    }
    Ok(())
}

/// An audio file, or the audio track of a video file (by its name: ffmpeg reads both, but a
/// video's size cap is a video's).
fn load_audio_any(p: &std::path::Path) -> Result<merg::audio::Pcm, merg::audio::AudioError> {
    let video = p.extension().and_then(|e| e.to_str()).is_some_and(|e| ["mp4", "mkv", "mov", "avi", "webm"].contains(&e.to_ascii_lowercase().as_str()));
    match video {
        true => merg::audio::load_clip_audio(p),
        false => merg::audio::load_audio(p),
    }
}
