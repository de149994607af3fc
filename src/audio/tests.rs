//! Decoding and the bad-input cases. Files are written here with hound (or by hand where a
//! header must lie), so every case is seeded or exact.

use super::*;

fn write_wav(path: &Path, spec: hound::WavSpec, frames: &[Vec<f64>]) {
    let mut w = hound::WavWriter::create(path, spec).unwrap();
    for f in frames {
        for &x in f {
            match (spec.sample_format, spec.bits_per_sample) {
                (hound::SampleFormat::Float, _) => w.write_sample(x as f32).unwrap(),
                (_, bits) => w.write_sample((x * (1u64 << (bits - 1)) as f64).round() as i32).unwrap(),
            }
        }
    }
    w.finalize().unwrap();
}

/// 0.1 s of two channels at 16 kHz: a ramp and its negative half.
fn frames() -> Vec<Vec<f64>> {
    (0..1600).map(|i| vec![(i as f64 / 1600.0) - 0.5, 0.25 - (i as f64 / 3200.0)]).collect()
}

#[test]
fn every_pcm_width_and_float_decode_to_the_channel_mean() {
    let dir = tempfile::tempdir().unwrap();
    for (bits, format) in [(16, hound::SampleFormat::Int), (24, hound::SampleFormat::Int), (32, hound::SampleFormat::Int), (32, hound::SampleFormat::Float)] {
        let p = dir.path().join(format!("x{bits}.wav"));
        let spec = hound::WavSpec { channels: 2, sample_rate: 16000, bits_per_sample: bits, sample_format: format };
        write_wav(&p, spec, &frames());
        let pcm = load_audio(&p).unwrap();
        assert_eq!(pcm.samples.len(), 1600);
        // Quantisation to `bits` (a step at most) and the f32 result's rounding are the only errors.
        let step = if format == hound::SampleFormat::Float { 0.0 } else { 1.0 / (1u64 << (bits - 1)) as f64 };
        let tol = step + 1e-7;
        let worst = pcm.samples.iter().zip(frames()).map(|(&s, f)| (s as f64 - (f[0] + f[1]) / 2.0).abs()).fold(0.0, f64::max);
        assert!(worst <= tol, "{bits}-bit {format:?}: {worst}");
    }
}

/// A RIFF/WAVE header by hand: 16-bit mono PCM at `rate` announcing `data_len` bytes.
fn wav_header(rate: u32, data_len: u32) -> Vec<u8> {
    let mut b = b"RIFF".to_vec();
    b.extend((36 + data_len).to_le_bytes());
    b.extend(b"WAVEfmt ");
    b.extend(16u32.to_le_bytes());
    b.extend(1u16.to_le_bytes()); // PCM
    b.extend(1u16.to_le_bytes()); // mono
    b.extend(rate.to_le_bytes());
    b.extend((rate * 2).to_le_bytes());
    b.extend(2u16.to_le_bytes());
    b.extend(16u16.to_le_bytes());
    b.extend(b"data");
    b.extend(data_len.to_le_bytes());
    b
}

#[test]
fn a_zero_rate_an_empty_stream_and_a_long_header_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("zero-rate.wav");
    let mut bytes = wav_header(0, 4);
    bytes.extend([0, 0, 0, 0]);
    std::fs::write(&p, bytes).unwrap();
    let e = load_audio(&p).unwrap_err();
    assert!(matches!(e, AudioError::ZeroRate { .. }) && e.to_string().contains("zero-rate.wav: the header gives a sample rate of 0"), "{e}");

    let p = dir.path().join("empty.wav");
    std::fs::write(&p, wav_header(16000, 0)).unwrap();
    let e = load_audio(&p).unwrap_err();
    assert!(matches!(e, AudioError::Empty { .. }) && e.to_string().contains("empty.wav"), "{e}");

    // The header claims two hours; only 8 bytes follow. Refused before decoding.
    let p = dir.path().join("long.wav");
    let mut bytes = wav_header(16000, 2 * 3600 * 32000);
    bytes.extend([0; 8]);
    std::fs::write(&p, bytes).unwrap();
    let e = load_audio(&p).unwrap_err();
    assert!(matches!(e, AudioError::TooLong { .. }), "{e}");
    assert!(e.to_string().contains("long.wav is 7200.0 s long; the limit is 1200 s (raise it with MERG_MAX_AUDIO_SECONDS=<seconds>)"), "{e}");
}

#[test]
fn the_duration_cap_applies_to_real_samples() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tenth.wav");
    write_wav(&p, hound::WavSpec { channels: 2, sample_rate: 16000, bits_per_sample: 16, sample_format: hound::SampleFormat::Int }, &frames());
    let e = wav::read(&p, std::fs::File::open(&p).unwrap(), 0.05).unwrap_err();
    assert!(e.to_string().contains("tenth.wav is 0.1 s long; the limit is"), "{e}");
}

