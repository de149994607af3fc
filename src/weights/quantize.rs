//! In-situ quantization: a float weight source whose linear weights come out in llama.cpp's
//! block formats (through candle's quantized tensors and kernels), quantized one tensor at a
//! time as the model loads, so peak memory stays near the quantized size. Embeddings, norms,
//! biases and every non-linear tensor stay as they are; the vision tower only on request.

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;

use anyhow::Result;
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};

use super::ledger::is_vision;
use super::{Expect, Mapped, WeightSource};

/// A quantization type, named as llama.cpp names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quant {
    Q8_0,
    Q6K,
    Q5K,
    Q4K,
}

impl Quant {
    pub const ALL: [Quant; 4] = [Quant::Q8_0, Quant::Q6K, Quant::Q5K, Quant::Q4K];

    pub fn parse(s: &str) -> Result<Quant> {
        Ok(match s.to_ascii_lowercase().replace('_', "").as_str() {
            "q80" => Quant::Q8_0,
            "q6k" => Quant::Q6K,
            "q5k" => Quant::Q5K,
            "q4k" => Quant::Q4K,
            _ => return Err(crate::setting::InvalidSetting::new("quant", s, "q8_0, q6k, q5k or q4k").into()),
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            Quant::Q8_0 => "q8_0",
            Quant::Q6K => "q6k",
            Quant::Q5K => "q5k",
            Quant::Q4K => "q4k",
        }
    }

    pub fn ggml(self) -> GgmlDType {
        match self {
            Quant::Q8_0 => GgmlDType::Q8_0,
            Quant::Q6K => GgmlDType::Q6K,
            Quant::Q5K => GgmlDType::Q5K,
            Quant::Q4K => GgmlDType::Q4K,
        }
    }

    /// Bits per weight of the block format (scales included).
    pub fn bits_per_weight(self) -> f64 {
        let g = self.ggml();
        (g.type_size() * 8) as f64 / g.block_size() as f64
    }
}

/// How many linear weights were quantized, kept dense, and their bytes.
#[derive(Default, Debug)]
pub struct QuantStats {
    pub quantized: AtomicUsize,
    /// Rows too short for the format's blocks, quantized as q8_0 instead (llama.cpp's fallback).
    pub fallback_q8_0: AtomicUsize,
    /// Rows too short even for q8_0's 32-weight blocks, or vision weights: left dense.
    pub dense: AtomicUsize,
    pub quantized_bytes: AtomicU64,
}

pub struct QuantizingSource {
    inner: Arc<dyn WeightSource>,
    quant: Quant,
    vision: bool,
    pub stats: Arc<QuantStats>,
}

impl QuantizingSource {
    pub fn new(inner: Arc<dyn WeightSource>, quant: Quant, vision: bool) -> Self {
        QuantizingSource { inner, quant, vision, stats: Arc::default() }
    }

    /// The format a weight whose rows hold `in_dim` values gets, if any.
    fn format_for(&self, in_dim: usize) -> Option<GgmlDType> {
        let want = self.quant.ggml();
        if in_dim.is_multiple_of(want.block_size()) {
            Some(want)
        } else if in_dim.is_multiple_of(GgmlDType::Q8_0.block_size()) {
            self.stats.fallback_q8_0.fetch_add(1, Ordering::Relaxed);
            Some(GgmlDType::Q8_0)
        } else {
            None
        }
    }
}


impl WeightSource for QuantizingSource {
    fn release_mappings(&self) {
        self.inner.release_mappings()
    }

    fn describe(&self) -> String {
        format!("{} (quantized to {} while loading)", self.inner.describe(), self.quant.name())
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn tensor_count(&self) -> Option<usize> {
        self.inner.tensor_count()
    }

    fn stored_name(&self, name: &str) -> Option<String> {
        self.inner.stored_name(name)
    }

    fn tensor(&self, name: &str, expect: Option<Expect>, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        self.inner.tensor(name, expect, dtype, dev)
    }

    fn quantized(&self, name: &str, expect: Option<Expect>, dev: &Device) -> Option<candle_core::Result<Arc<QTensor>>> {
        if let Some(q) = self.inner.quantized(name, expect, dev) {
            return Some(q);
        }
        let in_dim = expect.and_then(|e| e.shape.dims().last().copied());
        let format = match in_dim {
            Some(d) if self.vision || !is_vision(name) => self.format_for(d),
            _ => None,
        };
        let Some(format) = format else {
            self.stats.dense.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        // From the file a band of rows at a time where the source maps it as stored; else one
        // f32 copy of this tensor at a time, on the host, where candle quantizes.
        let stored = self.inner.mapped(name).filter(|m| m.is_float() && m.dims.len() == 2 && expect.is_none_or(|e| e.shape.dims() == m.dims));
        let q = match stored {
            Some(m) => m.quantize(format, dev),
            None => self.inner.tensor(name, expect, DType::F32, &Device::Cpu).and_then(|t| super::mapped::quantize_tensor(&t, format, dev)),
        };
        Some(self.count(q))
    }

    /// Only weights already in blocks pass through as stored; float ones get quantized.
    fn mapped(&self, name: &str) -> Option<Mapped> {
        self.inner.mapped(name).filter(|m| !m.is_float())
    }

    /// Lookups read the stored table whatever its type (only linear weights are quantized).
    fn rows(&self, name: &str) -> Option<Mapped> {
        self.inner.rows(name)
    }

    fn quantize_derived(&self, name: &str, weight: &Tensor, dev: &Device) -> Option<candle_core::Result<Arc<QTensor>>> {
        let in_dim = *weight.dims().last()?;
        let format = match self.vision || !is_vision(name) {
            true => self.format_for(in_dim),
            false => None,
        };
        let Some(format) = format else {
            self.stats.dense.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let q = super::mapped::quantize_tensor(weight, format, dev);
        Some(self.count(q))
    }
}

impl QuantizingSource {
    fn count(&self, q: candle_core::Result<QTensor>) -> candle_core::Result<Arc<QTensor>> {
        if let Ok(q) = &q {
            self.stats.quantized.fetch_add(1, Ordering::Relaxed);
            self.stats.quantized_bytes.fetch_add(q.storage_size_in_bytes() as u64, Ordering::Relaxed);
        }
        q.map(Arc::new)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_like_llama_cpp() {
        for q in Quant::ALL {
            assert_eq!(Quant::parse(q.name()).unwrap(), q);
        }
        assert_eq!(Quant::parse("Q4_K").unwrap(), Quant::Q4K);
        assert!(Quant::parse("iq2_xxs").unwrap_err().to_string().contains("iq2_xxs"));
        assert!((Quant::Q8_0.bits_per_weight() - 8.5).abs() < 1e-9);
        assert!((Quant::Q4K.bits_per_weight() - 4.5).abs() < 1e-9);
    }
}
