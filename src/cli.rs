//! The `toolfleet` command line. `main` parses and calls [`run`].

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Args, Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{LlmArgs, NatsArgs, RedisArgs, ToolDefsArgs};
use crate::fleet::{FleetSpec, IndexPaths, WorkerKind};
use crate::orchestrator::OrchestratorConfig;
use crate::protocol::{ChatEvent, ChatEventBody};

#[derive(Parser, Debug)]
#[command(
    name = "toolfleet",
    version,
    about = "An event-driven fleet for LLM tool calling over NATS, JetStream and Redis."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
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
    /// Load generator: chat jobs at a fixed concurrency through a local
    /// fleet; prints throughput, latency percentiles and peak memory.
    Bench(BenchArgs),
    /// Inspect and validate tool definition files.
    Tools {
        #[command(subcommand)]
        command: ToolsCommand,
    },
    /// Build the document index that retrieval workers search.
    Index {
        #[command(subcommand)]
        command: IndexCommand,
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
    },
}

#[derive(Args, Debug)]
pub struct ChatArgs {
    /// The question.
    pub question: String,
    #[command(flatten)]
    pub nats: NatsArgs,
    /// Seconds to wait for the answer.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
    /// Print every event as a JSON line instead of the rendered answer.
    #[arg(long)]
    pub json: bool,
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
    #[arg(long, env = crate::config::ENV_NATS_URL, default_value = crate::config::DEFAULT_NATS_URL, hide_env_values = true)]
    pub nats_url: String,
    /// Use this Redis server instead of a child process (when reachable).
    #[arg(long, env = crate::config::ENV_REDIS_URL, default_value = crate::config::DEFAULT_REDIS_URL, hide_env_values = true)]
    pub redis_url: String,
    /// Always start private nats-server and redis-server child processes.
    #[arg(long)]
    pub isolated: bool,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Chat jobs to run (after a warm-up of one batch).
    #[arg(long, default_value_t = 500)]
    pub jobs: usize,
    /// Jobs in flight at once (also the orchestrator's and workers' limit).
    #[arg(long, default_value_t = 32)]
    pub concurrency: usize,
    /// The scripted model's script (no artificial delay by default).
    #[arg(long, default_value = "examples/bench-script.json")]
    pub script: PathBuf,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
    /// Print the event timeline of every job slower than this, in ms.
    #[arg(long, default_value_t = 1000)]
    pub slow_ms: u64,
    #[command(flatten)]
    pub local: LocalArgs,
}

#[derive(Args, Debug)]
pub struct UpArgs {
    #[command(flatten)]
    pub nats: NatsArgs,
    #[command(flatten)]
    pub redis: RedisArgs,
    #[command(flatten)]
    pub defs: ToolDefsArgs,
    #[command(flatten)]
    pub llm: LlmArgs,
    /// Where the index lives (built from --corpus-dir when missing).
    #[arg(
        long,
        env = "TOOLFLEET_INDEX_DIR",
        default_value = "target/toolfleet-index"
    )]
    pub index_dir: PathBuf,
    #[arg(long, env = "TOOLFLEET_CORPUS_DIR", default_value = "examples/corpus")]
    pub corpus_dir: PathBuf,
    /// Chat jobs in flight at once.
    #[arg(long, env = "TOOLFLEET_MAX_IN_FLIGHT", default_value_t = 32)]
    pub max_in_flight: usize,
    /// Tool jobs executed at once per worker.
    #[arg(long, env = "TOOLFLEET_CONCURRENCY", default_value_t = 16)]
    pub concurrency: usize,
    /// Prometheus metrics and health endpoint.
    #[arg(long, env = crate::config::ENV_METRICS_ADDR, default_value = "127.0.0.1:9464")]
    pub metrics_addr: SocketAddr,
}

