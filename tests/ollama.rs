//! Models pulled with Ollama: a fake store (manifest JSON + blobs named by their SHA-256, as
//! Ollama writes them) made from the GGUF fixtures; `--model ollama:NAME[:TAG]` loads it as
//! the same GGUF files, `info` shows Ollama's layers, `serve` lists it as Ollama does, and a
//! missing tag, a damaged blob, a manifest without a model layer, a model without a projector
//! and vision tensors kept inside the text blob are clear errors.

mod common;

use std::path::{Path, PathBuf};

use common::cli::{run_with, Run};
use common::{fixtures, rewritten_gguf};
use sha2::{Digest, Sha256};

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// A store under `root` with one model `name:tag` whose layers are `(media type, bytes)`.
fn store(root: &Path, name: &str, tag: &str, layers: &[(&str, Vec<u8>)]) {
    let blobs = root.join("blobs");
    std::fs::create_dir_all(&blobs).unwrap();
    let mut entries = vec![];
    for (kind, bytes) in layers {
        let digest = hex(&Sha256::digest(bytes));
        std::fs::write(blobs.join(format!("sha256-{digest}")), bytes).unwrap();
        entries.push(serde_json::json!({"mediaType": kind, "digest": format!("sha256:{digest}"), "size": bytes.len()}));
    }
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": "application/vnd.docker.container.image.v1+json", "digest": "sha256:00", "size": 2},
        "layers": entries,
    });
    let dir = root.join("manifests/registry.ollama.ai/library").join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join(tag), serde_json::to_vec(&manifest).unwrap()).unwrap();
}

fn fixture(name: &str) -> Vec<u8> {
    std::fs::read(fixtures().join("gguf/qwen2_5-vl").join(name)).unwrap()
}

const MODEL: &str = "application/vnd.ollama.image.model";
const PROJECTOR: &str = "application/vnd.ollama.image.projector";
const TEMPLATE: &str = "application/vnd.ollama.image.template";
const PARAMS: &str = "application/vnd.ollama.image.params";

fn merg(store: &Path, cache: &Path, args: &[&str]) -> Run {
    let args: Vec<String> = args.iter().map(|s| s.to_string()).collect();
    run_with(&args, &[("OLLAMA_MODELS", store.as_os_str()), ("XDG_CACHE_HOME", cache.as_os_str())], "/api/tags")
}

