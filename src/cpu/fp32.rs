//! f32 weights repacked once at load for AVX-512, and their product with any number of f32
//! activation rows (candle's GEMM runs its AVX2 kernels on stable Rust, so an AVX-512 machine
//! prefilled an f32 model at 0.73× llama.cpp's rate). One kernel serves decode and prefill,
//! as for `bf16`.
//!
//! Layout: panel `p` holds weight rows `16p..16p+16` (zero rows pad the last panel); its line
//! `i`'s lane `r` holds row `16p+r`'s value `i`. One FMA of a line with activation value `i`
//! broadcast advances 16 rows by one value. Same bytes as the plain weight (up to the padding).

use super::panels::{Line, Panels, PANEL};

/// An f32 weight `[n, k]` in the panel layout above.
#[derive(Debug)]
pub struct PackedF32(Panels);

super::panels::panel_weight!(PackedF32);

/// Whether this machine runs the kernel (and the dispatch level allows AVX-512).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::level() == super::Level::Avx512
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

impl PackedF32 {
    /// Repacks a row-major `[n, k]` weight. Panics if `w` is shorter than the shape.
    pub fn pack(w: &[f32], n: usize, k: usize) -> PackedF32 {
        assert!(w.len() >= n * k, "PackedF32::pack: {} values for [{n}, {k}]", w.len());
        PackedF32(Panels::new(n, k, k, Line([0; 64]), |p, l| {
            let lanes = super::panels::lanes(l);
            for r in 0..PANEL.min(n - p * PANEL) {
                for (line, v) in lanes.iter_mut().zip(&w[(p * PANEL + r) * k..][..k]) {
                    line[r] = v.to_bits().to_le();
                }
            }
        }))
    }

    /// `out[m, n] = x[m, k] · wᵀ`. Call only when `available()`; panics if the slices are
    /// shorter than the shapes.
    pub fn matmul(&self, x: &[f32], m: usize, out: &mut [f32]) {
        assert!(available(), "PackedF32::matmul needs AVX-512");
        let (n, k) = (self.0.n, self.0.k);
        assert!(x.len() >= m * k && out.len() >= m * n, "PackedF32::matmul: slices shorter than [{m},{k}]·[{n},{k}]ᵀ");
        super::panels::run(n, m, out, |p, g, mg, res| {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available()` checked avx512f; the panel holds `k` lines and the
            // activations `mg` rows of `k` from `g`.
            unsafe {
                fma::panel(self.0.panel(p), &x[g * k..(g + mg) * k], k, mg, res)
            };
        });
    }
}

#[cfg(target_arch = "x86_64")]
mod fma {
    use super::super::panels::{Line, PANEL};
    use std::arch::x86_64::*;

    /// Lines ahead to prefetch at batch 1 (4 KiB, as `bf16`).
    const PREFETCH: usize = 64;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::testing::assert_close;

    /// Against candle's f32 matmul: odd row lengths, rows that are not whole panels, one to
    /// many passes of activation rows (seeded).
    #[test]
    fn matches_candle_matmul() -> candle_core::Result<()> {
        if !available() {
            eprintln!("no AVX-512: the unpacked kernels run instead");
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
