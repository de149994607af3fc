//! Unit tests of `block_manager` (a file of their own to keep the manager short).
use super::*;

fn toks(n: usize, base: u32) -> Vec<u32> {
    (0..n as u32).map(|i| base + i).collect()
}

#[test]
fn reuse_shared_prefix() {
    let mut bm = BlockManager::new(16, 4, true);
    let a_toks = toks(10, 0);
    let a = bm.allocate(&a_toks, &[]).unwrap();
    assert_eq!(a.table.len(), 3);
    assert_eq!(a.num_cached_tokens, 0);
    // Nothing committed yet: an identical prompt must not match uncomputed blocks.
    let early = bm.allocate(&a_toks, &[]).unwrap();
    assert_eq!(early.num_cached_tokens, 0);
    bm.free(&early.table).unwrap();
    bm.commit(&a.table, &a_toks, &[], 10);
    let mut b_toks = toks(8, 0);
    b_toks.extend([100, 101, 102]);
    let b = bm.allocate(&b_toks, &[]).unwrap();
    assert_eq!(b.num_cached_tokens, 8);
    assert_eq!(&b.table[..2], &a.table[..2]);
    assert_ne!(b.table[2], a.table[2]);
    assert_eq!(bm.ref_count(a.table[0]), Some(2));
    bm.check_invariants(&[&a.table, &b.table]).unwrap();
    assert_eq!(bm.stats().cached_tokens, 8);
    assert_eq!(bm.stats().prompt_tokens, 31);
}

#[test]
fn different_extra_does_not_match() {
    let mut bm = BlockManager::new(16, 4, true);
    let t = vec![7u32; 9];
    let img1 = vec![11u64; 9];
    let img2 = vec![22u64; 9];
    let a = bm.allocate(&t, &img1).unwrap();
    bm.commit(&a.table, &t, &img1, 9);
    let b = bm.allocate(&t, &img2).unwrap();
    assert_eq!(b.num_cached_tokens, 0);
    let c = bm.allocate(&t, &img1).unwrap();
    assert_eq!(c.num_cached_tokens, 8);
    assert_ne!(bm.block_hashes(&t, &img1), bm.block_hashes(&t, &img2));
    assert_eq!(bm.block_hashes(&t, &[]), bm.block_hashes(&t, &[0; 9]));
    bm.check_invariants(&[&a.table, &b.table, &c.table])
        .unwrap();
}

#[test]
fn never_all_cached() {
    let mut bm = BlockManager::new(16, 4, true);
    let t = toks(8, 0);
    let a = bm.allocate(&t, &[]).unwrap();
    bm.commit(&a.table, &t, &[], 8);
    bm.free(&a.table).unwrap();
    // Exactly two full blocks cached: only the first may be reused.
    let b = bm.allocate(&t, &[]).unwrap();
    assert_eq!(b.num_cached_tokens, 4);
    assert_eq!(b.table.len(), 2);
    assert_eq!(b.table[0], a.table[0]);
    assert_ne!(b.table[1], a.table[1]);
    bm.check_invariants(&[&b.table]).unwrap();
}

#[test]
fn eviction_is_lru_by_free_time() {
    let mut bm = BlockManager::new(3, 2, true);
    let (t1, t2, t3) = (vec![1, 1, 9], vec![2, 2, 9], vec![3, 3, 9]);
    let a = bm.allocate(&t1, &[]).unwrap();
    bm.commit(&a.table, &t1, &[], 3);
    bm.free(&a.table).unwrap(); // block a0 evictable, a1 free
    let b = bm.allocate(&t2, &[]).unwrap();
    bm.commit(&b.table, &t2, &[], 3);
    bm.free(&b.table).unwrap();
    assert_eq!(bm.num_available(), 3);
    // Only one never-cached block left besides the two cached ones: t3 needs 2 blocks, so
    // the least recently freed cached block (t1's) is evicted.
    let c = bm.allocate(&t3, &[]).unwrap();
    assert_eq!(bm.stats().evictions, 1);
    assert!(c.table.contains(&a.table[0]));
    bm.free(&c.table).unwrap();
    assert_eq!(bm.allocate(&t1, &[]).unwrap().num_cached_tokens, 0);
    // Same pool shape, opposite free order: the most recently used prefix survives.
    let mut bm2 = BlockManager::new(2, 2, true);
    let a = bm2.allocate(&[1, 1], &[]).unwrap();
    bm2.commit(&a.table, &[1, 1], &[], 2);
    let b = bm2.allocate(&[2, 2], &[]).unwrap();
    bm2.commit(&b.table, &[2, 2], &[], 2);
    bm2.free(&b.table).unwrap(); // t2 freed first → evicted first
    bm2.free(&a.table).unwrap();
    let c = bm2.allocate(&[3, 3], &[]).unwrap();
    assert_eq!(c.table, b.table);
    bm2.free(&c.table).unwrap();
    let d = bm2.allocate(&[1, 1, 9], &[]).unwrap();
    assert_eq!((d.table[0], d.num_cached_tokens), (a.table[0], 2));
    bm2.check_invariants(&[&d.table]).unwrap();
}

