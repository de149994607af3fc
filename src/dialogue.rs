//! The input MERG answers: speaker-tagged turns ending with the turn to answer, the name of the
//! next speaker, and where the speaker's video is. Shared by `merg respond` (JSON files) and the
//! dataset loaders (MELD, IEMOCAP), so both feed the pipeline the same thing.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    pub speaker: String,
    #[serde(alias = "utterance", alias = "Utterance")]
    pub text: String,
    /// Video clip of this turn (MELD ships one mp4 per utterance).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub video: Option<PathBuf>,
    /// Keyframe images of this turn, in time order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frames: Vec<PathBuf>,
    /// Audio file of this turn (WAV, FLAC, MP3, …); without it the clip's audio track serves.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub audio: Option<PathBuf>,
    /// The turn's annotated emotion, when the source has one (never given to the agents for
    /// the turn being answered).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub emotion: Option<String>,
}

impl Turn {
    pub fn new(speaker: impl Into<String>, text: impl Into<String>) -> Self {
        Turn { speaker: speaker.into(), text: text.into(), video: None, frames: vec![], audio: None, emotion: None }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Dialogue {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub id: Option<String>,
    /// History, oldest first; the last turn is the one the reply answers.
    pub turns: Vec<Turn>,
    /// Who speaks the reply.
    pub next_speaker: String,
    /// One video covering the whole history (alternative to per-turn clips).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub video: Option<PathBuf>,
    /// Keyframes for the whole history (alternative to per-turn frames).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub frames: Vec<PathBuf>,
}

/// A MELD-style CSV row written as JSON (`Speaker`, `Utterance`, optional `Emotion`).
#[derive(Deserialize)]
struct MeldRow {
    #[serde(rename = "Speaker", alias = "speaker")]
    speaker: String,
    #[serde(rename = "Utterance", alias = "utterance")]
    utterance: String,
    #[serde(rename = "Emotion", alias = "emotion", default)]
    emotion: Option<String>,
}

/// `{"rows": [...], "next_speaker": ...}`; a bare row list is also accepted (the reply's
/// speaker is then the one who spoke before the last turn, as in a two-party exchange).
#[derive(Deserialize)]
struct RowsFile {
    rows: Vec<MeldRow>,
    next_speaker: Option<String>,
}

impl Dialogue {
    /// Reads a dialogue JSON file; relative media paths are taken relative to the file.
    pub fn from_json_file(path: &Path) -> Result<Dialogue> {
        let text = crate::input::read_string(path, &crate::input::DIALOGUE)?;
        let mut d = Self::from_json_str(&text).with_context(|| format!("dialogue {}", path.display()))?;
        let base = path.parent().unwrap_or(Path::new("."));
        d.resolve_paths(base);
        Ok(d)
    }

    /// Parses the three accepted shapes, chosen by the JSON's own shape (not by trying each,
    /// so an error names the field and the expected type of the shape the file has).
    pub fn from_json_str(text: &str) -> Result<Dialogue> {
        const SHAPES: &str =
            "expected {\"turns\": [{\"speaker\", \"text\"}…], \"next_speaker\"}, {\"rows\": [MELD rows], \"next_speaker\"} or a list of MELD rows {\"Speaker\", \"Utterance\"}";
        let v: serde_json::Value = serde_json::from_str(text).with_context(|| format!("not valid JSON; {SHAPES}"))?;
        fn typed<T: serde::de::DeserializeOwned>(v: serde_json::Value) -> Result<T> {
            serde_path_to_error::deserialize(v).map_err(|e| {
                let path = e.path().to_string();
                anyhow::anyhow!("{}: {}", if path == "." { "top level".into() } else { path }, e.into_inner())
            })
        }
        let d = match &v {
            serde_json::Value::Array(_) => from_rows(typed(v)?, None)?,
            serde_json::Value::Object(o) if o.contains_key("rows") => {
                let r: RowsFile = typed(v)?;
                from_rows(r.rows, r.next_speaker)?
            }
            serde_json::Value::Object(_) => typed::<Dialogue>(v)?,
            _ => bail!("the top level is neither an object nor a list; {SHAPES}"),
        };
        d.validate()?;
        Ok(d)
    }

    pub fn resolve_paths(&mut self, base: &Path) {
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = base.join(&*p);
            }
        };
        self.video.iter_mut().for_each(fix);
        self.frames.iter_mut().for_each(fix);
        for t in &mut self.turns {
            t.video.iter_mut().for_each(fix);
            t.frames.iter_mut().for_each(fix);
            t.audio.iter_mut().for_each(fix);
        }
    }

