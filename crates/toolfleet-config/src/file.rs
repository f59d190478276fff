//! The whole configuration file ([`FleetConfig`]): read, parsed and checked
//! once at start, so a loaded config is consistent.
//!
//! `config/toolfleet.example.toml` is a complete, commented example (a test
//! loads it). Its top-level keys and tables:
//!
//! | key | type, default | meaning |
//! |---|---|---|
//! | `default_profile` | string, `"default"` | profile used when a job names none and its tenant has no `default_profile` of its own; must exist. A job naming a profile that does not exist is refused (`unknown_profile`), never run on this one |
//! | `max_agent_depth` | 0..=5, `1` | how deep agent tools nest: a job at this depth is offered no agent tool |
//! | `[deployments.<name>]` | table | one model endpoint: [`toolfleet_llm::deployments`] |
//! | `[profiles.<name>]` | table | what a chat job names: [`crate::profile`], with its [`crate::policy`] tables |
//! | `[sinks.<name>]` | table | a webhook and/or relay the events of invocations also go to: [`crate::sinks`] |
//! | `[tenants.<name>]` | table | one tenant's default profile and whether its users are trusted: [`crate::tenants`] |
//! | `[tenant_defaults]` | table, the keys of `[tenants.<name>]` | values for every tenant whose own table does not set them: [`crate::tenants`], [`crate::poison`], [`crate::caps`], [`crate::limits`], [`crate::cancels`], [`crate::fair`] |
//! | `[data_sources.<id>]` | table | a data source and the tenants that may use it: [`crate::tenants`] |
//! | `[pools.<name>]` | table | a worker pool declared to the orchestrator, so its tools are offered while none of its workers is live (scale from zero): [`crate::pools`] |
//! | `[links]` | table of strings, `{}` | link templates by reference type (`data_source`, `knowledge`, …): an `http(s)` URL with `{source}` and/or `{title}`; never for `document` |
//! | `[prices."<model>"]` | table | USD per million tokens: [`toolfleet_llm::prices`] |
//!
//! Unknown keys anywhere are errors, so a typo never silently falls back to a
//! default. Errors name the file, the dotted key path (e.g.
//! `profiles.default.policy.max_rounds`) and, for errors of shape (unknown
//! key, wrong type, bad syntax), the line and column.
//!
//! A binary started without a config file gets one profile, `default`,
//! built from its `--llm-*` flags ([`FleetConfig::single`], through
//! [`ConfigArgs::fleet_config`]).
//!
//! # Invariants
//!
//! - **A loaded [`FleetConfig`] is consistent**: the default profile exists,
//!   every profile names existing deployments and sinks, agent names are
//!   unique, every value is in range, each tenant's default profile exists
//!   and allows that tenant, and a profile's sink and declared data source
//!   allow every tenant the profile allows. What can still fail at resolution is
//!   the environment: a missing key.
//! - **No secret is read from, or written to, the file or a message**: keys
//!   and signing secrets are named by environment variable only; TOML error
//!   messages are rebuilt without the source line.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Deserialize;
use toolfleet_llm::args::LlmArgs;
use toolfleet_llm::config_file::{self, ConfigError, check_name, key_segment, names};
use toolfleet_llm::deployments::{self, Deployment};
use toolfleet_llm::model_config::{DEFAULT_PROFILE, ModelConfig};
use toolfleet_llm::prices::PriceTable;

use crate::agents::{DEFAULT_MAX_AGENT_DEPTH, MAX_AGENT_DEPTH_LIMIT};
use crate::pools::PoolConfig;
use crate::profile::{DEFAULT_ORCHESTRATOR, ORCHESTRATORS, Profile};
use crate::sinks::SinkConfig;
use crate::tenants::{DataSourceConfig, TenantConfig};

