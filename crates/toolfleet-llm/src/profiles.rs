//! Profiles, deployments and prices: the fleet's model configuration file
//! (TOML), its validation at load, and the resolution of a chat job's
//! profile to a usable deployment.
//!
//! A **deployment** is one model behind one OpenAI-compatible endpoint (API
//! shape, base URL, model, where its key is, timeouts, retries). A
//! **profile** is what a chat job names: an orchestrator, the deployments to
//! use in order of preference, prompts, must-include tools and the loop
//! policy. **Prices** turn token usage into USD.
//!
//! A binary started without a config file gets one profile, `default`,
//! built from its `--llm-*` flags ([`FleetConfig::single`] with
//! [`Deployment::from_llm_args`]).
//!
//! # The file
//!
//! `config/toolfleet.example.toml` is a complete, commented example (a test
//! loads it). Every key:
//!
//! | key | type, default | meaning |
//! |---|---|---|
//! | `default_profile` | string, `"default"` | profile used when a job names none, or one that does not exist; must exist |
//! | `[deployments.<name>]` | table | one model endpoint; names are `[A-Za-z0-9_.-]+` |
//! | `api` | `"chat_completions"` (default) or `"responses"` | which OpenAI API shape to speak |
//! | `reasoning` | bool, `false` | the model is a reasoning model (OpenAI o-series, gpt-5): with `api = "responses"`, requests ask for `"include": ["reasoning.encrypted_content"]` so reasoning is carried between tool rounds. Only for reasoning models: others (gpt-4o, gpt-4o-mini, …) answer that request with 400. Chat Completions ignores it |
//! | `base_url` | http(s) URL, required | the API root including `/v1` (or Azure's `/openai/deployments/<name>`); no user or password in it |
//! | `model` | string, required | model name sent to the provider (for Azure's classic form, the deployment's model, for prices and token counting) |
//! | `api_key_env` | env var name, none | the environment variable holding the key; no key is sent when absent. The key itself never appears in the file: an `api_key` key is refused |
//! | `auth` | `"bearer"` (default) or `{ header = "<name>" }` | `Authorization: Bearer <key>`, or the key as is in the named header (Azure: `{ header = "api-key" }`) |
//! | `query` | table of strings, `{}` | extra query parameters on every request, e.g. `{ "api-version" = "2024-10-21" }`; credential-like names (`key`, `api-key`, `token`, …) are refused |
//! | `stream` | bool, `true` | stream responses (server-sent events) or wait for whole answers |
//! | `http` | `"http1"` (default) or `"http2"` | `http1`: HTTP/1.1, a connection per call in flight; `http2`: HTTP/2 only (over TLS, or h2c over plain `http://`), for servers known to speak it — calls in flight share one connection (far less memory per waiting call), but the server's streams per connection (often 100–250 for public APIs) then cap the calls in flight |
//! | `connect_timeout_ms` | ms > 0, [`DEFAULT_CONNECT_TIMEOUT`](crate::DEFAULT_CONNECT_TIMEOUT) | TCP and TLS connect |
//! | `first_token_timeout_ms` | ms > 0, [`DEFAULT_FIRST_TOKEN_TIMEOUT`](crate::DEFAULT_FIRST_TOKEN_TIMEOUT) | request sent to first streamed event (or whole answer when not streaming) |
//! | `idle_timeout_ms` | ms > 0, [`DEFAULT_IDLE_TIMEOUT`](crate::DEFAULT_IDLE_TIMEOUT) | longest gap between streamed chunks |
//! | `[deployments.<name>.retry]` | table | retries of 429 and 5xx before any output was streamed |
//! | `retry.max_attempts` | 1..=10, `3` | attempts in all, the first included |
//! | `retry.max_elapsed_ms` | ms > 0, `30000` | no new attempt after this long since the first |
//! | `retry.base_delay_ms` | ms, `250` | first backoff delay, doubled per attempt (a `Retry-After` wins) |
//! | `retry.max_delay_ms` | ms ≥ `base_delay_ms`, `5000` | longest backoff delay |
//! | `[profiles.<name>]` | table | what a chat job names; names are `[A-Za-z0-9_.-]+` |
//! | `orchestrator` | string, `"agentic"` | resolved by name among [`ORCHESTRATORS`]; an unknown name falls back to [`DEFAULT_ORCHESTRATOR`] (noted in [`ResolvedProfile::orchestrator_fell_back`] and [`FleetConfig::warnings`]) |
//! | `deployment` | deployment name | the one deployment to use |
//! | `deployments` | non-empty list of deployment names | instead of `deployment`: tried in order, the first resolvable one is used; the later resolvable ones are its fallbacks when it fails before any output (connection, timeout, 429, 5xx after retries) |
//! | `utility_model` | string, the deployment's `model` | model for the tool-planning call, on the same deployment |
//! | `temperature` | 0.0..=2.0, the provider's | sampling temperature |
//! | `system_prompt` | string, the orchestrator's | system prompt |
//! | `max_agent_depth` | 0..=5, `1` | how deep agent tools nest: a job at this depth is offered no agent tool |
//! | `tools` | list of tool refs, `["*"]` | profile tools: `*` every selectable tool, `ns:*` every selectable tool of a namespace, `ns:name` (highest version) or `ns:name@x.y.z` one tool, selectable or not |
//! | `must_include_tools` | list of tool ids, `[]` | tools always offered whatever scoping picks, e.g. `"system:current_datetime@1.0.0"` |
//! | `agent` | `{ name, description, timeout_ms = 120000 }`, none | expose the profile as the tool `agent:<name>@1.0.0` (a nested chat job); names unique across profiles |
//! | `[profiles.<name>.scoping]` | table | progressive tool scoping: [`ScopingPolicy`] (`initial_tool_count` 20, `scoping_threshold` 30, `planning_threshold` 100, `max_expansion_rounds` 3, `max_tool_count` 30, `planning_history_message_count` 10) |
//! | `data_source` | string, none | data source searched before the model is called (preemptive RAG) |
//! | `[profiles.<name>.policy]` | table | the agentic loop's limits: [`LoopPolicy`] |
//! | `policy.max_rounds` | 1..=100, `8` | model calls per invocation |
//! | `policy.max_consecutive_tool_errors` | 1..=100, `3` | rounds in a row whose tool calls all failed before the model is told to answer |
//! | `policy.parallel_tool_calls` | bool, `true` | let the model ask for several tools at once and run them in parallel (tools not marked `parallelSafe` still run one at a time) |
//! | `policy.max_calls_per_turn` | 1..=128, `8` | tool calls run per model turn; calls beyond it get an error result |
//! | `policy.max_tool_result_tokens` | 64..=1000000 or `"off"`, `4000` | cap on one tool result, in the model's tokens ([`crate::budget`]) |
//! | `sink` | sink name, none | the `[sinks.<name>]` this profile's events also go to (a chat job's own `sink` wins) |
//! | `[sinks.<name>]` | table | a webhook and/or relay the events of invocations also go to; names are `[A-Za-z0-9_.-]+` |
//! | `sinks.<name>.url` | https URL, none | the webhook each routed event is POSTed to, signed (HMAC-SHA256); no credentials in it; the orchestrator's SSRF policy applies at start and at every delivery |
//! | `sinks.<name>.secret_env` | env var name, required with `url` | the variable holding the signing secret (never the secret itself) |
//! | `sinks.<name>.events` | `"final"` (default) or `"all"` | the terminal event only, or every event but the deltas |
//! | `sinks.<name>.relay` | NATS subject, none | a subject on another prefix the events are published to (no wildcards; not under the fleet's prefix, checked at the orchestrator's start) |
//! | `policy.on_truncated_tool_call` | `"error"` (default) or `"ask_again"` | a tool call cut by the output limit: end with an error, or ask the model again |
//! | `policy.context_budget_tokens` | 1000..=2000000 or `"off"`, `"off"` | before a model call, a conversation over this many tokens (the model's encoding) has its older turns replaced by a summary made with the `llm:summarize` tool, down to about half of it; a `compacted` event says what was saved |
//! | `[prices."<model>"]` | table | USD per million tokens, for cost in `completed` events and metrics |
//! | `input` | number ≥ 0, required | uncached prompt tokens |
//! | `cached_input` | number ≥ 0, `input` | prompt tokens served from the provider's cache |
//! | `output` | number ≥ 0, required | completion tokens, reasoning tokens included |
//!
//! Unknown keys anywhere are errors, so a typo never silently falls back to a
//! default. Errors name the file, the dotted key path (e.g.
//! `profiles.default.policy.max_rounds`) and, for errors of shape (unknown
//! key, wrong type, bad syntax), the line and column.
//!
//! # Invariants
//!
//! - **No secret is read from, or written to, the file or a message.** Keys
//!   come from the environment through [`EnvSource`] at resolution time;
//!   `Debug` of [`Deployment`] and [`ResolvedProfile`] redacts them; errors
//!   about `api_key_env` never echo its value (it might be a pasted key); TOML
//!   error messages are rebuilt without the source line.
//! - **A loaded [`FleetConfig`] is consistent**: the default profile exists,
//!   every profile names existing deployments, every value is in range. What
//!   can still fail at resolution is the environment: a missing key.
//! - **Resolution never reads the process environment directly**, only the
//!   [`EnvSource`] passed in, so it is testable without `set_var`.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::hash::BuildHasher;
use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Deserializer};
use url::Url;

use crate::{ApiShape, Auth, LlmConfig, RetryPolicy, Usage};
use toolfleet_protocol::ToolId;
use toolfleet_protocol::tools::ToolRef;

/// The profile name a config without `default_profile` (and a binary
/// without a config file) uses.
pub const DEFAULT_PROFILE: &str = "default";
/// The orchestrator used when a profile names none or one that is unknown.
pub const DEFAULT_ORCHESTRATOR: &str = "agentic";
/// The orchestrators this build knows by name.
pub const ORCHESTRATORS: &[&str] = &[DEFAULT_ORCHESTRATOR];

pub const DEFAULT_MAX_ROUNDS: u32 = 8;
pub const DEFAULT_MAX_CONSECUTIVE_TOOL_ERRORS: u32 = 3;
pub const DEFAULT_MAX_CALLS_PER_TURN: usize = 8;
/// Large enough for a page of search results with their snippets, small
/// enough that a few results cannot crowd the conversation out of a
/// 128k-token context.
pub const DEFAULT_MAX_TOOL_RESULT_TOKENS: usize = 4000;

/// Upper bounds that catch typos (`max_rounds = 800`) rather than limit
/// real use.
const MAX_ROUNDS_LIMIT: u32 = 100;
const MAX_TOOL_ERRORS_LIMIT: u32 = 100;
const MAX_CALLS_PER_TURN_LIMIT: usize = 128;
const MAX_TOOL_RESULT_TOKENS_LIMIT: usize = 1_000_000;
const MAX_RETRY_ATTEMPTS_LIMIT: u32 = 10;
/// The smallest context budget: below it a summary and the latest turn
/// would not fit.
pub const MIN_CONTEXT_BUDGET_TOKENS: usize = 1000;
/// The largest context budget (beyond any model's context window).
pub const MAX_CONTEXT_BUDGET_TOKENS: usize = 2_000_000;

/// Query parameter names that carry credentials: refused in `query`, where
/// they would put a key in the file.
const CREDENTIAL_QUERY_NAMES: &[&str] = &[
    "key",
    "api-key",
    "api_key",
    "apikey",
    "access_token",
    "token",
];

// ---------------------------------------------------------------------------
// The configuration

