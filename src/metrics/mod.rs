//! Evaluation metrics of generated empathetic replies (exact definitions in
//! docs/EVALUATION.md): emotion classification scores, Distinct-n, VADER sentiment polarity,
//! perplexity from the engine's token log-probabilities, BERTScore, and the classifier-based
//! emotion polarity / empathy score.

pub mod bertscore;
pub mod classification;
pub mod distinct;
/// The BERT-family encoder the metrics run (not a generation model: no engine, no cache).
pub mod encoder;
pub mod polarity;
pub mod ppl;
pub mod sentiment;
