//! `config.json` of a Qwen3-VL / Qwen3-VL-MoE checkpoint, read the way transformers 4.57
//! reads it: text fields in `text_config` (top-level fields are a fallback), vision fields in
//! `vision_config`, rotary settings in `rope_scaling` or (transformers 5) `rope_parameters`.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

use crate::layers::attention::AttentionShape;
use crate::layers::moe::MoeShape;
use crate::layers::{Act, RotaryLayout};
use crate::models::decoder::DecoderConfig;
use crate::models::SpecialIds;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    /// transformers' Qwen3-VL default is 128 whatever hidden / heads is.
    #[serde(default = "default_head_dim")]
    pub head_dim: usize,
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "default_silu")]
    pub hidden_act: Act,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// (t, h, w) shares of the rotary half-dimension, interleaved.
    pub mrope_section: Vec<usize>,
    /// Share of each head that rotates (Qwen3.5: 0.25; Qwen3-VL: all of it).
    #[serde(default = "one_f64")]
    pub partial_rotary_factor: f64,
    // MoE (qwen3_vl_moe) fields.
    #[serde(default)]
    pub num_experts: usize,
    #[serde(default)]
    pub num_experts_per_tok: usize,
    #[serde(default)]
    pub moe_intermediate_size: usize,
    #[serde(default = "one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Vec<usize>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VisionConfig {
    pub depth: usize,
    pub hidden_size: usize,
    #[serde(default = "default_gelu_tanh")]
    pub hidden_act: Act,
    pub intermediate_size: usize,
    pub num_heads: usize,
    #[serde(default = "three")]
    pub in_channels: usize,
    #[serde(default = "sixteen")]
    pub patch_size: usize,
    #[serde(default = "two")]
    pub spatial_merge_size: usize,
    #[serde(default = "two")]
    pub temporal_patch_size: usize,
    pub out_hidden_size: usize,
    /// Learned positions on a square grid, interpolated to each image's grid.
    #[serde(default = "default_num_pos")]
    pub num_position_embeddings: usize,
    /// Blocks whose output feeds a DeepStack merger, in the order of the mergers.
    #[serde(default)]
    pub deepstack_visual_indexes: Vec<usize>,
}

impl TextConfig {
    /// Channels of a head that rotate.
    pub fn rotary_dim(&self) -> usize {
        (self.head_dim as f64 * self.partial_rotary_factor) as usize
    }
}

impl VisionConfig {
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads.max(1)
    }
    /// Parameters of the tower: patch embedding (with bias), learned positions, blocks
    /// (LayerNorms, qkv, proj, MLP, all with biases), the merger and the DeepStack mergers.
    pub fn num_params(&self) -> u64 {
        let (w, i) = (self.hidden_size as u64, self.intermediate_size as u64);
        let m = w * (self.spatial_merge_size * self.spatial_merge_size) as u64;
        let patch = (self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size) as u64;
        let block = 4 * w + (3 * w * w + 3 * w) + (w * w + w) + (w * i + i) + (i * w + w);
        let merger = |norm: u64| 2 * norm + (m * m + m) + (m * self.out_hidden_size as u64 + self.out_hidden_size as u64);
        (w * patch + w) + self.num_position_embeddings as u64 * w + self.depth as u64 * block + merger(w) + self.deepstack_visual_indexes.len() as u64 * merger(m)
    }

    /// Side of the learned position grid.
    pub fn pos_side(&self) -> usize {
        (self.num_position_embeddings as f64).sqrt() as usize
    }
}

/// A Qwen3-VL-style checkpoint: this folder's families, and Qwen3.5 (`models::qwen3_5`),
/// which shares the vision tower, the token layout and this parser, with its own decoder.
#[derive(Clone, Debug)]
pub struct Config {
    pub model_type: String,
    pub text: TextConfig,
    pub vision: VisionConfig,
    /// Placeholder, marker and end-of-sequence ids.
    pub special: SpecialIds,
    pub decoder: DecoderConfig,
}

fn one_f64() -> f64 {
    1.0
}
fn default_head_dim() -> usize {
    128
}
fn default_rms_eps() -> f64 {
    1e-6
}
fn default_rope_theta() -> f64 {
    5_000_000.0
}
fn default_max_pos() -> usize {
    128_000
}
fn default_silu() -> Act {
    Act::Silu
}
fn default_gelu_tanh() -> Act {
    Act::GeluTanh
}
fn default_num_pos() -> usize {
    2304
}
fn one() -> usize {
    1
}
fn two() -> usize {
    2
}
fn three() -> usize {
    3
}
fn sixteen() -> usize {
    16
}

