//! bf16 weights repacked once at load, and their product with any number of bf16 activation
//! rows: batch-1 decode streams each panel once, and prefill reuses each panel from the core's
//! cache across its rows (see `panels`), so one kernel serves both.
//!
//! Layout: panel `p` holds weight rows `16p..16p+16` (zero rows pad the last panel); its line
//! `i`'s 32-bit lane `r` holds row `16p+r`'s values `2i, 2i+1` (a zero pads an odd row
//! length). With AVX-512 BF16, `vdpbf16ps` of a line with one activation pair broadcast to
//! every lane advances 16 rows by 2 values (`dp`). Elsewhere a line widens to two f32 vectors
//! in registers (a shift for the low values, a mask for the high ones) for two FMAs: in halves
//! with AVX2 + FMA (`fma`: Zen 3, Intel client CPUs), whole with AVX-512 where `vdpbf16ps` is
//! slower than that (`fma512`, see `dots`), the two giving the same bits. Either way products
//! of bf16 are exact in f32 and sums are f32, as the unpacked kernel in `matvec` computes
//! them. Same bytes as the plain weight.

use half::bf16;
use super::panels::{Line, Panels, PANEL};

/// Activation rows from which a product takes two panels per pass.
const PAIR_ROWS: usize = 2;

/// A bf16 weight `[n, k]` in the panel layout above.
#[derive(Debug)]
pub struct PackedBf16(Panels);

super::panels::panel_weight!(PackedBf16);

/// Whether this machine runs a packed kernel at the dispatch level: AVX-512 BF16 or AVX2 + FMA.
pub fn available() -> bool {
    avx512() || fma()
}

/// Whether the dispatch level allows AVX-512 BF16 instructions.
pub fn avx512() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::level() == super::Level::Avx512 && std::is_x86_feature_detected!("avx512bf16")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// Whether products take `vdpbf16ps` (the `dp` kernel) rather than widening to f32. On the
/// Intel cores with AVX-512 BF16 it issues at half the rate of f32 FMAs of the same width (an
/// Emerald Rapids VM: 171 against 338 GFLOP/s of independent chains on 2 threads), so the
/// widened kernel's 16 FMAs and 2 widenings a line per 8 rows outrun it (256-row products
/// of a 3B MLP weight: see `benches/panels.rs`); on Zen 5 it issues at twice that rate. The
/// choice is by vendor, not by a timing, so a machine's results are the same from run to run.
pub fn dots() -> bool {
    avx512() && !super::intel()
}

/// Whether the AVX2 + FMA kernel runs (Level::Avx2 or above is chosen only with both).
fn fma() -> bool {
    cfg!(target_arch = "x86_64") && super::level() >= super::Level::Avx2
}

/// The kernels a product may take: `vdpbf16ps` (`dp`), or widening to f32 in 512-bit lines
/// (`fma512`) or 256-bit halves (`fma`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kernel {
    Dots,
    Wide,
    Halves,
}

/// The kernel products take on this machine at the dispatch level.
fn kernel() -> Kernel {
    if dots() {
        Kernel::Dots
    } else if super::level() == super::Level::Avx512 {
        Kernel::Wide
    } else {
        Kernel::Halves
    }
}

impl PackedBf16 {
    /// Repacks a row-major `[n, k]` weight. Panics if `w` is shorter than the shape.
    pub fn pack(w: &[bf16], n: usize, k: usize) -> PackedBf16 {
        assert!(w.len() >= n * k, "PackedBf16::pack: {} values for [{n}, {k}]", w.len());
        Self::pack_rows(n, k, |r| &w[r * k..][..k])
    }

