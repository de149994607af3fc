//! The OpenAI chat API: `POST /v1/chat/completions` (text, inline `image_url` and `input_audio` parts,
//! sampling, stop strings, log-probs, `response_format` JSON schemas through the engine's
//! llguidance constraint, SSE streaming) and `GET /v1/models`.

use std::convert::Infallible;
use std::sync::Arc;

use axum::extract::State;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use futures_util::stream::{self, Stream, StreamExt};
use serde::Deserialize;
use serde_json::{json, Value};

use super::body::{parse_json, RequestBody};
use super::generation::{self, GenEvent, OutputOptions, Summary, TokenLogprob};
use super::{media, token_budget, ApiError, AppState, Flavor, Limits};
use crate::chat::{ContentPart, Message};
use crate::engine::ChatRequest;
use crate::generate::SamplingParams;
use crate::vision::Media;

const F: Flavor = Flavor::OpenAi;

#[derive(Deserialize)]
pub struct ChatCompletionRequest {
    pub model: String,
    pub messages: Vec<Value>,
    #[serde(default)]
    pub max_tokens: Option<usize>,
    #[serde(default)]
    pub max_completion_tokens: Option<usize>,
    #[serde(default)]
    pub temperature: Option<f64>,
    #[serde(default)]
    pub top_p: Option<f64>,
    #[serde(default)]
    pub seed: Option<i64>,
    #[serde(default)]
    pub stop: Option<Stop>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    #[serde(default)]
    pub response_format: Option<Value>,
    #[serde(default)]
    pub stream: Option<bool>,
    #[serde(default)]
    pub stream_options: Option<StreamOptions>,
    #[serde(default)]
    pub n: Option<u32>,
    #[serde(default)]
    pub tools: Option<Vec<Value>>,
    /// vLLM's extension for throughput benchmarks: generate `max_tokens` tokens even past
    /// the end-of-turn token.
    #[serde(default)]
    pub ignore_eos: bool,
}

#[derive(Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize, Default)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

pub async fn chat_completions(State(state): State<Arc<AppState>>, RequestBody(body): RequestBody) -> Result<Response, ApiError> {
    let req: ChatCompletionRequest = parse_json(F, &body)?;
    state.check_model(F, &req.model)?;
    let limits = state.cfg.limits.clone();
    // Images are decoded here: off the async workers.
    let checked = tokio::task::spawn_blocking(move || check(req, &limits))
        .await
        .map_err(|e| ApiError::new(F, 500, e.to_string()))??;
    let id = format!("chatcmpl-{}", state.next_id());
    let created = state.now_unix();
    if checked.chat.media.iter().any(Media::is_audio) && !state.handle.preparer().processor.hears() {
        let name = &state.cfg.model_name;
        return Err(ApiError::bad(F, format!("the request has input_audio parts, but the model {name} takes no audio")));
    }
    let want_logprobs = checked.opts.logprobs;
    let rx = generation::start(&state, F, checked.chat, checked.opts).await?;
    let ctx = Ctx { id, created, model: state.cfg.model_name.clone(), logprobs: want_logprobs };
    if checked.stream {
        return Ok(Sse::new(sse_stream(ctx, rx, checked.include_usage)).into_response());
    }
    let out = generation::collect(rx, F).await?;
    let body = json!({
        "id": ctx.id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": ctx.logprobs_json(&out.logprobs),
            "finish_reason": out.summary.finish,
        }],
        "usage": usage(&out.summary),
    });
    Ok(Json(body).into_response())
}

/// A chat completion request, checked: what the engine gets, and how to answer.
pub struct Checked {
    pub chat: ChatRequest,
    pub opts: OutputOptions,
    pub stream: bool,
    pub include_usage: bool,
}

/// Body bytes to the engine's request without a model or a server: everything the handler
/// checks but the model name. Any error is a 4xx (tests/fuzz's `serve_request` holds it to
/// that).
pub fn parse_request(body: &[u8], limits: &Limits) -> Result<Checked, ApiError> {
    check(parse_json(F, body)?, limits)
}

