//! Gemma 3 (`gemma3`: 4B, 12B, 27B): the SigLIP tower with its pooling projector, and the shared
//! decoder in its Gemma form (`decoder::GemmaLayout`: sandwich norms, scaled embeddings, local
//! sliding-window layers between global ones). Positions are 1-D (`0..L`, media included) and
//! the tokens of one image attend to each other in both directions, as transformers masks them.

pub mod config;
pub mod vision;

use anyhow::Result;
use candle_core::Tensor;
use serde_json::Value;

pub use config::Config;
use vision::SiglipTower;

use super::decoder::Decoder;
use super::position::{RopeParams, VideoTime};
use super::position::PositionScheme;
use super::vlm::{FamilyConfig, PromptStyle, VisionEncoder, VisionLanguageModel};
use super::{ModelSpec, ParamCounts, VisionSpec};
use crate::weights::Weights;

/// The registry's config reader for `gemma3`.
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
            // An image is one square grid of patches; `pool × pool` of them make a token.
            vision: Some(VisionSpec { patch_size: self.vision.patch_size, spatial_merge_size: self.pool(), temporal_patch_size: 1, video_timestamps: false, video_outer_markers: false, anyres: None, image_side: Some(self.vision.image_size) }),
        }
    }

    fn param_counts(&self) -> ParamCounts {
        let v = &self.vision;
        let projector = (v.hidden_size * self.text.hidden_size + v.hidden_size) as u64;
        ParamCounts::of(&self.decoder, v.num_params() + projector)
    }

    fn build(&self, w: Weights) -> Result<VisionLanguageModel> {
        // Released checkpoints name the parts `language_model.model`, `vision_tower`,
        // `multi_modal_projector`; transformers ≥ 4.52 saves them under `model.`.
        let released = w.contains("language_model.model.embed_tokens.weight");
        let (text, tower, projector) = match released {
            true => (w.pp("language_model").pp("model"), w.pp("vision_tower"), w.pp("multi_modal_projector")),
            false => (w.pp("model").pp("language_model"), w.pp("model").pp("vision_tower"), w.pp("model").pp("multi_modal_projector")),
        };
        let rope = RopeParams { merge: self.pool(), image_token: self.special.image, video_token: self.special.video, video_time: VideoTime::Index };
        let model = VisionLanguageModel::assemble(
            self.spec(),
            rope,
            &w,
            || Ok(Decoder::new(&self.decoder, text, w.clone())?),
            || Ok(Box::new(SiglipTower::new(&self.vision, self.pool(), self.text.hidden_size, tower.pp("vision_model"), projector)?)),
        )?;
        Ok(model.with_positions(PositionScheme::Sequential).with_prompt_style(PromptStyle { bidirectional_images: true }))
    }
}

impl VisionEncoder for SiglipTower {
    /// One item is one image, or with pan-and-scan the image then its crops (`grid.thw[0]` of
    /// them), each through the tower on its own; their tokens follow each other.
    fn encode(&self, patches: &Tensor, grid: &super::MediaGrid) -> Result<(Tensor, Vec<Tensor>)> {
        let (images, per) = (grid.thw[0].max(1), grid.thw[1] * grid.thw[2]);
        if images == 1 {
            return Ok((self.forward(patches)?, vec![]));
        }
        let parts = (0..images).map(|i| self.forward(&patches.narrow(0, i * per, per)?)).collect::<candle_core::Result<Vec<_>>>()?;
        Ok((Tensor::cat(&parts, 0)?, vec![]))
    }
}