/// The whole model configuration: deployments, profiles and prices.
#[derive(Clone, Debug, PartialEq)]
pub struct FleetConfig {
    /// Profile used when a job names none, or one that does not exist.
    pub default_profile: String,
    pub deployments: BTreeMap<String, Deployment>,
    pub profiles: BTreeMap<String, Profile>,
    pub prices: PriceTable,
    /// How deep agent tools may nest: a chat job started by an agent tool
    /// is at depth 1, one started by an agent tool inside it at 2, … A
    /// job at this depth is offered no agent tool.
    pub max_agent_depth: u32,
    /// Link templates by reference type (`data_source`, `knowledge`, …):
    /// a reference without a URL gets one from its type's template, with
    /// `{source}` and `{title}` replaced (percent-encoded). Uploaded
    /// documents (`document`) never get one.
    pub links: BTreeMap<String, String>,
    /// Named sinks a profile may route its answers to (`[sinks.<name>]`).
    pub sinks: BTreeMap<String, SinkConfig>,
}

/// A named sink (`[sinks.<name>]`): a webhook, a relay subject, or both.
/// The secret is never in the file: `secret_env` names the variable.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinkConfig {
    /// The webhook the events are POSTed to (https; http only when the
    /// orchestrator allows it for tests).
    #[serde(default)]
    pub url: Option<String>,
    /// The environment variable holding the webhook's signing secret;
    /// required with `url`.
    #[serde(default)]
    pub secret_env: Option<String>,
    /// Only the terminal event (`final`, the default) or all but deltas.
    #[serde(default)]
    pub events: toolfleet_protocol::SinkEvents,
    /// A NATS subject on another prefix the events are published to.
    #[serde(default)]
    pub relay: Option<String>,
}

impl SinkConfig {
    fn validate(&self, at: &str) -> Result<(), (String, String)> {
        if self.url.is_none() && self.relay.is_none() {
            return Err((at.to_owned(), "names neither `url` nor `relay`".to_owned()));
        }
        if let Some(raw) = &self.url {
            let url = Url::parse(raw)
                .map_err(|e| (format!("{at}.url"), format!("{raw:?} is not a URL ({e})")))?;
            if !matches!(url.scheme(), "https" | "http") || url.host_str().is_none() {
                return Err((
                    format!("{at}.url"),
                    "must be an https:// URL with a host".to_owned(),
                ));
            }
            if !url.username().is_empty() || url.password().is_some() {
                return Err((
                    format!("{at}.url"),
                    "must not hold credentials (user:password@)".to_owned(),
                ));
            }
            match &self.secret_env {
                None => {
                    return Err((
                        format!("{at}.secret_env"),
                        "a webhook is always signed: name the environment variable that holds \
                         its secret"
                            .to_owned(),
                    ));
                }
                Some(name) if !valid_env_name(name) => {
                    return Err((
                        format!("{at}.secret_env"),
                        format!(
                            "{name:?} is not an environment variable name ([A-Za-z_][A-Za-z0-9_]*)"
                        ),
                    ));
                }
                Some(_) => {}
            }
        } else if self.secret_env.is_some() {
            return Err((
                format!("{at}.secret_env"),
                "only a webhook (`url`) is signed".to_owned(),
            ));
        }
        if let Some(relay) = &self.relay {
            let tokens_ok = !relay.is_empty()
                && relay.split('.').all(|t| {
                    !t.is_empty() && t != "*" && t != ">" && !t.chars().any(char::is_whitespace)
                });
            if !tokens_ok {
                return Err((
                    format!("{at}.relay"),
                    format!("{relay:?} is not a NATS subject without wildcards"),
                ));
            }
        }
        Ok(())
    }
}

/// `[A-Za-z_][A-Za-z0-9_]*`.
fn valid_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Default of [`FleetConfig::max_agent_depth`].
pub const DEFAULT_MAX_AGENT_DEPTH: u32 = 1;
/// The deepest [`FleetConfig::max_agent_depth`] a file may set.
pub const MAX_AGENT_DEPTH_LIMIT: u32 = 5;

/// The file as written; checked further by [`FleetConfig::validate`].
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default = "default_profile_name")]
    default_profile: String,
    #[serde(default)]
    deployments: BTreeMap<String, Deployment>,
    #[serde(default)]
    profiles: BTreeMap<String, Profile>,
    #[serde(default)]
    prices: PriceTable,
    #[serde(default = "default_max_agent_depth")]
    max_agent_depth: u32,
    #[serde(default)]
    links: BTreeMap<String, String>,
    #[serde(default)]
    sinks: BTreeMap<String, SinkConfig>,
}

fn default_max_agent_depth() -> u32 {
    DEFAULT_MAX_AGENT_DEPTH
}

fn default_profile_name() -> String {
    DEFAULT_PROFILE.to_owned()
}

impl FleetConfig {
    /// Reads and validates a config file.
    ///
    /// # Errors
    ///
    /// [`ConfigError`] of kind `Read` when the file cannot be read, `Parse`
    /// when it is not TOML of the expected shape, `Invalid` when a value is
    /// out of range or a reference dangles.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError {
            kind: ConfigErrorKind::Read,
            origin: origin.clone(),
            key: None,
            position: None,
            message: e.to_string(),
        })?;
        Self::from_toml(&text, &origin)
    }

    /// Parses and validates config text; `origin` (a file name) goes into
    /// error messages.
    ///
    /// # Errors
    ///
    /// As [`FleetConfig::load`], without `Read`.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let parse_error = |key: Option<String>, error: &toml::de::Error| ConfigError {
            kind: ConfigErrorKind::Parse,
            origin: origin.to_owned(),
            key,
            position: error.span().map(|span| line_and_column(text, span.start)),
            // Only the message: `toml`'s own Display quotes the source line,
            // which may hold a key pasted in the wrong place.
            message: error.message().to_owned(),
        };
        let deserializer = toml::Deserializer::parse(text).map_err(|e| parse_error(None, &e))?;
        let file: FileConfig = serde_path_to_error::deserialize(deserializer).map_err(|e| {
            let path = e.path().to_string();
            let key = (path != ".").then_some(path);
            parse_error(key, e.inner())
        })?;
        let config = Self {
            default_profile: file.default_profile,
            deployments: file.deployments,
            profiles: file.profiles,
            prices: file.prices,
            max_agent_depth: file.max_agent_depth,
            links: file.links,
            sinks: file.sinks,
        };
        config.validate().map_err(|(key, message)| ConfigError {
            kind: ConfigErrorKind::Invalid,
            origin: origin.to_owned(),
            key: Some(key),
            position: None,
            message,
        })?;
        Ok(config)
    }

    /// A config of one profile, [`DEFAULT_PROFILE`], on one deployment of
    /// the same name: what a binary without a config file runs with.
    pub fn single(deployment: Deployment) -> Self {
        Self {
            default_profile: DEFAULT_PROFILE.to_owned(),
            deployments: BTreeMap::from([(DEFAULT_PROFILE.to_owned(), deployment)]),
            profiles: BTreeMap::from([(DEFAULT_PROFILE.to_owned(), Profile::new(DEFAULT_PROFILE))]),
            prices: PriceTable::default(),
            max_agent_depth: DEFAULT_MAX_AGENT_DEPTH,
            links: BTreeMap::new(),
            sinks: BTreeMap::new(),
        }
    }

    /// This configuration with `data_source` as the default profile's data
    /// source (the demo's and the tests' `handbook`).
    pub fn with_data_source(mut self, data_source: &str) -> Self {
        if let Some(profile) = self.profiles.get_mut(&self.default_profile) {
            profile.data_source = Some(data_source.to_owned());
        }
        self
    }

    /// Things worth a warning at start-up that are not errors: unknown
    /// orchestrator names (they fall back to the default) and models with
    /// no price (their cost is unknown).
    pub fn warnings(&self) -> Vec<String> {
        self.warnings_among(ORCHESTRATORS)
    }

    /// [`warnings`](Self::warnings), with `orchestrators` as the known
    /// orchestrator names (a process that registers its own passes them
    /// all).
    pub fn warnings_among(&self, orchestrators: &[&str]) -> Vec<String> {
        let mut warnings = Vec::new();
        for (name, profile) in &self.profiles {
            if !orchestrators.contains(&profile.orchestrator.as_str()) {
                warnings.push(format!(
                    "profile {name:?}: unknown orchestrator {:?}; {DEFAULT_ORCHESTRATOR:?} is used",
                    profile.orchestrator
                ));
            }
        }
        if !self.prices.is_empty() {
            for (name, deployment) in &self.deployments {
                if self.prices.get(&deployment.model).is_none() {
                    warnings.push(format!(
                        "deployment {name:?}: no price for model {:?}; its cost is not reported",
                        deployment.model
                    ));
                }
            }
        }
        warnings
    }

    /// The profile a job named, or the default one; and the first of its
    /// deployments whose key is available in `env`.
    ///
    /// A missing, empty or unknown profile name resolves to the default
    /// profile ([`ResolvedProfile::fell_back`] says whether a name was given
    /// but not found).
    ///
    /// # Errors
    ///
    /// [`ResolveError::NoDeployment`] when no deployment of the profile is
    /// resolvable (a fatal configuration error for the job: it ends at once
    /// with an `error` event); [`ResolveError::NoProfile`] when the default
    /// profile does not exist (only possible for a config built in code).
    pub fn resolve(
        &self,
        profile: Option<&str>,
        env: &dyn EnvSource,
    ) -> Result<ResolvedProfile, ResolveError> {
        self.resolve_among(profile, env, ORCHESTRATORS)
    }

    /// [`resolve`](Self::resolve), with the profile's orchestrator resolved
    /// among `orchestrators` (the names a process has registered) instead
    /// of [`ORCHESTRATORS`]; an unknown name still falls back to
    /// [`DEFAULT_ORCHESTRATOR`].
    pub fn resolve_among(
        &self,
        profile: Option<&str>,
        env: &dyn EnvSource,
        orchestrators: &[&str],
    ) -> Result<ResolvedProfile, ResolveError> {
        let requested = profile.filter(|p| !p.is_empty());
        let (name, fell_back) = match requested {
            Some(p) if self.profiles.contains_key(p) => (p, false),
            Some(_) => (self.default_profile.as_str(), true),
            None => (self.default_profile.as_str(), false),
        };
        let chosen = self
            .profiles
            .get(name)
            .ok_or_else(|| ResolveError::NoProfile {
                requested: requested.map(str::to_owned),
                default: self.default_profile.clone(),
            })?;
        let (orchestrator, orchestrator_fell_back) =
            match orchestrators.iter().find(|o| **o == chosen.orchestrator) {
                Some(known) => ((*known).to_owned(), false),
                None => (DEFAULT_ORCHESTRATOR.to_owned(), true),
            };

        let mut tried = Vec::new();
        let mut usable = Vec::new();
        for deployment_name in &chosen.deployments {
            let Some(deployment) = self.deployments.get(deployment_name) else {
                tried.push((deployment_name.clone(), "no such deployment".to_owned()));
                continue;
            };
            match deployment.api_key(env) {
                Ok(api_key) => usable.push(ResolvedDeployment {
                    name: deployment_name.clone(),
                    deployment: deployment.clone(),
                    api_key,
                }),
                // Skipped before the first usable one; after it, a
                // fallback that cannot be used is left out quietly.
                Err(why) if usable.is_empty() => {
                    tried.push((deployment_name.clone(), why.to_string()));
                }
                Err(_) => {}
            }
        }
        if usable.is_empty() {
            return Err(ResolveError::NoDeployment {
                profile: name.to_owned(),
                tried,
            });
        }
        let first = usable.remove(0);
        Ok(ResolvedProfile {
            name: name.to_owned(),
            requested: requested.map(str::to_owned),
            fell_back,
            profile: chosen.clone(),
            deployment_name: first.name,
            deployment: first.deployment,
            orchestrator,
            orchestrator_fell_back,
            skipped: tried,
            api_key: first.api_key,
            fallbacks: usable,
        })
    }

    /// Cross-references and ranges; the error is `(key path, message)`.
    fn validate(&self) -> Result<(), (String, String)> {
        if !self.profiles.contains_key(&self.default_profile) {
            return Err((
                "default_profile".to_owned(),
                format!(
                    "no profile named {:?} (profiles: {})",
                    self.default_profile,
                    names(self.profiles.keys())
                ),
            ));
        }
        if self.max_agent_depth > MAX_AGENT_DEPTH_LIMIT {
            return Err((
                "max_agent_depth".to_owned(),
                format!(
                    "must be between 0 and {MAX_AGENT_DEPTH_LIMIT}, not {}",
                    self.max_agent_depth
                ),
            ));
        }
        for (kind, template) in &self.links {
            let at = format!("links.{}", key_segment(kind));
            if kind == "document" {
                return Err((
                    at,
                    "uploaded documents have no link: they are the user's own files".to_owned(),
                ));
            }
            let usable = (template.starts_with("https://") || template.starts_with("http://"))
                && (template.contains("{source}") || template.contains("{title}"));
            if !usable {
                return Err((
                    at,
                    format!(
                        "{template:?} is not an http(s) URL template with {{source}} or {{title}}"
                    ),
                ));
            }
        }
        let mut agents: BTreeMap<&str, &str> = BTreeMap::new();
        for (name, profile) in &self.profiles {
            if let Some(agent) = &profile.agent
                && let Some(other) = agents.insert(&agent.name, name)
            {
                return Err((
                    format!("profiles.{}.agent.name", key_segment(name)),
                    format!(
                        "agent tool {:?} is already the agent of profile {other:?}",
                        agent.name
                    ),
                ));
            }
        }
        for (name, sink) in &self.sinks {
            let at = format!("sinks.{}", key_segment(name));
            check_name(name).map_err(|m| (at.clone(), m))?;
            sink.validate(&at)?;
        }
        for (name, profile) in &self.profiles {
            if let Some(sink) = &profile.sink
                && !self.sinks.contains_key(sink)
            {
                return Err((
                    format!("profiles.{}.sink", key_segment(name)),
                    format!(
                        "no sink named {sink:?} (sinks: {})",
                        names(self.sinks.keys())
                    ),
                ));
            }
        }
        for (name, deployment) in &self.deployments {
            let at = format!("deployments.{}", key_segment(name));
            check_name(name).map_err(|m| (at.clone(), m))?;
            deployment.validate(&at)?;
        }
        for (name, profile) in &self.profiles {
            let at = format!("profiles.{}", key_segment(name));
            check_name(name).map_err(|m| (at.clone(), m))?;
            profile.validate(&at)?;
            for (i, deployment) in profile.deployments.iter().enumerate() {
                if !self.deployments.contains_key(deployment) {
                    let key = if profile.deployments.len() == 1 {
                        format!("{at}.deployment")
                    } else {
                        format!("{at}.deployments[{i}]")
                    };
                    return Err((
                        key,
                        format!(
                            "no deployment named {deployment:?} (deployments: {})",
                            names(self.deployments.keys())
                        ),
                    ));
                }
            }
        }
        for (model, price) in self.prices.iter() {
            let at = format!("prices.{}", key_segment(model));
            if model.is_empty() {
                return Err((at, "the model name is empty".to_owned()));
            }
            price.validate(&at)?;
        }
        Ok(())
    }
}

