//! `merg bench` (prefill and decode speed of the dense reference path at batch 1) and
//! `merg bench-agents` (the five-agent workload on the paged engine, cache on vs off).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;

use merg::checkpoint::Checkpoint;
use merg::generate::{decode_inputs, forward_logits, VisionInput};
use merg::models::{registry, DenseCache};
use merg::weights::{Quant, Weights};

use super::{EngineArgs, Located, ModelArgs};

#[derive(Args)]
pub struct BenchArgs {
    /// The model; `--quant` takes several formats here, comma-separated, measured in this one
    /// run (`none`: the --dtype weights; a dtype: f32, f16, bf16; or a quantization, computed
    /// in --dtype), ratios to the first.
    #[command(flatten)]
    model: ModelArgs,
    /// A config.json (e.g. models/qwen2.5-vl-7b-instruct.json); implies --dummy.
    #[arg(long, conflicts_with = "model")]
    config: Option<PathBuf>,
    /// Random weights instead of the checkpoint's (like vLLM's --load-format dummy).
    #[arg(long)]
    dummy: bool,
    #[arg(long, default_value_t = 256)]
    prompt_tokens: usize,
    #[arg(long, default_value_t = 64)]
    decode_tokens: usize,
    /// Untimed prefills of the same prompt (each in a fresh cache) before the timed one, as
    /// llama-bench warms up by default: the first pass through a freshly loaded model also
    /// pays for first-touch page faults and the thread team's start. 0 times the cold pass.
    #[arg(long, default_value_t = 1)]
    warmup: usize,
    /// Skip measuring the machine's roofline (bandwidth and peaks, about two seconds).
    #[arg(long)]
    no_roofline: bool,
    /// Also decode this many sequences together on the paged engine, for each format, and
    /// report their aggregate tokens/s (comma-separated, e.g. 8,32).
    #[arg(long, value_delimiter = ',')]
    batch: Vec<usize>,
    /// Prompt tokens of each sequence in the batched runs (decode length: --decode-tokens).
    #[arg(long, default_value_t = 32)]
    batch_prompt_tokens: usize,
    /// tokenizer.json for the batched runs' engine (default: the checkpoint's, else
    /// $MERG_DATA_DIR or ../shared/data /qwen2-tokenizer/tokenizer.json).
    #[arg(long)]
    tokenizer: Option<PathBuf>,
    /// Also draw the run as a figure (FILE.svg or FILE.png): decode (batch 1 and each --batch)
    /// and prefill tokens/s per format, against the roofline when it was measured.
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
}

#[derive(Args)]
pub struct BenchAgentsArgs {
    /// Model config for dummy weights (needs the real Qwen vocabulary) …
    #[arg(long, default_value = "models/dummy-small-qwen2.5-vl.json", conflicts_with = "model")]
    config: PathBuf,
    /// … and the tokenizer.json giving real token counts (default: $MERG_DATA_DIR or
    /// ../shared/data /qwen2-tokenizer/tokenizer.json).
    #[arg(long, conflicts_with = "model")]
    tokenizer: Option<PathBuf>,
    /// A real model instead of --config (its own weights and tokenizer).
    #[command(flatten)]
    model: ModelArgs,
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
    /// (cache on, cache off) pairs to run; the reported wall ratio is their median. 0: the
    /// cache-on run alone.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Send the same workload to this OpenAI-compatible server (llama-server, e.g.
    /// http://127.0.0.1:8080) instead of running it here; prints the server's counts.
    #[arg(long, conflicts_with_all = ["model", "quant"])]
    server: Option<String>,
    /// With --server: `stage` (every dialogue's call of one agent, then the next agent) or
    /// `dialogue` (each dialogue's calls back to back).
    #[arg(long, default_value = "stage", requires = "server", value_parser = ["stage", "dialogue"])]
    order: String,
    /// With --server: requests in flight at once (start the server with as many slots).
    #[arg(long, default_value_t = 1, requires = "server")]
    slots: usize,
    /// Also draw the run as a figure (FILE.svg or FILE.png): wall per dialogue (cache on and
    /// off, each pair) and prompt tokens computed vs taken from the cache.
    #[arg(long, value_name = "FILE")]
    plot: Option<PathBuf>,
    #[command(flatten)]
    engine: EngineArgs,
}

