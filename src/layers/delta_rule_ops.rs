//! The gated delta rule as tensor operations, for the device path: the same two forms as
//! `delta_rule` (recurrent for one-token runs, chunked for prefill chunks), on tensors that
//! stay where they are (a GPU's memory; the CPU when `MERG_CPU_KERNELS=generic` runs this
//! path there). Equal to the host forms within 1e-5 (tests below).
//!
//! Shapes are head-major: q, k `[Hv, T, dk]` (already expanded from the key heads), v
//! `[Hv, T, dv]`, g, β `[Hv, T]`, state `[Hv, dk, dv]`, all f32.
//!
//! Inside a chunk the delta-rule updates form a unit-lower-triangular system (I + L)X = B;
//! transformers solves it row by row (63 dependent steps). Here its inverse is built by
//! halving: for M = [[A, 0], [B, D]], M⁻¹ = [[A⁻¹, 0], [−D⁻¹BA⁻¹, D⁻¹]], six levels for 64
//! rows, every level one batched product over all heads and chunks.

use candle_core::{Device, Result, Tensor, D};

use super::delta_rule::CHUNK;

/// L2-normalises the last dimension (eps 1e-6 inside the root, as the host form) and scales.
pub fn l2norm(x: &Tensor, scale: f64) -> Result<Tensor> {
    let inv = (x.sqr()?.sum_keepdim(D::Minus1)? + 1e-6)?.sqrt()?.recip()?;
    x.broadcast_mul(&inv)? * scale
}

/// One token: `q, k [Hv, 1, dk]`, `v [Hv, 1, dv]`, `g, beta [Hv, 1]`. Returns `[Hv, 1, dv]`.
pub fn recurrent(q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, state: &mut Tensor) -> Result<Tensor> {
    let s = state.broadcast_mul(&g.exp()?.unsqueeze(2)?)?;
    // u = β (v − Sᵀk); S ← S + k uᵀ; o = Sᵀq.
    let u = (v - k.matmul(&s)?)?.broadcast_mul(&beta.unsqueeze(2)?)?;
    let s = (s + k.transpose(1, 2)?.matmul(&u)?)?;
    let out = q.matmul(&s)?;
    *state = s;
    Ok(out)
}

/// Inverse of the unit-lower-triangular `I + l` for strictly lower `l [B, n, n]`, n a power of 2.
fn unit_lower_inverse(l: &Tensor) -> Result<Tensor> {
    let (b, n, _) = l.dims3()?;
    if n == 1 {
        return Tensor::ones((b, 1, 1), l.dtype(), l.device());
    }
    let h = n / 2;
    // Both diagonal blocks in one recursion (stacked on the batch dimension).
    let diag = Tensor::cat(&[l.narrow(1, 0, h)?.narrow(2, 0, h)?, l.narrow(1, h, h)?.narrow(2, h, h)?], 0)?;
    let inv = unit_lower_inverse(&diag.contiguous()?)?;
    let (ai, di) = (inv.narrow(0, 0, b)?, inv.narrow(0, b, b)?);
    let lower = l.narrow(1, h, h)?.narrow(2, 0, h)?.contiguous()?;
    let x = di.matmul(&lower)?.matmul(&ai)?.neg()?;
    let zeros = Tensor::zeros((b, h, h), l.dtype(), l.device())?;
    Tensor::cat(&[Tensor::cat(&[ai, zeros], 2)?, Tensor::cat(&[x, di], 2)?], 1)
}

/// `[n, n]` f32 mask: 1 where `j ≤ i` (`diagonal`) or `j < i`.
fn tril(n: usize, diagonal: bool, dev: &Device) -> Result<Tensor> {
    let m: Vec<f32> = (0..n * n).map(|x| ((x % n < x / n) || (diagonal && x % n == x / n)) as u8 as f32).collect();
    Tensor::from_vec(m, (n, n), dev)
}

/// Zero rows appended along dimension 1 up to `len`.
fn pad_tokens(x: &Tensor, len: usize) -> Result<Tensor> {
    let t = x.dim(1)?;
    if t == len {
        return Ok(x.clone());
    }
    let mut shape = x.dims().to_vec();
    shape[1] = len - t;
    Tensor::cat(&[x, &Tensor::zeros(shape, x.dtype(), x.device())?], 1)
}

