//! Approvals: a person's yes before a risky tool runs, as a durable pause.
//!
//! A call needs approval when its definition sets `requiresApproval` or
//! the profile lists the tool in `require_approval`. When the model calls
//! such a tool, the round's other calls run, and the orchestrator
//! ([`Ending::Parked`](crate::orchestrator::Ending)) hands the frame a
//! [`Park`]. The frame keeps the whole invocation — conversation, offered
//! tools, usage, citations, the held turn, the loop's own state, the
//! deadline left — as a [`Parked`] record in the parked bucket
//! (`<P>_PARKED`, key = invocation id), publishes `approval_requested` per
//! held call, acks the chat job and ends the run. No task, lease or
//! connection waits for the person.
//!
//! A decision is a core NATS request on
//! `<p>.chat.approve.<tenant>.<inv>`, answered by one orchestrator of the
//! queue group ([`serve_requests`]): checked against the record (unknown
//! invocation or call, already decided: a clear refusal, nothing changes)
//! and recorded as a [`Decision`] on the decisions stream (`<P>_DECISIONS`,
//! a work queue), whose message id makes the first decision on a call the
//! one that counts. The orchestrator that takes a decision from the stream
//! ([`handle_decision`]) writes it into the record (compare-and-set on the
//! entry's revision) and, when it was the turn's last, resumes the
//! invocation while holding the decision message — the same claim, lease,
//! in-progress acks and ack-after-the-terminal-event as a chat job, so an
//! orchestrator that dies while resuming leaves the message to be
//! delivered again to another.
//!
//! Every orchestrator watches the bucket ([`watch_parked`]) and publishes a
//! timeout decision for a record whose approval timeout has passed; a
//! cancel of a parked invocation becomes a cancel decision. Both resume
//! the invocation only to end it (`approval_timeout`, `cancelled`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind, kv};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use toolfleet_llm::{Message, ToolCall};
use toolfleet_protocol::approval::{
    Approval, ApprovalDecision, ApprovalOutcome, ApprovalReply, Decision, DecisionKind,
};
use toolfleet_protocol::{ChatEventBody, ChatJob, ToolStatus, now_ms};
use tracing::{info, warn};

use crate::context::Citations;
use crate::{Events, Failure, Fleet, Invocation, ToolOutcome, UsageLedger};

/// What an orchestrator hands the frame when calls of its turn wait for
/// approval.
#[derive(Debug)]
pub struct Park {
    /// The model's ids of the turn's calls, in order (what the tool
    /// messages answer when the turn resumes).
    pub model_call_ids: Vec<String>,
    /// The turn's calls, with our ids, in the model's order.
    pub calls: Vec<ParkedCall>,
    /// The orchestrator's own state, given back to
    /// [`Orchestrator::resume`](crate::Orchestrator::resume).
    pub state: Value,
}

/// What [`Orchestrator::resume`](crate::Orchestrator::resume) goes on
/// from: the parked turn, every held call decided.
#[derive(Debug)]
pub struct Resumed {
    pub model_call_ids: Vec<String>,
    pub calls: Vec<ParkedCall>,
    pub state: Value,
}

/// One call of a parked turn.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ParkedCall {
    /// The call, with the fleet's call id.
    pub call: ToolCall,
    /// The tool's id (`ns:name@x.y.z`), or the name the model used.
    pub tool: String,
    /// The arguments as events show them (`sensitiveArguments` redacted).
    pub shown_arguments: Value,
    pub state: CallState,
}

/// Where a call of a parked turn stands.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum CallState {
    /// It needed no approval and ran (or was answered) before the park.
    Done { outcome: ToolOutcome },
    /// It waits for a person.
    Held,
    /// It waits for an earlier call of the turn (calls run one at a
    /// time); it runs when the turn resumes.
    After,
    /// A person (or the timeout) decided.
    #[serde(rename_all = "camelCase")]
    Decided {
        outcome: ApprovalOutcome,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        approver: Option<String>,
        at_ms: u64,
    },
}

