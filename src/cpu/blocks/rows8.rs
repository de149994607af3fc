//! The 32-value block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) eight rows at a time, with AVX2
//! (at the AVX-512 level with VNNI the 4/5-bit dots take 256-bit `vpdpbusd`, the same sums in
//! fewer instructions; Q8_0 there takes `q8_0`'s panels). In the file's layout each row is
//! dotted on its own: per block of 32 values a row pays for its integer dot and then, alone,
//! for converting it, loading and multiplying its scale, one FMA and its offset term, and each
//! row ends in a horizontal sum (on a 0.5B model's rows of 896 values, 28 blocks, that overhead
//! was a large part of a decode step). Here block `b` of eight rows lies together, so the eight
//! rows' integer dots are reduced into the lanes of one vector and scaled, offset and
//! accumulated by a few vector instructions for all eight. A block's integer dot is exact and
//! the blocks are added in one order whatever the number of activation rows in a pass, so
//! decode and prefill give a row the same numbers (the prefix cache relies on it).
//!
//! A group's block `b` is the file's eight blocks `b` of rows `8g..8g+8` regrouped, the same
//! bytes: the eight `d` (f16), the eight `m` (the min formats Q4_1, Q5_1), the eight fifth-bit
//! words (Q5_0, Q5_1), then the quants (Q8_0: each row's 32 bytes). The 4- and 5-bit formats
//! hold rows `l` and `l + 4` side by side (quants `[l | l + 4]` in 32 bytes, fifth-bit words in
//! 8): one 256-bit load and two masks give both rows' low sixteen values and their high
//! sixteen, each row in a lane, dotted against the activations' halves broadcast to both lanes,
//! and the lanes' sums land in row order after three horizontal adds (a third of the work of
//! widening each row's nibbles to a vector of its own). A pair's fifth bits are regrouped into
//! one 64-bit word in the order this level reads them (`Fifth`): at the AVX-512 level two byte
//! masks loaded straight into mask registers (one masked add per vector sets the fifth bits),
//! at AVX2 an order in which two variable shifts put every byte's bit in place (a byte shuffle
//! and compare per vector took twice the instructions: the most of the Q5_0 kernel's work).
//! Rows past the weight's last are zeros.

use super::act::Q8;
use super::Format;

/// Rows interleaved in a group.
pub const ROWS: usize = 8;

/// Offsets in a group's block: the `m`s, the fifth bits, the quants, and one row's quant bytes.
#[derive(Clone, Copy)]
struct Parts {
    m: usize,
    qh: usize,
    qs: usize,
    q_bytes: usize,
}

const fn parts(f: Format) -> Parts {
    let min = matches!(f, Format::Q4_1 | Format::Q5_1);
    let q5 = matches!(f, Format::Q5_0 | Format::Q5_1);
    let qh = 16 + if min { 16 } else { 0 };
    let qs = qh + if q5 { 32 } else { 0 };
    Parts { m: 16, qh, qs, q_bytes: if matches!(f, Format::Q8_0) { 32 } else { 16 } }
}

/// Offsets in the file's block (ggml's `block_*`): `m`, the fifth bits, the quants.
fn file_parts(f: Format) -> (Option<usize>, Option<usize>, usize) {
    match f {
        Format::Q4_1 => (Some(2), None, 4),
        Format::Q5_0 => (None, Some(2), 6),
        Format::Q5_1 => (Some(2), Some(4), 8),
        _ => (None, None, 2),
    }
}

/// Bytes of one group (eight rows of `k` values) of format `f`.
pub fn group_bytes(f: Format, k: usize) -> usize {
    ROWS * (k / 32) * f.bytes()
}

/// Bytes an `[n, k]` weight takes in this layout (the file's, with the last group padded).
pub fn bytes(f: Format, n: usize, k: usize) -> usize {
    n.div_ceil(ROWS) * group_bytes(f, k)
}

/// Where row `r`'s `bytes` go in a part held in pairs of rows `l`, `l + 4`.
fn pair_at(r: usize, bytes: usize) -> usize {
    2 * bytes * (r % 4) + bytes * (r / 4)
}

