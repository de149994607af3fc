//! One kv head's group of query heads over its keys, in AVX2 + FMA: the scores of every head
//! of the group from one read of each K row, and each head's weighted sum of values from one
//! read of each V row per eight lanes of the output. The scalar loop before called a dot
//! product per (key, head), each ending in a horizontal sum through memory. On the Zen 4 VM,
//! a 0.5B model's shape (14 heads over 2 kv heads of 64, f32 K/V, 200 keys, 24 layers):
//! ~21 → ~9 µs a layer with K/V in cache, ~26 → ~17 µs with them evicted between steps, as
//! the weights streamed since the last step leave them.

use super::Value;

/// Heads of a group taken together (one accumulator register each).
const TILE: usize = 8;

/// `p[h·n + j] = scale · q_h · K[slots[j]]` for the `q.len() / d` heads of `q` (`[heads, d]`),
/// reading each K row's `d` values at `off` of its `width`. `false`: no kernel at this level or
/// for this `d` (a multiple of 8 is needed); `p` is untouched. The caller has checked that
/// every slot is a row of `k`.
pub(super) fn scores<T: Value>(q: &[f32], k: &[T], v: &[T], (width, off, d): (usize, usize, usize), slots: &[u32], scale: f32, p: &mut [f32]) -> bool {
    if !runs(d, width, off) {
        return false;
    }
    let (heads, n) = (q.len() / d, slots.len());
    assert!(p.len() >= heads * n && slots.iter().all(|&s| (s as usize + 1) * width <= k.len().min(v.len())), "scores: p or slots out of range");
    #[cfg(target_arch = "x86_64")]
    for h0 in (0..heads).step_by(TILE) {
        let (q, p) = (&q[h0 * d..], &mut p[h0 * n..]);
        // SAFETY: `runs` checked AVX2 + FMA; the assert above bounds every row read, and each
        // tile reads `g` heads of `q` and writes `g` rows of `n` in `p`, inside both slices.
        unsafe {
            match (heads - h0).min(TILE) {
                1 => fma::scores::<T, 1>(q, k, v, width, off, d, slots, scale, p),
                2 => fma::scores::<T, 2>(q, k, v, width, off, d, slots, scale, p),
                3 => fma::scores::<T, 3>(q, k, v, width, off, d, slots, scale, p),
                4 => fma::scores::<T, 4>(q, k, v, width, off, d, slots, scale, p),
                5 => fma::scores::<T, 5>(q, k, v, width, off, d, slots, scale, p),
                6 => fma::scores::<T, 6>(q, k, v, width, off, d, slots, scale, p),
                7 => fma::scores::<T, 7>(q, k, v, width, off, d, slots, scale, p),
                _ => fma::scores::<T, 8>(q, k, v, width, off, d, slots, scale, p),
            }
        }
    }
    true
}

/// `o[h] = Σ_j p[h·n + j] · V[slots[j]]` for the `o.len() / d` heads of `o` (`[heads, d]`).
/// `false` as `scores`.
pub(super) fn values<T: Value>(p: &[f32], v: &[T], (width, off, d): (usize, usize, usize), slots: &[u32], o: &mut [f32]) -> bool {
    if !runs(d, width, off) {
        return false;
    }
    let (heads, n) = (o.len() / d, slots.len());
    assert!(p.len() >= heads * n && slots.iter().all(|&s| (s as usize + 1) * width <= v.len()), "values: p or slots out of range");
    #[cfg(target_arch = "x86_64")]
    for h0 in (0..heads).step_by(TILE) {
        let (p, o) = (&p[h0 * n..], &mut o[h0 * d..]);
        // SAFETY: as in `scores`, with `g` heads of `o` written and `g` rows of `p` read.
        unsafe {
            match (heads - h0).min(TILE) {
                1 => fma::values::<T, 1>(p, v, width, off, d, slots, o),
                2 => fma::values::<T, 2>(p, v, width, off, d, slots, o),
                3 => fma::values::<T, 3>(p, v, width, off, d, slots, o),
                4 => fma::values::<T, 4>(p, v, width, off, d, slots, o),
                5 => fma::values::<T, 5>(p, v, width, off, d, slots, o),
                6 => fma::values::<T, 6>(p, v, width, off, d, slots, o),
                7 => fma::values::<T, 7>(p, v, width, off, d, slots, o),
                _ => fma::values::<T, 8>(p, v, width, off, d, slots, o),
            }
        }
    }
    true
}

