//! `merg respond`: one dialogue in, the empathetic reply out, plus a JSON trace.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::{Args, ValueEnum};

use merg::data::labels::LabelSet;
use merg::dialogue::Dialogue;
use merg::engine::{Engine, EngineThread};
use merg::generate::SamplingParams;
use merg::pipeline::frames::{self, FrameOptions, FrameReport};
use merg::pipeline::hearing::{self, AudioReport};
use merg::pipeline::model::EngineModel;
use merg::pipeline::prompt::Prompts;
use merg::pipeline::retrieval::Memory;
use merg::pipeline::{Baseline, Mode, Pipeline, PipelineConfig};

use super::{EngineArgs, ModelArgs};

#[derive(Clone, Copy, ValueEnum)]
pub enum ModeArg {
    Cascaded,
    Independent,
}

#[derive(Clone, Copy, ValueEnum)]
pub enum BaselineArg {
    /// One plain "reply with empathy" prompt.
    Plain,
    /// One-pass Chain-of-Empathy (event → emotion → cause → intent → reply).
    Coe,
}

/// Pipeline switches shared by `respond` and `eval`.
#[derive(Args, Clone)]
pub struct PipelineArgs {
    /// Emotion label set: meld, iemocap, or a comma-separated list (default: meld for
    /// respond, the dataset's own for eval).
    #[arg(long)]
    pub labels: Option<String>,
    /// Refinement rounds after the first pass (0–5).
    #[arg(long, default_value_t = 2)]
    pub t_max: usize,
    /// Exemplars retrieved for the reply generator (0–5).
    #[arg(long, default_value_t = 1)]
    pub top_k: usize,
    /// Exemplar memory (JSONL from `merg memory`); without it SGRG gets no exemplars.
    #[arg(long)]
    pub memory: Option<PathBuf>,
    #[arg(long)]
    pub no_mpa: bool,
    #[arg(long)]
    pub no_caef: bool,
    #[arg(long)]
    pub no_psp: bool,
    #[arg(long)]
    pub no_gra: bool,
    #[arg(long, value_enum, default_value = "cascaded")]
    pub mode: ModeArg,
    /// Take the last round's reply instead of selecting by (c1, c2, c3, c4, −t).
    #[arg(long)]
    pub no_selection: bool,
    /// Run a one-pass baseline instead of the agents.
    #[arg(long, value_enum)]
    pub baseline: Option<BaselineArg>,
    /// Per-agent token budget.
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// Cap on free-text fields of agent outputs (characters).
    #[arg(long, default_value_t = 160)]
    pub max_field_chars: usize,
    #[arg(long, default_value_t = 0.7)]
    pub temperature: f64,
    #[arg(long, default_value_t = 0.9)]
    pub top_p: f64,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Directory overriding prompts/*.j2 templates (missing ones use the built-in).
    #[arg(long)]
    pub prompts: Option<PathBuf>,
    /// Keyframes sampled per turn clip or frame list.
    #[arg(long, default_value_t = 1)]
    pub frames_per_turn: usize,
    /// Keyframes shown at most (the most recent are kept).
    #[arg(long, default_value_t = 8)]
    pub max_frames: usize,
    /// Continue text-only for media (images, videos, audio) that cannot be read (noted in the
    /// trace) instead of failing.
    #[arg(long)]
    pub skip_bad_media: bool,
    /// Audio clips heard at most, one per turn (the most recent turns are kept). Not `serve`'s
    /// `--max-audio`, which refuses requests with more clips.
    #[arg(long, default_value_t = merg::pipeline::hearing::DEFAULT_MAX_AUDIO)]
    pub max_audio_clips: usize,
    /// Give the model no audio, even when it hears (recorded in the trace).
    #[arg(long)]
    pub no_audio: bool,
}

impl PipelineArgs {
    pub fn config(&self) -> Result<PipelineConfig> {
        let cfg = PipelineConfig {
            use_mpa: !self.no_mpa,
            use_caef: !self.no_caef,
            use_psp: !self.no_psp,
            use_gra: !self.no_gra,
            mode: match self.mode {
                ModeArg::Cascaded => Mode::Cascaded,
                ModeArg::Independent => Mode::Independent,
            },
            t_max: self.t_max,
            top_k: self.top_k,
            selection: !self.no_selection,
            baseline: self.baseline.map(|b| match b {
                BaselineArg::Plain => Baseline::Plain,
                BaselineArg::Coe => Baseline::Coe,
            }),
            labels: LabelSet::from_spec(self.labels.as_deref().unwrap_or("meld"))?.labels,
            sampling: SamplingParams {
                temperature: self.temperature,
                top_p: self.top_p,
                seed: self.seed,
                max_new_tokens: self.max_new_tokens,
                ..Default::default()
            },
            max_field_chars: self.max_field_chars,
            use_audio: !self.no_audio,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    pub fn frame_options(&self) -> FrameOptions {
        FrameOptions { frames_per_turn: self.frames_per_turn, max_frames: self.max_frames, max_audio: self.max_audio_clips, skip_bad_media: self.skip_bad_media }
    }

    pub fn prompts(&self) -> Result<Prompts> {
        match &self.prompts {
            Some(d) => Prompts::from_dir(d),
            None => Ok(Prompts::builtin()),
        }
    }

    pub fn memory(&self) -> Result<Option<Memory>> {
        self.memory.as_deref().map(Memory::from_jsonl).transpose()
    }
}

#[derive(Args)]
#[command(mut_arg("model", |a| a.required(true)))]
pub struct RespondArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Dialogue JSON (see README: {"turns": [...], "next_speaker": ...} or MELD-style rows).
    #[arg(long)]
    pub dialogue: PathBuf,
    /// A video of the dialogue; keyframes are sampled from it (up to --max-frames).
    #[arg(long)]
    pub video: Option<PathBuf>,
    /// Keyframe images of the dialogue, in time order.
    #[arg(long, num_args = 1..)]
    pub frames: Vec<PathBuf>,
    /// One audio file (WAV, FLAC, MP3, …) per history turn, in turn order; replaces the
    /// dialogue's "audio" fields.
    #[arg(long, num_args = 1..)]
    pub audio: Vec<PathBuf>,
    /// Where the JSON trace goes (default: <dialogue file stem>.trace.json in the current directory).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    #[command(flatten)]
    pub pipeline: PipelineArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

pub fn cmd_respond(a: RespondArgs) -> Result<()> {
    let cfg = a.pipeline.config()?;
    let mut dialogue = Dialogue::from_json_file(&a.dialogue)?;
    if let Some(v) = &a.video {
        dialogue.video = Some(v.clone());
    }
    dialogue.frames.extend(a.frames.iter().cloned());
    set_audio(&mut dialogue, &a.audio)?;
    let mut report = FrameReport::default();
    let opts = a.pipeline.frame_options();
    let keyframes = frames::collect(&dialogue, &opts, &mut report).context("collecting keyframes (--skip-bad-media continues past unreadable media)")?;
    let mut audio_report = AudioReport::default();
    let clips = match cfg.use_audio {
        true => hearing::collect(&dialogue, &opts, &mut audio_report).context("collecting the turns' audio (--skip-bad-media continues past unreadable audio)")?,
        false => vec![],
    };
    let prompts = a.pipeline.prompts()?;
    let memory = a.pipeline.memory()?;
    let trace_path = a.trace.clone().unwrap_or_else(|| {
        let stem = a.dialogue.file_stem().and_then(|s| s.to_str()).unwrap_or("dialogue");
        PathBuf::from(format!("{stem}.trace.json"))
    });
    let engine_cfg = a.engine.config()?;
    let engine = Engine::new(a.model.load()?, engine_cfg)?;
    eprintln!("{}", engine.kv_summary());
    if let Some(line) = engine.state_summary() {
        eprintln!("{line}");
    }
    let thread = EngineThread::spawn(engine);
    let model = EngineModel::new(thread.handle.clone())?;
    let pipeline = Pipeline { model: &model, prompts: &prompts, memory: memory.as_ref(), cfg: &cfg };
    let trace = pipeline.respond_heard(&dialogue, keyframes, report, clips, audio_report).with_context(|| format!("answering dialogue {}", a.dialogue.display()))?;
    std::fs::write(&trace_path, serde_json::to_string_pretty(&trace)?)
        .with_context(|| format!("writing the trace to {}", trace_path.display()))?;
    println!("{}", trace.reply);
    eprintln!(
        "[{} rounds, round {} selected; {} of {} prompt tokens from the prefix cache; trace: {}]",
        trace.rounds.len(),
        trace.selected_round,
        trace.totals.cached_tokens,
        trace.totals.prompt_tokens,
        trace_path.display()
    );
    Ok(())
}

/// `--audio`: one file per history turn, in turn order, over the dialogue's own.
fn set_audio(dialogue: &mut Dialogue, files: &[PathBuf]) -> Result<()> {
    if files.is_empty() {
        return Ok(());
    }
    if files.len() != dialogue.turns.len() {
        bail!("--audio: {} files given, but the dialogue has {} turns; give one audio file per history turn, in turn order", files.len(), dialogue.turns.len());
    }
    for (t, f) in dialogue.turns.iter_mut().zip(files) {
        t.audio = Some(f.clone());
    }
    Ok(())
}
