//! Qwen3.5 (`qwen3_5`): the Qwen3-VL vision tower without DeepStack and a hybrid decoder —
//! Gated DeltaNet (linear attention, a fixed-size state per sequence) in three of every four
//! layers, gated full attention with partial interleaved M-RoPE in the rest, zero-centred
//! RMSNorms. The model is Qwen3-VL's config (`qwen3_vl::Config`) with this decoder:
//! positions, media splicing and the video timestamps are Qwen3-VL's. Multi-token-prediction weights (`mtp.*`) in the
//! checkpoint are not read (no speculative decoding).

pub mod config;

use anyhow::Result;
use serde_json::Value;

use super::vlm::FamilyConfig;

/// The registry's config reader for `qwen3_5`: a Qwen3-VL config with the hybrid decoder (the
/// `mtp.*` weights are neither loaded nor counted).
pub fn parse(config: &Value) -> Result<Box<dyn FamilyConfig>> {
    Ok(Box::new(config::from_value(config)?))
}
