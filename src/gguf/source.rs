//! GGUF files as a `WeightSource`: model code asks for transformers names, `names::locate`
//! says where llama.cpp put them, and this file reads and un-transforms them. Linear weights
//! stored in a block format come out as candle quantized tensors, untouched (rows permuted
//! where Qwen3.5's converter reordered them), so the matmuls run on the file's own blocks.
//! Everything else is dequantized to the compute dtype.

use std::sync::Arc;

use candle_core::quantized::{ggml_file, GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor, D};

use super::file::GgufFile;
use super::names::{self, Arch, Heads, Layout, Located, Part, Permute, Value};
use crate::weights::{Expect, Mapped, WeightSource};

pub struct GgufWeights {
    text: GgufFile,
    vision: Option<GgufFile>,
    arch: Arch,
    heads: Heads,
    /// The tower layers the DeepStack mergers read, in merger order.
    deepstack: Vec<usize>,
    /// The projector's tower names `mlp.fc1` `ffn_down` and `mlp.fc2` `ffn_up` (the legacy
    /// LLaVA converter's naming; see `swapped_ffn`).
    swap_ffn: bool,
}

fn is_float(t: GgmlDType) -> bool {
    matches!(t, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)
}

impl GgufWeights {
    pub fn new(text: GgufFile, vision: Option<GgufFile>, arch: Arch, heads: Heads, deepstack: Vec<usize>) -> Self {
        let swap_ffn = vision.as_ref().is_some_and(swapped_ffn);
        GgufWeights { text, vision, arch, heads, deepstack, swap_ffn }
    }

    /// What loading the weights takes (`gguf::load_cost`).
    pub fn load_cost(&self, dense_bytes: f64, gpu: bool) -> crate::memory::LoadCost {
        super::load_cost(&self.text, self.vision.as_ref(), dense_bytes, gpu)
    }

    fn file(&self, part: Part) -> Option<&GgufFile> {
        match part {
            Part::Text => Some(&self.text),
            Part::Vision => self.vision.as_ref(),
        }
    }

    /// The location of `name` with every stored tensor it needs present.
    fn find(&self, name: &str) -> Option<(Located, Vec<String>)> {
        let mut loc = names::locate(name, self.arch, self.heads, self.text.info("output.weight").is_some())?;
        let file = self.file(loc.part)?;
        if let Layout::Same(s) = &loc.layout {
            if self.swap_ffn && loc.part == Part::Vision {
                let swapped = s.replace(".ffn_up.", ".ffn_X.").replace(".ffn_down.", ".ffn_up.").replace(".ffn_X.", ".ffn_down.");
                loc.layout = Layout::Same(swapped);
            }
        }
        if let Layout::Same(s) = &loc.layout {
            if let Some(rest) = s.strip_prefix("v.deepstack.@") {
                let (idx, tail) = rest.split_once('.')?;
                let layer = self.deepstack.get(idx.parse::<usize>().ok()?)?;
                loc.layout = Layout::Same(format!("v.deepstack.{layer}.{tail}"));
            }
        }
        let parts = match &loc.layout {
            Layout::Same(s) | Layout::Swap12(s) | Layout::Column(s) => vec![s.clone()],
            Layout::Temporal(a, b) | Layout::GateUp(a, b) => vec![a.clone(), b.clone()],
            // The fused name when the converter kept it, else the three parts.
            Layout::Rows(v) if file.info(&v[0]).is_some() => vec![v[0].clone()],
            Layout::Rows(v) => v[1..].to_vec(),
        };
        parts.iter().all(|p| file.info(p).is_some()).then_some((loc, parts))
    }

    fn dense(&self, file: &GgufFile, tensor: &str) -> candle_core::Result<Tensor> {
        file.dense(tensor)?.to_dtype(DType::F32)
    }

    /// The transformers tensor on the host: a stored float tensor taken as it is keeps its
    /// type (one copy, no widening on the way to a bf16 model); anything else in f32.
    fn load(&self, loc: &Located, parts: &[String]) -> candle_core::Result<Tensor> {
        let file = self.file(loc.part).expect("found");
        let t = match &loc.layout {
            Layout::Same(_) if parts.len() == 1 && loc.value.is_none() => file.dense(&parts[0])?,
            Layout::Same(_) if parts.len() == 1 => self.dense(file, &parts[0])?,
            Layout::Rows(_) | Layout::Same(_) => Tensor::cat(&parts.iter().map(|p| self.dense(file, p)).collect::<candle_core::Result<Vec<_>>>()?, 0)?,
            Layout::Temporal(..) => Tensor::stack(&[self.dense(file, &parts[0])?, self.dense(file, &parts[1])?], 2)?,
            Layout::GateUp(..) => {
                let g = self.dense(file, &parts[0])?.transpose(1, 2)?;
                let u = self.dense(file, &parts[1])?.transpose(1, 2)?;
                Tensor::cat(&[g, u], D::Minus1)?.contiguous()?
            }
            Layout::Swap12(_) => self.dense(file, &parts[0])?.transpose(1, 2)?.contiguous()?,
            Layout::Column(_) => self.dense(file, &parts[0])?.flatten_all()?,
        };
        let t = match loc.permute {
            Some(p) => permute(&t, p)?,
            None => t,
        };
        let t = match loc.value {
            Some(Value::MinusOne) => (t - 1.0)?,
            Some(Value::LogNeg) => t.neg()?.log()?,
            None => t,
        };
        if loc.unsqueeze1 {
            t.unsqueeze(1)
        } else {
            Ok(t)
        }
    }
}

