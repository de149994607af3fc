//! Sparse mixture-of-experts feed-forward (Qwen3-MoE blocks, as in Qwen3-VL-MoE): a linear
//! router scores every expert, each token keeps its top-k (softmax in f32, then the kept
//! weights renormalised to sum to one, as transformers does), and the token's output is the
//! weighted sum of its experts' gated MLPs.
//!
//! Only the experts some token picked run, each on just its tokens, so a decode step reads
//! k experts' weights, not all of them.

use candle_core::{DType, Module, Result, Tensor};

use super::{act, linear, Act, Linear};
use crate::weights::Weights;

#[derive(Clone, Copy, Debug)]
pub struct MoeShape {
    pub hidden: usize,
    /// Width of one expert's MLP (`moe_intermediate_size`).
    pub expert_width: usize,
    pub num_experts: usize,
    pub top_k: usize,
    /// Renormalise the kept weights (`norm_topk_prob`).
    pub norm_topk: bool,
    pub act: Act,
}

#[derive(Clone, Debug)]
struct Expert {
    gate: Linear,
    up: Linear,
    down: Linear,
}

#[derive(Clone, Debug)]
pub struct SparseMoe {
    router: Linear,
    experts: Vec<Expert>,
    shape: MoeShape,
}

impl SparseMoe {
    /// Loads `gate` (the router) and the experts under `w`. Experts come fused, as the released
    /// Qwen3-VL-MoE checkpoints hold them (`experts.gate_up_proj` `[E, hidden, 2·width]`,
    /// `experts.down_proj` `[E, width, hidden]`), or one module per expert
    /// (`experts.{i}.{gate,up,down}_proj.weight`, the Qwen3-MoE layout).
    pub fn new(s: MoeShape, w: Weights) -> Result<Self> {
        if s.top_k == 0 || s.top_k > s.num_experts {
            candle_core::bail!("num_experts_per_tok {} must be between 1 and num_experts {}", s.top_k, s.num_experts);
        }
        let router = super::linear::linear_dense(s.hidden, s.num_experts, w.pp("gate"))?;
        let ew = w.pp("experts");
        let experts = if ew.contains("gate_up_proj") || !ew.contains("0.gate_proj.weight") {
            fused_experts(&s, &ew)?
        } else {
            (0..s.num_experts)
                .map(|i| {
                    let x = ew.pp(i);
                    Ok(Expert {
                        gate: linear(s.hidden, s.expert_width, false, x.pp("gate_proj"))?,
                        up: linear(s.hidden, s.expert_width, false, x.pp("up_proj"))?,
                        down: linear(s.expert_width, s.hidden, false, x.pp("down_proj"))?,
                    })
                })
                .collect::<Result<Vec<_>>>()?
        };
        if ew.contains(&format!("{}.gate_proj.weight", s.num_experts)) {
            candle_core::bail!("{}: more expert tensors than num_experts = {}", ew.vb().prefix(), s.num_experts);
        }
        Ok(SparseMoe { router, experts, shape: s })
    }

    /// Each token's chosen experts and their weights, from router logits `[T, E]`.
    fn route(&self, logits: &Tensor) -> Result<Vec<Vec<(usize, f32)>>> {
        let probs = candle_nn::ops::softmax_last_dim(&logits.to_dtype(DType::F32)?)?;
        // Off the CPU this is a read-back per MoE layer and step, the device path's one
        // remaining host trip (Qwen3-VL-MoE): the experts are dispatched from the host.
        #[allow(clippy::disallowed_methods)]
        let rows: Vec<Vec<f32>> = probs.to_vec2()?;
        Ok(rows.into_iter().map(|p| top_k(&p, self.shape.top_k, self.shape.norm_topk)).collect())
    }
}

