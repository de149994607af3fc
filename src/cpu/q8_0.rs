//! Q8_0 weights (llama.cpp's block: an f16 scale and 32 int8 values) repacked once at load for
//! AVX-512 VNNI, and their product with any number of activation rows. The activations are
//! quantized to Q8_0 blocks too (ggml's `quantize_row_q8_0`), so each block pair is an exact
//! integer dot scaled by the two f16 scales, as in llama.cpp and candle.
//!
//! Layout: panel `p` holds weight rows `16p..16p+16` (zero rows pad the last panel). For each
//! block of 32 values it stores 8 cache lines; line `g`'s 32-bit lane `r` holds row `16p+r`'s
//! values `4g..4g+4`. One `vpdpbusd` of a line with an activation quadruple broadcast to every
//! lane advances 16 rows by 4 values, so a block of 16 rows is 8 instructions (the unpacked
//! format needs about 10 per row). `vpdpbusd` multiplies unsigned by signed bytes: the weights
//! are stored offset by 128 (`w ^ 0x80`), and the offset's share, 128 × Σx over the block, is
//! taken off exactly by starting the integer accumulator at −128·Σx. The 16 rows' f16 scales
//! of two blocks share a line (`[block][row]`), which comes before those two blocks' 16 lines,
//! so a panel is one stream in address order; with every scale in lines after the panel's
//! blocks, a second stream, the 0.5B output head ([151936, 896]) decoded at 62-66 % of a ~52
//! GB/s triad (Zen 4, two cores). Same bytes as the blocks (34 per 32 weights) up to the last
//! scale line's padding.

use half::f16;
use rayon::prelude::*;

use super::panels::{Line, Panels, PANEL};

/// Values of one Q8_0 block.
pub const BLOCK: usize = 32;
/// Bytes of one Q8_0 block as llama.cpp stores it.
pub const BLOCK_BYTES: usize = 34;
/// A Q8_0 weight `[n, k]` in the panel layout above.
#[derive(Debug)]
pub struct PackedQ8(Panels);

super::panels::panel_weight!(PackedQ8);

/// Whether this machine runs the kernel (and the dispatch level allows AVX-512).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::level() == super::Level::Avx512 && std::is_x86_feature_detected!("avx512vnni")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

impl PackedQ8 {
    /// Repacks `n` rows of `k / 32` llama.cpp Q8_0 blocks. `None` when `k` is not whole blocks
    /// or `blocks` is shorter than the shape says.
    pub fn pack(blocks: &[u8], n: usize, k: usize) -> Option<PackedQ8> {
        let nb = k / BLOCK;
        if k == 0 || !k.is_multiple_of(BLOCK) || blocks.len() < n * nb * BLOCK_BYTES {
            return None;
        }
        // 0x80 is a zero weight once offset; padding rows have zero scales as well.
        Some(PackedQ8(Panels::new(n, k, nb * 8 + scale_lines(nb), Line([0x80; 64]), |p, l| {
            for pair in l.chunks_mut(PAIR_LINES) {
                pair[0] = Line([0; 64]);
            }
            for r in 0..PANEL.min(n - p * PANEL) {
                let row = &blocks[(p * PANEL + r) * nb * BLOCK_BYTES..][..nb * BLOCK_BYTES];
                for (b, blk) in row.chunks_exact(BLOCK_BYTES).enumerate() {
                    let at = 2 * (PANEL * (b % 2) + r);
                    l[scale_line(b)].0[at..at + 2].copy_from_slice(&blk[..2]);
                    // Four values a lane, offset to unsigned (`vpdpbusd` takes u8 × i8).
                    let lines = super::panels::lanes(&mut l[block_line(b)..][..8]);
                    for (line, q) in lines.iter_mut().zip(blk[2..].chunks_exact(4)) {
                        line[r] = u32::from_le_bytes([q[0], q[1], q[2], q[3]]).to_le() ^ 0x8080_8080;
                    }
                }
            }
        })))
    }

