//! Neutral conversation types, [`LlmConfig`] and [`LlmClient`]: request,
//! authentication, timeouts, retries, status handling.

pub use toolfleet_protocol::{ToolSpec, Usage};

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use reqwest::header::{self, HeaderMap, HeaderName, HeaderValue};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use tokio::time::Instant;
use tracing::Instrument;
use url::Url;

pub use crate::chat_wire::ChatStreamAccumulator;
pub use crate::error::{LlmError, LlmErrorKind};
pub use crate::images::{GeneratedImage, ImageAnswer, ImageFormat, ImageRequest};
pub use crate::responses_wire::ResponsesStreamAccumulator;
pub use crate::retry::{
    DEFAULT_BASE_DELAY, DEFAULT_MAX_ATTEMPTS, DEFAULT_MAX_DELAY, DEFAULT_MAX_ELAPSED, RetryPolicy,
};
pub use crate::sse::{MAX_EVENT_BYTES, SseDecoder, SseEvent};

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
        /// Provider output items to send back verbatim in the next request
        /// (Responses API reasoning items with their `encrypted_content`,
        /// which a stateless `store: false` conversation needs). Ignored by
        /// Chat Completions. Copied from [`Completion::opaque`] by
        /// [`Completion::assistant_message`].
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        opaque: Vec<Value>,
    },
    Tool {
        call_id: String,
        content: String,
    },
}

/// A function call the model asked for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    /// The id the tool result must quote: Chat Completions `tool_calls[].id`,
    /// Responses `call_id`.
    pub id: String,
    pub name: String,
    /// The raw JSON text exactly as the model produced it. It may be invalid
    /// (for example cut short by `max_tokens`); validating it is the
    /// caller's job at its boundary.
    pub arguments: String,
}

/// Which tool the model may or must call. Sent only when tools are.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ToolChoice {
    /// The model decides (the provider default).
    Auto,
    /// No tool calls.
    None,
    /// At least one tool call.
    Required,
    /// Exactly this function.
    Function(String),
}

/// One call to the model.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<Message>,
    /// Shared: a request holds its tools' schemas by reference, so
    /// thousands of waiting invocations hold one copy of each.
    pub tools: Vec<Arc<ToolSpec>>,
    /// `None` leaves it to the provider (`auto` whenever tools are sent).
    pub tool_choice: Option<ToolChoice>,
    /// Sent only together with tools (OpenAI rejects it otherwise).
    pub parallel_tool_calls: bool,
    pub temperature: Option<f32>,
    /// `max_tokens` (Chat Completions) or `max_output_tokens` (Responses).
    pub max_tokens: Option<u32>,
    /// The provider's processing tier (`service_tier`, e.g. OpenAI's
    /// `"flex"` for batch jobs); `None`: not sent, the provider's default.
    pub service_tier: Option<String>,
    /// OpenAI's `prompt_cache_key`: requests that share it (and their
    /// prompt's beginning) are routed to the same prompt cache. Sent only
    /// when the deployment accepts it ([`LlmConfig::prompt_cache_key`]);
    /// `None`: not sent.
    pub prompt_cache_key: Option<String>,
}

/// What the model answered.
///
/// When the model ran out of tokens (`finish_reason` [`FinishReason::Length`],
/// see [`is_truncated`](Self::is_truncated)) the tool calls it had started
/// are kept as far as they got, so the caller can report them, but their
/// arguments may be cut mid-JSON: a caller must never run the calls of a
/// truncated completion.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    /// The content text; empty when the model only called tools or refused.
    pub text: String,
    /// The refusal text, when the model declined (`delta.refusal` /
    /// a Responses `refusal` content part).
    pub refusal: Option<String>,
    /// The calls to run, in the model's order. This list, not
    /// `finish_reason`, says whether there is tool work: some compatible
    /// servers report `stop` next to tool calls.
    pub tool_calls: Vec<ToolCall>,
    pub finish_reason: FinishReason,
    pub usage: Option<Usage>,
    /// Output items to replay verbatim in the next request (Responses
    /// reasoning items); always empty for Chat Completions.
    pub opaque: Vec<Value>,
    /// HTTP requests this answer took, retries included (1 when the first
    /// one succeeded). For metrics.
    pub attempts: u32,
    /// From sending the successful attempt's request to its first streamed
    /// output (text, refusal or tool call); `None` when not streamed.
    pub time_to_first_token: Option<Duration>,
    /// How long the call waited at its deployment's fleet-wide gate, all
    /// attempts together ([`crate::gate`]).
    pub queued: Duration,
}

impl Completion {
    /// The assistant message to append to the conversation before the tool
    /// results.
    pub fn assistant_message(&self) -> Message {
        Message::Assistant {
            content: (!self.text.is_empty()).then(|| self.text.clone()),
            tool_calls: self.tool_calls.clone(),
            opaque: self.opaque.clone(),
        }
    }

    /// Whether the model stopped because it ran out of tokens: the text may
    /// end mid-sentence and tool-call arguments may be incomplete.
    pub fn is_truncated(&self) -> bool {
        self.finish_reason == FinishReason::Length
    }
}

/// Why the model stopped.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FinishReason {
    Stop,
    ToolCalls,
    /// `finish_reason: "length"`, or a Responses `response.incomplete`
    /// (`max_output_tokens`).
    Length,
    ContentFilter,
    /// Anything else the provider said, verbatim.
    Other(String),
}

impl FinishReason {
    /// As the OpenAI API spells it (`stop`, `tool_calls`, `length`,
    /// `content_filter`, or the provider's own word).
    pub fn as_str(&self) -> &str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::ToolCalls => "tool_calls",
            FinishReason::Length => "length",
            FinishReason::ContentFilter => "content_filter",
            FinishReason::Other(other) => other,
        }
    }
}

/// Which HTTP an endpoint is spoken to with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HttpVersion {
    /// HTTP/1.1: a connection per call in flight (pooled between calls).
    /// Never limited by the server's streams per connection.
    #[default]
    Http1,
    /// HTTP/2 only — negotiated over TLS, by prior knowledge (h2c) over
    /// plain `http://` — for servers known to speak it. Calls in flight
    /// share a few connections (four, taken in turn; one that breaks is
    /// replaced): far less memory and fewer descriptors per waiting call,
    /// but at most as many calls at once as the server allows streams on
    /// those connections (often 100–250 each for public APIs; set by the
    /// server, e.g. a gateway's `max_concurrent_streams`).
    Http2,
}

/// Which OpenAI API an endpoint speaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ApiShape {
    /// `POST {base}/chat/completions`: OpenAI, Azure OpenAI, Ollama, vLLM,
    /// llama.cpp and nearly every compatible server.
    #[default]
    ChatCompletions,
    /// `POST {base}/responses`: OpenAI and Azure OpenAI; needed to keep
    /// reasoning items between the rounds of a tool loop.
    Responses,
}

/// How the API key is sent.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Auth {
    /// `Authorization: Bearer <key>`.
    #[default]
    Bearer,
    /// The key alone in the named header, e.g. `api-key` for Azure OpenAI.
    Header(String),
}

pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// Generous because reasoning models may think for a long time before the
/// first token, and a non-streaming call waits for the whole answer.
pub const DEFAULT_FIRST_TOKEN_TIMEOUT: Duration = Duration::from_secs(120);
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Where the provider is, how to talk to it and how long to wait for it.
#[derive(Clone)]
pub struct LlmConfig {
    /// The API root, e.g. `http://127.0.0.1:8080/v1`; requests go to
    /// `{base_url}/chat/completions` or `{base_url}/responses`, and
    /// [`LlmClient::generate_image`]'s to `{base_url}/images/generations`
    /// (with or without a trailing slash, and any query string is kept).
    pub base_url: Url,
    pub api_key: Option<String>,
    pub api: ApiShape,
    /// The model is a reasoning model (OpenAI's o-series, gpt-5): Responses
    /// requests ask for `include: ["reasoning.encrypted_content"]`, so its
    /// reasoning items can be replayed in the next round of a stateless
    /// (`store: false`) tool loop. `false` by default, because other models
    /// (gpt-4o, gpt-4o-mini, ...) answer that request with 400. Chat
    /// Completions ignores it.
    pub reasoning: bool,
    /// The provider accepts `prompt_cache_key`: a request's
    /// [`ChatRequest::prompt_cache_key`] is sent. `false` by default, since
    /// a strict OpenAI-compatible server may refuse a field it does not
    /// know; the deployments file turns it on for OpenAI itself
    /// ([`crate::deployments`]).
    pub prompt_cache_key: bool,
    pub auth: Auth,
    /// Query parameters added to every request, e.g. Azure OpenAI's
    /// `("api-version", "2025-04-01-preview")`.
    pub extra_query: Vec<(String, String)>,
    /// `true` (the default): stream and hand text to the caller as it
    /// comes. `false`: one JSON answer; [`LlmClient::stream_chat`] then
    /// passes the whole text to its callback once.
    pub stream: bool,
    pub retry: RetryPolicy,
    /// TCP (and TLS) connect.
    pub connect_timeout: Duration,
    /// From sending the request until the first event of a stream, or the
    /// response headers of a non-streaming call (which a provider sends only
    /// when the whole answer is ready).
    pub first_token_timeout: Duration,
    /// Longest gap between two chunks of a response body.
    pub idle_timeout: Duration,
    /// HTTP/1.1 or HTTP/2 ([`HttpVersion`]).
    pub http: HttpVersion,
    /// The fleet-wide gate of the deployment (its `max_concurrency` and
    /// `requests_per_minute`), asked before every attempt; `None`: no
    /// shared limit.
    pub gate: Option<crate::gate::Gate>,
}

