//! Tool definitions, tool ids, provider wire shapes and the registry.
//!
//! A tool is defined once, in a JSON file under `tool_definitions/`
//! (format: `schemas/tool_definition.schema.json`). Everything else is
//! derived from that one definition: the NATS subject token
//! ([`ToolId::subject_token`]), the Chat Completions and Responses tool
//! shapes ([`ToolDefinition::chat_completions_tool`],
//! [`ToolDefinition::responses_tool`]) and the compiled validator of the
//! tool's arguments ([`CompiledTool`]).
//!
//! Invariants:
//!
//! - A definition is accepted only after three gates, in order: the file
//!   matches the embedded definition schema, it deserializes into
//!   [`ToolDefinition`], and it passes semantic checks (its embedded schemas
//!   compile offline, `sensitiveArguments` name real parameters, strict
//!   functions follow the provider's strict-mode rules). Ids and function
//!   names are unique across a directory and a registry.
//! - A [`ToolRegistry`] is built once and never mutated; when the catalog
//!   changes, build a new one and replace it whole. Every argument validator
//!   is compiled when the registry is built, never per call.
//! - This module knows no subject names: it yields the token
//!   `<namespace>.<name>.<major>_<minor>_<patch>`; `protocol` builds subjects.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;
use std::sync::{Arc, LazyLock};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::schema::{SchemaError, Validator, Violation, describe};

/// The JSON Schema of tool definition files, embedded so a binary validates
/// definitions without finding the schema on disk.
pub const TOOL_DEFINITION_SCHEMA: &str =
    include_str!("../../../schemas/tool_definition.schema.json");

/// The timeout of a tool whose definition names none.
pub const DEFAULT_TIMEOUT_MS: u64 = 30_000;

/// The definition schema, compiled on first use. An `Err` here means the
/// embedded file is broken — a build defect that a unit test catches — and is
/// reported as [`ToolDefError::EmbeddedSchema`] rather than a panic.
static DEFINITION_VALIDATOR: LazyLock<Result<Validator, String>> = LazyLock::new(|| {
    let schema: Value = serde_json::from_str(TOOL_DEFINITION_SCHEMA)
        .map_err(|e| format!("embedded tool definition schema is not JSON: {e}"))?;
    Validator::compile(&schema)
        .map_err(|e| format!("embedded tool definition schema does not compile: {e}"))
});

fn definition_validator() -> Result<&'static Validator, ToolDefError> {
    DEFINITION_VALIDATOR
        .as_ref()
        .map_err(|message| ToolDefError::EmbeddedSchema {
            message: message.clone(),
        })
}

// ---------------------------------------------------------------------------
// Tool ids

/// A tool's identity: `namespace:name@major.minor.patch`, e.g.
/// `system:current_datetime@1.0.0`. Namespace and name match
/// `[a-z][a-z0-9_]*`, which keeps them valid NATS subject tokens.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ToolId {
    /// The namespace, e.g. `system`: the family of tools it belongs to.
    pub namespace: String,
    /// The tool's name within its namespace, e.g. `current_datetime`.
    pub name: String,
    /// `(major, minor, patch)`.
    pub version: (u32, u32, u32),
}

impl ToolId {
    /// A tool id from its parts, checked like a parsed one.
    ///
    /// # Errors
    ///
    /// [`ToolIdError`] when the namespace or name is not `[a-z][a-z0-9_]*`.
    pub fn new(
        namespace: impl Into<String>,
        name: impl Into<String>,
        version: (u32, u32, u32),
    ) -> Result<Self, ToolIdError> {
        let id = Self {
            namespace: namespace.into(),
            name: name.into(),
            version,
        };
        let input = id.to_string();
        if let Some(reason) = bad_identifier(&id.namespace) {
            return Err(ToolIdError::new(
                &input,
                ToolIdProblem::BadNamespace {
                    namespace: id.namespace,
                    reason,
                },
            ));
        }
        if let Some(reason) = bad_identifier(&id.name) {
            return Err(ToolIdError::new(
                &input,
                ToolIdProblem::BadName {
                    name: id.name,
                    reason,
                },
            ));
        }
        Ok(id)
    }

    /// `<namespace>.<name>.<major>_<minor>_<patch>`: the tool's part of its
    /// NATS subject (`toolfleet.tool.<token>`). Dots in a version would add
    /// subject levels, hence the underscores.
    #[must_use]
    pub fn subject_token(&self) -> String {
        let (major, minor, patch) = self.version;
        format!("{}.{}.{major}_{minor}_{patch}", self.namespace, self.name)
    }
}

impl fmt::Display for ToolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor, patch) = self.version;
        write!(
            f,
            "{}:{}@{major}.{minor}.{patch}",
            self.namespace, self.name
        )
    }
}

impl FromStr for ToolId {
    type Err = ToolIdError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let fail = |problem| Err(ToolIdError::new(input, problem));
        let Some((namespace, rest)) = input.split_once(':') else {
            return fail(ToolIdProblem::MissingColon);
        };
        let Some((name, version)) = rest.split_once('@') else {
            return fail(ToolIdProblem::MissingAt);
        };
        if let Some(reason) = bad_identifier(namespace) {
            return fail(ToolIdProblem::BadNamespace {
                namespace: namespace.to_owned(),
                reason,
            });
        }
        if let Some(reason) = bad_identifier(name) {
            return fail(ToolIdProblem::BadName {
                name: name.to_owned(),
                reason,
            });
        }
        let version = match parse_version(version) {
            Ok(version) => version,
            Err(reason) => {
                return fail(ToolIdProblem::BadVersion {
                    version: version.to_owned(),
                    reason,
                });
            }
        };
        Ok(Self {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            version,
        })
    }
}

impl Serialize for ToolId {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ToolId {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// How a profile or a chat job names tools: one tool (`ns:name@x.y.z`
/// exactly, or `ns:name` for its highest version), every selectable tool of
/// a namespace (`ns:*`), or every selectable tool (`*`).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ToolRef {
    /// `*`
    All,
    /// `ns:*`
    Namespace(String),
    /// `ns:name`: the highest version served.
    Name {
        /// The namespace.
        namespace: String,
        /// The tool's name within it.
        name: String,
    },
    /// `ns:name@x.y.z`
    Exact(ToolId),
}

impl ToolRef {
    /// Whether the reference names `id` (patterns match any id they cover;
    /// whether a pattern may pick a tool that is not selectable is the
    /// caller's rule).
    #[must_use]
    pub fn matches(&self, id: &ToolId) -> bool {
        match self {
            ToolRef::All => true,
            ToolRef::Namespace(ns) => id.namespace == *ns,
            ToolRef::Name { namespace, name } => id.namespace == *namespace && id.name == *name,
            ToolRef::Exact(exact) => exact == id,
        }
    }

    /// Whether the reference is a pattern (`*`, `ns:*`) rather than one tool.
    #[must_use]
    pub fn is_pattern(&self) -> bool {
        matches!(self, ToolRef::All | ToolRef::Namespace(_))
    }
}

impl fmt::Display for ToolRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ToolRef::All => f.write_str("*"),
            ToolRef::Namespace(ns) => write!(f, "{ns}:*"),
            ToolRef::Name { namespace, name } => write!(f, "{namespace}:{name}"),
            ToolRef::Exact(id) => id.fmt(f),
        }
    }
}

impl FromStr for ToolRef {
    type Err = ToolIdError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        if input == "*" {
            return Ok(ToolRef::All);
        }
        if input.contains('@') {
            return input.parse().map(ToolRef::Exact);
        }
        let Some((namespace, name)) = input.split_once(':') else {
            return Err(ToolIdError::new(input, ToolIdProblem::MissingColon));
        };
        if let Some(reason) = bad_identifier(namespace) {
            return Err(ToolIdError::new(
                input,
                ToolIdProblem::BadNamespace {
                    namespace: namespace.to_owned(),
                    reason,
                },
            ));
        }
        if name == "*" {
            return Ok(ToolRef::Namespace(namespace.to_owned()));
        }
        if let Some(reason) = bad_identifier(name) {
            return Err(ToolIdError::new(
                input,
                ToolIdProblem::BadName {
                    name: name.to_owned(),
                    reason,
                },
            ));
        }
        Ok(ToolRef::Name {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
        })
    }
}

