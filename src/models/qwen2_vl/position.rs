//! 3-D position ids for M-RoPE, equal to transformers' `get_rope_index` (Qwen2-VL and
//! Qwen2.5-VL). Text advances all three components together; an image/video placeholder run
//! gets (t, h, w) grid coordinates offset by the text before it; text after a vision block
//! resumes at `max + 1`.

use anyhow::{bail, Result};

use super::config::{Config, Variant};
use crate::models::{MediaGrid, Positions};

/// Position ids `[3][L]` and the rope delta (`max position + 1 - L`) that continues decoding.
pub fn rope_index(ids: &[u32], media: &[MediaGrid], cfg: &Config) -> Result<(Positions, i64)> {
    let merge = cfg.vision.spatial_merge_size;
    let mut pos: [Vec<i64>; 3] = [Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len()), Vec::with_capacity(ids.len())];
    let mut images = media.iter().filter(|m| !m.is_video);
    let mut videos = media.iter().filter(|m| m.is_video);
    let mut next: i64 = 0; // first position of the next text run
    let mut i = 0;
    while i < ids.len() {
        let tok = ids[i];
        if tok != cfg.image_token_id && tok != cfg.video_token_id {
            for p in pos.iter_mut() {
                p.push(next);
            }
            next += 1;
            i += 1;
            continue;
        }
        let is_video = tok == cfg.video_token_id;
        let m = if is_video { videos.next() } else { images.next() };
        let Some(m) = m else {
            bail!("prompt has more {} placeholders than {} given", if is_video { "video" } else { "image" }, if is_video { "videos" } else { "images" });
        };
        let (gt, gh, gw) = (m.thw[0], m.thw[1] / merge, m.thw[2] / merge);
        let n = gt * gh * gw;
        if i + n > ids.len() || ids[i..i + n].iter().any(|&x| x != tok) {
            bail!("placeholder run at token {i} is shorter than the {n} tokens its grid {:?} needs", m.thw);
        }
        // Qwen2.5-VL scales the temporal index by real time. transformers casts the seconds per
        // grid to an integer tensor before multiplying (so 0.5 s → 0); we match it exactly.
        let t_scale: i64 = match (cfg.variant, is_video) {
            (Variant::Qwen25Vl, true) => m.second_per_grid.trunc() as i64,
            (Variant::Qwen25Vl, false) => 0,
            (Variant::Qwen2Vl, _) => 1,
        };
        let tps = cfg.vision.tokens_per_second;
        let mut max = next - 1;
        for t in 0..gt {
            let tv = match cfg.variant {
                Variant::Qwen2Vl => t as i64,
                Variant::Qwen25Vl => ((t as i64 * t_scale) as f64 * tps) as i64,
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
