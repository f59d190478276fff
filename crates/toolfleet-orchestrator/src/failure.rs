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
}

impl Failure {
    pub fn new(code: impl Into<ChatErrorCode>, message: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            message: message.into(),
        }
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
