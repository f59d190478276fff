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
//!
//! A tool whose definition declares an object `outputSchema` (one that
//! compiles) is listed with it, and its result's data is the call's
//! `structuredContent`, checked against the schema first: data missing or
//! not matching makes the call a tool error (`isError`, saying why, no
//! `structuredContent`), so a client that checks (the Python SDK raises)
//! never gets content that breaks the declared schema.
//!
//! **Tasks** (MCP 2025-11-25): a `tools/call` with a `task` parameter
//! answers at once with a task whose id is the fleet invocation of the
//! tool job it started; `tasks/get`, `tasks/result` (waits for the end),
//! `tasks/cancel` (cancels the job through the fleet's cancel subject)
//! and `tasks/list` serve it ([`tasks`] keeps the books, [`wire`] adds
//! to the SDK's messages what it does not speak of tasks). Tasks live in
//! this process, for this `mcp serve`'s one tenant, each bound to its
//! requestor ([`requestor`]): the hash of the `Authorization` header (an
//! authenticating proxy's), else the HTTP session; over stdio, the one
//! client.

mod tasks;
mod wire;

use std::sync::Arc;
use std::time::Duration;

use rmcp::ServiceExt;
use rmcp::handler::server::ServerHandler;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, Implementation,
    ListToolsResult, PaginatedRequestParams, ProgressNotificationParam, ServerCapabilities,
    ServerConfig, Tool,
};
use rmcp::model::{CustomRequest, CustomResult};
use rmcp::service::{RequestContext, RoleServer};
use toolfleet_protocol::Subjects;
use toolfleet_protocol::catalog::{Catalog, discover};
use toolfleet_protocol::client::{CallIds, ClientError};
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
    /// The tasks of task-augmented calls (of every HTTP session, each
    /// task bound to its requestor).
    tasks: Arc<tasks::TaskStore>,
}

/// A reading of the live tools and when it was taken.
type Reading = (tokio::time::Instant, Vec<ToolDefinition>);

/// How long a catalog reading is reused.
const CATALOG_FRESH: Duration = Duration::from_secs(2);
/// A call is waited for its tool's timeout and this margin.
const CALL_MARGIN: Duration = Duration::from_secs(5);

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
            tasks: Arc::default(),
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
    tool.output_schema = output_schema(d).map(|(schema, _)| Arc::new(schema));
    tool
}

/// The definition's `outputSchema` when MCP can declare it — an object
/// schema at its root (the spec's `structuredContent` is an object) that
/// compiles — and its validator.
fn output_schema(
    d: &ToolDefinition,
) -> Option<(
    serde_json::Map<String, serde_json::Value>,
    toolfleet_protocol::schema::Validator,
)> {
    match &d.output_schema {
        Some(value @ serde_json::Value::Object(map))
            if map.get("type").and_then(serde_json::Value::as_str) == Some("object") =>
        {
            let validator = toolfleet_protocol::schema::Validator::compile(value).ok()?;
            Some((map.clone(), validator))
        }
        _ => None,
    }
}

/// Who a task request comes from: the hash of its `Authorization` header
/// (a proxy that authenticates passes it on: the same principal in any
/// session), else its HTTP session (`Mcp-Session-Id`); over stdio, where
/// there are no HTTP parts, the one client.
///
/// # Errors
///
/// An HTTP request with neither (refused: its tasks could be nobody's).
fn requestor(context: &RequestContext<RoleServer>) -> Result<String, rmcp::ErrorData> {
    requestor_of(context.extensions.get::<axum::http::request::Parts>())
}

