//! A loaded checkpoint ready to answer chat requests: model + tokenizer + preprocessor.
//! This is the single-sequence path the CLI uses today; the paged engine builds on the same
//! pieces (`prepare_request` is shared).

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

use crate::chat::{ContentPart, Message};
use crate::config::ModelConfig;
use crate::generate::{generate, Generation, SamplingParams};
use crate::hub::ModelFiles;
use crate::models::{MediaGrid, QwenVl, VisionInput};
use crate::tokenizer::MergTokenizer;
use crate::vision::{self, Patches, PreprocessorConfig};

/// Media for one request, in the order their placeholders appear in the messages.
#[derive(Clone, Debug)]
pub enum Media {
    Image(image::RgbImage),
    /// Frames sampled at `fps` frames per second.
    Video { frames: Vec<image::RgbImage>, fps: f64 },
}

pub struct Runtime {
    pub model: QwenVl,
    pub tokenizer: MergTokenizer,
    pub preprocessor: PreprocessorConfig,
    pub files: Option<ModelFiles>,
}

/// One preprocessed image or video.
pub struct MediaItem {
    pub patches: Patches,
    pub grid: MediaGrid,
}

/// A request turned into model inputs.
pub struct PreparedRequest {
    pub ids: Vec<u32>,
    pub vision: VisionInput,
}

pub struct Reply {
    pub text: String,
    pub generation: Generation,
}

pub fn parse_device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        s if s == "cuda" || s.starts_with("cuda:") => {
            let ord = s.strip_prefix("cuda:").map(str::parse::<usize>).transpose().context("--device cuda:N")?;
            Device::new_cuda(ord.unwrap_or(0)).with_context(|| {
                format!("--device {s}: CUDA is not available (build with `--features cuda` and check the driver)")
            })
        }
        other => bail!("--device {other:?}: use cpu, cuda or cuda:N"),
    }
}

impl Runtime {
    /// Loads a checkpoint found by `hub::resolve` (repo id or local directory).
    pub fn load(files: ModelFiles, device: &Device, dtype: Option<DType>) -> Result<Self> {
        let cfg = ModelConfig::from_file(&files.config)?;
        let dtype = dtype.unwrap_or_else(|| crate::weights::default_dtype(device));
        let model = QwenVl::load(&cfg, &files.weights, dtype, device)
            .with_context(|| format!("loading model {}", files.source))?;
        let tokenizer = MergTokenizer::from_dir(&files.dir)?;
        let preprocessor = match &files.preprocessor_config {
            Some(p) => PreprocessorConfig::from_file(p)?,
            None => PreprocessorConfig::default(),
        };
        Ok(Runtime { model, tokenizer, preprocessor, files: Some(files) })
    }

    /// Preprocesses each media item into patches + its grid, in the given order (which must be
    /// the order of the `Image`/`Video` parts in the messages).
    pub fn preprocess_media(&self, messages: &[Message], media: &[Media]) -> Result<Vec<MediaItem>> {
        check_placeholders(messages, media)?;
        media.iter().map(|m| self.preprocess_one(m)).collect()
    }

    pub fn preprocess_one(&self, m: &Media) -> Result<MediaItem> {
        let (patches, is_video, secs) = match m {
            Media::Image(img) => (vision::preprocess_image(img, &self.preprocessor)?, false, 0.0),
            Media::Video { frames, fps } => {
                let p = vision::preprocess_video(frames, &self.preprocessor)?;
                (p, true, self.preprocessor.temporal_patch_size as f64 / fps)
            }
        };
        let grid = MediaGrid { thw: patches.grid_thw, is_video, second_per_grid: secs };
        Ok(MediaItem { patches, grid })
    }

    /// Prompt token ids with each placeholder expanded to its item's merged-token count.
    pub fn encode_prompt(&self, messages: &[Message], items: &[MediaItem]) -> Result<Vec<u32>> {
        let grids: Vec<MediaGrid> = items.iter().map(|i| i.grid.clone()).collect();
        self.encode_prompt_grids(messages, &grids)
    }