#[test]
fn revive_counts_against_availability() {
    let mut bm = BlockManager::new(2, 2, true);
    let t = vec![5, 5, 6];
    let a = bm.allocate(&t, &[]).unwrap();
    bm.commit(&a.table, &t, &[], 3);
    bm.free(&a.table).unwrap();
    let b = bm.allocate(&t, &[]).unwrap();
    assert_eq!(b.num_cached_tokens, 2);
    assert_eq!(bm.num_available(), 0);
    bm.check_invariants(&[&b.table]).unwrap();
}

#[test]
fn grow_and_blocks_needed() {
    let mut bm = BlockManager::new(4, 4, false);
    let mut a = bm.allocate(&toks(3, 0), &[]).unwrap().table;
    assert_eq!(bm.blocks_needed(3, 4), 0);
    assert_eq!(bm.blocks_needed(4, 5), 1);
    assert_eq!(bm.blocks_needed(5, 3), 0);
    assert!(bm.grow(&mut a, 4));
    assert_eq!(a.len(), 1);
    assert!(bm.grow(&mut a, 9));
    assert_eq!(a.len(), 3);
    assert!(!bm.grow(&mut a, 17));
    assert_eq!(a.len(), 3);
    assert!(bm.grow(&mut a, 16));
    assert!(bm.grow(&mut a, 2)); // shrinking request: no-op
    assert_eq!(a.len(), 4);
    bm.check_invariants(&[&a]).unwrap();
}

#[test]
fn out_of_blocks_changes_nothing() {
    let mut bm = BlockManager::new(3, 2, true);
    let t = vec![1, 2, 3];
    let a = bm.allocate(&t, &[]).unwrap();
    bm.commit(&a.table, &t, &[], 3);
    bm.free(&a.table).unwrap();
    let before = (bm.num_available(), bm.stats().clone());
    assert!(bm.allocate(&toks(7, 50), &[]).is_none());
    assert_eq!((bm.num_available(), bm.stats().clone()), before);
    // The cached block survived the failed attempt.
    assert_eq!(bm.allocate(&t, &[]).unwrap().num_cached_tokens, 2);
}

#[test]
fn double_free_is_an_error() {
    let mut bm = BlockManager::new(4, 2, true);
    let a = bm.allocate(&toks(3, 0), &[]).unwrap();
    bm.free(&a.table).unwrap();
    assert_eq!(bm.free(&a.table), Err(BlockError::DoubleFree(a.table[0])));
    let b = bm.allocate(&toks(1, 0), &[]).unwrap();
    // Same block twice in one call is a double free too, and nothing is released.
    assert!(bm.free(&[b.table[0], b.table[0]]).is_err());
    assert_eq!(bm.free(&[99]), Err(BlockError::InvalidBlock(99)));
    bm.check_invariants(&[&b.table]).unwrap();
    bm.free(&b.table).unwrap();
    assert_eq!(bm.num_available(), 4);
}

