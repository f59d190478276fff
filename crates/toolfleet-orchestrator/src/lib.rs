//! The orchestrator: takes chat jobs from the `TOOLFLEET_CHAT` work queue
//! with a bounded number in flight and runs one invocation per job.
//!
//! An invocation goes through stages, each a module: **intake** takes the
//! job off the stream; **context** resolves its profile and builds the
//! [`Invocation`] (prompt, conversation, the tools offered); an
//! [`Orchestrator`] chosen by the profile's `orchestrator` name runs it —
//! by default [`Agentic`], the **rounds** loop, which calls the model and
//! has **dispatch** run the tool calls it asks for; then the common end
//! publishes `completed` (or `error`) and intake acks the job last. Every
//! failure ends in an `error` event with a code — never silence.
//!
//! # Layout
//!
//! - [`intake`]: the chat consumer; decoding the chat job, attempts
//!   ([`MAX_CHAT_ATTEMPTS`]), the deadline from the stream's publish time,
//!   dead letters, cancel tokens, in-progress acks, the ack after the
//!   terminal event.
//! - [`context`]: [`Invocation`], built step by step from the job, the
//!   profile and the registry snapshot; where context steps (preemptive
//!   retrieval) plug in.
//! - [`gating`]: the tools a job may use at all (system, profile, selected
//!   and agent tools; purpose, `visibleIn`, provider confidence, liveness).
//! - [`scope`]: which of them the model is offered — all, the most
//!   relevant, or a planning call's pick — and `search_tools` expansion,
//!   suggestions for unknown tools; [`scoping`] holds the pure scoring,
//!   planning prompt and parsing it uses.
//! - [`agents`]: profiles exposed as tools; a call is a nested chat job.
//! - [`orchestrator`]: the [`Orchestrator`] trait, its [`Answer`] and
//!   [`Failure`], and the frame every invocation runs in (`started`, the
//!   chosen orchestrator, `completed`).
//! - [`rounds`]: [`Agentic`], the agentic round loop — model calls with
//!   streamed deltas, and the loop policy's caps.
//! - [`dispatch`]: [`ToolRunner`] — tool jobs out (JetStream or direct),
//!   replies, progress, deadlines and catalog readings in, as one closed
//!   event enum. Replies arrive through `replies`: one wildcard
//!   subscription per orchestrator, routed to each run's inbox.
//! - [`events`]: [`Events`], one invocation's ordered event publisher.
//! - [`usage`]: [`UsageLedger`], tokens and cost per model call.
//! - [`catalog`]: [`LiveCatalog`], the fleet's tools as one value swapped
//!   whole on every reading.
//! - [`limits`]: [`PayloadLimits`], the smaller of the contract's and the
//!   NATS server's size limits.
//! - [`fleet`]: [`Fleet`], what every invocation shares.
//! - [`metrics`]: the orchestrator's Prometheus metrics.
//! - [`sinks`]: response routing — a job's or profile's webhook and relay
//!   sinks, and the relay every orchestrator runs on the sinks stream.
//!
//! # Invariants
//!
//! - Every invocation ends in exactly one terminal event, and the chat job
//!   is acked after it.
//! - Events are numbered in publish order by one task per invocation.
//! - Only tools a live worker serves (agent tools: the orchestrators) and
//!   the job's gates permit are offered; a call to any other tool is
//!   answered at once (with close names), and so is a call whose tool has
//!   been missing from two catalog readings in a row while it waits.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{info, warn};

pub mod agents;
pub mod approvals;
pub mod catalog;
pub mod compaction;
pub mod context;
pub mod dispatch;
pub mod events;
pub mod fleet;
pub mod gating;
pub mod intake;
pub mod limits;
pub mod links;
pub mod metrics;
pub mod orchestrator;
mod pools;
pub mod rag;
mod replies;
pub mod rounds;
pub mod scope;
pub mod scoping;
pub mod sinks;
pub mod usage;

pub use catalog::LiveCatalog;
pub use context::Invocation;
pub use dispatch::{ToolOutcome, ToolRunner};
pub use events::Events;
pub use fleet::Fleet;
pub use intake::MAX_CHAT_ATTEMPTS;
pub use limits::PayloadLimits;
pub use orchestrator::{Answer, Ending, Failure, Orchestrator};
pub use rounds::{Agentic, PURPOSE_CONVERSATION};
pub use usage::UsageLedger;

