//! The commands that serve until a signal, and so log instead of printing
//! progress: `toolfleet up` (the orchestrator and every worker in one
//! process), the hidden `toolfleet bench-worker` (the worker process of
//! `toolfleet bench --processes`) and `toolfleet scripted-model`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;
use toolfleet_config::ConfigArgs;

use anyhow::Context;
use clap::Args;

use toolfleet_llm::args::LlmArgs;
use toolfleet_local::fleet::FleetSpec;
use toolfleet_orchestrator::OrchestratorConfig;
use toolfleet_worker::{Worker, WorkerArgs};

use crate::families::IndexArgs;

#[derive(Args, Debug)]
pub struct UpArgs {
    /// NATS, Redis, definitions and concurrency, as every worker has them.
    #[command(flatten)]
    pub worker: toolfleet_worker::WorkerArgs,
    #[command(flatten)]
    pub llm: LlmArgs,
    #[command(flatten)]
    pub index: IndexArgs,
    #[command(flatten)]
    pub sinks: toolfleet_orchestrator::sinks::SinkArgs,
    /// Chat jobs in flight at once.
    #[arg(long, env = "TOOLFLEET_MAX_IN_FLIGHT", default_value_t = 32)]
    pub max_in_flight: usize,
    /// Prometheus metrics and health endpoint.
    #[arg(long, env = toolfleet_service::args::ENV_METRICS_ADDR, default_value = "127.0.0.1:9464")]
    pub metrics_addr: SocketAddr,
    /// Also serve the OpenAI-compatible gateway (`toolfleet gateway`) on
    /// `--gateway-listen`, its metrics beside the fleet's.
    #[arg(long)]
    pub gateway: bool,
    /// Where `--gateway` listens.
    #[arg(long, env = crate::gateway::ENV_LISTEN, default_value = crate::gateway::DEFAULT_LISTEN)]
    pub gateway_listen: SocketAddr,
    /// The web tools' settings (TOML, a table per tool, as the web
    /// worker's `--settings`); without it every setting has its default.
    #[arg(long, env = "TOOLFLEET_TOOL_SETTINGS", value_name = "FILE")]
    pub tool_settings: Option<PathBuf>,
    /// Start no web worker (its tools reach the internet).
    #[arg(long)]
    pub no_web: bool,
}

#[derive(Args, Debug)]
pub struct BenchWorkerArgs {
    #[command(flatten)]
    pub worker: toolfleet_worker::WorkerArgs,
    #[command(flatten)]
    pub index: IndexArgs,
    /// Prometheus metrics and health endpoint.
    #[arg(long, env = toolfleet_service::args::ENV_METRICS_ADDR, default_value = "127.0.0.1:0")]
    pub metrics_addr: SocketAddr,
}

#[derive(Args, Debug)]
pub struct ScriptedModelArgs {
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub listen: SocketAddr,
    /// The script file (see `examples/demo-script.json`).
    #[arg(long)]
    pub script: PathBuf,
    /// Pause before every response's first token, in ms (a slow model;
    /// replaces the script's `firstTokenDelayMs`).
    #[arg(long)]
    pub first_token_delay_ms: Option<u64>,
    /// Pause before each streamed chunk, in ms (replaces the script's
    /// `chunkDelayMs`).
    #[arg(long)]
    pub chunk_delay_ms: Option<u64>,
}

