//! [`Worker`] and its builder: which tools a worker serves, with which
//! definitions and hooks.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use prometheus::core::Collector;
use toolfleet_protocol::schema::SchemaError;
use toolfleet_protocol::tools::{self, CompiledTool, ToolDefinition};

use crate::hooks::{HookSet, Hooks};
use crate::output::OutputCheck;
use crate::tool::{DynTool, Tool};

/// A worker could not be built or could not serve.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WorkerError {
    /// The worker's definitions, tools or settings do not fit together.
    #[error("configuration: {0}")]
    Config(String),
    /// NATS refused a stream, consumer, bucket or endpoint.
    #[error("NATS: {0}")]
    Nats(String),
}

/// One tool as a worker serves it: its checked, compiled definition and the
/// implementation.
pub(crate) struct Served {
    pub(crate) tool: Arc<CompiledTool>,
    pub(crate) imp: Arc<dyn DynTool>,
    /// The definition's `outputSchema`, compiled once like the arguments'.
    pub(crate) output: Option<OutputCheck>,
    /// The tool's id as text: its label in metrics and logs.
    label: String,
}

impl Served {
    /// `imp` serving the definition of `tool`, its `outputSchema` compiled.
    pub(crate) fn new(tool: CompiledTool, imp: Arc<dyn DynTool>) -> Result<Self, SchemaError> {
        Ok(Self {
            label: tool.definition.id.to_string(),
            output: OutputCheck::of(&tool.definition)?,
            tool: Arc::new(tool),
            imp,
        })
    }

    pub(crate) fn definition(&self) -> &ToolDefinition {
        &self.tool.definition
    }

    /// The tool's id as text (made once, not per call).
    pub(crate) fn label(&self) -> &str {
        &self.label
    }
}

/// A set of tools ready to serve: built once by [`Worker::builder`], then
/// run with [`Worker::run`] or, for a whole process, [`Worker::serve`].
pub struct Worker {
    pub(crate) name: String,
    pub(crate) tools: Vec<Arc<Served>>,
    pub(crate) hooks: Arc<HookSet>,
    pub(crate) collectors: Vec<Box<dyn Collector>>,
    pub(crate) reload: Option<Reload>,
    pub(crate) readiness: Vec<(String, Readiness)>,
}

/// A readiness check of a worker's own (see [`WorkerBuilder::readiness`]).
pub type Readiness =
    Arc<dyn Fn() -> futures::future::BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// Builds a worker's next tool set (see [`WorkerBuilder::reload_on`]).
pub type Rebuild =
    Arc<dyn Fn() -> futures::future::BoxFuture<'static, Result<Worker, String>> + Send + Sync>;

/// When and how a served worker changes its tool set.
#[derive(Clone)]
pub struct Reload {
    pub(crate) when: Arc<tokio::sync::Notify>,
    pub(crate) rebuild: Rebuild,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("name", &self.name)
            .field(
                "tools",
                &self
                    .tools
                    .iter()
                    .map(|t| t.definition().id.to_string())
                    .collect::<Vec<_>>(),
            )
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// Starts a worker named `name` (its family, e.g. `system`; shown in the
    /// services API, logs and the catalog).
    pub fn builder(name: impl Into<String>) -> WorkerBuilder {
        WorkerBuilder {
            name: name.into(),
            definitions: Vec::new(),
            impls: Vec::new(),
            hooks: Vec::new(),
            collectors: Vec::new(),
            problems: Vec::new(),
            secrets: Vec::new(),
            reload: None,
            readiness: Vec::new(),
        }
    }

    /// The worker's name (its family), as given to [`Worker::builder`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The definitions of the tools this worker serves.
    pub fn definitions(&self) -> impl Iterator<Item = &ToolDefinition> {
        self.tools.iter().map(|t| t.definition())
    }

    /// Registers the family's own metrics (see [`WorkerBuilder::metrics`])
    /// on the process's registry. [`Worker::serve`] and the one-process
    /// fleet do this; call it when running a worker yourself.
    ///
    /// # Errors
    ///
    /// A metric already registered under the same name.
    pub fn register_metrics(&mut self, registry: &prometheus::Registry) -> prometheus::Result<()> {
        for collector in self.collectors.drain(..) {
            registry.register(collector)?;
        }
        Ok(())
    }
}