/// The `k` largest entries (ties to the lower index, as torch.topk on CPU), optionally
/// renormalised to sum to one.
fn top_k(p: &[f32], k: usize, norm: bool) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..p.len()).collect();
    idx.sort_by(|&a, &b| p[b].total_cmp(&p[a]).then(a.cmp(&b)));
    let mut kept: Vec<(usize, f32)> = idx[..k].iter().map(|&i| (i, p[i])).collect();
    if norm {
        let sum: f32 = kept.iter().map(|(_, w)| w).sum();
        for (_, w) in kept.iter_mut() {
            *w /= sum;
        }
    }
    kept
}

fn fused_experts(s: &MoeShape, ew: &Weights) -> Result<Vec<Expert>> {
    let (e, h, i) = (s.num_experts, s.hidden, s.expert_width);
    let gate_up = ew.get((e, h, 2 * i), "gate_up_proj")?;
    let down = ew.get((e, i, h), "down_proj")?;
    // Each expert becomes three linear layers, quantized like any other when the source
    // quantizes (the fused tensor is dropped once they are cut).
    let layer = |w: Tensor, name: &str| -> Result<Linear> {
        match ew.quantize_derived(name, &w) {
            Some(q) => Linear::quantized(q?, None),
            None => Ok(Linear::new(w, None)),
        }
    };
    (0..e)
        .map(|x| {
            // Fused tensors are stored [in, out]; a Linear holds [out, in].
            let gu = gate_up.get(x)?; // [h, 2i]
            Ok(Expert {
                gate: layer(gu.narrow(1, 0, i)?.t()?.contiguous()?, "gate_up_proj")?,
                up: layer(gu.narrow(1, i, i)?.t()?.contiguous()?, "gate_up_proj")?,
                down: layer(down.get(x)?.t()?.contiguous()?, "down_proj")?,
            })
        })
        .collect()
}

