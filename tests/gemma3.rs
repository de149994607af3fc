//! Gemma 3 against transformers 4.57.1 on the tiny checkpoint (tests/fixtures/tiny-gemma3, goldens
//! by scripts/tiny_gemma3.py): positions identical, f32 logits within 1e-4 relative error, 32
//! greedy tokens identical, for text, one image, two images and a prompt far longer than the
//! sliding window (8 tokens) with an image inside; bf16 within the other families' tolerances.

mod common;

use std::sync::Arc;

use candle_core::{DType, Tensor};
use common::*;
use merg::generate::{forward_logits, generate, prepare, SamplingParams, VisionInput};
use merg::models::gemma3::vision::patches_of;
use merg::models::{DenseCache, MediaGrid, Model};
use merg::weights::Weights;

const CASES: [&str; 4] = ["text", "image", "two_images", "long"];
const PATCH: usize = 8;

fn load(dtype: DType) -> Arc<dyn Model> {
    let dir = fixtures().join("tiny-gemma3");
    let cfg = merg::models::registry::read_config(&dir.join("config.json")).unwrap();
    let files = vec![dir.join("model-00001-of-00002.safetensors"), dir.join("model-00002-of-00002.safetensors")];
    merg::models::load(&cfg, Weights::safetensors(&files, dtype, &test_device()).unwrap()).unwrap()
}

/// transformers' `pixel_values` `[images, 3, 48, 48]` as the tower's patch rows, one 6×6 grid each.
fn vision_input(g: &std::collections::HashMap<String, Tensor>) -> VisionInput {
    let Some(px) = g.get("pixel_values") else { return VisionInput::default() };
    let n = px.dim(0).unwrap();
    let patches: Vec<Tensor> = (0..n).map(|i| patches_of(&px.get(i).unwrap(), PATCH).unwrap()).collect();
    let side = px.dim(2).unwrap() / PATCH;
    VisionInput { image_patches: Some(Tensor::cat(&patches, 0).unwrap()), video_patches: None, media: vec![MediaGrid::image([1, side, side]); n] }
}

fn case_ids(g: &std::collections::HashMap<String, Tensor>) -> Vec<u32> {
    ids_i64(&g["input_ids"]).iter().map(|&x| x as u32).collect()
}

fn greedy_ids(g: &std::collections::HashMap<String, Tensor>) -> Vec<u32> {
    ids_i64(&g["greedy_ids"]).iter().map(|&x| x as u32).collect()
}

#[test]
fn gemma3_matches_transformers() {
    let model = load(DType::F32);
    for case in CASES {
        let (g, _) = golden("gemma3", case);
        let (ids, vis) = (case_ids(&g), vision_input(&g));
        let prefill = prepare(&*model, &ids, &vis).unwrap();
        let want = ids_i64(&g["position_ids"]);
        for c in 0..3 {
            assert_eq!(prefill.positions[c], want, "{case}: position ids");
        }
        assert_eq!(prefill.rope_delta, 0);
        // The image runs are the tokens transformers marks with token_type_ids = 1.
        let marked: Vec<usize> = ids_i64(&g["token_type_ids"]).iter().enumerate().filter(|(_, t)| **t == 1).map(|(i, _)| i).collect();
        let ours: Vec<usize> = prefill.bidirectional.iter().flat_map(|&(a, n)| a..a + n).collect();
        assert_eq!(ours, marked, "{case}: bidirectional image tokens");

        let logits = forward_logits(&*model, &prefill, &mut DenseCache::new(), ids.len()).unwrap();
        let err = max_rel_err(&logits, &g["logits"].squeeze(0).unwrap());
        println!("gemma3/{case}: logits max rel err {err:.2e} over {} tokens", ids.len());
        assert!(err <= 1e-4, "{case}: logits max rel err {err}");

        let params = SamplingParams { max_new_tokens: 32, ..Default::default() };
        let out = generate(&*model, &ids, &vis, &params, None).unwrap();
        assert_eq!(out.tokens, greedy_ids(&g), "{case}: greedy continuation");
    }
}

/// The image tokens' bidirectional mask is what makes the image cases pass: without it the
/// logits move far (transformers' own forward without token_type_ids moved them by 0.74).
#[test]
fn gemma3_images_need_their_bidirectional_mask() {
    let model = load(DType::F32);
    let (g, _) = golden("gemma3", "image");
    let ids = case_ids(&g);
    let mut prefill = prepare(&*model, &ids, &vision_input(&g)).unwrap();
    assert_eq!(prefill.bidirectional.len(), 1);
    prefill.bidirectional.clear();
    let logits = forward_logits(&*model, &prefill, &mut DenseCache::new(), ids.len()).unwrap();
    let apart = max_rel_err(&logits, &g["logits"].squeeze(0).unwrap());
    println!("causal-only image tokens: logits max rel err {apart:.2e}");
    assert!(apart > 1e-2, "{apart}");
}

/// bf16 weights and compute against the f32 goldens, with the Qwen families' bounds (‖·‖₂ ≤ 0.1,
/// max ≤ 0.3 of the logits' scale); greedy ids may part only where f32 nearly ties.
#[test]
fn gemma3_bf16_on_cpu_is_close_to_transformers_f32() {
    let (f32_model, model) = (load(DType::F32), load(DType::BF16));
    for case in CASES {
        let (g, _) = golden("gemma3", case);
        let (ids, vis) = (case_ids(&g), vision_input(&g));
        let prefill = prepare(&*model, &ids, &vis).unwrap();
        let logits = forward_logits(&*model, &prefill, &mut DenseCache::new(), ids.len()).unwrap();
        let want = g["logits"].squeeze(0).unwrap();
        let (err, fro) = (max_rel_err(&logits, &want), fro_rel_err(&logits, &want));
        println!("bf16 gemma3/{case}: logits rel err {fro:.2e} (‖·‖₂), {err:.2e} (max)");
        assert!(fro <= 0.1 && err <= 0.3, "{case}: {fro} / {err}");
        let params = SamplingParams { max_new_tokens: 32, ..Default::default() };
        let got = generate(&*model, &ids, &vis, &params, None).unwrap().tokens;
        let want = greedy_ids(&g);
        let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) else { continue };
        let mut prefix = ids.clone();
        prefix.extend_from_slice(&want[..i]);
        let p = prepare(&*f32_model, &prefix, &vis).unwrap();
        let l: Vec<f32> = forward_logits(&*f32_model, &p, &mut DenseCache::new(), 1).unwrap().squeeze(0).unwrap().to_vec1().unwrap();
        let scale = l.iter().fold(0f32, |m, x| m.max(x.abs()));
        let gap = (l[want[i] as usize] - l[got[i] as usize]) / scale;
        println!("bf16 gemma3/{case}: greedy parts at token {i}, f32 gap {gap:.2e}");
        assert!(gap <= 0.3, "{case}: token {i} differs without a near-tie ({gap})");
    }
}
