//! toolfleet-service: the process plumbing every fleet binary shares. It
//! depends only on the contract crate (and `toolfleet-build`, the
//! revision macro, which has no dependency at all).
//!
//! # Layout
//!
//! - [`build`]: the version and git revision of this process's build
//!   (`build_info!` in a binary's `main`, handed over once with
//!   `build::set`), for `--version`, metrics, the services API and traces.
//! - [`args`]: command-line and environment groups (`NatsArgs`,
//!   `ToolDefsArgs`; the Redis group is the store's `RedisOptions`), NATS
//!   connection with a start-up wait, exit code 64 on bad configuration,
//!   signals.
//! - `bad_config`: `args::BadConfig`, the configuration error both
//!   `args` and `nats_context` raise (a module of its own so neither needs
//!   the other).
//! - [`nats_context`]: the standard NATS settings (`NATS_URL`,
//!   `NATS_CREDS`, the `nats` CLI's selected context), the fallbacks of
//!   `NatsArgs`.
//! - [`telemetry`]: logs (text or JSON) and traces (OTLP, W3C
//!   `traceparent` across messages and HTTP requests).
//! - [`metrics`]: registration helpers and the `/metrics`, `/livez`,
//!   `/readyz` (and `/healthz`, the same as `/livez`) endpoint; each
//!   subsystem owns its metric struct; `toolfleet_build_info` and the
//!   `process_*` metrics of every served process.
//! - [`health`]: readiness checks (NATS connected, Redis answering,
//!   consumers in place) and the connection gauges.
//! - [`jobs`]: bounded pulling from a durable JetStream consumer, and
//!   in-progress acks for long jobs.
//! - [`serve`]: serve until a signal, then drain within a grace period.
//! - [`netpolicy`]: the SSRF policy (the URL gate and the address gate)
//!   shared by the web worker and the orchestrator's webhook sinks.

pub mod args;
mod bad_config;
pub mod build;
pub mod dead_letters;
pub mod health;
pub mod jobs;
pub mod metrics;
pub mod nats_context;
pub mod netpolicy;
pub mod poison;
pub mod serve;
pub mod telemetry;

pub use serve::{GRACE_PERIOD, Runtime, serve_until_signal};