impl Serialize for ToolRef {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for ToolRef {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

/// Why `part` is not `[a-z][a-z0-9_]*`, naming the first offending
/// character; `None` when it is fine.
fn bad_identifier(part: &str) -> Option<String> {
    let mut chars = part.char_indices();
    match chars.next() {
        None => return Some("it is empty".to_owned()),
        Some((_, c)) if !c.is_ascii_lowercase() => {
            return Some(format!(
                "it starts with {c:?}; the first character must be a lowercase letter a-z"
            ));
        }
        Some(_) => {}
    }
    chars
        .find(|(_, c)| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '_'))
        .map(|(at, c)| {
            format!("character {c:?} at byte {at} is not allowed; only a-z, 0-9 and _ are")
        })
}

fn parse_version(version: &str) -> Result<(u32, u32, u32), String> {
    let parts: Vec<&str> = version.split('.').collect();
    let [major, minor, patch] = parts.as_slice() else {
        return Err(format!(
            "expected three components major.minor.patch, found {}",
            parts.len()
        ));
    };
    let component = |label: &str, text: &str| -> Result<u32, String> {
        if text.is_empty() {
            return Err(format!("the {label} component is empty"));
        }
        // `u32::from_str` accepts a leading `+`; a version must be digits
        // only, so check first.
        if let Some(c) = text.chars().find(|c| !c.is_ascii_digit()) {
            return Err(format!(
                "the {label} component `{text}` is not a number ({c:?} is not a digit)"
            ));
        }
        // A leading zero would not survive Display, and ids must round-trip.
        if text.len() > 1 && text.starts_with('0') {
            return Err(format!("the {label} component `{text}` has a leading zero"));
        }
        text.parse::<u32>()
            .map_err(|_| format!("the {label} component `{text}` is larger than {}", u32::MAX))
    };
    Ok((
        component("major", major)?,
        component("minor", minor)?,
        component("patch", patch)?,
    ))
}

/// A string that is not a valid [`ToolId`]: what is wrong, and the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid tool id {input:?}: {problem} (expected namespace:name@major.minor.patch, \
     e.g. system:current_datetime@1.0.0)"
)]
pub struct ToolIdError {
    /// The text that failed to parse.
    pub input: String,
    /// What is wrong with it.
    pub problem: ToolIdProblem,
}

impl ToolIdError {
    fn new(input: &str, problem: ToolIdProblem) -> Self {
        Self {
            input: input.to_owned(),
            problem,
        }
    }
}

/// The ways a tool id can be malformed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ToolIdProblem {
    /// No `:` between namespace and name.
    #[error("missing ':' between namespace and name")]
    MissingColon,
    /// No `@` between name and version.
    #[error("missing '@' between name and version")]
    MissingAt,
    /// The namespace is not `[a-z][a-z0-9_]*`.
    #[error("bad namespace {namespace:?}: {reason}")]
    BadNamespace {
        /// The namespace, as given.
        namespace: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The name is not `[a-z][a-z0-9_]*`.
    #[error("bad name {name:?}: {reason}")]
    BadName {
        /// The name, as given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// The version is not `major.minor.patch`.
    #[error("bad version {version:?}: {reason}")]
    BadVersion {
        /// The version, as given.
        version: String,
        /// What is wrong with it.
        reason: String,
    },
}

// ---------------------------------------------------------------------------
// Definitions

/// One tool definition file (see `schemas/tool_definition.schema.json`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ToolDefinition {
    /// The file's optional `$schema` pointer, for editors; not used.
    #[serde(rename = "$schema", default, skip_serializing_if = "Option::is_none")]
    pub json_schema: Option<String>,
    /// Version of the file format (1).
    pub schema_version: u32,
    /// `namespace:name@major.minor.patch`; it also names the tool's NATS
    /// subject.
    pub id: ToolId,
    /// Which implementation a worker runs, e.g. `retrieval.search_documents`.
    pub implementation_key: String,
    /// A short human-readable name.
    pub title: String,
    /// For people and relevance scoring; the model reads
    /// `function.description`.
    pub description: String,
    /// A lower-case word grouping tools, e.g. `utility` or `retrieval`; scoping
    /// and [`crate::registry::Filter`] use it.
    pub category: String,
    /// Absent means [`Purpose::General`]; see [`ToolDefinition::purpose`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub purpose: Option<Purpose>,
    /// `true` (the default): offered when a chat job or its profile picks it.
    /// `false`: a system tool, never picked by users, added by the orchestrator
    /// whenever its purpose applies.
    #[serde(default = "default_true")]
    pub selectable: bool,
    /// Surfaces that show the tool; empty means no restriction.
    #[serde(default)]
    pub visible_in: Vec<String>,
    /// Keywords for search and relevance scoring.
    #[serde(default)]
    pub tags: Vec<String>,
    /// JSON Schema of per-tenant settings; properties may carry
    /// `"secret": true`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub settings_schema: Option<Value>,
    /// The function the model sees and calls.
    pub function: FunctionSpec,
    /// JSON Schema of the tool's structured result.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_schema: Option<Value>,
    /// Argument names that are never logged or echoed.
    #[serde(default)]
    pub sensitive_arguments: Vec<String>,
    /// In `0..=1`: below it the tool refuses to run (`blocked`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_provider_confidence: Option<f64>,
    /// How long one call may run, in ms ([`DEFAULT_TIMEOUT_MS`] when the file
    /// names none).
    #[serde(default = "default_timeout_ms")]
    pub timeout_ms: u64,
    /// How jobs reach the tool's workers.
    #[serde(default)]
    pub delivery: Delivery,
    /// Whether calls of the tool may run in parallel with other calls of the
    /// same model turn (default `true`).
    #[serde(default = "default_true")]
    pub parallel_safe: bool,
    /// Running a call again has no further effect (as MCP's
    /// `idempotentHint`): a worker keeps no result ledger for the tool, and
    /// a job delivered again (its ack was lost) simply runs again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub idempotent: bool,
    /// Results kept and reused by the orchestrator's tool-result cache
    /// (`docs/tool-cache.md`): only for an [`idempotent`](Self::idempotent)
    /// tool, checked at load.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cache: Option<ToolCache>,
    /// A person must approve each call before it runs: the orchestrator
    /// parks the invocation (`approval_requested`) until an approval, a
    /// denial or the profile's approval timeout.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub requires_approval: bool,
    /// The tenants that may use the tool; empty (the default) or `"*"`:
    /// every tenant. No other tenant is offered the tool, and its workers
    /// refuse their calls (see [`ToolDefinition::allows_tenant`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tenants: Vec<String>,
    /// Declarative LLM tools: the models to use, and their settings.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_preference: Option<ModelPreference>,
    /// In `0..=1`: relevance from which scoping recommends the tool.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub recommended_threshold: Option<f64>,
    /// Declarative LLM tools: the system prompt.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// Declarative LLM tools: the user message with `{{argument}}`
    /// placeholders.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_template: Option<String>,
    /// Declarative LLM tools: the format of the answer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_format: Option<OutputFormat>,
    /// Declarative LLM tools with `json` output: an example answer, shown
    /// to the model with the `outputSchema` (it must validate against it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_example: Option<Value>,
    /// Declarative LLM tools: named variants overriding prompt or format.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub variants: BTreeMap<String, ToolVariant>,
}

fn default_true() -> bool {
    true
}

fn default_timeout_ms() -> u64 {
    DEFAULT_TIMEOUT_MS
}

/// A tool's result cache (its definition's `cache`): the orchestrator
/// answers a call from a stored `ok` result of the same tool version, the
/// same arguments (in any key order) and the same scope, while it lasts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ToolCache {
    /// How long a stored result is reused, in ms
    /// ([`MIN_CACHE_TTL_MS`]..=[`MAX_CACHE_TTL_MS`]).
    pub ttl_ms: u64,
    /// Who shares a stored result.
    pub scope: CacheScope,
}

impl ToolCache {
    /// How long a stored result is reused.
    #[must_use]
    pub fn ttl(&self) -> Duration {
        Duration::from_millis(self.ttl_ms)
    }
}

/// The shortest `cache.ttlMs` a definition may name: 1 s.
pub const MIN_CACHE_TTL_MS: u64 = 1_000;
/// The longest `cache.ttlMs` a definition may name: 7 days.
pub const MAX_CACHE_TTL_MS: u64 = 7 * 24 * 3600 * 1000;

/// Who shares a tool's cached results.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheScope {
    /// The calls of one tenant (the one the fleet decided).
    Tenant,
    /// The calls of one authenticated user of one tenant; a call without
    /// one is not cached.
    User,
    /// Every tenant's calls: only for a tool whose answer depends on its
    /// arguments alone (no settings, data source or attached documents).
    Global,
}

impl CacheScope {
    /// The scope's name, as in a definition and a key.
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tenant => "tenant",
            Self::User => "user",
            Self::Global => "global",
        }
    }
}

/// The function the model sees.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct FunctionSpec {
    /// `^[a-zA-Z0-9_-]{1,64}$`, unique across the catalog.
    pub name: String,
    /// What the model reads to decide when and how to call the tool.
    pub description: String,
    /// Whether the provider's strict mode holds the model's arguments to
    /// `parameters` (which must then follow the strict-mode rules).
    #[serde(default)]
    pub strict: bool,
    /// JSON Schema of the arguments object (`"type": "object"`).
    pub parameters: Value,
}

