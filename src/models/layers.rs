//! Building blocks shared by both Qwen-VL families (text decoder and both vision towers),
//! so a family difference is a choice of block, never a copied model.

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{LayerNorm, Linear, RmsNorm, VarBuilder};

use crate::config::Act;

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

pub fn linear(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    if bias {
        candle_nn::linear(in_dim, out_dim, vb)
    } else {
        candle_nn::linear_no_bias(in_dim, out_dim, vb)
    }
}

/// RMSNorm (Qwen2 text, Qwen2.5-VL vision) or LayerNorm (Qwen2-VL vision).
#[derive(Clone, Debug)]
pub enum Norm {
    Rms(RmsNorm),
    Layer(LayerNorm),
}

impl Norm {
    pub fn rms(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Norm::Rms(candle_nn::rms_norm(dim, eps, vb)?))
    }
    pub fn layer(dim: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Norm::Layer(candle_nn::layer_norm(dim, eps, vb)?))
    }
}

impl Module for Norm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Norm::Rms(n) => n.forward(x),
            Norm::Layer(n) => n.forward(x),
        }
    }
}

/// Feed-forward: gated SwiGLU-style (Qwen2 text, Qwen2.5-VL vision) or fc1→act→fc2 (Qwen2-VL vision).
#[derive(Clone, Debug)]
pub enum Mlp {
    Gated { gate: Linear, up: Linear, down: Linear, act: Act },
    Plain { fc1: Linear, fc2: Linear, act: Act },
}

impl Mlp {
    pub fn gated(dim: usize, hidden: usize, bias: bool, act: Act, vb: VarBuilder) -> Result<Self> {
        Ok(Mlp::Gated {
            gate: linear(dim, hidden, bias, vb.pp("gate_proj"))?,
            up: linear(dim, hidden, bias, vb.pp("up_proj"))?,
            down: linear(hidden, dim, bias, vb.pp("down_proj"))?,
            act,
        })
    }
    pub fn plain(dim: usize, hidden: usize, act: Act, vb: VarBuilder) -> Result<Self> {
        Ok(Mlp::Plain {
            fc1: linear(dim, hidden, true, vb.pp("fc1"))?,
            fc2: linear(hidden, dim, true, vb.pp("fc2"))?,
            act,
        })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Mlp::Gated { gate, up, down, act: a } => {
                let g = act(*a, &gate.forward(x)?)?;
                down.forward(&(g * up.forward(x)?)?)
            }
            Mlp::Plain { fc1, fc2, act: a } => fc2.forward(&act(*a, &fc1.forward(x)?)?),
        }
    }
}

/// Rotary embedding on a token-major tensor `x: [T, heads, head_dim]` with half-width tables
/// `cos, sin: [T, head_dim/2]` (NeoX "rotate_half" convention, as both families use). Computed
/// in f32 like transformers, then cast back.
pub fn apply_rope(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let dtype = x.dtype();
    let x32 = x.to_dtype(DType::F32)?.unsqueeze(0)?.contiguous()?;
    let out = candle_nn::rotary_emb::rope_thd(&x32, cos, sin)?;
    out.squeeze(0)?.to_dtype(dtype)
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

/// Index of the max along the last dim of a 1-D f32 tensor, on the host.
pub fn argmax_last(x: &Tensor) -> Result<u32> {
    x.argmax(D::Minus1)?.to_scalar::<u32>()
}
