//! The only module that speaks provider HTTP: OpenAI Chat Completions,
//! streamed and not.
//!
//! The rest of the crate works with the neutral conversation types defined
//! here ([`Message`], [`ToolCall`], [`ChatRequest`], [`Completion`]); the
//! Chat Completions wire shape lives in private serde types in `chat_wire`
//! and never leaks out.
//!
//! # Layout
//!
//! - this file: neutral types, [`LlmConfig`], [`LlmClient`] (request,
//!   timeouts, status handling);
//! - `chat_wire`: wire types, `to_wire` / `from_wire`, and
//!   [`ChatStreamAccumulator`], which reassembles a streamed completion;
//! - `sse`: [`SseDecoder`], bytes to server-sent events;
//! - `error`: [`LlmError`] and [`LlmErrorKind`].
//!
//! # Invariants
//!
//! - The API key is sent only in the `Authorization` header (marked
//!   sensitive) and never appears in `Debug` output, logs or error messages;
//!   error messages are built here, provider text is bounded and scrubbed.
//! - Decoding is pure and synchronous ([`SseDecoder`],
//!   [`ChatStreamAccumulator`]), so it is tested byte-for-byte against
//!   recorded provider streams without a network.
//! - Every wait on the network is bounded: `connect_timeout` for the TCP/TLS
//!   connect, `first_token_timeout` until the first event arrives,
//!   `idle_timeout` between chunks after that.

mod chat_wire;
mod error;
mod sse;

use std::fmt;
use std::ops::AddAssign;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use reqwest::header::{self, HeaderMap, HeaderValue};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;
use url::Url;

pub use chat_wire::ChatStreamAccumulator;
pub use error::{LlmError, LlmErrorKind};
pub use sse::{MAX_EVENT_BYTES, SseDecoder, SseEvent};

/// One turn of a conversation, in neutral form.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum Message {
    System {
        content: String,
    },
    User {
        content: String,
    },
    Assistant {
        content: Option<String>,
        tool_calls: Vec<ToolCall>,
    },
    Tool {
        call_id: String,
        content: String,
    },
}

/// A function call the model asked for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    /// The raw JSON text exactly as the model produced it. It may be invalid
    /// (for example cut short by `max_tokens`); validating it is the
    /// caller's job at its boundary.
    pub arguments: String,
}

/// One call to the model.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Message>,
    /// Tool definitions already in Chat Completions wire shape:
    /// `{"type":"function","function":{name,description,parameters,strict}}`.
    pub tools: Vec<serde_json::Value>,
    pub parallel_tool_calls: bool,
    pub temperature: Option<f32>,
    pub max_tokens: Option<u32>,
}

/// What the model answered.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// The content text; empty when the model only called tools or refused.
    pub text: String,
    /// The refusal text, when the model declined (`delta.refusal`).
    pub refusal: Option<String>,
    /// The calls to run, in the model's order. This list, not
    /// `finish_reason`, says whether there is tool work: some compatible
    /// servers report `stop` next to tool calls.
    pub tool_calls: Vec<ToolCall>,
    pub finish_reason: FinishReason,
    pub usage: Option<Usage>,
}

impl Completion {
    /// The assistant message to append to the conversation before the tool
    /// results.
    pub fn assistant_message(&self) -> Message {
        Message::Assistant {
            content: (!self.text.is_empty()).then(|| self.text.clone()),
            tool_calls: self.tool_calls.clone(),
        }
    }
}

/// Why the model stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    ToolCalls,
    Length,
    ContentFilter,
    /// Anything else the provider said, verbatim.
    Other(String),
}

/// Token counts for one call, or summed over many with `+=`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
    pub total_tokens: u64,
    /// `prompt_tokens_details.cached_tokens`: the part of the prompt served
    /// from the provider's prompt cache.
    pub cached_tokens: u64,
    /// `completion_tokens_details.reasoning_tokens`.
    pub reasoning_tokens: u64,
}

impl AddAssign for Usage {
    fn add_assign(&mut self, other: Self) {
        self.prompt_tokens += other.prompt_tokens;
        self.completion_tokens += other.completion_tokens;
        self.total_tokens += other.total_tokens;
        self.cached_tokens += other.cached_tokens;
        self.reasoning_tokens += other.reasoning_tokens;
    }
}

pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Generous because reasoning models may think for a long time before the
/// first token, and a non-streaming call waits for the whole answer.
pub const DEFAULT_FIRST_TOKEN_TIMEOUT: Duration = Duration::from_secs(120);
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the provider is and how long to wait for it.
#[derive(Clone)]
pub struct LlmConfig {
    /// The API root, e.g. `http://127.0.0.1:8080/v1`; requests go to
    /// `{base_url}/chat/completions` (with or without a trailing slash, and
    /// any query string such as `api-version` is kept).
    pub base_url: Url,
    pub api_key: Option<String>,
    /// TCP (and TLS) connect.
    pub connect_timeout: Duration,
    /// From sending the request until the first event of a stream, or the
    /// response headers of a non-streaming call (which a provider sends only
    /// when the whole answer is ready).
    pub first_token_timeout: Duration,
    /// Longest gap between two chunks of a response body.
    pub idle_timeout: Duration,
}

impl LlmConfig {
    /// A config with the `DEFAULT_*` timeouts and no API key.
    pub fn new(base_url: Url) -> Self {
        Self {
            base_url,
            api_key: None,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            first_token_timeout: DEFAULT_FIRST_TOKEN_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
        }
    }
}

impl fmt::Debug for LlmConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmConfig")
            .field("base_url", &redacted_url(&self.base_url))
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .field("connect_timeout", &self.connect_timeout)
            .field("first_token_timeout", &self.first_token_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .finish()
    }
}

/// A URL for humans: no user info and no query, either of which may carry a
/// credential.
fn redacted_url(url: &Url) -> String {
    let mut shown = url.clone();
    // Both setters only fail for URLs that cannot have credentials at all.
    let _ = shown.set_username("");
    let _ = shown.set_password(None);
    if shown.query().is_some() {
        shown.set_query(Some("[redacted]"));
    }
    shown.to_string()
}

/// Installs rustls' `ring` crypto provider for the process. reqwest is built
/// with `rustls-no-provider`, so something must do this before the first
/// client is built; doing it again is harmless.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Largest non-streaming or error body we read. A chat completion is a few
/// kilobytes; this only stops a broken server from filling memory.
const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;
/// Error bodies are read only for their code and message.
const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;

/// A Chat Completions client. Cheap to clone: clones share one connection
/// pool.
#[derive(Clone)]
pub struct LlmClient {
    inner: Arc<Inner>,
}

struct Inner {
    http: reqwest::Client,
    endpoint: Url,
    /// `host:port`, the only part of the endpoint that goes into messages.
    server: String,
    authorization: Option<HeaderValue>,
    /// Kept only to scrub it from provider-supplied error text.
    api_key: Option<String>,
    first_token_timeout: Duration,
    idle_timeout: Duration,
}

impl fmt::Debug for LlmClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmClient")
            .field("endpoint", &redacted_url(&self.inner.endpoint))
            .finish_non_exhaustive()
    }
}

