//! What a model took from its weight source, tensor by tensor, in the form it holds it: dense
//! in a dtype, or in a block format. Counting from this rather than from the config is what
//! makes `merg bench`'s bytes per decode step true for any source: a GGUF file's mix of
//! types, in-situ quantization with its Q8_0 fallbacks, a tied head's own quantized copy, MoE
//! experts that a source dequantizes.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use serde::Serialize;

use super::{Expect, Mapped, WeightSource};

/// Tensors of one type and their bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TypeCount {
    pub tensors: usize,
    pub bytes: u64,
}

impl TypeCount {
    pub fn add(&mut self, bytes: u64) {
        self.tensors += 1;
        self.bytes += bytes;
    }
}

/// A ggml type in lower case, as llama.cpp's file names spell it (`q4_k`, `bf16`).
pub fn type_name(t: GgmlDType) -> &'static str {
    match t {
        GgmlDType::F32 => "f32",
        GgmlDType::F16 => "f16",
        GgmlDType::BF16 => "bf16",
        GgmlDType::Q4_0 => "q4_0",
        GgmlDType::Q4_1 => "q4_1",
        GgmlDType::Q5_0 => "q5_0",
        GgmlDType::Q5_1 => "q5_1",
        GgmlDType::Q8_0 => "q8_0",
        GgmlDType::Q8_1 => "q8_1",
        GgmlDType::Q2K => "q2_k",
        GgmlDType::Q3K => "q3_k",
        GgmlDType::Q4K => "q4_k",
        GgmlDType::Q5K => "q5_k",
        GgmlDType::Q6K => "q6_k",
        GgmlDType::Q8K => "q8_k",
    }
}

/// How the model holds one source tensor.
#[derive(Clone, Debug, Default)]
pub struct Taken {
    /// Where the source keeps it, when it names it otherwise (a GGUF file's `blk.0.attn_q.weight`).
    pub stored: Option<String>,
    /// Dense: its dims and dtype.
    pub dense: Option<(Vec<usize>, DType)>,
    /// In blocks: each piece's type and values (several for MoE experts cut from one tensor).
    pub blocks: Vec<(GgmlDType, usize)>,
    /// An embedding table whose rows are looked up where the file stores them: their type
    /// and width (a step reads a row's bytes in that type).
    pub lookup: Option<(GgmlDType, usize)>,
}

fn block_bytes(t: GgmlDType, values: usize) -> u64 {
    (values / t.block_size() * t.type_size()) as u64
}

impl Taken {
    fn dense_bytes(&self) -> u64 {
        self.dense.as_ref().map_or(0, |(dims, dt)| (dims.iter().product::<usize>() * dt.size_in_bytes()) as u64)
    }

    fn blocks_bytes(&self) -> u64 {
        self.blocks.iter().map(|&(t, n)| block_bytes(t, n)).sum()
    }

    /// Bytes of the form the layers compute with: the blocks when the tensor was quantized
    /// (a dense original is dropped once its blocks are made), else the dense tensor.
    fn held_bytes(&self) -> u64 {
        if self.blocks.is_empty() {
            self.dense_bytes()
        } else {
            self.blocks_bytes()
        }
    }

    fn values(&self) -> u64 {
        match self.blocks.is_empty() {
            true => self.dense.as_ref().map_or(0, |(d, _)| d.iter().product::<usize>() as u64),
            false => self.blocks.iter().map(|&(_, n)| n as u64).sum(),
        }
    }
}

/// Whether a tensor belongs to a media tower or its projector rather than the text model, in
/// every family's hub layout: Qwen's `visual.*` (`model.visual.*`, `thinker.visual.*`),
/// LLaVA-NeXT's and Gemma 3's `vision_tower.*` and `multi_modal_projector.*` (and LLaVA's
/// `image_newline`), Qwen2.5-Omni's `audio_tower.*`. `--quant` leaves these dense unless the
/// towers are asked for too, as `merg plan` counts them.
pub(crate) fn is_vision(name: &str) -> bool {
    const TOWERS: [&str; 4] = ["visual.", "vision_tower.", "multi_modal_projector.", "audio_tower."];
    TOWERS.iter().any(|t| name.starts_with(t) || name.contains(&format!(".{t}"))) || name == "image_newline" || name.ends_with(".image_newline")
}

fn is_embedding(name: &str) -> bool {
    name.ends_with("embed_tokens.weight")
}

