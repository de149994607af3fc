//! Matrix × few-vectors for decode: `y[m, n] = x[m, k] · w[n, k]ᵀ` with `m` small (one row per
//! sequence in the step) and `w` a linear layer's row-major f32 or bf16 weight. Decode reads
//! every weight once per token, so the kernel streams `w` exactly once per call at the memory
//! bandwidth, keeping the `m` activation rows in cache; bf16 weights are widened to f32 in
//! registers (a 16-bit shift), so bf16 halves the bytes read without losing f32 accumulation.
//! Output rows are split across the rayon pool.

use half::bf16;
use rayon::prelude::*;

use super::Level;

/// The most activation rows one pass handles (8 accumulators per weight row); larger steps
/// are processed in groups of this many.
pub const MAX_ROWS: usize = 8;

/// A weight element: f32 or bf16, widened to f32.
pub trait Elem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    #[cfg(target_arch = "x86_64")]
    /// 16 elements as f32 lanes.
    unsafe fn load16(p: *const Self) -> std::arch::x86_64::__m512;
    #[cfg(target_arch = "x86_64")]
    /// 8 elements as f32 lanes.
    unsafe fn load8(p: *const Self) -> std::arch::x86_64::__m256;
}

impl Elem for f32 {
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> std::arch::x86_64::__m256 {
        std::arch::x86_64::_mm256_loadu_ps(p)
    }
}

