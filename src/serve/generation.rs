//! One chat request from an HTTP handler to the engine and back. Preparation (template,
//! tokens, image preprocessing, schema compilation) runs on a blocking thread, so a bad request
//! is refused with its 4xx before any response starts. A forwarder thread then turns the
//! engine's events into text deltas on a channel the handler streams from; when the handler
//! goes away (the client disconnected) or the shutdown grace period ends, the forwarder aborts
//! the request, so the engine stops spending steps and KV blocks on it.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

use super::text::{IncrementalDecoder, StopMatcher};
use super::{ApiError, AppState, Flavor, Slot};
use crate::engine::{ChatRequest, Completion, EngineError, Event, RequestStream};
use crate::generate::FinishReason;

/// Output options beyond sampling.
#[derive(Clone, Debug, Default)]
pub struct OutputOptions {
    /// Strings that end generation; they are not part of the output.
    pub stop: Vec<String>,
    /// Return each generated token's log-probability.
    pub logprobs: bool,
}

#[derive(Clone, Debug)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
}

/// What the handler receives.
#[derive(Debug)]
pub enum GenEvent {
    /// New output text and the log-probs of the tokens that produced it.
    Delta { text: String, logprobs: Vec<TokenLogprob> },
    Done(Summary),
    Failed(EngineError),
}

#[derive(Clone, Debug)]
pub struct Summary {
    /// "stop", "length" or "abort" (cancelled at shutdown).
    pub finish: &'static str,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    /// Time from submission to the first token, and in total.
    pub prompt_time: Duration,
    pub total_time: Duration,
}

/// A whole (non-streamed) answer.
pub struct Collected {
    pub text: String,
    pub logprobs: Vec<TokenLogprob>,
    pub summary: Summary,
}

/// Prepares and submits `req`; the receiver yields its deltas, then `Done` or `Failed`.
pub async fn start(state: &Arc<AppState>, flavor: Flavor, req: ChatRequest, opts: OutputOptions) -> Result<UnboundedReceiver<GenEvent>, ApiError> {
    let slot = state.acquire(flavor)?;
    let handle = state.handle.clone();
    let submitted = Instant::now();
    let stream = tokio::task::spawn_blocking(move || handle.submit(req))
        .await
        .map_err(|e| ApiError::new(flavor, 500, format!("request preparation failed: {e}")))?
        .map_err(|e| ApiError::engine(flavor, e))?;
    let (tx, rx) = unbounded_channel();
    let st = state.clone();
    tokio::task::spawn_blocking(move || forward(&st, slot, stream, tx, opts, submitted));
    Ok(rx)
}

/// Runs the request to its end and returns the whole output.
pub async fn collect(mut rx: UnboundedReceiver<GenEvent>, flavor: Flavor) -> Result<Collected, ApiError> {
    let (mut text, mut logprobs) = (String::new(), vec![]);
    while let Some(ev) = rx.recv().await {
        match ev {
            GenEvent::Delta { text: t, logprobs: l } => {
                text.push_str(&t);
                logprobs.extend(l);
            }
            GenEvent::Done(summary) => return Ok(Collected { text, logprobs, summary }),
            GenEvent::Failed(e) => return Err(ApiError::engine(flavor, e)),
        }
    }
    Err(ApiError::new(flavor, 500, "the request ended without a result"))
}

