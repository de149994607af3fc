//! The Qwen2 text decoder both variants share, with sectioned multimodal rotary positions
//! (M-RoPE).
//!
//! Tensors are token-major and unbatched (`[T, hidden]`): the engine packs the tokens of many
//! sequences into one step and lets the `StepCache` keep them apart.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::Embedding;

use super::config::TextConfig;
use crate::layers::attention::SelfAttention;
use crate::layers::{Linear, Mlp, Norm, Rotary, RotaryLayout};
use crate::models::cache::StepCache;
use crate::models::Positions;
use crate::weights::Weights;

/// How a layer mixes tokens. Qwen2 layers are all attention; hybrid families add variants
/// (and their `LayerKind`) beside it.
enum Mixer {
    Attention(SelfAttention),
}

struct DecoderLayer {
    mixer: Mixer,
    mlp: Mlp,
    input_norm: Norm,
    post_attn_norm: Norm,
}

pub struct TextModel {
    embed: Embedding,
    layers: Vec<DecoderLayer>,
    norm: Norm,
    lm_head: Linear,
    rope: Rotary,
    cfg: TextConfig,
}

impl TextModel {
    /// `w` points at the decoder (`model.` in hub checkpoints); `lm_head` is looked up beside
    /// it in `root` unless embeddings are tied.
    pub fn new(cfg: &TextConfig, w: Weights, root: Weights) -> Result<Self> {
        let embed = candle_nn::embedding(cfg.vocab_size, cfg.hidden_size, w.pp("embed_tokens").vb().clone())?;
        let (h, d) = (cfg.hidden_size, cfg.head_dim());
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let lw = w.pp("layers").pp(i);
            let attn = SelfAttention::new(h, cfg.num_attention_heads, cfg.num_key_value_heads, d, true, lw.pp("self_attn"))?;
            layers.push(DecoderLayer {
                mixer: Mixer::Attention(attn),
                mlp: Mlp::gated(h, cfg.intermediate_size, false, cfg.hidden_act, lw.pp("mlp"))?,
                input_norm: Norm::rms(h, cfg.rms_norm_eps, lw.pp("input_layernorm"))?,
                post_attn_norm: Norm::rms(h, cfg.rms_norm_eps, lw.pp("post_attention_layernorm"))?,
            });
        }
        let norm = Norm::rms(h, cfg.rms_norm_eps, w.pp("norm"))?;
        let lm_head = if cfg.tie_word_embeddings {
            // A quantizing source gives the tied head its own quantized copy while the lookup
            // stays dense: the head is read whole every token, the lookup one row.
            match w.pp("embed_tokens").quantized("weight", &candle_core::Shape::from((cfg.vocab_size, h))) {
                Some(q) => Linear::quantized(q?, None)?,
                None => Linear::new(embed.embeddings().clone(), None),
            }
        } else {
            crate::layers::linear(h, cfg.vocab_size, false, root.pp("lm_head"))?
        };
        let sections = [cfg.mrope_section[0], cfg.mrope_section[1], cfg.mrope_section[2]];
        let rope = Rotary::new(d, cfg.rope_theta, &RotaryLayout::Sectioned(sections));
        Ok(TextModel { embed, layers, norm, lm_head, rope, cfg: cfg.clone() })
    }

    pub fn config(&self) -> &TextConfig {
        &self.cfg
    }

    pub fn dtype(&self) -> DType {
        self.embed.embeddings().dtype()
    }

    pub fn device(&self) -> &Device {
        self.embed.embeddings().device()
    }

    /// Token embeddings `[T, hidden]`.
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        let ids = Tensor::new(ids, self.device())?;
        self.embed.forward(&ids)
    }

    /// Runs the decoder over `T` new tokens; returns final-normed hidden states `[T, hidden]`.
    pub fn forward(&self, embeds: &Tensor, positions: &Positions, cache: &mut dyn StepCache) -> Result<Tensor> {
        let (cos, sin) = self.rope.tables(positions, self.device())?;
        let mut x = embeds.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            let h = layer.input_norm.forward(&x)?;
            let h = match &layer.mixer {
                Mixer::Attention(a) => a.forward(&h, &self.rope, &cos, &sin, i, cache)?,
            };
            let x1 = (&x + h)?;
            let h = layer.mlp.forward(&layer.post_attn_norm.forward(&x1)?)?;
            x = (x1 + h)?;
        }
        self.norm.forward(&x)
    }

    /// Vocabulary logits in f32, `[T, vocab]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(hidden)?.to_dtype(DType::F32)
    }
}
