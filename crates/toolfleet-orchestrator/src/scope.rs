//! Scope: which of the permitted tools the model is offered, round by
//! round — the orchestrator's side of progressive scoping (the scoring,
//! planning prompt and parsing are in [`scoping`]).
//!
//! [`choose`] runs once per invocation, before `started`, with the
//! profile's [`ScopingPolicy`]:
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
//! ([`search_tools_call`]): a call adds the matches to the offered tools
//! from the next round on, at most `max_expansion_rounds` times and never
//! beyond `max_tool_count` tools; each addition is a `scoping` event with
//! decision `expansion`.
//!
//! A call naming a tool that was not offered is answered with close names
//! among the offered ones ([`unknown_tool_message`]), and the loop goes on.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::Value;
use toolfleet_config::ScopingPolicy;
use toolfleet_llm::{ChatRequest, ToolCall, ToolSpec};
use toolfleet_protocol::catalog::Catalog;
use toolfleet_protocol::registry::{Registry, ToolSource};
use toolfleet_protocol::tools::{CompiledTool, ToolId};
use toolfleet_protocol::{ChatEventBody, ToolStatus};
use tracing::{info, warn};

use crate::agents::AgentSource;
use crate::gating::Permitted;
use crate::scoping::{self, RelevanceIndex};
use crate::usage::ModelCall;
use crate::{Events, Fleet, Invocation, ToolOutcome};

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

/// The registry of one catalog generation and its relevance index, shared
/// by every invocation until the catalog changes.
pub struct ToolSnapshot {
    /// The catalog generation it was built from.
    pub generation: u64,
    pub registry: Registry,
    /// Every registry entry's tool, in the registry's (id) order: the
    /// positions the index scores.
    pub tools: Vec<Arc<CompiledTool>>,
    /// Snapshot position by the address of the tool's `Arc` (every tool a
    /// scope holds comes from this snapshot's registry): no string is
    /// built or hashed per tool and invocation.
    positions: HashMap<usize, usize>,
    pub index: RelevanceIndex,
}

impl std::fmt::Debug for ToolSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolSnapshot")
            .field("generation", &self.generation)
            .field("tools", &self.tools.len())
            .finish_non_exhaustive()
    }
}

impl ToolSnapshot {
    /// The registry over the agent tools, then the live catalog (the
    /// configuration's agents win a duplicate id), and its index.
    pub fn build(
        agents: &AgentSource,
        catalog: &Catalog,
        compat: Option<&toolfleet_protocol::registry::CompatFile>,
        profiles: &toolfleet_config::FleetConfig,
    ) -> Self {
        let mut registry =
            Registry::build(&[agents as &dyn ToolSource, catalog as &dyn ToolSource]);
        if let Some(compat) = compat {
            // `<deployment>/<model>`: the deployment's own model, or a
            // profile's utility model on it.
            let known = |model: &str| {
                let Some((deployment, model)) = model.split_once('/') else {
                    return false;
                };
                profiles.deployments.get(deployment).is_some_and(|d| {
                    d.model == model
                        || profiles.profiles.values().any(|p| {
                            p.deployments.iter().any(|n| n == deployment)
                                && p.utility_model.as_deref() == Some(model)
                        })
                })
            };
            let (joined, problems) = registry.with_compat(compat, known);
            registry = joined;
            for p in problems {
                warn!(problem = %p, "tool compat file entry skipped");
            }
        }
        let tools: Vec<Arc<CompiledTool>> = registry.list().map(|e| e.tool.clone()).collect();
        let positions = tools
            .iter()
            .enumerate()
            .map(|(i, t)| (Arc::as_ptr(t) as usize, i))
            .collect();
        let index = RelevanceIndex::build(&tools);
        Self {
            generation: catalog.generation,
            registry,
            tools,
            positions,
            index,
        }
    }

    fn position(&self, tool: &Arc<CompiledTool>) -> Option<usize> {
        self.positions.get(&(Arc::as_ptr(tool) as usize)).copied()
    }
}

/// The tools an invocation may use, and what has been done to pick the
/// offered ones.
#[derive(Debug, Clone)]
pub struct Scope {
    snapshot: Arc<ToolSnapshot>,
    /// Every tool the invocation may use.
    pub permitted: Permitted,
    /// `search_tools` calls that added tools so far.
    pub expansions: u32,
    policy: ScopingPolicy,
}

impl Scope {
    pub fn new(snapshot: Arc<ToolSnapshot>, permitted: Permitted, policy: ScopingPolicy) -> Self {
        Self {
            snapshot,
            permitted,
            expansions: 0,
            policy,
        }
    }

