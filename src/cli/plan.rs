//! `merg plan`: will this model fit this memory, and with how many dialogues?

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use merg::models::registry;
use merg::plan::{plan, plan_with_load, Budget, Precision};

#[derive(Args)]
pub struct PlanArgs {
    /// A checkpoint (repo id or directory; only its config.json is read) or GGUF files (their
    /// metadata and tensor sizes are read).
    #[arg(long, required_unless_present = "config", conflicts_with = "config")]
    model: Option<String>,
    /// The vision projector of a GGUF model, when not beside it.
    #[arg(long)]
    mmproj: Option<PathBuf>,
    /// A config.json alone (e.g. models/qwen3.5-27b.json).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Quantize the decoder's linear layers: q8_0, q6k, q5k, q4k (as --quant).
    #[arg(long)]
    quant: Option<String>,
    /// Quantize the vision tower too.
    #[arg(long)]
    quant_vision: bool,
    /// Dense weights and K/V: bf16, f16 or f32.
    #[arg(long, default_value = "bf16")]
    dtype: String,
    /// The device's memory, e.g. 24GiB.
    #[arg(long)]
    memory: String,
    /// The host's memory when the weights load onto a GPU of --memory (e.g. 32GiB); without it
    /// the plan is for one memory (CPU), which must also hold the load's peak.
    #[arg(long)]
    host_memory: Option<String>,
    /// Kept back for activations, workspace and the runtime.
    #[arg(long, default_value = "1.5GiB")]
    reserve: String,
    #[arg(long, default_value_t = 8)]
    dialogues: u64,
    /// Tokens of each dialogue's context.
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub fn cmd_plan(a: PlanArgs) -> Result<()> {
    let dense_bytes = match a.dtype.as_str() {
        "bf16" | "f16" => 2.0,
        "f32" => 4.0,
        other => anyhow::bail!("--dtype {other:?}: use bf16, f16 or f32"),
    };
    // A GGUF model: the config from its metadata, the weights as its files store them.
    let mut gguf_weights = None;
    let (path, config) = match (&a.model, &a.config) {
        (_, Some(c)) => (c.clone(), registry::read_config(c)?),
        (Some(m), None) => match merg::gguf::resolve(m, None, a.mmproj.as_deref()).map_err(super::model_error)? {
            Some(paths) => {
                let opened = merg::gguf::open(&paths)?;
                gguf_weights = Some(opened.weights.load_cost(dense_bytes, a.host_memory.is_some()));
                if a.quant.is_some() && opened.quantized {
                    anyhow::bail!("--quant: {} is already quantized", paths.text.display());
                }
                (paths.text.clone(), opened.config)
            }
            None => {
                let p = merg::hub::resolve(m, None)?.config;
                let c = registry::read_config(&p)?;
                (p, c)
            }
        },
        (None, None) => anyhow::bail!("give --model or --config"),
    };
    let with_path = |e: anyhow::Error| anyhow::anyhow!("{}: {e:#}", path.display());
    let spec = registry::spec(&config).map_err(with_path)?;
    let params = registry::param_counts(&config).map_err(with_path)?;
    let quant = match &a.quant {
        Some(q) => Some(merg::weights::Quant::parse(q).map_err(|e| anyhow::anyhow!("--quant: {e:#}"))?),
        None => None,
    };
    if a.quant_vision && quant.is_none() {
        anyhow::bail!("--quant-vision needs --quant");
    }
    let budget = merg::engine::parse_bytes(&a.memory).map_err(|e| anyhow::anyhow!("--memory: {e:#}"))?;
    let reserve = merg::engine::parse_bytes(&a.reserve).map_err(|e| anyhow::anyhow!("--reserve: {e:#}"))?;
    let host = a.host_memory.as_deref().map(merg::engine::parse_bytes).transpose().map_err(|e| anyhow::anyhow!("--host-memory: {e:#}"))?;
    let budget = Budget { device: budget, host, reserve };
    let prec = Precision { dense_bytes, quant, quant_vision: a.quant_vision };
    let p = match gguf_weights.filter(|_| quant.is_none()) {
        Some(w) => plan_with_load(&params, &spec, prec, w, budget, a.context, a.dialogues),
        None => plan(&params, &spec, prec, budget, a.context, a.dialogues),
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        println!("model:              {} ({}, {} params)", path.display(), spec.model_type, super::info::billions(params.total()));
        println!("{p}");
    }
    Ok(())
}
