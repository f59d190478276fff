//! The tool families `toolfleet up`, the demo and the bench start in one
//! process. Adding a family to those commands is one entry here; nothing
//! else in the workspace's generic assembly names a family.

use std::path::Path;

use anyhow::Context;
use toolfleet_config::FleetConfig;
use toolfleet_llm::deployments::ProcessEnv;
use toolfleet_worker::Worker;

pub use toolfleet_worker_retrieval::IndexArgs;

/// The families this command ships, by name.
pub const NAMES: &[&str] = &[
    toolfleet_worker_system::FAMILY,
    toolfleet_worker_retrieval::FAMILY,
    toolfleet_worker_llm::FAMILY,
];

/// What the families are built from.
pub struct Inputs<'a> {
    /// The definitions directory.
    pub definitions: &'a Path,
    /// The retrieval family's index.
    pub index: &'a IndexArgs,
    /// The model deployments the LLM tools family calls (keys from the
    /// environment); without them that family is not started.
    pub models: Option<&'a FleetConfig>,
}

/// Every family this command ships (the LLM tools family only when
/// `inputs.models` is given).
pub async fn all(inputs: &Inputs<'_>) -> anyhow::Result<Vec<Worker>> {
    let names: Vec<&str> = NAMES
        .iter()
        .copied()
        .filter(|name| *name != toolfleet_worker_llm::FAMILY || inputs.models.is_some())
        .collect();
    some(&names, inputs).await
}

/// The named families; the index is opened (and seeded) only when the
/// retrieval family is among them.
pub async fn some(names: &[&str], inputs: &Inputs<'_>) -> anyhow::Result<Vec<Worker>> {
    let mut workers = Vec::with_capacity(names.len());
    for name in names {
        workers.push(family(name, inputs).await?);
    }
    Ok(workers)
}

async fn family(name: &str, inputs: &Inputs<'_>) -> anyhow::Result<Worker> {
    let definitions = inputs.definitions;
    match name {
        toolfleet_worker_system::FAMILY => Ok(toolfleet_worker_system::worker(definitions)?),
        toolfleet_worker_retrieval::FAMILY => {
            let index = inputs.index;
            let store = toolfleet_worker_retrieval::open_and_seed(index)
                .await
                .map_err(anyhow::Error::msg)
                .with_context(|| {
                    format!(
                        "opening the index ({:?}; corpus {})",
                        index.backend,
                        index.corpus_dir.display()
                    )
                })?;
            let embedder = index.embedder().map_err(anyhow::Error::msg)?;
            Ok(toolfleet_worker_retrieval::worker(
                definitions,
                store,
                embedder,
            )?)
        }
        toolfleet_worker_llm::FAMILY => {
            let models = inputs
                .models
                .context("the LLM tools family needs the model deployments (--config or --llm-*)")?
                .models();
            let settings = toolfleet_worker_llm::Settings {
                default_model: toolfleet_worker_llm::default_model_of(&models),
                ..toolfleet_worker_llm::Settings::default()
            };
            Ok(toolfleet_worker_llm::worker(
                definitions,
                &models,
                &ProcessEnv,
                &settings,
            )?)
        }
        other => anyhow::bail!("no tool family named {other:?} (known: {NAMES:?})"),
    }
}

/// The web family (`web:search`, `web:read_page`), with the tools'
/// settings from `settings` (TOML, a table per tool; none: every setting's
/// default, DuckDuckGo for search) and secrets from the environment. Not
/// among [`NAMES`]: it reaches the internet, which the demo and the bench
/// must not need; `toolfleet up` starts it.
pub fn web(definitions: &Path, settings: Option<&Path>) -> anyhow::Result<Worker> {
    let settings = match settings {
        Some(path) => toolfleet_worker::settings::SettingsFile::load(path)
            .with_context(|| format!("the web tools' settings ({})", path.display()))?,
        None => toolfleet_worker::settings::SettingsFile::empty(),
    };
    Ok(toolfleet_worker_web::worker(
        definitions,
        &settings,
        &toolfleet_worker::settings::ProcessSecrets,
        &toolfleet_worker_web::Network::default(),
    )?)
}
