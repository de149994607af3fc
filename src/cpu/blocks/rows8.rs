//! The 32-value block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) eight rows at a time with AVX2,
//! sixteen at the AVX-512 level with VNNI (where Q8_0 takes `q8_0`'s panels). In the file's
//! layout each row is dotted on its own: per block of 32 values a row pays for its integer
//! dot and then, alone, for converting it, loading and multiplying its scale, one FMA and its
//! offset term, and each row ends in a horizontal sum (on a 0.5B model's rows of 896 values,
//! 28 blocks, that overhead was a large part of a decode step). Here block `b` of eight rows
//! lies together, so the eight rows' integer dots are reduced into the lanes of one vector and
//! scaled, offset and accumulated by a few vector instructions for all eight. A block's
//! integer dot is exact and the blocks are added in one order whatever the number of
//! activation rows in a pass, so decode and prefill give a row the same numbers (the prefix
//! cache relies on it).
//!
//! A group's block `b` is the file's eight blocks `b` of rows `8g..8g+8` regrouped, the same
//! bytes: the eight `d` (f16), the eight `m` (the min formats Q4_1, Q5_1), the fifth bits
//! (Q5_0, Q5_1), then the quants. Every format holds the same byte column of the eight rows
//! side by side, as `q4k8` does: step `i`'s 32 bytes are each row's bytes `4i..4i + 4` in its
//! 32-bit lane (eight steps for Q8_0, four for the 4/5-bit formats, where one mask gives the
//! eight rows' values `4i..4i + 4` and a shift and mask their values `16 + 4i..`), so one
//! broadcast of four activation bytes serves all eight rows, whose sums land in their own
//! lanes with no horizontal adds. (Rows paired in 128-bit lanes took three horizontal adds a
//! block per activation row; on two Zen 5 cores this layout decodes a weight in cache at
//! 1.16× (Q4_0) and 1.30× (Q5_0) that rate at the AVX-512 level, 1.08× and 1.11× at AVX2.
//! Q8_0 with each row's 32 bytes a vector took six `vphaddd` and two permutes a block per
//! activation row, and its eight vectors and their absolute values spilled: the lanes ran
//! 256-row products of a [11008, 2048] weight at 1.6-1.7× its rate on a 2-core Zen 3, and
//! decode at 1.05×.) The fifth bits
//! of the block's 8 × 32 values fill 32 bytes, bit `s` of byte `4r + j` under byte `4r + j`
//! of vector `s` (step `s / 2`'s low vector for even `s`, high for odd), so one load and a
//! 16-bit shift per vector put every byte's bit at bit 4, where an AND and an OR (one
//! `vpternlogd` at the AVX-512 level) add 16. The AVX-512 level holds a 16-row panel's two
//! groups with their blocks alternating (`interleave`) and takes both at once in 512-bit
//! vectors (`panel`) for every number of activation rows; eight rows a pass instead of four
//! measured 0.87-1.0× in either width.
//! Rows past the weight's last are zeros.

use super::act::Q8;
use super::Format;

/// Rows interleaved in a group.
pub const ROWS: usize = 8;

/// Offsets in a group's block: the `m`s, the fifth bits, the quants.
#[derive(Clone, Copy)]
struct Parts {
    m: usize,
    qh: usize,
    qs: usize,
}

