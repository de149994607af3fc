//! Checkpoints in llama.cpp's GGUF files: a text model (`qwen2vl`, `qwen3vl`, `qwen3vlmoe`,
//! `qwen35`, `gemma3`, and `llama` as LLaVA-NeXT's decoder) plus its vision projector
//! (`mmproj-*.gguf`; Qwen2.5-Omni's `qwen2.5o` projector holds its audio tower too). The config comes from their metadata,
//! the tokenizer and chat template from the metadata unless the HF tokenizer.json sits beside
//! them, and the weights through `GgufWeights`, which keeps block-quantized linear weights in
//! their blocks. See `names` for the tensor mapping.

pub mod config;
pub mod config_gemma_llava;
pub mod config_omni;
pub mod file;
pub mod format;
pub mod hub;
pub mod names;
pub mod ollama;
pub mod source;
pub mod tokenizer;
mod tokenizer_spm;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use serde_json::Value;

pub use file::{GgufFile, Header};
pub use format::Format;
pub use source::GgufWeights;

/// The files of a GGUF checkpoint.
#[derive(Clone, Debug)]
pub struct GgufPaths {
    pub text: PathBuf,
    pub mmproj: Option<PathBuf>,
    /// The model in Ollama's store these files are the blobs of (`ollama:NAME`): its name,
    /// digest and other layers, read once with the files.
    pub ollama: Option<Box<ollama::OllamaModel>>,
}

impl GgufPaths {
    /// Files named directly (not through Ollama's store).
    pub fn new(text: PathBuf, mmproj: Option<PathBuf>) -> Self {
        GgufPaths { text, mmproj, ollama: None }
    }
}

fn is_gguf(p: &Path) -> bool {
    p.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

pub(crate) fn is_mmproj(p: &Path) -> bool {
    p.file_name().is_some_and(|n| n.to_string_lossy().to_ascii_lowercase().starts_with("mmproj"))
}

fn names(v: &[PathBuf]) -> String {
    crate::weights::file_names(v)
}

/// Whether `model` names a GGUF checkpoint — a `.gguf` file, a directory with GGUF files and
/// no config.json, or a hub repo of them (`org/Model-GGUF`, `org/repo:Q4_K_M`; see `hub`) —
/// and its files; `mmproj` overrides the projector found beside it.
pub fn resolve(model: &str, revision: Option<&str>, mmproj: Option<&Path>) -> Result<Option<GgufPaths>> {
    if let Some(reference) = model.strip_prefix(ollama::PREFIX) {
        return resolve_ollama(ollama::open(reference, &ollama::store_dir())?, mmproj).map(Some);
    }
    if let Some(p) = resolve_local(model, mmproj)? {
        return Ok(Some(p));
    }
    hub::resolve(model, revision, mmproj, &crate::hub::HubOptions::from_env())
}

/// An Ollama model's blobs as a GGUF pair; `mmproj` overrides its projector layer. A model
/// without a projector layer whose text blob holds vision tensors (Ollama's own layout for
/// its newer vision models) is refused by name: merg reads llama.cpp's layout.
pub fn resolve_ollama(m: ollama::OllamaModel, mmproj: Option<&Path>) -> Result<GgufPaths> {
    if let Some(p) = mmproj {
        crate::input::regular_file(p, &crate::input::WEIGHTS)?;
    }
    let projector = mmproj.map(Path::to_path_buf).or_else(|| m.projector.clone());
    if projector.is_none() {
        let text = GgufFile::open(&m.text)?;
        let vision = text.header.tensors.keys().filter(|n| n.starts_with("v.") || n.starts_with("mm.")).count();
        if vision > 0 {
            bail!(
                "{}{}: Ollama keeps this model's vision tower inside its text blob ({vision} v.*/mm.* tensors, architecture {:?}), a layout merg does not read; merg reads llama.cpp's: a text GGUF and its mmproj projector (name one to use with this model)",
                ollama::PREFIX,
                m.name,
                text.architecture()?
            );
        }
        bail!("{}{}: its manifest has no projector layer, so it is a text-only model; merg needs a vision projector (mmproj) for it: name one", ollama::PREFIX, m.name);
    }
    Ok(GgufPaths { text: m.text.clone(), mmproj: projector, ollama: Some(Box::new(m)) })
}

/// The directory a file's path names: `.` for a bare file name (whose `parent()` is empty,
/// so a projector beside `--model wide.gguf` in the current directory went unfound).
fn dir_of(path: &Path) -> &Path {
    path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."))
}

/// `resolve` for local files only.
pub fn resolve_local(model: &str, mmproj: Option<&Path>) -> Result<Option<GgufPaths>> {
    let path = Path::new(model);
    let (text, dir) = if path.is_file() && is_gguf(path) {
        if is_mmproj(path) {
            bail!("{model} is a vision projector (mmproj) file; give the text model's .gguf as the model and this file as the projector");
        }
        (path.to_path_buf(), dir_of(path).to_path_buf())
    } else if path.is_dir() && !path.join("config.json").is_file() {
        let mut ggufs: Vec<PathBuf> = std::fs::read_dir(path)
            .with_context(|| format!("cannot list {model}"))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.is_file() && is_gguf(p))
            .collect();
        ggufs.sort();
        let texts: Vec<PathBuf> = ggufs.iter().filter(|p| !is_mmproj(p)).cloned().collect();
        match texts.len() {
            0 if ggufs.is_empty() => return Ok(None),
            0 => bail!("{model} holds only vision projector files ({}), no text model .gguf", names(&ggufs)),
            1 => (texts[0].clone(), path.to_path_buf()),
            _ => bail!("{model} holds several GGUF text models ({}): give the file to use as the model", names(&texts)),
        }
    } else {
        return Ok(None);
    };
    let mmproj = match mmproj {
        Some(p) => {
            crate::input::regular_file(p, &crate::input::WEIGHTS)?;
            Some(p.to_path_buf())
        }
        None => {
            let mut found: Vec<PathBuf> = std::fs::read_dir(&dir)
                .map(|r| r.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_file() && is_gguf(p) && is_mmproj(p)).collect())
                .unwrap_or_default();
            found.sort();
            match found.len() {
                0 => None,
                1 => found.pop(),
                _ => return Err(SeveralProjectors { dir: dir.clone(), found }.into()),
            }
        }
    };
    Ok(Some(GgufPaths::new(text, mmproj)))
}

