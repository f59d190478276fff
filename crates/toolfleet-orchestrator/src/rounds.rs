//! Rounds: [`Agentic`], the default orchestrator — the agentic loop — and
//! [`Fleet::call_model`], one model call with its deltas, metrics and
//! usage.
//!
//! Each round streams a completion (text deltas become `delta` events);
//! tool calls, if any, run through the [`ToolRunner`] and their results
//! join the conversation; the loop ends when the model answers without
//! tools. The profile's loop policy caps it: when a cap is hit (rounds,
//! calls per turn, consecutive rounds of failed calls) the tools stay in
//! the request with `tool_choice: none` and a system note tells the model
//! to answer with what it has; the last round always forbids tools. A
//! truncated tool call is never run.

use std::time::Instant;

use futures::FutureExt;
use futures::future::BoxFuture;
use toolfleet_config::{LoopPolicy, TruncatedPolicy};
use toolfleet_llm::budget::TokenBudget;
use toolfleet_llm::{ChatRequest, Completion, Message, ToolCall, ToolChoice};
use toolfleet_protocol::{ChatEventBody, ToolStatus};

use serde::{Deserialize, Serialize};

use crate::approvals::{CallState, Hold, Park, ParkedCall, Resumed};
use crate::dispatch::new_call_id;
use crate::orchestrator::Ending;
use crate::usage::ModelCall;
use crate::{Answer, Events, Failure, Fleet, Invocation, Orchestrator, ToolOutcome, ToolRunner};

/// The `purpose` label of the conversation's own model calls (planning and
/// LLM-backed tools have their own).
pub const PURPOSE_CONVERSATION: &str = "conversation";

/// The agentic round loop, registered as `agentic`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Agentic;

impl Orchestrator for Agentic {
    fn run<'a>(
        &'a self,
        inv: &'a mut Invocation,
        fleet: &'a Fleet,
        events: &'a Events,
    ) -> BoxFuture<'a, Result<Ending, Failure>> {
        async move {
            let tools = fleet.tool_runner().await?;
            rounds(inv, fleet, events, tools, Caps::default(), 1).await
        }
        .boxed()
    }

    fn resume<'a>(
        &'a self,
        inv: &'a mut Invocation,
        resumed: Resumed,
        fleet: &'a Fleet,
        events: &'a Events,
    ) -> BoxFuture<'a, Result<Ending, Failure>> {
        resume(inv, resumed, fleet, events).boxed()
    }
}

/// Where the loop stood when it parked: the state [`Agentic`] keeps in
/// its [`Park`].
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct LoopState {
    /// The round whose calls wait.
    round: u32,
    failed_rounds: u32,
    #[serde(default)]
    stop: Option<String>,
}

/// Finishes the parked round — approved calls run now, denied ones are
/// answered as such — then goes on with the next round.
async fn resume(
    inv: &mut Invocation,
    resumed: Resumed,
    fleet: &Fleet,
    events: &Events,
) -> Result<Ending, Failure> {
    let state: LoopState = serde_json::from_value(resumed.state).map_err(|e| {
        Failure::new(
            "internal_error",
            format!("the parked loop state cannot be read: {e}"),
        )
    })?;
    let policy = inv.profile.profile.policy;
    let mut tools = fleet.tool_runner().await?;
    let mut caps = Caps {
        failed_rounds: state.failed_rounds,
        stop: state.stop,
    };
    let ours: Vec<ToolCall> = resumed.calls.iter().map(|c| c.call.clone()).collect();
    let run: Vec<bool> = resumed
        .calls
        .iter()
        .map(ParkedCall::runs_on_resume)
        .collect();
    let ran = run_turn(inv, &mut tools, &ours, &run, fleet, events).await;
    let mut outcomes = Vec::with_capacity(ours.len());
    for (parked, ran) in resumed.calls.into_iter().zip(ran) {
        outcomes.push(match (ran, parked.state) {
            (Some(outcome), _) => outcome,
            (None, CallState::Done { outcome }) => outcome,
            (None, CallState::Decided { reason, .. }) => crate::dispatch::immediate_with(
                fleet.metrics(),
                events,
                &parked.call,
                &parked.tool,
                ToolStatus::Blocked,
                "approval_denied",
                crate::approvals::denied_message(reason.as_deref()),
            ),
            (None, CallState::Held | CallState::After) => crate::dispatch::immediate(
                fleet.metrics(),
                events,
                &parked.call,
                &parked.tool,
                "approval_missing",
                "Error: the call was not run: it was never approved.".into(),
            ),
        });
    }
    after_turn(inv, &mut tools, &resumed.model_call_ids, &outcomes, fleet);
    if tools.cancelled() {
        return Err(Failure::new("cancelled", "the invocation was cancelled"));
    }
    caps.close_round(resumed.model_call_ids.len(), &outcomes, &policy, fleet);
    fleet.publish_references(inv, &outcomes, events)?;
    rounds(inv, fleet, events, tools, caps, state.round + 1).await
}

