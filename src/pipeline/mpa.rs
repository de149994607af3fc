//! A1, multimodal perception (MPA): concrete textual, visual and (with audio) acoustic evidence,
//! each cue tied to the turn, keyframe or audio clip it comes from. Prompt: prompts/mpa.j2.

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

/// Tone, loudness, pace, laughter, sighs heard in one audio clip.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AcousticCue {
    pub clip: usize,
    pub cue: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Evidence {
    pub textual_cues: Vec<TextCue>,
    pub visual_cues: Vec<VisualCue>,
    /// Only asked for when the dialogue has audio clips.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub acoustic_cues: Vec<AcousticCue>,
}

/// Turn, frame and clip numbers are bounded by what exists, so every cue points somewhere
/// real. Without audio the schema has no acoustic cues at all (as before hearing existed).
pub fn schema(n_turns: usize, n_frames: usize, n_audio: usize, max_chars: usize) -> Value {
    let cue = json!({"type": "string", "minLength": 1, "maxLength": max_chars});
    let mut s = json!({
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
    });
    if n_audio > 0 {
        s["properties"]["acoustic_cues"] = json!({"type": "array", "maxItems": 3, "items": {
            "type": "object",
            "properties": {"clip": {"type": "integer", "minimum": 1, "maximum": n_audio}, "cue": cue},
            "required": ["clip", "cue"], "additionalProperties": false}});
        s["required"] = json!(["textual_cues", "visual_cues", "acoustic_cues"]);
    }
    s
}

impl Evidence {
    /// How downstream prompts show it: one cue per line with its source.
    pub fn render(&self) -> String {
        let t = self.textual_cues.iter().map(|c| format!("- [T{}] {}", c.turn, c.cue));
        let v = self.visual_cues.iter().map(|c| format!("- [F{}] {}", c.frame, c.cue));
        let a = self.acoustic_cues.iter().map(|c| format!("- [A{}] {}", c.clip, c.cue));
        t.chain(v).chain(a).collect::<Vec<_>>().join("\n")
    }
}
