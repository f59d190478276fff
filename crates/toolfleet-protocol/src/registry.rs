//! The tool registry: one view over every source of tools.
//!
//! The fleet's tools come from several backends ([`ToolSource`]): the
//! catalog live workers advertise ([`Catalog`]), definition directories
//! ([`DirSource`]), the agent tools the orchestrator synthesizes, later MCP
//! servers. [`Registry::build`] puts them together into one value that
//! answers by id (`ns:name@x.y.z`, or `ns:name` for the highest version),
//! by [`ToolRef`], by [`Filter`] and by function name, and knows which
//! models each tool is recommended for ([`CompatFile`]).
//!
//! Invariants:
//!
//! - A [`Registry`] is an immutable snapshot: built whole, never changed,
//!   and replaced whole (a new `Arc<Registry>` swapped in) when a source
//!   changes. Entries share the sources' compiled tools (`Arc`s).
//! - One entry per tool id. On a duplicate id the first source given to
//!   [`Registry::build`] wins (and within one source its first tool); every
//!   dropped duplicate is recorded ([`Registry::duplicates`]) and logged
//!   once per build.
//! - A model is never offered one function name twice:
//!   [`Registry::by_function_name`] and [`Registry::offered`] pick one
//!   entry per function name — live ones first, then the highest version
//!   of a `ns:name`, then the smallest id (the catalog's rule, see
//!   [`crate::catalog`]).
//! - Recommended models come only from a [`CompatFile`] attached with
//!   [`Registry::with_compat`], which reports (and leaves out) models and
//!   tools nobody knows instead of failing.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::sync::Arc;

use serde_json::Value;

use crate::catalog::Catalog;
use crate::tools::{CompiledTool, ToolDefError, ToolDefinition, ToolId, ToolRef, load_dir};

// ---------------------------------------------------------------------------
// Sources

/// One backend of the registry.
pub trait ToolSource: Send + Sync {
    /// Short name for logs and metrics: `catalog`, `dir:<path>`, `agents`,
    /// `mcp:<server>`.
    fn name(&self) -> &str;

    /// The backend's tools now (cheap: `Arc`s). A duplicate id inside one
    /// backend is its own loading's error to report (e.g. [`load_dir`]),
    /// but [`Registry::build`] tolerates it: the first is kept and a
    /// [`Duplicate`] with both sources equal is recorded.
    fn tools(&self) -> Vec<SourcedTool>;
}

/// A tool as one backend has it.
#[derive(Clone, Debug)]
pub struct SourcedTool {
    /// The checked, compiled definition.
    pub tool: Arc<CompiledTool>,
    /// Live copies serving it (0: known, not served by any live worker).
    pub workers: usize,
    /// The worker families serving it (catalog), empty otherwise.
    pub families: Vec<String>,
}

impl SourcedTool {
    /// A tool known from a definition, served by no live worker.
    #[must_use]
    pub fn known(tool: Arc<CompiledTool>) -> Self {
        Self {
            tool,
            workers: 0,
            families: Vec::new(),
        }
    }
}

/// The catalog of live workers, as the backend `catalog`: every live
/// entry ([`Catalog::all`]), offered or not, so an older version still
/// served during a rolling upgrade is found by its id (the registry picks
/// its own one per function name).
impl ToolSource for Catalog {
    fn name(&self) -> &str {
        "catalog"
    }

    fn tools(&self) -> Vec<SourcedTool> {
        self.all()
            .map(|e| SourcedTool {
                tool: Arc::clone(&e.tool),
                workers: e.workers,
                families: e.families.clone(),
            })
            .collect()
    }
}

/// A directory of definition files (or tools handed over in tests), as the
/// backend `dir:<path>`. Its tools are served by no worker it knows of
/// (`workers` 0).
#[derive(Clone, Debug)]
pub struct DirSource {
    name: String,
    tools: Vec<Arc<CompiledTool>>,
}

impl DirSource {
    /// Loads, checks and compiles every definition in `dir` ([`load_dir`]).
    ///
    /// # Errors
    ///
    /// As [`load_dir`] (which refuses a duplicate id or function name), or
    /// a definition whose schemas do not compile.
    pub fn load(dir: impl AsRef<Path>) -> Result<Self, ToolDefError> {
        let dir = dir.as_ref();
        let tools = load_dir(dir)?
            .into_iter()
            .map(|definition| CompiledTool::new(definition).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            name: format!("dir:{}", dir.display()),
            tools,
        })
    }

    /// A source named `name` of the given tools, in that order (tests,
    /// and callers that load definitions their own way).
    #[must_use]
    pub fn from_tools(
        name: impl Into<String>,
        tools: impl IntoIterator<Item = Arc<CompiledTool>>,
    ) -> Self {
        Self {
            name: name.into(),
            tools: tools.into_iter().collect(),
        }
    }
}

impl ToolSource for DirSource {
    fn name(&self) -> &str {
        &self.name
    }

    fn tools(&self) -> Vec<SourcedTool> {
        self.tools.iter().cloned().map(SourcedTool::known).collect()
    }
}

// ---------------------------------------------------------------------------
// The registry

/// One tool of the registry and the source it was taken from.
#[derive(Clone, Debug)]
pub struct RegistryEntry {
    /// The checked, compiled definition.
    pub tool: Arc<CompiledTool>,
    /// The [`ToolSource::name`] of the source it was taken from.
    pub source: Arc<str>,
    /// Live copies serving it (0: known, not served by any live worker).
    pub workers: usize,
    /// The worker families serving it (catalog), empty otherwise.
    pub families: Vec<String>,
}

