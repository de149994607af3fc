//! `config.json` of a Qwen2.5-Omni checkpoint (`model_type` `qwen2_5_omni`, the released 3B / 7B
//! layout, or `qwen2_5_omni_thinker`, a thinker saved on its own), read the way transformers
//! reads it. Only `thinker_config` is read: its
//! `text_config` and `vision_config` are a Qwen2.5-VL text model and tower (parsed by
//! `qwen2_vl::config`), its `audio_config` the Whisper-style encoder; `talker_config` and
//! `token2wav_config` describe the speech output merg does not run.

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::models::position::TmRope;
use crate::models::qwen2_vl::config::{parse_text, parse_vision};
use crate::models::qwen2_vl::{self, Variant};
use crate::models::{AudioSpec, SpecialIds};

/// `thinker_config.audio_config`, with transformers' defaults (`Qwen2_5OmniAudioEncoderConfig`)
/// for absent fields.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(default)]
pub struct AudioConfig {
    pub num_mel_bins: usize,
    pub d_model: usize,
    pub encoder_layers: usize,
    pub encoder_attention_heads: usize,
    pub encoder_ffn_dim: usize,
    /// Rows of the sinusoidal position table; a window's positions must fit in it.
    pub max_source_positions: usize,
    /// Half the mel frames of one attention window (windows of `2 · n_window` frames, `n_window`
    /// positions after the stride-2 convolution).
    pub n_window: usize,
    /// Width of the projected features = the text model's hidden size.
    pub output_dim: usize,
    pub activation_function: String,
}

impl Default for AudioConfig {
    fn default() -> Self {
        AudioConfig {
            num_mel_bins: 128,
            d_model: 1280,
            encoder_layers: 32,
            encoder_attention_heads: 20,
            encoder_ffn_dim: 5120,
            max_source_positions: 1500,
            n_window: 100,
            output_dim: 3584,
            activation_function: "gelu".into(),
        }
    }
}

impl AudioConfig {
    /// Parameters of the tower as the model uses it: two convolutions, the layers (two
    /// LayerNorms, q/k/v/out with no bias on k, fc1/fc2), ln_post and proj; the unused
    /// `audio_bos_eos_token` table is not loaded and not counted.
    pub fn num_params(&self) -> u64 {
        let (d, f, m, o) = (self.d_model as u64, self.encoder_ffn_dim as u64, self.num_mel_bins as u64, self.output_dim as u64);
        let convs = (d * m * 3 + d) + (d * d * 3 + d);
        let layer = 4 * d + (4 * d * d + 3 * d) + (d * f + f) + (f * d + d);
        convs + self.encoder_layers as u64 * layer + 2 * d + (d * o + o)
    }