impl ParkedCall {
    /// A call of a turn that parks: `ran` is its outcome when it ran,
    /// `held` the reason it waits when it needs approval.
    pub(crate) fn new(
        inv: &Invocation,
        call: ToolCall,
        ran: Option<ToolOutcome>,
        hold: Hold,
    ) -> Self {
        let tool = resolve(inv, &call.name);
        let shown_arguments = match (tool, serde_json::from_str::<Value>(&call.arguments)) {
            (Some(t), Ok(v)) => crate::dispatch::redact(&v, &t.definition.sensitive_arguments),
            (_, Ok(v)) => v,
            (_, Err(_)) => Value::String(format!("[{} characters]", call.arguments.len())),
        };
        let state = match (ran, hold) {
            (Some(outcome), _) => CallState::Done { outcome },
            (None, Hold::Person) => CallState::Held,
            (None, Hold::After) => CallState::After,
            (None, Hold::Run | Hold::Refuse) => CallState::Done {
                outcome: ToolOutcome {
                    content: "Error: the call got no result.".into(),
                    status: ToolStatus::Error,
                    references: Vec::new(),
                },
            },
        };
        Self {
            tool: tool_name(inv, &call),
            shown_arguments,
            call,
            state,
        }
    }

    /// Whether it runs when the turn resumes: a person approved it, or it
    /// waited for an earlier call.
    pub fn runs_on_resume(&self) -> bool {
        matches!(
            self.state,
            CallState::After
                | CallState::Decided {
                    outcome: ApprovalOutcome::Approved,
                    ..
                }
        )
    }

    fn held(&self) -> bool {
        matches!(self.state, CallState::Held)
    }
}

/// What events and metrics call `call`'s tool: its id, or the name the
/// model used when no offered or permitted tool has it.
pub(crate) fn tool_name(inv: &Invocation, call: &ToolCall) -> String {
    resolve(inv, &call.name).map_or_else(|| call.name.clone(), |t| t.definition.id.to_string())
}

/// The offered or permitted tool the model calls by `name`.
fn resolve<'a>(
    inv: &'a Invocation,
    name: &str,
) -> Option<&'a Arc<toolfleet_protocol::tools::CompiledTool>> {
    inv.tool(name)
        .or_else(|| inv.scope.permitted.by_function_name(name))
}

/// What happens to one call of a turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Hold {
    /// It runs now.
    Run,
    /// It waits for a person.
    Person,
    /// It needs no approval, but calls run one at a time and an earlier
    /// one waits: it runs after that one is decided.
    After,
    /// It needs approval, and an agent tool's nested job cannot wait for
    /// one: answered without running.
    Refuse,
}

/// For each of the turn's calls (our ids), whether it must wait: its tool
/// (offered, or permitted) requires approval under the invocation's
/// profile. Calls over the per-turn cap are never run, so they wait for
/// nobody; without parallel calls, the calls after a held one wait too.
pub(crate) fn held_calls(inv: &Invocation, calls: &[ToolCall]) -> Vec<Hold> {
    let policy = inv.profile.profile.policy;
    let mut held_before = false;
    calls
        .iter()
        .enumerate()
        .map(|(i, call)| {
            if i >= policy.max_calls_per_turn {
                return Hold::Run;
            }
            let needs = resolve(inv, &call.name)
                .is_some_and(|t| inv.profile.profile.requires_approval(&t.definition));
            let hold = match (needs, inv.agent_depth > 0) {
                (true, true) => Hold::Refuse,
                (true, false) => Hold::Person,
                (false, _) if held_before && !policy.parallel_tool_calls => Hold::After,
                (false, _) => Hold::Run,
            };
            held_before |= hold == Hold::Person;
            hold
        })
        .collect()
}

/// What the model reads for a call an agent tool's nested job cannot wait
/// for.
pub(crate) const REFUSED_IN_AGENT: &str = "Not run: this tool needs a person's approval, and a job started by an agent tool cannot wait for one. Answer with what you have, or say that the caller should run it.";

