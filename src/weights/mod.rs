//! Where weights come from. A `WeightSource` answers "give me tensor `name`" (float, or
//! quantized where the source holds quantized blocks); `Weights` is the prefix-carrying handle
//! that model code loads from (`weights.pp("layers").pp(3)`), usable as a candle `VarBuilder`
//! for candle's own layer builders.
//!
//! Sources today: memory-mapped (sharded) safetensors, and dummy random weights for any config
//! (benchmarks). GGUF files and in-situ quantization plug in as further sources: a source that
//! returns `Some` from `quantized` makes every `layers::linear` under it quantized, with no
//! change to model code.

mod dummy;
pub mod ledger;
pub mod mapped;
mod quantize;
pub mod safetensors;

use std::sync::Arc;

use anyhow::Result;
use candle_core::quantized::QTensor;
use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder};

pub use self::dummy::DummyWeights;
pub use self::ledger::{Ledger, LedgerSource, TypeCount};
pub use self::mapped::Mapped;
pub use self::quantize::{Quant, QuantStats, QuantizingSource};
pub use self::safetensors::{index_shards, SafetensorsWeights};

/// What a model asks of a tensor: its shape and how a file-less source should initialise it.
#[derive(Clone, Copy, Debug)]
pub struct Expect<'a> {
    pub shape: &'a Shape,
    pub init: Init,
}

pub trait WeightSource: Send + Sync {
    /// Names the source in errors ("a.safetensors, b.safetensors", "dummy weights").
    fn describe(&self) -> String;
    fn contains(&self, name: &str) -> bool;
    /// Tensors the source holds, when it knows (a file's tensor table): the total a
    /// loading progress counts against.
    fn tensor_count(&self) -> Option<usize> {
        None
    }
    /// Where the source keeps tensor `name`, when it names it otherwise (a GGUF file's
    /// `blk.0.attn_q.weight`), for reports.
    fn stored_name(&self, _name: &str) -> Option<String> {
        None
    }
    /// A float tensor converted to `dtype` on `dev`. `expect` is absent when the caller takes
    /// whatever shape is stored; file sources check it, generated sources create from it.
    fn tensor(&self, name: &str, expect: Option<Expect>, dtype: DType, dev: &Device) -> candle_core::Result<Tensor>;
    /// The tensor in a quantized block format, when the source holds (or makes) it so.
    /// Asked only for linear weights; `expect` carries their `[out, in]` shape.
    fn quantized(&self, _name: &str, _expect: Option<Expect>, _dev: &Device) -> Option<candle_core::Result<Arc<QTensor>>> {
        None
    }
    /// Linear weight `name` as it lies in a mapped file, when the source stores it under that
    /// name untransformed and would hand it out as stored (a quantizing source: only when
    /// already in blocks). The CPU kernels repack it from there, with no copy between.
    fn mapped(&self, _name: &str) -> Option<Mapped> {
        None
    }
    /// An embedding table `name` as it lies in a mapped file (rows are looked up there).
    fn rows(&self, name: &str) -> Option<Mapped> {
        self.mapped(name)
    }
    /// Drops this process's pages of the source's mapped files (the page cache keeps them),
    /// once the model is loaded: every tensor has its own home by then, except embedding rows,
    /// which are read in place and fault back in. The kernel maps a page-cache folio whole on a
    /// fault (up to 2 MiB), so copying one tensor maps its neighbours' pages too, after their
    /// own release; without this they stay counted beside their copies.
    fn release_mappings(&self) {}
    /// A linear weight the model cut from a stored tensor (an expert of a fused MoE tensor),
    /// quantized the way this source quantizes its own linear weights; `None` keeps it dense.
    /// `name` is where it came from.
    fn quantize_derived(&self, _name: &str, _weight: &Tensor, _dev: &Device) -> Option<candle_core::Result<Arc<QTensor>>> {
        None
    }
}

/// A source as a candle backend, so `candle_nn` builders (norms, embeddings) load through it.
struct Backend(Arc<dyn WeightSource>, Option<Arc<Taking>>);

