//! The `toolfleet` command line. `main` parses and calls [`run`].

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use toolfleet_config::ConfigArgs;
use toolfleet_llm::args::LlmArgs;
use toolfleet_local::fleet::FleetSpec;
use toolfleet_service::args::{NatsArgs, ToolDefsArgs};

use crate::families::IndexArgs;
use toolfleet_orchestrator::OrchestratorConfig;
use toolfleet_protocol::{ChatEvent, ChatEventBody};

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
    Chat(ChatArgs),
    /// Bring up a whole local fleet (starting nats-server and redis-server
    /// when none is reachable), answer example questions, shut down.
    Demo(DemoArgs),
    /// Run the orchestrator and every worker in one process (development).
    Up(UpArgs),
    /// Load generator: raw tool calls or whole chat jobs at a fixed
    /// concurrency through a local fleet, optionally beside the transport
    /// floors; prints throughput, latency percentiles, errors and memory.
    Bench(BenchArgs),
    /// A worker process for `toolfleet bench --processes`: every family
    /// this command ships plus the bench's `bench:sleep` tool.
    #[command(hide = true)]
    BenchWorker(BenchWorkerArgs),
    /// Inspect and validate tool definition files.
    Tools {
        #[command(subcommand)]
        command: ToolsCommand,
    },
    /// Ingest files into the document index retrieval workers search
    /// (progress, then a summary; a bad file is reported and skipped).
    Ingest(Box<IngestArgs>),
    /// Check the document index.
    Index {
        #[command(subcommand)]
        command: IndexCommand,
    },
    /// Read the binary outputs of tools (images, files) from the store.
    Blob {
        #[command(subcommand)]
        command: BlobCommand,
    },
    /// Inspect and replay dead letters: jobs that exhausted their attempts
    /// or could not be read, kept in the dead-letter stream (14 days).
    Deadletters {
        #[command(subcommand)]
        command: DeadlettersCommand,
    },
    /// Cancel a running invocation: publishes its cancel and waits for the
    /// fleet's `error: cancelled`. With `--call`, only that tool call (a
    /// `callId` from `toolfleet events`) is stopped: its result is an
    /// error `call_cancelled` and the invocation goes on. Exit 0 once
    /// confirmed; 1 when the invocation is unknown, already finished, or
    /// the confirmation does not come in time.
    Cancel {
        /// The invocation id.
        invocation_id: String,
        /// Only this tool call of the invocation.
        #[arg(long = "call", value_name = "CALL_ID")]
        call_id: Option<String>,
        /// The invocation's tenant.
        #[arg(long, env = "TOOLFLEET_TENANT", default_value = toolfleet_protocol::DEFAULT_TENANT)]
        tenant: String,
        /// Seconds to wait for the confirmation.
        #[arg(long, default_value_t = 5)]
        wait: u64,
        #[command(flatten)]
        nats: NatsArgs,
    },
    /// Approve (or with `--deny`, deny) a tool call that waits for a
    /// person: the `callId` of an `approval_requested` event (shown by
    /// `toolfleet chat` and `toolfleet events`). The parked invocation
    /// resumes on any orchestrator once every held call of its turn is
    /// decided. Exit 0 when the decision is recorded; 1 when it is refused
    /// (unknown invocation or call, already decided) or nobody answers.
    Approve {
        /// The invocation id.
        invocation_id: String,
        /// The held call's id.
        call_id: String,
        /// Deny the call; the model reads the reason.
        #[arg(long, value_name = "REASON")]
        deny: Option<String>,
        /// Why it is approved (recorded in the `approval_resolved` event).
        #[arg(long, conflicts_with = "deny")]
        reason: Option<String>,
        /// Who decides, as recorded in the event and the log.
        #[arg(long, env = "TOOLFLEET_APPROVER")]
        approver: Option<String>,
        /// The invocation's tenant.
        #[arg(long, env = "TOOLFLEET_TENANT", default_value = toolfleet_protocol::DEFAULT_TENANT)]
        tenant: String,
        /// Seconds to wait for an orchestrator's answer.
        #[arg(long, default_value_t = 5)]
        wait: u64,
        #[command(flatten)]
        nats: NatsArgs,
    },
    /// The fleet at a glance: every worker instance (from `$SRV.INFO` and
    /// `$SRV.STATS`), every tool with its instances, backlog, jobs in
    /// flight, jobs run and errors (JetStream and direct) and its newest
    /// error; the chat backlog and the dead letters kept. Exits 3 when a
    /// tool has waiting jobs and no instance serves it (1 on an error).
    Status {
        /// `text` (tables) or `json`.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
        /// How long to collect the workers' answers, in ms.
        #[arg(long, default_value_t = 500, value_parser = clap::value_parser!(u64).range(50..=60_000))]
        wait_ms: u64,
        #[command(flatten)]
        nats: NatsArgs,
    },
    /// Replay an invocation's events from the events stream (kept two
    /// hours), a line each (deltas joined) or as JSON lines; a running
    /// invocation is followed to its end. Exits 0 after `completed`, 1
    /// after `error` or when nothing of it is kept, 2 when it is still
    /// running and `--no-follow` was given.
    Events {
        /// The invocation id.
        invocation_id: String,
        /// The invocation's tenant.
        #[arg(long, env = "TOOLFLEET_TENANT", default_value = toolfleet_protocol::DEFAULT_TENANT)]
        tenant: String,
        /// Stop at the events stored so far instead of following a running
        /// invocation.
        #[arg(long)]
        no_follow: bool,
        /// `text` (a line per event) or `json` (JSON lines).
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
        #[command(flatten)]
        nats: NatsArgs,
    },
    /// Serve the live fleet's tools to MCP clients.
    Mcp {
        #[command(subcommand)]
        command: McpCommand,
    },
    /// Print a shell completion script (bash, zsh, fish, elvish,
    /// powershell): `toolfleet completions bash > /etc/bash_completion.d/toolfleet`.
    Completions { shell: clap_complete::Shell },
    /// Probe a fleet process's health endpoint, for container images
    /// without curl: prints the answer, exits 0 when it is 2xx, 1 when it
    /// is not or nothing answers, 64 for a URL that is not http(s).
    Health {
        /// The endpoint, e.g. `http://127.0.0.1:9465/readyz` (ready: NATS,
        /// Redis and consumers) or `/livez` (the process runs).
        url: String,
        /// How long to wait for the answer.
        #[arg(long, default_value_t = 3000)]
        timeout_ms: u64,
    },
    /// Serve the scripted OpenAI-compatible model: a STAND-IN for a real
    /// provider that follows a JSON script, for tests and offline demos.
    ScriptedModel {
        /// Address to listen on.
        #[arg(long, default_value = "127.0.0.1:8080")]
        listen: SocketAddr,
        /// The script file (see `examples/demo-script.json`).
        #[arg(long)]
        script: PathBuf,
        /// Pause before every response's first token, in ms (a slow model;
        /// replaces the script's `firstTokenDelayMs`).
        #[arg(long)]
        first_token_delay_ms: Option<u64>,
        /// Pause before each streamed chunk, in ms (replaces the script's
        /// `chunkDelayMs`).
        #[arg(long)]
        chunk_delay_ms: Option<u64>,
    },
}

#[derive(Args, Debug)]
pub struct ChatArgs {
    /// The question; read from standard input when absent or `-`.
    pub question: Option<String>,
    /// The profile to answer with (the orchestrator's default when absent).
    #[arg(id = "job_profile", long = "profile", env = "TOOLFLEET_CHAT_PROFILE")]
    pub profile: Option<String>,
    /// The user the job is asked for (scopes user-owned context).
    #[arg(id = "job_user", long = "user", env = "TOOLFLEET_CHAT_USER")]
    pub user: Option<String>,
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Seconds to wait for the answer.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    /// Print every event as a JSON line instead of the rendered answer.
    #[arg(long)]
    pub json: bool,
    /// The tenant to ask as (1-64 of [A-Za-z0-9_-]): the submit, events
    /// and cancel subjects name it.
    #[arg(long, env = "TOOLFLEET_TENANT", default_value = toolfleet_protocol::DEFAULT_TENANT)]
    pub tenant: String,
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Questions to ask instead of the built-in examples.
    #[arg(long = "question")]
    pub questions: Vec<String>,
    /// The scripted model's script.
    #[arg(long, default_value = "examples/demo-script.json")]
    pub script: PathBuf,
    #[command(flatten)]
    pub local: LocalArgs,
}

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

