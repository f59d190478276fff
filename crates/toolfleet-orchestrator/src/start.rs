//! Start-up and drain: connect, open the streams and consumers, build the
//! [`Fleet`], spawn the background tasks (catalog readings, pool signals,
//! the sink relay, cancels, approval requests and timeouts), then pull
//! decisions and chat jobs until shutdown, and let the invocations in
//! flight finish.

use std::sync::Arc;

use async_nats::jetstream;
use futures::{FutureExt, StreamExt};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_service::jobs::{self, Sweeper};

use crate::settings::ChatDispatch;
use toolfleet_store::CitationStore;
use tracing::{info, warn};

use crate::intake::{self, Plugins};
use crate::metrics::OrchestratorMetrics;
use crate::replies::Replies;
use crate::tools::agents::AgentSource;
use crate::{
    Fleet, OrchestratorConfig, OrchestratorError, PayloadLimits, approvals, fleet, limits, pools,
    sinks,
};

/// Connects to NATS and Redis as configured, registers the metrics on
/// `rt`, and runs the orchestrator on `rt`'s tracker until its shutdown.
/// Returns once the chat stream and the wake-ups of fair dispatch are in
/// place.
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
    rt.watch_connections(&client, Some(ping))?;
    let dead_letters = toolfleet_service::metrics::dead_letters(&rt.metrics)?;
    let metrics = OrchestratorMetrics::register(&rt.metrics, dead_letters)?;
    let orchestrator = Ready::open(client, store, config, metrics, rt.shutdown.clone())
        .await
        .context("the orchestrator cannot start")?;
    rt.tracker.spawn(async move {
        if let Err(e) = orchestrator.run().await {
            tracing::error!(error = %e, "orchestrator stopped");
        }
    });
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
    Ready::open(client, store, config, metrics, shutdown)
        .await?
        .run()
        .await
}

/// An orchestrator ready to take jobs: its streams, consumers, subscriptions and background
/// tasks are in place: a job submitted from [`Ready::open`]'s
/// return on is taken once [`Ready::run`] pulls. Opening is where a
/// start fails (a stream of another layout, a bad sink, JetStream not
/// answering), so a caller waiting for readiness gets that error itself.
pub struct Ready {
    puller: Puller,
    decisions: jetstream::consumer::PullConsumer,
    chat: intake::Intake,
    /// Stops the replies when the run returns (after the invocations in
    /// flight are done), not when shutdown is asked: a draining run may
    /// still be waiting on its tools.
    _stop_replies: tokio_util::sync::DropGuard,
}

impl Ready {
    /// Opens the streams, consumers and subscriptions, builds the
    /// [`Fleet`] and spawns the background tasks (which stop at
    /// `shutdown`).
    pub async fn open(
        client: async_nats::Client,
        store: CitationStore,
        config: OrchestratorConfig,
        metrics: OrchestratorMetrics,
        shutdown: CancellationToken,
    ) -> Result<Self, OrchestratorError> {
        match PayloadLimits::of(&client).startup_message() {
            Some((limits::Severity::Warning, message)) => warn!("{message}"),
            Some((limits::Severity::Notice, message)) => info!("{message}"),
            None => {}
        }
        zero_model_series(&config, &metrics);
        crate::settings::check_max_not_before(config.max_not_before)
            .map_err(OrchestratorError::Config)?;
        let (settings, plugins) = config.into_parts();
        let plugins = Arc::new(plugins);
        let stop_replies = CancellationToken::new();
        let opened = Opened::open(client, store, settings, metrics, stop_replies.clone()).await?;
        let fleet = opened.fleet.clone();
        fleet.catalog.refresh().await;
        // The registry and its gauges from the first reading on.
        fleet.tool_snapshot();

        let tracker = TaskTracker::new();
        spawn_background(&tracker, &fleet, opened.background, &shutdown);
        let known = plugins.names();
        for w in fleet.config.profiles.warnings_among(&known) {
            warn!("{w}");
        }
        info!(stream = %fleet.config.subjects.chat_stream(), profiles = fleet.config.profiles.profiles.len(), orchestrators = ?known, "orchestrator taking chat jobs");
        Ok(Self {
            puller: Puller {
                permits: Arc::new(Semaphore::new(fleet.config.max_in_flight.max(1))),
                fleet,
                plugins,
                tracker,
                shutdown,
            },
            decisions: opened.decisions,
            chat: opened.chat,
            _stop_replies: stop_replies.drop_guard(),
        })
    }

    /// Pulls decisions and chat jobs until shutdown, then lets the
    /// invocations in flight finish.
    pub async fn run(self) -> Result<(), OrchestratorError> {
        let Self {
            puller,
            decisions,
            chat,
            _stop_replies,
        } = self;
        let tracker = puller.tracker.clone();
        // Decisions on parked invocations: the one that decides a turn's
        // last held call resumes the invocation, as a chat job runs (same
        // permits).
        tracker.spawn(puller.clone().pull_decisions(decisions));
        puller.dispatch(chat).await;
        tracker.close();
        tracker.wait().await;
        Ok(())
    }
}

