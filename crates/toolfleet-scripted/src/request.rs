//! Reading a request, in what both API shapes share: an OpenAI-shaped
//! error ([`ApiError`]), the checks every model request gets first, and the
//! [`Turn`]s both shapes reduce a conversation to. The shape-specific
//! reading is in `chat` and `responses`.
//!
//! # Request checks
//!
//! Like OpenAI, the server answers 400 with `{"error":{"message","type":
//! "invalid_request_error","param","code"}}` to a body that is not JSON
//! (`invalid_json`), a missing `model` or `messages` / `input`
//! (`missing_required_parameter`), empty `messages` / `input`
//! (`empty_array`), an unknown role or input item type (`invalid_value`),
//! a tool result that answers no preceding tool call, or a tool call left
//! without a result (code `null`). `POST /v1/responses` has a few checks of
//! its own (see `responses`).
//!
//! Being as strict as the real API catches conversation bugs in tests
//! rather than in production.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{Map, Value, json};

/// An OpenAI-shaped error response.
#[derive(Debug, PartialEq)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) message: String,
    pub(crate) param: Option<String>,
    pub(crate) code: Option<&'static str>,
}

impl ApiError {
    pub(crate) fn invalid(
        message: impl Into<String>,
        param: Option<&str>,
        code: Option<&'static str>,
    ) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: param.map(str::to_owned),
            code,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({"error": {
            "message": self.message,
            "type": "invalid_request_error",
            "param": self.param,
            "code": self.code,
        }});
        (self.status, axum::Json(body)).into_response()
    }
}

/// One message of a request, reduced to what the script needs.
#[derive(Debug)]
pub(crate) struct Turn {
    pub(crate) role: String,
    pub(crate) text: String,
    /// `(id, function name)` of an assistant message's tool calls.
    pub(crate) calls: Vec<(String, String)>,
    /// A tool message's `tool_call_id`.
    pub(crate) call_id: Option<String>,
}

impl Turn {
    /// A turn of plain text: no calls, answering none.
    pub(crate) fn text(role: &str, text: String) -> Self {
        Self {
            role: role.to_owned(),
            text,
            calls: Vec::new(),
            call_id: None,
        }
    }
}

/// Message content is a string or, in the newer shape, a list of parts.
pub(crate) fn content_text(content: Option<&Value>) -> String {
    match content {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// The checks every model request gets first: the body is a JSON object
/// and names a `model`.
pub(crate) fn request_object(body: &Value) -> Result<&Map<String, Value>, ApiError> {
    let Some(object) = body.as_object() else {
        return Err(ApiError::invalid(
            "The request body must be a JSON object.",
            None,
            Some("invalid_json"),
        ));
    };
    if !object.get("model").is_some_and(Value::is_string) {
        return Err(ApiError::invalid(
            "Missing required parameter: 'model'.",
            Some("model"),
            Some("missing_required_parameter"),
        ));
    }
    Ok(object)
}
