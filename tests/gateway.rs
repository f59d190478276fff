//! The OpenAI-compatible gateway (`toolfleet gateway`) in front of a fleet
//! on real servers (nats-server, redis-server, the scripted model): raw
//! HTTP for both APIs, streamed and not, checked with the same parsers as
//! OpenAI's recorded streams (`shared/conformance` beside the checkout);
//! keys made and revoked by `toolfleet keys`; errors in OpenAI's shape; a
//! client that goes away cancels its job; tenants kept apart; approvals;
//! the official `openai` Python client (`tests/gateway/openai_client.py`)
//! and curl.

// Tests are exempt from the 100-line limit: a scenario reads top to bottom.
#![allow(clippy::too_many_lines)]

#[path = "support/mod.rs"]
mod support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use support::{Env, Options, WAIT};
use toolfleet::gateway::GatewayConfig;

/// The profiles of every test: `default` for everyone, `acme-extra` for
/// acme, `globex-canary-7f3a` for globex only (the canary another tenant
/// must never see), `guarded` holding the clock for approval, and tenant
/// `initech` limited to one model call a minute.
const PROFILES: &str = r#"
[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"
[profiles.default]
deployment = "scripted"
[profiles.acme-extra]
deployment = "scripted"
tenants = ["acme"]
[profiles.globex-canary-7f3a]
deployment = "scripted"
tenants = ["globex"]
[profiles.guarded]
deployment = "scripted"
require_approval = ["system:current_datetime"]
[tenants.acme]
trust_user = true
[tenants.initech]
requests_per_minute = 1
"#;

/// The model's script: a cited answer about lighthouses (a search, then
/// the answer quoting it), the time, globex's canary, a long slow answer.
fn script() -> Value {
    json!({
        "rules": [
            { "whenUserContains": ["lighthouse"], "steps": [
                { "toolCalls": [ { "name": "search_data_sources", "arguments": { "query": "lighthouse fog signals warn ships", "topK": 2 } } ] },
                { "answer": "Lighthouses warn ships: {{tool:search_data_sources}}" }
            ] },
            { "whenUserContains": ["what time"], "steps": [
                { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
                { "answer": "It is {{tool:current_datetime}}." }
            ] },
            { "whenUserContains": ["globex secret"], "steps": [ { "answer": "CANARY-GLOBEX-91c2 is the secret." } ] },
            { "whenUserContains": ["slowly"], "steps": [
                { "fault": { "kind": "slowFirstToken", "delayMs": 30000 }, "answer": "too late" } ] },
            { "whenUserContains": ["long story"], "steps": [ { "answer": "word ".repeat(400) } ] }
        ],
        "default": { "steps": [ { "answer": "Hello from the fleet." } ] }
    })
}

/// A fleet with the gateway in front of it.
struct Door {
    env: Env,
    addr: SocketAddr,
    http: reqwest::Client,
}

impl Door {
    async fn start() -> Door {
        Self::start_with(script(), |_| {}).await
    }

    async fn start_with(script: Value, tweak: impl FnOnce(&mut GatewayConfig)) -> Door {
        let env = Env::start_with(
            script,
            Options {
                profiles_toml: Some(PROFILES.into()),
                corpus_tenant: Some("acme"),
                ..Default::default()
            },
        )
        .await;
        let profiles = toolfleet_config::FleetConfig::from_toml(
            &PROFILES.replace("{base_url}", env.model.base_url().as_str()),
            "gateway test profiles",
        )
        .unwrap();
        let mut config = GatewayConfig::new(env.subjects.clone(), profiles);
        config.timeout = Duration::from_secs(20);
        config.keep_alive = Duration::from_millis(500);
        tweak(&mut config);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = toolfleet::gateway::start(
            listener,
            async_nats::connect(env.nats.url()).await.unwrap(),
            env.store().await,
            config,
            &env.metrics,
            &env.tracker,
            env.shutdown.clone(),
        )
        .await
        .unwrap();
        toolfleet_llm::install_crypto_provider();
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(60))
            .build()
            .unwrap();
        Door { env, addr, http }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn base(&self) -> String {
        self.url("/v1")
    }

    /// `toolfleet keys <args>` on the fleet's Redis: exit code and stdout.
    fn keys(&self, args: &[&str]) -> (Option<i32>, String, String) {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_toolfleet"))
            .arg("keys")
            .args(args)
            .env("TOOLFLEET_REDIS_URL", self.env.redis.url())
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// A new key of `tenant` (more flags in `extra`).
    fn key(&self, tenant: &str, extra: &[&str]) -> String {
        let mut args = vec!["add", "--tenant", tenant];
        args.extend(extra);
        let (code, stdout, stderr) = self.keys(&args);
        assert_eq!(code, Some(0), "{stderr}");
        let key = stdout.trim().to_string();
        assert!(key.starts_with("tf_") && key.len() == 46, "{key}");
        key
    }

    async fn post(&self, path: &str, key: &str, body: &Value) -> reqwest::Response {
        tokio::time::timeout(
            WAIT,
            self.http
                .post(self.url(path))
                .bearer_auth(key)
                .json(body)
                .send(),
        )
        .await
        .expect("the gateway answers in time")
        .expect("the gateway answers")
    }

    async fn get(&self, path: &str, key: &str) -> reqwest::Response {
        tokio::time::timeout(WAIT, self.http.get(self.url(path)).bearer_auth(key).send())
            .await
            .expect("the gateway answers in time")
            .expect("the gateway answers")
    }
}

/// A server-sent event: its `event:` (if any) and `data:` lines.
#[derive(Debug, Clone)]
struct Frame {
    event: Option<String>,
    data: String,
}

/// The frames of an SSE body; comment lines (`: keep-alive`) are skipped.
fn frames(body: &str) -> Vec<Frame> {
    body.split("\n\n")
        .filter_map(|block| {
            let mut event = None;
            let mut data = Vec::new();
            for line in block.lines() {
                if let Some(e) = line.strip_prefix("event: ") {
                    event = Some(e.to_string());
                } else if let Some(d) = line.strip_prefix("data: ") {
                    data.push(d);
                }
            }
            (!data.is_empty()).then(|| Frame {
                event,
                data: data.join("\n"),
            })
        })
        .collect()
}

/// What a Chat Completions stream says, checked as OpenAI's recorded
/// streams are: every chunk a `chat.completion.chunk` of one id, the role
/// first, one `finish_reason`, the usage chunk (no choices) last, then
/// `[DONE]`.
#[derive(Debug, Default)]
struct ChatStream {
    content: String,
    annotations: Vec<Value>,
    finish_reason: Option<String>,
    usage: Option<Value>,
    extension: Option<Value>,
}

fn check_chat_stream(frames: &[Frame], with_usage: bool) -> ChatStream {
    let (last, chunks) = frames.split_last().expect("frames");
    assert_eq!(last.data, "[DONE]", "the stream ends with [DONE]");
    let chunks: Vec<Value> = chunks
        .iter()
        .map(|f| serde_json::from_str(&f.data).expect("a chunk is JSON"))
        .collect();
    let id = chunks[0]["id"].clone();
    assert!(
        id.as_str().is_some_and(|i| i.starts_with("chatcmpl-")),
        "{id}"
    );
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let mut out = ChatStream::default();
    for (i, c) in chunks.iter().enumerate() {
        assert_eq!(c["object"], "chat.completion.chunk", "{c}");
        assert_eq!(c["id"], id);
        assert!(c["created"].is_u64() && c["model"].is_string(), "{c}");
        let choices = c["choices"].as_array().expect("choices");
        if choices.is_empty() {
            assert!(
                with_usage && i == chunks.len() - 1,
                "only the usage chunk has no choices"
            );
            out.usage = Some(c["usage"].clone());
            continue;
        }
        let choice = &choices[0];
        assert_eq!(choice["index"], 0);
        assert!(
            out.finish_reason.is_none(),
            "nothing after finish_reason but usage"
        );
        if let Some(text) = choice["delta"]["content"].as_str() {
            out.content.push_str(text);
        }
        if let Some(a) = choice["delta"]["annotations"].as_array() {
            out.annotations.extend(a.iter().cloned());
        }
        if let Some(r) = choice["finish_reason"].as_str() {
            out.finish_reason = Some(r.to_string());
            out.extension = c.get("toolfleet").cloned();
        }
    }
    assert!(out.finish_reason.is_some(), "a finish_reason");
    assert_eq!(out.usage.is_some(), with_usage);
    if let Some(u) = &out.usage {
        let total = u["total_tokens"].as_u64().unwrap();
        assert_eq!(
            total,
            u["prompt_tokens"].as_u64().unwrap() + u["completion_tokens"].as_u64().unwrap()
        );
    }
    out
}

/// What a Responses stream says, checked as OpenAI's recorded streams are:
/// `event:` equals the data's `type`; `sequence_number` counts from 0;
/// `response.created` and `response.in_progress` first; each text part's
/// `output_text.done` is its deltas joined, and the final response carries
/// the same text; it ends with `response.completed` (or an `error` then
/// `response.failed`).
#[derive(Debug, Default)]
struct ResponsesStream {
    types: Vec<String>,
    text: String,
    annotations: Vec<Value>,
    response: Value,
}

fn check_responses_stream(events: &[Value]) -> ResponsesStream {
    let mut out = ResponsesStream::default();
    let mut deltas: std::collections::BTreeMap<(String, u64), String> = Default::default();
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e["sequence_number"], json!(i), "{e}");
        out.types
            .push(e["type"].as_str().expect("a type").to_string());
    }
    assert_eq!(out.types[..2], ["response.created", "response.in_progress"]);
    assert_eq!(events[0]["response"]["status"], "in_progress");
    let id = events[0]["response"]["id"].clone();
    for e in events {
        let at = || {
            (
                e["item_id"].as_str().unwrap().to_string(),
                e["content_index"].as_u64().unwrap(),
            )
        };
        match e["type"].as_str().unwrap() {
            "response.output_text.delta" => {
                deltas
                    .entry(at())
                    .or_default()
                    .push_str(e["delta"].as_str().unwrap());
            }
            "response.output_text.done" => {
                assert_eq!(
                    deltas.get(&at()).map_or("", String::as_str),
                    e["text"].as_str().unwrap(),
                    "done is the deltas joined"
                );
                out.text.push_str(e["text"].as_str().unwrap());
            }
            "response.output_text.annotation.added" => {
                out.annotations.push(e["annotation"].clone());
            }
            "response.completed" | "response.failed" | "response.incomplete" => {
                out.response = e["response"].clone();
            }
            _ => {}
        }
    }
    assert_eq!(out.response["id"], id, "the last event closes the response");
    match out.types.last().map(String::as_str) {
        Some("response.completed") => {
            assert_eq!(out.response["status"], "completed");
            let final_text: String = out.response["output"]
                .as_array()
                .unwrap()
                .iter()
                .filter(|item| item["type"] == "message")
                .flat_map(|item| item["content"].as_array().unwrap().clone())
                .filter(|part| part["type"] == "output_text")
                .map(|part| part["text"].as_str().unwrap().to_string())
                .collect();
            assert_eq!(final_text, out.text);
            let usage = &out.response["usage"];
            assert!(usage["total_tokens"].as_u64().unwrap() > 0, "{usage}");
        }
        Some("response.failed") => {
            assert_eq!(out.types[out.types.len() - 2], "error");
            assert_eq!(out.response["status"], "failed");
        }
        other => panic!("a stream ends completed or failed, not {other:?}"),
    }
    out
}

/// The frames of a Responses stream as events (`event:` checked).
fn response_events(frames: &[Frame]) -> Vec<Value> {
    frames
        .iter()
        .map(|f| {
            let v: Value = serde_json::from_str(&f.data).expect("an event is JSON");
            assert_eq!(f.event.as_deref(), v["type"].as_str(), "event: is the type");
            v
        })
        .collect()
}

/// Each annotation's span is a `[k]` marker of `text` (indices in
/// characters), with a URL and a title.
fn check_citations(text: &str, annotations: &[Value], nested: bool) {
    assert!(!annotations.is_empty(), "citations in {text:?}");
    let chars: Vec<char> = text.chars().collect();
    for a in annotations {
        assert_eq!(a["type"], "url_citation", "{a}");
        let c = if nested { &a["url_citation"] } else { a };
        let (start, end) = (
            c["start_index"].as_u64().unwrap() as usize,
            c["end_index"].as_u64().unwrap() as usize,
        );
        let marker: String = chars[start..end].iter().collect();
        assert!(
            marker.starts_with('[')
                && marker.ends_with(']')
                && marker[1..marker.len() - 1].parse::<u32>().is_ok(),
            "the span {start}..{end} is a marker: {marker:?}"
        );
        assert!(!c["url"].as_str().unwrap().is_empty(), "{a}");
        assert!(!c["title"].as_str().unwrap().is_empty(), "{a}");
    }
    assert!(
        !text.contains("[doc:"),
        "no fleet marker reaches the client: {text}"
    );
}

/// OpenAI's recorded streams, read in place: `shared/conformance` beside
/// this checkout (its SOURCES.md says where each comes from).
fn conformance(dir: &str) -> PathBuf {
    let path = support::root().join("../shared/conformance").join(dir);
    assert!(
        path.is_dir(),
        "the recorded OpenAI streams are expected in {} (shared/conformance beside the checkout)",
        path.display()
    );
    path
}

const LIGHTHOUSE: &str = "How do lighthouse keepers warn ships?";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_chat_completions_answer_with_citations_streamed_and_not() {
    let door = Door::start().await;
    let key = door.key("acme", &[]);
    let ask = |stream: bool| {
        json!({
            "model": "default",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": LIGHTHOUSE}],
            "stream": stream,
            "stream_options": {"include_usage": true},
            "temperature": 0.3,
        })
    };

    let r = door.post("/v1/chat/completions", &key, &ask(false)).await;
    assert_eq!(r.status(), 200);
    assert!(r.headers().contains_key("x-toolfleet-invocation-id"));
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["object"], "chat.completion");
    assert_eq!(body["model"], "default");
    let choice = &body["choices"][0];
    assert_eq!(choice["finish_reason"], "stop");
    assert_eq!(choice["message"]["role"], "assistant");
    let content = choice["message"]["content"].as_str().unwrap();
    assert!(content.starts_with("Lighthouses warn ships:"), "{content}");
    check_citations(
        content,
        choice["message"]["annotations"].as_array().unwrap(),
        true,
    );
    assert!(
        body["usage"]["total_tokens"].as_u64().unwrap() > 0,
        "{body}"
    );

    let r = door.post("/v1/chat/completions", &key, &ask(true)).await;
    assert_eq!(r.status(), 200);
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("text/event-stream"),
        "{:?}",
        r.headers()
    );
    let streamed = check_chat_stream(&frames(&r.text().await.unwrap()), true);
    assert_eq!(streamed.finish_reason.as_deref(), Some("stop"));
    assert!(
        streamed.content.starts_with("Lighthouses warn ships:"),
        "{streamed:?}"
    );
    check_citations(&streamed.content, &streamed.annotations, true);

    // The same checks hold for what api.openai.com streamed.
    for file in ["plain_content.sse", "refusal.sse", "max_tokens_length.sse"] {
        let recorded = std::fs::read_to_string(conformance("openai-chat-sse").join(file)).unwrap();
        let seen = check_chat_stream(&frames(&recorded), true);
        assert!(seen.finish_reason.is_some(), "{file}");
    }
    let recorded =
        std::fs::read_to_string(conformance("openai-chat-sse").join("plain_content.sse")).unwrap();
    assert_eq!(
        check_chat_stream(&frames(&recorded), true).content.len(),
        159
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_responses_answer_with_citations_streamed_and_not() {
    let door = Door::start().await;
    let key = door.key("acme", &[]);
    let ask = |stream: bool| {
        json!({
            "model": "default",
            "instructions": "Be brief.",
            "input": [{"role": "user", "content": [{"type": "input_text", "text": LIGHTHOUSE}]}],
            "stream": stream,
        })
    };

    let r = door.post("/v1/responses", &key, &ask(false)).await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["object"], "response");
    assert_eq!(body["status"], "completed");
    assert!(body["id"].as_str().unwrap().starts_with("resp_"));
    let part = &body["output"][0]["content"][0];
    assert_eq!(body["output"][0]["type"], "message");
    assert_eq!(part["type"], "output_text");
    let text = part["text"].as_str().unwrap();
    check_citations(text, part["annotations"].as_array().unwrap(), false);
    let usage = &body["usage"];
    assert!(usage["output_tokens"].as_u64().unwrap() > 0, "{usage}");
    assert_eq!(
        usage["total_tokens"].as_u64().unwrap(),
        usage["input_tokens"].as_u64().unwrap() + usage["output_tokens"].as_u64().unwrap()
    );
    // The answer can be read again by its id.
    let again: Value = door
        .get(
            &format!("/v1/responses/{}", body["id"].as_str().unwrap()),
            &key,
        )
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(again["status"], "completed");
    assert_eq!(again["output"][0]["content"][0]["text"], part["text"]);

    let r = door.post("/v1/responses", &key, &ask(true)).await;
    assert_eq!(r.status(), 200);
    let events = response_events(&frames(&r.text().await.unwrap()));
    let seen = check_responses_stream(&events);
    let expected = [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.annotation.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ];
    let distinct: Vec<&str> = seen.types.iter().fold(Vec::new(), |mut v, t| {
        if !v.contains(&t.as_str()) {
            v.push(t.as_str());
        }
        v
    });
    assert_eq!(distinct, expected, "{:?}", seen.types);
    check_citations(&seen.text, &seen.annotations, false);
    let done = seen.response["output"][0]["content"][0]["annotations"].clone();
    assert_eq!(done.as_array().unwrap(), &seen.annotations);

    // The same checks hold for what api.openai.com streamed (one response
    // after another in the agent-loop recording; a failure in the other).
    let mut checked = 0;
    for file in [
        "openai-reasoning-encrypted-content.1.chunks.jsonl",
        "openai-client-tool-search.2.chunks.jsonl",
        "openai-error.1.chunks.jsonl",
    ] {
        let lines =
            std::fs::read_to_string(conformance("openai-responses-events").join(file)).unwrap();
        let mut response: Vec<Value> = Vec::new();
        for line in lines.lines().filter(|l| !l.trim().is_empty()) {
            let e: Value = serde_json::from_str(line).unwrap();
            if e["type"] == "response.created" && !response.is_empty() {
                check_responses_stream(&std::mem::take(&mut response));
                checked += 1;
            }
            response.push(e);
        }
        let last = check_responses_stream(&response);
        checked += 1;
        if file.starts_with("openai-reasoning") {
            assert_eq!(last.text, "The final result is **570**.");
        }
    }
    assert_eq!(checked, 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_models_are_the_profiles_a_key_may_use() {
    let door = Door::start().await;
    let ids = |body: Value| -> Vec<String> {
        assert_eq!(body["object"], "list");
        body["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|m| {
                assert_eq!(m["object"], "model");
                assert_eq!(m["owned_by"], "toolfleet");
                assert!(m["created"].as_u64().unwrap() > 1_700_000_000);
                m["id"].as_str().unwrap().to_string()
            })
            .collect()
    };
    let acme = door.key("acme", &[]);
    let narrow = door.key("acme", &["--profiles", "default,guarded"]);
    let globex = door.key("globex", &[]);
    let models = |key: &str| {
        let key = key.to_string();
        let door = &door;
        async move { ids(door.get("/v1/models", &key).await.json().await.unwrap()) }
    };
    assert_eq!(models(&acme).await, ["acme-extra", "default", "guarded"]);
    assert_eq!(models(&narrow).await, ["default", "guarded"]);
    assert_eq!(
        models(&globex).await,
        ["default", "globex-canary-7f3a", "guarded"]
    );
}

/// Asserts an error answer in OpenAI's shape, with this status and code;
/// returns its body.
async fn assert_error(r: reqwest::Response, status: u16, code: &str) -> Value {
    assert_eq!(r.status(), status, "{:?}", r.headers());
    assert!(
        r.headers()["content-type"]
            .to_str()
            .unwrap()
            .starts_with("application/json"),
        "{:?}",
        r.headers()
    );
    let body: Value = r.json().await.unwrap();
    let e = &body["error"];
    assert_eq!(e["code"], code, "{body}");
    assert!(
        e["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{body}"
    );
    assert!(e["type"].is_string() && e.get("param").is_some(), "{body}");
    body
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_refuses_in_openai_shape_with_the_right_status() {
    let door = Door::start_with(script(), |c| c.max_body_bytes = 64 * 1024).await;
    let key = door.key("acme", &["--profiles", "default"]);
    let hi = json!([{"role": "user", "content": "hi"}]);
    let chat = |model: &str| json!({"model": model, "messages": hi});
    let before = door.env.model.requests().len();

    // 401: no key, a malformed one, an unknown one; the key is never
    // repeated.
    let r = door
        .http
        .post(door.url("/v1/chat/completions"))
        .json(&chat("default"))
        .send()
        .await
        .unwrap();
    assert_error(r, 401, "invalid_api_key").await;
    let r = door
        .post("/v1/chat/completions", "sk-not-ours", &chat("default"))
        .await;
    let body = assert_error(r, 401, "invalid_api_key").await;
    assert!(!body.to_string().contains("sk-not-ours"));
    let forged = format!("tf_{}", "A".repeat(43));
    let r = door
        .post("/v1/chat/completions", &forged, &chat("default"))
        .await;
    let body = assert_error(r, 401, "invalid_api_key").await;
    assert!(!body.to_string().contains(&forged));
    assert_error(
        door.get("/v1/models", &forged).await,
        401,
        "invalid_api_key",
    )
    .await;

    // 403: a profile of acme's this key may not use; 404: one that does not
    // exist, or another tenant's (not revealed).
    let r = door
        .post("/v1/chat/completions", &key, &chat("acme-extra"))
        .await;
    assert_error(r, 403, "model_not_allowed").await;
    let r = door
        .post(
            "/v1/responses",
            &key,
            &json!({"model": "nope", "input": "hi"}),
        )
        .await;
    let body = assert_error(r, 404, "model_not_found").await;
    assert_eq!(body["error"]["param"], "model");
    let r = door
        .post("/v1/chat/completions", &key, &chat("globex-canary-7f3a"))
        .await;
    assert_error(r, 404, "model_not_found").await;

    // 400: malformed JSON, no messages, what cannot be mapped.
    let r = door
        .http
        .post(door.url("/v1/chat/completions"))
        .bearer_auth(&key)
        .header("content-type", "application/json")
        .body("{\"model\": \"default\", \"messages\": [")
        .send()
        .await
        .unwrap();
    assert_error(r, 400, "invalid_request").await;
    for (body, param) in [
        (json!({"model": "default", "messages": []}), "messages"),
        (
            json!({"model": "default", "messages": hi, "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tools",
        ),
        (
            json!({"model": "default", "messages": [{"role": "tool", "tool_call_id": "c", "content": "x"}]}),
            "messages[0].role",
        ),
        (json!({"model": "default", "messages": hi, "n": 3}), "n"),
    ] {
        let r = door.post("/v1/chat/completions", &key, &body).await;
        assert_eq!(r.status(), 400);
        let e: Value = r.json().await.unwrap();
        assert_eq!(e["error"]["param"], param, "{e}");
    }
    let r = door
        .post(
            "/v1/responses",
            &key,
            &json!({"model": "default", "input": "hi", "previous_response_id": "resp_x"}),
        )
        .await;
    assert_error(r, 400, "unsupported_parameter").await;

    // 413: a body over the limit, declared or not.
    let big = json!({"model": "default", "messages": [{"role": "user", "content": "x".repeat(70 * 1024)}]});
    let r = door.post("/v1/chat/completions", &key, &big).await;
    assert_error(r, 413, "request_too_large").await;
    let chunked = reqwest::Body::wrap_stream(futures::stream::iter(vec![Ok::<_, std::io::Error>(
        bytes::Bytes::from(big.to_string()),
    )]));
    let r = door
        .http
        .post(door.url("/v1/chat/completions"))
        .bearer_auth(&key)
        .body(chunked)
        .send()
        .await
        .unwrap();
    assert_error(r, 413, "request_too_large").await;

    // 404 for a path the gateway does not serve; 404 for a response of
    // nobody.
    assert_error(door.get("/v1/embeddings", &key).await, 404, "not_found").await;
    assert_error(
        door.get("/v1/responses/resp_inv-nobody", &key).await,
        404,
        "not_found",
    )
    .await;

    // None of it reached the model.
    assert_eq!(door.env.model.requests().len(), before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_a_rate_limited_tenant_gets_429_with_retry_after() {
    let door = Door::start().await;
    let key = door.key("initech", &[]);
    // One model call a minute: the first request takes it; a later one is
    // refused before any output (a minute boundary between two requests
    // gives one more).
    let mut refused = None;
    for i in 0..3 {
        let stream = i % 2 == 1;
        let body = json!({"model": "default", "messages": [{"role": "user", "content": "hello"}], "stream": stream});
        let r = door.post("/v1/chat/completions", &key, &body).await;
        if r.status() == 429 {
            refused = Some(r);
            break;
        }
        assert_eq!(r.status(), 200);
        let _ = r.text().await;
    }
    let r = refused.expect("a request is refused once the minute's call is used");
    let after: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&after), "Retry-After {after}");
    let body = assert_error(r, 429, "rate_limit_exceeded").await;
    assert_eq!(body["error"]["type"], "requests");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("rate_limited")
    );
    // The Responses API says the same.
    let r = door
        .post(
            "/v1/responses",
            &key,
            &json!({"model": "default", "input": "hello", "stream": true}),
        )
        .await;
    if r.status() == 429 {
        assert!(r.headers().contains_key("retry-after"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_keys_are_listed_without_secrets_and_revoked_at_once() {
    let door = Door::start().await;
    let key = door.key("acme", &["--user", "ann", "--name", "ci bot"]);
    let other = door.key("globex", &[]);
    let hello = json!({"model": "default", "messages": [{"role": "user", "content": "hello"}]});
    assert_eq!(
        door.post("/v1/chat/completions", &key, &hello)
            .await
            .status(),
        200
    );

    let (code, stdout, _) = door.keys(&["ls", "--tenant", "acme", "-o", "json"]);
    assert_eq!(code, Some(0));
    let listed: Value = serde_json::from_str(&stdout).unwrap();
    let listed = listed.as_array().unwrap();
    assert_eq!(listed.len(), 1, "{stdout}");
    assert_eq!(listed[0]["tenant"], "acme");
    assert_eq!(listed[0]["user"], "ann");
    assert_eq!(listed[0]["name"], "ci bot");
    assert_eq!(listed[0]["hint"], key[..7]);
    let (_, table, _) = door.keys(&["ls"]);
    for shown in [&stdout, &table] {
        assert!(
            !shown.contains(&key) && !shown.contains(&key[7..]),
            "{shown}"
        );
        assert!(
            !shown.contains(&toolfleet::keys::sha256_hex(&key)),
            "{shown}"
        );
    }
    assert!(
        table.contains("globex") && table.contains("ci bot"),
        "{table}"
    );

    let id = listed[0]["id"].as_str().unwrap();
    let (code, _, stderr) = door.keys(&["revoke", id]);
    assert_eq!(code, Some(0), "{stderr}");
    let r = door.post("/v1/chat/completions", &key, &hello).await;
    assert_error(r, 401, "invalid_api_key").await;
    assert_eq!(
        door.post("/v1/chat/completions", &other, &hello)
            .await
            .status(),
        200
    );
    assert_eq!(door.keys(&["revoke", id]).0, Some(1));
    assert_eq!(door.keys(&["add", "--tenant", "no/such"]).0, Some(64));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_a_client_that_goes_away_cancels_its_job() {
    let mut slow = script();
    slow["chunkDelayMs"] = json!(100);
    let door = Door::start_with(slow, |_| {}).await;
    let key = door.key("acme", &[]);
    let mut events = door
        .env
        .subscribe("toolfleet.chat.events.acme.*".into())
        .await;
    let body = json!({"model": "default", "stream": true,
        "messages": [{"role": "user", "content": "Tell me a long story."}]});
    let r = door.post("/v1/chat/completions", &key, &body).await;
    assert_eq!(r.status(), 200);
    let invocation = r.headers()["x-toolfleet-invocation-id"]
        .to_str()
        .unwrap()
        .to_string();
    // Read until some text has come, then hang up.
    let mut stream = r.bytes_stream();
    let mut seen = String::new();
    while !seen.contains("word") {
        let chunk = tokio::time::timeout(WAIT, stream.next())
            .await
            .expect("text in time")
            .expect("more")
            .unwrap();
        seen.push_str(&String::from_utf8_lossy(&chunk));
    }
    drop(stream);
    // The fleet hears the cancel: the invocation ends `cancelled` and the
    // cancel is written down.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let e = tokio::time::timeout_at(deadline, events.next())
            .await
            .expect("the invocation ends in time")
            .unwrap();
        let e: Value = serde_json::from_slice(&e.payload).unwrap();
        if e["invocationId"] == invocation.as_str() && e["type"] == "error" {
            assert_eq!(e["code"], "cancelled", "{e}");
            break;
        }
        assert_ne!(e["type"], "completed", "the answer ran to its end: {e}");
    }
    door.env.wait_for_cancel_written("acme", &invocation).await;

    // Not streamed: hanging up while the answer is awaited cancels too.
    let impatient = reqwest::Client::builder()
        .timeout(Duration::from_millis(800))
        .build()
        .unwrap();
    let slow =
        json!({"model": "default", "messages": [{"role": "user", "content": "Answer slowly."}]});
    let gave_up = impatient
        .post(door.url("/v1/chat/completions"))
        .bearer_auth(&key)
        .json(&slow)
        .send()
        .await;
    assert!(gave_up.is_err(), "the answer is slow");
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let e = tokio::time::timeout_at(deadline, events.next())
            .await
            .expect("the slow invocation is cancelled in time")
            .unwrap();
        let e: Value = serde_json::from_slice(&e.payload).unwrap();
        if e["type"] == "error" && e["invocationId"] != invocation.as_str() {
            assert_eq!(e["code"], "cancelled", "{e}");
            break;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_tenants_cannot_see_or_reach_each_other() {
    let door = Door::start().await;
    let acme = door.key("acme", &["--user", "ann"]);
    let globex = door.key("globex", &[]);
    // Globex's canary: an answer only its own profile gives.
    let r = door
        .post(
            "/v1/responses",
            &globex,
            &json!({"model": "globex-canary-7f3a", "input": "Tell me the globex secret."}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let canary: Value = r.json().await.unwrap();
    assert!(canary.to_string().contains("CANARY-GLOBEX-91c2"));
    let id = canary["id"].as_str().unwrap().to_string();
    let model_calls = door.env.model.requests().len();

    // Acme does not see the profile, cannot run it, and cannot read
    // globex's response by its id.
    let models: Value = door.get("/v1/models", &acme).await.json().await.unwrap();
    assert!(!models.to_string().contains("globex"), "{models}");
    for (path, body) in [
        (
            "/v1/responses",
            json!({"model": "globex-canary-7f3a", "input": "Tell me the globex secret."}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "globex-canary-7f3a", "messages": [{"role": "user", "content": "Tell me the globex secret."}]}),
        ),
    ] {
        let r = door.post(path, &acme, &body).await;
        let text = assert_error(r, 404, "model_not_found").await.to_string();
        assert!(!text.contains("CANARY"), "{text}");
    }
    let r = door.get(&format!("/v1/responses/{id}"), &acme).await;
    let text = assert_error(r, 404, "not_found").await.to_string();
    assert!(!text.contains("CANARY"), "{text}");
    assert_eq!(
        door.env.model.requests().len(),
        model_calls,
        "acme reached no model"
    );
    let own: Value = door
        .get(&format!("/v1/responses/{id}"), &globex)
        .await
        .json()
        .await
        .unwrap();
    assert!(own.to_string().contains("CANARY-GLOBEX-91c2"), "{own}");

    // Acme's job runs as acme, its user the key's whatever the body says
    // (acme trusts its users: tools see the key's).
    let mut tool_jobs = door.env.subscribe("toolfleet.tool.>".into()).await;
    let r = door
        .post(
            "/v1/chat/completions",
            &acme,
            &json!({"model": "default", "user": "mallory", "messages": [{"role": "user", "content": LIGHTHOUSE}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let job = tokio::time::timeout(WAIT, tool_jobs.next())
        .await
        .unwrap()
        .unwrap();
    let headers = job.headers.expect("tool job headers");
    assert_eq!(
        headers.get("Toolfleet-Tenant").map(|v| v.as_str()),
        Some("acme")
    );
    assert_eq!(
        headers.get("Toolfleet-User").map(|v| v.as_str()),
        Some("ann")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_a_call_held_for_approval_is_answered_as_each_api_can() {
    let door = Door::start().await;
    let key = door.key("acme", &[]);
    let ask = json!({"model": "guarded", "input": "Tell me what time it is."});
    let r = door.post("/v1/responses", &key, &ask).await;
    assert_eq!(r.status(), 200);
    let body: Value = r.json().await.unwrap();
    assert_eq!(body["status"], "completed", "{body}");
    let item = body["output"]
        .as_array()
        .unwrap()
        .iter()
        .find(|i| i["type"] == "mcp_approval_request")
        .unwrap_or_else(|| panic!("an approval request item: {body}"))
        .clone();
    assert_eq!(item["server_label"], "toolfleet");
    assert_eq!(item["name"], "system:current_datetime@1.0.0");
    assert!(item["arguments"].is_string());
    let call_id = item["id"].as_str().unwrap().strip_prefix("mcpr_").unwrap();
    let id = body["id"].as_str().unwrap();
    let invocation = id.strip_prefix("resp_").unwrap();
    // Waiting: in progress until an approver decides; then the answer.
    let waiting: Value = door
        .get(&format!("/v1/responses/{id}"), &key)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(waiting["status"], "in_progress", "{waiting}");
    let (code, _, stderr) = support::toolfleet_at(
        &door.env.nats.url(),
        &["approve", "--tenant", "acme", invocation, call_id],
    );
    assert_eq!(code, Some(0), "{stderr}");
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let now: Value = door
            .get(&format!("/v1/responses/{id}"), &key)
            .await
            .json()
            .await
            .unwrap();
        if now["status"] == "completed" {
            let text = now["output"][0]["content"][0]["text"].as_str().unwrap();
            assert!(text.starts_with("It is "), "{now}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the answer after approval: {now}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Chat Completions, streamed: the text says what waits, and the last
    // chunk names the calls.
    let r = door
        .post(
            "/v1/chat/completions",
            &key,
            &json!({"model": "guarded", "stream": true, "messages": [{"role": "user", "content": "Tell me what time it is."}]}),
        )
        .await;
    assert_eq!(r.status(), 200);
    let seen = check_chat_stream(&frames(&r.text().await.unwrap()), false);
    assert_eq!(seen.finish_reason.as_deref(), Some("stop"));
    assert!(seen.content.contains("waits for approval"), "{seen:?}");
    let ext = seen.extension.expect("the toolfleet extension");
    assert_eq!(ext["status"], "approval_required");
    assert_eq!(ext["approvals"][0]["tool"], "system:current_datetime@1.0.0");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_times_out_with_504_and_cancels_and_answers_503_without_nats() {
    let mut door = Door::start_with(script(), |c| c.timeout = Duration::from_secs(2)).await;
    let key = door.key("acme", &[]);
    let mut events = door
        .env
        .subscribe("toolfleet.chat.events.acme.*".into())
        .await;
    let slow =
        json!({"model": "default", "messages": [{"role": "user", "content": "Answer slowly."}]});
    let r = door.post("/v1/chat/completions", &key, &slow).await;
    assert_error(r, 504, "timeout").await;
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let e = tokio::time::timeout_at(deadline, events.next())
            .await
            .unwrap()
            .unwrap();
        let e: Value = serde_json::from_slice(&e.payload).unwrap();
        if e["type"] == "error" {
            // Given up by the gateway (cancelled), or past the job's own
            // deadline, which is the same.
            assert!(
                e["code"] == "cancelled" || e["code"] == "deadline_exceeded",
                "{e}"
            );
            break;
        }
    }

    door.env.nats.stop();
    let hello = json!({"model": "default", "messages": [{"role": "user", "content": "hello"}]});
    let r = door.post("/v1/chat/completions", &key, &hello).await;
    assert_error(r, 503, "service_unavailable").await;
}

/// Every `toolfleet_gateway_*` metric the gateway exports is in the
/// metrics table of ops/README.md and on the dashboard, and the other way
/// round; its labels are the route and the status, never a key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_metrics_count_requests_by_route_and_status() {
    let door = Door::start().await;
    let key = door.key("acme", &[]);
    let hello = json!({"model": "default", "messages": [{"role": "user", "content": "hello"}], "stream": true});
    let r = door.post("/v1/chat/completions", &key, &hello).await;
    assert_eq!(r.status(), 200);
    let _ = r.text().await;
    let _ = door.get("/v1/models", "tf_nope").await;
    let text = door.env.metrics_text().await;
    assert!(
        text.contains(
            r#"toolfleet_gateway_requests_total{route="chat_completions",status="200"} 1"#
        ),
        "{text}"
    );
    assert!(text.contains(r#"toolfleet_gateway_requests_total{route="models",status="401"} 1"#));
    assert!(text.contains(
        r#"toolfleet_gateway_request_duration_seconds_count{route="chat_completions"} 1"#
    ));
    assert!(text.contains(r#"toolfleet_gateway_requests_in_flight{route="chat_completions"} 0"#));
    assert!(!text.contains("tf_"), "no key in the metrics");
    let exported: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|n| n.starts_with("toolfleet_gateway_"))
        .map(str::to_string)
        .collect();
    assert_eq!(exported.len(), 3, "{exported:?}");
    let documented = |text: &str| -> BTreeSet<String> {
        text.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
            .filter(|w| w.starts_with("toolfleet_gateway_"))
            .map(|w| {
                ["_bucket", "_count", "_sum"]
                    .iter()
                    .fold(w.to_string(), |w, s| {
                        w.strip_suffix(s).map_or(w.clone(), str::to_string)
                    })
            })
            .collect()
    };
    let readme = std::fs::read_to_string(support::root().join("ops/README.md")).unwrap();
    let dashboard =
        std::fs::read_to_string(support::root().join("ops/grafana/dashboards/toolfleet.json"))
            .unwrap();
    assert_eq!(
        documented(&readme),
        exported,
        "ops/README.md's metrics table"
    );
    assert_eq!(documented(&dashboard), exported, "the dashboard's panels");
}

/// The official `openai` Python package (tests/gateway/openai_client.py)
/// against the gateway: Chat Completions and Responses, streamed and not,
/// with citations as annotations, usage, and its own error types.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_the_official_openai_python_client_gets_cited_answers() {
    let door = Door::start().await;
    let key = door.key("acme", &[]);
    let child = tokio::process::Command::new("python3")
        .arg(support::root().join("tests/gateway/openai_client.py"))
        .arg(door.base())
        .arg(&key)
        .arg(LIGHTHOUSE)
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), child)
        .await
        .expect("the client finishes")
        .expect("python3 runs (the openai package: scripts/ensure-servers installs it)");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "openai_client.py failed:\n{stderr}");
    let seen: Value = serde_json::from_slice(&out.stdout).expect("one JSON line");
    for api in ["chat", "chat_stream", "responses", "responses_stream"] {
        let text = seen[api]["text"]
            .as_str()
            .unwrap_or_else(|| panic!("{api}: {seen}"));
        assert!(text.starts_with("Lighthouses warn ships:"), "{api}: {text}");
        assert!(
            seen[api]["citations"].as_u64().unwrap() > 0,
            "{api}: {seen}"
        );
        assert!(
            seen[api]["total_tokens"].as_u64().unwrap() > 0,
            "{api}: {seen}"
        );
    }
    assert_eq!(seen["errors"]["bad_key"], 401);
    assert_eq!(seen["errors"]["unknown_model"], 404);
    assert_eq!(seen["models"], json!(["acme-extra", "default", "guarded"]));
}

/// Debian's curl streams one answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_curl_streams_an_answer() {
    let door = Door::start().await;
    let key = door.key("acme", &[]);
    let body = json!({"model": "default", "stream": true, "stream_options": {"include_usage": true},
        "messages": [{"role": "user", "content": LIGHTHOUSE}]});
    let child = tokio::process::Command::new("curl")
        .args(["-sS", "-N", "--fail-with-body", "--max-time", "60"])
        .arg("-H")
        .arg(format!("Authorization: Bearer {key}"))
        .args(["-H", "Content-Type: application/json", "-d"])
        .arg(body.to_string())
        .arg(door.url("/v1/chat/completions"))
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(90), child)
        .await
        .expect("curl finishes")
        .expect("curl runs (Debian package curl)");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let seen = check_chat_stream(&frames(&String::from_utf8_lossy(&out.stdout)), true);
    assert!(
        seen.content.starts_with("Lighthouses warn ships:"),
        "{seen:?}"
    );
    check_citations(&seen.content, &seen.annotations, true);
}

/// The passwords of every identity `ops/nats/auth.conf` names (each
/// `$TOOLFLEET_NATS_<ROLE>_PASSWORD`), as the server's environment; and
/// the one of `user`.
fn auth_passwords(auth: &str) -> Vec<(String, String)> {
    let mut vars: Vec<String> = auth
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == '$'))
        .filter_map(|w| w.strip_prefix('$'))
        .filter(|w| w.starts_with("TOOLFLEET_NATS_") && w.ends_with("_PASSWORD"))
        .map(str::to_string)
        .collect();
    vars.sort();
    vars.dedup();
    vars.into_iter()
        .map(|v| (v.clone(), format!("pw-{v}")))
        .collect()
}

/// A fleet process of a role of `ops/nats/auth.conf`, killed on drop.
struct Role(std::process::Child);

impl Drop for Role {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn role(bin: &str, user: &str, nats_url: &str, extra: &[(&str, String)]) -> Role {
    let inbox = match user.strip_prefix("worker-") {
        Some(family) => format!("_INBOX.worker.{family}"),
        None => format!("_INBOX.{user}"),
    };
    let password = format!(
        "pw-TOOLFLEET_NATS_{}_PASSWORD",
        user.trim_start_matches("worker-").to_uppercase()
    );
    let child = std::process::Command::new(support::sibling_bin(bin))
        .current_dir(support::root())
        .env("TOOLFLEET_NATS_URL", nats_url)
        .env("TOOLFLEET_NATS_USER", user)
        .env("TOOLFLEET_NATS_PASSWORD", password)
        .env("TOOLFLEET_NATS_INBOX_PREFIX", inbox)
        .env(
            "TOOLFLEET_METRICS_ADDR",
            format!(
                "127.0.0.1:{}",
                toolfleet_local::servers::free_port().unwrap()
            ),
        )
        .envs(extra.iter().map(|(k, v)| (*k, v)))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap_or_else(|e| panic!("{bin}: {e}"));
    Role(child)
}

/// On a server running the shipped `ops/nats/auth.conf`, the gateway under
/// its own identity (`gateway`, inbox `_INBOX.gateway`) answers a key's
/// request through the orchestrator and a worker under theirs, without a
/// permission violation; and that identity may not touch tool jobs,
/// results, approvals or settings.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_answers_under_its_least_privilege_nats_identity() {
    use toolfleet_local::servers::{NatsConfig, NatsServer, RedisServer};
    let dir = support::root().join("ops/nats");
    let auth = std::fs::read_to_string(dir.join("auth.conf")).unwrap();
    assert!(auth.contains("TOOLFLEET_NATS_GATEWAY_PASSWORD"));
    let nats = NatsServer::start_configured(NatsConfig {
        extra: Some("include \"auth.conf\"".into()),
        files: vec![
            ("auth.conf".into(), auth.clone().into_bytes()),
            (
                "mcp-role.conf".into(),
                std::fs::read(dir.join("mcp-role.conf")).unwrap(),
            ),
        ],
        env: auth_passwords(&auth),
        ..NatsConfig::default()
    })
    .expect("nats-server with ops/nats/auth.conf");
    let redis = RedisServer::start().unwrap();
    let model = toolfleet_scripted::ScriptedServer::start(
        "127.0.0.1:0".parse().unwrap(),
        toolfleet_scripted::Script::from_json(&script().to_string()).unwrap(),
    )
    .await
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("toolfleet.toml");
    support::write_scripted_config(&config, &model.base_url());
    let common = [
        ("TOOLFLEET_REDIS_URL", redis.url()),
        ("TOOLFLEET_CONFIG", config.display().to_string()),
    ];
    let _fleet = [
        role(
            "toolfleet-orchestrator",
            "orchestrator",
            &nats.url(),
            &common,
        ),
        role(
            "toolfleet-worker-system",
            "worker-system",
            &nats.url(),
            &common,
        ),
    ];

    let mut args = toolfleet_service::args::NatsArgs::for_url(nats.url());
    args.user = Some("gateway".into());
    args.password = Some(toolfleet_service::args::Secret::new(
        "pw-TOOLFLEET_NATS_GATEWAY_PASSWORD",
    ));
    args.inbox_prefix = Some("_INBOX.gateway".into());
    args.connect_wait_secs = 10;
    let client = args.connect("toolfleet-gateway").await.unwrap();
    let store =
        toolfleet_store::CitationStore::connect(&redis.url(), "toolfleet", Duration::from_secs(60))
            .await
            .unwrap();
    let profiles = toolfleet_config::FleetConfig::load(&config).unwrap();
    let (shutdown, tracker) = (
        tokio_util::sync::CancellationToken::new(),
        tokio_util::task::TaskTracker::new(),
    );
    let _stop = shutdown.clone().drop_guard();
    let addr = toolfleet::gateway::start(
        tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap(),
        client,
        store,
        GatewayConfig::new(
            toolfleet_protocol::Subjects::new("toolfleet").unwrap(),
            profiles,
        ),
        &prometheus::Registry::new(),
        &tracker,
        shutdown.clone(),
    )
    .await
    .unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_toolfleet"))
        .args(["keys", "add", "--tenant", "acme"])
        .env("TOOLFLEET_REDIS_URL", redis.url())
        .output()
        .unwrap();
    let key = String::from_utf8(out.stdout).unwrap().trim().to_string();
    toolfleet_llm::install_crypto_provider();
    let http = reqwest::Client::new();
    // The orchestrator and the worker start on their own: ask until the
    // clock is offered (until then: 503, or an answer without the tool).
    let deadline = tokio::time::Instant::now() + WAIT;
    let answer = loop {
        let r = http
            .post(format!("http://{addr}/v1/chat/completions"))
            .bearer_auth(&key)
            .json(&json!({"model": "default", "stream": true,
                "messages": [{"role": "user", "content": "Tell me what time it is."}]}))
            .send()
            .await
            .unwrap();
        let status = r.status();
        if status == 200 {
            let seen = check_chat_stream(&frames(&r.text().await.unwrap()), false);
            if seen.content.starts_with("It is ") && !seen.content.contains("no_worker") {
                break seen.content;
            }
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no answer through the secure fleet: {}\n{}",
            status,
            nats.log()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert!(answer.contains("20"), "the clock answered: {answer}");
    let violations: Vec<String> = nats
        .log()
        .lines()
        .filter(|l| l.contains("Violation"))
        .map(str::to_string)
        .collect();
    assert!(violations.is_empty(), "{violations:#?}");

    // What the identity may not do: the server refuses each.
    let (tx, mut errors) = tokio::sync::mpsc::unbounded_channel();
    let hostile = async_nats::ConnectOptions::with_user_and_password(
        "gateway".into(),
        "pw-TOOLFLEET_NATS_GATEWAY_PASSWORD".into(),
    )
    .custom_inbox_prefix("_INBOX.gateway")
    .event_callback(move |event| {
        let tx = tx.clone();
        async move {
            if let async_nats::Event::ServerError(e) = event {
                let _ = tx.send(e.to_string().to_lowercase());
            }
        }
    })
    .connect(nats.url())
    .await
    .unwrap();
    for (what, subject) in [
        ("publish", "toolfleet.tool.system.current_datetime.1_0_0"),
        ("publish", "toolfleet.chat.approve.acme.inv-1"),
        ("publish", "toolfleet.reply.call_1"),
        ("publish", "$KV.TOOLFLEET_SETTINGS.acme.x"),
        ("subscription", "toolfleet.reply.>"),
        ("subscription", "toolfleet.tool.>"),
        ("subscription", "_INBOX.orchestrator.>"),
    ] {
        if what == "publish" {
            hostile.publish(subject, "forged".into()).await.unwrap();
        } else {
            let _sub = hostile.subscribe(subject).await.unwrap();
        }
        hostile.flush().await.unwrap();
        let wanted = format!(
            "permissions violation for {what} to \"{}\"",
            subject.to_lowercase()
        );
        loop {
            let e = tokio::time::timeout(WAIT, errors.recv())
                .await
                .unwrap_or_else(|_| panic!("{what} to {subject} was not refused"))
                .unwrap();
            if e.contains(&wanted) {
                break;
            }
        }
    }
}

/// A child process killed on drop.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Child {
    /// SIGTERM, then the exit status (within the wait).
    fn stop(&mut self) -> std::process::ExitStatus {
        std::process::Command::new("kill")
            .args(["-TERM", &self.0.id().to_string()])
            .status()
            .unwrap();
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                return status;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "no exit after SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// Asks `url` (a gateway) with `key` until it answers 200: the process
/// starts on its own.
async fn until_answered(http: &reqwest::Client, url: &str, key: &str, body: &Value) -> Value {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Ok(r) = http.post(url).bearer_auth(key).json(body).send().await
            && r.status() == 200
        {
            return r.json().await.unwrap();
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{url} never answered"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// `toolfleet gateway` as its own process (configured by its environment
/// variables) in front of a fleet: it answers, `/readyz` checks NATS and
/// Redis, `/metrics` counts its requests, SIGTERM stops it cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_the_command_serves_until_sigterm() {
    let door = Door::start().await;
    let key = door.key("acme", &[]);
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("toolfleet.toml");
    std::fs::write(
        &config,
        PROFILES.replace("{base_url}", door.env.model.base_url().as_str()),
    )
    .unwrap();
    let (listen, metrics) = (
        toolfleet_local::servers::free_port().unwrap(),
        toolfleet_local::servers::free_port().unwrap(),
    );
    let mut gateway = Child(
        std::process::Command::new(env!("CARGO_BIN_EXE_toolfleet"))
            .arg("gateway")
            .env("TOOLFLEET_NATS_URL", door.env.nats.url())
            .env("TOOLFLEET_REDIS_URL", door.env.redis.url())
            .env("TOOLFLEET_CONFIG", &config)
            .env("TOOLFLEET_GATEWAY_LISTEN", format!("127.0.0.1:{listen}"))
            .env("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{metrics}"))
            .env("TOOLFLEET_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let answer = until_answered(
        &door.http,
        &format!("http://127.0.0.1:{listen}/v1/chat/completions"),
        &key,
        &json!({"model": "acme-extra", "messages": [{"role": "user", "content": "hello"}]}),
    )
    .await;
    assert_eq!(
        answer["choices"][0]["message"]["content"],
        "Hello from the fleet."
    );
    let ready = door
        .http
        .get(format!("http://127.0.0.1:{metrics}/readyz"))
        .send()
        .await
        .unwrap();
    assert_eq!(ready.status(), 200);
    let said = ready.text().await.unwrap();
    assert!(
        said.contains("ok   nats") && said.contains("ok   redis"),
        "{said}"
    );
    let text = door
        .http
        .get(format!("http://127.0.0.1:{metrics}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        text.contains(
            r#"toolfleet_gateway_requests_total{route="chat_completions",status="200"} 1"#
        ),
        "{text}"
    );
    assert!(gateway.stop().success());
}

/// `toolfleet up --gateway`: the whole fleet and the gateway in one
/// process, as a developer runs it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_toolfleet_up_serves_it_beside_the_fleet() {
    let nats = toolfleet_local::servers::NatsServer::start().unwrap();
    let redis = toolfleet_local::servers::RedisServer::start().unwrap();
    let model = toolfleet_scripted::ScriptedServer::start(
        "127.0.0.1:0".parse().unwrap(),
        toolfleet_scripted::Script::from_json(&script().to_string()).unwrap(),
    )
    .await
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let config = tmp.path().join("toolfleet.toml");
    support::write_scripted_config(&config, &model.base_url());
    let (listen, metrics) = (
        toolfleet_local::servers::free_port().unwrap(),
        toolfleet_local::servers::free_port().unwrap(),
    );
    let mut up = Child(
        std::process::Command::new(env!("CARGO_BIN_EXE_toolfleet"))
            .args(["up", "--gateway"])
            .current_dir(support::root())
            .env("TOOLFLEET_NATS_URL", nats.url())
            .env("TOOLFLEET_REDIS_URL", redis.url())
            .env("TOOLFLEET_CONFIG", &config)
            .env("TOOLFLEET_INDEX_DIR", tmp.path().join("index"))
            .env("TOOLFLEET_GATEWAY_LISTEN", format!("127.0.0.1:{listen}"))
            .env("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{metrics}"))
            .env("TOOLFLEET_LOG", "warn")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_toolfleet"))
        .args(["keys", "add", "--tenant", "default"])
        .env("TOOLFLEET_REDIS_URL", redis.url())
        .output()
        .unwrap();
    let key = String::from_utf8(out.stdout).unwrap().trim().to_string();
    toolfleet_llm::install_crypto_provider();
    let http = reqwest::Client::new();
    let answer = until_answered(
        &http,
        &format!("http://127.0.0.1:{listen}/v1/responses"),
        &key,
        &json!({"model": "default", "input": "Tell me what time it is."}),
    )
    .await;
    let text = answer["output"][0]["content"][0]["text"].as_str().unwrap();
    assert!(text.starts_with("It is "), "{answer}");
    assert!(up.stop().success());
}