/// How a group holds a pair's fifth bits (Q5_0, Q5_1): the same 64 bits in either order.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Fifth {
    /// Two 32-bit byte masks, bit `i` of a word under byte `i` of its vector (the AVX-512
    /// level loads each into a mask register).
    Masks,
    /// For AVX2's 64-bit variable shifts: byte `i = 8j + b` of the low vector's bit at
    /// `8b + j`, of the high vector's at `8b + 4 + j`, so shifting the word left by `4 - j`
    /// in lane `j` (right by `j` for the high vector) puts every byte's own bit at its bit 4.
    Shifts,
}

/// Where this level's kernels read the fifth bits (`Fifth`).
fn fifth_order() -> Fifth {
    #[cfg(target_arch = "x86_64")]
    if super::vnni() {
        return Fifth::Masks;
    }
    Fifth::Shifts
}

/// Row `l + 4h`'s share of its pair's fifth-bit word in `order`, from the row's 32 bits as
/// the file holds them (bit `v` for value `v`; value `v` is byte `16h + v % 16` of the pair's
/// low vector when `v < 16`, of its high one otherwise).
fn fifth_word(order: Fifth, file: u32, h: usize) -> u64 {
    let file = u64::from(file);
    match order {
        Fifth::Masks => (file & 0xffff) << (16 * h) | (file >> 16) << (32 + 16 * h),
        // Value v = 8q + c (byte 8 · (2h + q % 2) + c of its vector) at bit 8c + 2h + q % 2,
        // plus 4 in the high vector: the file's bytes transposed into the word's.
        Fifth::Shifts => (0..4).fold(0, |w, q| w | SPREAD[(file >> (8 * q)) as u8 as usize] << (2 * h + q % 2 + 4 * (q / 2))),
    }
}

/// Bit `c` of a byte moved to bit `8c`.
const SPREAD: [u64; 256] = {
    let mut t = [0u64; 256];
    let mut x = 0;
    while x < 256 {
        let mut c = 0;
        while c < 8 {
            t[x] |= ((x as u64 >> c) & 1) << (8 * c);
            c += 1;
        }
        x += 1;
    }
    t
};

/// Group `g` of the file's rows (`nb` blocks each; rows `>= n` left as the zeros `out` holds)
/// written into `out` (`group_bytes`), with the fifth bits as this level reads them.
pub fn pack_group(f: Format, blocks: &[u8], n: usize, nb: usize, g: usize, out: &mut [u8]) {
    pack_group_as(f, fifth_order(), blocks, n, nb, g, out)
}

/// `pack_group` with the fifth bits in `order`.
fn pack_group_as(f: Format, order: Fifth, blocks: &[u8], n: usize, nb: usize, g: usize, out: &mut [u8]) {
    let (fb, p, (fm, fqh, fqs)) = (f.bytes(), parts(f), file_parts(f));
    let row_bytes = nb * fb;
    for r in 0..ROWS.min(n - g * ROWS) {
        let row = &blocks[(g * ROWS + r) * row_bytes..][..row_bytes];
        for (b, src) in row.chunks_exact(fb).enumerate() {
            let dst = &mut out[b * ROWS * fb..][..ROWS * fb];
            dst[2 * r..2 * r + 2].copy_from_slice(&src[0..2]);
            if let Some(at) = fm {
                dst[p.m + 2 * r..p.m + 2 * r + 2].copy_from_slice(&src[at..at + 2]);
            }
            // Rows l and l + 4 side by side but for Q8_0 (`pair_at`).
            let at = if f == Format::Q8_0 { 32 * r } else { pair_at(r, 16) };
            if let Some(src_at) = fqh {
                // Rows l and l + 4 share a word: row l's share first.
                let word = &mut dst[p.qh + 8 * (r % 4)..][..8];
                let held = if r < 4 { 0 } else { u64::from_le_bytes(word.try_into().unwrap()) };
                let file = u32::from_le_bytes(src[src_at..src_at + 4].try_into().unwrap());
                word.copy_from_slice(&(held | fifth_word(order, file, r / 4)).to_le_bytes());
            }
            dst[p.qs + at..][..p.q_bytes].copy_from_slice(&src[fqs..fqs + p.q_bytes]);
        }
    }
}

