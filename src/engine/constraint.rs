//! JSON-schema constrained decoding on top of llguidance.
//!
//! `ConstraintFactory` holds the token trie and llguidance's `ParserFactory`; it is built once
//! per tokenizer (the trie and the lexer slices take a while) and shared by every request.
//! `ConstraintFactory::json_schema` compiles a schema into a `JsonConstraint`, one per request,
//! which implements `generate::TokenConstraint`.
//!
//! Semantics of a constrained output:
//! * the text is exactly one JSON value valid for the schema, in compact form (no whitespace
//!   between tokens: `{"a":1,"b":[2,3]}`), followed by the stop token;
//! * once the value is complete and cannot be extended, only the stop token is allowed; when it
//!   could still be extended (e.g. a number `12` may become `123`), both are allowed;
//! * `is_finished()` turns true when the stop token is committed, never earlier, so the
//!   generation always ends with the stop token (`FinishReason::Stop` includes it in `tokens`);
//! * the schema is used as given: no `maxLength`/`maxItems` is added and `additionalProperties`
//!   keeps its JSON-schema default (allowed). Callers who need short, closed outputs say so in the
//!   schema (`maxLength`, `maxItems`, `additionalProperties: false`); `max_new_tokens` remains
//!   the hard bound on length (an output cut there is not valid JSON: `FinishReason::Length`).

use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, bail, Context, Result};
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{TokEnv, TokenId};
use llguidance::{JsonCompileOptions, Matcher, ParserFactory};
use serde_json::Value;
use toktrie_hf_tokenizers::ByteTokenizer;

use crate::generate::TokenConstraint;

/// Compiles JSON schemas into per-request constraints for one tokenizer. Cheap to share:
/// wrap in an `Arc` (it is `Send + Sync`).
pub struct ConstraintFactory {
    parser_factory: Arc<ParserFactory>,
    tok_env: TokEnv,
    stop_token: u32,
    /// Tokenizer vocabulary size including added tokens; ids at or above it are never allowed.
    tokenizer_vocab: usize,
}

impl std::fmt::Debug for ConstraintFactory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintFactory")
            .field("stop_token", &self.stop_token)
            .field("tokenizer_vocab", &self.tokenizer_vocab)
            .finish()
    }
}

pub use crate::tokenizer::TokenizerJson;

impl ConstraintFactory {
    /// Builds the token trie from a HF `tokenizer.json`. `stop_token` ends every constrained
    /// output (Qwen: `<|im_end|>`); it must be a special token of that tokenizer.
    ///
    /// The file is read by toktrie_hf_tokenizers' own `tokenizers` version (0.21, not ours), so
    /// we hand it bytes rather than our `Tokenizer` object.
    pub fn from_tokenizer_json(path: &Path, stop_token: u32) -> Result<Self> {
        let bytes = crate::input::read(path, &crate::input::TOKENIZER)?;
        Self::from_json_bytes(&bytes, &path.display().to_string(), stop_token)
    }

    /// As `from_tokenizer_json`, from the tokenizer.json `source` names.
    pub fn from_source(source: &TokenizerJson, stop_token: u32) -> Result<Self> {
        match source {
            TokenizerJson::File(p) => Self::from_tokenizer_json(p, stop_token),
            TokenizerJson::Text { origin, text } => Self::from_json_bytes(text.as_bytes(), origin, stop_token),
        }
    }

