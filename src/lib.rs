//! toolfleet: the `toolfleet` command. The fleet itself lives in the
//! workspace's crates (see ARCHITECTURE.md); this package assembles them
//! for an operator.
//!
//! # Layout
//!
//! A module per command group, each holding its flags and its body; the
//! imports run one way: [`cli`] → the commands → [`local`], [`families`]
//! and [`common`].
//!
//! - [`cli`]: the clap tree and [`cli::run`], which hands each command to
//!   its module. Nothing here imports it.
//! - [`chat`]: `toolfleet chat` (and the progress and Ctrl-C handling the
//!   demo shares).
//! - [`demo`]: `toolfleet demo`, a whole fleet in this process answering
//!   example questions.
//! - [`serve`]: the commands that serve until a signal: `up`,
//!   `bench-worker`, `scripted-model`.
//! - [`tools`]: `toolfleet tools` list, show, search, validate.
//! - [`index`]: `toolfleet ingest` and `toolfleet index search`.
//! - [`blob`]: `toolfleet blob get`.
//! - [`cache`]: `toolfleet cache purge`, the tool-result cache.
//! - [`settings`]: `toolfleet settings set|get|ls|rm`, the operator's
//!   per-tenant tool settings.
//! - [`schedule`]: `toolfleet schedule add|ls|rm|pause|resume`, scheduled
//!   chat jobs.
//! - [`ops`]: the operator's commands on a running fleet: `status`,
//!   `events`, `health`, `cancel`, `approve`, `deadletters`.
//! - [`mcp`]: `toolfleet mcp serve`'s flags and start-up; [`mcp_serve`]:
//!   the live fleet's tools as an MCP server.
//! - [`gateway`]: `toolfleet gateway`, the OpenAI-compatible HTTP door
//!   (Chat Completions, Responses, models) with its own `# Layout`;
//!   [`keys`]: `toolfleet keys add|ls|revoke`, its API keys.
//! - [`bench_run`]: `toolfleet bench` from arguments to report, over
//!   [`bench`] (the load generator: operations at a concurrency for a
//!   count or a duration, summarised as throughput, percentiles and
//!   errors), [`bench_fleet`] (the fleet it measures, in-process or as
//!   separate processes, with the bench's `bench:sleep` tool and the
//!   orchestrator's memory sampler), [`floor`] (the transport floors:
//!   JetStream work queue, core request-reply, a direct model call),
//!   [`floor_chat`] (the direct floor of chat jobs: the same model calls
//!   and tool functions without the fleet) and [`svg`] (the latency
//!   chart).
//! - [`local`]: a fleet on this machine: its flags and its NATS and Redis
//!   servers (reused or child processes), for `demo` and `bench`.
//! - [`families`]: the tool families this command starts, by name. The
//!   only place here that names a family.
//! - [`common`]: what several commands share: `--output`, one-line text,
//!   loading tool definitions, checks of typed ids.

pub mod bench;
pub mod bench_fleet;
pub mod bench_noisy;
pub mod bench_run;
pub mod blob;
pub mod cache;
pub mod chat;
pub mod cli;
pub mod common;
pub mod demo;
pub mod families;
pub mod floor;
pub mod floor_chat;
pub mod gateway;
pub mod index;
pub mod keys;
pub mod local;
pub mod mcp;
pub mod mcp_serve;
pub mod ops;
pub mod schedule;
pub mod serve;
pub mod settings;
pub mod svg;
pub mod tools;