const fn parts(f: Format) -> Parts {
    let min = matches!(f, Format::Q4_1 | Format::Q5_1);
    let q5 = matches!(f, Format::Q5_0 | Format::Q5_1);
    let qh = 16 + if min { 16 } else { 0 };
    let qs = qh + if q5 { 32 } else { 0 };
    Parts { m: 16, qh, qs }
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

/// Group `g` of the file's rows (`nb` blocks each; rows `>= n` left as the zeros `out` holds)
/// written into `out` (`group_bytes`, zeros).
pub fn pack_group(f: Format, blocks: &[u8], n: usize, nb: usize, g: usize, out: &mut [u8]) {
    #[cfg(target_arch = "x86_64")]
    if f == Format::Q8_0 && n - g * ROWS >= ROWS && std::is_x86_feature_detected!("avx2") {
        let row_bytes = nb * f.bytes();
        // SAFETY: AVX2 checked just above.
        return unsafe { avx2::pack_q8(&blocks[g * ROWS * row_bytes..][..ROWS * row_bytes], nb, out) };
    }
    pack_rows(f, blocks, n, nb, g, out)
}

/// `pack_group` a row and a block at a time, every format.
fn pack_rows(f: Format, blocks: &[u8], n: usize, nb: usize, g: usize, out: &mut [u8]) {
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
            for i in 0..steps(f) {
                dst[p.qs + 32 * i + 4 * r..][..4].copy_from_slice(&src[fqs + 4 * i..][..4]);
            }
            if let Some(at) = fqh {
                let file = u32::from_le_bytes(src[at..at + 4].try_into().unwrap());
                for j in 0..4 {
                    dst[p.qh + 4 * r + j] = fifth_byte(file, j);
                }
            }
        }
    }
}

/// Steps of 32 bytes in a group's block: each row's bytes `4i..4i + 4` in its lane.
const fn steps(f: Format) -> usize {
    if matches!(f, Format::Q8_0) {
        8
    } else {
        4
    }
}

/// Fifth-bit byte `4r + j` of a group's block from row `r`'s 32 bits as the file holds them
/// (bit `v` for value `v`): vector `s = 2i + h` holds value `4i + j + 16h` of the row in byte
/// `4r + j`, so bit `s` is file bit `4i + j + 16h` — the file's bits `j, j + 4, .., j + 12`
/// to the even bits, `j + 16, .., j + 28` to the odd ones (bit twiddling: packing runs at
/// load, over every block of the file).
fn fifth_byte(file: u32, j: usize) -> u8 {
    // Bits j + 4i (i < 4) of `w` as bits 0..4.
    let gather = |w: u32| {
        let x = (w >> j) & 0x1111;
        let x = (x | x >> 3) & 0x0303;
        (x | x >> 6) & 0x000f
    };
    // Bit i to bit 2i.
    let spread = |x: u32| {
        let y = (x | x << 2) & 0x33;
        (y | y << 1) & 0x55
    };
    (spread(gather(file)) | spread(gather(file >> 16)) << 1) as u8
}

/// A panel's two groups, `groups` (group 0's `group_bytes` then group 1's), into `out` with
/// their blocks alternating: block `b` of group 0, block `b` of group 1, block `b + 1` of
/// group 0, ... so the 512-bit pass (`panel`), which reads both groups' block `b` together,
/// streams one run of addresses. Read as two runs, one per group, the pass decoded a 0.5B
/// Q4_K_M file at 0.94× the eight-row kernel's rate on a Zen 5 VM (75-77 GB/s triad).
pub fn interleave(f: Format, k: usize, groups: &[u8], out: &mut [u8]) {
    let (gb, bb) = (group_bytes(f, k), ROWS * f.bytes());
    for (b, pair) in out[..2 * gb].chunks_exact_mut(2 * bb).enumerate() {
        pair[..bb].copy_from_slice(&groups[b * bb..][..bb]);
        pair[bb..].copy_from_slice(&groups[gb + b * bb..][..bb]);
    }
}

/// Group `g` (at `w`, `nb` blocks) against activation rows `r0..r0 + R`: `out[r · stride + l]`
/// for the group's rows `l < 8`. Needs AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
pub fn rows<const F: u8, const R: usize>(w: *const u8, nb: usize, a: &Q8, r0: usize, out: &mut [f32], stride: usize) {
    assert!(out.len() >= (R - 1) * stride + ROWS && a.q.len() >= (r0 + R) * nb * 32, "rows8::rows: slices shorter than the shapes");
    // SAFETY: the caller (`PackedBlocks::matmul`) checked avx2, fma and f16c; `w` holds `nb`
    // blocks of the group, and the activations and `out` are long enough (asserted above).
    unsafe {
        if F == Format::Q8_0 as u8 {
            avx2::rows_q8::<R>(w, nb, a, r0, out, stride)
        } else {
            avx2::rows_lanes::<F, R>(w, nb, a, r0, out, stride)
        }
    }
}

