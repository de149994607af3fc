//! `config.json` of a Gemma 3 checkpoint (`model_type` `gemma3`), read the way transformers
//! 4.57 reads it: the released configs state only what differs from `Gemma3TextConfig`'s and
//! `SiglipVisionConfig`'s defaults, so every default below is transformers' own.

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use serde_json::Value;

use crate::layers::attention::AttentionShape;
use crate::layers::{Act, RotaryLayout};
use crate::models::decoder::{DecoderConfig, GemmaLayout};
use crate::models::SpecialIds;

#[derive(Clone, Debug, Deserialize)]
pub struct TextConfig {
    #[serde(default = "d::vocab")]
    pub vocab_size: usize,
    #[serde(default = "d::hidden")]
    pub hidden_size: usize,
    #[serde(default = "d::intermediate")]
    pub intermediate_size: usize,
    #[serde(default = "d::layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d::heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d::kv_heads")]
    pub num_key_value_heads: usize,
    #[serde(default = "d::head_dim")]
    pub head_dim: usize,
    #[serde(default = "d::act")]
    pub hidden_activation: Act,
    #[serde(default = "d::max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default = "d::eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "d::rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "d::local_theta")]
    pub rope_local_base_freq: f64,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default = "d::head_dim")]
    pub query_pre_attn_scalar: usize,
    #[serde(default = "d::window")]
    pub sliding_window: usize,
    /// Every `sliding_window_pattern`-th layer is global (when `layer_types` is absent).
    #[serde(default = "d::pattern")]
    pub sliding_window_pattern: usize,
    #[serde(default)]
    pub layer_types: Option<Vec<String>>,
    #[serde(default)]
    pub rope_scaling: Option<Value>,
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    #[serde(default = "d::yes")]
    pub tie_word_embeddings: bool,
}

#[derive(Clone, Debug, Deserialize)]
pub struct VisionConfig {
    #[serde(default = "d::v_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d::v_intermediate")]
    pub intermediate_size: usize,
    #[serde(default = "d::v_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d::v_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d::channels")]
    pub num_channels: usize,
    #[serde(default = "d::image_size")]
    pub image_size: usize,
    #[serde(default = "d::patch")]
    pub patch_size: usize,
    #[serde(default = "d::act")]
    pub hidden_act: Act,
    #[serde(default = "d::eps")]
    pub layer_norm_eps: f64,
}

impl VisionConfig {
    /// Patches per side of the (square) image.
    pub fn patches_per_side(&self) -> usize {
        self.image_size / self.patch_size
    }

    pub fn num_params(&self) -> u64 {
        let (w, m, p) = (self.hidden_size as u64, self.intermediate_size as u64, self.patch_size as u64);
        let embed = w * self.num_channels as u64 * p * p + w + (self.patches_per_side() as u64).pow(2) * w;
        let block = 4 * (w * w + w) + 2 * w * m + m + w + 4 * w;
        embed + self.num_hidden_layers as u64 * block + 2 * w
    }
}

/// transformers' defaults (Gemma3TextConfig, SiglipVisionConfig, Gemma3Config).
mod d {
    use crate::layers::Act;
    pub fn vocab() -> usize { 262_208 }
    pub fn hidden() -> usize { 2304 }
    pub fn intermediate() -> usize { 9216 }
    pub fn layers() -> usize { 26 }
    pub fn heads() -> usize { 8 }
    pub fn kv_heads() -> usize { 4 }
    pub fn head_dim() -> usize { 256 }
    pub fn act() -> Act { Act::GeluTanh }
    pub fn max_pos() -> usize { 131_072 }
    pub fn eps() -> f64 { 1e-6 }
    pub fn rope_theta() -> f64 { 1_000_000.0 }
    pub fn local_theta() -> f64 { 10_000.0 }
    pub fn window() -> usize { 4096 }
    pub fn pattern() -> usize { 6 }
    pub fn yes() -> bool { true }
    pub fn v_hidden() -> usize { 768 }
    pub fn v_intermediate() -> usize { 3072 }
    pub fn v_layers() -> usize { 12 }
    pub fn v_heads() -> usize { 12 }
    pub fn channels() -> usize { 3 }
    pub fn image_size() -> usize { 224 }
    pub fn patch() -> usize { 16 }
    pub fn mm_tokens() -> usize { 256 }
    pub fn boi() -> u32 { 255_999 }
    pub fn eoi() -> u32 { 256_000 }
    pub fn image() -> u32 { 262_144 }
}

