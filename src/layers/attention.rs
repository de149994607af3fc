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

/// Queries per block of `masked_gqa`: each block's scores are `[heads, 128, keys it sees]`.
const QUERY_BLOCK: usize = 128;

/// Grouped-query attention of `T` queries over `S` keys under `vis` (causal, sliding window,
/// bidirectional spans). Shapes as `causal_gqa`.
///
/// The queries go in blocks of `QUERY_BLOCK`, each over only the keys some query of the block
/// sees: under a causal mask a long prefill computes about half the scores of one `[T, S]`
/// product, and holds one block's scores at a time instead of all (a 2,048-token prompt of 16
/// heads held 256 MiB of them per layer). Rows are independent, so blocking changes no score.
pub fn masked_gqa(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, at: Keys, vis: &Visibility) -> Result<Tensor> {
    let (t, h, d) = q.dims3()?;
    let (s, kvh, _) = k.dims3()?;
    let groups = h / kvh;
    // [KV, G, T, d]: each kv head serves its group of query heads without copying K/V.
    let q = q.reshape((t, kvh, groups, d))?.permute((1, 2, 0, 3))?;
    let k = k.transpose(0, 1)?.contiguous()?;
    let v = v.transpose(0, 1)?.contiguous()?;
    let mut outs = Vec::with_capacity(t.div_ceil(QUERY_BLOCK));
    for t0 in (0..t).step_by(QUERY_BLOCK) {
        let b = QUERY_BLOCK.min(t - t0);
        let block = Keys { past: at.past + t0, first: at.first };
        let (lo, hi) = seen_keys(b, s, block, vis);
        let qb = q.narrow(2, t0, b)?.contiguous()?.reshape((kvh, groups * b, d))?;
        let att = qb.matmul(&k.narrow(1, lo, hi - lo)?.t()?)?; // [KV, G*b, S']
        let att = scaled_masked_softmax(&att, scale, b, Keys { past: block.past, first: at.first + lo }, vis)?;
        outs.push(att.matmul(&v.narrow(1, lo, hi - lo)?)?.reshape((kvh, groups, b, d))?);
    }
    Tensor::cat(&outs, 2)?.permute((2, 0, 1, 3))?.reshape((t, h * d))
}

/// The run `lo..hi` of the `s` keys placed at `at.first` that any of `b` queries from `at.past`
/// sees (all of them when none sees any: softmax then gives NaN rows, as over the full mask).
fn seen_keys(b: usize, s: usize, at: Keys, vis: &Visibility) -> (usize, usize) {
    let last = at.past + b - 1;
    let range = if vis.is_causal() {
        // Query `i` sees keys up to position `i`.
        Some((0, (last + 1).saturating_sub(at.first).min(s))).filter(|&(_, hi)| hi > 0)
    } else {
        let seen = |j: usize| (at.past..=last).any(|i| vis.sees(i, at.first + j));
        (0..s).find(|&j| seen(j)).map(|lo| (lo, (lo..s).rev().find(|&j| seen(j)).map_or(s, |j| j + 1)))
    };
    range.unwrap_or((0, s))
}

/// `softmax(att · scale + mask)` over the last dim in f32 (transformers upcasts attention
/// weights the same way), `att: [KV, G*b, S]` with `b` queries placed as `at`; in `att`'s dtype.
fn scaled_masked_softmax(att: &Tensor, scale: f64, b: usize, at: Keys, vis: &Visibility) -> Result<Tensor> {
    use candle_core::Storage;
    let (kvh, rows, s) = att.dims3()?;
    // One causal query over exactly its keys needs no mask (decode).
    let plain = b == 1 && at.first + s == at.past + 1 && (at.first..=at.past).all(|j| vis.sees(at.past, j));
    let mask: Vec<f32> = match plain {
        true => vec![0.0; s],
        false => mask_values(b, s, at, vis),
    };
    if crate::cpu::host_paths(att.device()) && att.is_contiguous() {
        let (storage, layout) = att.storage_and_layout();
        if let Storage::Cpu(cpu) = &*storage {
            let n = kvh * rows * s;
            let o = layout.start_offset();
            crate::cpu::note_kernel_run();
            match att.dtype() {
                DType::F32 => {
                    let mut out = vec![0f32; n];
                    crate::cpu::attention::masked_softmax(&cpu.as_slice::<f32>()?[o..o + n], s, scale, &mask, &mut out);
                    return Tensor::from_vec(out, (kvh, rows, s), att.device());
                }
                DType::BF16 => {
                    let mut out = vec![half::bf16::ZERO; n];
                    crate::cpu::attention::masked_softmax(&cpu.as_slice::<half::bf16>()?[o..o + n], s, scale, &mask, &mut out);
                    return Tensor::from_vec(out, (kvh, rows, s), att.device());
                }
                _ => {}
            }
        }
    }
    let mut att = (att * scale)?;
    if !plain {
        let mask = Tensor::from_vec(mask, (b, s), att.device())?.to_dtype(att.dtype())?.repeat((rows / b, 1))?;
        att = att.broadcast_add(&mask)?;
    }
    softmax_f32(&att)
}

