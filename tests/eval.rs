//! `merg eval`, `merg memory` and `merg report` end to end on the tiny checkpoints and the MELD
//! fixture: a run killed with SIGKILL and resumed equals an uninterrupted run, shards merge to
//! the single-run summary, settings are checked on resume, the memory must be held out, and the
//! report writes its table, figures and human-evaluation sheets.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::*;
use serde_json::Value;

fn meld_dir() -> PathBuf {
    fixtures().join("data/meld/clean")
}

/// `merg eval` on the MELD fixture with tiny models and small budgets, plus `extra` flags.
fn eval_cmd(out: &Path, extra: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_merg"));
    c.args(["eval", "--dataset", "meld", "--split", "test", "--quiet", "--data-dir"])
        .arg(meld_dir())
        .args(["--model", tiny_dir("qwen2_5_vl").to_str().unwrap(), "--out"])
        .arg(out)
        .args(["--bertscore-model", fixtures().join("tiny-roberta").to_str().unwrap(), "--bertscore-layers", "2"])
        .args(["--emotion-model", fixtures().join("tiny-distilbert-emotion").to_str().unwrap()])
        .args(["--max-new-tokens", "240", "--max-field-chars", "16", "--kv-memory", "blocks:512"]);
    if !extra.contains(&"--t-max") {
        c.args(["--t-max", "1"]);
    }
    c.args(extra);
    c
}

fn ok(o: Output) -> Output {
    assert!(o.status.success(), "{}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    o
}

/// The summary without its `engine` part (cache warmth and timings legitimately differ).
fn results_summary(dir: &Path) -> Value {
    let mut v: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("summary.json")).unwrap()).unwrap();
    v.as_object_mut().unwrap().remove("engine");
    v
}

/// Records by key without timing and cache fields.
fn records(dir: &Path) -> Vec<Value> {
    let mut rs: Vec<Value> = std::fs::read_to_string(dir.join("results.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let mut v: Value = serde_json::from_str(l).unwrap();
            let t = v["trace"].as_object_mut().unwrap();
            for k in ["ms", "cached_tokens"] {
                t.remove(k);
            }
            v
        })
        .collect();
    rs.sort_by(|a, b| a["key"].as_str().cmp(&b["key"].as_str()));
    rs
}