/// What the model reads for a denied call.
pub(crate) fn denied_message(reason: Option<&str>) -> String {
    match reason.map(str::trim).filter(|r| !r.is_empty()) {
        Some(r) => format!(
            "Not run: a person denied this call. Their reason: {r}. Do not call it again with the same arguments; answer with what you have, or ask the user."
        ),
        None => "Not run: a person denied this call. Do not call it again with the same arguments; answer with what you have, or ask the user.".to_string(),
    }
}

/// The version of [`Parked`] records this release writes and reads.
const RECORD_VERSION: u32 = 1;

/// A parked invocation, as kept in the parked bucket.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Parked {
    pub version: u32,
    /// This parking of the invocation (it may park again after resuming).
    pub park_id: String,
    /// The chat job, as it ran (tenant and traceparent set).
    pub job: ChatJob,
    pub tenant: String,
    /// The claim owner of the chat job: the resumed run speaks for the
    /// invocation under the same claim.
    pub owner: String,
    pub profile: String,
    /// The deployment the conversation was on (after any fallback).
    pub deployment: String,
    pub agent_depth: u32,
    pub messages: Vec<Message>,
    /// The offered tools' ids.
    pub offered: Vec<String>,
    pub usage: UsageLedger,
    pub citations: Citations,
    /// Of the invocation's deadline, what was left when it parked: the
    /// wait for a person does not count.
    pub remaining_ms: u64,
    /// The `seq` its next event gets.
    pub next_seq: u64,
    pub parked_at_ms: u64,
    pub expires_at_ms: u64,
    pub model_call_ids: Vec<String>,
    pub calls: Vec<ParkedCall>,
    /// The orchestrator's own state.
    pub state: Value,
    #[serde(default)]
    pub cancelled: bool,
    /// The parking this one came from, when a resumed run parked again
    /// (a redelivery of the decision that resumed it finds this one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resumed_from: Option<String>,
}

impl Parked {
    /// The record of `inv` parking with `park`; intake fills in the claim
    /// owner, the deadline left and the next `seq`.
    pub(crate) fn of(inv: Invocation, park: Park) -> Self {
        let now = now_ms();
        let tenant = inv.job.tenant().to_string();
        Parked {
            version: RECORD_VERSION,
            park_id: uuid::Uuid::new_v4().simple().to_string(),
            tenant,
            owner: String::new(),
            profile: inv.profile.name.clone(),
            deployment: inv.profile.deployment_name.clone(),
            agent_depth: inv.agent_depth,
            offered: inv.tool_ids(),
            messages: inv.messages,
            usage: inv.usage,
            citations: inv.citations,
            remaining_ms: 0,
            next_seq: 0,
            parked_at_ms: now,
            expires_at_ms: now + inv.profile.profile.approval_timeout_ms,
            model_call_ids: park.model_call_ids,
            calls: park.calls,
            state: park.state,
            cancelled: false,
            resumed_from: None,
            job: inv.job,
        }
    }

    /// Publishes its `approval_requested` events again, with the `seq`s
    /// they had: a run that parked and died before (or while) publishing
    /// them, or before its ack, left them unsaid.
    pub(crate) async fn announce_again(&self, fleet: &Fleet) {
        let requests = self.requests(fleet);
        let events = Events::start_at(
            fleet.client.clone(),
            &fleet.config.subjects,
            &self.tenant,
            &self.job.invocation_id,
            self.next_seq.saturating_sub(requests.len() as u64),
        );
        for request in requests {
            events.send(request);
        }
        events.close().await;
    }

    fn held(&self) -> impl Iterator<Item = &ParkedCall> {
        self.calls.iter().filter(|c| c.held())
    }

    /// Whether nothing is left to decide.
    pub(crate) fn decided(&self) -> bool {
        self.cancelled || !self.calls.iter().any(ParkedCall::held)
    }

