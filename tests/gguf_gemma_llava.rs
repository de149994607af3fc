//! Gemma 3 and LLaVA-NeXT from llama.cpp's files (scripts/gguf_spm_fixtures.py): the `gemma3`
//! and `llama` text files and their `clip` projectors, converted by the pinned converter from
//! the tiny checkpoints. The F32 files give the safetensors model back (text and image), the
//! SentencePiece tokenizer rebuilt from the metadata tokenizes as tokenizer.json does, merg
//! agrees with llama.cpp itself on the F32 and Q4_0 files, and mismatched or incomplete files
//! fail by name.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use common::gguf::{gguf, max_diff, renamed_key, shards, stored_f16, RoundedToF16};
use common::{fixtures, golden, ids_i64, tiny_dir};
use merg::generate::{forward_logits, prepare, SamplingParams, VisionInput};
use merg::gguf::{GgufFile, GgufPaths};
use merg::models::{DenseCache, MediaGrid, Model};
use merg::weights::{index_shards, SafetensorsWeights, WeightSource, Weights};

/// (model_type, fixture folder).
const FAMILIES: [(&str, &str); 2] = [("gemma3", "gemma3"), ("llava_next", "llava-next")];

/// The model llama.cpp's GGUF files hold (merg's GGUF reader), in f32 on the CPU.
fn gguf_model(paths: &GgufPaths) -> Arc<dyn Model> {
    let o = merg::gguf::open(paths).unwrap();
    merg::models::load(&o.config, Weights::new(Arc::new(o.weights), DType::F32, &Device::Cpu)).unwrap()
}

/// What the converter left out: LLaVA's legacy projector converter drops the tower's layers
/// after the feature layer and its unused post-LayerNorm.
fn dropped(family: &str, name: &str) -> bool {
    family == "llava_next" && (name.contains("vision_model.encoder.layers.2.") || name.contains("vision_model.post_layernorm."))
}

/// The tiny checkpoint's config as llama.cpp's file describes the model: Gemma 3's GGUF records
/// neither the local/global pattern nor `query_pre_attn_scalar`, and llama.cpp takes every sixth
/// layer global and 1/√head_dim (the released 1B/4B/12B values); the tiny checkpoint uses 3 and
/// 24 to exercise them, so the reference here states llama.cpp's.
fn reference_config(family: &str) -> serde_json::Value {
    let mut c = merg::models::registry::read_config(&tiny_dir(family).join("config.json")).unwrap();
    if family == "gemma3" {
        let t = &mut c["text_config"];
        assert_eq!((t["sliding_window_pattern"].as_u64(), t["query_pre_attn_scalar"].as_u64()), (Some(3), Some(24)));
        t["sliding_window_pattern"] = 6.into();
        t["query_pre_attn_scalar"] = t["head_dim"].clone();
    }
    c
}

/// The golden's prompt and pixels as the model's inputs (Gemma 3: one 48-pixel square per
/// image; LLaVA-NeXT: each image's own tiles, as tests/parity.rs lays them out).
fn inputs(model: &dyn Model, g: &HashMap<String, Tensor>) -> (Vec<u32>, VisionInput) {
    let ids = ids_i64(&g["input_ids"]).iter().map(|&x| x as u32).collect();
    let Some(px) = g.get("pixel_values") else { return (ids, VisionInput::default()) };
    let v = model.spec().vision.clone().unwrap();
    let p = v.patch_size;
    let (mut patches, mut media) = (vec![], vec![]);
    match (g.get("image_sizes"), &v.anyres) {
        (Some(sizes), Some(any)) => {
            let side = any.tile / p;
            for (i, hw) in sizes.to_vec2::<i64>().unwrap().into_iter().enumerate() {
                let size = [hw[0] as usize, hw[1] as usize];
                let n = any.tiles(size);
                let t = px.get(i).unwrap().narrow(0, 0, n).unwrap().reshape((n, 3, side, p, side, p)).unwrap();
                patches.push(t.permute((0, 2, 4, 1, 3, 5)).unwrap().reshape((n * side * side, 3 * p * p)).unwrap());
                media.push(MediaGrid { size, ..MediaGrid::image([n, side, side]) });
            }
        }
        _ => {
            for i in 0..px.dim(0).unwrap() {
                patches.push(merg::models::gemma3::vision::patches_of(&px.get(i).unwrap(), p).unwrap());
                let side = px.dim(2).unwrap() / p;
                media.push(MediaGrid::image([1, side, side]));
            }
        }
    }
    (ids, VisionInput { image_patches: Some(Tensor::cat(&patches, 0).unwrap()), video_patches: None, media })
}