    fn from_json_bytes(bytes: &[u8], origin: &str, stop_token: u32) -> Result<Self> {
        let path = std::path::Path::new(origin);
        let mut byte_tok = ByteTokenizer::from_json_bytes(bytes)
            .with_context(|| format!("building the llguidance byte tokenizer from {origin}"))?;
        let tokenizer_vocab = byte_tok.tokrx_info().vocab_size as usize;
        // set_eos_token asserts the range; check first so a bad id is an error, not a panic.
        if stop_token as usize >= tokenizer_vocab {
            bail!(
                "stop token {stop_token} is outside the vocabulary of {} ({tokenizer_vocab} tokens)",
                path.display()
            );
        }
        if byte_tok.token_bytes()[stop_token as usize].first().is_none_or(|&b| b != 0xFF) {
            // A plain-text stop token could be produced by the grammar itself (e.g. inside a
            // string), which would make "the output ended" ambiguous.
            bail!("stop token {stop_token} is not a special token in {}", path.display());
        }
        byte_tok.set_eos_token(stop_token);
        let tok_env = byte_tok
            .into_tok_env(None)
            .with_context(|| format!("building the token trie for {}", path.display()))?;
        let mut parser_factory = ParserFactory::new_simple(&tok_env)
            .with_context(|| format!("building the llguidance parser factory for {}", path.display()))?;
        // llguidance logs warnings to stderr by default; errors reach callers through Result.
        parser_factory.quiet();
        Ok(ConstraintFactory { parser_factory: Arc::new(parser_factory), tok_env, stop_token, tokenizer_vocab })
    }

    pub fn stop_token(&self) -> u32 {
        self.stop_token
    }

    /// Number of tokenizer tokens (added tokens included); masks never allow ids past it.
    pub fn tokenizer_vocab(&self) -> usize {
        self.tokenizer_vocab
    }

    /// Compiles `schema` into a fresh constraint. Invalid or unsupported schemas (unknown
    /// types, unsatisfiable combinations, unsupported keywords) are errors that quote the
    /// schema. A `"x-guidance"` key in the schema overrides our compact-JSON options.
    pub fn json_schema(&self, schema: &Value) -> Result<JsonConstraint> {
        let shown = abbreviate(schema);
        let grammar_schema = match schema {
            Value::Object(map) => {
                let mut map = map.clone();
                if !map.contains_key("x-guidance") {
                    map.insert("x-guidance".into(), serde_json::to_value(compact_options())?);
                }
                Value::Object(map)
            }
            // `true` is the schema "any JSON value"; `false` accepts nothing.
            Value::Bool(true) => serde_json::json!({ "x-guidance": compact_options() }),
            Value::Bool(false) => bail!("JSON schema `false` accepts no value"),
            other => bail!("a JSON schema must be an object or a boolean, got {}", abbreviate(other)),
        };
        let grammar = TopLevelGrammar::from_json_schema(grammar_schema);
        let parser = self
            .parser_factory
            .create_parser(grammar)
            .map_err(|e| anyhow!("invalid or unsupported JSON schema {shown}: {e}"))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            bail!("invalid or unsupported JSON schema {shown}: {e}");
        }
        Ok(JsonConstraint {
            matcher,
            tok_env: self.tok_env.clone(),
            stop_token: self.stop_token,
            tokenizer_vocab: self.tokenizer_vocab,
            tokens: Vec::new(),
            finished: false,
            schema: shown,
        })
    }
}

/// Compact JSON: fixed separators and no free whitespace, so a model cannot spend its token
/// budget on spaces and newlines (tiny or weak models otherwise often never close the value).
fn compact_options() -> JsonCompileOptions {
    JsonCompileOptions {
        item_separator: ",".into(),
        key_separator: ":".into(),
        whitespace_flexible: false,
        whitespace_pattern: None,
        ..JsonCompileOptions::default()
    }
}

/// The schema as compact JSON, cut to a readable length for error messages.
fn abbreviate(v: &Value) -> String {
    const MAX: usize = 200;
    let s = v.to_string();
    match s.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}…", &s[..cut]),
        None => s,
    }
}

/// One request's JSON-schema constraint; see the module docs for its semantics.
pub struct JsonConstraint {
    matcher: Matcher,
    tok_env: TokEnv,
    stop_token: u32,
    tokenizer_vocab: usize,
    /// Committed tokens, stop token excluded.
    tokens: Vec<TokenId>,
    finished: bool,
    /// Abbreviated schema, for error messages.
    schema: String,
}

impl std::fmt::Debug for JsonConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("JsonConstraint")
            .field("schema", &self.schema)
            .field("tokens", &self.tokens.len())
            .field("finished", &self.finished)
            .finish()
    }
}

