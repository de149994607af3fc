//! The machine's own limits, measured on the threads the kernels use: memory bandwidth (a
//! STREAM triad, `a = b + s·c`, counted as 3 × 4 bytes per element as STREAM does) and the
//! f32 FMA and bf16 dot-product peaks (independent chains of `vfmadd` / `vdpbf16ps`).
//! `merg bench` reports decode against the bandwidth (bytes read per token ÷ time) and prefill
//! against the compute peak (FLOPs ÷ time).

use std::hint::black_box;
use std::time::Instant;

use rayon::prelude::*;
use serde::Serialize;

use super::Level;

#[derive(Clone, Copy, Debug, Serialize)]
pub struct Roofline {
    pub threads: usize,
    /// STREAM triad, GB/s (10⁹ bytes).
    pub bandwidth_gbs: f64,
    /// f32 fused multiply-add peak, GFLOP/s.
    pub f32_gflops: f64,
    /// bf16 dot-product peak (f32 accumulation), GFLOP/s; the f32 peak where the machine has
    /// no bf16 dot instruction.
    pub bf16_gflops: f64,
}

/// Measures the three figures (about a second).
pub fn measure() -> Roofline {
    let threads = rayon::current_num_threads();
    Roofline { threads, bandwidth_gbs: bandwidth_gbs(), f32_gflops: peak_gflops(false), bf16_gflops: peak_gflops(true) }
}

/// Best of several triad passes over arrays far larger than the caches, GB/s (768 MiB held
/// while it runs).
pub fn bandwidth_gbs() -> f64 {
    const N: usize = 1 << 26; // 64 Mi elements, 256 MiB per array
    let b = vec![1.0f32; N];
    let c = vec![2.0f32; N];
    let mut a = vec![0.0f32; N];
    let chunk = N / (rayon::current_num_threads() * 4);
    let mut best = f64::MAX;
    for pass in 0..6 {
        let s = black_box(3.0f32);
        let t = Instant::now();
        a.par_chunks_mut(chunk).zip(b.par_chunks(chunk)).zip(c.par_chunks(chunk)).for_each(|((a, b), c)| {
            for i in 0..a.len() {
                a[i] = b[i] + s * c[i];
            }
        });
        black_box(&a);
        // The first pass faults the pages in.
        if pass > 0 {
            best = best.min(t.elapsed().as_secs_f64());
        }
    }
    (3 * N * 4) as f64 / best / 1e9
}

/// FLOPs per second of independent FMA (or bf16 dot) chains on every thread.
fn peak_gflops(bf16: bool) -> f64 {
    let iters = 4_000_000usize;
    let threads = rayon::current_num_threads();
    let level = super::level();
    let run = || -> f64 {
        let t = Instant::now();
        let flops: f64 = (0..threads).into_par_iter().map(|_| chains(iters, bf16, level)).sum();
        flops / t.elapsed().as_secs_f64() / 1e9
    };
    run(); // warm up (frequency ramp)
    (0..3).map(|_| run()).fold(0f64, f64::max)
}

/// Runs `iters` rounds of 12 independent chains; returns the FLOPs done.
fn chains(iters: usize, bf16: bool, level: Level) -> f64 {
    #[cfg(target_arch = "x86_64")]
    {
        if level == Level::Avx512 && bf16 && std::is_x86_feature_detected!("avx512bf16") {
            // SAFETY: avx512f and avx512bf16 detected.
            return unsafe { x86::dpbf16(iters) };
        }
        if level == Level::Avx512 {
            // SAFETY: avx512f detected (Level::Avx512).
            return unsafe { x86::fma512(iters) };
        }
        if level == Level::Avx2 {
            // SAFETY: avx2 and fma detected (Level::Avx2).
            return unsafe { x86::fma256(iters) };
        }
    }
    let _ = (bf16, level);
    let mut acc = [1.0f32; 12];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = a.mul_add(0.999_999, 1e-7);
        }
    }
    black_box(acc);
    (iters * 12 * 2) as f64
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;
    use std::hint::black_box;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma512(iters: usize) -> f64 {
        let m = _mm512_set1_ps(0.999_999);
        let c = _mm512_set1_ps(1e-7);
        let mut acc = [_mm512_set1_ps(1.0); 12];
        for _ in 0..iters {
            for a in acc.iter_mut() {
                *a = _mm512_fmadd_ps(*a, m, c);
            }
        }
        black_box(acc);
        (iters * 12 * 16 * 2) as f64
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma256(iters: usize) -> f64 {
        let m = _mm256_set1_ps(0.999_999);
        let c = _mm256_set1_ps(1e-7);
        let mut acc = [_mm256_set1_ps(1.0); 12];
        for _ in 0..iters {
            for a in acc.iter_mut() {
                *a = _mm256_fmadd_ps(*a, m, c);
            }
        }
        black_box(acc);
        (iters * 12 * 8 * 2) as f64
    }

    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn dpbf16(iters: usize) -> f64 {
        let a = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3), _mm512_set1_ps(1e-3));
        let b = _mm512_cvtne2ps_pbh(_mm512_set1_ps(1e-3), _mm512_set1_ps(1e-3));
        let mut acc = [_mm512_setzero_ps(); 12];
        for _ in 0..iters {
            for s in acc.iter_mut() {
                *s = _mm512_dpbf16_ps(*s, a, b);
            }
        }
        black_box(acc);
        // 32 products and 32 sums into 16 lanes per instruction.
        (iters * 12 * 64) as f64
    }
}
