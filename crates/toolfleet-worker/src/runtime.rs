//! Serving a [`Worker`]'s tools on NATS.
//!
//! For each tool: its definition goes into the fleet's catalog bucket, then
//! jobs are pulled from the tool's durable consumer on the tool stream
//! (shared by every copy of the worker, so a pool scales by starting more
//! copies) and direct requests are answered on the tool's services-API
//! endpoint (which is also what makes the tool live in the catalog).
//!
//! One job: headers → call context; the result ledger and the cancel
//! tombstone in one read (a redelivered job returns the stored result, a
//! cancelled one does not run); envelope and argument validation (invalid
//! arguments are answered at once and touch nothing); `before_call`
//! policies; the tool under its timeout, kept alive by the pull loop's one
//! in-progress-ack ticker; the result to `Toolfleet-Reply-To`, then into
//! the ledger (the caller never waits for Redis twice); only then the ack.
//! Retries are ours: a retryable failure is `nak`ed with our own delay
//! until the attempt cap, then terminated and published as a dead letter —
//! and the caller still gets an error result.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind, consumer::pull, kv};
use async_nats::service::ServiceExt;
use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_protocol::schema::Violation;
use toolfleet_protocol::{
    CallContext, DeadLetter, DeadLetterKind, Envelope, Reference, Subjects, ToolErrorBody, ToolJob,
    ToolReply, ToolResult, ToolStatus, catalog, encode,
};
use toolfleet_store::{CitationStore, NewReference};
use tracing::{Instrument, info, warn};

use crate::builder::{Served, Worker, WorkerError};
use crate::ctx::{Sink, ToolCtx};
use crate::hooks::{CallInfo, HookSet};
use crate::metrics::WorkerMetrics;
use crate::tool::ToolError;

/// How a worker runs (the same for every tool it serves).
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub subjects: Subjects,
    /// Jobs executed at once by this process, across its tools.
    pub concurrency: usize,
    /// Attempts before a job is terminated and dead-lettered.
    pub max_attempts: u32,
    /// Delay before a failed attempt is delivered again.
    pub retry_delay: Duration,
    /// The longest ack wait of a tool's consumer. Each tool's is a quarter
    /// of its timeout within [`MIN_ACK_WAIT`] and this (see
    /// [`WorkerConfig::ack_wait_for`]); in-progress acks go out at a third
    /// of it.
    pub ack_wait: Duration,
    /// How long this worker must have been hearing every cancel (no
    /// reconnect since) before a job's publication for the first delivery
    /// of a new call ([`CallContext::new_call`]) to skip Redis: its memory
    /// of cancels then answers for the tombstone. See
    /// [`CANCEL_HEARING_MARGIN`] for what it must cover.
    pub cancel_hearing_margin: Duration,
}

/// The default [`WorkerConfig::cancel_hearing_margin`]: jobs published in
/// a worker's first 10 s (and 10 s after each reconnect) read Redis. An
/// orchestrator marks a job new only within 3 s of reading the
/// invocation's tombstone (absent), and a tombstone is written within the
/// store's retry budget (3 s) of its cancel: a cancel more than ~6 s
/// before a new call's job could not have let it through, so 10 s leaves
/// room for clock skew. A fleet that raises the store's retry budget
/// (`--redis-retry-budget-ms`) raises this with it.
pub const CANCEL_HEARING_MARGIN: Duration = Duration::from_secs(10);

/// The shortest ack wait of a tool consumer.
pub const MIN_ACK_WAIT: Duration = Duration::from_secs(2);

impl WorkerConfig {
    /// The ack wait of `def`'s consumer: how long the jobs of a worker that
    /// froze or died stay invisible before another worker of the pool gets
    /// them. A quarter of the tool's timeout, so a redelivered call still
    /// finishes inside the caller's wait (the tool's timeout plus slack);
    /// live workers prove they are alive with in-progress acks (a
    /// heartbeat, as Temporal's activity heartbeat timeout) at a third of
    /// it.
    pub fn ack_wait_for(&self, def: &toolfleet_protocol::tools::ToolDefinition) -> Duration {
        (def.timeout() / 4).clamp(MIN_ACK_WAIT, self.ack_wait.max(MIN_ACK_WAIT))
    }
}

impl WorkerConfig {
    pub fn new(subjects: Subjects) -> Self {
        Self {
            subjects,
            concurrency: 16,
            max_attempts: 3,
            retry_delay: Duration::from_millis(500),
            ack_wait: Duration::from_secs(30),
            cancel_hearing_margin: CANCEL_HEARING_MARGIN,
        }
    }
}

/// What every job of a worker shares.
struct Shared {
    client: async_nats::Client,
    store: CitationStore,
    metrics: WorkerMetrics,
    config: WorkerConfig,
    hooks: Arc<HookSet>,
    sink: Arc<dyn Sink>,
    /// The cancellation of each call running here, by invocation, so a
    /// cancel of the invocation stops its tools.
    running: Running,
    /// Results on their way to the ledger.
    recording: Recording,
    /// The NATS client's counters (its connects tell a reconnect).
    nats_stats: Arc<async_nats::Statistics>,
    /// Ledger writes, batched.
    ledger: LedgerWriter,
    /// Each tool's metrics, looked up once (by label).
    stats: HashMap<String, ToolStats>,
}

/// One tool's per-call metrics, looked up once instead of by label on
/// every call.
#[derive(Clone)]
struct ToolStats {
    in_flight: prometheus::IntGauge,
    duration: prometheus::Histogram,
    /// `toolfleet_tool_jobs_total{outcome="ok"}`: most jobs end there.
    ok: prometheus::IntCounter,
    /// Its endpoint's counts for `$SRV.STATS`.
    jobs: Arc<crate::service_stats::EndpointJobs>,
}

/// The results this worker has published and is writing to the ledger,
/// by invocation and call: a repeat of the call that arrives before the
/// write is done is answered from here, so the reply going out before the
/// ledger write never lets this worker run a call twice.
#[derive(Default)]
struct Recording {
    results: std::sync::Mutex<HashMap<String, HashMap<String, bytes::Bytes>>>,
}

impl Recording {
    /// Remembers `json` (the encoded result of `call`) until the guard is
    /// dropped.
    fn start<'a>(&'a self, call: &'a CallContext, json: bytes::Bytes) -> RecordingGuard<'a> {
        if let Ok(mut results) = self.results.lock() {
            let calls = match results.get_mut(&call.invocation.invocation_id) {
                Some(calls) => calls,
                None => results
                    .entry(call.invocation.invocation_id.clone())
                    .or_default(),
            };
            calls.insert(call.call_id.clone(), json);
        }
        RecordingGuard {
            recording: self,
            call,
        }
    }

    /// The result of `call` being written to the ledger, if any.
    fn get(&self, call: &CallContext) -> Option<ToolResult> {
        let json = self
            .results
            .lock()
            .ok()?
            .get(&call.invocation.invocation_id)?
            .get(&call.call_id)?
            .clone();
        serde_json::from_slice(&json).ok()
    }
}

struct RecordingGuard<'a> {
    recording: &'a Recording,
    call: &'a CallContext,
}

impl Drop for RecordingGuard<'_> {
    fn drop(&mut self) {
        if let Ok(mut results) = self.recording.results.lock()
            && let Some(calls) = results.get_mut(&self.call.invocation.invocation_id)
        {
            calls.remove(&self.call.call_id);
            if calls.is_empty() {
                results.remove(&self.call.invocation.invocation_id);
            }
        }
    }
}

/// Calls running in this worker: [`run_key`] → (call serial, token); and
/// the invocations cancelled lately, so a call that registers just after
/// its invocation's cancel arrived (it was being pulled or checked) is
/// cancelled too.
#[derive(Default)]
struct Running {
    state: std::sync::Mutex<RunningState>,
    serial: std::sync::atomic::AtomicU64,
    /// How many cancels are remembered (read without the lock: usually
    /// none).
    remembered: std::sync::atomic::AtomicUsize,
    /// Since when (unix ns, wall clock, to compare with JetStream's
    /// publication times) every cancel has been heard; 0 until the cancel
    /// subscription exists. Cancels published while the connection was
    /// down are lost, so a reconnect starts it again; so does a flood of
    /// cancels that emptied the memory.
    hearing_since: std::sync::atomic::AtomicU64,
    /// The client's connect count when `hearing_since` was set.
    hearing_connects: std::sync::atomic::AtomicU64,
}

#[derive(Default)]
struct RunningState {
    /// By invocation ([`run_key`]): each call's serial, call id and token.
    calls: HashMap<String, Vec<(u64, String, CancellationToken)>>,
    /// Cancels heard lately: of invocations ([`run_key`]) and of single
    /// calls (`<run key>.<call id>`).
    cancelled: HashMap<String, Instant>,
}

