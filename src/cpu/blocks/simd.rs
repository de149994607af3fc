//! AVX2 pieces the block kernels share (`rows8`, `q4k8`, `q6k8`): the four-byte activation
//! broadcast and the weight stream's prefetch schedule (which `cpu::q4_k`'s panels use too);
//! and the loads of the 512-bit passes over a panel's two interleaved groups (`rows8`).

#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use std::arch::x86_64::*;

    /// How far ahead of the block being dotted the weight stream is prefetched, in bytes. At
    /// 4 KiB, on a Zen 5 VM whose host gave a ~66-71 GB/s triad, the AVX2 groups streamed a
    /// [262144, 1024] weight for one activation row at Q4_K 72-77 GB/s, Q5_K 63-64, Q6_K 70-71,
    /// and a whole Q4_K_M file decoded at 84-86 % of the triad at the AVX2 level; at 8 KiB
    /// 82-85, 67-70, 74-77 and 92-93 % (two rounds each). At a ~42-46 GB/s triad and at the
    /// AVX-512 level the files decoded alike either way, and 256-token prefill moved by 1-2 %.
    pub const AHEAD: usize = 8192;

    /// Prefetches the `bytes` bytes `AHEAD` past `p` into L2/L1 (one hint per cache line):
    /// the decode step streams every weight once, and the hardware prefetchers alone left
    /// the k-quants at 70 % of the triad bandwidth.
    #[inline(always)]
    pub unsafe fn prefetch(p: *const u8, bytes: usize) {
        let mut off = 0;
        while off < bytes {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(AHEAD + off) as *const i8);
            off += 64;
        }
    }

    /// The 32 bytes at `p` split into their low nibbles and their high ones (each 0..16 in a
    /// byte of its own).
    #[inline(always)]
    pub unsafe fn nibbles(p: *const u8) -> (__m256i, __m256i) {
        let (q, m4) = (_mm256_loadu_si256(p as *const __m256i), _mm256_set1_epi8(0x0f));
        (_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4))
    }

    /// Four activation bytes at `p`, in every 32-bit lane (`q4k8`, `q6k8`: one broadcast
    /// against eight interleaved rows).
    #[inline(always)]
    pub unsafe fn four(p: *const i8) -> __m256i {
        _mm256_set1_epi32(p.cast::<i32>().read_unaligned())
    }

    /// Step `i`'s share of a block's prefetch, `step` bytes a step (at most 128): a group's
    /// block of a kilobyte or more hints a line or two per step of its loop rather than all
    /// at its start, where a burst of 19 or 27 hints stalls on the core's fill buffers (`q6k8`
    /// decoded at 12 GiB/s with the burst and 16 spread, on an AVX2 Zen-class VM). A fixed
    /// count per step: a loop over a step's lines was merged back into one burst by LLVM.
    #[inline(always)]
    pub unsafe fn prefetch_step(p: *const u8, i: usize, step: usize) {
        debug_assert!(step <= 128);
        let at = p.wrapping_add(AHEAD + i * step);
        _mm_prefetch::<_MM_HINT_T0>(at as *const i8);
        if step > 64 {
            _mm_prefetch::<_MM_HINT_T0>(at.wrapping_add(64) as *const i8);
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use std::arch::x86_64::*;

    /// The 32 bytes at `at` of both groups' block: `b0`'s in the low half.
    #[inline(always)]
    pub unsafe fn both(b0: *const u8, b1: *const u8, at: usize) -> __m512i {
        let lo = _mm512_castsi256_si512(_mm256_loadu_si256(b0.add(at) as *const __m256i));
        _mm512_inserti64x4::<1>(lo, _mm256_loadu_si256(b1.add(at) as *const __m256i))
    }

    /// The 16 bytes at `at` of both groups' block, `b0`'s first.
    #[inline(always)]
    pub unsafe fn both16(b0: *const u8, b1: *const u8, at: usize) -> __m256i {
        _mm256_inserti128_si256::<1>(_mm256_castsi128_si256(_mm_loadu_si128(b0.add(at) as *const __m128i)), _mm_loadu_si128(b1.add(at) as *const __m128i))
    }
}