impl LlmClient {
    /// Builds the client. Fails (kind `Protocol`, code `config`) on a base
    /// URL that is not http(s) or an API key that cannot go in a header.
    pub fn new(config: LlmConfig) -> Result<Self, LlmError> {
        install_crypto_provider();
        let endpoint = chat_completions_url(&config.base_url)?;
        let server = format!(
            "{}:{}",
            endpoint.host_str().unwrap_or("?"),
            endpoint.port_or_known_default().unwrap_or(0)
        );
        let authorization = match config.api_key.as_deref().filter(|k| !k.is_empty()) {
            Some(key) => {
                let mut value = HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| {
                    LlmError::config(
                        "the API key contains characters not allowed in an HTTP header",
                    )
                })?;
                // Keeps it out of hyper's and reqwest's own debug output.
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        let http = reqwest::Client::builder()
            .connect_timeout(config.connect_timeout)
            .user_agent(concat!("toolfleet/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(|e| {
                LlmError::config(format!(
                    "could not build the HTTP client: {}",
                    error_chain(&e)
                ))
            })?;
        Ok(Self {
            inner: Arc::new(Inner {
                http,
                endpoint,
                server,
                authorization,
                api_key: config.api_key.filter(|k| !k.is_empty()),
                first_token_timeout: config.first_token_timeout,
                idle_timeout: config.idle_timeout,
            }),
        })
    }

    /// Streams (`stream: true`, `stream_options.include_usage: true`),
    /// calls `on_text` for every content text delta, and returns the
    /// reassembled completion. On error `on_text` may already have seen part
    /// of the answer.
    pub async fn stream_chat(
        &self,
        req: &ChatRequest,
        mut on_text: impl FnMut(&str) + Send,
    ) -> Result<Completion, LlmError> {
        self.stream_chat_inner(req, &mut on_text)
            .await
            .map_err(|e| e.redact(self.inner.api_key.as_deref()))
    }

    /// The non-streaming variant.
    pub async fn chat(&self, req: &ChatRequest) -> Result<Completion, LlmError> {
        self.chat_inner(req)
            .await
            .map_err(|e| e.redact(self.inner.api_key.as_deref()))
    }

    async fn stream_chat_inner(
        &self,
        req: &ChatRequest,
        on_text: &mut (impl FnMut(&str) + Send),
    ) -> Result<Completion, LlmError> {
        let (mut response, first_deadline) = self.send(req, true).await?;
        if is_json(response.headers()) {
            // A server that ignores `stream: true` answers with one JSON
            // body; that is still a complete, usable answer.
            let body = self.read_body(&mut response, MAX_BODY_BYTES).await?;
            let completion = chat_wire::completion_from_wire(&body)?;
            if !completion.text.is_empty() {
                on_text(&completion.text);
            }
            return Ok(log_completion(completion, true));
        }
        let mut decoder = SseDecoder::new();
        let mut acc = ChatStreamAccumulator::new();
        let mut got_event = false;
        let mut done = false;
        while !done {
            let deadline = if got_event {
                Instant::now() + self.inner.idle_timeout
            } else {
                first_deadline
            };
            let chunk = match tokio::time::timeout_at(deadline, response.chunk()).await {
                Err(_) if got_event => {
                    return Err(LlmError::timeout(format!(
                        "the model provider sent nothing for {:?} mid-stream",
                        self.inner.idle_timeout
                    )));
                }
                Err(_) => return Err(self.first_token_timeout()),
                Ok(Err(e)) => return Err(self.transport_error(e)),
                Ok(Ok(None)) => break,
                Ok(Ok(Some(chunk))) => chunk,
            };
            for event in decoder.push(&chunk)? {
                got_event = true;
                if event.is_done() {
                    done = true;
                    break;
                }
                if let Some(text) = acc.push(&event.data)? {
                    on_text(&text);
                }
            }
        }
        if !done {
            if let Some(event) = decoder.finish() {
                done = event.is_done();
                if !done && let Some(text) = acc.push(&event.data)? {
                    on_text(&text);
                }
            }
            // Without `[DONE]` the answer still counts if the model said it
            // was finished (only the usage chunk may be missing); otherwise
            // the stream was cut and the same request is worth retrying.
            if !done && !acc.is_finished() {
                return Err(LlmError::connection_lost(format!(
                    "the model provider at {} closed the stream before the answer was complete",
                    self.inner.server
                )));
            }
        }
        Ok(log_completion(acc.finish()?, true))
    }

    async fn chat_inner(&self, req: &ChatRequest) -> Result<Completion, LlmError> {
        let (mut response, _) = self.send(req, false).await?;
        let body = self.read_body(&mut response, MAX_BODY_BYTES).await?;
        Ok(log_completion(
            chat_wire::completion_from_wire(&body)?,
            false,
        ))
    }

    /// Sends the request and checks the status. Returns the response and
    /// the deadline for the first event.
    async fn send(
        &self,
        req: &ChatRequest,
        stream: bool,
    ) -> Result<(reqwest::Response, Instant), LlmError> {
        let body = serde_json::to_vec(&chat_wire::to_wire(req, stream))
            .map_err(|e| LlmError::protocol(format!("could not encode the request: {e}")))?;
        tracing::debug!(
            model = %req.model,
            messages = req.messages.len(),
            tools = req.tools.len(),
            stream,
            "chat completion request"
        );
        let mut request = self
            .inner
            .http
            .post(self.inner.endpoint.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .header(
                header::ACCEPT,
                if stream {
                    "text/event-stream"
                } else {
                    "application/json"
                },
            )
            .body(body);
        if let Some(authorization) = &self.inner.authorization {
            request = request.header(header::AUTHORIZATION, authorization.clone());
        }
        let first_deadline = Instant::now() + self.inner.first_token_timeout;
        let mut response = match tokio::time::timeout_at(first_deadline, request.send()).await {
            Err(_) => return Err(self.first_token_timeout()),
            Ok(Err(e)) => return Err(self.transport_error(e)),
            Ok(Ok(response)) => response,
        };
        let status = response.status();
        if !status.is_success() {
            let retry_after = retry_after(response.headers());
            // The body only adds detail; a status error stands without it.
            let body = self
                .read_body(&mut response, MAX_ERROR_BODY_BYTES)
                .await
                .unwrap_or_default();
            let (code, message) = chat_wire::error_body_fields(&body);
            let status = status.as_u16();
            let message = match (status, message) {
                // OpenAI echoes part of a rejected key in its 401 message.
                (401 | 403, _) => {
                    format!("the model provider rejected the credentials (HTTP {status})")
                }
                (_, Some(message)) => {
                    format!("the model provider returned HTTP {status}: {message}")
                }
                (_, None) => format!("the model provider returned HTTP {status}"),
            };
            return Err(LlmError::status(status, code, message).with_retry_after(retry_after));
        }
        Ok((response, first_deadline))
    }

    /// Reads a whole body, bounded in size and by `idle_timeout` per chunk.
    async fn read_body(
        &self,
        response: &mut reqwest::Response,
        limit: usize,
    ) -> Result<Vec<u8>, LlmError> {
        let mut body = Vec::new();
        loop {
            let chunk: Option<Bytes> =
                match tokio::time::timeout(self.inner.idle_timeout, response.chunk()).await {
                    Err(_) => {
                        return Err(LlmError::timeout(format!(
                            "the model provider sent nothing for {:?} mid-body",
                            self.inner.idle_timeout
                        )));
                    }
                    Ok(Err(e)) => return Err(self.transport_error(e)),
                    Ok(Ok(chunk)) => chunk,
                };
            let Some(chunk) = chunk else {
                return Ok(body);
            };
            if body.len() + chunk.len() > limit {
                return Err(LlmError::protocol(format!(
                    "response body larger than {limit} bytes"
                )));
            }
            body.extend_from_slice(&chunk);
        }
    }

    fn first_token_timeout(&self) -> LlmError {
        LlmError::timeout(format!(
            "no response from the model provider at {} within {:?}",
            self.inner.server, self.inner.first_token_timeout
        ))
    }

    /// Maps a reqwest failure. The URL is stripped first: it may carry a
    /// credential in its query or user info.
    fn transport_error(&self, error: reqwest::Error) -> LlmError {
        let error = error.without_url();
        let server = &self.inner.server;
        if error.is_connect() {
            LlmError::connect(format!(
                "could not connect to the model provider at {server}: {}",
                error_chain(&error)
            ))
        } else if error.is_timeout() {
            LlmError::timeout(format!(
                "timed out talking to the model provider at {server}: {}",
                error_chain(&error)
            ))
        } else {
            LlmError::connection_lost(format!(
                "connection to the model provider at {server} failed: {}",
                error_chain(&error)
            ))
        }
    }
}

/// `{base}/chat/completions`, whether or not `base` ends in `/`, keeping
/// any query string (Azure-style `api-version`).
fn chat_completions_url(base: &Url) -> Result<Url, LlmError> {
    if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
        return Err(LlmError::config(format!(
            "the model base URL must be http(s), got scheme {:?}",
            base.scheme()
        )));
    }
    let mut dir = base.clone();
    dir.set_query(None);
    dir.set_fragment(None);
    if !dir.path().ends_with('/') {
        let path = format!("{}/", dir.path());
        dir.set_path(&path);
    }
    let mut endpoint = dir
        .join("chat/completions")
        .map_err(|e| LlmError::config(format!("invalid model base URL: {e}")))?;
    endpoint.set_query(base.query());
    Ok(endpoint)
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim_start().starts_with("application/json"))
}