pub fn cmd_bench(a: BenchArgs) -> Result<()> {
    merg::setting::at_least_one("prompt_tokens", a.prompt_tokens)?;
    // A bad figure name fails before minutes of measuring, not after.
    if let Some(p) = &a.plot {
        super::figure_name("plot", p)?;
    }
    let formats = match a.model.quant.is_empty() {
        true => vec![(None, None)],
        false => a.model.quant.iter().map(|f| format_of(f)).collect::<Result<Vec<_>>>().context("--quant")?,
    };
    if !a.batch.is_empty() {
        let tok = batch_tokenizer(&a)?;
        if let Some(c) = &a.config {
            tokenizer_fits(c, &tok).with_context(|| format!("--batch with --tokenizer {}", tok.display()))?;
        }
    }
    // The machine's limits, on the same threads, before any model is loaded.
    let roof = match (a.no_roofline, a.model.device.as_str()) {
        (true, _) => None,
        (false, "cpu") => Some(merg::cpu::roofline::measure()),
        (false, _) => Some(device_roofline(&a.model.device_and_dtype()?.0)?),
    };
    if let Some(r) = &roof {
        let on = match r.threads {
            0 => a.model.device.clone(),
            n => format!("{n} threads, {} kernels", merg::cpu::level().name()),
        };
        println!(
            "roofline: {:.1} GB/s {} bandwidth, {:.0} GFLOP/s f32 peak, {:.0} GFLOP/s bf16 peak ({on})",
            r.bandwidth_gbs,
            if r.threads == 0 { "copy" } else { "triad" },
            r.f32_gflops,
            r.bf16_gflops,
        );
    }
    let mut recs: Vec<serde_json::Value> = vec![];
    for (dtype, q) in formats {
        let mut rec = bench_one(&a, dtype, q, roof.is_some_and(|r| r.threads > 0))?;
        if let Some(r) = &roof {
            // A second triad right after the run (the model dropped): on a shared host the
            // bandwidth can move by half within minutes, and then a share of one is no measure.
            let after = (r.threads > 0).then(merg::cpu::roofline::bandwidth_gbs);
            roofline_lines(&mut rec, r, after);
        }
        if let Some(base) = recs.first() {
            for k in ["prefill_tokens_per_s", "decode_tokens_per_s"] {
                let ratio = rec[k].as_f64().unwrap_or(0.0) / base[k].as_f64().unwrap_or(1.0);
                println!("{} {}: {:.2} tok/s, {ratio:.2}x {}", &k[..k.find('_').unwrap_or(k.len())], rec["weights"].as_str().unwrap_or(""), rec[k].as_f64().unwrap_or(0.0), base["weights"].as_str().unwrap_or(""));
            }
        }
        println!("{}", serde_json::to_string_pretty(&rec)?);
        recs.push(rec);
    }
    if let Some(p) = &a.plot {
        merg::report::benches::bench(&recs).save(p)?;
        eprintln!("[figure written to {}]", p.display());
    }
    Ok(())
}

/// Draws `--plot` from the JSON the run printed.
fn plot_agents(plot: Option<&PathBuf>, json: &serde_json::Value) -> Result<()> {
    if let Some(p) = plot {
        merg::report::benches::bench_agents(json)?.save(p)?;
        eprintln!("[figure written to {}]", p.display());
    }
    Ok(())
}

/// A GPU's own limits, measured as the CPU's are (best of five): copy bandwidth (read and write
/// of a 1 GiB f32 tensor, four per timing) and the f32 and bf16 matmul peaks (4096², ten products per timing).
/// `threads` is 0: the figures are the device's.
fn device_roofline(device: &candle_core::Device) -> Result<merg::cpu::roofline::Roofline> {
    use candle_core::{DType, Tensor};
    let best = |n: usize, f: &dyn Fn() -> candle_core::Result<Tensor>| -> Result<f64> {
        let mut best = f64::MAX;
        for _ in 0..5 {
            device.synchronize()?;
            let t = Instant::now();
            for _ in 0..n {
                f()?;
            }
            device.synchronize()?;
            best = best.min(t.elapsed().as_secs_f64() / n as f64);
        }
        Ok(best)
    };
    let x = Tensor::ones(1usize << 28, DType::F32, device)?;
    let copy_s = best(4, &|| x.affine(1.0, 0.0))?;
    let peak = |dtype: DType| -> Result<f64> {
        let m = Tensor::ones((4096, 4096), dtype, device)?;
        Ok(2.0 * 4096f64.powi(3) / best(10, &|| m.matmul(&m))? / 1e9)
    };
    let (f32_gflops, bf16_gflops) = (peak(DType::F32)?, peak(DType::BF16)?);
    Ok(merg::cpu::roofline::Roofline { threads: 0, bandwidth_gbs: 2.0 * 4.0 * (1u64 << 28) as f64 / copy_s / 1e9, f32_gflops, bf16_gflops })
}

