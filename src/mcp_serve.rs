//! `toolfleet mcp serve`: the live fleet's tools as an MCP server (stdio).
//!
//! `tools/list` is the catalog the fleet's workers advertise, scoped to a
//! profile's tools (the default profile's unless one is given), without
//! the tools that profile or their definition hold for a person's approval
//! (an MCP call has nobody to ask) and those the tenant may not use;
//! `tools/call` runs the tool as a real tool
//! job of a fresh invocation (through JetStream, or its direct endpoint),
//! passing the tool's progress on as MCP progress notifications when the
//! client asked for them, and answers with the tool's content, its data as
//! structured content and its references as resource links. A failed call
//! is an MCP tool error (`isError`); an unknown tool a JSON-RPC error
//! (-32602), as the spec says. A call the client cancels (or gives up on)
//! is cancelled in the fleet too.

use std::sync::Arc;
use std::time::Duration;

use rmcp::ServiceExt;
use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ProgressNotificationParam, ServerCapabilities,
    ServerConfig, Tool,
};
use rmcp::service::{RequestContext, RoleServer};
use toolfleet_protocol::Subjects;
use toolfleet_protocol::catalog::{Catalog, discover};
use toolfleet_protocol::tools::ToolDefinition;

/// The fleet seen as an MCP server.
#[derive(Clone)]
pub struct FleetServer {
    client: async_nats::Client,
    subjects: Subjects,
    tenant: String,
    /// Only these tools (the profile's); all when `None`.
    scope: Option<Vec<toolfleet_protocol::tools::ToolRef>>,
    /// Tools the profile holds for a person's approval: never offered (an
    /// MCP call has nobody to ask).
    needs_approval: Vec<toolfleet_protocol::tools::ToolRef>,
    discovery_wait: Duration,
    /// The last reading of the catalog, reused for a moment (every call
    /// would otherwise wait out a discovery).
    cached: Arc<tokio::sync::Mutex<Option<Reading>>>,
}

/// A reading of the live tools and when it was taken.
type Reading = (tokio::time::Instant, Vec<ToolDefinition>);

/// How long a catalog reading is reused.
const CATALOG_FRESH: Duration = Duration::from_secs(2);

impl FleetServer {
    pub fn new(
        client: async_nats::Client,
        subjects: Subjects,
        tenant: String,
        scope: Option<Vec<toolfleet_protocol::tools::ToolRef>>,
        needs_approval: Vec<toolfleet_protocol::tools::ToolRef>,
    ) -> Self {
        Self {
            client,
            subjects,
            tenant,
            scope,
            needs_approval,
            discovery_wait: Duration::from_millis(500),
            cached: Arc::default(),
        }
    }

    /// The live tools this server offers, by function name: selectable
    /// tools only (system tools are the orchestrator's to add), the agent
    /// namespace left out (those are the orchestrators' own), within the
    /// profile's tools when one was given, and of several versions of one
    /// function only the highest.
    async fn tools(&self) -> Result<Vec<ToolDefinition>, rmcp::ErrorData> {
        let mut cached = self.cached.lock().await;
        if let Some((at, tools)) = cached.as_ref()
            && at.elapsed() < CATALOG_FRESH
        {
            return Ok(tools.clone());
        }
        let tools = self.read_tools().await?;
        *cached = Some((tokio::time::Instant::now(), tools.clone()));
        Ok(tools)
    }

    async fn read_tools(&self) -> Result<Vec<ToolDefinition>, rmcp::ErrorData> {
        let catalog = discover(
            &self.client,
            &self.subjects,
            self.discovery_wait,
            &Catalog::default(),
        )
        .await
        .map_err(|e| rmcp::ErrorData::internal_error(format!("the fleet's catalog: {e}"), None))?;
        let mut by_name: std::collections::BTreeMap<String, ToolDefinition> = Default::default();
        for d in catalog.all().map(|e| e.definition().clone()) {
            if !d.selectable
                || d.id.namespace == "agent"
                || !self.in_scope(&d)
                || !exported(&d)
                || !d.allows_tenant(&self.tenant)
                || self.needs_approval.iter().any(|r| r.matches(&d.id))
            {
                continue;
            }
            match by_name.get(&d.function.name) {
                Some(kept) if kept.id.version >= d.id.version => {}
                _ => {
                    by_name.insert(d.function.name.clone(), d);
                }
            }
        }
        Ok(by_name.into_values().collect())
    }

