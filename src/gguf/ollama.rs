//! Models pulled with Ollama (`ollama:NAME[:TAG]`), read from Ollama's own store: the
//! manifest under `manifests/<registry>/<namespace>/<name>/<tag>` names its layers by digest,
//! and each layer is the blob `blobs/sha256-<hex>`. The model layer is a GGUF text model and
//! the projector layer (when there is one) its mmproj, so they load as any GGUF pair; the
//! template and parameters layers are shown, not used (merg keeps the GGUF's own template).
//!
//! The store is `$OLLAMA_MODELS`, else `~/.ollama/models`. Blobs are checked against their
//! manifest: the size every time, the SHA-256 once per blob (a marker under merg's cache
//! remembers a verified blob by its digest, size and modification time, so a 17 GB model is
//! hashed once, not at every start).

use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde::Deserialize;
use sha2::{Digest, Sha256};

/// What a `--model` string names when it starts with this.
pub const PREFIX: &str = "ollama:";

const MODEL: &str = "application/vnd.ollama.image.model";
const PROJECTOR: &str = "application/vnd.ollama.image.projector";
const TEMPLATE: &str = "application/vnd.ollama.image.template";
const PARAMS: &str = "application/vnd.ollama.image.params";
const SYSTEM: &str = "application/vnd.ollama.image.system";

/// A model in Ollama's store, its files checked.
#[derive(Clone, Debug)]
pub struct OllamaModel {
    /// `name:tag` as Ollama lists it (`qwen3.5:27b`, `user/model:latest`).
    pub name: String,
    /// The manifest file, and its SHA-256 (Ollama's digest of the model, in `/api/tags`).
    pub manifest: PathBuf,
    pub digest: String,
    /// The model layer's blob (a GGUF text model).
    pub text: PathBuf,
    /// The projector layer's blob, when the manifest has one.
    pub projector: Option<PathBuf>,
    /// The template, parameters and system layers' text, when present.
    pub template: Option<String>,
    pub params: Option<String>,
    pub system: Option<String>,
}

#[derive(Deserialize)]
struct Manifest {
    #[serde(default)]
    layers: Vec<Layer>,
}

#[derive(Deserialize)]
struct Layer {
    #[serde(rename = "mediaType")]
    media_type: String,
    digest: String,
    size: u64,
}

/// Ollama's store: `$OLLAMA_MODELS`, else `~/.ollama/models`.
pub fn store_dir() -> PathBuf {
    match std::env::var_os("OLLAMA_MODELS") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => home().join(".ollama/models"),
    }
}

fn home() -> PathBuf {
    std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/"))
}

/// `NAME[:TAG]` → (registry, namespace, name, tag), with Ollama's defaults
/// (`registry.ollama.ai`, `library`, `latest`).
pub fn parse_name(reference: &str) -> Result<[String; 4]> {
    let (path, tag) = match reference.rsplit_once(':') {
        Some((p, t)) if !t.contains('/') => (p, t),
        _ => (reference, "latest"),
    };
    let parts: Vec<&str> = path.split('/').collect();
    let [registry, namespace, name] = match parts.as_slice() {
        [n] => ["registry.ollama.ai", "library", *n],
        [ns, n] => ["registry.ollama.ai", *ns, *n],
        [r, ns, n] => [*r, *ns, *n],
        _ => bail!("{PREFIX}{reference} is not an Ollama model name (NAME[:TAG], NAMESPACE/NAME[:TAG] or REGISTRY/NAMESPACE/NAME[:TAG])"),
    };
    let ok = |s: &str| !s.is_empty() && s != "." && s != ".." && !s.contains(['\\', '\0']);
    if ![registry, namespace, name, tag].iter().all(|s| ok(s)) {
        bail!("{PREFIX}{reference} is not an Ollama model name (an empty or path-like part)");
    }
    Ok([registry, namespace, name, tag].map(String::from))
}

