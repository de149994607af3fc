//! Qwen2-VL / Qwen2.5-VL positions: the shared M-RoPE index with this family's video time.

use anyhow::Result;

use super::config::{Config, Variant};
use crate::models::position::{mrope_index, RopeParams, VideoTime};
use crate::models::{MediaGrid, Positions};

pub fn params(cfg: &Config) -> RopeParams {
    RopeParams {
        merge: cfg.vision.spatial_merge_size,
        image_token: cfg.special.image,
        video_token: cfg.special.video,
        video_time: match cfg.variant {
            Variant::Qwen2Vl => VideoTime::Index,
            Variant::Qwen25Vl => VideoTime::Scaled { tokens_per_second: cfg.vision.tokens_per_second },
        },
    }
}

/// Position ids `[3][L]` and the rope delta, equal to transformers' `get_rope_index`.
pub fn rope_index(ids: &[u32], media: &[MediaGrid], cfg: &Config) -> Result<(Positions, i64)> {
    mrope_index(ids, media, &params(cfg))
}
