//! merg: an in-process inference engine for multimodal empathetic response generation.
//!
//! Layers, bottom up (see docs/ARCHITECTURE.md):
//! - `hub`, `weights`: find a checkpoint (HF hub cache or local dir) and its weight source.
//! - `layers`, `models`: shared blocks and the model families behind the `Model` trait,
//!   found by `model_type` in `models::registry`.
//! - `tokenizer`, `chat`, `vision`, `processor`: chat requests into tokens (special tokens only
//!   from the template) and HF-equal media patches.
//! - `checkpoint`: a loaded model plus its processor.
//! - `engine`: one paged KV pool, prefix cache, continuous batching, JSON constraints, and a
//!   thread-safe handle with event streams and abort.
//! - `pipeline`: the five MERG agents on top of the engine; `data`, `metrics`, `eval`, `report`.
//!
//! Another program answers a chat with images like this (a tiny random checkpoint here, so
//! the reply is noise):
//!
//! ```
//! use merg::{ChatRequest, Checkpoint, ContentPart, Engine, EngineConfig, EngineThread, Event, KvMemory, Media, Message, SamplingParams};
//!
//! # fn main() -> anyhow::Result<()> {
//! let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/tiny-qwen2_5-vl");
//! let files = merg::hub::resolve(dir, None)?; // or a hub repo id such as "Qwen/Qwen2.5-VL-7B-Instruct"
//! let ckpt = Checkpoint::load(files, &merg::parse_device("cpu")?, None)?;
//! let engine = Engine::new(ckpt, EngineConfig { kv_memory: KvMemory::Blocks(64), ..Default::default() })?;
//! let thread = EngineThread::spawn(engine);
//!
//! let face = image::RgbImage::from_fn(64, 48, |x, y| image::Rgb([x as u8 * 3, y as u8 * 5, 128]));
//! let messages = vec![Message::new("user", vec![ContentPart::Image, ContentPart::Text("How does she feel?".into())])];
//! let sampling = SamplingParams { max_new_tokens: 8, ..Default::default() };
//! let stream = thread.handle.submit(ChatRequest::new(messages, vec![Media::Image(face)], sampling))?;
//! let mut streamed = 0;
//! for event in stream {
//!     match event {
//!         Event::Token { .. } => streamed += 1,
//!         Event::Finished(reply) => {
//!             assert_eq!(reply.tokens.len(), streamed);
//!             println!("{} ({} prompt tokens)", reply.text, reply.prompt_tokens);
//!         }
//!         Event::Error(e) => return Err(e.into()),
//!     }
//! }
//! # Ok(())
//! # }
//! ```

pub mod audio;
pub mod bench;
pub mod chat;
pub mod checkpoint;
pub mod cpu;
pub mod data;
pub mod dialogue;
pub mod engine;
pub mod eval;
pub mod generate;
pub mod gguf;
pub mod hub;
pub mod input;
pub mod layers;
pub mod metrics;
pub mod memory;
pub mod models;
pub mod pipeline;
pub mod plan;
pub mod processor;
pub mod progress;
pub mod report;
/// The HTTP server behind `merg serve` (the `serve` feature, on by default).
#[cfg(feature = "serve")]
pub mod serve;
pub mod setting;
/// Seeded random tensors for tests (unit and integration); not part of the API.
#[doc(hidden)]
pub mod testing;
pub mod tokenizer;
pub mod vision;
pub mod weights;

pub use chat::{ContentPart, Message};
pub use checkpoint::{parse_device, Checkpoint};
pub use engine::{
    ChatRequest, Completion, Engine, EngineConfig, EngineError, EngineHandle, EngineThread, Event, KvMemory, RequestStream,
};
pub use generate::{FinishReason, SamplingParams};
pub use models::{Model, ModelSpec};
pub use setting::InvalidSetting;
pub use vision::Media;
