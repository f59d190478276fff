//! The tools an invocation may use, shared by every stage: the registry of
//! one catalog generation ([`ToolSnapshot`]), the declared pools' tools
//! offered while none of their workers is live ([`declared`]), the gates
//! ([`gating`]), the
//! pure scoring and planning functions ([`scoring`]), the agent tools'
//! registry backend ([`agents`]), an invocation's [`Scope`], and what a
//! call came to ([`ToolOutcome`]).
//!
//! Nothing here speaks NATS or HTTP: the context stage and dispatch call
//! these functions and publish what they decide.

pub mod agents;
pub mod declared;
pub mod gating;
pub mod scoring;

use std::collections::HashMap;
use std::sync::Arc;

use toolfleet_config::ScopingPolicy;
use toolfleet_llm::ToolSpec;
use toolfleet_protocol::catalog::Catalog;
use toolfleet_protocol::registry::{DirSource, Registry, ToolSource};
use toolfleet_protocol::tools::CompiledTool;
use toolfleet_protocol::{Reference, ToolStatus};
use tracing::warn;

use agents::AgentSource;
use declared::{DECLARED_SOURCE, DeclaredPools};

/// The worker family that serves tools imported from MCP servers.
pub const MCP_FAMILY: &str = "mcp";
use gating::Permitted;
use scoring::RelevanceIndex;

/// What a tool call came to.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ToolOutcome {
    /// What the model reads.
    pub content: String,
    pub status: ToolStatus,
    /// The references the call's result carried (only those naming the
    /// call itself).
    pub references: Vec<Reference>,
}

impl ToolOutcome {
    /// The outcome of a call that got no answer at all (a bug, or a call
    /// skipped by a turn that ended early): the model is told so.
    pub fn no_result() -> Self {
        Self {
            content: "Error: the call got no result.".into(),
            status: ToolStatus::Error,
            references: Vec::new(),
        }
    }
}

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
    /// configuration's agents win a duplicate id), then the declared
    /// pools' tools no live worker serves (backend `declared`: served by
    /// no worker yet, offered all the same), and its index.
    pub fn build(
        (agents, declared): (&AgentSource, &DeclaredPools),
        catalog: &Catalog,
        compat: Option<&toolfleet_protocol::registry::CompatFile>,
        profiles: &toolfleet_config::FleetConfig,
    ) -> Self {
        // Only those no live worker serves: a live one is the catalog's
        // (its workers' definition), and no duplicate is logged.
        let waiting = DirSource::from_tools(
            DECLARED_SOURCE,
            declared
                .tools()
                .filter(|t| !catalog.is_live(&t.definition.id.to_string()))
                .cloned(),
        );
        let mut registry = Registry::build(&[
            agents as &dyn ToolSource,
            catalog as &dyn ToolSource,
            &waiting as &dyn ToolSource,
        ]);
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

    pub(crate) fn position(&self, tool: &Arc<CompiledTool>) -> Option<usize> {
        self.positions.get(&(Arc::as_ptr(tool) as usize)).copied()
    }
}

/// The tools an invocation may use, and what has been done to pick the
/// offered ones.
#[derive(Debug, Clone)]
pub struct Scope {
    pub(crate) snapshot: Arc<ToolSnapshot>,
    /// Every tool the invocation may use.
    pub permitted: Permitted,
    /// `search_tools` calls so far, found or not (a park record keeps
    /// it, so a resumed run expands no further than the cap).
    pub expansions: u32,
    /// What the first model request offered, once it was made (a park
    /// record keeps it): see [`FirstOffer`].
    pub first_offer: Option<FirstOffer>,
    pub(crate) policy: ScopingPolicy,
}

/// What the first model request of an invocation offered, fixed for the
/// rest of it so every request begins the same way (a provider's prompt
/// cache serves the longest beginning two prompts share, the tools
/// included): its tools lead, sorted by function name, with
/// `search_tools` among them when it was offered; tools a `search_tools`
/// call adds follow them, in the order they were added.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct FirstOffer {
    /// How many of the offered tools the first request had.
    pub tools: usize,
    /// Whether it offered `search_tools`: then every request of the
    /// invocation does, and a call past the caps is answered that no
    /// more tools can be added (`expansion_capped`).
    pub search_tools: bool,
}

impl Scope {
    pub fn new(snapshot: Arc<ToolSnapshot>, permitted: Permitted, policy: ScopingPolicy) -> Self {
        Self {
            snapshot,
            permitted,
            expansions: 0,
            first_offer: None,
            policy,
        }
    }

    /// Fixes the first request's offer, once (later calls change
    /// nothing): `offered` sorted by function name, how many there are,
    /// and whether `search_tools` goes with them (tools were left out and
    /// the caps allow a search).
    pub fn fix_first_offer(&mut self, offered: &mut [Arc<CompiledTool>]) -> FirstOffer {
        if let Some(first) = self.first_offer {
            return first;
        }
        offered.sort_by(|a, b| a.definition.function.name.cmp(&b.definition.function.name));
        let first = FirstOffer {
            tools: offered.len(),
            search_tools: self.can_expand(offered.len()),
        };
        self.first_offer = Some(first);
        first
    }

