//! HF-equal image/video preprocessing for Qwen2-VL / Qwen2.5-VL.
//!
//! - `resize`: bit-exact Pillow 8-bit bicubic resampling (HF resizes through PIL).
//! - `preprocess`: config, `smart_resize`, rescale/normalise and patchify into `Patches`.
//! - `anyres`: LLaVA-NeXT's any-resolution tiles and the unpadding geometry.
//! - `media`: image decoding and video frame sampling (ffmpeg, behind the `video` feature).

pub mod anyres;
pub mod media;
pub mod preprocess;
pub mod resize;

pub use media::{decode_image, load_image, load_media, sample_indices, Media, VideoFrames};
#[cfg(feature = "video")]
pub use media::{load_frames_at, load_video_frames, load_video_frames_with_factor};
pub use preprocess::{
    preprocess_image, preprocess_video, smart_resize, Patches, PreprocessorConfig,
};
pub use resize::resize_bicubic;
