//! Sharded safetensors checkpoints, memory-mapped. Every shard's header is read and checked
//! first, so a truncated file or an integer tensor fails with the file's and tensor's names
//! instead of deep inside the model.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use candle_core::quantized::GgmlDType;
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Dtype as StDtype, SafeTensors};

use super::mapped::MappedFile;
use super::{Expect, Mapped, WeightSource};

/// The tensors of a safetensors file's bytes, checked to be complete and floating point;
/// `file` names it in errors.
pub fn float_tensor_names(bytes: &[u8], file: &str) -> Result<Vec<String>> {
    let st = SafeTensors::deserialize(bytes).map_err(|e| anyhow::anyhow!("{file}: not a valid safetensors file (truncated or corrupt?): {e}"))?;
    let mut names = vec![];
    for (name, view) in st.tensors() {
        match view.dtype() {
            StDtype::F32 | StDtype::F16 | StDtype::BF16 | StDtype::F64 => names.push(name),
            other => bail!("{file}: tensor {name} has dtype {other:?}; model weights must be floating point (f32/f16/bf16)"),
        }
    }
    Ok(names)
}

/// Reads every shard's header and checks that it is complete and holds float tensors.
/// Returns tensor → file.
pub fn index_shards(files: &[PathBuf]) -> Result<HashMap<String, PathBuf>> {
    if files.is_empty() {
        bail!("no .safetensors weight files given");
    }
    let mut owner = HashMap::new();
    for f in files {
        crate::input::regular_file(f, &crate::input::WEIGHTS)?;
        let file = std::fs::File::open(f).with_context(|| format!("cannot open weights {}", f.display()))?;
        // SAFETY: read-only map of a file we do not modify; candle maps the same files the same way.
        let mmap = unsafe { memmap2::Mmap::map(&file) }.with_context(|| format!("cannot map {}", f.display()))?;
        for name in float_tensor_names(&mmap, &f.display().to_string())? {
            if let Some(prev) = owner.insert(name.clone(), f.clone()) {
                bail!("tensor {name} appears in both {} and {}", prev.display(), f.display());
            }
        }
    }
    Ok(owner)
}

pub struct SafetensorsWeights {
    mmaped: MmapedSafetensors,
    names: String,
    /// Every f32/f16/bf16 tensor where it lies in its shard's mapping.
    views: HashMap<String, Mapped>,
    /// Tensors across the shards, of any dtype.
    count: usize,
}

impl SafetensorsWeights {
    /// Validates the shards (`index_shards`), then maps them.
    pub fn open(files: &[PathBuf]) -> Result<Self> {
        index_shards(files)?;
        // SAFETY: as above, the files are mapped read-only and not modified while mapped.
        let mmaped = unsafe { MmapedSafetensors::multi(files) }.context("mapping safetensors shards")?;
        let (mut views, mut count) = (HashMap::new(), 0);
        for f in files {
            let file = std::fs::File::open(f).with_context(|| format!("cannot open weights {}", f.display()))?;
            // SAFETY: as above.
            let map = Arc::new(unsafe { MappedFile::map(file) }.with_context(|| format!("cannot map {}", f.display()))?);
            let st = SafeTensors::deserialize(&map).map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?;
            let tensors = st.tensors();
            count += tensors.len();
            for (name, view) in tensors {
                let dtype = match view.dtype() {
                    StDtype::F32 => GgmlDType::F32,
                    StDtype::F16 => GgmlDType::F16,
                    StDtype::BF16 => GgmlDType::BF16,
                    _ => continue,
                };
                let start = view.data().as_ptr() as usize - map.as_ptr() as usize;
                views.insert(name, Mapped::new(map.clone(), start, view.data().len(), dtype, view.shape().to_vec()));
            }
        }
        Ok(SafetensorsWeights { mmaped, names: super::file_names(files), views, count })
    }
}

impl WeightSource for SafetensorsWeights {
    /// The views' mappings (float tensors read from the file by the kernels' packers and
    /// embedding lookups), each file once.
    fn release_mappings(&self) {
        let mut done: Vec<*const u8> = Vec::new();
        for m in self.views.values() {
            let at = m.file_start();
            if !done.contains(&at) {
                done.push(at);
                m.release_file();
            }
        }
    }

    fn describe(&self) -> String {
        self.names.clone()
    }

    fn contains(&self, name: &str) -> bool {
        self.mmaped.get(name).is_ok()
    }

    fn tensor_count(&self) -> Option<usize> {
        Some(self.count)
    }

    fn mapped(&self, name: &str) -> Option<Mapped> {
        self.views.get(name).cloned()
    }

    fn tensor(&self, name: &str, _expect: Option<Expect>, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self.mmaped.load(name, dev)?;
        // The copy is what gets read from now on: the mapping's pages of it leave this process.
        crate::cpu::pages::release(self.mmaped.get(name)?.data());
        t.to_dtype(dtype)
    }
}
