//! Agent tools: a profile exposed as a tool (`agent:<name>@1.0.0`) whose
//! call runs a nested chat job with that profile, and how deep such jobs
//! may nest.
//!
//! | key | type, default | meaning |
//! |---|---|---|
//! | `max_agent_depth` (top level) | 0..=5, `1` | how deep agent tools nest: a job at this depth is offered no agent tool |
//! | `profiles.<name>.agent` | `{ name, description, timeout_ms = 120000, tenants = ["*"] }`, none | expose the profile as the tool `agent:<name>@1.0.0` (a nested chat job); names unique across profiles; offered only to the tenants both `tenants` and the profile's `tenants` allow |

use serde::Deserialize;
use toolfleet_protocol::ToolId;

use crate::tenants::TenantScope;

/// Default of [`FleetConfig::max_agent_depth`](crate::FleetConfig::max_agent_depth).
pub const DEFAULT_MAX_AGENT_DEPTH: u32 = 1;
/// The deepest [`FleetConfig::max_agent_depth`](crate::FleetConfig::max_agent_depth)
/// a file may set.
pub const MAX_AGENT_DEPTH_LIMIT: u32 = 5;

/// A profile exposed as a tool.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AgentTool {
    /// The tool's name and the function name the model calls:
    /// `[a-z][a-z0-9_]*`, unique across profiles.
    pub name: String,
    /// What the model is told the agent does.
    pub description: String,
    /// How long one call may run, in ms (default 120 000).
    #[serde(default = "default_agent_timeout_ms")]
    pub timeout_ms: u64,
    /// The tenants the tool is offered to (besides the profile's own
    /// `tenants`, which the nested job must pass too).
    #[serde(default)]
    pub tenants: TenantScope,
}

/// Default of [`AgentTool::timeout_ms`].
pub const DEFAULT_AGENT_TIMEOUT_MS: u64 = 120_000;

fn default_agent_timeout_ms() -> u64 {
    DEFAULT_AGENT_TIMEOUT_MS
}

impl AgentTool {
    /// The name makes a tool id, the description is there, the timeout is
    /// between a second and an hour; `at` is the `agent` table's key path.
    pub(crate) fn validate(&self, at: &str) -> Result<(), (String, String)> {
        if ToolId::new("agent", self.name.clone(), (1, 0, 0)).is_err() || self.name.len() > 64 {
            return Err((
                format!("{at}.name"),
                format!(
                    "{:?} is not a tool name ([a-z][a-z0-9_]*, at most 64 characters)",
                    self.name
                ),
            ));
        }
        if self.description.trim().is_empty() {
            return Err((format!("{at}.description"), "must not be empty".to_owned()));
        }
        if !(1_000..=3_600_000).contains(&self.timeout_ms) {
            return Err((
                format!("{at}.timeout_ms"),
                format!("must be between 1000 and 3600000, not {}", self.timeout_ms),
            ));
        }
        Ok(())
    }
}
