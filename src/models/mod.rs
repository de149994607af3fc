//! Model families behind one trait. The engine, its sequences and the vision cache see only
//! `Model` and its `ModelSpec`; every family is one `vlm::VisionLanguageModel` (the shared
//! decoder, the family's vision tower and position conventions). Each family lives in its own
//! folder (`qwen2_vl/` serves Qwen2-VL and Qwen2.5-VL) with its config parsing, and is found
//! by `registry::load` from the checkpoint's `model_type`. Shared blocks are in
//! `crate::layers`, weight sources in `crate::weights`.
// No tensor is read back to the host here except through `engine::sampling::read_back` or
// where a site says why its tensor is on the host (.clippy.toml; tests may read freely).
#![cfg_attr(not(test), warn(clippy::disallowed_methods))]

pub mod cache;
pub mod cost;
pub mod decoder;
pub mod gemma3;
pub mod llava_next;
pub mod media;
pub mod position;
pub mod qwen2_5_omni;
pub mod qwen2_vl;
pub mod qwen3_5;
pub mod qwen3_vl;
pub mod registry;
pub mod vlm;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use serde::Serialize;

pub use cache::{DenseCache, RecurrentState, StepCache, Visibility};
pub use media::Deepstack;
pub use registry::{load, param_counts, supported_model_types};
pub use vlm::{AudioEncoder, FamilyConfig, VisionEncoder, VisionLanguageModel};

/// 3-D (t, h, w) position ids, one vector per component; text-only models repeat one vector.
pub type Positions = [Vec<i64>; 3];

/// What a decoder layer mixes tokens with, which decides the cache it needs.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub enum LayerKind {
    /// Softmax attention: K/V of every past token, in the paged pool.
    Attention,
    /// Softmax attention over the last `window` tokens only (Gemma 3's local layers; itself
    /// included, as transformers counts it): K/V of the window's tokens, in the pool's sliding
    /// group, which releases older blocks as a sequence advances.
    SlidingAttention { window: usize },
    /// Linear attention / SSM (Gated DeltaNet): a fixed-size state per sequence — a causal
    /// convolution window and a recurrent matrix — whatever the sequence length.
    Recurrent { conv_shape: Vec<usize>, state_shape: Vec<usize> },
}

/// Token ids the engine must know.
#[derive(Clone, Debug, Serialize, serde::Deserialize)]
pub struct SpecialIds {
    pub image: u32,
    pub video: u32,
    pub vision_start: u32,
    pub vision_end: u32,
    /// End-of-sequence ids from the config (the tokenizer adds its own stop tokens).
    pub eos: Vec<u32>,
}

impl SpecialIds {
    /// A family whose prompts mark media by one image token and nothing else (LLaVA-NeXT): the
    /// image token stands in for the video token and the markers, so no other id is reserved
    /// and every id below it is ordinary text.
    pub fn image_only(image: u32, eos: Vec<u32>) -> SpecialIds {
        SpecialIds { image, video: image, vision_start: image, vision_end: image, eos }
    }

    /// The ids of a vision-language config.json: each placeholder and marker id at the top
    /// level (older exports keep them in the text fields), the end-of-sequence id(s) from the
    /// text fields (`text`: the top level with `text_config` over it).
    pub fn from_config(root: &serde_json::Value, text: &serde_json::Map<String, serde_json::Value>) -> Result<SpecialIds> {
        use anyhow::Context;
        use serde_json::Value;
        let id = |key: &str| -> Result<u32> {
            root.get(key).or_else(|| text.get(key)).and_then(Value::as_u64).map(|v| v as u32).with_context(|| format!("missing token id \"{key}\""))
        };
        let eos = Self::eos_of(text);
        Ok(SpecialIds { image: id("image_token_id")?, video: id("video_token_id")?, vision_start: id("vision_start_token_id")?, vision_end: id("vision_end_token_id")?, eos })
    }