#[test]
fn files_that_are_not_audio_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let e = load_audio(dir.path()).unwrap_err();
    assert!(e.to_string().contains("is not a regular file (a directory)"), "{e}");
    let missing = dir.path().join("missing.flac");
    assert!(load_audio(&missing).unwrap_err().to_string().contains("missing.flac"));
    let p = dir.path().join("noise.mp3");
    std::fs::write(&p, b"this is not an mp3 file at all, just text").unwrap();
    let e = load_audio(&p).unwrap_err();
    #[cfg(feature = "video")]
    assert!(matches!(e, AudioError::Undecodable { .. }), "{e}");
    #[cfg(not(feature = "video"))]
    assert!(matches!(e, AudioError::NeedsFfmpeg { .. }), "{e}");
    assert!(e.to_string().contains("noise.mp3"), "{e}");
    // A truncated RIFF header is a WAV that does not decode.
    let p = dir.path().join("cut.wav");
    std::fs::write(&p, &wav_header(16000, 4)[..30]).unwrap();
    let e = load_audio(&p).unwrap_err();
    assert!(matches!(e, AudioError::Undecodable { .. }) && e.to_string().contains("cut.wav"), "{e}");
}

#[cfg(feature = "video")]
#[test]
fn a_clip_without_an_audio_stream_is_named() {
    let clip = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/media/clip.mp4");
    let e = load_clip_audio(&clip).unwrap_err();
    assert!(matches!(e, AudioError::NoAudioStream { .. }), "{e}");
    assert!(e.to_string().ends_with("clip.mp4 has no audio stream"), "{e}");
}

#[cfg(not(feature = "video"))]
#[test]
fn resampling_without_ffmpeg_is_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("cd.wav");
    write_wav(&p, hound::WavSpec { channels: 1, sample_rate: 44100, bits_per_sample: 16, sample_format: hound::SampleFormat::Int }, &vec![vec![0.1]; 100]);
    let e = load_audio(&p).unwrap_err();
    assert!(e.to_string().contains("cd.wav: resampling 44100 Hz to 16000 Hz needs ffmpeg"), "{e}");
}

#[test]
fn a_clip_longer_than_the_window_is_cut_to_the_span() {
    let pcm: Vec<f32> = (0..16000 * 40).map(|i| i as f32).collect();
    let whole = cut_to_span(&pcm[..16000 * 20], (2.0, 3.0), 30.0).unwrap();
    assert!(!whole.cut && whole.samples.len() == 16000 * 20 && whole.end == 20.0);
    let c = cut_to_span(&pcm, (2.5, 4.0), 30.0).unwrap();
    assert!(c.cut && c.samples.len() == 24000 && c.samples[0] == 40000.0 && (c.start, c.end) == (2.5, 4.0));
    // A span past the clip's end is clamped to it.
    let c = cut_to_span(&pcm, (39.0, 45.0), 30.0).unwrap();
    assert_eq!((c.samples.len(), c.end), (16000, 40.0));
    let e = cut_to_span(&pcm, (3.0, 3.0), 30.0).unwrap_err();
    assert_eq!(e.name, "audio_span");
}

#[test]
fn bytes_decode_like_the_file_and_errors_name_the_origin() {
    // A 16 kHz float WAV: read without ffmpeg, so the test holds without the `video` feature.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/media/omni_clip_b.wav");
    let wav = std::fs::read(&path).unwrap();
    let from_file = super::load_audio(&path).unwrap();
    let from_bytes = super::load_audio_bytes(&wav, "messages[0].content[1]").unwrap();
    assert_eq!(from_bytes.samples, from_file.samples);
    assert_eq!(from_bytes.source, std::path::PathBuf::from("messages[0].content[1]"));
    let e = super::load_audio_bytes(&[], "messages[0].content[1]").unwrap_err().to_string();
    assert!(e.contains("messages[0].content[1]") && e.contains("empty"), "{e}");
    let e = super::load_audio_bytes(b"RIFF\x10\0\0\0WAVEjunkjunk", "turns[2].audio").unwrap_err().to_string();
    assert!(e.contains("turns[2].audio") && e.contains("does not decode"), "{e}");
}

#[cfg(feature = "video")]
#[test]
fn compressed_bytes_go_through_ffmpeg_and_garbage_names_the_origin() {
    let mp4 = std::fs::read(Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/media").join("tone.mp4")).unwrap();
    let from_file = super::load_clip_audio(&Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/media").join("tone.mp4")).unwrap();
    let from_bytes = super::load_audio_bytes(&mp4, "input_audio").unwrap();
    assert_eq!(from_bytes.samples, from_file.samples);
    let e = super::load_audio_bytes(&[7u8; 4096], "messages[1].content[0]").unwrap_err().to_string();
    assert!(e.contains("messages[1].content[0]") && !e.contains("/tmp"), "{e}");
}
