//! Logs and traces for every fleet process.
//!
//! - **Logs** go to stderr as text (ANSI colours only when stderr is a
//!   terminal) or as one JSON object per line (`--log-format json`,
//!   `TOOLFLEET_LOG_FORMAT=json`), filtered by `TOOLFLEET_LOG`.
//! - **Traces** are exported over OTLP/HTTP (protobuf by default, JSON with
//!   `OTEL_EXPORTER_OTLP_PROTOCOL=http/json`) when an endpoint is configured
//!   (`--otlp-endpoint` or the standard `OTEL_EXPORTER_OTLP_ENDPOINT` /
//!   `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`; `OTEL_SDK_DISABLED=true` turns
//!   them off again). With no endpoint no OpenTelemetry layer is installed
//!   at all: tracing spans cost what they cost without it. Spans are batched
//!   on a thread of their own and sent by the process's Tokio runtime; an
//!   endpoint that is down loses spans (logged by the SDK), never work.
//! - **Context** travels as a W3C `traceparent`: [`set_parent`] makes a span
//!   the child of one a message carried, [`traceparent`] gives the one to
//!   put on the next message or HTTP request. With tracing off the incoming
//!   `traceparent` is passed on as it came (so ids still correlate logs
//!   across processes) and [`new_traceparent`] starts one where none came.

use std::io::IsTerminal;
use std::time::Duration;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// The log filter's variable (`info`, `toolfleet=debug,warn`, ...).
pub const ENV_LOG: &str = "TOOLFLEET_LOG";
/// The log format's variable: `text` or `json`.
pub const ENV_LOG_FORMAT: &str = "TOOLFLEET_LOG_FORMAT";
/// The standard OTLP endpoint variable; `/v1/traces` is appended.
pub const ENV_OTLP_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
/// The standard traces-only endpoint variable, used as it is.
pub const ENV_OTLP_TRACES_ENDPOINT: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";

/// How log lines are written.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line (`timestamp`, `level`, `fields`, `target`,
    /// `span`, `spans`).
    Json,
}

/// Logging and tracing flags every fleet binary takes.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct TelemetryArgs {
    /// Log line format on stderr.
    #[arg(long, env = ENV_LOG_FORMAT, value_enum, default_value_t = LogFormat::Text, global = true)]
    pub log_format: LogFormat,
    /// OTLP/HTTP collector base URL (e.g. `http://otel-collector:4318`);
    /// traces go to `<url>/v1/traces`. Off when unset.
    #[arg(long, env = ENV_OTLP_ENDPOINT, value_name = "URL", global = true)]
    pub otlp_endpoint: Option<String>,
}

/// The installed telemetry. [`Telemetry::shutdown`] sends the spans still
/// batched; call it before the process exits.
#[must_use = "call shutdown() before exiting, or batched spans are lost"]
pub struct Telemetry {
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl std::fmt::Debug for Telemetry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Telemetry")
            .field("tracing", &self.provider.is_some())
            .finish()
    }
}

impl Telemetry {
    /// Whether spans are exported.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Flushes batched spans and stops the exporter (bounded: the SDK gives
    /// up after 5 s, and so does this after a little more).
    pub async fn shutdown(self) {
        if let Some(provider) = self.provider {
            let flushed = tokio::task::spawn_blocking(move || provider.shutdown());
            let _ = tokio::time::timeout(Duration::from_secs(6), flushed).await;
        }
    }
}

/// Installs the subscriber: the log filter (`TOOLFLEET_LOG`, else
/// `default_filter`), the log format, and — when an OTLP endpoint is
/// configured — a span exporter naming the process `service`
/// (`OTEL_SERVICE_NAME` overrides it). Must run inside a Tokio runtime.
/// A second call does nothing.
pub fn init(service: &'static str, default_filter: &str, args: &TelemetryArgs) -> Telemetry {
    let filter = tracing_subscriber::EnvFilter::try_from_env(ENV_LOG)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let ansi = std::io::stderr().is_terminal();
    let fmt = match args.log_format {
        LogFormat::Text => tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_ansi(ansi)
            .boxed(),
        LogFormat::Json => tracing_subscriber::fmt::layer()
            .json()
            .with_writer(std::io::stderr)
            .with_ansi(false)
            .boxed(),
    };
    let (provider, setup_error) = match exporter(service, args) {
        Ok(p) => (p, None),
        Err(e) => (None, Some(e)),
    };
    // Spans are exported at INFO and above whatever the log filter says
    // (an interactive command logs only warnings, yet its span starts the
    // trace).
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer(service))
            .with_tracked_inactivity(false)
            .with_filter(tracing_subscriber::filter::LevelFilter::INFO)
    });
    let installed = tracing_subscriber::registry()
        .with(otel)
        .with(fmt.with_filter(filter))
        .try_init()
        .is_ok();
    if !installed {
        return Telemetry { provider: None };
    }
    if let Some(e) = setup_error {
        tracing::warn!(error = %e, "traces are not exported");
    }
    if let Some(p) = &provider {
        opentelemetry::global::set_tracer_provider(p.clone());
        tracing::info!("traces are exported over OTLP");
    }
    Telemetry { provider }
}

