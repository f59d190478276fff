//! Approvals: a person's yes before a risky tool runs, as a durable pause.
//!
//! A call needs approval when its definition sets `requiresApproval` or
//! the profile lists the tool in `require_approval`. When the model calls
//! such a tool, the round's other calls run, and the orchestrator
//! ([`Ending::Parked`](crate::Ending)) hands the frame a
//! [`Park`]. The frame keeps the whole invocation — conversation, offered
//! tools, usage, citations, the held turn, the loop's own state, the
//! deadline left — as a [`Parked`] record in the parked bucket
//! (`<P>_PARKED`, key = invocation id), publishes `approval_requested` per
//! held call, acks the chat job and ends the run. No task, lease or
//! connection waits for the person. The record is keyed by tenant and
//! invocation id (`<tenant>.<inv>`), and keeps no webhook URL: a job's own
//! webhook is sealed ([`seal`]), a configured sink is the profile's.
//!
//! A decision is a core NATS request on
//! `<p>.chat.approve.<tenant>.<inv>`, answered by one orchestrator of the
//! queue group ([`requests::serve`]): checked against the record (unknown
//! invocation or call, already decided: a clear refusal, nothing changes)
//! and recorded as a [`Decision`] on the decisions stream (`<P>_DECISIONS`,
//! a work queue), whose message id makes the first decision on a call the
//! one that counts. The orchestrator that takes a decision from the stream
//! (intake's decisions consumer) writes it into the record (compare-and-set on the
//! entry's revision) and, when it was the turn's last, resumes the
//! invocation while holding the decision message — the same claim, lease,
//! in-progress acks and ack-after-the-terminal-event as a chat job, so an
//! orchestrator that dies while resuming leaves the message to be
//! delivered again to another.
//!
//! Every orchestrator watches the bucket ([`watch::watch_parked`]) and publishes a
//! timeout decision for a record whose approval timeout has passed; a
//! cancel of a parked invocation becomes a cancel decision. Both resume
//! the invocation only to end it (`approval_timeout`, `cancelled`).

pub mod requests;
pub(crate) mod seal;
pub mod store;
pub mod watch;

use serde::{Deserialize, Serialize};
use serde_json::Value;
use toolfleet_llm::{Message, ToolCall};
use toolfleet_protocol::approval::{ApprovalDecision, ApprovalOutcome, Decision, DecisionKind};
use toolfleet_protocol::{ChatEventBody, ChatJob, now_ms};

