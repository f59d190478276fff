//! A worker binary's whole life: connect, serve its tools until a signal,
//! drain. Family binaries parse [`WorkerArgs`] and call [`Worker::serve`].

use std::net::SocketAddr;

use anyhow::Context;
use clap::{Args, FromArgMatches};
use toolfleet_service::args::{NatsArgs, ToolDefsArgs};
use toolfleet_store::{CitationStore, RedisOptions};

use crate::metrics::WorkerMetrics;
use crate::{Worker, WorkerConfig};

/// The command-line and environment settings every worker binary shares.
#[derive(Args, Debug, Clone)]
pub struct WorkerArgs {
    /// The NATS connection and the fleet's subject prefix.
    #[command(flatten)]
    pub nats: NatsArgs,
    /// The citation store and result ledger.
    #[command(flatten)]
    pub redis: RedisOptions,
    /// Where the tool definitions are.
    #[command(flatten)]
    pub defs: ToolDefsArgs,
    /// Tool jobs executed at once by this process.
    #[arg(long, env = "TOOLFLEET_CONCURRENCY", default_value_t = 16)]
    pub concurrency: usize,
}

impl Worker {
    /// Serves this worker's tools as a process until SIGINT or SIGTERM,
    /// with `/metrics` on `metrics_addr`, then drains within the grace
    /// period.
    ///
    /// # Errors
    ///
    /// A bad prefix, an unreachable NATS or Redis, or a worker that cannot
    /// set up its consumers and endpoints.
    pub async fn serve(
        mut self,
        args: &WorkerArgs,
        metrics_addr: SocketAddr,
    ) -> anyhow::Result<()> {
        let subjects = args.nats.subjects()?;
        toolfleet_service::serve_until_signal(metrics_addr, |rt| async move {
            let r = &args.redis;
            let store = CitationStore::connect_with(r, subjects.prefix(), r.ttl)
                .await
                .with_context(|| format!("cannot connect to Redis at {}", r.redacted_url()))?;
            let client = args
                .nats
                .connect(&format!("toolfleet-worker-{}", self.name()))
                .await?;
            let ping =
                toolfleet_service::health::ping(store.clone(), |s| async move { s.ping().await });
            rt.watch_connections(&client, Some(ping))?;
            rt.health
                .check("consumers", self.consumer_check(&client, &subjects));
            for (name, check) in self.readiness.drain(..) {
                rt.health.check(name, move || check());
            }
            let metrics = WorkerMetrics::register_all(&rt.metrics)?;
            self.register_metrics(&rt.metrics)?;
            let mut config = WorkerConfig::new(subjects);
            config.concurrency = args.concurrency;
            let reload = self.reload.take();
            let serving = rt.shutdown.child_token();
            let task = self
                .start(
                    client.clone(),
                    store.clone(),
                    config.clone(),
                    metrics.clone(),
                    serving.clone(),
                )
                .await
                .context("the worker cannot start")?;
            // Draining waits for the worker's jobs in flight.
            let parts = Parts {
                client,
                store,
                config,
                metrics,
            };
            rt.tracker.spawn(supervise(
                (task, serving),
                reload,
                parts,
                rt.shutdown.clone(),
            ));
            Ok(())
        })
        .await
    }
}

/// What every tool set a process serves shares.
struct Parts {
    client: async_nats::Client,
    store: CitationStore,
    config: WorkerConfig,
    metrics: WorkerMetrics,
}

type Serving = (
    tokio::task::JoinHandle<Result<(), crate::WorkerError>>,
    tokio_util::sync::CancellationToken,
);

