//! Gemma 3's vision side: the SigLIP tower (a Conv2d patch embedding, learned positions, pre-norm
//! ViT blocks with LayerNorm and a GELU-tanh MLP, a final LayerNorm) and the projector that
//! average-pools its patch grid to `mm_tokens_per_image` tokens, RMS-norms them (`1 + w`) and
//! maps them to the text width. Every image is the same square size, so there is no rotary and
//! no interpolation: positions are the table's rows in order.

use candle_core::{DType, Module, Result, Tensor};

use super::config::VisionConfig;
use crate::layers::vision::{patch_embed_2d, VitLayer, VitShape};
use crate::layers::{Linear, Norm};
use crate::weights::Weights;

pub struct SiglipTower {
    patch: Linear,
    /// `[patches, width]`: one learned row per patch position.
    positions: Tensor,
    blocks: Vec<VitLayer>,
    post_norm: Norm,
    /// `mm_soft_emb_norm`, then `mm_input_projection_weight` (`[width, text hidden]`).
    soft_norm: Norm,
    projection: Tensor,
    side: usize,
    pool: usize,
}

impl SiglipTower {
    /// `tower` points at `vision_tower.vision_model`, `projector` at `multi_modal_projector`.
    pub fn new(c: &VisionConfig, pool: usize, text_hidden: usize, tower: Weights, projector: Weights) -> Result<Self> {
        let (width, side) = (c.hidden_size, c.patches_per_side());
        let emb = tower.pp("embeddings");
        let patch = patch_embed_2d(width, c.num_channels, c.patch_size, true, emb.pp("patch_embedding"))?;
        let positions = emb.pp("position_embedding").get((side * side, width), "weight")?;
        let norm = |w: Weights| Norm::layer(width, c.layer_norm_eps, w);
        // SigLIP's block is CLIP's: the same pre-norm ViT layer.
        let vit = VitShape { width, heads: c.num_attention_heads, mlp_width: c.intermediate_size, act: c.hidden_act, eps: c.layer_norm_eps };
        let blocks = (0..c.num_hidden_layers).map(|i| VitLayer::new(vit, tower.pp("encoder").pp("layers").pp(i))).collect::<Result<_>>()?;
        let post_norm = norm(tower.pp("post_layernorm"))?;
        let soft_norm = Norm::rms_offset(width, c.layer_norm_eps, projector.pp("mm_soft_emb_norm"))?;
        let projection = projector.get((width, text_hidden), "mm_input_projection_weight")?;
        Ok(SiglipTower { patch, positions, blocks, post_norm, soft_norm, projection, side, pool })
    }

    /// `patches: [side², C·P·P]` of one image (row-major patches, each channel-major) →
    /// `[(side/pool)², text hidden]`.
    pub fn forward(&self, patches: &Tensor) -> Result<Tensor> {
        let n = patches.dim(0)?;
        if n != self.side * self.side {
            candle_core::bail!("a gemma3 image is {}×{} patches, got {n}", self.side, self.side);
        }
        let x = patches.to_dtype(self.positions.dtype())?;
        let mut x = (self.patch.forward(&x)? + &self.positions)?;
        // One image is one attention segment.
        for b in &self.blocks {
            x = b.forward(&x, &[(0, n)])?;
        }
        let x = self.post_norm.forward(&x)?;
        let pooled = self.avg_pool(&x)?;
        let normed = self.soft_norm.forward(&pooled)?;
        normed.matmul(&self.projection.to_dtype(normed.dtype())?)
    }

    /// `AvgPool2d(pool)` over the `side × side` grid of `[side², width]` rows → `[(side/pool)², width]`,
    /// summed in f32 (torch accumulates half-precision pools in f32 too).
    fn avg_pool(&self, x: &Tensor) -> Result<Tensor> {
        let (s, k, w) = (self.side, self.pool, x.dim(1)?);
        let g = s / k;
        let y = x.to_dtype(DType::F32)?.reshape((g, k, g, k, w))?.sum(3)?.sum(1)?; // [g, g, w]
        (y / (k * k) as f64)?.reshape((g * g, w))?.to_dtype(x.dtype())
    }
}

/// `[C, H, W]` pixels → `[(H/p)·(W/p), C·p·p]` patch rows in the order the tower takes them.
pub fn patches_of(pixels: &Tensor, p: usize) -> Result<Tensor> {
    let (c, h, w) = pixels.dims3()?;
    pixels.reshape((c, h / p, p, w / p, p))?.permute((1, 3, 0, 2, 4))?.reshape((h / p * (w / p), c * p * p))
}
