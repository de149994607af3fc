//! The dense panel kernels (`merg::cpu::bf16`, `merg::cpu::fp32`) on a 3B model's MLP weights
//! (up [11008, 2048] and down [2048, 11008]: a down panel of 16 rows is 704 KiB of f32, more
//! than many cores' L2) at decode (1 row) and prefill sizes (64, 256, 512 rows): GFLOP/s, best of
//! several runs, and the share of the machine's own bf16 / f32 peak (`cpu::roofline`), in one
//! run. A kernel only its level runs is skipped, with a line saying so. Beside them, what runs
//! without the panels: the unpacked bf16 decode (`matvec_bf16`) and candle's f32 GEMM (a
//! prefill with f32 weights below AVX-512, and with bf16 ones widened to f32 before the AVX2
//! bf16 panels existed).

use std::time::Instant;

use half::bf16;
use merg::cpu::bf16::PackedBf16;
use merg::cpu::fp32::PackedF32;
use rand::{rngs::StdRng, Rng, SeedableRng};

/// `[n, k]` of the weights measured: the MLP's up and down projections.
const SHAPES: [(usize, usize); 2] = [(11008, 2048), (2048, 11008)];

fn best_gflops(m: usize, (n, k): (usize, usize), reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (m * n * k) as f64 / best / 1e9
}

fn main() {
    let roof = merg::cpu::roofline::measure();
    println!("peaks on {} threads ({} kernels): f32 {:.0} GFLOP/s, bf16 {:.0} GFLOP/s", roof.threads, merg::cpu::level().name(), roof.f32_gflops, roof.bf16_gflops);
    // `cargo test` runs this once unoptimised (no `--bench`): the small sizes show it works.
    let sizes: &[usize] = if std::env::args().any(|a| a == "--bench") { &[1, 64, 256, 512] } else { &[1, 16] };
    for shape in SHAPES {
        println!("weight [{}, {}]", shape.0, shape.1);
        measure_shape(shape, sizes, &roof);
    }
}

fn measure_shape((n, k): (usize, usize), sizes: &[usize], roof: &merg::cpu::roofline::Roofline) {
    let mut rng = StdRng::seed_from_u64(7);
    let w: Vec<f32> = (0..n * k).map(|_| rng.random_range(-0.05..0.05)).collect();
    let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    let m_max = sizes.iter().copied().max().unwrap_or(1);
    let xs: Vec<f32> = (0..m_max * k).map(|_| rng.random_range(-1.0..1.0)).collect();
    let xb: Vec<bf16> = xs.iter().map(|&v| bf16::from_f32(v)).collect();
    let wt = candle_core::Tensor::from_slice(&w, (n, k), &candle_core::Device::Cpu).expect("w");
    let pb = merg::cpu::bf16::available().then(|| PackedBf16::pack(&wb, n, k));
    let pf = merg::cpu::fp32::available().then(|| PackedF32::pack(&w, n, k));
    for &m in sizes {
        let reps = if m == 1 { 50 } else { 5 };
        let mut out = vec![0f32; m * n];
        match &pb {
            Some(p) => {
                let g = best_gflops(m, (n, k), reps, || p.matmul(&xb[..m * k], m, &mut out));
                println!("bf16 panels m={m:>3}: {g:7.1} GFLOP/s, {:5.1} % of the bf16 peak", 100.0 * g / roof.bf16_gflops);
            }
            None => println!("bf16 panels: not at this level"),
        }
        match &pf {
            Some(p) => {
                let g = best_gflops(m, (n, k), reps, || p.matmul(&xs[..m * k], m, &mut out));
                println!("f32 panels  m={m:>3}: {g:7.1} GFLOP/s, {:5.1} % of the f32 peak", 100.0 * g / roof.f32_gflops);
            }
            None => println!("f32 panels: not at this level"),
        }
        let g = if m == 1 {
            best_gflops(m, (n, k), reps, || merg::cpu::matvec::matvec_bf16(&xb[..k], 1, k, &wb, n, &mut out, merg::cpu::level()))
        } else {
            let x = candle_core::Tensor::from_slice(&xs[..m * k], (m, k), &candle_core::Device::Cpu).expect("x");
            best_gflops(m, (n, k), reps, || drop(x.matmul(&wt.t().expect("t")).expect("matmul")))
        };
        let (what, peak) = if m == 1 { ("bf16 matvec", roof.bf16_gflops) } else { ("candle f32 ", roof.f32_gflops) };
        println!("{what} m={m:>3}: {g:7.1} GFLOP/s, {:5.1} % of the peak", 100.0 * g / peak);
    }
}
