//! The one linear layer of every model: weight `[out, in]` as candle's `QMatMul`, which holds
//! either a dense tensor or a quantized one (GGUF block formats); on the CPU, f32 weights
//! (AVX-512; not a tied head's shared table), bf16 weights (AVX-512 BF16) and block-quantized
//! weights (AVX-512 VNNI panels for Q8_0/Q4_K, AVX2 blocks for every other format `cpu::quant`
//! names) are instead handed once to the packed kernels;
//! plus an optional bias. Model code never knows which: a weight source that yields quantized
//! tensors changes no model.

use candle_core::quantized::{GgmlDType, QMatMul, QTensor};
use candle_core::{DType, Module, Result, Tensor};
use std::sync::Arc;

use crate::cpu::bf16::PackedBf16;
use crate::cpu::fp32::PackedF32;
use crate::cpu::blocks::{Format, PackedBlocks};
use crate::cpu::quant::Kernel;
use crate::cpu::q4_k::PackedQ4K;
use crate::cpu::q6_k::PackedQ6K;
use crate::cpu::q8_0::PackedQ8;
use crate::weights::{Mapped, Weights};

use super::deferred::Deferred;

#[derive(Clone, Debug)]
pub struct Linear {
    weight: Weight,
    bias: Option<Tensor>,
}

#[derive(Clone, Debug)]
enum Weight {
    Candle(QMatMul),
    /// Q8_0 in `cpu::q8_0`'s panel layout (the blocks it came from are dropped).
    PackedQ8(Arc<PackedQ8>),
    /// Q4_K or Q5_K in `cpu::q4_k`'s panel layout (likewise).
    PackedQ4K(Arc<PackedQ4K>),
    /// Q6_K in `cpu::q6_k`'s panel layout (likewise).
    PackedQ6K(Arc<PackedQ6K>),
    /// bf16 in `cpu::bf16`'s panel layout (the tensor it came from is dropped).
    PackedBf16(Arc<PackedBf16>),
    /// f32 in `cpu::fp32`'s panel layout (likewise).
    PackedF32(Arc<PackedF32>),
    /// f32, bf16 or AVX2-grouped blocks read from the mapped file until `cpu::repack` has
    /// packed it.
    Deferred(Arc<Deferred>),
    /// Any block format `cpu::blocks` runs, in the file's own blocks (AVX2).
    PackedBlocks(Arc<PackedBlocks>),
}

/// `w` repacked by `pack` when it is a 2-D CPU matrix of `T` and `available` (the kernel runs
/// here), read straight from the tensor's storage: a 7B model has no room for a copy of each
/// weight.
fn pack_dense<T: candle_core::WithDType, P>(w: &Tensor, available: bool, pack: impl Fn(&[T], usize, usize) -> P) -> Option<P> {
    if !crate::cpu::host_paths(w.device()) || w.dtype() != T::DTYPE || w.rank() != 2 || !available {
        return None;
    }
    let (n, k) = w.dims2().ok()?;
    if !w.is_contiguous() {
        return pack_dense(&w.contiguous().ok()?, available, pack);
    }
    let (storage, layout) = w.storage_and_layout();
    let candle_core::Storage::Cpu(cpu) = &*storage else { return None };
    let data = cpu.as_slice::<T>().ok()?;
    Some(pack(&data[layout.start_offset()..][..n * k], n, k))
}

/// Blocks `[n, k]` of type `dtype` in the packed layout of the kernel that runs them here.
fn pack_blocks(dtype: GgmlDType, blocks: &[u8], n: usize, k: usize) -> Option<Weight> {
    match crate::cpu::quant::kernel(dtype)? {
        Kernel::Vnni if dtype == GgmlDType::Q8_0 => PackedQ8::pack(blocks, n, k).map(|p| Weight::PackedQ8(Arc::new(p))),
        Kernel::Vnni if dtype == GgmlDType::Q6K => PackedQ6K::pack(blocks, n, k).map(|p| Weight::PackedQ6K(Arc::new(p))),
        Kernel::Vnni if dtype == GgmlDType::Q5K => PackedQ4K::pack_q5k(blocks, n, k).map(|p| Weight::PackedQ4K(Arc::new(p))),
        Kernel::Vnni => PackedQ4K::pack(blocks, n, k).map(|p| Weight::PackedQ4K(Arc::new(p))),
        Kernel::Blocks => PackedBlocks::pack(Format::of(dtype)?, blocks, n, k).map(|p| Weight::PackedBlocks(Arc::new(p))),
    }
}