    /// The `eos_token_id` of config fields: one id or a list (none when absent).
    pub fn eos_of(fields: &serde_json::Map<String, serde_json::Value>) -> Vec<u32> {
        use serde_json::Value;
        match fields.get("eos_token_id") {
            Some(Value::Number(n)) => n.as_u64().map(|v| vec![v as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|v| v as u32).collect(),
            _ => vec![],
        }
    }
}

/// How media become placeholder tokens.
#[derive(Clone, Debug, Serialize)]
pub struct VisionSpec {
    pub patch_size: usize,
    /// Patches merged per side into one token.
    pub spatial_merge_size: usize,
    pub temporal_patch_size: usize,
    /// Qwen3-VL: each temporal step of a video is its own placeholder run, preceded by its
    /// time as text (`<1.2 seconds>`), instead of one run per video.
    pub video_timestamps: bool,
    /// With timestamps: the template's own vision-start/-end stay around the steps
    /// (transformers 5's processor, Qwen3.5) instead of being replaced (4.57, Qwen3-VL).
    pub video_outer_markers: bool,
    /// LLaVA-NeXT: images are tiled at any resolution, and an image's token count follows from
    /// its size (the unpadded grid), not from a patch grid.
    #[serde(skip)]
    pub anyres: Option<crate::vision::anyres::AnyRes>,
    /// SigLIP-style towers (Gemma 3): every image is resized to this square side, whatever
    /// its aspect, so every image takes the same tokens.
    pub image_side: Option<usize>,
}

impl VisionSpec {
    /// Placeholder tokens one media item of this grid takes.
    pub fn tokens(&self, grid: &MediaGrid) -> usize {
        if let Some(a) = &self.anyres {
            return a.tokens(grid.size, a.tile / self.patch_size.max(1));
        }
        let m = self.spatial_merge_size.max(1);
        grid.thw.iter().product::<usize>() / (m * m)
    }
}

/// How a model hears: its audio placeholder and markers, and the log-mel frames it takes.
#[derive(Clone, Debug, Serialize)]
pub struct AudioSpec {
    /// Placeholder token, one per audio feature row (`<|AUDIO|>`).
    pub token: u32,
    pub start: u32,
    pub end: u32,
    /// Mel bins of the features (`num_mel_bins`).
    pub mel_bins: usize,
    /// Mel frames per attention window of the encoder (`2 × n_window`).
    pub chunk_frames: usize,
}

impl AudioSpec {
    /// Placeholder tokens of a clip of `frames` mel frames: the stride-2 convolution, then the
    /// pooling by two (transformers' `_get_feat_extract_output_lengths`).
    pub fn tokens(frames: usize) -> usize {
        let after_conv = (frames as i64 - 1).div_euclid(2) + 1;
        ((after_conv - 2).div_euclid(2) + 1).max(0) as usize
    }
}

/// Everything the engine needs to know about a model, without its weights.
#[derive(Clone, Debug, Serialize)]
pub struct ModelSpec {
    pub model_type: String,
    /// Kind of every decoder layer, in order.
    pub layers: Vec<LayerKind>,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub hidden_size: usize,
    pub vocab_size: usize,
    /// Longest sequence the positions support.
    pub max_context: usize,
    pub special: SpecialIds,
    /// Absent for text-only models.
    pub vision: Option<VisionSpec>,
}

impl LayerKind {
    /// Whether the layer keeps K/V in the paged pool (global or sliding attention).
    pub fn has_kv(&self) -> bool {
        !matches!(self, LayerKind::Recurrent { .. })
    }

    /// The sliding window of a windowed attention layer.
    pub fn window(&self) -> Option<usize> {
        match self {
            LayerKind::SlidingAttention { window } => Some(*window),
            _ => None,
        }
    }
}

impl ModelSpec {
    /// Layers with K/V in the pool: global and sliding attention.
    pub fn num_attention_layers(&self) -> usize {
        self.layers.iter().filter(|k| k.has_kv()).count()
    }

    /// Attention layers over every past token (K/V per token of the sequence).
    pub fn num_global_layers(&self) -> usize {
        self.layers.iter().filter(|k| **k == LayerKind::Attention).count()
    }

    /// Sliding-window attention layers (K/V of a window's worth of tokens per sequence).
    pub fn num_sliding_layers(&self) -> usize {
        self.layers.iter().filter(|k| k.window().is_some()).count()
    }

    /// The widest window of the sliding layers (the pool's sliding group keeps that many
    /// tokens, enough for every narrower window too); `None` without sliding layers.
    pub fn sliding_window(&self) -> Option<usize> {
        self.layers.iter().filter_map(LayerKind::window).max()
    }

    /// Layers with recurrent state (the prefix cache cannot restore them from K/V blocks).
    pub fn has_recurrent_layers(&self) -> bool {
        self.layers.iter().any(|k| matches!(k, LayerKind::Recurrent { .. }))
    }

