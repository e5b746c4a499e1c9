//! Error answers: a status, a fixed machine-readable code and a human message, as JSON.
//!
//! Invariants:
//! - Every non-2xx answer of the webhook listener has a JSON body `{"error", "message"}`.
//! - 401 answers carry no detail: the reason is logged and counted, not sent; their
//!   `WWW-Authenticate` challenge names the scheme expected, nothing more.
//! - 503 answers carry `Retry-After`.
//! - An answer given before its request's body was read to the end says
//!   `Connection: close` ([`ApiError::closing`]): hyper closes such a connection after
//!   the answer (it cannot find the next request), and a client that pools connections
//!   must know not to send another on it.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde_json::json;

#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    /// Fixed code, also the metrics reason.
    pub code: &'static str,
    pub message: String,
    pub retry_after_secs: Option<u64>,
    /// The `WWW-Authenticate` challenge of a 401: its scheme and realm.
    pub challenge: Option<(&'static str, &'static str)>,
    /// The answer closes the connection (`Connection: close`).
    pub closes: bool,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, code, message: message.into(), retry_after_secs: None, challenge: None, closes: false }
    }

    /// This answer, closing the connection: for an answer given while the request's
    /// body is not read to the end.
    pub fn closing(self) -> ApiError {
        ApiError { closes: true, ..self }
    }

    /// A 401 with a challenge of `scheme` in `realm` (RFC 9110: a 401 names at least
    /// one) and no detail.
    pub fn unauthorized(scheme: &'static str, realm: &'static str) -> ApiError {
        ApiError {
            challenge: Some((scheme, realm)),
            ..ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "authentication failed")
        }
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }

    /// 405: the path exists but does not take this method (axum adds `Allow`).
    pub fn method_not_allowed() -> ApiError {
        ApiError::new(StatusCode::METHOD_NOT_ALLOWED, "method_not_allowed", "method not allowed on this path")
    }

    pub fn unavailable(code: &'static str, message: impl Into<String>, retry_after_secs: u64) -> ApiError {
        ApiError {
            retry_after_secs: Some(retry_after_secs),
            ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, code, message)
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, Json(json!({ "error": self.code, "message": self.message }))).into_response();
        if let Some(secs) = self.retry_after_secs {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        // Both parts are the daemon's own names: a valid header value.
        if let Some((scheme, realm)) = self.challenge
            && let Ok(v) = HeaderValue::try_from(format!("{scheme} realm=\"{realm}\""))
        {
            resp.headers_mut().insert(header::WWW_AUTHENTICATE, v);
        }
        if self.closes {
            resp.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
        resp
    }
}