/// `a, b, c`, or `none`.
fn names<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let list: Vec<&str> = names.map(String::as_str).collect();
    if list.is_empty() {
        "none".to_owned()
    } else {
        list.join(", ")
    }
}

/// A name as it appears in a dotted key path: quoted unless bare.
fn key_segment(name: &str) -> String {
    if !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
    {
        name.to_owned()
    } else {
        format!("{name:?}")
    }
}

/// Profile and deployment names travel in headers and logs: keep them
/// plain.
fn check_name(name: &str) -> Result<(), String> {
    if !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
    {
        Ok(())
    } else {
        Err(format!(
            "bad name {name:?}: use letters, digits, `_`, `-` and `.`"
        ))
    }
}

/// 1-based line and column of a byte offset, for messages.
fn line_and_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

// ---------------------------------------------------------------------------
// Errors

/// A config file that cannot be used: names the file, the key and, where
/// known, the line and column.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct ConfigError {
    pub kind: ConfigErrorKind,
    /// The file name (or whatever origin was given).
    pub origin: String,
    /// Dotted key path, e.g. `profiles.default.policy.max_rounds`.
    pub key: Option<String>,
    /// 1-based line and column.
    pub position: Option<(usize, usize)>,
    pub message: String,
}

impl ConfigError {
    pub fn kind(&self) -> ConfigErrorKind {
        self.kind
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.origin)?;
        if let Some((line, column)) = self.position {
            write!(f, ":{line}:{column}")?;
        }
        if let Some(key) = &self.key {
            write!(f, ": {key}")?;
        }
        write!(f, ": {}", self.message)
    }
}

/// What kind of [`ConfigError`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ConfigErrorKind {
    /// The file could not be read.
    Read,
    /// Not TOML, or not the expected shape: unknown key, wrong type.
    Parse,
    /// A value out of range or a reference to something that does not exist.
    Invalid,
}

/// A profile that cannot be used for a job: fatal for that job, which ends
/// at once with an `error` event carrying [`ResolveError::code`].
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ResolveError {
    /// None of the profile's deployments is resolvable.
    #[error("profile {profile:?} has no usable deployment: {}", describe_tried(.tried))]
    NoDeployment {
        profile: String,
        /// Each deployment tried, with why it could not be used.
        tried: Vec<(String, String)>,
    },
    /// The default profile does not exist.
    #[error("no profile {default:?} (the default) is configured{}", requested_note(.requested))]
    NoProfile {
        requested: Option<String>,
        default: String,
    },
    /// A deployment's key is unavailable ([`Deployment::to_llm_config`],
    /// which knows the deployment only by model and host).
    #[error("deployment {deployment:?} cannot be used: {why}")]
    Unusable { deployment: String, why: String },
}

impl ResolveError {
    /// The `error` event's code.
    pub fn code(&self) -> &'static str {
        match self {
            Self::NoDeployment { .. } => "no_deployment",
            Self::NoProfile { .. } => "no_profile",
            Self::Unusable { .. } => "bad_deployment",
        }
    }
}

fn describe_tried(tried: &[(String, String)]) -> String {
    if tried.is_empty() {
        return "it names no deployment".to_owned();
    }
    tried
        .iter()
        .map(|(name, why)| format!("{name} ({why})"))
        .collect::<Vec<_>>()
        .join("; ")
}

fn requested_note(requested: &Option<String>) -> String {
    match requested {
        Some(r) => format!(" and profile {r:?} does not exist"),
        None => String::new(),
    }
}

/// Why a deployment's key is not available. Never holds the key.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyUnavailable {
    #[error("environment variable {0} is not set")]
    NotSet(String),
    #[error("environment variable {0} is empty")]
    Empty(String),
}

// ---------------------------------------------------------------------------
// Environment

/// Where API keys are read from: the process environment in binaries, a map
/// in tests (no `set_var`).
pub trait EnvSource {
    /// The variable's value; `None` when unset or not Unicode.
    fn var(&self, name: &str) -> Option<String>;
}

/// The process environment.
#[derive(Clone, Copy, Debug, Default)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn var(&self, name: &str) -> Option<String> {
        std::env::var(name).ok()
    }
}

impl<S: BuildHasher> EnvSource for HashMap<String, String, S> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

impl EnvSource for BTreeMap<String, String> {
    fn var(&self, name: &str) -> Option<String> {
        self.get(name).cloned()
    }
}

// ---------------------------------------------------------------------------
// Deployments

/// `[deployments.<name>.retry]` as written, in milliseconds.
#[derive(Deserialize)]
#[serde(default, deny_unknown_fields)]
struct RawRetry {
    max_attempts: u32,
    max_elapsed_ms: u64,
    base_delay_ms: u64,
    max_delay_ms: u64,
}

