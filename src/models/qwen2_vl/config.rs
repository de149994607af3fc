//! `config.json` of a Qwen2-VL / Qwen2.5-VL checkpoint, read the way transformers reads it.
//!
//! Hub configs keep the text fields at the top level; configs written by newer transformers
//! may also nest them under `text_config`. Both are accepted (nested wins, as in transformers).

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::layers::attention::AttentionShape;
use crate::layers::{Act, RotaryLayout};
use crate::models::decoder::DecoderConfig;
use crate::models::SpecialIds;

/// The two variants this family folder serves. They share the text decoder; the vision
/// towers differ (see `vision`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Variant {
    #[serde(rename = "qwen2_vl")]
    Qwen2Vl,
    #[serde(rename = "qwen2_5_vl")]
    Qwen25Vl,
}

impl Variant {
    pub fn model_type(self) -> &'static str {
        match self {
            Variant::Qwen2Vl => "qwen2_vl",
            Variant::Qwen25Vl => "qwen2_5_vl",
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct TextConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default = "default_rms_eps")]
    pub rms_norm_eps: f64,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
    #[serde(default = "default_silu")]
    pub hidden_act: Act,
    /// Split of the rotary half-dimension into (temporal, height, width) sections.
    pub mrope_section: Vec<usize>,
    /// Per-head width when the config states it (it need not be hidden / heads).
    #[serde(default)]
    pub head_dim: Option<usize>,
}

impl TextConfig {
    /// The config's `head_dim`, else hidden_size / num_attention_heads (as transformers).
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// The shared decoder this config describes: Qwen2 layers (q/k/v biases), sectioned
    /// M-RoPE.
    pub fn decoder(&self) -> DecoderConfig {
        let s = &self.mrope_section;
        DecoderConfig {
            vocab_size: self.vocab_size,
            num_layers: self.num_hidden_layers,
            attention: AttentionShape {
                hidden: self.hidden_size,
                heads: self.num_attention_heads,
                kv_heads: self.num_key_value_heads,
                head_dim: self.head_dim(),
                qkv_bias: true,
                qk_norm_eps: None,
                qk_norm_offset: false,
                output_gate: false,
            },
            intermediate_size: self.intermediate_size,
            hidden_act: self.hidden_act,
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            rope: RotaryLayout::Sectioned([s[0], s[1], s[2]]),
            rotary_dim: self.head_dim(),
            norm_offset: false,
            tie_word_embeddings: self.tie_word_embeddings,
            moe: None,
            linear: None,
            gemma: None,
        }
    }
}

/// One struct for both vision towers; fields a family does not use keep their defaults.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct VisionConfig {
    pub depth: usize,
    /// Width of the vision transformer blocks (Qwen2-VL `embed_dim`, Qwen2.5-VL `hidden_size`).
    pub width: usize,
    pub num_heads: usize,
    /// MLP width inside a block (Qwen2-VL `embed_dim * mlp_ratio`, Qwen2.5-VL `intermediate_size`).
    pub mlp_width: usize,
    /// Output width of the patch merger = the text model's hidden size.
    pub out_hidden_size: usize,
    pub patch_size: usize,
    pub spatial_merge_size: usize,
    pub temporal_patch_size: usize,
    pub in_channels: usize,
    pub hidden_act: Act,
    /// Qwen2.5-VL window attention: window side in pixels, and blocks that attend globally.
    pub window_size: usize,
    pub fullatt_block_indexes: Vec<usize>,
    /// Qwen2.5-VL: temporal position units per second of video.
    pub tokens_per_second: f64,
}