use crate::invocation::Citations;
use crate::{Events, Fleet, Invocation, ToolOutcome, UsageLedger};

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
        tool: Option<&std::sync::Arc<toolfleet_protocol::tools::CompiledTool>>,
        call: ToolCall,
        ran: Option<ToolOutcome>,
        hold: Hold,
    ) -> Self {
        let shown_arguments = match (tool, serde_json::from_str::<Value>(&call.arguments)) {
            (Some(t), Ok(v)) => crate::text::redact(&v, &t.definition.sensitive_arguments),
            (_, Ok(v)) => v,
            (_, Err(_)) => Value::String(format!("[{} characters]", call.arguments.len())),
        };
        let state = match (ran, hold) {
            (Some(outcome), _) => CallState::Done { outcome },
            (None, Hold::Person) => CallState::Held,
            (None, Hold::After) => CallState::After,
            (None, Hold::Run | Hold::Refuse) => CallState::Done {
                outcome: ToolOutcome::no_result(),
            },
        };
        Self {
            tool: tool.map_or_else(|| call.name.clone(), |t| t.definition.id.to_string()),
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

    pub(crate) fn held(&self) -> bool {
        matches!(self.state, CallState::Held)
    }
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

/// For each of the turn's calls, whether it must wait, given the tool
/// each call resolved to (dispatch's `resolve_tool`: offered,
/// permitted, or one whose worker joined late — the very tool dispatch
/// then runs): its tool requires approval under the invocation's rules
/// (the profile's, and a nested job's caller's). Calls over the per-turn
/// cap are never run, so they wait for nobody; without parallel calls, the
/// calls after a held one wait too.
pub(crate) fn held_calls(
    inv: &Invocation,
    tools: &[Option<&std::sync::Arc<toolfleet_protocol::tools::CompiledTool>>],
) -> Vec<Hold> {
    let policy = inv.profile.profile.policy;
    let mut held_before = false;
    tools
        .iter()
        .enumerate()
        .map(|(i, tool)| {
            if i >= policy.max_calls_per_turn {
                return Hold::Run;
            }
            let needs = tool.is_some_and(|t| inv.profile.profile.requires_approval(&t.definition));
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

/// The secret that signs jobs' own webhooks, from the orchestrator's
/// environment: also what seals them in parked records.
fn job_webhook_secret(fleet: &Fleet) -> Option<String> {
    let settings = &fleet.config.sinks;
    fleet
        .config
        .env
        .var(&settings.default_secret_env)
        .filter(|s| !s.is_empty())
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
    /// The chat job, as it ran (tenant and traceparent set), but for its
    /// own webhook's URL, which is only in [`Parked::sealed_webhook`].
    pub job: ChatJob,
    /// The job's own webhook URL, sealed ([`seal`]): opened again when the
    /// invocation resumes. Never the URL itself.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sealed_webhook: Option<String>,
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
    /// `search_tools` calls so far: a resumed run expands no further than
    /// its cap (0 in records written before it was kept).
    #[serde(default)]
    pub expansions: u32,
    /// The first request's offer, so a resumed run offers the tools in
    /// the same order (none in records written before it was kept: fixed
    /// again at the next request).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_offer: Option<crate::tools::FirstOffer>,
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
    /// owner, the deadline left and the next `seq`. The job's own webhook
    /// is sealed under the fleet's job-webhook secret, or dropped without
    /// one (see [`seal`]).
    pub(crate) fn of(fleet: &Fleet, mut inv: Invocation, park: Park) -> Self {
        let now = now_ms();
        let tenant = inv.job.tenant().to_string();
        let webhook = inv.job.sink.as_mut().and_then(|s| s.webhook.take());
        let sealed_webhook = webhook.and_then(|url| {
            let sealed = job_webhook_secret(fleet).and_then(|secret| {
                seal::seal(secret.as_bytes(), &tenant, &inv.job.invocation_id, &url)
            });
            if sealed.is_none() {
                tracing::warn!(invocation_id = %inv.job.invocation_id,
                    "the job's webhook cannot be kept while it waits for approval (no job-webhook secret): later events go to NATS only");
            }
            sealed
        });
        Parked {
            sealed_webhook,
            version: RECORD_VERSION,
            park_id: uuid::Uuid::new_v4().simple().to_string(),
            tenant,
            owner: String::new(),
            profile: inv.profile.name.clone(),
            deployment: inv.profile.deployment_name.clone(),
            agent_depth: inv.agent_depth,
            offered: inv.tool_ids(),
            expansions: inv.scope.expansions,
            first_offer: inv.scope.first_offer,
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

    /// The chat job as it was submitted: its own webhook opened again from
    /// [`Parked::sealed_webhook`] (and left out when it cannot be: the
    /// secret changed).
    pub(crate) fn unsealed_job(&self, fleet: &Fleet) -> ChatJob {
        let mut job = self.job.clone();
        if let Some(sealed) = &self.sealed_webhook {
            let url = job_webhook_secret(fleet).and_then(|secret| {
                seal::open(secret.as_bytes(), &self.tenant, &job.invocation_id, sealed)
            });
            if url.is_none() {
                tracing::warn!(invocation_id = %job.invocation_id,
                    "the job's sealed webhook does not open (the job-webhook secret changed): its events go to NATS only");
            }
            if let Some(sink) = job.sink.as_mut() {
                sink.webhook = url;
            }
        }
        if job
            .sink
            .as_ref()
            .is_some_and(|s| s.webhook.is_none() && s.relay.is_none())
        {
            job.sink = None;
        }
        job
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

    pub(crate) fn held(&self) -> impl Iterator<Item = &ParkedCall> {
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
    pub(crate) fn apply(&mut self, decision: &Decision) -> (Vec<(ApprovalOutcome, u64)>, bool) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Parked {
        Parked {
            version: RECORD_VERSION,
            park_id: "p1".into(),
            job: toolfleet_protocol::client::question("hi"),
            sealed_webhook: None,
            tenant: "default".into(),
            owner: "o".into(),
            profile: "default".into(),
            deployment: "d".into(),
            agent_depth: 0,
            messages: Vec::new(),
            offered: vec!["t:b@1.0.0".into(), "t:a@1.0.0".into()],
            expansions: 2,
            first_offer: Some(crate::tools::FirstOffer {
                tools: 1,
                search_tools: true,
            }),
            usage: UsageLedger::default(),
            citations: Citations::default(),
            remaining_ms: 1,
            next_seq: 1,
            parked_at_ms: 1,
            expires_at_ms: 2,
            model_call_ids: Vec::new(),
            calls: Vec::new(),
            state: Value::Null,
            cancelled: false,
            resumed_from: None,
        }
    }

    /// A record keeps the `search_tools` rounds spent and the first
    /// request's offer; one written before they were kept still reads
    /// (none spent, the offer fixed again at the next request).
    #[test]
    fn a_record_keeps_the_spent_expansions_and_the_first_offer_and_an_older_one_reads() {
        let mut value = serde_json::to_value(record()).expect("serialise");
        assert_eq!(value["expansions"], 2);
        assert_eq!(
            value["firstOffer"],
            serde_json::json!({"tools": 1, "searchTools": true})
        );
        let back: Parked = serde_json::from_value(value.clone()).expect("reads");
        assert_eq!(
            (back.expansions, back.first_offer),
            (2, record().first_offer)
        );
        let object = value.as_object_mut().expect("an object");
        object.remove("expansions");
        object.remove("firstOffer");
        let older: Parked = serde_json::from_value(value).expect("an older record reads");
        assert_eq!((older.expansions, older.first_offer), (0, None));
    }
}
