//! Prometheus metrics, one struct per subsystem, registered on a registry
//! that is passed in (never a global), and the `/metrics` + `/healthz` HTTP
//! endpoint every binary serves.
//!
//! Labels have bounded cardinality: tool ids, models, outcomes, kinds —
//! never an invocation id, a user or anything secret.

use std::net::SocketAddr;

use prometheus::{
    CounterVec, Encoder, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder,
};
use tokio_util::sync::CancellationToken;

const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

fn counter(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

fn histogram(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<HistogramVec> {
    let h = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()),
        labels,
    )?;
    r.register(Box::new(h.clone()))?;
    Ok(h)
}

/// Metrics of the orchestrator.
#[derive(Clone)]
pub struct OrchestratorMetrics {
    /// `outcome`: completed | error | malformed.
    pub chat_jobs: IntCounterVec,
    pub chat_job_duration: Histogram,
    pub chat_jobs_in_flight: IntGauge,
    /// `model`, `outcome`: ok | error code.
    pub llm_requests: IntCounterVec,
    pub llm_request_duration: HistogramVec,
    /// `model`, `kind`: prompt | completion | cached | reasoning, `purpose`:
    /// conversation | planning | tool.
    pub llm_tokens: IntCounterVec,
    /// USD from the price table, by `model` and `purpose`.
    pub llm_cost: CounterVec,
    /// HTTP attempts beyond the first, by `model`.
    pub llm_retries: IntCounterVec,
    /// Loop caps hit, by `limit`: rounds | calls_per_turn |
    /// consecutive_tool_errors | truncated_tool_call.
    pub loop_limits: IntCounterVec,
    /// Tool results cut to the token cap, by function name.
    pub tool_results_truncated: IntCounterVec,
    /// `tool`, `status`: ok | error | blocked | timeout.
    pub tool_calls: IntCounterVec,
    pub tool_call_duration: HistogramVec,
    /// `toolfleet_dead_letters_total`, shared with the workers of the
    /// process; the orchestrator counts `kind="chat"`.
    pub dead_letters: IntCounterVec,
}

/// `toolfleet_dead_letters_total{kind}`: registered once per registry and
/// shared by the orchestrator (`chat`) and the workers (`tool`) of a process.
pub fn dead_letters(r: &Registry) -> prometheus::Result<IntCounterVec> {
    counter(
        r,
        "toolfleet_dead_letters_total",
        "Jobs terminated and published as dead letters, by kind (tool, chat).",
        &["kind"],
    )
}

