//! Q6_K weights (llama.cpp's k-quant: per 256 values 128 bytes of low nibbles `ql`, 64 bytes
//! of high bit pairs `qh`, sixteen signed 8-bit sub-block scales and an f16 `d`; a value is
//! `d · sc_j · (q − 32)` with `q` in 0..64) repacked once at load for AVX-512 VNNI, and their
//! product with any number of activation rows. The activations are Q8_K
//! (`blocks::act::Q8K`), so a block pair is `d_x · d · (Σ_j sc_j · dot_j − 32 · Σ_j sc_j · Σx_j)` over the
//! sixteen 16-value sub-blocks, with exact integer dots — the sum candle and llama.cpp compute,
//! in another order.
//! Q4_K_M files hold a fifth of their layer weights (`attn_v`, half the `ffn_down`s) and the
//! output head in Q6_K, which without this ran on the AVX2 block kernels.
//!
//! Layout: panel `p` holds weight rows `16p..16p+16` (padding rows are zero); per block it
//! stores 53 lines. Line 0: the 16 rows' `d` (f16). Lines 1–4: `sc_j` as a byte per row
//! (`[j][row]`). Then per half `h` of 128 values, 24 lines, the bytes exactly as the block
//! stores them, four bytes per row per line: 16 lines of `ql` (line `t`: bytes `4t..4t + 4` of
//! the half's 64) and 8 of `qh` (bytes `4t..4t + 4` of its 32). As in ggml, `ql` byte `l`'s low
//! nibble is value `l` (or `32 + l − 32` for `l ≥ 32`) and its high nibble value `64 + l`, with
//! `qh` byte `l mod 32` giving their top two bits at shifts 0, 2, 4, 6. So four masked lines
//! per three loads and four `vpdpbusd`s advance 16 rows by sixteen values. 3,392 bytes per 16
//! rows and 256 values: 1 % more than the blocks' 3,360.

use super::panels::{Line, Panels, PANEL};
use super::blocks::act::Q8K;
use super::q4_k::BLOCK;

/// Bytes of one Q6_K block as llama.cpp stores it.
pub const BLOCK_BYTES: usize = 210;
/// Lines of one panel's block.
const LINES: usize = 53;
const META: usize = 5;
/// Lines of one half block's values.
const HALF: usize = 24;

/// A Q6_K weight `[n, k]` in the panel layout above.
#[derive(Debug)]
pub struct PackedQ6K(Panels);

super::panels::panel_weight!(PackedQ6K);

/// Whether this machine runs the kernel (and the dispatch level allows AVX-512).
pub fn available() -> bool {
    super::q8_0::available()
}

impl PackedQ6K {
    /// Repacks `n` rows of `k / 256` llama.cpp Q6_K blocks. `None` when `k` is not whole blocks
    /// or `blocks` is shorter than the shape says.
    pub fn pack(blocks: &[u8], n: usize, k: usize) -> Option<PackedQ6K> {
        let nb = k / BLOCK;
        if k == 0 || !k.is_multiple_of(BLOCK) || blocks.len() < n * nb * BLOCK_BYTES {
            return None;
        }
        Some(PackedQ6K(Panels::new(n, k, nb * LINES, Line([0; 64]), |p, l| {
            for r in 0..PANEL.min(n - p * PANEL) {
                let row = &blocks[(p * PANEL + r) * nb * BLOCK_BYTES..][..nb * BLOCK_BYTES];
                for (b, blk) in row.chunks_exact(BLOCK_BYTES).enumerate() {
                    pack_block(&mut l[b * LINES..(b + 1) * LINES], r, blk);
                }
            }
        })))
    }

