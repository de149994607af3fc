//! The one argument group that names and loads a model, shared by every command that takes
//! one (`generate`, `respond`, `eval`, `serve`, `bench`, `bench-agents`, `info`, `plan`), and
//! the steps they all take with it: so a GGUF file, a directory, a hub repo or `org/repo:QUANT`
//! and `--quant` mean the same on every command, and bad input fails with the same words.

use std::path::PathBuf;

use anyhow::{anyhow, bail, Result};
use candle_core::{DType, Device};
use clap::Args;

use merg::checkpoint::{Checkpoint, LoadOptions};
use merg::gguf::{AlreadyQuantized, GgufPaths, Opened, SeveralProjectors};
use merg::hub::ModelFiles;
use merg::weights::Quant;

use super::device_and_dtype;

#[derive(Args, Clone, Debug, Default)]
pub struct ModelArgs {
    /// A llama.cpp GGUF file (its mmproj-*.gguf beside it, or --mmproj), a directory (a
    /// checkpoint, or GGUF files), or a Hugging Face repo id (`org/repo`, or `org/repo:Q4_K_M`
    /// for one file of a GGUF repo; HF_HOME / HF_HUB_OFFLINE=1 honoured).
    #[arg(long)]
    pub model: Option<String>,
    /// The vision projector (mmproj-*.gguf) of a GGUF model, when it is not beside the model.
    #[arg(long)]
    pub mmproj: Option<PathBuf>,
    /// Hub revision (branch, tag or commit) of a repo id.
    #[arg(long)]
    pub revision: Option<String>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// f32, f16 or bf16 (default: a GGUF file's own float type, else bf16 on CUDA and f32 on
    /// CPU; `plan` plans bf16).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Quantize the decoder's linear weights while loading: q8_0, q6k, q5k or q4k (llama.cpp's
    /// formats; embeddings and norms stay as they are). `bench` compares several in one run:
    /// comma-separated, `none` or a dtype among them.
    #[arg(long, value_delimiter = ',')]
    pub quant: Vec<String>,
    /// With --quant, quantize the vision tower's linear weights too.
    #[arg(long, requires = "quant")]
    pub quant_vision: bool,
    /// No progress bars (loading, quantizing, downloading, evaluating); they show only on a
    /// terminal anyway.
    #[arg(long)]
    pub quiet: bool,
}

/// Where `--model` points.
pub enum Located {
    Gguf(GgufPaths),
    Files(Box<ModelFiles>),
}

impl ModelArgs {
    /// `--model`, for the commands (and modes) that need one.
    pub fn name(&self) -> Result<&str> {
        self.model.as_deref().ok_or_else(|| anyhow!("--model is required"))
    }

    /// The one in-situ quantization every command but `bench` takes.
    pub fn quant(&self) -> Result<Option<Quant>> {
        match self.quant.as_slice() {
            [] => Ok(None),
            [q] => Quant::parse(q).map(Some),
            many => bail!("--quant {}: one format here (`merg bench` alone compares several in one run)", many.join(",")),
        }
    }

    pub fn device_and_dtype(&self) -> Result<(Device, Option<DType>)> {
        device_and_dtype(&self.device, self.dtype.as_deref())
    }

    /// The files `--model` (and `--mmproj`, `--revision`) name.
    pub fn locate(&self) -> Result<Located> {
        let m = self.name()?;
        if let Some(paths) = merg::gguf::resolve(m, self.revision.as_deref(), self.mmproj.as_deref()).map_err(model_error)? {
            return Ok(Located::Gguf(paths));
        }
        if let Some(p) = &self.mmproj {
            bail!("--mmproj {}: only a GGUF model takes a separate vision projector; {m} is not one", p.display());
        }
        Ok(Located::Files(Box::new(merg::hub::resolve(m, self.revision.as_deref()).map_err(|e| anyhow!("--model {m}: {e:#}"))?)))
    }

    /// Opens GGUF files and checks `quant` against them, in the words every command uses.
    pub fn open_gguf(&self, paths: &GgufPaths, quant: Option<Quant>) -> Result<Opened> {
        let opened = merg::gguf::open(paths)?;
        opened.check_quant(paths, quant).map_err(quant_error)?;
        Ok(opened)
    }

    /// The model as the engine runs it.
    pub fn load(&self) -> Result<Checkpoint> {
        let (device, dtype) = self.device_and_dtype()?;
        let quant = self.quant()?;
        let opts = LoadOptions { dtype, quant, quant_vision: self.quant_vision };
        match self.locate()? {
            Located::Gguf(paths) => Checkpoint::load_gguf(&paths, &device, &opts).map_err(quant_error),
            Located::Files(files) => Checkpoint::load_with(*files, &device, &opts),
        }
    }
}

/// A `--model` resolution error in the flags' words (several projectors: `--mmproj` picks).
fn model_error(e: anyhow::Error) -> anyhow::Error {
    match e.downcast_ref::<SeveralProjectors>() {
        Some(p) => anyhow!("--model: {p}; give it with --mmproj FILE"),
        None => anyhow!("--model: {e:#}"),
    }
}

/// `--quant` on a file already in blocks, in the flags' words.
fn quant_error(e: anyhow::Error) -> anyhow::Error {
    match e.downcast_ref::<AlreadyQuantized>() {
        Some(q) => anyhow!("--quant: {q}; run it without --quant"),
        None => e,
    }
}
