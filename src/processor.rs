//! Turning a chat request into model inputs, before the model sees it: chat template and
//! tokens (dialogue text never becomes a control token), and media preprocessed into patch
//! grids (HF-equal). Like HF's `AutoProcessor`: the tokenizer and the image processor of one
//! checkpoint, plus what the model says about media placement. Cheap to clone; runs on the
//! caller's thread, never between engine steps.

use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::audio::{MelConfig, MelExtractor};
use crate::chat::{ContentPart, Message};
use crate::models::{AudioSpec, MediaGrid, ModelSpec, VisionSpec};
use crate::tokenizer::{ChatTokenizer, Placeholder};
use crate::vision::{self, Media, Patches, PreprocessorConfig};

/// One preprocessed image, video or audio clip. An audio clip's "patches" are its log-mel
/// rows: `[mels, frames]` (grid_thw `[1, 1, mels]`, patch_dim the valid frames), the layout the
/// audio encoder takes.
pub struct MediaItem {
    pub patches: Patches,
    pub grid: MediaGrid,
}

/// What the processor needs to hear: the model's audio input and the feature extractor.
#[derive(Clone)]
struct Hearing {
    spec: AudioSpec,
    mel: Arc<MelExtractor>,
}

#[derive(Clone)]
pub struct Processor {
    pub tokenizer: Arc<ChatTokenizer>,
    pub preprocessor: PreprocessorConfig,
    /// Absent for text-only models (then any media is an error).
    vision: Option<VisionSpec>,
    /// Absent for models without an audio encoder (then any audio is an error).
    hearing: Option<Hearing>,
}

impl Processor {
    pub fn new(tokenizer: Arc<ChatTokenizer>, mut preprocessor: PreprocessorConfig, spec: &ModelSpec) -> Self {
        // Any-resolution tiles are cut into the model's patches (LLaVA-NeXT's image processor
        // config names no patch size; its processor_config.json repeats the model's).
        if let Some(v) = spec.vision.as_ref().filter(|v| v.anyres.is_some()) {
            preprocessor.patch_size = v.patch_size;
        }
        // So are fixed-size (SigLIP) images; their patches are row-major, one per token before
        // the model's own pooling. This is the one place that sets it: the image processor's file
        // (Gemma3ImageProcessor's) names neither, and every config, read or the family's default,
        // meets the model here.
        if let Some(v) = spec.vision.as_ref().filter(|_| preprocessor.fixed_size.is_some()) {
            preprocessor.patch_size = v.patch_size;
            (preprocessor.merge_size, preprocessor.temporal_patch_size) = (1, 1);
        }
        Processor { tokenizer, preprocessor, vision: spec.vision.clone(), hearing: None }
    }

    /// The processor of a model with an audio encoder: clips become `mel`'s log-mel features.
    pub fn with_audio(self, spec: AudioSpec, mel: MelConfig) -> Result<Self> {
        if mel.n_mels != spec.mel_bins {
            bail!("the feature extractor gives {} mel bins (feature_size) but the audio encoder takes {} (num_mel_bins)", mel.n_mels, spec.mel_bins);
        }
        Ok(Processor { hearing: Some(Hearing { spec, mel: Arc::new(MelExtractor::new(mel)) }), ..self })
    }

    /// Whether this model hears (has an audio encoder).
    pub fn hears(&self) -> bool {
        self.hearing.is_some()
    }

    /// Seconds of audio one clip can hold (the feature extractor's chunk: 30 s for
    /// Qwen2.5-Omni); a longer clip is truncated to it. `None` for models that do not hear.
    pub fn audio_window(&self) -> Option<f64> {
        self.hearing.as_ref().map(|h| h.mel.config().chunk_seconds as f64)
    }

    fn hearing(&self) -> Result<&Hearing> {
        self.hearing.as_ref().context("this model takes no audio")
    }

    /// The tokenizer's media tokens must be the ones the model config names, or every
    /// placeholder would be spliced in the wrong place (a tokenizer from another checkpoint).
    pub fn check_ids(&self, spec: &ModelSpec) -> Result<()> {
        if let Some(h) = &self.hearing {
            let t = self.tokenizer.special();
            for (name, tok, cfg) in [("audio", t.audio_pad, h.spec.token), ("audio-start", t.audio_start, h.spec.start), ("audio-end", t.audio_end, h.spec.end)] {
                if tok != cfg {
                    bail!("the tokenizer's {name} token is id {tok} but the model config says {cfg}: tokenizer and config come from different checkpoints");
                }
            }
        }
        if spec.vision.is_none() {
            return Ok(());
        }
        let t = self.tokenizer.special();
        let s = &spec.special;
        // A tokenizer without video or marker tokens (LLaVA's) is checked on its image token.
        for (name, tok, cfg) in [
            ("image", t.image_pad, s.image),
            ("video", t.video_pad, s.video),
            ("vision-start", t.vision_start, s.vision_start),
            ("vision-end", t.vision_end, s.vision_end),
        ] {
            if tok != cfg && tok != crate::tokenizer::SpecialTokens::NONE {
                bail!("the tokenizer's {name} token is id {tok} but the model config says {cfg}: tokenizer and config come from different checkpoints");
            }
        }
        Ok(())
    }

