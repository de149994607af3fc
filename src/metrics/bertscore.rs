//! BERTScore (Zhang et al., 2020) exactly as the `bert-score` 0.3.13 package computes it.
//!
//! For each (candidate, reference): embed both with layer `num_layers` of the model
//! (`hidden_states[L]`, 0 = embeddings; the package truncates the encoder to L layers), L2-normalise
//! every token vector, and greedily match by cosine: precision averages, over candidate tokens, the
//! best cosine against any reference token; recall the other way round; F1 = 2PR/(P+R).
//! Details kept from the package:
//! - tokens: `sentence.strip()`, then `tokenizer.encode(.., add_special_tokens=True,
//!   truncation=True, max_length=model_max_length)`, with `add_prefix_space=True` for RoBERTa's
//!   byte-level BPE; an empty sentence is just [CLS, SEP].
//! - [CLS]/[SEP] take part in the matching (as match targets) but get weight 0 (no idf), or their
//!   idf weight, which is 0 when every reference has them.
//! - idf (optional): log((N+1)/(df+1)) over the N reference sentences, log(N+1) for unseen ids.
//! - a candidate or reference of only [CLS, SEP] gives P = R = F = 0.
//! - baseline rescaling: (x - b) / (1 - b), b from the package's tsv format (row = layer).
//! - several references per candidate: the best P, R and F separately.
//!
//! One deliberate difference: the package pads its greedy-match batches with zero-similarity
//! entries, so a token whose best cosine is negative scores 0 instead, depending on what it is
//! batched with. Real checkpoints do not produce negative best cosines (their embeddings are
//! anisotropic); we match real tokens only, so results never depend on batching.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Device, Tensor};

use crate::metrics::encoder::{normalize_rows, EncoderCheckpoint, Encoder, EncoderKind};

/// bert-score's default for English.
pub const DEFAULT_MODEL: &str = "roberta-large";
pub const DEFAULT_BATCH_SIZE: usize = 64;