/// `retry-after-ms` (OpenAI) or `Retry-After` in seconds. The HTTP-date form
/// is not used by model providers and is ignored.
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|v| v.is_finite() && *v >= 0.0)
    };
    value("retry-after-ms")
        .map(|ms| Duration::from_secs_f64(ms / 1000.0))
        .or_else(|| value("retry-after").map(Duration::from_secs_f64))
}

/// An error and its sources, `: `-joined: reqwest's own message alone
/// ("error sending request") hides the cause.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            text.push_str(": ");
            text.push_str(&cause_text);
        }
        source = cause.source();
    }
    text
}

fn log_completion(completion: Completion, stream: bool) -> Completion {
    tracing::debug!(
        stream,
        finish_reason = ?completion.finish_reason,
        tool_calls = completion.tool_calls.len(),
        text_chars = completion.text.len(),
        total_tokens = completion.usage.map(|u| u.total_tokens),
        "chat completion received"
    );
    completion
}

#[cfg(test)]
mod tests {
    use std::future::Future;
    use std::net::SocketAddr;
    use std::sync::Mutex;

    use axum::Router;
    use axum::body::Body;
    use axum::http::{HeaderMap as AxumHeaders, StatusCode};
    use axum::response::{IntoResponse, Response};
    use axum::routing::post;
    use futures::StreamExt;
    use serde_json::json;

