//! `StepCache` over the shared pool for one packed step of many sequences. The step's tokens
//! are concatenated (`[T_total, ...]`); each sequence owns a contiguous run of them.
//! Attention layers: every sequence's new K/V is written to its slots first (one scatter for
//! the whole step). On the CPU every one-token run (decode) then attends with `cpu::attention`,
//! reading its slots in place, and every other run (prefill chunks) over the gather of all its
//! slots. Elsewhere (and with `MERG_CPU_KERNELS=generic`) all runs attend in one computation
//! per layer (`batched`). Recurrent layers: each sequence's own fixed-size state, taken from
//! the sequence for the step. Global and sliding-window layers keep K/V in their own pool
//! groups (`kv_pool::GLOBAL`, `SLIDING`): each run carries its slots in both, the sliding
//! ones starting at the first block the sequence still holds.

use std::cell::OnceCell;

use candle_core::{Result, Tensor};

use super::kv_pool::KvPool;
use crate::layers::{masked_gqa, softmax_f32, Keys};
use crate::models::{RecurrentState, StepCache, Visibility};

pub struct SeqRun {
    /// First row of this sequence's tokens in the packed step.
    pub start: usize,
    pub len: usize,
    /// Tokens of the sequence before this run.
    pub past: usize,
    /// The run's K/V slots in each pool group (`GLOBAL`, `SLIDING`; None for a group without
    /// layers).
    pub groups: [Option<RunSlots>; 2],
    /// The sequence's per-layer recurrent state (empty for models without recurrent layers).
    pub recurrent: Vec<RecurrentState>,
    /// Bidirectional spans of this run's tokens, as positions in the sequence (half-open).
    pub spans: Vec<(usize, usize)>,
}

/// Slots of a sequence's tokens `first..past + len` in one pool group.
pub struct RunSlots {
    /// Position of `slots[0]` in the sequence (0 in the global group; in the sliding group
    /// the first token whose block is still held).
    pub first: usize,
    pub slots: Vec<u32>,
    /// The same slots on the device (`[past + len − first]`, u32).
    pub tensor: Tensor,
}

impl RunSlots {
    pub fn new(first: usize, slots: Vec<u32>, dev: &candle_core::Device) -> Result<Self> {
        Ok(RunSlots { first, tensor: Tensor::new(slots.as_slice(), dev)?, slots })
    }
}

impl SeqRun {
    fn past(&self) -> usize {
        self.past
    }

    fn visibility(&self, window: Option<usize>) -> Visibility<'_> {
        Visibility { window, spans: &self.spans }
    }

    /// The first key this run's queries see and its index into the group's slots. An error
    /// if the group gave that key's block back (a bookkeeping bug: wrong keys otherwise).
    fn keys(&self, group: usize, window: Option<usize>) -> Result<(usize, &RunSlots)> {
        let g = self.groups[group].as_ref().ok_or_else(|| candle_core::Error::Msg(format!("no slots in pool group {group}")))?;
        let first = self.visibility(window).first_key(self.past, self.len);
        if first < g.first {
            return Err(candle_core::Error::Msg(format!("key {first} is seen but its block was released (slots start at {})", g.first)));
        }
        Ok((first - g.first, g))
    }

    /// A one-token run whose query sees every key from its first on: the decode kernel's
    /// case; the index of that key in the group's slots.
    fn decodes(&self, group: usize, window: Option<usize>) -> Result<Option<usize>> {
        let (vis, past) = (self.visibility(window), self.past());
        let (at, g) = self.keys(group, window)?;
        Ok((self.len == 1 && (g.first + at..=past).all(|j| vis.sees(past, j))).then_some(at))
    }
}

pub struct PagedStep<'a> {
    pool: &'a KvPool,
    pub runs: Vec<SeqRun>,
    /// Slot of every packed token in each pool group, broadcast for `KvPool::write`.
    write_index: [Option<Tensor>; 2],
    /// The batched path's indices and mask, built at the step's first attention layer of each
    /// group (global, or sliding with its window).
    batch: [OnceCell<Batch>; 2],
    /// `TILE_BYTES` (smaller in tests, to cover the tiles).
    tile_bytes: usize,
}

impl<'a> PagedStep<'a> {
    pub fn new(pool: &'a KvPool, runs: Vec<SeqRun>, write_index: [Option<Tensor>; 2]) -> Self {
        PagedStep { pool, runs, write_index, batch: [OnceCell::new(), OnceCell::new()], tile_bytes: TILE_BYTES }
    }
}