/// Waits for the served worker to finish (after `shutdown`); with a
/// [`crate::builder::Reload`], swaps in each rebuilt tool set: the next
/// starts beside the current, then the current drains.
async fn supervise(
    mut current: Serving,
    reload: Option<crate::builder::Reload>,
    parts: Parts,
    shutdown: tokio_util::sync::CancellationToken,
) {
    let finished = |r: Result<Result<(), crate::WorkerError>, tokio::task::JoinError>| match r {
        Ok(Ok(())) => {}
        Ok(Err(e)) => tracing::error!(error = %e, "worker stopped"),
        Err(e) => tracing::error!(error = %e, "worker task failed"),
    };
    let Some(reload) = reload else {
        finished(current.0.await);
        return;
    };
    loop {
        tokio::select! {
            () = shutdown.cancelled() => break,
            () = reload.when.notified() => {}
        }
        let next = match (reload.rebuild)().await {
            Ok(next) => next,
            Err(e) => {
                tracing::warn!(error = %e, "the tool set cannot be rebuilt; the current one serves on");
                continue;
            }
        };
        let tools: Vec<String> = next.definitions().map(|d| d.id.to_string()).collect();
        let token = shutdown.child_token();
        match next
            .start(
                parts.client.clone(),
                parts.store.clone(),
                parts.config.clone(),
                parts.metrics.clone(),
                token.clone(),
            )
            .await
        {
            Ok(task) => {
                let (old, old_token) = std::mem::replace(&mut current, (task, token));
                old_token.cancel();
                finished(old.await);
                tracing::info!(tools = ?tools, "the tool set was reloaded");
            }
            Err(e) => {
                tracing::warn!(error = %e, "the rebuilt tool set cannot start; the current one serves on");
            }
        }
    }
    finished(current.0.await);
}

/// A file holding the Redis URL (with its password): when set, the URL is
/// read from it, so the password never sits in the worker's environment.
pub const ENV_REDIS_URL_FILE: &str = "TOOLFLEET_REDIS_URL_FILE";

/// `redis.url` from the file [`ENV_REDIS_URL_FILE`] names, when it names
/// one.
fn redis_url_from_file(redis: &mut RedisOptions) -> Result<(), String> {
    let Some(path) = std::env::var_os(ENV_REDIS_URL_FILE) else {
        return Ok(());
    };
    let path = std::path::PathBuf::from(path);
    let url = std::fs::read_to_string(&path)
        .map_err(|e| format!("{ENV_REDIS_URL_FILE}: cannot read {}: {e}", path.display()))?;
    redis.url = url.trim().to_string();
    Ok(())
}

/// A worker binary's settings: the shared [`WorkerArgs`], the binary's
/// own (`A`), and where to serve metrics.
#[derive(clap::Parser, Debug)]
struct StandaloneArgs<A: Args> {
    #[command(flatten)]
    worker: WorkerArgs,
    #[command(flatten)]
    own: A,
    #[command(flatten)]
    telemetry: toolfleet_service::telemetry::TelemetryArgs,
    /// Prometheus metrics and health endpoint.
    #[arg(long, env = toolfleet_service::args::ENV_METRICS_ADDR)]
    metrics_addr: Option<SocketAddr>,
    /// Prints this worker's NATS role (the permissions block for
    /// `ops/nats/auth.conf`, written from the tools it serves) and exits
    /// without connecting to NATS or Redis.
    #[arg(long)]
    print_nats_role: bool,
}

/// For a worker binary with no settings of its own.
#[derive(Args, Debug, Clone, Copy, Default)]
pub struct NoArgs {}

/// The whole `main` of the worker binary `binary` (its name in `--help`
/// and `--version`, which prints `version`: pass
/// `toolfleet_worker::build_info!()`): parses the shared settings and the
/// binary's own `A` (flags and `TOOLFLEET_*` environment variables;
/// `--help` lists them), builds the worker with the async `build` (it may connect to a store first), serves it until
/// SIGTERM and drains. A bad setting or a worker that cannot be built exits
/// with code 64 (EX_USAGE), anything else that stops it with 1.
///
/// ```no_run
/// # struct Convert;
/// # impl toolfleet_worker::Tool for Convert {
/// #     type Args = serde_json::Value;
/// #     async fn call(&self, _: &toolfleet_worker::ToolCtx, _: serde_json::Value)
/// #         -> Result<toolfleet_worker::ToolOutput, toolfleet_worker::ToolError> { todo!() }
/// # }
/// use toolfleet_worker::process::NoArgs;
///
/// #[tokio::main]
/// async fn main() -> std::process::ExitCode {
///     toolfleet_worker::process::main("units-worker", toolfleet_worker::build_info!(), "toolfleet worker: converts units.", "0.0.0.0:9470", async |args, _: &NoArgs| {
///         toolfleet_worker::Worker::builder("units")
///             .definitions_dir(&args.defs.dir)
///             .tool("units.convert", Convert)
///             .build()
///     })
///     .await
/// }
/// ```
pub async fn main<A, E>(
    binary: &'static str,
    version: toolfleet_service::build::BuildInfo,
    about: &'static str,
    default_metrics_addr: &str,
    build: impl AsyncFnOnce(&WorkerArgs, &A) -> Result<Worker, E>,
) -> std::process::ExitCode
where
    A: Args + FromArgMatches,
    E: std::fmt::Display,
{
    let names = (binary, about, default_metrics_addr);
    main_with(names, version, Flags::default(), build).await
}