fn unix_ns(t: std::time::SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .max(1)
}

/// How long a worker remembers a cancel for calls that start after it.
const REMEMBER_CANCEL: Duration = Duration::from_secs(600);
/// At most this many remembered cancels (a flood of cancels cannot grow
/// the worker without bound).
const MAX_REMEMBERED_CANCELS: usize = 10_000;

impl Running {
    /// Registers a call; the guard deregisters it when dropped. A call of
    /// an invocation cancelled lately, or itself cancelled lately, starts
    /// cancelled.
    fn register(
        &self,
        invocation_id: String,
        call_id: &str,
        token: CancellationToken,
    ) -> RunningGuard<'_> {
        let serial = self
            .serial
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if let Ok(mut state) = self.state.lock() {
            let lately = |key: &str| {
                state
                    .cancelled
                    .get(key)
                    .is_some_and(|at| at.elapsed() < REMEMBER_CANCEL)
            };
            if lately(&invocation_id) || lately(&call_key(&invocation_id, call_id)) {
                token.cancel();
            }
            let entry = (serial, call_id.to_string(), token);
            match state.calls.get_mut(&invocation_id) {
                Some(calls) => calls.push(entry),
                None => {
                    state.calls.insert(invocation_id.clone(), vec![entry]);
                }
            }
        }
        RunningGuard {
            running: self,
            invocation_id,
            serial,
        }
    }

    /// Cancels every call of `invocation_id` running here, and remembers
    /// the cancel for calls that start after it.
    fn cancel(&self, invocation_id: &str) -> usize {
        self.cancel_matching(invocation_id, invocation_id, |_| true)
    }

    /// Cancels call `call_id` of `invocation_id` (a [`run_key`]) if it runs
    /// here, and remembers the cancel should its job start later.
    fn cancel_call(&self, invocation_id: &str, call_id: &str) -> usize {
        let key = call_key(invocation_id, call_id);
        self.cancel_matching(&key, invocation_id, |c| c == call_id)
    }

    /// Whether call `call_id` of `invocation_id` was cancelled on its own
    /// lately (not with its whole invocation).
    fn call_cancelled(&self, invocation_id: &str, call_id: &str) -> bool {
        self.remembers_cancel(&call_key(invocation_id, call_id))
    }

    /// Remembers a cancel under `remember` and cancels the calls of
    /// `invocation_id` whose call id passes `which`.
    fn cancel_matching(
        &self,
        remember: &str,
        invocation_id: &str,
        which: impl Fn(&str) -> bool,
    ) -> usize {
        let Ok(mut state) = self.state.lock() else {
            return 0;
        };
        state
            .cancelled
            .retain(|_, at| at.elapsed() < REMEMBER_CANCEL);
        if state.cancelled.len() >= MAX_REMEMBERED_CANCELS {
            state.cancelled.clear();
            // What was forgotten must be read from Redis again.
            if self.hearing_since.load(Ordering::Acquire) != 0 {
                self.hearing_since
                    .store(unix_ns(std::time::SystemTime::now()), Ordering::Release);
            }
        }
        state.cancelled.insert(remember.to_string(), Instant::now());
        self.remembered
            .store(state.cancelled.len(), Ordering::Release);
        let tokens = state
            .calls
            .get(invocation_id)
            .map(Vec::as_slice)
            .unwrap_or(&[]);
        let mut stopped = 0;
        for (_, call_id, token) in tokens {
            if which(call_id) {
                token.cancel();
                stopped += 1;
            }
        }
        stopped
    }

    /// Starts remembering since when every cancel was heard: called once
    /// the cancel subscription exists, with the client's connect count.
    fn start_hearing(&self, connects: u64) {
        self.hearing_connects.store(connects, Ordering::Release);
        self.hearing_since
            .store(unix_ns(std::time::SystemTime::now()), Ordering::Release);
    }

    /// Since when every cancel has been heard, given the client's connect
    /// count and state now; `None` while disconnected or before
    /// [`Running::start_hearing`]. A changed count (a reconnect: cancels
    /// published meanwhile were lost) starts it again from now — later
    /// than the reconnect itself, which errs on the side of reading Redis.
    fn hearing_since(&self, connects: u64, connected: bool) -> Option<std::time::SystemTime> {
        if self.hearing_since.load(Ordering::Acquire) == 0 {
            return None;
        }
        if self.hearing_connects.load(Ordering::Acquire) != connects || !connected {
            // `since` first: whoever sees the new count sees the new time.
            self.hearing_since
                .store(unix_ns(std::time::SystemTime::now()), Ordering::Release);
            self.hearing_connects.store(connects, Ordering::Release);
        }
        let since = self.hearing_since.load(Ordering::Acquire);
        connected.then(|| std::time::UNIX_EPOCH + Duration::from_nanos(since))
    }

    /// Whether a cancel of `key` ([`run_key`]) was heard lately.
    fn remembers_cancel(&self, key: &str) -> bool {
        if self.remembered.load(Ordering::Acquire) == 0 {
            return false;
        }
        self.state.lock().is_ok_and(|state| {
            state
                .cancelled
                .get(key)
                .is_some_and(|at| at.elapsed() < REMEMBER_CANCEL)
        })
    }
}

struct RunningGuard<'a> {
    running: &'a Running,
    invocation_id: String,
    serial: u64,
}

impl Drop for RunningGuard<'_> {
    fn drop(&mut self) {
        if let Ok(mut state) = self.running.state.lock()
            && let Some(list) = state.calls.get_mut(&self.invocation_id)
        {
            list.retain(|(s, _, _)| *s != self.serial);
            if list.is_empty() {
                state.calls.remove(&self.invocation_id);
            }
        }
    }
}

/// How [`Running`] names an invocation: its tenant and id (both single
/// subject tokens, so the pair is unambiguous). A cancel published under
/// another tenant than the invocation's own finds nothing.
fn run_key(tenant: &str, invocation_id: &str) -> String {
    format!("{tenant}.{invocation_id}")
}

/// How [`Running`] remembers a cancel of one call: its invocation's
/// [`run_key`] and the call id (no token holds a dot).
fn call_key(run_key: &str, call_id: &str) -> String {
    format!("{run_key}.{call_id}")
}

/// Stops the running calls of every invocation whose cancel subject is
/// published.
async fn listen_for_cancels(
    shared: Arc<Shared>,
    mut cancels: async_nats::Subscriber,
    shutdown: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = cancels.next() => match m { Some(m) => m, None => break },
        };
        let subjects = &shared.config.subjects;
        if let Some((tenant, id)) = subjects.parse_cancel(msg.subject.as_str()) {
            let stopped = shared.running.cancel(&run_key(tenant, id));
            if stopped > 0 {
                info!(
                    invocation_id = id,
                    calls = stopped,
                    "cancel: stopping the invocation's tool calls"
                );
            }
        } else if let Some((tenant, id, call)) = subjects.parse_cancel_call(msg.subject.as_str())
            && shared.running.cancel_call(&run_key(tenant, id), call) > 0
        {
            info!(
                invocation_id = id,
                call_id = call,
                "cancel: stopping one tool call"
            );
        }
    }
    // No longer hearing cancels (shutting down, or the subscription
    // closed): jobs read the tombstone from now on.
    shared
        .running
        .hearing_since
        .store(0, std::sync::atomic::Ordering::Release);
}

impl Worker {
    /// A readiness check: the durable consumer of every tool this worker
    /// takes from JetStream exists (a consumer deleted by hand, or lost
    /// with a NATS server that kept no storage, makes the worker unready
    /// until it is created again).
    pub fn consumer_check(
        &self,
        client: &async_nats::Client,
        subjects: &toolfleet_protocol::Subjects,
    ) -> impl Fn() -> BoxFuture<'static, Result<(), String>> + Send + Sync + 'static {
        let names: Vec<String> = self
            .tools
            .iter()
            .filter(|t| t.definition().delivery == toolfleet_protocol::tools::Delivery::Jetstream)
            .map(|t| subjects.tool_consumer(&t.definition().id))
            .collect();
        let js = jetstream::new(client.clone());
        let stream = subjects.tools_stream();
        move || {
            let (js, names, stream) = (js.clone(), names.clone(), stream.clone());
            async move {
                if names.is_empty() {
                    return Ok(());
                }
                let s = js
                    .get_stream(&stream)
                    .await
                    .map_err(|e| format!("the tools stream {stream}: {e}"))?;
                for name in &names {
                    s.consumer_info(name)
                        .await
                        .map_err(|e| format!("consumer {name}: {e}"))?;
                }
                Ok(())
            }
            .boxed()
        }
    }

