//! Vision preprocessing: smart_resize semantics, parity with HF goldens, and bad-input handling.

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use merg::vision::{
    load_image, preprocess_image, preprocess_video, resize_bicubic, sample_indices, smart_resize,
    PreprocessorConfig,
};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Qwen2-VL defaults: factor 28, min 56*56, max 28*28*1280.
fn sr(h: usize, w: usize) -> anyhow::Result<(usize, usize)> {
    smart_resize(h, w, 28, 56 * 56, 28 * 28 * 1280)
}

// ---------------------------------------------------------------- smart_resize

#[test]
fn smart_resize_matches_hf_formula() {
    // Expected values worked out from HF's formula (round/floor/ceil by factor, beta rescale).
    let cases = [
        ((224, 224), (224, 224)),   // already aligned
        ((100, 200), (112, 196)),   // round 3.57→4, 7.14→7
        ((42, 70), (56, 56)),       // 1.5→2 and 2.5→2: Python rounds half to even
        ((28, 28), (56, 56)),       // below min_pixels: beta=2, ceil
        ((30, 40), (56, 84)),       // below min_pixels, uneven ceil
        ((2000, 3000), (812, 1204)), // above max_pixels: beta≈2.445, floor
        ((1080, 1920), (728, 1316)),
        ((480, 640), (476, 644)),
        ((777, 333), (784, 336)),
        ((28, 5600), (28, 5600)),   // ratio exactly 200 is allowed
        ((5600, 28), (5600, 28)),
        ((300, 30000), (84, 9996)), // ratio 100, over budget
    ];
    for ((h, w), want) in cases {
        assert_eq!(sr(h, w).unwrap(), want, "smart_resize({h}, {w})");
    }
    // Tiny config numbers (min 28*28, max 28*28*64).
    assert_eq!(smart_resize(56, 84, 28, 28 * 28, 28 * 28 * 64).unwrap(), (56, 84));
    // Results are always factor-aligned and within budget for a sweep of sizes.
    for h in (28..700).step_by(37) {
        for w in (28..900).step_by(53) {
            let (rh, rw) = sr(h, w).unwrap();
            assert!(rh % 28 == 0 && rw % 28 == 0 && rh > 0 && rw > 0, "{h}x{w} -> {rh}x{rw}");
            assert!(rh * rw <= 28 * 28 * 1280 && rh * rw >= 56 * 56, "{h}x{w} -> {rh}x{rw}");
        }
    }
}

#[test]
fn smart_resize_small_and_error_cases() {
    // HF 4.57 upscales images smaller than the factor instead of rejecting them.
    assert_eq!(sr(14, 14).unwrap(), (56, 56));
    assert_eq!(sr(5, 5).unwrap(), (56, 56));
    assert_eq!(sr(1, 1).unwrap(), (56, 56));
    assert_eq!(sr(20, 30).unwrap(), (56, 84));
    assert_eq!(sr(10, 1000).unwrap(), (28, 560));
    assert_eq!(sr(1, 150).unwrap(), (28, 700));
    // Over budget with an extreme ratio: the short side is clamped to one factor, not 0.
    assert_eq!(smart_resize(28, 5600, 28, 3136, 78400).unwrap(), (28, 3948));
    // Errors: aspect ratio over 200, empty sides, zero factor.
    let ratio = sr(28, 28 * 201).unwrap_err().to_string();
    assert!(ratio.contains("aspect ratio"), "{ratio}");
    assert!(sr(28 * 201, 28).is_err());
    assert!(sr(1, 201).is_err());
    let empty = sr(0, 100).unwrap_err().to_string();
    assert!(empty.contains("0x100"), "{empty}");
    assert!(sr(100, 0).is_err());
    assert!(smart_resize(100, 100, 0, 1, 2).is_err());
    // min_pixels 0 and a side rounding to 0 would give an empty grid.
    assert!(smart_resize(10, 100, 28, 0, 1 << 20).is_err());
}

// ---------------------------------------------------------------- Pillow resize

/// FNV-1a 64 over the raw RGB bytes: compact fingerprint of a whole resized image.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x100_0000_01b3))
}