    /// `out[m, n] = x[m, k] · wᵀ`. Call only when `available()`; panics if the slices are
    /// shorter than the shapes.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        assert!(available(), "PackedQ8::matmul needs AVX-512 VNNI");
        let (n, k, nb) = (self.0.n, self.0.k, self.0.k / BLOCK);
        assert!(x.len() >= m * k && out.len() >= m * n, "PackedQ8::matmul: slices shorter than [{m},{k}]·[{n},{k}]ᵀ");
        let act = Activations::quantize(&x[..m * k], m, k);
        super::panels::run(n, m, out, |p, g, mg, res| {
            let lines = self.0.panel(p);
            debug_assert_eq!(lines.len(), nb * 8 + scale_lines(nb));
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available()` checked avx512f and avx512vnni; the panel holds `nb` blocks
            // and their scale lines, and the activations `mg` rows from `g`.
            unsafe {
                vnni::panel(lines, nb, &act, g, mg, res)
            };
        });
    }
}

/// Lines of a pair of blocks: their scale line, then each block's eight.
const PAIR_LINES: usize = 17;

/// Lines of a panel that hold its f16 scales, one per pair of blocks.
fn scale_lines(nb: usize) -> usize {
    nb.div_ceil(2)
}

/// The line holding block `b`'s 16 scales (its first or second half).
fn scale_line(b: usize) -> usize {
    b / 2 * PAIR_LINES
}

/// Block `b`'s first line of values.
fn block_line(b: usize) -> usize {
    scale_line(b) + 1 + 8 * (b % 2)
}

/// Activations quantized per 32 values, as ggml's `quantize_row_q8_0`.
struct Activations {
    /// int8 values, four to an i32 (the quadruple `vpdpbusd` broadcasts).
    q: Vec<i32>,
    /// Each block's scale, rounded through f16 as the block format stores it.
    d: Vec<f32>,
    /// −128 × each block's Σq: the weights' +128 offset taken back out.
    offset: Vec<i32>,
}

impl Activations {
    fn quantize(x: &[f32], m: usize, k: usize) -> Activations {
        let nb = k / BLOCK;
        let mut q = vec![0i32; m * k / 4];
        let mut d = vec![0f32; m * nb];
        let mut offset = vec![0i32; m * nb];
        let work = |((xs, q), (d, o)): ((&[f32], &mut [i32]), (&mut f32, &mut i32))| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available()` (checked by `matmul`) means avx512f; a block is 32 values
            // and 8 quadruples.
            let (scale, sum) = unsafe { vnni::quantize_block(xs, q) };
            #[cfg(not(target_arch = "x86_64"))]
            let (scale, sum) = quantize_block(xs, q);
            *d = f16::from_f32(scale).to_f32();
            *o = -128 * sum;
        };
        if m > 1 {
            x.par_chunks_exact(BLOCK).zip(q.par_chunks_exact_mut(BLOCK / 4)).zip(d.par_iter_mut().zip(offset.par_iter_mut())).for_each(work);
        } else {
            x.chunks_exact(BLOCK).zip(q.chunks_exact_mut(BLOCK / 4)).zip(d.iter_mut().zip(offset.iter_mut())).for_each(work);
        }
        Activations { q, d, offset }
    }
}

