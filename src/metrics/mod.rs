//! Classic evaluation metrics of generated empathetic replies (see docs/EVALUATION.md for the
//! exact definitions): emotion classification scores, Distinct-n, VADER sentiment polarity and
//! perplexity from the engine's token log-probabilities.

pub mod classification;
pub mod distinct;
pub mod ppl;
pub mod sentiment;