/// [`requestor`] of a request's HTTP parts (`None` over stdio).
fn requestor_of(parts: Option<&axum::http::request::Parts>) -> Result<String, rmcp::ErrorData> {
    let Some(parts) = parts else {
        return Ok("stdio".into());
    };
    if let Some(auth) = parts.headers.get(axum::http::header::AUTHORIZATION) {
        let digest = ring::digest::digest(&ring::digest::SHA256, auth.as_bytes());
        let hex: String = digest.as_ref().iter().map(|b| format!("{b:02x}")).collect();
        return Ok(format!("authorization:{hex}"));
    }
    match parts
        .headers
        .get("mcp-session-id")
        .and_then(|v| v.to_str().ok())
    {
        Some(session) => Ok(format!("session:{session}")),
        None => Err(rmcp::ErrorData::invalid_request(
            "tasks need an MCP session (Mcp-Session-Id) or an Authorization header",
            None,
        )),
    }
}

impl ServerHandler for FleetServer {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("toolfleet", env!("CARGO_PKG_VERSION")))
            .with_instructions(
                "The tools of a toolfleet fleet: each call runs as a tool job on the fleet's worker pools.",
            )
    }

    async fn on_custom_request(
        &self,
        request: CustomRequest,
        context: RequestContext<RoleServer>,
    ) -> Result<CustomResult, rmcp::ErrorData> {
        let CustomRequest { method, params, .. } = request;
        let owner = requestor(&context)?;
        self.task_request(&owner, &method, params)
            .await
            .map(CustomResult::new)
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
        let tool = self.find_tool(&request.name).await?;
        let arguments = serde_json::Value::Object(request.arguments.clone().unwrap_or_default());
        let ids = CallIds::new();
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
            r = self.call(&tool, &ids, arguments, |m| {
                let _ = progress_tx.send(m.to_string());
            }) => r,
        };
        drop(progress_tx);
        let _ = forward.await;
        Ok(answer(called, output_schema(&tool).map(|(_, v)| v).as_ref()).into())
    }
}

impl FleetServer {
    /// The live tool named `name`, or the JSON-RPC error for an unknown
    /// tool (-32602, as the spec says).
    async fn find_tool(&self, name: &str) -> Result<ToolDefinition, rmcp::ErrorData> {
        let tools = self.tools().await?;
        tools
            .into_iter()
            .find(|d| d.function.name == name)
            .ok_or_else(|| {
                rmcp::ErrorData::invalid_params(
                    format!("no live tool of the fleet is named {name}"),
                    None,
                )
            })
    }

    /// Runs `tool` as the one tool job of a fresh invocation `ids` of the
    /// tenant, within the tool's timeout (and a margin).
    async fn call(
        &self,
        tool: &ToolDefinition,
        ids: &CallIds,
        arguments: serde_json::Value,
        on_progress: impl FnMut(&str),
    ) -> Result<toolfleet_protocol::ToolResult, ClientError> {
        toolfleet_protocol::client::call_tool_as(
            &self.client,
            &self.subjects,
            tool,
            &self.tenant,
            ids,
            arguments,
            tool.timeout() + CALL_MARGIN,
            on_progress,
        )
        .await
    }
}

/// A fleet call's outcome as MCP's tool result: the tool's content, its
/// data as structured content and its references as resource links; a
/// failed call (or one that could not be made) a tool error. With the
/// tool's declared `outputSchema` (`schema`), the data is the structured
/// content only when it matches; data missing or not matching is a tool
/// error saying so (a client checks structured content against the
/// schema the tool was listed with).
fn answer(
    called: Result<toolfleet_protocol::ToolResult, ClientError>,
    schema: Option<&toolfleet_protocol::schema::Validator>,
) -> CallToolResult {
    let result = match called {
        Ok(result) => result,
        Err(e) => return CallToolResult::error(vec![ContentBlock::text(e.to_string())]),
    };
    if result.status != toolfleet_protocol::ToolStatus::Ok {
        let why = result
            .error
            .as_ref()
            .map(|e| format!("{}: {}", e.code, e.message))
            .unwrap_or_else(|| result.status.as_str().to_string());
        return CallToolResult::error(vec![ContentBlock::text(why)]);
    }
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
    if let Some(schema) = schema {
        let refused = match &result.data {
            None => Some("the tool returned no structured data".to_string()),
            Some(data) => schema.validate(data).err().map(|violations| {
                format!(
                    "its data does not match the tool's outputSchema: {}",
                    toolfleet_protocol::schema::describe(&violations)
                )
            }),
        };
        if let Some(why) = refused {
            return CallToolResult::error(vec![ContentBlock::text(format!(
                "output_schema_mismatch: {why}"
            ))]);
        }
    }
    let mut out = CallToolResult::success(content);
    // MCP's structured content is an object: data of a tool that declares
    // no schema and is not an object is wrapped (declared schemas are
    // object schemas, checked above, so their data is never wrapped).
    out.structured_content = result.data.clone().map(|data| match data {
        serde_json::Value::Object(_) => data,
        other => serde_json::json!({ "result": other }),
    });
    out
}