/// The loop from round `first` on.
async fn rounds(
    inv: &mut Invocation,
    fleet: &Fleet,
    events: &Events,
    mut tools: ToolRunner<'_>,
    mut caps: Caps,
    first: u32,
) -> Result<Ending, Failure> {
    let policy = inv.profile.profile.policy;
    for round in first..=policy.max_rounds {
        let tools_allowed = caps.open_round(round, &policy, fleet, &mut inv.messages);
        crate::compaction::maybe_compact(inv, &mut tools, fleet, events).await;
        let mut request = request(inv, &policy, tools_allowed, fleet);
        let completion = fleet.call_model(inv, &mut request, events).await;
        // The conversation was lent to the request (not copied, so a
        // waiting invocation holds it once): take it back.
        inv.messages = request.messages;
        let completion = completion?;
        if completion.is_truncated() && !completion.tool_calls.is_empty() {
            truncated_tool_call(fleet, &policy, &mut inv.messages)?;
            continue;
        }
        if completion.tool_calls.is_empty() {
            let text = match (&completion.refusal, completion.text.is_empty()) {
                (Some(r), true) => r.clone(),
                _ => completion.text,
            };
            return Ok(Ending::Answered(Answer {
                text,
                rounds: round,
            }));
        }
        if !tools_allowed {
            return Err(Failure::new(
                "round_limit",
                format!(
                    "the model asked for tools after being told to answer ({}); round {round} of {}",
                    caps.stop.as_deref().unwrap_or_default(),
                    policy.max_rounds
                ),
            ));
        }
        let outcomes = match run_calls(inv, &mut tools, &completion, fleet, events).await {
            Turn::Ran(outcomes) => outcomes,
            Turn::Held(calls) => {
                if tools.cancelled() {
                    return Err(Failure::new("cancelled", "the invocation was cancelled"));
                }
                let state = LoopState {
                    round,
                    failed_rounds: caps.failed_rounds,
                    stop: caps.stop.clone(),
                };
                return Ok(Ending::Parked(Park {
                    model_call_ids: completion.tool_calls.iter().map(|c| c.id.clone()).collect(),
                    calls,
                    state: serde_json::to_value(state).unwrap_or_default(),
                }));
            }
        };
        if tools.cancelled() {
            return Err(Failure::new("cancelled", "the invocation was cancelled"));
        }
        caps.close_round(completion.tool_calls.len(), &outcomes, &policy, fleet);
        fleet.publish_references(inv, &outcomes, events)?;
    }
    Err(Failure::new(
        "round_limit",
        format!("no answer within {} rounds", policy.max_rounds),
    ))
}

