//! The seam between decoder layers and what they remember across steps (the trait the layers
//! call; the caches that implement it live above: `models::cache::DenseCache`, the engine's
//! paged step). It lives with the layers that call it, so layers import nothing from models.
//!
//! A step packs the new tokens of one or more sequences (`[T_total, …]`, each sequence a
//! contiguous run). Each layer asks the step's cache for what its kind needs:
//! - an attention layer hands over its rotated q/k/v; the cache stores k/v and returns causal
//!   attention over everything cached;
//! - a recurrent layer (Gated DeltaNet) takes each run's fixed-size state (conv window and
//!   recurrent matrix), updates it in place, and needs no per-token storage.

use candle_core::{Result, Tensor};

/// Which keys each query of a run sees: key `j` is visible to the query at sequence position
/// `i` when it is causal and inside the window (`j <= i`, `i - j < window`), or when both lie
/// in one bidirectional span (positions in the sequence, half-open).
#[derive(Clone, Copy, Debug)]
pub struct Visibility<'a> {
    pub window: Option<usize>,
    pub spans: &'a [(usize, usize)],
}

impl Visibility<'_> {
    pub fn sees(&self, i: usize, j: usize) -> bool {
        let causal = j <= i && self.window.is_none_or(|w| i - j < w);
        causal || self.spans.iter().any(|&(a, b)| (a..b).contains(&i) && (a..b).contains(&j))
    }

    /// Plain causal attention over everything cached.
    pub fn is_causal(&self) -> bool {
        self.window.is_none() && self.spans.is_empty()
    }

    /// First key any of the queries `past..past + t` sees (keys before it can be skipped).
    pub fn first_key(&self, past: usize, t: usize) -> usize {
        let by_window = self.window.map_or(0, |w| (past + 1).saturating_sub(w));
        let by_span = self.spans.iter().filter(|&&(a, b)| a < past + t && b > past).map(|&(a, _)| a).min();
        by_span.map_or(by_window, |a| a.min(by_window))
    }
}

/// Fixed-size state of one recurrent layer for one sequence; `None` until the layer first
/// writes it (a zero state).
#[derive(Clone, Debug, Default)]
pub struct RecurrentState {
    pub conv: Option<Tensor>,
    pub ssm: Option<Tensor>,
}

pub trait StepCache: Send {
    /// `(start, len)` of each sequence's tokens in a packed step of `total` tokens.
    fn runs(&self, total: usize) -> Vec<(usize, usize)>;

    /// Attention layer `layer`: `q: [T, heads, d]`, `k, v: [T, kv_heads, d]` for the step's
    /// tokens. Stores k/v and returns causal attention over the cached tokens, `[T, heads*d]`:
    /// all of them, or with `window` only the last `window` up to each query (itself included,
    /// as transformers' sliding window), widened by the step's bidirectional spans.
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, window: Option<usize>) -> Result<Tensor>;

    /// Rows of this step, `(first, len)` in the packed step, whose tokens also see each other
    /// ahead of themselves (Gemma 3: the tokens of one image). Every later `attend` of the step
    /// applies them; an empty list (the default state) is plain causal attention.
    fn set_bidirectional(&mut self, spans: &[(usize, usize)]) -> Result<()>;

    /// Recurrent layer `layer`: the state of the step's `run`-th sequence.
    fn recurrent(&mut self, layer: usize, run: usize) -> Result<&mut RecurrentState>;
}