    use super::*;
    use crate::scripted::{Script, ScriptedServer};

    const STEP: Duration = Duration::from_secs(20);
    const SECRET: &str = "sk-test-SECRET-never-printed";

    /// Every await in these tests is bounded.
    async fn within<F: Future>(future: F) -> F::Output {
        tokio::time::timeout(STEP, future)
            .await
            .expect("test step timed out")
    }

    fn config(base_url: Url) -> LlmConfig {
        LlmConfig {
            api_key: Some(SECRET.to_owned()),
            connect_timeout: Duration::from_secs(2),
            first_token_timeout: Duration::from_secs(5),
            idle_timeout: Duration::from_secs(5),
            ..LlmConfig::new(base_url)
        }
    }

    fn user(content: &str) -> Message {
        Message::User {
            content: content.to_owned(),
        }
    }

    fn request(messages: Vec<Message>) -> ChatRequest {
        ChatRequest {
            model: "toolfleet-scripted".into(),
            messages,
            tools: vec![
                json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}),
                json!({"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}),
            ],
            parallel_tool_calls: true,
            temperature: None,
            max_tokens: None,
        }
    }

    /// Serves `router` on a free loopback port.
    async fn spawn(router: Router) -> Url {
        let listener = within(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .await
            .expect("bind");
        let addr = listener.local_addr().expect("addr");
        tokio::spawn(async move {
            let _ = axum::serve(listener, router).await;
        });
        Url::parse(&format!("http://{addr}/v1/")).expect("url")
    }

    fn sse(frames: &[&str]) -> Vec<Result<Bytes, std::convert::Infallible>> {
        frames
            .iter()
            .map(|f| Ok(Bytes::from(format!("data: {f}\n\n"))))
            .collect()
    }

    fn sse_response(body: Body) -> Response {
        ([(header::CONTENT_TYPE, "text/event-stream")], body).into_response()
    }

    #[test]
    fn endpoint_url_handles_slashes_and_queries() {
        let url =
            |s: &str| chat_completions_url(&Url::parse(s).expect("url")).map(|u| u.to_string());
        assert_eq!(
            url("http://127.0.0.1:8080/v1").expect("ok"),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        assert_eq!(
            url("http://127.0.0.1:8080/v1/").expect("ok"),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
        assert_eq!(
            url("https://h.example/openai/deployments/d?api-version=2024-10-21").expect("ok"),
            "https://h.example/openai/deployments/d/chat/completions?api-version=2024-10-21"
        );
        assert_eq!(url("http://h").expect("ok"), "http://h/chat/completions");
        let err = url("file:///tmp/x").expect_err("not http");
        assert_eq!(err.code(), "config");
    }

    #[test]
    fn debug_output_never_shows_the_key() {
        let mut cfg = config(Url::parse("http://user:pw@h/v1?key=k").expect("url"));
        let text = format!("{cfg:?}");
        assert!(!text.contains(SECRET), "{text}");
        assert!(!text.contains("pw") && !text.contains("key=k"), "{text}");
        assert!(text.contains("[redacted]"));
        cfg.api_key = None;
        assert!(format!("{cfg:?}").contains("api_key: None"));
        let client =
            LlmClient::new(config(Url::parse("http://h/v1").expect("url"))).expect("client");
        assert!(!format!("{client:?}").contains(SECRET));
    }

    #[test]
    fn client_futures_can_be_spawned() {
        fn is_send<T: Send + 'static>(_: &T) {}
        fn borrows_are_send<T: Send>(_: T) {}
        let client =
            LlmClient::new(config(Url::parse("http://h/v1").expect("url"))).expect("client");
        is_send(&client);
        let req = request(vec![user("hi")]);
        borrows_are_send(client.stream_chat(&req, |_| {}));
        borrows_are_send(client.chat(&req));
    }

    #[test]
    fn usage_adds_up() {
        let mut total = Usage::default();
        let one = Usage {
            prompt_tokens: 1,
            completion_tokens: 2,
            total_tokens: 3,
            cached_tokens: 4,
            reasoning_tokens: 5,
        };
        total += one;
        total += one;
        assert_eq!(
            total,
            Usage {
                prompt_tokens: 2,
                completion_tokens: 4,
                total_tokens: 6,
                cached_tokens: 8,
                reasoning_tokens: 10
            }
        );
    }

    #[test]
    fn retry_after_prefers_milliseconds() {
        let mut headers = HeaderMap::new();
        headers.insert("retry-after", HeaderValue::from_static("3"));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(3)));
        headers.insert("retry-after-ms", HeaderValue::from_static("250"));
        assert_eq!(retry_after(&headers), Some(Duration::from_millis(250)));
        headers.insert("retry-after-ms", HeaderValue::from_static("soon"));
        assert_eq!(retry_after(&headers), Some(Duration::from_secs(3)));
    }

    const SCRIPT: &str = r#"{
        "rules": [{
            "whenUserContains": ["weather"],
            "steps": [
                {"toolCalls": [
                    {"name": "get_weather", "arguments": {"city": "Paris"}},
                    {"name": "lookup", "arguments": {"q": "umbrella etiquette"}}
                ]},
                {"answer": "The weather: {{tool:get_weather}} Also: {{tool:lookup}}"}
            ]
        }]
    }"#;

