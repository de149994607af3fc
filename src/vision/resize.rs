//! Bit-exact reimplementation of Pillow's 8-bit BICUBIC and BILINEAR `Image.resize`.
//!
//! HF's slow `Qwen2VLImageProcessor` resizes uint8 RGB through PIL, so any deviation here shows up
//! as whole-LSB differences (≈0.015 after normalisation). We therefore follow the arithmetic of
//! Pillow 13.0's `libImaging/Resample.c`: f64 filter weights normalised to sum 1, converted to
//! 22-bit fixed point, two separable passes with an 8-bit clamp/round in between, and Pillow's
//! rule for which pass runs first. Written from reading that file; no code was copied.

use anyhow::{bail, Result};
use image::RgbImage;
use rayon::prelude::*;

/// Fixed-point fraction bits: 32 bits minus 8 for the result minus 2 for overshoot of
/// negative-lobe filters (same budget Pillow uses).
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// Pillow's resampling filters merg reproduces (the `resample` ids of preprocessor configs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Filter {
    /// `Image.BILINEAR` (2): the triangle filter, support 1 (Gemma 3, SigLIP).
    Bilinear,
    /// `Image.BICUBIC` (3): Keys cubic, support 2 (Qwen, CLIP).
    Bicubic,
}

impl Filter {
    /// The filter of a PIL resample id, if merg reproduces it.
    pub fn from_pil(id: u32) -> Option<Filter> {
        match id {
            2 => Some(Filter::Bilinear),
            3 => Some(Filter::Bicubic),
            _ => None,
        }
    }

    /// Support radius at scale 1 (Pillow's `filter->support`).
    fn support(self) -> f64 {
        match self {
            Filter::Bilinear => 1.0,
            Filter::Bicubic => 2.0,
        }
    }

    fn weight(self, x: f64) -> f64 {
        match self {
            Filter::Bilinear => (1.0 - x.abs()).max(0.0),
            Filter::Bicubic => bicubic_filter(x),
        }
    }
}

/// Keys cubic convolution with a = -0.5 (Pillow's choice, unlike OpenCV's -0.75).
fn bicubic_filter(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Per-output-pixel filter taps: source start index, tap count, and fixed-point weights.
struct Coeffs {
    /// Max taps per output pixel; `weights` is laid out `[out_size][ksize]`.
    ksize: usize,
    /// `(xmin, count)` per output pixel.
    bounds: Vec<(usize, usize)>,
    weights: Vec<i32>,
}

/// Mirrors `precompute_coeffs` + `normalize_coeffs_8bpc` for the full-image box `[0, in_size]`.
fn precompute_coeffs(in_size: usize, out_size: usize, filter: Filter) -> Coeffs {
    // Pillow's box is f32; `(in1 - in0)` is computed in f32 then widened. Exact for sane sizes,
    // but keep the same path so huge sizes round identically.
    let in0: f32 = 0.0;
    let in1: f32 = in_size as f32;
    let scale = (in1 - in0) as f64 / out_size as f64;
    // Downscaling widens the kernel (antialiasing); upscaling keeps it at unit scale.
    let filterscale = if scale < 1.0 { 1.0 } else { scale };
    let support = filter.support() * filterscale;
    let ksize = (support.ceil() as usize) * 2 + 1;
    let inv_filterscale = 1.0 / filterscale;

    let mut bounds = Vec::with_capacity(out_size);
    let mut weights = vec![0i32; out_size * ksize];
    let mut k = vec![0f64; ksize];
    for xx in 0..out_size {
        let center = in0 as f64 + (xx as f64 + 0.5) * scale;
        // C `(int)` truncates toward zero; `as i64` does the same.
        let xmin = ((center - support + 0.5) as i64).max(0);
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64);
        let count = (xmax - xmin).max(0) as usize;
        let mut ww = 0.0f64;
        for (x, kx) in k.iter_mut().enumerate().take(count) {
            // Same operation order as Pillow: ((x + xmin) - center + 0.5) * inv_filterscale.
            let w = filter.weight(((x as i64 + xmin) as f64 - center + 0.5) * inv_filterscale);
            *kx = w;
            ww += w;
        }
        let row = &mut weights[xx * ksize..(xx + 1) * ksize];
        for x in 0..count {
            let mut v = k[x];
            if ww != 0.0 {
                v /= ww;
            }
            // Round half away from zero, then truncate: `(int)(±0.5 + v * 2^22)`.
            let scaled = v * (1u32 << PRECISION_BITS) as f64;
            row[x] = if v < 0.0 { (scaled - 0.5) as i32 } else { (scaled + 0.5) as i32 };
        }
        bounds.push((xmin as usize, count));
    }
    Coeffs { ksize, bounds, weights }
}