    /// The `approval_requested` events of the held calls.
    pub(crate) fn requests(&self, fleet: &Fleet) -> Vec<ChatEventBody> {
        let subject = fleet
            .config
            .subjects
            .chat_approve(&self.tenant, &self.job.invocation_id);
        self.held()
            .map(|c| ChatEventBody::ApprovalRequested {
                call_id: c.call.id.clone(),
                tool: c.tool.clone(),
                arguments: c.shown_arguments.clone(),
                expires_at_ms: self.expires_at_ms,
                subject: subject.clone(),
            })
            .collect()
    }

    /// Writes `decision` in; returns what it decided (each call's outcome
    /// and how long it waited), and whether anything changed.
    fn apply(&mut self, decision: &Decision) -> (Vec<(ApprovalOutcome, u64)>, bool) {
        let waited = decision.at_ms.saturating_sub(self.parked_at_ms);
        let decide =
            |call: &mut ParkedCall, outcome, reason: &Option<String>, approver: &Option<String>| {
                call.state = CallState::Decided {
                    outcome,
                    reason: reason.clone(),
                    approver: approver.clone(),
                    at_ms: decision.at_ms,
                };
                (outcome, waited)
            };
        match &decision.kind {
            DecisionKind::Call {
                call_id,
                decision: d,
                reason,
                approver,
            } => {
                let Some(call) = self
                    .calls
                    .iter_mut()
                    .find(|c| &c.call.id == call_id && c.held())
                else {
                    return (Vec::new(), false);
                };
                let outcome = match d {
                    ApprovalDecision::Approve => ApprovalOutcome::Approved,
                    ApprovalDecision::Deny => ApprovalOutcome::Denied,
                };
                (vec![decide(call, outcome, reason, approver)], true)
            }
            DecisionKind::Timeout => {
                let decided: Vec<_> = self
                    .calls
                    .iter_mut()
                    .filter(|c| c.held())
                    .map(|c| decide(c, ApprovalOutcome::Timeout, &None, &None))
                    .collect();
                let changed = !decided.is_empty();
                (decided, changed)
            }
            DecisionKind::Cancel => (Vec::new(), !std::mem::replace(&mut self.cancelled, true)),
        }
    }
}

/// The bucket and stream approvals live in, made at an orchestrator's
/// start.
pub(crate) struct Approvals {
    pub(crate) bucket: kv::Store,
}

impl Approvals {
    pub(crate) async fn open(
        js: &jetstream::Context,
        subjects: &toolfleet_protocol::Subjects,
    ) -> Result<
        (
            Self,
            jetstream::consumer::Consumer<jetstream::consumer::pull::Config>,
        ),
        String,
    > {
        let bucket = toolfleet_protocol::streams::parked_bucket(js, subjects)
            .await
            .map_err(|e| e.to_string())?;
        let stream = toolfleet_protocol::streams::ensure_decisions_stream(js, subjects)
            .await
            .map_err(|e| e.to_string())?;
        let consumer = stream
            .get_or_create_consumer(
                &subjects.chat_consumer(),
                jetstream::consumer::pull::Config {
                    durable_name: Some(subjects.chat_consumer()),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: crate::intake::CHAT_ACK_WAIT,
                    // A decision is never given up by the server (it would
                    // leave its invocation parked for good): the resumed
                    // run counts its own attempts.
                    max_deliver: -1,
                    max_ack_pending: 10_000,
                    ..Default::default()
                },
            )
            .await
            .map_err(|e| format!("decisions consumer: {e}"))?;
        Ok((Self { bucket }, consumer))
    }
}

impl Fleet {
    fn approvals(&self) -> &Approvals {
        &self.approvals
    }

    /// Keeps `parked` in the bucket (a new record, or the invocation's
    /// earlier one replaced: the run writing it holds the lease).
    pub(crate) async fn keep_parked(&self, parked: &Parked) -> Result<(), String> {
        let value = serde_json::to_vec(parked).map_err(|e| e.to_string())?;
        self.approvals()
            .bucket
            .put(&parked.job.invocation_id, value.into())
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }

    /// Removes the record of an invocation that ended. Best effort: a
    /// record left behind is removed by the next decision or timeout on
    /// it, or by the bucket's age limit.
    pub(crate) async fn forget_parked(&self, invocation_id: &str) {
        if let Err(e) = self.approvals().bucket.delete(invocation_id).await {
            warn!(invocation_id, error = %e, "cannot remove the parked record of an ended invocation");
        }
    }

    /// The record of `invocation_id` and its revision, if it is parked.
    pub(crate) async fn parked(
        &self,
        invocation_id: &str,
    ) -> Result<Option<(Parked, u64)>, String> {
        let entry = self
            .approvals()
            .bucket
            .entry(invocation_id)
            .await
            .map_err(|e| e.to_string())?;
        let Some(entry) = entry.filter(|e| e.operation == kv::Operation::Put) else {
            return Ok(None);
        };
        let parked: Parked = serde_json::from_slice(&entry.value)
            .map_err(|e| format!("the parked record cannot be read: {e}"))?;
        Ok(Some((parked, entry.revision)))
    }

    /// Publishes `decision` on the decisions stream; returns whether it
    /// was new (not a duplicate of one already recorded).
    async fn record_decision(&self, tenant: &str, decision: &Decision) -> Result<bool, String> {
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(
            toolfleet_protocol::headers::NATS_MSG_ID,
            decision.msg_id().as_str(),
        );
        let ack = self
            .js
            .publish_with_headers(
                self.config.subjects.chat_decision(tenant),
                headers,
                serde_json::to_vec(decision)
                    .map_err(|e| e.to_string())?
                    .into(),
            )
            .await
            .map_err(|e| e.to_string())?
            .await
            .map_err(|e| e.to_string())?;
        Ok(!ack.duplicate)
    }
}