impl SimpleBackend for Backend {
    fn get(&self, s: Shape, name: &str, init: Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        taken(&self.1, &*self.0, name);
        let t = self.0.tensor(name, Some(Expect { shape: &s, init }), dtype, dev)?;
        if t.shape() != &s {
            candle_core::bail!("shape mismatch for {name}, expected {s:?}, got {:?} in {}", t.shape(), self.0.describe());
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        taken(&self.1, &*self.0, name);
        self.0.tensor(name, None, dtype, dev)
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.0.contains(name)
    }
}

/// Loading progress: each distinct tensor the model takes advances the task by one (a tied
/// head asks for the embedding again; it is not loaded twice).
struct Taking {
    task: Arc<crate::progress::Task>,
    names: std::sync::Mutex<std::collections::HashSet<String>>,
}

/// Counts `name` once, if the source holds it (a probe for an optional tensor is no progress).
fn taken(taking: &Option<Arc<Taking>>, source: &dyn WeightSource, name: &str) {
    if let Some(t) = taking.as_ref().filter(|_| source.contains(name)) {
        if t.names.lock().map(|mut n| n.insert(name.to_string())).unwrap_or(false) {
            t.task.advance(1);
        }
    }
}

/// A position in a weight source: prefix, dtype and device, like candle's `VarBuilder`, plus
/// access to quantized tensors.
#[derive(Clone)]
pub struct Weights {
    vb: VarBuilder<'static>,
    source: Arc<dyn WeightSource>,
    taking: Option<Arc<Taking>>,
}

impl Weights {
    pub fn new(source: Arc<dyn WeightSource>, dtype: DType, device: &Device) -> Self {
        Self::build(source, dtype, device, None)
    }

    fn build(source: Arc<dyn WeightSource>, dtype: DType, device: &Device, taking: Option<Arc<Taking>>) -> Self {
        let vb = VarBuilder::from_backend(Box::new(Backend(source.clone(), taking.clone())), dtype, device.clone());
        Weights { vb, source, taking }
    }

    /// The same weights, counting each tensor the model takes as progress of `task` (whose
    /// total is `tensor_count`).
    pub fn tracked(self, task: Arc<crate::progress::Task>) -> Self {
        let taking = Arc::new(Taking { task, names: Default::default() });
        Self::build(self.source.clone(), self.dtype(), self.device(), Some(taking))
    }

    /// `WeightSource::release_mappings` of the source.
    pub fn release_mappings(&self) {
        self.source.release_mappings()
    }

    /// Tensors the source holds, when it knows.
    pub fn tensor_count(&self) -> Option<usize> {
        self.source.tensor_count()
    }

    /// Memory-mapped safetensors shards, validated first (see `SafetensorsWeights::open`).
    pub fn safetensors(files: &[std::path::PathBuf], dtype: DType, device: &Device) -> Result<Self> {
        Ok(Self::new(Arc::new(SafetensorsWeights::open(files)?), dtype, device))
    }

    /// Random weights of whatever shapes the model asks for.
    pub fn dummy(dtype: DType, device: &Device) -> Self {
        Self::new(Arc::new(DummyWeights::new(0.02)), dtype, device)
    }

    pub fn pp(&self, s: impl ToString) -> Self {
        Weights { vb: self.vb.pp(s), source: self.source.clone(), taking: self.taking.clone() }
    }

    /// The same position as a candle `VarBuilder` (for candle_nn's builders).
    pub fn vb(&self) -> &VarBuilder<'static> {
        &self.vb
    }

    pub fn get(&self, shape: impl Into<Shape>, name: &str) -> candle_core::Result<Tensor> {
        self.vb.get(shape, name)
    }

    /// Whether `name` (relative to this position) is in the source.
    pub fn contains(&self, name: &str) -> bool {
        self.vb.contains_tensor(name)
    }

    /// Linear weight `name` (relative) of `shape` in a quantized format, when the source
    /// holds or makes it so.
    pub fn quantized(&self, name: &str, shape: &Shape) -> Option<candle_core::Result<Arc<QTensor>>> {
        let expect = Expect { shape, init: candle_nn::init::DEFAULT_KAIMING_NORMAL };
        let full = self.full(name);
        taken(&self.taking, &*self.source, &full);
        self.source.quantized(&full, Some(expect), self.vb.device())
    }

