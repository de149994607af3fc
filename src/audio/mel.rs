//! Log-mel features equal to transformers' `WhisperFeatureExtractor` (4.57.1) as Qwen2.5-Omni's
//! processor calls it: the 16 kHz signal padded with zeros or truncated to the chunk
//! (`padding="max_length"`, `truncation=True`), a centred STFT (reflect padding of n_fft / 2,
//! periodic Hann window), the power spectrum, the Slaney mel filter bank, `log10(max(x, 1e-10))`,
//! a floor of max − 8 over the whole chunk, then `(x + 4) / 4`. The STFT's last frame is dropped,
//! as transformers drops it. Arithmetic is f64 (transformers' torch path is f32; its own numpy
//! path differs from it by up to 6e-5), results f32.

use std::sync::Arc;

use rustfft::num_complex::Complex;
use rustfft::{Fft, FftPlanner};

/// The feature extractor's settings (`preprocessor_config.json` of a Whisper-style model).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MelConfig {
    /// Mel bins (`feature_size`): 128 for Qwen2.5-Omni, 80 for Whisper's default.
    pub n_mels: usize,
    pub n_fft: usize,
    pub hop: usize,
    pub sampling_rate: u32,
    /// The window every input is padded or cut to (`chunk_length`, seconds).
    pub chunk_seconds: u32,
}

impl MelConfig {
    /// Qwen2.5-Omni's `WhisperFeatureExtractor` settings.
    pub const QWEN2_5_OMNI: MelConfig = MelConfig { n_mels: 128, n_fft: 400, hop: 160, sampling_rate: 16000, chunk_seconds: 30 };
    /// transformers' defaults (Whisper's 80 bins).
    pub const WHISPER: MelConfig = MelConfig { n_mels: 80, ..MelConfig::QWEN2_5_OMNI };

    /// Samples of one chunk (`n_samples`).
    pub fn chunk_samples(&self) -> usize {
        self.chunk_seconds as usize * self.sampling_rate as usize
    }

    /// Frames the attention mask marks valid for a signal of `samples` samples (what
    /// [`MelExtractor::extract`] would mark, without computing anything).
    pub fn valid_frames(&self, samples: usize) -> usize {
        attention_mask(samples.min(self.chunk_samples()), self.chunk_samples(), self.hop).iter().filter(|&&m| m == 1).count()
    }

    /// The extractor's settings from a `preprocessor_config.json` (`feature_size`, `n_fft`,
    /// `hop_length`, `sampling_rate`, `chunk_length`); `None` when it names no feature extractor.
    /// Absent fields take Qwen2.5-Omni's values; a zero is an error naming the field.
    pub fn from_preprocessor_json(v: &serde_json::Value) -> Result<Option<MelConfig>, String> {
        if v.get("feature_size").is_none() && v.get("feature_extractor_type").is_none() {
            return Ok(None);
        }
        let d = MelConfig::QWEN2_5_OMNI;
        let field = |name: &str, default: usize| -> Result<usize, String> {
            match v.get(name) {
                None => Ok(default),
                Some(x) => x.as_u64().filter(|&n| n > 0).map(|n| n as usize).ok_or_else(|| format!("{name}: {x} is not a positive whole number")),
            }
        };
        let cfg = MelConfig {
            n_mels: field("feature_size", d.n_mels)?,
            n_fft: field("n_fft", d.n_fft)?,
            hop: field("hop_length", d.hop)?,
            sampling_rate: field("sampling_rate", d.sampling_rate as usize)? as u32,
            chunk_seconds: field("chunk_length", d.chunk_seconds as usize)? as u32,
        };
        if cfg.sampling_rate != super::TARGET_RATE {
            return Err(format!("sampling_rate: {} Hz; merg resamples audio to {} Hz only", cfg.sampling_rate, super::TARGET_RATE));
        }
        Ok(Some(cfg))
    }
}

/// Features of one chunk: `n_mels` rows of `frames` values, and which frames hold signal.
#[derive(Clone, Debug, PartialEq)]
pub struct MelFeatures {
    pub n_mels: usize,
    pub frames: usize,
    /// Row-major `[n_mels][frames]` (the layout of transformers' `input_features[0]`).
    pub values: Vec<f32>,
    /// `feature_attention_mask`: 1 for frames that start inside the signal, 0 for padding.
    pub mask: Vec<u8>,
    /// Whether the signal was longer than the chunk and cut to it.
    pub truncated: bool,
}

impl MelFeatures {
    pub fn row(&self, mel: usize) -> &[f32] {
        &self.values[mel * self.frames..(mel + 1) * self.frames]
    }
}