    fn in_scope(&self, d: &ToolDefinition) -> bool {
        self.scope
            .as_ref()
            .is_none_or(|refs| refs.iter().any(|r| r.matches(&d.id)))
    }
}

/// The surface MCP clients are, for a definition's `visibleIn`.
pub const MCP_SURFACE: &str = "mcp";

/// The orchestrator's gates, as they apply to a call from an MCP client:
/// no documents are attached (`document_processing` tools are left out),
/// no data source is selected (`data_source_search` too), the surface is
/// [`MCP_SURFACE`] (a tool whose `visibleIn` does not name it is left
/// out), and no provider confidence is known (a tool with a
/// `minProviderConfidence` would refuse every call). A tool that needs a
/// person's approval is never offered: an MCP call has nobody to ask.
fn exported(d: &ToolDefinition) -> bool {
    use toolfleet_protocol::tools::Purpose;
    !d.requires_approval
        && !matches!(
            d.purpose(),
            Purpose::DocumentProcessing | Purpose::DataSourceSearch
        )
        && (d.visible_in.is_empty() || d.visible_in.iter().any(|s| s == MCP_SURFACE))
        && d.min_provider_confidence.is_none_or(|c| c <= 0.0)
}

fn mcp_tool(d: &ToolDefinition) -> Tool {
    let schema = match &d.function.parameters {
        serde_json::Value::Object(map) => map.clone(),
        _ => serde_json::Map::new(),
    };
    let mut tool = Tool::new(
        d.function.name.clone(),
        d.function.description.clone(),
        Arc::new(schema),
    );
    tool.title = Some(d.title.clone());
    tool
}