/// Answers approval requests (one queue group across orchestrators) until
/// `shutdown`.
pub(crate) async fn serve_requests(
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
    let parked = match fleet.parked(id).await {
        Ok(Some((p, _))) if p.tenant == tenant => p,
        Ok(_) => return unknown(),
        Err(e) => {
            warn!(invocation_id = id, error = %e, "cannot read a parked invocation");
            return ApprovalReply::refused(
                "unavailable",
                "the parked invocations cannot be read just now; send it again",
            );
        }
    };
    let Some(call) = parked.calls.iter().find(|c| c.call.id == approval.call_id) else {
        return ApprovalReply::refused(
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
        );
    };
    match &call.state {
        CallState::Held if parked.cancelled => {
            return ApprovalReply::refused(
                "already_decided",
                format!("invocation {id} was cancelled"),
            );
        }
        CallState::Held => {}
        CallState::Decided { outcome, .. } => {
            return ApprovalReply::refused(
                "already_decided",
                format!(
                    "call {} was already decided: {}",
                    approval.call_id,
                    outcome.as_str()
                ),
            );
        }
        CallState::Done { .. } | CallState::After => {
            return ApprovalReply::refused(
                "unknown_call",
                format!("call {} needs no approval", approval.call_id),
            );
        }
    }
    if now_ms() >= parked.expires_at_ms {
        return ApprovalReply::refused(
            "already_decided",
            format!("the approval of call {} timed out", approval.call_id),
        );
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

/// How long a decision that cannot be applied (the bucket does not
/// answer) waits before it is delivered again.
const RETRY_DELAY: Duration = Duration::from_secs(2);

/// Applies one decision from the stream; resumes the invocation when it
/// decided the last held call.
pub(crate) async fn handle_decision(fleet: &Arc<Fleet>, msg: jetstream::Message) {
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
        let (mut parked, revision) = match fleet.parked(&id).await {
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
            match fleet
                .approvals()
                .bucket
                .update(&id, value.into(), revision)
                .await
            {
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
        crate::intake::resume(fleet, msg, parked).await;
        return;
    }
}

/// How often the parked records are checked for timeouts.
const TIMEOUT_TICK: Duration = Duration::from_secs(1);
/// How long a timeout decision that did not take effect waits before it
/// is published again.
const TIMEOUT_RETRY_MS: u64 = 30_000;
/// How long after its expiry a record is timed out: approvals accepted
/// just before the expiry are on the decisions stream by then.
const TIMEOUT_GRACE_MS: u64 = 5_000;

/// What the watcher knows of one parked record.
struct Watched {
    park_id: String,
    tenant: String,
    expires_at_ms: u64,
    /// Some call still waits (and the record is not cancelled).
    waiting: bool,
    /// When a timeout may be published (again).
    next_try_ms: u64,
}

/// Watches the parked bucket: keeps the parked gauge, and publishes a
/// timeout decision for each record past its approval timeout. Every
/// orchestrator does; the decision's message id keeps it one.
pub(crate) async fn watch_parked(fleet: Arc<Fleet>, shutdown: CancellationToken) {
    let mut known: HashMap<String, Watched> = HashMap::new();
    while !shutdown.is_cancelled() {
        let mut watch = match fleet.approvals().bucket.watch_with_history(">").await {
            Ok(w) => w,
            Err(e) => {
                warn!(error = %e, "cannot watch the parked invocations; trying again");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(2)) => continue,
                }
            }
        };
        known.clear();
        let mut tick = tokio::time::interval(TIMEOUT_TICK);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                entry = watch.next() => match entry {
                    Some(Ok(entry)) => {
                        if entry.operation == kv::Operation::Put
                            && let Ok(p) = serde_json::from_slice::<Parked>(&entry.value)
                        {
                            known.insert(entry.key.clone(), Watched {
                                waiting: !p.decided(),
                                park_id: p.park_id,
                                tenant: p.tenant,
                                expires_at_ms: p.expires_at_ms,
                                next_try_ms: 0,
                            });
                        } else {
                            known.remove(&entry.key);
                        }
                        fleet.metrics.approvals_parked.set(i64::try_from(known.len()).unwrap_or(i64::MAX));
                    }
                    Some(Err(e)) => {
                        warn!(error = %e, "the watch on the parked invocations broke; starting it again");
                        break;
                    }
                    None => break,
                },
                _ = tick.tick() => {
                    let now = now_ms();
                    for (id, w) in known.iter_mut().filter(|(_, w)| w.waiting && w.expires_at_ms + TIMEOUT_GRACE_MS <= now && w.next_try_ms <= now) {
                        w.next_try_ms = now + TIMEOUT_RETRY_MS;
                        let decision = Decision {
                            invocation_id: id.clone(),
                            park_id: w.park_id.clone(),
                            kind: DecisionKind::Timeout,
                            at_ms: now,
                        };
                        if let Err(e) = fleet.record_decision(&w.tenant, &decision).await {
                            warn!(invocation_id = %id, error = %e, "cannot record an approval timeout; trying again later");
                        }
                    }
                }
            }
        }
    }
}

/// A cancel of `invocation_id` of `tenant`: if it is parked, a cancel
/// decision ends it (every orchestrator hears a cancel; the decision's
/// message id keeps it one).
pub(crate) async fn cancel_parked(fleet: &Fleet, invocation_id: &str, tenant: &str) {
    let parked = match fleet.parked(invocation_id).await {
        Ok(Some((p, _))) if p.tenant == tenant && !p.cancelled => p,
        Ok(_) => return,
        Err(e) => {
            warn!(invocation_id, error = %e, "cannot read the parked invocations to cancel");
            return;
        }
    };
    let decision = Decision {
        invocation_id: invocation_id.to_string(),
        park_id: parked.park_id,
        kind: DecisionKind::Cancel,
        at_ms: now_ms(),
    };
    if let Err(e) = fleet.record_decision(tenant, &decision).await {
        warn!(invocation_id, error = %e, "cannot record the cancel of a parked invocation");
    }
}

