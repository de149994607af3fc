//! Request bodies: read under the server's `max_body_bytes` and `body_read_timeout`
//! (`RequestBody`, the extractor every POST handler takes), then parsed as the endpoint's JSON
//! with errors naming the failing field (`parse_json`, which the fuzz target calls too).

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{FromRequest, Request};
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use super::ops::flavor_of;
use super::{ApiError, AppState, Flavor};

/// The whole request body. Refused with 413 over `max_body_bytes` and 408 when it has not all
/// arrived within `body_read_timeout` of the handler starting to read it; either way hyper
/// then closes the connection, as the rest of the body is never read.
pub struct RequestBody(pub Bytes);

impl FromRequest<Arc<AppState>> for RequestBody {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
        let flavor = flavor_of(req.uri().path());
        let limits = &state.cfg.limits;
        match tokio::time::timeout(limits.body_read_timeout, Bytes::from_request(req, state)).await {
            Ok(Ok(bytes)) => Ok(RequestBody(bytes)),
            Ok(Err(e)) => Err(rejected(flavor, e, limits.max_body_bytes)),
            Err(_) => Err(timed_out(flavor, limits.body_read_timeout.as_secs_f64())),
        }
    }
}

fn timed_out(flavor: Flavor, secs: f64) -> ApiError {
    ApiError::new(flavor, 408, format!("the request body did not arrive within the server's body_read_timeout of {secs} s"))
}

/// 413 naming the limit, or the status axum gives a body it could not read.
fn rejected(flavor: Flavor, e: BytesRejection, limit: usize) -> ApiError {
    match e.status() {
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::too_large(flavor, limit),
        s => ApiError::new(flavor, s.as_u16(), format!("could not read the request body: {}", e.body_text())),
    }
}

/// The body as `T`: 400 naming the field and the problem when it is not the JSON the
/// endpoint takes.
pub fn parse_json<T: DeserializeOwned>(flavor: Flavor, bytes: &[u8]) -> Result<T, ApiError> {
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        if inner.is_syntax() || inner.is_eof() || path == "." || path.is_empty() {
            ApiError::bad(flavor, format!("request body is not valid JSON for this endpoint: {inner}"))
        } else {
            ApiError::bad(flavor, format!("request body, field {path}: {inner}"))
        }
    })
}