impl ServerHandler for FleetServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("toolfleet", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "The tools of a toolfleet fleet: each call runs as a tool job on the fleet's worker pools.",
            )
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, rmcp::ErrorData> {
        let tools = self.tools().await?;
        Ok(ListToolsResult::with_all_items(
            tools.iter().map(mcp_tool).collect(),
        ))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, rmcp::ErrorData> {
        let tools = self.tools().await?;
        let Some(tool) = tools.iter().find(|d| d.function.name == request.name) else {
            return Err(rmcp::ErrorData::invalid_params(
                format!("no live tool of the fleet is named {}", request.name),
                None,
            ));
        };
        let arguments = serde_json::Value::Object(request.arguments.clone().unwrap_or_default());
        let timeout = tool.timeout() + Duration::from_secs(5);
        let token = context.meta.get_progress_token();
        let peer = context.peer.clone();
        let (progress_tx, mut progress_rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let forward = tokio::spawn(async move {
            let mut n = 0.0;
            while let Some(message) = progress_rx.recv().await {
                if let Some(token) = &token {
                    n += 1.0;
                    let mut param = ProgressNotificationParam::new(token.clone(), n);
                    param.message = Some(message);
                    let _ = peer.notify_progress(param).await;
                }
            }
        });
        let called = tokio::select! {
            () = context.ct.cancelled() => {
                return Err(rmcp::ErrorData::internal_error("the call was cancelled", None));
            }
            r = toolfleet_protocol::client::call_tool(
                &self.client,
                &self.subjects,
                tool,
                &self.tenant,
                arguments,
                timeout,
                |m| {
                    let _ = progress_tx.send(m.to_string());
                },
            ) => r,
        };
        drop(progress_tx);
        let _ = forward.await;
        let result = match called {
            Ok(result) => result,
            Err(e) => {
                return Ok(CallToolResult::error(vec![ContentBlock::text(e.to_string())]).into());
            }
        };
        let mut content = vec![ContentBlock::text(result.content.clone())];
        for r in &result.references {
            let uri = r
                .url
                .clone()
                .unwrap_or_else(|| format!("toolfleet-ref:{}/{}", result.invocation_id, r.index));
            let mut link = rmcp::model::Resource::new(uri, r.title.clone());
            link.title = Some(r.title.clone());
            link.description = r.snippet.clone();
            content.push(ContentBlock::ResourceLink(link));
        }
        let mut out = if result.status == toolfleet_protocol::ToolStatus::Ok {
            CallToolResult::success(content)
        } else {
            let why = result
                .error
                .as_ref()
                .map(|e| format!("{}: {}", e.code, e.message))
                .unwrap_or_else(|| result.status.as_str().to_string());
            CallToolResult::error(vec![ContentBlock::text(why)])
        };
        if result.status == toolfleet_protocol::ToolStatus::Ok {
            // MCP's structured content is an object.
            out.structured_content = result.data.clone().map(|data| match data {
                serde_json::Value::Object(_) => data,
                other => serde_json::json!({ "result": other }),
            });
        }
        Ok(out.into())
    }
}

/// Serves `server` over MCP's streamable HTTP at `http://<listen>/mcp`
/// until SIGINT or SIGTERM; says where on stderr once it listens. No
/// authentication of its own: bind it to loopback, or put it behind a
/// proxy that authenticates (the `Host` header must be a loopback name
/// unless `allowed_hosts` says otherwise).
///
/// # Errors
///
/// When `listen` cannot be bound.
pub async fn serve_http(
    server: FleetServer,
    listen: std::net::SocketAddr,
    allowed_hosts: Vec<String>,
) -> anyhow::Result<()> {
    use rmcp::transport::streamable_http_server::{
        StreamableHttpServerConfig, StreamableHttpService, session::local::LocalSessionManager,
    };
    let mut config = StreamableHttpServerConfig::default();
    if !allowed_hosts.is_empty() {
        config.allowed_hosts = allowed_hosts;
    }
    // Open event streams end with the server, so a stop does not wait on
    // clients that keep theirs open.
    let stop = config.cancellation_token.clone();
    let service = StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    let app = axum::Router::new().nest_service("/mcp", service);
    let listener = tokio::net::TcpListener::bind(listen).await?;
    eprintln!(
        "toolfleet mcp serve: listening on http://{}/mcp",
        listener.local_addr()?
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(async move {
            toolfleet_service::args::shutdown_signal().await;
            stop.cancel();
        })
        .await?;
    Ok(())
}

/// Serves `server` on stdin/stdout until the client closes.
///
/// # Errors
///
/// When the MCP session cannot start.
pub async fn serve_stdio(server: FleetServer) -> anyhow::Result<()> {
    let running = server.serve(rmcp::transport::stdio()).await?;
    running.waiting().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn definition(extra: serde_json::Value) -> ToolDefinition {
        let mut v = serde_json::json!({
            "schemaVersion": 1,
            "id": "demo:echo@1.0.0",
            "implementationKey": "demo.echo",
            "title": "Echo",
            "description": "Echoes.",
            "category": "utility",
            "function": {
                "name": "echo",
                "description": "Echo the text.",
                "parameters": { "type": "object", "properties": {} }
            }
        });
        for (k, x) in extra.as_object().unwrap() {
            v[k] = x.clone();
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn the_orchestrators_gates_apply_to_mcp_clients() {
        assert!(exported(&definition(serde_json::json!({}))));
        assert!(exported(&definition(
            serde_json::json!({ "purpose": "content_generation" })
        )));
        assert!(exported(&definition(
            serde_json::json!({ "visibleIn": ["chat", "mcp"] })
        )));
        for left_out in [
            serde_json::json!({ "purpose": "document_processing" }),
            serde_json::json!({ "purpose": "data_source_search" }),
            serde_json::json!({ "visibleIn": ["chat"] }),
            serde_json::json!({ "minProviderConfidence": 0.5 }),
            serde_json::json!({ "requiresApproval": true }),
        ] {
            assert!(!exported(&definition(left_out.clone())), "{left_out}");
        }
    }
}
