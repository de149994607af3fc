//! Evaluation datasets as `Dialogue`s: one `Item` per response target (an utterance with at
//! least one earlier turn in its dialogue), the earlier turns as history, the target's speaker
//! as the reply's speaker, its text as the reference reply and its label as the gold emotion.
//!
//! Loaders never drop data silently: every row or utterance that does not become an item, and
//! every clip that could not be used, is counted in the `LoadReport`. Structural problems
//! (missing columns, unknown labels, duplicate ids, an unreadable video root) are errors naming
//! the file, line and column. See docs/EVALUATION.md.

pub mod iemocap;
pub mod labels;
pub mod meld;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Result};
use serde::Serialize;

use crate::dialogue::Dialogue;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Item {
    /// Stable, unique: `meld/{split}/dia{D}_utt{U}` or `iemocap/{utterance id}`.
    pub key: String,
    /// History (earlier turns, oldest first, with their annotated emotions) and the target's
    /// speaker as `next_speaker`. `dialogue.id` is `Some(key)`.
    pub dialogue: Dialogue,
    /// The target utterance's label, canonical in the dataset's `LabelSet`.
    pub gold_emotion: String,
    /// The target utterance's text: the reference reply.
    pub reference: String,
    /// The target utterance's own clip (MELD), when it exists and passed the cheap check.
    pub target_video: Option<PathBuf>,
    /// One recording of the whole dialogue (IEMOCAP) with the time spans of the turns. It
    /// also holds the target and later turns: cut it at `target_span.0` before showing it to a
    /// model. Not put in `dialogue.video` for that reason.
    pub recording: Option<Recording>,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Recording {
    pub path: PathBuf,
    /// (start, end) seconds of each history turn, aligned with `dialogue.turns`.
    pub turn_spans: Vec<(f64, f64)>,
    /// (start, end) seconds of the target utterance.
    pub target_span: (f64, f64),
}

/// What a loader read and what it left out, so no count is silently wrong.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct LoadReport {
    /// Files read.
    pub sources: Vec<PathBuf>,
    /// Utterance rows / transcript lines that parsed.
    pub utterances: usize,
    pub dialogues: usize,
    pub items: usize,
    /// Utterances that open their dialogue (nothing to answer yet): not targets.
    pub first_turns: usize,
    /// Utterances whose text is empty after trimming: dropped from history and targets.
    pub empty_utterances: usize,
    /// Targets dropped because their label is outside the label set, by raw label.
    pub skipped_labels: BTreeMap<String, usize>,
    /// Transcript turns without any emotion annotation (IEMOCAP): history only.
    pub unlabeled_turns: usize,
    /// Transcript lines that are not utterances (IEMOCAP), skipped.
    pub unparsed_lines: usize,
    /// Rows whose text held cp1252-as-C1 mojibake and were repaired (MELD pre-2020 files).
    pub repaired_rows: usize,
    /// Clips (one per utterance or recording) checked under the video root.
    pub clips_found: usize,
    pub clips_missing: usize,
    pub clips_corrupt: usize,
    /// The first few clip problems, "path: reason".
    pub clip_problems: Vec<String>,
    /// Items with no usable video at all (history and target): they run text-only.
    pub text_only_items: usize,
}

const MAX_LISTED_PROBLEMS: usize = 20;

impl LoadReport {
    fn clip(&mut self, path: &Path) -> Option<PathBuf> {
        match check_clip(path) {
            ClipStatus::Ok => {
                self.clips_found += 1;
                Some(path.to_path_buf())
            }
            ClipStatus::Missing => {
                self.clips_missing += 1;
                self.note_problem(path, "missing");
                None
            }
            ClipStatus::Corrupt(why) => {
                self.clips_corrupt += 1;
                self.note_problem(path, &why);
                None
            }
        }
    }

    fn note_problem(&mut self, path: &Path, why: &str) {
        if self.clip_problems.len() < MAX_LISTED_PROBLEMS {
            self.clip_problems.push(format!("{}: {why}", path.display()));
        }
    }