/// What `toolfleet bench` drives through the fleet.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum BenchMode {
    /// Raw tool calls: a tool job on the tools stream, the result awaited
    /// on a reply inbox (no orchestrator, no model).
    Tool,
    /// Whole chat jobs: model calls, tool calls, citations and events.
    Chat,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Raw tool calls or whole chat jobs.
    #[arg(long, value_enum, default_value_t = BenchMode::Chat)]
    pub mode: BenchMode,
    /// Operations to run (after the warm-up). With --duration, whichever
    /// ends first.
    #[arg(long, visible_alias = "jobs")]
    pub count: Option<usize>,
    /// Run for this many seconds instead of (or at most, with --count) a
    /// count.
    #[arg(long)]
    pub duration: Option<f64>,
    /// Operations in flight at once (also the orchestrator's limit).
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// Operations before the measured run, discarded (default: one batch
    /// of --concurrency).
    #[arg(long)]
    pub warmup: Option<usize>,
    /// Tool mode: the tool to call. Default: bench:sleep@1.0.0 when
    /// --tool-delay-ms is given, else system:current_datetime@1.0.0.
    #[arg(long)]
    pub tool: Option<String>,
    /// Tool mode: the tool's arguments (JSON object).
    #[arg(long)]
    pub tool_args: Option<String>,
    /// Tool mode: call the bench's own tool (`bench:sleep`), which waits
    /// this long: a stand-in for a tool's own work.
    #[arg(long)]
    pub tool_delay_ms: Option<u64>,
    /// Chat mode, and tool mode with an LLM tool: the scripted model's
    /// pause before every first token, in ms (a slow model; each chat job
    /// makes two model calls).
    #[arg(long, default_value_t = 0)]
    pub model_delay_ms: u64,
    /// The scripted model's script (no artificial delay of its own).
    #[arg(long, default_value = "examples/bench-script.json")]
    pub script: PathBuf,
    /// Run the scripted model in a process of its own.
    #[arg(long)]
    pub model_process: bool,
    /// Run the model, the orchestrator (`toolfleet-orchestrator` beside
    /// this binary) and the workers as processes of their own; the
    /// orchestrator's memory is then read from /proc.
    #[arg(long)]
    pub processes: bool,
    /// Worker processes (with --processes).
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Tool jobs each worker process (or the in-process workers) runs at
    /// once. Default: --concurrency.
    #[arg(long)]
    pub worker_concurrency: Option<usize>,
    /// Seconds an operation may take before it counts as a `timeout`.
    #[arg(long, default_value_t = 120)]
    pub timeout_secs: u64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Write an SVG chart of the latency distributions here.
    #[arg(long)]
    pub svg: Option<PathBuf>,
    /// Chat mode: print the event timeline of every job slower than this,
    /// in ms.
    #[arg(long, default_value_t = 10_000)]
    pub slow_ms: u64,
    /// Also measure the transport floors on the same server under the same
    /// load (a JetStream work-queue round trip, a core NATS
    /// request-reply; for an LLM tool in tool mode, also a direct call to
    /// the same model with the tool's own request) and print the fleet's
    /// figures as ratios to them.
    #[arg(long)]
    pub floor: bool,
    #[command(flatten)]
    pub local: LocalArgs,
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
}

/// How a command prints its result.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// A table (or lines) for people.
    #[value(alias = "table")]
    Text,
    /// JSON for programs.
    Json,
}

