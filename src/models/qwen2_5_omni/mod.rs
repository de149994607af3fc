//! Qwen2.5-Omni (`qwen2_5_omni`: the released 3B and 7B): its thinker, which reads text, images,
//! video and audio and writes text. The text model and vision tower are Qwen2.5-VL's (the
//! shared decoder, `qwen2_vl::vision::VisionTower`), the audio tower is Whisper-style
//! (`audio`), and positions are TMRoPE (`position::tmrope_index`). The talker and token2wav
//! (speech output) are not loaded: their tensors stay in the files unread.

pub mod audio;
pub mod config;
pub mod prompt;

use anyhow::{Context, Result};
use serde_json::Value;

use audio::AudioTower;
pub use config::{AudioConfig, Config};

use super::decoder::Decoder;
use super::position::PositionScheme;
use super::qwen2_vl::vision::VisionTower;
use super::qwen2_vl::{self, Variant};
use super::vlm::{FamilyConfig, VisionLanguageModel};
use super::{ModelSpec, ParamCounts};
use crate::weights::Weights;

/// The registry's config reader for `qwen2_5_omni`.
pub fn parse(config: &Value) -> Result<Box<dyn FamilyConfig>> {
    Ok(Box::new(Config::from_value(config)?))
}

impl FamilyConfig for Config {
    fn spec(&self) -> ModelSpec {
        ModelSpec { model_type: "qwen2_5_omni".into(), ..self.vl.spec() }
    }

    fn param_counts(&self) -> ParamCounts {
        ParamCounts { audio: self.audio.num_params(), ..self.vl.param_counts() }
    }

    fn notes(&self) -> Vec<String> {
        vec!["the thinker only: the talker and token2wav (speech output) are not loaded".into()]
    }

    /// The thinker's tensors (`thinker.model.*`, `thinker.lm_head`, `thinker.visual.*`,
    /// `thinker.audio_tower.*`, or the same without `thinker.` for a thinker saved on its own);
    /// `talker.*` and `token2wav.*` are never asked for.
    fn build(&self, w: Weights) -> Result<VisionLanguageModel> {
        let t = match w.contains("model.embed_tokens.weight") {
            true => w.clone(),
            false => w.pp("thinker"),
        };
        let model = VisionLanguageModel::assemble(
            self.spec(),
            qwen2_vl::position::params(&self.vl),
            &w,
            || Ok(Decoder::new(&self.vl.text.decoder(), t.pp("model"), t.clone())?),
            || Ok(Box::new(VisionTower::new(Variant::Qwen25Vl, &self.vl.vision, t.pp("visual"))?)),
        )?;
        let audio = AudioTower::new(&self.audio, t.pp("audio_tower"))
            .context("audio tower")
            .with_context(|| format!("checkpoint [{}] does not match its config.json", w.describe()))?;
        Ok(model.with_positions(PositionScheme::TmRope(self.tmrope())).with_audio(self.audio_spec(), Box::new(audio)))
    }
}
