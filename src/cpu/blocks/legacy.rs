//! Dots of the 32-value block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) in the file's layout with
//! `Q8` activations, which the AVX-512 VNNI level keeps (below it `rows8` regroups them): one
//! weight row against up to four activation rows at decode, each weight block decoded once
//! into 32 bytes and dotted with every row (`vpmaddubsw` + `vpmaddwd`), and the 512-bit
//! prefill tile. The block decoding and reductions here serve `rows8` too.
//!
//! The 4- and 5-bit formats are dotted as unsigned values (0..15, 0..31) — `vpmaddubsw` takes
//! unsigned × signed bytes without saturating at these sizes — and their offset (−8, −16) or
//! min (`m`) comes back per block as `c · s`, where `s = d_x · Σq_x` is kept with the
//! activations: Σ(d(u − o))·x = d·Σu·x − o·d·Σx, and Σ(d·u + m)·x = d·Σu·x + m·Σx. Q8_0 is
//! signed: its sign moves onto the activation (`vpsignb`) so the weight can be unsigned.

#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // `r` indexes several per-row arrays at once
pub(super) mod avx2 {
    use super::super::act::{Q8, GROUP};
    use super::super::Format;
    use std::arch::x86_64::*;

    /// The f16 at `p` as f32.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn f16_at(p: *const u8) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(p.cast::<u16>().read_unaligned() as i32)))
    }

    /// 0xFF in byte `i` where bit `i` of `bits` is set (the 5th bit of the Q5 formats).
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn bit_bytes(bits: u32) -> __m256i {
        own_bits(_mm256_shuffle_epi8(_mm256_set1_epi32(bits as i32), _mm256_setr_epi64x(0, 0x0101_0101_0101_0101, 0x0202_0202_0202_0202, 0x0303_0303_0303_0303)))
    }

    /// 0xFF in byte `i` where bit `i % 8` of byte `i` of `spread` is set.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub unsafe fn own_bits(spread: __m256i) -> __m256i {
        // Every bit but byte i's own set: the OR is all ones exactly when that bit is.
        let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
        _mm256_cmpeq_epi8(_mm256_or_si256(spread, others), _mm256_set1_epi64x(-1))
    }

    /// The Q5 formats' fifth bits at `p` (32 bits, one per value) as 0x10 bytes.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub unsafe fn high(p: *const u8) -> __m256i {
        _mm256_and_si256(bit_bytes(p.cast::<u32>().read_unaligned()), _mm256_set1_epi8(0x10))
    }

    /// 16 bytes of nibbles as 32 values: the low nibbles (values 0..16) then the high ones.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub unsafe fn nibbles(p: *const u8) -> __m256i {
        let q = _mm_loadu_si128(p as *const __m128i);
        let lo = _mm_and_si128(q, _mm_set1_epi8(0x0f));
        let hi = _mm_and_si128(_mm_srli_epi16::<4>(q), _mm_set1_epi8(0x0f));
        _mm256_set_m128i(hi, lo)
    }

    /// Block `b` at `w`: its 32 values as bytes (unsigned but for Q8_0), its scale `d`, and
    /// the coefficient `c` of the activations' `s`.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn decode<const F: u8>(w: *const u8) -> (__m256i, f32, f32) {
        let d = f16_at(w);
        match F {
            f if f == Format::Q8_0 as u8 => (_mm256_loadu_si256(w.add(2) as *const __m256i), d, 0.0),
            f if f == Format::Q4_0 as u8 => (nibbles(w.add(2)), d, -8.0 * d),
            f if f == Format::Q4_1 as u8 => (nibbles(w.add(4)), d, f16_at(w.add(2))),
            f if f == Format::Q5_0 as u8 => (_mm256_or_si256(nibbles(w.add(6)), high(w.add(2))), d, -16.0 * d),
            _ => (_mm256_or_si256(nibbles(w.add(8)), high(w.add(4))), d, f16_at(w.add(2))),
        }
    }

    /// Row `w` (`nb` blocks) against activation rows `r0..r0 + M`: `out[i]` is row `r0 + i`'s dot.
    /// Even and odd blocks keep separate sums: one chain of FMAs per row would wait on the
    /// FMA's latency every block (measured: a Q8_0 row streamed at half the L3's rate).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn row<const F: u8, const M: usize>(w: *const u8, nb: usize, a: &Q8, r0: usize, out: &mut [f32]) {
        let mut acc = [[_mm256_setzero_ps(); M]; 2];
        let mut corr = [[0f32; M]; 2];
        let (even, odd) = acc.split_at_mut(1);
        let (ceven, codd) = corr.split_at_mut(1);
        let mut b = 0;
        let bytes = Format::from_id(F).bytes();
        while b + 2 <= nb {
            prefetch(w.add(b * bytes), 2 * bytes);
            block::<F, M>(w, b, nb, a, r0, &mut even[0], &mut ceven[0]);
            block::<F, M>(w, b + 1, nb, a, r0, &mut odd[0], &mut codd[0]);
            b += 2;
        }
        if b < nb {
            block::<F, M>(w, b, nb, a, r0, &mut even[0], &mut ceven[0]);
        }
        for r in 0..M {
            out[r] = hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + corr[0][r] + corr[1][r];
        }
    }

    /// Block `b` of row `w` into each activation row's sums.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn block<const F: u8, const M: usize>(w: *const u8, b: usize, nb: usize, a: &Q8, r0: usize, acc: &mut [__m256; M], corr: &mut [f32; M]) {
        let (u, d, c) = decode::<F>(w.add(b * Format::from_id(F).bytes()));
        let signed = F == Format::Q8_0 as u8;
        let au = if signed { _mm256_sign_epi8(u, u) } else { u };
        for r in 0..M {
            let blk = (r0 + r) * nb + b;
            let mut x = _mm256_loadu_si256(a.q.as_ptr().add(blk * 32) as *const __m256i);
            if signed {
                x = _mm256_sign_epi8(x, u);
            }
            let dot = _mm256_madd_epi16(_mm256_maddubs_epi16(au, x), _mm256_set1_epi16(1));
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(d * *a.d.get_unchecked(blk)), acc[r]);
            if !signed {
                // The min formats take `s` through f16 as ggml's `block_q8_1` holds it.
                let min = F == Format::Q4_1 as u8 || F == Format::Q5_1 as u8;
                corr[r] += c * *a.s.get_unchecked(2 * blk + min as usize);
            }
        }
    }

    /// Block `b` of row `w` against the `GROUP` activation rows of group `g` (rows `8g..8g+8`):
    /// the eight rows' scaled dots into `acc`, their offset or min terms into `corr` (the
    /// AVX-512 tile's last block when a row has an odd count). The weight block is decoded
    /// once for the eight rows and their dots land in the lanes of one vector.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile_block<const F: u8>(w: *const u8, b: usize, nb: usize, a: &Q8, g: usize, acc: &mut __m256, corr: &mut __m256) {
        let bytes = Format::from_id(F).bytes();
        let signed = F == Format::Q8_0 as u8;
        let ones = _mm256_set1_epi16(1);
        let blk = w.add(b * bytes);
        prefetch(blk, bytes);
        let (u, d, c) = decode::<F>(blk);
        let au = if signed { _mm256_sign_epi8(u, u) } else { u };
        let mut p = [_mm256_setzero_si256(); GROUP];
        for (r, p) in p.iter_mut().enumerate() {
            let mut x = _mm256_loadu_si256(a.q.as_ptr().add(((g * GROUP + r) * nb + b) * 32) as *const __m256i);
            if signed {
                x = _mm256_sign_epi8(x, u);
            }
            let m = _mm256_maddubs_epi16(au, x);
            *p = if signed { _mm256_madd_epi16(m, ones) } else { m };
        }
        let sums = if signed { reduce32(&p) } else { reduce16(&p) };
        let at = (g * nb + b) * GROUP;
        *acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(_mm256_set1_ps(d), _mm256_loadu_ps(a.d8.as_ptr().add(at))), *acc);
        if !signed {
            *corr = _mm256_fmadd_ps(_mm256_set1_ps(c), _mm256_loadu_ps(s8(F, a).as_ptr().add(at)), *corr);
        }
    }

    /// The activations' `s` as format `F` takes it: the min formats through f16, as ggml's
    /// `block_q8_1` holds it.
    #[inline]
    pub fn s8(f: u8, a: &Q8) -> &[f32] {
        if f == Format::Q4_1 as u8 || f == Format::Q5_1 as u8 {
            &a.s8h
        } else {
            &a.s8
        }
    }

    /// The eight i32 vectors' totals, vector `r`'s in lane `r`.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub unsafe fn reduce32(p: &[__m256i; GROUP]) -> __m256i {
        let q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
        let q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
        halves(q0, q1)
    }

    /// The eight i16 vectors' totals as i32, vector `r`'s in lane `r`. Two rounds of pairwise
    /// i16 sums before widening: a `vpmaddubsw` lane of these formats is at most 2·31·127 =
    /// 7874 (activations stay within ±127), so four of them, 31 496, still fit in an i16.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub unsafe fn reduce16(p: &[__m256i; GROUP]) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        let q0 = _mm256_hadd_epi16(_mm256_hadd_epi16(p[0], p[1]), _mm256_hadd_epi16(p[2], p[3]));
        let q1 = _mm256_hadd_epi16(_mm256_hadd_epi16(p[4], p[5]), _mm256_hadd_epi16(p[6], p[7]));
        halves(_mm256_madd_epi16(q0, ones), _mm256_madd_epi16(q1, ones))
    }

    /// `q0` holds vectors 0–3's low-half sums in its low lane and their high-half sums in its
    /// high lane, `q1` vectors 4–7's: the eight totals.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn halves(q0: __m256i, q1: __m256i) -> __m256i {
        _mm256_add_epi32(_mm256_permute2x128_si256::<0x20>(q0, q1), _mm256_permute2x128_si256::<0x31>(q0, q1))
    }

    /// How far ahead of the block being dotted the weight stream is prefetched, in bytes.
    pub const AHEAD: usize = 4096;

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

    /// The sum of the eight lanes.
    #[inline]
    #[target_feature(enable = "avx2")]
    pub unsafe fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }
}