#[derive(Clone, Debug, Deserialize)]
struct Top {
    model_type: String,
    #[serde(default = "d::mm_tokens")]
    mm_tokens_per_image: usize,
    #[serde(default = "d::boi")]
    boi_token_index: u32,
    #[serde(default = "d::eoi")]
    eoi_token_index: u32,
    #[serde(default = "d::image")]
    image_token_index: u32,
}

#[derive(Clone, Debug)]
pub struct Config {
    pub model_type: String,
    pub text: TextConfig,
    pub vision: VisionConfig,
    pub mm_tokens_per_image: usize,
    pub special: SpecialIds,
    pub decoder: DecoderConfig,
}

impl Config {
    pub fn from_value(root: &Value) -> Result<Self> {
        let top: Top = serde_json::from_value(root.clone()).context("gemma3 config")?;
        let text: TextConfig = serde_json::from_value(root.get("text_config").cloned().unwrap_or_else(|| serde_json::json!({}))).context("gemma3 text_config")?;
        let vision: VisionConfig = serde_json::from_value(root.get("vision_config").cloned().unwrap_or_else(|| serde_json::json!({}))).context("gemma3 vision_config")?;
        let mut text_fields = root.as_object().context("config is not a JSON object")?.clone();
        if let Some(Value::Object(t)) = root.get("text_config") {
            text_fields.extend(t.clone());
        }
        let eos = match text_fields.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|v| v as u32).collect(),
            _ => vec![],
        };
        // Gemma 3 has no video placeholder: an id no token has keeps every video path idle.
        let special = SpecialIds { image: top.image_token_index, video: u32::MAX, vision_start: top.boi_token_index, vision_end: top.eoi_token_index, eos };
        let decoder = decoder(&text)?;
        let c = Config { model_type: top.model_type, text, vision, mm_tokens_per_image: top.mm_tokens_per_image, special, decoder };
        c.validate()?;
        Ok(c)
    }

    /// Patches pooled per side into one image token (`AvgPool2d`'s kernel).
    pub fn pool(&self) -> usize {
        let side = (self.mm_tokens_per_image as f64).sqrt().round() as usize;
        self.vision.patches_per_side() / side.max(1)
    }

    fn validate(&self) -> Result<()> {
        let (v, t) = (&self.vision, &self.text);
        let side = (self.mm_tokens_per_image as f64).sqrt().round() as usize;
        if side * side != self.mm_tokens_per_image || side == 0 || v.patches_per_side() % side != 0 {
            bail!("mm_tokens_per_image {} must be a square whose side divides the {} patches per side of the image", self.mm_tokens_per_image, v.patches_per_side());
        }
        if v.patch_size == 0 || v.image_size % v.patch_size != 0 || v.hidden_size % v.num_attention_heads.max(1) != 0 {
            bail!("vision_config: image_size {} must be a multiple of patch_size {}, hidden_size {} of num_attention_heads {}", v.image_size, v.patch_size, v.hidden_size, v.num_attention_heads);
        }
        if t.num_attention_heads == 0 || t.num_key_value_heads == 0 || t.num_attention_heads % t.num_key_value_heads != 0 {
            bail!("text_config: num_attention_heads {} must be a multiple of num_key_value_heads {}", t.num_attention_heads, t.num_key_value_heads);
        }
        if t.attn_logit_softcapping.is_some() || t.final_logit_softcapping.is_some() {
            bail!("text_config: logit softcapping (Gemma 2) is not supported; Gemma 3 configs set none");
        }
        if t.sliding_window == 0 {
            bail!("text_config: sliding_window must be at least 1");
        }
        if t.sliding_window > t.max_position_embeddings {
            bail!("text_config: sliding_window {} is larger than the context (max_position_embeddings {})", t.sliding_window, t.max_position_embeddings);
        }
        Ok(())
    }
}

/// Which layers are local: `layer_types` when stated, else every `sliding_window_pattern`-th
/// layer global (transformers' rule).
fn sliding_layers(t: &TextConfig) -> Result<Vec<bool>> {
    match &t.layer_types {
        Some(types) => {
            if types.len() != t.num_hidden_layers {
                bail!("text_config: {} layer_types for {} layers", types.len(), t.num_hidden_layers);
            }
            types
                .iter()
                .map(|k| match k.as_str() {
                    "sliding_attention" => Ok(true),
                    "full_attention" => Ok(false),
                    other => bail!("text_config: unknown layer type {other:?}"),
                })
                .collect()
        }
        None => Ok((0..t.num_hidden_layers).map(|i| (i + 1) % t.sliding_window_pattern.max(1) != 0).collect()),
    }
}