fn is_expert(name: &str) -> bool {
    name.contains(".mlp.experts.")
}

/// Every tensor a model took, by the name it asked for.
#[derive(Default, Debug)]
pub struct Ledger(Mutex<BTreeMap<String, Taken>>);

impl Ledger {
    fn update(&self, name: &str, stored: Option<String>, f: impl FnOnce(&mut Taken)) {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let entry = map.entry(name.to_string()).or_default();
        entry.stored = entry.stored.take().or(stored);
        f(entry);
    }

    /// The text model's tensors (the vision tower left out), in name order.
    pub fn text(&self) -> Vec<(String, Taken)> {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.iter().filter(|(n, _)| !is_vision(n)).map(|(n, t)| (n.clone(), t.clone())).collect()
    }

    /// Bytes of the text model's weights one decode step reads: every layer's tensors as held,
    /// MoE experts scaled to the active ones (`idle_expert_values` of their values are not
    /// read), the output head, and one embedding row (as the lookup reads it); the head is the
    /// embedding table when `tied_head` (its quantized copy when one was made).
    pub fn decode_bytes(&self, tied_head: bool, idle_expert_values: u64) -> f64 {
        let (mut other, mut experts, mut expert_values) = (0u64, 0u64, 0u64);
        for (name, t) in self.text() {
            if is_embedding(&name) {
                let row = match (t.lookup, &t.dense) {
                    (Some((ty, width)), _) => block_bytes(ty, width) as usize,
                    (None, Some((dims, dt))) => dims.last().copied().unwrap_or(0) * dt.size_in_bytes(),
                    (None, None) => 0,
                } as u64;
                other += row + if tied_head { t.held_bytes() } else { 0 };
            } else if is_expert(&name) {
                experts += t.held_bytes();
                expert_values += t.values();
            } else {
                other += t.held_bytes();
            }
        }
        let active = 1.0 - (idle_expert_values as f64 / expert_values.max(1) as f64).clamp(0.0, 1.0);
        other as f64 + experts as f64 * active
    }

    /// The text model's tensors by the type they are held in (a tied head's quantized copy
    /// counts beside the dense embedding table it was made from, which the lookup keeps).
    pub fn types(&self) -> BTreeMap<String, TypeCount> {
        let mut out = BTreeMap::<String, TypeCount>::new();
        for (name, t) in self.text() {
            if let Some((_, dt)) = t.dense.as_ref().filter(|_| t.blocks.is_empty() || is_embedding(&name)) {
                out.entry(format!("{dt:?}").to_lowercase()).or_default().add(t.dense_bytes());
            }
            for &(bt, n) in &t.blocks {
                out.entry(type_name(bt).into()).or_default().add(block_bytes(bt, n));
            }
        }
        out
    }

    /// Block-quantized pieces the model holds (vision tower included) and their bytes.
    pub fn blocks_total(&self) -> (usize, u64) {
        let map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        map.values().fold((0, 0), |(n, b), t| (n + t.blocks.len(), b + t.blocks_bytes()))
    }

    /// Text tensors held in a block type that `has_kernel` says no packed kernel runs, by
    /// their stored name, with that type.
    pub fn without_kernel(&self, has_kernel: impl Fn(GgmlDType) -> bool) -> Vec<(String, GgmlDType)> {
        let mut out: Vec<(String, GgmlDType)> = vec![];
        for (name, t) in self.text() {
            let name = t.stored.clone().unwrap_or(name);
            for &(bt, _) in &t.blocks {
                if !has_kernel(bt) && !out.iter().any(|(n, b)| *n == name && *b == bt) {
                    out.push((name.clone(), bt));
                }
            }
        }
        out
    }
}

/// A source that writes what it hands out into a `Ledger`.
pub struct LedgerSource {
    inner: Arc<dyn WeightSource>,
    pub ledger: Arc<Ledger>,
}

impl LedgerSource {
    pub fn new(inner: Arc<dyn WeightSource>) -> Self {
        LedgerSource { inner, ledger: Arc::default() }
    }

    fn blocks(&self, name: &str, q: Option<candle_core::Result<Arc<QTensor>>>, replace: bool) -> Option<candle_core::Result<Arc<QTensor>>> {
        if let Some(Ok(t)) = &q {
            let piece = (t.dtype(), t.shape().elem_count());
            self.ledger.update(name, self.inner.stored_name(name), |e| {
                if replace {
                    e.blocks.clear();
                }
                e.blocks.push(piece);
            });
        }
        q
    }

