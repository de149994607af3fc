//! The dense panel kernels (`merg::cpu::bf16`, `merg::cpu::fp32`) on a 3B model's MLP width
//! ([11008, 2048]) at decode (1 row) and prefill sizes (64, 256, 512 rows): GFLOP/s, best of
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

const N: usize = 11008;
const K: usize = 2048;

fn best_gflops(m: usize, reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut best = f64::MAX;
    for _ in 0..reps {
        let t = Instant::now();
        f();
        best = best.min(t.elapsed().as_secs_f64());
    }
    2.0 * (m * N * K) as f64 / best / 1e9
}

fn main() {
    let roof = merg::cpu::roofline::measure();
    println!("peaks on {} threads ({} kernels): f32 {:.0} GFLOP/s, bf16 {:.0} GFLOP/s", roof.threads, merg::cpu::level().name(), roof.f32_gflops, roof.bf16_gflops);
    let mut rng = StdRng::seed_from_u64(7);
    let w: Vec<f32> = (0..N * K).map(|_| rng.random_range(-0.05..0.05)).collect();
    let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
    let xs: Vec<f32> = (0..512 * K).map(|_| rng.random_range(-1.0..1.0)).collect();
    let xb: Vec<bf16> = xs.iter().map(|&v| bf16::from_f32(v)).collect();
    let wt = candle_core::Tensor::from_slice(&w, (N, K), &candle_core::Device::Cpu).expect("w");
    // `cargo test` runs this once unoptimised (no `--bench`): the small sizes show it works.
    let sizes: &[usize] = if std::env::args().any(|a| a == "--bench") { &[1, 64, 256, 512] } else { &[1, 16] };
    for &m in sizes {
        let reps = if m == 1 { 50 } else { 5 };
        let mut out = vec![0f32; m * N];
        match merg::cpu::bf16::available() {
            true => {
                let p = PackedBf16::pack(&wb, N, K);
                let g = best_gflops(m, reps, || p.matmul(&xb[..m * K], m, &mut out));
                println!("bf16 panels m={m:>3}: {g:7.1} GFLOP/s, {:5.1} % of the bf16 peak", 100.0 * g / roof.bf16_gflops);
            }
            false => println!("bf16 panels: not at this level"),
        }
        match merg::cpu::fp32::available() {
            true => {
                let p = PackedF32::pack(&w, N, K);
                let g = best_gflops(m, reps, || p.matmul(&xs[..m * K], m, &mut out));
                println!("f32 panels  m={m:>3}: {g:7.1} GFLOP/s, {:5.1} % of the f32 peak", 100.0 * g / roof.f32_gflops);
            }
            false => println!("f32 panels: not at this level"),
        }
        let g = if m == 1 {
            best_gflops(m, reps, || merg::cpu::matvec::matvec_bf16(&xb[..K], 1, K, &wb, N, &mut out, merg::cpu::level()))
        } else {
            let x = candle_core::Tensor::from_slice(&xs[..m * K], (m, K), &candle_core::Device::Cpu).expect("x");
            best_gflops(m, reps, || drop(x.matmul(&wt.t().expect("t")).expect("matmul")))
        };
        let (what, peak) = if m == 1 { ("bf16 matvec", roof.bf16_gflops) } else { ("candle f32 ", roof.f32_gflops) };
        println!("{what} m={m:>3}: {g:7.1} GFLOP/s, {:5.1} % of the peak", 100.0 * g / peak);
    }
}
