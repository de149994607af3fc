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
}
