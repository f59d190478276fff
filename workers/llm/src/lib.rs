//! toolfleet-worker-llm: the LLM tools family — tools declared in a
//! definition file alone (`systemPrompt`, `userTemplate`, `outputFormat`,
//! `outputSchema`, `outputExample`, `variants`, `modelPreference`) and run
//! against the fleet's model deployments, with fallback across models.
//! Written against the worker SDK and the LLM client crate.
//!
//! - [`prompt`]: a definition's prompts, compiled at start (a template
//!   naming a variable the input schema lacks is refused with the file and
//!   field) and rendered from the validated arguments, defaults filled in;
//! - [`variant`]: which variant serves a `provider/model`;
//! - [`models`]: the order models are tried in (compat file, preferred,
//!   fallbacks, else the worker's default);
//! - [`providers`]: one pooled client per deployment, and which keys are
//!   missing;
//! - [`fallback`]: trying the models in turn, with the attempt and fallback
//!   hooks, `fallback` warnings and the `fallback_exhausted` summary;
//! - [`reply`]: a `json` reply parsed, code fences stripped;
//! - [`tool`]: the tool itself — the JSON-only instruction, the reply cap,
//!   the output-schema check, the spend reported with the result.
//!
//! Every definition of the directory that declares a prompt is served
//! (whatever its `implementationKey`); the others belong to other families.

pub mod fallback;
pub mod image;
pub mod models;
pub mod prompt;
pub mod providers;
pub mod reply;
pub mod tool;
pub mod variant;

use std::collections::{BTreeSet, HashMap};
use std::path::Path;
use std::sync::Arc;

use toolfleet_llm::deployments::EnvSource;
use toolfleet_llm::model_config::ModelConfig;
use toolfleet_worker::protocol::tools::{self, ToolDefinition};
use toolfleet_worker::{Worker, WorkerError};

pub use providers::Providers;
pub use tool::{DEFAULT_MAX_REPLY_CHARS, LlmTool, Settings};

/// The family name (the worker's name in the catalog and services API).
pub const FAMILY: &str = "llm";

/// The `implementationKey` of `content:generate_chart`: its answer must
/// validate against [`chart_schema`] (a mismatch fails the attempt and
/// moves on to the next model, instead of a warning).
pub const CHART_KEY: &str = "content.generate_chart";

/// `schemas/chart_config.schema.json`: a Chart.js configuration.
#[must_use]
pub fn chart_schema() -> serde_json::Value {
    serde_json::from_str(include_str!("../../../schemas/chart_config.schema.json"))
        .unwrap_or(serde_json::Value::Bool(false))
}

/// The worker's default model when none is given: the default profile's
/// first deployment and its model (`deployment/model`).
#[must_use]
pub fn default_model_of(config: &ModelConfig) -> Option<String> {
    let (name, deployment) = config.default_deployment()?;
    Some(format!("{name}/{}", deployment.model))
}

/// Whether `definition` is a declarative LLM tool: it has a prompt.
#[must_use]
pub fn is_declarative(definition: &ToolDefinition) -> bool {
    definition.user_template.is_some() || definition.system_prompt.is_some()
}

/// The LLM tools worker: every declarative definition in `definitions`,
/// run against the deployments of `config` (keys from `env`).
///
/// # Errors
///
/// As [`llm_tool`], and a directory without declarative tools.
pub fn worker(
    definitions: &Path,
    config: &ModelConfig,
    env: &dyn EnvSource,
    settings: &Settings,
) -> Result<Worker, WorkerError> {
    let (tool, served) = llm_tool(definitions, config, env, settings)?;
    let keys: BTreeSet<String> = served
        .iter()
        .map(|d| d.implementation_key.clone())
        .collect();
    let mut builder = Worker::builder(FAMILY);
    if let Some((image, definition)) = image_tool(definitions, &tool.providers, settings)? {
        builder = builder.definition(definition).tool(image::IMAGE_KEY, image);
    }
    for definition in served {
        builder = builder.definition(definition);
    }
    for key in keys {
        builder = builder.tool(key, tool.clone());
    }
    builder.build()
}

