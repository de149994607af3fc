//! The Qwen2 text decoder both VL families share, with multimodal rotary positions (M-RoPE).
//!
//! Tensors are token-major and unbatched (`[T, hidden]`): the engine packs the tokens of many
//! sequences into one step and lets the `AttentionBackend` keep them apart.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Embedding, Linear, VarBuilder};

use super::kv::AttentionBackend;
use super::layers::{apply_rope, linear, Mlp, Norm};
use crate::config::TextConfig;

/// M-RoPE tables. Each of the three position components (temporal, height, width) drives its
/// own section of the rotary half-dimension (`mrope_section`); text tokens have all three equal,
/// which reduces to plain 1-D RoPE.
#[derive(Clone, Debug)]
pub struct MRope {
    inv_freq: Vec<f32>,
    /// For each rotary frequency index, which position component (0=t, 1=h, 2=w) feeds it.
    component: Vec<usize>,
}

impl MRope {
    pub fn new(cfg: &TextConfig) -> Self {
        let dim = cfg.head_dim();
        let inv_freq = (0..dim / 2)
            .map(|i| (1.0 / cfg.rope_theta.powf((2 * i) as f64 / dim as f64)) as f32)
            .collect();
        let component = cfg
            .mrope_section
            .iter()
            .enumerate()
            .flat_map(|(c, &n)| std::iter::repeat_n(c, n))
            .collect();
        MRope { inv_freq, component }
    }

    /// `positions[c][i]` = component `c` of token `i` → `(cos, sin)`, each `[T, head_dim/2]` f32.
    pub fn tables(&self, positions: &[Vec<i64>; 3], dev: &Device) -> Result<(Tensor, Tensor)> {
        let t = positions[0].len();
        let half = self.inv_freq.len();
        let mut cos = Vec::with_capacity(t * half);
        let mut sin = Vec::with_capacity(t * half);
        for i in 0..t {
            for (f, &inv) in self.inv_freq.iter().enumerate() {
                // f32 product then f32 cos/sin, as transformers computes them.
                let angle = positions[self.component[f]][i] as f32 * inv;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        Ok((Tensor::from_vec(cos, (t, half), dev)?, Tensor::from_vec(sin, (t, half), dev)?))
    }
}

struct Attention {
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl Attention {
    fn new(cfg: &TextConfig, vb: VarBuilder) -> Result<Self> {
        let (h, kvh, d) = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim());
        Ok(Attention {
            q: linear(cfg.hidden_size, h * d, true, vb.pp("q_proj"))?,
            k: linear(cfg.hidden_size, kvh * d, true, vb.pp("k_proj"))?,
            v: linear(cfg.hidden_size, kvh * d, true, vb.pp("v_proj"))?,
            o: linear(h * d, cfg.hidden_size, false, vb.pp("o_proj"))?,
            heads: h,
            kv_heads: kvh,
            head_dim: d,
        })
    }

    fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        layer: usize,
        kv: &mut dyn AttentionBackend,
    ) -> Result<Tensor> {
        let t = x.dim(0)?;
        let q = self.q.forward(x)?.reshape((t, self.heads, self.head_dim))?;
        let k = self.k.forward(x)?.reshape((t, self.kv_heads, self.head_dim))?;
        let v = self.v.forward(x)?.reshape((t, self.kv_heads, self.head_dim))?;
        let q = apply_rope(&q, cos, sin)?;
        let k = apply_rope(&k, cos, sin)?;
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let out = kv.attend(layer, &q, &k, &v.contiguous()?, scale)?;
        self.o.forward(&out)
    }
}

struct DecoderLayer {
    attn: Attention,
    mlp: Mlp,
    input_norm: Norm,
    post_attn_norm: Norm,
}

pub struct TextModel {
    embed: Embedding,
    layers: Vec<DecoderLayer>,
    norm: Norm,
    lm_head: Linear,
    rope: MRope,
    cfg: TextConfig,
}

impl TextModel {
    /// `vb` points at the decoder (`model.` in hub checkpoints); `lm_head` is looked up beside
    /// it in `vb_root` unless embeddings are tied.
    pub fn new(cfg: &TextConfig, vb: VarBuilder, vb_root: VarBuilder) -> Result<Self> {
        let embed = candle_nn::embedding(cfg.vocab_size, cfg.hidden_size, vb.pp("embed_tokens"))?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for i in 0..cfg.num_hidden_layers {
            let lvb = vb.pp("layers").pp(i);
            layers.push(DecoderLayer {
                attn: Attention::new(cfg, lvb.pp("self_attn"))?,
                mlp: Mlp::gated(cfg.hidden_size, cfg.intermediate_size, false, cfg.hidden_act, lvb.pp("mlp"))?,
                input_norm: Norm::rms(cfg.hidden_size, cfg.rms_norm_eps, lvb.pp("input_layernorm"))?,
                post_attn_norm: Norm::rms(cfg.hidden_size, cfg.rms_norm_eps, lvb.pp("post_attention_layernorm"))?,
            });
        }
        let norm = Norm::rms(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("norm"))?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear::new(embed.embeddings().clone(), None)
        } else {
            candle_nn::linear_no_bias(cfg.hidden_size, cfg.vocab_size, vb_root.pp("lm_head"))?
        };
        Ok(TextModel { embed, layers, norm, lm_head, rope: MRope::new(cfg), cfg: cfg.clone() })
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
    pub fn forward(
        &self,
        embeds: &Tensor,
        positions: &[Vec<i64>; 3],
        kv: &mut dyn AttentionBackend,
    ) -> Result<Tensor> {
        let (cos, sin) = self.rope.tables(positions, self.device())?;
        let mut x = embeds.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            let residual = &x;
            let h = layer.attn.forward(&layer.input_norm.forward(&x)?, &cos, &sin, i, kv)?;
            let x1 = (residual + h)?;
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
