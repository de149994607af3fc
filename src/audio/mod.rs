//! Audio input (issue 29 item 2): a turn's audio file (WAV, FLAC, MP3, …) or the audio track of
//! its clip, as 16 kHz mono f32, and the log-mel features of Whisper-style audio encoders.
//!
//! - WAV is read in pure Rust (`wav`, hound) with or without the `video` feature; at 16 kHz it
//!   needs nothing else.
//! - Every other format, an mp4's audio stream and a WAV at another rate go through ffmpeg
//!   (`ffmpeg`, behind the `video` feature): its decoders and swresample's default resampler.
//! - Channels are averaged (librosa's and qwen-omni-utils' downmix, not ffmpeg's `-ac 1`, which
//!   weights stereo by 1/√2 and so shifts every log-mel value).
//! - `mel`: transformers' `WhisperFeatureExtractor` as Qwen2.5-Omni's processor calls it.
//!
//! Caps: the file's size (`input::AUDIO`, `MERG_MAX_AUDIO_MIB`; a clip's is a video's) and its
//! duration (`MERG_MAX_AUDIO_SECONDS`), checked from the header before decoding and again on the
//! decoded samples. Every error is an [`AudioError`] naming the file.

#[cfg(feature = "video")]
mod ffmpeg;
pub mod mel;
mod wav;

use std::path::{Path, PathBuf};

pub use mel::{MelConfig, MelExtractor, MelFeatures};

/// The rate every decoded signal is resampled to (Whisper-style encoders take 16 kHz).
pub const TARGET_RATE: u32 = 16000;
/// Default duration cap in seconds (20 minutes: 77 MB of 16 kHz f32).
pub const MAX_AUDIO_SECONDS: f64 = 1200.0;
/// The variable that raises the duration cap.
pub const MAX_AUDIO_SECONDS_ENV: &str = "MERG_MAX_AUDIO_SECONDS";

/// Why a file gave no audio. Each names the file; none names a command-line flag.
#[derive(Debug, thiserror::Error)]
pub enum AudioError {
    #[error("audio {path} does not decode: {reason}")]
    Undecodable { path: PathBuf, reason: String },
    #[error("{path} has no audio stream")]
    NoAudioStream { path: PathBuf },
    #[error("the audio of {path} is empty (an audio stream of zero length)")]
    Empty { path: PathBuf },
    #[error("audio {path}: the header gives a sample rate of 0")]
    ZeroRate { path: PathBuf },
    #[error("audio {path} is {seconds:.1} s long; the limit is {limit} s (raise it with {MAX_AUDIO_SECONDS_ENV}=<seconds>)")]
    TooLong { path: PathBuf, seconds: f64, limit: f64 },
    #[error("audio {path}: {what} needs ffmpeg, and this merg was built without the `video` feature")]
    NeedsFfmpeg { path: PathBuf, what: String },
    /// The file itself: missing, not a regular file, over its size cap (the message names it).
    #[error("{0:#}")]
    File(anyhow::Error),
}

impl AudioError {
    /// The same error naming `path` instead of the file it was raised for.
    #[cfg_attr(not(feature = "video"), allow(dead_code))]
    fn renamed(self, path: &Path) -> AudioError {
        let path = path.to_path_buf();
        match self {
            AudioError::Undecodable { reason, .. } => AudioError::Undecodable { path, reason },
            AudioError::NoAudioStream { .. } => AudioError::NoAudioStream { path },
            AudioError::Empty { .. } => AudioError::Empty { path },
            AudioError::ZeroRate { .. } => AudioError::ZeroRate { path },
            AudioError::TooLong { seconds, limit, .. } => AudioError::TooLong { path, seconds, limit },
            other => other,
        }
    }

    fn undecodable(path: &Path, reason: impl std::fmt::Display) -> AudioError {
        AudioError::Undecodable { path: path.to_path_buf(), reason: reason.to_string() }
    }
}

