//! Qwen2-VL / Qwen2.5-VL on candle. Shared layers live in `layers`; families differ only in
//! which blocks `vision` picks and how `position` scales video time.

pub mod encoder;
pub mod kv;
pub mod layers;
pub mod position;
pub mod qwen_vl;
pub mod text;
pub mod vision;

pub use kv::{AttentionBackend, DenseKvCache};
pub use position::MediaGrid;
pub use qwen_vl::{QwenVl, VisionInput};