impl Default for RawRetry {
    fn default() -> Self {
        let policy = RetryPolicy::default();
        Self {
            max_attempts: policy.max_attempts,
            max_elapsed_ms: millis(policy.max_elapsed),
            base_delay_ms: millis(policy.base_delay),
            max_delay_ms: millis(policy.max_delay),
        }
    }
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

impl From<RawRetry> for RetryPolicy {
    fn from(raw: RawRetry) -> Self {
        Self {
            max_attempts: raw.max_attempts,
            max_elapsed: Duration::from_millis(raw.max_elapsed_ms),
            base_delay: Duration::from_millis(raw.base_delay_ms),
            max_delay: Duration::from_millis(raw.max_delay_ms),
        }
    }
}

/// Retries: a few attempts, a time budget, delays in order.
fn validate_retry(retry: &RetryPolicy, at: &str) -> Result<(), (String, String)> {
    if !(1..=MAX_RETRY_ATTEMPTS_LIMIT).contains(&retry.max_attempts) {
        return Err((
            format!("{at}.max_attempts"),
            format!(
                "must be between 1 and {MAX_RETRY_ATTEMPTS_LIMIT}, not {}",
                retry.max_attempts
            ),
        ));
    }
    if retry.max_elapsed.is_zero() {
        return Err((
            format!("{at}.max_elapsed_ms"),
            "must be more than 0".to_owned(),
        ));
    }
    if retry.base_delay > retry.max_delay {
        return Err((
            format!("{at}.base_delay_ms"),
            format!(
                "{} is more than max_delay_ms ({})",
                millis(retry.base_delay),
                millis(retry.max_delay)
            ),
        ));
    }
    Ok(())
}

/// One model behind one OpenAI-compatible endpoint.
#[derive(Clone, PartialEq, Deserialize)]
#[serde(try_from = "RawDeployment")]
pub struct Deployment {
    /// Which OpenAI API shape to speak.
    pub api: ApiShape,
    /// A reasoning model: Responses requests ask for its encrypted
    /// reasoning ([`LlmConfig::reasoning`]). Never assumed.
    pub reasoning: bool,
    /// The API root including `/v1`; a query string in it is kept.
    pub base_url: Url,
    /// Model name sent to the provider, priced and token-counted.
    pub model: String,
    /// The environment variable holding the key; `None`: no key is sent.
    pub api_key_env: Option<String>,
    pub auth: Auth,
    /// Extra query parameters on every request (Azure: `api-version`).
    pub query: BTreeMap<String, String>,
    pub stream: bool,
    /// HTTP/1.1 or HTTP/2 ([`crate::HttpVersion`]).
    pub http: crate::HttpVersion,
    pub connect_timeout: Duration,
    pub first_token_timeout: Duration,
    pub idle_timeout: Duration,
    /// Retries of 429 and 5xx answers before any output was streamed.
    pub retry: RetryPolicy,
    /// A key given on the command line ([`Deployment::with_api_key`]); never
    /// read from a file. Wins over `api_key_env`.
    inline_api_key: Option<String>,
}

impl fmt::Debug for Deployment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Deployment")
            .field("api", &self.api)
            .field("reasoning", &self.reasoning)
            .field(
                "base_url",
                &toolfleet_protocol::redact_url(self.base_url.as_str()),
            )
            .field("model", &self.model)
            .field("api_key_env", &self.api_key_env)
            .field("auth", &self.auth)
            .field("query", &self.query)
            .field("stream", &self.stream)
            .field("http", &self.http)
            .field("connect_timeout", &self.connect_timeout)
            .field("first_token_timeout", &self.first_token_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("retry", &self.retry)
            .field(
                "inline_api_key",
                &self.inline_api_key.as_ref().map(|_| "[redacted]"),
            )
            .finish()
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDeployment {
    #[serde(default)]
    api: ApiShape,
    #[serde(default)]
    reasoning: bool,
    // Parsed here rather than through `url`'s serde feature, which this
    // crate does not enable itself.
    #[serde(deserialize_with = "deserialize_url")]
    base_url: Url,
    model: String,
    #[serde(default)]
    api_key_env: Option<String>,
    /// Present only to refuse it with a useful message.
    #[serde(default)]
    api_key: Option<serde::de::IgnoredAny>,
    #[serde(default)]
    auth: Auth,
    #[serde(default)]
    query: BTreeMap<String, String>,
    #[serde(default = "yes")]
    stream: bool,
    #[serde(default)]
    http: crate::HttpVersion,
    #[serde(default = "default_connect_timeout_ms")]
    connect_timeout_ms: u64,
    #[serde(default = "default_first_token_timeout_ms")]
    first_token_timeout_ms: u64,
    #[serde(default = "default_idle_timeout_ms")]
    idle_timeout_ms: u64,
    #[serde(default)]
    retry: RawRetry,
}

fn deserialize_url<'de, D: Deserializer<'de>>(d: D) -> Result<Url, D::Error> {
    let text = String::deserialize(d)?;
    Url::parse(&text).map_err(|e| serde::de::Error::custom(format!("not a URL: {e}")))
}

fn yes() -> bool {
    true
}
fn default_connect_timeout_ms() -> u64 {
    millis(crate::DEFAULT_CONNECT_TIMEOUT)
}
fn default_first_token_timeout_ms() -> u64 {
    millis(crate::DEFAULT_FIRST_TOKEN_TIMEOUT)
}
fn default_idle_timeout_ms() -> u64 {
    millis(crate::DEFAULT_IDLE_TIMEOUT)
}

impl TryFrom<RawDeployment> for Deployment {
    type Error = String;

    fn try_from(raw: RawDeployment) -> Result<Self, Self::Error> {
        if raw.api_key.is_some() {
            return Err(
                "`api_key` is not allowed in the file: put the key in an environment \
                        variable and name it with `api_key_env`"
                    .to_owned(),
            );
        }
        Ok(Self {
            api: raw.api,
            reasoning: raw.reasoning,
            base_url: raw.base_url,
            model: raw.model,
            api_key_env: raw.api_key_env,
            auth: raw.auth,
            query: raw.query,
            stream: raw.stream,
            http: raw.http,
            connect_timeout: Duration::from_millis(raw.connect_timeout_ms),
            first_token_timeout: Duration::from_millis(raw.first_token_timeout_ms),
            idle_timeout: Duration::from_millis(raw.idle_timeout_ms),
            retry: raw.retry.into(),
            inline_api_key: None,
        })
    }
}

impl Deployment {
    /// A Chat Completions deployment of a model that is not a reasoning
    /// model, with the `DEFAULT_*` timeouts and retries, streaming, and no
    /// key.
    pub fn new(base_url: Url, model: impl Into<String>) -> Self {
        Self {
            api: ApiShape::default(),
            reasoning: false,
            base_url,
            model: model.into(),
            api_key_env: None,
            auth: Auth::default(),
            query: BTreeMap::new(),
            stream: true,
            http: crate::HttpVersion::Http1,
            connect_timeout: crate::DEFAULT_CONNECT_TIMEOUT,
            first_token_timeout: crate::DEFAULT_FIRST_TOKEN_TIMEOUT,
            idle_timeout: crate::DEFAULT_IDLE_TIMEOUT,
            retry: RetryPolicy::default(),
            inline_api_key: None,
        }
    }

    /// The deployment described by a binary's `--llm-*` flags.
    pub fn from_llm_args(args: &crate::args::LlmArgs) -> Self {
        let mut deployment = Self::new(args.base_url.clone(), args.model.clone());
        deployment.api = args.api;
        deployment.http = args.http;
        deployment.connect_timeout = Duration::from_millis(args.connect_timeout_ms);
        deployment.first_token_timeout = Duration::from_millis(args.first_token_timeout_ms);
        deployment.idle_timeout = Duration::from_millis(args.idle_timeout_ms);
        if let Some(key) = &args.api_key {
            deployment = deployment.with_api_key(key.clone());
        }
        deployment
    }

    /// Uses `key` instead of reading `api_key_env` (a key from the command
    /// line). An empty key means none.
    pub fn with_api_key(mut self, key: impl Into<String>) -> Self {
        let key = key.into();
        self.inline_api_key = (!key.trim().is_empty()).then_some(key);
        self
    }

    /// The key to send: the one given in code, else `api_key_env`'s value
    /// in `env` (trimmed), else none when no variable is named.
    ///
    /// # Errors
    ///
    /// [`KeyUnavailable`] when the named variable is unset or empty.
    pub fn api_key(&self, env: &dyn EnvSource) -> Result<Option<String>, KeyUnavailable> {
        if let Some(key) = &self.inline_api_key {
            return Ok(Some(key.clone()));
        }
        let Some(var) = &self.api_key_env else {
            return Ok(None);
        };
        match env.var(var) {
            None => Err(KeyUnavailable::NotSet(var.clone())),
            // Keys pasted into env files often carry a trailing newline.
            Some(value) if value.trim().is_empty() => Err(KeyUnavailable::Empty(var.clone())),
            Some(value) => Ok(Some(value.trim().to_owned())),
        }
    }

    /// The client config for this deployment, with its key read from `env`.
    ///
    /// # Errors
    ///
    /// [`ResolveError::Unusable`] when the named key variable is unset or
    /// empty.
    pub fn to_llm_config(&self, env: &dyn EnvSource) -> Result<LlmConfig, ResolveError> {
        let key = self.api_key(env).map_err(|why| ResolveError::Unusable {
            deployment: self.label(),
            why: why.to_string(),
        })?;
        Ok(self.llm_config_with_key(key))
    }

    /// `model at host`, for messages about a deployment whose name is not
    /// at hand.
    fn label(&self) -> String {
        format!(
            "{} at {}",
            self.model,
            self.base_url.host_str().unwrap_or("?")
        )
    }

    fn llm_config_with_key(&self, api_key: Option<String>) -> LlmConfig {
        LlmConfig {
            base_url: self.base_url.clone(),
            api_key,
            api: self.api,
            reasoning: self.reasoning,
            auth: self.auth.clone(),
            extra_query: self
                .query
                .iter()
                .map(|(name, value)| (name.clone(), value.clone()))
                .collect(),
            stream: self.stream,
            retry: self.retry.clone(),
            connect_timeout: self.connect_timeout,
            first_token_timeout: self.first_token_timeout,
            idle_timeout: self.idle_timeout,
            http: self.http,
        }
    }

    fn validate(&self, at: &str) -> Result<(), (String, String)> {
        let url = &self.base_url;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err((
                format!("{at}.base_url"),
                format!("must be an http or https URL, not a {} URL", url.scheme()),
            ));
        }
        if !url.username().is_empty() || url.password().is_some() {
            return Err((
                format!("{at}.base_url"),
                "must not carry a user or password: put the key in an environment variable \
                 and name it with `api_key_env`"
                    .to_owned(),
            ));
        }
        if self.model.trim().is_empty() {
            return Err((format!("{at}.model"), "must not be empty".to_owned()));
        }
        if let Some(var) = &self.api_key_env {
            // The value is never echoed: a key pasted here by mistake must
            // not end up in a log.
            if !is_env_var_name(var) {
                return Err((
                    format!("{at}.api_key_env"),
                    "must be the name of an environment variable (letters, digits and `_`, \
                     not starting with a digit), not the key itself"
                        .to_owned(),
                ));
            }
        }
        if let Auth::Header(header) = &self.auth
            && reqwest::header::HeaderName::from_bytes(header.as_bytes()).is_err()
        {
            return Err((
                format!("{at}.auth.header"),
                format!("{header:?} is not a valid HTTP header name"),
            ));
        }
        for name in self.query.keys() {
            if name.is_empty() {
                return Err((
                    format!("{at}.query"),
                    "a parameter name is empty".to_owned(),
                ));
            }
            if CREDENTIAL_QUERY_NAMES.contains(&name.to_ascii_lowercase().as_str()) {
                return Err((
                    format!("{at}.query.{}", key_segment(name)),
                    "looks like a credential; keys belong in the environment: name the \
                     variable with `api_key_env` and use `auth = { header = \"...\" }`"
                        .to_owned(),
                ));
            }
        }
        for (key, value) in [
            ("connect_timeout_ms", self.connect_timeout),
            ("first_token_timeout_ms", self.first_token_timeout),
            ("idle_timeout_ms", self.idle_timeout),
        ] {
            if value.is_zero() {
                return Err((format!("{at}.{key}"), "must be more than 0".to_owned()));
            }
        }
        validate_retry(&self.retry, &format!("{at}.retry"))
    }
}

fn is_env_var_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

// ---------------------------------------------------------------------------
// Profiles

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
}

/// Default of [`Profile::approval_timeout_ms`]: one hour.
pub const DEFAULT_APPROVAL_TIMEOUT_MS: u64 = 3_600_000;
/// The longest [`Profile::approval_timeout_ms`] a file may set: a week.
pub const MAX_APPROVAL_TIMEOUT_MS: u64 = 7 * 24 * 3_600_000;

fn default_approval_timeout_ms() -> u64 {
    DEFAULT_APPROVAL_TIMEOUT_MS
}

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
}

/// Default of [`AgentTool::timeout_ms`].
pub const DEFAULT_AGENT_TIMEOUT_MS: u64 = 120_000;

fn default_agent_timeout_ms() -> u64 {
    DEFAULT_AGENT_TIMEOUT_MS
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
        Ok(Self {
            orchestrator: raw.orchestrator,
            deployments,
            utility_model: raw.utility_model,
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
        }
    }

    /// Whether this profile requires a person's approval before `tool`
    /// runs (its own list, or the definition's `requiresApproval`).
    pub fn requires_approval(&self, tool: &toolfleet_protocol::tools::ToolDefinition) -> bool {
        tool.requires_approval || self.require_approval.iter().any(|r| r.matches(&tool.id))
    }

    fn validate(&self, at: &str) -> Result<(), (String, String)> {
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
        if !(1_000..=MAX_APPROVAL_TIMEOUT_MS).contains(&self.approval_timeout_ms) {
            return Err((
                format!("{at}.approval_timeout_ms"),
                format!(
                    "must be between 1000 (a second) and {MAX_APPROVAL_TIMEOUT_MS} (a week), not {}",
                    self.approval_timeout_ms
                ),
            ));
        }
        for (key, value) in [
            ("utility_model", &self.utility_model),
            ("data_source", &self.data_source),
        ] {
            if value.as_ref().is_some_and(|v| v.trim().is_empty()) {
                return Err((format!("{at}.{key}"), "must not be empty".to_owned()));
            }
        }
        if let Some(agent) = &self.agent {
            if ToolId::new("agent", agent.name.clone(), (1, 0, 0)).is_err() || agent.name.len() > 64
            {
                return Err((
                    format!("{at}.agent.name"),
                    format!(
                        "{:?} is not a tool name ([a-z][a-z0-9_]*, at most 64 characters)",
                        agent.name
                    ),
                ));
            }
            if agent.description.trim().is_empty() {
                return Err((
                    format!("{at}.agent.description"),
                    "must not be empty".to_owned(),
                ));
            }
            if !(1_000..=3_600_000).contains(&agent.timeout_ms) {
                return Err((
                    format!("{at}.agent.timeout_ms"),
                    format!("must be between 1000 and 3600000, not {}", agent.timeout_ms),
                ));
            }
        }
        self.policy.validate(&format!("{at}.policy"))?;
        self.rag.validate(&format!("{at}.rag"))?;
        self.scoping.validate(&format!("{at}.scoping"))
    }
}

