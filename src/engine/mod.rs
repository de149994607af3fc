//! The serving engine: one model, one paged KV-cache pool shared by every request, prefix
//! caching, continuous batching and constrained decoding (nano-vllm's shape: one concept per
//! file).

pub mod block_manager;
pub mod constraint;