impl VisionConfig {
    pub fn head_dim(&self) -> usize {
        self.width / self.num_heads
    }
    /// Parameters of the tower: patch embedding (no bias), blocks (norms, qkv, proj, MLP) and
    /// the merger, per variant (LayerNorm + plain MLP, or RMSNorm + gated MLP).
    pub fn num_params(&self, variant: Variant) -> u64 {
        let (w, i) = (self.width as u64, self.mlp_width as u64);
        let m = w * (self.spatial_merge_size * self.spatial_merge_size) as u64;
        let (norm, mlp) = match variant {
            Variant::Qwen2Vl => (2 * w, (w * i + i) + (i * w + w)),
            Variant::Qwen25Vl => (w, 3 * w * i + 2 * i + w),
        };
        let block = 2 * norm + (3 * w * w + 3 * w) + (w * w + w) + mlp;
        let merger = norm + (m * m + m) + (m * self.out_hidden_size as u64 + self.out_hidden_size as u64);
        w * self.patch_dim() as u64 + self.depth as u64 * block + merger
    }

    /// Values in one flattened patch: channels × temporal patch × patch × patch.
    pub fn patch_dim(&self) -> usize {
        self.in_channels * self.temporal_patch_size * self.patch_size * self.patch_size
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Config {
    pub variant: Variant,
    pub text: TextConfig,
    pub vision: VisionConfig,
    /// Placeholder, marker and end-of-sequence ids.
    pub special: SpecialIds,
    /// dtype the checkpoint was saved in (`torch_dtype`), e.g. "bfloat16".
    pub torch_dtype: Option<String>,
}

fn default_rms_eps() -> f64 {
    1e-6
}
fn default_rope_theta() -> f64 {
    1_000_000.0
}
fn default_max_pos() -> usize {
    32768
}
fn default_silu() -> Act {
    Act::Silu
}

impl Config {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = crate::input::read_string(path, &crate::input::CONFIG).context("cannot read the model config")?;
        Self::from_json_str(&text).with_context(|| format!("invalid model config {}", path.display()))
    }

    pub fn from_json_str(text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text).context("not valid JSON")?;
        Self::from_value(&root)
    }

