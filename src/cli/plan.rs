//! `merg plan`: will this model fit this memory, and with how many dialogues?

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;

use merg::models::registry;
use merg::plan::{plan, Precision};

#[derive(Args)]
pub struct PlanArgs {
    /// A checkpoint (repo id or directory); only its config.json is read.
    #[arg(long, required_unless_present = "config", conflicts_with = "config")]
    model: Option<String>,
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
    let path = match (&a.model, &a.config) {
        (_, Some(c)) => c.clone(),
        (Some(m), None) => merg::hub::resolve(m, None)?.config,
        (None, None) => anyhow::bail!("give --model or --config"),
    };
    let config = registry::read_config(&path)?;
    let with_path = |e: anyhow::Error| anyhow::anyhow!("{}: {e:#}", path.display());
    let spec = registry::spec(&config).map_err(with_path)?;
    let params = registry::param_counts(&config).map_err(with_path)?;
    let dense_bytes = match a.dtype.as_str() {
        "bf16" | "f16" => 2.0,
        "f32" => 4.0,
        other => anyhow::bail!("--dtype {other:?}: use bf16, f16 or f32"),
    };
    let quant = match &a.quant {
        Some(q) => Some(merg::weights::Quant::parse(q).map_err(|e| anyhow::anyhow!("--quant: {e:#}"))?),
        None => None,
    };
    if a.quant_vision && quant.is_none() {
        anyhow::bail!("--quant-vision needs --quant");
    }
    let budget = merg::engine::parse_bytes(&a.memory).map_err(|e| anyhow::anyhow!("--memory: {e:#}"))?;
    let reserve = merg::engine::parse_bytes(&a.reserve).map_err(|e| anyhow::anyhow!("--reserve: {e:#}"))?;
    let p = plan(&params, &spec, Precision { dense_bytes, quant, quant_vision: a.quant_vision }, budget, reserve, a.context, a.dialogues);
    if a.json {
        println!("{}", serde_json::to_string_pretty(&p)?);
    } else {
        println!("model:              {} ({}, {} params)", path.display(), spec.model_type, super::info::billions(params.total()));
        println!("{p}");
    }
    Ok(())
}
