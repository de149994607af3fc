//! LLaVA-NeXT's any-resolution tiling, equal to transformers' `LlavaNextImageProcessor` (the
//! slow, PIL-based one) and to the model's unpadding: an image becomes one overview tile (the
//! whole image squashed to the tile size) plus the tiles of a grid chosen among the
//! checkpoint's pinpoints; the model later drops the feature rows or columns that only cover
//! the padding. The geometry lives here, below both the processor (which counts placeholder
//! tokens) and the model (which unpads features), so the two can never disagree.

use anyhow::{ensure, Result};
use image::RgbImage;

use super::preprocess::{normalize_image, PreprocessorConfig};
use super::resize::resize_bicubic;
use super::Patches;

/// What any-resolution tiling needs from `preprocessor_config.json`.
#[derive(Clone, Debug, PartialEq)]
pub struct AnyRes {
    /// Candidate (height, width) canvases in pixels, multiples of `tile`.
    pub pinpoints: Vec<[usize; 2]>,
    /// Side of a square tile in pixels (`crop_size`, the vision tower's `image_size`).
    pub tile: usize,
}

impl AnyRes {
    pub fn validate(&self) -> Result<()> {
        ensure!(self.tile > 0 && self.tile <= 4096, "tile size {} must be in 1..=4096", self.tile);
        ensure!(!self.pinpoints.is_empty(), "image_grid_pinpoints is empty");
        for p in &self.pinpoints {
            ensure!(p[0] > 0 && p[1] > 0 && p[0].is_multiple_of(self.tile) && p[1].is_multiple_of(self.tile), "grid pinpoint {p:?} is not a positive multiple of the tile size {}", self.tile);
            ensure!(p[0] * p[1] <= 64 * self.tile * self.tile, "grid pinpoint {p:?} holds more than 64 tiles");
        }
        Ok(())
    }

    /// transformers' `select_best_resolution`: the pinpoint keeping the most of the image's
    /// pixels once it is fitted inside, ties broken by the least wasted canvas.
    pub fn best_resolution(&self, [h, w]: [usize; 2]) -> [usize; 2] {
        let (mut best, mut most, mut least_waste) = (self.pinpoints[0], 0usize, usize::MAX);
        for &[ph, pw] in &self.pinpoints {
            let scale = (pw as f64 / w as f64).min(ph as f64 / h as f64);
            let (dw, dh) = ((w as f64 * scale) as usize, (h as f64 * scale) as usize);
            let effective = (dw * dh).min(w * h);
            let waste = ph * pw - effective;
            if effective > most || (effective == most && waste < least_waste) {
                (best, most, least_waste) = ([ph, pw], effective, waste);
            }
        }
        best
    }

    /// Tile grid (rows, columns) an image of `size` (height, width) is cut into.
    pub fn grid(&self, size: [usize; 2]) -> [usize; 2] {
        let [ph, pw] = self.best_resolution(size);
        [ph / self.tile, pw / self.tile]
    }

    /// Tiles of an image: the overview plus the grid's.
    pub fn tiles(&self, size: [usize; 2]) -> usize {
        let [r, c] = self.grid(size);
        1 + r * c
    }

    /// Placeholder tokens of an image of `size`: the overview tile's `side²` features, then the
    /// unpadded grid's rows, each closed by the newline feature (`side` = patches per tile side,
    /// the class token dropped as the "default" feature selection does).
    pub fn tokens(&self, size: [usize; 2], side: usize) -> usize {
        let [r, c] = self.grid(size);
        let u = unpadded(size, [r * side, c * side]);
        side * side + u.rows * (u.cols + 1)
    }
}

/// The part of a grid of features that covers the image rather than its padding.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unpadded {
    pub row: usize,
    pub rows: usize,
    pub col: usize,
    pub cols: usize,
}

/// transformers' `unpad_image` on a `[rows, cols]` feature grid of an image of `size` (height,
/// width): the padded side loses `(current - scaled) / 2` features at each end, the scaled side
/// rounded to 7 decimals first, as Python's `int(round(x, 7))`.
pub fn unpadded([h, w]: [usize; 2], [rows, cols]: [usize; 2]) -> Unpadded {
    let full = Unpadded { row: 0, rows, col: 0, cols };
    if w as f64 / h as f64 > cols as f64 / rows as f64 {
        let new = round7(h as f64 * (cols as f64 / w as f64));
        let pad = rows.saturating_sub(new) / 2;
        Unpadded { row: pad, rows: rows - 2 * pad, ..full }
    } else {
        let new = round7(w as f64 * (rows as f64 / h as f64));
        let pad = cols.saturating_sub(new) / 2;
        Unpadded { col: pad, cols: cols - 2 * pad, ..full }
    }
}

