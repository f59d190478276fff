//! How things end badly: a [`Failure`] ends one invocation with an `error`
//! event; an [`OrchestratorError`] stops the orchestrator's start.

pub use toolfleet_protocol::ChatErrorCode;

/// Why an invocation ended without an answer: the `error` event's code and
/// message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Stable and machine-readable, e.g. `round_limit`, `llm_http_429`.
    pub code: ChatErrorCode,
    /// For people; never holds a secret.
    pub message: String,
    /// For `rate_limited` and `budget_exhausted`: when a model call would
    /// be admitted again, in ms (the `error` event's `retryAfterMs`).
    pub retry_after_ms: Option<u64>,
}

impl Failure {
    pub fn new(code: impl Into<ChatErrorCode>, message: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            message: message.into(),
            retry_after_ms: None,
        }
    }

    /// This failure, with the `error` event's `retryAfterMs`.
    #[must_use]
    pub fn with_retry_after(mut self, after: std::time::Duration) -> Self {
        self.retry_after_ms = Some(u64::try_from(after.as_millis()).unwrap_or(u64::MAX));
        self
    }
}

/// Why the orchestrator could not start (or stopped).
#[derive(Debug, thiserror::Error)]
pub enum OrchestratorError {
    #[error("NATS: {0}")]
    Nats(String),
    #[error("configuration: {0}")]
    Config(String),
}