/// bert-score 0.3.13's `model2layers`: the layer tuned on WMT16 for each known model name.
const MODEL_LAYERS: &[(&str, usize)] = &[
    ("bert-base-uncased", 9), ("bert-large-uncased", 18), ("bert-base-cased-finetuned-mrpc", 9),
    ("bert-base-multilingual-cased", 9), ("bert-base-chinese", 8), ("roberta-base", 10),
    ("roberta-large", 17), ("roberta-large-mnli", 19), ("roberta-base-openai-detector", 7),
    ("roberta-large-openai-detector", 15), ("xlnet-base-cased", 5), ("xlnet-large-cased", 7),
    ("xlm-mlm-en-2048", 6), ("xlm-mlm-100-1280", 10), ("allenai/scibert_scivocab_uncased", 8),
    ("allenai/scibert_scivocab_cased", 9), ("nfliu/scibert_basevocab_uncased", 9),
    ("distilroberta-base", 5), ("distilbert-base-uncased", 5),
    ("distilbert-base-uncased-distilled-squad", 4), ("distilbert-base-multilingual-cased", 5),
    ("albert-base-v1", 10), ("albert-large-v1", 17), ("albert-xlarge-v1", 16),
    ("albert-xxlarge-v1", 8), ("albert-base-v2", 9), ("albert-large-v2", 14),
    ("albert-xlarge-v2", 13), ("albert-xxlarge-v2", 8), ("xlm-roberta-base", 9),
    ("xlm-roberta-large", 17), ("google/electra-small-generator", 9),
    ("google/electra-small-discriminator", 11), ("google/electra-base-generator", 10),
    ("google/electra-base-discriminator", 9), ("google/electra-large-generator", 18),
    ("google/electra-large-discriminator", 14), ("google/bert_uncased_L-2_H-128_A-2", 1),
    ("google/bert_uncased_L-2_H-256_A-4", 1), ("google/bert_uncased_L-2_H-512_A-8", 1),
    ("google/bert_uncased_L-2_H-768_A-12", 2), ("google/bert_uncased_L-4_H-128_A-2", 3),
    ("google/bert_uncased_L-4_H-256_A-4", 3), ("google/bert_uncased_L-4_H-512_A-8", 3),
    ("google/bert_uncased_L-4_H-768_A-12", 3), ("google/bert_uncased_L-6_H-128_A-2", 5),
    ("google/bert_uncased_L-6_H-256_A-4", 5), ("google/bert_uncased_L-6_H-512_A-8", 5),
    ("google/bert_uncased_L-6_H-768_A-12", 5), ("google/bert_uncased_L-8_H-128_A-2", 7),
    ("google/bert_uncased_L-8_H-256_A-4", 7), ("google/bert_uncased_L-8_H-512_A-8", 6),
    ("google/bert_uncased_L-8_H-768_A-12", 7), ("google/bert_uncased_L-10_H-128_A-2", 8),
    ("google/bert_uncased_L-10_H-256_A-4", 8), ("google/bert_uncased_L-10_H-512_A-8", 9),
    ("google/bert_uncased_L-10_H-768_A-12", 8), ("google/bert_uncased_L-12_H-128_A-2", 10),
    ("google/bert_uncased_L-12_H-256_A-4", 11), ("google/bert_uncased_L-12_H-512_A-8", 10),
    ("google/bert_uncased_L-12_H-768_A-12", 9), ("amazon/bort", 0), ("facebook/bart-base", 6),
    ("facebook/bart-large", 10), ("facebook/bart-large-cnn", 10), ("facebook/bart-large-mnli", 11),
    ("facebook/bart-large-xsum", 9), ("t5-small", 6), ("t5-base", 11), ("t5-large", 23),
    ("vinai/bertweet-base", 9), ("microsoft/deberta-base", 9), ("microsoft/deberta-base-mnli", 9),
    ("microsoft/deberta-large", 16), ("microsoft/deberta-large-mnli", 18),
    ("microsoft/deberta-xlarge", 18), ("microsoft/deberta-xlarge-mnli", 40),
    ("YituTech/conv-bert-base", 10), ("YituTech/conv-bert-small", 10),
    ("YituTech/conv-bert-medium-small", 9), ("microsoft/mpnet-base", 8),
    ("squeezebert/squeezebert-uncased", 9), ("squeezebert/squeezebert-mnli", 9),
    ("squeezebert/squeezebert-mnli-headless", 9), ("tuner007/pegasus_paraphrase", 15),
    ("google/pegasus-large", 8), ("google/pegasus-xsum", 11), ("sshleifer/tiny-mbart", 2),
    ("facebook/mbart-large-cc25", 12), ("facebook/mbart-large-50", 12),
    ("facebook/mbart-large-en-ro", 12), ("facebook/mbart-large-50-many-to-many-mmt", 12),
    ("facebook/mbart-large-50-one-to-many-mmt", 12), ("allenai/led-base-16384", 6),
    ("facebook/blenderbot_small-90M", 7), ("facebook/blenderbot-400M-distill", 2),
    ("microsoft/prophetnet-large-uncased", 4), ("microsoft/prophetnet-large-uncased-cnndm", 7),
    ("SpanBERT/spanbert-base-cased", 8), ("SpanBERT/spanbert-large-cased", 17),
    ("microsoft/xprophetnet-large-wiki100-cased", 7), ("ProsusAI/finbert", 10),
    ("Vamsi/T5_Paraphrase_Paws", 12), ("ramsrigouthamg/t5_paraphraser", 11),
    ("microsoft/deberta-v2-xlarge", 10), ("microsoft/deberta-v2-xlarge-mnli", 17),
    ("microsoft/deberta-v2-xxlarge", 21), ("microsoft/deberta-v2-xxlarge-mnli", 22),
    ("allenai/longformer-base-4096", 7), ("allenai/longformer-large-4096", 14),
    ("allenai/longformer-large-4096-finetuned-triviaqa", 14),
    ("zhiheng-huang/bert-base-uncased-embedding-relative-key", 4),
    ("zhiheng-huang/bert-base-uncased-embedding-relative-key-query", 7),
    ("zhiheng-huang/bert-large-uncased-whole-word-masking-embedding-relative-key-query", 19),
    ("google/mt5-small", 8), ("google/mt5-base", 11), ("google/mt5-large", 19),
    ("google/mt5-xl", 24), ("google/bigbird-roberta-base", 10),
    ("google/bigbird-roberta-large", 14), ("google/bigbird-base-trivia-itc", 8),
    ("princeton-nlp/unsup-simcse-bert-base-uncased", 10),
    ("princeton-nlp/unsup-simcse-bert-large-uncased", 18),
    ("princeton-nlp/unsup-simcse-roberta-base", 8),
    ("princeton-nlp/unsup-simcse-roberta-large", 13),
    ("princeton-nlp/sup-simcse-bert-base-uncased", 10),
    ("princeton-nlp/sup-simcse-bert-large-uncased", 18),
    ("princeton-nlp/sup-simcse-roberta-base", 10), ("princeton-nlp/sup-simcse-roberta-large", 16),
    ("dbmdz/bert-base-turkish-cased", 10), ("dbmdz/distilbert-base-turkish-cased", 4),
    ("google/byt5-small", 1), ("google/byt5-base", 17), ("google/byt5-large", 30),
    ("microsoft/deberta-v3-xsmall", 10), ("microsoft/deberta-v3-small", 4),
    ("microsoft/deberta-v3-base", 9), ("microsoft/mdeberta-v3-base", 10),
    ("microsoft/deberta-v3-large", 12), ("khalidalt/DeBERTa-v3-large-mnli", 18),
];

