//! HF-equal Qwen2-VL image/video preprocessing: smart_resize → PIL bicubic resize → rescale →
//! normalise → patchify, matching `Qwen2VLImageProcessor` (the slow, PIL-based one); and the
//! fixed-size form of SigLIP-style processors (Gemma 3: every image resized to one square).

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use candle_core::{Device, Tensor};
use image::RgbImage;
use serde::Deserialize;

use super::resize::{resize, Filter};

/// PIL's `Image.BICUBIC` enum value, the default resample filter.
const PIL_BICUBIC: u32 = 3;
/// OpenAI CLIP normalisation constants (HF `OPENAI_CLIP_MEAN` / `OPENAI_CLIP_STD`).
const CLIP_MEAN: [f64; 3] = [0.48145466, 0.4578275, 0.40821073];
const CLIP_STD: [f64; 3] = [0.26862954, 0.26130258, 0.27577711];

/// Subset of HF `preprocessor_config.json` that affects pixel values and grids.
#[derive(Deserialize, Clone, Debug)]
#[serde(from = "RawPreprocessorConfig")]
pub struct PreprocessorConfig {
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    /// Stored as f32 because HF builds `np.array(mean, dtype=float32)` before subtracting.
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    /// Kept f64: HF multiplies in float64 and only then casts to float32.
    pub rescale_factor: f64,
    pub do_resize: bool,
    pub do_rescale: bool,
    pub do_normalize: bool,
    pub do_convert_rgb: bool,
    /// PIL resample id; bilinear (2) and bicubic (3) are supported and `validate` enforces it.
    pub resample: u32,
    /// SigLIP-style processors (Gemma 3): every image is resized to this (height, width),
    /// whatever its aspect, and cut into row-major patches (no merge blocks, no time).
    pub fixed_size: Option<[usize; 2]>,
    /// Gemma 3: `do_pan_and_scan` (with a fixed size): wide or tall images are also shown as
    /// crops, each one more image of the same item.
    pub pan_and_scan: Option<super::pan_scan::PanAndScan>,
    /// Qwen3-VL videos: (min, max) pixels of the whole clip (frames × height × width), from
    /// `video_preprocessor_config.json`; `None`: each frame is sized like an image.
    pub video_budget: Option<(usize, usize)>,
    /// LLaVA-NeXT: images are tiled at any resolution (`image_grid_pinpoints`) instead of
    /// resized to a pixel budget.
    pub anyres: Option<super::anyres::AnyRes>,
    /// LLaVA-NeXT as read: (tile, crop (height, width), shortest edge), checked by `validate`.
    pub anyres_sides: Option<(usize, [usize; 2], usize)>,
}

/// `size` in newer configs: `{"shortest_edge": min_pixels, "longest_edge": max_pixels}`; some
/// older ones wrote `{"min_pixels": .., "max_pixels": ..}` instead.
#[derive(Deserialize, Default)]
struct RawSize {
    shortest_edge: Option<usize>,
    longest_edge: Option<usize>,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
    height: Option<usize>,
    width: Option<usize>,
}

/// Everything optional so absent keys fall back to Qwen2-VL's real defaults.
#[derive(Deserialize, Default)]
struct RawPreprocessorConfig {
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
    size: Option<RawSize>,
    patch_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    merge_size: Option<usize>,
    // f64 first, then cast: numpy also goes Python float (f64) → float32.
    image_mean: Option<[f64; 3]>,
    image_std: Option<[f64; 3]>,
    rescale_factor: Option<f64>,
    do_resize: Option<bool>,
    do_rescale: Option<bool>,
    do_normalize: Option<bool>,
    do_convert_rgb: Option<bool>,
    resample: Option<u32>,
    // LLaVA-NeXT (LlavaNextImageProcessor)
    image_grid_pinpoints: Option<Vec<[usize; 2]>>,
    crop_size: Option<RawCrop>,
    // Gemma 3 (Gemma3ImageProcessor)
    do_pan_and_scan: Option<bool>,
    pan_and_scan_min_crop_size: Option<usize>,
    pan_and_scan_max_num_crops: Option<usize>,
    pan_and_scan_min_ratio_to_activate: Option<f64>,
}

