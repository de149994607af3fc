//! The config.json of llama.cpp's `gemma3` and `llama` (LLaVA-NeXT) text files with their `clip`
//! projectors. Where the files are silent, the config says what llama.cpp computes from them,
//! so that merg runs the model llama.cpp runs: Gemma 3's local/global pattern (every sixth layer
//! global unless `gemma3.attention.sliding_window_pattern` says otherwise) and its query scale
//! (1/√head_dim, 1/√(hidden/heads) for the 62-layer 27B) are not recorded by the converter;
//! LLaVA's legacy projector converter cuts the tower after the feature layer, so the config's
//! tower is that many layers and its last output is the feature.

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Value as Meta;
use serde_json::{json, Map, Value};

use super::config::{dims, int, need, num, projector_type};
use super::file::GgufFile;
use super::names::Arch;
use super::tokenizer::token_id;

/// The config.json of a `gemma3` or `llama` text file and its projector.
pub fn config(text: &GgufFile, mm: &GgufFile, arch: Arch) -> Result<Value> {
    let projector = projector_type(mm)?;
    let want = if arch == Arch::Gemma3 { "gemma3" } else { "mlp" };
    if projector != want {
        bail!(
            "{} is a {projector} vision projector, but {} is a {} model (it needs a {want} projector): the mmproj file belongs to another model",
            mm.name(),
            text.name(),
            text.architecture()?
        );
    }
    let mut c = match arch {
        Arch::Gemma3 => gemma3(text, mm)?,
        _ => llava_next(text, mm)?,
    };
    let hidden = c["text_config"]["hidden_size"].as_u64().unwrap_or(0) as usize;
    let out = match arch {
        Arch::Gemma3 => dims(mm, "mm.input_projection.weight")?[1],
        _ => dims(mm, "mm.2.weight")?[0],
    };
    if out != hidden {
        bail!("{}: the projector's output width {out} differs from the text model's hidden size {hidden}: the mmproj file belongs to another model", mm.name());
    }
    c["tie_word_embeddings"] = json!(text.info("output.weight").is_none());
    Ok(c)
}

/// The text fields both decoders share.
fn text_common(f: &GgufFile, a: &str) -> Result<Map<String, Value>> {
    let hidden = int(f, &format!("{a}.embedding_length"))?;
    let heads = int(f, &format!("{a}.attention.head_count"))?;
    let mut c = Map::new();
    c.insert("hidden_size".into(), json!(hidden));
    c.insert("intermediate_size".into(), json!(int(f, &format!("{a}.feed_forward_length"))?));
    c.insert("num_hidden_layers".into(), json!(int(f, &format!("{a}.block_count"))?));
    c.insert("num_attention_heads".into(), json!(heads));
    c.insert("num_key_value_heads".into(), json!(num(f, &format!("{a}.attention.head_count_kv"))?.map_or(heads, |n| n as usize)));
    c.insert("head_dim".into(), json!(num(f, &format!("{a}.attention.key_length"))?.map_or(hidden / heads.max(1), |n| n as usize)));
    c.insert("rms_norm_eps".into(), json!(need(f, &format!("{a}.attention.layer_norm_rms_epsilon"))?));
    c.insert("rope_theta".into(), json!(need(f, &format!("{a}.rope.freq_base"))?));
    c.insert("vocab_size".into(), json!(dims(f, "token_embd.weight")?[0]));
    // Gemma 3 reads the tie from text_config, LLaVA-NeXT from the top (set in `config`).
    c.insert("tie_word_embeddings".into(), json!(f.info("output.weight").is_none()));
    if let Some(n) = num(f, &format!("{a}.context_length"))? {
        c.insert("max_position_embeddings".into(), json!(n as usize));
    }
    if let Some(eos) = f.meta("tokenizer.ggml.eos_token_id").and_then(|v| v.to_u32().ok()) {
        c.insert("eos_token_id".into(), json!(eos));
    }
    Ok(c)
}

