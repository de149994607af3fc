//! Q4_K and Q5_K weights eight rows at a time, for AVX2 without VNNI (with it, `q4_k`'s
//! panels hold both). In the file's own layout a sub-block of 32 values is one `vpmaddubsw`
//! per activation row, whose sixteen 16-bit pair sums must then be widened and scaled by a
//! `vpmaddwd` of their own: two multiplies per 32 values. Here the same byte column of eight
//! rows sits side by side (four bytes of each row in one 256-bit vector), so one broadcast of
//! four activation bytes serves eight rows, the pair sums of a whole sub-block add up in 16
//! bits (eight steps of at most 2 · 15 · 128 stay
//! below 32 767; Q5_K's values reach 31, so its sums are widened every four steps), and one
//! `vpmaddwd` scales all eight rows' sub-block at once: about nine multiplies per 8 × 32
//! values instead of sixteen (llama.cpp's AVX2 repack of Q4_K rests on the same observation).
//! The sums of a row never depend on how many activation rows share a pass, so decode and
//! prefill give the same numbers (the prefix cache relies on it).
//!
//! A group of eight rows holds, for each of its 256-value blocks, 1184 bytes (the file's eight
//! Q4_K blocks take 1152) or, for Q5_K, 1440 (the file's 1408):
//! - `d` and `dmin` of the eight rows (f16, 16 bytes each);
//! - the eight sub-block scales of each row, unpacked to bytes, sub-block-major (`sc[j][r]`);
//! - the mins likewise, in pairs of sub-blocks (`mn[j/2][r][j%2]`), ready for `vpmaddwd`;
//! - the nibbles: for chunk `c` (64 values) and step `i`, row `r`'s bytes `32c + 4i..+4`
//!   at `(8c + i) · 32 + 4r` (low nibbles: values `64c + 4i..`, high: `64c + 32 + 4i..`);
//! - Q5_K only: the fifth bits as the file holds them, row `r`'s bytes `4i..4i + 4` at
//!   `i · 32 + 4r`: bit `2c` of a byte is the fifth bit of the low nibble under it in every
//!   chunk `c`, bit `2c + 1` that of the high one. (In the file's layout the Q5_K kernel
//!   decoded at ~34 GB/s on two Zen 4 cores, 62 % of a ~55 GB/s triad.)
//!
//! Rows past the weight's last (its row count need not be a multiple of eight) are zeros.

use super::act::Q8K;
use super::kquants::scales_mins;

/// Rows interleaved in a group.
pub const ROWS: usize = 8;
const DMIN: usize = 16;
const SC: usize = 32;
const MN: usize = 96;
const QS: usize = 160;
/// Q5_K's fifth bits, after the nibbles.
const QH: usize = QS + 1024;

/// Bytes of one group's block (eight rows × 256 values), Q5_K's (`five`) or Q4_K's.
pub const fn block_bytes(five: bool) -> usize {
    if five {
        QH + 256
    } else {
        QH
    }
}

/// Bytes an `[n, k]` weight takes in this layout.
pub fn bytes(five: bool, n: usize, k: usize) -> usize {
    n.div_ceil(ROWS) * (k / 256) * block_bytes(five)
}

/// Group `g` of the file's rows of Q5_K (`five`) or Q4_K (`nb` blocks each; rows `>= n` left
/// as the zeros `out` holds) written into `out` (`nb · block_bytes(five)`).
pub fn pack_group(five: bool, blocks: &[u8], n: usize, nb: usize, g: usize, out: &mut [u8]) {
    let (file_bytes, bytes) = (if five { 176 } else { 144 }, block_bytes(five));
    let (qh, qs) = (16, if five { 48 } else { 16 });
    let row_bytes = nb * file_bytes;
    for r in 0..ROWS.min(n - g * ROWS) {
        let row = &blocks[(g * ROWS + r) * row_bytes..][..row_bytes];
        for (b, src) in row.chunks_exact(file_bytes).enumerate() {
            let dst = &mut out[b * bytes..][..bytes];
            dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
            dst[DMIN + 2 * r..DMIN + 2 * r + 2].copy_from_slice(&src[2..4]);
            let (sc, mn) = scales_mins(&src[4..16]);
            for j in 0..8 {
                dst[SC + 8 * j + r] = sc[j];
                dst[MN + 16 * (j / 2) + 2 * r + j % 2] = mn[j];
            }
            for c in 0..4 {
                for i in 0..8 {
                    let at = QS + (8 * c + i) * 32 + 4 * r;
                    dst[at..at + 4].copy_from_slice(&src[qs + 32 * c + 4 * i..][..4]);
                }
            }
            for i in (0..8).filter(|_| five) {
                dst[QH + 32 * i + 4 * r..][..4].copy_from_slice(&src[qh + 4 * i..][..4]);
            }
        }
    }
}