    /// One line for logs.
    pub fn summary(&self) -> String {
        let skipped: usize = self.skipped_labels.values().sum();
        format!(
            "{} items from {} utterances in {} dialogues ({} first turns, {} empty, {} skipped labels {:?}, {} unlabeled, {} unparsed lines, {} repaired rows); clips: {} found, {} missing, {} corrupt; {} items text-only",
            self.items,
            self.utterances,
            self.dialogues,
            self.first_turns,
            self.empty_utterances,
            skipped,
            self.skipped_labels,
            self.unlabeled_turns,
            self.unparsed_lines,
            self.repaired_rows,
            self.clips_found,
            self.clips_missing,
            self.clips_corrupt,
            self.text_only_items
        )
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum ClipStatus {
    Ok,
    Missing,
    Corrupt(String),
}

/// A cheap validity check (no decoding): the file exists, is non-empty, and starts like an MP4
/// (an ISO-BMFF box type at bytes 4..8) or an AVI (`RIFF....AVI `). Clips that pass can still
/// fail to decode; the pipeline handles that.
pub fn check_clip(path: &Path) -> ClipStatus {
    let meta = match std::fs::metadata(path) {
        Ok(m) if m.is_file() => m,
        Ok(_) => return ClipStatus::Corrupt("not a regular file".into()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return ClipStatus::Missing,
        Err(e) => return ClipStatus::Corrupt(format!("unreadable: {e}")),
    };
    if meta.len() == 0 {
        return ClipStatus::Corrupt("empty file".into());
    }
    let mut head = [0u8; 12];
    let n = match std::fs::File::open(path).and_then(|mut f| read_up_to(&mut f, &mut head)) {
        Ok(n) => n,
        Err(e) => return ClipStatus::Corrupt(format!("unreadable: {e}")),
    };
    if n < 12 {
        return ClipStatus::Corrupt(format!("only {n} bytes"));
    }
    const MP4_BOXES: [&[u8; 4]; 7] = [b"ftyp", b"moov", b"mdat", b"free", b"skip", b"wide", b"pnot"];
    let is_mp4 = MP4_BOXES.iter().any(|b| &head[4..8] == *b);
    let is_avi = &head[0..4] == b"RIFF" && &head[8..12] == b"AVI ";
    if is_mp4 || is_avi {
        ClipStatus::Ok
    } else {
        ClipStatus::Corrupt("header is neither MP4 nor AVI".into())
    }
}

fn read_up_to(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        let k = f.read(&mut buf[n..])?;
        if k == 0 {
            break;
        }
        n += k;
    }
    Ok(n)
}

/// A video root given by the user must be a readable directory: a typo must not turn a whole
/// run text-only.
fn check_video_root(root: &Path) -> Result<()> {
    match std::fs::read_dir(root) {
        Ok(_) => Ok(()),
        Err(e) => bail!("video root {}: not a readable directory ({e})", root.display()),
    }
}

/// Marks items whose history and target have no video at all.
fn count_text_only(items: &[Item], report: &mut LoadReport) {
    report.text_only_items = items
        .iter()
        .filter(|it| {
            it.target_video.is_none()
                && it.recording.is_none()
                && it.dialogue.video.is_none()
                && it.dialogue.turns.iter().all(|t| t.video.is_none())
        })
        .count();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clip_check_is_cheap_but_catches_obvious_defects() {
        let dir = tempfile::tempdir().unwrap();
        let p = |n: &str| dir.path().join(n);
        std::fs::write(p("ok.mp4"), b"\0\0\0\x20ftypisom\0\0\x02\0").unwrap();
        std::fs::write(p("ok.avi"), b"RIFF\x10\0\0\0AVI LIST").unwrap();
        std::fs::write(p("empty.mp4"), b"").unwrap();
        std::fs::write(p("text.mp4"), b"<html>not found</html>").unwrap();
        std::fs::write(p("short.mp4"), b"\0\0").unwrap();
        assert_eq!(check_clip(&p("ok.mp4")), ClipStatus::Ok);
        assert_eq!(check_clip(&p("ok.avi")), ClipStatus::Ok);
        assert_eq!(check_clip(&p("none.mp4")), ClipStatus::Missing);
        assert!(matches!(check_clip(&p("empty.mp4")), ClipStatus::Corrupt(w) if w.contains("empty")));
        assert!(matches!(check_clip(&p("text.mp4")), ClipStatus::Corrupt(_)));
        assert!(matches!(check_clip(&p("short.mp4")), ClipStatus::Corrupt(_)));
        assert!(matches!(check_clip(dir.path()), ClipStatus::Corrupt(_)));
        assert!(check_video_root(&p("absent")).is_err());
        assert!(check_video_root(dir.path()).is_ok());
    }
}