fn prompt_logits(model: &dyn Model, ids: &[u32], vis: &VisionInput) -> Tensor {
    let p = prepare(model, ids, vis).unwrap();
    forward_logits(model, &p, &mut DenseCache::new(), ids.len()).unwrap()
}

/// Every tensor of the hub checkpoint comes back from the F32 files (the norms the converter
/// stored as `w + 1` within one f32 ulp of 1; tensors it stored in f16 as their f16 rounding),
/// and the whole model gives the safetensors model's logits for the text and the image golden.
#[test]
fn f32_gguf_is_the_safetensors_model() {
    for (family, dir) in FAMILIES {
        let paths = gguf(dir, "f32");
        let files = shards(&tiny_dir(family));
        let st = SafetensorsWeights::open(&files).unwrap();
        let g = merg::gguf::open(&paths).unwrap().weights;
        let mut names: Vec<String> = index_shards(&files).unwrap().into_keys().collect();
        names.sort();
        let f16 = stored_f16(&names, &paths);
        let (mut compared, mut left_out) = (0, 0);
        for name in &names {
            let a = st.tensor(name, None, DType::F32, &Device::Cpu).unwrap();
            let b = match g.tensor(name, None, DType::F32, &Device::Cpu) {
                Ok(b) => b,
                Err(e) => {
                    assert!(dropped(family, name), "{family}: {name}: {e}");
                    left_out += 1;
                    continue;
                }
            };
            assert_eq!(a.shape(), b.shape(), "{family}: {name}");
            let a = if f16.contains(name) { a.to_dtype(DType::F16).unwrap().to_dtype(DType::F32).unwrap() } else { a };
            let tol = if family == "gemma3" && name.ends_with("norm.weight") && !name.contains("vision_model") { 1.2e-7 } else { 0.0 };
            assert!(max_diff(&a, &b) <= tol, "{family}: {name} differs by {}", max_diff(&a, &b));
            compared += 1;
        }
        eprintln!("{family}: {compared} tensors equal ({} stored in f16 by the converter: {f16:?}), {left_out} left out by it", f16.len());
        assert!(compared > 30 && !f16.is_empty());
        assert_eq!(left_out, if family == "llava_next" { 18 } else { 0 }, "{family}: tensors the converter left out");

        let reference = RoundedToF16 { inner: SafetensorsWeights::open(&files).unwrap(), names: f16 };
        let hub = merg::models::load(&reference_config(family), Weights::new(Arc::new(reference), DType::F32, &Device::Cpu)).unwrap();
        let ours = gguf_model(&paths);
        for case in ["text", "image"] {
            let (gold, _) = golden(family, case);
            let (ids, vis) = inputs(&*hub, &gold);
            let (la, lb) = (prompt_logits(&*hub, &ids, &vis), prompt_logits(&*ours, &ids, &vis));
            let scale = la.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            let d = max_diff(&la, &lb);
            eprintln!("{family}/{case}: {} tokens, GGUF vs safetensors max |Δlogit| {d:e} (scale {scale:.2})", ids.len());
            assert!(d <= 1e-5 * scale.max(1.0), "{family}/{case}: GGUF F32 logits differ by {d}");
        }
    }
}