/// Progressive tool scoping for one profile: how many of the permitted
/// tools the model is offered, and when a planning call narrows them.
///
/// Up to `scoping_threshold` permitted tools, all are offered; above it,
/// token-overlap relevance picks the top `initial_tool_count` (must-include
/// tools always in); above `planning_threshold`, a planning call to the
/// Preemptive retrieval: when a chat job has attached documents or a data
/// source, the orchestrator searches them (through the retrieval pool, as
/// tool jobs) with the last user message before the first model call, and
/// puts what it found, with its `[doc:N]` markers, in the prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RagPolicy {
    /// Search before the first model call. Default true.
    pub prefetch: bool,
    /// Passages per source (1..=20). Default 5.
    pub top_k: u32,
    /// The profile answers only from its documents: when the search found
    /// nothing, the model is told to try the search tools before saying
    /// there is no answer. Default false.
    pub in_scope_only: bool,
}

impl Default for RagPolicy {
    fn default() -> Self {
        Self {
            prefetch: true,
            top_k: 5,
            in_scope_only: false,
        }
    }
}

impl RagPolicy {
    fn validate(&self, at: &str) -> Result<(), (String, String)> {
        if !(1..=20).contains(&self.top_k) {
            return Err((
                format!("{at}.top_k"),
                format!("must be between 1 and 20, not {}", self.top_k),
            ));
        }
        Ok(())
    }
}

/// profile's utility model narrows the set, using the last
/// `planning_history_message_count` messages. When tools were left out the
/// model may call `search_tools` to add some, at most
/// `max_expansion_rounds` times and never beyond `max_tool_count` tools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScopingPolicy {
    pub initial_tool_count: usize,
    pub scoping_threshold: usize,
    pub planning_threshold: usize,
    pub max_expansion_rounds: u32,
    pub max_tool_count: usize,
    pub planning_history_message_count: usize,
}

/// Defaults of [`ScopingPolicy`].
pub const DEFAULT_INITIAL_TOOL_COUNT: usize = 20;
pub const DEFAULT_SCOPING_THRESHOLD: usize = 30;
pub const DEFAULT_PLANNING_THRESHOLD: usize = 100;
pub const DEFAULT_MAX_EXPANSION_ROUNDS: u32 = 3;
pub const DEFAULT_MAX_TOOL_COUNT: usize = 30;
pub const DEFAULT_PLANNING_HISTORY_MESSAGE_COUNT: usize = 10;
/// The most tools any request may offer (providers cap tools per request;
/// OpenAI at 128).
pub const MAX_TOOLS_PER_REQUEST: usize = 128;

impl Default for ScopingPolicy {
    fn default() -> Self {
        Self {
            initial_tool_count: DEFAULT_INITIAL_TOOL_COUNT,
            scoping_threshold: DEFAULT_SCOPING_THRESHOLD,
            planning_threshold: DEFAULT_PLANNING_THRESHOLD,
            max_expansion_rounds: DEFAULT_MAX_EXPANSION_ROUNDS,
            max_tool_count: DEFAULT_MAX_TOOL_COUNT,
            planning_history_message_count: DEFAULT_PLANNING_HISTORY_MESSAGE_COUNT,
        }
    }
}

impl ScopingPolicy {
    fn validate(&self, at: &str) -> Result<(), (String, String)> {
        let check = |key: &str, low: usize, high: usize, value: usize| {
            if (low..=high).contains(&value) {
                Ok(())
            } else {
                Err((
                    format!("{at}.{key}"),
                    format!("must be between {low} and {high}, not {value}"),
                ))
            }
        };
        check(
            "initial_tool_count",
            1,
            MAX_TOOLS_PER_REQUEST,
            self.initial_tool_count,
        )?;
        check(
            "max_tool_count",
            1,
            MAX_TOOLS_PER_REQUEST,
            self.max_tool_count,
        )?;
        check(
            "scoping_threshold",
            1,
            MAX_TOOLS_PER_REQUEST,
            self.scoping_threshold,
        )?;
        check("planning_threshold", 1, usize::MAX, self.planning_threshold)?;
        check(
            "max_expansion_rounds",
            0,
            100,
            self.max_expansion_rounds as usize,
        )?;
        check(
            "planning_history_message_count",
            1,
            500,
            self.planning_history_message_count,
        )?;
        if self.scoping_threshold > self.max_tool_count {
            return Err((
                format!("{at}.scoping_threshold"),
                format!(
                    "must not exceed max_tool_count ({}): up to the threshold every permitted tool is offered; is {}",
                    self.max_tool_count, self.scoping_threshold
                ),
            ));
        }
        if self.initial_tool_count > self.max_tool_count {
            return Err((
                format!("{at}.initial_tool_count"),
                format!(
                    "must not exceed max_tool_count ({}), is {}",
                    self.max_tool_count, self.initial_tool_count
                ),
            ));
        }
        Ok(())
    }
}

/// What to do with a tool call the model's output limit cut short.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TruncatedPolicy {
    /// Dispatch nothing and end the invocation with a clear error.
    #[default]
    Error,
    /// Dispatch nothing and ask the model again, telling it the call was cut.
    AskAgain,
}

/// The agentic loop's limits for one profile.
///
/// Default: 8 rounds, 3 consecutive tool errors, parallel tool calls on, 8
/// calls per turn, tool results capped at 4000 tokens, truncated tool calls
/// end the invocation with an error.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LoopPolicy {
    /// Model calls per invocation; on the last one the model is told to
    /// answer with what it has.
    pub max_rounds: u32,
    /// Rounds in a row whose tool calls all failed before the model is told
    /// to answer with what it has.
    pub max_consecutive_tool_errors: u32,
    /// Whether the model may ask for several tools in one turn (run in
    /// parallel unless a tool is not `parallelSafe`).
    pub parallel_tool_calls: bool,
    /// Tool calls run per model turn; the rest get an error result.
    pub max_calls_per_turn: usize,
    /// Cap on one tool result in the model's tokens; `None` (`"off"` in the
    /// file): no cap.
    #[serde(deserialize_with = "deserialize_token_cap")]
    pub max_tool_result_tokens: Option<usize>,
    pub on_truncated_tool_call: TruncatedPolicy,
    /// Context compaction: a conversation over this many tokens has its
    /// older turns summarised before the next model call; `None` (`"off"`,
    /// the default): never.
    #[serde(deserialize_with = "deserialize_token_cap")]
    pub context_budget_tokens: Option<usize>,
}

impl Default for LoopPolicy {
    fn default() -> Self {
        Self {
            max_rounds: DEFAULT_MAX_ROUNDS,
            max_consecutive_tool_errors: DEFAULT_MAX_CONSECUTIVE_TOOL_ERRORS,
            parallel_tool_calls: true,
            max_calls_per_turn: DEFAULT_MAX_CALLS_PER_TURN,
            max_tool_result_tokens: Some(DEFAULT_MAX_TOOL_RESULT_TOKENS),
            on_truncated_tool_call: TruncatedPolicy::default(),
            context_budget_tokens: None,
        }
    }
}

impl LoopPolicy {
    fn validate(&self, at: &str) -> Result<(), (String, String)> {
        let out_of_range = |key: &str, low: usize, high: usize, value: usize| {
            (!(low..=high).contains(&value)).then(|| {
                (
                    format!("{at}.{key}"),
                    format!("must be between {low} and {high}, not {value}"),
                )
            })
        };
        let checks = [
            out_of_range(
                "max_rounds",
                1,
                MAX_ROUNDS_LIMIT as usize,
                self.max_rounds as usize,
            ),
            out_of_range(
                "max_consecutive_tool_errors",
                1,
                MAX_TOOL_ERRORS_LIMIT as usize,
                self.max_consecutive_tool_errors as usize,
            ),
            out_of_range(
                "max_calls_per_turn",
                1,
                MAX_CALLS_PER_TURN_LIMIT,
                self.max_calls_per_turn,
            ),
            self.max_tool_result_tokens.and_then(|cap| {
                out_of_range(
                    "max_tool_result_tokens",
                    crate::budget::MIN_CAP_TOKENS,
                    MAX_TOOL_RESULT_TOKENS_LIMIT,
                    cap,
                )
            }),
            self.context_budget_tokens.and_then(|budget| {
                out_of_range(
                    "context_budget_tokens",
                    MIN_CONTEXT_BUDGET_TOKENS,
                    MAX_CONTEXT_BUDGET_TOKENS,
                    budget,
                )
            }),
        ];
        match checks.into_iter().flatten().next() {
            Some(error) => Err(error),
            None => Ok(()),
        }
    }
}

/// A token count, or `"off"` for no cap (TOML has no null).
fn deserialize_token_cap<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
    struct CapVisitor;

    impl serde::de::Visitor<'_> for CapVisitor {
        type Value = Option<usize>;

        fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.write_str("a number of tokens or \"off\"")
        }

        fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<Self::Value, E> {
            usize::try_from(v)
                .map(Some)
                .map_err(|_| E::custom(format!("{v} is not a number of tokens")))
        }

        fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<Self::Value, E> {
            usize::try_from(v)
                .map(Some)
                .map_err(|_| E::custom(format!("{v} is too large")))
        }

        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            if v == "off" {
                Ok(None)
            } else {
                Err(E::invalid_value(serde::de::Unexpected::Str(v), &self))
            }
        }
    }

    d.deserialize_any(CapVisitor)
}

// ---------------------------------------------------------------------------
// Resolution

/// A profile resolved for one job: the deployment to call and its key.
#[derive(Clone, PartialEq)]
pub struct ResolvedProfile {
    /// The profile used.
    pub name: String,
    /// The name the job gave, if any.
    pub requested: Option<String>,
    /// The job named a profile that does not exist; the default was used.
    pub fell_back: bool,
    pub profile: Profile,
    pub deployment_name: String,
    pub deployment: Deployment,
    /// The orchestrator to run: one of the known names
    /// ([`ORCHESTRATORS`], or those given to [`FleetConfig::resolve_among`]).
    pub orchestrator: String,
    /// The profile named an unknown orchestrator; the default is used.
    pub orchestrator_fell_back: bool,
    /// Deployments tried before this one, with why each was skipped.
    pub skipped: Vec<(String, String)>,
    /// The key to send, if any. Redacted in `Debug`.
    pub api_key: Option<String>,
    /// The profile's later deployments that resolved too, in order: where
    /// a call goes when this deployment fails before any output
    /// ([`ResolvedProfile::next_deployment`]).
    pub fallbacks: Vec<ResolvedDeployment>,
}

/// A deployment with its key, resolved. `Debug` redacts the key.
#[derive(Clone, PartialEq)]
pub struct ResolvedDeployment {
    pub name: String,
    pub deployment: Deployment,
    pub api_key: Option<String>,
}

impl fmt::Debug for ResolvedDeployment {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResolvedDeployment")
            .field("name", &self.name)
            .field("deployment", &self.deployment)
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .finish()
    }
}

impl fmt::Debug for ResolvedProfile {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResolvedProfile")
            .field("name", &self.name)
            .field("requested", &self.requested)
            .field("fell_back", &self.fell_back)
            .field("profile", &self.profile)
            .field("deployment_name", &self.deployment_name)
            .field("deployment", &self.deployment)
            .field("orchestrator", &self.orchestrator)
            .field("orchestrator_fell_back", &self.orchestrator_fell_back)
            .field("skipped", &self.skipped)
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .field("fallbacks", &self.fallbacks)
            .finish()
    }
}

impl ResolvedProfile {
    /// The profile on its next resolved deployment, when there is one: the
    /// current one is recorded in `skipped` with `why`.
    #[must_use]
    pub fn next_deployment(&self, why: &str) -> Option<ResolvedProfile> {
        let mut rest = self.fallbacks.clone();
        if rest.is_empty() {
            return None;
        }
        let next = rest.remove(0);
        let mut skipped = self.skipped.clone();
        skipped.push((self.deployment_name.clone(), why.to_owned()));
        Some(ResolvedProfile {
            deployment_name: next.name,
            deployment: next.deployment,
            api_key: next.api_key,
            fallbacks: rest,
            skipped,
            ..self.clone()
        })
    }

