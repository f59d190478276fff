//! [`ToolCtx`]: what a tool gets besides its arguments — the call's
//! context, its settings, cancellation, citations, blobs, progress and the
//! model calls it made.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};
use toolfleet_protocol::blob::{BlobUri, valid_content_type};
use toolfleet_protocol::{
    CallContext, InvocationContext, LlmCall, MAX_WARNING_CHARS, MAX_WARNINGS, Reference,
    ToolWarning,
};
use toolfleet_store::{MAX_BLOB_BYTES, NewReference};

use crate::error::ToolError;
use crate::hooks::HookSet;
use crate::settings::Secret;

/// Where a call's citations and progress go: Redis and NATS in a worker
/// ([`crate::runtime`]), memory in a [`crate::TestCtx`].
pub(crate) trait Sink: Send + Sync {
    /// Stores `refs` under the invocation's shared counter. The same
    /// `reservation` always gets the same indices back (a redelivered job).
    fn cite<'a>(
        &'a self,
        call: &'a CallContext,
        reservation: String,
        refs: Vec<NewReference>,
    ) -> BoxFuture<'a, Result<Vec<Reference>, ToolError>>;

    /// Stores `bytes` as blob `blob_id` of the call's invocation (checked
    /// by [`ToolCtx::store_blob`]). The same id replaces the blob.
    fn store_blob<'a>(
        &'a self,
        call: &'a CallContext,
        blob_id: String,
        content_type: String,
        bytes: Vec<u8>,
    ) -> BoxFuture<'a, Result<(), ToolError>>;

    /// Tells the caller how the call is going.
    fn progress<'a>(&'a self, call: &'a CallContext, message: String) -> BoxFuture<'a, ()>;

    /// The store the fleet's shared limits are counted in (`None` in a
    /// test context: no limits).
    fn shared_store(&self) -> Option<toolfleet_store::CitationStore> {
        None
    }
}

/// A blob a call stored ([`ToolCtx::store_blob`]): what to hand the model
/// or put in the result's data instead of the bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct BlobRef {
    /// The blob's id within the invocation: `<call id>.<n>` for the
    /// call's `n`th blob (from 1).
    pub id: String,
    /// `toolfleet-blob:<invocation id>/<id>` ([`BlobUri`]): what a client
    /// reads the blob by (`toolfleet blob get URI`).
    pub uri: String,
    /// The blob's size.
    pub bytes: usize,
    /// The blob's media type (`type/subtype`), as the tool stored it.
    pub content_type: String,
}

/// What a tool gets besides its arguments.
pub struct ToolCtx {
    call: CallContext,
    settings: Option<Value>,
    /// The per-tenant secrets this call resolved ([`ToolCtx::secret`]):
    /// scrubbed from its result like the worker's own.
    resolved: Mutex<Vec<Secret>>,
    cancel: CancellationToken,
    deadline: Option<tokio::time::Instant>,
    sink: Arc<dyn Sink>,
    hooks: Arc<HookSet>,
    cited: Mutex<Vec<Reference>>,
    /// How many times this call has cited so far.
    cites: AtomicU32,
    /// How many blobs this call has stored so far.
    blobs: AtomicU32,
    /// The model calls the tool reported ([`ToolCtx::record_llm_call`]).
    llm_calls: Mutex<Vec<LlmCall>>,
    /// The warnings the tool reported ([`ToolCtx::warning`]).
    warnings: Mutex<Vec<ToolWarning>>,
}

/// The most model calls one result carries (the contract's limit).
pub const MAX_LLM_CALLS: usize = 64;
/// The longest model name a result carries (the contract's limit).
pub const MAX_MODEL_CHARS: usize = 128;

impl ToolCtx {
    pub(crate) fn new(
        call: CallContext,
        settings: Option<Value>,
        sink: Arc<dyn Sink>,
        hooks: Arc<HookSet>,
        cancel: CancellationToken,
        deadline: Option<tokio::time::Instant>,
    ) -> Self {
        Self {
            call,
            settings,
            resolved: Mutex::new(Vec::new()),
            cancel,
            deadline,
            sink,
            hooks,
            cited: Mutex::new(Vec::new()),
            cites: AtomicU32::new(0),
            blobs: AtomicU32::new(0),
            llm_calls: Mutex::new(Vec::new()),
            warnings: Mutex::new(Vec::new()),
        }
    }