fn check(mut req: ChatCompletionRequest, limits: &Limits) -> Result<Checked, ApiError> {
    let stream = req.stream.unwrap_or(false);
    let include_usage = req.stream_options.as_ref().is_some_and(|o| o.include_usage);
    let opts = OutputOptions {
        stop: match req.stop.take().map(Stop::into_vec).unwrap_or_default() {
            v if v.len() > 4 => return Err(ApiError::bad(F, format!("stop takes at most 4 strings, got {}", v.len()))),
            v => v,
        },
        logprobs: req.logprobs.unwrap_or(false),
    };
    Ok(Checked { chat: build_request(req, limits)?, opts, stream, include_usage })
}

impl Stop {
    pub fn into_vec(self) -> Vec<String> {
        match self {
            Stop::One(s) => vec![s],
            Stop::Many(v) => v,
        }
    }
}

/// The engine request: messages with their images decoded, sampling, schema.
fn build_request(req: ChatCompletionRequest, limits: &Limits) -> Result<ChatRequest, ApiError> {
    if req.n.unwrap_or(1) != 1 {
        return Err(ApiError::bad(F, "n must be 1: one choice per request"));
    }
    if req.tools.as_ref().is_some_and(|t| !t.is_empty()) {
        return Err(ApiError::bad(F, "tools are not supported by this server"));
    }
    if req.top_logprobs.unwrap_or(0) > 0 {
        return Err(ApiError::bad(F, "top_logprobs is not supported: logprobs returns the sampled token's log-probability only"));
    }
    let max_tokens = token_budget(F, req.max_completion_tokens.or(req.max_tokens), limits, "max_tokens")?;
    let sampling = SamplingParams {
        temperature: req.temperature.unwrap_or(1.0),
        top_p: req.top_p.unwrap_or(1.0),
        seed: req.seed.unwrap_or(0) as u64,
        max_new_tokens: max_tokens,
        // No token id reaches u32::MAX, so nothing stops generation before max_tokens.
        stop_token_ids: if req.ignore_eos { vec![u32::MAX] } else { vec![] },
        ..Default::default()
    };
    sampling.validate().map_err(|e| ApiError::setting(F, e))?;
    let (messages, images) = messages(&req.messages, limits)?;
    let mut chat = ChatRequest::new(messages, images, sampling);
    chat.schema = req.response_format.as_ref().map(schema_of).transpose()?.flatten();
    Ok(chat)
}

/// The JSON schema `response_format` asks for, if any.
fn schema_of(rf: &Value) -> Result<Option<Value>, ApiError> {
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(json!({"type": "object"}))),
        Some("json_schema") => {
            let s = rf.pointer("/json_schema/schema").ok_or_else(|| ApiError::bad(F, "response_format json_schema needs json_schema.schema"))?;
            Ok(Some(s.clone()))
        }
        other => Err(ApiError::bad(F, format!("response_format.type must be text, json_object or json_schema, got {other:?}"))),
    }
}

