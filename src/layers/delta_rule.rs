//! The gated delta rule of Gated DeltaNet on host f32 slices, in the two forms transformers
//! has: recurrent (one token at a time, for decode) and chunked (64-token chunks solved with
//! a unit-lower-triangular system, for prefill). Both read and write the same state, so a
//! sequence may be prefilled in any chunks and then decoded; `chunked_equals_recurrent` holds
//! them to 1e-5.
//!
//! Per value head h (key head `h / (Hv / Hk)`), with q and k L2-normalised and q scaled by
//! 1/√dk, state S `[dk, dv]`:  S ← S·exp(g);  u = β(v − Sᵀk);  S ← S + k uᵀ;  o = Sᵀq.

/// Head counts and widths of one layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Dims {
    pub k_heads: usize,
    pub v_heads: usize,
    pub dk: usize,
    pub dv: usize,
}

impl Dims {
    pub fn state_len(&self) -> usize {
        self.v_heads * self.dk * self.dv
    }
}

/// Token-major inputs of one sequence: q, k `[T, Hk, dk]`, v `[T, Hv, dv]`, g, β `[T, Hv]`.
pub struct Inputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub g: &'a [f32],
    pub beta: &'a [f32],
}

pub const CHUNK: usize = 64;

/// L2-normalises every `d`-wide row (eps 1e-6 inside the root, as the FLA kernels) and scales.
fn l2norm_rows(x: &[f32], d: usize, scale: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks(d) {
        let inv = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() + 1e-6).sqrt();
        out.extend(row.iter().map(|v| v * inv * scale));
    }
    out
}

/// Normalised (q, k) of all tokens.
fn prepare(x: &Inputs, d: Dims) -> (Vec<f32>, Vec<f32>) {
    (l2norm_rows(x.q, d.dk, 1.0 / (d.dk as f32).sqrt()), l2norm_rows(x.k, d.dk, 1.0))
}

/// Token by token. Returns the output `[T, Hv, dv]`; `state` `[Hv, dk, dv]` is updated.
pub fn recurrent(x: &Inputs, d: Dims, state: &mut [f32]) -> Vec<f32> {
    let t = x.g.len() / d.v_heads;
    let (q, k) = prepare(x, d);
    let rep = d.v_heads / d.k_heads;
    let mut out = vec![0f32; t * d.v_heads * d.dv];
    let mut u = vec![0f32; d.dv];
    for i in 0..t {
        for h in 0..d.v_heads {
            let kh = h / rep;
            let qv = &q[(i * d.k_heads + kh) * d.dk..][..d.dk];
            let kv = &k[(i * d.k_heads + kh) * d.dk..][..d.dk];
            let vv = &x.v[(i * d.v_heads + h) * d.dv..][..d.dv];
            let (decay, beta) = (x.g[i * d.v_heads + h].exp(), x.beta[i * d.v_heads + h]);
            let s = &mut state[h * d.dk * d.dv..][..d.dk * d.dv];
            s.iter_mut().for_each(|e| *e *= decay);
            // u = β (v − Sᵀk)
            u.copy_from_slice(vv);
            for (a, row) in s.chunks(d.dv).enumerate() {
                for (uj, sj) in u.iter_mut().zip(row) {
                    *uj -= kv[a] * sj;
                }
            }
            u.iter_mut().for_each(|e| *e *= beta);
            let o = &mut out[(i * d.v_heads + h) * d.dv..][..d.dv];
            for (a, row) in s.chunks_mut(d.dv).enumerate() {
                for ((sj, uj), oj) in row.iter_mut().zip(&u).zip(o.iter_mut()) {
                    *sj += kv[a] * uj;
                    *oj += qv[a] * *sj;
                }
            }
        }
    }
    out
}

