//! One MCP server as the worker uses it: connected on first use (and again
//! after it died or closed), its tools listed, its tools called with the
//! call's deadline, cancellation, tenant and user. A server that changes
//! its tool list (`notifications/tools/list_changed`) is noted, for the
//! worker to list it again.
//!
//! A server has one connection ([`Instance`]) for listing and, unless it
//! is `per_tenant`, for every call; a `per_tenant` stdio server gets one
//! child per tenant, started on that tenant's first call, at most
//! `max_children` at once (the least recently used idle one is closed to
//! make room; when none is idle the call is `mcp_unavailable`). Every call
//! carries `_meta` `toolfleet/tenant` (and `toolfleet/user`, when the job
//! has a user the fleet trusts).
//!
//! An HTTP server with `oauth` gets one connection per tenant too, each
//! with its tenant's token ([`crate::oauth`]); a connection whose token
//! is about to expire is made again, and one the server refuses with
//! `401` is made again once with a new token. A connection replaced is
//! never cut: the calls in flight on it hold it ([`Live`]) and finish on
//! it; it closes when the last one ends. A `401` drops a connection (and
//! its token) only while it is still the one in use (its generation), so
//! calls refused at once do not drop each other's new connections.
//!
//! One connection attempt at a time per instance: callers that find one in
//! flight wait for its outcome rather than queue for attempts of their own
//! (a server that hangs on `initialize` costs its callers one
//! `init_timeout`, not one each). No lock is held while connecting.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use rmcp::ServiceExt;
use rmcp::model::{
    CallToolRequestParams, CallToolResult, ClientConfig, Implementation, MetaObject,
    RequestMetaObject,
};
use rmcp::service::{NotificationContext, Peer, RoleClient, RunningService};
use tokio::sync::watch;
use toolfleet_worker::Secret;
use toolfleet_worker::settings::Scrubber;

use crate::config::{ServerSpec, Transport};
use crate::pins::Pins;

/// `_meta` key of the tenant a call runs for.
pub const META_TENANT: &str = "toolfleet/tenant";
/// `_meta` key of the user a call runs for (only a user the fleet trusts).
pub const META_USER: &str = "toolfleet/user";

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

/// Who a call runs for: the job's tenant, and its user when the fleet
/// trusts it (both from the job's headers, set by the orchestrator).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Caller {
    pub tenant: String,
    pub user: Option<String>,
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

/// A live connection as its users hold it: the service stays up while
/// any holds it (dropping the last closes it).
#[derive(Clone)]
struct Live {
    service: Arc<RunningService<RoleClient, Handler>>,
    /// Which connection of its instance this is (the attempt's number).
    generation: u64,
    /// The OAuth token it was made with.
    token: Option<String>,
    /// When its OAuth token stops being used.
    expires: Option<tokio::time::Instant>,
}

impl Live {
    fn peer(&self) -> &Peer<RoleClient> {
        self.service.peer()
    }

    /// Open, and its token (if any) not about to expire.
    fn usable(&self) -> bool {
        self.expires.is_none_or(|e| e > tokio::time::Instant::now())
            && !self.service.is_closed()
            && !self.service.peer().is_transport_closed()
    }
}

/// A connection made: the service, its token and when that expires.
type Connected = (
    RunningService<RoleClient, Handler>,
    Option<String>,
    Option<tokio::time::Instant>,
);

/// An attempt's outcome, as its callers share it.
type Outcome = Result<Live, McpError>;

/// A connection, and the attempt to make one in flight (if any). Only
/// ever locked for a moment, never across an await.
#[derive(Default)]
struct Connection {
    running: Option<Live>,
    /// The attempt in flight: its number, and where its outcome appears
    /// (its sender dropped unanswered when its caller gave up on it).
    connecting: Option<(u64, watch::Receiver<Option<Outcome>>)>,
    attempts: u64,
    /// A connection was lost and none made since: the next one may offer
    /// other tools.
    lost: bool,
}

/// One connection to the server: the shared one, or a tenant's child.
#[derive(Default)]
struct Instance {
    /// The tenant of a `per_tenant` child.
    tenant: Option<String>,
    handler: Handler,
    connection: Mutex<Connection>,
}

impl Instance {
    /// The connection state. Nothing panics while holding it, so a
    /// poisoned lock still holds a consistent state.
    fn connection(&self) -> MutexGuard<'_, Connection> {
        self.connection
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    async fn close(&self) {
        let running = self.connection().running.take();
        if let Some(live) = running {
            match Arc::try_unwrap(live.service) {
                Ok(service) => {
                    let _ = service.cancel().await;
                }
                // Calls hold it still: it is closing, they end with it.
                Err(shared) => shared.cancellation_token().cancel(),
            }
        }
    }