impl FleetServer {
    /// A task-augmented `tools/call`: the job started, its task answered
    /// at once.
    async fn start_task(
        &self,
        owner: &str,
        params: Option<serde_json::Value>,
    ) -> Result<serde_json::Value, rmcp::ErrorData> {
        let params = params.unwrap_or_default();
        let name = params
            .get("name")
            .and_then(serde_json::Value::as_str)
            .ok_or_else(|| rmcp::ErrorData::invalid_params("name is required", None))?;
        let arguments = match params.get("arguments") {
            None | Some(serde_json::Value::Null) => serde_json::json!({}),
            Some(a @ serde_json::Value::Object(_)) => a.clone(),
            Some(_) => {
                return Err(rmcp::ErrorData::invalid_params(
                    "arguments must be an object",
                    None,
                ));
            }
        };
        let ttl = params
            .get("task")
            .and_then(|t| t.get("ttl"))
            .and_then(serde_json::Value::as_u64);
        let tool = self.find_tool(name).await?;
        let ids = CallIds::new();
        let ttl = tasks::granted_ttl(ttl, tool.timeout() + CALL_MARGIN);
        let created = self
            .tasks
            .create(owner, ids.clone(), ttl)
            .map_err(|e| e.to_rpc())?;
        let (fleet, id) = (self.clone(), ids.invocation_id.clone());
        let runner = tokio::spawn(async move {
            let store = fleet.tasks.clone();
            let called = fleet
                .call(&tool, &ids, arguments, |m| store.progress(&id, m))
                .await;
            let schema = output_schema(&tool).map(|(_, v)| v);
            let result = answer(called, schema.as_ref());
            // 2025-11-25: a tool result with `isError` is a failed task.
            let (status, message) = if result.is_error == Some(true) {
                (tasks::Status::Failed, first_text(&result))
            } else {
                (tasks::Status::Completed, "the tool answered".to_string())
            };
            let outcome = match serde_json::to_value(&result) {
                Ok(v) => tasks::Outcome::Result(v),
                Err(e) => tasks::Outcome::Error(rmcp::ErrorData::internal_error(
                    format!("the result cannot be written: {e}"),
                    None,
                )),
            };
            store.finish(&id, status, message, outcome);
        });
        self.tasks.attach(&ids_of(&created), runner.abort_handle());
        Ok(created)
    }

    /// `tasks/cancel`: `owner`'s task cancelled, and its fleet call with
    /// it (its runner, which holds the call, is stopped; the call's cancel
    /// subject tells the worker too). The task is cancelled whatever the
    /// extra publish does: a failed one is logged, never the answer.
    async fn cancel_task(
        &self,
        owner: &str,
        id: &str,
    ) -> Result<serde_json::Value, rmcp::ErrorData> {
        let (task, ids) = self.tasks.cancel(owner, id).map_err(|e| e.to_rpc())?;
        if let Err(e) = toolfleet_protocol::client::cancel_call(
            &self.client,
            &self.subjects,
            &self.tenant,
            &ids.invocation_id,
            &ids.call_id,
        )
        .await
        {
            tracing::warn!(task = %id, error = %e, "the fleet's cancel of a cancelled task could not be published");
        }
        Ok(task)
    }

