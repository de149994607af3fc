//! Reductions over one logits row for the host sampler: the largest value and its first place,
//! whether every value is finite, and a sum of exponentials. A row is a vocabulary long
//! (151,936 values for Qwen2), and the sampler walked it value by value with `f64` `exp` once
//! for the log-sum-exp and once more for a temperature's normaliser: 0.57-0.70 ms a greedy
//! token and 1.5 ms a top-p one on the 2-core Zen 5 box (`benches/sampling.rs`), a tenth to a
//! fifth of a 0.5B model's whole decode step. Here the scans run sixteen lanes at a time (plain Rust the
//! compiler vectorizes at any level) and the exponentials through `elementwise::exp_sub_sum`.

/// Lanes of the vectorized scans.
const LANES: usize = 16;
/// Values whose exponentials are summed in `f32` before the running `f64` sum takes them.
const RUN: usize = 256;

/// Values past which `max_index` splits the row across the thread team.
const TEAM_MIN: usize = 1 << 15;

/// The first place of the row's largest value, and that value (NaNs never win; an empty row
/// or one of NaNs only gives place 0 and −∞). A vocabulary-long row is scanned by every thread
/// of the team, each over its share (the halves the output head's product wrote on each core,
/// so each reads its own cache), and the shares' winners compared in order.
pub fn max_index(v: &[f32]) -> (usize, f32) {
    let threads = rayon::current_num_threads();
    if v.len() < TEAM_MIN || threads < 2 {
        return max_index_in(v);
    }
    let grain = v.len().div_ceil(threads * 4);
    let wins: Vec<std::sync::atomic::AtomicU64> = (0..v.len().div_ceil(grain)).map(|_| std::sync::atomic::AtomicU64::new(0)).collect();
    super::team::split(v.len(), grain, &|a, b| {
        let (at, max) = max_index_in(&v[a..b]);
        wins[a / grain].store((max.to_bits() as u64) << 32 | at as u64, std::sync::atomic::Ordering::Relaxed);
    });
    // The first share whose winner is the row's largest value (a share of NaNs only names a
    // place that does not hold its −∞, and never wins).
    let wins: Vec<(usize, f32)> = wins.iter().enumerate().map(|(c, w)| {
        let w = w.load(std::sync::atomic::Ordering::Relaxed);
        (c * grain + (w & 0xffff_ffff) as usize, f32::from_bits((w >> 32) as u32))
    }).collect();
    let max = wins.iter().fold(f32::NEG_INFINITY, |m, &(_, x)| if x > m { x } else { m });
    wins.into_iter().find(|&(at, x)| x == max && v[at] == max).unwrap_or((0, max))
}

/// `max_index` of a slice on this thread.
fn max_index_in(v: &[f32]) -> (usize, f32) {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = v.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &x) in lanes.iter_mut().zip(c) {
            *m = if x > *m { x } else { *m };
        }
    }
    let max = lanes.iter().chain(tail).fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m });
    // The first run of 256 holding it, then the place within (a run's compares have no early
    // exit, so they vectorize).
    let at = v.chunks(RUN).position(|c| c.iter().fold(0u32, |hits, &x| hits | (x == max) as u32) != 0);
    let place = at.map_or(0, |i| i * RUN + v[i * RUN..].iter().position(|&x| x == max).unwrap_or(0));
    (place, max)
}

/// Whether every value is finite (no NaN, no ±∞).
pub fn all_finite(v: &[f32]) -> bool {
    // `x · 0` is ±0 for a finite x and NaN otherwise; NaN survives the sums (lane-wise, so they
    // vectorize).
    let mut lanes = [0f32; LANES];
    let chunks = v.chunks_exact(LANES);
    let tail = chunks.remainder();
    for c in chunks {
        for (s, &x) in lanes.iter_mut().zip(c) {
            *s += x * 0.0;
        }
    }
    lanes.iter().chain(tail.iter()).all(|&x| x * 0.0 == 0.0)
}

