//! Finding a checkpoint: a local directory, or a Hugging Face repo id resolved through the
//! hub cache (offline) or the hub API (online, which also fills the cache). Downloading needs
//! the `hub` feature (on by default); without it a repo id resolves from the hub cache only,
//! as when offline, and one that is not cached is an error saying how to provide it.

use anyhow::{anyhow, bail, Context, Result};
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// Where every file of a checkpoint lives on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ModelFiles {
    /// The repo id or the directory as the user gave it.
    pub source: String,
    pub revision: Option<String>,
    /// Directory holding config.json (a snapshot directory for hub repos).
    pub dir: PathBuf,
    pub config: PathBuf,
    /// Safetensors files, in the sorted order of their names.
    pub weights: Vec<PathBuf>,
    pub tokenizer: PathBuf,
    pub tokenizer_config: Option<PathBuf>,
    pub preprocessor_config: Option<PathBuf>,
    /// Qwen3-VL keeps its video budget apart (`video_preprocessor_config.json`).
    pub video_preprocessor_config: Option<PathBuf>,
    pub generation_config: Option<PathBuf>,
    /// `chat_template.jinja` if present, else `chat_template.json`.
    pub chat_template: Option<PathBuf>,
}

/// Where the hub cache is and whether the network may be used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HubOptions {
    /// The `hub` cache directory (holding `models--org--name/`).
    pub cache_dir: PathBuf,
    /// Never touch the network; resolve from `cache_dir` only (always so without the `hub`
    /// feature).
    pub offline: bool,
}

