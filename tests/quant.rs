//! In-situ quantization (`--quant`): which weights are quantized, how close the block formats
//! stay to f32, and that Q8_0 keeps the tiny model's greedy text continuation.

mod common;

use std::sync::atomic::Ordering;

use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Module};
use common::tiny_dir;
use merg::checkpoint::LoadOptions;
use merg::chat::Message;
use merg::engine::{ChatRequest, Engine, EngineConfig, KvMemory};
use merg::layers::linear::Linear;
use merg::weights::Quant;
use merg::{Checkpoint, SamplingParams};

fn load(quant: Option<Quant>, quant_vision: bool) -> Checkpoint {
    let files = merg::hub::resolve(tiny_dir("qwen2_5_vl").to_str().unwrap(), None).unwrap();
    Checkpoint::load_with(files, &Device::Cpu, &LoadOptions { dtype: Some(DType::F32), quant, quant_vision }).unwrap()
}

fn greedy(ckpt: Checkpoint, prompt: &str, n: usize) -> Vec<u32> {
    let mut e = Engine::new(ckpt, EngineConfig { kv_memory: KvMemory::Blocks(64), ..Default::default() }).unwrap();
    let p = SamplingParams { max_new_tokens: n, stop_token_ids: vec![u32::MAX], ..Default::default() };
    e.run_all(vec![ChatRequest::new(vec![Message::text("user", prompt)], vec![], p)]).pop().unwrap().unwrap().tokens
}

/// Last-position logits of `ids` (dense reference path).
fn logits(c: &Checkpoint, ids: &[u32]) -> Vec<f32> {
    let pre = merg::generate::prepare(&*c.model, ids, &merg::generate::VisionInput::default()).unwrap();
    let l = merg::generate::forward_logits(&*c.model, &pre, &mut merg::models::DenseCache::new(), 1).unwrap();
    l.flatten_all().unwrap().to_vec1().unwrap()
}

/// Q8_0 follows f32's greedy continuation for 16 tokens, except where f32 itself nearly ties:
/// at a divergence, the f32 margin between the two choices must be within the logit noise
/// Q8_0 adds there. (A random tiny model has nearly flat logits, so such ties do happen.)
#[test]
fn q8_0_keeps_the_greedy_text_continuation_or_parts_at_a_near_tie() {
    let mut agreed = vec![];
    for prompt in ["Tell me about your day, and how it made you feel.", "I failed my exam today.", "We adopted a puppy!"] {
        let (f, q) = (load(None, false), load(Some(Quant::Q8_0), false));
        let ids = f.processor.encode_prompt(&[Message::text("user", prompt)], &[]).unwrap();
        let (fi, qi) = (greedy(load(None, false), prompt, 16), greedy(load(Some(Quant::Q8_0), false), prompt, 16));
        let same = fi.iter().zip(&qi).take_while(|(a, b)| a == b).count();
        agreed.push(same);
        if same == 16 {
            continue;
        }
        let prefix: Vec<u32> = ids.iter().chain(&fi[..same]).copied().collect();
        let (lf, lq) = (logits(&f, &prefix), logits(&q, &prefix));
        let noise = lf.iter().zip(&lq).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        let margin = lf[fi[same] as usize] - lf[qi[same] as usize];
        let range = lf.iter().fold(f32::MIN, |a, &b| a.max(b)) - lf.iter().fold(f32::MAX, |a, &b| a.min(b));
        eprintln!("{prompt:?}: same for {same} tokens; f32 margin {margin:.4}, Q8_0 logit noise {noise:.4} (logit range {range:.2})");
        assert!(margin >= 0.0 && margin <= 2.0 * noise, "{prompt:?}: parted at token {same} with an f32 margin {margin} beyond the Q8_0 noise {noise}");
    }
    eprintln!("tokens agreed per prompt: {agreed:?}");
}

#[test]
fn decoder_linears_are_quantized_vision_only_on_request() {
    // The tiny model: 2 decoder layers × 7 projections + an untied lm_head = 15 linears, rows
    // of 64/128 values (too short for k-quant blocks of 256, so q4k falls back to q8_0, as
    // llama.cpp does); its vision tower has 4 blocks × 5 linears + a 2-linear merger.
    let c = load(Some(Quant::Q4K), false);
    let s = c.quant_stats.as_ref().unwrap();
    assert_eq!(s.quantized.load(Ordering::Relaxed), 15);
    assert_eq!(s.fallback_q8_0.load(Ordering::Relaxed), 15);
    assert_eq!(s.dense.load(Ordering::Relaxed), 22, "vision linears stay dense");
    let c = load(Some(Quant::Q8_0), true);
    let s = c.quant_stats.as_ref().unwrap();
    assert_eq!(s.quantized.load(Ordering::Relaxed), 37);
    assert_eq!(s.dense.load(Ordering::Relaxed), 0);
    assert!(load(None, false).quant_stats.is_none());
}