impl RegistryEntry {
    /// The tool's id.
    #[must_use]
    pub fn id(&self) -> &ToolId {
        &self.tool.definition.id
    }

    /// The tool's definition.
    #[must_use]
    pub fn definition(&self) -> &ToolDefinition {
        &self.tool.definition
    }

    /// Does a live worker serve it?
    #[must_use]
    pub fn is_live(&self) -> bool {
        self.workers > 0
    }
}

/// A tool id two sources (or one source twice) had: the definition of
/// `kept` is in the registry, the one of `dropped` is not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Duplicate {
    /// The id both sources had.
    pub id: ToolId,
    /// The source whose definition was kept.
    pub kept: String,
    /// The source whose definition was dropped (equal to `kept` for a
    /// duplicate inside one source).
    pub dropped: String,
}

/// Conditions of [`Registry::find`]; every given one must hold.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Filter {
    /// The id's namespace is exactly this.
    pub namespace: Option<String>,
    /// The id (`ns:name@x.y.z`) starts with this.
    pub id_prefix: Option<String>,
    /// One of the definition's tags is exactly this.
    pub tag: Option<String>,
    /// The definition's category is exactly this.
    pub category: Option<String>,
    /// The tool's recommended models ([`Registry::models_for`]) include
    /// this one.
    pub model: Option<String>,
}

/// Every tool of the fleet's sources at one moment. Immutable: built whole
/// by [`Registry::build`], replaced whole (see the module docs).
#[derive(Clone, Debug, Default)]
pub struct Registry {
    /// By id: namespace, name, then version as numbers (1.9.0 before
    /// 1.10.0).
    entries: BTreeMap<ToolId, RegistryEntry>,
    /// Function name → the one entry that has it for a model.
    by_function: BTreeMap<String, ToolId>,
    duplicates: Vec<Duplicate>,
    /// Entries kept per source, every source named (0 when none was kept).
    sizes: BTreeMap<String, usize>,
    /// Tool id → recommended models, cheapest first (known models only).
    models: BTreeMap<ToolId, Vec<String>>,
}

impl Registry {
    /// The registry of `sources`' tools. On a duplicate id the earlier
    /// source wins (within one source, its earlier tool); each dropped
    /// duplicate is recorded and logged as a warning.
    #[must_use]
    pub fn build(sources: &[&dyn ToolSource]) -> Registry {
        let mut entries: BTreeMap<ToolId, RegistryEntry> = BTreeMap::new();
        let mut duplicates = Vec::new();
        let mut sizes = BTreeMap::new();
        for source in sources {
            let name: Arc<str> = Arc::from(source.name());
            let kept = sizes.entry(name.to_string()).or_insert(0);
            for sourced in source.tools() {
                let id = sourced.tool.definition.id.clone();
                if let Some(first) = entries.get(&id) {
                    tracing::warn!(tool = %id, kept = %first.source, dropped = %name,
                        "duplicate tool id; the first source's definition is kept");
                    duplicates.push(Duplicate {
                        id,
                        kept: first.source.to_string(),
                        dropped: name.to_string(),
                    });
                    continue;
                }
                *kept += 1;
                entries.insert(
                    id,
                    RegistryEntry {
                        tool: sourced.tool,
                        source: Arc::clone(&name),
                        workers: sourced.workers,
                        families: sourced.families,
                    },
                );
            }
        }
        let by_function = one_per_function_name(&entries);
        Registry {
            entries,
            by_function,
            duplicates,
            sizes,
            models: BTreeMap::new(),
        }
    }

    /// This registry with the recommended models of `compat` attached, and
    /// what [`CompatFile::check`] found wrong with it. A model
    /// `known_model` refuses is left out of [`Registry::models_for`]; an
    /// entry of the file naming no tool of the registry is only reported.
    /// The caller logs the problems; the rest keeps working.
    #[must_use]
    pub fn with_compat(
        mut self,
        compat: &CompatFile,
        known_model: impl Fn(&str) -> bool,
    ) -> (Registry, Vec<CompatError>) {
        let problems = compat.check(&known_model, &self);
        self.models = self
            .entries
            .keys()
            .filter_map(|id| {
                let models: Vec<String> = compat
                    .models(id)?
                    .iter()
                    .filter(|m| known_model(m))
                    .cloned()
                    .collect();
                (!models.is_empty()).then(|| (id.clone(), models))
            })
            .collect();
        (self, problems)
    }

    /// The entry named by `reference`: a full id (`ns:name@x.y.z`) exactly,
    /// or `ns:name` for its highest version. Patterns (`*`, `ns:*`) and
    /// malformed references name no entry.
    #[must_use]
    pub fn get(&self, reference: &str) -> Option<&RegistryEntry> {
        match reference.parse::<ToolRef>().ok()? {
            ToolRef::Exact(id) => self.entries.get(&id),
            ToolRef::Name { namespace, name } => self.highest(&namespace, &name),
            ToolRef::All | ToolRef::Namespace(_) => None,
        }
    }

    /// The entry of `id`.
    #[must_use]
    pub fn get_id(&self, id: &ToolId) -> Option<&RegistryEntry> {
        self.entries.get(id)
    }

    /// The entries `reference` names, in id order: every entry for `*`,
    /// those of a namespace for `ns:*`, the highest version for `ns:name`,
    /// the one entry for an exact id. Whether a pattern may pick a tool
    /// that is not selectable is the caller's rule.
    #[must_use]
    pub fn resolve(&self, reference: &ToolRef) -> Vec<&RegistryEntry> {
        match reference {
            ToolRef::Name { namespace, name } => {
                self.highest(namespace, name).into_iter().collect()
            }
            ToolRef::Exact(id) => self.entries.get(id).into_iter().collect(),
            ToolRef::All | ToolRef::Namespace(_) => self
                .entries
                .values()
                .filter(|e| reference.matches(e.id()))
                .collect(),
        }
    }

