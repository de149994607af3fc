//! The Ollama API, as the paper's own code and the `ollama` clients call it: `POST /api/chat`
//! and `/api/generate` (base64 `images`, `format` "json" or a JSON schema, `options`, NDJSON
//! streaming by default), `GET /api/tags`, `POST /api/show`, `GET /api/version`. Sampling
//! defaults are Ollama's (temperature 0.8, top_p 0.9, top_k 40).

use std::convert::Infallible;
use std::sync::Arc;
use std::time::SystemTime;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, StreamExt};
use serde::Deserialize;
use serde_json::{json, Map, Value};

use super::body::{parse_json, RequestBody};
use super::generation::{self, GenEvent, OutputOptions, Summary};
use super::{media, token_budget, ApiError, AppState, Flavor, Limits};
use crate::chat::{ContentPart, Message};
use crate::engine::ChatRequest;
use crate::generate::SamplingParams;
use crate::vision::Media;

const F: Flavor = Flavor::Ollama;

/// What `/api/chat` and `/api/generate` share.
#[derive(Deserialize)]
pub struct Common {
    pub model: String,
    #[serde(default)]
    pub format: Option<Value>,
    #[serde(default)]
    pub options: Option<Options>,
    #[serde(default)]
    pub stream: Option<bool>,
}

#[derive(Deserialize)]
pub struct ChatReq {
    #[serde(flatten)]
    pub common: Common,
    #[serde(default)]
    pub messages: Vec<OMessage>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
}

#[derive(Deserialize)]
pub struct OMessage {
    pub role: String,
    #[serde(default)]
    pub content: String,
    #[serde(default)]
    pub images: Option<Vec<String>>,
}

#[derive(Deserialize)]
pub struct GenerateReq {
    #[serde(flatten)]
    pub common: Common,
    #[serde(default)]
    pub prompt: String,
    #[serde(default)]
    pub system: Option<String>,
    #[serde(default)]
    pub images: Option<Vec<String>>,
    #[serde(default)]
    pub raw: Option<bool>,
    #[serde(default)]
    pub template: Option<String>,
    #[serde(default)]
    pub suffix: Option<String>,
}

/// The `options` merg honours; others (num_ctx, num_gpu, ...) are accepted and ignored, as
/// Ollama does for options a runner lacks.
#[derive(Deserialize, Default)]
pub struct Options {
    pub temperature: Option<f64>,
    pub top_p: Option<f64>,
    pub top_k: Option<usize>,
    pub seed: Option<i64>,
    pub num_predict: Option<i64>,
    pub stop: Option<Vec<String>>,
    #[serde(flatten)]
    pub _other: Map<String, Value>,
}

pub async fn chat(State(state): State<Arc<AppState>>, RequestBody(body): RequestBody) -> Result<Response, ApiError> {
    let req: ChatReq = parse_json(F, &body)?;
    state.check_model(F, &req.common.model)?;
    let limits = state.cfg.limits.clone();
    // Images are decoded here: off the async workers.
    let checked = tokio::task::spawn_blocking(move || check_chat(req, &limits));
    match checked.await.map_err(|e| ApiError::new(F, 500, e.to_string()))?? {
        Some(c) => respond(state, c, Kind::Chat).await,
        None => Ok(Json(loaded(&state, "message")).into_response()),
    }
}

pub async fn generate(State(state): State<Arc<AppState>>, RequestBody(body): RequestBody) -> Result<Response, ApiError> {
    let req: GenerateReq = parse_json(F, &body)?;
    state.check_model(F, &req.common.model)?;
    let limits = state.cfg.limits.clone();
    let checked = tokio::task::spawn_blocking(move || check_generate(req, &limits));
    match checked.await.map_err(|e| ApiError::new(F, 500, e.to_string()))?? {
        Some(c) => respond(state, c, Kind::Generate).await,
        None => Ok(Json(loaded(&state, "response")).into_response()),
    }
}

/// An `/api/chat` or `/api/generate` request, checked: what the engine gets, and how to
/// answer.
pub struct Checked {
    pub chat: ChatRequest,
    pub opts: OutputOptions,
    pub stream: bool,
}

/// `/api/chat` body bytes to the engine's request without a model or a server: everything
/// the handler checks but the model name. `None`: no messages, which Ollama answers with "the
/// model is loaded". Any error is a 4xx (tests/fuzz's `serve_request` holds it to that).
pub fn parse_chat(body: &[u8], limits: &Limits) -> Result<Option<Checked>, ApiError> {
    check_chat(parse_json(F, body)?, limits)
}

