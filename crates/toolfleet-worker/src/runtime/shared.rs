//! [`Shared`]: what every job of a running worker shares — the NATS
//! client, the store, the config, the hooks, the calls running here, the
//! ledger writer — and each tool's metrics, looked up once.

use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::SystemTime;

use toolfleet_store::CitationStore;

use super::cancels::{REMEMBER_CANCEL, Running};
use super::config::WorkerConfig;
use super::ledger::{LedgerWriter, Recording};
use super::setup::endpoint_name;
use super::sink::LiveSink;
use crate::builder::{Served, Worker};
use crate::ctx::Sink;
use crate::hooks::HookSet;
use crate::metrics::WorkerMetrics;
use crate::service_stats::{EndpointJobs, JobStats};

/// What every job of a worker shares.
pub(super) struct Shared {
    pub(super) client: async_nats::Client,
    pub(super) store: CitationStore,
    pub(super) metrics: WorkerMetrics,
    pub(super) config: WorkerConfig,
    pub(super) hooks: Arc<HookSet>,
    pub(super) sink: Arc<dyn Sink>,
    /// The cancellation of each call running here, by invocation, so a
    /// cancel of the invocation stops its tools.
    pub(super) running: Running,
    /// Results on their way to the ledger.
    pub(super) recording: Recording,
    /// The NATS client's counters (its connects tell a reconnect).
    pub(super) nats_stats: Arc<async_nats::Statistics>,
    /// Ledger writes, batched.
    pub(super) ledger: LedgerWriter,
    /// Each tool's metrics, looked up once (by label).
    stats: HashMap<String, ToolStats>,
}

/// One tool's per-call metrics, looked up once instead of by label on
/// every call.
#[derive(Clone)]
pub(super) struct ToolStats {
    pub(super) in_flight: prometheus::IntGauge,
    pub(super) duration: prometheus::Histogram,
    /// `toolfleet_tool_jobs_total{outcome="ok"}`: most jobs end there.
    pub(super) ok: prometheus::IntCounter,
    /// Outputs that missed the definition's `outputSchema`.
    pub(super) output_mismatches: prometheus::IntCounter,
    /// Its endpoint's counts for `$SRV.STATS`.
    pub(super) jobs: Arc<EndpointJobs>,
}

/// The outcomes of `toolfleet_tool_jobs_total` besides `ok`, each
/// zero-initialised per tool.
const OUTCOMES: [&str; 6] = [
    "error",
    "blocked",
    "timeout",
    "cancelled",
    "invalid_arguments",
    "redelivered",
];

impl ToolStats {
    /// The metrics of the tool labelled `label`, every series of it made
    /// now: the first dead letter, and the first job of every outcome,
    /// must be an increase.
    pub(super) fn zeroed(metrics: &WorkerMetrics, label: &str, jobs: Arc<EndpointJobs>) -> Self {
        metrics.dead_letters.with_label_values(&["tool", label]);
        for outcome in OUTCOMES {
            metrics.tool_jobs.with_label_values(&[label, outcome]);
        }
        Self::looked_up(metrics, label, jobs)
    }

    /// The metrics of the tool labelled `label`.
    fn looked_up(metrics: &WorkerMetrics, label: &str, jobs: Arc<EndpointJobs>) -> Self {
        Self {
            in_flight: metrics.tool_jobs_in_flight.with_label_values(&[label]),
            duration: metrics.tool_job_duration.with_label_values(&[label]),
            ok: metrics.tool_jobs.with_label_values(&[label, "ok"]),
            output_mismatches: metrics
                .tool_output_schema_mismatches
                .with_label_values(&[label]),
            jobs,
        }
    }
}

impl Shared {
    /// What `worker`'s jobs share, each of its tools' metrics made.
    pub(super) fn new(
        worker: &Worker,
        client: async_nats::Client,
        store: CitationStore,
        config: WorkerConfig,
        metrics: WorkerMetrics,
        job_stats: &JobStats,
    ) -> Self {
        let stats = worker
            .tools
            .iter()
            .map(|t| {
                let jobs = job_stats.endpoint(&endpoint_name(&t.definition().id));
                let stats = ToolStats::zeroed(&metrics, t.label(), jobs);
                (t.label().to_string(), stats)
            })
            .collect();
        Self {
            nats_stats: client.statistics(),
            ledger: LedgerWriter::start(store.clone()),
            sink: Arc::new(LiveSink {
                client: client.clone(),
                store: store.clone(),
                metrics: metrics.clone(),
            }),
            client,
            store,
            metrics,
            config,
            hooks: worker.hooks.clone(),
            running: Running::default(),
            recording: Recording::default(),
            stats,
        }
    }

    /// Whether this worker has heard every cancel that could concern a job
    /// JetStream stored at `published`: it has been listening, without a
    /// reconnect, since at least [`WorkerConfig::cancel_hearing_margin`]
    /// before, and still remembers what it heard then.
    pub(super) fn heard_all_cancels(&self, published: SystemTime) -> bool {
        let connects = self.nats_stats.connects.load(Ordering::Relaxed);
        let connected = self.client.connection_state() == async_nats::connection::State::Connected;
        let Some(since) = self.running.hearing_since(connects, connected) else {
            return false;
        };
        let margin = self.config.cancel_hearing_margin;
        // A publication time ahead of this host's clock: the clocks
        // disagree, and the margin cannot be trusted.
        let Ok(age) = SystemTime::now().duration_since(published) else {
            return false;
        };
        published >= since + margin && age + margin < REMEMBER_CANCEL
    }

    /// Counts one job of `tool` that ended in `outcome`.
    pub(super) fn count(&self, tool: &str, outcome: &str) {
        self.metrics
            .tool_jobs
            .with_label_values(&[tool, outcome])
            .inc();
    }

    /// `tool`'s metrics (every served tool has them from the start).
    pub(super) fn stats(&self, tool: &Served) -> Cow<'_, ToolStats> {
        match self.stats.get(tool.label()) {
            Some(stats) => Cow::Borrowed(stats),
            None => Cow::Owned(ToolStats::looked_up(
                &self.metrics,
                tool.label(),
                Arc::default(),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use prometheus::Registry;

    use super::*;

    #[test]
    fn every_series_of_a_tool_starts_at_zero() {
        let registry = Registry::new();
        let metrics = WorkerMetrics::register_all(&registry).unwrap();
        ToolStats::zeroed(&metrics, "test:answers@1.0.0", Arc::default());
        let series = |name: &str| -> Vec<(String, f64)> {
            let family = registry.gather().into_iter().find(|f| f.name() == name);
            family
                .map(|f| {
                    f.get_metric()
                        .iter()
                        .map(|m| {
                            let labels: Vec<String> = m
                                .get_label()
                                .iter()
                                .map(|l| format!("{}={}", l.name(), l.value()))
                                .collect();
                            (labels.join(","), m.get_counter().get_value())
                        })
                        .collect()
                })
                .unwrap_or_default()
        };
        assert_eq!(
            series("toolfleet_tool_output_schema_mismatches_total"),
            [("tool=test:answers@1.0.0".to_string(), 0.0)]
        );
        assert_eq!(
            series("toolfleet_dead_letters_total"),
            [("kind=tool,tool=test:answers@1.0.0".to_string(), 0.0)]
        );
        assert_eq!(series("toolfleet_tool_jobs_total").len(), 7);
    }
}
