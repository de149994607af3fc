//! GGUF fixture paths and comparisons shared by the GGUF tests.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use merg::gguf::{GgufFile, GgufPaths};
use merg::weights::{Expect, SafetensorsWeights, WeightSource};

/// The `kind` text file of a fixture folder (`f32`, `q8_0`, …) with its f32 projector.
pub fn gguf(dir: &str, kind: &str) -> GgufPaths {
    let base = super::fixtures().join("gguf").join(dir);
    GgufPaths::new(base.join(format!("tiny-{dir}-{kind}.gguf")), Some(base.join(format!("mmproj-tiny-{dir}-f32.gguf"))))
}

/// A checkpoint's safetensors shards, in name order.
pub fn shards(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.extension().is_some_and(|e| e == "safetensors")).collect();
    v.sort();
    v
}

/// Largest absolute difference of two tensors of one shape.
pub fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap().to_scalar::<f32>().unwrap()
}

/// The safetensors checkpoint with the tensors the converter stores in f16 rounded to f16
/// (Gemma 3's input projection, LLaVA's patch embedding and projector matrices, Qwen2.5-Omni's
/// audio convolutions: the converters write these in f16 even for F32 files).
pub struct RoundedToF16 {
    pub inner: SafetensorsWeights,
    pub names: HashSet<String>,
}

impl WeightSource for RoundedToF16 {
    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn tensor(&self, name: &str, expect: Option<Expect>, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self.inner.tensor(name, expect, DType::F32, dev)?;
        let t = if self.names.contains(name) { t.to_dtype(DType::F16)?.to_dtype(DType::F32)? } else { t };
        t.to_dtype(dtype)
    }
}

/// The hub names whose GGUF tensor is stored in f16.
pub fn stored_f16(names: &[String], paths: &GgufPaths) -> HashSet<String> {
    let files = [GgufFile::open(&paths.text).unwrap(), GgufFile::open(paths.mmproj.as_ref().unwrap()).unwrap()];
    let g = merg::gguf::open(paths).unwrap().weights;
    names
        .iter()
        .filter(|n| {
            let Some(stored) = g.stored_name(n) else { return false };
            stored.split(" + ").any(|s| files.iter().any(|f| f.info(s).is_some_and(|t| t.dtype == GgmlDType::F16)))
        })
        .cloned()
        .collect()
}

/// A copy of `src` in `dir` with the metadata key `from` renamed to `to` (same length, so the
/// file stays well formed and the key is simply absent).
pub fn renamed_key(src: &Path, dir: &Path, from: &str, to: &str) -> PathBuf {
    assert_eq!(from.len(), to.len());
    let mut b = std::fs::read(src).unwrap();
    let mut key = (from.len() as u64).to_le_bytes().to_vec();
    key.extend(from.as_bytes());
    let at = b.windows(key.len()).position(|w| w == key.as_slice()).expect("key in header") + 8;
    b[at..at + to.len()].copy_from_slice(to.as_bytes());
    let out = dir.join(src.file_name().unwrap());
    std::fs::write(&out, b).unwrap();
    out
}
