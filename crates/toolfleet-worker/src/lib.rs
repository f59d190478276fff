//! toolfleet-worker: the worker SDK — everything a tool author needs to
//! serve tools in a fleet. It depends on the contract, the store and the
//! process plumbing; never on the LLM client or the orchestrator.
//!
//! ```no_run
//! use serde::Deserialize;
//! use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput, Worker};
//!
//! struct Shout;
//!
//! #[derive(Deserialize)]
//! struct Args {
//!     text: String,
//! }
//!
//! impl Tool for Shout {
//!     type Args = Args;
//!     async fn call(&self, _ctx: &ToolCtx, args: Args) -> Result<ToolOutput, ToolError> {
//!         Ok(ToolOutput::text(args.text.to_uppercase()))
//!     }
//! }
//!
//! # fn main() -> Result<(), toolfleet_worker::WorkerError> {
//! let worker = Worker::builder("shouting")
//!     .definition_file("tool_definitions/shouting.shout.json")
//!     .tool("shouting.shout", Shout)
//!     .build()?;
//! # Ok(()) }
//! ```
//!
//! # Layout
//!
//! - [`tool`]: the [`Tool`] trait (typed arguments, deserialised after
//!   schema validation), [`ToolOutput`], [`ToolError`] (kept in `error`,
//!   below `tool`, `ctx` and `hooks`, which all speak of it).
//! - [`ctx`]: [`ToolCtx`] — the call's context, per-tenant settings,
//!   cancellation, [`ToolCtx::cite`], [`ToolCtx::store_blob`] (binary
//!   outputs kept out of the model's context, as a [`BlobRef`]),
//!   [`ToolCtx::progress`].
//! - [`hooks`]: [`Hooks`] on start, complete, error, fallback and warning,
//!   and [`Hooks::before_call`], where policies refuse calls (synchronous:
//!   a policy that needs the network, such as SSRF checks of resolved
//!   addresses, belongs in the tool's connector, with the syntactic part
//!   here). The definition's `minProviderConfidence` is always enforced.
//! - [`builder`]: [`Worker`] and its builder: definitions, one tool per
//!   `implementationKey`, hooks.
//! - [`runtime`]: serving on JetStream and direct delivery, with the result
//!   ledger, our own retries and dead letters; advertising the tools in the
//!   fleet's catalog; each structured output checked against the
//!   definition's `outputSchema`. Its parts are listed in its own layout.
//! - `output`: the `outputSchema` check the runtime and
//!   [`TestCtx::call_checked`] share (a mismatch is a warning
//!   `output_schema_mismatch`, never a failed call).
//! - [`fence`]: untrusted text (web pages, search results, MCP results
//!   and descriptions) wrapped so its content cannot close the wrapper.
//! - [`settings`]: operator settings per tool from the definition's
//!   `settingsSchema` ([`SettingsFile`], [`ToolSettings`]): plain values
//!   from the settings file, secrets only from the environment or files.
//! - [`testing`]: [`TestCtx`], to unit-test a tool without NATS or Redis.
//! - [`metrics`]: the worker runtime's Prometheus metrics.
//! - [`process`]: a worker binary's whole `main` ([`process::main`]: flags
//!   and `TOOLFLEET_*` variables, serve until SIGTERM, drain), or
//!   [`Worker::serve`] with [`WorkerArgs`] parsed by the caller.
//!
//! # Invariants
//!
//! Arguments are validated before any side effect; invalid arguments write
//! nothing and are never retried. The caller gets exactly one result per
//! job, even a dead one; the ack comes after the result is published.
//! Retries are ours (nak with delay), never the consumer's `backoff`.

// A public API: every public item says what it is and why.
#![warn(missing_docs)]

pub mod builder;
pub mod ctx;
mod error;
pub mod fence;
#[cfg(test)]
mod fixtures;
pub mod hooks;
pub mod limits;
pub mod metrics;
mod output;
pub mod process;
pub mod role;
pub mod runtime;
mod service_stats;
pub mod settings;
pub mod testing;
pub mod tool;

pub use builder::{Readiness, Rebuild, Reload, Worker, WorkerBuilder, WorkerError};
pub use ctx::{BlobRef, ToolCtx};
pub use hooks::{CallInfo, Hooks, Refusal};
pub use limits::SharedLimits;
pub use process::WorkerArgs;
pub use runtime::WorkerConfig;
pub use settings::{Secret, SettingsFile, ToolSettings};
pub use testing::TestCtx;
pub use tool::{Tool, ToolError, ToolOutput};
/// The contract: tool definitions, ids, envelopes and the call context.
pub use toolfleet_protocol as protocol;
/// Process plumbing: command-line groups, tracing, exit codes.
pub use toolfleet_service as service;
/// The version and git revision of the binary that expands it, for
/// [`process::main`]: call it in the binary's `main.rs`.
pub use toolfleet_service::build_info;
/// The citation store a worker writes references and results to (needed
/// to run a [`Worker`] yourself with [`Worker::run`]).
pub use toolfleet_store as store;
pub use toolfleet_store::NewReference;

/// The README's worker example compiles (its `rust` blocks run as doctests).
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
mod readme {}
