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
//!
//! Each call's tool is resolved once, when the turn is made
//! ([`dispatch::resolve_tool`]: offered, permitted, or one whose worker
//! joined after the invocation started): the hold is decided on that tool,
//! and dispatch runs that very tool ([`ToolRunner::run_resolved`]), so a
//! late tool that needs approval parks like any other.

use toolfleet_llm::budget::TokenBudget;
use toolfleet_llm::{Completion, Message, ToolCall};
use toolfleet_protocol::ToolErrorCode;
use toolfleet_protocol::ToolStatus;

use crate::approvals::{self, CallState, Hold, ParkedCall, Resumed};
use crate::dispatch::{self, Resolved};
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
    /// Its tool, resolved once: what the hold is decided on and what runs.
    pub(crate) resolved: Resolved,
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
    /// The turn of `completion`'s calls in round `round`, each under an id
    /// of ours (the same when a replayed run makes the same call:
    /// [`dispatch::replayable_call_id`]), its tool resolved, with what the
    /// approval rules hold.
    async fn new(inv: &Invocation, completion: &Completion, round: u32, fleet: &Fleet) -> Self {
        let cap = inv.profile.profile.policy.max_calls_per_turn;
        let mut calls = Vec::with_capacity(completion.tool_calls.len());
        for (i, model) in completion.tool_calls.iter().enumerate() {
            // Calls over the cap never run, and `search_tools` is the
            // loop's own: neither needs a catalog reading.
            let tool =
                if i >= cap || (model.name == SEARCH_TOOLS && inv.tool(SEARCH_TOOLS).is_none()) {
                    None
                } else {
                    dispatch::resolve_tool(fleet, inv, &model.name).await
                };
            calls.push(TurnCall {
                model_id: model.id.clone(),
                call: ToolCall {
                    id: dispatch::replayable_call_id(
                        (inv.job.tenant(), &inv.ctx.invocation_id),
                        round,
                        i,
                        &model.name,
                        &model.arguments,
                    ),
                    ..model.clone()
                },
                resolved: Resolved {
                    tool,
                    approved: false,
                },
                hold: Hold::Run,
                outcome: None,
            });
        }
        let tools: Vec<_> = calls.iter().map(|c| c.resolved.tool.as_ref()).collect();
        let holds = approvals::held_calls(inv, &tools);
        for (c, hold) in calls.iter_mut().zip(holds) {
            c.hold = hold;
        }
        Self { calls }
    }

    /// The turn a parked one resumes: approved calls (and those that waited
    /// for an earlier one) run; the others keep what they came to. The
    /// calls that run are resolved again; an approval counts only for the
    /// tool the person was shown, so a call whose name now resolves to
    /// another tool that needs approval is refused, never run.
    pub(crate) async fn resumed(resumed: &Resumed, inv: &Invocation, fleet: &Fleet) -> Self {
        let mut calls = Vec::with_capacity(resumed.calls.len());
        for (model_id, parked) in resumed.model_call_ids.iter().zip(&resumed.calls) {
            let runs = parked.runs_on_resume();
            let tool = if runs {
                dispatch::resolve_tool(fleet, inv, &parked.call.name).await
            } else {
                None
            };
            let approved = matches!(
                parked.state,
                CallState::Decided {
                    outcome: toolfleet_protocol::approval::ApprovalOutcome::Approved,
                    ..
                }
            ) && tool
                .as_ref()
                .is_some_and(|t| t.definition.id.to_string() == parked.tool);
            calls.push(TurnCall {
                model_id: model_id.clone(),
                call: parked.call.clone(),
                resolved: Resolved { tool, approved },
                hold: if runs { Hold::Run } else { Hold::Person },
                outcome: match &parked.state {
                    CallState::Done { outcome } => Some(outcome.clone()),
                    _ => None,
                },
            });
        }
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
    (completion, round): (&Completion, u32),
    fleet: &Fleet,
    events: &Events,
) -> Ended {
    inv.messages.push(completion.assistant_message());
    let mut turn = Turn::new(inv, completion, round, fleet).await;
    run(inv, tools, &mut turn, fleet, events).await;
    for c in turn.calls.iter_mut().filter(|c| c.hold == Hold::Refuse) {
        let tool = c
            .resolved
            .tool
            .as_ref()
            .map_or_else(|| c.call.name.clone(), |t| t.definition.id.to_string());
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
            .map(|c| ParkedCall::new(c.resolved.tool.as_ref(), c.call, c.outcome, c.hold))
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
    // What a thread keeps of this run if it is cut short from here on.
    if let Some(thread) = &inv.thread {
        thread.tap(&inv.messages);
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
        match &turn.calls[i].resolved.tool {
            Some(tool) if profile_of(tool).is_some() => agent_calls.push((i, tool.clone())),
            _ => worker_calls.push(i),
        }
    }
    let remote: Vec<ToolCall> = worker_calls
        .iter()
        .map(|&i| turn.calls[i].call.clone())
        .collect();
    let resolved: Vec<Resolved> = worker_calls
        .iter()
        .map(|&i| turn.calls[i].resolved.clone())
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
            futures::join!(agents, tools.run_resolved(inv, &remote, &resolved, events))
        }
    } else {
        let mut done = Vec::with_capacity(agent_calls.len());
        for (i, tool) in &agent_calls {
            done.push(agent_call(*i, tool).await);
        }
        let workers = if remote.is_empty() {
            Vec::new()
        } else {
            tools.run_resolved(inv, &remote, &resolved, events).await
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
