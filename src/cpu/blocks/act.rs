//! Activations quantized once per product, as ggml does before its integer dots: per 32 values
//! for the 32-value block formats (`Q8`, ggml's `block_q8_0`/`block_q8_1`), per 256 values for
//! the k-quants (`Q8K`, ggml's `block_q8_K`). Rounding follows candle's `from_float` (the
//! reference the kernels are tested against): half away from zero.

use half::f16;
use rayon::prelude::*;

/// Rows quantized per 32 values: `q` int8, `d` the scale (rounded through f16 as the block
/// stores it), and what the offset and min formats need: `Σq` in `s[2b]` (an integer, exact
/// in f32) and `d · Σq` rounded through f16 in `s[2b + 1]`, as ggml's `block_q8_1` stores it.
pub struct Q8 {
    pub k: usize,
    pub q: Vec<i8>,
    pub d: Vec<f32>,
    pub s: Vec<f32>,
}

/// Rows quantized per 256 values: `q` int8, `d` the scale, `bsums` each 16 values' Σq; and,
/// empty unless asked for, `pairs`: each block's eight 32-value sums as four 16-bit pairs
/// `(2i, 2i + 1)` (what the AVX-512 Q4_K kernel's `vpdpwssd` takes against its mins, `pairs`).
pub struct Q8K {
    pub k: usize,
    /// The int8 values, four to an i32 (little-endian: value `4i + j` is byte `j` of quad `i`),
    /// the unit the AVX-512 kernels broadcast; `q()` reads them as bytes. Read as i32s, not
    /// as bytes cast at each read: the VNNI Q6_K decode streamed its weights at 0.6× the rate
    /// reading quadruples out of an i8 buffer (Zen 4, criterion `Q6K_vnni_decode_bytes`).
    quads: Vec<i32>,
    pub d: Vec<f32>,
    pub bsums: Vec<i16>,
    pub pairs: Vec<i32>,
}

/// Blocks quantized in parallel when there are many (prefill), in place otherwise (decode: a
/// fork-join costs more than one row).
#[allow(clippy::too_many_arguments)]
fn blocks<A: Send, B: Send>(parallel: bool, x: &[f32], len: usize, q: &mut [i8], a: &mut [A], b: &mut [B], c: usize, f: impl Fn(&[f32], &mut [i8], &mut A, &mut [B]) + Sync + Send) {
    if parallel {
        x.par_chunks_exact(len).zip(q.par_chunks_exact_mut(len)).zip(a.par_iter_mut().zip(b.par_chunks_exact_mut(c))).for_each(|((x, q), (a, b))| f(x, q, a, b));
    } else {
        x.chunks_exact(len).zip(q.chunks_exact_mut(len)).zip(a.iter_mut().zip(b.chunks_exact_mut(c))).for_each(|((x, q), (a, b))| f(x, q, a, b));
    }
}

impl Q8 {
    /// `x` is `[m, k]` with `k` a multiple of 32.
    pub fn quantize(x: &[f32], m: usize, k: usize) -> Q8 {
        let nb = m * k / 32;
        let (mut q, mut d, mut s) = (vec![0i8; m * k], vec![0f32; nb], vec![0f32; 2 * nb]);
        blocks(m > 1, &x[..m * k], 32, &mut q, &mut d, &mut s, 2, |x, q, d, s| {
            let (scale, sum) = q8_block(x, q);
            *d = f16::from_f32(scale).to_f32();
            s[0] = sum as f32;
            s[1] = f16::from_f32(*d * sum as f32).to_f32();
        });
        Q8 { k, q, d, s }
    }
}

impl Q8K {
    /// `x` is `[m, k]` with `k` a multiple of 256.
    pub fn quantize(x: &[f32], m: usize, k: usize) -> Q8K {
        let nb = m * k / 256;
        let (mut quads, mut d, mut bsums) = (vec![0i32; m * k / 4], vec![0f32; nb], vec![0i16; nb * 16]);
        // SAFETY: the same memory as bytes (i8 has no invalid values and alignment 1), borrowed
        // only for this call.
        let q = unsafe { std::slice::from_raw_parts_mut(quads.as_mut_ptr() as *mut i8, m * k) };
        blocks(m > 1, &x[..m * k], 256, q, &mut d, &mut bsums, 16, |x, q, d, sums| *d = q8k_block(x, q, sums));
        Q8K { k, quads, d, bsums, pairs: Vec::new() }
    }