/// `text` on one line (control characters as spaces), cut to `max`
/// characters with `…`.
pub(crate) fn one_line(text: &str, max: usize) -> String {
    let flat: String = text
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    if flat.chars().count() <= max {
        return flat;
    }
    let mut cut: String = flat.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

#[derive(Subcommand, Debug)]
pub enum McpCommand {
    /// An MCP server on stdin/stdout: `tools/list` is the fleet's live
    /// catalog (a profile's tools with `--profile`), `tools/call` runs the
    /// tool as a tool job of a fresh invocation of `--tenant`, its progress
    /// passed on as MCP progress, its references as resource links.
    Serve {
        /// The tenant the calls run as.
        #[arg(long, env = "TOOLFLEET_TENANT", default_value = toolfleet_protocol::DEFAULT_TENANT)]
        tenant: String,
        /// Offer only this profile's tools (from the profiles file).
        #[arg(id = "mcp_profile", long = "profile", env = "TOOLFLEET_MCP_PROFILE")]
        profile: Option<String>,
        /// Serve MCP's streamable HTTP at `http://ADDR/mcp` instead of
        /// stdio (no authentication of its own: a loopback address, or
        /// behind an authenticating proxy).
        #[arg(id = "mcp_http", long = "http", value_name = "ADDR")]
        http: Option<SocketAddr>,
        /// With `--http`: the `Host` names accepted besides loopback's (a
        /// proxy's name).
        #[arg(long = "allowed-host", value_name = "HOST", requires = "mcp_http")]
        allowed_hosts: Vec<String>,
        #[command(flatten)]
        llm: LlmArgs,
        #[command(flatten)]
        nats: NatsArgs,
    },
}

#[derive(Subcommand, Debug)]
pub enum DeadlettersCommand {
    /// The newest dead letters: sequence, time, kind, tool, code, attempts,
    /// invocation.
    Ls {
        /// How many, newest first.
        #[arg(long, default_value_t = 20)]
        limit: usize,
        /// `text` (a table) or `json`.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
        #[command(flatten)]
        nats: NatsArgs,
    },
    /// One dead letter, whole (its job's body included), as JSON.
    Show {
        /// Its sequence in the dead-letter stream (from `ls`).
        seq: u64,
        #[command(flatten)]
        nats: NatsArgs,
    },
    /// Publishes a dead tool or chat job again, after a fix: a tool job to
    /// its tool (refused when no worker's consumer serves it any more), a
    /// chat job to its tenant's submit subject. JetStream counts its
    /// attempts afresh; a tool job's original caller has usually stopped
    /// waiting, so its result goes only to the ledger.
    Replay {
        /// Its sequence in the dead-letter stream (from `ls`).
        seq: u64,
        /// For a chat job: the tenant to submit it as again (a dead letter
        /// does not keep the submit subject's tenant).
        #[arg(long, env = "TOOLFLEET_TENANT", default_value = toolfleet_protocol::DEFAULT_TENANT)]
        tenant: String,
        #[command(flatten)]
        nats: NatsArgs,
    },
}

#[derive(Subcommand, Debug)]
pub enum ToolsCommand {
    /// List the tools: those of the definitions directory (id, kind,
    /// purpose, category, title), or with `--live` those the running
    /// fleet's workers serve (id, live copies, worker families, delivery,
    /// kind); with `--live`, exits 1 when the fleet serves none.
    List {
        /// `text` (a table) or `json`.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
        /// Only tools of this namespace.
        #[arg(long)]
        namespace: Option<String>,
        /// Only tools whose id starts with this.
        #[arg(long)]
        id_prefix: Option<String>,
        /// Only tools with this tag.
        #[arg(long)]
        tag: Option<String>,
        /// Only tools of this category.
        #[arg(long)]
        category: Option<String>,
        #[command(flatten)]
        source: ToolsSource,
    },
    /// Show one tool's definition and its generated wire shapes.
    Show {
        /// Tool id (`namespace:name@x.y.z`) or function name.
        tool: String,
        #[command(flatten)]
        defs: ToolDefsArgs,
    },
    /// Search the tools of the definitions directory (or with `--live`
    /// those the running fleet serves): by name (exact 100, prefix 80,
    /// substring 60), tag (exact 50, substring 40) or description (20),
    /// best first; exits 1 when nothing matches.
    Search {
        /// What to look for (case does not matter).
        query: String,
        /// At most this many results.
        #[arg(long, default_value_t = toolfleet_protocol::search::DEFAULT_LIMIT)]
        limit: usize,
        /// `text` (a table) or `json`.
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
        #[command(flatten)]
        source: ToolsSource,
    },
    /// Validate tool definition files: every file of every directory given
    /// is checked and reported (not just up to the first broken one),
    /// duplicate ids and function names included; exits 1 when any is
    /// broken.
    Validate {
        /// Files or directories; the definitions directory when omitted.
        paths: Vec<PathBuf>,
        /// `text` (a line per file) or `json` (`[{"path", "ok", "id",
        /// "error"}]`).
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
        #[command(flatten)]
        defs: ToolDefsArgs,
    },
}

/// Where `tools list` and `tools search` read the tools from.
#[derive(Args, Debug)]
pub struct ToolsSource {
    /// Read the tools live workers of the running fleet serve (over NATS:
    /// `--nats-url`, `--subject-prefix`, …) instead of the definitions
    /// directory.
    #[arg(long)]
    pub live: bool,
    /// With `--live`: how long to collect the workers' answers, in ms.
    #[arg(long, default_value_t = 500, requires = "live")]
    pub wait_ms: u64,
    #[command(flatten)]
    pub defs: ToolDefsArgs,
    #[command(flatten)]
    pub nats: NatsArgs,
}

#[derive(Subcommand, Debug)]
pub enum IndexCommand {
    /// Search the index as a retrieval tool would (to check an ingest).
    Search {
        query: String,
        #[command(flatten)]
        index: IndexArgs,
        /// Only this data source or upload collection.
        #[arg(long)]
        collection: Option<String>,
        #[arg(long, default_value_t = 5)]
        top_k: usize,
        /// `text` (a passage per hit) or `json` (`[{"score", "id",
        /// "title", "collection", "text"}]`).
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
    },
}

/// `toolfleet ingest`.
#[derive(clap::Args, Debug)]
pub struct IngestArgs {
    /// Files and directories (walked recursively): Markdown, HTML, plain
    /// text, CSV, and JSON Lines of context items.
    #[arg(required = true)]
    pub paths: Vec<PathBuf>,
    /// The data source (or upload collection) the documents belong to.
    #[arg(long)]
    pub collection: String,
    /// Owner ids stored with every document.
    #[arg(long)]
    pub owner_user: Option<String>,
    #[arg(long)]
    pub owner_device: Option<String>,
    #[arg(long)]
    pub owner_agent: Option<String>,
    /// Only files under these directories are read (links resolved);
    /// default: the current directory.
    #[arg(long = "allow-root")]
    pub allow_roots: Vec<PathBuf>,
    /// Tokens per chunk (o200k_base).
    #[arg(long, default_value_t = toolfleet_worker_retrieval::chunk::DEFAULT_MAX_TOKENS)]
    pub chunk_tokens: usize,
    /// Tokens shared by consecutive chunks.
    #[arg(long, default_value_t = toolfleet_worker_retrieval::chunk::DEFAULT_OVERLAP_TOKENS)]
    pub chunk_overlap: usize,
    /// Larger files are skipped.
    #[arg(long, default_value_t = toolfleet_worker_retrieval::ingest::DEFAULT_MAX_FILE_BYTES)]
    pub max_file_bytes: u64,
    /// No progress bar (it is drawn only on a terminal anyway).
    #[arg(long)]
    pub quiet: bool,
    #[command(flatten)]
    pub index: IndexArgs,
}

#[derive(Subcommand, Debug)]
pub enum BlobCommand {
    /// Write a blob's bytes to FILE (or to stdout when it is not a
    /// terminal). Exits 1 when the blob is gone (expired with its
    /// invocation's keys, or never stored), 64 for a malformed URI.
    Get {
        /// `toolfleet-blob:<invocation id>/<blob id>`, as a tool returned it.
        uri: String,
        /// Where to write the bytes (stdout when omitted).
        #[arg(short = 'o', long = "output")]
        output: Option<PathBuf>,
        /// The fleet's prefix (the store's keys start with it).
        #[arg(long = "subject-prefix", env = toolfleet_service::args::ENV_SUBJECT_PREFIX, default_value = toolfleet_protocol::DEFAULT_PREFIX)]
        prefix: String,
        #[command(flatten)]
        redis: toolfleet_store::RedisOptions,
    },
}

/// Runs a command; returns the process exit code.
pub async fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::Chat(args) => chat(args).await,
        Command::Demo(args) => demo(args).await,
        Command::Up(args) => up(args).await,
        Command::Bench(args) => bench(args).await,
        Command::BenchWorker(args) => bench_worker(args).await,
        Command::Tools { command } => tools(command).await,
        Command::Ingest(args) => ingest(*args).await,
        Command::Index { command } => index(command).await,
        Command::Blob { command } => blob(command).await,
        Command::Health { url, timeout_ms } => health(&url, timeout_ms).await,
        Command::Deadletters { command } => deadletters(command).await,
        Command::Approve {
            invocation_id,
            call_id,
            deny,
            reason,
            approver,
            tenant,
            wait,
            nats,
        } => {
            let approval = toolfleet_protocol::Approval {
                call_id,
                decision: if deny.is_some() {
                    toolfleet_protocol::approval::ApprovalDecision::Deny
                } else {
                    toolfleet_protocol::approval::ApprovalDecision::Approve
                },
                reason: deny.or(reason),
                approver,
            };
            crate::ops::approve(
                &invocation_id,
                &approval,
                &tenant,
                Duration::from_secs(wait),
                &nats,
            )
            .await
        }
        Command::Cancel {
            invocation_id,
            call_id,
            tenant,
            wait,
            nats,
        } => {
            cancel(
                &invocation_id,
                call_id.as_deref(),
                &tenant,
                Duration::from_secs(wait),
                &nats,
            )
            .await
        }
        Command::Status {
            output,
            wait_ms,
            nats,
        } => crate::ops::status(&nats, Duration::from_millis(wait_ms), output).await,
        Command::Events {
            invocation_id,
            tenant,
            no_follow,
            output,
            nats,
        } => crate::ops::events(&nats, &invocation_id, &tenant, !no_follow, output).await,
        Command::Mcp {
            command:
                McpCommand::Serve {
                    tenant,
                    profile,
                    http,
                    allowed_hosts,
                    llm,
                    nats,
                },
        } => {
            if !toolfleet_protocol::valid_tenant(&tenant) {
                eprintln!("toolfleet mcp serve: --tenant {tenant:?} is not 1-64 of [A-Za-z0-9_-]");
                return Ok(toolfleet_service::args::EXIT_CONFIG);
            }
            let (scope, needs_approval) = match &profile {
                None => (None, Vec::new()),
                Some(name) => {
                    let config =
                        toolfleet_service::args::or_exit(llm.fleet_config().map_err(Into::into));
                    let Some(p) = config.profiles.get(name) else {
                        eprintln!("toolfleet mcp serve: no profile {name:?} in the profiles file");
                        return Ok(toolfleet_service::args::EXIT_CONFIG);
                    };
                    (Some(p.tools.clone()), p.require_approval.clone())
                }
            };
            let subjects = nats.subjects()?;
            let client = nats.connect("toolfleet-mcp").await?;
            let server =
                crate::mcp_serve::FleetServer::new(client, subjects, tenant, scope, needs_approval);
            match http {
                Some(listen) => {
                    let mut hosts = allowed_hosts;
                    if !hosts.is_empty() {
                        hosts.extend(["localhost".into(), "127.0.0.1".into(), "::1".into()]);
                    }
                    crate::mcp_serve::serve_http(server, listen, hosts).await?;
                }
                None => crate::mcp_serve::serve_stdio(server).await?,
            }
            Ok(0)
        }
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
        Command::ScriptedModel {
            listen,
            script,
            first_token_delay_ms,
            chunk_delay_ms,
        } => {
            toolfleet_service::serve::raise_fd_limit();
            let mut script = toolfleet_scripted::Script::load(&script)?;
            if let Some(ms) = first_token_delay_ms {
                script = script.with_first_token_delay(Duration::from_millis(ms));
            }
            if let Some(ms) = chunk_delay_ms {
                script = script.with_chunk_delay(Duration::from_millis(ms));
            }
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("binding {listen}"))?;
            toolfleet_scripted::serve(listener, script, toolfleet_service::args::shutdown_signal())
                .await?;
            Ok(0)
        }
    }
}

/// Prints an event as it arrives on stderr: tool activity always, the
/// answer's text as it streams when stderr is a terminal. The final answer,
/// renumbered for the reader, goes to stdout.
/// What `toolfleet chat` shows on stderr while it waits: the tool calls as
/// they happen and, on a terminal, one progress line (rewritten in place)
/// with the time waited. The answer itself is printed once, on stdout,
/// when it is complete (its markers renumbered to the references listed).
struct Progress {
    terminal: bool,
    started: std::time::Instant,
    tools: u32,
    /// A progress line is on screen (to clear before anything else).
    shown: bool,
}

