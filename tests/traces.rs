//! Traces across processes: `toolfleet chat`, the orchestrator and a worker
//! pool, each a real process exporting OTLP/HTTP to a collector stand-in
//! (an HTTP server that decodes the OTLP protobuf the way a collector
//! does), must put one chat job in one trace — client → orchestrator →
//! model call → tool call → worker — with the GenAI attributes. The model
//! request carries the trace too. And a collector that is down costs
//! nothing but the spans.

use std::collections::HashMap;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
use prost::Message;

use crate::support::{self, WAIT};

/// One span as the collector received it.
#[derive(Clone, Debug)]
struct Span {
    service: String,
    trace_id: String,
    span_id: String,
    parent: String,
    name: String,
    kind: i32,
    /// 0 unset, 1 ok, 2 error.
    status: i32,
    attributes: HashMap<String, String>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn text(v: &Option<opentelemetry_proto::tonic::common::v1::AnyValue>) -> String {
    match v.as_ref().and_then(|v| v.value.as_ref()) {
        Some(AnyValue::StringValue(s)) => s.clone(),
        Some(AnyValue::IntValue(i)) => i.to_string(),
        Some(AnyValue::BoolValue(b)) => b.to_string(),
        Some(AnyValue::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

/// The collector stand-in: `POST /v1/traces` (protobuf), spans kept.
struct Collector {
    url: String,
    spans: Arc<Mutex<Vec<Span>>>,
    _task: tokio::task::JoinHandle<()>,
}

impl Collector {
    async fn start() -> Collector {
        let spans: Arc<Mutex<Vec<Span>>> = Arc::default();
        let kept = spans.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(
                move |headers: axum::http::HeaderMap, body: axum::body::Bytes| {
                    let kept = kept.clone();
                    async move {
                        assert_eq!(
                            headers.get("content-type").and_then(|v| v.to_str().ok()),
                            Some("application/x-protobuf")
                        );
                        let request = ExportTraceServiceRequest::decode(body.as_ref())
                            .expect("OTLP protobuf");
                        let mut out = kept.lock().unwrap();
                        for rs in request.resource_spans {
                            let service = rs
                                .resource
                                .iter()
                                .flat_map(|r| &r.attributes)
                                .find(|a| a.key == "service.name")
                                .map(|a| text(&a.value))
                                .unwrap_or_default();
                            for ss in rs.scope_spans {
                                for s in ss.spans {
                                    out.push(Span {
                                        service: service.clone(),
                                        trace_id: hex(&s.trace_id),
                                        span_id: hex(&s.span_id),
                                        parent: hex(&s.parent_span_id),
                                        name: s.name.clone(),
                                        kind: s.kind,
                                        status: s.status.as_ref().map_or(0, |st| st.code),
                                        attributes: s
                                            .attributes
                                            .iter()
                                            .map(|a| (a.key.clone(), text(&a.value)))
                                            .collect(),
                                    });
                                }
                            }
                        }
                        // An empty ExportTraceServiceResponse.
                        (
                            [("content-type", "application/x-protobuf")],
                            Vec::<u8>::new(),
                        )
                    }
                },
            ),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let task = tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Collector {
            url,
            spans,
            _task: task,
        }
    }

    fn spans(&self) -> Vec<Span> {
        self.spans.lock().unwrap().clone()
    }
}

struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    /// SIGTERM, wait for the exit (the spans still batched are sent on
    /// the way out), and return what it wrote to stderr.
    fn stop(mut self) -> String {
        let _ = Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status();
        let status = self.0.wait().unwrap();
        assert!(status.success(), "{status}");
        let mut stderr = String::new();
        if let Some(mut e) = self.0.stderr.take() {
            use std::io::Read;
            let _ = e.read_to_string(&mut stderr);
        }
        stderr
    }
}

struct Fleet {
    nats: toolfleet_local::servers::NatsServer,
    _redis: toolfleet_local::servers::RedisServer,
    model: toolfleet_scripted::ScriptedServer,
    orchestrator: Proc,
    worker: Proc,
}

/// The orchestrator and the system pool as processes, exporting to
/// `otlp` (none: tracing off), the worker logging JSON.
async fn fleet(otlp: Option<&str>) -> Fleet {
    let nats = toolfleet_local::servers::NatsServer::start().unwrap();
    let redis = toolfleet_local::servers::RedisServer::start().unwrap();
    let script = toolfleet_scripted::Script::from_json(
        &serde_json::json!({
            "rules": [{ "whenUserContains": ["time"], "steps": [
                { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
                { "answer": "The clock says {{tool:current_datetime}}." }
            ] }]
        })
        .to_string(),
    )
    .unwrap();
    let model = toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
        .await
        .unwrap();
    let ports: Vec<u16> = (0..2)
        .map(|_| toolfleet_local::servers::free_port().unwrap())
        .collect();
    let spawn = |bin: &str, port: u16, extra: &[(&str, String)]| {
        let mut cmd = Command::new(support::sibling_bin(bin));
        cmd.current_dir(support::root())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .env("TOOLFLEET_NATS_URL", nats.url())
            .env("TOOLFLEET_REDIS_URL", redis.url())
            .env("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{port}"))
            .env("TOOLFLEET_LOG", "info")
            .env("OTEL_BSP_SCHEDULE_DELAY", "100");
        if let Some(url) = otlp {
            cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", url);
        }
        for (k, v) in extra {
            cmd.env(k, v);
        }
        Proc(cmd.spawn().unwrap())
    };
    let orchestrator = spawn(
        "toolfleet-orchestrator",
        ports[0],
        &[
            ("TOOLFLEET_LLM_BASE_URL", model.base_url().to_string()),
            ("TOOLFLEET_LLM_MODEL", "toolfleet-scripted".into()),
        ],
    );
    let worker = spawn(
        "toolfleet-worker-system",
        ports[1],
        &[("TOOLFLEET_LOG_FORMAT", "json".into())],
    );
    for port in &ports {
        let deadline = std::time::Instant::now() + WAIT;
        while reqwest_ready(*port).await.is_none() {
            assert!(std::time::Instant::now() < deadline, "no /readyz on {port}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Fleet {
        nats,
        _redis: redis,
        model,
        orchestrator,
        worker,
    }
}

async fn reqwest_ready(port: u16) -> Option<()> {
    toolfleet_llm::install_crypto_provider();
    let r = reqwest::get(format!("http://127.0.0.1:{port}/readyz"))
        .await
        .ok()?;
    r.status().is_success().then_some(())
}

/// `toolfleet chat` until the fleet answers with the tool's result (the
/// worker may need a catalog refresh to be seen).
fn chat(fleet: &Fleet, otlp: Option<&str>) -> String {
    let deadline = std::time::Instant::now() + WAIT;
    loop {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_toolfleet"));
        cmd.args(["chat", "What time is it?"])
            .env("TOOLFLEET_NATS_URL", fleet.nats.url())
            .env("OTEL_BSP_SCHEDULE_DELAY", "100");
        if let Some(url) = otlp {
            cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", url);
        }
        let out = cmd.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout).to_string();
        if out.status.success() && stdout.contains("The clock says 20") {
            return stdout;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no answer: {stdout}\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

const SPAN_KIND_SERVER_OR_CONSUMER: [i32; 2] = [2, 5];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_spans_the_client_the_orchestrator_the_model_call_and_the_worker() {
    let collector = Collector::start().await;
    let fleet = fleet(Some(&collector.url)).await;
    let answer = tokio::task::block_in_place(|| chat(&fleet, Some(&collector.url)));
    assert!(answer.contains("The clock says"), "{answer}");

    // The last chat's client span names the trace.
    let deadline = std::time::Instant::now() + WAIT;
    let (spans, trace) = loop {
        let spans = collector.spans();
        let trace = spans
            .iter()
            .rev()
            .find(|s| s.service == "toolfleet" && s.name == "chat toolfleet")
            .map(|s| s.trace_id.clone());
        if let Some(trace) = trace {
            let of_trace: Vec<Span> = spans
                .iter()
                .filter(|s| s.trace_id == trace)
                .cloned()
                .collect();
            let services: std::collections::HashSet<&str> =
                of_trace.iter().map(|s| s.service.as_str()).collect();
            if services.contains("toolfleet-worker-system")
                && of_trace.iter().any(|s| s.name == "invoke_agent toolfleet")
            {
                break (of_trace, trace);
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no whole trace: {:#?}",
            collector.spans()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let one = |service: &str, name: &str| -> Span {
        spans
            .iter()
            .find(|s| s.service == service && s.name == name)
            .unwrap_or_else(|| panic!("no {name} span from {service}: {spans:#?}"))
            .clone()
    };
    let client = one("toolfleet", "chat toolfleet");
    let agent = one("toolfleet-orchestrator", "invoke_agent toolfleet");
    assert_eq!(
        agent.parent, client.span_id,
        "the job continues the client's trace"
    );
    assert!(SPAN_KIND_SERVER_OR_CONSUMER.contains(&agent.kind));
    assert_eq!(agent.attributes["gen_ai.operation.name"], "invoke_agent");
    assert_eq!(agent.status, 1, "ok");

    // Two model calls (the tool round and the answer), children of the
    // job, with the GenAI attributes and the tokens the model reported.
    let models: Vec<&Span> = spans
        .iter()
        .filter(|s| s.name == "chat toolfleet-scripted")
        .collect();
    assert_eq!(models.len(), 2, "{spans:#?}");
    for m in &models {
        assert_eq!(m.service, "toolfleet-orchestrator");
        assert_eq!(m.parent, agent.span_id);
        assert_eq!(m.kind, 3, "client");
        assert_eq!(m.attributes["gen_ai.operation.name"], "chat");
        assert_eq!(m.attributes["gen_ai.provider.name"], "openai");
        assert_eq!(m.attributes["gen_ai.request.model"], "toolfleet-scripted");
        let input: u64 = m.attributes["gen_ai.usage.input_tokens"].parse().unwrap();
        assert!(input > 0, "{m:?}");
        assert!(m.attributes.contains_key("gen_ai.usage.output_tokens"));
        assert!(
            ["tool_calls", "stop"]
                .contains(&m.attributes["gen_ai.response.finish_reasons"].as_str()),
            "{m:?}"
        );
        assert_eq!(m.status, 1, "ok");
    }
    // The provider got the model call's context in `traceparent`.
    let sent: Vec<String> = fleet
        .model
        .received()
        .iter()
        .filter_map(|r| r.header("traceparent").map(str::to_string))
        .collect();
    for m in &models {
        assert!(
            sent.iter()
                .any(|tp| *tp == format!("00-{trace}-{}-01", m.span_id)),
            "{sent:?} vs {m:?}"
        );
    }

    // The tool call: the orchestrator's span, and the worker's under it.
    let call = one("toolfleet-orchestrator", "execute_tool current_datetime");
    assert_eq!(call.parent, agent.span_id);
    assert_eq!(
        call.attributes["gen_ai.tool.name"],
        "system:current_datetime@1.0.0"
    );
    let call_id = &call.attributes["gen_ai.tool.call.id"];
    assert!(!call_id.is_empty());
    let job = one("toolfleet-worker-system", "execute_tool current_datetime");
    assert_eq!(job.parent, call.span_id, "the worker continues the call");
    assert!(SPAN_KIND_SERVER_OR_CONSUMER.contains(&job.kind));
    assert_eq!(&job.attributes["gen_ai.tool.call.id"], call_id);
    assert_eq!(job.status, 1, "ok");
    assert_eq!(call.status, 1, "ok");

    // The worker logged one JSON line for the finished job, with its
    // outcome, duration and trace id, and no terminal colours.
    let Fleet {
        orchestrator,
        worker,
        ..
    } = fleet;
    let worker_log = worker.stop();
    let orchestrator_log = orchestrator.stop();
    assert!(!worker_log.contains('\u{1b}') && !orchestrator_log.contains('\u{1b}'));
    let finished: Vec<serde_json::Value> = worker_log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|l| l["fields"]["message"] == "tool job finished")
        .collect();
    let ours = finished
        .iter()
        .find(|l| l["span"]["call_id"] == call_id.as_str())
        .unwrap_or_else(|| panic!("no finished line for {call_id}: {worker_log}"));
    assert_eq!(ours["level"], "INFO");
    assert_eq!(ours["fields"]["outcome"], "ok");
    assert!(ours["fields"]["duration_ms"].is_u64(), "{ours}");
    assert_eq!(ours["span"]["trace_id"], trace.as_str());
    assert!(
        orchestrator_log
            .lines()
            .any(
                |l| l.contains("chat job finished") && l.contains("outcome=\"completed\"")
                    || l.contains("chat job finished") && l.contains("outcome=completed")
            ),
        "{orchestrator_log}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_collector_that_is_down_costs_the_spans_and_nothing_else() {
    // A port nobody listens on.
    let dead = format!(
        "http://127.0.0.1:{}",
        toolfleet_local::servers::free_port().unwrap()
    );
    let fleet = fleet(Some(&dead)).await;
    let answer = tokio::task::block_in_place(|| chat(&fleet, Some(&dead)));
    assert!(answer.contains("The clock says"), "{answer}");
    // The processes still drain and exit cleanly: the last flush gives
    // up (bounded) instead of holding the exit.
    let Fleet {
        orchestrator,
        worker,
        ..
    } = fleet;
    let _ = worker.stop();
    let _ = orchestrator.stop();
    // With no collector configured the trace still starts at the client
    // and the ids reach the logs.
    let fleet = self::fleet(None).await;
    let _ = tokio::task::block_in_place(|| chat(&fleet, None));
    let Fleet { worker, .. } = fleet;
    let log = worker.stop();
    let finished = log
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|l| l["fields"]["message"] == "tool job finished")
        .unwrap_or_else(|| panic!("{log}"));
    let trace_id = finished["span"]["trace_id"].as_str().unwrap_or_default();
    assert_eq!(trace_id.len(), 32, "{finished}");
}
