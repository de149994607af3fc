//! The Qwen text decoder every family here shares: Qwen2 (q/k/v biases), Qwen3 (per-head q/k
//! RMSNorm, no biases, head_dim from the config), dense or sparse-MoE feed-forwards, sectioned
//! or interleaved M-RoPE, DeepStack (visual features added to the hidden states of the first
//! layers), and Qwen3.5's hybrid of Gated DeltaNet and gated attention layers (zero-centred
//! norms, partial rotary). A family describes its decoder in a `DecoderConfig`; no family
//! copies it.
//!
//! Tensors are token-major and unbatched (`[T, hidden]`): the engine packs the tokens of many
//! sequences into one step and lets the `StepCache` keep them apart.

use candle_core::{DType, Device, Module, Result, Tensor};

use super::cache::StepCache;
use super::{Deepstack, LayerKind, Positions};
use crate::layers::attention::{AttentionShape, SelfAttention};
use crate::layers::delta_net::{DeltaNetShape, GatedDeltaNet};
use crate::layers::moe::{MoeShape, SparseMoe};
use crate::layers::{Act, Embedding, Linear, Mlp, Norm, Rotary, RotaryLayout};
use crate::weights::Weights;

#[derive(Clone, Debug)]
pub struct DecoderConfig {
    pub vocab_size: usize,
    pub num_layers: usize,
    pub attention: AttentionShape,
    pub intermediate_size: usize,
    pub hidden_act: Act,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope: RotaryLayout,
    /// Channels of a head that rotate (head_dim, or a share of it: Qwen3.5's 0.25).
    pub rotary_dim: usize,
    /// Zero-centred RMSNorms (`1 + w`, Qwen3.5) instead of plain ones.
    pub norm_offset: bool,
    pub tie_word_embeddings: bool,
    /// Sparse feed-forwards, and which layers have one (the others stay dense).
    pub moe: Option<(MoeShape, Vec<bool>)>,
    /// Gated DeltaNet mixers, and which layers have one (the others attend).
    pub linear: Option<(DeltaNetShape, Vec<bool>)>,
    /// Gemma 3's layer layout; `None` for the Qwen decoders.
    pub gemma: Option<GemmaLayout>,
}

/// What Gemma 3 changes in the layers: norms after attention and after the feed-forward too
/// (besides before each), embeddings scaled by √hidden, its own query scale, and local
/// (sliding-window) layers with their own rope base between global ones.
#[derive(Clone, Debug)]
pub struct GemmaLayout {
    /// Scores' scale, `query_pre_attn_scalar`^-½.
    pub query_scale: f64,
    pub sliding_window: usize,
    /// Which layers are local (sliding-window).
    pub sliding: Vec<bool>,
    /// Rope base of the local layers (`rope_local_base_freq`); global layers use `rope_theta`.
    pub local_rope_theta: f64,
    /// Linear rope scaling of the global layers (positions divided by it); 1 for none.
    pub global_rope_factor: f64,
}

impl GemmaLayout {
    fn window(&self, layer: usize) -> Option<usize> {
        self.sliding.get(layer).copied().unwrap_or(false).then_some(self.sliding_window)
    }
}

impl DecoderConfig {
    pub fn hidden(&self) -> usize {
        self.attention.hidden
    }

    fn is_linear(&self, layer: usize) -> Option<DeltaNetShape> {
        self.linear.as_ref().filter(|(_, which)| which.get(layer).copied().unwrap_or(false)).map(|(s, _)| *s)
    }

    /// What each layer keeps between steps.
    pub fn layer_kinds(&self) -> Vec<LayerKind> {
        (0..self.num_layers)
            .map(|i| match self.is_linear(i) {
                Some(s) => {
                    let (conv_shape, state_shape) = s.state_shapes();
                    LayerKind::Recurrent { conv_shape, state_shape }
                }
                // Gemma 3's local layers: the engine keeps only their window's K/V.
                None => match self.gemma.as_ref().and_then(|g| g.window(i)) {
                    Some(window) => LayerKind::SlidingAttention { window },
                    None => LayerKind::Attention,
                },
            })
            .collect()
    }