    pub fn from_value(root: &Value) -> Result<Self> {
        let model_type = root
            .get("model_type")
            .and_then(Value::as_str)
            .context("missing \"model_type\"")?;
        let variant = match model_type {
            "qwen2_vl" => Variant::Qwen2Vl,
            "qwen2_5_vl" => Variant::Qwen25Vl,
            other => bail!("model_type {other:?} is not a Qwen2-VL family config (qwen2_vl, qwen2_5_vl)"),
        };
        let (text, text_obj) = parse_text(root)?;
        let vision_val = root.get("vision_config").context("missing \"vision_config\"")?;
        let vision = parse_vision(variant, vision_val, text.hidden_size).context("vision_config")?;

        let cfg = Config {
            variant,
            special: SpecialIds::from_config(root, &text_obj)?,
            torch_dtype: text_obj.get("torch_dtype").and_then(Value::as_str).map(str::to_string),
            text,
            vision,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Catch configs that would only fail deep inside a forward pass.
    pub fn validate(&self) -> Result<()> {
        let t = &self.text;
        for (name, v) in [
            ("hidden_size", t.hidden_size),
            ("intermediate_size", t.intermediate_size),
            ("num_hidden_layers", t.num_hidden_layers),
            ("num_attention_heads", t.num_attention_heads),
            ("vocab_size", t.vocab_size),
            ("max_position_embeddings", t.max_position_embeddings),
            ("vision_config.depth", self.vision.depth),
            ("vision_config width", self.vision.width),
            ("vision_config.patch_size", self.vision.patch_size),
            ("vision_config.spatial_merge_size", self.vision.spatial_merge_size),
            ("vision_config.temporal_patch_size", self.vision.temporal_patch_size),
        ] {
            if v == 0 {
                bail!("{name} must be at least 1, got 0");
            }
        }
        if t.num_attention_heads == 0 || (t.head_dim.is_none() && !t.hidden_size.is_multiple_of(t.num_attention_heads)) {
            bail!("hidden_size {} is not divisible by num_attention_heads {}", t.hidden_size, t.num_attention_heads);
        }
        if t.head_dim() == 0 || !t.head_dim().is_multiple_of(2) {
            bail!("head_dim {} must be a positive even number", t.head_dim());
        }
        if t.num_key_value_heads == 0 || !t.num_attention_heads.is_multiple_of(t.num_key_value_heads) {
            bail!(
                "num_attention_heads {} is not a multiple of num_key_value_heads {}",
                t.num_attention_heads,
                t.num_key_value_heads
            );
        }
        let half = t.head_dim() / 2;
        if t.mrope_section.len() != 3 || t.mrope_section.iter().sum::<usize>() != half {
            bail!(
                "rope_scaling.mrope_section {:?} must have 3 parts summing to head_dim/2 = {half}",
                t.mrope_section
            );
        }
        let v = &self.vision;
        if v.num_heads == 0 || !v.width.is_multiple_of(v.num_heads) || !v.head_dim().is_multiple_of(4) {
            bail!("vision width {} / num_heads {} must give a head_dim divisible by 4", v.width, v.num_heads);
        }
        if v.out_hidden_size != t.hidden_size {
            bail!(
                "vision merger output {} differs from the text hidden_size {}",
                v.out_hidden_size,
                t.hidden_size
            );
        }
        Ok(())
    }
}

/// The text model of a Qwen2-style config (also Qwen2.5-Omni's thinker): its fields at the top
/// level, overridden by a nested `text_config` when present. Returns the config and the merged
/// fields (where the token ids are looked up).
pub fn parse_text(root: &Value) -> Result<(TextConfig, serde_json::Map<String, Value>)> {
    let mut text_obj = root.as_object().context("config is not a JSON object")?.clone();
    if let Some(Value::Object(nested)) = root.get("text_config") {
        for (k, v) in nested {
            text_obj.insert(k.clone(), v.clone());
        }
    }
    let mrope = text_obj
        .get("rope_scaling")
        .and_then(|r| r.get("mrope_section"))
        .cloned()
        .context("missing rope_scaling.mrope_section (M-RoPE sections)")?;
    text_obj.insert("mrope_section".into(), mrope);
    if !text_obj.contains_key("num_key_value_heads") {
        if let Some(h) = text_obj.get("num_attention_heads").cloned() {
            text_obj.insert("num_key_value_heads".into(), h);
        }
    }
    let text: TextConfig = serde_path_to_error::deserialize(Value::Object(text_obj.clone()))
        .map_err(|e| anyhow::anyhow!("text model field {}: {}", e.path(), e.inner()))?;
    Ok((text, text_obj))
}

/// A `vision_config` of either variant (Qwen2.5-Omni's tower is Qwen2.5-VL's).
pub fn parse_vision(variant: Variant, v: &Value, text_hidden: usize) -> Result<VisionConfig> {
    // A present but malformed value (negative, fractional, a string) is named as such, not
    // reported as missing or silently replaced by the default.
    let field = |key: &str| -> Result<Option<usize>> {
        match v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x.as_u64().map(|n| Some(n as usize)).with_context(|| format!("\"{key}\" must be a non-negative integer, got {x}")),
        }
    };
    let get_usize = |key: &str| field(key).ok().flatten();
    for key in ["patch_size", "spatial_merge_size", "temporal_patch_size", "in_channels", "in_chans", "hidden_size", "out_hidden_size", "depth", "num_heads", "embed_dim", "intermediate_size", "window_size"] {
        field(key)?;
    }
    let need = |key: &str| get_usize(key).with_context(|| format!("missing \"{key}\""));
    let act = |default: Act| -> Result<Act> {
        match v.get("hidden_act") {
            Some(a) => serde_json::from_value(a.clone()).with_context(|| format!("unsupported hidden_act {a}")),
            None => Ok(default),
        }
    };
    let common_patch = get_usize("patch_size").unwrap_or(14);
    let merge = get_usize("spatial_merge_size").unwrap_or(2);
    let tps = get_usize("temporal_patch_size").unwrap_or(2);
    let in_ch = get_usize("in_channels").or_else(|| get_usize("in_chans")).unwrap_or(3);
    Ok(match variant {
        Variant::Qwen2Vl => {
            let width = need("embed_dim")?;
            let ratio = v.get("mlp_ratio").and_then(Value::as_f64).unwrap_or(4.0);
            VisionConfig {
                depth: need("depth")?,
                width,
                num_heads: need("num_heads")?,
                mlp_width: (width as f64 * ratio) as usize,
                out_hidden_size: get_usize("hidden_size").unwrap_or(text_hidden),
                patch_size: common_patch,
                spatial_merge_size: merge,
                temporal_patch_size: tps,
                in_channels: in_ch,
                hidden_act: act(Act::QuickGelu)?,
                window_size: 0,
                fullatt_block_indexes: vec![],
                tokens_per_second: 0.0,
            }
        }
        Variant::Qwen25Vl => VisionConfig {
            depth: need("depth")?,
            width: need("hidden_size")?,
            num_heads: need("num_heads")?,
            mlp_width: need("intermediate_size")?,
            out_hidden_size: get_usize("out_hidden_size").unwrap_or(text_hidden),
            patch_size: common_patch,
            spatial_merge_size: merge,
            temporal_patch_size: tps,
            in_channels: in_ch,
            hidden_act: act(Act::Silu)?,
            window_size: get_usize("window_size").unwrap_or(112),
            fullatt_block_indexes: v
                .get("fullatt_block_indexes")
                .and_then(Value::as_array)
                .map(|a| a.iter().filter_map(Value::as_u64).map(|x| x as usize).collect())
                .unwrap_or_default(),
            tokens_per_second: v.get("tokens_per_second").and_then(Value::as_f64).unwrap_or(2.0),
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn qwen2_vl_json() -> String {
        r#"{"model_type":"qwen2_vl","hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,
            "num_attention_heads":4,"num_key_value_heads":2,"vocab_size":512,"rope_theta":1000000.0,
            "rope_scaling":{"type":"mrope","mrope_section":[2,3,3]},"image_token_id":500,"video_token_id":501,
            "vision_start_token_id":497,"vision_end_token_id":498,"eos_token_id":490,
            "vision_config":{"depth":2,"embed_dim":32,"num_heads":4,"mlp_ratio":2,"hidden_size":64}}"#
            .to_string()
    }

    #[test]
    fn parses_top_level_hub_layout() {
        let c = Config::from_json_str(&qwen2_vl_json()).unwrap();
        assert_eq!(c.variant, Variant::Qwen2Vl);
        assert_eq!(c.text.head_dim(), 16);
        assert_eq!(c.vision.mlp_width, 64);
        assert_eq!(c.vision.hidden_act, Act::QuickGelu);
        assert_eq!(c.special.eos, vec![490]);
    }

    /// Qwen3-style configs state head_dim; it need not be hidden / heads.
    #[test]
    fn head_dim_is_read_when_stated() {
        let j = qwen2_vl_json().replace("\"num_key_value_heads\":2,", "\"num_key_value_heads\":2,\"head_dim\":32,");
        let j = j.replace("[2,3,3]", "[4,6,6]");
        let c = Config::from_json_str(&j).unwrap();
        assert_eq!(c.text.head_dim(), 32);
        assert_eq!(Config::from_json_str(&qwen2_vl_json()).unwrap().text.head_dim(), 16);
    }

    #[test]
    fn nested_text_config_wins() {
        let mut v: Value = serde_json::from_str(&qwen2_vl_json()).unwrap();
        v["text_config"] = serde_json::json!({"num_hidden_layers": 3});
        let c = Config::from_value(&v).unwrap();
        assert_eq!(c.text.num_hidden_layers, 3);
    }

    #[test]
    fn unknown_model_type_is_named() {
        let j = qwen2_vl_json().replace("qwen2_vl", "llava");
        let e = format!("{:#}", Config::from_json_str(&j).unwrap_err());
        assert!(e.contains("\"llava\""), "{e}");
    }

    #[test]
    fn bad_mrope_section_rejected() {
        let j = qwen2_vl_json().replace("[2,3,3]", "[2,3,4]");
        let e = format!("{:#}", Config::from_json_str(&j).unwrap_err());
        assert!(e.contains("mrope_section"), "{e}");
    }
}
