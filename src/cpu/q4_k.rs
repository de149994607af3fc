//! Q4_K and Q5_K weights (llama.cpp's k-quants: per 256 values an f16 scale `d` and min
//! `dmin`, eight 6-bit sub-block scales and mins, 128 bytes of 4-bit values and, for Q5_K, 32
//! bytes of fifth bits) repacked once at load for AVX-512 VNNI, and their product with any
//! number of activation rows. The activations are quantized to Q8_K as ggml's
//! `quantize_row_q8_K` does (candle's too; `blocks::act::Q8K`), so a block pair is
//! `d_x · (d · Σ_j sc_j · dot_j − dmin · Σ_j m_j · Σx_j)` with exact integer dots `dot_j` of
//! each 32-value sub-block — the sum candle and llama.cpp compute, in another order.
//!
//! Layout: panel `p` holds weight rows `16p..16p+16` (padding rows are zero); per block it
//! stores 37 lines (Q5_K: 45). Line 0: the 16 rows' `d` then their `dmin` (f16). Lines 1–2:
//! `sc_j` as a byte per row (`[j][row]`). Lines 3–4: the mins as byte pairs `(m_2i, m_2i+1)`
//! per row (`[i][row][2]`), widened in registers to the 16-bit pairs `vpdpwssd` takes. Q5_K
//! only, lines 5–12: the fifth bits as the block stores them, line `5 + t` lane `r` row `r`'s
//! bytes `4t..4t + 4`. Then (from line `N` = 5, or 13 for Q5_K) the 4-bit values exactly as
//! the block stores them, four bytes per row per line: line `N + 8q + t` lane `r` is row `r`'s
//! bytes `32q + 4t..32q + 4t + 4`, whose low nibbles are values `64q + 4t..` (sub-block `2q`)
//! and high nibbles values `64q + 32 + 4t..` (sub-block `2q + 1`); bit `2q` of the fifth-bit
//! byte in the same place of line `5 + t` is the fifth bit of the low nibble, bit `2q + 1`
//! that of the high one. So one line (and one fifth-bit line, rotated and merged by a
//! `vpternlogd`) and one `vpdpbusd` (unsigned 4- or 5-bit × signed 8-bit) advance 16 rows by
//! four values. 2,368 bytes per 16 rows and 256 values: 2.8 % more than the Q4_K blocks'
//! 2,304; Q5_K 2,880 against 2,816 (2.3 %).
//!
//! Q5_K was held in `blocks`' groups of eight rows at this level too, whose 512-bit pass reads
//! a panel's two groups as two streams, so one to four activation rows went the 256-bit way,
//! group by group. Here a panel's blocks are one stream for every count of rows: on a Zen 5
//! VM, one row against a [4864, 1024] weight in cache 1.5× the groups' rate (142 against 96
//! GB/s), two 1.28×, four 1.56×; 256 rows 1.1× (570 against 515-519 GMAC/s).

use super::blocks::act::Q8K;
use super::panels::{Line, Panels, PANEL};

/// Values of one Q4_K block.
pub const BLOCK: usize = 256;
/// Bytes of one Q4_K block as llama.cpp stores it.
pub const BLOCK_BYTES: usize = 144;
/// Bytes of one Q5_K block.
const BLOCK_BYTES_Q5: usize = 176;
/// Lines of one panel's block (Q4_K; Q5_K adds `FIFTH` lines of fifth bits).
const LINES: usize = 37;
const FIFTH: usize = 8;
const META: usize = 5;

/// A Q4_K or Q5_K weight `[n, k]` in the panel layout above (which of the two, its lines per
/// block say).
#[derive(Debug)]
pub struct PackedQ4K(Panels);

super::panels::panel_weight!(PackedQ4K);

/// Whether this machine runs the kernel (and the dispatch level allows AVX-512).
pub fn available() -> bool {
    super::q8_0::available()
}

