//! 3-D position ids for M-RoPE, equal to transformers' `get_rope_index` (Qwen2-VL,
//! Qwen2.5-VL, Qwen3-VL). Text advances all three components together; an image/video
//! placeholder run gets (t, h, w) grid coordinates offset by the text before it; text after a
//! vision block resumes at `max + 1`. The families differ only in a video's time axis.

use anyhow::{bail, Result};

use super::{MediaGrid, Positions};

/// How a video's temporal steps become the t component.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum VideoTime {
    /// Qwen2-VL: the step index.
    Index,
    /// Qwen2.5-VL: step × whole seconds per step × tokens per second.
    Scaled { tokens_per_second: f64 },
    /// Qwen3-VL: every step is its own run (its time is text in the prompt), so t is 0.
    PerStep,
}

/// How a family numbers prompt positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PositionScheme {
    /// 3-D M-RoPE positions (`mrope_index`): the Qwen families.
    MRope,
    /// One running index for every token, media included (LLaMA-style 1-D RoPE: LLaVA-NeXT);
    /// all three components equal and no rope delta.
    Sequential,
}

/// Positions `0..len` in all three components, and a delta of 0.
pub fn sequential_index(len: usize) -> (Positions, i64) {
    let v: Vec<i64> = (0..len as i64).collect();
    ([v.clone(), v.clone(), v], 0)
}

#[derive(Clone, Copy, Debug)]
pub struct RopeParams {
    pub merge: usize,
    pub image_token: u32,
    pub video_token: u32,
    pub video_time: VideoTime,
}

/// Position ids `[3][L]` and the rope delta (`max position + 1 - L`) that continues decoding.
pub fn mrope_index(ids: &[u32], media: &[MediaGrid], p: &RopeParams) -> Result<(Positions, i64)> {
    // Qwen3-VL: a video of t steps is t one-step items, each its own placeholder run.
    let split: Vec<MediaGrid>;
    let media = match p.video_time {
        VideoTime::PerStep => {
            split = media
                .iter()
                .flat_map(|m| {
                    let n = if m.is_video { m.thw[0] } else { 1 };
                    let thw = if m.is_video { [1, m.thw[1], m.thw[2]] } else { m.thw };
                    std::iter::repeat_n(MediaGrid { thw, ..m.clone() }, n)
                })
                .collect();
            &split[..]
        }
        _ => media,
    };
    let (merge, image_token, video_token) = (p.merge, p.image_token, p.video_token);
    let mut pos: [Vec<i64>; 3] = [Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len())];
    let mut images = media.iter().filter(|m| !m.is_video);
    let mut videos = media.iter().filter(|m| m.is_video);
    let mut next: i64 = 0; // first position of the next text run
    let mut i = 0;
    while i < ids.len() {
        let tok = ids[i];
        if tok != image_token && tok != video_token {
            for p in pos.iter_mut() {
                p.push(next);
            }
            next += 1;
            i += 1;
            continue;
        }
        let is_video = tok == video_token;
        let m = if is_video { videos.next() } else { images.next() };
        let Some(m) = m else {
            bail!("prompt has more {} placeholders than {} given", if is_video { "video" } else { "image" }, if is_video { "videos" } else { "images" });
        };
        let (gt, gh, gw) = (m.thw[0], m.thw[1] / merge, m.thw[2] / merge);
        let n = gt * gh * gw;
        if i + n > ids.len() || ids[i..i + n].iter().any(|&x| x != tok) {
            bail!("placeholder run at token {i} is shorter than the {n} tokens its grid {:?} needs", m.thw);
        }
        let mut max = next - 1;
        for t in 0..gt {
            let tv = match p.video_time {
                // Qwen2.5-VL scales the temporal index by real time. transformers casts the
                // seconds per grid to an integer tensor before multiplying (so 0.5 s → 0); we
                // match it exactly. Images have one step: t = 0 either way.
                VideoTime::Scaled { tokens_per_second } if is_video => {
                    ((t as i64 * m.second_per_grid.trunc() as i64) as f64 * tokens_per_second) as i64
                }
                _ => t as i64,
            };
            for h in 0..gh {
                for w in 0..gw {
                    let p = [tv + next, h as i64 + next, w as i64 + next];
                    for c in 0..3 {
                        pos[c].push(p[c]);
                        max = max.max(p[c]);
                    }
                }
            }
        }
        next = max + 1;
        i += n;
    }
    if images.next().is_some() || videos.next().is_some() {
        bail!("more images/videos given than placeholders in the prompt");
    }
    let delta = next - ids.len() as i64;
    Ok((pos, delta))
}