impl JsonConstraint {
    /// UTF-8 text of the committed tokens (stop token excluded); lossy while a multi-byte
    /// character is split across tokens.
    pub fn text_so_far(&self) -> String {
        String::from_utf8_lossy(&self.tok_env.tok_trie().decode_raw(&self.tokens)).into_owned()
    }

    /// Committed tokens, stop token excluded.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// The JSON value is complete: the stop token may come next.
    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }

    /// Allowed tokens over the tokenizer vocabulary: only the stop token once the value is
    /// complete and cannot grow, otherwise llguidance's mask.
    fn tokenizer_mask(&mut self) -> Result<llguidance::toktrie::SimpleVob> {
        self.matcher
            .compute_mask_or_eos()
            .map_err(|e| anyhow!("JSON constraint {}: computing the token mask after {:?}: {e}", self.schema, self.text_so_far()))
    }
}

impl TokenConstraint for JsonConstraint {
    fn allowed(&mut self, vocab_size: usize) -> Result<Option<Vec<bool>>> {
        if self.finished {
            bail!("JSON constraint {}: asked for a mask after the stop token", self.schema);
        }
        let vob = self.tokenizer_mask()?;
        // The model vocabulary may be padded past the tokenizer's (or, rarely, be smaller):
        // ids without a tokenizer entry stay false.
        let n = vocab_size.min(self.tokenizer_vocab).min(vob.len());
        let mut mask = vec![false; vocab_size];
        let mut any = false;
        for (id, slot) in mask.iter_mut().enumerate().take(n) {
            *slot = vob.is_allowed(id as TokenId);
            any |= *slot;
        }
        if !any {
            bail!(
                "JSON constraint {}: no token of the model's {vocab_size} is allowed after {:?}",
                self.schema,
                self.text_so_far()
            );
        }
        Ok(Some(mask))
    }

    fn commit(&mut self, token: u32) -> Result<()> {
        if self.finished {
            bail!("JSON constraint {}: token {token} committed after the stop token", self.schema);
        }
        if token == self.stop_token && self.matcher.is_stopped() && !self.matcher.is_error() {
            // The matcher stops by itself once the value cannot be extended; the stop token is
            // then the only allowed continuation and ends the output.
            self.finished = true;
            return Ok(());
        }
        if let Err(e) = self.matcher.consume_token(token) {
            let detail = self.matcher.get_error().unwrap_or_else(|| e.to_string());
            bail!(
                "JSON constraint {}: token {token} ({:?}) rejected after {:?}: {detail}",
                self.schema,
                String::from_utf8_lossy(&self.tok_env.tok_trie().decode_raw(&[token])),
                self.text_so_far()
            );
        }
        if self.matcher.is_error() {
            bail!(
                "JSON constraint {}: matcher error after token {token}: {}",
                self.schema,
                self.matcher.get_error().unwrap_or_default()
            );
        }
        if token == self.stop_token {
            self.finished = true;
        } else {
            self.tokens.push(token);
        }
        Ok(())
    }

    fn is_finished(&self) -> bool {
        self.finished
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn factory() -> ConstraintFactory {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-qwen2-vl/tokenizer.json");
        ConstraintFactory::from_tokenizer_json(&dir, 450).unwrap()
    }

    #[test]
    fn stop_token_must_be_special_and_in_range() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/tiny-qwen2-vl/tokenizer.json");
        assert!(ConstraintFactory::from_tokenizer_json(&p, 100_000).is_err());
        assert!(ConstraintFactory::from_tokenizer_json(&p, 10).is_err());
        assert!(ConstraintFactory::from_tokenizer_json(Path::new("/nonexistent/tokenizer.json"), 450).is_err());
    }

    #[test]
    fn non_object_schema_is_rejected() {
        let f = factory();
        assert!(f.json_schema(&serde_json::json!(3)).is_err());
        assert!(f.json_schema(&serde_json::json!(false)).is_err());
        assert!(f.json_schema(&serde_json::json!(true)).is_ok());
    }
}