impl HubOptions {
    /// From the environment, like `huggingface_hub`: `HF_HUB_CACHE`, else `$HF_HOME/hub`, else
    /// `$XDG_CACHE_HOME/huggingface/hub`, else `~/.cache/huggingface/hub`; offline when
    /// `HF_HUB_OFFLINE` is `1`, `true`, `yes` or `on` (any case).
    pub fn from_env() -> Self {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// [`HubOptions::from_env`] with variables read through `var` (tests need no real env).
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Self {
        let path = |k: &str| var(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        let cache_dir = path("HF_HUB_CACHE")
            .or_else(|| path("HF_HOME").map(|h| h.join("hub")))
            .or_else(|| path("XDG_CACHE_HOME").map(|x| x.join("huggingface").join("hub")))
            .or_else(|| path("HOME").map(|h| h.join(".cache").join("huggingface").join("hub")))
            // No home at all: a relative path still works and is visible in errors.
            .unwrap_or_else(|| PathBuf::from(".cache/huggingface/hub"));
        let offline = var("HF_HUB_OFFLINE").is_some_and(|v| env_true(&v));
        Self { cache_dir, offline }
    }
}

fn env_true(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

/// [`resolve_with`] using [`HubOptions::from_env`].
pub fn resolve(model: &str, revision: Option<&str>) -> Result<ModelFiles> {
    resolve_with(model, revision, &HubOptions::from_env())
}

const INDEX: &str = "model.safetensors.index.json";
const SINGLE: &str = "model.safetensors";
const OPTIONAL: [&str; 6] = [
    "tokenizer_config.json",
    "preprocessor_config.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "video_preprocessor_config.json",
];

/// Resolves `model`: an existing local directory is used as is; anything else is taken as a
/// hub repo id (`org/name`), looked up in `opts.cache_dir` (offline, or built without the
/// `hub` feature) or fetched (online).
pub fn resolve_with(model: &str, revision: Option<&str>, opts: &HubOptions) -> Result<ModelFiles> {
    if model.trim().is_empty() {
        bail!("the model name is empty: give a checkpoint directory or a Hugging Face repo id");
    }
    let path = Path::new(model);
    if path.is_dir() {
        return resolve_dir(model, path);
    }
    if path.exists() {
        bail!("model {model} is a file; expected a checkpoint directory or a repo id");
    }
    // Something that looks like a path but is missing is a typo, not a repo id.
    let looks_like_path = model.starts_with('.')
        || model.starts_with('/')
        || model.starts_with('~')
        || model.contains('\\')
        || model.matches('/').count() > 1;
    if looks_like_path {
        bail!("model directory {model} does not exist");
    }
    let revision = revision.unwrap_or("main");
    #[cfg(feature = "hub")]
    if !opts.offline {
        return resolve_online(model, revision, opts);
    }
    resolve_cached(model, revision, opts)
}

/// The hub cache's folder of a model repo, `models--org--name` (huggingface_hub's layout, the
/// name hf-hub's `Repo::folder_name` gives).
pub fn repo_folder_name(repo: &str) -> String {
    format!("models--{}", repo.replace('/', "--"))
}

/// How to provide `repo` when it is not (fully) in the hub cache and will not be downloaded:
/// offline, or built without the `hub` feature.
pub(crate) fn not_cached_help(repo: &str, revision: &str, opts: &HubOptions) -> String {
    let cache = opts.cache_dir.display();
    if opts.offline {
        return format!(
            "To provide it: on a connected machine run \
             `huggingface-cli download {repo} --local-dir DIR`, copy DIR here and load it as a local directory; \
             or copy that machine's hub cache into {cache} (HF_HOME/hub or HF_HUB_CACHE)"
        );
    }
    let rev = if revision == "main" { String::new() } else { format!(" --revision {revision}") };
    format!(
        "This merg was built without the `hub` feature, so it reads repos from the hub cache only \
         and cannot download {repo}. To provide it: download it into the hub cache \
         (`huggingface-cli download {repo}{rev}` with HF_HUB_CACHE={cache}), or into a directory \
         (`huggingface-cli download {repo}{rev} --local-dir DIR`) and load that directory; \
         or build merg with the `hub` feature (`cargo build --features hub`; it is on by default)"
    )
}

/// A plain directory with the files side by side.
fn resolve_dir(source: &str, dir: &Path) -> Result<ModelFiles> {
    let missing: Vec<&str> = ["config.json", "tokenizer.json"]
        .into_iter()
        .filter(|f| !dir.join(f).is_file())
        .collect();
    let has_weights = dir.join(INDEX).is_file() || dir.join(SINGLE).is_file();
    let mut missing: Vec<String> = missing.into_iter().map(String::from).collect();
    if !has_weights {
        missing.push(format!("{SINGLE} (or {INDEX})"));
    }
    if !missing.is_empty() {
        bail!(
            "model directory {} is missing {}",
            dir.display(),
            missing.join(", ")
        );
    }
    let weights = if dir.join(INDEX).is_file() {
        let index = dir.join(INDEX);
        shard_names(&index)?
            .into_iter()
            .map(|s| {
                let p = dir.join(&s);
                if p.is_file() {
                    Ok(p)
                } else {
                    Err(anyhow!(
                        "{} lists shard {s}, which is missing from {}",
                        index.display(),
                        dir.display()
                    ))
                }
            })
            .collect::<Result<Vec<_>>>()?
    } else {
        vec![dir.join(SINGLE)]
    };
    let opt = |f: &str| Some(dir.join(f)).filter(|p| p.is_file());
    Ok(ModelFiles {
        source: source.to_string(),
        revision: None,
        dir: dir.to_path_buf(),
        config: dir.join("config.json"),
        weights,
        tokenizer: dir.join("tokenizer.json"),
        tokenizer_config: opt("tokenizer_config.json"),
        preprocessor_config: opt("preprocessor_config.json"),
        video_preprocessor_config: opt("video_preprocessor_config.json"),
        generation_config: opt("generation_config.json"),
        chat_template: opt("chat_template.jinja").or_else(|| opt("chat_template.json")),
    })
}

/// The unique shard file names of a safetensors index's `weight_map`, sorted.
pub fn shard_names(index: &Path) -> Result<Vec<String>> {
    let text = crate::input::read_string(index, &crate::input::CONFIG)?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("{} is not valid JSON", index.display()))?;
    let map = v
        .get("weight_map")
        .and_then(|m| m.as_object())
        .with_context(|| format!("{} has no weight_map object", index.display()))?;
    let mut names = BTreeSet::new();
    for (tensor, file) in map {
        let file = file.as_str().with_context(|| {
            format!(
                "{}: weight_map[{tensor}] is not a file name",
                index.display()
            )
        })?;
        // A shard name is a file in the same directory; refuse anything that walks out of it.
        if file.is_empty() || file.contains("..") || Path::new(file).is_absolute() {
            bail!(
                "{}: weight_map[{tensor}] names an unsafe path {file:?}",
                index.display()
            );
        }
        names.insert(file.to_string());
    }
    if names.is_empty() {
        bail!("{} has an empty weight_map", index.display());
    }
    Ok(names.into_iter().collect())
}

/// From the cache only (offline, or no `hub` feature): `cache/models--org--name/refs/<revision>`
/// names a snapshot (or `revision` is a commit hash with a snapshot of its own); every file
/// must be in that snapshot.
fn resolve_cached(repo: &str, revision: &str, opts: &HubOptions) -> Result<ModelFiles> {
    let cache_dir = &opts.cache_dir;
    let repo_dir = cache_dir.join(repo_folder_name(repo));
    let snapshot = snapshot_dir(&repo_dir, revision);
    let lookup = |f: &str| snapshot.as_ref().map(|s| s.join(f)).filter(|p| p.is_file());

    let mut missing = Vec::new();
    let config = lookup("config.json");
    let tokenizer = lookup("tokenizer.json");
    if config.is_none() {
        missing.push("config.json".to_string());
    }
    if tokenizer.is_none() {
        missing.push("tokenizer.json".to_string());
    }
    let mut weights = Vec::new();
    if let Some(index) = lookup(INDEX) {
        for s in shard_names(&index)? {
            match lookup(&s) {
                Some(p) => weights.push(p),
                None => missing.push(format!("{s} (listed in {INDEX})")),
            }
        }
    } else if let Some(p) = lookup(SINGLE) {
        weights.push(p);
    } else {
        missing.push(format!("{SINGLE} (or {INDEX} and its shards)"));
    }
    if !missing.is_empty() {
        let where_ = match &snapshot {
            Some(s) => format!("snapshot {}", s.display()),
            None => format!(
                "{} (no snapshot for revision {revision}; nor is there a local directory named {repo})",
                repo_dir.display()
            ),
        };
        let why = if opts.offline { "offline (HF_HUB_OFFLINE) and " } else { "" };
        bail!(
            "{why}model {repo}@{revision} is not fully cached in {where_}; missing: {}.\n{}",
            missing.join(", "),
            not_cached_help(repo, revision, opts)
        );
    }
    let [tokenizer_config, preprocessor_config, generation_config, jinja, json, video_preprocessor_config] =
        OPTIONAL.map(lookup);
    let dir = snapshot.context("snapshot vanished")?;
    Ok(ModelFiles {
        source: repo.to_string(),
        revision: Some(revision.to_string()),
        dir,
        config: config.context("config.json vanished")?,
        weights,
        tokenizer: tokenizer.context("tokenizer.json vanished")?,
        tokenizer_config,
        preprocessor_config,
        video_preprocessor_config,
        generation_config,
        chat_template: jinja.or(json),
    })
}

pub(crate) fn snapshot_dir(repo_dir: &Path, revision: &str) -> Option<PathBuf> {
    // hf_hub::Cache does the refs lookup but does not trim the ref file nor accept commit
    // hashes; the layout is simple enough to read directly.
    let from_ref = crate::input::read_string(&repo_dir.join("refs").join(revision), &crate::input::TEXT)
        .ok()
        .map(|h| repo_dir.join("snapshots").join(h.trim()));
    from_ref
        .or_else(|| Some(repo_dir.join("snapshots").join(revision)))
        .filter(|d| !revision.contains("..") && d.is_dir())
}

/// The hub client: the cache in `opts`, `HF_TOKEN` when set.
#[cfg(feature = "hub")]
pub(crate) fn api(opts: &HubOptions) -> Result<hf_hub::api::sync::Api> {
    let mut builder = hf_hub::api::sync::ApiBuilder::from_env()
        .with_cache_dir(opts.cache_dir.clone())
        // hf-hub draws its own download bars (indicatif) when a front end shows progress.
        .with_progress(crate::progress::reporting());
    if let Some(tok) = std::env::var("HF_TOKEN").ok().filter(|t| !t.is_empty()) {
        builder = builder.with_token(Some(tok));
    }
    builder.build().context("creating the Hugging Face hub client")
}

/// Online: hf-hub's sync API; files already in the cache are not downloaded again.
#[cfg(feature = "hub")]
fn resolve_online(repo: &str, revision: &str, opts: &HubOptions) -> Result<ModelFiles> {
    let api = api(opts)?;
    let r = api.repo(hf_hub::Repo::with_revision(
        repo.to_string(),
        hf_hub::RepoType::Model,
        revision.to_string(),
    ));
    let need = |f: &str| {
        r.get(f).with_context(|| {
            format!(
                "downloading {f} of {repo}@{revision} failed (no network? set HF_HUB_OFFLINE=1 to use \
                 only the cache, or give a local directory holding a copy)"
            )
        })
    };
    let config = need("config.json")?;
    let tokenizer = need("tokenizer.json")?;
    // Optional files: absence on the hub is normal, so a failure just means "not there".
    let maybe = |f: &str| match r.get(f) {
        Ok(p) => Some(p),
        Err(e) => {
            tracing::debug!("{repo}@{revision}: no {f} ({e})");
            None
        }
    };
    let weights = match maybe(INDEX) {
        Some(index) => shard_names(&index)?
            .into_iter()
            .map(|s| need(&s).with_context(|| format!("shard {s} listed in {}", index.display())))
            .collect::<Result<Vec<_>>>()?,
        None => {
            vec![need(SINGLE).with_context(|| format!("{repo} has neither {INDEX} nor {SINGLE}"))?]
        }
    };
    let dir = config
        .parent()
        .map(Path::to_path_buf)
        .context("config.json has no parent directory")?;
    let [tokenizer_config, preprocessor_config, generation_config, jinja, json, video_preprocessor_config] =
        OPTIONAL.map(maybe);
    Ok(ModelFiles {
        source: repo.to_string(),
        revision: Some(revision.to_string()),
        dir,
        config,
        weights,
        tokenizer,
        tokenizer_config,
        preprocessor_config,
        video_preprocessor_config,
        generation_config,
        chat_template: jinja.or(json),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `cache/models--org--name/{refs/main, snapshots/<sha>/files}` as huggingface_hub writes it.
    fn fake_repo(cache: &Path, repo: &str, files: &[&str]) -> PathBuf {
        let root = cache.join(repo_folder_name(repo));
        std::fs::create_dir_all(root.join("refs")).unwrap();
        std::fs::write(root.join("refs/main"), "abc123").unwrap();
        let snap = root.join("snapshots/abc123");
        std::fs::create_dir_all(&snap).unwrap();
        for f in files {
            std::fs::write(snap.join(f), "{}").unwrap();
        }
        snap
    }

    fn opts(cache: &Path, offline: bool) -> HubOptions {
        HubOptions { cache_dir: cache.to_path_buf(), offline }
    }

    #[test]
    fn repo_folder_names_follow_the_hub_cache_layout() {
        assert_eq!(repo_folder_name("Qwen/Qwen2-VL-2B-Instruct"), "models--Qwen--Qwen2-VL-2B-Instruct");
        #[cfg(feature = "hub")]
        for repo in ["Qwen/Qwen2-VL-2B-Instruct", "org/a.b-c_d", "name-only"] {
            assert_eq!(repo_folder_name(repo), hf_hub::Repo::model(repo.to_string()).folder_name());
        }
    }

    /// The cache is read by the same code in every build; offline it never downloads.
    #[test]
    fn a_cached_repo_resolves_offline() {
        let cache = tempfile::tempdir().unwrap();
        let snap = fake_repo(cache.path(), "org/cached", &["config.json", "tokenizer.json", "model.safetensors"]);
        let m = resolve_with("org/cached", None, &opts(cache.path(), true)).unwrap();
        assert_eq!((m.dir, m.weights), (snap.clone(), vec![snap.join("model.safetensors")]));
    }

    /// Without `hub`, a repo in the cache resolves as it does offline, and one that is not
    /// cached (or only in part) names the repo, says why it cannot be downloaded and how to
    /// provide it.
    #[cfg(not(feature = "hub"))]
    #[test]
    fn without_the_hub_feature_repos_come_from_the_cache() {
        let cache = tempfile::tempdir().unwrap();
        let snap = fake_repo(cache.path(), "org/cached", &["config.json", "tokenizer.json", "model.safetensors"]);
        let m = resolve_with("org/cached", None, &opts(cache.path(), false)).unwrap();
        assert_eq!(m, resolve_with("org/cached", None, &opts(cache.path(), true)).unwrap());
        assert_eq!(m.config, snap.join("config.json"));

        let cache_s = cache.path().display().to_string();
        let e = format!("{:#}", resolve_with("org/not-cached", None, &opts(cache.path(), false)).unwrap_err());
        for needle in [
            "org/not-cached@main",
            "built without the `hub` feature",
            "cannot download org/not-cached",
            "`huggingface-cli download org/not-cached` with HF_HUB_CACHE=",
            &cache_s,
            "--local-dir DIR`) and load that directory",
            "`cargo build --features hub`",
        ] {
            assert!(e.contains(needle), "{needle:?} not in: {e}");
        }
        assert!(!e.contains("HF_HUB_OFFLINE") && !e.contains("--model"), "{e}");

        fake_repo(cache.path(), "org/partial", &["config.json"]);
        let e = format!("{:#}", resolve_with("org/partial", Some("main"), &opts(cache.path(), false)).unwrap_err());
        assert!(e.contains("missing: tokenizer.json, model.safetensors") && e.contains("`hub` feature"), "{e}");
        let e = format!("{:#}", resolve_with("org/cached", Some("v2"), &opts(cache.path(), false)).unwrap_err());
        assert!(e.contains("org/cached@v2") && e.contains("download org/cached --revision v2"), "{e}");
    }
}
