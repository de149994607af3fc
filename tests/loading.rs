//! Bad checkpoints and prompts fail with errors that name the file/tensor and the problem.

mod common;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use common::*;
use merg::models::qwen2_vl::Config as ModelConfig;
use merg::generate::{generate, SamplingParams};
use merg::generate::VisionInput;
use merg::models::qwen2_vl;

/// Copies a tiny checkpoint into a temp dir so a test can damage it.
fn scratch_copy(family: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dst = tmp.path().join("ckpt");
    std::fs::create_dir(&dst).unwrap();
    for e in std::fs::read_dir(tiny_dir(family)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    (tmp, dst)
}

fn shards(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    v.sort();
    v
}

fn load_err(dir: &Path) -> String {
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    match qwen2_vl::load(&cfg, &shards(dir), DType::F32, &Device::Cpu) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn truncated_shard_is_named() {
    let (_t, dir) = scratch_copy("qwen2_vl");
    let shard = dir.join("model-00002-of-00002.safetensors");
    let bytes = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("model-00002-of-00002.safetensors") && e.contains("truncated"), "{e}");
}

#[test]
fn integer_weights_are_rejected_with_tensor_name() {
    let (_t, dir) = scratch_copy("qwen2_vl");
    let shard = dir.join("model-00002-of-00002.safetensors");
    let mut ts: HashMap<String, Tensor> = candle_core::safetensors::load(&shard, &Device::Cpu).unwrap();
    let name = ts.keys().next().unwrap().clone();
    let t = ts[&name].to_dtype(DType::I64).unwrap();
    ts.insert(name.clone(), t);
    candle_core::safetensors::save(&ts, &shard).unwrap();
    let e = load_err(&dir);
    assert!(e.contains(&name) && e.contains("I64"), "{e}");
}

#[test]
fn shape_mismatch_names_tensor_and_both_shapes() {
    let (_t, dir) = scratch_copy("qwen2_5_vl");
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).unwrap().replace("\"intermediate_size\": 128", "\"intermediate_size\": 96");
    std::fs::write(&cfg_path, text).unwrap();
    let e = load_err(&dir);
    assert!(e.contains("mlp.gate_proj.weight") && e.contains("[96, 64]") && e.contains("[128, 64]"), "{e}");
}

#[test]
fn unknown_model_type_names_the_file() {
    let (_t, dir) = scratch_copy("qwen2_vl");
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).unwrap().replace("\"model_type\": \"qwen2_vl\"", "\"model_type\": \"llava\"");
    std::fs::write(&cfg_path, text).unwrap();
    let files = merg::hub::resolve(dir.to_str().unwrap(), None).unwrap();
    let e = format!("{:#}", merg::checkpoint::Checkpoint::load(files, &Device::Cpu, None).err().expect("llava is not registered"));
    // Names the file, the unknown type, and what is supported.
    assert!(e.contains("config.json") && e.contains("llava") && e.contains("qwen2_vl, qwen2_5_vl"), "{e}");
}

#[test]
fn prompt_longer_than_context_is_an_error() {
    let dir = tiny_dir("qwen2_vl");
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let model = qwen2_vl::load(&cfg, &shards(&dir), DType::F32, &Device::Cpu).unwrap();
    let ids = vec![5u32; 40];
    let e = generate(&model, &ids, &VisionInput::default(), &SamplingParams::default(), Some(32)).unwrap_err();
    let e = format!("{e:#}");
    assert!(e.contains("40 tokens") && e.contains("context window is 32"), "{e}");
}

#[test]
fn shipped_model_configs_parse() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("models");
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "json") {
            let cfg = merg::models::registry::read_config(&p).unwrap();
            merg::models::registry::spec(&cfg).unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
            merg::models::param_counts(&cfg).unwrap_or_else(|e| panic!("{}: {e:#}", p.display()));
            n += 1;
        }
    }
    assert!(n >= 5);
}

#[test]
fn dummy_weights_run_a_forward() {
    let cfg = ModelConfig::from_file(&tiny_dir("qwen2_5_vl").join("config.json")).unwrap();
    let model = qwen2_vl::dummy(&cfg, DType::F32, &Device::Cpu).unwrap();
    let g = generate(&model, &[1, 2, 3], &VisionInput::default(), &SamplingParams { max_new_tokens: 4, ..Default::default() }, None).unwrap();
    assert_eq!(g.tokens.len(), 4);
    assert!(g.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0));
}

/// Parameter counts from the config alone equal the tensors in the checkpoint, for every
/// family (the planner and `merg info` rely on them).
#[test]
fn param_counts_from_config_equal_the_checkpoint() {
    for family in ["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5"] {
        let dir = common::tiny_dir(family);
        if !dir.exists() {
            continue;
        }
        let cfg = merg::models::registry::read_config(&dir.join("config.json")).unwrap();
        let counts = merg::models::param_counts(&cfg).unwrap();
        let mut in_files = 0u64;
        for e in std::fs::read_dir(&dir).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "safetensors") {
                let bytes = std::fs::read(&p).unwrap();
                let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
                for (name, t) in st.tensors() {
                    if !name.starts_with("mtp.") {
                        in_files += t.shape().iter().product::<usize>() as u64;
                    }
                }
            }
        }
        assert_eq!(counts.total(), in_files, "{family}: {counts:?}");
    }
}
