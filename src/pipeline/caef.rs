//! A2, consistency-aware emotion forecaster (CAEF): reads the emotion of the words and of the
//! keyframes, judges whether they agree, and only then names the reply's emotion from the
//! dataset's label set (the field order makes the model reason before it answers).
//! Prompt: prompts/caef.j2.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Forecast {
    pub text_emotion: String,
    pub visual_emotion: String,
    /// "agree", "conflict" or "no_visual".
    pub consistency: String,
    pub rationale: String,
    pub emotion: String,
}

pub fn schema(labels: &[String], n_frames: usize, max_chars: usize) -> Value {
    let (visual, consistency): (Vec<String>, Vec<&str>) = if n_frames == 0 {
        (vec!["none".into()], vec!["no_visual"])
    } else {
        (labels.iter().cloned().chain(["none".to_string()]).collect(), vec!["agree", "conflict", "no_visual"])
    };
    json!({
        "type": "object",
        "properties": {
            "text_emotion": {"enum": labels},
            "visual_emotion": {"enum": visual},
            "consistency": {"enum": consistency},
            "rationale": {"type": "string", "minLength": 1, "maxLength": max_chars},
            "emotion": {"enum": labels}
        },
        "required": ["text_emotion", "visual_emotion", "consistency", "rationale", "emotion"],
        "additionalProperties": false
    })
}

impl Forecast {
    pub fn render(&self) -> String {
        format!(
            "{} (text suggests {}, keyframes suggest {}: {}; {})",
            self.emotion, self.text_emotion, self.visual_emotion, self.consistency, self.rationale
        )
    }
}
