//! Recurrent-state snapshots for hybrid models (Gated DeltaNet layers), so prefix caching
//! survives layers whose state cannot be rebuilt from K/V blocks.
//!
//! A snapshot is every recurrent layer's state of a sequence right after a block boundary,
//! keyed by the chained hash of the blocks before it — the same key the block manager gives
//! the last of those blocks. A new request whose prompt starts with those blocks resumes
//! there: K/V from the cached blocks, recurrent state from the snapshot. Snapshots are taken
//! only where requests branch (see `Sequence::snap_at`), within a byte budget, least recently
//! used first out.

use std::collections::{BTreeMap, HashMap};

use crate::models::RecurrentState;

struct Entry {
    states: Vec<RecurrentState>,
    bytes: u64,
    tick: u64,
}

#[derive(Clone, Debug, Default, serde::Serialize)]
pub struct SnapshotStats {
    pub stored: u64,
    pub restored: u64,
    pub evicted: u64,
    pub bytes: u64,
    pub budget: u64,
}

pub struct StateCache {
    entries: HashMap<u64, Entry>,
    lru: BTreeMap<u64, u64>,
    tick: u64,
    stats: SnapshotStats,
}

/// Bytes of a set of states (f32 host tensors).
fn size_of(states: &[RecurrentState]) -> u64 {
    states
        .iter()
        .flat_map(|s| [&s.conv, &s.ssm])
        .flatten()
        .map(|t| (t.elem_count() * t.dtype().size_in_bytes()) as u64)
        .sum()
}

impl StateCache {
    pub fn new(budget: u64) -> Self {
        StateCache { entries: HashMap::new(), lru: BTreeMap::new(), tick: 0, stats: SnapshotStats { budget, ..Default::default() } }
    }

    pub fn stats(&self) -> &SnapshotStats {
        &self.stats
    }

    pub fn contains(&self, key: u64) -> bool {
        self.entries.contains_key(&key)
    }

    /// The states after the blocks hashing to `key` (shared tensors: layers replace, never
    /// mutate, their state).
    pub fn get(&mut self, key: u64) -> Option<Vec<RecurrentState>> {
        self.tick += 1;
        let e = self.entries.get_mut(&key)?;
        self.lru.remove(&e.tick);
        e.tick = self.tick;
        self.lru.insert(self.tick, key);
        self.stats.restored += 1;
        Some(e.states.clone())
    }

    /// Keeps `states` under `key`, evicting the least recently used snapshots to fit; a
    /// snapshot larger than the whole budget is not kept.
    pub fn insert(&mut self, key: u64, states: &[RecurrentState]) {
        let bytes = size_of(states);
        if bytes > self.stats.budget || self.entries.contains_key(&key) {
            return;
        }
        while self.stats.bytes + bytes > self.stats.budget {
            let Some((_, old)) = self.lru.pop_first() else { break };
            if let Some(e) = self.entries.remove(&old) {
                self.stats.bytes -= e.bytes;
                self.stats.evicted += 1;
            }
        }
        self.tick += 1;
        self.lru.insert(self.tick, key);
        self.entries.insert(key, Entry { states: states.to_vec(), bytes, tick: self.tick });
        self.stats.bytes += bytes;
        self.stats.stored += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Tensor};

    fn states(v: f32) -> Vec<RecurrentState> {
        let t = Tensor::full(v, (4, 4), &Device::Cpu).unwrap().to_dtype(DType::F32).unwrap();
        vec![RecurrentState { conv: None, ssm: Some(t) }]
    }

    #[test]
    fn least_recently_used_goes_first() {
        let mut c = StateCache::new(2 * 64);
        c.insert(1, &states(1.0));
        c.insert(2, &states(2.0));
        assert!(c.get(1).is_some()); // 2 is now the oldest
        c.insert(3, &states(3.0));
        assert!(c.contains(1) && !c.contains(2) && c.contains(3));
        assert_eq!((c.stats().stored, c.stats().evicted, c.stats().bytes), (3, 1, 128));
        let s = c.get(3).unwrap();
        assert_eq!(s[0].ssm.as_ref().unwrap().to_vec2::<f32>().unwrap()[0][0], 3.0);
        let mut tiny = StateCache::new(10);
        tiny.insert(9, &states(0.0));
        assert!(!tiny.contains(9));
    }
}
