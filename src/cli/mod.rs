//! The `merg` command line: one file per command, plus the argument groups and helpers they
//! share. The library under src/ holds the logic; this layer parses flags, loads inputs and
//! prints, and turns library errors into messages that name the flags to change.

pub mod bench;
pub mod eval;
pub mod generate;
pub mod info;
pub mod plan;
pub mod report;
pub mod respond;
#[cfg(feature = "serve")]
pub mod serve;

use anyhow::Result;
use clap::Args;

use merg::checkpoint::{parse_device, Checkpoint};
use merg::engine::EngineError;
use merg::generate::SamplingParams;
use merg::weights::parse_dtype;

/// Paged-engine settings shared by the commands that run the engine.
#[derive(Args)]
pub struct EngineArgs {
    /// KV pool size: auto (the memory plan: what the loaded model leaves free, less a 1.5 GiB
    /// reserve and the recurrent states, capped at max-num-seqs × context), a fraction of
    /// free memory (0.5), bytes (4GiB) or blocks:N.
    #[arg(long, default_value = "auto")]
    kv_memory: String,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    #[arg(long, default_value_t = 2048)]
    max_step_tokens: usize,
    /// Hybrid models (Qwen3.5): bytes for recurrent states (one slot per running sequence;
    /// as much again for prefix-cache snapshots), e.g. 2GiB. Default: a quarter of the KV pool.
    #[arg(long)]
    state_memory: Option<String>,
}

impl EngineArgs {
    pub fn config(&self) -> Result<merg::engine::EngineConfig> {
        if self.block_size == 0 {
            anyhow::bail!("--block-size must be at least 1");
        }
        Ok(merg::engine::EngineConfig {
            block_size: self.block_size,
            kv_memory: self.kv_memory.parse().map_err(|e: anyhow::Error| anyhow::anyhow!("--kv-memory: {e:#}"))?,
            scheduler: merg::engine::scheduler::SchedulerConfig {
                max_num_seqs: self.max_num_seqs.max(1),
                max_step_tokens: self.max_step_tokens.max(1),
            },
            state_memory: match &self.state_memory {
                Some(m) => Some(merg::engine::parse_bytes(m).map_err(|e| anyhow::anyhow!("--state-memory: {e:#}"))?),
                None => None,
            },
            ..Default::default()
        })
    }
}

#[derive(Args, Clone)]
pub struct ModelArgs {
    /// Hugging Face repo id (uses the hub cache; HF_HOME / HF_HUB_OFFLINE=1 honoured), a local
    /// directory, or a llama.cpp GGUF file (or a directory of them, with its mmproj-*.gguf).
    #[arg(long)]
    pub model: String,
    /// The vision projector (mmproj-*.gguf) of a GGUF model, when it is not beside the model.
    #[arg(long)]
    pub mmproj: Option<std::path::PathBuf>,
    #[arg(long)]
    pub revision: Option<String>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// f32, f16 or bf16 (default: bf16 on CUDA, f32 on CPU).
    #[arg(long)]
    pub dtype: Option<String>,
    /// Quantize the decoder's linear weights while loading: q8_0, q6k, q5k or q4k
    /// (llama.cpp's formats; embeddings and norms stay as they are).
    #[arg(long)]
    pub quant: Option<String>,
    /// With --quant, quantize the vision tower's linear weights too.
    #[arg(long, requires = "quant")]
    pub quant_vision: bool,
}

#[derive(Args)]
pub struct SamplingArgs {
    #[arg(long, default_value_t = 128)]
    pub max_new_tokens: usize,
    /// 0 = greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f64,
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

impl SamplingArgs {
    pub fn params(&self) -> SamplingParams {
        SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            top_k: self.top_k,
            seed: self.seed,
            max_new_tokens: self.max_new_tokens,
            stop_token_ids: vec![],
        }
    }
}

/// `--device` and `--dtype` (None: the device's default), each error naming its flag.
pub fn device_and_dtype(device: &str, dtype: Option<&str>) -> Result<(candle_core::Device, Option<candle_core::DType>)> {
    let device = parse_device(device).map_err(|e| anyhow::anyhow!("--device: {e:#}"))?;
    let dtype = dtype.map(parse_dtype).transpose().map_err(|e| anyhow::anyhow!("--dtype: {e:#}"))?;
    Ok((device, dtype))
}

/// A `--model` resolution error in the flags' words (several projectors: `--mmproj` picks).
pub fn model_error(e: anyhow::Error) -> anyhow::Error {
    match e.downcast_ref::<merg::gguf::SeveralProjectors>() {
        Some(p) => anyhow::anyhow!("--model: {p}; give it with --mmproj FILE"),
        None => anyhow::anyhow!("--model: {e:#}"),
    }
}

pub fn load_checkpoint(m: &ModelArgs) -> Result<Checkpoint> {
    let (device, dtype) = device_and_dtype(&m.device, m.dtype.as_deref())?;
    let quant = m.quant.as_deref().map(merg::weights::Quant::parse).transpose().map_err(|e| anyhow::anyhow!("--quant: {e:#}"))?;
    let opts = merg::checkpoint::LoadOptions { dtype, quant, quant_vision: m.quant_vision };
    if let Some(paths) = merg::gguf::resolve(&m.model, m.revision.as_deref(), m.mmproj.as_deref()).map_err(model_error)? {
        return Checkpoint::load_gguf(&paths, &device, &opts).map_err(|e| match e.to_string().contains("already quantized") {
            true => anyhow::anyhow!("--quant: {e:#}"),
            false => e,
        });
    }
    if let Some(p) = &m.mmproj {
        anyhow::bail!("--mmproj {}: only a GGUF model takes a separate vision projector; {} is not one", p.display(), m.model);
    }
    let files = merg::hub::resolve(&m.model, m.revision.as_deref())?;
    Checkpoint::load_with(files, &device, &opts)
}

/// An engine error with the flag that addresses it, for the terminal.
pub fn with_hint(e: EngineError) -> anyhow::Error {
    match &e {
        EngineError::OverCapacity(_) => anyhow::anyhow!("{e} (raise --kv-memory)"),
        EngineError::BadRequest(m) if m.contains("context window") => anyhow::anyhow!("{e} (see --max-context)"),
        _ => anyhow::Error::new(e),
    }
}