/// What a worker binary's command line offers beyond the flags every
/// worker has.
#[derive(Debug, Clone, Copy)]
pub struct Flags {
    /// Its tools come from definition files (`--tool-definitions`). A
    /// worker whose tools come from elsewhere (the MCP worker: from its
    /// servers) hides the flag and refuses it on the command line (the
    /// variable, which a deployment may set for every worker, is ignored).
    pub tool_definitions: bool,
}

impl Default for Flags {
    fn default() -> Self {
        Self {
            tool_definitions: true,
        }
    }
}

/// [`main`] with `flags`; `names` are the binary's name, its one-line
/// description and its default metrics address.
pub async fn main_with<A, E>(
    (binary, about, default_metrics_addr): (&'static str, &'static str, &str),
    version: toolfleet_service::build::BuildInfo,
    flags: Flags,
    build: impl AsyncFnOnce(&WorkerArgs, &A) -> Result<Worker, E>,
) -> std::process::ExitCode
where
    A: Args + FromArgMatches,
    E: std::fmt::Display,
{
    let usage = |message: &dyn std::fmt::Display| {
        eprintln!("configuration error: {message}");
        std::process::ExitCode::from(toolfleet_service::args::EXIT_CONFIG as u8)
    };
    let mut command = toolfleet_service::args::command_of::<StandaloneArgs<A>>(version)
        .name(binary)
        .about(about);
    if !flags.tool_definitions {
        command = command.mut_arg("dir", |a| a.hide(true));
    }
    let args = match command.try_get_matches().and_then(|m| {
        if !flags.tool_definitions
            && m.value_source("dir") == Some(clap::parser::ValueSource::CommandLine)
        {
            return Err(clap::Error::raw(
                clap::error::ErrorKind::UnknownArgument,
                "this worker takes no --tool-definitions: its tools do not come from definition files\n",
            ));
        }
        StandaloneArgs::<A>::from_arg_matches(&m)
    }) {
        Ok(a) => a,
        Err(e) => {
            let _ = e.print();
            return if e.use_stderr() {
                std::process::ExitCode::from(toolfleet_service::args::EXIT_CONFIG as u8)
            } else {
                std::process::ExitCode::SUCCESS
            };
        }
    };
    let telemetry = toolfleet_service::telemetry::init(binary, "info", &args.telemetry);
    let mut args = args;
    if let Err(e) = redis_url_from_file(&mut args.worker.redis) {
        return usage(&e);
    }
    if let Err(e) = args.worker.nats.subjects() {
        return usage(&e);
    }
    if let Err(e) = args.worker.nats.check_url() {
        return usage(&e);
    }
    if let Err(e) = args.worker.redis.check_url() {
        return usage(&e);
    }
    let metrics_addr = match args.metrics_addr {
        Some(a) => a,
        None => match default_metrics_addr.parse() {
            Ok(a) => a,
            Err(e) => return usage(&format!("metrics address {default_metrics_addr:?}: {e}")),
        },
    };
    let worker = match build(&args.worker, &args.own).await {
        Ok(w) => w,
        Err(e) => return usage(&e),
    };
    if args.print_nats_role {
        // Checked above: the prefix is valid.
        if let Ok(subjects) = args.worker.nats.subjects() {
            print!("{}", crate::role::nats_role(&worker, &subjects));
        }
        telemetry.shutdown().await;
        return std::process::ExitCode::SUCCESS;
    }
    let served = worker.serve(&args.worker, metrics_addr).await;
    telemetry.shutdown().await;
    match served {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
