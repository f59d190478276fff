//! The runtime every worker binary shares.
//!
//! A worker serves one or more tools. For each tool it pulls jobs from the
//! tool's durable consumer on the `TOOLFLEET_TOOLS` work-queue stream (shared
//! by every copy of the worker, so a pool scales by starting more copies),
//! and also answers direct requests on the tool's NATS services endpoint.
//! Each job: headers → context, result ledger (a redelivered job returns the
//! stored result), envelope and argument validation (compiled validators;
//! invalid arguments are answered at once and touch nothing), policy,
//! hooks, the handler under the tool's timeout with in-progress acks, then
//! the result to `Toolfleet-Reply-To`, and only then the ack.
//!
//! Retries are ours: a retryable failure is `nak`ed with our own delay until
//! the attempt cap, then terminated and published as a dead letter — and the
//! caller still gets an error result.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind, consumer::pull, stream};
use async_nats::service::ServiceExt;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use serde_json::Value;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, warn};

use crate::citations::{CitationStore, NewReference};
use crate::metrics::WorkerMetrics;
use crate::protocol::{
    CallContext, DeadLetter, DeadLetterKind, Envelope, Reference, Subjects, ToolErrorBody, ToolJob,
    ToolReply, ToolResult, ToolStatus, encode,
};
use crate::schema::Violation;
use crate::tools::{CompiledTool, ToolDefinition};

/// How a tool failed. The kind decides ack / nak / terminate; strings are
/// never matched.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ToolError {
    /// The arguments make no sense for the tool: the model should fix them.
    /// Never retried.
    #[error("{0}")]
    InvalidInput(String),
    /// A policy refused the call.
    #[error("{0}")]
    Blocked(String),
    /// The tool failed; `retryable` says whether another attempt may help.
    #[error("{message}")]
    Failed { message: String, retryable: bool },
}

impl ToolError {
    pub fn failed(message: impl Into<String>) -> Self {
        ToolError::Failed {
            message: message.into(),
            retryable: false,
        }
    }

    pub fn transient(message: impl Into<String>) -> Self {
        ToolError::Failed {
            message: message.into(),
            retryable: true,
        }
    }

    pub fn is_retryable(&self) -> bool {
        matches!(
            self,
            ToolError::Failed {
                retryable: true,
                ..
            }
        )
    }

    pub fn code(&self) -> &'static str {
        match self {
            ToolError::InvalidInput(_) => "invalid_input",
            ToolError::Blocked(_) => "blocked",
            ToolError::Failed {
                retryable: true, ..
            } => "transient_failure",
            ToolError::Failed { .. } => "tool_failed",
        }
    }
}

/// What a handler returns: text for the model and optional structured data.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ToolOutput {
    pub content: String,
    pub data: Option<Value>,
}

/// What a tool handler gets besides its arguments.
pub struct ToolCtx {
    pub call: CallContext,
    store: CitationStore,
    client: async_nats::Client,
    cited: Mutex<Vec<Reference>>,
    /// How many times this job has cited so far.
    cites: std::sync::atomic::AtomicU32,
    metrics: WorkerMetrics,
    /// Cancelled when the tool's time is up or the worker shuts down.
    pub cancel: CancellationToken,
}

impl ToolCtx {
    /// Stores references in the invocation's citation store and returns them
    /// with their `[doc:N]` indices. A redelivered job gets the same indices.
    pub async fn cite(&self, refs: Vec<NewReference>) -> Result<Vec<Reference>, ToolError> {
        if refs.is_empty() {
            return Ok(Vec::new());
        }
        let tool = self.call.tool_id.to_string();
        // Each cite of a job has its own reservation, so a second cite
        // never reuses (and overwrites) the first one's indices, and a
        // redelivered job that cites in the same order gets them all back.
        let n = self
            .cites
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let reservation = if n == 0 {
            self.call.call_id.clone()
        } else {
            format!("{}.{n}", self.call.call_id)
        };
        let stored = self
            .store
            .reserve(
                &self.call.invocation.invocation_id,
                &reservation,
                &self.call.call_id,
                &tool,
                refs,
            )
            .await
            .map_err(|e| ToolError::transient(e.to_string()))?;
        self.metrics
            .citations_written
            .with_label_values(&[tool.as_str()])
            .inc_by(stored.len() as u64);
        if let Ok(mut cited) = self.cited.lock() {
            cited.extend(stored.iter().cloned());
        }
        Ok(stored)
    }

