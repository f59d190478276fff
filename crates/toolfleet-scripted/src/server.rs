//! HTTP serving: the routes, `GET /v1/models` and the 404 for any other
//! URL, the accept loop (HTTP/1.1 and HTTP/2 on one port), [`serve`] for
//! the CLI and [`ScriptedServer`] for tests, which runs in the background
//! and reads back what the server recorded.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, PoisonError};
use std::time::Duration;

use axum::Router;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use url::Url;

use crate::embeddings::embeddings;
use crate::handler::{chat_completions, responses};
use crate::images::images;
use crate::request::ApiError;
use crate::script::Script;
use crate::state::{Received, ServerState, StreamStats};

/// Request bodies carry whole conversations with tool results.
const MAX_REQUEST_BYTES: usize = 32 * 1024 * 1024;

fn router(state: Arc<ServerState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(responses))
        .route("/v1/models", get(models))
        .route("/v1/images/generations", post(images))
        .route("/v1/embeddings", post(embeddings))
        .fallback(unknown_url)
        .layer(DefaultBodyLimit::max(MAX_REQUEST_BYTES))
        .with_state(state)
}

async fn models(State(state): State<Arc<ServerState>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{
            "id": state.script.model(),
            "object": "model",
            "created": 0,
            "owned_by": "toolfleet (scripted stand-in, not a real model)",
        }],
    }))
    .into_response()
}

async fn unknown_url(method: Method, uri: Uri) -> Response {
    ApiError {
        status: StatusCode::NOT_FOUND,
        message: format!(
            "Unknown request URL: {method} {}. The scripted stand-in serves POST /v1/chat/completions, POST /v1/responses, POST /v1/images/generations, POST /v1/embeddings and GET /v1/models.",
            uri.path()
        ),
        param: None,
        code: Some("unknown_url"),
    }
    .into_response()
}

async fn serve_state(
    listener: TcpListener,
    state: Arc<ServerState>,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    tracing::info!(
        %addr,
        model = %state.script.model(),
        "scripted model server (a stand-in for an OpenAI-compatible provider) listening on {addr}"
    );
    // HTTP/1.1 and HTTP/2 (h2c by prior knowledge) on one port, as
    // providers serve both; HTTP/2 without hyper's default cap of 200
    // streams per connection, so a client multiplexing thousands of
    // waiting calls is not throttled by the stand-in.
    let mut builder =
        hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    builder
        .http2()
        .max_concurrent_streams(MAX_HTTP2_STREAMS)
        // A client's cancels (a cancelled invocation drops its stream) are
        // not an attack here.
        .max_pending_accept_reset_streams(None)
        .max_local_error_reset_streams(None);
    let app = router(state.clone());
    let graceful = hyper_util::server::graceful::GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let tcp = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((tcp, _)) => tcp,
                Err(e) => {
                    // Out of descriptors, say: wait rather than spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        // Every SSE chunk is a small write: without TCP_NODELAY, Nagle's
        // algorithm meets the client's delayed ACK and each round trip
        // gains ~40 ms that no real provider adds.
        let _ = tcp.set_nodelay(true);
        state.connections.fetch_add(1, Ordering::Relaxed);
        let service = {
            use tower::ServiceExt;
            hyper_util::service::TowerToHyperService::new(app.clone().map_request(
                |req: axum::http::Request<hyper::body::Incoming>| req.map(axum::body::Body::new),
            ))
        };
        let conn = builder
            .serve_connection_with_upgrades(hyper_util::rt::TokioIo::new(tcp), service)
            .into_owned();
        let conn = graceful.watch(conn);
        tokio::spawn(async move {
            let _ = conn.await;
        });
    }
    drop(listener);
    // Open responses finish (the caller bounds how long it waits).
    graceful.shutdown().await;
    Ok(())
}

/// HTTP/2 streams the stand-in allows on one connection.
const MAX_HTTP2_STREAMS: u32 = 100_000;

/// Serves `script` on `listener` until `shutdown` completes. The CLI's
/// `toolfleet scripted-model --listen ADDR --script FILE` runs this.
pub async fn serve(
    listener: TcpListener,
    script: Script,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    serve_state(listener, Arc::new(ServerState::new(script)), shutdown).await
}

