//! f32 weights repacked once at load, and their product with any number of f32 activation
//! rows: AVX-512 (candle's GEMM runs its AVX2 kernels on stable Rust, so an AVX-512 machine
//! prefilled an f32 model at 0.73× llama.cpp's rate) and AVX2 + FMA (there candle's GEMM
//! prefilled at 0.82× llama.cpp's rate on a Zen 3 class VM, and decode took another kernel,
//! summing in another order, so a prefix from the cache could differ from one computed in a
//! longer chunk). One kernel serves decode and prefill, as for `bf16`, and a row is summed the
//! same way whatever shares its pass.
//!
//! Layout: panel `p` holds weight rows `16p..16p+16` (zero rows pad the last panel); its line
//! `i`'s lane `r` holds row `16p+r`'s value `i`. One FMA of a line with activation value `i`
//! broadcast advances 16 rows by one value (two 256-bit FMAs with AVX2). Same bytes as the
//! plain weight (up to the padding).

use super::panels::{Line, Panels, PANEL};

/// An f32 weight `[n, k]` in the panel layout above.
#[derive(Debug)]
pub struct PackedF32(Panels);

super::panels::panel_weight!(PackedF32);

/// Whether this machine runs a kernel at the dispatch level: AVX-512, or AVX2 + FMA.
pub fn available() -> bool {
    cfg!(target_arch = "x86_64") && super::level() >= super::Level::Avx2
}

impl PackedF32 {
    /// Repacks a row-major `[n, k]` weight. Panics if `w` is shorter than the shape.
    pub fn pack(w: &[f32], n: usize, k: usize) -> PackedF32 {
        assert!(w.len() >= n * k, "PackedF32::pack: {} values for [{n}, {k}]", w.len());
        Self::pack_rows(n, k, |r| &w[r * k..][..k])
    }

    /// Repacks the weight whose row `r` is `row(r)` (`k` values each; rows may lie apart, as
    /// joined q/k/v parts do in a file).
    pub fn pack_rows<'a>(n: usize, k: usize, row: impl Fn(usize) -> &'a [f32] + Sync) -> PackedF32 {
        PackedF32(Panels::new(n, k, k, Line([0; 64]), |p, l| stage(n, &row, p, l)))
    }

    /// `out[m, n] = x[m, k] · wᵀ`. Call only when `available()`; panics if the slices are
    /// shorter than the shapes.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        product(self.0.n, self.0.k, x, m, out, |p, f| f(self.0.panel(p)))
    }
}

/// `PackedF32::pack_rows(n, k, row).matmul(x, m, out)` without the packed copy, the same bits:
/// each panel is staged from the rows as the product reaches it (`panels::Staged`). For a
/// weight still in its file; a prefill amortizes the staging over its rows, a decode step
/// pays about one more pass over the panel from the core's cache.
pub fn matmul_rows<'a>(n: usize, k: usize, row: impl Fn(usize) -> &'a [f32] + Sync, x: &[f32], m: usize, out: &mut [f32]) {
    let staged = super::panels::Staged::new(k, |p, l: &mut [Line]| stage(n, &row, p, l));
    product(n, k, x, m, out, |p, f| staged.with(p, f))
}

/// Panel `p` of the rows, every byte of its lines (lanes past the last row zero).
fn stage<'a>(n: usize, row: &impl Fn(usize) -> &'a [f32], p: usize, l: &mut [Line]) {
    let rows: Vec<&[u8]> = (p * PANEL..n.min(p * PANEL + PANEL)).map(|r| super::panels::as_bytes(row(r))).collect();
    super::panels::transpose_words(&rows, l)
}