/// Default layer for a model id from bert-score's table: the id as given, else its last one or
/// two path components (so `/models/roberta-large` and `~/hub/FacebookAI/roberta-large` work).
pub fn default_num_layers(model: &str) -> Option<usize> {
    let trimmed = model.trim_end_matches('/');
    let parts: Vec<&str> = trimmed.rsplit('/').collect();
    let mut keys = vec![trimmed.to_string()];
    if parts.len() >= 2 {
        keys.push(format!("{}/{}", parts[1], parts[0]));
    }
    keys.push(parts[0].to_string());
    keys.iter().find_map(|k| MODEL_LAYERS.iter().find(|(n, _)| n == k).map(|&(_, l)| l))
}

/// Precision, recall and F1 of one candidate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Score {
    pub precision: f64,
    pub recall: f64,
    pub f1: f64,
}

/// Rescaling baseline b for (P, R, F): scores become (x - b) / (1 - b).
///
/// bert-score ships them as `rescale_baseline/<lang>/<model>.tsv`; for roberta-large (en) at
/// layer 17 the row is `17,0.83150584,0.8314941,0.83122575`: copy that file (with its header) or
/// use [`Baseline::new`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Baseline {
    pub p: f64,
    pub r: f64,
    pub f: f64,
}

impl Baseline {
    pub fn new(p: f64, r: f64, f: f64) -> Self {
        Self { p, r, f }
    }

    /// Row `num_layers` (0-based, after the header `LAYER,P,R,F`) of a bert-score baseline file
    /// (comma separated despite the .tsv name), like the package's `iloc[num_layers]`.
    pub fn from_file(path: &Path, num_layers: usize) -> Result<Self> {
        let text = crate::input::read_string(path, &crate::input::TEXT).context("reading the BERTScore baseline file")?;
        let mut lines = text.lines().filter(|l| !l.trim().is_empty());
        let header = lines.next().ok_or_else(|| anyhow!("baseline file {} is empty", path.display()))?;
        let cols: Vec<&str> = header.split(',').map(str::trim).collect();
        if cols.len() != 4 || cols[1..] != ["P", "R", "F"] {
            bail!("baseline file {}: header {header:?} is not LAYER,P,R,F", path.display());
        }
        let row = lines.nth(num_layers).ok_or_else(|| {
            anyhow!("baseline file {} has no row for layer {num_layers}", path.display())
        })?;
        let vals: Vec<&str> = row.split(',').map(str::trim).collect();
        let num = |s: &str| -> Result<f64> {
            s.parse::<f64>().map_err(|_| anyhow!("baseline file {}: {s:?} is not a number in row {row:?}", path.display()))
        };
        if vals.len() != 4 {
            bail!("baseline file {}: row {row:?} does not have 4 columns", path.display());
        }
        if num(vals[0])? != num_layers as f64 {
            bail!("baseline file {}: row {num_layers} is for layer {}", path.display(), vals[0]);
        }
        // The package reads them as float32.
        let f32ed = |s: &str| -> Result<f64> { Ok(num(s)? as f32 as f64) };
        Ok(Self { p: f32ed(vals[1])?, r: f32ed(vals[2])?, f: f32ed(vals[3])? })
    }

