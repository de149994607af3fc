//! A run of keys for every head, in AVX2 + FMA: each key's K row (all kv heads) read once for
//! the scores of all the heads, and each head's weighted sum of values from one read of each V
//! row per eight lanes of the output. The scalar loop before called a dot product per (key,
//! head), each ending in a horizontal sum through memory. On the Zen 4 VM, a 0.5B model's
//! shape (14 heads over 2 kv heads of 64, f32 K/V, 200 keys, 24 layers): ~21 → ~9 µs a layer
//! with K/V in cache.

use super::Value;

/// Heads of a group taken together (one accumulator register each).
const TILE: usize = 8;

/// `fma::$kernel::<T, G>($args)` with `G` the tile's heads (the rest of the group, at most 8).
macro_rules! by_tile {
    ($rest:expr, $kernel:ident, ($($arg:expr),*)) => {
        match $rest.min(TILE) {
            1 => fma::$kernel::<T, 1>($($arg),*),
            2 => fma::$kernel::<T, 2>($($arg),*),
            3 => fma::$kernel::<T, 3>($($arg),*),
            4 => fma::$kernel::<T, 4>($($arg),*),
            5 => fma::$kernel::<T, 5>($($arg),*),
            6 => fma::$kernel::<T, 6>($($arg),*),
            7 => fma::$kernel::<T, 7>($($arg),*),
            _ => fma::$kernel::<T, 8>($($arg),*),
        }
    };
}

/// Where a run's K or V rows are: `width` values a row (`kv_heads` heads of `d`).
#[derive(Clone, Copy)]
pub(super) struct Rows {
    pub width: usize,
    pub d: usize,
    pub kv_heads: usize,
}

/// `p[h·n + j] = scale · q_h · K[slots[j]]` for the `q.len() / d` heads of `q` (`[heads, d]`,
/// each kv head's group in turn). `false`: no kernel at this level or for this `d` (a multiple
/// of 8 is needed); `p` is untouched.
pub(super) fn scores<T: Value>(q: &[f32], k: &[T], v: &[T], r: Rows, slots: &[u32], scale: f32, p: &mut [f32]) -> bool {
    if !runs(r) {
        return false;
    }
    let (heads, n) = (q.len() / r.d, slots.len());
    assert!(heads.is_multiple_of(r.kv_heads) && p.len() >= heads * n && in_rows(slots, r, k.len().min(v.len())), "scores: p or slots out of range");
    #[cfg(target_arch = "x86_64")]
    for h0 in (0..heads / r.kv_heads).step_by(TILE) {
        // SAFETY: `runs` checked AVX2 + FMA; the assert bounds every row read and every head's
        // row of `p`.
        unsafe { by_tile!(heads / r.kv_heads - h0, scores, (q, k, v, r, h0, slots, scale, p)) }
    }
    true
}

/// `o[h] = Σ_j p[h·n + j] · V[slots[j]]` for the `o.len() / d` heads of `o` (`[heads, d]`).
/// `false` as `scores`.
pub(super) fn values<T: Value>(p: &[f32], v: &[T], r: Rows, slots: &[u32], o: &mut [f32]) -> bool {
    if !runs(r) {
        return false;
    }
    let (heads, n) = (o.len() / r.d, slots.len());
    assert!(heads.is_multiple_of(r.kv_heads) && p.len() >= heads * n && in_rows(slots, r, v.len()), "values: p or slots out of range");
    #[cfg(target_arch = "x86_64")]
    for h0 in (0..heads / r.kv_heads).step_by(TILE) {
        // SAFETY: as in `scores`, with each head's row of `o` written.
        unsafe { by_tile!(heads / r.kv_heads - h0, values, (p, v, r, h0, slots, o)) }
    }
    true
}

/// Every slot a whole row of a store of `len` values.
fn in_rows(slots: &[u32], r: Rows, len: usize) -> bool {
    slots.iter().all(|&s| (s as usize + 1) * r.width <= len)
}