    /// Drops connection `generation` if it is still the one in use (the
    /// server refused its token); its calls in flight keep it until they
    /// end.
    fn drop_if(&self, generation: u64) {
        let mut connection = self.connection();
        if connection
            .running
            .as_ref()
            .is_some_and(|l| l.generation == generation)
        {
            connection.running = None;
        }
    }
}

/// The `per_tenant` children: tenant → (instance, last use).
#[derive(Default)]
struct Children {
    by_tenant: BTreeMap<String, (Arc<Instance>, u64)>,
    uses: u64,
}

/// One configured server and its connections (if any).
pub struct Server {
    pub name: String,
    spec: ServerSpec,
    /// The worker's own secrets: scrubbed from the children's stderr.
    secrets: Vec<Secret>,
    /// The digests of its tools this process pinned.
    pub pins: Pins,
    shared: Arc<Instance>,
    children: Mutex<Children>,
    /// The tokens of an HTTP server with `oauth`.
    oauth: Option<crate::oauth::OAuth>,
}

/// What a caller of [`Server::peer`] does, decided under the lock.
enum Step {
    Live(Live),
    Wait(watch::Receiver<Option<Outcome>>),
    Connect(u64, watch::Sender<Option<Outcome>>),
}

/// Ends attempt `.1` if its caller gives up on it before it stored its
/// outcome (the call was cancelled or ran out of time): its waiters, woken
/// by its sender's drop, then make an attempt of their own.
struct Attempt<'a>(&'a Instance, u64);

impl Drop for Attempt<'_> {
    fn drop(&mut self) {
        let mut connection = self.0.connection();
        if connection
            .connecting
            .as_ref()
            .is_some_and(|(n, _)| *n == self.1)
        {
            connection.connecting = None;
        }
    }
}

impl std::fmt::Debug for Server {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Server").field("name", &self.name).finish()
    }
}

impl Server {
    pub fn new(name: impl Into<String>, spec: ServerSpec) -> Arc<Self> {
        Self::with_secrets(name, spec, Vec::new())
    }

    /// A server whose children's stderr is also scrubbed of `secrets` (the
    /// worker's own credentials).
    pub fn with_secrets(
        name: impl Into<String>,
        spec: ServerSpec,
        secrets: Vec<Secret>,
    ) -> Arc<Self> {
        let oauth = match (&spec.oauth, &spec.url) {
            (Some(o), Some(url)) => Some(crate::oauth::OAuth::new(
                o.clone(),
                url,
                spec.init_timeout(),
            )),
            _ => None,
        };
        Arc::new(Self {
            name: name.into(),
            spec,
            secrets,
            pins: Pins::default(),
            shared: Arc::default(),
            children: Mutex::default(),
            oauth,
        })
    }

    pub fn spec(&self) -> &ServerSpec {
        &self.spec
    }

    /// Resolves after the server said its tool list changed (since the
    /// last [`Server::take_changed`]).
    pub async fn changed(&self) {
        let handler = &self.shared.handler;
        loop {
            let notified = handler.notify.notified();
            if handler.changed.load(Ordering::Acquire) {
                return;
            }
            notified.await;
        }
    }

    /// Whether the tool list changed; clears the flag.
    pub fn take_changed(&self) -> bool {
        self.shared.handler.changed.swap(false, Ordering::AcqRel)
    }

    fn unavailable(&self, message: impl std::fmt::Display) -> McpError {
        McpError::Unavailable {
            server: self.name.clone(),
            message: message.to_string(),
        }
    }

    /// The instance `caller`'s calls go to: the shared one, or (per
    /// tenant) the tenant's, made room for by closing the least recently
    /// used idle one.
    fn instance_for(&self, caller: &Caller) -> Result<Arc<Instance>, McpError> {
        if !self.spec.per_tenant && self.oauth.is_none() {
            return Ok(self.shared.clone());
        }
        let (instance, evicted) = {
            let mut children = self.children.lock().unwrap_or_else(PoisonError::into_inner);
            children.uses += 1;
            let now = children.uses;
            if let Some((instance, used)) = children.by_tenant.get_mut(&caller.tenant) {
                *used = now;
                return Ok(instance.clone());
            }
            let mut evicted = None;
            if children.by_tenant.len() >= self.spec.max_children {
                let idle = children
                    .by_tenant
                    .iter()
                    .filter(|(_, (i, _))| Arc::strong_count(i) == 1)
                    .min_by_key(|(_, (_, used))| *used)
                    .map(|(t, _)| t.clone());
                let Some(idle) = idle else {
                    return Err(self.unavailable(format!(
                        "its {} tenants' children (max_children) are all busy",
                        self.spec.max_children
                    )));
                };
                evicted = children.by_tenant.remove(&idle).map(|(i, _)| i);
            }
            let instance = Arc::new(Instance {
                tenant: Some(caller.tenant.clone()),
                ..Instance::default()
            });
            children
                .by_tenant
                .insert(caller.tenant.clone(), (instance.clone(), now));
            (instance, evicted)
        };
        if let Some(old) = evicted {
            tracing::info!(server = %self.name, tenant = old.tenant.as_deref().unwrap_or("-"), "closing the least recently used tenant's MCP child");
            tokio::spawn(async move { old.close().await });
        }
        Ok(instance)
    }

