//! Qwen2.5-Omni's thinker against transformers 4.57.1 on the tiny checkpoint (goldens made by
//! scripts/tiny_qwen2_5_omni.py): for text, audio, image + audio, a video with its audio track
//! and the same video without it, the audio tower's features, TMRoPE positions and rope delta, f32 logits within 1e-4
//! relative and 32 greedy tokens, fed the processor's own inputs (log-mel features, patches,
//! grids); bf16 within the other families' tolerances; and the errors of bad configs and
//! inputs.

mod common;

use std::collections::HashMap;
use std::sync::Arc;

use candle_core::{DType, Tensor};
use common::omni::{clips, greedy, logits_after, prepare, vision_input};
use common::*;
use merg::generate::forward_logits;
use merg::models::{DenseCache, Model};
use merg::weights::Weights;

const FAMILY: &str = "qwen2_5_omni";
const CASES: [&str; 5] = ["text", "audio", "image_audio", "video_audio", "video"];

fn config() -> serde_json::Value {
    merg::models::registry::read_config(&tiny_dir(FAMILY).join("config.json")).unwrap()
}

fn weight_files() -> Vec<std::path::PathBuf> {
    let dir = tiny_dir(FAMILY);
    let index: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap()).unwrap();
    let mut files: Vec<_> = index["weight_map"].as_object().unwrap().values().map(|v| dir.join(v.as_str().unwrap())).collect();
    files.sort();
    files.dedup();
    files
}

/// Through the registry, as `merg` loads any checkpoint.
fn load_with(config: &serde_json::Value, dtype: DType) -> anyhow::Result<Arc<dyn Model>> {
    merg::models::load(config, Weights::safetensors(&weight_files(), dtype, &test_device())?)
}

fn golden_ids(g: &HashMap<String, Tensor>, key: &str) -> Vec<u32> {
    ids_i64(&g[key]).iter().map(|&x| x as u32).collect()
}

#[test]
fn qwen2_5_omni_matches_transformers() {
    let model = load_with(&config(), DType::F32).unwrap();
    let model = &*model;
    for case in CASES {
        let (g, _) = golden(FAMILY, case);
        let ids = golden_ids(&g, "input_ids");
        let (prefill, audio) = prepare(model, &ids, &g).unwrap();
        if let Some(want) = g.get("audio_features") {
            let got = Tensor::cat(&audio, 0).unwrap();
            assert_eq!(got.dims(), want.dims(), "{case}: audio feature shape");
            let err = max_rel_err(&got, want);
            println!("{FAMILY}/{case}: audio features max rel err {err:.2e} over {} rows", want.dim(0).unwrap());
            assert!(err <= 1e-4, "{case}: audio features max rel err {err}");
        }
        let got: Vec<i64> = prefill.positions.iter().flatten().copied().collect();
        assert_eq!(got, ids_i64(&g["position_ids"]), "{case}: TMRoPE positions");
        assert_eq!(prefill.rope_delta, ids_i64(&g["rope_deltas"])[0], "{case}: rope delta");

        let logits = forward_logits(model, &prefill, &mut DenseCache::new(), ids.len()).unwrap();
        let err = max_rel_err(&logits, &g["logits"].squeeze(0).unwrap());
        println!("{FAMILY}/{case}: logits max rel err {err:.2e} over {} tokens", ids.len());
        assert!(err <= 1e-4, "{case}: logits max rel err {err}");
        assert_eq!(greedy(model, &prefill, ids.len(), 32), golden_ids(&g, "greedy_ids"), "{case}: greedy continuation");
    }
}

