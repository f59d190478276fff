//! [`ThreadMetrics`]: what threads and idempotency keys come to, counted
//! (every series at zero from the start, so a dashboard always has data).
//! It imports nothing of the crate: the orchestrator's metrics hold it.

use prometheus::{IntCounter, IntCounterVec, Opts, Registry};
use toolfleet_protocol::thread::MultitaskStrategy;

/// Every `outcome` of `toolfleet_thread_jobs_total`: the thread was free
/// (`took`), busy and the job waited (`waited`: enqueue, interrupt,
/// rollback), or busy and the job was refused (`refused`: reject).
pub const THREAD_OUTCOMES: [&str; 3] = ["took", "waited", "refused"];

/// The threads' and idempotency keys' metrics.
#[derive(Clone)]
pub struct ThreadMetrics {
    /// `toolfleet_thread_jobs_total{strategy, outcome}`: jobs of threads
    /// as they arrived (a redelivery counts again).
    pub jobs: IntCounterVec,
    /// `toolfleet_idempotent_replays_total`: repeats of an idempotency key
    /// answered with the first job's outcome instead of a run.
    pub replays: IntCounter,
}

impl ThreadMetrics {
    /// Registers the metrics on `r`, every series at zero.
    ///
    /// # Errors
    ///
    /// When a metric of the same name is registered already.
    pub fn register(r: &Registry) -> prometheus::Result<Self> {
        let jobs = IntCounterVec::new(
            Opts::new(
                "toolfleet_thread_jobs_total",
                "Chat jobs of threads as they arrived, by the strategy they arrived with and what it came to: took (the thread was free), waited (busy: enqueue, interrupt, rollback), refused (busy: reject, thread_busy).",
            ),
            &["strategy", "outcome"],
        )?;
        r.register(Box::new(jobs.clone()))?;
        for strategy in MultitaskStrategy::ALL {
            for outcome in THREAD_OUTCOMES {
                jobs.with_label_values(&[strategy.as_str(), outcome]);
            }
        }
        let replays = IntCounter::new(
            "toolfleet_idempotent_replays_total",
            "Chat jobs that repeated an idempotency key of their tenant within the window: answered with the first job's outcome, nothing run.",
        )?;
        r.register(Box::new(replays.clone()))?;
        Ok(Self { jobs, replays })
    }

    /// Counts a job of a thread that arrived with `strategy`.
    pub fn arrived(&self, strategy: MultitaskStrategy, outcome: &str) {
        self.jobs
            .with_label_values(&[strategy.as_str(), outcome])
            .inc();
    }
}