/// Builds a [`Worker`]: definitions (from files or in code), one
/// implementation per `implementationKey`, hooks.
pub struct WorkerBuilder {
    name: String,
    definitions: Vec<ToolDefinition>,
    impls: Vec<(String, Arc<dyn DynTool>)>,
    hooks: Vec<Arc<dyn Hooks>>,
    collectors: Vec<Box<dyn Collector>>,
    problems: Vec<String>,
    secrets: Vec<crate::Secret>,
    reload: Option<Reload>,
    readiness: Vec<(String, Readiness)>,
}

impl WorkerBuilder {
    /// For tools whose list changes while the worker runs (an MCP server's):
    /// each time `when` is notified, a worker served as a process
    /// ([`Worker::serve`]) builds its next tool set with `rebuild`, starts
    /// it beside the current one, then drains the current one — jobs keep
    /// flowing, a removed tool's jobs wait in its consumer, a new tool is
    /// advertised. A rebuild that fails leaves the current set serving.
    /// (Metric collectors of the rebuilt worker are not registered again.)
    pub fn reload_on(
        mut self,
        when: Arc<tokio::sync::Notify>,
        rebuild: impl Fn() -> futures::future::BoxFuture<'static, Result<Worker, String>>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.reload = Some(Reload {
            when,
            rebuild: Arc::new(rebuild),
        });
        self
    }

    /// A readiness check of the worker's own, beside NATS, Redis and the
    /// consumers (say its backing store: a cheap query): `/readyz` of a
    /// worker served as a process ([`Worker::serve`]) answers 503 naming
    /// `name` while `check` fails. Keep it cheap; it runs at every probe,
    /// under the health module's timeout.
    pub fn readiness(
        mut self,
        name: impl Into<String>,
        check: impl Fn() -> futures::future::BoxFuture<'static, Result<(), String>>
        + Send
        + Sync
        + 'static,
    ) -> Self {
        self.readiness.push((name.into(), Arc::new(check)));
        self
    }

    /// Every definition file in `dir`. Definitions whose
    /// `implementationKey` this worker has no tool for are ignored (they
    /// belong to other workers).
    pub fn definitions_dir(mut self, dir: impl AsRef<Path>) -> Self {
        match tools::load_dir(dir.as_ref()) {
            Ok(defs) => self.definitions.extend(defs),
            Err(e) => self.problems.push(e.to_string()),
        }
        self
    }

    /// One definition file.
    pub fn definition_file(mut self, path: impl AsRef<Path>) -> Self {
        match tools::load_file(path.as_ref()) {
            Ok(def) => self.definitions.push(def),
            Err(e) => self.problems.push(e.to_string()),
        }
        self
    }

    /// One definition from JSON text, e.g. `include_str!` of the tool's
    /// file, so the binary carries its definition (checked like a file).
    pub fn definition_json(mut self, json: &str) -> Self {
        let parsed = serde_json::from_str(json)
            .map_err(|e| format!("definition JSON: {e}"))
            .and_then(|value| {
                ToolDefinition::from_value(value, tools::Origin::Named("definition JSON".into()))
                    .map_err(|e| e.to_string())
            });
        match parsed {
            Ok(def) => self.definitions.push(def),
            Err(e) => self.problems.push(e),
        }
        self
    }

    /// One definition built in code (checked like a file when the worker
    /// is built).
    pub fn definition(mut self, definition: ToolDefinition) -> Self {
        self.definitions.push(definition);
        self
    }

    /// Serves `tool` for every definition whose `implementationKey` is
    /// `implementation_key` (several versions of a tool may share one).
    pub fn tool<T: Tool>(mut self, implementation_key: impl Into<String>, tool: T) -> Self {
        self.impls.push((implementation_key.into(), Arc::new(tool)));
        self
    }

    /// Adds hooks; they run after the built-in policies, in the order
    /// added. An `Arc<H>` is hooks too, for hooks the caller also reads.
    pub fn hooks(mut self, hooks: impl Hooks) -> Self {
        self.hooks.push(Arc::new(hooks));
        self
    }

    /// Secrets the tools hold (API keys from their settings,
    /// [`crate::ToolSettings::secrets`]): scrubbed from every result,
    /// reference, progress message and error the worker publishes, so a
    /// backend that echoes one back cannot leak it through a tool.
    pub fn secrets<'a>(mut self, secrets: impl IntoIterator<Item = &'a crate::Secret>) -> Self {
        self.secrets.extend(secrets.into_iter().cloned());
        self
    }

    /// A metric of the family's own (a clone of one its tools update),
    /// registered on the process's registry by [`Worker::register_metrics`]
    /// ([`Worker::serve`] and the one-process fleet call it). Name it
    /// `toolfleet_<family>_…` and keep its labels bounded.
    pub fn metrics(mut self, collector: impl Collector + 'static) -> Self {
        self.collectors.push(Box::new(collector));
        self
    }

    /// Checks that every tool has a definition and compiles them.
    ///
    /// # Errors
    ///
    /// [`WorkerError::Config`] naming every problem: unreadable or invalid
    /// definitions, a tool without a definition, two definitions with one
    /// id, a worker without tools.
    pub fn build(self) -> Result<Worker, WorkerError> {
        let mut problems = self.problems;
        if self.impls.is_empty() {
            problems.push(format!("worker {:?} has no tools", self.name));
        }
        let mut seen = HashSet::new();
        let mut served = Vec::new();
        for (key, imp) in &self.impls {
            let mut found = false;
            for def in self
                .definitions
                .iter()
                .filter(|d| &d.implementation_key == key)
            {
                found = true;
                if !seen.insert(def.id.clone()) {
                    problems.push(format!("{} is defined twice", def.id));
                    continue;
                }
                // The model calls tools by function name: two tools of one
                // worker must not share one.
                if let Some(other) = served
                    .iter()
                    .find(|s: &&Arc<Served>| s.definition().function.name == def.function.name)
                {
                    problems.push(format!(
                        "{} and {} share the function name {:?}",
                        other.definition().id,
                        def.id,
                        def.function.name
                    ));
                    continue;
                }
                let compiled = CompiledTool::new(def.clone()).map_err(|e| e.to_string());
                match compiled.and_then(|tool| {
                    Served::new(tool, imp.clone())
                        .map_err(|e| format!("{}: outputSchema: {e}", def.id))
                }) {
                    Ok(tool) => served.push(Arc::new(tool)),
                    Err(e) => problems.push(e),
                }
            }
            if !found {
                problems.push(format!("no tool definition has implementationKey {key:?}"));
            }
        }
        if !problems.is_empty() {
            return Err(WorkerError::Config(format!(
                "worker {:?}: {}",
                self.name,
                problems.join("; ")
            )));
        }
        Ok(Worker {
            name: self.name,
            tools: served,
            hooks: Arc::new(HookSet::with_scrubber(
                self.hooks,
                crate::settings::Scrubber::new(self.secrets),
            )),
            collectors: self.collectors,
            reload: self.reload,
            readiness: self.readiness,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ToolCtx, ToolError, ToolOutput};

    struct Nop;

    impl Tool for Nop {
        type Args = serde_json::Value;
        async fn call(&self, _: &ToolCtx, _: serde_json::Value) -> Result<ToolOutput, ToolError> {
            Ok(ToolOutput::text("ok"))
        }
    }

    const DEFINITION: &str = include_str!("../../../tool_definitions/system.current_datetime.json");

    fn definition(version: (u32, u32, u32)) -> ToolDefinition {
        let mut value: serde_json::Value = serde_json::from_str(DEFINITION).unwrap();
        value["id"] = format!(
            "system:current_datetime@{}.{}.{}",
            version.0, version.1, version.2
        )
        .into();
        ToolDefinition::from_value(value, tools::Origin::Named("test".into())).unwrap()
    }

    #[test]
    fn a_definition_from_json_text_is_served() {
        let worker = Worker::builder("t")
            .definition_json(DEFINITION)
            .tool("system.current_datetime", Nop)
            .build()
            .unwrap();
        let ids: Vec<String> = worker.definitions().map(|d| d.id.to_string()).collect();
        assert_eq!(ids, ["system:current_datetime@1.0.0"]);
        let err = Worker::builder("t")
            .definition_json("{not json")
            .tool("system.current_datetime", Nop)
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("definition JSON"), "{err}");
    }

    #[test]
    fn two_tools_of_one_worker_may_not_share_a_function_name() {
        let err = Worker::builder("t")
            .definition(definition((1, 0, 0)))
            .definition(definition((1, 1, 0)))
            .tool("system.current_datetime", Nop)
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("share the function name"), "{err}");
    }

    #[test]
    fn a_tool_without_a_definition_and_a_worker_without_tools_are_refused() {
        let err = Worker::builder("t")
            .definition(definition((1, 0, 0)))
            .tool("system.nope", Nop)
            .build()
            .unwrap_err();
        assert!(err.to_string().contains("\"system.nope\""), "{err}");
        let err = Worker::builder("t").build().unwrap_err();
        assert!(err.to_string().contains("has no tools"), "{err}");
    }
}
