//! `merg serve`: the engine as a local HTTP service. One loaded model behind the engine thread;
//! every caller shares its KV pool, prefix cache and continuous batching. It speaks
//! - the OpenAI chat API (`openai`): `/v1/chat/completions` (SSE streaming), `/v1/models`;
//! - the Ollama API (`ollama`): `/api/chat`, `/api/generate` (NDJSON streaming), `/api/tags`,
//!   `/api/show`;
//! - MERG's own `/v1/merg/respond` (`respond`): a dialogue with inline keyframes through the
//!   five-agent pipeline;
//! - operations (`ops`): `/health`, Prometheus `/metrics`, request logs, API-key checks.
//!
//! `listen` runs the connections under the per-client limits (header timeout and size, open
//! connections) and `body` reads request bodies under theirs (size, timeout); `generation`
//! bridges the engine's blocking event stream to async responses (and aborts a request whose
//! client went away); `text` turns tokens into text deltas and applies stop strings; `media`
//! decodes inline images under the server's limits; `error` answers in each API's error shape.

pub mod body;
pub mod error;
pub mod generation;
mod listen;
pub mod media;
pub mod ollama;
pub mod openai;
pub mod ops;
pub mod respond;
pub mod text;

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};

use crate::engine::EngineHandle;
use crate::pipeline::frames::FrameOptions;
use crate::pipeline::prompt::Prompts;
use crate::pipeline::retrieval::Memory;
use crate::pipeline::PipelineConfig;

pub use error::{ApiError, Flavor};

/// What one request may ask for, and what one client may hold. Every limit is named in the
/// error or log line that enforces it.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Request body size (413 above it).
    pub max_body_bytes: usize,
    /// Images in one request.
    pub max_images: usize,
    /// Audio clips (`input_audio` parts) in one request.
    pub max_audio: usize,
    /// Pixels of one decoded image (width × height), checked before decoding.
    pub max_image_pixels: u64,
    /// Largest `max_tokens` / `num_predict` a request may ask for; also the default.
    pub max_tokens: usize,
    /// Requests in flight (queued or running) before new ones get 429.
    pub max_queue: usize,
    /// Time a connection has to deliver a request's line and headers, counted from when the
    /// server starts waiting for them (after accepting, or after the previous response on a
    /// kept-alive connection); the connection is closed after it. Bounds silent, half-open
    /// and byte-a-second clients, and idle keep-alive connections.
    pub header_read_timeout: Duration,
    /// Time a request's whole body has to arrive once its headers are in (408 after it).
    /// Only reading the request is timed: a long streamed response is not.
    pub body_read_timeout: Duration,
    /// Bytes of a request's line and headers (431 above it).
    pub max_header_bytes: usize,
    /// Open connections. At the cap the server stops accepting until one closes: new clients
    /// wait in the kernel's listen backlog (see `listen`).
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_body_bytes: 32 << 20,
            max_images: 16,
            max_audio: 8,
            max_image_pixels: 4096 * 4096,
            max_tokens: 4096,
            max_queue: 256,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            max_header_bytes: 64 << 10,
            max_connections: 512,
        }
    }
}

/// Everything the server needs besides the engine.
pub struct ServeConfig {
    /// The name clients use in `model` (requests naming another model get 404).
    pub model_name: String,
    /// Bearer token every endpoint except `/health` requires, when set.
    pub api_key: Option<String>,
    pub limits: Limits,
    /// After a shutdown signal, how long in-flight requests may run before they are cancelled.
    pub shutdown_grace: Duration,
    /// Defaults of `/v1/merg/respond` (a request overrides fields of its own).
    pub pipeline: PipelineConfig,
    pub frames: FrameOptions,
    pub prompts: Prompts,
    pub memory: Option<Memory>,
    /// Shown by `/api/show` and `/api/tags`.
    pub info: ModelInfo,
}

/// Static facts about the served model.
#[derive(Clone, Debug, Default)]
pub struct ModelInfo {
    pub family: String,
    pub dtype: String,
    pub weight_bytes: u64,
    pub chat_template: String,
    /// The model's digest where it has one (a model from Ollama's store: its manifest's
    /// SHA-256, as Ollama's own `/api/tags` lists it).
    pub digest: Option<String>,
}

/// Shared by every handler.
pub struct AppState {
    pub handle: EngineHandle,
    pub cfg: ServeConfig,
    pub metrics: ops::Metrics,
    in_flight: AtomicUsize,
    next_id: AtomicU64,
    /// Set on a shutdown signal: new requests get 503.
    shutting_down: AtomicBool,
    /// Set when the shutdown grace period ends: in-flight requests are aborted.
    cancel_all: Arc<AtomicBool>,
    pub started: SystemTime,
}

/// A place in the request queue; dropping it frees the place.
pub struct Slot(Arc<AppState>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::SeqCst);
    }
}

