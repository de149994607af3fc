//! Qwen2.5-Omni from llama.cpp's files (scripts/make_gguf_fixtures.py `--only omni`): the
//! pinned converter writes the tiny checkpoint's thinker as a `qwen2vl` text file and one
//! `qwen2.5o` projector holding the vision tower and the audio tower. merg reads the pair as
//! the `qwen2_5_omni` family: every thinker tensor comes back (the audio convolutions as the
//! f16 the converter stores them in), the config equals the checkpoint's, and the text, audio
//! and image + audio goldens give the safetensors model's audio features and logits; the Q8_0
//! text file holds the in-situ Q8_0 blocks; mismatched or incomplete files fail by name.

mod common;

use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use common::gguf::{gguf, max_diff, renamed_key, shards, stored_f16, RoundedToF16};
use common::omni::{greedy, logits_after, prepare};
use common::{golden, ids_i64, tiny_dir};
use merg::generate::forward_logits;
use merg::gguf::GgufPaths;
use merg::models::{DenseCache, Model};
use merg::weights::{index_shards, Quant, QuantizingSource, SafetensorsWeights, WeightSource, Weights};

const FAMILY: &str = "qwen2_5_omni";
const DIR: &str = "qwen2_5-omni";
const CASES: [&str; 3] = ["text", "audio", "image_audio"];

/// The tiny checkpoint's config as llama.cpp's files describe the model: the vision window is
/// not recorded and llama.cpp (like merg reading the files) takes the released 112 pixels; the
/// tiny checkpoint's 56 is set to it here.
fn reference_config() -> serde_json::Value {
    let mut c = merg::models::registry::read_config(&tiny_dir(FAMILY).join("config.json")).unwrap();
    let v = &mut c["thinker_config"]["vision_config"];
    assert_eq!(v["window_size"].as_u64(), Some(56));
    v["window_size"] = 112.into();
    c
}

/// The thinker's tensors in the checkpoint (talker and token2wav aside, and the audio
/// tower's `audio_bos_eos_token`, which transformers never uses and the converter drops).
fn thinker_names() -> Vec<String> {
    let mut names: Vec<String> = index_shards(&shards(&tiny_dir(FAMILY))).unwrap().into_keys().filter(|n| n.starts_with("thinker.") && !n.contains("audio_bos_eos_token")).collect();
    names.sort();
    names
}

/// The safetensors thinker with the tensors the converter stored in f16 rounded to f16.
fn reference_model(paths: &GgufPaths) -> Arc<dyn Model> {
    let source = RoundedToF16 { names: stored_f16(&thinker_names(), paths), inner: SafetensorsWeights::open(&shards(&tiny_dir(FAMILY))).unwrap() };
    merg::models::load(&reference_config(), Weights::new(Arc::new(source), DType::F32, &Device::Cpu)).unwrap()
}

fn gguf_model(paths: &GgufPaths) -> Arc<dyn Model> {
    let o = merg::gguf::open(paths).unwrap();
    merg::models::load(&o.config, Weights::new(Arc::new(o.weights), DType::F32, &Device::Cpu)).unwrap()
}

fn scale(t: &Tensor) -> f32 {
    t.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}

