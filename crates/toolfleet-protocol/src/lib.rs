//! toolfleet-protocol: the contract every part of the fleet shares, and
//! nothing else. It depends on no crate of ours.
//!
//! # Layout
//!
//! - [`wire`] (re-exported at the root): subject names, header names, the
//!   invocation and call context carried in headers, the envelopes (chat
//!   job, chat event, tool job, tool reply, dead letter), error codes. The
//!   only place that knows a subject or header name.
//! - [`codes`]: [`ChatErrorCode`], the `code` of an `error` event.
//! - [`approval`]: a person's approval of a parked call, its answer, and
//!   the decisions the orchestrators record.
//! - [`blob`]: [`blob::BlobUri`], how a tool's binary output is named.
//! - [`schema`]: JSON Schema validators, compiled once, no remote `$ref`.
//! - [`tools`]: tool ids, definition files, the neutral [`ToolSpec`] the
//!   provider wire shapes are generated from, the registry.
//! - [`search`]: tool definitions found by a query, with scores.
//! - [`usage`]: token usage of model calls.
//! - [`references`]: the one `[doc:N]` scanner and the reader-side renderer.
//! - [`streams`]: the JetStream stream definitions.
//! - [`catalog`]: what the fleet's live workers serve.
//! - [`registry`]: one immutable view over every source of tools (the
//!   catalog, definition directories, …), with the compat file of
//!   recommended models.
//! - [`client`]: submitting a chat job and following its events.
//! - [`redact`]: credentials out of URLs before they reach a message, and
//!   a call's sensitive arguments out of events and dead letters.
//! - [`thread`]: threads (`threadId`, `multitaskStrategy`) and idempotency
//!   keys.
//! - [`schedule`]: scheduled chat jobs (the `<P>_SCHEDULES` records) and
//!   a job's per-run budget.

// The contract is a public API: every item says what it is to a client or
// worker author.
#![warn(missing_docs)]

pub mod approval;
pub mod blob;
pub mod canonical;
pub mod catalog;
pub mod client;
pub mod codes;
pub mod redact;
pub mod references;
pub mod registry;
pub mod schedule;
pub mod schema;
pub mod search;
pub mod streams;
pub mod thread;
pub mod tools;
pub mod usage;
pub mod wire;

pub use approval::{Approval, ApprovalOutcome};
pub use codes::{ChatErrorCode, ToolErrorCode};
pub use redact::redact_url;
pub use tools::{ToolId, ToolSpec};
pub use usage::Usage;
pub use wire::*;
