//! Gated DeltaNet, the linear-attention mixer of Qwen3.5's hybrid decoder (transformers'
//! `Qwen3_5GatedDeltaNet`): projections to q/k/v (one matrix), z (output gate), b (β) and a
//! (decay); a depthwise causal conv1d with SiLU over the q/k/v channels; the gated delta rule
//! (`delta_rule`); a per-head RMSNorm gated by silu(z); the output projection.
//!
//! State per sequence, in the step cache's `RecurrentState`: the conv window (the last
//! `kernel − 1` q/k/v rows, `[kernel − 1, conv_dim]`) and the delta-rule matrix
//! (`[Hv, dk, dv]`), both f32 whatever the model dtype.

use candle_core::{DType, Device, Module, Result, Tensor};

use super::delta_rule::{self, Dims, Inputs};
use super::delta_rule_ops as ops;
use super::norm::GatedRmsNorm;
use super::{linear, Linear};
use super::step_cache::StepCache;
use crate::weights::Weights;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeltaNetShape {
    pub hidden: usize,
    pub dims: Dims,
    pub conv_kernel: usize,
}

impl DeltaNetShape {
    pub fn key_dim(&self) -> usize {
        self.dims.k_heads * self.dims.dk
    }
    pub fn value_dim(&self) -> usize {
        self.dims.v_heads * self.dims.dv
    }
    /// Channels of the causal conv: q, k and v side by side.
    pub fn conv_dim(&self) -> usize {
        2 * self.key_dim() + self.value_dim()
    }
    /// `(conv window, delta-rule state)` shapes one sequence keeps.
    pub fn state_shapes(&self) -> (Vec<usize>, Vec<usize>) {
        (vec![self.conv_kernel - 1, self.conv_dim()], vec![self.dims.v_heads, self.dims.dk, self.dims.dv])
    }
}

#[derive(Clone, Debug)]
pub struct GatedDeltaNet {
    in_qkv: Linear,
    in_z: Linear,
    in_b: Linear,
    in_a: Linear,
    /// Depthwise kernel `[conv_dim, kernel]`, f32 on the host.
    conv: Vec<f32>,
    /// The same kernel as `[kernel, conv_dim]` f32 on the model's device (the tensor path).
    conv_taps: Tensor,
    dt_bias: Tensor,
    /// −exp(A_log), f32.
    neg_a: Tensor,
    norm: GatedRmsNorm,
    out: Linear,
    shape: DeltaNetShape,
}

impl GatedDeltaNet {
    pub fn new(s: DeltaNetShape, eps: f64, w: Weights) -> Result<Self> {
        let d = s.dims;
        if d.k_heads == 0 || !d.v_heads.is_multiple_of(d.k_heads) || s.conv_kernel < 2 {
            candle_core::bail!(
                "linear attention: {} value heads must be a multiple of {} key heads, and the conv kernel ({}) at least 2",
                d.v_heads,
                d.k_heads,
                s.conv_kernel
            );
        }
        let conv = w.pp("conv1d").get((s.conv_dim(), 1, s.conv_kernel), "weight")?.to_dtype(DType::F32)?;
        let a_log = w.vb().get_with_hints(d.v_heads, "A_log", candle_nn::Init::Const(0.0))?;
        Ok(GatedDeltaNet {
            in_qkv: linear(s.hidden, s.conv_dim(), false, w.pp("in_proj_qkv"))?,
            in_z: linear(s.hidden, s.value_dim(), false, w.pp("in_proj_z"))?,
            in_b: linear(s.hidden, d.v_heads, false, w.pp("in_proj_b"))?,
            in_a: linear(s.hidden, d.v_heads, false, w.pp("in_proj_a"))?,
            conv: super::host_vec(&conv.to_device(&Device::Cpu)?)?,
            conv_taps: conv.reshape((s.conv_dim(), s.conv_kernel))?.t()?.contiguous()?,
            dt_bias: w.vb().get_with_hints(d.v_heads, "dt_bias", candle_nn::Init::Const(1.0))?.to_dtype(DType::F32)?,
            neg_a: a_log.to_dtype(DType::F32)?.exp()?.neg()?,
            norm: GatedRmsNorm::new(d.dv, eps, w.pp("norm"))?,
            out: linear(s.value_dim(), s.hidden, false, w.pp("out_proj"))?,
            shape: s,
        })
    }

