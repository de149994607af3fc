//! `merg plan`: will this model fit this memory, and with how many dialogues?

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use merg::models::registry;
use merg::plan::{plan, plan_with_load, Budget, Precision};

use super::{Located, ModelArgs};

#[derive(Args)]
pub struct PlanArgs {
    /// The model: a checkpoint (only its config.json is read) or GGUF files (their metadata
    /// and tensor sizes are read). `--dtype` is the dense weights' and K/V's (default bf16).
    #[command(flatten)]
    model: ModelArgs,
    /// A config.json alone (e.g. models/qwen3.5-27b.json).
    #[arg(long, conflicts_with = "model")]
    config: Option<PathBuf>,
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
    /// How the KV cache stores K and V, as the engine's --kv-dtype: auto (--dtype) or q8.
    #[arg(long, default_value = "auto")]
    kv_dtype: String,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

pub fn cmd_plan(a: PlanArgs) -> Result<()> {
    merg::setting::check(a.dialogues >= 1, "dialogues", a.dialogues, "at least 1")?;
    merg::setting::at_least_one("context", a.context)?;
    let dense_bytes = match a.model.dtype.as_deref().unwrap_or("bf16") {
        "bf16" | "f16" => 2.0,
        "f32" => 4.0,
        other => return Err(merg::InvalidSetting::new("dtype", other, "bf16, f16 or f32").into()),
    };
    let quant = a.model.quant()?;
    // A GGUF model: the config from its metadata, the weights as its files store them.
    let mut gguf_weights = None;
    let (path, config) = match (&a.config, a.model.model.is_some()) {
        (Some(c), _) => (c.clone(), registry::read_config(c)?),
        (None, true) => match a.model.locate()? {
            Located::Gguf(paths) => {
                let opened = a.model.open_gguf(&paths, quant)?;
                gguf_weights = Some(opened.weights.load_cost(dense_bytes, a.host_memory.is_some()));
                (paths.text.clone(), opened.config)
            }
            Located::Files(f) => (f.config.clone(), registry::read_config(&f.config)?),
        },
        (None, false) => anyhow::bail!("give --model or --config"),
    };
    let with_path = |e: anyhow::Error| anyhow::anyhow!("{}: {e:#}", path.display());
    let spec = registry::spec(&config).map_err(with_path)?;
    let params = registry::param_counts(&config).map_err(with_path)?;
    let budget = merg::engine::parse_bytes(&a.memory).map_err(|e| anyhow::anyhow!("--memory: {e:#}"))?;
    let reserve = merg::engine::parse_bytes(&a.reserve).map_err(|e| anyhow::anyhow!("--reserve: {e:#}"))?;
    let host = a.host_memory.as_deref().map(merg::engine::parse_bytes).transpose().map_err(|e| anyhow::anyhow!("--host-memory: {e:#}"))?;
    let budget = Budget { device: budget, host, reserve };
    let kv_q8 = a.kv_dtype.parse::<merg::engine::KvDtype>()? == merg::engine::KvDtype::Q8;
    let prec = Precision { dense_bytes, quant, quant_vision: a.model.quant_vision, kv_q8 };
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
