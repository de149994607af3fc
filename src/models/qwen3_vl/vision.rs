//! The Qwen3-VL vision tower (also Qwen3.5's): a Conv3d patch embedding with bias, a learned
//! square grid of position embeddings bilinearly interpolated to each item's grid, LayerNorm
//! blocks with a GELU (tanh) MLP and 2-D rotary, full attention within each frame, and a
//! patch merger. DeepStack: the outputs of the blocks in `deepstack_visual_indexes` go through
//! their own mergers (LayerNorm after the 2×2 shuffle) and come back as extra levels.

use candle_core::{DType, Device, Module, Result, Tensor};

use super::config::VisionConfig;
use crate::layers::vision::{check_patches, frame_bounds, merge_order, patch_embed, PatchShape, VisionBlock, VisionRotary};
use crate::layers::{linear, Linear, Mlp, Norm};
use crate::weights::Weights;

/// LayerNorm → fc1 → GELU (erf) → fc2 over 2×2-merged patches. The main merger normalises
/// each patch before merging; DeepStack mergers normalise the merged vector.
struct Merger {
    norm: Norm,
    post_shuffle: bool,
    fc1: Linear,
    fc2: Linear,
    merged: usize,
}

impl Merger {
    fn new(cfg: &VisionConfig, post_shuffle: bool, w: Weights) -> Result<Self> {
        let unit = cfg.spatial_merge_size * cfg.spatial_merge_size;
        let merged = cfg.hidden_size * unit;
        Ok(Merger {
            norm: Norm::layer(if post_shuffle { merged } else { cfg.hidden_size }, 1e-6, w.pp("norm"))?,
            post_shuffle,
            fc1: linear(merged, merged, true, w.pp("linear_fc1"))?,
            fc2: linear(merged, cfg.out_hidden_size, true, w.pp("linear_fc2"))?,
            merged,
        })
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let rows = x.elem_count() / self.merged;
        let x = match self.post_shuffle {
            true => self.norm.forward(&x.reshape((rows, self.merged))?)?,
            false => self.norm.forward(x)?.reshape((rows, self.merged))?,
        };
        self.fc2.forward(&self.fc1.forward(&x)?.gelu_erf()?)
    }
}

pub struct VisionTower {
    patch_embed: Linear,
    pos_embed: Tensor,
    blocks: Vec<VisionBlock>,
    merger: Merger,
    deepstack: Vec<Merger>,
    rotary: VisionRotary,
    cfg: VisionConfig,
}

impl VisionTower {
    pub fn new(cfg: &VisionConfig, vb: Weights) -> Result<Self> {
        let w = cfg.hidden_size;
        let shape = PatchShape { in_channels: cfg.in_channels, temporal: cfg.temporal_patch_size, patch: cfg.patch_size };
        let mut blocks = Vec::with_capacity(cfg.depth);
        for i in 0..cfg.depth {
            let bvb = vb.pp("blocks").pp(i);
            let mlp = Mlp::plain_named(w, cfg.intermediate_size, cfg.hidden_act, bvb.pp("mlp"), ["linear_fc1", "linear_fc2"])?;
            blocks.push(VisionBlock::new(w, cfg.num_heads, |n| Norm::layer(w, 1e-6, n), mlp, bvb)?);
        }
        let deepstack = (0..cfg.deepstack_visual_indexes.len())
            .map(|i| Merger::new(cfg, true, vb.pp("deepstack_merger_list").pp(i)))
            .collect::<Result<Vec<_>>>()?;
        if vb.contains(&format!("deepstack_merger_list.{}.linear_fc1.weight", deepstack.len())) {
            candle_core::bail!(
                "the checkpoint has more DeepStack mergers than vision_config.deepstack_visual_indexes lists ({})",
                deepstack.len()
            );
        }
        Ok(VisionTower {
            patch_embed: patch_embed(w, shape, true, vb.pp("patch_embed").pp("proj"))?,
            pos_embed: vb.pp("pos_embed").get((cfg.num_position_embeddings, w), "weight")?,
            blocks,
            merger: Merger::new(cfg, false, vb.pp("merger"))?,
            deepstack,
            rotary: VisionRotary::new(cfg.head_dim(), cfg.spatial_merge_size),
            cfg: cfg.clone(),
        })
    }

    pub fn dtype(&self) -> DType {
        self.pos_embed.dtype()
    }

    /// Number of DeepStack levels each item yields.
    pub fn levels(&self) -> usize {
        self.deepstack.len()
    }