    /// `out[m, n] = x[m, k] · wᵀ`. Call only when `available()`; panics if the slices are
    /// shorter than the shapes.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        assert!(available(), "PackedQ6K::matmul needs AVX-512 VNNI");
        let (n, k) = (self.0.n, self.0.k);
        assert!(x.len() >= m * k && out.len() >= m * n, "PackedQ6K::matmul: slices shorter than [{m},{k}]·[{n},{k}]ᵀ");
        let act = Q8K::quantize(&x[..m * k], m, k);
        super::panels::run(n, m, out, |p, g, mg, res| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available()` checked avx512f/bw and avx512vnni; the panel holds `k / 256`
            // blocks and the activations `mg` rows from `g`.
            unsafe {
                vnni::panel(self.0.panel(p), k / BLOCK, &act, g, mg, res)
            };
        });
    }
}

/// Row `r`'s block (ggml's `block_q6_K`: ql[128], qh[64], scales[16], d) into a panel block.
fn pack_block(l: &mut [Line], r: usize, blk: &[u8]) {
    let (ql, qh, sc, d) = (&blk[..128], &blk[128..192], &blk[192..208], &blk[208..210]);
    l[0].0[2 * r..2 * r + 2].copy_from_slice(d);
    for (j, &s) in sc.iter().enumerate() {
        l[1 + j / 4].0[(j % 4) * PANEL + r] = s;
    }
    for h in 0..2 {
        let base = META + h * HALF;
        for (i, &q) in ql[64 * h..64 * h + 64].iter().enumerate() {
            l[base + i / 4].0[4 * r + i % 4] = q;
        }
        for (i, &q) in qh[32 * h..32 * h + 32].iter().enumerate() {
            l[base + 16 + i / 4].0[4 * r + i % 4] = q;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::super::panels::{Line, PANEL};
    use super::{Q8K, HALF, LINES, META};
    use std::arch::x86_64::*;

    /// Blocks ahead to prefetch at batch 1 (a block is 53 lines; 1 measured best of 1–4: at 2
    /// and more the decode fell 2–5 % behind the AVX2 block kernel on the same bytes).
    const PREFETCH: usize = 1;

    /// One panel against activation rows `g..g + mg`: `res[r * 16 + lane]`, four rows a pass
    /// where there are (a [11008, 2048] weight against 256 rows in cache: 422-431 GMAC/s
    /// against three's 355-361 on a Zen 5 VM).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub unsafe fn panel(lines: &[Line], nb: usize, a: &Q8K, g: usize, mg: usize, res: &mut [f32]) {
        let mut r = 0;
        while r < mg {
            let left = mg - r;
            let out = &mut res[r * PANEL..];
            match left {
                1 => rows::<1>(lines, nb, a, g + r, out),
                2 => rows::<2>(lines, nb, a, g + r, out),
                3 => rows::<3>(lines, nb, a, g + r, out),
                _ => rows::<4>(lines, nb, a, g + r, out),
            }
            r += left.min(4);
        }
    }

    /// `M` activation rows from `g` (a constant, so the accumulators stay in registers: four
    /// sub-block dots per row are open at a time).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn rows<const M: usize>(lines: &[Line], nb: usize, a: &Q8K, g: usize, res: &mut [f32]) {
        let (low, top) = (_mm512_set1_epi8(0x0f), _mm512_set1_epi8(0x30));
        let mut acc = [_mm512_setzero_ps(); M];
        for b in 0..nb {
            let l = lines.as_ptr().add(b * LINES) as *const __m512i;
            let ahead = l.add(LINES * PREFETCH);
            // Row r's activation quadruple `quad` of this block, broadcast.
            macro_rules! x {
                ($r:expr, $quad:expr) => {
                    _mm512_set1_epi32(*a.quads().as_ptr().add((($r + g) * nb + b) * 64 + $quad))
                };
            }
            // The sub-block scales, a byte per row (`[j][row]`).
            let sc = l.add(1) as *const i8;
            let mut isum = [_mm512_setzero_si512(); M];
            for h in 0..2 {
                let v = l.add(META + h * HALF);
                for tg in 0..2 {
                    // Sub-blocks 8h + tg, + 2, + 4, + 6: values 128h + 64·(k/2)… in quads.
                    let mut dot = [[_mm512_setzero_si512(); M]; 4];
                    for tt in 0..4 {
                        let t = 4 * tg + tt;
                        // The block PREFETCH ahead, in address order: four lines an iteration.
                        let c = 8 * h + t;
                        if M <= 2 && 4 * c < LINES {
                            for line in 4 * c..(4 * c + 4).min(LINES) {
                                _mm_prefetch::<_MM_HINT_T0>(ahead.add(line) as *const i8);
                            }
                        }
                        let (qa, qb, qh) = (_mm512_load_si512(v.add(t)), _mm512_load_si512(v.add(8 + t)), _mm512_load_si512(v.add(16 + t)));
                        // Each value: the nibble's bits under `low`, its two top bits
                        // masked to bits 4-5 (`(A & low) | B`, one `vpternlogd`).
                        let w = [
                            _mm512_ternarylogic_epi32::<0xEC>(qa, _mm512_and_si512(_mm512_slli_epi16::<4>(qh), top), low),
                            _mm512_ternarylogic_epi32::<0xEC>(qb, _mm512_and_si512(_mm512_slli_epi16::<2>(qh), top), low),
                            _mm512_ternarylogic_epi32::<0xEC>(_mm512_srli_epi16::<4>(qa), _mm512_and_si512(qh, top), low),
                            _mm512_ternarylogic_epi32::<0xEC>(_mm512_srli_epi16::<4>(qb), _mm512_and_si512(_mm512_srli_epi16::<2>(qh), top), low),
                        ];
                        for (kk, wk) in w.iter().enumerate() {
                            for r in 0..M {
                                dot[kk][r] = _mm512_dpbusd_epi32(dot[kk][r], *wk, x!(r, 32 * h + 8 * kk + t));
                            }
                        }
                    }
                    for (kk, d) in dot.iter().enumerate() {
                        let j = 8 * h + 2 * kk + tg;
                        let s = _mm512_cvtepi8_epi32(_mm_loadu_si128(sc.add(j * PANEL) as *const __m128i));
                        for r in 0..M {
                            isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(d[r], s));
                        }
                    }
                }
            }
            // The values' offset of 32: 32 · Σ_j sc_j · Σx_j, the scales as 16-bit pairs
            // (sc_2i, sc_2i+1) against the activations' 16-value sums read as the same pairs:
            // eight `vpdpwssd` a row where a broadcast, subtract, `vpmulld` and add per
            // sub-block were sixteen of each.
            let mut pairs = [_mm512_setzero_si512(); 8];
            for (i, p) in pairs.iter_mut().enumerate() {
                let lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(sc.add(2 * i * PANEL) as *const __m128i));
                let hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(sc.add((2 * i + 1) * PANEL) as *const __m128i));
                *p = _mm512_or_si512(_mm512_and_si512(lo, _mm512_set1_epi32(0xffff)), _mm512_slli_epi32::<16>(hi));
            }
            let d = _mm512_cvtph_ps(_mm256_load_si256(l as *const __m256i));
            for r in 0..M {
                let sums = a.bsums.as_ptr().add(((g + r) * nb + b) * 16) as *const i32;
                let mut off = _mm512_setzero_si512();
                for (i, p) in pairs.iter().enumerate() {
                    off = _mm512_dpwssd_epi32(off, *p, _mm512_set1_epi32(sums.add(i).read_unaligned()));
                }
                let isum = _mm512_sub_epi32(isum[r], _mm512_slli_epi32::<5>(off));
                let dx = _mm512_set1_ps(*a.d.as_ptr().add((g + r) * nb + b));
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, dx), acc[r]);
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

    /// Against candle's own Q6_K matmul (which quantizes the activations to Q8_K the same way):
    /// rows that are not whole panels, one to many passes of activation rows, several blocks.
    #[test]
    fn matches_candle_q6k_matmul() -> candle_core::Result<()> {
        if !available() {
            eprintln!("no AVX-512 VNNI: the block kernels run instead");
            return Ok(());
        }
        packed_matches_candle(GgmlDType::Q6K, &[(1, 256, 37), (1, 1024, 130), (2, 512, 16), (3, 256, 20), (5, 256, 20), (11, 768, 9), (40, 512, 33)], PackedQ6K::pack, PackedQ6K::bytes, |n, k| n.div_ceil(16) * k / 256 * 53 * 64, PackedQ6K::matmul)
    }

    /// A row's numbers do not depend on the activation rows beside it, bit for bit, through
    /// every pass size (three, two, one): decode and prefill agree.
    #[test]
    fn rows_are_batch_invariant() -> candle_core::Result<()> {
        if !available() {
            return Ok(());
        }
        let (k, n) = (512, 40);
        let (x, blocks, _) = crate::cpu::testing::quantized_case(GgmlDType::Q6K, 15, k, n)?;
        let w = PackedQ6K::pack(&blocks, n, k).expect("whole blocks");
        let mut all = vec![0f32; 15 * n];
        w.matmul(&x, 15, &mut all);
        for m in [1, 2, 3, 5, 7, 8, 9] {
            let mut some = vec![0f32; m * n];
            w.matmul(&x, m, &mut some);
            assert_eq!(some, all[..m * n], "{m} rows");
        }
        Ok(())
    }

    /// Rows that are not whole blocks, or too few bytes, are refused rather than misread.
    #[test]
    fn refuses_partial_blocks() {
        assert!(PackedQ6K::pack(&[0u8; 210 * 4], 2, 384).is_none());
        assert!(PackedQ6K::pack(&[0u8; 210 * 3], 2, 512).is_none());
        assert!(PackedQ6K::pack(&[0u8; 210 * 4], 2, 512).is_some());
    }
}
