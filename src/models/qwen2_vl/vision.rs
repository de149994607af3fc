//! Vision towers of both variants in one place: the variant picks the norm (LayerNorm vs
//! RMSNorm), the MLP (QuickGELU vs SwiGLU) and whether window attention is used (Qwen2.5-VL).
//! The block, patch embedding and 2-D rotary are shared with Qwen3-VL (`layers::vision`).
//!
//! Input: patches `[N, C*T*P*P]` in the processor's order (merge-block major) plus one
//! `(t, h, w)` grid per image/video; output: merged tokens `[N / merge², out_hidden]`.

use candle_core::{DType, Module, Result, Tensor};

use super::config::{Variant, VisionConfig};
use crate::layers::vision::{check_patches, frame_bounds, patch_embed, PatchShape, VisionBlock, VisionRotary};
use crate::layers::{linear, Linear, Mlp, Norm};
use crate::weights::Weights;

pub struct VisionTower {
    patch_embed: Linear,
    blocks: Vec<VisionBlock>,
    merger_norm: Norm,
    merger_fc1: Linear,
    merger_fc2: Linear,
    rotary: VisionRotary,
    cfg: VisionConfig,
    variant: Variant,
    dtype: DType,
}

impl VisionTower {
    pub fn new(variant: Variant, cfg: &VisionConfig, vb: Weights) -> Result<Self> {
        let w = cfg.width;
        let shape = PatchShape { in_channels: cfg.in_channels, temporal: cfg.temporal_patch_size, patch: cfg.patch_size };
        let patch_embed = patch_embed(w, shape, false, vb.pp("patch_embed").pp("proj"))?;
        let norm = |vb: Weights| match variant {
            Variant::Qwen2Vl => Norm::layer(w, 1e-6, vb),
            Variant::Qwen25Vl => Norm::rms(w, 1e-6, vb),
        };
        let mut blocks = Vec::with_capacity(cfg.depth);
        for i in 0..cfg.depth {
            let bvb = vb.pp("blocks").pp(i);
            let mlp = match variant {
                Variant::Qwen2Vl => Mlp::plain(w, cfg.mlp_width, cfg.hidden_act, bvb.pp("mlp"))?,
                Variant::Qwen25Vl => Mlp::gated(w, cfg.mlp_width, true, cfg.hidden_act, bvb.pp("mlp"))?,
            };
            blocks.push(VisionBlock::new(w, cfg.num_heads, norm, mlp, bvb)?);
        }
        let merged = w * cfg.spatial_merge_size * cfg.spatial_merge_size;
        let mvb = vb.pp("merger");
        Ok(VisionTower {
            patch_embed,
            blocks,
            merger_norm: norm(mvb.pp("ln_q"))?,
            merger_fc1: linear(merged, merged, true, mvb.pp("mlp").pp("0"))?,
            merger_fc2: linear(merged, cfg.out_hidden_size, true, mvb.pp("mlp").pp("2"))?,
            rotary: VisionRotary::new(cfg.head_dim(), cfg.spatial_merge_size),
            cfg: cfg.clone(),
            variant,
            dtype: vb.dtype(),
        })
    }

    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Encodes all images (or all videos) of a request at once.
    pub fn forward(&self, pixels: &Tensor, grids: &[[usize; 3]]) -> Result<Tensor> {
        let dev = pixels.device().clone();
        let n = pixels.dim(0)?;
        check_patches(n, grids)?;
        let unit = self.cfg.spatial_merge_size * self.cfg.spatial_merge_size;
        let mut x = self.patch_embed.forward(&pixels.to_dtype(self.dtype())?)?;
        let (mut cos, mut sin) = self.rotary.tables(grids, &dev)?;
        let frames = frame_bounds(grids);
        let mut order: Option<Vec<u32>> = None;
        let windows = if self.variant == Variant::Qwen25Vl {
            let (index, bounds) = window_index(grids, &self.cfg);
            // Reorder merge units so that every window is a contiguous run of tokens.
            x = permute_units(&x, &index, unit)?;
            cos = permute_units(&cos, &index, unit)?;
            sin = permute_units(&sin, &index, unit)?;
            order = Some(index);
            bounds
        } else {
            frames.clone()
        };
        for (i, blk) in self.blocks.iter().enumerate() {
            let full = self.variant == Variant::Qwen2Vl || self.cfg.fullatt_block_indexes.contains(&i);
            let segs = if full { &frames } else { &windows };
            x = blk.forward(&x, &cos, &sin, segs)?;
        }
        let merged_dim = self.cfg.width * unit;
        let y = self.merger_norm.forward(&x)?.reshape((n / unit, merged_dim))?;
        let y = self.merger_fc2.forward(&self.merger_fc1.forward(&y)?.gelu_erf()?)?;
        match order {
            Some(index) => {
                let mut inverse = vec![0u32; index.len()];
                for (pos, &src) in index.iter().enumerate() {
                    inverse[src as usize] = pos as u32;
                }
                y.index_select(&Tensor::new(inverse, &dev)?, 0)
            }
            None => Ok(y),
        }
    }
}

