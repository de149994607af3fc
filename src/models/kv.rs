//! The seam between the text decoder and K/V storage.
//!
//! The decoder computes q/k/v (already rotated) for the tokens of one step and hands them to an
//! `AttentionBackend`, which stores k/v wherever it likes and returns the attention output.
//! `DenseKvCache` (one sequence, contiguous tensors) is the reference; the paged pool of the
//! engine implements the same trait, so the model code never changes.

use candle_core::{DType, Device, Result, Tensor};

use super::layers::softmax_f32;

pub trait AttentionBackend {
    /// `q: [T, heads, d]`, `k, v: [T, kv_heads, d]` for the `T` new tokens of this step.
    /// Stores k/v for `layer` and returns causal attention over all cached tokens: `[T, heads*d]`.
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor>;
}

/// Causal grouped-query attention of `T` new queries over `S = past + T` keys.
/// `q: [T, H, d]`, `k, v: [S, KV, d]` (token-major). The causal offset handles prefill, chunked
/// prefill and decode alike: query `i` sees keys `0..=past+i`.
pub fn causal_gqa(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (t, h, d) = q.dims3()?;
    let (s, kvh, _) = k.dims3()?;
    let groups = h / kvh;
    let past = s - t;
    // [KV, G*T, d]: each kv head serves its group of query heads without copying K/V.
    let q = q.reshape((t, kvh, groups, d))?.permute((1, 2, 0, 3))?.reshape((kvh, groups * t, d))?;
    let k = k.transpose(0, 1)?.contiguous()?;
    let v = v.transpose(0, 1)?.contiguous()?;
    let mut att = (q.contiguous()?.matmul(&k.t()?)? * scale)?; // [KV, G*T, S]
    if t > 1 {
        let mask = causal_mask(t, s, past, att.dtype(), att.device())?; // [T, S]
        let mask = mask.repeat((groups, 1))?; // [G*T, S]
        att = att.broadcast_add(&mask)?;
    }
    let att = softmax_f32(&att)?;
    let out = att.matmul(&v)?; // [KV, G*T, d]
    out.reshape((kvh, groups, t, d))?.permute((2, 0, 1, 3))?.reshape((t, h * d))
}

pub fn causal_mask(t: usize, s: usize, past: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..s).map(move |j| if j <= past + i { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(mask, (t, s), dev)?.to_dtype(dtype)
}

/// Contiguous per-layer K/V for a single sequence: the simple, obviously-correct backend.
#[derive(Default)]
pub struct DenseKvCache {
    layers: Vec<Option<(Tensor, Tensor)>>,
}

impl DenseKvCache {
    pub fn new() -> Self {
        Self::default()
    }
    /// Tokens cached so far (layer 0 is written first in every step).
    pub fn len(&self) -> usize {
        match self.layers.first() {
            Some(Some((k, _))) => k.dim(0).unwrap_or(0),
            _ => 0,
        }
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn clear(&mut self) {
        self.layers.clear();
    }
}

impl AttentionBackend for DenseKvCache {
    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
        if self.layers.len() <= layer {
            self.layers.resize(layer + 1, None);
        }
        let (k_all, v_all) = match self.layers[layer].take() {
            Some((pk, pv)) => (Tensor::cat(&[&pk, k], 0)?, Tensor::cat(&[&pv, v], 0)?),
            None => (k.clone(), v.clone()),
        };
        let out = causal_gqa(q, &k_all, &v_all, scale)?;
        self.layers[layer] = Some((k_all, v_all));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Attention of a sequence split into chunks must equal one-shot prefill.
    #[test]
    fn chunked_equals_one_shot() -> Result<()> {
        let dev = Device::Cpu;
        let (t, h, kvh, d) = (7, 4, 2, 8);
        let q = Tensor::randn(0f32, 1., (t, h, d), &dev)?;
        let k = Tensor::randn(0f32, 1., (t, kvh, d), &dev)?;
        let v = Tensor::randn(0f32, 1., (t, kvh, d), &dev)?;
        let mut one = DenseKvCache::new();
        let full = one.attend(0, &q, &k, &v, 0.3)?;
        let mut chunked = DenseKvCache::new();
        let mut parts = vec![];
        for (start, len) in [(0, 3), (3, 1), (4, 3)] {
            parts.push(chunked.attend(0, &q.narrow(0, start, len)?, &k.narrow(0, start, len)?, &v.narrow(0, start, len)?, 0.3)?);
        }
        let joined = Tensor::cat(&parts, 0)?;
        let diff = (full - joined)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-5, "diff {diff}");
        assert_eq!(chunked.len(), 7);
        Ok(())
    }

    /// The first query sees only the first key: its output is exactly v[0] of its kv head.
    #[test]
    fn causal_first_token_sees_itself() -> Result<()> {
        let dev = Device::Cpu;
        let q = Tensor::randn(0f32, 1., (3, 2, 4), &dev)?;
        let k = Tensor::randn(0f32, 1., (3, 1, 4), &dev)?;
        let v = Tensor::randn(0f32, 1., (3, 1, 4), &dev)?;
        let out = causal_gqa(&q, &k, &v, 0.5)?; // [3, 8]
        let first = out.get(0)?.reshape((2, 4))?;
        let v0 = v.get(0)?.reshape((1, 4))?.repeat((2, 1))?;
        let diff = (first - v0)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6);
        Ok(())
    }
}
