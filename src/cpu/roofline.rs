//! The machine's own limits, measured on the threads the kernels use: memory bandwidth (a
//! STREAM triad, `a = b + s·c`, counted as 3 × 4 bytes per element as STREAM does) and the
//! f32 FMA and bf16 dot-product peaks (independent chains of `vfmadd` / `vdpbf16ps`).
//! `merg bench` reports decode against the bandwidth (bytes read per token ÷ time) and prefill
//! against the compute peak (FLOPs ÷ time), and, on a host whose bandwidth moves, each decode
//! step against triad passes run either side of it (`paired`).

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
    /// Peak of the instruction bf16 products take, GFLOP/s: `vdpbf16ps` (f32 accumulation)
    /// where they take it (`bf16::dots`), else the f32 FMA peak (they widen to f32).
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
    let mut t = Triad::new();
    (0..5).map(|_| t.pass()).fold(0f64, f64::max)
}

/// A triad's three arrays (256 MiB each, far larger than any cache), allocated and faulted in
/// once, for passes timed one at a time.
pub struct Triad {
    a: Vec<Page>,
    b: Vec<Page>,
    c: Vec<Page>,
}

/// The arrays start on page boundaries wherever malloc puts them: with blocks from the heap
/// (as after a model's load, `memory::Loading`) they were 16 bytes past one, each at another
/// offset, and the triad read 17 % lower (28.6 against 34.4 GB/s, the same process on the
/// Zen 4 VM) than with the page-aligned blocks mmap gives.
#[derive(Clone, Copy)]
#[repr(C, align(4096))]
struct Page([f32; 1024]);

fn floats(p: &[Page]) -> &[f32] {
    // SAFETY: a page is 1024 f32s with no padding.
    unsafe { std::slice::from_raw_parts(p.as_ptr() as *const f32, p.len() * 1024) }
}

fn floats_mut(p: &mut [Page]) -> &mut [f32] {
    // SAFETY: as in `floats`, borrowed mutably.
    unsafe { std::slice::from_raw_parts_mut(p.as_mut_ptr() as *mut f32, p.len() * 1024) }
}

impl Triad {
    const N: usize = 1 << 26;

    pub fn new() -> Triad {
        let pages = |v: f32| vec![Page([v; 1024]); Self::N / 1024];
        let mut t = Triad { a: pages(0.0), b: pages(1.0), c: pages(2.0) };
        // The first pass faults the pages in; it is not a measure.
        t.pass();
        t
    }

    /// One pass, GB/s.
    pub fn pass(&mut self) -> f64 {
        let chunk = Self::N / (rayon::current_num_threads() * 4);
        let s = black_box(3.0f32);
        let t = Instant::now();
        let (b, c) = (floats(&self.b), floats(&self.c));
        // On the team the products run on (the calling thread and its helpers), so that the
        // helpers still spinning after a decode step take part rather than compete.
        super::team::chunks_mut(floats_mut(&mut self.a), chunk, |i, a| {
            let (b, c) = (&b[i * chunk..][..a.len()], &c[i * chunk..][..a.len()]);
            for j in 0..a.len() {
                a[j] = b[j] + s * c[j];
            }
        });
        black_box(&self.a);
        (3 * Self::N * 4) as f64 / t.elapsed().as_secs_f64() / 1e9
    }
}

impl Default for Triad {
    fn default() -> Self {
        Self::new()
    }
}

/// Decode steps each bracketed by triad passes, so that every step is set against the
/// bandwidth of its own moment: on a shared host the triad can move by half within minutes,
/// and a share against one measured seconds earlier is then no measure.
#[derive(Clone, Debug, Serialize)]
pub struct Paired {
    pub steps: usize,
    /// Median, over the steps, of the bytes a step read per second as % of the mean of the
    /// two passes either side of it.
    pub median_pct: f64,
    /// The steps' first and third quartiles of the same share.
    pub quartile_pcts: [f64; 2],
    /// Median of the triad passes, GB/s.
    pub triad_median_gbs: f64,
    /// A cache line's round trip between two threads before the steps and after them, ns
    /// (`core_round_trip_ns`): where the host put the cores. A step of many short products
    /// pays it at every hand-over.
    pub core_round_trip_ns: [f64; 2],
}