/// The product over panels that `panel(p, f)` hands to `f`.
fn product(n: usize, k: usize, x: &[f32], m: usize, out: &mut [f32], panel: impl Fn(usize, &mut dyn FnMut(&[Line])) + Sync) {
    assert!(available(), "PackedF32::matmul needs AVX2 and FMA");
    assert!(x.len() >= m * k && out.len() >= m * n, "PackedF32::matmul: slices shorter than [{m},{k}]·[{n},{k}]ᵀ");
    let wide = super::level() == super::Level::Avx512;
    super::panels::run(n, m, out, |p, g, mg, res| {
        let x = &x[g * k..(g + mg) * k];
        panel(p, &mut |lines| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available()` means avx2 and fma, `wide` the AVX-512 level (avx512f); the
            // panel holds `k` lines and the activations `mg` rows of `k` from `g`.
            unsafe {
                if wide {
                    fma::panel(lines, x, k, mg, res)
                } else {
                    fma256::panel(lines, x, k, mg, res)
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
    use std::arch::x86_64::*;

    /// Lines ahead to prefetch at batch 1 (4 KiB, as `bf16`; the AVX2 kernel takes the same).
    pub(super) const PREFETCH: usize = 64;

    /// One panel against `mg` activation rows: `res[r * 16 + lane]`.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn panel(lines: &[Line], x: &[f32], k: usize, mg: usize, res: &mut [f32]) {
        super::super::panels::panel_rows!(rows, mg, (lines, x, k, res))
    }

    /// `M` activation rows with `C` accumulator chains each (constants, so the accumulators
    /// stay in registers; `C` chains hide the FMA's latency when `M` is small, and
    /// `panels::panel_rows` keeps `C` the same for every `M`: batch-invariant sums).
    #[target_feature(enable = "avx512f")]
    unsafe fn rows<const M: usize, const C: usize>(lines: &[Line], x: &[f32], k: usize, res: &mut [f32]) {
        let l = lines.as_ptr() as *const f32;
        let xp = x.as_ptr();
        let mut acc = [[_mm512_setzero_ps(); C]; M];
        let mut i = 0;
        while i + C <= k {
            for c in 0..C {
                if M <= 2 {
                    _mm_prefetch::<_MM_HINT_T0>(l.add((i + c + PREFETCH) * PANEL) as *const i8);
                }
                let w = _mm512_load_ps(l.add((i + c) * PANEL));
                for (r, a) in acc.iter_mut().enumerate() {
                    a[c] = _mm512_fmadd_ps(w, _mm512_set1_ps(*xp.add(r * k + i + c)), a[c]);
                }
            }
            i += C;
        }
        while i < k {
            let w = _mm512_load_ps(l.add(i * PANEL));
            for (r, a) in acc.iter_mut().enumerate() {
                a[0] = _mm512_fmadd_ps(w, _mm512_set1_ps(*xp.add(r * k + i)), a[0]);
            }
            i += 1;
        }
        for (r, a) in acc.iter().enumerate() {
            let mut s = a[0];
            for v in &a[1..] {
                s = _mm512_add_ps(s, *v);
            }
            _mm512_storeu_ps(res.as_mut_ptr().add(r * PANEL), s);
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod fma256 {
    use super::super::panels::{Line, PANEL};
    use std::arch::x86_64::*;

    use super::fma::PREFETCH;

    /// One panel against `mg` activation rows: `res[r * 16 + lane]`, four rows at a time.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn panel(lines: &[Line], x: &[f32], k: usize, mg: usize, res: &mut [f32]) {
        for r in (0..mg).step_by(4) {
            let (x, out) = (&x[r * k..], &mut res[r * PANEL..]);
            match mg - r {
                1 => rows::<1>(lines, x, k, out),
                2 => rows::<2>(lines, x, k, out),
                3 => rows::<3>(lines, x, k, out),
                _ => rows::<4>(lines, x, k, out),
            }
        }
    }

    /// `M` activation rows against one panel: per row one accumulator for each half line (rows
    /// 0-7, 8-15), one FMA per value, in value order whatever `M` is. At four rows the eight
    /// accumulators' FMAs outnumber the loads (two weight halves, four broadcasts), so the FMA
    /// units set the pace; at one row the stream from memory does.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows<const M: usize>(lines: &[Line], x: &[f32], k: usize, res: &mut [f32]) {
        let l = lines.as_ptr() as *const f32;
        let xp = x.as_ptr();
        let mut acc = [[_mm256_setzero_ps(); 2]; M];
        for i in 0..k {
            if M <= 2 {
                _mm_prefetch::<_MM_HINT_T0>(l.wrapping_add((i + PREFETCH) * PANEL) as *const i8);
            }
            let (w0, w1) = (_mm256_load_ps(l.add(i * PANEL)), _mm256_load_ps(l.add(i * PANEL + 8)));
            for (r, a) in acc.iter_mut().enumerate() {
                let xv = _mm256_broadcast_ss(&*xp.add(r * k + i));
                a[0] = _mm256_fmadd_ps(w0, xv, a[0]);
                a[1] = _mm256_fmadd_ps(w1, xv, a[1]);
            }
        }
        for (r, a) in acc.iter().enumerate() {
            _mm256_storeu_ps(res.as_mut_ptr().add(r * PANEL), a[0]);
            _mm256_storeu_ps(res.as_mut_ptr().add(r * PANEL + 8), a[1]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::assert_close;

    /// Against candle's f32 matmul: odd row lengths, rows that are not whole panels, one to
    /// many passes of activation rows (seeded).
    #[test]
    fn matches_candle_matmul() -> candle_core::Result<()> {
        if !available() {
            eprintln!("no AVX2: the unpacked kernels run instead");
            return Ok(());
        }
        for (i, &(m, k, n)) in [(1, 64, 37), (1, 896, 130), (2, 33, 16), (5, 256, 20), (11, 161, 9), (40, 320, 33)].iter().enumerate() {
            let x = crate::testing::randn(40 + 2 * i as u64, (m, k), 1.)?;
            let w = crate::testing::randn(41 + 2 * i as u64, (n, k), 1.)?;
            let want = x.matmul(&w.t()?)?.to_vec2::<f32>()?;
            let packed = PackedF32::pack(&w.flatten_all()?.to_vec1::<f32>()?, n, k);
            let mut got = vec![0f32; m * n];
            packed.matmul(&x.flatten_all()?.to_vec1::<f32>()?, m, &mut got);
            assert_close(&want, &got, 1e-5, &format!("{m}x{k}x{n}"));
        }
        Ok(())
    }

    /// A weight staged from its rows as the product goes gives the packed copy's bits, for
    /// decode and prefill row counts, rows in two separate parts (a joined q/k/v in a file)
    /// and a last panel that is not whole.
    #[test]
    fn staged_rows_give_the_packed_bits() -> candle_core::Result<()> {
        if !available() {
            return Ok(());
        }
        let (k, n, split) = (96, 53, 32);
        let w = crate::testing::randn(62, (n, k), 1.)?.flatten_all()?.to_vec1::<f32>()?;
        let (a, b) = w.split_at(split * k);
        let row = |r: usize| if r < split { &a[r * k..][..k] } else { &b[(r - split) * k..][..k] };
        let packed = PackedF32::pack_rows(n, k, row);
        for m in [1, 3, 9, 20] {
            let x = crate::testing::randn(63 + m as u64, (m, k), 1.)?.flatten_all()?.to_vec1::<f32>()?;
            let (mut want, mut got) = (vec![0f32; m * n], vec![0f32; m * n]);
            packed.matmul(&x, m, &mut want);
            matmul_rows(n, k, row, &x, m, &mut got);
            assert_eq!(got, want, "{m} rows");
        }
        Ok(())
    }

    /// A row's product is the same bits whatever rows share the call (decode alone, a few
    /// sequences, a prefill pass), so a token's logits do not depend on its batch.
    #[test]
    fn a_rows_product_does_not_depend_on_its_batch() -> candle_core::Result<()> {
        if !available() {
            return Ok(());
        }
        let (k, n) = (200, 48);
        let x = crate::testing::randn(60, (11, k), 1.)?.flatten_all()?.to_vec1::<f32>()?;
        let packed = PackedF32::pack(&crate::testing::randn(61, (n, k), 1.)?.flatten_all()?.to_vec1::<f32>()?, n, k);
        let mut all = vec![0f32; 11 * n];
        packed.matmul(&x, 11, &mut all);
        for m in [1, 2, 5] {
            let mut got = vec![0f32; m * n];
            packed.matmul(&x[..m * k], m, &mut got);
            assert_eq!(got, all[..m * n], "first {m} rows alone vs among 11");
        }
        Ok(())
    }
}