    fn validate(&self, text_hidden: usize) -> Result<()> {
        for (name, v) in [
            ("num_mel_bins", self.num_mel_bins),
            ("d_model", self.d_model),
            ("encoder_layers", self.encoder_layers),
            ("encoder_attention_heads", self.encoder_attention_heads),
            ("encoder_ffn_dim", self.encoder_ffn_dim),
            ("n_window", self.n_window),
            ("output_dim", self.output_dim),
        ] {
            if v == 0 {
                bail!("audio_config.{name} must be at least 1, got 0");
            }
        }
        if !self.d_model.is_multiple_of(self.encoder_attention_heads) {
            bail!("audio_config.d_model {} is not divisible by audio_config.encoder_attention_heads {}", self.d_model, self.encoder_attention_heads);
        }
        if !self.d_model.is_multiple_of(2) || self.d_model < 4 {
            bail!("audio_config.d_model {} must be even and at least 4 (sinusoidal positions)", self.d_model);
        }
        if self.n_window > self.max_source_positions {
            bail!("audio_config.n_window {} exceeds audio_config.max_source_positions {}", self.n_window, self.max_source_positions);
        }
        if self.activation_function != "gelu" {
            bail!("audio_config.activation_function {:?} is not supported (gelu)", self.activation_function);
        }
        if self.output_dim != text_hidden {
            bail!("audio_config.output_dim {} differs from the text hidden_size {text_hidden}", self.output_dim);
        }
        Ok(())
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Config {
    /// The thinker's text model and vision tower, as a Qwen2.5-VL config (validated as one).
    pub vl: qwen2_vl::Config,
    pub audio: AudioConfig,
    /// Audio placeholder and markers.
    pub audio_token: u32,
    pub audio_start: u32,
    pub audio_end: u32,
    /// `position_id_per_seconds` and `seconds_per_chunk` of TMRoPE.
    pub per_second: i64,
    pub seconds_per_chunk: f64,
}

impl Config {
    pub fn from_value(root: &Value) -> Result<Self> {
        // The released checkpoints nest the thinker's config; a thinker saved on its own
        // (transformers' Qwen2_5OmniThinkerForConditionalGeneration) is it.
        let thinker = match root.get("model_type").and_then(Value::as_str) {
            Some("qwen2_5_omni") => root.get("thinker_config").context("missing \"thinker_config\" (the Qwen2.5-Omni thinker)")?,
            Some("qwen2_5_omni_thinker") => root,
            other => bail!("model_type {other:?} is not a Qwen2.5-Omni config (qwen2_5_omni, qwen2_5_omni_thinker)"),
        };
        let (text, text_obj) = parse_text(thinker).context("thinker_config")?;
        let vision = root_field(thinker, "vision_config")?;
        let vision = parse_vision(Variant::Qwen25Vl, vision, text.hidden_size).context("thinker_config.vision_config")?;
        let audio: AudioConfig = serde_path_to_error::deserialize(root_field(thinker, "audio_config")?.clone())
            .map_err(|e| anyhow::anyhow!("thinker_config.audio_config field {}: {}", e.path(), e.inner()))?;
        // transformers' Qwen2_5OmniThinkerConfig defaults: the released vocabulary's ids.
        let id = |key: &str, default: Option<u32>| -> Result<u32> {
            match thinker.get(key) {
                Some(v) => v.as_u64().map(|v| v as u32).with_context(|| format!("thinker_config.{key} must be a token id, got {v}")),
                None => default.with_context(|| format!("missing thinker_config.{key}")),
            }
        };
        let eos = SpecialIds::eos_of(&text_obj);
        let special = SpecialIds {
            image: id("image_token_index", Some(151655))?,
            video: id("video_token_index", Some(151656))?,
            vision_start: id("vision_start_token_id", None)?,
            vision_end: id("vision_end_token_id", None)?,
            eos,
        };
        let per_second = thinker.get("position_id_per_seconds").map_or(Some(25), Value::as_i64).context("thinker_config.position_id_per_seconds must be an integer")?;
        let seconds_per_chunk = thinker.get("seconds_per_chunk").map_or(Some(2.0), Value::as_f64).context("thinker_config.seconds_per_chunk must be a number")?;
        let cfg = Config {
            vl: qwen2_vl::Config {
                variant: Variant::Qwen25Vl,
                torch_dtype: root.get("torch_dtype").or(text_obj.get("torch_dtype")).and_then(Value::as_str).map(str::to_string),
                special,
                text,
                vision,
            },
            audio_token: id("audio_token_index", Some(151646))?,
            audio_start: id("audio_start_token_id", Some(151647))?,
            audio_end: id("audio_end_token_id", Some(151648))?,
            audio,
            per_second,
            seconds_per_chunk,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn validate(&self) -> Result<()> {
        self.vl.validate().context("thinker_config")?;
        self.audio.validate(self.vl.text.hidden_size).context("thinker_config")?;
        // A chunk of no ids (seconds_per_chunk 0, negative or NaN) would never end.
        if self.per_second <= 0 || self.per_chunk() <= 0 {
            bail!("thinker_config.position_id_per_seconds {} and seconds_per_chunk {} must be positive", self.per_second, self.seconds_per_chunk);
        }
        Ok(())
    }

    /// Position ids per audio-in-video chunk: `int(position_id_per_seconds · seconds_per_chunk)`.
    pub fn per_chunk(&self) -> i64 {
        (self.per_second as f64 * self.seconds_per_chunk) as i64
    }

    pub fn tmrope(&self) -> TmRope {
        let s = &self.vl.special;
        TmRope {
            audio_token: self.audio_token,
            audio_start: self.audio_start,
            audio_end: self.audio_end,
            vision_start: s.vision_start,
            vision_end: s.vision_end,
            per_second: self.per_second,
            per_chunk: self.per_chunk(),
        }
    }

    pub fn audio_spec(&self) -> AudioSpec {
        AudioSpec {
            token: self.audio_token,
            start: self.audio_start,
            end: self.audio_end,
            mel_bins: self.audio.num_mel_bins,
            chunk_frames: 2 * self.audio.n_window,
        }
    }
}

/// A sub-config of the thinker that must be present (transformers would build a 7B-sized
/// default in its place, which no tiny or 3B checkpoint matches).
fn root_field<'a>(thinker: &'a Value, key: &str) -> Result<&'a Value> {
    match thinker.get(key) {
        Some(v @ Value::Object(_)) => Ok(v),
        Some(v) => bail!("thinker_config.{key} must be an object, got {v}"),
        None => bail!("missing thinker_config.{key}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Value {
        let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-qwen2_5-omni/config.json")).unwrap();
        serde_json::from_str(&text).unwrap()
    }

    #[test]
    fn reads_the_tiny_thinker() {
        let c = Config::from_value(&tiny()).unwrap();
        assert_eq!((c.vl.text.hidden_size, c.vl.vision.width, c.audio.d_model, c.audio.n_window), (64, 32, 32, 100));
        assert_eq!((c.audio_token, c.audio_start, c.audio_end), (451, 452, 453));
        assert_eq!((c.vl.special.image, c.vl.special.video, c.vl.special.vision_start, c.vl.special.eos.clone()), (460, 461, 457, vec![450]));
        assert_eq!(c.per_chunk(), 50);
    }

    #[test]
    fn missing_audio_config_is_named() {
        let mut v = tiny();
        v["thinker_config"].as_object_mut().unwrap().remove("audio_config");
        let e = format!("{:#}", Config::from_value(&v).unwrap_err());
        assert!(e.contains("thinker_config.audio_config"), "{e}");
        let mut v = tiny();
        v.as_object_mut().unwrap().remove("thinker_config");
        let e = format!("{:#}", Config::from_value(&v).unwrap_err());
        assert!(e.contains("thinker_config"), "{e}");
    }

    #[test]
    fn bad_audio_fields_are_named() {
        for (field, value, says) in [
            ("d_model", serde_json::json!(30), "encoder_attention_heads"),
            ("output_dim", serde_json::json!(48), "audio_config.output_dim"),
            ("n_window", serde_json::json!(2000), "audio_config.n_window"),
            ("encoder_layers", serde_json::json!(-1), "audio_config field encoder_layers"),
        ] {
            let mut v = tiny();
            v["thinker_config"]["audio_config"][field] = value;
            let e = format!("{:#}", Config::from_value(&v).unwrap_err());
            assert!(e.contains(says), "{field}: {e}");
        }
    }
}