    /// Repacks the weight whose row `r` is `row(r)` (`k` values each; rows may lie apart).
    pub fn pack_rows<'a>(n: usize, k: usize, row: impl Fn(usize) -> &'a [bf16] + Sync) -> PackedBf16 {
        PackedBf16(Panels::new(n, k, k.div_ceil(2), Line([0; 64]), |p, l| stage(n, &row, p, l)))
    }

    /// `out[m, n] = x[m, k] · wᵀ` in f32. Call only when `available()`; panics if the slices
    /// are shorter than the shapes.
    pub fn matmul(&self, x: &[bf16], m: usize, out: &mut [f32]) {
        self.matmul_with(kernel(), x, m, out)
    }

    fn matmul_with(&self, kernel: Kernel, x: &[bf16], m: usize, out: &mut [f32]) {
        let panels = &self.0;
        product(kernel, panels.n, panels.k, x, m, out, |p, f| f(panels.panel(p)), Some(|p: usize| [panels.panel(p), panels.panel(p + 1)]))
    }
}

/// `PackedBf16::pack_rows(n, k, row).matmul(x, m, out)` without the packed copy, the same
/// bits: each panel staged from the rows as the product reaches it (`panels::Staged`; as
/// `fp32::matmul_rows`). Panels go one at a time (a pair kernel gives the same bits).
pub fn matmul_rows<'a>(n: usize, k: usize, row: impl Fn(usize) -> &'a [bf16] + Sync, x: &[bf16], m: usize, out: &mut [f32]) {
    let staged = super::panels::Staged::new(k.div_ceil(2), |p, l: &mut [Line]| stage(n, &row, p, l));
    product(kernel(), n, k, x, m, out, |p, f| staged.with(p, f), None::<fn(usize) -> [&'static [Line]; 2]>)
}

/// Panel `p` of the rows, every byte of its lines: a lane holds a pair of values, the first in
/// its low half, so a row's pairs are its 32-bit words (an odd k's last lane holds the last
/// value and a zero; lanes past the last row are zero).
fn stage<'a>(n: usize, row: &impl Fn(usize) -> &'a [bf16], p: usize, l: &mut [Line]) {
    let rows: Vec<&[bf16]> = (p * PANEL..n.min(p * PANEL + PANEL)).map(row).collect();
    let whole = rows.first().map_or(0, |r| r.len() / 2);
    super::panels::transpose_words(&rows.iter().map(|r| super::panels::as_bytes(r)).collect::<Vec<_>>(), &mut l[..whole]);
    if let Some(last) = l.get_mut(whole) {
        let lanes = &mut super::panels::lanes(std::slice::from_mut(last))[0];
        for (r, lane) in lanes.iter_mut().enumerate() {
            *lane = rows.get(r).and_then(|row| row.last()).map_or(0, |v| v.to_bits() as u32).to_le();
        }
    }
}

/// The product over panels that `panel(p, f)` hands to `f`; `pair(p)`, where given, holds
/// panels `p` and `p + 1` for the two-panel AVX-512 pass.
#[allow(clippy::too_many_arguments)]
fn product<'w>(kernel: Kernel, n: usize, k: usize, x: &[bf16], m: usize, out: &mut [f32], panel: impl Fn(usize, &mut dyn FnMut(&[Line])) + Sync, pair: Option<impl Fn(usize) -> [&'w [Line]; 2] + Sync>) {
    assert!(available(), "PackedBf16::matmul needs AVX-512 BF16 or AVX2 + FMA");
    let level = super::level();
    assert!(kernel != Kernel::Dots || avx512(), "bf16 product: vdpbf16ps without AVX-512 BF16");
    assert!(kernel != Kernel::Wide || level == super::Level::Avx512, "bf16 product: 512-bit kernel below the AVX-512 level");
    let pairs = k.div_ceil(2);
    assert!(x.len() >= m * k && out.len() >= m * n, "PackedBf16::matmul: slices shorter than [{m},{k}]·[{n},{k}]ᵀ");
    if kernel != Kernel::Dots {
        return product_fma(n, k, x, m, out, panel, kernel == Kernel::Wide);
    }
    // Activation pairs as the 32-bit values the kernel broadcasts.
    let mut xp = vec![0u32; m * pairs];
    for (row, xs) in xp.chunks_exact_mut(pairs).zip(x.chunks_exact(k)) {
        for (i, v) in xs.iter().enumerate() {
            row[i / 2] |= (v.to_bits() as u32) << (16 * (i % 2));
        }
    }
    let xp = &xp;
    let one = |p: usize, g: usize, mg: usize, res: &mut [f32]| {
        let x = &xp[g * pairs..(g + mg) * pairs];
        panel(p, &mut |lines| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `Kernel::Dots` is taken only with avx512f and avx512bf16 (`avx512()`); the
            // panel holds `pairs` lines and the activations `mg` rows of `pairs` from `g`.
            unsafe {
                dp::panel(lines, x, pairs, mg, res)
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (lines, x, &res);
        });
    };
    // Two panels per pass once there are several rows: a decode step streams one panel at a
    // time, which the prefetchers follow best.
    let two = pair.as_ref().map(|pair| {
        move |p: usize, g: usize, mg: usize, a: &mut [f32], b: &mut [f32]| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as `one`, for panels `p` and `p + 1`.
            unsafe {
                dp::panel_pair(pair(p), &xp[g * pairs..(g + mg) * pairs], pairs, mg, [a, b])
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (pair, p, g, mg, a, b);
        }
    });
    super::panels::run_pairs(n, m, out, one, two.filter(|_| m >= PAIR_ROWS));
}

