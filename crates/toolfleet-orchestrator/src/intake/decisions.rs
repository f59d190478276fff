//! Decisions on parked invocations: the decisions consumer's handler
//! applies each decision to its parked record, and the one that decides a
//! turn's last held call resumes the invocation — holding the decision
//! message as a run holds its chat job.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind, kv};
use toolfleet_protocol::ChatEventBody;
use toolfleet_protocol::approval::Decision;
use toolfleet_service::telemetry;
use toolfleet_store::InvocationKey;
use tracing::{Instrument, warn};

use super::Plugins;
use super::claim::{
    CLAIM_RETRY_DELAY, Claimed, Delivery, LEASE_TTL, ack, answer_finished, claim_patiently,
    give_back, new_holder,
};
use super::run::{Leg, Taken, chat_job_span, run};
use crate::approvals::Parked;
use crate::failure::ChatErrorCode;
use crate::{Events, Fleet};

/// Deliveries of the decision that resumes a parked invocation before it
/// is ended with an error (they also count the times the stores did not
/// answer, so more than a chat job's).
const MAX_RESUME_DELIVERIES: u32 = 10;

/// Resumes a parked invocation whose held calls are all decided, holding
/// the decision message `msg` that decided the last one as a run holds
/// its chat job: claimed under the chat job's claim, leased, kept alive
/// with in-progress acks, acked after its terminal event (or its next
/// park).
async fn resume(fleet: &Arc<Fleet>, plugins: &Plugins, msg: jetstream::Message, parked: Parked) {
    let started = Instant::now();
    let delivery = Delivery::of(&msg);
    let holder = new_holder();
    let Some(leased) = claim_parked(fleet, &msg, &parked, &holder).await else {
        return;
    };
    let id = &parked.job.invocation_id;
    let span = chat_job_span(id, &parked.tenant, delivery.attempt);
    span.record("resumed", true);
    telemetry::continue_trace(&span, parked.job.traceparent.as_deref());
    if delivery.attempt > MAX_RESUME_DELIVERIES {
        return give_up(fleet, &msg, &parked, delivery).await;
    }
    let taken = Taken {
        msg,
        delivery,
        holder,
        started,
        leased,
    };
    run(fleet, plugins, taken, Leg::Resume(Box::new(parked)))
        .instrument(span)
        .await
}

/// Claims the parked invocation for a resumed run; when it may go on, the
/// time its lease counts from (otherwise the decision was settled here:
/// acked, or given back).
async fn claim_parked(
    fleet: &Fleet,
    msg: &jetstream::Message,
    parked: &Parked,
    holder: &str,
) -> Option<super::claim::Leased> {
    let id = &parked.job.invocation_id;
    let inv = InvocationKey::new(&parked.tenant, id);
    let held_until =
        toolfleet_protocol::now_ms() + parked.remaining_ms + LEASE_TTL.as_millis() as u64;
    match claim_patiently(fleet, msg, inv, &parked.owner, holder, held_until).await {
        Claimed::Ours(leased) => {
            // Read again under the lease: another decision's run may have
            // resumed (and parked again, or ended) while this one waited.
            let current = fleet.parked(&parked.tenant, id).await;
            let same =
                matches!(&current, Ok(Some((p, _))) if p.park_id == parked.park_id && p.decided());
            if !same {
                let _ = fleet.store.release_lease(inv, holder).await;
                if current.is_err() {
                    let _ = msg.ack_with(AckKind::Nak(Some(CLAIM_RETRY_DELAY))).await;
                } else {
                    ack(msg).await;
                }
            }
            same.then_some(leased)
        }
        Claimed::Finished => {
            // Ended before: this decision's ack was lost, or the stream
            // never confirmed the terminal event. Nothing to resume.
            fleet.forget_parked(&parked.tenant, id).await;
            answer_finished(fleet, msg, inv).await;
            None
        }
        Claimed::Other(_) => {
            // The id was taken by another job: nothing to resume.
            fleet.forget_parked(&parked.tenant, id).await;
            ack(msg).await;
            None
        }
        unclaimed @ (Claimed::Unknown(_) | Claimed::Held(_)) => {
            give_back(msg, id, unclaimed).await;
            None
        }
    }
}