/// The kernels run: AVX2 + FMA at this level, whole eight-lane chunks of a head.
fn runs(r: Rows) -> bool {
    cfg!(target_arch = "x86_64") && crate::cpu::level() >= crate::cpu::Level::Avx2 && r.d > 0 && r.d.is_multiple_of(8) && r.kv_heads * r.d <= r.width
}

#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;

    use super::super::Value;
    use super::Rows;

    /// Keys ahead whose K and V rows are fetched.
    const AHEAD: usize = 4;

    /// Every cache line of the `len` values at `p`.
    #[inline(always)]
    unsafe fn prefetch<T>(p: *const T, len: usize) {
        for line in (0..len * std::mem::size_of::<T>()).step_by(64) {
            _mm_prefetch::<_MM_HINT_T0>(p.cast::<i8>().add(line));
        }
    }

    /// Eight values at `p` as f32 lanes (bf16 widened exactly).
    #[inline(always)]
    unsafe fn load8<T: Value>(p: *const T) -> __m256 {
        match T::BF16 {
            true => _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p.cast())))),
            false => _mm256_loadu_ps(p.cast()),
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

    /// Heads `h0..h0 + G` of every kv head's group: key by key, the whole K row (every kv
    /// head) in turn, so a run's rows stream in order.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn scores<T: Value, const G: usize>(q: &[f32], k: &[T], v: &[T], r: Rows, h0: usize, slots: &[u32], scale: f32, p: &mut [f32]) {
        let (n, d, group) = (slots.len(), r.d, q.len() / r.d / r.kv_heads);
        let (q, k, v, p) = (q.as_ptr(), k.as_ptr(), v.as_ptr(), p.as_mut_ptr());
        let mut lanes = [0f32; 8];
        for (j, &s) in slots.iter().enumerate() {
            // The rows of K and V a few keys on (V for the values pass that follows): the
            // hardware prefetchers do not run ahead of rows scattered over a paged pool.
            if let Some(&ahead) = slots.get(j + AHEAD) {
                prefetch(k.add(ahead as usize * r.width), r.kv_heads * d);
                prefetch(v.add(ahead as usize * r.width), r.kv_heads * d);
            }
            for kv in 0..r.kv_heads {
                let (row, first) = (k.add(s as usize * r.width + kv * d), kv * group + h0);
                let mut acc = [_mm256_setzero_ps(); 8];
                let mut c = 0;
                while c < d {
                    let kv = load8(row.add(c));
                    for (h, a) in acc.iter_mut().enumerate().take(G) {
                        *a = _mm256_fmadd_ps(_mm256_loadu_ps(q.add((first + h) * d + c)), kv, *a);
                    }
                    c += 8;
                }
                _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_mul_ps(sums8(acc), _mm256_set1_ps(scale)));
                for (h, &l) in lanes.iter().enumerate().take(G) {
                    *p.add((first + h) * n + j) = l;
                }
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn values<T: Value, const G: usize>(p: &[f32], v: &[T], r: Rows, h0: usize, slots: &[u32], o: &mut [f32]) {
        let (n, d, group) = (slots.len(), r.d, o.len() / r.d / r.kv_heads);
        let (p, v, o) = (p.as_ptr(), v.as_ptr(), o.as_mut_ptr());
        for kv in 0..r.kv_heads {
            let first = kv * group + h0;
            let mut c = 0;
            while c < d {
                let mut acc = [_mm256_setzero_ps(); G];
                for (j, &s) in slots.iter().enumerate() {
                    let vv = load8(v.add(s as usize * r.width + kv * d + c));
                    for (h, a) in acc.iter_mut().enumerate() {
                        *a = _mm256_fmadd_ps(_mm256_set1_ps(*p.add((first + h) * n + j)), vv, *a);
                    }
                }
                for (h, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(o.add((first + h) * d + c), *a);
                }
                c += 8;
            }
        }
    }
}