impl Progress {
    fn new() -> Self {
        use std::io::IsTerminal;
        Self {
            terminal: std::io::stderr().is_terminal(),
            started: std::time::Instant::now(),
            tools: 0,
            shown: false,
        }
    }

    fn clear(&mut self) {
        if self.shown {
            eprint!("\r\x1b[2K");
            let _ = std::io::stderr().flush();
            self.shown = false;
        }
    }

    fn tick(&mut self) {
        if !self.terminal {
            return;
        }
        let tools = match self.tools {
            0 => String::new(),
            1 => ", 1 tool call".to_owned(),
            n => format!(", {n} tool calls"),
        };
        eprint!(
            "\r\x1b[2K… waiting for the answer ({:.0} s{tools})",
            self.started.elapsed().as_secs_f64()
        );
        let _ = std::io::stderr().flush();
        self.shown = true;
    }

    fn event(&mut self, event: &ChatEvent) {
        match &event.body {
            ChatEventBody::ToolCall {
                tool, arguments, ..
            } => {
                self.clear();
                self.tools += 1;
                eprintln!("  → {tool} {arguments}");
            }
            ChatEventBody::ToolResult {
                tool,
                status,
                duration_ms,
                error_code,
                ..
            } => {
                self.clear();
                let code = error_code
                    .as_deref()
                    .map(|c| format!(" ({c})"))
                    .unwrap_or_default();
                eprintln!("  ← {tool}: {}{code} in {duration_ms} ms", status.as_str());
            }
            ChatEventBody::ApprovalRequested {
                call_id,
                tool,
                arguments,
                ..
            } => {
                self.clear();
                eprintln!(
                    "  ⏸ {tool} {arguments} waits for approval:\n      toolfleet approve {} {call_id}   (or --deny REASON)",
                    event.invocation_id
                );
            }
            ChatEventBody::ApprovalResolved { tool, decision, .. } => {
                self.clear();
                eprintln!("  ▶ {tool}: {}", decision.as_str());
            }
            _ => {}
        }
        self.tick();
    }
}

/// Asks `job`, showing progress; Ctrl-C publishes the invocation's cancel
/// and waits (up to 5 s) for its `error: cancelled` before giving up.
async fn ask(
    client: &async_nats::Client,
    subjects: &toolfleet_protocol::Subjects,
    job: &toolfleet_protocol::ChatJob,
    timeout: Duration,
    mut on_event: impl FnMut(&ChatEvent),
) -> Result<toolfleet_protocol::client::ChatOutcome, AskError> {
    let answer = toolfleet_protocol::client::chat(client, subjects, job, timeout, |e| on_event(e));
    tokio::pin!(answer);
    tokio::select! {
        result = &mut answer => result.map_err(AskError::Failed),
        _ = tokio::signal::ctrl_c() => {
            eprintln!("\ncancelling {} …", job.invocation_id);
            let tenant = job.tenant.as_deref().unwrap_or(toolfleet_protocol::DEFAULT_TENANT);
            let _ = client
                .publish(subjects.chat_cancel(tenant, &job.invocation_id), "".into())
                .await;
            let _ = client.flush().await;
            match tokio::time::timeout(Duration::from_secs(5), &mut answer).await {
                Ok(Err(e)) if e.to_string().contains("cancelled") => Err(AskError::Cancelled(true)),
                Ok(Ok(outcome)) => Ok(outcome),
                _ => Err(AskError::Cancelled(false)),
            }
        }
    }
}

/// The answer as printed: its text, then its numbered references with
/// their links.
fn rendered(outcome: &toolfleet_protocol::client::ChatOutcome) -> String {
    toolfleet_protocol::references::render(&outcome.text, &outcome.references).to_markdown()
}

/// How [`ask`] ended without an answer.
enum AskError {
    Failed(toolfleet_protocol::client::ClientError),
    /// Interrupted; whether the fleet confirmed the cancel.
    Cancelled(bool),
}

/// Exit code of an interrupted command (128 + SIGINT).
const EXIT_INTERRUPTED: i32 = 130;

async fn chat(args: ChatArgs) -> anyhow::Result<i32> {
    if !toolfleet_protocol::valid_tenant(&args.tenant) {
        eprintln!(
            "toolfleet chat: --tenant {:?} is not 1-64 of [A-Za-z0-9_-]",
            args.tenant
        );
        return Ok(64);
    }
    let question = match args.question.as_deref() {
        Some(q) if q != "-" => q.to_owned(),
        _ => {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut text)?;
            text
        }
    };
    if question.trim().is_empty() {
        eprintln!("toolfleet chat: the question is empty (give it as an argument or on stdin)");
        return Ok(64);
    }
    let subjects = args.nats.subjects()?;
    let client = args.nats.connect("toolfleet-chat").await?;
    let timeout = Duration::from_secs(args.timeout);
    let mut job = toolfleet_protocol::client::question(question.trim_end());
    job.tenant = Some(args.tenant.clone());
    job.profile = args.profile.clone();
    job.user = args.user.clone();
    // The trace starts here: the orchestrator's and the workers' spans are
    // its children (exported when an OTLP endpoint is configured).
    let span = tracing::info_span!(
        "chat",
        otel.name = "chat toolfleet",
        otel.kind = "producer",
        invocation_id = %job.invocation_id,
    );
    job.traceparent = Some(
        toolfleet_service::telemetry::traceparent(&span, None)
            .unwrap_or_else(toolfleet_service::telemetry::new_traceparent),
    );
    if args.json {
        let result = ask(&client, &subjects, &job, timeout, |e| {
            println!("{}", serde_json::to_string(e).unwrap_or_default());
        })
        .instrument(span)
        .await;
        return Ok(match result {
            Ok(_) => 0,
            Err(AskError::Failed(e)) => {
                eprintln!("error: {e}");
                1
            }
            Err(AskError::Cancelled(_)) => EXIT_INTERRUPTED,
        });
    }
    let mut progress = Progress::new();
    progress.tick();
    let result = ask(&client, &subjects, &job, timeout, |e| progress.event(e))
        .instrument(span)
        .await;
    progress.clear();
    match result {
        Ok(outcome) => {
            println!("{}", rendered(&outcome));
            Ok(0)
        }
        Err(AskError::Failed(e)) => {
            eprintln!("error: {e:#}");
            Ok(1)
        }
        Err(AskError::Cancelled(confirmed)) => {
            eprintln!(
                "{}",
                if confirmed {
                    "cancelled"
                } else {
                    "cancel sent; the fleet did not confirm it in time"
                }
            );
            Ok(EXIT_INTERRUPTED)
        }
    }
}

/// The questions the demo asks; each matches a rule of the demo script.
pub const DEMO_QUESTIONS: [&str; 3] = [
    "What time is it, and how do lighthouses warn ships?",
    "How do honeybees find their way back to the hive?",
    "Why does sourdough bread rise without baker's yeast?",
];

/// NATS and Redis for the demo: the configured ones when reachable,
/// otherwise child processes (killed when dropped).
pub(crate) struct DemoServers {
    pub(crate) nats_url: String,
    pub(crate) redis_url: String,
    _nats: Option<toolfleet_local::servers::NatsServer>,
    _redis: Option<toolfleet_local::servers::RedisServer>,
}

pub(crate) fn demo_servers(args: &LocalArgs) -> anyhow::Result<DemoServers> {
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
    Ok(DemoServers {
        nats_url,
        redis_url,
        _nats: nats,
        _redis: redis,
    })
}

/// A whole fleet on this machine: servers (reused or child processes), the
/// scripted model, an index of the corpus, the orchestrator and both
/// workers in this process. Used by `demo` and `bench`.
struct LocalFleet {
    servers: DemoServers,
    model: toolfleet_scripted::ScriptedServer,
    subjects: toolfleet_protocol::Subjects,
    client: async_nats::Client,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    _work: tempfile::TempDir,
}

impl LocalFleet {
    async fn start(
        args: &LocalArgs,
        script: &std::path::Path,
        max_in_flight: usize,
    ) -> anyhow::Result<Self> {
        let servers = demo_servers(args)?;
        let registry = load_registry(&args.defs.dir)?;
        eprintln!(
            "• {} tool definitions loaded from {}",
            registry.len(),
            args.defs.dir.display()
        );

        let script = toolfleet_scripted::Script::load(script)?;
        let model_name = script.model().to_string();
        let model =
            toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse()?, script).await?;
        eprintln!(
            "• model: the scripted stand-in server at {} (not a real model)",
            model.base_url()
        );

