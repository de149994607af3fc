//! From a rendered Qwen2.5-Omni prompt to the model's placeholder runs, as transformers'
//! `Qwen2_5OmniProcessor.replace_multimodal_special_tokens` does in text: each `<|AUDIO|>` becomes
//! one token per audio feature row, each `<|IMAGE|>` / `<|VIDEO|>` one per merged patch, and with
//! the video's own audio track (`use_audio_in_video`) `<|vision_bos|><|VIDEO|><|vision_eos|>`
//! becomes the video and audio tokens interleaved in time chunks between the audio markers.
//! Working on ids is the same as on text: the placeholders are special tokens, never merged.

use anyhow::{bail, Result};

use super::Config;
use crate::models::position::interleaved_tokens;
use crate::models::{AudioSpec, MediaGrid};

/// Media of one prompt in the order of their placeholders: images and videos (`media`) and the
/// mel frames of each audio clip (`audio_frames`; with `audio_in_video`, each video's track
/// takes the next clip where its video appears).
pub struct PromptMedia<'a> {
    pub media: &'a [MediaGrid],
    pub audio_frames: &'a [usize],
    pub audio_in_video: bool,
}

/// `ids` with every single placeholder expanded to its run; an error when the prompt's
/// placeholders and the media do not pair up.
pub fn expand_placeholders(ids: &[u32], m: &PromptMedia, cfg: &Config) -> Result<Vec<u32>> {
    let (special, merge) = (&cfg.vl.special, cfg.vl.vision.spatial_merge_size);
    let mut images = m.media.iter().filter(|g| !g.is_video);
    let mut videos = m.media.iter().filter(|g| g.is_video);
    let mut audios = m.audio_frames.iter();
    let mut out = Vec::with_capacity(ids.len());
    for (i, &t) in ids.iter().enumerate() {
        let grid_tokens = |g: &MediaGrid| g.thw[0] * (g.thw[1] / merge) * (g.thw[2] / merge);
        if t == cfg.audio_token {
            let Some(&f) = audios.next() else { bail!("the prompt has more audio placeholders than audio clips") };
            out.extend(std::iter::repeat_n(t, AudioSpec::tokens(f)));
        } else if t == special.image {
            let Some(g) = images.next() else { bail!("the prompt has more image placeholders than images") };
            out.extend(std::iter::repeat_n(t, grid_tokens(g)));
        } else if t == special.video {
            let Some(g) = videos.next() else { bail!("the prompt has more video placeholders than videos") };
            if !m.audio_in_video {
                out.extend(std::iter::repeat_n(t, grid_tokens(g)));
                continue;
            }
            if out.last() != Some(&special.vision_start) || ids.get(i + 1) != Some(&special.vision_end) {
                bail!("the video placeholder at token {i} is not between the vision start and end markers");
            }
            let Some(&f) = audios.next() else { bail!("a video with its audio track but no audio clip left for it") };
            out.push(cfg.audio_start);
            out.extend(interleaved_tokens(g, merge, AudioSpec::tokens(f), special.video, &cfg.tmrope()));
            out.push(cfg.audio_end);
        } else {
            out.push(t);
        }
    }
    if images.next().is_some() || videos.next().is_some() || audios.next().is_some() {
        bail!("more media than placeholders in the prompt");
    }
    Ok(out)
}
