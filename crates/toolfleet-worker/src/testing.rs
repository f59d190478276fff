//! [`TestCtx`]: run a tool in a unit test, without NATS or Redis.
//!
//! Citations go to memory with the same numbering rules as the store (one
//! shared counter per invocation; the same reservation gets the same
//! indices back), progress messages are kept, and
//! [`TestCtx::call_checked`] puts the arguments through the definition's
//! schema and the built-in policies first, as a worker would.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::tools::{CompiledTool, ToolDefinition, ToolId};
use toolfleet_protocol::{CallContext, InvocationContext, LlmCall, Reference, ToolWarning};
use toolfleet_store::NewReference;

use crate::ctx::{Sink, ToolCtx};
use crate::hooks::{CallInfo, HookSet, Hooks};
use crate::tool::{DynTool, Tool, ToolError, ToolOutput};

/// An in-memory stand-in for the worker around a tool.
pub struct TestCtx {
    call: CallContext,
    /// Set by [`TestCtx::with_call_id`]: every call uses it.
    fixed_call_id: bool,
    calls: AtomicU32,
    settings: Option<Value>,
    sink: Arc<MemorySink>,
    hooks: Vec<Arc<dyn Hooks>>,
}

impl Default for TestCtx {
    fn default() -> Self {
        Self::new()
    }
}

impl TestCtx {
    /// Invocation `test-invocation`, calls `call-1`, `call-2`, … (one per
    /// call, as the orchestrator mints them), tool `test:tool@0.0.0`
    /// (replaced by the definition's id in [`TestCtx::call_checked`]).
    pub fn new() -> Self {
        let tool_id = ToolId {
            namespace: "test".into(),
            name: "tool".into(),
            version: (0, 0, 0),
        };
        Self {
            call: CallContext {
                invocation: InvocationContext::new("test-invocation"),
                call_id: "call-1".into(),
                tool_id,
                attempt: 1,
                reply_to: "toolfleet.reply.test".into(),
                citation_floor: 0,
                new_call: false,
            },
            fixed_call_id: false,
            calls: AtomicU32::new(0),
            settings: None,
            sink: Arc::new(MemorySink::default()),
            hooks: Vec::new(),
        }
    }

    /// The per-tenant settings the job carries.
    pub fn with_settings(mut self, settings: Value) -> Self {
        self.settings = Some(settings);
        self
    }

    /// The invocation the call belongs to (tenant, provider confidence, …).
    pub fn with_invocation(mut self, invocation: InvocationContext) -> Self {
        self.call.invocation = invocation;
        self
    }

    /// One call id for every call (a second call with the same id reuses
    /// its citation indices, as a redelivered job does).
    pub fn with_call_id(mut self, call_id: impl Into<String>) -> Self {
        self.call.call_id = call_id.into();
        self.fixed_call_id = true;
        self
    }

    /// The context of the next call.
    fn next_call(&self) -> CallContext {
        let mut call = self.call.clone();
        let n = self.calls.fetch_add(1, Ordering::Relaxed) + 1;
        if !self.fixed_call_id {
            call.call_id = format!("call-{n}");
        }
        call
    }

    fn ctx_for(&self, call: CallContext, hooks: Arc<HookSet>) -> ToolCtx {
        ToolCtx::new(
            call,
            self.settings.clone(),
            self.sink.clone(),
            hooks,
            CancellationToken::new(),
            None,
        )
    }

    /// Hooks to run around the call, after the built-in policies.
    pub fn with_hooks(mut self, hooks: impl Hooks) -> Self {
        self.hooks.push(Arc::new(hooks));
        self
    }

    /// A fresh [`ToolCtx`] for one call.
    pub fn ctx(&self) -> ToolCtx {
        self.ctx_for(self.next_call(), Arc::new(HookSet::new(self.hooks.clone())))
    }

    /// Runs `tool` with `args` deserialised into its argument type.
    ///
    /// # Errors
    ///
    /// What the tool returns; a non-retryable [`ToolError::Failed`] when
    /// `args` do not fit its argument type.
    pub async fn call<T: Tool>(&self, tool: &T, args: Value) -> Result<ToolOutput, ToolError> {
        let ctx = self.ctx();
        let result = tool.call_json(&ctx, args).await;
        self.keep(&ctx);
        result
    }

    /// Keeps what the call reported besides its output.
    fn keep(&self, ctx: &ToolCtx) {
        if let Ok(mut state) = self.sink.state.lock() {
            state.warnings.extend(ctx.take_warnings());
            state.llm_calls.extend(ctx.take_llm_calls());
        }
    }