    #[tokio::test]
    async fn stream_chat_and_chat_run_a_tool_round_against_the_scripted_server() {
        let script = Script::from_json(SCRIPT).expect("script");
        let server = within(ScriptedServer::start(
            "127.0.0.1:0".parse().expect("addr"),
            script,
        ))
        .await
        .expect("start");
        let client = LlmClient::new(config(server.base_url())).expect("client");

        // Round 1: both calls in one streamed response.
        let mut messages = vec![user("What's the weather in Paris?")];
        let mut deltas = Vec::new();
        let first =
            within(client.stream_chat(&request(messages.clone()), |t| deltas.push(t.to_owned())))
                .await
                .expect("first round");
        assert_eq!(first.finish_reason, FinishReason::ToolCalls);
        assert!(deltas.is_empty(), "a tool-call turn has no text");
        let names: Vec<_> = first.tool_calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["get_weather", "lookup"]);
        let args: serde_json::Value =
            serde_json::from_str(&first.tool_calls[0].arguments).expect("arguments are JSON");
        assert_eq!(args, json!({"city": "Paris"}));
        assert_ne!(first.tool_calls[0].id, first.tool_calls[1].id);
        assert!(first.usage.is_some_and(|u| u.total_tokens > 0));

        // Round 2: the answer quotes the tool results, streamed in pieces.
        messages.push(first.assistant_message());
        for (call, result) in first
            .tool_calls
            .iter()
            .zip(["21C and sunny [doc:1]", "bring one [doc:2]"])
        {
            messages.push(Message::Tool {
                call_id: call.id.clone(),
                content: result.to_owned(),
            });
        }
        let mut deltas = Vec::new();
        let second =
            within(client.stream_chat(&request(messages.clone()), |t| deltas.push(t.to_owned())))
                .await
                .expect("second round");
        let want = "The weather: 21C and sunny [doc:1] Also: bring one [doc:2]";
        assert_eq!(second.text, want);
        assert_eq!(second.finish_reason, FinishReason::Stop);
        assert!(second.tool_calls.is_empty());
        assert!(deltas.len() > 1, "text arrives in several deltas");
        assert_eq!(deltas.concat(), want);

        // The same conversation without streaming.
        let plain = within(client.chat(&request(messages))).await.expect("chat");
        assert_eq!(plain.text, want);
        assert!(plain.usage.is_some());

