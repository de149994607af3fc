//! The engine: one loaded model, one KV pool, a block manager with prefix caching, a
//! scheduler, and a vision-feature cache, driven one packed step at a time. It sees the model
//! only through the `Model` trait and its `ModelSpec`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::Context;
use candle_core::Tensor;
use serde::Serialize;

use super::block_manager::{BlockManager, CacheStats};
use super::error::{too_big, EngineError, EngineResult};
use super::kv_pool::{num_blocks_for, KvMemory, KvPool, GLOBAL, SLIDING};
use super::kv_store::{KvDtype, KvStore};
use super::paged_attention::{PagedStep, RunSlots, SeqRun};
use super::sliding::SlidingGroup;
use super::request::{check_prompt_len, placeholder_keys, ChatRequest, PreparedMedia, PreparedRequest, RequestPreparer};
use super::scheduler::{Scheduler, SchedulerConfig};
use super::sequence::{SeqId, Sequence, Status};
use super::vision_cache::{lock, VisionCache};
use crate::checkpoint::Checkpoint;
use crate::generate::{FinishReason, NonFiniteLogits, Sampler, SamplingParams, TokenConstraint};
use crate::models::{AudioSpec, Deepstack, Model, PromptInputs, RecurrentState};
use crate::tokenizer::SpecialTokens;
use super::state_cache::StateCache;

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
    /// Hybrid models: bytes for live recurrent states (one slot per running sequence) and,
    /// as much again, for prefix-cache snapshots. Default: a quarter of the KV pool's bytes.
    pub state_memory: Option<u64>,
    /// How K/V rows are stored: the model's dtype, or 8-bit codes (about half of bf16).
    pub kv_dtype: KvDtype,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            kv_memory: KvMemory::Auto,
            prefix_caching: true,
            scheduler: SchedulerConfig::default(),
            vision_cache_entries: 64,
            max_context: None,
            state_memory: None,
            kv_dtype: KvDtype::Auto,
        }
    }
}

impl EngineConfig {
    /// Each count against its rule, and the context window the engine will hold requests to
    /// (`model_context`, the model's own, when none is set and the model is known): a window
    /// of 0 is named as such, not found later as a KV pool with no room.
    pub fn validate(&self, model_context: Option<usize>) -> Result<(), crate::setting::InvalidSetting> {
        use crate::setting::{at_least_one, InvalidSetting};
        at_least_one("block_size", self.block_size)?;
        at_least_one("max_num_seqs", self.scheduler.max_num_seqs)?;
        at_least_one("max_step_tokens", self.scheduler.max_step_tokens)?;
        match self.max_context {
            Some(n) => at_least_one("max_context", n),
            None if model_context == Some(0) => Err(InvalidSetting::new("max_context", 0, "at least 1").from_origin("the model's own context length")),
            None => Ok(()),
        }
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
    pub late_preprocessing: u64,
    pub steps: u64,
    /// Reads of a tensor back to the host in the step path: one per step that samples.
    pub readbacks: u64,
    pub times: Times,
    pub preemptions: u64,
    /// Blocks of the global attention layers (every layer's, for models without sliding ones).
    pub num_blocks: usize,
    /// Blocks not held by a request in flight (cached-but-unreferenced blocks count as free).
    pub free_blocks: usize,
    /// The sliding-window layers' blocks, and those of them free (0 without such layers).
    pub window_blocks: usize,
    pub free_window_blocks: usize,
    pub block_size: usize,
    /// Requests queued but not yet admitted (the engine's queue depth).
    pub waiting: usize,
    /// Requests being prefilled or decoded.
    pub running: usize,
    /// Most sequences running at once (hybrid models: the recurrent-state slots).
    pub state_slots: usize,
    /// Hybrid models with prefix caching: recurrent-state snapshots.
    pub snapshots: Option<crate::engine::state_cache::SnapshotStats>,
}

/// What one step produced: every token sampled (in step order) and the requests that ended.
#[derive(Default)]
pub struct StepOutput {
    pub tokens: Vec<(SeqId, u32, f32)>,
    pub finished: Vec<(SeqId, Completion)>,
    /// Requests that failed alone (e.g. the model produced NaN logits for them); their
    /// blocks are already freed and the engine goes on with the others.
    pub failed: Vec<(SeqId, EngineError)>,
}

pub struct Engine {
    model: Arc<dyn Model>,
    preparer: RequestPreparer,
    pool: KvPool,
    /// Blocks of the global attention layers.
    bm: BlockManager,
    /// Blocks of the sliding-window layers (models with such layers).
    sliding: Option<SlidingGroup>,
    scheduler: Scheduler,
    seqs: HashMap<SeqId, Sequence>,
    vision_cache: Arc<Mutex<VisionCache>>,
    next_id: SeqId,
    steps: u64,
    preemptions: u64,
    /// Media items the engine thread had to preprocess itself (a cached item evicted between
    /// preparation and admission); normally 0.
    late_preprocessing: u64,
    /// Where the weights came from, for errors that implicate them.
    origin: String,
    /// Hybrid models with prefix caching: recurrent-state snapshots.
    states: Option<StateCache>,
    /// Tensors read back to the host by the step code (`sampling::read_back`).
    readbacks: u64,
    times: Times,
}

/// Where an engine's wall time went, in seconds: admitting requests (preprocessing, the
/// vision tower, prompt embeddings), steps that computed prompt tokens (prefill, possibly
/// with decode tokens beside them), and steps that only decoded.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Times {
    pub admit_s: f64,
    pub prefill_steps_s: f64,
    pub decode_steps_s: f64,
}

