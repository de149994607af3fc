//! Progress of long work: loading (and quantizing while loading) counts every tensor the model
//! takes against the file's tensor table, for safetensors and GGUF alike; the `merg` binary
//! draws it as a bar on a terminal and stays silent off one or with `--quiet`.

mod common;

use std::process::Command;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::Device;
use common::*;
use merg::checkpoint::{Checkpoint, LoadOptions};
use merg::progress::{Recorded, Recorder};
use merg::weights::Quant;

/// One recorder for this test binary (the reporter is process-wide), and a lock so each test
/// reads only the tasks it started.
fn recorder() -> (&'static Arc<Recorder>, std::sync::MutexGuard<'static, ()>) {
    static REC: OnceLock<Arc<Recorder>> = OnceLock::new();
    static ONE: Mutex<()> = Mutex::new(());
    let guard = ONE.lock().unwrap_or_else(|e| e.into_inner());
    let rec = REC.get_or_init(|| {
        let r = Arc::new(Recorder::default());
        merg::progress::set_reporter(Arc::new(r.clone()));
        r
    });
    rec.tasks.lock().unwrap().clear();
    (rec, guard)
}

fn only_task(rec: &Recorder) -> Recorded {
    let tasks = rec.tasks.lock().unwrap();
    assert_eq!(tasks.len(), 1, "{tasks:?}");
    tasks[0].clone()
}

/// Tensors in a checkpoint's safetensors shards, read from their headers.
fn safetensors_count(dir: &std::path::Path) -> u64 {
    let mut n = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            let bytes = std::fs::read(&p).unwrap();
            n += safetensors::SafeTensors::deserialize(&bytes).unwrap().len() as u64;
        }
    }
    n
}

#[test]
fn loading_counts_every_tensor_of_the_shards() {
    let (rec, _one) = recorder();
    let dir = tiny_dir("qwen2_5_vl");
    let files = merg::hub::resolve(dir.to_str().unwrap(), None).unwrap();
    Checkpoint::load(files, &Device::Cpu, None).unwrap();
    let t = only_task(rec);
    let total = safetensors_count(&dir);
    assert!(t.what.starts_with("loading ") && t.what.contains(".safetensors"), "{t:?}");
    assert_eq!((t.total, t.unit, t.ended), (Some(total), "tensors", true), "{t:?}");
    // The tiny checkpoint holds nothing the model leaves unread, and a tied head is one tensor.
    assert_eq!(t.done, total, "{t:?}");
}

#[test]
fn quantizing_while_loading_says_so_and_counts_the_same() {
    let (rec, _one) = recorder();
    let dir = tiny_dir("qwen2_5_vl");
    let files = merg::hub::resolve(dir.to_str().unwrap(), None).unwrap();
    Checkpoint::load_with(files, &Device::Cpu, &LoadOptions { quant: Some(Quant::Q8_0), ..Default::default() }).unwrap();
    let t = only_task(rec);
    assert!(t.what.contains("quantized to q8_0 while loading"), "{t:?}");
    assert_eq!((t.done, t.total, t.ended), (safetensors_count(&dir), Some(safetensors_count(&dir)), true), "{t:?}");
}

#[test]
fn a_gguf_pair_counts_both_files_tensors() {
    let (rec, _one) = recorder();
    let g = fixtures().join("gguf").join("qwen2_5-vl");
    let paths = merg::gguf::GgufPaths::new(g.join("tiny-qwen2_5-vl-f32.gguf"), Some(g.join("mmproj-tiny-qwen2_5-vl-f32.gguf")));
    Checkpoint::load_gguf(&paths, &Device::Cpu, &LoadOptions::default()).unwrap();
    let t = only_task(rec);
    let count = |p: &std::path::Path| merg::gguf::GgufFile::open(p).unwrap().header.tensors.len() as u64;
    let total = count(&paths.text) + count(paths.mmproj.as_ref().unwrap());
    assert!(t.what.contains("tiny-qwen2_5-vl-f32.gguf"), "{t:?}");
    assert_eq!((t.total, t.ended), (Some(total), true), "{t:?}");
    assert!(t.done > total / 2 && t.done <= total, "{t:?}");
}

/// `merg generate` under a pseudo-terminal (util-linux `script`), its terminal output.
fn on_a_terminal(extra: &str) -> String {
    let m = tiny_dir("qwen2_5_vl");
    let cmd = format!("{} generate --model {} --prompt hi --max-new-tokens 2 {extra}", env!("CARGO_BIN_EXE_merg"), m.display());
    let o = Command::new("script").args(["-qec", &cmd, "/dev/null"]).env("HF_HUB_OFFLINE", "1").output().expect("util-linux `script`");
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

#[test]
fn the_binary_draws_a_bar_only_on_a_terminal_and_not_when_quiet() {
    let shown = on_a_terminal("");
    assert!(shown.contains("loading model-00001-of-00002.safetensors") && shown.contains(" tensors"), "{shown}");
    let quiet = on_a_terminal("--quiet");
    assert!(!quiet.contains("tensors"), "--quiet still drew: {quiet}");
    let piped = Command::new(env!("CARGO_BIN_EXE_merg"))
        .args(["generate", "--model", tiny_dir("qwen2_5_vl").to_str().unwrap(), "--prompt", "hi", "--max-new-tokens", "2"])
        .output()
        .unwrap();
    assert!(piped.status.success());
    assert!(!String::from_utf8_lossy(&piped.stderr).contains("tensors"), "a pipe got a bar");
}
