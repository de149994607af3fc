//! The engine: one loaded model, one KV pool, a block manager with prefix caching, a
//! scheduler, and a vision-feature cache, driven one packed step at a time.

use std::collections::HashMap;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::Tensor;
use serde::Serialize;

use super::block_manager::{BlockManager, CacheStats};
use super::constraint::ConstraintFactory;
use super::kv_pool::{num_blocks_for, KvMemory, KvPool};
use super::paged_attention::{PagedStep, SeqRun};
use super::scheduler::{Scheduler, SchedulerConfig};
use super::sequence::{SeqId, Sequence, Status};
use super::vision_cache::{content_hash, VisionCache};
use crate::chat::Message;
use crate::generate::{sample_step, FinishReason, Sampler, SamplingParams, TokenConstraint};
use crate::models::position::rope_index;
use crate::runtime::{Media, Runtime};

#[derive(Clone, Debug)]
pub struct EngineConfig {
    pub block_size: usize,
    pub kv_memory: KvMemory,
    pub prefix_caching: bool,
    pub scheduler: SchedulerConfig,
    /// Vision features kept (entries).
    pub vision_cache_entries: usize,
    /// Context window (default: the model's).
    pub max_context: Option<usize>,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            kv_memory: KvMemory::Fraction(0.5),
            prefix_caching: true,
            scheduler: SchedulerConfig::default(),
            vision_cache_entries: 64,
            max_context: None,
        }
    }
}

/// A chat request: messages, their media in placeholder order, sampling, and optionally a JSON
/// schema the output must follow (or any other token constraint).
pub struct ChatRequest {
    pub messages: Vec<Message>,
    pub media: Vec<Media>,
    pub sampling: SamplingParams,
    /// Compiled by the engine's `ConstraintFactory` (built from the checkpoint's tokenizer).
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

#[derive(Clone, Debug, Serialize)]
pub struct Completion {
    pub text: String,
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub finish: FinishReason,
    pub prompt_tokens: usize,
    /// Prompt tokens whose K/V came from the prefix cache.
    pub cached_tokens: usize,
    pub preemptions: usize,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct EngineStats {
    pub prefix: CacheStats,
    pub vision_hits: u64,
    pub vision_misses: u64,
    pub steps: u64,
    pub preemptions: u64,
    pub num_blocks: usize,
    pub block_size: usize,
}

pub struct Engine {
    pub runtime: Runtime,
    pool: KvPool,
    bm: BlockManager,
    scheduler: Scheduler,
    seqs: HashMap<SeqId, Sequence>,
    vision_cache: VisionCache,
    next_id: SeqId,
    /// Built on the first schema request (the token trie takes a moment), then shared.
    constraints: Option<Arc<ConstraintFactory>>,
    steps: u64,
    preemptions: u64,
    max_context: usize,
}

impl Engine {
    pub fn new(runtime: Runtime, cfg: EngineConfig) -> Result<Self> {
        let m = &runtime.model;
        let n = num_blocks_for(&cfg.kv_memory, &m.cfg.text, cfg.block_size, m.dtype(), m.device())?;
        let pool = KvPool::new(&m.cfg.text, n, cfg.block_size, m.dtype(), m.device()).context("allocating the KV pool")?;
        let max_context = cfg.max_context.unwrap_or(m.cfg.text.max_position_embeddings);
        Ok(Engine {
            pool,
            bm: BlockManager::new(n, cfg.block_size, cfg.prefix_caching),
            scheduler: Scheduler::new(cfg.scheduler.clone()),
            seqs: HashMap::new(),
            vision_cache: VisionCache::new(cfg.vision_cache_entries),
            next_id: 0,
            constraints: None,
            steps: 0,
            preemptions: 0,
            max_context,
            runtime,
        })
    }

    pub fn stats(&self) -> EngineStats {
        EngineStats {
            prefix: self.bm.stats().clone(),
            vision_hits: self.vision_cache.hits,
            vision_misses: self.vision_cache.misses,
            steps: self.steps,
            // Finished sequences' preemptions plus those of sequences still in flight.
            preemptions: self.preemptions + self.seqs.values().map(|s| s.preemptions as u64).sum::<u64>(),
            num_blocks: self.pool.num_blocks,
            block_size: self.pool.block_size,
        }
    }