fn tiny_store(root: &Path) {
    store(
        root,
        "tiny-qwen",
        "q8",
        &[
            (MODEL, fixture("tiny-qwen2_5-vl-q8_0.gguf")),
            (PROJECTOR, fixture("mmproj-tiny-qwen2_5-vl-f32.gguf")),
            (TEMPLATE, b"{{ .Prompt }} (Ollama's template)".to_vec()),
            (PARAMS, br#"{"stop": ["<|im_end|>"]}"#.to_vec()),
        ],
    );
}

#[test]
fn a_model_from_ollamas_store_runs_as_its_gguf_files() {
    let d = tempfile::tempdir().unwrap();
    let (root, cache) = (d.path().join("models"), d.path().join("cache"));
    tiny_store(&root);
    let info = merg(&root, &cache, &["info", "--model", "ollama:tiny-qwen:q8"]);
    assert!(info.ok, "{}", info.stderr);
    for needle in ["ollama:    tiny-qwen:q8", "format:    q8_0", "(Ollama's template)", "\"stop\""] {
        assert!(info.stdout.contains(needle), "{needle:?} missing from:\n{}", info.stdout);
    }
    // Verified once: the marker names the blob.
    assert!(std::fs::read_dir(cache.join("merg/ollama-verified")).unwrap().count() >= 2);
    let gen = |model: &str| {
        let r = merg(&root, &cache, &["generate", "--model", model, "--prompt", "Hello", "--max-new-tokens", "6", "--json"]);
        assert!(r.ok, "{model}: {}", r.stderr);
        r.stdout
    };
    let q8 = fixtures().join("gguf/qwen2_5-vl/tiny-qwen2_5-vl-q8_0.gguf");
    assert_eq!(gen("ollama:tiny-qwen:q8"), gen(q8.to_str().unwrap()), "the same files, the same tokens");
    if cfg!(feature = "serve") {
        let s = merg(&root, &cache, &["serve", "--model", "ollama:tiny-qwen:q8", "--port", "0"]);
        let tags = s.probed.unwrap_or_default();
        let manifest = std::fs::read(root.join("manifests/registry.ollama.ai/library/tiny-qwen/q8")).unwrap();
        assert!(s.ok && tags.contains("\"name\":\"tiny-qwen:q8\"") && tags.contains(&hex(&Sha256::digest(&manifest))), "{tags}\n{}", s.stderr);
    }
}

fn fails(root: &Path, cache: &Path, model: &str, needles: &[&str]) {
    let r = merg(root, cache, &["plan", "--model", model, "--memory", "1GiB"]);
    assert!(!r.ok, "{model} should fail:\n{}", r.stdout);
    assert!(!r.stderr.contains("panicked"), "{}", r.stderr);
    for n in needles {
        assert!(r.stderr.contains(n), "{n:?} missing from {model}'s error:\n{}", r.stderr);
    }
}

#[test]
fn bad_stores_are_clear_errors() {
    let d = tempfile::tempdir().unwrap();
    let (root, cache) = (d.path().join("models"), d.path().join("cache"));
    tiny_store(&root);
    fails(&root, &cache, "ollama:tiny-qwen", &["no tag \"latest\"", "q8"]);
    fails(&root, &cache, "ollama:absent:7b", &["no model absent", "ollama pull absent:7b"]);
    fails(&root, &cache, "ollama:a/b/c/d", &["not an Ollama model name"]);
    // A manifest without a model layer.
    store(&root, "nomodel", "latest", &[(TEMPLATE, b"x".to_vec())]);
    fails(&root, &cache, "ollama:nomodel", &["no model layer"]);
    // Text only, and vision tensors inside the text blob (Ollama's newer layout).
    store(&root, "textonly", "latest", &[(MODEL, fixture("tiny-qwen2_5-vl-q8_0.gguf"))]);
    fails(&root, &cache, "ollama:textonly", &["no projector layer", "text-only"]);
    store(&root, "inside", "latest", &[(MODEL, with_vision_tensor(&fixtures().join("gguf/qwen2_5-vl/tiny-qwen2_5-vl-q8_0.gguf")))]);
    fails(&root, &cache, "ollama:inside", &["inside its text blob", "v.*/mm.*", "mmproj"]);
    // A blob cut short, and one of the right size with other bytes.
    let blob = |name: &str| -> PathBuf {
        let m: serde_json::Value = serde_json::from_slice(&std::fs::read(root.join("manifests/registry.ollama.ai/library").join(name).join("latest")).unwrap()).unwrap();
        root.join("blobs").join(m["layers"][0]["digest"].as_str().unwrap().replace(':', "-"))
    };
    store(&root, "short", "latest", &[(MODEL, fixture("tiny-qwen2_5-vl-f32.gguf")), (PROJECTOR, fixture("mmproj-tiny-qwen2_5-vl-f32.gguf"))]);
    let b = blob("short");
    let bytes = std::fs::read(&b).unwrap();
    std::fs::write(&b, &bytes[..bytes.len() - 10]).unwrap();
    fails(&root, &cache, "ollama:short", &["holds", "bytes, its manifest says", "ollama pull short"]);
    store(&root, "flipped", "latest", &[(MODEL, fixture("tiny-qwen2_5-vl-f32.gguf").into_iter().chain([1u8]).collect()), (PROJECTOR, fixture("mmproj-tiny-qwen2_5-vl-f32.gguf"))]);
    let b = blob("flipped");
    let mut bytes = std::fs::read(&b).unwrap();
    *bytes.last_mut().unwrap() ^= 0xff;
    std::fs::write(&b, &bytes).unwrap();
    fails(&root, &cache, "ollama:flipped", &["does not match its digest"]);
}

/// `src` with one more tensor named as Ollama names vision tensors (`v.blk.0…`).
fn with_vision_tensor(src: &Path) -> Vec<u8> {
    use candle_core::quantized::{GgmlDType, QTensor};
    let v = candle_core::Tensor::zeros((4, 4), candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    rewritten_gguf(src, |_, _| {}, vec![("v.blk.0.attn_q.weight".into(), QTensor::quantize(&v, GgmlDType::F32).unwrap())])
}
