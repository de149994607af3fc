//! The 32-value block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) eight rows at a time, for AVX2
//! without AVX-512 VNNI. In the file's layout each row is dotted on its own: per block of 32
//! values a row pays for its integer dot and then, alone, for converting it, loading and
//! multiplying its scale, one FMA and its offset term, and each row ends in a horizontal sum
//! (on a 0.5B model's rows of 896 values, 28 blocks, that overhead was a large part of a
//! decode step). Here block `b` of eight rows lies together, so the eight rows' integer dots
//! are reduced into the lanes of one vector and scaled, offset and accumulated by a few
//! vector instructions for all eight. A block's integer dot is exact and the blocks are added
//! in one order whatever the number of activation rows in a pass, so decode and prefill give
//! a row the same numbers (the prefix cache relies on it).
//!
//! A group's block `b` is the file's eight blocks `b` of rows `8g..8g+8` regrouped, the same
//! bytes: the eight `d` (f16), the eight `m` (the min formats Q4_1, Q5_1), the eight fifth-bit
//! words (Q5_0, Q5_1), then each row's quants (16 bytes of nibbles, Q8_0's 32 bytes). Rows past
//! the weight's last are zeros.

use super::act::Q8;
use super::Format;

/// Rows interleaved in a group.
pub const ROWS: usize = 8;

/// Offsets in a group's block: the `m`s, the fifth bits, the quants, and one row's quant bytes.
#[derive(Clone, Copy)]
struct Parts {
    m: usize,
    qh: usize,
    qs: usize,
    q_bytes: usize,
}

const fn parts(f: Format) -> Parts {
    let min = matches!(f, Format::Q4_1 | Format::Q5_1);
    let q5 = matches!(f, Format::Q5_0 | Format::Q5_1);
    let qh = 16 + if min { 16 } else { 0 };
    let qs = qh + if q5 { 32 } else { 0 };
    Parts { m: 16, qh, qs, q_bytes: if matches!(f, Format::Q8_0) { 32 } else { 16 } }
}

/// Offsets in the file's block (ggml's `block_*`): `m`, the fifth bits, the quants.
fn file_parts(f: Format) -> (Option<usize>, Option<usize>, usize) {
    match f {
        Format::Q4_1 => (Some(2), None, 4),
        Format::Q5_0 => (None, Some(2), 6),
        Format::Q5_1 => (Some(2), Some(4), 8),
        _ => (None, None, 2),
    }
}

/// Bytes of one group (eight rows of `k` values) of format `f`.
pub fn group_bytes(f: Format, k: usize) -> usize {
    ROWS * (k / 32) * f.bytes()
}

/// Bytes an `[n, k]` weight takes in this layout (the file's, with the last group padded).
pub fn bytes(f: Format, n: usize, k: usize) -> usize {
    n.div_ceil(ROWS) * group_bytes(f, k)
}

/// Group `g` of the file's rows (`nb` blocks each; rows `>= n` left as the zeros `out` holds)
/// written into `out` (`group_bytes`).
pub fn pack_group(f: Format, blocks: &[u8], n: usize, nb: usize, g: usize, out: &mut [u8]) {
    let (fb, p, (fm, fqh, fqs)) = (f.bytes(), parts(f), file_parts(f));
    let row_bytes = nb * fb;
    for r in 0..ROWS.min(n - g * ROWS) {
        let row = &blocks[(g * ROWS + r) * row_bytes..][..row_bytes];
        for (b, src) in row.chunks_exact(fb).enumerate() {
            let dst = &mut out[b * ROWS * fb..][..ROWS * fb];
            dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
            if let Some(at) = fm {
                dst[p.m + 2 * r..p.m + 2 * r + 2].copy_from_slice(&src[at..at + 2]);
            }
            if let Some(at) = fqh {
                dst[p.qh + 4 * r..p.qh + 4 * r + 4].copy_from_slice(&src[at..at + 4]);
            }
            dst[p.qs + p.q_bytes * r..][..p.q_bytes].copy_from_slice(&src[fqs..fqs + p.q_bytes]);
        }
    }
}

