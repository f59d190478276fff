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
//!
//! # Layout
//!
//! This module starts and stops the serving; its parts, each importing
//! only those listed after it:
//!
//! - `setup`: the stream, consumers, endpoints, cancel subscription and
//!   catalog entries, set up before anything is served and kept up after.
//! - `direct` and `jetstream`: a job's delivery and its end on each path
//!   (ack, `nak` for a retry, or terminate and dead-letter).
//! - `job`: one delivery, however it came: headers, span, log line.
//! - `call`: running an admitted call (budget, hooks, timeout, cancels).
//! - `admit`: the checks before a call runs.
//! - `dead_letters`, `reply`: dead letters; answering a call.
//! - `outcome`: what a delivery decides.
//! - `shared`: what every job shares, and each tool's metrics.
//! - `sink`, `ledger`, `cancels`, `results`, `config`: the pieces below
//!   (citations and progress, the ledger writer, cancels heard, the
//!   results the runtime makes, [`WorkerConfig`]).

mod admit;
mod call;
mod cancels;
mod config;
mod dead_letters;
mod direct;
mod jetstream;
mod job;
mod ledger;
mod outcome;
mod reply;
mod results;
mod setup;
mod shared;
mod sink;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use async_nats::jetstream as js;
use async_nats::service::endpoint::Endpoint;
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_service::jobs::{PullLoop, Reconnects, Sweeper};
use toolfleet_store::CitationStore;
use tracing::info;

pub use self::config::{CANCEL_HEARING_MARGIN, MIN_ACK_WAIT, WorkerConfig};
use self::direct::direct_loop;
use self::jetstream::handle_jetstream;
use self::setup::{ToolConsumer, endpoint_name, keep_advertised, set_up};
use self::shared::Shared;
use crate::builder::{Served, Worker, WorkerError};
use crate::metrics::WorkerMetrics;
use crate::service_stats::JobStats;

/// Told once a worker serves, or why it cannot.
type Ready = tokio::sync::oneshot::Sender<Result<(), WorkerError>>;

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
        let js = js::new(client.clone());
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
        ready: Option<Ready>,
    ) -> Result<(), WorkerError> {
        // Everything is set up before anything is served: a worker that
        // cannot serve one of its tools serves none, and says why.
        let job_stats = Arc::new(JobStats::new(
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
        let shared = Arc::new(Shared::new(
            &self, client, store, config, metrics, &job_stats,
        ));
        // The cancel subscription exists (set-up's requests went out after
        // it on the same connection): every cancel from now on is heard.
        let connects = shared.nats_stats.connects.load(Ordering::Relaxed);
        shared.running.start_hearing(connects);
        // Jobs wait in the consumers until the loops below take them; a
        // caller that stopped waiting for us gets no worker running behind
        // its back.
        if let Some(ready) = ready
            && ready.send(Ok(())).is_err()
        {
            let _ = setup.service.stop().await;
            return Ok(());
        }
        let loops = Loops::new(&shared, setup.tools.len(), &shutdown);
        for (tool, consumer, endpoint) in setup.tools {
            info!(tool = %tool.label(), worker = %self.name, "serving tool");
            loops.serve(tool, consumer, endpoint);
        }
        loops.tracker.spawn({
            let shared = shared.clone();
            let (cancels, shutdown) = (setup.cancels, shutdown.clone());
            async move {
                let subjects = &shared.config.subjects;
                shared.running.listen(subjects, cancels, shutdown).await;
            }
        });
        loops.tracker.spawn(keep_advertised(
            setup.catalog,
            js::new(shared.client.clone()),
            shared.config.subjects.clone(),
            self.tools.iter().map(|t| t.definition().clone()).collect(),
            shutdown.clone(),
        ));
        shutdown.cancelled().await;
        // Not live any more: new calls go to other copies (or are answered
        // no_worker) while the jobs in flight finish.
        let _ = setup.service.stop().await;
        loops.tracker.close();
        loops.tracker.wait().await;
        Ok(())
    }
}

/// What every tool's loops share while a worker serves: the jobs, the
/// permits (jobs at once, across tools), the NATS connection's watch and
/// the tasks to wait for at shutdown.
struct Loops {
    shared: Arc<Shared>,
    permits: Arc<Semaphore>,
    /// More tools than permits: idle pulls must not hold them.
    hold_permit_while_waiting: bool,
    reconnects: Reconnects,
    tracker: TaskTracker,
    shutdown: CancellationToken,
}

impl Loops {
    fn new(shared: &Arc<Shared>, tools: usize, shutdown: &CancellationToken) -> Self {
        let concurrency = shared.config.concurrency.max(1);
        Self {
            shared: shared.clone(),
            permits: Arc::new(Semaphore::new(concurrency)),
            hold_permit_while_waiting: tools <= concurrency,
            reconnects: Reconnects::watch(shared.client.clone(), shutdown.clone()),
            tracker: TaskTracker::new(),
            shutdown: shutdown.clone(),
        }
    }

    /// Serves `tool`: a pull loop on its consumer and a loop on its
    /// endpoint.
    fn serve(&self, tool: Arc<Served>, consumer: ToolConsumer, endpoint: Endpoint) {
        self.pull(tool.clone(), consumer);
        self.tracker.spawn(direct_loop(
            endpoint,
            tool,
            self.shared.clone(),
            self.permits.clone(),
            self.tracker.clone(),
            self.shutdown.clone(),
        ));
    }

    /// The loop that pulls `tool`'s jobs from `consumer`. It keeps every
    /// job alive from its pull until its handler is done, with one ticker
    /// for all of them; jobs whose headers cannot be read are taken aside,
    /// answered and dead-lettered.
    fn pull(&self, tool: Arc<Served>, consumer: ToolConsumer) {
        let config = &self.shared.config;
        let progress_every = config.ack_wait_for(tool.definition()) / 3;
        let sweeper = {
            let (tool, shared) = (tool.clone(), self.shared.clone());
            Sweeper {
                js: js::new(shared.client.clone()),
                stream: config.subjects.tools_stream(),
                on_poison: Arc::new(move |p| {
                    dead_letters::poison(tool.clone(), shared.clone(), p).boxed()
                }),
                progress_every,
            }
        };
        let pull = PullLoop {
            consumer,
            reconnects: self.reconnects.clone(),
            sweeper,
            permits: self.permits.clone(),
            tracker: self.tracker.clone(),
            shutdown: self.shutdown.clone(),
            what: tool.definition().id.to_string(),
            progress_every,
            hold_permit_while_waiting: self.hold_permit_while_waiting,
        };
        let shared = self.shared.clone();
        self.tracker.spawn(pull.in_slots(move |msg, slot| {
            let (tool, shared) = (tool.clone(), shared.clone());
            async move { handle_jetstream(msg, slot, &tool, &shared).await }
        }));
    }
}