/// Decode as % of the bandwidth roofline and prefill as % of the compute peak, printed as
/// `decode f32: 9.31 tok/s, 41.2 % of roofline` and added to the record.
fn roofline_lines(rec: &mut serde_json::Value, r: &merg::cpu::roofline::Roofline, after: Option<f64>) {
    let f = |k: &str| rec[k].as_f64().unwrap_or(0.0);
    let (decode, prefill, bytes, flops) = (f("decode_tokens_per_s"), f("prefill_tokens_per_s"), f("decode_bytes_per_token"), f("prefill_flops"));
    let name = rec["weights"].as_str().unwrap_or("").to_string();
    let decode_pct = 100.0 * decode * bytes / (r.bandwidth_gbs * 1e9);
    // Dense bf16 weights (a bf16 GGUF is named by its format, so not by the name). On a GPU
    // (threads 0) quantized prefill runs on the tensor cores (candle's MMQ kernels or a
    // dequantized half-precision product), so its ceiling is the bf16 one, not f32's (the
    // H200 measured q4k prefill at 1.1-1.8x the f32 peak).
    let quantized = rec["quantized_linear_weights"].as_u64().is_some_and(|n| n > 0);
    let bf16 = (rec["dtype"].as_str() == Some("BF16") && !quantized) || (r.threads == 0 && quantized);
    let peak = if bf16 { r.bf16_gflops } else { r.f32_gflops };
    let prefill_pct = 100.0 * flops / f("prefill_s") / (peak * 1e9);
    println!("decode {name}: {decode:.2} tok/s, {decode_pct:.1} % of roofline ({:.3} GB read per token at {:.1} GB/s)", bytes / 1e9, r.bandwidth_gbs);
    println!("prefill {name}: {prefill:.2} tok/s, {prefill_pct:.1} % of the {} peak ({:.1} GFLOP/s of {peak:.0})", if bf16 { "bf16" } else { "f32" }, flops / f("prefill_s") / 1e9);
    rec["decode_roofline_pct"] = serde_json::json!(decode_pct);
    rec["prefill_peak_pct"] = serde_json::json!(prefill_pct);
    if let Some(after) = after {
        let moved = 100.0 * (after / r.bandwidth_gbs - 1.0);
        let unsteady = if moved.abs() > 15.0 { ": the bandwidth moved during the run, so compare decode rates, or the paired share below" } else { "" };
        let pct = 100.0 * decode * bytes / (after * 1e9);
        println!("decode {name}: {pct:.1} % of the {after:.1} GB/s triad measured after it ({moved:+.0} %{unsteady})");
        rec["bandwidth_after_gbs"] = serde_json::json!(after);
        rec["decode_roofline_pct_after"] = serde_json::json!(pct);
    }
    if let Some(p) = rec["decode_roofline_paired"].as_object() {
        let f = |k: &str| p[k].as_f64().unwrap_or(f64::NAN);
        let q = |i: usize| p["quartile_pcts"][i].as_f64().unwrap_or(f64::NAN);
        println!(
            "decode {name}: {:.1} % of the triad measured either side of each step (median of {} more steps, quartiles {:.1}-{:.1} %, triad median {:.1} GB/s; a cache line between two cores {:.0} ns there and back before the steps, {:.0} after)",
            f("median_pct"),
            p["steps"],
            q(0),
            q(1),
            f("triad_median_gbs"),
            p["core_round_trip_ns"][0].as_f64().unwrap_or(f64::NAN),
            p["core_round_trip_ns"][1].as_f64().unwrap_or(f64::NAN)
        );
    }
}

