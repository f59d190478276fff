//! Profiles: what a chat job names — an orchestrator, the deployments to
//! use in order of preference, prompts, the tools offered, and the
//! policies ([`crate::policy`]), approvals ([`crate::approvals`]), agent
//! tool ([`crate::agents`]) and sink ([`crate::sinks`]) that apply.
//!
//! | key | type, default | meaning |
//! |---|---|---|
//! | `[profiles.<name>]` | table | what a chat job names; names are `[A-Za-z0-9_.-]+` |
//! | `orchestrator` | string, `"agentic"` | resolved by name among [`ORCHESTRATORS`]; an unknown name falls back to [`DEFAULT_ORCHESTRATOR`] (noted in [`ResolvedProfile::orchestrator_fell_back`](crate::ResolvedProfile::orchestrator_fell_back) and [`FleetConfig::warnings`](crate::FleetConfig::warnings)) |
//! | `deployment` | deployment name | the one deployment to use |
//! | `deployments` | non-empty list of deployment names | instead of `deployment`: tried in order, the first resolvable one is used; the later resolvable ones are its fallbacks when it fails before any output (connection, timeout, 429, 5xx after retries) |
//! | `utility_model` | string, the deployment's `model` | model for the tool-planning call, on the same deployment |
//! | `temperature` | 0.0..=2.0, the provider's | sampling temperature |
//! | `system_prompt` | string, the orchestrator's | system prompt |
//! | `tools` | list of tool refs, `["*"]` | profile tools: `*` every selectable tool, `ns:*` every selectable tool of a namespace, `ns:name` (highest version) or `ns:name@x.y.z` one tool, selectable or not |
//! | `must_include_tools` | list of tool ids, `[]` | tools always offered whatever scoping picks (they count toward `scoping.max_tool_count`, and a list longer than that cap is refused), e.g. `"system:current_datetime@1.0.0"` |
//! | `data_source` | string, none | data source searched before the model is called (preemptive RAG) |
//! | `sink` | sink name, none | the `[sinks.<name>]` this profile's events also go to (a chat job's own `sink` wins) |
//! | `tenants` | list of tenant names or `["*"]`, `["*"]` | the tenants whose jobs may run this profile ([`crate::tenants`]); another tenant's job naming it ends with `profile_not_allowed` |
//! | `multitask_strategy` | `reject`, `enqueue`, `interrupt` or `rollback`; `"reject"` | what a job of a thread does when another of the thread's jobs runs and it names no `multitaskStrategy` (`docs/threads.md`) |
//! | `agent`, `require_approval`, `approval_timeout_ms` | | see [`crate::agents`] and [`crate::approvals`] |
//! | `[profiles.<name>.policy]`, `.scoping`, `.rag` | tables | see [`crate::policy`] |

use serde::Deserialize;
use toolfleet_protocol::thread::MultitaskStrategy;
use toolfleet_protocol::tools::{ToolDefinition, ToolRef};
use toolfleet_protocol::{Priority, ToolId};

use crate::agents::AgentTool;
use crate::approvals::{self, DEFAULT_APPROVAL_TIMEOUT_MS, default_approval_timeout_ms};
use crate::policy::{LoopPolicy, RagPolicy, ScopingPolicy};
use crate::tenants::TenantScope;

/// The orchestrator used when a profile names none or one that is unknown.
pub const DEFAULT_ORCHESTRATOR: &str = "agentic";
/// The orchestrators this build knows by name.
pub const ORCHESTRATORS: &[&str] = &[DEFAULT_ORCHESTRATOR];

