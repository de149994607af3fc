//! A whole Qwen2-VL / Qwen2.5-VL: vision tower + text decoder + the glue that puts vision
//! features into the placeholder positions of the prompt.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};
use candle_nn::VarBuilder;

use super::kv::AttentionBackend;
use super::position::{decode_positions, rope_index, MediaGrid};
use super::text::TextModel;
use super::vision::VisionTower;
use crate::config::ModelConfig;

/// Vision input of one request: patches of all images, patches of all videos, and the grid of
/// each item in prompt order.
#[derive(Clone, Debug, Default)]
pub struct VisionInput {
    pub image_patches: Option<Tensor>,
    pub video_patches: Option<Tensor>,
    pub media: Vec<MediaGrid>,
}

/// A prompt ready for prefill: token ids (placeholders expanded), their 3-D positions, and
/// the vision features that replace the placeholders.
pub struct Prefill {
    pub embeds: Tensor,
    pub positions: [Vec<i64>; 3],
    pub rope_delta: i64,
}

pub struct QwenVl {
    pub cfg: ModelConfig,
    pub text: TextModel,
    pub vision: VisionTower,
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

impl QwenVl {
    pub fn new(cfg: &ModelConfig, vb: VarBuilder) -> Result<Self> {
        let (text_prefix, vision_prefix) = prefixes(|n| vb.contains_tensor(n));
        let text = TextModel::new(&cfg.text, vb.pp(text_prefix), vb.clone()).context("text decoder")?;
        let vision = VisionTower::new(cfg.family, &cfg.vision, vb.pp(vision_prefix)).context("vision tower")?;
        Ok(QwenVl { cfg: cfg.clone(), text, vision })
    }

    /// Loads memory-mapped safetensors shards; a tensor that does not match the config fails
    /// with its name and both shapes.
    pub fn load(cfg: &ModelConfig, weights: &[PathBuf], dtype: DType, device: &Device) -> Result<Self> {
        let vb = crate::weights::mmap_var_builder(weights, dtype, device)?;
        Self::new(cfg, vb).with_context(|| {
            format!("checkpoint [{}] does not match its config.json", crate::weights::file_names(weights))
        })
    }

    /// Random weights of the right shapes (benchmarks, `--load-format dummy`).
    pub fn dummy(cfg: &ModelConfig, dtype: DType, device: &Device) -> Result<Self> {
        Self::new(cfg, crate::weights::dummy_var_builder(dtype, device))
    }

    pub fn device(&self) -> &Device {
        self.text.device()
    }

    pub fn dtype(&self) -> DType {
        self.text.dtype()
    }

    /// Runs the vision tower(s) and returns per-kind features `[tokens, hidden]`.
    pub fn encode_vision(&self, input: &VisionInput) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grids = |video: bool| -> Vec<[usize; 3]> {
            input.media.iter().filter(|m| m.is_video == video).map(|m| m.thw).collect()
        };
        let enc = |patches: &Option<Tensor>, video: bool| -> Result<Option<Tensor>> {
            match patches {
                Some(p) => Ok(Some(self.vision.forward(&p.to_device(self.device())?, &grids(video))?)),
                None => Ok(None),
            }
        };
        Ok((enc(&input.image_patches, false)?, enc(&input.video_patches, true)?))
    }

    /// Embeds the prompt and scatters vision features into the placeholder positions.
    pub fn prepare(&self, ids: &[u32], input: &VisionInput) -> Result<Prefill> {
        let (positions, rope_delta) = rope_index(ids, &input.media, &self.cfg)?;
        let (img, vid) = self.encode_vision(input)?;
        let embeds = self.merge_features(ids, img.as_ref(), vid.as_ref())?;
        Ok(Prefill { embeds, positions, rope_delta })
    }

    /// Same as `prepare`, with vision features already computed (e.g. from a cache).
    pub fn merge_features(&self, ids: &[u32], img: Option<&Tensor>, vid: Option<&Tensor>) -> Result<Tensor> {
        let text = self.text.embed(ids)?;
        let mut rows: Vec<Tensor> = Vec::new();
        let (mut next_img, mut next_vid) = (0usize, 0usize);
        let mut run_start = 0;
        // Splice contiguous text runs and feature runs; a token-by-token scatter would be O(L) ops.
        let mut i = 0;
        while i < ids.len() {
            let (feat, cursor) = if ids[i] == self.cfg.image_token_id {
                (img, &mut next_img)
            } else if ids[i] == self.cfg.video_token_id {
                (vid, &mut next_vid)
            } else {
                i += 1;
                continue;
            };
            let tok = ids[i];
            let mut j = i;
            while j < ids.len() && ids[j] == tok {
                j += 1;
            }
            let Some(feat) = feat else { bail!("prompt has placeholder tokens but no vision input") };
            if *cursor + (j - i) > feat.dim(0)? {
                bail!("prompt has more placeholder tokens than vision features ({})", feat.dim(0)?);
            }
            if run_start < i {
                rows.push(text.narrow(0, run_start, i - run_start)?);
            }
            rows.push(feat.narrow(0, *cursor, j - i)?.to_dtype(text.dtype())?);
            *cursor += j - i;
            run_start = j;
            i = j;
        }
        if run_start < ids.len() {
            rows.push(text.narrow(0, run_start, ids.len() - run_start)?);
        }
        for (feat, used) in [(img, next_img), (vid, next_vid)] {
            if let Some(f) = feat {
                if f.dim(0)? != used {
                    bail!("{} vision features but {used} placeholder tokens", f.dim(0)?);
                }
            }
        }
        Ok(Tensor::cat(&rows, 0)?)
    }

    /// Decoder forward; returns f32 logits `[T, vocab]` of the last `keep` tokens.
    pub fn forward(
        &self,
        embeds: &Tensor,
        positions: &[Vec<i64>; 3],
        kv: &mut dyn AttentionBackend,
        keep: usize,
    ) -> Result<Tensor> {
        let hidden = self.text.forward(embeds, positions, kv)?;
        let t = hidden.dim(0)?;
        let keep = keep.min(t);
        Ok(self.text.logits(&hidden.narrow(0, t - keep, keep)?)?)
    }

    /// One decode step for a single token.
    pub fn decode_step(&self, token: u32, past: usize, rope_delta: i64, kv: &mut dyn AttentionBackend) -> Result<Tensor> {
        let e = self.text.embed(&[token])?;
        let pos = decode_positions(past, 1, rope_delta);
        Ok(self.forward(&e, &pos, kv, 1)?.squeeze(0)?)
    }
}
