//! What each cached block holds, token by token, so a prompt can reuse part of a block.
//!
//! The prefix cache matches whole blocks by chained hash. A prompt that parts from a cached one
//! inside a block would compute again up to `block_size - 1` tokens whose K/V the cache holds:
//! in the five-agent workload every call parts from the dialogue's earlier calls somewhere
//! inside its instructions, so on average half a block per call. llama.cpp's slot cache and
//! SGLang's radix cache match single tokens. Here every registered block keeps its tokens (and
//! per-token keys) under the chain hash of the block before it, so the block after a prompt's
//! last full match can be compared token by token with its cached siblings, and the leading
//! rows it shares with one of them copied instead of computed.

use std::collections::HashMap;

use super::block_manager::BlockId;

/// One cached block's tokens with their per-token keys (0 = none).
type Tokens = Box<[(u32, u64)]>;

#[derive(Default)]
pub struct BlockContents {
    /// Chain hash of the block before (0 for a prompt's first block) → the cached blocks that
    /// follow it, with their tokens.
    by_parent: HashMap<u64, Vec<(BlockId, Tokens)>>,
    parent_of: HashMap<BlockId, u64>,
}

impl BlockContents {
    /// Records block `b`, registered after the block hashed `parent`, holding `tokens` with
    /// their `extra` keys (a shorter `extra` is padded with 0, as the hashes pad it).
    pub fn insert(&mut self, parent: u64, b: BlockId, tokens: &[u32], extra: &[u64]) {
        let t: Tokens = tokens.iter().enumerate().map(|(j, &t)| (t, extra.get(j).copied().unwrap_or(0))).collect();
        self.by_parent.entry(parent).or_default().push((b, t));
        self.parent_of.insert(b, parent);
    }

    /// Forgets block `b` (it left the cache).
    pub fn remove(&mut self, b: BlockId) {
        let Some(parent) = self.parent_of.remove(&b) else { return };
        if let Some(v) = self.by_parent.get_mut(&parent) {
            v.retain(|(id, _)| *id != b);
            if v.is_empty() {
                self.by_parent.remove(&parent);
            }
        }
    }

    /// The cached block after `parent` whose leading tokens agree longest with `tokens`
    /// (keys included), and how many agree: at most `max`, at least one, else None.
    pub fn longest(&self, parent: u64, tokens: &[u32], extra: &[u64], max: usize) -> Option<(BlockId, usize)> {
        let want = |j: usize| (tokens[j], extra.get(j).copied().unwrap_or(0));
        let n = max.min(tokens.len());
        self.by_parent
            .get(&parent)?
            .iter()
            .map(|(b, t)| (*b, t.iter().take(n).enumerate().take_while(|&(j, &x)| x == want(j)).count()))
            .filter(|&(_, run)| run > 0)
            .max_by_key(|&(b, run)| (run, std::cmp::Reverse(b)))
    }

    /// Blocks recorded (for the manager's invariant check).
    pub fn count(&self) -> usize {
        self.parent_of.len()
    }

