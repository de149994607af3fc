//! GGUF files in a Hugging Face hub repo (`org/Model-GGUF`, or `org/repo:Q4_K_M` to pick a
//! quantization, as llama.cpp's `-hf` takes it). Such repos hold several text files (one per
//! quantization) and one or more projectors, so the choice is made by name: the `:QUANT`
//! suffix for the text file, `--mmproj NAME` when several projectors are there.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use super::{is_mmproj, GgufPaths};
use crate::hub::HubOptions;

/// Whether `model` asks for a GGUF hub repo: `org/name:QUANT`, or a repo named `…GGUF`.
fn parse(model: &str) -> Option<(&str, Option<&str>)> {
    let (repo, quant) = match model.split_once(':') {
        Some((r, q)) => (r, Some(q)),
        None => (model, None),
    };
    let ok = repo.matches('/').count() == 1 && !repo.starts_with(['.', '/', '~']) && !Path::new(model).exists();
    (ok && (quant.is_some() || repo.to_ascii_lowercase().ends_with("gguf"))).then_some((repo, quant))
}

/// The text file: the only one, or the one whose name holds `quant`.
fn pick_text(repo: &str, files: &[String], quant: Option<&str>) -> Result<String> {
    let texts: Vec<&String> = files.iter().filter(|f| f.ends_with(".gguf") && !is_mmproj(Path::new(f))).collect();
    let chosen: Vec<&&String> = match quant {
        Some(q) => texts.iter().filter(|f| f.to_ascii_lowercase().contains(&q.to_ascii_lowercase())).collect(),
        None => texts.iter().collect(),
    };
    match (chosen.len(), quant) {
        (1, _) => Ok(chosen[0].to_string()),
        (0, _) if texts.is_empty() => bail!("hub repo {repo} holds no GGUF text model"),
        (0, Some(q)) => bail!("hub repo {repo} has no GGUF file for {q:?}; it holds {}", list(&texts)),
        (_, Some(q)) => bail!("{q:?} matches several GGUF files of {repo}: {}; name one exactly ({repo}:NAME)", list(&chosen.iter().map(|s| **s).collect::<Vec<_>>())),
        (_, None) => bail!("hub repo {repo} holds several GGUF text models ({}); pick one as {repo}:QUANT, e.g. {repo}:Q4_K_M", list(&texts)),
    }
}

fn pick_mmproj(repo: &str, files: &[String], named: Option<&str>) -> Result<Option<String>> {
    let all: Vec<&String> = files.iter().filter(|f| f.ends_with(".gguf") && is_mmproj(Path::new(f))).collect();
    match named {
        Some(n) => all.iter().find(|f| f.as_str() == n || f.ends_with(&format!("/{n}"))).map(|f| Some(f.to_string())).with_context(|| format!("hub repo {repo} has no projector {n}; it holds {}", list(&all))),
        None if all.len() <= 1 => Ok(all.first().map(|f| f.to_string())),
        None => bail!("hub repo {repo} holds several vision projectors ({}); name one as the projector", list(&all)),
    }
}

fn list(v: &[&String]) -> String {
    v.iter().map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
}

/// Resolves a GGUF hub repo to local files (downloading what the cache lacks, unless
/// offline). `None`: `model` is not such a repo. `mmproj` names a local projector file, or a
/// projector of the repo by name.
pub fn resolve(model: &str, revision: Option<&str>, mmproj: Option<&Path>, opts: &HubOptions) -> Result<Option<GgufPaths>> {
    let Some((repo, quant)) = parse(model) else { return Ok(None) };
    let revision = revision.unwrap_or("main");
    let local_mmproj = mmproj.filter(|p| p.is_file()).map(Path::to_path_buf);
    let named_mmproj = match (&local_mmproj, mmproj) {
        (None, Some(p)) => Some(p.to_string_lossy().into_owned()),
        _ => None,
    };
    let (text, mm) = if opts.offline {
        let repo_dir = opts.cache_dir.join(hf_hub::Repo::model(repo.to_string()).folder_name());
        let snapshot = crate::hub::snapshot_dir(&repo_dir, revision).with_context(|| {
            format!("offline (HF_HUB_OFFLINE) and {repo}@{revision} is not in the hub cache {}", opts.cache_dir.display())
        })?;
        let files = list_dir(&snapshot);
        let text = pick_text(repo, &files, quant)?;
        let mm = pick_mmproj(repo, &files, named_mmproj.as_deref())?;
        (snapshot.join(text), mm.map(|m| snapshot.join(m)))
    } else {
        let api = crate::hub::api(opts)?;
        let r = api.repo(hf_hub::Repo::with_revision(repo.to_string(), hf_hub::RepoType::Model, revision.to_string()));
        let info = r.info().with_context(|| format!("listing the files of {repo}@{revision} (no network? set HF_HUB_OFFLINE=1 to use the cache)"))?;
        let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
        let text = pick_text(repo, &files, quant)?;
        let mm = pick_mmproj(repo, &files, named_mmproj.as_deref())?;
        let get = |f: &str| r.get(f).with_context(|| format!("downloading {f} of {repo}@{revision}"));
        (get(&text)?, mm.map(|m| get(&m)).transpose()?)
    };
    Ok(Some(GgufPaths { text, mmproj: local_mmproj.or(mm) }))
}

fn list_dir(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .map(|r| r.filter_map(|e| e.ok()).map(|e| e.file_name().to_string_lossy().into_owned()).collect())
        .unwrap_or_default();
    v.sort();
    v
}

/// Where a GGUF repo's files would be cached (for tests that build a cache by hand).
pub fn cache_folder(cache_dir: &Path, repo: &str) -> PathBuf {
    cache_dir.join(hf_hub::Repo::model(repo.to_string()).folder_name())
}
