//! Agent tools: a profile exposed as a tool.
//!
//! A profile with an `agent` table becomes the tool `agent:<name>@1.0.0`
//! ([`AgentSource`], a registry backend served by the orchestrators
//! themselves). Calling it ([`run_agent_call`]) runs a **nested chat job**
//! over NATS, like any client's: a fresh invocation id, the agent's
//! profile, the parent's tenant, user, data source and attached documents,
//! the surface `agent`, and headers linking it to the parent
//! ([`headers::PARENT_INVOCATION`]) and counting its depth
//! ([`headers::AGENT_DEPTH`]). Any orchestrator copy may take it. While it
//! runs, what it does reaches the parent's events as `tool_progress` of the
//! agent call; its answer comes back as the call's result, with its
//! references given new indices from the **parent's** citation counter
//! (one reservation, keyed by the call, so a repeat reuses them) and its
//! `[doc:N]` markers rewritten to match.
//!
//! The nested job inherits its caller's approval rules
//! ([`headers::REQUIRE_APPROVAL`]: the caller's `require_approval`, itself
//! widened by its own caller's), widening the agent profile's: a tool the
//! caller holds for a person is held in the nested job too, where it
//! cannot wait for one and is answered `blocked` (`approval_unavailable`)
//! without running.
//!
//! A job at the fleet's `max_agent_depth` is offered no agent tool, so
//! nesting stops there whatever the profiles say. The nested job's deadline
//! is the agent's timeout, never past the parent's; when the parent stops
//! waiting (deadline, cancel) the nested job is cancelled.

use std::sync::Arc;
use std::time::Duration;
use toolfleet_protocol::ToolErrorCode;

use serde_json::Value;
use toolfleet_llm::ToolCall;
use toolfleet_protocol::client::{self, ClientError};
use toolfleet_protocol::tools::CompiledTool;
use toolfleet_protocol::{
    AGENT_SURFACE, ChatEventBody, ChatJob, ChatMessage, ChatRole, Reference, ToolStatus, headers,
};
use tracing::warn;

use crate::quota::remaining_budget;
use crate::tools::agents::profile_of;
use crate::{Events, Fleet, Invocation, ToolOutcome};

/// What a failed agent call tells the model.
fn fail(code: &str, message: String) -> ToolOutcome {
    ToolOutcome {
        content: format!("Error ({code}): {message}"),
        status: ToolStatus::Error,
        references: Vec::new(),
    }
}

/// Runs one call of agent tool `tool`: a nested chat job, its progress
/// into `events` as the call's `tool_progress`, its answer as the result.
pub async fn run_agent_call(
    fleet: &Fleet,
    inv: &Invocation,
    tool: &Arc<CompiledTool>,
    call: &ToolCall,
    arguments: &Value,
    events: &Events,
    spent: &std::sync::Mutex<Vec<toolfleet_protocol::LlmCall>>,
) -> ToolOutcome {
    let def = &tool.definition;
    let tool_id = def.id.to_string();
    let Some(profile) = configured_profile(fleet, tool) else {
        return fail(
            "internal_error",
            format!("{tool_id} is not an agent of this configuration"),
        );
    };
    let Some(task) = arguments.get("task").and_then(Value::as_str) else {
        return fail(
            ToolErrorCode::InvalidArguments.as_str(),
            "`task` (a string) is required".into(),
        );
    };
    let left = inv.deadline_ms.saturating_sub(toolfleet_protocol::now_ms());
    // Leave the caller time to answer with what the agent said (or that
    // it said nothing).
    let wait = def
        .timeout_ms
        .min(left.saturating_sub((left / 5).max(2_000)));
    if wait < 1_000 {
        return ToolOutcome {
            content: format!(
                "Error: no time is left to run {} before the invocation's deadline.",
                def.function.name
            ),
            status: ToolStatus::Timeout,
            references: Vec::new(),
        };
    }
    let nested = Nested {
        fleet,
        call,
        tool_id: &tool_id,
        name: &def.function.name,
        wait,
    };
    let answer = match nested
        .ask(
            nested_job(inv, profile, task, wait, remaining_budget(fleet, inv)),
            inv,
            events,
        )
        .await
    {
        Ok(answer) => answer,
        Err(outcome) => return outcome,
    };
    // The nested job's model calls are this call's spend.
    if let Ok(mut spent) = spent.lock() {
        spent.extend(answer.llm_calls.iter().cloned());
    }
    match renumber(
        fleet,
        inv,
        &tool_id,
        &call.id,
        answer.text,
        answer.references,
    )
    .await
    {
        Ok((text, references)) => ToolOutcome {
            content: text,
            status: ToolStatus::Ok,
            references,
        },
        Err(e) => fail(
            "citation_store",
            format!(
                "{} answered, but its citations could not be renumbered: {e}",
                def.function.name
            ),
        ),
    }
}