/// Runs a parked invocation whose held calls are all decided: rebuilt
/// from its record, its decisions announced (`approval_resolved`, metrics);
/// a timeout or cancel ends it, otherwise its orchestrator goes on.
pub(crate) async fn resume(
    fleet: &Fleet,
    parked: Parked,
    deadline_ms: u64,
    events: &Events,
    cancel_check: &crate::context::CancelCheck,
) -> Result<crate::orchestrator::Finished, Failure> {
    // Rebuilt first, so the invocation's sinks hear the decisions and the
    // end too; an invocation that only ends needs no rebuilding to.
    let rebuilt = rebuild(fleet, &parked, deadline_ms);
    if let Ok((inv, _)) = &rebuilt
        && let Ok(Some(route)) = crate::sinks::route_for(fleet, inv)
    {
        events.route(route);
    }
    let mut timed_out = false;
    for call in &parked.calls {
        if let CallState::Decided {
            outcome,
            reason,
            approver,
            at_ms,
            ..
        } = &call.state
        {
            let waited_ms = at_ms.saturating_sub(parked.parked_at_ms);
            timed_out |= *outcome == ApprovalOutcome::Timeout;
            events.send(ChatEventBody::ApprovalResolved {
                call_id: call.call.id.clone(),
                tool: call.tool.clone(),
                decision: *outcome,
                reason: reason.clone(),
                approver: approver.clone(),
                waited_ms,
            });
        }
    }
    if parked.cancelled {
        return Err(Failure::new(
            "cancelled",
            "the invocation was cancelled while it waited for approval",
        ));
    }
    if timed_out {
        let waiting: Vec<&str> = parked
            .calls
            .iter()
            .filter(|c| {
                matches!(
                    c.state,
                    CallState::Decided {
                        outcome: ApprovalOutcome::Timeout,
                        ..
                    }
                )
            })
            .map(|c| c.tool.as_str())
            .collect();
        return Err(Failure::new(
            "approval_timeout",
            format!(
                "no approval arrived within {} s for {}",
                parked.expires_at_ms.saturating_sub(parked.parked_at_ms) / 1000,
                waiting.join(", ")
            ),
        ));
    }
    let (mut inv, resumed) = rebuilt?;
    inv.cancel_check = cancel_check.clone();
    let orchestrator = crate::orchestrator::orchestrator_of(fleet, &inv)?;
    let ending = orchestrator
        .resume(&mut inv, resumed, fleet, events)
        .await?;
    crate::orchestrator::finish(fleet, inv, ending, events)
}

/// The invocation of a parked record: the job's profile and gates
/// resolved again (on the deployment it was on), the conversation, offered
/// tools, usage and citations as they were.
fn rebuild(
    fleet: &Fleet,
    parked: &Parked,
    deadline_ms: u64,
) -> Result<(Invocation, Resumed), Failure> {
    let mut inv =
        crate::context::build(fleet, parked.job.clone(), deadline_ms, parked.agent_depth)?;
    while inv.profile.deployment_name != parked.deployment {
        match inv.profile.next_deployment("parked on a later deployment") {
            Some(next) => inv.profile = next,
            None => break,
        }
    }
    if inv.profile.deployment_name != parked.deployment {
        inv = crate::context::build(fleet, inv.job, deadline_ms, parked.agent_depth)?;
    }
    inv.messages = parked.messages.clone();
    inv.tools = parked
        .offered
        .iter()
        .filter_map(|id| {
            inv.scope
                .permitted
                .tools
                .iter()
                .find(|t| &t.definition.id.to_string() == id)
                .cloned()
        })
        .collect();
    inv.usage = parked.usage.clone();
    inv.citations = parked.citations.clone();
    let resumed = Resumed {
        model_call_ids: parked.model_call_ids.clone(),
        calls: parked.calls.clone(),
        state: parked.state.clone(),
    };
    Ok((inv, resumed))
}
