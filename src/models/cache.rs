//! What decoder layers remember across steps: the `StepCache` seam (defined with the layers
//! that call it, `layers::step_cache`) and `DenseCache` (one sequence, contiguous tensors), the
//! obviously-correct reference; the engine's paged step implements the same trait, so model
//! code never changes.

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Shape, Tensor};

pub use crate::layers::attention::causal_gqa;
use crate::layers::attention::{masked_gqa, Keys};
pub use crate::layers::step_cache::{RecurrentState, StepCache, Visibility};

/// Rows a dense cache's K/V buffers start with and grow by.
const KV_CHUNK: usize = 512;

/// Contiguous per-layer K/V and recurrent state for a single sequence.
#[derive(Default)]
pub struct DenseCache {
    /// Per layer, K/V buffers a step writes its rows into in place (the whole cache used to be
    /// concatenated every step, quadratic in a long generation).
    kv: Vec<Option<Kv>>,
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
        self.kv.iter().flatten().next().map_or(0, |l| l.len)
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

/// One layer's K and V, `[capacity, kv_heads, d]` each, the first `len` rows written.
struct Kv {
    k: Tensor,
    v: Tensor,
    len: usize,
}

impl Kv {
    /// Writes the step's rows after the cached ones (growing the buffers by whole chunks) and
    /// returns every cached row of K and V.
    fn append(slot: &mut Option<Kv>, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (len, cap) = slot.as_ref().map_or((0, 0), |kv| (kv.len, kv.k.dim(0).unwrap_or(0)));
        let t = k.dim(0)?;
        if len + t > cap {
            let rows = (len + t).next_multiple_of(KV_CHUNK);
            let grown = |x: &Tensor, old: Option<&Tensor>| -> Result<Tensor> {
                let mut dims = x.dims().to_vec();
                dims[0] = rows;
                let buf = touched_zeros(dims, x.dtype(), x.device())?;
                if let Some(old) = old {
                    buf.slice_set(&old.narrow(0, 0, len)?, 0, 0)?;
                }
                Ok(buf)
            };
            let (k2, v2) = (grown(k, slot.as_ref().map(|s| &s.k))?, grown(v, slot.as_ref().map(|s| &s.v))?);
            *slot = Some(Kv { k: k2, v: v2, len });
        }
        let kv = slot.as_mut().expect("allocated above");
        kv.k.slice_set(k, 0, len)?;
        kv.v.slice_set(v, 0, len)?;
        kv.len = len + t;
        Ok((kv.k.narrow(0, 0, kv.len)?, kv.v.narrow(0, 0, kv.len)?))
    }
}

/// A zero tensor whose host pages are already written: a fresh zeroed allocation is mapped
/// page by page as it is first written, and a decode step that wrote the next row of each
/// layer's K and V took a page fault every few tokens per buffer (48 every eight tokens on
/// the 0.5B shape: 24 layers' K and V, eight 512-byte rows a page; llama.cpp clears its K/V
/// buffer when it makes it).
fn touched_zeros(dims: Vec<usize>, dtype: DType, device: &Device) -> Result<Tensor> {
    let shape = Shape::from(dims);
    if !device.is_cpu() {
        return Tensor::zeros(shape, dtype, device);
    }
    fn host<T: candle_core::WithDType>(shape: Shape, device: &Device) -> Result<Tensor> {
        let n = shape.elem_count();
        let mut v: Vec<T> = Vec::with_capacity(n);
        v.resize(n, T::zero());
        // A write per page the compiler cannot turn into a lazily mapped zeroed allocation.
        let per_page = (4096 / std::mem::size_of::<T>()).max(1);
        for i in (0..n).step_by(per_page) {
            // SAFETY: `i < n = v.len()`.
            unsafe { std::ptr::write_volatile(v.as_mut_ptr().add(i), T::zero()) };
        }
        Tensor::from_vec(v, shape, device)
    }
    match dtype {
        DType::F32 => host::<f32>(shape, device),
        DType::BF16 => host::<half::bf16>(shape, device),
        DType::F16 => host::<half::f16>(shape, device),
        _ => Tensor::zeros(shape, dtype, device),
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
        let (k_all, v_all) = Kv::append(&mut self.kv[layer], &k.contiguous()?, &v.contiguous()?)?;
        let (s, kvh, d) = k_all.dims3()?;
        let t = q.dim(0)?;
        let past = s - t;
        let vis = Visibility { window, spans: &self.spans };
        // Keys no query of the step sees (out of every window) are left out.
        let first = vis.first_key(past, t);
        // One new token seeing all its keys: the CPU kernel the engine's decode uses, in place.
        // Without spans every key from `first` is in the window (no check over the keys).
        let fast = match t == 1 && (vis.spans.is_empty() || (first..s).all(|j| vis.sees(past, j))) {
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
