//! The orchestrator: takes chat jobs from the `TOOLFLEET_CHAT` work queue
//! with a bounded number in flight and runs one invocation per job.
//!
//! An invocation goes through **stages in one direction**; a stage imports
//! only the stages after it, the parts and the shared types below them
//! (`tests/layout.rs` checks it):
//!
//! 1. [`intake`] — the chat consumer (and the decisions consumer of parked
//!    invocations): decode, typed checks with one rejection path, claims
//!    and leases, the frame every invocation runs in, and one place for
//!    the end of a run (terminal event or park, ack, bookkeeping);
//! 2. [`context`] — opens the [`Invocation`] and runs the ordered
//!    [`ContextHandler`]s: invocation context, conversation, permitted
//!    tools, sink route, scoping, `started`, preemptive RAG, and any a
//!    deployment registers;
//! 3. [`rounds`] — the [`Orchestrator`] trait and [`Agentic`], the
//!    agentic loop: model calls with streamed deltas, each turn's calls,
//!    compaction, `search_tools`;
//! 4. [`dispatch`] — [`ToolRunner`]: tool jobs out (JetStream or direct),
//!    replies, progress, deadlines and catalog readings in, as one closed
//!    event enum; agent tools' calls;
//! 5. [`events`] — [`Events`], one invocation's ordered event publisher.
//!
//! **Parts** the stages call, never calling back up: [`approvals`] (the
//! durable pause: records, the parked bucket, approval requests, timeouts),
//! [`agents`] (an agent tool's call as a nested chat job), [`sinks`]
//! (response routing and its relay), `pools` (the scaling signals, and
//! the declared pools' consumers), [`schedules`] (scheduled chat jobs:
//! each due time fired once across the fleet by compare-and-set).
//!
//! **Shared** below them all: [`Fleet`] (what every invocation shares),
//! [`Settings`], [`invocation`], [`tools`] (snapshot, gates, scoring),
//! [`failure`], [`catalog`], [`usage`], [`quota`] (tenants' rate limits,
//! budgets and per-run caps), [`limits`], [`links`],
//! [`metrics`], `replies`, `text`, `tenant_queue` (per-tenant queues
//! taken in turn, and token buckets), [`threads`] (threads: one job of
//! each at a time by compare-and-set, and the conversation they keep).
//!
//! Around them: [`config`] ([`OrchestratorConfig`]: settings and what a
//! deployment registers) and [`start`](mod@start) (connect, open, spawn,
//! pull, drain).
//!
//! # Invariants
//!
//! - Every invocation ends in exactly one terminal event, and the chat job
//!   is acked after it.
//! - Events are numbered in publish order by one task per invocation.
//! - Only tools a live worker serves (agent tools: the orchestrators; a
//!   declared pool's tools: the pool's first worker to start) and the
//!   job's gates permit are offered; a call to any other tool is answered
//!   at once (with close names), and so is a call whose tool has been
//!   missing from two catalog readings in a row while it waits (bar a
//!   declared pool's: its job waits in its queue for a worker, until just
//!   before the job's deadline).
//! - Every failure ends in an `error` event with a code — never silence.

// Tests are exempt from the 100-line limit: a scenario reads top to bottom.
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod agents;
pub mod approvals;
pub mod caps;
pub mod catalog;
pub mod config;
pub mod context;
pub mod dispatch;
pub mod events;
pub mod failure;
pub mod fleet;
pub mod intake;
pub mod invocation;
pub mod limits;
pub mod links;
pub mod metrics;
mod pools;
mod provider_gate;
pub mod quota;
mod replies;
pub mod rounds;
pub mod schedules;
pub mod settings;
pub mod sinks;
pub mod start;
mod tenant_queue;
mod text;
pub mod threads;
pub mod tools;
pub mod usage;

pub use catalog::LiveCatalog;
pub use config::OrchestratorConfig;
pub use context::{ContextHandler, ContextHandlers, DEFAULT_SYSTEM_PROMPT};
pub use dispatch::ToolRunner;
pub use events::Events;
pub use failure::{Failure, OrchestratorError};
pub use fleet::Fleet;
pub use intake::MAX_CHAT_ATTEMPTS;
pub use invocation::Invocation;
pub use limits::PayloadLimits;
pub use rounds::{Agentic, Answer, Ending, Orchestrator, PURPOSE_CONVERSATION};
pub use settings::Settings;
pub use start::{Ready, run, start};
pub use tools::ToolOutcome;
pub use usage::UsageLedger;
