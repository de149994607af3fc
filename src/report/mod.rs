//! `merg report`: metric tables side by side, the paper's figures as SVG, and blinded
//! human-evaluation sheets, from one or more `merg eval` run folders.
//!
//! Figures: PSP tone and stance per forecast emotion (paper Fig. 3), GRA error attribution per
//! agent (Fig. 4: how often each agent failed its check, and how often it was the earliest
//! failure that started a re-run), selected-round histogram, confusion matrix, and the
//! ablation comparison across runs.

pub mod human;
pub mod svg;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::eval::record::Record;
use crate::eval::summary::{table_header, Summary};
use crate::eval::{read_records, read_spec, RunSpec};
use crate::pipeline::psp::{STANCES, TONES};

/// A finished run folder.
pub struct Run {
    pub name: String,
    pub dir: PathBuf,
    pub spec: RunSpec,
    pub records: Vec<Record>,
    pub summary: Summary,
}

impl Run {
    pub fn load(dir: &Path) -> Result<Run> {
        let spec = read_spec(dir)?;
        let records = read_records(&dir.join("results.jsonl"))?;
        let summary = Summary::compute(&records, &spec.pipeline.labels, &spec.summary)?;
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| dir.display().to_string());
        Ok(Run { name, dir: dir.to_path_buf(), spec, records, summary })
    }
}

/// Writes report.md and the figures into `out`; returns the files written.
pub fn write(runs: &[Run], out: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    let mut files = vec![];
    let mut put = |name: String, body: String| -> Result<()> {
        let p = out.join(name);
        std::fs::write(&p, body).with_context(|| format!("writing {}", p.display()))?;
        files.push(p);
        Ok(())
    };
    let mut md = String::from("# merg report\n\n## Metrics (paper Table 1 shape, plus polarity)\n\n");
    md.push_str(&table_header());
    for r in runs {
        md.push_str(&format!("| {} | {} |\n", r.name, r.summary.table_cells().join(" | ")));
    }
    md.push_str("\nPPL is corpus-level over reply tokens; Dist-n, Acc and BERTScore P/R/F1 in %.\n\n## Runs\n\n");
    for r in runs {
        let c = &r.spec.pipeline;
        md.push_str(&format!(
            "- **{}**: {} {} ({} items, {} failed), model {}, seed {}, baseline {:?}, mpa/caef/psp/gra {}/{}/{}/{}, mode {:?}, T_max {}, top-k {}, selection {}, distinct {:?}\n",
            r.name, r.spec.dataset, r.spec.split, r.summary.items, r.summary.failed, r.spec.model, c.sampling.seed, c.baseline,
            c.use_mpa, c.use_caef, c.use_psp, c.use_gra, c.mode, c.t_max, c.top_k, c.selection, r.summary.distinct.mode
        ));
    }
    put("report.md".into(), md)?;
    if runs.len() > 1 {
        put("ablation.svg".into(), ablation_chart(runs))?;
    }
    for r in runs {
        let n = &r.name;
        let (tone, stance) = plan_distributions(&r.records, &r.spec.pipeline.labels);
        put(format!("{n}.tone.svg"), svg::bar_chart(&format!("{n}: PSP tone per forecast emotion"), &r.spec.pipeline.labels, &tone, true, "replies"))?;
        put(format!("{n}.stance.svg"), svg::bar_chart(&format!("{n}: PSP stance per forecast emotion"), &r.spec.pipeline.labels, &stance, true, "replies"))?;
        put(format!("{n}.gra.svg"), gra_attribution(&r.records, n))?;
        let h = &r.summary.selected_rounds;
        let cats: Vec<String> = (0..h.len()).map(|i| format!("round {i}")).collect();
        put(format!("{n}.rounds.svg"), svg::bar_chart(&format!("{n}: selected round"), &cats, &[("items".into(), h.iter().map(|&x| x as f64).collect())], false, "items"))?;
        if let Some(e) = &r.summary.emotion {
            let m: Vec<Vec<f64>> = e.confusion.iter().map(|row| row.iter().map(|&x| x as f64).collect()).collect();
            put(format!("{n}.confusion.svg"), svg::heatmap(&format!("{n}: emotion forecast confusion"), &e.labels, &e.labels, &m, "gold", "forecast"))?;
        }
    }
    Ok(files)
}

/// (tone series, stance series) over the label set, counting selected plans by forecast.
pub fn plan_distributions(records: &[Record], labels: &[String]) -> (Vec<(String, Vec<f64>)>, Vec<(String, Vec<f64>)>) {
    let count = |names: &[&str], pick: &dyn Fn(&crate::pipeline::psp::Plan) -> String| {
        names
            .iter()
            .map(|name| {
                let per: Vec<f64> = labels
                    .iter()
                    .map(|l| {
                        records
                            .iter()
                            .filter(|r| r.forecast.as_deref() == Some(l.as_str()))
                            .filter(|r| r.trace.plan.as_ref().is_some_and(|p| pick(p) == *name))
                            .count() as f64
                    })
                    .collect();
                (name.to_string(), per)
            })
            .filter(|(_, v)| v.iter().any(|&x| x > 0.0))
            .collect()
    };
    (count(&TONES, &|p| p.tone.clone()), count(&STANCES, &|p| p.stance.clone()))
}

/// Per agent: failed checks over all audited rounds, and rounds whose re-run it started.
pub fn gra_counts(records: &[Record]) -> ([f64; 4], [f64; 4]) {
    let mut failed = [0.0; 4];
    let mut blamed = [0.0; 4];
    for r in records.iter().filter(|r| r.error.is_none()) {
        for t in &r.trace.tuples {
            for (k, &pass) in t.iter().enumerate() {
                if !pass {
                    failed[k] += 1.0;
                }
            }
        }
        for s in r.trace.starts.iter().skip(1) {
            if let Some(k) = ["mpa", "caef", "psp", "sgrg"].iter().position(|a| a == s) {
                blamed[k] += 1.0;
            }
        }
    }
    (failed, blamed)
}

fn gra_attribution(records: &[Record], name: &str) -> String {
    let (failed, blamed) = gra_counts(records);
    let cats: Vec<String> = ["MPA (c1)", "CAEF (c2)", "PSP (c3)", "SGRG (c4)"].map(String::from).to_vec();
    svg::bar_chart(
        &format!("{name}: GRA error attribution"),
        &cats,
        &[("failed checks".into(), failed.to_vec()), ("re-runs started".into(), blamed.to_vec())],
        false,
        "count",
    )
}

fn ablation_chart(runs: &[Run]) -> String {
    let metrics = ["Dist-1", "Dist-2", "Acc", "F1 (BERTScore)", "Empathy"];
    let series = runs
        .iter()
        .map(|r| {
            let s = &r.summary;
            let v = [
                s.distinct.distinct_1 * 100.0,
                s.distinct.distinct_2 * 100.0,
                s.emotion.as_ref().map(|e| e.accuracy * 100.0).unwrap_or(0.0),
                s.bertscore.map(|b| b[2] * 100.0).unwrap_or(0.0),
                s.empathy.map(|e| e * 100.0).unwrap_or(0.0),
            ];
            (r.name.clone(), v.to_vec())
        })
        .collect::<Vec<_>>();
    svg::bar_chart("Runs compared", &metrics.map(String::from), &series, false, "% (empathy ×100)")
}
