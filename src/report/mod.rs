//! `merg report`: metric tables side by side, the paper's figures (SVG and PNG, drawn by
//! `plot`), and blinded human-evaluation sheets, from one or more `merg eval` run folders.
//!
//! Figures: PSP tone and stance per forecast emotion (paper Fig. 3), GRA error attribution per
//! agent (Fig. 4: how often each agent failed its check, and how often it was the earliest
//! failure that started a re-run), selected-round histogram, confusion matrix, and the
//! ablation comparison across runs.

pub mod benches;
pub mod human;
pub mod plot;
mod raster;
#[cfg(test)]
mod tests;

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::eval::record::Record;
use crate::eval::summary::{table_header, Summary};
use crate::eval::{read_records, read_spec, RunSpec};
use crate::pipeline::psp::{STANCES, TONES};
use plot::{Categorical, Figure, Heatmap, Style};

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

/// Writes report.md and the figures (each as .svg and .png) into `out`; returns the files written.
pub fn write(runs: &[Run], out: &Path) -> Result<Vec<PathBuf>> {
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
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
    let table = out.join("report.md");
    std::fs::write(&table, md).with_context(|| format!("writing {}", table.display()))?;
    let mut files = vec![table];
    for (stem, fig) in figures(runs) {
        files.extend(fig.save_both(out, &stem)?);
    }
    Ok(files)
}

/// Every figure of the report, by file stem: the ablation chart (several runs), then per run
/// tone, stance, GRA attribution, selected rounds and (with emotion labels) the confusion matrix.
pub fn figures(runs: &[Run]) -> Vec<(String, Figure)> {
    let mut figs = vec![];
    if runs.len() > 1 {
        figs.push(("ablation".to_string(), ablation_chart(runs)));
    }
    for r in runs {
        let n = &r.name;
        let labels = &r.spec.pipeline.labels;
        let (tone, stance) = plan_distributions(&r.records, labels);
        let plan = |what: &str, series| Categorical {
            title: format!("{n}: PSP {what} per forecast emotion"),
            x_label: "forecast emotion".into(),
            y_label: "replies".into(),
            categories: labels.clone(),
            series,
            style: Style::Stacked,
            values: true,
            ..Default::default()
        };
        figs.push((format!("{n}.tone"), plan("tone", tone).into()));
        figs.push((format!("{n}.stance"), plan("stance", stance).into()));
        figs.push((format!("{n}.gra"), gra_attribution(&r.records, n)));
        let h = &r.summary.selected_rounds;
        let rounds = Categorical {
            title: format!("{n}: selected round"),
            x_label: "round (0: the first answer)".into(),
            y_label: "items".into(),
            categories: (0..h.len()).map(|i| i.to_string()).collect(),
            series: vec![("items".into(), h.iter().map(|&x| x as f64).collect())],
            values: true,
            ..Default::default()
        };
        figs.push((format!("{n}.rounds"), rounds.into()));
        if let Some(e) = &r.summary.emotion {
            let confusion = Heatmap {
                title: format!("{n}: emotion forecast confusion"),
                rows: e.labels.clone(),
                cols: e.labels.clone(),
                values: e.confusion.iter().map(|row| row.iter().map(|&x| x as f64).collect()).collect(),
                row_label: "gold".into(),
                col_label: "forecast".into(),
            };
            figs.push((format!("{n}.confusion"), confusion.into()));
        }
    }
    figs
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

fn gra_attribution(records: &[Record], name: &str) -> Figure {
    let (failed, blamed) = gra_counts(records);
    Categorical {
        title: format!("{name}: GRA error attribution"),
        x_label: "agent (GRA check)".into(),
        y_label: "count".into(),
        categories: ["MPA (c1)", "CAEF (c2)", "PSP (c3)", "SGRG (c4)"].map(String::from).to_vec(),
        series: vec![("failed checks".into(), failed.to_vec()), ("re-runs started".into(), blamed.to_vec())],
        values: true,
        ..Default::default()
    }
    .into()
}

fn ablation_chart(runs: &[Run]) -> Figure {
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
    Categorical {
        title: "Runs compared".into(),
        x_label: "metric".into(),
        y_label: "% (empathy ×100)".into(),
        categories: metrics.map(String::from).to_vec(),
        series,
        ..Default::default()
    }
    .into()
}
