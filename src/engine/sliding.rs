//! The pool's sliding group: the blocks of a model's sliding-window layers (Gemma 3's local
//! layers), kept apart from the global layers' blocks so that a sequence holds only its
//! window's worth of them, whatever its length (vLLM's hybrid KV manager does the same with
//! one group per layer kind).
//!
//! Every sequence has a second block table here, indexed like its global one (block `i`
//! holds tokens `i·bs..(i+1)·bs`); the blocks before the window of the next query are given
//! back after each step and marked `RELEASED` in the table. A block given back after its K/V
//! was committed stays in this group's prefix cache (evictable, LRU) under the same chain
//! hash as the global group's block of the same tokens, so a later prompt can revive it.
//!
//! A prefix-cache hit of `k` blocks is usable only when this group still holds (or can
//! revive) every block from the window before the hit's end on: the next query sees back
//! that far. The scheduler cuts a global hit to the longest such `k` (`usable_hit`); the
//! global layers then recompute nothing they have, the sliding layers nothing they lack.

use super::block_manager::{BlockId, BlockManager, RELEASED};
use super::kv_pool::{GLOBAL, SLIDING};
use super::sequence::Sequence;

pub struct SlidingGroup {
    pub bm: BlockManager,
    /// Tokens each query sees back, itself included (the widest sliding layer's window).
    pub window: usize,
}

impl SlidingGroup {
    pub fn new(num_blocks: usize, block_size: usize, prefix_caching: bool, window: usize) -> Self {
        SlidingGroup { bm: BlockManager::new(num_blocks, block_size, prefix_caching), window: window.max(1) }
    }

    /// First position a query at `computed` or later can see: the window before `computed`,
    /// or the start of a bidirectional span (`(first, len)`, an image's tokens) that reaches
    /// past it, whose tokens see each other whatever the window.
    pub fn keep_from(&self, computed: usize, spans: &[(usize, usize)]) -> usize {
        let by_window = (computed + 1).saturating_sub(self.window);
        spans.iter().filter(|&&(a, l)| a + l > computed).map(|&(a, _)| a).fold(by_window, usize::min)
    }

    /// Blocks wholly before `keep_from`: nothing from `computed` on reads them.
    fn dead_blocks(&self, computed: usize, spans: &[(usize, usize)]) -> usize {
        self.keep_from(computed, spans) / self.bm.block_size()
    }

    /// The longest prefix-cache hit of at most `cap` blocks this group can resume from: every
    /// block between the window before the hit's end and that end is cached here (chain
    /// hashes of `tokens`, the same as the global group's).
    pub fn usable_hit(&self, tokens: &[u32], extra: &[u64], spans: &[(usize, usize)], cap: usize) -> usize {
        let bs = self.bm.block_size();
        let cap = cap.min(tokens.len() / bs);
        if cap == 0 || !self.bm.prefix_caching() {
            return 0;
        }
        let hashes = self.bm.block_hashes(&tokens[..cap * bs], extra);
        (0..=cap).rev().find(|&k| hashes[self.dead_blocks(k * bs, spans).min(k)..k].iter().all(|h| self.bm.holds(*h))).unwrap_or(0)
    }

    /// A table for a sequence of `len` tokens resuming after `hit` cached blocks (as
    /// `usable_hit` allowed): `RELEASED` before the window, the window's blocks revived from
    /// the cache, fresh blocks for the rest. None, nothing changed, if the pool is short.
    pub fn allocate(&mut self, tokens: &[u32], extra: &[u64], spans: &[(usize, usize)], hit: usize, len: usize) -> Option<Vec<BlockId>> {
        let bs = self.bm.block_size();
        let from = self.dead_blocks(hit * bs, spans).min(hit);
        let hashes = self.bm.block_hashes(&tokens[..hit * bs], extra);
        let mut table = vec![RELEASED; from];
        table.extend(self.bm.take(&hashes[from..], len.div_ceil(bs).saturating_sub(hit))?);
        Some(table)
    }

