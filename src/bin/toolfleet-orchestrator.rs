//! `toolfleet-orchestrator`: takes chat jobs and runs the agentic loop.
//! Configured by flags and `TOOLFLEET_*` environment variables (`--help`).

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use toolfleet::config::{self, LlmArgs, NatsArgs, RedisArgs, ToolDefsArgs};
use toolfleet::fleet::FleetSpec;
use toolfleet::orchestrator::OrchestratorConfig;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "toolfleet orchestrator: takes chat jobs from JetStream and runs the agentic loop."
)]
struct Args {
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    redis: RedisArgs,
    #[command(flatten)]
    defs: ToolDefsArgs,
    #[command(flatten)]
    llm: LlmArgs,
    /// Chat jobs in flight at once.
    #[arg(long, env = "TOOLFLEET_MAX_IN_FLIGHT", default_value_t = 32)]
    max_in_flight: usize,
    /// Prometheus metrics and health endpoint.
    #[arg(long, env = config::ENV_METRICS_ADDR, default_value = "0.0.0.0:9464")]
    metrics_addr: SocketAddr,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Args = config::parse_or_exit();
    config::init_tracing();
    let subjects = config::or_exit(args.nats.subjects().map_err(Into::into));
    let profiles = config::or_exit(args.llm.fleet_config());
    let mut orchestrator = OrchestratorConfig::new(subjects.clone(), profiles);
    orchestrator.max_in_flight = args.max_in_flight;
    let spec = FleetSpec {
        nats_url: args.nats.url.clone(),
        redis_url: args.redis.url.clone(),
        subjects,
        citation_ttl: Duration::from_secs(args.redis.ttl_secs),
        registry: config::or_exit(toolfleet::fleet::load_registry(&args.defs.dir)),
        orchestrator: Some(orchestrator),
        workers: Vec::new(),
        worker_concurrency: 0,
        index: None,
    };
    toolfleet::fleet::serve_until_signal(spec, args.metrics_addr).await
}