/// How long [`ScriptedServer::shutdown`] lets open streams finish.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// A scripted server running in a background task, for tests.
pub struct ScriptedServer {
    addr: SocketAddr,
    base_url: Url,
    state: Arc<ServerState>,
    stop: CancellationToken,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl ScriptedServer {
    /// Binds `listen` (use `127.0.0.1:0` in tests) and serves in the
    /// background until [`shutdown`](Self::shutdown) or drop.
    pub async fn start(listen: SocketAddr, script: Script) -> std::io::Result<Self> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let base_url = Url::parse(&format!("http://{addr}/v1"))
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let state = Arc::new(ServerState::new(script));
        let stop = CancellationToken::new();
        let task = tokio::spawn(serve_state(
            listener,
            state.clone(),
            stop.clone().cancelled_owned(),
        ));
        Ok(Self {
            addr,
            base_url,
            state,
            stop,
            task: Some(task),
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR/v1`, the base URL for an OpenAI client.
    pub fn base_url(&self) -> Url {
        self.base_url.clone()
    }

    /// The script being played.
    pub fn script(&self) -> &Script {
        &self.state.script
    }

    /// Every request body received so far, oldest first (the last 1000).
    /// A body that was not JSON appears as a JSON string.
    pub fn requests(&self) -> Vec<Value> {
        self.state
            .received
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .map(|r| r.body.clone())
            .collect()
    }

    /// Every request received so far with its time, path, query, headers
    /// and injected fault, oldest first (the last 1000).
    pub fn received(&self) -> Vec<Received> {
        self.state
            .received
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter()
            .cloned()
            .collect()
    }

    /// How many TCP connections the server accepted, over its life (with
    /// HTTP/2, calls in flight share connections; with HTTP/1.1 each holds
    /// one).
    pub fn connections(&self) -> u64 {
        self.state.connections.load(Ordering::Relaxed)
    }

    /// How many requests got a scripted fault, over the server's life.
    pub fn fault_hits(&self) -> u64 {
        self.state.fault_hits.load(Ordering::Relaxed)
    }

    /// How the streamed bodies have ended so far.
    pub fn stream_stats(&self) -> StreamStats {
        *self.state.streams.borrow()
    }

    /// Waits until the stream counts satisfy `ready` and returns them.
    /// Unbounded: wrap it in a timeout.
    pub async fn wait_for_streams(
        &self,
        mut ready: impl FnMut(&StreamStats) -> bool,
    ) -> StreamStats {
        let mut changes = self.state.streams.subscribe();
        // The sender lives in `self.state`, so the channel cannot close
        // while we hold `self`.
        match changes.wait_for(|s| ready(s)).await {
            Ok(stats) => *stats,
            Err(_) => self.stream_stats(),
        }
    }

    /// Stops accepting, lets open responses finish for a few seconds, then
    /// stops.
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        if let Some(mut task) = self.task.take()
            && tokio::time::timeout(SHUTDOWN_GRACE, &mut task)
                .await
                .is_err()
        {
            task.abort();
        }
    }
}

impl Drop for ScriptedServer {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::DEFAULT_MODEL;
    use crate::test_support::{install_crypto_provider, post, start, within};

    #[tokio::test]
    async fn bad_requests_get_openai_errors_and_are_recorded() {
        let (server, client) = start("{}").await;
        let (status, _, text) = post(&client, &server, "{not json".to_owned()).await;
        assert_eq!(status, 400);
        let error: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(error["error"]["type"], json!("invalid_request_error"));
        assert_eq!(error["error"]["code"], json!("invalid_json"));
        assert!(error["error"]["message"].is_string());

        let (status, _, text) = post(&client, &server, json!({"model": "m"}).to_string()).await;
        assert_eq!(status, 400);
        let error: Value = serde_json::from_str(&text).expect("json");
        assert_eq!(error["error"]["param"], json!("messages"));

        assert_eq!(
            server.requests(),
            [json!("{not json"), json!({"model": "m"})],
            "every body is recorded, even rejected ones"
        );

        let models = within(client.get(format!("{}/models", server.base_url())).send())
            .await
            .expect("models");
        let models: Value = within(models.json()).await.expect("json");
        assert_eq!(models["data"][0]["id"], json!(DEFAULT_MODEL));
        assert!(
            models["data"][0]["owned_by"]
                .as_str()
                .is_some_and(|o| o.contains("stand-in"))
        );

        let missing = within(
            client
                .get(format!("http://{}/v1/nope", server.addr()))
                .send(),
        )
        .await
        .expect("404");
        assert_eq!(missing.status().as_u16(), 404);
        let error: Value = within(missing.json()).await.expect("json");
        assert_eq!(error["error"]["code"], json!("unknown_url"));
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn serve_runs_until_its_shutdown_future_completes() {
        install_crypto_provider();
        let listener = within(TcpListener::bind("127.0.0.1:0"))
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(serve(
            listener,
            Script::from_json(r#"{"model": "custom-stand-in"}"#).expect("script"),
            async {
                let _ = stopped.await;
            },
        ));
        let response = within(
            reqwest::Client::new()
                .get(format!("http://{addr}/v1/models"))
                .send(),
        )
        .await
        .expect("models");
        let models: Value = within(response.json()).await.expect("json");
        assert_eq!(models["data"][0]["id"], json!("custom-stand-in"));
        stop.send(()).expect("server still running");
        within(task).await.expect("join").expect("serve returns Ok");
    }
}