    /// Uses `f` for JSON schemas (needed when the runtime has no tokenizer file, e.g. dummy
    /// weights with a separate tokenizer).
    pub fn set_constraint_factory(&mut self, f: Arc<ConstraintFactory>) {
        self.constraints = Some(f);
    }

    fn constraint_factory(&mut self) -> Result<Arc<ConstraintFactory>> {
        if let Some(f) = &self.constraints {
            return Ok(f.clone());
        }
        let files = self.runtime.files.as_ref().context("a JSON schema needs the tokenizer file: this runtime has none (set_constraint_factory)")?;
        let stop = self.runtime.tokenizer.special().im_end;
        let f = Arc::new(ConstraintFactory::from_tokenizer_json(&files.tokenizer, stop)?);
        self.constraints = Some(f.clone());
        Ok(f)
    }

    /// Context window requests are held to.
    pub fn max_context(&self) -> usize {
        self.max_context
    }

    pub fn num_free_blocks(&self) -> usize {
        self.bm.num_available()
    }

    pub fn has_pending(&self) -> bool {
        !self.scheduler.is_idle()
    }

    /// Tokenizes, preprocesses and encodes media (through the vision cache, which skips both
    /// for a known image), then queues the
    /// request. Fails for this request only (bad media, too long, larger than the pool).
    pub fn add_request(&mut self, mut req: ChatRequest) -> Result<SeqId> {
        if let Some(schema) = req.schema.take() {
            if req.constraint.is_some() {
                bail!("a request takes a JSON schema or a constraint, not both");
            }
            req.constraint = Some(Box::new(self.constraint_factory()?.json_schema(&schema)?));
        }
        let rt = &self.runtime;
        crate::runtime::check_placeholders(&req.messages, &req.media)?;
        let mut image_feats = vec![];
        let mut video_feats = vec![];
        let mut hashes = (vec![], vec![]);
        let mut grids = Vec::with_capacity(req.media.len());
        for m in &req.media {
            let key = content_hash(m);
            // A cached item needs neither preprocessing nor the vision tower.
            let (feats, grid) = match self.vision_cache.get(key) {
                Some(hit) => hit,
                None => {
                    let item = rt.preprocess_one(m)?;
                    let p = item.patches.to_tensor(rt.model.device())?;
                    let f = rt.model.vision.forward(&p, &[item.grid.thw])?;
                    self.vision_cache.insert(key, f.clone(), item.grid.clone());
                    (f, item.grid)
                }
            };
            if grid.is_video {
                video_feats.push(feats);
                hashes.1.push(key);
            } else {
                image_feats.push(feats);
                hashes.0.push(key);
            }
            grids.push(grid);
        }
        let ids = rt.encode_prompt_grids(&req.messages, &grids)?;
        let cat = |v: &[Tensor]| -> Result<Option<Tensor>> { Ok(if v.is_empty() { None } else { Some(Tensor::cat(v, 0)?) }) };
        let (positions, rope_delta) = rope_index(&ids, &grids, &rt.model.cfg)?;
        let embeds = rt.model.merge_features(&ids, cat(&image_feats)?.as_ref(), cat(&video_feats)?.as_ref())?;
        let extra = placeholder_keys(&ids, rt.model.cfg.image_token_id, rt.model.cfg.video_token_id, &hashes.0, &hashes.1);
        let mut sampling = req.sampling;
        if sampling.stop_token_ids.is_empty() {
            sampling.stop_token_ids = rt.tokenizer.stop_token_ids();
        }
        self.add_prepared(ids, extra, embeds, positions, rope_delta, sampling, req.constraint)
    }

