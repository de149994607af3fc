//! SentencePiece BPE vocabularies (`tokenizer.ggml.model` = "llama": Gemma 3, LLaMA) as a
//! tokenizer.json, built the way transformers' `SpmConverter` builds one from the
//! tokenizer.model the converter read: the pieces keep their ids, byte pieces (`<0xNN>`) serve
//! byte fallback, and the merges come from the scores (`generate_merges`: every split of a
//! piece into two pieces, best-scored piece first). llama.cpp's own SentencePiece tokenizer
//! merges by the same scores.

use std::collections::HashMap;

use anyhow::{bail, Result};
use candle_core::quantized::gguf_file::Value as Meta;
use serde_json::{json, Value};

use super::file::GgufFile;
use super::tokenizer::{strings, token_types};

/// llama.cpp's token types (see `token_types`).
const UNKNOWN: i64 = 2;
const CONTROL: i64 = 3;
const USER_DEFINED: i64 = 4;
const UNUSED: i64 = 5;

fn scores(f: &GgufFile, n: usize) -> Result<Vec<f32>> {
    let Some(Meta::Array(v)) = f.meta("tokenizer.ggml.scores") else { bail!("{}: metadata tokenizer.ggml.scores is missing or not an array", f.name()) };
    if v.len() != n {
        bail!("{}: tokenizer.ggml.scores has {} entries for {n} tokens", f.name(), v.len());
    }
    v.iter().map(|x| x.to_f32().map_err(|_| anyhow::anyhow!("{}: tokenizer.ggml.scores holds {x:?}, not numbers", f.name()))).collect()
}

fn flag(f: &GgufFile, key: &str, default: bool) -> bool {
    f.meta(key).and_then(|v| v.to_bool().ok()).unwrap_or(default)
}

/// The text of the token whose id `key` names, if the file names one in range.
fn named<'a>(f: &GgufFile, key: &str, tokens: &[&'a str]) -> Option<&'a str> {
    let id = f.meta(key).and_then(|v| v.to_u32().ok())?;
    tokens.get(id as usize).copied()
}

/// transformers' `generate_merges`: for each piece in id order, every split into two pieces of
/// the vocabulary (ordered by the parts' ids), then all of them sorted stably by the piece's
/// score, best first, longer left parts first, then longer right parts.
fn generate_merges(tokens: &[&str], scores: &[f32], vocab: &HashMap<&str, u32>) -> Vec<(String, String)> {
    let mut merges: Vec<(&str, &str, f32)> = vec![];
    for (&piece, &score) in tokens.iter().zip(scores) {
        if !vocab.contains_key(piece) {
            continue;
        }
        let mut local: Vec<(&str, &str, f32)> = piece
            .char_indices()
            .skip(1)
            .map(|(i, _)| piece.split_at(i))
            .filter(|(l, r)| vocab.contains_key(l) && vocab.contains_key(r))
            .map(|(l, r)| (l, r, score))
            .collect();
        local.sort_by_key(|(l, r, _)| (vocab[l], vocab[r]));
        merges.extend(local);
    }
    let len = |s: &str| s.chars().count();
    merges.sort_by(|a, b| b.2.total_cmp(&a.2).then(len(b.0).cmp(&len(a.0))).then(len(b.1).cmp(&len(a.1))));
    merges.into_iter().map(|(l, r, _)| (l.to_string(), r.to_string())).collect()
}

/// The post-processor adding `<bos>` (and `<eos>`) as the HF tokenizer does when asked to.
fn post_processor(bos: Option<(&str, u32)>, eos: Option<(&str, u32)>) -> Value {
    let special = |(t, _): (&str, u32)| json!({"SpecialToken": {"id": t, "type_id": 0}});
    let seq = |s: &str| json!({"Sequence": {"id": s, "type_id": 0}});
    let around = |s: &str| bos.map(special).into_iter().chain([seq(s)]).chain(eos.map(special)).collect::<Vec<_>>();
    let pair: Vec<Value> = around("A").into_iter().chain(around("B")).collect();
    let mut specials = serde_json::Map::new();
    for (t, id) in bos.into_iter().chain(eos) {
        specials.insert(t.into(), json!({"id": t, "ids": [id], "tokens": [t]}));
    }
    json!({"type": "TemplateProcessing", "single": around("A"), "pair": pair, "special_tokens": specials})
}

