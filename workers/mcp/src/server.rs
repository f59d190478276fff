//! One MCP server as the worker uses it: connected on first use (and again
//! after it died or closed), its tools listed, its tools called with the
//! call's deadline and cancellation. A server that changes its tool list
//! (`notifications/tools/list_changed`) is noted, for the worker to list it
//! again.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use rmcp::ServiceExt;
use rmcp::model::{CallToolRequestParams, CallToolResult, ClientConfig, Implementation};
use rmcp::service::{NotificationContext, Peer, RoleClient, RunningService};
use tokio::sync::Mutex;

use crate::config::{ServerSpec, Transport};

/// What went wrong talking to a server.
#[derive(Debug, Clone, thiserror::Error)]
pub enum McpError {
    /// The server cannot be reached, did not start, died, or closed the
    /// connection: another attempt (a restarted server) may do.
    #[error("MCP server {server} is unavailable: {message}")]
    Unavailable { server: String, message: String },
    /// The server answered with a JSON-RPC error.
    #[error("MCP server {server} refused the request: {message}")]
    Refused { server: String, message: String },
    /// No answer in time.
    #[error("MCP server {server} did not answer within {after:?}")]
    Timeout { server: String, after: Duration },
}

/// Notes a server's `tools/list_changed`.
#[derive(Clone, Default)]
struct Handler {
    changed: Arc<AtomicBool>,
    generation: Arc<AtomicU64>,
    notify: Arc<tokio::sync::Notify>,
}

impl rmcp::ClientHandler for Handler {
    fn on_tool_list_changed(
        &self,
        _context: NotificationContext<RoleClient>,
    ) -> impl Future<Output = ()> + Send + '_ {
        self.changed.store(true, Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.notify.notify_waiters();
        std::future::ready(())
    }

    fn get_info(&self) -> ClientConfig {
        ClientConfig::new(
            Default::default(),
            Implementation::new("toolfleet-worker-mcp", env!("CARGO_PKG_VERSION")),
        )
    }
}

/// One configured server and its connection (if any).
pub struct Server {
    pub name: String,
    spec: ServerSpec,
    handler: Handler,
    running: Mutex<Option<RunningService<RoleClient, Handler>>>,
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("name", &self.name).finish()
    }
}

impl Server {
    pub fn new(name: impl Into<String>, spec: ServerSpec) -> Arc<Self> {
        Arc::new(Self {
            name: name.into(),
            spec,
            handler: Handler::default(),
            running: Mutex::new(None),
        })
    }

    pub fn spec(&self) -> &ServerSpec {
        &self.spec
    }

