//! MELD (Poria et al. 2019) from its official `{train,dev,test}_sent_emo.csv` files, clean or
//! pre-2020 mojibake (both read to identical text), with optional per-utterance clips
//! `dia{D}_utt{U}.mp4`.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use anyhow::{bail, Context, Result};

use super::labels::LabelSet;
use super::{check_video_root, count_text_only, Item, LoadReport};
use crate::dialogue::{Dialogue, Turn};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Split {
    Train,
    Dev,
    Test,
}

impl Split {
    pub fn name(self) -> &'static str {
        match self {
            Split::Train => "train",
            Split::Dev => "dev",
            Split::Test => "test",
        }
    }

    pub fn csv_name(self) -> String {
        format!("{}_sent_emo.csv", self.name())
    }

    /// The clip folder of this split in the MELD release.
    pub fn video_subdir(self) -> &'static str {
        match self {
            Split::Train => "train_splits",
            Split::Dev => "dev_splits_complete",
            Split::Test => "output_repeated_splits_test",
        }
    }
}

impl FromStr for Split {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_lowercase().as_str() {
            "train" => Ok(Split::Train),
            "dev" | "val" | "valid" | "validation" => Ok(Split::Dev),
            "test" => Ok(Split::Test),
            _ => Err(crate::setting::InvalidSetting::new("split", s, "train, dev or test (MELD's splits)").into()),
        }
    }
}

/// One CSV row, text repaired (see `repair_mojibake`), not otherwise altered.
#[derive(Clone, Debug, PartialEq)]
pub struct Row {
    /// 1-based line of the row in its file (header = line 1).
    pub line: u64,
    pub dialogue_id: u32,
    pub utterance_id: u32,
    pub speaker: String,
    pub utterance: String,
    pub emotion: String,
    pub sentiment: Option<String>,
}

const REQUIRED: [&str; 5] = ["Utterance", "Speaker", "Emotion", "Dialogue_ID", "Utterance_ID"];

/// Loads `dir/{split}_sent_emo.csv`. `video_root` is the split's clip folder, or a MELD
/// release folder holding it under its standard name (`Split::video_subdir`).
pub fn load(dir: &Path, split: Split, video_root: Option<&Path>) -> Result<(Vec<Item>, LoadReport)> {
    let video_dir = video_root.map(|r| {
        let sub = r.join(split.video_subdir());
        if sub.is_dir() {
            sub
        } else {
            r.to_path_buf()
        }
    });
    load_csv(&dir.join(split.csv_name()), split.name(), video_dir.as_deref())
}

/// Loads one MELD-format CSV; `split_name` goes into the item keys, clips are looked up
/// directly in `video_dir`.
pub fn load_csv(path: &Path, split_name: &str, video_dir: Option<&Path>) -> Result<(Vec<Item>, LoadReport)> {
    if let Some(v) = video_dir {
        check_video_root(v)?;
    }
    let mut report = LoadReport { sources: vec![path.to_path_buf()], ..Default::default() };
    let rows = read_rows(path, &mut report)?;
    report.utterances = rows.len();

    let mut dialogues: BTreeMap<u32, Vec<Row>> = BTreeMap::new();
    for r in rows {
        dialogues.entry(r.dialogue_id).or_default().push(r);
    }
    report.dialogues = dialogues.len();

    let mut items = Vec::new();
    for (dia, mut rows) in dialogues {
        // Row order in the file is not trusted (Sr No. is unsorted in train); ids have gaps.
        rows.sort_by_key(|r| r.utterance_id);
        let clips: Vec<Option<PathBuf>> = rows
            .iter()
            .map(|r| video_dir.and_then(|v| report.clip(&v.join(format!("dia{dia}_utt{}.mp4", r.utterance_id)))))
            .collect();
        let turns: Vec<Turn> = rows
            .iter()
            .zip(&clips)
            .map(|(r, clip)| Turn {
                speaker: r.speaker.clone(),
                text: r.utterance.clone(),
                video: clip.clone(),
                frames: vec![],
                audio: None,
                emotion: Some(r.emotion.clone()),
            })
            .collect();
        report.first_turns += usize::from(!rows.is_empty());
        for i in 1..rows.len() {
            let t = &rows[i];
            let key = format!("meld/{split_name}/dia{dia}_utt{}", t.utterance_id);
            items.push(Item {
                dialogue: Dialogue {
                    id: Some(key.clone()),
                    turns: turns[..i].to_vec(),
                    next_speaker: t.speaker.clone(),
                    video: None,
                    frames: vec![],
                },
                key,
                gold_emotion: t.emotion.clone(),
                reference: t.utterance.clone(),
                target_video: clips[i].clone(),
                recording: None,
            });
        }
    }
    report.items = items.len();
    count_text_only(&items, &mut report);
    Ok((items, report))
}

/// Reads and validates every row: required columns present, ids numeric, labels in MELD's
/// seven, no duplicate (dialogue, utterance) ids. Empty utterances are dropped and counted.
pub fn read_rows(path: &Path, report: &mut LoadReport) -> Result<Vec<Row>> {
    let f = crate::input::open(path, &crate::input::DATASET).context("MELD")?;
    read_rows_from(f, &path.display().to_string(), report)
}

