//! `config.json` of a LLaVA-NeXT checkpoint (`model_type` `llava_next`), read the way
//! transformers reads it. The hub configs state only what differs from the defaults of the
//! nested configs (llava-v1.6-vicuna-7b's `text_config` names no hidden size), so every absent
//! field takes the default of transformers' `LlamaConfig` / `MistralConfig` /
//! `CLIPVisionConfig`.

use anyhow::{bail, ensure, Context, Result};
use serde_json::{Map, Value};

use crate::layers::attention::AttentionShape;
use crate::layers::vision::VitShape;
use crate::layers::{Act, RotaryLayout};
use crate::models::decoder::DecoderConfig;
use crate::models::SpecialIds;
use crate::vision::anyres::AnyRes;

/// transformers' `LlavaNextConfig` default pinpoints (CLIP ViT-L/14-336 tiles).
const DEFAULT_PINPOINTS: [[usize; 2]; 5] = [[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]];

/// The CLIP vision tower.
#[derive(Clone, Debug)]
pub struct ClipConfig {
    pub layer: VitShape,
    pub num_layers: usize,
    pub image_size: usize,
    pub patch_size: usize,
    pub channels: usize,
}

impl ClipConfig {
    /// Patches on a tile's side.
    pub fn side(&self) -> usize {
        self.image_size / self.patch_size
    }

    /// Every tensor of the tower as the checkpoint holds it (all layers, the unused
    /// post-LayerNorm too).
    pub fn num_params(&self) -> u64 {
        let (w, i) = (self.layer.width as u64, self.layer.mlp_width as u64);
        let positions = (self.side() * self.side() + 1) as u64;
        let layer = 4 * (w * w + w) + 4 * w + (w * i + i) + (i * w + w);
        w * (self.channels * self.patch_size * self.patch_size) as u64 + w + positions * w + 4 * w + self.num_layers as u64 * layer
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub decoder: DecoderConfig,
    pub vision: ClipConfig,
    pub anyres: AnyRes,
    /// Vision layers run: the hidden state `vision_feature_layer` names is the output of this
    /// many layers (transformers' `hidden_states[k]`, the embeddings being `[0]`).
    pub feature_layers: usize,
    pub projector_act: Act,
    pub projector_bias: bool,
    pub special: SpecialIds,
    pub num_kv_heads: usize,
    pub max_context: usize,
}

/// A field of `obj` as an unsigned integer, `default` when absent or null; a present value of
/// another kind is an error naming it.
fn uint(obj: &Map<String, Value>, key: &str, default: usize) -> Result<usize> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_u64().map(|n| n as usize).with_context(|| format!("\"{key}\" must be a non-negative integer, got {v}")),
    }
}

fn float(obj: &Map<String, Value>, key: &str, default: f64) -> Result<f64> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(v) => v.as_f64().with_context(|| format!("\"{key}\" must be a number, got {v}")),
    }
}

fn act(obj: &Map<String, Value>, key: &str, default: Act) -> Result<Act> {
    match obj.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(a) => serde_json::from_value(a.clone()).with_context(|| format!("unsupported {key} {a}")),
    }
}

fn object<'a>(root: &'a Value, key: &str) -> Result<&'a Map<String, Value>> {
    static EMPTY: std::sync::OnceLock<Map<String, Value>> = std::sync::OnceLock::new();
    match root.get(key) {
        None | Some(Value::Null) => Ok(EMPTY.get_or_init(Map::new)),
        Some(Value::Object(m)) => Ok(m),
        Some(v) => bail!("\"{key}\" must be an object, got {v}"),
    }
}

