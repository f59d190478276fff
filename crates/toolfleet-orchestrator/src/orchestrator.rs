//! The [`Orchestrator`] trait, and the frame every invocation runs in.
//!
//! A profile's `orchestrator` name picks an implementation registered in
//! [`OrchestratorConfig`](crate::OrchestratorConfig) (`agentic`, the
//! [`Agentic`](crate::Agentic) round loop, by default). The frame around it
//! is the same for every orchestrator, so a custom one plugs in without
//! touching the loop and cannot forget the contract:
//!
//! 1. [`context::build`](crate::context) makes the [`Invocation`];
//! 2. [`scope::choose`](crate::scope::choose) picks the tools offered
//!    first (a planning call may run here);
//! 3. `started` is published (model, profile, offered tools), then a
//!    `scoping` event saying how they were chosen (unless all permitted
//!    tools are offered and nothing was left out); then preemptive
//!    retrieval ([`rag::prefetch`](crate::rag::prefetch)) searches the
//!    attachments and data source, and the references it cited follow;
//! 4. the orchestrator runs, publishing what it does through [`Events`];
//! 5. on [`Answer`]: the references not published yet, then `completed`
//!    with the answer and only the references it cites, renumbered 1..k
//!    (text and list alike) with their links, and the usage ledger. On
//!    [`Failure`], intake publishes the `error` event.

use futures::future::BoxFuture;
use toolfleet_protocol::{ChatEventBody, ChatJob};

use crate::{Events, Fleet, Invocation, context};

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
            "internal_error",
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

/// Why an invocation ended without an answer: the `error` event's code and
/// message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failure {
    /// Stable and machine-readable, e.g. `round_limit`, `llm_http_429`.
    pub code: String,
    /// For people; never holds a secret.
    pub message: String,
}

impl Failure {
    pub fn new(code: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            code: code.into(),
            message: message.into(),
        }
    }
}

/// How the frame ends a run that did not fail.
#[derive(Debug)]
pub(crate) enum Finished {
    /// The `completed` event, for the caller to send once it knows the
    /// run still speaks for the invocation.
    Completed(ChatEventBody),
    /// The invocation waits for approvals: the record to keep.
    Parked(Box<crate::approvals::Parked>),
}

/// Runs `job` through the frame: context, `started`, the profile's
/// orchestrator.
pub(crate) async fn invoke(
    fleet: &Fleet,
    job: ChatJob,
    deadline_ms: u64,
    agent_depth: u32,
    events: &Events,
    cancel_check: &context::CancelCheck,
) -> Result<Finished, Failure> {
    let mut inv = context::build(fleet, job, deadline_ms, agent_depth)?;
    if let Some(route) = crate::sinks::route_for(fleet, &inv)? {
        events.route(route);
    }
    inv.cancel_check = cancel_check.clone();
    let scoping = crate::scope::choose(fleet, &mut inv).await;
    let orchestrator = orchestrator_of(fleet, &inv)?;
    events.send(ChatEventBody::Started {
        model: inv.model().to_string(),
        profile: Some(inv.profile.name.clone()),
        tools: inv.tool_ids(),
    });
    // Nothing to say when every permitted tool is offered and nothing
    // was left out: `started` lists them.
    if !matches!(&scoping, ChatEventBody::Scoping { decision, note: None, .. } if decision == "all")
    {
        events.send(scoping);
    }
    crate::rag::prefetch(fleet, &mut inv, events).await?;
    let ending = orchestrator.run(&mut inv, fleet, events).await?;
    finish(fleet, inv, ending, events)
}

/// The orchestrator the invocation's profile names.
pub(crate) fn orchestrator_of(
    fleet: &Fleet,
    inv: &Invocation,
) -> Result<std::sync::Arc<dyn Orchestrator>, Failure> {
    fleet
        .config()
        .orchestrator(&inv.profile.orchestrator)
        .ok_or_else(|| {
            Failure::new(
                "internal_error",
                format!(
                    "no orchestrator is registered as {:?}",
                    inv.profile.orchestrator
                ),
            )
        })
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
            return Ok(Finished::Parked(Box::new(crate::approvals::Parked::of(
                inv, park,
            ))));
        }
    };
    fleet.publish_references(&mut inv, &[], events)?;
    // Only what the answer cites, renumbered 1..k, with links.
    let cited = toolfleet_protocol::references::cited_only(&answer.text, &inv.citations.all());
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
