//! The engine's typed error: what a library caller needs to decide (fix the request, retry
//! later or with more memory, or report a bug), with a message that names the input and the
//! problem. Messages never name command-line flags: a CLI adds its own hints.

use crate::models::ModelSpec;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum EngineError {
    /// The request itself is wrong: bad media, bad schema, bad sampling values, too long for
    /// the context window. Retrying it unchanged fails again.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The request is valid but does not fit this engine's KV memory.
    #[error("over capacity: {0}")]
    OverCapacity(String),
    /// The engine was shut down before the request finished.
    #[error("the engine has shut down")]
    ShutDown,
    /// A failure inside the engine or the model (a step failed); every request in flight gets it.
    #[error("internal error: {0}")]
    Internal(String),
}

impl EngineError {
    pub fn bad(e: impl std::fmt::Display) -> Self {
        EngineError::BadRequest(e.to_string())
    }

    /// From an `anyhow` chain: the whole chain, as `{:#}` prints it.
    pub fn bad_request(e: anyhow::Error) -> Self {
        EngineError::BadRequest(format!("{e:#}"))
    }

    pub fn internal(e: anyhow::Error) -> Self {
        EngineError::Internal(format!("{e:#}"))
    }

    /// An HTTP-like status a server can answer with.
    pub fn status(&self) -> u16 {
        match self {
            EngineError::BadRequest(_) => 400,
            EngineError::OverCapacity(_) => 413,
            EngineError::ShutDown => 503,
            EngineError::Internal(_) => 500,
        }
    }
}

pub type EngineResult<T> = std::result::Result<T, EngineError>;

/// Pool size in the error's words (used when a request cannot fit even alone).
pub(crate) fn too_big(needed: usize, blocks: usize, prompt: usize, spec: &ModelSpec) -> EngineError {
    // Sliding-window layers keep a window's worth whatever the prompt: the global ones decide.
    let layers = match spec.num_sliding_layers() {
        0 => format!("{} attention layers", spec.num_attention_layers()),
        n => format!("{} global attention layers; the {n} sliding-window ones keep a window's worth", spec.num_global_layers()),
    };
    EngineError::OverCapacity(format!(
        "the request needs {needed} KV blocks for its {prompt}-token prompt but the pool holds {blocks} \
         ({layers}); give the engine more KV memory or shorten the prompt"
    ))
}