impl AppState {
    pub fn new(handle: EngineHandle, cfg: ServeConfig) -> Arc<Self> {
        Arc::new(AppState {
            handle,
            cfg,
            metrics: ops::Metrics::default(),
            in_flight: AtomicUsize::new(0),
            next_id: AtomicU64::new(0),
            shutting_down: AtomicBool::new(false),
            cancel_all: Arc::new(AtomicBool::new(false)),
            started: SystemTime::now(),
        })
    }

    /// A queue place, or 429 when `max_queue` requests are already in flight (503 while
    /// shutting down).
    pub fn acquire(self: &Arc<Self>, flavor: Flavor) -> Result<Slot, ApiError> {
        if self.shutting_down.load(Ordering::SeqCst) {
            return Err(ApiError::new(flavor, 503, "the server is shutting down"));
        }
        let limit = self.cfg.limits.max_queue;
        let n = self.in_flight.fetch_add(1, Ordering::SeqCst);
        let slot = Slot(self.clone());
        if n >= limit {
            return Err(ApiError::new(flavor, 429, format!("{n} requests are in flight and the server's queue limit is {limit}; retry later")));
        }
        Ok(slot)
    }

    pub fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }

    /// True once in-flight work must stop (the shutdown grace period is over).
    pub fn cancelled(&self) -> bool {
        self.cancel_all.load(Ordering::SeqCst)
    }

    fn next_id(&self) -> u64 {
        self.next_id.fetch_add(1, Ordering::Relaxed)
    }

    /// 404 unless `name` is the served model (Ollama's implicit `:latest` tag accepted).
    pub fn check_model(&self, flavor: Flavor, name: &str) -> Result<(), ApiError> {
        let served = &self.cfg.model_name;
        if name == served || name.strip_suffix(":latest") == Some(served.as_str()) {
            return Ok(());
        }
        Err(ApiError::new(flavor, 404, format!("model {name:?} not found; this server serves {served:?}")))
    }

    /// Seconds since the Unix epoch.
    pub fn now_unix(&self) -> u64 {
        SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
    }
}

/// Binding beyond loopback exposes the model to the network; that needs an API key.
pub fn check_bind(addr: &SocketAddr, has_api_key: bool) -> anyhow::Result<()> {
    if !addr.ip().is_loopback() && !has_api_key {
        anyhow::bail!("refusing to listen on {addr} without an API key: only loopback addresses may serve unauthenticated");
    }
    Ok(())
}

pub fn router(state: Arc<AppState>) -> Router {
    let limit = state.cfg.limits.max_body_bytes;
    Router::new()
        .route("/v1/chat/completions", post(openai::chat_completions))
        .route("/v1/models", get(openai::models))
        .route("/api/chat", post(ollama::chat))
        .route("/api/generate", post(ollama::generate))
        .route("/api/tags", get(ollama::tags))
        .route("/api/show", post(ollama::show))
        .route("/api/version", get(ollama::version))
        .route("/v1/merg/respond", post(respond::respond))
        .route("/health", get(ops::health))
        .route("/metrics", get(ops::metrics))
        .fallback(ops::not_found)
        .layer(axum::middleware::from_fn_with_state(state.clone(), ops::guard))
        .layer(DefaultBodyLimit::max(limit))
        .with_state(state)
}

/// Serves until `shutdown` resolves, then stops accepting, lets in-flight requests finish for
/// the grace period, cancels what is left, and returns once every connection has closed.
pub async fn serve(listener: tokio::net::TcpListener, state: Arc<AppState>, shutdown: impl Future<Output = ()> + Send + 'static) {
    let st = state.clone();
    let signal = async move {
        shutdown.await;
        st.shutting_down.store(true, Ordering::SeqCst);
        let grace = st.cfg.shutdown_grace;
        tracing::info!(in_flight = st.in_flight(), grace_s = grace.as_secs_f64(), "shutdown: finishing in-flight requests");
        let cancel = st.cancel_all.clone();
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            cancel.store(true, Ordering::SeqCst);
        });
    };
    let limits = state.cfg.limits.clone();
    listen::run(listener, router(state), &limits, signal).await;
}

/// The generation budget a request asked for (`field`), or the server's limit when it asked
/// for none; 400 naming the limit when it asked for more.
pub(crate) fn token_budget(flavor: Flavor, asked: Option<usize>, limits: &Limits, field: &str) -> Result<usize, ApiError> {
    match asked {
        None => Ok(limits.max_tokens),
        Some(n) if n >= 1 && n <= limits.max_tokens => Ok(n),
        Some(n) => Err(ApiError::bad(flavor, format!("{field} must be 1..={} (the server's limit), got {n}", limits.max_tokens))),
    }
}

/// `{"a": 1}` merged over `base` key by key (objects recursively); used for per-request
/// overrides of the server's defaults.
pub(crate) fn merge_json(base: &mut Value, over: &Value) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                merge_json(b.entry(k.clone()).or_insert(json!(null)), v);
            }
        }
        (b, o) => *b = o.clone(),
    }
}
