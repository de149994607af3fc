//! Decode attention on the CPU that reads K/V where they lie: each query token attends over
//! the rows `slots` of a `[positions, kv_heads·d]` K and V store (the engine's paged pool, or
//! a dense cache's tensors), with no gathered copy per sequence per layer. One query token per
//! sequence (a decode step of many sequences at once); each run of a sequence's keys is a team
//! task over every head, merged as flash-decoding does. Scores, softmax and sums are f32
//! whatever the store's type, as transformers upcasts attention weights.

use candle_core::{DType, Result, Tensor};
use half::bf16;

mod group;

/// Where one sequence's query reads: the store rows of its positions, oldest first.
pub struct Query<'a> {
    pub slots: &'a [u32],
}

/// A K or V row as f32: an f32 store's row itself, a bf16 one's widened into `scratch`.
trait Value: Copy + Send + Sync {
    /// Stored as bf16 (else f32).
    const BF16: bool;
    fn row<'a>(row: &'a [Self], scratch: &'a mut [f32]) -> &'a [f32];
}
impl Value for f32 {
    const BF16: bool = false;
    fn row<'a>(row: &'a [f32], _: &'a mut [f32]) -> &'a [f32] {
        row
    }
}
impl Value for bf16 {
    const BF16: bool = true;
    fn row<'a>(row: &'a [bf16], scratch: &'a mut [f32]) -> &'a [f32] {
        for (o, x) in scratch.iter_mut().zip(row) {
            *o = x.to_f32();
        }
        scratch
    }
}

/// `q: [R, heads, d]` (one token of each of `queries`' R sequences) over K/V stores `k, v:
/// [rows, kv_heads·d]` of one dtype (f32 or bf16) → `[R, heads·d]` in `q`'s dtype. `None`:
/// not on the CPU or not a supported dtype (callers gather instead).
pub fn decode(q: &Tensor, k: &Tensor, v: &Tensor, kv_heads: usize, queries: &[Query], scale: f32) -> Result<Option<Tensor>> {
    let (r, heads, d) = q.dims3()?;
    if !q.device().is_cpu() || k.dtype() != v.dtype() || !k.is_contiguous() || !v.is_contiguous() || r != queries.len() || heads % kv_heads != 0 {
        return Ok(None);
    }
    super::note_kernel_run();
    let qs: Vec<f32> = q.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
    let mut out = vec![0f32; r * heads * d];
    let (ks, ko) = k.storage_and_layout();
    let (vs, vo) = v.storage_and_layout();
    let (candle_core::Storage::Cpu(kc), candle_core::Storage::Cpu(vc)) = (&*ks, &*vs) else { return Ok(None) };
    let (k0, v0) = (ko.start_offset(), vo.start_offset());
    let shape = Shape { heads, kv_heads, d };
    // As many runs as the team has threads for every sequence, however many share the step:
    // splitting by the step's sequences gave a sequence other bits when it decoded alone than
    // beside others (the merge adds in another order), so its logits depended on which
    // sequences the scheduler put in its step (an eval resumed after a kill batches
    // differently from one run straight through).
    let per_seq = rayon::current_num_threads();
    match k.dtype() {
        DType::F32 => shape.run(&qs, &kc.as_slice::<f32>()?[k0..], &vc.as_slice::<f32>()?[v0..], queries, scale, per_seq, &mut out)?,
        DType::BF16 => shape.run(&qs, &kc.as_slice::<bf16>()?[k0..], &vc.as_slice::<bf16>()?[v0..], queries, scale, per_seq, &mut out)?,
        _ => return Ok(None),
    }
    Ok(Some(Tensor::from_vec(out, (r, heads * d), q.device())?.to_dtype(q.dtype())?))
}

#[derive(Clone, Copy)]
struct Shape {
    heads: usize,
    kv_heads: usize,
    d: usize,
}

/// Keys a task takes at least: shorter runs cost more in merging than they save. At 32, one
/// 0.5B-shape layer's decode over 64-128 keys (two runs on a team of two) took 6.0 µs against
/// 7.5 at 64 (one run, the other core idle) on a Zen 5 VM.
const MIN_KEYS: usize = 32;