/// A panel (at `w`, `nb` blocks of each group, as `interleave` holds them) of a 4/5-bit format
/// against activation rows `r0..r0 + rows`: `out[r · stride + l]` for the panel's rows
/// `l < 16`, the same bits as `rows` on each group (lane for lane the same integer sums and
/// float operations), four activation rows a pass. One broadcast of four activation bytes, one
/// nibble split and one fifth-bit shift serve sixteen rows in 512-bit vectors where `rows`
/// spends them on eight: on two Zen 5 cores a weight in cache decodes at 1.3-1.4× the eight-row
/// rate and 256-row prefill runs at 1.5-1.7× it. Needs the AVX-512 level with VNNI, VL and BW
/// (`vnni()`).
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
pub fn panel(f: Format, w: *const u8, nb: usize, a: &Q8, r0: usize, out: &mut [f32], stride: usize, rows: usize) {
    assert!(rows > 0 && super::vnni() && f != Format::Q8_0 && out.len() >= (rows - 1) * stride + 2 * ROWS && a.q.len() >= (r0 + rows) * nb * 32, "rows8::panel: no VNNI, Q8_0, or slices shorter than the shapes");
    macro_rules! pass {
        ($F:ident, $r:expr, $out:expr, $ahead:expr) => {{
            const F: u8 = Format::$F as u8;
            // SAFETY: checked above; `w` holds `nb` blocks of each of the panel's groups.
            unsafe {
                match rows - $r {
                    4.. => zmm::panel::<F, 4>(w, nb, a, r0 + $r, $out, stride, $ahead),
                    3 => zmm::panel::<F, 3>(w, nb, a, r0 + $r, $out, stride, $ahead),
                    2 => zmm::panel::<F, 2>(w, nb, a, r0 + $r, $out, stride, $ahead),
                    _ => zmm::panel::<F, 1>(w, nb, a, r0 + $r, $out, stride, $ahead),
                }
            }
        }};
    }
    let mut r = 0;
    while r < rows {
        let o = &mut out[r * stride..];
        // Only the first pass over a panel in each block of activation rows hints the lines
        // ahead: the later ones find the panel in cache, and their hints into the next panel
        // evicted it (256-row prefill 0.87-0.94×).
        let ahead = (r0 + r).is_multiple_of(crate::cpu::panels::ROW_BLOCK);
        r += match f {
            Format::Q4_0 => pass!(Q4_0, r, o, ahead),
            Format::Q4_1 => pass!(Q4_1, r, o, ahead),
            Format::Q5_0 => pass!(Q5_0, r, o, ahead),
            _ => pass!(Q5_1, r, o, ahead),
        };
    }
}

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // `r` and `l` index several arrays at once
mod avx2 {
    use super::super::act::Q8;
    use super::super::simd::avx2::{four, nibbles, prefetch};
    use super::super::Format;
    use super::{parts, ROWS};
    use std::arch::x86_64::*;

    /// Eight whole rows of Q8_0 (`rows`, `nb` file blocks each) into a group (`out`) as
    /// `pack_rows` writes it: each block's eight `d`, then the rows' quants as an 8 × 8
    /// transpose of 32-bit words (row `r`'s word `i` to step `i`'s lane `r`; `panels`' f32
    /// transpose, which only moves bits). Copied four
    /// bytes at a time, Q8_0 packed at ~0.67× the rate of the file layout's whole-block copies
    /// (10 against 15 GB/s on a Zen 3 core) and held up a Q8_0 file's first token, whose
    /// panels are staged from the file while the repacking runs; this runs at ~12.
    #[target_feature(enable = "avx2")]
    pub unsafe fn pack_q8(rows: &[u8], nb: usize, out: &mut [u8]) {
        let (fb, gb, qs) = (Format::Q8_0.bytes(), ROWS * Format::Q8_0.bytes(), parts(Format::Q8_0).qs);
        assert!(rows.len() >= ROWS * nb * fb && out.len() >= nb * gb, "rows8::pack_q8: slices shorter than the shapes");
        for b in 0..nb {
            let dst = out.as_mut_ptr().add(b * gb);
            let src = |r: usize| rows.as_ptr().add(r * nb * fb + b * fb);
            for r in 0..ROWS {
                std::ptr::copy_nonoverlapping(src(r), dst.add(2 * r), 2);
            }
            // The words as f32 lanes: the transpose only moves bits.
            let v: [__m256; ROWS] = std::array::from_fn(|r| _mm256_loadu_ps(src(r).add(2) as *const f32));
            for (i, line) in crate::cpu::panels::avx2::transpose8(v).into_iter().enumerate() {
                _mm256_storeu_ps(dst.add(qs + 32 * i) as *mut f32, line);
            }
        }
    }

