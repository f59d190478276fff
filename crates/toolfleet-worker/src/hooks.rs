//! Lifecycle hooks around every call, and policies that may refuse one.
//!
//! Every method has a no-op default, so a hook implements only what it
//! needs (the shape of ripgrep's `Sink`). [`Hooks::before_call`] runs after
//! the arguments are validated and before anything runs: the place for
//! provider-confidence, SSRF and settings policies. A refusal answers the
//! call `blocked` with the refusal's reason; no tool code runs and nothing
//! is written to the store.

use std::sync::Arc;

use serde_json::Value;
use toolfleet_protocol::tools::ToolDefinition;
use toolfleet_protocol::{CallContext, ToolResult, ToolWarning};

use crate::error::ToolError;
use crate::settings::Scrubber;

/// What [`Hooks::before_call`] sees of a call.
#[derive(Debug, Clone, Copy)]
pub struct CallInfo<'a> {
    /// The call: invocation context, call id, tool id, attempt.
    pub call: &'a CallContext,
    /// The definition of the tool called.
    pub definition: &'a ToolDefinition,
    /// The validated arguments.
    pub arguments: &'a Value,
    /// The per-tenant settings sent with the job.
    pub settings: Option<&'a Value>,
}

/// Why a policy refused a call. Answered as a `blocked` result with this
/// code and message (the message is for the model: say what to do).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// The code in the `blocked` result (`snake_case`, e.g.
    /// `provider_confidence`).
    pub code: String,
    /// Why, for the model: what to do instead.
    pub message: String,
}

impl Refusal {
    /// A refusal with `code` and `message`.
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            message: message.into(),
        }
    }
}

/// Lifecycle hooks around every call; every method is a no-op by default.
pub trait Hooks: Send + Sync + 'static {
    /// Before the tool runs, after its arguments are validated. `Err`
    /// refuses the call.
    fn before_call(&self, _call: &CallInfo<'_>) -> Result<(), Refusal> {
        Ok(())
    }
    /// The tool is about to run.
    fn on_start(&self, _call: &CallContext) {}
    /// The tool answered `ok`.
    fn on_complete(&self, _call: &CallContext, _result: &ToolResult) {}
    /// The tool failed (including a timeout).
    fn on_error(&self, _call: &CallContext, _error: &ToolError) {}
    /// One attempt of the call at a model (or backend) begins: a tool that
    /// works through a list fires this per attempt
    /// ([`crate::ToolCtx::attempt_started`]), then
    /// [`on_attempt_complete`](Self::on_attempt_complete) or
    /// [`on_attempt_error`](Self::on_attempt_error).
    fn on_attempt_start(&self, _call: &CallContext, _backend: &str) {}
    /// The attempt at `backend` gave the answer.
    fn on_attempt_complete(&self, _call: &CallContext, _backend: &str) {}
    /// The attempt at `backend` failed; `error` says how.
    fn on_attempt_error(&self, _call: &CallContext, _backend: &str, _error: &str) {}
    /// The tool moved from one model (or backend) to the next in its list.
    fn on_fallback(&self, _call: &CallContext, _from: &str, _to: &str, _reason: &str) {}
    /// Something worth a look that did not fail the call (it travels with
    /// the result when the tool reported it).
    fn on_warning(&self, _call: &CallContext, _warning: &ToolWarning) {}
}

/// Hooks shared with the caller (a recorder a test reads, say).
impl<H: Hooks> Hooks for Arc<H> {
    fn before_call(&self, call: &CallInfo<'_>) -> Result<(), Refusal> {
        (**self).before_call(call)
    }
    fn on_start(&self, call: &CallContext) {
        (**self).on_start(call)
    }
    fn on_complete(&self, call: &CallContext, result: &ToolResult) {
        (**self).on_complete(call, result)
    }
    fn on_error(&self, call: &CallContext, error: &ToolError) {
        (**self).on_error(call, error)
    }
    fn on_attempt_start(&self, call: &CallContext, backend: &str) {
        (**self).on_attempt_start(call, backend)
    }
    fn on_attempt_complete(&self, call: &CallContext, backend: &str) {
        (**self).on_attempt_complete(call, backend)
    }
    fn on_attempt_error(&self, call: &CallContext, backend: &str, error: &str) {
        (**self).on_attempt_error(call, backend, error)
    }
    fn on_fallback(&self, call: &CallContext, from: &str, to: &str, reason: &str) {
        (**self).on_fallback(call, from, to, reason)
    }
    fn on_warning(&self, call: &CallContext, warning: &ToolWarning) {
        (**self).on_warning(call, warning)
    }
}

/// The definition's `minProviderConfidence`: a call from an invocation
/// whose provider confidence is lower (or unknown) is refused. Every worker
/// runs it first; it is not added by hand.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ProviderConfidence;