/// One mel filter: its first FFT bin and weights (the bank is sparse: a triangle per filter).
#[derive(Clone, Debug)]
struct Filter {
    start: usize,
    weights: Vec<f64>,
}

/// A prepared extractor (filter bank, window and FFT plan built once).
pub struct MelExtractor {
    cfg: MelConfig,
    filters: Vec<Filter>,
    window: Vec<f64>,
    fft: Arc<dyn Fft<f64>>,
}

impl MelExtractor {
    pub fn new(cfg: MelConfig) -> MelExtractor {
        let fft = FftPlanner::new().plan_fft_forward(cfg.n_fft);
        // torch.hann_window(n) is periodic: the denominator is n, not n - 1.
        let n = cfg.n_fft as f64;
        let window = (0..cfg.n_fft).map(|i| 0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / n).cos()).collect();
        let filters = slaney_bank(cfg.n_mels, cfg.n_fft / 2 + 1, cfg.sampling_rate, 8000.0);
        MelExtractor { cfg, filters, window, fft }
    }

    pub fn config(&self) -> MelConfig {
        self.cfg
    }

    /// Features of 16 kHz mono `samples`, padded with zeros or truncated to one chunk.
    pub fn extract(&self, samples: &[f32]) -> MelFeatures {
        let n = self.cfg.chunk_samples();
        let used = samples.len().min(n);
        let mut signal = vec![0f64; n];
        for (d, s) in signal.iter_mut().zip(&samples[..used]) {
            *d = *s as f64;
        }
        let mut values = self.log_mel(&signal);
        let frames = n / self.cfg.hop;
        floor_and_scale(&mut values);
        MelFeatures {
            n_mels: self.cfg.n_mels,
            frames,
            values: values.into_iter().map(|v| v as f32).collect(),
            mask: attention_mask(used, n, self.cfg.hop),
            truncated: samples.len() > n,
        }
    }

    /// `log10(max(mel power, 1e-10))`, `[n_mels][frames]`, of a signal of at least n_fft / 2 + 1
    /// samples (reflect padding needs them; a chunk always has).
    fn log_mel(&self, signal: &[f64]) -> Vec<f64> {
        let (n_fft, hop) = (self.cfg.n_fft, self.cfg.hop);
        let padded = reflect_pad(signal, n_fft / 2);
        // 1 + len / hop STFT frames, less the last one.
        let frames = signal.len() / hop;
        let mut out = vec![0f64; self.cfg.n_mels * frames];
        let mut buf = vec![Complex::new(0.0, 0.0); n_fft];
        let mut scratch = vec![Complex::new(0.0, 0.0); self.fft.get_inplace_scratch_len()];
        let mut power = vec![0f64; n_fft / 2 + 1];
        for t in 0..frames {
            let frame = &padded[t * hop..t * hop + n_fft];
            for ((b, x), w) in buf.iter_mut().zip(frame).zip(&self.window) {
                *b = Complex::new(x * w, 0.0);
            }
            self.fft.process_with_scratch(&mut buf, &mut scratch);
            for (p, c) in power.iter_mut().zip(&buf) {
                *p = c.norm_sqr();
            }
            for (m, f) in self.filters.iter().enumerate() {
                let e: f64 = f.weights.iter().zip(&power[f.start..]).map(|(w, p)| w * p).sum();
                out[m * frames + t] = e.max(1e-10).log10();
            }
        }
        out
    }
}

/// `x[pad]..x[1]`, x, `x[n-2]..x[n-1-pad]` (torch's `reflect`: the edge sample not repeated).
fn reflect_pad(x: &[f64], pad: usize) -> Vec<f64> {
    assert!(x.len() > pad, "reflect padding of {pad} needs more than {pad} samples");
    let n = x.len();
    let mut out = Vec::with_capacity(n + 2 * pad);
    out.extend((1..=pad).rev().map(|i| x[i]));
    out.extend_from_slice(x);
    out.extend((1..=pad).map(|i| x[n - 1 - i]));
    out
}

/// Whisper's dynamic-range floor (max − 8 over the whole chunk) and scaling to about [-1, 1].
fn floor_and_scale(v: &mut [f64]) {
    let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    for x in v.iter_mut() {
        *x = (x.max(max - 8.0) + 4.0) / 4.0;
    }
}