    /// Records a tensor handed out as stored: blocks as blocks, floats as dense.
    fn record(&self, name: &str, m: Option<Mapped>) -> Option<Mapped> {
        if let Some(m) = &m {
            let stored = self.inner.stored_name(name);
            match super::mapped::float_dtype(m.dtype) {
                Some(dt) => self.ledger.update(name, stored, |e| e.dense = Some((m.dims.clone(), dt))),
                None => self.ledger.update(name, stored, |e| {
                    e.blocks.clear();
                    e.blocks.push((m.dtype, m.dims.iter().product()));
                }),
            }
        }
        m
    }
}

impl WeightSource for LedgerSource {
    fn release_mappings(&self) {
        self.inner.release_mappings()
    }

    fn describe(&self) -> String {
        self.inner.describe()
    }

    fn contains(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    fn tensor_count(&self) -> Option<usize> {
        self.inner.tensor_count()
    }

    fn stored_name(&self, name: &str) -> Option<String> {
        self.inner.stored_name(name)
    }

    fn tensor(&self, name: &str, expect: Option<Expect>, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self.inner.tensor(name, expect, dtype, dev)?;
        let dense = (t.dims().to_vec(), t.dtype());
        self.ledger.update(name, self.inner.stored_name(name), |e| e.dense = Some(dense));
        Ok(t)
    }

    fn quantized(&self, name: &str, expect: Option<Expect>, dev: &Device) -> Option<candle_core::Result<Arc<QTensor>>> {
        let q = self.inner.quantized(name, expect, dev);
        self.blocks(name, q, true)
    }

    fn mapped(&self, name: &str) -> Option<Mapped> {
        self.record(name, self.inner.mapped(name))
    }

    fn rows(&self, name: &str) -> Option<Mapped> {
        let m = self.record(name, self.inner.rows(name))?;
        let row = (m.dtype, m.dims.last().copied().unwrap_or(0));
        self.ledger.update(name, None, |e| e.lookup = Some(row));
        Some(m)
    }

    fn quantize_derived(&self, name: &str, weight: &Tensor, dev: &Device) -> Option<candle_core::Result<Arc<QTensor>>> {
        // Each expert is one piece cut from the same stored tensor.
        let q = self.inner.quantize_derived(name, weight, dev);
        self.blocks(name, q, false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use GgmlDType::*;

    fn dense(l: &Ledger, name: &str, dims: &[usize], dt: DType) {
        l.update(name, None, |e| e.dense = Some((dims.to_vec(), dt)));
    }

    fn blocks(l: &Ledger, name: &str, stored: &str, t: GgmlDType, values: usize) {
        l.update(name, Some(stored.into()), |e| e.blocks.push((t, values)));
    }

    /// A two-tensor layer, a norm, an embedding and a vision tensor.
    fn model(tied_quantized_head: bool) -> Ledger {
        let l = Ledger::default();
        blocks(&l, "model.layers.0.self_attn.q_proj.weight", "blk.0.attn_q.weight", Q4K, 256 * 256); // 144 B a block
        dense(&l, "model.layers.0.mlp.down_proj.weight", &[256, 512], DType::BF16);
        dense(&l, "model.norm.weight", &[256], DType::F32);
        dense(&l, "model.embed_tokens.weight", &[1000, 256], DType::F32);
        if tied_quantized_head {
            blocks(&l, "model.embed_tokens.weight", "token_embd.weight", Q6K, 1000 * 256); // 210 B a block
        }
        dense(&l, "visual.blocks.0.attn.qkv.weight", &[96, 32], DType::F32);
        l
    }

    /// Every family's towers and projectors are told from its text model by name.
    #[test]
    fn towers_of_every_family_are_not_text() {
        for tower in [
            "visual.blocks.0.attn.qkv.weight",
            "model.visual.merger.mlp.0.weight",
            "thinker.visual.blocks.0.mlp.up_proj.weight",
            "thinker.audio_tower.layers.0.fc1.weight",
            "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight",
            "model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight",
            "multi_modal_projector.linear_1.weight",
            "model.multi_modal_projector.mm_input_projection_weight",
            "image_newline",
            "model.image_newline",
        ] {
            assert!(is_vision(tower), "{tower}");
        }
        for text in ["model.layers.0.self_attn.q_proj.weight", "language_model.model.layers.0.mlp.gate_proj.weight", "thinker.model.layers.0.mlp.down_proj.weight", "lm_head.weight", "model.language_model.embed_tokens.weight"] {
            assert!(!is_vision(text), "{text}");
        }
    }

    #[test]
    fn decode_reads_each_layer_the_head_and_one_embedding_row() {
        let layer = (256 * 144 + 256 * 512 * 2 + 256 * 4) as f64;
        let row = (256 * 4) as f64;
        // Untied: the head is elsewhere; of the embedding only the looked-up row.
        assert_eq!(model(false).decode_bytes(false, 0), layer + row);
        // Tied, dense: the head streams the whole f32 table.
        assert_eq!(model(false).decode_bytes(true, 0), layer + row + (1000 * 256 * 4) as f64);
        // Tied, quantized head: its blocks, and the row from the dense table.
        assert_eq!(model(true).decode_bytes(true, 0), layer + row + (1000 * 210) as f64);
    }

    #[test]
    fn experts_count_by_the_share_that_runs() {
        let l = Ledger::default();
        // Four experts fused in one dense tensor, cut into Q8_0 pieces (34 B per 32 values).
        dense(&l, "model.layers.0.mlp.experts.gate_up_proj", &[4, 64, 64], DType::F32);
        for _ in 0..8 {
            blocks(&l, "model.layers.0.mlp.experts.gate_up_proj", "blk.0.ffn_gate_exps.weight", Q8_0, 64 * 32);
        }
        dense(&l, "model.layers.0.mlp.gate.weight", &[4, 64], DType::F32);
        let all = (4 * 64 * 64 / 32 * 34) as f64;
        let router = (4 * 64 * 4) as f64;
        // Top-1 of 4: three quarters of the expert values idle; the router is read whole.
        assert_eq!(l.decode_bytes(false, 3 * 64 * 64), all / 4.0 + router);
        assert_eq!(l.decode_bytes(false, 0), all + router);
    }

    #[test]
    fn types_and_tensors_without_a_kernel() {
        let l = model(true);
        let t = l.types();
        assert_eq!(t["q4_k"], TypeCount { tensors: 1, bytes: 256 * 144 });
        assert_eq!(t["q6_k"], TypeCount { tensors: 1, bytes: 1000 * 210 });
        assert_eq!(t["bf16"], TypeCount { tensors: 1, bytes: 256 * 512 * 2 });
        // The norm and the embedding table the lookup keeps; the vision tensor left out.
        assert_eq!(t["f32"], TypeCount { tensors: 2, bytes: 256 * 4 + 1000 * 256 * 4 });
        assert_eq!(l.blocks_total(), (2, 256 * 144 + 1000 * 210));
        let none = l.without_kernel(|_| false);
        assert_eq!(none, vec![("token_embd.weight".to_string(), Q6K), ("blk.0.attn_q.weight".to_string(), Q4K)]);
        assert_eq!(l.without_kernel(|t| t == Q4K), vec![("token_embd.weight".to_string(), Q6K)]);
    }

    /// Through the source: dense requests and quantized answers land in the ledger.
    #[test]
    fn the_source_records_what_it_hands_out() -> candle_core::Result<()> {
        let inner = Arc::new(crate::weights::DummyWeights::new(0.02));
        let quant = Arc::new(crate::weights::QuantizingSource::new(inner, crate::weights::Quant::Q8_0, false));
        let src = LedgerSource::new(quant);
        let shape = candle_core::Shape::from((8, 64));
        let expect = Expect { shape: &shape, init: candle_nn::init::DEFAULT_KAIMING_NORMAL };
        src.tensor("model.norm.weight", Some(expect), DType::F32, &Device::Cpu)?;
        src.quantized("model.layers.0.mlp.up_proj.weight", Some(expect), &Device::Cpu).expect("quantizes")?;
        let text = src.ledger.text();
        assert_eq!(text[0].0, "model.layers.0.mlp.up_proj.weight");
        assert_eq!((text[0].1.blocks.clone(), text[0].1.dense.clone()), (vec![(Q8_0, 8 * 64)], None));
        assert_eq!(text[1].1.dense, Some((vec![8, 64], DType::F32)));
        Ok(())
    }
}
