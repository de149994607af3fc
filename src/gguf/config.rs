//! A transformers-style config.json built from GGUF metadata (the text file's `{arch}.*` keys
//! and the projector's `clip.*` keys), so the families parse and check it exactly as they do a
//! hub checkpoint's. What GGUF does not record (the temporal patch size, which the converter's
//! Conv3d split fixes at 2; Qwen2-VL's MLP width, which its converter overwrites) is read from
//! tensor shapes.

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Value as Meta;
use serde_json::{json, Map, Value};

use super::file::GgufFile;
use super::names::Arch;

pub(crate) fn num(f: &GgufFile, key: &str) -> Result<Option<f64>> {
    let Some(v) = f.meta(key) else { return Ok(None) };
    Ok(Some(match v {
        Meta::U8(x) => *x as f64,
        Meta::I8(x) => *x as f64,
        Meta::U16(x) => *x as f64,
        Meta::I16(x) => *x as f64,
        Meta::U32(x) => *x as f64,
        Meta::I32(x) => *x as f64,
        Meta::U64(x) => *x as f64,
        Meta::I64(x) => *x as f64,
        // The shortest decimal that rounds to the f32 (1e-6, not 9.99999997e-7), as the
        // converter read it from config.json.
        Meta::F32(x) => x.to_string().parse().unwrap_or(*x as f64),
        Meta::F64(x) => *x,
        other => bail!("{}: metadata {key} should be a number, is {other:?}", f.name()),
    }))
}

pub(crate) fn need(f: &GgufFile, key: &str) -> Result<f64> {
    num(f, key)?.with_context(|| format!("{}: metadata {key} is missing", f.name()))
}

pub(crate) fn int(f: &GgufFile, key: &str) -> Result<usize> {
    let x = need(f, key)?;
    if x < 0. || x.fract() != 0. || x > 1e12 {
        bail!("{}: metadata {key} = {x} is not a count", f.name());
    }
    Ok(x as usize)
}

fn array<'a>(f: &'a GgufFile, key: &str) -> Result<Option<&'a Vec<Meta>>> {
    match f.meta(key) {
        None => Ok(None),
        Some(Meta::Array(v)) => Ok(Some(v)),
        Some(other) => bail!("{}: metadata {key} should be an array, is {other:?}", f.name()),
    }
}

pub(crate) fn ints(f: &GgufFile, key: &str) -> Result<Option<Vec<usize>>> {
    let Some(v) = array(f, key)? else { return Ok(None) };
    v.iter()
        .map(|x| match x {
            Meta::U32(n) => Ok(*n as usize),
            Meta::I32(n) if *n >= 0 => Ok(*n as usize),
            Meta::U64(n) => Ok(*n as usize),
            other => bail!("{}: metadata {key} holds {other:?}, not counts", f.name()),
        })
        .collect::<Result<_>>()
        .map(Some)
}

fn bools(f: &GgufFile, key: &str) -> Result<Option<Vec<bool>>> {
    let Some(v) = array(f, key)? else { return Ok(None) };
    v.iter()
        .map(|x| match x {
            Meta::Bool(b) => Ok(*b),
            other => bail!("{}: metadata {key} holds {other:?}, not booleans", f.name()),
        })
        .collect::<Result<_>>()
        .map(Some)
}

pub(crate) fn dims(f: &GgufFile, tensor: &str) -> Result<Vec<usize>> {
    Ok(f.info(tensor).with_context(|| format!("{}: tensor {tensor} is missing", f.name()))?.dims.clone())
}

/// Special token ids the config carries, looked up in the vocabulary.
pub struct TokenIds {
    pub image: u32,
    pub video: u32,
    pub vision_start: u32,
    pub vision_end: u32,
    pub eos: Option<u32>,
}

/// The projector's kind, from `clip.projector_type` (or `clip.vision.projector_type`).
pub fn projector_type(mm: &GgufFile) -> Result<String> {
    let v = mm.meta("clip.projector_type").or_else(|| mm.meta("clip.vision.projector_type"));
    let v = v.with_context(|| format!("{}: no clip.projector_type: not a vision projector (mmproj) file", mm.name()))?;
    Ok(v.to_string().map_err(|_| anyhow::anyhow!("{}: clip.projector_type is not a string", mm.name()))?.clone())
}

/// transformers' `model_type` for a text architecture and its projector.
fn model_type(arch: Arch, projector: &str, text: &GgufFile, mm: &GgufFile) -> Result<&'static str> {
    let want = match arch {
        Arch::Qwen2Vl => &["qwen2vl_merger", "qwen2.5vl_merger"][..],
        _ => &["qwen3vl_merger"][..],
    };
    if !want.contains(&projector) {
        bail!(
            "{} is a {projector} vision projector, but {} is a {} model (it needs {}): the mmproj file belongs to another model",
            mm.name(),
            text.name(),
            text.architecture()?,
            want.join(" or ")
        );
    }
    Ok(match (arch, projector) {
        (Arch::Qwen2Vl, "qwen2vl_merger") => "qwen2_vl",
        (Arch::Qwen2Vl, _) => "qwen2_5_vl",
        (Arch::Qwen3Vl, _) => "qwen3_vl",
        (Arch::Qwen3VlMoe, _) => "qwen3_vl_moe",
        (Arch::Qwen35, _) => "qwen3_5",
        (Arch::Gemma3 | Arch::Llama, _) => bail!("{}: not a Qwen model (config_gemma_llava reads it)", text.name()),
    })
}

