//! toolfleet-worker-mcp: the tools of MCP servers as fleet tools.
//!
//! Each configured server ([`config`]: a stdio command or a streamable HTTP
//! URL) is connected ([`server`]), its `tools/list` turned into fleet
//! definitions under the namespace `mcp_<server>` ([`tools`]), advertised
//! in the catalog like any other tool and called through JetStream: every
//! call reaches this worker, which calls the server with the call's
//! deadline, cancellation, tenant and user. A server that died is started
//! (or connected) again on the next call; a call it died in is
//! `mcp_unavailable`, retried as the job's policy says. A tool whose
//! schema does not compile is left out and reported; so is a server that
//! cannot be reached at start (the others are served).
//!
//! # Layout
//!
//! - [`config`]: the servers, their tenants, trust, bounds and children;
//! - [`server`]: connections, per-tenant children, calls with `_meta`;
//! - [`child`]: a stdio child's explicit environment, user, and scrubbed
//!   stderr; the worker made non-dumpable;
//! - [`tools`]: MCP tools as definitions (fenced descriptions, approval
//!   from hints, tenants) and the tool that calls them (fenced results);
//! - [`oauth`]: OAuth 2.1 client credentials for HTTP servers (metadata
//!   discovery, the `resource` parameter, tokens per tenant);
//! - [`pins`]: tool digests, pinned or accepted by the operator;
//! - [`metrics`]: calls, durations, tools and refused changes by server.

pub mod child;
pub mod config;
pub mod metrics;
pub mod oauth;
pub mod pins;
pub mod server;
pub mod tools;

use std::sync::Arc;

use toolfleet_worker::Worker;

pub use config::McpConfig;
pub use metrics::McpMetrics;
pub use server::{McpError, Server};

/// The worker of a configuration, its servers, and what was left out.
pub struct Imported {
    pub worker: Worker,
    pub servers: Vec<Arc<Server>>,
    /// Why each tool or server left out was (for the log).
    pub skipped: Vec<String>,
    pub metrics: McpMetrics,
}

/// The servers of `config`, not connected yet.
pub fn servers(config: &McpConfig) -> Vec<Arc<Server>> {
    servers_with_secrets(config, &[])
}

/// The servers of `config`, not connected yet, their children's stderr
/// scrubbed of `secrets` (the worker's own credentials) too.
pub fn servers_with_secrets(
    config: &McpConfig,
    secrets: &[toolfleet_worker::Secret],
) -> Vec<Arc<Server>> {
    config
        .servers
        .iter()
        .map(|(name, spec)| Server::with_secrets(name.clone(), spec.clone(), secrets.to_vec()))
        .collect()
}

/// The worker's own credentials (NATS password or token, from the
/// environment or their files, and passwords in the NATS and Redis URLs):
/// what its children's stderr is scrubbed of.
pub fn worker_secrets(args: &toolfleet_worker::WorkerArgs) -> Vec<toolfleet_worker::Secret> {
    // With what the connection takes from NATS_URL or the nats CLI's
    // context (a broken context has stopped the start already).
    let nats = args
        .nats
        .with_fallbacks(&toolfleet_worker::service::nats_context::ProcessVars)
        .unwrap_or_else(|_| args.nats.clone());
    let args = toolfleet_worker::WorkerArgs {
        nats,
        ..args.clone()
    };
    let mut secrets: Vec<String> = [&args.nats.password, &args.nats.token]
        .into_iter()
        .flatten()
        .map(|s| s.expose().to_string())
        .collect();
    // Read again from their files (the connection read them first).
    for file in [&args.nats.password_file, &args.nats.token_file]
        .into_iter()
        .flatten()
    {
        secrets.extend(child::read_secret(file).ok());
    }
    for url in args.nats.url().split(',').chain(args.redis.url.split(',')) {
        secrets.extend(url_password(url));
    }
    secrets
        .into_iter()
        .filter(|s| !s.is_empty())
        .map(toolfleet_worker::Secret::new)
        .collect()
}

/// The password in a URL's user info (`scheme://user:password@host`).
fn url_password(url: &str) -> Option<String> {
    let rest = url.trim().split_once("://")?.1;
    let authority = rest.split(['/', '?', '#']).next()?;
    let (userinfo, _) = authority.rsplit_once('@')?;
    let secret = userinfo.split_once(':').map_or(userinfo, |(_, p)| p);
    Some(secret.to_string())
}

impl std::fmt::Debug for Imported {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Imported")
            .field("servers", &self.servers)
            .field("skipped", &self.skipped)
            .finish_non_exhaustive()
    }
}

/// Connects to every server of `config`, lists its tools and builds the
/// worker serving them (worker name `mcp`).
///
/// # Errors
///
/// When no server gave a tool to serve, saying why for each.
pub async fn import(config: &McpConfig) -> Result<Imported, String> {
    let servers = servers(config);
    let metrics =
        McpMetrics::new(servers.iter().map(|s| s.name.as_str())).map_err(|e| e.to_string())?;
    let (builder, skipped) = builder(&servers, &metrics).await?;
    let worker = builder.build().map_err(|e| e.to_string())?;
    Ok(Imported {
        worker,
        servers,
        skipped,
        metrics,
    })
}

/// Lists the tools of `servers` (connecting each first, if need be) into a
/// worker builder, with why each tool or server was left out.
///
/// # Errors
///
/// When no server gave a tool to serve, saying why for each.
pub async fn builder(
    servers: &[Arc<Server>],
    metrics: &McpMetrics,
) -> Result<(toolfleet_worker::WorkerBuilder, Vec<String>), String> {
    let mut builder = Worker::builder("mcp").metrics(metrics.collector());
    let mut skipped = Vec::new();
    let mut served = 0;
    // Function names are one namespace across servers.
    let mut functions = std::collections::BTreeSet::new();
    for server in servers {
        let (name, spec) = (&server.name, server.spec());
        match server.list_tools().await {
            Ok(listed) => {
                let changes = server.pins.changes(name);
                let (imported, left_out) =
                    tools::definitions(name, spec, &listed, &mut functions, &server.pins);
                skipped.extend(left_out);
                metrics
                    .tool_changes
                    .with_label_values(&[name.as_str()])
                    .inc_by(server.pins.changes(name) - changes);
                metrics
                    .tools
                    .with_label_values(&[name.as_str()])
                    .set(imported.len() as i64);
                for tool in imported {
                    served += 1;
                    let key = tool.definition.implementation_key.clone();
                    builder = builder.definition(tool.definition).tool(
                        key,
                        tools::McpTool {
                            server: server.clone(),
                            mcp_name: tool.mcp_name,
                            safe_to_repeat: tool.safe_to_repeat,
                            metrics: metrics.clone(),
                        },
                    );
                }
            }
            Err(e) => {
                metrics.tools.with_label_values(&[name.as_str()]).set(0);
                skipped.push(format!("server {name} left out: {e}"));
            }
        }
    }
    if served == 0 {
        return Err(format!(
            "no MCP server gave a tool to serve: {}",
            skipped.join("; ")
        ));
    }
    Ok((builder, skipped))
}

#[cfg(test)]
mod tests {
    #[test]
    fn passwords_in_urls_are_the_workers_secrets() {
        assert_eq!(
            super::url_password("redis://default:s3cret-pw@redis:6379/0").as_deref(),
            Some("s3cret-pw")
        );
        assert_eq!(
            super::url_password("nats://tok3n@nats:4222").as_deref(),
            Some("tok3n")
        );
        assert_eq!(super::url_password("redis://redis:6379"), None);
    }
}
