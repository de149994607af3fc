//! `merg eval` (a dataset split through the pipeline, resumable, shardable, mergeable) and
//! `merg memory` (the exemplar memory from a held-out split).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};

use merg::data::{iemocap, meld, Item, LoadReport};
use merg::engine::{Engine, EngineThread};
use merg::eval::summary::SummaryOptions;
use merg::eval::{self, Evaluator, RunSpec, Scorers};
use merg::metrics::bertscore::{self, BertScorer};
use merg::metrics::polarity::{self, EmotionClassifier};
use merg::pipeline::model::EngineModel;

use super::respond::PipelineArgs;
use super::{EngineArgs, ModelArgs};

#[derive(Clone, Copy, ValueEnum, PartialEq)]
pub enum DatasetArg {
    Meld,
    Iemocap,
}

#[derive(Args)]
pub struct DataArgs {
    #[arg(long, value_enum)]
    pub dataset: DatasetArg,
    /// MELD: train, dev or test. IEMOCAP: a session number (5 = the usual test session).
    #[arg(long)]
    pub split: String,
    /// MELD: the folder with *_sent_emo.csv. IEMOCAP: the folder holding Session1..Session5.
    #[arg(long)]
    pub data_dir: PathBuf,
    /// MELD: the folder with train_splits/, dev_splits_complete/, output_repeated_splits_test/.
    /// IEMOCAP: videos are looked up under the data dir when this is given (any value).
    #[arg(long)]
    pub video_root: Option<PathBuf>,
}

impl DataArgs {
    pub fn load(&self) -> Result<(Vec<Item>, LoadReport)> {
        match self.dataset {
            DatasetArg::Meld => meld::load(&self.data_dir, self.split.parse()?, self.video_root.as_deref()),
            DatasetArg::Iemocap => {
                let s: u32 = match self.split.trim().trim_start_matches("Session").parse() {
                    Ok(s) if (1..=5).contains(&s) => s,
                    _ => return Err(merg::InvalidSetting::new("split", &self.split, "a session number 1 to 5 (IEMOCAP's sessions)").into()),
                };
                iemocap::load(&self.data_dir, s, self.video_root.is_some())
            }
        }
    }

    fn name(&self) -> &'static str {
        match self.dataset {
            DatasetArg::Meld => "meld",
            DatasetArg::Iemocap => "iemocap",
        }
    }
}

#[derive(Args)]
#[command(mut_arg("model", |a| a.required_unless_present("merge")))]
pub struct EvalArgs {
    /// Combine finished shard runs (folders) into --out instead of running anything.
    #[arg(long, num_args = 1.., conflicts_with_all = ["dataset", "model"])]
    pub merge: Vec<PathBuf>,
    #[arg(long, value_enum, required_unless_present = "merge")]
    pub dataset: Option<DatasetArg>,
    /// MELD: train, dev or test. IEMOCAP: a session number (5 = the usual test session).
    #[arg(long, required_unless_present = "merge")]
    pub split: Option<String>,
    /// MELD: the folder with *_sent_emo.csv. IEMOCAP: the folder holding Session1..Session5.
    #[arg(long, required_unless_present = "merge")]
    pub data_dir: Option<PathBuf>,
    /// MELD: the folder with the clip folders (or one split's clips). IEMOCAP: any value turns
    /// on the dialogs' videos under the data dir.
    #[arg(long)]
    pub video_root: Option<PathBuf>,
    /// The model (`--device` is where the metric models run too).
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub pipeline: PipelineArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
    /// Only the first N items of the split.
    #[arg(long)]
    pub limit: Option<usize>,
    /// Run part K of N (1-based), e.g. a Slurm array task: --shard $((SLURM_ARRAY_TASK_ID+1))/N.
    #[arg(long)]
    pub shard: Option<String>,
    /// Run folder; re-running with the same folder resumes.
    #[arg(long)]
    pub out: PathBuf,
    /// Dialogues in flight at once (their agent calls batch together in the engine).
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// BERTScore model (repo id or directory; layer from bert-score's table unless --bertscore-layers).
    #[arg(long, default_value = bertscore::DEFAULT_MODEL)]
    pub bertscore_model: String,
    #[arg(long)]
    pub bertscore_layers: Option<usize>,
    /// bert-score baseline TSV for rescaling (off by default, as in bert-score).
    #[arg(long)]
    pub bertscore_baseline: Option<PathBuf>,
    #[arg(long)]
    pub no_bertscore: bool,
    /// Emotion classifier for the emotion polarity (DistilBERT sequence classifier).
    #[arg(long, default_value = polarity::DEFAULT_EMOTION_MODEL)]
    pub emotion_model: String,
    #[arg(long)]
    pub no_emotion_polarity: bool,
    /// Distinct-n over chunks of N replies (default: corpus-level over all replies).
    #[arg(long)]
    pub distinct_chunk: Option<usize>,
}

/// The counts that must be at least one when given.
fn check_counts(a: &EvalArgs) -> Result<()> {
    use merg::setting::at_least_one;
    at_least_one("concurrency", a.concurrency)?;
    a.limit.map(|n| at_least_one("limit", n)).transpose()?;
    a.distinct_chunk.map(|n| at_least_one("distinct_chunk", n)).transpose()?;
    Ok(())
}

