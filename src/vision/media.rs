//! Loading images and sampling video frames from disk. Every error names the file involved.

use std::path::Path;

use anyhow::{bail, ensure, Context, Result};
use image::RgbImage;

/// Media for one request, in the order their placeholders appear in the messages.
#[derive(Clone, Debug)]
pub enum Media {
    Image(RgbImage),
    /// Frames sampled at `fps` frames per second.
    Video { frames: Vec<RgbImage>, fps: f64 },
    /// An audio clip, 16 kHz mono (for models with an audio encoder).
    Audio(crate::audio::Pcm),
}

impl Media {
    /// (frames, height, width): what the placeholder token count depends on.
    pub fn dims(&self) -> (usize, usize, usize) {
        match self {
            Media::Image(i) => (1, i.height() as usize, i.width() as usize),
            Media::Video { frames, .. } => {
                let (h, w) = frames.first().map(|f| (f.height() as usize, f.width() as usize)).unwrap_or((0, 0));
                (frames.len(), h, w)
            }
            Media::Audio(_) => (0, 0, 0),
        }
    }

    pub fn is_audio(&self) -> bool {
        matches!(self, Media::Audio(_))
    }
}

/// Loads media files: images, then optionally a video sampled at `fps`.
pub fn load_media(images: &[std::path::PathBuf], video: Option<&std::path::PathBuf>, fps: f64, max_frames: usize) -> Result<Vec<Media>> {
    let mut out: Vec<Media> = images.iter().map(|p| load_image(p).map(Media::Image)).collect::<Result<_>>()?;
    if let Some(v) = video {
        out.push(load_video(v, fps, max_frames)?);
    }
    Ok(out)
}

#[cfg(feature = "video")]
fn load_video(path: &Path, fps: f64, max_frames: usize) -> Result<Media> {
    let v = load_video_frames(path, fps as f32, max_frames)?;
    Ok(Media::Video { frames: v.frames, fps: v.fps as f64 })
}

#[cfg(not(feature = "video"))]
fn load_video(path: &Path, _fps: f64, _max_frames: usize) -> Result<Media> {
    bail!("{}: this merg was built without the `video` feature; pass keyframes as images", path.display())
}

/// Pixels of the largest image file merg decodes (16384 × 16384, about 0.8 GB as RGB).
pub const MAX_IMAGE_PIXELS: u64 = 16384 * 16384;

/// Decode an image file (png/jpeg/webp/bmp) into 8-bit RGB, like HF's `convert_to_rgb`.
pub fn load_image(path: &Path) -> Result<RgbImage> {
    let bytes = crate::input::read(path, &crate::input::IMAGE)?;
    decode_image(&bytes, &format!("image {}", path.display()), MAX_IMAGE_PIXELS)
}

/// Decodes image bytes (`what` names them in errors). The header is read first, so an image
/// over `max_pixels` is refused before a single pixel is allocated.
pub fn decode_image(bytes: &[u8], what: &str, max_pixels: u64) -> Result<RgbImage> {
    // Sniff the format from content, so a misnamed file still decodes (PIL does the same).
    let reader = || image::ImageReader::new(std::io::Cursor::new(bytes)).with_guessed_format().with_context(|| format!("reading {what}"));
    let (w, h) = reader()?.into_dimensions().with_context(|| format!("{what}: not a readable image"))?;
    let pixels = w as u64 * h as u64;
    ensure!(pixels > 0, "{what} is empty ({w}×{h})");
    ensure!(pixels <= max_pixels, "{what} is {w}×{h} = {pixels} pixels; the limit is {max_pixels} pixels");
    let mut r = reader()?;
    let mut lim = image::Limits::default();
    lim.max_image_width = Some(w);
    lim.max_image_height = Some(h);
    lim.max_alloc = Some(pixels * 16 + (1 << 20));
    r.limits(lim);
    let img = r.decode().with_context(|| format!("decoding {what}"))?;
    // NOTE: PIL's RGBA→RGB conversion drops alpha without compositing; `to_rgb8` does the same.
    Ok(img.to_rgb8())
}

/// Frames sampled from a video plus the timing the model needs.
#[derive(Clone, Debug)]
pub struct VideoFrames {
    pub frames: Vec<RgbImage>,
    /// Frames per second actually sampled: `frames.len() / duration`. Qwen2.5-VL's
    /// `second_per_grid_ts` is `temporal_patch_size / fps`.
    pub fps: f32,
    /// Native frame rate reported by the container.
    pub source_fps: f32,
    /// Frames decoded from the stream.
    pub total_frames: usize,
    /// Source index of each sampled frame.
    pub indices: Vec<usize>,
}

