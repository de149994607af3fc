//! `merg report`: tables, figures and human-evaluation sheets from `merg eval` run folders;
//! `merg plot`: a saved benchmark JSON drawn as a figure.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};

use merg::report::{self, benches, human, Run};

#[derive(Args)]
pub struct ReportArgs {
    /// Run folders written by `merg eval` (one column/bar each).
    #[arg(num_args = 1.., required_unless_present = "aggregate_human")]
    pub runs: Vec<PathBuf>,
    /// Output folder for report.md and the figures (each as .svg and .png).
    #[arg(long, default_value = "report")]
    pub out: PathBuf,
    /// Also export blinded human-evaluation sheets for this many common items.
    #[arg(long)]
    pub human_items: Option<usize>,
    #[arg(long, default_value_t = 3)]
    pub raters: usize,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Aggregate filled sheets instead (needs --key).
    #[arg(long, num_args = 1..)]
    pub aggregate_human: Vec<PathBuf>,
    #[arg(long)]
    pub key: Option<PathBuf>,
}

pub fn cmd_report(a: ReportArgs) -> Result<()> {
    if !a.aggregate_human.is_empty() {
        let Some(key) = &a.key else { bail!("--aggregate-human needs --key key.csv (written with the sheets)") };
        let ratings = human::aggregate(key, &a.aggregate_human)?;
        println!("| run | criterion | mean | sd | n |\n|---|---|---|---|---|");
        for r in ratings {
            println!("| {} | {} | {:.2} | {:.2} | {} |", r.run, r.criterion, r.mean, r.sd, r.n);
        }
        return Ok(());
    }
    let runs = a.runs.iter().map(|d| Run::load(d)).collect::<Result<Vec<_>>>()?;
    let mut files = report::write(&runs, &a.out)?;
    if let Some(n) = a.human_items {
        files.extend(human::export(&runs, &a.out.join("human_eval"), n, a.raters, a.seed)?);
    }
    println!("{}", std::fs::read_to_string(a.out.join("report.md"))?);
    eprintln!("[{} files written under {}]", files.len(), a.out.display());
    Ok(())
}

#[derive(Clone, Copy, ValueEnum)]
pub enum PlotKind {
    /// scripts/bench_serve.py's JSON rows: requests/s and latency per client count.
    ServeLoad,
    /// `merg bench-agents`' JSON (here or --server): wall per dialogue, prompt tokens.
    BenchAgents,
}

#[derive(Args)]
pub struct PlotArgs {
    /// What the JSON is.
    pub kind: PlotKind,
    /// The JSON file, as the benchmark printed it.
    pub input: PathBuf,
    /// The figure to write: FILE.svg or FILE.png.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn cmd_plot(a: PlotArgs) -> Result<()> {
    super::figure_name("out", &a.out)?;
    let text = merg::input::read_string(&a.input, &merg::input::BENCH_JSON)?;
    let json: serde_json::Value = serde_json::from_str(&text).with_context(|| format!("{}: not JSON", a.input.display()))?;
    let fig = match a.kind {
        PlotKind::ServeLoad => benches::serve_load(&json),
        PlotKind::BenchAgents => benches::bench_agents(&json),
    }
    .with_context(|| a.input.display().to_string())?;
    fig.save(&a.out)?;
    eprintln!("[figure written to {}]", a.out.display());
    Ok(())
}