/// `{a}.rope.scaling.*` as transformers' `rope_scaling` (none, or linear).
fn rope_scaling(f: &GgufFile, a: &str) -> Result<Option<Value>> {
    let key = format!("{a}.rope.scaling.type");
    let Some(kind) = f.meta(&key) else { return Ok(None) };
    let kind = kind.to_string().map_err(|_| anyhow::anyhow!("{}: metadata {key} is not a string", f.name()))?;
    match kind.as_str() {
        "none" => Ok(None),
        "linear" => Ok(Some(json!({"rope_type": "linear", "factor": need(f, &format!("{a}.rope.scaling.factor"))?}))),
        other => bail!("{}: metadata {key} is {other:?}; merg reads linear rope scaling only for these models", f.name()),
    }
}

/// Which layers are local, as llama.cpp's `load_swa_pattern` reads them: a per-layer array or a
/// period (every `n`-th layer global, 6 when absent).
fn sliding_layers(f: &GgufFile, a: &str, layers: usize) -> Result<Vec<bool>> {
    let key = format!("{a}.attention.sliding_window_pattern");
    match f.meta(&key) {
        Some(Meta::Array(v)) => {
            let flags: Vec<bool> = v.iter().map(|x| x.to_bool().map_err(|_| anyhow::anyhow!("{}: metadata {key} holds {x:?}, not booleans", f.name()))).collect::<Result<_>>()?;
            if flags.len() != layers {
                bail!("{}: metadata {key} has {} entries for {layers} layers", f.name(), flags.len());
            }
            Ok(flags)
        }
        _ => {
            let n = num(f, &key)?.map_or(6, |n| n as usize);
            Ok((0..layers).map(|i| n == 0 || i % n < n - 1).collect())
        }
    }
}

fn gemma3(text: &GgufFile, mm: &GgufFile) -> Result<Value> {
    let a = "gemma3";
    let mut t = text_common(text, a)?;
    let layers = t["num_hidden_layers"].as_u64().unwrap_or(0) as usize;
    let window = num(text, &format!("{a}.attention.sliding_window"))?.unwrap_or(0.) as usize;
    let sliding = match window {
        0 => vec![false; layers],
        _ => sliding_layers(text, a, layers)?,
    };
    let types: Vec<&str> = sliding.iter().map(|&s| if s { "sliding_attention" } else { "full_attention" }).collect();
    t.insert("layer_types".into(), json!(types));
    t.insert("sliding_window".into(), json!(window.max(1)));
    t.insert("rope_local_base_freq".into(), json!(num(text, &format!("{a}.rope.freq_base_swa"))?.unwrap_or(10_000.)));
    if let Some(s) = rope_scaling(text, a)? {
        t.insert("rope_scaling".into(), s);
    }
    if let Some(cap) = num(text, &format!("{a}.final_logit_softcapping"))? {
        t.insert("final_logit_softcapping".into(), json!(cap));
    }
    let (hidden, heads, head_dim) = (t["hidden_size"].as_u64().unwrap_or(0), t["num_attention_heads"].as_u64().unwrap_or(1).max(1), t["head_dim"].as_u64().unwrap_or(0));
    let scalar = if layers == 62 { hidden / heads } else { head_dim };
    t.insert("query_pre_attn_scalar".into(), json!(scalar));
    let v = vision_common(mm)?;
    let side = v["image_size"].as_u64().unwrap_or(0) / v["patch_size"].as_u64().unwrap_or(1).max(1);
    let pool = num(mm, "clip.vision.projector.scale_factor")?.map_or(4, |n| n as u64).max(1);
    let id = |tok: &str| token_id(text, tok);
    let mut eos = vec![];
    eos.extend(t.get("eos_token_id").and_then(Value::as_u64));
    // Gemma 3 ends a turn with <end_of_turn> (llama.cpp counts it as end of generation too).
    eos.extend(id("<end_of_turn>").ok().map(u64::from));
    t.insert("eos_token_id".into(), json!(eos));
    Ok(json!({
        "model_type": "gemma3",
        "mm_tokens_per_image": (side / pool).pow(2),
        "boi_token_index": id("<start_of_image>")?,
        "eoi_token_index": id("<end_of_image>")?,
        "image_token_index": id("<image_soft_token>")?,
        "text_config": Value::Object(t),
        "vision_config": Value::Object(v),
    }))
}