/// Every thinker tensor comes back from the F32 files: bit for bit, except the two audio
/// convolution kernels, which the converter writes in f16 at every output type (they equal the
/// checkpoint's rounded to f16); talker and token2wav are not in the files.
#[test]
fn f32_gguf_holds_the_thinker() {
    let paths = gguf(DIR, "f32");
    let st = SafetensorsWeights::open(&shards(&tiny_dir(FAMILY))).unwrap();
    let g = merg::gguf::open(&paths).unwrap().weights;
    let names = thinker_names();
    let f16 = stored_f16(&names, &paths);
    let mut audio = 0;
    for name in &names {
        let a = st.tensor(name, None, DType::F32, &Device::Cpu).unwrap();
        let b = g.tensor(name, None, DType::F32, &Device::Cpu).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(a.shape(), b.shape(), "{name}");
        let a = if f16.contains(name) { a.to_dtype(DType::F16).unwrap().to_dtype(DType::F32).unwrap() } else { a };
        assert_eq!(max_diff(&a, &b), 0.0, "{name} ({})", g.stored_name(name).unwrap());
        audio += name.contains("audio_tower") as usize;
    }
    let mut f16: Vec<_> = f16.into_iter().collect();
    f16.sort();
    eprintln!("{} thinker tensors equal ({audio} of the audio tower); stored in f16 by the converter: {f16:?}", names.len());
    assert_eq!(f16, ["thinker.audio_tower.conv1.weight", "thinker.audio_tower.conv2.weight"]);
    assert_eq!(audio, 2 * 2 + 2 * 15 + 4, "convolutions, two layers, ln_post and proj");
    let index = std::fs::read_to_string(tiny_dir(FAMILY).join("model.safetensors.index.json")).unwrap();
    let talker = index.split('"').find(|s| s.starts_with("talker.") && s.ends_with(".weight")).unwrap();
    assert!(!g.contains(talker) && !g.contains("token2wav.code2wav_dit_model.time_embed.time_mlp.0.weight"), "{talker}");
}

/// The config built from the files' metadata parses to the checkpoint's thinker (with the
/// vision window llama.cpp assumes), and counts the same parameters in the text model, vision
/// tower and audio tower; `merg plan`'s load cost holds both towers at 4 bytes a value.
#[test]
fn gguf_config_is_the_checkpoints() {
    use merg::models::qwen2_5_omni::Config;
    let paths = gguf(DIR, "f32");
    let opened = merg::gguf::open(&paths).unwrap();
    let (ours, hub) = (Config::from_value(&opened.config).unwrap(), Config::from_value(&reference_config()).unwrap());
    let mut want = serde_json::to_value(&hub).unwrap();
    // The one field the files cannot carry: the checkpoint's declared dtype.
    want["vl"]["torch_dtype"] = serde_json::Value::Null;
    assert_eq!(serde_json::to_value(&ours).unwrap(), want);
    let (p, q) = (merg::models::registry::param_counts(&opened.config).unwrap(), merg::models::registry::param_counts(&reference_config()).unwrap());
    assert_eq!(p, q);
    assert!(p.audio > 0 && p.vision > 0);
    assert_eq!(merg::models::registry::spec(&opened.config).unwrap().model_type, FAMILY);
    let cost = opened.weights.load_cost(4.0, false);
    let embd = merg::gguf::GgufFile::open(&paths.text).unwrap().info("token_embd.weight").unwrap().len as u64;
    assert_eq!((cost.text_bytes, cost.vision_bytes), ((p.text_linear + p.text_other) * 4 - embd, (p.vision + p.audio) * 4));
}

/// The GGUF model and the safetensors model (f16 rounding where the converter stored f16) on
/// the goldens' own inputs (the processor's log-mel features, patches and grids): the same
/// audio features, TMRoPE positions and logits for text, audio and image + audio.
#[test]
fn f32_gguf_is_the_safetensors_model() {
    let paths = gguf(DIR, "f32");
    let (hub, ours) = (reference_model(&paths), gguf_model(&paths));
    for case in CASES {
        let (g, _) = golden(FAMILY, case);
        let ids: Vec<u32> = ids_i64(&g["input_ids"]).iter().map(|&x| x as u32).collect();
        let ((pa, aa), (pb, ab)) = (prepare(&*hub, &ids, &g).unwrap(), prepare(&*ours, &ids, &g).unwrap());
        assert_eq!(aa.len(), ab.len(), "{case}: clips");
        for (a, b) in aa.iter().zip(&ab) {
            let d = max_diff(a, b);
            eprintln!("{FAMILY}/{case}: audio features {:?}, GGUF vs safetensors max |Δ| {d:e} (scale {:.2})", a.dims(), scale(a));
            assert!(d <= 1e-5 * scale(a).max(1.0), "{case}: audio features differ by {d}");
        }
        assert_eq!(pa.positions, pb.positions, "{case}: TMRoPE positions");
        let (la, lb) = (forward_logits(&*hub, &pa, &mut DenseCache::new(), ids.len()).unwrap(), forward_logits(&*ours, &pb, &mut DenseCache::new(), ids.len()).unwrap());
        let d = max_diff(&la, &lb);
        eprintln!("{FAMILY}/{case}: {} tokens, {} clips, GGUF vs safetensors max |Δlogit| {d:e} (scale {:.2})", ids.len(), aa.len(), scale(&la));
        assert!(d <= 1e-5 * scale(&la).max(1.0), "{case}: GGUF F32 logits differ by {d}");
    }
}