/// `w` repacked for `cpu::bf16` when it is a bf16 matrix on a CPU that runs the kernel.
fn pack_bf16(w: &Tensor) -> Option<PackedBf16> {
    pack_dense(w, crate::cpu::bf16::available(), PackedBf16::pack)
}

/// `w` repacked for `cpu::fp32` when it is an f32 matrix on a CPU that runs the kernel.
fn pack_f32(w: &Tensor) -> Option<PackedF32> {
    pack_dense(w, crate::cpu::fp32::available(), PackedF32::pack)
}

impl Linear {
    /// A dense layer from its `[out, in]` weight (a large CPU weight is moved onto huge pages:
    /// decode streams it every token).
    pub fn new(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self::dense(weight, bias, true)
    }

    /// A dense layer over `weight` without moving it (a tied head shares the embedding table,
    /// which its owner has already placed); a bf16 one on the CPU still gets its packed copy.
    pub fn shared(weight: Tensor, bias: Option<Tensor>) -> Self {
        Self::dense(weight, bias, false)
    }

    /// Packed when `pack_bf16` takes it; otherwise the tensor, moved onto huge pages if asked.
    fn dense(weight: Tensor, bias: Option<Tensor>, rehome: bool) -> Self {
        if let Some(p) = pack_bf16(&weight) {
            return Linear { weight: Weight::PackedBf16(Arc::new(p)), bias };
        }
        // f32 only when the layer owns its weight: a tied head's packed copy would double the
        // embedding table (its one-row products take `cpu::matvec` on the table itself).
        if rehome {
            if let Some(p) = pack_f32(&weight) {
                return Linear { weight: Weight::PackedF32(Arc::new(p)), bias };
            }
        }
        let weight = if rehome { crate::cpu::pages::rehome(weight.clone()).unwrap_or(weight) } else { weight };
        Linear { weight: Weight::Candle(QMatMul::Tensor(weight)), bias }
    }

    /// A quantized layer (its matmul dequantizes block-wise inside the kernel). Where a packed
    /// CPU kernel runs the block type (`cpu::quant::kernel`) the blocks are handed to it once
    /// and the tensor is dropped.
    pub fn quantized(weight: Arc<QTensor>, bias: Option<Tensor>) -> Result<Self> {
        let dims = weight.shape().dims().to_vec();
        if crate::cpu::host_paths(&weight.device()) && dims.len() == 2 {
            if let Some(weight) = pack_blocks(weight.dtype(), &weight.data()?, dims[0], dims[1]) {
                return Ok(Linear { weight, bias });
            }
        }
        Ok(Linear { weight: Weight::Candle(QMatMul::from_arc(weight)?), bias })
    }

