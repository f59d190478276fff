//! `toolfleet-worker-mcp`: serves the tools of the MCP servers named in its
//! configuration file (`--mcp-config`, `TOOLFLEET_MCP_CONFIG`; see
//! `toolfleet_worker_mcp::config`). Start more copies to scale the pool.

use std::path::PathBuf;

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
        async |_, own: &McpArgs| {
            let config = toolfleet_worker_mcp::McpConfig::load(&own.mcp_config)
                .map_err(|e| e.to_string())?;
            let imported = toolfleet_worker_mcp::import(&config).await?;
            for why in &imported.skipped {
                tracing::warn!("{why}");
            }
            for server in imported.servers {
                tokio::spawn(async move {
                    server.changed().await;
                    tracing::warn!(
                        server = %server.name,
                        "the MCP server's tool list changed; restart this worker to serve the new list \
                         (calls to tools it removed fail with its error)"
                    );
                });
            }
            Ok::<_, String>(imported.worker)
        },
    )
    .await
}
