//! [`Invocation`]: one chat job on its way to an answer — the value the
//! context stage builds and every later stage works on — with its
//! [`Citations`] and its [`CancelCheck`].

use std::collections::BTreeMap;
use std::sync::Arc;

use toolfleet_config::ResolvedProfile;
use toolfleet_llm::{Message, ToolSpec};
use toolfleet_protocol::tools::CompiledTool;
use toolfleet_protocol::{ChatJob, InvocationContext, Priority, Reference};

use crate::failure::ChatErrorCode;
use crate::tools::{Scope, scoring};
use crate::{Failure, UsageLedger};

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
    /// these, or among the permitted ones ([`Scope::permitted`]:
    /// scoping bounds what the model is shown, the gates what may run); any
    /// other call is answered with close names and not run.
    pub tools: Vec<Arc<CompiledTool>>,
    /// The tools the invocation may use, and how the offered ones were
    /// chosen among them.
    pub scope: Scope,
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
    /// The job's thread's conversation, tapped as the run goes (a job
    /// that names a thread: [`threads`](crate::threads)).
    pub thread: Option<crate::threads::tap::ThreadTap>,
}

impl Invocation {
    /// The `service_tier` of this invocation's model calls: its
    /// deployment's `batch_service_tier` for a batch job, else none.
    pub fn service_tier(&self) -> Option<String> {
        (self.job.priority == Some(Priority::Batch))
            .then(|| self.profile.deployment.batch_service_tier.clone())
            .flatten()
    }

    /// The priority this invocation runs with (intake sets it on the job
    /// from its lane, its own field and its profile).
    pub fn priority(&self) -> Priority {
        self.job.priority.unwrap_or_default()
    }
}

/// Sets the trust `ctx` carries from the deployment `profile` is on: its
/// `confidence`, its provider and its name — never anything a chat job
/// claimed. Set again when the invocation moves to a fallback deployment
/// ([`Invocation::use_deployment`]), so tool jobs carry the trust of the
/// deployment whose model asked for them.
pub fn trust_from(ctx: &mut InvocationContext, profile: &ResolvedProfile) {
    ctx.provider_confidence = Some(profile.provider_confidence());
    ctx.provider = Some(profile.provider());
    ctx.connection = Some(profile.connection().to_owned());
}

/// When a run last read its invocation's cancel tombstone and found none
/// (at its start, then at each lease renewal). Its tool jobs are marked
/// new calls (`Toolfleet-New-Call`: a worker may then answer for the
/// tombstone from its memory of cancels, and skips the ledger read) only
/// while that read is fresh, so a cancel published more than
/// [`CancelCheck::FRESH_MS`] plus the tombstone's write before a marked job
/// is always one the run would have stopped for. A run that cannot read
/// Redis marks nothing, and workers read the tombstone themselves; nor
/// does a replayed run ([`CancelCheck::for_replay`]), whose calls may
/// already have results in the ledger.
///
/// It also carries whether the run's lease is in doubt (its renewals
/// failing, [`CancelCheck::lease_in_doubt`]): no tool job goes out while
/// it is ([`CancelCheck::lease_held`]).
#[derive(Debug, Clone, Default)]
pub struct CancelCheck(Arc<Checks>);

#[derive(Debug)]
struct Checks {
    /// When the tombstone was last read absent (Unix ms; 0 never,
    /// [`NEVER`] for a replay).
    read_at: std::sync::atomic::AtomicU64,
    in_doubt: tokio::sync::watch::Sender<bool>,
}

impl Default for Checks {
    fn default() -> Self {
        Self {
            read_at: std::sync::atomic::AtomicU64::new(0),
            in_doubt: tokio::sync::watch::Sender::new(false),
        }
    }
}

/// A [`CancelCheck`] that is never fresh.
const NEVER: u64 = u64::MAX;

impl CancelCheck {
    /// How long a tombstone read counts as fresh.
    pub const FRESH_MS: u64 = 3_000;

    /// The check of a replayed run (its chat job, or the decision that
    /// resumes it, delivered again): its calls get the ids the earlier
    /// run's did, so their jobs are never marked new — a worker reads the
    /// ledger, and answers a call that already ran with its result.
    #[must_use]
    pub fn for_replay() -> Self {
        let check = Self::default();
        check
            .0
            .read_at
            .store(NEVER, std::sync::atomic::Ordering::Release);
        check
    }

    /// The tombstone was read just now, and absent.
    pub fn passed(&self) {
        self.passed_at(toolfleet_protocol::now_ms());
    }

    /// The tombstone was read at `at` (Unix ms), and absent (a later read
    /// already noted is kept).
    pub fn passed_at(&self, at: u64) {
        let _ = self.0.read_at.fetch_update(
            std::sync::atomic::Ordering::Release,
            std::sync::atomic::Ordering::Acquire,
            |last| (last != NEVER).then_some(last.max(at)),
        );
    }

    /// Whether the last read is fresh enough to mark a tool job new.
    pub fn fresh(&self) -> bool {
        let at = self.0.read_at.load(std::sync::atomic::Ordering::Acquire);
        at != 0 && at != NEVER && toolfleet_protocol::now_ms().saturating_sub(at) < Self::FRESH_MS
    }

