//! `StepCache` over the shared pool for one packed step of many sequences. The step's tokens
//! are concatenated (`[T_total, ...]`); each sequence owns a contiguous run of them.
//! Attention layers: every sequence's new K/V is written to its slots first (one scatter for
//! the whole step); every one-token run (decode) then attends on the CPU with
//! `cpu::attention`, reading its slots in place, and every other run (prefill chunks; every run
//! on other devices) attends over the gather of all its slots. Recurrent
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
        // Every one-token run goes through the decode kernel, whatever else shares the step: a
        // sequence's token is then computed the same way whether or not another sequence's
        // prefill chunk is in its step (the two kernels round differently in bf16, and which
        // steps mix depends on the scheduler, e.g. on prefix sharing).
        let one: Vec<usize> = (0..self.runs.len()).filter(|&i| self.runs[i].len == 1).collect();
        let mut decoded = None;
        if !one.is_empty() {
            let (kp, vp, kv_heads) = self.pool.layer(layer).map_err(candle_core::Error::wrap)?;
            let queries: Vec<_> = one.iter().map(|&i| crate::cpu::attention::Query { slots: &self.runs[i].slots }).collect();
            let qd = match one.len() == self.runs.len() {
                true => q.clone(),
                false => q.index_select(&Tensor::new(one.iter().map(|&i| self.runs[i].start as u32).collect::<Vec<_>>(), q.device())?, 0)?,
            };
            decoded = crate::cpu::attention::decode(&qd, kp, vp, kv_heads, &queries, scale as f32)?;
            if let (Some(out), true) = (&decoded, one.len() == self.runs.len()) {
                return Ok(out.clone());
            }
        }
        let mut outs = Vec::with_capacity(self.runs.len());
        let mut next_one = 0;
        for r in &self.runs {
            match &decoded {
                Some(d) if r.len == 1 => {
                    outs.push(d.narrow(0, next_one, 1)?);
                    next_one += 1;
                }
                _ => {
                    let (kc, vc) = self.pool.gather(layer, &r.context_slots).map_err(candle_core::Error::wrap)?;
                    outs.push(causal_gqa(&q.narrow(0, r.start, r.len)?, &kc, &vc, scale)?);
                }
            }
        }
        Tensor::cat(&outs, 0)
    }

    fn recurrent(&mut self, layer: usize, run: usize) -> Result<&mut RecurrentState> {
        let r = self.runs.get_mut(run).ok_or_else(|| candle_core::Error::Msg(format!("no run {run} in this step")))?;
        r.recurrent.get_mut(layer).ok_or_else(|| candle_core::Error::Msg(format!("layer {layer} has no recurrent state")))
    }
}
