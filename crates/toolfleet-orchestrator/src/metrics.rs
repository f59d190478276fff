//! Metrics of the orchestrator.

use prometheus::{
    CounterVec, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry,
};
use toolfleet_service::metrics::{LATENCY_BUCKETS, counter, histogram, registered};

/// Every `outcome` of `toolfleet_chat_jobs_total`.
/// `parked`: a run that ended waiting for a person's approval (its
/// invocation goes on later, as another run). `suspended`: refused because
/// its tenant is suspended for poison.
pub const CHAT_OUTCOMES: [&str; 7] = [
    "completed",
    "error",
    "malformed",
    "duplicate",
    "superseded",
    "parked",
    "suspended",
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
    /// The tool-result cache, by `tool` and `outcome` (every outcome is in
    /// [`TOOL_CACHE_OUTCOMES`]).
    pub tool_cache: IntCounterVec,
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
    pub registry_tools: IntGaugeVec,
    /// Duplicate ids a later backend brought (the first backend's wins).
    pub registry_duplicates: IntGauge,
    /// Time to rebuild the registry and relevance index after a catalog
    /// change.
    pub registry_build: Histogram,
    /// Tool calls naming no offered tool (answered with suggestions).
    pub unknown_tool_calls: IntCounter,
    /// Tool results read back from the ledger (their replies were lost to
    /// a reconnect, or the call was adopted from an earlier run).
    pub results_read_back: IntCounter,
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
    /// `tenant` (the submit subject's): chat jobs that could not be read.
    pub chat_poison: IntCounterVec,
    /// `tenant`: suspensions for poison this orchestrator started.
    pub tenant_suspensions: IntCounterVec,
    /// `tenant`: chat jobs refused because their tenant was suspended.
    pub chat_suspended: IntCounterVec,
    /// Jobs and parks refused at a tenant's cap, by `tenant` (an operator
    /// identity: bounded) and `cap`: queued_jobs | job_bytes | parked.
    pub caps_refused: IntCounterVec,
    /// A tenant's invocations in the parked bucket, by `tenant`, as this
    /// orchestrator last saw the bucket.
    pub tenant_parked: IntGaugeVec,
    /// The tenants' rate limits, budgets and per-run caps.
    pub quota: crate::quota::QuotaMetrics,
    /// Scheduled chat jobs' due times, by outcome.
    pub schedules: crate::schedules::ScheduleMetrics,
    /// Jobs of threads by strategy and outcome, and idempotent replays.
    pub threads: crate::threads::metrics::ThreadMetrics,
    /// Cancels heard, by `tenant` and `outcome` (every outcome is in
    /// `CANCEL_OUTCOMES`, with the cancel listener).
    pub cancels: IntCounterVec,
    /// Chat jobs stored per `tenant` (waiting, or delivered and not yet
    /// acked), as fair dispatch last read the chat stream; every
    /// orchestrator reports the same counts.
    pub chat_queued: IntGaugeVec,
    /// Times a tenant's chat job (`cap="jobs"`) or tool call
    /// (`cap="tool_calls"`) waited because the tenant had its cap of them
    /// in flight fleet-wide, by `tenant` and `cap`.
    pub in_flight_waits: IntCounterVec,
    /// How long model calls waited for their deployment's fleet-wide
    /// limits, by `deployment` (only deployments that have some).
    pub provider_queued: HistogramVec,
    /// Batch jobs taken from the interactive lane and moved to the batch
    /// one, by `tenant`.
    pub chat_moved_to_batch: IntCounterVec,
    /// Jobs taken by fair dispatch, by `priority` (interactive | batch)
    /// and `reason` (turn: the lane's turn; aged: a batch job that had
    /// waited `--batch-max-wait`).
    pub chat_dispatched: IntCounterVec,
    /// Conversation model calls whose prompt prefix (system prompt and
    /// tools) differed from their invocation's previous call's, by
    /// `profile`: the provider's prompt cache could not serve them.
    pub prompt_prefix_changes: IntCounterVec,
}

/// Every `cap` of `toolfleet_tenant_cap_refusals_total`.
pub const CAPS: [&str; 4] = ["queued_jobs", "job_bytes", "parked", "delayed_jobs"];

/// One metric's name, help and labels: the registration table below is a
/// list of these, each registered in one line.
struct Spec {
    name: &'static str,
    help: &'static str,
    labels: &'static [&'static str],
}

impl Spec {
    fn counter(&self, r: &Registry) -> prometheus::Result<IntCounterVec> {
        counter(r, self.name, self.help, self.labels)
    }