#[derive(Deserialize)]
struct RawCrop {
    height: usize,
    width: usize,
}

impl From<RawPreprocessorConfig> for PreprocessorConfig {
    fn from(r: RawPreprocessorConfig) -> Self {
        let size = r.size.unwrap_or_default();
        // LLaVA-NeXT: `size.shortest_edge` is the side every tile is resized to, not a pixel
        // count; `validate` requires it to equal the (square) crop, as in every released config.
        let anyres = r.image_grid_pinpoints.map(|pinpoints| {
            let tile = r.crop_size.as_ref().map(|c| c.height).or(size.shortest_edge).unwrap_or(336);
            super::anyres::AnyRes { pinpoints, tile }
        });
        let crop = r.crop_size.map(|c| [c.height, c.width]);
        let shortest = size.shortest_edge;
        let fixed_size = size.height.zip(size.width).map(|(h, w)| [h, w]);
        let pan_and_scan = (r.do_pan_and_scan == Some(true)).then(|| {
            let d = super::pan_scan::PanAndScan::default();
            super::pan_scan::PanAndScan {
                min_crop: r.pan_and_scan_min_crop_size.unwrap_or(d.min_crop),
                max_crops: r.pan_and_scan_max_num_crops.unwrap_or(d.max_crops),
                min_ratio: r.pan_and_scan_min_ratio_to_activate.unwrap_or(d.min_ratio),
            }
        });
        // HF: explicit min_pixels/max_pixels override `size`, which overrides the defaults.
        let min_pixels = r.min_pixels.or(size.shortest_edge).or(size.min_pixels).unwrap_or(56 * 56);
        let max_pixels =
            r.max_pixels.or(size.longest_edge).or(size.max_pixels).unwrap_or(28 * 28 * 1280);
        let f32x3 = |v: [f64; 3]| v.map(|x| x as f32);
        PreprocessorConfig {
            min_pixels,
            max_pixels,
            patch_size: r.patch_size.unwrap_or(14),
            temporal_patch_size: r.temporal_patch_size.unwrap_or(2),
            merge_size: r.merge_size.unwrap_or(2),
            image_mean: f32x3(r.image_mean.unwrap_or(CLIP_MEAN)),
            image_std: f32x3(r.image_std.unwrap_or(CLIP_STD)),
            rescale_factor: r.rescale_factor.unwrap_or(1.0 / 255.0),
            do_resize: r.do_resize.unwrap_or(true),
            do_rescale: r.do_rescale.unwrap_or(true),
            do_normalize: r.do_normalize.unwrap_or(true),
            do_convert_rgb: r.do_convert_rgb.unwrap_or(true),
            resample: r.resample.unwrap_or(PIL_BICUBIC),
            video_budget: None,
            fixed_size,
            pan_and_scan,
            anyres_sides: anyres.as_ref().map(|a| (a.tile, crop.unwrap_or([a.tile; 2]), shortest.unwrap_or(a.tile))),
            anyres,
        }
    }
}

impl Default for PreprocessorConfig {
    fn default() -> Self {
        RawPreprocessorConfig::default().into()
    }
}

/// The largest `min_pixels` / `max_pixels` accepted (Qwen2.5-VL's default max is 12.8 M).
pub const MAX_SANE_PIXELS: usize = 16384 * 16384;

