//! Image bytes through decoding (pixel cap checked from the header) and HF-equal Qwen
//! preprocessing: an error or patches of the promised shape, never a panic or a blow-up.
#![no_main]
use libfuzzer_sys::fuzz_target;
use merg::vision::{decode_image, preprocess_image, PreprocessorConfig};

fuzz_target!(|data: &[u8]| {
    let Ok(img) = decode_image(data, "fuzz image", 1 << 22) else { return };
    let cfg = PreprocessorConfig { max_pixels: 256 * 256, ..PreprocessorConfig::default() };
    if let Ok(p) = preprocess_image(&img, &cfg) {
        assert!(p.num_patches() > 0);
    }
});
