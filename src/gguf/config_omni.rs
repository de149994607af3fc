//! The config.json of Qwen2.5-Omni's llama.cpp files: the converter writes the thinker's text
//! model as a plain `qwen2vl` text file and its vision tower and audio tower together into one
//! `clip` projector of type `qwen2.5o` (`clip.vision.*` and `clip.audio.*`). The config is the
//! released checkpoint's layout (`qwen2_5_omni` with a `thinker_config`), so the family parses
//! and checks it as it does a hub checkpoint's. What the files do not record is what
//! transformers' `Qwen2_5OmniThinkerConfig` and every released Qwen2.5-Omni (3B, 7B) use: audio
//! windows of 2 · 100 mel frames (`n_window`), TMRoPE's 25 position ids a second in 2 s chunks,
//! and (as for Qwen2.5-VL) the vision window of 112 pixels.

use anyhow::{bail, Result};
use serde_json::{json, Map, Value};

use super::config::{dims, int, need, projector_type};
use super::file::GgufFile;
use super::names::Arch;
use super::tokenizer::token_id;

/// The projector type the converter gives Qwen2.5-Omni's vision + audio file.
pub const PROJECTOR: &str = "qwen2.5o";

/// transformers' and the released models' values for what GGUF does not record.
const N_WINDOW: usize = 100;
const POSITION_ID_PER_SECONDS: usize = 25;
const SECONDS_PER_CHUNK: usize = 2;

/// Whether `mm` is Qwen2.5-Omni's projector (vision and audio towers in one file).
pub fn is_omni(mm: &GgufFile) -> bool {
    projector_type(mm).is_ok_and(|p| p == PROJECTOR)
}

/// The config.json of a `qwen2vl` text file and its `qwen2.5o` projector.
pub fn config(text: &GgufFile, mm: &GgufFile) -> Result<Value> {
    let arch = text.architecture()?;
    if Arch::parse(&arch) != Some(Arch::Qwen2Vl) {
        bail!("{} is Qwen2.5-Omni's {PROJECTOR} projector, but {} is a {arch} model (it needs qwen2vl): the mmproj file belongs to another model", mm.name(), text.name());
    }
    let id = |tok: &str| -> Result<u32> {
        token_id(text, tok).map_err(|e| anyhow::anyhow!("{e}: a {PROJECTOR} projector ({}) needs Qwen2.5-Omni's text model, whose vocabulary has it", mm.name()))
    };
    let mut t = super::config::text_config(text, Arch::Qwen2Vl, &arch)?;
    let hidden = t["hidden_size"].as_u64().unwrap_or(0) as usize;
    if let Some(eos) = text.meta("tokenizer.ggml.eos_token_id").and_then(|v| v.to_u32().ok()) {
        t.insert("eos_token_id".into(), json!(eos));
    }
    let mut v = super::config::vision_config(mm, "qwen2_5_vl", hidden)?;
    v.insert("tokens_per_second".into(), json!(POSITION_ID_PER_SECONDS));
    let thinker = json!({
        "model_type": "qwen2_5_omni_thinker",
        "text_config": Value::Object(t),
        "vision_config": Value::Object(v),
        "audio_config": Value::Object(audio_config(mm, hidden)?),
        "audio_token_index": id("<|AUDIO|>")?,
        "audio_start_token_id": id("<|audio_bos|>")?,
        "audio_end_token_id": id("<|audio_eos|>")?,
        "image_token_index": id("<|IMAGE|>")?,
        "video_token_index": id("<|VIDEO|>")?,
        "vision_start_token_id": id("<|vision_bos|>")?,
        "vision_end_token_id": id("<|vision_eos|>")?,
        "position_id_per_seconds": POSITION_ID_PER_SECONDS,
        "seconds_per_chunk": SECONDS_PER_CHUNK,
    });
    Ok(json!({"model_type": "qwen2_5_omni", "thinker_config": thinker}))
}

/// `thinker_config.audio_config` from `clip.audio.*` and the tensors: the position table's
/// rows are `max_source_positions`, the projection's width must be the text model's.
fn audio_config(mm: &GgufFile, text_hidden: usize) -> Result<Map<String, Value>> {
    let k = |s: &str| format!("clip.audio.{s}");
    if mm.meta("clip.has_audio_encoder").and_then(|b| b.to_bool().ok()) != Some(true) {
        bail!("{}: clip.has_audio_encoder is not true: a {PROJECTOR} projector without its audio tower", mm.name());
    }
    let out = dims(mm, "mm.a.fc.weight")?[0];
    if out != text_hidden {
        bail!("{}: the audio projection's output width {out} differs from the text model's hidden size {text_hidden}: the mmproj file belongs to another model", mm.name());
    }
    let eps = need(mm, &k("attention.layer_norm_epsilon"))?;
    // The tower's LayerNorms are torch's default; a file saying otherwise is another model.
    if (eps - 1e-5).abs() > 1e-9 {
        bail!("{}: metadata {} = {eps}; Qwen2.5-Omni's audio tower uses 1e-5", mm.name(), k("attention.layer_norm_epsilon"));
    }
    let positions = match mm.info("a.position_embd.weight") {
        Some(_) => dims(mm, "a.position_embd.weight")?[0],
        None => 1500,
    };
    let mut c = Map::new();
    c.insert("num_mel_bins".into(), json!(int(mm, &k("num_mel_bins"))?));
    c.insert("d_model".into(), json!(int(mm, &k("embedding_length"))?));
    c.insert("encoder_layers".into(), json!(int(mm, &k("block_count"))?));
    c.insert("encoder_attention_heads".into(), json!(int(mm, &k("attention.head_count"))?));
    c.insert("encoder_ffn_dim".into(), json!(int(mm, &k("feed_forward_length"))?));
    c.insert("output_dim".into(), json!(out));
    c.insert("max_source_positions".into(), json!(positions));
    c.insert("n_window".into(), json!(N_WINDOW));
    c.insert("activation_function".into(), json!("gelu"));
    Ok(c)
}
