//! The life of a fleet process after its configuration is parsed: serve
//! `/metrics`, start the parts, wait for SIGINT or SIGTERM, stop taking
//! work, and drain within [`GRACE_PERIOD`].

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::Context;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

/// How long a process waits for work in flight after SIGTERM.
pub const GRACE_PERIOD: Duration = Duration::from_secs(30);

/// What a process's parts get to start with: the metrics registry they
/// register on, the tracker their tasks run on, and the token that stops
/// them.
#[derive(Clone)]
pub struct Runtime {
    pub metrics: prometheus::Registry,
    pub tracker: TaskTracker,
    pub shutdown: CancellationToken,
}

impl Runtime {
    pub fn new() -> Self {
        Self {
            metrics: prometheus::Registry::new(),
            tracker: TaskTracker::new(),
            shutdown: CancellationToken::new(),
        }
    }

    /// Stops taking work and waits for the tasks in flight, at most
    /// `grace`. Returns whether everything finished.
    pub async fn drain(&self, grace: Duration) -> bool {
        self.shutdown.cancel();
        self.tracker.close();
        tokio::time::timeout(grace, self.tracker.wait())
            .await
            .is_ok()
    }
}

impl Default for Runtime {
    fn default() -> Self {
        Self::new()
    }
}

/// What every fleet binary does after parsing its configuration: bind
/// `metrics_addr`, run `start` (which returns once its parts are taking
/// work), then serve `/metrics` and `/healthz` there, wait for SIGINT or
/// SIGTERM, stop taking work, and drain within [`GRACE_PERIOD`].
pub async fn serve_until_signal<F, Fut>(metrics_addr: SocketAddr, start: F) -> anyhow::Result<()>
where
    F: FnOnce(Runtime) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    let runtime = Runtime::new();
    // Bind first (a taken port is a start-up error before any work), serve
    // once the parts take work: an answering /healthz means ready.
    let listener = tokio::net::TcpListener::bind(metrics_addr)
        .await
        .with_context(|| format!("serving metrics on {metrics_addr}"))?;
    let addr = listener.local_addr()?;
    start(runtime.clone()).await?;
    {
        let (registry, shutdown) = (runtime.metrics.clone(), runtime.shutdown.clone());
        tokio::spawn(async move {
            if let Err(e) = crate::metrics::serve(listener, registry, shutdown).await {
                tracing::error!(error = %e, "metrics endpoint stopped");
            }
        });
    }
    tracing::info!(metrics = %addr, "running; SIGTERM or Ctrl-C to stop");
    crate::args::shutdown_signal().await;
    tracing::info!("stopping: no new jobs; finishing those in flight");
    if !runtime.drain(GRACE_PERIOD).await {
        tracing::warn!("grace period over; exiting with jobs in flight (they will be redelivered)");
    }
    Ok(())
}
