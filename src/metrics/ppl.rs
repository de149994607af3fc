//! Perplexity of generated replies from the engine's per-token natural-log probabilities
//! (`Generation::logprobs`, under the unmodified model).
//!
//! Tokens: every generated token the engine reports, the stop token included when generation
//! ended on one (ending the reply is one of the model's predictions). Pass
//! `Generation::logprobs` unchanged.
//!
//! - item PPL = exp(−mean logprob of the item's tokens)
//! - corpus PPL = exp(−Σ logprobs / Σ tokens) over all items: the headline number, token-weighted
//! - `mean_item_ppl` = mean of item PPLs is reported too (dominated by short, unlikely replies).

use anyhow::{bail, Result};
use serde::Serialize;

/// Rounding in a log-softmax can give a probability-1 token a logprob a hair above 0.
const POSITIVE_SLACK: f32 = 1e-3;

fn check(logprobs: &[f32], what: &str) -> Result<()> {
    if let Some((i, lp)) = logprobs.iter().enumerate().find(|(_, lp)| lp.is_nan() || **lp > POSITIVE_SLACK) {
        bail!("perplexity: {what}: token {i} has logprob {lp}, not a natural-log probability (≤ 0)");
    }
    Ok(())
}

/// exp(−mean logprob); an error for an empty reply or a logprob that is NaN or > 0.
pub fn item_ppl(logprobs: &[f32]) -> Result<f64> {
    if logprobs.is_empty() {
        bail!("perplexity: empty reply (no generated tokens)");
    }
    check(logprobs, "reply")?;
    let sum: f64 = logprobs.iter().map(|&x| x as f64).sum();
    Ok((-sum / logprobs.len() as f64).exp())
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PplSummary {
    /// exp(−Σ logprobs / Σ tokens): the headline.
    pub corpus_ppl: f64,
    pub mean_item_ppl: f64,
    /// Items with at least one token.
    pub items: usize,
    pub tokens: usize,
    /// Items with no generated token (left out of both numbers).
    pub empty_items: usize,
}

pub fn summarize<T: AsRef<[f32]>>(items: &[T]) -> Result<PplSummary> {
    let (mut sum, mut tokens, mut item_sum, mut used, mut empty) = (0f64, 0usize, 0f64, 0usize, 0usize);
    for (i, lps) in items.iter().enumerate() {
        let lps = lps.as_ref();
        if lps.is_empty() {
            empty += 1;
            continue;
        }
        check(lps, &format!("item {i}"))?;
        sum += lps.iter().map(|&x| x as f64).sum::<f64>();
        tokens += lps.len();
        item_sum += item_ppl(lps)?;
        used += 1;
    }
    if used == 0 {
        bail!("perplexity: no item has a generated token ({} items)", items.len());
    }
    Ok(PplSummary { corpus_ppl: (-sum / tokens as f64).exp(), mean_item_ppl: item_sum / used as f64, items: used, tokens, empty_items: empty })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed() {
        // ln(1/2), ln(1/4): mean −1.5 ln 2 → PPL 2^1.5.
        let a = [0.5f32.ln(), 0.25f32.ln()];
        assert!((item_ppl(&a).unwrap() - 2f64.powf(1.5)).abs() < 1e-5);
        // Uniform over 10 → PPL 10 whatever the length.
        let b = [0.1f32.ln(); 3];
        assert!((item_ppl(&b).unwrap() - 10.0).abs() < 1e-4);
        let s = summarize(&[a.to_vec(), b.to_vec(), vec![]]).unwrap();
        // Σ = ln(1/8) + 3 ln(1/10) over 5 tokens → (8·1000)^(1/5).
        assert!((s.corpus_ppl - 8000f64.powf(0.2)).abs() < 1e-4, "{s:?}");
        assert!((s.mean_item_ppl - (2f64.powf(1.5) + 10.0) / 2.0).abs() < 1e-4);
        assert_eq!((s.items, s.tokens, s.empty_items), (2, 5, 1));
        assert!(item_ppl(&[0.0]).unwrap() == 1.0);
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(item_ppl(&[]).is_err());
        assert!(item_ppl(&[f32::NAN]).is_err());
        assert!(item_ppl(&[0.5]).is_err());
        assert!(summarize::<Vec<f32>>(&[vec![]]).is_err());
        assert!(summarize(&[vec![-1.0], vec![0.2]]).unwrap_err().to_string().contains("item 1"));
        assert!(item_ppl(&[f32::NEG_INFINITY]).unwrap().is_infinite());
    }
}