/// The files as merg loads a user's (`Checkpoint::load_gguf`: the tokenizer rebuilt from the
/// metadata, the chat template the file carries, the projector's geometry, the preprocessor
/// config beside): a chat with an image gives the hub checkpoint's prompt ids and pixels and,
/// on the same inputs, the logits of the safetensors model llama.cpp's file describes (see
/// `reference_config`, f16-rounded where the converter stored f16).
#[test]
fn gguf_checkpoint_runs_a_chat_with_an_image() {
    use merg::chat::{ContentPart, Message};
    use merg::checkpoint::LoadOptions;
    for (family, dir) in FAMILIES {
        let paths = gguf(dir, "f32");
        let ours = merg::Checkpoint::load_gguf(&paths, &Device::Cpu, &LoadOptions::default()).unwrap();
        let hub = merg::Checkpoint::load(merg::hub::resolve(tiny_dir(family).to_str().unwrap(), None).unwrap(), &Device::Cpu, Some(DType::F32)).unwrap();
        let files = shards(&tiny_dir(family));
        let mut names: Vec<String> = index_shards(&files).unwrap().into_keys().collect();
        names.sort();
        let reference = RoundedToF16 { names: stored_f16(&names, &paths), inner: SafetensorsWeights::open(&files).unwrap() };
        let rounded = merg::models::load(&reference_config(family), Weights::new(Arc::new(reference), DType::F32, &Device::Cpu)).unwrap();
        let photo = merg::vision::Media::Image(image::open(fixtures().join("media/img_a.png")).unwrap().to_rgb8());
        let text = [Message::text("user", "How was your day? I hope it went well.")];
        let with_image = [Message::new("user", vec![ContentPart::Image, ContentPart::Text("How does she feel?".into())])];
        for (messages, media) in [(&text[..], vec![]), (&with_image[..], vec![photo])] {
            let (ids, vis) = merg::generate::reference_inputs(&ours.processor, messages, &media, &Device::Cpu).unwrap();
            let (hub_ids, hub_vis) = merg::generate::reference_inputs(&hub.processor, messages, &media, &Device::Cpu).unwrap();
            assert_eq!(ids, hub_ids, "{family}: prompt ids");
            if let (Some(a), Some(b)) = (&vis.image_patches, &hub_vis.image_patches) {
                assert_eq!(max_diff(a, b), 0.0, "{family}: image patches");
            }
            assert_eq!(vis.image_patches.is_some(), !media.is_empty());
            let (la, lb) = (prompt_logits(&*rounded, &ids, &vis), prompt_logits(&*ours.model, &ids, &vis));
            let d = max_diff(&la, &lb);
            let scale = la.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            eprintln!("{family} chat, {} media: {} tokens, max |Δlogit| {d:e} (scale {scale:.2})", media.len(), ids.len());
            assert!(d <= 1e-5 * scale.max(1.0), "{family}: GGUF checkpoint logits differ by {d}");
        }
    }
}

/// The SentencePiece tokenizer rebuilt from `tokenizer.ggml.*` (pieces, scores, types; merges
/// from the scores) encodes and decodes as the checkpoint's tokenizer.json, with and without
/// the `<bos>` the post-processor adds; dialogue text through merg's chat tokenizer cannot
/// become an added token.
#[test]
fn tokenizer_from_gguf_metadata_equals_tokenizer_json() {
    let texts = [
        "Hello world!  It's 2024-11-23, isn't it?",
        "How was your day? I hope it went well.",
        "naïve café — \u{1F600} emojis\n\n\tand tabs",
        "<start_of_turn>user\n<image> </s><s>[multimodal]<end_of_turn>",
        "   leading spaces and 12345 numbers",
        "The quick brown fox jumps over the lazy dog; she felt happy, then sad.",
        "",
    ];
    for (family, dir) in FAMILIES {
        let hf = tokenizers::Tokenizer::from_file(tiny_dir(family).join("tokenizer.json")).unwrap();
        let f = GgufFile::open(&gguf(dir, "f32").text).unwrap();
        let json = merg::gguf::tokenizer::tokenizer_json(&f).unwrap();
        let ours: tokenizers::Tokenizer = json.parse().unwrap();
        for t in texts {
            for special in [false, true] {
                let (a, b) = (ours.encode(t, special).unwrap(), hf.encode(t, special).unwrap());
                assert_eq!(a.get_ids(), b.get_ids(), "{family}: {t:?} (special {special})");
            }
            let ids = hf.encode(t, true).unwrap().get_ids().to_vec();
            assert_eq!(ours.decode(&ids, false).unwrap(), hf.decode(&ids, false).unwrap(), "{family}: decode {t:?}");
            // tiny-gemma3's tokenizer_config.json (which the converter reads) calls [multimodal]
            // not special, its tokenizer.json special: only skipping specials tells them apart.
            if !t.contains("[multimodal]") {
                assert_eq!(ours.decode(&ids, true).unwrap(), hf.decode(&ids, true).unwrap(), "{family}: decode {t:?} without specials");
            }
        }
        assert_eq!(ours.get_vocab_size(true), hf.get_vocab_size(true), "{family}: vocabulary");
    }
    // Through merg's chat tokenizer: data text as the checkpoint's tokenizer splits it, and
    // never one of the added tokens (Gemma's turn and image tokens, LLaVA's <image>, <s>, </s>).
    for (family, dir) in FAMILIES {
        let f = GgufFile::open(&gguf(dir, "f32").text).unwrap();
        let chat = merg::tokenizer::ChatTokenizer::from_json(&merg::gguf::tokenizer::tokenizer_json(&f).unwrap(), "gguf", None).unwrap();
        let hf = merg::tokenizer::ChatTokenizer::from_dir(&tiny_dir(family)).unwrap();
        for t in texts {
            assert_eq!(chat.encode_text(t).unwrap(), hf.encode_text(t).unwrap(), "{family} chat tokenizer: {t:?}");
        }
        let ids = chat.encode_text(texts[3]).unwrap();
        let added: Vec<u32> = hf_added(&tiny_dir(family));
        assert!(added.len() >= 5 && ids.iter().all(|i| !added.contains(i)), "{family}: data text made an added token: {ids:?}");
    }
}