impl Engine {
    pub fn new(ckpt: Checkpoint, cfg: EngineConfig) -> anyhow::Result<Self> {
        let model = ckpt.model.clone();
        let origin = ckpt.origin();
        let spec = model.spec();
        cfg.validate(Some(spec.max_context))?;
        let max_tokens = (cfg.scheduler.max_num_seqs as u64).saturating_mul(cfg.max_context.unwrap_or(spec.max_context) as u64);
        let store = KvStore::resolve(cfg.kv_dtype, model.dtype());
        let n = num_blocks_for(&cfg.kv_memory, spec, cfg.block_size, store, model.device(), max_tokens)?;
        let max_context = cfg.max_context.unwrap_or(spec.max_context);
        // `n` blocks of every layer's K/V: the budget the two pool groups share.
        let load = super::kv_pool::Load { max_seqs: cfg.scheduler.max_num_seqs, step_tokens: cfg.scheduler.max_step_tokens, context: max_context };
        let groups = super::kv_pool::split(n as u64 * super::kv_pool::bytes_per_block(spec, cfg.block_size, store), &cfg.kv_memory, spec, cfg.block_size, store, load)?;
        let pool = KvPool::new(spec, groups, cfg.block_size, store, model.device()).context("allocating the KV pool")?;
        let sliding = spec.sliding_window().map(|w| SlidingGroup::new(groups[SLIDING], cfg.block_size, cfg.prefix_caching, w));
        let vision_cache = Arc::new(Mutex::new(VisionCache::new(cfg.vision_cache_entries)));
        let preparer = RequestPreparer::new(ckpt.processor.clone(), vision_cache.clone(), ckpt.tokenizer_json.clone(), max_context);
        // K/V blocks alone cannot restore a recurrent layer's state: a hybrid model's cached
        // prefixes also need its state snapshots (kept only while prefix caching is on).
        let (states, scheduler_cfg) = state_budget(&cfg, spec, n as u64 * crate::engine::kv_pool::bytes_per_block(spec, cfg.block_size, store))?;
        let prefix_caching = cfg.prefix_caching;
        let states = states.filter(|_| prefix_caching);
        Ok(Engine {
            model,
            preparer,
            pool,
            // Part of a block only where the pool's rows are a sequence's whole state.
            bm: BlockManager::new(groups[GLOBAL], cfg.block_size, prefix_caching).with_partial_reuse(states.is_none() && sliding.is_none()),
            sliding,
            scheduler: Scheduler::new(scheduler_cfg),
            states,
            seqs: HashMap::new(),
            vision_cache,
            next_id: 0,
            steps: 0,
            readbacks: 0,
            times: Times::default(),
            preemptions: 0,
            late_preprocessing: 0,
            origin,
        })
    }

    pub fn model(&self) -> &Arc<dyn Model> {
        &self.model
    }

    /// Caller-side request preparation (clone it into any thread).
    pub fn preparer(&self) -> &RequestPreparer {
        &self.preparer
    }