/// A text model's directory holds more than one `mmproj-*.gguf` and none was named.
#[derive(Debug)]
pub struct SeveralProjectors {
    pub dir: PathBuf,
    pub found: Vec<PathBuf>,
}

impl std::fmt::Display for SeveralProjectors {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} holds several vision projectors ({}): name the one to use", self.dir.display(), names(&self.found))
    }
}

impl std::error::Error for SeveralProjectors {}

/// In-situ quantization was asked of a GGUF model already stored in a block format.
#[derive(Debug)]
pub struct AlreadyQuantized {
    pub file: PathBuf,
    /// The file's format as llama.cpp names it (`q8_0`, `q4_k_m`).
    pub format: String,
}

impl std::fmt::Display for AlreadyQuantized {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} is already quantized ({}): in-situ quantization applies to float weights only", self.file.display(), self.format)
    }
}

impl std::error::Error for AlreadyQuantized {}

/// What `open` reads: the model's config, its weights and its tokenizer.
pub struct Opened {
    pub config: Value,
    pub weights: GgufWeights,
    /// tokenizer.json text: the file beside the GGUF when present, else rebuilt from metadata.
    pub tokenizer_json: String,
    /// Where the tokenizer came from, for messages.
    pub tokenizer_origin: String,
    pub chat_template: Option<String>,
    /// Image preprocessing: `preprocessor_config.json` beside the files, else the family's
    /// defaults with the projector's recorded mean, std and pixel limits.
    pub preprocessor: Preprocessing,
    /// Whether any tensor is stored in a block-quantized format.
    pub quantized: bool,
    /// The text model's format (`q4_k_m`, `bf16`, …) and its tensors by type.
    pub format: Format,
}

/// How images are prepared for a GGUF checkpoint.
pub struct Preprocessing {
    pub file: Option<PathBuf>,
    pub video_file: Option<PathBuf>,
    pub mean: Option<[f32; 3]>,
    pub std: Option<[f32; 3]>,
    pub min_pixels: Option<usize>,
    pub max_pixels: Option<usize>,
}

impl Preprocessing {
    fn read(dir: &Path, mm: &GgufFile) -> Result<Self> {
        let triple = |key: &str| -> Result<Option<[f32; 3]>> {
            match mm.meta(key) {
                None => Ok(None),
                Some(candle_core::quantized::gguf_file::Value::Array(v)) if v.len() == 3 => {
                    let f = |i: usize| v[i].to_f32().map_err(|_| anyhow::anyhow!("{}: {key} is not three numbers", mm.name()));
                    Ok(Some([f(0)?, f(1)?, f(2)?]))
                }
                Some(_) => bail!("{}: {key} is not three numbers", mm.name()),
            }
        };
        let pixels = |key: &str| mm.meta(key).and_then(|v| v.to_u32().ok()).map(|n| n as usize);
        let beside = |name: &str| Some(dir.join(name)).filter(|p| p.is_file());
        Ok(Preprocessing {
            file: beside("preprocessor_config.json"),
            video_file: beside("video_preprocessor_config.json"),
            mean: triple("clip.vision.image_mean")?,
            std: triple("clip.vision.image_std")?,
            min_pixels: pixels("clip.vision.image_min_pixels"),
            max_pixels: pixels("clip.vision.image_max_pixels"),
        })
    }

