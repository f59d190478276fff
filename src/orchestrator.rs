//! The orchestrator: takes chat jobs from the `TOOLFLEET_CHAT` work queue
//! with a bounded number in flight and runs one agentic loop per invocation.
//!
//! Per invocation: validate the job, build the context, offer the tools live
//! workers serve, stream a completion (text deltas become `delta` events),
//! publish every tool call as a JetStream tool job in parallel, await the
//! results on the invocation's reply inbox under per-call deadlines, append
//! them, repeat until the model answers or the round limit is hit; collect
//! references before the stream, after each tool batch and at the end;
//! publish `completed`; ack the chat job last. Every failure ends in an
//! `error` event with a code — never silence.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind, consumer::pull, stream};
use dashmap::DashMap;
use futures::{FutureExt, StreamExt};
use serde_json::Value;
use tokio::sync::{RwLock, Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, warn};

use crate::budget::TokenBudget;
use crate::citations::CitationStore;
use crate::llm::{ChatRequest, LlmClient, Message, Usage};
use crate::metrics::OrchestratorMetrics;
use crate::profiles::{
    EnvSource, FleetConfig, LoopPolicy, ProcessEnv, ResolvedProfile, TruncatedPolicy,
};
use crate::protocol::{
    CallContext, ChatEvent, ChatEventBody, ChatJob, ChatRole, DeadLetter, DeadLetterKind, Envelope,
    InvocationContext, LlmCall, Reference, Subjects, ToolJob, ToolReply, ToolResult, ToolStatus,
    encode, salvage_invocation_id,
};
use crate::tools::{Delivery, ToolDefinition, ToolRegistry};

/// How the orchestrator runs. Model endpoints, prompts and loop policies
/// come from the profiles ([`FleetConfig`]), resolved per chat job.
#[derive(Clone)]
pub struct OrchestratorConfig {
    pub subjects: Subjects,
    pub profiles: Arc<FleetConfig>,
    /// Where API-key variables are read.
    pub env: Arc<dyn EnvSource + Send + Sync>,
    /// Chat jobs worked on at once by this process.
    pub max_in_flight: usize,
    /// Deadline of a chat job that names none.
    pub default_timeout: Duration,
    /// Added to a tool's own timeout while waiting for its result (queueing,
    /// transport).
    pub tool_wait_slack: Duration,
    /// How often the live worker catalog is refreshed.
    pub catalog_refresh: Duration,
    /// How long a catalog query collects answers.
    pub catalog_wait: Duration,
}

impl std::fmt::Debug for OrchestratorConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrchestratorConfig")
            .field("subjects", &self.subjects)
            .field(
                "profiles",
                &self.profiles.profiles.keys().collect::<Vec<_>>(),
            )
            .field("max_in_flight", &self.max_in_flight)
            .finish_non_exhaustive()
    }
}

impl OrchestratorConfig {
    pub fn new(subjects: Subjects, profiles: FleetConfig) -> Self {
        Self {
            subjects,
            profiles: Arc::new(profiles),
            env: Arc::new(ProcessEnv),
            max_in_flight: 32,
            default_timeout: Duration::from_secs(120),
            tool_wait_slack: Duration::from_secs(2),
            catalog_refresh: Duration::from_secs(2),
            catalog_wait: Duration::from_millis(250),
        }
    }
}

/// Ack wait of the chat consumer; running jobs send in-progress acks at a
/// third of it.
const CHAT_ACK_WAIT: Duration = Duration::from_secs(60);
const CHAT_PROGRESS_EVERY: Duration = Duration::from_secs(20);

/// How often a wait for tool results looks at the worker catalog.
const LIVENESS_CHECK: Duration = Duration::from_secs(1);

/// Deliveries of one chat job that are run (an orchestrator that dies
/// mid-way gets the job redelivered); the next one ends it with an error
/// event and a dead letter.
pub const MAX_CHAT_ATTEMPTS: u32 = 3;

pub const DEFAULT_SYSTEM_PROMPT: &str = "You are a helpful assistant with tools. When a tool result contains markers like [doc:3], cite the passages you use with those exact markers.";

#[derive(Debug, thiserror::Error)]
pub enum OrchestratorError {
    #[error("NATS: {0}")]
    Nats(String),
}

/// What every invocation shares.
struct Fleet {
    client: async_nats::Client,
    js: jetstream::Context,
    /// One client per deployment, built on first use.
    llms: DashMap<String, LlmClient>,
    registry: Arc<ToolRegistry>,
    store: CitationStore,
    metrics: OrchestratorMetrics,
    config: OrchestratorConfig,
    live: RwLock<HashSet<String>>,
    /// Counts catalog refreshes, so a wait can tell a new refresh from an
    /// old one.
    catalog_generation: std::sync::atomic::AtomicU64,
    /// Cancel tokens of the invocations running here. Tokens are keyed by
    /// invocation id; the number tells two runs of one id apart, so the end
    /// of one never removes the other's token.
    cancels: DashMap<String, (u64, CancellationToken)>,
    runs: std::sync::atomic::AtomicU64,
}

/// Creates the chat-job stream if it does not exist.
pub async fn ensure_chat_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<stream::Stream, OrchestratorError> {
    js.get_or_create_stream(stream::Config {
        name: subjects.chat_stream(),
        subjects: vec![subjects.chat_submit()],
        retention: stream::RetentionPolicy::WorkQueue,
        storage: stream::StorageType::File,
        duplicate_window: Duration::from_secs(120),
        max_message_size: crate::protocol::MAX_JOB_BYTES as i32 + 64 * 1024,
        // A job nobody took within a day has no one waiting for it.
        max_age: Duration::from_secs(24 * 3600),
        ..Default::default()
    })
    .await
    .map_err(|e| OrchestratorError::Nats(format!("chat stream {}: {e}", subjects.chat_stream())))
}