    /// Whether the model may still add tools with `search_tools` when
    /// `offered` are offered: some were left out, expansion rounds and
    /// the tool cap allow it.
    pub fn can_expand(&self, offered: usize) -> bool {
        self.permitted.tools.len() > offered
            && self.expansions < self.policy.max_expansion_rounds
            && offered < self.policy.max_tool_count
    }

    /// The snapshot positions of the permitted tools.
    fn candidates(&self) -> Vec<usize> {
        self.permitted
            .tools
            .iter()
            .filter_map(|t| self.snapshot.position(t))
            .collect()
    }

    /// The tools at snapshot `positions`, in id order.
    fn tools_at(&self, positions: &[usize]) -> Vec<Arc<CompiledTool>> {
        let mut tools: Vec<Arc<CompiledTool>> = positions
            .iter()
            .filter_map(|&p| self.snapshot.index.tool(p).cloned())
            .collect();
        tools.sort_by(|a, b| a.definition.id.cmp(&b.definition.id));
        tools
    }
}

/// Runs `f`, which may take a while (scoring thousands of tools), where it
/// does not hold up other tasks: on a multi-threaded runtime the worker
/// thread is handed over meanwhile.
pub(crate) fn blocking<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current().map(|h| h.runtime_flavor()) {
        Ok(tokio::runtime::RuntimeFlavor::MultiThread) => tokio::task::block_in_place(f),
        _ => f(),
    }
}

/// The `search_tools` meta-tool as the model sees it.
pub fn search_tools_spec() -> Arc<ToolSpec> {
    static SPEC: std::sync::LazyLock<Arc<ToolSpec>> =
        std::sync::LazyLock::new(|| Arc::new(scoping::search_tools_spec()));
    SPEC.clone()
}

