//! A2, consistency-aware emotion forecaster (CAEF): reads the emotion of the words, of the
//! keyframes and (with audio) of the voice, judges whether they agree, and only then names the
//! reply's emotion from the dataset's label set (the field order makes the model reason before
//! it answers).
//! Prompt: prompts/caef.j2.

use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Forecast {
    pub text_emotion: String,
    pub visual_emotion: String,
    /// The emotion the voice suggests (a label or "none"); only asked for with audio clips.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audio_emotion: Option<String>,
    /// "agree", "conflict" or "no_visual" (with audio: of all the cues present).
    pub consistency: String,
    pub rationale: String,
    pub emotion: String,
}

/// Without audio clips exactly the schema of before hearing existed; with them the voice's
/// emotion comes between the visual one and the verdict on their agreement, and since a voice is
/// always there to agree or conflict with the words, "no_visual" is left only when keyframes
/// exist (they may show nothing useful).
pub fn schema(labels: &[String], n_frames: usize, n_audio: usize, max_chars: usize) -> Value {
    let with_none = || labels.iter().cloned().chain(["none".to_string()]).collect::<Vec<String>>();
    let (visual, consistency): (Vec<String>, Vec<&str>) = match (n_frames, n_audio) {
        (0, 0) => (vec!["none".into()], vec!["no_visual"]),
        (0, _) => (vec!["none".into()], vec!["agree", "conflict"]),
        _ => (with_none(), vec!["agree", "conflict", "no_visual"]),
    };
    if n_audio > 0 {
        return json!({
            "type": "object",
            "properties": {
                "text_emotion": {"enum": labels},
                "visual_emotion": {"enum": visual},
                "audio_emotion": {"enum": with_none()},
                "consistency": {"enum": consistency},
                "rationale": {"type": "string", "minLength": 1, "maxLength": max_chars},
                "emotion": {"enum": labels}
            },
            "required": ["text_emotion", "visual_emotion", "audio_emotion", "consistency", "rationale", "emotion"],
            "additionalProperties": false
        });
    }
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
        if let Some(a) = &self.audio_emotion {
            return format!(
                "{} (text suggests {}, keyframes suggest {}, the voice suggests {}: {}; {})",
                self.emotion, self.text_emotion, self.visual_emotion, a, self.consistency, self.rationale
            );
        }
        format!(
            "{} (text suggests {}, keyframes suggest {}: {}; {})",
            self.emotion, self.text_emotion, self.visual_emotion, self.consistency, self.rationale
        )
    }
}
