//! `toolfleet-worker-web`: serves web:search and web:read_page under the
//! SSRF policy of its settings. Start more copies to scale the pool.
//! Configured by flags and `TOOLFLEET_*` environment variables; the tools'
//! settings come from `--settings` (TOML, one table per tool) and secrets
//! from the environment or files.

use std::path::PathBuf;

use toolfleet_worker::settings::{ProcessSecrets, SettingsFile};

/// The web worker's own settings.
#[derive(clap::Args, Debug, Clone)]
struct WebArgs {
    /// The tools' settings: TOML with a table per tool (`["web:search"]`,
    /// `["web:read_page"]`); without it every setting has its default.
    #[arg(long, env = "TOOLFLEET_TOOL_SETTINGS", value_name = "FILE")]
    settings: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    toolfleet_worker::process::main(
        "toolfleet-worker-web",
        toolfleet_worker::build_info!(),
        "toolfleet worker: serves web:search and web:read_page (SSRF-safe).",
        "0.0.0.0:9468",
        async |args, own: &WebArgs| {
            let settings = match &own.settings {
                Some(path) => SettingsFile::load(path)
                    .map_err(|e| toolfleet_worker::WorkerError::Config(e.to_string()))?,
                None => SettingsFile::empty(),
            };
            toolfleet_worker_web::worker(
                &args.defs.dir,
                &settings,
                &ProcessSecrets,
                &toolfleet_worker_web::Network::default(),
            )
        },
    )
    .await
}