impl Shape {
    /// Each sequence's keys split into runs, one task each (enough runs for the team when few
    /// sequences decode: one sequence of 2 kv heads kept one core of two busy per head before,
    /// and reading half of every K/V row is a strided stream the prefetchers serve worse than
    /// whole rows in order: 12.3 against 8.6 µs for 200 keys of a 0.5B shape just evicted).
    /// A run's softmax is partial (its max and sum per head, its unnormalised sums of
    /// values); the runs of a sequence are merged as flash-decoding does.
    /// `per_seq`: the runs a sequence is split into at most (the team's threads, whatever
    /// the number of sequences, so a sequence's bits do not depend on its step's others).
    #[allow(clippy::too_many_arguments)]
    fn run<T: Value>(self, q: &[f32], k: &[T], v: &[T], queries: &[Query], scale: f32, per_seq: usize, out: &mut [f32]) -> Result<()> {
        let (d, width, heads) = (self.d, self.kv_heads * self.d, self.heads);
        let rows = k.len().min(v.len()) / width;
        if let Some(bad) = queries.iter().flat_map(|qr| qr.slots).find(|&&s| s as usize >= rows) {
            candle_core::bail!("attention: slot {bad} is outside the K/V store of {rows} rows");
        }
        let runs: Vec<(usize, &[u32])> = queries
            .iter()
            .enumerate()
            .flat_map(|(i, qr)| {
                let parts = per_seq.min(qr.slots.len() / MIN_KEYS).max(1);
                let len = qr.slots.len().div_ceil(parts).max(1);
                qr.slots.chunks(len).map(move |c| (i, c))
            })
            .collect();
        // Per run: every head's d unnormalised sums, then its max and its sum of weights.
        let stride = heads * (d + 2);
        let mut parts = vec![0f32; runs.len() * stride];
        let r = group::Rows { width, d, kv_heads: self.kv_heads };
        super::team::chunks_mut(&mut parts, stride, |i, part| {
            let (seq, slots) = runs[i];
            let (o, stats) = part.split_at_mut(heads * d);
            self.partial(&q[seq * heads * d..(seq + 1) * heads * d], k, v, r, slots, scale, o, stats);
        });
        let mut at = 0;
        for (seq, o) in out.chunks_exact_mut(heads * d).enumerate() {
            let n = runs[at..].iter().take_while(|(s, _)| *s == seq).count();
            merge(&parts[at * stride..(at + n) * stride], heads, d, o);
            at += n;
        }
        Ok(())
    }

    /// One run's scores, softmax statistics (`stats`: each head's max, then each head's sum
    /// of weights) and unnormalised sums of values (`o`, `[heads, d]`).
    #[allow(clippy::too_many_arguments)]
    fn partial<T: Value>(self, q: &[f32], k: &[T], v: &[T], r: group::Rows, slots: &[u32], scale: f32, o: &mut [f32], stats: &mut [f32]) {
        let (d, n, group) = (self.d, slots.len(), self.heads / self.kv_heads);
        let mut p = vec![0f32; self.heads * n];
        if !group::scores(q, k, v, r, slots, scale, &mut p) {
            let mut kr = vec![0f32; d];
            for (j, &s) in slots.iter().enumerate() {
                for kv in 0..self.kv_heads {
                    let kr = T::row(&k[s as usize * r.width + kv * d..][..d], &mut kr);
                    for h in kv * group..(kv + 1) * group {
                        p[h * n + j] = dot(&q[h * d..(h + 1) * d], kr) * scale;
                    }
                }
            }
        }
        let (max, sum) = stats.split_at_mut(self.heads);
        max.fill(f32::NEG_INFINITY);
        sum.fill(0.0);
        for (h, ph) in p.chunks_exact_mut(n.max(1)).enumerate().take(self.heads) {
            max[h] = ph.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            sum[h] = super::elementwise::exp_sub_sum(ph, max[h]);
        }
        if !group::values(&p, v, r, slots, o) {
            o.fill(0.0);
            let mut vr = vec![0f32; d];
            for (j, &s) in slots.iter().enumerate() {
                for kv in 0..self.kv_heads {
                    let vr = T::row(&v[s as usize * r.width + kv * d..][..d], &mut vr);
                    for h in kv * group..(kv + 1) * group {
                        axpy(p[h * n + j], vr, &mut o[h * d..(h + 1) * d]);
                    }
                }
            }
        }
    }
}