    /// Queues already-prepared inputs (benchmarks and tests drive the engine this way).
    #[allow(clippy::too_many_arguments)]
    pub fn add_prepared(
        &mut self,
        ids: Vec<u32>,
        extra: Vec<u64>,
        prompt_embeds: Tensor,
        prompt_positions: [Vec<i64>; 3],
        rope_delta: i64,
        sampling: SamplingParams,
        constraint: Option<Box<dyn TokenConstraint>>,
    ) -> Result<SeqId> {
        sampling.validate()?;
        if ids.is_empty() {
            bail!("empty prompt");
        }
        if ids.len() >= self.max_context {
            bail!("prompt is {} tokens but the context window is {}", ids.len(), self.max_context);
        }
        let needed = self.bm.blocks_needed(0, ids.len() + 1);
        if needed > self.pool.num_blocks {
            bail!(
                "request needs {needed} KV blocks for its {}-token prompt but the whole pool has {} (raise --kv-memory)",
                ids.len(),
                self.pool.num_blocks
            );
        }
        let id = self.next_id;
        self.next_id += 1;
        let seq = Sequence {
            id,
            prompt_len: ids.len(),
            tokens: ids,
            extra,
            prompt_embeds,
            prompt_positions,
            rope_delta,
            num_computed: 0,
            table: vec![],
            status: Status::Waiting,
            sampler: Sampler::new(sampling.clone()),
            params: sampling,
            constraint,
            logprobs: vec![],
            finish: None,
            cached_tokens: 0,
            admitted_once: false,
            preemptions: 0,
            max_context: self.max_context,
        };
        self.seqs.insert(id, seq);
        self.scheduler.add(id);
        Ok(id)
    }

    /// One scheduling step; returns the requests that finished in it.
    pub fn step(&mut self) -> Result<Vec<(SeqId, Completion)>> {
        let (chunks, overflow) = self.scheduler.schedule(&mut self.seqs, &mut self.bm);
        let mut done = vec![];
        for id in overflow {
            // Too large for the pool even alone: end it with what it has.
            if let Some(s) = self.seqs.get_mut(&id) {
                s.finish = Some(FinishReason::Length);
            }
            done.push(self.finish(id)?);
        }
        if chunks.is_empty() {
            return Ok(done);
        }
        self.steps += 1;
        let model = &self.runtime.model;
        let dev = model.device().clone();
        let mut embeds = Vec::with_capacity(chunks.len());
        let mut positions: [Vec<i64>; 3] = [vec![], vec![], vec![]];
        let mut runs = Vec::with_capacity(chunks.len());
        let mut write_slots = vec![];
        let mut start = 0;
        for c in &chunks {
            let s = &self.seqs[&c.seq];
            let (a, b) = (s.num_computed, s.num_computed + c.len);
            embeds.push(seq_embeds(s, a, b, model)?);
            let p = s.positions(a, b);
            for k in 0..3 {
                positions[k].extend_from_slice(&p[k]);
            }
            write_slots.extend(self.pool.slots(&s.table, a, b));
            let ctx = self.pool.slots(&s.table, 0, b);
            runs.push(SeqRun { start, len: c.len, context_slots: Tensor::new(ctx, &dev)? });
            start += c.len;
        }
        let embeds = Tensor::cat(&embeds, 0)?;
        let write_index = self.pool.write_index(&write_slots, &dev)?;
        let mut step = PagedStep::new(&self.pool, runs, write_index);
        let hidden = model.text.forward(&embeds, &positions, &mut step)?;
        // Rows whose sequence reaches its last token this step get sampled.
        let mut rows = vec![];
        let mut samplers = vec![];
        let mut offset = 0;
        for c in &chunks {
            let s = &self.seqs[&c.seq];
            if s.num_computed + c.len == s.tokens.len() {
                rows.push((offset + c.len - 1) as u32);
                samplers.push(c.seq);
            }
            offset += c.len;
        }
        for c in &chunks {
            let s = self.seqs.get_mut(&c.seq).expect("scheduled");
            s.num_computed += c.len;
            let extra = s.extra_keys();
            self.bm.commit(&s.table, &s.tokens, &extra, s.num_computed);
        }
        if !rows.is_empty() {
            let idx = Tensor::new(rows.as_slice(), &dev)?;
            let logits = model.text.logits(&hidden.index_select(&idx, 0)?)?;
            let vocab = model.cfg.text.vocab_size;
            for (i, id) in samplers.into_iter().enumerate() {
                let s = self.seqs.get_mut(&id).expect("scheduled");
                if sample_next(s, &logits.get(i)?, vocab)? {
                    done.push(self.finish(id)?);
                }
            }
        }
        Ok(done)
    }