/// What a tool needs from the invocation to be offered at all.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Purpose {
    /// Offered whatever the invocation carries.
    #[default]
    General,
    /// Offered only when documents are attached.
    DocumentProcessing,
    /// Offered only when a data source is selected.
    DataSourceSearch,
    /// Writes content; offered whatever is attached.
    ContentGeneration,
}

/// How tool jobs reach workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Delivery {
    /// A durable JetStream work-queue job.
    #[default]
    Jetstream,
    /// Core NATS request-reply in a queue group.
    Direct,
}

/// The model a declarative LLM tool would rather use.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ModelPreference {
    /// The model to try first, `provider/model` (after the compat file's
    /// recommendations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub preferred_model: Option<String>,
    /// The models to try next, in order, `provider/model` each.
    #[serde(default)]
    pub fallback_models: Vec<String>,
    /// The most tokens the answer may take.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u32>,
    /// Sampling temperature, in `0..=2`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub temperature: Option<f64>,
}

/// The answer format of a declarative LLM tool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutputFormat {
    /// Plain text.
    Text,
    /// Markdown text.
    Markdown,
    /// A JSON value, checked against the definition's `outputSchema`.
    Json,
}

/// A named variant of a declarative LLM tool; absent fields fall back to
/// the definition's.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct ToolVariant {
    /// The models this variant is for: `provider/model`, `provider/*` or
    /// `*` (a provider is a deployment name of the fleet's configuration).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub models: Vec<String>,
    /// The variant used when no variant's `models` match.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub default: bool,
    /// What the variant is for, in words, for people reading the file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    /// The system prompt, in place of the definition's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub system_prompt: Option<String>,
    /// The user message template, in place of the definition's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_template: Option<String>,
    /// The answer format, in place of the definition's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output_format: Option<OutputFormat>,
}

impl ToolDefinition {
    /// Whether `tenant` may use the tool: its [`tenants`](Self::tenants)
    /// is empty, holds `"*"`, or names it.
    pub fn allows_tenant(&self, tenant: &str) -> bool {
        self.tenants.is_empty() || self.tenants.iter().any(|t| t == "*" || t == tenant)
    }

    /// The tool as the model client offers it, in neutral form; the client
    /// renders it in the API shape of its endpoint.
    #[must_use]
    pub fn tool_spec(&self) -> ToolSpec {
        ToolSpec {
            name: self.function.name.clone(),
            description: self.function.description.clone(),
            parameters: self.function.parameters.clone(),
            strict: self.function.strict,
        }
    }

    /// The tool in the Chat Completions shape:
    /// `{"type":"function","function":{name, description, parameters, strict}}`.
    #[must_use]
    pub fn chat_completions_tool(&self) -> Value {
        self.tool_spec().to_chat_completions()
    }

    /// The tool in the Responses API shape (flat):
    /// `{"type":"function", name, description, parameters, strict}`.
    #[must_use]
    pub fn responses_tool(&self) -> Value {
        self.tool_spec().to_responses()
    }

    /// How long one call may run.
    #[must_use]
    pub fn timeout(&self) -> Duration {
        Duration::from_millis(self.timeout_ms)
    }

    /// The purpose, [`Purpose::General`] when the file names none.
    #[must_use]
    pub fn purpose(&self) -> Purpose {
        self.purpose.unwrap_or_default()
    }

    /// Names of the settings marked `"secret": true` in `settingsSchema`,
    /// sorted.
    #[must_use]
    pub fn settings_secret_fields(&self) -> Vec<String> {
        let mut fields: Vec<String> = self
            .settings_schema
            .as_ref()
            .and_then(|schema| schema.get("properties"))
            .and_then(Value::as_object)
            .map(|properties| {
                properties
                    .iter()
                    .filter(|(_, property)| property.get("secret") == Some(&Value::Bool(true)))
                    .map(|(name, _)| name.clone())
                    .collect()
            })
            .unwrap_or_default();
        fields.sort();
        fields
    }

    /// Parse and check a definition held as JSON (the three gates of
    /// [`load_file`], without a file). Errors name the definition's
    /// `origin` — pass what the caller knows of where it came from.
    ///
    /// # Errors
    ///
    /// [`ToolDefError`] of kind `Schema`, `Invalid` or `InvalidSchema`.
    pub fn from_value(value: Value, origin: Origin) -> Result<Self, ToolDefError> {
        let validator = definition_validator()?;
        if let Err(violations) = validator.validate(&value) {
            return Err(ToolDefError::Schema { origin, violations });
        }
        let definition: Self =
            serde_json::from_value(value).map_err(|error| ToolDefError::Invalid {
                origin: origin.clone(),
                pointer: String::new(),
                message: error.to_string(),
            })?;
        compile_checked(&definition, &origin)?;
        Ok(definition)
    }
}

/// A definition with its arguments validator compiled: what a worker needs
/// to validate a call without compiling anything per call.
#[derive(Debug, Clone)]
pub struct CompiledTool {
    /// The checked definition.
    pub definition: ToolDefinition,
    /// Compiled `function.parameters`.
    pub arguments: Validator,
    /// The tool as the model sees it, built once and shared by every
    /// request that offers it (a schema per tool, not per invocation).
    pub spec: std::sync::Arc<ToolSpec>,
}

impl CompiledTool {
    /// Check `definition` through the same gates as a file (definition
    /// schema, semantic checks) and compile its argument schema.
    ///
    /// # Errors
    ///
    /// [`ToolDefError`] of kind `Schema`, `Invalid` or `InvalidSchema`.
    pub fn new(definition: ToolDefinition) -> Result<Self, ToolDefError> {
        let origin = Origin::definition(&definition.id);
        // A definition built in code skipped the file schema; re-check its
        // serialized form so e.g. a function name with spaces or a NaN
        // confidence cannot enter a registry that way.
        let value = serde_json::to_value(&definition).map_err(|error| ToolDefError::Invalid {
            origin: origin.clone(),
            pointer: String::new(),
            message: format!("cannot serialize: {error}"),
        })?;
        if let Err(violations) = definition_validator()?.validate(&value) {
            return Err(ToolDefError::Schema { origin, violations });
        }
        let arguments = compile_checked(&definition, &origin)?;
        let spec = std::sync::Arc::new(definition.tool_spec());
        Ok(Self {
            definition,
            arguments,
            spec,
        })
    }

    /// Validate a call's arguments.
    ///
    /// # Errors
    ///
    /// The violations; [`describe`] turns them into the text for the model.
    pub fn validate_arguments(&self, arguments: &Value) -> Result<(), Vec<Violation>> {
        self.arguments.validate(arguments)
    }
}

/// The semantic checks, run after the definition schema and serde accepted
/// the definition. Returns the compiled arguments validator, so a check
/// never compiles twice.
fn compile_checked(
    definition: &ToolDefinition,
    origin: &Origin,
) -> Result<Validator, ToolDefError> {
    let embedded = |pointer: &str, schema: &Value| {
        Validator::compile(schema).map_err(|source| ToolDefError::InvalidSchema {
            origin: origin.clone(),
            pointer: pointer.to_owned(),
            source,
        })
    };
    let arguments = embedded("/function/parameters", &definition.function.parameters)?;
    if let Some(schema) = &definition.settings_schema {
        embedded("/settingsSchema", schema)?;
    }
    if let Some(schema) = &definition.output_schema {
        let output = embedded("/outputSchema", schema)?;
        if let Some(example) = &definition.output_example
            && let Err(violations) = output.validate(example)
        {
            return Err(ToolDefError::Invalid {
                origin: origin.clone(),
                pointer: "/outputExample".to_owned(),
                message: format!("does not match the outputSchema: {}", describe(&violations)),
            });
        }
    }

    let invalid = |pointer: String, message: String| ToolDefError::Invalid {
        origin: origin.clone(),
        pointer,
        message,
    };
    let properties = definition
        .function
        .parameters
        .get("properties")
        .and_then(Value::as_object);
    for (index, argument) in definition.sensitive_arguments.iter().enumerate() {
        if !properties.is_some_and(|p| p.contains_key(argument)) {
            let known: Vec<&str> = properties
                .map(|p| p.keys().map(String::as_str).collect())
                .unwrap_or_default();
            return Err(invalid(
                format!("/sensitiveArguments/{index}"),
                format!(
                    "sensitive argument {argument:?} is not a property of function.parameters \
                     (properties: {})",
                    if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    }
                ),
            ));
        }
    }
    if definition.function.strict {
        check_strict(&definition.function.parameters, "/function/parameters")
            .map_err(|(pointer, message)| invalid(pointer, message))?;
    }
    if let Some(cache) = &definition.cache {
        check_cache(definition, cache).map_err(|(pointer, message)| invalid(pointer, message))?;
    }
    Ok(arguments)
}