    /// Whether block `b` is recorded.
    pub fn holds(&self, b: BlockId) -> bool {
        self.parent_of.contains_key(&b)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_run_among_siblings_keys_included() {
        let mut c = BlockContents::default();
        c.insert(7, 1, &[1, 2, 3, 4], &[]);
        c.insert(7, 2, &[1, 2, 9, 9], &[]);
        c.insert(7, 3, &[1, 2, 3, 4], &[0, 0, 5]);
        c.insert(8, 4, &[1, 2, 3, 4], &[]);
        assert_eq!(c.longest(7, &[1, 2, 3, 7], &[], 3), Some((1, 3)));
        // At most `max`, and the lower block id among equals.
        assert_eq!(c.longest(7, &[1, 2, 3, 4], &[], 2), Some((1, 2)));
        // A per-token key (an image) must agree too.
        assert_eq!(c.longest(7, &[1, 2, 3, 4], &[0, 0, 5], 3), Some((3, 3)));
        assert_eq!(c.longest(7, &[5], &[], 3), None);
        assert_eq!(c.longest(9, &[1], &[], 3), None);
        c.remove(1);
        c.remove(3);
        assert_eq!(c.longest(7, &[1, 2, 3, 7], &[], 3), Some((2, 2)));
        c.remove(2);
        assert!(!c.by_parent.contains_key(&7));
        assert_eq!(c.count(), 1);
        assert!(c.holds(4) && !c.holds(2));
    }

    use crate::engine::block_manager::{BlockManager, RowCopy};

    fn toks(n: usize, base: u32) -> Vec<u32> {
        (0..n as u32).map(|i| base + i).collect()
    }

    #[test]
    fn a_prompt_parting_inside_a_block_takes_the_rows_it_shares() {
        let mut bm = BlockManager::new(8, 4, true);
        let a = toks(10, 0);
        let t = bm.allocate(&a, &[]).unwrap().table;
        bm.commit(&t, &a, &[], a.len());
        bm.free(&t).unwrap();
        // Shares 6 tokens: block 0 by hash, then 2 rows of block 1.
        let mut b = toks(6, 0);
        b.extend([90, 91, 92]);
        let got = bm.allocate_capped(&b, &[], usize::MAX, true).unwrap();
        assert_eq!(got.num_cached_tokens, 6);
        assert_eq!(got.table[0], t[0]);
        assert_eq!(got.copy, Some(RowCopy { src: t[1], dst: got.table[1], rows: 2 }));
        // The source is held for the copy: the tables and it account for every reference.
        bm.check_invariants(&[&got.table, &[t[1]]]).unwrap();
        bm.free(&[t[1]]).unwrap();
        bm.check_invariants(&[&got.table]).unwrap();
        assert_eq!(bm.stats().cached_tokens, 6);
        // Block-granular without `partial`, and never the prompt's last token.
        bm.free(&got.table).unwrap();
        assert_eq!(bm.allocate(&b, &[]).unwrap().num_cached_tokens, 4);
        let mut bm = BlockManager::new(8, 4, true);
        let t = bm.allocate(&a, &[]).unwrap().table;
        bm.commit(&t, &a, &[], a.len());
        bm.free(&t).unwrap();
        let again = bm.allocate_capped(&a[..8], &[], usize::MAX, true).unwrap();
        assert_eq!((again.num_cached_tokens, again.copy.map(|c| c.rows)), (7, Some(3)));
    }

    #[test]
    fn a_finished_tables_last_part_is_reused_in_part() {
        let mut bm = BlockManager::new(8, 4, true);
        let a = toks(10, 0);
        let t = bm.allocate(&a, &[]).unwrap().table;
        bm.commit(&t, &a, &[], a.len());
        bm.commit_tail(&t, &a, &[], a.len());
        bm.free(&t).unwrap();
        bm.check_invariants(&[]).unwrap();
        // The same prompt extended: two full blocks by hash, the two rows of the tail.
        let mut b = a.clone();
        b.push(99);
        let got = bm.allocate_capped(&b, &[], usize::MAX, true).unwrap();
        assert_eq!((got.num_cached_tokens, got.copy), (10, Some(RowCopy { src: t[2], dst: got.table[2], rows: 2 })));
        bm.free(&[t[2]]).unwrap();
        bm.check_invariants(&[&got.table]).unwrap();
    }

    #[test]
    fn a_short_pool_leaves_the_source_where_it_was() {
        let mut bm = BlockManager::new(3, 4, true);
        let a = toks(8, 0);
        let t = bm.allocate(&a, &[]).unwrap().table;
        bm.commit(&t, &a, &[], a.len());
        bm.free(&t).unwrap();
        let mut b = toks(6, 0);
        b.extend(toks(10, 50));
        // Block 0 matched, block 1's source pinned, and the 3 fresh blocks wanted are not there.
        assert!(bm.allocate_capped(&b, &[], usize::MAX, true).is_none());
        bm.check_invariants(&[]).unwrap();
        assert_eq!(bm.num_available(), 3);
        // The source still leaves the cache before the block freed earlier than it (block 0).
        let c = bm.allocate(&toks(8, 100), &[]).unwrap();
        assert!(c.table.contains(&t[1]) && !c.table.contains(&t[0]));
    }
}