    /// With the latency buckets.
    fn histogram(&self, r: &Registry) -> prometheus::Result<HistogramVec> {
        histogram(r, self.name, self.help, self.labels)
    }

    fn histogram_with(&self, r: &Registry, buckets: &[f64]) -> prometheus::Result<HistogramVec> {
        let opts = HistogramOpts::new(self.name, self.help).buckets(buckets.to_vec());
        registered(r, HistogramVec::new(opts, self.labels)?)
    }

    /// Without labels.
    fn plain_histogram(&self, r: &Registry, buckets: &[f64]) -> prometheus::Result<Histogram> {
        let opts = HistogramOpts::new(self.name, self.help).buckets(buckets.to_vec());
        registered(r, Histogram::with_opts(opts)?)
    }

    fn cost(&self, r: &Registry) -> prometheus::Result<CounterVec> {
        registered(
            r,
            CounterVec::new(Opts::new(self.name, self.help), self.labels)?,
        )
    }

    fn gauges(&self, r: &Registry) -> prometheus::Result<IntGaugeVec> {
        registered(
            r,
            IntGaugeVec::new(Opts::new(self.name, self.help), self.labels)?,
        )
    }

    fn gauge(&self, r: &Registry) -> prometheus::Result<IntGauge> {
        registered(r, IntGauge::new(self.name, self.help)?)
    }

    fn total(&self, r: &Registry) -> prometheus::Result<IntCounter> {
        registered(r, IntCounter::new(self.name, self.help)?)
    }
}

const fn spec(name: &'static str, help: &'static str, labels: &'static [&'static str]) -> Spec {
    Spec { name, help, labels }
}