/// As `parse_chat`, for `/api/generate` (`None`: neither prompt nor images).
pub fn parse_generate(body: &[u8], limits: &Limits) -> Result<Option<Checked>, ApiError> {
    check_generate(parse_json(F, body)?, limits)
}

fn check_chat(req: ChatReq, limits: &Limits) -> Result<Option<Checked>, ApiError> {
    if req.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::bad(F, "tools are not supported by this server"));
    }
    if req.messages.is_empty() {
        return Ok(None);
    }
    let (messages, images) = chat_messages(req.messages, limits)?;
    request(messages, images, req.common, limits).map(Some)
}

fn check_generate(req: GenerateReq, limits: &Limits) -> Result<Option<Checked>, ApiError> {
    if req.raw.unwrap_or(false) || req.template.is_some() {
        return Err(ApiError::bad(F, "raw prompts and custom templates are not supported: every prompt goes through the model's chat template"));
    }
    if req.suffix.is_some() {
        return Err(ApiError::bad(F, "suffix (fill-in-the-middle) is not supported by this model"));
    }
    let images = req.images.unwrap_or_default();
    if req.prompt.is_empty() && images.is_empty() {
        return Ok(None);
    }
    let mut msgs = vec![];
    if let Some(s) = req.system {
        msgs.push(OMessage { role: "system".into(), content: s, images: None });
    }
    msgs.push(OMessage { role: "user".into(), content: req.prompt, images: Some(images) });
    let (messages, images) = chat_messages(msgs, limits)?;
    request(messages, images, req.common, limits).map(Some)
}

/// Ollama's answer to a request without input: the model is loaded.
fn loaded(state: &AppState, field: &str) -> Value {
    let mut v = json!({"model": state.cfg.model_name, "created_at": now(), "done": true, "done_reason": "load"});
    v[field] = if field == "message" { json!({"role": "assistant", "content": ""}) } else { json!("") };
    v
}

fn chat_messages(list: Vec<OMessage>, limits: &Limits) -> Result<(Vec<Message>, Vec<Media>), ApiError> {
    let (mut out, mut images) = (vec![], vec![]);
    for (i, m) in list.into_iter().enumerate() {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant") {
            return Err(ApiError::bad(F, format!("messages[{i}].role must be system, user or assistant, got {:?}", m.role)));
        }
        // Images first, then the text: the order Qwen's own examples use.
        let mut parts = vec![];
        for (j, b64) in m.images.unwrap_or_default().iter().enumerate() {
            media::check_count(images.len() + 1, limits).map_err(|e| ApiError::bad(F, e))?;
            let img = media::from_base64(b64, &format!("messages[{i}].images[{j}]"), limits).map_err(|e| ApiError::bad(F, e))?;
            images.push(Media::Image(img));
            parts.push(ContentPart::Image);
        }
        parts.push(ContentPart::Text(m.content));
        out.push(Message::new(m.role, parts));
    }
    Ok((out, images))
}

fn request(messages: Vec<Message>, images: Vec<Media>, common: Common, limits: &Limits) -> Result<Checked, ApiError> {
    let o = common.options.unwrap_or_default();
    let asked = match o.num_predict {
        None | Some(-1) | Some(-2) => None,
        Some(n) if n <= 0 => return Err(ApiError::bad(F, format!("options.num_predict must be positive, -1 or -2, got {n}"))),
        Some(n) => Some(n as usize),
    };
    let sampling = SamplingParams {
        temperature: o.temperature.unwrap_or(0.8),
        top_p: o.top_p.unwrap_or(0.9),
        top_k: o.top_k.unwrap_or(40),
        seed: o.seed.unwrap_or(0) as u64,
        max_new_tokens: token_budget(F, asked, limits, "options.num_predict")?,
        ..Default::default()
    };
    sampling.validate().map_err(|e| ApiError::setting(F, e))?;
    let mut chat = ChatRequest::new(messages, images, sampling);
    chat.schema = match common.format {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s.is_empty() => None,
        Some(Value::String(s)) if s == "json" => Some(json!({"type": "object"})),
        Some(f @ Value::Object(_)) => Some(f),
        Some(other) => return Err(ApiError::bad(F, format!("format must be \"json\" or a JSON schema object, got {other}"))),
    };
    let opts = OutputOptions { stop: o.stop.unwrap_or_default(), logprobs: false };
    Ok(Checked { chat, opts, stream: common.stream.unwrap_or(true) })
}

