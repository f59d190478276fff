//! The life of a fleet process after its configuration is parsed: raise the
//! open-file limit, serve `/metrics`, start the parts, wait for SIGINT or
//! SIGTERM, stop taking work, and drain within [`GRACE_PERIOD`].

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use std::sync::Arc;

use anyhow::Context;
use futures::FutureExt;
use futures::future::BoxFuture;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::health::{ConnectionMetrics, Ping};

/// How long a process waits for work in flight after SIGTERM.
pub const GRACE_PERIOD: Duration = Duration::from_secs(30);

/// What a process's parts get to start with: the metrics registry they
/// register on, the tracker their tasks run on, and the token that stops
/// them.
#[derive(Clone)]
pub struct Runtime {
    pub metrics: prometheus::Registry,
    /// The readiness checks `/readyz` runs; parts add theirs as they start.
    pub health: crate::health::Health,
    pub tracker: TaskTracker,
    pub shutdown: CancellationToken,
}

impl Runtime {
    pub fn new() -> Self {
        Self {
            metrics: prometheus::Registry::new(),
            health: crate::health::Health::new(),
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
/// work), then serve `/metrics` (with `toolfleet_build_info` and the
/// `process_*` metrics) and `/healthz` there, wait for SIGINT or
/// SIGTERM, stop taking work, and drain within [`GRACE_PERIOD`].
pub async fn serve_until_signal<F, Fut>(metrics_addr: SocketAddr, start: F) -> anyhow::Result<()>
where
    F: FnOnce(Runtime) -> Fut,
    Fut: Future<Output = anyhow::Result<()>>,
{
    raise_fd_limit();
    let runtime = Runtime::new();
    crate::metrics::register_process(&runtime.metrics)?;
    // Bind first (a taken port is a start-up error before any work), serve
    // once the parts take work: an answering /healthz means ready.
    let listener = tokio::net::TcpListener::bind(metrics_addr)
        .await
        .with_context(|| format!("serving metrics on {metrics_addr}"))?;
    let addr = listener.local_addr()?;
    start(runtime.clone()).await?;
    {
        let (registry, shutdown) = (runtime.metrics.clone(), runtime.shutdown.clone());
        let health = runtime.health.clone();
        tokio::spawn(async move {
            if let Err(e) = crate::metrics::serve_with(listener, registry, health, shutdown).await {
                tracing::error!(error = %e, "metrics endpoint stopped");
            }
        });
    }
    let build = crate::build::get();
    tracing::info!(
        metrics = %addr,
        version = build.version,
        revision = build.revision,
        "running; SIGTERM or Ctrl-C to stop"
    );
    crate::args::shutdown_signal().await;
    tracing::info!("stopping: no new jobs; finishing those in flight");
    if !runtime.drain(GRACE_PERIOD).await {
        tracing::warn!("grace period over; exiting with jobs in flight (they will be redelivered)");
    }
    Ok(())
}

/// Below this many open files a long-lived process says so at start: every
/// chat job in flight holds a connection to the model, and every open
/// file (a socket, a stream's file) counts.
pub const LOW_FD_LIMIT: u64 = 4096;

/// The open-file limits of this process after [`raise_fd_limit`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FdLimit {
    /// The soft limit in force (`None`: unlimited).
    pub soft: Option<u64>,
    /// The hard limit (`None`: unlimited).
    pub hard: Option<u64>,
    /// Whether this call raised the soft limit.
    pub raised: bool,
}

impl FdLimit {
    /// Whether the soft limit is below [`LOW_FD_LIMIT`].
    pub fn is_low(&self) -> bool {
        self.soft.is_some_and(|s| s < LOW_FD_LIMIT)
    }
}

/// Raises this process's soft limit on open files to its hard limit, as
/// long-lived servers do (a default soft limit of 1024 is a few hundred
/// chat jobs in flight: the bench saw `Too many open files` from the
/// model client). Logs the outcome, and warns when the limit stays below
/// [`LOW_FD_LIMIT`] (raise the hard limit: `ulimit -Hn`, systemd
/// `LimitNOFILE=`, Docker `--ulimit nofile=`). [`serve_until_signal`]
/// calls it; other long-lived commands call it themselves.
pub fn raise_fd_limit() -> FdLimit {
    let limit = raise_soft_to_hard();
    let show = |v: Option<u64>| v.map_or("unlimited".to_string(), |v| v.to_string());
    if limit.is_low() {
        tracing::warn!(
            soft = %show(limit.soft),
            hard = %show(limit.hard),
            "the open-file limit is low: each chat job in flight holds a connection; \
             raise the hard limit (ulimit -Hn, LimitNOFILE=, --ulimit nofile=)"
        );
    } else {
        tracing::debug!(soft = %show(limit.soft), hard = %show(limit.hard), raised = limit.raised, "open-file limit");
    }
    limit
}

#[cfg(unix)]
fn raise_soft_to_hard() -> FdLimit {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let old = getrlimit(Resource::Nofile);
    let wanted = |soft: Option<u64>| match (soft, old.maximum) {
        (None, _) => false,
        (Some(_), None) => true,
        (Some(s), Some(h)) => s < h,
    };
    if !wanted(old.current) {
        return FdLimit {
            soft: old.current,
            hard: old.maximum,
            raised: false,
        };
    }
    let new = Rlimit {
        current: old.maximum,
        maximum: old.maximum,
    };
    // macOS refuses a soft limit above OPEN_MAX even under an unlimited
    // hard limit: keep the old one then.
    let raised = setrlimit(Resource::Nofile, new).is_ok();
    let now = getrlimit(Resource::Nofile);
    FdLimit {
        soft: now.current,
        hard: now.maximum,
        raised: raised && now.current != old.current,
    }
}

#[cfg(not(unix))]
fn raise_soft_to_hard() -> FdLimit {
    FdLimit {
        soft: None,
        hard: None,
        raised: false,
    }
}

impl Runtime {
    /// Wires a process's connections into its health: readiness checks for
    /// NATS (and Redis, given its `ping`), the connection gauges and reconnect
    /// counter on its registry, refreshed until it shuts down.
    ///
    /// # Errors
    ///
    /// A metric already registered.
    pub fn watch_connections(
        &self,
        client: &async_nats::Client,
        redis: Option<Ping>,
    ) -> prometheus::Result<()> {
        let (health, registry, shutdown) = (&self.health, &self.metrics, self.shutdown.clone());
        health.nats(client);
        if let Some(ping) = &redis {
            let ping = ping.clone();
            health.check("redis", move || ping());
        }
        let metrics = ConnectionMetrics::register(registry)?;
        let redis_up = redis.map(|ping| {
            let f: Arc<dyn Fn() -> BoxFuture<'static, bool> + Send + Sync> = Arc::new(move || {
                let ping = ping.clone();
                async move { ping().await.is_ok() }.boxed()
            });
            f
        });
        metrics.watch(client.clone(), redis_up, shutdown);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_fd_limit_ends_at_the_hard_limit() {
        let first = raise_fd_limit();
        assert_eq!(first.soft, first.hard, "{first:?}");
        // Idempotent: nothing left to raise.
        let again = raise_fd_limit();
        assert_eq!(again.soft, first.soft);
        assert!(!again.raised);
    }

    #[test]
    fn a_low_limit_is_named() {
        let low = FdLimit {
            soft: Some(1024),
            hard: Some(1024),
            raised: false,
        };
        assert!(low.is_low());
        let unlimited = FdLimit {
            soft: None,
            hard: None,
            raised: false,
        };
        assert!(!unlimited.is_low());
    }
}