/// The ids of a tokenizer.json's added tokens.
fn hf_added(dir: &Path) -> Vec<u32> {
    let t: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer.json")).unwrap()).unwrap();
    t["added_tokens"].as_array().unwrap().iter().map(|a| a["id"].as_u64().unwrap() as u32).collect()
}

fn golden_json(path: &Path) -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn rows(v: &serde_json::Value) -> Vec<Vec<f32>> {
    v.as_array().unwrap().iter().map(|r| r.as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32).collect()).collect()
}

fn sha256_f32(t: &Tensor) -> String {
    use sha2::Digest;
    let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    sha2::Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect()
}

/// merg and llama.cpp (llama-cpp-python, the pinned library) on the same files and the text
/// golden's prompt (longer than Gemma 3's 8-token window), as tests/gguf.rs compares the Qwen
/// files: the F32 files within 5e-3 of the logit scale (llama.cpp keeps K/V in f16 and sums in
/// another order); the Q4_0 files (Q4_0 with llama.cpp's Q8_0 fallback for the 64-wide head)
/// within four times that gap plus a tenth of what Q4_0 itself moves llama.cpp's logits (on
/// these 64-wide rows 4-bit weights move them by 40-80 % of the scale, so a misread block or
/// row would show as a gap of that size); greedy decoding agreeing for at least 8 of 16
/// tokens; every tensor dequantizes to exactly gguf-py's values.
#[test]
fn logits_agree_with_llama_cpp() {
    for (family, dir) in FAMILIES {
        let (mut f32_gap, mut f32_logits) = (0f32, vec![]);
        for kind in ["f32", "q4_0"] {
            let paths = gguf(dir, kind);
            let g = golden_json(&paths.text.with_extension("json"));
            let file = GgufFile::open(&paths.text).unwrap();
            let hashes = g["gguf_py"].as_object().unwrap();
            assert_eq!(hashes.len(), file.header.tensors.len(), "{family} {kind}");
            let mut types = std::collections::BTreeSet::new();
            for (tensor, w) in hashes {
                let q = file.qtensor(tensor, &Device::Cpu).unwrap();
                assert_eq!(sha256_f32(&q.dequantize(&Device::Cpu).unwrap()), w["sha256"].as_str().unwrap(), "{family} {kind}: {tensor} ({})", w["type"]);
                types.insert(w["type"].as_str().unwrap().to_string());
            }
            let l = &g["llama_cpp"];
            let prompt: Vec<u32> = l["prompt"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
            let want = rows(&l["logits_last"]);
            let model = gguf_model(&paths);
            let inputs = prepare(&*model, &prompt, &Default::default()).unwrap();
            let got = forward_logits(&*model, &inputs, &mut DenseCache::new(), want.len()).unwrap().to_vec2::<f32>().unwrap();
            let scale = want.iter().flatten().fold(0f32, |a, &b| a.max(b.abs()));
            let err = want.iter().flatten().zip(got.iter().flatten()).fold(0f32, |a, (x, y)| a.max((x - y).abs())) / scale;
            let greedy: Vec<u32> = l["greedy"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
            let p = SamplingParams { max_new_tokens: greedy.len(), stop_token_ids: vec![u32::MAX], ..Default::default() };
            let ours = merg::generate::generate(&*model, &prompt, &Default::default(), &p, None).unwrap().tokens;
            let same = ours.iter().zip(&greedy).take_while(|(a, b)| a == b).count();
            eprintln!("{family} {kind} ({types:?}): {} prompt tokens, max |Δlogit| / scale = {err:.2e} (scale {scale:.2}); greedy agrees for {same} of {}", prompt.len(), greedy.len());
            if kind == "f32" {
                (f32_gap, f32_logits) = (err, want);
                assert!(err < 5e-3, "{family} F32 file: merg and llama.cpp differ by {err} of the logit scale");
            } else {
                let moved = f32_logits.iter().flatten().zip(want.iter().flatten()).fold(0f32, |a, (x, y)| a.max((x - y).abs())) / scale;
                eprintln!("{family}: Q4_0 moves llama.cpp's logits by {moved:.2e} of the scale");
                assert!(types.contains("Q4_0"), "{family}: {types:?}");
                assert!(err < 4.0 * f32_gap + 0.1 * moved, "{family} {kind}: {err} of the logit scale (F32 gap {f32_gap}, Q4_0's own effect {moved})");
            }
            assert!(same >= 8, "{family} {kind}: greedy parted from llama.cpp at token {same}: {ours:?} vs {greedy:?}");
        }
    }
}

fn open_err(paths: &GgufPaths) -> String {
    format!("{:#}", merg::gguf::open(paths).err().expect("must fail"))
}

/// A projector of another kind beside a gemma3 or llama text file, and files missing the
/// fields the config needs, fail naming the file and the key.
#[test]
fn mismatched_and_incomplete_files_are_named() {
    let (gemma, llava, qwen) = (gguf("gemma3", "f32"), gguf("llava-next", "f32"), fixtures().join("gguf/qwen2-vl/mmproj-tiny-qwen2-vl-f32.gguf"));
    for (text, mm, kind) in [(&gemma, &llava, "mlp"), (&llava, &gemma, "gemma3"), (&gemma, &qwen2(&qwen), "qwen2vl_merger")] {
        let e = open_err(&GgufPaths::new(text.text.clone(), mm.mmproj.clone()));
        let mm_name = mm.mmproj.as_ref().unwrap().file_name().unwrap().to_string_lossy().to_string();
        assert!(e.contains(&mm_name) && e.contains(&format!("a {kind} vision projector")) && e.contains("another model"), "{e}");
    }
    // A Qwen text file with Gemma 3's projector.
    let e = open_err(&GgufPaths::new(fixtures().join("gguf/qwen2-vl/tiny-qwen2-vl-f32.gguf"), gemma.mmproj.clone()));
    assert!(e.contains("mmproj-tiny-gemma3-f32.gguf") && e.contains("gemma3 vision projector"), "{e}");

    let d = tempfile::tempdir().unwrap();
    let t = renamed_key(&gemma.text, d.path(), "gemma3.embedding_length", "gemma3.embedding_lengtX");
    let e = open_err(&GgufPaths::new(t, gemma.mmproj.clone()));
    assert!(e.contains("tiny-gemma3-f32.gguf") && e.contains("gemma3.embedding_length is missing"), "{e}");
    let d = tempfile::tempdir().unwrap();
    let m = renamed_key(llava.mmproj.as_ref().unwrap(), d.path(), "clip.vision.image_grid_pinpoints", "clip.vision.image_grid_pinpointX");
    let e = open_err(&GgufPaths::new(llava.text.clone(), Some(m)));
    assert!(e.contains("mmproj-tiny-llava-next-f32.gguf") && e.contains("clip.vision.image_grid_pinpoints") && e.contains("LLaVA-1.5"), "{e}");
    let d = tempfile::tempdir().unwrap();
    let m = renamed_key(gemma.mmproj.as_ref().unwrap(), d.path(), "clip.vision.patch_size", "clip.vision.patch_sizX");
    let e = open_err(&GgufPaths::new(gemma.text.clone(), Some(m)));
    assert!(e.contains("mmproj-tiny-gemma3-f32.gguf") && e.contains("clip.vision.patch_size is missing"), "{e}");
    let d = tempfile::tempdir().unwrap();
    let t = renamed_key(&llava.text, d.path(), "tokenizer.ggml.scores", "tokenizer.ggml.scoreX");
    let e = format!("{:#}", merg::gguf::tokenizer::tokenizer_json(&GgufFile::open(&t).unwrap()).unwrap_err());
    assert!(e.contains("tiny-llava-next-f32.gguf") && e.contains("tokenizer.ggml.scores"), "{e}");
}

fn qwen2(mmproj: &Path) -> GgufPaths {
    GgufPaths::new(PathBuf::new(), Some(mmproj.to_path_buf()))
}
