//! Truthful health: `/livez` answers while the process runs; `/readyz`
//! answers 200 only when every readiness check passes — NATS connected,
//! Redis answering where the process uses it, its consumers in place —
//! and 503 naming the failing ones otherwise. The same checks drive the
//! `toolfleet_nats_connected` / `toolfleet_redis_connected` gauges and the
//! NATS reconnect counter, refreshed in the background so a scrape during
//! an outage reads them without waiting on anything.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use prometheus::{IntCounter, IntGauge, Registry};
use tokio_util::sync::CancellationToken;

/// How long one check may take before it counts as failed.
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(2);
/// How often the connection gauges are refreshed.
pub const REFRESH: Duration = Duration::from_secs(2);

type CheckFn = Arc<dyn Fn() -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// A readiness check's answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckResult {
    pub name: String,
    pub result: Result<(), String>,
}

/// The process's readiness checks. Cheap to clone; parts add their checks
/// as they start.
#[derive(Clone, Default)]
pub struct Health {
    checks: Arc<Mutex<Vec<(String, CheckFn)>>>,
}

impl Health {
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds the check `name`: `Ok` when ready, `Err` saying why not.
    pub fn check<F, Fut>(&self, name: impl Into<String>, check: F)
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = Result<(), String>> + Send + 'static,
    {
        let f: CheckFn = Arc::new(move || check().boxed());
        if let Ok(mut checks) = self.checks.lock() {
            checks.push((name.into(), f));
        }
    }

    /// Whether `client` is connected (no round trip: the client's state).
    pub fn nats(&self, client: &async_nats::Client) {
        let client = client.clone();
        self.check("nats", move || {
            let state = client.connection_state();
            async move {
                match state {
                    async_nats::connection::State::Connected => Ok(()),
                    other => Err(format!("NATS is {other:?}")),
                }
            }
        });
    }

    /// Runs every check (each under [`CHECK_TIMEOUT`], all at once).
    pub async fn run(&self) -> Vec<CheckResult> {
        let checks: Vec<(String, CheckFn)> =
            self.checks.lock().map(|c| c.clone()).unwrap_or_default();
        futures::future::join_all(checks.into_iter().map(|(name, check)| async move {
            let result = match tokio::time::timeout(CHECK_TIMEOUT, check()).await {
                Ok(r) => r,
                Err(_) => Err(format!("no answer within {} s", CHECK_TIMEOUT.as_secs())),
            };
            CheckResult { name, result }
        }))
        .await
    }
}

/// The connection metrics: `toolfleet_nats_connected`,
/// `toolfleet_redis_connected` (1 or 0) and `toolfleet_nats_reconnects_total`
/// (`toolfleet_build_info` is the process's:
/// [`crate::metrics::register_process`]).
#[derive(Clone)]
pub struct ConnectionMetrics {
    pub nats_connected: IntGauge,
    pub redis_connected: IntGauge,
    pub nats_reconnects: IntCounter,
}

impl ConnectionMetrics {
    /// Registers them on `registry`.
    ///
    /// # Errors
    ///
    /// A metric already registered.
    pub fn register(registry: &Registry) -> prometheus::Result<Self> {
        let nats_connected = IntGauge::new(
            "toolfleet_nats_connected",
            "1 while this process is connected to NATS, else 0.",
        )?;
        let redis_connected = IntGauge::new(
            "toolfleet_redis_connected",
            "1 while Redis answers this process (for processes that use it), else 0.",
        )?;
        let nats_reconnects = IntCounter::new(
            "toolfleet_nats_reconnects_total",
            "Times this process reconnected to NATS after losing it.",
        )?;
        for c in [
            Box::new(nats_connected.clone()) as Box<dyn prometheus::core::Collector>,
            Box::new(redis_connected.clone()),
            Box::new(nats_reconnects.clone()),
        ] {
            registry.register(c)?;
        }
        Ok(Self {
            nats_connected,
            redis_connected,
            nats_reconnects,
        })
    }

    /// Refreshes the gauges from `client` (and `redis`, a ping) every
    /// [`REFRESH`] until `shutdown`.
    pub fn watch(
        self,
        client: async_nats::Client,
        redis: Option<Arc<dyn Fn() -> BoxFuture<'static, bool> + Send + Sync>>,
        shutdown: CancellationToken,
    ) {
        tokio::spawn(async move {
            let stats = client.statistics();
            let mut seen_connects = 1u64;
            loop {
                let connected =
                    client.connection_state() == async_nats::connection::State::Connected;
                self.nats_connected.set(i64::from(connected));
                let connects = stats.connects.load(std::sync::atomic::Ordering::Relaxed);
                if connects > seen_connects {
                    self.nats_reconnects.inc_by(connects - seen_connects);
                    seen_connects = connects;
                }
                if let Some(ping) = &redis {
                    let up = tokio::time::timeout(CHECK_TIMEOUT, ping())
                        .await
                        .unwrap_or(false);
                    self.redis_connected.set(i64::from(up));
                }
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(REFRESH) => {}
                }
            }
        });
    }
}

/// A ping: `Ok` when the service answers.
pub type Ping = Arc<dyn Fn() -> BoxFuture<'static, Result<(), String>> + Send + Sync>;

/// A [`Ping`] from a cloneable handle and its async check, e.g.
/// `ping(store.clone(), |s| async move { s.ping().await })`.
pub fn ping<S, Fut, E>(state: S, check: fn(S) -> Fut) -> Ping
where
    S: Clone + Send + Sync + 'static,
    Fut: Future<Output = Result<(), E>> + Send + 'static,
    E: std::fmt::Display,
{
    Arc::new(move || {
        let fut = check(state.clone());
        async move { fut.await.map_err(|e| e.to_string()) }.boxed()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn every_check_runs_and_a_slow_one_fails() {
        let health = Health::new();
        health.check("ok", || async { Ok(()) });
        health.check("bad", || async { Err("down".to_string()) });
        health.check("slow", || async {
            tokio::time::sleep(Duration::from_secs(60)).await;
            Ok(())
        });
        tokio::time::pause();
        let results = health.run().await;
        assert_eq!(results[0].result, Ok(()));
        assert_eq!(results[1].result, Err("down".into()));
        assert!(
            results[2]
                .result
                .as_ref()
                .unwrap_err()
                .contains("no answer")
        );
    }
}