/// Group `g` (at `w`, `nb` blocks) against activation rows `r0..r0 + R`: `out[r · stride + l]`
/// for the group's rows `l < 8`. Needs AVX2, FMA and F16C.
#[cfg(target_arch = "x86_64")]
pub fn rows<const F: u8, const R: usize>(w: *const u8, nb: usize, a: &Q8, r0: usize, out: &mut [f32], stride: usize) {
    assert!(out.len() >= (R - 1) * stride + ROWS && a.q.len() >= (r0 + R) * nb * 32, "rows8::rows: slices shorter than the shapes");
    // SAFETY: the caller (`PackedBlocks::matmul`) checked avx2, fma and f16c; `w` holds `nb`
    // blocks of the group, and the activations and `out` are long enough (asserted above).
    unsafe {
        if F == Format::Q8_0 as u8 {
            avx2::rows_q8::<R>(w, nb, a, r0, out, stride)
        } else if super::vnni() && (F == Format::Q5_0 as u8 || F == Format::Q5_1 as u8) {
            avx2::rows_paired_masked::<F, R>(w, nb, a, r0, out, stride)
        } else if super::vnni() {
            avx2::rows_paired_vnni::<F, R>(w, nb, a, r0, out, stride)
        } else {
            avx2::rows_paired::<F, R>(w, nb, a, r0, out, stride)
        }
    }
}


#[cfg(target_arch = "x86_64")]
#[allow(clippy::needless_range_loop)] // `r` and `l` index several arrays at once
mod avx2 {
    use super::super::act::Q8;
    use super::super::simd::avx2::{nibbles, prefetch, reduce32};
    use super::super::Format;
    use super::{parts, ROWS};
    use std::arch::x86_64::*;

