//! WAV files in pure Rust (hound): every PCM integer width and 32-bit float, any rate and channel
//! count, so WAV input works without ffmpeg. The header is checked (rate, channels, duration
//! cap) before a sample is decoded.

use std::io::Read;
use std::path::Path;

use super::{downmix, AudioError};

/// The file's samples averaged over its channels, and its sample rate.
pub(crate) fn read(path: &Path, reader: impl Read, max_seconds: f64) -> Result<(Vec<f32>, u32), AudioError> {
    let bad = |e: hound::Error| AudioError::undecodable(path, e);
    let wav = hound::WavReader::new(reader).map_err(bad)?;
    let spec = wav.spec();
    if spec.sample_rate == 0 {
        return Err(AudioError::ZeroRate { path: path.to_path_buf() });
    }
    let seconds = wav.duration() as f64 / spec.sample_rate as f64;
    super::check_duration(path, seconds, max_seconds)?;
    if wav.duration() == 0 {
        return Err(AudioError::Empty { path: path.to_path_buf() });
    }
    // Integers are scaled by 2^(bits-1), as ffmpeg's conversion to float does.
    let interleaved: Vec<f32> = match spec.sample_format {
        hound::SampleFormat::Float => wav.into_samples::<f32>().collect::<Result<_, _>>().map_err(bad)?,
        hound::SampleFormat::Int => {
            let scale = 1.0 / (1u64 << (spec.bits_per_sample - 1)) as f32;
            wav.into_samples::<i32>().map(|s| s.map(|v| v as f32 * scale)).collect::<Result<_, _>>().map_err(bad)?
        }
    };
    Ok((downmix(&interleaved, spec.channels as usize), spec.sample_rate))
}
