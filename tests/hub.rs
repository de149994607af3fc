//! Checkpoint resolution against fake hub caches and local directories (never the network:
//! every hub lookup here is offline through `resolve_with`; process env is not touched).

use merg::hub::{resolve_with, HubOptions, ModelFiles};
use std::path::{Path, PathBuf};

const SHA: &str = "0123456789abcdef0123456789abcdef01234567";

fn write(p: &Path, s: &str) {
    std::fs::create_dir_all(p.parent().unwrap()).unwrap();
    std::fs::write(p, s).unwrap();
}

fn offline(cache: &Path) -> HubOptions {
    HubOptions {
        cache_dir: cache.to_path_buf(),
        offline: true,
    }
}

/// `cache/models--org--name/{refs/<rev>, snapshots/<sha>/files}`; returns the snapshot dir.
fn fake_repo(cache: &Path, repo: &str, rev: &str, files: &[&str]) -> PathBuf {
    let root = cache.join(format!("models--{}", repo.replace('/', "--")));
    write(&root.join("refs").join(rev), SHA); // Python writes no trailing newline
    let snap = root.join("snapshots").join(SHA);
    for f in files {
        write(&snap.join(f), "{}");
    }
    snap
}

const BASE: &[&str] = &["config.json", "tokenizer.json"];

#[test]
fn offline_single_file_repo() {
    let cache = tempfile::tempdir().unwrap();
    let snap = fake_repo(
        cache.path(),
        "Qwen/Qwen2-VL-2B-Instruct",
        "main",
        &[
            "config.json",
            "tokenizer.json",
            "model.safetensors",
            "tokenizer_config.json",
            "chat_template.json",
        ],
    );
    let m = resolve_with("Qwen/Qwen2-VL-2B-Instruct", None, &offline(cache.path())).unwrap();
    assert_eq!(
        m,
        ModelFiles {
            source: "Qwen/Qwen2-VL-2B-Instruct".into(),
            revision: Some("main".into()),
            dir: snap.clone(),
            config: snap.join("config.json"),
            weights: vec![snap.join("model.safetensors")],
            tokenizer: snap.join("tokenizer.json"),
            tokenizer_config: Some(snap.join("tokenizer_config.json")),
            preprocessor_config: None,
            video_preprocessor_config: None,
            generation_config: None,
            chat_template: Some(snap.join("chat_template.json")),
        }
    );
}

#[test]
fn offline_sharded_repo_with_branch_and_commit_revisions() {
    let cache = tempfile::tempdir().unwrap();
    let snap = fake_repo(cache.path(), "org/sharded", "v1.0", BASE);
    write(
        &snap.join("model.safetensors.index.json"),
        r#"{"metadata": {}, "weight_map": {"a": "model-00002-of-00002.safetensors",
            "b": "model-00001-of-00002.safetensors", "c": "model-00002-of-00002.safetensors"}}"#,
    );
    write(&snap.join("model-00001-of-00002.safetensors"), "");
    write(&snap.join("model-00002-of-00002.safetensors"), "");
    let want = vec![
        snap.join("model-00001-of-00002.safetensors"),
        snap.join("model-00002-of-00002.safetensors"),
    ];
    let m = resolve_with("org/sharded", Some("v1.0"), &offline(cache.path())).unwrap();
    assert_eq!(m.weights, want);
    assert_eq!(m.revision.as_deref(), Some("v1.0"));
    // A commit hash works without a ref file.
    let m = resolve_with("org/sharded", Some(SHA), &offline(cache.path())).unwrap();
    assert_eq!(m.weights, want);
    // "main" has no ref here.
    let e = resolve_with("org/sharded", None, &offline(cache.path())).unwrap_err();
    assert!(
        format!("{e:#}").contains("no snapshot for revision main"),
        "{e:#}"
    );
}

#[test]
fn offline_missing_shard_names_index_and_shard() {
    let cache = tempfile::tempdir().unwrap();
    let snap = fake_repo(cache.path(), "org/broken", "main", BASE);
    write(
        &snap.join("model.safetensors.index.json"),
        r#"{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}"#,
    );
    write(&snap.join("model-00001-of-00002.safetensors"), "");
    let e = format!(
        "{:#}",
        resolve_with("org/broken", None, &offline(cache.path())).unwrap_err()
    );
    assert!(
        e.contains("model-00002-of-00002.safetensors")
            && e.contains("model.safetensors.index.json"),
        "{e}"
    );
    assert!(!e.contains("model-00001-of-00002"), "{e}");
}

#[test]
fn offline_missing_repo_explains_how_to_provide_it() {
    let cache = tempfile::tempdir().unwrap();
    let e = format!(
        "{:#}",
        resolve_with("Qwen/Qwen2.5-VL-3B-Instruct", None, &offline(cache.path())).unwrap_err()
    );
    for needle in [
        "Qwen/Qwen2.5-VL-3B-Instruct",
        "config.json",
        "tokenizer.json",
        "model.safetensors",
        "huggingface-cli download Qwen/Qwen2.5-VL-3B-Instruct --local-dir",
        "load it as a local directory",
        "HF_HOME",
    ] {
        assert!(e.contains(needle), "missing {needle:?} in: {e}");
    }
}

