//! Attention kernels on token-major tensors: causal grouped-query attention of new tokens over
//! cached K/V (decoders), and dense non-causal attention of one segment (vision towers).

use candle_core::{DType, Device, Module, Result, Tensor};

use super::{linear, Fused, Linear, Norm, Rotary};
use super::step_cache::{StepCache, Visibility};
use crate::weights::Weights;

/// Decoder self-attention: q/k/v projections, rotary, the step cache's causal attention over
/// everything cached, output projection. Grouped-query when `kv_heads < heads`.
#[derive(Clone, Debug)]
pub struct SelfAttention {
    /// q, k and v projections, joined into one product where their weights allow.
    qkv: Fused,
    o: Linear,
    /// Qwen3: per-head RMSNorm of q and k (over head_dim) before rotary.
    qk_norm: Option<(Norm, Norm)>,
    output_gate: bool,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    /// Scores' scale: 1/√head_dim, or Gemma 3's `query_pre_attn_scalar`^-½.
    scale: f64,
    /// Sliding-window layers (Gemma 3's local layers): keys within this many tokens.
    window: Option<usize>,
}

/// Shape and options of one decoder attention block.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Qwen2 puts biases on q/k/v (never on o); Qwen3 on none.
    pub qkv_bias: bool,
    /// Qwen3's q_norm / k_norm, with this epsilon.
    pub qk_norm_eps: Option<f64>,
    /// Qwen3.5: zero-centred q/k norms (scale `1 + w`).
    pub qk_norm_offset: bool,
    /// Qwen3.5: `q_proj` also yields a per-head gate; the output is `o_proj(attn · σ(gate))`.
    pub output_gate: bool,
}

impl SelfAttention {
    pub fn new(s: AttentionShape, w: Weights) -> Result<Self> {
        let (hidden, heads, kv_heads, head_dim) = (s.hidden, s.heads, s.kv_heads, s.head_dim);
        let norm = |w: Weights, eps: f64| match s.qk_norm_offset {
            true => Norm::rms_offset(head_dim, eps, w),
            false => Norm::rms(head_dim, eps, w),
        };
        let qk_norm = match s.qk_norm_eps {
            Some(eps) => Some((norm(w.pp("q_norm"), eps)?, norm(w.pp("k_norm"), eps)?)),
            None => None,
        };
        let q_width = if s.output_gate { 2 * heads * head_dim } else { heads * head_dim };
        Ok(SelfAttention {
            qkv: Fused::new(vec![
                linear(hidden, q_width, s.qkv_bias, w.pp("q_proj"))?,
                linear(hidden, kv_heads * head_dim, s.qkv_bias, w.pp("k_proj"))?,
                linear(hidden, kv_heads * head_dim, s.qkv_bias, w.pp("v_proj"))?,
            ])?,
            o: linear(heads * head_dim, hidden, false, w.pp("o_proj"))?,
            qk_norm,
            output_gate: s.output_gate,
            heads,
            kv_heads,
            head_dim,
            scale: 1.0 / (head_dim as f64).sqrt(),
            window: None,
        })
    }

    /// Another scale for the scores (Gemma 3 scales by `query_pre_attn_scalar`, not head_dim).
    pub fn with_scale(self, scale: f64) -> Self {
        SelfAttention { scale, ..self }
    }

    /// A sliding-window layer: each query sees the last `window` keys (itself included).
    pub fn with_window(self, window: Option<usize>) -> Self {
        SelfAttention { window, ..self }
    }

    /// `x: [T, hidden]` of this step; `layer` names the cache slot.
    pub fn forward(&self, x: &Tensor, rope: &Rotary, cos: &Tensor, sin: &Tensor, layer: usize, cache: &mut dyn StepCache) -> Result<Tensor> {
        let t = x.dim(0)?;
        let [q, k, v]: [Tensor; 3] = self.qkv.forward(x)?.try_into().map_err(|_| candle_core::Error::Msg("q/k/v: three outputs expected".into()))?;
        // With an output gate, each head's q_proj rows are [query | gate].
        let (q, gate) = match self.output_gate {
            true => {
                let qg = q.reshape((t, self.heads, 2 * self.head_dim))?;
                (qg.narrow(2, 0, self.head_dim)?.contiguous()?, Some(qg.narrow(2, self.head_dim, self.head_dim)?.reshape((t, self.heads * self.head_dim))?))
            }
            false => (q.reshape((t, self.heads, self.head_dim))?, None),
        };
        let k = k.reshape((t, self.kv_heads, self.head_dim))?;
        let v = v.reshape((t, self.kv_heads, self.head_dim))?;
        let (q, k) = match &self.qk_norm {
            Some((qn, kn)) => (qn.forward(&q)?, kn.forward(&k)?),
            None => (q, k),
        };
        let q = rope.apply(&q, cos, sin)?;
        let k = rope.apply(&k, cos, sin)?;
        let out = cache.attend(layer, &q, &k, &v.contiguous()?, self.scale, self.window)?;
        let out = match gate {
            Some(g) => (out * candle_nn::ops::sigmoid(&g)?)?,
            None => out,
        };
        self.o.forward(&out)
    }
}