/// The text model: LLaMA or Mistral layers (no biases, RMSNorm, SiLU MLP, 1-D RoPE).
fn decoder(t: &Map<String, Value>, root: &Value) -> Result<(DecoderConfig, usize, usize)> {
    let kind = t.get("model_type").and_then(Value::as_str).unwrap_or("llama");
    let mistral = match kind {
        "llama" => false,
        "mistral" => true,
        other => bail!("text_config.model_type {other:?} is not a LLaMA-layout decoder (llama, mistral)"),
    };
    for key in ["attention_bias", "mlp_bias"] {
        if t.get(key).and_then(Value::as_bool) == Some(true) {
            bail!("text_config.{key} is true; merg's LLaMA decoder has no biases there");
        }
    }
    if t.get("rope_scaling").is_some_and(|v| !v.is_null()) {
        bail!("text_config.rope_scaling {} is not supported (plain RoPE only)", t["rope_scaling"]);
    }
    let hidden = uint(t, "hidden_size", 4096)?;
    let heads = uint(t, "num_attention_heads", 32)?;
    let kv_heads = uint(t, "num_key_value_heads", if mistral { 8 } else { heads })?;
    let root_vocab = root.get("vocab_size").and_then(Value::as_u64).map_or(32000, |v| v as usize);
    ensure!(heads > 0 && kv_heads > 0 && heads.is_multiple_of(kv_heads), "num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}");
    let head_dim = uint(t, "head_dim", hidden / heads)?;
    ensure!(head_dim > 0 && head_dim.is_multiple_of(2), "head_dim {head_dim} must be a positive even number");
    let max_pos = uint(t, "max_position_embeddings", if mistral { 4096 * 32 } else { 2048 })?;
    // A sliding window only changes attention past its length: the context stops there.
    let window = if mistral { uint(t, "sliding_window", 4096)? } else { 0 };
    let max_context = if window > 0 { max_pos.min(window) } else { max_pos };
    let cfg = DecoderConfig {
        vocab_size: uint(t, "vocab_size", root_vocab)?,
        num_layers: uint(t, "num_hidden_layers", 32)?,
        attention: AttentionShape { hidden, heads, kv_heads, head_dim, qkv_bias: false, qk_norm_eps: None, qk_norm_offset: false, output_gate: false },
        intermediate_size: uint(t, "intermediate_size", if mistral { 14336 } else { 11008 })?,
        hidden_act: act(t, "hidden_act", Act::Silu)?,
        rms_norm_eps: float(t, "rms_norm_eps", 1e-6)?,
        rope_theta: float(t, "rope_theta", 10000.0)?,
        rope: RotaryLayout::OneD,
        rotary_dim: head_dim,
        norm_offset: false,
        tie_word_embeddings: root.get("tie_word_embeddings").and_then(Value::as_bool).unwrap_or(false),
        moe: None,
        linear: None,
        gemma: None,
    };
    Ok((cfg, kv_heads, max_context))
}

fn clip(v: &Map<String, Value>) -> Result<ClipConfig> {
    if let Some(kind) = v.get("model_type").and_then(Value::as_str) {
        ensure!(kind == "clip_vision_model", "vision_config.model_type {kind:?} is not clip_vision_model");
    }
    let width = uint(v, "hidden_size", 768)?;
    let heads = uint(v, "num_attention_heads", 12)?;
    ensure!(heads > 0 && width.is_multiple_of(heads), "vision hidden_size {width} is not a multiple of num_attention_heads {heads}");
    let c = ClipConfig {
        layer: VitShape { width, heads, mlp_width: uint(v, "intermediate_size", 3072)?, act: act(v, "hidden_act", Act::QuickGelu)?, eps: float(v, "layer_norm_eps", 1e-5)? },
        num_layers: uint(v, "num_hidden_layers", 12)?,
        image_size: uint(v, "image_size", 224)?,
        patch_size: uint(v, "patch_size", 32)?,
        channels: uint(v, "num_channels", 3)?,
    };
    ensure!(c.patch_size > 0 && c.image_size.is_multiple_of(c.patch_size), "vision image_size {} is not a multiple of patch_size {}", c.image_size, c.patch_size);
    ensure!(c.channels == 3, "vision num_channels {} (merg feeds RGB)", c.channels);
    Ok(c)
}