        let work = tempfile::tempdir()?;
        eprintln!(
            "• index: {} ingested as data source \"handbook\" (tantivy, in a temporary directory)",
            args.corpus.display()
        );

        let subjects = toolfleet_protocol::Subjects::new(toolfleet_protocol::DEFAULT_PREFIX)?;
        // The scripted stand-in plays the model of the one default profile.
        let profiles = toolfleet_config::FleetConfig::single(
            toolfleet_llm::deployments::Deployment::new(model.base_url(), model_name),
        )
        .with_data_source("handbook");
        let workers = crate::families::all(&crate::families::Inputs {
            definitions: &args.defs.dir,
            index: &IndexArgs::tantivy(work.path().join("index"), args.corpus.clone()),
            models: Some(&profiles),
        })
        .await?;
        let mut orchestrator = OrchestratorConfig::new(subjects.clone(), profiles);
        orchestrator.max_in_flight = max_in_flight;
        let spec = FleetSpec {
            nats_url: servers.nats_url.clone(),
            redis_url: servers.redis_url.clone(),
            subjects: subjects.clone(),
            citation_ttl: Duration::from_secs(3600),
            orchestrator: Some(orchestrator),
            workers,
            worker_concurrency: max_in_flight,
            nats_connect_wait: Duration::from_secs(10),
        };
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let metrics = prometheus::Registry::new();
        eprint!("• starting the orchestrator and the system and retrieval workers … ");
        toolfleet_local::fleet::start(spec, &metrics, &tracker, shutdown.clone()).await?;
        eprintln!("ready\n");
        let client = toolfleet_service::args::connect_nats(
            &servers.nats_url,
            "toolfleet-demo",
            Duration::from_secs(5),
        )
        .await?;
        Ok(Self {
            servers,
            model,
            subjects,
            client,
            shutdown,
            tracker,
            _work: work,
        })
    }

    async fn stop(self) {
        eprint!("• shutting down … ");
        self.shutdown.cancel();
        self.tracker.close();
        if tokio::time::timeout(Duration::from_secs(10), self.tracker.wait())
            .await
            .is_err()
        {
            eprint!("(grace period over) ");
        }
        self.model.shutdown().await;
        drop(self.servers);
        eprintln!("done");
    }
}

async fn demo(args: DemoArgs) -> anyhow::Result<i32> {
    eprintln!("toolfleet demo: a local fleet answering chat jobs with tools and citations");
    let fleet = LocalFleet::start(&args.local, &args.script, 8).await?;
    let questions: Vec<String> = if args.questions.is_empty() {
        DEMO_QUESTIONS.iter().map(|q| q.to_string()).collect()
    } else {
        args.questions.clone()
    };
    let mut failures = 0;
    for q in &questions {
        println!("Q: {q}");
        let job = toolfleet_protocol::client::question(q);
        let mut progress = Progress::new();
        let result = ask(
            &fleet.client,
            &fleet.subjects,
            &job,
            Duration::from_secs(60),
            |e| progress.event(e),
        )
        .await;
        progress.clear();
        match result {
            Ok(outcome) => println!("A: {}\n", rendered(&outcome)),
            Err(AskError::Failed(e)) => {
                failures += 1;
                println!("error: {e:#}\n");
            }
            Err(AskError::Cancelled(_)) => {
                fleet.stop().await;
                return Ok(EXIT_INTERRUPTED);
            }
        }
    }
    fleet.stop().await;
    Ok(if failures == 0 { 0 } else { 1 })
}

async fn bench(args: BenchArgs) -> anyhow::Result<i32> {
    crate::bench_run::run(args).await
}

async fn bench_worker(args: BenchWorkerArgs) -> anyhow::Result<i32> {
    let subjects =
        toolfleet_service::args::or_exit(args.worker.nats.subjects().map_err(Into::into));
    let workers = toolfleet_service::args::or_exit(
        crate::bench_fleet::bench_workers(&args.worker.defs.dir, &args.index).await,
    );
    let spec = FleetSpec {
        nats_url: args.worker.nats.url.clone(),
        redis_url: args.worker.redis.url.clone(),
        subjects,
        citation_ttl: args.worker.redis.ttl,
        orchestrator: None,
        workers,
        worker_concurrency: args.worker.concurrency,
        nats_connect_wait: Duration::from_secs(args.worker.nats.connect_wait_secs),
    };
    toolfleet_service::serve_until_signal(args.metrics_addr, |rt| async move {
        toolfleet_local::fleet::serve(spec, &rt).await
    })
    .await?;
    Ok(0)
}

/// The dead-letter stream, or why it cannot be read.
async fn dead_letter_stream(
    js: &async_nats::jetstream::Context,
    subjects: &toolfleet_protocol::Subjects,
) -> anyhow::Result<async_nats::jetstream::stream::Stream> {
    let name = subjects.dead_letters_stream();
    js.get_stream(&name).await.map_err(|e| {
        anyhow::anyhow!(
            "the dead-letter stream {name} cannot be read ({e}): no orchestrator has started \
             on this prefix yet, or this identity may not read it"
        )
    })
}

/// Dead letter `seq` of `stream`, decoded; `None` when there is none.
async fn dead_letter_at(
    stream: &async_nats::jetstream::stream::Stream,
    seq: u64,
) -> anyhow::Result<Option<(toolfleet_protocol::DeadLetter, String)>> {
    match stream.get_raw_message(seq).await {
        Ok(raw) => {
            let dead: toolfleet_protocol::DeadLetter = serde_json::from_slice(&raw.payload)
                .map_err(|e| anyhow::anyhow!("dead letter {seq} cannot be read: {e}"))?;
            let time = raw
                .time
                .format(&time::format_description::well_known::Rfc3339)
                .unwrap_or_default();
            Ok(Some((dead, time)))
        }
        Err(e) if e.to_string().contains("no message found") => Ok(None),
        Err(e) => Err(anyhow::anyhow!("reading dead letter {seq}: {e}")),
    }
}