    /// The live connection (held: it stays up while the caller holds
    /// it), connecting (again) when there is none, the last one closed or
    /// its token is about to expire, or waiting for the attempt in flight.
    async fn peer(&self, instance: &Instance) -> Result<Live, McpError> {
        loop {
            let step = {
                let mut connection = instance.connection();
                match (&connection.running, &connection.connecting) {
                    (Some(live), _) if live.usable() => Step::Live(live.clone()),
                    (_, Some((_, outcome))) => Step::Wait(outcome.clone()),
                    (_, None) => {
                        match connection.running.take() {
                            // Its token expires: connect again with a new
                            // one (the tools are the same). The old one is
                            // not cut: its calls in flight hold it.
                            Some(old)
                                if !old.service.is_closed()
                                    && !old.peer().is_transport_closed() => {}
                            Some(_) => {
                                connection.lost = true;
                                tracing::warn!(
                                    server = %self.name,
                                    "MCP server connection closed; connecting again"
                                );
                            }
                            None => {}
                        }
                        let (tx, rx) = watch::channel(None);
                        connection.attempts += 1;
                        connection.connecting = Some((connection.attempts, rx));
                        Step::Connect(connection.attempts, tx)
                    }
                }
            };
            match step {
                Step::Live(live) => return Ok(live),
                Step::Wait(mut attempt) => {
                    if let Ok(outcome) = attempt.wait_for(Option::is_some).await
                        && let Some(outcome) = &*outcome
                    {
                        return outcome.clone();
                    }
                    // Its caller gave up on it unanswered: try again.
                }
                Step::Connect(n, tx) => {
                    // Declared after `tx`, dropped before it: the attempt
                    // is gone when its waiters wake.
                    let attempt = Attempt(instance, n);
                    let outcome = self.attempt(instance, n).await;
                    drop(attempt);
                    tx.send_replace(Some(outcome.clone()));
                    return outcome;
                }
            }
        }
    }

    /// Connects within the init timeout and stores the connection as
    /// `generation`.
    async fn attempt(&self, instance: &Instance, generation: u64) -> Outcome {
        let connected = tokio::time::timeout(self.spec.init_timeout(), self.connect(instance))
            .await
            .map_err(|_| McpError::Timeout {
                server: self.name.clone(),
                after: self.spec.init_timeout(),
            })??;
        let (service, token, expires) = connected;
        let live = Live {
            service: Arc::new(service),
            generation,
            token,
            expires,
        };
        let again = {
            let mut connection = instance.connection();
            connection.running = Some(live.clone());
            std::mem::take(&mut connection.lost)
        };
        if again && instance.tenant.is_none() {
            // A server started again may offer other tools.
            instance.handler.changed.store(true, Ordering::Release);
            instance.handler.notify.notify_waiters();
        }
        Ok(live)
    }

    /// A connection, its OAuth token and when that expires (if it has
    /// one).
    async fn connect(&self, instance: &Instance) -> Result<Connected, McpError> {
        match self.spec.transport() {
            Transport::Http { url } if self.oauth.is_some() => {
                self.connect_oauth(instance, &url).await
            }
            Transport::Stdio { program, args } => {
                crate::child::protect_worker();
                let tenant = instance.tenant.as_deref();
                let prepared = crate::child::prepare(&self.spec, &program, &args, tenant)
                    .map_err(|e| self.unavailable(e))?;
                let (transport, stderr) =
                    rmcp::transport::TokioChildProcess::builder(prepared.command)
                        .stderr(std::process::Stdio::piped())
                        .spawn()
                        .map_err(|e| self.unavailable(format!("cannot start {program}: {e}")))?;
                if let Some(stderr) = stderr {
                    let secrets = self.secrets.iter().chain(&prepared.secrets).cloned();
                    crate::child::log_stderr(
                        stderr,
                        Scrubber::new(secrets),
                        self.name.clone(),
                        instance.tenant.clone(),
                    );
                }
                instance
                    .handler
                    .clone()
                    .serve(transport)
                    .await
                    .map(|r| (r, None, None))
                    .map_err(|e| self.unavailable(format!("initialize failed: {e}")))
            }
            Transport::Http { url } => {
                let _ = rustls::crypto::ring::default_provider().install_default();
                let mut config =
                    rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(
                        url.as_str(),
                    );
                if let Some(token) = self.bearer_token()? {
                    config = config.auth_header(token);
                }
                let transport = rmcp::transport::StreamableHttpClientTransport::from_config(config);
                instance
                    .handler
                    .clone()
                    .serve(transport)
                    .await
                    .map(|r| (r, None, None))
                    .map_err(|e| self.unavailable(format!("initialize failed: {e}")))
            }
        }
    }