impl Config {
    pub fn from_value(root: &Value) -> Result<Self> {
        Self::parse(root, &["qwen3_vl", "qwen3_vl_moe"], |cfg, _| Ok(cfg.qwen3_decoder()))
    }

    /// Parses a config of one of `types`; `decoder` builds the family's decoder from the
    /// parsed parts and the merged text fields.
    pub fn parse(root: &Value, types: &[&str], decoder: impl Fn(&Config, &Map<String, Value>) -> Result<DecoderConfig>) -> Result<Self> {
        let model_type = root.get("model_type").and_then(Value::as_str).context("missing \"model_type\"")?;
        if !types.contains(&model_type) {
            bail!("model_type {model_type:?} is not one of {}", types.join(", "));
        }
        let text_obj = text_fields(root)?;
        let text: TextConfig = serde_path_to_error::deserialize(Value::Object(text_obj.clone()))
            .map_err(|e| anyhow::anyhow!("text_config field {}: {}", e.path(), e.inner()))?;
        let vision_val = root.get("vision_config").context("missing \"vision_config\"")?;
        let vision: VisionConfig = serde_path_to_error::deserialize(vision_val.clone())
            .map_err(|e| anyhow::anyhow!("vision_config field {}: {}", e.path(), e.inner()))?;
        let mut cfg = Config {
            model_type: model_type.to_string(),
            special: SpecialIds::from_config(root, &text_obj)?,
            text,
            vision,
            decoder: placeholder_decoder(),
        };
        cfg.validate()?;
        cfg.decoder = decoder(&cfg, &text_obj)?;
        Ok(cfg)
    }

    pub fn is_moe(&self) -> bool {
        self.model_type == "qwen3_vl_moe"
    }

    /// Catch configs that would only fail deep inside a forward pass, naming the field.
    pub fn validate(&self) -> Result<()> {
        let (t, v) = (&self.text, &self.vision);
        for (name, x) in [
            ("text_config.hidden_size", t.hidden_size),
            ("text_config.num_hidden_layers", t.num_hidden_layers),
            ("text_config.num_attention_heads", t.num_attention_heads),
            ("text_config.num_key_value_heads", t.num_key_value_heads),
            ("text_config.vocab_size", t.vocab_size),
            ("text_config.max_position_embeddings", t.max_position_embeddings),
            ("vision_config.depth", v.depth),
            ("vision_config.hidden_size", v.hidden_size),
            ("vision_config.num_heads", v.num_heads),
            ("vision_config.patch_size", v.patch_size),
            ("vision_config.spatial_merge_size", v.spatial_merge_size),
            ("vision_config.temporal_patch_size", v.temporal_patch_size),
            ("vision_config.num_position_embeddings", v.num_position_embeddings),
        ] {
            if x == 0 {
                bail!("{name} must be at least 1, got 0");
            }
        }
        if t.head_dim % 2 != 0 {
            bail!("text_config.head_dim {} must be even", t.head_dim);
        }
        if t.num_attention_heads % t.num_key_value_heads != 0 {
            bail!("text_config.num_attention_heads {} is not a multiple of num_key_value_heads {}", t.num_attention_heads, t.num_key_value_heads);
        }
        let half = t.rotary_dim() / 2;
        if t.rotary_dim() == 0 || t.rotary_dim() % 2 != 0 || t.rotary_dim() > t.head_dim {
            bail!("text_config rotary width {} (head_dim {} × partial_rotary_factor {}) must be even and within the head", t.rotary_dim(), t.head_dim, t.partial_rotary_factor);
        }
        if t.mrope_section.len() != 3 || t.mrope_section.iter().sum::<usize>() != half {
            bail!("text_config rope mrope_section {:?} must have 3 parts summing to the rotary half-width {half}", t.mrope_section);
        }
        if v.hidden_size % v.num_heads != 0 || v.head_dim() % 4 != 0 {
            bail!("vision_config.hidden_size {} / num_heads {} must give a head_dim divisible by 4", v.hidden_size, v.num_heads);
        }
        if v.pos_side() * v.pos_side() != v.num_position_embeddings {
            bail!("vision_config.num_position_embeddings {} is not a square grid", v.num_position_embeddings);
        }
        if v.out_hidden_size != t.hidden_size {
            bail!("vision_config.out_hidden_size {} differs from text_config.hidden_size {}", v.out_hidden_size, t.hidden_size);
        }
        if let Some(&bad) = v.deepstack_visual_indexes.iter().find(|&&i| i >= v.depth) {
            bail!("vision_config.deepstack_visual_indexes has {bad}, beyond the tower's depth {} (blocks 0..{})", v.depth, v.depth);
        }
        if v.deepstack_visual_indexes.len() > t.num_hidden_layers {
            bail!(
                "vision_config.deepstack_visual_indexes has {} levels but the decoder has only {} layers to add them to",
                v.deepstack_visual_indexes.len(),
                t.num_hidden_layers
            );
        }
        if self.is_moe() {
            if t.num_experts == 0 || t.moe_intermediate_size == 0 || t.decoder_sparse_step == 0 {
                bail!("text_config of a qwen3_vl_moe model needs num_experts, moe_intermediate_size and decoder_sparse_step ≥ 1");
            }
            if t.num_experts_per_tok == 0 || t.num_experts_per_tok > t.num_experts {
                bail!("text_config.num_experts_per_tok {} must be between 1 and num_experts {}", t.num_experts_per_tok, t.num_experts);
            }
        }
        Ok(())
    }

