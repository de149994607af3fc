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
            _ => Tensor::from_vec(seeded_normal(name_seed(name), shape.elem_count(), self.std as f32), shape, &Device::Cpu)?.to_device(dev)?,
        };
        t.to_dtype(dtype)
    }
}

/// A seed from a tensor's name (FNV-1a), so a dummy model is the same on every run.
fn name_seed(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| (h ^ b as u64).wrapping_mul(0x0100_0000_01b3))
}

/// `n` normal values of standard deviation `std`, the same for a seed on any number of threads:
/// chunks of 64K values, each from its own generator seeded by (seed, chunk), on all threads
/// (Box–Muller, both values of each pair). candle's CPU `randn` cannot be seeded.
fn seeded_normal(seed: u64, n: usize, std: f32) -> Vec<f32> {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    use rayon::prelude::*;
    const CHUNK: usize = 1 << 16;
    let mut out = vec![0f32; n];
    out.par_chunks_mut(CHUNK).enumerate().for_each(|(c, dst)| {
        let mut rng = StdRng::seed_from_u64(seed ^ (c as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15));
        for pair in dst.chunks_mut(2) {
            let (u, v): (f32, f32) = (rng.random_range(f32::EPSILON..1.0), rng.random());
            let (r, a) = (std * (-2.0 * u.ln()).sqrt(), std::f32::consts::TAU * v);
            pair[0] = r * a.cos();
            if let Some(x) = pair.get_mut(1) {
                *x = r * a.sin();
            }
        }
    });
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dummy tensor is the same on every run (by its name), differs between names, and has
    /// the asked spread.
    #[test]
    fn dummy_weights_are_seeded_by_name() -> candle_core::Result<()> {
        let w = DummyWeights::new(0.02);
        let shape = candle_core::Shape::from((300, 700));
        let get = |name: &str| w.tensor(name, Some(Expect { shape: &shape, init: candle_nn::init::DEFAULT_KAIMING_NORMAL }), DType::F32, &Device::Cpu);
        let (a, b, c) = (get("layers.0.mlp.up_proj.weight")?, get("layers.0.mlp.up_proj.weight")?, get("layers.1.mlp.up_proj.weight")?);
        assert_eq!(a.flatten_all()?.to_vec1::<f32>()?, b.flatten_all()?.to_vec1::<f32>()?);
        assert_ne!(a.flatten_all()?.to_vec1::<f32>()?, c.flatten_all()?.to_vec1::<f32>()?);
        let sd = a.sqr()?.mean_all()?.to_scalar::<f32>()?.sqrt();
        assert!((sd - 0.02).abs() < 0.001, "std {sd}");
        Ok(())
    }
}
