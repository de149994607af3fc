//! Continuous batching. Each step packs decode tokens of running sequences and (chunked)
//! prefill of new ones under a token budget. When the pool runs dry the newest running
//! sequence is preempted (blocks freed, recomputed later, helped by the prefix cache).
//! Oldest-first service and FIFO admission mean no sequence starves; a waiting sequence whose
//! next prompt blocks a running one is computing waits for them, and only as long as that
//! sequence runs.
//! Models with sliding-window layers hold blocks in two pool groups (`sliding.rs`): a sequence
//! is admitted and grown only when both have its blocks, preemption frees both, and a prefix
//! hit is cut to what the sliding group still holds of the window before it.

use std::collections::{HashMap, VecDeque};

use super::block_manager::{BlockManager, RowCopy};
use super::sliding::SlidingGroup;
use super::state_cache::StateCache;
use super::sequence::{SeqId, Sequence, Status};

#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    pub max_num_seqs: usize,
    /// Tokens computed per step across all sequences (prefill chunks + decodes).
    pub max_step_tokens: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig { max_num_seqs: 64, max_step_tokens: 2048 }
    }
}

/// `len` tokens of `seq` starting at its `num_computed`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Chunk {
    pub seq: SeqId,
    pub len: usize,
    /// For a sequence admitted this step: cached rows to copy into its table first.
    pub copy: Option<RowCopy>,
}

#[derive(Default)]
pub struct Scheduler {
    pub cfg: SchedulerConfig,
    waiting: VecDeque<SeqId>,
    /// In admission order: the front is the oldest.
    running: Vec<SeqId>,
}

impl Scheduler {
    pub fn new(cfg: SchedulerConfig) -> Self {
        Scheduler { cfg, ..Default::default() }
    }

    pub fn add(&mut self, id: SeqId) {
        self.waiting.push_back(id);
    }

    /// (waiting, running) sequence counts.
    pub fn counts(&self) -> (usize, usize) {
        (self.waiting.len(), self.running.len())
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn remove_finished(&mut self, id: SeqId) {
        self.running.retain(|&s| s != id);
        self.waiting.retain(|&s| s != id);
    }

    /// Picks this step's work. Sequences that cannot fit even alone in the pool are returned
    /// in `overflow` so the engine can finish them instead of looping.
    /// `sliding`: the pool's sliding group, for models with sliding-window layers; a sequence
    /// runs only when both groups have its blocks.
    pub fn schedule(&mut self, seqs: &mut HashMap<SeqId, Sequence>, bm: &mut BlockManager, mut states: Option<&mut StateCache>, mut sliding: Option<&mut SlidingGroup>) -> (Vec<Chunk>, Vec<SeqId>) {
        let mut chunks = vec![];
        let mut overflow = vec![];
        let mut budget = self.cfg.max_step_tokens;
        // 1. Running sequences, oldest first.
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let seq = seqs.get_mut(&id).expect("running sequence exists");
            let n = seq.next_chunk(budget);
            let target = seq.num_computed + n;
            let grown = bm.grow(&mut seq.table, target);
            if grown && sliding.as_deref_mut().is_none_or(|g| g.bm.grow(&mut seq.window_table, target)) {
                chunks.push(Chunk { seq: id, len: n, copy: None });
                budget = budget.saturating_sub(n);
                i += 1;
                continue;
            }
            // Out of blocks: preempt the newest running sequence (possibly this one).
            let victim = *self.running.last().expect("non-empty");
            if victim == id && i == 0 {
                // Alone and still too big for the pool.
                overflow.push(id);
                self.running.remove(i);
                continue;
            }
            self.preempt(victim, seqs, bm, sliding.as_deref_mut());
            if victim == id {
                continue; // this one went back to waiting; i now points past the end
            }
        }
        // 2. Admit waiting sequences in FIFO order while budget, seats and blocks allow. One
        //    whose next blocks a running sequence is computing waits for them (see
        //    `in_flight`); those behind it go on.
        let mut w = 0;
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.get(w) else { break };
            let seq = seqs.get(&id).expect("waiting sequence exists");
            let extra = seq.extra_keys();
            let cached = bm.cached_prefix(&seq.tokens, &extra);
            // Hybrid models resume only where a recurrent-state snapshot exists.
            let resume = match states.as_deref() {
                Some(st) => (1..=cached.len()).rev().find(|&k| st.contains(cached[k - 1])).unwrap_or(0),
                None => usize::MAX,
            };
            // Sliding layers resume only where their window's blocks are still cached.
            let resume = match sliding.as_deref() {
                Some(g) => g.usable_hit(&seq.tokens, &extra, &seq.prompt_spans, cached.len().min(resume)),
                None => resume,
            };
            if in_flight(seq, cached.len().min(resume), &self.running, seqs, bm, states.is_some()) {
                w += 1;
                continue;
            }
            let seq = seqs.get_mut(&id).expect("waiting sequence exists");
            // The sliding table first (it counts no statistics), given back if the global
            // group is short; both resume after the same blocks.
            let hit = cached.len().min(resume);
            let window_table = match sliding.as_deref_mut() {
                Some(g) => {
                    // Only as far as the first chunk: later chunks grow it as the global
                    // table would, and the window's start is given back behind them.
                    seq.num_computed = hit * bm.block_size();
                    let end = seq.num_computed + seq.next_chunk(budget);
                    seq.num_computed = 0;
                    g.allocate(&seq.tokens, &extra, &seq.prompt_spans, hit, end)
                }
                None => Some(vec![]),
            };
            let both = window_table.and_then(|t| match bm.allocate_capped(&seq.tokens, &extra, hit) {
                Some(a) => Some((a, t)),
                None => {
                    if let Some(g) = sliding.as_deref_mut() {
                        let _ = g.bm.free(&t);
                    }
                    None
                }
            });
            let Some((alloc, window_table)) = both else {
                if self.running.is_empty() && chunks.is_empty() {
                    // Nothing else holds blocks: this sequence can never fit.
                    self.waiting.remove(w);
                    overflow.push(id);
                    continue;
                }
                break;
            };
            self.waiting.remove(w);
            seq.table = alloc.table;
            seq.window_table = window_table;
            seq.num_computed = alloc.num_cached_tokens;
            if let Some(st) = states.as_deref_mut() {
                let bs = bm.block_size();
                let k = seq.num_computed / bs;
                if k > 0 {
                    seq.recurrent = st.get(cached[k - 1]).expect("snapshot checked above");
                }
                seq.snap_at = snapshot_points(seq, cached.len(), bs);
            }
            if !seq.admitted_once {
                seq.cached_tokens = alloc.num_cached_tokens;
                seq.admitted_once = true;
            }
            seq.status = Status::Running;
            let n = seq.next_chunk(budget);
            chunks.push(Chunk { seq: id, len: n, copy: alloc.copy });
            budget = budget.saturating_sub(n);
            self.running.push(id);
        }
        (chunks, overflow)
    }

    fn preempt(&mut self, id: SeqId, seqs: &mut HashMap<SeqId, Sequence>, bm: &mut BlockManager, sliding: Option<&mut SlidingGroup>) {
        let seq = seqs.get_mut(&id).expect("preempted sequence exists");
        // Blocks come from these managers, so freeing cannot double-free; ignore the Ok.
        let _ = bm.free(&seq.table);
        seq.table.clear();
        if let Some(g) = sliding {
            let _ = g.bm.free(&seq.window_table);
        }
        seq.window_table.clear();
        seq.num_computed = 0;
        // Recomputation starts from the first token, so recurrent layers start from zero.
        seq.recurrent.iter_mut().for_each(|r| *r = Default::default());
        seq.status = Status::Waiting;
        seq.preemptions += 1;
        self.running.retain(|&s| s != id);
        self.waiting.push_front(id);
    }
}