async fn deadletters(command: DeadlettersCommand) -> anyhow::Result<i32> {
    let nats = match &command {
        DeadlettersCommand::Ls { nats, .. }
        | DeadlettersCommand::Show { nats, .. }
        | DeadlettersCommand::Replay { nats, .. } => nats,
    };
    let subjects = nats.subjects()?;
    let client = nats.connect("toolfleet-deadletters").await?;
    let js = async_nats::jetstream::new(client.clone());
    let mut stream = dead_letter_stream(&js, &subjects).await?;
    let stream = &mut stream;
    match command {
        DeadlettersCommand::Ls { limit, output, .. } => {
            let state = stream.info().await?.state.clone();
            let mut rows = Vec::new();
            let mut seq = state.last_sequence;
            while seq >= state.first_sequence && seq > 0 && rows.len() < limit {
                match dead_letter_at(stream, seq).await {
                    Ok(Some((dead, time))) => rows.push((seq, time, dead)),
                    Ok(None) => {}
                    // One unreadable record does not hide the others.
                    Err(e) => eprintln!("{e:#}"),
                }
                seq -= 1;
            }
            match output {
                Output::Json => {
                    let json: Vec<serde_json::Value> = rows
                        .iter()
                        .map(|(seq, time, dead)| {
                            let mut v = serde_json::to_value(dead).unwrap_or_default();
                            v["seq"] = (*seq).into();
                            v["time"] = time.clone().into();
                            if let Some(o) = v.as_object_mut() {
                                o.remove("job");
                            }
                            v
                        })
                        .collect();
                    println!("{}", serde_json::to_string_pretty(&json)?);
                }
                Output::Text => {
                    println!(
                        "{:<6} {:<20} {:<5} {:<36} {:<22} {:<3} INVOCATION",
                        "SEQ", "TIME", "KIND", "TOOL", "CODE", "TRY"
                    );
                    for (seq, time, dead) in &rows {
                        println!(
                            "{:<6} {:<20} {:<5} {:<36} {:<22} {:<3} {}",
                            seq,
                            time.get(..19).unwrap_or(time),
                            dead.kind.as_str(),
                            dead.tool_id.as_deref().unwrap_or("-"),
                            dead.code,
                            dead.attempts,
                            dead.invocation_id.as_deref().unwrap_or("-")
                        );
                    }
                    if rows.is_empty() {
                        eprintln!("no dead letters");
                    }
                }
            }
            Ok(0)
        }
        DeadlettersCommand::Show { seq, .. } => match dead_letter_at(stream, seq).await? {
            Some((dead, time)) => {
                let mut v = serde_json::to_value(&dead)?;
                v["seq"] = seq.into();
                v["time"] = time.into();
                println!("{}", serde_json::to_string_pretty(&v)?);
                Ok(0)
            }
            None => {
                eprintln!("no dead letter {seq} (it may have aged out)");
                Ok(1)
            }
        },
        DeadlettersCommand::Replay { seq, tenant, .. } => {
            let Some((dead, _)) = dead_letter_at(stream, seq).await? else {
                eprintln!("no dead letter {seq} (it may have aged out)");
                return Ok(1);
            };
            let Some(job) = &dead.job else {
                eprintln!(
                    "dead letter {seq} kept no job to replay (its body was not a JSON object: {})",
                    dead.code
                );
                return Ok(1);
            };
            let mut headers = async_nats::HeaderMap::new();
            for (k, v) in &dead.headers {
                // A fresh run: no old message id, deadline or attempt.
                let stale = [
                    toolfleet_protocol::headers::NATS_MSG_ID,
                    toolfleet_protocol::headers::DEADLINE,
                    toolfleet_protocol::headers::ATTEMPT,
                ];
                if !stale.contains(&k.as_str()) {
                    headers.insert(k.as_str(), v.as_str());
                }
            }
            headers.insert(
                toolfleet_protocol::headers::NATS_MSG_ID,
                format!("replay-{}-{seq}", dead.stream_sequence).as_str(),
            );
            let subject = match dead.kind {
                toolfleet_protocol::DeadLetterKind::Tool => {
                    let Some(id) = dead
                        .tool_id
                        .as_deref()
                        .and_then(|t| t.parse::<toolfleet_protocol::tools::ToolId>().ok())
                    else {
                        eprintln!("dead letter {seq} names no tool");
                        return Ok(1);
                    };
                    let consumer = subjects.tool_consumer(&id);
                    let tools = js.get_stream(subjects.tools_stream()).await?;
                    if tools.consumer_info(&consumer).await.is_err() {
                        eprintln!(
                            "no worker serves {id} any more (its consumer {consumer} is gone): \
                             not replayed"
                        );
                        return Ok(1);
                    }
                    subjects.tool(&id)
                }
                toolfleet_protocol::DeadLetterKind::Sink => {
                    // The event went out on NATS; only its sink missed it,
                    // and a sink's delivery is not a job to submit again.
                    eprintln!(
                        "dead letter {seq} is a sink delivery (its event is in `job`): \
                         not replayable"
                    );
                    return Ok(1);
                }
                toolfleet_protocol::DeadLetterKind::Chat => {
                    // The tenant is the submit subject's, which a dead
                    // letter does not keep: the operator names it.
                    if !toolfleet_protocol::valid_tenant(&tenant) {
                        eprintln!("--tenant {tenant:?} is not 1-64 of [A-Za-z0-9_-]");
                        return Ok(toolfleet_service::args::EXIT_CONFIG);
                    }
                    subjects.chat_submit(&tenant)
                }
            };
            let ack = js
                .publish_with_headers(subject.clone(), headers, serde_json::to_vec(job)?.into())
                .await?
                .await?;
            println!(
                "dead letter {seq} replayed to {subject} (stream sequence {})",
                ack.sequence
            );
            Ok(0)
        }
    }
}

/// `toolfleet cancel`: see [`Command::Cancel`].
async fn cancel(
    invocation_id: &str,
    call_id: Option<&str>,
    tenant: &str,
    wait: Duration,
    nats: &NatsArgs,
) -> anyhow::Result<i32> {
    use futures::StreamExt;
    if !toolfleet_protocol::valid_tenant(tenant) {
        eprintln!("toolfleet cancel: --tenant {tenant:?} is not 1-64 of [A-Za-z0-9_-]");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    if !toolfleet_protocol::valid_invocation_id(invocation_id) {
        eprintln!("toolfleet cancel: {invocation_id:?} is not an invocation id");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    if let Some(call) = call_id
        && !toolfleet_protocol::valid_invocation_id(call)
    {
        eprintln!("toolfleet cancel: --call {call:?} is not a call id");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    let subjects = nats.subjects()?;
    let client = nats.connect("toolfleet-cancel").await?;
    let terminal = |e: &ChatEvent| match &e.body {
        ChatEventBody::Completed { .. } => Some("completed".to_owned()),
        ChatEventBody::Error { code, .. } => Some(format!("error ({code})")),
        _ => None,
    };
    // Subscribed first: a terminal event between the reading and the
    // subscription is not missed.
    let mut events = client
        .subscribe(subjects.chat_events(tenant, invocation_id))
        .await?;
    client.flush().await?;
    let last =
        toolfleet_protocol::client::last_event(&client, &subjects, tenant, invocation_id).await?;
    match last.as_ref().map(|e| (terminal(e), e)) {
        Some((Some(how), _)) => {
            println!("{invocation_id} already finished: {how}; nothing to cancel");
            return Ok(1);
        }
        None if call_id.is_some() => {
            // No run yet (or none at all): there is no call to stop, and the
            // invocation is not ours to end.
            println!(
                "{invocation_id} of tenant {tenant} has no event: unknown, or not started; \
                 nothing cancelled"
            );
            return Ok(1);
        }
        None => {
            // Maybe still queued: the cancel is remembered for it.
            toolfleet_protocol::client::cancel(&client, &subjects, tenant, invocation_id).await?;
            println!(
                "{invocation_id} of tenant {tenant} has no event: unknown, or still queued \
                 (the cancel is sent and remembered, so a queued job ends cancelled when it starts)"
            );
            return Ok(1);
        }
        Some((None, _)) => {}
    }
    if let Some(call_id) = call_id {
        toolfleet_protocol::client::cancel_call(&client, &subjects, tenant, invocation_id, call_id)
            .await?;
    } else {
        toolfleet_protocol::client::cancel(&client, &subjects, tenant, invocation_id).await?;
    }
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, events.next()).await {
            Ok(Some(msg)) => {
                let Ok(event) =
                    toolfleet_protocol::Envelope::ChatEvent.decode::<ChatEvent>(&msg.payload)
                else {
                    continue;
                };
                if let (
                    Some(call_id),
                    ChatEventBody::ToolResult {
                        call_id: done,
                        error_code,
                        status,
                        ..
                    },
                ) = (call_id, &event.body)
                    && done == call_id
                {
                    if error_code.as_deref() == Some("call_cancelled") {
                        println!(
                            "call {call_id} of {invocation_id} cancelled; the invocation goes on"
                        );
                        return Ok(0);
                    }
                    println!(
                        "call {call_id} of {invocation_id} finished before the cancel took effect: {}",
                        status.as_str()
                    );
                    return Ok(1);
                }
                match terminal(&event) {
                    Some(how) if call_id.is_some() => {
                        println!(
                            "{invocation_id} ended ({how}) before the call's cancel was confirmed"
                        );
                        return Ok(1);
                    }
                    Some(how) if how == "error (cancelled)" => {
                        println!("{invocation_id} cancelled");
                        return Ok(0);
                    }
                    Some(how) => {
                        println!("{invocation_id} finished before the cancel took effect: {how}");
                        return Ok(1);
                    }
                    None => {}
                }
            }
            Ok(None) | Err(_) => {
                match call_id {
                    Some(call) => println!(
                        "cancel of call {call} of {invocation_id} sent; no confirmation within {} s \
                         (the call may have finished before, or be an agent tool's, which stops \
                         only with its invocation)",
                        wait.as_secs()
                    ),
                    None => println!(
                        "cancel of {invocation_id} sent; no confirmation within {} s",
                        wait.as_secs()
                    ),
                }
                return Ok(1);
            }
        }
    }
}

async fn health(url: &str, timeout_ms: u64) -> anyhow::Result<i32> {
    let parsed = match url::Url::parse(url) {
        Ok(u) if matches!(u.scheme(), "http" | "https") => u,
        Ok(u) => {
            eprintln!("error: {url} is not an http(s) URL ({}:)", u.scheme());
            return Ok(toolfleet_service::args::EXIT_CONFIG);
        }
        Err(e) => {
            eprintln!("error: {url:?} is not a URL: {e}");
            return Ok(toolfleet_service::args::EXIT_CONFIG);
        }
    };
    toolfleet_llm::install_crypto_provider();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_millis(timeout_ms))
        .build()?;
    match client.get(parsed).send().await {
        Ok(response) => {
            let status = response.status();
            let body = response.text().await.unwrap_or_default();
            print!("{body}");
            if !body.ends_with('\n') {
                println!();
            }
            if status.is_success() {
                Ok(0)
            } else {
                eprintln!("{url}: HTTP {status}");
                Ok(1)
            }
        }
        Err(e) => {
            eprintln!("{url}: no answer: {e}");
            Ok(1)
        }
    }
}