    /// A layer whose weight goes straight from the mapped file to its home (the mapping's pages
    /// of it released behind the copy): blocks repacked when a packed kernel runs their type;
    /// a float weight stored in the compute `dtype` repacked when its kernel runs here, else
    /// copied row-major onto huge pages. `None`: another device, blocks without a packed
    /// kernel, or a float weight to convert; the caller loads a copy instead.
    pub fn from_mapped(m: &Mapped, dtype: DType, dev: &candle_core::Device, bias: Option<Tensor>) -> Option<Self> {
        let [n, k] = m.dims[..] else { return None };
        if !crate::cpu::host_paths(dev) {
            return None;
        }
        // Weights a packed kernel runs from staged panels: used from the file, packed behind the
        // first tokens.
        if let Some(d) = Deferred::new(m, dtype) {
            return Some(Linear { weight: Weight::Deferred(d), bias });
        }
        // Dense weights no packed kernel takes here stay row-major, copied once onto huge pages.
        fn dense<T: candle_core::WithDType>(m: &Mapped, n: usize, k: usize) -> Option<Weight> {
            let t = Tensor::from_vec(crate::cpu::pages::huge_copy(m.values::<T>()?), (n, k), &candle_core::Device::Cpu).ok()?;
            Some(Weight::Candle(QMatMul::Tensor(t)))
        }
        let pack = || match m.dtype {
            GgmlDType::F32 if dtype == DType::F32 => dense::<f32>(m, n, k),
            GgmlDType::BF16 if dtype == DType::BF16 => dense::<half::bf16>(m, n, k),
            GgmlDType::F16 if dtype == DType::F16 => dense::<half::f16>(m, n, k),
            _ if m.is_float() => None,
            t => pack_blocks(t, m.bytes(), n, k),
        };
        let weight = crate::cpu::pages::releasing(m.bytes(), pack)?;
        Some(Linear { weight, bias })
    }

    /// The dense weight, when it is one (tied embeddings, tests).
    pub fn dense_weight(&self) -> Option<&Tensor> {
        match &self.weight {
            Weight::Candle(QMatMul::Tensor(w)) => Some(w),
            _ => None,
        }
    }

    pub fn is_quantized(&self) -> bool {
        match &self.weight {
            Weight::Deferred(d) => d.is_quantized(),
            w => matches!(w, Weight::Candle(QMatMul::QTensor(_)) | Weight::PackedQ8(_) | Weight::PackedQ4K(_) | Weight::PackedQ6K(_) | Weight::PackedBlocks(_)),
        }
    }
}

/// Several linears over the same input (q/k/v, gate/up) computed as few products as their
/// weights allow: each run of neighbouring parts whose weights join is one product, one
/// parallel pass and one weight stream per step instead of several (a 0.5B decode step has 168
/// products otherwise, each a fork-join of the thread pool). A Q4_K_M file often stores v in
/// another block type than q and k: q and k still join, v is a product of its own.
#[derive(Clone, Debug)]
pub struct Fused {
    /// Each run's joined layer and its parts' output widths.
    runs: Vec<(Linear, Vec<usize>)>,
}

impl Fused {
    pub fn new(parts: Vec<Linear>) -> Result<Self> {
        let mut runs = vec![];
        let mut start = 0;
        while start < parts.len() {
            // The longest run from `start` that joins (a failed join copies no weight).
            let mut end = parts.len();
            let joined = loop {
                if end == start + 1 {
                    break parts[start].clone();
                }
                if let Some(one) = Linear::concat(&parts[start..end])? {
                    break one;
                }
                end -= 1;
            };
            runs.push((joined, parts[start..end].iter().map(Linear::out_dim).collect::<Result<_>>()?));
            start = end;
        }
        Ok(Fused { runs })
    }

    /// Products a forward runs (1 when every part joined).
    pub fn products(&self) -> usize {
        self.runs.len()
    }

    /// Each part's output, in order.
    pub fn forward(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let mut outs = vec![];
        for (one, widths) in &self.runs {
            let y = one.forward(x)?;
            if widths.len() == 1 {
                outs.push(y);
                continue;
            }
            let last = y.rank() - 1;
            let mut start = 0;
            for &w in widths {
                outs.push(y.narrow(last, start, w)?);
                start += w;
            }
        }
        Ok(outs)
    }
}

impl Linear {
    /// Output features.
    pub fn out_dim(&self) -> Result<usize> {
        match &self.weight {
            Weight::PackedQ8(p) => Ok(p.rows()),
            Weight::PackedQ4K(p) => Ok(p.rows()),
            Weight::PackedQ6K(p) => Ok(p.rows()),
            Weight::PackedBf16(p) => Ok(p.rows()),
            Weight::PackedF32(p) => Ok(p.rows()),
            Weight::Deferred(d) => Ok(d.rows()),
            Weight::PackedBlocks(p) => Ok(p.rows()),
            Weight::Candle(QMatMul::Tensor(w)) => w.dim(0),
            Weight::Candle(QMatMul::TensorF16(w)) => w.dim(0),
            Weight::Candle(QMatMul::QTensor(q)) => q.shape().dims().first().copied().ok_or_else(|| candle_core::Error::Msg("a 0-d weight".into())),
        }
    }