#[derive(Subcommand, Debug)]
pub enum ToolsCommand {
    /// List the tools in the definitions directory.
    List(ToolDefsArgs),
    /// Show one tool's definition and its generated wire shapes.
    Show {
        /// Tool id (`namespace:name@x.y.z`) or function name.
        tool: String,
        #[command(flatten)]
        defs: ToolDefsArgs,
    },
    /// Validate tool definition files (a file or a directory).
    Validate {
        /// Files or directories; the definitions directory when omitted.
        paths: Vec<PathBuf>,
        #[command(flatten)]
        defs: ToolDefsArgs,
    },
}

#[derive(Subcommand, Debug)]
pub enum IndexCommand {
    /// Build (or rebuild) the index from a corpus of Markdown files.
    Build {
        #[arg(long, env = "TOOLFLEET_CORPUS_DIR", default_value = "examples/corpus")]
        corpus: PathBuf,
        #[arg(
            long,
            env = "TOOLFLEET_INDEX_DIR",
            default_value = "target/toolfleet-index"
        )]
        index: PathBuf,
    },
    /// Search the index (to check it).
    Search {
        query: String,
        #[arg(
            long,
            env = "TOOLFLEET_INDEX_DIR",
            default_value = "target/toolfleet-index"
        )]
        index: PathBuf,
        #[arg(long, default_value_t = 5)]
        limit: usize,
    },
}

/// Runs a command; returns the process exit code.
pub async fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Command::Chat(args) => chat(args).await,
        Command::Demo(args) => demo(args).await,
        Command::Up(args) => up(args).await,
        Command::Bench(args) => bench(args).await,
        Command::Tools { command } => tools(command),
        Command::Index { command } => index(command),
        Command::ScriptedModel { listen, script } => {
            let script = crate::scripted::Script::load(&script)?;
            let listener = tokio::net::TcpListener::bind(listen)
                .await
                .with_context(|| format!("binding {listen}"))?;
            crate::scripted::serve(listener, script, crate::config::shutdown_signal()).await?;
            Ok(0)
        }
    }
}

/// Prints an event as it arrives on stderr: tool activity always, the
/// answer's text as it streams when stderr is a terminal. The final answer,
/// renumbered for the reader, goes to stdout.
fn show_progress(event: &ChatEvent) {
    use std::io::IsTerminal;
    match &event.body {
        ChatEventBody::Delta { text } if std::io::stderr().is_terminal() => {
            eprint!("{text}");
            let _ = std::io::stderr().flush();
        }
        ChatEventBody::Completed { .. } if std::io::stderr().is_terminal() => eprintln!("\n"),
        ChatEventBody::ToolCall {
            tool, arguments, ..
        } => eprintln!("  → {tool} {arguments}"),
        ChatEventBody::ToolResult {
            tool,
            status,
            duration_ms,
            error_code,
            ..
        } => {
            let code = error_code
                .as_deref()
                .map(|c| format!(" ({c})"))
                .unwrap_or_default();
            eprintln!("  ← {tool}: {}{code} in {duration_ms} ms", status.as_str());
        }
        _ => {}
    }
}

async fn ask(
    client: &async_nats::Client,
    subjects: &crate::protocol::Subjects,
    question: &str,
    timeout: Duration,
) -> anyhow::Result<String> {
    let job = crate::client::question(question);
    let outcome = crate::client::chat(client, subjects, &job, timeout, show_progress).await?;
    let rendered = crate::citations::render(&outcome.text, &outcome.references);
    Ok(rendered.to_markdown())
}

