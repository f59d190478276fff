//! Errors as OpenAI's APIs answer them: `{"error": {"message", "type",
//! "param", "code"}}` with the HTTP status that says what happened, and
//! `Retry-After` on a 429. Every error the gateway answers is built here,
//! from the request's checks, a fleet's `error` event or the client's
//! failure. No text here ever holds a key: the key is only hashed.

use std::time::Duration;

use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::{Value, json};
use toolfleet_protocol::client::ClientError;

/// An error answer in OpenAI's shape.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct ApiError {
    pub status: StatusCode,
    pub message: String,
    /// OpenAI's `type`: `invalid_request_error`, `requests`,
    /// `insufficient_quota`, `server_error`, `timeout`.
    pub kind: &'static str,
    pub code: Option<String>,
    pub param: Option<String>,
    /// `Retry-After` (whole seconds, rounded up) on a 429.
    pub retry_after: Option<Duration>,
}

/// When the fleet says nothing about it, a 429 asks for a retry after this.
const DEFAULT_RETRY_AFTER: Duration = Duration::from_secs(1);

impl ApiError {
    fn new(status: StatusCode, kind: &'static str, code: &str, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            kind,
            code: Some(code.to_string()),
            param: None,
            retry_after: None,
        }
    }

    /// 400: the request cannot be read or mapped onto a chat job.
    pub(crate) fn bad_request(param: Option<&str>, message: impl Into<String>) -> Self {
        let mut e = Self::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            "invalid_request",
            message,
        );
        e.param = param.map(str::to_string);
        e
    }

    /// 400 for a parameter value the fleet cannot honour.
    pub(crate) fn unsupported(param: &str, message: impl Into<String>) -> Self {
        let mut e = Self::bad_request(Some(param), message);
        e.code = Some("unsupported_parameter".into());
        e
    }

    /// 401: no key, a malformed one, or one the store does not know
    /// (revoked, expired, never made). The key is never repeated.
    pub(crate) fn invalid_key(missing: bool) -> Self {
        let message = if missing {
            "You didn't provide an API key. Send it in an Authorization header \
             using Bearer auth (Authorization: Bearer tf_…)."
        } else {
            "Incorrect API key provided. Keys are made with `toolfleet keys add`."
        };
        Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            "invalid_api_key",
            message,
        )
    }

    /// 404: no such profile (or none the key's tenant may use: another
    /// tenant's profiles are not revealed).
    pub(crate) fn model_not_found(model: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "model_not_found",
            format!("The model `{model}` does not exist or you do not have access to it."),
        );
        e.param = Some("model".into());
        e
    }

    /// 403: a profile of the key's tenant that this key may not use.
    pub(crate) fn model_not_allowed(model: &str) -> Self {
        let mut e = Self::new(
            StatusCode::FORBIDDEN,
            "invalid_request_error",
            "model_not_allowed",
            format!("This API key may not use the model `{model}`."),
        );
        e.param = Some("model".into());
        e
    }

    /// 404 for a path or a response id that is not there.
    pub(crate) fn not_found(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            "not_found",
            message,
        )
    }

    /// 413: the request (or a message of it) is larger than a chat job
    /// may be.
    pub(crate) fn too_large(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            "request_too_large",
            message,
        )
    }

    /// 503: NATS or the key store cannot be reached.
    pub(crate) fn unavailable(message: impl Into<String>) -> Self {
        Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "service_unavailable",
            message,
        )
    }

    /// 504: no answer within the gateway's time.
    pub(crate) fn timeout(after: Duration) -> Self {
        Self::new(
            StatusCode::GATEWAY_TIMEOUT,
            "timeout",
            "timeout",
            format!("The fleet did not answer within {} s.", after.as_secs()),
        )
    }

    fn too_many(kind: &'static str, code: &str, message: String, after: Option<Duration>) -> Self {
        let mut e = Self::new(StatusCode::TOO_MANY_REQUESTS, kind, code, message);
        e.retry_after = Some(after.unwrap_or(DEFAULT_RETRY_AFTER));
        e
    }

    /// The answer for a fleet's `error` event: its code decides the status
    /// (the table in docs/gateway.md); the message says the code.
    pub(crate) fn from_fleet(code: &str, message: &str, retry_after_ms: Option<u64>) -> Self {
        let text = format!("{message} ({code})");
        let after = retry_after_ms.map(Duration::from_millis);
        match code {
            "rate_limited" | "llm_http_429" => {
                Self::too_many("requests", "rate_limit_exceeded", text, after)
            }
            "budget_exhausted" => {
                Self::too_many("insufficient_quota", "insufficient_quota", text, after)
            }
            "queue_full" | "too_many_parked" | "tenant_suspended" => {
                Self::too_many("requests", code, text, after)
            }
            "unknown_profile" | "profile_not_allowed" => {
                let mut e = Self::new(
                    StatusCode::NOT_FOUND,
                    "invalid_request_error",
                    "model_not_found",
                    text,
                );
                e.param = Some("model".into());
                e
            }
            "data_source_not_allowed" => {
                Self::new(StatusCode::FORBIDDEN, "invalid_request_error", code, text)
            }
            "malformed_job" | "tenant_mismatch" | "invalid_tool_selection" | "invalid_sink" => {
                Self::new(StatusCode::BAD_REQUEST, "invalid_request_error", code, text)
            }
            "deadline_exceeded" => Self::new(StatusCode::GATEWAY_TIMEOUT, "timeout", code, text),
            c if c.starts_with("llm_") || c == "no_deployment" => {
                Self::new(StatusCode::BAD_GATEWAY, "server_error", code, text)
            }
            _ => Self::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                code,
                text,
            ),
        }
    }

    /// The answer when submitting or following the job failed on the
    /// gateway's side (an `error` event is [`ApiError::from_fleet`]).
    pub(crate) fn from_client(e: &ClientError, timeout: Duration) -> Self {
        match e {
            ClientError::Timeout(_) => Self::timeout(timeout),
            ClientError::JobTooLarge { .. } => Self::too_large(e.to_string()),
            ClientError::QueueFull(_) => {
                Self::too_many("requests", "queue_full", e.to_string(), None)
            }
            ClientError::Failed { code, message } => Self::from_fleet(code, message, None),
            ClientError::Nats(_) | ClientError::Rejected(_) => Self::unavailable(format!(
                "The fleet cannot take the request now ({e}); try again shortly."
            )),
        }
    }

    /// The `error` object itself (streams carry it without the wrapper
    /// status).
    pub(crate) fn object(&self) -> Value {
        json!({
            "message": self.message,
            "type": self.kind,
            "param": self.param,
            "code": self.code,
        })
    }

    /// The response body: `{"error": {...}}`.
    pub(crate) fn body(&self) -> Value {
        json!({ "error": self.object() })
    }

    /// Whole seconds, rounded up, at least 1.
    pub(crate) fn retry_after_secs(&self) -> Option<u64> {
        self.retry_after
            .map(|d| d.as_millis().div_ceil(1000).max(1))
            .map(|s| u64::try_from(s).unwrap_or(u64::MAX))
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after_secs() {
            response
                .headers_mut()
                .insert("retry-after", HeaderValue::from(secs));
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fleet_codes_get_their_status_and_a_retry_after() {
        let e = ApiError::from_fleet("rate_limited", "slow down", Some(1500));
        assert_eq!(e.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(e.retry_after_secs(), Some(2));
        assert_eq!(e.code.as_deref(), Some("rate_limit_exceeded"));
        let e = ApiError::from_fleet("budget_exhausted", "spent", None);
        assert_eq!(
            (e.status, e.kind, e.retry_after_secs()),
            (StatusCode::TOO_MANY_REQUESTS, "insufficient_quota", Some(1))
        );
        for (code, status) in [
            ("unknown_profile", StatusCode::NOT_FOUND),
            ("deadline_exceeded", StatusCode::GATEWAY_TIMEOUT),
            ("llm_http_503", StatusCode::BAD_GATEWAY),
            ("round_limit", StatusCode::INTERNAL_SERVER_ERROR),
            ("malformed_job", StatusCode::BAD_REQUEST),
        ] {
            assert_eq!(
                ApiError::from_fleet(code, "m", None).status,
                status,
                "{code}"
            );
        }
        let body = ApiError::invalid_key(false).body();
        assert_eq!(body["error"]["code"], "invalid_api_key");
        assert!(body["error"]["param"].is_null());
    }
}