/// The tokenizer rebuilt from `tokenizer.ggml.*` encodes every golden's rendered prompt (audio,
/// image and video markers, turns) and plain text as the checkpoint's tokenizer.json does, and
/// the file carries the checkpoint's chat template.
#[test]
fn tokenizer_and_template_from_gguf_metadata_equal_the_checkpoints() {
    let f = merg::gguf::GgufFile::open(&gguf(DIR, "f32").text).unwrap();
    let ours: tokenizers::Tokenizer = merg::gguf::tokenizer::tokenizer_json(&f).unwrap().parse().unwrap();
    let hf = tokenizers::Tokenizer::from_file(tiny_dir(FAMILY).join("tokenizer.json")).unwrap();
    let mut texts: Vec<String> = ["text", "audio", "image_audio", "video", "video_audio"].iter().map(|c| golden(FAMILY, c).1["prompt_text"].as_str().unwrap().to_string()).collect();
    texts.extend(["Hello world!  It's 2024-11-23, isn't it?", "naïve café — \u{1F600} emojis\n\n\tand tabs", "   leading spaces and 12345 numbers"].map(String::from));
    for t in &texts {
        let (a, b) = (ours.encode(t.as_str(), false).unwrap(), hf.encode(t.as_str(), false).unwrap());
        assert_eq!(a.get_ids(), b.get_ids(), "{t:?}");
        assert_eq!(ours.decode(a.get_ids(), false).unwrap(), hf.decode(b.get_ids(), false).unwrap(), "decode {t:?}");
    }
    assert_eq!(ours.get_vocab_size(true), hf.get_vocab_size(true));
    let file: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(tiny_dir(FAMILY).join("chat_template.json")).unwrap()).unwrap();
    assert_eq!(merg::gguf::tokenizer::chat_template(&f).as_deref(), file["chat_template"].as_str());
}

/// `Checkpoint::load_gguf` builds what `Checkpoint::load` builds from the hub checkpoint: where
/// both load, a text chat and a chat with an image give the same prompt ids and pixels and the
/// reference model's logits; where the hub checkpoint is refused (merg's chat tokenizer has not
/// learned Omni's `<|vision_bos|>` / `<|IMAGE|>` names yet), the GGUF files are refused for the
/// same reason.
#[test]
fn gguf_checkpoint_loads_as_the_hub_checkpoint_does() {
    use merg::chat::{ContentPart, Message};
    use merg::checkpoint::LoadOptions;
    let paths = gguf(DIR, "f32");
    let ours = merg::Checkpoint::load_gguf(&paths, &Device::Cpu, &LoadOptions::default());
    let hub = merg::Checkpoint::load(merg::hub::resolve(tiny_dir(FAMILY).to_str().unwrap(), None).unwrap(), &Device::Cpu, Some(DType::F32));
    let (ours, hub) = match (ours, hub) {
        (Ok(o), Ok(h)) => (o, h),
        (o, h) => panic!("GGUF load {:?}, hub load {:?}", o.err().map(|e| format!("{e:#}")), h.err().map(|e| format!("{e:#}"))),
    };
    assert!(ours.processor.hears() && hub.processor.hears(), "both processors take audio");
    let reference = reference_model(&paths);
    let photo = merg::vision::Media::Image(image::open(common::fixtures().join("media/img_a.png")).unwrap().to_rgb8());
    let text = [Message::text("user", "How was your day? I hope it went well.")];
    let with_image = [Message::new("user", vec![ContentPart::Image, ContentPart::Text("How does she feel?".into())])];
    for (messages, media) in [(&text[..], vec![]), (&with_image[..], vec![photo])] {
        let (ids, vis) = merg::generate::reference_inputs(&ours.processor, messages, &media, &Device::Cpu).unwrap();
        let (hub_ids, hub_vis) = merg::generate::reference_inputs(&hub.processor, messages, &media, &Device::Cpu).unwrap();
        assert_eq!(ids, hub_ids, "prompt ids");
        assert_eq!(vis.image_patches.is_some(), !media.is_empty());
        if let (Some(a), Some(b)) = (&vis.image_patches, &hub_vis.image_patches) {
            assert_eq!(max_diff(a, b), 0.0, "image patches");
        }
        let logits = |m: &dyn Model| {
            let p = merg::generate::prepare(m, &ids, &vis).unwrap();
            forward_logits(m, &p, &mut DenseCache::new(), ids.len()).unwrap()
        };
        let (la, lb) = (logits(&*reference), logits(&*ours.model));
        let d = max_diff(&la, &lb);
        eprintln!("{FAMILY} chat, {} media: {} tokens, max |Δlogit| {d:e} (scale {:.2})", media.len(), ids.len(), scale(&la));
        assert!(d <= 1e-5 * scale(&la).max(1.0), "GGUF checkpoint logits differ by {d}");
    }
}