    /// Serves the tools on a task of its own and returns once every tool is
    /// advertised and taking jobs. The task ends when `shutdown` is
    /// cancelled and the jobs in flight are done.
    ///
    /// # Errors
    ///
    /// As [`Worker::run`], when the worker cannot start.
    pub async fn start(
        self,
        client: async_nats::Client,
        store: CitationStore,
        config: WorkerConfig,
        metrics: WorkerMetrics,
        shutdown: CancellationToken,
    ) -> Result<tokio::task::JoinHandle<Result<(), WorkerError>>, WorkerError> {
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(self.run(client, store, config, metrics, shutdown, Some(ready_tx)));
        match ready_rx.await {
            Ok(Ok(())) => Ok(task),
            Ok(Err(e)) => Err(e),
            Err(_) => Err(match task.await {
                Ok(Err(e)) => e,
                _ => WorkerError::Config("the worker stopped while starting".into()),
            }),
        }
    }

    /// Serves the tools until `shutdown` is cancelled, then stops pulling
    /// and lets jobs in flight finish (the caller bounds that with its
    /// grace period). `ready` is told once every tool is advertised and
    /// taking jobs.
    ///
    /// # Errors
    ///
    /// [`WorkerError::Nats`] when a stream, consumer, bucket or endpoint
    /// cannot be set up.
    pub async fn run(
        self,
        client: async_nats::Client,
        store: CitationStore,
        config: WorkerConfig,
        metrics: WorkerMetrics,
        shutdown: CancellationToken,
        ready: Option<tokio::sync::oneshot::Sender<Result<(), WorkerError>>>,
    ) -> Result<(), WorkerError> {
        // Everything is set up before anything is served: a worker that
        // cannot serve one of its tools serves none, and says why.
        let job_stats = Arc::new(crate::service_stats::JobStats::new(
            self.tools
                .iter()
                .map(|t| endpoint_name(&t.definition().id))
                .collect::<Vec<_>>()
                .iter()
                .map(String::as_str),
        ));
        let setup = match set_up(&self, &client, &config, job_stats.clone()).await {
            Ok(setup) => setup,
            Err(e) => {
                if let Some(ready) = ready {
                    let _ = ready.send(Err(e.clone()));
                }
                return Err(e);
            }
        };
        let client_stats = client.statistics();
        let ledger = LedgerWriter::start(store.clone());
        let shared = Arc::new(Shared {
            client: client.clone(),
            store: store.clone(),
            metrics: metrics.clone(),
            config: config.clone(),
            hooks: self.hooks.clone(),
            sink: Arc::new(LiveSink {
                client,
                store,
                metrics: metrics.clone(),
            }),
            running: Running::default(),
            recording: Recording::default(),
            nats_stats: client_stats.clone(),
            ledger,
            stats: self
                .tools
                .iter()
                .map(|t| {
                    let label = [t.label()];
                    let stats = ToolStats {
                        in_flight: metrics.tool_jobs_in_flight.with_label_values(&label),
                        duration: metrics.tool_job_duration.with_label_values(&label),
                        ok: {
                            // The first dead letter, and the first job of
                            // every outcome, must be an increase.
                            metrics.dead_letters.with_label_values(&["tool", t.label()]);
                            for outcome in [
                                "error",
                                "blocked",
                                "timeout",
                                "cancelled",
                                "invalid_arguments",
                                "redelivered",
                            ] {
                                metrics.tool_jobs.with_label_values(&[t.label(), outcome]);
                            }
                            metrics.tool_jobs.with_label_values(&[t.label(), "ok"])
                        },
                        jobs: job_stats.endpoint(&endpoint_name(&t.definition().id)),
                    };
                    (t.label().to_string(), stats)
                })
                .collect(),
        });
        // The cancel subscription exists (set-up's requests went out after
        // it on the same connection): every cancel from now on is heard.
        shared.running.start_hearing(
            client_stats
                .connects
                .load(std::sync::atomic::Ordering::Relaxed),
        );
        // Jobs wait in the consumers until the loops below take them; a
        // caller that stopped waiting for us gets no worker running behind
        // its back.
        if let Some(ready) = ready
            && ready.send(Ok(())).is_err()
        {
            let _ = setup.service.stop().await;
            return Ok(());
        }
        let permits = Arc::new(Semaphore::new(config.concurrency.max(1)));
        // More tools than permits: idle pulls must not hold them.
        let hold_permit_while_waiting = setup.tools.len() <= config.concurrency.max(1);
        let tracker = TaskTracker::new();
        let reconnects =
            toolfleet_service::jobs::Reconnects::watch(shared.client.clone(), shutdown.clone());
        for (tool, consumer, endpoint) in setup.tools {
            let label = tool.definition().id.to_string();
            info!(tool = %label, worker = %self.name, "serving tool");
            {
                let heartbeat = config.ack_wait_for(tool.definition()) / 3;
                let sweeper = {
                    let (tool, shared) = (tool.clone(), shared.clone());
                    toolfleet_service::jobs::Sweeper {
                        js: jetstream::new(shared.client.clone()),
                        stream: config.subjects.tools_stream(),
                        on_poison: Arc::new(move |p| {
                            poison(tool.clone(), shared.clone(), p).boxed()
                        }),
                    }
                };
                let (tool, shared) = (tool.clone(), shared.clone());
                // The loop keeps every job alive from its pull until its
                // handler is done, with one ticker for all of them.
                let pull = toolfleet_service::jobs::PullLoop {
                    consumer,
                    reconnects: reconnects.clone(),
                    sweeper,
                    permits: permits.clone(),
                    tracker: tracker.clone(),
                    shutdown: shutdown.clone(),
                    what: label,
                    progress_every: heartbeat,
                    hold_permit_while_waiting,
                };
                tracker.spawn(pull.in_slots(move |msg, slot| {
                    let (tool, shared) = (tool.clone(), shared.clone());
                    async move { handle_jetstream(msg, slot, &tool, &shared).await }
                }));
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
        tracker.spawn(listen_for_cancels(
            shared.clone(),
            setup.cancels,
            shutdown.clone(),
        ));
        tracker.spawn(keep_advertised(
            setup.catalog,
            jetstream::new(shared.client.clone()),
            config.subjects.clone(),
            self.tools.iter().map(|t| t.definition().clone()).collect(),
            shutdown.clone(),
        ));
        shutdown.cancelled().await;
        // Not live any more: new calls go to other copies (or are answered
        // no_worker) while the jobs in flight finish.
        let _ = setup.service.stop().await;
        tracker.close();
        tracker.wait().await;
        Ok(())
    }
}

/// What a worker sets up before it serves: the services-API registration,
/// the catalog bucket, and per tool its consumer and endpoint.
struct SetUp {
    service: async_nats::service::Service,
    catalog: kv::Store,
    cancels: async_nats::Subscriber,
    tools: Vec<(
        Arc<Served>,
        jetstream::consumer::Consumer<pull::Config>,
        async_nats::service::endpoint::Endpoint,
    )>,
}

async fn set_up(
    worker: &Worker,
    client: &async_nats::Client,
    config: &WorkerConfig,
    job_stats: Arc<crate::service_stats::JobStats>,
) -> Result<SetUp, WorkerError> {
    let nats = |e: &dyn std::fmt::Display| WorkerError::Nats(e.to_string());
    let js = jetstream::new(client.clone());
    let stream = toolfleet_protocol::streams::ensure_tools_stream(&js, &config.subjects)
        .await
        .map_err(|e| nats(&e))?;
    let catalog = catalog::bucket(&js, &config.subjects)
        .await
        .map_err(|e| nats(&e))?;
    let cancels = client
        .subscribe(config.subjects.chat_cancel_any())
        .await
        .map_err(|e| nats(&e))?;
    let service = client
        .service_builder()
        .description(format!("toolfleet worker: {}", worker.name))
        .metadata(HashMap::from([
            (catalog::META_WORKER.to_string(), worker.name.clone()),
            (
                catalog::META_FLEET.to_string(),
                config.subjects.prefix().to_string(),
            ),
        ]))
        // Every job it ran, JetStream ones included, in each endpoint's
        // `data` (the library's own counts see only direct calls).
        .stats_handler(move |endpoint, _| job_stats.data(&endpoint))
        .start(config.subjects.worker_service(), env!("CARGO_PKG_VERSION"))
        .await
        .map_err(|e| WorkerError::Nats(format!("services API: {e}")))?;
    let mut tools = Vec::with_capacity(worker.tools.len());
    for tool in &worker.tools {
        match set_up_tool(tool, &stream, &catalog, &service, config).await {
            Ok((consumer, endpoint)) => tools.push((tool.clone(), consumer, endpoint)),
            Err(e) => {
                // Nothing of this worker stays live.
                let _ = service.stop().await;
                return Err(e);
            }
        }
    }
    Ok(SetUp {
        service,
        catalog,
        cancels,
        tools,
    })
}

/// One tool's consumer and endpoint, and its entry in the catalog. The
/// definition goes into the catalog before the endpoint that makes the
/// tool live appears.
async fn set_up_tool(
    tool: &Served,
    stream: &jetstream::stream::Stream,
    catalog: &kv::Store,
    service: &async_nats::service::Service,
    config: &WorkerConfig,
) -> Result<
    (
        jetstream::consumer::Consumer<pull::Config>,
        async_nats::service::endpoint::Endpoint,
    ),
    WorkerError,
> {
    let def = tool.definition();
    let consumer = consumer(stream, config, def).await?;
    let digest = catalog::advertise(catalog, def)
        .await
        .map_err(|e| WorkerError::Nats(e.to_string()))?;
    let delivery = serde_json::to_value(def.delivery)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    let endpoint = service
        .endpoint_builder()
        .name(endpoint_name(&def.id))
        .metadata(HashMap::from([
            (catalog::META_TOOL_ID.to_string(), def.id.to_string()),
            (catalog::META_DIGEST.to_string(), digest),
            (catalog::META_DELIVERY.to_string(), delivery),
        ]))
        .add(config.subjects.tool_direct(&def.id))
        .await
        .map_err(|e| WorkerError::Nats(format!("endpoint for {}: {e}", def.id)))?;
    Ok((consumer, endpoint))
}

/// A tool's endpoint name: its id with `-` joining the parts (no namespace
/// or name holds one), so two versions of one function are two endpoints.
fn endpoint_name(id: &toolfleet_protocol::ToolId) -> String {
    id.subject_token().replace('.', "-")
}

/// How often a worker writes its definitions into the catalog again: they
/// stay fresh under the bucket's age limit, and a bucket lost with a NATS
/// server that kept no storage is created and filled again.
const READVERTISE_EVERY: Duration = Duration::from_secs(60);

async fn keep_advertised(
    mut catalog: kv::Store,
    js: jetstream::Context,
    subjects: toolfleet_protocol::Subjects,
    definitions: Vec<toolfleet_protocol::tools::ToolDefinition>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(READVERTISE_EVERY) => {}
        }
        for def in &definitions {
            if catalog::advertise(&catalog, def).await.is_ok() {
                continue;
            }
            // The bucket may be gone: look it up (or create it) once more.
            let retried = match catalog::bucket(&js, &subjects).await {
                Ok(store) => {
                    catalog = store;
                    catalog::advertise(&catalog, def).await.map(|_| ())
                }
                Err(e) => Err(e),
            };
            if let Err(e) = retried {
                warn!(tool = %def.id, error = %e, "cannot write the definition into the catalog");
            }
        }
    }
}

