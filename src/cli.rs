//! The `toolfleet` command line: the clap tree ([`Cli`], [`Command`]) and
//! [`run`], which hands each command to its module. The top of this
//! package: no module imports it (`main` parses and calls [`run`]).

use clap::{Parser, Subcommand};

#[derive(Parser, Debug)]
#[command(
    name = "toolfleet",
    version,
    about = "An event-driven fleet for LLM tool calling over NATS, JetStream and Redis."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    #[command(flatten)]
    pub telemetry: toolfleet_service::telemetry::TelemetryArgs,
}

// Parsed once per process: the size difference between variants is
// irrelevant.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Submit a chat job, stream the answer and print it with its references.
    Chat(crate::chat::ChatArgs),
    /// Bring up a whole local fleet (starting nats-server and redis-server
    /// when none is reachable), answer example questions, shut down.
    Demo(crate::demo::DemoArgs),
    /// Run the orchestrator and every worker in one process (development).
    Up(crate::serve::UpArgs),
    /// Load generator: raw tool calls or whole chat jobs at a fixed
    /// concurrency through a local fleet, optionally beside the transport
    /// floors; prints throughput, latency percentiles, errors and memory.
    Bench(crate::bench_run::BenchArgs),
    /// A worker process for `toolfleet bench --processes`: every family
    /// this command ships plus the bench's `bench:sleep` tool.
    #[command(hide = true)]
    BenchWorker(crate::serve::BenchWorkerArgs),
    /// Inspect and validate tool definition files.
    Tools {
        #[command(subcommand)]
        command: crate::tools::ToolsCommand,
    },
    /// Ingest files into the document index retrieval workers search
    /// (progress, then a summary; a bad file is reported and skipped).
    Ingest(Box<crate::index::IngestArgs>),
    /// Check the document index, or migrate its PostgreSQL tables.
    Index {
        #[command(subcommand)]
        command: crate::index::IndexCommand,
    },
    /// Read the binary outputs of tools (images, files) from the store.
    Blob {
        #[command(subcommand)]
        command: crate::blob::BlobCommand,
    },
    /// Inspect and replay dead letters: jobs that exhausted their attempts
    /// or could not be read, kept in the dead-letter stream (14 days).
    Deadletters {
        #[command(subcommand)]
        command: crate::ops::deadletters::DeadlettersCommand,
    },
    /// Cancel a running invocation: publishes its cancel and waits for the
    /// fleet's `error: cancelled`. With `--call`, only that tool call (a
    /// `callId` from `toolfleet events`) is stopped: its result is an
    /// error `call_cancelled` and the invocation goes on. Exit 0 once
    /// confirmed; 1 when the invocation is unknown, already finished, or
    /// the confirmation does not come in time.
    Cancel(crate::ops::cancel::CancelArgs),
    /// Approve (or with `--deny`, deny) a tool call that waits for a
    /// person: the `callId` of an `approval_requested` event (shown by
    /// `toolfleet chat` and `toolfleet events`). The parked invocation
    /// resumes on any orchestrator once every held call of its turn is
    /// decided. Exit 0 when the decision is recorded; 1 when it is refused
    /// (unknown invocation or call, already decided) or nobody answers.
    Approve(crate::ops::approve::ApproveArgs),
    /// The fleet at a glance: every worker instance (from `$SRV.INFO` and
    /// `$SRV.STATS`), every tool with its instances, backlog, jobs in
    /// flight, jobs run and errors (JetStream and direct) and its newest
    /// error; the chat backlog and the dead letters kept. Exits 3 when a
    /// tool has waiting jobs and no instance serves it (1 on an error).
    Status(crate::ops::status::StatusArgs),
    /// Replay an invocation's events from the events stream (kept two
    /// hours), a line each (deltas joined) or as JSON lines; a running
    /// invocation is followed to its end. Exits 0 after `completed`, 1
    /// after `error` or when nothing of it is kept, 2 when it is still
    /// running and `--no-follow` was given.
    Events(crate::ops::events::EventsArgs),
    /// Serve the OpenAI-compatible HTTP API (`/v1/chat/completions`,
    /// `/v1/responses`, `/v1/models`) in front of the fleet: each request a
    /// chat job of its API key's tenant (docs/gateway.md).
    Gateway(Box<crate::gateway::GatewayArgs>),
    /// The gateway's API keys: add (printed once, stored hashed), ls,
    /// revoke.
    Keys {
        #[command(subcommand)]
        command: crate::keys::KeysCommand,
    },
    /// Serve the live fleet's tools to MCP clients.
    Mcp {
        #[command(subcommand)]
        command: crate::mcp::McpCommand,
    },
    /// Per-tenant tool settings (the settings bucket the orchestrators
    /// send in each tenant's tool jobs): set (checked against the tool's
    /// settingsSchema; secrets only as references), get, ls, rm.
    Settings {
        #[command(subcommand)]
        command: crate::settings::SettingsCommand,
    },
    /// Scheduled chat jobs (the schedules bucket every orchestrator
    /// watches): add (cron in a time zone, a job file, missed-run policy,
    /// concurrency, budget), ls, rm, pause, resume (docs/schedules.md).
    Schedule {
        #[command(subcommand)]
        command: crate::schedule::ScheduleCommand,
    },
    /// The tool-result cache: purge a tool's cached results, of every
    /// tenant or one (docs/tool-cache.md).
    Cache {
        #[command(subcommand)]
        command: crate::cache::CacheCommand,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish,
    /// powershell): `toolfleet completions bash > /etc/bash_completion.d/toolfleet`.
    Completions { shell: clap_complete::Shell },
    /// Probe a fleet process's health endpoint, for container images
    /// without curl: prints the answer, exits 0 when it is 2xx, 1 when it
    /// is not or nothing answers, 64 for a URL that is not http(s).
    Health(crate::ops::health::HealthArgs),
    /// Serve the scripted OpenAI-compatible model: a STAND-IN for a real
    /// provider that follows a JSON script, for tests and offline demos.
    ScriptedModel(crate::serve::ScriptedModelArgs),
}

