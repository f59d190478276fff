//! toolfleet: the `toolfleet` command. The fleet itself lives in the
//! workspace's crates (see ARCHITECTURE.md); this package assembles them
//! for an operator.
//!
//! # Layout
//!
//! - [`cli`]: the command line — chat, demo, up, tools, index, bench,
//!   scripted-model.
//! - [`families`]: the tool families this command starts, by name. The
//!   only place here that names a family.
//! - [`bench`]: the load generator behind `toolfleet bench`: operations
//!   (raw tool calls, chat jobs) at a concurrency for a count or a
//!   duration, summarised as throughput, percentiles and errors.
//! - [`bench_fleet`]: the fleet the bench measures, in-process or as
//!   separate processes (model, orchestrator, workers), with the bench's
//!   `bench:sleep` tool and the orchestrator's memory sampler.
//! - [`bench_run`]: `toolfleet bench` from arguments to report.
//! - [`floor`]: the transport floors `toolfleet bench --floor` measures the
//!   fleet against (JetStream work queue, core request-reply, and for an
//!   LLM tool a direct call to the same model).
//! - [`mcp_serve`]: `toolfleet mcp serve`, the live fleet's tools as an
//!   MCP server.
//! - [`ops`]: operator commands that read the running fleet: `status`
//!   and `events`.
//! - [`svg`]: the bench's latency chart.

pub mod bench;
pub mod bench_fleet;
pub mod bench_run;
pub mod cli;
pub mod families;
pub mod floor;
pub mod mcp_serve;
pub mod ops;
pub mod svg;