/// The Q8_0 text file holds the blocks merg's in-situ Q8_0 makes of the same weights, and with
/// the F32 projector runs the audio golden with the F32 file's audio features (the towers are
/// in the projector, untouched) and keeps the F32 file's greedy text for 16 tokens, or parts
/// where F32 itself nearly ties.
#[test]
fn q8_0_gguf_holds_the_in_situ_blocks() {
    let files = shards(&tiny_dir(FAMILY));
    let insitu = QuantizingSource::new(Arc::new(SafetensorsWeights::open(&files).unwrap()), Quant::Q8_0, false);
    let g = merg::gguf::open(&gguf(DIR, "q8_0")).unwrap().weights;
    let mut compared = 0;
    for name in thinker_names().iter().filter(|n| n.starts_with("thinker.model.") && n.ends_with("proj.weight")) {
        let q = g.quantized(name, None, &Device::Cpu).unwrap_or_else(|| panic!("{name} is not stored in blocks")).unwrap();
        let shape = q.shape().clone();
        let expect = merg::weights::Expect { shape: &shape, init: candle_nn::init::ZERO };
        let ours = insitu.quantized(name, Some(expect), &Device::Cpu).unwrap().unwrap();
        assert_eq!(q.dtype(), ours.dtype(), "{name}");
        assert!(q.data().unwrap() == ours.data().unwrap(), "{name}: Q8_0 blocks differ");
        compared += 1;
    }
    eprintln!("{compared} linear weights, identical Q8_0 blocks");
    assert_eq!(compared, 3 * 7, "q/k/v/o and gate/up/down of three layers");

    let (f, q) = (gguf_model(&gguf(DIR, "f32")), gguf_model(&gguf(DIR, "q8_0")));
    let (gold, _) = golden(FAMILY, "audio");
    let ids: Vec<u32> = ids_i64(&gold["input_ids"]).iter().map(|&x| x as u32).collect();
    let ((pf, af), (pq, aq)) = (prepare(&*f, &ids, &gold).unwrap(), prepare(&*q, &ids, &gold).unwrap());
    assert_eq!(max_diff(&af[0], &aq[0]), 0.0, "audio features");
    let (a, b) = (greedy(&*f, &pf, ids.len(), 16), greedy(&*q, &pq, ids.len(), 16));
    let same = a.iter().zip(&b).take_while(|(x, y)| x == y).count();
    if same == 16 {
        eprintln!("{FAMILY}/audio: the Q8_0 text file follows F32 for all 16 greedy tokens");
        return;
    }
    // Parted: only where F32 itself nearly ties (its margin within the logit noise Q8_0 adds:
    // random tiny models have nearly flat logits, and Q8_0 moves them by several percent).
    let (lf, lq) = (logits_after(&*f, &pf, ids.len(), &a[..same]), logits_after(&*q, &pq, ids.len(), &a[..same]));
    let noise = lf.iter().zip(&lq).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
    let margin = lf[a[same] as usize] - lf[b[same] as usize];
    eprintln!("{FAMILY}/audio: the Q8_0 text file follows F32 for {same} of 16 greedy tokens; there the F32 margin is {margin:.4}, the Q8_0 logit noise {noise:.4}");
    assert!(margin >= 0.0 && margin <= 2.0 * noise, "parted at token {same} with an F32 margin {margin} beyond the Q8_0 noise {noise}");
}

