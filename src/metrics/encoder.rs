//! BERT-family encoders (BERT, RoBERTa, DistilBERT) for the evaluation metrics.
//!
//! Ours rather than `candle_transformers::models::{bert, distilbert}` because the metrics need
//! things those do not give: hidden states of an intermediate layer (BERTScore reads layer L of
//! roberta-large), RoBERTa's padding-aware position ids (bert's are 0..T), DistilBERT's exact
//! erf GELU (candle's distilbert uses the tanh approximation, ~1e-3 off transformers) and a
//! sequence-classification head. Post-LN blocks, as in transformers; f32 is what tests use.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{DType, Device, Tensor, D};
use candle_nn::{LayerNorm, Linear, Module, VarBuilder};
use serde::Deserialize;

use crate::layers::{self, Act};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EncoderKind {
    Bert,
    Roberta,
    DistilBert,
}

impl EncoderKind {
    fn parse(model_type: &str) -> Option<Self> {
        match model_type {
            "bert" => Some(Self::Bert),
            // Same weights layout and position scheme as RoBERTa.
            "roberta" | "xlm-roberta" | "camembert" => Some(Self::Roberta),
            "distilbert" => Some(Self::DistilBert),
            _ => None,
        }
    }
}

/// config.json fields of both naming schemes (BERT/RoBERTa vs DistilBERT).
#[derive(Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: Option<usize>,
    dim: Option<usize>,
    num_hidden_layers: Option<usize>,
    n_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    n_heads: Option<usize>,
    intermediate_size: Option<usize>,
    hidden_dim: Option<usize>,
    hidden_act: Option<String>,
    activation: Option<String>,
    max_position_embeddings: usize,
    #[serde(default)]
    type_vocab_size: usize,
    layer_norm_eps: Option<f64>,
    pad_token_id: Option<u32>,
    position_embedding_type: Option<String>,
    #[serde(default)]
    id2label: std::collections::BTreeMap<String, String>,
}

#[derive(Debug, Clone)]
pub struct EncoderConfig {
    pub kind: EncoderKind,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub intermediate_size: usize,
    pub activation: Act,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    pub layer_norm_eps: f64,
    pub pad_token_id: u32,
    /// Class names by index (empty for models without a classification head).
    pub labels: Vec<String>,
}

impl EncoderConfig {
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = crate::input::read_string(path, &crate::input::CONFIG)?;
        Self::from_json(&text).with_context(|| format!("model config {}", path.display()))
    }

    pub fn from_json(text: &str) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(text).context("not a BERT/RoBERTa/DistilBERT config.json")?;
        let model_type = raw.model_type.as_deref().unwrap_or("");
        let family = EncoderKind::parse(model_type).ok_or_else(|| {
            anyhow!("model_type {model_type:?} is not a supported encoder (bert, roberta, distilbert)")
        })?;
        let need = |v: Option<usize>, name: &str| v.ok_or_else(|| anyhow!("config has no {name}"));
        let (hidden, layers, heads, inter, act) = match family {
            EncoderKind::DistilBert => (
                need(raw.dim, "dim")?,
                need(raw.n_layers, "n_layers")?,
                need(raw.n_heads, "n_heads")?,
                need(raw.hidden_dim, "hidden_dim")?,
                raw.activation.unwrap_or_else(|| "gelu".into()),
            ),
            _ => (
                need(raw.hidden_size, "hidden_size")?,
                need(raw.num_hidden_layers, "num_hidden_layers")?,
                need(raw.num_attention_heads, "num_attention_heads")?,
                need(raw.intermediate_size, "intermediate_size")?,
                raw.hidden_act.unwrap_or_else(|| "gelu".into()),
            ),
        };
        if let Some(p) = raw.position_embedding_type.as_deref() {
            if p != "absolute" {
                bail!("position_embedding_type {p:?} is not supported (only absolute)");
            }
        }
        if heads == 0 || hidden % heads != 0 {
            bail!("hidden size {hidden} is not a multiple of {heads} attention heads");
        }
        // The same activation names as the Qwen configs (`config::Act`), plus relu.
        let activation: Act = serde_json::from_value(serde_json::Value::String(act.clone()))
            .map_err(|_| anyhow!("unsupported activation {act:?}"))?;
        let mut labels = Vec::new();
        for i in 0..raw.id2label.len() {
            let l = raw.id2label.get(&i.to_string()).ok_or_else(|| anyhow!("id2label has no entry {i}"))?;
            labels.push(l.clone());
        }
        Ok(Self {
            kind: family,
            vocab_size: raw.vocab_size,
            hidden_size: hidden,
            num_layers: layers,
            num_heads: heads,
            intermediate_size: inter,
            activation,
            max_position_embeddings: raw.max_position_embeddings,
            type_vocab_size: if family == EncoderKind::DistilBert { 0 } else { raw.type_vocab_size },
            // DistilBERT hard-codes 1e-12 in transformers; BERT's default is the same.
            layer_norm_eps: raw.layer_norm_eps.unwrap_or(1e-12),
            pad_token_id: raw.pad_token_id.unwrap_or(if family == EncoderKind::Roberta { 1 } else { 0 }),
            labels,
        })
    }

    /// Longest input the position table allows (RoBERTa's positions start at pad_id + 1).
    pub fn max_input_len(&self) -> usize {
        match self.kind {
            EncoderKind::Roberta => self.max_position_embeddings.saturating_sub(self.pad_token_id as usize + 1),
            _ => self.max_position_embeddings,
        }
    }
}