/// Each format against the f32 product on rows of real width (k-quant blocks are 256 wide).
/// Bounds: the relative RMS error of round-to-nearest with b effective bits on Gaussian
/// weights is about 2^-b·√3 scaled by the block range; measured values are far inside them.
#[test]
fn block_formats_stay_close_to_f32() -> candle_core::Result<()> {
    let w = merg::testing::randn(119, (128, 1024), 1.)?;
    let x = merg::testing::randn(120, (3, 1024), 1.)?;
    let exact = Linear::new(w.clone(), None).forward(&x)?;
    let norm = exact.sqr()?.mean_all()?.sqrt()?.to_scalar::<f32>()?;
    for (q, bound) in [(Quant::Q8_0, 0.015), (Quant::Q6K, 0.03), (Quant::Q5K, 0.06), (Quant::Q4K, 0.12)] {
        let ql = Linear::quantized(std::sync::Arc::new(QTensor::quantize(&w, q.ggml())?), None)?;
        let err = (ql.forward(&x)? - &exact)?.sqr()?.mean_all()?.sqrt()?.to_scalar::<f32>()? / norm;
        eprintln!("{}: relative RMS error {err:.4}", q.name());
        assert!(err < bound, "{}: relative RMS error {err} over {bound}", q.name());
    }
    Ok(())
}

#[test]
fn quant_flags_are_checked() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_merg"))
        .args(["generate", "--model", tiny_dir("qwen2_5_vl").to_str().unwrap(), "--prompt", "hi", "--quant", "iq2_xxs"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--quant") && err.contains("iq2_xxs"), "{err}");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_merg"))
        .args(["generate", "--model", tiny_dir("qwen2_5_vl").to_str().unwrap(), "--prompt", "hi", "--quant", "q8_0", "--max-new-tokens", "4", "--kv-memory", "blocks:64"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}

/// `merg bench --quant` measures several formats in one run and names each ratio; on rows of
/// 256+ values (the small dummy config) q4k really is q4k, not the q8_0 fallback.
#[test]
fn bench_measures_formats_in_one_run() {
    let cfg = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/dummy-small-qwen2.5-vl.json");
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_merg"))
        .args(["bench", "--config", cfg.to_str().unwrap(), "--quant", "none,q4k", "--prompt-tokens", "8", "--decode-tokens", "2", "--no-roofline"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    for line in ["decode q4k:", "prefill q4k:"] {
        assert!(text.contains(line), "no {line:?} in {text}");
    }
    // 4 layers × 7 projections + lm_head = 29 linears, all with rows of 256 or 512 values.
    assert_eq!(text.matches("\"quantized_linear_weights\": 29").count(), 1, "{text}");

    // Tied embeddings: the head gets its own quantized copy (still 29), the lookup stays dense.
    let tmp = tempfile::tempdir().unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&cfg).unwrap()).unwrap();
    v["tie_word_embeddings"] = true.into();
    let tied = tmp.path().join("tied.json");
    std::fs::write(&tied, v.to_string()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_merg"))
        .args(["bench", "--config", tied.to_str().unwrap(), "--quant", "q8_0", "--prompt-tokens", "8", "--decode-tokens", "2", "--no-roofline"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("\"quantized_linear_weights\": 29"), "{text}{}", String::from_utf8_lossy(&out.stderr));
}

/// Qwen3-VL-MoE's fused experts are cut into per-expert layers and quantized like every other
/// decoder linear (for the 30B-A3B they are most of the weights): 4 layers × 4 attention
/// projections, 3 sparse layers × 4 experts × 3 matrices, one dense MLP and the untied head
/// = 56 quantized; the routers stay dense (as llama.cpp keeps them). Layer-level accuracy is
/// `layers::moe`'s test (same routing, Q8_0 noise); here, whole-model logits move more than
/// the dense tiny Qwen3-VL's under Q8_0 (measured 1.4e-1 vs 1.8e-2) because a token whose
/// top-k nearly ties (gaps down to 6e-5 in these weights) can switch experts upstream.
#[test]
fn moe_experts_are_quantized_in_situ() {
    let load = |quant| {
        let files = merg::hub::resolve(tiny_dir("qwen3_vl_moe").to_str().unwrap(), None).unwrap();
        Checkpoint::load_with(files, &Device::Cpu, &LoadOptions { dtype: Some(DType::F32), quant, quant_vision: false }).unwrap()
    };
    let q = load(Some(Quant::Q8_0));
    let s = q.quant_stats.as_ref().unwrap();
    assert_eq!(s.quantized.load(Ordering::Relaxed), 56);
    let ids: Vec<u32> = (3..40).collect();
    let (a, b) = (logits(&load(None), &ids), logits(&q, &ids));
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
    let err = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max) / scale;
    println!("q8_0 MoE logits max rel err {err:.2e}");
    assert!(err < 0.3, "{err}");
}