const CHAT_JOBS: Spec = spec(
    "toolfleet_chat_jobs_total",
    "Chat jobs by outcome.",
    &["outcome"],
);
const CHAT_JOB_DURATION: Spec = spec(
    "toolfleet_chat_job_duration_seconds",
    "Time from taking a chat job to its terminal event.",
    &[],
);
const CHAT_JOBS_IN_FLIGHT: Spec = spec(
    "toolfleet_chat_jobs_in_flight",
    "Chat jobs being worked on by this orchestrator.",
    &[],
);
const LLM_REQUESTS: Spec = spec(
    "toolfleet_llm_requests_total",
    "Model requests by model and outcome.",
    &["model", "outcome"],
);
const LLM_REQUEST_DURATION: Spec = spec(
    "toolfleet_llm_request_duration_seconds",
    "Model request duration, first byte to last.",
    &["model"],
);
const LLM_TIME_TO_FIRST_TOKEN: Spec = spec(
    "toolfleet_llm_time_to_first_token_seconds",
    "Streamed model calls: from sending the request to the first text, refusal or tool call.",
    &["model"],
);
const LLM_TOKENS: Spec = spec(
    "toolfleet_llm_tokens_total",
    "Tokens reported by the model, by kind and purpose.",
    &["model", "kind", "purpose"],
);
const LLM_COST: Spec = spec(
    "toolfleet_llm_cost_usd_total",
    "Model cost in USD from the configured price table.",
    &["model", "purpose"],
);
const LLM_RETRIES: Spec = spec(
    "toolfleet_llm_retries_total",
    "Model HTTP attempts beyond the first (429, 5xx, connect, timeout).",
    &["model"],
);
const LLM_FALLBACKS: Spec = spec(
    "toolfleet_llm_fallbacks_total",
    "Model calls moved to the profile's next deployment after a failure before any output.",
    &["from", "to"],
);
const LOOP_LIMITS: Spec = spec(
    "toolfleet_loop_limits_total",
    "Loop caps hit; the model is then told to answer with what it has.",
    &["limit"],
);
const TOOL_RESULTS_TRUNCATED: Spec = spec(
    "toolfleet_tool_results_truncated_total",
    "Tool results cut to the per-profile token cap.",
    &["function"],
);
const TOOL_CALLS: Spec = spec(
    "toolfleet_tool_calls_total",
    "Tool calls dispatched by the orchestrator, by final status.",
    &["tool", "status"],
);
const TOOL_CACHE: Spec = spec(
    "toolfleet_tool_cache_total",
    "Calls of tools with a result cache, by outcome: hit (answered from the cache), miss (run), store (an ok result kept), skip (an ok result not kept: it had warnings, was replayed, or was over 256 KiB), bypass (the cache did not answer or was passed by after a failure, or a user-scoped call had no user: run uncached).",
    &["tool", "outcome"],
);
/// Every `outcome` of `toolfleet_tool_cache_total`.
pub const TOOL_CACHE_OUTCOMES: [&str; 5] = ["hit", "miss", "store", "skip", "bypass"];
const TOOL_CALL_DURATION: Spec = spec(
    "toolfleet_tool_call_duration_seconds",
    "Tool call round trip as the orchestrator sees it.",
    &["tool"],
);
const SCOPING_DECISIONS: Spec = spec(
    "toolfleet_scoping_decisions_total",
    "How the tools offered were chosen, by decision.",
    &["decision"],
);
const TOOLS_OFFERED: Spec = spec(
    "toolfleet_tools_offered",
    "Tools offered to the model per request (search_tools included).",
    &[],
);
const TOOL_EXPANSIONS: Spec = spec(
    "toolfleet_tool_expansions_total",
    "search_tools calls, by outcome.",
    &["outcome"],
);
const REGISTRY_TOOLS: Spec = spec(
    "toolfleet_registry_tools",
    "Tools in the orchestrator's registry, by backend.",
    &["backend"],
);
const REGISTRY_DUPLICATES: Spec = spec(
    "toolfleet_registry_duplicate_tools",
    "Tool ids a later backend also brought (the first backend's definition is used).",
    &[],
);
const REGISTRY_BUILD: Spec = spec(
    "toolfleet_registry_build_seconds",
    "Time to rebuild the registry and relevance index after a catalog change.",
    &[],
);
const UNKNOWN_TOOL_CALLS: Spec = spec(
    "toolfleet_unknown_tool_calls_total",
    "Tool calls naming no offered tool; answered with close names.",
    &[],
);
const RESULTS_READ_BACK: Spec = spec(
    "toolfleet_tool_results_read_back_total",
    "Tool results read back from the result ledger: the reply was lost (a reconnect) or the call was adopted from an earlier run of its invocation.",
    &[],
);
const TOOL_BACKLOG: Spec = spec(
    "toolfleet_tool_backlog",
    "Tool jobs waiting for a worker (the tool consumer's num_pending): scale the pool on it.",
    &["tool"],
);
const TOOL_JOBS_PENDING_ACK: Spec = spec(
    "toolfleet_tool_jobs_pending_ack",
    "Tool jobs a worker took and has not answered yet (num_ack_pending).",
    &["tool"],
);
const TOOL_LIVE_WORKERS: Spec = spec(
    "toolfleet_tool_live_workers",
    "Live worker processes serving the tool, from the catalog.",
    &["tool"],
);
const APPROVALS: Spec = spec(
    "toolfleet_approvals_total",
    "Tool calls that waited for a person's approval, by outcome.",
    &["outcome"],
);
const APPROVAL_WAIT: Spec = spec(
    "toolfleet_approval_wait_seconds",
    "Time from approval_requested to the decision, by outcome.",
    &["outcome"],
);
const APPROVALS_REFUSED: Spec = spec(
    "toolfleet_approval_requests_refused_total",
    "Approval requests answered with an error, by code.",
    &["code"],
);
const CHAT_POISON: Spec = spec(
    "toolfleet_chat_poison_total",
    "Chat jobs that could not be read (unreadable headers, a body that does not decode), by the tenant of their submit subject.",
    &["tenant"],
);
const TENANT_SUSPENSIONS: Spec = spec(
    "toolfleet_tenant_suspensions_total",
    "Times a tenant was suspended for poison (its count reached its limit) by this orchestrator.",
    &["tenant"],
);
const CHAT_SUSPENDED: Spec = spec(
    "toolfleet_chat_suspended_total",
    "Chat jobs refused (tenant_suspended, not run) because their tenant was suspended for poison.",
    &["tenant"],
);
const CAPS_REFUSED: Spec = spec(
    "toolfleet_tenant_cap_refusals_total",
    "Chat jobs and parks refused at a tenant's cap, by tenant and cap (queued_jobs, job_bytes, parked); refusals on the publish ack are the NATS server's and not counted here.",
    &["tenant", "cap"],
);

const TENANT_PARKED: Spec = spec(
    "toolfleet_tenant_parked",
    "A tenant's invocations parked waiting for approvals, as this orchestrator last saw the parked bucket.",
    &["tenant"],
);

const APPROVALS_PARKED: Spec = spec(
    "toolfleet_approvals_parked",
    "Invocations parked waiting for approvals, fleet-wide (every orchestrator reports the same count).",
    &[],
);