/// The durable consumer of one tool, shared by every copy of its worker.
async fn consumer(
    stream: &jetstream::stream::Stream,
    config: &WorkerConfig,
    def: &toolfleet_protocol::tools::ToolDefinition,
) -> Result<jetstream::consumer::Consumer<pull::Config>, WorkerError> {
    let name = config.subjects.tool_consumer(&def.id);
    let filter = config.subjects.tool(&def.id);
    let settings = pull::Config {
        durable_name: Some(name.clone()),
        filter_subject: filter.clone(),
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: config.ack_wait_for(def),
        // Our own cap terminates first; this is the backstop for a job
        // that kills its worker every time.
        max_deliver: i64::from(config.max_attempts) + 2,
        max_ack_pending: 10_000,
        ..Default::default()
    };
    let mut consumer: jetstream::consumer::Consumer<pull::Config> = stream
        .get_or_create_consumer(&name, settings.clone())
        .await
        .map_err(|e| WorkerError::Nats(format!("consumer for {}: {e}", def.id)))?;
    // Consumer names fold `.` into `_`, so two ids can meet in one name
    // (`a:b_c` and `a_b:c`): never pull another tool's jobs.
    let info = consumer
        .info()
        .await
        .map_err(|e| WorkerError::Nats(format!("consumer {name}: {e}")))?;
    if info.config.filter_subject != filter {
        return Err(WorkerError::Config(format!(
            "the consumer {name} belongs to {}, not to {} (their ids fold to one consumer name; rename one tool)",
            info.config.filter_subject, def.id
        )));
    }
    // Made by an earlier release or with another timeout: bring its ack
    // wait to this one's (an editable setting; the copies of a pool agree
    // because they serve the same definition).
    if info.config.ack_wait != settings.ack_wait {
        match stream.create_consumer(settings.clone()).await {
            Ok(updated) => consumer = updated,
            Err(e) => warn!(consumer = %name, error = %e, ack_wait = ?info.config.ack_wait,
                "cannot update the consumer's ack wait; a frozen worker's jobs wait that long"),
        }
    }
    Ok(consumer)
}

/// Citations and blobs to Redis, progress to the caller's reply subject.
struct LiveSink {
    client: async_nats::Client,
    store: CitationStore,
    metrics: WorkerMetrics,
}

impl Sink for LiveSink {
    fn cite<'a>(
        &'a self,
        call: &'a CallContext,
        reservation: String,
        refs: Vec<NewReference>,
    ) -> BoxFuture<'a, Result<Vec<Reference>, ToolError>> {
        async move {
            let tool = call.tool_id.to_string();
            let stored = self
                .store
                .reserve(
                    &call.invocation.invocation_id,
                    &reservation,
                    &call.call_id,
                    &tool,
                    refs,
                    call.citation_floor,
                )
                .await
                .map_err(|e| ToolError::transient(e.to_string()))?;
            self.metrics
                .citations_written
                .with_label_values(&[tool.as_str()])
                .inc_by(stored.len() as u64);
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
            self.store
                .put_blob(
                    &call.invocation.invocation_id,
                    &blob_id,
                    &content_type,
                    &bytes,
                )
                .await
                .map_err(|e| match e.kind() {
                    // Refused before it was sent: another attempt would
                    // be refused too.
                    toolfleet_store::ErrorKind::TooLarge | toolfleet_store::ErrorKind::Invalid => {
                        ToolError::failed(e.to_string())
                    }
                    _ => ToolError::transient(e.to_string()),
                })
        }
        .boxed()
    }

    fn progress<'a>(&'a self, call: &'a CallContext, message: String) -> BoxFuture<'a, ()> {
        async move {
            let reply = ToolReply::Progress {
                invocation_id: call.invocation.invocation_id.clone(),
                call_id: call.call_id.clone(),
                message,
            };
            let _ = self
                .client
                .publish(call.reply_to.clone(), encode(&reply))
                .await;
        }
        .boxed()
    }
}

async fn direct_loop(
    mut endpoint: async_nats::service::endpoint::Endpoint,
    tool: Arc<Served>,
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
        let (tool, shared) = (tool.clone(), shared.clone());
        tracker.spawn(async move {
            let no_headers = async_nats::HeaderMap::new();
            let headers = request.message.headers.as_ref().unwrap_or(&no_headers);
            let processed = process(
                headers,
                &request.message.payload,
                1,
                None,
                crate::service_stats::Via::Direct,
                &tool,
                &shared,
            )
            .await;
            // Direct delivery has no redelivery: a failure that JetStream
            // would retry is the caller's error result now.
            let mut to_record = None;
            let response = match processed {
                Processed::Call(call, Outcome::Answer { result, ran }) => {
                    let json = encode_result(&result);
                    let response = Ok(fit_result(&shared, &result, Some(&json)));
                    if ran && !tool.definition().idempotent {
                        to_record = Some((call, json));
                    }
                    response
                }
                Processed::Call(call, Outcome::Retry(failure) | Outcome::Dead(failure)) => {
                    Ok(fit_result(&shared, &failure.result_for(&call, 1), None))
                }
                // No call context to answer in: the service error says why.
                Processed::Unanswerable(failure) => Err(async_nats::service::error::Error {
                    status: format!("{}: {}", failure.code, failure.message),
                    code: 400,
                }),
            };
            // As for a JetStream job: the caller first, then the ledger.
            let recording = to_record
                .as_ref()
                .map(|(call, json)| shared.recording.start(call, json.clone()));
            let _ = request.respond(response).await;
            if let Some((call, json)) = &to_record {
                write_ledger(&shared, call, json).await;
            }
            drop(recording);
            drop(permit);
        });
    }
    let _ = endpoint.stop().await;
}