    /// The parts as one layer (rows one after another), when their weights are of one joinable
    /// kind: all packed bf16, all packed Q8_0 (whole panels each), or all dense tensors of one
    /// dtype and width. Biases must be all present or all absent.
    fn concat(parts: &[Linear]) -> Result<Option<Linear>> {
        let bias = match parts.iter().map(|p| p.bias.as_ref()).collect::<Option<Vec<_>>>() {
            Some(b) => Some(Tensor::cat(&b, 0)?),
            None if parts.iter().all(|p| p.bias.is_none()) => None,
            None => return Ok(None),
        };
        // Every part packed in the same format (the variant is named after its type): their
        // panels joined; `None` if a part differs or is not whole panels.
        macro_rules! join {
            ($packed:ident) => {
                join!($packed, |a: Vec<&$packed>| $packed::concat(&a).map(Arc::new))
            };
            ($packed:ident, $join:expr) => {{
                let all: Option<Vec<&$packed>> = parts.iter().map(|p| if let Weight::$packed(w) = &p.weight { Some(&**w) } else { None }).collect();
                all.and_then($join).map(Weight::$packed)
            }};
        }
        let weight = match parts.iter().map(|p| &p.weight).collect::<Vec<_>>().as_slice() {
            [Weight::PackedBf16(_), ..] => join!(PackedBf16),
            [Weight::PackedF32(_), ..] => join!(PackedF32),
            [Weight::PackedQ8(_), ..] => join!(PackedQ8),
            [Weight::PackedQ4K(_), ..] => join!(PackedQ4K),
            [Weight::PackedQ6K(_), ..] => join!(PackedQ6K),
            [Weight::PackedBlocks(_), ..] => join!(PackedBlocks),
            [Weight::Deferred(_), ..] => join!(Deferred, |a: Vec<&Deferred>| Deferred::join(&a)),
            _ => {
                let all: Option<Vec<_>> = parts.iter().map(|p| p.dense_weight()).collect();
                match all {
                    Some(ws) if ws.windows(2).all(|w| w[0].dtype() == w[1].dtype() && w[0].dims().get(1) == w[1].dims().get(1)) && !ws.is_empty() => {
                        let w = crate::cpu::pages::rehome(Tensor::cat(&ws, 0)?)?;
                        Some(Weight::Candle(QMatMul::Tensor(w)))
                    }
                    _ => None,
                }
            }
        };
        Ok(weight.map(|weight| Linear { weight, bias }))
    }
}

/// Products with at most this many activation rows (decode steps) use `cpu::matvec` on the
/// CPU; larger ones (prefill) use candle's gemm.
pub const MATVEC_MAX_ROWS: usize = 16;