/// Runs a command; returns the process exit code.
pub async fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::Chat(args) => crate::chat::run(args).await,
        Command::Demo(args) => crate::demo::run(args).await,
        Command::Up(args) => crate::serve::up(args).await,
        Command::Bench(args) => crate::bench_run::run(args).await,
        Command::BenchWorker(args) => crate::serve::bench_worker(args).await,
        Command::Tools { command } => crate::tools::run(command).await,
        Command::Ingest(args) => crate::index::ingest(*args).await,
        Command::Index { command } => crate::index::run(command).await,
        Command::Blob { command } => crate::blob::run(command).await,
        Command::Health(args) => crate::ops::health::run(args).await,
        Command::Deadletters { command } => crate::ops::deadletters::run(command).await,
        Command::Approve(args) => crate::ops::approve::run(args).await,
        Command::Cancel(args) => crate::ops::cancel::run(args).await,
        Command::Status(args) => crate::ops::status::run(args).await,
        Command::Events(args) => crate::ops::events::run(args).await,
        Command::Gateway(args) => crate::gateway::run(*args).await,
        Command::Keys { command } => crate::keys::run(command).await,
        Command::Cache { command } => crate::cache::run(command).await,
        Command::Mcp { command } => crate::mcp::run(command).await,
        Command::Settings { command } => crate::settings::run(command).await,
        Command::Schedule { command } => crate::schedule::run(command).await,
        Command::Completions { shell } => {
            use clap::CommandFactory;
            clap_complete::generate(
                shell,
                &mut Cli::command(),
                "toolfleet",
                &mut std::io::stdout(),
            );
            Ok(0)
        }
        Command::ScriptedModel(args) => crate::serve::scripted_model(args).await,
    }
}