fn layer_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    // Older BERT checkpoints (bert-base-uncased) store LayerNorm as gamma/beta.
    let (w, b) = if vb.contains_tensor("weight") { ("weight", "bias") } else { ("gamma", "beta") };
    Ok(LayerNorm::new(vb.get(size, w)?, vb.get(size, b)?, eps))
}

fn linear(i: usize, o: usize, vb: VarBuilder) -> Result<Linear> {
    Ok(candle_nn::linear(i, o, vb)?)
}

struct Block {
    q: Linear,
    k: Linear,
    v: Linear,
    attn_out: Linear,
    attn_norm: LayerNorm,
    ff_in: Linear,
    ff_out: Linear,
    ff_norm: LayerNorm,
}

impl Block {
    fn load(cfg: &EncoderConfig, vb: VarBuilder) -> Result<Self> {
        let (h, i, eps) = (cfg.hidden_size, cfg.intermediate_size, cfg.layer_norm_eps);
        Ok(match cfg.kind {
            EncoderKind::DistilBert => {
                let a = vb.pp("attention");
                Self {
                    q: linear(h, h, a.pp("q_lin"))?,
                    k: linear(h, h, a.pp("k_lin"))?,
                    v: linear(h, h, a.pp("v_lin"))?,
                    attn_out: linear(h, h, a.pp("out_lin"))?,
                    attn_norm: layer_norm(h, eps, vb.pp("sa_layer_norm"))?,
                    ff_in: linear(h, i, vb.pp("ffn.lin1"))?,
                    ff_out: linear(i, h, vb.pp("ffn.lin2"))?,
                    ff_norm: layer_norm(h, eps, vb.pp("output_layer_norm"))?,
                }
            }
            _ => {
                let a = vb.pp("attention");
                Self {
                    q: linear(h, h, a.pp("self.query"))?,
                    k: linear(h, h, a.pp("self.key"))?,
                    v: linear(h, h, a.pp("self.value"))?,
                    attn_out: linear(h, h, a.pp("output.dense"))?,
                    attn_norm: layer_norm(h, eps, a.pp("output.LayerNorm"))?,
                    ff_in: linear(h, i, vb.pp("intermediate.dense"))?,
                    ff_out: linear(i, h, vb.pp("output.dense"))?,
                    ff_norm: layer_norm(h, eps, vb.pp("output.LayerNorm"))?,
                }
            }
        })
    }

