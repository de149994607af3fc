//! Emotion label sets: the closed vocabularies the forecaster must answer in and the metrics
//! score against. Built-in sets know a few common synonyms ("happy" for MELD's "joy") so a model's
//! free-text label still maps onto the set; custom sets match exactly (case-insensitively).

use anyhow::Result;

use crate::setting::InvalidSetting;
use serde::Serialize;

/// MELD's seven classes, in the order the MELD paper lists them.
pub const MELD: [&str; 7] = ["neutral", "joy", "surprise", "anger", "sadness", "disgust", "fear"];
/// IEMOCAP as this crate uses it: neu, hap+exc (merged into happy), sad, ang, fru.
pub const IEMOCAP: [&str; 5] = ["neutral", "happy", "sad", "angry", "frustrated"];

const MELD_ALIASES: &[(&str, &str)] = &[
    ("joyful", "joy"),
    ("happy", "joy"),
    ("happiness", "joy"),
    ("surprised", "surprise"),
    ("angry", "anger"),
    ("sad", "sadness"),
    ("disgusted", "disgust"),
    ("fearful", "fear"),
    ("afraid", "fear"),
    ("scared", "fear"),
];

const IEMOCAP_ALIASES: &[(&str, &str)] = &[
    ("neu", "neutral"),
    ("hap", "happy"),
    ("exc", "happy"),
    ("excited", "happy"),
    ("joy", "happy"),
    ("happiness", "happy"),
    ("sadness", "sad"),
    ("ang", "angry"),
    ("anger", "angry"),
    ("fru", "frustrated"),
    ("frustration", "frustrated"),
];

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct LabelSet {
    /// "meld", "iemocap", or "custom".
    pub name: String,
    /// Canonical labels, lowercase, in a fixed order (the confusion matrix uses it).
    pub labels: Vec<String>,
    /// (synonym, canonical label), both lowercase.
    #[serde(skip)]
    aliases: Vec<(String, String)>,
}

impl LabelSet {
    pub fn meld() -> Self {
        Self::builtin("meld", &MELD, MELD_ALIASES)
    }

    pub fn iemocap() -> Self {
        Self::builtin("iemocap", &IEMOCAP, IEMOCAP_ALIASES)
    }

    fn builtin(name: &str, labels: &[&str], aliases: &[(&str, &str)]) -> Self {
        LabelSet {
            name: name.into(),
            labels: labels.iter().map(|s| s.to_string()).collect(),
            aliases: aliases.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect(),
        }
    }

    /// A user-given set, e.g. `"happy, sad,neutral"`: trimmed, lowercased, no duplicates.
    pub fn custom(labels: &[&str]) -> Result<Self, InvalidSetting> {
        let bad = |rule: String| InvalidSetting::new("labels", labels.join(","), rule);
        let mut out: Vec<String> = Vec::new();
        for l in labels {
            let l = l.trim().to_lowercase();
            if l.is_empty() {
                return Err(bad("a list of non-empty labels (one is empty)".into()));
            }
            if out.contains(&l) {
                return Err(bad(format!("a list of distinct labels ('{l}' is given twice)")));
            }
            out.push(l);
        }
        if out.len() < 2 {
            return Err(bad("a list of at least two labels".into()));
        }
        Ok(LabelSet { name: "custom".into(), labels: out, aliases: vec![] })
    }

    /// `"meld"`, `"iemocap"`, or a comma-separated list of labels.
    pub fn from_spec(spec: &str) -> Result<Self> {
        match spec.trim().to_lowercase().as_str() {
            "meld" => Ok(Self::meld()),
            "iemocap" => Ok(Self::iemocap()),
            s if s.contains(',') => Ok(Self::custom(&spec.split(',').collect::<Vec<_>>())?),
            _ => Err(InvalidSetting::new("labels", spec, "meld, iemocap or a comma-separated list of labels").into()),
        }
    }

    /// The canonical label a free-text answer names, if any: trimmed, lowercased, surrounding
    /// quotes/punctuation removed, then an exact label or a known synonym.
    pub fn normalize(&self, s: &str) -> Option<&str> {
        let t = s.trim().trim_matches(|c: char| !c.is_alphanumeric()).to_lowercase();
        if let Some(l) = self.labels.iter().find(|l| **l == t) {
            return Some(l.as_str());
        }
        let canon = &self.aliases.iter().find(|(a, _)| *a == t)?.1;
        self.labels.iter().find(|l| *l == canon).map(|l| l.as_str())
    }

    pub fn contains(&self, label: &str) -> bool {
        self.labels.iter().any(|l| l == label)
    }

    pub fn index(&self, label: &str) -> Option<usize> {
        self.labels.iter().position(|l| l == label)
    }

    pub fn len(&self) -> usize {
        self.labels.len()
    }

    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_and_normalisation() {
        let m = LabelSet::from_spec("MELD").unwrap();
        assert_eq!(m.labels.len(), 7);
        assert_eq!(m.normalize("  Joy. "), Some("joy"));
        assert_eq!(m.normalize("\"Happy\""), Some("joy"));
        assert_eq!(m.normalize("angry"), Some("anger"));
        assert_eq!(m.normalize("frustrated"), None);
        let i = LabelSet::from_spec("iemocap").unwrap();
        assert_eq!(i.normalize("Excited"), Some("happy"));
        assert_eq!(i.normalize("fru"), Some("frustrated"));
        assert_eq!(i.normalize("fear"), None);
        let c = LabelSet::from_spec("Pos, neg ,neu").unwrap();
        assert_eq!(c.labels, ["pos", "neg", "neu"]);
        assert_eq!(c.normalize("NEG"), Some("neg"));
        assert_eq!(c.normalize("negative"), None);
        assert_eq!(c.index("neu"), Some(2));
    }

    #[test]
    fn bad_specs_are_errors() {
        assert!(LabelSet::from_spec("emotions").is_err());
        assert!(LabelSet::from_spec("a,,b").is_err());
        assert!(LabelSet::from_spec("a,A").is_err());
        assert!(LabelSet::from_spec("a,").is_err());
    }
}