use crate::metrics::OrchestratorMetrics;
use toolfleet_config::{DEFAULT_ORCHESTRATOR, FleetConfig};
use toolfleet_llm::deployments::{EnvSource, ProcessEnv};
use toolfleet_protocol::Subjects;
use toolfleet_store::CitationStore;

/// The system prompt of a profile that sets none.
pub const DEFAULT_SYSTEM_PROMPT: &str = "You are a helpful assistant with tools. When a tool result contains markers like [doc:3], cite the passages you use with those exact markers.";

/// How the orchestrator runs. Model endpoints, prompts and loop policies
/// come from the profiles ([`FleetConfig`]), resolved per chat job; the
/// profile's `orchestrator` names one of [`orchestrators`](Self::register_orchestrator)
/// registered here.
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
    /// How often the live worker catalog is read.
    pub catalog_refresh: Duration,
    /// How long a catalog reading collects answers.
    pub catalog_wait: Duration,
    /// Recommended models per tool (`--tool-compat`), joined to the
    /// registry on every rebuild.
    pub compat: Option<Arc<toolfleet_protocol::registry::CompatFile>>,
    /// Webhook and relay sinks: retries, SSRF exceptions, allowed relays.
    pub sinks: sinks::SinkSettings,
    /// Orchestrators by the name a profile gives; [`Agentic`] is
    /// registered as [`DEFAULT_ORCHESTRATOR`].
    orchestrators: BTreeMap<String, Arc<dyn Orchestrator>>,
}

impl std::fmt::Debug for OrchestratorConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrchestratorConfig")
            .field("subjects", &self.subjects)
            .field(
                "profiles",
                &self.profiles.profiles.keys().collect::<Vec<_>>(),
            )
            .field("orchestrators", &self.orchestrator_names())
            .field("max_in_flight", &self.max_in_flight)
            .finish_non_exhaustive()
    }
}

impl OrchestratorConfig {
    pub fn new(subjects: Subjects, profiles: FleetConfig) -> Self {
        let mut config = Self {
            subjects,
            profiles: Arc::new(profiles),
            env: Arc::new(ProcessEnv),
            max_in_flight: 32,
            default_timeout: Duration::from_secs(120),
            tool_wait_slack: Duration::from_secs(2),
            catalog_refresh: Duration::from_secs(2),
            catalog_wait: Duration::from_millis(250),
            compat: None,
            sinks: sinks::SinkSettings::default(),
            orchestrators: BTreeMap::new(),
        };
        config.register_orchestrator(DEFAULT_ORCHESTRATOR, Agentic);
        config
    }

    /// Registers `orchestrator` under `name`: a profile with
    /// `orchestrator = "<name>"` then runs with it. Registering a name again
    /// replaces the earlier one (`agentic` included).
    pub fn register_orchestrator(
        &mut self,
        name: impl Into<String>,
        orchestrator: impl Orchestrator,
    ) -> &mut Self {
        self.orchestrators
            .insert(name.into(), Arc::new(orchestrator));
        self
    }

    /// The registered orchestrator names, sorted.
    pub fn orchestrator_names(&self) -> Vec<&str> {
        self.orchestrators.keys().map(String::as_str).collect()
    }

