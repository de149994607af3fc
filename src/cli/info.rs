//! `merg info`: what a checkpoint is (family, sizes, parameters, files), from its config
//! alone — a checkpoint directory / repo, or a bare config.json (`models/*.json`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use super::{Located, ModelArgs};

use merg::models::registry;

#[derive(Args)]
pub struct InfoArgs {
    /// The model (only its config, metadata and file list are read); with --quant, what in-situ
    /// quantization would apply to.
    #[command(flatten)]
    model: ModelArgs,
    /// A config.json alone (e.g. models/qwen3-vl-8b-instruct.json).
    #[arg(long, conflicts_with = "model")]
    config: Option<PathBuf>,
}

/// Billions, one decimal below 10.
pub fn billions(n: u64) -> String {
    let b = n as f64 / 1e9;
    if b < 10.0 {
        format!("{b:.2}B")
    } else {
        format!("{b:.1}B")
    }
}

pub fn cmd_info(a: InfoArgs) -> Result<()> {
    let quant = a.model.quant()?;
    let (config_path, files, config, format, ollama) = match (&a.config, a.model.model.is_some()) {
        (Some(c), _) => (c.clone(), None, registry::read_config(c)?, None, None),
        (None, true) => match a.model.locate()? {
            Located::Gguf(g) => {
                let opened = a.model.open_gguf(&g, quant)?;
                (g.text.clone(), None, opened.config, Some(opened.format), g.ollama)
            }
            Located::Files(f) => (f.config.clone(), Some(f.clone()), registry::read_config(&f.config)?, None, None),
        },
        (None, false) => anyhow::bail!("give --model or --config"),
    };
    let with_path = |e: anyhow::Error| anyhow::anyhow!("{}: {e:#}", config_path.display());
    let spec = registry::spec(&config).map_err(with_path)?;
    let params = registry::param_counts(&config).map_err(with_path)?;
    match &files {
        Some(f) => {
            println!("model:     {}", f.source);
            println!("dir:       {}", f.dir.display());
        }
        None => println!("config:    {}", config_path.display()),
    }
    if let Some(f) = &format {
        println!("format:    {} (llama.cpp file type {})", f.name, f.file_type.as_deref().unwrap_or("unknown"));
    }
    if let Some(o) = &ollama {
        ollama_layers(o);
    }
    if let Some(q) = quant {
        let tower = if a.model.quant_vision { " and vision tower" } else { "" };
        println!("quant:     {} in situ (decoder{tower} linear weights)", q.name());
    }
    println!("family:    {}", spec.model_type);
    let recurrent = spec.layers.len() - spec.num_attention_layers();
    let sliding = match spec.sliding_window() {
        Some(w) => format!(", {} of them sliding-window ({w} tokens)", spec.num_sliding_layers()),
        None => String::new(),
    };
    println!(
        "text:      {} layers ({} attention{sliding}, {recurrent} linear attention), hidden {}, head_dim {}, {} kv heads, vocab {}, context {}",
        spec.layers.len(),
        spec.num_attention_layers(),
        spec.hidden_size,
        spec.head_dim,
        spec.num_kv_heads,
        spec.vocab_size,
        spec.max_context
    );
    if let Some(v) = &spec.vision {
        println!("vision:    patch {}, merge {}, temporal patch {}", v.patch_size, v.spatial_merge_size, v.temporal_patch_size);
    }
    let audio = if params.audio > 0 { format!(" + audio {}", billions(params.audio)) } else { String::new() };
    println!(
        "params:    {} total = text {} + vision {}{audio}; {} active per token",
        billions(params.total()),
        billions(params.text_linear + params.text_other),
        billions(params.vision),
        billions(params.text_active + params.vision + params.audio)
    );
    for note in registry::notes(&config).map_err(with_path)? {
        println!("note:      {note}");
    }
    if let Some(f) = &files {
        let shards = merg::weights::index_shards(&f.weights).context("reading the weight files")?;
        println!("weights:   {} tensors in {} file(s)", shards.len(), f.weights.len());
    }
    Ok(())
}

/// What Ollama's manifest adds: its name and digest, and its template, parameters and system
/// layers (shown only: merg keeps the GGUF's own chat template).
fn ollama_layers(o: &merg::gguf::ollama::OllamaModel) {
    println!("ollama:    {} (digest {}, manifest {})", o.name, o.digest, o.manifest.display());
    println!("blobs:     model {}, projector {}", o.text.display(), o.projector.as_ref().map_or("none".into(), |p| p.display().to_string()));
    for (what, text) in [("template (not used: merg uses the GGUF's chat template)", &o.template), ("parameters", &o.params), ("system", &o.system)] {
        if let Some(t) = text {
            println!("ollama {what}:");
            for line in t.lines() {
                println!("  {line}");
            }
        }
    }
}
