//! Block manager of the paged KV cache: pure bookkeeping of which pool blocks each sequence
//! owns, with prefix caching (vLLM / nano-vllm style). No tensors live here.
//!
//! Each block is in exactly one of three states:
//! - **free**: refcount 0, not in the hash cache, on the free list;
//! - **evictable**: refcount 0 but registered in the hash cache (its K/V is still valid and can
//!   be revived by a later matching prompt), kept in an LRU ordered by the time it was freed;
//! - **used**: refcount > 0 (registered or not).
//!
//! Hashing: block hashes are chained (`h_i = H(h_{i-1}, block i)`) so a match on block `i`
//! implies the whole prefix matches. `H` is `std::hash::DefaultHasher::new()` (SipHash-1-3 with
//! zero keys): deterministic within one build, which is all we need since hashes are never
//! persisted or shared across processes. A 64-bit collision (~2^-64 per pair) would serve wrong
//! K/V; we accept that rather than storing every block's tokens to compare on each match.

use serde::Serialize;
use std::collections::{BTreeMap, HashMap};
use std::hash::{DefaultHasher, Hasher};

use super::block_contents::BlockContents;

pub type BlockId = u32;

/// Stands in a block table for a block a sliding-window group has given back (its tokens lie
/// before every later query's window); `free` and `commit` pass over it. Never a real block:
/// `new` caps the pool below it.
pub const RELEASED: BlockId = BlockId::MAX;

/// Prompt-token accounting of the prefix cache (reset with [`BlockManager::reset_stats`]).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct CacheStats {
    /// Prompt tokens submitted to [`BlockManager::allocate`].
    pub prompt_tokens: u64,
    /// Prompt tokens served from cached blocks.
    pub cached_tokens: u64,
    /// Prompt tokens that had to be computed (`prompt_tokens - cached_tokens`).
    pub computed_tokens: u64,
    /// Cached blocks dropped to make room for fresh ones.
    pub evictions: u64,
}

/// Blocks handed to a new sequence.
#[derive(Clone, Debug, PartialEq)]
pub struct Allocation {
    /// Block table covering the whole prompt.
    pub table: Vec<BlockId>,
    /// Leading prompt tokens whose K/V is already in the cache, or will be once `copy` is done.
    pub num_cached_tokens: usize,
    /// Rows of a cached block the new table's first fresh block starts with (token-granular
    /// reuse): the pool must copy them before the sequence's first step, then `free(&[src])`.
    pub copy: Option<RowCopy>,
}

/// The first `rows` K/V rows of cached block `src` go to block `dst`. `src` is referenced once
/// for the copy (it cannot be evicted before it is made).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowCopy {
    pub src: BlockId,
    pub dst: BlockId,
    pub rows: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BlockError {
    #[error("block {0} freed more times than it was referenced (double free)")]
    DoubleFree(BlockId),
    #[error("block {0} is not in the pool")]
    InvalidBlock(BlockId),
}

#[derive(Clone, Debug, Default)]
struct BlockMeta {
    ref_count: u32,
    /// `Some(h)` iff the block is registered in the cache under `h` (`cached[h] == id`).
    hash: Option<u64>,
    /// LRU key while evictable (the tick at which it reached refcount 0).
    tick: u64,
}

pub struct BlockManager {
    block_size: usize,
    prefix_caching: bool,
    blocks: Vec<BlockMeta>,
    /// Unregistered refcount-0 blocks; a stack, initially ordered so block 0 is handed out first.
    free: Vec<BlockId>,
    /// Registered refcount-0 blocks by free tick: first entry = least recently freed.
    evictable: BTreeMap<u64, BlockId>,
    cached: HashMap<u64, BlockId>,
    /// The tokens of every registered block, for reuse of part of one.
    contents: BlockContents,
    /// Whether a block may be reused in part (`with_partial_reuse`).
    partial: bool,
    next_tick: u64,
    stats: CacheStats,
}

