//! merg: an in-process inference engine for multimodal empathetic response generation.
//!
//! Layers, bottom up (see docs/ARCHITECTURE.md):
//! - `hub`, `config`, `weights`: find a checkpoint (HF hub cache or local dir) and load it.
//! - `tokenizer`, `chat`: token ids from chat messages, special tokens only from the template.
//! - `vision`: HF-equal image/video preprocessing into patch grids.
//! - `models`: Qwen2-VL / Qwen2.5-VL written on candle, K/V behind a small cache interface.
//! - `generate`: sampling, stop tokens, log-probabilities.

pub mod bench;
pub mod chat;
pub mod config;
pub mod data;
pub mod dialogue;
pub mod engine;
pub mod eval;
pub mod generate;
pub mod pipeline;
pub mod hub;
pub mod metrics;
pub mod models;
pub mod report;
pub mod runtime;

pub mod tokenizer;
pub mod vision;
pub mod weights;
