//! `merg` command line. Every failure prints one clear error chain and exits non-zero.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};

use merg::chat::{ContentPart, Message};
use merg::config::ModelConfig;
use merg::generate::SamplingParams;
use merg::models::{DenseKvCache, QwenVl};
use merg::runtime::{load_media, parse_device, Media, Runtime};
use merg::weights::parse_dtype;

mod cli;

#[derive(Parser)]
#[command(name = "merg", version, about = "Multimodal empathetic response generation on Qwen vision-language models")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Answer one chat prompt (text plus optional images / a video).
    Generate(GenerateArgs),
    /// Print what a checkpoint is (family, sizes, files) without running it.
    Info(ModelArgs),
    /// Decode throughput on a checkpoint or on dummy weights of a config (fixed token budgets).
    Bench(BenchArgs),
    /// The five-agent workload on the paged engine, prefix cache on vs off, in one run.
    BenchAgents(BenchAgentsArgs),
    /// Answer a dialogue with the five-agent MERG pipeline; prints the reply, writes a trace.
    Respond(cli::respond::RespondArgs),
    /// Run the pipeline over a dataset split (resumable, shardable) and summarise the metrics.
    Eval(Box<cli::eval::EvalArgs>),
    /// Build the exemplar memory for SGRG from a held-out split (MELD dev, IEMOCAP Session 2).
    Memory(cli::eval::MemoryArgs),
    /// Tables, figures and human-evaluation sheets from eval run folders.
    Report(cli::report::ReportArgs),
}

#[derive(Args)]
struct BenchAgentsArgs {
    /// Model config for dummy weights (needs the real Qwen vocabulary) …
    #[arg(long, default_value = "models/dummy-small-qwen2.5-vl.json")]
    config: PathBuf,
    /// … and the tokenizer.json giving real token counts (default: $MERG_DATA_DIR or
    /// ../shared/data /qwen2-tokenizer/tokenizer.json).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// A real checkpoint directory instead (its own weights and tokenizer).
    #[arg(long, conflicts_with_all = ["config", "tokenizer"])]
    model: Option<String>,
    #[arg(long, default_value_t = 8)]
    dialogues: usize,
    #[arg(long, default_value_t = 24)]
    new_tokens: usize,
    /// Keyframe image shown with every dialogue (default: synthetic frames).
    #[arg(long)]
    keyframe: Option<PathBuf>,
    /// Keyframes per dialogue (0 = text only); a 448×448 frame is 256 Qwen2.5-VL tokens.
    #[arg(long, default_value_t = 4)]
    keyframes: usize,
    #[arg(long, default_value_t = 448)]
    keyframe_size: u32,
    /// (cache on, cache off) pairs to run; the reported wall ratio is their median.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long)]
    dtype: Option<String>,
    #[command(flatten)]
    engine: EngineArgs,
}

/// Paged-engine settings shared by the commands that run the engine.
#[derive(Args)]
pub struct EngineArgs {
    /// KV pool size: a fraction of free memory (0.5), bytes (4GiB) or blocks:N.
    #[arg(long, default_value = "0.3")]
    kv_memory: String,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    #[arg(long, default_value_t = 64)]
    max_num_seqs: usize,
    #[arg(long, default_value_t = 2048)]
    max_step_tokens: usize,
}

impl EngineArgs {
    pub fn config(&self) -> Result<merg::engine::EngineConfig> {
        if self.block_size == 0 {
            anyhow::bail!("--block-size must be at least 1");
        }
        Ok(merg::engine::EngineConfig {
            block_size: self.block_size,
            kv_memory: self.kv_memory.parse()?,
            scheduler: merg::engine::scheduler::SchedulerConfig {
                max_num_seqs: self.max_num_seqs.max(1),
                max_step_tokens: self.max_step_tokens.max(1),
            },
            ..Default::default()
        })
    }
}

#[derive(Args)]
pub struct ModelArgs {
    /// Hugging Face repo id (uses the hub cache; HF_HOME / HF_HUB_OFFLINE=1 honoured) or a local directory.
    #[arg(long)]
    model: String,
    #[arg(long)]
    revision: Option<String>,
    /// cpu, cuda or cuda:N.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// f32, f16 or bf16 (default: bf16 on CUDA, f32 on CPU).
    #[arg(long)]
    dtype: Option<String>,
}