const CANCELS: Spec = spec(
    "toolfleet_cancels_total",
    "Cancels heard by this orchestrator, by tenant and outcome: tombstone or remembered (written down), rate_limited or queue_full (not written down; a run here is still stopped), store_unavailable.",
    &["tenant", "outcome"],
);

const CHAT_MOVED_TO_BATCH: Spec = spec(
    "toolfleet_chat_moved_to_batch_total",
    "Batch chat jobs (their priority field, or their profile's) submitted on the interactive subject and moved to their tenant's batch lane before running, by tenant.",
    &["tenant"],
);

const CHAT_DISPATCHED: Spec = spec(
    "toolfleet_chat_dispatched_total",
    "Chat jobs taken by fair dispatch in this orchestrator, by priority (interactive, batch) and reason (turn: the lane's turn; aged: a batch job taken ahead of waiting interactive ones because batch had waited --batch-max-wait).",
    &["priority", "reason"],
);

const IN_FLIGHT_WAITS: Spec = spec(
    "toolfleet_tenant_in_flight_waits_total",
    "Times a tenant's chat job (cap=jobs: max_jobs_in_flight) or tool call (cap=tool_calls: max_tool_calls_in_flight, per pool) waited because the tenant had its cap of them in flight fleet-wide.",
    &["tenant", "cap"],
);

const PROVIDER_QUEUED: Spec = spec(
    "toolfleet_provider_queue_seconds",
    "Conversation model calls of deployments with fleet-wide limits (max_concurrency, requests_per_minute): how long each waited for its place, all attempts together.",
    &["deployment"],
);

const PROMPT_PREFIX_CHANGES: Spec = spec(
    "toolfleet_prompt_prefix_changes_total",
    "Conversation model calls whose prompt prefix (system prompt, then the tools sorted by name) differed from their invocation's previous call's, by profile: the provider's prompt cache could not serve their beginning.",
    &["profile"],
);

/// Buckets of the wait at a deployment's limits: none to two minutes.
const PROVIDER_QUEUED_BUCKETS: [f64; 10] =
    [0.005, 0.05, 0.25, 0.5, 1.0, 2.5, 5.0, 15.0, 60.0, 120.0];

const CHAT_QUEUED: Spec = spec(
    "toolfleet_chat_jobs_queued",
    "Chat jobs in the chat stream per tenant (waiting, or delivered and not yet acked), fleet-wide (every orchestrator reports the same count).",
    &["tenant"],
);

/// Buckets of the approval wait: a second to a week.
const APPROVAL_WAIT_BUCKETS: [f64; 10] = [
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
];

/// Buckets of the tools offered per request.
const TOOLS_OFFERED_BUCKETS: [f64; 10] = [0.0, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 50.0, 100.0, 128.0];

