//! Pieces the vision towers share: the patch embedding (a Conv3d or Conv2d whose stride equals
//! its kernel, over patches the processor already cut), the pre-norm ViT block with 2-D
//! rotary over (row, col) of the Qwen towers, the rotary tables in the processor's merge-block
//! order, and the plain ViT layer of HF's CLIP (LLaVA-NeXT) with learned positions instead
//! (also the layer of Qwen2.5-Omni's Whisper-style audio encoder, under its own names).
//! Qwen towers differ only in the norm and MLP they hand to `VisionBlock::new` and in what they
//! do around the blocks (windows, learned positions, DeepStack).

use candle_core::{Device, Module, Result, Tensor};

use super::{apply_rope, dense_attention, linear, Act, Fused, Linear, Mlp, Norm};
use crate::weights::Weights;

/// Patch geometry of a tower.
#[derive(Clone, Copy, Debug)]
pub struct PatchShape {
    pub in_channels: usize,
    pub temporal: usize,
    pub patch: usize,
}

impl PatchShape {
    /// Values in one flattened patch: channels × temporal × patch × patch.
    pub fn dim(&self) -> usize {
        self.in_channels * self.temporal * self.patch * self.patch
    }
}

/// Conv3d with stride == kernel over pre-cut patches = a matmul with the flattened kernel.
pub fn patch_embed(width: usize, p: PatchShape, bias: bool, w: Weights) -> Result<Linear> {
    let conv = w.get((width, p.in_channels, p.temporal, p.patch, p.patch), "weight")?;
    let b = match bias {
        true => Some(w.get(width, "bias")?),
        false => None,
    };
    Ok(Linear::new(conv.reshape((width, p.dim()))?, b))
}

/// Conv2d with stride == kernel (CLIP's and SigLIP's `patch_embedding`) over patches
/// flattened (channel, row, column): a matmul with the flattened kernel.
pub fn patch_embed_2d(width: usize, in_channels: usize, patch: usize, bias: bool, w: Weights) -> Result<Linear> {
    let conv = w.get((width, in_channels, patch, patch), "weight")?;
    let b = match bias {
        true => Some(w.get(width, "bias")?),
        false => None,
    };
    Ok(Linear::new(conv.reshape((width, in_channels * patch * patch))?, b))
}

/// Width, heads and MLP of a plain ViT layer.
#[derive(Clone, Copy, Debug)]
pub struct VitShape {
    pub width: usize,
    pub heads: usize,
    pub mlp_width: usize,
    pub act: Act,
    pub eps: f64,
}

/// A ViT encoder layer as HF's CLIP and SigLIP write it: x + attn(layer_norm1(x)), then adds
/// mlp(layer_norm2(x)); biased `self_attn.{q,k,v}_proj` and `out_proj`, no rotary (positions
/// are learned and added before the first layer). Attention never crosses a segment (a tile).
pub struct VitLayer {
    norm1: Norm,
    norm2: Norm,
    qkv: Fused,
    out: Linear,
    mlp: Mlp,
    heads: usize,
}

/// Where a ViT layer's tensors live: CLIP / SigLIP (`VitNames::CLIP`) or Whisper-style audio
/// encoders (`VitNames::WHISPER`: other norm names, the MLP's layers on the layer itself, and
/// no bias on `k_proj`).
#[derive(Clone, Copy, Debug)]
pub struct VitNames {
    pub norm1: &'static str,
    pub norm2: &'static str,
    /// Parent of `fc1` / `fc2`; `None`: the layer itself.
    pub mlp: Option<&'static str>,
    pub k_bias: bool,
}

impl VitNames {
    pub const CLIP: VitNames = VitNames { norm1: "layer_norm1", norm2: "layer_norm2", mlp: Some("mlp"), k_bias: true };
    pub const WHISPER: VitNames = VitNames { norm1: "self_attn_layer_norm", norm2: "final_layer_norm", mlp: None, k_bias: false };
}

impl VitLayer {
    pub fn new(s: VitShape, w: Weights) -> Result<Self> {
        Self::named(s, VitNames::CLIP, w)
    }

