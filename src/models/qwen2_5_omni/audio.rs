//! Qwen2.5-Omni's audio tower, as transformers' `Qwen2_5OmniAudioEncoder`: log-mel frames cut
//! into windows of `2 · n_window` frames, each window through two convolutions (the second of
//! stride 2) with GELU and its own sinusoidal positions from 0; pre-LN transformer layers whose
//! attention stays inside a window; then the clip's states average-pooled by two, LayerNorm and
//! the projection to the text model's width. The layers are `layers::vision::VitLayer` under
//! Whisper's names.

use anyhow::{Context, Result};
use candle_core::{DType, Module, Tensor, D};

use super::config::AudioConfig;
use crate::layers::vision::{VitLayer, VitNames, VitShape};
use crate::layers::{linear, Act, Linear, Norm};
use crate::models::vlm::AudioEncoder;
use crate::weights::Weights;

/// torch.nn.LayerNorm's default, which the encoder's norms keep.
const LN_EPS: f64 = 1e-5;

pub struct AudioTower {
    conv1: Conv1d,
    conv2: Conv1d,
    /// Sinusoidal positions `[n_window, d_model]` (a window's states never pass n_window).
    positions: Tensor,
    layers: Vec<VitLayer>,
    ln_post: Norm,
    proj: Linear,
    window: usize,
    dtype: DType,
}

/// A `torch.nn.Conv1d` with bias and padding 1 (kernel 3).
struct Conv1d {
    weight: Tensor,
    bias: Tensor,
    stride: usize,
}

impl Conv1d {
    fn new(out: usize, inp: usize, stride: usize, w: Weights) -> candle_core::Result<Self> {
        Ok(Conv1d { weight: w.get((out, inp, 3), "weight")?, bias: w.get(out, "bias")?, stride })
    }

    /// `[b, in, len]` → `[b, out, (len - 1) / stride + 1]`.
    fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let y = x.conv1d(&self.weight, 1, self.stride, 1, 1)?;
        y.broadcast_add(&self.bias.reshape((1, (), 1))?)
    }
}

impl AudioTower {
    /// Loads `audio_tower.*`; a tensor that does not match `cfg` fails naming the config fields
    /// its shape comes from.
    pub fn new(cfg: &AudioConfig, w: Weights) -> Result<Self> {
        let d = cfg.d_model;
        let conv1 = Conv1d::new(d, cfg.num_mel_bins, 1, w.pp("conv1")).context("audio_tower.conv1 against audio_config.d_model and num_mel_bins")?;
        let conv2 = Conv1d::new(d, d, 2, w.pp("conv2")).context("audio_tower.conv2 against audio_config.d_model")?;
        let shape = VitShape { width: d, heads: cfg.encoder_attention_heads, mlp_width: cfg.encoder_ffn_dim, act: Act::Gelu, eps: LN_EPS };
        let mut layers = Vec::with_capacity(cfg.encoder_layers);
        for i in 0..cfg.encoder_layers {
            let layer = VitLayer::named(shape, VitNames::WHISPER, w.pp("layers").pp(i))
                .with_context(|| format!("audio_tower.layers.{i} against audio_config.d_model, encoder_ffn_dim and encoder_layers ({})", cfg.encoder_layers))?;
            layers.push(layer);
        }
        let proj = linear(d, cfg.output_dim, true, w.pp("proj")).context("audio_tower.proj against audio_config.d_model and output_dim")?;
        Ok(AudioTower {
            conv1,
            conv2,
            positions: sinusoids(cfg.n_window, d, w.device())?.to_dtype(w.dtype())?,
            layers,
            ln_post: Norm::layer(d, LN_EPS, w.pp("ln_post")).context("audio_tower.ln_post against audio_config.d_model")?,
            proj,
            window: 2 * cfg.n_window,
            dtype: w.dtype(),
        })
    }

    /// Windows `[b, mels, len]` → their states `[b · len', d]` with positions, `len'` each.
    fn front(&self, x: &Tensor) -> candle_core::Result<(Tensor, usize)> {
        let x = self.conv1.forward(x)?.gelu_erf()?;
        let x = self.conv2.forward(&x)?.gelu_erf()?.transpose(1, 2)?;
        let (b, len, d) = x.dims3()?;
        let x = x.broadcast_add(&self.positions.narrow(0, 0, len)?.unsqueeze(0)?)?;
        Ok((x.reshape((b * len, d))?, len))
    }
}

impl AudioEncoder for AudioTower {
    fn encode(&self, mel: &Tensor) -> Result<Tensor> {
        let (mels, frames) = mel.dims2()?;
        let mel = mel.to_dtype(self.dtype)?;
        let (full, tail) = (frames / self.window, frames % self.window);
        let (mut states, mut segs, mut start) = (vec![], vec![], 0);
        // Whole windows as one batch, the partial last window on its own: each window is
        // convolved with zero padding at its own edges, as transformers pads and masks them.
        if full > 0 {
            let x = mel.narrow(1, 0, full * self.window)?.reshape((mels, full, self.window))?.transpose(0, 1)?.contiguous()?;
            let (x, len) = self.front(&x)?;
            states.push(x);
            segs.extend((0..full).map(|i| (i * len, len)));
            start = full * len;
        }
        if tail > 0 {
            let (x, len) = self.front(&mel.narrow(1, full * self.window, tail)?.unsqueeze(0)?.contiguous()?)?;
            states.push(x);
            segs.push((start, len));
        }
        let mut x = Tensor::cat(&states, 0)?;
        for layer in &self.layers {
            x = layer.forward(&x, &segs)?;
        }
        // AvgPool1d(2, stride 2) over time: an odd last state is dropped.
        let (n, d) = x.dims2()?;
        let x = x.narrow(0, 0, n / 2 * 2)?.reshape((n / 2, 2, d))?.mean(1)?;
        Ok(self.proj.forward(&self.ln_post.forward(&x)?)?)
    }
}

/// transformers' `SinusoidsPositionEmbedding` rows `0..length`: `[sin(t·f), cos(t·f)]` with
/// `f_i = exp(-i · ln(10000) / (d/2 - 1))`, computed in f32 as torch does.
fn sinusoids(length: usize, d: usize, device: &candle_core::Device) -> candle_core::Result<Tensor> {
    let half = d / 2;
    let step = (10000f64.ln() / (half - 1) as f64) as f32;
    let inv: Vec<f32> = (0..half).map(|i| (-step * i as f32).exp()).collect();
    let t = Tensor::arange(0u32, length as u32, device)?.to_dtype(DType::F32)?.unsqueeze(1)?;
    let scaled = t.broadcast_mul(&Tensor::new(inv, device)?.unsqueeze(0)?)?;
    Tensor::cat(&[scaled.sin()?, scaled.cos()?], D::Minus1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Row t, column i of the table is sin(t·f_i), column half + i cos(t·f_i); f_0 = 1 and the
    /// last frequency is 1/10000.
    #[test]
    fn sinusoids_follow_whisper() -> candle_core::Result<()> {
        let s = sinusoids(5, 8, &Device::Cpu)?.to_vec2::<f32>()?;
        assert_eq!(s[0], vec![0., 0., 0., 0., 1., 1., 1., 1.]);
        assert!((s[3][0] - 3f32.sin()).abs() < 1e-6 && (s[3][4] - 3f32.cos()).abs() < 1e-6);
        assert!((s[4][3] - (4e-4f32).sin()).abs() < 1e-6, "{}", s[4][3]);
        Ok(())
    }
}
