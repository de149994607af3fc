//! Parity with HF transformers 4.57.1 on the tiny checkpoints (goldens made by
//! scripts/make_goldens.py): position ids identical, logits within 1e-4 relative error, and
//! 32-token greedy continuations identical, for text, one image, two images and a video.

mod common;

use candle_core::{DType, Device};
use common::*;
use merg::config::ModelConfig;
use merg::generate::{generate, SamplingParams};
use merg::models::position::rope_index;
use merg::models::{MediaGrid, QwenVl, VisionInput};

const CASES: [&str; 4] = ["text", "image", "two_images", "video"];

fn load(family: &str) -> QwenVl {
    let dir = tiny_dir(family);
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let index: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    let mut files: Vec<_> = index["weight_map"].as_object().unwrap().values().map(|v| dir.join(v.as_str().unwrap())).collect();
    files.sort();
    files.dedup();
    QwenVl::load(&cfg, &files, DType::F32, &Device::Cpu).unwrap()
}

fn vision_input(g: &std::collections::HashMap<String, candle_core::Tensor>) -> VisionInput {
    let mut media: Vec<MediaGrid> = grids(g.get("image_grid_thw"))
        .into_iter()
        .map(|thw| MediaGrid { thw, is_video: false, second_per_grid: 0.0 })
        .collect();
    let secs: Vec<f32> = g.get("second_per_grid_ts").map(|t| t.to_vec1().unwrap()).unwrap_or_default();
    for (i, thw) in grids(g.get("video_grid_thw")).into_iter().enumerate() {
        media.push(MediaGrid { thw, is_video: true, second_per_grid: secs.get(i).copied().unwrap_or(1.0) as f64 });
    }
    VisionInput { image_patches: g.get("pixel_values").cloned(), video_patches: g.get("pixel_values_videos").cloned(), media }
}

fn check_family(family: &str) {
    let model = load(family);
    for case in CASES {
        let (g, _meta) = golden(family, case);
        let ids: Vec<u32> = ids_i64(&g["input_ids"]).iter().map(|&x| x as u32).collect();
        let vis = vision_input(&g);

        let (pos, delta) = rope_index(&ids, &vis.media, &model.cfg).unwrap();
        let want = ids_i64(&g["position_ids"]);
        let got: Vec<i64> = pos.iter().flatten().copied().collect();
        assert_eq!(got, want, "{family}/{case}: position ids");
        assert_eq!(delta, ids_i64(&g["rope_deltas"])[0], "{family}/{case}: rope delta");

        let prefill = model.prepare(&ids, &vis).unwrap();
        let mut kv = merg::models::DenseKvCache::new();
        let logits = model.forward(&prefill.embeds, &prefill.positions, &mut kv, ids.len()).unwrap();
        let want = g["logits"].squeeze(0).unwrap();
        let err = max_rel_err(&logits, &want);
        println!("{family}/{case}: logits max rel err {err:.2e} over {} tokens", ids.len());
        assert!(err <= 1e-4, "{family}/{case}: logits max rel err {err}");

        let params = SamplingParams { max_new_tokens: 32, ..Default::default() };
        let out = generate(&model, &ids, &vis, &params, None).unwrap();
        let want: Vec<u32> = ids_i64(&g["greedy_ids"]).iter().map(|&x| x as u32).collect();
        assert_eq!(out.tokens, want, "{family}/{case}: greedy continuation");
    }
}

#[test]
fn qwen2_vl_matches_transformers() {
    check_family("qwen2_vl");
}

#[test]
fn qwen2_5_vl_matches_transformers() {
    check_family("qwen2_5_vl");
}