    /// What the family's released `preprocessor_config.json` holds, for a model built from
    /// its config alone: patch geometry from the model, and Qwen3-VL's own mean/std and budget.
    pub fn default_preprocessor(&self) -> crate::vision::PreprocessorConfig {
        let mut c = crate::vision::PreprocessorConfig::default();
        if let Some(v) = &self.vision {
            (c.patch_size, c.merge_size, c.temporal_patch_size) = (v.patch_size, v.spatial_merge_size, v.temporal_patch_size);
        }
        if let Some(a) = self.vision.as_ref().and_then(|v| v.anyres.clone()) {
            c.anyres = Some(a);
        }
        // Gemma3ImageProcessor: one square, bilinear, mean = std = 0.5. Its patch geometry (the
        // model's patch size, no merge, no temporal step) is `Processor::new`'s, as for a file.
        if let Some(side) = self.vision.as_ref().and_then(|v| v.image_side) {
            (c.fixed_size, c.resample) = (Some([side, side]), 2);
            (c.image_mean, c.image_std) = ([0.5; 3], [0.5; 3]);
        }
        if self.model_type.starts_with("qwen3") {
            (c.image_mean, c.image_std) = ([0.5; 3], [0.5; 3]);
            (c.min_pixels, c.max_pixels) = (65_536, 16_777_216);
        }
        c
    }
}

/// Parameter counts of a model, from its config alone.
#[derive(Clone, Copy, Debug, Default, Serialize, PartialEq, Eq)]
pub struct ParamCounts {
    /// Decoder linear-layer weights (what in-situ quantization quantizes).
    pub text_linear: u64,
    /// Decoder embeddings, norms, biases and recurrent parameters.
    pub text_other: u64,
    pub vision: u64,
    /// Audio tower (Qwen2.5-Omni); 0 for models without one.
    pub audio: u64,
    /// Decoder parameters one token runs through (MoE: its top-k experts only).
    pub text_active: u64,
    /// Whether the output head is the embedding matrix.
    pub tied_head: bool,
}

impl ParamCounts {
    pub fn total(&self) -> u64 {
        self.text_linear + self.text_other + self.vision + self.audio
    }

    fn of(decoder: &decoder::DecoderConfig, vision: u64) -> Self {
        let (text_linear, text_other) = decoder.num_params();
        ParamCounts { text_linear, text_other, vision, audio: 0, text_active: decoder.active_params(), tied_head: decoder.tie_word_embeddings }
    }
}

/// One image or video as the decoder sees it.
#[derive(Clone, Debug, PartialEq)]
pub struct MediaGrid {
    /// Patch grid (t, h, w) before spatial merging.
    pub thw: [usize; 3],
    pub is_video: bool,
    /// Seconds covered by one temporal grid step (video only).
    pub second_per_grid: f64,
    /// Frames of a video before padding to whole temporal patches (0 when unknown: then
    /// every temporal step is taken as full).
    pub frames: usize,
    /// (height, width) in pixels of the source image: LLaVA-NeXT unpads its features by it
    /// (0 when no family needs it).
    pub size: [usize; 2],
    /// Log-mel frames of an audio clip; 0 for images and videos. An audio item's other fields
    /// mean nothing: it never reaches the vision tower or the vision position index.
    pub audio_frames: usize,
}

impl MediaGrid {
    pub fn image(thw: [usize; 3]) -> Self {
        MediaGrid { thw, is_video: false, second_per_grid: 0.0, frames: 0, size: [0, 0], audio_frames: 0 }
    }

    /// An audio clip of `frames` log-mel frames.
    pub fn audio(frames: usize) -> Self {
        MediaGrid { thw: [0, 0, 0], audio_frames: frames, ..MediaGrid::image([0, 0, 0]) }
    }

    pub fn is_audio(&self) -> bool {
        self.audio_frames > 0
    }

    /// Mid-time in seconds of each temporal step, as Qwen3-VL's processor writes it: frame
    /// `i` is at `i / fps`; a step's time is the mean of its first and last frame, the last
    /// frame repeating where the video was padded.
    pub fn step_seconds(&self, temporal_patch: usize) -> Vec<f64> {
        let tp = temporal_patch.max(1);
        let fps = tp as f64 / self.second_per_grid;
        let n = if self.frames == 0 { self.thw[0] * tp } else { self.frames };
        (0..self.thw[0])
            .map(|s| {
                let first = (s * tp).min(n - 1);
                let last = (s * tp + tp - 1).min(n - 1);
                (first as f64 / fps + last as f64 / fps) / 2.0
            })
            .collect()
    }
}

/// A prompt ready for the decoder: embeddings with media features spliced in, positions, the
/// offset that continues positions after the prompt, and DeepStack features (Qwen3-VL).
pub struct PromptInputs {
    pub embeds: Tensor,
    pub positions: Positions,
    pub rope_delta: i64,
    pub deepstack: Option<Deepstack>,
    /// `(first, len)` token runs of the prompt that attend to each other in both directions
    /// (Gemma 3: each image's tokens); empty for causal-only families.
    pub bidirectional: Vec<(usize, usize)>,
}

/// A loaded model, as the engine drives it.
pub trait Model: Send + Sync {
    fn spec(&self) -> &ModelSpec;
    fn device(&self) -> &Device;
    fn dtype(&self) -> DType;