/// Why a delivery was not answered by its tool: a code and a message.
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

    fn result_for(&self, call: &CallContext, attempt: u32) -> ToolResult {
        error_result(call, attempt, 0, &self.code, &self.message)
    }
}

/// What became of one delivery of a job.
// Returned once per delivery and matched at once: boxing the call would
// cost an allocation per job to save a move.
#[allow(clippy::large_enum_variant)]
enum Processed {
    /// No call to answer: its headers cannot be read, or its reply subject
    /// is not the fleet's. Dead: terminated and dead-lettered.
    Unanswerable(Failure),
    /// A call, and what became of it.
    Call(CallContext, Outcome),
}

/// What became of a call.
enum Outcome {
    /// Tell the caller this result; the job is done. `ran`: the tool ran
    /// for it, so it goes into the ledger (after the caller has it).
    Answer { result: Box<ToolResult>, ran: bool },
    /// Another attempt may help (until the attempt cap).
    Retry(Failure),
    /// Never again: terminate and dead-letter; the caller gets an error
    /// result.
    Dead(Failure),
}

impl Outcome {
    /// An answer the tool did not run for (replayed, refused, invalid):
    /// nothing to write to the ledger.
    fn refused(result: ToolResult) -> Self {
        Outcome::Answer {
            result: Box::new(result),
            ran: false,
        }
    }
}

/// One delivery from the tool's consumer. The pull loop keeps it alive
/// (in-progress acks) until `slot` is dropped, when this returns.
async fn handle_jetstream(
    msg: jetstream::Message,
    mut slot: toolfleet_service::jobs::Slot,
    tool: &Served,
    shared: &Shared,
) {
    let (attempt, sequence, first_published) = match msg.info() {
        Ok(i) => (
            u32::try_from(i.delivered).unwrap_or(1).max(1),
            i.stream_sequence,
            (i.delivered == 1).then(|| {
                std::time::UNIX_EPOCH
                    + Duration::from_nanos(
                        u64::try_from(i.published.unix_timestamp_nanos()).unwrap_or(0),
                    )
            }),
        ),
        Err(_) => (1, 0, None),
    };
    let no_headers = async_nats::HeaderMap::new();
    let headers = msg.headers.as_ref().unwrap_or(&no_headers);
    let processed = process(
        headers,
        &msg.payload,
        attempt,
        first_published,
        crate::service_stats::Via::JetStream,
        tool,
        shared,
    )
    .await;
    let (call, failure) = match processed {
        Processed::Call(call, Outcome::Answer { result, ran }) => {
            let to_ledger = ran && !tool.definition().idempotent;
            answer(shared, &call, &result, to_ledger, || slot.free()).await;
            // Only now: the result is out and (when the tool ran) in the
            // ledger, so a crash before this ack redelivers a job that
            // either replays its result or runs again.
            let _ = msg.ack().await;
            return;
        }
        Processed::Call(_, Outcome::Retry(failure)) if attempt < shared.config.max_attempts => {
            shared
                .metrics
                .tool_job_retries
                .with_label_values(&[tool.label()])
                .inc();
            warn!(tool = %tool.label(), attempt, error = %failure.message, "attempt failed; will retry");
            let _ = msg
                .ack_with(AckKind::Nak(Some(shared.config.retry_delay)))
                .await;
            return;
        }
        Processed::Call(call, Outcome::Retry(failure) | Outcome::Dead(failure)) => {
            (Some(call), failure)
        }
        Processed::Unanswerable(failure) => (None, failure),
    };
    // The caller always gets an answer, even for a dead job.
    if let Some(call) = &call {
        let result = failure.result_for(call, attempt);
        publish_reply(shared, call, fit_result(shared, &result, None)).await;
    }
    let _ = msg.ack_with(AckKind::Term).await;
    let dead = DeadLetter {
        kind: DeadLetterKind::Tool,
        stream: shared.config.subjects.tools_stream(),
        stream_sequence: sequence,
        invocation_id: call.as_ref().map(|c| c.invocation.invocation_id.clone()),
        call_id: call.as_ref().map(|c| c.call_id.clone()),
        tool_id: Some(tool.label().to_string()),
        attempts: attempt,
        code: failure.code.clone(),
        error: failure.message,
        headers: toolfleet_protocol::dead_letter_headers(Some(headers)),
        raw_headers: None,
        job: toolfleet_protocol::dead_letter_job(&msg.payload),
    };
    shared
        .metrics
        .dead_letters
        .with_label_values(&["tool", tool.label()])
        .inc();
    let _ = shared
        .client
        .publish(
            shared.config.subjects.dead_letter(DeadLetterKind::Tool),
            encode(&dead),
        )
        .await;
    warn!(tool = %tool.label(), attempt, code = %failure.code, "tool job dead-lettered");
}

/// Ends a tool job whose headers the NATS client cannot read (found by the
/// pull loop's sweep and already removed from the stream): an error result
/// to its caller when the call can be read from it — invocation, call id
/// and a reply subject of this fleet — and a dead letter with the headers
/// as stored.
async fn poison(tool: Arc<Served>, shared: Arc<Shared>, poison: toolfleet_service::poison::Poison) {
    use toolfleet_protocol::headers::{CALL_ID, INVOCATION_ID, REPLY_TO};
    let label = tool.label().to_string();
    let valid = |name| {
        poison
            .header(name)
            .filter(|v| toolfleet_protocol::valid_invocation_id(v))
            .map(str::to_string)
    };
    let invocation_id = valid(INVOCATION_ID);
    let call_id = valid(CALL_ID);
    let message = format!(
        "the tool job's headers cannot be read ({}); it was removed from the queue",
        poison.reason
    );
    shared.count(&label, "error");
    if let (Some(inv), Some(call_id), Some(reply_to)) = (
        &invocation_id,
        &call_id,
        poison
            .header(REPLY_TO)
            .filter(|r| shared.config.subjects.is_reply_subject(r)),
    ) {
        let call = CallContext {
            invocation: toolfleet_protocol::InvocationContext::new(inv.clone()),
            call_id: call_id.clone(),
            tool_id: tool.definition().id.clone(),
            attempt: 1,
            reply_to: reply_to.to_string(),
            citation_floor: 0,
            new_call: false,
        };
        let result = error_result(&call, 1, 0, "unreadable_headers", &message);
        publish_reply(&shared, &call, fit_result(&shared, &result, None)).await;
    }
    let dead = DeadLetter {
        kind: DeadLetterKind::Tool,
        stream: shared.config.subjects.tools_stream(),
        stream_sequence: poison.stream_sequence,
        invocation_id,
        call_id,
        tool_id: Some(label),
        attempts: 1,
        code: "unreadable_headers".into(),
        error: message,
        job: None,
        headers: Default::default(),
        raw_headers: Some(poison.raw_headers),
    };
    shared
        .metrics
        .dead_letters
        .with_label_values(&["tool", tool.label()])
        .inc();
    let _ = shared
        .client
        .publish(
            shared.config.subjects.dead_letter(DeadLetterKind::Tool),
            encode(&dead),
        )
        .await;
}

/// Answers `call` with `result`; then, when the tool ran for it and is
/// not idempotent (`to_ledger`), writes it to the ledger, so a redelivery
/// or a re-publish of the job returns it without running again. The caller does not wait for
/// the ledger: the job's ack does (it comes after this returns), so a crash
/// between the reply and the write is a crash before the write — the job
/// is delivered again and runs again, reusing its citation indices. Until
/// the write is done this worker answers a repeat of the call from memory
/// ([`Recording`]).
///
/// `answered` runs once the reply is out: the job's permit goes back then,
/// so the next job is pulled while this one's ledger write is on its way.
async fn answer(
    shared: &Shared,
    call: &CallContext,
    result: &ToolResult,
    to_ledger: bool,
    answered: impl FnOnce(),
) {
    // Encoded once: the ledger holds these bytes, the reply is them
    // tagged as a result.
    let json = encode_result(result);
    let recording = to_ledger.then(|| shared.recording.start(call, json.clone()));
    publish_reply(shared, call, fit_result(shared, result, Some(&json))).await;
    answered();
    if to_ledger {
        write_ledger(shared, call, &json).await;
    }
    drop(recording);
}

/// The most results one ledger write carries.
const LEDGER_BATCH: usize = 256;

/// The most bytes of results one ledger write carries.
const LEDGER_BATCH_BYTES: usize = 1024 * 1024;