    pub fn rescale(&self, s: Score) -> Score {
        Score {
            precision: (s.precision - self.p) / (1.0 - self.p),
            recall: (s.recall - self.r) / (1.0 - self.r),
            f1: (s.f1 - self.f) / (1.0 - self.f),
        }
    }
}

/// Token weights; without idf every token weighs 1 except [CLS]/[SEP] (0).
#[derive(Debug, Clone)]
pub struct IdfWeights {
    weights: HashMap<u32, f64>,
    default: f64,
}

impl IdfWeights {
    pub fn get(&self, id: u32) -> f64 {
        self.weights.get(&id).copied().unwrap_or(self.default)
    }
}

/// Python's `str.strip()`: Unicode whitespace plus the \x1c..\x1f separators.
fn py_strip(s: &str) -> &str {
    s.trim_matches(|c: char| c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c))
}

pub struct BertScorer {
    model: String,
    encoder: Encoder,
    tokenizer: tokenizers::Tokenizer,
    cls: u32,
    sep: u32,
    prefix_space: bool,
    num_layers: usize,
    batch_size: usize,
    baseline: Option<Baseline>,
}

impl BertScorer {
    /// Loads `model` (local directory or hub id of a BERT/RoBERTa/DistilBERT checkpoint with
    /// tokenizer.json) and its first `num_layers` layers; `None` takes bert-score's default for
    /// the model name (17 for roberta-large) and is an error for names it does not know.
    pub fn load(model: &str, num_layers: Option<usize>, device: &Device) -> Result<Self> {
        let num_layers = match num_layers.or_else(|| default_num_layers(model)) {
            Some(n) => n,
            None => bail!("BERTScore: no default layer known for model {model}; pass num_layers"),
        };
        let ck = EncoderCheckpoint::load(model, device)?;
        let cfg = &ck.config;
        if num_layers > cfg.num_layers {
            bail!("BERTScore: num_layers {num_layers} but model {model} has {} layers", cfg.num_layers);
        }
        let encoder = Encoder::load(cfg, Some(num_layers), ck.base_vb()?)
            .with_context(|| format!("loading encoder of {model}"))?;
        // bert-score truncates to the tokenizer's model_max_length; never past the positions.
        let max_len = ck.model_max_length().unwrap_or(usize::MAX).min(cfg.max_input_len());
        let tokenizer = ck.tokenizer(max_len)?;
        let roberta = cfg.kind == EncoderKind::Roberta;
        let id_of = |key: &str, fallback: &str| -> Result<u32> {
            let tok = ck.special_token(key).unwrap_or_else(|| fallback.to_string());
            tokenizer
                .token_to_id(&tok)
                .ok_or_else(|| anyhow!("model {model}: {key} {tok:?} is not in the tokenizer's vocabulary"))
        };
        let cls = id_of("cls_token", if roberta { "<s>" } else { "[CLS]" })?;
        let sep = id_of("sep_token", if roberta { "</s>" } else { "[SEP]" })?;
        Ok(Self {
            model: model.to_string(),
            encoder,
            tokenizer,
            cls,
            sep,
            prefix_space: roberta,
            num_layers,
            batch_size: DEFAULT_BATCH_SIZE,
            baseline: None,
        })
    }

