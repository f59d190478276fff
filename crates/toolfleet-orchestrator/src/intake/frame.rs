//! The frame every invocation runs in, the same for every orchestrator
//! so a custom one plugs in without touching the loop and cannot forget
//! the contract:
//!
//! 1. the context stage ([`context`]) opens the [`Invocation`] and runs
//!    its handlers (`started` and preemptive retrieval among them);
//! 2. the profile's [`Orchestrator`](crate::Orchestrator) runs, publishing
//!    what it does through [`Events`];
//! 3. on an [`Answer`](crate::Answer): the references not published yet,
//!    then `completed` with the answer and only the references it cites,
//!    renumbered 1..k (text and list alike) with their links, and the
//!    usage ledger. On a park, the record to keep. On a [`Failure`], the
//!    run publishes the `error` event.
//!
//! A parked invocation whose held calls are all decided goes through
//! [`resume`]: rebuilt from its record, its decisions announced, then its
//! orchestrator's `resume`.

use toolfleet_protocol::approval::ApprovalOutcome;
use toolfleet_protocol::{ChatEventBody, ChatJob};

use super::Plugins;
use crate::approvals::{CallState, Parked, Resumed};
use crate::context;
use crate::failure::ChatErrorCode;
use crate::invocation::CancelCheck;
use crate::rounds::Ending;
use crate::{Events, Failure, Fleet, Invocation};

/// How the frame ends a run that did not fail.
#[derive(Debug)]
pub(crate) enum Finished {
    /// The `completed` event, for the caller to send once it knows the
    /// run still speaks for the invocation.
    Completed(ChatEventBody),
    /// The invocation waits for approvals: the record to keep.
    Parked(Box<Parked>),
}

/// How deep a fresh job runs in agent calls, and the approval rules its
/// caller passed down.
pub(crate) struct Nesting {
    pub(crate) agent_depth: u32,
    /// A nested job's caller's `require_approval` (and its callers'): the
    /// job's own profile's rules are widened by them, never narrowed, so
    /// a nested run cannot run what its caller holds.
    pub(crate) inherited_approval: Vec<toolfleet_protocol::tools::ToolRef>,
    /// The job's place on its thread, when it names one.
    pub(crate) thread: Option<std::sync::Arc<crate::threads::Seat>>,
    /// The run's in-flight permit, given back while a repeat of an
    /// idempotency key waits for the first job.
    pub(crate) place: Option<std::sync::Arc<crate::threads::Place>>,
}

/// Runs `job` through the frame: the context stage, then the profile's
/// orchestrator.
pub(crate) async fn invoke(
    fleet: &Fleet,
    plugins: &Plugins,
    job: ChatJob,
    deadline_ms: u64,
    nesting: Nesting,
    events: &Events,
    cancel_check: &CancelCheck,
) -> Result<Finished, Failure> {
    // A repeated idempotency key runs nothing: the first job's outcome.
    let first = match super::idempotency::first_of(fleet, &job).await? {
        super::idempotency::Keyed::First => None,
        super::idempotency::Keyed::Ended => Some(job.invocation_id.clone()),
        super::idempotency::Keyed::Repeat(first) => Some(first),
    };
    if let Some(first) = first {
        if let Some(place) = &nesting.place {
            place.give_back();
        }
        return (super::idempotency::replay(fleet, &job, &first, events).await)
            .map(Finished::Completed);
    }
    let mut inv = context::open(
        fleet,
        job,
        deadline_ms,
        nesting.agent_depth,
        &plugins.names(),
    )?;
    // A thread's job runs when it has the thread (its strategy says how
    // it gets it, or that it does not).
    if let Some(seat) = &nesting.thread {
        let strategy =
            (inv.job.multitask_strategy).unwrap_or(inv.profile.profile.multitask_strategy);
        seat.enter(fleet, &|event| events.send(event), strategy)
            .await?;
        inv.thread = Some(seat.tap());
    }
    let rules = &mut inv.profile.profile.require_approval;
    for r in nesting.inherited_approval {
        if !rules.contains(&r) {
            rules.push(r);
        }
    }
    inv.cancel_check = cancel_check.clone();
    let orchestrator = plugins.orchestrator_of(&inv)?;
    // Boxed: the context stage (pre-fetching among it) is over before the
    // orchestrator's long waits, and should not be carried through them.
    Box::pin(plugins.context.run(&mut inv, fleet, events)).await?;
    let ending = orchestrator.run(&mut inv, fleet, events).await?;
    finish(fleet, inv, ending, events)
}