use tracing_subscriber::Layer as _;

/// The OTLP exporter, when one is configured.
fn exporter(
    service: &'static str,
    args: &TelemetryArgs,
) -> Result<Option<opentelemetry_sdk::trace::SdkTracerProvider>, String> {
    use opentelemetry_otlp::{WithExportConfig, WithHttpConfig};
    if std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true")) {
        return Ok(None);
    }
    let traces_env = std::env::var(ENV_OTLP_TRACES_ENDPOINT)
        .ok()
        .filter(|v| !v.trim().is_empty());
    let base = args
        .otlp_endpoint
        .as_deref()
        .map(str::trim)
        .filter(|v| !v.is_empty());
    if traces_env.is_none() && base.is_none() {
        return Ok(None);
    }
    // Checked here, so no error below can quote a URL with a password.
    for url in traces_env.as_deref().into_iter().chain(base) {
        let parsed = url::Url::parse(url).map_err(|e| {
            format!(
                "bad OTLP endpoint {}: {e}",
                toolfleet_protocol::redact::redact_url(url)
            )
        })?;
        if !matches!(parsed.scheme(), "http" | "https") {
            return Err(format!(
                "the OTLP endpoint {} is not http(s)",
                toolfleet_protocol::redact::redact_url(url)
            ));
        }
        if !parsed.username().is_empty() || parsed.password().is_some() {
            return Err(format!(
                "the OTLP endpoint {} carries credentials, which are not sent: give them in \
                 OTEL_EXPORTER_OTLP_HEADERS (e.g. authorization=Basic …)",
                toolfleet_protocol::redact::redact_url(url)
            ));
        }
    }
    let handle = tokio::runtime::Handle::try_current()
        .map_err(|_| "no Tokio runtime to send spans from".to_string())?;
    let _ = rustls::crypto::ring::default_provider().install_default();
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .connect_timeout(Duration::from_secs(3))
        .build()
        .map_err(|e| format!("cannot build the OTLP HTTP client: {e}"))?;
    let mut builder = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_http_client(RuntimeClient { client, handle });
    // The spec's default, protobuf, unless a protocol variable says
    // otherwise (the exporter reads those itself).
    if [
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
        "OTEL_EXPORTER_OTLP_PROTOCOL",
    ]
    .iter()
    .all(|v| std::env::var(v).is_err())
    {
        builder = builder.with_protocol(opentelemetry_otlp::Protocol::HttpBinary);
    }
    // The traces variable wins over the base URL (the exporter reads it
    // itself); the base URL gets the signal path, as the spec says.
    if traces_env.is_none()
        && let Some(base) = base
    {
        let endpoint = format!("{}/v1/traces", base.trim_end_matches('/'));
        url::Url::parse(&endpoint).map_err(|e| {
            format!(
                "bad OTLP endpoint {}: {e}",
                toolfleet_protocol::redact::redact_url(&endpoint)
            )
        })?;
        builder = builder.with_endpoint(endpoint);
    }
    let exporter = builder
        .build()
        .map_err(|e| format!("cannot build the OTLP exporter: {e}"))?;
    let service_name = std::env::var("OTEL_SERVICE_NAME")
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| service.to_string());
    let resource = opentelemetry_sdk::Resource::builder()
        .with_service_name(service_name)
        .with_attribute(opentelemetry::KeyValue::new(
            "service.version",
            crate::build::get().version,
        ))
        .build();
    Ok(Some(
        opentelemetry_sdk::trace::SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource)
            .build(),
    ))
}

/// Sends the exporter's requests with our reqwest client on the process's
/// runtime: the SDK's batch thread has no runtime of its own, and a second
/// HTTP stack (reqwest's blocking client) is not worth its build.
#[derive(Debug)]
struct RuntimeClient {
    client: reqwest::Client,
    handle: tokio::runtime::Handle,
}

#[async_trait::async_trait]
impl opentelemetry_http::HttpClient for RuntimeClient {
    async fn send_bytes(
        &self,
        request: http::Request<bytes::Bytes>,
    ) -> Result<http::Response<bytes::Bytes>, opentelemetry_http::HttpError> {
        let request = reqwest::Request::try_from(request)?;
        let client = self.client.clone();
        let sent = self.handle.spawn(async move {
            let response = client.execute(request).await?;
            let status = response.status();
            let headers = response.headers().clone();
            let body = response.bytes().await?;
            let mut answer = http::Response::new(body);
            *answer.status_mut() = status;
            *answer.headers_mut() = headers;
            Ok::<_, reqwest::Error>(answer)
        });
        // Only the status line may echo the URL: strip it from errors (an
        // endpoint's credentials stay out of logs).
        match sent.await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(e)) => Err(format!("OTLP export failed: {}", e.without_url()).into()),
            Err(e) => Err(format!("OTLP export stopped: {e}").into()),
        }
    }
}