/// The forwarder: engine events in, deltas out. Holds the queue slot until the request ends.
fn forward(state: &AppState, _slot: Slot, stream: RequestStream, tx: UnboundedSender<GenEvent>, opts: OutputOptions, submitted: Instant) {
    let tok = state.handle.preparer().processor.tokenizer.clone();
    let stop_ids = tok.stop_token_ids();
    let mut dec = IncrementalDecoder::new(tok.clone());
    let mut stops = StopMatcher::new(opts.stop);
    let mut pending: Vec<TokenLogprob> = vec![];
    let (mut aborted, mut first_token) = (false, None);
    loop {
        let ev = match stream.next_event_timeout(Duration::from_millis(50)) {
            Ok(ev) => ev,
            Err(_) => {
                let _ = tx.send(GenEvent::Failed(EngineError::ShutDown));
                return;
            }
        };
        if !aborted && (tx.is_closed() || state.cancelled()) {
            stream.abort();
            aborted = true;
        }
        match ev {
            None => {}
            Some(Event::Token { token, logprob }) => {
                first_token.get_or_insert_with(|| submitted.elapsed());
                if stops.is_stopped() {
                    continue;
                }
                if opts.logprobs && !stop_ids.contains(&token) {
                    pending.push(TokenLogprob { token: tok.decode(&[token], false).unwrap_or_default(), logprob });
                }
                let piece = match dec.push(token) {
                    Ok(p) => p,
                    Err(e) => {
                        let _ = tx.send(GenEvent::Failed(EngineError::internal(e)));
                        stream.abort();
                        return;
                    }
                };
                let text = stops.push(&piece).into_text();
                if stops.is_stopped() {
                    stream.abort();
                }
                if !text.is_empty() || stops.is_stopped() {
                    let _ = tx.send(GenEvent::Delta { text, logprobs: std::mem::take(&mut pending) });
                }
            }
            Some(Event::Finished(c)) => {
                let text = if stops.is_stopped() {
                    String::new()
                } else {
                    stops.push(&dec.finish().unwrap_or_default()).into_text() + &stops.flush()
                };
                if !text.is_empty() || !pending.is_empty() {
                    let _ = tx.send(GenEvent::Delta { text, logprobs: pending });
                }
                let summary = summarize(&c, stops.is_stopped(), first_token.unwrap_or_else(|| submitted.elapsed()), submitted.elapsed());
                state.metrics.record_completion(&summary);
                tracing::info!(
                    prompt_tokens = summary.prompt_tokens,
                    cached_tokens = summary.cached_tokens,
                    completion_tokens = summary.completion_tokens,
                    finish = summary.finish,
                    ms = summary.total_time.as_secs_f64() * 1e3,
                    "generation finished"
                );
                let _ = tx.send(GenEvent::Done(summary));
                return;
            }
            Some(Event::Error(e)) => {
                let _ = tx.send(GenEvent::Failed(e));
                return;
            }
        }
    }
}

fn summarize(c: &Completion, stopped_by_string: bool, prompt_time: Duration, total_time: Duration) -> Summary {
    Summary { finish: finish_reason(c.finish, stopped_by_string), prompt_tokens: c.prompt_tokens, cached_tokens: c.cached_tokens, completion_tokens: c.tokens.len(), prompt_time, total_time }
}

/// The API's finish reason. A stop string that cut the output makes it "stop" whatever the
/// engine reports: the engine runs ahead of this forwarder, so it may have reached the token
/// budget (or the context) before the abort sent at the match arrived.
fn finish_reason(engine: FinishReason, stopped_by_string: bool) -> &'static str {
    match engine {
        _ if stopped_by_string => "stop",
        FinishReason::Stop => "stop",
        FinishReason::Length | FinishReason::Context => "length",
        FinishReason::Aborted => "abort",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The race tests/serve.rs hit once in a dozen runs: the stop string matched, but the
    /// engine had already finished on the token budget.
    #[test]
    fn a_stop_string_match_is_a_stop_whatever_the_engine_reports() {
        for engine in [FinishReason::Stop, FinishReason::Length, FinishReason::Context, FinishReason::Aborted] {
            assert_eq!(finish_reason(engine, true), "stop", "{engine:?}");
        }
        assert_eq!(finish_reason(FinishReason::Length, false), "length");
        assert_eq!(finish_reason(FinishReason::Context, false), "length");
        assert_eq!(finish_reason(FinishReason::Aborted, false), "abort");
        assert_eq!(finish_reason(FinishReason::Stop, false), "stop");
    }
}