impl OrchestratorMetrics {
    pub fn register(r: &Registry, dead_letters: IntCounterVec) -> prometheus::Result<Self> {
        let chat_job_duration = Histogram::with_opts(
            HistogramOpts::new(
                "toolfleet_chat_job_duration_seconds",
                "Time from taking a chat job to its terminal event.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
        )?;
        r.register(Box::new(chat_job_duration.clone()))?;
        let chat_jobs_in_flight = IntGauge::new(
            "toolfleet_chat_jobs_in_flight",
            "Chat jobs being worked on by this orchestrator.",
        )?;
        r.register(Box::new(chat_jobs_in_flight.clone()))?;
        Ok(Self {
            chat_jobs: counter(
                r,
                "toolfleet_chat_jobs_total",
                "Chat jobs by outcome.",
                &["outcome"],
            )?,
            chat_job_duration,
            chat_jobs_in_flight,
            llm_requests: counter(
                r,
                "toolfleet_llm_requests_total",
                "Model requests by model and outcome.",
                &["model", "outcome"],
            )?,
            llm_request_duration: histogram(
                r,
                "toolfleet_llm_request_duration_seconds",
                "Model request duration, first byte to last.",
                &["model"],
            )?,
            llm_tokens: counter(
                r,
                "toolfleet_llm_tokens_total",
                "Tokens reported by the model, by kind and purpose.",
                &["model", "kind", "purpose"],
            )?,
            llm_cost: {
                let c = CounterVec::new(
                    Opts::new(
                        "toolfleet_llm_cost_usd_total",
                        "Model cost in USD from the configured price table.",
                    ),
                    &["model", "purpose"],
                )?;
                r.register(Box::new(c.clone()))?;
                c
            },
            llm_retries: counter(
                r,
                "toolfleet_llm_retries_total",
                "Model HTTP attempts beyond the first (429, 5xx, connect, timeout).",
                &["model"],
            )?,
            loop_limits: counter(
                r,
                "toolfleet_loop_limits_total",
                "Loop caps hit; the model is then told to answer with what it has.",
                &["limit"],
            )?,
            tool_results_truncated: counter(
                r,
                "toolfleet_tool_results_truncated_total",
                "Tool results cut to the per-profile token cap.",
                &["function"],
            )?,
            tool_calls: counter(
                r,
                "toolfleet_tool_calls_total",
                "Tool calls dispatched by the orchestrator, by final status.",
                &["tool", "status"],
            )?,
            tool_call_duration: histogram(
                r,
                "toolfleet_tool_call_duration_seconds",
                "Tool call round trip as the orchestrator sees it.",
                &["tool"],
            )?,
            dead_letters,
        })
    }
}

/// Metrics of the worker runtime, shared by every tool of a process.
#[derive(Clone)]
pub struct WorkerMetrics {
    /// `tool`, `outcome`: ok | error | blocked | timeout | invalid_arguments | redelivered.
    pub tool_jobs: IntCounterVec,
    pub tool_job_duration: HistogramVec,
    pub tool_jobs_in_flight: IntGaugeVec,
    pub tool_job_retries: IntCounterVec,
    /// `kind`: tool.
    pub dead_letters: IntCounterVec,
    pub citations_written: IntCounterVec,
}

impl WorkerMetrics {
    pub fn register(r: &Registry, dead_letters: IntCounterVec) -> prometheus::Result<Self> {
        let in_flight = IntGaugeVec::new(
            Opts::new("toolfleet_tool_jobs_in_flight", "Tool jobs being executed."),
            &["tool"],
        )?;
        r.register(Box::new(in_flight.clone()))?;
        Ok(Self {
            tool_jobs: counter(
                r,
                "toolfleet_tool_jobs_total",
                "Tool jobs by outcome.",
                &["tool", "outcome"],
            )?,
            tool_job_duration: histogram(
                r,
                "toolfleet_tool_job_duration_seconds",
                "Tool job execution time in the worker.",
                &["tool"],
            )?,
            tool_jobs_in_flight: in_flight,
            tool_job_retries: counter(
                r,
                "toolfleet_tool_job_retries_total",
                "Failed attempts handed back for a retry.",
                &["tool"],
            )?,
            dead_letters,
            citations_written: counter(
                r,
                "toolfleet_citations_written_total",
                "References written to the citation store.",
                &["tool"],
            )?,
        })
    }
}

/// Renders the registry in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut buf = Vec::new();
    // Encoding into a Vec only fails on invalid metric families, which
    // registration already rejects.
    let _ = TextEncoder::new().encode(&registry.gather(), &mut buf);
    String::from_utf8(buf).unwrap_or_default()
}

/// Serves `GET /metrics` and `GET /healthz` on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Registry,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    use axum::{Router, routing::get};
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    (
                        [("content-type", "text/plain; version=0.0.4")],
                        render(&registry),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }));
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

/// Binds `addr` and serves metrics in a background task; returns the bound
/// address (useful with port 0).
pub async fn spawn(
    addr: SocketAddr,
    registry: Registry,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = serve(listener, registry, shutdown).await {
            tracing::error!(error = %e, "metrics endpoint stopped");
        }
    });
    Ok(local)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        o.dead_letters.with_label_values(&["chat"]).inc();
        w.dead_letters.with_label_values(&["tool"]).inc();
        let text = render(&r);
        assert!(
            text.contains("toolfleet_dead_letters_total{kind=\"chat\"} 1"),
            "{text}"
        );
        assert!(
            text.contains("toolfleet_dead_letters_total{kind=\"tool\"} 1"),
            "{text}"
        );
    }
}