/// Sub-block `j`'s 6-bit scale and min from a block's 12 scale bytes (ggml's `get_scale_min_k4`).
pub(crate) fn scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

/// The first line of a panel's block's nibbles: after Q5_K's fifth bits (`five`), so the
/// first chunk of a block reads its lines in address order.
const fn nibbles(five: bool) -> usize {
    if five {
        META + FIFTH
    } else {
        META
    }
}

/// Lines of a panel's block: Q5_K's (`five`) or Q4_K's.
const fn lines(five: bool) -> usize {
    if five {
        LINES + FIFTH
    } else {
        LINES
    }
}

impl PackedQ4K {
    /// Repacks `n` rows of `k / 256` llama.cpp Q4_K blocks. `None` when `k` is not whole blocks
    /// or `blocks` is shorter than the shape says.
    pub fn pack(blocks: &[u8], n: usize, k: usize) -> Option<PackedQ4K> {
        Self::pack_blocks(false, blocks, n, k)
    }

    /// `pack` for Q5_K blocks.
    pub fn pack_q5k(blocks: &[u8], n: usize, k: usize) -> Option<PackedQ4K> {
        Self::pack_blocks(true, blocks, n, k)
    }

    fn pack_blocks(five: bool, blocks: &[u8], n: usize, k: usize) -> Option<PackedQ4K> {
        let (nb, file_bytes, lines) = (k / BLOCK, if five { BLOCK_BYTES_Q5 } else { BLOCK_BYTES }, lines(five));
        if k == 0 || !k.is_multiple_of(BLOCK) || blocks.len() < n * nb * file_bytes {
            return None;
        }
        let qs = if five { 48 } else { 16 };
        Some(PackedQ4K(Panels::new(n, k, nb * lines, Line([0; 64]), |p, l| {
            for r in 0..PANEL.min(n - p * PANEL) {
                let row = &blocks[(p * PANEL + r) * nb * file_bytes..][..nb * file_bytes];
                for (b, blk) in row.chunks_exact(file_bytes).enumerate() {
                    let l = &mut l[b * lines..(b + 1) * lines];
                    l[0].0[2 * r..2 * r + 2].copy_from_slice(&blk[0..2]);
                    l[0].0[32 + 2 * r..32 + 2 * r + 2].copy_from_slice(&blk[2..4]);
                    for j in 0..8 {
                        let (sc, m) = scale_min(j, &blk[4..16]);
                        l[1 + j / 4].0[(j % 4) * PANEL + r] = sc;
                        l[3 + j / 4].0[(j / 2 % 2) * 32 + 2 * r + j % 2] = m;
                    }
                    for (i, &q) in blk[qs..qs + 128].iter().enumerate() {
                        l[nibbles(five) + i / 4].0[4 * r + i % 4] = q;
                    }
                    for (i, &h) in blk[16..48].iter().enumerate().filter(|_| five) {
                        l[META + i / 4].0[4 * r + i % 4] = h;
                    }
                }
            }
        })))
    }

