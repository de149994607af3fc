//! What one `respond` records: inputs, every agent call of every round, GRA verdicts, re-runs,
//! selection tuples, the final choice, token counts, prefix-cache hits and timings. Written as
//! JSON by `merg respond --trace` and summarised per item by `merg eval`.

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::caef::Forecast;
use super::frames::FrameReport;
use super::hearing::AudioReport;
use super::gra::Verdict;
use super::mpa::Evidence;
use super::psp::Plan;
use super::{PipelineConfig, Stage};
use crate::generate::FinishReason;

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct AgentRecord {
    pub agent: String,
    pub round: usize,
    /// Upstream outputs this call was given (cascaded mode), e.g. ["mpa", "caef"].
    pub upstream: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub correction: Option<String>,
    #[serde(skip_serializing_if = "Vec::is_empty", default)]
    pub exemplars: Vec<String>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    pub finish: FinishReason,
    pub ms: f64,
    /// The parsed output, or null when it did not parse (see `error`).
    pub output: Option<Value>,
    pub raw: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RoundRecord {
    pub round: usize,
    /// Stage this round started from (round 0: the first enabled stage).
    pub start: Stage,
    /// Why it re-ran: the GRA correction that caused it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub calls: Vec<AgentRecord>,
    pub evidence: Option<Evidence>,
    pub forecast: Option<Forecast>,
    pub plan: Option<Plan>,
    pub reply: String,
    /// Model log-probs of the tokens of the reply text (not the JSON wrapper or stop token),
    /// for perplexity.
    pub reply_logprobs: Vec<f32>,
    pub verdict: Option<Verdict>,
    /// (c1, c2, c3, c4) of this round; all false when GRA gave no verdict.
    pub tuple: [bool; 4],
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct Totals {
    pub calls: usize,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub generated_tokens: usize,
    pub ms: f64,
}

impl Totals {
    pub fn add(&mut self, r: &AgentRecord) {
        self.calls += 1;
        self.prompt_tokens += r.prompt_tokens;
        self.cached_tokens += r.cached_tokens;
        self.generated_tokens += r.generated_tokens;
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Trace {
    pub dialogue_id: Option<String>,
    pub next_speaker: String,
    pub turns: usize,
    pub config: PipelineConfig,
    pub frames: FrameReport,
    /// The audio clips the agents heard, and what was dropped, cut or ignored (hearing off, a
    /// model without ears).
    #[serde(default)]
    pub audio: AudioReport,
    /// Fallbacks taken and anything unusual about the input.
    pub notes: Vec<String>,
    /// Retrieved exemplars (key, BM25 score).
    pub exemplars: Vec<(String, f64)>,
    pub rounds: Vec<RoundRecord>,
    pub selected_round: usize,
    pub selection_rule: String,
    pub reply: String,
    pub emotion: Option<String>,
    pub plan: Option<Plan>,
    pub reply_logprobs: Vec<f32>,
    pub totals: Totals,
}
