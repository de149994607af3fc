//! Helpers shared by the integration tests: fixture paths and golden loading.
#![allow(dead_code)]

pub mod cli;
pub mod gguf;
pub mod omni;

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{Device, Tensor};

/// The fixtures folder; `MERG_FIXTURES_DIR` overrides it for a test binary run away from its
/// build tree (scripts/gpu-check.sh carries the binaries to a GPU machine).
pub fn fixtures() -> PathBuf {
    match std::env::var_os("MERG_FIXTURES_DIR") {
        Some(dir) => PathBuf::from(dir),
        None => Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures"),
    }
}

/// The device the parity tests load models on: the CPU, or `MERG_TEST_DEVICE=cuda` (`cuda:N`)
/// on a build with the `cuda` feature, where the same goldens check the device path. Opened as
/// `--device` opens it.
pub fn test_device() -> Device {
    match std::env::var("MERG_TEST_DEVICE").as_deref() {
        Err(_) | Ok("") => Device::Cpu,
        Ok(d) => merg::checkpoint::parse_device(d).unwrap_or_else(|e| panic!("MERG_TEST_DEVICE={d}: {e:#}")),
    }
}

/// Checkpoint directory of a tiny fixture model, by family (`model_type`).
pub fn tiny_dir(family: &str) -> PathBuf {
    fixtures().join(match family {
        "qwen2_vl" => "tiny-qwen2-vl",
        "qwen2_5_vl" => "tiny-qwen2_5-vl",
        "qwen3_vl" => "tiny-qwen3-vl",
        "qwen3_vl_moe" => "tiny-qwen3-vl-moe",
        "qwen3_5" => "tiny-qwen3_5",
        "llava_next" => "tiny-llava-next",
        "gemma3" => "tiny-gemma3",
        "qwen2_5_omni" => "tiny-qwen2_5-omni",
        other => panic!("unknown family {other}"),
    })
}

pub fn golden(family: &str, case: &str) -> (HashMap<String, Tensor>, serde_json::Value) {
    let base = fixtures().join("goldens").join(family);
    let tensors = candle_core::safetensors::load(base.join(format!("{case}.safetensors")), &Device::Cpu).unwrap();
    let meta = serde_json::from_str(&std::fs::read_to_string(base.join(format!("{case}.json"))).unwrap()).unwrap();
    (tensors, meta)
}

pub fn ids_i64(t: &Tensor) -> Vec<i64> {
    t.flatten_all().unwrap().to_vec1::<i64>().unwrap()
}

pub fn grids(t: Option<&Tensor>) -> Vec<[usize; 3]> {
    match t {
        None => vec![],
        Some(t) => t.to_vec2::<i64>().unwrap().iter().map(|r| [r[0] as usize, r[1] as usize, r[2] as usize]).collect(),
    }
}

/// max |a - b| / max |b|: error relative to the golden's scale.
pub fn max_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let a = &a.to_device(b.device()).unwrap();
    let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    let scale = b.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    diff / scale.max(1e-12)
}

/// ||a - b||₂ / ||b||₂ over all entries: the typical error, where `max_rel_err` is the worst.
pub fn fro_rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let a = &a.to_device(b.device()).unwrap();
    let d = (a - b).unwrap().sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt();
    d / b.sqr().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap().sqrt().max(1e-12)
}

/// Writes at `dst` a copy of GGUF file `src` with its F32 matrices stored as BF16 and
/// `general.file_type` set to llama.cpp's MOSTLY_BF16 (32), as `convert_hf_to_gguf.py
/// --outtype bf16` lays a file out: norms and biases stay F32.
pub fn bf16_gguf(src: &Path, dst: &Path) {
    use candle_core::quantized::{gguf_file, GgmlDType, QTensor};
    let f = merg::gguf::GgufFile::open(src).unwrap();
    let mut meta: Vec<(String, gguf_file::Value)> = f.header.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    meta.retain(|(k, _)| k != "general.file_type" && k != "general.alignment");
    meta.push(("general.file_type".into(), gguf_file::Value::U32(32)));
    let tensors: Vec<(String, QTensor)> = f
        .header
        .order
        .iter()
        .map(|name| {
            let q = f.qtensor(name, &Device::Cpu).unwrap();
            match q.dtype() == GgmlDType::F32 && q.shape().rank() >= 2 {
                true => (name.clone(), QTensor::quantize(&q.dequantize(&Device::Cpu).unwrap(), GgmlDType::BF16).unwrap()),
                false => (name.clone(), q),
            }
        })
        .collect();
    let meta_refs: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let mut out = std::fs::File::create(dst).unwrap();
    gguf_file::write(&mut out, &meta_refs, &tensor_refs).unwrap();
}

/// The GGUF file `src` rewritten in memory: its metadata passed through `edit`, its tensors
/// (in name order) followed by `extra`. For tests that need a file llama.cpp's converter
/// would not write (another architecture, stray tensors).
pub fn rewritten_gguf(
    src: &Path,
    edit: impl Fn(&str, &mut candle_core::quantized::gguf_file::Value),
    extra: Vec<(String, candle_core::quantized::QTensor)>,
) -> Vec<u8> {
    use candle_core::quantized::gguf_file;
    let mut f = std::fs::File::open(src).unwrap();
    let content = gguf_file::Content::read(&mut f).unwrap();
    let mut meta: Vec<(String, gguf_file::Value)> = content.metadata.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    for (k, v) in meta.iter_mut() {
        edit(k, v);
    }
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut tensors: Vec<(String, candle_core::quantized::QTensor)> = names.iter().map(|n| ((*n).clone(), content.tensor(&mut f, n, &Device::Cpu).unwrap())).collect();
    tensors.extend(extra);
    let meta_refs: Vec<(&str, &gguf_file::Value)> = meta.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let tensor_refs: Vec<(&str, &candle_core::quantized::QTensor)> = tensors.iter().map(|(k, t)| (k.as_str(), t)).collect();
    let mut out = std::io::Cursor::new(Vec::new());
    gguf_file::write(&mut out, &meta_refs, &tensor_refs).unwrap();
    out.into_inner()
}
