//! Emotion polarity and empathy, as in the ImageBind-MLLM MERG seed paper's evaluation
//! (reference notebook jiwon-hae/EmpatheticMLLM).
//!
//! A DistilBERT emotion classifier (`bhadresh-savani/distilbert-base-uncased-emotion`: sadness,
//! joy, love, anger, fear, surprise) gives a probability distribution per text. The emotion
//! polarity of a reply is the cosine between its distribution and the mean distribution of the
//! dialogue-history utterances (0 for an empty history); empathy is the mean of the emotion
//! polarity and a sentiment polarity computed elsewhere (VADER).
//!
//! Texts are tokenised like the transformers text-classification pipeline (fast tokenizer,
//! special tokens added, nothing stripped) and truncated to 512 tokens (`truncation=True`; the
//! pipeline without it would fail on longer texts, the model has 512 positions).

use anyhow::{anyhow, bail, Context, Result};
use candle_core::{Device, Tensor};

use crate::metrics::encoder::{EncoderCheckpoint, ClassifierHead, Encoder};

pub const DEFAULT_EMOTION_MODEL: &str = "bhadresh-savani/distilbert-base-uncased-emotion";
/// Texts longer than this many tokens (special tokens included) are truncated.
pub const MAX_TOKENS: usize = 512;

pub struct EmotionClassifier {
    model: String,
    encoder: Encoder,
    head: ClassifierHead,
    tokenizer: tokenizers::Tokenizer,
    labels: Vec<String>,
    batch_size: usize,
}

impl EmotionClassifier {
    /// Loads a DistilBERT sequence classifier (local directory or hub id, with tokenizer.json
    /// and model.safetensors); the labels come from its config's id2label.
    pub fn load(model: &str, device: &Device) -> Result<Self> {
        let ck = EncoderCheckpoint::load(model, device)?;
        let cfg = &ck.config;
        let encoder = Encoder::load(cfg, None, ck.base_vb()?).with_context(|| format!("loading encoder of {model}"))?;
        let head = ClassifierHead::load(cfg, ck.vb.clone()).with_context(|| format!("emotion classifier {model}"))?;
        let max_len = ck.model_max_length().unwrap_or(MAX_TOKENS).min(MAX_TOKENS).min(cfg.max_input_len());
        let tokenizer = ck.tokenizer(max_len)?;
        Ok(Self { model: model.to_string(), encoder, head, tokenizer, labels: cfg.labels.clone(), batch_size: 32 })
    }

    pub fn labels(&self) -> &[String] {
        &self.labels
    }

    /// Texts per forward pass (results do not depend on it beyond float rounding).
    pub fn set_batch_size(&mut self, n: usize) {
        self.batch_size = n.max(1);
    }

    /// Token ids as the classifier sees them (truncated to [`MAX_TOKENS`]).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| anyhow!("tokenizing a text for {}: {e}", self.model))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Raw classifier logits, one row of `labels().len()` per text.
    pub fn logits<S: AsRef<str>>(&self, texts: &[S]) -> Result<Vec<Vec<f32>>> {
        let ids = texts.iter().map(|t| self.encode(t.as_ref())).collect::<Result<Vec<_>>>()?;
        let mut out = Vec::with_capacity(ids.len());
        for chunk in ids.chunks(self.batch_size) {
            let batch: Vec<&[u32]> = chunk.iter().map(Vec::as_slice).collect();
            let hs = self.encoder.hidden_states(&batch, self.encoder.loaded_layers())?;
            let logits: Tensor = self.head.forward(&hs)?;
            out.extend(logits.to_device(&Device::Cpu)?.to_vec2::<f32>()?);
        }
        Ok(out)
    }

    /// Softmax of the logits: one emotion distribution per text.
    pub fn probabilities<S: AsRef<str>>(&self, texts: &[S]) -> Result<Vec<Vec<f64>>> {
        Ok(self.logits(texts)?.iter().map(|l| softmax(l)).collect())
    }

    /// cosine(p(reply), mean over `history` of p(utterance)); 0 when `history` is empty.
    pub fn emotion_polarity<S: AsRef<str>>(&self, reply: &str, history: &[S]) -> Result<f64> {
        if history.is_empty() {
            return Ok(0.0);
        }
        let mut texts: Vec<&str> = vec![reply];
        texts.extend(history.iter().map(|h| h.as_ref()));
        let probs = self.probabilities(&texts)?;
        emotion_polarity_from_probs(&probs[0], &probs[1..])
    }
}

fn softmax(logits: &[f32]) -> Vec<f64> {
    let m = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let e: Vec<f64> = logits.iter().map(|&x| (x as f64 - m).exp()).collect();
    let s: f64 = e.iter().sum();
    e.into_iter().map(|x| x / s).collect()
}

/// The polarity formula on precomputed distributions; 0 for an empty history.
pub fn emotion_polarity_from_probs(reply: &[f64], history: &[Vec<f64>]) -> Result<f64> {
    if history.is_empty() {
        return Ok(0.0);
    }
    if let Some(h) = history.iter().find(|h| h.len() != reply.len()) {
        bail!("emotion distributions of different sizes: {} and {}", reply.len(), h.len());
    }
    let n = history.len() as f64;
    let mean: Vec<f64> = (0..reply.len()).map(|k| history.iter().map(|h| h[k]).sum::<f64>() / n).collect();
    let dot: f64 = reply.iter().zip(&mean).map(|(a, b)| a * b).sum();
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let denom = norm(reply) * norm(&mean);
    if denom == 0.0 {
        bail!("emotion polarity of an all-zero distribution is undefined");
    }
    Ok(dot / denom)
}

/// Empathy score: the mean of the emotion polarity and the sentiment polarity.
pub fn empathy(emotion_polarity: f64, sentiment_polarity: f64) -> f64 {
    (emotion_polarity + sentiment_polarity) / 2.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn polarity_formula() {
        let a = vec![0.7, 0.2, 0.1];
        // Identical distributions: cosine 1.
        assert!((emotion_polarity_from_probs(&a, &[a.clone(), a.clone()]).unwrap() - 1.0).abs() < 1e-12);
        // Orthogonal: 0; the mean of the history is what is compared.
        let x = vec![1.0, 0.0, 0.0];
        let hist = vec![vec![0.0, 1.0, 0.0], vec![0.0, 0.0, 1.0]];
        assert!(emotion_polarity_from_probs(&x, &hist).unwrap().abs() < 1e-12);
        let y = vec![0.0, 1.0, 1.0];
        let want = 1.0 / 2f64.sqrt();
        assert!((emotion_polarity_from_probs(&y, &[vec![0.0, 1.0, 0.0]]).unwrap() - want).abs() < 1e-12);
        assert_eq!(emotion_polarity_from_probs(&a, &[]).unwrap(), 0.0);
        assert!(emotion_polarity_from_probs(&a, &[vec![1.0]]).is_err());
        assert!(emotion_polarity_from_probs(&[0.0, 0.0], &[vec![1.0, 0.0]]).is_err());
        assert_eq!(empathy(0.5, -0.25), 0.125);
    }

    #[test]
    fn softmax_is_stable() {
        let p = softmax(&[1000.0, 1000.0, f32::MIN]);
        assert!((p[0] - 0.5).abs() < 1e-12 && (p[1] - 0.5).abs() < 1e-12 && p[2] == 0.0);
    }
}
