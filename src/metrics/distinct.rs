//! Distinct-n (Li et al. 2016): distinct n-grams / all n-grams of the generated replies.
//!
//! Tokenisation (`tokenize`): lowercase; typographic apostrophes ’ ‘ become '; then each maximal
//! run of word characters (Unicode letters, digits, `_`, and `'`) is a token and every other
//! non-space character is a token of its own. The same rule as Python's
//! `re.findall(r"[\w']+|[^\w\s]", text.lower())` after the apostrophe mapping.
//! N-grams never cross reply boundaries.

use std::collections::HashSet;

use anyhow::{bail, Result};
use serde::Serialize;

/// How replies are pooled.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum DistinctMode {
    /// Unique / total n-grams over all replies at once (Li et al.'s definition).
    Corpus,
    /// Mean over replies of each reply's own unique / total; replies with no n-gram of that
    /// order are left out of that order's mean.
    PerResponse,
    /// Corpus-level within consecutive chunks of `size` replies, averaged over chunks. A trailing
    /// partial chunk is dropped when at least one full chunk exists (a tiny chunk would inflate
    /// the mean); with fewer than `size` replies the single partial chunk is used.
    Chunked { size: usize },
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DistinctScores {
    pub mode: DistinctMode,
    pub distinct_1: f64,
    pub distinct_2: f64,
    /// Replies given.
    pub responses: usize,
    /// Units averaged for distinct-1 and distinct-2: 1 (corpus), replies with such n-grams
    /// (per-response), or chunks.
    pub units: [usize; 2],
    /// Replies left out by a dropped partial chunk.
    pub dropped_responses: usize,
}

/// Normalises the apostrophes VADER and distinct-n see: ’ (U+2019) and ‘ (U+2018) become '.
pub fn normalize_apostrophes(text: &str) -> String {
    text.replace(['\u{2019}', '\u{2018}'], "'")
}

pub fn tokenize(text: &str) -> Vec<String> {
    let text = normalize_apostrophes(&text.to_lowercase());
    let mut out = Vec::new();
    let mut word = String::new();
    for c in text.chars() {
        if c.is_alphanumeric() || c == '_' || c == '\'' {
            word.push(c);
            continue;
        }
        if !word.is_empty() {
            out.push(std::mem::take(&mut word));
        }
        if !c.is_whitespace() {
            out.push(c.to_string());
        }
    }
    if !word.is_empty() {
        out.push(word);
    }
    out
}

/// (distinct, total) n-grams over the token lists, n-grams not crossing list boundaries.
pub fn ngram_counts(replies: &[Vec<String>], n: usize) -> (usize, usize) {
    let mut seen: HashSet<&[String]> = HashSet::new();
    let mut total = 0;
    for toks in replies {
        if n > 0 && toks.len() >= n {
            for g in toks.windows(n) {
                seen.insert(g);
                total += 1;
            }
        }
    }
    (seen.len(), total)
}

fn ratio(tokens: &[Vec<String>], n: usize) -> Option<f64> {
    let (u, t) = ngram_counts(tokens, n);
    (t > 0).then(|| u as f64 / t as f64)
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// Distinct-1 and -2 of `replies` pooled as `mode` says. A pool without any n-gram scores 0.
pub fn distinct<S: AsRef<str>>(replies: &[S], mode: DistinctMode) -> Result<DistinctScores> {
    let toks: Vec<Vec<String>> = replies.iter().map(|r| tokenize(r.as_ref())).collect();
    let mut dropped = 0;
    let groups: Vec<&[Vec<String>]> = match mode {
        DistinctMode::Corpus => vec![&toks[..]],
        DistinctMode::PerResponse => toks.chunks(1).collect(),
        DistinctMode::Chunked { size } => {
            if size == 0 {
                bail!("distinct-n: chunk size must be at least 1");
            }
            let mut g: Vec<&[Vec<String>]> = toks.chunks(size).collect();
            if g.len() > 1 && g.last().is_some_and(|c| c.len() < size) {
                dropped = g.pop().map_or(0, |c| c.len());
            }
            g
        }
    };
    let score = |n: usize| -> (f64, usize) {
        let rs: Vec<f64> = match mode {
            // Empty replies contribute nothing, so they are left out of the per-reply mean.
            DistinctMode::PerResponse => groups.iter().filter_map(|g| ratio(g, n)).collect(),
            _ => groups.iter().map(|g| ratio(g, n).unwrap_or(0.0)).collect(),
        };
        (mean(&rs), rs.len())
    };
    let ((d1, u1), (d2, u2)) = (score(1), score(2));
    Ok(DistinctScores { mode, distinct_1: d1, distinct_2: d2, responses: replies.len(), units: [u1, u2], dropped_responses: dropped })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokenisation() {
        assert_eq!(tokenize("I DON’T know... ‘Where’s number 27?!’"), [
            "i", "don't", "know", ".", ".", ".", "'where's", "number", "27", "?", "!", "'"
        ]);
        assert!(tokenize("  \t ").is_empty());
    }

    #[test]
    fn hand_counted() {
        // "a b a" + "a b": unigrams 5 total, 2 distinct; bigrams (a b)(b a)(a b) 3 total, 2 distinct.
        let r = ["a b a", "a b"];
        let c = distinct(&r, DistinctMode::Corpus).unwrap();
        assert_eq!((c.distinct_1, c.distinct_2), (2.0 / 5.0, 2.0 / 3.0));
        let p = distinct(&r, DistinctMode::PerResponse).unwrap();
        assert_eq!((p.distinct_1, p.distinct_2), ((2.0 / 3.0 + 1.0) / 2.0, 1.0));
        let k = distinct(&["a", "a", "b"], DistinctMode::Chunked { size: 2 }).unwrap();
        assert_eq!((k.distinct_1, k.dropped_responses, k.units), (0.5, 1, [1, 1]));
        let e = distinct(&["", "x"], DistinctMode::PerResponse).unwrap();
        assert_eq!((e.distinct_1, e.distinct_2, e.units), (1.0, 0.0, [1, 0]));
        assert!(distinct(&["a"], DistinctMode::Chunked { size: 0 }).is_err());
        assert_eq!(distinct::<&str>(&[], DistinctMode::Corpus).unwrap().distinct_1, 0.0);
    }
}
