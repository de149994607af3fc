//! Normalisations: RMSNorm (Qwen text decoders, Qwen2.5-VL vision) and LayerNorm (Qwen2-VL
//! vision, BERT-family encoders).

use candle_core::{Module, Result, Tensor};
use candle_nn::{LayerNorm, RmsNorm};

use crate::weights::Weights;

#[derive(Clone, Debug)]
pub enum Norm {
    Rms(RmsNorm),
    Layer(LayerNorm),
}

impl Norm {
    pub fn rms(dim: usize, eps: f64, vb: Weights) -> Result<Self> {
        Ok(Norm::Rms(candle_nn::rms_norm(dim, eps, vb.vb().clone())?))
    }
    pub fn layer(dim: usize, eps: f64, vb: Weights) -> Result<Self> {
        Ok(Norm::Layer(candle_nn::layer_norm(dim, eps, vb.vb().clone())?))
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
