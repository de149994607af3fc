//! Qwen3-VL (dense) and Qwen3-VL-MoE: the Qwen3-VL vision tower with DeepStack, and the
//! shared decoder in its Qwen3 form (q/k norm, interleaved M-RoPE, optional sparse experts).
//! Qwen3.5 (`models::qwen3_5`) is this model with a hybrid decoder and no DeepStack.
//! Videos are one placeholder run per temporal step, each after its time as text; positions
//! are the shared M-RoPE index with every step its own item.

pub mod config;
pub mod vision;

use anyhow::Result;
use candle_core::Tensor;
use serde_json::Value;

pub use config::{Config, TextConfig, VisionConfig};
use vision::VisionTower;

use super::decoder::Decoder;
use super::position::{RopeParams, VideoTime};
use super::vlm::{FamilyConfig, VisionEncoder, VisionLanguageModel};
use super::{MediaGrid, ModelSpec, ParamCounts, VisionSpec};
use crate::weights::Weights;

/// The registry's config reader for `qwen3_vl` and `qwen3_vl_moe`.
pub fn parse(config: &Value) -> Result<Box<dyn FamilyConfig>> {
    Ok(Box::new(Config::from_value(config)?))
}

impl FamilyConfig for Config {
    fn spec(&self) -> ModelSpec {
        let t = &self.text;
        ModelSpec {
            model_type: self.model_type.clone(),
            layers: self.decoder.layer_kinds(),
            num_kv_heads: t.num_key_value_heads,
            head_dim: t.head_dim,
            hidden_size: t.hidden_size,
            vocab_size: t.vocab_size,
            max_context: t.max_position_embeddings,
            special: self.special.clone(),
            vision: Some(VisionSpec {
                patch_size: self.vision.patch_size,
                spatial_merge_size: self.vision.spatial_merge_size,
                temporal_patch_size: self.vision.temporal_patch_size,
                video_timestamps: true,
                // The goldens' transformers: 4.57 for Qwen3-VL, 5.x (keeps them) for Qwen3.5.
                video_outer_markers: self.model_type == "qwen3_5",
                anyres: None,
                image_side: None,
            }),
        }
    }

    fn param_counts(&self) -> ParamCounts {
        ParamCounts::of(&self.decoder, self.vision.num_params())
    }

    fn build(&self, w: Weights) -> Result<VisionLanguageModel> {
        let rope = RopeParams {
            merge: self.vision.spatial_merge_size,
            image_token: self.special.image,
            video_token: self.special.video,
            video_time: VideoTime::PerStep,
        };
        VisionLanguageModel::assemble(
            self.spec(),
            rope,
            &w,
            || Ok(Decoder::new(&self.decoder, w.pp("model").pp("language_model"), w.clone())?),
            || Ok(Box::new(VisionTower::new(&self.vision, w.pp("model").pp("visual"))?)),
        )
    }
}

impl VisionEncoder for VisionTower {
    fn encode(&self, patches: &Tensor, grid: &MediaGrid) -> Result<(Tensor, Vec<Tensor>)> {
        Ok(self.forward(patches, &[grid.thw])?)
    }

    fn deepstack_levels(&self) -> usize {
        self.levels()
    }
}
