//! The serving engine: one model, one paged KV-cache pool shared by every request, prefix
//! caching, continuous batching and constrained decoding (nano-vllm's shape: one concept per
//! file).
//!
//! - `request`: chat requests and their caller-side preparation.
//! - `sequence`: one request in flight.
//! - `block_manager`: which pool blocks each sequence owns; prefix-cache hashing and LRU.
//! - `kv_pool`: the K/V tensors of the attention layers (scatter writes, gathered reads).
//! - `paged_attention`: the model's `StepCache` over the pool for a packed step.
//! - `sampling`: every sequence of a step sampled with one read-back from the device
//!   (`ranking`: the head of a sampled row ranked there; `draw`: the seeded draw over it).
//! - `scheduler`: continuous batching with chunked prefill and preemption.
//! - `vision_cache`: encoded images by content hash.
//! - `constraint`: JSON-schema constrained decoding (llguidance).
//! - `error`: the typed error every public call returns.
//! - `engine`: ties them together; `handle`: a thread-safe front door with event streams.
// No tensor is read back to the host here except through `engine::sampling::read_back` or
// where a site says why its tensor is on the host (.clippy.toml; tests may read freely).
#![cfg_attr(not(test), warn(clippy::disallowed_methods))]

mod block_contents;
pub mod block_manager;
pub mod constraint;
#[allow(clippy::module_inception)]
pub mod engine;
pub mod error;
pub mod handle;
pub mod kv_pool;
pub mod kv_store;
pub mod paged_attention;
mod draw;
mod ranking;
pub mod request;
pub mod sampling;
pub mod scheduler;
pub mod sliding;
pub mod state_cache;
pub mod sequence;
pub mod vision_cache;

pub use engine::{Completion, Engine, EngineConfig, EngineStats, StepOutput, Times};
pub use error::{EngineError, EngineResult};
pub use handle::{EngineHandle, EngineThread, Event, RequestId, RequestStream, StreamEnded};
pub use kv_pool::{parse_bytes, KvMemory};
pub use kv_store::KvDtype;
pub use request::{ChatRequest, PreparedRequest, RequestPreparer};
pub use scheduler::SchedulerConfig;