/// Runs the orchestrator until `shutdown`; then stops taking jobs and lets
/// invocations in flight finish.
pub async fn run(
    client: async_nats::Client,
    store: CitationStore,
    registry: ToolRegistry,
    config: OrchestratorConfig,
    metrics: OrchestratorMetrics,
    shutdown: CancellationToken,
) -> Result<(), OrchestratorError> {
    run_with_ready(client, store, registry, config, metrics, shutdown, None).await
}

/// [`run`], telling `ready` once the chat consumer is in place.
pub async fn run_with_ready(
    client: async_nats::Client,
    store: CitationStore,
    registry: ToolRegistry,
    config: OrchestratorConfig,
    metrics: OrchestratorMetrics,
    shutdown: CancellationToken,
    ready: Option<tokio::sync::oneshot::Sender<()>>,
) -> Result<(), OrchestratorError> {
    let js = jetstream::new(client.clone());
    let stream = ensure_chat_stream(&js, &config.subjects).await?;
    crate::worker::ensure_tools_stream(&js, &config.subjects)
        .await
        .map_err(|e| OrchestratorError::Nats(e.to_string()))?;
    let consumer: jetstream::consumer::Consumer<pull::Config> = stream
        .get_or_create_consumer(
            &config.subjects.chat_consumer(),
            pull::Config {
                durable_name: Some(config.subjects.chat_consumer()),
                filter_subject: config.subjects.chat_submit(),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: CHAT_ACK_WAIT,
                // One more than we run, so the delivery after the last
                // attempt can still end the invocation visibly.
                max_deliver: i64::from(MAX_CHAT_ATTEMPTS) + 1,
                max_ack_pending: 10_000,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| OrchestratorError::Nats(format!("chat consumer: {e}")))?;

    let mut cancel_sub = client
        .subscribe(config.subjects.chat_cancel_all())
        .await
        .map_err(|e| OrchestratorError::Nats(e.to_string()))?;

    let fleet = Arc::new(Fleet {
        client: client.clone(),
        js,
        llms: DashMap::new(),
        registry: Arc::new(registry),
        store,
        metrics,
        config: config.clone(),
        live: RwLock::new(HashSet::new()),
        catalog_generation: std::sync::atomic::AtomicU64::new(0),
        cancels: DashMap::new(),
        runs: std::sync::atomic::AtomicU64::new(0),
    });
    fleet.refresh_catalog().await;

    let tracker = TaskTracker::new();
    {
        let fleet = fleet.clone();
        let shutdown = shutdown.clone();
        tracker.spawn(async move {
            loop {
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(fleet.config.catalog_refresh) => fleet.refresh_catalog().await,
                }
            }
        });
    }
    {
        let fleet = fleet.clone();
        let shutdown = shutdown.clone();
        tracker.spawn(async move {
            loop {
                let msg = tokio::select! {
                    _ = shutdown.cancelled() => break,
                    m = cancel_sub.next() => match m { Some(m) => m, None => break },
                };
                if let Some(id) = msg.subject.as_str().rsplit('.').next()
                    && let Some(entry) = fleet.cancels.get(id)
                    && let (_, token) = &*entry
                {
                    info!(invocation_id = id, "cancel requested");
                    token.cancel();
                }
            }
        });
    }

    for w in config.profiles.warnings() {
        warn!("{w}");
    }
    info!(stream = %config.subjects.chat_stream(), profiles = config.profiles.profiles.len(), tools = fleet.registry.len(), "orchestrator taking chat jobs");
    if let Some(ready) = ready {
        let _ = ready.send(());
    }
    let permits = Arc::new(Semaphore::new(config.max_in_flight.max(1)));
    {
        let fleet = fleet.clone();
        crate::jobs::pull_bounded(
            consumer,
            permits,
            tracker.clone(),
            shutdown.clone(),
            config.subjects.chat_consumer(),
            CHAT_PROGRESS_EVERY,
            move |msg| {
                let fleet = fleet.clone();
                async move { fleet.handle(msg).await }
            },
        )
        .await;
    }
    tracker.close();
    tracker.wait().await;
    Ok(())
}

/// Why an invocation ended without an answer.
#[derive(Debug)]
struct Failure {
    code: String,
    message: String,
}

impl Failure {
    fn new(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            message: message.into(),
        }
    }
}

/// Publishes one invocation's events in order, numbering them.
struct Events {
    tx: mpsc::UnboundedSender<ChatEventBody>,
    task: tokio::task::JoinHandle<()>,
}

impl Events {
    fn start(client: async_nats::Client, subject: String, invocation_id: String) -> Self {
        let (tx, mut rx) = mpsc::unbounded_channel::<ChatEventBody>();
        let task = tokio::spawn(async move {
            let mut seq = 0;
            while let Some(body) = rx.recv().await {
                let event = ChatEvent {
                    invocation_id: invocation_id.clone(),
                    seq,
                    body,
                };
                seq += 1;
                let terminal = event.body.is_terminal();
                let mut payload = encode(&event);
                // A terminal event too big for the server would leave the
                // client waiting: say so in a small one instead.
                let limit = client.server_info().max_payload;
                if terminal && limit > 0 && payload.len() > limit {
                    payload = encode(&ChatEvent {
                        invocation_id: invocation_id.clone(),
                        seq: event.seq,
                        body: ChatEventBody::Error {
                            code: "answer_too_large".into(),
                            message: format!(
                                "the answer event is {} bytes; the NATS server takes at most {limit}",
                                payload.len()
                            ),
                        },
                    });
                }
                if let Err(e) = client.publish(subject.clone(), payload).await {
                    warn!(error = %e, "cannot publish a chat event");
                }
            }
            let _ = client.flush().await;
        });
        Self { tx, task }
    }