async fn up(args: UpArgs) -> anyhow::Result<i32> {
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
    let workers = toolfleet_service::args::or_exit(
        crate::families::all(&crate::families::Inputs {
            definitions: &args.worker.defs.dir,
            index: &args.index,
            models: Some(&models),
        })
        .await,
    );
    let mut orchestrator = OrchestratorConfig::new(subjects.clone(), models);
    orchestrator.max_in_flight = args.max_in_flight;
    orchestrator.sinks = sinks;
    let spec = FleetSpec {
        nats_url: args.worker.nats.url.clone(),
        redis_url: args.worker.redis.url.clone(),
        subjects,
        citation_ttl: args.worker.redis.ttl,
        orchestrator: Some(orchestrator),
        workers,
        worker_concurrency: args.worker.concurrency,
        nats_connect_wait: Duration::from_secs(args.worker.nats.connect_wait_secs),
    };
    toolfleet_service::serve_until_signal(args.metrics_addr, |rt| async move {
        toolfleet_local::fleet::serve(spec, &rt).await
    })
    .await?;
    Ok(0)
}

async fn tools(command: ToolsCommand) -> anyhow::Result<i32> {
    match command {
        ToolsCommand::List {
            output,
            namespace,
            id_prefix,
            tag,
            category,
            source,
        } => {
            let registry = tools_registry(&source).await?;
            let filter = toolfleet_protocol::registry::Filter {
                namespace,
                id_prefix,
                tag,
                category,
                model: None,
            };
            let rows: Vec<serde_json::Value> = registry
                .find(&filter)
                .into_iter()
                .map(|e| tool_row(e, source.live))
                .collect();
            match output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
                Output::Text => print_tool_rows(&rows, source.live),
            }
            if source.live && registry.is_empty() {
                eprintln!("no live tools");
                return Ok(1);
            }
            Ok(0)
        }
        ToolsCommand::Show { tool, defs } => {
            let registry = load_registry(&defs.dir)?;
            let def = match tool.parse::<toolfleet_protocol::tools::ToolId>() {
                Ok(id) => registry.get(&id),
                Err(_) => registry.by_function_name(&tool),
            }
            .with_context(|| format!("no tool {tool:?} in {}", defs.dir.display()))?;
            println!("{}", serde_json::to_string_pretty(def)?);
            println!(
                "\nChat Completions shape:\n{}",
                serde_json::to_string_pretty(&def.chat_completions_tool())?
            );
            println!(
                "\nResponses shape:\n{}",
                serde_json::to_string_pretty(&def.responses_tool())?
            );
            Ok(0)
        }
        ToolsCommand::Search {
            query,
            limit,
            output,
            source,
        } => {
            let registry = tools_registry(&source).await?;
            if source.live && registry.is_empty() {
                eprintln!("no live tools");
            }
            let hits = toolfleet_protocol::search::search(
                registry.list().map(|e| e.definition()),
                &query,
                limit,
            );
            match output {
                Output::Json => {
                    let rows: Vec<_> = hits
                        .iter()
                        .map(|h| {
                            let mut row = serde_json::json!({
                                "score": h.score,
                                "id": h.definition.id.to_string(),
                                "function": h.definition.function.name,
                                "title": h.definition.title,
                                "tags": h.definition.tags,
                            });
                            if source.live
                                && let Some(e) = registry.get_id(&h.definition.id)
                            {
                                row["workers"] = e.workers.into();
                                row["families"] = e.families.clone().into();
                            }
                            row
                        })
                        .collect();
                    println!("{}", serde_json::to_string_pretty(&rows)?);
                }
                Output::Text => {
                    for h in &hits {
                        println!(
                            "{:>3}  {:<40} {:<20} {}",
                            h.score,
                            h.definition.id.to_string(),
                            h.definition.function.name,
                            h.definition.title
                        );
                    }
                }
            }
            Ok(if hits.is_empty() { 1 } else { 0 })
        }
        ToolsCommand::Validate {
            paths,
            output,
            defs,
        } => {
            let paths = if paths.is_empty() {
                vec![defs.dir]
            } else {
                paths
            };
            let mut rows = Vec::new();
            for p in paths {
                let checked = if p.is_dir() {
                    toolfleet_protocol::tools::validate_dir(&p)
                        .unwrap_or_else(|e| vec![(p, Err(e))])
                } else {
                    let loaded = toolfleet_protocol::tools::load_file(&p);
                    vec![(p, loaded)]
                };
                rows.extend(checked.into_iter().map(|(path, loaded)| match loaded {
                    Ok(d) => serde_json::json!({
                        "path": path.display().to_string(), "ok": true, "id": d.id.to_string(),
                    }),
                    Err(e) => serde_json::json!({
                        "path": path.display().to_string(), "ok": false, "error": e.to_string(),
                    }),
                }));
            }
            let bad = rows.iter().filter(|r| r["ok"] == false).count();
            match output {
                Output::Json => println!("{}", serde_json::to_string_pretty(&rows)?),
                Output::Text => {
                    for r in &rows {
                        let path = r["path"].as_str().unwrap_or_default();
                        match r["id"].as_str() {
                            Some(id) => println!("ok   {path} ({id})"),
                            None => {
                                println!("FAIL {path}: {}", r["error"].as_str().unwrap_or_default())
                            }
                        }
                    }
                    println!("{} file(s), {bad} broken", rows.len());
                }
            }
            Ok(if bad == 0 { 0 } else { 1 })
        }
    }
}

async fn ingest(args: IngestArgs) -> anyhow::Result<i32> {
    use std::io::IsTerminal;
    use toolfleet_worker_retrieval::ingest::{IngestOptions, Outcome};
    let chunking =
        toolfleet_worker_retrieval::chunk::ChunkConfig::new(args.chunk_tokens, args.chunk_overlap)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    let collection = args.collection.trim().to_owned();
    if collection.is_empty() || collection.chars().any(char::is_control) || collection.len() > 256 {
        anyhow::bail!("--collection must be 1-256 characters without control characters");
    }
    let allowed_roots = if args.allow_roots.is_empty() {
        vec![std::env::current_dir()?]
    } else {
        args.allow_roots.clone()
    };
    let options = IngestOptions {
        collection,
        owner: toolfleet_worker_retrieval::model::Owner {
            user: args.owner_user.clone(),
            device: args.owner_device.clone(),
            agent: args.owner_agent.clone(),
        },
        chunking,
        max_file_bytes: args.max_file_bytes,
        allowed_roots,
        embedder: args.index.embedder().map_err(anyhow::Error::msg)?,
    };
    let store = toolfleet_worker_retrieval::open_store(&args.index)
        .await
        .map_err(anyhow::Error::msg)?;
    let (planned, _) = toolfleet_worker_retrieval::ingest::plan(&args.paths, &options);
    let total_bytes: u64 = planned.iter().map(|p| p.bytes).sum();
    let bar = if args.quiet || !std::io::stderr().is_terminal() {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::new(total_bytes)
    };
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {binary_bytes}/{binary_total_bytes} {binary_bytes_per_sec} {wide_msg}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut problems = Vec::new();
    let report = toolfleet_worker_retrieval::ingest::ingest(
        store.as_ref(),
        &args.paths,
        &options,
        &mut |file| {
            bar.inc(file.bytes);
            bar.set_message(file.path.display().to_string());
            match &file.outcome {
                Outcome::Skipped(why) => {
                    problems.push(format!("skipped {}: {why}", file.path.display()))
                }
                Outcome::Document { warnings, .. } => problems.extend(
                    warnings
                        .iter()
                        .map(|w| format!("warning {}: {w}", file.path.display())),
                ),
                Outcome::Items {
                    written,
                    rejected,
                    stopped,
                } => {
                    problems.extend(rejected.iter().map(|(line, why)| {
                        format!("skipped {} line {line}: {why}", file.path.display())
                    }));
                    if let Some(why) = stopped {
                        problems.push(format!(
                            "stopped {} after {written} items: {why}",
                            file.path.display()
                        ));
                    }
                }
            }
        },
    )
    .await;
    bar.finish_and_clear();
    for problem in &problems {
        eprintln!("{problem}");
    }
    let mb = report.bytes_ingested() as f64 / 1_000_000.0;
    println!(
        "ingested {} documents ({} chunks) and {} context items into {:?} ({}) from {:.2} MB in {:.2} s ({:.2} MB/s); {} skipped",
        report.documents(),
        report.chunks(),
        report.items(),
        options.collection,
        store.backend(),
        mb,
        report.elapsed_secs,
        mb / report.elapsed_secs.max(1e-9),
        report.skipped()
    );
    // Some input left out is worth a non-zero exit for scripts; the rest
    // went in all the same.
    Ok(if report.skipped() == 0 { 0 } else { 2 })
}

