//! The one KV-cache pool: per attention layer, K and V tensors of `num_blocks * block_size`
//! token slots (recurrent layers of a hybrid model keep fixed-size state per sequence instead
//! and take no pool memory). The layers form two groups with their own block counts and block
//! tables: global attention (`GLOBAL`, K/V of every token) and sliding-window attention
//! (`SLIDING`, K/V of a window's worth per sequence; see `sliding.rs`). `split` shares one
//! memory budget between them.
//! The block manager decides which slots a sequence owns; this file only moves tensors.
//! Writes are in place (`scatter_set`), reads gather a sequence's slots into a dense tensor
//! for attention (custom paged kernels can replace the gather later, behind the same API).
//! Rows are stored in the model's dtype or as 8-bit codes (`kv_store`).

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

use super::kv_store::{KvStore, Rows};
use crate::models::{LayerKind, ModelSpec};

/// The pool group of global attention layers.
pub const GLOBAL: usize = 0;
/// The pool group of sliding-window attention layers.
pub const SLIDING: usize = 1;

/// A layer's pool group (None for layers without K/V).
fn group_of(kind: &LayerKind) -> Option<usize> {
    match kind {
        LayerKind::Attention => Some(GLOBAL),
        LayerKind::SlidingAttention { .. } => Some(SLIDING),
        LayerKind::Recurrent { .. } => None,
    }
}

pub struct KvPool {
    k: Vec<Rows>,
    v: Vec<Rows>,
    store: KvStore,
    /// Model layer → (index into `k`/`v`, group, window) (None for layers without K/V).
    slot_of_layer: Vec<Option<(usize, usize, Option<usize>)>>,
    pub block_size: usize,
    /// Blocks of each group (`GLOBAL`, `SLIDING`).
    pub num_blocks: [usize; 2],
    kv_heads: usize,
    head_dim: usize,
}

/// How much memory the pool may take.
#[derive(Clone, Debug, PartialEq)]
pub enum KvMemory {
    /// The memory plan's share (`memory::auto_kv_bytes`): what the loaded model leaves free,
    /// less a reserve and the recurrent states, capped at what the scheduler can ever use.
    Auto,
    Bytes(u64),
    /// Fraction of the device's free memory (CUDA) or of available RAM (CPU).
    Fraction(f64),
    Blocks(usize),
}

/// `"4GiB"`-style sizes; `None` when `t` has no unit.
fn with_unit(t: &str) -> Option<Result<u64>> {
    let units = [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("GB", 1_000_000_000), ("MB", 1_000_000), ("B", 1)];
    let (n, mul) = units.iter().find_map(|(u, m)| t.strip_suffix(u).map(|n| (n, *m)))?;
    Some(n.trim().parse::<f64>().ok().filter(|v| *v >= 0.0 && v.is_finite()).map(|v| (v * mul as f64) as u64).context("not a number"))
}

/// A byte count: `4GiB`, `512MiB`, `1000000`.
pub fn parse_bytes(s: &str) -> Result<u64> {
    let t = s.trim();
    match with_unit(t) {
        Some(b) => b.with_context(|| format!("'{s}' is not a size like 2GiB")),
        None => t.parse::<u64>().with_context(|| format!("'{s}' is not a size like 2GiB")),
    }
}

/// What `KvMemory` accepts, as the rule of an invalid `kv_memory` setting.
const KV_FORMS: &str = "auto, a fraction of free memory like 0.5, bytes like 4GiB, or blocks:N";

impl std::str::FromStr for KvMemory {
    type Err = crate::setting::InvalidSetting;
    /// "0.5" (fraction), "4GiB", "512MiB", "1000000" (bytes), "blocks:64".
    fn from_str(s: &str) -> std::result::Result<Self, Self::Err> {
        let bad = || crate::setting::InvalidSetting::new("kv_memory", s, KV_FORMS);
        let t = s.trim();
        if t.eq_ignore_ascii_case("auto") {
            return Ok(KvMemory::Auto);
        }
        if let Some(n) = t.strip_prefix("blocks:") {
            return n.trim().parse().map(KvMemory::Blocks).map_err(|_| bad());
        }
        if let Some(b) = with_unit(t) {
            return b.map(KvMemory::Bytes).map_err(|_| bad());
        }
        match t.parse::<f64>() {
            Ok(v) if v > 0.0 && v <= 1.0 => Ok(KvMemory::Fraction(v)),
            Ok(v) if v > 1.0 && v.is_finite() => Ok(KvMemory::Bytes(v as u64)),
            _ => Err(bad()),
        }
    }
}

