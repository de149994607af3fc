//! Matrix × few-vectors for decode: `y[m, n] = x[m, k] · w[n, k]ᵀ` with `m` small (one row per
//! sequence in the step) and `w` a linear layer's row-major f32 or bf16 weight. Decode reads
//! every weight once per token, so the kernel streams `w` exactly once per call at the memory
//! bandwidth, keeping the `m` activation rows in cache; bf16 weights are widened to f32 in
//! registers (a 16-bit shift), so bf16 halves the bytes read without losing f32 accumulation.
//! Output rows are split across the thread team (`team`).

use half::bf16;

use super::Level;

/// The most activation rows one pass handles (8 accumulators per weight row); larger steps
/// are processed in groups of this many.
pub const MAX_ROWS: usize = 8;

/// A weight element: f32 or bf16, widened to f32. (The vector kernels load both kinds
/// inline: an intrinsic called from a helper without the target feature would not inline.)
pub trait Elem: Copy + Send + Sync + 'static {
    const IS_BF16: bool;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    const IS_BF16: bool = false;
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for bf16 {
    const IS_BF16: bool = true;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
}

/// Weight rows per task. One activation row (batch-1 decode) is bound by each core's
/// share of the bandwidth: one contiguous stream per thread keeps the hardware prefetchers on
/// it (measured on the 2-core box over a 0.5B model's layer shapes: 18.3 GB/s with 16 tasks
/// per matrix, 24.3 GB/s with one per thread, on the pool). More rows are compute-heavier and
/// balance better in smaller tasks.
pub(crate) fn rows_per_task(n: usize, m: usize) -> usize {
    let threads = rayon::current_num_threads();
    match m {
        1 => n.div_ceil(threads).next_multiple_of(4).max(4),
        _ => (n / (threads * 8)).clamp(4, 256),
    }
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` at `level`. Panics if the slices are shorter than the
/// shapes say (callers pass whole tensors).
pub fn matvec<W: Elem>(x: &[f32], m: usize, k: usize, w: &[W], n: usize, out: &mut [f32], level: Level) {
    assert!(x.len() >= m * k && w.len() >= n * k && out.len() >= m * n, "matvec: slices shorter than [{m},{k}]·[{n},{k}]ᵀ");
    // Work on the transpose [n, m] so each weight row's results are contiguous per task.
    let mut t = vec![0f32; n * m];
    let rows_per_task = rows_per_task(n, m);
    // AVX-512 bf16 reads whole cache lines of 32 weights and splits them into even and odd
    // halves in registers; the activations are split the same way once here.
    let split = (level == Level::Avx512 && W::IS_BF16).then(|| deinterleave(x, m, k));
    super::team::chunks_mut(&mut t, rows_per_task * m, |c, chunk| {
        let j0 = c * rows_per_task;
        let rows = chunk.len() / m;
        for g in (0..m).step_by(MAX_ROWS) {
            let mg = (m - g).min(MAX_ROWS);
            let xg = &x[g * k..(g + mg) * k];
            let wj = &w[j0 * k..(j0 + rows) * k];
            #[cfg(target_arch = "x86_64")]
            if let Some(xd) = &split {
                let body = k / 32 * 32;
                // SAFETY: `split` exists only at Level::Avx512 (avx512f and avx512bw detected),
                // and only for bf16 weights, whose bits the kernel reads as u16.
                unsafe { avx512::rows_dot_bf16(xg, &xd[g * body..(g + mg) * body], mg, k, wj.as_ptr() as *const u16, rows, chunk, m, g) };
                continue;
            }
            rows_dot(xg, mg, k, wj, rows, chunk, m, g, level);
        }
    });
    for j in 0..n {
        for r in 0..m {
            out[r * n + j] = t[j * m + r];
        }
    }
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` for bf16 activations and weights (a bf16 model's decode):
/// with AVX-512 BF16, `vdpbf16ps` multiplies the bf16 pairs exactly and accumulates in f32
/// with one instruction per cache line, like the f32 kernel; otherwise the activations are
/// widened and `matvec` runs.
pub fn matvec_bf16(x: &[bf16], m: usize, k: usize, w: &[bf16], n: usize, out: &mut [f32], level: Level) {
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx512 && std::is_x86_feature_detected!("avx512bf16") {
        assert!(x.len() >= m * k && w.len() >= n * k && out.len() >= m * n, "matvec_bf16: slices shorter than the shapes");
        let mut t = vec![0f32; n * m];
        let rows_per_task = rows_per_task(n, m);
        super::team::chunks_mut(&mut t, rows_per_task * m, |c, chunk| {
            let j0 = c * rows_per_task;
            let rows = chunk.len() / m;
            for g in (0..m).step_by(MAX_ROWS) {
                let mg = (m - g).min(MAX_ROWS);
                // SAFETY: avx512f/bw (Level::Avx512) and avx512bf16 detected; bf16 is 2 bytes.
                unsafe { avx512::rows_dot_dp(x[g * k..(g + mg) * k].as_ptr() as *const u16, mg, k, w[j0 * k..(j0 + rows) * k].as_ptr() as *const u16, rows, chunk, m, g) };
            }
        });
        for j in 0..n {
            for r in 0..m {
                out[r * n + j] = t[j * m + r];
            }
        }
        return;
    }
    let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
    matvec(&xf, m, k, w, n, out, level);
}

/// Each row's first `k / 32 * 32` values as blocks of 32: the 16 even-indexed, then the 16
/// odd-indexed (the order bf16 pairs sit in a 32-bit lane).
fn deinterleave(x: &[f32], m: usize, k: usize) -> Vec<f32> {
    let body = k / 32 * 32;
    let mut out = vec![0f32; m * body];
    for r in 0..m {
        for b in (0..body).step_by(32) {
            for l in 0..16 {
                out[r * body + b + l] = x[r * k + b + 2 * l];
                out[r * body + b + 16 + l] = x[r * k + b + 2 * l + 1];
            }
        }
    }
    out
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

    /// 16 weights at `p` as f32 lanes (bf16 is the top half of an f32: zero-extend, shift).
    macro_rules! load16 {
        ($w:ty, $p:expr) => {
            if <$w>::IS_BF16 {
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256($p as *const __m256i))))
            } else {
                _mm512_loadu_ps($p as *const f32)
            }
        };
    }

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
                        *a = _mm512_fmadd_ps(xv, load16!(W, w.as_ptr().add((j + t) * k + i)), *a);
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
                let wv = load16!(W, wr.add(i));
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

    /// bf16 activations against bf16 weights, 32 pairs per `vdpbf16ps` (exact products,
    /// f32 sums); the tail past the last full 32 is summed in scalar f32.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rows_dot_dp(x: *const u16, mg: usize, k: usize, w: *const u16, rows: usize, chunk: &mut [f32], stride: usize, col0: usize) {
        let body = k / 32 * 32;
        let bh = |p: *const u16| -> __m512bh { std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p as *const __m512i)) };
        let f = |p: *const u16, i: usize| half::bf16::from_bits(*p.add(i)).to_f32();
        let tail = |r: usize, j: usize| -> f32 { (body..k).map(|i| f(x, r * k + i) * f(w, j * k + i)).sum() };
        let mut j0 = 0;
        let end = w.add(rows * k) as usize;
        // One activation row: two weight rows per pass (two streams in flight), with software
        // prefetch a little ahead of each (24.3 against 20.9 GB/s without, on the layer shapes).
        if mg == 1 {
            while j0 + 2 <= rows {
                let (w0, w1) = (w.add(j0 * k), w.add((j0 + 1) * k));
                let mut a0 = [_mm512_setzero_ps(); 2];
                let mut a1 = [_mm512_setzero_ps(); 2];
                let mut i = 0;
                while i + 64 <= body {
                    for p in [w0.add(i + DP_PREFETCH), w1.add(i + DP_PREFETCH)] {
                        if (p as usize) < end {
                            _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
                            _mm_prefetch::<_MM_HINT_T0>(p.add(32) as *const i8);
                        }
                    }
                    let (xa, xb) = (bh(x.add(i)), bh(x.add(i + 32)));
                    a0[0] = _mm512_dpbf16_ps(a0[0], xa, bh(w0.add(i)));
                    a1[0] = _mm512_dpbf16_ps(a1[0], xa, bh(w1.add(i)));
                    a0[1] = _mm512_dpbf16_ps(a0[1], xb, bh(w0.add(i + 32)));
                    a1[1] = _mm512_dpbf16_ps(a1[1], xb, bh(w1.add(i + 32)));
                    i += 64;
                }
                while i < body {
                    let xa = bh(x.add(i));
                    a0[0] = _mm512_dpbf16_ps(a0[0], xa, bh(w0.add(i)));
                    a1[0] = _mm512_dpbf16_ps(a1[0], xa, bh(w1.add(i)));
                    i += 32;
                }
                chunk[j0 * stride + col0] = _mm512_reduce_add_ps(_mm512_add_ps(a0[0], a0[1])) + tail(0, j0);
                chunk[(j0 + 1) * stride + col0] = _mm512_reduce_add_ps(_mm512_add_ps(a1[0], a1[1])) + tail(0, j0 + 1);
                j0 += 2;
            }
        }
        for j in j0..rows {
            let wr = w.add(j * k);
            if mg == 1 {
                let mut acc = [_mm512_setzero_ps(); 4];
                let mut i = 0;
                while i + 128 <= body {
                    for (h, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_dpbf16_ps(*a, bh(x.add(i + 32 * h)), bh(wr.add(i + 32 * h)));
                    }
                    i += 128;
                }
                while i < body {
                    acc[0] = _mm512_dpbf16_ps(acc[0], bh(x.add(i)), bh(wr.add(i)));
                    i += 32;
                }
                let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
                chunk[j * stride + col0] = _mm512_reduce_add_ps(sum) + tail(0, j);
            } else {
                let mut acc = [_mm512_setzero_ps(); super::MAX_ROWS];
                let mut i = 0;
                while i < body {
                    let wv = bh(wr.add(i));
                    for (r, a) in acc.iter_mut().enumerate().take(mg) {
                        *a = _mm512_dpbf16_ps(*a, bh(x.add(r * k + i)), wv);
                    }
                    i += 32;
                }
                for (r, a) in acc.iter().enumerate().take(mg) {
                    chunk[j * stride + col0 + r] = _mm512_reduce_add_ps(*a) + tail(r, j);
                }
            }
        }
    }

    /// Weights ahead of the current position to prefetch (bf16 elements).
    const PREFETCH: usize = 1024;
    /// The same for `rows_dot_dp`, ahead in each of its two rows (measured best of 512–2048).
    const DP_PREFETCH: usize = 512;

    /// bf16 weights, 32 per step (one cache line per row): a 512-bit load holds 16 lanes of
    /// (odd << 16 | even); `even` is the lane shifted left 16, `odd` the lane with its low half
    /// cleared. `xd` holds the activations split the same way (`deinterleave`).
    #[target_feature(enable = "avx512f,avx512bw,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rows_dot_bf16(x: &[f32], xd: &[f32], mg: usize, k: usize, w: *const u16, rows: usize, chunk: &mut [f32], stride: usize, col0: usize) {
        let body = k / 32 * 32;
        let hi = _mm512_set1_epi32(0xFFFF_0000u32 as i32);
        let tail = |r: usize, j: usize| -> f32 { (body..k).map(|i| x[r * k + i] * half::bf16::from_bits(*w.add(j * k + i)).to_f32()).sum() };
        let mut j = 0;
        // One activation row: each weight row in turn, so the weights are one sequential
        // stream (what the hardware prefetcher follows best); two blocks per step keep four
        // independent accumulator chains.
        if mg == 1 {
            let body64 = k / 64 * 64;
            while j < rows {
                let wr = w.add(j * k);
                let mut acc = [_mm512_setzero_ps(); 4];
                let mut i = 0;
                while i < body64 {
                    // Software prefetch well ahead: the widening makes each cache line cost
                    // more instructions than in f32, so fewer misses are in flight without it.
                    _mm_prefetch::<_MM_HINT_T0>(wr.add(i + PREFETCH) as *const i8);
                    _mm_prefetch::<_MM_HINT_T0>(wr.add(i + PREFETCH + 32) as *const i8);
                    for h in 0..2 {
                        let v = _mm512_loadu_si512(wr.add(i + 32 * h) as *const __m512i);
                        let xe = _mm512_loadu_ps(xd.as_ptr().add(i + 32 * h));
                        let xo = _mm512_loadu_ps(xd.as_ptr().add(i + 32 * h + 16));
                        acc[2 * h] = _mm512_fmadd_ps(xe, _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v)), acc[2 * h]);
                        acc[2 * h + 1] = _mm512_fmadd_ps(xo, _mm512_castsi512_ps(_mm512_and_si512(v, hi)), acc[2 * h + 1]);
                    }
                    i += 64;
                }
                while i < body {
                    let v = _mm512_loadu_si512(wr.add(i) as *const __m512i);
                    acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(xd.as_ptr().add(i)), _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v)), acc[0]);
                    acc[1] = _mm512_fmadd_ps(_mm512_loadu_ps(xd.as_ptr().add(i + 16)), _mm512_castsi512_ps(_mm512_and_si512(v, hi)), acc[1]);
                    i += 32;
                }
                let sum = _mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3]));
                chunk[j * stride + col0] = _mm512_reduce_add_ps(sum) + tail(0, j);
                j += 1;
            }
        }
        while j < rows {
            let mut acc = [_mm512_setzero_ps(); super::MAX_ROWS];
            let mut i = 0;
            while i < body {
                let v = _mm512_loadu_si512(w.add(j * k + i) as *const __m512i);
                let we = _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v));
                let wo = _mm512_castsi512_ps(_mm512_and_si512(v, hi));
                for (r, a) in acc.iter_mut().enumerate().take(mg) {
                    let xr = xd.as_ptr().add(r * body + i);
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(xr), we, *a);
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(xr.add(16)), wo, *a);
                }
                i += 32;
            }
            for (r, a) in acc.iter().enumerate().take(mg) {
                chunk[j * stride + col0 + r] = _mm512_reduce_add_ps(*a) + tail(r, j);
            }
            j += 1;
        }
    }
}