#[test]
fn resize_matches_pillow_bicubic() {
    // Fingerprints of `Image.fromarray(pattern).resize((w, h), Image.BICUBIC)` from Pillow 13.0.
    // Cases cover up/down-scaling per axis, single-axis resizes, and both pass orders
    // (vertical first when the height shrinks by more than twice the width change).
    let cases: [((u32, u32), (usize, usize), u64); 12] = [
        ((17, 13), (40, 9), 0x5f1786bddfd46921),
        ((100, 70), (112, 56), 0xf5bea790d4267619),
        ((40, 300), (28, 308), 0x7d316ec0d0a0abc5),
        ((30, 20), (84, 56), 0xf6c62f73489d2462),
        ((64, 64), (23, 61), 0xc3caee7f612b8ae0),
        ((55, 168), (62, 25), 0x7eb8b742e8a96e2a),
        ((33, 33), (33, 10), 0x5be23a410abf4371),
        ((33, 33), (10, 33), 0x3e5e2445e069211e),
        ((260, 190), (252, 196), 0xd1ca6b68c5d524e7),
        ((7, 5), (300, 3), 0xb8d3e51254747c75),
        ((500, 40), (28, 17), 0xe6316ed937398982),
        ((12, 200), (12, 40), 0x11b3c11bd9a647bc),
    ];
    for ((w0, h0), (w, h), want) in cases {
        let src = image::RgbImage::from_fn(w0, h0, |x, y| {
            let px = |c: u32| ((x * 37 + y * 91 + c * 53 + x * y * 7) % 256) as u8;
            image::Rgb([px(0), px(1), px(2)])
        });
        let out = resize_bicubic(&src, w, h).unwrap();
        assert_eq!(out.dimensions(), (w as u32, h as u32));
        assert_eq!(fnv1a(out.as_raw()), want, "{w0}x{h0} -> {w}x{h}");
    }
    assert!(resize_bicubic(&image::RgbImage::new(4, 4), 0, 3).is_err());
}

// ---------------------------------------------------------------- config