impl LlmConfig {
    /// Chat Completions, streamed, bearer auth, not a reasoning model, the
    /// default retry policy, the `DEFAULT_*` timeouts and no API key.
    pub fn new(base_url: Url) -> Self {
        Self {
            base_url,
            api_key: None,
            api: ApiShape::default(),
            reasoning: false,
            prompt_cache_key: false,
            auth: Auth::default(),
            extra_query: Vec::new(),
            stream: true,
            retry: RetryPolicy::default(),
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            first_token_timeout: DEFAULT_FIRST_TOKEN_TIMEOUT,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            http: HttpVersion::Http1,
            gate: None,
        }
    }
}

impl fmt::Debug for LlmConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Query values are hidden too: some deployments put a key there.
        let query: Vec<&str> = self.extra_query.iter().map(|(k, _)| k.as_str()).collect();
        f.debug_struct("LlmConfig")
            .field("base_url", &redacted_url(&self.base_url))
            .field("api_key", &self.api_key.as_ref().map(|_| "[redacted]"))
            .field("api", &self.api)
            .field("reasoning", &self.reasoning)
            .field("prompt_cache_key", &self.prompt_cache_key)
            .field("auth", &self.auth)
            .field("extra_query", &query)
            .field("stream", &self.stream)
            .field("retry", &self.retry)
            .field("connect_timeout", &self.connect_timeout)
            .field("first_token_timeout", &self.first_token_timeout)
            .field("idle_timeout", &self.idle_timeout)
            .field("gate", &self.gate)
            .finish()
    }
}

/// A URL for humans (the protocol's one redaction).
fn redacted_url(url: &Url) -> String {
    toolfleet_protocol::redact_url(url.as_str())
}

/// Installs rustls' `ring` crypto provider for the process. reqwest is built
/// with `rustls-no-provider`, so something must do this before the first
/// client is built; doing it again is harmless.
pub fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

/// Largest non-streaming or error body we read. A completion is a few
/// kilobytes; this only stops a broken server from filling memory.
const MAX_BODY_BYTES: usize = 16 * 1024 * 1024;
/// Largest image-generation body we read: a `b64_json` image is several
/// megabytes, a third more once encoded.
const MAX_IMAGE_BODY_BYTES: usize = 48 * 1024 * 1024;
/// Error bodies are read only for their code and message.
const MAX_ERROR_BODY_BYTES: usize = 64 * 1024;

/// A model client for one endpoint. Cheap to clone: clones share one
/// connection pool.
#[derive(Clone)]
pub struct LlmClient {
    inner: Arc<Inner>,
}

#[derive(Clone)]
struct Inner {
    /// The HTTP clients calls are sent on (several over HTTP/2).
    http: Arc<crate::connections::Connections>,
    api: ApiShape,
    /// [`LlmConfig::reasoning`].
    reasoning: bool,
    /// [`LlmConfig::prompt_cache_key`].
    prompt_cache_key: bool,
    /// Chat Completions or Responses, per `api`.
    endpoint: Url,
    /// `images/generations`.
    images_endpoint: Url,
    /// `host:port`, the only part of the endpoint that goes into messages.
    server: String,
    credential: Option<(HeaderName, HeaderValue)>,
    /// Kept only to scrub it from provider-supplied error text.
    api_key: Option<String>,
    stream: bool,
    retry: RetryPolicy,
    first_token_timeout: Duration,
    idle_timeout: Duration,
    gate: Option<crate::gate::Gate>,
}

impl fmt::Debug for LlmClient {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmClient")
            .field("api", &self.inner.api)
            .field("endpoint", &redacted_url(&self.inner.endpoint))
            .finish_non_exhaustive()
    }
}

/// What one streamed attempt has handed to the caller so far.
#[derive(Default)]
struct Progress {
    /// Text, a refusal or a tool call has streamed: the attempt must not be
    /// repeated.
    emitted: bool,
    /// When the first of it streamed.
    first_output: Option<Instant>,
}

/// The two stream accumulators, as the client drives them.
trait Accumulate {
    /// Whether the stream is over once the model has finished (Responses:
    /// nothing follows the terminal event) or a usage chunk and `[DONE]`
    /// may still follow (Chat Completions).
    const ENDS_AT_FINISH: bool;
    fn push_event(&mut self, event: &SseEvent) -> Result<Option<String>, LlmError>;
    fn is_finished(&self) -> bool;
    fn has_output(&self) -> bool;
    fn finish(self) -> Result<Completion, LlmError>;
}

impl Accumulate for ChatStreamAccumulator {
    const ENDS_AT_FINISH: bool = false;
    fn push_event(&mut self, event: &SseEvent) -> Result<Option<String>, LlmError> {
        self.push(&event.data)
    }
    fn is_finished(&self) -> bool {
        ChatStreamAccumulator::is_finished(self)
    }
    fn has_output(&self) -> bool {
        ChatStreamAccumulator::has_output(self)
    }
    fn finish(self) -> Result<Completion, LlmError> {
        ChatStreamAccumulator::finish(self)
    }
}

impl Accumulate for ResponsesStreamAccumulator {
    const ENDS_AT_FINISH: bool = true;
    fn push_event(&mut self, event: &SseEvent) -> Result<Option<String>, LlmError> {
        ResponsesStreamAccumulator::push_event(self, event)
    }
    fn is_finished(&self) -> bool {
        ResponsesStreamAccumulator::is_finished(self)
    }
    fn has_output(&self) -> bool {
        ResponsesStreamAccumulator::has_output(self)
    }
    fn finish(self) -> Result<Completion, LlmError> {
        ResponsesStreamAccumulator::finish(self)
    }
}

/// How long a finished stream's remaining bytes are read before it is
/// dropped ([`drain`]).
const DRAIN_WAIT: Duration = Duration::from_millis(100);
/// How many of them at most.
const DRAIN_BYTES: usize = 64 * 1024;

/// Reads what follows a stream's end marker (usually only the end of the
/// body), so that HTTP/2 closes the stream instead of resetting it:
/// thousands of calls ending at once would otherwise send thousands of
/// `RST_STREAM`s, which servers take for a rapid-reset attack and answer
/// with `GOAWAY` — ending every other call on the connection. Bounded in
/// time and bytes: a server that keeps sending is cut off as before.
async fn drain(response: &mut reqwest::Response) {
    let _ = tokio::time::timeout(DRAIN_WAIT, async {
        let mut left = DRAIN_BYTES;
        while let Ok(Some(chunk)) = response.chunk().await {
            if chunk.len() >= left {
                break;
            }
            left -= chunk.len();
        }
    })
    .await;
}

impl LlmClient {
    /// Builds the client. Fails (kind `Protocol`, code `config`) on a base
    /// URL that is not http(s), an auth header name that is not a valid
    /// header name, or an API key that cannot go in a header.
    pub fn new(config: LlmConfig) -> Result<Self, LlmError> {
        install_crypto_provider();
        let path = match config.api {
            ApiShape::ChatCompletions => "chat/completions",
            ApiShape::Responses => "responses",
        };
        let endpoint = endpoint_url(&config.base_url, path, &config.extra_query)?;
        let images_endpoint =
            endpoint_url(&config.base_url, "images/generations", &config.extra_query)?;
        let server = format!(
            "{}:{}",
            endpoint.host_str().unwrap_or("?"),
            endpoint.port_or_known_default().unwrap_or(0)
        );
        let api_key = config.api_key.filter(|k| !k.is_empty());
        let credential = match api_key.as_deref() {
            Some(key) => Some(credential(&config.auth, key)?),
            None => None,
        };
        let http = crate::connections::Connections::new(config.http, config.connect_timeout)
            .map_err(|e| {
                LlmError::config(format!(
                    "could not build the HTTP client: {}",
                    error_chain(&e)
                ))
            })?;
        let http = Arc::new(http);
        Ok(Self {
            inner: Arc::new(Inner {
                http,
                api: config.api,
                reasoning: config.reasoning,
                prompt_cache_key: config.prompt_cache_key,
                endpoint,
                images_endpoint,
                server,
                credential,
                api_key,
                stream: config.stream,
                retry: config.retry,
                first_token_timeout: config.first_token_timeout,
                idle_timeout: config.idle_timeout,
                gate: config.gate,
            }),
        })
    }

    /// This client, on the same connection pool, asking `gate` before
    /// every attempt (a caller that learns its gate per call: an LLM-tool
    /// worker, whose shared store comes with each job).
    #[must_use]
    pub fn with_gate(&self, gate: crate::gate::Gate) -> Self {
        let mut inner = (*self.inner).clone();
        inner.gate = Some(gate);
        Self {
            inner: Arc::new(inner),
        }
    }

    /// The API shape this client speaks.
    pub fn api(&self) -> ApiShape {
        self.inner.api
    }

    /// Asks the model, streaming unless the config says `stream: false`,
    /// calls `on_text` for every content text delta (or once with the whole
    /// text when not streaming), and returns the reassembled completion.
    ///
    /// Retryable failures are retried per [`RetryPolicy`] as long as
    /// nothing has streamed yet; [`Completion::attempts`] and
    /// [`LlmError::attempts`] say how many requests it took. On error
    /// `on_text` may already have seen part of the answer. Dropping the
    /// future closes the connection at once.
    pub async fn stream_chat(
        &self,
        req: &ChatRequest,
        mut on_text: impl FnMut(&str) + Send,
    ) -> Result<Completion, LlmError> {
        self.call(req, self.inner.stream, &mut on_text)
            .await
            .map_err(|e| e.redact(self.inner.api_key.as_deref()))
    }

