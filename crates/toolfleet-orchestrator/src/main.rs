//! `toolfleet-orchestrator`: takes chat jobs and runs the agentic loop.
//! Configured by flags and `TOOLFLEET_*` environment variables (`--help`).
//! The tools it offers are those the fleet's live workers advertise; it
//! reads tool definition files only for the pools its profiles file
//! declares (`[pools.<name>] declared = true`: scale from zero).

use std::net::SocketAddr;

use clap::Parser;
use toolfleet_config::ConfigArgs;
use toolfleet_llm::args::LlmArgs;
use toolfleet_orchestrator::OrchestratorConfig;
use toolfleet_service::args::{self, NatsArgs};
use toolfleet_store::RedisOptions;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "toolfleet orchestrator: takes chat jobs from JetStream and runs the agentic loop."
)]
struct Args {
    #[command(flatten)]
    nats: NatsArgs,
    #[command(flatten)]
    redis: RedisOptions,
    #[command(flatten)]
    llm: LlmArgs,
    #[command(flatten)]
    telemetry: toolfleet_service::telemetry::TelemetryArgs,
    #[command(flatten)]
    sinks: toolfleet_orchestrator::sinks::SinkArgs,
    #[command(flatten)]
    threads: toolfleet_orchestrator::threads::store::ThreadArgs,
    /// Chat jobs in flight at once.
    #[arg(long, env = "TOOLFLEET_MAX_IN_FLIGHT", default_value_t = 32)]
    max_in_flight: usize,
    /// The longest batch chat jobs wait while interactive ones keep
    /// coming, in seconds: past it a batch job is taken next (per
    /// orchestrator), so batch never starves.
    #[arg(long, env = "TOOLFLEET_BATCH_MAX_WAIT_SECS", default_value_t = 30, value_parser = clap::value_parser!(u64).range(1..=86_400))]
    batch_max_wait_secs: u64,
    /// How chat jobs are taken: `fair` (per-tenant turns, interactive
    /// before batch) or `fifo` (one queue in arrival order: no fairness;
    /// the chat stream may not hold fair dispatch's consumers).
    #[arg(long, env = "TOOLFLEET_CHAT_DISPATCH", value_enum, default_value_t = toolfleet_orchestrator::settings::ChatDispatch::Fair)]
    chat_dispatch: toolfleet_orchestrator::settings::ChatDispatch,
    /// How far ahead a chat job's `notBefore` may be, in seconds (at most
    /// 82800, 23 h: the chat stream deletes a job a day after its
    /// submission; each job's limit is also less its timeout): a job
    /// asking to start later is refused (`malformed_job`).
    #[arg(long, env = "TOOLFLEET_MAX_NOT_BEFORE_SECS", default_value_t = toolfleet_orchestrator::settings::DEFAULT_MAX_NOT_BEFORE.as_secs(), value_parser = clap::value_parser!(u64).range(1..=toolfleet_orchestrator::settings::MAX_NOT_BEFORE_CEILING.as_secs()))]
    max_not_before_secs: u64,
    /// A tenant's chat jobs waiting for their `notBefore` at once (1 to
    /// 5000; each stays pending on a chat consumer whose max_ack_pending
    /// is 10000): more are refused (`queue_full`).
    #[arg(long, env = "TOOLFLEET_MAX_DELAYED_JOBS", default_value_t = toolfleet_orchestrator::settings::DEFAULT_MAX_DELAYED_JOBS, value_parser = clap::value_parser!(u64).range(1..=5000))]
    max_delayed_jobs: u64,
    /// Recommended models per tool (JSON: `{"tools": {"<tool id or
    /// ns:name>": ["<deployment>/<model>", ...]}}`, cheapest first). A file
    /// that cannot be read or parsed stops the start (exit 64); models no
    /// deployment serves and tools the fleet does not serve are logged and
    /// skipped.
    #[arg(long, env = "TOOLFLEET_TOOL_COMPAT", value_name = "FILE")]
    tool_compat: Option<std::path::PathBuf>,
    /// Directory of tool definition files, read only when the profiles
    /// file declares a pool (`[pools.<name>] declared = true`): the
    /// definitions of its tools, offered while none of its workers is
    /// live. Give the directory its workers serve.
    #[arg(long, env = args::ENV_TOOL_DEFINITIONS, default_value = args::DEFAULT_TOOL_DEFINITIONS, value_name = "DIR")]
    tool_definitions: std::path::PathBuf,
    /// Prometheus metrics and health endpoint.
    #[arg(long, env = args::ENV_METRICS_ADDR, default_value = "0.0.0.0:9464")]
    metrics_addr: SocketAddr,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let a: Args = args::parse_or_exit(toolfleet_service::build_info!());
    let telemetry =
        toolfleet_service::telemetry::init("toolfleet-orchestrator", "info", &a.telemetry);
    let subjects = args::or_exit(a.nats.subjects().map_err(Into::into));
    args::or_exit(a.nats.check_url().map_err(Into::into));
    args::or_exit(a.redis.check_url().map_err(Into::into));
    let profiles = args::or_exit(a.llm.fleet_config().map_err(Into::into));
    // A declared pool's tools from the definition files (exit 64 on an
    // unknown pool or a definition that will not load).
    let declared = args::or_exit(
        toolfleet_orchestrator::tools::declared::DeclaredPools::load(
            &profiles,
            &a.tool_definitions,
        )
        .map_err(anyhow::Error::msg),
    );
    let mut config = OrchestratorConfig::new(subjects, profiles);
    config.declared = declared;
    config.max_in_flight = a.max_in_flight;
    config.batch_max_wait = std::time::Duration::from_secs(a.batch_max_wait_secs);
    config.chat_dispatch = a.chat_dispatch;
    config.max_not_before = std::time::Duration::from_secs(a.max_not_before_secs);
    config.max_delayed_jobs = a.max_delayed_jobs;
    config.sinks = a.sinks.settings();
    config.threads = a.threads.settings();
    // A configured sink the policy refuses stops the start (exit 64).
    args::or_exit(
        (config.sinks)
            .check_config(&config.subjects, &config.profiles.sinks, &*config.env)
            .map_err(anyhow::Error::msg),
    );
    if let Some(path) = &a.tool_compat {
        let compat = args::or_exit(
            toolfleet_protocol::registry::CompatFile::load(path).map_err(anyhow::Error::from),
        );
        config.compat = Some(std::sync::Arc::new(compat));
    }
    let served = toolfleet_service::serve_until_signal(a.metrics_addr, |rt| {
        toolfleet_orchestrator::start(&a.nats, &a.redis, config, rt)
    })
    .await;
    telemetry.shutdown().await;
    served
}
