//! A job pulled from the tool's consumer, to its end on JetStream: acked
//! once answered (and in the ledger), `nak`ed with our own delay for a
//! retry, or terminated and dead-lettered — the caller still gets an
//! error result.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_nats::jetstream::{self, AckKind};
use toolfleet_protocol::{CallContext, DeadLetter, DeadLetterKind};
use tracing::warn;

use super::dead_letters;
use super::job::process;
use super::outcome::{Failure, Outcome, Processed};
use super::reply::{answer, fit_result, publish_reply};
use super::shared::Shared;
use crate::builder::Served;
use crate::service_stats::Via;

/// Where a delivery stands in its job's life, from JetStream's info.
struct Delivery {
    /// The attempt this delivery is (from 1).
    attempt: u32,
    /// The job's sequence in the tools stream.
    sequence: u64,
    /// When JetStream stored the job, for its first delivery only.
    first_published: Option<SystemTime>,
}

impl Delivery {
    fn of(msg: &jetstream::Message) -> Self {
        match msg.info() {
            Ok(i) => Self {
                attempt: u32::try_from(i.delivered).unwrap_or(1).max(1),
                sequence: i.stream_sequence,
                first_published: (i.delivered == 1).then(|| {
                    UNIX_EPOCH
                        + Duration::from_nanos(
                            u64::try_from(i.published.unix_timestamp_nanos()).unwrap_or(0),
                        )
                }),
            },
            Err(_) => Self {
                attempt: 1,
                sequence: 0,
                first_published: None,
            },
        }
    }
}

/// One delivery from the tool's consumer. The pull loop keeps it alive
/// (in-progress acks) until `slot` is dropped, when this returns.
pub(super) async fn handle_jetstream(
    msg: jetstream::Message,
    mut slot: toolfleet_service::jobs::Slot,
    tool: &Served,
    shared: &Shared,
) {
    let delivery = Delivery::of(&msg);
    let attempt = delivery.attempt;
    let no_headers = async_nats::HeaderMap::new();
    let headers = msg.headers.as_ref().unwrap_or(&no_headers);
    let processed = process(
        headers,
        &msg.payload,
        attempt,
        delivery.first_published,
        Via::JetStream,
        tool,
        shared,
    )
    .await;
    let (call, failure) = match processed {
        Processed::Call(call, Outcome::Answer { result, ran }) => {
            let to_ledger = ran && !tool.definition().idempotent;
            answer(shared, &call, &result, to_ledger, || slot.free()).await;
            // Only now: the result is out and (when the tool ran) in the
            // ledger, so a crash before this ack redelivers a job that
            // either replays its result or runs again.
            let _ = msg.ack().await;
            return;
        }
        Processed::Call(_, Outcome::Retry(failure)) if attempt < shared.config.max_attempts => {
            shared
                .metrics
                .tool_job_retries
                .with_label_values(&[tool.label()])
                .inc();
            warn!(tool = %tool.label(), attempt, error = %failure.message, "attempt failed; will retry");
            let _ = msg
                .ack_with(AckKind::Nak(Some(shared.config.retry_delay)))
                .await;
            return;
        }
        Processed::Call(call, Outcome::Retry(failure) | Outcome::Dead(failure)) => {
            (Some(call), failure)
        }
        Processed::Unanswerable(failure) => (None, failure),
    };
    give_up(&msg, &delivery, call.as_ref(), failure, tool, shared).await;
}

/// Ends a job for good: an error result to its caller (when there is a
/// call to answer), the job terminated, and a dead letter of it.
async fn give_up(
    msg: &jetstream::Message,
    delivery: &Delivery,
    call: Option<&CallContext>,
    failure: Failure,
    tool: &Served,
    shared: &Shared,
) {
    let attempt = delivery.attempt;
    // The caller always gets an answer, even for a dead job.
    if let Some(call) = call {
        let result = failure.result_for(call, attempt);
        publish_reply(shared, call, fit_result(shared, &result, None)).await;
    }
    let _ = msg.ack_with(AckKind::Term).await;
    let code = failure.code.clone();
    let mut dead = DeadLetter {
        kind: DeadLetterKind::Tool,
        stream: shared.config.subjects.tools_stream(),
        stream_sequence: delivery.sequence,
        invocation_id: call.map(|c| c.invocation.invocation_id.clone()),
        call_id: call.map(|c| c.call_id.clone()),
        tool_id: Some(tool.label().to_string()),
        attempts: attempt,
        code: failure.code,
        error: failure.message,
        headers: toolfleet_protocol::dead_letter_headers(msg.headers.as_ref()),
        raw_headers: None,
        job: toolfleet_protocol::dead_letter_job(&msg.payload),
    };
    // Kept for days: its sensitive arguments are hidden as events hide
    // them, before it leaves the worker.
    dead.redact_arguments(&tool.definition().sensitive_arguments);
    dead_letters::publish(shared, dead).await;
    warn!(tool = %tool.label(), attempt, code = %code, "tool job dead-lettered");
}