    /// Pair `k` (rows `k`, `k + 4`) of a 4/5-bit format's block at `blk`, unsigned (0..16,
    /// 0..32): values 0..16 of row `k` in the low lane and of row `k + 4` in the high one, then
    /// values 16..32 likewise.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn pair<const F: u8>(blk: *const u8, k: usize) -> (__m256i, __m256i) {
        let p = parts(Format::from_id(F));
        let (lo, hi) = nibbles(blk.add(p.qs + 32 * k));
        if F != Format::Q5_0 as u8 && F != Format::Q5_1 as u8 {
            return (lo, hi);
        }
        // The pair's word in `Fifth::Shifts` order in every 64-bit lane: lane j shifted left
        // by 4 - j (the low vector) or right by j (the high one) has each byte's own bit at
        // its bit 4, where 16 is added. Two shifts and two ANDs for 64 values: the byte
        // shuffle and compare spread this replaced took twice that, the most of the kernel's
        // work, which held Q5_0 at ~81 % of a 70 GB/s triad on a Zen 5 VM.
        let word = _mm256_set1_epi64x(blk.add(p.qh + 8 * k).cast::<i64>().read_unaligned());
        let sixteen = _mm256_set1_epi8(0x10);
        let low = _mm256_and_si256(_mm256_sllv_epi64(word, _mm256_setr_epi64x(4, 3, 2, 1)), sixteen);
        let high = _mm256_and_si256(_mm256_srlv_epi64(word, _mm256_setr_epi64x(0, 1, 2, 3)), sixteen);
        (_mm256_or_si256(lo, low), _mm256_or_si256(hi, high))
    }

    /// `pair` for Q5_0 and Q5_1 with each fifth-bit word as a byte mask: 16 added where set.
    #[inline]
    #[target_feature(enable = "avx2,avx512bw,avx512vl")]
    unsafe fn pair_masked<const F: u8>(blk: *const u8, k: usize) -> (__m256i, __m256i) {
        let (p, sixteen) = (parts(Format::from_id(F)), _mm256_set1_epi8(0x10));
        let (lo, hi) = nibbles(blk.add(p.qs + 32 * k));
        let words = blk.add(p.qh + 8 * k).cast::<u32>();
        let (kl, kh) = (words.read_unaligned(), words.add(1).read_unaligned());
        (_mm256_mask_add_epi8(lo, kl, lo, sixteen), _mm256_mask_add_epi8(hi, kh, hi, sixteen))
    }

    /// The 4/5-bit formats' eight row sums of one block against one activation row, rows
    /// 0-3 in the low half and 4-7 in the high one: `vpmaddubsw` pair sums of each row pair
    /// (a lane's pair sums: at most 2 · 31 · 127 each, 15 748 for the two halves, 31 496
    /// after one horizontal add: still an i16), reduced by horizontal adds.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn sums_maddubs(u: &[(__m256i, __m256i); ROWS / 2], xl: __m256i, xh: __m256i) -> __m256i {
        let ones = _mm256_set1_epi16(1);
        let p = u.map(|(lo, hi)| _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh)));
        let p01 = _mm256_madd_epi16(_mm256_hadd_epi16(p[0], p[1]), ones);
        let p23 = _mm256_madd_epi16(_mm256_hadd_epi16(p[2], p[3]), ones);
        _mm256_hadd_epi32(p01, p23)
    }

    /// `sums_maddubs` with `vpdpbusd`: each row pair's four-product sums in i32 at once.
    #[inline]
    #[target_feature(enable = "avx2,avx512vnni,avx512vl")]
    unsafe fn sums_dpbusd(u: &[(__m256i, __m256i); ROWS / 2], xl: __m256i, xh: __m256i) -> __m256i {
        let p = u.map(|(lo, hi)| _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(_mm256_setzero_si256(), lo, xl), hi, xh));
        _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]))
    }

    /// The 4/5-bit formats: pairs of rows per vector (the module's notes), one kernel per way
    /// of summing a block (`$sums`, with the target features `$features` it needs).
    macro_rules! rows_paired {
        ($name:ident, $features:literal, $sums:ident) => {
            rows_paired!($name, $features, $sums, pair);
        };
        ($name:ident, $features:literal, $sums:ident, $pair:ident) => {
            #[target_feature(enable = $features)]
            pub unsafe fn $name<const F: u8, const R: usize>(w: *const u8, nb: usize, a: &Q8, r0: usize, out: &mut [f32], stride: usize) {
                let f = Format::from_id(F);
                let min = matches!(f, Format::Q4_1 | Format::Q5_1);
                let offset = if f == Format::Q4_0 { -8.0 } else { -16.0 };
                let gb = ROWS * f.bytes();
                let (mut acc, mut corr) = ([_mm256_setzero_ps(); R], [_mm256_setzero_ps(); R]);
                for b in 0..nb {
                    let blk = w.add(b * gb);
                    prefetch(blk, gb);
                    let mut u = [(_mm256_setzero_si256(), _mm256_setzero_si256()); ROWS / 2];
                    for k in 0..ROWS / 2 {
                        u[k] = $pair::<F>(blk, k);
                    }
                    let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
                    let c = if min { _mm256_cvtph_ps(_mm_loadu_si128(blk.add(16) as *const __m128i)) } else { _mm256_mul_ps(d, _mm256_set1_ps(offset)) };
                    for r in 0..R {
                        let at = (r0 + r) * nb + b;
                        let x = a.q.as_ptr().add(at * 32);
                        let (xl, xh) = (_mm256_broadcastsi128_si256(_mm_loadu_si128(x as *const __m128i)), _mm256_broadcastsi128_si256(_mm_loadu_si128(x.add(16) as *const __m128i)));
                        // Lanes: rows 0-3 in the low half, 4-7 in the high one.
                        let sums = $sums(&u, xl, xh);
                        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_mul_ps(d, _mm256_set1_ps(*a.d.get_unchecked(at))), acc[r]);
                        // The min formats take `s` through f16, as ggml's `block_q8_1` holds it.
                        corr[r] = _mm256_fmadd_ps(c, _mm256_set1_ps(*a.s.get_unchecked(2 * at + min as usize)), corr[r]);
                    }
                }
                for r in 0..R {
                    _mm256_storeu_ps(out.as_mut_ptr().add(r * stride), _mm256_add_ps(acc[r], corr[r]));
                }
            }
        };
    }
    rows_paired!(rows_paired, "avx2,fma,f16c", sums_maddubs);
    rows_paired!(rows_paired_vnni, "avx2,fma,f16c,avx512vnni,avx512vl", sums_dpbusd);
    rows_paired!(rows_paired_masked, "avx2,fma,f16c,avx512vnni,avx512vl,avx512bw", sums_dpbusd, pair_masked);

    /// Q8_0: each row's signed bytes a vector, their signs moved onto the activations
    /// (`vpmaddubsw` takes unsigned × signed).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn rows_q8<const R: usize>(w: *const u8, nb: usize, a: &Q8, r0: usize, out: &mut [f32], stride: usize) {
        let (gb, qs) = (ROWS * Format::Q8_0.bytes(), parts(Format::Q8_0).qs);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let blk = w.add(b * gb);
            prefetch(blk, gb);
            // Decoded once for every activation row of the pass.
            let mut u = [_mm256_setzero_si256(); ROWS];
            for l in 0..ROWS {
                u[l] = _mm256_loadu_si256(blk.add(qs + 32 * l) as *const __m256i);
            }
            let au = u.map(|v| _mm256_sign_epi8(v, v));
            let d = _mm256_cvtph_ps(_mm_loadu_si128(blk as *const __m128i));
            for r in 0..R {
                let at = (r0 + r) * nb + b;
                let x = _mm256_loadu_si256(a.q.as_ptr().add(at * 32) as *const __m256i);
                let mut p = [_mm256_setzero_si256(); ROWS];
                for l in 0..ROWS {
                    p[l] = _mm256_madd_epi16(_mm256_maddubs_epi16(au[l], _mm256_sign_epi8(x, u[l])), ones);
                }
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(reduce32(&p)), _mm256_mul_ps(d, _mm256_set1_ps(*a.d.get_unchecked(at))), acc[r]);
            }
        }
        for r in 0..R {
            _mm256_storeu_ps(out.as_mut_ptr().add(r * stride), acc[r]);
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use candle_core::quantized::GgmlDType;

    /// `vpdpbusd`'s block sums give the bits of `vpmaddubsw` + `vpmaddwd`'s (both exact), and
    /// the fifth bits set by byte masks those of the AVX2 shifts, so a file gives the same
    /// numbers at either level: every 4/5-bit format, a group of seven rows (the eighth zero),
    /// three activation rows, eight blocks. (Both against candle: `every_format_matches_candle`.)
    #[test]
    fn vnni_sums_give_the_avx2_bits() -> candle_core::Result<()> {
        if !super::super::vnni() {
            eprintln!("no AVX-512 VNNI at this level: nothing to compare");
            return Ok(());
        }
        fn check<const F: u8>(dtype: GgmlDType) -> candle_core::Result<()> {
            let (f, m, k, n) = (Format::from_id(F), 3, 256, 7);
            let (x, blocks, _) = crate::cpu::testing::quantized_case(dtype, m, k, n)?;
            let (mut group, mut masks) = (vec![0u8; group_bytes(f, k)], vec![0u8; group_bytes(f, k)]);
            pack_group_as(f, Fifth::Shifts, &blocks, n, k / 32, 0, &mut group);
            pack_group_as(f, Fifth::Masks, &blocks, n, k / 32, 0, &mut masks);
            let a = Q8::quantize(&x, m, k);
            let (mut want, mut got) = ([0f32; 3 * ROWS], [0f32; 3 * ROWS]);
            // SAFETY: `vnni()` checked avx512vnni, avx512vl and avx512bw at the AVX-512 level
            // (avx2, fma and f16c with it); the group holds k / 32 blocks and the activations 3
            // rows.
            unsafe {
                avx2::rows_paired::<F, 3>(group.as_ptr(), k / 32, &a, 0, &mut want, ROWS);
                avx2::rows_paired_vnni::<F, 3>(group.as_ptr(), k / 32, &a, 0, &mut got, ROWS);
            }
            assert_eq!(got, want, "{f:?}");
            if matches!(f, Format::Q5_0 | Format::Q5_1) {
                // SAFETY: as above.
                unsafe { avx2::rows_paired_masked::<F, 3>(masks.as_ptr(), k / 32, &a, 0, &mut got, ROWS) };
                assert_eq!(got, want, "{f:?} with byte masks");
            }
            assert!(want.iter().any(|v| *v != 0.0), "{f:?}: a product of zeros proves nothing");
            Ok(())
        }
        check::<{ Format::Q4_0 as u8 }>(GgmlDType::Q4_0)?;
        check::<{ Format::Q4_1 as u8 }>(GgmlDType::Q4_1)?;
        check::<{ Format::Q5_0 as u8 }>(GgmlDType::Q5_0)?;
        check::<{ Format::Q5_1 as u8 }>(GgmlDType::Q5_1)
    }
}
