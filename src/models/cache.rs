//! What decoder layers remember across steps: the `StepCache` seam (defined with the layers
//! that call it, `layers::step_cache`) and `DenseCache` (one sequence, contiguous tensors), the
//! obviously-correct reference; the engine's paged step implements the same trait, so model
//! code never changes.

use std::collections::HashMap;

use candle_core::{Result, Tensor};
use candle_nn::kv_cache::KvCache;

pub use crate::layers::attention::causal_gqa;
use crate::layers::attention::{masked_gqa, Keys};
pub use crate::layers::step_cache::{RecurrentState, StepCache, Visibility};

/// Rows a dense cache's K/V buffers start with and grow by.
const KV_CHUNK: usize = 512;

/// Contiguous per-layer K/V and recurrent state for a single sequence.
#[derive(Default)]
pub struct DenseCache {
    /// Per layer, K/V in candle_nn's growable cache: a step writes its rows in place (the
    /// whole cache used to be concatenated every step, quadratic in a long generation).
    kv: Vec<Option<KvCache>>,
    states: HashMap<usize, RecurrentState>,
    /// The current step's bidirectional spans, as positions in the sequence.
    spans: Vec<(usize, usize)>,
}

impl DenseCache {
    pub fn new() -> Self {
        Self::default()
    }
    /// Tokens whose K/V are cached (0 for a model without attention layers).
    pub fn len(&self) -> usize {
        self.kv.iter().flatten().next().map_or(0, |l| l.current_seq_len())
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn clear(&mut self) {
        self.kv.clear();
        self.states.clear();
        self.spans.clear();
    }
}

impl StepCache for DenseCache {
    fn runs(&self, total: usize) -> Vec<(usize, usize)> {
        vec![(0, total)]
    }

    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, window: Option<usize>) -> Result<Tensor> {
        if self.kv.len() <= layer {
            self.kv.resize_with(layer + 1, || None);
        }
        let cache = self.kv[layer].get_or_insert_with(|| KvCache::new(0, KV_CHUNK));
        let (k_all, v_all) = cache.append(&k.contiguous()?, &v.contiguous()?)?;
        let (s, kvh, d) = k_all.dims3()?;
        let t = q.dim(0)?;
        let past = s - t;
        let vis = Visibility { window, spans: &self.spans };
        // Keys no query of the step sees (out of every window) are left out.
        let first = vis.first_key(past, t);
        // One new token seeing all its keys: the CPU kernel the engine's decode uses, in place.
        let fast = match t == 1 && (first..s).all(|j| vis.sees(past, j)) {
            true if crate::cpu::host_paths(q.device()) => {
                let slots: Vec<u32> = (first as u32..s as u32).collect();
                let (kf, vf) = (k_all.reshape((s, kvh * d))?, v_all.reshape((s, kvh * d))?);
                crate::cpu::attention::decode(q, &kf, &vf, kvh, &[crate::cpu::attention::Query { slots: &slots }], scale as f32)?
            }
            _ => None,
        };
        match fast {
            Some(o) => Ok(o),
            None => masked_gqa(q, &k_all.narrow(0, first, s - first)?, &v_all.narrow(0, first, s - first)?, scale, Keys { past, first }, &vis),
        }
    }

    fn set_bidirectional(&mut self, spans: &[(usize, usize)]) -> Result<()> {
        let past = self.len();
        self.spans = spans.iter().map(|&(a, n)| (past + a, past + a + n)).collect();
        Ok(())
    }

    fn recurrent(&mut self, layer: usize, run: usize) -> Result<&mut RecurrentState> {
        if run != 0 {
            candle_core::bail!("a dense cache holds one sequence; run {run} asked for");
        }
        Ok(self.states.entry(layer).or_default())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Attention of a sequence split into chunks must equal one-shot prefill.
    #[test]
    fn chunked_equals_one_shot() -> Result<()> {
        let (t, h, kvh, d) = (7, 4, 2, 8);
        let q = crate::testing::randn(110, (t, h, d), 1.)?;
        let k = crate::testing::randn(111, (t, kvh, d), 1.)?;
        let v = crate::testing::randn(112, (t, kvh, d), 1.)?;
        let mut one = DenseCache::new();
        let full = one.attend(0, &q, &k, &v, 0.3, None)?;
        let mut chunked = DenseCache::new();
        let mut parts = vec![];
        for (start, len) in [(0, 3), (3, 1), (4, 3)] {
            parts.push(chunked.attend(0, &q.narrow(0, start, len)?, &k.narrow(0, start, len)?, &v.narrow(0, start, len)?, 0.3, None)?);
        }
        let joined = Tensor::cat(&parts, 0)?;
        let diff = (full - joined)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "diff {diff}");
        assert_eq!(chunked.len(), 7);
        Ok(())
    }

    #[test]
    fn recurrent_state_persists_per_layer() -> Result<()> {
        let mut c = DenseCache::new();
        assert!(c.recurrent(3, 0)?.ssm.is_none());
        c.recurrent(3, 0)?.ssm = Some(Tensor::ones(2, candle_core::DType::F32, &Device::Cpu)?);
        assert!(c.recurrent(3, 0)?.ssm.is_some());
        assert!(c.recurrent(4, 0)?.ssm.is_none());
        assert!(c.recurrent(3, 1).is_err());
        Ok(())
    }
}