    /// The call: invocation context, call id, tool id, attempt.
    pub fn call(&self) -> &CallContext {
        &self.call
    }

    /// The limits this call's model calls share with the rest of the
    /// fleet: the tenant's rate limits and budgets (sent with the job) and
    /// each deployment's fleet-wide limits. `None` in a test context.
    pub fn shared_limits(&self) -> Option<crate::SharedLimits> {
        Some(crate::SharedLimits {
            store: self.sink.shared_store()?,
            tenant: self.call.invocation.tenant().to_owned(),
            limits: self.call.invocation.tenant_limits,
            token: format!(
                "tool/{}/{}",
                self.call.invocation.invocation_id, self.call.call_id
            ),
        })
    }

    /// The invocation: tenant, user, profile, data source, deadline, ….
    pub fn invocation(&self) -> &InvocationContext {
        &self.call.invocation
    }

    /// The per-tenant settings sent with the job (`settings` of the tool
    /// job), if any.
    pub fn settings(&self) -> Option<&Value> {
        self.settings.as_ref()
    }

    /// One setting, deserialised. `Ok(None)` when it is absent.
    ///
    /// # Errors
    ///
    /// A non-retryable [`ToolError::Failed`] when the value has the wrong
    /// shape: a configuration problem, not something the model can fix.
    pub fn setting<T: DeserializeOwned>(&self, name: &str) -> Result<Option<T>, ToolError> {
        match self.settings.as_ref().and_then(|s| s.get(name)) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => serde_json::from_value(v.clone()).map(Some).map_err(|e| {
                tracing::error!(tool = %self.call.tool_id, setting = name, error = %e, "a setting has the wrong shape");
                ToolError::failed(format!("the tool's setting {name:?} is misconfigured"))
            }),
        }
    }

    /// A secret setting of the tenant: the job's settings name where it
    /// is (`{"env": "NAME"}` or `{"file": "/path"}`: the operator's
    /// `toolfleet settings set` refuses anything else), and it is read here,
    /// on this worker's host — a secret value never travels on NATS.
    /// `Ok(None)` when the setting is absent. The value is scrubbed from
    /// everything the call publishes.
    ///
    /// # Errors
    ///
    /// A non-retryable [`ToolError::Failed`] naming the setting (never a
    /// value) when it is not a reference or what it names is missing.
    pub fn secret(&self, name: &str) -> Result<Option<Secret>, ToolError> {
        let Some(value) = self
            .settings
            .as_ref()
            .and_then(|s| s.get(name))
            .filter(|v| !v.is_null())
        else {
            return Ok(None);
        };
        match crate::settings::secret_from_json_reference(
            name,
            value,
            &crate::settings::ProcessSecrets,
        ) {
            Ok(secret) => {
                if let Ok(mut resolved) = self.resolved.lock() {
                    resolved.push(secret.clone());
                }
                Ok(Some(secret))
            }
            Err(e) => {
                tracing::error!(tool = %self.call.tool_id, setting = name, error = %e, "a tenant's secret setting cannot be read");
                Err(ToolError::failed(format!(
                    "the tool's secret setting {name:?} is misconfigured"
                )))
            }
        }
    }

    /// The secrets this call resolved so far ([`ToolCtx::secret`]).
    pub(crate) fn resolved_secrets(&self) -> Vec<Secret> {
        self.resolved.lock().map(|r| r.clone()).unwrap_or_default()
    }

    /// Cancelled when the invocation is cancelled (the worker then drops
    /// the call's future and answers `cancelled`), and once the call is
    /// over: it answered, failed or ran out of time. Hand a clone to work
    /// that would outlive the future (`spawn_blocking`, threads) so that
    /// work stops too. A worker's shutdown does not cancel calls in flight:
    /// they finish while the worker drains.
    pub fn cancellation(&self) -> &CancellationToken {
        &self.cancel
    }

    /// Completes when [`ToolCtx::cancellation`] is cancelled.
    pub fn cancelled(&self) -> WaitForCancellationFuture<'_> {
        self.cancel.cancelled()
    }

    /// When the call's time is up: the tool's timeout, or the invocation's
    /// deadline when that is nearer. `None` in a [`crate::TestCtx`] without
    /// one.
    pub fn deadline(&self) -> Option<tokio::time::Instant> {
        self.deadline
    }

    /// Stores references in the invocation's citation store and returns them
    /// with their `[doc:N]` indices (shared with every other tool and the
    /// orchestrator, so they never collide). A redelivered job that cites in
    /// the same order gets the same indices back.
    ///
    /// # Errors
    ///
    /// A retryable [`ToolError`] when the store is unavailable.
    pub async fn cite(&self, refs: Vec<NewReference>) -> Result<Vec<Reference>, ToolError> {
        if refs.is_empty() {
            return Ok(Vec::new());
        }
        // Each cite of a call has its own reservation, so a second cite never
        // reuses (and overwrites) the first one's indices.
        let n = self.cites.fetch_add(1, Ordering::Relaxed);
        let reservation = if n == 0 {
            self.call.call_id.clone()
        } else {
            format!("{}.{n}", self.call.call_id)
        };
        let scrubber = self.hooks.scrubber();
        let refs = if scrubber.is_empty() {
            refs
        } else {
            refs.into_iter()
                .map(|mut r| {
                    for field in [&mut r.title]
                        .into_iter()
                        .chain(r.source.as_mut())
                        .chain(r.url.as_mut())
                        .chain(r.snippet.as_mut())
                    {
                        scrubber.in_place(field);
                    }
                    r
                })
                .collect()
        };
        let stored = self.sink.cite(&self.call, reservation, refs).await?;
        if let Ok(mut cited) = self.cited.lock() {
            cited.extend(stored.iter().cloned());
        }
        Ok(stored)
    }

    /// Stores `bytes` (an image, a file: anything too big or too binary for
    /// the model's context or a NATS message) as a blob of the invocation,
    /// kept as long as its citations, and returns a small [`BlobRef`] to
    /// answer with instead. Ids are deterministic (`<call id>.1`, `.2`, …
    /// in the order the call stores them), so a redelivered job that stores
    /// in the same order replaces its blobs instead of leaving copies.
    ///
    /// # Errors
    ///
    /// A non-retryable [`ToolError`] for a content type that is not
    /// `type/subtype` or bytes past [`MAX_BLOB_BYTES`] (32 MiB); a
    /// retryable one when the store is unavailable.
    pub async fn store_blob(
        &self,
        content_type: &str,
        bytes: Vec<u8>,
    ) -> Result<BlobRef, ToolError> {
        if bytes.len() > MAX_BLOB_BYTES {
            return Err(ToolError::failed(format!(
                "the tool's output is {} bytes, more than a blob may have ({MAX_BLOB_BYTES} bytes)",
                bytes.len()
            )));
        }
        if !valid_content_type(content_type) {
            return Err(ToolError::failed(format!(
                "the tool's output has content type {content_type:?}, not `type/subtype`"
            )));
        }
        let n = self.blobs.fetch_add(1, Ordering::Relaxed) + 1;
        let id = format!("{}.{n}", self.call.call_id);
        let uri = BlobUri::new(self.call.invocation.invocation_id.as_str(), id.as_str())
            .map_err(|e| ToolError::failed(e.to_string()))?;
        let size = bytes.len();
        self.sink
            .store_blob(&self.call, id.clone(), content_type.to_owned(), bytes)
            .await?;
        Ok(BlobRef {
            id,
            uri: uri.to_string(),
            bytes: size,
            content_type: content_type.to_owned(),
        })
    }

    /// Sends a progress message to the caller (a `tool_progress` event for
    /// the chat client). Best effort: a lost progress message is not an
    /// error.
    pub async fn progress(&self, message: impl Into<String>) {
        let message = self.hooks.scrubber().text(&message.into());
        self.sink.progress(&self.call, message).await;
    }

    /// Reports that an attempt at `backend` (a model, an endpoint) begins
    /// (runs the `on_attempt_start` hooks). Follow it with
    /// [`attempt_completed`](Self::attempt_completed) or
    /// [`attempt_failed`](Self::attempt_failed).
    pub fn attempt_started(&self, backend: &str) {
        self.hooks.on_attempt_start(&self.call, backend);
    }

    /// The attempt at `backend` gave the answer (`on_attempt_complete`).
    pub fn attempt_completed(&self, backend: &str) {
        self.hooks.on_attempt_complete(&self.call, backend);
    }

    /// The attempt at `backend` failed (`on_attempt_error`).
    pub fn attempt_failed(&self, backend: &str, error: &str) {
        self.hooks.on_attempt_error(&self.call, backend, error);
    }

    /// Reports a move from one model or backend to the next in the tool's
    /// list (runs the `on_fallback` hooks).
    pub fn fallback(&self, from: &str, to: &str, reason: &str) {
        self.hooks.on_fallback(&self.call, from, to, reason);
    }

    /// Reports something worth a look that did not fail the call: it
    /// travels back with the result (at most [`MAX_WARNINGS`], messages cut
    /// to [`MAX_WARNING_CHARS`]) and runs the `on_warning` hooks. `code` is
    /// `snake_case`, e.g. `fallback`.
    pub fn warning(&self, code: &str, message: &str) {
        // Scrubbed before it is cut, so no part of a secret survives.
        let mut message = self.hooks.scrubber().text(message);
        if let Some((cut, _)) = message.char_indices().nth(MAX_WARNING_CHARS) {
            message.truncate(cut);
            message.push('…');
        }
        let warning = ToolWarning {
            code: code.to_owned(),
            message,
        };
        self.hooks.on_warning(&self.call, &warning);
        if let Ok(mut warnings) = self.warnings.lock()
            && warnings.len() < MAX_WARNINGS
        {
            warnings.push(warning);
        }
    }

    /// Whether this call has reported a warning with `code` (and not had
    /// its warnings taken since).
    pub(crate) fn has_warning(&self, code: &str) -> bool {
        self.warnings
            .lock()
            .is_ok_and(|w| w.iter().any(|w| w.code == code))
    }

    /// The warnings reported so far by this call.
    pub(crate) fn take_warnings(&self) -> Vec<ToolWarning> {
        self.warnings
            .lock()
            .map(|mut w| std::mem::take(&mut *w))
            .unwrap_or_default()
    }

    /// Reports a model call the tool made (tokens, model, cost, attempts):
    /// it travels back with the result, so the invocation's usage, cost and
    /// `llmCalls` include what the tool spent. The purpose is always
    /// `tool`; calls beyond [`MAX_LLM_CALLS`] are summed into the last one.
    pub fn record_llm_call(&self, mut call: LlmCall) {
        call.purpose = "tool".to_owned();
        // The contract's limit on a model name.
        if let Some((cut, _)) = call.model.char_indices().nth(MAX_MODEL_CHARS) {
            call.model.truncate(cut);
        }
        if let Ok(mut calls) = self.llm_calls.lock() {
            if calls.len() < MAX_LLM_CALLS {
                calls.push(call);
            } else if let Some(last) = calls.last_mut() {
                last.usage += call.usage;
                last.attempts = last.attempts.saturating_add(call.attempts);
                last.cost_usd = match (last.cost_usd, call.cost_usd) {
                    (Some(a), Some(b)) => Some(a + b),
                    _ => None,
                };
            }
        }
    }

    /// The model calls reported so far by this call.
    pub(crate) fn take_llm_calls(&self) -> Vec<LlmCall> {
        self.llm_calls
            .lock()
            .map(|mut c| std::mem::take(&mut *c))
            .unwrap_or_default()
    }

    /// The references cited so far by this call.
    pub(crate) fn take_cited(&self) -> Vec<Reference> {
        self.cited
            .lock()
            .map(|mut c| std::mem::take(&mut *c))
            .unwrap_or_default()
    }
}
