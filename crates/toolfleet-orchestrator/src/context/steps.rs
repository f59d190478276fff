//! The built-in steps of the context stage, as plain functions (the
//! handlers in [`super`] call them; resuming a parked invocation calls the
//! first ones again).

use toolfleet_config::ResolvedProfile;
use toolfleet_llm::Message;
use toolfleet_protocol::{ChatJob, ChatRole, InvocationContext};
use tracing::info;

use crate::failure::ChatErrorCode;
use crate::invocation::trust_from;
use crate::sinks::{self, Route};
use crate::{Failure, Fleet, Invocation};

/// The system prompt of a profile that sets none.
pub const DEFAULT_SYSTEM_PROMPT: &str = "You are a helpful assistant with tools. When a tool result contains markers like [doc:3], cite the passages you use with those exact markers.";

/// The profile the job named (or its tenant's default) if its tenant may
/// use it, its deployment, and its orchestrator among `orchestrators` (the
/// registered names). A profile that is not configured, or that the
/// tenant may not use, fails the job (`unknown_profile`,
/// `profile_not_allowed`): it never runs on another one.
pub fn resolve_profile(
    fleet: &Fleet,
    job: &ChatJob,
    orchestrators: &[&str],
) -> Result<ResolvedProfile, Failure> {
    let config = fleet.config();
    let resolved = config
        .profiles
        .resolve_among(
            job.tenant(),
            job.profile.as_deref(),
            &*config.env,
            orchestrators,
        )
        .map_err(|e| Failure::new(e.code(), e.to_string()))?;
    // A deployment whose client cannot be built fails the job here, before
    // `started`, like one that does not resolve.
    fleet.llm_for(&resolved)?;
    if resolved.orchestrator_fell_back {
        info!(profile = %resolved.name, orchestrator = %resolved.orchestrator, "orchestrator fell back to the default");
    }
    Ok(resolved)
}

/// The context tool jobs carry. The data source is the job's, or the
/// profile's when the job names none. Trust is the fleet's: provider
/// confidence, provider and connection are those of the deployment in use
/// ([`trust_from`]), and the user is the job's only
/// when the operator trusts its tenant to assert users (`trust_user`).
pub fn invocation_context(
    job: &ChatJob,
    profile: &ResolvedProfile,
    deadline_ms: u64,
    trust_user: bool,
) -> InvocationContext {
    let mut ctx = InvocationContext {
        invocation_id: job.invocation_id.clone(),
        tenant: job.tenant.clone(),
        user: job.user.clone().filter(|_| trust_user),
        profile: Some(profile.name.clone()),
        provider: None,
        connection: None,
        resource: job.resource.clone(),
        data_source_id: job
            .data_source_id
            .clone()
            .or_else(|| profile.profile.data_source.clone()),
        attached_documents: job.attached_documents.clone(),
        provider_confidence: None,
        deadline_ms: Some(deadline_ms),
        traceparent: job.traceparent.clone(),
        tenant_limits: None,
        priority: job.priority.unwrap_or_default(),
    };
    trust_from(&mut ctx, profile);
    ctx
}

/// The data sources the invocation names — its data source (the job's or
/// its profile's) and the collections of its attached documents
/// (`<collection>:<path>`) — are ones its tenant may use: a declared one
/// that does not allow the tenant fails the job with
/// `data_source_not_allowed`. Undeclared ids pass (the retrieval store
/// keeps each tenant's data apart anyway).
pub fn check_data_sources(fleet: &Fleet, ctx: &InvocationContext) -> Result<(), Failure> {
    let config = &fleet.config().profiles;
    let tenant = ctx.tenant();
    let named = ctx
        .data_source_id
        .iter()
        .map(|d| (d.as_str(), "data source"));
    let attached = ctx
        .attached_documents
        .iter()
        .filter_map(|d| Some((d.split_once(':')?.0, "attached document's data source")));
    for (id, what) in named.chain(attached) {
        if !config.data_source_allows(id, tenant) {
            return Err(Failure::new(
                ChatErrorCode::DataSourceNotAllowed,
                format!("tenant {tenant:?} may not use the {what} {id:?}"),
            ));
        }
    }
    Ok(())
}

/// The profile's system prompt (or [`DEFAULT_SYSTEM_PROMPT`]),
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

/// The invocation's route: the job's own sink, else its profile's, else
/// none. A job's sink that is refused is an `invalid_sink` failure.
pub fn route_for(fleet: &Fleet, inv: &Invocation) -> Result<Option<Route>, Failure> {
    // A job an agent tool started answers its caller, not a sink: its
    // events reach the caller's route as the caller's tool result.
    if inv.agent_depth > 0 {
        return Ok(None);
    }
    let config = fleet.config();
    sinks::resolve(
        &config.sinks,
        &config.subjects,
        &config.profiles.sinks,
        inv.job.sink.as_ref(),
        inv.profile.profile.sink.as_deref(),
        inv.job.tenant(),
    )
    .map_err(|(kind, failure)| {
        if let Some(kind) = kind {
            fleet
                .metrics
                .sinks
                .deliveries
                .with_label_values(&[kind, "refused"])
                .inc();
        }
        failure
    })
}