    /// Structural checks every consumer relies on.
    pub fn validate(&self) -> Result<()> {
        if self.turns.is_empty() {
            bail!("the dialogue history is empty: at least one turn is needed to answer");
        }
        for (i, t) in self.turns.iter().enumerate() {
            if t.speaker.trim().is_empty() {
                bail!("turn {}: empty speaker name", i + 1);
            }
            // An empty path would resolve to the dialogue's own directory.
            if t.audio.as_ref().is_some_and(|p| p.as_os_str().is_empty()) {
                bail!("turn {}: \"audio\" is an empty path", i + 1);
            }
        }
        if self.next_speaker.trim().is_empty() {
            bail!("next_speaker is empty: name who speaks the reply");
        }
        Ok(())
    }

    /// Whether the reply's speaker appears in the history (a new speaker is allowed — MELD has
    /// them — and the trace says so).
    pub fn next_speaker_is_known(&self) -> bool {
        self.turns.iter().any(|t| t.speaker == self.next_speaker)
    }

    pub fn last(&self) -> &Turn {
        self.turns.last().expect("validated: non-empty")
    }
}

fn from_rows(rows: Vec<MeldRow>, next_speaker: Option<String>) -> Result<Dialogue> {
    let turns: Vec<Turn> = rows
        .into_iter()
        .map(|r| Turn { speaker: r.speaker, text: r.utterance, video: None, frames: vec![], audio: None, emotion: r.emotion })
        .collect();
    let next_speaker = match next_speaker {
        Some(s) => s,
        None => {
            let last = turns.last().map(|t| t.speaker.clone()).unwrap_or_default();
            turns
                .iter()
                .rev()
                .map(|t| &t.speaker)
                .find(|s| **s != last)
                .cloned()
                .context("no next_speaker given and only one speaker in the rows: add \"next_speaker\"")?
        }
    };
    Ok(Dialogue { id: None, turns, next_speaker, video: None, frames: vec![] })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_and_row_forms_agree() {
        let full = r#"{"turns":[{"speaker":"Ross","text":"Hi."},{"speaker":"Rachel","text":"Oh no."}],"next_speaker":"Ross"}"#;
        let rows = r#"[{"Speaker":"Ross","Utterance":"Hi."},{"Speaker":"Rachel","Utterance":"Oh no."}]"#;
        let a = Dialogue::from_json_str(full).unwrap();
        let b = Dialogue::from_json_str(rows).unwrap();
        assert_eq!(a.turns, b.turns);
        assert_eq!(b.next_speaker, "Ross");
    }

    #[test]
    fn a_turns_audio_is_read_and_resolved_beside_the_file() {
        let text = r#"{"turns":[{"speaker":"A","text":"Hi.","audio":"a/1.flac"},{"speaker":"B","text":"Oh."}],"next_speaker":"A"}"#;
        let mut d = Dialogue::from_json_str(text).unwrap();
        d.resolve_paths(Path::new("/data/d1"));
        assert_eq!(d.turns[0].audio.as_deref(), Some(Path::new("/data/d1/a/1.flac")));
        assert_eq!(d.turns[1].audio, None);
        let e = Dialogue::from_json_str(r#"{"turns":[{"speaker":"A","text":"x","audio":""}],"next_speaker":"B"}"#).unwrap_err();
        assert!(e.to_string().contains("turn 1: \"audio\" is an empty path"), "{e}");
        let e = Dialogue::from_json_str(r#"{"turns":[{"speaker":"A","text":"x","audio":3}],"next_speaker":"B"}"#).unwrap_err();
        assert!(e.to_string().contains("turns[0].audio"), "{e}");
    }

    #[test]
    fn empty_history_is_an_error() {
        let e = Dialogue::from_json_str(r#"{"turns":[],"next_speaker":"A"}"#).unwrap_err();
        assert!(format!("{e:#}").contains("history is empty"), "{e:#}");
        let e = Dialogue::from_json_str(r#"[{"Speaker":"A","Utterance":"x"}]"#).unwrap_err();
        assert!(format!("{e:#}").contains("next_speaker"), "{e:#}");
    }
}