/// The text part of the config.
pub(crate) fn text_config(f: &GgufFile, arch: Arch, a: &str) -> Result<Map<String, Value>> {
    let heads = int(f, &format!("{a}.attention.head_count"))?;
    let hidden = int(f, &format!("{a}.embedding_length"))?;
    // block_count includes the multi-token-prediction layers (Qwen3.5), which merg does not run.
    let mtp = num(f, &format!("{a}.nextn_predict_layers"))?.unwrap_or(0.) as usize;
    let layers = int(f, &format!("{a}.block_count"))?.checked_sub(mtp).with_context(|| format!("{}: more MTP layers than blocks", f.name()))?;
    let vocab = dims(f, "token_embd.weight")?[0];
    let mut c = Map::new();
    c.insert("hidden_size".into(), json!(hidden));
    c.insert("num_hidden_layers".into(), json!(layers));
    c.insert("num_attention_heads".into(), json!(heads));
    c.insert("num_key_value_heads".into(), json!(int(f, &format!("{a}.attention.head_count_kv"))?));
    c.insert("intermediate_size".into(), json!(num(f, &format!("{a}.feed_forward_length"))?.unwrap_or(0.) as usize));
    c.insert("rms_norm_eps".into(), json!(need(f, &format!("{a}.attention.layer_norm_rms_epsilon"))?));
    c.insert("vocab_size".into(), json!(vocab));
    c.insert("tie_word_embeddings".into(), json!(f.info("output.weight").is_none()));
    if let Some(n) = num(f, &format!("{a}.context_length"))? {
        c.insert("max_position_embeddings".into(), json!(n as usize));
    }
    if let Some(d) = num(f, &format!("{a}.attention.key_length"))? {
        c.insert("head_dim".into(), json!(d as usize));
    }
    let theta = need(f, &format!("{a}.rope.freq_base"))?;
    let sections = ints(f, &format!("{a}.rope.dimension_sections"))?.with_context(|| format!("{}: metadata {a}.rope.dimension_sections is missing", f.name()))?;
    // llama.cpp keeps four sections (the fourth is zero for these models); transformers three.
    let mrope: Vec<usize> = sections.into_iter().take(3).collect();
    match arch {
        Arch::Qwen2Vl => {
            c.insert("rope_theta".into(), json!(theta));
            c.insert("rope_scaling".into(), json!({"type": "mrope", "mrope_section": mrope}));
        }
        Arch::Qwen3Vl | Arch::Qwen3VlMoe => {
            c.insert("rope_theta".into(), json!(theta));
            c.insert("rope_scaling".into(), json!({"rope_type": "default", "mrope_section": mrope, "mrope_interleaved": true}));
        }
        Arch::Gemma3 | Arch::Llama => bail!("{}: not a Qwen model (config_gemma_llava reads it)", f.name()),
        Arch::Qwen35 => {
            let head_dim = c.get("head_dim").and_then(Value::as_u64).unwrap_or((hidden / heads.max(1)) as u64) as f64;
            let rotary = need(f, &format!("{a}.rope.dimension_count"))?;
            c.insert(
                "rope_parameters".into(),
                json!({"rope_type": "default", "rope_theta": theta, "mrope_section": mrope, "mrope_interleaved": true, "partial_rotary_factor": rotary / head_dim}),
            );
        }
    }
    if arch == Arch::Qwen3VlMoe {
        c.insert("num_experts".into(), json!(int(f, &format!("{a}.expert_count"))?));
        c.insert("num_experts_per_tok".into(), json!(int(f, &format!("{a}.expert_used_count"))?));
        c.insert("moe_intermediate_size".into(), json!(int(f, &format!("{a}.expert_feed_forward_length"))?));
    }
    if arch == Arch::Qwen35 {
        let value_heads = int(f, &format!("{a}.ssm.time_step_rank"))?;
        c.insert("linear_conv_kernel_dim".into(), json!(int(f, &format!("{a}.ssm.conv_kernel"))?));
        c.insert("linear_key_head_dim".into(), json!(int(f, &format!("{a}.ssm.state_size"))?));
        c.insert("linear_num_key_heads".into(), json!(int(f, &format!("{a}.ssm.group_count"))?));
        c.insert("linear_num_value_heads".into(), json!(value_heads));
        c.insert("linear_value_head_dim".into(), json!(int(f, &format!("{a}.ssm.inner_size"))? / value_heads.max(1)));
        let recurrent = match bools(f, &format!("{a}.attention.recurrent_layers"))? {
            Some(r) => r,
            None => {
                let every = int(f, &format!("{a}.full_attention_interval"))?.max(1);
                (0..layers).map(|i| (i + 1) % every != 0).collect()
            }
        };
        let types: Vec<&str> = recurrent.iter().take(layers).map(|&r| if r { "linear_attention" } else { "full_attention" }).collect();
        c.insert("layer_types".into(), json!(types));
        // Gated attention: q_proj holds the query and its gate.
        c.insert("attn_output_gate".into(), json!(true));
    }
    Ok(c)
}

