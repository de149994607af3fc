//! LLaVA-NeXT (`llava_next`: llava-v1.6 Vicuna 7B/13B, Mistral 7B): a CLIP ViT tower over
//! any-resolution tiles, a two-layer projector and the image-newline row marker (`vision`), on
//! the shared decoder configured as LLaMA (no biases, RMSNorm, SiLU MLP, 1-D RoPE; `config`).
//! Positions are one running index (`PositionScheme::Sequential`), media tokens included.

pub mod config;
pub mod vision;

use anyhow::Result;
use serde_json::Value;

pub use config::Config;
use vision::{Prefixes, Tower};

use super::decoder::Decoder;
use super::position::{PositionScheme, RopeParams, VideoTime};
use super::vlm::{FamilyConfig, VisionLanguageModel};
use super::{LayerKind, ModelSpec, ParamCounts, VisionSpec};
use crate::weights::Weights;

/// The registry's config reader for `llava_next`.
pub fn parse(config: &Value) -> Result<Box<dyn FamilyConfig>> {
    Ok(Box::new(Config::from_value(config)?))
}

/// (text decoder, lm_head's parent, tower, projector, newline's parent): the llava-hf hub
/// layout (`language_model.model.`, `vision_tower.`, …, written before transformers 4.52) or
/// the one transformers writes now (`model.language_model.`, `model.vision_tower.`, `lm_head`).
fn parts(w: &Weights) -> (Weights, Weights, Prefixes) {
    let (root, text, lm) = match w.contains("language_model.model.embed_tokens.weight") {
        true => (w.clone(), w.pp("language_model").pp("model"), w.pp("language_model")),
        false => (w.pp("model"), w.pp("model").pp("language_model"), w.clone()),
    };
    let p = Prefixes { tower: root.pp("vision_tower").pp("vision_model"), projector: root.pp("multi_modal_projector"), newline: root };
    (text, lm, p)
}

impl FamilyConfig for Config {
    fn spec(&self) -> ModelSpec {
        let d = &self.decoder;
        ModelSpec {
            model_type: "llava_next".into(),
            layers: vec![LayerKind::Attention; d.num_layers],
            num_kv_heads: self.num_kv_heads,
            head_dim: d.attention.head_dim,
            hidden_size: d.hidden(),
            vocab_size: d.vocab_size,
            max_context: self.max_context,
            special: self.special.clone(),
            vision: Some(VisionSpec {
                patch_size: self.vision.patch_size,
                spatial_merge_size: 1,
                temporal_patch_size: 1,
                video_timestamps: false,
                video_outer_markers: false,
                anyres: Some(self.anyres.clone()),
                image_side: None,
            }),
        }
    }

    fn param_counts(&self) -> ParamCounts {
        let (w, h) = (self.vision.layer.width as u64, self.decoder.hidden() as u64);
        let bias = if self.projector_bias { 2 * h } else { 0 };
        let projector = w * h + h * h + bias + h;
        ParamCounts::of(&self.decoder, self.vision.num_params() + projector)
    }

    fn build(&self, w: Weights) -> Result<VisionLanguageModel> {
        let (text, lm, prefixes) = parts(&w);
        // Only the image token is spliced; the M-RoPE fields are unused under sequential positions.
        let rope = RopeParams { merge: 1, image_token: self.special.image, video_token: self.special.video, video_time: VideoTime::Index };
        let model = VisionLanguageModel::assemble(
            self.spec(),
            rope,
            &w,
            || Ok(Decoder::new(&self.decoder, text, lm)?),
            || Ok(Box::new(Tower::new(self, prefixes)?)),
        )?;
        Ok(model.with_positions(PositionScheme::Sequential))
    }
}