    /// Gives back the blocks of `table` that no query from `computed` on sees. Called after a
    /// step's commit, so the blocks it gives back are registered (and stay cached) when their
    /// K/V is complete.
    pub fn release(&mut self, table: &mut [BlockId], computed: usize, spans: &[(usize, usize)]) {
        let end = self.dead_blocks(computed, spans).min(table.len());
        let gone: Vec<BlockId> = table[..end].iter().copied().filter(|&b| b != RELEASED).collect();
        // Each block is held by this table once: freeing cannot fail.
        let _ = self.bm.free(&gone);
        table[..end].fill(RELEASED);
    }

    /// First token position whose block `table` still holds (its slots start there).
    pub fn first_held(&self, table: &[BlockId]) -> usize {
        table.iter().take_while(|&&b| b == RELEASED).count() * self.bm.block_size()
    }

    /// A sequence's block table in each pool group with layers, and the first token position
    /// whose block it still holds there.
    pub fn tables<'s>(sliding: Option<&SlidingGroup>, s: &'s Sequence) -> Vec<(usize, &'s [BlockId], usize)> {
        let mut t = vec![(GLOBAL, s.table.as_slice(), 0)];
        if let Some(g) = sliding {
            t.push((SLIDING, s.window_table.as_slice(), g.first_held(&s.window_table)));
        }
        t
    }

    /// Blocks a table holds (not given back).
    pub fn held(table: &[BlockId]) -> usize {
        table.iter().filter(|&&b| b != RELEASED).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn toks(n: usize) -> Vec<u32> {
        (0..n as u32).map(|i| 100 + i).collect()
    }

    /// A sequence decoding past its window holds at most ⌈window / bs⌉ + 1 blocks; the ones
    /// it gave back stay cached, so a prompt sharing the prefix revives the window's blocks
    /// only, and a hit whose window was evicted is cut to what is still cached.
    #[test]
    fn release_bounds_blocks_and_hits_need_the_window() {
        let (bs, w) = (4, 6);
        let mut g = SlidingGroup::new(32, bs, true, w);
        let t = toks(40);
        let mut table = g.allocate(&t, &[], &[], 0, 1).unwrap();
        for n in 1..=40 {
            assert!(g.bm.grow(&mut table, n));
            g.bm.commit(&table, &t, &[], n);
            g.release(&mut table, n, &[]);
            assert!(SlidingGroup::held(&table) <= w.div_ceil(bs) + 1, "{n}: {table:?}");
            assert!(g.first_held(&table) <= g.keep_from(n, &[]));
        }
        g.bm.check_invariants(&[&table]).unwrap();
        // Everything before was given back but cached: a hit of 9 blocks (36 tokens) needs
        // blocks 7 and 8 (tokens 31..36), revived, and the table starts released.
        assert_eq!(g.usable_hit(&t, &[], &[], 9), 9);
        let b = g.allocate(&t, &[], &[], 9, 40).unwrap();
        assert_eq!((&b[..7], b.len()), (&[RELEASED; 7][..], 10));
        let hashes = g.bm.block_hashes(&t[..36], &[]);
        assert_eq!((g.bm.cached_hash(b[7]), g.bm.cached_hash(b[8])), (Some(hashes[7]), Some(hashes[8])), "revived");
        assert_eq!(b[8], table[8], "block 8 still held by the first table");
        // An image span reaching back keeps its first block.
        assert_eq!(g.keep_from(36, &[(10, 30)]), 10);
        g.bm.free(&table).unwrap();
        g.bm.free(&b).unwrap();
        g.bm.check_invariants(&[]).unwrap();
        // A small pool evicts the early blocks: a hit needing them is cut.
        let mut small = SlidingGroup::new(3, bs, true, w);
        let mut t2 = small.allocate(&t, &[], &[], 0, 1).unwrap();
        for n in 1..=24 {
            assert!(small.bm.grow(&mut t2, n));
            small.bm.commit(&t2, &t, &[], n);
            small.release(&mut t2, n, &[]);
        }
        small.bm.free(&t2).unwrap();
        assert!(!small.bm.holds(small.bm.block_hashes(&t[..bs], &[])[0]), "the first block was evicted");
        assert_eq!(small.usable_hit(&t, &[], &[], 6), 6, "the window's blocks are still cached");
        // An image over tokens 0..25 makes a query at 24 see token 0, whose block is gone.
        assert_eq!(small.usable_hit(&t, &[], &[(0, 25)], 6), 0);
        assert!(small.allocate(&t, &[], &[], 6, 24).is_some());
    }
}