    fn finish(&mut self, id: SeqId) -> Result<(SeqId, Completion)> {
        let s = self.seqs.remove(&id).context("finishing an unknown sequence")?;
        self.scheduler.remove_finished(id);
        if !s.table.is_empty() {
            self.bm.free(&s.table).map_err(|e| anyhow::anyhow!("freeing blocks of sequence {id}: {e:?}"))?;
        }
        self.preemptions += s.preemptions as u64;
        let text = self.runtime.tokenizer.decode(s.generated(), true)?;
        Ok((
            id,
            Completion {
                text,
                tokens: s.generated().to_vec(),
                logprobs: s.logprobs,
                finish: s.finish.unwrap_or(FinishReason::Length),
                prompt_tokens: s.prompt_len,
                cached_tokens: s.cached_tokens,
                preemptions: s.preemptions,
            },
        ))
    }

    /// Runs requests to completion; results in request order (a bad request fails alone).
    pub fn run_all(&mut self, reqs: Vec<ChatRequest>) -> Vec<Result<Completion>> {
        let mut order: Vec<Result<SeqId>> = reqs.into_iter().map(|r| self.add_request(r)).collect();
        let mut results: HashMap<SeqId, Completion> = HashMap::new();
        while self.has_pending() {
            match self.step() {
                Ok(done) => results.extend(done),
                Err(e) => return order.drain(..).map(|_| Err(anyhow::anyhow!("engine step failed: {e:#}"))).collect(),
            }
        }
        order
            .drain(..)
            .map(|r| r.and_then(|id| results.remove(&id).context("request vanished")))
            .collect()
    }
}

/// Embeddings of tokens `a..b`: the stored prompt embeddings, then plain token embeddings for
/// generated tokens.
fn seq_embeds(s: &Sequence, a: usize, b: usize, model: &crate::models::QwenVl) -> Result<Tensor> {
    let mut parts = vec![];
    let p_end = b.min(s.prompt_len);
    if a < p_end {
        parts.push(s.prompt_embeds.narrow(0, a, p_end - a)?);
    }
    let g = a.max(s.prompt_len);
    if g < b {
        parts.push(model.text.embed(&s.tokens[g..b])?);
    }
    Ok(if parts.len() == 1 { parts.pop().expect("one part") } else { Tensor::cat(&parts, 0)? })
}

/// Samples one token; returns true when the sequence is finished.
fn sample_next(s: &mut Sequence, logits: &Tensor, vocab: usize) -> Result<bool> {
    let (generated, total) = (s.generated().len() + 1, s.tokens.len() + 1);
    let (tok, lp, finish) =
        sample_step(&mut s.sampler, s.constraint.as_deref_mut(), logits, vocab, generated, total, s.max_context)?;
    s.tokens.push(tok);
    s.logprobs.push(lp);
    s.finish = finish;
    Ok(finish.is_some())
}

/// Per-token extra keys: the content hash of the media item each placeholder run stands for.
fn placeholder_keys(ids: &[u32], image_tok: u32, video_tok: u32, images: &[u64], videos: &[u64]) -> Vec<u64> {
    let (mut ii, mut vi) = (0, 0);
    let mut out = vec![0u64; ids.len()];
    let mut i = 0;
    while i < ids.len() {
        let t = ids[i];
        if t != image_tok && t != video_tok {
            i += 1;
            continue;
        }
        let key = if t == image_tok { ii += 1; images.get(ii - 1) } else { vi += 1; videos.get(vi - 1) };
        let key = key.copied().unwrap_or(u64::MAX);
        while i < ids.len() && ids[i] == t {
            out[i] = key;
            i += 1;
        }
    }
    out
}