fn open_err(paths: &GgufPaths) -> String {
    format!("{:#}", merg::gguf::open(paths).err().expect("must fail"))
}

/// The Omni projector beside another family's text file, another projector beside Omni's text
/// file, and a projector without the audio fields fail naming the files and the cause.
#[test]
fn mismatched_and_incomplete_files_are_named() {
    let omni = gguf(DIR, "f32");
    let vl = gguf("qwen2_5-vl", "f32");
    let qwen3 = gguf("qwen3-vl", "f32");
    let mm = omni.mmproj.clone();
    let e = open_err(&GgufPaths::new(vl.text.clone(), mm.clone()));
    assert!(e.contains("tiny-qwen2_5-vl-f32.gguf") && e.contains("<|AUDIO|>") && e.contains("mmproj-tiny-qwen2_5-omni-f32.gguf") && e.contains("Qwen2.5-Omni's text model"), "{e}");
    let e = open_err(&GgufPaths::new(qwen3.text.clone(), mm.clone()));
    assert!(e.contains("qwen2.5o") && e.contains("qwen3vl model") && e.contains("another model"), "{e}");
    let e = open_err(&GgufPaths::new(omni.text.clone(), vl.mmproj.clone()));
    assert!(e.contains("tiny-qwen2_5-omni-f32.gguf") && e.contains("<|image_pad|>"), "{e}");
    let gemma = gguf("gemma3", "f32");
    let e = open_err(&GgufPaths::new(gemma.text.clone(), mm.clone()));
    assert!(e.contains("a qwen2.5o vision projector") && e.contains("another model"), "{e}");
    for (key, to) in [("clip.audio.block_count", "clip.audio.block_counX"), ("clip.audio.num_mel_bins", "clip.audio.num_mel_binX"), ("clip.has_audio_encoder", "clip.has_audio_encodeX")] {
        let d = tempfile::tempdir().unwrap();
        let m = renamed_key(mm.as_ref().unwrap(), d.path(), key, to);
        let e = open_err(&GgufPaths::new(omni.text.clone(), Some(m)));
        assert!(e.contains("mmproj-tiny-qwen2_5-omni-f32.gguf") && e.contains(key), "{key}: {e}");
    }
}

/// `merg info` and `merg plan` on the Q8_0 text file (its projector found beside it) name the
/// family and format, count the audio tower, and plan both towers' weights as what loading
/// holds (vision + audio at the default bf16, the sinusoid table the model computes left out).
#[test]
fn info_and_plan_read_the_omni_files() {
    let q8 = gguf(DIR, "q8_0");
    let run = |args: &[&str]| {
        let o = std::process::Command::new(env!("CARGO_BIN_EXE_merg")).args(args).env("HF_HUB_OFFLINE", "1").output().unwrap();
        assert!(o.status.success(), "{args:?}: {}", String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stdout).into_owned()
    };
    let model = q8.text.to_str().unwrap();
    let info = run(&["info", "--model", model]);
    assert!(info.contains("family:    qwen2_5_omni") && info.contains("format:    q8_0") && info.contains("+ audio ") && info.contains("talker and token2wav"), "{info}");
    let plan: serde_json::Value = serde_json::from_str(&run(&["plan", "--model", model, "--memory", "1GiB", "--json"])).unwrap();
    let opened = merg::gguf::open(&q8).unwrap();
    let p = merg::models::registry::param_counts(&opened.config).unwrap();
    assert_eq!(plan["vision_weight_bytes"].as_u64(), Some((p.vision + p.audio) * 2), "{plan}");
    assert_eq!(plan["params"]["audio"].as_u64(), Some(p.audio), "{plan}");
}
