//! A fleet on this machine, as `toolfleet demo` and `toolfleet bench`
//! bring one up: where it gets its servers, corpus and tools
//! ([`LocalArgs`]) and its NATS and Redis servers ([`LocalServers`]: the
//! configured ones when reachable, otherwise child processes).

use std::path::PathBuf;

use clap::Args;
use toolfleet_service::args::ToolDefsArgs;

/// Where a local fleet gets its servers, corpus and tools.
#[derive(Args, Debug)]
pub struct LocalArgs {
    /// The example corpus to index.
    #[arg(long, default_value = "examples/corpus")]
    pub corpus: PathBuf,
    #[command(flatten)]
    pub defs: ToolDefsArgs,
    /// Use this NATS server instead of a child process (when reachable).
    #[arg(long, env = toolfleet_service::args::ENV_NATS_URL, default_value = toolfleet_service::args::DEFAULT_NATS_URL, hide_env_values = true)]
    pub nats_url: String,
    /// Use this Redis server instead of a child process (when reachable).
    #[arg(long, env = toolfleet_store::connection::ENV_REDIS_URL, default_value = toolfleet_store::connection::DEFAULT_REDIS_URL, hide_env_values = true)]
    pub redis_url: String,
    /// Always start private nats-server and redis-server child processes.
    #[arg(long)]
    pub isolated: bool,
}

/// NATS and Redis for a local fleet: the configured ones when reachable,
/// otherwise child processes (killed when dropped).
pub(crate) struct LocalServers {
    pub(crate) nats_url: String,
    pub(crate) redis_url: String,
    _nats: Option<toolfleet_local::servers::NatsServer>,
    _redis: Option<toolfleet_local::servers::RedisServer>,
}

impl LocalServers {
    /// Reuses or starts the servers, saying which on stderr.
    pub(crate) fn start(args: &LocalArgs) -> anyhow::Result<Self> {
        let (nats_url, nats) =
            if !args.isolated && toolfleet_local::servers::nats_reachable(&args.nats_url) {
                eprintln!(
                    "• using the NATS server at {}",
                    toolfleet_protocol::redact_url(&args.nats_url)
                );
                (args.nats_url.clone(), None)
            } else {
                eprint!("• starting nats-server -js … ");
                let s = toolfleet_local::servers::NatsServer::start()?;
                eprintln!("on {}", s.url());
                (s.url(), Some(s))
            };
        let (redis_url, redis) =
            if !args.isolated && toolfleet_local::servers::redis_reachable(&args.redis_url) {
                eprintln!(
                    "• using the Redis server at {}",
                    toolfleet_protocol::redact_url(&args.redis_url)
                );
                (args.redis_url.clone(), None)
            } else {
                eprint!("• starting redis-server … ");
                let s = toolfleet_local::servers::RedisServer::start()?;
                eprintln!("on {}", s.url());
                (s.url(), Some(s))
            };
        Ok(Self {
            nats_url,
            redis_url,
            _nats: nats,
            _redis: redis,
        })
    }
}
