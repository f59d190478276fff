//! The scripted model server: a stand-in for an OpenAI-compatible provider,
//! so tests and the offline demo run with no real model. It says so: the
//! start-up log line, the `system_fingerprint` of every response and the
//! `owned_by` of `GET /v1/models` all name it a scripted stand-in.
//!
//! It serves both OpenAI API shapes from the same script:
//!
//! - `POST /v1/chat/completions`: streaming SSE (`data: {..}\n\n` chunks
//!   ending in `data: [DONE]`) or one JSON body;
//! - `POST /v1/responses`: streaming SSE with `event: <type>` lines
//!   (`response.created`, `response.in_progress`,
//!   `response.output_item.added`, `response.output_text.delta`,
//!   `response.function_call_arguments.delta` / `.done`,
//!   `response.output_item.done`, `response.completed` or
//!   `response.incomplete`) or one response object;
//! - `GET /v1/models`;
//! - `POST /v1/images/generations` and `POST /v1/embeddings`, for the
//!   tools that call them.
//!
//! It answers by following a JSON script instead of thinking, can inject
//! faults (error statuses, cut streams, malformed chunks, slow first tokens,
//! truncation) per script step, and records what happened so tests can
//! assert it: every request with its receive time, path, query, headers,
//! body and injected fault ([`ScriptedServer::received`],
//! [`ScriptedServer::requests`], [`ScriptedServer::fault_hits`]), and how
//! every streamed body ended ([`ScriptedServer::stream_stats`]), including
//! streams the client walked away from.
//!
//! # Layout
//!
//! From the bottom up: each module uses only those listed before it. The
//! script format, the faults and the request checks are documented in the
//! `//!` of `script`, `fault` and `request` (and `responses`).
//!
//! - `fault`: the faults a step can inject, and how a step's `fault` is
//!   checked.
//! - `script`: the script format; reading and checking a script; which
//!   rule answers a conversation.
//! - `request`: what both API shapes share in reading a request: the
//!   OpenAI-shaped error, the first checks, the turns a conversation
//!   reduces to.
//! - `reply`: playing the script against the turns: the step, its
//!   placeholders filled, a `length` cut; ids and token estimates.
//! - `state`: what the server keeps across requests: the request log,
//!   fault counts, stream counts.
//! - `sse`: streamed bodies: frames, stream faults, and the paced body that
//!   counts how it ended.
//! - `chat` and `responses`: one per API shape: reading its request and
//!   writing its reply as one body or as streamed frames.
//! - `handler`: the handler both model APIs share: record, play, inject
//!   the fault, answer.
//! - `images` and `embeddings`: the other two endpoints.
//! - `server`: routes, the accept loop, [`serve`] and [`ScriptedServer`].
//!
//! Invariants: only `chat` and `responses` know how the two model APIs
//! shape messages, bodies and frames (the rest works on `Turn`s and a
//! `Reply`); only `state` holds what outlives a request; `script` and
//! `fault` are the script as data and never see a request.

// Tests are exempt from the 100-line limit: a scenario reads top to bottom.
#![cfg_attr(test, allow(clippy::too_many_lines))]

mod chat;
mod embeddings;
mod fault;
mod handler;
mod images;
mod reply;
mod request;
mod responses;
mod script;
mod server;
mod sse;
mod state;
#[cfg(test)]
mod test_support;

pub use embeddings::{EMBEDDING_DIMENSIONS, scripted_embedding};
pub use script::{DEFAULT_MODEL, Script, ScriptError};
pub use server::{ScriptedServer, serve};
pub use state::{Received, StreamStats};

/// Sent as `system_fingerprint` on every response (Chat Completions and
/// Responses alike): anyone reading a recorded response can tell it did
/// not come from a real model.
pub const SYSTEM_FINGERPRINT: &str = "fp_toolfleet_scripted_stand_in";