    /// As `encode_prompt`, from the grids alone (the engine's vision cache keeps grids, so a
    /// cached image needs no preprocessing at all).
    pub fn encode_prompt_grids(&self, messages: &[Message], grids: &[MediaGrid]) -> Result<Vec<u32>> {
        let merge = self.model.cfg.vision.spatial_merge_size.max(1);
        let counts: Vec<usize> = grids.iter().map(|g| g.thw.iter().product::<usize>() / (merge * merge)).collect();
        self.tokenizer.encode_chat(messages, true, &counts)
    }

    /// Prompt length without touching pixels: each placeholder's token count comes from the
    /// image size (`smart_resize`), so callers can budget context cheaply.
    pub fn count_prompt_tokens(&self, messages: &[Message], media_dims: &[(usize, usize, usize)]) -> Result<usize> {
        let p = &self.preprocessor;
        let grids = media_dims
            .iter()
            .map(|&(frames, h, w)| {
                let (rh, rw) = vision::smart_resize(h, w, p.factor(), p.min_pixels, p.max_pixels)?;
                // Videos are padded to whole temporal patches; an image is one.
                let t = if frames <= 1 { 1 } else { frames.div_ceil(p.temporal_patch_size) };
                Ok(MediaGrid { thw: [t, rh / p.patch_size, rw / p.patch_size], is_video: frames > 1, second_per_grid: 0.0 })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(self.encode_prompt_grids(messages, &grids)?.len())
    }

    /// Tokenizes the messages and preprocesses the media into patch tensors.
    pub fn prepare_request(&self, messages: &[Message], media: &[Media]) -> Result<PreparedRequest> {
        let items = self.preprocess_media(messages, media)?;
        let ids = self.encode_prompt(messages, &items)?;
        let dev = self.model.device();
        let cat = |video: bool| -> Result<Option<Tensor>> {
            let ts = items
                .iter()
                .filter(|i| i.grid.is_video == video)
                .map(|i| i.patches.to_tensor(dev))
                .collect::<Result<Vec<_>>>()?;
            Ok(if ts.is_empty() { None } else { Some(Tensor::cat(&ts, 0)?) })
        };
        let vision = VisionInput {
            image_patches: cat(false)?,
            video_patches: cat(true)?,
            media: items.iter().map(|i| i.grid.clone()).collect(),
        };
        Ok(PreparedRequest { ids, vision })
    }

    pub fn chat(&self, messages: &[Message], media: &[Media], params: &SamplingParams, max_context: Option<usize>) -> Result<Reply> {
        let req = self.prepare_request(messages, media)?;
        let mut params = params.clone();
        if params.stop_token_ids.is_empty() {
            params.stop_token_ids = self.tokenizer.stop_token_ids();
        }
        let generation = generate(&self.model, &req.ids, &req.vision, &params, max_context)?;
        let text = self.tokenizer.decode(&generation.tokens, true)?;
        Ok(Reply { text, generation })
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

/// Loads media files named on the command line; videos are sampled at `fps`.
pub fn load_media(images: &[PathBuf], video: Option<&PathBuf>, fps: f64, max_frames: usize) -> Result<Vec<Media>> {
    let mut out: Vec<Media> = images.iter().map(|p| vision::load_image(p).map(Media::Image)).collect::<Result<_>>()?;
    if let Some(v) = video {
        out.push(load_video(v, fps, max_frames)?);
    }
    Ok(out)
}

#[cfg(feature = "video")]
fn load_video(path: &std::path::Path, fps: f64, max_frames: usize) -> Result<Media> {
    let v = vision::load_video_frames(path, fps as f32, max_frames)?;
    Ok(Media::Video { frames: v.frames, fps: v.fps as f64 })
}

#[cfg(not(feature = "video"))]
fn load_video(path: &std::path::Path, _fps: f64, _max_frames: usize) -> Result<Media> {
    bail!("{}: this merg was built without the `video` feature; pass keyframes as images", path.display())
}