    /// The highest version of `namespace:name`.
    fn highest(&self, namespace: &str, name: &str) -> Option<&RegistryEntry> {
        // Ids sort by namespace, name, then version: the last one of the
        // range is the highest version.
        let from = ToolId {
            namespace: namespace.to_owned(),
            name: name.to_owned(),
            version: (0, 0, 0),
        };
        let to = ToolId {
            version: (u32::MAX, u32::MAX, u32::MAX),
            ..from.clone()
        };
        self.entries
            .range(from..=to)
            .next_back()
            .map(|(_, entry)| entry)
    }

    /// Every entry, in id order (namespace, name, then version as numbers).
    pub fn list(&self) -> impl Iterator<Item = &RegistryEntry> {
        self.entries.values()
    }

    /// The entries a model may be offered: one per function name (see
    /// [`Registry::by_function_name`]), in id order.
    pub fn offered(&self) -> impl Iterator<Item = &RegistryEntry> {
        self.entries.iter().filter_map(|(id, entry)| {
            (self.by_function.get(&entry.definition().function.name) == Some(id)).then_some(entry)
        })
    }

    /// The entries meeting every condition of `filter`, in id order.
    #[must_use]
    pub fn find(&self, filter: &Filter) -> Vec<&RegistryEntry> {
        self.entries
            .values()
            .filter(|e| {
                let d = e.definition();
                filter
                    .namespace
                    .as_ref()
                    .is_none_or(|ns| d.id.namespace == *ns)
                    && filter
                        .id_prefix
                        .as_ref()
                        .is_none_or(|prefix| d.id.to_string().starts_with(prefix.as_str()))
                    && filter.tag.as_ref().is_none_or(|tag| d.tags.contains(tag))
                    && filter.category.as_ref().is_none_or(|c| d.category == *c)
                    && filter.model.as_ref().is_none_or(|model| {
                        self.models
                            .get(&d.id)
                            .is_some_and(|models| models.contains(model))
                    })
            })
            .collect()
    }

    /// The one entry a model means by the function name `name`. Among the
    /// entries with that function name: live ones first, then the highest
    /// version of a `ns:name`, then the smallest id.
    #[must_use]
    pub fn by_function_name(&self, name: &str) -> Option<&RegistryEntry> {
        self.by_function
            .get(name)
            .and_then(|id| self.entries.get(id))
    }

    /// Whether no two entries share a function name (then every entry is
    /// offered by [`Registry::offered`], and a reader need not dedupe).
    #[must_use]
    pub fn function_names_unique(&self) -> bool {
        self.by_function.len() == self.entries.len()
    }

    /// The recommended models of `id`, cheapest first (empty when none, or
    /// no compat file is attached).
    #[must_use]
    pub fn models_for(&self, id: &ToolId) -> Vec<String> {
        self.models.get(id).cloned().unwrap_or_default()
    }

    /// The ids two sources (or one source twice) had, and whose definition
    /// was dropped, in the order met.
    #[must_use]
    pub fn duplicates(&self) -> &[Duplicate] {
        &self.duplicates
    }

    /// Entries kept per source name (0 for a source all of whose tools
    /// another source had first).
    #[must_use]
    pub fn sizes(&self) -> BTreeMap<String, usize> {
        self.sizes.clone()
    }

    /// How many tools the registry holds.
    #[must_use]
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the registry holds no tool.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Function name → the entry offered for it: live entries first, then,
/// as the catalog does, each `ns:name` represented by its highest version
/// and of those the smallest id.
fn one_per_function_name(entries: &BTreeMap<ToolId, RegistryEntry>) -> BTreeMap<String, ToolId> {
    let mut by_function: BTreeMap<&str, Vec<&RegistryEntry>> = BTreeMap::new();
    for entry in entries.values() {
        by_function
            .entry(&entry.definition().function.name)
            .or_default()
            .push(entry);
    }
    by_function
        .into_iter()
        .filter_map(|(function, candidates)| {
            let chosen = candidates.iter().min_by(|a, b| {
                let key = |e: &RegistryEntry| {
                    let id = e.id();
                    (
                        !e.is_live(),
                        id.namespace.clone(),
                        id.name.clone(),
                        std::cmp::Reverse(id.version),
                    )
                };
                key(a).cmp(&key(b))
            })?;
            if candidates.len() > 1 {
                tracing::debug!(function, offered = %chosen.id(), candidates = candidates.len(),
                    "several tools have one function name; one is offered");
            }
            Some((function.to_owned(), chosen.id().clone()))
        })
        .collect()
}

// ---------------------------------------------------------------------------
// The compat file

/// Which models each tool is recommended for, cheapest first, from a JSON
/// file:
///
/// ```json
/// {"tools": {"llm:summarize@1.0.0": ["openai/gpt-4o-mini", "openai/gpt-4o"],
///            "units:convert": ["openai/gpt-4o-mini"]}}
/// ```
///
/// A key is a full tool id or `ns:name` (every version of it); for a tool
/// both name, the full id's list is the one taken. A model is
/// `provider/model`: both parts non-empty, no white space.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CompatFile {
    /// Where it was read from, for errors.
    origin: String,
    /// Key as written → (the reference it parses to, its models).
    tools: BTreeMap<String, (ToolRef, Vec<String>)>,
}