impl PreprocessorConfig {
    /// Parse and validate a `preprocessor_config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = crate::input::read_string(path, &crate::input::CONFIG).context("reading the preprocessor config")?;
        Self::from_text(&text, path)
    }

    /// Parse and validate the text of a `preprocessor_config.json` read from `path` (named in
    /// errors), for callers that read the same file for more than the image settings.
    pub fn from_text(text: &str, path: &Path) -> Result<Self> {
        let de = &mut serde_json::Deserializer::from_str(text);
        let cfg: Self = serde_path_to_error::deserialize(de)
            .map_err(|e| anyhow::anyhow!("parsing preprocessor config {}: field {}: {}", path.display(), e.path(), e.inner()))?;
        cfg.validate().with_context(|| format!("invalid preprocessor config {}", path.display()))?;
        Ok(cfg)
    }

    /// Reads Qwen3-VL's clip-wide video budget from a `video_preprocessor_config.json`
    /// (other families' video configs repeat the image budget and change nothing).
    pub fn read_video_budget(&mut self, path: &Path) -> Result<()> {
        let text = crate::input::read_string(path, &crate::input::CONFIG).context("reading the video preprocessor config")?;
        let v: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("video preprocessor config {} is not valid JSON", path.display()))?;
        if v.get("video_processor_type").and_then(|t| t.as_str()) != Some("Qwen3VLVideoProcessor") {
            return Ok(());
        }
        let edge = |k: &str| v.get("size").and_then(|s| s.get(k)).and_then(|x| x.as_u64()).map(|x| x as usize);
        let (lo, hi) = (edge("shortest_edge").unwrap_or(128 * 32 * 32), edge("longest_edge").unwrap_or(32 * 32 * 768));
        ensure!(lo <= hi && hi <= MAX_SANE_PIXELS * 64, "video preprocessor config {}: size {lo}..{hi} is not a valid pixel budget", path.display());
        self.video_budget = Some((lo, hi));
        Ok(())
    }

    /// Spatial alignment of resized images: one merged token covers `factor` pixels per side.
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }

    /// Reject values that would make patchify divide by zero or silently differ from HF.
    pub fn validate(&self) -> Result<()> {
        ensure!(self.patch_size > 0, "patch_size must be > 0");
        // Resized images are allocated at up to max_pixels (and at least min_pixels): a value no
        // image needs would only turn into an allocation failure later.
        for (name, v) in [("min_pixels", self.min_pixels), ("max_pixels", self.max_pixels)] {
            ensure!(v <= MAX_SANE_PIXELS, "{name} is {v}; the most merg accepts is {MAX_SANE_PIXELS} (16384 × 16384)");
        }
        for (name, v) in [("patch_size", self.patch_size), ("merge_size", self.merge_size), ("temporal_patch_size", self.temporal_patch_size)] {
            ensure!(v <= 1024, "{name} is {v}; the most merg accepts is 1024");
        }
        ensure!(self.merge_size > 0, "merge_size must be > 0");
        ensure!(self.temporal_patch_size > 0, "temporal_patch_size must be > 0");
        ensure!(
            self.min_pixels <= self.max_pixels,
            "min_pixels ({}) exceeds max_pixels ({})",
            self.min_pixels,
            self.max_pixels
        );
        ensure!(
            Filter::from_pil(self.resample).is_some(),
            "resample={} unsupported: only PIL bilinear (2) and bicubic (3) are implemented",
            self.resample
        );
        if let Some([h, w]) = self.fixed_size {
            // The patch size is the model's (the file names none), checked when cutting.
            ensure!(h > 0 && w > 0 && h * w <= MAX_SANE_PIXELS, "size {h}x{w} is not a usable image size");
        }
        if let Some(p) = &self.pan_and_scan {
            ensure!(self.fixed_size.is_some(), "do_pan_and_scan needs a fixed image size (size.height and size.width)");
            p.validate()?;
        }
        ensure!(
            self.image_std.iter().all(|s| *s != 0.0),
            "image_std {:?} contains zero",
            self.image_std
        );
        if let Some(a) = &self.anyres {
            a.validate()?;
            // Tiles are cut at the crop size and then resized to the shortest edge and centre-
            // cropped: identities when the three agree, which is all merg reproduces.
            if let Some((tile, crop, shortest)) = self.anyres_sides {
                ensure!(crop == [tile, tile] && shortest == tile, "crop_size {crop:?} and size.shortest_edge {shortest} differ; only square tiles of the shortest edge are supported");
            }
        }
        Ok(())
    }
}

