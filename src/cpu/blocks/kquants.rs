//! AVX2 dots of the k-quants in the file's row order (Q5_K: 256 values a block; Q4_K and Q6_K
//! run on `q4k8`'s and `q6k8`'s interleaved groups, Q4_K sharing this module's block reading) with `Q8K` activations:
//! one weight row against up to four activation rows, each block's values decoded once into
//! registers and dotted with every row. The sub-block scales multiply in integers
//! (`vpmaddwd` of the `vpmaddubsw` pairs with the scale), so a block costs one conversion and
//! one FMA per row:
//! `d_x · (d · Σ_j sc_j · Σ u·x − dmin · Σ_j m_j · Σx_j)`, the mins' share from the
//! activations' 16-value sums.

/// Sub-block scales and mins of a Q4_K/Q5_K block from its 12 packed bytes, four at a time:
/// bytes 0–3 hold scales 0–3 in their low 6 bits (and the top bits of scales 4–7), bytes 4–7
/// the mins likewise, bytes 8–11 the low nibbles of scales 4–7 and, above them, of mins 4–7.
/// (ggml's `get_scale_min_k4` reads them one at a time; a test holds the two equal.)
#[inline(always)]
pub fn scales_mins(packed: &[u8]) -> ([u8; 8], [u8; 8]) {
    let word = |i: usize| u32::from_le_bytes([packed[4 * i], packed[4 * i + 1], packed[4 * i + 2], packed[4 * i + 3]]);
    let (a, b, c) = (word(0), word(1), word(2));
    let (low6, low4, top2) = (0x3f3f_3f3f, 0x0f0f_0f0f, 0x0303_0303);
    let sc_hi = (c & low4) | (((a >> 6) & top2) << 4);
    let m_hi = ((c >> 4) & low4) | (((b >> 6) & top2) << 4);
    let sc = ((a & low6) as u64 | (sc_hi as u64) << 32).to_le_bytes();
    let m = ((b & low6) as u64 | (m_hi as u64) << 32).to_le_bytes();
    (sc, m)
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // `r` indexes several per-row arrays at once
pub(super) mod avx2 {
    use super::super::act::{Q8K, GROUP};
    use super::super::simd::avx2::{f16_at, prefetch, reduce32};
    use super::super::Format;
    use std::arch::x86_64::*;

    /// Row `w` (`nb` blocks of format `F`, a k-quant) against activation rows `r0..r0 + M`.
    /// Each block's integer sums are reduced exactly and then scaled into one f32 per row, in
    /// block order, exactly as `tile` does in its lanes: decode and prefill give a row the same
    /// numbers (the prefix cache relies on it), for one horizontal sum per block and row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn row<const F: u8, const M: usize>(w: *const u8, nb: usize, a: &Q8K, r0: usize, out: &mut [f32]) {
        let bytes = Format::from_id(F).bytes();
        let mut acc = [0f32; M];
        for b in 0..nb {
            let blk = w.add(b * bytes);
            prefetch(blk, bytes);
            q45k_block::<F, M>(blk, nb, b, a, r0, &mut acc);
        }
        out[..M].copy_from_slice(&acc);
    }

    /// The sum of the eight i32 lanes (exact: integer addition in any order).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn hsum_i32(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0x4E>(s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0xB1>(s)))
    }

    /// Row `w` (`nb` blocks of format `F`, a k-quant) against the `GROUP` activation rows of
    /// group `g` (prefill): `out[r]`. Each block is decoded once for the
    /// eight rows, and the per-block scaling, min or offset terms done for all eight rows
    /// in one vector (`reduce32`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile<const F: u8>(w: *const u8, nb: usize, a: &Q8K, g: usize, out: &mut [f32]) {
        let bytes = Format::from_id(F).bytes();
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let blk = w.add(b * bytes);
            prefetch(blk, bytes);
            let dx = _mm256_loadu_ps(a.d8.as_ptr().add((g * nb + b) * GROUP));
            let rows = |r: usize| g * GROUP + r;
            let (isum, msum) = q45k_sums::<F, GROUP>(blk, nb, b, a, rows);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce32(&isum)), _mm256_mul_ps(_mm256_set1_ps(f16_at(blk)), dx), acc);
            acc = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(reduce32(&msum)), _mm256_mul_ps(_mm256_set1_ps(f16_at(blk.add(2))), dx), acc);
        }
        _mm256_storeu_ps(out.as_mut_ptr(), acc);
    }

    /// `PICK[j]` broadcasts 16-bit word `j` of a 128-bit half across it (`vpshufb`).
    const PICK: [__m256i; 8] = {
        let mut p = [[0u8; 32]; 8];
        let mut j = 0;
        while j < 8 {
            let mut i = 0;
            while i < 32 {
                p[j][i] = (2 * j + i % 2) as u8;
                i += 1;
            }
            j += 1;
        }
        // SAFETY: [u8; 32] and __m256i have the same size, every bit pattern is valid.
        unsafe { std::mem::transmute::<[[u8; 32]; 8], [__m256i; 8]>(p) }
    };

    /// Activation row `r`'s 32 values from `at` of block `b`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn x32(a: &Q8K, nb: usize, row: usize, b: usize, at: usize) -> __m256i {
        _mm256_loadu_si256(a.q().as_ptr().add((row * nb + b) * 256 + at) as *const __m256i)
    }

    /// Activation row `r`'s sixteen 16-value sums of block `b`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn bsums(a: &Q8K, nb: usize, row: usize, b: usize) -> __m256i {
        _mm256_loadu_si256(a.bsums.as_ptr().add((row * nb + b) * 16) as *const __m256i)
    }

    /// One Q4_K (144 bytes: d, dmin, 12 scale bytes, 128 nibble bytes) or Q5_K (176: d, dmin,
    /// 12 scale bytes, 32 bytes of fifth bits, 128 nibble bytes) block.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q45k_block<const F: u8, const M: usize>(w: *const u8, nb: usize, b: usize, a: &Q8K, r0: usize, acc: &mut [f32; M]) {
        let (isum, msum) = q45k_sums::<F, M>(w, nb, b, a, |r| r0 + r);
        let (d, dmin) = (f16_at(w), f16_at(w.add(2)));
        for r in 0..M {
            let dx = *a.d.get_unchecked((r0 + r) * nb + b);
            acc[r] = (hsum_i32(isum[r]) as f32).mul_add(d * dx, acc[r]);
            acc[r] = (-(hsum_i32(msum[r]) as f32)).mul_add(dmin * dx, acc[r]);
        }
    }

    /// A Q4_K/Q5_K block's integer sums against activation rows `row(0..M)`: Σ_j sc_j · Σ u·x
    /// and Σ_j m_j · Σx_j, as eight i32 lanes per row.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q45k_sums<const F: u8, const M: usize>(w: *const u8, nb: usize, b: usize, a: &Q8K, row: impl Fn(usize) -> usize) -> ([__m256i; M], [__m256i; M]) {
        let five = F == Format::Q5K as u8;
        let (sc, mn) = super::scales_mins(std::slice::from_raw_parts(w.add(4), 12));
        let qs = w.add(if five { 48 } else { 16 });
        let (m4, one) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(1));
        let mut hb = if five { _mm256_loadu_si256(w.add(16) as *const __m256i) } else { _mm256_setzero_si256() };
        // The eight scales as 16-bit words in both halves, each broadcast by a shuffle when
        // its sub-block comes (cheaper than moving each byte to a vector on its own).
        let scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(_mm_cvtsi64_si128(i64::from_le_bytes(sc))));
        let mut isum = [_mm256_setzero_si256(); M];
        for c in 0..4 {
            // 64 values: the low nibbles are sub-block 2c, the high ones 2c + 1; Q5_K's fifth
            // bits are bits 2c and 2c + 1 of the 32 high-bit bytes.
            let q = _mm256_loadu_si256(qs.add(32 * c) as *const __m256i);
            let mut lo = _mm256_and_si256(q, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
            if five {
                lo = _mm256_or_si256(lo, _mm256_slli_epi16::<4>(_mm256_and_si256(hb, one)));
                hi = _mm256_or_si256(hi, _mm256_slli_epi16::<4>(_mm256_and_si256(_mm256_srli_epi16::<1>(hb), one)));
                hb = _mm256_srli_epi16::<2>(hb);
            }
            let (sl, sh) = (_mm256_shuffle_epi8(scales, PICK[2 * c]), _mm256_shuffle_epi8(scales, PICK[2 * c + 1]));
            for r in 0..M {
                let pl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x32(a, nb, row(r), b, 64 * c)), sl);
                let ph = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x32(a, nb, row(r), b, 64 * c + 32)), sh);
                isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(pl, ph));
            }
        }
        // Each min twice, once for each 16-value sum of its sub-block.
        let pairs = _mm_shuffle_epi8(_mm_cvtsi64_si128(i64::from_le_bytes(mn)), _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
        let mins = _mm256_cvtepu8_epi16(pairs);
        let mut msum = [_mm256_setzero_si256(); M];
        for r in 0..M {
            msum[r] = _mm256_madd_epi16(mins, bsums(a, nb, row(r), b));
        }
        (isum, msum)
    }
}
