//! Putting vision features into a prompt: splicing them into the placeholder runs of the
//! token embeddings, and the DeepStack side channel (Qwen3-VL) that carries further levels of
//! features for the same positions into the first decoder layers.

use anyhow::{bail, Result};
use candle_core::Tensor;

/// Visual features a decoder adds inside its first layers: `features` `[n, levels·hidden]`
/// (level `l` in columns `l·hidden..`) for the `n` token `rows` (ascending).
#[derive(Clone, Debug)]
pub struct Deepstack {
    pub rows: Vec<u32>,
    pub features: Tensor,
}

impl Deepstack {
    pub fn levels(&self, hidden: usize) -> candle_core::Result<usize> {
        Ok(self.features.dim(1)? / hidden.max(1))
    }

    /// The part for tokens `a..b`, with rows moved to start at `offset` (their place in a
    /// packed step). `None` when no row falls in the range.
    pub fn slice(&self, a: usize, b: usize, offset: usize) -> candle_core::Result<Option<Deepstack>> {
        let lo = self.rows.partition_point(|&r| (r as usize) < a);
        let hi = self.rows.partition_point(|&r| (r as usize) < b);
        if lo == hi {
            return Ok(None);
        }
        let rows = self.rows[lo..hi].iter().map(|&r| (r as usize - a + offset) as u32).collect();
        Ok(Some(Deepstack { rows, features: self.features.narrow(0, lo, hi - lo)? }))
    }

    /// Joins the parts of one packed step (rows already offset, in step order).
    pub fn concat(parts: Vec<Deepstack>) -> candle_core::Result<Option<Deepstack>> {
        if parts.is_empty() {
            return Ok(None);
        }
        let rows = parts.iter().flat_map(|p| p.rows.iter().copied()).collect();
        let feats: Vec<&Tensor> = parts.iter().map(|p| &p.features).collect();
        Ok(Some(Deepstack { rows, features: Tensor::cat(&feats, 0)? }))
    }
}

/// Token positions of every image/video placeholder, ascending.
pub fn placeholder_rows(ids: &[u32], image_tok: u32, video_tok: u32) -> Vec<u32> {
    ids.iter().enumerate().filter(|(_, &t)| t == image_tok || t == video_tok).map(|(i, _)| i as u32).collect()
}

/// Replaces the embeddings of placeholder tokens by vision features. `img`/`vid` are the
/// features of all images / all videos in prompt order; each must be used up exactly.
pub fn splice_features(text: &Tensor, ids: &[u32], image_tok: u32, video_tok: u32, img: Option<&Tensor>, vid: Option<&Tensor>) -> Result<Tensor> {
    let mut rows: Vec<Tensor> = Vec::new();
    let (mut next_img, mut next_vid) = (0usize, 0usize);
    let mut run_start = 0;
    // Splice contiguous text runs and feature runs; a token-by-token scatter would be O(L) ops.
    let mut i = 0;
    while i < ids.len() {
        let (feat, cursor) = if ids[i] == image_tok {
            (img, &mut next_img)
        } else if ids[i] == video_tok {
            (vid, &mut next_vid)
        } else {
            i += 1;
            continue;
        };
        let tok = ids[i];
        let mut j = i;
        while j < ids.len() && ids[j] == tok {
            j += 1;
        }
        let Some(feat) = feat else { bail!("prompt has placeholder tokens but no vision input") };
        if *cursor + (j - i) > feat.dim(0)? {
            bail!("prompt has more placeholder tokens than vision features ({})", feat.dim(0)?);
        }
        if run_start < i {
            rows.push(text.narrow(0, run_start, i - run_start)?);
        }
        rows.push(feat.narrow(0, *cursor, j - i)?.to_dtype(text.dtype())?);
        *cursor += j - i;
        run_start = j;
        i = j;
    }
    if run_start < ids.len() {
        rows.push(text.narrow(0, run_start, ids.len() - run_start)?);
    }
    for (feat, used) in [(img, next_img), (vid, next_vid)] {
        if let Some(f) = feat {
            if f.dim(0)? != used {
                bail!("{} vision features but {used} placeholder tokens", f.dim(0)?);
            }
        }
    }
    Ok(Tensor::cat(&rows, 0)?)
}

/// All images' (or all videos') features, in prompt order.
pub fn cat_kind(media: &[super::MediaGrid], features: &[Tensor], video: bool) -> Result<Option<Tensor>> {
    let parts: Vec<&Tensor> = media.iter().zip(features).filter(|(m, _)| m.is_video == video).map(|(_, f)| f).collect();
    Ok(if parts.is_empty() { None } else { Some(Tensor::cat(&parts, 0)?) })
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn deepstack_slices_follow_the_chunk() -> candle_core::Result<()> {
        let f = Tensor::arange(0f32, 8., &Device::Cpu)?.reshape((4, 2))?;
        let d = Deepstack { rows: vec![2, 3, 7, 8], features: f };
        assert!(d.slice(0, 2, 0)?.is_none());
        let s = d.slice(3, 8, 10)?.unwrap();
        assert_eq!(s.rows, vec![10, 14]);
        assert_eq!(s.features.to_vec2::<f32>()?, vec![vec![2., 3.], vec![4., 5.]]);
        let j = Deepstack::concat(vec![d.slice(0, 3, 0)?.unwrap(), s])?.unwrap();
        assert_eq!(j.rows, vec![2, 10, 14]);
        assert_eq!(j.levels(1)?, 2);
        assert_eq!(placeholder_rows(&[1, 5, 5, 2, 6], 5, 6), vec![1, 2, 4]);
        let _ = DType::F32;
        Ok(())
    }
}
