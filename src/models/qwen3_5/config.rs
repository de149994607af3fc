//! Qwen3.5's `config.json`: Qwen3-VL's layout (parsed by `qwen3_vl::Config::parse`) plus the
//! hybrid decoder's fields — `layer_types` (or `full_attention_interval`), the linear
//! attention's heads, widths and conv kernel — with transformers 5's defaults.

use anyhow::{bail, Result};
use serde::Deserialize;
use serde_json::{Map, Value};

use crate::layers::delta_net::DeltaNetShape;
use crate::layers::delta_rule::Dims;
use crate::models::decoder::DecoderConfig;
use crate::models::qwen3_vl::Config;

#[derive(Deserialize)]
struct Hybrid {
    #[serde(default)]
    layer_types: Option<Vec<String>>,
    #[serde(default = "four")]
    full_attention_interval: usize,
    #[serde(default = "four")]
    linear_conv_kernel_dim: usize,
    #[serde(default = "d128")]
    linear_key_head_dim: usize,
    #[serde(default = "d128")]
    linear_value_head_dim: usize,
    #[serde(default = "sixteen")]
    linear_num_key_heads: usize,
    #[serde(default = "thirty_two")]
    linear_num_value_heads: usize,
}

fn four() -> usize {
    4
}
fn d128() -> usize {
    128
}
fn sixteen() -> usize {
    16
}
fn thirty_two() -> usize {
    32
}

pub fn from_value(root: &Value) -> Result<Config> {
    let mut root = root.clone();
    // transformers 5 defaults the partial rotary factor to 0.25 for this family.
    if let Some(Value::Object(t)) = root.get_mut("text_config") {
        let in_rope = ["rope_parameters", "rope_scaling"].iter().any(|k| t.get(*k).and_then(|r| r.get("partial_rotary_factor")).is_some());
        if !in_rope {
            t.entry("partial_rotary_factor").or_insert(0.25.into());
        }
    }
    Config::parse(&root, &["qwen3_5"], hybrid_decoder)
}

fn hybrid_decoder(cfg: &Config, text: &Map<String, Value>) -> Result<DecoderConfig> {
    let h: Hybrid = serde_path_to_error::deserialize(Value::Object(text.clone()))
        .map_err(|e| anyhow::anyhow!("text_config field {}: {}", e.path(), e.inner()))?;
    let n = cfg.text.num_hidden_layers;
    let types = match h.layer_types {
        Some(t) => t,
        None if h.full_attention_interval == 0 => bail!("text_config.full_attention_interval must be at least 1"),
        None => (0..n).map(|i| if (i + 1) % h.full_attention_interval == 0 { "full_attention" } else { "linear_attention" }.to_string()).collect(),
    };
    if types.len() != n {
        bail!("text_config.layer_types has {} entries for {n} layers", types.len());
    }
    let linear = types
        .iter()
        .map(|t| match t.as_str() {
            "linear_attention" => Ok(true),
            "full_attention" => Ok(false),
            other => bail!("text_config.layer_types has {other:?}; expected linear_attention or full_attention"),
        })
        .collect::<Result<Vec<bool>>>()?;
    let dims = Dims { k_heads: h.linear_num_key_heads, v_heads: h.linear_num_value_heads, dk: h.linear_key_head_dim, dv: h.linear_value_head_dim };
    if dims.k_heads == 0 || dims.dk == 0 || dims.dv == 0 || !dims.v_heads.is_multiple_of(dims.k_heads) {
        bail!("text_config.linear_num_value_heads {} must be a positive multiple of linear_num_key_heads {}", dims.v_heads, dims.k_heads);
    }
    if h.linear_conv_kernel_dim < 2 {
        bail!("text_config.linear_conv_kernel_dim {} must be at least 2", h.linear_conv_kernel_dim);
    }
    let mut d = cfg.qwen3_decoder();
    d.norm_offset = true;
    d.attention.qk_norm_offset = true;
    d.attention.output_gate = true;
    d.linear = Some((DeltaNetShape { hidden: cfg.text.hidden_size, dims, conv_kernel: h.linear_conv_kernel_dim }, linear));
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::LayerKind;

    fn tiny() -> Value {
        serde_json::json!({
            "model_type": "qwen3_5", "image_token_id": 500, "video_token_id": 501,
            "vision_start_token_id": 497, "vision_end_token_id": 498,
            "text_config": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 8,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "layer_types": null,
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "mrope_section": [2, 1, 1], "mrope_interleaved": true}},
            "vision_config": {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "num_heads": 4,
                "out_hidden_size": 64, "num_position_embeddings": 64}
        })
    }

    #[test]
    fn every_fourth_layer_attends_by_default() {
        let c = from_value(&tiny()).unwrap();
        assert_eq!(c.decoder.rotary_dim, 8);
        let kinds = c.decoder.layer_kinds();
        let attn: Vec<usize> = kinds.iter().enumerate().filter(|(_, k)| **k == LayerKind::Attention).map(|(i, _)| i).collect();
        assert_eq!(attn, vec![3, 7]);
        assert_eq!(kinds[0], LayerKind::Recurrent { conv_shape: vec![3, 2 * 32 + 64], state_shape: vec![4, 16, 16] });
    }

    #[test]
    fn bad_hybrid_fields_are_named() {
        for (path, val, want) in [
            ("/text_config/layer_types", serde_json::json!(["linear_attention"]), "layer_types has 1 entries for 8 layers"),
            ("/text_config/linear_num_value_heads", serde_json::json!(3), "linear_num_value_heads 3"),
            ("/text_config/rope_parameters/mrope_section", serde_json::json!([2, 2, 2]), "mrope_section"),
        ] {
            let mut v = tiny();
            *v.pointer_mut(path).unwrap() = val;
            let e = format!("{:#}", from_value(&v).unwrap_err());
            assert!(e.contains(want), "{path}: {e}");
        }
    }
}
