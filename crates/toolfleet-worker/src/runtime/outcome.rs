//! What one delivery of a job decides: [`Processed`] (a call, or nothing
//! to answer), the call's [`Outcome`] (answer, retry, dead) and the
//! [`Failure`] that is not the tool's answer.

use toolfleet_protocol::{CallContext, ToolResult};

use super::results::error_result;

/// Why a delivery was not answered by its tool: a code and a message.
pub(super) struct Failure {
    pub(super) code: String,
    pub(super) message: String,
}

impl Failure {
    pub(super) fn new(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            message: message.into(),
        }
    }

    /// The error result the caller gets for this failure.
    pub(super) fn result_for(&self, call: &CallContext, attempt: u32) -> ToolResult {
        error_result(call, attempt, 0, &self.code, &self.message)
    }
}

/// What became of one delivery of a job.
// Returned once per delivery and matched at once: boxing the call would
// cost an allocation per job to save a move.
#[allow(clippy::large_enum_variant)]
pub(super) enum Processed {
    /// No call to answer: its headers cannot be read, or its reply subject
    /// is not the fleet's. Dead: terminated and dead-lettered.
    Unanswerable(Failure),
    /// A call, and what became of it.
    Call(CallContext, Outcome),
}

/// What became of a call.
pub(super) enum Outcome {
    /// Tell the caller this result; the job is done. `ran`: the tool ran
    /// for it, so it goes into the ledger (after the caller has it).
    Answer { result: Box<ToolResult>, ran: bool },
    /// Another attempt may help (until the attempt cap).
    Retry(Failure),
    /// Never again: terminate and dead-letter; the caller gets an error
    /// result.
    Dead(Failure),
}

impl Outcome {
    /// An answer the tool did not run for (replayed, refused, invalid):
    /// nothing to write to the ledger.
    pub(super) fn refused(result: ToolResult) -> Self {
        Outcome::Answer {
            result: Box::new(result),
            ran: false,
        }
    }

    /// The status the job ended with (a result's status, or `retry` /
    /// `dead`) and its error's code and message, if it failed.
    pub(super) fn status(&self) -> (&str, Option<(&str, &str)>) {
        match self {
            Outcome::Answer { result, .. } => (
                result.status.as_str(),
                result
                    .error
                    .as_ref()
                    .map(|e| (e.code.as_str(), e.message.as_str())),
            ),
            Outcome::Retry(f) => ("retry", Some((f.code.as_str(), f.message.as_str()))),
            Outcome::Dead(f) => ("dead", Some((f.code.as_str(), f.message.as_str()))),
        }
    }
}
