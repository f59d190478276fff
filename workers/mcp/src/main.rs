//! `toolfleet-worker-mcp`: serves the tools of the MCP servers named in its
//! configuration file (`--mcp-config`, `TOOLFLEET_MCP_CONFIG`; see
//! `toolfleet_worker_mcp::config`). Start more copies to scale the pool.
//! When a server says its tool list changed (or comes back after dying),
//! the worker lists it again and serves the new set. Before anything else
//! the worker empties its `/proc/<pid>/environ` (keeping its variables on
//! the heap) and makes itself non-dumpable, so its children find no
//! credential there or in its memory; their stderr is logged scrubbed of
//! its secrets.

use std::path::PathBuf;
use std::sync::Arc;

/// This family's own settings.
#[derive(clap::Args, Debug)]
struct McpArgs {
    /// The MCP servers to import (TOML, `[servers.<name>]` tables).
    #[arg(long, env = "TOOLFLEET_MCP_CONFIG", value_name = "FILE")]
    mcp_config: PathBuf,
}

fn main() -> std::process::ExitCode {
    // First, while this is the only thread: nothing left in the block the
    // kernel shows as /proc/<pid>/environ.
    let hidden = toolfleet_worker_mcp::child::hide_start_environment();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("cannot start the runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    runtime.block_on(serve(hidden))
}

async fn serve(hidden: Result<(), String>) -> std::process::ExitCode {
    toolfleet_worker::process::main_with(
        (
            "toolfleet-worker-mcp",
            "toolfleet worker: serves the tools of MCP servers (stdio or streamable HTTP) as fleet tools.",
            "0.0.0.0:9469",
        ),
        toolfleet_worker::build_info!(),
        // Its tools are its servers'.
        toolfleet_worker::process::Flags {
            tool_definitions: false,
        },
        async |args, own: &McpArgs| {
            if let Err(e) = &hidden {
                tracing::warn!(error = %e, "cannot empty the worker's start-up environment: children that may read its memory may find credentials in /proc/<worker>/environ");
            }
            // Before any child: no process of this user reads our memory.
            toolfleet_worker_mcp::child::protect_worker();
            let config = toolfleet_worker_mcp::McpConfig::load(&own.mcp_config)
                .map_err(|e| e.to_string())?;
            let secrets = toolfleet_worker_mcp::worker_secrets(args);
            let servers = toolfleet_worker_mcp::servers_with_secrets(&config, &secrets);
            let metrics =
                toolfleet_worker_mcp::McpMetrics::new(servers.iter().map(|s| s.name.as_str()))
                    .map_err(|e| e.to_string())?;
            let (builder, skipped) = toolfleet_worker_mcp::builder(&servers, &metrics).await?;
            for why in &skipped {
                tracing::warn!("{why}");
            }
            // Any server's change lists them all again.
            let changed = Arc::new(tokio::sync::Notify::new());
            for server in &servers {
                let (server, changed) = (server.clone(), changed.clone());
                tokio::spawn(async move {
                    loop {
                        server.changed().await;
                        server.take_changed();
                        tracing::info!(server = %server.name, "the MCP server's tools changed; listing them again");
                        changed.notify_one();
                    }
                });
            }
            let rebuild = move || {
                let (servers, metrics) = (servers.clone(), metrics.clone());
                futures::FutureExt::boxed(async move {
                    let (builder, skipped) =
                        toolfleet_worker_mcp::builder(&servers, &metrics).await?;
                    for why in &skipped {
                        tracing::warn!("{why}");
                    }
                    builder.build().map_err(|e| e.to_string())
                })
            };
            builder
                .reload_on(changed, rebuild)
                .build()
                .map_err(|e| e.to_string())
        },
    )
    .await
}
