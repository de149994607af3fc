//! Feed-forward blocks: gated SwiGLU-style (Qwen text, Qwen2.5-VL vision) or fc1 → act → fc2
//! (Qwen2-VL, Qwen3-VL vision).

use candle_core::{Module, Result, Tensor};

use super::{act, linear, Act, Fused, Linear};
use crate::weights::Weights;

#[derive(Clone, Debug)]
pub enum Mlp {
    /// `gate_up`: gate_proj and up_proj, joined into one product where their weights allow.
    Gated { gate_up: Fused, down: Linear, act: Act },
    Plain { fc1: Linear, fc2: Linear, act: Act },
}

impl Mlp {
    pub fn gated(dim: usize, hidden: usize, bias: bool, act: Act, vb: Weights) -> Result<Self> {
        Ok(Mlp::Gated {
            gate_up: Fused::new(vec![linear(dim, hidden, bias, vb.pp("gate_proj"))?, linear(dim, hidden, bias, vb.pp("up_proj"))?])?,
            down: linear(hidden, dim, bias, vb.pp("down_proj"))?,
            act,
        })
    }
    pub fn plain(dim: usize, hidden: usize, act: Act, vb: Weights) -> Result<Self> {
        Self::plain_named(dim, hidden, act, vb, ["fc1", "fc2"])
    }
    /// A plain MLP whose two layers have other names (Qwen3-VL: `linear_fc1`, `linear_fc2`).
    pub fn plain_named(dim: usize, hidden: usize, act: Act, vb: Weights, [n1, n2]: [&str; 2]) -> Result<Self> {
        Ok(Mlp::Plain { fc1: linear(dim, hidden, true, vb.pp(n1))?, fc2: linear(hidden, dim, true, vb.pp(n2))?, act })
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Mlp::Gated { gate_up, down, act: a } => {
                let [g, u]: [Tensor; 2] = gate_up.forward(x)?.try_into().map_err(|_| candle_core::Error::Msg("gate/up: two outputs expected".into()))?;
                down.forward(&super::gated(*a, &g, &u)?)
            }
            Mlp::Plain { fc1, fc2, act: a } => fc2.forward(&act(*a, &fc1.forward(x)?)?),
        }
    }
}