/// The whole configuration: deployments, profiles, prices, sinks, links.
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
    /// What the operator says about each tenant (`[tenants.<name>]`); a
    /// tenant not listed has the defaults.
    pub tenants: BTreeMap<String, TenantConfig>,
    /// Declared data sources and who may use them (`[data_sources.<id>]`);
    /// an undeclared id is usable by every tenant.
    pub data_sources: BTreeMap<String, DataSourceConfig>,
    /// A tenant's keys for every tenant whose table lacks them
    /// (`[tenant_defaults]`).
    pub tenant_defaults: TenantConfig,
    /// Worker pools the orchestrator knows of before any of their workers
    /// is live (`[pools.<name>]`).
    pub pools: BTreeMap<String, PoolConfig>,
}

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
    #[serde(default)]
    tenants: BTreeMap<String, TenantConfig>,
    #[serde(default)]
    data_sources: BTreeMap<String, DataSourceConfig>,
    #[serde(default)]
    tenant_defaults: TenantConfig,
    #[serde(default)]
    pools: BTreeMap<String, PoolConfig>,
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
        let (text, origin) = config_file::read(path.as_ref())?;
        Self::from_toml(&text, &origin)
    }

    /// Parses and validates config text; `origin` (a file name) goes into
    /// error messages.
    ///
    /// # Errors
    ///
    /// As [`FleetConfig::load`], without `Read`.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self, ConfigError> {
        let file: FileConfig = config_file::parse(text, origin)?;
        let config = Self {
            default_profile: file.default_profile,
            deployments: file.deployments,
            profiles: file.profiles,
            prices: file.prices,
            max_agent_depth: file.max_agent_depth,
            links: file.links,
            sinks: file.sinks,
            tenants: file.tenants,
            data_sources: file.data_sources,
            tenant_defaults: file.tenant_defaults,
            pools: file.pools,
        };
        config
            .validate()
            .map_err(|problem| ConfigError::invalid(origin, problem))?;
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
            tenants: BTreeMap::new(),
            data_sources: BTreeMap::new(),
            tenant_defaults: TenantConfig::default(),
            pools: BTreeMap::new(),
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

    /// The declared pools (`[pools.<name>] declared = true`), by name:
    /// their tools are offered while none of their workers is live.
    pub fn declared_pools(&self) -> impl Iterator<Item = (&String, &PoolConfig)> {
        self.pools.iter().filter(|(_, p)| p.declared)
    }

    /// The model part of this configuration, as a process that only calls
    /// models (the LLM tools family) reads it.
    pub fn models(&self) -> ModelConfig {
        ModelConfig {
            deployments: self.deployments.clone(),
            prices: self.prices.clone(),
            default_name: self
                .profiles
                .get(&self.default_profile)
                .and_then(|p| p.deployments.first().cloned()),
        }
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

    /// Cross-references and ranges, table by table; the error is `(key
    /// path, message)` of the first problem.
    fn validate(&self) -> Result<(), (String, String)> {
        self.check_default_profile()?;
        self.check_agent_depth()?;
        self.check_links()?;
        self.check_agent_names()?;
        self.check_sinks()?;
        deployments::validate_all(&self.deployments)?;
        self.check_profiles()?;
        self.check_tenants()?;
        crate::tenants::check_defaults(&self.tenant_defaults)?;
        self.check_data_sources()?;
        self.check_poison()?;
        self.check_caps()?;
        self.check_cancel_limits()?;
        self.check_fair_share()?;
        crate::pools::check(&self.pools)?;
        self.prices.validate()
    }

    fn check_default_profile(&self) -> Result<(), (String, String)> {
        if self.profiles.contains_key(&self.default_profile) {
            return Ok(());
        }
        Err((
            "default_profile".to_owned(),
            format!(
                "no profile named {:?} (profiles: {})",
                self.default_profile,
                names(self.profiles.keys())
            ),
        ))
    }

    fn check_agent_depth(&self) -> Result<(), (String, String)> {
        if self.max_agent_depth <= MAX_AGENT_DEPTH_LIMIT {
            return Ok(());
        }
        Err((
            "max_agent_depth".to_owned(),
            format!(
                "must be between 0 and {MAX_AGENT_DEPTH_LIMIT}, not {}",
                self.max_agent_depth
            ),
        ))
    }

    /// Each link template is an http(s) URL with a placeholder; uploaded
    /// documents get none.
    fn check_links(&self) -> Result<(), (String, String)> {
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
        Ok(())
    }

    /// An agent tool's name is the tool's: one profile per name.
    fn check_agent_names(&self) -> Result<(), (String, String)> {
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
        Ok(())
    }

    /// The sinks themselves, then every profile's `sink` names one.
    fn check_sinks(&self) -> Result<(), (String, String)> {
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
        Ok(())
    }

    /// Each profile's own values, then the deployments it names exist.
    fn check_profiles(&self) -> Result<(), (String, String)> {
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
        Ok(())
    }
}

/// The whole configuration from a binary's `--config` / `--llm-*` flags
/// (the flags are the LLM client's; what they build is this crate's).
pub trait ConfigArgs {
    /// The `--config` file, or one profile from the flags.
    ///
    /// # Errors
    ///
    /// As [`FleetConfig::load`].
    fn fleet_config(&self) -> Result<FleetConfig, ConfigError>;
}