/// One result on its way to the ledger, and who waits for it.
struct LedgerWrite {
    invocation_id: String,
    call_id: String,
    json: bytes::Bytes,
    done: tokio::sync::oneshot::Sender<Result<(), String>>,
}

/// Writes results to the ledger in batches: whatever is waiting when the
/// previous write returns goes in the next (one Redis pipeline on a single
/// server), so under load the ledger costs one round trip per batch, not
/// per job; alone, a write goes at once. Each job still waits for (and
/// acks after) the write that carries its result.
struct LedgerWriter {
    tx: tokio::sync::mpsc::UnboundedSender<LedgerWrite>,
}

impl LedgerWriter {
    /// Starts the writer task; it ends once the writer is dropped and
    /// every write sent has been carried out.
    fn start(store: CitationStore) -> Self {
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<LedgerWrite>();
        tokio::spawn(async move {
            let mut batch = Vec::with_capacity(LEDGER_BATCH);
            while rx.recv_many(&mut batch, LEDGER_BATCH).await > 0 {
                // In pipelines of at most LEDGER_BATCH_BYTES (one result
                // larger than that goes alone).
                let mut pending = batch.drain(..).peekable();
                while pending.peek().is_some() {
                    let (mut chunk, mut bytes) = (Vec::new(), 0);
                    while let Some(write) = pending
                        .next_if(|w| chunk.is_empty() || bytes + w.json.len() <= LEDGER_BATCH_BYTES)
                    {
                        bytes += write.json.len();
                        chunk.push(write);
                    }
                    let results: Vec<(&str, &str, &[u8])> = chunk
                        .iter()
                        .map(|w| (w.invocation_id.as_str(), w.call_id.as_str(), &w.json[..]))
                        .collect();
                    let outcome = store
                        .ledger_put_many(&results)
                        .await
                        .map_err(|e| e.to_string());
                    drop(results);
                    for write in chunk {
                        let _ = write.done.send(outcome.clone());
                    }
                }
            }
        });
        Self { tx }
    }

    /// Writes `json`, the encoded result of `call`; returns once it is
    /// stored, or why it could not be.
    async fn write(&self, call: &CallContext, json: bytes::Bytes) -> Result<(), String> {
        let (done, stored) = tokio::sync::oneshot::channel();
        self.tx
            .send(LedgerWrite {
                invocation_id: call.invocation.invocation_id.clone(),
                call_id: call.call_id.clone(),
                json,
                done,
            })
            .map_err(|_| closed())?;
        stored.await.map_err(|_| closed())?
    }
}

fn closed() -> String {
    "the ledger writer has stopped".to_string()
}

/// A result as the ledger stores it.
fn encode_result(result: &ToolResult) -> bytes::Bytes {
    serde_json::to_vec(result)
        .map(bytes::Bytes::from)
        .unwrap_or_default()
}

/// Writes an answered call's result (`json`) to the ledger. If it cannot
/// be written the result is out all the same: a later duplicate will run
/// again, reusing its citation indices.
async fn write_ledger(shared: &Shared, call: &CallContext, json: &bytes::Bytes) {
    if let Err(e) = shared.ledger.write(call, json.clone()).await {
        shared.hooks.on_warning(
            call,
            &toolfleet_protocol::ToolWarning {
                code: "ledger_not_written".to_owned(),
                message: format!("result ledger not written: {e}"),
            },
        );
        warn!(error = %e, "result ledger not written");
    }
}

/// Publishes an encoded reply to the call's reply subject. No headers:
/// the reply names its invocation and call in its body (which the caller
/// checks against the call), and a caller reads nothing else.
async fn publish_reply(shared: &Shared, call: &CallContext, payload: bytes::Bytes) {
    if let Err(e) = shared.client.publish(call.reply_to.clone(), payload).await {
        warn!(error = %e, "cannot publish the tool result");
    }
}

/// The encoded result reply (from `json`, the result already encoded,
/// when given). A result too big for the server would never arrive: the
/// caller gets a small error result instead of waiting out its timeout.
fn fit_result(shared: &Shared, result: &ToolResult, json: Option<&[u8]>) -> bytes::Bytes {
    let payload = match json.and_then(tagged_result) {
        Some(payload) => payload,
        None => encode(&ToolReply::Result(Box::new(result.clone()))),
    };
    let limit = shared.client.max_payload();
    if limit == 0 || payload.len() <= limit {
        return payload;
    }
    let message = format!(
        "the tool's result is {} bytes; the NATS server takes at most {limit}",
        payload.len()
    );
    warn!(tool = %result.tool_id, "{message}");
    encode(&ToolReply::Result(Box::new(ToolResult {
        status: ToolStatus::Error,
        content: message.clone(),
        data: None,
        error: Some(ToolErrorBody {
            code: "result_too_large".into(),
            message,
            violations: Vec::new(),
        }),
        references: Vec::new(),
        ..result.clone()
    })))
}

/// `ToolReply::Result` as serde encodes it (the tag first, then the
/// result's fields), from the result's own encoding: `{"type":"result",`
/// and the object's fields. `None` for anything but a non-empty object.
fn tagged_result(json: &[u8]) -> Option<bytes::Bytes> {
    const TAG: &[u8] = b"{\"type\":\"result\",";
    let fields = json.strip_prefix(b"{")?;
    if !fields.starts_with(b"\"") {
        return None;
    }
    let mut out = Vec::with_capacity(TAG.len() + fields.len());
    out.extend_from_slice(TAG);
    out.extend_from_slice(fields);
    Some(out.into())
}

pub(crate) fn error_result(
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

pub(crate) fn status_result(
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
        llm_calls: Vec::new(),
        warnings: Vec::new(),
    }
}

/// Processes one delivery. Shared by JetStream and direct delivery;
/// `first_published` is when JetStream stored the job, for its first
/// delivery only.
async fn process(
    headers: &async_nats::HeaderMap,
    payload: &[u8],
    attempt: u32,
    first_published: Option<std::time::SystemTime>,
    via: crate::service_stats::Via,
    tool: &Served,
    shared: &Shared,
) -> Processed {
    let label = tool.label();
    let mut call = match CallContext::from_headers(headers) {
        Ok(c) => c,
        Err(e) => {
            shared.count(label, "error");
            warn!(tool = %label, error = %e, "tool job with bad headers");
            return Processed::Unanswerable(Failure::new(e.code(), e.to_string()));
        }
    };
    call.attempt = attempt;
    // Results go only to the fleet's reply subjects: a job that names
    // anything else (another fleet's subject, `chat.submit`, an events
    // subject) is a forgery or a bug, and gets no answer.
    if !shared.config.subjects.is_reply_subject(&call.reply_to) {
        shared.count(label, "error");
        warn!(tool = %label, reply_to = %call.reply_to, "tool job with a reply subject outside the fleet's reply prefix");
        return Processed::Unanswerable(Failure::new(
            "bad_reply_subject",
            format!(
                "the reply subject {:?} is not under {}",
                call.reply_to,
                shared.config.subjects.replies_all()
            ),
        ));
    }
    let span = tracing::info_span!(
        "tool_job",
        otel.name = format!("execute_tool {}", tool.definition().id.name),
        otel.kind = "consumer",
        otel.status_code = tracing::field::Empty,
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = %label,
        gen_ai.tool.call.id = %call.call_id,
        gen_ai.tool.type = "function",
        error.type = tracing::field::Empty,
        invocation_id = %call.invocation.invocation_id,
        call_id = %call.call_id,
        tool_id = %label,
        attempt,
        trace_id = tracing::field::Empty,
    );
    let incoming = call.invocation.traceparent.clone();
    toolfleet_service::telemetry::set_parent(&span, incoming.as_deref());
    if let Some(id) = incoming
        .as_deref()
        .and_then(toolfleet_service::telemetry::trace_id)
    {
        span.record("trace_id", id);
    }
    let started = std::time::Instant::now();
    let outcome = process_call(&call, payload, first_published, tool, shared)
        .instrument(span.clone())
        .await;
    let (status, error) = match &outcome {
        Outcome::Answer { result, .. } => (
            result.status.as_str(),
            result
                .error
                .as_ref()
                .map(|e| (e.code.as_str(), e.message.as_str())),
        ),
        Outcome::Retry(f) => ("retry", Some((f.code.as_str(), f.message.as_str()))),
        Outcome::Dead(f) => ("dead", Some((f.code.as_str(), f.message.as_str()))),
    };
    let code = error.map(|(code, _)| code);
    shared
        .stats(tool)
        .jobs
        .record(via, status, error, started.elapsed());
    span.record(
        "otel.status_code",
        if code.is_none() { "ok" } else { "error" },
    );
    if let Some(code) = code {
        span.record("error.type", code);
    }
    // One line per finished job, inside its span (its ids and trace id).
    span.in_scope(|| {
        info!(
            outcome = status,
            code = code.unwrap_or(""),
            duration_ms = started.elapsed().as_millis() as u64,
            "tool job finished"
        );
    });
    Processed::Call(call, outcome)
}

