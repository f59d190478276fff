//! The gateway's metrics, registered on the registry it is given: requests
//! by route and status, their duration (to the end of the response body:
//! a stream's whole length) and the requests in flight. Labels are the
//! route (five values) and the HTTP status: never a key, tenant, model or
//! invocation.

use std::time::Instant;

use axum::body::{Body, HttpBody};
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use futures::StreamExt;
use prometheus::{HistogramVec, IntCounterVec, IntGaugeVec, Opts, Registry};

/// The gateway's metrics.
#[derive(Clone)]
pub struct GatewayMetrics {
    requests: IntCounterVec,
    duration: HistogramVec,
    in_flight: IntGaugeVec,
}

/// Every value of the `route` label.
const ROUTES: [&str; 5] = [
    "chat_completions",
    "responses",
    "response",
    "models",
    "other",
];

impl GatewayMetrics {
    /// Registers the gateway's metrics on `r`.
    ///
    /// # Errors
    ///
    /// A metric of the same name already registered.
    pub fn register(r: &Registry) -> prometheus::Result<Self> {
        use toolfleet_service::metrics::{counter, histogram, registered};
        let in_flight = registered(
            r,
            IntGaugeVec::new(
                Opts::new(
                    "toolfleet_gateway_requests_in_flight",
                    "Gateway requests being answered (streams until their last frame), by route.",
                ),
                &["route"],
            )?,
        )?;
        for route in ROUTES {
            in_flight.with_label_values(&[route]).set(0);
        }
        Ok(Self {
            requests: counter(
                r,
                "toolfleet_gateway_requests_total",
                "Gateway requests answered, by route and HTTP status.",
                &["route", "status"],
            )?,
            duration: histogram(
                r,
                "toolfleet_gateway_request_duration_seconds",
                "Gateway requests from arrival to the end of the response body (a stream's whole length), by route.",
                &["route"],
            )?,
            in_flight,
        })
    }
}

/// The `route` label of a path.
fn route_of(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "chat_completions",
        "/v1/responses" => "responses",
        "/v1/models" => "models",
        p if p.starts_with("/v1/responses/") => "response",
        _ => "other",
    }
}

/// Counts a request while its response body lasts.
struct InFlight {
    metrics: GatewayMetrics,
    route: &'static str,
    started: Instant,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let m = &self.metrics;
        m.in_flight.with_label_values(&[self.route]).dec();
        m.duration
            .with_label_values(&[self.route])
            .observe(self.started.elapsed().as_secs_f64());
    }
}

/// The middleware that measures every request.
pub(crate) async fn track(
    State(metrics): State<GatewayMetrics>,
    request: Request,
    next: Next,
) -> Response {
    let route = route_of(request.uri().path());
    metrics.in_flight.with_label_values(&[route]).inc();
    let guard = InFlight {
        metrics: metrics.clone(),
        route,
        started: Instant::now(),
    };
    let response = next.run(request).await;
    metrics
        .requests
        .with_label_values(&[route, response.status().as_str()])
        .inc();
    // A body already whole is done now; a stream is done when it ends.
    if response.body().size_hint().exact().is_some() {
        return response;
    }
    let (parts, body) = response.into_parts();
    let body = Body::from_stream(futures::stream::unfold(
        (body.into_data_stream(), guard),
        |(mut data, guard)| async move { data.next().await.map(|chunk| (chunk, (data, guard))) },
    ));
    Response::from_parts(parts, body)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_are_a_closed_set() {
        assert_eq!(route_of("/v1/chat/completions"), "chat_completions");
        assert_eq!(route_of("/v1/responses/resp_x"), "response");
        assert_eq!(route_of("/v1/secret/tf_abc"), "other");
        for path in ["/v1/models", "/v1/responses", "/x"] {
            assert!(ROUTES.contains(&route_of(path)));
        }
    }
}