#[test]
fn prefix_caching_disabled() {
    let mut bm = BlockManager::new(8, 2, false);
    let t = toks(5, 0);
    let a = bm.allocate(&t, &[]).unwrap();
    bm.commit(&a.table, &t, &[], 5);
    let b = bm.allocate(&t, &[]).unwrap();
    assert_eq!(b.num_cached_tokens, 0);
    assert!(a.table.iter().all(|&x| bm.cached_hash(x).is_none()));
    bm.free(&a.table).unwrap();
    bm.free(&b.table).unwrap();
    bm.check_invariants(&[]).unwrap();
    assert_eq!(bm.num_available(), 8);
}

#[test]
fn a_prompt_parting_inside_a_block_takes_the_rows_it_shares() {
    let mut bm = BlockManager::new(8, 4, true).with_partial_reuse(true);
    let a = toks(10, 0);
    let t = bm.allocate(&a, &[]).unwrap().table;
    bm.commit(&t, &a, &[], a.len());
    bm.free(&t).unwrap();
    // Shares 6 tokens: block 0 by hash, then 2 rows of block 1.
    let mut b = toks(6, 0);
    b.extend([90, 91, 92]);
    let got = bm.allocate_capped(&b, &[], usize::MAX).unwrap();
    assert_eq!(got.num_cached_tokens, 6);
    assert_eq!(got.table[0], t[0]);
    assert_eq!(got.copy, Some(RowCopy { src: t[1], dst: got.table[1], rows: 2 }));
    // The source is held for the copy: the tables and it account for every reference.
    bm.check_invariants(&[&got.table, &[t[1]]]).unwrap();
    bm.free(&[t[1]]).unwrap();
    bm.check_invariants(&[&got.table]).unwrap();
    assert_eq!(bm.stats().cached_tokens, 6);
    // Block-granular without partial reuse.
    let mut plain = BlockManager::new(8, 4, true);
    let t = plain.allocate(&a, &[]).unwrap().table;
    plain.commit(&t, &a, &[], a.len());
    plain.free(&t).unwrap();
    assert_eq!(plain.allocate(&b, &[]).unwrap().num_cached_tokens, 4);
    // Never the prompt's last token.
    let mut bm = BlockManager::new(8, 4, true).with_partial_reuse(true);
    let t = bm.allocate(&a, &[]).unwrap().table;
    bm.commit(&t, &a, &[], a.len());
    bm.free(&t).unwrap();
    let again = bm.allocate_capped(&a[..8], &[], usize::MAX).unwrap();
    assert_eq!((again.num_cached_tokens, again.copy.map(|c| c.rows)), (7, Some(3)));
}

#[test]
fn a_finished_tables_last_part_is_reused_in_part() {
    let mut bm = BlockManager::new(8, 4, true).with_partial_reuse(true);
    let a = toks(10, 0);
    let t = bm.allocate(&a, &[]).unwrap().table;
    bm.commit(&t, &a, &[], a.len());
    bm.commit_tail(&t, &a, &[], a.len());
    bm.free(&t).unwrap();
    bm.check_invariants(&[]).unwrap();
    // The same prompt extended: two full blocks by hash, the two rows of the tail.
    let mut b = a.clone();
    b.push(99);
    let got = bm.allocate_capped(&b, &[], usize::MAX).unwrap();
    assert_eq!((got.num_cached_tokens, got.copy), (10, Some(RowCopy { src: t[2], dst: got.table[2], rows: 2 })));
    bm.free(&[t[2]]).unwrap();
    bm.check_invariants(&[&got.table]).unwrap();
}

#[test]
fn a_short_pool_leaves_the_source_where_it_was() {
    let mut bm = BlockManager::new(3, 4, true).with_partial_reuse(true);
    let a = toks(8, 0);
    let t = bm.allocate(&a, &[]).unwrap().table;
    bm.commit(&t, &a, &[], a.len());
    bm.free(&t).unwrap();
    let mut b = toks(6, 0);
    b.extend(toks(10, 50));
    // Block 0 matched, block 1's source pinned, and the 3 fresh blocks wanted are not there.
    assert!(bm.allocate_capped(&b, &[], usize::MAX).is_none());
    bm.check_invariants(&[]).unwrap();
    assert_eq!(bm.num_available(), 3);
    // The source still leaves the cache before the block freed earlier than it (block 0).
    let c = bm.allocate(&toks(8, 100), &[]).unwrap();
    assert!(c.table.contains(&t[1]) && !c.table.contains(&t[0]));
}
