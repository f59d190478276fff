//! The one error type of the `llm` module: a small `Clone + PartialEq` kind
//! that callers match on, a stable short code for logs and metric labels,
//! and a human message that never carries the request or the API key.

use std::time::Duration;

/// What went wrong talking to the model provider. Callers decide retry or
/// give-up on this, never on the message text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LlmErrorKind {
    /// The connection could not be made, or was lost before the response
    /// was complete (a stream cut short counts here: nothing is wrong with
    /// the request, so trying again is the right answer).
    Connect,
    /// No first token within `first_token_timeout`, or a gap between chunks
    /// longer than `idle_timeout`.
    Timeout,
    /// The provider answered with a non-2xx status. `code` is the provider's
    /// `error.code` (or `error.type`) from the JSON body, when there was one.
    Status { status: u16, code: Option<String> },
    /// The provider reported an error object inside a 2xx response, usually
    /// mid-stream.
    Provider { code: Option<String> },
    /// The response could not be understood (bad JSON, broken SSE framing,
    /// a tool call without a name), or the client was configured with
    /// something it cannot use.
    Protocol,
}

/// An error from [`LlmClient`](super::LlmClient) or the stream decoders.
///
/// The message is built by this module from parts it controls, so it never
/// contains the request body, the URL or the API key.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct LlmError {
    kind: LlmErrorKind,
    code: String,
    message: String,
    retry_after: Option<Duration>,
    /// HTTP requests made for the call that ended in this error, retries
    /// included.
    attempts: u32,
}

/// Provider error codes that describe a condition which will not go away by
/// itself: a 429 carrying one of these is not worth retrying.
const PERMANENT_CODES: &[&str] = &["insufficient_quota", "billing_hard_limit_reached"];

/// Provider error codes sent inside a 2xx stream that are transient.
const TRANSIENT_PROVIDER_CODES: &[&str] = &[
    "server_error",
    "rate_limit_exceeded",
    "overloaded_error",
    "service_unavailable",
];

/// Longest code we keep from a provider, so a misbehaving server cannot put
/// unbounded text into a metric label.
const MAX_CODE_LEN: usize = 48;

impl LlmError {
    pub(crate) fn connect(message: impl Into<String>) -> Self {
        Self::new(LlmErrorKind::Connect, "connect", message)
    }

    /// Whether the call lost a connection it had (not one it could not
    /// open): that connection is not to be used again.
    pub(crate) fn lost_its_connection(&self) -> bool {
        self.code() == "connection_lost"
    }

    /// A response that started but did not finish: the connection dropped or
    /// the body ended before the model said it was done.
    pub(crate) fn connection_lost(message: impl Into<String>) -> Self {
        Self::new(LlmErrorKind::Connect, "connection_lost", message)
    }

    pub(crate) fn timeout(message: impl Into<String>) -> Self {
        Self::new(LlmErrorKind::Timeout, "timeout", message)
    }

    pub(crate) fn protocol(message: impl Into<String>) -> Self {
        Self::new(LlmErrorKind::Protocol, "protocol", message)
    }

    pub(crate) fn config(message: impl Into<String>) -> Self {
        Self::new(LlmErrorKind::Protocol, "config", message)
    }

    pub(crate) fn status(status: u16, code: Option<String>, message: impl Into<String>) -> Self {
        let code = code.map(|c| sanitize_code(&c)).filter(|c| !c.is_empty());
        let short = code.clone().unwrap_or_else(|| format!("http_{status}"));
        Self::new(LlmErrorKind::Status { status, code }, short, message)
    }

    pub(crate) fn provider(code: Option<String>, message: impl Into<String>) -> Self {
        let code = code.map(|c| sanitize_code(&c)).filter(|c| !c.is_empty());
        let short = code.clone().unwrap_or_else(|| "provider".to_owned());
        Self::new(LlmErrorKind::Provider { code }, short, message)
    }

