//! [`TestCtx`]: run a tool in a unit test, without NATS or Redis.
//!
//! Citations go to memory with the same numbering rules as the store (one
//! shared counter per invocation; the same reservation gets the same
//! indices back), blobs are kept by URI (the same id replaces a blob),
//! progress messages are kept, and
//! [`TestCtx::call_checked`] puts the arguments through the definition's
//! schema and the built-in policies first, and the structured output
//! through its `outputSchema` after, as a worker would.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::blob::BlobUri;
use toolfleet_protocol::tools::{CompiledTool, ToolDefinition, ToolId};
use toolfleet_protocol::{CallContext, InvocationContext, LlmCall, Reference, ToolWarning};
use toolfleet_store::{Blob, NewReference};

use crate::ctx::{Sink, ToolCtx};
use crate::hooks::{CallInfo, HookSet, Hooks};
use crate::output::OutputCheck;
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
    secrets: Vec<crate::Secret>,
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
            secrets: Vec::new(),
        }
    }

    /// Secrets the worker would scrub ([`crate::WorkerBuilder::secrets`]):
    /// references and progress are scrubbed as in a worker.
    pub fn with_secrets<'a>(
        mut self,
        secrets: impl IntoIterator<Item = &'a crate::Secret>,
    ) -> Self {
        self.secrets.extend(secrets.into_iter().cloned());
        self
    }

    fn hook_set(&self) -> Arc<HookSet> {
        Arc::new(HookSet::with_scrubber(
            self.hooks.clone(),
            crate::settings::Scrubber::new(self.secrets.clone()),
        ))
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
        self.ctx_for(self.next_call(), self.hook_set())
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

    /// Runs the tool of `worker` whose function the model knows as
    /// `function`, with `args` as JSON, in this process: no NATS, no
    /// Redis, no argument validation or hooks (see
    /// [`TestCtx::call_checked`] for those). What a program that embeds a
    /// worker's tools — or `toolfleet bench`'s direct floor — calls.
    ///
    /// # Errors
    ///
    /// What the tool returns; a non-retryable [`ToolError::Failed`] when
    /// `worker` serves no such function.
    pub async fn call_in(
        &self,
        worker: &crate::Worker,
        function: &str,
        args: Value,
    ) -> Result<ToolOutput, ToolError> {
        let Some(served) = worker
            .tools
            .iter()
            .find(|t| t.definition().function.name == function)
        else {
            return Err(ToolError::failed(format!(
                "worker {} serves no function {function}",
                worker.name()
            )));
        };
        let ctx = self.ctx();
        let result = served.imp.call_json(&ctx, args).await;
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
    /// ([`ToolError::Blocked`]) before the tool runs; structured output
    /// that misses the definition's `outputSchema` adds an
    /// `output_schema_mismatch` warning ([`TestCtx::warnings`]).
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
        let output_check = OutputCheck::of(definition)
            .map_err(|e| ToolError::failed(format!("the definition's outputSchema: {e}")))?;
        if let Err(violations) = compiled.validate_arguments(&args) {
            return Err(ToolError::InvalidInput(format!(
                "Invalid arguments for {}: {}",
                definition.function.name,
                toolfleet_protocol::schema::describe(&violations)
            )));
        }
        let mut call = self.next_call();
        call.tool_id = definition.id.clone();
        let hooks = self.hook_set();
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
        if let (Ok(output), Some(check)) = (&result, &output_check) {
            check.check(&ctx, output.data.as_ref());
        }
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

    /// Every blob stored so far ([`ToolCtx::store_blob`]), by URI
    /// (`toolfleet-blob:<invocation id>/<blob id>`, the
    /// [`crate::BlobRef::uri`]). A blob stored again under the same id
    /// (the same call id, as a redelivered job) replaces the first.
    pub fn blobs(&self) -> BTreeMap<String, Blob> {
        self.sink
            .state
            .lock()
            .map(|s| s.blobs.clone())
            .unwrap_or_default()
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
    blobs: BTreeMap<String, Blob>,
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

    fn store_blob<'a>(
        &'a self,
        call: &'a CallContext,
        blob_id: String,
        content_type: String,
        bytes: Vec<u8>,
    ) -> BoxFuture<'a, Result<(), ToolError>> {
        async move {
            let uri = BlobUri::new(call.invocation.invocation_id.as_str(), blob_id)
                .map_err(|e| ToolError::failed(e.to_string()))?;
            let mut state = self
                .state
                .lock()
                .map_err(|_| ToolError::failed("the test store is poisoned"))?;
            state.blobs.insert(
                uri.to_string(),
                Blob {
                    content_type,
                    bytes,
                },
            );
            Ok(())
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

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use serde_json::json;
    use toolfleet_store::MAX_BLOB_BYTES;

    use super::*;
    use crate::BlobRef;

    /// Stores one blob per entry of `blobs` (its text as the bytes).
    struct Painter;

    #[derive(Deserialize)]
    struct Args {
        blobs: Vec<String>,
    }

    impl Tool for Painter {
        type Args = Args;
        async fn call(&self, ctx: &ToolCtx, args: Args) -> Result<ToolOutput, ToolError> {
            let mut refs = Vec::new();
            for text in args.blobs {
                refs.push(ctx.store_blob("image/png", text.into_bytes()).await?);
            }
            ToolOutput::text(format!("{} image(s)", refs.len())).with_data(refs)
        }
    }

    fn refs(output: &ToolOutput) -> Vec<BlobRef> {
        serde_json::from_value(output.data.clone().unwrap()).unwrap()
    }

    #[tokio::test]
    async fn blobs_of_one_call_get_distinct_ids_and_a_redelivery_replaces_them() {
        let ctx = TestCtx::new();
        let first = ctx
            .call(&Painter, json!({"blobs": ["a", "bb"]}))
            .await
            .unwrap();
        let first = refs(&first);
        let ids: Vec<&str> = first.iter().map(|r| r.id.as_str()).collect();
        assert_eq!(ids, ["call-1.1", "call-1.2"]);
        assert_eq!(first[1].uri, "toolfleet-blob:test-invocation/call-1.2");
        assert_eq!(
            (first[1].bytes, first[1].content_type.as_str()),
            (2, "image/png")
        );
        // The reference is what travels: camelCase, no bytes.
        let data = serde_json::to_value(&first[0]).unwrap();
        assert_eq!(data["contentType"], "image/png", "{data}");
        let second = refs(&ctx.call(&Painter, json!({"blobs": ["c"]})).await.unwrap());
        assert_eq!(second[0].id, "call-2.1");
        let blobs = ctx.blobs();
        assert_eq!(blobs.len(), 3, "{blobs:?}");
        assert_eq!(blobs[&first[1].uri].bytes, b"bb");
        assert_eq!(blobs[&first[1].uri].content_type, "image/png");

        // The same call id again (a redelivered job) gets the same ids:
        // its blobs replace the first attempt's.
        let ctx = TestCtx::new().with_call_id("c-9");
        let a = refs(
            &ctx.call(&Painter, json!({"blobs": ["x", "y"]}))
                .await
                .unwrap(),
        );
        let b = refs(
            &ctx.call(&Painter, json!({"blobs": ["X", "Y"]}))
                .await
                .unwrap(),
        );
        assert_eq!(
            a.iter().map(|r| &r.uri).collect::<Vec<_>>(),
            b.iter().map(|r| &r.uri).collect::<Vec<_>>()
        );
        let blobs = ctx.blobs();
        assert_eq!(blobs.len(), 2, "{blobs:?}");
        assert_eq!(blobs["toolfleet-blob:test-invocation/c-9.1"].bytes, b"X");
        assert_eq!(blobs["toolfleet-blob:test-invocation/c-9.2"].bytes, b"Y");
    }

    #[tokio::test]
    async fn a_tool_for_other_tenants_refuses_their_calls() {
        use crate::fixtures::{Answers, definition};
        let mut def = definition(None);
        def.tenants = vec!["globex".into()];
        let as_tenant = |tenant: &str| {
            let mut inv = toolfleet_protocol::InvocationContext::new("inv-1");
            inv.tenant = Some(tenant.into());
            TestCtx::new().with_invocation(inv)
        };
        let refused = as_tenant("acme")
            .call_checked(&def, &Answers::data(Value::Null), json!({}))
            .await
            .unwrap_err();
        assert_eq!(refused.code(), "blocked");
        assert!(
            refused.to_string().contains("not offered to tenant acme"),
            "{refused}"
        );
        let ok = as_tenant("globex")
            .call_checked(&def, &Answers::data(Value::Null), json!({}))
            .await
            .unwrap();
        assert_eq!(ok.content, "fixed");
    }

    #[tokio::test]
    async fn a_blob_too_large_or_without_a_content_type_fails_for_good() {
        let test = TestCtx::new();
        let ctx = test.ctx();
        let err = ctx
            .store_blob("image/png", vec![0; MAX_BLOB_BYTES + 1])
            .await
            .unwrap_err();
        assert!(!err.is_retryable(), "{err:?}");
        assert!(
            err.to_string().contains("more than a blob may have"),
            "{err}"
        );
        let err = ctx.store_blob("png", vec![1]).await.unwrap_err();
        assert!(!err.is_retryable(), "{err:?}");
        assert!(err.to_string().contains("type/subtype"), "{err}");
        assert!(test.blobs().is_empty());
        // Refused blobs take no id: the next one is still the first.
        let ok = ctx
            .store_blob("image/png", vec![0; MAX_BLOB_BYTES])
            .await
            .unwrap();
        assert_eq!((ok.id.as_str(), ok.bytes), ("call-1.1", MAX_BLOB_BYTES));
    }
}