#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::Elem;
    use std::arch::x86_64::*;

    macro_rules! load8 {
        ($w:ty, $p:expr) => {
            if <$w>::IS_BF16 {
                _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128($p as *const __m128i))))
            } else {
                _mm256_loadu_ps($p as *const f32)
            }
        };
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps::<1>(s, s));
        _mm_cvtss_f32(s)
    }

    /// `rows` weight rows against `mg` (1–8) activation rows. Few activation rows (decode)
    /// keep several independent sums per row: one FMA chain per row waits on the FMA's
    /// latency every 8 values, which held a bf16 row (16 bytes per FMA) under the bandwidth
    /// (a bf16 decode ran at 0.75× llama.cpp's at this level on a Zen 5).
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn rows_dot<W: Elem>(x: &[f32], mg: usize, k: usize, w: &[W], rows: usize, chunk: &mut [f32], stride: usize, col0: usize) {
        match mg {
            1 => rows_dot_m::<W, 1, 4>(x, k, w, rows, chunk, stride, col0),
            2 => rows_dot_m::<W, 2, 4>(x, k, w, rows, chunk, stride, col0),
            3 => rows_dot_m::<W, 3, 2>(x, k, w, rows, chunk, stride, col0),
            4 => rows_dot_m::<W, 4, 2>(x, k, w, rows, chunk, stride, col0),
            5 => rows_dot_m::<W, 5, 1>(x, k, w, rows, chunk, stride, col0),
            6 => rows_dot_m::<W, 6, 1>(x, k, w, rows, chunk, stride, col0),
            7 => rows_dot_m::<W, 7, 1>(x, k, w, rows, chunk, stride, col0),
            _ => rows_dot_m::<W, 8, 1>(x, k, w, rows, chunk, stride, col0),
        }
    }

    /// `M` activation rows, `U` sums per row (each takes every `U`-th group of 8 values).
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn rows_dot_m<W: Elem, const M: usize, const U: usize>(x: &[f32], k: usize, w: &[W], rows: usize, chunk: &mut [f32], stride: usize, col0: usize) {
        let (body, wide) = (k / 8 * 8, k / (8 * U) * (8 * U));
        for j in 0..rows {
            let mut acc = [[_mm256_setzero_ps(); M]; U];
            let wr = w.as_ptr().add(j * k);
            let mut i = 0;
            while i < wide {
                // One hint per cache line, 4 KiB ahead: the hardware prefetchers alone left
                // a bf16 decode at ~80 % of llama.cpp's bandwidth on this path.
                let bytes = 8 * U * std::mem::size_of::<W>();
                for off in (0..bytes).step_by(64) {
                    _mm_prefetch::<_MM_HINT_T0>((wr.add(i) as *const i8).wrapping_add(4096 + off));
                }
                for (u, acc) in acc.iter_mut().enumerate() {
                    let wv = load8!(W, wr.add(i + 8 * u));
                    for (r, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(r * k + i + 8 * u)), wv, *a);
                    }
                }
                i += 8 * U;
            }
            while i < body {
                let wv = load8!(W, wr.add(i));
                for (r, a) in acc[0].iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(x.as_ptr().add(r * k + i)), wv, *a);
                }
                i += 8;
            }
            for r in 0..M {
                let mut v = acc[0][r];
                for a in &acc[1..] {
                    v = _mm256_add_ps(v, a[r]);
                }
                let mut s = hsum(v);
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
    use candle_core::DType;

    /// Every level against candle's matmul on random inputs: shapes with and without a vector
    /// tail, 1..=11 activation rows (more than one group; each of the AVX2 kernel's unrolled
    /// row counts, with `k` ending inside its unrolled stride), f32 and bf16 weights. Seeded.
    #[test]
    fn matches_candle_matmul_at_every_level() -> candle_core::Result<()> {
        for (i, &(m, k, n)) in [(1, 64, 37), (1, 896, 128), (1, 40, 3), (2, 72, 20), (3, 100, 9), (4, 104, 17), (6, 48, 5), (8, 256, 64), (11, 333, 50)].iter().enumerate() {
            let x = crate::testing::randn(2 * i as u64, (m, k), 1.)?;
            let w = crate::testing::randn(2 * i as u64 + 1, (n, k), 1.)?;
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
                // bf16 activations too: against f32 products of the same bf16 values.
                let xb = x.to_dtype(DType::BF16)?;
                let want = xb.to_dtype(DType::F32)?.matmul(&wb.to_dtype(DType::F32)?.t()?)?.to_vec2::<f32>()?;
                matvec_bf16(&xb.flatten_all()?.to_vec1::<bf16>()?, m, k, &wb.flatten_all()?.to_vec1::<bf16>()?, n, &mut got, level);
                check(&want, &got, n, 1e-5, &format!("bf16·bf16 {level:?} {m}x{k}x{n}"));
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

#[cfg(test)]
mod speed {
    use super::*;

    /// Not a test: prints the kernel's bandwidth on a Qwen2.5-0.5B-sized head
    /// (`cargo test --release --lib matvec_bandwidth -- --ignored --nocapture`).
    #[test]
    #[ignore]
    fn matvec_bandwidth() {
        let (n, k) = (151_936, 896);
        let x: Vec<f32> = (0..k).map(|i| (i as f32).sin()).collect();
        let wf: Vec<f32> = (0..n * k).map(|i| ((i % 97) as f32) * 1e-3).collect();
        let wb: Vec<bf16> = wf.iter().map(|&v| bf16::from_f32(v)).collect();
        let mut out = vec![0f32; n];
        for level in Level::available() {
            for (name, bytes) in [("f32", 4), ("bf16", 2)] {
                let mut best = f64::MAX;
                for _ in 0..5 {
                    let t = std::time::Instant::now();
                    if bytes == 4 {
                        matvec(&x, 1, k, &wf, n, &mut out, level);
                    } else {
                        let xb: Vec<bf16> = x.iter().map(|&v| bf16::from_f32(v)).collect();
                        matvec_bf16(&xb, 1, k, &wb, n, &mut out, level);
                    }
                    best = best.min(t.elapsed().as_secs_f64());
                }
                println!("{level:?} {name}: {:.1} GB/s", (n * k * bytes) as f64 / best / 1e9);
            }
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t = std::time::Instant::now();
                matvec(&x, 1, k, &wf[..n / 2 * k], n / 2, &mut out, level);
                best = best.min(t.elapsed().as_secs_f64());
            }
            println!("{level:?} f32 half rows: {:.1} GB/s", (n / 2 * k * 4) as f64 / best / 1e9);
        }
    }
}
