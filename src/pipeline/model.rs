//! What the agents need from a model: one constrained chat call at a time, a prompt-length
//! count for context budgeting, and prefix-cache counters for the trace. The engine handle is
//! the real implementation; orchestration tests use a scripted double.

use std::time::Instant;

use anyhow::Result;
use serde::Serialize;
use serde_json::Value;

use crate::chat::{ContentPart, Message};
use crate::engine::block_manager::CacheStats;
use crate::engine::{ChatRequest, EngineHandle};
use crate::generate::{FinishReason, SamplingParams};
use crate::runtime::Media;

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
    pub generated_tokens: usize,
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub ms: f64,
}

pub trait AgentModel: Send + Sync {
    fn call(&self, call: AgentCall) -> Result<AgentReply>;
    /// Prompt tokens for `messages` whose images have the given (frames, height, width).
    fn count_tokens(&self, messages: &[Message], media_dims: &[(usize, usize, usize)]) -> Result<usize>;
    fn context_window(&self) -> usize;
    /// Prefix-cache counters so far (None when the model has no cache).
    fn cache_stats(&self) -> Option<CacheStats>;
}

/// (frames, height, width) of each media item.
pub fn media_dims(media: &[Media]) -> Vec<(usize, usize, usize)> {
    media
        .iter()
        .map(|m| match m {
            Media::Image(i) => (1, i.height() as usize, i.width() as usize),
            Media::Video { frames, .. } => {
                let (h, w) = frames.first().map(|f| (f.height() as usize, f.width() as usize)).unwrap_or((0, 0));
                (frames.len(), h, w)
            }
        })
        .collect()
}

/// The real model: the paged engine behind its thread-safe handle.
pub struct EngineModel {
    pub handle: EngineHandle,
    context: usize,
}

impl EngineModel {
    pub fn new(handle: EngineHandle) -> Result<Self> {
        let context = handle.inspect(|e| e.max_context())?;
        Ok(EngineModel { handle, context })
    }
}

impl AgentModel for EngineModel {
    fn call(&self, call: AgentCall) -> Result<AgentReply> {
        let t = Instant::now();
        let req = ChatRequest::new(call.messages, call.media, call.sampling).with_schema(call.schema);
        let c = self.handle.generate(req)?;
        Ok(AgentReply {
            text: c.text,
            generated_tokens: c.tokens.len(),
            logprobs: c.logprobs,
            finish: c.finish,
            prompt_tokens: c.prompt_tokens,
            cached_tokens: c.cached_tokens,
            ms: t.elapsed().as_secs_f64() * 1e3,
        })
    }

    fn count_tokens(&self, messages: &[Message], media_dims: &[(usize, usize, usize)]) -> Result<usize> {
        let (m, d) = (messages.to_vec(), media_dims.to_vec());
        self.handle.inspect(move |e| e.runtime.count_prompt_tokens(&m, &d))?
    }

    fn context_window(&self) -> usize {
        self.context
    }

    fn cache_stats(&self) -> Option<CacheStats> {
        self.handle.stats().ok().map(|s| s.prefix)
    }
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
