//! The elementwise steps between a layer's products — residual add, `silu(gate) · up` — on
//! one thread. At decode they are a few thousand values each: candle's versions run bf16 on
//! the rayon pool (waking its sleeping workers, ~16 µs for an add of 896 values on the 2-core
//! box, against 0.3 µs here) and take `exp` one value at a time.
//!
//! Rounding is the reference's: bf16 values are widened, computed in f32 and rounded to
//! nearest-even once per torch op (`silu` rounds, then the product rounds), as transformers'
//! bf16 modules do; f32 `silu` uses a vector `exp` within 4 ulp of the scalar one. (The
//! AVX-512 conversion reads f32 subnormals as zero.)

use half::bf16;

use super::Level;

/// `out = a + b`.
pub fn add_f32(a: &[f32], b: &[f32], out: &mut [f32]) {
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = x + y;
    }
}

/// `out = bf16(a + b)`.
pub fn add_bf16(a: &[bf16], b: &[bf16], out: &mut [bf16]) {
    #[cfg(target_arch = "x86_64")]
    if bf16_vectors() {
        // SAFETY: avx512f and avx512bf16 detected (and allowed by the dispatch level).
        unsafe { avx512::add_bf16(a, b, out) };
        return;
    }
    for ((o, x), y) in out.iter_mut().zip(a).zip(b) {
        *o = bf16::from_f32(x.to_f32() + y.to_f32());
    }
}

/// `out = bf16(x)`, rounding to nearest-even.
pub fn to_bf16(x: &[f32], out: &mut [bf16]) {
    #[cfg(target_arch = "x86_64")]
    if bf16_vectors() {
        // SAFETY: avx512f and avx512bf16 detected (and allowed by the dispatch level).
        unsafe { avx512::to_bf16(x, out) };
        return;
    }
    for (o, v) in out.iter_mut().zip(x) {
        *o = bf16::from_f32(*v);
    }
}

/// `x[r] += bias` for every row `r` of `bias.len()` values.
pub fn add_rows(x: &mut [f32], bias: &[f32]) {
    for row in x.chunks_exact_mut(bias.len().max(1)) {
        for (v, b) in row.iter_mut().zip(bias) {
            *v += b;
        }
    }
}

/// `out = silu(g) · u` in f32.
pub fn silu_mul_f32(g: &[f32], u: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::level() == Level::Avx512 {
        // SAFETY: Level::Avx512 means avx512f was detected.
        unsafe { avx512::silu_mul_f32(g, u, out) };
        return;
    }
    for ((o, x), y) in out.iter_mut().zip(g).zip(u) {
        *o = silu(*x) * y;
    }
}

