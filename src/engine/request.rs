//! Requests and their preparation. `RequestPreparer` does everything that needs no model
//! weights — chat template and tokens, media decoding and HF-equal preprocessing, compiling a
//! JSON schema — on the caller's thread, so the engine thread only encodes media it has not
//! seen and steps. A keyframe the vision cache already holds is not even preprocessed.

use std::sync::{Arc, Mutex, OnceLock};

use super::constraint::{ConstraintFactory, TokenizerJson};
use super::error::{EngineError, EngineResult};
use super::vision_cache::{content_hash, lock, VisionCache};
use crate::chat::Message;
use crate::generate::{SamplingParams, TokenConstraint};
use crate::models::MediaGrid;
use crate::processor::{check_placeholders, Processor};
use crate::vision::{Media, Patches};

/// A chat request: messages, their media in placeholder order, sampling, and optionally a JSON
/// schema the output must follow (or any other token constraint).
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub media: Vec<Media>,
    pub sampling: SamplingParams,
    /// Compiled with the checkpoint's tokenizer when the request is prepared.
    pub schema: Option<serde_json::Value>,
    /// A ready-made constraint instead of a schema.
    pub constraint: Option<Box<dyn TokenConstraint>>,
}

impl ChatRequest {
    pub fn new(messages: Vec<Message>, media: Vec<Media>, sampling: SamplingParams) -> Self {
        ChatRequest { messages, media, sampling, schema: None, constraint: None }
    }

    pub fn with_schema(mut self, schema: serde_json::Value) -> Self {
        self.schema = Some(schema);
        self
    }
}

/// One media item after preparation.
pub struct PreparedMedia {
    /// Content hash of the source (the vision-cache key and the prefix-cache extra key).
    pub key: u64,
    pub grid: MediaGrid,
    /// Patches, unless the vision cache held the item when the request was prepared.
    pub patches: Option<Patches>,
    /// The source, kept for a cached item in case the cache drops it before admission.
    pub source: Option<Media>,
}

/// A request the engine can queue without tokenizing or preprocessing anything.
pub struct PreparedRequest {
    pub ids: Vec<u32>,
    pub media: Vec<PreparedMedia>,
    pub sampling: SamplingParams,
    pub constraint: Option<Box<dyn TokenConstraint>>,
}

/// Caller-side preparation, shared by the engine and every handle (cheap to clone).
#[derive(Clone)]
pub struct RequestPreparer {
    pub processor: Processor,
    /// Shared with the engine: lets the caller skip preprocessing a cached item.
    vision_cache: Arc<Mutex<VisionCache>>,
    /// The tokenizer.json JSON schemas compile from, and the factory once built.
    tokenizer_json: Option<TokenizerJson>,
    constraints: Arc<OnceLock<Arc<ConstraintFactory>>>,
    max_context: usize,
}

impl RequestPreparer {
    pub(crate) fn new(
        processor: Processor,
        vision_cache: Arc<Mutex<VisionCache>>,
        tokenizer_json: Option<TokenizerJson>,
        max_context: usize,
    ) -> Self {
        RequestPreparer { processor, vision_cache, tokenizer_json, constraints: Arc::new(OnceLock::new()), max_context }
    }

    /// Context window requests are held to.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    /// Uses `f` for JSON schemas (needed when the checkpoint has no tokenizer file, e.g. dummy
    /// weights with a separate tokenizer). Ignored once a factory exists.
    pub fn set_constraint_factory(&self, f: Arc<ConstraintFactory>) {
        let _ = self.constraints.set(f);
    }

    fn constraint_factory(&self) -> EngineResult<Arc<ConstraintFactory>> {
        if let Some(f) = self.constraints.get() {
            return Ok(f.clone());
        }
        let source = self.tokenizer_json.as_ref().ok_or_else(|| {
            EngineError::bad("a JSON schema needs the checkpoint's tokenizer.json, and this engine has none")
        })?;
        let stop = self.processor.tokenizer.special().im_end;
        let f = Arc::new(ConstraintFactory::from_source(source, stop).map_err(EngineError::internal)?);
        Ok(self.constraints.get_or_init(|| f).clone())
    }

    /// Tokenizes, preprocesses media the vision cache lacks, compiles the schema. Fails for
    /// this request only.
    pub fn prepare(&self, mut req: ChatRequest) -> EngineResult<PreparedRequest> {
        req.sampling.validate().map_err(EngineError::bad)?;
        if let Some(schema) = req.schema.take() {
            if req.constraint.is_some() {
                return Err(EngineError::bad("a request takes a JSON schema or a constraint, not both"));
            }
            let c = self.constraint_factory()?.json_schema(&schema).map_err(EngineError::bad_request)?;
            req.constraint = Some(Box::new(c));
        }
        check_placeholders(&req.messages, &req.media).map_err(EngineError::bad_request)?;
        self.processor.check_text_fits(&req.messages, self.max_context).map_err(EngineError::bad_request)?;
        let mut media = Vec::with_capacity(req.media.len());
        for (i, m) in req.media.into_iter().enumerate() {
            media.push(self.prepare_media(m).map_err(|e| EngineError::BadRequest(format!("media item {i}: {e:#}")))?);
        }
        let grids: Vec<MediaGrid> = media.iter().map(|m| m.grid.clone()).collect();
        let ids = self.processor.encode_prompt(&req.messages, &grids).map_err(EngineError::bad_request)?;
        check_prompt_len(ids.len(), self.max_context)?;
        let mut sampling = req.sampling;
        if sampling.stop_token_ids.is_empty() {
            sampling.stop_token_ids = self.processor.tokenizer.stop_token_ids();
        }
        Ok(PreparedRequest { ids, media, sampling, constraint: req.constraint })
    }

    fn prepare_media(&self, m: Media) -> anyhow::Result<PreparedMedia> {
        let key = content_hash(&m);
        let cached = lock(&self.vision_cache)?.grid_of(key);
        Ok(match cached {
            Some(grid) => PreparedMedia { key, grid, patches: None, source: Some(m) },
            None => {
                let item = self.processor.preprocess(&m)?;
                PreparedMedia { key, grid: item.grid, patches: Some(item.patches), source: None }
            }
        })
    }
}

/// A prompt must be non-empty and leave room for at least one generated token.
pub(crate) fn check_prompt_len(len: usize, max_context: usize) -> EngineResult<()> {
    if len == 0 {
        return Err(EngineError::bad("empty prompt"));
    }
    if len >= max_context {
        return Err(EngineError::BadRequest(format!("prompt is {len} tokens but the context window is {max_context}")));
    }
    Ok(())
}

/// Per-token extra keys: the content hash of the media item each placeholder token stands
/// for (0 for text). Items are in prompt order and `tokens[k]` long; an item may span several
/// runs (a Qwen3-VL video: one run per time step). `placeholders` are the token ids that stand
/// for media (image, video, audio).
pub(super) fn placeholder_keys(ids: &[u32], placeholders: &[u32], keys: &[u64], tokens: &[usize]) -> Vec<u64> {
    let mut out = vec![0u64; ids.len()];
    let (mut item, mut left) = (0usize, tokens.first().copied().unwrap_or(0));
    for (i, &t) in ids.iter().enumerate() {
        if !placeholders.contains(&t) {
            continue;
        }
        while left == 0 && item + 1 < tokens.len() {
            item += 1;
            left = tokens[item];
        }
        // More placeholders than items describe: a distinct key keeps them out of any match.
        out[i] = if left > 0 { keys.get(item).copied().unwrap_or(u64::MAX) } else { u64::MAX };
        left = left.saturating_sub(1);
    }
    out
}