/// A prefill chunk of `T` tokens in `CHUNK`-token chunks (transformers'
/// `torch_chunk_gated_delta_rule`). Same shapes as `recurrent`, T tokens; returns `[Hv, T, dv]`.
pub fn chunked(q: &Tensor, k: &Tensor, v: &Tensor, g: &Tensor, beta: &Tensor, state: &mut Tensor) -> Result<Tensor> {
    let (hv, t, dk) = k.dims3()?;
    let dv = v.dim(2)?;
    let (c, dev) = (CHUNK, q.device());
    let n = t.div_ceil(c);
    // Padding tokens carry k = v = β = g = 0: they change neither the outputs nor the state.
    let chunks = |x: &Tensor, w: usize| -> Result<Tensor> { pad_tokens(x, n * c)?.reshape((hv * n, c, w)) };
    let (q, k, v) = (chunks(q, dk)?, chunks(k, dk)?, chunks(v, dv)?);
    let beta = pad_tokens(beta, n * c)?.reshape((hv * n, c, 1))?;
    let gc = pad_tokens(g, n * c)?.reshape((hv * n, c))?.cumsum(1)?;
    // decay[i][j] = exp(gc_i − gc_j) for j ≤ i, else 0 (masked before exp: no overflow).
    let lower = tril(c, true, dev)?;
    let diff = gc.unsqueeze(2)?.broadcast_sub(&gc.unsqueeze(1)?)?.broadcast_mul(&lower)?;
    let decay = diff.exp()?.broadcast_mul(&lower)?;
    let k_beta = k.broadcast_mul(&beta)?;
    let l = k_beta.matmul(&k.transpose(1, 2)?)?.mul(&decay)?.broadcast_mul(&tril(c, false, dev)?)?;
    let inv = unit_lower_inverse(&l)?;
    let value = inv.matmul(&v.broadcast_mul(&beta)?)?;
    let k_cumdecay = inv.matmul(&k_beta.broadcast_mul(&gc.exp()?.unsqueeze(2)?)?)?;
    let intra = q.matmul(&k.transpose(1, 2)?)?.mul(&decay)?;
    let q_decayed = q.broadcast_mul(&gc.exp()?.unsqueeze(2)?)?;
    let last = gc.narrow(1, c - 1, 1)?;
    let k_to_end = k.broadcast_mul(&last.broadcast_sub(&gc)?.exp()?.unsqueeze(2)?)?;
    let per_head = |x: Tensor, w: usize| x.reshape((hv, n, c, w));
    let (value, k_cumdecay, intra) = (per_head(value, dv)?, per_head(k_cumdecay, dk)?, per_head(intra, c)?);
    let (q_decayed, k_to_end, last) = (per_head(q_decayed, dk)?, per_head(k_to_end, dk)?, last.reshape((hv, n, 1, 1))?);
    let mut s = state.clone();
    let mut outs = Vec::with_capacity(n);
    for i in 0..n {
        let at = |x: &Tensor| x.narrow(1, i, 1)?.squeeze(1);
        // The part of each token's value the old state does not already predict.
        let v_new = (at(&value)? - at(&k_cumdecay)?.matmul(&s)?)?;
        outs.push((at(&q_decayed)?.matmul(&s)? + at(&intra)?.matmul(&v_new)?)?);
        s = (s.broadcast_mul(&at(&last)?.exp()?)? + at(&k_to_end)?.transpose(1, 2)?.contiguous()?.matmul(&v_new)?)?;
    }
    *state = s;
    Tensor::cat(&outs, 1)?.narrow(1, 0, t)
}