async fn index(command: IndexCommand) -> anyhow::Result<i32> {
    match command {
        IndexCommand::Search {
            query,
            index,
            collection,
            top_k,
            output,
        } => {
            let store = toolfleet_worker_retrieval::open_store(&index)
                .await
                .map_err(anyhow::Error::msg)?;
            let query = toolfleet_worker_retrieval::search::Query {
                text: query,
                collections: collection.into_iter().collect(),
                top_k: top_k.clamp(1, toolfleet_worker_retrieval::search::MAX_TOP_K),
                ..Default::default()
            };
            let hits = store.search(&query).await?;
            if output == Output::Json {
                let rows: Vec<serde_json::Value> = hits
                    .iter()
                    .map(|h| {
                        serde_json::json!({
                            "score": h.score,
                            "id": h.item.id,
                            "title": h.item.title,
                            "collection": h.item.collection,
                            "text": h.item.text,
                        })
                    })
                    .collect();
                println!("{}", serde_json::to_string_pretty(&rows)?);
                return Ok(0);
            }
            for h in &hits {
                let text: String = h.item.text.chars().take(200).collect();
                println!(
                    "{:.3}  {}  {}\n       {}",
                    h.score,
                    h.item.id,
                    h.item.title,
                    text.replace('\n', " ")
                );
            }
            if hits.is_empty() {
                eprintln!("no match");
            }
            Ok(0)
        }
    }
}

async fn blob(command: BlobCommand) -> anyhow::Result<i32> {
    use std::io::IsTerminal;
    let BlobCommand::Get {
        uri,
        output,
        prefix,
        redis,
    } = command;
    let uri = match toolfleet_protocol::blob::BlobUri::parse(&uri) {
        Ok(uri) => uri,
        Err(e) => {
            eprintln!("toolfleet blob get: {e}");
            return Ok(toolfleet_service::args::EXIT_CONFIG);
        }
    };
    if let Err(e) = toolfleet_protocol::Subjects::new(&prefix) {
        eprintln!("toolfleet blob get: {e}");
        return Ok(toolfleet_service::args::EXIT_CONFIG);
    }
    let store = toolfleet_store::CitationStore::connect_with(&redis, &prefix, redis.ttl)
        .await
        .with_context(|| format!("cannot connect to Redis at {}", redis.redacted_url()))?;
    let Some(blob) = store.get_blob(uri.invocation_id(), uri.blob_id()).await? else {
        eprintln!(
            "toolfleet blob get: no blob at {uri}: it expired with its invocation's keys, \
             or was never stored"
        );
        return Ok(1);
    };
    match output {
        Some(path) => {
            std::fs::write(&path, &blob.bytes)
                .with_context(|| format!("writing {}", path.display()))?;
            eprintln!(
                "wrote {} bytes of {} to {}",
                blob.bytes.len(),
                blob.content_type,
                path.display()
            );
        }
        None => {
            let mut stdout = std::io::stdout().lock();
            let text = is_text(&blob.content_type) && std::str::from_utf8(&blob.bytes).is_ok();
            if stdout.is_terminal() && !text {
                eprintln!(
                    "toolfleet blob get: not writing {} bytes of {} to a terminal; \
                     use -o FILE or redirect stdout",
                    blob.bytes.len(),
                    blob.content_type
                );
                return Ok(toolfleet_service::args::EXIT_CONFIG);
            }
            stdout.write_all(&blob.bytes)?;
            stdout.flush()?;
        }
    }
    Ok(0)
}

/// Is a blob of this content type text a terminal can show?
fn is_text(content_type: &str) -> bool {
    let essence = content_type.split(';').next().unwrap_or_default().trim();
    essence.starts_with("text/")
        || essence == "application/json"
        || essence.ends_with("+json")
        || essence.ends_with("+xml")
}

/// The tools `tools list` and `tools search` read: the definitions
/// directory, or with `--live` one reading of the fleet's catalog (what
/// its live workers serve), each through the registry.
async fn tools_registry(
    source: &ToolsSource,
) -> anyhow::Result<toolfleet_protocol::registry::Registry> {
    use toolfleet_protocol::catalog::{Catalog, discover};
    use toolfleet_protocol::registry::{DirSource, Registry};
    if source.live {
        let subjects = toolfleet_service::args::or_exit(source.nats.subjects().map_err(Into::into));
        let client = source.nats.connect("toolfleet-tools").await?;
        let catalog = discover(
            &client,
            &subjects,
            Duration::from_millis(source.wait_ms),
            &Catalog::default(),
        )
        .await?;
        Ok(Registry::build(&[&catalog]))
    } else {
        let dir = DirSource::load(&source.defs.dir).with_context(|| {
            format!(
                "loading tool definitions from {}",
                source.defs.dir.display()
            )
        })?;
        Ok(Registry::build(&[&dir]))
    }
}

/// One tool as `tools list` shows it: id, kind (`system` for a tool that
/// is not selectable), purpose, category, title, and for a live tool its
/// copies (`workers`), worker families and delivery.
fn tool_row(entry: &toolfleet_protocol::registry::RegistryEntry, live: bool) -> serde_json::Value {
    let d = entry.definition();
    let mut row = serde_json::json!({
        "id": d.id.to_string(),
        "kind": if d.selectable { "selectable" } else { "system" },
        "purpose": d.purpose(),
        "category": d.category,
        "title": d.title,
    });
    if live {
        row["workers"] = entry.workers.into();
        row["families"] = entry.families.clone().into();
        row["delivery"] = serde_json::to_value(d.delivery).unwrap_or_default();
    }
    row
}

/// The rows of [`tool_row`] as a table with a header.
fn print_tool_rows(rows: &[serde_json::Value], live: bool) {
    let text =
        |row: &serde_json::Value, key: &str| row[key].as_str().unwrap_or_default().to_owned();
    if live {
        println!(
            "{:<40} {:>7} {:<24} {:<9} KIND",
            "ID", "WORKERS", "FAMILIES", "DELIVERY"
        );
        for row in rows {
            let families: Vec<&str> = row["families"]
                .as_array()
                .map(|f| f.iter().filter_map(serde_json::Value::as_str).collect())
                .unwrap_or_default();
            println!(
                "{:<40} {:>7} {:<24} {:<9} {}",
                text(row, "id"),
                row["workers"],
                if families.is_empty() {
                    "-".to_owned()
                } else {
                    families.join(",")
                },
                text(row, "delivery"),
                text(row, "kind"),
            );
        }
    } else {
        println!(
            "{:<40} {:<10} {:<19} {:<12} TITLE",
            "ID", "KIND", "PURPOSE", "CATEGORY"
        );
        for row in rows {
            println!(
                "{:<40} {:<10} {:<19} {:<12} {}",
                text(row, "id"),
                text(row, "kind"),
                text(row, "purpose"),
                text(row, "category"),
                text(row, "title"),
            );
        }
    }
}

/// Loads and validates the tool definition files in `dir`.
fn load_registry(dir: &std::path::Path) -> anyhow::Result<toolfleet_protocol::tools::ToolRegistry> {
    toolfleet_protocol::tools::ToolRegistry::from_dir(dir)
        .with_context(|| format!("loading tool definitions from {}", dir.display()))
}