    /// The non-streaming variant, whatever the config says; retried like
    /// [`stream_chat`](Self::stream_chat).
    pub async fn chat(&self, req: &ChatRequest) -> Result<Completion, LlmError> {
        self.call(req, false, &mut |_: &str| {})
            .await
            .map_err(|e| e.redact(self.inner.api_key.as_deref()))
    }

    /// Generates one image (`POST {base_url}/images/generations`, `n: 1`),
    /// with the same authentication, timeouts, status handling and
    /// retries as [`chat`](Self::chat): [`ImageAnswer::attempts`] and
    /// [`LlmError::attempts`] say how many requests it took. A refused
    /// prompt is a 400 whose [`LlmError::code`] is the provider's
    /// (`content_policy_violation` for OpenAI), not retried. Dropping the
    /// future closes the connection at once.
    pub async fn generate_image(&self, req: &ImageRequest) -> Result<ImageAnswer, LlmError> {
        self.images(req)
            .await
            .map_err(|e| e.redact(self.inner.api_key.as_deref()))
    }

    /// Encodes once, then runs attempts until one succeeds or the retry
    /// policy says stop.
    async fn images(&self, req: &ImageRequest) -> Result<ImageAnswer, LlmError> {
        let body = crate::images::encode(req)?;
        tracing::debug!(model = %req.model, "image request");
        let started = Instant::now();
        let mut attempt = 0;
        loop {
            attempt += 1;
            let pass = self.admit().await;
            let conn = self.inner.http.take();
            let answer = self.image_once(&conn.client, body.clone()).await;
            if answer.as_ref().is_err_and(LlmError::lost_its_connection) {
                self.inner.http.broken(&conn);
            }
            drop(pass);
            let error = match answer {
                Ok(mut answer) => {
                    answer.attempts = attempt;
                    tracing::debug!(
                        attempts = attempt,
                        images = answer.images.len(),
                        total_tokens = answer.usage.map(|u| u.total_tokens),
                        "image answer received"
                    );
                    return Ok(answer);
                }
                Err(error) => error.with_attempts(attempt),
            };
            self.pause_on_retry_after(&error).await;
            if !self.wait_before_retry(started, &error, false).await {
                return Err(error);
            }
        }
    }

    async fn image_once(
        &self,
        http: &reqwest::Client,
        body: Bytes,
    ) -> Result<ImageAnswer, LlmError> {
        let endpoint = &self.inner.images_endpoint;
        let (mut response, _) = self.send(http, endpoint, body, false).await?;
        let body = self.read_body(&mut response, MAX_IMAGE_BODY_BYTES).await?;
        crate::images::from_wire(&body)
    }

    /// Runs attempts until one succeeds or the retry policy (or a
    /// streamed answer) says stop.
    async fn call<F: FnMut(&str) + Send>(
        &self,
        req: &ChatRequest,
        stream: bool,
        on_text: &mut F,
    ) -> Result<Completion, LlmError> {
        tracing::debug!(
            api = ?self.inner.api,
            model = %req.model,
            messages = req.messages.len(),
            tools = req.tools.len(),
            stream,
            "model request"
        );
        // One span per model call (retries inside it), with the GenAI
        // semantic conventions' attributes; its context goes to the
        // provider in `traceparent`.
        let span = tracing::info_span!(
            "model_call",
            otel.name = format!("chat {}", req.model),
            otel.kind = "client",
            otel.status_code = tracing::field::Empty,
            gen_ai.operation.name = "chat",
            gen_ai.provider.name = provider_name(&self.inner.server),
            gen_ai.request.model = %req.model,
            gen_ai.usage.input_tokens = tracing::field::Empty,
            gen_ai.usage.output_tokens = tracing::field::Empty,
            gen_ai.response.finish_reasons = tracing::field::Empty,
            server.address = %self.inner.server,
            error.type = tracing::field::Empty,
        );
        let result = self
            .attempts(req, stream, on_text)
            .instrument(span.clone())
            .await;
        match &result {
            Ok(c) => {
                span.record("otel.status_code", "ok");
                if let Some(u) = c.usage {
                    span.record("gen_ai.usage.input_tokens", u.prompt_tokens);
                    span.record("gen_ai.usage.output_tokens", u.completion_tokens);
                }
                span.record("gen_ai.response.finish_reasons", c.finish_reason.as_str());
            }
            Err(e) => {
                span.record("otel.status_code", "error");
                span.record("error.type", e.code());
            }
        }
        result
    }

    /// The attempts of one call, retried as the policy says. Each attempt
    /// encodes the request anew rather than keeping one encoding for them
    /// all: the body is let go once it is sent ([`Self::send`]), so a call
    /// that waits on a slow model holds no copy of its request (several KiB
    /// each, for thousands of waiting calls).
    async fn attempts<F: FnMut(&str) + Send>(
        &self,
        req: &ChatRequest,
        stream: bool,
        on_text: &mut F,
    ) -> Result<Completion, LlmError> {
        let started = Instant::now();
        let mut attempt = 0;
        let mut queued = Duration::ZERO;
        loop {
            attempt += 1;
            // Before the gate: a request that cannot be encoded (it never
            // could: encoding is deterministic) takes no slot.
            let body = self.encode(req, stream)?;
            let pass = self.admit().await;
            queued += pass.waited;
            let mut progress = Progress::default();
            let sent = Instant::now();
            let conn = self.inner.http.take();
            let result = if stream {
                self.stream_once(&conn.client, body, on_text, &mut progress)
                    .await
            } else {
                self.plain_once(&conn.client, body).await
            };
            if result.as_ref().is_err_and(LlmError::lost_its_connection) {
                self.inner.http.broken(&conn);
            }
            let error = match result {
                Ok(mut completion) => {
                    if !stream && !completion.text.is_empty() {
                        on_text(&completion.text);
                    }
                    completion.attempts = attempt;
                    completion.queued = queued;
                    completion.time_to_first_token = progress.first_output.map(|t| t - sent);
                    self.note_unreplayable_reasoning(&completion);
                    return Ok(log_completion(completion, self.inner.api, stream));
                }
                Err(error) => error.with_attempts(attempt),
            };
            drop(pass);
            self.pause_on_retry_after(&error).await;
            if !self
                .wait_before_retry(started, &error, progress.emitted)
                .await
            {
                return Err(error);
            }
        }
    }

    /// A slot of the deployment's fleet-wide gate, when it has one.
    async fn admit(&self) -> crate::gate::GatePass {
        match &self.inner.gate {
            Some(gate) => gate.admit().await,
            None => crate::gate::GatePass::open(Duration::ZERO),
        }
    }

    /// A 429 that said how long to wait pauses every caller of the
    /// deployment (through its gate) that long.
    async fn pause_on_retry_after(&self, error: &LlmError) {
        let too_many = matches!(error.kind(), LlmErrorKind::Status { status: 429, .. });
        if let (Some(gate), Some(wait), true) = (&self.inner.gate, error.retry_after(), too_many) {
            gate.pause(wait).await;
        }
    }

    /// The retry step every call shares: after `error` ended attempt
    /// [`LlmError::attempts`] of a call that started at `started`, waits as
    /// the retry policy says and returns `true`, or returns `false` at once
    /// when the call must give up. A failed attempt that had already
    /// `emitted` part of its answer to the caller is never repeated.
    async fn wait_before_retry(&self, started: Instant, error: &LlmError, emitted: bool) -> bool {
        let attempt = error.attempts();
        let delay = if emitted {
            None
        } else {
            self.inner.retry.delay_before_retry(
                attempt,
                started.elapsed(),
                error,
                crate::retry::jitter(),
            )
        };
        let Some(delay) = delay else {
            tracing::debug!(
                attempt,
                code = error.code(),
                retryable = error.is_retryable(),
                streamed = emitted,
                "model request failed"
            );
            return false;
        };
        tracing::warn!(
            attempt,
            code = error.code(),
            delay_ms = delay.as_millis() as u64,
            server = %self.inner.server,
            "model request failed; retrying"
        );
        tokio::time::sleep(delay).await;
        true
    }

    fn encode(&self, req: &ChatRequest, stream: bool) -> Result<Bytes, LlmError> {
        let body = match self.inner.api {
            ApiShape::ChatCompletions => serde_json::to_vec(
                &crate::chat_wire::to_wire(req, stream)
                    .keep_prompt_cache_key(self.inner.prompt_cache_key),
            ),
            ApiShape::Responses => serde_json::to_vec(
                &crate::responses_wire::to_wire(req, stream, self.inner.reasoning)
                    .keep_prompt_cache_key(self.inner.prompt_cache_key),
            ),
        };
        body.map(Bytes::from)
            .map_err(|e| LlmError::protocol(format!("could not encode the request: {e}")))
    }

    /// Reasoning items without their encrypted content come from a
    /// reasoning model on a deployment not marked as one: they cannot be
    /// replayed (and are not), so the model loses its reasoning between
    /// rounds. Worth a word to the operator, who can fix the config.
    fn note_unreplayable_reasoning(&self, completion: &Completion) {
        if self.inner.api == ApiShape::Responses
            && !self.inner.reasoning
            && crate::responses_wire::has_unreplayable_reasoning(completion)
        {
            tracing::warn!(
                server = %self.inner.server,
                "the model returned reasoning items, but the deployment is not marked as a \
                 reasoning model; they are not replayed. Set `reasoning = true` on the \
                 deployment to keep them between rounds"
            );
        }
    }

