//! What the library's unit tests share: seeded random tensors, so a test whose bound depends
//! on the draw gives the same verdict on every run (candle's CPU `randn` cannot be seeded).

use candle_core::{Device, Result, Shape, Tensor};
use rand::{rngs::StdRng, Rng, SeedableRng};

/// Normal values of standard deviation `std` (Box–Muller over a seeded generator).
pub fn randn(seed: u64, shape: impl Into<Shape>, std: f32) -> Result<Tensor> {
    let shape = shape.into();
    let mut rng = StdRng::seed_from_u64(seed);
    let values: Vec<f32> = (0..shape.elem_count())
        .map(|_| {
            let (u, v): (f32, f32) = (rng.random_range(f32::EPSILON..1.0), rng.random());
            std * (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos()
        })
        .collect();
    Tensor::from_vec(values, shape, &Device::Cpu)
}
