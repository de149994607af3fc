//! Turning a chat request into model inputs, before the model sees it: chat template and
//! tokens (dialogue text never becomes a control token), and media preprocessed into patch
//! grids (HF-equal). Like HF's `AutoProcessor`: the tokenizer and the image processor of one
//! checkpoint, plus what the model says about media placement. Cheap to clone; runs on the
//! caller's thread, never between engine steps.

use std::sync::Arc;

use anyhow::{bail, Context, Result};

use crate::chat::{ContentPart, Message};
use crate::models::{MediaGrid, ModelSpec, VisionSpec};
use crate::tokenizer::{ChatTokenizer, Placeholder};
use crate::vision::{self, Media, Patches, PreprocessorConfig};

/// One preprocessed image or video.
pub struct MediaItem {
    pub patches: Patches,
    pub grid: MediaGrid,
}

#[derive(Clone)]
pub struct Processor {
    pub tokenizer: Arc<ChatTokenizer>,
    pub preprocessor: PreprocessorConfig,
    /// Absent for text-only models (then any media is an error).
    vision: Option<VisionSpec>,
}

impl Processor {
    pub fn new(tokenizer: Arc<ChatTokenizer>, mut preprocessor: PreprocessorConfig, spec: &ModelSpec) -> Self {
        // Any-resolution tiles are cut into the model's patches (LLaVA-NeXT's image processor
        // config names no patch size; its processor_config.json repeats the model's).
        if let Some(v) = spec.vision.as_ref().filter(|v| v.anyres.is_some()) {
            preprocessor.patch_size = v.patch_size;
        }
        // So are fixed-size (SigLIP) images; their patches are row-major, one per token before
        // the model's own pooling.
        if let Some(v) = spec.vision.as_ref().filter(|_| preprocessor.fixed_size.is_some()) {
            preprocessor.patch_size = v.patch_size;
            (preprocessor.merge_size, preprocessor.temporal_patch_size) = (1, 1);
        }
        Processor { tokenizer, preprocessor, vision: spec.vision.clone() }
    }

    /// The tokenizer's media tokens must be the ones the model config names, or every
    /// placeholder would be spliced in the wrong place (a tokenizer from another checkpoint).
    pub fn check_ids(&self, spec: &ModelSpec) -> Result<()> {
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

    /// Preprocesses one media item into patches and its grid.
    pub fn preprocess(&self, m: &Media) -> Result<MediaItem> {
        self.check_media_kind(matches!(m, Media::Video { .. }))?;
        let (patches, is_video, secs) = match m {
            Media::Image(img) => (vision::preprocess_image(img, &self.preprocessor)?, false, 0.0),
            Media::Video { frames, fps } => {
                let p = vision::preprocess_video(frames, &self.preprocessor)?;
                (p, true, self.preprocessor.temporal_patch_size as f64 / fps)
            }
        };
        let frames = match m {
            Media::Video { frames, .. } => frames.len(),
            Media::Image(_) => 0,
        };
        let size = match m {
            Media::Image(img) => [img.height() as usize, img.width() as usize],
            Media::Video { frames, .. } => frames.first().map_or([0, 0], |f| [f.height() as usize, f.width() as usize]),
        };
        let grid = MediaGrid { thw: patches.grid_thw, is_video, second_per_grid: secs, frames, size };
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
        Ok(MediaGrid { thw: [t, rh / p.patch_size, rw / p.patch_size], is_video, second_per_grid: secs, frames, size: [h, w] })
    }

    /// Prompt token ids with each placeholder expanded to its item's merged-token count
    /// (Qwen3-VL videos: one run per temporal step, each after its time).
    pub fn encode_prompt(&self, messages: &[Message], grids: &[MediaGrid]) -> Result<Vec<u32>> {
        let items: Vec<Placeholder> = match grids.is_empty() {
            true => vec![],
            false => {
                let v = self.vision()?;
                grids.iter().map(|g| placeholder(v, g)).collect()
            }
        };
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

/// The messages must have one `Image`/`Video` part per media item.
pub fn check_placeholders(messages: &[Message], media: &[Media]) -> Result<()> {
    let placeholders = messages
        .iter()
        .flat_map(|m| m.content.iter())
        .filter(|c| matches!(c, ContentPart::Image | ContentPart::Video))
        .count();
    if placeholders != media.len() {
        bail!("the messages reference {placeholders} images/videos but {} were given", media.len());
    }
    Ok(())
}