#[test]
fn killed_and_resumed_equals_uninterrupted_and_shards_merge() {
    let tmp = tempfile::tempdir().unwrap();
    let full = tmp.path().join("full");
    ok(eval_cmd(&full, &[]).output().unwrap());
    let whole = results_summary(&full);
    assert_eq!(whole["items"], 4);
    assert_eq!(whole["failed"], 0);
    assert!(whole["bertscore"].is_array() && whole["polarity_emotion"].is_number() && whole["ppl"]["corpus_ppl"].is_number(), "{whole}");
    let md = std::fs::read_to_string(full.join("summary.md")).unwrap();
    assert!(md.contains("| PPL | Dist-1 | Dist-2 | Acc | P | R | F1 |"), "{md}");
    let cfg: Value = serde_json::from_str(&std::fs::read_to_string(full.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg["model"], tiny_dir("qwen2_5_vl").to_str().unwrap());
    assert!(cfg["pipeline"]["sampling"]["seed"].is_number());

    // SIGKILL once the first record is on disk, leave a torn line as a kill mid-write would,
    // then resume.
    let killed = tmp.path().join("killed");
    let mut child = eval_cmd(&killed, &[]).spawn().unwrap();
    let res = killed.join("results.jsonl");
    let t0 = Instant::now();
    while std::fs::read_to_string(&res).map(|s| s.lines().count()).unwrap_or(0) < 1 {
        assert!(t0.elapsed() < Duration::from_secs(120), "no record within 2 minutes");
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().unwrap(); // SIGKILL on Unix
    child.wait().unwrap();
    let done_before = std::fs::read_to_string(&res).unwrap().lines().count();
    assert!(done_before < 4, "killed before the end ({done_before} records)");
    std::fs::OpenOptions::new().append(true).open(&res).and_then(|mut f| std::io::Write::write_all(&mut f, b"{\"key\":\"meld/te")).unwrap();
    ok(eval_cmd(&killed, &[]).output().unwrap());
    assert_eq!(results_summary(&killed), whole);
    assert_eq!(records(&killed), records(&full));
    let lines = std::fs::read_to_string(&res).unwrap().lines().count();
    assert_eq!(lines, 4, "finished items were not recomputed and the torn line is gone");

    // Two shards merged give the single-run summary.
    let (s1, s2, merged) = (tmp.path().join("s1"), tmp.path().join("s2"), tmp.path().join("merged"));
    ok(eval_cmd(&s1, &["--shard", "1/2"]).output().unwrap());
    ok(eval_cmd(&s2, &["--shard", "2/2"]).output().unwrap());
    assert_eq!(results_summary(&s1)["items"], 2);
    let m = Command::new(env!("CARGO_BIN_EXE_merg")).args(["eval", "--out"]).arg(&merged).arg("--merge").arg(&s1).arg(&s2).output().unwrap();
    ok(m);
    assert_eq!(results_summary(&merged), whole);
    assert_eq!(records(&merged), records(&full));

    // Resuming with other settings is refused and names what changed.
    let o = eval_cmd(&full, &["--t-max", "2"]).output().unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("different settings") && e.contains("pipeline"), "{e}");

    // Report: table with both runs, figures, blinded sheets that aggregate back.
    let rep = tmp.path().join("report");
    let o = Command::new(env!("CARGO_BIN_EXE_merg"))
        .arg("report")
        .arg(&full)
        .arg(&merged)
        .args(["--human-items", "3", "--raters", "2", "--out"])
        .arg(&rep)
        .output()
        .unwrap();
    ok(o);
    let md = std::fs::read_to_string(rep.join("report.md")).unwrap();
    assert!(md.contains("| full |") && md.contains("| merged |"), "{md}");
    // Each figure as SVG (with its title) and as a PNG that decodes and is not blank.
    let titles = [
        ("full.tone", "full: PSP tone per forecast emotion"),
        ("full.stance", "full: PSP stance per forecast emotion"),
        ("full.gra", "full: GRA error attribution"),
        ("full.rounds", "full: selected round"),
        ("full.confusion", "full: emotion forecast confusion"),
        ("merged.tone", "merged: PSP tone per forecast emotion"),
        ("ablation", "Runs compared"),
    ];
    for (stem, title) in titles {
        let svg = std::fs::read_to_string(rep.join(format!("{stem}.svg"))).unwrap_or_else(|e| panic!("{stem}.svg: {e}"));
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>") && svg.contains(&format!(">\n{title}\n</text>")), "{stem}.svg");
        let png = image::open(rep.join(format!("{stem}.png"))).unwrap_or_else(|e| panic!("{stem}.png: {e}")).to_rgb8();
        let colours: std::collections::HashSet<[u8; 3]> = png.pixels().map(|p| p.0).collect();
        assert!(png.width() > 300 && png.height() > 200 && colours.len() > 4, "{stem}.png: {}x{}, {} colours", png.width(), png.height(), colours.len());
    }
    // The ablation chart: a bar per metric for each run, each run in the legend.
    let ablation = std::fs::read_to_string(rep.join("ablation.svg")).unwrap();
    for s in ["Dist-1", "Dist-2", "Acc", "F1 (BERTScore)", "Empathy", "full", "merged", "metric"] {
        assert!(ablation.contains(&format!(">\n{s}\n</text>")), "ablation.svg: {s}");
    }
    check_human_sheets(&rep.join("human_eval"));
}

fn check_human_sheets(dir: &Path) {
    let key = dir.join("key.csv");
    let mut kr = csv::Reader::from_path(&key).unwrap();
    let key_rows: Vec<(String, String)> = kr.records().map(|r| r.unwrap()).map(|r| (r[0].to_string(), r[1].to_string())).collect();
    assert_eq!(key_rows.len(), 6, "3 items x 2 systems");
    // Fill each sheet: system "full" gets 5 everywhere, "merged" gets 1..3 by rater.
    let mut sheets = vec![];
    for rater in 1..=2 {
        let p = dir.join(format!("sheet_{rater}.csv"));
        let mut r = csv::Reader::from_path(&p).unwrap();
        assert_eq!(r.headers().unwrap().iter().collect::<Vec<_>>(), ["code", "context", "response", "empathy", "coherence", "fluency"]);
        let rows: Vec<csv::StringRecord> = r.records().map(|x| x.unwrap()).collect();
        assert_eq!(rows.len(), 6);
        assert!(rows.iter().all(|row| !row[0].contains("full") && !row[0].contains("merged")), "blinded codes");
        let filled = dir.join(format!("filled_{rater}.csv"));
        let mut w = csv::Writer::from_path(&filled).unwrap();
        w.write_record(["code", "context", "response", "empathy", "coherence", "fluency"]).unwrap();
        for row in &rows {
            let sys = &key_rows.iter().find(|k| k.0 == row[0]).unwrap().1;
            let v = if sys == "full" { "5".to_string() } else { rater.to_string() };
            w.write_record([&row[0], &row[1], &row[2], v.as_str(), v.as_str(), ""]).unwrap();
        }
        w.flush().unwrap();
        sheets.push(filled);
    }
    let o = ok(Command::new(env!("CARGO_BIN_EXE_merg"))
        .args(["report", "--key"])
        .arg(&key)
        .arg("--aggregate-human")
        .args(&sheets)
        .output()
        .unwrap());
    let table = String::from_utf8_lossy(&o.stdout);
    assert!(table.contains("| full | empathy | 5.00 | 0.00 | 6 |"), "{table}");
    assert!(table.contains("| merged | coherence | 1.50 | 0.55 | 6 |"), "{table}");
    assert!(!table.contains("fluency"), "blank cells are not ratings: {table}");
    // A rating outside 1..5 is an error naming the sheet, row and column.
    let bad = dir.join("bad.csv");
    std::fs::write(&bad, format!("code,context,response,empathy,coherence,fluency\n{},c,r,7,,\n", key_rows[0].0)).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_merg")).args(["report", "--key"]).arg(&key).arg("--aggregate-human").arg(&bad).output().unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("bad.csv row 2, column empathy"), "{e}");
}

#[test]
fn memory_is_built_from_a_held_out_split_and_retrieved() {
    let tmp = tempfile::tempdir().unwrap();
    let mem = tmp.path().join("memory.jsonl");
    // The fixture has only a test split: a memory from it, used on it, must be refused.
    let o = ok(Command::new(env!("CARGO_BIN_EXE_merg"))
        .args(["memory", "--dataset", "meld", "--split", "test", "--data-dir"])
        .arg(meld_dir())
        .arg("--out")
        .arg(&mem)
        .output()
        .unwrap());
    assert!(String::from_utf8_lossy(&o.stderr).contains("4 exemplars"));
    let o = eval_cmd(&tmp.path().join("leak"), &["--memory", mem.to_str().unwrap(), "--limit", "1"]).output().unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("held-out split"), "{e}");
    // Held-out entries (another split's keys) are retrieved by SGRG.
    let held_out: String = std::fs::read_to_string(&mem).unwrap().replace("meld/test/", "meld/dev/");
    std::fs::write(&mem, held_out).unwrap();
    let out = tmp.path().join("ok");
    ok(eval_cmd(&out, &["--memory", mem.to_str().unwrap(), "--limit", "2", "--t-max", "0", "--no-bertscore", "--no-emotion-polarity"]).output().unwrap());
    let recs = records(&out);
    assert_eq!(recs.len(), 2);
    for r in &recs {
        let ex = r["trace"]["exemplars"].as_array().unwrap();
        assert_eq!(ex.len(), 1, "{r}");
        assert!(ex[0].as_str().unwrap().starts_with("meld/dev/"));
        assert!(r["metrics"]["bertscore"].is_null() && r["metrics"]["emotion_polarity"].is_null());
    }
    let s = results_summary(&out);
    assert!(s["bertscore"].is_null() && s["empathy"].is_null());
}