    /// The eight vectors of a 4/5-bit format's block at `blk`, unsigned (0..16, 0..32): step
    /// `i`'s low nibbles at `2i` (values `4i..4i + 4` of each row in its lane), its high ones at
    /// `2i + 1` (values `16 + 4i..`).
    #[inline(always)]
    unsafe fn nibble_vectors<const F: u8>(blk: *const u8) -> [__m256i; 8] {
        let p = parts(Format::from_id(F));
        let mut v = [_mm256_setzero_si256(); 8];
        for i in 0..4 {
            (v[2 * i], v[2 * i + 1]) = nibbles(blk.add(p.qs + 32 * i));
        }
        v
    }

    /// Bit `s` of each of a block's 32 fifth-bit bytes moved to bit 4, for each vector `s`
    /// (16-bit shifts: bits that cross into the next byte are masked off later, and bit 4 of a
    /// byte comes from that byte).
    #[inline(always)]
    unsafe fn at_bit4<const F: u8>(blk: *const u8) -> [__m256i; 8] {
        let bits = _mm256_loadu_si256(blk.add(parts(Format::from_id(F)).qh) as *const __m256i);
        [
            _mm256_slli_epi16::<4>(bits),
            _mm256_slli_epi16::<3>(bits),
            _mm256_slli_epi16::<2>(bits),
            _mm256_slli_epi16::<1>(bits),
            bits,
            _mm256_srli_epi16::<1>(bits),
            _mm256_srli_epi16::<2>(bits),
            _mm256_srli_epi16::<3>(bits),
        ]
    }