/// The loop policy's caps, as they stand between rounds.
#[derive(Debug, Default)]
struct Caps {
    /// Rounds in a row whose tool calls all failed.
    failed_rounds: u32,
    /// Set when a cap is hit: from then on the model may call no tool and
    /// is told to answer with what it has. Says which cap.
    stop: Option<String>,
}

impl Caps {
    /// Starts a round; returns whether tools are allowed in it.
    fn open_round(
        &mut self,
        round: u32,
        policy: &LoopPolicy,
        fleet: &Fleet,
        messages: &mut Vec<Message>,
    ) -> bool {
        if self.stop.is_none() && round == policy.max_rounds {
            self.stop = Some(format!("this is the last of {} rounds", policy.max_rounds));
            limit_hit(fleet, "rounds");
        }
        if let Some(reason) = &self.stop
            && !matches!(messages.last(), Some(Message::System { .. }))
        {
            messages.push(Message::System {
                content: format!("Tool limit reached ({reason}). Do not call any more tools: answer now with what you have, and say what you could not find out."),
            });
        }
        self.stop.is_none()
    }

    /// Ends a round whose calls ran: the per-turn and the failed-rounds caps.
    fn close_round(
        &mut self,
        calls: usize,
        outcomes: &[ToolOutcome],
        policy: &LoopPolicy,
        fleet: &Fleet,
    ) {
        if calls > policy.max_calls_per_turn {
            limit_hit(fleet, "calls_per_turn");
            self.stop.get_or_insert_with(|| {
                format!("at most {} tool calls per turn", policy.max_calls_per_turn)
            });
        }
        if outcomes.iter().all(|o| o.status != ToolStatus::Ok) {
            self.failed_rounds += 1;
        } else {
            self.failed_rounds = 0;
        }
        if policy.max_consecutive_tool_errors > 0
            && self.failed_rounds >= policy.max_consecutive_tool_errors
            && self.stop.is_none()
        {
            limit_hit(fleet, "consecutive_tool_errors");
            self.stop = Some(format!(
                "every tool call failed in {} round(s) in a row",
                self.failed_rounds
            ));
        }
    }
}

fn limit_hit(fleet: &Fleet, limit: &str) {
    fleet
        .metrics()
        .loop_limits
        .with_label_values(&[limit])
        .inc();
}

/// The round's request, with the conversation moved into it (the caller
/// puts it back after the call). The tools stay in it even when they are
/// forbidden (the prompt prefix, and its cache, do not change);
/// `tool_choice: none` forbids them.
fn request(
    inv: &mut Invocation,
    policy: &LoopPolicy,
    tools_allowed: bool,
    fleet: &Fleet,
) -> ChatRequest {
    let tools = inv.tool_specs();
    fleet.metrics().tools_offered.observe(tools.len() as f64);
    ChatRequest {
        model: inv.model().to_string(),
        messages: std::mem::take(&mut inv.messages),
        tools,
        tool_choice: (!tools_allowed).then_some(ToolChoice::None),
        parallel_tool_calls: policy.parallel_tool_calls,
        temperature: inv.profile.profile.temperature,
        max_tokens: None,
    }
}

/// The model ran out of tokens while writing a tool call: the call is not
/// run; the policy says whether the job fails or the model is asked again.
fn truncated_tool_call(
    fleet: &Fleet,
    policy: &LoopPolicy,
    messages: &mut Vec<Message>,
) -> Result<(), Failure> {
    limit_hit(fleet, "truncated_tool_call");
    match policy.on_truncated_tool_call {
        TruncatedPolicy::Error => Err(Failure::new(
            "truncated_tool_call",
            "the model ran out of tokens while writing a tool call; its arguments are incomplete and were not run",
        )),
        TruncatedPolicy::AskAgain => {
            messages.push(Message::System {
                content: "Your last tool call was cut off at the output token limit, so it was not run. Call the tool again with shorter arguments, or answer without it.".into(),
            });
            Ok(())
        }
    }
}

