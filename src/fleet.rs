//! Assembling the fleet's parts from configuration: the orchestrator, the
//! two worker kinds, and all of them in one process (`toolfleet up`, the
//! demo, the integration tests). Binaries call these same functions.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::citations::CitationStore;
use crate::index::DocumentIndex;
use crate::metrics::{OrchestratorMetrics, WorkerMetrics};
use crate::orchestrator::OrchestratorConfig;
use crate::protocol::Subjects;
use crate::tools::ToolRegistry;
use crate::worker::{ServedTool, WorkerConfig};

/// The worker binaries the fleet ships.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum WorkerKind {
    /// `system:*` tools (current date and time).
    System,
    /// `retrieval:*` tools over the document index.
    Retrieval,
}

impl WorkerKind {
    pub fn name(self) -> &'static str {
        match self {
            WorkerKind::System => "system",
            WorkerKind::Retrieval => "retrieval",
        }
    }

    /// The tool namespace this worker serves.
    pub fn namespace(self) -> &'static str {
        self.name()
    }
}

/// Loads and validates the tool definitions.
pub fn load_registry(dir: &Path) -> anyhow::Result<ToolRegistry> {
    ToolRegistry::from_dir(dir)
        .with_context(|| format!("loading tool definitions from {}", dir.display()))
}

/// Opens the index at `index_dir`, building it from `corpus_dir` first when
/// it does not exist yet.
pub fn open_or_build_index(index_dir: &Path, corpus_dir: &Path) -> anyhow::Result<DocumentIndex> {
    if !index_dir.join("meta.json").exists() {
        let stats = DocumentIndex::build(corpus_dir, index_dir)
            .with_context(|| format!("building the index from {}", corpus_dir.display()))?;
        tracing::info!(documents = stats.documents, passages = stats.passages, index = %index_dir.display(), "index built");
    }
    DocumentIndex::open(index_dir)
        .with_context(|| format!("opening the index at {}", index_dir.display()))
}

/// The tools of `kind` in the registry that this build has handlers for.
pub fn served_tools(
    kind: WorkerKind,
    registry: &ToolRegistry,
    index: Option<&DocumentIndex>,
) -> anyhow::Result<Vec<ServedTool>> {
    let mut out = Vec::new();
    for compiled in registry.iter_compiled() {
        let def = &compiled.definition;
        if def.id.namespace != kind.namespace() {
            continue;
        }
        let handler =
            crate::builtin::handler(&def.implementation_key, index).with_context(|| {
                format!(
                    "{}: no implementation for key {:?}",
                    def.id, def.implementation_key
                )
            })?;
        let compiled = registry
            .compiled_arc(&def.id)
            .with_context(|| format!("{} is not compiled", def.id))?;
        out.push(ServedTool::new(compiled, handler));
    }
    anyhow::ensure!(
        !out.is_empty(),
        "no {} tools in the tool definitions",
        kind.name()
    );
    Ok(out)
}

/// Index locations of a retrieval worker.
#[derive(Debug, Clone)]
pub struct IndexPaths {
    pub index_dir: PathBuf,
    pub corpus_dir: PathBuf,
}

/// Everything one process needs to run some or all of the fleet.
pub struct FleetSpec {
    pub nats_url: String,
    pub redis_url: String,
    pub subjects: Subjects,
    pub citation_ttl: Duration,
    pub registry: ToolRegistry,
    /// Run an orchestrator with this configuration (profiles included).
    pub orchestrator: Option<OrchestratorConfig>,
    /// Run these workers.
    pub workers: Vec<WorkerKind>,
    pub worker_concurrency: usize,
    pub index: Option<IndexPaths>,
}

/// Starts the parts of `spec` as tasks on `tracker`; they stop when
/// `shutdown` is cancelled. Returns once every part is subscribed, so jobs
/// published afterwards are taken.
pub async fn start(
    spec: FleetSpec,
    metrics: &prometheus::Registry,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let wait = Duration::from_secs(10);
    let store = CitationStore::connect(&spec.redis_url, spec.subjects.prefix(), spec.citation_ttl)
        .await
        .map_err(|e| {
            anyhow::anyhow!(
                "cannot connect to Redis at {}: {e}",
                crate::config::redact_url(&spec.redis_url)
            )
        })?;

    let dead_letters = crate::metrics::dead_letters(metrics)?;
    if !spec.workers.is_empty() {
        let worker_metrics = WorkerMetrics::register(metrics, dead_letters.clone())?;
        let index = match (&spec.index, spec.workers.contains(&WorkerKind::Retrieval)) {
            (Some(p), true) => Some(open_or_build_index(&p.index_dir, &p.corpus_dir)?),
            (None, true) => anyhow::bail!("a retrieval worker needs an index directory"),
            _ => None,
        };
        for kind in &spec.workers {
            let tools = served_tools(*kind, &spec.registry, index.as_ref())?;
            let client = crate::config::connect_nats(
                &spec.nats_url,
                &format!("toolfleet-worker-{}", kind.name()),
                wait,
            )
            .await?;
            let mut config = WorkerConfig::new(kind.name(), spec.subjects.clone());
            config.concurrency = spec.worker_concurrency;
            let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
            let (store, metrics, shutdown) =
                (store.clone(), worker_metrics.clone(), shutdown.clone());
            tracker.spawn(async move {
                if let Err(e) = crate::worker::run_with_ready(
                    client,
                    store,
                    tools,
                    config,
                    metrics,
                    shutdown,
                    Some(ready_tx),
                )
                .await
                {
                    tracing::error!(error = %e, "worker stopped");
                }
            });
            ready_rx.await.context("a worker failed to start")?;
        }
    }

    if let Some(config) = spec.orchestrator {
        let client =
            crate::config::connect_nats(&spec.nats_url, "toolfleet-orchestrator", wait).await?;
        let m = OrchestratorMetrics::register(metrics, dead_letters)?;
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let registry = spec.registry;
        tracker.spawn(async move {
            if let Err(e) = crate::orchestrator::run_with_ready(
                client,
                store,
                registry,
                config,
                m,
                shutdown,
                Some(ready_tx),
            )
            .await
            {
                tracing::error!(error = %e, "orchestrator stopped");
            }
        });
        ready_rx.await.context("the orchestrator failed to start")?;
    }
    Ok(())
}

/// How long a process waits for work in flight after SIGTERM.
pub const GRACE_PERIOD: Duration = Duration::from_secs(30);

/// What every fleet binary does after parsing its configuration: serve
/// `/metrics` on `metrics_addr`, start the parts of `spec`, wait for SIGINT
/// or SIGTERM, stop taking work, and drain within [`GRACE_PERIOD`].
pub async fn serve_until_signal(
    spec: FleetSpec,
    metrics_addr: std::net::SocketAddr,
) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let tracker = TaskTracker::new();
    let metrics = prometheus::Registry::new();
    let addr = crate::metrics::spawn(metrics_addr, metrics.clone(), shutdown.clone())
        .await
        .with_context(|| format!("serving metrics on {metrics_addr}"))?;
    start(spec, &metrics, &tracker, shutdown.clone()).await?;
    tracing::info!(metrics = %addr, "running; SIGTERM or Ctrl-C to stop");
    crate::config::shutdown_signal().await;
    tracing::info!("stopping: no new jobs; finishing those in flight");
    shutdown.cancel();
    tracker.close();
    if tokio::time::timeout(GRACE_PERIOD, tracker.wait())
        .await
        .is_err()
    {
        tracing::warn!("grace period over; exiting with jobs in flight (they will be redelivered)");
    }
    Ok(())
}
