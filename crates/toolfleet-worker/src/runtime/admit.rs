//! Admission of a job, the checks before its call runs, in order: the
//! right tool; a result already stored (replayed) or a cancel already
//! heard; the envelope; the arguments against the definition's schema;
//! the `before_call` policies. Each check that refuses answers the call
//! without running it.

use std::time::SystemTime;
use toolfleet_protocol::ToolErrorCode;

use toolfleet_protocol::{CallContext, Envelope, ToolJob, ToolResult, ToolStatus};
use toolfleet_store::{CitationError, InvocationKey};

use super::cancels::run_key;
use super::outcome::{Failure, Outcome};
use super::results::{error_result, status_result};
use super::shared::Shared;
use crate::builder::Served;
use crate::hooks::CallInfo;

/// The checks before a call runs; `Err` is the answer without running it.
pub(super) async fn admit(
    call: &CallContext,
    payload: &[u8],
    first_published: Option<SystemTime>,
    tool: &Served,
    shared: &Shared,
) -> Result<ToolJob, Outcome> {
    check_tool(call, tool, shared)?;
    check_prior(call, first_published, tool, shared).await?;
    let job = decode(call, payload, tool, shared)?;
    validate(call, &job, tool, shared)?;
    check_policies(call, &job, tool, shared)?;
    Ok(job)
}

/// The job names the tool this subject serves.
fn check_tool(call: &CallContext, tool: &Served, shared: &Shared) -> Result<(), Outcome> {
    let def = tool.definition();
    if call.tool_id == def.id {
        return Ok(());
    }
    shared.count(tool.label(), "error");
    Err(Outcome::Dead(Failure::new(
        ToolErrorCode::WrongTool.as_str(),
        format!(
            "this subject serves {}, but the job names {}",
            def.id, call.tool_id
        ),
    )))
}

/// A redelivered (or re-published) job returns what the first attempt
/// stored, and writes no second set of citations. A job of a cancelled
/// invocation (its cancel came while it was queued, perhaps before this
/// worker started) is answered `cancelled` without running. A store that
/// cannot say is a retry.
async fn check_prior(
    call: &CallContext,
    first_published: Option<SystemTime>,
    tool: &Served,
    shared: &Shared,
) -> Result<(), Outcome> {
    let label = tool.label();
    match prior(call, first_published, shared).await {
        Ok((Some(mut stored), _)) => {
            shared.count(label, "redelivered");
            stored.replayed = true;
            stored.attempt = call.attempt;
            Err(Outcome::refused(stored))
        }
        Ok((None, true)) => {
            shared.count(label, "cancelled");
            Err(Outcome::refused(status_result(
                call,
                call.attempt,
                0,
                ToolStatus::Error,
                ToolErrorCode::Cancelled.as_str(),
                "the invocation was cancelled before this call started",
                Vec::new(),
            )))
        }
        Ok((None, false)) => Ok(()),
        Err(e) => Err(Outcome::Retry(Failure::new(
            ToolErrorCode::StoreUnavailable.as_str(),
            e.to_string(),
        ))),
    }
}

/// The result stored for `call`, if any, and whether its invocation was
/// cancelled: from this worker's memory while the ledger write is on its
/// way, else from the ledger and the tombstone in one read.
///
/// The first delivery of a new call has no stored result, and when this
/// worker has heard every cancel since well before the job was
/// published, its memory answers for the tombstone: no Redis read.
async fn prior(
    call: &CallContext,
    first_published: Option<SystemTime>,
    shared: &Shared,
) -> Result<(Option<ToolResult>, bool), CitationError> {
    if let Some(stored) = shared.recording.get(call) {
        return Ok((Some(stored), false));
    }
    let heard = |p| shared.heard_all_cancels(p);
    let remembered = (call.new_call && first_published.is_some_and(heard)).then(|| {
        shared.running.remembers_cancel(&run_key(
            call.invocation.tenant(),
            &call.invocation.invocation_id,
        ))
    });
    match remembered {
        // Still heard after the look: a flood of cancels may have emptied
        // the memory meanwhile.
        Some(cancelled) if cancelled || first_published.is_some_and(heard) => Ok((None, cancelled)),
        _ => {
            shared
                .store
                .ledger_and_cancel(InvocationKey::of_call(call), &call.call_id)
                .await
        }
    }
}

/// The job's envelope; a malformed one is answered at once.
fn decode(
    call: &CallContext,
    payload: &[u8],
    tool: &Served,
    shared: &Shared,
) -> Result<ToolJob, Outcome> {
    Envelope::ToolJob.decode(payload).map_err(|e| {
        shared.count(tool.label(), "error");
        let message = format!("malformed tool job: {e}");
        Outcome::refused(error_result(call, call.attempt, 0, e.code(), &message))
    })
}

/// Invalid arguments: a model-readable error at once, no side effect,
/// nothing written to Redis, never retried.
fn validate(
    call: &CallContext,
    job: &ToolJob,
    tool: &Served,
    shared: &Shared,
) -> Result<(), Outcome> {
    let Err(violations) = tool.tool.validate_arguments(&job.arguments) else {
        return Ok(());
    };
    shared.count(tool.label(), "invalid_arguments");
    let message = format!(
        "Invalid arguments for {}: {}",
        tool.definition().function.name,
        toolfleet_protocol::schema::describe(&violations)
    );
    Err(Outcome::refused(status_result(
        call,
        call.attempt,
        0,
        ToolStatus::Error,
        ToolErrorCode::InvalidArguments.as_str(),
        &message,
        violations,
    )))
}

/// The `before_call` policies (built-in, then the author's): a refusal is
/// answered `blocked` with its code and message.
fn check_policies(
    call: &CallContext,
    job: &ToolJob,
    tool: &Served,
    shared: &Shared,
) -> Result<(), Outcome> {
    let info = CallInfo {
        call,
        definition: tool.definition(),
        arguments: &job.arguments,
        settings: job.settings.as_ref(),
    };
    let Err(refusal) = shared.hooks.before_call(&info) else {
        return Ok(());
    };
    shared.count(tool.label(), "blocked");
    Err(Outcome::refused(status_result(
        call,
        call.attempt,
        0,
        ToolStatus::Blocked,
        &refusal.code,
        &refusal.message,
        Vec::new(),
    )))
}
