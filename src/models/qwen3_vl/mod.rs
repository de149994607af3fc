//! Qwen3-VL (dense) and Qwen3-VL-MoE: the Qwen3-VL vision tower with DeepStack, and the
//! shared decoder in its Qwen3 form (q/k norm, interleaved M-RoPE, optional sparse experts).
//! Qwen3.5 (`models::qwen3_5`) is this model with a hybrid decoder and no DeepStack.
//! Videos are one placeholder run per temporal step, each after its time as text; positions
//! are the shared M-RoPE index with every step its own item.

pub mod config;
pub mod vision;

use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use serde_json::Value;

pub use config::{Config, TextConfig, VisionConfig};
use vision::VisionTower;

use super::cache::StepCache;
use super::decoder::Decoder;
use super::media::{cat_kind, placeholder_rows, splice_features};
use super::position::{mrope_index, RopeParams, VideoTime};
use super::{Deepstack, MediaGrid, Model, ModelSpec, Positions, PromptInputs, SpecialIds, VisionSpec};
use crate::weights::Weights;

pub struct Qwen3Vl {
    pub cfg: Config,
    pub text: Decoder,
    pub vision: VisionTower,
    spec: ModelSpec,
}

/// The registry's loader for `qwen3_vl` and `qwen3_vl_moe`.
pub fn load_from_config(config: &Value, weights: Weights) -> Result<Arc<dyn Model>> {
    Ok(Arc::new(Qwen3Vl::new(&Config::from_value(config)?, weights)?))
}

/// The registry's parameter counter.
pub fn params_from_config(config: &Value) -> Result<super::ParamCounts> {
    let cfg = Config::from_value(config)?;
    Ok(super::ParamCounts::of(&cfg.decoder, cfg.vision.num_params()))
}

/// The registry's spec reader.
pub fn spec_from_config(config: &Value) -> Result<ModelSpec> {
    Ok(spec_of(&Config::from_value(config)?))
}

impl Qwen3Vl {
    pub fn new(cfg: &Config, w: Weights) -> Result<Self> {
        let source = w.describe();
        let build = || -> Result<Self> {
            let text = Decoder::new(&cfg.decoder, w.pp("model").pp("language_model"), w.clone()).context("text decoder")?;
            let vision = VisionTower::new(&cfg.vision, w.pp("model").pp("visual")).context("vision tower")?;
            Ok(Qwen3Vl { cfg: cfg.clone(), text, vision, spec: spec_of(cfg) })
        };
        build().with_context(|| format!("checkpoint [{source}] does not match its config.json"))
    }

    pub fn rope_params(&self) -> RopeParams {
        RopeParams {
            merge: self.cfg.vision.spatial_merge_size,
            image_token: self.cfg.image_token_id,
            video_token: self.cfg.video_token_id,
            video_time: VideoTime::PerStep,
        }
    }

    /// Position ids `[3][L]` and the rope delta, equal to transformers' `get_rope_index`.
    pub fn rope_index(&self, ids: &[u32], media: &[MediaGrid]) -> Result<(Positions, i64)> {
        mrope_index(ids, media, &self.rope_params())
    }
}

pub fn spec_of(cfg: &Config) -> ModelSpec {
    let t = &cfg.text;
    ModelSpec {
        model_type: cfg.model_type.clone(),
        layers: cfg.decoder.layer_kinds(),
        num_kv_heads: t.num_key_value_heads,
        head_dim: t.head_dim,
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
            video_timestamps: true,
            // The goldens' transformers: 4.57 for Qwen3-VL, 5.x (keeps them) for Qwen3.5.
            video_outer_markers: cfg.model_type == "qwen3_5",
        }),
    }
}

impl Model for Qwen3Vl {
    fn spec(&self) -> &ModelSpec {
        &self.spec
    }

    fn device(&self) -> &Device {
        self.text.device()
    }

    fn dtype(&self) -> DType {
        self.text.dtype()
    }

    /// `[tokens, hidden · (1 + levels)]`: the merged features, then each DeepStack level, so
    /// the vision cache keeps every level of an item together.
    fn encode_media(&self, patches: &Tensor, grid: &MediaGrid) -> Result<Tensor> {
        let (main, levels) = self.vision.forward(&patches.to_device(self.device())?, &[grid.thw])?;
        let mut parts = vec![main];
        parts.extend(levels);
        Ok(Tensor::cat(&parts, 1)?)
    }

    fn prepare_prompt(&self, ids: &[u32], media: &[MediaGrid], features: &[Tensor]) -> Result<PromptInputs> {
        if media.len() != features.len() {
            bail!("{} media items but {} feature tensors", media.len(), features.len());
        }
        let hidden = self.cfg.text.hidden_size;
        let width = hidden * (1 + self.vision.levels());
        if let Some(f) = features.iter().find(|f| f.dim(1).ok() != Some(width)) {
            bail!("vision features of width {:?}, expected {width} (hidden × (1 + DeepStack levels))", f.dim(1).ok());
        }
        let (positions, rope_delta) = self.rope_index(ids, media)?;
        let main: Vec<Tensor> = features.iter().map(|f| f.narrow(1, 0, hidden)).collect::<candle_core::Result<_>>()?;
        let (img, vid) = (cat_kind(media, &main, false)?, cat_kind(media, &main, true)?);
        let text = self.text.embed(ids)?;
        let (it, vt) = (self.cfg.image_token_id, self.cfg.video_token_id);
        let embeds = splice_features(&text, ids, it, vt, img.as_ref(), vid.as_ref())?;
        let deepstack = match (features.is_empty(), self.vision.levels()) {
            (true, _) | (_, 0) => None,
            _ => {
                let deep: Vec<Tensor> = features.iter().map(|f| f.narrow(1, hidden, width - hidden)).collect::<candle_core::Result<_>>()?;
                // Media are in prompt order and each item's tokens are contiguous, so the
                // items' rows in order are the placeholder rows in order.
                let rows = placeholder_rows(ids, it, vt);
                let features = Tensor::cat(&deep, 0)?;
                if features.dim(0)? != rows.len() {
                    bail!("{} placeholder tokens but {} DeepStack feature rows", rows.len(), features.dim(0)?);
                }
                Some(Deepstack { rows, features })
            }
        };
        Ok(PromptInputs { embeds, positions, rope_delta, deepstack })
    }

    fn embed_tokens(&self, ids: &[u32]) -> Result<Tensor> {
        Ok(self.text.embed(ids)?)
    }

    fn forward(&self, embeds: &Tensor, positions: &Positions, deepstack: Option<&Deepstack>, cache: &mut dyn StepCache) -> Result<Tensor> {
        Ok(self.text.forward(embeds, positions, deepstack, cache)?)
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.text.logits(hidden)?)
    }
}