    /// Whether the model may still add tools with `search_tools` when
    /// `offered` are offered: some were left out, expansion rounds and
    /// the tool cap allow it.
    pub fn can_expand(&self, offered: usize) -> bool {
        self.permitted.tools.len() > offered
            && self.expansions < self.policy.max_expansion_rounds
            && offered < self.policy.max_tool_count
    }

    /// Whether imported MCP tools are among the permitted ones (served by
    /// the [`MCP_FAMILY`]'s workers).
    pub fn has_mcp_tools(&self) -> bool {
        self.permitted.tools.iter().any(|t| {
            self.snapshot
                .registry
                .get(&t.definition.id.to_string())
                .is_some_and(|e| e.families.iter().any(|f| f == MCP_FAMILY))
        })
    }

    /// The snapshot positions of the permitted tools.
    pub(crate) fn candidates(&self) -> Vec<usize> {
        self.permitted
            .tools
            .iter()
            .filter_map(|t| self.snapshot.position(t))
            .collect()
    }

    /// The tools at snapshot `positions`, in id order.
    pub(crate) fn tools_at(&self, positions: &[usize]) -> Vec<Arc<CompiledTool>> {
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
        std::sync::LazyLock::new(|| Arc::new(scoring::search_tools_spec()));
    SPEC.clone()
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
        let snapshot = ToolSnapshot::build(
            (&agents, &DeclaredPools::none()),
            &catalog,
            Some(&compat),
            &config,
        );
        let helper = snapshot.registry.get("agent:helper@1.0.0").unwrap();
        assert_eq!(&*helper.source, agents::AGENTS_SOURCE);
        assert_eq!(
            agents::profile_of(&helper.tool),
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

    /// A declared pool's tool no live worker serves is in the registry
    /// from the `declared` backend and permitted; once a worker serves it,
    /// it is the catalog's (no duplicate), and an undeclared tool with no
    /// worker is never permitted.
    #[test]
    fn a_declared_tool_is_permitted_while_no_worker_serves_it() {
        let config = toolfleet_config::FleetConfig::from_toml(
            "[deployments.d]\nbase_url = \"http://127.0.0.1:9/v1\"\nmodel = \"m\"\n\
             [profiles.default]\ndeployment = \"d\"\n\
             [pools.web]\ndeclared = true\n",
            "test",
        )
        .unwrap();
        let definitions = ["web:search@1.0.0", "web:read_page@1.0.0"].map(|id| {
            let function = id.split([':', '@']).nth(1).unwrap();
            tool(id, function).definition.clone()
        });
        let declared =
            DeclaredPools::resolve(&config, definitions.to_vec(), "tool_definitions").unwrap();
        let agents = AgentSource::new(&config).unwrap();
        let permitted_ids = |catalog: &Catalog| {
            let snapshot = ToolSnapshot::build((&agents, &declared), catalog, None, &config);
            let gate = gating::Gate {
                documents: false,
                data_source: false,
                surface: "chat",
                provider_confidence: 0.0,
                agents: false,
                own_profile: "default",
                tenant: "default",
                agents_denied: &[],
            };
            let profile = toolfleet_config::Profile::new("d");
            let job = toolfleet_protocol::client::question("hi");
            let permitted = gating::permitted(&snapshot.registry, &profile, &job, &gate).unwrap();
            let sources: Vec<(String, String)> = snapshot
                .registry
                .list()
                .map(|e| (e.id().to_string(), e.source.to_string()))
                .collect();
            assert!(snapshot.registry.duplicates().is_empty());
            let ids: Vec<String> = permitted
                .tools
                .iter()
                .map(|t| t.definition.id.to_string())
                .collect();
            (ids, sources)
        };
        let (ids, sources) = permitted_ids(&Catalog::default());
        assert_eq!(ids, ["web:read_page@1.0.0", "web:search@1.0.0"]);
        assert!(sources.iter().all(|(_, s)| s == declared::DECLARED_SOURCE));
        let live =
            Catalog::from_tools([tool("web:search@1.0.0", "search"), tool("t:a@1.0.0", "a")]);
        let (ids, sources) = permitted_ids(&live);
        assert_eq!(
            ids,
            ["t:a@1.0.0", "web:read_page@1.0.0", "web:search@1.0.0"]
        );
        assert!(sources.contains(&("web:search@1.0.0".into(), "catalog".into())));
        assert!(sources.contains(&("web:read_page@1.0.0".into(), "declared".into())));
        // Undeclared: a tool no worker serves is not permitted.
        let none = DeclaredPools::none();
        let snapshot = ToolSnapshot::build((&agents, &none), &Catalog::default(), None, &config);
        assert!(snapshot.registry.list().next().is_none());
    }
}