    /// Connects to an HTTP server with the instance's tenant's OAuth
    /// token; a `401` drops the token and tries once more with a new one.
    async fn connect_oauth(&self, instance: &Instance, url: &str) -> Result<Connected, McpError> {
        let Some(oauth) = &self.oauth else {
            return Err(self.unavailable("no OAuth client"));
        };
        let tenant = instance.tenant.as_deref();
        let _ = rustls::crypto::ring::default_provider().install_default();
        for attempt in 0..2 {
            let (token, until) = oauth.token(tenant).await.map_err(|e| self.unavailable(e))?;
            let config =
                rmcp::transport::streamable_http_client::StreamableHttpClientTransportConfig::with_uri(
                    url,
                )
                .auth_header(token.clone());
            let transport = rmcp::transport::StreamableHttpClientTransport::from_config(config);
            match instance.handler.clone().serve(transport).await {
                Ok(running) => return Ok((running, Some(token), Some(until))),
                Err(e) if attempt == 0 && format!("{e:?}").contains("AuthRequired") => {
                    tracing::info!(server = %self.name, tenant = tenant.unwrap_or("-"), "MCP server refused the OAuth token; getting a new one");
                    oauth.refused(tenant, &token).await;
                }
                Err(e) => return Err(self.unavailable(format!("initialize failed: {e}"))),
            }
        }
        Err(self.unavailable("the server refused a new OAuth token too"))
    }

    /// The HTTP server's bearer token, from its file or variable.
    fn bearer_token(&self) -> Result<Option<String>, McpError> {
        if let Some(path) = &self.spec.bearer_token_file {
            return crate::child::read_secret(path)
                .map(Some)
                .map_err(|e| self.unavailable(format!("bearer_token_file: {e}")));
        }
        match &self.spec.bearer_token_env {
            Some(var) => std::env::var(var)
                .map(Some)
                .map_err(|_| self.unavailable(format!("{var} is not set"))),
            None => Ok(None),
        }
    }

    /// Every tool the server offers now.
    ///
    /// # Errors
    ///
    /// [`McpError`] when the server cannot be reached or refuses.
    pub async fn list_tools(&self) -> Result<Vec<rmcp::model::Tool>, McpError> {
        let live = self.peer(&self.shared).await?;
        tokio::time::timeout(self.spec.init_timeout(), live.peer().list_all_tools())
            .await
            .map_err(|_| McpError::Timeout {
                server: self.name.clone(),
                after: self.spec.init_timeout(),
            })?
            .map_err(|e| self.service_error(e))
    }

    /// Calls `tool` with `arguments` for `caller` until `deadline`;
    /// dropping the future (a cancelled call) cancels the request on the
    /// server.
    ///
    /// # Errors
    ///
    /// [`McpError`]: unavailable (retryable), refused, or out of time.
    pub async fn call(
        &self,
        caller: &Caller,
        tool: &str,
        arguments: serde_json::Map<String, serde_json::Value>,
        deadline: tokio::time::Instant,
    ) -> Result<CallToolResult, McpError> {
        let instance = self.instance_for(caller)?;
        let mut params = CallToolRequestParams::new(tool.to_string()).with_arguments(arguments);
        params.meta = Some(meta(caller));
        let (called, live) = self.call_once(&instance, params.clone(), deadline).await?;
        match (&self.oauth, called) {
            // The server refused the token (it expired early, or the
            // server forgot it): it never ran the call, so one more try
            // on a connection with a new token. The connection and token
            // are dropped only if still the ones in use: another call
            // refused at the same time may have replaced them already.
            (Some(oauth), Err(e)) if auth_refused(&e) => {
                tracing::info!(server = %self.name, tenant = %caller.tenant, "MCP server refused the OAuth token; connecting with a new one");
                if let Some(token) = &live.token {
                    oauth.refused(instance.tenant.as_deref(), token).await;
                }
                instance.drop_if(live.generation);
                drop(live);
                self.call_once(&instance, params, deadline)
                    .await?
                    .0
                    .map_err(|e| self.service_error(e))
            }
            (_, called) => called.map_err(|e| self.service_error(e)),
        }
    }

