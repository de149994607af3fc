//! IEMOCAP (Busso et al. 2008) from the standard release layout:
//! `Session{N}/dialog/transcriptions/{dialog}.txt`, `Session{N}/dialog/EmoEvaluation/{dialog}.txt`
//! and `Session{N}/dialog/avi/DivX/{dialog}.avi` (one recording per dialog, both speakers).
//!
//! Utterance ids look like `Ses01F_impro01_F000` or `Ses01M_script02_1_M012`: `Ses` + two-digit
//! session + the gender of the actor wearing the motion-capture markers in that recording,
//! then the dialog name, then the speaker's turn id whose first letter (F/M) is the speaker.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::{count_text_only, Item, LoadReport, Recording};
use crate::dialogue::{Dialogue, Turn};

/// The session held out for testing, as in the issue.
pub const TEST_SESSION: u32 = 5;
/// The session used as retrieval memory.
pub const MEMORY_SESSION: u32 = 2;

/// Raw IEMOCAP codes onto the `LabelSet::iemocap()` classes: hap and exc merge into happy;
/// everything else (xxx, oth, sur, fea, dis) has no class and is dropped as a target.
pub fn map_label(raw: &str) -> Option<&'static str> {
    match raw.trim().to_lowercase().as_str() {
        "neu" => Some("neutral"),
        "hap" | "exc" => Some("happy"),
        "sad" => Some("sad"),
        "ang" => Some("angry"),
        "fru" => Some("frustrated"),
        _ => None,
    }
}

/// One transcript line.
#[derive(Clone, Debug, PartialEq)]
pub struct Utterance {
    pub id: String,
    /// "F" or "M".
    pub speaker: String,
    pub start: f64,
    pub end: f64,
    pub text: String,
}

/// Parses `Ses01F_impro01_F000 [006.2901-008.2357]: Excuse me.`; `None` for any other line.
pub fn parse_transcript_line(line: &str) -> Option<Utterance> {
    let (id, rest) = line.trim().split_once(' ')?;
    let rest = rest.trim_start().strip_prefix('[')?;
    let (times, rest) = rest.split_once(']')?;
    let text = rest.trim_start().strip_prefix(':')?.trim();
    let (start, end) = times.split_once('-')?;
    let (start, end) = (start.trim().parse::<f64>().ok()?, end.trim().parse::<f64>().ok()?);
    Some(Utterance { speaker: speaker_of(id)?.to_string(), id: id.to_string(), start, end, text: text.to_string() })
}

/// The speaker letter of an utterance id: the first character of its last `_` part.
pub fn speaker_of(id: &str) -> Option<&'static str> {
    if !id.starts_with("Ses") {
        return None;
    }
    match id.rsplit('_').next()?.chars().next()? {
        'F' => Some("F"),
        'M' => Some("M"),
        _ => None,
    }
}

/// Parses an EmoEvaluation file into utterance id → raw label, from its summary lines
/// `[6.2901 - 8.2357]\tSes01F_impro01_F000\tneu\t[2.5000, 2.5000, 2.5000]` (the per-annotator
/// lines and the `%` header are ignored).
pub fn parse_evaluation(text: &str, file: &Path) -> Result<HashMap<String, String>> {
    let mut out = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let Some(rest) = line.trim().strip_prefix('[') else { continue };
        let Some((_, rest)) = rest.split_once(']') else { continue };
        let mut fields = rest.split_whitespace();
        let (Some(id), Some(label)) = (fields.next(), fields.next()) else {
            bail!("IEMOCAP {} line {}: expected `[start - end] id label [v, a, d]`, got {line:?}", file.display(), n + 1);
        };
        if out.insert(id.to_string(), label.to_string()).is_some() {
            bail!("IEMOCAP {} line {}: utterance {id} evaluated twice", file.display(), n + 1);
        }
    }
    Ok(out)
}