    /// Parameters (linear-layer weights, everything else): the split a quantizer cares about
    /// (embeddings, norms, biases and recurrent parameters stay dense).
    pub fn num_params(&self) -> (u64, u64) {
        let a = &self.attention;
        let (h, v) = (a.hidden as u64, self.vocab_size as u64);
        let (mut linear, mut other) = (0u64, v * h + h);
        if !self.tie_word_embeddings {
            linear += v * h;
        }
        let (q, kv) = ((a.heads * a.head_dim) as u64, (a.kv_heads * a.head_dim) as u64);
        let norms_per_layer = if self.gemma.is_some() { 4 } else { 2 };
        for i in 0..self.num_layers {
            other += norms_per_layer * h;
            match self.is_linear(i) {
                Some(s) => {
                    let (cd, vd, hv) = (s.conv_dim() as u64, s.value_dim() as u64, s.dims.v_heads as u64);
                    linear += h * cd + h * vd + 2 * h * hv + vd * h;
                    other += cd * s.conv_kernel as u64 + 2 * hv + s.dims.dv as u64;
                }
                None => {
                    let gate = if a.output_gate { 2 } else { 1 };
                    linear += h * q * gate + 2 * h * kv + q * h;
                    if a.qkv_bias {
                        other += q + 2 * kv;
                    }
                    if a.qk_norm_eps.is_some() {
                        other += 2 * a.head_dim as u64;
                    }
                }
            }
            match &self.moe {
                Some((m, sparse)) if sparse.get(i).copied().unwrap_or(false) => {
                    linear += h * m.num_experts as u64 + 3 * h * (m.expert_width * m.num_experts) as u64;
                }
                _ => linear += 3 * h * self.intermediate_size as u64,
            }
        }
        (linear, other)
    }

    /// Parameters one token runs through (MoE: only its top-k experts).
    pub fn active_params(&self) -> u64 {
        let (l, o) = self.num_params();
        let idle: u64 = match &self.moe {
            Some((m, sparse)) => sparse.iter().filter(|s| **s).count() as u64 * 3 * (m.hidden * m.expert_width * (m.num_experts - m.top_k)) as u64,
            None => 0,
        };
        l + o - idle
    }

    /// Layer `i`'s attention: Gemma 3's query scale and, on local layers, its window.
    fn attention_layer(&self, i: usize, w: Weights) -> Result<SelfAttention> {
        let a = SelfAttention::new(self.attention, w)?;
        Ok(match &self.gemma {
            Some(g) => a.with_scale(g.query_scale).with_window(g.window(i)),
            None => a,
        })
    }

    /// Layer `i`'s norms around its mixer and feed-forward (Gemma 3: four of them).
    fn layer(&self, mixer: Mixer, ffn: Ffn, i: usize, lw: &Weights) -> Result<DecoderLayer> {
        let h = self.hidden();
        let input_norm = self.norm(h, lw.pp("input_layernorm"))?;
        Ok(match &self.gemma {
            Some(g) => DecoderLayer {
                mixer,
                ffn,
                input_norm,
                attn_out_norm: Some(self.norm(h, lw.pp("post_attention_layernorm"))?),
                ffn_norm: self.norm(h, lw.pp("pre_feedforward_layernorm"))?,
                ffn_out_norm: Some(self.norm(h, lw.pp("post_feedforward_layernorm"))?),
                local_rope: g.window(i).is_some(),
            },
            None => DecoderLayer { mixer, ffn, input_norm, attn_out_norm: None, ffn_norm: self.norm(h, lw.pp("post_attention_layernorm"))?, ffn_out_norm: None, local_rope: false },
        })
    }

    fn norm(&self, dim: usize, w: Weights) -> Result<Norm> {
        match self.norm_offset {
            true => Norm::rms_offset(dim, self.rms_norm_eps, w),
            false => Norm::rms(dim, self.rms_norm_eps, w),
        }
    }
}

