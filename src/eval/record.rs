//! One JSONL line per evaluated item: what the pipeline answered, what it should have, a
//! summary of its trace, and the item's own metrics. Written as soon as the item is done, so a
//! killed run loses at most the items in flight.

use serde::{Deserialize, Serialize};

use crate::pipeline::psp::Plan;
use crate::pipeline::Trace;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Record {
    pub key: String,
    /// Position in the dataset's full item list (before sharding and --limit).
    pub index: usize,
    pub gold: String,
    pub forecast: Option<String>,
    pub reply: String,
    pub reference: String,
    /// History utterance texts (polarity compares the reply with them).
    pub history: Vec<String>,
    /// Their speakers (for human-evaluation sheets).
    #[serde(default)]
    pub speakers: Vec<String>,
    /// The pipeline failed on this item (the message); it has no reply and no metrics.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    pub trace: TraceSummary,
    pub metrics: ItemMetrics,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct TraceSummary {
    pub rounds: usize,
    pub selected_round: usize,
    /// (c1..c4) per round.
    pub tuples: Vec<[bool; 4]>,
    /// Stage each round started from ("mpa" for the first pass).
    pub starts: Vec<String>,
    pub plan: Option<Plan>,
    pub keyframes: usize,
    /// Audio clips the agents heard.
    #[serde(default)]
    pub audio_clips: usize,
    pub exemplars: Vec<String>,
    pub notes: Vec<String>,
    pub calls: usize,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    pub ms: f64,
}

impl TraceSummary {
    pub fn of(t: &Trace) -> Self {
        TraceSummary {
            rounds: t.rounds.len(),
            selected_round: t.selected_round,
            tuples: t.rounds.iter().map(|r| r.tuple).collect(),
            starts: t.rounds.iter().map(|r| r.start.name().to_string()).collect(),
            plan: t.plan.clone(),
            keyframes: t.frames.kept.len(),
            audio_clips: t.audio.kept.len(),
            exemplars: t.exemplars.iter().map(|e| e.0.clone()).collect(),
            notes: t.notes.iter().chain(&t.frames.notes).chain(&t.audio.notes).cloned().collect(),
            calls: t.totals.calls,
            prompt_tokens: t.totals.prompt_tokens,
            cached_tokens: t.totals.cached_tokens,
            generated_tokens: t.totals.generated_tokens,
            ms: t.totals.ms,
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ItemMetrics {
    /// Log-probs of the reply's tokens (corpus PPL needs the raw values).
    pub reply_logprobs: Vec<f32>,
    pub ppl: Option<f64>,
    /// 1 − |VADER compound(reply) − mean compound(history)|; 0 for an empty history.
    pub sentiment_polarity: f64,
    /// Classifier-based; None when no emotion classifier was configured.
    pub emotion_polarity: Option<f64>,
    pub empathy: Option<f64>,
    /// BERTScore (P, R, F1) against the reference; None when BERTScore is off.
    pub bertscore: Option<[f64; 3]>,
}
