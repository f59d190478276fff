//! The worker runtime with tools of our own: lifecycle hooks, per-tool
//! timeouts and handler failures, against real nats-server and
//! redis-server. And a client that speaks only JSON over NATS.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use toolfleet::local::{NatsServer, RedisServer};
use toolfleet::protocol::{CallContext, Envelope, InvocationContext, Subjects, ToolResult};
use toolfleet::worker::{
    Hooks, ServedTool, ToolCtx, ToolError, ToolHandler, ToolOutput, WorkerConfig,
};

use crate::support::{self, next_json};

/// Records every hook call.
#[derive(Default)]
struct Recorder(Mutex<Vec<String>>);

impl Recorder {
    fn push(&self, s: String) {
        self.0.lock().unwrap().push(s);
    }
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

impl Hooks for Recorder {
    fn on_start(&self, call: &CallContext) {
        self.push(format!("start {}", call.call_id));
    }
    fn on_complete(&self, call: &CallContext, result: &ToolResult) {
        self.push(format!(
            "complete {} {}",
            call.call_id,
            result.status.as_str()
        ));
    }
    fn on_error(&self, call: &CallContext, error: &ToolError) {
        self.push(format!("error {} {}", call.call_id, error.code()));
    }
}

/// Behaves by its `utcOffset` argument: fail, hang, panic, cite twice, or
/// succeed.
struct Moody;

fn reference(title: &str) -> toolfleet::citations::NewReference {
    toolfleet::citations::NewReference {
        kind: "document".into(),
        title: title.into(),
        source: None,
        url: None,
        snippet: None,
    }
}

impl ToolHandler for Moody {
    fn call<'a>(
        &'a self,
        ctx: &'a ToolCtx,
        args: Value,
    ) -> BoxFuture<'a, Result<ToolOutput, ToolError>> {
        async move {
            match args["utcOffset"].as_str() {
                Some("+01:00") => Err(ToolError::failed("the backend said no")),
                Some("+02:00") => {
                    tokio::time::sleep(Duration::from_secs(60)).await;
                    Ok(ToolOutput::default())
                }
                Some("+03:00") => {
                    let empty: Vec<u8> = Vec::new();
                    let i = args["utcOffset"].as_str().map_or(0, str::len);
                    Ok(ToolOutput {
                        content: empty[i].to_string(),
                        data: None,
                    })
                }
                Some("+04:00") => {
                    let a = ctx.cite(vec![reference("a1"), reference("a2")]).await?;
                    let b = ctx.cite(vec![reference("b1"), reference("b2")]).await?;
                    let markers: Vec<String> = a.iter().chain(&b).map(|r| r.marker()).collect();
                    Ok(ToolOutput {
                        content: markers.join(" "),
                        data: None,
                    })
                }
                _ => Ok(ToolOutput {
                    content: "fine".into(),
                    data: None,
                }),
            }
        }
        .boxed()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_timeouts_and_failures_in_the_worker_runtime() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let store = toolfleet::citations::CitationStore::connect(
        &redis.url(),
        "toolfleet",
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let subjects = Subjects::new("toolfleet").unwrap();

    // The shipped current_datetime definition, with a short timeout, served
    // by our handler.
    let dir = tempfile::tempdir().unwrap();
    let mut def: Value = serde_json::from_str(
        &std::fs::read_to_string(
            support::root().join("tool_definitions/system.current_datetime.json"),
        )
        .unwrap(),
    )
    .unwrap();
    def["timeoutMs"] = json!(300);
    std::fs::write(dir.path().join("t.json"), def.to_string()).unwrap();
    let registry = toolfleet::tools::ToolRegistry::from_dir(dir.path()).unwrap();
    let id: toolfleet::tools::ToolId = "system:current_datetime@1.0.0".parse().unwrap();
    let hooks = Arc::new(Recorder::default());
    let tool = ServedTool::new(registry.compiled_arc(&id).unwrap(), Arc::new(Moody))
        .with_hooks(hooks.clone());

    let metrics = toolfleet::metrics::WorkerMetrics::register(
        &prometheus::Registry::new(),
        toolfleet::metrics::dead_letters(&prometheus::Registry::new()).unwrap(),
    )
    .unwrap();
    let shutdown = CancellationToken::new();
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let worker = tokio::spawn(toolfleet::worker::run_with_ready(
        client.clone(),
        store,
        vec![tool],
        WorkerConfig::new("test", subjects.clone()),
        metrics,
        shutdown.clone(),
        Some(ready_tx),
    ));
    tokio::time::timeout(support::WAIT, ready_rx)
        .await
        .unwrap()
        .unwrap();

    let js = async_nats::jetstream::new(client.clone());
    let inbox = client.new_inbox();
    let mut replies = client.subscribe(inbox.clone()).await.unwrap();
    client.flush().await.unwrap();
    let mut ask = async |call: &str, args: Value| -> Value {
        let ctx = CallContext {
            invocation: InvocationContext::new("hooks-1"),
            call_id: call.into(),
            tool_id: id.clone(),
            attempt: 1,
            reply_to: inbox.clone(),
        };
        js.publish_with_headers(
            subjects.tool(&id),
            ctx.to_headers(),
            json!({ "arguments": args }).to_string().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
        let reply = next_json(&mut replies).await;
        Envelope::ToolReply
            .validator()
            .validate(&reply)
            .expect("replies follow the schema");
        reply
    };

    let ok = ask("c_ok", json!({})).await;
    assert_eq!(ok["status"], "ok");
    assert_eq!(hooks.take(), vec!["start c_ok", "complete c_ok ok"]);

    let failed = ask("c_fail", json!({ "utcOffset": "+01:00" })).await;
    assert_eq!(failed["status"], "error");
    assert_eq!(failed["error"]["code"], "tool_failed");
    assert_eq!(failed["content"], "the backend said no");
    assert_eq!(
        hooks.take(),
        vec!["start c_fail", "error c_fail tool_failed"]
    );

    let slow = ask("c_slow", json!({ "utcOffset": "+02:00" })).await;
    assert_eq!(slow["status"], "timeout");
    assert!(
        slow["content"].as_str().unwrap().contains("300 ms"),
        "{slow}"
    );
    assert_eq!(
        hooks.take(),
        vec!["start c_slow", "error c_slow tool_failed"]
    );

    // A panicking handler is an error result, not a stuck job.
    let panicked = ask("c_panic", json!({ "utcOffset": "+03:00" })).await;
    assert_eq!(panicked["status"], "error");
    assert!(
        panicked["content"].as_str().unwrap().contains("panicked"),
        "{panicked}"
    );
    assert_eq!(
        hooks.take(),
        vec!["start c_panic", "error c_panic tool_failed"]
    );

    // Two cites in one job get distinct indices; the job's references are
    // all four.
    let cited = ask("c_cite", json!({ "utcOffset": "+04:00" })).await;
    assert_eq!(cited["content"], "[doc:1] [doc:2] [doc:3] [doc:4]");
    let titles: Vec<&str> = cited["references"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["title"].as_str().unwrap())
        .collect();
    assert_eq!(titles, vec!["a1", "a2", "b1", "b2"]);
    hooks.take();

    // Invalid arguments never reach the hooks or the handler.
    let invalid = ask("c_bad", json!({ "utcOffset": "soon" })).await;
    assert_eq!(invalid["error"]["code"], "invalid_arguments");
    assert_eq!(invalid["error"]["violations"][0]["path"], "/utcOffset");
    assert!(hooks.take().is_empty());

    shutdown.cancel();
    tokio::time::timeout(support::WAIT, worker)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// What a client in another language does: plain JSON over NATS, no
/// toolfleet types. Every event validates against the published schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_json_client_gets_schema_valid_events() {
    let env = support::Env::start(json!({
        "rules": [{ "whenUserContains": ["honeybee"], "steps": [
            { "toolCalls": [ { "name": "search_documents", "arguments": { "query": "honeybee waggle dance" } } ] },
            { "answer": "Bees dance: {{tool:search_documents}}" }
        ] }]
    }))
    .await;
    let mut events = env
        .subscribe("toolfleet.chat.events.plain-client-1".into())
        .await;
    let js = async_nats::jetstream::new(env.client.clone());
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", "plain-client-1");
    let body = r#"{"invocationId":"plain-client-1","messages":[{"role":"user","content":"How do honeybees navigate?"}]}"#;
    js.publish_with_headers("toolfleet.chat.submit", headers.clone(), body.into())
        .await
        .unwrap()
        .await
        .unwrap();
    // A retried submit inside the duplicate window is not run twice.
    let dup = js
        .publish_with_headers("toolfleet.chat.submit", headers, body.into())
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(dup.duplicate);

    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(support::root().join("schemas/chat_event.schema.json")).unwrap(),
    )
    .unwrap();
    let validator = toolfleet::schema::Validator::compile(&schema).unwrap();
    let mut seen = Vec::new();
    loop {
        let ev = next_json(&mut events).await;
        validator
            .validate(&ev)
            .unwrap_or_else(|v| panic!("{ev}: {v:?}"));
        let kind = ev["type"].as_str().unwrap().to_string();
        seen.push(kind.clone());
        if kind == "completed" {
            assert!(ev["text"].as_str().unwrap().contains("[doc:1]"));
            assert_eq!(ev["references"][0]["index"], 1);
            break;
        }
        assert_ne!(kind, "error", "{ev}");
    }
    assert_eq!(seen.first().map(String::as_str), Some("started"));
    assert!(
        tokio::time::timeout(
            Duration::from_millis(500),
            futures::StreamExt::next(&mut events)
        )
        .await
        .is_err(),
        "one terminal event, once"
    );
}
