//! Building blocks shared by every model family (decoders, vision towers, the metrics'
//! encoders), so a family difference is a choice of block, never a copied model:
//! - `linear`: one linear type for dense and quantized weights;
//! - `norm`, `mlp`: RMSNorm / LayerNorm, gated and plain feed-forwards;
//! - `rotary`: 1-D RoPE, sectioned and interleaved M-RoPE, partial rotary;
//! - `attention`: causal grouped-query attention over cached K/V (optional q/k norm), dense
//!   vision attention;
//! - `moe`: sparse mixture-of-experts feed-forward (top-k routing);
//! - `delta_net`, `delta_rule`: Gated DeltaNet (Qwen3.5's linear attention) and its gated
//!   delta rule, chunked and recurrent;
//! - `vision`: the ViT block, patch embedding and 2-D rotary of every Qwen vision tower.

pub mod attention;
pub mod delta_net;
pub mod delta_rule;
pub mod linear;
pub mod mlp;
pub mod moe;
pub mod norm;
pub mod rotary;
pub mod vision;

use candle_core::{Result, Tensor, D};
use serde::{Deserialize, Serialize};

pub use attention::{causal_gqa, causal_mask, dense_attention, softmax_f32};
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

/// Index of the max along the last dim of a 1-D f32 tensor, on the host.
pub fn argmax_last(x: &Tensor) -> Result<u32> {
    x.argmax(D::Minus1)?.to_scalar::<u32>()
}
