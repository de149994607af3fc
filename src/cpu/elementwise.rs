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

/// RMSNorm of each row of `x` (rows of `w.len()` values) into `out`: `x / √(mean(x²) + eps) · w`
/// as candle's `rms_norm` computes it (the divide, then the product, each rounded; a bf16 row's
/// root rounded to bf16 and each step rounded to bf16), except that the squares are summed in
/// sixteen interleaved f32 partial sums rather than one after another: the sum no longer waits
/// on each add (896 values took ~1 µs in order). Rows in parallel past 32 (prefill), as
/// candle's.
pub fn rms_norm<T: Norm>(x: &[T], w: &[T], eps: f32, out: &mut [T]) {
    use rayon::prelude::*;
    let n = w.len().max(1);
    let row = |(x, o): (&[T], &mut [T])| {
        let mut acc = [0f32; 16];
        let (body, tail) = x.split_at(x.len() / 16 * 16);
        for c in body.chunks_exact(16) {
            for (a, v) in acc.iter_mut().zip(c) {
                let v = v.f32();
                *a += v * v;
            }
        }
        let sum2 = acc.iter().sum::<f32>() + tail.iter().map(|v| v.f32() * v.f32()).sum::<f32>();
        T::scale_row(x, w, (sum2 / n as f32 + eps).sqrt(), o);
    };
    if x.len() / n <= 32 {
        x.chunks_exact(n).zip(out.chunks_exact_mut(n)).for_each(row);
    } else {
        x.par_chunks_exact(n).zip(out.par_chunks_exact_mut(n)).for_each(row);
    }
}

/// The element types `rms_norm` takes.
pub trait Norm: Copy + Send + Sync {
    fn f32(self) -> f32;
    /// `out = x / m · w` in this type's arithmetic.
    fn scale_row(x: &[Self], w: &[Self], m: f32, out: &mut [Self]);
}

impl Norm for f32 {
    fn f32(self) -> f32 {
        self
    }
    fn scale_row(x: &[f32], w: &[f32], m: f32, out: &mut [f32]) {
        for ((o, v), a) in out.iter_mut().zip(x).zip(w) {
            *o = v / m * a;
        }
    }
}

impl Norm for bf16 {
    fn f32(self) -> f32 {
        self.to_f32()
    }
    fn scale_row(x: &[bf16], w: &[bf16], m: f32, out: &mut [bf16]) {
        let m = bf16::from_f32(m);
        for ((o, v), a) in out.iter_mut().zip(x).zip(w) {
            *o = *v / m * *a;
        }
    }
}