/// One block's values `round(x / scale)` as quadruples, `scale = max |x| / 127`; returns the
/// scale and the values' sum. (The reference for `vnni::quantize_block`, and the path without
/// it.)
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
fn quantize_block(xs: &[f32], q: &mut [i32]) -> (f32, i32) {
    let scale = xs.iter().fold(0f32, |a, v| a.max(v.abs())) / 127.0;
    let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    let mut sum = 0i32;
    for (quad, xs) in q.iter_mut().zip(xs.chunks_exact(4)) {
        let b = [0, 1, 2, 3].map(|i| (xs[i] * inv).round() as i8);
        sum += b.iter().map(|&v| v as i32).sum::<i32>();
        *quad = i32::from_le_bytes(b.map(|v| v as u8));
    }
    (scale, sum)
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::super::panels::{Line, PANEL, PASS_ROWS};
    use super::{block_line, scale_line, Activations};
    use std::arch::x86_64::*;

    /// `quantize_block` in vector registers: `x · inv` rounded half away from zero as `roundf`
    /// does (add ±0.49999997, truncate), packed to bytes with `vpmovdb`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn quantize_block(xs: &[f32], q: &mut [i32]) -> (f32, i32) {
        assert!(xs.len() >= 32 && q.len() >= 8);
        let x = [_mm512_loadu_ps(xs.as_ptr()), _mm512_loadu_ps(xs.as_ptr().add(16))];
        let scale = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x[0]), _mm512_abs_ps(x[1]))) / 127.0;
        let inv = _mm512_set1_ps(if scale != 0.0 { 1.0 / scale } else { 0.0 });
        let (sign, half) = (_mm512_set1_epi32(i32::MIN), _mm512_castps_si512(_mm512_set1_ps(0.499_999_97)));
        let mut sum = _mm512_setzero_si512();
        for h in 0..2 {
            let v = _mm512_mul_ps(x[h], inv);
            let bias = _mm512_castsi512_ps(_mm512_or_si512(_mm512_and_si512(_mm512_castps_si512(v), sign), half));
            let r = _mm512_cvttps_epi32(_mm512_add_ps(v, bias));
            sum = _mm512_add_epi32(sum, r);
            _mm_storeu_si128(q.as_mut_ptr().add(4 * h) as *mut __m128i, _mm512_cvtepi32_epi8(r));
        }
        (scale, _mm512_reduce_add_epi32(sum))
    }

    /// One panel against activation rows `g..g + mg`: `res[r * 16 + lane]`.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub unsafe fn panel(lines: &[Line], nb: usize, a: &Activations, g: usize, mg: usize, res: &mut [f32]) {
        match mg {
            1 => rows::<1>(lines, nb, a, g, res),
            2 => rows::<2>(lines, nb, a, g, res),
            3 => rows::<3>(lines, nb, a, g, res),
            4 => rows::<4>(lines, nb, a, g, res),
            5 => rows::<5>(lines, nb, a, g, res),
            6 => rows::<6>(lines, nb, a, g, res),
            7 => rows::<7>(lines, nb, a, g, res),
            _ => rows::<PASS_ROWS>(lines, nb, a, g, res),
        }
    }

    /// `M` rows (a constant, so the accumulators stay in registers). Two integer chains per row
    /// (even and odd lines) hide `vpdpbusd`'s latency at M = 1.
    #[target_feature(enable = "avx512f,avx512vnni")]
    unsafe fn rows<const M: usize>(lines: &[Line], nb: usize, a: &Activations, g: usize, res: &mut [f32]) {
        let kq = nb * 8;
        let (q, d, off) = (a.q.as_ptr().add(g * kq), a.d.as_ptr().add(g * nb), a.offset.as_ptr().add(g * nb));
        let mut acc = [_mm512_setzero_ps(); M];
        for b in 0..nb {
            let mut even = [_mm512_setzero_si512(); M];
            let mut odd = [_mm512_setzero_si512(); M];
            for (r, e) in even.iter_mut().enumerate() {
                *e = _mm512_set1_epi32(*off.add(r * nb + b));
            }
            // No software prefetch: the lines are read in address order, which the hardware
            // prefetchers follow. On the Zen 4 VM, against triad passes either side of each
            // product, a [131072, 2048] weight streamed at 86 % of the triad without hints and
            // 83 % with a hint per line four blocks ahead (six alternating runs, every one in
            // favour; into L2 at 8-32 blocks ahead no better), the 0.5B shape's output head
            // ([151936, 896]) at 79-85 % against 66-76 %, and the 3B-8L Q8_0 file decoded at
            // 84-85 % against 81-85 %. (Q6_K's panels are the other way round: 48 % without
            // their one-block-ahead hints, 90 % with.)
            let line = lines.as_ptr().add(block_line(b)) as *const __m512i;
            for h in 0..4 {
                let (w0, w1) = (_mm512_load_si512(line.add(2 * h)), _mm512_load_si512(line.add(2 * h + 1)));
                for r in 0..M {
                    let x = q.add(r * kq + b * 8 + 2 * h);
                    even[r] = _mm512_dpbusd_epi32(even[r], w0, _mm512_set1_epi32(*x));
                    odd[r] = _mm512_dpbusd_epi32(odd[r], w1, _mm512_set1_epi32(*x.add(1)));
                }
            }
            let ws = _mm512_cvtph_ps(_mm256_load_si256(lines.as_ptr().add(scale_line(b)).cast::<u8>().add(32 * (b % 2)) as *const __m256i));
            for r in 0..M {
                let dot = _mm512_cvtepi32_ps(_mm512_add_epi32(even[r], odd[r]));
                acc[r] = _mm512_fmadd_ps(dot, _mm512_mul_ps(ws, _mm512_set1_ps(*d.add(r * nb + b))), acc[r]);
            }
        }
        for (r, v) in acc.iter().enumerate() {
            _mm512_storeu_ps(res.as_mut_ptr().add(r * PANEL), *v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::packed_matches_candle;
    use candle_core::quantized::GgmlDType;

    /// Against candle's own Q8_0 matmul (which also quantizes the activations to Q8_0): rows
    /// that are not whole panels, one to many passes of activation rows, short and long rows.
    #[test]
    fn matches_candle_q8_0_matmul() -> candle_core::Result<()> {
        if !available() {
            eprintln!("no AVX-512 VNNI: candle's kernels run instead");
            return Ok(());
        }
        packed_matches_candle(GgmlDType::Q8_0, &[(1, 64, 37), (1, 896, 130), (5, 256, 20), (11, 160, 9), (8, 32, 16), (40, 320, 33)], PackedQ8::pack, PackedQ8::bytes, |n, k| n.div_ceil(16) * (16 * k / 32 * 32 + (k / 32 * 32).div_ceil(64) * 64), PackedQ8::matmul)
    }

    /// The vector quantizer rounds every value as `roundf` does, ties and extremes included.
    #[test]
    fn vector_block_quantizer_equals_the_scalar_one() {
        if !available() {
            return;
        }
        for seed in 0..200u32 {
            let mut xs: Vec<f32> = (0..32u32).map(|i| ((i * 7919 + seed * 104729) % 2001) as f32 / 1000.0 - 1.0).collect();
            xs[seed as usize % 32] = if seed % 2 == 0 { 1.27 } else { -1.27 };
            // Scaled so that some values land exactly on halves (ties), or all zero.
            let f = [1.0, 127.0 / 254.0, 0.5, 0.0][seed as usize % 4];
            xs.iter_mut().for_each(|v| *v *= f);
            let (mut a, mut b) = ([0i32; 8], [0i32; 8]);
            let want = quantize_block(&xs, &mut a);
            #[cfg(target_arch = "x86_64")]
            let got = unsafe { vnni::quantize_block(&xs, &mut b) };
            #[cfg(not(target_arch = "x86_64"))]
            let got = quantize_block(&xs, &mut b);
            assert_eq!((a, want), (b, got), "seed {seed}");
        }
    }

    /// Rows that are not whole blocks, or too few bytes, are refused rather than misread.
    #[test]
    fn refuses_partial_blocks() {
        assert!(PackedQ8::pack(&[0u8; 34 * 4], 2, 48).is_none());
        assert!(PackedQ8::pack(&[0u8; 34 * 3], 2, 64).is_none());
        assert!(PackedQ8::pack(&[0u8; 34 * 4], 2, 64).is_some());
    }
}
