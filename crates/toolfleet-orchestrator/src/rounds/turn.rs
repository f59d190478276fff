//! One model turn's tool calls, from the completion to the tool messages:
//! a [`Turn`] holds each call with everything the turn decides about it
//! (its ids, whether it runs now, what it came to).
//!
//! Calls over the per-turn cap are answered without running;
//! `search_tools` runs first, here (it changes the tools offered from the
//! next round on); then agent tools (nested chat jobs) and worker tools —
//! together when parallel calls are on, else one at a time. A call that
//! needs a person's approval holds the turn: the others run, and the turn
//! parks (its tool messages are added when it resumes).

use toolfleet_llm::budget::TokenBudget;
use toolfleet_llm::{Completion, Message, ToolCall};
use toolfleet_protocol::ToolErrorCode;
use toolfleet_protocol::ToolStatus;

use crate::approvals::{self, CallState, Hold, ParkedCall, Resumed};
use crate::dispatch::{self, new_call_id};
use crate::tools::agents::profile_of;
use crate::tools::scoring::SEARCH_TOOLS;
use crate::{Events, Fleet, Invocation, ToolOutcome, ToolRunner};

/// One call of a model turn.
#[derive(Debug)]
pub(crate) struct TurnCall {
    /// The model's id: pairs the tool message with its call (the model's
    /// ids are not ours to trust as idempotency keys: some servers repeat
    /// them).
    pub(crate) model_id: String,
    /// The call under the fleet's own id — its job, events and citations.
    pub(crate) call: ToolCall,
    /// Whether it runs in this turn, waits, or is refused.
    pub(crate) hold: Hold,
    /// What it came to, once answered.
    pub(crate) outcome: Option<ToolOutcome>,
}

/// A model turn's calls, in the model's order.
#[derive(Debug)]
pub(crate) struct Turn {
    pub(crate) calls: Vec<TurnCall>,
}

/// What the calls of a turn came to.
pub(crate) enum Ended {
    /// Every call ran (or was answered): an outcome each, in call order.
    Ran(Vec<ToolOutcome>),
    /// Some calls wait for a person's approval; the others ran.
    Held(Vec<ParkedCall>),
}

impl Turn {
    /// The turn of `completion`'s calls, each under a fresh id of ours,
    /// with what the profile's approval rules hold.
    fn new(inv: &Invocation, completion: &Completion) -> Self {
        let ours: Vec<ToolCall> = completion
            .tool_calls
            .iter()
            .map(|c| ToolCall {
                id: new_call_id(),
                ..c.clone()
            })
            .collect();
        let holds = approvals::held_calls(inv, &ours);
        let calls = completion
            .tool_calls
            .iter()
            .zip(ours)
            .zip(holds)
            .map(|((model, call), hold)| TurnCall {
                model_id: model.id.clone(),
                call,
                hold,
                outcome: None,
            })
            .collect();
        Self { calls }
    }

    /// The turn a parked one resumes: approved calls (and those that waited
    /// for an earlier one) run; the others keep what they came to.
    pub(crate) fn resumed(resumed: &Resumed) -> Self {
        let calls = resumed
            .model_call_ids
            .iter()
            .zip(&resumed.calls)
            .map(|(model_id, parked)| TurnCall {
                model_id: model_id.clone(),
                call: parked.call.clone(),
                hold: if parked.runs_on_resume() {
                    Hold::Run
                } else {
                    Hold::Person
                },
                outcome: match &parked.state {
                    CallState::Done { outcome } => Some(outcome.clone()),
                    _ => None,
                },
            })
            .collect();
        Self { calls }
    }

    /// Whether a call waits for a person.
    fn held(&self) -> bool {
        self.calls.iter().any(|c| c.hold == Hold::Person)
    }

    /// Every call's outcome, in call order.
    pub(crate) fn outcomes(&self) -> Vec<ToolOutcome> {
        self.calls
            .iter()
            .map(|c| c.outcome.clone().unwrap_or_else(ToolOutcome::no_result))
            .collect()
    }

    /// Whether `i` runs now and has no answer yet.
    fn runs(&self, i: usize) -> bool {
        self.calls[i].hold == Hold::Run && self.calls[i].outcome.is_none()
    }
}

/// Runs the completion's tool calls and appends the assistant message and
/// one tool message per call (cut to the profile's token cap) to the
/// conversation — unless a call needs a person's approval: then the calls
/// that do not need one run, and the turn is held.
pub(crate) async fn run_calls(
    inv: &mut Invocation,
    tools: &mut ToolRunner<'_>,
    completion: &Completion,
    fleet: &Fleet,
    events: &Events,
) -> Ended {
    inv.messages.push(completion.assistant_message());
    let mut turn = Turn::new(inv, completion);
    run(inv, tools, &mut turn, fleet, events).await;
    for c in turn.calls.iter_mut().filter(|c| c.hold == Hold::Refuse) {
        let tool = inv.tool_label(&c.call.name);
        c.outcome = Some(dispatch::immediate_with(
            fleet.metrics(),
            events,
            &c.call,
            &tool,
            ToolStatus::Blocked,
            ToolErrorCode::ApprovalUnavailable.as_str(),
            approvals::REFUSED_IN_AGENT.to_string(),
        ));
    }
    if turn.held() {
        record_spent(inv, tools, fleet);
        let calls = turn
            .calls
            .into_iter()
            .map(|c| ParkedCall::new(inv, c.call, c.outcome, c.hold))
            .collect();
        return Ended::Held(calls);
    }
    let outcomes = turn.outcomes();
    after(inv, tools, &turn, fleet);
    Ended::Ran(outcomes)
}

