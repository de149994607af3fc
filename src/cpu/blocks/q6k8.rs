//! Q6_K weights eight rows at a time, for AVX2 (as `q4k8` for Q4_K). In the file's layout each
//! row's 6-bit values are put together from a low-nibble byte and a 2-bit field of another
//! byte, and every 16 values need their own `vpmaddwd` per row. Here the same byte column of
//! eight rows sits side by side, so one decode of the bits serves eight rows, one broadcast of
//! four activation bytes multiplies eight rows, and one `vpmaddwd` scales two steps of all
//! eight rows. The integer sums are exact and each block is scaled into one f32 per row in
//! block order (`d · d_x · (Σ sc·Σu·x − 32 · Σ sc·Σx)`), so a row's numbers never depend on
//! how many activation rows share its pass (decode and prefill agree).
//!
//! A group of eight rows holds, for each of its 256-value blocks, 1680 bytes (the file's eight
//! blocks take as many):
//! - `d` of the eight rows (f16, 16 bytes);
//! - the sixteen signed scales of each row, in pairs of sub-blocks (`sc[j/2][r][j%2]`);
//! - the low nibbles as `q4k8` holds Q4_K's: for chunk `c` (64 values) and step `i`, row `r`'s
//!   bytes at `(8c + i) · 32 + 4r` (low nibbles: values `64c + 4i..+4`, high: `64c + 32 + 4i..`);
//! - the 2-bit highs, one byte per value column for two steps: for chunk `c` and step pair `s`,
//!   row `r`'s byte `b` at `(4c + s) · 32 + 4r + b` holds in bits 0-1 the high bits of value
//!   `64c + 8s + b`, 2-3 of `64c + 32 + 8s + b`, 4-5 of `64c + 8s + 4 + b`, 6-7 of
//!   `64c + 32 + 8s + 4 + b` (so each step's highs reach bits 4-5 with one shift and mask).
//!
//! Rows past the weight's last (its row count need not be a multiple of eight) are zeros.

/// Rows interleaved in a group.
pub const ROWS: usize = 8;
/// Bytes of one group's block (eight rows × 256 values).
pub const BYTES: usize = 1680;
const SC: usize = 16;
const QL: usize = 144;
const QH: usize = 1168;
/// Bytes of one Q6_K block in the file (`ql[128]`, `qh[64]`, `scales[16]`, `d`).
const FILE_BYTES: usize = 210;

/// Bytes an `[n, k]` weight takes in this layout.
pub fn bytes(n: usize, k: usize) -> usize {
    n.div_ceil(ROWS) * (k / 256) * BYTES
}

/// A file block's 256 values as their low nibbles and their two high bits, in value order.
fn split(src: &[u8]) -> ([u8; 256], [u8; 256]) {
    // ggml's order: half `h` (128 values) takes ql[64h..64h+64] and qh[32h..32h+32]; within it
    // value l + 32t (l < 32) is nibble (t / 2) of ql[64h + l + 32 (t % 2)], bits 2t of qh[32h + l].
    let (mut lo, mut hi) = ([0u8; 256], [0u8; 256]);
    for h in 0..2 {
        let (ql, qh) = (&src[64 * h..64 * h + 64], &src[128 + 32 * h..128 + 32 * h + 32]);
        for t in 0..4 {
            let (q, shift) = (&ql[32 * (t % 2)..32 * (t % 2) + 32], 4 * (t / 2));
            for l in 0..32 {
                lo[128 * h + 32 * t + l] = (q[l] >> shift) & 0x0f;
                hi[128 * h + 32 * t + l] = (qh[l] >> (2 * t)) & 3;
            }
        }
    }
    (lo, hi)
}

/// Group `g` of the file's rows (`nb` blocks each; rows `>= n` written as zeros) into `out`
/// (`nb · BYTES`), each 32-byte line of eight rows written whole, in order.
pub fn pack_group(blocks: &[u8], n: usize, nb: usize, g: usize, out: &mut [u8]) {
    let (row_bytes, rows) = (nb * FILE_BYTES, ROWS.min(n - g * ROWS));
    let (mut lo, mut hi) = ([[0u8; 256]; ROWS], [[0u8; 256]; ROWS]);
    for b in 0..nb {
        let dst: &mut [u8; BYTES] = (&mut out[b * BYTES..][..BYTES]).try_into().expect("BYTES");
        for r in 0..rows {
            let src = &blocks[(g * ROWS + r) * row_bytes + b * FILE_BYTES..][..FILE_BYTES];
            dst[2 * r..2 * r + 2].copy_from_slice(&src[208..210]);
            for j in 0..16 {
                dst[SC + 16 * (j / 2) + 2 * r + j % 2] = src[192 + j];
            }
            (lo[r], hi[r]) = split(src);
        }
        for c in 0..4 {
            for i in 0..8 {
                let (v, line) = (64 * c + 4 * i, QL + (8 * c + i) * 32);
                for (lo, dst) in lo.iter().zip(dst[line..line + 32].chunks_exact_mut(4)) {
                    for col in 0..4 {
                        dst[col] = lo[v + col] | lo[v + 32 + col] << 4;
                    }
                }
            }
            for s in 0..4 {
                // Steps 2s (bits 0-3) and 2s + 1 (bits 4-7) of the pair.
                let (v, line) = (64 * c + 8 * s, QH + (4 * c + s) * 32);
                for (hi, dst) in hi.iter().zip(dst[line..line + 32].chunks_exact_mut(4)) {
                    for col in 0..4 {
                        let (even, odd) = (hi[v + col] | hi[v + 32 + col] << 2, hi[v + 4 + col] | hi[v + 36 + col] << 2);
                        dst[col] = even | odd << 4;
                    }
                }
            }
        }
    }
}

