//! A loaded checkpoint: the model (any registered family) and its processor (tokenizer, chat
//! template, image preprocessor). `Engine::new` takes one.

use std::sync::Arc;

use anyhow::{Context, Result};
use candle_core::{DType, Device};

use crate::tokenizer::TokenizerJson;
use crate::gguf::GgufPaths;
use crate::hub::ModelFiles;
use crate::models::{self, Model};
use crate::processor::Processor;
use crate::tokenizer::ChatTokenizer;
use crate::vision::PreprocessorConfig;
use crate::weights::{Quant, QuantStats, Weights};

pub struct Checkpoint {
    pub model: Arc<dyn Model>,
    pub processor: Processor,
    /// Where it came from (absent for dummy weights and GGUF files).
    pub files: Option<ModelFiles>,
    /// The GGUF files it came from, when it did.
    pub gguf: Option<GgufPaths>,
    /// What in-situ quantization did, when it was asked for.
    pub quant_stats: Option<Arc<QuantStats>>,
    /// The tokenizer.json JSON-schema constraints compile from (absent for dummy weights).
    pub tokenizer_json: Option<TokenizerJson>,
}

/// A device by name: "cpu", "cuda" or "cuda:N".
pub fn parse_device(name: &str) -> Result<Device> {
    match name {
        "cpu" => Ok(Device::Cpu),
        s if s == "cuda" || s.starts_with("cuda:") => {
            let bad = || crate::setting::InvalidSetting::new("device", s, "cpu, cuda or cuda:N (N a GPU number)");
            let ord = s.strip_prefix("cuda:").map(str::parse::<usize>).transpose().map_err(|_| bad())?;
            let device = Device::new_cuda(ord.unwrap_or(0)).with_context(|| {
                format!("device {s}: CUDA is not available (merg must be built with the `cuda` feature, and a driver must be present)")
            })?;
            crate::memory::keep_freed_memory(&device);
            Ok(device)
        }
        _ => Err(crate::setting::InvalidSetting::new("device", name, "cpu, cuda or cuda:N").into()),
    }
}

/// How to load: compute dtype (None: the device's default, or a GGUF file's own bf16) and
/// in-situ quantization.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    pub dtype: Option<DType>,
    /// Quantize the decoder's linear weights to this llama.cpp block format while loading.
    pub quant: Option<Quant>,
    /// Quantize the vision tower's linear weights too.
    pub quant_vision: bool,
}

impl LoadOptions {
    pub fn weights(&self, w: Weights) -> (Weights, Option<Arc<QuantStats>>) {
        match self.quant {
            Some(q) => {
                let (w, stats) = w.quantize(q, self.quant_vision);
                (w, Some(stats))
            }
            None => (w, None),
        }
    }
}

impl Checkpoint {
    /// Loads a checkpoint found by `hub::resolve` (repo id or local directory).
    pub fn load(files: ModelFiles, device: &Device, dtype: Option<DType>) -> Result<Self> {
        Self::load_with(files, device, &LoadOptions { dtype, ..Default::default() })
    }

    /// As `load`, with quantization.
    pub fn load_with(files: ModelFiles, device: &Device, opts: &LoadOptions) -> Result<Self> {
        let config = models::registry::read_config(&files.config)?;
        let dtype = opts.dtype.unwrap_or_else(|| crate::weights::default_dtype(device));
        let prec = crate::plan::Precision { dense_bytes: dtype.size_in_bytes() as f64, quant: opts.quant, quant_vision: opts.quant_vision, kv_q8: false };
        let what = || format!("loading model {} ({})", files.source, files.config.display());
        let spec = models::registry::spec(&config).with_context(what)?;
        let params = models::registry::param_counts(&config).with_context(what)?;
        let cost = crate::plan::config_load_cost(&params, &spec, prec, !device.is_cpu());
        crate::memory::check_load(&files.source, cost, device)?;
        let (weights, quant_stats) = opts.weights(Weights::safetensors(&files.weights, dtype, device)?);
        let model = models::load(&config, weights).with_context(what)?;
        let tokenizer = Arc::new(ChatTokenizer::from_dir(&files.dir)?);
        // One read of preprocessor_config.json serves the image settings and, for a model that
        // hears, the feature extractor's.
        let (mut preprocessor, mel) = match &files.preprocessor_config {
            Some(p) => {
                let text = crate::input::read_string(p, &crate::input::CONFIG).context("reading the preprocessor config")?;
                (PreprocessorConfig::from_text(&text, p)?, mel_config(&text, p)?)
            }
            None => (PreprocessorConfig::default(), None),
        };
        if let Some(p) = &files.video_preprocessor_config {
            preprocessor.read_video_budget(p)?;
        }
        let processor = processor_for(&model, tokenizer, preprocessor, mel)?;
        let tokenizer_json = Some(TokenizerJson::File(files.tokenizer.clone()));
        Ok(Checkpoint { model, processor, files: Some(files), gguf: None, quant_stats, tokenizer_json })
    }

