//! Normalisations: RMSNorm (Qwen text decoders, Qwen2.5-VL vision), zero-centred RMSNorm
//! (Qwen3.5: the weight is stored as an offset from one), the gated RMSNorm inside Gated
//! DeltaNet, and LayerNorm (Qwen2-VL / Qwen3-VL vision, BERT-family encoders).

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{LayerNorm, RmsNorm};

use crate::weights::Weights;

#[derive(Clone, Debug)]
pub enum Norm {
    Rms(RmsNorm),
    /// `x · rsqrt(mean(x²) + eps) · (1 + w)` in f32, cast back after the product (as
    /// transformers' Qwen3_5RMSNorm). Holds `1 + w` in f32.
    RmsOffset { scale: Tensor, eps: f64 },
    Layer(LayerNorm),
}

impl Norm {
    pub fn rms(dim: usize, eps: f64, vb: Weights) -> Result<Self> {
        Ok(Norm::Rms(candle_nn::rms_norm(dim, eps, vb.vb().clone())?))
    }
    /// Zero-centred RMSNorm: the checkpoint stores `w` with the scale `1 + w`.
    pub fn rms_offset(dim: usize, eps: f64, vb: Weights) -> Result<Self> {
        let w = vb.vb().get_with_hints(dim, "weight", candle_nn::Init::Const(0.0))?;
        Ok(Norm::RmsOffset { scale: (w.to_dtype(DType::F32)? + 1.0)?, eps })
    }
    pub fn layer(dim: usize, eps: f64, vb: Weights) -> Result<Self> {
        Ok(Norm::Layer(candle_nn::layer_norm(dim, eps, vb.vb().clone())?))
    }
}

/// `x · rsqrt(mean(x²) + eps)` over the last dim, in f32.
fn rms_normalise(x: &Tensor, eps: f64) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    let ms = x.sqr()?.mean_keepdim(D::Minus1)?;
    x.broadcast_div(&(ms + eps)?.sqrt()?)
}

impl Module for Norm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Norm::Rms(n) => match rms_host(x, n)? {
                Some(y) => Ok(y),
                None => n.forward(x),
            },
            Norm::RmsOffset { scale, eps } => rms_normalise(x, *eps)?.broadcast_mul(scale)?.to_dtype(x.dtype()),
            Norm::Layer(n) => n.forward(x),
        }
    }
}

/// `n` of a contiguous f32 or bf16 `x` on the CPU in one host pass (`cpu::elementwise::rms_norm`):
/// a decode step's ~50 norms of one row each went through candle's op, which sums the squares
/// one after another. `None`: not such a tensor.
fn rms_host(x: &Tensor, n: &RmsNorm) -> Result<Option<Tensor>> {
    fn run<T: candle_core::WithDType + crate::cpu::elementwise::Norm>(x: &Tensor, w: &Tensor, eps: f32) -> Result<Tensor> {
        let mut out = vec![T::zero(); x.elem_count()];
        crate::layers::with_host_slice(w, |w: &[T]| crate::layers::with_host_slice(x, |xs: &[T]| crate::cpu::elementwise::rms_norm(xs, w, eps, &mut out)))??;
        Tensor::from_vec(out, x.shape(), x.device())
    }
    let w = n.weight();
    if !crate::cpu::host_paths(x.device()) || !x.is_contiguous() || w.dtype() != x.dtype() || w.dims1()? != x.dim(candle_core::D::Minus1)? || !w.is_contiguous() {
        return Ok(None);
    }
    crate::cpu::note_kernel_run();
    match x.dtype() {
        DType::F32 => run::<f32>(x, w, n.eps() as f32).map(Some),
        DType::BF16 => run::<half::bf16>(x, w, n.eps() as f32).map(Some),
        _ => Ok(None),
    }
}

/// Gated DeltaNet's output norm: RMSNorm (weight as is, applied in the input dtype) times
/// `silu(gate)` in f32, as transformers' Qwen3_5RMSNormGated.
#[derive(Clone, Debug)]
pub struct GatedRmsNorm {
    weight: Tensor,
    eps: f64,
}

impl GatedRmsNorm {
    pub fn new(dim: usize, eps: f64, vb: Weights) -> Result<Self> {
        Ok(GatedRmsNorm { weight: vb.vb().get_with_hints(dim, "weight", candle_nn::Init::Const(1.0))?, eps })
    }

    /// `x, gate: [N, dim]`.
    pub fn forward(&self, x: &Tensor, gate: &Tensor) -> Result<Tensor> {
        let dt = x.dtype();
        let h = rms_normalise(x, self.eps)?.to_dtype(dt)?.broadcast_mul(&self.weight.to_dtype(dt)?)?;
        let g = candle_nn::ops::silu(&gate.to_dtype(DType::F32)?)?;
        (h.to_dtype(DType::F32)? * g)?.to_dtype(dt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The host pass is candle's RMSNorm up to the order of the sum of squares (candle's
    /// one-after-another f32 sum of 2,048 squares is itself off by ~1e-5 of it): f32 within
    /// 2e-5 of each value, bf16 within one bf16 step, for one row and for rows past the
    /// parallel bound (widths on and off the sixteen-value chunks).
    #[test]
    fn the_host_norm_is_candles() -> Result<()> {
        for (rows, width) in [(1, 896), (40, 77), (3, 2048)] {
            for dt in [DType::F32, DType::BF16] {
                let x = (crate::testing::randn(110 + rows as u64, (rows, width), 3.)? + 0.5)?.to_dtype(dt)?;
                let w = crate::testing::randn(111, width, 1.)?.to_dtype(dt)?;
                let n = RmsNorm::new(w, 1e-6);
                let Some(got) = rms_host(&x, &n)? else {
                    assert!(!crate::cpu::host_paths(x.device()));
                    return Ok(());
                };
                let want = candle_nn::ops::rms_norm(&x, n.weight(), 1e-6)?;
                let (got, want) = (got.to_dtype(DType::F32)?, want.to_dtype(DType::F32)?);
                let tol = if dt == DType::F32 { 2e-5 } else { 2f32.powi(-7) };
                let bad = ((&got - &want)?.abs()? - (want.abs()? * tol as f64)?)?.max_all()?.to_scalar::<f32>()?;
                assert!(bad <= 1e-30, "{rows}x{width} {dt:?}: off by {bad} past the bound");
            }
        }
        Ok(())
    }

    /// A zero-centred norm with weight w equals a plain RMSNorm with weight 1 + w.
    #[test]
    fn offset_norm_is_rms_with_one_plus_w() -> Result<()> {
        let x = crate::testing::randn(108, (3, 8), 1.)?;
        let w = crate::testing::randn(109, 8, 0.1)?;
        let offset = Norm::RmsOffset { scale: (&w + 1.0)?, eps: 1e-6 };
        let plain = candle_nn::RmsNorm::new((&w + 1.0)?, 1e-6);
        let d = (offset.forward(&x)? - plain.forward(&x)?)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d < 1e-5, "{d}");
        Ok(())
    }
}