/// The form `from_str` reads back (`blocks:64`, `0.5`, `4294967296B`).
impl std::fmt::Display for KvMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KvMemory::Auto => write!(f, "auto"),
            KvMemory::Bytes(b) => write!(f, "{b}B"),
            KvMemory::Fraction(x) => write!(f, "{x}"),
            KvMemory::Blocks(n) => write!(f, "blocks:{n}"),
        }
    }
}

/// Bytes of K+V one block takes across all attention layers (what a block costs when every
/// layer keeps every token: the unit `KvMemory::Blocks` counts in).
pub fn bytes_per_block(spec: &ModelSpec, block_size: usize, store: KvStore) -> u64 {
    let [g, s] = group_bytes_per_block(spec, block_size, store);
    g + s
}

/// Bytes of K+V one block of each group takes (its layers only).
pub fn group_bytes_per_block(spec: &ModelSpec, block_size: usize, store: KvStore) -> [u64; 2] {
    let per_layer = 2 * block_size as u64 * store.row_bytes(spec.num_kv_heads * spec.head_dim, spec.head_dim);
    [spec.num_global_layers() as u64 * per_layer, spec.num_sliding_layers() as u64 * per_layer]
}

/// What the sliding group must hold beside the global one: the sequences' windows and one
/// step's new tokens.
#[derive(Clone, Copy, Debug)]
pub struct Load {
    /// Most sequences running at once.
    pub max_seqs: usize,
    /// Tokens one step computes across all sequences (prefill chunks and decodes).
    pub step_tokens: usize,
    /// The context requests are held to: the length the split assumes a sequence reaches.
    pub context: usize,
}

pub use crate::memory::window_blocks;

/// Sequences the split assumes are this many windows long (or the context, when shorter):
/// long enough that the sliding layers' share is small (Gemma 3's 1024-token window: 4096,
/// the paper's dialogues), short enough that a model's 128k context does not leave room for
/// only a couple of windows when requests are shorter.
pub const ASSUMED_WINDOWS: usize = 4;

/// Shares `bytes` between the groups: `[global, sliding]` block counts. Without sliding layers
/// the global group takes everything. Otherwise the sliding group gets, for as many sequences
/// as the global blocks hold of `ASSUMED_WINDOWS` windows (or `load.context`, when shorter; at
/// least one, at most `load.max_seqs`), each one's window (`window_blocks`), plus one step's
/// tokens (a step's chunks together grow the windows by at most that): a sequence alone can
/// always take a full step. The global group gets the rest. Shorter sequences may run out of
/// sliding blocks first and longer ones of global blocks; the scheduler then preempts (or
/// waits) as it does whichever group is short. Neither group gets more than it could ever use
/// (`max_seqs × context` tokens for the global one). `mem` is the setting the budget came
/// from, named when it is too small.
pub fn split(bytes: u64, mem: &KvMemory, spec: &ModelSpec, block_size: usize, store: KvStore, load: Load) -> Result<[usize; 2]> {
    let bs = block_size.max(1) as u64;
    let [g, s] = group_bytes_per_block(spec, block_size, store);
    let max_global = (load.max_seqs as u64).saturating_mul(load.context as u64).div_ceil(bs).max(1);
    let Some(window) = spec.sliding_window().filter(|_| s > 0) else {
        return Ok([(bytes / g.max(1)).min(max_global) as usize, 0]);
    };
    if g == 0 {
        bail!("every attention layer of this model is windowed; the KV pool needs at least one global attention layer");
    }
    let w = window_blocks(window.min(load.context.max(1)), block_size) as u64;
    let step = (load.step_tokens.min(load.context.max(1)) as u64).div_ceil(bs);
    let ctx = (load.context.min(ASSUMED_WINDOWS * window).max(1) as u64).div_ceil(bs);
    // bytes = N_g·g + (seqs·w + step)·s with seqs = N_g / ctx: solve for N_g, then round.
    let per_global = g as f64 + w as f64 * s as f64 / ctx as f64;
    let n_g = ((bytes.saturating_sub((w + step) * s)) as f64 / per_global.max(1.0)) as u64;
    let seqs = n_g.div_ceil(ctx).clamp(1, load.max_seqs.max(1) as u64);
    let n_s = seqs * w + step;
    let left = bytes.checked_sub(n_s * s).filter(|l| *l >= g).map(|l| l / g.max(1));
    match left {
        Some(n_g) => Ok([n_g.min(max_global) as usize, n_s as usize]),
        None => {
            let rule = format!("enough for one sequence's sliding window and one step ({n_s} blocks of {s} bytes) beside a block of the global layers ({g} bytes); it gives {bytes} bytes");
            Err(crate::setting::InvalidSetting::new("kv_memory", mem, rule).into())
        }
    }
}