    /// `tasks/result`: waits for the end of `owner`'s task.
    async fn task_result(
        &self,
        owner: &str,
        id: &str,
    ) -> Result<serde_json::Value, rmcp::ErrorData> {
        match self.tasks.result(owner, id).await.map_err(|e| e.to_rpc())? {
            tasks::Outcome::Result(result) => Ok(result),
            tasks::Outcome::Error(e) => Err(e),
        }
    }

    /// The task requests ([`wire`] renamed them to [`wire::TASK_METHODS`]'s
    /// names, which the SDK passes on as custom requests).
    async fn task_request(
        &self,
        owner: &str,
        method: &str,
        params: Option<serde_json::Value>,
    ) -> Result<serde_json::Value, rmcp::ErrorData> {
        let id = || -> Result<String, rmcp::ErrorData> {
            params
                .as_ref()
                .and_then(|p| p.get("taskId"))
                .and_then(serde_json::Value::as_str)
                .map(str::to_string)
                .ok_or_else(|| rmcp::ErrorData::invalid_params("taskId is required", None))
        };
        match wire::task_method(method) {
            Some("tools/call") => self.start_task(owner, params.clone()).await,
            Some("tasks/get") => self.tasks.get(owner, &id()?).map_err(|e| e.to_rpc()),
            Some("tasks/cancel") => self.cancel_task(owner, &id()?).await,
            Some("tasks/result") => self.task_result(owner, &id()?).await,
            Some("tasks/list") => {
                let cursor = match params.as_ref().and_then(|p| p.get("cursor")) {
                    None | Some(serde_json::Value::Null) => None,
                    Some(serde_json::Value::String(c)) => Some(c.as_str()),
                    Some(other) => {
                        return Err(tasks::TaskError::BadCursor(other.to_string()).to_rpc());
                    }
                };
                self.tasks.list(owner, cursor).map_err(|e| e.to_rpc())
            }
            _ => Err(rmcp::ErrorData::new(
                rmcp::model::ErrorCode::METHOD_NOT_FOUND,
                format!("no method {method}"),
                None,
            )),
        }
    }
}

impl FleetServer {
    /// Cancels the fleet jobs of the tasks still working (the server
    /// stops; its tasks end with it).
    pub async fn cancel_working_tasks(&self) {
        for ids in self.tasks.cancel_all() {
            let _ = toolfleet_protocol::client::cancel_call(
                &self.client,
                &self.subjects,
                &self.tenant,
                &ids.invocation_id,
                &ids.call_id,
            )
            .await;
        }
    }
}

