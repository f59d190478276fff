//! The agent tools' registry backend: a profile with an `agent` table
//! becomes the tool `agent:<name>@1.0.0`, served by the orchestrators
//! themselves (always live while one runs). Calling one is a nested chat
//! job ([`crate::agents`]).

use std::sync::Arc;

use serde_json::json;
use toolfleet_config::FleetConfig;
use toolfleet_protocol::headers;
use toolfleet_protocol::registry::{SourcedTool, ToolSource};
use toolfleet_protocol::tools::{CompiledTool, Origin, ToolDefinition};

/// The source name of the agent tools' backend.
pub const AGENTS_SOURCE: &str = "agents";

/// The `implementationKey` of profile `profile`'s agent tool.
pub fn implementation_key(profile: &str) -> String {
    format!("agent.{profile}")
}

/// The profile an agent tool runs, from its implementation key.
pub fn profile_of(tool: &CompiledTool) -> Option<&str> {
    tool.definition.implementation_key.strip_prefix("agent.")
}

/// The agent tools of a configuration: one per profile with an `agent`
/// table, served by the orchestrators (always live while one runs).
pub struct AgentSource {
    tools: Vec<SourcedTool>,
}

impl AgentSource {
    /// The agent tools `config` declares.
    ///
    /// # Errors
    ///
    /// A message naming the profile when its tool definition does not
    /// pass the definition checks (the config's own validation makes that
    /// a bug).
    pub fn new(config: &FleetConfig) -> Result<Self, String> {
        let mut tools = Vec::new();
        for (name, profile) in &config.profiles {
            let Some(agent) = &profile.agent else {
                continue;
            };
            let value = json!({
                "schemaVersion": 1,
                "id": format!("agent:{}@1.0.0", agent.name),
                "implementationKey": implementation_key(name),
                "title": format!("Agent {}", agent.name),
                "description": agent.description,
                "category": "agent",
                "selectable": true,
                "tags": ["agent"],
                "timeoutMs": agent.timeout_ms,
                "parallelSafe": true,
                "function": {
                    "name": agent.name,
                    "description": agent.description,
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "task": {
                                "type": "string",
                                "minLength": 1,
                                "description": "What the agent should do, with everything it needs to know: it does not see this conversation."
                            }
                        },
                        "required": ["task"],
                        "additionalProperties": false
                    }
                }
            });
            let definition = ToolDefinition::from_value(
                value,
                Origin::Named(format!("profile {name:?} (agent tool)")),
            )
            .and_then(CompiledTool::new)
            .map_err(|e| format!("profile {name:?}: its agent tool is not valid: {e}"))?;
            tools.push(SourcedTool {
                tool: Arc::new(definition),
                workers: 1,
                families: vec!["orchestrator".into()],
            });
        }
        Ok(Self { tools })
    }
}

impl ToolSource for AgentSource {
    fn name(&self) -> &str {
        AGENTS_SOURCE
    }

    fn tools(&self) -> Vec<SourcedTool> {
        self.tools.clone()
    }
}

/// The depth of a chat job from its headers (0 without the header; an
/// unreadable value counts as the deepest, so it is offered no agent).
pub fn depth_of(h: Option<&async_nats::HeaderMap>) -> u32 {
    match h.and_then(|h| h.get(headers::AGENT_DEPTH)) {
        None => 0,
        Some(v) => v.as_str().parse().unwrap_or(u32::MAX),
    }
}
