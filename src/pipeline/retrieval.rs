//! Exemplar memory for SGRG: (context, response) pairs from a held-out split (MELD dev,
//! IEMOCAP Session 2), searched with Okapi BM25 over the context text. Deterministic (ties go
//! to the earlier entry) and leak-proof: entries from the query's own dialogue are never
//! returned, so a test item can never retrieve itself or its neighbours.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

use crate::dialogue::Dialogue;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Exemplar {
    /// Unique id, e.g. "meld/dev/dia12_utt3".
    pub key: String,
    /// The dialogue it comes from (entries of the query's dialogue are excluded).
    pub dialogue: String,
    /// The turns before the response, "Speaker: text" lines.
    pub context: String,
    pub response: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub emotion: Option<String>,
}

/// Okapi BM25 parameters (the usual defaults).
const K1: f64 = 1.2;
const B: f64 = 0.75;
/// Context turns used for indexing and for queries: the recent turns decide what a reply answers.
pub const CONTEXT_TURNS: usize = 3;

pub struct Memory {
    pub entries: Vec<Exemplar>,
    docs: Vec<HashMap<String, u32>>,
    lens: Vec<f64>,
    avg_len: f64,
    df: HashMap<String, u32>,
}

/// Lowercased alphanumeric words; typographic apostrophes fold into plain ones.
pub fn words(text: &str) -> Vec<String> {
    crate::metrics::distinct::normalize_apostrophes(text)
        .to_lowercase()
        .split(|c: char| !(c.is_alphanumeric() || c == '\''))
        .map(|w| w.trim_matches('\''))
        .filter(|w| !w.is_empty())
        .map(str::to_string)
        .collect()
}

/// The query/context text of a dialogue: its last `CONTEXT_TURNS` turns.
pub fn context_text(d: &Dialogue) -> String {
    let n = d.turns.len();
    d.turns[n.saturating_sub(CONTEXT_TURNS)..].iter().map(|t| format!("{}: {}", t.speaker, t.text)).collect::<Vec<_>>().join("\n")
}

impl Memory {
    pub fn new(entries: Vec<Exemplar>) -> Self {
        let docs: Vec<HashMap<String, u32>> = entries
            .iter()
            .map(|e| {
                let mut tf = HashMap::new();
                for w in words(&e.context) {
                    *tf.entry(w).or_insert(0) += 1;
                }
                tf
            })
            .collect();
        let lens: Vec<f64> = docs.iter().map(|d| d.values().sum::<u32>() as f64).collect();
        let avg_len = if lens.is_empty() { 0.0 } else { lens.iter().sum::<f64>() / lens.len() as f64 };
        let mut df = HashMap::new();
        for d in &docs {
            for w in d.keys() {
                *df.entry(w.clone()).or_insert(0) += 1;
            }
        }
        Memory { entries, docs, lens, avg_len, df }
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn idf(&self, w: &str) -> f64 {
        let n = self.entries.len() as f64;
        let df = *self.df.get(w).unwrap_or(&0) as f64;
        // BM25+ style floor (Lucene's formula): never negative for very common words.
        ((n - df + 0.5) / (df + 0.5) + 1.0).ln()
    }

    /// The `k` best entries for `query`, skipping entries from dialogue `exclude_dialogue`.
    /// Entries with no word in common score 0 and are never returned.
    pub fn search(&self, query: &str, k: usize, exclude_dialogue: Option<&str>) -> Vec<(f64, &Exemplar)> {
        if k == 0 || self.entries.is_empty() {
            return vec![];
        }
        let mut q = words(query);
        q.sort();
        q.dedup();
        let mut scored: Vec<(f64, usize)> = vec![];
        for (i, (doc, len)) in self.docs.iter().zip(&self.lens).enumerate() {
            if exclude_dialogue.is_some_and(|d| d == self.entries[i].dialogue) {
                continue;
            }
            let mut s = 0.0;
            for w in &q {
                if let Some(&tf) = doc.get(w) {
                    let tf = tf as f64;
                    s += self.idf(w) * tf * (K1 + 1.0) / (tf + K1 * (1.0 - B + B * len / self.avg_len.max(1e-9)));
                }
            }
            if s > 0.0 {
                scored.push((s, i));
            }
        }
        scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        scored.into_iter().take(k).map(|(s, i)| (s, &self.entries[i])).collect()
    }

    pub fn from_jsonl(path: &Path) -> Result<Self> {
        let f = crate::input::open(path, &crate::input::MEMORY)?;
        Self::from_jsonl_reader(std::io::BufReader::new(f), &path.display().to_string())
    }

    /// As `from_jsonl`, from any reader; `name` names it in errors.
    pub fn from_jsonl_reader(r: impl BufRead, name: &str) -> Result<Self> {
        let mut entries = vec![];
        for (n, line) in r.lines().enumerate() {
            let line = line.with_context(|| format!("{name} line {}: not UTF-8 text", n + 1))?;
            if line.trim().is_empty() {
                continue;
            }
            let e: Exemplar = serde_json::from_str(&line)
                .with_context(|| format!("{name} line {}: expected {{\"key\", \"dialogue\", \"context\", \"response\"}}", n + 1))?;
            entries.push(e);
        }
        if entries.is_empty() {
            bail!("exemplar memory {name} is empty");
        }
        Ok(Memory::new(entries))
    }

    pub fn write_jsonl(&self, path: &Path) -> Result<()> {
        let mut f = std::io::BufWriter::new(std::fs::File::create(path).with_context(|| format!("creating {}", path.display()))?);
        for e in &self.entries {
            writeln!(f, "{}", serde_json::to_string(e)?)?;
        }
        f.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ex(key: &str, dia: &str, ctx: &str) -> Exemplar {
        Exemplar { key: key.into(), dialogue: dia.into(), context: ctx.into(), response: format!("re {key}"), emotion: None }
    }

    #[test]
    fn bm25_ranks_by_overlap_and_rarity_and_excludes_own_dialogue() {
        let m = Memory::new(vec![
            ex("a", "1", "I lost my job today"),
            ex("b", "2", "the job interview went great"),
            ex("c", "3", "the cat is sick"),
            ex("d", "4", "today today today the the the"),
        ]);
        let r = m.search("I lost my job", 2, None);
        assert_eq!(r[0].1.key, "a");
        assert_eq!(r[1].1.key, "b");
        assert!(r[0].0 > r[1].0);
        let r = m.search("I lost my job", 2, Some("1"));
        assert_eq!(r[0].1.key, "b", "own dialogue excluded");
        assert!(m.search("zebra", 3, None).is_empty());
        assert!(m.search("job", 0, None).is_empty());
        // Typographic apostrophes match plain ones.
        assert_eq!(words("I can\u{2019}t"), words("i can't"));
    }

    #[test]
    fn ties_go_to_the_earlier_entry() {
        let m = Memory::new(vec![ex("x", "1", "hello there"), ex("y", "2", "hello there")]);
        let r = m.search("hello", 2, None);
        assert_eq!((r[0].1.key.as_str(), r[1].1.key.as_str()), ("x", "y"));
        assert_eq!(r[0].0, r[1].0);
    }
}