        // What the provider was actually sent.
        let sent = server.requests();
        assert_eq!(sent.len(), 3);
        assert_eq!(sent[0]["stream"], json!(true));
        assert_eq!(sent[0]["stream_options"], json!({"include_usage": true}));
        assert_eq!(sent[0]["tool_choice"], json!("auto"));
        assert_eq!(sent[0]["parallel_tool_calls"], json!(true));
        assert_eq!(sent[0]["tools"].as_array().map(Vec::len), Some(2));
        let history = &sent[1]["messages"];
        assert_eq!(history[1]["role"], json!("assistant"));
        assert_eq!(history[1]["tool_calls"][0]["type"], json!("function"));
        assert_eq!(
            history[1]["tool_calls"][0]["id"],
            json!(first.tool_calls[0].id)
        );
        assert_eq!(history[2]["role"], json!("tool"));
        assert_eq!(history[2]["tool_call_id"], json!(first.tool_calls[0].id));
        assert_eq!(sent[2]["stream"], json!(false));
        assert!(sent[2].get("stream_options").is_none());
        within(server.shutdown()).await;
    }

    #[derive(Default)]
    struct Seen {
        authorization: Mutex<Vec<String>>,
    }

    #[tokio::test]
    async fn error_statuses_carry_code_retry_hint_and_no_secret() {
        let seen = Arc::new(Seen::default());
        let record = seen.clone();
        let router = Router::new()
            .route(
                "/v1/chat/completions",
                post(move |headers: AxumHeaders, body: Bytes| {
                    let record = record.clone();
                    async move {
                        let auth = headers
                            .get(header::AUTHORIZATION)
                            .and_then(|v| v.to_str().ok())
                            .unwrap_or_default()
                            .to_owned();
                        record
                            .authorization
                            .lock()
                            .expect("lock")
                            .push(auth);
                        let body: serde_json::Value =
                            serde_json::from_slice(&body).expect("request body is JSON");
                        let prompt = body["messages"][0]["content"].as_str().unwrap_or_default().to_owned();
                        match prompt.as_str() {
                            "429" => (
                                StatusCode::TOO_MANY_REQUESTS,
                                [("retry-after", "2")],
                                r#"{"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#,
                            )
                                .into_response(),
                            "quota" => (
                                StatusCode::TOO_MANY_REQUESTS,
                                r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#,
                            )
                                .into_response(),
                            "401" => (
                                StatusCode::UNAUTHORIZED,
                                format!(r#"{{"error":{{"message":"Incorrect API key provided: {SECRET}","type":"invalid_request_error","code":"invalid_api_key"}}}}"#),
                            )
                                .into_response(),
                            "echo" => (
                                StatusCode::BAD_REQUEST,
                                format!(r#"{{"error":{{"message":"bad value {SECRET}","type":"invalid_request_error","code":null}}}}"#),
                            )
                                .into_response(),
                            _ => (StatusCode::INTERNAL_SERVER_ERROR, "upstream exploded").into_response(),
                        }
                    }
                }),
            );
        let base = spawn(router).await;
        let client = LlmClient::new(config(base)).expect("client");
        let call = |prompt: &'static str| {
            let client = client.clone();
            async move {
                within(client.stream_chat(&request(vec![user(prompt)]), |_| {}))
                    .await
                    .expect_err("must fail")
            }
        };

        let err = call("429").await;
        assert_eq!(
            err.kind(),
            &LlmErrorKind::Status {
                status: 429,
                code: Some("rate_limit_exceeded".into())
            }
        );
        assert!(err.is_retryable());
        assert_eq!(err.retry_after(), Some(Duration::from_secs(2)));
        assert!(err.to_string().contains("Rate limit reached"), "{err}");

        let err = call("quota").await;
        assert_eq!(err.code(), "insufficient_quota");
        assert!(!err.is_retryable(), "waiting does not refill a quota");

        let err = call("500").await;
        assert_eq!(
            err.kind(),
            &LlmErrorKind::Status {
                status: 500,
                code: None
            }
        );
        assert_eq!(err.code(), "http_500");
        assert!(err.is_retryable());

        let err = call("401").await;
        assert_eq!(err.code(), "invalid_api_key");
        assert!(!err.is_retryable());
        let err2 = within(client.chat(&request(vec![user("echo")])))
            .await
            .expect_err("400");
        for e in [&err, &err2] {
            assert!(!e.to_string().contains(SECRET), "{e}");
            assert!(!format!("{e:?}").contains(SECRET), "{e:?}");
        }
        assert!(err2.to_string().contains("[redacted]"));

        let auth = seen.authorization.lock().expect("lock").clone();
        assert_eq!(auth.len(), 5);
        assert!(auth.iter().all(|a| a == &format!("Bearer {SECRET}")));
    }

    #[tokio::test]
    async fn connection_refused_is_a_retryable_connect_error() {
        // A port that was free a moment ago and has no listener now.
        let addr: SocketAddr = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            listener.local_addr().expect("addr")
        };
        let client = LlmClient::new(config(
            Url::parse(&format!("http://{addr}/v1")).expect("url"),
        ))
        .expect("client");
        let err = within(client.stream_chat(&request(vec![user("hi")]), |_| {}))
            .await
            .expect_err("nothing listens");
        assert_eq!(err.kind(), &LlmErrorKind::Connect);
        assert_eq!(err.code(), "connect");
        assert!(err.is_retryable());
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
        let err = within(client.chat(&request(vec![user("hi")])))
            .await
            .expect_err("nothing listens");
        assert_eq!(err.kind(), &LlmErrorKind::Connect);
    }

    #[tokio::test]
    async fn slow_stalled_and_cut_streams_fail_as_the_caller_needs() {
        let role = r#"{"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}"#;
        let text = r#"{"choices":[{"index":0,"delta":{"content":"Hello"}}]}"#;
        let stop = r#"{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}"#;
        let router = Router::new().route(
            "/v1/chat/completions",
            post(move |body: Bytes| async move {
                let body: serde_json::Value = serde_json::from_slice(&body).expect("json");
                match body["messages"][0]["content"].as_str().unwrap_or_default() {
                    "slow" => {
                        tokio::time::sleep(Duration::from_secs(30)).await;
                        StatusCode::OK.into_response()
                    }
                    "stall" => sse_response(Body::from_stream(
                        futures::stream::iter(sse(&[role, text])).chain(futures::stream::pending()),
                    )),
                    "cut" => sse_response(Body::from_stream(futures::stream::iter(sse(&[role, text])))),
                    "no-done" => sse_response(Body::from_stream(futures::stream::iter(sse(&[role, text, stop])))),
                    "garbage" => sse_response(Body::from_stream(futures::stream::iter(sse(&[role, "{oops"])))),
                    _ => (
                        [(header::CONTENT_TYPE, "application/json")],
                        r#"{"choices":[{"index":0,"message":{"role":"assistant","content":"whole"},"finish_reason":"stop"}]}"#,
                    )
                        .into_response(),
                }
            }),
        );
        let base = spawn(router).await;
        let client = LlmClient::new(LlmConfig {
            first_token_timeout: Duration::from_millis(300),
            idle_timeout: Duration::from_millis(300),
            ..config(base)
        })
        .expect("client");
        let run = |prompt: &'static str| {
            let client = client.clone();
            async move {
                let mut text = String::new();
                let result =
                    within(client.stream_chat(&request(vec![user(prompt)]), |t| text.push_str(t)))
                        .await;
                (result, text)
            }
        };

        let (result, _) = run("slow").await;
        let err = result.expect_err("slow first token");
        assert_eq!(err.kind(), &LlmErrorKind::Timeout);
        assert!(err.is_retryable());
        let err = within(client.chat(&request(vec![user("slow")])))
            .await
            .expect_err("slow non-streaming");
        assert_eq!(err.kind(), &LlmErrorKind::Timeout);

        let (result, text) = run("stall").await;
        let err = result.expect_err("stalled mid-stream");
        assert_eq!(err.kind(), &LlmErrorKind::Timeout);
        assert_eq!(text, "Hello", "text before the stall was delivered");

        let (result, _) = run("cut").await;
        let err = result.expect_err("cut before finish");
        assert_eq!(err.kind(), &LlmErrorKind::Connect);
        assert_eq!(err.code(), "connection_lost");
        assert!(err.is_retryable());

        let (result, text) = run("no-done").await;
        let completion = result.expect("finished without [DONE] is still an answer");
        assert_eq!(
            (completion.text.as_str(), text.as_str()),
            ("Hello", "Hello")
        );

        let (result, _) = run("garbage").await;
        assert_eq!(result.expect_err("garbage").kind(), &LlmErrorKind::Protocol);

        let (result, text) = run("json").await;
        assert_eq!(
            result.expect("JSON reply to a stream request").text,
            "whole"
        );
        assert_eq!(text, "whole");
    }
}