    /// The values as bytes, row after row.
    pub fn q(&self) -> &[i8] {
        // SAFETY: as in `quantize`; the view lives as long as `self`'s borrow.
        unsafe { std::slice::from_raw_parts(self.quads.as_ptr() as *const i8, self.quads.len() * 4) }
    }

    /// The values as quadruples, 64 per block.
    pub fn quads(&self) -> &[i32] {
        &self.quads
    }

    /// Also the 32-value sums as 16-bit pairs (`pairs`).
    pub fn pairs(mut self) -> Q8K {
        let pair = |s: &[i16]| (s[0].wrapping_add(s[1]) as u16 as i32) | ((s[2].wrapping_add(s[3]) as i32) << 16);
        self.pairs = self.bsums.chunks_exact(4).map(pair).collect();
        self
    }
}

/// `round(x / scale)` with `scale = max |x| / 127`; returns the scale and Σq.
fn q8_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    #[cfg(target_arch = "x86_64")]
    if super::super::level() >= super::super::Level::Avx2 {
        // SAFETY: Level::Avx2 or above is only chosen when avx2 and fma are detected.
        return unsafe { avx2::q8_block(x, q) };
    }
    q8_block_scalar(x, q)
}

/// The reference for `avx2::q8_block`.
fn q8_block_scalar(x: &[f32], q: &mut [i8]) -> (f32, i32) {
    let scale = x.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
    let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    let mut sum = 0;
    for (q, x) in q.iter_mut().zip(x) {
        *q = (x * inv).round() as i8;
        sum += *q as i32;
    }
    (scale, sum)
}

/// ggml's `quantize_row_q8_K`: the value of largest magnitude `max` (the first of equals: the
/// sign matters) maps to −127 (`iscale = −127 / max`), `d = 1 / iscale`; each 16 values' sum
/// beside.
fn q8k_block(x: &[f32], q: &mut [i8], sums: &mut [i16]) -> f32 {
    // The largest magnitude over sixteen lanes (vectorized; a fold carrying the signed value
    // along was one dependent compare a value, ~2 µs of a 4,864-wide decode product), then the
    // first value that has it.
    let mut lanes = [0f32; 16];
    for c in x.chunks_exact(16) {
        for (a, &v) in lanes.iter_mut().zip(c) {
            *a = if v.abs() > *a { v.abs() } else { *a };
        }
    }
    let amax = lanes.iter().chain(x.chunks_exact(16).remainder()).fold(0f32, |a, &v| if v.abs() > a { v.abs() } else { a });
    let max = x.iter().copied().find(|v| v.abs() == amax).unwrap_or(0.0);
    if amax == 0.0 {
        q.fill(0);
        sums.fill(0);
        return 0.0;
    }
    let iscale = -127.0 / max;
    #[cfg(target_arch = "x86_64")]
    if super::super::level() >= super::super::Level::Avx2 {
        // SAFETY: Level::Avx2 or above is only chosen when avx2 and fma are detected.
        unsafe { avx2::q8k_values(x, iscale, q, sums) };
        return 1.0 / iscale;
    }
    q8k_values(x, iscale, q, sums);
    1.0 / iscale
}

