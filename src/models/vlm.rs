//! The one vision-language model type: the shared decoder, a family's vision tower and its
//! position conventions. A family is its config parsing (`FamilyConfig`), its tower
//! (`VisionEncoder`) and its `RopeParams`; this type does the rest of `Model` for all of them —
//! splicing features into the placeholders, DeepStack rows, the M-RoPE index.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

use super::cache::StepCache;
use super::decoder::Decoder;
use super::media::{cat_kind, placeholder_rows, splice_features};
use super::position::{mrope_index, sequential_index, tmrope_index, PositionScheme, RopeParams};
use super::{AudioSpec, Deepstack, MediaGrid, Model, ModelSpec, ParamCounts, Positions, PromptInputs};
use crate::weights::Weights;

/// A family's vision tower, as the shared model drives it.
pub trait VisionEncoder: Send + Sync {
    /// Merged features `[tokens, hidden]` of one media item, and one `[tokens, hidden]` tensor
    /// per DeepStack level (none for towers without DeepStack).
    fn encode(&self, patches: &Tensor, grid: &MediaGrid) -> Result<(Tensor, Vec<Tensor>)>;

    /// DeepStack levels `encode` returns.
    fn deepstack_levels(&self) -> usize {
        0
    }
}

/// A family's audio tower (Qwen2.5-Omni's Whisper-style encoder), as the shared model drives it.
pub trait AudioEncoder: Send + Sync {
    /// Features `[tokens, hidden]` of one clip's log-mel frames `[mels, frames]` (its valid
    /// frames only: the feature extractor's padding to 30 s cut off).
    fn encode(&self, mel: &Tensor) -> Result<Tensor>;
}

/// What a family's parsed config gives the registry: the model's spec and parameter counts
/// without reading a weight, and the model built from a weight source.
pub trait FamilyConfig {
    fn spec(&self) -> ModelSpec;
    fn param_counts(&self) -> ParamCounts;
    /// What a user should know about how the checkpoint is read (parts not loaded, …).
    fn notes(&self) -> Vec<String> {
        vec![]
    }
    fn build(&self, weights: Weights) -> Result<VisionLanguageModel>;
}

pub struct VisionLanguageModel {
    pub text: Decoder,
    pub vision: Box<dyn VisionEncoder>,
    rope: RopeParams,
    positions: PositionScheme,
    spec: ModelSpec,
    prompt: PromptStyle,
    audio: Option<(AudioSpec, Box<dyn AudioEncoder>)>,
}

/// A family's prompt conventions beyond its rope parameters.
#[derive(Clone, Copy, Debug, Default)]
pub struct PromptStyle {
    /// Each image's tokens attend to each other in both directions (Gemma 3, as transformers'
    /// `token_type_ids` mask).
    pub bidirectional_images: bool,
}

impl VisionLanguageModel {
    /// Builds the decoder and tower from `weights`; a tensor that does not match the config
    /// fails naming the part, the tensor and the source.
    pub fn assemble(
        spec: ModelSpec,
        rope: RopeParams,
        weights: &Weights,
        text: impl FnOnce() -> Result<Decoder>,
        vision: impl FnOnce() -> Result<Box<dyn VisionEncoder>>,
    ) -> Result<Self> {
        let build = || -> Result<Self> {
            let text = text().context("text decoder")?;
            let vision = vision().context("vision tower")?;
            Ok(VisionLanguageModel { text, vision, rope, positions: PositionScheme::MRope, spec, prompt: PromptStyle::default(), audio: None })
        };
        build().with_context(|| format!("checkpoint [{}] does not match its config.json", weights.describe()))
    }

    /// The same model with other prompt conventions.
    pub fn with_prompt_style(self, prompt: PromptStyle) -> Self {
        VisionLanguageModel { prompt, ..self }
    }