/// `int(round(x, 7))` for a non-negative `x`.
fn round7(x: f64) -> usize {
    ((x * 1e7).round_ties_even() / 1e7) as usize
}

/// transformers' `get_patch_output_size`: the image fitted inside `target`, the fitted side
/// exact and the other rounded up (never past the target).
fn fitted_size([h, w]: [usize; 2], [th, tw]: [usize; 2]) -> [usize; 2] {
    let (sw, sh) = (tw as f64 / w as f64, th as f64 / h as f64);
    if sw < sh {
        [((h as f64 * sw).ceil() as usize).min(th), tw]
    } else {
        [th, ((w as f64 * sh).ceil() as usize).min(tw)]
    }
}

/// The image resized into the best pinpoint and centred on a black canvas of its size
/// (`_resize_for_patching` + `_pad_for_patching`: the odd pixel goes to the bottom / right).
fn canvas(img: &RgbImage, target: [usize; 2]) -> Result<RgbImage> {
    let [nh, nw] = fitted_size([img.height() as usize, img.width() as usize], target);
    let resized = resize_bicubic(img, nw, nh)?;
    let mut out = RgbImage::new(target[1] as u32, target[0] as u32);
    let (top, left) = ((target[0] - nh) / 2, (target[1] - nw) / 2);
    image::imageops::replace(&mut out, &resized, left as i64, top as i64);
    Ok(out)
}

/// Preprocesses one image into its tiles' patches: the overview first, then the grid's tiles
/// row by row; within a tile, patches row-major, each flattened (channel, row, column), which is
/// the vision tower's Conv2d patch embedding as a matmul. `grid_thw` = (tiles, side, side).
pub fn preprocess(img: &RgbImage, cfg: &PreprocessorConfig, any: &AnyRes) -> Result<Patches> {
    any.validate()?;
    let size = [img.height() as usize, img.width() as usize];
    ensure!(size[0] > 0 && size[1] > 0, "image is empty ({}x{})", size[1], size[0]);
    let (t, p) = (any.tile, cfg.patch_size);
    ensure!(p > 0 && t.is_multiple_of(p), "tile size {t} is not a multiple of the patch size {p}");
    let big = canvas(img, any.best_resolution(size))?;
    let mut tiles = vec![resize_bicubic(img, t, t)?];
    for y in (0..big.height()).step_by(t) {
        for x in (0..big.width()).step_by(t) {
            tiles.push(image::imageops::crop_imm(&big, x, y, t as u32, t as u32).to_image());
        }
    }
    let side = t / p;
    let patch_dim = 3 * p * p;
    let mut data = Vec::with_capacity(tiles.len() * side * side * patch_dim);
    for tile in &tiles {
        let chw = normalize_image(tile, cfg);
        for py in 0..side {
            for px in 0..side {
                for c in 0..3 {
                    for y in 0..p {
                        let start = c * t * t + (py * p + y) * t + px * p;
                        data.extend_from_slice(&chw[start..start + p]);
                    }
                }
            }
        }
    }
    Ok(Patches { data, grid_thw: [tiles.len(), side, side], patch_dim })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> AnyRes {
        AnyRes { pinpoints: vec![[56, 112], [112, 56], [112, 112], [168, 56], [56, 168]], tile: 56 }
    }

    /// Grids and token counts transformers 4.57.1 gives these sizes (goldens/llava_next/*.json).
    #[test]
    fn grids_and_tokens_equal_transformers() {
        let a = tiny();
        assert_eq!(a.best_resolution([70, 100]), [112, 112]);
        assert_eq!(a.best_resolution([300, 40]), [168, 56]);
        assert_eq!((a.tokens([70, 100], 4), a.tokens([190, 260], 4), a.tokens([300, 40], 4)), (70, 70, 52));
        assert_eq!(unpadded([300, 40], [12, 4]), Unpadded { row: 0, rows: 12, col: 1, cols: 2 });
        assert_eq!(fitted_size([300, 40], [168, 56]), [168, 23]);
    }

    /// llava-v1.6 at 336: a 640x480 photo takes the 672x672 grid (2x2); of its 48x48 features
    /// 36 rows cover the image: 24² + 36 x 49 = 2,340 tokens.
    #[test]
    fn real_pinpoints() {
        let a = AnyRes { pinpoints: vec![[336, 672], [672, 336], [672, 672], [1008, 336], [336, 1008]], tile: 336 };
        assert_eq!(a.grid([480, 640]), [2, 2]);
        assert_eq!(a.tokens([480, 640], 24), 576 + 36 * 49);
    }
}
