//! `toolfleet gateway`: the OpenAI-compatible door. `POST
//! /v1/chat/completions`, `POST /v1/responses` (streamed or not), `GET
//! /v1/responses/{id}` and `GET /v1/models`, for any OpenAI client with a
//! key from `toolfleet keys add`. A request becomes a chat job of the key's
//! tenant (and user), submitted and followed over NATS like any client's;
//! the fleet runs the tools, the answer comes back in the API's shape with
//! its citations as the API's annotations. docs/gateway.md is the user's
//! page.
//!
//! # Layout
//!
//! From the request to the wire, each module using only those before it:
//!
//! - [`error`]: `ApiError`, OpenAI's error shape, and the status of every
//!   fleet error code.
//! - [`request`]: both request shapes read into an `Ask` (the profile,
//!   the job's messages, how to answer); what cannot be mapped is a 400.
//! - [`auth`]: the bearer key, looked up by hash in the store on every
//!   request; which models (profiles) it may use.
//! - [`answer`]: the fleet's events folded into `Output`s (text with
//!   citations, held calls, usage, failure): the one place that reads
//!   events.
//! - [`job`]: submitting and following a request's job; giving it up
//!   cancels it.
//! - [`stream`]: an answer as server-sent events, the status line held
//!   until the first output.
//! - [`chat`], [`responses`]: each API's objects and frames, written from
//!   `Output`s.
//! - [`metrics`]: requests by route and status, duration, in flight.
//! - [`server`]: the routes, and [`start`].
//!
//! Invariants: the key is hashed at once and never logged, labelled or
//! repeated; a job's tenant and user are the key's, never the body's; a
//! request that is not taken whole (a parameter the fleet cannot honour)
//! is refused, never half-run.

mod answer;
mod auth;
mod chat;
mod error;
mod job;
pub mod metrics;
mod request;
mod responses;
mod server;
mod stream;

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use clap::Args;
use toolfleet_config::ConfigArgs;
use toolfleet_llm::args::LlmArgs;
use toolfleet_service::args::{self, NatsArgs};
use toolfleet_store::{CitationStore, RedisOptions};

pub use server::{GatewayConfig, start};

/// Where the gateway listens.
pub const ENV_LISTEN: &str = "TOOLFLEET_GATEWAY_LISTEN";
pub const DEFAULT_LISTEN: &str = "127.0.0.1:8080";
pub const ENV_TIMEOUT_SECS: &str = "TOOLFLEET_GATEWAY_TIMEOUT_SECS";
pub const DEFAULT_TIMEOUT_SECS: u64 = 300;
pub const ENV_MAX_BODY_BYTES: &str = "TOOLFLEET_GATEWAY_MAX_BODY_BYTES";
/// Its `/metrics`, `/livez` and `/readyz`: the port after the workers'.
pub const DEFAULT_METRICS_ADDR: &str = "0.0.0.0:9470";

#[derive(Args, Debug)]
pub struct GatewayArgs {
    /// The address the OpenAI-compatible API listens on.
    #[arg(long, env = ENV_LISTEN, default_value = DEFAULT_LISTEN)]
    pub listen: SocketAddr,
    /// How long a request may take, in seconds (also its job's deadline);
    /// past it a request is answered 504 and its job cancelled.
    #[arg(long, env = ENV_TIMEOUT_SECS, default_value_t = DEFAULT_TIMEOUT_SECS,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub timeout_secs: u64,
    /// The largest request body taken, in bytes (larger: 413).
    #[arg(long, env = ENV_MAX_BODY_BYTES, default_value_t = toolfleet_protocol::MAX_JOB_BYTES)]
    pub max_body_bytes: usize,
    /// Prometheus metrics and health endpoint.
    #[arg(long, env = args::ENV_METRICS_ADDR, default_value = DEFAULT_METRICS_ADDR)]
    pub metrics_addr: SocketAddr,
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub redis: RedisOptions,
    /// The profiles file (`--config`): the models the gateway offers.
    #[command(flatten)]
    pub llm: LlmArgs,
}

/// `toolfleet gateway`: serves until a signal; exit 64 on a bad
/// configuration.
pub async fn run(a: GatewayArgs) -> anyhow::Result<i32> {
    let subjects = args::or_exit(a.nats.subjects().map_err(Into::into));
    args::or_exit(a.nats.check_url().map_err(Into::into));
    args::or_exit(a.redis.check_url().map_err(Into::into));
    let profiles = args::or_exit(a.llm.fleet_config().map_err(Into::into));
    let mut config = GatewayConfig::new(subjects, profiles);
    config.timeout = Duration::from_secs(a.timeout_secs);
    config.max_body_bytes = a.max_body_bytes;
    toolfleet_service::serve_until_signal(a.metrics_addr, |rt| async move {
        let (client, store) = connect(&a.nats, &a.redis, &config).await?;
        let ping =
            toolfleet_service::health::ping(store.clone(), |s| async move { s.ping().await });
        rt.watch_connections(&client, Some(ping))?;
        serve_on(&rt, a.listen, client, store, config).await
    })
    .await?;
    Ok(0)
}

/// The gateway's connections: NATS (as `toolfleet-gateway`) and the store.
///
/// # Errors
///
/// Either cannot be reached within its wait.
pub async fn connect(
    nats: &NatsArgs,
    redis: &RedisOptions,
    config: &GatewayConfig,
) -> anyhow::Result<(async_nats::Client, CitationStore)> {
    let store = CitationStore::connect_with(redis, config.subjects.prefix(), redis.ttl)
        .await
        .with_context(|| format!("cannot connect to Redis at {}", redis.redacted_url()))?;
    let client = nats.connect("toolfleet-gateway").await?;
    Ok((client, store))
}

/// Binds `listen` and serves the gateway on `rt` (`toolfleet gateway`,
/// `toolfleet up --gateway`).
///
/// # Errors
///
/// The address cannot be bound, or a metric is registered already.
pub async fn serve_on(
    rt: &toolfleet_service::Runtime,
    listen: SocketAddr,
    client: async_nats::Client,
    store: CitationStore,
    config: GatewayConfig,
) -> anyhow::Result<()> {
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding the gateway's {listen}"))?;
    start(
        listener,
        client,
        store,
        config,
        &rt.metrics,
        &rt.tracker,
        rt.shutdown.clone(),
    )
    .await?;
    Ok(())
}
