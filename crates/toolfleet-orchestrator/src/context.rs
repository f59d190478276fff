//! Context: from a chat job to an [`Invocation`] — the value every later
//! stage works on.
//!
//! [`build`] runs the steps below in order; each is one function that
//! reads the job (and the fleet) and fills in part of the invocation:
//!
//! 1. [`resolve_profile`] — the job's profile among the configured ones
//!    (falling back to the default), its first deployment with a usable
//!    key, and the orchestrator its `orchestrator` name resolves to among
//!    the registered ones. No resolvable deployment (or one whose client
//!    cannot be built) ends the job at once.
//! 2. [`invocation_context`] — the [`InvocationContext`] every tool job
//!    carries in its headers, with the deadline.
//! 3. [`conversation`] — the system prompt, then the job's messages.
//! 4. [`permitted_tools`] — the tools the invocation may use at all, from
//!    the registry snapshot (agent tools, then the live catalog) through
//!    the gates of [`gating`](crate::gating): system, profile, selected
//!    and agent tools; purpose, `visibleIn`, provider confidence,
//!    liveness. The model is offered none of them yet:
//! 5. [`scope::choose`](crate::scope::choose) (async, after `build`) picks
//!    the tools offered first — all of them, or the most relevant, or what
//!    a planning call names — and the `search_tools` meta-tool when some
//!    were left out.
//!
//! # Adding a step
//!
//! Steps that shape what the model sees before its first call go here, as
//! one more function called from [`build`] in its place: **preemptive
//! retrieval** runs after step 4, calls tools through the fleet, and adds what it
//! found to [`Invocation::messages`] — its citations reach the client with
//! the first `references` event, published right after `started`. A step
//! fails the job by returning a [`Failure`].

use std::collections::BTreeMap;
use std::sync::Arc;

use toolfleet_config::ResolvedProfile;
use toolfleet_llm::{Message, ToolSpec};
use toolfleet_protocol::tools::CompiledTool;
use toolfleet_protocol::{ChatJob, ChatRole, InvocationContext, Reference};
use tracing::info;

use crate::{DEFAULT_SYSTEM_PROMPT, Failure, Fleet, UsageLedger};

/// One chat job on its way to an answer.
#[derive(Debug)]
pub struct Invocation {
    /// The job as submitted.
    pub job: ChatJob,
    /// The profile, deployment and orchestrator name the job runs with.
    pub profile: ResolvedProfile,
    /// The context every tool job of the invocation carries.
    pub ctx: InvocationContext,
    /// The conversation so far, system prompt first.
    pub messages: Vec<Message>,
    /// The tools offered to the model. A call runs when its tool is among
    /// these, or among the permitted ones ([`Scope::permitted`](crate::scope::Scope):
    /// scoping bounds what the model is shown, the gates what may run); any
    /// other call is answered with close names and not run.
    pub tools: Vec<Arc<CompiledTool>>,
    /// The tools the invocation may use, and how the offered ones were
    /// chosen among them.
    pub scope: crate::scope::Scope,
    /// How deep in agent calls this job runs (0: a client's job).
    pub agent_depth: u32,
    /// Unix time in milliseconds after which nobody waits for the answer.
    pub deadline_ms: u64,
    /// The model calls so far.
    pub usage: UsageLedger,
    /// The references this run's own tool calls returned.
    pub citations: Citations,
    /// When the run last read its cancel tombstone (see [`CancelCheck`]).
    pub cancel_check: CancelCheck,
}

/// When a run last read its invocation's cancel tombstone and found none
/// (at its start, then at each lease renewal). Its tool jobs are marked
/// new calls (`Toolfleet-New-Call`: a worker may then answer for the
/// tombstone from its memory of cancels) only while that read is fresh, so
/// a cancel published more than [`CancelCheck::FRESH_MS`] plus the
/// tombstone's write before a marked job is always one the run would have
/// stopped for. A run that cannot read Redis marks nothing, and workers
/// read the tombstone themselves.
#[derive(Debug, Clone, Default)]
pub struct CancelCheck(Arc<std::sync::atomic::AtomicU64>);

impl CancelCheck {
    /// How long a tombstone read counts as fresh.
    pub const FRESH_MS: u64 = 3_000;

    /// The tombstone was read just now, and absent.
    pub fn passed(&self) {
        self.0.store(
            toolfleet_protocol::now_ms(),
            std::sync::atomic::Ordering::Release,
        );
    }

    /// Whether the last read is fresh enough to mark a tool job new.
    pub fn fresh(&self) -> bool {
        let at = self.0.load(std::sync::atomic::Ordering::Acquire);
        at != 0 && toolfleet_protocol::now_ms().saturating_sub(at) < Self::FRESH_MS
    }
}