/// `product` with FMAs: the activations widened to f32 once (rows of `2 · pairs`, a zero after
/// an odd `k`), each line widened in registers; 512-bit at the AVX-512 level, 256-bit halves
/// below it (same bits).
fn product_fma(n: usize, k: usize, x: &[bf16], m: usize, out: &mut [f32], panel: impl Fn(usize, &mut dyn FnMut(&[Line])) + Sync, wide: bool) {
    let stride = 2 * k.div_ceil(2);
    let mut xf = vec![0f32; m * stride];
    for (row, xs) in xf.chunks_exact_mut(stride).zip(x.chunks_exact(k)) {
        for (o, v) in row.iter_mut().zip(xs) {
            *o = v.to_f32();
        }
    }
    super::panels::run(n, m, out, |p, g, mg, res| {
        let x = &xf[g * stride..(g + mg) * stride];
        panel(p, &mut |lines| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available()` means Level::Avx2 or above (avx2 and fma detected);
            // `Kernel::Wide` is taken only at the AVX-512 level (avx512f); the panel holds
            // `pairs` lines and `x` rows `g..g + mg` of `stride`.
            unsafe {
                if wide {
                    fma512::panel(lines, x, stride, mg, res)
                } else {
                    fma::panel(lines, x, stride, mg, res)
                }
            };
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (lines, x, wide, &res);
        });
    });
}

#[cfg(target_arch = "x86_64")]
mod fma {
    use super::super::panels::{Line, PANEL};
    use super::dp::PREFETCH;
    use std::arch::x86_64::*;

    /// One panel against `mg` activation rows of `stride` f32 values: `res[r * 16 + lane]`.
    /// Every row is summed the same way whatever shares its pass (its own accumulators, lines
    /// in order), so a row's product does not depend on its batch nor on how many rows a pass
    /// takes. Every row count runs here, prefill too: candle's f32 GEMM on the widened weight
    /// ran nearer the f32 peak (94 % against these panels' 73 % at 256 rows, while `rows`
    /// spilled an accumulator; a Zen 3 VM since: panels 71-79 %, candle 74-76 %), but it sums in
    /// another order than decode, so a prefix computed in a longer chunk gave other K/V than
    /// the same prefix from the cache.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn panel(lines: &[Line], x: &[f32], stride: usize, mg: usize, res: &mut [f32]) {
        let three = three_rows();
        let mut r = 0;
        while r < mg {
            let (x, out) = (&x[r * stride..], &mut res[r * PANEL..]);
            match mg - r {
                1 => rows::<1>(lines, x, stride, out),
                2 => rows::<2>(lines, x, stride, out),
                _ if three => rows::<3>(lines, x, stride, out),
                _ => rows::<2>(lines, x, stride, out),
            }
            r += if three { 3 } else { 2 };
        }
    }

    /// Whether a pass takes three rows: twelve accumulators, which fit the sixteen registers
    /// beside two widened weights and a broadcast because `rows` widens a line's low values
    /// for every row before its high ones; two rows' eight FMA chains wait more on each
    /// other's latency. Until `rows` did that, four widened weights were live and one of three
    /// rows' accumulators lived on the stack: on a Zen 4 (AVX-512 hardware, this kernel forced
    /// by `MERG_CPU_KERNELS=avx2`) that accumulator's store-to-load chain set the pace
    /// (`perf annotate`: 30 % of the samples on its FMA) and two rows prefilled a 3B-width BF16
    /// file at 1.6× the rate of three, so CPUs with AVX-512 took two. Without the spill, three
    /// rows ran 1.7-1.85× the spilled three on a Zen 3 VM (256-row products of the 3B MLP
    /// weights, same bits). CPUs with AVX-512 still take two until measured again there.
    fn three_rows() -> bool {
        !std::is_x86_feature_detected!("avx512f")
    }

    /// `M` activation rows against one panel: per row and half panel one accumulator for the
    /// lines' low values and one for their high values, added at the end.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows<const M: usize>(lines: &[Line], x: &[f32], stride: usize, res: &mut [f32]) {
        let l = lines.as_ptr() as *const __m256i;
        let xp = x.as_ptr();
        let mut acc = [[[_mm256_setzero_ps(); 2]; 2]; M];
        let mask = _mm256_set1_epi32(0xffff_0000u32 as i32);
        for i in 0..lines.len() {
            if M == 1 {
                _mm_prefetch::<_MM_HINT_T0>(l.add(2 * (i + PREFETCH)) as *const i8);
            }
            let x = |r: usize| xp.add(r * stride + 2 * i);
            // The low values of both halves against every row, then the high ones: only two
            // widened weights are live at a time, so three rows' twelve accumulators stay in
            // registers. The line is read again for the high values (from L1; a volatile read,
            // so the compiler does not keep the raw line live instead).
            let (e0, e1) = (_mm256_load_si256(l.add(2 * i)), _mm256_load_si256(l.add(2 * i + 1)));
            let (lo0, lo1) = (_mm256_castsi256_ps(_mm256_slli_epi32::<16>(e0)), _mm256_castsi256_ps(_mm256_slli_epi32::<16>(e1)));
            for (r, a) in acc.iter_mut().enumerate() {
                let xe = _mm256_broadcast_ss(&*x(r));
                a[0][0] = _mm256_fmadd_ps(lo0, xe, a[0][0]);
                a[1][0] = _mm256_fmadd_ps(lo1, xe, a[1][0]);
            }
            let (o0, o1) = (std::ptr::read_volatile(l.add(2 * i)), std::ptr::read_volatile(l.add(2 * i + 1)));
            let (hi0, hi1) = (_mm256_castsi256_ps(_mm256_and_si256(o0, mask)), _mm256_castsi256_ps(_mm256_and_si256(o1, mask)));
            for (r, a) in acc.iter_mut().enumerate() {
                let xo = _mm256_broadcast_ss(&*x(r).add(1));
                a[0][1] = _mm256_fmadd_ps(hi0, xo, a[0][1]);
                a[1][1] = _mm256_fmadd_ps(hi1, xo, a[1][1]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            for (h, a) in a.iter().enumerate() {
                _mm256_storeu_ps(res.as_mut_ptr().add(r * PANEL + 8 * h), _mm256_add_ps(a[0], a[1]));
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod fma512 {
    use super::super::panels::{Line, PANEL, PASS_ROWS};
    use super::dp::PREFETCH;
    use std::arch::x86_64::*;

    /// One panel against `mg` activation rows of `stride` f32 values: `res[r * 16 + lane]`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn panel(lines: &[Line], x: &[f32], stride: usize, mg: usize, res: &mut [f32]) {
        for r in (0..mg).step_by(PASS_ROWS) {
            let (x, out) = (&x[r * stride..], &mut res[r * PANEL..]);
            match mg - r {
                1 => rows::<1>(lines, x, stride, out),
                2 => rows::<2>(lines, x, stride, out),
                3 => rows::<3>(lines, x, stride, out),
                4 => rows::<4>(lines, x, stride, out),
                5 => rows::<5>(lines, x, stride, out),
                6 => rows::<6>(lines, x, stride, out),
                7 => rows::<7>(lines, x, stride, out),
                _ => rows::<PASS_ROWS>(lines, x, stride, out),
            }
        }
    }

    /// `M` activation rows against one panel: per row one accumulator for the lines' low
    /// values and one for their high values, added at the end, lane for lane the operations of
    /// `fma::rows` (so the AVX2 level gives the same bits). Eight rows' sixteen accumulators
    /// fit AVX-512's 32 registers beside the widened line, and each widening serves them all.
    #[target_feature(enable = "avx512f")]
    unsafe fn rows<const M: usize>(lines: &[Line], x: &[f32], stride: usize, res: &mut [f32]) {
        let l = lines.as_ptr() as *const __m512i;
        let xp = x.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); 2]; M];
        let mask = _mm512_set1_epi32(0xffff_0000u32 as i32);
        for i in 0..lines.len() {
            if M == 1 {
                _mm_prefetch::<_MM_HINT_T0>(l.wrapping_add(i + PREFETCH) as *const i8);
            }
            let v = _mm512_load_si512(l.add(i));
            let (lo, hi) = (_mm512_castsi512_ps(_mm512_slli_epi32::<16>(v)), _mm512_castsi512_ps(_mm512_and_si512(v, mask)));
            for (r, a) in acc.iter_mut().enumerate() {
                let x = xp.add(r * stride + 2 * i);
                a[0] = _mm512_fmadd_ps(lo, _mm512_set1_ps(*x), a[0]);
                a[1] = _mm512_fmadd_ps(hi, _mm512_set1_ps(*x.add(1)), a[1]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            _mm512_storeu_ps(res.as_mut_ptr().add(r * PANEL), _mm512_add_ps(a[0], a[1]));
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod dp {
    use super::super::panels::{Line, PANEL};
    use std::arch::x86_64::*;

    /// Lines ahead to prefetch at batch 1 (4 KiB; measured on the layer shapes of a 0.5B
    /// model: 8 → 23.5, 16 → 22.5, 32 → 24.5, 64 → 24.9, 128 → 24.2 GB/s); the AVX2 kernel
    /// takes the same.
    pub(super) const PREFETCH: usize = 64;

    /// One panel against `mg` activation rows: `res[r * 16 + lane]`.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn panel(lines: &[Line], x: &[u32], pairs: usize, mg: usize, res: &mut [f32]) {
        super::super::panels::panel_rows!(one, mg, (lines, x, pairs, res))
    }

    /// `rows` of one panel, in the form `panels::panel_rows!` dispatches.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn one<const M: usize, const C: usize>(lines: &[Line], x: &[u32], pairs: usize, res: &mut [f32]) {
        rows::<M, C, 1>([lines], x, pairs, [res])
    }

    /// Two panels against `mg` activation rows, four rows at a time: each activation
    /// broadcast serves both panels' lines. `rows` sums every output alike for one panel or
    /// two (the same `C` chains over the same pairs), so pairs never change a result.
    #[target_feature(enable = "avx512f,avx512bf16")]
    pub unsafe fn panel_pair(lines: [&[Line]; 2], x: &[u32], pairs: usize, mg: usize, res: [&mut [f32]; 2]) {
        let [ra, rb] = res;
        for g in (0..mg).step_by(4) {
            let (xs, r) = (&x[g * pairs..], g * PANEL..);
            let res = [&mut ra[r.clone()], &mut rb[r]];
            match mg - g {
                1 => rows::<1, 2, 2>(lines, xs, pairs, res),
                2 => rows::<2, 2, 2>(lines, xs, pairs, res),
                3 => rows::<3, 2, 2>(lines, xs, pairs, res),
                _ => rows::<4, 2, 2>(lines, xs, pairs, res),
            }
        }
    }

    /// `M` activation rows against `P` panels with `C` accumulator chains each (constants, so
    /// the `M × P × C` accumulators stay in registers; `C` chains hide `vdpbf16ps`'s latency
    /// when `M` is small, and `panels::panel_rows` keeps `C` the same for every `M`:
    /// batch-invariant sums). Each activation broadcast serves all `P` panels' lines.
    #[target_feature(enable = "avx512f,avx512bf16")]
    unsafe fn rows<const M: usize, const C: usize, const P: usize>(lines: [&[Line]; P], x: &[u32], pairs: usize, mut res: [&mut [f32]; P]) {
        let bh = |v: __m512i| std::mem::transmute::<__m512i, __m512bh>(v);
        let mut l = [std::ptr::null::<__m512i>(); P];
        for (p, lines) in lines.iter().enumerate() {
            l[p] = lines.as_ptr() as *const __m512i;
        }
        let xp = x.as_ptr();
        let mut acc = [[[_mm512_setzero_ps(); C]; P]; M];
        let mut w = [bh(_mm512_setzero_si512()); P];
        let mut i = 0;
        while i + C <= pairs {
            for c in 0..C {
                // At batch 1 the panels are one stream: ask for each line PREFETCH lines ahead
                // (past the panel's end is the next panel; a prefetch never faults).
                if M <= 2 && P == 1 {
                    _mm_prefetch::<_MM_HINT_T0>(l[0].add(i + c + PREFETCH) as *const i8);
                }
                for p in 0..P {
                    w[p] = bh(_mm512_load_si512(l[p].add(i + c)));
                }
                for (r, a) in acc.iter_mut().enumerate() {
                    let xv = bh(_mm512_set1_epi32(*xp.add(r * pairs + i + c) as i32));
                    for p in 0..P {
                        a[p][c] = _mm512_dpbf16_ps(a[p][c], w[p], xv);
                    }
                }
            }
            i += C;
        }
        while i < pairs {
            for p in 0..P {
                w[p] = bh(_mm512_load_si512(l[p].add(i)));
            }
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = bh(_mm512_set1_epi32(*xp.add(r * pairs + i) as i32));
                for p in 0..P {
                    a[p][0] = _mm512_dpbf16_ps(a[p][0], w[p], xv);
                }
            }
            i += 1;
        }
        for (r, a) in acc.iter().enumerate() {
            for (p, out) in res.iter_mut().enumerate() {
                let mut s = a[p][0];
                for v in &a[p][1..] {
                    s = _mm512_add_ps(s, *v);
                }
                _mm512_storeu_ps(out.as_mut_ptr().add(r * PANEL), s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::assert_close;
    use candle_core::DType;

    /// Every kernel this machine can run at the dispatch level, whichever `kernel()` picks
    /// here (so an Intel machine still tests `dp`, an AMD one `fma512`).
    fn kernels() -> Vec<Kernel> {
        let wide = crate::cpu::level() == crate::cpu::Level::Avx512;
        [(Kernel::Dots, avx512()), (Kernel::Wide, wide), (Kernel::Halves, available())].into_iter().filter(|k| k.1).map(|k| k.0).collect()
    }

    /// Against f32 products of the same bf16 values, each kernel: odd row lengths, rows that
    /// are not whole panels, one to many passes of activation rows.
    #[test]
    fn matches_f32_products_of_the_bf16_values() -> candle_core::Result<()> {
        if !available() {
            eprintln!("no AVX2 + FMA: the unpacked kernels run instead");
            return Ok(());
        }
        for &(m, k, n) in &[(1, 64, 37), (1, 896, 130), (2, 33, 16), (5, 256, 20), (11, 161, 9), (40, 320, 33), (13, 96, 100)] {
            let x = crate::testing::randn(113, (m, k), 1.)?.to_dtype(DType::BF16)?;
            let w = crate::testing::randn(114, (n, k), 1.)?.to_dtype(DType::BF16)?;
            let want = x.to_dtype(DType::F32)?.matmul(&w.to_dtype(DType::F32)?.t()?)?.to_vec2::<f32>()?;
            let packed = PackedBf16::pack(&w.flatten_all()?.to_vec1::<bf16>()?, n, k);
            for kernel in kernels() {
                let mut got = vec![0f32; m * n];
                packed.matmul_with(kernel, &x.flatten_all()?.to_vec1::<bf16>()?, m, &mut got);
                assert_close(&want, &got, 1e-5, &format!("{kernel:?} {m}x{k}x{n}"));
            }
        }
        Ok(())
    }

    /// The 512-bit widening kernel gives the AVX2 kernel's bits (an odd row length, a last
    /// panel not whole, one to many passes), so an AVX-512 Intel machine at either level and
    /// an AVX2-only one compute the same logits.
    #[test]
    fn widened_lines_give_the_halves_bits() -> candle_core::Result<()> {
        if crate::cpu::level() != crate::cpu::Level::Avx512 {
            return Ok(());
        }
        let (k, n) = (301, 45);
        let packed = PackedBf16::pack(&crate::testing::randn(66, (n, k), 1.)?.to_dtype(DType::BF16)?.flatten_all()?.to_vec1::<bf16>()?, n, k);
        for m in [1, 3, 8, 19] {
            let x = crate::testing::randn(67 + m as u64, (m, k), 1.)?.to_dtype(DType::BF16)?.flatten_all()?.to_vec1::<bf16>()?;
            let (mut wide, mut halves) = (vec![0f32; m * n], vec![0f32; m * n]);
            packed.matmul_with(Kernel::Wide, &x, m, &mut wide);
            packed.matmul_with(Kernel::Halves, &x, m, &mut halves);
            assert_eq!(wide, halves, "{m} rows");
        }
        Ok(())
    }

    /// A row's product is the same bits whatever rows share the call: alone it takes one
    /// panel per pass, among others two (`panel_pair`), and both sum every output alike.
    #[test]
    fn a_rows_product_does_not_depend_on_its_batch() -> candle_core::Result<()> {
        if !available() {
            return Ok(());
        }
        let (k, n) = (202, 70);
        let x = crate::testing::randn(62, (11, k), 1.)?.to_dtype(DType::BF16)?.flatten_all()?.to_vec1::<bf16>()?;
        let packed = PackedBf16::pack(&crate::testing::randn(63, (n, k), 1.)?.to_dtype(DType::BF16)?.flatten_all()?.to_vec1::<bf16>()?, n, k);
        for kernel in kernels() {
            let mut all = vec![0f32; 11 * n];
            packed.matmul_with(kernel, &x, 11, &mut all);
            for m in [1, 2, 5, 7] {
                let mut got = vec![0f32; m * n];
                packed.matmul_with(kernel, &x[..m * k], m, &mut got);
                assert_eq!(got, all[..m * n], "{kernel:?}: first {m} rows alone vs among 11");
            }
        }
        Ok(())
    }

    /// A weight staged from its rows as the product goes gives the packed copy's bits (two
    /// parts, an odd row length, a last panel not whole, decode and prefill row counts).
    #[test]
    fn staged_rows_give_the_packed_bits() -> candle_core::Result<()> {
        if !available() {
            return Ok(());
        }
        let (k, n, split) = (97, 53, 48);
        let w = crate::testing::randn(64, (n, k), 1.)?.to_dtype(DType::BF16)?.flatten_all()?.to_vec1::<bf16>()?;
        let (a, b) = w.split_at(split * k);
        let row = |r: usize| if r < split { &a[r * k..][..k] } else { &b[(r - split) * k..][..k] };
        let packed = PackedBf16::pack_rows(n, k, row);
        for m in [1, 2, 9, 20] {
            let x = crate::testing::randn(65 + m as u64, (m, k), 1.)?.to_dtype(DType::BF16)?.flatten_all()?.to_vec1::<bf16>()?;
            let (mut want, mut got) = (vec![0f32; m * n], vec![0f32; m * n]);
            packed.matmul(&x, m, &mut want);
            matmul_rows(n, k, row, &x, m, &mut got);
            assert_eq!(got, want, "{m} rows");
        }
        Ok(())
    }
}
