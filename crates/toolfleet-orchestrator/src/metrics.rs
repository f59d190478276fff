//! Metrics of the orchestrator.

use prometheus::{
    CounterVec, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry,
};
use toolfleet_service::metrics::{LATENCY_BUCKETS, counter, histogram};

/// Every `outcome` of `toolfleet_chat_jobs_total`.
/// `parked`: a run that ended waiting for a person's approval (its
/// invocation goes on later, as another run).
pub const CHAT_OUTCOMES: [&str; 6] = [
    "completed",
    "error",
    "malformed",
    "duplicate",
    "superseded",
    "parked",
];

/// Every `code` of `toolfleet_approval_requests_refused_total`.
pub const APPROVAL_REFUSALS: [&str; 5] = [
    "malformed_approval",
    "unknown_invocation",
    "unknown_call",
    "already_decided",
    "unavailable",
];

/// Every `status` of `toolfleet_tool_calls_total` a worker's answer (or the
/// orchestrator's own) gives.
pub const TOOL_CALL_STATUSES: [&str; 4] = ["ok", "error", "blocked", "timeout"];

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
    /// Streamed model calls: request sent to first output, by `model`.
    pub llm_time_to_first_token: HistogramVec,
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
    /// Model calls moved to a profile's next deployment, by `from` and `to`
    /// (deployment names of the configuration: bounded).
    pub llm_fallbacks: IntCounterVec,
    /// Scoping decisions, by `decision`: all | token | planning |
    /// planning_fallback.
    pub scoping_decisions: IntCounterVec,
    /// Tools offered per model request.
    pub tools_offered: Histogram,
    /// `search_tools` calls, by `outcome`: added | nothing | capped.
    pub tool_expansions: IntCounterVec,
    /// Tools in the registry, by `backend` (catalog, agents, …).
    pub registry_tools: prometheus::IntGaugeVec,
    /// Duplicate ids a later backend brought (the first backend's wins).
    pub registry_duplicates: prometheus::IntGauge,
    /// Time to rebuild the registry and relevance index after a catalog
    /// change.
    pub registry_build: Histogram,
    /// Tool calls naming no offered tool (answered with suggestions).
    pub unknown_tool_calls: prometheus::IntCounter,
    /// Sink deliveries (webhooks, relays).
    pub sinks: crate::sinks::SinkMetrics,
    /// `toolfleet_dead_letters_total`, shared with the workers of the
    /// process; the orchestrator counts `kind="chat"`.
    pub dead_letters: IntCounterVec,
    /// Jobs waiting for a worker, by `tool` (its consumer's `num_pending`).
    pub tool_backlog: prometheus::IntGaugeVec,
    /// Jobs a worker took and has not answered, by `tool`
    /// (`num_ack_pending`).
    pub tool_jobs_pending_ack: prometheus::IntGaugeVec,
    /// Live worker processes serving each `tool` (from the catalog).
    pub tool_live_workers: prometheus::IntGaugeVec,
    /// Parked calls decided, by `outcome`: approved | denied | timeout.
    pub approvals: IntCounterVec,
    /// From `approval_requested` to the decision, by `outcome`.
    pub approval_wait: HistogramVec,
    /// Approval requests answered with an error, by `code`.
    pub approvals_refused: IntCounterVec,
    /// Invocations parked fleet-wide, as this orchestrator last saw the
    /// parked bucket (every orchestrator reports the same count).
    pub approvals_parked: IntGauge,
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
        let tools_offered = Histogram::with_opts(
            HistogramOpts::new(
                "toolfleet_tools_offered",
                "Tools offered to the model per request (search_tools included).",
            )
            .buckets(vec![
                0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 50.0, 100.0, 128.0,
            ]),
        )?;
        r.register(Box::new(tools_offered.clone()))?;
        let registry_tools = prometheus::IntGaugeVec::new(
            Opts::new(
                "toolfleet_registry_tools",
                "Tools in the orchestrator's registry, by backend.",
            ),
            &["backend"],
        )?;
        r.register(Box::new(registry_tools.clone()))?;
        let pool_gauge = |name: &str, help: &str| -> prometheus::Result<prometheus::IntGaugeVec> {
            let g = prometheus::IntGaugeVec::new(Opts::new(name, help), &["tool"])?;
            r.register(Box::new(g.clone()))?;
            Ok(g)
        };
        let tool_backlog = pool_gauge(
            "toolfleet_tool_backlog",
            "Tool jobs waiting for a worker (the tool consumer's num_pending): scale the pool on it.",
        )?;
        let tool_jobs_pending_ack = pool_gauge(
            "toolfleet_tool_jobs_pending_ack",
            "Tool jobs a worker took and has not answered yet (num_ack_pending).",
        )?;
        let tool_live_workers = pool_gauge(
            "toolfleet_tool_live_workers",
            "Live worker processes serving the tool, from the catalog.",
        )?;
        let registry_duplicates = prometheus::IntGauge::new(
            "toolfleet_registry_duplicate_tools",
            "Tool ids a later backend also brought (the first backend's definition is used).",
        )?;
        r.register(Box::new(registry_duplicates.clone()))?;
        let registry_build = Histogram::with_opts(
            HistogramOpts::new(
                "toolfleet_registry_build_seconds",
                "Time to rebuild the registry and relevance index after a catalog change.",
            )
            .buckets(LATENCY_BUCKETS.to_vec()),
        )?;
        r.register(Box::new(registry_build.clone()))?;
        let unknown_tool_calls = prometheus::IntCounter::new(
            "toolfleet_unknown_tool_calls_total",
            "Tool calls naming no offered tool; answered with close names.",
        )?;
        r.register(Box::new(unknown_tool_calls.clone()))?;
        let scoping_decisions = counter(
            r,
            "toolfleet_scoping_decisions_total",
            "How the tools offered were chosen, by decision.",
            &["decision"],
        )?;
        for d in ["all", "token", "planning", "planning_fallback"] {
            scoping_decisions.with_label_values(&[d]);
        }
        let tool_expansions = counter(
            r,
            "toolfleet_tool_expansions_total",
            "search_tools calls, by outcome.",
            &["outcome"],
        )?;
        for o in ["added", "nothing", "capped"] {
            tool_expansions.with_label_values(&[o]);
        }
        let llm_fallbacks = counter(
            r,
            "toolfleet_llm_fallbacks_total",
            "Model calls moved to the profile's next deployment after a failure before any output.",
            &["from", "to"],
        )?;
        // The first dead letter must be an increase.
        dead_letters.with_label_values(&["chat", ""]);
        dead_letters.with_label_values(&["sink", ""]);
        let chat_jobs = counter(
            r,
            "toolfleet_chat_jobs_total",
            "Chat jobs by outcome.",
            &["outcome"],
        )?;
        // So must the first job of every outcome.
        for o in CHAT_OUTCOMES {
            chat_jobs.with_label_values(&[o]);
        }
        let approvals = counter(
            r,
            "toolfleet_approvals_total",
            "Tool calls that waited for a person's approval, by outcome.",
            &["outcome"],
        )?;
        let approval_wait = HistogramVec::new(
            HistogramOpts::new(
                "toolfleet_approval_wait_seconds",
                "Time from approval_requested to the decision, by outcome.",
            )
            .buckets(vec![
                1.0,
                5.0,
                15.0,
                60.0,
                300.0,
                900.0,
                3600.0,
                4.0 * 3600.0,
                86_400.0,
                604_800.0,
            ]),
            &["outcome"],
        )?;
        r.register(Box::new(approval_wait.clone()))?;
        for o in toolfleet_protocol::ApprovalOutcome::ALL {
            approvals.with_label_values(&[o.as_str()]);
            approval_wait.with_label_values(&[o.as_str()]);
        }
        let approvals_refused = counter(
            r,
            "toolfleet_approval_requests_refused_total",
            "Approval requests answered with an error, by code.",
            &["code"],
        )?;
        for c in APPROVAL_REFUSALS {
            approvals_refused.with_label_values(&[c]);
        }
        let approvals_parked = IntGauge::new(
            "toolfleet_approvals_parked",
            "Invocations parked waiting for approvals, fleet-wide (every orchestrator reports the same count).",
        )?;
        r.register(Box::new(approvals_parked.clone()))?;
        Ok(Self {
            approvals,
            approval_wait,
            approvals_refused,
            approvals_parked,
            tool_backlog,
            tool_jobs_pending_ack,
            tool_live_workers,
            llm_fallbacks,
            scoping_decisions,
            tools_offered,
            tool_expansions,
            registry_tools,
            registry_duplicates,
            registry_build,
            unknown_tool_calls,
            chat_jobs,
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
            llm_time_to_first_token: histogram(
                r,
                "toolfleet_llm_time_to_first_token_seconds",
                "Streamed model calls: from sending the request to the first text, refusal or tool call.",
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
            sinks: crate::sinks::SinkMetrics::register(r)?,
            dead_letters,
        })
    }
}

impl OrchestratorMetrics {
    /// Sets the registry gauges after a rebuild that took `took`.
    pub fn observe_registry(
        &self,
        registry: &toolfleet_protocol::registry::Registry,
        took: std::time::Duration,
    ) {
        self.registry_tools.reset();
        for (backend, n) in registry.sizes() {
            self.registry_tools
                .with_label_values(&[backend.as_str()])
                .set(i64::try_from(n).unwrap_or(i64::MAX));
        }
        self.registry_duplicates
            .set(i64::try_from(registry.duplicates().len()).unwrap_or(i64::MAX));
        self.registry_build.observe(took.as_secs_f64());
    }
}
