//! From a checkpoint's `model_type` to the family that loads it. Adding a family is one row
//! here plus its folder.

use std::sync::Arc;

use anyhow::{Context, Result};
use serde_json::Value;

use super::vlm::FamilyConfig;
use super::{Model, ModelSpec, ParamCounts};
use crate::weights::Weights;

/// One registered family: its `model_type` and its config reader.
struct Family {
    model_type: &'static str,
    parse: fn(&Value) -> Result<Box<dyn FamilyConfig>>,
}

const FAMILIES: &[Family] = &[
    Family { model_type: "qwen2_vl", parse: super::qwen2_vl::parse },
    Family { model_type: "qwen2_5_vl", parse: super::qwen2_vl::parse },
    Family { model_type: "qwen3_vl", parse: super::qwen3_vl::parse },
    Family { model_type: "qwen3_vl_moe", parse: super::qwen3_vl::parse },
    Family { model_type: "qwen3_5", parse: super::qwen3_5::parse },
    Family { model_type: "gemma3", parse: super::gemma3::parse },
    Family { model_type: "llava_next", parse: super::llava_next::parse },
    Family { model_type: "qwen2_5_omni", parse: super::qwen2_5_omni::parse },
    Family { model_type: "qwen2_5_omni_thinker", parse: super::qwen2_5_omni::parse },
];

pub fn supported_model_types() -> Vec<&'static str> {
    FAMILIES.iter().map(|f| f.model_type).collect()
}

fn family(config: &Value) -> Result<Box<dyn FamilyConfig>> {
    let t = model_type(config)?;
    let family = FAMILIES
        .iter()
        .find(|f| f.model_type == t)
        .with_context(|| format!("unknown model_type {t:?}: merg supports {}", supported_model_types().join(", ")))?;
    (family.parse)(config)
}

/// The `model_type` of a parsed config.json (top level, as transformers writes it).
pub fn model_type(config: &Value) -> Result<&str> {
    config.get("model_type").and_then(Value::as_str).context("config has no \"model_type\"")
}

/// Loads the model a config.json describes from `weights`.
pub fn load(config: &Value, weights: Weights) -> Result<Arc<dyn Model>> {
    // Freed load-time copies go back to the system (see `memory::Loading`).
    let _loading = crate::memory::Loading::begin();
    let family = family(config)?;
    // Quantizing while loading is most of a large model's load time: the task says so.
    let task = crate::progress::task(&format!("loading {}", weights.describe()), weights.tensor_count().map(|n| n as u64), "tensors");
    let model = family.build(weights.clone().tracked(task))?;
    weights.release_mappings();
    // Weights used from the file get their packed copies from here on (`cpu::repack`).
    crate::cpu::repack::start();
    Ok(Arc::new(model))
}

/// What the engine would see of the model, from its config alone.
pub fn spec(config: &Value) -> Result<ModelSpec> {
    Ok(family(config)?.spec())
}

/// Parameter counts from a config alone (no weights read).
pub fn param_counts(config: &Value) -> Result<ParamCounts> {
    Ok(family(config)?.param_counts())
}

/// What the family says about how it reads the checkpoint (e.g. parts it does not load).
pub fn notes(config: &Value) -> Result<Vec<String>> {
    Ok(family(config)?.notes())
}

/// Reads and parses a config.json file.
pub fn read_config(path: &std::path::Path) -> Result<Value> {
    let text = crate::input::read_string(path, &crate::input::CONFIG).context("cannot read the model config")?;
    serde_json::from_str(&text).with_context(|| format!("invalid model config {}: not valid JSON", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    #[test]
    fn unknown_model_type_lists_the_supported_ones() {
        let cfg = serde_json::json!({"model_type": "llava"});
        let e = format!("{:#}", load(&cfg, Weights::dummy(DType::F32, &Device::Cpu)).err().unwrap());
        assert!(e.contains("\"llava\"") && e.contains("qwen2_vl") && e.contains("qwen2_5_vl"), "{e}");
    }
}
