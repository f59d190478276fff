//! One delivery of a job, however it came (JetStream or a direct
//! request): its headers read into a call context (a call with no
//! answerable reply subject is [`Processed::Unanswerable`]), the job's
//! span (continuing the caller's trace), the call, and one log line and
//! the endpoint's counts when it is over.

use std::time::{Instant, SystemTime};
use toolfleet_protocol::ToolErrorCode;

use toolfleet_protocol::CallContext;
use tracing::{Instrument, Span, info, warn};

use super::call::process_call;
use super::outcome::{Failure, Outcome, Processed};
use super::shared::Shared;
use crate::builder::Served;
use crate::service_stats::Via;

/// Processes one delivery. Shared by JetStream and direct delivery;
/// `first_published` is when JetStream stored the job, for its first
/// delivery only.
pub(super) async fn process(
    headers: &async_nats::HeaderMap,
    payload: &[u8],
    attempt: u32,
    first_published: Option<SystemTime>,
    via: Via,
    tool: &Served,
    shared: &Shared,
) -> Processed {
    let call = match read_call(headers, attempt, tool, shared) {
        Ok(call) => call,
        Err(failure) => return Processed::Unanswerable(failure),
    };
    let span = job_span(&call, tool);
    let started = Instant::now();
    let outcome = process_call(&call, payload, first_published, tool, shared)
        .instrument(span.clone())
        .await;
    finished(&span, &outcome, via, started, tool, shared);
    Processed::Call(call, outcome)
}

/// The call the job's headers describe, on its `attempt`. Results go only
/// to the fleet's reply subjects: a job that names anything else (another
/// fleet's subject, `chat.submit`, an events subject) is a forgery or a
/// bug, and gets no answer.
fn read_call(
    headers: &async_nats::HeaderMap,
    attempt: u32,
    tool: &Served,
    shared: &Shared,
) -> Result<CallContext, Failure> {
    let label = tool.label();
    let mut call = CallContext::from_headers(headers).map_err(|e| {
        shared.count(label, "error");
        warn!(tool = %label, error = %e, "tool job with bad headers");
        Failure::new(e.code(), e.to_string())
    })?;
    call.attempt = attempt;
    if !shared.config.subjects.is_reply_subject(&call.reply_to) {
        shared.count(label, "error");
        warn!(tool = %label, reply_to = %call.reply_to, "tool job with a reply subject outside the fleet's reply prefix");
        return Err(Failure::new(
            ToolErrorCode::BadReplySubject.as_str(),
            format!(
                "the reply subject {:?} is not under {}",
                call.reply_to,
                shared.config.subjects.replies_all()
            ),
        ));
    }
    Ok(call)
}

/// The job's span (OpenTelemetry's `execute_tool`), a child of the
/// caller's `traceparent` when the job carries one.
fn job_span(call: &CallContext, tool: &Served) -> Span {
    let label = tool.label();
    let span = tracing::info_span!(
        "tool_job",
        otel.name = format!("execute_tool {}", tool.definition().id.name),
        otel.kind = "consumer",
        otel.status_code = tracing::field::Empty,
        gen_ai.operation.name = "execute_tool",
        gen_ai.tool.name = %label,
        gen_ai.tool.call.id = %call.call_id,
        gen_ai.tool.type = "function",
        error.type = tracing::field::Empty,
        invocation_id = %call.invocation.invocation_id,
        call_id = %call.call_id,
        tool_id = %label,
        attempt = call.attempt,
        trace_id = tracing::field::Empty,
    );
    toolfleet_service::telemetry::continue_trace(&span, call.invocation.traceparent.as_deref());
    span
}

/// Counts the finished job for `$SRV.STATS`, marks its span ok or failed,
/// and logs one line inside it (its ids and trace id).
fn finished(
    span: &Span,
    outcome: &Outcome,
    via: Via,
    started: Instant,
    tool: &Served,
    shared: &Shared,
) {
    let (status, error) = outcome.status();
    let code = error.map(|(code, _)| code);
    shared
        .stats(tool)
        .jobs
        .record(via, status, error, started.elapsed());
    span.record(
        "otel.status_code",
        if code.is_none() { "ok" } else { "error" },
    );
    if let Some(code) = code {
        span.record("error.type", code);
    }
    span.in_scope(|| {
        info!(
            outcome = status,
            code = code.unwrap_or(""),
            duration_ms = started.elapsed().as_millis() as u64,
            "tool job finished"
        );
    });
}
