//! Errors as each API's clients expect them: OpenAI's `{"error": {"message", "type", "code"}}`
//! (also used by MERG's endpoint) or Ollama's `{"error": "..."}`, with the HTTP status that
//! says whose fault it is. Messages name the input and the limit.

use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

use crate::engine::EngineError;

/// Which API's error shape to answer in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Flavor {
    OpenAi,
    Ollama,
}

#[derive(Debug)]
pub struct ApiError {
    pub flavor: Flavor,
    pub status: u16,
    pub message: String,
}

impl ApiError {
    pub fn new(flavor: Flavor, status: u16, message: impl Into<String>) -> Self {
        ApiError { flavor, status, message: message.into() }
    }

    pub fn bad(flavor: Flavor, message: impl Into<String>) -> Self {
        Self::new(flavor, 400, message)
    }

    /// A sampling value against its rule (400), named by the field the client sent: Ollama's
    /// `options.top_p`, `options.num_predict`; OpenAI's `top_p`, `max_tokens`.
    pub fn setting(flavor: Flavor, e: crate::setting::InvalidSetting) -> Self {
        let field = match (flavor, e.name) {
            (Flavor::Ollama, "max_new_tokens") => "options.num_predict".to_string(),
            (Flavor::Ollama, name) => format!("options.{name}"),
            (Flavor::OpenAi, "max_new_tokens") => "max_tokens".to_string(),
            (Flavor::OpenAi, name) => name.to_string(),
        };
        Self::bad(flavor, format!("{field} must be {}, got {}", e.rule, e.value))
    }

    pub fn engine(flavor: Flavor, e: EngineError) -> Self {
        Self::new(flavor, e.status(), e.to_string())
    }

    /// The body as the flavor's clients parse it.
    pub fn body(&self) -> serde_json::Value {
        match self.flavor {
            Flavor::Ollama => json!({ "error": self.message }),
            Flavor::OpenAi => {
                let kind = match self.status {
                    401 => "authentication_error",
                    404 => "not_found_error",
                    429 => "rate_limit_error",
                    400..=499 => "invalid_request_error",
                    _ => "server_error",
                };
                json!({ "error": { "message": self.message, "type": kind, "code": self.status } })
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        tracing::info!(status = self.status, error = %self.message, "request refused");
        let mut resp = (status, axum::Json(self.body())).into_response();
        if matches!(self.status, 429 | 503) {
            resp.headers_mut().insert(header::RETRY_AFTER, header::HeaderValue::from_static("1"));
        }
        resp
    }
}

impl ApiError {
    /// 413 naming the body limit.
    pub fn too_large(flavor: Flavor, limit: usize) -> ApiError {
        ApiError::new(flavor, 413, format!("the request body exceeds the server's limit of {} bytes ({} MiB)", limit, limit >> 20))
    }
}