/// Which source frames to keep, following HF `Qwen2VLVideoProcessor.sample_frames` with
/// `min_frames = frame_factor`: `n = total / source_fps * fps` clamped to
/// `[frame_factor, min(max_frames, total)]`, floored to a multiple of `frame_factor`, then indices
/// `arange(0, total, total / n)` truncated to int.
pub fn sample_indices(
    total: usize,
    source_fps: f64,
    fps: f64,
    frame_factor: usize,
    max_frames: usize,
) -> Result<Vec<usize>> {
    ensure!(frame_factor > 0, "frame_factor must be > 0");
    crate::setting::check(fps > 0.0 && fps.is_finite(), "fps", fps, "a positive number of frames per second")?;
    ensure!(source_fps > 0.0 && source_fps.is_finite(), "video frame rate is unknown ({source_fps})");
    ensure!(
        total >= frame_factor,
        "video has {total} frames, fewer than the {frame_factor} needed for one temporal patch"
    );
    let cap = (max_frames.min(total) / frame_factor) * frame_factor;
    // total ≥ frame_factor here, so only a small max_frames leaves less than one patch.
    if max_frames < frame_factor {
        let rule = format!("at least {frame_factor}, the frames of one temporal patch");
        return Err(crate::setting::InvalidSetting::new("max_frames", max_frames, rule).into());
    }
    let wanted = total as f64 / source_fps * fps;
    let n = wanted.max(frame_factor as f64).min(cap as f64);
    let n = ((n / frame_factor as f64).floor() as usize) * frame_factor;
    let step = total as f64 / n as f64;
    // torch.arange(0, total, step) in float32, then `.int()` (truncation).
    let count = (total as f64 / step).ceil() as usize;
    Ok((0..count).map(|i| ((i as f64 * step) as f32) as usize).filter(|&i| i < total).collect())
}

#[cfg(feature = "video")]
mod decode {
    use super::*;
    use video_rs::ffmpeg;

    /// Initialise ffmpeg once; repeated init is harmless but wasteful.
    fn init() -> Result<()> {
        static INIT: std::sync::OnceLock<std::result::Result<(), String>> = std::sync::OnceLock::new();
        INIT.get_or_init(|| video_rs::init().map_err(|e| e.to_string()))
            .clone()
            .map_err(|e| anyhow::anyhow!("initialising ffmpeg: {e}"))
    }

    /// Copy an RGB24 ffmpeg frame (rows may be padded to `stride`) into an `RgbImage`.
    fn to_rgb(frame: &ffmpeg::util::frame::Video) -> Result<RgbImage> {
        let (w, h) = (frame.width() as usize, frame.height() as usize);
        ensure!(
            frame.format() == ffmpeg::format::Pixel::RGB24,
            "decoder produced {:?}, expected RGB24",
            frame.format()
        );
        let stride = frame.stride(0);
        let data = frame.data(0);
        ensure!(w > 0 && h > 0 && stride >= w * 3, "decoded frame is malformed ({w}x{h})");
        ensure!(data.len() >= (h - 1) * stride + w * 3, "decoded frame buffer is short");
        let mut buf = Vec::with_capacity(w * h * 3);
        for y in 0..h {
            buf.extend_from_slice(&data[y * stride..y * stride + w * 3]);
        }
        RgbImage::from_raw(w as u32, h as u32, buf).context("decoded frame has wrong length")
    }

    /// Decode frames in order, handing each index (and the stream's frame rate) to `keep`:
    /// `Some(true)` stores it, `Some(false)` skips it, `None` stops decoding. Returns the number
    /// of frames decoded, the kept frames and the frame rate.
    fn decode_until(
        path: &Path,
        mut keep: impl FnMut(usize, f32) -> Option<bool>,
    ) -> Result<(usize, Vec<RgbImage>, f32)> {
        // ffmpeg would block forever on a FIFO and read a device without end.
        crate::input::regular_file(path, &crate::input::VIDEO)?;
        let mut decoder = video_rs::Decoder::new(path)
            .with_context(|| format!("opening video {}", path.display()))?;
        let source_fps = decoder.frame_rate();
        let mut kept = Vec::new();
        let mut n = 0usize;
        loop {
            match decoder.decode_raw() {
                Ok(frame) => {
                    let Some(k) = keep(n, source_fps) else { break };
                    if k {
                        kept.push(
                            to_rgb(&frame)
                                .with_context(|| format!("frame {n} of video {}", path.display()))?,
                        );
                    }
                    n += 1;
                }
                // End of stream surfaces as either variant depending on the drain path.
                Err(video_rs::Error::DecodeExhausted | video_rs::Error::ReadExhausted) => break,
                Err(e) => {
                    return Err(e)
                        .with_context(|| format!("decoding frame {n} of video {}", path.display()))
                }
            }
        }
        Ok((n, kept, source_fps))
    }