/// The references of one run, by index, as its own tool calls returned
/// them — never read back from the store, so a reference some other job
/// wrote under this invocation's id, a dead earlier run's, or one Redis
/// lost, cannot reach `completed`.
#[derive(Debug, Default, Clone, serde::Serialize, serde::Deserialize)]
pub struct Citations {
    by_index: BTreeMap<u64, Reference>,
    /// The highest index already sent in a `references` event.
    published: u64,
}

impl Citations {
    /// The highest index this run has seen: every tool job carries it, and
    /// a worker's new indices are above it even if Redis lost its counter.
    pub fn floor(&self) -> u64 {
        self.by_index.last_key_value().map_or(0, |(i, _)| *i)
    }

    /// Adds a call's references. The same reference again (a replayed
    /// result) is fine; a different one under a known index means the
    /// store handed an index out twice (it lost its counter mid-round),
    /// and the invocation fails rather than cite the wrong document.
    pub fn add(&mut self, refs: &[Reference]) -> Result<(), Failure> {
        for r in refs {
            match self.by_index.get(&r.index) {
                Some(known) if known != r => {
                    return Err(Failure::new(
                        "citation_conflict",
                        format!(
                            "two tool calls were given citation [doc:{}] (the citation store lost its counter, e.g. Redis restarted without persistence); the answer could cite the wrong document",
                            r.index
                        ),
                    ));
                }
                Some(_) => {}
                None => {
                    self.by_index.insert(r.index, r.clone());
                }
            }
        }
        Ok(())
    }

    /// The references not yet published, in index order; marks them
    /// published.
    pub fn unpublished(&mut self) -> Vec<Reference> {
        let new: Vec<Reference> = self
            .by_index
            .range(self.published + 1..)
            .map(|(_, r)| r.clone())
            .collect();
        if let Some(last) = new.last() {
            self.published = last.index;
        }
        new
    }

    /// Every reference, in index order.
    pub fn all(&self) -> Vec<Reference> {
        self.by_index.values().cloned().collect()
    }
}

impl Invocation {
    /// The conversation model.
    pub fn model(&self) -> &str {
        self.profile.model()
    }

    /// The offered tool a model calls by `function_name`.
    pub fn tool(&self, function_name: &str) -> Option<&Arc<CompiledTool>> {
        self.tools
            .iter()
            .find(|t| t.definition.function.name == function_name)
    }

    /// The offered tools as the model sees them, with `search_tools` when
    /// tools were left out and the model may still add some.
    pub fn tool_specs(&self) -> Vec<Arc<ToolSpec>> {
        let mut specs: Vec<Arc<ToolSpec>> = self.tools.iter().map(|t| t.spec.clone()).collect();
        if self.scope.can_expand(self.tools.len()) {
            specs.push(crate::scope::search_tools_spec());
        }
        specs
    }

    /// The ids of the offered tools (`ns:name@x.y.z`).
    pub fn tool_ids(&self) -> Vec<String> {
        self.tools
            .iter()
            .map(|t| t.definition.id.to_string())
            .collect()
    }
}

/// Builds the invocation of `job`, step by step (see the module docs).
pub fn build(
    fleet: &Fleet,
    job: ChatJob,
    deadline_ms: u64,
    agent_depth: u32,
) -> Result<Invocation, Failure> {
    let profile = resolve_profile(fleet, &job)?;
    let ctx = invocation_context(&job, &profile, deadline_ms);
    let messages = conversation(&job, &profile);
    let scope = permitted_tools(fleet, &job, &profile, &ctx, agent_depth)?;
    Ok(Invocation {
        job,
        profile,
        ctx,
        messages,
        tools: Vec::new(),
        scope,
        agent_depth,
        deadline_ms,
        usage: UsageLedger::default(),
        citations: Citations::default(),
        cancel_check: CancelCheck::default(),
    })
}

/// Step 1: the profile the job named (or the default), its deployment, and
/// its orchestrator among those registered in the configuration.
pub fn resolve_profile(fleet: &Fleet, job: &ChatJob) -> Result<ResolvedProfile, Failure> {
    let config = fleet.config();
    let resolved = config
        .profiles
        .resolve_among(
            job.profile.as_deref(),
            &*config.env,
            &config.orchestrator_names(),
        )
        .map_err(|e| Failure::new(e.code(), e.to_string()))?;
    // A deployment whose client cannot be built fails the job here, before
    // `started`, like one that does not resolve.
    fleet.llm_for(&resolved)?;
    if resolved.fell_back || resolved.orchestrator_fell_back {
        info!(profile = %resolved.name, requested = ?resolved.requested, orchestrator = %resolved.orchestrator, "profile or orchestrator fell back to the default");
    }
    Ok(resolved)
}