    pub fn stats(&self) -> EngineStats {
        let vc = self.vision_cache.lock().map(|v| (v.hits, v.misses)).unwrap_or_default();
        EngineStats {
            prefix: self.bm.stats().clone(),
            vision_hits: vc.0,
            vision_misses: vc.1,
            late_preprocessing: self.late_preprocessing,
            steps: self.steps,
            readbacks: self.readbacks,
            times: self.times,
            // Finished sequences' preemptions plus those of sequences still in flight.
            preemptions: self.preemptions + self.seqs.values().map(|s| s.preemptions as u64).sum::<u64>(),
            num_blocks: self.pool.num_blocks[GLOBAL],
            free_blocks: self.bm.num_available(),
            window_blocks: self.pool.num_blocks[SLIDING],
            free_window_blocks: self.sliding.as_ref().map_or(0, |g| g.bm.num_available()),
            block_size: self.pool.block_size,
            waiting: self.scheduler.counts().0,
            running: self.scheduler.counts().1,
            state_slots: self.scheduler.cfg.max_num_seqs,
            snapshots: self.states.as_ref().map(|s| s.stats().clone()),
        }
    }

    /// Context window requests are held to.
    pub fn max_context(&self) -> usize {
        self.preparer.max_context()
    }

    /// Hybrid models: the recurrent-state budget in one line (slots, snapshot memory), for a
    /// start-up report; `None` for models without recurrent layers.
    /// The KV pool's size, for start-up logs.
    pub fn kv_summary(&self) -> String {
        let ([blocks, window], bs) = (self.pool.num_blocks, self.pool.block_size);
        let [g, s] = crate::engine::kv_pool::group_bytes_per_block(self.model.spec(), bs, self.pool.store());
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let sliding = match window {
            0 => String::new(),
            _ => format!(" + {window} blocks of the sliding-window layers ({:.2} GiB)", gib(window as u64 * s)),
        };
        let q8 = if self.pool.store() == KvStore::Q8 { ", 8-bit" } else { "" };
        format!("KV cache: {blocks} blocks of {bs} tokens ({:.2} GiB, {} tokens{q8}){sliding}", gib(blocks as u64 * g), blocks * bs)
    }

    /// Blocks a request in flight holds in each pool group (global, sliding).
    pub fn blocks_held(&self, id: SeqId) -> Option<[usize; 2]> {
        self.seqs.get(&id).map(|s| [s.table.len(), SlidingGroup::held(&s.window_table)])
    }

    pub fn state_summary(&self) -> Option<String> {
        let spec = self.model.spec();
        spec.has_recurrent_layers().then(|| {
            let per = state_bytes_per_seq(spec) as f64 / 1048576.0;
            let snaps = match &self.states {
                Some(s) => format!("{:.1} MiB for prefix-cache snapshots", s.stats().budget as f64 / 1048576.0),
                None => "no snapshots (prefix caching off)".into(),
            };
            format!("recurrent state: {} slots of {per:.1} MiB (at most {} running sequences), {snaps}", self.scheduler.cfg.max_num_seqs, self.scheduler.cfg.max_num_seqs)
        })
    }

    pub fn num_free_blocks(&self) -> usize {
        self.bm.num_available()
    }

    pub fn has_pending(&self) -> bool {
        !self.scheduler.is_idle()
    }

    /// Prepares (on this thread) and queues a request. Fails for this request only.
    pub fn add_request(&mut self, req: ChatRequest) -> EngineResult<SeqId> {
        let t0 = std::time::Instant::now();
        let prepared = self.preparer.prepare(req);
        let id = prepared.and_then(|p| self.add_prepared(p));
        self.times.admit_s += t0.elapsed().as_secs_f64();
        id
    }

    /// Encodes the request's media (images, videos, audio clips) through the media cache, builds
    /// its decoder inputs and queues it.
    pub fn add_prepared(&mut self, p: PreparedRequest) -> EngineResult<SeqId> {
        let (mut grids, mut feats, mut audio) = (vec![], vec![], vec![]);
        for (i, m) in p.media.iter().enumerate() {
            let f = self.media_features(m).map_err(|e| EngineError::BadRequest(format!("media item {i}: {e:#}")))?;
            match m.grid.is_audio() {
                true => audio.push(f),
                false => {
                    grids.push(m.grid.clone());
                    feats.push(f);
                }
            }
        }
        let inputs = self.model.prepare_prompt_with_audio(&p.ids, &grids, &feats, &audio).map_err(EngineError::bad_request)?;
        let spec = self.model.spec();
        let keys: Vec<u64> = p.media.iter().map(|m| m.key).collect();
        let tokens: Vec<usize> = p
            .media
            .iter()
            .map(|m| match (&spec.vision, m.grid.is_audio()) {
                (_, true) => AudioSpec::tokens(m.grid.audio_frames),
                (Some(v), false) => v.tokens(&m.grid),
                (None, false) => 0,
            })
            .collect();
        let audio_tok = self.model.audio_spec().map_or(SpecialTokens::NONE, |a| a.token);
        let placeholders = [spec.special.image, spec.special.video, audio_tok];
        let extra = placeholder_keys(&p.ids, &placeholders, &keys, &tokens);
        self.add_inputs(p.ids, extra, inputs, p.sampling, p.constraint)
    }