impl Module for SparseMoe {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let t = x.dim(0)?;
        let routes = self.route(&self.router.forward(x)?)?;
        // Tokens (and weights) per expert, in token order.
        let mut per_expert: Vec<(Vec<u32>, Vec<f32>)> = vec![(vec![], vec![]); self.experts.len()];
        for (tok, r) in routes.iter().enumerate() {
            for &(e, w) in r {
                per_expert[e].0.push(tok as u32);
                per_expert[e].1.push(w);
            }
        }
        let mut out = x.zeros_like()?;
        for (e, (toks, weights)) in per_expert.iter().enumerate() {
            if toks.is_empty() {
                continue;
            }
            let ex = &self.experts[e];
            let idx = Tensor::new(toks.as_slice(), x.device())?;
            let xs = x.index_select(&idx, 0)?;
            let h = (act(self.shape.act, &ex.gate.forward(&xs)?)? * ex.up.forward(&xs)?)?;
            let y = ex.down.forward(&h)?;
            // transformers casts the routing weights to the hidden dtype before the product.
            let w = Tensor::new(weights.as_slice(), x.device())?.to_dtype(x.dtype())?.reshape((toks.len(), 1))?;
            out = out.index_add(&idx, &y.broadcast_mul(&w)?, 0)?;
        }
        debug_assert_eq!(out.dim(0)?, t);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn top_k_keeps_the_largest_and_renormalises() {
        let k = top_k(&[0.1, 0.4, 0.2, 0.3], 2, true);
        assert_eq!(k.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 3]);
        assert!((k[0].1 - 0.4 / 0.7).abs() < 1e-6 && (k[1].1 - 0.3 / 0.7).abs() < 1e-6);
        // Ties go to the lower index.
        assert_eq!(top_k(&[0.25; 4], 2, false).iter().map(|x| x.0).collect::<Vec<_>>(), vec![0, 1]);
    }

    /// The sparse forward equals the dense reference: every expert on every token, weighted by
    /// the renormalised top-k probabilities (zero for the experts a token did not pick).
    #[test]
    fn sparse_forward_equals_dense_reference() -> Result<()> {
        let dev = Device::Cpu;
        let s = MoeShape { hidden: 16, expert_width: 8, num_experts: 4, top_k: 2, norm_topk: true, act: Act::Silu };
        let moe = SparseMoe::new(s, Weights::dummy(DType::F32, &dev))?;
        let x = crate::testing::randn(102, (5, 16), 1.)?;
        let got = moe.forward(&x)?;
        let routes = moe.route(&moe.router.forward(&x)?)?;
        let mut want = vec![];
        for (tok, r) in routes.iter().enumerate() {
            let xt = x.narrow(0, tok, 1)?;
            let mut acc = Tensor::zeros((1, 16), DType::F32, &dev)?;
            for e in 0..4 {
                let w = r.iter().find(|(i, _)| *i == e).map(|(_, w)| *w).unwrap_or(0.0);
                let ex = &moe.experts[e];
                let y = ex.down.forward(&(act(Act::Silu, &ex.gate.forward(&xt)?)? * ex.up.forward(&xt)?)?)?;
                acc = (acc + (y * w as f64)?)?;
            }
            want.push(acc);
        }
        let want = Tensor::cat(&want, 0)?;
        let d = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d < 1e-5, "max diff {d}");
        Ok(())
    }

    /// Fused experts from a file, quantized in situ to Q8_0: the routing is the same (the router
    /// stays dense) and the output within Q8_0's noise of the dense layer's.
    #[test]
    fn fused_experts_quantize_in_situ() -> Result<()> {
        let dev = Device::Cpu;
        let (h, i, e) = (64, 32, 4);
        let dir = tempfile::tempdir().map_err(candle_core::Error::wrap)?;
        let file = dir.path().join("moe.safetensors");
        let t = |seed: u64, shape: &[usize]| crate::testing::randn(seed, shape, 0.3);
        let tensors = std::collections::HashMap::from([
            ("mlp.gate.weight".to_string(), t(1, &[e, h])?),
            ("mlp.experts.gate_up_proj".to_string(), t(2, &[e, h, 2 * i])?),
            ("mlp.experts.down_proj".to_string(), t(3, &[e, i, h])?),
        ]);
        candle_core::safetensors::save(&tensors, &file)?;
        let s = MoeShape { hidden: h, expert_width: i, num_experts: e, top_k: 2, norm_topk: true, act: Act::Silu };
        let w = Weights::safetensors(&[file], DType::F32, &dev).map_err(candle_core::Error::wrap)?;
        let dense = SparseMoe::new(s, w.pp("mlp"))?;
        let (wq, stats) = w.quantize(crate::weights::Quant::Q8_0, false);
        let quant = SparseMoe::new(s, wq.pp("mlp"))?;
        assert_eq!(stats.quantized.load(std::sync::atomic::Ordering::Relaxed), 3 * e);
        assert!(quant.experts.iter().all(|x| x.gate.is_quantized() && x.down.is_quantized()) && !quant.router.is_quantized());
        let x = crate::testing::randn(9, (9, h), 1.)?;
        assert_eq!(dense.route(&dense.router.forward(&x)?)?, quant.route(&quant.router.forward(&x)?)?);
        let (a, b) = (dense.forward(&x)?, quant.forward(&x)?);
        let rel = ((&a - &b)?.sqr()?.sum_all()?.to_scalar::<f32>()? / a.sqr()?.sum_all()?.to_scalar::<f32>()?).sqrt();
        assert!(rel < 2e-2, "q8_0 experts: relative error {rel}");
        Ok(())
    }

    #[test]
    fn bad_top_k_is_named() {
        let s = MoeShape { hidden: 16, expert_width: 8, num_experts: 4, top_k: 5, norm_topk: true, act: Act::Silu };
        let e = SparseMoe::new(s, Weights::dummy(DType::F32, &Device::Cpu)).unwrap_err().to_string();
        assert!(e.contains("num_experts_per_tok 5"), "{e}");
    }
}