pub fn causal_mask(t: usize, s: usize, past: usize, dtype: DType, dev: &Device) -> Result<Tensor> {
    visibility_mask(t, s, Keys { past, first: 0 }, &Visibility { window: None, spans: &[] }, dtype, dev)
}

/// Additive `[T, S]` mask (0 or −inf) of `T` queries over `S` keys placed as `at` says.
pub fn visibility_mask(t: usize, s: usize, at: Keys, vis: &Visibility, dtype: DType, dev: &Device) -> Result<Tensor> {
    Tensor::from_vec(mask_values(t, s, at, vis), (t, s), dev)?.to_dtype(dtype)
}

/// `visibility_mask`'s values, row-major.
fn mask_values(t: usize, s: usize, at: Keys, vis: &Visibility) -> Vec<f32> {
    (0..t).flat_map(|i| (0..s).map(move |j| if vis.sees(at.past + i, at.first + j) { 0.0 } else { f32::NEG_INFINITY })).collect()
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

    /// The whole `[T, S]` product the blocks replace: scores, scale, mask, f32 softmax.
    fn unblocked(q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, at: Keys, vis: &Visibility) -> Result<Tensor> {
        let (t, h, d) = q.dims3()?;
        let (s, kvh, _) = k.dims3()?;
        let g = h / kvh;
        let q = q.reshape((t, kvh, g, d))?.permute((1, 2, 0, 3))?.contiguous()?.reshape((kvh, g * t, d))?;
        let (k, v) = (k.transpose(0, 1)?.contiguous()?, v.transpose(0, 1)?.contiguous()?);
        let mask = visibility_mask(t, s, at, vis, q.dtype(), q.device())?.repeat((g, 1))?;
        let att = softmax_f32(&(q.matmul(&k.t()?)? * scale)?.broadcast_add(&mask)?)?;
        att.matmul(&v)?.reshape((kvh, g, t, d))?.permute((2, 0, 1, 3))?.reshape((t, h * d))
    }

    /// Blocks of queries over the keys they see equal the whole product, across block
    /// boundaries (300 queries: three blocks), after skipped keys and a past, under a causal
    /// mask, a sliding window and a bidirectional span, in f32 and bf16.
    #[test]
    fn query_blocks_equal_the_whole_product() -> Result<()> {
        let (t, past, first, h, kvh, d) = (300, 40, 8, 4, 2, 16);
        let s = past + t - first;
        let spans = [(100, 180)];
        let visible = [Visibility { window: None, spans: &[] }, Visibility { window: Some(90), spans: &[] }, Visibility { window: None, spans: &spans }];
        for dt in [DType::F32, DType::BF16] {
            let q = crate::testing::randn(130, (t, h, d), 1.)?.to_dtype(dt)?;
            let k = crate::testing::randn(131, (s, kvh, d), 1.)?.to_dtype(dt)?;
            let v = crate::testing::randn(132, (s, kvh, d), 1.)?.to_dtype(dt)?;
            for vis in &visible {
                let at = Keys { past, first };
                let (got, want) = (masked_gqa(&q, &k, &v, 0.25, at, vis)?, unblocked(&q, &k, &v, 0.25, at, vis)?);
                let diff = (got.to_dtype(DType::F32)? - want.to_dtype(DType::F32)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
                // f32: summation order only; bf16: one rounding of an output near 1.
                let bound = if dt == DType::F32 { 1e-5 } else { 2f32.powi(-7) };
                assert!(diff <= bound, "{dt:?} window {:?} spans {:?}: {diff}", vis.window, vis.spans);
            }
        }
        Ok(())
    }
}