impl Elem for bf16 {
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load16(p: *const bf16) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        // bf16 is the top half of an f32: zero-extend to 32 bits and shift into place.
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn load8(p: *const bf16) -> std::arch::x86_64::__m256 {
        use std::arch::x86_64::*;
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` at `level`. Panics if the slices are shorter than the
/// shapes say (callers pass whole tensors).
pub fn matvec<W: Elem>(x: &[f32], m: usize, k: usize, w: &[W], n: usize, out: &mut [f32], level: Level) {
    assert!(x.len() >= m * k && w.len() >= n * k && out.len() >= m * n, "matvec: slices shorter than [{m},{k}]·[{n},{k}]ᵀ");
    // Work on the transpose [n, m] so each weight row's results are contiguous per task.
    let mut t = vec![0f32; n * m];
    // Enough rows per task to amortise scheduling, few enough to balance the threads.
    let rows_per_task = (n / (rayon::current_num_threads() * 8)).clamp(4, 256);
    t.par_chunks_mut(rows_per_task * m).enumerate().for_each(|(c, chunk)| {
        let j0 = c * rows_per_task;
        let rows = chunk.len() / m;
        for g in (0..m).step_by(MAX_ROWS) {
            let mg = (m - g).min(MAX_ROWS);
            rows_dot(&x[g * k..(g + mg) * k], mg, k, &w[j0 * k..(j0 + rows) * k], rows, chunk, m, g, level);
        }
    });
    for j in 0..n {
        for r in 0..m {
            out[r * n + j] = t[j * m + r];
        }
    }
}

/// For `rows` weight rows, the dots with `mg` activation rows; results go to
/// `chunk[j * stride + col0 + r]`.
#[allow(clippy::too_many_arguments)]
fn rows_dot<W: Elem>(x: &[f32], mg: usize, k: usize, w: &[W], rows: usize, chunk: &mut [f32], stride: usize, col0: usize, level: Level) {
    #[cfg(target_arch = "x86_64")]
    {
        if level == Level::Avx512 {
            // SAFETY: Level::Avx512 is only chosen when avx512f and avx512bw are detected.
            unsafe { avx512::rows_dot(x, mg, k, w, rows, chunk, stride, col0) };
            return;
        }
        if level == Level::Avx2 {
            // SAFETY: Level::Avx2 is only chosen when avx2 and fma are detected.
            unsafe { avx2::rows_dot(x, mg, k, w, rows, chunk, stride, col0) };
            return;
        }
    }
    let _ = level;
    for j in 0..rows {
        let wr = &w[j * k..(j + 1) * k];
        for r in 0..mg {
            let xr = &x[r * k..(r + 1) * k];
            // Eight partial sums, like the vector kernels, so the compiler can vectorise.
            let mut acc = [0f32; 8];
            let mut i = 0;
            while i + 8 <= k {
                for l in 0..8 {
                    acc[l] += xr[i + l] * wr[i + l].to_f32();
                }
                i += 8;
            }
            let mut s: f32 = acc.iter().sum();
            for i in i..k {
                s += xr[i] * wr[i].to_f32();
            }
            chunk[j * stride + col0 + r] = s;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::Elem;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx512f,avx512bw,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rows_dot<W: Elem>(x: &[f32], mg: usize, k: usize, w: &[W], rows: usize, chunk: &mut [f32], stride: usize, col0: usize) {
        let body = k / 16 * 16;
        let mut j = 0;
        // One activation row (batch-1 decode): four weight rows at a time share each x load.
        if mg == 1 {
            while j + 4 <= rows {
                let mut acc = [_mm512_setzero_ps(); 4];
                let mut i = 0;
                while i < body {
                    let xv = _mm512_loadu_ps(x.as_ptr().add(i));
                    for (t, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(xv, W::load16(w.as_ptr().add((j + t) * k + i)), *a);
                    }
                    i += 16;
                }
                for (t, a) in acc.iter().enumerate() {
                    let mut s = _mm512_reduce_add_ps(*a);
                    for i in body..k {
                        s += x[i] * w[(j + t) * k + i].to_f32();
                    }
                    chunk[(j + t) * stride + col0] = s;
                }
                j += 4;
            }
        }
        // Otherwise (and the leftover rows): one weight row against every activation row.
        while j < rows {
            let mut acc = [_mm512_setzero_ps(); super::MAX_ROWS];
            let wr = w.as_ptr().add(j * k);
            let mut i = 0;
            while i < body {
                let wv = W::load16(wr.add(i));
                for (r, a) in acc.iter_mut().enumerate().take(mg) {
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(x.as_ptr().add(r * k + i)), wv, *a);
                }
                i += 16;
            }
            for (r, a) in acc.iter().enumerate().take(mg) {
                let mut s = _mm512_reduce_add_ps(*a);
                for i in body..k {
                    s += x[r * k + i] * w[j * k + i].to_f32();
                }
                chunk[j * stride + col0 + r] = s;
            }
            j += 1;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Elem;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rows_dot<W: Elem>(x: &[f32], mg: usize, k: usize, w: &[W], rows: usize, chunk: &mut [f32], stride: usize, col0: usize) {
        let body = k / 8 * 8;
        for j in 0..rows {
            let mut acc = [_mm256_setzero_ps(); super::MAX_ROWS];
            let wr = w.as_ptr().add(j * k);
            let mut i = 0;
            while i < body {
                let wv = W::load8(wr.add(i));
                for (r, a) in acc.iter_mut().enumerate().take(mg) {
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(r * k + i)), wv, *a);
                }
                i += 8;
            }
            for (r, a) in acc.iter().enumerate().take(mg) {
                let mut s = hsum(*a);
                for i in body..k {
                    s += x[r * k + i] * w[j * k + i].to_f32();
                }
                chunk[j * stride + col0 + r] = s;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};

    /// Every level against candle's matmul on random inputs: shapes with and without a vector
    /// tail, 1..=11 activation rows (more than one group), f32 and bf16 weights.
    #[test]
    fn matches_candle_matmul_at_every_level() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        for &(m, k, n) in &[(1, 64, 37), (1, 896, 128), (3, 100, 9), (8, 256, 64), (11, 333, 50)] {
            let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
            let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
            let xs = x.flatten_all()?.to_vec1::<f32>()?;
            for level in Level::available() {
                let want = x.matmul(&w.t()?)?.to_vec2::<f32>()?;
                let mut got = vec![0f32; m * n];
                matvec(&xs, m, k, &w.flatten_all()?.to_vec1::<f32>()?, n, &mut got, level);
                check(&want, &got, n, 1e-5, &format!("f32 {level:?} {m}x{k}x{n}"));
                // bf16 weights: the reference widens the same bf16 values to f32.
                let wb = w.to_dtype(DType::BF16)?;
                let want = x.matmul(&wb.to_dtype(DType::F32)?.t()?)?.to_vec2::<f32>()?;
                matvec(&xs, m, k, &wb.flatten_all()?.to_vec1::<bf16>()?, n, &mut got, level);
                check(&want, &got, n, 1e-5, &format!("bf16 {level:?} {m}x{k}x{n}"));
            }
        }
        Ok(())
    }

    fn check(want: &[Vec<f32>], got: &[f32], n: usize, tol: f32, what: &str) {
        let scale = want.iter().flatten().fold(1f32, |a, &b| a.max(b.abs()));
        for (r, row) in want.iter().enumerate() {
            for (j, &v) in row.iter().enumerate() {
                let d = (v - got[r * n + j]).abs();
                assert!(d <= tol * scale, "{what}: [{r},{j}] {v} vs {} (scale {scale})", got[r * n + j]);
            }
        }
    }
}