    /// `out[m, n] = x[m, k] · wᵀ`. Call only when `available()`; panics if the slices are
    /// shorter than the shapes.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        assert!(available(), "PackedQ4K::matmul needs AVX-512 VNNI");
        let (n, k) = (self.0.n, self.0.k);
        let five = self.0.per_panel() == k / BLOCK * lines(true);
        assert!(x.len() >= m * k && out.len() >= m * n, "PackedQ4K::matmul: slices shorter than [{m},{k}]·[{n},{k}]ᵀ");
        let act = Q8K::quantize(&x[..m * k], m, k).pairs();
        super::panels::run(n, m, out, |p, g, mg, res| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available()` checked avx512f/bw and avx512vnni; the panel holds `k / 256`
            // blocks and the activations `mg` rows from `g`.
            unsafe {
                if five {
                    vnni::panel::<true>(self.0.panel(p), k / BLOCK, &act, g, mg, res)
                } else {
                    vnni::panel::<false>(self.0.panel(p), k / BLOCK, &act, g, mg, res)
                }
            };
        });
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::super::panels::{Line, PANEL};
    use super::super::blocks::simd::avx2::prefetch_step;
    use super::{Q8K, META};
    use std::arch::x86_64::*;

    /// One panel (Q5_K if `FIVE`, else Q4_K) against activation rows `g..g + mg`:
    /// `res[r * 16 + lane]`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn panel<const FIVE: bool>(lines: &[Line], nb: usize, a: &Q8K, g: usize, mg: usize, res: &mut [f32]) {
        let mut r = 0;
        while r < mg {
            let left = mg - r;
            let out = &mut res[r * PANEL..];
            match left {
                1 => rows::<FIVE, 1>(lines, nb, a, g + r, out),
                2 => rows::<FIVE, 2>(lines, nb, a, g + r, out),
                3 => rows::<FIVE, 3>(lines, nb, a, g + r, out),
                _ => rows::<FIVE, 4>(lines, nb, a, g + r, out),
            }
            r += left.min(4);
        }
    }

    /// `M` activation rows from `g` (a constant, so the accumulators stay in registers).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn rows<const FIVE: bool, const M: usize>(lines: &[Line], nb: usize, a: &Q8K, g: usize, res: &mut [f32]) {
        let (nibble, sixteen, per_block) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x10), super::lines(FIVE));
        // A block's share of the weight stream's prefetch, a line or two a step.
        let step = (per_block * 64).div_ceil(32);
        let mut acc = [_mm512_setzero_ps(); M];
        for b in 0..nb {
            // The stream is prefetched `AHEAD` past the block, a line or two a step
            // (`prefetch_step`, as the AVX2 groups do). On a Zen 5 VM, one activation row
            // streaming a [262144, 1024] weight at a ~71-74 GB/s triad, with `AHEAD` then 4 KiB:
            // Q4_K 75-83 GB/s with it, 69-71 with the hardware prefetchers alone, and Q5_K
            // 32-35 without it (its fifth-bit lines before or behind the nibbles alike)
            // against 74-78 with it. (On a Zen 4 VM a hint per line two blocks ahead, all at
            // the block's start, had streamed Q4_K at 0.78-0.92× the rate without hints.)
            let l = lines.as_ptr().add(b * per_block) as *const __m512i;
            // Row r's activation quadruple `quad` of this block, broadcast.
            macro_rules! x {
                ($r:expr, $quad:expr) => {
                    _mm512_set1_epi32(*a.quads().as_ptr().add((($r + g) * nb + b) * 64 + $quad))
                };
            }
            let meta = _mm512_load_si512(l);
            let mut isum = [_mm512_setzero_si512(); M];
            for q in 0..4 {
                let mut lo = [_mm512_setzero_si512(); M];
                let mut hi = [_mm512_setzero_si512(); M];
                // Q5_K: bit 2q of each fifth-bit byte (under the low nibbles) and bit 2q + 1
                // (under the high ones) rotated to bit 4 within its 32-bit lane, so bit 4 of
                // each byte comes from its own byte.
                let (rl, rh) = (_mm512_set1_epi32((4 - 2 * q as i32) & 31), _mm512_set1_epi32((3 - 2 * q as i32) & 31));
                for t in 0..8 {
                    prefetch_step(l as *const u8, 8 * q + t, step);
                    let w = _mm512_load_si512(l.add(super::nibbles(FIVE) + 8 * q + t));
                    let (mut wl, mut wh) = (_mm512_and_si512(w, nibble), _mm512_and_si512(_mm512_srli_epi16::<4>(w), nibble));
                    if FIVE {
                        // `v | (bit & 16)`, one `vpternlogd` each (byte masks and a masked add
                        // took three instructions a vector).
                        let bits = _mm512_load_si512(l.add(META + t));
                        wl = _mm512_ternarylogic_epi32::<0xF8>(wl, _mm512_rolv_epi32(bits, rl), sixteen);
                        wh = _mm512_ternarylogic_epi32::<0xF8>(wh, _mm512_rolv_epi32(bits, rh), sixteen);
                    }
                    for r in 0..M {
                        lo[r] = _mm512_dpbusd_epi32(lo[r], wl, x!(r, 16 * q + t));
                        hi[r] = _mm512_dpbusd_epi32(hi[r], wh, x!(r, 16 * q + 8 + t));
                    }
                }
                // Sub-blocks 2q and 2q + 1's scales, a byte per row.
                let sc = l.add(1) as *const u8;
                let sl = _mm512_cvtepu8_epi32(_mm_loadu_si128(sc.add(2 * q * PANEL) as *const __m128i));
                let sh = _mm512_cvtepu8_epi32(_mm_loadu_si128(sc.add((2 * q + 1) * PANEL) as *const __m128i));
                for r in 0..M {
                    isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(lo[r], sl), _mm512_mullo_epi32(hi[r], sh)));
                }
            }
            // Σ_j m_j · Σx_j as four 16-bit pair products per row.
            let mins = l.add(3) as *const __m256i;
            let mut msum = [_mm512_setzero_si512(); M];
            for i in 0..4 {
                let mp = _mm512_cvtepu8_epi16(_mm256_load_si256(mins.add(i)));
                for (r, s) in msum.iter_mut().enumerate() {
                    *s = _mm512_dpwssd_epi32(*s, mp, _mm512_set1_epi32(*a.pairs.as_ptr().add(((g + r) * nb + b) * 4 + i)));
                }
            }
            let d = _mm512_cvtph_ps(_mm512_castsi512_si256(meta));
            let dmin = _mm512_cvtph_ps(_mm512_extracti64x4_epi64::<1>(meta));
            for r in 0..M {
                let dx = _mm512_set1_ps(*a.d.as_ptr().add((g + r) * nb + b));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, dx), acc[r]);
                acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(msum[r]), _mm512_mul_ps(dmin, dx), acc[r]);
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

    /// Against candle's own Q4_K and Q5_K matmuls (which quantize the activations to Q8_K the
    /// same way): rows that are not whole panels, one to many passes of activation rows,
    /// several blocks.
    #[test]
    fn matches_candle_q4k_q5k_matmul() -> candle_core::Result<()> {
        if !available() {
            eprintln!("no AVX-512 VNNI: candle's kernels run instead");
            return Ok(());
        }
        let shapes = [(1, 256, 37), (1, 1024, 130), (2, 512, 16), (5, 256, 20), (11, 768, 9), (40, 512, 33)];
        type Pack = fn(&[u8], usize, usize) -> Option<PackedQ4K>;
        for (dtype, pack, five) in [(GgmlDType::Q4K, PackedQ4K::pack as Pack, false), (GgmlDType::Q5K, PackedQ4K::pack_q5k, true)] {
            packed_matches_candle(dtype, &shapes, pack, PackedQ4K::bytes, |n, k| n.div_ceil(16) * k / 256 * lines(five) * 64, PackedQ4K::matmul)?;
        }
        Ok(())
    }

    /// Rows that are not whole blocks, or too few bytes, are refused rather than misread.
    #[test]
    fn refuses_partial_blocks() {
        assert!(PackedQ4K::pack(&[0u8; 144 * 4], 2, 384).is_none());
        assert!(PackedQ4K::pack(&[0u8; 144 * 3], 2, 512).is_none());
        assert!(PackedQ4K::pack(&[0u8; 144 * 4], 2, 512).is_some());
        assert!(PackedQ4K::pack_q5k(&[0u8; 176 * 3], 2, 512).is_none());
        assert!(PackedQ4K::pack_q5k(&[0u8; 176 * 4], 2, 512).is_some());
    }
}