/// A --quant entry: (dtype override, quantization).
fn format_of(f: &str) -> Result<(Option<candle_core::DType>, Option<Quant>)> {
    if f == "none" {
        return Ok((None, None));
    }
    match merg::weights::parse_dtype(f) {
        Ok(d) => Ok((Some(d), None)),
        Err(_) => match Quant::parse(f) {
            Ok(q) => Ok((None, Some(q))),
            Err(_) => Err(merg::InvalidSetting::new("quant", f, "none, f32, f16, bf16, q8_0, q6k, q5k or q4k").into()),
        },
    }
}

/// The weights of one run, before the model is built, and what is known of their format.
struct Loaded {
    config: serde_json::Value,
    weights: Weights,
    dtype: candle_core::DType,
    /// A GGUF text model's format: its name, llama.cpp's label and its tensors by type.
    gguf: Option<merg::gguf::Format>,
}

/// Opens the run's weights in their compute dtype: `--dtype` (or a `--quant` dtype entry),
/// else a GGUF file's own default (bf16 for a bf16 file), else the device's.
fn open_weights(a: &BenchArgs, dtype_override: Option<candle_core::DType>, quant: Option<Quant>) -> Result<Loaded> {
    let (device, dtype) = a.model.device_and_dtype()?;
    let asked = dtype_override.or(dtype);
    let plain = asked.unwrap_or_else(|| merg::weights::default_dtype(&device));
    let loaded = match (&a.config, a.model.model.is_some()) {
        (Some(c), _) => Loaded { config: registry::read_config(c)?, weights: Weights::dummy(plain, &device), dtype: plain, gguf: None },
        (None, true) => match a.model.locate()? {
            Located::Gguf(_) if a.dummy => anyhow::bail!("--dummy: a GGUF model's weights are its file; give --dummy a checkpoint directory, or --config"),
            Located::Gguf(paths) => open_gguf(&a.model, &paths, quant, asked, &device)?,
            Located::Files(files) => {
                let weights = if a.dummy { Weights::dummy(plain, &device) } else { Weights::safetensors(&files.weights, plain, &device)? };
                Loaded { config: registry::read_config(&files.config)?, weights, dtype: plain, gguf: None }
            }
        },
        (None, false) => anyhow::bail!("bench needs --config FILE or --model MODEL"),
    };
    // What in-situ quantization makes is read back from the ledger, as for any source.
    Ok(match quant {
        Some(q) => Loaded { weights: loaded.weights.quantize(q, a.model.quant_vision).0, ..loaded },
        None => loaded,
    })
}

/// llama.cpp files: the config from their metadata, the weights as stored, dense tensors in
/// `asked` or the file's own default dtype.
fn open_gguf(m: &ModelArgs, paths: &merg::gguf::GgufPaths, quant: Option<Quant>, asked: Option<candle_core::DType>, device: &candle_core::Device) -> Result<Loaded> {
    let opened = m.open_gguf(paths, quant)?;
    let dtype = asked.unwrap_or_else(|| opened.format.default_dtype(device));
    merg::memory::check_load(&paths.text.display().to_string(), opened.weights.load_cost(dtype.size_in_bytes() as f64, !device.is_cpu()), device)?;
    Ok(Loaded { config: opened.config, weights: Weights::new(std::sync::Arc::new(opened.weights), dtype, device), dtype, gguf: Some(opened.format) })
}

/// The name of the format a run used: the in-situ quantization, else a GGUF file's format
/// (a float file computed in another dtype says so: `f32 as bf16`), else the dtype.
fn weights_name(quant: Option<Quant>, gguf: Option<&merg::gguf::Format>, dtype: candle_core::DType) -> String {
    use candle_core::quantized::GgmlDType;
    let dt = format!("{dtype:?}").to_lowercase();
    match (quant, gguf) {
        (Some(q), _) => q.name().to_string(),
        (None, Some(f)) if matches!(f.main, Some(GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16)) && f.name != dt => format!("{} as {dt}", f.name),
        (None, Some(f)) => f.name.clone(),
        (None, None) => dt,
    }
}