    /// The shared decoder: Qwen3 layers (q/k RMSNorm, no biases), interleaved M-RoPE, and for
    /// the MoE variant a sparse block on every `decoder_sparse_step`-th layer outside
    /// `mlp_only_layers`.
    pub fn qwen3_decoder(&self) -> DecoderConfig {
        let t = &self.text;
        let s = &t.mrope_section;
        let moe = self.is_moe().then(|| {
            let shape = MoeShape {
                hidden: t.hidden_size,
                expert_width: t.moe_intermediate_size,
                num_experts: t.num_experts,
                top_k: t.num_experts_per_tok,
                // transformers' Qwen3-VL-MoE block always renormalises (norm_topk_prob is
                // ignored there: every released model sets it).
                norm_topk: true,
                act: t.hidden_act,
            };
            let sparse = (0..t.num_hidden_layers)
                .map(|i| !t.mlp_only_layers.contains(&i) && (i + 1) % t.decoder_sparse_step == 0)
                .collect();
            (shape, sparse)
        });
        DecoderConfig {
            vocab_size: t.vocab_size,
            num_layers: t.num_hidden_layers,
            attention: AttentionShape {
                hidden: t.hidden_size,
                heads: t.num_attention_heads,
                kv_heads: t.num_key_value_heads,
                head_dim: t.head_dim,
                qkv_bias: t.attention_bias,
                qk_norm_eps: Some(t.rms_norm_eps),
                qk_norm_offset: false,
                output_gate: false,
            },
            intermediate_size: t.intermediate_size,
            hidden_act: t.hidden_act,
            rms_norm_eps: t.rms_norm_eps,
            rope_theta: t.rope_theta,
            rope: RotaryLayout::Interleaved([s[0], s[1], s[2]]),
            rotary_dim: t.rotary_dim(),
            norm_offset: false,
            tie_word_embeddings: t.tie_word_embeddings,
            moe,
            linear: None,
            gemma: None,
        }
    }
}

/// Filled in by `Config::parse` once the rest is validated.
fn placeholder_decoder() -> DecoderConfig {
    DecoderConfig {
        vocab_size: 0,
        num_layers: 0,
        attention: AttentionShape { hidden: 0, heads: 0, kv_heads: 0, head_dim: 0, qkv_bias: false, qk_norm_eps: None, qk_norm_offset: false, output_gate: false },
        intermediate_size: 0,
        hidden_act: Act::Silu,
        rms_norm_eps: 0.0,
        rope_theta: 0.0,
        rope: RotaryLayout::OneD,
        rotary_dim: 0,
        norm_offset: false,
        tie_word_embeddings: false,
        moe: None,
        linear: None,
        gemma: None,
    }
}