/// `vision_feature_layer` as the number of layers to run.
fn feature_layers(root: &Value, num_layers: usize) -> Result<usize> {
    let v = root.get("vision_feature_layer").cloned().unwrap_or(Value::from(-2));
    let k = v.as_i64().with_context(|| format!("vision_feature_layer {v} is not one layer index (several layers are not supported)"))?;
    let n = if k < 0 { num_layers as i64 + 1 + k } else { k };
    ensure!((0..=num_layers as i64).contains(&n), "vision_feature_layer {k} is outside the tower's {num_layers} layers");
    Ok(n as usize)
}

impl Config {
    pub fn from_value(root: &Value) -> Result<Self> {
        let obj = root.as_object().context("config is not a JSON object")?;
        let t = object(root, "text_config")?;
        let (decoder, num_kv_heads, max_context) = decoder(t, root).context("text_config")?;
        let vision = clip(object(root, "vision_config")?).context("vision_config")?;
        let strategy = root.get("vision_feature_select_strategy").and_then(Value::as_str).unwrap_or("default");
        ensure!(strategy == "default", "vision_feature_select_strategy {strategy:?} is not supported (\"default\": the class token dropped)");
        let pinpoints = match root.get("image_grid_pinpoints") {
            None | Some(Value::Null) => DEFAULT_PINPOINTS.to_vec(),
            Some(v) => serde_json::from_value(v.clone()).with_context(|| format!("image_grid_pinpoints {v} is not a list of [height, width]"))?,
        };
        let anyres = AnyRes { pinpoints, tile: vision.image_size };
        anyres.validate()?;
        let image = uint(obj, "image_token_index", 32000)?;
        ensure!(image < decoder.vocab_size, "image_token_index {image} is outside the vocabulary of {}", decoder.vocab_size);
        let eos = t.get("eos_token_id").or_else(|| root.get("eos_token_id")).and_then(Value::as_u64).map_or(2, |v| v as u32);
        Ok(Config {
            feature_layers: feature_layers(root, vision.num_layers)?,
            projector_act: act(obj, "projector_hidden_act", Act::Gelu)?,
            projector_bias: root.get("multimodal_projector_bias").and_then(Value::as_bool).unwrap_or(true),
            special: SpecialIds::image_only(image as u32, vec![eos]),
            decoder,
            vision,
            anyres,
            num_kv_heads,
            max_context,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// llava-hf/llava-v1.6-vicuna-7b-hf's config.json names few fields: the rest are the
    /// LLaMA and CLIP defaults (7B: 4096 wide, 32 layers; ViT-L/14-336 stated in full).
    #[test]
    fn sparse_hub_config_takes_transformers_defaults() {
        let c = Config::from_value(&serde_json::json!({
            "model_type": "llava_next", "image_token_index": 32000, "vocab_size": 32064,
            "text_config": {"model_type": "llama", "max_position_embeddings": 4096, "vocab_size": 32064, "rms_norm_eps": 1e-05},
            "vision_config": {"hidden_size": 1024, "image_size": 336, "intermediate_size": 4096, "model_type": "clip_vision_model",
                              "num_attention_heads": 16, "num_hidden_layers": 24, "patch_size": 14, "projection_dim": 768},
            "vision_feature_layer": -2, "vision_feature_select_strategy": "default"}))
        .unwrap();
        let a = &c.decoder.attention;
        assert_eq!((a.hidden, a.heads, a.kv_heads, c.decoder.num_layers, c.decoder.intermediate_size), (4096, 32, 32, 32, 11008));
        assert_eq!((c.vision.side(), c.feature_layers, c.anyres.tile, c.max_context), (24, 23, 336, 4096));
        assert_eq!(c.vision.layer.act, Act::QuickGelu);
        let bad = serde_json::json!({"model_type": "llava_next", "vision_feature_select_strategy": "full"});
        assert!(format!("{:#}", Config::from_value(&bad).unwrap_err()).contains("\"full\""));
    }
}