/// The global layers' linear rope factor (1 without scaling).
fn rope_factor(t: &TextConfig) -> Result<f64> {
    let Some(s) = &t.rope_scaling else { return Ok(1.0) };
    let kind = s.get("rope_type").or_else(|| s.get("type")).and_then(Value::as_str).unwrap_or("default");
    match kind {
        "default" => Ok(1.0),
        "linear" => s.get("factor").and_then(Value::as_f64).filter(|f| *f > 0.0).context("text_config: linear rope_scaling needs a positive factor"),
        other => bail!("text_config: rope_scaling type {other:?} is not supported for gemma3 (linear is)"),
    }
}

fn decoder(t: &TextConfig) -> Result<DecoderConfig> {
    Ok(DecoderConfig {
        vocab_size: t.vocab_size,
        num_layers: t.num_hidden_layers,
        attention: AttentionShape {
            hidden: t.hidden_size,
            heads: t.num_attention_heads,
            kv_heads: t.num_key_value_heads,
            head_dim: t.head_dim,
            qkv_bias: t.attention_bias,
            qk_norm_eps: Some(t.rms_norm_eps),
            qk_norm_offset: true,
            output_gate: false,
        },
        intermediate_size: t.intermediate_size,
        hidden_act: t.hidden_activation,
        rms_norm_eps: t.rms_norm_eps,
        rope_theta: t.rope_theta,
        rope: RotaryLayout::OneD,
        rotary_dim: t.head_dim,
        norm_offset: true,
        tie_word_embeddings: t.tie_word_embeddings,
        moe: None,
        linear: None,
        gemma: Some(GemmaLayout {
            query_scale: (t.query_pre_attn_scalar as f64).powf(-0.5),
            sliding_window: t.sliding_window,
            sliding: sliding_layers(t)?,
            local_rope_theta: t.rope_local_base_freq,
            global_rope_factor: rope_factor(t)?,
        }),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A config stating only what the 4B one states gets transformers' defaults and the 5:1
    /// pattern of local and global layers.
    #[test]
    fn defaults_and_layer_pattern() {
        let c = Config::from_value(&serde_json::json!({
            "model_type": "gemma3", "mm_tokens_per_image": 256,
            "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
            "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27, "patch_size": 14}
        }))
        .unwrap();
        let g = c.decoder.gemma.as_ref().unwrap();
        assert_eq!(g.sliding.iter().filter(|s| !**s).count(), 5);
        assert_eq!(&g.sliding[..6], &[true, true, true, true, true, false]);
        assert_eq!((g.global_rope_factor, g.sliding_window, c.text.head_dim), (8.0, 1024, 256));
        assert_eq!((c.pool(), c.special.image, c.special.vision_start), (4, 262_144, 255_999));
    }

    /// Bad configs are refused naming the field: a window larger than the context, a layer
    /// pattern of the wrong length, an image token count the pooling cannot give.
    #[test]
    fn bad_configs_name_the_field() {
        let base = serde_json::json!({
            "model_type": "gemma3", "mm_tokens_per_image": 9,
            "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "sliding_window": 8, "max_position_embeddings": 4096},
            "vision_config": {"hidden_size": 32, "image_size": 48, "intermediate_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2, "patch_size": 8}
        });
        assert!(Config::from_value(&base).is_ok());
        let with = |path: &[&str], v: Value| {
            let mut c = base.clone();
            let (last, parents) = path.split_last().unwrap();
            let mut at = &mut c;
            for p in parents {
                at = &mut at[*p];
            }
            at[*last] = v;
            format!("{:#}", Config::from_value(&c).unwrap_err())
        };
        let e = with(&["text_config", "sliding_window"], serde_json::json!(8192));
        assert!(e.contains("sliding_window 8192 is larger than the context (max_position_embeddings 4096)"), "{e}");
        let e = with(&["text_config", "layer_types"], serde_json::json!(["sliding_attention", "full_attention"]));
        assert!(e.contains("2 layer_types for 6 layers"), "{e}");
        let e = with(&["mm_tokens_per_image"], serde_json::json!(8));
        assert!(e.contains("mm_tokens_per_image 8 must be a square"), "{e}");
        let e = with(&["mm_tokens_per_image"], serde_json::json!(16));
        assert!(e.contains("mm_tokens_per_image 16") && e.contains("6 patches per side"), "{e}");
    }
}
