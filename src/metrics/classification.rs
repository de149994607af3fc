//! Emotion classification scores, defined as scikit-learn defines them (`accuracy_score`,
//! `precision_recall_fscore_support(labels=…, zero_division=0)`, `f1_score(average="macro" |
//! "weighted")`, `confusion_matrix(labels=…)`), which the goldens check.
//!
//! Gold labels must be in the label list. A prediction outside it (a forecaster answer that did
//! not normalise) counts as wrong: it lowers accuracy and its gold class's recall, is no class's
//! false positive, and is counted in its row's `invalid` cell rather than in the matrix.

use anyhow::{bail, Result};
use serde::Serialize;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClassStats {
    pub label: String,
    pub precision: f64,
    pub recall: f64,
    pub f1: f64,
    /// Gold items of this class.
    pub support: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ClassificationReport {
    pub labels: Vec<String>,
    pub n: usize,
    pub accuracy: f64,
    pub per_class: Vec<ClassStats>,
    pub macro_precision: f64,
    pub macro_recall: f64,
    pub macro_f1: f64,
    /// Per-class F1 weighted by support.
    pub weighted_f1: f64,
    /// `confusion[gold][pred]`, rows and columns in `labels` order.
    pub confusion: Vec<Vec<usize>>,
    /// Per gold class, predictions that were not a label.
    pub invalid: Vec<usize>,
    pub invalid_total: usize,
}

fn div(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        0.0
    } else {
        a / b
    }
}

/// Scores `pred` against `gold` (same length, same order) over `labels`.
pub fn evaluate<G: AsRef<str>, P: AsRef<str>, L: AsRef<str>>(gold: &[G], pred: &[P], labels: &[L]) -> Result<ClassificationReport> {
    if gold.len() != pred.len() {
        bail!("classification: {} gold labels but {} predictions", gold.len(), pred.len());
    }
    let labels: Vec<String> = labels.iter().map(|l| l.as_ref().to_string()).collect();
    if labels.is_empty() {
        bail!("classification: empty label list");
    }
    let k = labels.len();
    let idx = |s: &str| labels.iter().position(|l| l == s);
    let mut confusion = vec![vec![0usize; k]; k];
    let mut invalid = vec![0usize; k];
    let mut correct = 0;
    for (i, (g, p)) in gold.iter().zip(pred).enumerate() {
        let Some(gi) = idx(g.as_ref()) else {
            bail!("classification: gold label {:?} of item {i} is not in the label list {labels:?}", g.as_ref());
        };
        match idx(p.as_ref()) {
            Some(pi) => {
                confusion[gi][pi] += 1;
                correct += usize::from(gi == pi);
            }
            None => invalid[gi] += 1,
        }
    }
    let n = gold.len();
    let per_class: Vec<ClassStats> = (0..k)
        .map(|c| {
            let tp = confusion[c][c] as f64;
            let predicted: usize = (0..k).map(|g| confusion[g][c]).sum();
            let support = confusion[c].iter().sum::<usize>() + invalid[c];
            let precision = div(tp, predicted as f64);
            let recall = div(tp, support as f64);
            // sklearn's form: 2tp / (2tp + fp + fn), 0 when undefined.
            let f1 = div(2.0 * tp, predicted as f64 + support as f64);
            ClassStats { label: labels[c].clone(), precision, recall, f1, support }
        })
        .collect();
    let mean = |f: fn(&ClassStats) -> f64| per_class.iter().map(f).sum::<f64>() / k as f64;
    let weighted_f1 = div(per_class.iter().map(|s| s.f1 * s.support as f64).sum(), n as f64);
    Ok(ClassificationReport {
        n,
        accuracy: div(correct as f64, n as f64),
        macro_precision: mean(|s| s.precision),
        macro_recall: mean(|s| s.recall),
        macro_f1: mean(|s| s.f1),
        weighted_f1,
        per_class,
        confusion,
        invalid_total: invalid.iter().sum(),
        invalid,
        labels,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hand_computed() {
        let r = evaluate(&["a", "a", "b", "b"], &["a", "b", "b", "zzz"], &["a", "b"]).unwrap();
        assert_eq!(r.accuracy, 0.5);
        assert_eq!(r.confusion, vec![vec![1, 1], vec![0, 1]]);
        assert_eq!((r.invalid.clone(), r.invalid_total), (vec![0, 1], 1));
        // a: p 1/1, r 1/2, f1 2/3; b: p 1/2, r 1/2, f1 1/2.
        assert_eq!((r.per_class[0].precision, r.per_class[0].recall), (1.0, 0.5));
        assert!((r.macro_f1 - (2.0 / 3.0 + 0.5) / 2.0).abs() < 1e-12);
        assert!((r.weighted_f1 - (2.0 / 3.0 + 0.5) / 2.0).abs() < 1e-12);
    }

    #[test]
    fn bad_input_is_an_error() {
        assert!(evaluate(&["a"], &["a", "b"], &["a", "b"]).is_err());
        assert!(evaluate(&["c"], &["a"], &["a", "b"]).unwrap_err().to_string().contains("\"c\""));
        assert!(evaluate::<&str, &str, &str>(&[], &[], &[]).is_err());
    }
}