/// Causal grouped-query attention of `T` new queries over `S = past + T` keys.
/// `q: [T, H, d]`, `k, v: [S, KV, d]` (token-major). The causal offset handles prefill, chunked
/// prefill and decode alike: query `i` sees keys `0..=past+i`.
pub fn causal_gqa(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let past = k.dim(0)? - q.dim(0)?;
    masked_gqa(q, k, v, scale, Keys { past, first: 0 }, &Visibility { window: None, spans: &[] })
}

/// Where a run's queries and keys sit in their sequence: queries at `past..past + T`, the
/// given keys at `first..first + S` (keys before `first` were skipped: none of the queries
/// sees them).
#[derive(Clone, Copy, Debug)]
pub struct Keys {
    pub past: usize,
    pub first: usize,
}

/// Grouped-query attention of `T` queries over `S` keys under `vis` (causal, sliding window,
/// bidirectional spans). Shapes as `causal_gqa`.
pub fn masked_gqa(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, at: Keys, vis: &Visibility) -> Result<Tensor> {
    let (t, h, d) = q.dims3()?;
    let (s, kvh, _) = k.dims3()?;
    let groups = h / kvh;
    // [KV, G*T, d]: each kv head serves its group of query heads without copying K/V.
    let q = q.reshape((t, kvh, groups, d))?.permute((1, 2, 0, 3))?.reshape((kvh, groups * t, d))?;
    let k = k.transpose(0, 1)?.contiguous()?;
    let v = v.transpose(0, 1)?.contiguous()?;
    let mut att = (q.contiguous()?.matmul(&k.t()?)? * scale)?; // [KV, G*T, S]
    // One causal query over exactly its keys needs no mask (decode).
    let plain = t == 1 && at.first + s == at.past + 1 && (at.first..=at.past).all(|j| vis.sees(at.past, j));
    if !plain {
        let mask = visibility_mask(t, s, at, vis, att.dtype(), att.device())?; // [T, S]
        let mask = mask.repeat((groups, 1))?; // [G*T, S]
        att = att.broadcast_add(&mask)?;
    }
    let att = softmax_f32(&att)?;
    let out = att.matmul(&v)?; // [KV, G*T, d]
    out.reshape((kvh, groups, t, d))?.permute((2, 0, 1, 3))?.reshape((t, h * d))
}

pub fn causal_mask(t: usize, s: usize, past: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
    visibility_mask(t, s, Keys { past, first: 0 }, &Visibility { window: None, spans: &[] }, dtype, dev)
}

/// Additive `[T, S]` mask (0 or −inf) of `T` queries over `S` keys placed as `at` says.
pub fn visibility_mask(t: usize, s: usize, at: Keys, vis: &Visibility, dtype: DType, dev: &Device) -> Result<Tensor> {
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..s).map(move |j| if vis.sees(at.past + i, at.first + j) { 0.0 } else { f32::NEG_INFINITY }))
        .collect();
    Tensor::from_vec(mask, (t, s), dev)?.to_dtype(dtype)
}

/// Dense non-causal attention of one segment. `q, k, v: [S, heads, d]` → `[S, heads*d]`.
/// Used by the vision towers, whose attention is block-diagonal over images/windows.
pub fn dense_attention(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<Tensor> {
    let (s, h, d) = q.dims3()?;
    let q = q.transpose(0, 1)?.contiguous()?;
    let k = k.transpose(0, 1)?.contiguous()?;
    let v = v.transpose(0, 1)?.contiguous()?;
    let att = (q.matmul(&k.t()?)? * scale)?;
    let att = softmax_f32(&att)?;
    att.matmul(&v)?.transpose(0, 1)?.reshape((s, h * d))
}

/// Softmax over the last dim in f32 (transformers upcasts attention weights the same way).
pub fn softmax_f32(x: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    candle_nn::ops::softmax_last_dim(&x.to_dtype(DType::F32)?)?.to_dtype(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The first query sees only the first key: its output is exactly v[0] of its kv head.
    #[test]
    fn causal_first_token_sees_itself() -> Result<()> {
        let q = crate::testing::randn(103, (3, 2, 4), 1.)?;
        let k = crate::testing::randn(104, (3, 1, 4), 1.)?;
        let v = crate::testing::randn(105, (3, 1, 4), 1.)?;
        let out = causal_gqa(&q, &k, &v, 0.5)?; // [3, 8]
        let first = out.get(0)?.reshape((2, 4))?;
        let v0 = v.get(0)?.reshape((1, 4))?.repeat((2, 1))?;
        let diff = (first - v0)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6);
        Ok(())
    }
}
