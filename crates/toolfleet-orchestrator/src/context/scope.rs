//! Scoping, a step of the context stage: which of the permitted tools the
//! model is offered first (the scoring, planning prompt and parsing are
//! pure functions in [`scoring`]).
//!
//! [`choose`] runs once per invocation, before `started`, with the
//! profile's `ScopingPolicy`:
//!
//! - up to `scoping_threshold` permitted tools: all are offered (`all`);
//! - above it: token-overlap relevance against the latest user message and
//!   the last assistant message picks the top `initial_tool_count`, the
//!   profile's must-include tools always in (`token`);
//! - above `planning_threshold`: a planning call to the profile's utility
//!   model (its deployment's model when it names none; temperature 0.1, at
//!   most 300 output tokens, the last `planning_history_message_count`
//!   messages) names categories or tools (`planning`). A planning call that
//!   fails, times out or answers something unparseable falls back to token
//!   scoring (`planning_fallback`), and the `scoping` event says why.
//!
//! When tools were left out, the model is also offered `search_tools`
//! ([`crate::rounds`] runs it), and a call naming a tool that was not
//! offered is answered with close names
//! ([`Invocation::unknown_tool_message`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use toolfleet_llm::ChatRequest;
use toolfleet_protocol::ChatEventBody;
use toolfleet_protocol::tools::CompiledTool;
use tracing::{info, warn};

use crate::tools::Scope;
use crate::tools::scoring::{self, Stage};
use crate::usage::ModelCall;
use crate::{Fleet, Invocation};

/// The `purpose` label of planning calls.
pub const PURPOSE_PLANNING: &str = "planning";
/// How long a planning call may take before token scoring is used.
pub const PLANNING_TIMEOUT: Duration = Duration::from_secs(15);
/// Sampling temperature of planning calls.
pub const PLANNING_TEMPERATURE: f32 = 0.1;
/// Output tokens of a planning call.
pub const PLANNING_MAX_TOKENS: u32 = 300;
/// Candidates listed in a planning prompt (the most relevant first).
pub const PLANNING_CANDIDATES: usize = 100;

/// Picks the tools offered first (see the module docs), sets
/// [`Invocation::tools`], and returns the `scoping` event.
pub async fn choose(fleet: &Fleet, inv: &mut Invocation) -> ChatEventBody {
    let policy = inv.profile.profile.scoping;
    let permitted = inv.scope.permitted.tools.clone();
    let n = permitted.len();
    let mut notes = inv.scope.permitted.notes.clone();
    let query = || scoring::scoring_query(&inv.messages);
    let (decision, tools) = match scoring::stage(n, inv.scope.has_mcp_tools(), &policy) {
        Stage::All => ("all", permitted),
        Stage::Relevance => ("token", token_choice(inv, &query())),
        Stage::Planning => {
            let query = query();
            match plan(fleet, inv, &query).await {
                Ok((tools, plan_notes)) => {
                    notes.extend(plan_notes);
                    ("planning", tools)
                }
                Err(why) => {
                    warn!(invocation_id = %inv.job.invocation_id, reason = %why, "tool planning failed; token scoring used");
                    notes.push(format!("planning failed, token scoring used: {why}"));
                    ("planning_fallback", token_choice(inv, &query))
                }
            }
        }
    };
    fleet
        .metrics()
        .scoping_decisions
        .with_label_values(&[decision])
        .inc();
    inv.tools = tools;
    if decision != "all" {
        info!(invocation_id = %inv.job.invocation_id, decision, permitted = n, offered = inv.tools.len(), "tools scoped");
    }
    ChatEventBody::Scoping {
        decision: decision.to_string(),
        permitted: n,
        tools: inv.tool_ids(),
        added: Vec::new(),
        note: (!notes.is_empty()).then(|| notes.join("; ")),
    }
}

/// The must-include tools, then the most relevant, within the policy.
fn token_choice(inv: &Invocation, query: &str) -> Vec<Arc<CompiledTool>> {
    let scope = &inv.scope;
    let candidates = scope.candidates();
    let must = must_include_positions(scope);
    let selection = scoring::by_relevance(
        &scope.snapshot.index,
        &candidates,
        query,
        &scope.policy,
        &must,
    );
    scope.tools_at(&selection.chosen)
}

fn must_include_positions(scope: &Scope) -> Vec<usize> {
    scope
        .permitted
        .must_include
        .iter()
        .filter_map(|id| scope.snapshot.registry.get(id))
        .filter_map(|e| scope.snapshot.position(&e.tool))
        .collect()
}

/// The planning call: the utility model names categories or tools among
/// the most relevant candidates. A utility model that fails (no answer in
/// time, an error, a plan naming nothing usable) hands over to the
/// conversation's own model before token scoring takes over.
async fn plan(
    fleet: &Fleet,
    inv: &mut Invocation,
    query: &str,
) -> Result<(Vec<Arc<CompiledTool>>, Vec<String>), String> {
    let candidates = Candidates::of(inv, query);
    let utility = inv.profile.utility_model().to_string();
    let main = inv.model().to_string();
    match plan_with(fleet, inv, &utility, &candidates).await {
        Err(why) if utility != main => {
            warn!(invocation_id = %inv.job.invocation_id, utility = %utility, reason = %why, "the utility model failed to plan; the main model plans");
            let (tools, mut notes) =
                plan_with(fleet, inv, &main, &candidates)
                    .await
                    .map_err(|e| {
                        format!(
                            "the utility model {utility} failed ({why}), and so did {main}: {e}"
                        )
                    })?;
            notes.insert(
                0,
                format!("the utility model {utility} failed ({why}); {main} planned"),
            );
            Ok((tools, notes))
        }
        planned => planned,
    }
}

