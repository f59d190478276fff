//! [`ToolError`]: how a call failed. It sits below the tool, its context
//! and the hooks (all three speak of it), so none of them imports another
//! for it.

/// How a tool failed. The kind decides what the worker does — answer, retry
/// or refuse — never the message text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ToolError {
    /// The arguments make no sense for the tool: the model should fix them.
    /// Never retried.
    #[error("{0}")]
    InvalidInput(String),
    /// A policy refused the call: answered `blocked`, never retried.
    #[error("{0}")]
    Blocked(String),
    /// The tool failed; `retryable` says whether another attempt may help
    /// (then the job goes back to the queue with our delay, up to the
    /// attempt cap).
    #[error("{message}")]
    Failed {
        /// What went wrong, for the model and the log.
        message: String,
        /// Whether another attempt may help.
        retryable: bool,
    },
    /// The call did not finish in time (the worker reports this to hooks;
    /// a tool returning it is answered `timeout`).
    #[error("{0}")]
    Timeout(String),
    /// The invocation was cancelled while the call ran: the tool was
    /// stopped. Never retried.
    #[error("{0}")]
    Cancelled(String),
    /// A failure with a code of the tool's own (`snake_case`, e.g.
    /// `fallback_exhausted`), for callers that act on it.
    #[error("{message}")]
    Coded {
        /// The code in the result's error (`snake_case`).
        code: &'static str,
        /// What went wrong, for the model and the log.
        message: String,
        /// Whether another attempt may help.
        retryable: bool,
    },
}

impl ToolError {
    /// A failure another attempt will not fix.
    pub fn failed(message: impl Into<String>) -> Self {
        ToolError::Failed {
            message: message.into(),
            retryable: false,
        }
    }

    /// A failure another attempt may fix (a backend that is down, a rate
    /// limit).
    pub fn transient(message: impl Into<String>) -> Self {
        ToolError::Failed {
            message: message.into(),
            retryable: true,
        }
    }

    /// Arguments the model should fix.
    pub fn invalid(message: impl Into<String>) -> Self {
        ToolError::InvalidInput(message.into())
    }

    /// A refusal by policy.
    pub fn blocked(message: impl Into<String>) -> Self {
        ToolError::Blocked(message.into())
    }

    /// A failure with its own code (never retried).
    pub fn coded(code: &'static str, message: impl Into<String>) -> Self {
        ToolError::Coded {
            code,
            message: message.into(),
            retryable: false,
        }
    }

    /// Whether another attempt may help: the worker then hands the job
    /// back for a retry instead of answering with the error.
    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ToolError::Failed {
                retryable: true,
                ..
            } | ToolError::Coded {
                retryable: true,
                ..
            }
        )
    }

    /// The error code in the tool result.
    pub fn code(&self) -> &'static str {
        match self {
            ToolError::InvalidInput(_) => "invalid_input",
            ToolError::Blocked(_) => "blocked",
            ToolError::Failed {
                retryable: true, ..
            } => "transient_failure",
            ToolError::Failed { .. } => "tool_failed",
            ToolError::Timeout(_) => "timeout",
            ToolError::Cancelled(_) => "cancelled",
            ToolError::Coded { code, .. } => code,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use toolfleet_protocol::ToolErrorCode;

    /// The SDK's own codes are the contract's fixed ones, said once there.
    #[test]
    fn every_sdk_code_is_a_fixed_tool_error_code() {
        let errors = [
            ToolError::InvalidInput("x".into()),
            ToolError::Blocked("x".into()),
            ToolError::failed("x"),
            ToolError::transient("x"),
            ToolError::Timeout("x".into()),
            ToolError::Cancelled("x".into()),
        ];
        for e in errors {
            assert!(
                !matches!(ToolErrorCode::parse(e.code()), ToolErrorCode::Custom(_)),
                "{} is not in ToolErrorCode::FIXED",
                e.code()
            );
        }
    }
}