impl OrchestratorMetrics {
    /// Registers the orchestrator's metrics on `r` (`dead_letters` is the
    /// process's shared counter) with every bounded series at zero.
    pub fn register(r: &Registry, dead_letters: IntCounterVec) -> prometheus::Result<Self> {
        let m = Self {
            chat_jobs: CHAT_JOBS.counter(r)?,
            chat_job_duration: CHAT_JOB_DURATION.plain_histogram(r, LATENCY_BUCKETS)?,
            chat_jobs_in_flight: CHAT_JOBS_IN_FLIGHT.gauge(r)?,
            llm_requests: LLM_REQUESTS.counter(r)?,
            llm_request_duration: LLM_REQUEST_DURATION.histogram(r)?,
            llm_time_to_first_token: LLM_TIME_TO_FIRST_TOKEN.histogram(r)?,
            llm_tokens: LLM_TOKENS.counter(r)?,
            llm_cost: LLM_COST.cost(r)?,
            llm_retries: LLM_RETRIES.counter(r)?,
            llm_fallbacks: LLM_FALLBACKS.counter(r)?,
            loop_limits: LOOP_LIMITS.counter(r)?,
            tool_results_truncated: TOOL_RESULTS_TRUNCATED.counter(r)?,
            tool_calls: TOOL_CALLS.counter(r)?,
            tool_call_duration: TOOL_CALL_DURATION.histogram(r)?,
            tool_cache: TOOL_CACHE.counter(r)?,
            scoping_decisions: SCOPING_DECISIONS.counter(r)?,
            tools_offered: TOOLS_OFFERED.plain_histogram(r, &TOOLS_OFFERED_BUCKETS)?,
            tool_expansions: TOOL_EXPANSIONS.counter(r)?,
            registry_tools: REGISTRY_TOOLS.gauges(r)?,
            registry_duplicates: REGISTRY_DUPLICATES.gauge(r)?,
            registry_build: REGISTRY_BUILD.plain_histogram(r, LATENCY_BUCKETS)?,
            unknown_tool_calls: UNKNOWN_TOOL_CALLS.total(r)?,
            results_read_back: RESULTS_READ_BACK.total(r)?,
            sinks: crate::sinks::SinkMetrics::register(r)?,
            dead_letters,
            tool_backlog: TOOL_BACKLOG.gauges(r)?,
            tool_jobs_pending_ack: TOOL_JOBS_PENDING_ACK.gauges(r)?,
            tool_live_workers: TOOL_LIVE_WORKERS.gauges(r)?,
            approvals: APPROVALS.counter(r)?,
            approval_wait: APPROVAL_WAIT.histogram_with(r, &APPROVAL_WAIT_BUCKETS)?,
            approvals_refused: APPROVALS_REFUSED.counter(r)?,
            approvals_parked: APPROVALS_PARKED.gauge(r)?,
            chat_poison: CHAT_POISON.counter(r)?,
            tenant_suspensions: TENANT_SUSPENSIONS.counter(r)?,
            chat_suspended: CHAT_SUSPENDED.counter(r)?,
            caps_refused: CAPS_REFUSED.counter(r)?,
            tenant_parked: TENANT_PARKED.gauges(r)?,
            quota: crate::quota::QuotaMetrics::register(r)?,
            schedules: crate::schedules::ScheduleMetrics::register(r)?,
            threads: crate::threads::metrics::ThreadMetrics::register(r)?,
            cancels: CANCELS.counter(r)?,
            chat_queued: CHAT_QUEUED.gauges(r)?,
            in_flight_waits: IN_FLIGHT_WAITS.counter(r)?,
            provider_queued: PROVIDER_QUEUED.histogram_with(r, &PROVIDER_QUEUED_BUCKETS)?,
            chat_moved_to_batch: CHAT_MOVED_TO_BATCH.counter(r)?,
            chat_dispatched: CHAT_DISPATCHED.counter(r)?,
            prompt_prefix_changes: PROMPT_PREFIX_CHANGES.counter(r)?,
        };
        m.zero();
        Ok(m)
    }

    /// Every bounded series at zero, so the first of each is an increase
    /// an alert sees.
    fn zero(&self) {
        for d in ["all", "token", "planning", "planning_fallback"] {
            self.scoping_decisions.with_label_values(&[d]);
        }
        for o in ["added", "nothing", "capped"] {
            self.tool_expansions.with_label_values(&[o]);
        }
        self.dead_letters.with_label_values(&["chat", ""]);
        self.dead_letters.with_label_values(&["sink", ""]);
        // Tools are known only from the catalog: each outcome's series is
        // there from the start under `tool=""`, as the dead letters'.
        for o in TOOL_CACHE_OUTCOMES {
            self.tool_cache.with_label_values(&["", o]);
        }
        for o in CHAT_OUTCOMES {
            self.chat_jobs.with_label_values(&[o]);
        }
        for o in toolfleet_protocol::ApprovalOutcome::ALL {
            self.approvals.with_label_values(&[o.as_str()]);
            self.approval_wait.with_label_values(&[o.as_str()]);
        }
        for c in APPROVAL_REFUSALS {
            self.approvals_refused.with_label_values(&[c]);
        }
        for c in CAPS {
            self.caps_refused.with_label_values(&["default", c]);
        }
        for (p, r) in [
            ("interactive", "turn"),
            ("batch", "turn"),
            ("batch", "aged"),
        ] {
            self.chat_dispatched.with_label_values(&[p, r]);
        }
    }
}

impl OrchestratorMetrics {
    /// `tenant`'s poison series at zero (a tenant of the config at start,
    /// any at its first poison), so its first suspension is an increase
    /// an alert sees.
    pub fn zero_tenant(&self, tenant: &str) {
        self.chat_poison.with_label_values(&[tenant]);
        self.tenant_suspensions.with_label_values(&[tenant]);
        self.chat_suspended.with_label_values(&[tenant]);
        self.chat_moved_to_batch.with_label_values(&[tenant]);
        for cap in ["jobs", "tool_calls"] {
            self.in_flight_waits.with_label_values(&[tenant, cap]);
        }
    }

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