/// What the calls of a turn came to.
enum Turn {
    /// Every call ran (or was answered): an outcome each, in call order.
    Ran(Vec<ToolOutcome>),
    /// Some calls wait for a person's approval; the others ran.
    Held(Vec<ParkedCall>),
}

/// Runs the completion's tool calls and appends the assistant message and
/// one tool message per call (cut to the profile's token cap) to the
/// conversation — unless a call needs a person's approval: then the calls
/// that do not run, and the turn is held (the tool messages are added
/// when it resumes).
async fn run_calls(
    inv: &mut Invocation,
    tools: &mut ToolRunner<'_>,
    completion: &Completion,
    fleet: &Fleet,
    events: &Events,
) -> Turn {
    inv.messages.push(completion.assistant_message());
    // The model's call ids are not ours to trust as idempotency keys (some
    // servers repeat them): every call gets a fresh id for the fleet —
    // jobs, events, citations — and the model's id only pairs the result
    // with its call in the conversation.
    let ours: Vec<ToolCall> = completion
        .tool_calls
        .iter()
        .map(|c| ToolCall {
            id: new_call_id(),
            ..c.clone()
        })
        .collect();
    let holds = crate::approvals::held_calls(inv, &ours);
    let run: Vec<bool> = holds.iter().map(|h| *h == Hold::Run).collect();
    let mut ran = run_turn(inv, tools, &ours, &run, fleet, events).await;
    for ((call, hold), ran) in ours.iter().zip(&holds).zip(ran.iter_mut()) {
        if *hold == Hold::Refuse {
            let tool = crate::approvals::tool_name(inv, call);
            *ran = Some(crate::dispatch::immediate_with(
                fleet.metrics(),
                events,
                call,
                &tool,
                ToolStatus::Blocked,
                "approval_unavailable",
                crate::approvals::REFUSED_IN_AGENT.to_string(),
            ));
        }
    }
    let model_ids: Vec<String> = completion.tool_calls.iter().map(|c| c.id.clone()).collect();
    if holds.contains(&Hold::Person) {
        record_spent(inv, tools, fleet);
        let calls = ours
            .into_iter()
            .zip(ran)
            .zip(holds)
            .map(|((call, ran), hold)| ParkedCall::new(inv, call, ran, hold))
            .collect();
        return Turn::Held(calls);
    }
    let outcomes: Vec<ToolOutcome> = ran
        .into_iter()
        .map(|o| o.unwrap_or_else(no_result))
        .collect();
    after_turn(inv, tools, &model_ids, &outcomes, fleet);
    Turn::Ran(outcomes)
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
fn after_turn(
    inv: &mut Invocation,
    tools: &mut ToolRunner<'_>,
    model_call_ids: &[String],
    outcomes: &[ToolOutcome],
    fleet: &Fleet,
) {
    record_spent(inv, tools, fleet);
    let policy = inv.profile.profile.policy;
    let budget = policy
        .max_tool_result_tokens
        .map(|cap| (TokenBudget::for_model(inv.model()), cap));
    for (call_id, outcome) in model_call_ids.iter().zip(outcomes) {
        let content = match &budget {
            Some((b, cap)) => {
                let capped = b.cap(&outcome.content, *cap);
                if capped.truncated {
                    // Bounded label: a name the model made up is "unknown".
                    let function = function_of(inv, call_id);
                    fleet
                        .metrics()
                        .tool_results_truncated
                        .with_label_values(&[function])
                        .inc();
                }
                capped.text
            }
            None => outcome.content.clone(),
        };
        inv.messages.push(Message::Tool {
            call_id: call_id.clone(),
            content,
        });
    }
}

/// The function name of the offered tool the assistant's call `call_id`
/// named, or `unknown` (a bounded metric label).
fn function_of<'a>(inv: &'a Invocation, call_id: &str) -> &'a str {
    let name = inv.messages.iter().rev().find_map(|m| match m {
        Message::Assistant { tool_calls, .. } => tool_calls
            .iter()
            .find(|c| c.id == call_id)
            .map(|c| c.name.as_str()),
        _ => None,
    });
    name.and_then(|n| inv.tool(n))
        .map_or("unknown", |t| t.definition.function.name.as_str())
}