    /// Encoder features of one item (vision tower, or audio tower for a clip): from the cache,
    /// else encoded (and cached).
    fn media_features(&mut self, m: &PreparedMedia) -> anyhow::Result<Tensor> {
        if let Some((f, _)) = lock(&self.vision_cache)?.get(m.key) {
            return Ok(f);
        }
        let item;
        let patches = match (&m.patches, &m.source) {
            (Some(p), _) => p,
            (None, Some(src)) => {
                self.late_preprocessing += 1;
                item = self.preparer.processor.preprocess(src)?;
                &item.patches
            }
            (None, None) => anyhow::bail!("neither patches nor source pixels"),
        };
        let input = patches.to_tensor(self.model.device())?;
        let f = match m.grid.is_audio() {
            true => self.model.encode_audio(&input)?,
            false => self.model.encode_media(&input, &m.grid)?,
        };
        lock(&self.vision_cache)?.insert(m.key, f.clone(), m.grid.clone());
        Ok(f)
    }

    /// Queues decoder inputs directly (benchmarks and tests drive the engine this way).
    pub fn add_inputs(
        &mut self,
        ids: Vec<u32>,
        extra: Vec<u64>,
        inputs: PromptInputs,
        sampling: SamplingParams,
        constraint: Option<Box<dyn TokenConstraint>>,
    ) -> EngineResult<SeqId> {
        sampling.validate().map_err(EngineError::bad)?;
        check_prompt_len(ids.len(), self.max_context())?;
        let needed = self.bm.blocks_needed(0, ids.len() + 1);
        if needed > self.pool.num_blocks[GLOBAL] {
            return Err(too_big(needed, self.pool.num_blocks[GLOBAL], ids.len(), self.model.spec()));
        }
        let id = self.next_id;
        self.next_id += 1;
        let recurrent = match self.model.spec().has_recurrent_layers() {
            true => vec![RecurrentState::default(); self.model.spec().layers.len()],
            false => vec![],
        };
        let snap_hint = ids_after_last_media(&ids, self.model.spec());
        let seq = Sequence {
            id,
            prompt_len: ids.len(),
            tokens: ids,
            extra,
            prompt_embeds: inputs.embeds,
            prompt_positions: inputs.positions,
            prompt_deepstack: inputs.deepstack,
            prompt_spans: inputs.bidirectional,
            rope_delta: inputs.rope_delta,
            num_computed: 0,
            table: vec![],
            window_table: vec![],
            recurrent,
            snap_hint,
            snap_at: vec![],
            status: Status::Waiting,
            sampler: Sampler::new(sampling.clone()),
            params: sampling,
            constraint,
            logprobs: vec![],
            finish: None,
            cached_tokens: 0,
            admitted_once: false,
            preemptions: 0,
            max_context: self.max_context(),
        };
        self.seqs.insert(id, seq);
        self.scheduler.add(id);
        Ok(id)
    }

    /// One scheduling step: the tokens it sampled and the requests that finished in it. A
    /// failed step is an internal error (every request in flight is affected).
    pub fn step(&mut self) -> EngineResult<StepOutput> {
        let t0 = std::time::Instant::now();
        let (out, prefill) = self.step_inner().map_err(EngineError::internal)?;
        let t = t0.elapsed().as_secs_f64();
        match prefill {
            true => self.times.prefill_steps_s += t,
            false => self.times.decode_steps_s += t,
        }
        Ok(out)
    }

