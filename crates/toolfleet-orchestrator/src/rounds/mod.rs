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

use futures::FutureExt;
use futures::future::BoxFuture;
use toolfleet_config::{LoopPolicy, TruncatedPolicy};
use toolfleet_llm::{ChatRequest, Message, ToolChoice};
use toolfleet_protocol::ToolErrorCode;
use toolfleet_protocol::ToolStatus;

use serde::{Deserialize, Serialize};

mod compaction;
mod expansion;
mod model;
mod turn;

pub use model::{prefix_hash, prompt_cache_key};

use crate::approvals::{self, CallState, Park, Resumed};
use crate::dispatch;
use crate::failure::ChatErrorCode;
use crate::{Events, Failure, Fleet, Invocation, ToolOutcome, ToolRunner};
use turn::{Ended, Turn};

/// Runs one invocation to its answer.
///
/// The invocation arrives built: profile resolved, conversation and offered
/// tools in place, `started` already published. An implementation reaches
/// the model with [`Fleet::call_model`], the tools with
/// [`Fleet::tool_runner`], and publishes citations with
/// [`Fleet::publish_references`]; it may also send events of its own
/// (say, `delta`s) through `events`. It returns the answer's text, or a
/// [`Failure`] that ends the invocation with an `error` event. It never
/// sends a terminal event itself.
///
/// The future is dropped when the invocation's deadline passes or it is
/// cancelled; an implementation needs no timeouts of its own for that.
pub trait Orchestrator: Send + Sync + 'static {
    fn run<'a>(
        &'a self,
        inv: &'a mut Invocation,
        fleet: &'a Fleet,
        events: &'a Events,
    ) -> BoxFuture<'a, Result<Ending, Failure>>;

    /// Goes on with an invocation this orchestrator parked
    /// ([`Ending::Parked`]) once every held call is decided: `resumed`
    /// holds the turn's calls — approved ones still to run, denied ones to
    /// tell the model about, the others with their outcomes — and the
    /// state the orchestrator kept in its [`Park`]. The invocation arrives
    /// rebuilt: conversation, offered tools, usage and citations as they
    /// were. An orchestrator that never parks keeps the default, which
    /// fails.
    fn resume<'a>(
        &'a self,
        inv: &'a mut Invocation,
        resumed: crate::approvals::Resumed,
        fleet: &'a Fleet,
        events: &'a Events,
    ) -> BoxFuture<'a, Result<Ending, Failure>> {
        let _ = (inv, resumed, fleet, events);
        Box::pin(std::future::ready(Err(Failure::new(
            ChatErrorCode::InternalError,
            "this orchestrator parked an invocation but cannot resume one",
        ))))
    }
}

/// How a run of an orchestrator ends (besides failing).
#[derive(Debug)]
pub enum Ending {
    /// The invocation's answer.
    Answered(Answer),
    /// Calls of the current turn wait for a person's approval: the frame
    /// keeps the invocation in the parked bucket, publishes
    /// `approval_requested` for each held call, and ends this run without
    /// a terminal event; [`Orchestrator::resume`] goes on later, on any
    /// orchestrator.
    Parked(crate::approvals::Park),
}

impl From<Answer> for Ending {
    fn from(answer: Answer) -> Self {
        Ending::Answered(answer)
    }
}

/// What an orchestrator answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Answer {
    /// The answer, with `[doc:N]` markers as the model wrote them.
    pub text: String,
    /// Model rounds it took (0 for an answer without a model call).
    pub rounds: u32,
}

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
    mut resumed: Resumed,
    fleet: &Fleet,
    events: &Events,
) -> Result<Ending, Failure> {
    let state: LoopState =
        serde_json::from_value(std::mem::take(&mut resumed.state)).map_err(|e| {
            Failure::new(
                ChatErrorCode::InternalError,
                format!("the parked loop state cannot be read: {e}"),
            )
        })?;
    let policy = inv.profile.profile.policy;
    let mut tools = fleet.tool_runner().await?;
    let mut caps = Caps {
        failed_rounds: state.failed_rounds,
        stop: state.stop,
    };
    let mut turn = Turn::resumed(&resumed, inv, fleet).await;
    turn::run(inv, &mut tools, &mut turn, fleet, events).await;
    for (c, parked) in turn.calls.iter_mut().zip(&resumed.calls) {
        if c.outcome.is_some() {
            continue;
        }
        c.outcome = Some(match &parked.state {
            CallState::Done { outcome } => outcome.clone(),
            CallState::Decided { reason, .. } => dispatch::immediate_with(
                fleet.metrics(),
                events,
                &parked.call,
                &parked.tool,
                ToolStatus::Blocked,
                ToolErrorCode::ApprovalDenied.as_str(),
                approvals::denied_message(reason.as_deref()),
            ),
            CallState::Held | CallState::After => dispatch::immediate(
                fleet.metrics(),
                events,
                &parked.call,
                &parked.tool,
                ToolErrorCode::ApprovalMissing.as_str(),
                "Error: the call was not run: it was never approved.".into(),
            ),
        });
    }
    let outcomes = turn.outcomes();
    turn::after(inv, &mut tools, &turn, fleet);
    if tools.cancelled() {
        return Err(Failure::new(
            ChatErrorCode::Cancelled,
            "the invocation was cancelled",
        ));
    }
    if let Some(failure) = tools.ended() {
        return Err(failure);
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
        // Compaction and the turn's calls are boxed: each is larger than
        // the model call (~8.5 KiB against ~2.3 KiB in release), and a
        // loop future sized for them would carry that space while it
        // waits on the model, for every invocation.
        Box::pin(compaction::maybe_compact(inv, &mut tools, fleet, events)).await;
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
                ChatErrorCode::RoundLimit,
                format!(
                    "the model asked for tools after being told to answer ({}); round {round} of {}",
                    caps.stop.as_deref().unwrap_or_default(),
                    policy.max_rounds
                ),
            ));
        }
        let outcomes = match Box::pin(turn::run_calls(
            inv,
            &mut tools,
            (&completion, round),
            fleet,
            events,
        ))
        .await
        {
            Ended::Ran(outcomes) => outcomes,
            Ended::Held(calls) => {
                if tools.cancelled() {
                    return Err(Failure::new(
                        ChatErrorCode::Cancelled,
                        "the invocation was cancelled",
                    ));
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
            return Err(Failure::new(
                ChatErrorCode::Cancelled,
                "the invocation was cancelled",
            ));
        }
        // A call waited for a declared pool's first worker until the
        // deadline: no time is left for the model.
        if let Some(failure) = tools.ended() {
            return Err(failure);
        }
        caps.close_round(completion.tool_calls.len(), &outcomes, &policy, fleet);
        fleet.publish_references(inv, &outcomes, events)?;
    }
    Err(Failure::new(
        ChatErrorCode::RoundLimit,
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
/// `tool_choice: none` forbids them. It carries the tenant's and
/// profile's [`prompt_cache_key`] (sent where the deployment accepts it).
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
        service_tier: inv.service_tier(),
        prompt_cache_key: Some(prompt_cache_key(
            fleet.config().subjects.prefix(),
            inv.ctx.tenant(),
            &inv.profile.name,
        )),
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
            ChatErrorCode::TruncatedToolCall,
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