/// Opens `reference` (`NAME[:TAG]`, without the prefix) in the store `store`.
pub fn open(reference: &str, store: &Path) -> Result<OllamaModel> {
    let [registry, namespace, name, tag] = parse_name(reference)?;
    let dir = store.join("manifests").join(&registry).join(&namespace).join(&name);
    let manifest = dir.join(&tag);
    if !manifest.is_file() {
        let tags = list_tags(&dir);
        match tags.is_empty() {
            true => bail!("{PREFIX}{reference}: no model {name} in Ollama's store {} (pull it with `ollama pull {reference}`, or set OLLAMA_MODELS)", store.display()),
            false => bail!("{PREFIX}{reference}: {name} has no tag {tag:?} in Ollama's store {} (it has {})", store.display(), tags.join(", ")),
        }
    }
    let bytes = crate::input::read(&manifest, &crate::input::CONFIG).with_context(|| format!("{PREFIX}{reference}: reading its manifest"))?;
    let parsed: Manifest = serde_json::from_slice(&bytes).with_context(|| format!("{PREFIX}{reference}: manifest {} is not Ollama's manifest JSON", manifest.display()))?;
    let layer = |kind: &str| parsed.layers.iter().find(|l| l.media_type == kind);
    let Some(model) = layer(MODEL) else {
        bail!("{PREFIX}{reference}: manifest {} has no model layer ({MODEL})", manifest.display());
    };
    let blob = |l: &Layer| checked_blob(store, l, reference);
    let text_layer = |kind: &str| -> Result<Option<String>> {
        layer(kind).map(|l| Ok(String::from_utf8_lossy(&std::fs::read(blob(l)?)?).into_owned())).transpose()
    };
    let display_name = match (registry.as_str(), namespace.as_str()) {
        ("registry.ollama.ai", "library") => format!("{name}:{tag}"),
        ("registry.ollama.ai", ns) => format!("{ns}/{name}:{tag}"),
        (r, ns) => format!("{r}/{ns}/{name}:{tag}"),
    };
    Ok(OllamaModel {
        name: display_name,
        digest: hex(&Sha256::digest(&bytes)),
        manifest,
        text: blob(model)?,
        projector: layer(PROJECTOR).map(blob).transpose()?,
        template: text_layer(TEMPLATE)?,
        params: text_layer(PARAMS)?,
        system: text_layer(SYSTEM)?,
    })
}

fn list_tags(dir: &Path) -> Vec<String> {
    let mut tags: Vec<String> = std::fs::read_dir(dir)
        .map(|r| r.filter_map(|e| e.ok()).filter(|e| e.path().is_file()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    tags.sort();
    tags
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The blob a layer names, its size checked against the manifest and its SHA-256 against the
/// digest (once per blob: see the module's comment).
fn checked_blob(store: &Path, layer: &Layer, reference: &str) -> Result<PathBuf> {
    let Some(want) = layer.digest.strip_prefix("sha256:").filter(|h| h.len() == 64 && h.bytes().all(|b| b.is_ascii_hexdigit())) else {
        bail!("{PREFIX}{reference}: layer digest {:?} is not sha256:<64 hex digits>", layer.digest);
    };
    let path = store.join("blobs").join(format!("sha256-{want}"));
    let meta = std::fs::metadata(&path).with_context(|| format!("{PREFIX}{reference}: its {} blob {} is missing from the store", layer.media_type, path.display()))?;
    if meta.len() != layer.size {
        bail!("{PREFIX}{reference}: blob {} holds {} bytes, its manifest says {} (an interrupted pull? run `ollama pull {reference}` again)", path.display(), meta.len(), layer.size);
    }
    let marker = verified_dir().join(format!("sha256-{want}"));
    let stamp = format!("{} {:?}", meta.len(), meta.modified().ok());
    if std::fs::read_to_string(&marker).is_ok_and(|s| s == stamp) {
        return Ok(path);
    }
    let got = sha256_file(&path)?;
    if got != want.to_ascii_lowercase() {
        bail!("{PREFIX}{reference}: blob {} does not match its digest (sha256 {got}, the manifest says {want}); run `ollama pull {reference}` again", path.display());
    }
    // A marker that cannot be written only means hashing again next time.
    let _ = std::fs::create_dir_all(verified_dir()).and_then(|_| std::fs::write(&marker, stamp));
    Ok(path)
}

/// Where verified blobs are remembered: `$XDG_CACHE_HOME/merg/ollama-verified`, else
/// `~/.cache/merg/ollama-verified`.
fn verified_dir() -> PathBuf {
    let cache = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()).map(PathBuf::from).unwrap_or_else(|| home().join(".cache"));
    cache.join("merg/ollama-verified")
}

fn sha256_file(path: &Path) -> Result<String> {
    let mut f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    // A 17 GB blob hashes for a minute or more, once: worth a bar.
    let size = f.metadata().map(|m| m.len()).ok();
    let task = crate::progress::task(&format!("checking {} against its sha256 (once)", path.display()), size, "bytes");
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).with_context(|| format!("reading {}", path.display()))?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
        task.advance(n as u64);
    }
    Ok(hex(&h.finalize()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_take_ollamas_defaults() {
        let n = |s: &str| parse_name(s).unwrap().join("/");
        assert_eq!(n("qwen3.5:27b"), "registry.ollama.ai/library/qwen3.5/27b");
        assert_eq!(n("llava"), "registry.ollama.ai/library/llava/latest");
        assert_eq!(n("user/m:q4"), "registry.ollama.ai/user/m/q4");
        assert_eq!(n("host:5000/ns/m"), "host:5000/ns/m/latest");
        for bad in ["a/b/c/d", "../x", "x:", ":y", "a//b"] {
            assert!(parse_name(bad).is_err(), "{bad}");
        }
    }
}