/// NeoX rotary ("rotate_half") on `x: [t, heads, d]` into `out`: channel `i` and `i + r/2` of
/// the first `r` channels of each head rotate by token `t`'s angle `i` (`cos`, `sin`:
/// `[t, r/2]`), the rest are copied. Each output is `x1·c − x2·s` or `x1·s + x2·c` as written,
/// a product and a sum each rounded in f32 (no fused multiply-add), so the values are
/// candle's `rope_thd`'s bit for bit.
pub fn rope(x: &[f32], cos: &[f32], sin: &[f32], heads: usize, d: usize, r: usize, out: &mut [f32]) {
    let half = r / 2;
    assert!(r <= d && x.len() == out.len() && (x.len() / (heads * d).max(1)) * half <= cos.len().min(sin.len()), "rope: tables shorter than the tokens");
    for (i, (xt, ot)) in x.chunks_exact(heads * d).zip(out.chunks_exact_mut(heads * d)).enumerate() {
        let (c, s) = (&cos[i * half..(i + 1) * half], &sin[i * half..(i + 1) * half]);
        for (xh, oh) in xt.chunks_exact(d).zip(ot.chunks_exact_mut(d)) {
            let (x1, x2) = xh[..r].split_at(half);
            let (o1, rest) = oh.split_at_mut(half);
            let (o2, pass) = rest.split_at_mut(half);
            for j in 0..half {
                o1[j] = x1[j] * c[j] - x2[j] * s[j];
                o2[j] = x1[j] * s[j] + x2[j] * c[j];
            }
            pass.copy_from_slice(&xh[r..]);
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

/// `p[i] = e^(p[i] − max)` (a softmax's numerators); returns their sum. Vector `exp` within
/// 4 ulp of libm's, `e^−∞ = 0`; the sum in lane order, not left to right.
pub fn exp_sub_sum(p: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    match super::level() {
        // SAFETY: Level::Avx512 means avx512f was detected.
        Level::Avx512 => return unsafe { avx512::exp_sub_sum(p, max) },
        // SAFETY: Level::Avx2 means avx2 and fma were detected.
        Level::Avx2 => return unsafe { avx2::exp_sub_sum(p, max) },
        _ => {}
    }
    let mut sum = 0f32;
    for v in p.iter_mut() {
        *v = (*v - max).exp();
        sum += *v;
    }
    sum
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
    pub unsafe fn exp_sub_sum(p: &mut [f32], max: f32) -> f32 {
        let (n, mx) = (p.len(), _mm512_set1_ps(max));
        let mut sum = _mm512_setzero_ps();
        for i in (0..n).step_by(16) {
            let m = mask(i, n);
            let e = exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, p.as_ptr().add(i)), mx));
            _mm512_mask_storeu_ps(p.as_mut_ptr().add(i), m, e);
            sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(m, e));
        }
        _mm512_reduce_add_ps(sum)
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

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// `avx512::exp` on eight lanes: the same reduction and polynomial, `2^n` built from
    /// exponent bits in two factors so results down to the subnormals round once, as
    /// `scalef` does.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp(x: __m256) -> __m256 {
        let x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(89.0)), _mm256_set1_ps(-104.0));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(_mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)));
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_145_75), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428_606_8e-6), r);
        let mut p = _mm256_set1_ps(1.0 / 5040.0);
        for c in [1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
        }
        // n in [-150, 129]: halves of it are normal exponents.
        let n = _mm256_cvtps_epi32(n);
        let n1 = _mm256_srai_epi32::<1>(n);
        let pow = |e: __m256i| _mm256_castsi256_ps(_mm256_slli_epi32::<23>(_mm256_add_epi32(e, _mm256_set1_epi32(127))));
        _mm256_mul_ps(_mm256_mul_ps(p, pow(n1)), pow(_mm256_sub_epi32(n, n1)))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_sub_sum(p: &mut [f32], max: f32) -> f32 {
        let (n, mx) = (p.len(), _mm256_set1_ps(max));
        let mut sum = _mm256_setzero_ps();
        let mut i = 0;
        while i + 8 <= n {
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(p.as_ptr().add(i)), mx));
            _mm256_storeu_ps(p.as_mut_ptr().add(i), e);
            sum = _mm256_add_ps(sum, e);
            i += 8;
        }
        if i < n {
            // The tail goes into the lanes too (element `i` always in lane `i % 8`, padding
            // exactly 0), so trailing masked scores (−∞) never change the sum: a prefill row
            // padded to its query block's keys then sums as the same row unpadded (summed
            // apart, the tail moved with the padding, and a prompt prefilled in other chunks
            // scored its tokens a few ulp apart).
            let mut tail = [f32::NEG_INFINITY; 8];
            tail[..n - i].copy_from_slice(&p[i..]);
            let e = exp(_mm256_sub_ps(_mm256_loadu_ps(tail.as_ptr()), mx));
            _mm256_storeu_ps(tail.as_mut_ptr(), e);
            p[i..].copy_from_slice(&tail[..n - i]);
            tail[n - i..].fill(0.0);
            sum = _mm256_add_ps(sum, _mm256_loadu_ps(tail.as_ptr()));
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), sum);
        lanes.iter().sum()
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

    /// The softmax numerators at every level this machine runs: within 4 ulp of libm's `exp`
    /// (exactly 0 for −∞ and below the subnormals), the sum within rounding of theirs.
    #[test]
    fn exp_sub_sum_within_4_ulp_of_libm() {
        let x: Vec<f32> = values(10_003, 6).into_iter().chain([f32::NEG_INFINITY, -103.0, -95.0, -87.5]).collect();
        let max = 3.5;
        let want: Vec<f32> = x.iter().map(|v| (v - max).exp()).collect();
        let mut runs: Vec<(&str, fn(&mut [f32], f32) -> f32)> = vec![("dispatched", exp_sub_sum)];
        #[cfg(target_arch = "x86_64")]
        {
            if std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma") {
                // SAFETY: avx2 and fma detected.
                runs.push(("avx2", |p, m| unsafe { avx2::exp_sub_sum(p, m) }));
            }
            if std::is_x86_feature_detected!("avx512f") {
                // SAFETY: avx512f detected.
                runs.push(("avx512", |p, m| unsafe { avx512::exp_sub_sum(p, m) }));
            }
        }
        for (name, f) in runs {
            for len in [x.len(), 13, 5] {
                let mut p = x[..len].to_vec();
                let sum = f(&mut p, max);
                for (i, (&g, &w)) in p.iter().zip(&want).enumerate() {
                    let ulps = if g == w { 0.0 } else { (g - w).abs() / (f32::EPSILON * w.abs()).max(f32::from_bits(1)) };
                    assert!(ulps <= 4.0, "{name}: exp({} - {max}) = {g}, libm {w}", x[i]);
                }
                let total: f64 = want[..len].iter().map(|&v| v as f64).sum();
                assert!(sum as f64 == total || (sum as f64 - total).abs() <= total * 1e-5, "{name} len {len}: sum {sum} vs {total}");
                // Trailing masked scores (a prefill row padded to its block's keys) leave the
                // sum's bits as they are: short rows of scores near the max (seeded), where a
                // tail summed apart from the lanes rounds differently.
                for seed in 0..64 {
                    let row: Vec<f32> = values(len.min(21), 100 + seed).iter().map(|v| max - (v.abs() % 4.0)).collect();
                    let one = f(&mut row.clone(), max);
                    for pad in [1, 3, 8, 11] {
                        let mut padded: Vec<f32> = row.iter().copied().chain(std::iter::repeat_n(f32::NEG_INFINITY, pad)).collect();
                        assert_eq!(f(&mut padded, max).to_bits(), one.to_bits(), "{name}: {} scores padded by {pad} (seed {seed})", row.len());
                    }
                }
            }
            let mut masked = [f32::NEG_INFINITY; 3];
            assert_eq!(f(&mut masked, max), 0.0, "{name}");
            assert_eq!(masked, [0.0; 3], "{name}: e^-inf");
        }
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