/// A sequence's output from its runs' partials (`Shape::run`): each run's sums scaled by
/// `e^(max − overall max)`, over the weights' sum scaled the same. No keys at all gives zeros.
fn merge(parts: &[f32], heads: usize, d: usize, out: &mut [f32]) {
    let stride = heads * (d + 2);
    let stat = |r: usize, i: usize| parts[r * stride + heads * d + i];
    let runs = parts.len() / stride;
    for h in 0..heads {
        let m = (0..runs).map(|r| stat(r, h)).fold(f32::NEG_INFINITY, f32::max);
        let o = &mut out[h * d..(h + 1) * d];
        o.fill(0.0);
        if m == f32::NEG_INFINITY {
            continue;
        }
        let mut total = 0.0;
        for r in 0..runs {
            let w = (stat(r, h) - m).exp();
            total += w * stat(r, heads + h);
            for (x, y) in o.iter_mut().zip(&parts[r * stride + h * d..r * stride + (h + 1) * d]) {
                *x += w * y;
            }
        }
        o.iter_mut().for_each(|x| *x /= total);
    }
}

/// `Σ a·b` with fused multiply-adds where the level has them, eight or sixteen partial sums.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if super::level() >= super::Level::Avx2 {
        // SAFETY: Level::Avx2 or above is only chosen when avx2 and fma are detected.
        return unsafe { fma::dot(a, b) };
    }
    let mut acc = [0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for l in 0..8 {
            acc[l] += x[l] * y[l];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// `o += w · v`.
fn axpy(w: f32, v: &[f32], o: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if super::level() >= super::Level::Avx2 {
        // SAFETY: as `dot`.
        return unsafe { fma::axpy(w, v, o) };
    }
    for (a, b) in o.iter_mut().zip(v) {
        *a += w * b;
    }
}

#[cfg(target_arch = "x86_64")]
mod fma {
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        while i + 16 <= n {
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i)), _mm256_loadu_ps(b.as_ptr().add(i)), s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a.as_ptr().add(i + 8)), _mm256_loadu_ps(b.as_ptr().add(i + 8)), s1);
            i += 16;
        }
        let mut lanes = [0f32; 8];
        _mm256_storeu_ps(lanes.as_mut_ptr(), _mm256_add_ps(s0, s1));
        lanes.iter().sum::<f32>() + (i..n).map(|j| a[j] * b[j]).sum::<f32>()
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn axpy(w: f32, v: &[f32], o: &mut [f32]) {
        let n = v.len().min(o.len());
        let wv = _mm256_set1_ps(w);
        let mut i = 0;
        while i + 8 <= n {
            let p = o.as_mut_ptr().add(i);
            _mm256_storeu_ps(p, _mm256_fmadd_ps(wv, _mm256_loadu_ps(v.as_ptr().add(i)), _mm256_loadu_ps(p)));
            i += 8;
        }
        for j in i..n {
            o[j] += w * v[j];
        }
    }
}

