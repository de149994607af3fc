//! The five-agent MERG pipeline (arXiv 2604.18988), training-free: one loaded model plays
//! every agent through its own prompt, on the engine's shared KV pool.
//!
//! - `frames`: keyframes from per-turn clips / frames or one dialogue video, capped and fitted.
//! - `hearing`: one audio clip per turn (its audio file, its clip's track, or a recording's
//!   span), capped, cut to the model's audio window and fitted with the keyframes.
//! - `prompt`: templates in `prompts/` and the shared prefix (system, dialogue, keyframes).
//! - `mpa`, `caef`, `psp`, `sgrg`, `gra`: one agent each — output type and JSON schema.
//! - `retrieval`: BM25 exemplar memory for SGRG.
//! - `orchestrate`: rounds, reflection, re-runs from the earliest faulty stage, selection;
//!   plus the one-pass baselines.
//! - `model`: the `AgentModel` interface (the engine, or a test double); `trace`: what a run
//!   records.

pub mod caef;
pub mod frames;
pub mod gra;
pub mod hearing;
pub mod model;
pub mod mpa;
pub mod orchestrate;
pub mod prompt;
pub mod psp;
pub mod retrieval;
pub mod sgrg;
pub mod trace;

use serde::{Deserialize, Serialize};

use crate::generate::SamplingParams;

pub use orchestrate::Pipeline;
pub use trace::Trace;

/// The four audited stages, in pipeline (and audit) order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    Mpa,
    Caef,
    Psp,
    Sgrg,
}

impl Stage {
    pub const ALL: [Stage; 4] = [Stage::Mpa, Stage::Caef, Stage::Psp, Stage::Sgrg];

    pub fn name(self) -> &'static str {
        match self {
            Stage::Mpa => "mpa",
            Stage::Caef => "caef",
            Stage::Psp => "psp",
            Stage::Sgrg => "sgrg",
        }
    }
}

/// Cascaded: each agent sees the outputs of the agents before it. Independent: each sees only
/// the raw input (dialogue, keyframes; SGRG still gets its exemplars).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    Cascaded,
    Independent,
}

/// One-pass baselines instead of the agents.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Baseline {
    /// A plain "write the next empathetic turn" prompt.
    Plain,
    /// Chain-of-Empathy (event → emotion → cause → intent → reply) in one generation.
    Coe,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PipelineConfig {
    pub use_mpa: bool,
    pub use_caef: bool,
    pub use_psp: bool,
    pub use_gra: bool,
    pub mode: Mode,
    /// Refinement rounds after the first pass.
    pub t_max: usize,
    /// Exemplars retrieved for SGRG.
    pub top_k: usize,
    /// Final reply by the (c1, c2, c3, c4, −t) rule; off = the last round's reply.
    pub selection: bool,
    pub baseline: Option<Baseline>,
    /// The label set the forecast must come from.
    pub labels: Vec<String>,
    /// Per-call sampling; each call's seed is derived from `sampling.seed`, round and agent.
    pub sampling: SamplingParams,
    /// Length cap of free-text fields in agent outputs (characters).
    pub max_field_chars: usize,
    /// Give the turns' audio to a model that hears (off: text and keyframes only).
    #[serde(default = "yes")]
    pub use_audio: bool,
}

fn yes() -> bool {
    true
}

impl Default for PipelineConfig {
    fn default() -> Self {
        PipelineConfig {
            use_mpa: true,
            use_caef: true,
            use_psp: true,
            use_gra: true,
            mode: Mode::Cascaded,
            t_max: 2,
            top_k: 1,
            selection: true,
            baseline: None,
            labels: crate::data::labels::LabelSet::meld().labels,
            sampling: SamplingParams { temperature: 0.7, top_p: 0.9, max_new_tokens: 256, ..Default::default() },
            max_field_chars: 160,
            use_audio: true,
        }
    }
}

impl PipelineConfig {
    pub fn enabled(&self, s: Stage) -> bool {
        match s {
            Stage::Mpa => self.use_mpa,
            Stage::Caef => self.use_caef,
            Stage::Psp => self.use_psp,
            Stage::Sgrg => true,
        }
    }

    /// Whether the final reply is chosen by (c1, c2, c3, c4, −t); otherwise the last round's.
    pub fn selects_by_tuple(&self) -> bool {
        self.selection && self.use_gra && self.baseline.is_none()
    }

    /// Each value against its rule; the error names the field (`top_k` is the exemplar count).
    pub fn validate(&self) -> Result<(), crate::setting::InvalidSetting> {
        use crate::setting::{at_least_one, at_most, check};
        at_most("t_max", self.t_max, 5)?;
        at_most("top_k", self.top_k, 5)?;
        check(self.labels.len() >= 2, "labels", self.labels.join(","), "at least two labels")?;
        at_least_one("max_field_chars", self.max_field_chars)?;
        self.sampling.validate()
    }
}