    fn new(kind: LlmErrorKind, code: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            kind,
            code: code.into(),
            message: message.into(),
            retry_after: None,
            attempts: 1,
        }
    }

    pub(crate) fn with_attempts(mut self, attempts: u32) -> Self {
        self.attempts = attempts;
        self
    }

    pub(crate) fn with_retry_after(mut self, retry_after: Option<Duration>) -> Self {
        self.retry_after = retry_after;
        self
    }

    /// Removes every occurrence of `secret` from the message. The message is
    /// built from our own text plus provider-supplied error text, and a
    /// provider may echo what it was sent.
    pub(crate) fn redact(mut self, secret: Option<&str>) -> Self {
        if let Some(secret) = secret.filter(|s| !s.is_empty())
            && self.message.contains(secret)
        {
            self.message = self.message.replace(secret, "[redacted]");
        }
        self
    }

    /// The kind, for callers to match on.
    pub fn kind(&self) -> &LlmErrorKind {
        &self.kind
    }

    /// A stable short code for logs and metric labels: `connect`,
    /// `connection_lost`, `timeout`, `protocol`, `config`, `http_<status>`,
    /// or the provider's own code (such as `insufficient_quota`), lower-cased
    /// and limited to `[a-z0-9_]`.
    pub fn code(&self) -> &str {
        &self.code
    }

    /// How long the provider asked us to wait (`Retry-After` /
    /// `retry-after-ms`), when it said.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }

    /// How many HTTP requests the call made before giving up with this
    /// error, retries included (1 when it was not retried). For metrics.
    pub fn attempts(&self) -> u32 {
        self.attempts
    }

    /// Whether the same request may succeed if sent again: connection
    /// failures, timeouts, 429 and 5xx. A 429 whose code says the account is
    /// out of quota is not retryable: waiting will not refill it.
    pub fn is_retryable(&self) -> bool {
        match &self.kind {
            LlmErrorKind::Connect | LlmErrorKind::Timeout => true,
            LlmErrorKind::Status { status, code } => {
                let permanent = code
                    .as_deref()
                    .is_some_and(|c| PERMANENT_CODES.contains(&c));
                (*status == 429 && !permanent) || (500..=599).contains(status)
            }
            LlmErrorKind::Provider { code } => code
                .as_deref()
                .is_some_and(|c| TRANSIENT_PROVIDER_CODES.contains(&c)),
            LlmErrorKind::Protocol => false,
        }
    }
}

/// Lower-cases and keeps only `[a-z0-9_]` (other characters become `_`),
/// bounded in length: provider codes end up in metric labels.
fn sanitize_code(raw: &str) -> String {
    raw.trim()
        .chars()
        .take(MAX_CODE_LEN)
        .map(|c| {
            let c = c.to_ascii_lowercase();
            if c.is_ascii_alphanumeric() || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn retryable_follows_kind_and_status() {
        assert!(LlmError::connect("x").is_retryable());
        assert!(LlmError::connection_lost("x").is_retryable());
        assert!(LlmError::timeout("x").is_retryable());
        assert!(LlmError::status(429, None, "x").is_retryable());
        assert!(LlmError::status(429, Some("rate_limit_exceeded".into()), "x").is_retryable());
        assert!(LlmError::status(500, None, "x").is_retryable());
        assert!(LlmError::status(503, Some("server_error".into()), "x").is_retryable());
        assert!(!LlmError::status(429, Some("insufficient_quota".into()), "x").is_retryable());
        assert!(!LlmError::status(400, None, "x").is_retryable());
        assert!(!LlmError::status(401, Some("invalid_api_key".into()), "x").is_retryable());
        assert!(!LlmError::protocol("x").is_retryable());
        assert!(LlmError::provider(Some("server_error".into()), "x").is_retryable());
        assert!(!LlmError::provider(Some("insufficient_quota".into()), "x").is_retryable());
        assert!(!LlmError::provider(None, "x").is_retryable());
    }

    #[test]
    fn codes_are_short_and_stable() {
        assert_eq!(LlmError::connect("x").code(), "connect");
        assert_eq!(LlmError::timeout("x").code(), "timeout");
        assert_eq!(LlmError::protocol("x").code(), "protocol");
        assert_eq!(LlmError::status(429, None, "x").code(), "http_429");
        assert_eq!(
            LlmError::status(429, Some("insufficient_quota".into()), "x").code(),
            "insufficient_quota"
        );
        assert_eq!(LlmError::provider(None, "x").code(), "provider");
        let weird = LlmError::provider(Some(format!("Bad Code!{}", "x".repeat(200))), "x");
        assert!(weird.code().starts_with("bad_code_"));
        assert_eq!(weird.code().len(), MAX_CODE_LEN);
        assert_eq!(
            weird.kind(),
            &LlmErrorKind::Provider {
                code: Some(weird.code().to_owned())
            }
        );
        assert_eq!(
            LlmError::status(500, Some("  ".into()), "x").code(),
            "http_500"
        );
    }

    #[test]
    fn redact_removes_the_secret_everywhere() {
        let e =
            LlmError::status(401, None, "key sk-123 rejected, sk-123 again").redact(Some("sk-123"));
        assert_eq!(e.to_string(), "key [redacted] rejected, [redacted] again");
        let e = LlmError::connect("fine").redact(Some(""));
        assert_eq!(e.to_string(), "fine");
    }
}