/// Whether a projector's tower uses the legacy LLaVA converter's swapped MLP names: its
/// `ffn_down` widens (`[mlp, width]`, what transformers calls `fc1`). llama.cpp's clip loader
/// swaps them back by the same test.
fn swapped_ffn(mm: &GgufFile) -> bool {
    let width = mm.meta("clip.vision.embedding_length").and_then(|v| v.to_u32().ok()).map(|w| w as usize);
    let down = mm.info("v.blk.0.ffn_down.weight").map(|t| t.dims.clone());
    matches!((width, down), (Some(w), Some(d)) if d.len() == 2 && d[1] == w && d[0] != w)
}

/// Undoes a converter's reordering along `p.dim()`.
fn permute(t: &Tensor, p: Permute) -> candle_core::Result<Tensor> {
    let idx: Vec<u32> = p.source_index(t.dim(p.dim())?).into_iter().map(|i| i as u32).collect();
    let idx = Tensor::new(idx, t.device())?;
    t.index_select(&idx, p.dim())
}

/// A quantized tensor's rows permuted (blocks never cross rows, so whole rows move).
fn permute_rows(q: &QTensor, u: Permute, dev: &Device) -> candle_core::Result<QTensor> {
    let dims = q.shape().dims().to_vec();
    let data = q.data()?;
    let row = data.len() / dims[0];
    let mut out = Vec::with_capacity(data.len());
    for src in u.source_index(dims[0]) {
        out.extend_from_slice(&data[src * row..(src + 1) * row]);
    }
    ggml_file::qtensor_from_ggml(q.dtype(), &out, dims, dev)
}

impl WeightSource for GgufWeights {
    fn release_mappings(&self) {
        self.text.release_all();
        if let Some(v) = &self.vision {
            v.release_all();
        }
    }

    fn describe(&self) -> String {
        match &self.vision {
            Some(v) => format!("{}, {}", self.text.name(), v.name()),
            None => self.text.name(),
        }
    }

    fn contains(&self, name: &str) -> bool {
        self.find(name).is_some()
    }

    fn tensor_count(&self) -> Option<usize> {
        Some(self.text.header.tensors.len() + self.vision.as_ref().map_or(0, |v| v.header.tensors.len()))
    }

    fn stored_name(&self, name: &str) -> Option<String> {
        self.find(name).map(|(_, parts)| parts.join(" + "))
    }

    fn tensor(&self, name: &str, expect: Option<Expect>, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let Some((loc, parts)) = self.find(name) else {
            let file = names::locate(name, self.arch, self.heads, true).map(|l| l.part);
            let wher = match file.and_then(|p| self.file(p)) {
                Some(f) => f.name(),
                None if file == Some(Part::Vision) => "the vision projector (no mmproj file was given)".into(),
                None => self.describe(),
            };
            candle_core::bail!("cannot find tensor {name} in {wher}")
        };
        let t = self.load(&loc, &parts)?;
        if let Some(e) = expect {
            if t.shape() != e.shape {
                candle_core::bail!("shape mismatch for {name} ({}), expected {:?}, got {:?}", parts.join(" + "), e.shape, t.shape());
            }
        }
        t.to_dtype(dtype)?.to_device(dev)
    }

    fn mapped(&self, name: &str) -> Option<Mapped> {
        let (loc, parts) = self.find(name)?;
        let plain = matches!(loc.layout, Layout::Same(_)) && parts.len() == 1 && loc.permute.is_none() && loc.value.is_none() && !loc.unsqueeze1;
        if !plain {
            return None;
        }
        self.file(loc.part)?.mapped(&parts[0])
    }

    fn quantized(&self, name: &str, _expect: Option<Expect>, dev: &Device) -> Option<candle_core::Result<Arc<QTensor>>> {
        let (loc, parts) = self.find(name)?;
        let file = self.file(loc.part)?;
        let dtype = file.info(&parts[0])?.dtype;
        if is_float(dtype) || !matches!(loc.layout, Layout::Same(_)) || loc.value.is_some() || loc.unsqueeze1 {
            return None;
        }
        match loc.permute {
            None => Some(file.qtensor(&parts[0], dev).map(Arc::new)),
            Some(p) if p.dim() == 0 => Some(file.qtensor(&parts[0], &Device::Cpu).and_then(|q| permute_rows(&q, p, dev)).map(Arc::new)),
            // Columns cross blocks: dequantized (dense) instead.
            Some(_) => None,
        }
    }
}
