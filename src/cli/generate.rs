//! `merg generate`: one chat turn (text plus optional images / a video) through the engine.

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
    let media = load_media(&a.images, a.video.as_ref(), a.fps, a.max_frames)?;
    let ckpt = a.model.load()?;
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
    let sources: Vec<String> = a.images.iter().chain(a.video.iter()).map(|p| p.display().to_string()).collect();
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