#[test]
fn bad_eval_input_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--shard", "3/2"], "--shard"),
        (vec!["--t-max", "9"], "--t-max"),
        (vec!["--labels", "joy"], "--labels joy: must be"),
    ];
    for (extra, msg) in cases {
        let o = eval_cmd(&tmp.path().join("x"), &extra).output().unwrap();
        let e = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && e.contains(msg) && !e.contains("panicked"), "{extra:?}: {e}");
    }
    let o = Command::new(env!("CARGO_BIN_EXE_merg"))
        .args(["eval", "--dataset", "meld", "--split", "test", "--data-dir", "/nonexistent", "--model", "x", "--out"])
        .arg(tmp.path().join("y"))
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && e.contains("/nonexistent"), "{e}");
}

/// `--concurrency 4` batches four dialogues' agent calls together. Replies, forecasts, plans,
/// verdicts and every text metric equal `--concurrency 1`'s, on the greedy and the seeded path;
/// the reply log-probs (and so PPL) may differ in their last digits, because a different batch
/// composition changes the f32 summation order inside the matrix products (README: Evaluation).
#[test]
fn concurrency_four_gives_the_records_of_concurrency_one() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, sampling) in [("greedy", ["--temperature", "0"]), ("seeded", ["--temperature", "0.7"])] {
        let run = |c: &str| {
            let out = tmp.path().join(format!("{name}-{c}"));
            ok(eval_cmd(&out, &[&sampling[..], &["--seed", "3", "--limit", "4", "--t-max", "0", "--concurrency", c]].concat()).output().unwrap());
            out
        };
        let (one, four) = (run("1"), run("4"));
        let (mut a, mut b) = (records(&one), records(&four));
        assert_eq!(a.len(), 4);
        let (la, lb) = (take_float_fields(&mut a), take_float_fields(&mut b));
        assert_eq!(a, b, "{name}: records differ between --concurrency 1 and 4");
        assert_eq!(la.len(), lb.len());
        for (x, y) in la.iter().zip(&lb) {
            assert!((x - y).abs() <= 1e-4 * x.abs().max(1.0), "{name}: log-prob/PPL {x} vs {y}");
        }
        let (mut sa, mut sb) = (results_summary(&one), results_summary(&four));
        let (pa, pb) = (take_float_fields(std::slice::from_mut(&mut sa)), take_float_fields(std::slice::from_mut(&mut sb)));
        assert_eq!(sa, sb, "{name}: summaries differ");
        for (x, y) in pa.iter().zip(&pb) {
            assert!((x - y).abs() <= 1e-4 * x.abs().max(1.0), "{name}: summary PPL {x} vs {y}");
        }
    }
}

/// Removes the fields that carry log-probabilities (`reply_logprobs`, `ppl`, anywhere) and
/// returns their numbers in order.
fn take_float_fields(vs: &mut [Value]) -> Vec<f64> {
    fn walk(v: &mut Value, out: &mut Vec<f64>) {
        match v {
            Value::Object(o) => {
                for k in ["reply_logprobs", "ppl", "PPL"] {
                    if let Some(x) = o.remove(k) {
                        flat(&x, out);
                    }
                }
                o.values_mut().for_each(|x| walk(x, out));
            }
            Value::Array(a) => a.iter_mut().for_each(|x| walk(x, out)),
            _ => {}
        }
    }
    fn flat(v: &Value, out: &mut Vec<f64>) {
        match v {
            Value::Number(n) => out.push(n.as_f64().unwrap()),
            Value::Array(a) => a.iter().for_each(|x| flat(x, out)),
            Value::Object(o) => o.values().for_each(|x| flat(x, out)),
            _ => {}
        }
    }
    let mut out = vec![];
    vs.iter_mut().for_each(|v| walk(v, &mut out));
    out
}
