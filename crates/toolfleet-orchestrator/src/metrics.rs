//! Metrics of the orchestrator.

use prometheus::{
    CounterVec, Histogram, HistogramOpts, HistogramVec, IntCounterVec, IntGauge, Opts, Registry,
};
use toolfleet_service::metrics::{LATENCY_BUCKETS, counter, histogram};

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