/// Scores of one product at most this many bytes (f32): a part with more goes in tiles of
/// query rows, so a long prefill chunk beside many contexts cannot outgrow the memory the KV
/// pool leaves free (the pool takes all but a fixed reserve).
const TILE_BYTES: usize = 128 << 20;

/// The runs of a step that attend together, padded to the longest of them (queries) and the
/// longest context (keys). A step has at most two: its one-token runs (decodes) and its
/// longer runs (prefill chunks), so a decode is never padded to a chunk's length.
struct Part {
    /// `[R·Lmax]` slots: each run's context, padded with its last slot (masked out).
    slots: Tensor,
    /// `[R·Qmax]` rows of the packed queries, padded with the run's first row.
    rows: Tensor,
    /// `[R, 1, 1, Qmax, Lmax]` additive mask (0 or −inf) in the queries' dtype: padding and the
    /// future hidden, broadcast over kv heads and their query groups.
    mask: Tensor,
    /// `[T_part]` rows of the padded output that are real tokens, in run order.
    keep: Tensor,
    runs: usize,
    qmax: usize,
    lmax: usize,
}

/// A step's parts, the same for all layers of a pool group, so built once.
struct Batch {
    parts: Vec<Part>,
    /// `[T]` row of each packed token in the parts' outputs joined (None: already in order).
    order: Option<Tensor>,
}

impl Part {
    /// Each run's keys from the first its queries see (`SeqRun::keys`), in `group`.
    fn new(runs: &[&SeqRun], group: usize, window: Option<usize>, dev: &candle_core::Device, dtype: candle_core::DType) -> Result<Part> {
        let keys = runs.iter().map(|r| r.keys(group, window).map(|(at, g)| (g.first + at, &g.slots[at..]))).collect::<Result<Vec<_>>>()?;
        let qmax = runs.iter().map(|r| r.len).max().unwrap_or(1);
        let lmax = keys.iter().map(|(_, k)| k.len()).max().unwrap_or(1);
        let (mut slots, mut rows, mut mask, mut keep) = (vec![], vec![], vec![], vec![]);
        for (i, (r, &(first, ks))) in runs.iter().zip(&keys).enumerate() {
            let (past, vis) = (r.past(), r.visibility(window));
            slots.extend(ks.iter().copied().chain(std::iter::repeat(*ks.last().unwrap_or(&0))).take(lmax));
            rows.extend((0..qmax).map(|t| (r.start + t.min(r.len - 1)) as u32));
            keep.extend((0..r.len).map(|t| (i * qmax + t) as u32));
            // A padded query row sees its run's keys like the last real row (its output is dropped),
            // and no query sees the padding keys.
            for t in 0..qmax {
                let i = past + t.min(r.len - 1);
                mask.extend((0..lmax).map(|j| if j < ks.len() && vis.sees(i, first + j) { 0f32 } else { f32::NEG_INFINITY }));
            }
        }
        let r = runs.len();
        Ok(Part {
            slots: Tensor::new(slots, dev)?,
            rows: Tensor::new(rows, dev)?,
            mask: Tensor::from_vec(mask, (r, 1, 1, qmax, lmax), dev)?.to_dtype(dtype)?,
            keep: Tensor::new(keep, dev)?,
            runs: r,
            qmax,
            lmax,
        })
    }
}

impl Batch {
    fn new(runs: &[SeqRun], group: usize, window: Option<usize>, dev: &candle_core::Device, dtype: candle_core::DType) -> Result<Batch> {
        let (decodes, chunks): (Vec<&SeqRun>, Vec<&SeqRun>) = runs.iter().partition(|r| r.len == 1);
        let split = [decodes, chunks].into_iter().filter(|p| !p.is_empty()).collect::<Vec<_>>();
        let parts = split.iter().map(|p| Part::new(p, group, window, dev, dtype)).collect::<Result<Vec<_>>>()?;
        // Packed token → its row in the joined outputs (parts in turn, each in run order).
        let mut order = vec![0u32; runs.iter().map(|r| r.start + r.len).max().unwrap_or(0)];
        let mut next = 0u32;
        for r in split.iter().flatten() {
            for t in 0..r.len {
                order[r.start + t] = next;
                next += 1;
            }
        }
        let in_order = order.iter().enumerate().all(|(i, &o)| i as u32 == o);
        Ok(Batch { parts, order: (!in_order).then(|| Tensor::new(order, dev)).transpose()? })
    }
}

