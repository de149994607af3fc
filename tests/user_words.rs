//! Errors in the user's words, one test per class: a bad value is named by the flag the user
//! typed, it is printed exactly as typed (never in Rust's debug form), and the error names the
//! real cause (a context window of 0 is not "no memory left for the KV cache").

mod common;

use std::process::Command;

use common::*;

/// (exit ok, stderr) of `merg args`.
fn merg(args: &[&str]) -> (bool, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_merg")).args(args).env("HF_HUB_OFFLINE", "1").output().unwrap();
    (o.status.success(), String::from_utf8_lossy(&o.stderr).into_owned())
}

/// The error line of a run that must fail cleanly.
fn error_of(args: &[&str]) -> String {
    let (ok, err) = merg(args);
    assert!(!ok, "expected {args:?} to fail: {err}");
    assert!(!err.contains("panicked"), "{args:?} panicked: {err}");
    let line = err.lines().find(|l| l.starts_with("error")).unwrap_or_else(|| panic!("no error line for {args:?}: {err}"));
    // Rust's debug forms of the library's own types must never reach the user.
    for debug in ["Some(", "None", "Blocks(", "Bytes(", "Fraction(", "\\\\"] {
        assert!(!line.contains(debug), "debug form {debug:?} in: {line}");
    }
    line.to_string()
}

fn tiny() -> String {
    tiny_dir("qwen2_5_vl").to_string_lossy().into_owned()
}

/// `args` with `--FLAG VALUE` appended fail with "--FLAG VALUE: must be …".
fn assert_named(args: &[&str], flag: &str, value: &str) {
    let mut all: Vec<&str> = args.to_vec();
    all.extend([flag, value]);
    let line = error_of(&all);
    assert!(line.contains(&format!("{flag} {value}: must be ")), "{flag} {value} not named as typed: {line}");
}

#[test]
fn every_checked_value_is_named_by_the_flag_typed() {
    let m = tiny();
    let gen = ["generate", "--model", &m, "--prompt", "hi"];
    for (flag, value) in [
        ("--top-p", "1.5"),
        ("--top-p", "-1"),
        ("--temperature", "-0.5"),
        ("--max-new-tokens", "0"),
        ("--max-context", "0"),
        ("--block-size", "0"),
        ("--max-num-seqs", "0"),
        ("--max-step-tokens", "0"),
        ("--kv-memory", "lots"),
        ("--dtype", "f64"),
        ("--device", "gpu"),
        ("--quant", "q9"),
    ] {
        assert_named(&gen, flag, value);
    }
    let dialogue = fixtures().join("data").join("..").join("media").join("none.json");
    let dialogue = dialogue.to_string_lossy();
    let respond = ["respond", "--model", &m, "--dialogue", &dialogue];
    for (flag, value) in [("--t-max", "6"), ("--top-k", "9"), ("--max-field-chars", "0"), ("--labels", "joy"), ("--labels", "joy,joy")] {
        assert_named(&respond, flag, value);
    }
    let meld = fixtures().join("data").join("meld").join("clean");
    let meld = meld.to_string_lossy();
    let eval = ["eval", "--model", &m, "--dataset", "meld", "--data-dir", &meld, "--out", "/nonexistent/merg-eval"];
    assert_named(&eval, "--split", "Tset");
    let eval: Vec<&str> = eval.iter().copied().chain(["--split", "test"]).collect();
    for (flag, value) in [("--shard", "3/2"), ("--shard", "x"), ("--limit", "0"), ("--concurrency", "0"), ("--distinct-chunk", "0")] {
        assert_named(&eval, flag, value);
    }
    assert_named(&["bench", "--model", &m, "--no-roofline"], "--prompt-tokens", "0");
    assert_named(&["bench", "--model", &m, "--no-roofline", "--quant", "f32"], "--quant", "q9");
    assert_named(&["bench-agents", "--model", &m], "--new-tokens", "0");
    assert_named(&["bench", "--model", &m, "--no-roofline"], "--plot", "fig.jpg");
    assert_named(&["bench-agents", "--model", &m], "--dialogues", "0");
    if cfg!(feature = "serve") {
        let serve = ["serve", "--model", &m, "--port", "0"];
        for (flag, value) in [("--max-connections", "0"), ("--max-tokens", "0"), ("--header-timeout", "0"), ("--body-timeout", "nan"), ("--shutdown-grace", "-1")] {
            assert_named(&serve, flag, value);
        }
    }
    let cfg = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join("qwen2-vl-7b-instruct.json");
    let plan = ["plan", "--config", cfg.to_str().unwrap(), "--memory", "24GiB"];
    assert_named(&plan, "--dialogues", "0");
    assert_named(&plan, "--context", "0");
}

#[test]
fn values_are_printed_as_typed() {
    let m = tiny();
    let gen = ["generate", "--model", &m, "--prompt", "hi"];
    // Not re-formatted (1.5), not escaped (F3\\2), not the parsed enum (Blocks(0)).
    assert_named(&gen, "--top-p", "1.50");
    assert_named(&gen, "--dtype", r"F3\2");
    assert_named(&gen, "--kv-memory", "blocks:0");
    // Of a list flag, the entry at fault.
    let line = error_of(&["bench", "--model", &m, "--no-roofline", "--quant", "f32,Q9"]);
    assert!(line.contains("--quant Q9: must be "), "{line}");
    // A default the user never typed is called the default.
    let cfg = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("models").join("qwen2-vl-7b-instruct.json");
    let (_, err) = merg(&["plan", "--config", cfg.to_str().unwrap(), "--memory", "24GiB", "--dtype", "\"f32\""]);
    assert!(err.contains("--dtype \"f32\": must be bf16, f16 or f32"), "{err}");
}

#[test]
fn errors_name_the_real_cause() {
    let m = tiny();
    // A context window of 0, from the flag or from the model's config, is named as such.
    let line = error_of(&["generate", "--model", &m, "--prompt", "hi", "--max-context", "0"]);
    assert!(line.contains("--max-context 0") && !line.contains("KV"), "{line}");
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(tiny_dir("qwen2_5_vl")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.path().join(p.file_name().unwrap())).unwrap();
    }
    let cfg_path = dir.path().join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["max_position_embeddings"] = 0.into();
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    let line = error_of(&["generate", "--model", dir.path().to_str().unwrap(), "--prompt", "hi"]);
    assert!(line.contains("config.json") && line.contains("max_position_embeddings must be at least 1, got 0") && !line.contains("KV"), "{line}");
    // A pool too small for one block says how big a block is, against the flag.
    let line = error_of(&["generate", "--model", &m, "--prompt", "hi", "--kv-memory", "1KiB"]);
    assert!(line.contains("--kv-memory 1KiB: must be enough for one block of 16 tokens"), "{line}");
    // A prompt plus decode past the window is the window, not the prompt flag alone.
    let line = error_of(&["bench", "--model", &m, "--no-roofline", "--prompt-tokens", "4000", "--decode-tokens", "8"]);
    assert!(line.contains("4008 tokens") && line.contains("context window of 2048"), "{line}");
    // Too few frames for one temporal patch of a video.
    let clip = fixtures().join("media").join("clip.mp4");
    if cfg!(feature = "video") {
        let line = error_of(&["generate", "--model", &m, "--prompt", "hi", "--video", clip.to_str().unwrap(), "--max-frames", "1"]);
        assert!(line.contains("--max-frames 1: must be at least 2, the frames of one temporal patch"), "{line}");
    }
}