    fn parse_body(&self, body: &[u8]) -> Result<Completion, LlmError> {
        match self.inner.api {
            ApiShape::ChatCompletions => crate::chat_wire::completion_from_wire(body),
            ApiShape::Responses => crate::responses_wire::completion_from_wire(body),
        }
    }

    async fn plain_once(
        &self,
        http: &reqwest::Client,
        body: Bytes,
    ) -> Result<Completion, LlmError> {
        let (mut response, _) = self.send(http, &self.inner.endpoint, body, false).await?;
        let body = self.read_body(&mut response, MAX_BODY_BYTES).await?;
        self.parse_body(&body)
    }

    async fn stream_once<F: FnMut(&str) + Send>(
        &self,
        http: &reqwest::Client,
        body: Bytes,
        on_text: &mut F,
        progress: &mut Progress,
    ) -> Result<Completion, LlmError> {
        let (mut response, first_deadline) =
            self.send(http, &self.inner.endpoint, body, true).await?;
        if is_json(response.headers()) {
            // A server that ignores `stream: true` answers with one JSON
            // body; that is still a complete, usable answer.
            let body = self.read_body(&mut response, MAX_BODY_BYTES).await?;
            let completion = self.parse_body(&body)?;
            if !completion.text.is_empty() {
                progress.emitted = true;
                on_text(&completion.text);
            }
            return Ok(completion);
        }
        match self.inner.api {
            ApiShape::ChatCompletions => {
                self.read_stream(
                    response,
                    first_deadline,
                    ChatStreamAccumulator::new(),
                    on_text,
                    progress,
                )
                .await
            }
            ApiShape::Responses => {
                self.read_stream(
                    response,
                    first_deadline,
                    ResponsesStreamAccumulator::new(),
                    on_text,
                    progress,
                )
                .await
            }
        }
    }