    /// The preprocessor config for a model of `spec`.
    pub fn config(&self, spec: &crate::models::ModelSpec) -> Result<crate::vision::PreprocessorConfig> {
        let mut c = match &self.file {
            Some(p) => crate::vision::PreprocessorConfig::from_file(p)?,
            None => {
                let mut c = spec.default_preprocessor();
                c.image_mean = self.mean.unwrap_or(c.image_mean);
                c.image_std = self.std.unwrap_or(c.image_std);
                c.min_pixels = self.min_pixels.unwrap_or(c.min_pixels);
                c.max_pixels = self.max_pixels.unwrap_or(c.max_pixels);
                c
            }
        };
        if let Some(p) = &self.video_file {
            c.read_video_budget(p)?;
        }
        Ok(c)
    }
}

impl Opened {
    /// Refuses in-situ quantization of a file already stored in blocks (`AlreadyQuantized`).
    pub fn check_quant(&self, paths: &GgufPaths, quant: Option<crate::weights::Quant>) -> Result<()> {
        if self.quantized && quant.is_some() {
            return Err(AlreadyQuantized { file: paths.text.clone(), format: self.format.name.clone() }.into());
        }
        Ok(())
    }
}

/// Opens and checks a GGUF checkpoint.
pub fn open(paths: &GgufPaths) -> Result<Opened> {
    let mut text = GgufFile::open(&paths.text)?;
    let arch_name = text.architecture()?;
    let Some(arch) = names::Arch::parse(&arch_name) else {
        if arch_name == "clip" {
            bail!("{} is a vision projector (mmproj) file, not a text model", text.name());
        }
        bail!("{}: architecture {arch_name:?} is not one merg runs (it reads {})", text.name(), names::Arch::NAMES);
    };
    let Some(mm_path) = &paths.mmproj else {
        bail!(
            "{} holds only the language model; merg needs its vision projector too: put the matching mmproj-*.gguf beside it or name it",
            text.name()
        );
    };
    let mm = GgufFile::open(mm_path)?;
    if mm.architecture()? != "clip" {
        bail!("{} is a {} model, not a vision projector (mmproj) file", mm.name(), mm.architecture()?);
    }
    let dir = dir_of(&paths.text);
    let beside = dir.join("tokenizer.json");
    let (tokenizer_json, tokenizer_origin) = if beside.is_file() {
        (crate::input::read_string(&beside, &crate::input::TOKENIZER)?, beside.display().to_string())
    } else {
        (tokenizer::tokenizer_json(&text)?, format!("the tokenizer in {}", text.name()))
    };
    let chat_template = match crate::chat::find_chat_template(dir)? {
        Some(t) if beside.is_file() => Some(t),
        _ => tokenizer::chat_template(&text),
    };
    let config = match arch {
        names::Arch::Gemma3 | names::Arch::Llama => config_gemma_llava::config(&text, &mm, arch)?,
        _ if config_omni::is_omni(&mm) => config_omni::config(&text, &mm)?,
        _ => {
            let ids = config::TokenIds {
                image: tokenizer::token_id(&text, "<|image_pad|>")?,
                video: tokenizer::token_id(&text, "<|video_pad|>")?,
                vision_start: tokenizer::token_id(&text, "<|vision_start|>")?,
                vision_end: tokenizer::token_id(&text, "<|vision_end|>")?,
                eos: text.meta("tokenizer.ggml.eos_token_id").and_then(|v| v.to_u32().ok()),
            };
            config::config(&text, &mm, arch, &ids)?
        }
    };
    let heads = linear_heads(&config);
    let deepstack = config["vision_config"]["deepstack_visual_indexes"]
        .as_array()
        .map(|v| v.iter().filter_map(Value::as_u64).map(|x| x as usize).collect())
        .unwrap_or_default();
    let preprocessor = Preprocessing::read(dir, &mm)?;
    let quantized = [&text, &mm].iter().any(|f| f.header.tensors.values().any(|t| t.dtype.block_size() > 1));
    let format = Format::of(&text);
    // The vocabulary's arrays (tens of MB of small strings for 150k-250k tokens) have been
    // read into the tokenizer and the config; the weights source keeps the rest of the header.
    for key in ["tokens", "merges", "token_type", "scores"] {
        text.header.metadata.remove(&format!("tokenizer.ggml.{key}"));
    }
    let weights = GgufWeights::new(text, Some(mm), arch, heads, deepstack);
    Ok(Opened { config, weights, tokenizer_json, tokenizer_origin, chat_template, preprocessor, quantized, format })
}

