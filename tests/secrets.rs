//! Secrets stay secret: canaries set as a model API key, as the password of
//! a deployment URL, and as a tool setting never appear in any chat event,
//! tool result, dead letter, log line (at debug level), metric or Redis
//! value — across success and failure paths. The fleet runs as separate
//! binaries so their logs are read as an operator would read them.

use std::io::Read;
use std::process::{Child, Command};
use std::time::Duration;

use futures::StreamExt;
use serde_json::json;
use toolfleet_protocol::{CallContext, InvocationContext};

use crate::support::{self, WAIT};

const KEY_CANARY: &str = "sk-canary-key-7f3a9c";
const URL_CANARY: &str = "urlcanary5d1e";
const SETTING_CANARY: &str = "setting-canary-2b8e";

struct Proc(Child, std::path::PathBuf);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `bin` with its output going to `log`.
fn spawn(bin: &str, env: &[(&str, String)], log: std::path::PathBuf) -> Proc {
    let out = std::fs::File::create(&log).unwrap();
    let mut cmd = Command::new(bin);
    cmd.current_dir(support::root())
        .stdout(out.try_clone().unwrap())
        .stderr(out);
    for (k, v) in env {
        cmd.env(k, v);
    }
    Proc(cmd.spawn().unwrap_or_else(|e| panic!("{bin}: {e}")), log)
}

/// Everything a process wrote, once it has been stopped.
fn output(mut p: Proc) -> String {
    let _ = p.0.kill();
    let _ = p.0.wait();
    let mut text = String::new();
    std::fs::File::open(&p.1)
        .unwrap()
        .read_to_string(&mut text)
        .unwrap();
    text
}