    /// Linear weight `name` (relative) as stored in a mapped file, checked to be `shape`.
    pub fn mapped(&self, name: &str, shape: &Shape) -> candle_core::Result<Option<Mapped>> {
        taken(&self.taking, &*self.source, &self.full(name));
        self.checked(self.source.mapped(&self.full(name)), name, shape)
    }

    /// Embedding table `name` (relative) as stored in a mapped file, checked to be `shape`.
    pub fn rows(&self, name: &str, shape: &Shape) -> candle_core::Result<Option<Mapped>> {
        taken(&self.taking, &*self.source, &self.full(name));
        self.checked(self.source.rows(&self.full(name)), name, shape)
    }

    /// `name` under this position's prefix, as the source names it.
    fn full(&self, name: &str) -> String {
        let prefix = self.vb.prefix();
        if prefix.is_empty() { name.to_string() } else { format!("{prefix}.{name}") }
    }

    fn checked(&self, m: Option<Mapped>, name: &str, shape: &Shape) -> candle_core::Result<Option<Mapped>> {
        match m {
            Some(m) if m.dims != shape.dims() => {
                let full = self.full(name);
                let stored = self.source.stored_name(&full).map(|s| format!(" ({s})")).unwrap_or_default();
                candle_core::bail!("shape mismatch for {full}{stored}, expected {shape:?}, got {:?} in {}", m.dims, self.describe())
            }
            m => Ok(m),
        }
    }

    /// `weight` `[out, in]`, cut by the model from tensor `name` (relative), quantized as
    /// this source's linear weights are (`None`: stays dense).
    pub fn quantize_derived(&self, name: &str, weight: &Tensor) -> Option<candle_core::Result<Arc<QTensor>>> {
        self.source.quantize_derived(&self.full(name), weight, self.vb.device())
    }

    /// The same weights with linear layers quantized to `quant` as they load (the vision
    /// tower too when `vision`). The statistics fill in as the model loads.
    pub fn quantize(self, quant: Quant, vision: bool) -> (Self, Arc<QuantStats>) {
        let src = QuantizingSource::new(self.source.clone(), quant, vision);
        let stats = src.stats.clone();
        (Self::build(Arc::new(src), self.dtype(), self.device(), self.taking.clone()), stats)
    }

    /// The same weights, writing what the model takes into the returned `Ledger` (install it
    /// last, over any quantizing source, so it sees the form the layers get).
    pub fn recorded(self) -> (Self, Arc<Ledger>) {
        let src = LedgerSource::new(self.source.clone());
        let ledger = src.ledger.clone();
        (Self::build(Arc::new(src), self.dtype(), self.device(), self.taking.clone()), ledger)
    }

    pub fn describe(&self) -> String {
        self.source.describe()
    }

    pub fn device(&self) -> &Device {
        self.vb.device()
    }

    pub fn dtype(&self) -> DType {
        self.vb.dtype()
    }
}

/// Parses a user-facing dtype name.
pub fn parse_dtype(name: &str) -> Result<DType> {
    Ok(match name.to_ascii_lowercase().as_str() {
        "f32" | "float32" => DType::F32,
        "f16" | "float16" | "half" => DType::F16,
        "bf16" | "bfloat16" => DType::BF16,
        _ => return Err(crate::setting::InvalidSetting::new("dtype", name, "f32, f16 or bf16").into()),
    })
}

/// Default compute dtype: bf16 on CUDA (what the checkpoints ship), f32 on CPU (candle's CPU
/// kernels are fastest and exact there).
pub fn default_dtype(device: &Device) -> DType {
    if device.is_cuda() {
        DType::BF16
    } else {
        DType::F32
    }
}

pub fn file_names(files: &[std::path::PathBuf]) -> String {
    files.iter().map(|f| f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default()).collect::<Vec<_>>().join(", ")
}
