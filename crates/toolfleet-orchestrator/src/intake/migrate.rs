//! From the shared chat consumer of earlier releases to fair dispatch.
//!
//! Before fair dispatch every orchestrator pulled chat jobs from one
//! unfiltered durable consumer, `orchestrators`. A work-queue stream
//! refuses a consumer whose filter overlaps another's, so the per-tenant
//! consumers cannot exist beside it: the first orchestrator of this
//! release to start removes it ([`drop_shared_consumer`]). Nothing is
//! lost: a work queue keeps a job until it is acked, and the jobs the old
//! consumer had delivered and not had acked are delivered again by their
//! tenant's consumer; the claim and lease of each invocation (see
//! `claim`) keep a job that an old orchestrator is still running from
//! running twice, and answer it from its finished run if it ended.
//!
//! In a rolling upgrade, old orchestrators still running finish the jobs
//! they hold (their acks fail once their consumer is gone, and those jobs
//! are then answered from their finished claims on redelivery) and take
//! no new ones; an old orchestrator that starts after a new one cannot
//! make its unfiltered consumer beside the per-tenant ones and stops with
//! an error. The upgrade is one way: to go back, delete the `chat-*`
//! consumers (`nats consumer rm TOOLFLEET_CHAT chat-<tenant>`).
//!
//! Jobs stored on the untenanted `<p>.chat.submit` by a release before
//! tenant subjects match no tenant's filter; they are published again on
//! the submit subject of the tenant they name (as they ran before: see
//! `handle`) and removed ([`requeue_untenanted`]).

use async_nats::jetstream::{
    self, ErrorCode,
    stream::{ConsumerErrorKind, RawMessageErrorKind},
};
use futures::StreamExt;
use toolfleet_protocol::{DEFAULT_TENANT, Subjects, valid_tenant};
use tracing::{info, warn};

use crate::OrchestratorError;

/// Removes the shared `orchestrators` chat consumer of an earlier release,
/// if it is there.
pub(super) async fn drop_shared_consumer(
    stream: &jetstream::stream::Stream,
    subjects: &Subjects,
) -> Result<(), OrchestratorError> {
    match stream.delete_consumer(&subjects.chat_consumer()).await {
        Ok(_) => {
            info!(
                consumer = %subjects.chat_consumer(),
                "removed the chat consumer every tenant shared (an earlier release's); chat jobs are now taken from each tenant's own consumer in turn"
            );
            Ok(())
        }
        Err(e) if matches!(e.kind(), ConsumerErrorKind::JetStream(j) if j.error_code() == ErrorCode::CONSUMER_NOT_FOUND) => {
            Ok(())
        }
        Err(e) => Err(OrchestratorError::Nats(format!(
            "cannot remove the shared chat consumer of an earlier release ({}): {e}",
            subjects.chat_consumer()
        ))),
    }
}

/// FIFO dispatch shares one unfiltered consumer, which a work queue
/// allows only when no consumer of fair dispatch is there: refuses to
/// start, saying how to switch, when one is.
pub(super) async fn refuse_tenant_consumers(
    stream: &jetstream::stream::Stream,
    subjects: &Subjects,
) -> Result<(), OrchestratorError> {
    let mut names = stream.consumer_names();
    while let Some(name) = names.next().await {
        let name = name.map_err(|e| OrchestratorError::Nats(e.to_string()))?;
        if subjects.consumer_lane(&name).is_some() {
            return Err(OrchestratorError::Config(format!(
                "--chat-dispatch fifo: the chat stream holds fair dispatch's consumer {name:?}; \
                 stop every orchestrator and delete the chat-* and batch-* consumers \
                 (`nats consumer rm {} <name>`), or run with --chat-dispatch fair",
                subjects.chat_stream()
            )));
        }
    }
    Ok(())
}

/// How many messages `stream` holds on `subject` (0 when it cannot be
/// read: the move is tried at the next start).
async fn legacy_count(stream: &jetstream::stream::Stream, subject: &str) -> u64 {
    let Ok(mut counts) = stream.info_with_subjects(subject).await else {
        return 0;
    };
    let mut n = 0;
    while let Some(Ok((_, c))) = counts.next().await {
        n += c as u64;
    }
    n
}

/// Publishes the jobs stored on the untenanted submit subject again on
/// their tenant's, and removes them. Errors are logged: the jobs left are
/// moved at the next start.
pub(super) async fn requeue_untenanted(
    js: &jetstream::Context,
    stream: &jetstream::stream::Stream,
    subjects: &Subjects,
) {
    let legacy = format!("{}.chat.submit", subjects.prefix());
    let stored = legacy_count(stream, &legacy).await;
    if stored == 0 {
        return;
    }
    info!(
        jobs = stored,
        "moving chat jobs off the untenanted submit subject of an earlier release"
    );
    let mut from = 1;
    loop {
        let msg = match stream
            .raw_message_builder()
            .sequence(from)
            .next_by_subject(legacy.clone())
            .send()
            .await
        {
            Ok(msg) => msg,
            Err(e) if matches!(e.kind(), RawMessageErrorKind::NoMessageFound) => return,
            Err(e) => {
                warn!(error = %e, "cannot read the chat jobs left on the untenanted submit subject (this needs $JS.API.STREAM.MSG.GET and MSG.DELETE on the chat stream, which the shipped orchestrator role lacks: see docs/operations.md, \"Upgrading to fair dispatch\"); they stay stored, and are tried again at the next start");
                return;
            }
        };
        from = msg.sequence + 1;
        let tenant = serde_json::from_slice::<serde_json::Value>(&msg.payload)
            .ok()
            .and_then(|job| job["tenant"].as_str().map(str::to_owned))
            .filter(|t| valid_tenant(t))
            .unwrap_or_else(|| DEFAULT_TENANT.to_owned());
        // Without its message id: the duplicate window would drop it.
        let kept = super::lanes::without_msg_id(&msg.headers);
        let published = match js
            .publish_with_headers(subjects.chat_submit(&tenant), kept, msg.payload.clone())
            .await
        {
            Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        if let Err(e) = published {
            warn!(seq = msg.sequence, error = %e, "cannot move a chat job off the untenanted submit subject; trying at the next start");
            return;
        }
        if let Err(e) = stream.delete_message(msg.sequence).await {
            warn!(seq = msg.sequence, error = %e, "a chat job moved off the untenanted submit subject could not be removed there; whichever copy is claimed first runs, the other is refused as a duplicate");
        }
        info!(seq = msg.sequence, %tenant, "chat job moved off the untenanted submit subject");
    }
}
