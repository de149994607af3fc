//! HF-equal image/video preprocessing for every family's processor.
//!
//! - `resize`: bit-exact Pillow 8-bit bicubic and bilinear resampling (HF resizes through PIL).
//! - `preprocess`: config, `smart_resize`, rescale/normalise and patchify into `Patches`
//!   (Qwen's merge blocks, or SigLIP's fixed square in row-major patches).
//! - `anyres`: LLaVA-NeXT's any-resolution tiles and the unpadding geometry.
//! - `pan_scan`: Gemma 3's pan-and-scan crops.
//! - `media`: image decoding and video frame sampling (ffmpeg, behind the `video` feature).

pub mod anyres;
pub mod media;
pub mod pan_scan;
pub mod preprocess;
pub mod resize;

pub use media::{decode_image, load_image, load_media, sample_indices, Media, VideoFrames};
#[cfg(feature = "video")]
pub use media::{load_frames_at, load_video_frames, load_video_frames_with_factor};
pub use preprocess::{
    preprocess_image, preprocess_video, smart_resize, Patches, PreprocessorConfig,
};
pub use resize::resize_bicubic;