/// Python's `round()`: half to even (e.g. round(2.5) == 2), unlike Rust's `f64::round`.
fn py_round(x: f64) -> f64 {
    x.round_ties_even()
}

/// Target (height, width) exactly as HF `smart_resize`: both multiples of `factor`, pixel count in
/// `[min_pixels, max_pixels]`, aspect ratio kept as well as possible.
pub fn smart_resize(
    height: usize,
    width: usize,
    factor: usize,
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize)> {
    ensure!(factor > 0, "smart_resize: factor must be > 0");
    // HF 4.57 has no "smaller than factor" check (tiny images are upscaled to min_pixels);
    // a zero side would be a ZeroDivisionError there, so it is our only size error.
    if height == 0 || width == 0 {
        bail!("smart_resize: image is empty ({height}x{width})");
    }
    let (h, w, f) = (height as f64, width as f64, factor as f64);
    // Float ratio, as HF computes it (a ratio of exactly 200 is allowed).
    let ratio = h.max(w) / h.min(w);
    if ratio > 200.0 {
        bail!("smart_resize: absolute aspect ratio must be at most 200, got {height}x{width} ({ratio:.2})");
    }
    let mut h_bar = py_round(h / f) * f;
    let mut w_bar = py_round(w / f) * f;
    if h_bar * w_bar > max_pixels as f64 {
        let beta = ((h * w) / max_pixels as f64).sqrt();
        // Newer HF clamps to at least one factor so extreme ratios cannot produce a zero side.
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    // Only reachable with min_pixels == 0 and a side rounding to 0; HF would crash later.
    ensure!(
        h_bar >= f && w_bar >= f,
        "smart_resize: {height}x{width} maps to an empty {h_bar}x{w_bar} grid (min_pixels={min_pixels})"
    );
    Ok((h_bar as usize, w_bar as usize))
}

/// Flattened patches for one image or video, ready for the vision tower.
#[derive(Clone, Debug)]
pub struct Patches {
    /// Row-major `[t*h*w, C*T*P*P]` in HF's flatten order.
    pub data: Vec<f32>,
    pub grid_thw: [usize; 3],
    pub patch_dim: usize,
}

impl Patches {
    pub fn num_patches(&self) -> usize {
        self.grid_thw.iter().product()
    }

    /// LLM placeholder tokens: `merge x merge` patches fold into one token.
    pub fn num_merged_tokens(&self, merge: usize) -> usize {
        self.num_patches() / (merge * merge).max(1)
    }

    /// `[num_patches, patch_dim]` f32 tensor on `device`.
    pub fn to_tensor(&self, device: &Device) -> Result<Tensor> {
        Tensor::from_slice(&self.data, (self.num_patches(), self.patch_dim), device)
            .context("building pixel_values tensor from patches")
    }
}

/// How HF turns uint8 into normalised f32; the two processors round differently (≤2e-7 apart).
#[derive(Clone, Copy, PartialEq)]
enum Norm {
    /// Slow image processor: `rescale` (float64 multiply, cast to float32), then `normalize`
    /// (`(x - mean) / std` in float32).
    Image,
    /// Torch video processor: rescale fused into normalisation, `(x - mean*255) / (std*255)` with
    /// the scaled mean/std computed in float32.
    VideoFused,
}

/// uint8 HWC frame → normalised f32 CHW, rounding exactly as the chosen HF path does.
fn normalize_chw(img: &RgbImage, cfg: &PreprocessorConfig, norm: Norm) -> Vec<f32> {
    let (w, h) = (img.width() as usize, img.height() as usize);
    let plane = w * h;
    let mut out = vec![0f32; 3 * plane];
    // Per-value lookup: at most 256 inputs per channel, so precompute them.
    let mut lut = [[0f32; 256]; 3];
    let fused = norm == Norm::VideoFused && cfg.do_rescale && cfg.do_normalize;
    let inv_scale = (1.0 / cfg.rescale_factor) as f32;
    for (c, table) in lut.iter_mut().enumerate() {
        for (v, slot) in table.iter_mut().enumerate() {
            *slot = if fused {
                let (m, s) = (cfg.image_mean[c] * inv_scale, cfg.image_std[c] * inv_scale);
                (v as f32 - m) / s
            } else {
                let mut x =
                    if cfg.do_rescale { (v as f64 * cfg.rescale_factor) as f32 } else { v as f32 };
                if cfg.do_normalize {
                    x = (x - cfg.image_mean[c]) / cfg.image_std[c];
                }
                x
            };
        }
    }
    for (i, px) in img.as_raw().chunks_exact(3).enumerate() {
        for c in 0..3 {
            out[c * plane + i] = lut[c][px[c] as usize];
        }
    }
    out
}

/// uint8 image → normalised f32 CHW as the slow image processors do it (rescale in f64, cast,
/// normalise in f32).
pub(crate) fn normalize_image(img: &RgbImage, cfg: &PreprocessorConfig) -> Vec<f32> {
    normalize_chw(img, cfg, Norm::Image)
}

/// Resize (if configured) one frame to `(height, width)` with the configured filter.
fn resize_frame(img: &RgbImage, height: usize, width: usize, cfg: &PreprocessorConfig) -> Result<RgbImage> {
    let filter = Filter::from_pil(cfg.resample).context("unsupported resample filter")?;
    resize(img, width, height, filter)
}

/// Target size for frames of `height x width` under `cfg`.
fn target_size(height: usize, width: usize, cfg: &PreprocessorConfig) -> Result<(usize, usize)> {
    if !cfg.do_resize {
        let f = cfg.factor();
        ensure!(
            height.is_multiple_of(f) && width.is_multiple_of(f),
            "do_resize=false but image {height}x{width} is not a multiple of patch_size*merge_size={f}"
        );
        return Ok((height, width));
    }
    smart_resize(height, width, cfg.factor(), cfg.min_pixels, cfg.max_pixels)
}

/// Qwen3-VL's video `smart_resize`: the budget covers the whole clip (frames rounded to
/// the temporal patch), and the scale factor counts the real frames.
pub fn smart_resize_video(frames: usize, height: usize, width: usize, temporal: usize, factor: usize, min_pixels: usize, max_pixels: usize) -> Result<(usize, usize)> {
    ensure!(factor > 0 && temporal > 0, "smart_resize: factor must be > 0");
    ensure!(height >= factor && width >= factor, "video frames {height}x{width} are smaller than {factor} pixels on a side");
    let (n, h, w, f) = (frames as f64, height as f64, width as f64, factor as f64);
    let ratio = h.max(w) / h.min(w);
    ensure!(ratio <= 200.0, "smart_resize: absolute aspect ratio must be at most 200, got {height}x{width}");
    let mut h_bar = py_round(h / f) * f;
    let mut w_bar = py_round(w / f) * f;
    let t_bar = py_round(n / temporal as f64) * temporal as f64;
    if t_bar * h_bar * w_bar > max_pixels as f64 {
        let beta = ((n * h * w) / max_pixels as f64).sqrt();
        h_bar = f.max((h / beta / f).floor() * f);
        w_bar = f.max((w / beta / f).floor() * f);
    } else if t_bar * h_bar * w_bar < min_pixels as f64 {
        let beta = (min_pixels as f64 / (n * h * w)).sqrt();
        h_bar = (h * beta / f).ceil() * f;
        w_bar = (w * beta / f).ceil() * f;
    }
    Ok((h_bar as usize, w_bar as usize))
}

/// Patchify normalised CHW frames (count a multiple of T) into HF's order: reshape to
/// `(gt, T, C, gh/m, m, P, gw/m, m, P)` and permute to `(gt, gh/m, gw/m, m, m, C, T, P, P)`.
fn patchify(frames: &[Vec<f32>], height: usize, width: usize, cfg: &PreprocessorConfig) -> Patches {
    let (p, m, tp) = (cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size);
    let (gt, gh, gw) = (frames.len() / tp, height / p, width / p);
    let channels = 3;
    let patch_dim = channels * tp * p * p;
    let plane = height * width;
    let mut data = Vec::with_capacity(gt * gh * gw * patch_dim);
    for t0 in 0..gt {
        for bh in 0..gh / m {
            for bw in 0..gw / m {
                for mh in 0..m {
                    for mw in 0..m {
                        let y0 = (bh * m + mh) * p;
                        let x0 = (bw * m + mw) * p;
                        for c in 0..channels {
                            for t in 0..tp {
                                let frame = &frames[t0 * tp + t];
                                for py in 0..p {
                                    let start = c * plane + (y0 + py) * width + x0;
                                    data.extend_from_slice(&frame[start..start + p]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    Patches { data, grid_thw: [gt, gh, gw], patch_dim }
}

/// Shared path for images (one frame repeated T times) and videos.
fn preprocess_frames(
    frames: &[&RgbImage],
    cfg: &PreprocessorConfig,
    norm: Norm,
    what: &str,
) -> Result<Patches> {
    cfg.validate().context("invalid preprocessor config")?;
    let first = frames.first().with_context(|| format!("{what}: no frames given"))?;
    let (w, h) = (first.width() as usize, first.height() as usize);
    ensure!(w > 0 && h > 0, "{what}: frame is empty ({w}x{h})");
    for (i, f) in frames.iter().enumerate() {
        ensure!(
            f.width() as usize == w && f.height() as usize == h,
            "{what}: frame {i} is {}x{} but frame 0 is {w}x{h}; all frames must match",
            f.width(),
            f.height()
        );
    }
    let sized = match (cfg.video_budget, frames.len() > 1 && cfg.do_resize) {
        (Some((lo, hi)), true) => smart_resize_video(frames.len(), h, w, cfg.temporal_patch_size, cfg.factor(), lo, hi),
        _ => target_size(h, w, cfg),
    };
    let (rh, rw) = sized.with_context(|| format!("{what}: sizing {w}x{h}"))?;
    // Every frame is resized and normalised independently, like HF's per-image loop.
    let normalized = frames
        .iter()
        .map(|f| -> Result<Vec<f32>> {
            let resized = resize_frame(f, rh, rw, cfg)?;
            Ok(normalize_chw(&resized, cfg, norm))
        })
        .collect::<Result<Vec<_>>>()
        .with_context(|| format!("{what}: resizing {w}x{h} to {rw}x{rh}"))?;
    let tp = cfg.temporal_patch_size;
    let mut padded: Vec<Vec<f32>> = normalized;
    if padded.len() == 1 {
        // A still image is repeated along time to fill one temporal patch.
        let only = padded[0].clone();
        padded.resize(tp, only);
    } else {
        // Videos: repeat the last frame up to a multiple of T (HF pads the same way).
        let rem = padded.len() % tp;
        if rem != 0 {
            let last = padded.last().cloned().expect("non-empty");
            padded.extend(std::iter::repeat_n(last, tp - rem));
        }
    }
    Ok(patchify(&padded, rh, rw, cfg))
}

/// Preprocess one RGB image into patches with `grid_thw = [1, h/P, w/P]` (LLaVA-NeXT:
/// `[tiles, side, side]`, see `anyres::preprocess`).
pub fn preprocess_image(img: &RgbImage, cfg: &PreprocessorConfig) -> Result<Patches> {
    if let Some(any) = &cfg.anyres {
        cfg.validate().context("invalid preprocessor config")?;
        return super::anyres::preprocess(img, cfg, any);
    }
    if let Some([h, w]) = cfg.fixed_size {
        return preprocess_fixed(img, cfg, [h, w]);
    }
    preprocess_frames(&[img], cfg, Norm::Image, "image")
}

/// A SigLIP-style image: resized to `[h, w]` whatever its aspect (`do_resize`), normalised, cut
/// into row-major patches of `[C·P·P]` values (channel-major inside a patch), grid `[1, h/P, w/P]`;
/// with pan-and-scan, the image then its crops, grid `[1 + crops, h/P, w/P]`.
fn preprocess_fixed(img: &RgbImage, cfg: &PreprocessorConfig, [h, w]: [usize; 2]) -> Result<Patches> {
    cfg.validate().context("invalid preprocessor config")?;
    let (iw, ih) = (img.width() as usize, img.height() as usize);
    ensure!(iw > 0 && ih > 0, "image is empty ({iw}x{ih})");
    let p = cfg.patch_size;
    ensure!(h.is_multiple_of(p) && w.is_multiple_of(p), "the preprocessor's size {h}x{w} is not a multiple of the model's patch size {p}");
    let crops = cfg.pan_and_scan.as_ref().map(|ps| ps.cut(img)).unwrap_or_default();
    let mut data = Vec::with_capacity(3 * h * w * (1 + crops.len()));
    for part in std::iter::once(img).chain(&crops) {
        let (pw, ph) = (part.width() as usize, part.height() as usize);
        let resized = match cfg.do_resize {
            true => resize_frame(part, h, w, cfg).with_context(|| format!("image: resizing {pw}x{ph} to {w}x{h}"))?,
            false => {
                ensure!([ph, pw] == [h, w], "do_resize=false but the image is {pw}x{ph}, not the configured {w}x{h}");
                part.clone()
            }
        };
        let chw = normalize_chw(&resized, cfg, Norm::Image);
        for by in 0..h / p {
            for bx in 0..w / p {
                for c in 0..3 {
                    for y in by * p..(by + 1) * p {
                        let start = c * h * w + y * w + bx * p;
                        data.extend_from_slice(&chw[start..start + p]);
                    }
                }
            }
        }
    }
    Ok(Patches { data, grid_thw: [1 + crops.len(), h / p, w / p], patch_dim: 3 * p * p })
}

/// Preprocess video frames (all the same size) into patches with `grid_t = ceil(n / T)`.
/// Normalisation rounds like HF's torch `Qwen2VLVideoProcessor`; resizing, when the frame size
/// needs it, is PIL bicubic (HF's video processor uses torchvision there, ±1-2 LSB apart).
pub fn preprocess_video(frames: &[RgbImage], cfg: &PreprocessorConfig) -> Result<Patches> {
    ensure!(!frames.is_empty(), "video: no frames given");
    let refs: Vec<&RgbImage> = frames.iter().collect();
    // A one-frame video still goes through the video padding rule (repeat to T), which is the
    // same result as the image rule.
    preprocess_frames(&refs, cfg, Norm::VideoFused, "video")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values from transformers 4.57.1 `video_processing_qwen3_vl.smart_resize`.
    #[test]
    fn video_smart_resize_equals_qwen3_vl() {
        for ((n, h, w, t, f, lo, hi), want) in [
            ((4, 56, 84, 2, 32, 4096, 65536), (64, 96)),
            ((16, 720, 1280, 2, 32, 131072, 786432), (160, 288)),
            ((3, 500, 300, 2, 32, 4096, 65536), (160, 96)),
            ((8, 100, 2000, 2, 32, 65536, 100663296), (96, 1984)),
        ] {
            assert_eq!(smart_resize_video(n, h, w, t, f, lo, hi).unwrap(), want, "{n} frames {h}x{w}");
        }
        assert!(smart_resize_video(4, 20, 84, 2, 32, 4096, 65536).unwrap_err().to_string().contains("smaller than 32"));
    }
}