    pub fn model(&self) -> &str {
        &self.model
    }

    pub fn num_layers(&self) -> usize {
        self.num_layers
    }

    /// Sentences embedded per forward pass (results do not depend on it).
    pub fn set_batch_size(&mut self, n: usize) {
        self.batch_size = n.max(1);
    }

    /// Rescale every score returned from now on (`None`: raw scores).
    pub fn set_baseline(&mut self, baseline: Option<Baseline>) {
        self.baseline = baseline;
    }

    /// Loads the row for this scorer's layer from a bert-score baseline file and uses it.
    pub fn set_baseline_file(&mut self, path: &Path) -> Result<()> {
        self.baseline = Some(Baseline::from_file(path, self.num_layers)?);
        Ok(())
    }

    /// Token ids exactly as bert-score's `sent_encode`.
    pub fn encode(&self, sentence: &str) -> Result<Vec<u32>> {
        let s = py_strip(sentence);
        if s.is_empty() {
            return Ok(vec![self.cls, self.sep]);
        }
        // RoBERTa's slow tokenizer with add_prefix_space=True puts a space before the text.
        let text = if self.prefix_space { format!(" {s}") } else { s.to_string() };
        let enc = self
            .tokenizer
            .encode(text.as_str(), true)
            .map_err(|e| anyhow!("tokenizing {:?} for {}: {e}", truncate(s), self.model))?;
        Ok(enc.get_ids().to_vec())
    }

    /// idf weights from reference sentences, as bert-score's `get_idf_dict`.
    pub fn idf_from_refs<S: AsRef<str>>(&self, refs: &[S]) -> Result<IdfWeights> {
        let n = refs.len() as f64;
        let mut df: HashMap<u32, usize> = HashMap::new();
        for r in refs {
            for id in self.encode(r.as_ref())?.into_iter().collect::<HashSet<_>>() {
                *df.entry(id).or_default() += 1;
            }
        }
        let weights = df.into_iter().map(|(id, c)| (id, ((n + 1.0) / (c as f64 + 1.0)).ln())).collect();
        Ok(IdfWeights { weights, default: (n + 1.0).ln() })
    }

    fn no_idf(&self) -> IdfWeights {
        let weights = HashMap::from([(self.cls, 0.0), (self.sep, 0.0)]);
        IdfWeights { weights, default: 1.0 }
    }

    /// One score per (candidate, reference) pair, without idf.
    pub fn score<S: AsRef<str>, T: AsRef<str>>(&self, cands: &[S], refs: &[T]) -> Result<Vec<Score>> {
        self.score_with_idf(cands, refs, None)
    }

    /// As [`Self::score`], weighting tokens by `idf` (bert-score's `idf=True` uses
    /// [`Self::idf_from_refs`] over the references).
    pub fn score_with_idf<S: AsRef<str>, T: AsRef<str>>(
        &self,
        cands: &[S],
        refs: &[T],
        idf: Option<&IdfWeights>,
    ) -> Result<Vec<Score>> {
        if cands.len() != refs.len() {
            bail!("BERTScore: {} candidates but {} references", cands.len(), refs.len());
        }
        let raw = self.raw_scores(cands, refs, idf)?;
        Ok(raw.into_iter().map(|s| self.finish(s)).collect())
    }

