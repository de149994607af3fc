//! Random weights with the right shapes and no files (like vLLM's `--load-format dummy`):
//! `std` normal for matrices, ones for norm scales, zeros for biases — enough for throughput
//! work and shape checks, meaningless output.

use candle_core::{DType, Device, Tensor};
use candle_nn::Init;

use super::{Expect, WeightSource};

pub struct DummyWeights {
    pub std: f64,
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
        let t = match init {
            Init::Const(c) => Tensor::ones(shape, DType::F32, dev)?.affine(c, 0.)?,
            _ if name.ends_with("bias") => Tensor::zeros(shape, DType::F32, dev)?,
            _ => Tensor::randn(0f32, self.std as f32, shape, dev)?,
        };
        t.to_dtype(dtype)
    }
}
