//! The `merg` command line: one file per command, plus the argument groups and helpers they
//! share. The library under src/ holds the logic; this layer parses flags, loads inputs and
//! prints, and turns library errors into messages that name the flags to change.

pub mod bench;
pub mod eval;
pub mod generate;
pub mod info;
pub mod model;
pub mod plan;
pub mod progress;
pub mod report;
pub mod respond;
#[cfg(feature = "serve")]
pub mod serve;
pub mod words;

use anyhow::Result;
use clap::Args;

use merg::checkpoint::parse_device;
use merg::engine::EngineError;
use merg::generate::SamplingParams;
use merg::weights::parse_dtype;

pub use model::{Located, ModelArgs};

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
    /// Context window in tokens (default: the model's own, max_position_embeddings).
    #[arg(long)]
    max_context: Option<usize>,
    /// How the KV cache stores K and V: auto (the model's dtype) or q8 (8-bit codes with one
    /// scale per 32 values, like llama.cpp's q8_0 cache: about half of bf16's memory).
    #[arg(long, default_value = "auto")]
    kv_dtype: String,
}

impl EngineArgs {
    /// The engine's settings, checked before any model is loaded.
    pub fn config(&self) -> Result<merg::engine::EngineConfig> {
        let cfg = merg::engine::EngineConfig {
            block_size: self.block_size,
            kv_memory: self.kv_memory.parse()?,
            scheduler: merg::engine::scheduler::SchedulerConfig {
                max_num_seqs: self.max_num_seqs,
                max_step_tokens: self.max_step_tokens,
            },
            state_memory: match &self.state_memory {
                Some(m) => Some(merg::engine::parse_bytes(m).map_err(|e| anyhow::anyhow!("--state-memory: {e:#}"))?),
                None => None,
            },
            max_context: self.max_context,
            kv_dtype: self.kv_dtype.parse()?,
            ..Default::default()
        };
        cfg.validate(None)?;
        Ok(cfg)
    }
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
    let device = parse_device(device)?;
    let dtype = dtype.map(parse_dtype).transpose()?;
    Ok((device, dtype))
}

/// A figure's file name (flag id `name`): .svg or .png, checked before anything is measured.
pub fn figure_name(name: &'static str, path: &std::path::Path) -> Result<()> {
    match merg::report::plot::check_extension(path) {
        Ok(_) => Ok(()),
        Err(_) => Err(merg::InvalidSetting::new(name, path.display(), "a file name ending in .svg or .png").into()),
    }
}

/// An engine error with the flag that addresses it, for the terminal.
pub fn with_hint(e: EngineError) -> anyhow::Error {
    match &e {
        EngineError::OverCapacity(_) => anyhow::anyhow!("{e} (raise --kv-memory)"),
        EngineError::BadRequest(m) if m.contains("context window") => anyhow::anyhow!("{e} (see --max-context)"),
        _ => anyhow::Error::new(e),
    }
}