    fn vision(&self) -> Result<&VisionSpec> {
        self.vision.as_ref().context("this model takes no images or videos")
    }

    /// The vision spec, if the model takes this kind of media: fixed-size (SigLIP) towers take
    /// images only.
    fn check_media_kind(&self, is_video: bool) -> Result<&VisionSpec> {
        let v = self.vision()?;
        if is_video && self.preprocessor.fixed_size.is_some() {
            bail!("this model takes images but no videos; give its frames as images");
        }
        Ok(v)
    }

    /// Log-mel rows of an audio clip, cut to the frames that hold signal (transformers'
    /// `feature_attention_mask`), as the model takes them.
    fn preprocess_audio(&self, pcm: &crate::audio::Pcm) -> Result<MediaItem> {
        let h = self.hearing()?;
        let mel = h.mel.extract(&pcm.samples);
        let valid = mel.mask.iter().filter(|&&m| m == 1).count();
        if AudioSpec::tokens(valid) == 0 {
            bail!("the audio clip is {} samples long: too short for one audio token", pcm.samples.len());
        }
        let data = (0..mel.n_mels).flat_map(|r| mel.row(r)[..valid].iter().copied()).collect();
        let patches = Patches { data, grid_thw: [1, 1, mel.n_mels], patch_dim: valid };
        Ok(MediaItem { patches, grid: MediaGrid::audio(valid) })
    }

    /// Preprocesses one media item into patches and its grid.
    pub fn preprocess(&self, m: &Media) -> Result<MediaItem> {
        let (patches, is_video, secs) = match m {
            Media::Audio(pcm) => return self.preprocess_audio(pcm),
            Media::Image(img) => {
                self.check_media_kind(false)?;
                (vision::preprocess_image(img, &self.preprocessor)?, false, 0.0)
            }
            Media::Video { frames, fps } => {
                self.check_media_kind(true)?;
                let p = vision::preprocess_video(frames, &self.preprocessor)?;
                (p, true, self.preprocessor.temporal_patch_size as f64 / fps)
            }
        };
        let (frames, h, w) = m.dims();
        let frames = if is_video { frames } else { 0 };
        let grid = MediaGrid { thw: patches.grid_thw, is_video, second_per_grid: secs, frames, size: [h, w], audio_frames: 0 };
        Ok(MediaItem { patches, grid })
    }

    /// The grid an item of these (frames, height, width) gets, without touching pixels
    /// (`smart_resize` on the size alone). Videos are padded to whole temporal patches.
    pub fn grid_for(&self, (frames, h, w): (usize, usize, usize), is_video: bool, fps: f64) -> Result<MediaGrid> {
        let v = self.check_media_kind(is_video)?;
        let p = &self.preprocessor;
        if let Some([fh, fw]) = p.fixed_size {
            let crops = p.pan_and_scan.as_ref().map_or(0, |ps| ps.crops([h, w]).len());
            return Ok(MediaGrid { size: [h, w], ..MediaGrid::image([1 + crops, fh / p.patch_size, fw / p.patch_size]) });
        }
        if let (Some(a), false) = (&p.anyres, is_video) {
            let side = a.tile / v.patch_size.max(1);
            return Ok(MediaGrid { thw: [a.tiles([h, w]), side, side], size: [h, w], ..MediaGrid::image([1, 1, 1]) });
        }
        let (rh, rw) = match p.video_budget {
            Some((lo, hi)) if is_video && frames > 1 => vision::preprocess::smart_resize_video(frames, h, w, p.temporal_patch_size, p.factor(), lo, hi)?,
            _ => vision::smart_resize(h, w, p.factor(), p.min_pixels, p.max_pixels)?,
        };
        let t = if is_video { frames.div_ceil(p.temporal_patch_size) } else { 1 };
        let secs = if is_video { p.temporal_patch_size as f64 / fps } else { 0.0 };
        let frames = if is_video { frames } else { 0 };
        Ok(MediaGrid { thw: [t, rh / p.patch_size, rw / p.patch_size], is_video, second_per_grid: secs, frames, size: [h, w], audio_frames: 0 })
    }