/// Ends a parked invocation whose resuming decision was delivered too
/// often without finishing, rather than try forever.
async fn give_up(fleet: &Fleet, msg: &jetstream::Message, parked: &Parked, delivery: Delivery) {
    let id = &parked.job.invocation_id;
    let events = Events::start_at(
        fleet.client.clone(),
        &fleet.config.subjects,
        &parked.tenant,
        id,
        parked.next_seq,
    );
    events.finish(ChatEventBody::Error {
        code: ChatErrorCode::TooManyAttempts.to_string(),
        message: format!(
            "the decision that resumes the invocation was delivered {} times without the invocation finishing (orchestrators stopped while running it, or the stores did not answer)",
            delivery.attempt
        ),
        retry_after_ms: None,
    });
    if let Some(terminal) = events.close().await
        && let Err(e) = fleet
            .store
            .finish(
                InvocationKey::new(&parked.tenant, id),
                &parked.owner,
                &terminal,
            )
            .await
    {
        warn!(invocation_id = %id, error = %e, "cannot mark the invocation finished");
    }
    fleet.forget_parked(&parked.tenant, id).await;
    fleet.metrics.chat_jobs.with_label_values(&["error"]).inc();
    let _ = msg.ack_with(AckKind::Term).await;
}

/// How long a decision that cannot be applied (the bucket does not
/// answer) waits before it is delivered again.
const RETRY_DELAY: Duration = Duration::from_secs(2);

/// Applies one decision from the stream; resumes the invocation when it
/// decided the last held call.
pub(crate) async fn handle_decision(
    fleet: &Arc<Fleet>,
    plugins: &Plugins,
    msg: jetstream::Message,
) {
    let decision: Decision = match serde_json::from_slice(&msg.payload) {
        Ok(d) => d,
        Err(e) => {
            warn!(error = %e, subject = %msg.subject, "a message on the decisions stream is not a decision; dropped");
            let _ = msg.ack_with(AckKind::Term).await;
            return;
        }
    };
    let tenant = msg
        .subject
        .as_str()
        .rsplit('.')
        .next()
        .unwrap_or_default()
        .to_string();
    let id = decision.invocation_id.clone();
    loop {
        let (mut parked, revision) = match fleet.parked(&tenant, &id).await {
            Ok(Some(found)) => found,
            Ok(None) => {
                // Ended already (this decision came late, or twice).
                let _ = msg.ack_with(AckKind::Ack).await;
                return;
            }
            Err(e) => {
                warn!(invocation_id = %id, error = %e, "cannot read the parked invocation; the decision will be delivered again");
                let _ = msg.ack_with(AckKind::Nak(Some(RETRY_DELAY))).await;
                return;
            }
        };
        if parked.tenant != tenant {
            let _ = msg.ack_with(AckKind::Ack).await;
            return;
        }
        if parked.park_id != decision.park_id {
            // A decision on an earlier parking. If the run it resumed
            // parked again, that run may have died before its requests
            // went out: say them again.
            if parked.resumed_from.as_deref() == Some(decision.park_id.as_str()) {
                parked.announce_again(fleet).await;
            }
            let _ = msg.ack_with(AckKind::Ack).await;
            return;
        }
        let (decided, changed) = parked.apply(&decision);
        if changed {
            let value = match serde_json::to_vec(&parked) {
                Ok(v) => v,
                Err(_) => return,
            };
            match fleet.update_parked(&tenant, &id, value, revision).await {
                // Counted here, once: the write that decided them.
                Ok(_) => {
                    for (outcome, waited_ms) in decided {
                        fleet
                            .metrics
                            .approvals
                            .with_label_values(&[outcome.as_str()])
                            .inc();
                        fleet
                            .metrics
                            .approval_wait
                            .with_label_values(&[outcome.as_str()])
                            .observe(waited_ms as f64 / 1000.0);
                    }
                }
                // Another decision was written in between: read it again.
                Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => continue,
                Err(e) => {
                    warn!(invocation_id = %id, error = %e, "cannot write the decision; it will be delivered again");
                    let _ = msg.ack_with(AckKind::Nak(Some(RETRY_DELAY))).await;
                    return;
                }
            }
        }
        if !parked.decided() {
            let _ = msg.ack_with(AckKind::Ack).await;
            return;
        }
        resume(fleet, plugins, msg, parked).await;
        return;
    }
}
