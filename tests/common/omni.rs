//! Qwen2.5-Omni goldens as the thinker's inputs (tests/omni.rs, tests/gguf_omni.rs): the
//! processor's patches and grids, each clip's log-mel frames, and the prompt prepared with
//! both.

use std::collections::HashMap;

use candle_core::Tensor;
use merg::generate::{decode_inputs, forward_logits, VisionInput};
use merg::models::{DenseCache, MediaGrid, Model, PromptInputs};

pub fn vision_input(g: &HashMap<String, Tensor>) -> VisionInput {
    let mut media: Vec<MediaGrid> = super::grids(g.get("image_grid_thw")).into_iter().map(MediaGrid::image).collect();
    let secs: Vec<f32> = g.get("video_second_per_grid").map(|t| t.to_vec1().unwrap()).unwrap_or_default();
    for (i, thw) in super::grids(g.get("video_grid_thw")).into_iter().enumerate() {
        media.push(MediaGrid { thw, is_video: true, second_per_grid: secs[i] as f64, frames: 0, size: [0, 0], audio_frames: 0 });
    }
    VisionInput { image_patches: g.get("pixel_values").cloned(), video_patches: g.get("pixel_values_videos").cloned(), media }
}

/// Each clip's log-mel frames `[mels, frames]`: the processor's features cut to the frames its
/// attention mask marks valid (the goldens keep the longest clip's valid frames only).
pub fn clips(g: &HashMap<String, Tensor>) -> Vec<Tensor> {
    let (Some(features), Some(mask)) = (g.get("input_features"), g.get("feature_attention_mask")) else { return vec![] };
    mask.to_vec2::<i64>()
        .unwrap()
        .iter()
        .enumerate()
        .map(|(b, row)| {
            let frames = row.iter().sum::<i64>() as usize;
            assert!(row[..frames].iter().all(|&m| m == 1), "valid frames first");
            features.get(b).unwrap().narrow(1, 0, frames).unwrap()
        })
        .collect()
}

/// The golden's prompt prepared with its media's features, and the audio tower's features.
pub fn prepare(model: &dyn Model, ids: &[u32], g: &HashMap<String, Tensor>) -> anyhow::Result<(PromptInputs, Vec<Tensor>)> {
    let vis = vision_input(g);
    let feats = vis.items()?.iter().map(|(p, m)| model.encode_media(p, m)).collect::<anyhow::Result<Vec<_>>>()?;
    let audio = clips(g).iter().map(|c| model.encode_audio(c)).collect::<anyhow::Result<Vec<_>>>()?;
    Ok((model.prepare_prompt_with_audio(ids, &vis.media, &feats, &audio)?, audio))
}

/// Greedy continuation on a dense cache (the reference loop of `generate::generate`, with audio).
pub fn greedy(model: &dyn Model, prefill: &PromptInputs, len: usize, n: usize) -> Vec<u32> {
    let mut cache = DenseCache::new();
    let mut logits = forward_logits(model, prefill, &mut cache, 1).unwrap();
    let mut out = vec![];
    for step in 0..n {
        let tok = logits.squeeze(0).unwrap().argmax(0).unwrap().to_scalar::<u32>().unwrap();
        out.push(tok);
        if step + 1 < n {
            let inputs = decode_inputs(model, tok, len + step, prefill.rope_delta).unwrap();
            logits = forward_logits(model, &inputs, &mut cache, 1).unwrap();
        }
    }
    out
}

/// Next-token logits after the prompt and `forced` generated tokens (decoded one by one, as
/// generation feeds them: a generated placeholder id is plain text, not a media slot).
pub fn logits_after(model: &dyn Model, prefill: &PromptInputs, len: usize, forced: &[u32]) -> Vec<f32> {
    let mut cache = DenseCache::new();
    let mut logits = forward_logits(model, prefill, &mut cache, 1).unwrap();
    for (step, &tok) in forced.iter().enumerate() {
        let inputs = decode_inputs(model, tok, len + step, prefill.rope_delta).unwrap();
        logits = forward_logits(model, &inputs, &mut cache, 1).unwrap();
    }
    logits.squeeze(0).unwrap().to_vec1().unwrap()
}