/// bf16 within the tolerances of tests/parity.rs (‖·‖₂ 0.1, max 0.3: rounding amplified by a
/// random network; a wrong op is O(1)); greedy tokens equal, or parting only where the f32
/// golden nearly ties.
#[test]
fn qwen2_5_omni_bf16_on_cpu_is_close_to_transformers_f32() {
    let model = load_with(&config(), DType::BF16).unwrap();
    let f32_model = load_with(&config(), DType::F32).unwrap();
    for case in CASES {
        let (g, _) = golden(FAMILY, case);
        let ids = golden_ids(&g, "input_ids");
        let (prefill, _) = prepare(&*model, &ids, &g).unwrap();
        let logits = forward_logits(&*model, &prefill, &mut DenseCache::new(), ids.len()).unwrap();
        let want = g["logits"].squeeze(0).unwrap();
        let (err, fro) = (max_rel_err(&logits, &want), fro_rel_err(&logits, &want));
        println!("BF16 {FAMILY}/{case}: logits rel err {fro:.2e} (‖·‖₂), {err:.2e} (max)");
        assert!(fro <= 0.1 && err <= 0.3, "{case}: bf16 logits rel err {fro} (‖·‖₂), {err} (max)");
        let got = greedy(&*model, &prefill, ids.len(), 32);
        let want = golden_ids(&g, "greedy_ids");
        let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) else { continue };
        let (p, _) = prepare(&*f32_model, &ids, &g).unwrap();
        let l = logits_after(&*f32_model, &p, ids.len(), &want[..i]);
        let scale = l.iter().fold(0f32, |m, x| m.max(x.abs()));
        let gap = (l[want[i] as usize] - l[got[i] as usize]) / scale;
        println!("BF16 {FAMILY}/{case}: greedy parts at token {i}, f32 gap {gap:.2e}");
        assert!(gap <= 0.3, "{case}: bf16 token {i} differs without a near-tie (gap {gap})");
    }
}

/// The thinker loads with the talker's and token2wav's tensors in the files (never read), and
/// the family says so; the spec counts the audio tower.
#[test]
fn talker_and_token2wav_are_skipped_and_named() {
    let cfg = config();
    let index = std::fs::read_to_string(tiny_dir(FAMILY).join("model.safetensors.index.json")).unwrap();
    assert!(index.contains("\"talker.") && index.contains("\"token2wav."), "the fixture carries talker tensors");
    let model = load_with(&cfg, DType::F32).unwrap();
    assert_eq!(model.spec().model_type, FAMILY);
    assert_eq!(model.audio_spec().map(|a| (a.token, a.mel_bins, a.chunk_frames)), Some((451, 128, 200)));
    let notes = merg::models::registry::notes(&cfg).unwrap().join(" ");
    assert!(notes.contains("talker") && notes.contains("token2wav"), "{notes}");
    // The counts from the config equal the checkpoint's own tensors (the audio tower's unused
    // audio_bos_eos_token table aside).
    let params = merg::models::param_counts(&cfg).unwrap();
    let mut stored: HashMap<&str, u64> = HashMap::new();
    for f in weight_files() {
        for (name, t) in candle_core::safetensors::load(&f, &candle_core::Device::Cpu).unwrap() {
            let part = match name.as_str() {
                n if n.starts_with("thinker.audio_tower.") && !n.contains("audio_bos_eos_token") => "audio",
                n if n.starts_with("thinker.visual.") => "vision",
                n if n.starts_with("thinker.model.") || n == "thinker.lm_head.weight" => "text",
                _ => "other",
            };
            *stored.entry(part).or_default() += t.elem_count() as u64;
        }
    }
    assert_eq!((params.audio, params.vision, params.text_linear + params.text_other), (stored["audio"], stored["vision"], stored["text"]));
}

/// An audio config whose sizes do not match the tensors fails naming the tensor and the
/// config fields; a thinker config without `audio_config` fails naming it.
#[test]
fn bad_audio_configs_name_the_field() {
    let mut cfg = config();
    cfg["thinker_config"]["audio_config"]["encoder_ffn_dim"] = serde_json::json!(96);
    let e = format!("{:#}", load_with(&cfg, DType::F32).err().unwrap());
    assert!(e.contains("audio_tower.layers.0") && e.contains("encoder_ffn_dim") && e.contains("fc1"), "{e}");
    let mut cfg = config();
    cfg["thinker_config"]["audio_config"]["num_mel_bins"] = serde_json::json!(80);
    let e = format!("{:#}", load_with(&cfg, DType::F32).err().unwrap());
    assert!(e.contains("audio_tower.conv1") && e.contains("num_mel_bins"), "{e}");
    let mut cfg = config();
    cfg["thinker_config"]["audio_config"]["encoder_layers"] = serde_json::json!(3);
    let e = format!("{:#}", load_with(&cfg, DType::F32).err().unwrap());
    assert!(e.contains("audio_tower.layers.2") && e.contains("encoder_layers (3)"), "{e}");
    let mut cfg = config();
    cfg["thinker_config"].as_object_mut().unwrap().remove("audio_config");
    let e = format!("{:#}", load_with(&cfg, DType::F32).err().unwrap());
    assert!(e.contains("thinker_config.audio_config"), "{e}");
}

