//! Prometheus plumbing every process shares: registration helpers for the
//! metric structs each subsystem owns (registered on a registry that is
//! passed in, never a global), and the `/metrics` + `/healthz` endpoint.
//!
//! Labels have bounded cardinality: tool ids, models, outcomes, kinds —
//! never an invocation id, a user or anything secret.

use std::net::SocketAddr;

use prometheus::{
    Encoder, HistogramOpts, HistogramVec, IntCounterVec, Opts, Registry, TextEncoder,
};
use tokio_util::sync::CancellationToken;

pub const LATENCY_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
];

/// Registers `metric` on `r` and hands it back: one line per metric in a
/// registration table.
///
/// # Errors
///
/// A metric of the same name already registered.
pub fn registered<M: prometheus::core::Collector + Clone + 'static>(
    r: &Registry,
    metric: M,
) -> prometheus::Result<M> {
    r.register(Box::new(metric.clone()))?;
    Ok(metric)
}

pub fn counter(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<IntCounterVec> {
    let c = IntCounterVec::new(Opts::new(name, help), labels)?;
    r.register(Box::new(c.clone()))?;
    Ok(c)
}

pub fn histogram(
    r: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> prometheus::Result<HistogramVec> {
    let h = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(LATENCY_BUCKETS.to_vec()),
        labels,
    )?;
    r.register(Box::new(h.clone()))?;
    Ok(h)
}

/// `toolfleet_dead_letters_total{kind, tool}`: registered once per
/// registry and shared by the orchestrator (`kind="chat"`, `tool=""`) and
/// the workers (`kind="tool"`, the tool's id) of a process. Each process
/// starts its own series at zero, so the first dead letter is an increase
/// an alert sees.
pub fn dead_letters(r: &Registry) -> prometheus::Result<IntCounterVec> {
    counter(
        r,
        "toolfleet_dead_letters_total",
        "Jobs terminated and published as dead letters, by kind (tool, chat) and tool (empty for chat jobs).",
        &["kind", "tool"],
    )
}

/// What a process says of itself, registered once on its registry by
/// [`crate::serve_until_signal`]: `toolfleet_build_info{version,revision}`
/// (always 1; the build [`crate::build::get`] gives) and, on Linux, the
/// standard `process_*` metrics (`process_cpu_seconds_total`,
/// `process_resident_memory_bytes`, `process_virtual_memory_bytes`,
/// `process_open_fds`, `process_max_fds`, `process_start_time_seconds`,
/// `process_threads`), read from `/proc` at each scrape.
///
/// # Errors
///
/// They are registered already.
pub fn register_process(r: &Registry) -> prometheus::Result<()> {
    let build = crate::build::get();
    let info = prometheus::IntGaugeVec::new(
        Opts::new(
            "toolfleet_build_info",
            "Always 1: the version and git revision of this process's build.",
        ),
        &["version", "revision"],
    )?;
    info.with_label_values(&[build.version, build.revision])
        .set(1);
    r.register(Box::new(info))?;
    #[cfg(target_os = "linux")]
    r.register(Box::new(
        prometheus::process_collector::ProcessCollector::for_self(),
    ))?;
    Ok(())
}

/// Renders the registry in the Prometheus text format.
pub fn render(registry: &Registry) -> String {
    let mut buf = Vec::new();
    // Encoding into a Vec only fails on invalid metric families, which
    // registration already rejects.
    let _ = TextEncoder::new().encode(&registry.gather(), &mut buf);
    String::from_utf8(buf).unwrap_or_default()
}

/// Serves `GET /metrics`, `/livez`, `/healthz` (the same as `/livez`) and
/// `/readyz` (no checks: always ready) on `listener` until `shutdown`.
pub async fn serve(
    listener: tokio::net::TcpListener,
    registry: Registry,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    serve_with(listener, registry, crate::health::Health::new(), shutdown).await
}

/// [`serve`] with the process's readiness checks: `/readyz` answers 200
/// `ready` with a line per check when all pass, 503 naming the failures
/// otherwise.
pub async fn serve_with(
    listener: tokio::net::TcpListener,
    registry: Registry,
    health: crate::health::Health,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    use axum::http::StatusCode;
    use axum::{Router, routing::get};
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move {
                    (
                        [("content-type", "text/plain; version=0.0.4")],
                        render(&registry),
                    )
                }
            }),
        )
        .route("/healthz", get(|| async { "ok" }))
        .route("/livez", get(|| async { "ok" }))
        .route(
            "/readyz",
            get(move || {
                let health = health.clone();
                async move {
                    let results = health.run().await;
                    let ready = results.iter().all(|r| r.result.is_ok());
                    let mut body = String::from(if ready { "ready\n" } else { "not ready\n" });
                    for r in &results {
                        match &r.result {
                            Ok(()) => body.push_str(&format!("ok   {}\n", r.name)),
                            Err(e) => body.push_str(&format!("FAIL {}: {e}\n", r.name)),
                        }
                    }
                    let status = if ready {
                        StatusCode::OK
                    } else {
                        StatusCode::SERVICE_UNAVAILABLE
                    };
                    (status, body)
                }
            }),
        );
    axum::serve(listener, app)
        .with_graceful_shutdown(async move { shutdown.cancelled().await })
        .await
}

/// Binds `addr` and serves metrics in a background task; returns the bound
/// address (useful with port 0).
pub async fn spawn(
    addr: SocketAddr,
    registry: Registry,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let local = listener.local_addr()?;
    tokio::spawn(async move {
        if let Err(e) = serve(listener, registry, shutdown).await {
            tracing::error!(error = %e, "metrics endpoint stopped");
        }
    });
    Ok(local)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_says_its_build_and_its_resources() {
        let r = Registry::new();
        register_process(&r).unwrap();
        let text = render(&r);
        let build = crate::build::get();
        assert!(
            text.contains(&format!(
                "toolfleet_build_info{{revision=\"{}\",version=\"{}\"}} 1",
                build.revision, build.version
            )),
            "{text}"
        );
        #[cfg(target_os = "linux")]
        for family in [
            "process_cpu_seconds_total",
            "process_resident_memory_bytes",
            "process_open_fds",
            "process_start_time_seconds",
        ] {
            let value = text
                .lines()
                .find_map(|l| l.strip_prefix(&format!("{family} ")))
                .and_then(|v| v.parse::<f64>().ok());
            assert!(value.is_some_and(|v| v >= 0.0), "{family}: {text}");
        }
        // Once per registry.
        assert!(register_process(&r).is_err());
    }
}