    /// Resolves after the server said its tool list changed (since the
    /// last [`Server::take_changed`]).
    pub async fn changed(&self) {
        loop {
            let notified = self.handler.notify.notified();
            if self.handler.changed.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    /// Whether the tool list changed; clears the flag.
    pub fn take_changed(&self) -> bool {
        self.handler.changed.swap(false, Ordering::AcqRel)
    }

    fn unavailable(&self, message: impl std::fmt::Display) -> McpError {
        McpError::Unavailable {
            server: self.name.clone(),
            message: message.to_string(),
        }
    }

    /// The live connection's peer, connecting (again) when there is none or
    /// the last one closed.
    async fn peer(&self) -> Result<Peer<RoleClient>, McpError> {
        let mut running = self.running.lock().await;
        if let Some(r) = running.as_ref()
            && !r.is_closed()
            && !r.peer().is_transport_closed()
        {
            return Ok(r.peer().clone());
        }
        let again = running.take().is_some();
        if again {
            tracing::warn!(server = %self.name, "MCP server connection closed; connecting again");
        }
        let connected = tokio::time::timeout(self.spec.init_timeout(), self.connect())
            .await
            .map_err(|_| McpError::Timeout {
                server: self.name.clone(),
                after: self.spec.init_timeout(),
            })??;
        let peer = connected.peer().clone();
        *running = Some(connected);
        if again {
            // A server started again may offer other tools.
            self.handler.changed.store(true, Ordering::Release);
            self.handler.notify.notify_waiters();
        }
        Ok(peer)
    }

    async fn connect(&self) -> Result<RunningService<RoleClient, Handler>, McpError> {
        match self.spec.transport() {
            Transport::Stdio { program, args } => {
                let mut cmd = tokio::process::Command::new(&program);
                cmd.args(&args).env_clear();
                for keep in ["PATH", "HOME", "LANG", "LC_ALL", "TMPDIR"] {
                    if let Ok(v) = std::env::var(keep) {
                        cmd.env(keep, v);
                    }
                }
                for name in &self.spec.pass_env {
                    if let Ok(v) = std::env::var(name) {
                        cmd.env(name, v);
                    }
                }
                cmd.envs(&self.spec.env);
                if let Some(dir) = &self.spec.cwd {
                    cmd.current_dir(dir);
                }
                let (transport, _stderr) = rmcp::transport::TokioChildProcess::builder(cmd)
                    .stderr(std::process::Stdio::inherit())
                    .spawn()
                    .map_err(|e| self.unavailable(format!("cannot start {program}: {e}")))?;
                self.handler
                    .clone()
                    .serve(transport)
                    .await
                    .map_err(|e| self.unavailable(format!("initialize failed: {e}")))
            }
            Transport::Http { url } => {
                let _ = rustls::crypto::ring::default_provider().install_default();
                let mut config =
                    rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(
                        url.as_str(),
                    );
                if let Some(var) = &self.spec.bearer_token_env {
                    let token = std::env::var(var)
                        .map_err(|_| self.unavailable(format!("{var} is not set")))?;
                    config = config.auth_header(token);
                }
                let transport = rmcp::transport::StreamableHttpClientTransport::from_config(config);
                self.handler
                    .clone()
                    .serve(transport)
                    .await
                    .map_err(|e| self.unavailable(format!("initialize failed: {e}")))
            }
        }
    }

    /// Every tool the server offers now.
    ///
    /// # Errors
    ///
    /// [`McpError`] when the server cannot be reached or refuses.
    pub async fn list_tools(&self) -> Result<Vec<rmcp::model::Tool>, McpError> {
        let peer = self.peer().await?;
        tokio::time::timeout(self.spec.init_timeout(), peer.list_all_tools())
            .await
            .map_err(|_| McpError::Timeout {
                server: self.name.clone(),
                after: self.spec.init_timeout(),
            })?
            .map_err(|e| self.service_error(e))
    }

    /// Calls `tool` with `arguments` until `deadline`; dropping the future
    /// (a cancelled call) cancels the request on the server.
    ///
    /// # Errors
    ///
    /// [`McpError`]: unavailable (retryable), refused, or out of time.
    pub async fn call(
        &self,
        tool: &str,
        arguments: serde_json::Map<String, serde_json::Value>,
        deadline: tokio::time::Instant,
    ) -> Result<CallToolResult, McpError> {
        let peer = tokio::time::timeout_at(deadline, self.peer())
            .await
            .map_err(|_| McpError::Timeout {
                server: self.name.clone(),
                after: self.spec.timeout(),
            })??;
        let params = CallToolRequestParams::new(tool.to_string()).with_arguments(arguments);
        match tokio::time::timeout_at(deadline, peer.call_tool(params)).await {
            Ok(r) => r.map_err(|e| self.service_error(e)),
            Err(_) => Err(McpError::Timeout {
                server: self.name.clone(),
                after: self.spec.timeout(),
            }),
        }
    }

    fn service_error(&self, e: rmcp::service::ServiceError) -> McpError {
        use rmcp::service::ServiceError as E;
        match e {
            E::McpError(data) => McpError::Refused {
                server: self.name.clone(),
                message: data.message.to_string(),
            },
            E::Timeout { timeout } => McpError::Timeout {
                server: self.name.clone(),
                after: timeout,
            },
            // Gone or cut: another attempt may find it back.
            E::TransportSend(_) | E::TransportClosed | E::Cancelled { .. } => self.unavailable(e),
            // An answer we cannot use (a task, a request for input): the
            // same request gets the same answer.
            other => McpError::Refused {
                server: self.name.clone(),
                message: other.to_string(),
            },
        }
    }

    /// Closes the connection (a stdio server's process ends with it).
    pub async fn close(&self) {
        if let Some(r) = self.running.lock().await.take() {
            let _ = r.cancel().await;
        }
    }
}
