//! LLaVA-NeXT's image path: CLIP ViT features of every tile from the configured layer, the
//! two-layer projector, then transformers' `pack_image_features`: the overview tile's features,
//! then the grid's tiles stitched into one feature map, unpadded to the image, each row closed
//! by the learned `image_newline`.
//!
//! Input: patches `[tiles · side², 3·P·P]` as `vision::anyres::preprocess` cuts them (overview
//! first); output: `[tokens, text hidden]`, `tokens` = `AnyRes::tokens` of the image's size.

use anyhow::{ensure, Result};
use candle_core::{Module, Tensor};

use super::config::Config;
use crate::layers::vision::{patch_embed_2d, VitLayer};
use crate::layers::{act, linear, Act, Linear, Norm};
use crate::models::vlm::VisionEncoder;
use crate::models::MediaGrid;
use crate::vision::anyres::{unpadded, AnyRes};
use crate::weights::Weights;

/// Where a checkpoint keeps the image path's parts.
pub struct Prefixes {
    pub tower: Weights,
    pub projector: Weights,
    pub newline: Weights,
}

pub struct Tower {
    patch_embed: Linear,
    class: Tensor,
    positions: Tensor,
    pre_norm: Norm,
    /// The layers up to the configured feature layer (the rest are never run).
    layers: Vec<VitLayer>,
    proj1: Linear,
    proj2: Linear,
    proj_act: Act,
    /// `[1, 1, text hidden]`.
    newline: Tensor,
    anyres: AnyRes,
    side: usize,
}

impl Tower {
    pub fn new(cfg: &Config, w: Prefixes) -> Result<Self> {
        let v = &cfg.vision;
        let (width, hidden, side) = (v.layer.width, cfg.decoder.hidden(), v.side());
        let emb = w.tower.pp("embeddings");
        let layers = (0..cfg.feature_layers).map(|i| VitLayer::new(v.layer, w.tower.pp("encoder").pp("layers").pp(i))).collect::<candle_core::Result<_>>()?;
        Ok(Tower {
            patch_embed: patch_embed_2d(width, v.channels, v.patch_size, false, emb.pp("patch_embedding"))?,
            class: emb.get(width, "class_embedding")?.reshape((1, 1, width))?,
            positions: emb.pp("position_embedding").get((side * side + 1, width), "weight")?,
            // transformers' CLIP spells it `pre_layrnorm`.
            pre_norm: Norm::layer(width, v.layer.eps, w.tower.pp("pre_layrnorm"))?,
            layers,
            proj1: linear(width, hidden, cfg.projector_bias, w.projector.pp("linear_1"))?,
            proj2: linear(hidden, hidden, cfg.projector_bias, w.projector.pp("linear_2"))?,
            proj_act: cfg.projector_act,
            newline: w.newline.get(hidden, "image_newline")?.reshape((1, 1, hidden))?,
            anyres: cfg.anyres.clone(),
            side,
        })
    }

    /// Projected features `[tiles, side², hidden]` of every tile (class token dropped).
    fn tile_features(&self, patches: &Tensor, tiles: usize) -> Result<Tensor> {
        let n = self.side * self.side;
        ensure!(patches.dim(0)? == tiles * n, "vision input has {} patches but {tiles} tiles of {n}", patches.dim(0)?);
        let x = self.patch_embed.forward(&patches.to_dtype(self.class.dtype())?)?;
        let width = x.dim(1)?;
        let x = x.reshape((tiles, n, width))?;
        let x = Tensor::cat(&[&self.class.broadcast_as((tiles, 1, width))?, &x], 1)?.broadcast_add(&self.positions)?;
        let mut x = self.pre_norm.forward(&x.reshape((tiles * (n + 1), width))?)?;
        // Each tile is its own image to CLIP: attention stays within it.
        let segs: Vec<(usize, usize)> = (0..tiles).map(|t| (t * (n + 1), n + 1)).collect();
        for layer in &self.layers {
            x = layer.forward(&x, &segs)?;
        }
        let x = x.reshape((tiles, n + 1, width))?.narrow(1, 1, n)?.reshape((tiles * n, width))?;
        let y = self.proj2.forward(&act(self.proj_act, &self.proj1.forward(&x)?)?)?;
        Ok(y.reshape((tiles, n, y.dim(1)?))?)
    }

    /// transformers' `pack_image_features` for one image of `size` (height, width).
    fn pack(&self, tiles: &Tensor, size: [usize; 2]) -> Result<Tensor> {
        let (count, _, hidden) = tiles.dims3()?;
        let base = tiles.get(0)?;
        let newline = self.newline.to_dtype(tiles.dtype())?;
        if count == 1 {
            return Ok(Tensor::cat(&[base, newline.reshape((1, hidden))?], 0)?);
        }
        let [r, c] = self.anyres.grid(size);
        ensure!(count == 1 + r * c, "image of {}x{} takes {} tiles, {count} given", size[1], size[0], 1 + r * c);
        let s = self.side;
        let map = tiles.narrow(0, 1, r * c)?.reshape((r, c, s, s, hidden))?.permute((0, 2, 1, 3, 4))?.reshape((r * s, c * s, hidden))?;
        let u = unpadded(size, [r * s, c * s]);
        let map = map.narrow(0, u.row, u.rows)?.narrow(1, u.col, u.cols)?;
        let rows = Tensor::cat(&[&map, &newline.broadcast_as((u.rows, 1, hidden))?], 1)?;
        Ok(Tensor::cat(&[&base, &rows.reshape((u.rows * (u.cols + 1), hidden))?], 0)?)
    }
}

impl VisionEncoder for Tower {
    fn encode(&self, patches: &Tensor, grid: &MediaGrid) -> Result<(Tensor, Vec<Tensor>)> {
        ensure!(!grid.is_video, "LLaVA-NeXT takes images, not videos");
        ensure!(grid.size[0] > 0 && grid.size[1] > 0, "LLaVA-NeXT needs the image's size to unpad its features");
        let tiles = self.tile_features(patches, grid.thw[0])?;
        Ok((self.pack(&tiles, grid.size)?, vec![]))
    }
}