    /// Sends a progress message to the caller.
    pub async fn progress(&self, message: impl Into<String>) {
        let reply = ToolReply::Progress {
            invocation_id: self.call.invocation.invocation_id.clone(),
            call_id: self.call.call_id.clone(),
            message: message.into(),
        };
        let _ = self
            .client
            .publish(self.call.reply_to.clone(), encode(&reply))
            .await;
    }

    fn take_cited(&self) -> Vec<Reference> {
        self.cited
            .lock()
            .map(|mut c| std::mem::take(&mut *c))
            .unwrap_or_default()
    }
}

/// A tool implementation.
pub trait ToolHandler: Send + Sync + 'static {
    fn call<'a>(
        &'a self,
        ctx: &'a ToolCtx,
        args: Value,
    ) -> BoxFuture<'a, Result<ToolOutput, ToolError>>;
}

/// Lifecycle hooks around every call; every method is a no-op by default.
pub trait Hooks: Send + Sync + 'static {
    fn on_start(&self, _call: &CallContext) {}
    fn on_complete(&self, _call: &CallContext, _result: &ToolResult) {}
    fn on_error(&self, _call: &CallContext, _error: &ToolError) {}
    /// A tool moved from one model (or backend) to the next in its list.
    fn on_fallback(&self, _call: &CallContext, _from: &str, _to: &str, _reason: &str) {}
    fn on_warning(&self, _call: &CallContext, _message: &str) {}
}

/// Hooks that do nothing.
pub struct NoHooks;
impl Hooks for NoHooks {}

/// A tool as a worker serves it: the definition with its compiled
/// arguments validator (from the registry), the handler and its hooks.
#[derive(Clone)]
pub struct ServedTool {
    pub tool: Arc<CompiledTool>,
    pub handler: Arc<dyn ToolHandler>,
    pub hooks: Arc<dyn Hooks>,
}

impl ServedTool {
    pub fn new(tool: Arc<CompiledTool>, handler: Arc<dyn ToolHandler>) -> Self {
        Self {
            tool,
            handler,
            hooks: Arc::new(NoHooks),
        }
    }

    pub fn definition(&self) -> &ToolDefinition {
        &self.tool.definition
    }

    pub fn with_hooks(mut self, hooks: Arc<dyn Hooks>) -> Self {
        self.hooks = hooks;
        self
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("configuration: {0}")]
    Config(String),
    #[error("NATS: {0}")]
    Nats(String),
}

/// How a worker runs.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// Shown in the services API and logs, e.g. `retrieval`.
    pub name: String,
    pub subjects: Subjects,
    /// Jobs executed at once by this process, across its tools.
    pub concurrency: usize,
    /// Attempts before a job is terminated and dead-lettered.
    pub max_attempts: u32,
    /// Delay before a failed attempt is delivered again.
    pub retry_delay: Duration,
    /// The consumer's ack wait; in-progress acks go out at half of it.
    pub ack_wait: Duration,
}

impl WorkerConfig {
    pub fn new(name: &str, subjects: Subjects) -> Self {
        Self {
            name: name.to_string(),
            subjects,
            concurrency: 16,
            max_attempts: 3,
            retry_delay: Duration::from_millis(500),
            ack_wait: Duration::from_secs(30),
        }
    }
}

/// Creates the tool-job stream if it does not exist.
pub async fn ensure_tools_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<stream::Stream, WorkerError> {
    js.get_or_create_stream(stream::Config {
        name: subjects.tools_stream(),
        subjects: vec![subjects.tools_all()],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        duplicate_window: Duration::from_secs(120),
        max_message_size: crate::protocol::MAX_JOB_BYTES as i32 + 64 * 1024,
        // Past the longest chat deadline (1 h) nobody waits for a result.
        max_age: Duration::from_secs(2 * 3600),
        ..Default::default()
    })
    .await
    .map_err(|e| WorkerError::Nats(format!("tool stream {}: {e}", subjects.tools_stream())))
}