/// Whether a running sequence is computing the blocks `seq` needs next (its first `from`
/// blocks are cached): admitted now, `seq` would compute them a second time in the same step;
/// a step or so later it finds them in the cache (SGLang and vLLM schedule around prefixes in
/// flight for the same reason). A hybrid model resumes only at a recurrent-state snapshot, so
/// there the running sequence must also snapshot inside the shared blocks. Only full blocks of
/// `seq`'s prompt count, as `BlockManager::allocate` reuses them.
fn in_flight(seq: &Sequence, from: usize, running: &[SeqId], seqs: &HashMap<SeqId, Sequence>, bm: &BlockManager, hybrid: bool) -> bool {
    let bs = bm.block_size();
    let reusable = seq.tokens.len().saturating_sub(1) / bs;
    if !bm.prefix_caching() || from >= reusable {
        return false;
    }
    let mine = bm.block_hashes(&seq.tokens[..reusable * bs], &seq.extra_keys());
    running.iter().filter_map(|id| seqs.get(id)).any(|r| {
        let theirs_len = r.prompt_len.min(r.tokens.len()) / bs;
        if r.num_computed >= (from + 1) * bs || theirs_len <= from {
            return false;
        }
        let theirs = bm.block_hashes(&r.tokens[..theirs_len.min(reusable) * bs], &r.extra_keys());
        let shared = mine.iter().zip(&theirs).take_while(|(a, b)| a == b).count();
        shared > from && (!hybrid || r.snap_at.iter().any(|&p| p > from * bs && p <= shared * bs))
    })
}

/// Where a hybrid sequence's recurrent state is worth keeping: the end of the shared prefix
/// the pipeline's prompts have (after the last media item), the block where this prompt
/// parts from what the cache already holds (`matched` blocks: the next request sharing them
/// starts there), and the prompt's last full block (an exact repeat). Block boundaries past
/// what is already computed, ascending.
fn snapshot_points(seq: &Sequence, matched: usize, bs: usize) -> Vec<usize> {
    let last = (seq.prompt_len.saturating_sub(1) / bs) * bs;
    let mut p: Vec<usize> = [seq.snap_hint.map(|h| h / bs * bs), Some(matched * bs), Some(last)]
        .into_iter()
        .flatten()
        .filter(|&x| x > seq.num_computed && x <= last)
        .collect();
    p.sort_unstable();
    p.dedup();
    p
}
