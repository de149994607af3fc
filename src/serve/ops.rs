//! Operations: the API-key check and request log around every route, `/health`, and
//! `/metrics` in Prometheus text format (requests by route and status, tokens in and out,
//! prompt tokens served from the prefix cache, queue depth, KV blocks in use).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::{json, Value};
use subtle::ConstantTimeEq;

use super::generation::Summary;
use super::{ApiError, AppState, Flavor};

#[derive(Default)]
pub struct Metrics {
    requests: Mutex<BTreeMap<(String, u16), u64>>,
    completions: AtomicU64,
    prompt_tokens: AtomicU64,
    cached_tokens: AtomicU64,
    generated_tokens: AtomicU64,
}

impl Metrics {
    pub fn record_completion(&self, s: &Summary) {
        self.record(1, s.prompt_tokens, s.cached_tokens, s.completion_tokens);
    }

    /// `n` generations with these token totals (a pipeline run counts each agent call).
    pub fn record(&self, n: usize, prompt: usize, cached: usize, generated: usize) {
        self.completions.fetch_add(n as u64, Ordering::Relaxed);
        self.prompt_tokens.fetch_add(prompt as u64, Ordering::Relaxed);
        self.cached_tokens.fetch_add(cached as u64, Ordering::Relaxed);
        self.generated_tokens.fetch_add(generated as u64, Ordering::Relaxed);
    }

    fn record_request(&self, route: &str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((route.to_string(), status)).or_default() += 1;
        }
    }
}

/// The API flavor a path's clients expect errors in.
pub(crate) fn flavor_of(path: &str) -> Flavor {
    if path.starts_with("/api/") {
        Flavor::Ollama
    } else {
        Flavor::OpenAi
    }
}

/// Whether the request carries the server's API key (`Authorization: Bearer <key>`),
/// compared in constant time.
fn authorized(headers: &HeaderMap, key: &str) -> bool {
    let Some(given) = headers.get(header::AUTHORIZATION).and_then(|v| v.to_str().ok()) else { return false };
    let given = given.strip_prefix("Bearer ").unwrap_or("");
    bool::from(given.as_bytes().ct_eq(key.as_bytes()))
}

/// Around every route: the API-key check (all but `/health`), one log line, the counters.
pub async fn guard(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let route = req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_string()).unwrap_or_else(|| "unmatched".into());
    let method = req.method().clone();
    let resp = match &state.cfg.api_key {
        Some(key) if route != "/health" && !authorized(req.headers(), key) => {
            ApiError::new(flavor_of(&route), 401, "missing or wrong API key (send Authorization: Bearer <key>)").into_response()
        }
        _ => match declared_len(&req) {
            Some(len) if len > state.cfg.limits.max_body_bytes => too_large(req, len, state.cfg.limits.max_body_bytes, flavor_of(&route)).await,
            _ => next.run(req).await,
        },
    };
    let status = resp.status().as_u16();
    state.metrics.record_request(&route, status);
    tracing::info!(%method, route, status, ms = started.elapsed().as_secs_f64() * 1e3, "request");
    resp
}

/// The body length the request declares (`Content-Length`).
fn declared_len(req: &Request) -> Option<usize> {
    req.headers().get(axum::http::header::CONTENT_LENGTH)?.to_str().ok()?.parse().ok()
}

/// 413 for a body declared larger than `limit`, after reading and dropping what the client
/// sends (up to 4× the limit, for 5 s): closing a connection with unread bytes makes the
/// kernel reset it, and a client still sending then sees the reset instead of the 413.
async fn too_large(req: Request, len: usize, limit: usize, flavor: Flavor) -> Response {
    use futures_util::StreamExt;
    if len <= limit.saturating_mul(4) {
        let mut body = req.into_body().into_data_stream();
        let _ = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            let mut read = 0usize;
            while let Some(Ok(chunk)) = body.next().await {
                read += chunk.len();
                if read > len {
                    break;
                }
            }
        })
        .await;
    }
    ApiError::too_large(flavor, limit).into_response()
}

pub async fn health(State(state): State<Arc<AppState>>) -> Json<Value> {
    Json(json!({"status": "ok", "model": state.cfg.model_name, "in_flight": state.in_flight()}))
}

pub async fn not_found(req: Request) -> ApiError {
    ApiError::new(flavor_of(req.uri().path()), 404, format!("no endpoint {} {}", req.method(), req.uri().path()))
}

pub async fn metrics(State(state): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let handle = state.handle.clone();
    let stats = tokio::task::spawn_blocking(move || handle.stats())
        .await
        .map_err(|e| ApiError::new(Flavor::OpenAi, 500, e.to_string()))?
        .map_err(|e| ApiError::engine(Flavor::OpenAi, e))?;
    let m = &state.metrics;
    let mut out = String::new();
    let mut metric = |name: &str, kind: &str, help: &str, samples: Vec<(String, u64)>| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (labels, v) in samples {
            let _ = writeln!(out, "{name}{labels} {v}");
        }
    };
    let requests: Vec<(String, u64)> = m
        .requests
        .lock()
        .map(|r| r.iter().map(|((route, status), n)| (format!("{{route=\"{route}\",status=\"{status}\"}}"), *n)).collect())
        .unwrap_or_default();
    let one = |v: u64| vec![(String::new(), v)];
    let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
    metric("merg_requests_total", "counter", "HTTP requests by route and status.", requests);
    metric("merg_generations_total", "counter", "Generations that ran to an end.", one(load(&m.completions)));
    metric("merg_prompt_tokens_total", "counter", "Prompt tokens of finished generations.", one(load(&m.prompt_tokens)));
    metric("merg_prompt_tokens_cached_total", "counter", "Prompt tokens served from the prefix cache.", one(load(&m.cached_tokens)));
    metric("merg_generated_tokens_total", "counter", "Tokens generated.", one(load(&m.generated_tokens)));
    metric("merg_requests_in_flight", "gauge", "Requests accepted and not yet finished.", one(state.in_flight() as u64));
    metric("merg_engine_waiting", "gauge", "Requests queued in the engine, not yet admitted.", one(stats.waiting as u64));
    metric("merg_engine_running", "gauge", "Requests being prefilled or decoded.", one(stats.running as u64));
    metric("merg_kv_blocks_total", "gauge", "KV pool blocks (of the global attention layers).", one(stats.num_blocks as u64));
    let used = stats.num_blocks.saturating_sub(stats.free_blocks) as u64;
    metric("merg_kv_blocks_used", "gauge", "KV pool blocks held by requests in flight.", one(used));
    if stats.window_blocks > 0 {
        metric("merg_kv_window_blocks_total", "gauge", "KV pool blocks of the sliding-window layers.", one(stats.window_blocks as u64));
        let used = stats.window_blocks.saturating_sub(stats.free_window_blocks) as u64;
        metric("merg_kv_window_blocks_used", "gauge", "Sliding-window blocks held by requests in flight.", one(used));
    }
    metric("merg_engine_steps_total", "counter", "Engine steps.", one(stats.steps));
    metric("merg_preemptions_total", "counter", "Requests preempted for KV blocks.", one(stats.preemptions));
    metric("merg_vision_cache_hits_total", "counter", "Media encodings reused.", one(stats.vision_hits));
    Ok(([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response())
}