    /// The orchestrator registered under `name`.
    pub fn orchestrator(&self, name: &str) -> Option<Arc<dyn Orchestrator>> {
        self.orchestrators.get(name).cloned()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum OrchestratorError {
    #[error("NATS: {0}")]
    Nats(String),
    #[error("configuration: {0}")]
    Config(String),
}

/// Connects to NATS and Redis as configured, registers the metrics on
/// `rt`, and runs the orchestrator on `rt`'s tracker until its shutdown.
/// Returns once the chat consumer is in place.
pub async fn start(
    nats: &toolfleet_service::args::NatsArgs,
    redis: &toolfleet_store::RedisOptions,
    config: OrchestratorConfig,
    rt: toolfleet_service::Runtime,
) -> anyhow::Result<()> {
    use anyhow::Context;
    let store = CitationStore::connect_with(redis, config.subjects.prefix(), redis.ttl)
        .await
        .with_context(|| format!("cannot connect to Redis at {}", redis.redacted_url()))?;
    let client = nats.connect("toolfleet-orchestrator").await?;
    let ping = toolfleet_service::health::ping(store.clone(), |s| async move { s.ping().await });
    toolfleet_service::health::watch_connections(&rt, &client, Some(ping))?;
    let dead_letters = toolfleet_service::metrics::dead_letters(&rt.metrics)?;
    let metrics = OrchestratorMetrics::register(&rt.metrics, dead_letters)?;
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let shutdown = rt.shutdown.clone();
    rt.tracker.spawn(async move {
        if let Err(e) =
            run_with_ready(client, store, config, metrics, shutdown, Some(ready_tx)).await
        {
            tracing::error!(error = %e, "orchestrator stopped");
        }
    });
    ready_rx.await.context("the orchestrator failed to start")?;
    Ok(())
}

/// Runs the orchestrator until `shutdown`; then stops taking jobs and lets
/// invocations in flight finish.
pub async fn run(
    client: async_nats::Client,
    store: CitationStore,
    config: OrchestratorConfig,
    metrics: OrchestratorMetrics,
    shutdown: CancellationToken,
) -> Result<(), OrchestratorError> {
    run_with_ready(client, store, config, metrics, shutdown, None).await
}

/// [`run`], telling `ready` once the chat consumer is in place.
pub async fn run_with_ready(
    client: async_nats::Client,
    store: CitationStore,
    config: OrchestratorConfig,
    metrics: OrchestratorMetrics,
    shutdown: CancellationToken,
    ready: Option<tokio::sync::oneshot::Sender<()>>,
) -> Result<(), OrchestratorError> {
    match PayloadLimits::of(&client).startup_message() {
        Some((limits::Severity::Warning, message)) => warn!("{message}"),
        Some((limits::Severity::Notice, message)) => info!("{message}"),
        None => {}
    }
    // Every fallback a profile can make, and every model's answered
    // requests, at zero from the start.
    for profile in config.profiles.profiles.values() {
        for model in profile
            .deployments
            .iter()
            .filter_map(|d| config.profiles.deployments.get(d))
        {
            metrics
                .llm_requests
                .with_label_values(&[model.model.as_str(), "ok"]);
        }
        for (i, from) in profile.deployments.iter().enumerate() {
            for to in &profile.deployments[i + 1..] {
                metrics
                    .llm_fallbacks
                    .with_label_values(&[from.as_str(), to.as_str()]);
            }
        }
    }
    let js = jetstream::new(client.clone());
    let consumer = intake::chat_consumer(&js, &config.subjects).await?;
    (config.sinks)
        .check_config(&config.subjects, &config.profiles.sinks, &*config.env)
        .map_err(OrchestratorError::Config)?;
    let sink_consumer = sinks::consumer(&js, &config.subjects, &config.sinks).await?;
    let cancel_sub = client
        .subscribe(config.subjects.chat_cancel_all())
        .await
        .map_err(|e| OrchestratorError::Nats(e.to_string()))?;

    // The replies keep flowing until the invocations in flight are done
    // (after `tracker.wait()` below), not just until shutdown is asked: a
    // draining run may still be waiting on its tools.
    let stop_replies = CancellationToken::new();
    let _stop_replies_on_return = stop_replies.clone().drop_guard();
    let replies = replies::Replies::start(&client, &config.subjects, stop_replies)
        .await
        .map_err(|e| OrchestratorError::Nats(e.to_string()))?;
    let agents = agents::AgentSource::new(&config.profiles).map_err(OrchestratorError::Config)?;
    let (approvals, decisions) = approvals::Approvals::open(&js, &config.subjects)
        .await
        .map_err(OrchestratorError::Nats)?;
    let approval_requests = client
        .queue_subscribe(
            config.subjects.chat_approve_all(),
            config.subjects.chat_consumer(),
        )
        .await
        .map_err(|e| OrchestratorError::Nats(e.to_string()))?;
    let fleet = Arc::new(Fleet::new(
        client,
        js,
        store,
        metrics,
        config.clone(),
        fleet::Parts {
            replies,
            agents,
            approvals,
        },
    ));
    fleet.catalog.refresh().await;
    // The registry and its gauges from the first reading on.
    fleet.tool_snapshot();

    let tracker = TaskTracker::new();
    {
        let fleet = fleet.clone();
        let shutdown = shutdown.clone();
        tracker.spawn(async move {
            fleet
                .catalog
                .run(fleet.config.catalog_refresh, shutdown)
                .await
        });
    }
    tracker.spawn(pools::watch(
        fleet.clone(),
        fleet.config.catalog_refresh,
        shutdown.clone(),
    ));
    tracker.spawn(sinks::relay::run(
        fleet.clone(),
        sink_consumer,
        shutdown.clone(),
    ));
    tracker.spawn(intake::listen_for_cancels(
        fleet.clone(),
        cancel_sub,
        shutdown.clone(),
    ));
    tracker.spawn(approvals::serve_requests(
        fleet.clone(),
        approval_requests,
        shutdown.clone(),
    ));
    tracker.spawn(approvals::watch_parked(fleet.clone(), shutdown.clone()));

    let known = config.orchestrator_names();
    for w in config.profiles.warnings_among(&known) {
        warn!("{w}");
    }
    info!(stream = %config.subjects.chat_stream(), profiles = config.profiles.profiles.len(), orchestrators = ?known, "orchestrator taking chat jobs");
    if let Some(ready) = ready {
        let _ = ready.send(());
    }
    let permits = Arc::new(Semaphore::new(config.max_in_flight.max(1)));
    // Decisions on parked invocations: the one that decides a turn's last
    // held call resumes the invocation, as a chat job runs (same permits).
    {
        let fleet = fleet.clone();
        let reconnects =
            toolfleet_service::jobs::Reconnects::watch(fleet.client.clone(), shutdown.clone());
        let sweeper = toolfleet_service::jobs::Sweeper {
            js: async_nats::jetstream::new(fleet.client.clone()),
            stream: config.subjects.decisions_stream(),
            on_poison: Arc::new(|_| futures::FutureExt::boxed(async {})),
        };
        let permits = permits.clone();
        let tracker_for_loop = tracker.clone();
        let shutdown = shutdown.clone();
        let consumer_name = config.subjects.chat_consumer();
        tracker.spawn(async move {
            toolfleet_service::jobs::pull_bounded(
                decisions,
                reconnects,
                sweeper,
                permits,
                tracker_for_loop,
                shutdown,
                consumer_name,
                intake::CHAT_PROGRESS_EVERY,
                move |msg| {
                    let fleet = fleet.clone();
                    async move { approvals::handle_decision(&fleet, msg).await }
                },
            )
            .await;
        });
    }
    {
        let fleet = fleet.clone();
        let reconnects =
            toolfleet_service::jobs::Reconnects::watch(fleet.client.clone(), shutdown.clone());
        let sweeper = {
            let fleet = fleet.clone();
            toolfleet_service::jobs::Sweeper {
                js: async_nats::jetstream::new(fleet.client.clone()),
                stream: config.subjects.chat_stream(),
                on_poison: Arc::new(move |p| {
                    futures::FutureExt::boxed(intake::poison(fleet.clone(), p))
                }),
            }
        };
        toolfleet_service::jobs::pull_bounded(
            consumer,
            reconnects,
            sweeper,
            permits,
            tracker.clone(),
            shutdown.clone(),
            config.subjects.chat_consumer(),
            intake::CHAT_PROGRESS_EVERY,
            move |msg| {
                let fleet = fleet.clone();
                async move { intake::handle(&fleet, msg).await }
            },
        )
        .await;
    }
    tracker.close();
    tracker.wait().await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> OrchestratorConfig {
        let profiles = FleetConfig::from_toml(
            r#"
default_profile = "default"
[deployments.d]
base_url = "http://127.0.0.1:9/v1"
model = "m"
[profiles.default]
deployment = "d"
[profiles.custom]
deployment = "d"
orchestrator = "custom"
"#,
            "test",
        )
        .expect("profiles");
        OrchestratorConfig::new(Subjects::new("toolfleet").expect("prefix"), profiles)
    }

    #[test]
    fn agentic_is_registered_by_default_and_more_can_be_registered() {
        let mut config = config();
        assert_eq!(config.orchestrator_names(), [DEFAULT_ORCHESTRATOR]);
        let unknown = config.profiles.warnings_among(&config.orchestrator_names());
        assert!(
            unknown.iter().any(|w| w.contains("\"custom\"")),
            "{unknown:?}"
        );

        config.register_orchestrator("custom", Agentic);
        assert_eq!(config.orchestrator_names(), ["agentic", "custom"]);
        assert!(config.orchestrator("custom").is_some());
        assert!(config.orchestrator("swarm").is_none());
        // A registered name is no longer worth a warning.
        let warnings = config.profiles.warnings_among(&config.orchestrator_names());
        assert!(warnings.is_empty(), "{warnings:?}");
        assert!(format!("{config:?}").contains("custom"));
    }
}