    /// The layer with its tensors under `names`.
    pub fn named(s: VitShape, names: VitNames, w: Weights) -> Result<Self> {
        let a = w.pp("self_attn");
        let proj = |name: &str| linear(s.width, s.width, true, a.pp(name));
        let mlp = match names.mlp {
            Some(m) => w.pp(m),
            None => w.clone(),
        };
        Ok(VitLayer {
            norm1: Norm::layer(s.width, s.eps, w.pp(names.norm1))?,
            norm2: Norm::layer(s.width, s.eps, w.pp(names.norm2))?,
            qkv: Fused::new(vec![proj("q_proj")?, linear(s.width, s.width, names.k_bias, a.pp("k_proj"))?, proj("v_proj")?])?,
            out: proj("out_proj")?,
            mlp: Mlp::plain(s.width, s.mlp_width, s.act, mlp)?,
            heads: s.heads,
        })
    }

    pub fn forward(&self, x: &Tensor, segs: &[(usize, usize)]) -> Result<Tensor> {
        let (n, width) = x.dims2()?;
        let d = width / self.heads;
        let [q, k, v]: [Tensor; 3] = self.qkv.forward(&self.norm1.forward(x)?)?.try_into().map_err(|_| candle_core::Error::Msg("q/k/v: three outputs expected".into()))?;
        let (q, k, v) = (q.reshape((n, self.heads, d))?, k.reshape((n, self.heads, d))?, v.reshape((n, self.heads, d))?);
        let scale = 1.0 / (d as f64).sqrt();
        let mut outs = Vec::with_capacity(segs.len());
        for &(start, len) in segs {
            outs.push(dense_attention(&q.narrow(0, start, len)?, &k.narrow(0, start, len)?, &v.narrow(0, start, len)?, scale)?);
        }
        let x = (x + self.out.forward(&Tensor::cat(&outs, 0)?)?)?;
        let m = self.mlp.forward(&self.norm2.forward(&x)?)?;
        x + m
    }
}

/// One pre-norm block: x + attn(norm1(x)), then + mlp(norm2(x)). Attention is dense within
/// each segment (a frame or a window) and never crosses one.
pub struct VisionBlock {
    norm1: Norm,
    norm2: Norm,
    qkv: Qkv,
    proj: Linear,
    mlp: Mlp,
    heads: usize,
}

/// A block's q/k/v projection: one `attn.qkv` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or three
/// `attn.q`, `attn.k`, `attn.v` (Qwen2.5-Omni's copy of the Qwen2.5-VL tower).
enum Qkv {
    One(Linear),
    Three(Fused),
}

impl VisionBlock {
    pub fn new(width: usize, heads: usize, norm: impl Fn(Weights) -> Result<Norm>, mlp: Mlp, w: Weights) -> Result<Self> {
        let a = w.pp("attn");
        let qkv = match a.contains("q.weight") && !a.contains("qkv.weight") {
            true => Qkv::Three(Fused::new(vec![linear(width, width, true, a.pp("q"))?, linear(width, width, true, a.pp("k"))?, linear(width, width, true, a.pp("v"))?])?),
            false => Qkv::One(linear(width, 3 * width, true, a.pp("qkv"))?),
        };
        Ok(VisionBlock { norm1: norm(w.pp("norm1"))?, norm2: norm(w.pp("norm2"))?, qkv, proj: linear(width, width, true, a.pp("proj"))?, mlp, heads })
    }

    /// q, k, v `[n, heads, d]` of the normed states `h`.
    fn qkv(&self, h: &Tensor, n: usize, d: usize) -> Result<(Tensor, Tensor, Tensor)> {
        match &self.qkv {
            Qkv::One(l) => {
                let qkv = l.forward(h)?.reshape((n, 3, self.heads, d))?;
                Ok((qkv.narrow(1, 0, 1)?.squeeze(1)?, qkv.narrow(1, 1, 1)?.squeeze(1)?, qkv.narrow(1, 2, 1)?.squeeze(1)?))
            }
            Qkv::Three(f) => {
                let [q, k, v]: [Tensor; 3] = f.forward(h)?.try_into().map_err(|_| candle_core::Error::Msg("q/k/v: three outputs expected".into()))?;
                Ok((q.reshape((n, self.heads, d))?, k.reshape((n, self.heads, d))?, v.reshape((n, self.heads, d))?))
            }
        }
    }