/// What the loaded weights are, as the JSON gives it and the lines print it: the bytes a
/// decode step reads, the tensors by type (as a GGUF file stores them, or as the model holds
/// them when quantized in situ or read from other sources), and the block-quantized tensors
/// that run on candle's kernels because no packed kernel takes their type here.
fn weight_facts(gguf: Option<&merg::gguf::Format>, in_situ: bool, ledger: &merg::weights::Ledger, params: &merg::models::ParamCounts, cpu: bool) -> serde_json::Value {
    let idle_experts = (params.text_linear + params.text_other).saturating_sub(params.text_active);
    let decode_bytes = ledger.decode_bytes(params.tied_head, idle_experts);
    let types = match gguf.filter(|_| !in_situ) {
        Some(f) => f.tensor_types.clone(),
        None => ledger.types(),
    };
    let fallbacks = match cpu {
        true => ledger.without_kernel(merg::cpu::quant::has_kernel),
        false => vec![],
    };
    let (quantized, quantized_bytes) = ledger.blocks_total();
    serde_json::json!({
        "decode_weight_bytes_per_token": decode_bytes,
        "tensor_types": types,
        "gguf_file_type": gguf.and_then(|f| f.file_type.clone()),
        "quantized_linear_weights": quantized,
        "quantized_bytes": quantized_bytes,
        "kernels": cpu.then(|| merg::cpu::level().name()),
        "candle_kernel_tensors": fallbacks.iter().map(|(n, t)| serde_json::json!({"tensor": n, "type": merg::gguf::format::type_name(*t)})).collect::<Vec<_>>(),
    })
}

/// Prints the format line and, when some tensors have no packed kernel here, their names by
/// type (to stderr: stdout stays the figures and the JSON).
fn print_facts(name: &str, facts: &serde_json::Value) {
    let types: Vec<String> = facts["tensor_types"].as_object().map(|m| m.iter().map(|(t, c)| format!("{} {t}", c["tensors"])).collect()).unwrap_or_default();
    let file_type = facts["gguf_file_type"].as_str().map(|f| format!(", file type {f}")).unwrap_or_default();
    eprintln!("weights: {name} ({} tensors{file_type}); {:.4} GB of weights read per decode token", types.join(", "), facts["decode_weight_bytes_per_token"].as_f64().unwrap_or(0.0) / 1e9);
    let mut by_type: std::collections::BTreeMap<&str, Vec<&str>> = Default::default();
    for t in facts["candle_kernel_tensors"].as_array().into_iter().flatten() {
        by_type.entry(t["type"].as_str().unwrap_or("")).or_default().push(t["tensor"].as_str().unwrap_or(""));
    }
    for (t, names) in by_type {
        eprintln!("candle kernels for {} {t} tensors (no packed {t} kernel at {}): {}", names.len(), facts["kernels"].as_str().unwrap_or(""), names.join(", "));
    }
}