#[test]
fn config_defaults_and_size_forms() {
    let d = PreprocessorConfig::default();
    assert_eq!((d.min_pixels, d.max_pixels), (56 * 56, 28 * 28 * 1280));
    assert_eq!((d.patch_size, d.temporal_patch_size, d.merge_size, d.factor()), (14, 2, 2, 28));
    assert_eq!(d.image_mean, [0.48145466, 0.4578275, 0.40821073]);

    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("preprocessor_config.json");
    std::fs::write(&p, r#"{"size": {"shortest_edge": 3136, "longest_edge": 12845056}}"#).unwrap();
    let c = PreprocessorConfig::from_file(&p).unwrap();
    assert_eq!((c.min_pixels, c.max_pixels), (3136, 12845056));
    // Explicit min/max_pixels win over `size`, as in HF.
    std::fs::write(&p, r#"{"min_pixels": 784, "size": {"shortest_edge": 3136, "longest_edge": 9999}}"#)
        .unwrap();
    let c = PreprocessorConfig::from_file(&p).unwrap();
    assert_eq!((c.min_pixels, c.max_pixels), (784, 9999));

    std::fs::write(&p, "{not json").unwrap();
    let e = format!("{:#}", PreprocessorConfig::from_file(&p).unwrap_err());
    assert!(e.contains("preprocessor_config.json"), "{e}");
    // Bilinear (Gemma 3's SigLIP processor) and bicubic are reproduced; nearest, box and
    // Lanczos are refused by name.
    std::fs::write(&p, r#"{"resample": 2}"#).unwrap();
    assert_eq!(PreprocessorConfig::from_file(&p).unwrap().resample, 2);
    std::fs::write(&p, r#"{"resample": 1}"#).unwrap();
    let e = format!("{:#}", PreprocessorConfig::from_file(&p).unwrap_err());
    assert!(e.contains("resample=1 unsupported"), "{e}");
    let missing = dir.path().join("nope.json");
    let e = format!("{:#}", PreprocessorConfig::from_file(&missing).unwrap_err());
    assert!(e.contains("nope.json"), "{e}");
}

// ---------------------------------------------------------------- HF parity

fn tiny_config() -> PreprocessorConfig {
    let p = fixtures().join("tiny-qwen2-vl/preprocessor_config.json");
    PreprocessorConfig::from_file(&p).unwrap_or_else(|e| panic!("{e:#} (fixtures missing?)"))
}

fn load_golden(name: &str) -> std::collections::HashMap<String, Tensor> {
    let p = fixtures().join("goldens/preprocess").join(format!("{name}.safetensors"));
    candle_core::safetensors::load(&p, &Device::Cpu)
        .unwrap_or_else(|e| panic!("loading golden {}: {e}", p.display()))
}

/// Compare patches to golden tensors; returns the max abs error.
fn compare(name: &str, got: &merg::vision::Patches, pv: &Tensor, grid: &Tensor) -> f32 {
    let grid: Vec<i64> = grid.flatten_all().unwrap().to_dtype(DType::I64).unwrap().to_vec1().unwrap();
    let ours: Vec<i64> = got.grid_thw.iter().map(|&x| x as i64).collect();
    assert_eq!(ours, grid, "{name}: grid_thw");
    let want = pv.to_dtype(DType::F32).unwrap();
    assert_eq!(want.dims(), &[got.num_patches(), got.patch_dim], "{name}: pixel_values shape");
    let want: Vec<f32> = want.flatten_all().unwrap().to_vec1().unwrap();
    let max_err = want.iter().zip(&got.data).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    println!("{name}: grid {ours:?}, max abs err {max_err:e}");
    max_err
}

#[test]
fn images_match_hf_goldens() {
    let cfg = tiny_config();
    for name in ["img_a", "img_b", "img_small", "img_tall"] {
        let img = load_image(&fixtures().join(format!("media/{name}.png"))).unwrap();
        let got = preprocess_image(&img, &cfg).unwrap();
        let g = load_golden(name);
        let err = compare(name, &got, &g["pixel_values"], &g["image_grid_thw"]);
        assert!(err <= 1e-5, "{name}: max abs err {err}");
        // The tensor view carries the same numbers.
        let t = got.to_tensor(&Device::Cpu).unwrap();
        assert_eq!(t.dims(), &[got.num_patches(), got.patch_dim]);
        assert_eq!(got.num_merged_tokens(cfg.merge_size) * 4, got.num_patches());
    }
}

#[test]
fn video_matches_hf_golden() {
    let cfg = tiny_config();
    let frames: Vec<_> = (0..4)
        .map(|i| load_image(&fixtures().join(format!("media/vid_{i}.png"))).unwrap())
        .collect();
    let got = preprocess_video(&frames, &cfg).unwrap();
    let g = load_golden("video");
    let err = compare("video", &got, &g["pixel_values_videos"], &g["video_grid_thw"]);
    assert!(err <= 1e-5, "video: max abs err {err}");
}

#[test]
fn odd_frame_count_repeats_last_frame() {
    let cfg = PreprocessorConfig::default();
    let mk = |v: u8| image::RgbImage::from_pixel(56, 56, image::Rgb([v, v, v]));
    let three = preprocess_video(&[mk(10), mk(20), mk(30)], &cfg).unwrap();
    let four = preprocess_video(&[mk(10), mk(20), mk(30), mk(30)], &cfg).unwrap();
    assert_eq!(three.grid_thw, [2, 4, 4]);
    assert_eq!(three.data, four.data);
    let one = preprocess_image(&mk(10), &cfg).unwrap();
    assert_eq!(one.grid_thw, [1, 4, 4]);
    assert_eq!(one.patch_dim, 3 * 2 * 14 * 14);
    // Mismatched frame sizes are an error, not a panic.
    let e = preprocess_video(&[mk(1), image::RgbImage::new(28, 56)], &cfg).unwrap_err();
    assert!(format!("{e:#}").contains("frame 1"), "{e:#}");
}

// ---------------------------------------------------------------- bad input

fn err_mentions(r: anyhow::Result<impl std::fmt::Debug>, path: &Path) {
    let e = format!("{:#}", r.expect_err("expected an error"));
    assert!(e.contains(&path.display().to_string()), "error does not name {}: {e}", path.display());
}

#[test]
fn bad_images_report_the_path() {
    let dir = tempfile::tempdir().unwrap();
    err_mentions(load_image(&dir.path().join("missing.png")), &dir.path().join("missing.png"));

    let junk = dir.path().join("junk.png");
    std::fs::write(&junk, b"definitely not an image, just some bytes").unwrap();
    err_mentions(load_image(&junk), &junk);

    // A valid PNG cut in half.
    let full = dir.path().join("full.png");
    image::RgbImage::from_fn(64, 48, |x, y| image::Rgb([x as u8, y as u8, (x * y) as u8]))
        .save(&full)
        .unwrap();
    let bytes = std::fs::read(&full).unwrap();
    let trunc = dir.path().join("truncated.png");
    std::fs::write(&trunc, &bytes[..bytes.len() / 2]).unwrap();
    err_mentions(load_image(&trunc), &trunc);

    // Zero-size: image crate refuses to write one, so hand-build a 0x0 PNG header.
    let zero = dir.path().join("zero.png");
    std::fs::write(&zero, zero_size_png()).unwrap();
    err_mentions(load_image(&zero), &zero);

    // An empty in-memory image must not panic in preprocessing either.
    assert!(preprocess_image(&image::RgbImage::new(0, 0), &PreprocessorConfig::default()).is_err());
}

/// PNG signature + IHDR declaring 0x0 + IEND (CRCs computed so only the size is wrong).
fn zero_size_png() -> Vec<u8> {
    fn crc32(data: &[u8]) -> u32 {
        let mut c = 0xffff_ffffu32;
        for &b in data {
            c ^= b as u32;
            for _ in 0..8 {
                c = if c & 1 != 0 { 0xedb8_8320 ^ (c >> 1) } else { c >> 1 };
            }
        }
        !c
    }
    fn chunk(out: &mut Vec<u8>, kind: &[u8], data: &[u8]) {
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        let mut body = kind.to_vec();
        body.extend_from_slice(data);
        out.extend_from_slice(&body);
        out.extend_from_slice(&crc32(&body).to_be_bytes());
    }
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    let ihdr = [0, 0, 0, 0, 0, 0, 0, 0, 8, 2, 0, 0, 0]; // 0x0, 8-bit RGB
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(&mut out, b"IEND", &[]);
    out
}

#[test]
fn frame_sampling_follows_hf() {
    // 8 frames at 4 fps sampled at 2 fps → 4 frames, every other one.
    assert_eq!(sample_indices(8, 4.0, 2.0, 2, 768).unwrap(), vec![0, 2, 4, 6]);
    // Never fewer than one temporal patch.
    assert_eq!(sample_indices(8, 4.0, 0.1, 2, 768).unwrap(), vec![0, 4]);
    // Capped by max_frames (floored to the factor) and by the frame count.
    assert_eq!(sample_indices(30, 10.0, 10.0, 2, 5).unwrap(), vec![0, 7, 15, 22]);
    assert_eq!(sample_indices(5, 1.0, 30.0, 2, 768).unwrap(), vec![0, 1, 2, 3]);
    assert!(sample_indices(1, 1.0, 1.0, 2, 768).is_err());
    assert!(sample_indices(8, 4.0, 0.0, 2, 768).is_err());
}

#[cfg(feature = "video")]
mod video {
    use super::*;
    use merg::vision::load_video_frames;

    #[test]
    fn clip_mp4_sampled_at_2fps() {
        let p = fixtures().join("media/clip.mp4");
        let v = load_video_frames(&p, 2.0, 768).unwrap();
        assert_eq!(v.total_frames, 8);
        assert_eq!(v.indices, vec![0, 2, 4, 6]);
        assert_eq!(v.frames.len(), 4);
        assert!(v.frames.iter().all(|f| f.dimensions() == (84, 56)));
        assert!((v.fps - 2.0).abs() < 1e-4, "fps {}", v.fps);
        assert!((v.source_fps - 4.0).abs() < 1e-4);
        // The sampled frames preprocess into whole temporal patches.
        let p = preprocess_video(&v.frames, &tiny_config()).unwrap();
        assert_eq!(p.grid_thw[0], 2);
    }

    #[test]
    fn bad_videos_report_the_path() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.mp4");
        err_mentions(load_video_frames(&missing, 2.0, 16), &missing);
        let junk = dir.path().join("junk.mp4");
        let bytes: Vec<u8> = (0..4096u32).map(|i| (i.wrapping_mul(2654435761) >> 13) as u8).collect();
        std::fs::write(&junk, bytes).unwrap();
        err_mentions(load_video_frames(&junk, 2.0, 16), &junk);
    }
}
