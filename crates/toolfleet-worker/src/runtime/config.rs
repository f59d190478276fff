//! [`WorkerConfig`]: how a worker runs, the same for every tool it serves,
//! with the defaults and bounds its consumers are made with.

use std::time::Duration;

use toolfleet_protocol::Subjects;
use toolfleet_protocol::tools::ToolDefinition;

/// How a worker runs (the same for every tool it serves).
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    /// The fleet's subject names (its prefix), shared with the orchestrator.
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
    /// of a new call ([`toolfleet_protocol::CallContext::new_call`]) to
    /// skip Redis: its memory of cancels then answers for the tombstone.
    /// See [`CANCEL_HEARING_MARGIN`] for what it must cover.
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
pub const MIN_ACK_WAIT: Duration = toolfleet_protocol::streams::TOOL_MIN_ACK_WAIT;

impl WorkerConfig {
    /// The defaults for the fleet named by `subjects`: 16 jobs at once, 3
    /// attempts 500 ms apart, ack waits of at most 30 s.
    pub fn new(subjects: Subjects) -> Self {
        Self {
            subjects,
            concurrency: 16,
            // The defaults an orchestrator makes a declared pool's
            // consumers with, before any worker of it has started.
            max_attempts: toolfleet_protocol::streams::TOOL_MAX_ATTEMPTS,
            retry_delay: Duration::from_millis(500),
            ack_wait: toolfleet_protocol::streams::TOOL_MAX_ACK_WAIT,
            cancel_hearing_margin: CANCEL_HEARING_MARGIN,
        }
    }

    /// The ack wait of `def`'s consumer: how long the jobs of a worker that
    /// froze or died stay invisible before another worker of the pool gets
    /// them. A quarter of the tool's timeout, so a redelivered call still
    /// finishes inside the caller's wait (the tool's timeout plus slack);
    /// live workers prove they are alive with in-progress acks (a
    /// heartbeat, as Temporal's activity heartbeat timeout) at a third of
    /// it.
    pub fn ack_wait_for(&self, def: &ToolDefinition) -> Duration {
        toolfleet_protocol::streams::tool_ack_wait(def, self.ack_wait)
    }
}
