//! `toolfleet-worker-llm`: serves the declarative LLM tools of the
//! definitions directory (llm:summarize, llm:classify, …,
//! content:generate_chart) against the fleet's model deployments — the
//! same `--config` file the orchestrator reads. Start more copies to scale
//! the pool. Configured by flags and `TOOLFLEET_*` environment variables.

use std::path::PathBuf;

use toolfleet_worker::WorkerError;
use toolfleet_worker::protocol::registry::CompatFile;
use toolfleet_worker_llm::{DEFAULT_MAX_REPLY_CHARS, Settings};

/// The LLM tools worker's own settings.
#[derive(clap::Args, Debug, Clone)]
struct LlmToolArgs {
    #[command(flatten)]
    llm: toolfleet_llm::args::LlmArgs,
    /// Recommended models per tool (the orchestrator's `--tool-compat`
    /// file: `{"tools": {"<tool id or ns:name>": ["<deployment>/<model>",
    /// ...]}}`), tried before a tool's own preference.
    #[arg(long, env = "TOOLFLEET_TOOL_COMPAT", value_name = "FILE")]
    tool_compat: Option<PathBuf>,
    /// `deployment/model` for tools that name no model; default: the
    /// default profile's first deployment and its model.
    #[arg(long, env = "TOOLFLEET_LLM_DEFAULT_MODEL")]
    default_model: Option<String>,
    /// A reply longer than this many characters is cut with a notice (a
    /// `json` tool's fails and the next model is tried).
    #[arg(long, env = "TOOLFLEET_LLM_MAX_REPLY_CHARS", default_value_t = DEFAULT_MAX_REPLY_CHARS)]
    max_reply_chars: usize,
    /// `deployment/model` of the image model for content:generate_image
    /// (e.g. `openai/gpt-image-1`); without one (and none in its
    /// definition or the compat file) that tool is not served.
    #[arg(long, env = "TOOLFLEET_IMAGE_MODEL")]
    image_model: Option<String>,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    toolfleet_worker::process::main(
        "toolfleet-worker-llm",
        toolfleet_worker::build_info!(),
        "toolfleet worker: serves declarative LLM tools (summarize, classify, charts, …).",
        "0.0.0.0:9467",
        async |args, own: &LlmToolArgs| {
            let config = own
                .llm
                .model_config()
                .map_err(|e| WorkerError::Config(e.to_string()))?;
            let compat = match &own.tool_compat {
                Some(path) => Some(std::sync::Arc::new(
                    CompatFile::load(path).map_err(|e| WorkerError::Config(e.to_string()))?,
                )),
                None => None,
            };
            let settings = Settings {
                compat,
                default_model: own
                    .default_model
                    .clone()
                    .or_else(|| toolfleet_worker_llm::default_model_of(&config)),
                max_reply_chars: own.max_reply_chars,
                image_model: own.image_model.clone(),
            };
            toolfleet_worker_llm::worker(
                &args.defs.dir,
                &config,
                &toolfleet_llm::deployments::ProcessEnv,
                &settings,
            )
        },
    )
    .await
}