    /// `nibble_vectors` with the fifth bits (16 where set) for Q5_0 and Q5_1.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn vectors<const F: u8>(blk: *const u8) -> [__m256i; 8] {
        let mut v = nibble_vectors::<F>(blk);
        if F == Format::Q5_0 as u8 || F == Format::Q5_1 as u8 {
            let (at4, sixteen) = (at_bit4::<F>(blk), _mm256_set1_epi8(0x10));
            for s in 0..8 {
                v[s] = _mm256_or_si256(v[s], _mm256_and_si256(at4[s], sixteen));
            }
        }
        v
    }

    /// The 4/5-bit formats' eight row sums of one block against the activations at `x`, row
    /// `l` in lane `l`: `vpmaddubsw` pair sums of the low vectors and of the high ones, each
    /// four steps added in 16 bits (at most 4 · 2 · 31 · 127 = 31 496), then widened.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn sums_maddubs(v: &[__m256i; 8], x: *const i8) -> __m256i {
        let (mut lo, mut hi) = (_mm256_setzero_si256(), _mm256_setzero_si256());
        for i in 0..4 {
            lo = _mm256_add_epi16(lo, _mm256_maddubs_epi16(v[2 * i], four(x.add(4 * i))));
            hi = _mm256_add_epi16(hi, _mm256_maddubs_epi16(v[2 * i + 1], four(x.add(16 + 4 * i))));
        }
        let ones = _mm256_set1_epi16(1);
        _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones))
    }

    /// The 4/5-bit formats: the group's eight rows in the lanes of one accumulator per
    /// activation row.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows_lanes<const F: u8, const R: usize>(w: *const u8, nb: usize, a: &Q8, r0: usize, out: &mut [f32], stride: usize) {
        let f = Format::from_id(F);
        let min = matches!(f, Format::Q4_1 | Format::Q5_1);
        let offset = if f == Format::Q4_0 { -8.0 } else { -16.0 };
        let gb = ROWS * f.bytes();
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let blk = w.add(b * gb);
            prefetch(blk, gb);
            let v = vectors::<F>(blk);
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            let m = if min { _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i)) } else { _mm256_setzero_ps() };
            for r in 0..R {
                let at = (r0 + r) * nb + b;
                let (sums, dx) = (_mm256_cvtepi32_ps(sums_maddubs(&v, a.q.as_ptr().add(at * 32))), _mm256_mul_ps(d, _mm256_set1_ps(*a.d.get_unchecked(at))));
                if min {
                    // m · d_x · Σq, with d_x · Σq through f16 as ggml's `block_q8_1`
                    // holds it.
                    acc[r] = _mm256_fmadd_ps(m, _mm256_set1_ps(*a.s.get_unchecked(2 * at + 1)), _mm256_fmadd_ps(sums, dx, acc[r]));
                } else {
                    // The offset in the integers, as ggml's dot takes it: the sums and
                    // offset · Σq are integers below 2^24, so their f32 sum is exact.
                    // One FMA a block on each row's accumulator: a second (the offset
                    // apart) lengthened the chain, and a second accumulator a row
                    // spilled AVX2's sixteen registers at four rows.
                    acc[r] = _mm256_fmadd_ps(_mm256_add_ps(sums, _mm256_set1_ps(offset * *a.s.get_unchecked(2 * at))), dx, acc[r]);
                }
            }
        }
        for r in 0..R {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * stride), acc[r]);
        }
    }

    /// Q8_0: step `i`'s vector holds each row's bytes `4i..4i + 4` in its lane, so one
    /// broadcast of four activation bytes serves the eight rows and their sums land in their
    /// own lanes. `vpmaddubsw` takes unsigned × signed, so the weights' signs move onto the
    /// activations; |w| is taken once per step for every activation row of the pass. Each
    /// step's pair sums (at most 2 · 128 · 127) are widened at once: two would overflow 16
    /// bits. The integer sums are exact, so the bits are those of a row-at-a-time dot.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows_q8<const R: usize>(w: *const u8, nb: usize, a: &Q8, r0: usize, out: &mut [f32], stride: usize) {
        let (gb, qs) = (ROWS * Format::Q8_0.bytes(), parts(Format::Q8_0).qs);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let blk = w.add(b * gb);
            prefetch(blk, gb);
            let mut sums = [_mm256_setzero_si256(); R];
            for i in 0..8 {
                let v = _mm256_loadu_si256(blk.add(qs + 32 * i) as *const __m256i);
                let u = _mm256_sign_epi8(v, v);
                for r in 0..R {
                    let x = four(a.q.as_ptr().add(((r0 + r) * nb + b) * 32 + 4 * i));
                    sums[r] = _mm256_add_epi32(sums[r], _mm256_madd_epi16(_mm256_maddubs_epi16(u, _mm256_sign_epi8(x, v)), ones));
                }
            }
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            for r in 0..R {
                let at = (r0 + r) * nb + b;
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), _mm256_mul_ps(d, _mm256_set1_ps(*a.d.get_unchecked(at))), acc[r]);
            }
        }
        for r in 0..R {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * stride), acc[r]);
        }
    }
}

/// `avx2::rows_lanes` over both groups of an interleaved panel in 512-bit vectors with
/// `vpdpbusd` and `vpternlogd` (the same exact integer sums as `vpmaddubsw` + `vpmaddwd`, the
/// same bits as the AVX2 AND and OR): group 0's lanes in the low half, group 1's in the high
/// one.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // `r` indexes several per-row arrays at once
mod zmm {
    use super::super::act::Q8;
    use super::super::simd::avx2::prefetch;
    use super::super::simd::avx512::{both, both16};
    use super::super::Format;
    use super::{parts, ROWS};
    use std::arch::x86_64::*;

