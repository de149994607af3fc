//! `merg serve`: the engine as a local HTTP service (OpenAI and Ollama APIs, MERG's respond
//! endpoint). Flags set the limits and the pipeline defaults; the library does the serving.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;

use merg::engine::EngineThread;
use merg::serve::{self, AppState, Limits, ModelInfo, ServeConfig};

use super::respond::PipelineArgs;
use super::{EngineArgs, ModelArgs};

#[derive(Args)]
#[command(mut_arg("model", |a| a.required(true)))]
pub struct ServeArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Address to listen on; anything but loopback needs --api-key-file.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0 picks a free one; the address is printed once listening).
    #[arg(long, default_value_t = 11435)]
    port: u16,
    /// File holding the API key clients must send as `Authorization: Bearer <key>`.
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// Model name clients use (default: the --model argument's last path component).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Largest request body, MiB.
    #[arg(long, default_value_t = 32)]
    max_body_mib: usize,
    /// Images per request.
    #[arg(long, default_value_t = 16)]
    max_images: usize,
    /// Audio clips (input_audio parts) per request.
    #[arg(long, default_value_t = 8)]
    max_audio: usize,
    /// Pixels per image (width × height), checked before decoding.
    #[arg(long, default_value_t = 4096 * 4096)]
    max_image_pixels: u64,
    /// Largest max_tokens / num_predict a request may ask for (and the default).
    #[arg(long, default_value_t = 4096)]
    max_tokens: usize,
    /// Requests in flight before new ones get 429.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Seconds a client has to send a request's headers (and, on a kept-alive connection, to
    /// start its next request) before the connection is closed.
    #[arg(long, default_value_t = 10.0)]
    header_timeout: f64,
    /// Seconds a request's body has to arrive once its headers are in (408 after it).
    #[arg(long, default_value_t = 30.0)]
    body_timeout: f64,
    /// Largest request line and headers, KiB (431 above it).
    #[arg(long, default_value_t = 64)]
    max_header_kib: usize,
    /// Open connections; beyond it new clients wait until one closes.
    #[arg(long, default_value_t = 512)]
    max_connections: usize,
    /// Seconds in-flight requests may run after SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 30.0)]
    shutdown_grace: f64,
    /// Defaults of /v1/merg/respond (requests override them per call).
    #[command(flatten)]
    pipeline: PipelineArgs,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn cmd_serve(a: ServeArgs) -> Result<()> {
    let addr: SocketAddr = format!("{}:{}", a.host, a.port)
        .parse()
        .or_else(|_| format!("[{}]:{}", a.host, a.port).parse())
        .with_context(|| format!("--host {:?} is not an IP address", a.host))?;
    let api_key = a.api_key_file.as_deref().map(read_key).transpose()?;
    serve::check_bind(&addr, api_key.is_some()).context("give the server an API key with --api-key-file, or bind 127.0.0.1")?;
    for (name, n) in [("max_body_mib", a.max_body_mib), ("max_tokens", a.max_tokens), ("max_queue", a.max_queue), ("max_header_kib", a.max_header_kib), ("max_connections", a.max_connections)] {
        merg::setting::at_least_one(name, n)?;
    }
    let limits = Limits {
        max_body_bytes: a.max_body_mib << 20,
        max_images: a.max_images,
        max_audio: a.max_audio,
        max_image_pixels: a.max_image_pixels,
        max_tokens: a.max_tokens,
        max_queue: a.max_queue,
        header_read_timeout: seconds("header_timeout", a.header_timeout, false)?,
        body_read_timeout: seconds("body_timeout", a.body_timeout, false)?,
        max_header_bytes: a.max_header_kib << 10,
        max_connections: a.max_connections,
    };
    let shutdown_grace = seconds("shutdown_grace", a.shutdown_grace, true)?;
    let pipeline = a.pipeline.config()?;
    let (prompts, memory) = (a.pipeline.prompts()?, a.pipeline.memory()?);
    let engine_cfg = a.engine.config()?;
    let ckpt = a.model.load()?;
    let info = model_info(&ckpt);
    // Default served name: Ollama's own listing name for a model from its store (`qwen3.5:27b`).
    let ollama_name = ckpt.gguf.as_ref().and_then(|g| g.ollama.as_ref()).map(|o| o.name.clone());
    let engine = merg::engine::Engine::new(ckpt, engine_cfg)?;
    eprintln!("{}", engine.kv_summary());
    if let Some(line) = engine.state_summary() {
        eprintln!("{line}");
    }
    let thread = EngineThread::spawn(engine);
    let model_name = match (&a.served_model_name, ollama_name) {
        (Some(n), _) => n.clone(),
        (None, Some(o)) => o,
        (None, None) => default_name(a.model.name()?),
    };
    let cfg = ServeConfig {
        model_name: model_name.clone(),
        api_key,
        limits,
        shutdown_grace,
        pipeline,
        frames: a.pipeline.frame_options(),
        prompts,
        memory,
        info,
    };
    let state = AppState::new(thread.handle.clone(), cfg);
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("listening on {addr}"))?;
        let local = listener.local_addr()?;
        eprintln!("merg serve: listening on http://{local} (model {model_name:?})");
        serve::serve(listener, state, shutdown_signal()).await;
        anyhow::Ok(())
    })?;
    drop(thread);
    eprintln!("merg serve: shut down");
    Ok(())
}