    /// The same model hearing through `encoder` (its placeholder token and frame geometry in `spec`).
    pub fn with_audio(self, spec: AudioSpec, encoder: Box<dyn AudioEncoder>) -> Self {
        VisionLanguageModel { audio: Some((spec, encoder)), ..self }
    }

    /// Numbers prompt positions by `scheme` instead of M-RoPE (the default).
    pub fn with_positions(mut self, scheme: PositionScheme) -> Self {
        self.positions = scheme;
        self
    }

    /// Position ids `[3][L]` and the rope delta, equal to transformers' `get_rope_index` (or
    /// its plain `arange` for families without M-RoPE).
    pub fn rope_index(&self, ids: &[u32], media: &[MediaGrid]) -> Result<(Positions, i64)> {
        match self.positions {
            PositionScheme::MRope => mrope_index(ids, media, &self.rope),
            PositionScheme::Sequential => Ok(sequential_index(ids.len())),
            PositionScheme::TmRope(tm) => tmrope_index(ids, media, &self.rope, &tm),
        }
    }

    /// `(first, len)` of every run of image placeholders, when images attend bidirectionally.
    fn bidirectional(&self, ids: &[u32]) -> Vec<(usize, usize)> {
        if !self.prompt.bidirectional_images {
            return vec![];
        }
        image_runs(ids, self.rope.image_token)
    }

    fn hidden(&self) -> usize {
        self.spec.hidden_size
    }

    /// `embeds` with the audio placeholders' rows replaced by the clips' features (in prompt
    /// order, as transformers' `masked_scatter`).
    fn splice_audio(&self, embeds: &Tensor, ids: &[u32], audio: &[Tensor]) -> Result<Tensor> {
        let Some((spec, _)) = &self.audio else {
            if !audio.is_empty() {
                bail!("{} has no audio encoder, but {} audio clips were given", self.spec.model_type, audio.len());
            }
            return Ok(embeds.clone());
        };
        let placeholders = ids.iter().filter(|&&t| t == spec.token).count();
        let rows = audio.iter().map(|a| a.dim(0)).sum::<candle_core::Result<usize>>()?;
        if placeholders != rows {
            bail!("the prompt has {placeholders} audio placeholder tokens but the {} audio clips give {rows} feature rows", audio.len());
        }
        if audio.is_empty() {
            return Ok(embeds.clone());
        }
        if let Some(a) = audio.iter().find(|a| a.dim(1).ok() != Some(self.hidden())) {
            bail!("audio features of width {:?}, expected the hidden size {}", a.dim(1).ok(), self.hidden());
        }
        // The audio token is the only kind spliced here; u32::MAX stands for "no second kind".
        splice_features(embeds, ids, spec.token, u32::MAX, Some(&Tensor::cat(audio, 0)?), None)
    }

    /// DeepStack features of the prompt's placeholder rows, from each item's levels.
    fn deepstack(&self, ids: &[u32], features: &[Tensor]) -> Result<Option<Deepstack>> {
        let (hidden, levels) = (self.hidden(), self.vision.deepstack_levels());
        if features.is_empty() || levels == 0 {
            return Ok(None);
        }
        let deep: Vec<Tensor> = features.iter().map(|f| f.narrow(1, hidden, hidden * levels)).collect::<candle_core::Result<_>>()?;
        // Media are in prompt order and each item's tokens are contiguous, so the items' rows
        // in order are the placeholder rows in order.
        let rows = placeholder_rows(ids, self.rope.image_token, self.rope.video_token);
        let features = Tensor::cat(&deep, 0)?;
        if features.dim(0)? != rows.len() {
            bail!("{} placeholder tokens but {} DeepStack feature rows", rows.len(), features.dim(0)?);
        }
        Ok(Some(Deepstack { rows, features }))
    }
}