/// `max_tokens`: the most tokens the scheduler could ever hold at once (sequences × context),
/// which caps the automatic size.
pub fn num_blocks_for(mem: &KvMemory, spec: &ModelSpec, block_size: usize, store: KvStore, device: &Device, max_tokens: u64) -> Result<usize> {
    // A model without attention layers needs no pool; one block keeps the bookkeeping uniform.
    let per = bytes_per_block(spec, block_size, store).max(1);
    // What the load freed goes back to the device first, so the pool is sized on memory it can get.
    crate::memory::release_pooled(device);
    let n = match mem {
        KvMemory::Auto => {
            let avail = crate::memory::available_memory(device)?;
            let per_token = per / block_size as u64;
            let bytes = crate::memory::auto_kv_bytes(avail, crate::memory::DEFAULT_RESERVE, per_token, max_tokens, spec.has_recurrent_layers());
            if bytes < per {
                bail!(
                    "after the model, {:.2} GiB are available; less a {:.1} GiB reserve nothing is left for the KV cache — free memory, or give the KV memory explicitly",
                    avail as f64 / (1u64 << 30) as f64,
                    crate::memory::DEFAULT_RESERVE as f64 / (1u64 << 30) as f64
                );
            }
            ((bytes / per) as usize).max(1)
        }
        KvMemory::Blocks(n) => *n,
        KvMemory::Bytes(b) => (*b / per) as usize,
        KvMemory::Fraction(f) => ((crate::memory::available_memory(device)? as f64 * f) as u64 / per) as usize,
    };
    if n == 0 {
        let rule = format!("enough for one block of {block_size} tokens ({per} bytes)");
        return Err(crate::setting::InvalidSetting::new("kv_memory", mem, rule).into());
    }
    // Checked before allocating: a failed allocation aborts the process instead of erroring.
    let want = (n as u64).saturating_mul(per);
    let avail = crate::memory::available_memory(device)?;
    if want > avail {
        bail!(
            "the KV pool would take {:.1} GiB ({n} blocks of {per} bytes) but the device has {:.1} GiB available; ask for less KV memory",
            want as f64 / (1u64 << 30) as f64,
            avail as f64 / (1u64 << 30) as f64
        );
    }
    Ok(n)
}

impl KvPool {
    /// `num_blocks`: blocks of each group (`split`).
    pub fn new(spec: &ModelSpec, num_blocks: [usize; 2], block_size: usize, store: KvStore, device: &Device) -> Result<Self> {
        let (kvh, d) = (spec.num_kv_heads, spec.head_dim);
        let n = spec.num_attention_layers();
        let (mut k, mut v) = (Vec::with_capacity(n), Vec::with_capacity(n));
        let mut slot_of_layer = Vec::with_capacity(spec.layers.len());
        for kind in &spec.layers {
            let Some(g) = group_of(kind) else {
                slot_of_layer.push(None);
                continue;
            };
            slot_of_layer.push(Some((k.len(), g, kind.window())));
            let slots = num_blocks[g] * block_size;
            k.push(Rows::zeros(slots, kvh * d, d, store, device)?);
            v.push(Rows::zeros(slots, kvh * d, d, store, device)?);
        }
        Ok(KvPool { k, v, store, slot_of_layer, block_size, num_blocks, kv_heads: kvh, head_dim: d })
    }

    /// The pool group of `layer`, checked against the window the layer attends with: the
    /// spec decides where K/V lives, so a layer masking by another window is a bug.
    pub fn group(&self, layer: usize, window: Option<usize>) -> Result<usize> {
        let (_, g, spec_window) = self.slot_of_layer.get(layer).copied().flatten().with_context(|| format!("layer {layer} keeps no K/V in the pool"))?;
        if spec_window != window {
            bail!("layer {layer} attends with window {window:?} but the model's spec gives it {spec_window:?}");
        }
        Ok(g)
    }

    /// Attention layers holding K/V in the pool.
    pub fn num_layers(&self) -> usize {
        self.k.len()
    }

    fn slot(&self, layer: usize) -> Result<usize> {
        self.slot_of_layer.get(layer).copied().flatten().map(|(l, _, _)| l).with_context(|| format!("layer {layer} keeps no K/V in the pool"))
    }