/// `toolfleet up`: exits 64 on a bad configuration (a sink the policy
/// refuses included, as the orchestrator's binary does).
pub async fn up(args: UpArgs) -> anyhow::Result<i32> {
    let subjects =
        toolfleet_service::args::or_exit(args.worker.nats.subjects().map_err(Into::into));
    let models = toolfleet_service::args::or_exit(args.llm.fleet_config().map_err(Into::into));
    // A configured sink the policy refuses stops the start (exit 64), as
    // the orchestrator's binary does.
    let sinks = args.sinks.settings();
    if let Err(e) = sinks.check_config(
        &subjects,
        &models.sinks,
        &toolfleet_llm::deployments::ProcessEnv,
    ) {
        eprintln!("toolfleet up: {e}");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    let mut workers = toolfleet_service::args::or_exit(
        crate::families::all(&crate::families::Inputs {
            definitions: &args.worker.defs.dir,
            index: &args.index,
            models: Some(&models),
        })
        .await,
    );
    if !args.no_web {
        workers.push(toolfleet_service::args::or_exit(crate::families::web(
            &args.worker.defs.dir,
            args.tool_settings.as_deref(),
        )));
    }
    let gateway = args.gateway.then(|| {
        let config = crate::gateway::GatewayConfig::new(subjects.clone(), models.clone());
        (args.gateway_listen, config)
    });
    let mut orchestrator = OrchestratorConfig::new(subjects.clone(), models);
    orchestrator.max_in_flight = args.max_in_flight;
    orchestrator.sinks = sinks;
    let spec = fleet_spec(&args.worker, subjects, Some(orchestrator), workers);
    match gateway {
        Some(gateway) => serve_with_gateway(spec, &args.worker, gateway, args.metrics_addr).await,
        None => serve(spec, args.metrics_addr).await,
    }
}

/// [`serve`], and the gateway on the same runtime once the fleet takes
/// jobs (`toolfleet up --gateway`).
async fn serve_with_gateway(
    spec: FleetSpec,
    worker: &WorkerArgs,
    (listen, config): (SocketAddr, crate::gateway::GatewayConfig),
    metrics_addr: SocketAddr,
) -> anyhow::Result<i32> {
    toolfleet_service::serve_until_signal(metrics_addr, |rt| async move {
        toolfleet_local::fleet::serve(spec, &rt).await?;
        let (client, store) = crate::gateway::connect(&worker.nats, &worker.redis, &config).await?;
        rt.health.nats(&client);
        crate::gateway::serve_on(&rt, listen, client, store, config).await
    })
    .await?;
    Ok(0)
}

/// `toolfleet bench-worker`: every family this command ships plus the
/// bench's own tool ([`crate::bench_fleet::bench_workers`]).
pub async fn bench_worker(args: BenchWorkerArgs) -> anyhow::Result<i32> {
    let subjects =
        toolfleet_service::args::or_exit(args.worker.nats.subjects().map_err(Into::into));
    let workers = toolfleet_service::args::or_exit(
        crate::bench_fleet::bench_workers(&args.worker.defs.dir, &args.index).await,
    );
    let spec = fleet_spec(&args.worker, subjects, None, workers);
    serve(spec, args.metrics_addr).await
}

/// `toolfleet scripted-model`: the stand-in model until a signal.
pub async fn scripted_model(args: ScriptedModelArgs) -> anyhow::Result<i32> {
    toolfleet_service::serve::raise_fd_limit();
    let mut script = toolfleet_scripted::Script::load(&args.script)?;
    if let Some(ms) = args.first_token_delay_ms {
        script = script.with_first_token_delay(Duration::from_millis(ms));
    }
    if let Some(ms) = args.chunk_delay_ms {
        script = script.with_chunk_delay(Duration::from_millis(ms));
    }
    let listen = args.listen;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    toolfleet_scripted::serve(listener, script, toolfleet_service::args::shutdown_signal()).await?;
    Ok(0)
}

/// The fleet a serving command runs, on the servers and with the
/// concurrency of its worker flags; the streams it creates get the flags'
/// `--stream-replicas` (as the separate binaries' do).
fn fleet_spec(
    worker: &WorkerArgs,
    subjects: toolfleet_protocol::Subjects,
    orchestrator: Option<OrchestratorConfig>,
    workers: Vec<Worker>,
) -> FleetSpec {
    toolfleet_protocol::streams::set_default_replicas(worker.nats.stream_replicas);
    // NATS_URL or the nats CLI's context when no --nats-url is given, as
    // for the separate binaries.
    let nats = toolfleet_service::args::or_exit(
        worker
            .nats
            .with_fallbacks(&toolfleet_service::nats_context::ProcessVars)
            .map_err(Into::into),
    );
    FleetSpec {
        nats_url: nats.url().to_owned(),
        redis_url: worker.redis.url.clone(),
        subjects,
        citation_ttl: worker.redis.ttl,
        orchestrator,
        workers,
        worker_concurrency: worker.concurrency,
        nats_connect_wait: Duration::from_secs(worker.nats.connect_wait_secs),
        // Every flag counts: identity, TLS, inbox prefix, Redis TLS and
        // cluster, as for the separate binaries.
        nats: Some(nats.clone()),
        redis: Some(worker.redis.clone()),
    }
}

/// Serves `spec` with `/metrics` and health on `metrics_addr` until a
/// signal; exit 0 once drained.
async fn serve(spec: FleetSpec, metrics_addr: SocketAddr) -> anyhow::Result<i32> {
    toolfleet_service::serve_until_signal(metrics_addr, |rt| async move {
        toolfleet_local::fleet::serve(spec, &rt).await
    })
    .await?;
    Ok(0)
}