/// Picks the tools offered first (see the module docs), sets
/// [`Invocation::tools`], and returns the `scoping` event.
pub async fn choose(fleet: &Fleet, inv: &mut Invocation) -> ChatEventBody {
    let policy = inv.profile.profile.scoping;
    let permitted = inv.scope.permitted.tools.clone();
    let n = permitted.len();
    let mut notes = inv.scope.permitted.notes.clone();
    let (decision, tools) = if n <= policy.scoping_threshold {
        ("all", permitted)
    } else {
        let query = scoping::scoring_query(&inv.messages);
        let by_tokens = |inv: &Invocation| token_choice(inv, &query);
        if n > policy.planning_threshold {
            match plan(fleet, inv, &query).await {
                Ok((tools, plan_notes)) => {
                    notes.extend(plan_notes);
                    ("planning", tools)
                }
                Err(why) => {
                    warn!(invocation_id = %inv.job.invocation_id, reason = %why, "tool planning failed; token scoring used");
                    notes.push(format!("planning failed, token scoring used: {why}"));
                    ("planning_fallback", by_tokens(inv))
                }
            }
        } else {
            ("token", by_tokens(inv))
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
    let selection = scoping::by_relevance(
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
/// the most relevant candidates.
async fn plan(
    fleet: &Fleet,
    inv: &mut Invocation,
    query: &str,
) -> Result<(Vec<Arc<CompiledTool>>, Vec<String>), String> {
    let scope = &inv.scope;
    let index = &scope.snapshot.index;
    let candidates = scope.candidates();
    let mask = scoping::candidate_mask(index.len(), &candidates);
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
    let messages = scoping::planning_messages(&inv.messages, &listed, &categories, &scope.policy);
    let model = inv.profile.utility_model().to_string();
    let request = ChatRequest {
        model: model.clone(),
        messages,
        tools: Vec::new(),
        tool_choice: None,
        parallel_tool_calls: false,
        temperature: Some(PLANNING_TEMPERATURE),
        max_tokens: Some(PLANNING_MAX_TOKENS),
    };
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
        .with_label_values(&[model.as_str()])
        .observe(started.elapsed().as_secs_f64());
    let completion = match completion {
        Ok(c) => c,
        Err(e) => {
            m.llm_requests
                .with_label_values(&[model.as_str(), e.code()])
                .inc();
            return Err(format!("the planning call failed: {e}"));
        }
    };
    m.llm_requests
        .with_label_values(&[model.as_str(), "ok"])
        .inc();
    let usage = completion.usage.unwrap_or_default();
    inv.usage.record(
        m,
        ModelCall {
            model: &model,
            purpose: PURPOSE_PLANNING,
            usage,
            cost: fleet.config().profiles.prices.cost(&model, &usage),
            attempts: completion.attempts,
        },
    );
    let plan = scoping::parse_plan(&completion.text).map_err(|e| e.to_string())?;
    let scope = &inv.scope;
    let must = must_include_positions(scope);
    let selection = scoping::apply_plan(
        &plan,
        &scope.snapshot.index,
        &candidates,
        &ranked,
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
            shorten(&completion.text, 200)
        ));
    }
    Ok((scope.tools_at(&selection.chosen), notes))
}

fn shorten(text: &str, max: usize) -> String {
    crate::dispatch::shorten(text, max)
}

/// Runs a `search_tools` call: the matches among the permitted tools not
/// offered yet join the offered ones (within the caps) from the next
/// round on.
pub fn search_tools_call(
    inv: &mut Invocation,
    call: &ToolCall,
    fleet: &Fleet,
    events: &Events,
) -> ToolOutcome {
    let tool = scoping::SEARCH_TOOLS;
    let arguments: Value = serde_json::from_str(&call.arguments).unwrap_or(Value::Null);
    events.send(ChatEventBody::ToolCall {
        call_id: call.id.clone(),
        tool: tool.to_string(),
        arguments: arguments.clone(),
    });
    let started = Instant::now();
    let m = fleet.metrics();
    let offered = inv.tools.len();
    let (status, content, error_code) = if !inv.scope.can_expand(offered) {
        m.tool_expansions.with_label_values(&["capped"]).inc();
        (
            ToolStatus::Error,
            format!(
                "Error: no more tools can be added (at most {} search_tools calls and {} tools per conversation). Answer with the tools you have.",
                inv.scope.policy.max_expansion_rounds, inv.scope.policy.max_tool_count
            ),
            Some("expansion_capped".to_string()),
        )
    } else {
        let offered_ids: std::collections::HashSet<&ToolId> =
            inv.tools.iter().map(|t| &t.definition.id).collect();
        let pool: Vec<usize> = inv
            .scope
            .permitted
            .tools
            .iter()
            .filter(|t| !offered_ids.contains(&t.definition.id))
            .filter_map(|t| inv.scope.snapshot.position(t))
            .collect();
        let room = inv.scope.policy.max_tool_count.saturating_sub(offered);
        let index = &inv.scope.snapshot.index;
        // Tens of milliseconds over thousands of tools: off the async
        // workers.
        let found = blocking(|| scoping::run_search_tools_in(&arguments, index, &pool, room));
        match found {
            Err(e) => (
                ToolStatus::Error,
                format!("Error: {e}"),
                Some("invalid_arguments".to_string()),
            ),
            Ok(found) => {
                // Every search counts against the rounds, found or not.
                inv.scope.expansions += 1;
                if found.added.is_empty() {
                    m.tool_expansions.with_label_values(&["nothing"]).inc();
                } else {
                    m.tool_expansions.with_label_values(&["added"]).inc();
                    let added: Vec<String> = found
                        .added
                        .iter()
                        .map(|t| t.definition.id.to_string())
                        .collect();
                    inv.tools.extend(found.added);
                    inv.tools
                        .sort_by(|a, b| a.definition.id.cmp(&b.definition.id));
                    events.send(ChatEventBody::Scoping {
                        decision: "expansion".into(),
                        permitted: inv.scope.permitted.tools.len(),
                        tools: inv.tool_ids(),
                        added,
                        note: None,
                    });
                }
                (ToolStatus::Ok, found.text, None)
            }
        }
    };
    events.send(ChatEventBody::ToolResult {
        call_id: call.id.clone(),
        tool: tool.to_string(),
        status,
        duration_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        error_code,
        warnings: Vec::new(),
    });
    ToolOutcome {
        content,
        status,
        references: Vec::new(),
    }
}

/// Runs an agent tool's call with its events and metrics, as dispatch does
/// for worker tools.
pub async fn agent_call(
    inv: &Invocation,
    tool: &Arc<CompiledTool>,
    call: &ToolCall,
    fleet: &Fleet,
    events: &Events,
    spent: &std::sync::Mutex<Vec<toolfleet_protocol::LlmCall>>,
) -> ToolOutcome {
    let id = tool.definition.id.to_string();
    let arguments: Result<Value, _> = serde_json::from_str(&call.arguments);
    events.send(ChatEventBody::ToolCall {
        call_id: call.id.clone(),
        tool: id.clone(),
        arguments: match &arguments {
            Ok(v) => crate::dispatch::redact(v, &tool.definition.sensitive_arguments),
            Err(_) => Value::String("[not JSON]".into()),
        },
    });
    let started = Instant::now();
    let (outcome, error_code) = match arguments {
        Err(e) => (
            ToolOutcome {
                content: format!(
                    "Error: the arguments for {} are not valid JSON ({e}). Send a JSON object.",
                    call.name
                ),
                status: ToolStatus::Error,
                references: Vec::new(),
            },
            Some("invalid_arguments".to_string()),
        ),
        Ok(arguments) => match tool.validate_arguments(&arguments) {
            Err(violations) => (
                ToolOutcome {
                    content: format!(
                        "Error: invalid arguments for {}: {}",
                        call.name,
                        violations
                            .iter()
                            .map(ToString::to_string)
                            .collect::<Vec<_>>()
                            .join("; ")
                    ),
                    status: ToolStatus::Error,
                    references: Vec::new(),
                },
                Some("invalid_arguments".to_string()),
            ),
            Ok(()) => {
                let outcome = crate::agents::run_agent_call(
                    fleet, inv, tool, call, &arguments, events, spent,
                )
                .await;
                let code =
                    (outcome.status != ToolStatus::Ok).then(|| outcome.status.as_str().to_string());
                (outcome, code)
            }
        },
    };
    let elapsed = started.elapsed();
    let m = fleet.metrics();
    m.tool_calls
        .with_label_values(&[id.as_str(), outcome.status.as_str()])
        .inc();
    m.tool_call_duration
        .with_label_values(&[id.as_str()])
        .observe(elapsed.as_secs_f64());
    events.send(ChatEventBody::ToolResult {
        call_id: call.id.clone(),
        tool: id,
        status: outcome.status,
        duration_ms: u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX),
        error_code,
        warnings: Vec::new(),
    });
    outcome
}

/// What the model reads after calling a tool it may not use: close names
/// among the tools it may use (a permitted tool scoping left out runs when
/// called by name), and `search_tools` when it may still add some.
pub fn unknown_tool_message(inv: &Invocation, name: &str) -> String {
    let offered: Vec<&str> = inv
        .tools
        .iter()
        .map(|t| t.definition.function.name.as_str())
        .collect();
    let permitted = inv
        .scope
        .permitted
        .tools
        .iter()
        .map(|t| t.definition.function.name.as_str());
    let mut message = format!("Error: there is no tool named {name:?}.");
    let close = scoping::suggest(name, permitted, 3);
    if !close.is_empty() {
        message.push_str(&format!(" Did you mean: {}?", close.join(", ")));
    }
    if inv.scope.can_expand(inv.tools.len()) {
        message.push_str(&format!(
            " More tools exist than are offered: call {} to find one.",
            scoping::SEARCH_TOOLS
        ));
    }
    message.push_str(&format!(" Available tools: {}.", offered.join(", ")));
    message
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use toolfleet_protocol::tools::{Origin, ToolDefinition};

    fn tool(id: &str, function: &str) -> Arc<CompiledTool> {
        let key = id.split_once('@').unwrap().0.replace(':', ".");
        let v = json!({
            "schemaVersion": 1, "id": id, "implementationKey": key, "title": id,
            "description": "d", "category": "c",
            "function": { "name": function, "description": "d",
                          "parameters": { "type": "object", "properties": {} } }
        });
        Arc::new(
            CompiledTool::new(ToolDefinition::from_value(v, Origin::Named(id.into())).unwrap())
                .unwrap(),
        )
    }

    /// The agents backend comes first: a worker advertising an agent's id
    /// is a counted duplicate; the compat file's models join the registry,
    /// and a model no deployment serves is left out.
    #[test]
    fn a_snapshot_puts_agents_first_and_joins_the_compat_file() {
        let config = toolfleet_config::FleetConfig::from_toml(
            r#"
[deployments.openai]
base_url = "https://api.openai.com/v1"
model = "gpt-4o-mini"
[profiles.default]
deployment = "openai"
[profiles.helper]
deployment = "openai"
agent = { name = "helper", description = "Helps." }
"#,
            "test",
        )
        .unwrap();
        let agents = AgentSource::new(&config).unwrap();
        let catalog =
            Catalog::from_tools([tool("agent:helper@1.0.0", "helper"), tool("t:a@1.0.0", "a")]);
        let compat = toolfleet_protocol::registry::CompatFile::from_json(
            r#"{"tools": {"t:a": ["openai/gpt-4o-mini", "openai/gpt-9"]}}"#,
            "compat.json",
        )
        .unwrap();
        let snapshot = ToolSnapshot::build(&agents, &catalog, Some(&compat), &config);
        let helper = snapshot.registry.get("agent:helper@1.0.0").unwrap();
        assert_eq!(&*helper.source, crate::gating::AGENTS_SOURCE);
        assert_eq!(
            crate::agents::profile_of(&helper.tool),
            Some("helper"),
            "the configuration's agent, not the worker's"
        );
        assert_eq!(snapshot.registry.duplicates().len(), 1);
        assert_eq!(
            snapshot.registry.models_for(&"t:a@1.0.0".parse().unwrap()),
            ["openai/gpt-4o-mini"]
        );
        assert_eq!(snapshot.tools.len(), 2);
    }
}