/// Group `g` (at `w`, `nb` blocks) against activation rows `r0..r0 + R`: `out[r · stride + l]`
/// for the group's rows `l < 8`. Needs AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
pub fn rows<const F: u8, const R: usize>(w: *const u8, nb: usize, a: &Q8, r0: usize, out: &mut [f32], stride: usize) {
    assert!(out.len() >= (R - 1) * stride + ROWS && a.q.len() >= (r0 + R) * nb * 32, "rows8::rows: slices shorter than the shapes");
    // SAFETY: the caller (`PackedBlocks::matmul`) checked avx2, fma and f16c; `w` holds `nb`
    // blocks of the group, and the activations and `out` are long enough (asserted above).
    unsafe { avx2::rows::<F, R>(w, nb, a, r0, out, stride) }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // `r` and `l` index several arrays at once
mod avx2 {
    use super::super::act::Q8;
    use super::super::legacy::avx2::{high, nibbles, prefetch, reduce16, reduce32};
    use super::super::Format;
    use super::{parts, ROWS};
    use std::arch::x86_64::*;

    /// Row `l`'s 32 values of the group's block at `blk`: unsigned (0..16, 0..32) but for
    /// Q8_0's signed bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn values<const F: u8>(blk: *const u8, l: usize) -> __m256i {
        let p = parts(Format::from_id(F));
        let q = blk.add(p.qs + p.q_bytes * l);
        match F {
            f if f == Format::Q8_0 as u8 => _mm256_loadu_si256(q as *const __m256i),
            f if f == Format::Q5_0 as u8 || f == Format::Q5_1 as u8 => _mm256_or_si256(nibbles(q), high(blk.add(p.qh + 4 * l))),
            _ => nibbles(q),
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows<const F: u8, const R: usize>(w: *const u8, nb: usize, a: &Q8, r0: usize, out: &mut [f32], stride: usize) {
        let f = Format::from_id(F);
        let signed = f == Format::Q8_0;
        let min = matches!(f, Format::Q4_1 | Format::Q5_1);
        let offset = match f {
            Format::Q4_0 => -8.0,
            Format::Q5_0 => -16.0,
            _ => 0.0,
        };
        let gb = ROWS * f.bytes();
        let ones = _mm256_set1_epi16(1);
        let (mut acc, mut corr) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
        for b in 0..nb {
            let blk = w.add(b * gb);
            prefetch(blk, gb);
            // Decoded once for every activation row of the pass; Q8_0's magnitudes, its signs
            // moved onto the activations below (`vpmaddubsw` takes unsigned × signed).
            let mut u = [_mm256_setzero_si256(); ROWS];
            for l in 0..ROWS {
                u[l] = values::<F>(blk, l);
            }
            let au = if signed { u.map(|v| _mm256_sign_epi8(v, v)) } else { u };
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            let c = if min { _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i)) } else { _mm256_mul_ps(d, _mm256_set1_ps(offset)) };
            for r in 0..R {
                let at = (r0 + r) * nb + b;
                let x = _mm256_loadu_si256(a.q.as_ptr().add(at * 32) as *const __m256i);
                let mut p = [_mm256_setzero_si256(); ROWS];
                for l in 0..ROWS {
                    let xl = if signed { _mm256_sign_epi8(x, u[l]) } else { x };
                    let m = _mm256_maddubs_epi16(au[l], xl);
                    p[l] = if signed { _mm256_madd_epi16(m, ones) } else { m };
                }
                let sums = if signed { reduce32(&p) } else { reduce16(&p) };
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(*a.d.get_unchecked(at))), acc[r]);
                if !signed {
                    // The min formats take `s` through f16, as ggml's `block_q8_1` holds it.
                    corr[r] = _mm256_fmadd_ps(c, _mm256_set1_ps(*a.s.get_unchecked(2 * at + min as usize)), corr[r]);
                }
            }
        }
        for r in 0..R {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * stride), _mm256_add_ps(acc[r], corr[r]));
        }
    }
}