/// Prefill then decode at batch 1 with one weight format.
/// `paired`: also decode `--decode-tokens` more steps, each between two triad passes
/// (`cpu::roofline::paired`), after everything else is measured.
fn bench_one(a: &BenchArgs, dtype_override: Option<candle_core::DType>, quant: Option<Quant>, paired: bool) -> Result<serde_json::Value> {
    // From before the files are opened: loading is where a weight could be held twice.
    let memory = merg::memory::PeakSampler::start(std::time::Duration::from_millis(10));
    let Loaded { config, weights, dtype, gguf } = open_weights(a, dtype_override, quant)?;
    // Last, over any quantizing source: the ledger sees what the layers get.
    let (weights, ledger) = weights.recorded();
    let device = weights.device().clone();
    let t_load = Instant::now();
    let model = registry::load(&config, weights)?;
    let load_s = t_load.elapsed().as_secs_f64();
    let (after_load, peak_load) = (merg::memory::resident(), memory.peak());
    let spec = model.spec().clone();
    if a.prompt_tokens + a.decode_tokens >= spec.max_context {
        let n = a.prompt_tokens + a.decode_tokens;
        anyhow::bail!("--prompt-tokens plus --decode-tokens is {n} tokens, more than the model's context window of {} holds", spec.max_context);
    }
    // Ordinary token ids below the vision specials (content does not matter for speed, but a
    // placeholder id would demand image features).
    let hi = spec.special.vision_start.min(spec.vocab_size as u32).max(2);
    let ids: Vec<u32> = (0..a.prompt_tokens as u32).map(|i| 1 + (i * 7919) % (hi - 1)).collect();
    let sync = |d: &candle_core::Device| d.synchronize().context("device sync");
    // The first token (of a warm-up, else of the timed prefill) is where a user's first reply
    // starts; the weights it ran from the file are then packed before anything else is
    // timed (`cpu::repack`), so the timed runs measure the steady state.
    let mut first_token_s = None;
    let mut repack_wait_s = 0.0;
    // Resident once every weight is packed: what the loaded model holds from then on. (Right
    // after loading, the repacking thread has just begun reading the file: a band of it may be
    // resident, or not, depending on how far it got.)
    let mut after_repack = None;
    let mut first_token = || {
        if first_token_s.is_none() {
            first_token_s = since_process_start();
            let t = Instant::now();
            merg::cpu::repack::wait();
            repack_wait_s = t.elapsed().as_secs_f64();
            after_repack = merg::memory::resident();
        }
    };
    for _ in 0..a.warmup {
        let pre = merg::generate::prepare(&*model, &ids, &VisionInput::default())?;
        forward_logits(&*model, &pre, &mut DenseCache::new(), 1)?;
        sync(&device)?;
        first_token();
    }
    let t0 = Instant::now();
    let pre = merg::generate::prepare(&*model, &ids, &VisionInput::default())?;
    let mut kv = DenseCache::new();
    let logits = forward_logits(&*model, &pre, &mut kv, 1)?;
    let mut tok = greedy(&logits)?;
    sync(&device)?;
    let prefill_s = t0.elapsed().as_secs_f64();
    first_token();
    let t1 = Instant::now();
    for i in 0..a.decode_tokens {
        let step = decode_inputs(&*model, tok, ids.len() + i, pre.rope_delta)?;
        tok = greedy(&forward_logits(&*model, &step, &mut kv, 1)?)?;
    }
    sync(&device)?;
    let decode_s = t1.elapsed().as_secs_f64();
    let weights_name = weights_name(quant, gguf.as_ref(), dtype);
    let params = registry::param_counts(&config)?;
    let facts = weight_facts(gguf.as_ref(), quant.is_some(), &ledger, &params, device.is_cpu());
    print_facts(&weights_name, &facts);
    // The linear-weight count and FLOPs from the config; the bytes as the model holds them.
    let mut cost = merg::models::cost::TokenCost::of(&params, &spec, dtype.size_in_bytes() as f64, dtype.size_in_bytes() as f64);
    cost.weight_bytes = facts["decode_weight_bytes_per_token"].as_f64().unwrap_or(0.0);
    let mid_context = (ids.len() + a.decode_tokens / 2) as f64;
    let batched = batched_runs(a, model.clone(), &config, &weights_name)?;
    // The peaks so far: the paired triad below holds 768 MiB of its own.
    let memory = memory_facts(after_load, after_repack, peak_load, memory.peak());
    // As many steps again as the timed decode, or what the context window leaves; decode
    // goes on from where the timed steps stopped, in the same cache.
    let steps = a.decode_tokens.min(spec.max_context - 1 - ids.len() - a.decode_tokens);
    let paired = match paired && steps > 0 {
        true => Some(merg::cpu::roofline::paired(steps, |i| -> Result<f64> {
            let past = ids.len() + a.decode_tokens + i;
            let step = decode_inputs(&*model, tok, past, pre.rope_delta)?;
            tok = greedy(&forward_logits(&*model, &step, &mut kv, 1)?)?;
            Ok(cost.decode_bytes(past as f64))
        })?),
        false => None,
    };
    let mut rec = serde_json::json!({
        "weights": weights_name,
        "family": spec.model_type,
        "hidden_size": spec.hidden_size,
        "layers": spec.layers.len(),
        "device": a.model.device,
        "dtype": format!("{dtype:?}"),
        "dummy": a.config.is_some() || a.dummy,
        "prompt_tokens": a.prompt_tokens,
        "decode_tokens": a.decode_tokens,
        "warmup_prefills": a.warmup,
        "prefill_tokens_per_s": a.prompt_tokens as f64 / prefill_s,
        "prefill_s": prefill_s,
        "prefill_flops": cost.prefill_flops(a.prompt_tokens as f64),
        "decode_bytes_per_token": cost.decode_bytes(mid_context),
        "decode_tokens_per_s": a.decode_tokens as f64 / decode_s,
        "load_s": load_s,
        "first_token_s": first_token_s,
        "repack_wait_s": repack_wait_s,
        "memory": memory,
        "decode_roofline_paired": paired,
        "device_memory_used_bytes": merg::memory::device_used(&device),
        "batched": batched,
    });
    merge(&mut rec, facts);
    Ok(rec)
}