/// The task id of a `CreateTaskResult`.
fn ids_of(created: &serde_json::Value) -> String {
    created["task"]["taskId"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The first text of a tool result (its error's message).
fn first_text(result: &CallToolResult) -> String {
    result
        .content
        .iter()
        .find_map(|c| c.as_text().map(|t| t.text.clone()))
        .unwrap_or_else(|| "the tool failed".into())
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
    let tasks = server.clone();
    tasks::TaskStore::sweep(&server.tasks);
    let service = StreamableHttpService::new(
        move || Ok(server.clone()),
        Arc::new(LocalSessionManager::default()),
        config,
    );
    let app = axum::Router::new()
        .nest_service("/mcp", service)
        .layer(axum::middleware::from_fn(wire::http));
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
    tasks.cancel_working_tasks().await;
    Ok(())
}

/// Serves `server` on stdin/stdout until the client closes.
///
/// # Errors
///
/// When the MCP session cannot start.
pub async fn serve_stdio(server: FleetServer) -> anyhow::Result<()> {
    tasks::TaskStore::sweep(&server.tasks);
    let (stdin, stdout, written) = wire::stdio();
    let running = server.clone().serve((stdin, stdout)).await?;
    running.waiting().await?;
    server.cancel_working_tasks().await;
    // The last answers out before the process ends.
    let _ = tokio::time::timeout(Duration::from_secs(2), written).await;
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

    /// An ok result of the fleet with `data`.
    fn result(data: Option<serde_json::Value>) -> toolfleet_protocol::ToolResult {
        let mut v = serde_json::json!({
            "invocationId": "inv-1", "callId": "call_1", "toolId": "demo:echo@1.0.0",
            "status": "ok", "content": "the text", "attempt": 1, "durationMs": 3
        });
        if let Some(data) = data {
            v["data"] = data;
        }
        serde_json::from_value(v).unwrap()
    }

    #[test]
    fn structured_content_is_sent_only_when_it_matches_the_declared_schema() {
        let d = definition(serde_json::json!({ "outputSchema": {
            "type": "object",
            "properties": { "n": { "type": "integer" } },
            "required": ["n"]
        } }));
        let (declared, schema) = output_schema(&d).unwrap();
        assert_eq!(
            mcp_tool(&d).output_schema.as_deref(),
            Some(&declared),
            "listed with the schema it is checked against"
        );
        let ok = answer(
            Ok(result(Some(serde_json::json!({ "n": 3 })))),
            Some(&schema),
        );
        assert_eq!(ok.is_error, Some(false));
        assert_eq!(ok.structured_content, Some(serde_json::json!({ "n": 3 })));
        for data in [
            Some(serde_json::json!({ "n": "three" })),
            Some(serde_json::json!(3)),
            None,
        ] {
            let refused = answer(Ok(result(data.clone())), Some(&schema));
            assert_eq!(refused.is_error, Some(true), "{data:?}");
            assert_eq!(refused.structured_content, None, "{data:?}");
            assert!(
                first_text(&refused).starts_with("output_schema_mismatch: "),
                "{refused:?}"
            );
        }
        // Without a declared schema, data goes as it is (a non-object
        // wrapped: structured content is an object).
        let free = answer(Ok(result(Some(serde_json::json!(3)))), None);
        assert_eq!(
            free.structured_content,
            Some(serde_json::json!({ "result": 3 }))
        );
        // A schema that is not an object's, or does not compile, is not
        // declared at all.
        for schema in [
            serde_json::json!({ "type": "string" }),
            serde_json::json!({ "type": "object", "properties": { "n": { "type": 5 } } }),
        ] {
            let d = definition(serde_json::json!({ "outputSchema": schema }));
            assert!(mcp_tool(&d).output_schema.is_none(), "{schema}");
        }
    }

    #[test]
    fn a_task_requestor_is_its_authorization_else_its_session() {
        let parts = |headers: &[(&str, &str)]| {
            let mut request = axum::http::Request::builder();
            for (k, v) in headers {
                request = request.header(*k, *v);
            }
            request.body(()).unwrap().into_parts().0
        };
        assert_eq!(requestor_of(None).unwrap(), "stdio");
        let alice = requestor_of(Some(&parts(&[
            ("authorization", "Bearer alice"),
            ("mcp-session-id", "s1"),
        ])))
        .unwrap();
        // The same principal in another session is the same requestor;
        // the header itself is never kept.
        let alice_again = requestor_of(Some(&parts(&[
            ("authorization", "Bearer alice"),
            ("mcp-session-id", "s2"),
        ])))
        .unwrap();
        assert_eq!(alice, alice_again);
        assert!(alice.starts_with("authorization:") && !alice.contains("alice"));
        let mallory = requestor_of(Some(&parts(&[("authorization", "Bearer mallory")]))).unwrap();
        assert_ne!(alice, mallory);
        assert_eq!(
            requestor_of(Some(&parts(&[("mcp-session-id", "s1")]))).unwrap(),
            "session:s1"
        );
        assert_ne!(
            requestor_of(Some(&parts(&[("mcp-session-id", "s2")]))).unwrap(),
            "session:s1"
        );
        let refused = requestor_of(Some(&parts(&[]))).unwrap_err();
        assert_eq!(refused.code, rmcp::model::ErrorCode::INVALID_REQUEST);
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
