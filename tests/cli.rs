//! The `merg` binary: a real run on the tiny checkpoint, and bad input that must end with a
//! clear message and a non-zero exit, never a panic.

mod common;

use std::process::{Command, Output};

use common::*;

fn merg(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_merg")).args(args).env("HF_HUB_OFFLINE", "1").output().unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Asserts a clean failure whose message contains every `needle`.
fn fails_with(o: &Output, needles: &[&str]) {
    let e = stderr(o);
    assert!(!o.status.success(), "expected failure, got success: {e}");
    assert!(!e.contains("panicked"), "panicked: {e}");
    for n in needles {
        assert!(e.contains(n), "missing {n:?} in: {e}");
    }
}

fn media(name: &str) -> String {
    fixtures().join("media").join(name).to_string_lossy().into_owned()
}

fn model(family: &str) -> String {
    tiny_dir(family).to_string_lossy().into_owned()
}

#[test]
fn generate_json_with_image_is_deterministic_for_a_seed() {
    let m = model("qwen2_5_vl");
    let img = media("img_a.png");
    let args = ["generate", "--model", &m, "--image", &img, "--prompt", "How does she feel?", "--max-new-tokens", "8",
        "--temperature", "0.8", "--top-p", "0.9", "--seed", "3", "--json"];
    let a = merg(&args);
    assert!(a.status.success(), "{}", stderr(&a));
    let rec: serde_json::Value = serde_json::from_slice(&a.stdout).unwrap();
    let n = rec["tokens"].as_array().unwrap().len();
    assert!((1..=8).contains(&n));
    assert_eq!(rec["logprobs"].as_array().unwrap().len(), n);
    assert!(rec["prompt_tokens"].as_u64().unwrap() > 40, "image tokens are in the prompt");
    assert_eq!(a.stdout, merg(&args).stdout, "same seed, same output");
}

#[cfg(feature = "video")]
#[test]
fn generate_with_mp4_video() {
    let m = model("qwen2_vl");
    let v = media("clip.mp4");
    let o = merg(&["generate", "--model", &m, "--video", &v, "--prompt", "What happens?", "--max-new-tokens", "4", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn info_describes_the_checkpoint() {
    let o = merg(&["info", "--model", &model("qwen2_vl")]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = String::from_utf8_lossy(&o.stdout);
    assert!(s.contains("qwen2_vl") && s.contains("2 layers"), "{s}");
}

#[test]
fn missing_image_is_named() {
    let o = merg(&["generate", "--model", &model("qwen2_vl"), "--image", "/nonexistent/face.png", "--prompt", "hi"]);
    fails_with(&o, &["/nonexistent/face.png"]);
}

#[test]
fn undecodable_and_empty_images_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let junk = tmp.path().join("junk.png");
    std::fs::write(&junk, b"definitely not a png").unwrap();
    let o = merg(&["generate", "--model", &model("qwen2_vl"), "--image", junk.to_str().unwrap(), "--prompt", "hi"]);
    fails_with(&o, &["junk.png"]);
    let empty = tmp.path().join("empty.png");
    std::fs::write(&empty, b"").unwrap();
    let o = merg(&["generate", "--model", &model("qwen2_vl"), "--image", empty.to_str().unwrap(), "--prompt", "hi"]);
    fails_with(&o, &["empty.png"]);
}

#[cfg(feature = "video")]
#[test]
fn corrupt_mp4_is_named() {
    let tmp = tempfile::tempdir().unwrap();
    let bad = tmp.path().join("clip.mp4");
    std::fs::write(&bad, vec![7u8; 4096]).unwrap();
    let o = merg(&["generate", "--model", &model("qwen2_vl"), "--video", bad.to_str().unwrap(), "--prompt", "hi"]);
    fails_with(&o, &["clip.mp4"]);
}

#[test]
fn prompt_longer_than_context_fails_cleanly() {
    let o = merg(&["generate", "--model", &model("qwen2_vl"), "--prompt", "hello there", "--max-context", "10"]);
    fails_with(&o, &["context window is 10"]);
}

#[test]
fn offline_repo_not_in_cache_explains_how_to_provide_it() {
    let home = tempfile::tempdir().unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_merg"))
        .args(["info", "--model", "Qwen/Qwen2-VL-2B-Instruct"])
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HOME", home.path())
        .env_remove("HF_HUB_CACHE")
        .output()
        .unwrap();
    fails_with(&o, &["Qwen/Qwen2-VL-2B-Instruct", "config.json", "--local-dir"]);
}

#[test]
fn unknown_device_and_dtype_are_rejected() {
    fails_with(&merg(&["generate", "--model", &model("qwen2_vl"), "--prompt", "x", "--device", "tpu"]), &["tpu"]);
    fails_with(&merg(&["generate", "--model", &model("qwen2_vl"), "--prompt", "x", "--dtype", "int3"]), &["int3"]);
}

/// `bench` on dummy weights; `--plot` draws the run (SVG or PNG, by the name).
#[test]
fn bench_runs_on_dummy_weights_of_a_config() {
    let tmp = tempfile::tempdir().unwrap();
    let (svg, png) = (tmp.path().join("bench.svg"), tmp.path().join("bench.png"));
    let cfg = tiny_dir("qwen2_5_vl").join("config.json");
    let o = merg(&["bench", "--config", cfg.to_str().unwrap(), "--prompt-tokens", "16", "--decode-tokens", "4", "--no-roofline", "--plot", svg.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let rec: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert!(rec["decode_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(rec["dummy"], true);
    assert!(rec["decode_roofline_paired"].is_null(), "no roofline, no paired steps");
    let figure = std::fs::read_to_string(&svg).unwrap();
    assert!(figure.contains(">\ndecode\n</text>") && figure.contains(">\nprefill\n</text>") && figure.contains(">\nf32\n</text>"), "{figure}");
    assert!(!figure.contains("roofline"), "no roofline measured, none drawn");
    // With the roofline: its line, then each format's decode and prefill lines (decode also
    // against a triad measured after the run, and against passes either side of each of four
    // more steps), then JSON.
    let o = merg(&["bench", "--config", cfg.to_str().unwrap(), "--prompt-tokens", "16", "--decode-tokens", "4", "--quant", "f32,q8_0", "--plot", png.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.lines().next().unwrap().starts_with("roofline: ") && out.contains("GB/s triad bandwidth"), "{out}");
    for w in ["f32", "q8_0"] {
        assert!(out.lines().any(|l| l.starts_with(&format!("decode {w}: ")) && l.contains("% of roofline")), "{w}: {out}");
        assert!(out.lines().any(|l| l.starts_with(&format!("decode {w}: ")) && l.contains("GB/s triad measured after it (")), "{w}: {out}");
        assert!(out.lines().any(|l| l.starts_with(&format!("decode {w}: ")) && l.contains("% of the triad measured either side of each step (median of 4 more steps")), "{w}: {out}");
        assert!(out.lines().any(|l| l.starts_with(&format!("prefill {w}: ")) && l.contains("% of the f32 peak")), "{w}: {out}");
    }
    let img = image::open(&png).unwrap().to_rgb8();
    let colours: std::collections::HashSet<[u8; 3]> = img.pixels().map(|p| p.0).collect();
    assert!(img.width() > 600 && img.height() > 300 && colours.len() > 8, "{}x{}, {} colours", img.width(), img.height(), colours.len());
    // A name that is neither fails before anything is measured.
    fails_with(&merg(&["bench", "--config", cfg.to_str().unwrap(), "--plot", "bench.jpg"]), &["bench.jpg", ".svg or .png"]);
    // So does a --batch tokenizer from another checkpoint (image token 460, the config's
    // 248056): before the weights load, which prints their line.
    let qwen35 = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/qwen3.5-0.8b.json");
    let tok = tiny_dir("qwen2_5_vl").join("tokenizer.json");
    let o = merg(&["bench", "--config", qwen35.to_str().unwrap(), "--batch", "2", "--tokenizer", tok.to_str().unwrap(), "--no-roofline"]);
    fails_with(&o, &["--tokenizer", "different checkpoints"]);
    assert!(!stderr(&o).contains("weights:"), "{}", stderr(&o));
}

/// `merg plot serve-load` draws scripts/bench_serve.py's rows (what bench-serve.sh saves).
#[test]
fn plot_draws_saved_serve_load_rows() {
    let tmp = tempfile::tempdir().unwrap();
    let rows = tmp.path().join("rows.json");
    std::fs::write(&rows, r#"[{"clients": 1, "requests": 8, "rps": 20.5, "p50": 0.05, "p99": 0.06, "ttft_p50": 0.01},
        {"clients": 8, "requests": 64, "rps": 90.0, "p50": 0.09, "p99": 0.12, "ttft_p50": 0.02}]"#).unwrap();
    let svg = tmp.path().join("serve.svg");
    let o = merg(&["plot", "serve-load", rows.to_str().unwrap(), "--out", svg.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let figure = std::fs::read_to_string(&svg).unwrap();
    assert!(figure.contains(">\nthroughput\n</text>") && figure.contains(">\n20.5\n</text>") && figure.matches("<circle").count() == 2 * 4 + 4, "{figure}");
    fails_with(&merg(&["plot", "serve-load", svg.to_str().unwrap(), "--out", "x.png"]), &["serve.svg", "not JSON"]);
}

/// The benchmark runs on a real checkpoint too (shape of its report only; numbers are for
/// `merg bench-agents` runs, not for tests).
#[test]
fn bench_agents_reports_cache_counters_and_every_pair() {
    let tmp = tempfile::tempdir().unwrap();
    let plot = tmp.path().join("agents.svg");
    let o = merg(&[
        "bench-agents", "--model", &model("qwen2_5_vl"), "--dialogues", "2", "--new-tokens", "2", "--keyframes", "1",
        "--keyframe-size", "56", "--repeats", "2", "--kv-memory", "blocks:256", "--plot", plot.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(r["wall_ratios"].as_array().unwrap().len(), 2);
    assert_eq!(r["pair_walls_s"].as_array().unwrap().len(), 2);
    // The figure: both pairs' walls, cache on and off, and the tokens computed.
    let figure = std::fs::read_to_string(&plot).unwrap();
    for s in ["wall per dialogue", "prompt tokens", "cache on", "cache off", "computed", "from the cache"] {
        assert!(figure.contains(&format!(">\n{s}\n</text>")), "{s}: {figure}");
    }
    let on = &r["with_cache"]["stats"]["prefix"];
    let off = &r["without_cache"]["stats"]["prefix"];
    assert_eq!(on["prompt_tokens"], off["prompt_tokens"], "same workload both ways");
    assert_eq!(off["cached_tokens"], 0);
    assert!(r["cache_hit_fraction"].as_f64().unwrap() > 0.3, "{r}");
    assert_eq!(r["with_cache"]["requests"], 16);
}

/// `merg bench-agents` takes a Qwen3-VL (dense and MoE) config: dummy weights of its shape,
/// the family's released chat template, and the cache-hit share in the report. The tiny
/// checkpoints' configs run with their own tokenizer (the README test command runs without
/// ../shared); with the real Qwen2 tokenizer present, the real-vocabulary dummy configs too.
/// A tokenizer whose media ids disagree with the config is refused by name.
#[test]
fn bench_agents_takes_qwen3_vl_configs() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let tiny_tok = tiny_dir("qwen3_vl").join("tokenizer.json");
    let real_tok = root.join("../shared/data/qwen2-tokenizer/tokenizer.json");
    let mut runs = vec![
        (tiny_dir("qwen3_vl").join("config.json"), tiny_tok.clone()),
        (tiny_dir("qwen3_vl_moe").join("config.json"), tiny_tok.clone()),
    ];
    if real_tok.exists() {
        runs.push((root.join("models/dummy-small-qwen3-vl.json"), real_tok.clone()));
        runs.push((root.join("models/dummy-small-qwen3-vl-moe.json"), real_tok));
    }
    let mismatch = merg(&["bench-agents", "--config", root.join("models/dummy-small-qwen3-vl.json").to_str().unwrap(), "--tokenizer", tiny_tok.to_str().unwrap()]);
    assert!(!mismatch.status.success() && stderr(&mismatch).contains("image token is id 460 but the model config says 151655"), "{}", stderr(&mismatch));
    for (cfg, tok) in runs {
        let cfg = cfg.to_str().unwrap();
        let o = merg(&[
            "bench-agents", "--config", cfg, "--tokenizer", tok.to_str().unwrap(),
            "--dialogues", "2", "--new-tokens", "2", "--keyframes", "2", "--keyframe-size", "64", "--repeats", "1",
            "--kv-memory", "blocks:512",
        ]);
        assert!(o.status.success(), "{cfg}: {}", stderr(&o));
        let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        println!("{cfg}: cache hit fraction {}", r["cache_hit_fraction"]);
        assert!(r["cache_hit_fraction"].as_f64().unwrap() > 0.3, "{cfg}: {r}");
        assert_eq!(r["with_cache"]["requests"], 16, "{cfg}: the same 8 calls per dialogue as for Qwen2.5-VL");
    }
}

/// The paper's setting: Qwen3.5-27B on one 24 GiB card fed by a 32 GiB host. At q4k it holds
/// 8 dialogues of 4k tokens (weights, K/V of the 16 attention layers, the 48 Gated DeltaNet
/// states each) and the host can load it (the 248k-row head is quantized a band of rows at a
/// time); in bf16 the weights alone exceed the card. As one 24 GiB memory (a CPU) it fits too;
/// a 1 GiB host cannot pass its largest tensor through.
fn weights_of(plan: &serde_json::Value) -> u64 {
    plan["text_weight_bytes"].as_u64().unwrap() + plan["vision_weight_bytes"].as_u64().unwrap()
}

#[test]
fn plan_fits_qwen3_5_27b_at_q4k_in_24_gib_but_not_bf16() {
    let cfg = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models/qwen3.5-27b.json");
    let run = |extra: &[&str]| -> serde_json::Value {
        let mut args = vec!["plan", "--config", cfg.to_str().unwrap(), "--memory", "24GiB", "--dialogues", "8", "--context", "4096", "--json"];
        args.extend_from_slice(extra);
        let o = merg(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice(&o.stdout).unwrap()
    };
    let q4k = run(&["--quant", "q4k", "--host-memory", "32GiB"]);
    println!("q4k: {q4k}");
    assert_eq!((q4k["fits"].as_bool(), q4k["host_fits"].as_bool()), (Some(true), Some(true)));
    assert!(q4k["host_load_peak_bytes"].as_u64().unwrap() < 32 << 30);
    let one = run(&["--quant", "q4k"]);
    assert_eq!((one["fits"].as_bool(), one["host_fits"].as_bool()), (Some(true), Some(true)), "{one}");
    let peak = one["host_load_peak_bytes"].as_u64().unwrap();
    assert!(peak > weights_of(&one) && peak < weights_of(&one) + (2 << 30), "weights + one head's blocks in flight: {one}");
    let small_host = run(&["--quant", "q4k", "--host-memory", "1GiB"]);
    assert_eq!((small_host["fits"].as_bool(), small_host["host_fits"].as_bool()), (Some(false), Some(false)), "{small_host}");
    assert_eq!(q4k["kv_bytes_per_token"], 2 * 16 * 4 * 256 * 2, "K+V, 16 attention layers, 4 kv heads of 256, bf16");
    assert_eq!(q4k["state_bytes_per_sequence"], 48 * 4 * (3 * (2 * 16 * 128 + 48 * 128) + 48 * 128 * 128), "48 linear layers: conv window + delta-rule state, f32");
    let weights = weights_of(&q4k);
    assert!((15u64 << 30..19u64 << 30).contains(&weights), "a Q4_K_M-sized 27B: {weights}");
    let bf16 = run(&["--host-memory", "32GiB"]);
    assert_eq!(bf16["fits"], false);
    assert!(bf16["free_bytes"].as_i64().unwrap() < 0, "bf16 weights alone exceed 24 GiB");
    let bad = merg(&["plan", "--config", cfg.to_str().unwrap(), "--memory", "lots"]);
    assert!(!bad.status.success() && stderr(&bad).contains("--memory"), "{}", stderr(&bad));
}

/// The CPU kernels' fallbacks (forced as on a machine without AVX-512 or AVX2) give the same
/// greedy tokens as the best level here, and say which kernels run.
#[test]
fn cpu_kernel_fallbacks_give_the_same_tokens() {
    let dir = common::tiny_dir("qwen2_5_vl");
    let run = |level: Option<&str>| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_merg"));
        c.args(["generate", "--model", dir.to_str().unwrap(), "--prompt", "How was your day? Tell me everything.", "--max-new-tokens", "12", "--json"]);
        if let Some(l) = level {
            c.env("MERG_CPU_KERNELS", l);
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        (v["tokens"].clone(), String::from_utf8_lossy(&o.stderr).into_owned())
    };
    let (best, _) = run(None);
    for level in ["avx2", "portable"] {
        let (tokens, stderr) = run(Some(level));
        assert_eq!(tokens, best, "{level}");
        let detected = merg::cpu::Level::detected();
        let want = if detected.name() == "portable" { "portable" } else { level };
        assert!(stderr.contains(&format!("cpu kernels: {want}")), "{level}: {stderr}");
    }
}

/// Temperature / top-p sampling draws the same tokens on the device path (MERG_CPU_KERNELS=
/// generic: each row's head ranked by candle's ops, one read-back) as on the host's whole row.
#[test]
fn sampled_tokens_are_the_same_on_the_device_path() {
    let dir = common::tiny_dir("qwen2_5_vl");
    let run = |generic: bool| {
        let mut c = Command::new(env!("CARGO_BIN_EXE_merg"));
        c.args(["generate", "--model", dir.to_str().unwrap(), "--prompt", "How was your day?", "--max-new-tokens", "24", "--json"]);
        c.args(["--temperature", "1.3", "--top-p", "0.95", "--seed", "9"]);
        if generic {
            c.env("MERG_CPU_KERNELS", "generic");
        }
        let o = c.output().unwrap();
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["tokens"].clone()
    };
    let host = run(false);
    assert_eq!(run(true), host);
    let distinct: std::collections::HashSet<String> = host.as_array().unwrap().iter().map(|t| t.to_string()).collect();
    assert!(distinct.len() > 6, "a sampled reply, not a repeated token: {host}");
}

/// A forced level above what the machine has runs at the detected level with a warning that
/// names it, instead of faulting on an instruction the CPU lacks.
#[test]
fn forcing_a_level_the_machine_lacks_warns_and_runs() {
    let cfg = tiny_dir("qwen2_5_vl").join("config.json");
    let o = Command::new(env!("CARGO_BIN_EXE_merg"))
        .args(["bench", "--config", cfg.to_str().unwrap(), "--prompt-tokens", "4", "--decode-tokens", "2", "--no-roofline"])
        .env("MERG_CPU_KERNELS", "avx512")
        .output()
        .unwrap();
    let e = stderr(&o);
    assert!(o.status.success(), "{e}");
    let detected = merg::cpu::Level::detected();
    assert!(e.contains(&format!("cpu kernels: {}", detected.name())), "{e}");
    let warned = e.contains(&format!("warning: MERG_CPU_KERNELS=avx512 asks for more than this machine has; using {}", detected.name()));
    assert_eq!(warned, detected < merg::cpu::Level::Avx512, "{e}");
}

/// The paper's Table 5 backbones beyond the Qwen families: the Gemma 3 configs in models/ count
/// the published parameters (4,300,079,472; 12,187,325,040; 27,432,406,640), Gemma 3 12B at 4 bits
/// holds 8 dialogues of 4k tokens on a 24 GiB card (LLaVA 13B with the 8-bit K/V cache), and
/// `bench-agents` runs the five-agent
/// workload on the tiny LLaVA-NeXT and Gemma 3 checkpoints.
#[test]
fn gemma3_and_llava_next_plan_and_bench_agents() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for (name, total) in [("gemma3-4b-it", 4_300_079_472u64), ("gemma3-12b-it", 12_187_325_040), ("gemma3-27b-it", 27_432_406_640)] {
        let cfg = root.join(format!("models/{name}.json"));
        let o = merg(&["plan", "--config", cfg.to_str().unwrap(), "--memory", "24GiB", "--quant", "q4k", "--json"]);
        assert!(o.status.success(), "{name}: {}", stderr(&o));
        let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        let p = &r["params"];
        let got = p["text_active"].as_u64().unwrap() + p["vision"].as_u64().unwrap();
        assert_eq!(got, total, "{name}: parameters");
        if name == "gemma3-12b-it" {
            assert_eq!(r["fits"], true, "{name} at q4k, 8 × 4096 on 24 GiB: {r}");
        }
    }
    // LLaVA 13B at 4 bits: 8 × 4096 tokens of its 40 full-width layers' K/V take 25 GiB in
    // bf16, more than the card; the 8-bit cache (425 KiB a token) fits them.
    let llava = root.join("models/llava-v1.6-vicuna-13b.json");
    let fits = |kv: &str| {
        let o = merg(&["plan", "--config", llava.to_str().unwrap(), "--memory", "24GiB", "--quant", "q4k", "--kv-dtype", kv, "--json"]);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_slice::<serde_json::Value>(&o.stdout).unwrap()["fits"].clone()
    };
    assert_eq!((fits("auto"), fits("q8")), (serde_json::json!(false), serde_json::json!(true)), "LLaVA 13B q4k on 24 GiB");
    let bad = merg(&["plan", "--config", llava.to_str().unwrap(), "--memory", "24GiB", "--kv-dtype", "fp4"]);
    assert!(!bad.status.success() && stderr(&bad).contains("--kv-dtype fp4: must be auto or q8"), "{}", stderr(&bad));
    for family in ["llava_next", "gemma3"] {
        let o = merg(&[
            "bench-agents", "--model", &model(family), "--dialogues", "2", "--new-tokens", "2", "--keyframes", "2",
            "--keyframe-size", "64", "--repeats", "1", "--kv-memory", "blocks:512",
        ]);
        assert!(o.status.success(), "{family}: {}", stderr(&o));
        let r: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        println!("{family}: cache hit fraction {}", r["cache_hit_fraction"]);
        assert!(r["cache_hit_fraction"].as_f64().unwrap() > 0.3, "{family}: {r}");
        assert_eq!(r["with_cache"]["requests"], 16, "{family}");
    }
}