/// Step 2: the context tool jobs carry. The data source is the job's, or
/// the profile's when the job names none.
pub fn invocation_context(
    job: &ChatJob,
    profile: &ResolvedProfile,
    deadline_ms: u64,
) -> InvocationContext {
    InvocationContext {
        invocation_id: job.invocation_id.clone(),
        tenant: job.tenant.clone(),
        user: job.user.clone(),
        profile: Some(profile.name.clone()),
        provider: job.provider.clone(),
        connection: job.connection.clone(),
        resource: job.resource.clone(),
        data_source_id: job
            .data_source_id
            .clone()
            .or_else(|| profile.profile.data_source.clone()),
        attached_documents: job.attached_documents.clone(),
        provider_confidence: job.provider_confidence,
        deadline_ms: Some(deadline_ms),
        traceparent: job.traceparent.clone(),
    }
}

/// Step 3: the profile's system prompt (or [`DEFAULT_SYSTEM_PROMPT`]),
/// then the job's messages as they came.
pub fn conversation(job: &ChatJob, profile: &ResolvedProfile) -> Vec<Message> {
    let mut messages = Vec::with_capacity(job.messages.len() + 2);
    messages.push(Message::System {
        content: profile
            .profile
            .system_prompt
            .clone()
            .unwrap_or_else(|| DEFAULT_SYSTEM_PROMPT.to_string()),
    });
    messages.extend(job.messages.iter().map(|m| match m.role {
        ChatRole::System => Message::System {
            content: m.content.clone(),
        },
        ChatRole::User => Message::User {
            content: m.content.clone(),
        },
        ChatRole::Assistant => Message::Assistant {
            content: Some(m.content.clone()),
            tool_calls: Vec::new(),
            opaque: Vec::new(),
        },
    }));
    messages
}

/// Step 4: the tools the invocation may use (see [`gating`](crate::gating)),
/// from the registry snapshot of the latest catalog reading.
pub fn permitted_tools(
    fleet: &Fleet,
    job: &ChatJob,
    profile: &ResolvedProfile,
    ctx: &InvocationContext,
    agent_depth: u32,
) -> Result<crate::scope::Scope, Failure> {
    let snapshot = fleet.tool_snapshot();
    let gate = crate::gating::Gate {
        documents: !job.attached_documents.is_empty(),
        data_source: ctx.data_source_id.is_some(),
        surface: job.surface(),
        provider_confidence: job.provider_confidence.unwrap_or(0.0),
        agents: agent_depth < fleet.config().profiles.max_agent_depth,
        own_profile: &profile.name,
    };
    let permitted = crate::gating::permitted(&snapshot.registry, &profile.profile, job, &gate)?;
    Ok(crate::scope::Scope::new(
        snapshot,
        permitted,
        profile.profile.scoping,
    ))
}

#[cfg(test)]
mod tests {

    #[test]
    fn a_tombstone_read_counts_as_fresh_for_three_seconds() {
        let check = CancelCheck::default();
        assert!(!check.fresh(), "never read");
        check.passed();
        assert!(check.fresh());
        check.0.store(
            toolfleet_protocol::now_ms() - CancelCheck::FRESH_MS - 1,
            std::sync::atomic::Ordering::Release,
        );
        assert!(!check.fresh(), "stale");
    }

    use super::*;

    fn reference(index: u64, call: &str, title: &str) -> Reference {
        Reference {
            index,
            kind: "document".into(),
            title: title.into(),
            source: None,
            url: None,
            snippet: None,
            tool_id: Some("testing:t@1.0.0".into()),
            call_id: Some(call.into()),
        }
    }

    #[test]
    fn citations_publish_once_keep_a_floor_and_refuse_a_reused_index() {
        let mut c = Citations::default();
        assert_eq!(c.floor(), 0);
        c.add(&[reference(1, "a", "one"), reference(2, "a", "two")])
            .unwrap();
        assert_eq!(c.floor(), 2);
        assert_eq!(c.unpublished().len(), 2);
        assert!(c.unpublished().is_empty());
        // A replayed result brings the same references again: fine.
        c.add(&[reference(2, "a", "two")]).unwrap();
        assert!(c.unpublished().is_empty());
        // Another call given a known index: the store lost its counter.
        let e = c.add(&[reference(2, "b", "other")]).unwrap_err();
        assert_eq!(e.code, "citation_conflict");
        c.add(&[reference(3, "b", "three")]).unwrap();
        let new = c.unpublished();
        assert_eq!(new.len(), 1);
        assert_eq!(new[0].index, 3);
        assert_eq!(
            c.all().iter().map(|r| r.index).collect::<Vec<_>>(),
            [1, 2, 3]
        );
    }
}