impl BlockManager {
    /// A `block_size` of 0 is treated as 1 (a zero-slot block cannot hold anything).
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool) -> Self {
        // BlockId is u32: a larger pool could not be addressed (and `RELEASED` is no block).
        let num_blocks = num_blocks.min(RELEASED as usize);
        Self {
            block_size: block_size.max(1),
            prefix_caching,
            blocks: vec![BlockMeta::default(); num_blocks],
            free: (0..num_blocks as BlockId).rev().collect(),
            evictable: BTreeMap::new(),
            cached: HashMap::new(),
            contents: BlockContents::default(),
            partial: false,
            next_tick: 0,
            stats: CacheStats::default(),
        }
    }

    /// Lets a prompt reuse the leading rows it shares with a cached block after its last full
    /// match (`Allocation::copy`), and `commit_tail` keep a given-back table's partly filled
    /// block: only for a pool whose rows are a sequence's whole state (no recurrent layers, no
    /// sliding window).
    pub fn with_partial_reuse(mut self, on: bool) -> Self {
        self.partial = on;
        self
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    pub fn prefix_caching(&self) -> bool {
        self.prefix_caching
    }

    /// Blocks that can be handed out now: free ones plus evictable cached ones.
    pub fn num_available(&self) -> usize {
        self.free.len() + self.evictable.len()
    }

    /// The hash a block is registered under in the prefix cache, if any (for tests/debugging).
    pub fn cached_hash(&self, id: BlockId) -> Option<u64> {
        self.blocks.get(id as usize).and_then(|b| b.hash)
    }

    /// Reference count of a block (None if out of range).
    pub fn ref_count(&self, id: BlockId) -> Option<u32> {
        self.blocks.get(id as usize).map(|b| b.ref_count)
    }

    /// Chained content hashes of the full blocks of `tokens`. `extra[j]` is a per-token key
    /// (0 = none), e.g. the hash of the image token `j` stands for, so equal placeholder ids with
    /// different images never match. A shorter `extra` is padded with 0 (so `&[]` = no keys).
    pub fn block_hashes(&self, tokens: &[u32], extra: &[u64]) -> Vec<u64> {
        self.hashes_from(tokens, extra, 0, tokens.len() / self.block_size, 0)
    }

    /// Hashes of full blocks `first..end`, chained from `prev` (the hash of block `first - 1`,
    /// or 0 for the first block).
    fn hashes_from(
        &self,
        tokens: &[u32],
        extra: &[u64],
        first: usize,
        end: usize,
        mut prev: u64,
    ) -> Vec<u64> {
        let bs = self.block_size;
        let mut out = Vec::with_capacity(end.saturating_sub(first));
        for i in first..end {
            let mut h = DefaultHasher::new();
            h.write_u64(prev);
            write_tokens(&mut h, tokens, extra, i * bs..(i + 1) * bs);
            prev = h.finish();
            out.push(prev);
        }
        out
    }

    /// Blocks for a new (or preempted-and-resumed) sequence. Reuses the longest cached prefix
    /// chain, but at most `(len-1)/bs` blocks so at least one token is computed (its logits are
    /// needed). None, with nothing changed, if the pool cannot supply the rest. An empty prompt
    /// gets an empty table.
    pub fn allocate(&mut self, tokens: &[u32], extra: &[u64]) -> Option<Allocation> {
        self.allocate_capped(tokens, extra, usize::MAX)
    }

    /// Chain hashes of the leading blocks of `tokens` whose K/V the cache holds (at most
    /// `(len-1)/bs`, as `allocate` would reuse).
    pub fn cached_prefix(&self, tokens: &[u32], extra: &[u64]) -> Vec<u64> {
        let mut out = vec![];
        if !self.prefix_caching || tokens.is_empty() {
            return out;
        }
        let mut prev = 0;
        for i in 0..(tokens.len() - 1) / self.block_size {
            let h = self.hashes_from(tokens, extra, i, i + 1, prev)[0];
            if !self.cached.contains_key(&h) {
                break;
            }
            out.push(h);
            prev = h;
        }
        out
    }

    /// `allocate`, reusing at most `cap` cached blocks (a hybrid model can only resume where
    /// it has a recurrent-state snapshot). With partial reuse on, the block after the last full
    /// match also takes the leading rows it shares with a cached block (`Allocation::copy`).
    pub fn allocate_capped(&mut self, tokens: &[u32], extra: &[u64], cap: usize) -> Option<Allocation> {
        let bs = self.block_size;
        let len = tokens.len();
        if len == 0 {
            return Some(Allocation { table: Vec::new(), num_cached_tokens: 0, copy: None });
        }
        let total = len.div_ceil(bs);
        let mut matched = Vec::new();
        if self.prefix_caching {
            let max_reuse = ((len - 1) / bs).min(cap);
            // Hash lazily: stop at the first miss instead of hashing the whole prompt.
            let mut prev = 0;
            for i in 0..max_reuse {
                let h = self.hashes_from(tokens, extra, i, i + 1, prev)[0];
                if !self.cached.contains_key(&h) {
                    break;
                }
                matched.push(h);
                prev = h;
            }
        }
        let m = matched.len();
        // At least one token is computed (its logits are needed) and a whole block would have
        // matched by hash.
        let most = (bs - 1).min(len - 1 - m * bs);
        let part = match self.partial && self.prefix_caching && most > 0 {
            true => self.contents.longest(matched.last().copied().unwrap_or(0), &tokens[m * bs..], extra.get(m * bs..).unwrap_or(&[]), most),
            false => None,
        };
        // The source is referenced before the fresh blocks are taken, so taking them cannot
        // evict it; undone (its place in the eviction order kept) if the pool is short.
        let pinned = part.map(|(src, _)| (src, self.pin(src)));
        let Some(table) = self.take(&matched, total - m) else {
            if let Some((src, tick)) = pinned {
                self.unpin(src, tick);
            }
            return None;
        };
        let copy = part.map(|(src, rows)| RowCopy { src, dst: table[m], rows });
        let num_cached = m * bs + copy.map_or(0, |c| c.rows);
        self.stats.prompt_tokens += len as u64;
        self.stats.cached_tokens += num_cached as u64;
        self.stats.computed_tokens += (len - num_cached) as u64;
        Some(Allocation { table, num_cached_tokens: num_cached, copy })
    }

    /// One more reference to block `b`; its eviction tick if it was evictable.
    fn pin(&mut self, b: BlockId) -> Option<u64> {
        let m = &mut self.blocks[b as usize];
        m.ref_count += 1;
        (m.ref_count == 1).then(|| {
            self.evictable.remove(&m.tick);
            m.tick
        })
    }

    /// Undoes `pin`, putting an evictable block back where it was in the eviction order.
    fn unpin(&mut self, b: BlockId, tick: Option<u64>) {
        let m = &mut self.blocks[b as usize];
        m.ref_count -= 1;
        if let Some(t) = tick {
            self.evictable.insert(t, b);
        }
    }

    /// Whether the cache holds a block under this chain hash.
    pub fn holds(&self, hash: u64) -> bool {
        self.cached.contains_key(&hash)
    }

    /// The cached blocks of `revive` (chain hashes this cache holds), referenced once more, then
    /// `fresh` new blocks; all or nothing (None, nothing changed, if the pool is short or a hash
    /// is not cached). No prompt statistics are counted.
    pub fn take(&mut self, revive: &[u64], fresh: usize) -> Option<Vec<BlockId>> {
        let mut table = Vec::with_capacity(revive.len() + fresh);
        for h in revive {
            table.push(*self.cached.get(h)?);
        }
        // Reviving an evictable block takes it out of the available pool too.
        let revived = table
            .iter()
            .filter(|&&b| self.blocks[b as usize].ref_count == 0)
            .count();
        if fresh + revived > self.num_available() {
            return None;
        }
        for &b in &table {
            self.pin(b);
        }
        for _ in 0..fresh {
            // Checked above: cannot fail.
            table.push(self.take_fresh()?);
        }
        Some(table)
    }

    /// A never-cached free block if any, else the least recently freed evictable one.
    fn take_fresh(&mut self) -> Option<BlockId> {
        let b = match self.free.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.evictable.pop_first()?;
                if let Some(h) = self.blocks[b as usize].hash.take() {
                    self.cached.remove(&h);
                    self.contents.remove(b);
                }
                self.stats.evictions += 1;
                b
            }
        };
        self.blocks[b as usize].ref_count = 1;
        Some(b)
    }

    /// Blocks needed to grow a table from `cur_len` to `new_len` tokens.
    pub fn blocks_needed(&self, cur_len: usize, new_len: usize) -> usize {
        new_len
            .div_ceil(self.block_size)
            .saturating_sub(cur_len.div_ceil(self.block_size))
    }

    /// Make `table` hold `new_len` tokens by appending fresh blocks. false (no change) if the pool
    /// is short; a table already large enough is left as is.
    pub fn grow(&mut self, table: &mut Vec<BlockId>, new_len: usize) -> bool {
        let need = new_len
            .div_ceil(self.block_size)
            .saturating_sub(table.len());
        if need > self.num_available() {
            return false;
        }
        for _ in 0..need {
            match self.take_fresh() {
                Some(b) => table.push(b),
                None => return false, // unreachable: availability checked above
            }
        }
        true
    }

    /// Register the full blocks of `tokens[..num_computed]` (whose K/V is now written) so later
    /// prompts can reuse them. Only blocks this table holds a reference to are registered; a hash
    /// already mapped to another block keeps its mapping (this block stays private and is
    /// recycled normally). A no-op without prefix caching.
    pub fn commit(
        &mut self,
        table: &[BlockId],
        tokens: &[u32],
        extra: &[u64],
        num_computed: usize,
    ) {
        if !self.prefix_caching {
            return;
        }
        let bs = self.block_size;
        let n_full = (num_computed.min(tokens.len()) / bs).min(table.len());
        // Resume the chain after the last block already registered: its stored hash is its chain
        // hash, so repeated commits during decode only hash the new blocks.
        let mut first = 0;
        let mut prev = 0;
        for i in (0..n_full).rev() {
            if let Some(h) = self.blocks.get(table[i] as usize).and_then(|m| m.hash) {
                first = i + 1;
                prev = h;
                break;
            }
        }
        let hashes = self.hashes_from(tokens, extra, first, n_full, prev);
        for (i, h) in (first..n_full).zip(hashes) {
            let parent = std::mem::replace(&mut prev, h);
            let b = table[i];
            let Some(m) = self.blocks.get(b as usize) else {
                continue;
            };
            // A refcount-0 block is not this table's (stale table): registering it would put a
            // free-list block into the cache.
            if m.ref_count == 0 || m.hash.is_some() {
                continue;
            }
            self.register(b, h, parent, tokens, extra, i * bs..(i + 1) * bs);
        }
    }

    /// Registers block `b` under hash `h` unless the hash already maps to another block (which
    /// keeps its mapping: `b` stays private and is recycled normally), with its tokens
    /// `tokens[range]` recorded after the block hashed `parent`.
    fn register(&mut self, b: BlockId, h: u64, parent: u64, tokens: &[u32], extra: &[u64], range: std::ops::Range<usize>) {
        if let std::collections::hash_map::Entry::Vacant(e) = self.cached.entry(h) {
            e.insert(b);
            self.blocks[b as usize].hash = Some(h);
            self.contents.insert(parent, b, &tokens[range.clone()], extra.get(range.start..).unwrap_or(&[]));
        }
    }

    /// Registers the partly filled block after the table's full ones (`tokens[full·bs..
    /// num_computed]`) for part-of-a-block reuse alone, when the table is given back: under a
    /// hash no chain of full blocks gives (no whole-block match finds it), its tokens recorded
    /// after the last full block's chain hash. A repeated or extended prompt then computes only
    /// what the finished one did not (as llama.cpp's slot cache). A no-op without partial reuse
    /// or prefix caching, without such a part, or where the full blocks before it are not
    /// registered.
    pub fn commit_tail(&mut self, table: &[BlockId], tokens: &[u32], extra: &[u64], num_computed: usize) {
        let bs = self.block_size;
        let n = num_computed.min(tokens.len());
        let (full, rest) = (n / bs, n % bs);
        let Some(&b) = table.get(full) else { return };
        if !self.partial || !self.prefix_caching || rest == 0 || b == RELEASED {
            return;
        }
        let parent = match full {
            0 => 0,
            _ => match self.blocks.get(table[full - 1] as usize).and_then(|m| m.hash) {
                Some(h) => h,
                None => return,
            },
        };
        match self.blocks.get(b as usize) {
            Some(m) if m.ref_count > 0 && m.hash.is_none() => {}
            _ => return,
        }
        let mut h = DefaultHasher::new();
        h.write_u64(parent);
        // A marker and the length: a full block's chain hash never covers these bytes.
        h.write_u64(u64::MAX);
        h.write_usize(rest);
        write_tokens(&mut h, tokens, extra, full * bs..n);
        self.register(b, h.finish(), parent, tokens, extra, full * bs..n);
    }

    /// Drop one reference per table entry. Blocks reaching refcount 0 become evictable if they
    /// are registered in the cache, else free. Validated first: on error nothing changes.
    pub fn free(&mut self, table: &[BlockId]) -> Result<(), BlockError> {
        let mut counts: HashMap<BlockId, u32> = HashMap::with_capacity(table.len());
        for &b in table.iter().filter(|&&b| b != RELEASED) {
            let m = self
                .blocks
                .get(b as usize)
                .ok_or(BlockError::InvalidBlock(b))?;
            let c = counts.entry(b).or_insert(0);
            *c += 1;
            if *c > m.ref_count {
                return Err(BlockError::DoubleFree(b));
            }
        }
        // Reverse order: a prompt's tail blocks get older ticks and are evicted before its head,
        // keeping the (more shareable) prefix cached longest.
        for &b in table.iter().rev().filter(|&&b| b != RELEASED) {
            let m = &mut self.blocks[b as usize];
            m.ref_count -= 1;
            if m.ref_count == 0 {
                if m.hash.is_some() {
                    m.tick = self.next_tick;
                    self.next_tick += 1;
                    self.evictable.insert(m.tick, b);
                } else {
                    self.free.push(b);
                }
            }
        }
        Ok(())
    }

    pub fn stats(&self) -> &CacheStats {
        &self.stats
    }

    pub fn reset_stats(&mut self) {
        self.stats = CacheStats::default();
    }

    /// Checks: refcounts equal the references held by `live_tables`; free / evictable / used
    /// partition the pool; the hash map and the per-block hashes agree both ways; stats add up.
    pub fn check_invariants(&self, live_tables: &[&[BlockId]]) -> Result<(), String> {
        let n = self.blocks.len();
        let mut refs = vec![0u32; n];
        for t in live_tables {
            for &b in t.iter().filter(|&&b| b != RELEASED) {
                let r = refs
                    .get_mut(b as usize)
                    .ok_or(format!("live table holds invalid block {b}"))?;
                *r += 1;
            }
        }
        for (i, m) in self.blocks.iter().enumerate() {
            if m.ref_count != refs[i] {
                return Err(format!(
                    "block {i}: refcount {} but {} live references",
                    m.ref_count, refs[i]
                ));
            }
        }
        // 0 = used, 1 = free, 2 = evictable.
        let mut state = vec![0u8; n];
        for &b in &self.free {
            let m = self
                .blocks
                .get(b as usize)
                .ok_or(format!("free list holds invalid block {b}"))?;
            if state[b as usize] != 0 {
                return Err(format!("block {b} twice in free list"));
            }
            if m.ref_count != 0 || m.hash.is_some() {
                return Err(format!(
                    "free block {b} has refcount {} / hash {:?}",
                    m.ref_count, m.hash
                ));
            }
            state[b as usize] = 1;
        }
        for (&tick, &b) in &self.evictable {
            let m = self
                .blocks
                .get(b as usize)
                .ok_or(format!("LRU holds invalid block {b}"))?;
            if state[b as usize] != 0 {
                return Err(format!(
                    "block {b} both free and evictable, or twice in LRU"
                ));
            }
            if m.ref_count != 0 || m.hash.is_none() || m.tick != tick {
                return Err(format!(
                    "evictable block {b}: refcount {}, hash {:?}, tick {} vs {tick}",
                    m.ref_count, m.hash, m.tick
                ));
            }
            state[b as usize] = 2;
        }
        for (i, m) in self.blocks.iter().enumerate() {
            if m.ref_count == 0 && state[i] == 0 {
                return Err(format!(
                    "block {i} has refcount 0 but is neither free nor evictable (leak)"
                ));
            }
            if let Some(h) = m.hash {
                if self.cached.get(&h) != Some(&(i as BlockId)) {
                    return Err(format!(
                        "block {i} claims hash {h:#x} but the cache maps it elsewhere"
                    ));
                }
            }
        }
        for (&h, &b) in &self.cached {
            if self.blocks.get(b as usize).and_then(|m| m.hash) != Some(h) {
                return Err(format!(
                    "cache maps {h:#x} to block {b} whose stored hash differs"
                ));
            }
        }
        if self.contents.count() != self.cached.len() || self.cached.values().any(|&b| !self.contents.holds(b)) {
            return Err(format!("{} blocks cached but {} with recorded tokens", self.cached.len(), self.contents.count()));
        }
        if !self.prefix_caching && !self.cached.is_empty() {
            return Err("prefix caching is off but blocks are registered".into());
        }
        let s = &self.stats;
        if s.cached_tokens + s.computed_tokens != s.prompt_tokens {
            return Err(format!("stats do not add up: {s:?}"));
        }
        Ok(())
    }
}

/// Feeds `tokens[range]` with their per-token keys (a shorter `extra` padded with 0) to `h`.
fn write_tokens(h: &mut DefaultHasher, tokens: &[u32], extra: &[u64], range: std::ops::Range<usize>) {
    for j in range {
        h.write_u32(tokens[j]);
        h.write_u64(extra.get(j).copied().unwrap_or(0));
    }
}

#[cfg(test)]
#[path = "block_manager_tests.rs"]
mod tests;