    /// `mask`: additive, [B, 1, 1, T].
    fn forward(&self, xs: &Tensor, mask: &Tensor, heads: usize, act: Act) -> Result<Tensor> {
        let (b, t, h) = xs.dims3()?;
        let hd = h / heads;
        let split = |x: Tensor| -> candle_core::Result<Tensor> {
            x.reshape((b, t, heads, hd))?.transpose(1, 2)?.contiguous()
        };
        let q = split(self.q.forward(xs)?)?;
        let k = split(self.k.forward(xs)?)?;
        let v = split(self.v.forward(xs)?)?;
        let scores = (q.matmul(&k.t()?)? / (hd as f64).sqrt())?.broadcast_add(mask)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let ctx = probs.matmul(&v)?.transpose(1, 2)?.reshape((b, t, h))?;
        let a = self.attn_norm.forward(&(self.attn_out.forward(&ctx)? + xs)?)?;
        let f = self.ff_out.forward(&layers::act(act, &self.ff_in.forward(&a)?)?)?;
        Ok(self.ff_norm.forward(&(f + a)?)?)
    }
}

/// Embeddings plus the first `layers.len()` transformer blocks.
pub struct Encoder {
    cfg: EncoderConfig,
    word: candle_nn::Embedding,
    position: candle_nn::Embedding,
    token_type: Option<candle_nn::Embedding>,
    emb_norm: LayerNorm,
    layers: Vec<Block>,
    device: Device,
}

/// Finds the prefix under which the base model's tensors live ("", "roberta.", "bert.", ...).
pub fn base_prefix(vb: &VarBuilder, cfg: &EncoderConfig) -> Result<String> {
    let family = match cfg.kind {
        EncoderKind::Bert => "bert.",
        EncoderKind::Roberta => "roberta.",
        EncoderKind::DistilBert => "distilbert.",
    };
    for p in ["", family] {
        if vb.contains_tensor(&format!("{p}embeddings.word_embeddings.weight")) {
            return Ok(p.to_string());
        }
    }
    bail!("no embeddings.word_embeddings.weight (bare or under {family}) in the weights: not a {:?} checkpoint", cfg.kind)
}