    /// Reads SSE events into `acc` until the stream ends, honouring the
    /// first-token and idle timeouts.
    async fn read_stream<A: Accumulate, F: FnMut(&str) + Send>(
        &self,
        mut response: reqwest::Response,
        first_deadline: Instant,
        mut acc: A,
        on_text: &mut F,
        progress: &mut Progress,
    ) -> Result<Completion, LlmError> {
        let mut decoder = SseDecoder::new();
        let mut got_event = false;
        let mut done = false;
        let mut deliver = |acc: &mut A, event: &SseEvent| -> Result<bool, LlmError> {
            if event.is_done() {
                return Ok(true);
            }
            let text = acc.push_event(event)?;
            if acc.has_output() {
                progress.emitted = true;
                progress.first_output.get_or_insert_with(Instant::now);
            }
            if let Some(text) = text {
                on_text(&text);
            }
            Ok(A::ENDS_AT_FINISH && acc.is_finished())
        };
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
                if deliver(&mut acc, &event)? {
                    done = true;
                    break;
                }
            }
        }
        if !done {
            if let Some(event) = decoder.finish() {
                done = deliver(&mut acc, &event)?;
            }
            // Without an end marker the answer still counts if the model
            // said it was finished (only the usage chunk may be missing);
            // otherwise the stream was cut and the same request is worth
            // retrying.
            if !done && !acc.is_finished() {
                return Err(LlmError::connection_lost(format!(
                    "the model provider at {} closed the stream before the answer was complete",
                    self.inner.server
                )));
            }
        }
        if done {
            drain(&mut response).await;
        }
        // Dropping the response here closes the connection if the server
        // sent more than we read (a Responses stream after its terminal
        // event).
        acc.finish()
    }

    /// Sends the request to `endpoint` (one of [`Inner`]'s) and checks the
    /// status. Returns the response and the deadline for the first event.
    async fn send(
        &self,
        http: &reqwest::Client,
        endpoint: &Url,
        body: Bytes,
        stream: bool,
    ) -> Result<(reqwest::Response, Instant), LlmError> {
        let mut request = http
            .post(endpoint.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .header(
                header::ACCEPT,
                if stream {
                    "text/event-stream"
                } else {
                    "application/json"
                },
            )
            // Not as bytes: reqwest keeps a copy of a bytes body until the
            // response comes (to follow a redirect with it), which for a
            // slow model is the whole wait. As a body of its own (its length
            // still sent), it is dropped once sent; a retry encodes again.
            .body(reqwest::Body::wrap(http_body_util::Full::new(body)));
        if let Some((name, value)) = &self.inner.credential {
            request = request.header(name.clone(), value.clone());
        }
        let mut trace = HeaderMap::new();
        inject_trace_context(&mut trace);
        request = request.headers(trace);
        let first_deadline = Instant::now() + self.inner.first_token_timeout;
        let mut response = match tokio::time::timeout_at(first_deadline, request.send()).await {
            Err(_) => return Err(self.first_token_timeout()),
            Ok(Err(e)) => return Err(self.transport_error(e)),
            Ok(Ok(response)) => response,
        };
        let status = response.status();
        if status.is_redirection() {
            let to = response
                .headers()
                .get(header::LOCATION)
                .and_then(|l| l.to_str().ok())
                .map(toolfleet_protocol::redact_url)
                .unwrap_or_default();
            let status = status.as_u16();
            return Err(LlmError::status(
                status,
                None,
                format!(
                    "the model endpoint redirects (HTTP {status}) to {to:?}; set the deployment's base_url to where it redirects"
                ),
            ));
        }
        if !status.is_success() {
            let retry_after = retry_after(response.headers());
            // The body only adds detail; a status error stands without it.
            let body = self
                .read_body(&mut response, MAX_ERROR_BODY_BYTES)
                .await
                .unwrap_or_default();
            let (code, message) = crate::chat_wire::error_body_fields(&body);
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

/// The header that carries the key, marked sensitive so hyper's and
/// reqwest's own debug output never shows it.
fn credential(auth: &Auth, key: &str) -> Result<(HeaderName, HeaderValue), LlmError> {
    let (name, value) = match auth {
        Auth::Bearer => (header::AUTHORIZATION, format!("Bearer {key}")),
        Auth::Header(name) => (
            HeaderName::from_bytes(name.trim().as_bytes()).map_err(|_| {
                LlmError::config(format!("{name:?} is not a valid HTTP header name"))
            })?,
            key.to_owned(),
        ),
    };
    let mut value = HeaderValue::from_str(&value).map_err(|_| {
        LlmError::config("the API key contains characters not allowed in an HTTP header")
    })?;
    value.set_sensitive(true);
    Ok((name, value))
}

/// `{base}/{path}`, whether or not `base` ends in `/`, keeping any query
/// string of `base` and adding `extra_query`.
fn endpoint_url(base: &Url, path: &str, extra_query: &[(String, String)]) -> Result<Url, LlmError> {
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
        .join(path)
        .map_err(|e| LlmError::config(format!("invalid model base URL: {e}")))?;
    endpoint.set_query(base.query());
    if !extra_query.is_empty() {
        endpoint.query_pairs_mut().extend_pairs(extra_query);
    }
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
            .filter(|v| v.is_finite() && *v >= 0.0 && *v < 1e9)
    };
    value("retry-after-ms")
        .map(|ms| Duration::from_secs_f64(ms / 1000.0))
        .or_else(|| value("retry-after").map(Duration::from_secs_f64))
}

/// The GenAI conventions' `gen_ai.provider.name` of a server (`host:port`):
/// Azure OpenAI by its host, anything else speaking the OpenAI API as
/// `openai`.
fn provider_name(server: &str) -> &'static str {
    let host = server.rsplit_once(':').map_or(server, |(h, _)| h);
    if host.ends_with(".openai.azure.com") || host.ends_with(".cognitiveservices.azure.com") {
        "azure.ai.openai"
    } else {
        "openai"
    }
}

/// Puts the current span's W3C `traceparent` into `headers`, so the
/// provider's side of the request joins the model call's trace. Nothing
/// when tracing is off (the span has no OpenTelemetry context).
fn inject_trace_context(headers: &mut HeaderMap) {
    use opentelemetry::propagation::TextMapPropagator;
    use tracing_opentelemetry::OpenTelemetrySpanExt;
    let cx = tracing::Span::current().context();
    opentelemetry_sdk::propagation::TraceContextPropagator::new()
        .inject_context(&cx, &mut opentelemetry_http::HeaderInjector(headers));
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

fn log_completion(completion: Completion, api: ApiShape, stream: bool) -> Completion {
    tracing::debug!(
        ?api,
        stream,
        attempts = completion.attempts,
        finish_reason = ?completion.finish_reason,
        tool_calls = completion.tool_calls.len(),
        text_chars = completion.text.len(),
        total_tokens = completion.usage.map(|u| u.total_tokens),
        "model answer received"
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
    use toolfleet_scripted::{Script, ScriptedServer, StreamStats};

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
            // Retry behaviour has its own tests; here every call is one
            // request.
            retry: RetryPolicy::never(),
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
            tools: vec![Arc::new(tool("get_weather")), Arc::new(tool("lookup"))],
            tool_choice: Some(ToolChoice::Auto),
            parallel_tool_calls: true,
            temperature: None,
            max_tokens: None,
            service_tier: None,
            prompt_cache_key: None,
        }
    }

    fn tool(name: &str) -> ToolSpec {
        ToolSpec {
            name: name.to_owned(),
            description: format!("the {name} tool"),
            parameters: json!({"type": "object"}),
            strict: false,
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
        let url = |s: &str| {
            endpoint_url(&Url::parse(s).expect("url"), "chat/completions", &[])
                .map(|u| u.to_string())
        };
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
        assert!(format!("{cfg:?}").contains("reasoning: false"));
        cfg.extra_query = vec![("api-version".into(), "v-secret-ish".into())];
        let text = format!("{cfg:?}");
        assert!(!text.contains("v-secret-ish"), "{text}");
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
        let image = ImageRequest {
            model: "dall-e-3".into(),
            prompt: "hi".into(),
            size: None,
            quality: None,
            response_format: None,
        };
        borrows_are_send(client.generate_image(&image));
    }

    #[test]
    fn config_enums_read_as_documented() {
        let shape: ApiShape = serde_json::from_value(json!("responses")).expect("shape");
        assert_eq!(shape, ApiShape::Responses);
        assert_eq!(
            serde_json::to_value(ApiShape::ChatCompletions).expect("json"),
            json!("chat_completions")
        );
        assert_eq!(ApiShape::default(), ApiShape::ChatCompletions);
        let auth: Auth = serde_json::from_value(json!({"header": "api-key"})).expect("auth");
        assert_eq!(auth, Auth::Header("api-key".into()));
        assert_eq!(
            serde_json::from_value::<Auth>(json!("bearer")).expect("auth"),
            Auth::Bearer
        );
        let choice: ToolChoice =
            serde_json::from_value(json!({"function": "get_weather"})).expect("choice");
        assert_eq!(choice, ToolChoice::Function("get_weather".into()));
        let cfg = LlmConfig::new(Url::parse("http://h/v1").expect("url"));
        assert!(cfg.stream);
        assert!(
            !cfg.reasoning,
            "never assumed: other models refuse its request"
        );
        assert_eq!(cfg.retry, RetryPolicy::default());
        assert_eq!(
            (cfg.api, cfg.auth),
            (ApiShape::ChatCompletions, Auth::Bearer)
        );
        // Older conversations without `opaque` still read.
        let message: Message =
            serde_json::from_value(json!({"role": "assistant", "content": "hi", "tool_calls": []}))
                .expect("message");
        assert_eq!(
            message,
            Message::Assistant {
                content: Some("hi".into()),
                tool_calls: vec![],
                opaque: vec![]
            }
        );
        assert!(
            serde_json::to_value(&message)
                .expect("json")
                .get("opaque")
                .is_none()
        );
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

    /// A scripted server that answers "hi" to anything, `delay_ms` before
    /// its first token.
    async fn slow_hi(delay_ms: u64) -> ScriptedServer {
        let script = Script::from_json(&format!(
            r#"{{ "firstTokenDelayMs": {delay_ms}, "default": {{ "steps": [ {{ "answer": "hi" }} ] }} }}"#
        ))
        .expect("script");
        within(ScriptedServer::start(
            "127.0.0.1:0".parse().expect("addr"),
            script,
        ))
        .await
        .expect("start")
    }

    /// Calls in flight at once: over HTTP/1.1 each holds a connection of
    /// its own; with `HttpVersion::Http2` (h2c) they share a few.
    #[tokio::test]
    async fn http2_calls_in_flight_share_a_few_connections() {
        const CALLS: usize = 12;
        for (http, most) in [
            (HttpVersion::Http1, CALLS),
            (HttpVersion::Http2, crate::connections::H2_CONNECTIONS),
        ] {
            let server = slow_hi(300).await;
            let client = LlmClient::new(LlmConfig {
                http,
                ..config(server.base_url())
            })
            .expect("client");
            let calls = (0..CALLS).map(|_| {
                let client = client.clone();
                async move {
                    client
                        .stream_chat(&request(vec![user("hello")]), |_| {})
                        .await
                }
            });
            for done in within(futures::future::join_all(calls)).await {
                assert_eq!(done.expect("answered").text, "hi");
            }
            assert_eq!(server.connections() as usize, most, "{http:?}");
        }
    }

    /// One HTTP/2 connection to the model breaks under hundreds of
    /// waiting calls (a TCP proxy in between drops it): no call fails.
    /// Each that was on it is tried again on a fresh connection (the
    /// default retry policy), never on the dead one; the calls on the
    /// other connections never notice.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_broken_http2_connection_fails_no_call_a_retry_can_save() {
        const CALLS: usize = 300;
        let server = slow_hi(1500).await;
        let target = server.base_url();
        let proxy = toolfleet_testkit::proxy::Proxy::start(&format!(
            "{}:{}",
            target.host_str().expect("host"),
            target.port().expect("port")
        ))
        .await
        .expect("proxy");
        let mut base = target.clone();
        base.set_port(Some(proxy.port())).expect("port");
        let client = LlmClient::new(LlmConfig {
            http: HttpVersion::Http2,
            retry: RetryPolicy::default(),
            ..config(base)
        })
        .expect("client");
        let calls: Vec<_> = (0..CALLS)
            .map(|_| {
                let client = client.clone();
                tokio::spawn(async move {
                    client
                        .stream_chat(&request(vec![user("hello")]), |_| {})
                        .await
                })
            })
            .collect();
        // Every call is waiting on the model; one connection breaks.
        tokio::time::sleep(Duration::from_millis(700)).await;
        proxy.cut_one();
        let mut retried = 0;
        for call in calls {
            let done = within(call).await.expect("no panic").expect("answered");
            assert_eq!(done.text, "hi");
            retried += usize::from(done.attempts > 1);
        }
        // The broken connection's calls were tried again; the others not.
        assert!(
            retried > 0 && retried < CALLS,
            "{retried} of {CALLS} retried"
        );
    }

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

    /// The request body goes with its length (never chunked) and is not
    /// kept, so a redirect is not followed: the error names where to,
    /// without credentials, and is final.
    #[tokio::test]
    async fn a_redirect_is_not_followed_and_says_where_to() {
        let router = Router::new().route(
            "/v1/chat/completions",
            post(|headers: AxumHeaders, body: Bytes| async move {
                let length = headers
                    .get(header::CONTENT_LENGTH)
                    .and_then(|v| v.to_str().ok())
                    .map(str::to_owned);
                if length != Some(body.len().to_string()) {
                    return (StatusCode::LENGTH_REQUIRED, "no content-length").into_response();
                }
                (
                    StatusCode::PERMANENT_REDIRECT,
                    [(
                        "location",
                        "https://user:pw@elsewhere.example/v1/chat/completions",
                    )],
                    "",
                )
                    .into_response()
            }),
        );
        let base = spawn(router).await;
        let client = LlmClient::new(config(base)).expect("client");
        let err = within(client.stream_chat(&request(vec![user("hi")]), |_| {}))
            .await
            .expect_err("a redirect fails the call");
        assert_eq!(err.code(), "http_308", "{err}");
        assert!(!err.is_retryable());
        assert!(err.to_string().contains("elsewhere.example"), "{err}");
        assert!(!err.to_string().contains("pw@"), "{err}");
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

    // -----------------------------------------------------------------------
    // Resilience, both API shapes and cancellation, against real HTTP
    // streams from the scripted server and its injected faults.

    async fn scripted(script: &str) -> ScriptedServer {
        within(ScriptedServer::start(
            "127.0.0.1:0".parse().expect("addr"),
            Script::from_json(script).expect("script"),
        ))
        .await
        .expect("start")
    }

    /// Quick retries, so tests spend their time where the server says.
    fn fast_retries() -> RetryPolicy {
        RetryPolicy {
            max_attempts: 3,
            max_elapsed: Duration::from_secs(10),
            base_delay: Duration::from_millis(10),
            max_delay: Duration::from_millis(50),
        }
    }

    fn client(server: &ScriptedServer, api: ApiShape) -> LlmClient {
        LlmClient::new(LlmConfig {
            api,
            retry: fast_retries(),
            ..config(server.base_url())
        })
        .expect("client")
    }

    /// Runs one streamed call, returning its result and the text deltas.
    async fn run(client: &LlmClient, prompt: &str) -> (Result<Completion, LlmError>, Vec<String>) {
        let mut deltas = Vec::new();
        let result =
            within(client.stream_chat(&request(vec![user(prompt)]), |t| deltas.push(t.to_owned())))
                .await;
        (result, deltas)
    }

    const SHAPES: [ApiShape; 2] = [ApiShape::ChatCompletions, ApiShape::Responses];

    #[tokio::test]
    async fn a_429_is_retried_after_the_wait_the_server_asked_for() {
        let server = scripted(
            r#"{"default": {"steps": [{"answer": "after the wait",
                "fault": {"kind": "status", "status": 429, "retryAfterMs": 200,
                          "code": "rate_limit_exceeded", "times": 1}}]}}"#,
        )
        .await;
        let (result, deltas) = run(&client(&server, ApiShape::ChatCompletions), "hi").await;
        let completion = result.expect("second attempt succeeds");
        assert_eq!(completion.text, "after the wait");
        assert_eq!(deltas.concat(), "after the wait");
        assert_eq!(completion.attempts, 2);
        let received = server.received();
        assert_eq!(received.len(), 2);
        assert_eq!(received[0].fault, Some("status"));
        assert_eq!(received[1].fault, None);
        assert_eq!(server.fault_hits(), 1);
        // Measured where it matters, on the server: the retry came no
        // sooner than the server asked, though the backoff alone would
        // have been 10 ms or less.
        let gap = received[1].at.duration_since(received[0].at);
        assert!(gap >= Duration::from_millis(200), "retried after {gap:?}");
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn server_errors_are_retried_a_bounded_number_of_times() {
        let server = scripted(
            r#"{"rules": [
                {"whenUserContains": ["flaky"], "steps": [{"answer": "third time lucky",
                    "fault": {"kind": "status", "status": 500, "times": 2}}]},
                {"whenUserContains": ["broken"], "steps": [{"answer": "never",
                    "fault": {"kind": "status", "status": 503}}]},
                {"whenUserContains": ["come back later"], "steps": [{"answer": "never",
                    "fault": {"kind": "status", "status": 429, "retryAfterMs": 60000}}]},
                {"whenUserContains": ["bad request"], "steps": [{"answer": "never",
                    "fault": {"kind": "status", "status": 400, "code": "invalid_value"}}]}
            ]}"#,
        )
        .await;
        let client = client(&server, ApiShape::ChatCompletions);
        let count = |phrase: &str| {
            server
                .requests()
                .iter()
                .filter(|r| r.to_string().contains(phrase))
                .count()
        };

        let (result, _) = run(&client, "flaky").await;
        let completion = result.expect("succeeds on the third attempt");
        assert_eq!(completion.text, "third time lucky");
        assert_eq!(completion.attempts, 3);
        assert_eq!(count("flaky"), 3);

        let (result, deltas) = run(&client, "broken").await;
        let err = result.expect_err("fails every time");
        assert_eq!(
            err.kind(),
            &LlmErrorKind::Status {
                status: 503,
                code: Some("server_error".into())
            }
        );
        assert_eq!(err.attempts(), 3, "max_attempts");
        assert_eq!(count("broken"), 3);
        assert!(deltas.is_empty());

        // Waiting longer than the time budget allows is not attempted.
        let (result, _) = run(&client, "come back later").await;
        let err = result.expect_err("gives up at once");
        assert_eq!(err.attempts(), 1);
        assert_eq!(err.retry_after(), Some(Duration::from_secs(60)));
        assert_eq!(count("come back later"), 1);

        // Not retryable at all.
        let err = within(client.chat(&request(vec![user("bad request")])))
            .await
            .expect_err("400");
        assert_eq!(err.code(), "invalid_value");
        assert_eq!(err.attempts(), 1);
        assert_eq!(count("bad request"), 1);
        assert_eq!(server.fault_hits(), 2 + 3 + 1 + 1);
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn nothing_is_retried_once_text_or_a_tool_call_has_streamed() {
        let server = scripted(
            r#"{"rules": [
                {"whenUserContains": ["cut text"], "steps": [{"answer": "one two three four five six",
                    "fault": {"kind": "cutMidText"}}]},
                {"whenUserContains": ["cut call"], "steps": [{"toolCalls": [
                    {"name": "get_weather", "arguments": {"city": "Paris", "units": "metric"}}],
                    "fault": {"kind": "cutMidToolCall"}}]}
            ]}"#,
        )
        .await;
        for api in SHAPES {
            let client = client(&server, api);
            let before = server.received().len();
            let (result, deltas) = run(&client, "cut text").await;
            let err = result.expect_err("cut after the first text");
            assert_eq!(err.kind(), &LlmErrorKind::Connect, "{api:?}");
            assert_eq!(err.code(), "connection_lost", "{api:?}");
            assert!(err.is_retryable(), "{api:?}: retryable in itself");
            assert_eq!(err.attempts(), 1, "{api:?}: but text had streamed");
            assert_eq!(deltas, ["one two three "], "{api:?}");

            let (result, deltas) = run(&client, "cut call").await;
            let err = result.expect_err("cut mid tool call");
            assert_eq!(err.kind(), &LlmErrorKind::Connect, "{api:?}");
            assert_eq!(err.code(), "connection_lost", "{api:?}");
            assert_eq!(err.attempts(), 1, "{api:?}");
            assert!(deltas.is_empty(), "{api:?}");
            assert_eq!(
                server.received().len(),
                before + 2,
                "{api:?}: one request each"
            );
        }
        assert_eq!(server.stream_stats().cut, 4);
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn malformed_chunks_are_protocol_errors_and_not_retried() {
        let server = scripted(
            r#"{"default": {"steps": [{"answer": "x", "fault": {"kind": "malformedChunk"}}]}}"#,
        )
        .await;
        for api in SHAPES {
            let client = client(&server, api);
            let (result, _) = run(&client, "hi").await;
            let err = result.expect_err("malformed");
            assert_eq!(err.kind(), &LlmErrorKind::Protocol, "{api:?}");
            assert_eq!(err.attempts(), 1, "{api:?}");
            let err = within(client.chat(&request(vec![user("hi")])))
                .await
                .expect_err("malformed body");
            assert_eq!(err.kind(), &LlmErrorKind::Protocol, "{api:?}");
        }
        assert_eq!(server.fault_hits(), 4);
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn a_slow_first_token_times_out_and_is_retried() {
        let server = scripted(
            r#"{"rules": [
                {"whenUserContains": ["once"], "steps": [{"answer": "worth the wait",
                    "fault": {"kind": "slowFirstToken", "delayMs": 5000, "times": 1}}]},
                {"whenUserContains": ["always"], "steps": [{"answer": "too late",
                    "fault": {"kind": "slowFirstToken", "delayMs": 5000}}]}
            ]}"#,
        )
        .await;
        for api in SHAPES {
            let client = LlmClient::new(LlmConfig {
                api,
                first_token_timeout: Duration::from_millis(500),
                retry: RetryPolicy {
                    max_attempts: 2,
                    ..fast_retries()
                },
                ..config(server.base_url())
            })
            .expect("client");
            let (result, _) = run(&client, "always").await;
            let err = result.expect_err("never in time");
            assert_eq!(err.kind(), &LlmErrorKind::Timeout, "{api:?}");
            assert_eq!(err.attempts(), 2, "{api:?}: timeouts are retried");
        }
        let client = LlmClient::new(LlmConfig {
            first_token_timeout: Duration::from_millis(500),
            retry: fast_retries(),
            ..config(server.base_url())
        })
        .expect("client");
        let (result, _) = run(&client, "once").await;
        let completion = result.expect("the retry is on time");
        assert_eq!(completion.text, "worth the wait");
        assert_eq!(completion.attempts, 2);
        assert_eq!(server.fault_hits(), 5);
        // The client hung up on every slow stream.
        let stats = within(server.wait_for_streams(|s| s.dropped == 5)).await;
        assert_eq!(stats.completed, 1);
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn running_out_of_tokens_marks_the_completion_truncated() {
        let server = scripted(
            r#"{"rules": [
                {"whenUserContains": ["calls"], "steps": [{"toolCalls": [
                    {"name": "get_weather", "arguments": {"city": "Paris"}},
                    {"name": "lookup", "arguments": {}}], "fault": {"kind": "length"}}]},
                {"whenUserContains": ["essay"], "steps": [{"answer": "a very long essay indeed",
                    "fault": {"kind": "length"}}]}
            ]}"#,
        )
        .await;
        for api in SHAPES {
            let client = client(&server, api);
            for streamed in [true, false] {
                let ctx = format!("{api:?} streamed={streamed}");
                let completion = if streamed {
                    run(&client, "calls").await.0
                } else {
                    within(client.chat(&request(vec![user("calls")]))).await
                }
                .expect("a truncated answer is still an answer");
                assert_eq!(completion.finish_reason, FinishReason::Length, "{ctx}");
                assert!(completion.is_truncated(), "{ctx}");
                assert_eq!(completion.tool_calls.len(), 1, "{ctx}");
                assert_eq!(completion.tool_calls[0].name, "get_weather", "{ctx}");
                assert!(
                    serde_json::from_str::<serde_json::Value>(&completion.tool_calls[0].arguments)
                        .is_err(),
                    "{ctx}: the arguments were cut"
                );
                let completion = if streamed {
                    run(&client, "essay").await.0
                } else {
                    within(client.chat(&request(vec![user("essay")]))).await
                }
                .expect("truncated text");
                assert!(completion.is_truncated(), "{ctx}");
                assert_eq!(completion.text, "a very long ", "{ctx}: half the text");
            }
        }
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn refusals_arrive_in_both_shapes() {
        let server =
            scripted(r#"{"default": {"steps": [{"refusal": "I can't help with that."}]}}"#).await;
        for api in SHAPES {
            let client = client(&server, api);
            let (result, deltas) = run(&client, "something bad").await;
            let plain = within(client.chat(&request(vec![user("something bad")]))).await;
            for completion in [result, plain] {
                let completion = completion.expect("a refusal is an answer");
                assert_eq!(
                    completion.refusal.as_deref(),
                    Some("I can't help with that."),
                    "{api:?}"
                );
                assert_eq!(completion.text, "", "{api:?}");
                assert!(completion.tool_calls.is_empty(), "{api:?}");
                assert_eq!(completion.finish_reason, FinishReason::Stop, "{api:?}");
            }
            assert!(deltas.is_empty(), "{api:?}: a refusal is not answer text");
        }
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn the_responses_api_runs_a_tool_round_with_reasoning_replayed() {
        let server = scripted(
            r#"{"rules": [{"whenUserContains": ["weather"], "steps": [
                {"reasoning": true, "toolCalls": [
                    {"name": "get_weather", "arguments": {"city": "Paris"}},
                    {"name": "lookup", "arguments": {"q": "umbrella etiquette"}}]},
                {"answer": "The weather: {{tool:get_weather}} Also: {{tool:lookup}}"}
            ]}]}"#,
        )
        .await;
        assert!(server_is_reasoning_model(&server));
        let client = LlmClient::new(LlmConfig {
            api: ApiShape::Responses,
            reasoning: true,
            retry: fast_retries(),
            ..config(server.base_url())
        })
        .expect("client");
        assert_eq!(client.api(), ApiShape::Responses);
        let mut messages = vec![
            Message::System {
                content: "Be brief.".into(),
            },
            user("What's the weather in Paris?"),
        ];
        let mut deltas = Vec::new();
        let first =
            within(client.stream_chat(&request(messages.clone()), |t| deltas.push(t.to_owned())))
                .await
                .expect("first round");
        assert!(deltas.is_empty());
        assert_eq!(first.finish_reason, FinishReason::ToolCalls);
        let names: Vec<_> = first.tool_calls.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["get_weather", "lookup"]);
        assert!(first.tool_calls.iter().all(|c| c.id.starts_with("call_")));
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&first.tool_calls[0].arguments)
                .expect("arguments JSON"),
            json!({"city": "Paris"})
        );
        assert_eq!(first.opaque.len(), 1);
        assert_eq!(first.opaque[0]["type"], json!("reasoning"));
        assert!(first.usage.is_some_and(|u| u.reasoning_tokens > 0));

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
        let second = within(client.stream_chat(&request(messages), |t| deltas.push(t.to_owned())))
            .await
            .expect("second round");
        let want = "The weather: 21C and sunny [doc:1] Also: bring one [doc:2]";
        assert_eq!(second.text, want);
        assert_eq!(deltas.concat(), want);
        assert!(deltas.len() > 1);
        assert_eq!(second.finish_reason, FinishReason::Stop);
        assert!(second.opaque.is_empty());

        let received = server.received();
        assert_eq!(received.len(), 2);
        assert!(received.iter().all(|r| r.path == "/v1/responses"));
        let sent = &received[0].body;
        assert_eq!(sent["instructions"], json!("Be brief."));
        assert_eq!(sent["stream"], json!(true));
        assert_eq!(sent["store"], json!(false));
        assert_eq!(sent["include"], json!(["reasoning.encrypted_content"]));
        assert_eq!(sent["tool_choice"], json!("auto"));
        assert_eq!(sent["parallel_tool_calls"], json!(true));
        assert_eq!(sent["tools"][0]["name"], json!("get_weather"), "flat tools");
        assert!(sent["tools"][0].get("function").is_none());
        // The second request carries the round: the reasoning item as it
        // came, the calls, and their outputs correlated by call_id.
        let input = received[1].body["input"].as_array().expect("input items");
        let kinds: Vec<&str> = input.iter().filter_map(|i| i["type"].as_str()).collect();
        assert_eq!(
            kinds,
            [
                "message",
                "reasoning",
                "function_call",
                "function_call",
                "function_call_output",
                "function_call_output"
            ]
        );
        assert_eq!(input[1], first.opaque[0]);
        for (i, call) in first.tool_calls.iter().enumerate() {
            assert_eq!(input[2 + i]["call_id"], json!(call.id));
            assert_eq!(input[2 + i]["name"], json!(call.name));
            assert_eq!(input[2 + i]["arguments"], json!(call.arguments));
            assert_eq!(input[4 + i]["call_id"], json!(call.id));
        }
        assert_eq!(input[4]["output"], json!("21C and sunny [doc:1]"));
        within(server.shutdown()).await;
    }

    /// Whether the scripted server stands in for a reasoning model (its
    /// script says so, or a step reasons).
    fn server_is_reasoning_model(server: &ScriptedServer) -> bool {
        server.script().is_reasoning_model()
    }

    /// The default: gpt-4o-mini and friends answer 400 to a request for
    /// encrypted reasoning, so a deployment not marked as a reasoning model
    /// never sends one, and its tool loop runs.
    #[tokio::test]
    async fn a_model_not_marked_as_reasoning_is_not_asked_for_encrypted_reasoning() {
        let server = scripted(SCRIPT).await;
        assert!(!server_is_reasoning_model(&server));
        for stream in [true, false] {
            let client = LlmClient::new(LlmConfig {
                api: ApiShape::Responses,
                stream,
                ..config(server.base_url())
            })
            .expect("client");
            let mut messages = vec![user("What's the weather in Paris?")];
            let first = within(client.stream_chat(&request(messages.clone()), |_| {}))
                .await
                .expect("first round");
            assert_eq!(first.tool_calls.len(), 2);
            assert!(first.opaque.is_empty());
            messages.push(first.assistant_message());
            for call in &first.tool_calls {
                messages.push(Message::Tool {
                    call_id: call.id.clone(),
                    content: "sunny".into(),
                });
            }
            let second = within(client.stream_chat(&request(messages), |_| {}))
                .await
                .expect("second round");
            assert_eq!(second.text, "The weather: sunny Also: sunny");
        }
        let received = server.received();
        assert_eq!(received.len(), 4);
        for r in &received {
            assert!(r.body.get("include").is_none(), "{}", r.body);
            assert_eq!(r.body["store"], json!(false));
        }

        // Marking it as a reasoning model anyway gets the real API's answer.
        let client = LlmClient::new(LlmConfig {
            api: ApiShape::Responses,
            reasoning: true,
            ..config(server.base_url())
        })
        .expect("client");
        let (result, _) = run(&client, "What's the weather in Paris?").await;
        let err = result.expect_err("refused");
        assert!(
            matches!(err.kind(), LlmErrorKind::Status { status: 400, .. }),
            "{err:?}"
        );
        assert!(!err.is_retryable());
        assert!(
            err.to_string()
                .contains("Encrypted content is not supported with this model"),
            "{err}"
        );
        within(server.shutdown()).await;
    }

    /// A reasoning model on a deployment not marked as one sends reasoning
    /// items without their encrypted content; with `store: false` they
    /// cannot go back (the API answers 404), so the loop goes on without
    /// them.
    #[tokio::test]
    async fn an_unmarked_reasoning_model_still_runs_its_tool_loop() {
        let server = scripted(
            r#"{"rules": [{"whenUserContains": ["weather"], "steps": [
                {"reasoning": true, "toolCalls": [{"name": "get_weather", "arguments": {}}]},
                {"answer": "It is {{tool:get_weather}}"}
            ]}]}"#,
        )
        .await;
        assert!(server_is_reasoning_model(&server));
        let client = client(&server, ApiShape::Responses);
        let mut messages = vec![user("weather?")];
        let first = within(client.stream_chat(&request(messages.clone()), |_| {}))
            .await
            .expect("first round");
        assert_eq!(first.opaque.len(), 1);
        assert!(first.opaque[0].get("encrypted_content").is_none());
        messages.push(first.assistant_message());
        messages.push(Message::Tool {
            call_id: first.tool_calls[0].id.clone(),
            content: "sunny".into(),
        });
        let second = within(client.stream_chat(&request(messages), |_| {}))
            .await
            .expect("second round");
        assert_eq!(second.text, "It is sunny");
        let received = server.received();
        assert_eq!(received.len(), 2);
        let kinds: Vec<&str> = received[1].body["input"]
            .as_array()
            .expect("input")
            .iter()
            .filter_map(|i| i["type"].as_str())
            .collect();
        assert_eq!(
            kinds,
            ["message", "function_call", "function_call_output"],
            "the bare reasoning item stays out"
        );
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn without_streaming_the_whole_text_comes_once() {
        let server = scripted(
            r#"{"default": {"steps": [{"answer": "one whole answer in a single body"}]}}"#,
        )
        .await;
        for api in SHAPES {
            let client = LlmClient::new(LlmConfig {
                api,
                stream: false,
                ..config(server.base_url())
            })
            .expect("client");
            let (result, deltas) = run(&client, "hi").await;
            let completion = result.expect("answer");
            assert_eq!(completion.text, "one whole answer in a single body");
            assert_eq!(deltas, ["one whole answer in a single body"], "{api:?}");
            assert_eq!(completion.finish_reason, FinishReason::Stop);
            assert!(completion.usage.is_some_and(|u| u.total_tokens > 0));
        }
        let received = server.received();
        assert_eq!(received[0].path, "/v1/chat/completions");
        assert_eq!(received[1].path, "/v1/responses");
        for r in &received {
            assert_eq!(r.body["stream"], json!(false));
            assert_eq!(r.header("accept"), Some("application/json"));
        }
        assert_eq!(server.stream_stats(), StreamStats::default(), "no streams");
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn azure_style_key_header_and_api_version_reach_the_server() {
        let server = scripted(r#"{"default": {"steps": [{"answer": "hello Azure"}]}}"#).await;
        for api in SHAPES {
            let client = LlmClient::new(LlmConfig {
                api,
                auth: Auth::Header("api-key".into()),
                extra_query: vec![("api-version".into(), "2025-04-01-preview".into())],
                ..config(server.base_url())
            })
            .expect("client");
            let (result, _) = run(&client, "hi").await;
            assert_eq!(result.expect("answer").text, "hello Azure");
        }
        for received in server.received() {
            assert_eq!(received.header("api-key"), Some(SECRET));
            assert_eq!(received.header("authorization"), None);
            assert_eq!(
                received.query.as_deref(),
                Some("api-version=2025-04-01-preview")
            );
        }
        let err = LlmClient::new(LlmConfig {
            auth: Auth::Header("bad header".into()),
            ..config(server.base_url())
        })
        .expect_err("not a header name");
        assert_eq!(err.code(), "config");
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn dropping_the_call_closes_the_stream_at_once() {
        let words = vec!["word"; 90].join(" ");
        let server = scripted(&format!(
            r#"{{"chunkDelayMs": 50, "default": {{"steps": [{{"answer": "{words}"}}]}}}}"#
        ))
        .await;
        for api in SHAPES {
            let before = server.stream_stats();
            let client = client(&server, api);
            let req = request(vec![user("tell me everything")]);
            let (first_text, got_text) = tokio::sync::oneshot::channel();
            let mut first_text = Some(first_text);
            let mut call = Box::pin(client.stream_chat(&req, move |_| {
                if let Some(tx) = first_text.take() {
                    let _ = tx.send(());
                }
            }));
            within(async {
                tokio::select! {
                    _ = &mut call => panic!("the answer ended before it could be cancelled"),
                    got = got_text => got.expect("first text"),
                }
            })
            .await;
            assert_eq!(server.stream_stats().started, before.started + 1);
            drop(call);
            // 30 chunks 50 ms apart were still to come: the server sees the
            // client go long before it could finish.
            let stats = within(server.wait_for_streams(|s| s.dropped == before.dropped + 1)).await;
            assert_eq!(stats.completed, before.completed, "{api:?}");
        }
        within(server.shutdown()).await;
    }

    // -----------------------------------------------------------------------
    // Image generation.

    fn image_request(model: &str, prompt: &str, format: Option<ImageFormat>) -> ImageRequest {
        ImageRequest {
            model: model.to_owned(),
            prompt: prompt.to_owned(),
            size: Some("1024x1024".into()),
            quality: None,
            response_format: format,
        }
    }

    #[tokio::test]
    async fn images_come_as_urls_or_base64_from_the_scripted_server() {
        use base64::Engine as _;
        // 13 MiB is more than 16 MiB once base64-encoded: more than a chat
        // body may be, so this also shows the images path reads its own,
        // larger bound.
        const IMAGE_BYTES: usize = 13 * 1024 * 1024;
        let server = scripted(&format!(r#"{{"imageBytes": {IMAGE_BYTES}}}"#)).await;
        let client = LlmClient::new(LlmConfig {
            extra_query: vec![("api-version".into(), "2025-04-01-preview".into())],
            ..config(server.base_url())
        })
        .expect("client");

        let prompt = "a lighthouse at dusk";
        let answer = within(client.generate_image(&image_request("dall-e-3", prompt, None)))
            .await
            .expect("url answer");
        assert_eq!(answer.attempts, 1);
        assert_eq!(answer.images.len(), 1);
        let image = &answer.images[0];
        assert!(
            image
                .url
                .as_deref()
                .is_some_and(|u| u.starts_with("https://images.scripted.invalid/")),
            "{image:?}"
        );
        assert_eq!(image.b64_json, None);
        assert_eq!(image.revised_prompt.as_deref(), Some(prompt));
        let usage = answer.usage.expect("usage");
        assert!(usage.prompt_tokens > 0);
        assert_eq!(usage.completion_tokens, 0);
        assert_eq!(usage.total_tokens, usage.prompt_tokens);

        // gpt-image models answer in base64 unasked; others when asked.
        for req in [
            image_request("gpt-image-1", prompt, None),
            image_request("dall-e-2", prompt, Some(ImageFormat::B64Json)),
        ] {
            let answer = within(client.generate_image(&req))
                .await
                .expect("base64 answer");
            let image = &answer.images[0];
            assert_eq!(image.url, None, "{}", req.model);
            let bytes = base64::engine::general_purpose::STANDARD
                .decode(image.b64_json.as_deref().expect("b64_json"))
                .expect("valid base64");
            assert_eq!(bytes.len(), IMAGE_BYTES, "{}", req.model);
            assert!(bytes.starts_with(b"\x89PNG\r\n\x1a\n"), "{}", req.model);
        }

        let received = server.received();
        assert_eq!(received.len(), 3);
        for r in &received {
            assert_eq!(r.path, "/v1/images/generations");
            assert_eq!(r.query.as_deref(), Some("api-version=2025-04-01-preview"));
            assert_eq!(
                r.header("authorization"),
                Some(format!("Bearer {SECRET}").as_str())
            );
            assert_eq!(r.header("accept"), Some("application/json"));
            assert_eq!(r.body["n"], json!(1));
            assert_eq!(r.body["prompt"], json!(prompt));
            assert_eq!(r.body["size"], json!("1024x1024"));
            assert!(r.body.get("quality").is_none(), "{}", r.body);
        }
        assert!(received[0].body.get("response_format").is_none());
        assert!(received[1].body.get("response_format").is_none());
        assert_eq!(received[2].body["response_format"], json!("b64_json"));
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn a_refused_image_prompt_keeps_the_providers_code_and_is_not_retried() {
        let server = scripted("{}").await;
        let client = client(&server, ApiShape::ChatCompletions);
        let err =
            within(client.generate_image(&image_request("dall-e-3", "please refuse image", None)))
                .await
                .expect_err("refused");
        assert_eq!(
            err.kind(),
            &LlmErrorKind::Status {
                status: 400,
                code: Some("content_policy_violation".into())
            }
        );
        assert_eq!(err.code(), "content_policy_violation");
        assert!(!err.is_retryable());
        assert_eq!(err.attempts(), 1);
        assert!(err.to_string().contains("safety system"), "{err}");
        assert!(!err.to_string().contains(SECRET), "{err}");
        assert_eq!(server.received().len(), 1, "one request");
        within(server.shutdown()).await;
    }

    #[tokio::test]
    async fn failing_image_servers_are_retried_per_policy_and_never_show_the_key() {
        let prompts = Arc::new(Mutex::new(Vec::<String>::new()));
        let record = prompts.clone();
        let router = Router::new().route(
            "/v1/images/generations",
            post(move |body: Bytes| {
                let record = record.clone();
                async move {
                    let body: serde_json::Value =
                        serde_json::from_slice(&body).expect("request body is JSON");
                    let prompt = body["prompt"].as_str().unwrap_or_default().to_owned();
                    let seen = {
                        let mut prompts = record.lock().expect("lock");
                        prompts.push(prompt.clone());
                        prompts.iter().filter(|p| **p == prompt).count()
                    };
                    let unavailable = (
                        StatusCode::SERVICE_UNAVAILABLE,
                        format!(
                            r#"{{"error":{{"message":"overloaded, key {SECRET}","type":"server_error","code":null}}}}"#
                        ),
                    )
                        .into_response();
                    let ok = |data: serde_json::Value| {
                        axum::Json(json!({"created": 1, "data": data})).into_response()
                    };
                    match prompt.as_str() {
                        "flaky" if seen <= 2 => unavailable,
                        "flaky" => ok(json!([{"url": "https://img.example/a.png"}])),
                        "empty" => ok(json!([])),
                        _ => unavailable,
                    }
                }
            }),
        );
        let base = spawn(router).await;
        let client = LlmClient::new(LlmConfig {
            retry: fast_retries(),
            ..config(base)
        })
        .expect("client");
        let count = |prompt: &str| {
            prompts
                .lock()
                .expect("lock")
                .iter()
                .filter(|p| *p == prompt)
                .count()
        };
        let generate = |prompt: &'static str| {
            let client = client.clone();
            async move { within(client.generate_image(&image_request("dall-e-3", prompt, None))).await }
        };

        let answer = generate("flaky").await.expect("third time lucky");
        assert_eq!(answer.attempts, 3);
        assert_eq!(
            answer.images[0].url.as_deref(),
            Some("https://img.example/a.png")
        );
        assert_eq!(count("flaky"), 3);

        let err = generate("down").await.expect_err("503 every time");
        assert_eq!(
            err.kind(),
            &LlmErrorKind::Status {
                status: 503,
                code: Some("server_error".into())
            }
        );
        assert!(err.is_retryable());
        assert_eq!(err.attempts(), 3, "max_attempts");
        assert_eq!(count("down"), 3);
        assert!(
            err.to_string().contains("overloaded, key [redacted]"),
            "{err}"
        );
        assert!(!err.to_string().contains(SECRET), "{err}");
        assert!(!format!("{err:?}").contains(SECRET), "{err:?}");

        // A 200 that is not an image answer is not worth asking again.
        let err = generate("empty").await.expect_err("no images");
        assert_eq!(err.kind(), &LlmErrorKind::Protocol);
        assert_eq!(err.attempts(), 1);
        assert_eq!(count("empty"), 1);
    }

    #[tokio::test]
    async fn an_image_server_that_is_down_is_retried_as_a_connect_error() {
        // A port that was free a moment ago and has no listener now.
        let addr: SocketAddr = {
            let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
            listener.local_addr().expect("addr")
        };
        let client = LlmClient::new(LlmConfig {
            retry: fast_retries(),
            ..config(Url::parse(&format!("http://{addr}/v1")).expect("url"))
        })
        .expect("client");
        let err = within(client.generate_image(&image_request("dall-e-3", "hi", None)))
            .await
            .expect_err("nothing listens");
        assert_eq!(err.kind(), &LlmErrorKind::Connect);
        assert_eq!(err.attempts(), 3, "retried per policy");
        assert!(err.to_string().contains(&addr.to_string()), "{err}");
        assert!(!err.to_string().contains(SECRET), "{err}");
    }
}
