//! `toolfleet-worker-mcp`: serves the tools of the MCP servers named in its
//! configuration file (`--mcp-config`, `TOOLFLEET_MCP_CONFIG`; see
//! `toolfleet_worker_mcp::config`). Start more copies to scale the pool.
//! When a server says its tool list changed (or comes back after dying),
//! the worker lists it again and serves the new set. The worker makes
//! itself non-dumpable first, so its children cannot read its memory or
//! `/proc/<pid>/environ`; their stderr is logged scrubbed of its secrets.

use std::path::PathBuf;
use std::sync::Arc;

/// This family's own settings.
#[derive(clap::Args, Debug)]
struct McpArgs {
    /// The MCP servers to import (TOML, `[servers.<name>]` tables).
    #[arg(long, env = "TOOLFLEET_MCP_CONFIG", value_name = "FILE")]
    mcp_config: PathBuf,
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    toolfleet_worker::process::main(
        "toolfleet-worker-mcp",
        "toolfleet worker: serves the tools of MCP servers (stdio or streamable HTTP) as fleet tools.",
        "0.0.0.0:9469",
        async |args, own: &McpArgs| {
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