async fn metrics(port: u16) -> String {
    toolfleet_llm::install_crypto_provider();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Ok(r) = reqwest::get(format!("http://127.0.0.1:{port}/metrics")).await
            && let Ok(t) = r.text().await
        {
            return t;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no /metrics on {port}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn assert_clean(what: &str, text: &str) {
    for canary in [KEY_CANARY, URL_CANARY, SETTING_CANARY] {
        assert!(
            !text.contains(canary),
            "{what} holds the secret {canary}:\n{text}"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn canary_secrets_never_leave_their_place() {
    let nats = toolfleet_local::servers::NatsServer::start().unwrap();
    let redis = toolfleet_local::servers::RedisServer::start().unwrap();
    let script = toolfleet_scripted::Script::from_json(
        &json!({
            "rules": [
                { "whenUserContains": ["time"], "steps": [
                    { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
                    { "answer": "It is {{tool:current_datetime}}" }
                ] },
                { "whenUserContains": ["offset"], "steps": [
                    { "toolCalls": [ { "name": "current_datetime", "arguments": { "utcOffset": "nonsense" } } ] },
                    { "answer": "Could not." }
                ] }
            ]
        })
        .to_string(),
    )
    .unwrap();
    let model = toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
        .await
        .unwrap();
    let dead_port = toolfleet_local::servers::free_port().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("toolfleet.toml");
    std::fs::write(
        &config,
        format!(
            r#"
default_profile = "default"

[deployments.scripted]
base_url = "{base}"
model = "toolfleet-scripted"
api_key_env = "CANARY_KEY"

[deployments.broken]
base_url = "http://127.0.0.1:{dead_port}/v1"
model = "gone"
api_key_env = "CANARY_KEY"
connect_timeout_ms = 500
[deployments.broken.retry]
max_attempts = 1

[profiles.default]
deployment = "scripted"

[profiles.broken]
deployment = "broken"
"#,
            base = model.base_url()
        ),
    )
    .unwrap();
    // A password in a deployment URL is refused at start, without
    // repeating it.
    let with_password = dir.path().join("with-password.toml");
    std::fs::write(
        &with_password,
        format!(
            "[deployments.d]\nbase_url = \"http://user:{URL_CANARY}@127.0.0.1:{dead_port}/v1\"\nmodel = \"m\"\n[profiles.default]\ndeployment = \"d\"\n"
        ),
    )
    .unwrap();
    let refused = Command::new(support::sibling_bin("toolfleet-orchestrator"))
        .env("TOOLFLEET_CONFIG", &with_password)
        .env("TOOLFLEET_NATS_URL", nats.url())
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(64));
    let said = String::from_utf8_lossy(&refused.stderr).to_string()
        + &String::from_utf8_lossy(&refused.stdout);
    assert!(said.contains("user or password"), "{said}");
    assert_clean("a configuration error", &said);

    let (orchestrator, worker, ports) = start_pair(
        &nats.url(),
        &redis.url(),
        dir.path(),
        vec![
            ("TOOLFLEET_CONFIG", config.display().to_string()),
            ("CANARY_KEY", KEY_CANARY.to_string()),
        ],
        "toolfleet-worker-system",
        Vec::new(),
    )
    .await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = toolfleet_protocol::Subjects::new("toolfleet").unwrap();
    let mut seen = everything(&client).await;

    // Success: a tool round and an answer (the worker may need a catalog
    // refresh to be seen: ask until the tool ran).
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let job = toolfleet_protocol::client::question("what time is it?");
        let outcome = toolfleet_protocol::client::chat(&client, &subjects, &job, WAIT, |_| {})
            .await
            .expect("answered");
        if outcome.text.contains('T') && !outcome.text.contains("not available") {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{}", outcome.text);
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    // Failure: invalid tool arguments.
    let job = toolfleet_protocol::client::question("what is the offset?");
    toolfleet_protocol::client::chat(&client, &subjects, &job, WAIT, |_| {})
        .await
        .expect("answered");
    // Failure: an unreachable deployment (its key goes nowhere visible).
    let mut job = toolfleet_protocol::client::question("what time is it?");
    job.profile = Some("broken".into());
    let failed = toolfleet_protocol::client::chat(&client, &subjects, &job, WAIT, |_| {}).await;
    assert!(failed.is_err(), "{failed:?}");
    // A tool job carrying a secret setting, answered, then one dead-lettered.
    let inbox = subjects.reply_inbox();
    let mut replies = client.subscribe(inbox.clone()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    for (call_id, arguments) in [
        ("call_ok", json!({})),
        ("call_bad", json!({ "utcOffset": "nonsense" })),
    ] {
        let call = CallContext {
            invocation: InvocationContext::new("canary-1"),
            call_id: call_id.into(),
            tool_id: "system:current_datetime@1.0.0".parse().unwrap(),
            attempt: 1,
            reply_to: inbox.clone(),
            citation_floor: 0,
            new_call: false,
        };
        js.publish_with_headers(
            subjects.tool(&call.tool_id),
            call.to_headers(),
            json!({ "arguments": arguments, "settings": { "apiKey": SETTING_CANARY } })
                .to_string()
                .into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
        tokio::time::timeout(WAIT, replies.next())
            .await
            .expect("a result")
            .unwrap();
    }

    // Collect what was published.
    let mut published = String::new();
    while let Ok(Some(msg)) = tokio::time::timeout(Duration::from_millis(500), seen.next()).await {
        published.push_str(&String::from_utf8_lossy(&msg.payload));
        published.push('\n');
    }
    assert!(published.contains("completed") && published.contains("error"));
    assert_clean("a published event, result or dead letter", &published);
    for port in &ports {
        assert_clean("a metric", &metrics(*port).await);
    }
    let stored = redis_dump(&redis.url()).await;
    assert_clean("a Redis value", &stored);
    let logs = output(orchestrator) + &output(worker);
    assert!(logs.contains("DEBUG"), "debug logging was on: {logs}");
    assert_clean("a log line", &logs);
}

/// The orchestrator and one worker binary as separate processes (debug
/// logging, metrics on ports of their own), once both serve `/metrics`.
/// Returns them and their metrics ports.
async fn start_pair(
    nats: &str,
    redis: &str,
    dir: &std::path::Path,
    orchestrator_extra: Vec<(&'static str, String)>,
    worker_bin: &str,
    worker_extra: Vec<(&'static str, String)>,
) -> (Proc, Proc, Vec<u16>) {
    let ports: Vec<u16> = (0..2)
        .map(|_| toolfleet_local::servers::free_port().unwrap())
        .collect();
    let common = vec![
        ("TOOLFLEET_NATS_URL", nats.to_owned()),
        ("TOOLFLEET_REDIS_URL", redis.to_owned()),
        ("TOOLFLEET_LOG", "debug".to_string()),
    ];
    let mut orchestrator_env = common.clone();
    orchestrator_env.push(("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{}", ports[0])));
    orchestrator_env.extend(orchestrator_extra);
    let mut worker_env = common;
    worker_env.push(("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{}", ports[1])));
    worker_env.extend(worker_extra);
    let orchestrator = spawn(
        &support::sibling_bin("toolfleet-orchestrator"),
        &orchestrator_env,
        dir.join("orchestrator.log"),
    );
    let worker = spawn(
        &support::sibling_bin(worker_bin),
        &worker_env,
        dir.join("worker.log"),
    );
    for p in &ports {
        metrics(*p).await;
    }
    (orchestrator, worker, ports)
}

/// Everything a client, a caller or an operator could read on NATS.
async fn everything(
    client: &async_nats::Client,
) -> futures::stream::SelectAll<async_nats::Subscriber> {
    futures::stream::select_all([
        client.subscribe("toolfleet.chat.events.>").await.unwrap(),
        client.subscribe("toolfleet.reply.>").await.unwrap(),
        client.subscribe("toolfleet.deadletter.>").await.unwrap(),
    ])
}

/// Every key and value in Redis, as text.
async fn redis_dump(url: &str) -> String {
    let mut conn = redis::Client::open(url)
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut conn)
        .await
        .unwrap();
    assert!(!keys.is_empty());
    let mut stored = String::new();
    for key in keys {
        let kind: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(&mut conn)
            .await
            .unwrap();
        let value: String = match kind.as_str() {
            "string" => redis::cmd("GET")
                .arg(&key)
                .query_async(&mut conn)
                .await
                .unwrap(),
            "hash" => {
                let all: Vec<String> = redis::cmd("HGETALL")
                    .arg(&key)
                    .query_async(&mut conn)
                    .await
                    .unwrap();
                all.join("\n")
            }
            other => format!("{key}: {other}"),
        };
        stored.push_str(&key);
        stored.push_str(&value);
    }
    stored
}

const WEB_CANARY: &str = "brave-canary-key-91c4e";

/// The web worker's Brave key: sent as its header and nowhere else, even
/// by a backend that echoes it back in its results — the worker scrubs it
/// from results, references and errors before anything is published.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_web_workers_key_is_scrubbed_even_when_a_backend_echoes_it() {
    use axum::routing::get;
    let nats = toolfleet_local::servers::NatsServer::start().unwrap();
    let redis = toolfleet_local::servers::RedisServer::start().unwrap();
    // A hostile Brave: it echoes the key it was sent into every field.
    let received = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let seen_keys = received.clone();
    let app = axum::Router::new().route(
        "/brave",
        get(move |headers: axum::http::HeaderMap| {
            let seen_keys = seen_keys.clone();
            async move {
                let key = headers
                    .get("x-subscription-token")
                    .and_then(|v| v.to_str().ok())
                    .unwrap_or_default()
                    .to_owned();
                seen_keys.lock().unwrap().push(key.clone());
                axum::Json(json!({"web": {"results": [{
                    "title": format!("Bees {key}"),
                    "url": format!("https://bees.example/?k={key}"),
                    "description": format!("Your key is {key}."),
                }]}}))
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let brave = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });

    let script = toolfleet_scripted::Script::from_json(
        &json!({
            "rules": [
                { "whenUserContains": ["bees"], "steps": [
                    { "toolCalls": [ { "name": "web_search", "arguments": { "query": "bees" } } ] },
                    { "answer": "Found: {{tool:web_search}}" }
                ] },
                { "whenUserContains": ["metadata"], "steps": [
                    { "toolCalls": [ { "name": "web_read_page", "arguments": { "url": "http://169.254.169.254/latest/meta-data/" } } ] },
                    { "answer": "Refused: {{tool:web_read_page}}" }
                ] }
            ]
        })
        .to_string(),
    )
    .unwrap();
    let model = toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
        .await
        .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("toolfleet.toml");
    support::write_scripted_config(&config, &model.base_url());
    let settings = dir.path().join("web.toml");
    std::fs::write(
        &settings,
        format!(
            "[\"web:search\"]\nbackend = \"brave\"\nbraveUrl = \"http://{brave}/brave\"\n\
             braveApiKey = {{ env = \"BRAVE_KEY\" }}\n"
        ),
    )
    .unwrap();
    let (orchestrator, worker, ports) = start_pair(
        &nats.url(),
        &redis.url(),
        dir.path(),
        vec![("TOOLFLEET_CONFIG", config.display().to_string())],
        "toolfleet-worker-web",
        vec![
            ("TOOLFLEET_TOOL_SETTINGS", settings.display().to_string()),
            ("BRAVE_KEY", WEB_CANARY.to_string()),
        ],
    )
    .await;
    let client = async_nats::connect(nats.url()).await.unwrap();
    let subjects = toolfleet_protocol::Subjects::new("toolfleet").unwrap();
    let mut seen = everything(&client).await;
    // Ask until the web tools are in the catalog and ran.
    let deadline = tokio::time::Instant::now() + WAIT;
    let answer = loop {
        let job = toolfleet_protocol::client::question("what do you know about bees?");
        let outcome = toolfleet_protocol::client::chat(&client, &subjects, &job, WAIT, |_| {})
            .await
            .expect("answered");
        if outcome.text.contains("bees.example") {
            break outcome;
        }
        assert!(tokio::time::Instant::now() < deadline, "{}", outcome.text);
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    // The key went to the backend, came back in every field, and was
    // scrubbed: the answer shows where.
    assert_eq!(
        received.lock().unwrap().first().map(String::as_str),
        Some(WEB_CANARY)
    );
    assert!(answer.text.contains("[redacted]"), "{}", answer.text);
    assert!(
        answer
            .references
            .iter()
            .any(|r| r.title == "Bees [redacted]"),
        "{:?}",
        answer.references
    );
    // A blocked page: refused, the worker keeps serving.
    let job = toolfleet_protocol::client::question("read the metadata page");
    let refused = toolfleet_protocol::client::chat(&client, &subjects, &job, WAIT, |_| {})
        .await
        .expect("answered");
    assert!(refused.text.contains("link-local"), "{}", refused.text);

    let mut published = String::new();
    while let Ok(Some(msg)) = tokio::time::timeout(Duration::from_millis(500), seen.next()).await {
        published.push_str(&String::from_utf8_lossy(&msg.payload));
        published.push('\n');
    }
    assert!(published.contains("completed"));
    let clean = |what: &str, text: &str| {
        assert!(!text.contains(WEB_CANARY), "{what} holds the key:\n{text}");
    };
    clean("a published event, result or dead letter", &published);
    for port in &ports {
        clean("a metric", &metrics(*port).await);
    }
    clean("a Redis value", &redis_dump(&redis.url()).await);
    let logs = output(orchestrator) + &output(worker);
    assert!(logs.contains("DEBUG"), "debug logging was on: {logs}");
    clean("a log line", &logs);
}