    /// Features `[tokens, width]` of one preprocessed media item (`patches` as the
    /// preprocessor cut them); `tokens` equals `spec().vision.tokens(grid)`. `width` is the
    /// family's own layout (hidden, or hidden × (1 + DeepStack levels) for Qwen3-VL); the
    /// vision cache keeps the tensor whole and hands it back to `prepare_prompt`.
    fn encode_media(&self, patches: &Tensor, grid: &MediaGrid) -> Result<Tensor>;

    /// Prompt ids (placeholders expanded) plus each media item's grid and features, in prompt
    /// order → decoder inputs.
    fn prepare_prompt(&self, ids: &[u32], media: &[MediaGrid], features: &[Tensor]) -> Result<PromptInputs>;

    /// The audio input this model takes; `None` for models without an audio encoder.
    fn audio_spec(&self) -> Option<&AudioSpec> {
        None
    }

    /// Features `[tokens, hidden]` of one clip's log-mel frames `[mels, frames]`; `tokens`
    /// equals `AudioSpec::tokens(frames)`.
    fn encode_audio(&self, _mel: &Tensor) -> Result<Tensor> {
        anyhow::bail!("{} has no audio encoder", self.spec().model_type)
    }

    /// `prepare_prompt` with each audio clip's features (from `encode_audio`, in prompt order)
    /// spliced into the audio placeholders.
    fn prepare_prompt_with_audio(&self, ids: &[u32], media: &[MediaGrid], features: &[Tensor], audio: &[Tensor]) -> Result<PromptInputs> {
        if !audio.is_empty() {
            anyhow::bail!("{} has no audio encoder, but {} audio clips were given", self.spec().model_type, audio.len());
        }
        self.prepare_prompt(ids, media, features)
    }

    /// Plain token embeddings `[T, hidden]` (generated tokens).
    fn embed_tokens(&self, ids: &[u32]) -> Result<Tensor>;

    /// Positions of `n` generated tokens after `past` tokens.
    fn decode_positions(&self, past: usize, n: usize, rope_delta: i64) -> Positions {
        let v: Vec<i64> = (0..n).map(|i| (past + i) as i64 + rope_delta).collect();
        [v.clone(), v.clone(), v]
    }

    /// One packed step over `embeds: [T, hidden]` through the step's caches; returns the final
    /// normed hidden states `[T, hidden]`. `deepstack` rows index this step's tokens.
    fn forward(&self, embeds: &Tensor, positions: &Positions, deepstack: Option<&Deepstack>, cache: &mut dyn StepCache) -> Result<Tensor>;

    /// Vocabulary logits in f32, `[T, vocab]`.
    fn logits(&self, hidden: &Tensor) -> Result<Tensor>;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_counts_attention_layers_only() {
        let spec = ModelSpec {
            model_type: "hybrid".into(),
            layers: vec![
                LayerKind::Recurrent { conv_shape: vec![4, 8], state_shape: vec![2, 4, 4] },
                LayerKind::Attention,
                LayerKind::Recurrent { conv_shape: vec![4, 8], state_shape: vec![2, 4, 4] },
                LayerKind::Attention,
            ],
            num_kv_heads: 2,
            head_dim: 8,
            hidden_size: 16,
            vocab_size: 32,
            max_context: 64,
            special: SpecialIds { image: 1, video: 2, vision_start: 3, vision_end: 4, eos: vec![] },
            vision: None,
        };
        assert_eq!(spec.num_attention_layers(), 2);
        assert!(spec.has_recurrent_layers());
        assert_eq!(spec.sliding_window(), None);
        let gemma = ModelSpec { layers: vec![LayerKind::SlidingAttention { window: 8 }, LayerKind::Attention, LayerKind::SlidingAttention { window: 4 }], ..spec };
        assert_eq!((gemma.num_attention_layers(), gemma.num_global_layers(), gemma.num_sliding_layers()), (3, 1, 2));
        assert_eq!(gemma.sliding_window(), Some(8));
        let v = VisionSpec { patch_size: 14, spatial_merge_size: 2, temporal_patch_size: 2, video_timestamps: false, video_outer_markers: false, anyres: None, image_side: None };
        assert_eq!(v.tokens(&MediaGrid::image([1, 32, 32])), 256);
    }

    /// HF's `_calculate_timestamps`: 4 frames at 2 fps → steps at 0.25 s and 1.25 s; 3 frames
    /// pad the last step with the last frame (1.0 s twice).
    #[test]
    fn step_seconds_average_each_temporal_patch() {
        let g = MediaGrid { thw: [2, 4, 4], is_video: true, second_per_grid: 1.0, frames: 4, size: [0, 0], audio_frames: 0 };
        assert_eq!(g.step_seconds(2), vec![0.25, 1.25]);
        let g = MediaGrid { frames: 3, ..g };
        assert_eq!(g.step_seconds(2), vec![0.25, 1.0]);
    }
}
