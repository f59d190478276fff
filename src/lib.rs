//! toolfleet: an event-driven fleet for LLM tool calling over NATS, JetStream
//! and Redis.
//!
//! Clients submit chat jobs to `toolfleet.chat.submit`; an orchestrator runs
//! the agentic loop against an OpenAI-compatible model and publishes every
//! tool call as a job on a JetStream subject; worker pools take those jobs,
//! write citations to Redis and reply over core NATS.
//!
//! # Layout
//!
//! - [`protocol`]: subjects, header names, the invocation context and the
//!   envelopes of the public contract. The only module that knows names.
//! - [`schema`]: JSON Schema validators, compiled once, used at boundaries.
//! - [`tools`]: tool definition files, tool ids, wire shapes, the registry.
//! - [`llm`]: the only module that speaks provider HTTP (Chat Completions
//!   and Responses API, streaming and not, with retries and timeouts).
//! - [`profiles`]: profiles, deployments and prices from the config file.
//! - [`scripted`]: the scripted OpenAI-compatible model server (a stand-in
//!   for tests and the offline demo, labelled as such).
//! - [`citations`]: the only module that speaks Redis: references, the
//!   shared counter, the result ledger, and reader-side rendering.
//! - [`worker`]: the runtime every worker binary shares.
//! - [`jobs`]: bounded pulling from a durable JetStream consumer.
//! - [`bench`]: the load generator behind `toolfleet bench`.
//! - [`builtin`]: the tool implementations shipped with the fleet.
//! - [`index`]: the full-text document index behind retrieval tools.
//! - [`orchestrator`]: chat-job consumption and the agentic loop.
//! - [`profiles`]: profiles, deployments and prices from the TOML config file.
//! - [`budget`]: the tool-result token cap (tiktoken, head + tail + notice).
//! - [`cli`]: the `toolfleet` command line.
//! - [`client`]: submitting chat jobs and following their events.
//! - [`metrics`]: Prometheus metrics per subsystem and the `/metrics` server.
//! - [`config`]: shared configuration parts read from flags and environment.
//! - [`fleet`]: assembling the orchestrator and workers from configuration.
//! - [`local`]: bringing up `nats-server` and `redis-server` child processes
//!   for the demo and the test harness.

pub mod bench;
pub mod budget;
pub mod builtin;
pub mod citations;
pub mod cli;
pub mod client;
pub mod config;
pub mod fleet;
pub mod index;
pub mod jobs;
pub mod llm;
pub mod local;
pub mod metrics;
pub mod orchestrator;
pub mod profiles;
pub mod protocol;
pub mod schema;
pub mod scripted;
pub mod tools;
pub mod worker;