/// 16 kHz mono samples decoded from a file.
#[derive(Clone, Debug, PartialEq)]
pub struct Pcm {
    pub samples: Vec<f32>,
    /// The file it came from (for trace notes).
    pub source: PathBuf,
}

impl Pcm {
    pub fn seconds(&self) -> f64 {
        self.samples.len() as f64 / TARGET_RATE as f64
    }
}

/// The duration cap in seconds (`MERG_MAX_AUDIO_SECONDS` when it is a positive number).
pub fn max_seconds() -> f64 {
    std::env::var(MAX_AUDIO_SECONDS_ENV).ok().and_then(|v| v.trim().parse::<f64>().ok()).filter(|s| *s > 0.0).unwrap_or(MAX_AUDIO_SECONDS)
}

fn too_long(path: &Path, seconds: f64) -> AudioError {
    AudioError::TooLong { path: path.to_path_buf(), seconds, limit: max_seconds() }
}

fn check_duration(path: &Path, seconds: f64, max: f64) -> Result<(), AudioError> {
    if seconds > max {
        return Err(too_long(path, seconds));
    }
    Ok(())
}

/// An audio file (a turn's `"audio"`) as 16 kHz mono.
pub fn load_audio(path: &Path) -> Result<Pcm, AudioError> {
    load(path, &crate::input::AUDIO)
}

/// The audio track of a video clip (a turn's `"video"`) as 16 kHz mono.
pub fn load_clip_audio(path: &Path) -> Result<Pcm, AudioError> {
    load(path, &crate::input::VIDEO)
}

fn load(path: &Path, kind: &crate::input::Kind) -> Result<Pcm, AudioError> {
    let max = max_seconds();
    // The size cap and the regular-file check come first: ffmpeg would block on a FIFO.
    let file = crate::input::open(path, kind).map_err(AudioError::File)?;
    let mut reader = std::io::BufReader::new(file);
    // A file's first read fills the buffer with far more than the 12 bytes of a RIFF header.
    let head = std::io::BufRead::fill_buf(&mut reader).map_err(|e| AudioError::undecodable(path, e))?;
    let samples = if is_wav(head) {
        let (mono, rate) = wav::read(path, reader, max)?;
        to_target_rate(mono, rate, path)?
    } else {
        drop(reader);
        decode_other(path, max)?
    };
    Ok(Pcm { samples, source: path.to_path_buf() })
}

/// Audio sent as bytes (a server request's base64 `input_audio`), as 16 kHz mono. `origin` names
/// the bytes in errors and trace notes (e.g. `messages[1].content[0]`). Every cap of a file
/// applies: its size (`input::AUDIO`) and its duration. A WAV is read in memory; any other
/// format goes through ffmpeg from a private temporary file (ffmpeg's demuxers read files).
pub fn load_audio_bytes(bytes: &[u8], origin: &str) -> Result<Pcm, AudioError> {
    let path = Path::new(origin);
    if bytes.len() as u64 > crate::input::AUDIO.limit() {
        return Err(AudioError::File(crate::input::AUDIO.too_big(path, bytes.len() as u64)));
    }
    if bytes.is_empty() {
        return Err(AudioError::Empty { path: path.to_path_buf() });
    }
    let samples = if is_wav(bytes) {
        let (mono, rate) = wav::read(path, std::io::Cursor::new(bytes), max_seconds())?;
        to_target_rate(mono, rate, path)?
    } else {
        decode_bytes_other(bytes, path)?
    };
    Ok(Pcm { samples, source: path.to_path_buf() })
}

#[cfg(feature = "video")]
fn decode_bytes_other(bytes: &[u8], origin: &Path) -> Result<Vec<f32>, AudioError> {
    use std::io::Write;
    let mut f = tempfile::NamedTempFile::new().map_err(|e| AudioError::undecodable(origin, format!("a temporary file for ffmpeg: {e}")))?;
    f.write_all(bytes).map_err(|e| AudioError::undecodable(origin, format!("a temporary file for ffmpeg: {e}")))?;
    // ffmpeg's errors name the temporary file; the caller's name replaces it.
    ffmpeg::decode(f.path(), max_seconds()).map_err(|e| e.renamed(origin))
}