    /// Random weights for a config.json, with a separate tokenizer (benchmarks).
    pub fn dummy(config: &std::path::Path, tokenizer: ChatTokenizer, device: &Device, dtype: DType) -> Result<Self> {
        Self::dummy_with(config, tokenizer, device, &LoadOptions { dtype: Some(dtype), ..Default::default() })
    }

    /// As `dummy`, with quantization (each random tensor quantized as it is made).
    pub fn dummy_with(config: &std::path::Path, tokenizer: ChatTokenizer, device: &Device, opts: &LoadOptions) -> Result<Self> {
        let cfg = models::registry::read_config(config)?;
        let dtype = opts.dtype.unwrap_or_else(|| crate::weights::default_dtype(device));
        let (weights, quant_stats) = opts.weights(Weights::dummy(dtype, device));
        let model = models::load(&cfg, weights).with_context(|| format!("model config {}", config.display()))?;
        Ok(Checkpoint { quant_stats, ..Self::from_model(model, tokenizer)? })
    }

    /// An already loaded model with a tokenizer (benchmarks drive the engine this way).
    pub fn from_model(model: Arc<dyn models::Model>, tokenizer: ChatTokenizer) -> Result<Self> {
        let processor = processor_for(&model, Arc::new(tokenizer), model.spec().default_preprocessor(), None)?;
        Ok(Checkpoint { model, processor, files: None, gguf: None, quant_stats: None, tokenizer_json: None })
    }

    /// llama.cpp GGUF files: the text model and its vision projector (see `gguf::resolve`).
    /// Quantized tensors stay in their blocks; `opts.quant` applies only to a file stored in
    /// float types. Without `opts.dtype`, dense tensors take the file's format's default (bf16
    /// for a bf16 file, see `gguf::Format::default_dtype`).
    pub fn load_gguf(paths: &GgufPaths, device: &Device, opts: &LoadOptions) -> Result<Self> {
        let opened = crate::gguf::open(paths)?;
        opened.check_quant(paths, opts.quant)?;
        let dtype = opts.dtype.unwrap_or_else(|| opened.format.default_dtype(device));
        let cost = opened.weights.load_cost(dtype.size_in_bytes() as f64, !device.is_cpu());
        crate::memory::check_load(&paths.text.display().to_string(), cost, device)?;
        let (weights, quant_stats) = opts.weights(Weights::new(Arc::new(opened.weights), dtype, device));
        let source = weights.describe();
        let model = models::load(&opened.config, weights).with_context(|| format!("loading the GGUF model {source}"))?;
        let tokenizer = ChatTokenizer::from_json(&opened.tokenizer_json, &opened.tokenizer_origin, opened.chat_template)?;
        let processor = processor_for(&model, Arc::new(tokenizer), opened.preprocessor.config(model.spec())?, None)?;
        let tokenizer_json = Some(TokenizerJson::Text { origin: opened.tokenizer_origin, text: opened.tokenizer_json.into() });
        Ok(Checkpoint { model, processor, files: None, gguf: Some(paths.clone()), quant_stats, tokenizer_json })
    }

    /// Where the weights came from, for messages.
    pub fn origin(&self) -> String {
        match (&self.files, &self.gguf) {
            (Some(f), _) => f.source.clone(),
            (None, Some(g)) => g.text.display().to_string(),
            (None, None) => "with dummy weights".into(),
        }
    }

    pub fn tokenizer(&self) -> &ChatTokenizer {
        &self.processor.tokenizer
    }

}

pub use crate::memory::available_memory;

/// The processor of a loaded model: its tokenizer, image preprocessor and, for a model with an
/// audio encoder, the feature extractor (`mel`, or the model's defaults), checked against the
/// model's special ids.
fn processor_for(model: &Arc<dyn models::Model>, tokenizer: Arc<ChatTokenizer>, preprocessor: PreprocessorConfig, mel: Option<crate::audio::MelConfig>) -> Result<Processor> {
    let mut processor = Processor::new(tokenizer, preprocessor, model.spec());
    if let Some(spec) = model.audio_spec() {
        let mel = mel.unwrap_or(crate::audio::MelConfig { n_mels: spec.mel_bins, ..crate::audio::MelConfig::QWEN2_5_OMNI });
        processor = processor.with_audio(spec.clone(), mel)?;
    }
    processor.check_ids(model.spec())?;
    Ok(processor)
}

/// The feature extractor's settings in a preprocessor_config.json's `text`, if it names one.
fn mel_config(text: &str, path: &std::path::Path) -> Result<Option<crate::audio::MelConfig>> {
    let v: serde_json::Value = serde_json::from_str(text).with_context(|| format!("{} is not JSON", path.display()))?;
    crate::audio::MelConfig::from_preprocessor_json(&v).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))
}