impl CompatFile {
    /// Reads and checks the file at `path`.
    ///
    /// # Errors
    ///
    /// A [`CompatError`] naming the file (and the key, where there is one):
    /// unreadable, not JSON, or a malformed entry (see
    /// [`CompatFile::from_json`]).
    pub fn load(path: impl AsRef<Path>) -> Result<Self, CompatError> {
        let path = path.as_ref();
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| {
            CompatError::new(&origin, String::new(), CompatProblem::Io(e.to_string()))
        })?;
        Self::from_json(&text, &origin)
    }

    /// Parses and checks the JSON `text`; errors name `origin`.
    ///
    /// # Errors
    ///
    /// A [`CompatError`] for the first problem met: invalid JSON, a
    /// document that is not `{"tools": {..}}`, a key that is not a tool id
    /// or `ns:name`, a list that is not of strings, a model that is not
    /// `provider/model`, a model listed twice for one tool.
    pub fn from_json(text: &str, origin: &str) -> Result<Self, CompatError> {
        let fail = |field: String, problem| Err(CompatError::new(origin, field, problem));
        let document: Value = match serde_json::from_str(text) {
            Ok(value) => value,
            Err(e) => return fail(String::new(), CompatProblem::Json(e.to_string())),
        };
        let Some(document) = document.as_object() else {
            return fail(
                String::new(),
                CompatProblem::Shape("expected an object {\"tools\": {...}}".into()),
            );
        };
        for key in document.keys() {
            if key != "tools" && key != "$schema" {
                return fail(
                    key.clone(),
                    CompatProblem::Shape("unknown field; expected only \"tools\"".into()),
                );
            }
        }
        let Some(listed) = document.get("tools") else {
            return fail(
                "tools".into(),
                CompatProblem::Shape("missing; expected an object of tool → models".into()),
            );
        };
        let Some(listed) = listed.as_object() else {
            return fail(
                "tools".into(),
                CompatProblem::Shape("expected an object of tool → models".into()),
            );
        };
        let mut tools = BTreeMap::new();
        for (key, models) in listed {
            let field = format!("tools[{}]", quoted(key));
            let reference = match key.parse::<ToolRef>() {
                Ok(r @ (ToolRef::Exact(_) | ToolRef::Name { .. })) => r,
                Ok(_) => {
                    return fail(
                        field,
                        CompatProblem::BadTool {
                            key: key.clone(),
                            reason: "a pattern; name one tool (ns:name or ns:name@x.y.z)".into(),
                        },
                    );
                }
                Err(e) => {
                    return fail(
                        field,
                        CompatProblem::BadTool {
                            key: key.clone(),
                            reason: e.problem.to_string(),
                        },
                    );
                }
            };
            let Some(models) = models.as_array() else {
                return fail(
                    field,
                    CompatProblem::Shape("expected an array of \"provider/model\" names".into()),
                );
            };
            let mut names: Vec<String> = Vec::with_capacity(models.len());
            for (index, model) in models.iter().enumerate() {
                let field = format!("{field}[{index}]");
                let Some(model) = model.as_str() else {
                    return fail(
                        field,
                        CompatProblem::Shape("expected a \"provider/model\" string".into()),
                    );
                };
                if !valid_model(model) {
                    return fail(
                        field,
                        CompatProblem::BadModel {
                            model: model.into(),
                        },
                    );
                }
                if let Some(first) = names.iter().position(|m| m == model) {
                    return fail(
                        field,
                        CompatProblem::DuplicateModel {
                            model: model.into(),
                            first,
                        },
                    );
                }
                names.push(model.to_owned());
            }
            tools.insert(key.clone(), (reference, names));
        }
        Ok(Self {
            origin: origin.to_owned(),
            tools,
        })
    }

    /// Where the file was read from.
    #[must_use]
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The models listed for `id`, as written (unknown ones included):
    /// the list of its full id, else the list of its `ns:name`.
    #[must_use]
    pub fn models(&self, id: &ToolId) -> Option<&[String]> {
        let exact = self.tools.get(&id.to_string());
        let name = || self.tools.get(&format!("{}:{}", id.namespace, id.name));
        exact.or_else(name).map(|(_, models)| models.as_slice())
    }

    /// What the file names that nobody knows: each key naming no tool of
    /// `registry`, and each model `known_model` refuses, as one error
    /// naming the file and the field. The caller logs them; the rest of
    /// the file is still good (see [`Registry::with_compat`]).
    #[must_use]
    pub fn check(
        &self,
        known_model: impl Fn(&str) -> bool,
        registry: &Registry,
    ) -> Vec<CompatError> {
        let mut problems = Vec::new();
        for (key, (reference, models)) in &self.tools {
            let field = format!("tools[{}]", quoted(key));
            if registry.resolve(reference).is_empty() {
                problems.push(CompatError::new(
                    &self.origin,
                    field.clone(),
                    CompatProblem::UnknownTool { key: key.clone() },
                ));
            }
            for (index, model) in models.iter().enumerate() {
                if !known_model(model) {
                    problems.push(CompatError::new(
                        &self.origin,
                        format!("{field}[{index}]"),
                        CompatProblem::UnknownModel {
                            model: model.clone(),
                        },
                    ));
                }
            }
        }
        problems
    }
}

/// `provider/model`: both parts non-empty, no white space (the model part
/// may hold further slashes, as router model names do).
fn valid_model(model: &str) -> bool {
    model.split_once('/').is_some_and(|(provider, name)| {
        !provider.is_empty() && !name.is_empty() && !model.chars().any(char::is_whitespace)
    })
}

/// A JSON string literal of `key`, for field names like `tools["x"]`.
fn quoted(key: &str) -> String {
    Value::String(key.to_owned()).to_string()
}