/// The profile an agent tool runs — only one the configuration exposes
/// as this very agent (gating keeps workers' look-alikes out; this holds
/// whatever calls it).
fn configured_profile<'t>(fleet: &Fleet, tool: &'t CompiledTool) -> Option<&'t str> {
    let id = &tool.definition.id;
    profile_of(tool).filter(|p| {
        fleet
            .config
            .profiles
            .profiles
            .get(*p)
            .and_then(|p| p.agent.as_ref())
            .is_some_and(|a| id.namespace == "agent" && a.name == id.name)
    })
}

/// The nested chat job of an agent call: the agent's profile, the
/// caller's tenant, user, data source and documents, the surface `agent`,
/// a deadline of `wait`, and what is left of the caller's per-run caps as
/// its `budget` (`budget`). It claims no trust (a chat job may not): the
/// nested run takes its provider confidence, provider and connection from
/// the deployment its own profile calls, and its user only if its tenant
/// is trusted to assert users.
fn nested_job(
    inv: &Invocation,
    profile: &str,
    task: &str,
    wait: u64,
    budget: Option<toolfleet_protocol::schedule::RunBudget>,
) -> ChatJob {
    ChatJob {
        invocation_id: client::new_invocation_id(),
        messages: vec![ChatMessage {
            role: ChatRole::User,
            content: task.to_string(),
        }],
        profile: Some(profile.to_string()),
        tenant: inv.job.tenant.clone(),
        user: inv.job.user.clone(),
        resource: inv.job.resource.clone(),
        data_source_id: inv.job.data_source_id.clone(),
        attached_documents: inv.job.attached_documents.clone(),
        timeout_ms: Some(wait),
        traceparent: inv.job.traceparent.clone(),
        tools: Vec::new(),
        surface: Some(AGENT_SURFACE.to_string()),
        // A nested job answers its caller, not the caller's sinks.
        sink: None,
        priority: Some(inv.priority()),
        // A nested job starts at once, under what is left of its
        // caller's budget.
        not_before: None,
        budget,
        // A nested job is one turn of its own: no thread, no key.
        thread_id: None,
        multitask_strategy: None,
        idempotency_key: None,
    }
}

/// One agent call's nested job on its way.
struct Nested<'a> {
    fleet: &'a Fleet,
    call: &'a ToolCall,
    tool_id: &'a str,
    name: &'a str,
    /// How long the call waits for the answer, in ms.
    wait: u64,
}

