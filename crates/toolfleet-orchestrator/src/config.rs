//! [`OrchestratorConfig`]: everything an orchestrator process is started
//! with — its [`Settings`] (read through `Deref`, so `config.max_in_flight`
//! works as a field) and what a deployment registers: orchestrators by the
//! name a profile gives, and context handlers.

use std::ops::{Deref, DerefMut};

use toolfleet_config::FleetConfig;
use toolfleet_protocol::Subjects;

use crate::context::{ContextHandler, ContextHandlers};
use crate::intake::Plugins;
use crate::{Orchestrator, Settings};

/// How the orchestrator runs. Model endpoints, prompts and loop policies
/// come from the profiles ([`FleetConfig`]), resolved per chat job; the
/// profile's `orchestrator` names one of the orchestrators
/// [registered](Self::register_orchestrator) here.
#[derive(Clone)]
pub struct OrchestratorConfig {
    settings: Settings,
    plugins: Plugins,
}

impl Deref for OrchestratorConfig {
    type Target = Settings;

    fn deref(&self) -> &Settings {
        &self.settings
    }
}

impl DerefMut for OrchestratorConfig {
    fn deref_mut(&mut self) -> &mut Settings {
        &mut self.settings
    }
}

impl std::fmt::Debug for OrchestratorConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrchestratorConfig")
            .field("settings", &self.settings)
            .field("orchestrators", &self.orchestrator_names())
            .field("context_handlers", &self.plugins.context)
            .finish()
    }
}

impl OrchestratorConfig {
    /// The defaults for `subjects` and `profiles`, with [`Agentic`](crate::Agentic)
    /// registered as `agentic` and the built-in context handlers.
    pub fn new(subjects: Subjects, profiles: FleetConfig) -> Self {
        Self {
            settings: Settings::new(subjects, profiles),
            plugins: Plugins::default(),
        }
    }

    /// Registers `orchestrator` under `name`: a profile with
    /// `orchestrator = "<name>"` then runs with it. Registering a name again
    /// replaces the earlier one (`agentic` included).
    pub fn register_orchestrator(
        &mut self,
        name: impl Into<String>,
        orchestrator: impl Orchestrator,
    ) -> &mut Self {
        self.plugins.register_orchestrator(name, orchestrator);
        self
    }

    /// The registered orchestrator names, sorted.
    pub fn orchestrator_names(&self) -> Vec<&str> {
        self.plugins.names()
    }

    /// The orchestrator registered under `name`.
    pub fn orchestrator(&self, name: &str) -> Option<std::sync::Arc<dyn Orchestrator>> {
        self.plugins.orchestrator(name)
    }

    /// Adds a context handler after the built-ins: it runs on every new
    /// invocation once preemptive retrieval is done, before the model's
    /// first call.
    pub fn register_context_handler(&mut self, handler: impl ContextHandler) -> &mut Self {
        self.plugins.context.push(handler);
        self
    }

    /// The context handlers, in order, to put one at a place among them.
    pub fn context_handlers_mut(&mut self) -> &mut ContextHandlers {
        &mut self.plugins.context
    }

    /// The settings and the registered parts, apart.
    pub(crate) fn into_parts(self) -> (Settings, Plugins) {
        (self.settings, self.plugins)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Agentic;
    use toolfleet_config::DEFAULT_ORCHESTRATOR;

    fn config() -> OrchestratorConfig {
        let profiles = FleetConfig::from_toml(
            r#"
default_profile = "default"
[deployments.d]
base_url = "http://127.0.0.1:9/v1"
model = "m"
[profiles.default]
deployment = "d"
[profiles.custom]
deployment = "d"
orchestrator = "custom"
"#,
            "test",
        )
        .expect("profiles");
        OrchestratorConfig::new(Subjects::new("toolfleet").expect("prefix"), profiles)
    }

    #[test]
    fn agentic_is_registered_by_default_and_more_can_be_registered() {
        let mut config = config();
        assert_eq!(config.orchestrator_names(), [DEFAULT_ORCHESTRATOR]);
        let unknown = config.profiles.warnings_among(&config.orchestrator_names());
        assert!(
            unknown.iter().any(|w| w.contains("\"custom\"")),
            "{unknown:?}"
        );

        config.register_orchestrator("custom", Agentic);
        assert_eq!(config.orchestrator_names(), ["agentic", "custom"]);
        assert!(config.orchestrator("custom").is_some());
        assert!(config.orchestrator("swarm").is_none());
        // A registered name is no longer worth a warning.
        let warnings = config.profiles.warnings_among(&config.orchestrator_names());
        assert!(warnings.is_empty(), "{warnings:?}");
        assert!(format!("{config:?}").contains("custom"));
    }
}