/// transformers' sample mask (`used` ones, padding zeros) taken every `hop` samples, less the
/// last entry when the chunk is not a whole number of hops (the STFT frame it would mark is
/// dropped).
fn attention_mask(used: usize, chunk: usize, hop: usize) -> Vec<u8> {
    let mut mask: Vec<u8> = (0..chunk).step_by(hop).map(|i| u8::from(i < used)).collect();
    if !chunk.is_multiple_of(hop) {
        mask.pop();
    }
    mask
}

/// Slaney mel scale (librosa's default, transformers' `mel_scale="slaney"`): linear to 1 kHz,
/// logarithmic above.
fn hz_to_mel(f: f64) -> f64 {
    let logstep = 27.0 / 6.4f64.ln();
    if f >= 1000.0 {
        15.0 + (f / 1000.0).ln() * logstep
    } else {
        3.0 * f / 200.0
    }
}

fn mel_to_hz(m: f64) -> f64 {
    let logstep = 6.4f64.ln() / 27.0;
    if m >= 15.0 {
        1000.0 * (logstep * (m - 15.0)).exp()
    } else {
        200.0 * m / 3.0
    }
}

/// numpy's `linspace(start, stop, num)`: `start + i * step`, the last point exactly `stop`.
fn linspace(start: f64, stop: f64, num: usize) -> Vec<f64> {
    let step = (stop - start) / (num - 1) as f64;
    let mut v: Vec<f64> = (0..num).map(|i| start + i as f64 * step).collect();
    v[num - 1] = stop;
    v
}

/// transformers' `mel_filter_bank(bins, n_mels, 0, max_hz, rate, norm="slaney",
/// mel_scale="slaney")`: triangles between mel-spaced corners over the FFT bins' frequencies,
/// each scaled by 2 / its width in Hz (equal area), kept sparse.
fn slaney_bank(n_mels: usize, bins: usize, rate: u32, max_hz: f64) -> Vec<Filter> {
    let corners: Vec<f64> = linspace(hz_to_mel(0.0), hz_to_mel(max_hz), n_mels + 2).into_iter().map(mel_to_hz).collect();
    let fft_freqs = linspace(0.0, (rate / 2) as f64, bins);
    (0..n_mels)
        .map(|m| {
            let (lo, mid, hi) = (corners[m], corners[m + 1], corners[m + 2]);
            let enorm = 2.0 / (hi - lo);
            let w: Vec<f64> = fft_freqs
                .iter()
                .map(|&f| {
                    let down = -(lo - f) / (mid - lo);
                    let up = (hi - f) / (hi - mid);
                    down.min(up).max(0.0) * enorm
                })
                .collect();
            let start = w.iter().position(|&x| x > 0.0).unwrap_or(0);
            let end = w.iter().rposition(|&x| x > 0.0).map_or(start, |e| e + 1);
            Filter { start, weights: w[start..end].to_vec() }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reflect_padding_is_torchs() {
        assert_eq!(reflect_pad(&[1.0, 2.0, 3.0, 4.0], 2), vec![3.0, 2.0, 1.0, 2.0, 3.0, 4.0, 3.0, 2.0]);
    }

    #[test]
    fn the_mask_marks_frames_that_start_in_the_signal() {
        let m = attention_mask(32000, 480000, 160);
        assert_eq!((m.len(), m.iter().map(|&x| x as usize).sum::<usize>()), (3000, 200));
        assert_eq!(attention_mask(161, 480000, 160).iter().filter(|&&x| x == 1).count(), 2);
        assert_eq!(attention_mask(10, 1000, 160).len(), 6);
    }

    #[test]
    fn the_slaney_scale_round_trips_and_filters_have_equal_area() {
        for f in [0.0, 440.0, 999.0, 1000.0, 4321.0, 8000.0] {
            assert!((mel_to_hz(hz_to_mel(f)) - f).abs() < 1e-9);
        }
        let bank = slaney_bank(128, 201, 16000, 8000.0);
        assert_eq!(bank.len(), 128);
        // Every filter covers at least one bin (transformers warns otherwise).
        assert!(bank.iter().all(|f| !f.weights.is_empty()));
    }

    #[test]
    fn silence_is_the_floor_everywhere_and_truncation_is_reported() {
        let ex = MelExtractor::new(MelConfig::WHISPER);
        let f = ex.extract(&[0.0; 1600]);
        assert_eq!((f.n_mels, f.frames, f.truncated), (80, 3000, false));
        // log10(1e-10) = -10 everywhere: (−10 + 4) / 4.
        assert!(f.values.iter().all(|&v| v == -1.5));
        assert_eq!(f.mask.iter().filter(|&&x| x == 1).count(), 10);
        assert!(ex.extract(&vec![0.0; 480001]).truncated);
    }
}
