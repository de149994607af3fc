//! src/audio against PyAV and transformers 4.57.1 (scripts/make_audio_goldens.py): the log-mel
//! features of `WhisperFeatureExtractor` as Qwen2.5-Omni's processor calls it (128 bins) and
//! at its 80-bin default, and (with ffmpeg) the 16 kHz mono PCM of the WAV and the mp4 fixtures.

use std::path::{Path, PathBuf};

use merg::audio::{MelConfig, MelExtractor};
use safetensors::SafeTensors;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Every f32 tensor of a golden file.
fn golden(name: &str) -> std::collections::HashMap<String, Vec<f32>> {
    let bytes = std::fs::read(fixtures().join("goldens/audio").join(name)).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    st.tensors().into_iter().map(|(k, v)| (k, v.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect())).collect()
}

fn index() -> serde_json::Value {
    serde_json::from_str(&std::fs::read_to_string(fixtures().join("goldens/audio/index.json")).unwrap()).unwrap()
}

/// Largest |a - b| over `frames` columns of `want` ([mels][frames]) against the same columns of
/// `got` ([mels][got_frames]) starting at `from`.
fn max_err(got: &[f32], got_frames: usize, want: &[f32], frames: usize, from: usize) -> f32 {
    let mels = want.len() / frames;
    let mut worst = 0f32;
    for m in 0..mels {
        for t in 0..frames {
            worst = worst.max((got[m * got_frames + from + t] - want[m * frames + t]).abs());
        }
    }
    worst
}

fn check_tone(case: &str, cfg: MelConfig) {
    let pcm = &golden("pcm.safetensors")["wav"];
    let want = &golden("features.safetensors")[&format!("{case}.head")];
    let meta = &index()["cases"][case];
    let f = MelExtractor::new(cfg).extract(pcm);
    assert_eq!((f.n_mels, f.frames), (cfg.n_mels, meta["frames"].as_u64().unwrap() as usize));
    let head = meta["head"].as_u64().unwrap() as usize;
    let err = max_err(&f.values, f.frames, want, head, 0);
    // Past the signal transformers has the floor in every frame.
    let floor = meta["floor"].as_f64().unwrap() as f32;
    let floor_err = (0..f.n_mels).flat_map(|m| f.row(m)[head..].iter()).map(|v| (v - floor).abs()).fold(0f32, f32::max);
    eprintln!("{case}: max |merg - transformers| = {err:e} (first {head} frames), {floor_err:e} (floor)");
    assert!(err < 1e-4 && floor_err < 1e-4, "{case}: {err} {floor_err}");
    assert_eq!(f.mask.len(), meta["mask_len"].as_u64().unwrap() as usize);
    assert_eq!(f.mask.iter().map(|&x| x as u64).sum::<u64>(), meta["mask_sum"].as_u64().unwrap());
    assert!(!f.truncated);
}

#[test]
fn qwen2_5_omni_features_equal_transformers() {
    check_tone("wav128", MelConfig::QWEN2_5_OMNI);
}

#[test]
fn whisper_default_features_equal_transformers() {
    check_tone("wav80", MelConfig::WHISPER);
}

/// 31 s, so the chunk is cut to 30 s: the script's chirp, rebuilt here (f64, rounded to f32).
#[test]
fn a_long_signal_is_truncated_like_transformers() {
    let x: Vec<f32> = (0..31 * 16000)
        .map(|i| {
            let t = i as f64 / 16000.0;
            let tau = std::f64::consts::TAU;
            (0.4 * (tau * (150.0 * t + 40.0 * t * t)).sin() + 0.1 * (tau * 3000.0 * t).sin()) as f32
        })
        .collect();
    let g = golden("features.safetensors");
    let edge = index()["cases"]["long128"]["edge"].as_u64().unwrap() as usize;
    let f = MelExtractor::new(MelConfig::QWEN2_5_OMNI).extract(&x);
    assert!(f.truncated && f.mask.iter().all(|&m| m == 1));
    let head = max_err(&f.values, f.frames, &g["long128.head"], edge, 0);
    let tail = max_err(&f.values, f.frames, &g["long128.tail"], edge, f.frames - edge);
    eprintln!("long128: max |merg - transformers| = {head:e} (first {edge} frames), {tail:e} (last {edge})");
    assert!(head < 1e-4 && tail < 1e-4, "{head} {tail}");
}

#[cfg(feature = "video")]
fn check_pcm(file: &str, key: &str, tol: f32) {
    let pcm = merg::audio::load_audio(&fixtures().join("media").join(file)).unwrap();
    let want = &golden("pcm.safetensors")[key];
    assert_eq!(pcm.samples.len(), want.len(), "{file}: sample count");
    let err = pcm.samples.iter().zip(want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    eprintln!("{file}: max |merg - PyAV| = {err:e} over {} samples", want.len());
    assert!(err < tol, "{file}: {err}");
}

/// 44.1 kHz stereo 16-bit: hound + channel mean + swresample against PyAV's swresample + mean.
#[cfg(feature = "video")]
#[test]
fn the_wav_fixture_decodes_to_pyavs_16k_mono() {
    check_pcm("tone.wav", "wav", 1e-4);
}

/// AAC in an mp4 (beside a video stream), through ffmpeg's decoder.
#[cfg(feature = "video")]
#[test]
fn the_mp4_audio_track_decodes_to_pyavs_16k_mono() {
    check_pcm("tone.mp4", "mp4", 1e-3);
}