    /// Every warning the calls reported so far ([`ToolCtx::warning`]), in
    /// order.
    pub fn warnings(&self) -> Vec<ToolWarning> {
        self.sink
            .state
            .lock()
            .map(|s| s.warnings.clone())
            .unwrap_or_default()
    }

    /// Every model call the calls reported so far
    /// ([`ToolCtx::record_llm_call`]), in order.
    pub fn llm_calls(&self) -> Vec<LlmCall> {
        self.sink
            .state
            .lock()
            .map(|s| s.llm_calls.clone())
            .unwrap_or_default()
    }

    /// Runs `tool` as a worker would for `definition`: the arguments must
    /// pass its JSON Schema ([`ToolError::InvalidInput`] naming the failing
    /// path otherwise) and the built-in policies and hooks
    /// ([`ToolError::Blocked`]) before the tool runs.
    ///
    /// # Errors
    ///
    /// As above, or what the tool returns.
    pub async fn call_checked<T: Tool>(
        &self,
        definition: &ToolDefinition,
        tool: &T,
        args: Value,
    ) -> Result<ToolOutput, ToolError> {
        let compiled = CompiledTool::new(definition.clone())
            .map_err(|e| ToolError::failed(format!("the definition: {e}")))?;
        if let Err(violations) = compiled.validate_arguments(&args) {
            return Err(ToolError::InvalidInput(format!(
                "Invalid arguments for {}: {}",
                definition.function.name,
                toolfleet_protocol::schema::describe(&violations)
            )));
        }
        let mut call = self.next_call();
        call.tool_id = definition.id.clone();
        let hooks = Arc::new(HookSet::new(self.hooks.clone()));
        let info = CallInfo {
            call: &call,
            definition,
            arguments: &args,
            settings: self.settings.as_ref(),
        };
        hooks
            .before_call(&info)
            .map_err(|refusal| ToolError::Blocked(refusal.message))?;
        let ctx = self.ctx_for(call, hooks);
        let result = tool.call_json(&ctx, args).await;
        self.keep(&ctx);
        result
    }

    /// Every reference cited so far, by index.
    pub fn references(&self) -> Vec<Reference> {
        let mut refs: Vec<Reference> = self
            .sink
            .state
            .lock()
            .map(|s| s.refs.clone())
            .unwrap_or_default();
        refs.sort_by_key(|r| r.index);
        refs
    }

    /// Every progress message sent so far, in order.
    pub fn progress(&self) -> Vec<String> {
        self.sink
            .state
            .lock()
            .map(|s| s.progress.clone())
            .unwrap_or_default()
    }
}

#[derive(Default)]
struct MemorySink {
    state: Mutex<MemoryState>,
}

#[derive(Default)]
struct MemoryState {
    next: u64,
    refs: Vec<Reference>,
    reservations: HashMap<String, Vec<u64>>,
    progress: Vec<String>,
    warnings: Vec<ToolWarning>,
    llm_calls: Vec<LlmCall>,
}

impl Sink for MemorySink {
    fn cite<'a>(
        &'a self,
        call: &'a CallContext,
        reservation: String,
        refs: Vec<NewReference>,
    ) -> BoxFuture<'a, Result<Vec<Reference>, ToolError>> {
        async move {
            let mut state = self
                .state
                .lock()
                .map_err(|_| ToolError::failed("the test store is poisoned"))?;
            let indices = match state.reservations.get(&reservation) {
                Some(existing) if existing.len() == refs.len() => existing.clone(),
                _ => {
                    let first = state.next + 1;
                    state.next += refs.len() as u64;
                    let indices: Vec<u64> = (first..=state.next).collect();
                    state.reservations.insert(reservation, indices.clone());
                    indices
                }
            };
            let tool = call.tool_id.to_string();
            let stored: Vec<Reference> = refs
                .into_iter()
                .zip(&indices)
                .map(|(r, &index)| r.cited(index, &tool, &call.call_id))
                .collect();
            state.refs.retain(|r| !indices.contains(&r.index));
            state.refs.extend(stored.iter().cloned());
            Ok(stored)
        }
        .boxed()
    }

    fn progress<'a>(&'a self, _call: &'a CallContext, message: String) -> BoxFuture<'a, ()> {
        async move {
            if let Ok(mut state) = self.state.lock() {
                state.progress.push(message);
            }
        }
        .boxed()
    }
}