/// OpenAI messages into chat messages plus their images and audio clips in placeholder order.
fn messages(list: &[Value], limits: &Limits) -> Result<(Vec<Message>, Vec<Media>), ApiError> {
    let (mut out, mut images) = (vec![], vec![]);
    for (i, m) in list.iter().enumerate() {
        let role = match m.get("role").and_then(Value::as_str) {
            Some("developer") => "system",
            Some(r @ ("system" | "user" | "assistant")) => r,
            other => return Err(ApiError::bad(F, format!("messages[{i}].role must be system, developer, user or assistant, got {other:?}"))),
        };
        let mut parts = vec![];
        match m.get("content") {
            Some(Value::String(s)) => parts.push(ContentPart::Text(s.clone())),
            Some(Value::Array(items)) => {
                for (j, p) in items.iter().enumerate() {
                    let at = format!("messages[{i}].content[{j}]");
                    match p.get("type").and_then(Value::as_str) {
                        Some("text") => {
                            let t = p.get("text").and_then(Value::as_str).ok_or_else(|| ApiError::bad(F, format!("{at}: a text part needs a string `text`")))?;
                            parts.push(ContentPart::Text(t.to_string()));
                        }
                        Some("image_url") => {
                            let url = p.pointer("/image_url/url").or_else(|| p.get("image_url")).and_then(Value::as_str);
                            let url = url.ok_or_else(|| ApiError::bad(F, format!("{at}: an image_url part needs image_url.url")))?;
                            let pictures = images.iter().filter(|m: &&Media| !m.is_audio()).count();
                            media::check_count(pictures + 1, limits).map_err(|e| ApiError::bad(F, e))?;
                            images.push(Media::Image(media::from_data_url(url, &at, limits).map_err(|e| ApiError::bad(F, e))?));
                            parts.push(ContentPart::Image);
                        }
                        Some("input_audio") => {
                            let clips = images.iter().filter(|m: &&Media| m.is_audio()).count();
                            media::check_audio_count(clips + 1, limits).map_err(|e| ApiError::bad(F, e))?;
                            let part = p.get("input_audio").ok_or_else(|| ApiError::bad(F, format!("{at}: an input_audio part needs input_audio.data and input_audio.format")))?;
                            images.push(Media::Audio(media::audio_from_part(part, &at).map_err(|e| ApiError::bad(F, e))?));
                            parts.push(ContentPart::Audio);
                        }
                        other => return Err(ApiError::bad(F, format!("{at}: part type must be text, image_url or input_audio, got {other:?}"))),
                    }
                }
            }
            Some(Value::Null) | None if role == "assistant" => {}
            _ => return Err(ApiError::bad(F, format!("messages[{i}].content must be a string or a list of parts"))),
        }
        out.push(Message::new(role, parts));
    }
    if out.is_empty() {
        return Err(ApiError::bad(F, "messages must not be empty"));
    }
    Ok((out, images))
}

struct Ctx {
    id: String,
    created: u64,
    model: String,
    logprobs: bool,
}

impl Ctx {
    fn logprobs_json(&self, lps: &[TokenLogprob]) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        let content: Vec<Value> = lps
            .iter()
            .map(|l| json!({"token": l.token, "logprob": l.logprob, "bytes": l.token.as_bytes(), "top_logprobs": []}))
            .collect();
        json!({ "content": content })
    }

    fn chunk(&self, delta: Value, logprobs: Value, finish: Option<&str>) -> Value {
        json!({
            "id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
        })
    }
}

fn usage(s: &Summary) -> Value {
    json!({
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "total_tokens": s.prompt_tokens + s.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": s.cached_tokens},
    })
}

/// Server-sent events: a role chunk, content chunks, a finish chunk, optionally a usage
/// chunk, then `[DONE]`. A failure mid-stream is sent as an error event.
fn sse_stream(
    ctx: Ctx,
    rx: tokio::sync::mpsc::UnboundedReceiver<GenEvent>,
    include_usage: bool,
) -> impl Stream<Item = Result<SseEvent, Infallible>> {
    let first = ctx.chunk(json!({"role": "assistant", "content": ""}), Value::Null, None);
    let head = stream::iter([Ok(SseEvent::default().data(first.to_string()))]);
    let ctx = Arc::new(ctx);
    let body = stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|ev| (ev, rx)) }).flat_map(move |ev| {
        let events: Vec<Value> = match ev {
            GenEvent::Delta { text, logprobs } => vec![ctx.chunk(json!({"content": text}), ctx.logprobs_json(&logprobs), None)],
            GenEvent::Done(s) => {
                let mut v = vec![ctx.chunk(json!({}), Value::Null, Some(s.finish))];
                if include_usage {
                    v.push(json!({"id": ctx.id, "object": "chat.completion.chunk", "created": ctx.created, "model": ctx.model, "choices": [], "usage": usage(&s)}));
                }
                v
            }
            GenEvent::Failed(e) => vec![ApiError::engine(F, e).body()],
        };
        stream::iter(events.into_iter().map(|v| Ok(SseEvent::default().data(v.to_string()))))
    });
    let done = stream::iter([Ok(SseEvent::default().data("[DONE]"))]);
    head.chain(body).chain(done)
}

pub async fn models(State(state): State<Arc<AppState>>) -> Json<Value> {
    let created = state.started.duration_since(std::time::SystemTime::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    Json(json!({
        "object": "list",
        "data": [{"id": state.cfg.model_name, "object": "model", "created": created, "owned_by": "merg"}],
    }))
}