/// `out = bf16(bf16(silu(g)) · u)`.
pub fn silu_mul_bf16(g: &[bf16], u: &[bf16], out: &mut [bf16]) {
    #[cfg(target_arch = "x86_64")]
    if bf16_vectors() {
        // SAFETY: avx512f and avx512bf16 detected (and allowed by the dispatch level).
        unsafe { avx512::silu_mul_bf16(g, u, out) };
        return;
    }
    for ((o, x), y) in out.iter_mut().zip(g).zip(u) {
        let s = bf16::from_f32(silu(x.to_f32()));
        *o = bf16::from_f32(s.to_f32() * y.to_f32());
    }
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[cfg(target_arch = "x86_64")]
fn bf16_vectors() -> bool {
    super::bf16::avx512()
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use half::bf16;
    use std::arch::x86_64::*;

    /// `e^x` for 16 lanes: `2^n · p(r)` with `x = n·ln2 + r`, `|r| ≤ ln2/2`, `p` the degree-7
    /// Taylor polynomial (truncation below 2e-9 relative; close to libm's `expf`).
    /// Inputs are clamped to `[-104, 89]`, past which `e^x` is zero or infinite in f32 as it
    /// is from libm (and the range reduction would lose its precision).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn exp(x: __m512) -> __m512 {
        let x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(89.0)), _mm512_set1_ps(-104.0));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)));
        // ln2 split in two so n·ln2 is exact to f32 precision.
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_145_75), x);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428_606_8e-6), r);
        let mut p = _mm512_set1_ps(1.0 / 5040.0);
        for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
        }
        _mm512_scalef_ps(p, n)
    }

    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn silu(x: __m512) -> __m512 {
        let e = exp(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_div_ps(x, _mm512_add_ps(_mm512_set1_ps(1.0), e))
    }

    /// Lanes `i..i + 16` of `s` (fewer at the end) as f32, zeros past the end.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load_bf16(s: &[bf16], i: usize, mask: __mmask16) -> __m512 {
        let h = _mm256_maskz_loadu_epi16(mask, s.as_ptr().add(i) as *const i16);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }

    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    unsafe fn store_bf16(s: &mut [bf16], i: usize, mask: __mmask16, v: __m512) {
        let h: __m256i = std::mem::transmute(_mm512_cvtneps_pbh(v));
        _mm256_mask_storeu_epi16(s.as_mut_ptr().add(i) as *mut i16, mask, h);
    }

    fn mask(i: usize, n: usize) -> __mmask16 {
        if n - i >= 16 {
            0xffff
        } else {
            ((1u32 << (n - i)) - 1) as __mmask16
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn add_bf16(a: &[bf16], b: &[bf16], out: &mut [bf16]) {
        let n = out.len().min(a.len()).min(b.len());
        for i in (0..n).step_by(16) {
            let m = mask(i, n);
            store_bf16(out, i, m, _mm512_add_ps(load_bf16(a, i, m), load_bf16(b, i, m)));
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn to_bf16(x: &[f32], out: &mut [bf16]) {
        let n = out.len().min(x.len());
        for i in (0..n).step_by(16) {
            let m = mask(i, n);
            store_bf16(out, i, m, _mm512_maskz_loadu_ps(m, x.as_ptr().add(i)));
        }
    }

    #[target_feature(enable = "avx512f")]
    pub unsafe fn silu_mul_f32(g: &[f32], u: &[f32], out: &mut [f32]) {
        let n = out.len().min(g.len()).min(u.len());
        for i in (0..n).step_by(16) {
            let m = mask(i, n);
            let x = _mm512_maskz_loadu_ps(m, g.as_ptr().add(i));
            let y = _mm512_maskz_loadu_ps(m, u.as_ptr().add(i));
            _mm512_mask_storeu_ps(out.as_mut_ptr().add(i), m, _mm512_mul_ps(silu(x), y));
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub unsafe fn silu_mul_bf16(g: &[bf16], u: &[bf16], out: &mut [bf16]) {
        let n = out.len().min(g.len()).min(u.len());
        for i in (0..n).step_by(16) {
            let m = mask(i, n);
            // silu rounds to bf16 before the product, as two torch ops would.
            let s = _mm512_cvtpbh_ps(_mm512_cvtneps_pbh(silu(load_bf16(g, i, m))));
            store_bf16(out, i, m, _mm512_mul_ps(s, load_bf16(u, i, m)));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        // Spread over the range where exp matters, including both clamps and exact zeros.
        (0..n as u32).map(|i| ((i.wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / (1 << 24) as f32 - 0.5) * 240.0 * if i % 7 == 0 { 0.01 } else { 1.0 }).chain([0.0, -0.0, 100.0, -120.0]).collect()
    }

    #[test]
    fn f32_silu_mul_within_4_ulp_of_libm() {
        let (g, u) = (values(100_001, 1), values(100_001, 2));
        let mut out = vec![0f32; g.len()];
        silu_mul_f32(&g, &u, &mut out);
        let mut worst = 0f32;
        for i in 0..g.len() {
            let want = silu(g[i]) * u[i];
            let ulps = (out[i] - want).abs() / (f32::EPSILON * want.abs()).max(f32::MIN_POSITIVE);
            worst = worst.max(ulps);
            assert!(ulps <= 4.0, "silu({}) * {}: {} vs {want}", g[i], u[i], out[i]);
        }
        eprintln!("worst: {worst} ulp");
    }

    #[test]
    fn bf16_ops_round_like_the_reference() {
        let (g, u) = (values(333, 3), values(333, 4));
        let (g, u): (Vec<bf16>, Vec<bf16>) = (g.iter().map(|&v| bf16::from_f32(v)).collect(), u.iter().map(|&v| bf16::from_f32(v)).collect());
        let mut sum = vec![bf16::ZERO; g.len()];
        add_bf16(&g, &u, &mut sum);
        let mut prod = vec![bf16::ZERO; g.len()];
        silu_mul_bf16(&g, &u, &mut prod);
        for i in 0..g.len() {
            assert_eq!(sum[i], bf16::from_f32(g[i].to_f32() + u[i].to_f32()), "{} + {}", g[i], u[i]);
            let s = bf16::from_f32(silu(g[i].to_f32()));
            let want = bf16::from_f32(s.to_f32() * u[i].to_f32());
            // The vector exp may differ from libm's in the last f32 bits, which can move a
            // bf16 rounding by one step.
            let step = (want.to_f32().abs() / 128.0).max(f32::MIN_POSITIVE);
            assert!((prod[i].to_f32() - want.to_f32()).abs() <= step, "silu({}) * {}: {} vs {want}", g[i], u[i], prod[i]);
        }
        let wide: Vec<f32> = values(77, 5).iter().map(|v| v * 1.001).chain([f32::NAN, f32::INFINITY, 1e-40]).collect();
        let mut narrow = vec![bf16::ZERO; wide.len()];
        to_bf16(&wide, &mut narrow);
        for (n, w) in narrow.iter().zip(&wide) {
            let want = bf16::from_f32(*w);
            // `vcvtneps2bf16` reads f32 subnormals as zero (below 1.2e-38: no activation's size).
            let flushed = w.abs() < f32::MIN_POSITIVE && n.to_f32() == 0.0;
            assert!(n.to_bits() == want.to_bits() || (n.is_nan() && want.is_nan()) || flushed, "{w}: {n} vs {want}");
        }
        let mut f = vec![0f32; 5];
        add_f32(&[1.0, 2.0, 3.0, 4.0, 5.0], &[0.5; 5], &mut f);
        assert_eq!(f, [1.5, 2.5, 3.5, 4.5, 5.5]);
    }
}
