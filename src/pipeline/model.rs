//! What the agents need from a model: one constrained chat call at a time, a prompt-length
//! count for context budgeting, and prefix-cache counters for the trace. The engine handle is
//! the real implementation; orchestration tests use a scripted double.

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Result;
use serde::Serialize;
use serde_json::Value;

use crate::chat::{ContentPart, Message};
use crate::engine::block_manager::CacheStats;
use crate::engine::{ChatRequest, Completion, EngineError, EngineHandle, Event};
use crate::generate::{FinishReason, SamplingParams};
use crate::vision::Media;

/// One agent call.
pub struct AgentCall {
    /// "mpa", "caef", "psp", "sgrg", "gra", "plain", "coe".
    pub agent: &'static str,
    pub round: usize,
    pub messages: Vec<Message>,
    pub media: Vec<Media>,
    pub schema: Value,
    pub sampling: SamplingParams,
}

#[derive(Clone, Debug, Serialize)]
pub struct AgentReply {
    pub text: String,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub ms: f64,
}

pub trait AgentModel: Send + Sync {
    fn call(&self, call: AgentCall) -> Result<AgentReply>;
    /// Prompt tokens for `messages` with these media (counted from their sizes and lengths,
    /// without preprocessing them).
    fn count_tokens(&self, messages: &[Message], media: &[Media]) -> Result<usize>;
    fn context_window(&self) -> usize;
    /// Byte length of the decoded text after each of `tokens` (non-decreasing), so a field of
    /// a JSON output can be mapped back to the tokens that produced it.
    fn decoded_offsets(&self, tokens: &[u32]) -> Result<Vec<usize>>;
    /// Prefix-cache counters so far (None when the model has no cache).
    fn cache_stats(&self) -> Option<CacheStats>;
    /// Seconds of audio one clip can hold; `None` for a model that does not hear (the default:
    /// a model that does not say it hears gets no audio).
    fn audio_window(&self) -> Option<f64> {
        None
    }
    /// Whether the model has an audio encoder.
    fn hears(&self) -> bool {
        self.audio_window().is_some()
    }
}

/// The real model: the paged engine behind its thread-safe handle. Token counting and
/// decoding run on the caller's thread with the handle's preparer, never between steps.
pub struct EngineModel {
    pub handle: EngineHandle,
    /// When set, the call in flight is aborted and later calls fail (a server's client went
    /// away, or the server is shutting down).
    cancel: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
}

impl EngineModel {
    pub fn new(handle: EngineHandle) -> Result<Self> {
        Ok(EngineModel { handle, cancel: None })
    }

    /// Calls stop as soon as `cancel` returns true (polled every 50 ms while a call runs).
    pub fn with_cancel(handle: EngineHandle, cancel: Arc<dyn Fn() -> bool + Send + Sync>) -> Self {
        EngineModel { handle, cancel: Some(cancel) }
    }

    fn complete(&self, req: ChatRequest) -> Result<Completion> {
        let Some(cancel) = &self.cancel else { return Ok(self.handle.generate(req)?) };
        let cancelled = || anyhow::anyhow!("the pipeline run was cancelled");
        if cancel() {
            return Err(cancelled());
        }
        let stream = self.handle.submit(req)?;
        loop {
            match stream.next_event_timeout(Duration::from_millis(50)) {
                Ok(Some(Event::Finished(c))) if c.finish != FinishReason::Aborted => return Ok(c),
                Ok(Some(Event::Finished(_))) => return Err(cancelled()),
                Ok(Some(Event::Error(e))) => return Err(e.into()),
                Ok(Some(Event::Token { .. })) => {}
                Ok(None) if cancel() => stream.abort(),
                Ok(None) => {}
                Err(_) => return Err(EngineError::ShutDown.into()),
            }
        }
    }
}

impl AgentModel for EngineModel {
    fn call(&self, call: AgentCall) -> Result<AgentReply> {
        let t = Instant::now();
        let req = ChatRequest::new(call.messages, call.media, call.sampling).with_schema(call.schema);
        let c = self.complete(req)?;
        Ok(AgentReply {
            text: c.text,
            tokens: c.tokens,
            logprobs: c.logprobs,
            finish: c.finish,
            prompt_tokens: c.prompt_tokens,
            cached_tokens: c.cached_tokens,
            ms: t.elapsed().as_secs_f64() * 1e3,
        })
    }