/// `round(iscale · x)` (half away from zero, clamped to i8) and each 16 values' sum: the
/// reference for `avx2::q8k_values`.
fn q8k_values(x: &[f32], iscale: f32, q: &mut [i8], sums: &mut [i16]) {
    for (q, x) in q.iter_mut().zip(x) {
        *q = (iscale * x).round().clamp(-128.0, 127.0) as i8;
    }
    for (s, q) in sums.iter_mut().zip(q.chunks_exact(16)) {
        *s = q.iter().map(|&v| v as i16).sum();
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// `q8_block_scalar` in vector registers (`round`, then `bytes`).
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn q8_block(x: &[f32], q: &mut [i8]) -> (f32, i32) {
        assert!(x.len() >= 32 && q.len() >= 32);
        let v = [0, 8, 16, 24].map(|i| _mm256_loadu_ps(x.as_ptr().add(i)));
        let abs = _mm256_set1_ps(f32::from_bits(0x7fff_ffff));
        let m = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)), _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)));
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let scale = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m))) / 127.0;
        let inv = _mm256_set1_ps(if scale != 0.0 { 1.0 / scale } else { 0.0 });
        let r = v.map(|v| round(_mm256_mul_ps(v, inv)));
        let sum = _mm256_add_epi32(_mm256_add_epi32(r[0], r[1]), _mm256_add_epi32(r[2], r[3]));
        let s = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256::<1>(sum));
        let s = _mm_hadd_epi32(_mm_hadd_epi32(s, s), s);
        _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, bytes(r));
        (scale, _mm_cvtsi128_si32(s))
    }

    /// `p` rounded half away from zero as `round` does: add ±0.49999997, truncate.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn round(p: __m256) -> __m256i {
        let (sign, half) = (_mm256_set1_ps(-0.0), _mm256_set1_ps(0.499_999_97));
        _mm256_cvttps_epi32(_mm256_add_ps(p, _mm256_or_ps(_mm256_and_ps(p, sign), half)))
    }

    /// Four vectors of eight i32 as 32 bytes in order, saturated to i8: the packs interleave
    /// the 128-bit halves, the permutation puts the values back in order.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn bytes(r: [__m256i; 4]) -> __m256i {
        let b = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
        _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7))
    }

    /// `super::q8k_values` 32 at a time (`round`, then `bytes`, whose saturation is the
    /// clamp), the sums taken of the saturated bytes as the scalar path sums its clamped
    /// values.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn q8k_values(x: &[f32], iscale: f32, q: &mut [i8], sums: &mut [i16]) {
        assert!(x.len() >= 256 && q.len() >= 256 && sums.len() >= 16);
        let (s, ones) = (_mm256_set1_ps(iscale), _mm256_set1_epi8(1));
        for c in 0..8 {
            let b = bytes([0, 8, 16, 24].map(|i| round(_mm256_mul_ps(s, _mm256_loadu_ps(x.as_ptr().add(32 * c + i))))));
            _mm256_storeu_si256(q.as_mut_ptr().add(32 * c) as *mut __m256i, b);
            // Byte pairs summed to i16 (ones · b), then each 128-bit half's eight words: the
            // two 16-value sums, exact in i16 (|Σ| ≤ 16 · 128).
            let w = _mm256_maddubs_epi16(ones, b);
            let w = _mm256_hadd_epi16(w, w);
            let w = _mm256_hadd_epi16(w, w);
            let w = _mm256_hadd_epi16(w, w);
            sums[2 * c] = _mm256_extract_epi16::<0>(w) as i16;
            sums[2 * c + 1] = _mm256_extract_epi16::<8>(w) as i16;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector quantizer rounds every value as the scalar one does, ties and zeros included.
    #[test]
    fn vector_q8_block_equals_the_scalar_one() {
        for seed in 0..200u32 {
            let mut xs: Vec<f32> = (0..32u32).map(|i| ((i * 7919 + seed * 104729) % 2001) as f32 / 1000.0 - 1.0).collect();
            xs[seed as usize % 32] = if seed % 2 == 0 { 1.27 } else { -1.27 };
            let f = [1.0, 127.0 / 254.0, 0.5, 0.0][seed as usize % 4];
            xs.iter_mut().for_each(|v| *v *= f);
            let (mut a, mut b) = ([0i8; 32], [0i8; 32]);
            let want = q8_block_scalar(&xs, &mut a);
            let got = q8_block(&xs, &mut b);
            assert_eq!((a, want), (b, got), "seed {seed}");
        }
    }

    /// Q8_K: the largest magnitude maps to ∓127, the 16-value sums add up and the 32-value
    /// pairs are theirs.
    #[test]
    fn q8k_scale_and_sums() {
        let x: Vec<f32> = (0..512).map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0).collect();
        let a = Q8K::quantize(&x, 2, 256).pairs();
        for b in 0..2 {
            for (i, p) in a.pairs[b * 4..][..4].iter().enumerate() {
                let s = &a.bsums[b * 16 + 4 * i..][..4];
                assert_eq!((*p as i16, (*p >> 16) as i16), (s[0] + s[1], s[2] + s[3]), "pair {i}");
            }
            let q = &a.q()[b * 256..][..256];
            assert_eq!(q.iter().map(|v| (*v as i32).abs()).max(), Some(127));
            for (i, s) in a.bsums[b * 16..][..16].iter().enumerate() {
                assert_eq!(*s as i32, q[16 * i..][..16].iter().map(|&v| v as i32).sum::<i32>());
            }
            for (q, x) in q.iter().zip(&x[b * 256..]) {
                assert!((*q as f32 * a.d[b] - x).abs() <= a.d[b].abs() * 0.5 + 1e-6);
            }
        }
    }

    /// A block's scale is ggml's: the first value of the largest magnitude decides the sign
    /// (opposite signs of one magnitude, in either order, in any lane), an all-zero block is 0.
    #[test]
    fn q8k_scale_takes_the_first_largest_magnitude() {
        let fold = |x: &[f32]| x.iter().fold((0f32, 0f32), |(a, m), &v| if v.abs() > a { (v.abs(), v) } else { (a, m) }).1;
        for (i, j) in [(0, 255), (255, 0), (17, 18), (130, 3), (40, 40)] {
            let mut x: Vec<f32> = (0..256).map(|v| ((v * 37 % 101) as f32 - 50.0) / 100.0).collect();
            (x[j], x[i]) = (-2.5, 2.5);
            let (mut q, mut sums) = ([0i8; 256], [0i16; 16]);
            let d = q8k_block(&x, &mut q, &mut sums);
            assert_eq!(d, 1.0 / (-127.0 / fold(&x)), "+2.5 at {i}, −2.5 at {j}");
        }
        let (mut q, mut sums) = ([1i8; 256], [1i16; 16]);
        assert_eq!(q8k_block(&[0.0; 256], &mut q, &mut sums), 0.0);
        assert!(q.iter().all(|&v| v == 0) && sums.iter().all(|&v| v == 0));
    }

    /// The vector Q8_K quantizer gives the scalar one's bytes and sums: ties at ±0.5, a
    /// magnitude shared by opposite signs (the first decides), zeros, saturation at −128.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn vector_q8k_equals_the_scalar_one() {
        if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")) {
            return;
        }
        for seed in 0..100u32 {
            let mut xs: Vec<f32> = (0..256u32).map(|i| ((i * 7919 + seed * 104729) % 2001) as f32 / 1000.0 - 1.0).collect();
            match seed % 4 {
                0 => xs.iter_mut().step_by(3).for_each(|v| *v = (*v * 254.0).round() / 254.0),
                1 => (xs[5], xs[200]) = (1.5, -1.5),
                2 => xs.iter_mut().take(128).for_each(|v| *v = 0.0),
                _ => xs[seed as usize % 256] = -1.01,
            }
            let iscale = -127.0 / xs.iter().fold((0f32, 0f32), |(a, m), &v| if v.abs() > a { (v.abs(), v) } else { (a, m) }).1;
            // At scale 1 the values themselves: the largest below a half, halves, saturation.
            let edges = [0.499_999_97, -0.499_999_97, 0.5, -0.5, 1.5, -2.5, 126.5, 127.6, -128.4, -130.0, 0.0, -0.0];
            let mut raw = xs.clone();
            raw[..edges.len()].copy_from_slice(&edges);
            // Saturated blocks: the 16-value sums at their extremes.
            let full: Vec<f32> = (0..256).map(|i| if i < 128 { 300.0 } else { -300.0 }).collect();
            for (xs, scale) in [(&xs, iscale), (&xs, iscale * 1.02), (&raw, 1.0), (&full, 1.0)] {
                let (mut qa, mut qb, mut sa, mut sb) = ([0i8; 256], [0i8; 256], [0i16; 16], [0i16; 16]);
                q8k_values(xs, scale, &mut qa, &mut sa);
                // SAFETY: avx2 and fma were detected above.
                unsafe { avx2::q8k_values(xs, scale, &mut qb, &mut sb) };
                assert_eq!((qa, sa), (qb, sb), "seed {seed} scale {scale}");
            }
        }
    }
}