/// `Σ e^(v[i]·scale − sub)`: each argument rounded to `f32` as `x * scale - sub` is, its
/// exponential within 4 ulp of libm's (`exp_sub_sum`), runs of 256 summed in `f32` and the
/// runs in `f64`.
pub fn sum_exp(v: &[f32], scale: f32, sub: f32) -> f64 {
    let mut buf = [0f32; RUN];
    v.chunks(RUN)
        .map(|c| {
            let b = &mut buf[..c.len()];
            for (o, &x) in b.iter_mut().zip(c) {
                *o = x * scale - sub;
            }
            super::elementwise::exp_sub_sum(b, 0.0) as f64
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    /// Against the scalar definitions, on rows off the lane and run sizes, with the maximum
    /// repeated (the first place wins), at the tail, and with −∞ entries (a masked row).
    #[test]
    fn reductions_match_the_scalar_definitions() {
        let mut rng = StdRng::seed_from_u64(11);
        for len in [1, 15, 16, 17, 255, 256, 257, 4099, 151_936] {
            let mut v: Vec<f32> = (0..len).map(|_| rng.random::<f32>() * 30.0 - 20.0).collect();
            for i in (3..len).step_by(7) {
                v[i] = f32::NEG_INFINITY;
            }
            for (case, at) in [("inside", len / 3), ("last", len - 1)] {
                let mut v = v.clone();
                v[at] = 50.0;
                if at + 5 < len {
                    v[at + 5] = 50.0;
                }
                assert_eq!(max_index(&v), (at, 50.0), "len {len}, max {case}");
            }
            let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            for scale in [1.0, 1.0 / 0.7] {
                let want: f64 = v.iter().map(|&x| ((x * scale - max * scale) as f64).exp()).sum();
                let got = sum_exp(&v, scale, max * scale);
                assert!((got - want).abs() <= 1e-6 * want, "len {len}, scale {scale}: {got} vs {want}");
            }
            assert_eq!(all_finite(&v), len <= 3, "len {len}: −∞ at every 7th place from 3");
        }
        assert!(all_finite(&[1.0, -3.5, f32::MAX, f32::MIN_POSITIVE]));
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut v = vec![0.5f32; 300];
            v[299] = bad;
            assert!(!all_finite(&v), "{bad}");
        }
        assert_eq!(max_index(&[]), (0, f32::NEG_INFINITY));
        assert_eq!(max_index(&[f32::NAN, 2.0, f32::NAN, 3.0]), (3, 3.0));
    }

    /// A row split across the team gives the one-thread scan's answer: the largest value's
    /// first place when it repeats in several shares, in the last share, a row of −∞, and a row
    /// whose first shares are NaN only with a lone −∞ far on.
    #[test]
    fn a_row_split_across_the_team_gives_the_one_thread_answer() {
        let len = 151_936;
        let mut rng = StdRng::seed_from_u64(12);
        let v: Vec<f32> = (0..len).map(|_| rng.random::<f32>() * 30.0 - 20.0).collect();
        let mut cases = vec![];
        let mut twice = v.clone();
        (twice[len - 100], twice[len / 2 + 3], twice[1000]) = (60.0, 60.0, 59.0);
        cases.push(("repeated", twice));
        let mut last = v.clone();
        last[len - 1] = 70.0;
        cases.push(("last", last));
        cases.push(("all −∞", vec![f32::NEG_INFINITY; len]));
        let mut nans = vec![f32::NAN; len];
        nans[len - 7] = f32::NEG_INFINITY;
        cases.push(("NaN then −∞", nans));
        for (what, v) in cases {
            let (want, got) = (max_index_in(&v), max_index(&v));
            assert_eq!(got.0, want.0, "{what}: place");
            assert_eq!(got.1.to_bits(), want.1.to_bits(), "{what}: value");
        }
        assert_eq!(max_index(&vec![f32::NAN; len]), (0, f32::NEG_INFINITY));
    }
}
