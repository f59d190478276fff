//! What a tool author writes: a [`Tool`] with typed arguments, returning a
//! [`ToolOutput`] or a [`ToolError`].

use std::future::Future;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::ctx::ToolCtx;
pub use crate::error::ToolError;

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
    /// What the model reads.
    pub content: String,
    /// Structured data for programs (the result's `data`), checked against
    /// the definition's `outputSchema` when it has one.
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