/// A decode-sized product on the CPU through `cpu::matvec`, which streams the f32 or bf16
/// weight once at the memory bandwidth (candle's gemm is built for large matrices and widens
/// bf16 slowly). `None`: not such a product.
fn cpu_matvec(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    use candle_core::{Device, Storage};
    let k = *x.dims().last().unwrap_or(&0);
    if !crate::cpu::host_paths(x.device()) || !w.is_contiguous() || x.dtype() != w.dtype() || k == 0 || w.rank() != 2 {
        return Ok(None);
    }
    let rows = x.elem_count() / k;
    let n = w.dim(0)?;
    if rows == 0 || rows > MATVEC_MAX_ROWS || w.dim(1)? != k {
        return Ok(None);
    }
    let xs: Vec<f32> = match x.dtype() {
        DType::F32 => super::host_vec(x)?,
        _ => vec![],
    };
    crate::cpu::note_kernel_run();
    let mut out = vec![0f32; rows * n];
    let level = crate::cpu::level();
    {
        let (storage, layout) = w.storage_and_layout();
        let Storage::Cpu(cpu) = &*storage else { return Ok(None) };
        let off = layout.start_offset();
        match w.dtype() {
            DType::F32 => crate::cpu::matvec::matvec(&xs, rows, k, &cpu.as_slice::<f32>()?[off..off + n * k], n, &mut out, level),
            DType::BF16 => {
                let xb: Vec<half::bf16> = super::host_vec(x)?;
                crate::cpu::matvec::matvec_bf16(&xb, rows, k, &cpu.as_slice::<half::bf16>()?[off..off + n * k], n, &mut out, level)
            }
            _ => return Ok(None),
        }
    }
    let mut shape = x.dims().to_vec();
    *shape.last_mut().expect("rank ≥ 1") = n;
    Ok(Some(Tensor::from_vec(out, shape, &Device::Cpu)?.to_dtype(x.dtype())?))
}

/// A prefill-sized product with a bf16 weight on a CPU without the packed bf16 kernel: the
/// weight is widened to f32 a few hundred rows at a time and each slab goes through candle's
/// f32 GEMM (candle's own bf16 GEMM ran at 0.46× the f32 one on an AVX2 Zen 3). Widening is
/// exact and costs one conversion per weight against `rows` multiply-adds, and the products
/// and sums are f32 either way. `None`: not such a product.
fn cpu_widened_bf16(x: &Tensor, w: &Tensor) -> Result<Option<Tensor>> {
    let k = *x.dims().last().unwrap_or(&0);
    if !crate::cpu::host_paths(x.device()) || w.dtype() != DType::BF16 || x.dtype() != DType::BF16 || w.rank() != 2 || k == 0 || w.dim(1)? != k {
        return Ok(None);
    }
    let rows = x.elem_count() / k;
    if rows <= MATVEC_MAX_ROWS {
        return Ok(None);
    }
    crate::cpu::note_kernel_run();
    let n = w.dim(0)?;
    // About 4 MiB of f32 per slab: large enough for the GEMM's blocking, small beside the model.
    let slab = ((1 << 20) / k).max(64);
    let x32 = x.reshape((rows, k))?.to_dtype(DType::F32)?;
    let mut parts = Vec::with_capacity(n.div_ceil(slab));
    for start in (0..n).step_by(slab) {
        let ws = w.narrow(0, start, slab.min(n - start))?.to_dtype(DType::F32)?;
        parts.push(x32.matmul(&ws.t()?)?);
    }
    let mut shape = x.dims().to_vec();
    *shape.last_mut().expect("rank ≥ 1") = n;
    Ok(Some(Tensor::cat(&parts, 1)?.to_dtype(DType::BF16)?.reshape(shape)?))
}

/// Any product with a packed weight (on the CPU by construction): `[..., k]` rows of `x` taken
/// as `T` (bf16 for `cpu::bf16`, f32 for the quantized kernels), `n` outputs each, the result
/// in `x`'s dtype.
fn packed<T: candle_core::WithDType>(x: &Tensor, (n, k): (usize, usize), matmul: impl Fn(&[T], usize, &mut [f32]), bias: Option<&Tensor>) -> Result<Tensor> {
    crate::cpu::note_kernel_run();
    let rows = packed_rows(x, k)?;
    let mut out = vec![0f32; rows * n];
    super::with_host_slice(x, |xs: &[T]| matmul(xs, rows, &mut out))?;
    packed_output(x, out, n, bias)
}

/// Rows of `x` for a packed weight of `k` columns.
fn packed_rows(x: &Tensor, k: usize) -> Result<usize> {
    if x.dims().last() != Some(&k) {
        candle_core::bail!("linear: input {:?} does not end in the weight's {k} columns", x.dims());
    }
    Ok(x.elem_count() / k.max(1))
}