/// Text fields: the top level, overridden by `text_config`; the rotary section, theta and
/// partial factor lifted out of `rope_scaling` / `rope_parameters`.
fn text_fields(root: &Value) -> Result<Map<String, Value>> {
    let mut obj = root.as_object().context("config is not a JSON object")?.clone();
    obj.remove("vision_config");
    match root.get("text_config") {
        Some(Value::Object(nested)) => obj.extend(nested.clone()),
        Some(_) => bail!("\"text_config\" must be an object"),
        None => bail!("missing \"text_config\""),
    }
    let rope = obj.get("rope_parameters").or_else(|| obj.get("rope_scaling")).cloned();
    let section = rope.as_ref().and_then(|r| r.get("mrope_section")).cloned().unwrap_or_else(|| serde_json::json!([24, 20, 20]));
    obj.insert("mrope_section".into(), section);
    for key in ["rope_theta", "partial_rotary_factor"] {
        if let Some(v) = rope.as_ref().and_then(|r| r.get(key)).cloned() {
            obj.entry(key).or_insert(v);
        }
    }
    if let Some(false) = rope.as_ref().and_then(|r| r.get("mrope_interleaved")).and_then(Value::as_bool) {
        bail!("text_config rope mrope_interleaved is false: Qwen3-VL models use interleaved M-RoPE");
    }
    if !obj.contains_key("num_key_value_heads") {
        if let Some(h) = obj.get("num_attention_heads").cloned() {
            obj.insert("num_key_value_heads".into(), h);
        }
    }
    Ok(obj)
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn tiny() -> Value {
        serde_json::json!({
            "model_type": "qwen3_vl", "image_token_id": 500, "video_token_id": 501,
            "vision_start_token_id": 497, "vision_end_token_id": 498, "tie_word_embeddings": true,
            "text_config": {"model_type": "qwen3_vl_text", "hidden_size": 64, "intermediate_size": 128,
                "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
                "vocab_size": 512, "eos_token_id": 490, "rope_theta": 5000000,
                "rope_scaling": {"rope_type": "default", "mrope_section": [6, 5, 5], "mrope_interleaved": true}},
            "vision_config": {"depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                "out_hidden_size": 64, "num_position_embeddings": 64, "deepstack_visual_indexes": [0, 1, 2]}
        })
    }

    #[test]
    fn parses_nested_hub_layout() {
        let c = Config::from_value(&tiny()).unwrap();
        assert_eq!(c.text.head_dim, 32);
        assert!(c.text.tie_word_embeddings && !c.is_moe());
        assert_eq!(c.vision.pos_side(), 8);
        assert_eq!(c.special.eos, vec![490]);
        assert_eq!(c.decoder.rope, RotaryLayout::Interleaved([6, 5, 5]));
    }

    #[test]
    fn rope_parameters_are_read_like_rope_scaling() {
        let mut v = tiny();
        let t = v["text_config"].as_object_mut().unwrap();
        t.remove("rope_scaling");
        t.remove("rope_theta");
        t.insert("rope_parameters".into(), serde_json::json!({"rope_theta": 1000.0, "mrope_section": [6, 5, 5]}));
        let c = Config::from_value(&v).unwrap();
        assert_eq!(c.text.rope_theta, 1000.0);
    }

    #[test]
    fn bad_fields_are_named() {
        let cases: [(&str, Value, &str); 4] = [
            ("/vision_config/deepstack_visual_indexes", serde_json::json!([0, 9]), "deepstack_visual_indexes has 9"),
            ("/text_config/rope_scaling/mrope_section", serde_json::json!([6, 5, 6]), "mrope_section"),
            ("/vision_config/num_position_embeddings", serde_json::json!(60), "num_position_embeddings 60"),
            ("/text_config/num_key_value_heads", serde_json::json!(3), "num_key_value_heads 3"),
        ];
        for (path, val, want) in cases {
            let mut v = tiny();
            *v.pointer_mut(path).unwrap() = val;
            let e = format!("{:#}", Config::from_value(&v).unwrap_err());
            assert!(e.contains(want), "{path}: {e}");
        }
        let mut v = tiny();
        v["model_type"] = "qwen3_vl_moe".into();
        v["text_config"]["num_experts"] = 4.into();
        v["text_config"]["moe_intermediate_size"] = 32.into();
        v["text_config"]["num_experts_per_tok"] = 8.into();
        let e = format!("{:#}", Config::from_value(&v).unwrap_err());
        assert!(e.contains("num_experts_per_tok 8"), "{e}");
    }
}
