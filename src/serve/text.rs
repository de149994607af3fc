//! Turning a token stream into text deltas a client can print: incremental detokenisation
//! that never emits half a UTF-8 character, and stop strings that are cut from the output
//! (held back while they might still be starting).

use std::sync::Arc;

use anyhow::Result;

use crate::tokenizer::ChatTokenizer;

/// Incremental detokeniser (the prefix/read-offset scheme of TGI and vLLM): each new token
/// decodes a short window of recent tokens, so the cost per token stays constant, and text is
/// released only once it no longer ends in an incomplete character.
pub struct IncrementalDecoder {
    tok: Arc<ChatTokenizer>,
    tokens: Vec<u32>,
    prefix: usize,
    read: usize,
}

impl IncrementalDecoder {
    pub fn new(tok: Arc<ChatTokenizer>) -> Self {
        IncrementalDecoder { tok, tokens: vec![], prefix: 0, read: 0 }
    }

    /// The text `token` completes (often empty for a partial character or a special token).
    pub fn push(&mut self, token: u32) -> Result<String> {
        self.tokens.push(token);
        let before = self.tok.decode(&self.tokens[self.prefix..self.read], true)?;
        let after = self.tok.decode(&self.tokens[self.prefix..], true)?;
        if after.len() <= before.len() || after.ends_with('\u{FFFD}') || !after.is_char_boundary(before.len()) {
            return Ok(String::new());
        }
        self.prefix = self.read;
        self.read = self.tokens.len();
        Ok(after[before.len()..].to_string())
    }

    /// Text still held back at the end (an incomplete character decodes to U+FFFD, exactly
    /// as decoding the whole output at once does).
    pub fn finish(&mut self) -> Result<String> {
        let before = self.tok.decode(&self.tokens[self.prefix..self.read], true)?;
        let after = self.tok.decode(&self.tokens[self.prefix..], true)?;
        self.prefix = self.tokens.len();
        self.read = self.tokens.len();
        Ok(after.get(before.len()..).unwrap_or_default().to_string())
    }
}

/// What to send after a piece of text arrived.
#[derive(Debug, PartialEq)]
pub enum StopCheck {
    /// Text that can no longer become part of a stop string.
    Emit(String),
    /// A stop string appeared: the text before it; generation should end.
    Stopped(String),
}

/// Cuts the output at the first stop string (OpenAI and Ollama semantics: the stop string
/// itself is not returned). Text that could be the start of a stop string waits.
pub struct StopMatcher {
    stops: Vec<String>,
    /// Received but not yet emitted.
    held: String,
    done: bool,
}

impl StopCheck {
    /// The text to send, whichever case it is.
    pub fn into_text(self) -> String {
        match self {
            StopCheck::Emit(t) | StopCheck::Stopped(t) => t,
        }
    }
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        StopMatcher { stops: stops.into_iter().filter(|s| !s.is_empty()).collect(), held: String::new(), done: false }
    }

    pub fn push(&mut self, piece: &str) -> StopCheck {
        if self.done {
            return StopCheck::Stopped(String::new());
        }
        self.held.push_str(piece);
        let first = self.stops.iter().filter_map(|s| self.held.find(s.as_str())).min();
        if let Some(at) = first {
            self.done = true;
            let out = self.held[..at].to_string();
            self.held.clear();
            return StopCheck::Stopped(out);
        }
        let keep = self.partial_suffix();
        let out = self.held[..self.held.len() - keep].to_string();
        self.held.drain(..self.held.len() - keep);
        StopCheck::Emit(out)
    }

    /// Whether a stop string has appeared.
    pub fn is_stopped(&self) -> bool {
        self.done
    }

    /// Whatever is held back, at the end of generation (nothing once stopped).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.held)
    }

    /// Length of the longest suffix of `held` that is a proper prefix of some stop string.
    fn partial_suffix(&self) -> usize {
        let mut best = 0;
        for s in &self.stops {
            for (i, _) in self.held.char_indices() {
                let tail = &self.held[i..];
                if tail.len() < s.len() && s.starts_with(tail) {
                    best = best.max(tail.len());
                    break;
                }
            }
        }
        best
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(stops.iter().map(|s| s.to_string()).collect());
        let mut out = String::new();
        for p in pieces {
            match m.push(p) {
                StopCheck::Emit(t) => out.push_str(&t),
                StopCheck::Stopped(t) => {
                    out.push_str(&t);
                    return (out, true);
                }
            }
        }
        out.push_str(&m.flush());
        (out, false)
    }

    #[test]
    fn stop_strings_are_cut_even_across_pieces() {
        assert_eq!(run(&["END"], &["hello E", "N", "D more"]), ("hello ".into(), true));
        assert_eq!(run(&["\n\n", "##"], &["a\n", "b#", "#c"]), ("a\nb".into(), true));
        // A partial match that does not complete is released.
        assert_eq!(run(&["END"], &["the EN", "ding"]), ("the ENding".into(), false));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), false));
        // Multi-byte text around a held suffix.
        assert_eq!(run(&["ü!"], &["grüß ü", "?"]), ("grüß ü?".into(), false));
    }

    #[test]
    fn held_text_waits_only_while_it_can_still_match() {
        let mut m = StopMatcher::new(vec!["STOP".into()]);
        assert_eq!(m.push("go ST"), StopCheck::Emit("go ".into()));
        assert_eq!(m.push("x"), StopCheck::Emit("STx".into()));
    }
}