/// The next token of `[1, vocab]` f32 logits, greedily. On the CPU it is read in place:
/// candle's argmax walks a 151,936-value row one value at a time, about 90 µs of a 0.5B
/// model's ~8 ms step on the 2-core Zen 5 box (llama-bench, beside it, samples nothing).
fn greedy(logits: &candle_core::Tensor) -> Result<u32> {
    let row = logits.squeeze(0)?;
    if row.device().is_cpu() {
        return Ok(merg::layers::with_host_slice(&row, |v: &[f32]| merg::cpu::reduce::max_index(v).0 as u32)?);
    }
    Ok(row.argmax(0)?.to_scalar::<u32>()?)
}

/// Seconds since this process started, from `/proc/self/stat`'s start time and the boot clock
/// (10 ms resolution), so a first-token time counts the start-up before `main` too; `None`
/// off Linux.
fn since_process_start() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name, which may hold spaces: state is field 3, starttime 22.
    let start_ticks: f64 = stat[stat.rfind(')')? + 2..].split(' ').nth(22 - 3)?.parse().ok()?;
    let uptime: f64 = std::fs::read_to_string("/proc/uptime").ok()?.split_whitespace().next()?.parse().ok()?;
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    (hz > 0.0).then(|| uptime - start_ticks / hz)
}

/// Adds `extra`'s fields to the object `rec`.
fn merge(rec: &mut serde_json::Value, extra: serde_json::Value) {
    if let (Some(r), serde_json::Value::Object(e)) = (rec.as_object_mut(), extra) {
        r.extend(e);
    }
}

/// The `--batch` runs on the loaded model, printed as `decode bf16 batch 8: … tok/s aggregate`.
/// The tokenizer `--batch` runs the engine with; asked for before anything is measured.
fn batch_tokenizer(a: &BenchArgs) -> Result<PathBuf> {
    let own = match a.model.model.is_some() && a.config.is_none() {
        true => match a.model.locate()? {
            Located::Files(f) => Some(f.tokenizer).filter(|p| p.exists()),
            Located::Gguf(_) => None,
        },
        false => None,
    };
    a.tokenizer.clone().or(own).or_else(default_tokenizer).context(
        "--batch runs the engine, which needs a tokenizer: pass --tokenizer, set MERG_DATA_DIR, or use a checkpoint that has one",
    )
}

/// A tokenizer from another checkpoint than `config`'s fails before the weights load (a 9B
/// took 21 s on a GPU to reach the same error through the loaded model).
fn tokenizer_fits(config: &std::path::Path, tok: &std::path::Path) -> Result<()> {
    let config = registry::read_config(config)?;
    let spec = registry::spec(&config)?;
    let template = merg::chat::default_chat_template(registry::model_type(&config)?);
    let tokenizer = std::sync::Arc::new(merg::tokenizer::ChatTokenizer::from_files(tok, Some(template.to_string()))?);
    merg::processor::Processor::new(tokenizer, Default::default(), &spec).check_ids(&spec)
}

fn batched_runs(a: &BenchArgs, model: std::sync::Arc<dyn merg::models::Model>, config: &serde_json::Value, name: &str) -> Result<Vec<merg::bench::BatchedDecode>> {
    if a.batch.is_empty() {
        return Ok(vec![]);
    }
    let tok = batch_tokenizer(a)?;
    let template = merg::chat::default_chat_template(registry::model_type(config)?);
    let mut out = vec![];
    for &b in &a.batch {
        let tokenizer = merg::tokenizer::ChatTokenizer::from_files(&tok, Some(template.to_string()))?;
        let ckpt = Checkpoint::from_model(model.clone(), tokenizer)?;
        let r = merg::bench::batched_decode(ckpt, b, a.batch_prompt_tokens, a.decode_tokens.max(2)).with_context(|| format!("--batch {b}"))?;
        println!("decode {name} batch {b}: {:.2} tok/s aggregate over {} steps", r.tokens_per_s, r.decode_steps);
        out.push(r);
    }
    Ok(out)
}