/// A prefill's attention weights in one pass: row `r` of `x` (`cols` scores) becomes
/// `softmax(x[r] · scale + mask[r mod mask_rows])` in f32, the mask additive (0 or −∞), `out`
/// taking the rows in `x`'s type. Each row's softmax is candle's (`softmax_last_dim`: the
/// max, `exp` of the differences, their sum, each divided by it) with the vector `exp` of
/// `elementwise::exp_sub_sum` (within 4 ulp of libm's); for bf16 the scaled score is
/// rounded to bf16 first, with the scale itself in bf16, as a bf16 model's `scores · scale`
/// does. This replaces four passes over the `[heads, queries, keys]` scores (scale, mask add,
/// and softmax's widening and narrowing), each with its own allocation.
pub fn masked_softmax<T: Score>(x: &[T], cols: usize, scale: f64, mask: &[f32], out: &mut [T]) {
    let mask_rows = mask.len() / cols.max(1);
    assert!(cols > 0 && mask_rows > 0 && x.len() == out.len() && x.len().is_multiple_of(cols), "masked_softmax: rows of {cols} scores and of mask");
    let scale = T::scale(scale);
    // About 64 KiB of scores per task.
    let rows_per_task = (16384 / cols).max(1);
    super::team::chunks_mut(out, rows_per_task * cols, |c, o| {
        let mut p = vec![0f32; cols];
        for (i, row) in o.chunks_exact_mut(cols).enumerate() {
            let r = c * rows_per_task + i;
            let (xr, mr) = (&x[r * cols..][..cols], &mask[(r % mask_rows) * cols..][..cols]);
            for ((p, &v), &m) in p.iter_mut().zip(xr).zip(mr) {
                *p = T::scaled(v, scale) + m;
            }
            let max = row_max(&p);
            if max == f32::NEG_INFINITY {
                // No key visible: NaN, as candle's softmax gives (e^(−∞ − −∞)).
                row.fill(T::from(f32::NAN));
                continue;
            }
            let sum = super::elementwise::exp_sub_sum(&mut p, max);
            for (o, p) in row.iter_mut().zip(&p) {
                *o = T::from(p / sum);
            }
        }
    });
}

/// The largest of `p` (−∞ for none), eight lanes at a time so the compiler vectorises.
fn row_max(p: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = p.chunks_exact(8);
    let tail = chunks.remainder().iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    for c in chunks {
        for (l, &v) in lanes.iter_mut().zip(c) {
            *l = if v > *l { v } else { *l };
        }
    }
    lanes.iter().fold(tail, |a, &b| a.max(b))
}

