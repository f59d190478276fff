//! Approval requests: a decision is a core NATS request on
//! `<p>.chat.approve.<tenant>.<inv>`, answered by one orchestrator of the
//! queue group — checked against the parked record (unknown invocation or
//! call, already decided: a clear refusal, nothing changes) and recorded
//! on the decisions stream.

use std::sync::Arc;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::approval::{Approval, ApprovalReply, Decision, DecisionKind};
use toolfleet_protocol::now_ms;
use tracing::{info, warn};

use super::{CallState, Parked};
use crate::Fleet;

/// Answers approval requests (one queue group across orchestrators) until
/// `shutdown`.
pub(crate) async fn serve(
    fleet: Arc<Fleet>,
    mut requests: async_nats::Subscriber,
    shutdown: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = requests.next() => match m { Some(m) => m, None => break },
        };
        let fleet = fleet.clone();
        tokio::spawn(async move {
            let reply = answer(&fleet, &msg).await;
            if let Some(code) = &reply.code {
                fleet
                    .metrics
                    .approvals_refused
                    .with_label_values(&[code.as_str()])
                    .inc();
            }
            if let Some(to) = msg.reply {
                let body = serde_json::to_vec(&reply).unwrap_or_default();
                let _ = fleet.client.publish(to, body.into()).await;
            }
        });
    }
}

/// Checks one approval request against the parked record and records it.
async fn answer(fleet: &Fleet, msg: &async_nats::Message) -> ApprovalReply {
    let Some((tenant, id)) = fleet.config.subjects.parse_approve(msg.subject.as_str()) else {
        return ApprovalReply::refused(
            "malformed_approval",
            "the subject names no valid tenant and invocation id",
        );
    };
    let approval = match Approval::decode(&msg.payload) {
        Ok(a) => a,
        Err(e) => {
            return ApprovalReply::refused(
                "malformed_approval",
                format!("not an approval (schemas/approval.schema.json): {e}"),
            );
        }
    };
    let unknown = || {
        ApprovalReply::refused(
            "unknown_invocation",
            format!("no invocation {id} of tenant {tenant} is waiting for an approval"),
        )
    };
    let parked = match fleet.parked(tenant, id).await {
        Ok(Some((p, _))) => p,
        Ok(_) => return unknown(),
        Err(e) => {
            warn!(invocation_id = id, error = %e, "cannot read a parked invocation");
            return ApprovalReply::refused(
                "unavailable",
                "the parked invocations cannot be read just now; send it again",
            );
        }
    };
    if let Err(refused) = decidable(&parked, &approval, id) {
        return refused;
    }
    let decision = Decision {
        invocation_id: id.to_string(),
        park_id: parked.park_id.clone(),
        kind: DecisionKind::Call {
            call_id: approval.call_id.clone(),
            decision: approval.decision,
            reason: approval.reason,
            approver: approval.approver,
        },
        at_ms: now_ms(),
    };
    match fleet.record_decision(tenant, &decision).await {
        Ok(true) => {
            info!(invocation_id = id, call_id = %approval.call_id, decision = ?approval.decision, "approval recorded");
            ApprovalReply::ok()
        }
        Ok(false) => ApprovalReply::refused(
            "already_decided",
            format!(
                "call {} was already decided (another decision on it came first)",
                approval.call_id
            ),
        ),
        Err(e) => {
            warn!(invocation_id = id, error = %e, "cannot record an approval");
            ApprovalReply::refused(
                "unavailable",
                "the decision could not be recorded just now; send it again",
            )
        }
    }
}

/// Whether `approval` may decide a call of `parked` (of invocation `id`):
/// the call is held, not decided, and its time is not up.
fn decidable(parked: &Parked, approval: &Approval, id: &str) -> Result<(), ApprovalReply> {
    let Some(call) = parked.calls.iter().find(|c| c.call.id == approval.call_id) else {
        return Err(ApprovalReply::refused(
            "unknown_call",
            format!(
                "invocation {id} holds no call {} (waiting: {})",
                approval.call_id,
                parked
                    .held()
                    .map(|c| c.call.id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    };
    match &call.state {
        CallState::Held if parked.cancelled => Err(ApprovalReply::refused(
            "already_decided",
            format!("invocation {id} was cancelled"),
        )),
        CallState::Held if now_ms() >= parked.expires_at_ms => Err(ApprovalReply::refused(
            "already_decided",
            format!("the approval of call {} timed out", approval.call_id),
        )),
        CallState::Held => Ok(()),
        CallState::Decided { outcome, .. } => Err(ApprovalReply::refused(
            "already_decided",
            format!(
                "call {} was already decided: {}",
                approval.call_id,
                outcome.as_str()
            ),
        )),
        CallState::Done { .. } | CallState::After => Err(ApprovalReply::refused(
            "unknown_call",
            format!("call {} needs no approval", approval.call_id),
        )),
    }
}
