//! `toolfleet mcp serve`: the command's flags and start-up — the tenant
//! and the profile's scope checked, the fleet's NATS connected — around
//! the server of [`crate::mcp_serve`], on stdio or streamable HTTP.

use std::net::SocketAddr;
use toolfleet_config::ConfigArgs;

use clap::Subcommand;
use toolfleet_llm::args::LlmArgs;
use toolfleet_service::args::NatsArgs;

#[derive(Subcommand, Debug)]
pub enum McpCommand {
    /// An MCP server on stdin/stdout: `tools/list` is the fleet's live
    /// catalog within a profile's tools (`--profile`, else the default
    /// profile), never a tool that needs a person's approval (by its
    /// definition or the profile's `require_approval`) nor one `--tenant`
    /// may not use; `tools/call` runs the tool as a tool job of a fresh
    /// invocation of `--tenant`, its progress passed on as MCP progress,
    /// its references as resource links; a `tools/call` with a `task`
    /// answers with a task (MCP 2025-11-25 tasks: `tasks/get`,
    /// `tasks/result`, `tasks/cancel`, `tasks/list`) whose id is the
    /// fleet invocation of its tool job.
    Serve {
        /// The tenant the calls run as.
        #[arg(long, env = "TOOLFLEET_TENANT", default_value = toolfleet_protocol::DEFAULT_TENANT)]
        tenant: String,
        /// Offer only this profile's tools, under its approval rules (from
        /// the profiles file; the default profile when not given).
        #[arg(id = "mcp_profile", long = "profile", env = "TOOLFLEET_MCP_PROFILE")]
        profile: Option<String>,
        /// Serve MCP's streamable HTTP at `http://ADDR/mcp` instead of
        /// stdio (no authentication of its own: a loopback address, or
        /// behind an authenticating proxy).
        #[arg(id = "mcp_http", long = "http", value_name = "ADDR")]
        http: Option<SocketAddr>,
        /// With `--http`: the `Host` names accepted besides loopback's (a
        /// proxy's name).
        #[arg(long = "allowed-host", value_name = "HOST", requires = "mcp_http")]
        allowed_hosts: Vec<String>,
        #[command(flatten)]
        llm: LlmArgs,
        #[command(flatten)]
        nats: NatsArgs,
    },
}

/// `toolfleet mcp serve`: serves until stdin closes (or, with `--http`,
/// until a signal); exit 64 for a bad tenant or an unknown profile.
pub async fn run(command: McpCommand) -> anyhow::Result<i32> {
    let McpCommand::Serve {
        tenant,
        profile,
        http,
        allowed_hosts,
        llm,
        nats,
    } = command;
    if !crate::common::tenant_ok("toolfleet mcp serve", &tenant) {
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    // Without --profile, the default profile's rules: its tools, and its
    // approval rules (a tool it holds for approval is never offered).
    let config = toolfleet_service::args::or_exit(llm.fleet_config().map_err(Into::into));
    // The tenant's own default profile, as the orchestrator would choose;
    // a profile the tenant may not use is refused, as a job naming it is.
    let name = profile.unwrap_or_else(|| config.default_profile_of(&tenant).to_owned());
    let Some(p) = config.profiles.get(&name) else {
        eprintln!("toolfleet mcp serve: no profile {name:?} in the profiles file");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    };
    if !p.tenants.allows(&tenant) {
        eprintln!("toolfleet mcp serve: profile {name:?} is not for tenant {tenant:?}");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    let (scope, needs_approval) = (Some(p.tools.clone()), p.require_approval.clone());
    let subjects = nats.subjects()?;
    let client = nats.connect("toolfleet-mcp").await?;
    let server =
        crate::mcp_serve::FleetServer::new(client, subjects, tenant, scope, needs_approval);
    match http {
        Some(listen) => {
            let mut hosts = allowed_hosts;
            if !hosts.is_empty() {
                hosts.extend(["localhost".into(), "127.0.0.1".into(), "::1".into()]);
            }
            crate::mcp_serve::serve_http(server, listen, hosts).await?;
        }
        None => crate::mcp_serve::serve_stdio(server).await?,
    }
    Ok(0)
}
