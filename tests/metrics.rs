//! Metrics against goldens from their reference implementations (scripts/make_metric_goldens.py:
//! Python vaderSentiment 3.3.2, scikit-learn, a plain Python distinct-n), plus the MELD-based
//! goldens when $MERG_DATA_DIR (default ../shared/data) has the MELD CSVs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use merg::data::{meld, LoadReport};
use merg::metrics::classification::evaluate;
use merg::metrics::distinct::{distinct, tokenize, DistinctMode};
use merg::metrics::sentiment::{compound, compound_raw};
use serde_json::Value;

fn golden(name: &str) -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/goldens/metrics").join(name);
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap()
}

fn meld_test_csv() -> Option<PathBuf> {
    let dir = std::env::var_os("MERG_DATA_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/data"));
    let p = dir.join("meld/test_sent_emo.csv");
    if p.is_file() {
        Some(p)
    } else {
        println!("SKIPPED: {} absent (set MERG_DATA_DIR)", p.display());
        None
    }
}

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap()
}

/// Largest |ours − reference| over (text, raw golden, normalised golden) triples.
fn vader_max_err<'a>(cases: impl Iterator<Item = (&'a str, f64, f64)>) -> (f64, usize) {
    let (mut max, mut n) = (0f64, 0);
    for (text, raw, norm) in cases {
        let (a, b) = (compound_raw(text), compound(text));
        assert!((a - raw).abs() <= 1e-4, "{text:?}: compound {a} vs vaderSentiment {raw}");
        assert!((b - norm).abs() <= 1e-4, "{text:?}: normalised compound {b} vs vaderSentiment {norm}");
        max = max.max((a - raw).abs()).max((b - norm).abs());
        n += 1;
    }
    (max, n)
}

#[test]
fn vader_matches_vadersentiment_on_made_up_sentences() {
    let g = golden("vader.json");
    assert_eq!(g["versions"]["vaderSentiment"], "3.3.2");
    let rows = g["sentences"].as_array().unwrap();
    let (max, n) = vader_max_err(rows.iter().map(|r| (r["text"].as_str().unwrap(), f(&r["compound_raw"]), f(&r["compound"]))));
    assert!(n >= 50);
    // The apostrophe normalisation matters on these: some raw and normalised goldens differ.
    assert!(rows.iter().any(|r| r["compound_raw"] != r["compound"]));
    println!("VADER vs vaderSentiment 3.3.2: max |Δcompound| = {max:e} over {n} sentences");
}

#[test]
fn vader_matches_vadersentiment_on_meld_test() {
    let Some(csv) = meld_test_csv() else { return };
    let mut rep = LoadReport::default();
    let text: HashMap<(u32, u32), String> =
        meld::read_rows(&csv, &mut rep).unwrap().into_iter().map(|r| ((r.dialogue_id, r.utterance_id), r.utterance)).collect();
    let g = golden("vader_meld.json");
    let rows = g["rows"].as_array().unwrap();
    assert_eq!(rows.len(), text.len());
    let (max, n) = vader_max_err(rows.iter().map(|r| {
        let key = (r[0].as_u64().unwrap() as u32, r[1].as_u64().unwrap() as u32);
        (text[&key].as_str(), f(&r[2]), f(&r[3]))
    }));
    println!("VADER vs vaderSentiment 3.3.2 on MELD test: max |Δcompound| = {max:e} over {n} utterances");
}

fn mode_of(s: &Value) -> DistinctMode {
    match s["mode"].as_str().unwrap() {
        "corpus" => DistinctMode::Corpus,
        "per_response" => DistinctMode::PerResponse,
        "chunked" => DistinctMode::Chunked { size: s["size"].as_u64().unwrap() as usize },
        m => panic!("unknown mode {m}"),
    }
}

fn check_distinct(replies: &[String], scores: &Value) {
    for s in scores.as_array().unwrap() {
        let got = distinct(replies, mode_of(s)).unwrap();
        assert_eq!(got.mode, mode_of(s));
        assert!((got.distinct_1 - f(&s["distinct_1"])).abs() < 1e-12, "{s}: {got:?}");
        assert!((got.distinct_2 - f(&s["distinct_2"])).abs() < 1e-12, "{s}: {got:?}");
    }
}

#[test]
fn distinct_matches_reference() {
    let g = golden("distinct.json");
    let replies: Vec<String> = g["replies"].as_array().unwrap().iter().map(|r| r.as_str().unwrap().to_string()).collect();
    for (r, want) in replies.iter().zip(g["tokens"].as_array().unwrap()) {
        let want: Vec<&str> = want.as_array().unwrap().iter().map(|t| t.as_str().unwrap()).collect();
        assert_eq!(tokenize(r), want, "{r:?}");
    }
    check_distinct(&replies, &g["scores"]);
}

#[test]
fn distinct_matches_reference_on_meld_test() {
    let Some(csv) = meld_test_csv() else { return };
    let mut rep = LoadReport::default();
    // File order, as the golden script reads it.
    let replies: Vec<String> = meld::read_rows(&csv, &mut rep).unwrap().into_iter().map(|r| r.utterance).collect();
    check_distinct(&replies, &golden("distinct_meld.json")["scores"]);
}

#[test]
fn classification_matches_sklearn() {
    let g = golden("classification.json");
    for case in g["cases"].as_array().unwrap() {
        let strs = |k: &str| -> Vec<String> { case[k].as_array().unwrap().iter().map(|v| v.as_str().unwrap().to_string()).collect() };
        let (labels, gold, pred) = (strs("labels"), strs("gold"), strs("pred"));
        let r = evaluate(&gold, &pred, &labels).unwrap();
        let name = case["name"].as_str().unwrap();
        let close = |a: f64, b: &Value, what: &str| assert!((a - f(b)).abs() < 1e-12, "{name} {what}: {a} vs sklearn {b}");
        close(r.accuracy, &case["accuracy"], "accuracy");
        close(r.macro_precision, &case["macro_precision"], "macro precision");
        close(r.macro_recall, &case["macro_recall"], "macro recall");
        close(r.macro_f1, &case["macro_f1"], "macro F1");
        close(r.weighted_f1, &case["weighted_f1"], "weighted F1");
        for (i, s) in r.per_class.iter().enumerate() {
            close(s.precision, &case["precision"][i], "precision");
            close(s.recall, &case["recall"][i], "recall");
            close(s.f1, &case["f1"][i], "f1");
            assert_eq!(s.support as u64, case["support"][i].as_u64().unwrap(), "{name} support");
        }
        let cm: Vec<Vec<usize>> = serde_json::from_value(case["confusion"].clone()).unwrap();
        assert_eq!(r.confusion, cm, "{name} confusion matrix");
        assert_eq!(r.invalid_total, pred.iter().filter(|p| !labels.contains(p)).count());
    }
}