    /// One `tools/call` on the instance's connection (made if need be),
    /// which it holds until the call ends: the error of connecting, or the
    /// call's outcome and the connection it was made on.
    async fn call_once(
        &self,
        instance: &Instance,
        params: CallToolRequestParams,
        deadline: tokio::time::Instant,
    ) -> Result<(Result<CallToolResult, rmcp::service::ServiceError>, Live), McpError> {
        let timeout = || McpError::Timeout {
            server: self.name.clone(),
            after: self.spec.timeout(),
        };
        let live = tokio::time::timeout_at(deadline, self.peer(instance))
            .await
            .map_err(|_| timeout())??;
        let called = tokio::time::timeout_at(deadline, live.peer().call_tool(params))
            .await
            .map_err(|_| timeout())?;
        Ok((called, live))
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

    /// Closes every connection (a stdio server's processes end with them).
    pub async fn close(&self) {
        self.shared.close().await;
        let children: Vec<Arc<Instance>> = {
            let mut children = self.children.lock().unwrap_or_else(PoisonError::into_inner);
            std::mem::take(&mut children.by_tenant)
                .into_values()
                .map(|(i, _)| i)
                .collect()
        };
        for child in children {
            child.close().await;
        }
    }
}

/// Whether a call failed on the server's `401` (its token refused).
fn auth_refused(e: &rmcp::service::ServiceError) -> bool {
    let shown = format!("{e} {e:?}");
    shown.contains("Auth required") || shown.contains("AuthRequired")
}

/// A call's `_meta`: its tenant, and its user when there is one.
fn meta(caller: &Caller) -> RequestMetaObject {
    let mut meta = serde_json::Map::new();
    meta.insert(META_TENANT.into(), caller.tenant.clone().into());
    if let Some(user) = &caller.user {
        meta.insert(META_USER.into(), user.clone().into());
    }
    RequestMetaObject(MetaObject(meta))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stdio server that never answers `initialize` and adds a line to
    /// `starts` each time it is started.
    fn hung(starts: &std::path::Path) -> Arc<Server> {
        let spec: ServerSpec = toml::from_str(&format!(
            r#"
command = ["sh", "-c", "echo started >> '{}'; exec sleep 60"]
init_timeout_ms = 3000
"#,
            starts.display()
        ))
        .unwrap();
        Server::new("hung", spec)
    }

    fn starts(path: &std::path::Path) -> usize {
        std::fs::read_to_string(path)
            .unwrap_or_default()
            .lines()
            .count()
    }

    /// Waits (with a deadline) until the server was started `n` times.
    async fn started(path: &std::path::Path, n: usize) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while starts(path) < n {
            assert!(
                tokio::time::Instant::now() < deadline,
                "started {} times, not {n}",
                starts(path)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn callers_share_the_connection_attempt_in_flight() {
        let dir = std::env::temp_dir().join(format!("toolfleet-mcp-server-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("starts");
        let _ = std::fs::remove_file(&path);
        let server = hung(&path);

        // Three callers at once: one start, whose timeout all three get
        // (not three starts, one after another).
        let (a, b, c, ()) = tokio::join!(
            server.list_tools(),
            server.list_tools(),
            server.list_tools(),
            started(&path, 1)
        );
        for r in [a, b, c] {
            assert!(matches!(r, Err(McpError::Timeout { .. })), "{r:?}");
        }
        assert_eq!(starts(&path), 1, "one attempt for the three callers");

        // A caller that gives up on its attempt leaves those waiting for
        // it to make their own.
        let mut first = Box::pin(server.list_tools());
        assert!(futures::FutureExt::now_or_never(&mut first).is_none());
        let mut second = Box::pin(server.list_tools());
        assert!(futures::FutureExt::now_or_never(&mut second).is_none());
        started(&path, 2).await;
        drop(first);
        let (second, ()) = tokio::join!(
            tokio::time::timeout(Duration::from_secs(30), second),
            started(&path, 3)
        );
        let second = second.expect("the waiter made an attempt of its own");
        assert!(
            matches!(second, Err(McpError::Timeout { .. })),
            "{second:?}"
        );
        assert_eq!(starts(&path), 3);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