fn no_result() -> ToolOutcome {
    ToolOutcome {
        content: "Error: the call got no result.".into(),
        status: ToolStatus::Error,
        references: Vec::new(),
    }
}

/// Runs the turn's calls that `run` marks (the others get `None`): calls
/// over the per-turn cap (counted in the model's order, whatever they
/// are) are answered without running;
/// `search_tools` runs first, here (it changes the tools offered from the
/// next round on); then agent tools (nested chat jobs) and worker tools —
/// together when parallel calls are on, else one at a time. Outcomes in
/// call order.
async fn run_turn(
    inv: &mut Invocation,
    tools: &mut ToolRunner<'_>,
    calls: &[ToolCall],
    run: &[bool],
    fleet: &Fleet,
    events: &Events,
) -> Vec<Option<ToolOutcome>> {
    let policy = inv.profile.profile.policy;
    let mut out: Vec<Option<ToolOutcome>> = vec![None; calls.len()];
    let cap = calls.len().min(policy.max_calls_per_turn);
    for (i, call) in calls.iter().enumerate() {
        if !run[i] {
            continue;
        }
        if i >= cap {
            out[i] = Some(crate::dispatch::over_the_turn_cap(fleet, inv, call, events));
        } else if call.name == crate::scoping::SEARCH_TOOLS && inv.tool(&call.name).is_none() {
            out[i] = Some(crate::scope::search_tools_call(inv, call, fleet, events));
        }
    }
    let inv = &*inv;
    let mut agent_calls = Vec::new();
    let mut worker_calls = Vec::new();
    for (i, call) in calls.iter().enumerate() {
        if out[i].is_some() || !run[i] {
            continue;
        }
        // An offered tool, or a permitted one scoping left out.
        let tool = inv
            .tool(&call.name)
            .or_else(|| inv.scope.permitted.by_function_name(&call.name));
        match tool {
            Some(tool) if crate::agents::profile_of(tool).is_some() => {
                agent_calls.push((i, tool.clone(), call));
            }
            _ => worker_calls.push(i),
        }
    }
    let remote: Vec<ToolCall> = worker_calls.iter().map(|&i| calls[i].clone()).collect();
    let agents_spent = std::sync::Mutex::new(Vec::new());
    let (agent_outcomes, worker_outcomes) = if policy.parallel_tool_calls {
        let agents = futures::future::join_all(agent_calls.iter().map(|(_, tool, call)| {
            crate::scope::agent_call(inv, tool, call, fleet, events, &agents_spent)
        }));
        if remote.is_empty() {
            (agents.await, Vec::new())
        } else {
            futures::join!(agents, tools.run(inv, &remote, events))
        }
    } else {
        let mut done = Vec::with_capacity(agent_calls.len());
        for (_, tool, call) in &agent_calls {
            done.push(
                crate::scope::agent_call(inv, tool, call, fleet, events, &agents_spent).await,
            );
        }
        let workers = if remote.is_empty() {
            Vec::new()
        } else {
            tools.run(inv, &remote, events).await
        };
        (done, workers)
    };
    tools.add_spent(agents_spent.into_inner().unwrap_or_default());
    for ((i, _, _), outcome) in agent_calls.iter().zip(agent_outcomes) {
        out[*i] = Some(outcome);
    }
    for (i, outcome) in worker_calls.into_iter().zip(worker_outcomes) {
        out[i] = Some(outcome);
    }
    for (o, run) in out.iter_mut().zip(run) {
        if *run && o.is_none() {
            *o = Some(no_result());
        }
    }
    out
}