impl Nested<'_> {
    /// Submits `job` (linked to the parent, one level deeper) and waits
    /// for its answer, passing its progress on; a failure is the call's
    /// outcome.
    async fn ask(
        &self,
        job: ChatJob,
        inv: &Invocation,
        events: &Events,
    ) -> Result<client::ChatOutcome, ToolOutcome> {
        let mut h = async_nats::HeaderMap::new();
        h.insert(headers::PARENT_INVOCATION, inv.job.invocation_id.as_str());
        h.insert(
            headers::AGENT_DEPTH,
            inv.agent_depth.saturating_add(1).to_string().as_str(),
        );
        let rules = &inv.profile.profile.require_approval;
        if !rules.is_empty() {
            let value: Vec<String> = rules.iter().map(ToString::to_string).collect();
            h.insert(headers::REQUIRE_APPROVAL, value.join(",").as_str());
        }
        let subjects = &self.fleet.config.subjects;
        // The nested job is cancelled when this call stops waiting for it
        // before its end (the parent's deadline or cancel drops this future).
        let mut guard = CancelOnDrop {
            client: self.fleet.client.clone(),
            subjects: subjects.clone(),
            tenant: job.tenant().to_string(),
            invocation_id: job.invocation_id.clone(),
            armed: true,
        };
        let name = self.name;
        let progress = |event: &toolfleet_protocol::ChatEvent| {
            if let Some(message) = progress_of(&event.body) {
                events.send(ChatEventBody::ToolProgress {
                    call_id: self.call.id.clone(),
                    tool: self.tool_id.to_string(),
                    message: crate::text::shorten(
                        &format!("{name}: {message}"),
                        toolfleet_protocol::MAX_PROGRESS_CHARS,
                    ),
                });
            }
        };
        let wait = Duration::from_millis(self.wait);
        let outcome =
            client::chat_with_headers(&self.fleet.client, subjects, &job, h, wait, progress).await;
        match outcome {
            Ok(answer) => {
                guard.armed = false;
                Ok(answer)
            }
            Err(ClientError::Timeout(_)) => Err(ToolOutcome {
                content: format!("Error: {name} did not answer within {} ms.", self.wait),
                status: ToolStatus::Timeout,
                references: Vec::new(),
            }),
            Err(ClientError::Failed { code, message }) => {
                guard.armed = false;
                Err(fail(&code, format!("{name} failed: {message}")))
            }
            Err(e) => Err(fail(e.code(), format!("{name} could not run: {e}"))),
        }
    }
}

/// Gives the nested answer's references indices from the parent's
/// counter (above the parent's floor) and rewrites its markers to them.
async fn renumber(
    fleet: &Fleet,
    inv: &Invocation,
    tool_id: &str,
    call_id: &str,
    text: String,
    references: Vec<Reference>,
) -> Result<(String, Vec<Reference>), toolfleet_store::CitationError> {
    if references.is_empty() {
        return Ok((text, references));
    }
    let (stored, map) = fleet
        .store
        .reserve_again(
            toolfleet_store::InvocationKey::new(inv.job.tenant(), &inv.job.invocation_id),
            call_id,
            tool_id,
            references,
            inv.citations.floor(),
        )
        .await?;
    let text = toolfleet_protocol::references::renumber(&text, |n| map.get(&n).copied());
    Ok((text, stored))
}

/// The most inherited approval rules a chat job's header is read for.
const MAX_INHERITED_RULES: usize = 256;

/// The approval rules a nested job's caller passed down
/// ([`headers::REQUIRE_APPROVAL`]); none without the header. Anyone who
/// may submit can set it, and it only ever adds holds, so it is taken as
/// given; an entry that is not a tool ref is skipped.
pub fn inherited_approval(
    h: Option<&async_nats::HeaderMap>,
) -> Vec<toolfleet_protocol::tools::ToolRef> {
    let Some(value) = h.and_then(|h| h.get(headers::REQUIRE_APPROVAL)) else {
        return Vec::new();
    };
    value
        .as_str()
        .split(',')
        .filter_map(|r| r.trim().parse().ok())
        .take(MAX_INHERITED_RULES)
        .collect()
}

/// What of a nested job's event the parent's client sees, in words.
fn progress_of(body: &ChatEventBody) -> Option<String> {
    match body {
        ChatEventBody::Started { .. } => Some("started".into()),
        ChatEventBody::ToolCall { tool, .. } => Some(format!("calling {tool}")),
        ChatEventBody::ToolProgress { tool, message, .. } => Some(format!("{tool}: {message}")),
        ChatEventBody::ToolResult { tool, status, .. } => {
            Some(format!("{tool}: {}", status.as_str()))
        }
        _ => None,
    }
}

/// Cancels a nested job whose caller stopped waiting.
struct CancelOnDrop {
    client: async_nats::Client,
    subjects: toolfleet_protocol::Subjects,
    tenant: String,
    invocation_id: String,
    armed: bool,
}

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        if !self.armed {
            return;
        }
        let client = self.client.clone();
        let subjects = self.subjects.clone();
        let tenant = std::mem::take(&mut self.tenant);
        let id = std::mem::take(&mut self.invocation_id);
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                if let Err(e) = client::cancel(&client, &subjects, &tenant, &id).await {
                    warn!(invocation_id = %id, error = %e, "cannot cancel a nested agent job");
                }
            });
        }
    }
}