/// `clip8`: drop the fraction bits (arithmetic shift = floor, the +0.5 was pre-added) and clamp.
#[inline]
fn clip8(ss: i32) -> u8 {
    (ss >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Rounding bias added to every accumulator, so the final shift rounds to nearest.
const HALF: i32 = 1 << (PRECISION_BITS - 1);

/// Horizontal pass over source rows `[y0, y0 + rows)`; output is `out_w x rows` RGB.
fn resample_horizontal(src: &[u8], src_w: usize, y0: usize, rows: usize, c: &Coeffs) -> Vec<u8> {
    let out_w = c.bounds.len();
    let mut out = vec![0u8; out_w * rows * 3];
    if out.is_empty() {
        return out;
    }
    // Rows are independent; integer math keeps the parallel result identical to serial.
    out.par_chunks_mut(out_w * 3).enumerate().for_each(|(yy, out_line)| {
        let line = &src[(y0 + yy) * src_w * 3..(y0 + yy + 1) * src_w * 3];
        for (xx, &(xmin, count)) in c.bounds.iter().enumerate() {
            let k = &c.weights[xx * c.ksize..xx * c.ksize + count];
            let (mut s0, mut s1, mut s2) = (HALF, HALF, HALF);
            for (x, &w) in k.iter().enumerate() {
                let p = (xmin + x) * 3;
                s0 += line[p] as i32 * w;
                s1 += line[p + 1] as i32 * w;
                s2 += line[p + 2] as i32 * w;
            }
            out_line[xx * 3] = clip8(s0);
            out_line[xx * 3 + 1] = clip8(s1);
            out_line[xx * 3 + 2] = clip8(s2);
        }
    });
    out
}

/// Vertical pass; `row_offset` is subtracted from the coefficient bounds because the horizontal
/// pass only produced rows starting at that source row.
fn resample_vertical(src: &[u8], w: usize, row_offset: usize, c: &Coeffs) -> Vec<u8> {
    let out_h = c.bounds.len();
    let stride = w * 3;
    let mut out = vec![0u8; stride * out_h];
    if out.is_empty() {
        return out;
    }
    out.par_chunks_mut(stride).enumerate().for_each(|(yy, out_line)| {
        let (ymin, count) = c.bounds[yy];
        let ymin = ymin - row_offset;
        let k = &c.weights[yy * c.ksize..yy * c.ksize + count];
        // Accumulate whole source rows (cache-friendly); same integer sums as Pillow's order.
        let mut acc = vec![HALF; stride];
        for (y, &wt) in k.iter().enumerate() {
            let row = &src[(ymin + y) * stride..(ymin + y + 1) * stride];
            for (a, &v) in acc.iter_mut().zip(row) {
                *a += v as i32 * wt;
            }
        }
        for (o, &a) in out_line.iter_mut().zip(&acc) {
            *o = clip8(a);
        }
    });
    out
}

/// Resize like `PIL.Image.resize((width, height), Image.BICUBIC)` on an RGB image (default box,
/// no `reducing_gap`). Same size returns an unchanged copy, as PIL does.
pub fn resize_bicubic(img: &RgbImage, width: usize, height: usize) -> Result<RgbImage> {
    resize(img, width, height, Filter::Bicubic)
}

/// Resize like `PIL.Image.resize((width, height), filter)` on an RGB image.
pub fn resize(img: &RgbImage, width: usize, height: usize, filter: Filter) -> Result<RgbImage> {
    let (in_w, in_h) = (img.width() as usize, img.height() as usize);
    if width == 0 || height == 0 {
        bail!("resize target {width}x{height} has a zero dimension (source {in_w}x{in_h})");
    }
    if in_w == 0 || in_h == 0 {
        bail!("cannot resize an empty {in_w}x{in_h} image to {width}x{height}");
    }
    // Pillow's fixed-point accumulators are i32; its own sizes are C ints.
    if width > i32::MAX as usize / 8 || height > i32::MAX as usize / 8 {
        bail!("resize target {width}x{height} is too large");
    }
    let need_horizontal = width != in_w;
    let need_vertical = height != in_h;
    if !need_horizontal && !need_vertical {
        return Ok(img.clone());
    }
    // Pillow >= 13 runs the vertical pass first when the height shrinks by more than twice the
    // (signed) width change; older Pillow always went horizontal first. The passes round to 8
    // bits in between, so the order changes results; we follow 13.0 (the golden environment).
    let (dh, dw) = (in_h as i64 - height as i64, in_w as i64 - width as i64);
    let horizontal_first = !(dh > 0 && dh > dw * 2);

    let src = img.as_raw();
    let vert = precompute_coeffs(in_h, height, filter);
    let out = if horizontal_first {
        // Only the source rows the vertical filter touches are horizontally resampled (Pillow's
        // ybox_first/ybox_last); identical results, less work.
        let y_first = vert.bounds.first().map_or(0, |b| b.0);
        let y_last = vert.bounds.last().map_or(in_h, |b| b.0 + b.1);
        if need_horizontal {
            let horiz = precompute_coeffs(in_w, width, filter);
            let tmp = resample_horizontal(src, in_w, y_first, y_last - y_first, &horiz);
            if need_vertical {
                resample_vertical(&tmp, width, y_first, &vert)
            } else {
                tmp // height unchanged: the bounds covered every row
            }
        } else {
            resample_vertical(src, in_w, 0, &vert)
        }
    } else {
        // Vertical first (need_vertical is implied by dh > 0).
        let tmp = resample_vertical(src, in_w, 0, &vert);
        if need_horizontal {
            let horiz = precompute_coeffs(in_w, width, filter);
            resample_horizontal(&tmp, in_w, 0, height, &horiz)
        } else {
            tmp
        }
    };
    RgbImage::from_raw(width as u32, height as u32, out)
        .ok_or_else(|| anyhow::anyhow!("internal: resized buffer has the wrong length"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_is_interpolating() {
        assert_eq!(bicubic_filter(0.0), 1.0);
        assert_eq!(bicubic_filter(1.0), 0.0);
        assert_eq!(bicubic_filter(2.0), 0.0);
    }

    #[test]
    fn constant_image_stays_constant() {
        let img = RgbImage::from_pixel(37, 23, image::Rgb([200, 10, 99]));
        for (w, h) in [(56, 28), (10, 10), (37, 50), (80, 23)] {
            let out = resize_bicubic(&img, w, h).unwrap();
            assert!(out.pixels().all(|p| p.0 == [200, 10, 99]), "{w}x{h}");
        }
    }

    #[test]
    fn same_size_is_identity() {
        let img = RgbImage::from_fn(9, 7, |x, y| image::Rgb([x as u8 * 20, y as u8 * 30, 7]));
        assert_eq!(resize_bicubic(&img, 9, 7).unwrap(), img);
    }
}