impl Fleet {
    /// One model call for `inv`: text deltas are sent as `delta` events as
    /// they stream; the request, retry and duration metrics and the usage
    /// ledger (with its token and cost metrics) are updated. When the
    /// profile's deployment fails before any text has streamed (an error
    /// its retries did not cure: connection, timeout, 429, 5xx), the call
    /// goes to the profile's next deployment (`request.model` becomes its
    /// model, a `fallback` event says so); the invocation stays on it. A
    /// failed call is a [`Failure`] with code `llm_<kind>`.
    pub async fn call_model(
        &self,
        inv: &mut Invocation,
        request: &mut ChatRequest,
        events: &Events,
    ) -> Result<Completion, Failure> {
        loop {
            let llm = self.llm_for(&inv.profile)?;
            let mut streamed = false;
            let result = self
                .call_once(&llm, inv, request, events, &mut streamed)
                .await;
            match result {
                Err(e) if !streamed && e.is_retryable() => {
                    let Some(next) = inv.profile.next_deployment(e.code()) else {
                        return Err(Failure::new(format!("llm_{}", e.code()), e.to_string()));
                    };
                    tracing::warn!(
                        invocation_id = %inv.job.invocation_id,
                        from = %inv.profile.deployment_name,
                        to = %next.deployment_name,
                        code = e.code(),
                        "deployment failed before any output; falling back"
                    );
                    self.metrics
                        .llm_fallbacks
                        .with_label_values(&[
                            inv.profile.deployment_name.as_str(),
                            next.deployment_name.as_str(),
                        ])
                        .inc();
                    events.send(ChatEventBody::Fallback {
                        from: inv.profile.deployment_name.clone(),
                        from_model: inv.profile.model().to_string(),
                        to: next.deployment_name.clone(),
                        to_model: next.model().to_string(),
                        code: e.code().to_string(),
                    });
                    inv.profile = next;
                    request.model = inv.profile.model().to_string();
                }
                Err(e) => return Err(Failure::new(format!("llm_{}", e.code()), e.to_string())),
                Ok(completion) => return Ok(completion),
            }
        }
    }

    /// One attempt of [`call_model`](Self::call_model) on the profile's
    /// current deployment; `streamed` is set once a delta went out.
    async fn call_once(
        &self,
        llm: &toolfleet_llm::LlmClient,
        inv: &mut Invocation,
        request: &ChatRequest,
        events: &Events,
        streamed: &mut bool,
    ) -> Result<Completion, toolfleet_llm::LlmError> {
        let model = request.model.as_str();
        let started = Instant::now();
        let completion = llm
            .stream_chat(request, |text| {
                *streamed = true;
                events.send(ChatEventBody::Delta {
                    text: text.to_string(),
                })
            })
            .await;
        let m = &self.metrics;
        m.llm_request_duration
            .with_label_values(&[model])
            .observe(started.elapsed().as_secs_f64());
        let attempts = match &completion {
            Ok(c) => c.attempts,
            Err(e) => e.attempts(),
        };
        if attempts > 1 {
            m.llm_retries
                .with_label_values(&[model])
                .inc_by(u64::from(attempts - 1));
        }
        let completion = match completion {
            Ok(c) => c,
            Err(e) => {
                m.llm_requests.with_label_values(&[model, e.code()]).inc();
                return Err(e);
            }
        };
        m.llm_requests.with_label_values(&[model, "ok"]).inc();
        if let Some(ttft) = completion.time_to_first_token {
            m.llm_time_to_first_token
                .with_label_values(&[model])
                .observe(ttft.as_secs_f64());
        }
        let usage = completion.usage.unwrap_or_default();
        inv.usage.record(
            m,
            ModelCall {
                model,
                purpose: PURPOSE_CONVERSATION,
                usage,
                cost: self.config.profiles.prices.cost(model, &usage),
                attempts,
            },
        );
        Ok(completion)
    }
}