fn optional_norm(norm: &Option<Norm>, x: Tensor) -> Result<Tensor> {
    match norm {
        Some(n) => n.forward(&x),
        None => Ok(x),
    }
}

/// `x` as the nearest value of `dtype` (a scalar transformers casts to the weights' dtype).
fn rounded_to(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::BF16 => half::bf16::from_f64(x).to_f64(),
        DType::F16 => half::f16::from_f64(x).to_f64(),
        DType::F32 => x as f32 as f64,
        _ => x,
    }
}

/// How a layer mixes tokens. Hybrid families add variants (and their `LayerKind`) beside it.
enum Mixer {
    Attention(SelfAttention),
    Linear(GatedDeltaNet),
}

enum Ffn {
    Dense(Mlp),
    Sparse(SparseMoe),
}

struct DecoderLayer {
    mixer: Mixer,
    ffn: Ffn,
    input_norm: Norm,
    /// Gemma 3: the attention's output is normed before the residual add.
    attn_out_norm: Option<Norm>,
    /// Before the feed-forward (Qwen's `post_attention_layernorm`, Gemma's
    /// `pre_feedforward_layernorm`).
    ffn_norm: Norm,
    /// Gemma 3: the feed-forward's output is normed before the residual add.
    ffn_out_norm: Option<Norm>,
    /// Local layers: the global (default) or local rope tables.
    local_rope: bool,
}

pub struct Decoder {
    embed: Embedding,
    layers: Vec<DecoderLayer>,
    norm: Norm,
    lm_head: Linear,
    rope: Rotary,
    /// Gemma 3's local layers' rope (their own base, no scaling).
    local_rope: Option<Rotary>,
    /// Gemma 3: embeddings times √hidden, rounded to the weights' dtype as transformers does.
    embed_scale: Option<f64>,
    cfg: DecoderConfig,
}

impl Decoder {
    /// `w` points at the decoder (`model.` or `model.language_model.`); `lm_head` is looked up
    /// beside it in `root` unless embeddings are tied.
    pub fn new(cfg: &DecoderConfig, w: Weights, root: Weights) -> Result<Self> {
        let h = cfg.hidden();
        let mut embed = Embedding::new(cfg.vocab_size, h, &w.pp("embed_tokens"))?;
        if cfg.tie_word_embeddings {
            // The tied head streams the table every token: huge pages, as for other linears.
            embed = embed.rehomed()?;
        }
        let mut layers = Vec::with_capacity(cfg.num_layers);
        for i in 0..cfg.num_layers {
            let lw = w.pp("layers").pp(i);
            let ffn = match &cfg.moe {
                Some((shape, sparse)) if sparse.get(i).copied().unwrap_or(false) => Ffn::Sparse(SparseMoe::new(*shape, lw.pp("mlp"))?),
                _ => Ffn::Dense(Mlp::gated(h, cfg.intermediate_size, false, cfg.hidden_act, lw.pp("mlp"))?),
            };
            let mixer = match cfg.is_linear(i) {
                Some(s) => Mixer::Linear(GatedDeltaNet::new(s, cfg.rms_norm_eps, lw.pp("linear_attn"))?),
                None => Mixer::Attention(cfg.attention_layer(i, lw.pp("self_attn"))?),
            };
            layers.push(cfg.layer(mixer, ffn, i, &lw)?);
        }
        let norm = cfg.norm(h, w.pp("norm"))?;
        let lm_head = match embed.dense() {
            // A quantizing source gives the tied head its own quantized copy while the lookup
            // stays dense: the head is read whole every token, the lookup one row.
            Some(table) if cfg.tie_word_embeddings => match w.pp("embed_tokens").quantized("weight", &candle_core::Shape::from((cfg.vocab_size, h))) {
                Some(q) => Linear::quantized(q?, None)?,
                None => Linear::shared(table.clone(), None),
            },
            // Lookups read the mapped file; the head gets the table's one copy (packed).
            None if cfg.tie_word_embeddings => crate::layers::linear(h, cfg.vocab_size, false, w.pp("embed_tokens"))?,
            _ => crate::layers::linear(h, cfg.vocab_size, false, root.pp("lm_head"))?,
        };
        let mut rope = Rotary::new(cfg.rotary_dim, cfg.rope_theta, &cfg.rope);
        let (mut local_rope, mut embed_scale) = (None, None);
        if let Some(g) = &cfg.gemma {
            rope = rope.linear_scaled(g.global_rope_factor);
            local_rope = Some(Rotary::new(cfg.rotary_dim, g.local_rope_theta, &cfg.rope));
            embed_scale = Some(rounded_to(embed.dtype(), (h as f64).sqrt()));
        }
        Ok(Decoder { embed, layers, norm, lm_head, rope, local_rope, embed_scale, cfg: cfg.clone() })
    }

