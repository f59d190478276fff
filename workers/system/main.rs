//! `toolfleet-worker-system`: serves system:* tools (current date and time).
//! Start more copies to scale the pool: they share one durable consumer per
//! tool. Configured by flags and `TOOLFLEET_*` environment variables.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use toolfleet::config::{self, NatsArgs, RedisArgs, ToolDefsArgs};
use toolfleet::fleet::{FleetSpec, WorkerKind};

#[derive(Parser, Debug)]
#[command(
    version,
    about = "toolfleet worker: serves system:* tools (current date and time)."
)]
struct Args {
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    redis: RedisArgs,
    #[command(flatten)]
    defs: ToolDefsArgs,
    /// Tool jobs executed at once by this process.
    #[arg(long, env = "TOOLFLEET_CONCURRENCY", default_value_t = 16)]
    concurrency: usize,
    /// Prometheus metrics and health endpoint.
    #[arg(long, env = config::ENV_METRICS_ADDR, default_value = "0.0.0.0:9465")]
    metrics_addr: SocketAddr,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args: Args = config::parse_or_exit();
    config::init_tracing();
    let spec = FleetSpec {
        nats_url: args.nats.url.clone(),
        redis_url: args.redis.url.clone(),
        subjects: config::or_exit(args.nats.subjects().map_err(Into::into)),
        citation_ttl: Duration::from_secs(args.redis.ttl_secs),
        registry: config::or_exit(toolfleet::fleet::load_registry(&args.defs.dir)),
        orchestrator: None,
        workers: vec![WorkerKind::System],
        worker_concurrency: args.concurrency,
        index: None,
    };
    toolfleet::fleet::serve_until_signal(spec, args.metrics_addr).await
}