/// A packed product's f32 rows of `n` as a tensor shaped like `x` with `n` last, in `x`'s
/// dtype. The bias joins in f32 before the one rounding to bf16, as a bf16 `addmm` does.
fn packed_output(x: &Tensor, mut out: Vec<f32>, n: usize, bias: Option<&Tensor>) -> Result<Tensor> {
    if let Some(b) = bias {
        super::with_host_slice(b, |b: &[f32]| crate::cpu::elementwise::add_rows(&mut out, b))?;
    }
    let mut shape = x.dims().to_vec();
    *shape.last_mut().expect("rank ≥ 1") = n;
    match x.dtype() {
        DType::BF16 => {
            let mut narrow = vec![half::bf16::ZERO; out.len()];
            crate::cpu::elementwise::to_bf16(&out, &mut narrow);
            Tensor::from_vec(narrow, shape, x.device())
        }
        dt => Tensor::from_vec(out, shape, x.device())?.to_dtype(dt),
    }
}

impl Module for Linear {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let y = match &self.weight {
            Weight::PackedQ8(p) => return packed(x, (p.rows(), p.cols()), |x: &[f32], m, o| p.matmul(x, m, o), self.bias.as_ref()),
            Weight::PackedQ4K(p) => return packed(x, (p.rows(), p.cols()), |x: &[f32], m, o| p.matmul(x, m, o), self.bias.as_ref()),
            Weight::PackedQ6K(p) => return packed(x, (p.rows(), p.cols()), |x: &[f32], m, o| p.matmul(x, m, o), self.bias.as_ref()),
            Weight::PackedBlocks(p) => return packed(x, (p.rows(), p.cols()), |x: &[f32], m, o| p.matmul(x, m, o), self.bias.as_ref()),
            Weight::PackedBf16(p) => return packed(x, (p.rows(), p.cols()), |x: &[half::bf16], m, o| p.matmul(x, m, o), self.bias.as_ref()),
            Weight::PackedF32(p) => return packed(x, (p.rows(), p.cols()), |x: &[f32], m, o| p.matmul(x, m, o), self.bias.as_ref()),
            Weight::Deferred(d) if d.is_bf16() => return packed(x, (d.rows(), d.cols()), |x: &[half::bf16], m, o| d.matmul_bf16(x, m, o), self.bias.as_ref()),
            Weight::Deferred(d) => return packed(x, (d.rows(), d.cols()), |x: &[f32], m, o| d.matmul_f32(x, m, o), self.bias.as_ref()),
            Weight::Candle(QMatMul::Tensor(w)) if let Some(y) = cpu_matvec(x, w)? => y,
            Weight::Candle(QMatMul::Tensor(w)) if let Some(y) = cpu_widened_bf16(x, w)? => y,
            // Dense: fold leading dims into rows and use one plain matmul (a broadcast batched
            // matmul is much slower on both CPU and CUDA), exactly as candle_nn::Linear does.
            Weight::Candle(QMatMul::Tensor(w)) => {
                let dims = x.dims().to_vec();
                let k = *dims.last().unwrap_or(&0);
                if dims.len() > 2 && x.is_contiguous() {
                    let rows: usize = dims[..dims.len() - 1].iter().product();
                    let mut out = dims.clone();
                    *out.last_mut().expect("rank > 2") = w.dim(0)?;
                    x.reshape((rows, k))?.matmul(&w.t()?)?.reshape(out)?
                } else if dims.len() > 2 {
                    x.matmul(&w.broadcast_left(dims[..dims.len() - 2].to_vec())?.t()?)?
                } else {
                    x.matmul(&w.t()?)?
                }
            }
            // Quantized kernels take contiguous f32 (or f16) rows; other dtypes round-trip.
            Weight::Candle(q) => {
                let dt = x.dtype();
                let x32 = if matches!(dt, DType::F32 | DType::F16) { x.contiguous()? } else { x.to_dtype(DType::F32)?.contiguous()? };
                q.forward(&x32)?.to_dtype(dt)?
            }
        };
        match &self.bias {
            None => Ok(y),
            Some(b) => y.broadcast_add(b),
        }
    }
}

