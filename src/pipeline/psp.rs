//! A3, pragmatic strategy planner (PSP): {goal, stance, tactic, tone}. Stance and tone come from
//! fixed inventories so plans can be counted per emotion (the paper's Fig. 3).
//! Prompt: prompts/psp.j2.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

pub const STANCES: [&str; 7] = ["supportive", "empathetic", "encouraging", "neutral", "apologetic", "assertive", "playful"];
pub const TONES: [&str; 8] = ["warm", "gentle", "calm", "cheerful", "enthusiastic", "serious", "sympathetic", "firm"];

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    pub goal: String,
    pub stance: String,
    pub tactic: String,
    pub tone: String,
}

pub fn schema(max_chars: usize) -> Value {
    let text = json!({"type": "string", "minLength": 1, "maxLength": max_chars});
    json!({
        "type": "object",
        "properties": {"goal": text, "stance": {"enum": STANCES}, "tactic": text, "tone": {"enum": TONES}},
        "required": ["goal", "stance", "tactic", "tone"],
        "additionalProperties": false
    })
}

impl Plan {
    pub fn render(&self) -> String {
        format!("goal: {}; stance: {}; tactic: {}; tone: {}", self.goal, self.stance, self.tactic, self.tone)
    }
}