    /// Index tensor for `write`: each slot id repeated across the row width.
    pub fn write_index(&self, slots: &[u32], device: &Device) -> Result<Tensor> {
        let w = self.kv_heads * self.head_dim;
        Ok(Tensor::new(slots, device)?.unsqueeze(1)?.broadcast_as((slots.len(), w))?.contiguous()?)
    }

    /// Stores `k, v: [n, kv_heads, d]` into the slots encoded by `index` (from `write_index`).
    pub fn write(&self, layer: usize, index: &Tensor, k: &Tensor, v: &Tensor) -> Result<()> {
        let n = k.dim(0)?;
        let w = self.kv_heads * self.head_dim;
        let l = self.slot(layer)?;
        self.k[l].set(index, &k.reshape((n, w))?)?;
        self.v[l].set(index, &v.reshape((n, w))?)?;
        Ok(())
    }

    /// The layer's whole K and V stores, `[slots, kv_heads·d]`, for kernels that read slots in
    /// place; None when the rows are 8-bit codes (those are gathered and dequantized).
    pub fn layer(&self, layer: usize) -> Result<Option<(&Tensor, &Tensor)>> {
        let l = self.slot(layer)?;
        Ok(self.k[l].float().zip(self.v[l].float()))
    }

    /// K/V heads of every layer.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// How rows are stored.
    pub fn store(&self) -> KvStore {
        self.store
    }

    /// K and V of the given slots, `[S, kv_heads, d]` each.
    /// Codes come back in `dtype` (the layer's compute dtype); float rows as they are stored.
    pub fn gather(&self, layer: usize, slots: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        let s = slots.dim(0)?;
        let shape = (s, self.kv_heads, self.head_dim);
        let l = self.slot(layer)?;
        let k = self.k[l].select(slots, dtype)?.reshape(shape)?;
        let v = self.v[l].select(slots, dtype)?.reshape(shape)?;
        Ok((k, v))
    }

    /// Copies the first `rows` rows of block `src` to block `dst` in every layer, as stored
    /// (codes and scales alike): a prompt reusing part of a cached block. Models with a
    /// sliding group never share part of a block, so only the global group is copied.
    pub fn copy_rows(&self, src: u32, dst: u32, rows: usize, device: &Device) -> Result<()> {
        let bs = self.block_size as u32;
        let from: Vec<u32> = (0..rows as u32).map(|j| src * bs + j).collect();
        let (from, to) = (Tensor::new(from.as_slice(), device)?, self.write_index(&self.slots(&[dst], 0, rows), device)?);
        for &(l, g, _) in self.slot_of_layer.iter().flatten() {
            if g == GLOBAL {
                self.k[l].copy(&from, &to)?;
                self.v[l].copy(&from, &to)?;
            }
        }
        Ok(())
    }