/// What a chat job names: orchestrator, deployments, prompts, tools, limits.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(try_from = "RawProfile")]
pub struct Profile {
    /// Resolved by name among [`ORCHESTRATORS`], falling back to
    /// [`DEFAULT_ORCHESTRATOR`].
    pub orchestrator: String,
    /// Deployment names in order of preference; never empty in a loaded
    /// config.
    pub deployments: Vec<String>,
    /// Model for the tool-planning call; the deployment's model when unset.
    pub utility_model: Option<String>,
    /// The planning call's instructions, replacing the built-in ones (the
    /// conversation and candidate tools still follow them). `{max_tools}`
    /// is replaced by the scoping policy's `max_tool_count`. The answer must
    /// stay the JSON object the built-in prompt asks for:
    /// `{"tools": [...], "categories": [...]}`.
    pub planning_prompt: Option<String>,
    pub temperature: Option<f32>,
    /// The orchestrator's default prompt when unset.
    pub system_prompt: Option<String>,
    /// Tools always offered to the model.
    pub must_include_tools: Vec<ToolId>,
    /// Data source searched before the model is called.
    pub data_source: Option<String>,
    pub policy: LoopPolicy,
    /// How the tools offered are narrowed when there are many.
    pub scoping: ScopingPolicy,
    /// Retrieval before the first model call.
    pub rag: RagPolicy,
    /// Profile tools: always in for this profile. `*` (the default) is
    /// every selectable tool, `ns:*` every selectable tool of a namespace,
    /// `ns:name` (highest version) or `ns:name@x.y.z` one tool, selectable
    /// or not.
    pub tools: Vec<ToolRef>,
    /// When set, the profile is also a tool (`agent:<name>@1.0.0`): calling
    /// it runs a nested chat job with this profile.
    pub agent: Option<AgentTool>,
    /// Tools whose every call a person must approve under this profile,
    /// besides those whose definition sets `requiresApproval` (same
    /// patterns as [`tools`](Self::tools)).
    pub require_approval: Vec<ToolRef>,
    /// How long a parked invocation waits for its approvals before it ends
    /// with `approval_timeout`, in ms.
    pub approval_timeout_ms: u64,
    /// The named sink (`[sinks.<name>]`) this profile's answers also go
    /// to; a chat job's own `sink` wins over it.
    pub sink: Option<String>,
    /// The tenants whose jobs may run this profile.
    pub tenants: TenantScope,
    /// `batch`: every job of this profile runs as a batch job (taken
    /// after interactive ones, with the deployment's batch service tier),
    /// whatever the job says. Default `interactive`: the job decides.
    pub priority: Priority,
    /// What happens to a job of a thread that arrives while another of
    /// its jobs runs, when the job does not say (`docs/threads.md`).
    /// Default `reject`.
    pub multitask_strategy: MultitaskStrategy,
}