    /// The step's output, and whether it computed prompt tokens.
    fn step_inner(&mut self) -> anyhow::Result<(StepOutput, bool)> {
        let (chunks, overflow) = self.scheduler.schedule(&mut self.seqs, &mut self.bm, self.states.as_mut(), self.sliding.as_mut());
        for cp in chunks.iter().filter_map(|c| c.copy) {
            let copied = self.pool.copy_rows(cp.src, cp.dst, cp.rows, self.model.device());
            // The source block was referenced for the copy alone.
            let _ = self.bm.free(&[cp.src]);
            copied?;
        }
        let mut out = StepOutput::default();
        for id in overflow {
            // Too large for the pool even alone: end it with what it has.
            if let Some(s) = self.seqs.get_mut(&id) {
                s.finish = Some(FinishReason::Length);
            }
            out.finished.push(self.finish(id)?);
        }
        if chunks.is_empty() {
            return Ok((out, false));
        }
        let prefill = chunks.iter().any(|c| c.len > 1);
        self.steps += 1;
        let model = self.model.clone();
        let dev = model.device().clone();
        let mut embeds = Vec::with_capacity(chunks.len());
        let mut deepstack = vec![];
        let mut positions: [Vec<i64>; 3] = [vec![], vec![], vec![]];
        let mut runs = Vec::with_capacity(chunks.len());
        let mut write_slots: [Vec<u32>; 2] = [vec![], vec![]];
        let mut start = 0;
        for c in &chunks {
            let s = self.seqs.get_mut(&c.seq).expect("scheduled");
            let (a, b) = (s.num_computed, s.num_computed + c.len);
            embeds.push(seq_embeds(s, a, b, &*model)?);
            if let Some(d) = &s.prompt_deepstack {
                deepstack.extend(d.slice(a, b, start)?);
            }
            let p = s.positions(a, b, |past, n, d| model.decode_positions(past, n, d));
            for k in 0..3 {
                positions[k].extend_from_slice(&p[k]);
            }
            let mut groups = [None, None];
            for (g, table, first) in SlidingGroup::tables(self.sliding.as_ref(), s) {
                write_slots[g].extend(self.pool.slots(table, a, b));
                groups[g] = Some(RunSlots::new(first, self.pool.slots(table, first, b), &dev)?);
            }
            let recurrent = std::mem::take(&mut s.recurrent);
            runs.push(SeqRun { start, len: c.len, past: a, groups, recurrent, spans: s.spans_in(a, b) });
            start += c.len;
        }
        let embeds = Tensor::cat(&embeds, 0)?;
        let write_index = [Some(self.pool.write_index(&write_slots[GLOBAL], &dev)?), self.sliding.as_ref().map(|_| self.pool.write_index(&write_slots[SLIDING], &dev)).transpose()?];
        let mut step = PagedStep::new(&self.pool, runs, write_index);
        let deepstack = Deepstack::concat(deepstack)?;
        let hidden = model.forward(&embeds, &positions, deepstack.as_ref(), &mut step);
        // Give each sequence its recurrent state back, whatever the forward did.
        for (c, r) in chunks.iter().zip(step.runs.drain(..)) {
            self.seqs.get_mut(&c.seq).expect("scheduled").recurrent = r.recurrent;
        }
        let hidden = hidden?;
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
            // Commit before release: the window's blocks given back stay in the prefix cache.
            if let Some(g) = self.sliding.as_mut() {
                g.bm.commit(&s.window_table, &s.tokens, &extra, s.num_computed);
                g.release(&mut s.window_table, s.num_computed, &s.prompt_spans);
            }
            if let Some(st) = self.states.as_mut().filter(|_| s.snap_at.contains(&s.num_computed)) {
                if let Some(&key) = self.bm.block_hashes(&s.tokens[..s.num_computed], &extra).last() {
                    st.insert(key, &s.recurrent);
                }
            }
        }
        if !rows.is_empty() {
            let idx = Tensor::new(rows.as_slice(), &dev)?;
            let logits = model.logits(&hidden.index_select(&idx, 0)?)?;
            let vocab = model.spec().vocab_size;
            let mut by_id: HashMap<SeqId, &mut Sequence> = self.seqs.iter_mut().filter(|(id, _)| samplers.contains(id)).map(|(id, s)| (*id, s)).collect();
            let mut seqs: Vec<&mut Sequence> = samplers.iter().map(|id| by_id.remove(id).expect("scheduled")).collect();
            let picked = super::sampling::sample_rows(&logits, &mut seqs, vocab, &mut self.readbacks);
            drop(seqs);
            for (id, res) in samplers.into_iter().zip(picked) {
                match res {
                    Ok((tok, lp, done)) => {
                        out.tokens.push((id, tok, lp));
                        if done {
                            out.finished.push(self.finish(id)?);
                        }
                    }
                    // This request fails alone; the others in the step go on.
                    Err(e) => {
                        let err = match e.downcast_ref::<NonFiniteLogits>() {
                            Some(_) => EngineError::Internal(format!("{e}: the model {} may be corrupt (NaN weights?)", self.origin)),
                            None => EngineError::internal(e.context("sampling")),
                        };
                        self.finish(id)?;
                        out.failed.push((id, err));
                    }
                }
            }
        }
        Ok((out, prefill))
    }

    /// Ends a request now, keeping what it generated (`FinishReason::Aborted`); `None` when it
    /// is not in flight (already finished, or never queued).
    pub fn abort(&mut self, id: SeqId) -> Option<Completion> {
        let s = self.seqs.get_mut(&id)?;
        s.finish = Some(FinishReason::Aborted);
        self.finish(id).ok().map(|(_, c)| c)
    }

    fn finish(&mut self, id: SeqId) -> anyhow::Result<(SeqId, Completion)> {
        let s = self.seqs.remove(&id).context("finishing an unknown sequence")?;
        self.scheduler.remove_finished(id);
        if !s.table.is_empty() {
            // Its last, partly filled block stays reusable in part.
            self.bm.commit_tail(&s.table, &s.tokens, &s.extra_keys(), s.num_computed);
            self.bm.free(&s.table).map_err(|e| anyhow::anyhow!("freeing blocks of sequence {id}: {e:?}"))?;
        }
        if let Some(g) = self.sliding.as_mut() {
            g.bm.free(&s.window_table).map_err(|e| anyhow::anyhow!("freeing sliding-window blocks of sequence {id}: {e:?}"))?;
        }
        self.preemptions += s.preemptions as u64;
        let text = self.preparer.processor.tokenizer.decode(s.generated(), true)?;
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
    pub fn run_all(&mut self, reqs: Vec<ChatRequest>) -> Vec<EngineResult<Completion>> {
        let mut order: Vec<EngineResult<SeqId>> = reqs.into_iter().map(|r| self.add_request(r)).collect();
        let mut results: HashMap<SeqId, EngineResult<Completion>> = HashMap::new();
        while self.has_pending() {
            match self.step() {
                Ok(out) => {
                    results.extend(out.finished.into_iter().map(|(id, c)| (id, Ok(c))));
                    results.extend(out.failed.into_iter().map(|(id, e)| (id, Err(e))));
                }
                Err(e) => return order.drain(..).map(|_| Err(e.clone())).collect(),
            }
        }
        order
            .drain(..)
            .map(|r| r.and_then(|id| results.remove(&id).unwrap_or_else(|| Err(EngineError::Internal(format!("request {id} vanished"))))))
            .collect()
    }
}