    /// The conversation model.
    pub fn model(&self) -> &str {
        &self.deployment.model
    }

    /// The model for the tool-planning call.
    pub fn utility_model(&self) -> &str {
        self.profile
            .utility_model
            .as_deref()
            .unwrap_or(&self.deployment.model)
    }

    /// The client config for the resolved deployment, with the resolved
    /// key.
    pub fn llm_config(&self) -> LlmConfig {
        self.deployment.llm_config_with_key(self.api_key.clone())
    }
}

// ---------------------------------------------------------------------------
// Prices

/// USD per million tokens for one model.
#[derive(Clone, Copy, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Price {
    /// Uncached prompt tokens.
    pub input: f64,
    /// Prompt tokens served from the provider's cache; `input` when unset.
    #[serde(default)]
    pub cached_input: Option<f64>,
    /// Completion tokens, reasoning tokens included.
    pub output: f64,
}

impl Price {
    /// USD for `usage`. Cached prompt tokens are billed at `cached_input`
    /// and not again at `input`; reasoning tokens are already part of the
    /// completion tokens and are not added again.
    pub fn cost(&self, usage: &Usage) -> f64 {
        let cached = usage.cached_tokens.min(usage.prompt_tokens);
        let uncached = usage.prompt_tokens - cached;
        let cached_price = self.cached_input.unwrap_or(self.input);
        // u64 → f64 is exact below 2^53 tokens, which no bill reaches.
        (uncached as f64 * self.input
            + cached as f64 * cached_price
            + usage.completion_tokens as f64 * self.output)
            / 1_000_000.0
    }

    fn validate(&self, at: &str) -> Result<(), (String, String)> {
        for (key, value) in [
            ("input", Some(self.input)),
            ("cached_input", self.cached_input),
            ("output", Some(self.output)),
        ] {
            if let Some(v) = value
                && (!v.is_finite() || v < 0.0)
            {
                return Err((
                    format!("{at}.{key}"),
                    format!("must be a price of 0 or more, not {v}"),
                ));
            }
        }
        Ok(())
    }
}

/// Prices by model name.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(transparent)]
pub struct PriceTable {
    prices: BTreeMap<String, Price>,
}

impl PriceTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn insert(&mut self, model: impl Into<String>, price: Price) {
        self.prices.insert(model.into(), price);
    }

    /// The price of `model`: its own entry, else, for a dated snapshot such
    /// as `gpt-4o-mini-2024-07-18` (what providers report back), the entry
    /// of the name without the date. Other near matches are not guessed:
    /// `gpt-4o-audio-preview` is not priced as `gpt-4o`.
    pub fn get(&self, model: &str) -> Option<&Price> {
        self.prices
            .get(model)
            .or_else(|| strip_date_suffix(model).and_then(|base| self.prices.get(base)))
    }

    /// USD for `usage` on `model`; `None` when the model has no price.
    pub fn cost(&self, model: &str, usage: &Usage) -> Option<f64> {
        self.get(model).map(|price| price.cost(usage))
    }

    pub fn is_empty(&self) -> bool {
        self.prices.is_empty()
    }

    pub fn len(&self) -> usize {
        self.prices.len()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&String, &Price)> {
        self.prices.iter()
    }
}

/// `name` without a trailing `-YYYY-MM-DD`.
fn strip_date_suffix(model: &str) -> Option<&str> {
    const SUFFIX: usize = "-2024-07-18".len();
    let split = model.len().checked_sub(SUFFIX)?;
    let (base, date) = (model.get(..split)?, model.get(split..)?);
    let bytes = date.as_bytes();
    let shape = bytes.iter().enumerate().all(|(i, b)| match i {
        0 | 5 | 8 => *b == b'-',
        _ => b.is_ascii_digit(),
    });
    (shape && !base.is_empty()).then_some(base)
}

#[cfg(test)]
mod tests {

    #[test]
    fn later_usable_deployments_are_the_fallbacks_in_order() {
        let config = FleetConfig::from_toml(
            r#"
[deployments.a]
base_url = "http://a.example/v1"
model = "m-a"
[deployments.nokey]
base_url = "http://n.example/v1"
model = "m-n"
api_key_env = "TOOLFLEET_TEST_UNSET_KEY"
[deployments.b]
base_url = "http://b.example/v1"
model = "m-b"
api_key_env = "TOOLFLEET_TEST_B_KEY"
[profiles.default]
deployments = ["a", "nokey", "b"]
"#,
            "test",
        )
        .unwrap();
        let env: std::collections::HashMap<String, String> =
            [("TOOLFLEET_TEST_B_KEY".to_owned(), "sk-b-secret".to_owned())].into();
        let r = config.resolve(None, &env).unwrap();
        assert_eq!(r.deployment_name, "a");
        let names: Vec<&str> = r.fallbacks.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(names, ["b"], "the one without a key is left out");
        assert!(!format!("{r:?}").contains("sk-b-secret"), "{r:?}");
        let next = r.next_deployment("http_500").expect("b");
        assert_eq!(next.deployment_name, "b");
        assert_eq!(next.model(), "m-b");
        assert_eq!(next.api_key.as_deref(), Some("sk-b-secret"));
        assert_eq!(
            next.skipped.last().unwrap(),
            &("a".to_owned(), "http_500".to_owned())
        );
        assert!(next.next_deployment("again").is_none());
    }
    use super::*;

