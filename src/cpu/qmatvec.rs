//! Matrix × few-vectors for Q8_0 weights (llama.cpp's block: an f16 scale and 32 int8
//! values, 34 bytes), as llama.cpp computes it: the activations are quantized to Q8_0 blocks
//! too and each block pair is one VNNI integer dot (`vpdpbusd`), scaled by the two f16 scales.
//! Only with AVX-512 VNNI; elsewhere candle's kernels run.

use half::f16;
use rayon::prelude::*;

use super::matvec::MAX_ROWS;

/// Bytes of one Q8_0 block.
pub const BLOCK_BYTES: usize = 34;
/// Values of one Q8_0 block.
pub const BLOCK: usize = 32;

/// Whether this machine runs the kernel (and the dispatch level allows AVX-512).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        super::level() == super::Level::Avx512 && std::is_x86_feature_detected!("avx512vnni") && std::is_x86_feature_detected!("avx512vl")
    }
    #[cfg(not(target_arch = "x86_64"))]
    false
}

/// `x` quantized per 32 values: (scales, int8 values), as ggml's `quantize_row_q8_0`.
fn quantize(x: &[f32]) -> (Vec<f32>, Vec<i8>) {
    let mut d = Vec::with_capacity(x.len() / BLOCK);
    let mut q = vec![0i8; x.len()];
    for (b, xs) in x.chunks_exact(BLOCK).enumerate() {
        let amax = xs.iter().fold(0f32, |a, v| a.max(v.abs()));
        let scale = amax / 127.0;
        let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
        for (i, v) in xs.iter().enumerate() {
            q[b * BLOCK + i] = (v * inv).round() as i8;
        }
        // The scale as the block stores it (f16), so both sides round alike.
        d.push(f16::from_f32(scale).to_f32());
    }
    (d, q)
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` for Q8_0 weights `w` (`n` rows of `k / 32` blocks).
/// Call only when `available()`.
pub fn matvec_q8_0(x: &[f32], m: usize, k: usize, w: &[u8], n: usize, out: &mut [f32]) {
    assert!(available(), "matvec_q8_0 needs AVX-512 VNNI");
    assert!(k % BLOCK == 0, "Q8_0 rows hold whole blocks");
    let row_bytes = k / BLOCK * BLOCK_BYTES;
    assert!(x.len() >= m * k && w.len() >= n * row_bytes && out.len() >= m * n, "matvec_q8_0: slices shorter than the shapes");
    let (xd, xq) = quantize(&x[..m * k]);
    let mut t = vec![0f32; n * m];
    let rows_per_task = (n / (rayon::current_num_threads() * 8)).clamp(4, 256);
    t.par_chunks_mut(rows_per_task * m).enumerate().for_each(|(c, chunk)| {
        let j0 = c * rows_per_task;
        let rows = chunk.len() / m;
        let wj = &w[j0 * row_bytes..(j0 + rows) * row_bytes];
        for g in (0..m).step_by(MAX_ROWS) {
            let mg = (m - g).min(MAX_ROWS);
            let nb = k / BLOCK;
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `available()` checked avx512vnni and avx512vl (and Level::Avx512).
            unsafe {
                vnni::rows(&xd[g * nb..(g + mg) * nb], &xq[g * k..(g + mg) * k], mg, k, wj, rows, chunk, m, g)
            };
        }
    });
    for j in 0..n {
        for r in 0..m {
            out[r * n + j] = t[j * m + r];
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::{BLOCK, BLOCK_BYTES};
    use std::arch::x86_64::*;

    /// One block pair: Σ w·x over 32 int8 as 8 int32 lanes. `vpdpbusd` takes unsigned × signed,
    /// so |w| meets x carrying w's sign (ggml's trick).
    #[inline(always)]
    unsafe fn dot(w: *const u8, x: *const i8) -> __m256 {
        let wv = _mm256_loadu_si256(w as *const __m256i);
        let xv = _mm256_loadu_si256(x as *const __m256i);
        let p = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_sign_epi8(wv, wv), _mm256_sign_epi8(xv, wv));
        _mm256_cvtepi32_ps(p)
    }

    #[inline(always)]
    unsafe fn scale(blk: *const u8) -> f32 {
        let bits = (blk as *const u16).read_unaligned();
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(bits as i32)))
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps::<1>(s, s)))
    }

    #[target_feature(enable = "avx2,fma,f16c,avx512vnni,avx512vl")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rows(xd: &[f32], xq: &[i8], mg: usize, k: usize, w: &[u8], rows: usize, chunk: &mut [f32], stride: usize, col0: usize) {
        let nb = k / BLOCK;
        for j in 0..rows {
            let row = w.as_ptr().add(j * nb * BLOCK_BYTES);
            for r in 0..mg {
                // Four chains so FMA latency does not bound the loop.
                let mut acc = [_mm256_setzero_ps(); 4];
                let mut b = 0;
                while b + 4 <= nb {
                    for (h, a) in acc.iter_mut().enumerate() {
                        let blk = row.add((b + h) * BLOCK_BYTES);
                        let d = _mm256_set1_ps(scale(blk) * xd[r * nb + b + h]);
                        *a = _mm256_fmadd_ps(dot(blk.add(2), xq.as_ptr().add(r * k + (b + h) * BLOCK)), d, *a);
                    }
                    b += 4;
                }
                while b < nb {
                    let blk = row.add(b * BLOCK_BYTES);
                    let d = _mm256_set1_ps(scale(blk) * xd[r * nb + b]);
                    acc[0] = _mm256_fmadd_ps(dot(blk.add(2), xq.as_ptr().add(r * k + b * BLOCK)), d, acc[0]);
                    b += 1;
                }
                let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
                chunk[j * stride + col0 + r] = hsum(s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
    use candle_core::{Device, Module, Tensor};

    /// Against candle's own Q8_0 matmul (which also quantizes the activations to Q8_0).
    #[test]
    fn matches_candle_q8_0_matmul() -> candle_core::Result<()> {
        if !available() {
            eprintln!("no AVX-512 VNNI: candle's kernels run instead");
            return Ok(());
        }
        let dev = Device::Cpu;
        for &(m, k, n) in &[(1, 64, 37), (1, 896, 130), (5, 256, 20), (11, 160, 9)] {
            let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
            let q = QTensor::quantize(&Tensor::randn(0f32, 1., (n, k), &dev)?, GgmlDType::Q8_0)?;
            let data = q.data()?.to_vec();
            let want = QMatMul::from_qtensor(q)?.forward(&x)?.to_vec2::<f32>()?;
            let mut got = vec![0f32; m * n];
            matvec_q8_0(&x.flatten_all()?.to_vec1::<f32>()?, m, k, &data, n, &mut got);
            let scale = want.iter().flatten().fold(1f32, |a, &b| a.max(b.abs()));
            for r in 0..m {
                for j in 0..n {
                    assert!((want[r][j] - got[r * n + j]).abs() <= 1e-4 * scale, "{m}x{k}x{n} [{r},{j}]: {} vs {}", want[r][j], got[r * n + j]);
                }
            }
        }
        Ok(())
    }
}