#[cfg(not(feature = "video"))]
fn decode_bytes_other(_bytes: &[u8], origin: &Path) -> Result<Vec<f32>, AudioError> {
    Err(AudioError::NeedsFfmpeg { path: origin.to_path_buf(), what: "decoding audio other than WAV".into() })
}

/// RIFF/RIFX … WAVE: the one format read without ffmpeg (sniffed, not taken from the name).
fn is_wav(head: &[u8]) -> bool {
    head.len() >= 12 && (&head[..4] == b"RIFF" || &head[..4] == b"RIFX") && &head[8..12] == b"WAVE"
}

#[cfg(feature = "video")]
fn decode_other(path: &Path, max: f64) -> Result<Vec<f32>, AudioError> {
    ffmpeg::decode(path, max)
}

#[cfg(not(feature = "video"))]
fn decode_other(path: &Path, _max: f64) -> Result<Vec<f32>, AudioError> {
    Err(AudioError::NeedsFfmpeg { path: path.to_path_buf(), what: "decoding audio other than WAV".into() })
}

#[cfg(feature = "video")]
fn to_target_rate(mono: Vec<f32>, rate: u32, path: &Path) -> Result<Vec<f32>, AudioError> {
    if rate == TARGET_RATE {
        return Ok(mono);
    }
    ffmpeg::resample(&mono, rate, path)
}

#[cfg(not(feature = "video"))]
fn to_target_rate(mono: Vec<f32>, rate: u32, path: &Path) -> Result<Vec<f32>, AudioError> {
    if rate == TARGET_RATE {
        return Ok(mono);
    }
    Err(AudioError::NeedsFfmpeg { path: path.to_path_buf(), what: format!("resampling {rate} Hz to {TARGET_RATE} Hz") })
}

/// Interleaved frames of `channels` samples to their mean (in f64, so the order of the channels
/// does not round differently).
fn downmix(interleaved: &[f32], channels: usize) -> Vec<f32> {
    if channels == 1 {
        return interleaved.to_vec();
    }
    interleaved.chunks_exact(channels).map(|f| (f.iter().map(|&x| x as f64).sum::<f64>() / channels as f64) as f32).collect()
}

/// The samples an audio encoder gets for one turn, and whether they were cut to the turn's span.
#[derive(Clone, Debug, PartialEq)]
pub struct SpanCut {
    pub samples: Vec<f32>,
    /// True when the clip was longer than the window and only the span was kept (the trace
    /// says so).
    pub cut: bool,
    /// The seconds of the clip kept: `[start, end)`.
    pub start: f64,
    pub end: f64,
}

/// A clip no longer than `window` seconds is kept whole; a longer one is cut to the turn's
/// `[start, end)` span (seconds from the clip's start, clamped to the clip). A span that is
/// empty, reversed or not finite is refused as the `audio_span` setting.
pub fn cut_to_span(pcm: &[f32], span: (f64, f64), window: f64) -> Result<SpanCut, crate::setting::InvalidSetting> {
    let (start, end) = span;
    let shown = format!("{start}..{end} s");
    crate::setting::check(start.is_finite() && end.is_finite() && start >= 0.0 && end > start, "audio_span", &shown, "a span of seconds with 0 <= start < end")?;
    let total = pcm.len() as f64 / TARGET_RATE as f64;
    if total <= window {
        return Ok(SpanCut { samples: pcm.to_vec(), cut: false, start: 0.0, end: total });
    }
    let at = |t: f64| ((t * TARGET_RATE as f64).round() as usize).min(pcm.len());
    let (a, b) = (at(start), at(end));
    Ok(SpanCut { samples: pcm[a..b].to_vec(), cut: true, start: a as f64 / TARGET_RATE as f64, end: b as f64 / TARGET_RATE as f64 })
}

#[cfg(test)]
mod tests;