/// A `cache` is for tools whose calls can be answered again without
/// running: idempotent ones (a read, a pure computation), for a bounded
/// time; one shared by every tenant only where nothing but the arguments
/// decides the answer.
fn check_cache(definition: &ToolDefinition, cache: &ToolCache) -> Result<(), (String, String)> {
    if !definition.idempotent {
        return Err((
            "/cache".to_owned(),
            "a tool-result cache needs \"idempotent\": true (only a read or a pure computation \
             may be answered from an earlier call)"
                .to_owned(),
        ));
    }
    if !(MIN_CACHE_TTL_MS..=MAX_CACHE_TTL_MS).contains(&cache.ttl_ms) {
        return Err((
            "/cache/ttlMs".to_owned(),
            format!(
                "{} ms is outside {MIN_CACHE_TTL_MS}..={MAX_CACHE_TTL_MS} (1 s to 7 days)",
                cache.ttl_ms
            ),
        ));
    }
    if cache.scope == CacheScope::Global {
        let per_tenant = if definition.settings_schema.is_some() {
            Some("it has per-tenant settings (settingsSchema)")
        } else if matches!(
            definition.purpose(),
            Purpose::DocumentProcessing | Purpose::DataSourceSearch
        ) {
            Some("its purpose reads the tenant's documents or data source")
        } else {
            None
        };
        if let Some(why) = per_tenant {
            return Err((
                "/cache/scope".to_owned(),
                format!(
                    "scope \"global\" would share one tenant's results with another: {why}; \
                     use \"tenant\""
                ),
            ));
        }
    }
    Ok(())
}

/// The provider's strict mode rejects a schema in which an object allows
/// extra properties or leaves a property optional; catching that at load time
/// beats a 400 from the provider on every request that offers the tool.
fn check_strict(schema: &Value, pointer: &str) -> Result<(), (String, String)> {
    let Some(object) = schema.as_object() else {
        return Ok(());
    };
    if let Some(properties) = object.get("properties").and_then(Value::as_object) {
        if object.get("additionalProperties") != Some(&Value::Bool(false)) {
            return Err((
                pointer.to_owned(),
                "strict function: every object schema needs \"additionalProperties\": false"
                    .to_owned(),
            ));
        }
        let required: Vec<&str> = object
            .get("required")
            .and_then(Value::as_array)
            .map(|names| names.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        for name in properties.keys() {
            if !required.contains(&name.as_str()) {
                return Err((
                    pointer.to_owned(),
                    format!(
                        "strict function: property {name:?} must be listed in \"required\" \
                         (make it nullable instead of optional)"
                    ),
                ));
            }
        }
        for (name, property) in properties {
            check_strict(
                property,
                &format!("{pointer}/properties/{}", escape_pointer(name)),
            )?;
        }
    }
    if let Some(items) = object.get("items") {
        check_strict(items, &format!("{pointer}/items"))?;
    }
    for keyword in ["$defs", "definitions"] {
        if let Some(defs) = object.get(keyword).and_then(Value::as_object) {
            for (name, def) in defs {
                check_strict(
                    def,
                    &format!("{pointer}/{keyword}/{}", escape_pointer(name)),
                )?;
            }
        }
    }
    if let Some(alternatives) = object.get("anyOf").and_then(Value::as_array) {
        for (index, alternative) in alternatives.iter().enumerate() {
            check_strict(alternative, &format!("{pointer}/anyOf/{index}"))?;
        }
    }
    Ok(())
}

/// RFC 6901 escaping of one pointer segment.
fn escape_pointer(segment: &str) -> String {
    segment.replace('~', "~0").replace('/', "~1")
}

// ---------------------------------------------------------------------------
// Loading

/// Load and check one definition file.
///
/// # Errors
///
/// [`ToolDefError`] naming the file (and, where there is one, the JSON path):
/// unreadable file, invalid JSON, schema violations, or a failed semantic
/// check.
pub fn load_file(path: impl AsRef<Path>) -> Result<ToolDefinition, ToolDefError> {
    let path = path.as_ref();
    let origin = Origin::File(path.to_path_buf());
    let text = std::fs::read_to_string(path).map_err(|source| ToolDefError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let value: Value = serde_json::from_str(&text).map_err(|source| ToolDefError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    ToolDefinition::from_value(value, origin)
}

/// Load and check every `*.json` file directly in `dir`, in file-name order.
/// Ids and function names must be unique across the directory.
///
/// # Errors
///
/// The first failing file's [`ToolDefError`], or a duplicate naming both
/// files.
pub fn load_dir(dir: impl AsRef<Path>) -> Result<Vec<ToolDefinition>, ToolDefError> {
    Ok(load_dir_files(dir)?
        .into_iter()
        .map(|(_, definition)| definition)
        .collect())
}

/// [`load_dir`], with the file each definition came from (for messages
/// about a definition that is valid but cannot be served).
///
/// # Errors
///
/// As [`load_dir`].
pub fn load_dir_files(
    dir: impl AsRef<Path>,
) -> Result<Vec<(PathBuf, ToolDefinition)>, ToolDefError> {
    let mut loaded = Vec::new();
    for path in definition_files(dir.as_ref())? {
        let definition = load_file(&path)?;
        loaded.push((Origin::File(path), definition));
    }
    check_unique(
        loaded
            .iter()
            .map(|(origin, definition)| (origin, definition)),
    )?;
    Ok(loaded
        .into_iter()
        .filter_map(|(origin, definition)| match origin {
            Origin::File(path) => Some((path, definition)),
            _ => None,
        })
        .collect())
}

/// A definition file and what loading it gave.
pub type CheckedFile = (PathBuf, Result<ToolDefinition, ToolDefError>);

/// Every definition file of `dir` checked, not just up to the first
/// broken one: each file with its definition or its error (a duplicate id
/// or function name is the error of the file that repeats it), sorted by
/// path. For `toolfleet tools validate`.
///
/// # Errors
///
/// [`ToolDefError::Io`] when the directory cannot be listed.
pub fn validate_dir(dir: impl AsRef<Path>) -> Result<Vec<CheckedFile>, ToolDefError> {
    let mut checked: Vec<CheckedFile> = definition_files(dir.as_ref())?
        .into_iter()
        .map(|path| {
            let loaded = load_file(&path);
            (path, loaded)
        })
        .collect();
    let origins: Vec<Origin> = checked
        .iter()
        .map(|(path, _)| Origin::File(path.clone()))
        .collect();
    let dups = duplicates(
        origins
            .iter()
            .zip(&checked)
            .filter_map(|(origin, (_, loaded))| Some((origin, loaded.as_ref().ok()?))),
    );
    for dup in dups {
        let second = match &dup {
            ToolDefError::DuplicateId { second, .. }
            | ToolDefError::DuplicateFunctionName { second, .. } => second.clone(),
            _ => continue,
        };
        if let Some((_, loaded)) = checked
            .iter_mut()
            .find(|(path, _)| Origin::File(path.clone()) == second)
            && loaded.is_ok()
        {
            *loaded = Err(dup);
        }
    }
    Ok(checked)
}

/// The definition files of `dir` (`*.json`, hidden files skipped), sorted.
fn definition_files(dir: &Path) -> Result<Vec<PathBuf>, ToolDefError> {
    let io = |source| ToolDefError::Io {
        path: dir.to_path_buf(),
        source,
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(io)? {
        let path = entry.map_err(io)?.path();
        // Editors leave hidden swap and backup files beside the real ones.
        let hidden = path
            .file_name()
            .and_then(|name| name.to_str())
            .is_some_and(|name| name.starts_with('.'));
        if !hidden && path.is_file() && path.extension().is_some_and(|ext| ext == "json") {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

fn check_unique<'a>(
    definitions: impl IntoIterator<Item = (&'a Origin, &'a ToolDefinition)>,
) -> Result<(), ToolDefError> {
    match duplicates(definitions).into_iter().next() {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

/// Every repeated id and function name, each naming the first holder and
/// the one that repeats it.
fn duplicates<'a>(
    definitions: impl IntoIterator<Item = (&'a Origin, &'a ToolDefinition)>,
) -> Vec<ToolDefError> {
    let mut ids: HashMap<&ToolId, &Origin> = HashMap::new();
    let mut names: HashMap<&str, &Origin> = HashMap::new();
    let mut found = Vec::new();
    for (origin, definition) in definitions {
        if let Some(first) = ids.get(&definition.id) {
            found.push(ToolDefError::DuplicateId {
                id: Box::new(definition.id.clone()),
                first: (*first).clone(),
                second: origin.clone(),
            });
            continue;
        }
        ids.insert(&definition.id, origin);
        if let Some(first) = names.get(definition.function.name.as_str()) {
            found.push(ToolDefError::DuplicateFunctionName {
                name: definition.function.name.clone(),
                first: (*first).clone(),
                second: origin.clone(),
            });
            continue;
        }
        names.insert(&definition.function.name, origin);
    }
    found
}

/// Where a definition came from, for error messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Origin {
    /// A definition file.
    File(PathBuf),
    /// A definition built or received in memory, named by the caller (see
    /// [`Origin::definition`]).
    Named(String),
}

impl Origin {
    /// A definition held in memory, named by its id.
    #[must_use]
    pub fn definition(id: &ToolId) -> Self {
        // A string rather than a `ToolId` keeps `ToolDefError` small.
        Self::Named(format!("tool definition {id}"))
    }
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::File(path) => write!(f, "{}", path.display()),
            Self::Named(name) => f.write_str(name),
        }
    }
}

/// What kind of [`ToolDefError`] happened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ToolDefErrorKind {
    /// See [`ToolDefError::Io`].
    Io,
    /// See [`ToolDefError::Json`].
    Json,
    /// See [`ToolDefError::Schema`].
    Schema,
    /// See [`ToolDefError::InvalidSchema`].
    InvalidSchema,
    /// See [`ToolDefError::Invalid`].
    Invalid,
    /// See [`ToolDefError::DuplicateId`].
    DuplicateId,
    /// See [`ToolDefError::DuplicateFunctionName`].
    DuplicateFunctionName,
    /// See [`ToolDefError::EmbeddedSchema`].
    EmbeddedSchema,
}

/// A tool definition that cannot be used. Every message names the file (or
/// definition) and, where there is one, the JSON path of the problem.
#[derive(Debug, thiserror::Error)]
pub enum ToolDefError {
    /// The file or directory cannot be read.
    #[error("{}: cannot read: {source}", path.display())]
    Io {
        /// The file or directory.
        path: PathBuf,
        /// Why it cannot be read.
        source: std::io::Error,
    },
    /// The file is not JSON.
    #[error("{}: not valid JSON: {source}", path.display())]
    Json {
        /// The file.
        path: PathBuf,
        /// What the parser says, with line and column.
        source: serde_json::Error,
    },
    /// The file does not match `schemas/tool_definition.schema.json`.
    #[error(
        "{origin}: does not match the tool definition schema:\n{}",
        describe(violations)
    )]
    Schema {
        /// The definition.
        origin: Origin,
        /// Each place the definition breaks the schema.
        violations: Vec<Violation>,
    },
    /// A schema inside the definition (parameters, settings, output) does
    /// not compile.
    #[error(
        "{origin}: at {}: not a usable JSON Schema: {source}",
        inner_pointer(pointer, source)
    )]
    InvalidSchema {
        /// The definition.
        origin: Origin,
        /// Where the embedded schema is, e.g. `/function/parameters`.
        pointer: String,
        /// Why the schema does not compile.
        source: SchemaError,
    },
    /// A semantic check failed.
    #[error("{origin}: at {}: {message}", if pointer.is_empty() { "/" } else { pointer })]
    Invalid {
        /// The definition.
        origin: Origin,
        /// Where in the definition, as a JSON pointer (empty for the whole).
        pointer: String,
        /// What is wrong.
        message: String,
    },
    /// Two definitions share an id.
    #[error("{second}: at /id: tool id {id} is already defined by {first}")]
    DuplicateId {
        /// The shared id.
        // Boxed: unboxed, it would make every `Result<_, ToolDefError>` larger.
        id: Box<ToolId>,
        /// The definition that had it first.
        first: Origin,
        /// The definition that has it again.
        second: Origin,
    },
    /// Two definitions share a function name, so a model's call would be
    /// ambiguous.
    #[error("{second}: at /function/name: function name {name:?} is already used by {first}")]
    DuplicateFunctionName {
        /// The shared function name.
        name: String,
        /// The definition that had it first.
        first: Origin,
        /// The definition that has it again.
        second: Origin,
    },
    /// The embedded definition schema is broken (a build defect).
    #[error("{message}")]
    EmbeddedSchema {
        /// Why it does not compile.
        message: String,
    },
}