/// Every fallback a profile can make, and every model's answered
/// requests, at zero from the start.
fn zero_model_series(config: &OrchestratorConfig, metrics: &OrchestratorMetrics) {
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
    for name in config.profiles.profiles.keys() {
        metrics.prompt_prefix_changes.with_label_values(&[name]);
    }
}

/// What the start opens: the fleet, its consumers and subscriptions.
struct Opened {
    fleet: Arc<Fleet>,
    chat: intake::Intake,
    decisions: jetstream::consumer::PullConsumer,
    background: Background,
}

/// The subscriptions and consumer the background tasks run on.
struct Background {
    sinks: jetstream::consumer::PullConsumer,
    cancels: async_nats::Subscriber,
    approval_requests: async_nats::Subscriber,
}

impl Opened {
    async fn open(
        client: async_nats::Client,
        store: CitationStore,
        settings: crate::Settings,
        metrics: OrchestratorMetrics,
        stop_replies: CancellationToken,
    ) -> Result<Self, OrchestratorError> {
        let nats = |e: String| OrchestratorError::Nats(e);
        let js = jetstream::new(client.clone());
        let subjects = &settings.subjects;
        let limits = toolfleet_protocol::streams::ChatLimits {
            per_tenant: settings.profiles.largest_queued_cap(),
        };
        let chat = intake::Intake {
            stream: intake::chat_stream(&js, subjects, limits, settings.chat_dispatch).await?,
            // Wake-ups of fair dispatch: which tenant just submitted, in
            // which lane.
            wakeups: futures::stream::select(
                client
                    .subscribe(subjects.chat_submit_all())
                    .await
                    .map_err(|e| nats(e.to_string()))?,
                client
                    .subscribe(subjects.chat_batch_all())
                    .await
                    .map_err(|e| nats(e.to_string()))?,
            )
            .boxed(),
        };
        // Scale from zero: the declared pools' consumers, before any job.
        pools::ensure_consumers(&js, subjects, &settings.declared).await?;
        declared_pools_said(&settings);
        (settings.sinks)
            .check_config(subjects, &settings.profiles.sinks, &*settings.env)
            .map_err(OrchestratorError::Config)?;
        let sinks = sinks::consumer(&js, subjects, &settings.sinks).await?;
        let cancels = client
            .subscribe(subjects.chat_cancel_all())
            .await
            .map_err(|e| nats(e.to_string()))?;
        let reconnects = jobs::Reconnects::watch(client.clone(), stop_replies.clone());
        let replies = Replies::start(&client, subjects, stop_replies)
            .await
            .map_err(|e| nats(e.to_string()))?;
        let agents = AgentSource::new(&settings.profiles).map_err(OrchestratorError::Config)?;
        let parked_bucket = approvals::store::open(&js, subjects).await.map_err(nats)?;
        let settings_bucket = toolfleet_protocol::streams::settings_bucket(&js, subjects)
            .await
            .map_err(|e| nats(e.to_string()))?;
        let threads = crate::threads::store::Buckets::open(&js, subjects, &settings.threads)
            .await
            .map_err(|e| nats(e.to_string()))?;
        let decisions = intake::decisions_consumer(&js, subjects).await?;
        let approval_requests = client
            .queue_subscribe(subjects.chat_approve_all(), subjects.chat_consumer())
            .await
            .map_err(|e| nats(e.to_string()))?;
        let heartbeat = jobs::Heartbeat::start(client.clone(), intake::CHAT_PROGRESS_EVERY);
        let parts = fleet::Parts {
            replies,
            agents,
            parked_bucket,
            settings_bucket,
            threads,
            heartbeat,
            reconnects,
        };
        let fleet = Arc::new(Fleet::new(client, js, store, metrics, settings, parts));
        Ok(Self {
            fleet,
            chat,
            decisions,
            background: Background {
                sinks,
                cancels,
                approval_requests,
            },
        })
    }
}

/// Logs the declared pools and their tools; warns of pools the profiles
/// file declares whose tools this orchestrator was not given (a fleet
/// built without [`DeclaredPools::load`](crate::tools::declared::DeclaredPools::load)):
/// their tools are offered only while a worker serves them.
fn declared_pools_said(settings: &crate::Settings) {
    let by_pool = settings.declared.by_pool();
    for (pool, tools) in &by_pool {
        info!(pool, tools = ?tools, "declared pool: its tools are offered while none of its workers is live");
    }
    for (pool, _) in settings.profiles.declared_pools() {
        if !by_pool.contains_key(pool.as_str()) {
            warn!(pool = %pool, "the profiles file declares this pool, but its tools' definitions were not loaded: they are offered only while one of its workers is live");
        }
    }
}

/// The tasks beside the consumers, until `shutdown`.
fn spawn_background(
    tracker: &TaskTracker,
    fleet: &Arc<Fleet>,
    background: Background,
    shutdown: &CancellationToken,
) {
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
    let every = fleet.config.catalog_refresh;
    tracker.spawn(pools::watch(fleet.clone(), every, shutdown.clone()));
    tracker.spawn(sinks::relay::run(
        fleet.clone(),
        background.sinks,
        shutdown.clone(),
    ));
    tracker.spawn(intake::listen_for_cancels(
        fleet.clone(),
        background.cancels,
        shutdown.clone(),
    ));
    tracker.spawn(approvals::requests::serve(
        fleet.clone(),
        background.approval_requests,
        shutdown.clone(),
    ));
    tracker.spawn(approvals::watch::watch_parked(
        fleet.clone(),
        shutdown.clone(),
    ));
    tracker.spawn(crate::schedules::run(fleet.clone(), shutdown.clone()));
}

