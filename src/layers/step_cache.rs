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
    /// tokens. Stores k/v and returns causal attention over all cached tokens: `[T, heads*d]`.
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor>;

    /// Recurrent layer `layer`: the state of the step's `run`-th sequence.
    fn recurrent(&mut self, layer: usize, run: usize) -> Result<&mut RecurrentState>;
}
