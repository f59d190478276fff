//! `toolfleet-worker-system`: serves system:* tools (current date and time).
//! Start more copies to scale the pool: they share one durable consumer per
//! tool. Configured by flags and `TOOLFLEET_*` environment variables.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Parser;
use tokio_util::{sync::CancellationToken, task::TaskTracker};
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
    let args = Args::try_parse().unwrap_or_else(|e| {
        let _ = e.print();
        std::process::exit(if e.use_stderr() {
            config::EXIT_CONFIG
        } else {
            0
        })
    });
    config::init_tracing();
    let spec = FleetSpec {
        nats_url: args.nats.url.clone(),
        redis_url: args.redis.url.clone(),
        subjects: args.nats.subjects()?,
        citation_ttl: Duration::from_secs(args.redis.ttl_secs),
        registry: toolfleet::fleet::load_registry(&args.defs.dir)?,
        orchestrator: None,
        workers: vec![WorkerKind::System],
        worker_concurrency: args.concurrency,
        index: None,
    };
    let (shutdown, tracker, metrics) = (
        CancellationToken::new(),
        TaskTracker::new(),
        prometheus::Registry::new(),
    );
    toolfleet::metrics::spawn(args.metrics_addr, metrics.clone(), shutdown.clone()).await?;
    toolfleet::fleet::start(spec, &metrics, &tracker, shutdown.clone()).await?;
    config::shutdown_signal().await;
    shutdown.cancel();
    tracker.close();
    let _ = tokio::time::timeout(Duration::from_secs(30), tracker.wait()).await;
    Ok(())
}