/// The vision part of the config, from the projector file.
pub(crate) fn vision_config(mm: &GgufFile, model_type: &str, text_hidden: usize) -> Result<Map<String, Value>> {
    let k = |s: &str| format!("clip.vision.{s}");
    let width = int(mm, &k("embedding_length"))?;
    let depth = int(mm, &k("block_count"))?;
    let patch = dims(mm, "v.patch_embd.weight")?;
    let out = dims(mm, "mm.2.weight")?[0];
    if out != text_hidden {
        bail!("{}: the projector's output width {out} differs from the text model's hidden size {text_hidden}: the mmproj file belongs to another model", mm.name());
    }
    let mut c = Map::new();
    c.insert("depth".into(), json!(depth));
    c.insert("num_heads".into(), json!(int(mm, &k("attention.head_count"))?));
    c.insert("patch_size".into(), json!(patch.last().copied().unwrap_or(0)));
    c.insert("temporal_patch_size".into(), json!(2));
    c.insert("spatial_merge_size".into(), json!(num(mm, &k("spatial_merge_size"))?.unwrap_or(2.) as usize));
    let mlp = dims(mm, "v.blk.0.ffn_up.weight")?[0];
    match model_type {
        "qwen2_vl" => {
            c.insert("embed_dim".into(), json!(width));
            c.insert("hidden_size".into(), json!(text_hidden));
            c.insert("mlp_ratio".into(), json!(mlp as f64 / width as f64));
            c.insert("in_chans".into(), json!(3));
        }
        _ => {
            c.insert("hidden_size".into(), json!(width));
            c.insert("out_hidden_size".into(), json!(out));
            c.insert("intermediate_size".into(), json!(mlp));
            c.insert("in_channels".into(), json!(3));
        }
    }
    if model_type == "qwen2_5_vl" {
        let every = int(mm, &k("n_wa_pattern"))?.max(1);
        let full: Vec<usize> = (0..depth).filter(|i| (i + 1) % every == 0).collect();
        c.insert("fullatt_block_indexes".into(), json!(full));
        // Newer converters record it; older ones do not, and every released Qwen2.5-VL uses
        // 112 (as llama.cpp assumes).
        c.insert("window_size".into(), json!(num(mm, &k("window_size"))?.unwrap_or(112.) as usize));
        c.insert("hidden_act".into(), json!("silu"));
    }
    if model_type.starts_with("qwen3") {
        let deep = bools(mm, &k("is_deepstack_layers"))?.unwrap_or_default();
        let idx: Vec<usize> = deep.iter().enumerate().filter(|(_, &d)| d).map(|(i, _)| i).collect();
        c.insert("deepstack_visual_indexes".into(), json!(idx));
        c.insert("num_position_embeddings".into(), json!(dims(mm, "v.position_embd.weight")?[0]));
        c.insert("hidden_act".into(), json!("gelu_pytorch_tanh"));
    }
    Ok(c)
}

/// The config.json of a GGUF text file and its projector.
pub fn config(text: &GgufFile, mm: &GgufFile, arch: Arch, ids: &TokenIds) -> Result<Value> {
    let a = text.architecture()?;
    let projector = projector_type(mm)?;
    let model_type = model_type(arch, &projector, text, mm)?;
    let mut tc = text_config(text, arch, &a)?;
    let hidden = tc["hidden_size"].as_u64().unwrap_or(0) as usize;
    let vc = vision_config(mm, model_type, hidden)?;
    if model_type.starts_with("qwen3") {
        let deep = vc["deepstack_visual_indexes"].as_array().map_or(0, Vec::len);
        if let Some(n) = num(text, &format!("{a}.n_deepstack_layers"))? {
            if n as usize != deep {
                bail!("{} feeds {deep} DeepStack levels but {} expects {n}: the mmproj file belongs to another model", mm.name(), text.name());
            }
        }
    }
    if let Some(eos) = ids.eos {
        tc.insert("eos_token_id".into(), json!(eos));
    }
    let mut c = Map::new();
    c.insert("model_type".into(), json!(model_type));
    c.insert("image_token_id".into(), json!(ids.image));
    c.insert("video_token_id".into(), json!(ids.video));
    c.insert("vision_start_token_id".into(), json!(ids.vision_start));
    c.insert("vision_end_token_id".into(), json!(ids.vision_end));
    c.insert("vision_config".into(), Value::Object(vc));
    if model_type.starts_with("qwen2") {
        // Qwen2-VL configs keep the text fields at the top level.
        c.extend(tc);
    } else {
        c.insert("tie_word_embeddings".into(), tc["tie_word_embeddings"].clone());
        c.insert("text_config".into(), Value::Object(tc));
    }
    Ok(Value::Object(c))
}
