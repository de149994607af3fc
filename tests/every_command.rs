//! Every command that loads a model takes it through one argument group: a llama.cpp GGUF
//! file (the paper's format) runs on each of them, as it is and quantized in situ from F32,
//! and bad model input — an architecture merg has no family for, a projector of another
//! model, `--quant` on a quantized file — fails with the same words on every command.

mod common;

use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::Value;
use common::cli::run;
use common::{fixtures, rewritten_gguf};

const COMMANDS: [&str; 8] = ["generate", "respond", "eval", "serve", "bench", "bench-agents", "info", "plan"];

fn gguf(name: &str) -> PathBuf {
    fixtures().join("gguf").join(name)
}

fn s(p: &Path) -> String {
    p.to_str().unwrap().to_string()
}

/// `cmd`'s arguments for a short run with the model flags `model`; `out` takes its files.
fn args(cmd: &str, model: &[String], out: &Path) -> Vec<String> {
    let examples = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples");
    let mut a = vec![cmd.to_string()];
    let short_agents = ["--max-new-tokens", "240", "--max-field-chars", "16", "--kv-memory", "blocks:512"];
    let rest: Vec<String> = match cmd {
        "generate" => ["--prompt", "Hello", "--max-new-tokens", "2"].map(String::from).to_vec(),
        "respond" => {
            let mut v = vec!["--dialogue".into(), s(&examples.join("dialogue.json")), "--no-gra".into(), "--trace".into(), s(&out.join("trace.json"))];
            v.extend(short_agents.map(String::from));
            v
        }
        "eval" => {
            let data = fixtures().join("data/meld/clean");
            let mut v: Vec<String> = ["--dataset", "meld", "--split", "test", "--limit", "1", "--t-max", "0", "--quiet"].map(String::from).to_vec();
            v.extend(["--no-bertscore", "--no-emotion-polarity", "--data-dir"].map(String::from));
            v.extend([s(&data), "--out".into(), s(&out.join("eval"))]);
            v.extend(short_agents.map(String::from));
            v
        }
        "serve" => ["--port", "0"].map(String::from).to_vec(),
        "bench" => ["--prompt-tokens", "8", "--decode-tokens", "2", "--no-roofline"].map(String::from).to_vec(),
        "bench-agents" => ["--dialogues", "1", "--new-tokens", "2", "--keyframes", "1", "--keyframe-size", "56", "--repeats", "0"].map(String::from).to_vec(),
        "info" => vec![],
        "plan" => ["--memory", "1GiB"].map(String::from).to_vec(),
        other => panic!("no arguments for {other}"),
    };
    a.extend(model.iter().cloned());
    a.extend(rest);
    a
}

fn served(cmd: &str) -> bool {
    cmd != "serve" || cfg!(feature = "serve")
}

#[test]
fn every_command_runs_a_gguf_model() {
    let q8 = gguf("qwen2_5-vl/tiny-qwen2_5-vl-q8_0.gguf");
    let f32 = gguf("qwen2_5-vl/tiny-qwen2_5-vl-f32.gguf");
    let forms: [(&str, Vec<String>); 2] = [("as stored", vec!["--model".into(), s(&q8)]), ("quantized in situ", vec!["--model".into(), s(&f32), "--quant".into(), "q8_0".into()])];
    for cmd in COMMANDS.into_iter().filter(|c| served(c)) {
        for (form, model) in &forms {
            let out = tempfile::tempdir().unwrap();
            let r = run(&args(cmd, model, out.path()));
            assert!(r.ok, "merg {cmd} on a GGUF file {form} failed:\n{}", r.stderr);
        }
    }
}

/// The `error: …` line a failed command printed.
fn error_line(stderr: &str) -> String {
    stderr.lines().find(|l| l.starts_with("error: ")).unwrap_or_else(|| panic!("no error line in:\n{stderr}")).to_string()
}

#[test]
fn bad_model_input_fails_alike_on_every_command() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().join("phi3");
    std::fs::create_dir(&dir).unwrap();
    // A family merg does not run: the fixture with its architecture renamed.
    let renamed = rewritten_gguf(
        &gguf("qwen2_5-vl/tiny-qwen2_5-vl-q8_0.gguf"),
        |k, v| {
            if k == "general.architecture" {
                *v = Value::String("phi3".into());
            }
        },
        vec![],
    );
    std::fs::write(dir.join("model.gguf"), renamed).unwrap();
    std::fs::copy(gguf("qwen2_5-vl/mmproj-tiny-qwen2_5-vl-f32.gguf"), dir.join("mmproj-model.gguf")).unwrap();
    let cases: [(&str, Vec<String>, &[&str]); 3] = [
        ("an architecture with no family", vec!["--model".into(), s(&dir.join("model.gguf"))], &["model.gguf", "\"phi3\"", "is not one merg runs"]),
        (
            "a projector of another model",
            vec!["--model".into(), s(&gguf("qwen2_5-vl/tiny-qwen2_5-vl-q8_0.gguf")), "--mmproj".into(), s(&gguf("qwen3-vl/mmproj-tiny-qwen3-vl-f32.gguf"))],
            &["mmproj-tiny-qwen3-vl-f32.gguf", "belongs to another model"],
        ),
        (
            "--quant on a quantized file",
            vec!["--model".into(), s(&gguf("qwen2_5-vl/tiny-qwen2_5-vl-q8_0.gguf")), "--quant".into(), "q4k".into()],
            &["--quant", "tiny-qwen2_5-vl-q8_0.gguf", "already quantized (q8_0)"],
        ),
    ];
    for (what, model, needles) in cases {
        let mut first: Option<(String, String)> = None;
        for cmd in COMMANDS.into_iter().filter(|c| served(c)) {
            let out = tempfile::tempdir().unwrap();
            let r = run(&args(cmd, &model, out.path()));
            assert!(!r.ok, "merg {cmd} with {what} should fail:\n{}", r.stderr);
            assert!(!r.stderr.contains("panicked"), "merg {cmd} with {what} panicked:\n{}", r.stderr);
            let line = error_line(&r.stderr);
            for n in needles {
                assert!(line.contains(n), "merg {cmd} with {what}: {n:?} missing from {line:?}");
            }
            match &first {
                None => first = Some((cmd.to_string(), line)),
                Some((c0, l0)) => assert_eq!(&line, l0, "merg {cmd} and merg {c0} word {what} differently"),
            }
        }
    }
}
