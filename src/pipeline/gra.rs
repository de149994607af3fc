//! A5, global reflection agent (GRA): audits A1..A4 in order (c1..c4, pass/fail with a
//! correction each). The earliest failing stage is where the pipeline re-runs from; the pass
//! flags form each round's selection tuple. Prompt: prompts/gra.j2.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::Stage;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Check {
    pub pass: bool,
    pub correction: String,
}

/// Field order = audit order.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    pub mpa: Check,
    pub caef: Check,
    pub psp: Check,
    pub sgrg: Check,
}

pub fn schema(max_chars: usize) -> Value {
    let check = json!({
        "type": "object",
        "properties": {"pass": {"type": "boolean"}, "correction": {"type": "string", "maxLength": max_chars}},
        "required": ["pass", "correction"],
        "additionalProperties": false
    });
    json!({
        "type": "object",
        "properties": {"mpa": check, "caef": check, "psp": check, "sgrg": check},
        "required": ["mpa", "caef", "psp", "sgrg"],
        "additionalProperties": false
    })
}

impl Verdict {
    pub fn check(&self, s: Stage) -> &Check {
        match s {
            Stage::Mpa => &self.mpa,
            Stage::Caef => &self.caef,
            Stage::Psp => &self.psp,
            Stage::Sgrg => &self.sgrg,
        }
    }

    /// (c1, c2, c3, c4); a stage that did not run (ablated) counts as passed.
    pub fn flags(&self, enabled: impl Fn(Stage) -> bool) -> [bool; 4] {
        Stage::ALL.map(|s| !enabled(s) || self.check(s).pass)
    }

    /// The earliest enabled stage that failed.
    pub fn earliest_fault(&self, enabled: impl Fn(Stage) -> bool) -> Option<Stage> {
        Stage::ALL.into_iter().find(|&s| enabled(s) && !self.check(s).pass)
    }
}
