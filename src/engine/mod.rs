//! The serving engine: one model, one paged KV-cache pool shared by every request, prefix
//! caching, continuous batching and constrained decoding (nano-vllm's shape: one concept per
//! file).
//!
//! - `sequence`: one request in flight.
//! - `block_manager`: which pool blocks each sequence owns; prefix-cache hashing and LRU.
//! - `kv_pool`: the K/V tensors themselves (scatter writes, gathered reads).
//! - `paged_attention`: the model's `AttentionBackend` over the pool for a packed step.
//! - `scheduler`: continuous batching with chunked prefill and preemption.
//! - `vision_cache`: encoded images by content hash.
//! - `constraint`: JSON-schema constrained decoding (llguidance).
//! - `engine`: ties them together; `handle`: a thread-safe front door.

pub mod block_manager;
pub mod constraint;
#[allow(clippy::module_inception)]
pub mod engine;
pub mod handle;
pub mod kv_pool;
pub mod paged_attention;
pub mod scheduler;
pub mod sequence;
pub mod vision_cache;

pub use engine::{ChatRequest, Completion, Engine, EngineConfig, EngineStats};
pub use handle::{EngineHandle, EngineThread};
pub use kv_pool::KvMemory;