/// What a planning prompt lists: the permitted tools' snapshot positions,
/// their ranking for the query, and the prompt's messages.
struct Candidates {
    positions: Vec<usize>,
    ranked: Vec<scoring::Scored>,
    messages: Vec<toolfleet_llm::Message>,
}

impl Candidates {
    fn of(inv: &Invocation, query: &str) -> Self {
        let scope = &inv.scope;
        let index = &scope.snapshot.index;
        let positions = scope.candidates();
        let mask = scoring::candidate_mask(index.len(), &positions);
        let is_allowed = |p: usize| mask[p];
        let ranked = index.score(query, is_allowed);
        let mut listed: Vec<&CompiledTool> = ranked
            .iter()
            .take(PLANNING_CANDIDATES)
            .filter_map(|s| index.tool(s.position).map(|t| &**t))
            .collect();
        if listed.len() < PLANNING_CANDIDATES {
            // Not enough relevant tools: list the rest in id order.
            for t in &scope.permitted.tools {
                if listed.len() >= PLANNING_CANDIDATES {
                    break;
                }
                if !listed.iter().any(|l| l.definition.id == t.definition.id) {
                    listed.push(t);
                }
            }
        }
        let categories = index.categories(is_allowed);
        let messages = scoring::planning_messages(
            &inv.messages,
            &listed,
            &categories,
            &scope.policy,
            inv.profile.profile.planning_prompt.as_deref(),
        );
        Self {
            positions,
            ranked,
            messages,
        }
    }
}

/// One planning call on `model`, and the tools its plan picks.
async fn plan_with(
    fleet: &Fleet,
    inv: &mut Invocation,
    model: &str,
    candidates: &Candidates,
) -> Result<(Vec<Arc<CompiledTool>>, Vec<String>), String> {
    let text = ask(fleet, inv, model, candidates.messages.clone()).await?;
    let plan = scoring::parse_plan(&text).map_err(|e| e.to_string())?;
    let scope = &inv.scope;
    let must = must_include_positions(scope);
    let selection = scoring::apply_plan(
        &plan,
        &scope.snapshot.index,
        &candidates.positions,
        &candidates.ranked,
        &scope.policy,
        &must,
    );
    let mut notes = Vec::new();
    if !selection.unknown.is_empty() {
        notes.push(format!(
            "the plan named tools that are not permitted: {}",
            selection.unknown.join(", ")
        ));
    }
    if !selection.unknown_categories.is_empty() {
        notes.push(format!(
            "the plan named unknown categories: {}",
            selection.unknown_categories.join(", ")
        ));
    }
    if selection.unknown.len() == plan.tools.len()
        && selection.unknown_categories.len() == plan.categories.len()
    {
        return Err(format!(
            "the plan named no permitted tool or category ({})",
            crate::text::shorten(&text, 200)
        ));
    }
    Ok((scope.tools_at(&selection.chosen), notes))
}

/// The planning request to `model` (on the profile's deployment): its
/// answer's text, with its metrics and usage recorded.
async fn ask(
    fleet: &Fleet,
    inv: &mut Invocation,
    model: &str,
    messages: Vec<toolfleet_llm::Message>,
) -> Result<String, String> {
    let request = ChatRequest {
        model: model.to_string(),
        messages,
        tools: Vec::new(),
        tool_choice: None,
        parallel_tool_calls: false,
        temperature: Some(PLANNING_TEMPERATURE),
        max_tokens: Some(PLANNING_MAX_TOKENS),
        service_tier: inv.service_tier(),
        // The planning prompt holds the candidate tools, which differ
        // from question to question: nothing for a cache to share.
        prompt_cache_key: None,
    };
    // Under the tenant's limits like any model call; a refusal makes the
    // plan fail (token scoring is used) and the conversation's own call
    // then ends the run with it. Warnings are sent by that call.
    fleet.admit_model_call(inv).await.map_err(|f| f.message)?;
    let llm = fleet.llm_for(&inv.profile).map_err(|f| f.message)?;
    let started = Instant::now();
    // Never more than half of what is left: a hung plan must leave the
    // conversation time to run on token scoring.
    let left = Duration::from_millis(inv.deadline_ms.saturating_sub(toolfleet_protocol::now_ms()));
    let limit = PLANNING_TIMEOUT.min(left / 2);
    let completion = tokio::time::timeout(limit, llm.stream_chat(&request, |_| {}))
        .await
        .map_err(|_| format!("no answer within {} ms", limit.as_millis()))?;
    let m = fleet.metrics();
    m.llm_request_duration
        .with_label_values(&[model])
        .observe(started.elapsed().as_secs_f64());
    let completion = match completion {
        Ok(c) => c,
        Err(e) => {
            m.llm_requests.with_label_values(&[model, e.code()]).inc();
            return Err(format!("the planning call failed: {e}"));
        }
    };
    m.llm_requests.with_label_values(&[model, "ok"]).inc();
    let usage = completion.usage.unwrap_or_default();
    inv.usage.record(
        m,
        ModelCall {
            model,
            purpose: PURPOSE_PLANNING,
            usage,
            cost: fleet.config().profiles.prices.cost(model, &usage),
            attempts: completion.attempts,
        },
    );
    Ok(completion.text)
}