fn linear_heads(config: &Value) -> names::Heads {
    let t = config.get("text_config").unwrap_or(config);
    let n = |k: &str| t.get(k).and_then(Value::as_u64).unwrap_or(0) as usize;
    let head_dim = match n("head_dim") {
        0 => n("hidden_size").checked_div(n("num_attention_heads")).unwrap_or(0),
        d => d,
    };
    names::Heads {
        key_heads: n("linear_num_key_heads"),
        value_heads: n("linear_num_value_heads"),
        key_dim: n("linear_key_head_dim"),
        value_dim: n("linear_value_head_dim"),
        head_dim,
    }
}

/// What loading opened GGUF files takes (`memory::LoadCost`), dense tensors in `dense_bytes`
/// per value, onto the CPU or (`gpu`) a GPU. Held: block tensors as stored, float ones in the
/// compute dtype, and an untied token embedding not at all (lookups read its rows in the file;
/// the pages they touch are clean page cache). A tied one is held once, as the head. In flight
/// on the host, one tensor at a time: a float tensor converted to another dtype takes its
/// stored copy and the converted one; anything else passes in 32 MiB bands from the mapping
/// to its packed home (a GPU upload maps the whole tensor); on the CPU the parts joined into
/// one q/k/v or gate/up weight are held twice while they are joined.
pub fn load_cost(text: &GgufFile, vision: Option<&GgufFile>, dense_bytes: f64, gpu: bool) -> crate::memory::LoadCost {
    let (mut held, mut in_flight) = ([0u64; 2], 0u64);
    for (i, f) in std::iter::once(text).chain(vision).enumerate() {
        let tied = f.info("output.weight").is_none();
        let mut joins: std::collections::HashMap<String, u64> = Default::default();
        for (name, t) in f.header.tensors.iter().filter(|(name, _)| !is_mtp(f, name) && !never_read(name)) {
            let elems: usize = t.dims.iter().product();
            let (stored, dense) = (t.len as u64, (elems as f64 * dense_bytes) as u64);
            let float = t.dtype.block_size() == 1;
            let converted = float && (t.len as f64 / elems as f64 - dense_bytes).abs() > 1e-9;
            let keeps = if float { dense } else { stored };
            let lookup_only = name == "token_embd.weight" && !tied;
            held[i] += if lookup_only { 0 } else { keeps };
            let pass = match (converted, gpu) {
                (true, _) => stored + dense,
                (false, true) => stored,
                (false, false) => stored.min(crate::cpu::pages::BAND_BYTES as u64),
            };
            in_flight = in_flight.max(pass);
            if let Some(group) = joined_group(name) {
                *joins.entry(group).or_default() += keeps;
            }
        }
        if !gpu {
            in_flight = in_flight.max(joins.values().copied().max().unwrap_or(0));
        }
    }
    let [text_bytes, vision_bytes] = held;
    let resident = if gpu { 0 } else { text_bytes + vision_bytes };
    crate::memory::LoadCost { text_bytes, vision_bytes, host_peak_bytes: resident + in_flight + crate::memory::RUNTIME_BYTES }
}

/// The one weight a tensor is joined into on the CPU (`layers::Fused`): q/k/v, gate/up.
fn joined_group(name: &str) -> Option<String> {
    for (parts, into) in [(&[".attn_q.", ".attn_k.", ".attn_v."][..], ".attn_qkv."), (&[".ffn_gate.", ".ffn_up."][..], ".ffn_gate_up.")] {
        if let Some(p) = parts.iter().find(|p| name.contains(*p)) {
            return Some(name.replacen(p, into, 1));
        }
    }
    None
}

/// Tensors the converter adds that the model computes instead: Qwen2.5-Omni's sinusoidal
/// audio positions (1500 rows; the tower makes its window's rows itself).
fn never_read(name: &str) -> bool {
    name == "a.position_embd.weight"
}

/// Whether `name` belongs to a multi-token-prediction block (Qwen3.5), which merg skips.
pub(crate) fn is_mtp(f: &GgufFile, name: &str) -> bool {
    let blocks = f.meta("qwen35.block_count").and_then(|v| v.to_u32().ok()).unwrap_or(0);
    let mtp = f.meta("qwen35.nextn_predict_layers").and_then(|v| v.to_u32().ok()).unwrap_or(0);
    if mtp == 0 {
        return false;
    }
    let layer = name.strip_prefix("blk.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<u32>().ok());
    layer.is_some_and(|l| l + mtp >= blocks)
}