fn default_profile_tools() -> Vec<ToolRef> {
    vec![ToolRef::All]
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawProfile {
    #[serde(default = "default_orchestrator")]
    orchestrator: String,
    #[serde(default)]
    deployment: Option<String>,
    #[serde(default)]
    deployments: Option<Vec<String>>,
    #[serde(default)]
    utility_model: Option<String>,
    #[serde(default)]
    planning_prompt: Option<String>,
    #[serde(default)]
    temperature: Option<f32>,
    #[serde(default)]
    system_prompt: Option<String>,
    #[serde(default)]
    must_include_tools: Vec<ToolId>,
    #[serde(default)]
    data_source: Option<String>,
    #[serde(default)]
    policy: LoopPolicy,
    #[serde(default)]
    scoping: ScopingPolicy,
    #[serde(default)]
    rag: RagPolicy,
    #[serde(default = "default_profile_tools")]
    tools: Vec<ToolRef>,
    #[serde(default)]
    agent: Option<AgentTool>,
    #[serde(default)]
    require_approval: Vec<ToolRef>,
    #[serde(default = "default_approval_timeout_ms")]
    approval_timeout_ms: u64,
    #[serde(default)]
    sink: Option<String>,
    #[serde(default)]
    tenants: TenantScope,
    #[serde(default)]
    priority: Priority,
    #[serde(default)]
    multitask_strategy: MultitaskStrategy,
}

fn default_orchestrator() -> String {
    DEFAULT_ORCHESTRATOR.to_owned()
}

impl TryFrom<RawProfile> for Profile {
    type Error = String;

    fn try_from(raw: RawProfile) -> Result<Self, Self::Error> {
        let deployments = match (raw.deployment, raw.deployments) {
            (Some(one), None) => vec![one],
            (None, Some(list)) if !list.is_empty() => list,
            (None, Some(_)) => return Err("`deployments` must name at least one".to_owned()),
            (None, None) => {
                return Err("missing `deployment` (or `deployments`, a list)".to_owned());
            }
            (Some(_), Some(_)) => {
                return Err("set either `deployment` or `deployments`, not both".to_owned());
            }
        };
        if raw
            .planning_prompt
            .as_deref()
            .is_some_and(|p| p.trim().is_empty())
        {
            return Err(
                "`planning_prompt` must not be empty (leave it out for the built-in one)"
                    .to_owned(),
            );
        }
        Ok(Self {
            orchestrator: raw.orchestrator,
            deployments,
            utility_model: raw.utility_model,
            planning_prompt: raw.planning_prompt,
            temperature: raw.temperature,
            system_prompt: raw.system_prompt,
            must_include_tools: raw.must_include_tools,
            data_source: raw.data_source,
            policy: raw.policy,
            scoping: raw.scoping,
            rag: raw.rag,
            tools: raw.tools,
            agent: raw.agent,
            require_approval: raw.require_approval,
            approval_timeout_ms: raw.approval_timeout_ms,
            sink: raw.sink,
            tenants: raw.tenants,
            priority: raw.priority,
            multitask_strategy: raw.multitask_strategy,
        })
    }
}

impl Profile {
    /// A profile on one deployment with the default orchestrator and
    /// policy, and nothing else set.
    pub fn new(deployment: impl Into<String>) -> Self {
        Self {
            orchestrator: DEFAULT_ORCHESTRATOR.to_owned(),
            deployments: vec![deployment.into()],
            utility_model: None,
            planning_prompt: None,
            temperature: None,
            system_prompt: None,
            must_include_tools: Vec::new(),
            data_source: None,
            policy: LoopPolicy::default(),
            scoping: ScopingPolicy::default(),
            rag: RagPolicy::default(),
            tools: default_profile_tools(),
            agent: None,
            require_approval: Vec::new(),
            approval_timeout_ms: DEFAULT_APPROVAL_TIMEOUT_MS,
            sink: None,
            tenants: TenantScope::any(),
            priority: Priority::Interactive,
            multitask_strategy: MultitaskStrategy::Reject,
        }
    }

    /// Whether this profile requires a person's approval before `tool`
    /// runs (its own list, or the definition's `requiresApproval`).
    pub fn requires_approval(&self, tool: &ToolDefinition) -> bool {
        tool.requires_approval || self.require_approval.iter().any(|r| r.matches(&tool.id))
    }

    pub(crate) fn validate(&self, at: &str) -> Result<(), (String, String)> {
        if self.orchestrator.trim().is_empty() {
            return Err((format!("{at}.orchestrator"), "must not be empty".to_owned()));
        }
        if let Some(t) = self.temperature
            && !(0.0..=2.0).contains(&t)
        {
            return Err((
                format!("{at}.temperature"),
                format!("must be between 0.0 and 2.0, not {t}"),
            ));
        }
        approvals::check_timeout(
            self.approval_timeout_ms,
            &format!("{at}.approval_timeout_ms"),
        )?;
        for (key, value) in [
            ("utility_model", &self.utility_model),
            ("data_source", &self.data_source),
        ] {
            if value.as_ref().is_some_and(|v| v.trim().is_empty()) {
                return Err((format!("{at}.{key}"), "must not be empty".to_owned()));
            }
        }
        if let Some(agent) = &self.agent {
            agent.validate(&format!("{at}.agent"))?;
        }
        self.policy.validate(&format!("{at}.policy"))?;
        self.rag.validate(&format!("{at}.rag"))?;
        self.scoping.validate(&format!("{at}.scoping"))?;
        // Must-include tools are offered whatever scoping picks, and count
        // toward the cap: more of them than the cap is a contradiction,
        // refused here rather than settled silently on every request.
        if self.must_include_tools.len() > self.scoping.max_tool_count {
            return Err((
                format!("{at}.must_include_tools"),
                format!(
                    "lists {} tools, more than scoping.max_tool_count ({}): every must-include tool is offered and counts toward that cap; list fewer or raise the cap",
                    self.must_include_tools.len(),
                    self.scoping.max_tool_count
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::ConfigErrorKind;
    use crate::testing::{MINIMAL, parse_err};

    #[test]
    fn more_must_include_tools_than_the_tool_cap_are_refused() {
        let three = "must_include_tools = [\"a:x@1.0.0\", \"a:y@1.0.0\", \"a:z@1.0.0\"]";
        let e = parse_err(&MINIMAL.replace(
            "deployment = \"local\"",
            &format!(
                "deployment = \"local\"\n{three}\n[profiles.default.scoping]\nmax_tool_count = 2\ninitial_tool_count = 1\nscoping_threshold = 2"
            ),
        ));
        assert_eq!(
            e.key.as_deref(),
            Some("profiles.default.must_include_tools"),
            "{e}"
        );
        assert!(
            e.message.contains("more than scoping.max_tool_count (2)"),
            "{e}"
        );
        // At the cap, both hold: all three are offered.
        let ok = MINIMAL.replace(
            "deployment = \"local\"",
            &format!(
                "deployment = \"local\"\n{three}\n[profiles.default.scoping]\nmax_tool_count = 3\ninitial_tool_count = 1\nscoping_threshold = 3"
            ),
        );
        crate::FleetConfig::from_toml(&ok, "test").unwrap();
    }

    #[test]
    fn bad_tool_ids_and_profile_shapes_are_refused() {
        let e = parse_err(&MINIMAL.replace(
            "deployment = \"local\"",
            "deployment = \"local\"\nmust_include_tools = [\"system:ok@1.0.0\", \"Not A Tool\"]",
        ));
        assert_eq!(e.kind(), ConfigErrorKind::Parse);
        assert_eq!(
            e.key.as_deref(),
            Some("profiles.default.must_include_tools[1]")
        );
        assert!(e.message.contains("invalid tool id"), "{e}");

        let e = parse_err(&MINIMAL.replace(
            "deployment = \"local\"",
            "deployment = \"local\"\ndeployments = [\"local\"]",
        ));
        assert!(e.message.contains("not both"), "{e}");
        assert_eq!(e.key.as_deref(), Some("profiles.default"));

        let e = parse_err(&MINIMAL.replace("deployment = \"local\"", "deployments = []"));
        assert!(e.message.contains("at least one"), "{e}");

        let e = parse_err(&MINIMAL.replace("deployment = \"local\"", "temperature = 0.5"));
        assert!(e.message.contains("missing `deployment`"), "{e}");
    }

    #[test]
    fn a_planning_prompt_is_the_profiles_own_and_never_empty() {
        let toml = MINIMAL.replace(
            "deployment = \"local\"",
            "deployment = \"local\"\nplanning_prompt = \"Pick at most {max_tools} tools.\"",
        );
        let config = crate::FleetConfig::from_toml(&toml, "test").expect("valid");
        assert_eq!(
            config.profiles["default"].planning_prompt.as_deref(),
            Some("Pick at most {max_tools} tools.")
        );
        let e = parse_err(&MINIMAL.replace(
            "deployment = \"local\"",
            "deployment = \"local\"\nplanning_prompt = \"  \"",
        ));
        assert!(e.message.contains("must not be empty"), "{e}");
        assert_eq!(e.key.as_deref(), Some("profiles.default"));
    }
}