/// A positive, finite number of seconds as a duration.
/// Seconds given as setting `name` (`zero_ok`: 0 allowed), as a duration.
fn seconds(name: &'static str, secs: f64, zero_ok: bool) -> Result<Duration> {
    let rule = if zero_ok { "a number of seconds ≥ 0" } else { "a positive number of seconds" };
    let ok = if zero_ok { secs >= 0.0 } else { secs > 0.0 };
    // NaN fails both comparisons; infinity and the like fail the conversion.
    let bad = || merg::InvalidSetting::new(name, secs, rule);
    if !ok {
        return Err(bad().into());
    }
    Ok(Duration::try_from_secs_f64(secs).map_err(|_| bad())?)
}

/// The key, trimmed; an empty file is an error (it would accept an empty bearer token).
fn read_key(path: &std::path::Path) -> Result<String> {
    let key = merg::input::read_string(path, &merg::input::TEXT).context("--api-key-file")?;
    let key = key.trim().to_string();
    if key.is_empty() {
        anyhow::bail!("--api-key-file {} is empty", path.display());
    }
    Ok(key)
}

fn model_info(ckpt: &merg::Checkpoint) -> ModelInfo {
    let size = |paths: &mut dyn Iterator<Item = &std::path::PathBuf>| paths.filter_map(|w| std::fs::metadata(w).ok()).map(|m| m.len()).sum::<u64>();
    let weight_bytes = match (&ckpt.files, &ckpt.gguf) {
        (Some(f), _) => size(&mut f.weights.iter()),
        (None, Some(g)) => size(&mut std::iter::once(&g.text).chain(g.mmproj.as_ref())),
        (None, None) => 0,
    };
    ModelInfo {
        family: ckpt.model.spec().model_type.clone(),
        dtype: format!("{:?}", ckpt.model.dtype()).to_lowercase(),
        weight_bytes,
        chat_template: ckpt.tokenizer().chat_template().map(|t| t.source().to_string()).unwrap_or_default(),
        digest: ckpt.gguf.as_ref().and_then(|g| g.ollama.as_ref()).map(|o| o.digest.clone()),
    }
}

/// `Qwen/Qwen2.5-VL-7B-Instruct` stays as it is; a directory gives its last component.
fn default_name(model: &str) -> String {
    let p = std::path::Path::new(model);
    if p.is_dir() {
        if let Some(n) = p.canonicalize().ok().and_then(|c| c.file_name().map(|n| n.to_string_lossy().into_owned())) {
            return n;
        }
    }
    model.to_string()
}

/// SIGTERM or Ctrl-C.
async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
    eprintln!("merg serve: shutdown signal received");
}