/// Group `g` (at `w`, `nb` blocks) against activation rows `r0..r0 + R`: `out[r · stride + l]`
/// for the group's rows `l < 8`. Needs AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
pub fn rows<const R: usize>(w: *const u8, nb: usize, a: &super::act::Q8K, r0: usize, out: &mut [f32], stride: usize) {
    assert!(out.len() >= (R - 1) * stride + ROWS && a.q().len() >= (r0 + R) * nb * 256, "q6k8::rows: slices shorter than the shapes");
    // SAFETY: the caller (`PackedBlocks::matmul`) checked avx2, fma and f16c; `w` holds `nb`
    // blocks of the group, and the activations and `out` are long enough (asserted above).
    unsafe { avx2::rows::<R>(w, nb, a, r0, out, stride) }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // `r` indexes several per-row arrays at once
mod avx2 {
    use super::super::act::Q8K;
    use super::super::simd::avx2::{four, prefetch_step};
    use super::{BYTES, QH, QL, SC};
    use std::arch::x86_64::*;

    /// The scales of sub-blocks `2p` (`ODD` false) or `2p + 1` of the eight rows, each in both
    /// 16-bit halves of its row's lane.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn scales<const ODD: bool>(blk: *const u8, p: usize) -> __m256i {
        let pairs = _mm_loadu_si128(blk.add(SC + 16 * p) as *const __m128i);
        let pick = if ODD { _mm_setr_epi8(1, 1, 3, 3, 5, 5, 7, 7, 9, 9, 11, 11, 13, 13, 15, 15) } else { _mm_setr_epi8(0, 0, 2, 2, 4, 4, 6, 6, 8, 8, 10, 10, 12, 12, 14, 14) };
        _mm256_cvtepi8_epi16(_mm_shuffle_epi8(pairs, pick))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows<const R: usize>(w: *const u8, nb: usize, a: &Q8K, r0: usize, out: &mut [f32], stride: usize) {
        let (m4, m30) = (_mm256_set1_epi8(0x0f), _mm256_set1_epi8(0x30));
        let k = nb * 256;
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let blk = w.add(b * BYTES);
            let x = |r: usize, at: usize| a.q().as_ptr().add((r0 + r) * k + b * 256 + at);
            let mut isum = [_mm256_setzero_si256(); R];
            for c in 0..4 {
                // Low nibbles: sub-blocks 4c (steps 0-3) and 4c + 1 (4-7); high: 4c + 2, 4c + 3.
                // Two scales live at a time (sixteen ymm registers: one row must not spill).
                for half in 0..2 {
                    let (sl, sh) = if half == 0 { (scales::<false>(blk, 2 * c), scales::<false>(blk, 2 * c + 1)) } else { (scales::<true>(blk, 2 * c), scales::<true>(blk, 2 * c + 1)) };
                    for s in 2 * half..2 * half + 2 {
                        prefetch_step(blk, 4 * c + s, BYTES.div_ceil(16));
                        let h = _mm256_loadu_si256(blk.add(QH + (4 * c + s) * 32) as *const __m256i);
                        // Each step's 6-bit values (0..63): two steps' pair sums add up in 16
                        // bits (2 · 2 · 63 · 127 < 32 767).
                        let (mut lo, mut hi) = ([_mm256_setzero_si256(); R], [_mm256_setzero_si256(); R]);
                        for e in 0..2 {
                            let i = 2 * s + e;
                            let q = _mm256_loadu_si256(blk.add(QL + (8 * c + i) * 32) as *const __m256i);
                            let (hl, hh) = if e == 0 {
                                (_mm256_and_si256(_mm256_slli_epi16::<4>(h), m30), _mm256_and_si256(_mm256_slli_epi16::<2>(h), m30))
                            } else {
                                (_mm256_and_si256(h, m30), _mm256_and_si256(_mm256_srli_epi16::<2>(h), m30))
                            };
                            let ul = _mm256_or_si256(_mm256_and_si256(q, m4), hl);
                            let uh = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(q), m4), hh);
                            for r in 0..R {
                                lo[r] = _mm256_add_epi16(lo[r], _mm256_maddubs_epi16(ul, four(x(r, 64 * c + 4 * i))));
                                hi[r] = _mm256_add_epi16(hi[r], _mm256_maddubs_epi16(uh, four(x(r, 64 * c + 32 + 4 * i))));
                            }
                        }
                        for r in 0..R {
                            isum[r] = _mm256_add_epi32(isum[r], _mm256_add_epi32(_mm256_madd_epi16(lo[r], sl), _mm256_madd_epi16(hi[r], sh)));
                        }
                    }
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            for r in 0..R {
                // The −32 offset: 32 · Σ_j sc_j · Σx_j, the pair (Σx_2p, Σx_2p+1) broadcast.
                let bs = a.bsums.as_ptr().add(((r0 + r) * nb + b) * 16);
                let mut off = _mm256_setzero_si256();
                for p in 0..8 {
                    let pairs = _mm256_cvtepi8_epi16(_mm_loadu_si128(blk.add(SC + 16 * p) as *const __m128i));
                    off = _mm256_add_epi32(off, _mm256_madd_epi16(pairs, _mm256_set1_epi32(bs.add(2 * p).cast::<i32>().read_unaligned())));
                }
                let dot = _mm256_sub_epi32(isum[r], _mm256_slli_epi32::<5>(off));
                let dx = _mm256_set1_ps(*a.d.get_unchecked((r0 + r) * nb + b));
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d, dx), acc[r]);
            }
        }
        for r in 0..R {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * stride), acc[r]);
        }
    }
}