/// Qwen2.5-VL windows: merge units are regrouped into square windows of
/// `window_size / merge / patch` units per side (edge windows are smaller). Returns the unit
/// permutation and the (start, len) of each non-empty window in patch tokens.
pub fn window_index(grids: &[[usize; 3]], cfg: &VisionConfig) -> (Vec<u32>, Vec<(usize, usize)>) {
    let m = cfg.spatial_merge_size;
    let win = (cfg.window_size / m / cfg.patch_size).max(1);
    let unit = m * m;
    let mut index = Vec::new();
    let mut bounds = Vec::new();
    let mut base = 0usize;
    let mut start = 0usize;
    for &[t, h, w] in grids {
        let (lh, lw) = (h / m, w / m);
        for ti in 0..t {
            for wy in 0..lh.div_ceil(win) {
                for wx in 0..lw.div_ceil(win) {
                    let mut count = 0;
                    for y in wy * win..((wy + 1) * win).min(lh) {
                        for x in wx * win..((wx + 1) * win).min(lw) {
                            index.push((base + ti * lh * lw + y * lw + x) as u32);
                            count += 1;
                        }
                    }
                    bounds.push((start, count * unit));
                    start += count * unit;
                }
            }
        }
        base += t * lh * lw;
    }
    (index, bounds)
}

/// Reorders rows in groups of `unit` (one merge unit = `unit` consecutive patch rows).
fn permute_units(x: &Tensor, index: &[u32], unit: usize) -> Result<Tensor> {
    let (n, d) = x.dims2()?;
    let idx = Tensor::new(index, x.device())?;
    x.reshape((n / unit, unit * d))?.index_select(&idx, 0)?.reshape((n, d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layers::Act;

    fn cfg() -> VisionConfig {
        VisionConfig {
            depth: 1, width: 16, num_heads: 2, mlp_width: 32, out_hidden_size: 8, patch_size: 14,
            spatial_merge_size: 2, temporal_patch_size: 2, in_channels: 3, hidden_act: Act::Silu,
            window_size: 56, fullatt_block_indexes: vec![], tokens_per_second: 2.0,
        }
    }

    #[test]
    fn windows_cover_every_unit_once() {
        // 5x3 merge units with 2x2 windows: 3 rows of windows x 2 cols, edge windows smaller.
        let (index, bounds) = window_index(&[[2, 10, 6]], &cfg());
        let mut seen = index.clone();
        seen.sort();
        assert_eq!(seen, (0..30).collect::<Vec<u32>>());
        assert_eq!(bounds.len(), 12);
        assert_eq!(bounds[0], (0, 16));
        assert_eq!(bounds.iter().map(|b| b.1).sum::<usize>(), 120);
        // First window of the first frame: units (0,0),(0,1),(1,0),(1,1) of a 3-wide grid.
        assert_eq!(&index[..4], &[0, 1, 3, 4]);
    }
}