/// Host-layout inputs (`[T, H, d]`, token-major, f32 slices) as head-major tensors on `dev`,
/// q and k normalised, q scaled, and expanded from `k_heads` to `v_heads` — what the device
/// path feeds `recurrent` and `chunked`; tests use it to run both forms on the same data.
pub fn head_major(x: &Tensor, heads_to: usize) -> Result<Tensor> {
    let (t, h, d) = x.dims3()?;
    let x = x.transpose(0, 1)?;
    if h == heads_to {
        return x.contiguous();
    }
    x.unsqueeze(1)?.broadcast_as((h, heads_to / h, t, d))?.reshape((heads_to, t, d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;
    use crate::layers::delta_rule::{self as host, Dims, Inputs};

    fn random(n: usize, seed: u64) -> Vec<f32> {
        crate::testing::randn(seed, n, 1.0).unwrap().to_vec1().unwrap()
    }

    fn tensor(x: &[f32], shape: &[usize], dev: &Device) -> Result<Tensor> {
        Tensor::from_slice(x, shape, dev)
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max)
    }

    /// Prefill in uneven pieces (the chunked form on pieces of 70, 33 and 40 tokens, the
    /// recurrent one on single tokens) gives the host forms' outputs and states within 1e-5.
    #[test]
    fn tensor_forms_equal_the_host_forms() -> Result<()> {
        let d = Dims { k_heads: 2, v_heads: 4, dk: 16, dv: 8 };
        let t = 150;
        let (q, k, v) = (random(t * 2 * 16, 1), random(t * 2 * 16, 2), random(t * 4 * 8, 3));
        let g: Vec<f32> = random(t * 4, 4).iter().map(|x| -0.3 * x.abs()).collect();
        let beta: Vec<f32> = random(t * 4, 5).iter().map(|x| 1.0 / (1.0 + (-x).exp())).collect();
        let dev = Device::Cpu;
        let (mut s_host, mut s_dev) = (vec![0f32; d.state_len()], Tensor::zeros((4, 16, 8), DType::F32, &dev)?);
        let (mut want, mut got) = (vec![], vec![]);
        let mut start = 0;
        for len in [70, 1, 33, 40, 1, 1, 4] {
            let sl = |x: &[f32], w: usize| x[start * w..(start + len) * w].to_vec();
            let (qs, ks, vs, gs, bs) = (sl(&q, 32), sl(&k, 32), sl(&v, 32), sl(&g, 4), sl(&beta, 4));
            let x = Inputs { q: &qs, k: &ks, v: &vs, g: &gs, beta: &bs };
            want.extend(if len == 1 { host::recurrent(&x, d, &mut s_host) } else { host::chunked(&x, d, &mut s_host) });
            let qt = l2norm(&head_major(&tensor(&qs, &[len, 2, 16], &dev)?, 4)?, 0.25)?;
            let kt = l2norm(&head_major(&tensor(&ks, &[len, 2, 16], &dev)?, 4)?, 1.0)?;
            let vt = head_major(&tensor(&vs, &[len, 4, 8], &dev)?, 4)?;
            let (gt, bt) = (tensor(&gs, &[len, 4], &dev)?.t()?.contiguous()?, tensor(&bs, &[len, 4], &dev)?.t()?.contiguous()?);
            let o = if len == 1 { recurrent(&qt, &kt, &vt, &gt, &bt, &mut s_dev)? } else { chunked(&qt, &kt, &vt, &gt, &bt, &mut s_dev)? };
            got.extend(o.transpose(0, 1)?.flatten_all()?.to_vec1::<f32>()?);
            start += len;
        }
        let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
        assert!(max_diff(&want, &got) / scale < 1e-5, "outputs: {}", max_diff(&want, &got) / scale);
        assert!(max_diff(&s_host, &s_dev.flatten_all()?.to_vec1()?) < 1e-5);
        Ok(())
    }

    #[test]
    fn unit_lower_inverse_inverts() -> Result<()> {
        let n = 8;
        let l = crate::testing::randn(9, (3, n, n), 0.5)?.broadcast_mul(&tril(n, false, &Device::Cpu)?)?;
        let eye = Tensor::eye(n, DType::F32, &Device::Cpu)?;
        let prod = l.broadcast_add(&eye)?.matmul(&unit_lower_inverse(&l)?)?;
        let err = prod.broadcast_sub(&eye)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(err < 1e-5, "{err}");
        Ok(())
    }
}