fn inner_pointer(pointer: &str, source: &SchemaError) -> String {
    format!("{pointer}{}", source.path().unwrap_or_default())
}

impl ToolDefError {
    /// The kind, for callers that decide by type.
    #[must_use]
    pub fn kind(&self) -> ToolDefErrorKind {
        match self {
            Self::Io { .. } => ToolDefErrorKind::Io,
            Self::Json { .. } => ToolDefErrorKind::Json,
            Self::Schema { .. } => ToolDefErrorKind::Schema,
            Self::InvalidSchema { .. } => ToolDefErrorKind::InvalidSchema,
            Self::Invalid { .. } => ToolDefErrorKind::Invalid,
            Self::DuplicateId { .. } => ToolDefErrorKind::DuplicateId,
            Self::DuplicateFunctionName { .. } => ToolDefErrorKind::DuplicateFunctionName,
            Self::EmbeddedSchema { .. } => ToolDefErrorKind::EmbeddedSchema,
        }
    }
}

// ---------------------------------------------------------------------------
// Registry

/// The tools known to a process, with their argument validators compiled.
/// Built once, then immutable: replace it whole when the catalog changes.
/// Cloning is cheap (entries are shared).
#[derive(Debug, Clone, Default)]
pub struct ToolRegistry {
    tools: Vec<Arc<CompiledTool>>,
    by_id: HashMap<ToolId, usize>,
    by_function: HashMap<String, usize>,
}

impl ToolRegistry {
    /// Check and compile every definition. Order is kept.
    ///
    /// # Errors
    ///
    /// A failed semantic check, or a duplicate id or function name.
    pub fn new(definitions: Vec<ToolDefinition>) -> Result<Self, ToolDefError> {
        let origins: Vec<Origin> = definitions
            .iter()
            .map(|definition| Origin::definition(&definition.id))
            .collect();
        check_unique(origins.iter().zip(&definitions))?;
        let tools = definitions
            .into_iter()
            .map(|definition| CompiledTool::new(definition).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self::index(tools))
    }

    /// [`load_dir`], then [`ToolRegistry::new`].
    ///
    /// # Errors
    ///
    /// As [`load_dir`].
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self, ToolDefError> {
        Self::new(load_dir(dir)?)
    }

    fn index(tools: Vec<Arc<CompiledTool>>) -> Self {
        let by_id = tools
            .iter()
            .enumerate()
            .map(|(at, tool)| (tool.definition.id.clone(), at))
            .collect();
        let by_function = tools
            .iter()
            .enumerate()
            .map(|(at, tool)| (tool.definition.function.name.clone(), at))
            .collect();
        Self {
            tools,
            by_id,
            by_function,
        }
    }

    /// The definition of `id`.
    #[must_use]
    pub fn get(&self, id: &ToolId) -> Option<&ToolDefinition> {
        self.compiled(id).map(|tool| &tool.definition)
    }

    /// The definition and compiled argument validator of `id`.
    #[must_use]
    pub fn compiled(&self, id: &ToolId) -> Option<&CompiledTool> {
        self.by_id.get(id).map(|&at| self.tools[at].as_ref())
    }

    /// The shared entry of `id`, for holding beyond the registry's lifetime.
    #[must_use]
    pub fn compiled_arc(&self, id: &ToolId) -> Option<Arc<CompiledTool>> {
        self.by_id.get(id).map(|&at| Arc::clone(&self.tools[at]))
    }

    /// The tool the model means by a function name in a tool call.
    #[must_use]
    pub fn by_function_name(&self, name: &str) -> Option<&ToolDefinition> {
        self.by_function
            .get(name)
            .map(|&at| &self.tools[at].definition)
    }

    /// Definitions in registry order.
    pub fn iter(&self) -> impl Iterator<Item = &ToolDefinition> {
        self.tools.iter().map(|tool| &tool.definition)
    }

    /// Compiled tools in registry order.
    pub fn iter_compiled(&self) -> impl Iterator<Item = &CompiledTool> {
        self.tools.iter().map(AsRef::as_ref)
    }

    /// How many tools the registry holds.
    #[must_use]
    pub fn len(&self) -> usize {
        self.tools.len()
    }

    /// Whether the registry holds no tool.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.tools.is_empty()
    }

    /// A registry of the tools `keep` accepts, in the same order; shares the
    /// compiled validators instead of recompiling.
    #[must_use]
    pub fn filtered(&self, keep: impl Fn(&ToolDefinition) -> bool) -> ToolRegistry {
        Self::index(
            self.tools
                .iter()
                .filter(|tool| keep(&tool.definition))
                .cloned()
                .collect(),
        )
    }
}

