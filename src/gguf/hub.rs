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

/// Resolves a GGUF hub repo to local files (downloading what the cache lacks, unless offline
/// or built without the `hub` feature: then from the files in the cache only). `None`: `model`
/// is not such a repo. `mmproj` names a local projector file, or a projector of the repo by
/// name.
pub fn resolve(model: &str, revision: Option<&str>, mmproj: Option<&Path>, opts: &HubOptions) -> Result<Option<GgufPaths>> {
    let Some((repo, quant)) = parse(model) else { return Ok(None) };
    let revision = revision.unwrap_or("main");
    let local_mmproj = mmproj.filter(|p| p.is_file()).map(Path::to_path_buf);
    let named_mmproj = match (&local_mmproj, mmproj) {
        (None, Some(p)) => Some(p.to_string_lossy().into_owned()),
        _ => None,
    };
    #[cfg(feature = "hub")]
    if !opts.offline {
        let (text, mm) = download(repo, quant, revision, named_mmproj.as_deref(), opts)?;
        return Ok(Some(GgufPaths::new(text, local_mmproj.or(mm))));
    }
    let snapshot = crate::hub::snapshot_dir(&cache_folder(&opts.cache_dir, repo), revision).with_context(|| {
        let why = if opts.offline { "offline (HF_HUB_OFFLINE) and " } else { "" };
        format!("{why}{repo}@{revision} is not in the hub cache {}.\n{}", opts.cache_dir.display(), crate::hub::not_cached_help(repo, revision, opts))
    })?;
    // Without `hub`, the files in the cache are all there is: a failed choice says so.
    let note = |e: anyhow::Error| match opts.offline {
        true => e,
        false => e.context(format!(
            "choosing among the files of {repo} in the hub cache ({}) only: this merg was built without the `hub` feature",
            snapshot.display()
        )),
    };
    let files = list_dir(&snapshot);
    let text = pick_text(repo, &files, quant).map_err(note)?;
    let mm = pick_mmproj(repo, &files, named_mmproj.as_deref()).map_err(note)?;
    Ok(Some(GgufPaths::new(snapshot.join(text), local_mmproj.or(mm.map(|m| snapshot.join(m))))))
}

/// Online: the repo's file list from the hub, then the chosen files (from the cache when there).
#[cfg(feature = "hub")]
fn download(repo: &str, quant: Option<&str>, revision: &str, named_mmproj: Option<&str>, opts: &HubOptions) -> Result<(PathBuf, Option<PathBuf>)> {
    let api = crate::hub::api(opts)?;
    let r = api.repo(hf_hub::Repo::with_revision(repo.to_string(), hf_hub::RepoType::Model, revision.to_string()));
    let info = r.info().with_context(|| format!("listing the files of {repo}@{revision} (no network? set HF_HUB_OFFLINE=1 to use the cache)"))?;
    let files: Vec<String> = info.siblings.into_iter().map(|s| s.rfilename).collect();
    let text = pick_text(repo, &files, quant)?;
    let mm = pick_mmproj(repo, &files, named_mmproj)?;
    let get = |f: &str| r.get(f).with_context(|| format!("downloading {f} of {repo}@{revision}"));
    Ok((get(&text)?, mm.map(|m| get(&m)).transpose()?))
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
    cache_dir.join(crate::hub::repo_folder_name(repo))
}

#[cfg(all(test, not(feature = "hub")))]
mod tests {
    /// Without `hub`, a GGUF repo comes from the hub cache: one not there says how to provide
    /// it, and a quantization the cache lacks says that only the cached files were looked at.
    #[test]
    fn without_the_hub_feature_gguf_repos_come_from_the_cache() {
        let cache = tempfile::tempdir().unwrap();
        let opts = crate::hub::HubOptions { cache_dir: cache.path().to_path_buf(), offline: false };
        let e = format!("{:#}", super::resolve("org/Tiny-GGUF:Q4_K_M", None, None, &opts).unwrap_err());
        assert!(e.contains("org/Tiny-GGUF@main is not in the hub cache") && e.contains("`hub` feature") && e.contains("--features hub"), "{e}");
        let folder = super::cache_folder(cache.path(), "org/Tiny-GGUF");
        std::fs::create_dir_all(folder.join("snapshots/abc")).unwrap();
        std::fs::create_dir_all(folder.join("refs")).unwrap();
        std::fs::write(folder.join("refs/main"), "abc\n").unwrap();
        std::fs::write(folder.join("snapshots/abc/tiny-Q8_0.gguf"), "").unwrap();
        let p = super::resolve("org/Tiny-GGUF:Q8_0", None, None, &opts).unwrap().unwrap();
        assert_eq!(p.text, folder.join("snapshots/abc/tiny-Q8_0.gguf"));
        let e = format!("{:#}", super::resolve("org/Tiny-GGUF:Q4_K_M", None, None, &opts).unwrap_err());
        assert!(e.contains("in the hub cache") && e.contains("`hub` feature") && e.contains("no GGUF file for \"Q4_K_M\""), "{e}");
    }
}