/// A layer kept dense whatever the source does (an MoE router: small, and its rounding would
/// flip near-tied expert choices; llama.cpp keeps `ffn_gate_inp` unquantized too).
pub fn linear_dense(in_dim: usize, out_dim: usize, w: Weights) -> Result<Linear> {
    Ok(Linear::new(w.vb().get_with_hints((out_dim, in_dim), "weight", candle_nn::init::DEFAULT_KAIMING_NORMAL)?, None))
}

/// Loads `weight` (and `bias` when `bias` is true) under `w`, checking the shape. A source
/// that holds the weight quantized gives a quantized layer.
pub fn linear(in_dim: usize, out_dim: usize, bias: bool, w: Weights) -> Result<Linear> {
    // The same initialisation hints as candle_nn::linear: file sources ignore them, generated
    // (dummy) weights follow them, so a dummy model is random rather than all zeros.
    let bound = 1. / (in_dim as f64).sqrt();
    let b = match bias {
        true => Some(w.vb().get_with_hints(out_dim, "bias", candle_nn::Init::Uniform { lo: -bound, up: bound })?),
        false => None,
    };
    let want = candle_core::Shape::from((out_dim, in_dim));
    if let Some(m) = w.mapped("weight", &want)? {
        if let Some(l) = Linear::from_mapped(&m, w.dtype(), w.device(), b.clone()) {
            return Ok(l);
        }
    }
    match w.quantized("weight", &want) {
        Some(q) => {
            let q = q?;
            if q.shape() != &want {
                candle_core::bail!("shape mismatch for {}, expected {want:?}, got {:?}", w.vb().prefix(), q.shape());
            }
            Linear::quantized(q, b)
        }
        None => Ok(Linear::new(w.vb().get_with_hints((out_dim, in_dim), "weight", candle_nn::init::DEFAULT_KAIMING_NORMAL)?, b)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    /// Same numbers as candle_nn::Linear for 2-D and 3-D prefill-sized inputs where candle's
    /// gemm runs them (bit for bit), within f32 rounding where a CPU kernel of ours does (the
    /// AVX-512 f32 panels, the decode-sized matvec: they sum in another order), and a Q8_0
    /// weight gives nearly the same product. Seeded.
    #[test]
    fn dense_equals_candle_linear_and_q8_is_close() -> Result<()> {
        use crate::testing::randn;
        let w = randn(1, (64, 32), 1.)?;
        let b = randn(2, 64, 1.)?;
        let ours = Linear::new(w.clone(), Some(b.clone()));
        let theirs = candle_nn::Linear::new(w.clone(), Some(b.clone()));
        for x in [randn(3, (20, 32), 1.)?, randn(4, (2, 9, 32), 1.)?] {
            let (a, b) = (ours.forward(&x)?, theirs.forward(&x)?);
            let d = (&a - &b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            if crate::cpu::fp32::available() {
                let scale = b.abs()?.max_all()?.to_scalar::<f32>()?;
                assert!(d <= 1e-6 * scale, "prefill-sized product differs by {d} (scale {scale})");
            } else {
                assert_eq!(d, 0.0);
            }
        }
        for x in [randn(5, (5, 32), 1.)?, randn(6, (2, 3, 32), 1.)?] {
            let (a, b) = (ours.forward(&x)?, theirs.forward(&x)?);
            let d = (&a - &b)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let scale = b.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(d <= 1e-6 * scale, "decode-sized product differs by {d} (scale {scale})");
        }
        let q = QTensor::quantize(&w, candle_core::quantized::GgmlDType::Q8_0)?;
        let ql = Linear::quantized(Arc::new(q), Some(b))?;
        assert!(ql.is_quantized() && ql.dense_weight().is_none());
        let x = randn(7, (5, 32), 1.)?;
        let want = theirs.forward(&x)?;
        let err = (ql.forward(&x)? - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(err / scale < 2e-2, "q8_0 rel err {}", err / scale);
        assert_eq!(ours.forward(&x)?.dtype(), DType::F32);
        Ok(())
    }

    /// A prefill-sized bf16 product equals the f32 product of the same bf16 values, rounded
    /// once to bf16: 20 and 130 rows (the packed panels where a bf16 kernel runs, widened slab
    /// by slab where none does), several slabs.
    #[test]
    fn bf16_prefill_equals_the_f32_product_of_its_values() -> Result<()> {
        let (n, k) = (300, 4096);
        let w = crate::testing::randn(5, (n, k), 0.05)?.to_dtype(DType::BF16)?;
        let layer = Linear::new(w.clone(), None);
        for m in [20, 130] {
            let x = crate::testing::randn(6, (2, m / 2, k), 1.)?.to_dtype(DType::BF16)?;
            let want = x.to_dtype(DType::F32)?.reshape((m, k))?.matmul(&w.to_dtype(DType::F32)?.t()?)?;
            let got = layer.forward(&x)?;
            assert_eq!(got.dims(), &[2, m / 2, n]);
            let err = (got.to_dtype(DType::F32)?.reshape((m, n))? - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            let scale = want.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(err <= scale / 128.0, "{m} rows: bf16 prefill differs by {err} (scale {scale})");
        }
        Ok(())
    }

    /// Parts whose weights join run as one product; a neighbour of another block type (a
    /// Q4_K_M file's Q8_0 v beside Q5_0 q and k) is a product of its own, the q and k before it
    /// still one. Every part's output equals its own layer's, bit for bit.
    #[test]
    fn neighbours_that_join_are_one_product_and_each_part_is_its_own_layer() -> Result<()> {
        use candle_core::quantized::GgmlDType;
        let k = 64;
        let q = |seed: u64, n: usize, dt: GgmlDType| -> Result<Linear> {
            let w = QTensor::quantize(&crate::testing::randn(seed, (n, k), 0.3)?, dt)?;
            Linear::quantized(Arc::new(w), Some(crate::testing::randn(seed + 100, n, 0.3)?))
        };
        let parts = vec![q(11, 32, GgmlDType::Q5_0)?, q(12, 16, GgmlDType::Q5_0)?, q(13, 16, GgmlDType::Q8_0)?];
        let fused = Fused::new(parts.clone())?;
        // Where a packed kernel holds both types, q and k join and v stands apart; where
        // candle's kernels run them nothing joins.
        let packed = crate::cpu::quant::has_kernel(GgmlDType::Q5_0) && crate::cpu::quant::has_kernel(GgmlDType::Q8_0);
        assert_eq!(fused.products(), if packed { 2 } else { 3 });
        let same = Fused::new(vec![q(14, 16, GgmlDType::Q8_0)?, q(15, 16, GgmlDType::Q8_0)?])?;
        assert_eq!(same.products(), if packed { 1 } else { 2 });
        for rows in [1, 5] {
            let x = crate::testing::randn(16 + rows as u64, (rows, k), 1.)?;
            let outs = fused.forward(&x)?;
            assert_eq!(outs.len(), 3);
            for (i, (o, p)) in outs.iter().zip(&parts).enumerate() {
                let (got, want) = (o.to_vec2::<f32>()?, p.forward(&x)?.to_vec2::<f32>()?);
                assert_eq!(got, want, "{rows} rows: part {i}");
            }
        }
        Ok(())
    }

    /// Dummy weights give a random layer, not zeros (benchmarks depend on it).
    #[test]
    fn dummy_linear_is_random() -> Result<()> {
        let l = linear(32, 16, false, Weights::dummy(DType::F32, &Device::Cpu))?;
        // The product with the identity is the weight's transpose, however it is held.
        let w = l.forward(&Tensor::eye(32, DType::F32, &Device::Cpu)?)?;
        let std = w.sqr()?.mean_all()?.to_scalar::<f32>()?.sqrt();
        assert!(std > 1e-3, "weight std {std}");
        Ok(())
    }
}
