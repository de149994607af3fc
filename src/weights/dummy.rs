//! Random weights with the right shapes and no files (like vLLM's `--load-format dummy`):
//! `std` normal for matrices, ones for norm scales, zeros for biases — enough for throughput
//! work and shape checks, meaningless output.

use candle_core::{DType, Device, Tensor};
use candle_nn::Init;

use super::{Expect, WeightSource};

/// Each tensor is checked against the memory the device has free at that moment before it
/// is made, so an absurd config is an error, not an abort (and tensors a quantizing source
/// frees again never count twice).
pub struct DummyWeights {
    pub std: f64,
}

impl DummyWeights {
    pub fn new(std: f64) -> Self {
        DummyWeights { std }
    }
}

impl WeightSource for DummyWeights {
    fn describe(&self) -> String {
        "dummy weights".into()
    }

    fn contains(&self, _name: &str) -> bool {
        // Answering "no" for the transformers-5 names keeps the hub layout.
        false
    }

    fn tensor(&self, name: &str, expect: Option<Expect>, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let Some(Expect { shape, init }) = expect else {
            candle_core::bail!("dummy weights need a shape for {name}")
        };
        // f32 first, then the target dtype: both exist for a moment.
        let bytes = (shape.elem_count() as u64).saturating_mul(4 + dtype.size_in_bytes() as u64);
        let avail = crate::memory::available_memory(dev).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
        if bytes > avail {
            candle_core::bail!(
                "dummy weights need more than the {:.1} GiB available on the device (at tensor {name} {shape:?}); the config's sizes are too large for this machine",
                avail as f64 / (1u64 << 30) as f64
            )
        }
        let t = match init {
            Init::Const(c) => Tensor::ones(shape, DType::F32, dev)?.affine(c, 0.)?,
            _ if name.ends_with("bias") => Tensor::zeros(shape, DType::F32, dev)?,
            _ => Tensor::randn(0f32, self.std as f32, shape, dev)?,
        };
        t.to_dtype(dtype)
    }
}