    /// Several references per candidate: the best precision, recall and F1 over them,
    /// each taken separately (as bert-score does).
    pub fn score_multi<S: AsRef<str>, T: AsRef<str>>(
        &self,
        cands: &[S],
        refs: &[Vec<T>],
        idf: Option<&IdfWeights>,
    ) -> Result<Vec<Score>> {
        if cands.len() != refs.len() {
            bail!("BERTScore: {} candidates but {} reference groups", cands.len(), refs.len());
        }
        let (mut fc, mut fr) = (Vec::new(), Vec::new());
        for (i, (c, group)) in cands.iter().zip(refs).enumerate() {
            if group.is_empty() {
                bail!("BERTScore: candidate {i} has no references");
            }
            for r in group {
                fc.push(c.as_ref());
                fr.push(r.as_ref());
            }
        }
        let raw = self.raw_scores(&fc, &fr, idf)?;
        let mut out = Vec::with_capacity(cands.len());
        let mut at = 0;
        for group in refs {
            let best = raw[at..at + group.len()].iter().copied().reduce(|a, b| Score {
                precision: nan_max(a.precision, b.precision),
                recall: nan_max(a.recall, b.recall),
                f1: nan_max(a.f1, b.f1),
            });
            at += group.len();
            out.push(self.finish(best.expect("groups are non-empty")));
        }
        Ok(out)
    }

    fn finish(&self, s: Score) -> Score {
        match &self.baseline {
            Some(b) => b.rescale(s),
            None => s,
        }
    }

    /// Unit-norm token embeddings [T, H] of each distinct token sequence.
    pub fn embed(&self, seqs: &[Vec<u32>]) -> Result<Vec<Tensor>> {
        // Longest first so each batch pads little; results do not depend on the grouping.
        let mut order: Vec<usize> = (0..seqs.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(seqs[i].len()));
        let mut out: Vec<Option<Tensor>> = vec![None; seqs.len()];
        for chunk in order.chunks(self.batch_size) {
            let batch: Vec<&[u32]> = chunk.iter().map(|&i| seqs[i].as_slice()).collect();
            let hs = self
                .encoder
                .hidden_states(&batch, self.num_layers)
                .with_context(|| format!("BERTScore embeddings with {}", self.model))?;
            for (row, &i) in chunk.iter().enumerate() {
                let e = hs.get(row)?.narrow(0, 0, seqs[i].len())?;
                out[i] = Some(normalize_rows(&e)?);
            }
        }
        Ok(out.into_iter().map(|t| t.expect("every sequence embedded")).collect())
    }

    fn raw_scores<S: AsRef<str>, T: AsRef<str>>(
        &self,
        cands: &[S],
        refs: &[T],
        idf: Option<&IdfWeights>,
    ) -> Result<Vec<Score>> {
        let default_idf;
        let idf = match idf {
            Some(w) => w,
            None => {
                default_idf = self.no_idf();
                &default_idf
            }
        };
        // Embed each distinct token sequence once.
        let mut index: HashMap<Vec<u32>, usize> = HashMap::new();
        let mut seqs: Vec<Vec<u32>> = Vec::new();
        let mut slot = |ids: Vec<u32>| -> usize {
            *index.entry(ids.clone()).or_insert_with(|| {
                seqs.push(ids);
                seqs.len() - 1
            })
        };
        let mut pairs = Vec::with_capacity(cands.len());
        for (c, r) in cands.iter().zip(refs) {
            let (c, r) = (self.encode(c.as_ref())?, self.encode(r.as_ref())?);
            pairs.push((slot(c), slot(r)));
        }
        let embs = self.embed(&seqs)?;
        pairs
            .into_iter()
            .map(|(c, r)| greedy_match(&embs[c], &seqs[c], &embs[r], &seqs[r], idf))
            .collect()
    }
}

/// torch.max semantics: NaN wins.
fn nan_max(a: f64, b: f64) -> f64 {
    if a.is_nan() || b.is_nan() {
        f64::NAN
    } else {
        a.max(b)
    }
}

fn truncate(s: &str) -> String {
    s.chars().take(40).collect()
}