#[test]
fn local_dir_single_and_missing_files() {
    let d = tempfile::tempdir().unwrap();
    let e = format!(
        "{:#}",
        resolve_with(d.path().to_str().unwrap(), None, &offline(d.path())).unwrap_err()
    );
    assert!(e.contains(&d.path().display().to_string()), "{e}");
    for f in ["config.json", "tokenizer.json", "model.safetensors"] {
        assert!(e.contains(f), "missing {f} in: {e}");
    }
    for f in [
        "config.json",
        "tokenizer.json",
        "model.safetensors",
        "generation_config.json",
    ] {
        write(&d.path().join(f), "{}");
    }
    let m = resolve_with(d.path().to_str().unwrap(), None, &offline(d.path())).unwrap();
    assert_eq!(m.dir, d.path());
    assert_eq!(m.weights, vec![d.path().join("model.safetensors")]);
    assert_eq!(
        m.generation_config,
        Some(d.path().join("generation_config.json"))
    );
    assert_eq!(m.revision, None);
    assert_eq!(m.chat_template, None);
}

#[test]
fn local_dir_missing_shard_and_bad_index() {
    let d = tempfile::tempdir().unwrap();
    for f in BASE {
        write(&d.path().join(f), "{}");
    }
    let index = d.path().join("model.safetensors.index.json");
    write(&index, r#"{"weight_map": {"w": "shard-a.safetensors"}}"#);
    let e = format!(
        "{:#}",
        resolve_with(d.path().to_str().unwrap(), None, &offline(d.path())).unwrap_err()
    );
    assert!(
        e.contains("shard-a.safetensors") && e.contains(&index.display().to_string()),
        "{e}"
    );
    write(&index, r#"{"weight_map": {"w": "../../etc/passwd"}}"#);
    let e = format!(
        "{:#}",
        resolve_with(d.path().to_str().unwrap(), None, &offline(d.path())).unwrap_err()
    );
    assert!(e.contains("unsafe path"), "{e}");
    write(&index, "not json");
    let e = format!(
        "{:#}",
        resolve_with(d.path().to_str().unwrap(), None, &offline(d.path())).unwrap_err()
    );
    assert!(e.contains("not valid JSON"), "{e}");
}

#[test]
fn bad_model_arguments() {
    let d = tempfile::tempdir().unwrap();
    let o = offline(d.path());
    assert!(format!("{:#}", resolve_with("", None, &o).unwrap_err()).contains("empty"));
    let e = format!("{:#}", resolve_with("./no/such/dir", None, &o).unwrap_err());
    assert!(
        e.contains("./no/such/dir") && e.contains("does not exist"),
        "{e}"
    );
    let f = d.path().join("file.txt");
    write(&f, "x");
    let e = format!(
        "{:#}",
        resolve_with(f.to_str().unwrap(), None, &o).unwrap_err()
    );
    assert!(e.contains("is a file"), "{e}");
}

#[test]
fn tiny_fixture_checkpoints_resolve_as_local_dirs() {
    for name in ["tiny-qwen2-vl", "tiny-qwen2_5-vl"] {
        let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures")
            .join(name);
        if !dir.is_dir() {
            eprintln!("SKIP: fixture {} absent", dir.display());
            continue;
        }
        let m = resolve_with(dir.to_str().unwrap(), None, &offline(&dir)).unwrap();
        assert_eq!(m.weights.len(), 2, "{name}");
        assert!(
            m.preprocessor_config.is_some() && m.tokenizer_config.is_some(),
            "{name}"
        );
        assert_eq!(m.chat_template, Some(dir.join("chat_template.json")));
    }
}

#[test]
fn hub_options_from_env_variables() {
    let env = |pairs: &'static [(&'static str, &'static str)]| {
        HubOptions::from_lookup(move |k| {
            pairs
                .iter()
                .find(|(n, _)| *n == k)
                .map(|(_, v)| v.to_string())
        })
    };
    let o = env(&[("HOME", "/home/u")]);
    assert_eq!(
        o,
        HubOptions {
            cache_dir: "/home/u/.cache/huggingface/hub".into(),
            offline: false
        }
    );
    let o = env(&[
        ("HOME", "/home/u"),
        ("XDG_CACHE_HOME", "/x"),
        ("HF_HUB_OFFLINE", "1"),
    ]);
    assert_eq!(
        o,
        HubOptions {
            cache_dir: "/x/huggingface/hub".into(),
            offline: true
        }
    );
    let o = env(&[
        ("HOME", "/home/u"),
        ("HF_HOME", "/hf"),
        ("HF_HUB_OFFLINE", "TRUE"),
    ]);
    assert_eq!(
        o,
        HubOptions {
            cache_dir: "/hf/hub".into(),
            offline: true
        }
    );
    let o = env(&[
        ("HF_HOME", "/hf"),
        ("HF_HUB_CACHE", "/cache"),
        ("HF_HUB_OFFLINE", "0"),
    ]);
    assert_eq!(
        o,
        HubOptions {
            cache_dir: "/cache".into(),
            offline: false
        }
    );
    assert!(!env(&[("HF_HUB_OFFLINE", "")]).offline);
}