#[derive(Args)]
struct SamplingArgs {
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
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
    fn params(&self) -> SamplingParams {
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

#[derive(Args)]
struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// The user message.
    #[arg(long)]
    prompt: String,
    /// Optional system message (the chat template's default otherwise).
    #[arg(long)]
    system: Option<String>,
    /// Image files, shown before the prompt in this order.
    #[arg(long = "image")]
    images: Vec<PathBuf>,
    /// An mp4 video, shown after the images.
    #[arg(long)]
    video: Option<PathBuf>,
    /// Frames per second sampled from --video.
    #[arg(long, default_value_t = 2.0)]
    fps: f64,
    #[arg(long, default_value_t = 32)]
    max_frames: usize,
    /// Context window (default: the model's max_position_embeddings).
    #[arg(long)]
    max_context: Option<usize>,
    /// Print a JSON record (text, token ids, log-probs, finish reason) instead of the text.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
struct BenchArgs {
    /// A checkpoint (repo id or directory); with --dummy only its config.json is read.
    #[arg(long, conflicts_with = "config")]
    model: Option<String>,
    /// A config.json (e.g. models/qwen2.5-vl-7b-instruct.json); implies --dummy.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Random weights instead of the checkpoint's (like vLLM's --load-format dummy).
    #[arg(long)]
    dummy: bool,
    #[arg(long, default_value = "cpu")]
    device: String,
    #[arg(long)]
    dtype: Option<String>,
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.cmd {
        Cmd::Generate(a) => cmd_generate(a),
        Cmd::Info(a) => cmd_info(a),
        Cmd::Bench(a) => cmd_bench(a),
        Cmd::BenchAgents(a) => cmd_bench_agents(a),
        Cmd::Respond(a) => cli::respond::cmd_respond(a),
        Cmd::Eval(a) => cli::eval::cmd_eval(*a),
        Cmd::Memory(a) => cli::eval::cmd_memory(a),
        Cmd::Report(a) => cli::report::cmd_report(a),
    }
}

pub fn load_runtime(m: &ModelArgs) -> Result<Runtime> {
    let device = parse_device(&m.device)?;
    let dtype = m.dtype.as_deref().map(parse_dtype).transpose()?;
    let files = merg::hub::resolve(&m.model, m.revision.as_deref())?;
    Runtime::load(files, &device, dtype)
}

fn cmd_generate(a: GenerateArgs) -> Result<()> {
    let params = a.sampling.params();
    params.validate()?;
    let media = load_media(&a.images, a.video.as_ref(), a.fps, a.max_frames)?;
    let rt = load_runtime(&a.model)?;
    let mut content: Vec<ContentPart> = media
        .iter()
        .map(|m| match m {
            Media::Image(_) => ContentPart::Image,
            Media::Video { .. } => ContentPart::Video,
        })
        .collect();
    content.push(ContentPart::Text(a.prompt.clone()));
    let mut messages = vec![];
    if let Some(s) = &a.system {
        messages.push(Message { role: "system".into(), content: vec![ContentPart::Text(s.clone())] });
    }
    messages.push(Message { role: "user".into(), content });
    let reply = rt.chat(&messages, &media, &params, a.max_context)?;
    if a.json {
        let rec = serde_json::json!({
            "text": reply.text,
            "tokens": reply.generation.tokens,
            "logprobs": reply.generation.logprobs,
            "finish": reply.generation.finish,
            "prompt_tokens": reply.generation.prompt_tokens,
        });
        println!("{}", serde_json::to_string(&rec)?);
    } else {
        println!("{}", reply.text);
    }
    Ok(())
}

fn cmd_info(a: ModelArgs) -> Result<()> {
    let files = merg::hub::resolve(&a.model, a.revision.as_deref())?;
    let cfg = ModelConfig::from_file(&files.config)?;
    let shards = merg::weights::index_shards(&files.weights)?;
    println!("model:     {}", files.source);
    println!("dir:       {}", files.dir.display());
    println!("family:    {}", cfg.family.model_type());
    let t = &cfg.text;
    println!(
        "text:      {} layers, hidden {}, heads {}/{} kv, vocab {}, context {}",
        t.num_hidden_layers, t.hidden_size, t.num_attention_heads, t.num_key_value_heads, t.vocab_size, t.max_position_embeddings
    );
    let v = &cfg.vision;
    println!("vision:    {} blocks, width {}, heads {}, patch {}, merge {}", v.depth, v.width, v.num_heads, v.patch_size, v.spatial_merge_size);
    println!("weights:   {} tensors in {} file(s)", shards.len(), files.weights.len());
    Ok(())
}

fn cmd_bench(a: BenchArgs) -> Result<()> {
    let device = parse_device(&a.device)?;
    let dtype = a.dtype.as_deref().map(parse_dtype).transpose()?.unwrap_or_else(|| merg::weights::default_dtype(&device));
    let (cfg, model) = match (&a.config, &a.model) {
        (Some(c), _) => {
            let cfg = ModelConfig::from_file(c)?;
            let m = QwenVl::dummy(&cfg, dtype, &device)?;
            (cfg, m)
        }
        (None, Some(m)) => {
            let files = merg::hub::resolve(m, None)?;
            let cfg = ModelConfig::from_file(&files.config)?;
            let model = if a.dummy { QwenVl::dummy(&cfg, dtype, &device)? } else { QwenVl::load(&cfg, &files.weights, dtype, &device)? };
            (cfg, model)
        }
        (None, None) => anyhow::bail!("bench needs --config FILE or --model MODEL"),
    };
    if a.prompt_tokens == 0 || a.prompt_tokens + a.decode_tokens >= cfg.text.max_position_embeddings {
        anyhow::bail!("--prompt-tokens must be ≥ 1 and prompt + decode must fit the context ({})", cfg.text.max_position_embeddings);
    }
    // Ordinary token ids below the vision specials (content does not matter for speed, but a
    // placeholder id would demand image features).
    let hi = cfg.vision_start_token_id.min(cfg.text.vocab_size as u32).max(2);
    let ids: Vec<u32> = (0..a.prompt_tokens as u32).map(|i| 1 + (i * 7919) % (hi - 1)).collect();
    let vision = merg::models::VisionInput::default();
    let sync = |d: &candle_core::Device| d.synchronize().context("device sync");
    let t0 = Instant::now();
    let pre = model.prepare(&ids, &vision)?;
    let mut kv = DenseKvCache::new();
    let logits = model.forward(&pre.embeds, &pre.positions, &mut kv, 1)?;
    let mut tok = logits.squeeze(0)?.argmax(0)?.to_scalar::<u32>()?;
    sync(&device)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for i in 0..a.decode_tokens {
        let l = model.decode_step(tok, ids.len() + i, pre.rope_delta, &mut kv)?;
        tok = l.argmax(0)?.to_scalar::<u32>()?;
    }
    sync(&device)?;
    let decode_s = t1.elapsed().as_secs_f64();
    let rec = serde_json::json!({
        "family": cfg.family.model_type(),
        "hidden_size": cfg.text.hidden_size,
        "layers": cfg.text.num_hidden_layers,
        "device": a.device,
        "dtype": format!("{dtype:?}"),
        "dummy": a.config.is_some() || a.dummy,
        "prompt_tokens": a.prompt_tokens,
        "decode_tokens": a.decode_tokens,
        "prefill_tokens_per_s": a.prompt_tokens as f64 / prefill_s,
        "decode_tokens_per_s": a.decode_tokens as f64 / decode_s,
    });
    println!("{}", serde_json::to_string_pretty(&rec)?);
    Ok(())
}

fn default_tokenizer() -> Option<PathBuf> {
    let base = std::env::var_os("MERG_DATA_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("../shared/data"));
    let p = base.join("qwen2-tokenizer/tokenizer.json");
    p.exists().then_some(p)
}

fn cmd_bench_agents(a: BenchAgentsArgs) -> Result<()> {
    let device = parse_device(&a.device)?;
    let dtype = a.dtype.as_deref().map(parse_dtype).transpose()?;
    let cfg = a.engine.config()?;
    let frames: Vec<image::RgbImage> = (0..a.keyframes)
        .map(|k| match &a.keyframe {
            Some(p) => merg::vision::load_image(p),
            None => Ok(image::RgbImage::from_fn(a.keyframe_size, a.keyframe_size, |x, y| {
                image::Rgb([(x + 40 * k as u32) as u8, y as u8, ((x * y + k as u32) % 251) as u8])
            })),
        })
        .collect::<Result<_>>()?;
    let make: Box<dyn Fn() -> Result<Runtime>> = match &a.model {
        Some(m) => {
            let m = m.clone();
            let device = device.clone();
            Box::new(move || Runtime::load(merg::hub::resolve(&m, None)?, &device, dtype))
        }
        None => {
            let tok = a.tokenizer.clone().or_else(default_tokenizer).context(
                "bench-agents needs the real Qwen2 tokenizer for real token counts: pass --tokenizer, set MERG_DATA_DIR, or use --model DIR",
            )?;
            let model_cfg = ModelConfig::from_file(&a.config)?;
            let device = device.clone();
            Box::new(move || {
                let dtype = dtype.unwrap_or_else(|| merg::weights::default_dtype(&device));
                Ok(Runtime {
                    model: QwenVl::dummy(&model_cfg, dtype, &device)?,
                    tokenizer: merg::tokenizer::MergTokenizer::from_files(&tok, Some(merg::chat::QWEN2_VL_CHAT_TEMPLATE.to_string()))?,
                    preprocessor: Default::default(),
                    files: None,
                })
            })
        }
    };
    let report = merg::bench::run_agents(&*make, &cfg, a.dialogues, a.new_tokens, &frames, a.repeats)?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    Ok(())
}
