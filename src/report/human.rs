//! Human evaluation: blinded, shuffled rating sheets (Empathy, Coherence, Fluency on 1–5 Likert
//! scales) mixing the replies of several systems on the same items, a key file that unblinds
//! them, and the aggregation of filled sheets into per-system means.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::Serialize;

use super::Run;

pub const CRITERIA: [&str; 3] = ["empathy", "coherence", "fluency"];

/// Writes `sheet_{r}.csv` for each rater (each its own shuffle) and `key.csv` into `out`.
/// Items are those every run answered, `items` of them drawn with `seed`.
pub fn export(runs: &[Run], out: &Path, items: usize, raters: usize, seed: u64) -> Result<Vec<PathBuf>> {
    if runs.is_empty() || raters == 0 {
        bail!("human-evaluation export needs at least one run and one rater");
    }
    std::fs::create_dir_all(out)?;
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let answered = |r: &Run| r.records.iter().filter(|x| x.error.is_none()).map(|x| x.key.clone()).collect::<HashSet<_>>();
    let mut common: Vec<String> = answered(&runs[0]).into_iter().filter(|k| runs.iter().all(|r| answered(r).contains(k))).collect();
    common.sort();
    common.shuffle(&mut rng);
    common.truncate(items);
    if common.is_empty() {
        bail!("the runs have no successfully answered item in common");
    }
    // Codes are random, so neither the code nor the row order reveals the system.
    let mut rows = vec![];
    let mut codes: Vec<u32> = (0..(common.len() * runs.len()) as u32).collect();
    codes.shuffle(&mut rng);
    let mut key = csv::Writer::from_path(out.join("key.csv"))?;
    key.write_record(["code", "run", "item"])?;
    for (i, k) in common.iter().enumerate() {
        for (j, run) in runs.iter().enumerate() {
            let rec = run.records.iter().find(|r| &r.key == k).expect("common item");
            let code = format!("S{:05}", codes[i * runs.len() + j]);
            let context = rec.history.iter().zip(rec.speakers.iter().chain(std::iter::repeat(&String::new()))).map(|(t, s)| if s.is_empty() { t.clone() } else { format!("{s}: {t}") }).collect::<Vec<_>>().join("\n");
            key.write_record([code.as_str(), run.name.as_str(), k.as_str()])?;
            rows.push([code, context, rec.reply.clone()]);
        }
    }
    key.flush()?;
    let mut files = vec![out.join("key.csv")];
    for r in 1..=raters {
        let mut order = rows.clone();
        order.shuffle(&mut rng);
        let p = out.join(format!("sheet_{r}.csv"));
        let mut w = csv::Writer::from_path(&p)?;
        w.write_record(["code", "context", "response", "empathy", "coherence", "fluency"])?;
        for [code, ctx, reply] in &order {
            w.write_record([code.as_str(), ctx.as_str(), reply.as_str(), "", "", ""])?;
        }
        w.flush()?;
        files.push(p);
    }
    std::fs::write(
        out.join("INSTRUCTIONS.txt"),
        "Rate each response to its context from 1 (worst) to 5 (best), whole numbers only:\n\
         empathy   - does it recognise and respond to the speaker's feelings?\n\
         coherence - does it follow from the conversation?\n\
         fluency   - is it natural, grammatical language?\n\
         Do not open key.csv. Return the filled sheet_N.csv.\n",
    )?;
    Ok(files)
}

#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Rating {
    pub run: String,
    pub criterion: String,
    pub mean: f64,
    pub sd: f64,
    pub n: usize,
}

/// Per (run, criterion): mean and sample standard deviation over every filled cell of every
/// sheet. Blank cells are skipped (counted out of `n`); anything but 1..5 is an error naming
/// the sheet, row and column.
pub fn aggregate(key: &Path, sheets: &[PathBuf]) -> Result<Vec<Rating>> {
    let mut who: HashMap<String, String> = HashMap::new();
    let mut kr = csv::Reader::from_reader(crate::input::open(key, &crate::input::RECORDS)?);
    for row in kr.records() {
        let row = row.with_context(|| format!("reading the key {}", key.display()))?;
        who.insert(row.get(0).unwrap_or_default().to_string(), row.get(1).unwrap_or_default().to_string());
    }
    let mut scores: BTreeMap<(String, String), Vec<f64>> = BTreeMap::new();
    for sheet in sheets {
        let mut r = csv::Reader::from_reader(crate::input::open(sheet, &crate::input::RECORDS)?);
        let headers = r.headers().with_context(|| format!("reading the sheet {}", sheet.display()))?.clone();
        let col = |name: &str| headers.iter().position(|h| h.trim().eq_ignore_ascii_case(name));
        let code_col = col("code").with_context(|| format!("{}: no \"code\" column", sheet.display()))?;
        for (n, row) in r.records().enumerate() {
            let row = row.with_context(|| format!("reading the sheet {}", sheet.display()))?;
            let code = row.get(code_col).unwrap_or_default();
            let run = who.get(code).with_context(|| format!("{} row {}: code {code:?} is not in {}", sheet.display(), n + 2, key.display()))?;
            for c in CRITERIA {
                let i = col(c).with_context(|| format!("{}: no {c:?} column", sheet.display()))?;
                let cell = row.get(i).unwrap_or_default().trim();
                if cell.is_empty() {
                    continue;
                }
                let v: u8 = cell.parse().ok().filter(|v| (1..=5).contains(v)).with_context(|| {
                    format!("{} row {}, column {c}: {cell:?} is not a whole number from 1 to 5", sheet.display(), n + 2)
                })?;
                scores.entry((run.clone(), c.to_string())).or_default().push(v as f64);
            }
        }
    }
    Ok(scores
        .into_iter()
        .map(|((run, criterion), v)| {
            let n = v.len();
            let mean = v.iter().sum::<f64>() / n as f64;
            let sd = if n > 1 { (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1) as f64).sqrt() } else { 0.0 };
            Rating { run, criterion, mean, sd, n }
        })
        .collect())
}