/// As `read_rows`, from any reader; `file` names it in errors.
pub fn read_rows_from<R: std::io::Read>(reader: R, file: &str, report: &mut LoadReport) -> Result<Vec<Row>> {
    let mut rdr = csv::ReaderBuilder::new().has_headers(true).from_reader(reader);
    let headers = rdr.headers().with_context(|| format!("MELD {file}: reading the header"))?.clone();
    let names: Vec<String> = headers.iter().map(|h| h.trim_start_matches('\u{feff}').trim().to_string()).collect();
    let col = |name: &str| names.iter().position(|h| h == name);
    let missing: Vec<&str> = REQUIRED.iter().copied().filter(|c| col(c).is_none()).collect();
    if !missing.is_empty() {
        bail!("MELD {file}: missing column(s) {missing:?} (header has {names:?})");
    }
    let [c_utt, c_spk, c_emo, c_dia, c_uid] = REQUIRED.map(|c| col(c).expect("checked above"));
    let c_sent = col("Sentiment");
    let labels = LabelSet::meld();

    let mut rows = Vec::new();
    let mut seen: HashMap<(u32, u32), u64> = HashMap::new();
    for rec in rdr.records() {
        let rec = rec.with_context(|| format!("MELD {file}: malformed CSV"))?;
        let line = rec.position().map_or(0, |p| p.line());
        let field = |c: usize, name: &str| -> Result<Cow<'_, str>> {
            let raw = rec.get(c).with_context(|| format!("MELD {file} line {line}: no value in column {name}"))?;
            Ok(repair_mojibake(raw))
        };
        let id = |c: usize, name: &str| -> Result<u32> {
            let v = field(c, name)?;
            v.trim().parse::<u32>().with_context(|| format!("MELD {file} line {line}, column {name}: {v:?} is not an id"))
        };
        let (dialogue_id, utterance_id) = (id(c_dia, "Dialogue_ID")?, id(c_uid, "Utterance_ID")?);
        let utterance = field(c_utt, "Utterance")?;
        let speaker = field(c_spk, "Speaker")?;
        let emotion_raw = field(c_emo, "Emotion")?;
        let sentiment = c_sent.map(|c| field(c, "Sentiment")).transpose()?.map(|s| s.trim().to_string());
        if [&utterance, &speaker, &emotion_raw].iter().any(|f| matches!(f, Cow::Owned(_))) {
            report.repaired_rows += 1;
        }
        let emotion = emotion_raw.trim().to_lowercase();
        if !labels.contains(&emotion) {
            bail!("MELD {file} line {line}, column Emotion: unknown label {emotion_raw:?} (expected one of {:?})", labels.labels);
        }
        if let Some(first) = seen.insert((dialogue_id, utterance_id), line) {
            bail!("MELD {file} line {line}: duplicate Dialogue_ID {dialogue_id} / Utterance_ID {utterance_id} (first on line {first})");
        }
        if speaker.trim().is_empty() {
            bail!("MELD {file} line {line}, column Speaker: empty speaker name");
        }
        if utterance.trim().is_empty() {
            report.empty_utterances += 1;
            continue;
        }
        rows.push(Row {
            line,
            dialogue_id,
            utterance_id,
            speaker: speaker.into_owned(),
            utterance: utterance.into_owned(),
            emotion,
            sentiment,
        });
    }
    Ok(rows)
}

/// Undoes the pre-2020 MELD encoding damage: UTF-8 text holding C1 controls where cp1252
/// punctuation was meant (U+0092 for ’, U+0085 for …) and U+00A0 where the clean files have a
/// space. Borrowed when there is nothing to repair, so clean text passes untouched.
pub fn repair_mojibake(s: &str) -> Cow<'_, str> {
    if !s.chars().any(|c| ('\u{80}'..='\u{a0}').contains(&c)) {
        return Cow::Borrowed(s);
    }
    Cow::Owned(s.chars().map(|c| if c == '\u{a0}' { ' ' } else { cp1252_c1(c).unwrap_or(c) }).collect())
}

/// cp1252's characters for bytes 0x80–0x9F (the five unassigned bytes stay as they are).
fn cp1252_c1(c: char) -> Option<char> {
    const TABLE: [char; 32] = [
        '€', '\u{81}', '‚', 'ƒ', '„', '…', '†', '‡', 'ˆ', '‰', 'Š', '‹', 'Œ', '\u{8d}', 'Ž', '\u{8f}', //
        '\u{90}', '‘', '’', '“', '”', '•', '–', '—', '˜', '™', 'š', '›', 'œ', '\u{9d}', 'ž', 'Ÿ',
    ];
    let u = c as u32;
    (0x80..=0x9f).contains(&u).then(|| TABLE[(u - 0x80) as usize])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mojibake_repair() {
        assert!(matches!(repair_mojibake("It’s fine — “ok”"), Cow::Borrowed(_)));
        assert_eq!(repair_mojibake("It\u{92}s\u{a0}fine\u{85} \u{97} \u{93}ok\u{94} \u{96}"), "It’s fine… — “ok” –");
        assert_eq!(repair_mojibake("\u{81}"), "\u{81}");
    }

    #[test]
    fn split_names() {
        assert_eq!("Validation".parse::<Split>().unwrap(), Split::Dev);
        assert_eq!(Split::Test.csv_name(), "test_sent_emo.csv");
        assert!("eval".parse::<Split>().is_err());
    }
}