pub fn cmd_eval(a: EvalArgs) -> Result<()> {
    if !a.merge.is_empty() {
        let s = eval::merge(&a.merge, &a.out)?;
        println!("{}", std::fs::read_to_string(a.out.join("summary.md"))?);
        eprintln!("[merged {} runs: {} items]", a.merge.len(), s.items);
        return Ok(());
    }
    let need = |what: &str| anyhow::anyhow!("{what} is required (or --merge)");
    let data = DataArgs {
        dataset: a.dataset.ok_or_else(|| need("--dataset"))?,
        split: a.split.clone().ok_or_else(|| need("--split"))?,
        data_dir: a.data_dir.clone().ok_or_else(|| need("--data-dir"))?,
        video_root: a.video_root.clone(),
    };
    let data = &data;
    a.model.name().map_err(|_| need("--model"))?;
    let model = &a.model;
    // Every setting is checked before the data and the model are read.
    let shard = a.shard.as_deref().map(eval::parse_shard).transpose()?;
    check_counts(&a)?;
    let mut pipeline = a.pipeline.clone();
    if pipeline.labels.is_none() {
        pipeline.labels = Some(data.name().to_string());
    }
    let cfg = pipeline.config()?;
    let (items, report) = data.load()?;
    eprintln!("[{}]", report.summary());
    let total_items = a.limit.unwrap_or(items.len()).min(items.len());
    let selected = eval::select(items, a.limit, shard);
    if selected.is_empty() {
        bail!("nothing to evaluate: the split has no items (or --limit/--shard leave none)");
    }
    let memory = pipeline.memory()?;
    if let Some(m) = &memory {
        eval::check_memory_is_held_out(m, &selected)?;
    }
    let spec = RunSpec {
        dataset: data.name().into(),
        split: data.split.clone(),
        data_dir: data.data_dir.clone(),
        video_root: data.video_root.clone(),
        model: model.name()?.to_string(),
        revision: model.revision.clone(),
        pipeline: cfg,
        frames_per_turn: pipeline.frames_per_turn,
        max_frames: pipeline.max_frames,
        max_audio: pipeline.max_audio_clips,
        memory: pipeline.memory.clone(),
        limit: a.limit,
        shard,
        bertscore_model: (!a.no_bertscore).then(|| a.bertscore_model.clone()),
        bertscore_layers: a.bertscore_layers,
        bertscore_baseline: a.bertscore_baseline.clone(),
        emotion_model: (!a.no_emotion_polarity).then(|| a.emotion_model.clone()),
        summary: SummaryOptions { distinct_chunk: a.distinct_chunk },
        total_items,
        merg_version: env!("CARGO_PKG_VERSION").into(),
    };
    let scorers = load_scorers(&spec, &model.device)?;
    let prompts = pipeline.prompts()?;
    let cfg = a.engine.config()?;
    let engine = Engine::new(model.load()?, cfg)?;
    eprintln!("{}", engine.kv_summary());
    if let Some(line) = engine.state_summary() {
        eprintln!("{line}");
    }
    let thread = EngineThread::spawn(engine);
    let agent_model = EngineModel::new(thread.handle.clone())?;
    let ev = Evaluator { spec: &spec, model: &agent_model, prompts: &prompts, memory: memory.as_ref(), scorers: &scorers };
    let s = ev.run(&selected, &a.out, a.concurrency)?;
    println!("{}", std::fs::read_to_string(a.out.join("summary.md"))?);
    if s.failed > 0 {
        eprintln!("[{} of {} items failed; see `error` in {}; re-run the same command to retry them]", s.failed, s.items, a.out.join("results.jsonl").display());
    }
    Ok(())
}

fn load_scorers(spec: &RunSpec, device: &str) -> Result<Scorers> {
    let dev = merg::checkpoint::parse_device(device)?;
    let bertscore = match &spec.bertscore_model {
        Some(m) => {
            let mut s = BertScorer::load(m, spec.bertscore_layers, &dev)
                .with_context(|| format!("loading the BERTScore model {m} (or pass --no-bertscore)"))?;
            if let Some(b) = &spec.bertscore_baseline {
                s.set_baseline_file(b)?;
            }
            Some(s)
        }
        None => None,
    };
    let emotion = match &spec.emotion_model {
        Some(m) => Some(
            EmotionClassifier::load(m, &dev)
                .with_context(|| format!("loading the emotion classifier {m} (or pass --no-emotion-polarity)"))?,
        ),
        None => None,
    };
    Ok(Scorers { bertscore, emotion })
}

#[derive(Args)]
pub struct MemoryArgs {
    #[command(flatten)]
    pub data: DataArgs,
    /// Where the JSONL memory goes.
    #[arg(long)]
    pub out: PathBuf,
}

pub fn cmd_memory(a: MemoryArgs) -> Result<()> {
    let (items, report) = a.data.load()?;
    eprintln!("[{}]", report.summary());
    if items.is_empty() {
        bail!("the split has no items to build a memory from");
    }
    let m = eval::build_memory(&items);
    m.write_jsonl(Path::new(&a.out))?;
    eprintln!("[{} exemplars written to {}]", m.len(), a.out.display());
    Ok(())
}
