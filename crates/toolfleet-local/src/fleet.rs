//! Assembling a fleet in one process: an orchestrator and any workers the
//! caller lists (`toolfleet up`, the demo, the bench and the tests). This
//! module knows no tool family; callers build each family's tools.

use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use toolfleet_orchestrator::OrchestratorConfig;
use toolfleet_orchestrator::metrics::OrchestratorMetrics;
use toolfleet_protocol::Subjects;
use toolfleet_store::CitationStore;
use toolfleet_worker::metrics::WorkerMetrics;
use toolfleet_worker::{Worker, WorkerConfig};

/// Everything one process needs to run some or all of the fleet.
pub struct FleetSpec {
    pub nats_url: String,
    pub redis_url: String,
    pub subjects: Subjects,
    pub citation_ttl: Duration,
    /// Run an orchestrator with this configuration (profiles included).
    pub orchestrator: Option<OrchestratorConfig>,
    /// Run these workers.
    pub workers: Vec<Worker>,
    pub worker_concurrency: usize,
    /// How long to keep trying the first NATS connection.
    pub nats_connect_wait: Duration,
    /// The whole NATS settings (identity, TLS, inbox prefix) when a
    /// command's flags gave them (`toolfleet up`): every part connects with
    /// them. `None`: plainly to `nats_url`.
    pub nats: Option<toolfleet_service::args::NatsArgs>,
    /// The whole Redis settings (TLS, cluster) likewise; `None`: plainly to
    /// `redis_url`.
    pub redis: Option<toolfleet_store::RedisOptions>,
}

impl FleetSpec {
    /// A connection for one part, named `name`.
    async fn connect_nats(&self, name: &str) -> anyhow::Result<async_nats::Client> {
        match &self.nats {
            Some(nats) => nats.connect(name).await,
            None => {
                toolfleet_service::args::connect_nats(&self.nats_url, name, self.nats_connect_wait)
                    .await
            }
        }
    }

    async fn connect_store(&self) -> anyhow::Result<CitationStore> {
        let (prefix, ttl) = (self.subjects.prefix(), self.citation_ttl);
        let store = match &self.redis {
            Some(redis) => CitationStore::connect_with(redis, prefix, ttl).await,
            None => CitationStore::connect(&self.redis_url, prefix, ttl).await,
        };
        store.map_err(|e| {
            anyhow::anyhow!(
                "cannot connect to Redis at {}: {e}",
                toolfleet_protocol::redact_url(&self.redis_url)
            )
        })
    }
}

/// Starts the parts of `spec` as tasks on `tracker`; they stop when
/// `shutdown` is cancelled. Returns once every part is subscribed, so jobs
/// published afterwards are taken.
pub async fn start(
    spec: FleetSpec,
    metrics: &prometheus::Registry,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    start_parts(spec, metrics, tracker, shutdown, None).await
}

/// [`start`] as a served process (`toolfleet up`): on `rt`'s registry and
/// tracker, with `/readyz` checking every part's NATS connection, Redis,
/// and every worker's consumers, and the connection gauges.
pub async fn serve(spec: FleetSpec, rt: &toolfleet_service::Runtime) -> anyhow::Result<()> {
    start_parts(
        spec,
        &rt.metrics,
        &rt.tracker,
        rt.shutdown.clone(),
        Some(rt),
    )
    .await
}

async fn start_parts(
    mut spec: FleetSpec,
    metrics: &prometheus::Registry,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
    rt: Option<&toolfleet_service::Runtime>,
) -> anyhow::Result<()> {
    // The connection gauges follow the first connection; every part's
    // connection is a readiness check.
    let mut watched = false;
    let mut watch = |client: &async_nats::Client, store: &CitationStore| -> anyhow::Result<()> {
        let Some(rt) = rt else { return Ok(()) };
        if watched {
            rt.health.nats(client);
        } else {
            let ping =
                toolfleet_service::health::ping(store.clone(), |s| async move { s.ping().await });
            rt.watch_connections(client, Some(ping))?;
            watched = true;
        }
        Ok(())
    };
    let store = spec.connect_store().await?;

    let dead_letters = toolfleet_service::metrics::dead_letters(metrics)?;
    let workers = std::mem::take(&mut spec.workers);
    if !workers.is_empty() {
        let worker_metrics = WorkerMetrics::register(metrics, dead_letters.clone())?;
        for mut worker in workers {
            worker.register_metrics(metrics)?;
            let client = spec
                .connect_nats(&format!("toolfleet-worker-{}", worker.name()))
                .await?;
            watch(&client, &store)?;
            if let Some(rt) = rt {
                rt.health.check(
                    format!("consumers of {}", worker.name()),
                    worker.consumer_check(&client, &spec.subjects),
                );
            }
            let mut config = WorkerConfig::new(spec.subjects.clone());
            config.concurrency = spec.worker_concurrency;
            let task = worker
                .start(
                    client,
                    store.clone(),
                    config,
                    worker_metrics.clone(),
                    shutdown.clone(),
                )
                .await
                .context("a worker cannot start")?;
            tracker.spawn(async move {
                match task.await {
                    Ok(Ok(())) => {}
                    Ok(Err(e)) => tracing::error!(error = %e, "worker stopped"),
                    Err(e) => tracing::error!(error = %e, "worker task failed"),
                }
            });
        }
    }

    if let Some(config) = spec.orchestrator.take() {
        let client = spec.connect_nats("toolfleet-orchestrator").await?;
        watch(&client, &store)?;
        let m = OrchestratorMetrics::register(metrics, dead_letters)?;
        let orchestrator = toolfleet_orchestrator::Ready::open(client, store, config, m, shutdown)
            .await
            .context("the orchestrator cannot start")?;
        tracker.spawn(async move {
            if let Err(e) = orchestrator.run().await {
                tracing::error!(error = %e, "orchestrator stopped");
            }
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use prometheus::Registry;
    use toolfleet_service::metrics::{dead_letters, render};

    #[test]
    fn orchestrator_and_worker_metrics_share_a_registry() {
        let r = Registry::new();
        let dead = dead_letters(&r).unwrap();
        let o = OrchestratorMetrics::register(&r, dead.clone()).unwrap();
        let w = WorkerMetrics::register(&r, dead).unwrap();
        o.chat_jobs.with_label_values(&["completed"]).inc();
        w.tool_jobs
            .with_label_values(&["system:current_datetime@1.0.0", "ok"])
            .inc();
        let text = render(&r);
        assert!(
            text.contains("toolfleet_chat_jobs_total{outcome=\"completed\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "toolfleet_tool_jobs_total{outcome=\"ok\",tool=\"system:current_datetime@1.0.0\"} 1"
            ),
            "{text}"
        );
        // Registering twice on one registry is an error, not a silent double.
        assert!(dead_letters(&r).is_err());
        o.dead_letters.with_label_values(&["chat", ""]).inc();
        w.dead_letters
            .with_label_values(&["tool", "system:current_datetime@1.0.0"])
            .inc();
        let text = render(&r);
        assert!(
            text.contains("toolfleet_dead_letters_total{kind=\"chat\",tool=\"\"} 1"),
            "{text}"
        );
        assert!(
            text.contains(
                "toolfleet_dead_letters_total{kind=\"tool\",tool=\"system:current_datetime@1.0.0\"} 1"
            ),
            "{text}"
        );
    }
}