/// The prefill tile with AVX-512 VNNI: two blocks per step in 512-bit registers, `vpdpbusd`
/// for the dots (no `vpmaddubsw` saturation to mind, so Q8_0 needs only its sign moved onto
/// the activations), the sixteen (row, block) sums reduced with unpacks and one lane shuffle.
#[cfg(target_arch = "x86_64")]
pub(super) mod avx512 {
    use super::super::act::{Q8, GROUP};
    use super::super::Format;
    use super::avx2;
    use std::arch::x86_64::*;

    /// As `avx2::tile`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn tile<const F: u8>(w: *const u8, nb: usize, a: &Q8, g: usize, out: &mut [f32]) {
        let bytes = Format::from_id(F).bytes();
        let signed = F == Format::Q8_0 as u8;
        let (mut acc, mut corr) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut b = 0;
        while b + 2 <= nb {
            let (w0, w1) = (w.add(b * bytes), w.add((b + 1) * bytes));
            avx2::prefetch(w0, 2 * bytes);
            let (u0, d0, c0) = avx2::decode::<F>(w0);
            let (u1, d1, c1) = avx2::decode::<F>(w1);
            let u = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(u0), u1);
            let (uu, neg) = if signed { (_mm512_abs_epi8(u), _mm512_movepi8_mask(u)) } else { (u, 0) };
            let mut p = [_mm512_setzero_si512(); GROUP];
            for (r, p) in p.iter_mut().enumerate() {
                // Row r's blocks b and b + 1 are adjacent: one 64-byte load.
                let mut x = _mm512_loadu_si512(a.q.as_ptr().add(((g * GROUP + r) * nb + b) * 32) as *const _);
                if signed {
                    x = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
                }
                *p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), uu, x);
            }
            // Lanes [b: rows 0-3, b+1: rows 0-3, b: rows 4-7, b+1: rows 4-7].
            let sums = reduce(&p);
            let at = (g * nb + b) * GROUP;
            let dx = order(_mm512_loadu_ps(a.d8.as_ptr().add(at)));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), _mm512_mul_ps(by_block(d0, d1), dx), acc);
            if !signed {
                corr = _mm512_fmadd_ps(by_block(c0, c1), order(_mm512_loadu_ps(avx2::s8(F, a).as_ptr().add(at))), corr);
            }
            b += 2;
        }
        let t = _mm512_add_ps(acc, corr);
        let rows = _mm512_add_ps(_mm512_shuffle_f32x4::<0x08>(t, t), _mm512_shuffle_f32x4::<0x0D>(t, t));
        let mut total = _mm512_castps512_ps256(rows);
        if b < nb {
            let (mut a2, mut c2) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            avx2::tile_block::<F>(w, b, nb, a, g, &mut a2, &mut c2);
            total = _mm256_add_ps(total, _mm256_add_ps(a2, c2));
        }
        _mm256_storeu_ps(out.as_mut_ptr(), total);
    }

    /// `v0` in the lanes of block `b`, `v1` in those of block `b + 1` (the `reduce` order).
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn by_block(v0: f32, v1: f32) -> __m512 {
        _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(v0), _mm512_set1_ps(v1))
    }

    /// Two blocks' eight per-row values `[b: rows 0-7, b+1: rows 0-7]` in the `reduce` order.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn order(v: __m512) -> __m512 {
        _mm512_shuffle_f32x4::<0xD8>(v, v)
    }

    /// Each of eight vectors' two 256-bit halves summed: lanes [half 0 of vectors 0-3,
    /// half 1 of 0-3, half 0 of 4-7, half 1 of 4-7].
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn reduce(p: &[__m512i; GROUP]) -> __m512i {
        let t0 = quad(pair(p[0], p[1]), pair(p[2], p[3]));
        let t1 = quad(pair(p[4], p[5]), pair(p[6], p[7]));
        _mm512_add_epi32(_mm512_shuffle_i32x4::<0x88>(t0, t1), _mm512_shuffle_i32x4::<0xDD>(t0, t1))
    }

    /// Per 128-bit lane: `[a0+a2, b0+b2, a1+a3, b1+b3]`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn pair(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
    }

    /// Per 128-bit lane, from two `pair`s: the four vectors' sums over the lane.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn quad(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b))
    }
}