impl Shared {
    /// Whether this worker has heard every cancel that could concern a job
    /// JetStream stored at `published`: it has been listening, without a
    /// reconnect, since at least [`WorkerConfig::cancel_hearing_margin`]
    /// before, and still remembers what it heard then.
    fn heard_all_cancels(&self, published: std::time::SystemTime) -> bool {
        let connects = self
            .nats_stats
            .connects
            .load(std::sync::atomic::Ordering::Relaxed);
        let connected = self.client.connection_state() == async_nats::connection::State::Connected;
        let Some(since) = self.running.hearing_since(connects, connected) else {
            return false;
        };
        let margin = self.config.cancel_hearing_margin;
        // A publication time ahead of this host's clock: the clocks
        // disagree, and the margin cannot be trusted.
        let Ok(age) = std::time::SystemTime::now().duration_since(published) else {
            return false;
        };
        published >= since + margin && age + margin < REMEMBER_CANCEL
    }

    fn count(&self, tool: &str, outcome: &str) {
        self.metrics
            .tool_jobs
            .with_label_values(&[tool, outcome])
            .inc();
    }

    /// `tool`'s metrics (every served tool has them from the start).
    fn stats(&self, tool: &Served) -> std::borrow::Cow<'_, ToolStats> {
        match self.stats.get(tool.label()) {
            Some(stats) => std::borrow::Cow::Borrowed(stats),
            None => std::borrow::Cow::Owned(ToolStats {
                in_flight: self
                    .metrics
                    .tool_jobs_in_flight
                    .with_label_values(&[tool.label()]),
                duration: self
                    .metrics
                    .tool_job_duration
                    .with_label_values(&[tool.label()]),
                ok: self
                    .metrics
                    .tool_jobs
                    .with_label_values(&[tool.label(), "ok"]),
                jobs: Arc::default(),
            }),
        }
    }
}

/// The checks before a call runs; `Err` is the answer without running it.
async fn admit(
    call: &CallContext,
    payload: &[u8],
    first_published: Option<std::time::SystemTime>,
    tool: &Served,
    shared: &Shared,
) -> Result<ToolJob, Outcome> {
    let def = tool.definition();
    let label = tool.label();
    let attempt = call.attempt;
    if call.tool_id != def.id {
        shared.count(label, "error");
        return Err(Outcome::Dead(Failure::new(
            "wrong_tool",
            format!(
                "this subject serves {}, but the job names {}",
                def.id, call.tool_id
            ),
        )));
    }
    // A redelivered (or re-published) job returns what the first attempt
    // stored, and writes no second set of citations: from this worker's
    // memory while the ledger write is on its way, else from the ledger.
    // A job of a cancelled invocation (its cancel came while it was
    // queued, perhaps before this worker started) is answered `cancelled`
    // without running.
    //
    // The first delivery of a new call has no stored result, and when this
    // worker has heard every cancel since well before the job was
    // published, its memory answers for the tombstone: no Redis read.
    let stored = match shared.recording.get(call) {
        Some(stored) => Ok((Some(stored), false)),
        None => {
            let heard = |p| shared.heard_all_cancels(p);
            let remembered = (call.new_call && first_published.is_some_and(heard)).then(|| {
                shared.running.remembers_cancel(&run_key(
                    call.invocation.tenant(),
                    &call.invocation.invocation_id,
                ))
            });
            match remembered {
                // Still heard after the look: a flood of cancels may have
                // emptied the memory meanwhile.
                Some(cancelled) if cancelled || first_published.is_some_and(heard) => {
                    Ok((None, cancelled))
                }
                _ => {
                    shared
                        .store
                        .ledger_and_cancel(
                            &call.invocation.invocation_id,
                            &call.call_id,
                            call.invocation.tenant(),
                        )
                        .await
                }
            }
        }
    };
    match stored {
        Ok((Some(mut stored), _)) => {
            shared.count(label, "redelivered");
            stored.replayed = true;
            stored.attempt = attempt;
            return Err(Outcome::refused(stored));
        }
        Ok((None, true)) => {
            shared.count(label, "cancelled");
            return Err(Outcome::refused(status_result(
                call,
                attempt,
                0,
                ToolStatus::Error,
                "cancelled",
                "the invocation was cancelled before this call started",
                Vec::new(),
            )));
        }
        Ok((None, false)) => {}
        Err(e) => {
            return Err(Outcome::Retry(Failure::new(
                "store_unavailable",
                e.to_string(),
            )));
        }
    }
    let job: ToolJob = Envelope::ToolJob.decode(payload).map_err(|e| {
        shared.count(label, "error");
        let message = format!("malformed tool job: {e}");
        Outcome::refused(error_result(call, attempt, 0, e.code(), &message))
    })?;
    // Invalid arguments: a model-readable error at once, no side effect,
    // nothing written to Redis, never retried.
    if let Err(violations) = tool.tool.validate_arguments(&job.arguments) {
        shared.count(label, "invalid_arguments");
        let message = format!(
            "Invalid arguments for {}: {}",
            def.function.name,
            toolfleet_protocol::schema::describe(&violations)
        );
        return Err(Outcome::refused(status_result(
            call,
            attempt,
            0,
            ToolStatus::Error,
            "invalid_arguments",
            &message,
            violations,
        )));
    }
    let info = CallInfo {
        call,
        definition: def,
        arguments: &job.arguments,
        settings: job.settings.as_ref(),
    };
    if let Err(refusal) = shared.hooks.before_call(&info) {
        shared.count(label, "blocked");
        return Err(Outcome::refused(status_result(
            call,
            attempt,
            0,
            ToolStatus::Blocked,
            &refusal.code,
            &refusal.message,
            Vec::new(),
        )));
    }
    Ok(job)
}

/// How long the call may run: the tool's timeout, or less when the
/// invocation's deadline is nearer. `None` when the deadline has passed.
fn budget(call: &CallContext, tool: &Served) -> Option<Duration> {
    let timeout = tool.definition().timeout();
    match call.invocation.deadline_ms {
        None => Some(timeout),
        Some(deadline) => {
            let left = deadline.saturating_sub(toolfleet_protocol::now_ms());
            (left > 0).then(|| timeout.min(Duration::from_millis(left)))
        }
    }
}

async fn process_call(
    call: &CallContext,
    payload: &[u8],
    first_published: Option<std::time::SystemTime>,
    tool: &Served,
    shared: &Shared,
) -> Outcome {
    let job = match admit(call, payload, first_published, tool, shared).await {
        Ok(job) => job,
        Err(outcome) => return outcome,
    };
    let label = tool.label();
    let attempt = call.attempt;
    let Some(budget) = budget(call, tool) else {
        shared.count(label, "timeout");
        return Outcome::refused(status_result(
            call,
            attempt,
            0,
            ToolStatus::Timeout,
            "deadline_exceeded",
            "the invocation's deadline passed before the tool could run",
            Vec::new(),
        ));
    };
    let token = CancellationToken::new();
    let key = run_key(call.invocation.tenant(), &call.invocation.invocation_id);
    let _running = shared
        .running
        .register(key.clone(), &call.call_id, token.clone());
    let ctx = ToolCtx::new(
        call.clone(),
        job.settings,
        shared.sink.clone(),
        shared.hooks.clone(),
        // Not tied to the worker's shutdown: calls in flight finish during
        // the drain (SIGTERM stops pulling, not working). A cancel of the
        // invocation does stop them.
        token,
        Some(tokio::time::Instant::now() + budget),
    );
    let stats = shared.stats(tool);
    stats.in_flight.inc();
    shared.hooks.on_start(call);
    let started = Instant::now();
    let ran = match run_tool(tool, &ctx, job.arguments, budget).await {
        // This call alone was cancelled (`toolfleet cancel --call`): its
        // caller goes on without it, so not `cancelled`, which ends the
        // invocation.
        Err(ToolError::Cancelled(_)) if shared.running.call_cancelled(&key, &call.call_id) => {
            Err(ToolError::coded(
                "call_cancelled",
                "an operator cancelled this call; the tool was stopped",
            ))
        }
        ran => ran,
    };
    ctx.cancellation().cancel();
    stats.in_flight.dec();
    let elapsed = started.elapsed();
    stats.duration.observe(elapsed.as_secs_f64());
    let duration_ms = elapsed.as_millis() as u64;

    let result = match ran {
        Ok(output) => ToolResult {
            invocation_id: call.invocation.invocation_id.clone(),
            call_id: call.call_id.clone(),
            tool_id: label.to_string(),
            status: ToolStatus::Ok,
            content: output.content,
            data: output.data,
            error: None,
            references: ctx.take_cited(),
            attempt,
            duration_ms,
            replayed: false,
            llm_calls: ctx.take_llm_calls(),
            warnings: ctx.take_warnings(),
        },
        Err(e) => {
            shared.hooks.on_error(call, &e);
            if e.is_retryable() {
                shared.count(label, "error");
                return Outcome::Retry(Failure::new(
                    e.code(),
                    shared.hooks.scrubber().text(&e.to_string()),
                ));
            }
            let status = match e {
                ToolError::Blocked(_) => ToolStatus::Blocked,
                ToolError::Timeout(_) => ToolStatus::Timeout,
                _ => ToolStatus::Error,
            };
            let mut failed = status_result(
                call,
                attempt,
                duration_ms,
                status,
                e.code(),
                &e.to_string(),
                Vec::new(),
            );
            // What the tool spent counts even when it failed.
            failed.llm_calls = ctx.take_llm_calls();
            failed.warnings = ctx.take_warnings();
            failed
        }
    };
    let mut result = result;
    scrub(shared.hooks.scrubber(), &mut result);
    finish(shared, &stats, call, label, result)
}