/// A problem with a compat file: which file, which field, what.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct CompatError {
    /// The file (or the origin given to [`CompatFile::from_json`]).
    pub origin: String,
    /// Where in the document, e.g. `tools["units:convert"][1]`; empty for
    /// the whole document.
    pub field: String,
    /// What is wrong there.
    pub problem: CompatProblem,
}

impl CompatError {
    fn new(origin: &str, field: String, problem: CompatProblem) -> Self {
        Self {
            origin: origin.to_owned(),
            field,
            problem,
        }
    }
}

impl fmt::Display for CompatError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "{}: {}", self.origin, self.problem)
        } else {
            write!(f, "{}: at {}: {}", self.origin, self.field, self.problem)
        }
    }
}

/// What is wrong in a compat file.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum CompatProblem {
    /// The file cannot be read.
    #[error("cannot read: {0}")]
    Io(String),
    /// The file is not JSON.
    #[error("not valid JSON: {0}")]
    Json(String),
    /// The document is not `{"tools": {key: [model, ..]}}`.
    #[error("{0}")]
    Shape(String),
    /// A key of `tools` is neither a tool id nor an `ns:name`.
    #[error("{key:?} is not a tool id (ns:name@x.y.z) or ns:name: {reason}")]
    BadTool {
        /// The key, as written.
        key: String,
        /// Why it is not one.
        reason: String,
    },
    /// A listed model is not `provider/model`.
    #[error("{model:?} is not a model name: expected provider/model, both non-empty, no spaces")]
    BadModel {
        /// The model, as written.
        model: String,
    },
    /// A tool lists one model twice.
    #[error("{model:?} is listed twice (first at index {first})")]
    DuplicateModel {
        /// The model, as written.
        model: String,
        /// The index of its first listing.
        first: usize,
    },
    /// Found by [`CompatFile::check`]: no tool of the registry is named.
    #[error("no tool in the registry is {key}")]
    UnknownTool {
        /// The key, as written.
        key: String,
    },
    /// Found by [`CompatFile::check`]: a model nobody configured.
    #[error("unknown model {model:?}")]
    UnknownModel {
        /// The model, as written.
        model: String,
    },
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::tools::Origin;

    /// A checked, compiled tool of the given id and function name.
    fn tool_with(id: &str, function: &str, category: &str, tags: &[&str]) -> Arc<CompiledTool> {
        let definition = ToolDefinition::from_value(
            json!({
                "schemaVersion": 1,
                "id": id,
                "implementationKey": "test.tool",
                "title": format!("Tool {id}"),
                "description": "A tool of the registry tests.",
                "category": category,
                "tags": tags,
                "function": {
                    "name": function,
                    "description": "Does its work.",
                    "parameters": { "type": "object", "properties": {} }
                }
            }),
            Origin::Named(format!("test {id}")),
        )
        .expect("a valid definition");
        Arc::new(CompiledTool::new(definition).expect("compiles"))
    }

    /// A tool whose function name is its id's name.
    fn tool(id: &str) -> Arc<CompiledTool> {
        let name = id
            .split_once(':')
            .and_then(|(_, rest)| rest.split_once('@'))
            .map(|(name, _)| name)
            .expect("an id");
        tool_with(id, name, "utility", &[])
    }

    /// A stand-in backend with live tools (`workers` copies each).
    struct Live {
        tools: Vec<Arc<CompiledTool>>,
        workers: usize,
    }

    impl ToolSource for Live {
        fn name(&self) -> &str {
            "live"
        }

        fn tools(&self) -> Vec<SourcedTool> {
            self.tools
                .iter()
                .map(|t| SourcedTool {
                    tool: Arc::clone(t),
                    workers: self.workers,
                    families: vec!["system".into()],
                })
                .collect()
        }
    }

    fn ids<'a>(entries: impl IntoIterator<Item = &'a RegistryEntry>) -> Vec<String> {
        entries.into_iter().map(|e| e.id().to_string()).collect()
    }

    fn id(text: &str) -> ToolId {
        text.parse().expect("a tool id")
    }

    fn reference(text: &str) -> ToolRef {
        text.parse().expect("a tool reference")
    }

    fn registry(tools: &[&str]) -> Registry {
        let source = DirSource::from_tools("dir:test", tools.iter().map(|id| tool(id)));
        Registry::build(&[&source])
    }

    #[test]
    fn the_first_source_wins_a_duplicate_id_and_it_is_recorded() {
        let first = DirSource::from_tools(
            "dir:a",
            [tool("units:convert@1.0.0"), tool("units:round@1.0.0")],
        );
        let second = Live {
            tools: vec![tool("units:convert@1.0.0"), tool("units:scale@1.0.0")],
            workers: 2,
        };
        let registry = Registry::build(&[&first, &second]);
        assert_eq!(
            ids(registry.list()),
            [
                "units:convert@1.0.0",
                "units:round@1.0.0",
                "units:scale@1.0.0"
            ]
        );
        let convert = registry.get("units:convert@1.0.0").expect("kept");
        assert_eq!(&*convert.source, "dir:a");
        assert!(
            !convert.is_live(),
            "the first source's entry, not the live one"
        );
        assert!(registry.get("units:scale@1.0.0").expect("kept").is_live());
        assert_eq!(
            registry.duplicates(),
            [Duplicate {
                id: id("units:convert@1.0.0"),
                kept: "dir:a".into(),
                dropped: "live".into(),
            }]
        );
        // The other order: the live one is kept.
        let registry = Registry::build(&[&second, &first]);
        assert!(registry.get("units:convert@1.0.0").expect("kept").is_live());
        assert_eq!(registry.duplicates()[0].kept, "live");
        assert_eq!(registry.duplicates()[0].dropped, "dir:a");
        assert_eq!(registry.len(), 3);
        assert!(!registry.is_empty());
        assert!(Registry::default().is_empty());
    }

    #[test]
    fn a_duplicate_inside_one_source_keeps_the_first() {
        let a = tool_with("units:convert@1.0.0", "convert", "first", &[]);
        let b = tool_with("units:convert@1.0.0", "convert", "second", &[]);
        let source = DirSource::from_tools("dir:x", [a, b]);
        let registry = Registry::build(&[&source]);
        assert_eq!(registry.len(), 1);
        assert_eq!(
            registry
                .get("units:convert@1.0.0")
                .expect("kept")
                .definition()
                .category,
            "first"
        );
        assert_eq!(
            registry.duplicates(),
            [Duplicate {
                id: id("units:convert@1.0.0"),
                kept: "dir:x".into(),
                dropped: "dir:x".into(),
            }]
        );
        assert_eq!(registry.sizes(), BTreeMap::from([("dir:x".into(), 1)]));
    }

    #[test]
    fn get_takes_an_exact_id_or_the_highest_version_of_a_name() {
        let registry = registry(&[
            "units:convert@1.9.0",
            "units:convert@1.10.0",
            "units:convert@0.12.0",
            "units:converter@9.0.0",
            "unit:convert@5.0.0",
        ]);
        let version = |r: &str| registry.get(r).map(|e| e.id().to_string());
        assert_eq!(
            version("units:convert@1.9.0").as_deref(),
            Some("units:convert@1.9.0")
        );
        // 1.10.0 is newer than 1.9.0 (numbers, not strings); neighbours in
        // the id order (`units:converter`, `unit:convert`) are not taken.
        assert_eq!(
            version("units:convert").as_deref(),
            Some("units:convert@1.10.0")
        );
        assert_eq!(version("units:convert@2.0.0"), None);
        assert_eq!(version("units:nope"), None);
        assert_eq!(version("units:*"), None);
        assert_eq!(version("*"), None);
        assert_eq!(version("not a reference"), None);
        assert!(registry.get_id(&id("unit:convert@5.0.0")).is_some());
    }

    #[test]
    fn resolve_answers_each_kind_of_reference() {
        let registry = registry(&[
            "units:convert@1.0.0",
            "units:convert@2.0.0",
            "units:round@1.0.0",
            "system:clock@1.0.0",
        ]);
        let resolved = |r: &str| ids(registry.resolve(&reference(r)));
        assert_eq!(
            resolved("*"),
            [
                "system:clock@1.0.0",
                "units:convert@1.0.0",
                "units:convert@2.0.0",
                "units:round@1.0.0"
            ]
        );
        assert_eq!(
            resolved("units:*"),
            [
                "units:convert@1.0.0",
                "units:convert@2.0.0",
                "units:round@1.0.0"
            ]
        );
        assert_eq!(resolved("units:convert"), ["units:convert@2.0.0"]);
        assert_eq!(resolved("units:convert@1.0.0"), ["units:convert@1.0.0"]);
        assert!(resolved("units:convert@3.0.0").is_empty());
        assert!(resolved("other:*").is_empty());
        assert!(resolved("units:nope").is_empty());
    }

    #[test]
    fn find_holds_every_given_condition() {
        let source = DirSource::from_tools(
            "dir:test",
            [
                tool_with("units:convert@1.0.0", "convert", "math", &["units", "si"]),
                tool_with("units:round@1.0.0", "round", "math", &["numbers"]),
                tool_with("system:clock@1.0.0", "clock", "utility", &["time"]),
                tool_with("systems:probe@1.0.0", "probe", "utility", &["si"]),
            ],
        );
        let compat = CompatFile::from_json(
            r#"{"tools": {"units:convert": ["openai/gpt-4o-mini"],
                          "system:clock@1.0.0": ["openai/gpt-4o"]}}"#,
            "compat.json",
        )
        .expect("compat");
        let (registry, problems) = Registry::build(&[&source]).with_compat(&compat, |_| true);
        assert!(problems.is_empty(), "{problems:?}");
        let found = |filter: Filter| ids(registry.find(&filter));
        assert_eq!(found(Filter::default()).len(), 4);
        assert_eq!(
            found(Filter {
                namespace: Some("system".into()),
                ..Filter::default()
            }),
            ["system:clock@1.0.0"]
        );
        assert_eq!(
            found(Filter {
                id_prefix: Some("system".into()),
                ..Filter::default()
            }),
            ["system:clock@1.0.0", "systems:probe@1.0.0"]
        );
        assert_eq!(
            found(Filter {
                tag: Some("si".into()),
                ..Filter::default()
            }),
            ["systems:probe@1.0.0", "units:convert@1.0.0"]
        );
        assert_eq!(
            found(Filter {
                category: Some("math".into()),
                ..Filter::default()
            }),
            ["units:convert@1.0.0", "units:round@1.0.0"]
        );
        assert_eq!(
            found(Filter {
                model: Some("openai/gpt-4o-mini".into()),
                ..Filter::default()
            }),
            ["units:convert@1.0.0"]
        );
        // All conditions together.
        assert_eq!(
            found(Filter {
                tag: Some("si".into()),
                category: Some("math".into()),
                ..Filter::default()
            }),
            ["units:convert@1.0.0"]
        );
        assert!(
            found(Filter {
                namespace: Some("units".into()),
                category: Some("utility".into()),
                ..Filter::default()
            })
            .is_empty()
        );
    }

    /// One function name, several tools: a live one before a known one,
    /// then the highest version of a `ns:name`, then the smallest id.
    #[test]
    fn one_entry_per_function_name_live_first_then_newest_then_smallest_id() {
        let known = DirSource::from_tools(
            "dir:test",
            [
                tool_with("alpha:now@3.0.0", "now", "utility", &[]),
                tool_with("clock:now@1.0.0", "now", "utility", &[]),
                tool_with("clock:now@1.10.0", "now", "utility", &[]),
                tool_with("clock:now@1.9.0", "now", "utility", &[]),
                tool_with("clock:other@1.0.0", "other", "utility", &[]),
            ],
        );
        let registry = Registry::build(&[&known]);
        let offered = |r: &Registry, f: &str| r.by_function_name(f).map(|e| e.id().to_string());
        // Nothing live: `alpha:now` (highest version of itself) has the
        // smallest id among the `ns:name`s.
        assert_eq!(
            offered(&registry, "now").as_deref(),
            Some("alpha:now@3.0.0")
        );
        assert_eq!(
            ids(registry.offered()),
            ["alpha:now@3.0.0", "clock:other@1.0.0"]
        );
        assert_eq!(offered(&registry, "nope"), None);

        // Two `clock:now` versions live: the live ones come first, and of
        // them the highest version.
        let live = Live {
            tools: vec![
                tool_with("clock:now@1.0.0", "now", "utility", &[]),
                tool_with("clock:now@1.9.0", "now", "utility", &[]),
            ],
            workers: 1,
        };
        let registry = Registry::build(&[&live, &known]);
        assert_eq!(
            offered(&registry, "now").as_deref(),
            Some("clock:now@1.9.0")
        );
        assert_eq!(
            ids(registry.offered()),
            ["clock:now@1.9.0", "clock:other@1.0.0"]
        );
        // The others are still in the registry by id.
        assert!(registry.get("clock:now@1.10.0").is_some());
        assert_eq!(
            registry
                .get("clock:now")
                .map(|e| e.id().to_string())
                .as_deref(),
            Some("clock:now@1.10.0")
        );
    }

    #[test]
    fn sizes_count_the_entries_kept_per_source() {
        let first = DirSource::from_tools("dir:a", [tool("a:one@1.0.0"), tool("a:two@1.0.0")]);
        let second = Live {
            tools: vec![tool("a:one@1.0.0"), tool("b:three@1.0.0")],
            workers: 1,
        };
        let shadowed = DirSource::from_tools("dir:c", [tool("a:two@1.0.0")]);
        let registry = Registry::build(&[&first, &second, &shadowed]);
        assert_eq!(
            registry.sizes(),
            BTreeMap::from([
                ("dir:a".to_string(), 2),
                ("live".to_string(), 1),
                ("dir:c".to_string(), 0),
            ])
        );
        assert_eq!(registry.duplicates().len(), 2);
    }

    #[test]
    fn a_catalog_is_a_source_of_every_live_tool() {
        // The catalog offers only 1.1.0; the registry still has 1.0.0 by id.
        let catalog = Catalog::from_tools([
            tool("units:convert@1.0.0"),
            tool("units:convert@1.1.0"),
            tool("units:round@1.0.0"),
        ]);
        assert_eq!(ToolSource::name(&catalog), "catalog");
        let registry = Registry::build(&[&catalog]);
        assert_eq!(
            ids(registry.list()),
            [
                "units:convert@1.0.0",
                "units:convert@1.1.0",
                "units:round@1.0.0"
            ]
        );
        assert!(registry.list().all(RegistryEntry::is_live));
        assert_eq!(
            registry
                .by_function_name("convert")
                .map(|e| e.id().to_string())
                .as_deref(),
            Some("units:convert@1.1.0")
        );
        assert_eq!(registry.sizes(), BTreeMap::from([("catalog".into(), 3)]));
    }

    #[test]
    fn a_dir_source_loads_the_shipped_definitions() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tool_definitions");
        let source = DirSource::load(dir).expect("shipped definitions");
        assert_eq!(source.name(), format!("dir:{dir}"));
        let registry = Registry::build(&[&source]);
        assert!(registry.get("system:current_datetime").is_some());
        assert!(
            registry
                .list()
                .all(|e| !e.is_live() && e.families.is_empty())
        );
        let error = DirSource::load(format!("{dir}/nope")).expect_err("no such directory");
        assert!(error.to_string().contains("nope"), "{error}");
    }

    // -- the compat file --

    fn compat_error(text: &str) -> CompatError {
        CompatFile::from_json(text, "compat.json").expect_err(text)
    }

    #[test]
    fn compat_errors_name_the_file_and_the_field() {
        let cases: &[(&str, &str, &str)] = &[
            ("{\"tools\": ", "", "not valid JSON"),
            ("[]", "", "expected an object"),
            ("{}", "tools", "missing"),
            (r#"{"tools": []}"#, "tools", "expected an object"),
            (r#"{"tools": {}, "extra": 1}"#, "extra", "unknown field"),
            (
                r#"{"tools": {"convert": ["a/b"]}}"#,
                r#"tools["convert"]"#,
                "missing ':'",
            ),
            (
                r#"{"tools": {"units:*": ["a/b"]}}"#,
                r#"tools["units:*"]"#,
                "a pattern",
            ),
            (
                r#"{"tools": {"units:convert@1.0": ["a/b"]}}"#,
                r#"tools["units:convert@1.0"]"#,
                "bad version",
            ),
            (
                r#"{"tools": {"units:convert": "a/b"}}"#,
                r#"tools["units:convert"]"#,
                "expected an array",
            ),
            (
                r#"{"tools": {"units:convert": ["a/b", 3]}}"#,
                r#"tools["units:convert"][1]"#,
                "expected a \"provider/model\" string",
            ),
            (
                r#"{"tools": {"units:convert": ["gpt-4o"]}}"#,
                r#"tools["units:convert"][0]"#,
                "\"gpt-4o\" is not a model name",
            ),
            (
                r#"{"tools": {"units:convert": ["openai/"]}}"#,
                r#"tools["units:convert"][0]"#,
                "not a model name",
            ),
            (
                r#"{"tools": {"units:convert": ["/gpt-4o"]}}"#,
                r#"tools["units:convert"][0]"#,
                "not a model name",
            ),
            (
                r#"{"tools": {"units:convert": ["a/b", "openai/gpt 4o"]}}"#,
                r#"tools["units:convert"][1]"#,
                "not a model name",
            ),
            (
                r#"{"tools": {"units:convert": ["a/b", "c/d", "a/b"]}}"#,
                r#"tools["units:convert"][2]"#,
                "\"a/b\" is listed twice (first at index 0)",
            ),
        ];
        for (text, field, expected) in cases {
            let error = compat_error(text);
            assert_eq!(error.origin, "compat.json", "{text}");
            assert_eq!(error.field, *field, "{text}");
            let shown = error.to_string();
            assert!(shown.starts_with("compat.json: "), "{shown}");
            assert!(shown.contains(field), "{shown}");
            assert!(
                shown.contains(expected),
                "{text}: {shown:?} lacks {expected:?}"
            );
        }
        assert!(matches!(
            compat_error(r#"{"tools": {"units:convert": ["a/b", "a/b"]}}"#).problem,
            CompatProblem::DuplicateModel { first: 0, .. }
        ));
    }

    #[test]
    fn a_compat_file_loads_from_disk_and_names_a_missing_one() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("compat.json");
        std::fs::write(
            &path,
            r#"{"$schema": "x", "tools": {"units:convert": ["openai/gpt-4o-mini", "openrouter/meta/llama-3"]}}"#,
        )
        .expect("write");
        let compat = CompatFile::load(&path).expect("loads");
        assert_eq!(compat.origin(), path.display().to_string());
        assert_eq!(
            compat.models(&id("units:convert@4.0.0")),
            Some(
                &[
                    "openai/gpt-4o-mini".to_string(),
                    "openrouter/meta/llama-3".into()
                ][..]
            )
        );
        let missing = dir.path().join("nope.json");
        let error = CompatFile::load(&missing).expect_err("missing");
        assert!(matches!(error.problem, CompatProblem::Io(_)));
        assert!(
            error.to_string().contains(&missing.display().to_string()),
            "{error}"
        );
        let error = {
            std::fs::write(&path, r#"{"tools": {"units:convert": ["x"]}}"#).expect("write");
            CompatFile::load(&path).expect_err("bad model")
        };
        assert!(
            error.to_string().starts_with(&format!(
                "{}: at tools[\"units:convert\"][0]",
                path.display()
            )),
            "{error}"
        );
    }

    #[test]
    fn check_reports_unknown_tools_and_models_each_once() {
        let registry = registry(&["units:convert@1.0.0", "units:round@2.0.0"]);
        let compat = CompatFile::from_json(
            r#"{"tools": {
                "units:convert": ["openai/gpt-4o-mini", "acme/unknown"],
                "units:round@1.0.0": ["openai/gpt-4o"],
                "units:gone": []
            }}"#,
            "compat.json",
        )
        .expect("compat");
        let known = |m: &str| m.starts_with("openai/");
        let problems = compat.check(known, &registry);
        let shown: Vec<String> = problems.iter().map(ToString::to_string).collect();
        assert_eq!(
            shown,
            [
                "compat.json: at tools[\"units:convert\"][1]: unknown model \"acme/unknown\"",
                "compat.json: at tools[\"units:gone\"]: no tool in the registry is units:gone",
                "compat.json: at tools[\"units:round@1.0.0\"]: no tool in the registry is units:round@1.0.0",
            ]
        );
        assert!(matches!(
            problems[0].problem,
            CompatProblem::UnknownModel { .. }
        ));
        assert_eq!(compat.check(|_| true, &registry).len(), 2);
    }

    /// The models of a tool: its full id's list over its `ns:name`'s,
    /// unknown models left out, empty when the file names it not.
    #[test]
    fn models_for_takes_the_most_precise_list_of_known_models() {
        let registry = registry(&[
            "llm:summarize@1.0.0",
            "llm:summarize@2.0.0",
            "units:convert@1.0.0",
        ]);
        let compat = CompatFile::from_json(
            r#"{"tools": {
                "llm:summarize@1.0.0": ["openai/gpt-4o-mini", "openai/gpt-4o"],
                "llm:summarize": ["acme/cheap", "openai/gpt-4o"]
            }}"#,
            "compat.json",
        )
        .expect("compat");
        assert!(
            registry.models_for(&id("llm:summarize@1.0.0")).is_empty(),
            "nothing before a compat file is attached"
        );
        let (registry, problems) = registry.with_compat(&compat, |m| m != "acme/cheap");
        assert_eq!(problems.len(), 1, "{problems:?}");
        assert_eq!(problems[0].field, "tools[\"llm:summarize\"][0]");
        assert_eq!(
            registry.models_for(&id("llm:summarize@1.0.0")),
            ["openai/gpt-4o-mini", "openai/gpt-4o"]
        );
        assert_eq!(
            registry.models_for(&id("llm:summarize@2.0.0")),
            ["openai/gpt-4o"]
        );
        assert!(registry.models_for(&id("units:convert@1.0.0")).is_empty());
        assert!(registry.models_for(&id("llm:summarize@9.0.0")).is_empty());
    }
}