#[derive(Clone, Copy)]
enum Kind {
    Chat,
    Generate,
}

impl Kind {
    /// One NDJSON object carrying `text`.
    fn part(self, model: &str, text: &str) -> Value {
        match self {
            Kind::Chat => json!({"model": model, "created_at": now(), "message": {"role": "assistant", "content": text}, "done": false}),
            Kind::Generate => json!({"model": model, "created_at": now(), "response": text, "done": false}),
        }
    }

    fn last(self, model: &str, text: &str, s: &Summary) -> Value {
        let mut v = self.part(model, text);
        let ns = |d: std::time::Duration| d.as_nanos() as u64;
        let fields = json!({
            "done": true, "done_reason": s.finish,
            "total_duration": ns(s.total_time), "load_duration": 0,
            "prompt_eval_count": s.prompt_tokens, "prompt_eval_duration": ns(s.prompt_time),
            "eval_count": s.completion_tokens, "eval_duration": ns(s.total_time.saturating_sub(s.prompt_time)),
        });
        v.as_object_mut().expect("object").extend(fields.as_object().expect("object").clone());
        v
    }
}

async fn respond(state: Arc<AppState>, c: Checked, kind: Kind) -> Result<Response, ApiError> {
    let rx = generation::start(&state, F, c.chat, c.opts).await?;
    let model = state.cfg.model_name.clone();
    if !c.stream {
        let out = generation::collect(rx, F).await?;
        return Ok(Json(kind.last(&model, &out.text, &out.summary)).into_response());
    }
    let lines = stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|ev| (ev, rx)) }).map(move |ev| {
        let v = match ev {
            GenEvent::Delta { text, .. } => kind.part(&model, &text),
            GenEvent::Done(s) => kind.last(&model, "", &s),
            GenEvent::Failed(e) => ApiError::engine(F, e).body(),
        };
        Ok::<_, Infallible>(Bytes::from(format!("{v}\n")))
    });
    Ok(([(header::CONTENT_TYPE, "application/x-ndjson")], Body::from_stream(lines)).into_response())
}

fn now() -> String {
    humantime::format_rfc3339_nanos(SystemTime::now()).to_string()
}

fn details(state: &AppState) -> Value {
    let i = &state.cfg.info;
    json!({
        "parent_model": "", "format": "safetensors", "family": i.family, "families": [i.family],
        "parameter_size": "", "quantization_level": i.dtype.to_uppercase(),
    })
}

pub async fn tags(State(state): State<Arc<AppState>>) -> Json<Value> {
    let name = &state.cfg.model_name;
    let modified = humantime::format_rfc3339_seconds(state.started).to_string();
    let mut entry = json!({"name": name, "model": name, "modified_at": modified, "size": state.cfg.info.weight_bytes, "details": details(&state)});
    if let Some(d) = &state.cfg.info.digest {
        entry["digest"] = json!(d);
    }
    Json(json!({ "models": [entry] }))
}

#[derive(Deserialize)]
pub struct ShowReq {
    #[serde(alias = "name")]
    pub model: String,
}

pub async fn show(State(state): State<Arc<AppState>>, RequestBody(body): RequestBody) -> Result<Json<Value>, ApiError> {
    let req: ShowReq = parse_json(F, &body)?;
    state.check_model(F, &req.model)?;
    let spec = state.handle.model_spec();
    let arch = &state.cfg.info.family;
    let mut caps = vec!["completion"];
    if spec.vision.is_some() {
        caps.push("vision");
    }
    Ok(Json(json!({
        "modelfile": format!("# served by merg\nFROM {}\n", state.cfg.model_name),
        "parameters": "",
        "template": state.cfg.info.chat_template,
        "details": details(&state),
        "model_info": {
            "general.architecture": arch,
            format!("{arch}.context_length"): state.handle.preparer().max_context(),
            format!("{arch}.embedding_length"): spec.hidden_size,
            format!("{arch}.block_count"): spec.layers.len(),
            format!("{arch}.vocab_size"): spec.vocab_size,
        },
        "capabilities": caps,
        "modified_at": humantime::format_rfc3339_seconds(state.started).to_string(),
    })))
}

pub async fn version() -> Json<Value> {
    Json(json!({"version": env!("CARGO_PKG_VERSION")}))
}