/// A function tool offered to the model, in neutral form. Each API shape
/// renders it its own way ([`to_chat_completions`](Self::to_chat_completions),
/// [`to_responses`](Self::to_responses)).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolSpec {
    /// The function name the model calls.
    pub name: String,
    /// What the model reads to decide when and how to call the tool.
    pub description: String,
    /// JSON Schema of the arguments object.
    pub parameters: Value,
    /// OpenAI structured outputs: the model's arguments are guaranteed to
    /// match `parameters` (which must then be a strict-mode schema).
    pub strict: bool,
}

impl ToolSpec {
    /// `{"type":"function","function":{name, description, parameters, strict}}`.
    pub fn to_chat_completions(&self) -> Value {
        json!({
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
                "strict": self.strict,
            }
        })
    }

    /// The flat Responses API shape:
    /// `{"type":"function", name, description, parameters, strict}`.
    pub fn to_responses(&self) -> Value {
        json!({
            "type": "function",
            "name": self.name,
            "description": self.description,
            "parameters": self.parameters,
            "strict": self.strict,
        })
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn tool_refs_parse_exact_ids_names_and_patterns() {
        let id: ToolId = "units:convert@1.2.0".parse().unwrap();
        for (text, matches) in [
            ("*", true),
            ("units:*", true),
            ("other:*", false),
            ("units:convert", true),
            ("units:other", false),
            ("units:convert@1.2.0", true),
            ("units:convert@1.0.0", false),
        ] {
            let r: ToolRef = text.parse().unwrap();
            assert_eq!(r.to_string(), text);
            assert_eq!(r.matches(&id), matches, "{text}");
            assert_eq!(r.is_pattern(), text.ends_with('*'), "{text}");
        }
        for bad in ["", "units", "Units:*", "units:Convert", "units:c@1", ":*"] {
            assert!(bad.parse::<ToolRef>().is_err(), "{bad:?} parsed");
        }
    }
    use serde_json::json;

    use super::*;

    fn definitions_dir() -> PathBuf {
        PathBuf::from(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tool_definitions"
        ))
    }

    fn schema_examples() -> Vec<Value> {
        let schema: Value =
            serde_json::from_str(TOOL_DEFINITION_SCHEMA).expect("embedded schema is JSON");
        schema["examples"]
            .as_array()
            .expect("examples array")
            .clone()
    }

    fn example(index: usize) -> Value {
        schema_examples().swap_remove(index)
    }

    fn parse(value: Value) -> Result<ToolDefinition, ToolDefError> {
        ToolDefinition::from_value(value, Origin::Named("test".into()))
    }

    fn id(text: &str) -> ToolId {
        text.parse().expect("valid id")
    }

    // -- ids --

    #[test]
    fn tool_id_parses_displays_and_round_trips() {
        let parsed = id("system:current_datetime@1.20.3");
        assert_eq!(parsed.namespace, "system");
        assert_eq!(parsed.name, "current_datetime");
        assert_eq!(parsed.version, (1, 20, 3));
        assert_eq!(parsed.to_string(), "system:current_datetime@1.20.3");
        assert_eq!(parsed.subject_token(), "system.current_datetime.1_20_3");
        assert_eq!(id("a:b9_@0.0.0").to_string(), "a:b9_@0.0.0");
        assert_eq!(
            ToolId::new("retrieval", "search_documents", (1, 0, 0)).expect("valid"),
            id("retrieval:search_documents@1.0.0")
        );
        assert!(ToolId::new("Retrieval", "x", (1, 0, 0)).is_err());
    }

    #[test]
    fn tool_id_serde_is_the_string() {
        let parsed = id("retrieval:search_documents@1.0.0");
        let value = serde_json::to_value(&parsed).expect("serialize");
        assert_eq!(value, json!("retrieval:search_documents@1.0.0"));
        let back: ToolId = serde_json::from_value(value).expect("deserialize");
        assert_eq!(back, parsed);
        let error = serde_json::from_value::<ToolId>(json!("nope")).expect_err("bad id");
        assert!(error.to_string().contains("missing ':'"), "{error}");
    }

    #[test]
    fn tool_id_rejects_each_malformation_clearly() {
        let cases: &[(&str, &str)] = &[
            ("system_current_datetime@1.0.0", "missing ':'"),
            ("system:current_datetime", "missing '@'"),
            ("system:current_datetime1.0.0", "missing '@'"),
            (":x@1.0.0", "bad namespace \"\": it is empty"),
            (
                "System:x@1.0.0",
                "bad namespace \"System\": it starts with 'S'",
            ),
            ("sys-tem:x@1.0.0", "character '-' at byte 3"),
            ("system:@1.0.0", "bad name \"\": it is empty"),
            ("system:1x@1.0.0", "bad name \"1x\": it starts with '1'"),
            ("system:cur.rent@1.0.0", "character '.' at byte 3"),
            ("system:a:b@1.0.0", "character ':' at byte 1"),
            (
                "system:x@1.0",
                "expected three components major.minor.patch, found 2",
            ),
            ("system:x@1.0.0.0", "found 4"),
            ("system:x@1..0", "the minor component is empty"),
            (
                "system:x@1.x.0",
                "the minor component `x` is not a number ('x' is not a digit)",
            ),
            (
                "system:x@+1.0.0",
                "the major component `+1` is not a number",
            ),
            (
                "system:x@1.0.-1",
                "the patch component `-1` is not a number",
            ),
            (
                "system:x@01.0.0",
                "the major component `01` has a leading zero",
            ),
            (
                "system:x@1.0.4294967296",
                "the patch component `4294967296` is larger than",
            ),
            ("", "missing ':'"),
        ];
        for (input, expected) in cases {
            let error = input.parse::<ToolId>().expect_err(input);
            let text = error.to_string();
            assert!(
                text.contains(expected),
                "{input:?}: {text:?} lacks {expected:?}"
            );
            assert!(
                text.contains(&format!("{input:?}")),
                "{input:?}: {text:?} lacks the input"
            );
            assert_eq!(error.input, *input);
        }
        assert_eq!(
            "x@1.0.0".parse::<ToolId>().expect_err("no colon").problem,
            ToolIdProblem::MissingColon
        );
        assert_eq!(
            "x:y".parse::<ToolId>().expect_err("no at").problem,
            ToolIdProblem::MissingAt
        );
    }

    // -- the definition schema and the serde type --

    #[test]
    fn schema_examples_validate_and_round_trip() {
        let examples = schema_examples();
        assert!(
            examples.len() >= 2,
            "the schema needs a full and a minimal example"
        );
        let validator = definition_validator().expect("embedded schema compiles");
        for (index, example) in examples.iter().enumerate() {
            validator
                .validate(example)
                .unwrap_or_else(|v| panic!("example {index}: {}", describe(&v)));
            let definition = parse(example.clone())
                .unwrap_or_else(|e| panic!("example {index} is not a usable definition: {e}"));
            let serialized = serde_json::to_value(&definition).expect("serialize");
            validator
                .validate(&serialized)
                .unwrap_or_else(|v| panic!("example {index} re-serialized: {}", describe(&v)));
            let again: ToolDefinition = serde_json::from_value(serialized).expect("deserialize");
            assert_eq!(again, definition, "example {index}");
        }
        // The first example spells out every field, so it survives a round
        // trip byte for byte: no field is lost or renamed by serde.
        let full = &examples[0];
        let definition = parse(full.clone()).expect("full example");
        assert_eq!(&serde_json::to_value(&definition).expect("serialize"), full);
        let schema: Value = serde_json::from_str(TOOL_DEFINITION_SCHEMA).expect("schema JSON");
        let mut documented: Vec<&String> = schema["properties"]
            .as_object()
            .expect("properties")
            .keys()
            .collect();
        documented.retain(|key| *key != "$schema");
        for key in documented {
            assert!(full.get(key).is_some(), "the full example lacks {key}");
        }
    }

    #[test]
    fn defaults_apply_to_a_minimal_definition() {
        let definition = parse(example(1)).expect("minimal example");
        assert!(definition.selectable);
        assert!(definition.parallel_safe);
        assert!(!definition.function.strict);
        assert!(definition.visible_in.is_empty());
        assert_eq!(definition.delivery, Delivery::Jetstream);
        assert_eq!(
            definition.timeout(),
            Duration::from_millis(DEFAULT_TIMEOUT_MS)
        );
        assert_eq!(definition.purpose(), Purpose::General);
        assert!(definition.settings_secret_fields().is_empty());
    }

    #[test]
    fn schema_rejects_bad_function_name_and_non_object_parameters() {
        let mut bad_name = example(1);
        bad_name["function"]["name"] = json!("has space");
        let error = parse(bad_name).expect_err("bad function name");
        assert_eq!(error.kind(), ToolDefErrorKind::Schema);
        assert!(error.to_string().contains("at /function/name:"), "{error}");

        let mut long_name = example(1);
        long_name["function"]["name"] = json!("a".repeat(65));
        assert_eq!(
            parse(long_name).expect_err("long").kind(),
            ToolDefErrorKind::Schema
        );

        let mut not_object = example(1);
        not_object["function"]["parameters"] = json!({"type": "string"});
        let error = parse(not_object).expect_err("non-object parameters");
        assert!(
            error.to_string().contains("at /function/parameters/type:"),
            "{error}"
        );

        let mut untyped = example(1);
        untyped["function"]["parameters"] = json!({"properties": {}});
        let error = parse(untyped).expect_err("untyped parameters");
        assert!(
            error.to_string().contains("at /function/parameters:"),
            "{error}"
        );

        let mut extra = example(1);
        extra["unknownField"] = json!(true);
        let error = parse(extra).expect_err("unknown top-level field");
        assert!(error.to_string().contains("unknownField"), "{error}");
    }

    #[test]
    fn settings_secret_fields_lists_secrets() {
        let definition = parse(example(0)).expect("full example");
        assert_eq!(
            definition.settings_secret_fields(),
            vec!["apiKey".to_owned()]
        );
    }

    // -- wire shapes --

    #[test]
    fn wire_shapes_come_from_the_one_definition() {
        let definition =
            load_file(definitions_dir().join("retrieval.search_documents.json")).expect("loads");
        let chat = definition.chat_completions_tool();
        assert_eq!(
            chat,
            json!({
                "type": "function",
                "function": {
                    "name": "search_documents",
                    "description": definition.function.description,
                    "parameters": definition.function.parameters,
                    "strict": false
                }
            })
        );
        let responses = definition.responses_tool();
        assert_eq!(
            responses,
            json!({
                "type": "function",
                "name": "search_documents",
                "description": definition.function.description,
                "parameters": definition.function.parameters,
                "strict": false
            })
        );
        let strict = parse(example(0)).expect("full example");
        assert_eq!(
            strict.chat_completions_tool()["function"]["strict"],
            json!(true)
        );
        assert_eq!(strict.responses_tool()["strict"], json!(true));
    }

    // -- the shipped definitions --

    #[test]
    fn load_dir_loads_the_shipped_definitions() {
        let definitions = load_dir(definitions_dir()).expect("shipped definitions load");
        let ids: Vec<String> = definitions.iter().map(|d| d.id.to_string()).collect();
        assert!(
            ids.contains(&"system:current_datetime@1.0.0".to_owned()),
            "{ids:?}"
        );
        assert!(
            ids.contains(&"retrieval:search_documents@1.0.0".to_owned()),
            "{ids:?}"
        );

        let registry = ToolRegistry::new(definitions).expect("registry");
        let datetime = registry
            .compiled(&id("system:current_datetime@1.0.0"))
            .expect("datetime");
        assert_eq!(
            datetime.definition.implementation_key,
            "system.current_datetime"
        );
        assert_eq!(datetime.definition.function.name, "current_datetime");
        assert_eq!(datetime.definition.timeout(), Duration::from_secs(5));
        assert_eq!(datetime.definition.category, "utility");
        assert_eq!(datetime.definition.purpose, Some(Purpose::General));
        assert!(datetime.validate_arguments(&json!({})).is_ok());
        assert!(
            datetime
                .validate_arguments(&json!({"utcOffset": "+05:30"}))
                .is_ok()
        );
        assert!(
            datetime
                .validate_arguments(&json!({"utcOffset": "-14:00"}))
                .is_ok()
        );
        let violations = datetime
            .validate_arguments(&json!({"utcOffset": "25:00"}))
            .expect_err("bad offset");
        assert_eq!(violations[0].path, "/utcOffset");
        assert!(datetime.validate_arguments(&json!({"tz": "UTC"})).is_err());

        let search = registry
            .by_function_name("search_data_sources")
            .expect("search");
        assert_eq!(search.id, id("retrieval:search_data_sources@1.0.0"));
        assert_eq!(search.implementation_key, "retrieval.search_data_sources");
        assert_eq!(search.timeout(), Duration::from_secs(10));
        assert_eq!(search.category, "retrieval");
        assert!(search.parallel_safe);
        let search = registry.compiled(&search.id).expect("compiled");
        assert!(
            search
                .validate_arguments(&json!({"query": "lighthouses", "topK": 3}))
                .is_ok()
        );
        let violations = search
            .validate_arguments(&json!({"query": "x", "topK": 50}))
            .expect_err("topK too high");
        assert_eq!(
            describe(&violations),
            "at /topK: 50 is greater than the maximum of 20"
        );
        assert!(search.validate_arguments(&json!({"topK": 3})).is_err());
        assert!(search.validate_arguments(&json!({"query": ""})).is_err());
    }

    // -- bad files --

    fn write(dir: &Path, name: &str, content: &str) -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, content).expect("write temp file");
        path
    }

    fn shipped(name: &str) -> Value {
        let text = std::fs::read_to_string(definitions_dir().join(name)).expect("shipped file");
        serde_json::from_str(&text).expect("shipped JSON")
    }

    #[test]
    fn invalid_json_names_the_file_and_position() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = write(
            dir.path(),
            "broken.json",
            "{\n  \"schemaVersion\": 1,\n  \"id\": \n}",
        );
        let error = load_dir(dir.path()).expect_err("invalid JSON");
        assert_eq!(error.kind(), ToolDefErrorKind::Json);
        let text = error.to_string();
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(text.contains("line 4"), "{text}");
    }

    #[test]
    fn schema_violation_names_the_file_and_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut value = shipped("retrieval.search_documents.json");
        value["timeoutMs"] = json!(-5);
        let path = write(dir.path(), "bad_timeout.json", &value.to_string());
        let error = load_file(&path).expect_err("schema violation");
        assert_eq!(error.kind(), ToolDefErrorKind::Schema);
        let text = error.to_string();
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(text.contains("at /timeoutMs:"), "{text}");
    }

    #[test]
    fn an_unknown_purpose_names_the_file_and_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut value = shipped("retrieval.search_documents.json");
        value["purpose"] = json!("mind_reading");
        let path = write(dir.path(), "bad_purpose.json", &value.to_string());
        let error = load_file(&path).expect_err("unknown purpose");
        assert_eq!(error.kind(), ToolDefErrorKind::Schema);
        let text = error.to_string();
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(text.contains("at /purpose:"), "{text}");
        // The four purposes there are load.
        for purpose in [
            "general",
            "document_processing",
            "data_source_search",
            "content_generation",
        ] {
            value["purpose"] = json!(purpose);
            let path = write(dir.path(), "ok.json", &value.to_string());
            load_file(&path).unwrap_or_else(|e| panic!("{purpose}: {e}"));
        }
    }

    #[test]
    fn duplicate_function_name_names_both_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let original = shipped("retrieval.search_documents.json");
        let mut copy = original.clone();
        copy["id"] = json!("retrieval:search_documents@2.0.0");
        let first = write(dir.path(), "a.json", &original.to_string());
        let second = write(dir.path(), "b.json", &copy.to_string());
        let error = load_dir(dir.path()).expect_err("duplicate function name");
        assert_eq!(error.kind(), ToolDefErrorKind::DuplicateFunctionName);
        let text = error.to_string();
        assert!(text.contains(&first.display().to_string()), "{text}");
        assert!(text.contains(&second.display().to_string()), "{text}");
        assert!(text.contains("\"search_documents\""), "{text}");
        assert!(text.contains("/function/name"), "{text}");
    }

    #[test]
    fn duplicate_id_names_both_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let original = shipped("retrieval.search_documents.json");
        let mut copy = original.clone();
        copy["function"]["name"] = json!("search_documents_again");
        write(dir.path(), "a.json", &original.to_string());
        let second = write(dir.path(), "b.json", &copy.to_string());
        let error = load_dir(dir.path()).expect_err("duplicate id");
        assert_eq!(error.kind(), ToolDefErrorKind::DuplicateId);
        let text = error.to_string();
        assert!(text.contains(&second.display().to_string()), "{text}");
        assert!(text.contains("retrieval:search_documents@1.0.0"), "{text}");
    }

    #[test]
    fn bad_sensitive_argument_names_the_file_and_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut value = shipped("retrieval.search_documents.json");
        value["sensitiveArguments"] = json!(["query", "password"]);
        let path = write(dir.path(), "bad_sensitive.json", &value.to_string());
        let error = load_dir(dir.path()).expect_err("bad sensitive argument");
        assert_eq!(error.kind(), ToolDefErrorKind::Invalid);
        let text = error.to_string();
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(text.contains("at /sensitiveArguments/1:"), "{text}");
        assert!(text.contains("\"password\""), "{text}");
    }

    #[test]
    fn llm_tool_fields_are_checked_with_file_and_field() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut value = shipped("retrieval.search_documents.json");
        value["outputSchema"] = json!({"type": "object", "required": ["summary"]});
        value["outputExample"] = json!({"title": "no summary"});
        let path = write(dir.path(), "bad_example.json", &value.to_string());
        let error = load_file(&path).expect_err("example against schema");
        let text = error.to_string();
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(text.contains("/outputExample"), "{text}");
        assert!(text.contains("summary"), "{text}");
        value["outputExample"] = json!({"summary": "ok"});
        assert!(parse(value.clone()).is_ok());

        for (pointer, bad) in [
            (
                "/modelPreference/preferredModel",
                json!({"preferredModel": "gpt-4o"}),
            ),
            (
                "/modelPreference/fallbackModels/0",
                json!({"fallbackModels": ["openai/"]}),
            ),
        ] {
            let mut v = value.clone();
            v["modelPreference"] = bad;
            let error = parse(v).expect_err("a model id without its provider");
            assert!(error.to_string().contains(pointer), "{error}");
        }
        let mut v = value.clone();
        v["variants"] = json!({"brief": {"models": ["openai gpt-4o"]}});
        let error = parse(v).expect_err("a malformed variant model");
        assert!(
            error.to_string().contains("/variants/brief/models/0"),
            "{error}"
        );
        let mut v = value;
        v["modelPreference"] = json!({"preferredModel": "local/meta-llama/Llama-3-8B"});
        assert!(parse(v).is_ok(), "a model name may hold slashes");
    }

    #[test]
    fn uncompilable_parameters_name_the_file_and_path() {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut value = shipped("retrieval.search_documents.json");
        value["function"]["parameters"]["properties"]["limit"]["maximum"] = json!("ten");
        let path = write(dir.path(), "bad_parameters.json", &value.to_string());
        let error = load_file(&path).expect_err("parameters do not compile");
        assert_eq!(error.kind(), ToolDefErrorKind::InvalidSchema);
        let text = error.to_string();
        assert!(text.contains(&path.display().to_string()), "{text}");
        assert!(
            text.contains("at /function/parameters/properties/limit/maximum:"),
            "{text}"
        );

        let mut remote = shipped("retrieval.search_documents.json");
        remote["function"]["parameters"]["properties"]["limit"] =
            json!({"$ref": "http://169.254.169.254/latest"});
        let error = parse(remote).expect_err("remote ref in parameters");
        assert_eq!(error.kind(), ToolDefErrorKind::InvalidSchema);
        assert!(error.to_string().contains("169.254.169.254"), "{error}");
    }

    #[test]
    fn strict_functions_must_follow_strict_mode_rules() {
        let mut optional = example(0);
        optional["function"]["parameters"]["required"] = json!(["text"]);
        let error = parse(optional).expect_err("optional property under strict");
        assert_eq!(error.kind(), ToolDefErrorKind::Invalid);
        assert!(error.to_string().contains("\"style\""), "{error}");

        let mut open = example(0);
        open["function"]["parameters"]
            .as_object_mut()
            .expect("object")
            .remove("additionalProperties");
        let error = parse(open).expect_err("open object under strict");
        assert!(
            error.to_string().contains("at /function/parameters:"),
            "{error}"
        );
    }

    #[test]
    fn unreadable_dir_and_non_json_files() {
        let dir = tempfile::tempdir().expect("tempdir");
        let missing = dir.path().join("nope");
        let error = load_dir(&missing).expect_err("missing dir");
        assert_eq!(error.kind(), ToolDefErrorKind::Io);
        assert!(error.to_string().contains(&missing.display().to_string()));
        write(dir.path(), "README.md", "not a definition");
        write(dir.path(), ".hidden.json", "{ not json");
        assert!(
            load_dir(dir.path())
                .expect("ignores non-definitions")
                .is_empty()
        );
    }

    // -- registry --

    #[test]
    fn registry_lookups_filter_and_duplicates() {
        let registry = ToolRegistry::from_dir(definitions_dir()).expect("registry");
        assert_eq!(registry.len(), registry.iter().count());
        assert!(!registry.is_empty());
        assert!(registry.get(&id("system:current_datetime@1.0.0")).is_some());
        assert!(registry.get(&id("system:current_datetime@2.0.0")).is_none());
        assert!(registry.by_function_name("nope").is_none());

        let only_utility = registry.filtered(|d| d.category == "utility");
        assert_eq!(only_utility.len(), 1);
        assert!(only_utility.by_function_name("current_datetime").is_some());
        assert!(only_utility.by_function_name("search_documents").is_none());
        assert!(
            only_utility
                .compiled(&id("retrieval:search_documents@1.0.0"))
                .is_none()
        );
        // The filtered registry shares the compiled tools.
        let a = registry
            .compiled_arc(&id("system:current_datetime@1.0.0"))
            .expect("a");
        let b = only_utility
            .compiled_arc(&id("system:current_datetime@1.0.0"))
            .expect("b");
        assert!(Arc::ptr_eq(&a, &b));
        assert!(registry.filtered(|_| false).is_empty());

        let definitions: Vec<ToolDefinition> = registry.iter().cloned().collect();
        let mut doubled = definitions.clone();
        doubled.extend(definitions);
        let error = ToolRegistry::new(doubled).expect_err("duplicates");
        assert_eq!(error.kind(), ToolDefErrorKind::DuplicateId);

        let mut spaced = registry.iter().next().expect("a tool").clone();
        spaced.function.name = "has space".into();
        let error = ToolRegistry::new(vec![spaced]).expect_err("schema gate runs");
        assert_eq!(error.kind(), ToolDefErrorKind::Schema);
        assert!(error.to_string().contains("at /function/name:"), "{error}");

        let mut bad = registry.iter().next().expect("a tool").clone();
        bad.sensitive_arguments = vec!["ghost".into()];
        let error = ToolRegistry::new(vec![bad]).expect_err("semantic check runs");
        assert!(error.to_string().contains("tool definition "), "{error}");
        assert!(error.to_string().contains("\"ghost\""), "{error}");
    }

    /// A minimal idempotent definition with `extra` merged in.
    fn cached(extra: Value) -> Result<ToolDefinition, ToolDefError> {
        let mut value = json!({
            "schemaVersion": 1,
            "id": "units:convert@1.0.0",
            "implementationKey": "units.convert",
            "title": "Convert",
            "description": "Converts units.",
            "category": "utility",
            "idempotent": true,
            "function": {
                "name": "convert",
                "description": "Converts units.",
                "parameters": { "type": "object", "properties": { "value": { "type": "number" } } }
            }
        });
        for (k, v) in extra.as_object().expect("an object") {
            value[k] = v.clone();
        }
        parse(value)
    }

    #[test]
    fn a_cache_is_only_for_idempotent_tools_with_a_bounded_ttl() {
        let ok = cached(json!({ "cache": { "ttlMs": 60000, "scope": "tenant" } })).expect("valid");
        assert_eq!(
            ok.cache,
            Some(ToolCache {
                ttl_ms: 60_000,
                scope: CacheScope::Tenant
            })
        );
        assert_eq!(ok.cache.unwrap().ttl(), Duration::from_secs(60));
        let error =
            cached(json!({ "idempotent": false, "cache": { "ttlMs": 60000, "scope": "tenant" } }))
                .expect_err("not idempotent");
        assert_eq!(error.kind(), ToolDefErrorKind::Invalid);
        assert!(error.to_string().contains("at /cache:"), "{error}");
        assert!(
            error.to_string().contains("\"idempotent\": true"),
            "{error}"
        );
        for ttl in [999, 604_800_001] {
            let error = cached(json!({ "cache": { "ttlMs": ttl, "scope": "user" } }))
                .expect_err("ttl out of bounds");
            assert!(error.to_string().contains("/cache/ttlMs"), "{error}");
        }
        for bad in [
            json!({ "cache": { "ttlMs": 60000, "scope": "everyone" } }),
            json!({ "cache": { "ttlMs": 60000 } }),
            json!({ "cache": { "ttlMs": 60000, "scope": "tenant", "extra": 1 } }),
        ] {
            let error = cached(bad).expect_err("schema");
            assert_eq!(error.kind(), ToolDefErrorKind::Schema, "{error}");
        }
    }

    #[test]
    fn a_global_cache_is_refused_where_tenants_answers_differ() {
        cached(json!({ "cache": { "ttlMs": 60000, "scope": "global" } })).expect("arguments only");
        for extra in [
            json!({ "settingsSchema": { "type": "object" } }),
            json!({ "purpose": "data_source_search" }),
            json!({ "purpose": "document_processing" }),
        ] {
            let mut extra = extra;
            extra["cache"] = json!({ "ttlMs": 60000, "scope": "global" });
            let error = cached(extra.clone()).expect_err("global refused");
            assert!(error.to_string().contains("/cache/scope"), "{error}");
            extra["cache"]["scope"] = json!("tenant");
            cached(extra).expect("tenant scope is fine");
        }
    }
}
