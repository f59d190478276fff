//! Metrics of the worker runtime, shared by every tool of a process.

use prometheus::{IntCounterVec, IntGaugeVec, Opts, Registry};
use toolfleet_service::metrics::{counter, histogram};

/// Metrics of the worker runtime, shared by every tool of a process.
#[derive(Clone)]
pub struct WorkerMetrics {
    /// `tool`, `outcome`: ok | error | blocked | timeout | invalid_arguments | redelivered.
    pub tool_jobs: IntCounterVec,
    /// `tool`: how long the tool ran, in seconds.
    pub tool_job_duration: prometheus::HistogramVec,
    /// `tool`: jobs running now.
    pub tool_jobs_in_flight: IntGaugeVec,
    /// `tool`: failed attempts handed back for a retry.
    pub tool_job_retries: IntCounterVec,
    /// `kind`: tool.
    pub dead_letters: IntCounterVec,
    /// `tool`: references written to the citation store.
    pub citations_written: IntCounterVec,
    /// `tool`: structured outputs that do not match the definition's
    /// `outputSchema` (answered all the same, with an
    /// `output_schema_mismatch` warning): a definition and its code that
    /// disagree.
    pub tool_output_schema_mismatches: IntCounterVec,
}

impl WorkerMetrics {
    /// Registers the worker metrics and the shared dead-letter counter on
    /// `r` (a process with no orchestrator beside it).
    pub fn register_all(r: &Registry) -> prometheus::Result<Self> {
        let dead_letters = toolfleet_service::metrics::dead_letters(r)?;
        Self::register(r, dead_letters)
    }

    /// Registers the worker metrics on `r`, counting dead letters on
    /// `dead_letters` (the process's one counter, shared with an
    /// orchestrator running beside the workers).
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
            tool_output_schema_mismatches: counter(
                r,
                "toolfleet_tool_output_schema_mismatches_total",
                "Tool outputs that do not match the definition's outputSchema.",
                &["tool"],
            )?,
        })
    }
}