/// What the tools of a turn spent on models is the invocation's spend too.
fn record_spent(inv: &mut Invocation, tools: &mut ToolRunner<'_>, fleet: &Fleet) {
    for call in tools.take_spent() {
        inv.usage
            .record_tool(fleet.metrics(), &fleet.config().profiles.prices, call);
    }
}

/// Ends a turn whose calls all have outcomes: their spend, and one tool
/// message per call (paired by the model's call id), cut to the profile's
/// token cap.
pub(crate) fn after(inv: &mut Invocation, tools: &mut ToolRunner<'_>, turn: &Turn, fleet: &Fleet) {
    record_spent(inv, tools, fleet);
    let policy = inv.profile.profile.policy;
    let budget = policy
        .max_tool_result_tokens
        .map(|cap| (TokenBudget::for_model(inv.model()), cap));
    for c in &turn.calls {
        let outcome = c.outcome.clone().unwrap_or_else(ToolOutcome::no_result);
        let content = match &budget {
            Some((b, cap)) => {
                let capped = b.cap(&outcome.content, *cap);
                if capped.truncated {
                    // The function of the turn's first call with this
                    // model id (some servers repeat ids); bounded: a name
                    // the model made up is "unknown".
                    let named = turn
                        .calls
                        .iter()
                        .find(|o| o.model_id == c.model_id)
                        .map_or(c.call.name.as_str(), |o| o.call.name.as_str());
                    let function = inv
                        .tool(named)
                        .map_or("unknown", |t| t.definition.function.name.as_str());
                    fleet
                        .metrics()
                        .tool_results_truncated
                        .with_label_values(&[function])
                        .inc();
                }
                capped.text
            }
            None => outcome.content,
        };
        inv.messages.push(Message::Tool {
            call_id: c.model_id.clone(),
            content,
        });
    }
}

/// Runs the turn's calls that run now (see the module docs); outcomes land
/// in their calls.
pub(crate) async fn run(
    inv: &mut Invocation,
    tools: &mut ToolRunner<'_>,
    turn: &mut Turn,
    fleet: &Fleet,
    events: &Events,
) {
    let policy = inv.profile.profile.policy;
    let cap = turn.calls.len().min(policy.max_calls_per_turn);
    for i in 0..turn.calls.len() {
        if !turn.runs(i) {
            continue;
        }
        let call = &turn.calls[i].call;
        if i >= cap {
            turn.calls[i].outcome = Some(dispatch::over_the_turn_cap(fleet, inv, call, events));
        } else if call.name == SEARCH_TOOLS && inv.tool(&call.name).is_none() {
            let call = call.clone();
            turn.calls[i].outcome = Some(super::expansion::search_tools_call(
                inv, &call, fleet, events,
            ));
        }
    }
    run_remote(inv, tools, turn, fleet, events).await;
    for i in 0..turn.calls.len() {
        if turn.runs(i) {
            turn.calls[i].outcome = Some(ToolOutcome::no_result());
        }
    }
}

/// Runs the turn's agent-tool and worker-tool calls that run now.
async fn run_remote(
    inv: &Invocation,
    tools: &mut ToolRunner<'_>,
    turn: &mut Turn,
    fleet: &Fleet,
    events: &Events,
) {
    let mut agent_calls = Vec::new();
    let mut worker_calls = Vec::new();
    for i in (0..turn.calls.len()).filter(|&i| turn.runs(i)) {
        match inv.tool_for_call(&turn.calls[i].call.name) {
            Some(tool) if profile_of(tool).is_some() => agent_calls.push((i, tool.clone())),
            _ => worker_calls.push(i),
        }
    }
    let remote: Vec<ToolCall> = worker_calls
        .iter()
        .map(|&i| turn.calls[i].call.clone())
        .collect();
    let agents_spent = std::sync::Mutex::new(Vec::new());
    let calls = &turn.calls;
    let spent = &agents_spent;
    let agent_call = |i: usize, tool| {
        dispatch::agent::agent_call(inv, tool, &calls[i].call, fleet, events, spent)
    };
    let (agent_outcomes, worker_outcomes) = if inv.profile.profile.policy.parallel_tool_calls {
        let agents =
            futures::future::join_all(agent_calls.iter().map(|(i, tool)| agent_call(*i, tool)));
        if remote.is_empty() {
            (agents.await, Vec::new())
        } else {
            futures::join!(agents, tools.run(inv, &remote, events))
        }
    } else {
        let mut done = Vec::with_capacity(agent_calls.len());
        for (i, tool) in &agent_calls {
            done.push(agent_call(*i, tool).await);
        }
        let workers = if remote.is_empty() {
            Vec::new()
        } else {
            tools.run(inv, &remote, events).await
        };
        (done, workers)
    };
    tools.add_spent(agents_spent.into_inner().unwrap_or_default());
    for ((i, _), outcome) in agent_calls.iter().zip(agent_outcomes) {
        turn.calls[*i].outcome = Some(outcome);
    }
    for (i, outcome) in worker_calls.into_iter().zip(worker_outcomes) {
        turn.calls[i].outcome = Some(outcome);
    }
}