/// `content:generate_image` with its definition from `definitions`, when
/// the directory has it and it has models: the compat file's, its
/// `modelPreference`, else [`Settings::image_model`]. `None` (with a log
/// line) when it has none: the tool is then not served.
///
/// # Errors
///
/// A model of no configured deployment, naming the file and field.
pub fn image_tool(
    definitions: &Path,
    providers: &Arc<Providers>,
    settings: &Settings,
) -> Result<Option<(image::GenerateImage, ToolDefinition)>, WorkerError> {
    let files =
        tools::load_dir_files(definitions).map_err(|e| WorkerError::Config(e.to_string()))?;
    let Some((path, definition)) = files
        .into_iter()
        .find(|(_, d)| d.implementation_key == image::IMAGE_KEY)
    else {
        return Ok(None);
    };
    let fail = |field: &str, model: &str| {
        WorkerError::Config(format!(
            "{}: {}: {field}: {model:?} is not provider/model with a deployment of the \
             configuration as provider (deployments: {})",
            path.display(),
            definition.id,
            providers.names()
        ))
    };
    let known = |m: &str| providers::split_model(m).is_some_and(|(p, _)| providers.knows(p));
    let preference = definition.model_preference.as_ref();
    if let Some(p) = preference {
        if let Some(m) = p.preferred_model.as_deref().filter(|m| !known(m)) {
            return Err(fail("modelPreference.preferredModel", m));
        }
        for (i, m) in p.fallback_models.iter().enumerate() {
            if !known(m) {
                return Err(fail(&format!("modelPreference.fallbackModels[{i}]"), m));
            }
        }
    }
    if let Some(m) = settings.image_model.as_deref().filter(|m| !known(m)) {
        return Err(WorkerError::Config(format!(
            "image model {m:?}: expected provider/model with a deployment of the configuration \
             as provider (deployments: {})",
            providers.names()
        )));
    }
    let recommended: Vec<String> = settings
        .compat
        .as_ref()
        .and_then(|c| c.models(&definition.id))
        .unwrap_or_default()
        .iter()
        .filter(|m| known(m))
        .cloned()
        .collect();
    let models = models::resolve(&recommended, preference, settings.image_model.as_deref());
    if models.is_empty() {
        tracing::info!(tool = %definition.id,
            "not served: no image model (give the worker --image-model provider/model)");
        return Ok(None);
    }
    Ok(Some((
        image::GenerateImage {
            providers: providers.clone(),
            models: Arc::new(models),
        },
        definition,
    )))
}

/// The tool serving every declarative definition in `definitions`, and
/// those definitions (for a worker of your own, or a test).
///
/// # Errors
///
/// [`WorkerError::Config`] naming the file and field of the first
/// definition that cannot be served (a template naming a variable the
/// input schema lacks, a model of no configured deployment, no model at
/// all), an unreadable directory, or a default model of no deployment.
pub fn llm_tool(
    definitions: &Path,
    config: &ModelConfig,
    env: &dyn EnvSource,
    settings: &Settings,
) -> Result<(LlmTool, Vec<ToolDefinition>), WorkerError> {
    let files =
        tools::load_dir_files(definitions).map_err(|e| WorkerError::Config(e.to_string()))?;
    let providers = Providers::new(config, env).map_err(WorkerError::Config)?;
    if let Some(default) = &settings.default_model {
        let known = providers::split_model(default).is_some_and(|(p, _)| providers.knows(p));
        if !known {
            return Err(WorkerError::Config(format!(
                "default model {default:?}: expected provider/model with a deployment of the \
                 configuration as provider (deployments: {})",
                providers.names()
            )));
        }
    }
    let mut declared = HashMap::new();
    let mut served = Vec::new();
    for (path, definition) in files {
        if !is_declarative(&definition) {
            continue;
        }
        let strict = (definition.implementation_key == CHART_KEY).then(chart_schema);
        let compiled = tool::Declared::new(&definition, &providers, settings, strict.as_ref())
            .map_err(|e| {
                WorkerError::Config(format!(
                    "{}: {}: {}: {}",
                    path.display(),
                    definition.id,
                    e.field,
                    e.message
                ))
            })?;
        declared.insert(definition.id.clone(), Arc::new(compiled));
        served.push(definition);
    }
    let tool = LlmTool {
        providers: Arc::new(providers),
        tools: Arc::new(declared),
        max_reply_chars: settings.max_reply_chars,
    };
    Ok((tool, served))
}