/// Group `g` (at `w`, `nb` blocks of Q5_K if `FIVE`, else Q4_K) against activation rows
/// `r0..r0 + R`: `out[r · stride + l]` for the group's rows `l < 8`. Needs AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
pub fn rows<const FIVE: bool, const R: usize>(w: *const u8, nb: usize, a: &Q8K, r0: usize, out: &mut [f32], stride: usize) {
    assert!(out.len() >= (R - 1) * stride + ROWS && a.q().len() >= (r0 + R) * nb * 256, "q4k8::rows: slices shorter than the shapes");
    // SAFETY: the caller (`PackedBlocks::matmul`) checked avx2, fma and f16c; `w` holds `nb`
    // blocks of the group, and the activations and `out` are long enough (asserted above).
    unsafe { avx2::rows::<FIVE, R>(w, nb, a, r0, out, stride) }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // `r` indexes several per-row arrays at once
mod avx2 {
    use super::super::act::Q8K;
    use super::super::simd::avx2::{four, nibbles, prefetch_step};
    use super::{block_bytes, DMIN, MN, QH, QS, SC};
    use std::arch::x86_64::*;

    /// Sub-block `j`'s scales of the eight rows, each in both 16-bit halves of its row's lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn scales(blk: *const u8, j: usize) -> __m256i {
        let s = _mm_loadl_epi64(blk.add(SC + 8 * j) as *const __m128i);
        _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s, s))
    }

    /// Q5_K's fifth bits of chunk `c` (`bits >> 2c`, bit 0 under the low nibbles, bit 1
    /// under the high ones) as 16 in each byte where set. The 16-bit shifts move bits across
    /// bytes, but only bit 4 of each byte is kept, which comes from its own byte.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn fifth(bits: __m256i, c: usize) -> (__m256i, __m256i) {
        let (s, sixteen) = (_mm256_srl_epi16(bits, _mm_cvtsi32_si128(2 * c as i32)), _mm256_set1_epi8(0x10));
        (_mm256_and_si256(_mm256_slli_epi16::<4>(s), sixteen), _mm256_and_si256(_mm256_slli_epi16::<3>(s), sixteen))
    }

    /// Row `r`'s activation bytes `at..at + 4` of block `b`, in every lane.
    #[inline(always)]
    unsafe fn x(a: &Q8K, nb: usize, b: usize, r: usize, at: usize) -> __m256i {
        four(a.q().as_ptr().add((r * nb + b) * 256 + at))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows<const FIVE: bool, const R: usize>(w: *const u8, nb: usize, a: &Q8K, r0: usize, out: &mut [f32], stride: usize) {
        let bytes = block_bytes(FIVE);
        // Steps summed in 16 bits before widening (the module's notes).
        let run = if FIVE { 4 } else { 8 };
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let blk = w.add(b * bytes);
            let mut isum = [_mm256_setzero_si256(); R];
            for c in 0..4 {
                // Sub-blocks 2c (low nibbles) and 2c + 1 (high), each summed in 16 bits.
                let (sl, sh) = (scales(blk, 2 * c), scales(blk, 2 * c + 1));
                let (mut lo, mut hi) = ([_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R]);
                for i in 0..8 {
                    prefetch_step(blk, 8 * c + i, bytes.div_ceil(32));
                    let (mut ql, mut qh) = nibbles(blk.add(QS + 32 * (8 * c + i)));
                    if FIVE {
                        let (fl, fh) = fifth(_mm256_loadu_si256(blk.add(QH + 32 * i) as *const __m256i), c);
                        (ql, qh) = (_mm256_or_si256(ql, fl), _mm256_or_si256(qh, fh));
                    }
                    for r in 0..R {
                        lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(ql, x(a, nb, b, r0 + r, 64 * c + 4 * i)));
                        hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(qh, x(a, nb, b, r0 + r, 64 * c + 32 + 4 * i)));
                    }
                    if (i + 1) % run == 0 {
                        for r in 0..R {
                            isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(lo[r], sl), _mm256_madd_epi16(hi[r], sh)));
                            (lo[r], hi[r]) = (_mm256_setzero_si256(), _mm256_setzero_si256());
                        }
                    }
                }
            }
            block_end(blk, nb, b, a, r0, &isum, &mut acc);
        }
        for r in 0..R {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * stride), acc[r]);
        }
    }

    /// A block's end for activation rows `r0..r0 + R`: `acc += d_x · (d · isum − dmin · Σ_j
    /// m_j · Σx_j)`, eight rows a vector.
    #[inline(always)]
    unsafe fn block_end<const R: usize>(blk: *const u8, nb: usize, b: usize, a: &Q8K, r0: usize, isum: &[__m256i; R], acc: &mut [__m256; R]) {
        let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
        let dmin = _mm256_cvtph_ps(_mm_loadu_si128(blk.add(DMIN) as *const __m128i));
        for r in 0..R {
            // Σ_j m_j · Σx_j: each sub-block's sum is two of the activations' 16-value sums.
            let bs = a.bsums.as_ptr().add(((r0 + r) * nb + b) * 16);
            let xs = _mm256_madd_epi16(_mm256_loadu_si256(bs as *const __m256i), _mm256_set1_epi16(1));
            let xs = _mm256_packs_epi32(xs, xs);
            let mut msum = _mm256_setzero_si256();
            for p in 0..4 {
                let mins = _mm256_cvtepu8_epi16(_mm_loadu_si128(blk.add(MN + 16 * p) as *const __m128i));
                // The pair (Σx_2p, Σx_2p+1) in every lane: words 2p, 2p + 1 of the packed
                // sums sit in lane p of the low half for p < 2 and of the high half after.
                let pair = _mm256_permutevar8x32_epi32(xs, _mm256_set1_epi32([0, 1, 4, 5][p]));
                msum = _mm256_add_epi32(msum, _mm256_madd_epi16(mins, pair));
            }
            let dx = _mm256_set1_ps(*a.d.get_unchecked((r0 + r) * nb + b));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, dx), acc[r]);
            acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(msum), _mm256_mul_ps(dmin, dx), acc[r]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{available, Format, PackedBlocks};

    /// Q5_K's largest values against activations quantized to −128 (an activation row of all
    /// +1 or all −1: Q8_K's scale takes the sign of the largest value) sum to 8 · 2 · 31 · 128
    /// over eight steps, past an i16: the sums must be widened every four steps. Every value
    /// is 31 (`d` 1, scales 1, mins 0), so each row's product is exactly ±31 · k.
    #[test]
    fn q5k_extremes_do_not_wrap() {
        if !available() {
            return;
        }
        let (n, k) = (8, 512);
        let mut block = [0xffu8; 176];
        block[..2].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
        block[2..4].fill(0);
        // Scales 0–3 and the low nibbles of scales 4–7 are 1, every min 0.
        block[4..16].copy_from_slice(&[1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1]);
        let blocks: Vec<u8> = (0..n * k / 256).flat_map(|_| block).collect();
        let w = PackedBlocks::pack(Format::Q5K, &blocks, n, k).expect("whole blocks");
        let x: Vec<f32> = (0..2 * k).map(|i| if i < k { 1.0 } else { -1.0 }).collect();
        let mut out = vec![0f32; 2 * n];
        w.matmul(&x, 2, &mut out);
        let want: Vec<f32> = (0..2 * n).map(|i| if i < n { 31.0 * k as f32 } else { -31.0 * k as f32 }).collect();
        assert_eq!(out, want);
    }
}