/// Resident memory after loading, once every weight is packed, and at its peaks (during the
/// load; over the whole run), each split into anonymous and file-backed bytes; printed as one
/// line (to stderr, with the weights line: stdout stays the speeds and the JSON).
fn memory_facts(after_load: Option<merg::memory::Resident>, after_repack: Option<merg::memory::Resident>, peak_load: merg::memory::Peak, peak: merg::memory::Peak) -> serde_json::Value {
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let at = |what: &str, r: Option<merg::memory::Resident>| r.map(|r| format!(", {:.0} MiB {what} ({:.0} + {:.0})", mib(r.total()), mib(r.anon_bytes), mib(r.file_bytes))).unwrap_or_default();
    if after_load.is_some() {
        eprintln!(
            "memory: peak {:.0} MiB ({:.0} anonymous + {:.0} file-backed at their peaks){}{}",
            mib(peak.total_bytes),
            mib(peak.anon_bytes),
            mib(peak.file_bytes),
            at("after loading", after_load),
            at("once packed", after_repack)
        );
    }
    serde_json::json!({ "after_load": after_load, "after_repack": after_repack, "peak_during_load": peak_load, "peak": peak })
}

fn default_tokenizer() -> Option<PathBuf> {
    let base = std::env::var_os("MERG_DATA_DIR").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("../shared/data"));
    let p = base.join("qwen2-tokenizer/tokenizer.json");
    p.exists().then_some(p)
}

pub fn cmd_bench_agents(a: BenchAgentsArgs) -> Result<()> {
    for (name, n) in [("dialogues", a.dialogues), ("new_tokens", a.new_tokens), ("keyframe_size", a.keyframe_size as usize), ("slots", a.slots)] {
        merg::setting::at_least_one(name, n)?;
    }
    if let Some(p) = &a.plot {
        super::figure_name("plot", p)?;
    }
    let (device, dtype) = a.model.device_and_dtype()?;
    let cfg = a.engine.config()?;
    let frames: Vec<image::RgbImage> = (0..a.keyframes)
        .map(|k| match &a.keyframe {
            Some(p) => merg::vision::load_image(p),
            None => Ok(image::RgbImage::from_fn(a.keyframe_size, a.keyframe_size, |x, y| {
                image::Rgb([(x + 40 * k as u32) as u8, y as u8, ((x * y + k as u32) % 251) as u8])
            })),
        })
        .collect::<Result<_>>()?;
    if let Some(url) = &a.server {
        let order = if a.order == "dialogue" { merg::bench::server::Order::Dialogue } else { merg::bench::server::Order::Stage };
        let run = merg::bench::server::run_on_server(url, order, a.slots, a.dialogues, a.new_tokens, &frames).map_err(|e| anyhow::anyhow!("--server {url}: {e:#}"))?;
        println!("{}", serde_json::to_string_pretty(&run)?);
        return plot_agents(a.plot.as_ref(), &serde_json::to_value(&run)?);
    }
    let quant = a.model.quant()?;
    let make: Box<dyn Fn() -> Result<Checkpoint>> = match &a.model.model {
        Some(_) => {
            let args = a.model.clone();
            Box::new(move || args.load())
        }
        None => {
            let tok = a.tokenizer.clone().or_else(default_tokenizer).context(
                "bench-agents needs the real Qwen2 tokenizer for real token counts: pass --tokenizer, set MERG_DATA_DIR, or use --model DIR",
            )?;
            let config = a.config.clone();
            let device = device.clone();
            let quant_vision = a.model.quant_vision;
            Box::new(move || {
                let model_type = merg::models::registry::model_type(&merg::models::registry::read_config(&config)?)?.to_string();
                let template = merg::chat::default_chat_template(&model_type);
                let tokenizer = merg::tokenizer::ChatTokenizer::from_files(&tok, Some(template.to_string()))?;
                Checkpoint::dummy_with(&config, tokenizer, &device, &merg::checkpoint::LoadOptions { dtype, quant, quant_vision })
            })
        }
    };
    let report = merg::bench::run_agents(&*make, &cfg, a.dialogues, a.new_tokens, &frames, a.repeats)?;
    println!("{}", serde_json::to_string_pretty(&report)?);
    plot_agents(a.plot.as_ref(), &serde_json::to_value(&report)?)
}