/// Audio that does not fit the prompt or the tower is refused with the counts, not a panic.
#[test]
fn mismatched_audio_inputs_are_refused() {
    let model = load_with(&config(), DType::F32).unwrap();
    let (g, _) = golden(FAMILY, "audio");
    let ids = golden_ids(&g, "input_ids");
    let clip = &clips(&g)[0];
    let e = format!("{:#}", model.encode_audio(&clip.narrow(0, 0, 80).unwrap()).unwrap_err());
    assert!(e.contains("80 mels") && e.contains("128 mels"), "{e}");
    for frames in [0, 2] {
        let e = format!("{:#}", model.encode_audio(&clip.narrow(1, 0, frames).unwrap()).unwrap_err());
        assert!(e.contains(&format!("{frames} frames")) && e.contains("at least 3 frames"), "{e}");
    }
    assert_eq!(model.encode_audio(&clip.narrow(1, 0, 3).unwrap()).unwrap().dim(0).unwrap(), 1);
    // A clip shorter than the prompt's placeholders, and no clip at all.
    let short = model.encode_audio(&clip.narrow(1, 0, 400).unwrap()).unwrap();
    assert_eq!(short.dim(0).unwrap(), merg::models::AudioSpec::tokens(400));
    let e = format!("{:#}", model.prepare_prompt_with_audio(&ids, &[], &[], &[short]).err().unwrap());
    assert!(e.contains("132 audio placeholder tokens") && e.contains("100 feature rows"), "{e}");
    let e = format!("{:#}", model.prepare_prompt(&ids, &[], &[]).err().unwrap());
    assert!(e.contains("132 audio placeholder tokens"), "{e}");
    // A model without an audio tower refuses audio.
    let vl = merg::models::registry::read_config(&tiny_dir("qwen2_5_vl").join("config.json")).unwrap();
    let spec = merg::models::registry::spec(&vl).unwrap();
    assert!(spec.model_type == "qwen2_5_vl");
}

/// An audio-in-video block whose tokens are not interleaved as the processor writes them is an
/// error naming the block, not positions made up.
#[test]
fn audio_in_video_layout_is_checked() {
    let model = load_with(&config(), DType::F32).unwrap();
    let (g, _) = golden(FAMILY, "video_audio");
    let mut ids = golden_ids(&g, "input_ids");
    let (video, audio) = (461, 451);
    // The first audio token trades places with the video token before it (the last of the
    // video's first time chunk).
    let first_audio = ids.iter().position(|&t| t == audio).unwrap();
    assert_eq!(ids[first_audio - 1], video);
    ids.swap(first_audio - 1, first_audio);
    let vis = vision_input(&g);
    let feats: Vec<Tensor> = vis.items().unwrap().iter().map(|(p, m)| model.encode_media(p, m).unwrap()).collect();
    let audio_feats: Vec<Tensor> = clips(&g).iter().map(|c| model.encode_audio(c).unwrap()).collect();
    let e = format!("{:#}", model.prepare_prompt_with_audio(&ids, &vis.media, &feats, &audio_feats).err().unwrap());
    assert!(e.contains("video with its audio at token") && e.contains("interleaved"), "{e}");
}

/// `merg info` counts the audio tower and says that the speech output is not loaded.
#[test]
fn info_counts_the_audio_tower_and_names_the_skipped_parts() {
    let dir = tiny_dir(FAMILY).display().to_string();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_merg")).args(["info", "--model", &dir]).env("HF_HUB_OFFLINE", "1").output().unwrap();
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{err}");
    assert!(out.contains("family:    qwen2_5_omni") && out.contains("+ audio "), "{out}");
    assert!(out.contains("note:") && out.contains("talker and token2wav"), "{out}");
}