/// The tokenizer.json text of a SentencePiece vocabulary.
pub fn tokenizer_json(f: &GgufFile) -> Result<String> {
    let tokens = strings(f, "tokenizer.ggml.tokens")?;
    let scores = scores(f, tokens.len())?;
    let types = token_types(f, tokens.len())?;
    let mut vocab: HashMap<&str, u32> = HashMap::new();
    let mut added = vec![];
    for (id, (&tok, &ty)) in tokens.iter().zip(&types).enumerate() {
        if matches!(ty, UNKNOWN | CONTROL | USER_DEFINED) {
            added.push(json!({"id": id, "content": tok, "single_word": false, "lstrip": false, "rstrip": false, "normalized": false, "special": ty != USER_DEFINED}));
        }
        // Unused ids are the converter's [PAD] fillers up to the embedding's rows.
        if ty != UNUSED && vocab.insert(tok, id as u32).is_some() {
            bail!("{}: token {tok:?} appears twice in tokenizer.ggml.tokens", f.name());
        }
    }
    let mut merge_vocab = vocab.clone();
    // transformers' GemmaSentencePieceExtractor lets a tab merge as its byte piece.
    if f.architecture()?.starts_with("gemma") && !merge_vocab.contains_key("\t") {
        if let Some(&b) = vocab.get("<0x09>") {
            merge_vocab.insert("\t", b);
        }
    }
    let merges: Vec<Value> = generate_merges(&tokens, &scores, &merge_vocab).into_iter().map(|(l, r)| json!([l, r])).collect();
    let Some(unk) = named(f, "tokenizer.ggml.unknown_token_id", &tokens).or_else(|| tokens.iter().zip(&types).find(|(_, &t)| t == UNKNOWN).map(|(s, _)| *s)) else {
        bail!("{}: the SentencePiece vocabulary has no unknown token (tokenizer.ggml.unknown_token_id)", f.name())
    };
    let id_of = |key: &str, add: bool| named(f, key, &tokens).filter(|_| add).map(|t| (t, vocab[t]));
    let bos = id_of("tokenizer.ggml.bos_token_id", flag(f, "tokenizer.ggml.add_bos_token", true));
    let eos = id_of("tokenizer.ggml.eos_token_id", flag(f, "tokenizer.ggml.add_eos_token", false));
    // llama.cpp marks a word start before the text unless add_space_prefix is false (Gemma);
    // transformers' LLaMA tokenizer does so at the start of the input only.
    let prefix = flag(f, "tokenizer.ggml.add_space_prefix", true);
    let (normalizer, pre_tokenizer) = match prefix {
        true => (Value::Null, json!({"type": "Metaspace", "replacement": "\u{2581}", "prepend_scheme": "first", "split": false})),
        false => (json!({"type": "Replace", "pattern": {"String": " "}, "content": "\u{2581}"}), Value::Null),
    };
    let mut decoders = vec![json!({"type": "Replace", "pattern": {"String": "\u{2581}"}, "content": " "}), json!({"type": "ByteFallback"}), json!({"type": "Fuse"})];
    if prefix {
        decoders.push(json!({"type": "Strip", "content": " ", "start": 1, "stop": 0}));
    }
    let t = json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": normalizer,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": post_processor(bos, eos),
        "decoder": {"type": "Sequence", "decoders": decoders},
        "model": {"type": "BPE", "dropout": null, "unk_token": unk, "continuing_subword_prefix": null, "end_of_word_suffix": null,
                  "fuse_unk": true, "byte_fallback": true, "ignore_merges": false, "vocab": vocab, "merges": merges},
    });
    Ok(t.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Ties keep id order; a better-scored piece's merges come first; every split into two
    /// known pieces is a merge.
    #[test]
    fn merges_follow_scores_as_transformers_builds_them() {
        let tokens = ["a", "b", "c", "ab", "bc", "abc"];
        let scores = [0.0, 0.0, 0.0, -1.0, -3.0, -2.0];
        let vocab: HashMap<&str, u32> = tokens.iter().enumerate().map(|(i, t)| (*t, i as u32)).collect();
        let m = generate_merges(&tokens, &scores, &vocab);
        let want = [("a", "b"), ("ab", "c"), ("a", "bc"), ("b", "c")];
        assert_eq!(m, want.map(|(l, r)| (l.to_string(), r.to_string())));
    }
}