/// bert-score's `greedy_cos_idf` for one pair of unit-norm embeddings.
fn greedy_match(hyp: &Tensor, hyp_ids: &[u32], rf: &Tensor, ref_ids: &[u32], idf: &IdfWeights) -> Result<Score> {
    let sim: Vec<Vec<f32>> = hyp.matmul(&rf.t()?)?.to_device(&Device::Cpu)?.to_vec2()?;
    let weighted = |best: &mut dyn Iterator<Item = f32>, ids: &[u32]| -> f64 {
        let (mut num, mut den) = (0.0f64, 0.0f64);
        for (b, &id) in best.zip(ids) {
            let w = idf.get(id);
            num += w * b as f64;
            den += w;
        }
        num / den // 0/0 = NaN when every weight is 0, as in the package
    };
    let p = weighted(&mut sim.iter().map(|row| row.iter().copied().fold(f32::NEG_INFINITY, f32::max)), hyp_ids);
    let r = weighted(
        &mut (0..ref_ids.len()).map(|j| sim.iter().map(|row| row[j]).fold(f32::NEG_INFINITY, f32::max)),
        ref_ids,
    );
    // F from the unmasked P and R; then empty sides zero P and R, and NaN F becomes 0.
    let mut f = 2.0 * p * r / (p + r);
    let (mut p, mut r) = (p, r);
    if hyp_ids.len() == 2 || ref_ids.len() == 2 {
        p = 0.0;
        r = 0.0;
    }
    if f.is_nan() {
        f = 0.0;
    }
    Ok(Score { precision: p, recall: r, f1: f })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(rows: &[[f32; 2]]) -> Tensor {
        let flat: Vec<f32> = rows.iter().flatten().copied().collect();
        let t = Tensor::from_vec(flat, (rows.len(), 2), &Device::Cpu).unwrap();
        normalize_rows(&t).unwrap()
    }

    #[test]
    fn strip_like_python() {
        assert_eq!(py_strip("\u{1c} \t a b \u{a0}\n\u{1f}"), "a b");
        assert_eq!(py_strip("\u{200b}x"), "\u{200b}x"); // zero-width space is not whitespace
    }

    #[test]
    fn greedy_match_weights_and_empties() {
        let no_idf = IdfWeights { weights: HashMap::from([(0, 0.0), (2, 0.0)]), default: 1.0 };
        // hyp: [CLS, a, SEP]; ref: [CLS, a', b, SEP] with a' = a.
        let hyp = unit(&[[1.0, 1.0], [1.0, 0.0], [0.0, -1.0]]);
        let rf = unit(&[[1.0, 1.0], [1.0, 0.0], [0.0, 1.0], [0.0, -1.0]]);
        let s = greedy_match(&hyp, &[0, 5, 2], &rf, &[0, 5, 6, 2], &no_idf).unwrap();
        // P: token a matches a' exactly. R: a' -> 1, b -> best is CLS of hyp (cos 45°).
        let r = (1.0 + 0.5f64.sqrt()) / 2.0;
        assert!((s.precision - 1.0).abs() < 1e-6 && (s.recall - r).abs() < 1e-6);
        assert!((s.f1 - 2.0 * r / (1.0 + r)).abs() < 1e-6);
        // An empty side (only CLS, SEP) scores 0 everywhere.
        let empty = unit(&[[1.0, 1.0], [0.0, -1.0]]);
        let z = greedy_match(&empty, &[0, 2], &rf, &[0, 5, 6, 2], &no_idf).unwrap();
        assert_eq!((z.precision, z.recall, z.f1), (0.0, 0.0, 0.0));
        // All-zero idf on a non-empty hypothesis: P is NaN (0/0) and F falls back to 0, as in
        // the package.
        let zero = IdfWeights { weights: HashMap::new(), default: 0.0 };
        let n = greedy_match(&hyp, &[0, 5, 2], &rf, &[0, 5, 6, 2], &zero).unwrap();
        assert!(n.precision.is_nan() && n.f1 == 0.0);
    }

    #[test]
    fn rescale_formula() {
        let b = Baseline::new(0.8, 0.5, 0.6);
        let s = b.rescale(Score { precision: 0.9, recall: 0.5, f1: 0.6 });
        assert!((s.precision - 0.5).abs() < 1e-12 && s.recall == 0.0 && s.f1.abs() < 1e-12);
        assert!(nan_max(1.0, f64::NAN).is_nan() && nan_max(1.0, 2.0) == 2.0);
    }
}
