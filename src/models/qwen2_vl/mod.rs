//! Qwen2-VL and Qwen2.5-VL: vision tower + Qwen2 text decoder + the glue that puts vision
//! features into the placeholder positions of the prompt. The two variants share the decoder;
//! the vision towers differ in norm, MLP and window attention, and Qwen2.5-VL scales video
//! time in the positions.

pub mod config;
pub mod position;
pub mod vision;

use std::path::PathBuf;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

pub use config::{Config, TextConfig, Variant, VisionConfig};
use vision::VisionTower;

use super::decoder::Decoder;
use super::vlm::{FamilyConfig, VisionEncoder, VisionLanguageModel};
use super::{LayerKind, MediaGrid, ModelSpec, ParamCounts, VisionSpec};
use crate::weights::Weights;

/// Where a checkpoint keeps its parts: hub layout (`model.`, `visual.`) or the layout newer
/// transformers writes (`model.language_model.`, `model.visual.`).
pub fn prefixes(has_tensor: impl Fn(&str) -> bool) -> (&'static str, &'static str) {
    if has_tensor("model.language_model.embed_tokens.weight") {
        ("model.language_model", "model.visual")
    } else {
        ("model", "visual")
    }
}

/// The registry's config reader for `qwen2_vl` and `qwen2_5_vl`.
pub fn parse(config: &Value) -> Result<Box<dyn FamilyConfig>> {
    Ok(Box::new(Config::from_value(config)?))
}

impl FamilyConfig for Config {
    fn spec(&self) -> ModelSpec {
        let t = &self.text;
        ModelSpec {
            model_type: self.variant.model_type().to_string(),
            layers: vec![LayerKind::Attention; t.num_hidden_layers],
            num_kv_heads: t.num_key_value_heads,
            head_dim: t.head_dim(),
            hidden_size: t.hidden_size,
            vocab_size: t.vocab_size,
            max_context: t.max_position_embeddings,
            special: self.special.clone(),
            vision: Some(VisionSpec {
                patch_size: self.vision.patch_size,
                spatial_merge_size: self.vision.spatial_merge_size,
                temporal_patch_size: self.vision.temporal_patch_size,
                video_timestamps: false,
                video_outer_markers: false,
                anyres: None,
                image_side: None,
            }),
        }
    }

    fn param_counts(&self) -> ParamCounts {
        ParamCounts::of(&self.text.decoder(), self.vision.num_params(self.variant))
    }

    fn build(&self, w: Weights) -> Result<VisionLanguageModel> {
        let (text_prefix, vision_prefix) = prefixes(|n| w.contains(n));
        VisionLanguageModel::assemble(
            self.spec(),
            position::params(self),
            &w,
            || Ok(Decoder::new(&self.text.decoder(), w.pp(text_prefix), w.clone())?),
            || Ok(Box::new(VisionTower::new(self.variant, &self.vision, w.pp(vision_prefix))?)),
        )
    }
}

impl VisionEncoder for VisionTower {
    fn encode(&self, patches: &Tensor, grid: &MediaGrid) -> Result<(Tensor, Vec<Tensor>)> {
        Ok((self.forward(patches, &[grid.thw])?, vec![]))
    }
}

/// Loads memory-mapped safetensors shards; a tensor that does not match the config fails
/// with its name and both shapes.
pub fn load(cfg: &Config, files: &[PathBuf], dtype: DType, device: &Device) -> Result<VisionLanguageModel> {
    cfg.build(Weights::safetensors(files, dtype, device)?)
}

/// Random weights of the right shapes (benchmarks, `--load-format dummy`).
pub fn dummy(cfg: &Config, dtype: DType, device: &Device) -> Result<VisionLanguageModel> {
    cfg.build(Weights::dummy(dtype, device))
}
