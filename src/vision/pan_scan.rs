//! Gemma 3's pan-and-scan: an image much wider (or taller) than square is also shown as a row
//! (or column) of crops, each resized to the tower's square like the whole image, so detail
//! the square would squash survives. Equal to transformers 4.57's
//! `Gemma3ImageProcessor.pan_and_scan` (written from reading it).

use anyhow::{ensure, Result};
use image::RgbImage;

/// `do_pan_and_scan` and its three settings (transformers' defaults when a config leaves them
/// null: crops of at least 256 pixels, at most 4, from an aspect ratio of 1.2).
#[derive(Clone, Debug, PartialEq)]
pub struct PanAndScan {
    pub min_crop: usize,
    pub max_crops: usize,
    pub min_ratio: f64,
}

impl Default for PanAndScan {
    fn default() -> Self {
        PanAndScan { min_crop: 256, max_crops: 4, min_ratio: 1.2 }
    }
}

/// One crop: top, left, height, width in pixels of the source image.
pub type Crop = [usize; 4];

impl PanAndScan {
    pub fn validate(&self) -> Result<()> {
        ensure!(self.min_crop > 0, "pan_and_scan_min_crop_size must be at least 1");
        ensure!((2..=64).contains(&self.max_crops), "pan_and_scan_max_num_crops {} must be in 2..=64", self.max_crops);
        ensure!(self.min_ratio.is_finite() && self.min_ratio >= 1.0, "pan_and_scan_min_ratio_to_activate {} must be at least 1", self.min_ratio);
        Ok(())
    }

    /// The crops of an image of `[height, width]`, left to right or top to bottom; none when
    /// the image is close enough to square or the crops would be smaller than `min_crop`.
    pub fn crops(&self, [h, w]: [usize; 2]) -> Vec<Crop> {
        if h == 0 || w == 0 {
            return vec![];
        }
        // The long side is split; the short one kept whole.
        let (long, short) = if w >= h { (w, h) } else { (h, w) };
        if (long as f64 / short as f64) < self.min_ratio {
            return vec![];
        }
        // Round half up, no more crops than min_crop-wide pieces, then clamp to [2, max].
        let n = ((long as f64 / short as f64 + 0.5).floor() as usize).min(long / self.min_crop).max(2).min(self.max_crops);
        let size = long.div_ceil(n);
        if size.min(short) < self.min_crop {
            return vec![];
        }
        (0..n)
            .map(|i| {
                // Python slices stop at the edge: the last crop may be narrower.
                let (at, len) = (i * size, size.min(long.saturating_sub(i * size)));
                if w >= h { [0, at, h, len] } else { [at, 0, len, w] }
            })
            .collect()
    }

    /// The image's crops as images.
    pub fn cut(&self, img: &RgbImage) -> Vec<RgbImage> {
        let size = [img.height() as usize, img.width() as usize];
        self.crops(size).into_iter().map(|[y, x, h, w]| image::imageops::crop_imm(img, x as u32, y as u32, w as u32, h as u32).to_image()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Crop counts and boxes from transformers 4.57.1's `pan_and_scan`.
    #[test]
    fn crops_equal_transformers() {
        let p = PanAndScan { min_crop: 16, max_crops: 4, min_ratio: 1.2 };
        assert_eq!(p.crops([190, 260]), vec![[0, 0, 190, 130], [0, 130, 190, 130]]);
        assert_eq!(p.crops([300, 40]), vec![[0, 0, 75, 40], [75, 0, 75, 40], [150, 0, 75, 40], [225, 0, 75, 40]]);
        assert!(p.crops([20, 30]).is_empty(), "crops of 15 px are under the minimum");
        assert!(p.crops([100, 110]).is_empty(), "close to square");
        // Defaults: 1000×300 → round(3.33) = 3 crops of 334, 334, 332.
        let d = PanAndScan::default();
        assert_eq!(d.crops([300, 1000]), vec![[0, 0, 300, 334], [0, 334, 300, 334], [0, 668, 300, 332]]);
        assert!(d.crops([300, 500]).is_empty(), "250-px crops are under 256");
    }
}
