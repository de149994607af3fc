//! A tokenizer.json rebuilt from a GGUF file's `tokenizer.ggml.*` metadata, for GGUF files
//! that come without the HF tokenizer. Two kinds:
//! - `gpt2` (Qwen): llama.cpp's converter records the byte-level BPE's vocabulary, merges,
//!   token types and the pre-tokenizer's name; the pipeline around the BPE (NFC, the split
//!   regex, byte-level mapping) is the one the named Qwen tokenizer.json has. Unknown
//!   pre-tokenizer names are refused: a wrong split regex would tokenize silently wrong.
//! - `llama` (SentencePiece BPE: Gemma 3, LLaMA): pieces, scores and token types, no merges.
//!   The merges are rebuilt from the scores as transformers' `SpmConverter` builds them from
//!   the tokenizer.model (`spm` below), with byte fallback, spaces as U+2581 and a word-start
//!   mark at the start of the text unless `tokenizer.ggml.add_space_prefix` is false.

use anyhow::{bail, Context, Result};
use candle_core::quantized::gguf_file::Value as Meta;
use serde_json::{json, Value};

use super::file::GgufFile;

/// The split regexes of the Qwen tokenizer.json files, by llama.cpp's pre-tokenizer name.
fn split_regex(pre: &str) -> Option<&'static str> {
    Some(match pre {
        "qwen2" => r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        "qwen35" => r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
        _ => return None,
    })
}

pub(crate) fn strings<'a>(f: &'a GgufFile, key: &str) -> Result<Vec<&'a str>> {
    let Some(Meta::Array(v)) = f.meta(key) else { bail!("{}: metadata {key} is missing or not an array", f.name()) };
    v.iter()
        .map(|x| match x {
            Meta::String(s) => Ok(s.as_str()),
            other => bail!("{}: metadata {key} holds {other:?}, not strings", f.name()),
        })
        .collect()
}

/// llama.cpp's token types: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte.
pub(crate) fn token_types(f: &GgufFile, n: usize) -> Result<Vec<i64>> {
    let Some(Meta::Array(v)) = f.meta("tokenizer.ggml.token_type") else { return Ok(vec![1; n]) };
    if v.len() != n {
        bail!("{}: tokenizer.ggml.token_type has {} entries for {n} tokens", f.name(), v.len());
    }
    v.iter()
        .map(|x| match x {
            Meta::I32(t) => Ok(*t as i64),
            Meta::U32(t) => Ok(*t as i64),
            other => bail!("{}: tokenizer.ggml.token_type holds {other:?}", f.name()),
        })
        .collect()
}

/// The tokenizer.json text of a GGUF file's embedded tokenizer.
pub fn tokenizer_json(f: &GgufFile) -> Result<String> {
    let model = f.meta("tokenizer.ggml.model").and_then(|v| v.to_string().ok()).cloned().unwrap_or_default();
    match model.as_str() {
        "gpt2" => {}
        "llama" => return super::tokenizer_spm::tokenizer_json(f),
        _ => bail!(
            "{}: tokenizer.ggml.model is {model:?}; merg rebuilds byte-level BPE (\"gpt2\") and SentencePiece (\"llama\") tokenizers — put the model's tokenizer.json beside the file",
            f.name()
        ),
    }
    let pre = f.meta("tokenizer.ggml.pre").and_then(|v| v.to_string().ok()).cloned().unwrap_or_default();
    let Some(regex) = split_regex(&pre) else {
        bail!("{}: tokenizer.ggml.pre {pre:?} is not a pre-tokenizer merg knows (qwen2, qwen35) — put the model's tokenizer.json beside the file", f.name());
    };
    let tokens = strings(f, "tokenizer.ggml.tokens")?;
    let merges = strings(f, "tokenizer.ggml.merges")?;
    let types = token_types(f, tokens.len())?;
    let mut vocab = serde_json::Map::new();
    let mut added = vec![];
    for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        // Control tokens were special in the HF tokenizer; user-defined ones were added but
        // not special (llama.cpp's converter sorts them so). Every token, added or not, is in
        // the model's vocabulary too, so each keeps its id (tokenizers would otherwise number
        // added tokens after the vocabulary, and the converter's [PAD] fillers sit there).
        if ty == 3 || ty == 4 {
            added.push(json!({"id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": ty == 3}));
        }
        // Unused ids (type 5) are the converter's [PAD] fillers up to the embedding's rows; the
        // HF tokenizer has no token there, so decoding them yields nothing, as it did.
        if ty != 5 && vocab.insert(tok.to_string(), json!(id)).is_some() {
            bail!("{}: token {tok:?} appears twice in tokenizer.ggml.tokens", f.name());
        }
    }
    let merges: Vec<Value> = merges
        .iter()
        .map(|m| m.split_once(' ').map(|(a, b)| json!([a, b])).with_context(|| format!("{}: merge {m:?} is not two tokens", f.name())))
        .collect::<Result<_>>()?;
    let byte_level = |prefix: bool, trim: bool, regex: bool| json!({"type": "ByteLevel", "add_prefix_space": prefix, "trim_offsets": trim, "use_regex": regex});
    let t = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": false},
            byte_level(false, true, false),
        ]},
        "post_processor": byte_level(false, false, false),
        "decoder": byte_level(true, true, true),
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": "", "end_of_word_suffix": "",
                  "fuse_unk": false, "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": merges},
    });
    Ok(t.to_string())
}

/// The chat template the file carries (`tokenizer.chat_template`).
pub fn chat_template(f: &GgufFile) -> Option<String> {
    f.meta("tokenizer.chat_template").and_then(|v| v.to_string().ok()).cloned()
}

/// The id of `token` in the file's vocabulary.
pub fn token_id(f: &GgufFile, token: &str) -> Result<u32> {
    let tokens = strings(f, "tokenizer.ggml.tokens")?;
    tokens.iter().position(|&t| t == token).map(|i| i as u32).with_context(|| format!("{}: the vocabulary has no {token}", f.name()))
}