impl ConfigArgs for LlmArgs {
    fn fleet_config(&self) -> Result<FleetConfig, ConfigError> {
        match &self.config {
            Some(path) => FleetConfig::load(path),
            None => {
                let config = FleetConfig::single(self.deployment());
                Ok(match &self.data_source {
                    Some(ds) => config.with_data_source(ds),
                    None => config,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;
    use std::time::Duration;

    use toolfleet_llm::{ApiShape, Auth, RetryPolicy};

    use super::*;
    use crate::testing::{EXAMPLE, MINIMAL, PROVIDERS_DOC, TWO, parse, parse_err};
    use crate::{ConfigErrorKind, LoopPolicy, TruncatedPolicy};

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
        assert!(config.tenant_defaults.cancel_rate.is_some());
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
            "confidence",
            "provider",
            "batch_service_tier",
            "prompt_cache_key",
            "max_concurrency",
            "priority",
            "multitask_strategy",
            "tenants",
            "trust_user",
            "poison_limit",
            "poison_window_secs",
            "poison_cooloff_secs",
            "max_queued_jobs",
            "max_job_bytes",
            "max_stored_events",
            "max_parked",
            "max_jobs_in_flight",
            "max_tool_calls_in_flight",
            "requests_per_minute",
            "tokens_per_minute",
            "spend_per_day_usd",
            "spend_per_month_usd",
            "soft_limit_ratio",
            "max_run_tokens",
            "max_run_spend_usd",
            "cancel_rate",
            "cancel_burst",
            "remembered_cancels",
            "weight",
            "declared",
        ] {
            assert!(
                EXAMPLE.contains(&format!("\n{key} =")) || EXAMPLE.contains(&format!("# {key} =")),
                "{key} is not shown in the example file"
            );
        }
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
                .resolve("default", None, &vars)
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
        assert_eq!(d.connect_timeout, toolfleet_llm::DEFAULT_CONNECT_TIMEOUT);
        assert_eq!(
            d.first_token_timeout,
            toolfleet_llm::DEFAULT_FIRST_TOKEN_TIMEOUT
        );
        assert_eq!(d.idle_timeout, toolfleet_llm::DEFAULT_IDLE_TIMEOUT);
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
            (
                "model = \"llama3.1:8b\"",
                "model = \"m\"\nconfidence = 1.5",
                "deployments.local.confidence",
                "between 0.0 and 1.0, not 1.5",
            ),
            (
                "model = \"llama3.1:8b\"",
                "model = \"m\"\nprovider = \"open ai\"",
                "deployments.local.provider",
                "not a provider name",
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
    fn single_builds_a_default_profile_from_flags() {
        use clap::Parser;

        #[derive(Parser)]
        struct Cli {
            #[command(flatten)]
            llm: toolfleet_llm::args::LlmArgs,
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
        let config = FleetConfig::single(cli.llm.deployment());
        let r = config
            .resolve("acme", None, &HashMap::new())
            .expect("resolves");
        assert_eq!(r.name, "default");
        assert_eq!(
            r.provider_confidence(),
            0.0,
            "trusted only when the file says so"
        );
        assert_eq!(r.provider(), "127.0.0.1");
        assert_eq!(r.connection(), "default");
        assert_eq!(r.model(), "scripted");
        let e = config
            .resolve("acme", Some("anything"), &HashMap::new())
            .expect_err("no silent fallback");
        assert_eq!(e.code(), "unknown_profile");
        assert_eq!(r.api_key.as_deref(), Some("flag-key"));
        let llm = r.llm_config();
        assert_eq!(llm.idle_timeout, Duration::from_millis(1234));
        assert_eq!(llm.api_key.as_deref(), Some("flag-key"));
    }

    /// The model-only reader of the LLM client sees the same deployments,
    /// prices and default deployment as the whole file's.
    #[test]
    fn the_models_of_a_file_are_what_the_model_only_reader_reads() {
        for text in [EXAMPLE, MINIMAL, TWO] {
            let config = parse(text).expect("loads");
            let models = ModelConfig::from_toml(text, "test.toml").expect("loads");
            assert_eq!(config.models(), models);
        }
        let models = parse(TWO).expect("loads").models();
        assert_eq!(models.default_name.as_deref(), Some("primary"));
    }
}