    /// `R` activation rows from `r0` (a constant, so the accumulators stay in registers);
    /// returns `R`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn panel<const F: u8, const R: usize>(w: *const u8, nb: usize, a: &Q8, r0: usize, out: &mut [f32], stride: usize, ahead: bool) -> usize {
        let (f, m4, sixteen) = (Format::from_id(F), _mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x10));
        let (p, gb) = (parts(f), ROWS * f.bytes());
        let min = matches!(f, Format::Q4_1 | Format::Q5_1);
        let offset = if f == Format::Q4_0 { -8.0 } else { -16.0 };
        let mut acc = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let (b0, b1) = (w.add(2 * b * gb), w.add((2 * b + 1) * gb));
            if ahead {
                prefetch(b0, 2 * gb);
            }
            let mut v = [_mm512_setzero_si512(); 8];
            for i in 0..4 {
                let q = both(b0, b1, p.qs + 32 * i);
                (v[2 * i], v[2 * i + 1]) = (_mm512_and_si512(q, m4), _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4));
            }
            if F == Format::Q5_0 as u8 || F == Format::Q5_1 as u8 {
                let bits = both(b0, b1, p.qh);
                let at4 = [
                    _mm512_slli_epi16::<4>(bits),
                    _mm512_slli_epi16::<3>(bits),
                    _mm512_slli_epi16::<2>(bits),
                    _mm512_slli_epi16::<1>(bits),
                    bits,
                    _mm512_srli_epi16::<1>(bits),
                    _mm512_srli_epi16::<2>(bits),
                    _mm512_srli_epi16::<3>(bits),
                ];
                for s in 0..8 {
                    v[s] = _mm512_ternarylogic_epi32::<0xF8>(v[s], at4[s], sixteen);
                }
            }
            let d = _mm512_cvtph_ps(both16(b0, b1, 0));
            let m = if min { _mm512_cvtph_ps(both16(b0, b1, 16)) } else { _mm512_setzero_ps() };
            for r in 0..R {
                let at = (r0 + r) * nb + b;
                let x = a.q.as_ptr().add(at * 32).cast::<i32>();
                let (mut lo, mut hi) = (_mm512_setzero_si512(), _mm512_setzero_si512());
                for i in 0..4 {
                    lo = _mm512_dpbusd_epi32(lo, v[2 * i], _mm512_set1_epi32(x.add(i).read_unaligned()));
                    hi = _mm512_dpbusd_epi32(hi, v[2 * i + 1], _mm512_set1_epi32(x.add(4 + i).read_unaligned()));
                }
                let (sums, dx) = (_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), _mm512_mul_ps(d, _mm512_set1_ps(*a.d.get_unchecked(at))));
                // `rows_lanes`' operations, lane for lane.
                if min {
                    acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(*a.s.get_unchecked(2 * at + 1)), _mm512_fmadd_ps(sums, dx, acc[r]));
                } else {
                    acc[r] = _mm512_fmadd_ps(_mm512_add_ps(sums, _mm512_set1_ps(offset * *a.s.get_unchecked(2 * at))), dx, acc[r]);
                }
            }
        }
        for r in 0..R {
            _mm512_storeu_ps(out.as_mut_ptr().add(r * stride), acc[r]);
        }
        R
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;

    /// `fifth_byte` against its definition (bit `s` of byte `j` is file bit
    /// `4(s / 2) + j + 16(s % 2)`), on every single bit and a few mixed words.
    #[test]
    fn fifth_bytes_hold_each_vector_its_bit() {
        let words = (0..32).map(|b| 1u32 << b).chain([0, u32::MAX, 0x8421_1248, 0xdead_beef, 0x0f0f_3c3c]);
        for file in words {
            for j in 0..4 {
                let want = (0..8).fold(0u8, |w, s| w | ((file >> (4 * (s / 2) + j + 16 * (s % 2))) as u8 & 1) << s);
                assert_eq!(fifth_byte(file, j), want, "{file:#x}, byte {j}");
            }
        }
    }

    /// Q8_0's transposing pack writes the bytes of the row-by-row one, in a weight whose last
    /// group is whole and in one whose last group is not (that group takes `pack_rows`).
    #[test]
    fn q8_0_packs_as_row_by_row() {
        let nb = 5;
        for n in [16usize, 13] {
            let blocks: Vec<u8> = (0..n * nb * 34).map(|i| (i * 131 % 251) as u8).collect();
            for g in 0..n.div_ceil(ROWS) {
                let (mut got, mut want) = (vec![0u8; group_bytes(Format::Q8_0, 32 * nb)], vec![0u8; group_bytes(Format::Q8_0, 32 * nb)]);
                pack_group(Format::Q8_0, &blocks, n, nb, g, &mut got);
                pack_rows(Format::Q8_0, &blocks, n, nb, g, &mut want);
                assert_eq!(got, want, "{n} rows, group {g}");
            }
        }
    }

    /// Q8_0 bytes of −128 (a file may hold them; ggml's quantizer stops at −127) against
    /// activations of ±127 (scale 1, so every number is an exact integer): each step's pair
    /// sums reach 2 · 128 · 127 = 32 512, so they must be widened step by step (two steps
    /// wrap 16 bits) and |−128| must read as 128. Each row's product is exactly ∓128 · 127 · k.
    #[test]
    fn q8_0_extremes_do_not_wrap() {
        if !super::super::available() {
            return;
        }
        let (n, k) = (8, 512);
        let mut block = [0x80u8; 34];
        block[..2].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
        let blocks: Vec<u8> = (0..n * k / 32).flat_map(|_| block).collect();
        let w = super::super::PackedBlocks::pack(Format::Q8_0, &blocks, n, k).expect("whole blocks");
        let x: Vec<f32> = (0..2 * k).map(|i| if i < k { 127.0 } else { -127.0 }).collect();
        let mut out = vec![0f32; 2 * n];
        w.matmul(&x, 2, &mut out);
        let want: Vec<f32> = (0..2 * n).map(|i| if i < n { -128.0 * 127.0 * k as f32 } else { 128.0 * 127.0 * k as f32 }).collect();
        assert_eq!(out, want);
    }

    /// The 512-bit pass over an interleaved panel gives each of its two groups the bits of the
    /// AVX2 eight-row kernel (`vpdpbusd`'s exact sums equal `vpmaddubsw` + `vpmaddwd`'s, the
    /// fifth bits set by `vpternlogd` the AND and OR's), so a file gives the same numbers at
    /// either level: every 4/5-bit format, fifteen rows (group 1's last one zero), one to five
    /// activation rows (a four-row pass and its remainder), eight blocks. (Both against candle:
    /// `every_format_matches_candle`.)
    #[test]
    fn interleaved_panels_give_the_avx2_bits() -> candle_core::Result<()> {
        if !super::super::vnni() {
            eprintln!("no AVX-512 VNNI at this level: nothing to compare");
            return Ok(());
        }
        fn check<const F: u8>(dtype: GgmlDType) -> candle_core::Result<()> {
            let (f, k, n, rows) = (Format::from_id(F), 256, 15, 5);
            let (x, blocks, _) = crate::cpu::testing::quantized_case(dtype, rows, k, n)?;
            let gb = group_bytes(f, k);
            let mut groups = vec![0u8; 2 * gb];
            for (h, group) in groups.chunks_exact_mut(gb).enumerate() {
                pack_group(f, &blocks, n, k / 32, h, group);
            }
            let mut held = vec![0u8; groups.len()];
            interleave(f, k, &groups, &mut held);
            let a = Q8::quantize(&x, rows, k);
            let stride = 2 * ROWS;
            let (mut want, mut got) = (vec![0f32; rows * stride], vec![0f32; rows * stride]);
            for (h, group) in groups.chunks_exact(gb).enumerate() {
                super::rows::<F, 4>(group.as_ptr(), k / 32, &a, 0, &mut want[h * ROWS..], stride);
                super::rows::<F, 1>(group.as_ptr(), k / 32, &a, 4, &mut want[4 * stride + h * ROWS..], stride);
            }
            panel(f, held.as_ptr(), k / 32, &a, 0, &mut got, stride, rows);
            assert_eq!(got, want, "{f:?}");
            assert!(want.iter().any(|v| *v != 0.0), "{f:?}: a product of zeros proves nothing");
            Ok(())
        }
        check::<{ Format::Q4_0 as u8 }>(GgmlDType::Q4_0)?;
        check::<{ Format::Q4_1 as u8 }>(GgmlDType::Q4_1)?;
        check::<{ Format::Q5_0 as u8 }>(GgmlDType::Q5_0)?;
        check::<{ Format::Q5_1 as u8 }>(GgmlDType::Q5_1)
    }
}