impl Hooks for ProviderConfidence {
    fn before_call(&self, info: &CallInfo<'_>) -> Result<(), Refusal> {
        let Some(min) = info.definition.min_provider_confidence else {
            return Ok(());
        };
        let have = info.call.invocation.provider_confidence;
        if have.unwrap_or(0.0) >= min {
            return Ok(());
        }
        Err(Refusal::new(
            "provider_confidence",
            format!(
                "{} needs provider confidence of at least {min}; this invocation has {}",
                info.definition.function.name,
                have.map_or_else(|| "none".to_string(), |c| c.to_string())
            ),
        ))
    }
}

/// The definition's `tenants`: a call from an invocation of another tenant
/// (its `Toolfleet-Tenant`, which only the orchestrator sets) is refused
/// with `tenant_not_allowed`. Every worker runs it; it is not added by
/// hand.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct TenantsAllowed;

impl Hooks for TenantsAllowed {
    fn before_call(&self, info: &CallInfo<'_>) -> Result<(), Refusal> {
        let tenant = info.call.invocation.tenant();
        if info.definition.allows_tenant(tenant) {
            return Ok(());
        }
        Err(Refusal::new(
            "tenant_not_allowed",
            format!(
                "{} is not offered to tenant {tenant}",
                info.definition.function.name
            ),
        ))
    }
}

/// `error` with the worker's secrets scrubbed from its message.
fn scrubbed(error: &ToolError, s: &Scrubber) -> ToolError {
    if s.is_empty() {
        return error.clone();
    }
    match error {
        ToolError::InvalidInput(m) => ToolError::InvalidInput(s.text(m)),
        ToolError::Blocked(m) => ToolError::Blocked(s.text(m)),
        ToolError::Failed { message, retryable } => ToolError::Failed {
            message: s.text(message),
            retryable: *retryable,
        },
        ToolError::Timeout(m) => ToolError::Timeout(s.text(m)),
        ToolError::Cancelled(m) => ToolError::Cancelled(s.text(m)),
        ToolError::Coded {
            code,
            message,
            retryable,
        } => ToolError::Coded {
            code,
            message: s.text(message),
            retryable: *retryable,
        },
    }
}

/// The hooks of a worker, in order: the built-in policies, then the
/// author's; and the secrets scrubbed from everything the worker
/// publishes.
#[derive(Clone)]
pub(crate) struct HookSet(Vec<Arc<dyn Hooks>>, Scrubber);

impl HookSet {
    pub(crate) fn with_scrubber(authored: Vec<Arc<dyn Hooks>>, scrubber: Scrubber) -> Self {
        let mut all: Vec<Arc<dyn Hooks>> =
            vec![Arc::new(TenantsAllowed), Arc::new(ProviderConfidence)];
        all.extend(authored);
        Self(all, scrubber)
    }

    /// The worker's secrets, to scrub from what it publishes.
    pub(crate) fn scrubber(&self) -> &Scrubber {
        &self.1
    }

    /// The first refusal wins.
    pub(crate) fn before_call(&self, info: &CallInfo<'_>) -> Result<(), Refusal> {
        self.0.iter().try_for_each(|h| h.before_call(info))
    }

    pub(crate) fn on_start(&self, call: &CallContext) {
        self.0.iter().for_each(|h| h.on_start(call));
    }

    pub(crate) fn on_complete(&self, call: &CallContext, result: &ToolResult) {
        self.0.iter().for_each(|h| h.on_complete(call, result));
    }

    pub(crate) fn on_error(&self, call: &CallContext, error: &ToolError) {
        let error = scrubbed(error, &self.1);
        self.0.iter().for_each(|h| h.on_error(call, &error));
    }

    pub(crate) fn on_fallback(&self, call: &CallContext, from: &str, to: &str, reason: &str) {
        self.0
            .iter()
            .for_each(|h| h.on_fallback(call, from, to, reason));
    }

    pub(crate) fn on_attempt_start(&self, call: &CallContext, backend: &str) {
        self.0
            .iter()
            .for_each(|h| h.on_attempt_start(call, backend));
    }

    pub(crate) fn on_attempt_complete(&self, call: &CallContext, backend: &str) {
        self.0
            .iter()
            .for_each(|h| h.on_attempt_complete(call, backend));
    }

    pub(crate) fn on_attempt_error(&self, call: &CallContext, backend: &str, error: &str) {
        // Hooks log: they see the error as published, secrets scrubbed.
        let error = self.1.text(error);
        self.0
            .iter()
            .for_each(|h| h.on_attempt_error(call, backend, &error));
    }

    pub(crate) fn on_warning(&self, call: &CallContext, warning: &ToolWarning) {
        self.0.iter().for_each(|h| h.on_warning(call, warning));
    }
}
