//! Weights: memory-mapped (sharded) safetensors, validated before use, or random "dummy"
//! weights of any real config for benchmarks (like vLLM's `--load-format dummy`).

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};
use safetensors::tensor::{Dtype as StDtype, SafeTensors};

/// Reads every shard's header and checks that it is complete and holds float tensors, so a bad
/// file fails here with its name instead of deep inside the model. Returns tensor → file.
pub fn index_shards(files: &[PathBuf]) -> Result<HashMap<String, PathBuf>> {
    if files.is_empty() {
        bail!("no .safetensors weight files given");
    }
    let mut owner = HashMap::new();
    for f in files {
        let file = std::fs::File::open(f).with_context(|| format!("cannot open weights {}", f.display()))?;
        // SAFETY: read-only map of a file we do not modify; candle maps the same files the same way.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("cannot map {}", f.display()))?;
        let st = SafeTensors::deserialize(&mmap)
            .map_err(|e| anyhow::anyhow!("{}: not a valid safetensors file (truncated or corrupt?): {e}", f.display()))?;
        for (name, view) in st.tensors() {
            match view.dtype() {
                StDtype::F32 | StDtype::F16 | StDtype::BF16 | StDtype::F64 => {}
                other => bail!(
                    "{}: tensor {name} has dtype {other:?}; model weights must be floating point (f32/f16/bf16)",
                    f.display()
                ),
            }
            if let Some(prev) = owner.insert(name.clone(), f.clone()) {
                bail!("tensor {name} appears in both {} and {}", prev.display(), f.display());
            }
        }
    }
    Ok(owner)
}

/// A `VarBuilder` over memory-mapped shards, after `index_shards` validation.
pub fn mmap_var_builder(files: &[PathBuf], dtype: DType, device: &Device) -> Result<VarBuilder<'static>> {
    index_shards(files)?;
    // SAFETY: as above, the files are mapped read-only and not modified while mapped.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(files, dtype, device) }
        .context("mapping safetensors shards")?;
    Ok(vb)
}

/// Random weights with the right shapes and no files: `std` normal for matrices, ones for norm
/// scales, zeros for biases — enough for throughput work and shape checks, meaningless output.
pub struct DummyWeights {
    pub std: f64,
}

impl SimpleBackend for DummyWeights {
    fn get(&self, s: Shape, name: &str, h: Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = match h {
            Init::Const(c) => Tensor::ones(s, DType::F32, dev)?.affine(c, 0.)?,
            _ if name.ends_with("bias") => Tensor::zeros(s, DType::F32, dev)?,
            _ => Tensor::randn(0f32, self.std as f32, s, dev)?,
        };
        t.to_dtype(dtype)
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> candle_core::Result<Tensor> {
        candle_core::bail!("dummy weights need a shape for {name}")
    }

    fn contains_tensor(&self, _name: &str) -> bool {
        // Answering "no" for the transformers-5 names keeps the hub layout.
        false
    }
}

pub fn dummy_var_builder(dtype: DType, device: &Device) -> VarBuilder<'static> {
    let backend: Box<dyn SimpleBackend> = Box::new(DummyWeights { std: 0.02 });
    VarBuilder::from_backend(backend, dtype, device.clone())
}

/// Parses a user-facing dtype name.
pub fn parse_dtype(name: &str) -> Result<DType> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "f32" | "float32" => DType::F32,
        "f16" | "float16" | "half" => DType::F16,
        "bf16" | "bfloat16" => DType::BF16,
        other => bail!("unknown dtype {other:?}: use f32, f16 or bf16"),
    })
}

/// Default compute dtype: bf16 on CUDA (what the checkpoints ship), f32 on CPU (candle's CPU
/// kernels are fastest and exact there).
pub fn default_dtype(device: &Device) -> DType {
    if device.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    }
}

pub fn file_names(files: &[PathBuf]) -> String {
    files.iter().map(|f| f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()).collect::<Vec<_>>().join(", ")
}
