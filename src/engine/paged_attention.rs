//! `StepCache` over the shared pool for one packed step of many sequences. The step's tokens
//! are concatenated (`[T_total, ...]`); each sequence owns a contiguous run of them.
//! Attention layers: every sequence's new K/V is written to its slots first (one scatter for
//! the whole step); a step of one token per sequence (decode) then attends on the CPU with
//! `cpu::attention`, reading each sequence's slots in place; otherwise (prefill chunks, other
//! devices) each sequence attends over the gather of all its slots. Recurrent
//! layers: each sequence's own fixed-size state, taken from the sequence for the step.

use candle_core::{Result, Tensor};

use super::kv_pool::KvPool;
use crate::layers::causal_gqa;
use crate::models::{RecurrentState, StepCache};

pub struct SeqRun {
    /// First row of this sequence's tokens in the packed step.
    pub start: usize,
    pub len: usize,
    /// Slots of every token of the sequence up to the end of this run (`[past + len]`, u32).
    pub context_slots: Tensor,
    /// The same slots on the host (the in-place CPU decode kernel reads them).
    pub slots: Vec<u32>,
    /// The sequence's per-layer recurrent state (empty for models without recurrent layers).
    pub recurrent: Vec<RecurrentState>,
}

pub struct PagedStep<'a> {
    pool: &'a KvPool,
    pub runs: Vec<SeqRun>,
    /// Slot of every packed token, broadcast for `KvPool::write`.
    write_index: Tensor,
}

impl<'a> PagedStep<'a> {
    pub fn new(pool: &'a KvPool, runs: Vec<SeqRun>, write_index: Tensor) -> Self {
        PagedStep { pool, runs, write_index }
    }
}

impl StepCache for PagedStep<'_> {
    fn runs(&self, _total: usize) -> Vec<(usize, usize)> {
        self.runs.iter().map(|r| (r.start, r.len)).collect()
    }

    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
        self.pool.write(layer, &self.write_index, k, v).map_err(candle_core::Error::wrap)?;
        if self.runs.iter().all(|r| r.len == 1) {
            let (kp, vp, kv_heads) = self.pool.layer(layer).map_err(candle_core::Error::wrap)?;
            let queries: Vec<_> = self.runs.iter().map(|r| crate::cpu::attention::Query { slots: &r.slots }).collect();
            if let Some(out) = crate::cpu::attention::decode(q, kp, vp, kv_heads, &queries, scale as f32)? {
                return Ok(out);
            }
        }
        let mut outs = Vec::with_capacity(self.runs.len());
        for r in &self.runs {
            let (kc, vc) = self.pool.gather(layer, &r.context_slots).map_err(candle_core::Error::wrap)?;
            outs.push(causal_gqa(&q.narrow(0, r.start, r.len)?, &kc, &vc, scale)?);
        }
        Tensor::cat(&outs, 0)
    }

    fn recurrent(&mut self, layer: usize, run: usize) -> Result<&mut RecurrentState> {
        let r = self.runs.get_mut(run).ok_or_else(|| candle_core::Error::Msg(format!("no run {run} in this step")))?;
        r.recurrent.get_mut(layer).ok_or_else(|| candle_core::Error::Msg(format!("layer {layer} has no recurrent state")))
    }
}