impl PagedStep<'_> {
    /// All runs in at most two computations (decodes, prefill chunks): one gather of each
    /// part's contexts from the pool, one masked grouped-query product (in query tiles when
    /// long). `q: [T, H, d]` → `[T, H·d]`, equal to `causal_gqa` per run.
    fn batched(&self, layer: usize, q: &Tensor, scale: f64, window: Option<usize>) -> Result<Tensor> {
        let group = self.pool.group(layer, window).map_err(candle_core::Error::wrap)?;
        let cell = &self.batch[group];
        let b = match cell.get() {
            Some(b) => b,
            None => {
                let b = Batch::new(&self.runs, group, window, q.device(), q.dtype())?;
                cell.get_or_init(|| b)
            }
        };
        let outs = b.parts.iter().map(|p| self.attend_part(p, layer, q, scale)).collect::<Result<Vec<_>>>()?;
        let out = match outs.len() {
            1 => outs.into_iter().next().expect("one part"),
            _ => Tensor::cat(&outs, 0)?,
        };
        match &b.order {
            Some(order) => out.index_select(order, 0),
            None => Ok(out),
        }
    }

    fn attend_part(&self, p: &Part, layer: usize, q: &Tensor, scale: f64) -> Result<Tensor> {
        let (_, h, d) = q.dims3()?;
        let (r, kvh) = (p.runs, self.pool.kv_heads());
        let g = h / kvh;
        let (k, v) = self.pool.gather(layer, &p.slots, q.dtype()).map_err(candle_core::Error::wrap)?;
        let kv = |x: Tensor| x.reshape((r, p.lmax, kvh, d))?.permute((0, 2, 1, 3))?.contiguous(); // [R, KV, L, d]
        let (kt, v) = (kv(k)?.transpose(2, 3)?.contiguous()?, kv(v)?);
        // [R, KV, G, Qmax, d]: each kv head serves its group of query heads.
        let q = q.index_select(&p.rows, 0)?.reshape((r, p.qmax, kvh, g, d))?.permute((0, 2, 3, 1, 4))?;
        let tile = (self.tile_bytes / (r * h * p.lmax * 4)).clamp(1, p.qmax);
        let mut tiles = Vec::with_capacity(p.qmax.div_ceil(tile));
        for q0 in (0..p.qmax).step_by(tile) {
            let n = tile.min(p.qmax - q0);
            let qt = q.narrow(3, q0, n)?.contiguous()?.reshape((r, kvh, g * n, d))?;
            let att = (qt.matmul(&kt)? * scale)?.reshape((r, kvh, g, n, p.lmax))?.broadcast_add(&p.mask.narrow(3, q0, n)?)?;
            let att = softmax_f32(&att)?.to_dtype(v.dtype())?.reshape((r, kvh, g * n, p.lmax))?;
            tiles.push(att.matmul(&v)?.reshape((r, kvh, g, n, d))?);
        }
        let out = match tiles.len() {
            1 => tiles.pop().expect("one tile"),
            _ => Tensor::cat(&tiles, 3)?,
        };
        out.permute((0, 3, 1, 2, 4))?.reshape((r * p.qmax, h * d))?.index_select(&p.keep, 0)
    }
}

