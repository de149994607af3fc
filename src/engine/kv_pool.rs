//! The one KV-cache pool: per layer, K and V tensors of `num_blocks * block_size` token slots.
//! The block manager decides which slots a sequence owns; this file only moves tensors.
//! Writes are in place (`scatter_set`), reads gather a sequence's slots into a dense tensor
//! for attention (custom paged kernels can replace the gather later, behind the same API).

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device, Tensor};

use crate::config::TextConfig;

pub struct KvPool {
    k: Vec<Tensor>,
    v: Vec<Tensor>,
    pub block_size: usize,
    pub num_blocks: usize,
    kv_heads: usize,
    head_dim: usize,
}

/// How much memory the pool may take.
#[derive(Clone, Debug, PartialEq)]
pub enum KvMemory {
    Bytes(u64),
    /// Fraction of the device's free memory (CUDA) or of available RAM (CPU).
    Fraction(f64),
    Blocks(usize),
}

impl std::str::FromStr for KvMemory {
    type Err = anyhow::Error;
    /// "0.5" (fraction), "4GiB", "512MiB", "1000000" (bytes), "blocks:64".
    fn from_str(s: &str) -> Result<Self> {
        let t = s.trim();
        if let Some(n) = t.strip_prefix("blocks:") {
            return Ok(KvMemory::Blocks(n.parse().with_context(|| format!("--kv-memory {s:?}: bad block count"))?));
        }
        let units = [("GiB", 1u64 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10), ("GB", 1_000_000_000), ("MB", 1_000_000), ("B", 1)];
        for (u, mul) in units {
            if let Some(n) = t.strip_suffix(u) {
                let v: f64 = n.trim().parse().with_context(|| format!("--kv-memory {s:?}: bad number"))?;
                return Ok(KvMemory::Bytes((v * mul as f64) as u64));
            }
        }
        let v: f64 = t.parse().with_context(|| format!("--kv-memory {s:?}: use a fraction like 0.5, bytes like 4GiB, or blocks:N"))?;
        if v > 0.0 && v <= 1.0 {
            Ok(KvMemory::Fraction(v))
        } else if v > 1.0 {
            Ok(KvMemory::Bytes(v as u64))
        } else {
            bail!("--kv-memory {s:?} must be positive")
        }
    }
}

/// Bytes of K+V one block takes across all layers.
pub fn bytes_per_block(cfg: &TextConfig, block_size: usize, dtype: DType) -> u64 {
    2 * cfg.num_hidden_layers as u64 * block_size as u64 * cfg.num_key_value_heads as u64 * cfg.head_dim() as u64 * dtype.size_in_bytes() as u64
}

fn available_bytes(device: &Device) -> Result<u64> {
    if device.is_cuda() {
        #[cfg(feature = "cuda")]
        {
            let (free, _total) = cudarc::driver::result::mem_get_info().context("querying free GPU memory")?;
            return Ok(free as u64);
        }
    }
    // CPU: MemAvailable from /proc/meminfo; elsewhere assume 4 GiB.
    let info = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let kb = info
        .lines()
        .find(|l| l.starts_with("MemAvailable:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|n| n.parse::<u64>().ok());
    Ok(kb.map(|k| k * 1024).unwrap_or(4 << 30))
}

pub fn num_blocks_for(mem: &KvMemory, cfg: &TextConfig, block_size: usize, dtype: DType, device: &Device) -> Result<usize> {
    let per = bytes_per_block(cfg, block_size, dtype);
    let n = match mem {
        KvMemory::Blocks(n) => *n,
        KvMemory::Bytes(b) => (*b / per) as usize,
        KvMemory::Fraction(f) => ((available_bytes(device)? as f64 * f) as u64 / per) as usize,
    };
    if n == 0 {
        bail!("--kv-memory {mem:?} holds no block of {block_size} tokens ({per} bytes each)");
    }
    Ok(n)
}

impl KvPool {
    pub fn new(cfg: &TextConfig, num_blocks: usize, block_size: usize, dtype: DType, device: &Device) -> Result<Self> {
        let (kvh, d) = (cfg.num_key_value_heads, cfg.head_dim());
        let slots = num_blocks * block_size;
        let mut k = Vec::with_capacity(cfg.num_hidden_layers);
        let mut v = Vec::with_capacity(cfg.num_hidden_layers);
        for _ in 0..cfg.num_hidden_layers {
            k.push(Tensor::zeros((slots, kvh * d), dtype, device)?);
            v.push(Tensor::zeros((slots, kvh * d), dtype, device)?);
        }
        Ok(KvPool { k, v, block_size, num_blocks, kv_heads: kvh, head_dim: d })
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
        let dtype = self.k[layer].dtype();
        self.k[layer].scatter_set(index, &k.reshape((n, w))?.to_dtype(dtype)?.contiguous()?, 0)?;
        self.v[layer].scatter_set(index, &v.reshape((n, w))?.to_dtype(dtype)?.contiguous()?, 0)?;
        Ok(())
    }

    /// K and V of the given slots, `[S, kv_heads, d]` each.
    pub fn gather(&self, layer: usize, slots: &Tensor) -> Result<(Tensor, Tensor)> {
        let s = slots.dim(0)?;
        let shape = (s, self.kv_heads, self.head_dim);
        let k = self.k[layer].index_select(slots, 0)?.reshape(shape)?;
        let v = self.v[layer].index_select(slots, 0)?.reshape(shape)?;
        Ok((k, v))
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
    }
}
