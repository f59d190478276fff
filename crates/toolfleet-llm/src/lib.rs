//! toolfleet-llm: the only crate that speaks provider HTTP: OpenAI Chat Completions and
//! the OpenAI Responses API, streamed and not, and OpenAI image generation,
//! with timeouts, retries and cancellation.
//!
//! The rest of the crate works with the neutral conversation types defined
//! here ([`Message`], [`ToolCall`], [`ToolSpec`], [`ChatRequest`],
//! [`Completion`]); each API shape lives in private serde types in its own
//! submodule (`to_wire` / `from_wire`) and never leaks out. Tool
//! implementations and the orchestrator never learn which shape was used:
//! [`LlmConfig::api`] picks it per endpoint.
//!
//! # Layout
//!
//! - `client` (re-exported at the root): neutral types, [`LlmConfig`], [`LlmClient`] (request,
//!   authentication, timeouts, retries, status handling);
//! - `connections`: the HTTP clients a client's calls go out on (several
//!   HTTP/2 connections, a broken one replaced, never asked again);
//! - `chat_wire`: Chat Completions wire types and
//!   [`ChatStreamAccumulator`];
//! - `responses_wire`: Responses API wire types and
//!   [`ResponsesStreamAccumulator`];
//! - `images` (re-exported at the root): [`ImageRequest`] / [`ImageAnswer`]
//!   for [`LlmClient::generate_image`], and the `images/generations` wire
//!   types;
//! - `sse`: [`SseDecoder`], bytes to server-sent events;
//! - `retry`: [`RetryPolicy`] and the pure retry decision;
//! - `error`: [`LlmError`] and [`LlmErrorKind`];
//! - [`deployments`]: a model endpoint as the configuration file describes
//!   it, and where its key is read from ([`deployments::EnvSource`]);
//! - [`prices`]: USD per million tokens, a call's cost;
//! - [`model_config`]: the deployments and prices of the fleet's
//!   configuration file, the rest of it skipped (the `toolfleet-config`
//!   crate reads the whole file);
//! - [`config_file`]: errors that name the file, key and position, and the
//!   naming rules of the file's tables;
//! - [`budget`]: the tool-result token cap (tiktoken);
//! - [`args`]: the `--llm-*` / `--config` command-line group.
//!
//! # Invariants
//!
//! - The API key is sent only in the configured header (`Authorization:
//!   Bearer` or, for Azure OpenAI, `api-key`), marked sensitive, and never
//!   appears in `Debug` output, logs or error messages; error messages are
//!   built here, provider text is bounded and scrubbed.
//! - Decoding is pure and synchronous ([`SseDecoder`],
//!   [`ChatStreamAccumulator`], [`ResponsesStreamAccumulator`]), so it is
//!   tested byte-for-byte against recorded provider streams without a
//!   network.
//! - Every wait on the network is bounded: `connect_timeout` for the TCP/TLS
//!   connect, `first_token_timeout` until the first event arrives,
//!   `idle_timeout` between chunks after that, and [`RetryPolicy`] bounds
//!   retries in count and time.
//! - A call is retried only while nothing of its answer has reached the
//!   caller: once text or a tool call has streamed, a failure is returned
//!   as it is, since a second answer could not be told apart from the
//!   first.
//! - Dropping a call's future closes its HTTP connection at once: no task
//!   is spawned, so nothing keeps reading a stream nobody wants.
//! - A request's beginning is stable for the provider's prompt cache: the
//!   first system message (Responses: `instructions`, alone), then the
//!   tools in the caller's order (never re-sorted: the caller keeps it
//!   stable, new tools last), then the conversation, later system messages
//!   included; `prompt_cache_key` goes out only when the deployment
//!   accepts it ([`LlmConfig::prompt_cache_key`]).

pub mod args;
pub mod budget;
mod chat_wire;
mod client;
pub mod config_file;
mod connections;
pub mod deployments;
mod error;
pub mod gate;
mod images;
pub mod model_config;
pub mod prices;
mod responses_wire;
mod retry;
mod sse;

pub use client::*;
