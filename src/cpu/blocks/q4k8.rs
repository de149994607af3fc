//! Q4_K weights eight rows at a time, for AVX2 without VNNI. In the file's own layout a
//! sub-block of 32 values is one `vpmaddubsw` per activation row, whose sixteen 16-bit pair
//! sums must then be widened and scaled by a `vpmaddwd` of their own: two multiplies per 32
//! values. Here the same byte column of eight rows sits side by side (four bytes of each row
//! in one 256-bit vector), so one broadcast of four activation bytes serves eight rows, the
//! pair sums of a whole sub-block add up in 16 bits (eight steps of at most 2 · 15 · 127 stay
//! below 32 767), and one `vpmaddwd` scales all eight rows' sub-block at once: about nine
//! multiplies per 8 × 32 values instead of sixteen (llama.cpp's AVX2 repack of Q4_K rests on
//! the same observation). The sums of a row never depend on how many activation rows share a
//! pass, so decode and prefill give the same numbers (the prefix cache relies on it).
//!
//! A group of eight rows holds, for each of its 256-value blocks, 1184 bytes (the file's eight
//! blocks take 1152):
//! - `d` and `dmin` of the eight rows (f16, 16 bytes each);
//! - the eight sub-block scales of each row, unpacked to bytes, sub-block-major (`sc[j][r]`);
//! - the mins likewise, in pairs of sub-blocks (`mn[j/2][r][j%2]`), ready for `vpmaddwd`;
//! - the nibbles: for chunk `c` (64 values) and step `i`, row `r`'s bytes `32c + 4i..+4`
//!   at `(8c + i) · 32 + 4r` (low nibbles: values `64c + 4i..`, high: `64c + 32 + 4i..`).
//!
//! Rows past the weight's last (its row count need not be a multiple of eight) are zeros.

use super::act::Q8K;
use super::kquants::scales_mins;

/// Rows interleaved in a group.
pub const ROWS: usize = 8;
/// Bytes of one group's block (eight rows × 256 values).
pub const BYTES: usize = 1184;
const DMIN: usize = 16;
const SC: usize = 32;
const MN: usize = 96;
const QS: usize = 160;
/// Bytes of one Q4_K block in the file.
const FILE_BYTES: usize = 144;

/// Bytes an `[n, k]` weight takes in this layout.
pub fn bytes(n: usize, k: usize) -> usize {
    n.div_ceil(ROWS) * (k / 256) * BYTES
}

/// Group `g` of the file's rows (`nb` blocks each, `row_bytes` apart; rows `>= n` left as
/// the zeros `out` holds) written into `out` (`nb · BYTES`).
pub fn pack_group(blocks: &[u8], n: usize, nb: usize, g: usize, out: &mut [u8]) {
    let row_bytes = nb * FILE_BYTES;
    for r in 0..ROWS.min(n - g * ROWS) {
        let row = &blocks[(g * ROWS + r) * row_bytes..][..row_bytes];
        for (b, src) in row.chunks_exact(FILE_BYTES).enumerate() {
            let dst = &mut out[b * BYTES..][..BYTES];
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
                    dst[at..at + 4].copy_from_slice(&src[16 + 32 * c + 4 * i..][..4]);
                }
            }
        }
    }
}

/// Group `g` (at `w`, `nb` blocks) against activation rows `r0..r0 + R`: `out[r · stride + l]`
/// for the group's rows `l < 8`. Needs AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
pub fn rows<const R: usize>(w: *const u8, nb: usize, a: &Q8K, r0: usize, out: &mut [f32], stride: usize) {
    assert!(out.len() >= (R - 1) * stride + ROWS && a.q().len() >= (r0 + R) * nb * 256, "q4k8::rows: slices shorter than the shapes");
    // SAFETY: the caller (`PackedBlocks::matmul`) checked avx2, fma and f16c; `w` holds `nb`
    // blocks of the group, and the activations and `out` are long enough (asserted above).
    unsafe { avx2::rows::<R>(w, nb, a, r0, out, stride) }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // `r` indexes several per-row arrays at once
mod avx2 {
    use super::super::act::Q8K;
    use super::super::simd::avx2::{four, prefetch_step};
    use super::{BYTES, DMIN, MN, QS, SC};
    use std::arch::x86_64::*;

    /// Sub-block `j`'s scales of the eight rows, each in both 16-bit halves of its row's lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn scales(blk: *const u8, j: usize) -> __m256i {
        let s = _mm_loadl_epi64(blk.add(SC + 8 * j) as *const __m128i);
        _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(s, s))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows<const R: usize>(w: *const u8, nb: usize, a: &Q8K, r0: usize, out: &mut [f32], stride: usize) {
        let m4 = _mm256_set1_epi8(0x0f);
        let k = nb * 256;
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let blk = w.add(b * BYTES);
            let x = |r: usize, at: usize| a.q().as_ptr().add((r0 + r) * k + b * 256 + at);
            let mut isum = [_mm256_setzero_si256(); R];
            for c in 0..4 {
                // Sub-blocks 2c (low nibbles) and 2c + 1 (high), each summed in 16 bits.
                let (mut lo, mut hi) = ([_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R]);
                for i in 0..8 {
                    prefetch_step(blk, 8 * c + i, BYTES.div_ceil(32));
                    let q = _mm256_loadu_si256(blk.add(QS + (8 * c + i) * 32) as *const __m256i);
                    let (ql, qh) = (_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4));
                    for r in 0..R {
                        lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(ql, four(x(r, 64 * c + 4 * i))));
                        hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(qh, four(x(r, 64 * c + 32 + 4 * i))));
                    }
                }
                let (sl, sh) = (scales(blk, 2 * c), scales(blk, 2 * c + 1));
                for r in 0..R {
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(lo[r], sl), _mm256_madd_epi16(hi[r], sh)));
                }
            }
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
        for r in 0..R {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * stride), acc[r]);
        }
    }
}