/// In chunks of `CHUNK` tokens (transformers' `torch_chunk_gated_delta_rule`): within a
/// chunk, the delta-rule updates become one unit-lower-triangular solve; across chunks, the
/// state carries. Same contract as `recurrent`.
pub fn chunked(x: &Inputs, d: Dims, state: &mut [f32]) -> Vec<f32> {
    let t = x.g.len() / d.v_heads;
    let (q, k) = prepare(x, d);
    let rep = d.v_heads / d.k_heads;
    let mut out = vec![0f32; t * d.v_heads * d.dv];
    for h in 0..d.v_heads {
        let kh = h / rep;
        let s = &mut state[h * d.dk * d.dv..][..d.dk * d.dv];
        for c0 in (0..t).step_by(CHUNK) {
            let n = CHUNK.min(t - c0);
            let row = |buf: &'_ [f32], heads: usize, head: usize, w: usize, i: usize| -> Vec<f32> {
                buf[((c0 + i) * heads + head) * w..][..w].to_vec()
            };
            let qs: Vec<Vec<f32>> = (0..n).map(|i| row(&q, d.k_heads, kh, d.dk, i)).collect();
            let ks: Vec<Vec<f32>> = (0..n).map(|i| row(&k, d.k_heads, kh, d.dk, i)).collect();
            let vs: Vec<Vec<f32>> = (0..n).map(|i| row(x.v, d.v_heads, h, d.dv, i)).collect();
            let beta: Vec<f32> = (0..n).map(|i| x.beta[(c0 + i) * d.v_heads + h]).collect();
            let mut cum = vec![0f32; n];
            let mut acc = 0f32;
            for i in 0..n {
                acc += x.g[(c0 + i) * d.v_heads + h];
                cum[i] = acc;
            }
            let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>();
            // (I + L) X = B with L[i][j] = β_i (k_i·k_j) e^{cum_i − cum_j}, j < i: the new values
            // (B = β v) and the decayed keys that read the old state (B = β k e^{cum}).
            let mut new_v: Vec<Vec<f32>> = (0..n).map(|i| vs[i].iter().map(|e| e * beta[i]).collect()).collect();
            let mut kcd: Vec<Vec<f32>> = (0..n).map(|i| ks[i].iter().map(|e| e * beta[i] * cum[i].exp()).collect()).collect();
            for i in 0..n {
                for j in 0..i {
                    let l = beta[i] * dot(&ks[i], &ks[j]) * (cum[i] - cum[j]).exp();
                    let (vj, kj) = (new_v[j].clone(), kcd[j].clone());
                    new_v[i].iter_mut().zip(&vj).for_each(|(a, b)| *a -= l * b);
                    kcd[i].iter_mut().zip(&kj).for_each(|(a, b)| *a -= l * b);
                }
            }
            // v_new = new_v − kcd · S (the part the old state does not already predict).
            let mut vnew = new_v;
            for i in 0..n {
                for (a, srow) in s.chunks(d.dv).enumerate() {
                    let c = kcd[i][a];
                    vnew[i].iter_mut().zip(srow).for_each(|(v, sv)| *v -= c * sv);
                }
            }
            // Output: the old state read by the decayed query, plus attention inside the chunk.
            for i in 0..n {
                let o = &mut out[((c0 + i) * d.v_heads + h) * d.dv..][..d.dv];
                let qd = cum[i].exp();
                for (a, srow) in s.chunks(d.dv).enumerate() {
                    let c = qs[i][a] * qd;
                    o.iter_mut().zip(srow).for_each(|(oj, sv)| *oj += c * sv);
                }
                for j in 0..=i {
                    let w = dot(&qs[i], &ks[j]) * (cum[i] - cum[j]).exp();
                    o.iter_mut().zip(&vnew[j]).for_each(|(oj, v)| *oj += w * v);
                }
            }
            // State: decayed to the chunk's end, plus every token's correction.
            let last = cum[n - 1];
            s.iter_mut().for_each(|e| *e *= last.exp());
            for j in 0..n {
                let kd = (last - cum[j]).exp();
                for (a, srow) in s.chunks_mut(d.dv).enumerate() {
                    let c = ks[j][a] * kd;
                    srow.iter_mut().zip(&vnew[j]).for_each(|(sv, v)| *sv += c * v);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: &mut u64) -> f32 {
        *seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((*seed >> 33) as f32 / (1u64 << 31) as f32) * 2.0 - 1.0
    }

    fn random(n: usize, seed: &mut u64) -> Vec<f32> {
        (0..n).map(|_| lcg(seed)).collect()
    }

    /// Any split into chunks, either form, gives the recurrent outputs and final state.
    #[test]
    fn chunked_equals_recurrent() {
        let d = Dims { k_heads: 2, v_heads: 4, dk: 8, dv: 6 };
        let t = 150; // three chunks, the last one partial
        let mut seed = 7u64;
        let q = random(t * d.k_heads * d.dk, &mut seed);
        let k = random(t * d.k_heads * d.dk, &mut seed);
        let v = random(t * d.v_heads * d.dv, &mut seed);
        let g: Vec<f32> = random(t * d.v_heads, &mut seed).iter().map(|x| -0.5 * (x + 1.0)).collect();
        let beta: Vec<f32> = random(t * d.v_heads, &mut seed).iter().map(|x| 0.5 * (x + 1.0)).collect();
        let all = Inputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
        let mut s_rec = vec![0f32; d.state_len()];
        let want = recurrent(&all, d, &mut s_rec);
        let mut s_chunk = vec![0f32; d.state_len()];
        let got = chunked(&all, d, &mut s_chunk);
        let max = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
        assert!(max(&want, &got) < 1e-5, "outputs {}", max(&want, &got));
        assert!(max(&s_rec, &s_chunk) < 1e-5, "states {}", max(&s_rec, &s_chunk));
        // Prefill in uneven pieces (chunked), then decode token by token (recurrent).
        let mut s = vec![0f32; d.state_len()];
        let mut outs = vec![];
        let mut start = 0;
        for len in [70, 1, 33, 40, 1, 1, 4] {
            let sl = |x: &[f32], w: usize| x[start * w..(start + len) * w].to_vec();
            let (q, k, v, g, b) = (sl(&q, d.k_heads * d.dk), sl(&k, d.k_heads * d.dk), sl(&v, d.v_heads * d.dv), sl(&g, d.v_heads), sl(&beta, d.v_heads));
            let x = Inputs { q: &q, k: &k, v: &v, g: &g, beta: &b };
            outs.extend(if len == 1 { recurrent(&x, d, &mut s) } else { chunked(&x, d, &mut s) });
            start += len;
        }
        assert!(max(&want, &outs) < 1e-5, "pieces {}", max(&want, &outs));
        assert!(max(&s_rec, &s) < 1e-5);
    }
}