    /// Slot ids of tokens `start..end` of a sequence with this block table.
    pub fn slots(&self, table: &[u32], start: usize, end: usize) -> Vec<u32> {
        (start..end).map(|i| table[i / self.block_size] * self.block_size as u32 + (i % self.block_size) as u32).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_memory_specs() {
        assert_eq!("0.5".parse::<KvMemory>().unwrap(), KvMemory::Fraction(0.5));
        assert_eq!("2GiB".parse::<KvMemory>().unwrap(), KvMemory::Bytes(2 << 30));
        assert_eq!("blocks:12".parse::<KvMemory>().unwrap(), KvMemory::Blocks(12));
        assert!("-1".parse::<KvMemory>().is_err());
        assert!("lots".parse::<KvMemory>().is_err());
        for m in [KvMemory::Auto, KvMemory::Blocks(12), KvMemory::Fraction(0.5), KvMemory::Bytes(3 << 30)] {
            assert_eq!(m.to_string().parse::<KvMemory>().unwrap(), m, "{m} reads back");
        }
        assert_eq!("lots".parse::<KvMemory>().unwrap_err().name, "kv_memory");
    }

    /// A hybrid model's pool holds K/V for its attention layers only, and is sized by them.
    #[test]
    fn pool_covers_attention_layers_only() {
        use crate::models::SpecialIds;
        let rec = LayerKind::Recurrent { conv_shape: vec![3, 8], state_shape: vec![2, 4, 4] };
        let spec = |layers: Vec<LayerKind>| ModelSpec {
            model_type: "test".into(),
            layers,
            num_kv_heads: 2,
            head_dim: 4,
            hidden_size: 8,
            vocab_size: 16,
            max_context: 64,
            special: SpecialIds { image: 1, video: 2, vision_start: 3, vision_end: 4, eos: vec![] },
            vision: None,
        };
        let hybrid = spec(vec![rec.clone(), rec.clone(), rec, LayerKind::Attention]);
        let dense = spec(vec![LayerKind::Attention; 4]);
        assert_eq!(bytes_per_block(&dense, 16, KvStore::Float(DType::F32)), 4 * bytes_per_block(&hybrid, 16, KvStore::Float(DType::F32)));
        let mem = KvMemory::Bytes(bytes_per_block(&dense, 16, KvStore::Float(DType::F32)) * 10);
        assert_eq!(num_blocks_for(&mem, &hybrid, 16, KvStore::Float(DType::F32), &Device::Cpu, u64::MAX).unwrap(), 40);
        // Auto never exceeds what the scheduler could hold.
        let per_token = bytes_per_block(&dense, 16, KvStore::Float(DType::F32)) / 16;
        assert_eq!("auto".parse::<KvMemory>().unwrap(), KvMemory::Auto);
        assert_eq!(num_blocks_for(&KvMemory::Auto, &dense, 16, KvStore::Float(DType::F32), &Device::Cpu, 160).unwrap(), 10, "{per_token}");
        let pool = KvPool::new(&hybrid, [4, 0], 16, KvStore::Float(DType::F32), &Device::Cpu).unwrap();
        assert_eq!(pool.num_layers(), 1);
        let (k, v) = (Tensor::ones((2, 2, 4), DType::F32, &Device::Cpu).unwrap(), Tensor::ones((2, 2, 4), DType::F32, &Device::Cpu).unwrap());
        let idx = pool.write_index(&[0, 1], &Device::Cpu).unwrap();
        assert!(pool.write(3, &idx, &k, &v).is_ok());
        let e = pool.write(0, &idx, &k, &v).unwrap_err().to_string();
        assert!(e.contains("layer 0 keeps no K/V"), "{e}");
    }

    /// Gemma 3 12B's layers (40 sliding of window 1024, 8 global) in a budget that holds 8
    /// contexts of 4096 tokens when every layer keeps every token: the split holds more than
    /// twice the tokens, within the budget, and room for each sequence's window.
    #[test]
    fn split_gives_sliding_layers_their_windows_only() {
        use crate::models::SpecialIds;
        let mut layers = vec![];
        for i in 0..48 {
            layers.push(if (i + 1) % 6 == 0 { LayerKind::Attention } else { LayerKind::SlidingAttention { window: 1024 } });
        }
        let spec = ModelSpec {
            model_type: "gemma3".into(),
            layers,
            num_kv_heads: 8,
            head_dim: 256,
            hidden_size: 3840,
            vocab_size: 262_208,
            max_context: 131_072,
            special: SpecialIds { image: 1, video: 2, vision_start: 3, vision_end: 4, eos: vec![] },
            vision: None,
        };
        let (bs, dt) = (16, KvStore::Float(DType::BF16));
        let all = bytes_per_block(&spec, bs, dt);
        let budget = all * 8 * 4096 / 16;
        let load = Load { max_seqs: 64, step_tokens: 2048, context: 4096 };
        let mem = KvMemory::Bytes(budget);
        let [n_g, n_s] = split(budget, &mem, &spec, bs, dt, load).unwrap();
        let [g, s] = group_bytes_per_block(&spec, bs, dt);
        assert!(n_g as u64 * g + n_s as u64 * s <= budget);
        let seqs = (n_g * bs / 4096) as u64;
        assert!(seqs >= 16, "{n_g} global blocks: {seqs} contexts of 4096 (8 when every layer is global)");
        assert!(n_s as u64 >= seqs * window_blocks(1024, bs) as u64 + 2048 / 16);
        // A model without sliding layers keeps the whole budget global, as before.
        let dense = ModelSpec { layers: vec![LayerKind::Attention; 4], ..spec.clone() };
        let per = bytes_per_block(&dense, bs, dt);
        assert_eq!(split(per * 10, &KvMemory::Blocks(10), &dense, bs, dt, load).unwrap(), [10, 0]);
        // Too little for one window: the setting is named with its rule.
        let e = split(all * 4, &KvMemory::Blocks(4), &spec, bs, dt, load).unwrap_err();
        let e = e.downcast_ref::<crate::setting::InvalidSetting>().expect("an invalid kv_memory");
        assert_eq!((e.name, e.value.as_str()), ("kv_memory", "blocks:4"));
        assert!(e.rule.contains("enough for one sequence's sliding window"), "{}", e.rule);
    }
}