/// The end of the frame: an answer becomes `completed`, a park the record
/// to keep.
pub(crate) fn finish(
    fleet: &Fleet,
    mut inv: Invocation,
    ending: Ending,
    events: &Events,
) -> Result<Finished, Failure> {
    let answer = match ending {
        Ending::Answered(answer) => answer,
        Ending::Parked(park) => {
            fleet.publish_references(&mut inv, &[], events)?;
            return Ok(Finished::Parked(Box::new(Parked::of(fleet, inv, park))));
        }
    };
    fleet.publish_references(&mut inv, &[], events)?;
    // Only what the answer cites, renumbered 1..k, with links.
    let cited = toolfleet_protocol::references::cited_only(&answer.text, &inv.citations.all());
    if let Some(thread) = &inv.thread {
        thread.answered(&inv.messages, &cited.text);
    }
    let links = &fleet.config().profiles.links;
    Ok(Finished::Completed(ChatEventBody::Completed {
        text: cited.text,
        references: crate::links::resolve_all(cited.references, links),
        usage: inv.usage.total(),
        cost_usd: inv.usage.cost(),
        llm_calls: inv.usage.into_calls(),
        rounds: answer.rounds,
    }))
}

/// Runs a parked invocation whose held calls are all decided: rebuilt
/// from its record, its decisions announced (`approval_resolved`, metrics);
/// a timeout or cancel ends it, otherwise its orchestrator goes on.
pub(crate) async fn resume(
    fleet: &Fleet,
    plugins: &Plugins,
    parked: Parked,
    deadline_ms: u64,
    events: &Events,
    (cancel_check, thread): (&CancelCheck, Option<crate::threads::tap::ThreadTap>),
) -> Result<Finished, Failure> {
    // Rebuilt first, so the invocation's sinks hear the decisions and the
    // end too; an invocation that only ends needs no rebuilding to.
    let rebuilt = rebuild(fleet, plugins, &parked, deadline_ms);
    if let Ok((inv, _)) = &rebuilt
        && let Ok(Some(route)) = context::route_for(fleet, inv)
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
            ChatErrorCode::Cancelled,
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
            ChatErrorCode::ApprovalTimeout,
            format!(
                "no approval arrived within {} s for {}",
                parked.expires_at_ms.saturating_sub(parked.parked_at_ms) / 1000,
                waiting.join(", ")
            ),
        ));
    }
    let (mut inv, resumed) = rebuilt?;
    inv.cancel_check = cancel_check.clone();
    if let Some(thread) = thread {
        thread.tap(&inv.messages);
        inv.thread = Some(thread);
    }
    let orchestrator = plugins.orchestrator_of(&inv)?;
    let ending = orchestrator
        .resume(&mut inv, resumed, fleet, events)
        .await?;
    finish(fleet, inv, ending, events)
}

/// The invocation of a parked record: the job's profile and gates
/// resolved again (on the deployment it was on), the conversation, offered
/// tools, usage and citations as they were.
fn rebuild(
    fleet: &Fleet,
    plugins: &Plugins,
    parked: &Parked,
    deadline_ms: u64,
) -> Result<(Invocation, Resumed), Failure> {
    let names = plugins.names();
    let mut inv = context::reopen(
        fleet,
        parked.unsealed_job(fleet),
        deadline_ms,
        parked.agent_depth,
        &names,
    )?;
    while inv.profile.deployment_name != parked.deployment {
        match inv.profile.next_deployment("parked on a later deployment") {
            Some(next) => inv.use_deployment(next),
            None => break,
        }
    }
    if inv.profile.deployment_name != parked.deployment {
        inv = context::reopen(fleet, inv.job, deadline_ms, parked.agent_depth, &names)?;
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
    inv.scope.expansions = parked.expansions;
    inv.scope.first_offer = parked.first_offer;
    inv.usage = parked.usage.clone();
    inv.citations = parked.citations.clone();
    let resumed = Resumed {
        model_call_ids: parked.model_call_ids.clone(),
        calls: parked.calls.clone(),
        state: parked.state.clone(),
    };
    Ok((inv, resumed))
}