    /// Merged tokens `[N / merge², out]` of all items, and each DeepStack level of the same
    /// tokens (in the order the decoder adds them: block order).
    pub fn forward(&self, pixels: &Tensor, grids: &[[usize; 3]]) -> Result<(Tensor, Vec<Tensor>)> {
        let dev = pixels.device().clone();
        check_patches(pixels.dim(0)?, grids)?;
        let x = self.patch_embed.forward(&pixels.to_dtype(self.dtype())?)?;
        let mut x = (x + self.position_embeddings(grids, &dev)?)?;
        let (cos, sin) = self.rotary.tables(grids, &dev)?;
        let frames = frame_bounds(grids);
        let mut levels = Vec::with_capacity(self.deepstack.len());
        for (i, blk) in self.blocks.iter().enumerate() {
            x = blk.forward(&x, &cos, &sin, &frames)?;
            if let Some(k) = self.cfg.deepstack_visual_indexes.iter().position(|&b| b == i) {
                levels.push(self.deepstack[k].forward(&x)?);
            }
        }
        Ok((self.merger.forward(&x)?, levels))
    }

    /// transformers' `fast_pos_embed_interpolate`: for each patch, the four learned positions
    /// around its place on the square grid, bilinearly weighted (weights in f32, summed in the
    /// model dtype in the same order), in merge-block order and repeated for every frame.
    fn position_embeddings(&self, grids: &[[usize; 3]], dev: &Device) -> Result<Tensor> {
        let side = self.cfg.pos_side();
        let m = self.cfg.spatial_merge_size;
        let mut idx: [Vec<u32>; 4] = Default::default();
        let mut wts: [Vec<f32>; 4] = Default::default();
        for &[t, h, w] in grids {
            let (hs, ws) = (corners(side, h), corners(side, w));
            for _ in 0..t {
                for (r, c) in merge_order(h, w, m) {
                    let ((r0, r1, dr), (c0, c1, dc)) = (hs[r], ws[c]);
                    let cells = [(r0, c0), (r0, c1), (r1, c0), (r1, c1)];
                    let weights = [(1.0 - dr) * (1.0 - dc), (1.0 - dr) * dc, dr * (1.0 - dc), dr * dc];
                    for k in 0..4 {
                        idx[k].push((cells[k].0 * side + cells[k].1) as u32);
                        wts[k].push(weights[k]);
                    }
                }
            }
        }
        let n = idx[0].len();
        let mut sum: Option<Tensor> = None;
        for k in 0..4 {
            let rows = self.pos_embed.index_select(&Tensor::new(idx[k].as_slice(), dev)?, 0)?;
            let w = Tensor::from_vec(std::mem::take(&mut wts[k]), (n, 1), dev)?.to_dtype(self.dtype())?;
            let term = rows.broadcast_mul(&w)?;
            sum = Some(match sum {
                None => term,
                Some(s) => (s + term)?,
            });
        }
        sum.ok_or_else(|| candle_core::Error::Msg("no patches".into()))
    }
}

/// For each of `n` points spread evenly over `0..=side-1` (torch.linspace in f32): the grid
/// cell below, the one above (clamped), and the fraction between them.
fn corners(side: usize, n: usize) -> Vec<(usize, usize, f32)> {
    linspace(0.0, (side - 1) as f32, n)
        .into_iter()
        .map(|v| {
            let lo = v as usize; // truncation, like tensor.int()
            (lo, (lo + 1).min(side - 1), v - lo as f32)
        })
        .collect()
}

/// torch.linspace on CPU in f32: `start + step·i` for the first half, `end − step·(n−1−i)`
/// for the second, so both ends are exact.
fn linspace(start: f32, end: f32, n: usize) -> Vec<f32> {
    if n == 1 {
        return vec![start];
    }
    let step = (end - start) / (n - 1) as f32;
    let half = n / 2;
    (0..n).map(|i| if i < half { start + step * i as f32 } else { end - step * (n - 1 - i) as f32 }).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linspace_is_exact_at_both_ends_and_symmetric() {
        let v = linspace(0.0, 47.0, 7);
        assert_eq!((v[0], v[6]), (0.0, 47.0));
        assert!((v[3] - 23.5).abs() < 1e-6);
        assert_eq!(linspace(0.0, 7.0, 1), vec![0.0]);
        let c = corners(8, 3);
        assert_eq!(c, vec![(0, 1, 0.0), (3, 4, 0.5), (7, 7, 0.0)]);
    }
}