/// The rendered prompt (the goldens' `prompt_text`, from transformers' chat template) through
/// the checkpoint's tokenizer.json and `expand_placeholders` gives the processor's ids: audio
/// runs from the clips' frames, image and video runs from their grids, and the video with its
/// audio interleaved in 2 s chunks.
#[test]
fn placeholders_expand_as_the_processor_does() {
    use merg::models::qwen2_5_omni::prompt::{expand_placeholders, PromptMedia};
    let cfg = merg::models::qwen2_5_omni::Config::from_value(&config()).unwrap();
    let tok = tokenizers::Tokenizer::from_file(tiny_dir(FAMILY).join("tokenizer.json")).unwrap();
    for case in CASES {
        let (g, meta) = golden(FAMILY, case);
        let text = meta["prompt_text"].as_str().unwrap();
        let ids = tok.encode(text, false).unwrap().get_ids().to_vec();
        let frames: Vec<usize> = g.get("feature_attention_mask").map_or(vec![], |m| m.to_vec2::<i64>().unwrap().iter().map(|r| r.iter().sum::<i64>() as usize).collect());
        let vis = vision_input(&g);
        let m = PromptMedia { media: &vis.media, audio_frames: &frames, audio_in_video: meta["use_audio_in_video"].as_bool().unwrap() };
        assert_eq!(expand_placeholders(&ids, &m, &cfg).unwrap(), golden_ids(&g, "input_ids"), "{case}: expanded prompt ids");
    }
    // A clip too many, or one too few, is an error.
    let (g, meta) = golden(FAMILY, "audio");
    let ids = tok.encode(meta["prompt_text"].as_str().unwrap(), false).unwrap().get_ids().to_vec();
    for frames in [vec![], vec![530, 530]] {
        let m = PromptMedia { media: &[], audio_frames: &frames, audio_in_video: false };
        assert!(expand_placeholders(&ids, &m, &cfg).is_err(), "{} clips", frames.len());
    }
    assert!(g.contains_key("input_features"));
}

/// A thinker saved on its own (`qwen2_5_omni_thinker`: the thinker's config at the top level,
/// tensors without `thinker.`) loads as the same model.
#[test]
fn a_thinker_saved_alone_loads_the_same() {
    let dir = tempfile::tempdir().unwrap();
    let mut tensors = HashMap::new();
    for f in weight_files() {
        for (name, t) in candle_core::safetensors::load(&f, &candle_core::Device::Cpu).unwrap() {
            if let Some(n) = name.strip_prefix("thinker.") {
                tensors.insert(n.to_string(), t);
            }
        }
    }
    let file = dir.path().join("model.safetensors");
    candle_core::safetensors::save(&tensors, &file).unwrap();
    let mut cfg = config()["thinker_config"].clone();
    cfg["model_type"] = serde_json::json!("qwen2_5_omni_thinker");
    let model = merg::models::load(&cfg, Weights::safetensors(&[file], DType::F32, &test_device()).unwrap()).unwrap();
    let (g, _) = golden(FAMILY, "audio");
    let ids = golden_ids(&g, "input_ids");
    let (prefill, _) = prepare(&*model, &ids, &g).unwrap();
    let logits = forward_logits(&*model, &prefill, &mut DenseCache::new(), ids.len()).unwrap();
    let err = max_rel_err(&logits, &g["logits"].squeeze(0).unwrap());
    assert!(err <= 1e-4, "thinker alone: logits max rel err {err}");
}

/// The released configs in models/ (Qwen2.5-Omni-3B and -7B) count the thinker's parameters as
/// transformers 4.57.1 does: `Qwen2_5OmniThinkerForConditionalGeneration` built from each
/// file's `thinker_config` on the meta device holds text 3,085,938,688 / 7,615,616,512 (the 3B's
/// head tied to its embedding), vision 668,684,288 / 676,550,144 and audio 637,676,544 /
/// 639,647,232, of which merg leaves out the audio tower's unused `audio_bos_eos_token` table
/// (2 × the text width). Qwen publishes no thinker-only count; the 7B's model page gives 10.7B
/// for the whole model with the talker and token2wav, which merg does not load.
#[test]
fn released_configs_count_transformers_parameters() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for (name, text, vision, audio, width) in [("qwen2.5-omni-3b", 3_085_938_688u64, 668_684_288u64, 637_676_544u64, 2048u64), ("qwen2.5-omni-7b", 7_615_616_512, 676_550_144, 639_647_232, 3584)] {
        let cfg = merg::models::registry::read_config(&root.join(format!("models/{name}.json"))).unwrap();
        let p = merg::models::registry::param_counts(&cfg).unwrap();
        assert_eq!((p.text_linear + p.text_other, p.vision, p.audio + 2 * width), (text, vision, audio), "{name}");
        assert_eq!(p.tied_head, name.ends_with("3b"), "{name}");
        eprintln!("{name}: {} thinker parameters (text {text}, vision {vision}, audio {})", p.total(), p.audio);
    }
}