    /// `x: [T, hidden]` of this step (the runs of several sequences); `layer` names the state.
    /// On the CPU the conv and delta rule run on host slices; elsewhere (and with
    /// `MERG_CPU_KERNELS=generic`) as tensor operations, the state staying on the device.
    pub fn forward(&self, x: &Tensor, layer: usize, cache: &mut dyn StepCache) -> Result<Tensor> {
        let t = x.dim(0)?;
        let mixed = self.in_qkv.forward(x)?.to_dtype(DType::F32)?;
        let beta = candle_nn::ops::sigmoid(&self.in_b.forward(x)?)?.to_dtype(DType::F32)?;
        // g = −exp(A_log) · softplus(a + dt_bias), in f32 like transformers.
        let a = self.in_a.forward(x)?.to_dtype(DType::F32)?.broadcast_add(&self.dt_bias)?;
        let g = softplus(&a)?.broadcast_mul(&self.neg_a)?;
        let core = match crate::cpu::host_paths(x.device()) {
            true => self.rule_on_host(&mixed, &beta, &g, layer, cache)?,
            false => self.rule_as_tensors(&mixed, &beta, &g, layer, cache)?,
        };
        let (s, dt) = (self.shape, x.dtype());
        let core = core.reshape((t * s.dims.v_heads, s.dims.dv))?.to_dtype(dt)?;
        let z = self.in_z.forward(x)?.reshape((t * s.dims.v_heads, s.dims.dv))?;
        let y = self.norm.forward(&core, &z)?.reshape((t, s.value_dim()))?;
        self.out.forward(&y)
    }

    /// Conv and delta rule of every run on the device: `[T, Hv, dv]` f32.
    fn rule_as_tensors(&self, mixed: &Tensor, beta: &Tensor, g: &Tensor, layer: usize, cache: &mut dyn StepCache) -> Result<Tensor> {
        let (s, dev) = (self.shape, mixed.device());
        let d = s.dims;
        let (cs, ss) = s.state_shapes();
        let on_dev = |t: Option<Tensor>, shape: &[usize]| match t {
            Some(t) => t.to_device(dev),
            None => Tensor::zeros(shape, DType::F32, dev),
        };
        let mut outs = vec![];
        for (run, (start, len)) in cache.runs(mixed.dim(0)?).into_iter().enumerate() {
            let state = cache.recurrent(layer, run)?;
            // Depthwise causal conv over the window and the run's rows, then SiLU.
            let ext = Tensor::cat(&[on_dev(state.conv.take(), &cs)?, mixed.narrow(0, start, len)?], 0)?;
            let mut acc = ext.narrow(0, 0, len)?.broadcast_mul(&self.conv_taps.get(0)?)?;
            for j in 1..s.conv_kernel {
                acc = (acc + ext.narrow(0, j, len)?.broadcast_mul(&self.conv_taps.get(j)?)?)?;
            }
            state.conv = Some(ext.narrow(0, len, s.conv_kernel - 1)?.contiguous()?);
            let qkv = candle_nn::ops::silu(&acc)?;
            let (kd, vd) = (s.key_dim(), s.value_dim());
            let q = ops::l2norm(&qkv.narrow(1, 0, kd)?.reshape((len, d.k_heads, d.dk))?, 1.0 / (d.dk as f64).sqrt())?;
            let k = ops::l2norm(&qkv.narrow(1, kd, kd)?.reshape((len, d.k_heads, d.dk))?, 1.0)?;
            let v = qkv.narrow(1, 2 * kd, vd)?.reshape((len, d.v_heads, d.dv))?;
            let (q, k, v) = (ops::head_major(&q, d.v_heads)?, ops::head_major(&k, d.v_heads)?, ops::head_major(&v, d.v_heads)?);
            let per_head = |x: &Tensor| x.narrow(0, start, len)?.t()?.contiguous();
            let (g, beta) = (per_head(g)?, per_head(beta)?);
            let mut ssm = on_dev(state.ssm.take(), &ss)?;
            // Prefill chunks use the chunked form, decode the recurrent one, as transformers.
            let o = match len {
                1 => ops::recurrent(&q, &k, &v, &g, &beta, &mut ssm)?,
                _ => ops::chunked(&q, &k, &v, &g, &beta, &mut ssm)?,
            };
            state.ssm = Some(ssm);
            outs.push(o.transpose(0, 1)?);
        }
        Tensor::cat(&outs, 0)
    }

