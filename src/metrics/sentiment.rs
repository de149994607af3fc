//! VADER sentiment (Hutto & Gilbert 2014) and the sentiment-polarity agreement of a reply with
//! its history.
//!
//! Scoring is `vader-parity`, a port with tested output parity against Python vaderSentiment
//! 3.3.2 (our goldens re-check it on MELD utterances). Before scoring, typographic apostrophes
//! become ' (`normalize_apostrophes`): VADER's negation list and lexicon spell "don't", and
//! MELD writes "don’t".

use std::sync::OnceLock;

use serde::Serialize;
use vader_parity::SentimentIntensityAnalyzer;

pub use super::distinct::normalize_apostrophes;

fn analyzer() -> &'static SentimentIntensityAnalyzer {
    // The lexicon is parsed once per process.
    static A: OnceLock<SentimentIntensityAnalyzer> = OnceLock::new();
    A.get_or_init(SentimentIntensityAnalyzer::new)
}

/// VADER compound score of `text` exactly as given (rounded to 4 decimals, like vaderSentiment).
pub fn compound_raw(text: &str) -> f64 {
    analyzer().polarity_scores(text).compound
}

/// VADER compound score after apostrophe normalisation: the score the metrics use. In [-1, 1].
pub fn compound(text: &str) -> f64 {
    compound_raw(&normalize_apostrophes(text))
}

/// 1 − |compound(reply) − mean compound of the history turns|; 0 when the history is empty.
/// Ranges over [-1, 1]: 1 when the reply's sentiment matches the history's mean.
pub fn polarity<S: AsRef<str>>(reply: &str, history: &[S]) -> f64 {
    if history.is_empty() {
        return 0.0;
    }
    let mean = history.iter().map(|t| compound(t.as_ref())).sum::<f64>() / history.len() as f64;
    1.0 - (compound(reply) - mean).abs()
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolaritySummary {
    /// Mean of per-item polarity over all items (items with empty history score 0 and count).
    pub mean_polarity: f64,
    pub items: usize,
    pub empty_histories: usize,
    /// Mean compound of the replies.
    pub mean_reply_compound: f64,
}

/// Corpus summary over (reply, history texts) pairs.
pub fn summarize<S: AsRef<str>>(pairs: &[(S, Vec<S>)]) -> PolaritySummary {
    let n = pairs.len();
    let avg = |xs: Vec<f64>| if n == 0 { 0.0 } else { xs.iter().sum::<f64>() / n as f64 };
    PolaritySummary {
        mean_polarity: avg(pairs.iter().map(|(r, h)| polarity(r.as_ref(), h)).collect()),
        items: n,
        empty_histories: pairs.iter().filter(|(_, h)| h.is_empty()).count(),
        mean_reply_compound: avg(pairs.iter().map(|(r, _)| compound(r.as_ref())).collect()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polarity_definition() {
        assert_eq!(polarity::<&str>("I love it!", &[]), 0.0);
        let h = ["This is great.", "I hate this."];
        let mean = (compound(h[0]) + compound(h[1])) / 2.0;
        let want = 1.0 - (compound("Okay.") - mean).abs();
        assert_eq!(polarity("Okay.", &h), want);
        assert_eq!(polarity("The table.", &["A chair."]), 1.0);
        // "don’t" must negate like "don't".
        assert_eq!(compound("I don’t like it"), compound_raw("I don't like it"));
        assert!(compound("I don’t like it") < 0.0);
    }
}