    /// Says whether the run's lease is in doubt (renewals failing, near
    /// its lapse) or held again.
    pub fn lease_in_doubt(&self, doubt: bool) {
        self.0.in_doubt.send_replace(doubt);
    }

    /// Returns once the run's lease is not in doubt (at once, usually):
    /// what a tool job waits for before it goes out.
    pub async fn lease_held(&self) {
        let mut held = self.0.in_doubt.subscribe();
        let _ = held.wait_for(|doubt| !*doubt).await;
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
                        ChatErrorCode::CitationConflict,
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
    /// Moves the invocation to `next` (the profile on another of its
    /// deployments), with that deployment's trust in its context.
    pub fn use_deployment(&mut self, next: ResolvedProfile) {
        self.profile = next;
        trust_from(&mut self.ctx, &self.profile);
    }

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

    /// The tool a call of the model names by `function_name`: an offered
    /// one, or a permitted one scoping left out (it runs when called by
    /// name). The one lookup every stage uses for "which tool is this call".
    pub fn tool_for_call(&self, function_name: &str) -> Option<&Arc<CompiledTool>> {
        self.tool(function_name)
            .or_else(|| self.scope.permitted.by_function_name(function_name))
    }

    /// What events and metrics call the tool of a call named
    /// `function_name`: its id, or the name the model used when no offered
    /// or permitted tool has it.
    pub fn tool_label(&self, function_name: &str) -> String {
        self.tool_for_call(function_name).map_or_else(
            || function_name.to_string(),
            |t| t.definition.id.to_string(),
        )
    }

    /// What the model reads after calling a tool it may not use: close
    /// names among the tools it may use (a permitted tool scoping left out
    /// runs when called by name), and `search_tools` when it may still add
    /// some.
    pub fn unknown_tool_message(&self, name: &str) -> String {
        let offered: Vec<&str> = self
            .tools
            .iter()
            .map(|t| t.definition.function.name.as_str())
            .collect();
        let permitted = self
            .scope
            .permitted
            .tools
            .iter()
            .map(|t| t.definition.function.name.as_str());
        let mut message = format!("Error: there is no tool named {name:?}.");
        let close = scoring::suggest(name, permitted, 3);
        if !close.is_empty() {
            message.push_str(&format!(" Did you mean: {}?", close.join(", ")));
        }
        if self.scope.can_expand(self.tools.len()) {
            message.push_str(&format!(
                " More tools exist than are offered: call {} to find one.",
                scoring::SEARCH_TOOLS
            ));
        }
        message.push_str(&format!(" Available tools: {}.", offered.join(", ")));
        message
    }

    /// The offered tools as the model sees them, in an order that stays
    /// put for the whole invocation (the provider's prompt cache serves
    /// the longest beginning two requests share): the first request's
    /// tools sorted by function name, `search_tools` among them when
    /// tools were left out, then the tools `search_tools` added, in the
    /// order they came. The first call fixes that offer
    /// ([`crate::tools::Scope::fix_first_offer`]); from then on
    /// `search_tools` stays offered even once the caps are reached (a
    /// call is answered that no more tools can be added), so reaching a
    /// cap does not change the requests' beginning.
    pub fn tool_specs(&mut self) -> Vec<Arc<ToolSpec>> {
        let first = self.scope.fix_first_offer(&mut self.tools);
        let mut specs: Vec<Arc<ToolSpec>> = self.tools.iter().map(|t| t.spec.clone()).collect();
        if first.search_tools {
            // A tool of the first offer that has gone since (its worker
            // left, before a resume) shortens it.
            let lead = &specs[..first.tools.min(specs.len())];
            let at = lead.partition_point(|s| s.name.as_str() < scoring::SEARCH_TOOLS);
            specs.insert(at, crate::tools::search_tools_spec());
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

#[cfg(test)]
mod tests {

    #[test]
    fn a_tombstone_read_counts_as_fresh_for_three_seconds() {
        let check = CancelCheck::default();
        assert!(!check.fresh(), "never read");
        check.passed();
        assert!(check.fresh());
        check.0.read_at.store(
            toolfleet_protocol::now_ms() - CancelCheck::FRESH_MS - 1,
            std::sync::atomic::Ordering::Release,
        );
        assert!(!check.fresh(), "stale");
    }

    #[test]
    fn a_replayed_runs_check_is_never_fresh() {
        let check = CancelCheck::for_replay();
        check.passed();
        assert!(!check.fresh());
    }

    #[tokio::test]
    async fn tool_jobs_wait_while_the_lease_is_in_doubt() {
        let check = CancelCheck::default();
        check.lease_held().await;
        check.lease_in_doubt(true);
        let waiting = check.clone();
        let mut held = tokio::spawn(async move { waiting.lease_held().await });
        assert!(
            tokio::time::timeout(std::time::Duration::from_millis(50), &mut held)
                .await
                .is_err(),
            "waits while in doubt"
        );
        check.lease_in_doubt(false);
        held.await.unwrap();
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