impl Model for VisionLanguageModel {
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
        let (main, levels) = self.vision.encode(&patches.to_device(self.device())?, grid)?;
        if levels.is_empty() {
            return Ok(main);
        }
        let mut parts = vec![main];
        parts.extend(levels);
        Ok(Tensor::cat(&parts, 1)?)
    }

    fn prepare_prompt(&self, ids: &[u32], media: &[MediaGrid], features: &[Tensor]) -> Result<PromptInputs> {
        self.prepare_prompt_with_audio(ids, media, features, &[])
    }

    fn audio_spec(&self) -> Option<&AudioSpec> {
        self.audio.as_ref().map(|(s, _)| s)
    }

    fn encode_audio(&self, mel: &Tensor) -> Result<Tensor> {
        let Some((spec, encoder)) = &self.audio else { bail!("{} has no audio encoder", self.spec.model_type) };
        let (mels, frames) = mel.dims2().context("log-mel features must be [mels, frames]")?;
        // Fewer than 3 frames pool to no token at all.
        if mels != spec.mel_bins || AudioSpec::tokens(frames) == 0 {
            bail!("log-mel features of {mels} mels × {frames} frames: the audio encoder takes {} mels and at least 3 frames", spec.mel_bins);
        }
        encoder.encode(&mel.to_device(self.device())?)
    }

    fn prepare_prompt_with_audio(&self, ids: &[u32], media: &[MediaGrid], features: &[Tensor], audio: &[Tensor]) -> Result<PromptInputs> {
        if media.len() != features.len() {
            bail!("{} media items but {} feature tensors", media.len(), features.len());
        }
        let hidden = self.hidden();
        let width = hidden * (1 + self.vision.deepstack_levels());
        if let Some(f) = features.iter().find(|f| f.dim(1).ok() != Some(width)) {
            bail!("vision features of width {:?}, expected {width} (hidden × (1 + DeepStack levels))", f.dim(1).ok());
        }
        let (positions, rope_delta) = self.rope_index(ids, media)?;
        let main: Vec<Tensor> = features.iter().map(|f| f.narrow(1, 0, hidden)).collect::<candle_core::Result<_>>()?;
        let (img, vid) = (cat_kind(media, &main, false)?, cat_kind(media, &main, true)?);
        let text = self.text.embed(ids)?;
        let embeds = splice_features(&text, ids, self.rope.image_token, self.rope.video_token, img.as_ref(), vid.as_ref())?;
        let embeds = self.splice_audio(&embeds, ids, audio)?;
        let deepstack = self.deepstack(ids, features)?;
        Ok(PromptInputs { embeds, positions, rope_delta, deepstack, bidirectional: self.bidirectional(ids) })
    }

    fn embed_tokens(&self, ids: &[u32]) -> Result<Tensor> {
        Ok(self.text.embed(ids)?)
    }

    fn forward(&self, embeds: &Tensor, positions: &Positions, deepstack: Option<&Deepstack>, cache: &mut dyn StepCache) -> Result<Tensor> {
        if deepstack.is_some() && self.vision.deepstack_levels() == 0 {
            bail!("{} has no DeepStack layers", self.spec.model_type);
        }
        Ok(self.text.forward(embeds, positions, deepstack, cache)?)
    }

    fn logits(&self, hidden: &Tensor) -> Result<Tensor> {
        Ok(self.text.logits(hidden)?)
    }
}

/// `(first, len)` of every maximal run of `token` in `ids` (transformers' image groups).
pub fn image_runs(ids: &[u32], token: u32) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = vec![];
    for (i, &t) in ids.iter().enumerate() {
        match runs.last_mut() {
            Some((a, n)) if t == token && *a + *n == i => *n += 1,
            _ if t == token => runs.push((i, 1)),
            _ => {}
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    #[test]
    fn image_runs_are_maximal_runs() {
        assert_eq!(super::image_runs(&[1, 9, 9, 2, 9, 3, 9, 9, 9], 9), vec![(1, 2), (4, 1), (6, 3)]);
        assert!(super::image_runs(&[1, 2], 9).is_empty());
    }
}