    fn decode_all(path: &Path, mut keep: impl FnMut(usize) -> bool) -> Result<(usize, Vec<RgbImage>, f32)> {
        decode_until(path, |i, _| Some(keep(i)))
    }

    /// The frame shown at each of `times` (seconds, ascending), in one pass that stops after
    /// the last one: frame i covers [i / fps, (i + 1) / fps). Times past the end are dropped.
    pub fn load_frames_at(path: &Path, times: &[f64]) -> Result<Vec<(f64, RgbImage)>> {
        ensure!(path.exists(), "video file {} does not exist", path.display());
        ensure!(times.windows(2).all(|w| w[0] <= w[1]), "frame times must be ascending");
        init()?;
        // Frame index of each time, known once the stream's frame rate is.
        let mut wanted: Option<Vec<usize>> = None;
        let (_, frames, fps) = decode_until(path, |i, fps| {
            let w = wanted.get_or_insert_with(|| times.iter().map(|t| (t.max(0.0) * fps as f64).floor() as usize).collect());
            let last = *w.last()?;
            (i <= last).then(|| w.contains(&i))
        })?;
        ensure!(fps > 0.0 && fps.is_finite(), "video {} has no usable frame rate ({fps})", path.display());
        let idx = wanted.unwrap_or_default();
        let mut uniq = idx.clone();
        uniq.dedup();
        // `frames` holds one image per distinct wanted index that exists, in order.
        let mut out = vec![];
        for (t, i) in times.iter().zip(&idx) {
            if let Some(k) = uniq.iter().position(|u| u == i) {
                if let Some(f) = frames.get(k) {
                    out.push((*t, f.clone()));
                }
            }
        }
        Ok(out)
    }

    /// Decode `path`, sample frames uniformly at `fps` (at least `frame_factor`, at most
    /// `max_frames`, count a multiple of `frame_factor`) and report the effective sampling fps.
    pub fn load_video_frames_with_factor(
        path: &Path,
        fps: f32,
        max_frames: usize,
        frame_factor: usize,
    ) -> Result<VideoFrames> {
        ensure!(path.exists(), "video file {} does not exist", path.display());
        init()?;
        // Pass 1 counts frames: container frame counts are often missing or wrong, and keeping
        // every decoded frame of a long video in memory is not an option.
        let (total, _, source_fps) = decode_all(path, |_| false)?;
        if total == 0 {
            bail!("video {} contains no decodable frames", path.display());
        }
        let indices = sample_indices(total, source_fps as f64, fps as f64, frame_factor, max_frames)
            .with_context(|| format!("sampling frames from video {}", path.display()))?;
        // Pass 2 keeps only the sampled frames (indices are sorted and unique).
        let mut want = indices.iter().copied().peekable();
        let (total2, frames, _) = decode_all(path, |i| {
            if want.peek() == Some(&i) {
                want.next();
                true
            } else {
                false
            }
        })?;
        ensure!(
            total2 == total && frames.len() == indices.len(),
            "video {} decoded inconsistently ({total} then {total2} frames)",
            path.display()
        );
        let duration = total as f64 / source_fps as f64;
        Ok(VideoFrames {
            fps: (frames.len() as f64 / duration) as f32,
            frames,
            source_fps,
            total_frames: total,
            indices,
        })
    }
}

#[cfg(feature = "video")]
pub use decode::{load_frames_at, load_video_frames_with_factor};

/// `load_video_frames_with_factor` with Qwen2-VL's temporal patch size of 2.
#[cfg(feature = "video")]
pub fn load_video_frames(path: &Path, fps: f32, max_frames: usize) -> Result<VideoFrames> {
    load_video_frames_with_factor(path, fps, max_frames, 2)
}
