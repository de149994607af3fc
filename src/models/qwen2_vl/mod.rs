//! Qwen2-VL and Qwen2.5-VL: vision tower + Qwen2 text decoder + the glue that puts vision
//! features into the placeholder positions of the prompt. The two variants share the decoder;
//! the vision towers differ in norm, MLP and window attention, and Qwen2.5-VL scales video
//! time in the positions.

pub mod config;
pub mod position;
pub mod vision;

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

pub use config::{Config, TextConfig, Variant, VisionConfig};
use position::rope_index;
use vision::VisionTower;

use super::cache::StepCache;
use super::decoder::Decoder;
use super::media::{cat_kind, splice_features};
use super::{Deepstack, LayerKind, MediaGrid, Model, ModelSpec, Positions, PromptInputs, SpecialIds, VisionSpec};
use crate::weights::Weights;

pub struct QwenVl {
    pub cfg: Config,
    pub text: Decoder,
    pub vision: VisionTower,
    spec: ModelSpec,
}

/// Where a checkpoint keeps its parts: hub layout (`model.`, `visual.`) or the layout newer
/// transformers writes (`model.language_model.`, `model.visual.`).
pub fn prefixes(has_tensor: impl Fn(&str) -> bool) -> (&'static str, &'static str) {
    if has_tensor("model.language_model.embed_tokens.weight") {
        ("model.language_model", "model.visual")
    } else {
        ("model", "visual")
    }
}

/// The registry's loader for `qwen2_vl` and `qwen2_5_vl`.
pub fn load_from_config(config: &Value, weights: Weights) -> Result<Arc<dyn Model>> {
    let cfg = Config::from_value(config)?;
    Ok(Arc::new(QwenVl::new(&cfg, weights)?))
}

/// The registry's parameter counter.
pub fn params_from_config(config: &Value) -> Result<super::ParamCounts> {
    let cfg = Config::from_value(config)?;
    Ok(super::ParamCounts::of(&cfg.text.decoder(), cfg.vision.num_params(cfg.variant)))
}

/// The registry's spec reader.
pub fn spec_from_config(config: &Value) -> Result<ModelSpec> {
    Ok(spec_of(&Config::from_value(config)?))
}

impl QwenVl {
    pub fn new(cfg: &Config, w: Weights) -> Result<Self> {
        let (text_prefix, vision_prefix) = prefixes(|n| w.contains(n));
        let source = w.describe();
        let build = || -> Result<Self> {
            let text = Decoder::new(&cfg.text.decoder(), w.pp(text_prefix), w.clone()).context("text decoder")?;
            let vision = VisionTower::new(cfg.variant, &cfg.vision, w.pp(vision_prefix)).context("vision tower")?;
            Ok(QwenVl { cfg: cfg.clone(), text, vision, spec: spec_of(cfg) })
        };
        build().with_context(|| format!("checkpoint [{source}] does not match its config.json"))
    }

    /// Loads memory-mapped safetensors shards; a tensor that does not match the config fails
    /// with its name and both shapes.
    pub fn load(cfg: &Config, files: &[PathBuf], dtype: DType, device: &Device) -> Result<Self> {
        Self::new(cfg, Weights::safetensors(files, dtype, device)?)
    }

    /// Random weights of the right shapes (benchmarks, `--load-format dummy`).
    pub fn dummy(cfg: &Config, dtype: DType, device: &Device) -> Result<Self> {
        Self::new(cfg, Weights::dummy(dtype, device))
    }
}

fn spec_of(cfg: &Config) -> ModelSpec {
    let t = &cfg.text;
    ModelSpec {
        model_type: cfg.variant.model_type().to_string(),
        layers: vec![LayerKind::Attention; t.num_hidden_layers],
        num_kv_heads: t.num_key_value_heads,
        head_dim: t.head_dim(),
        hidden_size: t.hidden_size,
        vocab_size: t.vocab_size,
        max_context: t.max_position_embeddings,
        special: SpecialIds {
            image: cfg.image_token_id,
            video: cfg.video_token_id,
            vision_start: cfg.vision_start_token_id,
            vision_end: cfg.vision_end_token_id,
            eos: cfg.eos_token_ids.clone(),
        },
        vision: Some(VisionSpec {
            patch_size: cfg.vision.patch_size,
            spatial_merge_size: cfg.vision.spatial_merge_size,
            temporal_patch_size: cfg.vision.temporal_patch_size,
            video_timestamps: false,
            video_outer_markers: false,
        }),
    }
}

impl Model for QwenVl {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn device(&self) -> &Device {
        self.text.device()
    }

    fn dtype(&self) -> DType {
        self.text.dtype()
    }

    fn encode_media(&self, patches: &Tensor, grid: &MediaGrid) -> Result<Tensor> {
        Ok(self.vision.forward(&patches.to_device(self.device())?, &[grid.thw])?)
    }

    fn prepare_prompt(&self, ids: &[u32], media: &[MediaGrid], features: &[Tensor]) -> Result<PromptInputs> {
        if media.len() != features.len() {
            bail!("{} media items but {} feature tensors", media.len(), features.len());
        }
        let (positions, rope_delta) = rope_index(ids, media, &self.cfg)?;
        let (img, vid) = (cat_kind(media, features, false)?, cat_kind(media, features, true)?);
        let text = self.text.embed(ids)?;
        let embeds = splice_features(&text, ids, self.cfg.image_token_id, self.cfg.video_token_id, img.as_ref(), vid.as_ref())?;
        Ok(PromptInputs { embeds, positions, rope_delta, deepstack: None })
    }

    fn embed_tokens(&self, ids: &[u32]) -> Result<Tensor> {
        Ok(self.text.embed(ids)?)
    }

    fn forward(&self, embeds: &Tensor, positions: &Positions, deepstack: Option<&Deepstack>, cache: &mut dyn StepCache) -> Result<Tensor> {
        if deepstack.is_some() {
            bail!("{} has no DeepStack layers", self.cfg.variant.model_type());
        }
        Ok(self.text.forward(embeds, positions, None, cache)?)
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.text.logits(hidden)?)
    }
}