/// An attention score type: f32, or bf16 as a bf16 model's ops round it.
pub trait Score: Copy + Send + Sync {
    /// The scale as this type holds it (candle's affine takes it in the tensor's dtype).
    fn scale(s: f64) -> f32;
    /// `v · scale` as the tensor op would store it, widened to f32.
    fn scaled(v: Self, scale: f32) -> f32;
    fn from(v: f32) -> Self;
}
impl Score for f32 {
    fn scale(s: f64) -> f32 {
        s as f32
    }
    fn scaled(v: f32, scale: f32) -> f32 {
        v * scale
    }
    fn from(v: f32) -> f32 {
        v
    }
}
impl Score for bf16 {
    fn scale(s: f64) -> f32 {
        bf16::from_f64(s).to_f32()
    }
    fn scaled(v: bf16, scale: f32) -> f32 {
        bf16::from_f32(v.to_f32() * scale).to_f32()
    }
    fn from(v: f32) -> bf16 {
        bf16::from_f32(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// Against the gathered reference (`causal_gqa`) with slots scattered over the store, two
    /// sequences of different lengths, grouped heads, f32 and bf16 stores; groups of 3 and 11
    /// heads (a tile of eight and a rest in `group`), head dims of 16 and 24 (whole eight-lane
    /// chunks) and 12 (the scalar loop at every level).
    #[test]
    fn equals_gathered_attention() -> Result<()> {
        let dev = Device::Cpu;
        let rows = 40;
        let slots: [Vec<u32>; 2] = [vec![3, 17, 5, 30, 8], (10..33).rev().collect()];
        for (heads, kvh, d) in [(6, 2, 16), (22, 2, 24), (3, 1, 12)] {
            let k = crate::testing::randn(115, (rows, kvh * d), 1.)?;
            let v = crate::testing::randn(116, (rows, kvh * d), 1.)?;
            let q = crate::testing::randn(117, (2, heads, d), 1.)?;
            for dtype in [DType::F32, DType::BF16] {
                let (k, v) = (k.to_dtype(dtype)?, v.to_dtype(dtype)?);
                let queries: Vec<Query> = slots.iter().map(|s| Query { slots: s }).collect();
                let got = decode(&q, &k, &v, kvh, &queries, 0.25)?.expect("cpu");
                for (i, s) in slots.iter().enumerate() {
                    let idx = Tensor::new(s.as_slice(), &dev)?;
                    let kc = k.index_select(&idx, 0)?.to_dtype(DType::F32)?.reshape((s.len(), kvh, d))?;
                    let vc = v.index_select(&idx, 0)?.to_dtype(DType::F32)?.reshape((s.len(), kvh, d))?;
                    let want = crate::layers::causal_gqa(&q.narrow(0, i, 1)?, &kc, &vc, 0.25)?;
                    let diff = (got.narrow(0, i, 1)? - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(diff < 1e-5, "{dtype:?} {heads}/{kvh} heads of {d}, sequence {i}: {diff}");
                }
            }
        }
        // One sequence's 300 keys in 1, 3, 5 and 9 runs (12 asked for: runs keep 32 keys at
        // least) merged: the same output as the reference.
        let (heads, kvh, d, rows) = (4, 2, 16, 320);
        let k = crate::testing::randn(118, (rows, kvh * d), 1.)?;
        let v = crate::testing::randn(119, (rows, kvh * d), 1.)?;
        let q = crate::testing::randn(120, (1, heads, d), 1.)?;
        let slots: Vec<u32> = (0..300).map(|i| (i * 7 % rows) as u32).collect();
        let idx = Tensor::new(slots.as_slice(), &dev)?;
        let (kc, vc) = (k.index_select(&idx, 0)?.reshape((300, kvh, d))?, v.index_select(&idx, 0)?.reshape((300, kvh, d))?);
        let want: Vec<f32> = crate::layers::causal_gqa(&q, &kc, &vc, 0.25)?.flatten_all()?.to_vec1()?;
        let (qs, ks, vs): (Vec<f32>, Vec<f32>, Vec<f32>) = (q.flatten_all()?.to_vec1()?, k.flatten_all()?.to_vec1()?, v.flatten_all()?.to_vec1()?);
        for per_seq in [1, 3, 5, 12] {
            let mut got = vec![0f32; heads * d];
            Shape { heads, kv_heads: kvh, d }.run(&qs, &ks, &vs, &[Query { slots: &slots }], 0.25, per_seq, &mut got)?;
            let diff = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(diff < 1e-5, "{per_seq} runs: {diff}");
        }
        // Batch-invariant: the sequence decoded beside another gives the bits it gets alone
        // (the team splits it into the same runs either way).
        let alone = decode(&q, &k, &v, kvh, &[Query { slots: &slots[..100] }], 0.25)?.expect("cpu").flatten_all()?.to_vec1::<f32>()?;
        let other: Vec<u32> = (0..90).collect();
        let q2 = Tensor::cat(&[&q, &q], 0)?;
        let both = decode(&q2, &k, &v, kvh, &[Query { slots: &slots[..100] }, Query { slots: &other }], 0.25)?.expect("cpu").flatten_all()?.to_vec1::<f32>()?;
        assert_eq!(alone, both[..heads * d], "a sequence's attention depends on the others in its step");
        let mut none = vec![1f32; heads * d];
        Shape { heads, kv_heads: kvh, d }.run(&qs, &ks, &vs, &[Query { slots: &[] }], 0.25, 2, &mut none)?;
        assert!(none.iter().all(|&x| x == 0.0), "no keys: zeros");
        let rows = 40;
        let (k, v, q) = (crate::testing::randn(115, (rows, 32), 1.)?, crate::testing::randn(116, (rows, 32), 1.)?, crate::testing::randn(117, (2, 6, 16), 1.)?);
        let kvh = 2;
        let bad = [Query { slots: &[41] }, Query { slots: &[0] }];
        assert!(decode(&q, &k, &v, kvh, &bad, 0.25).unwrap_err().to_string().contains("slot 41 is outside"));
        Ok(())
    }
}
