//! Qwen3.5 (`qwen3_5`): the Qwen3-VL vision tower without DeepStack and a hybrid decoder —
//! Gated DeltaNet (linear attention, a fixed-size state per sequence) in three of every four
//! layers, gated full attention with partial interleaved M-RoPE in the rest, zero-centred
//! RMSNorms. The model type is `qwen3_vl::Qwen3Vl` with this decoder: positions, media splicing
//! and the video timestamps are Qwen3-VL's. Multi-token-prediction weights (`mtp.*`) in the
//! checkpoint are not read (no speculative decoding).

pub mod config;

use std::sync::Arc;

use anyhow::Result;
use serde_json::Value;

use super::qwen3_vl::{spec_of, Qwen3Vl};
use super::{Model, ModelSpec};
use crate::weights::Weights;

/// The registry's loader for `qwen3_5`.
pub fn load_from_config(config: &Value, weights: Weights) -> Result<Arc<dyn Model>> {
    Ok(Arc::new(Qwen3Vl::new(&config::from_value(config)?, weights)?))
}

/// The registry's parameter counter (the `mtp.*` weights are not counted: merg never loads
/// them).
pub fn params_from_config(config: &Value) -> Result<super::ParamCounts> {
    let cfg = config::from_value(config)?;
    Ok(super::ParamCounts::of(&cfg.decoder, cfg.vision.num_params()))
}

/// The registry's spec reader.
pub fn spec_from_config(config: &Value) -> Result<ModelSpec> {
    Ok(spec_of(&config::from_value(config)?))
}
