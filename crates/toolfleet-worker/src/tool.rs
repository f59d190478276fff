//! What a tool author writes: a [`Tool`] with typed arguments, returning a
//! [`ToolOutput`] or a [`ToolError`].

use std::future::Future;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::ctx::ToolCtx;

/// A tool implementation. The worker validates the call's arguments against
/// the definition's JSON Schema, then deserialises them into `Args` and
/// calls [`Tool::call`] under the tool's timeout.
///
/// ```
/// use serde::Deserialize;
/// use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput};
///
/// struct Echo;
///
/// #[derive(Deserialize)]
/// struct EchoArgs {
///     text: String,
/// }
///
/// impl Tool for Echo {
///     type Args = EchoArgs;
///     async fn call(&self, _ctx: &ToolCtx, args: EchoArgs) -> Result<ToolOutput, ToolError> {
///         Ok(ToolOutput::text(args.text))
///     }
/// }
/// ```
pub trait Tool: Send + Sync + 'static {
    /// The arguments, deserialised from the validated JSON object. Use
    /// `serde_json::Value` to take them as they come.
    type Args: DeserializeOwned + Send;

    /// Runs one call. Cancelled (dropped) when its time is up; long work can
    /// also watch [`ToolCtx::cancelled`].
    fn call(
        &self,
        ctx: &ToolCtx,
        args: Self::Args,
    ) -> impl Future<Output = Result<ToolOutput, ToolError>> + Send;
}

/// What a tool returns: text for the model and optional structured data for
/// programs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolOutput {
    pub content: String,
    pub data: Option<Value>,
}

impl ToolOutput {
    /// Text for the model, no data.
    pub fn text(content: impl Into<String>) -> Self {
        Self {
            content: content.into(),
            data: None,
        }
    }

    /// Adds structured data. A value that cannot be serialised is an error
    /// of the tool, not a panic.
    pub fn with_data(mut self, data: impl Serialize) -> Result<Self, ToolError> {
        self.data = Some(
            serde_json::to_value(data)
                .map_err(|e| ToolError::failed(format!("the tool's data: {e}")))?,
        );
        Ok(self)
    }
}

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
    Failed { message: String, retryable: bool },
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
        code: &'static str,
        message: String,
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

/// A [`Tool`] with its argument type erased, so one worker serves tools of
/// many types. Blanket-implemented; tool authors never see it.
pub(crate) trait DynTool: Send + Sync + 'static {
    fn call_json<'a>(
        &'a self,
        ctx: &'a ToolCtx,
        args: Value,
    ) -> BoxFuture<'a, Result<ToolOutput, ToolError>>;
}

impl<T: Tool> DynTool for T {
    fn call_json<'a>(
        &'a self,
        ctx: &'a ToolCtx,
        args: Value,
    ) -> BoxFuture<'a, Result<ToolOutput, ToolError>> {
        async move {
            // The schema already passed: a mismatch here is the tool's
            // struct disagreeing with its own definition.
            let args: T::Args = serde_json::from_value(args).map_err(|e| {
                tracing::error!(
                    tool = %ctx.call().tool_id,
                    error = %e,
                    "arguments that pass the definition's schema do not fit the tool's argument type"
                );
                ToolError::failed(format!(
                    "the tool cannot take these arguments although they match its schema ({e}); \
                     the tool's definition and code disagree"
                ))
            })?;
            self.call(ctx, args).await
        }
        .boxed()
    }
}