    fn count_tokens(&self, messages: &[Message], media: &[Media]) -> Result<usize> {
        let p = self.handle.preparer();
        p.processor.check_text_fits(messages, p.max_context())?;
        p.processor.count_tokens_with(messages, media)
    }

    fn context_window(&self) -> usize {
        self.handle.preparer().max_context()
    }

    fn decoded_offsets(&self, tokens: &[u32]) -> Result<Vec<usize>> {
        // Same decoding as the engine's completion text (special tokens skipped).
        let tok = &self.handle.preparer().processor.tokenizer;
        token_offsets(tokens, |t| tok.decode(t, true))
    }

    fn cache_stats(&self) -> Option<CacheStats> {
        self.handle.stats().ok().map(|s| s.prefix)
    }

    fn audio_window(&self) -> Option<f64> {
        self.handle.preparer().processor.audio_window()
    }
}

/// Decoded byte length after each token. Incremental decoding can shrink by a few bytes while a
/// multi-byte character is incomplete; the running maximum keeps offsets monotone.
pub fn token_offsets(tokens: &[u32], decode: impl Fn(&[u32]) -> Result<String>) -> Result<Vec<usize>> {
    let mut out = Vec::with_capacity(tokens.len());
    let mut hi = 0;
    for i in 1..=tokens.len() {
        hi = hi.max(decode(&tokens[..i])?.len());
        out.push(hi);
    }
    Ok(out)
}

/// Log-probs of the tokens that produced the string value of the last `"reply"` field in a
/// JSON output (tokens straddling its quotes included; the stop token and the JSON wrapper
/// excluded), so perplexity measures the reply, whatever schema carried it.
pub fn reply_logprobs(raw: &str, offsets: &[usize], logprobs: &[f32]) -> Vec<f32> {
    let key = "\"reply\":\"";
    let Some(k) = raw.rfind(key) else { return vec![] };
    let start = k + key.len();
    // The value ends at the first unescaped quote after it.
    let bytes = raw.as_bytes();
    let mut end = start;
    while end < bytes.len() && bytes[end] != b'"' {
        end += if bytes[end] == b'\\' { 2 } else { 1 };
    }
    let end = end.min(raw.len());
    let mut prev = 0;
    let mut out = vec![];
    for (&off, &lp) in offsets.iter().zip(logprobs) {
        // Token i covers bytes prev..off of the decoded text.
        if off > start && prev < end {
            out.push(lp);
        }
        prev = off;
    }
    out
}

/// Characters of text in the messages (for trace summaries).
pub fn text_chars(messages: &[Message]) -> usize {
    messages
        .iter()
        .flat_map(|m| &m.content)
        .map(|p| match p {
            ContentPart::Text(t) => t.chars().count(),
            _ => 0,
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_span_excludes_wrapper_and_handles_escapes() {
        // Tokens: `{"reply":"` | `Hi` | ` \"x\"` | `!"}` | stop (decodes to nothing).
        let raw = r#"{"reply":"Hi \"x\"!"}"#;
        let ends = [10, 12, 18, raw.len(), raw.len()];
        let lps = [-1.0, -2.0, -3.0, -4.0, -5.0];
        assert_eq!(reply_logprobs(raw, &ends, &lps), vec![-2.0, -3.0, -4.0]);
        // Chain-of-Empathy output: only the last "reply" field counts.
        let coe = r#"{"event":"a","reply":"ok"}"#;
        let ends: Vec<usize> = (1..=coe.len()).collect();
        let lps: Vec<f32> = (0..coe.len()).map(|i| i as f32).collect();
        assert_eq!(reply_logprobs(coe, &ends, &lps), vec![22.0, 23.0]);
        assert!(reply_logprobs("{}", &[2], &[0.0]).is_empty());
    }

    #[test]
    fn offsets_are_monotone() {
        let dec = |t: &[u32]| Ok(if t.len() == 2 { "a".to_string() } else { "ab".repeat(t.len()) });
        assert_eq!(token_offsets(&[1, 2, 3], dec).unwrap(), vec![2, 2, 6]);
    }
}