/// The kernels run: AVX2 + FMA at this level, whole eight-lane chunks of a row inside it.
fn runs(d: usize, width: usize, off: usize) -> bool {
    cfg!(target_arch = "x86_64") && crate::cpu::level() >= crate::cpu::Level::Avx2 && d > 0 && d.is_multiple_of(8) && off + d <= width
}

#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;

    use super::super::Value;

    /// Eight values at `p` as f32 lanes (bf16 widened exactly).
    #[inline(always)]
    unsafe fn load8<T: Value>(p: *const T) -> __m256 {
        match T::BF16 {
            true => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())))),
            false => _mm256_loadu_ps(p.cast()),
        }
    }

    /// Keys ahead whose K and V rows are fetched.
    /// Keys ahead whose K and V rows are fetched (on the Zen 4 VM, 24 layers of 200 keys
    /// evicted between calls: ~23 µs a layer without, ~17 with 8 ahead; 4, 16 or 32 ahead
    /// and V into L2 only were no better).
    const AHEAD: usize = 8;

    /// Every cache line of the `d` values at `p`.
    #[inline(always)]
    unsafe fn prefetch_row<T>(p: *const T, d: usize) {
        let bytes = d * std::mem::size_of::<T>();
        for line in (0..bytes).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>().add(line));
        }
    }

    /// The eight lanes' sums of `a[0..8]` in one register, lane `h` for `a[h]`.
    #[inline(always)]
    unsafe fn sums8(a: [__m256; 8]) -> __m256 {
        let (t0, t1) = (_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
        let (t2, t3) = (_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
        let (u0, u1) = (_mm256_hadd_ps(t0, t1), _mm256_hadd_ps(t2, t3));
        // u0 holds heads 0-3 of the low and high halves, u1 heads 4-7.
        _mm256_add_ps(_mm256_permute2f128_ps::<0x20>(u0, u1), _mm256_permute2f128_ps::<0x31>(u0, u1))
    }

    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn scores<T: Value, const G: usize>(q: &[f32], k: &[T], v: &[T], width: usize, off: usize, d: usize, slots: &[u32], scale: f32, p: &mut [f32]) {
        let n = slots.len();
        let (q, k, v, p) = (q.as_ptr(), k.as_ptr(), v.as_ptr(), p.as_mut_ptr());
        let mut lanes = [0f32; 8];
        for (j, &s) in slots.iter().enumerate() {
            // The K/V of a long context come from memory (the weights streamed since the last
            // step evicted them): each row is a few lines apart from the next, so the hardware
            // prefetcher does not run ahead of this loop. Ask for the rows AHEAD keys on, the
            // V rows too (the values pass reads them next).
            if let Some(&ahead) = slots.get(j + AHEAD) {
                prefetch_row::<T>(k.add(ahead as usize * width + off), d);
                prefetch_row::<T>(v.add(ahead as usize * width + off), d);
            }
            let row = k.add(s as usize * width + off);
            let mut acc = [_mm256_setzero_ps(); 8];
            let mut c = 0;
            while c < d {
                let kv = load8(row.add(c));
                for (h, a) in acc.iter_mut().enumerate().take(G) {
                    *a = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(h * d + c)), kv, *a);
                }
                c += 8;
            }
            _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_mul_ps(sums8(acc), _mm256_set1_ps(scale)));
            for (h, &l) in lanes.iter().enumerate().take(G) {
                *p.add(h * n + j) = l;
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn values<T: Value, const G: usize>(p: &[f32], v: &[T], width: usize, off: usize, d: usize, slots: &[u32], o: &mut [f32]) {
        let n = slots.len();
        let (p, v, o) = (p.as_ptr(), v.as_ptr(), o.as_mut_ptr());
        let mut c = 0;
        while c < d {
            let mut acc = [_mm256_setzero_ps(); G];
            for (j, &s) in slots.iter().enumerate() {
                let vv = load8(v.add(s as usize * width + off + c));
                for (h, a) in acc.iter_mut().enumerate() {
                    *a = _mm256_fmadd_ps(_mm256_set1_ps(*p.add(h * n + j)), vv, *a);
                }
            }
            for (h, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(o.add(h * d + c), *a);
            }
            c += 8;
        }
    }
}