/// Makes `span` the child of the span a message's `traceparent` names. An
/// absent or malformed value leaves `span` a root. Does nothing when
/// tracing is off.
pub fn set_parent(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(tp) = traceparent.filter(|tp| is_traceparent(tp)) else {
        return;
    };
    let carrier = std::collections::HashMap::from([("traceparent".to_string(), tp.to_string())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// Continues in `span` the trace a message's `traceparent` names (or
/// starts one), records the trace's id in its `trace_id` field, and
/// returns the `traceparent` naming `span` for the next hop — a fresh one
/// when there is none and tracing is off. The one way a process picks up a
/// trace from a message.
pub fn continue_trace(span: &tracing::Span, incoming: Option<&str>) -> String {
    set_parent(span, incoming);
    let traceparent = traceparent(span, incoming).unwrap_or_else(new_traceparent);
    if let Some(id) = trace_id(&traceparent) {
        span.record("trace_id", id);
    }
    traceparent
}

/// The `traceparent` naming `span`, for the next message or request; with
/// tracing off (the span has no OpenTelemetry context) `incoming`, when it
/// is a valid one, else `None`.
pub fn traceparent(span: &tracing::Span, incoming: Option<&str>) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    if sc.is_valid() {
        return Some(format!(
            "00-{}-{}-{:02x}",
            sc.trace_id(),
            sc.span_id(),
            sc.trace_flags().to_u8()
        ));
    }
    incoming.filter(|tp| is_traceparent(tp)).map(str::to_string)
}

/// The trace id (32 hex digits) of a `traceparent`.
pub fn trace_id(traceparent: &str) -> Option<&str> {
    is_traceparent(traceparent).then(|| &traceparent[3..35])
}

/// A fresh `traceparent` (random trace and span ids, sampled), for a
/// message that starts a trace while tracing is off.
pub fn new_traceparent() -> String {
    let trace = uuid::Uuid::new_v4().simple().to_string();
    let span = &uuid::Uuid::new_v4().simple().to_string()[..16];
    format!("00-{trace}-{span}-01")
}

/// Whether `v` is a W3C `traceparent` we can continue: version `00`,
/// lowercase hex ids that are not all zero.
pub fn is_traceparent(v: &str) -> bool {
    let b = v.as_bytes();
    let hex = |s: &[u8]| {
        s.iter()
            .all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(c))
    };
    b.len() == 55
        && &b[..3] == b"00-"
        && b[35] == b'-'
        && b[52] == b'-'
        && hex(&b[3..35])
        && hex(&b[36..52])
        && hex(&b[53..55])
        && b[3..35].iter().any(|&c| c != b'0')
        && b[36..52].iter().any(|&c| c != b'0')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_are_checked_before_they_are_continued() {
        let good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        assert!(is_traceparent(good));
        assert_eq!(trace_id(good), Some("0af7651916cd43dd8448eb211c80319c"));
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-0g",
        ] {
            assert!(!is_traceparent(bad), "{bad}");
            assert_eq!(trace_id(bad), None);
        }
        let fresh = new_traceparent();
        assert!(is_traceparent(&fresh), "{fresh}");
        assert_ne!(trace_id(&fresh), trace_id(&new_traceparent()));
    }

    #[test]
    fn endpoints_with_credentials_are_refused_without_showing_them() {
        let args = TelemetryArgs {
            log_format: LogFormat::Text,
            otlp_endpoint: Some("http://user:hunter2@collector:4318".into()),
        };
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let _in_rt = rt.enter();
        let e = exporter("test", &args).expect_err("credentials");
        assert!(e.contains("OTEL_EXPORTER_OTLP_HEADERS"), "{e}");
        assert!(!e.contains("hunter2"), "{e}");
        let args = TelemetryArgs {
            otlp_endpoint: Some("ftp://collector".into()),
            ..args
        };
        assert!(
            exporter("test", &args)
                .expect_err("ftp")
                .contains("not http(s)")
        );
    }

    #[test]
    fn with_tracing_off_the_incoming_traceparent_passes_through() {
        let span = tracing::info_span!("job");
        let good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        set_parent(&span, Some(good));
        assert_eq!(traceparent(&span, Some(good)).as_deref(), Some(good));
        assert_eq!(traceparent(&span, Some("garbage")), None);
        assert_eq!(traceparent(&span, None), None);
    }
}