/// Embeddings of tokens `a..b`: the stored prompt embeddings, then plain token embeddings for
/// generated tokens.
fn seq_embeds(s: &Sequence, a: usize, b: usize, model: &dyn Model) -> anyhow::Result<Tensor> {
    let mut parts = vec![];
    let p_end = b.min(s.prompt_len);
    if a < p_end {
        parts.push(s.prompt_embeds.narrow(0, a, p_end - a)?);
    }
    let g = a.max(s.prompt_len);
    if g < b {
        parts.push(model.embed_tokens(&s.tokens[g..b])?);
    }
    Ok(if parts.len() == 1 { parts.pop().expect("one part") } else { Tensor::cat(&parts, 0)? })
}

/// Token count after the last vision-end token of a prompt (the end of the media a prompt
/// shares with its siblings), if it has media.
fn ids_after_last_media(ids: &[u32], spec: &crate::models::ModelSpec) -> Option<usize> {
    spec.has_recurrent_layers().then_some(())?;
    ids.iter().rposition(|&t| t == spec.special.vision_end).map(|i| i + 1)
}

pub use crate::models::cost::state_bytes_per_seq;

/// Hybrid models: the snapshot cache and the scheduler limited to the state slots that fit.
fn state_budget(cfg: &EngineConfig, spec: &crate::models::ModelSpec, kv_bytes: u64) -> anyhow::Result<(Option<StateCache>, crate::engine::SchedulerConfig)> {
    let mut sched = cfg.scheduler.clone();
    if !spec.has_recurrent_layers() {
        return Ok((None, sched));
    }
    let per = state_bytes_per_seq(spec).max(1);
    let mem = cfg.state_memory.unwrap_or(kv_bytes / 4);
    let slots = (mem / per) as usize;
    if slots == 0 {
        anyhow::bail!("state memory of {mem} bytes holds no sequence's recurrent state ({per} bytes each)");
    }
    sched.max_num_seqs = sched.max_num_seqs.min(slots);
    Ok((Some(StateCache::new(mem)), sched))
}