/// Runs `steps` steps, a triad pass before the first and after each; `step(i)` does step `i`
/// and returns the bytes it read.
pub fn paired<E>(steps: usize, mut step: impl FnMut(usize) -> Result<f64, E>) -> Result<Paired, E> {
    let before = core_round_trip_ns();
    let mut triad = Triad::new();
    let mut gbs = vec![triad.pass()];
    let mut shares = Vec::with_capacity(steps);
    for i in 0..steps {
        let t = Instant::now();
        let bytes = step(i)?;
        let s = t.elapsed().as_secs_f64();
        gbs.push(triad.pass());
        shares.push(100.0 * bytes / s / 1e9 / ((gbs[i] + gbs[i + 1]) / 2.0));
    }
    let triad_median_gbs = quantile(&mut gbs, 0.5);
    Ok(Paired { steps, median_pct: quantile(&mut shares, 0.5), quartile_pcts: [quantile(&mut shares, 0.25), quantile(&mut shares, 0.75)], triad_median_gbs, core_round_trip_ns: [before, core_round_trip_ns()] })
}

/// The median round trip of one cache line between this thread and a fresh one, ns (batches
/// of 500 hand-overs; NaN with one core). On a 2-vCPU Zen 5 VM it read 46-49 ns while the
/// host kept both vCPUs on one die (triad ~43 GB/s) and 365-394 ns while it put them on two
/// (triad ~72-75 GB/s: two dies' links to memory, and every hand-over between the cores eight
/// times dearer). Waits 3 ms first, so the team's helpers (which spin up to 2 ms after a
/// job) are asleep and leave the fresh thread a core.
pub fn core_round_trip_ns() -> f64 {
    use std::sync::atomic::{AtomicU64, Ordering::{Acquire, Release}};
    const BATCH: u64 = 500;
    if std::thread::available_parallelism().map_or(1, |n| n.get()) < 2 {
        return f64::NAN;
    }
    std::thread::sleep(std::time::Duration::from_millis(3));
    // Spins, yielding now and then: two threads that land on one core still get through.
    let wait = |line: &AtomicU64, value: u64| {
        let mut spins = 0u32;
        while line.load(Acquire) != value {
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(4096) {
                std::thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
    };
    let line = AtomicU64::new(0);
    let batches = 9;
    let mut times = std::thread::scope(|s| {
        s.spawn(|| {
            for i in 0..batches * BATCH {
                wait(&line, 2 * i + 1);
                line.store(2 * i + 2, Release);
            }
        });
        (0..batches)
            .map(|b| {
                let t = Instant::now();
                for i in b * BATCH..(b + 1) * BATCH {
                    line.store(2 * i + 1, Release);
                    wait(&line, 2 * i + 2);
                }
                t.elapsed().as_secs_f64() * 1e9 / BATCH as f64
            })
            .collect::<Vec<f64>>()
    });
    quantile(&mut times, 0.5)
}

/// The `q`-quantile of `v` (nearest rank); NaN when empty.
fn quantile(v: &mut [f64], q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n => v[((n - 1) as f64 * q).round() as usize],
    }
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
        if bf16 && super::bf16::dots() {
            // SAFETY: `dots()` means avx512f and avx512bf16 at the dispatch level.
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_by_nearest_rank() {
        let mut v = [5.0, 1.0, 4.0, 2.0, 3.0];
        assert_eq!([0.0, 0.25, 0.5, 0.75, 1.0].map(|q| quantile(&mut v, q)), [1.0, 2.0, 3.0, 4.0, 5.0]);
        assert!(quantile(&mut [], 0.5).is_nan());
    }

    /// Every step runs once, in order, between passes; an error stops the run and comes back.
    /// The arrays start on pages, wherever malloc put them.
    #[test]
    fn paired_steps_run_in_order_between_passes() {
        let t = Triad::new();
        assert!([&t.a, &t.b, &t.c].iter().all(|v| (v.as_ptr() as usize).is_multiple_of(4096)));
        drop(t);
        let mut seen = vec![];
        let p = paired(3, |i| -> Result<f64, ()> {
            seen.push(i);
            Ok(1e6)
        })
        .unwrap();
        assert_eq!((seen, p.steps), (vec![0, 1, 2], 3));
        assert!(p.triad_median_gbs > 0.0 && p.median_pct > 0.0 && p.quartile_pcts[0] <= p.median_pct && p.median_pct <= p.quartile_pcts[1], "{p:?}");
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        assert!(p.core_round_trip_ns.iter().all(|&ns| if cores > 1 { ns > 0.0 && ns.is_finite() } else { ns.is_nan() }), "{p:?}");
        let mut runs = 0;
        assert_eq!(paired(3, |i| if i == 1 { Err("step 1") } else { runs += 1; Ok(1.0) }).unwrap_err(), "step 1");
        assert_eq!(runs, 1);
    }
}
