//! GGUF fixture paths and comparisons shared by the GGUF tests.

use std::path::{Path, PathBuf};

use candle_core::Tensor;
use merg::gguf::GgufPaths;

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
