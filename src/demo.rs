//! `toolfleet demo`: a whole fleet on this machine ([`LocalFleet`]: the
//! servers, the scripted model, an index of the corpus, the orchestrator
//! and the workers in this process) answering example questions.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use toolfleet_local::fleet::FleetSpec;
use toolfleet_orchestrator::OrchestratorConfig;

use crate::chat::{AskError, EXIT_INTERRUPTED, Progress, ask, rendered};
use crate::families::IndexArgs;
use crate::local::{LocalArgs, LocalServers};

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

/// The questions the demo asks; each matches a rule of the demo script.
pub const DEMO_QUESTIONS: [&str; 3] = [
    "What time is it, and how do lighthouses warn ships?",
    "How do honeybees find their way back to the hive?",
    "Why does sourdough bread rise without baker's yeast?",
];

/// A whole fleet on this machine: servers (reused or child processes), the
/// scripted model, an index of the corpus, the orchestrator and the
/// workers of every family in this process. (`toolfleet bench` has its
/// own, [`crate::bench_fleet`], in more shapes.)
struct LocalFleet {
    servers: LocalServers,
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
        let servers = LocalServers::start(args)?;
        let registry = crate::common::load_registry(&args.defs.dir)?;
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
        let families: Vec<String> = workers.iter().map(|w| w.name().to_string()).collect();
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
            nats: None,
            redis: None,
        };
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let metrics = prometheus::Registry::new();
        eprint!(
            "• starting the orchestrator and the {} workers … ",
            families.join(", ")
        );
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

/// `toolfleet demo`: exit 0 when every question was answered, 1 when one
/// failed, 130 when interrupted.
pub async fn run(args: DemoArgs) -> anyhow::Result<i32> {
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
