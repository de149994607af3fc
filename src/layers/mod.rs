//! Building blocks shared by every model family (decoders, vision towers, the metrics'
//! encoders), so a family difference is a choice of block, never a copied model:
//! - `linear`: one linear type for dense and quantized weights;
//! - `embedding`: token lookups, from a dense table or the mapped file's own rows;
//! - `norm`, `mlp`: RMSNorm / LayerNorm, gated and plain feed-forwards;
//! - `rotary`: 1-D RoPE, sectioned and interleaved M-RoPE, partial rotary;
//! - `attention`: causal grouped-query attention over cached K/V (optional q/k norm), dense
//!   vision attention;
//! - `moe`: sparse mixture-of-experts feed-forward (top-k routing);
//! - `delta_net`, `delta_rule`: Gated DeltaNet (Qwen3.5's linear attention) and its gated
//!   delta rule, chunked and recurrent;
//! - `step_cache`: the `StepCache` seam layers call for K/V and recurrent state;
//! - `vision`: the ViT block, patch embedding and 2-D rotary of every Qwen vision tower.
// No tensor is read back to the host here except through `engine::sampling::read_back` or
// where a site says why its tensor is on the host (.clippy.toml; tests may read freely).
#![cfg_attr(not(test), warn(clippy::disallowed_methods))]

pub mod attention;
pub mod deferred;
pub mod delta_net;
pub mod delta_rule;
pub mod delta_rule_ops;
pub mod embedding;
pub mod linear;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod rotary;
pub mod step_cache;
pub mod vision;

use candle_core::{Result, Tensor};
use serde::{Deserialize, Serialize};

pub use attention::{causal_gqa, causal_mask, dense_attention, masked_gqa, softmax_f32, visibility_mask, Keys};
pub use embedding::Embedding;
pub use linear::{linear, Fused, Linear};
pub use mlp::Mlp;
pub use norm::{GatedRmsNorm, Norm};
pub use rotary::{apply_rope, Rotary, RotaryLayout};

/// Activations named in HF configs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Act {
    #[serde(rename = "silu", alias = "swish")]
    Silu,
    #[serde(rename = "quick_gelu")]
    QuickGelu,
    #[serde(rename = "gelu")]
    Gelu,
    #[serde(rename = "gelu_pytorch_tanh", alias = "gelu_new", alias = "gelu_fast")]
    GeluTanh,
    /// Some BERT-family encoders (the metrics' models).
    #[serde(rename = "relu")]
    Relu,
}

pub fn act(a: Act, x: &Tensor) -> Result<Tensor> {
    match a {
        Act::Silu => candle_nn::ops::silu(x),
        // x * sigmoid(1.702 x), as transformers' QuickGELUActivation.
        Act::QuickGelu => x * candle_nn::ops::sigmoid(&(x * 1.702)?)?,
        Act::Gelu => x.gelu_erf(),
        Act::GeluTanh => x.gelu(),
        Act::Relu => x.relu(),
    }
}

/// The values of a tensor already in host memory (a CPU path's input): a copy, not a transfer.
/// A tensor on a GPU is an error here, so a device path cannot read back unseen.
#[allow(clippy::disallowed_methods)]
pub fn host_vec<T: candle_core::WithDType>(x: &Tensor) -> Result<Vec<T>> {
    if !x.device().is_cpu() {
        candle_core::bail!("host_vec of a tensor on {:?}: device tensors are read back through engine::sampling::read_back", x.device().location());
    }
    x.flatten_all()?.to_vec1()
}

