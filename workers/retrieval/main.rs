//! `toolfleet-worker-retrieval`: serves retrieval:* tools over the document index.
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
    about = "toolfleet worker: serves retrieval:* tools over the document index."
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
    /// Where the index lives (built from --corpus-dir at start when missing).
    #[arg(
        long,
        env = "TOOLFLEET_INDEX_DIR",
        default_value = "target/toolfleet-index"
    )]
    index_dir: std::path::PathBuf,
    /// The corpus of Markdown files to index when the index is missing.
    #[arg(long, env = "TOOLFLEET_CORPUS_DIR", default_value = "examples/corpus")]
    corpus_dir: std::path::PathBuf,
    /// Prometheus metrics and health endpoint.
    #[arg(long, env = config::ENV_METRICS_ADDR, default_value = "0.0.0.0:9466")]
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
        workers: vec![WorkerKind::Retrieval],
        worker_concurrency: args.concurrency,
        index: Some(toolfleet::fleet::IndexPaths {
            index_dir: args.index_dir.clone(),
            corpus_dir: args.corpus_dir.clone(),
        }),
    };
    toolfleet::fleet::serve_until_signal(spec, args.metrics_addr).await
}
