//! A1, multimodal perception (MPA): concrete textual and visual evidence, each cue tied to the
//! turn or keyframe it comes from. Prompt: prompts/mpa.j2.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TextCue {
    pub turn: usize,
    pub cue: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct VisualCue {
    pub frame: usize,
    pub cue: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Evidence {
    pub textual_cues: Vec<TextCue>,
    pub visual_cues: Vec<VisualCue>,
}

/// Turn and frame numbers are bounded by what exists, so every cue points somewhere real.
pub fn schema(n_turns: usize, n_frames: usize, max_chars: usize) -> Value {
    let cue = json!({"type": "string", "minLength": 1, "maxLength": max_chars});
    json!({
        "type": "object",
        "properties": {
            "textual_cues": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                "type": "object",
                "properties": {"turn": {"type": "integer", "minimum": 1, "maximum": n_turns.max(1)}, "cue": cue},
                "required": ["turn", "cue"], "additionalProperties": false}},
            "visual_cues": {"type": "array", "maxItems": if n_frames == 0 { 0 } else { 3 }, "items": {
                "type": "object",
                "properties": {"frame": {"type": "integer", "minimum": 1, "maximum": n_frames.max(1)}, "cue": cue},
                "required": ["frame", "cue"], "additionalProperties": false}}
        },
        "required": ["textual_cues", "visual_cues"],
        "additionalProperties": false
    })
}

impl Evidence {
    /// How downstream prompts show it: one cue per line with its source.
    pub fn render(&self) -> String {
        let t = self.textual_cues.iter().map(|c| format!("- [T{}] {}", c.turn, c.cue));
        let v = self.visual_cues.iter().map(|c| format!("- [F{}] {}", c.frame, c.cue));
        t.chain(v).collect::<Vec<_>>().join("\n")
    }
}