    pub fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, segs: &[(usize, usize)]) -> Result<Tensor> {
        let (n, width) = x.dims2()?;
        let d = width / self.heads;
        let h = self.norm1.forward(x)?;
        let (q, k, v) = self.qkv(&h, n, d)?;
        let (q, k) = (apply_rope(&q, cos, sin)?, apply_rope(&k, cos, sin)?);
        let scale = 1.0 / (d as f64).sqrt();
        let mut outs = Vec::with_capacity(segs.len());
        for &(start, len) in segs {
            outs.push(dense_attention(&q.narrow(0, start, len)?, &k.narrow(0, start, len)?, &v.narrow(0, start, len)?, scale)?);
        }
        let att = self.proj.forward(&Tensor::cat(&outs, 0)?)?;
        let x = (x + att)?;
        let m = self.mlp.forward(&self.norm2.forward(&x)?)?;
        x + m
    }
}

/// 2-D rotary of a tower: each of row and column gets a quarter of the head dim, theta 10000.
#[derive(Clone, Debug)]
pub struct VisionRotary {
    inv_freq: Vec<f32>,
    merge: usize,
}

impl VisionRotary {
    pub fn new(head_dim: usize, merge: usize) -> Self {
        let rot_dim = head_dim / 2;
        let inv_freq = (0..rot_dim / 2).map(|i| (1.0 / 10000f64.powf((2 * i) as f64 / rot_dim as f64)) as f32).collect();
        VisionRotary { inv_freq, merge }
    }

    /// cos/sin `[N, head_dim/2]`: row frequencies then column frequencies of each patch, in
    /// the processor's merge-block order.
    pub fn tables(&self, grids: &[[usize; 3]], dev: &Device) -> Result<(Tensor, Tensor)> {
        let m = self.merge;
        let q = self.inv_freq.len();
        let mut cos = Vec::new();
        let mut sin = Vec::new();
        for &[t, h, w] in grids {
            for _ in 0..t {
                for (row, col) in merge_order(h, w, m) {
                    for pos in [row as f32, col as f32] {
                        for f in 0..q {
                            let a = pos * self.inv_freq[f];
                            cos.push(a.cos());
                            sin.push(a.sin());
                        }
                    }
                }
            }
        }
        let n = cos.len() / (2 * q);
        Ok((Tensor::from_vec(cos, (n, 2 * q), dev)?, Tensor::from_vec(sin, (n, 2 * q), dev)?))
    }
}

/// (row, col) of each patch of an `h × w` grid in merge-block order: blocks of `m × m`
/// patches row-major, patches row-major within a block.
pub fn merge_order(h: usize, w: usize, m: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..h / m).flat_map(move |bh| {
        (0..w / m).flat_map(move |bw| (0..m).flat_map(move |ih| (0..m).map(move |iw| (bh * m + ih, bw * m + iw))))
    })
}

/// (start, len) of every frame: full attention never crosses a temporal step.
pub fn frame_bounds(grids: &[[usize; 3]]) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut start = 0;
    for &[t, h, w] in grids {
        for _ in 0..t {
            out.push((start, h * w));
            start += h * w;
        }
    }
    out
}

/// Checks that `n` patch rows match the grids.
pub fn check_patches(n: usize, grids: &[[usize; 3]]) -> Result<()> {
    let expected: usize = grids.iter().map(|g| g[0] * g[1] * g[2]).sum();
    if n != expected {
        candle_core::bail!("vision input has {n} patches but the grids describe {expected}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn merge_order_visits_blocks_then_patches() {
        let v: Vec<_> = merge_order(2, 4, 2).collect();
        assert_eq!(v, vec![(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]);
        assert_eq!(frame_bounds(&[[2, 2, 4], [1, 2, 2]]), vec![(0, 8), (8, 8), (16, 4)]);
    }
}
