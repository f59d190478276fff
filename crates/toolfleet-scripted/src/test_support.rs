//! Helpers the unit tests of every module share: bounded awaits, scripts,
//! conversations, and a running server with a client to talk to it.

use std::future::Future;
use std::path::Path;
use std::time::Duration;

use axum::http::HeaderMap;
use serde_json::{Value, json};

use crate::chat::read_request;
use crate::reply::{Reply, plan};
use crate::request::Turn;
use crate::script::Script;
use crate::server::ScriptedServer;

const STEP: Duration = Duration::from_secs(20);

/// Every await in these tests is bounded.
pub(crate) async fn within<F: Future>(future: F) -> F::Output {
    tokio::time::timeout(STEP, future)
        .await
        .expect("test step timed out")
}

pub(crate) fn demo_script() -> Script {
    Script::load(Path::new(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/demo-script.json"
    )))
    .expect("the demo script is valid")
}

pub(crate) fn user(text: &str) -> Value {
    json!({"role": "user", "content": text})
}

pub(crate) fn assistant_calls(calls: &[(&str, &str)]) -> Value {
    json!({"role": "assistant", "content": null, "tool_calls": calls.iter().map(|(id, name)| json!({
        "id": id, "type": "function", "function": {"name": name, "arguments": "{}"}
    })).collect::<Vec<_>>()})
}

pub(crate) fn tool(id: &str, content: &str) -> Value {
    json!({"role": "tool", "tool_call_id": id, "content": content})
}

pub(crate) fn turns(messages: Vec<Value>) -> Vec<Turn> {
    read_request(&json!({"model": "m", "messages": messages})).expect("valid request")
}

pub(crate) fn reply(script: &Script, turns: &[Turn]) -> Reply {
    plan(script, turns, "", true).reply
}

pub(crate) fn call_names(reply: &Reply) -> Vec<&str> {
    match reply {
        Reply::ToolCalls(calls) => calls.iter().map(|(_, n, _)| n.as_str()).collect(),
        other => panic!("expected tool calls, got {other:?}"),
    }
}

pub(crate) fn answer(reply: Reply) -> String {
    match reply {
        Reply::Answer(text) => text,
        other => panic!("expected an answer, got {other:?}"),
    }
}

pub(crate) const TWO_ROUNDS: &str = r#"{
    "rules": [
        {"whenUserContains": ["LOOP"], "steps": [{"toolCalls": [{"name": "f"}]}]},
        {"whenUserContains": ["two"], "steps": [
            {"toolCalls": [{"name": "f", "arguments": {"n": 1}}]},
            {"toolCalls": [{"name": "g", "arguments": {"n": 2}}]},
            {"answer": "f said {{tool:f}}, g said {{tool:g}}"}
        ]}
    ]
}"#;

pub(crate) fn install_crypto_provider() {
    let _ = rustls::crypto::ring::default_provider().install_default();
}

pub(crate) async fn start(script: &str) -> (ScriptedServer, reqwest::Client) {
    install_crypto_provider();
    let server = within(ScriptedServer::start(
        "127.0.0.1:0".parse().expect("addr"),
        Script::from_json(script).expect("script"),
    ))
    .await
    .expect("start");
    (server, reqwest::Client::new())
}

pub(crate) async fn post(
    client: &reqwest::Client,
    server: &ScriptedServer,
    body: String,
) -> (u16, String, String) {
    let response = within(
        client
            .post(format!("{}/chat/completions", server.base_url()))
            .header("content-type", "application/json")
            .body(body)
            .send(),
    )
    .await
    .expect("send");
    let status = response.status().as_u16();
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();
    (
        status,
        content_type,
        within(response.text()).await.expect("body"),
    )
}

/// The `data:` payloads of an SSE body, checking the framing on the way.
pub(crate) fn payloads(body: &str) -> Vec<String> {
    assert!(body.ends_with("data: [DONE]\n\n"), "{body}");
    body.split("\n\n")
        .filter(|frame| !frame.is_empty())
        .map(|frame| {
            frame
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("bad frame {frame:?}"))
                .to_owned()
        })
        .collect()
}

/// Posts `body` to `path` (under `/v1`) and reads the whole response,
/// noting whether the body broke off instead of ending.
pub(crate) async fn send(
    client: &reqwest::Client,
    server: &ScriptedServer,
    path: &str,
    body: &Value,
) -> (reqwest::StatusCode, HeaderMap, String, bool) {
    let mut response = within(
        client
            .post(format!("{}/{path}", server.base_url()))
            .json(body)
            .send(),
    )
    .await
    .expect("send");
    let status = response.status();
    let headers = response.headers().clone();
    let mut bytes = Vec::new();
    let mut broken = false;
    loop {
        match within(response.chunk()).await {
            Ok(Some(chunk)) => bytes.extend_from_slice(&chunk),
            Ok(None) => break,
            Err(_) => {
                broken = true;
                break;
            }
        }
    }
    let text = String::from_utf8(bytes).expect("utf-8 body");
    (status, headers, text, broken)
}

/// The events of a Responses SSE body, checking that every frame is
/// `event: <type>` + `data: <json with that type>`.
pub(crate) fn response_events(body: &str) -> Vec<Value> {
    body.split("\n\n")
        .filter(|frame| !frame.is_empty())
        .map(|frame| {
            let (event, data) = frame.split_once('\n').expect("two lines");
            let kind = event.strip_prefix("event: ").expect("event line");
            let data: Value = serde_json::from_str(data.strip_prefix("data: ").expect("data line"))
                .expect("data JSON");
            assert_eq!(data["type"], json!(kind));
            data
        })
        .collect()
}

pub(crate) fn of_type<'a>(events: &'a [Value], kind: &str) -> Vec<&'a Value> {
    events.iter().filter(|e| e["type"] == kind).collect()
}

pub(crate) const RESPONSES: &str = r#"{
    "rules": [
        {"whenUserContains": ["weather"], "steps": [
            {"reasoning": true, "toolCalls": [
                {"name": "get_weather", "arguments": {"city": "Paris", "units": "metric"}},
                {"name": "lookup", "arguments": {}}]},
            {"answer": "It is {{tool:get_weather}} ({{tool:lookup}})"}]},
        {"whenUserContains": ["refuse"], "steps": [{"refusal": "I can't help with that."}]}
    ]
}"#;