    /// Conv and delta rule of every run on host slices: `[T, Hv, dv]` f32 on the host.
    fn rule_on_host(&self, mixed: &Tensor, beta: &Tensor, g: &Tensor, layer: usize, cache: &mut dyn StepCache) -> Result<Tensor> {
        crate::cpu::note_kernel_run();
        let (t, s) = (mixed.dim(0)?, self.shape);
        let (mixed, beta, g): (Vec<f32>, Vec<f32>, Vec<f32>) =
            (super::host_vec(mixed)?, super::host_vec(beta)?, super::host_vec(g)?);
        let mut core = Vec::with_capacity(t * s.value_dim());
        for (run, (start, len)) in cache.runs(t).into_iter().enumerate() {
            let state = cache.recurrent(layer, run)?;
            let cw = s.conv_dim();
            let mut window = take_state(state.conv.take(), (s.conv_kernel - 1) * cw)?;
            let qkv = conv_silu(&mixed[start * cw..(start + len) * cw], &self.conv, cw, s.conv_kernel, &mut window);
            let mut ssm = take_state(state.ssm.take(), s.dims.state_len())?;
            let (q, k, v) = split_qkv(&qkv, len, s);
            let hv = s.dims.v_heads;
            let inputs = Inputs { q: &q, k: &k, v: &v, g: &g[start * hv..(start + len) * hv], beta: &beta[start * hv..(start + len) * hv] };
            // Prefill chunks use the chunked form, decode the recurrent one, as transformers.
            core.extend(if len > 1 { delta_rule::chunked(&inputs, s.dims, &mut ssm) } else { delta_rule::recurrent(&inputs, s.dims, &mut ssm) });
            let (cs, ss) = s.state_shapes();
            state.conv = Some(Tensor::from_vec(window, cs, &Device::Cpu)?);
            state.ssm = Some(Tensor::from_vec(ssm, ss, &Device::Cpu)?);
        }
        Tensor::from_vec(core, (t, s.dims.v_heads, s.dims.dv), &Device::Cpu)
    }
}

fn softplus(x: &Tensor) -> Result<Tensor> {
    // log(1 + e^x), with torch's threshold: x itself above 20.
    let big = x.ge(20.0)?;
    let small = (x.exp()? + 1.0)?.log()?;
    big.where_cond(x, &small)
}

/// A state tensor as host f32 (zeros when the sequence has none yet).
fn take_state(t: Option<Tensor>, len: usize) -> Result<Vec<f32>> {
    match t {
        Some(t) => super::host_vec(&t.to_device(&Device::Cpu)?),
        None => Ok(vec![0f32; len]),
    }
}

/// Depthwise causal conv1d + SiLU over `x` `[T, C]` rows, continuing from `window` (the last
/// `kernel − 1` rows before `x`), which then holds the last `kernel − 1` rows of `window ++ x`.
fn conv_silu(x: &[f32], w: &[f32], c: usize, kernel: usize, window: &mut Vec<f32>) -> Vec<f32> {
    let t = x.len() / c;
    let past = kernel - 1;
    let mut ext = Vec::with_capacity((past + t) * c);
    ext.extend_from_slice(window);
    ext.extend_from_slice(x);
    let mut out = vec![0f32; t * c];
    for i in 0..t {
        for ch in 0..c {
            let mut acc = 0f32;
            for j in 0..kernel {
                acc += w[ch * kernel + j] * ext[(i + j) * c + ch];
            }
            out[i * c + ch] = acc / (1.0 + (-acc).exp());
        }
    }
    window.clear();
    window.extend_from_slice(&ext[t * c..]);
    out
}

/// Splits conv output rows `[T, 2·key_dim + value_dim]` into q, k `[T, Hk·dk]`, v `[T, Hv·dv]`.
fn split_qkv(x: &[f32], t: usize, s: DeltaNetShape) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (kd, vd) = (s.key_dim(), s.value_dim());
    let w = 2 * kd + vd;
    let (mut q, mut k, mut v) = (Vec::with_capacity(t * kd), Vec::with_capacity(t * kd), Vec::with_capacity(t * vd));
    for row in x.chunks(w).take(t) {
        q.extend_from_slice(&row[..kd]);
        k.extend_from_slice(&row[kd..2 * kd]);
        v.extend_from_slice(&row[2 * kd..]);
    }
    (q, k, v)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The conv of a sequence split in two equals the conv of the whole (the window carries).
    #[test]
    fn conv_window_carries_across_chunks() {
        let (c, k) = (3, 4);
        let w: Vec<f32> = (0..c * k).map(|i| (i as f32 * 0.37).sin()).collect();
        let x: Vec<f32> = (0..7 * c).map(|i| (i as f32 * 0.11).cos()).collect();
        let mut win = vec![0f32; (k - 1) * c];
        let whole = conv_silu(&x, &w, c, k, &mut win);
        let mut win2 = vec![0f32; (k - 1) * c];
        let mut parts = conv_silu(&x[..2 * c], &w, c, k, &mut win2);
        parts.extend(conv_silu(&x[2 * c..], &w, c, k, &mut win2));
        assert_eq!(whole, parts);
        assert_eq!(win, win2);
        assert_eq!(&win[..], &x[4 * c..]);
    }
}