/// Takes the worker's secrets out of a result before anyone sees it.
fn scrub(scrubber: &crate::settings::Scrubber, result: &mut ToolResult) {
    if scrubber.is_empty() {
        return;
    }
    scrubber.in_place(&mut result.content);
    if let Some(data) = result.data.as_mut() {
        scrubber.value(data);
    }
    if let Some(error) = result.error.as_mut() {
        scrubber.in_place(&mut error.message);
    }
    for r in &mut result.references {
        scrubber.in_place(&mut r.title);
        for field in [&mut r.source, &mut r.url, &mut r.snippet]
            .into_iter()
            .flatten()
        {
            scrubber.in_place(field);
        }
    }
    for w in &mut result.warnings {
        scrubber.in_place(&mut w.message);
    }
}

/// Counts the result and runs the completion hooks. The result goes into
/// the ledger once the caller has it ([`answer`]).
fn finish(
    shared: &Shared,
    stats: &ToolStats,
    call: &CallContext,
    label: &str,
    result: ToolResult,
) -> Outcome {
    if result.status == ToolStatus::Ok {
        stats.ok.inc();
        shared.hooks.on_complete(call, &result);
    } else {
        shared.count(label, result.status.as_str());
    }
    Outcome::Answer {
        result: Box::new(result),
        ran: true,
    }
}

/// Runs the tool under `budget`. A panicking tool is a failed call, not a
/// stuck job; one out of time is [`ToolError::Timeout`].
async fn run_tool(
    tool: &Served,
    ctx: &ToolCtx,
    arguments: serde_json::Value,
    budget: Duration,
) -> Result<crate::ToolOutput, ToolError> {
    let cancelled = || {
        Err(ToolError::Cancelled(
            "the invocation was cancelled; the tool was stopped".into(),
        ))
    };
    // A call whose invocation was cancelled before it started never
    // starts its tool.
    if ctx.cancellation().is_cancelled() {
        return cancelled();
    }
    let deadline = tokio::time::Instant::now() + budget;
    let mut call = std::pin::pin!(
        std::panic::AssertUnwindSafe(tool.imp.call_json(ctx, arguments)).catch_unwind()
    );
    // Most tools answer on their first poll: they need no timer (the
    // answer is taken as `timeout` would take it, before its clock).
    let ran = match futures::poll!(call.as_mut()) {
        std::task::Poll::Ready(ran) => Ok(ran),
        std::task::Poll::Pending => tokio::select! {
            biased;
            _ = ctx.cancelled() => return cancelled(),
            ran = tokio::time::timeout_at(deadline, call) => ran,
        },
    };
    match ran {
        Ok(Ok(ran)) => ran,
        Ok(Err(_panic)) => Err(ToolError::failed(
            "the tool failed unexpectedly (it panicked); see the worker's log",
        )),
        Err(_) => Err(ToolError::Timeout(format!(
            "the tool did not finish within {} ms",
            budget.as_millis()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(inv: &str, call_id: &str) -> CallContext {
        CallContext {
            invocation: toolfleet_protocol::InvocationContext::new(inv),
            call_id: call_id.into(),
            tool_id: "system:current_datetime@1.0.0".parse().unwrap(),
            attempt: 1,
            reply_to: "toolfleet.reply.x".into(),
            citation_floor: 0,
            new_call: false,
        }
    }

    #[test]
    fn a_result_encoded_once_makes_the_same_reply_as_serde() {
        let plain = status_result(
            &call("inv-1", "c1"),
            2,
            7,
            ToolStatus::Error,
            "tool_failed",
            "it \"broke\"",
            Vec::new(),
        );
        let mut rich = ToolResult {
            status: ToolStatus::Ok,
            content: "fine".into(),
            data: Some(serde_json::json!({ "a": [1, 2], "b": null })),
            error: None,
            replayed: true,
            ..plain.clone()
        };
        rich.references.push(Reference {
            index: 3,
            kind: "document".into(),
            title: "t".into(),
            source: None,
            url: Some("https://example.com/".into()),
            snippet: None,
            tool_id: None,
            call_id: Some("c1".into()),
        });
        for result in [plain, rich] {
            let json = encode_result(&result);
            assert_eq!(
                tagged_result(&json).unwrap(),
                encode(&ToolReply::Result(Box::new(result.clone())))
            );
            // The ledger holds the result itself.
            let stored: ToolResult = serde_json::from_slice(&json).unwrap();
            assert_eq!(stored, result);
        }
        assert_eq!(tagged_result(b"{}"), None);
        assert_eq!(tagged_result(b"[1]"), None);
    }

    #[test]
    fn a_result_being_recorded_is_found_until_its_write_is_done() {
        let recording = Recording::default();
        let first = call("inv-1", "c1");
        let result = error_result(&first, 1, 0, "x", "y");
        let guard = recording.start(&first, encode_result(&result));
        assert_eq!(recording.get(&call("inv-1", "c1")), Some(result));
        assert_eq!(recording.get(&call("inv-1", "c2")), None);
        assert_eq!(recording.get(&call("inv-2", "c1")), None);
        drop(guard);
        assert_eq!(recording.get(&first), None);
        assert!(recording.results.lock().unwrap().is_empty());
    }

    #[test]
    fn a_cancel_reaches_running_calls_and_calls_that_register_after_it() {
        let running = Running::default();
        let before = CancellationToken::new();
        let guard = running.register(run_key("acme", "inv-1"), "c1", before.clone());
        let other = CancellationToken::new();
        let _other = running.register(run_key("acme", "inv-2"), "c1", other.clone());
        let elsewhere = CancellationToken::new();
        let _elsewhere = running.register(run_key("globex", "inv-1"), "c1", elsewhere.clone());
        assert_eq!(running.cancel(&run_key("acme", "inv-1")), 1);
        assert!(before.is_cancelled());
        assert!(!other.is_cancelled());
        // The same invocation id under another tenant is another invocation.
        assert!(!elsewhere.is_cancelled());
        drop(guard);
        // Registered after the cancel: starts cancelled.
        let after = CancellationToken::new();
        let _after = running.register(run_key("acme", "inv-1"), "c2", after.clone());
        assert!(after.is_cancelled());
    }

    #[test]
    fn a_call_cancel_stops_that_call_only_and_is_remembered_for_its_job() {
        let running = Running::default();
        let key = run_key("acme", "inv-1");
        let first = CancellationToken::new();
        let _first = running.register(key.clone(), "c1", first.clone());
        let second = CancellationToken::new();
        let _second = running.register(key.clone(), "c2", second.clone());
        assert_eq!(running.cancel_call(&key, "c1"), 1);
        assert!(first.is_cancelled());
        assert!(!second.is_cancelled(), "the invocation goes on");
        assert!(running.call_cancelled(&key, "c1"));
        assert!(!running.call_cancelled(&key, "c2"));
        assert!(!running.call_cancelled(&run_key("globex", "inv-1"), "c1"));
        // Its job, delivered again or late, starts cancelled; another
        // call of the invocation does not.
        let again = CancellationToken::new();
        let _again = running.register(key.clone(), "c1", again.clone());
        assert!(again.is_cancelled());
        let third = CancellationToken::new();
        let _third = running.register(key, "c3", third.clone());
        assert!(!third.is_cancelled());
    }
}