/// What a pull loop does with a message whose headers cannot be read.
type OnPoison = Arc<
    dyn Fn(toolfleet_service::poison::Poison) -> futures::future::BoxFuture<'static, ()>
        + Send
        + Sync,
>;

/// The shared parts of the pull loops.
#[derive(Clone)]
struct Puller {
    fleet: Arc<Fleet>,
    plugins: Arc<Plugins>,
    permits: Arc<Semaphore>,
    tracker: TaskTracker,
    shutdown: CancellationToken,
}

impl Puller {
    /// Takes chat jobs from the tenants in turn until shutdown (fair
    /// dispatch), each handled by intake under the shared permits — or in
    /// arrival order from one shared consumer (`--chat-dispatch fifo`).
    async fn dispatch(self, chat: intake::Intake) {
        if self.fleet.config.chat_dispatch == ChatDispatch::Fifo {
            return self.pull_fifo(chat).await;
        }
        let fleet = self.fleet;
        let on_poison: OnPoison = {
            let fleet = fleet.clone();
            Arc::new(move |p| intake::poison(fleet.clone(), p).boxed())
        };
        let sweeper = Sweeper {
            js: jetstream::new(fleet.client.clone()),
            stream: fleet.config.subjects.chat_stream(),
            on_poison,
            progress_every: intake::CHAT_PROGRESS_EVERY,
        };
        intake::Dispatcher {
            fleet,
            plugins: self.plugins,
            permits: self.permits,
            tracker: self.tracker,
            shutdown: self.shutdown,
            sweeper,
        }
        .run(chat)
        .await;
    }

    /// FIFO dispatch: every tenant's chat jobs off one consumer, in
    /// arrival order, each handled by intake under the shared permits.
    async fn pull_fifo(self, chat: intake::Intake) {
        let fleet = self.fleet;
        let subjects = &fleet.config.subjects;
        let consumer = match intake::fifo_consumer(&chat.stream, subjects).await {
            Ok(c) => c,
            Err(e) => {
                tracing::error!(error = %e, "cannot open the FIFO chat consumer; no chat job is taken");
                return;
            }
        };
        let on_poison: OnPoison = {
            let fleet = fleet.clone();
            Arc::new(move |p| intake::poison(fleet.clone(), p).boxed())
        };
        let pull = jobs::PullLoop {
            consumer,
            reconnects: fleet.reconnects.from_now(),
            sweeper: Sweeper {
                js: jetstream::new(fleet.client.clone()),
                stream: subjects.chat_stream(),
                on_poison,
                progress_every: intake::CHAT_PROGRESS_EVERY,
            },
            permits: self.permits,
            tracker: self.tracker,
            shutdown: self.shutdown,
            what: subjects.chat_consumer(),
            progress_every: intake::CHAT_PROGRESS_EVERY,
            hold_permit_while_waiting: true,
        };
        let plugins = self.plugins;
        pull.in_slots(move |msg, mut slot| {
            let (fleet, plugins) = (fleet.clone(), plugins.clone());
            async move {
                // The permit goes with the job, as in fair dispatch: a job
                // waiting for its thread gives it back while it waits.
                let place = slot.take_permit();
                intake::handle_holding(&fleet, &plugins, msg, place).await;
                drop(slot);
            }
        })
        .await;
    }

    /// Pulls decisions on parked invocations off `consumer` until
    /// shutdown, each handled by intake under the shared permits.
    async fn pull_decisions(self, consumer: jetstream::consumer::PullConsumer) {
        let fleet = self.fleet;
        let subjects = &fleet.config.subjects;
        let reconnects = fleet.reconnects.from_now();
        let sweeper = Sweeper {
            js: jetstream::new(fleet.client.clone()),
            stream: subjects.decisions_stream(),
            on_poison: Arc::new(|_| async {}.boxed()),
            progress_every: intake::CHAT_PROGRESS_EVERY,
        };
        let plugins = self.plugins;
        // An idle pull holds no permit (as fair dispatch's): a decision
        // that arrives when none is free waits for one, kept alive.
        let pull = jobs::PullLoop {
            consumer,
            reconnects,
            sweeper,
            permits: self.permits,
            tracker: self.tracker,
            shutdown: self.shutdown,
            what: format!("{} decisions", subjects.chat_consumer()),
            progress_every: intake::CHAT_PROGRESS_EVERY,
            hold_permit_while_waiting: false,
        };
        pull.in_slots(move |msg, slot| {
            let fleet = fleet.clone();
            let plugins = plugins.clone();
            async move {
                intake::handle_decision(&fleet, &plugins, msg).await;
                drop(slot);
            }
        })
        .await;
    }
}