    /// The grid of any media item without touching pixels or computing features.
    pub fn grid_of(&self, m: &Media) -> Result<MediaGrid> {
        match m {
            Media::Audio(pcm) => {
                let frames = self.hearing()?.mel.config().valid_frames(pcm.samples.len());
                Ok(MediaGrid::audio(frames))
            }
            Media::Video { fps, .. } => self.grid_for(m.dims(), true, *fps),
            Media::Image(_) => self.grid_for(m.dims(), false, 2.0),
        }
    }

    /// Prompt token ids with each placeholder expanded to its item's merged-token count
    /// (Qwen3-VL videos: one run per temporal step, each after its time).
    pub fn encode_prompt(&self, messages: &[Message], grids: &[MediaGrid]) -> Result<Vec<u32>> {
        let items = grids
            .iter()
            .map(|g| match g.is_audio() {
                true => self.hearing().map(|_| Placeholder::Audio(AudioSpec::tokens(g.audio_frames))),
                false => self.vision().map(|v| placeholder(v, g)),
            })
            .collect::<Result<Vec<_>>>()?;
        self.tokenizer.encode_chat_with(messages, true, &items)
    }

    /// Refuses messages whose text alone cannot fit `max_context` tokens, without tokenizing.
    pub fn check_text_fits(&self, messages: &[Message], max_context: usize) -> Result<()> {
        let bytes: usize = messages
            .iter()
            .flat_map(|m| &m.content)
            .map(|p| match p {
                ContentPart::Text(t) => t.len(),
                _ => 0,
            })
            .sum();
        let at_least = self.tokenizer.min_tokens(bytes);
        if at_least >= max_context {
            anyhow::bail!("the prompt's text is {bytes} bytes, at least {at_least} tokens, but the context window is {max_context} tokens");
        }
        Ok(())
    }

    /// Prompt length without touching pixels or computing audio features, so callers can
    /// budget context cheaply.
    pub fn count_tokens_with(&self, messages: &[Message], media: &[Media]) -> Result<usize> {
        let grids = media.iter().map(|m| self.grid_of(m)).collect::<Result<Vec<_>>>()?;
        Ok(self.encode_prompt(messages, &grids)?.len())
    }

    /// Prompt length without touching pixels, so callers can budget context cheaply.
    pub fn count_prompt_tokens(&self, messages: &[Message], media_dims: &[(usize, usize, usize)]) -> Result<usize> {
        let grids = media_dims.iter().map(|&d| self.grid_for(d, d.0 > 1, 2.0)).collect::<Result<Vec<_>>>()?;
        Ok(self.encode_prompt(messages, &grids)?.len())
    }
}

/// How the prompt spells one media item.
fn placeholder(v: &VisionSpec, g: &MediaGrid) -> Placeholder {
    // A fixed-size image with pan-and-scan crops: the whole image, then each crop.
    if v.image_side.is_some() && !g.is_video && g.thw[0] > 1 {
        let per_image = v.tokens(&MediaGrid { thw: [1, g.thw[1], g.thw[2]], ..g.clone() });
        return Placeholder::Crops { per_image, crops: g.thw[0] - 1 };
    }
    if g.is_video && v.video_timestamps {
        let per_step = v.tokens(&MediaGrid { thw: [1, g.thw[1], g.thw[2]], ..g.clone() });
        Placeholder::Steps { per_step, seconds: g.step_seconds(v.temporal_patch_size), keep_outer: v.video_outer_markers }
    } else {
        Placeholder::Run(v.tokens(g))
    }
}

/// The messages must have one `Image`/`Video`/`Audio` part per media item, of the item's kind
/// (audio parts for audio clips, image or video parts for the rest), in order.
pub fn check_placeholders(messages: &[Message], media: &[Media]) -> Result<()> {
    let parts: Vec<&ContentPart> = messages.iter().flat_map(|m| m.content.iter()).filter(|c| !matches!(c, ContentPart::Text(_))).collect();
    if parts.len() != media.len() {
        bail!("the messages reference {} images/videos/audio clips but {} were given", parts.len(), media.len());
    }
    if let Some(k) = parts.iter().zip(media).position(|(p, m)| (**p == ContentPart::Audio) != m.is_audio()) {
        let (part, item) = if media[k].is_audio() { ("an image or video part", "an audio clip") } else { ("an audio part", "an image or video") };
        bail!("media item {k} is {item} but its place in the messages is {part}");
    }
    Ok(())
}