impl StepCache for PagedStep<'_> {
    fn runs(&self, _total: usize) -> Vec<(usize, usize)> {
        self.runs.iter().map(|r| (r.start, r.len)).collect()
    }

    fn attend(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64, window: Option<usize>) -> Result<Tensor> {
        let group = self.pool.group(layer, window).map_err(candle_core::Error::wrap)?;
        let index = self.write_index[group].as_ref().ok_or_else(|| candle_core::Error::Msg(format!("no write slots for pool group {group}")))?;
        self.pool.write(layer, index, k, v).map_err(candle_core::Error::wrap)?;
        if !crate::cpu::host_paths(q.device()) {
            return self.batched(layer, q, scale, window);
        }
        // Every one-token run goes through the decode kernel, whatever else shares the step: a
        // sequence's token is then computed the same way whether or not another sequence's
        // prefill chunk is in its step (the two kernels round differently in bf16, and which
        // steps mix depends on the scheduler, e.g. on prefix sharing). A sliding layer's
        // decode reads only the window's slots.
        let mut one = vec![];
        for (i, r) in self.runs.iter().enumerate() {
            if let Some(at) = r.decodes(group, window)? {
                one.push((i, at));
            }
        }
        let mut decoded = None;
        // 8-bit rows have no in-place kernel: their decodes gather like prefill runs.
        let stores = self.pool.layer(layer).map_err(candle_core::Error::wrap)?;
        if let (false, Some((kp, vp))) = (one.is_empty(), stores) {
            let kv_heads = self.pool.kv_heads();
            let slots = |i: usize| &self.runs[i].groups[group].as_ref().expect("checked by decodes").slots;
            let queries: Vec<_> = one.iter().map(|&(i, at)| crate::cpu::attention::Query { slots: &slots(i)[at..] }).collect();
            let qd = match one.len() == self.runs.len() {
                true => q.clone(),
                false => q.index_select(&Tensor::new(one.iter().map(|&(i, _)| self.runs[i].start as u32).collect::<Vec<_>>(), q.device())?, 0)?,
            };
            decoded = crate::cpu::attention::decode(&qd, kp, vp, kv_heads, &queries, scale as f32)?;
            if let (Some(out), true) = (&decoded, one.len() == self.runs.len()) {
                return Ok(out.clone());
            }
        }
        let mut outs = Vec::with_capacity(self.runs.len());
        let mut next_one = one.iter().map(|&(i, _)| i).peekable();
        let mut row = 0;
        for (i, r) in self.runs.iter().enumerate() {
            match &decoded {
                Some(d) if next_one.peek() == Some(&i) => {
                    next_one.next();
                    outs.push(d.narrow(0, row, 1)?);
                    row += 1;
                }
                _ => {
                    let (vis, past) = (r.visibility(window), r.past());
                    let (at, g) = r.keys(group, window)?;
                    let (kc, vc) = self.pool.gather(layer, &g.tensor.narrow(0, at, g.slots.len() - at)?, q.dtype()).map_err(candle_core::Error::wrap)?;
                    outs.push(masked_gqa(&q.narrow(0, r.start, r.len)?, &kc, &vc, scale, Keys { past, first: g.first + at }, &vis)?);
                }
            }
        }
        Tensor::cat(&outs, 0)
    }

    fn set_bidirectional(&mut self, spans: &[(usize, usize)]) -> Result<()> {
        for r in &mut self.runs {
            let past = r.past();
            r.spans = spans.iter().filter(|&&(a, _)| (r.start..r.start + r.len).contains(&a)).map(|&(a, n)| (past + a - r.start, past + a - r.start + n)).collect();
        }
        for c in &mut self.batch {
            c.take();
        }
        Ok(())
    }

    fn recurrent(&mut self, layer: usize, run: usize) -> Result<&mut RecurrentState> {
        let r = self.runs.get_mut(run).ok_or_else(|| candle_core::Error::Msg(format!("no run {run} in this step")))?;
        r.recurrent.get_mut(layer).ok_or_else(|| candle_core::Error::Msg(format!("layer {layer} has no recurrent state")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::causal_gqa;
    use crate::models::{LayerKind, ModelSpec, SpecialIds};
    use super::super::kv_store::KvStore;
    use candle_core::{DType, Device};

    /// One attention layer's pool of 8 blocks of 4 slots (2 kv heads of 8), every slot holding
    /// seeded random K and V (seeds `kv`), returned beside it.
    fn filled_pool(kind: LayerKind, kv: (u64, u64)) -> anyhow::Result<(KvPool, Tensor, Tensor)> {
        let spec = ModelSpec {
            model_type: "test".into(),
            layers: vec![kind],
            num_kv_heads: 2,
            head_dim: 8,
            hidden_size: 32,
            vocab_size: 16,
            max_context: 64,
            special: SpecialIds { image: 1, video: 2, vision_start: 3, vision_end: 4, eos: vec![] },
            vision: None,
        };
        let dev = Device::Cpu;
        let pool = KvPool::new(&spec, [8, 8], 4, KvStore::Float(DType::F32), &dev)?;
        let all: Vec<u32> = (0..32).collect();
        let (k, v) = (crate::testing::randn(kv.0, (32, 2, 8), 1.0)?, crate::testing::randn(kv.1, (32, 2, 8), 1.0)?);
        pool.write(0, &pool.write_index(&all, &dev)?, &k, &v)?;
        Ok((pool, k, v))
    }

    /// A mixed step (decode runs between prefill chunks, a chunk after a cached past, a fresh
    /// prefill, contexts of different lengths in scattered slots): the batched computation
    /// (decodes and chunks as two parts, their rows put back in packed order) equals causal
    /// attention run by run, in one tile and in tiles of one query row.
    #[test]
    fn batched_attention_equals_attention_per_run() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let (pool, _, _) = filled_pool(LayerKind::Attention, (1, 2))?;
        let contexts: [(Vec<u32>, usize); 4] = [((20..27).rev().collect(), 3), ((0..5).collect(), 1), ((28..32).collect(), 4), ((8..17).collect(), 1)];
        let (mut runs, mut start) = (vec![], 0);
        for (slots, len) in contexts {
            let past = slots.len() - len;
            runs.push(SeqRun { start, len, past, groups: [Some(RunSlots::new(0, slots, &dev)?), None], recurrent: vec![], spans: vec![] });
            start += len;
        }
        let q = crate::testing::randn(3, (start, 4, 8), 1.0)?;
        let mut want = vec![];
        for r in &runs {
            let (kc, vc) = pool.gather(0, &r.groups[0].as_ref().unwrap().tensor, DType::F32)?;
            want.push(causal_gqa(&q.narrow(0, r.start, r.len)?, &kc, &vc, 0.35)?);
        }
        let want = Tensor::cat(&want, 0)?;
        let mut step = PagedStep::new(&pool, runs, [None, None]);
        for tile_bytes in [TILE_BYTES, 1] {
            step.tile_bytes = tile_bytes;
            let got = step.batched(0, &q, 0.35, None)?;
            assert_eq!(got.dims(), want.dims());
            let err = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
            assert!(err < 1e-6, "tiles of {tile_bytes} bytes: {err}");
        }
        Ok(())
    }

    /// Sliding-window layers with a bidirectional span: the batched computation, the per-run
    /// path and the decode kernel over the window's slots all equal `masked_gqa` over the whole
    /// context with the same visibility, also when the run's slots start at a later block (the
    /// sliding group gave the earlier ones back).
    #[test]
    fn windowed_and_bidirectional_runs_equal_masked_attention() -> anyhow::Result<()> {
        let dev = Device::Cpu;
        let window = Some(3);
        let (pool, k, v) = filled_pool(LayerKind::SlidingAttention { window: 3 }, (4, 5))?;
        // (slots, new tokens, spans, first held): a decode whose first block was released, a
        // chunk with an image span reaching back past the window, a fresh prefill with a span.
        let contexts: [(Vec<u32>, usize, Vec<(usize, usize)>, usize); 3] = [((0..9).collect(), 1, vec![], 4), ((10..22).collect(), 6, vec![(3, 9)], 0), ((24..31).collect(), 7, vec![(1, 5)], 0)];
        let q = crate::testing::randn(6, (14, 4, 8), 1.0)?;
        let (mut runs, mut want, mut start) = (vec![], vec![], 0);
        for (slots, len, spans, first) in contexts {
            let past = slots.len() - len;
            let (kc, vc) = pool.gather(0, &Tensor::new(slots.as_slice(), &dev)?, DType::F32)?;
            let vis = Visibility { window, spans: &spans };
            want.push(masked_gqa(&q.narrow(0, start, len)?, &kc, &vc, 0.35, Keys { past, first: 0 }, &vis)?);
            runs.push(SeqRun { start, len, past, groups: [None, Some(RunSlots::new(first, slots[first..].to_vec(), &dev)?)], recurrent: vec![], spans });
            start += len;
        }
        let want = Tensor::cat(&want, 0)?;
        // The step's new tokens are the last of each context: writing them again changes nothing.
        let new: Vec<u32> = runs.iter().flat_map(|r| { let g = r.groups[1].as_ref().unwrap(); g.slots[r.past - g.first..].to_vec() }).collect();
        let rows = Tensor::new(new.as_slice(), &dev)?;
        let (kn, vn) = (k.index_select(&rows, 0)?, v.index_select(&rows, 0)?);
        let mut step = PagedStep::new(&pool, runs, [None, Some(pool.write_index(&new, &dev)?)]);
        let wrong = step.attend(0, &q, &kn, &vn, 0.35, None).unwrap_err().to_string();
        assert!(wrong.contains("the model's spec gives it Some(3)"), "{wrong}");
        let batched = step.batched(0, &q, 0.35, window)?;
        let err = (&batched - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(err < 1e-6, "batched {err}");
        // The CPU path (decode kernel over the window, gathered runs from their first key).
        let per_run = step.attend(0, &q, &kn, &vn, 0.35, window)?;
        let err = (&per_run - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(err < 1e-5, "per run {err}");
        Ok(())
    }
}