/// `f` of `x`'s values as a host slice of `T`: borrowed where they lie when `x` is a
/// contiguous CPU tensor of `T` (a decode step's activations; the copy `host_vec` makes cost an
/// allocation and a pass for each of a step's ~150 products), else a converted copy.
pub fn with_host_slice<T: candle_core::WithDType, R>(x: &Tensor, f: impl FnOnce(&[T]) -> R) -> Result<R> {
    if x.dtype() == T::DTYPE && x.device().is_cpu() {
        let (storage, layout) = x.storage_and_layout();
        if let (candle_core::Storage::Cpu(cpu), Some((a, b))) = (&*storage, layout.contiguous_offsets()) {
            return Ok(f(&T::cpu_storage_as_slice(cpu)?[a..b]));
        }
    }
    Ok(f(&host_vec::<T>(&x.to_dtype(T::DTYPE)?)?))
}

/// `a + b` for tensors of one shape and dtype (a decoder layer's residual adds): on the CPU,
/// contiguous f32 and bf16 go through `cpu::elementwise` (candle's bf16 add runs a few
/// thousand values on the thread pool); anything else is candle's add.
pub fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    use crate::cpu::elementwise::{add_bf16, add_f32};
    if a.dims() != b.dims() || a.dtype() != b.dtype() {
        return a + b;
    }
    match binary_cpu(a, b, add_f32, add_bf16)? {
        Some(y) => Ok(y),
        None => a + b,
    }
}

/// `act(g) · u`, the gated feed-forward's middle (one pass for SiLU on the CPU).
pub fn gated(a: Act, g: &Tensor, u: &Tensor) -> Result<Tensor> {
    use crate::cpu::elementwise::{silu_mul_bf16, silu_mul_f32};
    if a == Act::Silu && g.dims() == u.dims() && g.dtype() == u.dtype() {
        if let Some(y) = binary_cpu(g, u, silu_mul_f32, silu_mul_bf16)? {
            return Ok(y);
        }
    }
    act(a, g)? * u
}

/// `f(a, b)` elementwise into a new tensor, on CPU f32 or bf16 tensors of one shape (the
/// caller checked it) whose rows are contiguous: whole contiguous tensors, or row-strided views
/// such as the gate and up halves narrowed from a joined gate_up product at prefill (without
/// that, every prefill's SiLU went through candle's strided unary map and scalar `expf`).
/// `None` when the tensors are not such.
fn binary_cpu(a: &Tensor, b: &Tensor, f32_op: fn(&[f32], &[f32], &mut [f32]), bf16_op: fn(&[half::bf16], &[half::bf16], &mut [half::bf16])) -> Result<Option<Tensor>> {
    use candle_core::{DType, Storage};
    if !crate::cpu::host_paths(a.device()) {
        return Ok(None);
    }
    let (Some(ra), Some(rb)) = (Rows::of(a), Rows::of(b)) else { return Ok(None) };
    let (sa, _) = a.storage_and_layout();
    let (sb, _) = b.storage_and_layout();
    let (Storage::Cpu(ca), Storage::Cpu(cb)) = (&*sa, &*sb) else { return Ok(None) };
    let y = match a.dtype() {
        DType::F32 => Tensor::from_vec(ra.zip(rb, ca.as_slice::<f32>()?, cb.as_slice::<f32>()?, f32_op), a.shape(), a.device())?,
        DType::BF16 => Tensor::from_vec(ra.zip(rb, ca.as_slice::<half::bf16>()?, cb.as_slice::<half::bf16>()?, bf16_op), a.shape(), a.device())?,
        _ => return Ok(None),
    };
    crate::cpu::note_kernel_run();
    Ok(Some(y))
}

/// A tensor's values as `count` rows of `len` contiguous values, `stride` apart from `start`.
#[derive(Clone, Copy)]
struct Rows {
    start: usize,
    count: usize,
    len: usize,
    stride: usize,
}