fn llava_next(text: &GgufFile, mm: &GgufFile) -> Result<Value> {
    let a = "llama";
    let mut t = text_common(text, a)?;
    t.insert("model_type".into(), json!("llama"));
    if let Some(s) = rope_scaling(text, a)? {
        t.insert("rope_scaling".into(), s);
    }
    let head_dim = t["head_dim"].as_u64().unwrap_or(0) as f64;
    if let Some(rot) = num(text, &format!("{a}.rope.dimension_count"))? {
        if rot != head_dim {
            bail!("{}: metadata {a}.rope.dimension_count = {rot} rotates part of a {head_dim}-wide head; merg's LLaMA decoder rotates whole heads", text.name());
        }
    }
    let merge = mm.meta("clip.vision.mm_patch_merge_type").and_then(|v| v.to_string().ok()).cloned().unwrap_or_else(|| "flat".into());
    let pins = super::config::ints(mm, "clip.vision.image_grid_pinpoints")?;
    let (Some(pins), "spatial_unpad") = (pins, merge.as_str()) else {
        bail!(
            "{}: a LLaVA-1.5 projector (clip.vision.image_grid_pinpoints absent or clip.vision.mm_patch_merge_type {merge:?}, not \"spatial_unpad\"); merg runs LLaVA-NeXT (any-resolution tiles)",
            mm.name()
        );
    };
    if pins.is_empty() || pins.len() % 2 != 0 {
        bail!("{}: clip.vision.image_grid_pinpoints holds {} numbers, not [height, width] pairs", mm.name(), pins.len());
    }
    let pinpoints: Vec<[usize; 2]> = pins.chunks(2).map(|p| [p[0], p[1]]).collect();
    let mut v = vision_common(mm)?;
    v.insert("model_type".into(), json!("clip_vision_model"));
    let gelu = mm.meta("clip.use_gelu").and_then(|b| b.to_bool().ok()).unwrap_or(false);
    v.insert("hidden_act".into(), json!(if gelu { "gelu" } else { "quick_gelu" }));
    let image = token_id(text, "<image>")?;
    Ok(json!({
        "model_type": "llava_next",
        "image_token_index": image,
        "image_grid_pinpoints": pinpoints,
        // The converter kept the tower up to the feature layer: its last output is the feature.
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
        "projector_hidden_act": "gelu",
        "multimodal_projector_bias": mm.info("mm.0.bias").is_some(),
        "use_image_newline_parameter": true,
        "vocab_size": t["vocab_size"].clone(),
        "text_config": Value::Object(t),
        "vision_config": Value::Object(v),
    }))
}

/// The tower's shape from `clip.vision.*` (SigLIP and CLIP alike).
fn vision_common(mm: &GgufFile) -> Result<Map<String, Value>> {
    let k = |s: &str| format!("clip.vision.{s}");
    let mut v = Map::new();
    v.insert("hidden_size".into(), json!(int(mm, &k("embedding_length"))?));
    v.insert("intermediate_size".into(), json!(int(mm, &k("feed_forward_length"))?));
    v.insert("num_hidden_layers".into(), json!(int(mm, &k("block_count"))?));
    v.insert("num_attention_heads".into(), json!(int(mm, &k("attention.head_count"))?));
    v.insert("image_size".into(), json!(int(mm, &k("image_size"))?));
    v.insert("patch_size".into(), json!(int(mm, &k("patch_size"))?));
    v.insert("layer_norm_eps".into(), json!(need(mm, &k("attention.layer_norm_epsilon")).context("the vision tower's LayerNorm epsilon")?));
    v.insert("num_channels".into(), json!(3));
    Ok(v)
}