impl Encoder {
    /// Loads the embeddings and the first `num_layers` blocks (all when `None`); `vb` must be
    /// at the base model (see [`base_prefix`]). Blocks past `num_layers` are never read, so
    /// BERTScore at layer 17 of roberta-large does not load layers 18..24.
    pub fn load(cfg: &EncoderConfig, num_layers: Option<usize>, vb: VarBuilder) -> Result<Self> {
        let n = num_layers.unwrap_or(cfg.num_layers);
        if n > cfg.num_layers {
            bail!("layer {n} requested but the model has {} layers", cfg.num_layers);
        }
        let h = cfg.hidden_size;
        let e = vb.pp("embeddings");
        let word = candle_nn::embedding(cfg.vocab_size, h, e.pp("word_embeddings"))?;
        let position = candle_nn::embedding(cfg.max_position_embeddings, h, e.pp("position_embeddings"))?;
        let token_type = if cfg.type_vocab_size > 0 {
            Some(candle_nn::embedding(cfg.type_vocab_size, h, e.pp("token_type_embeddings"))?)
        } else {
            None
        };
        let emb_norm = layer_norm(h, cfg.layer_norm_eps, e.pp("LayerNorm"))?;
        let stack = match cfg.kind {
            EncoderKind::DistilBert => vb.pp("transformer.layer"),
            _ => vb.pp("encoder.layer"),
        };
        let layers = (0..n)
            .map(|i| Block::load(cfg, stack.pp(i.to_string())).with_context(|| format!("encoder layer {i}")))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { cfg: cfg.clone(), word, position, token_type, emb_norm, layers, device: vb.device().clone() })
    }

    pub fn config(&self) -> &EncoderConfig {
        &self.cfg
    }

    pub fn loaded_layers(&self) -> usize {
        self.layers.len()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// Right-pads `seqs` with the pad id and returns `hidden_states[layer]` as [B, T_max, H]
    /// (index 0 = embedding output, like transformers' `output_hidden_states`). Rows past a
    /// sequence's length are padding and meaningless; real rows do not depend on the padding.
    pub fn hidden_states(&self, seqs: &[&[u32]], layer: usize) -> Result<Tensor> {
        if layer > self.layers.len() {
            bail!("hidden state {layer} requested but only {} layers are loaded", self.layers.len());
        }
        if seqs.is_empty() || seqs.iter().any(|s| s.is_empty()) {
            bail!("encoder input must be a non-empty batch of non-empty sequences");
        }
        let t = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
        let limit = self.cfg.max_input_len();
        if t > limit {
            bail!("sequence of {t} tokens is longer than the model's {limit} positions");
        }
        let pad = self.cfg.pad_token_id;
        let b = seqs.len();
        let (mut ids, mut pos, mut mask) = (Vec::with_capacity(b * t), Vec::with_capacity(b * t), Vec::with_capacity(b * t));
        for s in seqs {
            if let Some(&bad) = s.iter().find(|&&id| id as usize >= self.cfg.vocab_size) {
                bail!("token id {bad} is outside the model's vocabulary of {}", self.cfg.vocab_size);
            }
            let mut run = 0u32;
            for j in 0..t {
                let real = j < s.len();
                let id = if real { s[j] } else { pad };
                ids.push(id);
                mask.push(if real { 0f32 } else { f32::MIN });
                pos.push(match self.cfg.kind {
                    // transformers' create_position_ids_from_input_ids: pad tokens get pad_id,
                    // others pad_id + (count of non-pad tokens so far).
                    EncoderKind::Roberta => {
                        if id != pad {
                            run += 1;
                            pad + run
                        } else {
                            pad
                        }
                    }
                    _ => j as u32,
                });
            }
        }
        let dev = &self.device;
        let ids = Tensor::from_vec(ids, (b, t), dev)?;
        let pos = Tensor::from_vec(pos, (b, t), dev)?;
        let mask = Tensor::from_vec(mask, (b, 1, 1, t), dev)?;
        let mut xs = (self.word.forward(&ids)? + self.position.forward(&pos)?)?;
        if let Some(tt) = &self.token_type {
            xs = xs.broadcast_add(&tt.forward(&Tensor::zeros(1, DType::U32, dev)?)?)?;
        }
        let mut xs = self.emb_norm.forward(&xs)?;
        for block in &self.layers[..layer] {
            xs = block.forward(&xs, &mask, self.cfg.num_heads, self.cfg.activation)?;
        }
        Ok(xs)
    }
}

/// Sequence-classification head on the first token ([CLS] / <s>).
pub enum ClassifierHead {
    /// DistilBertForSequenceClassification: pre_classifier → ReLU → classifier.
    DistilBert { pre: Linear, out: Linear },
}

impl ClassifierHead {
    /// `vb` at the checkpoint root.
    pub fn load(cfg: &EncoderConfig, vb: VarBuilder) -> Result<Self> {
        let (h, n) = (cfg.hidden_size, cfg.labels.len());
        if n == 0 {
            bail!("config.json has no id2label: not a sequence-classification model");
        }
        match cfg.kind {
            EncoderKind::DistilBert => Ok(Self::DistilBert {
                pre: linear(h, h, vb.pp("pre_classifier")).context("DistilBERT pre_classifier")?,
                out: linear(h, n, vb.pp("classifier")).context("DistilBERT classifier")?,
            }),
            f => bail!("{f:?} sequence classifiers are not supported (only DistilBERT)"),
        }
    }