impl Rows {
    fn of(t: &Tensor) -> Option<Rows> {
        let l = t.layout();
        let (dims, strides) = (l.dims(), l.stride());
        let start = l.start_offset();
        if l.is_contiguous() || dims.len() < 2 {
            return l.is_contiguous().then_some(Rows { start, count: 1, len: t.elem_count(), stride: 0 });
        }
        let r = dims.len() - 1;
        // The last dimension contiguous, the leading ones (those of size 1 aside: their
        // stride is arbitrary) one run of rows.
        let lead: Vec<(usize, usize)> = (0..r).filter(|&i| dims[i] != 1).map(|i| (dims[i], strides[i])).collect();
        let one_run = lead.windows(2).all(|w| w[0].1 == w[1].1 * w[1].0);
        (strides[r] == 1 && one_run).then(|| Rows { start, count: dims[..r].iter().product(), len: dims[r], stride: lead.last().map_or(0, |l| l.1) })
    }

    /// `op` row by row into one contiguous vector (both tensors have this shape).
    fn zip<T: Copy + Default>(self, b: Rows, va: &[T], vb: &[T], op: fn(&[T], &[T], &mut [T])) -> Vec<T> {
        let mut out = vec![T::default(); self.count * self.len];
        for (i, o) in out.chunks_exact_mut(self.len.max(1)).enumerate() {
            op(&va[self.start + i * self.stride..][..self.len], &vb[b.start + i * b.stride..][..self.len], o);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;

    /// The CPU paths equal candle's ops: the adds exactly, `silu · u` within f32 rounding (f32)
    /// or one bf16 step; strided inputs take candle's path.
    #[test]
    fn add_and_gated_match_candle() -> Result<()> {
        let a = crate::testing::randn(106, (3, 77), 3.)?;
        let b = crate::testing::randn(107, (3, 77), 3.)?;
        for dt in [DType::F32, DType::BF16] {
            let (a, b) = (a.to_dtype(dt)?, b.to_dtype(dt)?);
            let diff = |x: &Tensor, y: &Tensor| -> Result<f32> { (x.to_dtype(DType::F32)? - y.to_dtype(DType::F32)?)?.abs()?.max_all()?.to_scalar::<f32>() };
            assert_eq!(diff(&add(&a, &b)?, &(&a + &b)?)?, 0.0, "{dt:?} add");
            let want = (act(Act::Silu, &a.to_dtype(DType::F32)?)?.to_dtype(dt)?.to_dtype(DType::F32)? * b.to_dtype(DType::F32)?)?;
            let bound = if dt == DType::F32 { 1e-5 } else { 2f32.powi(-7) * 40.0 };
            assert!(diff(&gated(Act::Silu, &a, &b)?, &want)? <= bound, "{dt:?} silu·u");
            let (at, bt) = (a.t()?, b.t()?);
            assert_eq!(diff(&add(&at, &bt)?, &(&at + &bt)?)?, 0.0, "{dt:?} strided add");
            // The halves of a joined gate_up product: rows `stride` apart, each contiguous.
            let joined = Tensor::cat(&[&a, &b], 1)?;
            let (g, u) = (joined.narrow(1, 0, 77)?, joined.narrow(1, 77, 77)?);
            assert!(!g.is_contiguous() && Rows::of(&g).is_some(), "a row-strided view");
            assert_eq!(diff(&gated(Act::Silu, &g, &u)?, &gated(Act::Silu, &a, &b)?)?, 0.0, "{dt:?} narrowed silu·u");
            let joined3 = joined.unsqueeze(1)?;
            let (g3, u3) = (joined3.narrow(2, 0, 77)?, joined3.narrow(2, 77, 77)?);
            assert_eq!(diff(&gated(Act::Silu, &g3, &u3)?, &gated(Act::Silu, &a, &b)?.unsqueeze(1)?)?, 0.0, "{dt:?} narrowed silu·u, rank 3");
            assert_eq!(diff(&add(&g3, &u3)?, &(&g3 + &u3)?)?, 0.0, "{dt:?} narrowed add, rank 3");
            assert_eq!(diff(&gated(Act::Gelu, &a, &b)?, &(a.gelu_erf()? * &b)?)?, 0.0, "{dt:?} gelu");
        }
        Ok(())
    }
}