fn read_text(path: &Path) -> Result<String> {
    let bytes = crate::input::read(path, &crate::input::DATASET).context("IEMOCAP")?;
    // The release is ASCII; a stray Latin-1 byte must not stop a run.
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Loads every dialog of `root/Session{session}` (root is the folder holding `Session1`…
/// `Session5`, e.g. `IEMOCAP_full_release`). With `with_video`, each item carries the dialog's
/// recording when its `.avi` passes the cheap check.
pub fn load(root: &Path, session: u32, with_video: bool) -> Result<(Vec<Item>, LoadReport)> {
    let dialog = root.join(format!("Session{session}")).join("dialog");
    let tdir = dialog.join("transcriptions");
    let edir = dialog.join("EmoEvaluation");
    let vdir = dialog.join("avi").join("DivX");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&tdir)
        .with_context(|| format!("IEMOCAP session {session}: reading {}", tdir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "txt") && !p.file_name().is_some_and(|n| n.to_string_lossy().starts_with('.')))
        .collect();
    files.sort();
    if files.is_empty() {
        bail!("IEMOCAP session {session}: no transcription .txt files in {}", tdir.display());
    }
    if with_video {
        super::check_video_root(&vdir)?;
    }
    let mut report = LoadReport::default();
    let mut items = Vec::new();
    for tfile in files {
        let name = tfile.file_stem().expect("has extension").to_string_lossy().into_owned();
        let efile = edir.join(format!("{name}.txt"));
        let labels = parse_evaluation(&read_text(&efile)?, &efile)?;
        let mut utts = Vec::new();
        let mut seen = HashMap::new();
        for (n, line) in read_text(&tfile)?.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let Some(u) = parse_transcript_line(line) else {
                report.unparsed_lines += 1;
                continue;
            };
            if !u.id.starts_with(&format!("{name}_")) {
                bail!("IEMOCAP {} line {}: utterance {} does not belong to dialog {name}", tfile.display(), n + 1, u.id);
            }
            if let Some(first) = seen.insert(u.id.clone(), n + 1) {
                bail!("IEMOCAP {} line {}: utterance {} repeated (first on line {first})", tfile.display(), n + 1, u.id);
            }
            if u.text.is_empty() {
                report.empty_utterances += 1;
                continue;
            }
            utts.push(u);
        }
        report.sources.push(tfile.clone());
        report.sources.push(efile);
        report.utterances += utts.len();
        report.dialogues += 1;
        // Transcripts are mostly but not always in time order; the stable sort keeps file
        // order for equal start times.
        utts.sort_by(|a, b| a.start.total_cmp(&b.start));
        let video = if with_video { report.clip(&vdir.join(format!("{name}.avi"))) } else { None };
        items.extend(dialog_items(&utts, &labels, video, &mut report));
    }
    report.items = items.len();
    count_text_only(&items, &mut report);
    Ok((items, report))
}

fn dialog_items(utts: &[Utterance], labels: &HashMap<String, String>, video: Option<PathBuf>, report: &mut LoadReport) -> Vec<Item> {
    let turns: Vec<Turn> = utts
        .iter()
        .map(|u| Turn {
            speaker: u.speaker.clone(),
            text: u.text.clone(),
            video: None,
            frames: vec![],
            audio: None,
            emotion: labels.get(&u.id).and_then(|l| map_label(l)).map(str::to_string),
        })
        .collect();
    let mut items = Vec::new();
    for (i, u) in utts.iter().enumerate() {
        let Some(raw) = labels.get(&u.id) else {
            report.unlabeled_turns += 1;
            continue;
        };
        if i == 0 {
            report.first_turns += 1;
            continue;
        }
        let Some(gold) = map_label(raw) else {
            *report.skipped_labels.entry(raw.clone()).or_default() += 1;
            continue;
        };
        let key = format!("iemocap/{}", u.id);
        items.push(Item {
            dialogue: Dialogue { id: Some(key.clone()), turns: turns[..i].to_vec(), next_speaker: u.speaker.clone(), video: None, frames: vec![] },
            key,
            gold_emotion: gold.to_string(),
            reference: u.text.clone(),
            target_video: None,
            recording: video.clone().map(|path| Recording {
                path,
                turn_spans: utts[..i].iter().map(|t| (t.start, t.end)).collect(),
                target_span: (u.start, u.end),
            }),
        });
    }
    items
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transcript_lines() {
        let u = parse_transcript_line("Ses01F_impro01_F000 [006.2901-008.2357]: Excuse me.").unwrap();
        assert_eq!((u.speaker.as_str(), u.start, u.end, u.text.as_str()), ("F", 6.2901, 8.2357, "Excuse me."));
        let u = parse_transcript_line("Ses01M_script02_1_M012 [100.5-101.25]: Yeah [LAUGHTER]").unwrap();
        assert_eq!((u.id.as_str(), u.speaker.as_str()), ("Ses01M_script02_1_M012", "M"));
        assert_eq!(parse_transcript_line("Ses01F_impro01_MXX0 [1.0-2.0]: hm").unwrap().speaker, "M");
        assert!(parse_transcript_line("M: [BREATHING]").is_none());
        assert!(parse_transcript_line("Ses01F_impro01_X000 [1.0-2.0]: hm").is_none());
        assert!(parse_transcript_line("Ses01F_impro01_F000 [1.0]: hm").is_none());
    }

    #[test]
    fn labels_map_to_five_classes() {
        assert_eq!(map_label("exc"), Some("happy"));
        assert_eq!(map_label("hap"), Some("happy"));
        assert_eq!(map_label("fru"), Some("frustrated"));
        for raw in ["xxx", "oth", "sur", "fea", "dis"] {
            assert_eq!(map_label(raw), None);
        }
    }
}