async fn chat(args: ChatArgs) -> anyhow::Result<i32> {
    let subjects = args.nats.subjects()?;
    let client = args.nats.connect("toolfleet-chat").await?;
    let timeout = Duration::from_secs(args.timeout);
    if args.json {
        let job = crate::client::question(&args.question);
        let result = crate::client::chat(&client, &subjects, &job, timeout, |e| {
            println!("{}", serde_json::to_string(e).unwrap_or_default());
        })
        .await;
        return Ok(if result.is_ok() { 0 } else { 1 });
    }
    match ask(&client, &subjects, &args.question, timeout).await {
        Ok(answer) => {
            println!("{answer}");
            Ok(0)
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            Ok(1)
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
struct DemoServers {
    nats_url: String,
    redis_url: String,
    _nats: Option<crate::local::NatsServer>,
    _redis: Option<crate::local::RedisServer>,
}

fn demo_servers(args: &LocalArgs) -> anyhow::Result<DemoServers> {
    let (nats_url, nats) = if !args.isolated && crate::local::nats_reachable(&args.nats_url) {
        eprintln!(
            "• using the NATS server at {}",
            crate::config::redact_url(&args.nats_url)
        );
        (args.nats_url.clone(), None)
    } else {
        eprint!("• starting nats-server -js … ");
        let s = crate::local::NatsServer::start()?;
        eprintln!("on {}", s.url());
        (s.url(), Some(s))
    };
    let (redis_url, redis) = if !args.isolated && crate::local::redis_reachable(&args.redis_url) {
        eprintln!(
            "• using the Redis server at {}",
            crate::config::redact_url(&args.redis_url)
        );
        (args.redis_url.clone(), None)
    } else {
        eprint!("• starting redis-server … ");
        let s = crate::local::RedisServer::start()?;
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
    model: crate::scripted::ScriptedServer,
    subjects: crate::protocol::Subjects,
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
        let registry = crate::fleet::load_registry(&args.defs.dir)?;
        eprintln!(
            "• {} tool definitions loaded from {}",
            registry.len(),
            args.defs.dir.display()
        );

        let script = crate::scripted::Script::load(script)?;
        let model_name = script.model().to_string();
        let model = crate::scripted::ScriptedServer::start("127.0.0.1:0".parse()?, script).await?;
        eprintln!(
            "• model: the scripted stand-in server at {} (not a real model)",
            model.base_url()
        );

        let work = tempfile::tempdir()?;
        eprint!("• indexing {} … ", args.corpus.display());
        let _ = std::io::stderr().flush();
        let stats = crate::index::DocumentIndex::build(&args.corpus, &work.path().join("index"))?;
        eprintln!("{} documents, {} passages", stats.documents, stats.passages);

        let subjects = crate::protocol::Subjects::new(crate::protocol::DEFAULT_PREFIX)?;
        // The scripted stand-in plays the model of the one default profile.
        let profiles = crate::profiles::FleetConfig::single(crate::profiles::Deployment::new(
            model.base_url(),
            model_name,
        ));
        let mut orchestrator = OrchestratorConfig::new(subjects.clone(), profiles);
        orchestrator.max_in_flight = max_in_flight;
        let spec = FleetSpec {
            nats_url: servers.nats_url.clone(),
            redis_url: servers.redis_url.clone(),
            subjects: subjects.clone(),
            citation_ttl: Duration::from_secs(3600),
            registry,
            orchestrator: Some(orchestrator),
            workers: vec![WorkerKind::System, WorkerKind::Retrieval],
            worker_concurrency: max_in_flight,
            index: Some(IndexPaths {
                index_dir: work.path().join("index"),
                corpus_dir: args.corpus.clone(),
            }),
        };
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let metrics = prometheus::Registry::new();
        eprint!("• starting the orchestrator and the system and retrieval workers … ");
        crate::fleet::start(spec, &metrics, &tracker, shutdown.clone()).await?;
        eprintln!("ready\n");
        let client = crate::config::connect_nats(
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
        match ask(&fleet.client, &fleet.subjects, q, Duration::from_secs(60)).await {
            Ok(answer) => println!("A: {answer}\n"),
            Err(e) => {
                failures += 1;
                println!("error: {e:#}\n");
            }
        }
    }
    fleet.stop().await;
    Ok(if failures == 0 { 0 } else { 1 })
}

async fn bench(args: BenchArgs) -> anyhow::Result<i32> {
    eprintln!("toolfleet bench: chat jobs through a local fleet (scripted stand-in model)");
    let fleet = LocalFleet::start(&args.local, &args.script, args.concurrency).await?;
    let questions: Vec<String> = DEMO_QUESTIONS.iter().map(|q| q.to_string()).collect();
    // Warm up: the first jobs pay for connections and lazy start-up.
    let slow = Duration::from_millis(args.slow_ms);
    let _ = crate::bench::run(
        &fleet.client,
        &fleet.subjects,
        &questions,
        args.concurrency.min(args.jobs),
        args.concurrency,
        Duration::from_secs(60),
        slow,
    )
    .await;
    let report = crate::bench::run(
        &fleet.client,
        &fleet.subjects,
        &questions,
        args.jobs,
        args.concurrency,
        Duration::from_secs(120),
        slow,
    )
    .await;
    fleet.stop().await;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{report}");
    }
    Ok(if report.failed == 0 { 0 } else { 1 })
}

async fn up(args: UpArgs) -> anyhow::Result<i32> {
    let subjects = crate::config::or_exit(args.nats.subjects().map_err(Into::into));
    let registry = crate::config::or_exit(crate::fleet::load_registry(&args.defs.dir));
    let mut orchestrator = OrchestratorConfig::new(
        subjects.clone(),
        crate::config::or_exit(args.llm.fleet_config()),
    );
    orchestrator.max_in_flight = args.max_in_flight;
    let spec = FleetSpec {
        nats_url: args.nats.url.clone(),
        redis_url: args.redis.url.clone(),
        subjects,
        citation_ttl: Duration::from_secs(args.redis.ttl_secs),
        registry,
        orchestrator: Some(orchestrator),
        workers: vec![WorkerKind::System, WorkerKind::Retrieval],
        worker_concurrency: args.concurrency,
        index: Some(IndexPaths {
            index_dir: args.index_dir.clone(),
            corpus_dir: args.corpus_dir.clone(),
        }),
    };
    crate::fleet::serve_until_signal(spec, args.metrics_addr).await?;
    Ok(0)
}

fn tools(command: ToolsCommand) -> anyhow::Result<i32> {
    match command {
        ToolsCommand::List(defs) => {
            let registry = crate::fleet::load_registry(&defs.dir)?;
            for d in registry.iter() {
                println!(
                    "{:<40} {:<20} {}",
                    d.id.to_string(),
                    d.function.name,
                    d.title
                );
            }
            Ok(0)
        }
        ToolsCommand::Show { tool, defs } => {
            let registry = crate::fleet::load_registry(&defs.dir)?;
            let def = match tool.parse::<crate::tools::ToolId>() {
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
        ToolsCommand::Validate { paths, defs } => {
            let paths = if paths.is_empty() {
                vec![defs.dir]
            } else {
                paths
            };
            let mut bad = 0;
            for p in paths {
                let result = if p.is_dir() {
                    crate::tools::load_dir(&p).map(|d| d.len())
                } else {
                    crate::tools::load_file(&p).map(|_| 1)
                };
                match result {
                    Ok(n) => println!("ok   {} ({n} definition(s))", p.display()),
                    Err(e) => {
                        bad += 1;
                        println!("FAIL {}: {e}", p.display());
                    }
                }
            }
            Ok(if bad == 0 { 0 } else { 1 })
        }
    }
}

fn index(command: IndexCommand) -> anyhow::Result<i32> {
    match command {
        IndexCommand::Build { corpus, index } => {
            let stats = crate::index::DocumentIndex::build(&corpus, &index)?;
            println!(
                "indexed {} documents ({} passages) into {}",
                stats.documents,
                stats.passages,
                index.display()
            );
            Ok(0)
        }
        IndexCommand::Search {
            query,
            index,
            limit,
        } => {
            let idx = crate::index::DocumentIndex::open(&index)?;
            for h in idx.search(&query, limit)? {
                println!(
                    "{:.3}  {}  {}\n       {}",
                    h.score, h.source, h.title, h.snippet
                );
            }
            Ok(0)
        }
    }
}