    fn send(&self, body: ChatEventBody) {
        let _ = self.tx.send(body);
    }

    /// Waits until every event sent so far is published.
    async fn close(self) {
        drop(self.tx);
        let _ = self.task.await;
    }
}

impl Fleet {
    async fn refresh_catalog(&self) {
        match crate::worker::live_tools(
            &self.client,
            &self.config.subjects,
            self.config.catalog_wait,
        )
        .await
        {
            Ok(live) => {
                *self.live.write().await = live;
                self.catalog_generation
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            Err(e) => warn!(error = %e, "cannot refresh the worker catalog"),
        }
    }

    async fn is_live(&self, id: &str) -> bool {
        if self.live.read().await.contains(id) {
            return true;
        }
        // A worker may have started since the last refresh.
        self.refresh_catalog().await;
        self.live.read().await.contains(id)
    }

    async fn handle(self: &Arc<Self>, msg: jetstream::Message) {
        let started = Instant::now();
        let (attempt, sequence, published_ms) = match msg.info() {
            Ok(i) => (
                u32::try_from(i.delivered).unwrap_or(1),
                i.stream_sequence,
                u64::try_from(i.published.unix_timestamp_nanos() / 1_000_000).ok(),
            ),
            Err(_) => (1, 0, None),
        };
        let job: ChatJob = match Envelope::ChatJob.decode(&msg.payload) {
            Ok(j) => j,
            Err(e) => {
                self.metrics
                    .chat_jobs
                    .with_label_values(&["malformed"])
                    .inc();
                let invocation_id = salvage_invocation_id(&msg.payload, msg.headers.as_ref());
                warn!(invocation_id = ?invocation_id, error = %e, "malformed chat job");
                self.dead_letter(
                    &msg,
                    invocation_id,
                    attempt,
                    sequence,
                    "malformed_job",
                    e.code(),
                    &e.to_string(),
                )
                .await;
                return;
            }
        };
        if attempt > MAX_CHAT_ATTEMPTS {
            self.metrics.chat_jobs.with_label_values(&["error"]).inc();
            let message = format!(
                "the job was delivered {attempt} times without finishing (an orchestrator stopped while running it each time)"
            );
            warn!(invocation_id = %job.invocation_id, "{message}");
            self.dead_letter(
                &msg,
                Some(job.invocation_id.clone()),
                attempt,
                sequence,
                "too_many_attempts",
                "too_many_attempts",
                &message,
            )
            .await;
            return;
        }

        let id = job.invocation_id.clone();
        let span = tracing::info_span!("chat_job", invocation_id = %id, attempt);
        async {
            self.metrics.chat_jobs_in_flight.inc();
            let cancel = CancellationToken::new();
            let run = self.runs.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            self.cancels.insert(id.clone(), (run, cancel.clone()));
            let events = Events::start(self.client.clone(), self.config.subjects.chat_events(&id), id.clone());

            // Long invocations must not be redelivered to another
            // orchestrator while this one still works on them.
            let keep_alive = crate::jobs::keep_alive(&msg, CHAT_PROGRESS_EVERY);

            // The client's clock starts at submission: time spent queued in
            // the stream counts.
            let timeout = job.timeout_ms.map(Duration::from_millis).unwrap_or(self.config.default_timeout);
            let now = crate::protocol::now_ms();
            let deadline_ms = published_ms.unwrap_or(now).min(now) + timeout.as_millis() as u64;
            let left = Duration::from_millis(deadline_ms.saturating_sub(now));
            let outcome = tokio::select! {
                // A bug must end the invocation with an error event, not
                // leave it silent.
                r = std::panic::AssertUnwindSafe(self.invoke(&job, deadline_ms, &events)).catch_unwind(), if !left.is_zero() => {
                    r.unwrap_or_else(|_| Err(Failure::new("internal_error", "the orchestrator failed unexpectedly; see its log")))
                }
                _ = tokio::time::sleep(left) => Err(Failure::new("deadline_exceeded", format!("no answer within {} ms of submission", timeout.as_millis()))),
                _ = cancel.cancelled() => Err(Failure::new("cancelled", "the invocation was cancelled")),
            };
            let label = match outcome {
                Ok(()) => "completed",
                Err(f) => {
                    warn!(code = %f.code, message = %f.message, "invocation failed");
                    events.send(ChatEventBody::Error { code: f.code, message: f.message });
                    "error"
                }
            };
            events.close().await;
            drop(keep_alive);
            // Ack last: only after the terminal event is out.
            let _ = msg.ack().await;
            self.cancels.remove_if(&id, |_, (r, _)| *r == run);
            self.metrics.chat_jobs.with_label_values(&[label]).inc();
            self.metrics.chat_jobs_in_flight.dec();
            self.metrics.chat_job_duration.observe(started.elapsed().as_secs_f64());
        }
        .instrument(span)
        .await
    }

    /// Ends a chat job that will not run: an `error` event when the
    /// invocation id is known, a dead letter, and `term`.
    #[allow(clippy::too_many_arguments)]
    async fn dead_letter(
        &self,
        msg: &jetstream::Message,
        invocation_id: Option<String>,
        attempt: u32,
        sequence: u64,
        event_code: &str,
        code: &str,
        error: &str,
    ) {
        if let Some(id) = &invocation_id {
            let events = Events::start(
                self.client.clone(),
                self.config.subjects.chat_events(id),
                id.clone(),
            );
            events.send(ChatEventBody::Error {
                code: event_code.into(),
                message: error.to_string(),
            });
            events.close().await;
        }
        let dead = DeadLetter {
            kind: DeadLetterKind::Chat,
            stream: self.config.subjects.chat_stream(),
            stream_sequence: sequence,
            invocation_id,
            call_id: None,
            tool_id: None,
            attempts: attempt,
            code: code.to_string(),
            error: error.to_string(),
            headers: Default::default(),
        };
        self.metrics.dead_letters.with_label_values(&["chat"]).inc();
        let _ = self
            .client
            .publish(
                self.config.subjects.dead_letter(DeadLetterKind::Chat),
                encode(&dead),
            )
            .await;
        let _ = msg.ack_with(AckKind::Term).await;
    }

    /// The client of a resolved profile's deployment, built once.
    fn llm_for(&self, resolved: &ResolvedProfile) -> Result<LlmClient, Failure> {
        if let Some(c) = self.llms.get(&resolved.deployment_name) {
            return Ok(c.clone());
        }
        let client = LlmClient::new(resolved.llm_config()).map_err(|e| {
            Failure::new(
                "bad_deployment",
                format!("deployment {:?}: {e}", resolved.deployment_name),
            )
        })?;
        self.llms
            .insert(resolved.deployment_name.clone(), client.clone());
        Ok(client)
    }

    async fn invoke(
        &self,
        job: &ChatJob,
        deadline_ms: u64,
        events: &Events,
    ) -> Result<(), Failure> {
        // No resolvable deployment is fatal for the job, at once.
        let resolved = self
            .config
            .profiles
            .resolve(job.profile.as_deref(), &*self.config.env)
            .map_err(|e| Failure::new(e.code(), e.to_string()))?;
        if resolved.fell_back || resolved.orchestrator_fell_back {
            info!(profile = %resolved.name, requested = ?resolved.requested, orchestrator = %resolved.orchestrator, "profile or orchestrator fell back to the default");
        }
        let llm = self.llm_for(&resolved)?;
        let profile = &resolved.profile;
        let policy = &profile.policy;
        let model = resolved.model().to_string();

        let ctx = InvocationContext {
            invocation_id: job.invocation_id.clone(),
            tenant: job.tenant.clone(),
            user: job.user.clone(),
            profile: Some(resolved.name.clone()),
            provider: job.provider.clone(),
            connection: job.connection.clone(),
            resource: job.resource.clone(),
            data_source_id: job
                .data_source_id
                .clone()
                .or_else(|| profile.data_source.clone()),
            provider_confidence: job.provider_confidence,
            deadline_ms: Some(deadline_ms),
            traceparent: job.traceparent.clone(),
        };

        let mut messages = Vec::with_capacity(job.messages.len() + 2);
        messages.push(Message::System {
            content: profile
                .system_prompt
                .clone()
                .unwrap_or_else(|| DEFAULT_SYSTEM_PROMPT.to_string()),
        });
        for m in &job.messages {
            messages.push(match m.role {
                ChatRole::System => Message::System {
                    content: m.content.clone(),
                },
                ChatRole::User => Message::User {
                    content: m.content.clone(),
                },
                ChatRole::Assistant => Message::Assistant {
                    content: Some(m.content.clone()),
                    tool_calls: Vec::new(),
                    opaque: Vec::new(),
                },
            });
        }

        let live = self.live.read().await.clone();
        let offered: Vec<&ToolDefinition> = self
            .registry
            .iter()
            .filter(|d| live.contains(&d.id.to_string()))
            .collect();
        events.send(ChatEventBody::Started {
            model: model.clone(),
            profile: Some(resolved.name.clone()),
            tools: offered.iter().map(|d| d.id.to_string()).collect(),
        });
        let tools: Vec<crate::llm::ToolSpec> = offered.iter().map(|d| d.tool_spec()).collect();
        let budget = policy
            .max_tool_result_tokens
            .map(|cap| (TokenBudget::for_model(&model), cap));

        let mut seen_refs: HashSet<u64> = HashSet::new();
        self.collect_references(&ctx.invocation_id, &mut seen_refs, events)
            .await?;

        let inbox = self.client.new_inbox();
        let mut replies = self
            .client
            .subscribe(format!("{inbox}.*"))
            .await
            .map_err(|e| Failure::new("nats_unavailable", e.to_string()))?;

        let mut ledger = UsageLedger::default();
        // Rounds in a row whose tool calls all failed.
        let mut failed_rounds = 0u32;
        // Set when a cap is hit: from then on the model gets no tools and is
        // told to answer with what it has.
        let mut stop_tools: Option<String> = None;
        for round in 1..=policy.max_rounds {
            if stop_tools.is_none() && round == policy.max_rounds {
                stop_tools = Some(format!("this is the last of {} rounds", policy.max_rounds));
                self.metrics
                    .loop_limits
                    .with_label_values(&["rounds"])
                    .inc();
            }
            let tools_allowed = stop_tools.is_none();
            if let Some(reason) = &stop_tools
                && !matches!(messages.last(), Some(Message::System { .. }))
            {
                messages.push(Message::System {
                    content: format!("Tool limit reached ({reason}). Do not call any more tools: answer now with what you have, and say what you could not find out."),
                });
            }
            let request = ChatRequest {
                model: model.clone(),
                messages: messages.clone(),
                // The tools stay in the request (the prompt prefix, and its
                // cache, do not change); `tool_choice: none` forbids them.
                tools: tools.clone(),
                tool_choice: (!tools_allowed).then_some(crate::llm::ToolChoice::None),
                parallel_tool_calls: policy.parallel_tool_calls,
                temperature: profile.temperature,
                max_tokens: None,
            };
            let llm_started = Instant::now();
            let completion = llm
                .stream_chat(&request, |text| {
                    events.send(ChatEventBody::Delta {
                        text: text.to_string(),
                    })
                })
                .await;
            self.metrics
                .llm_request_duration
                .with_label_values(&[model.as_str()])
                .observe(llm_started.elapsed().as_secs_f64());
            let attempts = match &completion {
                Ok(c) => c.attempts,
                Err(e) => e.attempts(),
            };
            if attempts > 1 {
                self.metrics
                    .llm_retries
                    .with_label_values(&[model.as_str()])
                    .inc_by(u64::from(attempts - 1));
            }
            let completion = match completion {
                Ok(c) => {
                    self.metrics
                        .llm_requests
                        .with_label_values(&[model.as_str(), "ok"])
                        .inc();
                    c
                }
                Err(e) => {
                    self.metrics
                        .llm_requests
                        .with_label_values(&[model.as_str(), e.code()])
                        .inc();
                    return Err(Failure::new(format!("llm_{}", e.code()), e.to_string()));
                }
            };
            let usage = completion.usage.unwrap_or_default();
            let cost = self.config.profiles.prices.cost(&model, &usage);
            self.record_usage(&model, PURPOSE_CONVERSATION, &usage, cost);
            ledger.add(&model, PURPOSE_CONVERSATION, usage, cost, attempts);

            if completion.is_truncated() && !completion.tool_calls.is_empty() {
                self.metrics
                    .loop_limits
                    .with_label_values(&["truncated_tool_call"])
                    .inc();
                match policy.on_truncated_tool_call {
                    TruncatedPolicy::Error => {
                        return Err(Failure::new(
                            "truncated_tool_call",
                            "the model ran out of tokens while writing a tool call; its arguments are incomplete and were not run",
                        ));
                    }
                    TruncatedPolicy::AskAgain => {
                        messages.push(Message::System {
                            content: "Your last tool call was cut off at the output token limit, so it was not run. Call the tool again with shorter arguments, or answer without it.".into(),
                        });
                        continue;
                    }
                }
            }
            if completion.tool_calls.is_empty() {
                let text = match (&completion.refusal, completion.text.is_empty()) {
                    (Some(r), true) => r.clone(),
                    _ => completion.text.clone(),
                };
                self.collect_references(&ctx.invocation_id, &mut seen_refs, events)
                    .await?;
                let references = self
                    .store
                    .references(&ctx.invocation_id)
                    .await
                    .map_err(|e| Failure::new("citation_store_unavailable", e.to_string()))?;
                events.send(ChatEventBody::Completed {
                    text,
                    references,
                    usage: ledger.total,
                    cost_usd: ledger.cost,
                    llm_calls: ledger.calls,
                    rounds: round,
                });
                return Ok(());
            }
            if !tools_allowed {
                return Err(Failure::new(
                    "round_limit",
                    format!(
                        "the model asked for tools after being told to answer ({}); round {round} of {}",
                        stop_tools.as_deref().unwrap_or_default(),
                        policy.max_rounds
                    ),
                ));
            }

            messages.push(Message::Assistant {
                content: (!completion.text.is_empty()).then(|| completion.text.clone()),
                tool_calls: completion.tool_calls.clone(),
                opaque: completion.opaque.clone(),
            });
            // The model's call ids are not ours to trust as idempotency keys
            // (some servers repeat them): every call gets a fresh id for
            // the fleet — jobs, events, citations — and the model's id only
            // pairs the result with its call in the conversation.
            let ours: Vec<crate::llm::ToolCall> = completion
                .tool_calls
                .iter()
                .map(|c| crate::llm::ToolCall {
                    id: format!("call_{}", uuid::Uuid::new_v4().simple()),
                    ..c.clone()
                })
                .collect();
            let results = self
                .run_tools(&ctx, &ours, policy, &inbox, &mut replies, events)
                .await;
            if completion.tool_calls.len() > policy.max_calls_per_turn {
                self.metrics
                    .loop_limits
                    .with_label_values(&["calls_per_turn"])
                    .inc();
                stop_tools.get_or_insert_with(|| {
                    format!("at most {} tool calls per turn", policy.max_calls_per_turn)
                });
            }
            if results.iter().all(|(_, status)| *status != ToolStatus::Ok) {
                failed_rounds += 1;
            } else {
                failed_rounds = 0;
            }
            for (call, (content, _)) in completion.tool_calls.iter().zip(results) {
                let content = match &budget {
                    Some((b, cap)) => {
                        let capped = b.cap(&content, *cap);
                        if capped.truncated {
                            // Bounded label: a name the model made up is "unknown".
                            let function = self
                                .registry
                                .by_function_name(&call.name)
                                .map_or("unknown", |d| d.function.name.as_str());
                            self.metrics
                                .tool_results_truncated
                                .with_label_values(&[function])
                                .inc();
                        }
                        capped.text
                    }
                    None => content,
                };
                messages.push(Message::Tool {
                    call_id: call.id.clone(),
                    content,
                });
            }
            if policy.max_consecutive_tool_errors > 0
                && failed_rounds >= policy.max_consecutive_tool_errors
                && stop_tools.is_none()
            {
                self.metrics
                    .loop_limits
                    .with_label_values(&["consecutive_tool_errors"])
                    .inc();
                stop_tools = Some(format!(
                    "every tool call failed in {failed_rounds} round(s) in a row"
                ));
            }
            self.collect_references(&ctx.invocation_id, &mut seen_refs, events)
                .await?;
        }
        Err(Failure::new(
            "round_limit",
            format!("no answer within {} rounds", policy.max_rounds),
        ))
    }

    fn record_usage(&self, model: &str, purpose: &str, usage: &Usage, cost: Option<f64>) {
        for (kind, n) in [
            ("prompt", usage.prompt_tokens),
            ("completion", usage.completion_tokens),
            ("cached", usage.cached_tokens),
            ("reasoning", usage.reasoning_tokens),
        ] {
            self.metrics
                .llm_tokens
                .with_label_values(&[model, kind, purpose])
                .inc_by(n);
        }
        if let Some(c) = cost {
            self.metrics
                .llm_cost
                .with_label_values(&[model, purpose])
                .inc_by(c);
        }
    }

    /// Publishes a `references` event with the references not seen yet.
    async fn collect_references(
        &self,
        invocation_id: &str,
        seen: &mut HashSet<u64>,
        events: &Events,
    ) -> Result<(), Failure> {
        let all = self
            .store
            .references(invocation_id)
            .await
            .map_err(|e| Failure::new("citation_store_unavailable", e.to_string()))?;
        let new: Vec<Reference> = all.into_iter().filter(|r| seen.insert(r.index)).collect();
        if !new.is_empty() {
            events.send(ChatEventBody::References { references: new });
        }
        Ok(())
    }

    /// Runs one turn's tool calls under the loop policy and returns what the
    /// model reads for each, with its status, in call order. Every call gets
    /// an answer. Calls over the per-turn cap are not run; with parallel
    /// calls on, the parallel-safe calls go out together and each unsafe one
    /// runs alone after them; with them off, every call runs alone.
    async fn run_tools(
        &self,
        ctx: &InvocationContext,
        calls: &[crate::llm::ToolCall],
        policy: &LoopPolicy,
        inbox: &str,
        replies: &mut async_nats::Subscriber,
        events: &Events,
    ) -> Vec<(String, ToolStatus)> {
        let mut out: Vec<Option<(String, ToolStatus)>> = vec![None; calls.len()];
        let run = calls.len().min(policy.max_calls_per_turn);
        for (i, call) in calls.iter().enumerate().skip(run) {
            let tool = self
                .registry
                .by_function_name(&call.name)
                .map(|d| d.id.to_string())
                .unwrap_or_else(|| call.name.clone());
            out[i] = Some(self.immediate(
                events,
                call,
                &tool,
                ToolStatus::Error,
                "calls_per_turn",
                format!(
                    "Error: not run: at most {} tool calls per turn.",
                    policy.max_calls_per_turn
                ),
            ));
        }
        let parallel_safe = |c: &crate::llm::ToolCall| {
            self.registry
                .by_function_name(&c.name)
                .is_none_or(|d| d.parallel_safe)
        };
        let mut batches: Vec<Vec<usize>> = Vec::new();
        if policy.parallel_tool_calls {
            batches.push((0..run).filter(|&i| parallel_safe(&calls[i])).collect());
            batches.extend(
                (0..run)
                    .filter(|&i| !parallel_safe(&calls[i]))
                    .map(|i| vec![i]),
            );
        } else {
            batches.extend((0..run).map(|i| vec![i]));
        }
        for batch in batches.into_iter().filter(|b| !b.is_empty()) {
            let subset: Vec<crate::llm::ToolCall> =
                batch.iter().map(|&i| calls[i].clone()).collect();
            let results = self.run_batch(ctx, &subset, inbox, replies, events).await;
            for (i, r) in batch.into_iter().zip(results) {
                out[i] = Some(r);
            }
        }
        out.into_iter()
            .map(|o| o.unwrap_or_else(|| ("Error: no result.".to_string(), ToolStatus::Error)))
            .collect()
    }

    /// Dispatches a batch of tool calls in parallel and awaits their results
    /// under per-call deadlines.
    async fn run_batch(
        &self,
        ctx: &InvocationContext,
        calls: &[crate::llm::ToolCall],
        inbox: &str,
        replies: &mut async_nats::Subscriber,
        events: &Events,
    ) -> Vec<(String, ToolStatus)> {
        let mut answers: Vec<Option<(String, ToolStatus)>> = vec![None; calls.len()];
        // Internal call id → (position, definition, started, wait deadline).
        let mut pending: HashMap<String, (usize, &ToolDefinition, Instant, tokio::time::Instant)> =
            HashMap::new();
        let mut acks = Vec::new();

        for (i, call) in calls.iter().enumerate() {
            let Some(def) = self.registry.by_function_name(&call.name) else {
                events.send(ChatEventBody::ToolCall {
                    call_id: call.id.clone(),
                    tool: call.name.clone(),
                    arguments: Value::String("[unknown tool]".into()),
                });
                let names: Vec<&str> = self
                    .registry
                    .iter()
                    .map(|d| d.function.name.as_str())
                    .collect();
                answers[i] = Some(self.immediate(
                    events,
                    call,
                    &call.name,
                    ToolStatus::Error,
                    "unknown_tool",
                    format!(
                        "Error: there is no tool named {:?}. Available tools: {}.",
                        call.name,
                        names.join(", ")
                    ),
                ));
                continue;
            };
            let tool = def.id.to_string();
            let arguments: Value = match serde_json::from_str(if call.arguments.trim().is_empty() {
                "{}"
            } else {
                &call.arguments
            }) {
                Ok(v) => v,
                Err(e) => {
                    events.send(ChatEventBody::ToolCall {
                        call_id: call.id.clone(),
                        tool: tool.clone(),
                        arguments: Value::String("[not JSON]".into()),
                    });
                    answers[i] = Some(self.immediate(
                        events,
                        call,
                        &tool,
                        ToolStatus::Error,
                        "invalid_arguments",
                        format!("Error: the arguments for {} are not valid JSON ({e}). Send a JSON object.", call.name),
                    ));
                    continue;
                }
            };
            events.send(ChatEventBody::ToolCall {
                call_id: call.id.clone(),
                tool: tool.clone(),
                arguments: redact(&arguments, &def.sensitive_arguments),
            });
            if !self.is_live(&tool).await {
                answers[i] = Some(self.no_worker(events, call, &tool, "no live worker serves it"));
                continue;
            }
            // Ours, minted per call (see `invoke`): unique within the
            // invocation, so it is safe as an idempotency key.
            let call_id = call.id.clone();
            // Each call answers on its own subject under the invocation's
            // inbox, so even a bare "no responders" names its call.
            let reply_to = format!("{inbox}.{call_id}");
            let call_ctx = CallContext {
                invocation: ctx.clone(),
                call_id: call_id.clone(),
                tool_id: def.id.clone(),
                attempt: 1,
                reply_to: reply_to.clone(),
            };
            let body = encode(&ToolJob {
                arguments,
                settings: None,
            });
            let dispatched = match def.delivery {
                // Core request-reply to the pool's queue group: no stream,
                // and no worker means "no responders" at once.
                Delivery::Direct => self
                    .client
                    .publish_with_reply_and_headers(
                        self.config.subjects.tool_direct(&def.id),
                        reply_to,
                        call_ctx.to_headers(),
                        body,
                    )
                    .await
                    .map_err(|e| e.to_string()),
                Delivery::Jetstream => self
                    .js
                    .publish_with_headers(
                        self.config.subjects.tool(&def.id),
                        call_ctx.to_headers(),
                        body,
                    )
                    .await
                    .map(|ack| acks.push((i, call_id.clone(), ack)))
                    .map_err(|e| e.to_string()),
            };
            match dispatched {
                Ok(()) => {}
                Err(e) => {
                    answers[i] = Some(self.immediate(
                        events,
                        call,
                        &tool,
                        ToolStatus::Error,
                        "dispatch_failed",
                        format!("Error: the tool job could not be queued: {e}"),
                    ));
                    continue;
                }
            }
            let mut wait = def.timeout() + self.config.tool_wait_slack;
            if let Some(d) = ctx.deadline_ms {
                wait = wait.min(Duration::from_millis(
                    d.saturating_sub(crate::protocol::now_ms()),
                ));
            }
            pending.insert(
                call_id,
                (i, def, Instant::now(), tokio::time::Instant::now() + wait),
            );
        }

        // JetStream must have stored every job; a job it refused is answered
        // at once.
        for (i, call_id, ack) in acks {
            // A duplicate means JetStream already holds a job under this id:
            // ours would never run.
            let failed = match ack.await {
                Ok(a) if a.duplicate => Some("a job with this id is already queued".to_string()),
                Ok(_) => None,
                Err(e) => Some(e.to_string()),
            };
            if let Some(e) = failed
                && let Some((_, def, _, _)) = pending.remove(&call_id)
            {
                answers[i] = Some(self.immediate(
                    events,
                    &calls[i],
                    &def.id.to_string(),
                    ToolStatus::Error,
                    "dispatch_failed",
                    format!("Error: the tool job was not stored: {e}"),
                ));
            }
        }

        // Calls whose tool has been missing from the catalog: the refresh
        // generation last seen missing and how many refreshes in a row.
        let mut missing: HashMap<String, (u64, u32)> = HashMap::new();
        while !pending.is_empty() {
            let next_deadline = pending
                .values()
                .map(|v| v.3)
                .min()
                .unwrap_or_else(tokio::time::Instant::now)
                .min(tokio::time::Instant::now() + LIVENESS_CHECK);
            match tokio::time::timeout_at(next_deadline, replies.next()).await {
                Ok(Some(msg)) => {
                    if msg.status == Some(async_nats::StatusCode::NO_RESPONDERS) {
                        let call_id = msg.subject.as_str().rsplit('.').next().unwrap_or_default();
                        if let Some((i, def, _, _)) = pending.remove(call_id) {
                            answers[i] = Some(self.no_worker(
                                events,
                                &calls[i],
                                &def.id.to_string(),
                                "no live worker serves it",
                            ));
                        }
                        continue;
                    }
                    let reply: ToolReply = match Envelope::ToolReply.decode(&msg.payload) {
                        Ok(r) => r,
                        Err(e) => {
                            warn!(error = %e, "malformed tool reply ignored");
                            continue;
                        }
                    };
                    let ToolReply::Result(result) = reply else {
                        continue;
                    };
                    let Some((i, def, started, _)) = pending.remove(&result.call_id) else {
                        continue;
                    };
                    answers[i] = Some((
                        self.record(events, &calls[i], def, started.elapsed(), &result),
                        result.status,
                    ));
                }
                Ok(None) => break,
                Err(_) => {
                    let now = tokio::time::Instant::now();
                    let expired: Vec<String> = pending
                        .iter()
                        .filter(|(_, v)| v.3 <= now)
                        .map(|(k, _)| k.clone())
                        .collect();
                    // A pool that died after dispatch: two catalog refreshes
                    // in a row without the tool end the wait (one missed
                    // INFO reply under load is not enough).
                    let generation = self
                        .catalog_generation
                        .load(std::sync::atomic::Ordering::Relaxed);
                    let live = self.live.read().await.clone();
                    let mut gone = Vec::new();
                    for (key, (_, def, _, _)) in &pending {
                        if live.contains(&def.id.to_string()) {
                            missing.remove(key);
                            continue;
                        }
                        let entry = missing.entry(key.clone()).or_insert((generation, 0));
                        if entry.0 != generation || entry.1 == 0 {
                            *entry = (generation, entry.1 + 1);
                        }
                        if entry.1 >= 2 {
                            gone.push(key.clone());
                        }
                    }
                    for key in gone {
                        if let Some((i, def, _, _)) = pending.remove(&key) {
                            answers[i] = Some(self.no_worker(
                                events,
                                &calls[i],
                                &def.id.to_string(),
                                "its last live worker went away during this call",
                            ));
                        }
                    }
                    for key in expired {
                        if let Some((i, def, started, _)) = pending.remove(&key) {
                            let tool = def.id.to_string();
                            self.metrics
                                .tool_calls
                                .with_label_values(&[tool.as_str(), "timeout"])
                                .inc();
                            events.send(ChatEventBody::ToolResult {
                                call_id: calls[i].id.clone(),
                                tool,
                                status: ToolStatus::Timeout,
                                duration_ms: started.elapsed().as_millis() as u64,
                                error_code: Some("timeout".into()),
                            });
                            answers[i] = Some((
                                format!(
                                    "Error: {} did not answer in time. Answer with what you have.",
                                    calls[i].name
                                ),
                                ToolStatus::Timeout,
                            ));
                        }
                    }
                }
            }
        }
        answers
            .into_iter()
            .map(|a| a.unwrap_or_else(|| ("Error: no result.".to_string(), ToolStatus::Error)))
            .collect()
    }

    /// Answers a call whose tool has no live worker, saying why.
    fn no_worker(
        &self,
        events: &Events,
        call: &crate::llm::ToolCall,
        tool: &str,
        why: &str,
    ) -> (String, ToolStatus) {
        self.immediate(
            events,
            call,
            tool,
            ToolStatus::Error,
            "no_worker",
            format!(
                "Error: the tool {} is not available right now ({why}). Answer without it.",
                call.name
            ),
        )
    }

    /// Answers a call without dispatching it.
    fn immediate(
        &self,
        events: &Events,
        call: &crate::llm::ToolCall,
        tool: &str,
        status: ToolStatus,
        code: &str,
        content: String,
    ) -> (String, ToolStatus) {
        // Bounded label: a tool name the model made up is "unknown".
        let known = tool
            .parse::<crate::tools::ToolId>()
            .ok()
            .and_then(|id| self.registry.get(&id))
            .is_some();
        self.metrics
            .tool_calls
            .with_label_values(&[if known { tool } else { "unknown" }, status.as_str()])
            .inc();
        events.send(ChatEventBody::ToolResult {
            call_id: call.id.clone(),
            tool: tool.to_string(),
            status,
            duration_ms: 0,
            error_code: Some(code.to_string()),
        });
        (content, status)
    }

    fn record(
        &self,
        events: &Events,
        call: &crate::llm::ToolCall,
        def: &ToolDefinition,
        elapsed: Duration,
        result: &ToolResult,
    ) -> String {
        let tool = def.id.to_string();
        self.metrics
            .tool_calls
            .with_label_values(&[tool.as_str(), result.status.as_str()])
            .inc();
        self.metrics
            .tool_call_duration
            .with_label_values(&[tool.as_str()])
            .observe(elapsed.as_secs_f64());
        events.send(ChatEventBody::ToolResult {
            call_id: call.id.clone(),
            tool,
            status: result.status,
            duration_ms: elapsed.as_millis() as u64,
            error_code: result.error.as_ref().map(|e| e.code.clone()),
        });
        match result.status {
            ToolStatus::Ok => result.content.clone(),
            ToolStatus::Blocked => format!("Blocked: {}", result.content),
            ToolStatus::Error | ToolStatus::Timeout => format!("Error: {}", result.content),
        }
    }
}

/// The `purpose` label of the conversation's own model calls (planning and
/// LLM-backed tools have their own).
pub const PURPOSE_CONVERSATION: &str = "conversation";

/// Token usage and cost of one invocation, per model call.
#[derive(Debug, Default)]
struct UsageLedger {
    total: Usage,
    cost: Option<f64>,
    calls: Vec<LlmCall>,
}

impl UsageLedger {
    fn add(&mut self, model: &str, purpose: &str, usage: Usage, cost: Option<f64>, attempts: u32) {
        self.total += usage;
        if let Some(c) = cost {
            *self.cost.get_or_insert(0.0) += c;
        }
        self.calls.push(LlmCall {
            model: model.to_string(),
            purpose: purpose.to_string(),
            usage,
            cost_usd: cost,
            attempts,
        });
    }
}

/// Replaces the values of sensitive arguments.
fn redact(arguments: &Value, sensitive: &[String]) -> Value {
    let mut out = arguments.clone();
    if let Some(map) = out.as_object_mut() {
        for name in sensitive {
            if let Some(v) = map.get_mut(name) {
                *v = Value::String("[redacted]".into());
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sensitive_arguments_are_redacted() {
        let args = serde_json::json!({"query": "q", "apiToken": "s3cret"});
        let out = redact(&args, &["apiToken".to_string()]);
        assert_eq!(
            out,
            serde_json::json!({"query": "q", "apiToken": "[redacted]"})
        );
    }
}