/// Runs a worker until `shutdown` is cancelled, then stops pulling and lets
/// in-flight jobs finish (the caller bounds that with its grace period).
pub async fn run(
    client: async_nats::Client,
    store: CitationStore,
    tools: Vec<ServedTool>,
    config: WorkerConfig,
    metrics: WorkerMetrics,
    shutdown: CancellationToken,
) -> Result<(), WorkerError> {
    run_with_ready(client, store, tools, config, metrics, shutdown, None).await
}

/// [`run`], telling `ready` once every consumer and endpoint is in place.
#[allow(clippy::too_many_arguments)]
pub async fn run_with_ready(
    client: async_nats::Client,
    store: CitationStore,
    tools: Vec<ServedTool>,
    config: WorkerConfig,
    metrics: WorkerMetrics,
    shutdown: CancellationToken,
    ready: Option<tokio::sync::oneshot::Sender<()>>,
) -> Result<(), WorkerError> {
    if tools.is_empty() {
        return Err(WorkerError::Config(
            "a worker needs at least one tool".into(),
        ));
    }
    let js = jetstream::new(client.clone());
    let stream = ensure_tools_stream(&js, &config.subjects).await?;
    let permits = Arc::new(Semaphore::new(config.concurrency.max(1)));
    let tracker = TaskTracker::new();

    let service = client
        .service_builder()
        .description(format!("toolfleet worker: {}", config.name))
        .metadata(HashMap::from([("worker".to_string(), config.name.clone())]))
        .start(config.subjects.worker_service(), env!("CARGO_PKG_VERSION"))
        .await
        .map_err(|e| WorkerError::Nats(format!("services API: {e}")))?;

    let shared = Arc::new(Shared {
        client: client.clone(),
        store,
        metrics,
        config: config.clone(),
    });

    for tool in tools {
        let tool = Arc::new(tool);
        let consumer: jetstream::consumer::Consumer<pull::Config> = stream
            .get_or_create_consumer(
                &config.subjects.tool_consumer(&tool.definition().id),
                pull::Config {
                    durable_name: Some(config.subjects.tool_consumer(&tool.definition().id)),
                    filter_subject: config.subjects.tool(&tool.definition().id),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: config.ack_wait,
                    // Our own cap terminates first; this is the backstop for a
                    // job that kills its worker every time.
                    max_deliver: i64::from(config.max_attempts) + 2,
                    max_ack_pending: 10_000,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| {
                WorkerError::Nats(format!("consumer for {}: {e}", tool.definition().id))
            })?;

        let endpoint = service
            .endpoint_builder()
            .name(&tool.definition().function.name)
            .metadata(HashMap::from([
                ("toolId".to_string(), tool.definition().id.to_string()),
                (
                    "delivery".to_string(),
                    format!("{:?}", tool.definition().delivery).to_lowercase(),
                ),
            ]))
            .add(config.subjects.tool_direct(&tool.definition().id))
            .await
            .map_err(|e| {
                WorkerError::Nats(format!("endpoint for {}: {e}", tool.definition().id))
            })?;

        info!(tool = %tool.definition().id, worker = %config.name, "serving tool");
        {
            let (tool, shared) = (tool.clone(), shared.clone());
            tracker.spawn(crate::jobs::pull_bounded(
                consumer,
                permits.clone(),
                tracker.clone(),
                shutdown.clone(),
                tool.definition().id.to_string(),
                config.ack_wait / 2,
                move |msg| {
                    let (tool, shared) = (tool.clone(), shared.clone());
                    async move { handle_jetstream(msg, &tool, &shared).await }
                },
            ));
        }
        tracker.spawn(direct_loop(
            endpoint,
            tool,
            shared.clone(),
            permits.clone(),
            tracker.clone(),
            shutdown.clone(),
        ));
    }

    if let Some(ready) = ready {
        let _ = ready.send(());
    }
    shutdown.cancelled().await;
    tracker.close();
    tracker.wait().await;
    let _ = service.stop().await;
    Ok(())
}

struct Shared {
    client: async_nats::Client,
    store: CitationStore,
    metrics: WorkerMetrics,
    config: WorkerConfig,
}

async fn direct_loop(
    mut endpoint: async_nats::service::endpoint::Endpoint,
    tool: Arc<ServedTool>,
    shared: Arc<Shared>,
    permits: Arc<Semaphore>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
) {
    loop {
        let request = tokio::select! {
            _ = shutdown.cancelled() => break,
            r = endpoint.next() => match r { Some(r) => r, None => break },
        };
        let Ok(permit) = permits.clone().acquire_owned().await else {
            break;
        };
        let tool = tool.clone();
        let shared = shared.clone();
        tracker.spawn(async move {
            let headers = request.message.headers.clone().unwrap_or_default();
            let mut outcome = process(&headers, &request.message.payload, 1, &tool, &shared).await;
            // Direct delivery has no redelivery: a failure that JetStream
            // would retry is the caller's error result now.
            if outcome.result.is_none()
                && let Some(call) = &outcome.call
            {
                let message = outcome
                    .error
                    .clone()
                    .unwrap_or_else(|| "the tool job failed".into());
                outcome.result = Some(error_result(call, 1, 0, &outcome.code, &message));
            }
            if let Some(result) = &outcome.result {
                let _ = request
                    .respond(Ok(encode(&ToolReply::Result(result.clone()))))
                    .await;
            } else {
                let _ = request
                    .respond(Err(async_nats::service::error::Error {
                        status: outcome.code.clone(),
                        code: 400,
                    }))
                    .await;
            }
            drop(permit);
        });
    }
    let _ = endpoint.stop().await;
}

/// What to do with a message after processing.
enum Disposition {
    Ack,
    /// Hand back for another attempt after the delay.
    Retry(Duration),
    /// Never again: terminate and publish a dead letter.
    Terminate,
}

struct Outcome {
    /// The result to publish, if there is a caller to tell.
    result: Option<ToolResult>,
    disposition: Disposition,
    code: String,
    error: Option<String>,
    call: Option<CallContext>,
}

async fn handle_jetstream(msg: jetstream::Message, tool: &ServedTool, shared: &Shared) {
    let (attempt, sequence) = match msg.info() {
        Ok(i) => (
            u32::try_from(i.delivered).unwrap_or(1).max(1),
            i.stream_sequence,
        ),
        Err(_) => (1, 0),
    };
    let headers = msg.headers.clone().unwrap_or_default();
    let tool_label = tool.definition().id.to_string();

    // In-progress acks keep a long job from being redelivered to another
    // worker while this one is still on it.
    let keep_alive = crate::jobs::keep_alive(&msg, shared.config.ack_wait / 2);
    let mut outcome = process(&headers, &msg.payload, attempt, tool, shared).await;
    drop(keep_alive);

    if matches!(outcome.disposition, Disposition::Retry(_)) && attempt >= shared.config.max_attempts
    {
        outcome.disposition = Disposition::Terminate;
    }
    match &outcome.disposition {
        Disposition::Retry(delay) => {
            shared
                .metrics
                .tool_job_retries
                .with_label_values(&[tool_label.as_str()])
                .inc();
            warn!(tool = %tool_label, attempt, error = ?outcome.error, "attempt failed; will retry");
            let _ = msg.ack_with(AckKind::Nak(Some(*delay))).await;
        }
        Disposition::Ack => {
            if let Some(result) = &outcome.result {
                publish_result(shared, outcome.call.as_ref(), result).await;
            }
            let _ = msg.ack().await;
        }
        Disposition::Terminate => {
            // The caller always gets an answer, even for a dead job.
            let result = outcome.result.clone().or_else(|| {
                outcome.call.as_ref().map(|c| {
                    error_result(
                        c,
                        attempt,
                        0,
                        &outcome.code,
                        outcome.error.as_deref().unwrap_or("the tool job failed"),
                    )
                })
            });
            if let (Some(result), Some(call)) = (&result, outcome.call.as_ref()) {
                let mut result = result.clone();
                if result.status == ToolStatus::Ok {
                    result = error_result(
                        call,
                        attempt,
                        result.duration_ms,
                        &outcome.code,
                        "the tool job failed",
                    );
                }
                publish_result(shared, Some(call), &result).await;
            }
            let _ = msg.ack_with(AckKind::Term).await;
            let dead = DeadLetter {
                kind: DeadLetterKind::Tool,
                stream: shared.config.subjects.tools_stream(),
                stream_sequence: sequence,
                invocation_id: outcome
                    .call
                    .as_ref()
                    .map(|c| c.invocation.invocation_id.clone()),
                call_id: outcome.call.as_ref().map(|c| c.call_id.clone()),
                tool_id: Some(tool_label.clone()),
                attempts: attempt,
                code: outcome.code.clone(),
                error: outcome.error.clone().unwrap_or_default(),
                headers: safe_headers(&headers),
            };
            shared
                .metrics
                .dead_letters
                .with_label_values(&["tool"])
                .inc();
            let _ = shared
                .client
                .publish(
                    shared.config.subjects.dead_letter(DeadLetterKind::Tool),
                    encode(&dead),
                )
                .await;
            warn!(tool = %tool_label, attempt, code = %outcome.code, "tool job dead-lettered");
        }
    }
}

/// Headers worth keeping in a dead letter: the context, never settings.
fn safe_headers(h: &async_nats::HeaderMap) -> std::collections::BTreeMap<String, String> {
    h.iter()
        .filter(|(k, _)| {
            let k = k.to_string();
            k.starts_with("Toolfleet-") || k == "traceparent" || k == "Nats-Msg-Id"
        })
        .filter_map(|(k, v)| v.first().map(|v| (k.to_string(), v.to_string())))
        .collect()
}

async fn publish_result(shared: &Shared, call: Option<&CallContext>, result: &ToolResult) {
    let Some(call) = call else { return };
    let mut payload = encode(&ToolReply::Result(result.clone()));
    // A result too big for the server would never arrive: the caller gets
    // a small error result instead of waiting out its timeout.
    let limit = shared.client.server_info().max_payload;
    if limit > 0 && payload.len() > limit {
        let message = format!(
            "the tool's result is {} bytes; the NATS server takes at most {limit}",
            payload.len()
        );
        warn!(tool = %call.tool_id, "{message}");
        payload = encode(&ToolReply::Result(error_result(
            call,
            result.attempt,
            result.duration_ms,
            "result_too_large",
            &message,
        )));
    }
    let mut headers = call.invocation.to_headers();
    headers.insert(crate::protocol::headers::CALL_ID, call.call_id.as_str());
    if let Err(e) = shared
        .client
        .publish_with_headers(call.reply_to.clone(), headers, payload)
        .await
    {
        warn!(error = %e, "cannot publish the tool result");
    }
}

fn error_result(
    call: &CallContext,
    attempt: u32,
    duration_ms: u64,
    code: &str,
    message: &str,
) -> ToolResult {
    status_result(
        call,
        attempt,
        duration_ms,
        ToolStatus::Error,
        code,
        message,
        Vec::new(),
    )
}

fn status_result(
    call: &CallContext,
    attempt: u32,
    duration_ms: u64,
    status: ToolStatus,
    code: &str,
    message: &str,
    violations: Vec<Violation>,
) -> ToolResult {
    ToolResult {
        invocation_id: call.invocation.invocation_id.clone(),
        call_id: call.call_id.clone(),
        tool_id: call.tool_id.to_string(),
        status,
        content: message.to_string(),
        data: None,
        error: Some(ToolErrorBody {
            code: code.to_string(),
            message: message.to_string(),
            violations,
        }),
        references: Vec::new(),
        attempt,
        duration_ms,
        replayed: false,
    }
}

/// Processes one job. Shared by JetStream and direct delivery.
async fn process(
    headers: &async_nats::HeaderMap,
    payload: &[u8],
    attempt: u32,
    tool: &ServedTool,
    shared: &Shared,
) -> Outcome {
    let tool_label = tool.definition().id.to_string();
    let count = |outcome: &str| {
        shared
            .metrics
            .tool_jobs
            .with_label_values(&[tool_label.as_str(), outcome])
            .inc();
    };

    let mut call = match CallContext::from_headers(headers) {
        Ok(c) => c,
        Err(e) => {
            count("error");
            warn!(tool = %tool_label, error = %e, "tool job with bad headers");
            return Outcome {
                result: None,
                disposition: Disposition::Terminate,
                code: e.code().to_string(),
                error: Some(e.to_string()),
                call: None,
            };
        }
    };
    call.attempt = attempt;
    let span = tracing::info_span!(
        "tool_job",
        invocation_id = %call.invocation.invocation_id,
        call_id = %call.call_id,
        tool_id = %tool_label,
        attempt
    );
    process_call(call, payload, attempt, tool, shared, &count)
        .instrument(span)
        .await
}

async fn process_call(
    call: CallContext,
    payload: &[u8],
    attempt: u32,
    tool: &ServedTool,
    shared: &Shared,
    count: &(dyn Fn(&str) + Sync),
) -> Outcome {
    let done = |result: ToolResult, disposition: Disposition, code: &str| Outcome {
        error: result.error.as_ref().map(|e| e.message.clone()),
        result: Some(result),
        disposition,
        code: code.to_string(),
        call: Some(call.clone()),
    };

    if call.tool_id != tool.definition().id {
        count("error");
        let msg = format!(
            "this subject serves {}, but the job names {}",
            tool.definition().id,
            call.tool_id
        );
        return done(
            error_result(&call, attempt, 0, "wrong_tool", &msg),
            Disposition::Terminate,
            "wrong_tool",
        );
    }

    // A redelivered (or re-published) job returns what the first attempt
    // stored, and writes no second set of citations.
    {
        match shared
            .store
            .ledger_get(&call.invocation.invocation_id, &call.call_id)
            .await
        {
            Ok(Some(mut stored)) => {
                count("redelivered");
                stored.replayed = true;
                stored.attempt = attempt;
                return done(stored, Disposition::Ack, "ok");
            }
            Ok(None) => {}
            Err(e) => {
                return Outcome {
                    result: None,
                    disposition: Disposition::Retry(shared.config.retry_delay),
                    code: "store_unavailable".into(),
                    error: Some(e.to_string()),
                    call: Some(call.clone()),
                };
            }
        }
    }

    let job: ToolJob = match Envelope::ToolJob.decode(payload) {
        Ok(j) => j,
        Err(e) => {
            count("error");
            let code = e.code();
            let msg = format!("malformed tool job: {e}");
            return done(
                error_result(&call, attempt, 0, code, &msg),
                Disposition::Ack,
                code,
            );
        }
    };

    // Invalid arguments: a model-readable error at once, no side effect,
    // nothing written to Redis, never retried.
    if let Err(violations) = tool.tool.validate_arguments(&job.arguments) {
        count("invalid_arguments");
        let msg = format!(
            "Invalid arguments for {}: {}",
            tool.definition().function.name,
            crate::schema::describe(&violations)
        );
        let r = status_result(
            &call,
            attempt,
            0,
            ToolStatus::Error,
            "invalid_arguments",
            &msg,
            violations,
        );
        return done(r, Disposition::Ack, "invalid_arguments");
    }

    if let (Some(min), conf) = (
        tool.definition().min_provider_confidence,
        call.invocation.provider_confidence,
    ) && conf.unwrap_or(0.0) < min
    {
        count("blocked");
        let msg = format!(
            "{} needs provider confidence of at least {min}; this invocation has {}",
            tool.definition().function.name,
            conf.map(|c| c.to_string()).unwrap_or_else(|| "none".into())
        );
        let r = status_result(
            &call,
            attempt,
            0,
            ToolStatus::Blocked,
            "provider_confidence",
            &msg,
            Vec::new(),
        );
        return done(r, Disposition::Ack, "blocked");
    }

    let mut budget = tool.definition().timeout();
    if let Some(deadline) = call.invocation.deadline_ms {
        let left = deadline.saturating_sub(crate::protocol::now_ms());
        if left == 0 {
            count("timeout");
            let r = status_result(
                &call,
                attempt,
                0,
                ToolStatus::Timeout,
                "deadline_exceeded",
                "the invocation's deadline passed before the tool could run",
                Vec::new(),
            );
            return done(r, Disposition::Ack, "timeout");
        }
        budget = budget.min(Duration::from_millis(left));
    }

    let ctx = ToolCtx {
        call: call.clone(),
        store: shared.store.clone(),
        client: shared.client.clone(),
        cited: Mutex::new(Vec::new()),
        cites: std::sync::atomic::AtomicU32::new(0),
        metrics: shared.metrics.clone(),
        cancel: CancellationToken::new(),
    };
    let tool_label = tool.definition().id.to_string();
    let in_flight = shared
        .metrics
        .tool_jobs_in_flight
        .with_label_values(&[tool_label.as_str()]);
    in_flight.inc();
    tool.hooks.on_start(&call);
    let started = Instant::now();
    // A panicking handler is a failed call, not a stuck job.
    let call_fut =
        std::panic::AssertUnwindSafe(tool.handler.call(&ctx, job.arguments)).catch_unwind();
    let ran = match tokio::time::timeout(budget, call_fut).await {
        Ok(Ok(r)) => Ok(r),
        Ok(Err(_panic)) => Ok(Err(ToolError::Failed {
            message: "the tool failed unexpectedly (it panicked); see the worker's log".into(),
            retryable: false,
        })),
        Err(e) => Err(e),
    };
    ctx.cancel.cancel();
    let elapsed = started.elapsed();
    in_flight.dec();
    shared
        .metrics
        .tool_job_duration
        .with_label_values(&[tool_label.as_str()])
        .observe(elapsed.as_secs_f64());
    let duration_ms = elapsed.as_millis() as u64;

    let (result, disposition, code) = match ran {
        Ok(Ok(output)) => {
            let r = ToolResult {
                invocation_id: call.invocation.invocation_id.clone(),
                call_id: call.call_id.clone(),
                tool_id: tool_label.clone(),
                status: ToolStatus::Ok,
                content: output.content,
                data: output.data,
                error: None,
                references: ctx.take_cited(),
                attempt,
                duration_ms,
                replayed: false,
            };
            (r, Disposition::Ack, "ok")
        }
        Ok(Err(e)) => {
            tool.hooks.on_error(&call, &e);
            if e.is_retryable() {
                count("error");
                return Outcome {
                    result: None,
                    disposition: Disposition::Retry(shared.config.retry_delay),
                    code: e.code().to_string(),
                    error: Some(e.to_string()),
                    call: Some(call.clone()),
                };
            }
            let status = match e {
                ToolError::Blocked(_) => ToolStatus::Blocked,
                _ => ToolStatus::Error,
            };
            let r = status_result(
                &call,
                attempt,
                duration_ms,
                status,
                e.code(),
                &e.to_string(),
                Vec::new(),
            );
            (r, Disposition::Ack, e.code())
        }
        Err(_) => {
            let e = ToolError::failed(format!(
                "the tool did not finish within {} ms",
                budget.as_millis()
            ));
            tool.hooks.on_error(&call, &e);
            let r = status_result(
                &call,
                attempt,
                duration_ms,
                ToolStatus::Timeout,
                "timeout",
                &e.to_string(),
                Vec::new(),
            );
            (r, Disposition::Ack, "timeout")
        }
    };
    count(result.status.as_str());
    // The ledger makes a redelivery of this job return this result. If it
    // cannot be written the result still goes out: a later duplicate will
    // run again but reuse its citation indices.
    if let Err(e) = shared.store.ledger_put(&result).await {
        tool.hooks
            .on_warning(&call, &format!("result ledger not written: {e}"));
        warn!(error = %e, "result ledger not written");
    }
    if result.status == ToolStatus::Ok {
        tool.hooks.on_complete(&call, &result);
    }
    done(result, disposition, code)
}

/// The tools live workers serve right now, by tool id, from the NATS
/// services API (`$SRV.INFO.toolfleet-worker`). Collects answers for `wait`.
pub async fn live_tools(
    client: &async_nats::Client,
    subjects: &Subjects,
    wait: Duration,
) -> Result<std::collections::HashSet<String>, WorkerError> {
    let inbox = client.new_inbox();
    let mut sub = client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| WorkerError::Nats(e.to_string()))?;
    client
        .publish_with_reply(
            format!("$SRV.INFO.{}", subjects.worker_service()),
            inbox,
            bytes::Bytes::new(),
        )
        .await
        .map_err(|e| WorkerError::Nats(e.to_string()))?;
    client
        .flush()
        .await
        .map_err(|e| WorkerError::Nats(e.to_string()))?;
    let mut live = std::collections::HashSet::new();
    let deadline = tokio::time::Instant::now() + wait;
    while let Ok(Some(msg)) = tokio::time::timeout_at(deadline, sub.next()).await {
        if let Ok(info) = serde_json::from_slice::<async_nats::service::Info>(&msg.payload) {
            for e in info.endpoints {
                if let Some(id) = e.metadata.get("toolId") {
                    live.insert(id.clone());
                }
            }
        }
    }
    Ok(live)
}