    const EXAMPLE: &str = include_str!("../../../config/toolfleet.example.toml");
    const PROVIDERS_DOC: &str = include_str!("../../../README.md");

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect()
    }

    fn parse(text: &str) -> Result<FleetConfig, ConfigError> {
        FleetConfig::from_toml(text, "test.toml")
    }

    fn parse_err(text: &str) -> ConfigError {
        parse(text).expect_err("the config should be refused")
    }

    #[test]
    fn sinks_are_parsed_and_checked_with_the_key_path() {
        const DEPLOYMENT: &str =
            "[deployments.local]\nbase_url = \"http://127.0.0.1:11434/v1\"\nmodel = \"m\"\n";
        let ok = parse(&format!(
            r#"{DEPLOYMENT}
            [profiles.default]
            deployment = "local"
            sink = "acme"
            [sinks.acme]
            url = "https://hooks.acme.example/toolfleet"
            secret_env = "TOOLFLEET_SINK_ACME_SECRET"
            events = "all"
            [sinks.bus]
            relay = "acme.answers"
            "#
        ))
        .expect("a config with sinks");
        assert_eq!(ok.profiles["default"].sink.as_deref(), Some("acme"));
        let acme = &ok.sinks["acme"];
        assert_eq!(acme.events, toolfleet_protocol::SinkEvents::All);
        assert_eq!(
            acme.secret_env.as_deref(),
            Some("TOOLFLEET_SINK_ACME_SECRET")
        );
        assert_eq!(
            ok.sinks["bus"].events,
            toolfleet_protocol::SinkEvents::Final
        );
        assert_eq!(ok.sinks["bus"].relay.as_deref(), Some("acme.answers"));

        for (sink, key, says) in [
            ("", "sinks.s", "neither"),
            (
                "url = \"https://h.example/x\"",
                "sinks.s.secret_env",
                "always signed",
            ),
            (
                "url = \"https://h.example/x\"\nsecret_env = \"1BAD\"",
                "sinks.s.secret_env",
                "not an environment",
            ),
            (
                "url = \"ftp://h.example/x\"\nsecret_env = \"S\"",
                "sinks.s.url",
                "https",
            ),
            (
                "url = \"https://u:p@h.example/x\"\nsecret_env = \"S\"",
                "sinks.s.url",
                "credentials",
            ),
            (
                "url = \"not a url\"\nsecret_env = \"S\"",
                "sinks.s.url",
                "not a URL",
            ),
            ("relay = \"acme.*\"", "sinks.s.relay", "wildcards"),
            ("relay = \"acme..x\"", "sinks.s.relay", "wildcards"),
            (
                "relay = \"a.b\"\nsecret_env = \"S\"",
                "sinks.s.secret_env",
                "only a webhook",
            ),
        ] {
            let e = parse_err(&format!(
                "{DEPLOYMENT}\n[profiles.default]\ndeployment = \"local\"\n[sinks.s]\n{sink}\n"
            ));
            assert_eq!(e.key.as_deref(), Some(key), "{sink}: {e}");
            assert!(e.to_string().contains(says), "{sink}: {e}");
        }
        let e = parse_err(&format!(
            "{DEPLOYMENT}\n[profiles.default]\ndeployment = \"local\"\nsink = \"nope\"\n"
        ));
        assert_eq!(e.key.as_deref(), Some("profiles.default.sink"), "{e}");
        assert!(e.to_string().contains("no sink named"), "{e}");
        let e = parse_err(&format!(
            "{DEPLOYMENT}\n[profiles.default]\ndeployment = \"local\"\n[sinks.s]\nrelay = \"a.b\"\nsecret = \"x\"\n"
        ));
        assert_eq!(e.kind(), ConfigErrorKind::Parse, "{e}");
    }

    const MINIMAL: &str = r#"
        [deployments.local]
        base_url = "http://127.0.0.1:11434/v1"
        model = "llama3.1:8b"

        [profiles.default]
        deployment = "local"
    "#;

    /// Two deployments with keys, a profile that prefers the first.
    const TWO: &str = r#"
        default_profile = "main"

        [deployments.primary]
        base_url = "https://api.openai.com/v1"
        model = "gpt-4o-mini"
        api_key_env = "PRIMARY_KEY"

        [deployments.backup]
        base_url = "https://backup.example.com/v1"
        model = "gpt-4o-mini"
        api_key_env = "BACKUP_KEY"

        [profiles.main]
        deployments = ["primary", "backup"]

        [profiles.other]
        orchestrator = "swarm"
        deployment = "backup"
    "#;

    #[test]
    fn example_file_loads_with_every_key() {
        let config = parse(EXAMPLE).expect("the example config loads");
        assert!(config.warnings().is_empty(), "{:?}", config.warnings());
        let profile = &config.profiles[&config.default_profile];
        assert!(!profile.must_include_tools.is_empty());
        assert!(profile.system_prompt.is_some());
        assert!(profile.utility_model.is_some());
        assert!(profile.data_source.is_some());
        assert!(
            config
                .deployments
                .values()
                .any(|d| d.api == ApiShape::Responses)
        );
        assert!(
            config
                .deployments
                .values()
                .any(|d| matches!(d.auth, Auth::Header(_)) && !d.query.is_empty())
        );
        assert!(config.profiles.values().any(|p| p.deployments.len() > 1));
        assert!(!config.prices.is_empty());
    }

    #[test]
    fn example_file_documents_every_key_of_the_module_docs() {
        // Each key of the module's table appears in the example file.
        for key in [
            "default_profile",
            "api",
            "reasoning",
            "base_url",
            "model",
            "api_key_env",
            "auth",
            "query",
            "stream",
            "http",
            "connect_timeout_ms",
            "first_token_timeout_ms",
            "idle_timeout_ms",
            "max_attempts",
            "max_elapsed_ms",
            "base_delay_ms",
            "max_delay_ms",
            "orchestrator",
            "deployment",
            "deployments",
            "utility_model",
            "temperature",
            "system_prompt",
            "must_include_tools",
            "data_source",
            "max_rounds",
            "max_consecutive_tool_errors",
            "parallel_tool_calls",
            "max_calls_per_turn",
            "max_tool_result_tokens",
            "on_truncated_tool_call",
            "input",
            "cached_input",
            "output",
            "prefetch",
            "top_k",
            "in_scope_only",
            "data_source",
        ] {
            assert!(
                EXAMPLE.contains(&format!("\n{key} =")) || EXAMPLE.contains(&format!("# {key} =")),
                "{key} is not shown in the example file"
            );
        }
    }

    #[test]
    fn rag_policy_and_link_templates_load_and_are_checked() {
        let config = parse(EXAMPLE).expect("loads");
        let default = &config.profiles["default"];
        assert_eq!(default.rag, RagPolicy::default());
        assert!(default.rag.prefetch && default.rag.top_k == 5 && !default.rag.in_scope_only);
        assert_eq!(
            config.links["data_source"],
            "https://wiki.example.com/handbook/{source}"
        );
        let with = |extra: &str| format!("{MINIMAL}\n{extra}");
        let ok = parse(&with(
            "[profiles.default.rag]\nprefetch = false\ntop_k = 20\nin_scope_only = true",
        ))
        .unwrap();
        assert!(!ok.profiles["default"].rag.prefetch);
        for (extra, key, says) in [
            (
                "[profiles.default.rag]\ntop_k = 0",
                "profiles.default.rag.top_k",
                "between 1 and 20",
            ),
            (
                "[profiles.default.rag]\ntop_k = 21",
                "profiles.default.rag.top_k",
                "between 1 and 20",
            ),
            (
                "[links]\ndocument = \"https://x/{source}\"",
                "links.document",
                "uploaded documents have no link",
            ),
            (
                "[links]\nweb = \"ftp://x/{source}\"",
                "links.web",
                "not an http(s) URL template",
            ),
            (
                "[links]\nweb = \"https://x/fixed\"",
                "links.web",
                "not an http(s) URL template",
            ),
        ] {
            let e = parse_err(&with(extra));
            assert_eq!(e.key.as_deref(), Some(key), "{extra}: {e}");
            assert!(e.to_string().contains(says), "{extra}: {e}");
        }
        let e = parse_err(&with("[profiles.default.rag]\nprefech = true"));
        assert!(e.to_string().contains("prefech"), "{e}");
    }

    #[test]
    fn every_snippet_in_the_providers_doc_loads() {
        let mut snippets = 0;
        let mut rest = PROVIDERS_DOC;
        while let Some(start) = rest.find("```toml\n") {
            let body = &rest[start + "```toml\n".len()..];
            let end = body.find("```").expect("a closed code block");
            let snippet = &body[..end];
            let config = parse(snippet).unwrap_or_else(|e| panic!("{e}\n{snippet}"));
            // Every snippet's profile resolves once its key is present.
            let vars: HashMap<String, String> = config
                .deployments
                .values()
                .filter_map(|d| d.api_key_env.clone())
                .map(|v| (v, "test-key".to_owned()))
                .collect();
            config
                .resolve(None, &vars)
                .unwrap_or_else(|e| panic!("{e}\n{snippet}"));
            snippets += 1;
            rest = &body[end + 3..];
        }
        assert!(snippets >= 5, "only {snippets} snippets");
    }

    #[test]
    fn minimal_file_gets_documented_defaults() {
        let config = parse(MINIMAL).expect("loads");
        assert_eq!(config.default_profile, "default");
        let d = &config.deployments["local"];
        assert_eq!(d.api, ApiShape::ChatCompletions);
        assert!(!d.reasoning, "never assumed");
        assert_eq!(d.auth, Auth::Bearer);
        assert!(d.stream);
        assert_eq!(d.api_key_env, None);
        assert_eq!(d.connect_timeout, crate::DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(d.first_token_timeout, crate::DEFAULT_FIRST_TOKEN_TIMEOUT);
        assert_eq!(d.idle_timeout, crate::DEFAULT_IDLE_TIMEOUT);
        assert_eq!(d.retry, RetryPolicy::default());
        let p = &config.profiles["default"];
        assert_eq!(p.orchestrator, "agentic");
        assert_eq!(p.deployments, ["local"]);
        assert_eq!(p.policy, LoopPolicy::default());
        assert_eq!(p.policy.max_rounds, 8);
        assert_eq!(p.policy.max_tool_result_tokens, Some(4000));
        assert_eq!(p.policy.on_truncated_tool_call, TruncatedPolicy::Error);
    }

    #[test]
    fn azure_header_auth_and_query_parse() {
        let config = parse(
            r#"
            [deployments.azure]
            base_url = "https://res.openai.azure.com/openai/deployments/gpt4o"
            model = "gpt-4o"
            api_key_env = "AZURE_OPENAI_API_KEY"
            auth = { header = "api-key" }
            query = { "api-version" = "2024-10-21" }
            [profiles.default]
            deployment = "azure"
            [profiles.default.policy]
            max_tool_result_tokens = "off"
            on_truncated_tool_call = "ask_again"
            "#,
        )
        .expect("loads");
        let d = &config.deployments["azure"];
        assert_eq!(d.auth, Auth::Header("api-key".into()));
        assert_eq!(d.query["api-version"], "2024-10-21");
        let policy = config.profiles["default"].policy;
        assert_eq!(policy.max_tool_result_tokens, None);
        assert_eq!(policy.on_truncated_tool_call, TruncatedPolicy::AskAgain);
        assert_eq!(policy.context_budget_tokens, None, "off by default");
    }

    #[test]
    fn unknown_keys_are_refused_with_path_and_line() {
        let e = parse_err(
            "[deployments.local]\nbase_url = \"http://h/v1\"\nmodel = \"m\"\n\
             [profiles.default]\ndeployment = \"local\"\n[profiles.default.policy]\nmax_round = 3\n",
        );
        assert_eq!(e.kind(), ConfigErrorKind::Parse);
        let shown = e.to_string();
        assert!(shown.starts_with("test.toml:7:"), "{shown}");
        assert!(shown.contains("profiles.default.policy"), "{shown}");
        assert!(shown.contains("max_round"), "{shown}");
    }

    #[test]
    fn wrong_types_name_the_key() {
        let e = parse_err(&MINIMAL.replace(
            "model = \"llama3.1:8b\"",
            "model = \"m\"\nconnect_timeout_ms = \"soon\"",
        ));
        assert_eq!(e.kind(), ConfigErrorKind::Parse);
        assert_eq!(
            e.key.as_deref(),
            Some("deployments.local.connect_timeout_ms")
        );
        assert!(e.position.is_some());
    }

    #[test]
    fn syntax_errors_give_a_position_without_quoting_the_line() {
        let e = parse_err("[deployments.x]\napi_key_env = \"sk-secret-value\n");
        assert_eq!(e.kind(), ConfigErrorKind::Parse);
        assert!(e.position.is_some_and(|(line, _)| line == 2), "{e}");
        assert!(!e.to_string().contains("sk-secret"), "{e}");
    }

    #[test]
    fn an_inline_key_is_refused_without_echoing_it() {
        let e = parse_err(&MINIMAL.replace(
            "model = \"llama3.1:8b\"",
            "model = \"m\"\napi_key = \"sk-live-123456\"",
        ));
        assert_eq!(e.key.as_deref(), Some("deployments.local"));
        assert!(e.message.contains("api_key_env"), "{e}");
        assert!(!e.to_string().contains("sk-live"), "{e}");

        let e = parse_err(&MINIMAL.replace(
            "model = \"llama3.1:8b\"",
            "model = \"m\"\napi_key_env = \"sk-live-123456\"",
        ));
        assert_eq!(e.kind(), ConfigErrorKind::Invalid);
        assert_eq!(e.key.as_deref(), Some("deployments.local.api_key_env"));
        assert!(!e.to_string().contains("sk-live"), "{e}");

        let e = parse_err(&MINIMAL.replace(
            "model = \"llama3.1:8b\"",
            "model = \"m\"\nquery = { \"api-key\" = \"abc\" }",
        ));
        assert_eq!(e.key.as_deref(), Some("deployments.local.query.api-key"));
        assert!(!e.to_string().contains("abc"), "{e}");

        let e = parse_err(&MINIMAL.replace(
            "http://127.0.0.1:11434/v1",
            "https://user:hunter2@example.com/v1",
        ));
        assert_eq!(e.key.as_deref(), Some("deployments.local.base_url"));
        assert!(!e.to_string().contains("hunter2"), "{e}");
    }

    /// Data-driven: each edit of `MINIMAL` is refused at the given key.
    #[test]
    fn semantic_errors_name_the_key() {
        let cases: &[(&str, &str, &str, &str)] = &[
            // (replace, with, expected key, expected words in the message)
            (
                "[deployments.local]",
                "default_profile = \"main\"\n[deployments.local]",
                "default_profile",
                "no profile named \"main\"",
            ),
            (
                "deployment = \"local\"",
                "deployment = \"nowhere\"",
                "profiles.default.deployment",
                "no deployment named \"nowhere\" (deployments: local)",
            ),
            (
                "deployment = \"local\"",
                "deployments = [\"local\", \"nowhere\"]",
                "profiles.default.deployments[1]",
                "no deployment named \"nowhere\"",
            ),
            (
                "http://127.0.0.1:11434/v1",
                "ftp://127.0.0.1/v1",
                "deployments.local.base_url",
                "http or https",
            ),
            (
                "deployment = \"local\"",
                "deployment = \"local\"\npolicy = { max_rounds = 0 }",
                "profiles.default.policy.max_rounds",
                "between 1 and 100, not 0",
            ),
            (
                "deployment = \"local\"",
                "deployment = \"local\"\npolicy = { max_consecutive_tool_errors = 0 }",
                "profiles.default.policy.max_consecutive_tool_errors",
                "between 1",
            ),
            (
                "deployment = \"local\"",
                "deployment = \"local\"\npolicy = { max_calls_per_turn = 0 }",
                "profiles.default.policy.max_calls_per_turn",
                "between 1",
            ),
            (
                "deployment = \"local\"",
                "deployment = \"local\"\npolicy = { max_tool_result_tokens = 10 }",
                "profiles.default.policy.max_tool_result_tokens",
                "between 64",
            ),
            (
                "deployment = \"local\"",
                "deployment = \"local\"\npolicy = { context_budget_tokens = 500 }",
                "profiles.default.policy.context_budget_tokens",
                "between 1000",
            ),
            (
                "deployment = \"local\"",
                "deployment = \"local\"\ntemperature = 3.5",
                "profiles.default.temperature",
                "between 0.0 and 2.0",
            ),
            (
                "model = \"llama3.1:8b\"",
                "model = \"m\"\nidle_timeout_ms = 0",
                "deployments.local.idle_timeout_ms",
                "more than 0",
            ),
            (
                "model = \"llama3.1:8b\"",
                "model = \"m\"\nretry = { max_attempts = 0 }",
                "deployments.local.retry.max_attempts",
                "between 1 and 10",
            ),
            (
                "model = \"llama3.1:8b\"",
                "model = \"m\"\nretry = { base_delay_ms = 9000, max_delay_ms = 100 }",
                "deployments.local.retry.base_delay_ms",
                "more than max_delay_ms",
            ),
            (
                "model = \"llama3.1:8b\"",
                "model = \"m\"\nauth = { header = \"bad header\" }",
                "deployments.local.auth.header",
                "not a valid HTTP header name",
            ),
            (
                "[profiles.default]",
                "[prices.\"m\"]\ninput = -1\noutput = 1\n[profiles.default]",
                "prices.m.input",
                "0 or more",
            ),
        ];
        for (from, to, key, words) in cases {
            assert!(MINIMAL.contains(from), "bad case {from}");
            let e = parse_err(&MINIMAL.replacen(from, to, 1));
            assert_eq!(e.kind(), ConfigErrorKind::Invalid, "{e}");
            assert_eq!(e.key.as_deref(), Some(*key), "{e}");
            assert!(e.message.contains(words), "{e}");
            assert!(
                e.to_string().starts_with(&format!("test.toml: {key}: ")),
                "{e}"
            );
        }
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
    fn load_names_the_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("fleet.toml");
        let e = FleetConfig::load(&path).expect_err("missing file");
        assert_eq!(e.kind(), ConfigErrorKind::Read);
        assert!(e.to_string().contains("fleet.toml"), "{e}");

        std::fs::write(&path, MINIMAL.replace("local\"\n", "nowhere\"\n")).expect("write");
        let e = FleetConfig::load(&path).expect_err("dangling deployment");
        assert!(
            e.to_string().starts_with(&path.display().to_string()),
            "{e}"
        );

        std::fs::write(&path, MINIMAL).expect("write");
        assert!(FleetConfig::load(&path).is_ok());
    }

    #[test]
    fn resolves_the_first_deployment_with_a_key() {
        let config = parse(TWO).expect("loads");
        let both = env(&[("PRIMARY_KEY", "k1"), ("BACKUP_KEY", "k2")]);
        let r = config.resolve(Some("main"), &both).expect("resolves");
        assert_eq!(r.name, "main");
        assert!(!r.fell_back);
        assert_eq!(r.deployment_name, "primary");
        assert_eq!(r.api_key.as_deref(), Some("k1"));
        assert!(r.skipped.is_empty());
        assert_eq!(r.orchestrator, "agentic");

        let backup_only = env(&[("PRIMARY_KEY", "  \n"), ("BACKUP_KEY", "k2\n")]);
        let r = config
            .resolve(Some("main"), &backup_only)
            .expect("resolves");
        assert_eq!(r.deployment_name, "backup");
        assert_eq!(r.api_key.as_deref(), Some("k2"), "trimmed");
        assert_eq!(
            r.skipped,
            [(
                "primary".to_owned(),
                "environment variable PRIMARY_KEY is empty".to_owned()
            )]
        );
    }

    #[test]
    fn unknown_or_missing_profile_falls_back_to_the_default() {
        let config = parse(TWO).expect("loads");
        let both = env(&[("PRIMARY_KEY", "k1"), ("BACKUP_KEY", "k2")]);
        for (asked, fell_back) in [(None, false), (Some(""), false), (Some("nope"), true)] {
            let r = config.resolve(asked, &both).expect("resolves");
            assert_eq!(r.name, "main", "{asked:?}");
            assert_eq!(r.fell_back, fell_back, "{asked:?}");
        }
        let r = config.resolve(Some("nope"), &both).expect("resolves");
        assert_eq!(r.requested.as_deref(), Some("nope"));
    }

    #[test]
    fn unknown_orchestrator_falls_back_to_agentic() {
        let config = parse(TWO).expect("loads");
        let r = config
            .resolve(Some("other"), &env(&[("BACKUP_KEY", "k2")]))
            .expect("resolves");
        assert_eq!(r.name, "other");
        assert_eq!(r.orchestrator, "agentic");
        assert!(r.orchestrator_fell_back);
        assert!(config.warnings().iter().any(|w| w.contains("\"swarm\"")));
    }

    #[test]
    fn no_resolvable_deployment_names_the_profile_and_why() {
        let config = parse(TWO).expect("loads");
        let e = config
            .resolve(Some("main"), &env(&[("BACKUP_KEY", "")]))
            .expect_err("nothing resolvable");
        assert_eq!(e.code(), "no_deployment");
        assert_eq!(
            e,
            ResolveError::NoDeployment {
                profile: "main".into(),
                tried: vec![
                    (
                        "primary".into(),
                        "environment variable PRIMARY_KEY is not set".into()
                    ),
                    (
                        "backup".into(),
                        "environment variable BACKUP_KEY is empty".into()
                    ),
                ],
            }
        );
        assert_eq!(
            e.to_string(),
            "profile \"main\" has no usable deployment: primary (environment variable \
             PRIMARY_KEY is not set); backup (environment variable BACKUP_KEY is empty)"
        );
    }

    #[test]
    fn a_deployment_without_key_variable_needs_no_key() {
        let config = parse(MINIMAL).expect("loads");
        let r = config.resolve(None, &HashMap::new()).expect("resolves");
        assert_eq!(r.api_key, None);
        assert_eq!(r.utility_model(), "llama3.1:8b");
        let llm = r.llm_config();
        assert_eq!(llm.api_key, None);
        assert_eq!(llm.base_url.as_str(), "http://127.0.0.1:11434/v1");
    }

    #[test]
    fn keys_never_show_in_debug_output() {
        let config = parse(TWO).expect("loads");
        let r = config
            .resolve(None, &env(&[("PRIMARY_KEY", "sk-very-secret")]))
            .expect("resolves");
        assert!(!format!("{r:?}").contains("sk-very-secret"));
        let d = Deployment::new(
            Url::parse("https://api.openai.com/v1").expect("url"),
            "gpt-4o",
        )
        .with_api_key("sk-very-secret");
        assert!(!format!("{d:?}").contains("sk-very-secret"));
        assert!(!format!("{:?}", FleetConfig::single(d)).contains("sk-very-secret"));
    }

    #[test]
    fn single_builds_a_default_profile_from_flags() {
        use clap::Parser;

        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            llm: crate::args::LlmArgs,
        }
        let cli = Cli::parse_from([
            "test",
            "--llm-base-url",
            "http://127.0.0.1:8080/v1",
            "--llm-model",
            "scripted",
            "--llm-api-key",
            "flag-key",
            "--llm-idle-timeout-ms",
            "1234",
        ]);
        let config = FleetConfig::single(Deployment::from_llm_args(&cli.llm));
        let r = config
            .resolve(Some("anything"), &HashMap::new())
            .expect("resolves");
        assert_eq!(r.name, "default");
        assert!(r.fell_back);
        assert_eq!(r.model(), "scripted");
        assert_eq!(r.api_key.as_deref(), Some("flag-key"));
        let llm = r.llm_config();
        assert_eq!(llm.idle_timeout, Duration::from_millis(1234));
        assert_eq!(llm.api_key.as_deref(), Some("flag-key"));
    }

    #[test]
    fn to_llm_config_reads_the_key_from_env() {
        let config = parse(TWO).expect("loads");
        let d = &config.deployments["primary"];
        let llm = d
            .to_llm_config(&env(&[("PRIMARY_KEY", "k1")]))
            .expect("llm config");
        assert_eq!(llm.api_key.as_deref(), Some("k1"));
        let e = d.to_llm_config(&HashMap::new()).expect_err("no key");
        assert!(e.to_string().contains("PRIMARY_KEY is not set"), "{e}");
    }

    #[test]
    fn every_deployment_setting_reaches_the_client_config() {
        let config = parse(EXAMPLE).expect("loads");
        let vars = env(&[("AZURE_OPENAI_API_KEY", "az-key")]);
        let llm = config.deployments["azure"]
            .to_llm_config(&vars)
            .expect("llm config");
        assert_eq!(
            llm.base_url.as_str(),
            "https://my-resource.openai.azure.com/openai/deployments/gpt-4o-mini"
        );
        assert_eq!(llm.api_key.as_deref(), Some("az-key"));
        assert_eq!(llm.api, ApiShape::ChatCompletions);
        assert_eq!(llm.auth, Auth::Header("api-key".into()));
        assert_eq!(
            llm.extra_query,
            [("api-version".to_owned(), "2024-10-21".to_owned())]
        );

        let vars = env(&[("OPENAI_API_KEY", "oa-key")]);
        let llm = config.deployments["openai"]
            .to_llm_config(&vars)
            .expect("llm config");
        assert_eq!(llm.auth, Auth::Bearer);
        assert!(llm.stream);
        assert!(llm.extra_query.is_empty());
        assert_eq!(llm.connect_timeout, Duration::from_millis(5000));
        assert_eq!(llm.first_token_timeout, Duration::from_millis(60000));
        assert_eq!(llm.idle_timeout, Duration::from_millis(30000));
        assert_eq!(
            llm.retry,
            RetryPolicy {
                max_attempts: 3,
                max_elapsed: Duration::from_millis(30000),
                base_delay: Duration::from_millis(250),
                max_delay: Duration::from_millis(5000),
            }
        );
        assert!(!llm.reasoning);
        let llm = config.deployments["openai-responses"]
            .to_llm_config(&vars)
            .expect("llm config");
        assert_eq!(llm.api, ApiShape::Responses);
        assert!(!llm.reasoning, "gpt-4o is not a reasoning model");
        let llm = config.deployments["openai-reasoning"]
            .to_llm_config(&vars)
            .expect("llm config");
        assert_eq!(llm.api, ApiShape::Responses);
        assert!(llm.reasoning);
        let resolved = config
            .resolve(Some("deep"), &vars)
            .expect("the reasoning profile resolves");
        assert!(resolved.llm_config().reasoning);

        let config =
            parse(&MINIMAL.replace("model = \"llama3.1:8b\"", "model = \"m\"\nstream = false"))
                .expect("loads");
        let llm = config.deployments["local"]
            .to_llm_config(&HashMap::new())
            .expect("llm config");
        assert!(!llm.stream);
        assert_eq!(llm.api_key, None);
        assert_eq!(llm.http, crate::HttpVersion::Http1);
        let config =
            parse(&MINIMAL.replace("model = \"llama3.1:8b\"", "model = \"m\"\nhttp = \"http2\""))
                .expect("loads");
        let llm = config.deployments["local"]
            .to_llm_config(&HashMap::new())
            .expect("llm config");
        assert_eq!(llm.http, crate::HttpVersion::Http2);
        assert!(
            parse(&MINIMAL.replace("model = \"llama3.1:8b\"", "model = \"m\"\nhttp = \"3\""))
                .is_err()
        );
    }

    #[test]
    fn cost_bills_cached_tokens_once_and_reasoning_not_again() {
        let config = parse(EXAMPLE).expect("loads");
        let usage = Usage {
            prompt_tokens: 1_000_000,
            completion_tokens: 500_000,
            total_tokens: 1_500_000,
            cached_tokens: 400_000,
            reasoning_tokens: 200_000,
        };
        // gpt-4o-mini in the example: 0.15 input, 0.075 cached, 0.60 output.
        let cost = config.prices.cost("gpt-4o-mini", &usage).expect("priced");
        let expected = 0.6 * 0.15 + 0.4 * 0.075 + 0.5 * 0.60;
        assert!((cost - expected).abs() < 1e-9, "{cost} != {expected}");
    }

    #[test]
    fn cost_of_unknown_model_is_none_and_snapshots_use_their_base_price() {
        let mut prices = PriceTable::new();
        let price = Price {
            input: 2.0,
            cached_input: None,
            output: 8.0,
        };
        prices.insert("gpt-4o", price);
        let usage = Usage {
            prompt_tokens: 1000,
            completion_tokens: 100,
            total_tokens: 1100,
            cached_tokens: 1000,
            reasoning_tokens: 0,
        };
        // No cached price: cached tokens cost the input price.
        let cost = prices.cost("gpt-4o", &usage).expect("priced");
        assert!((cost - (1000.0 * 2.0 + 100.0 * 8.0) / 1e6).abs() < 1e-12);
        assert_eq!(prices.cost("gpt-4o-2024-08-06", &usage), Some(cost));
        assert_eq!(prices.cost("gpt-4o-audio-preview", &usage), None);
        assert_eq!(prices.cost("llama3.1:8b", &usage), None);
        assert_eq!(prices.cost("-2024-08-06", &usage), None);
        // More cached than prompt tokens (a provider bug) is not billed twice.
        let odd = Usage {
            cached_tokens: 5000,
            ..usage
        };
        assert_eq!(prices.cost("gpt-4o", &odd), Some(cost));
    }
}