    pub fn config(&self) -> &DecoderConfig {
        &self.cfg
    }

    pub fn dtype(&self) -> DType {
        self.embed.dtype()
    }

    pub fn device(&self) -> &Device {
        self.embed.device()
    }

    /// Token embeddings `[T, hidden]` (Gemma 3: scaled).
    pub fn embed(&self, ids: &[u32]) -> Result<Tensor> {
        let x = self.embed.lookup(ids)?;
        match self.embed_scale {
            Some(s) => x * s,
            None => Ok(x),
        }
    }

    /// Runs the decoder over `T` new tokens; returns final-normed hidden states `[T, hidden]`.
    /// `deepstack` rows are indices into this step's tokens.
    pub fn forward(&self, embeds: &Tensor, positions: &Positions, deepstack: Option<&Deepstack>, cache: &mut dyn StepCache) -> Result<Tensor> {
        crate::cpu::on_pool(self.device(), || self.forward_layers(embeds, positions, deepstack, cache))
    }

    fn forward_layers(&self, embeds: &Tensor, positions: &Positions, deepstack: Option<&Deepstack>, cache: &mut dyn StepCache) -> Result<Tensor> {
        let (cos, sin) = self.rope.tables(positions, self.device())?;
        let local = match &self.local_rope {
            Some(r) => Some(r.tables(positions, self.device())?),
            None => None,
        };
        let hidden = self.cfg.hidden();
        let deep = match deepstack {
            Some(d) if !d.rows.is_empty() => Some((Tensor::new(d.rows.as_slice(), self.device())?, d)),
            _ => None,
        };
        let mut x = embeds.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            let h = layer.input_norm.forward(&x)?;
            let (rope, cos, sin) = match (&local, &self.local_rope) {
                (Some((c, s)), Some(r)) if layer.local_rope => (r, c, s),
                _ => (&self.rope, &cos, &sin),
            };
            let h = match &layer.mixer {
                Mixer::Attention(a) => a.forward(&h, rope, cos, sin, i, cache)?,
                Mixer::Linear(l) => l.forward(&h, i, cache)?,
            };
            let h = optional_norm(&layer.attn_out_norm, h)?;
            let x1 = crate::layers::add(&x, &h)?;
            let h = layer.ffn_norm.forward(&x1)?;
            let h = match &layer.ffn {
                Ffn::Dense(m) => m.forward(&h)?,
                Ffn::Sparse(m) => m.forward(&h)?,
            };
            let h = optional_norm(&layer.ffn_out_norm, h)?;
            x = crate::layers::add(&x1, &h)?;
            // DeepStack: level i of the visual features joins the residual after layer i.
            if let Some((rows, d)) = &deep {
                if i < d.levels(hidden)? {
                    let f = d.features.narrow(1, i * hidden, hidden)?.to_dtype(x.dtype())?.contiguous()?;
                    x = x.index_add(rows, &f, 0)?;
                }
            }
        }
        self.norm.forward(&x)
    }

    /// Vocabulary logits in f32, `[T, vocab]`.
    pub fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        self.lm_head.forward(hidden)?.to_dtype(DType::F32)
    }
}

