//! One request in flight: its tokens, how many have K/V in the pool, its block table, its
//! recurrent-layer state, and its sampling state. Prompt embeddings (text + vision features)
//! are kept so a preempted sequence can be recomputed without running the vision tower again.

use candle_core::Tensor;

use super::block_manager::BlockId;
use crate::generate::{FinishReason, Sampler, SamplingParams, TokenConstraint};
use crate::models::{Deepstack, Positions, RecurrentState};

pub type SeqId = u64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    Waiting,
    Running,
    Finished,
}

pub struct Sequence {
    pub id: SeqId,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Per prompt token: content hash of the image/video it stands for (0 for text), so prefix
    /// cache keys differ when the media differ.
    pub extra: Vec<u64>,
    /// `[prompt_len, hidden]` embeddings with vision features spliced in.
    pub prompt_embeds: Tensor,
    pub prompt_positions: Positions,
    /// Qwen3-VL: features added inside the first decoder layers at the prompt's media rows.
    pub prompt_deepstack: Option<Deepstack>,
    /// `(first, len)` prompt runs that attend to each other in both directions (Gemma 3's
    /// images): a prefill chunk never ends inside one, or its first tokens would miss the rest.
    pub prompt_spans: Vec<(usize, usize)>,
    pub rope_delta: i64,
    /// Tokens whose K/V are in the pool (and whose effect is in the recurrent state).
    pub num_computed: usize,
    /// Blocks of the global attention layers (the pool's `GLOBAL` group).
    pub table: Vec<BlockId>,
    /// Blocks of the sliding-window layers (`SLIDING` group; empty without such layers),
    /// indexed like `table`, `RELEASED` before the window.
    pub window_table: Vec<BlockId>,
    /// One per model layer; only recurrent layers use theirs. Reset on preemption.
    pub recurrent: Vec<RecurrentState>,
    /// Hybrid models: where this prompt likely branches from others (after its last media
    /// item), so its recurrent state is worth a snapshot there.
    pub snap_hint: Option<usize>,
    /// Hybrid models: token counts (block boundaries, ascending) after which the recurrent
    /// state is snapshotted; prefill chunks end exactly there. Set at admission.
    pub snap_at: Vec<usize>,
    pub status: Status,
    pub params: SamplingParams,
    pub sampler: Sampler,
    pub constraint: Option<Box<dyn TokenConstraint>>,
    pub logprobs: Vec<f32>,
    pub finish: Option<FinishReason>,
    /// Prompt tokens served from the prefix cache at (first) admission.
    pub cached_tokens: usize,
    pub admitted_once: bool,
    pub preemptions: usize,
    /// Context window of the model (positions are capped by it).
    pub max_context: usize,
}

impl Sequence {
    pub fn generated(&self) -> &[u32] {
        &self.tokens[self.prompt_len..]
    }

    /// Tokens still to compute before the next sample.
    pub fn pending(&self) -> usize {
        self.tokens.len() - self.num_computed
    }

    /// Tokens to compute in the next chunk, at most `budget`, stopping at the next snapshot
    /// point so the state there can be kept.
    pub fn next_chunk(&self, budget: usize) -> usize {
        let n = self.pending().min(budget);
        let n = match self.snap_at.iter().find(|&&p| p > self.num_computed) {
            Some(&p) => n.min(p - self.num_computed),
            None => n,
        };
        self.whole_spans(n)
    }

    /// `n` moved so the chunk does not end inside a bidirectional span: back to the span's
    /// start, or, when the chunk starts inside it, on to its end (past the budget by less than
    /// one image).
    fn whole_spans(&self, n: usize) -> usize {
        let (from, end) = (self.num_computed, self.num_computed + n);
        match self.prompt_spans.iter().find(|&&(a, l)| a < end && end < a + l) {
            Some(&(a, _)) if a > from => a - from,
            Some(&(a, l)) => a + l - from,
            None => n,
        }
    }

    /// The bidirectional spans touching tokens `start..end`, as positions `(first, end)`.
    pub fn spans_in(&self, start: usize, end: usize) -> Vec<(usize, usize)> {
        self.prompt_spans.iter().filter(|&&(a, l)| a < end && a + l > start).map(|&(a, l)| (a, a + l)).collect()
    }

    /// Extra keys for all current tokens (generated tokens are text: 0).
    pub fn extra_keys(&self) -> Vec<u64> {
        let mut e = self.extra.clone();
        e.resize(self.tokens.len(), 0);
        e
    }

    /// Positions of tokens `start..end`; `decode` gives those of generated tokens.
    pub fn positions(&self, start: usize, end: usize, decode: impl Fn(usize, usize, i64) -> Positions) -> Positions {
        let mut out: Positions = [vec![], vec![], vec![]];
        let p_end = end.min(self.prompt_len);
        if start < p_end {
            for c in 0..3 {
                out[c].extend_from_slice(&self.prompt_positions[c][start..p_end]);
            }
        }
        let g_start = start.max(self.prompt_len);
        if g_start < end {
            let d = decode(g_start, end - g_start, self.rope_delta);
            for c in 0..3 {
                out[c].extend_from_slice(&d[c]);
            }
        }
        out
    }
}