    /// `hidden`: last hidden states [B, T, H] → logits [B, num_labels].
    pub fn forward(&self, hidden: &Tensor) -> Result<Tensor> {
        let first = hidden.narrow(1, 0, 1)?.squeeze(1)?;
        match self {
            Self::DistilBert { pre, out } => Ok(out.forward(&pre.forward(&first)?.relu()?)?),
        }
    }
}

/// L2-normalises the rows of a [T, H] tensor.
pub fn normalize_rows(xs: &Tensor) -> Result<Tensor> {
    let norm = xs.sqr()?.sum_keepdim(D::Minus1)?.sqrt()?;
    Ok(xs.broadcast_div(&norm)?)
}

/// A checkpoint resolved through [`crate::hub::resolve`] (local directory, or hub id from the
/// cache / online per `HubOptions::from_env`), with its parsed config and an f32 `VarBuilder`.
/// Needs config.json, tokenizer.json and safetensors weights; for a repo that ships only
/// vocab.txt / vocab.json + merges.txt or pytorch_model.bin, convert once in Python
/// (`AutoTokenizer.from_pretrained(id).save_pretrained(dir)`, `model.save_pretrained(dir)`) and
/// pass the directory.
pub struct EncoderCheckpoint {
    pub files: crate::hub::ModelFiles,
    pub config: EncoderConfig,
    pub vb: VarBuilder<'static>,
}

impl EncoderCheckpoint {
    pub fn load(model: &str, device: &Device) -> Result<Self> {
        let files = crate::hub::resolve(model, None).with_context(|| format!("locating model {model}"))?;
        let config = EncoderConfig::from_file(&files.config).with_context(|| format!("model {model}"))?;
        let vb = crate::weights::Weights::safetensors(&files.weights, DType::F32, device).map(|w| w.vb().clone())
            .with_context(|| format!("loading weights of {model}"))?;
        Ok(Self { files, config, vb })
    }

    /// The `VarBuilder` at the base model ("roberta.", "distilbert.", ... or the root).
    pub fn base_vb(&self) -> Result<VarBuilder<'static>> {
        let prefix = base_prefix(&self.vb, &self.config).with_context(|| format!("model {}", self.files.source))?;
        Ok(match prefix.strip_suffix('.') {
            Some(p) => self.vb.pp(p),
            None => self.vb.clone(),
        })
    }

    /// Special token string from tokenizer_config.json (`"<s>"` or `{"content": "<s>", ...}`).
    pub fn special_token(&self, key: &str) -> Option<String> {
        let path = self.files.tokenizer_config.as_ref()?;
        let v: serde_json::Value = serde_json::from_str(&crate::input::read_string(path, &crate::input::CONFIG).ok()?).ok()?;
        match v.get(key)? {
            serde_json::Value::String(s) => Some(s.clone()),
            o => o.get("content")?.as_str().map(str::to_string),
        }
    }

    /// `model_max_length` from tokenizer_config.json, when present and sane.
    pub fn model_max_length(&self) -> Option<usize> {
        let path = self.files.tokenizer_config.as_ref()?;
        let v: serde_json::Value = serde_json::from_str(&crate::input::read_string(path, &crate::input::CONFIG).ok()?).ok()?;
        // transformers writes 1e30 for "no limit".
        v.get("model_max_length")?.as_f64().filter(|&n| (1.0..1e9).contains(&n)).map(|n| n as usize)
    }

    /// The tokenizer.json, truncating (right side, special tokens kept) to `max_len` tokens.
    pub fn tokenizer(&self, max_len: usize) -> Result<tokenizers::Tokenizer> {
        let path = &self.files.tokenizer;
        let mut tok = tokenizers::Tokenizer::from_file(path)
            .map_err(|e| anyhow!("{}: not a usable tokenizer: {e}", path.display()))?;
        tok.with_padding(None);
        tok.with_truncation(Some(tokenizers::TruncationParams { max_length: max_len, ..Default::default() }))
            .map_err(|e| anyhow!("{}: setting truncation: {e}", path.display()))?;
        Ok(tok)
    }
}
