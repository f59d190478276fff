//! A poison trickle (issue 29, item 3): chat jobs whose header block the
//! NATS client cannot read, sent by one tenant over a raw connection while
//! another tenant submits valid jobs. The orchestrator never loses its
//! connection (the NATS server's record of closed connections says so),
//! and the bystander's jobs all finish. A tenant whose poisons reach its
//! limit is refused (`tenant_suspended`) until its cool-off ends, and
//! served again after.

use std::time::Duration;

use futures::StreamExt;
use serde_json::{Value, json};
use toolfleet_local::servers::NatsConfig;
use toolfleet_protocol::ChatJob;
use toolfleet_protocol::client::ClientError;

use crate::support::{self, Env, Options, WAIT};

/// Every kind of header block the client could not read (the tests of
/// `patches/async-nats` have the same and more): a value that is not
/// UTF-8, a line without `:`, a name with a space, a status that is not a
/// number.
const POISONS: [&[u8]; 4] = [
    b"NATS/1.0\r\nToolfleet-Tenant: \xff\xfe\r\n\r\n",
    b"NATS/1.0\r\nno colon here\r\n\r\n",
    b"NATS/1.0\r\nBad Name: v\r\n\r\n",
    b"NATS/1.0 abc\r\n\r\n",
];

fn hello_script() -> Value {
    json!({ "rules": [{ "whenUserContains": ["hello"], "steps": [ { "answer": "Hi." } ] }] })
}

/// A fleet (orchestrator, no workers) whose NATS server keeps a
/// monitoring endpoint, and that endpoint's port.
async fn monitored(profiles_toml: Option<String>) -> (Env, u16) {
    let monitor = toolfleet_local::servers::free_port().unwrap();
    let env = Env::start_with(
        hello_script(),
        Options {
            workers: vec![],
            data_source: None,
            profiles_toml,
            nats: NatsConfig {
                extra: Some(format!("http_port: {monitor}")),
                ..NatsConfig::default()
            },
            ..Options::default()
        },
    )
    .await;
    (env, monitor)
}

/// How many connections named `name` the NATS server has seen closed
/// (`/connz?state=closed`): each is a disconnect of that process.
async fn closed_connections(monitor: u16, name: &str) -> usize {
    connections(monitor, "closed", name).await
}

/// How many connections named `name` the NATS server lists in `state`
/// (`open` or `closed`).
async fn connections(monitor: u16, state: &str, name: &str) -> usize {
    let body = support::reqwest_get(&format!(
        "http://127.0.0.1:{monitor}/connz?state={state}&limit=1024"
    ))
    .await;
    let connz: Value = serde_json::from_str(&body).unwrap();
    connz["connections"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["name"] == name)
        .count()
}

/// A valid job of `tenant`, as a client writes it.
fn job_of(tenant: &str, text: &str) -> ChatJob {
    let mut job = toolfleet_protocol::client::question(text);
    job.tenant = Some(tenant.into());
    job
}

/// Sends `count` poison chat jobs of `tenant`, five a second, each over its
/// own raw connection; their invocation ids, in order.
async fn trickle(env: &Env, tenant: &str, count: usize) -> Vec<String> {
    let mut ids = Vec::new();
    let mut pace = tokio::time::interval(Duration::from_millis(200));
    for i in 0..count {
        pace.tick().await;
        let job = job_of(tenant, "hello poison");
        support::publish_raw(
            &env.nats.url(),
            None,
            &env.subjects.chat_submit(tenant),
            POISONS[i % POISONS.len()],
            &serde_json::to_vec(&job).unwrap(),
        )
        .await;
        ids.push(job.invocation_id);
    }
    ids
}

/// The terminal event's code of each invocation in `ids` (`tenant`'s), as
/// they arrive on `events`.
async fn error_codes(
    events: &mut async_nats::Subscriber,
    ids: &[String],
) -> std::collections::HashMap<String, String> {
    let mut codes = std::collections::HashMap::new();
    let deadline = tokio::time::Instant::now() + WAIT;
    while codes.len() < ids.len() {
        let msg = tokio::time::timeout_at(deadline, events.next())
            .await
            .unwrap_or_else(|_| panic!("terminal events of {ids:?}; got {codes:?}"))
            .unwrap();
        let event: Value = serde_json::from_slice(&msg.payload).unwrap();
        if event["type"] == "error" {
            let id = event["invocationId"].as_str().unwrap().to_string();
            assert!(ids.contains(&id), "{event}");
            codes.insert(id, event["code"].as_str().unwrap().to_string());
        }
    }
    codes
}

/// Acme sends a trickle of poison jobs while globex submits valid ones:
/// no disconnect, every globex job completes (none `too_many_attempts`),
/// every poison is answered `unreadable_headers`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_trickle_never_disconnects_the_orchestrator_and_bystanders_finish() {
    let (env, monitor) = monitored(None).await;
    let mut acme_events = env.subscribe("toolfleet.chat.events.acme.>".into()).await;
    let globex = async {
        let mut outcomes = Vec::new();
        for _ in 0..15 {
            let job = job_of("globex", "hello there");
            outcomes.push(env.submit(&job).await);
        }
        outcomes
    };
    // Fewer than the default limit (20 a minute): acme is not suspended.
    let (ids, outcomes) = tokio::join!(trickle(&env, "acme", 15), globex);
    for outcome in outcomes {
        match outcome {
            Ok(done) => assert_eq!(done.text, "Hi."),
            Err(ClientError::Failed { code, message }) => {
                panic!("a globex job failed: {code}: {message}")
            }
            Err(e) => panic!("a globex job did not finish: {e}"),
        }
    }
    let codes = error_codes(&mut acme_events, &ids).await;
    assert!(
        codes.values().all(|c| c == "unreadable_headers"),
        "{codes:?}"
    );
    // Every poison was answered, so each was received: a disconnect it
    // caused is on the server's record by now. (The orchestrator's
    // connection is listed under its name, so the count can see it.)
    assert!(
        connections(monitor, "open", "toolfleet-orchestrator").await >= 1,
        "the orchestrator's connection is not listed under its name"
    );
    assert_eq!(
        closed_connections(monitor, "toolfleet-orchestrator").await,
        0,
        "the orchestrator lost its connection"
    );
    // Nothing of the poisons is left in the queue (each is terminated
    // after its answer).
    support::chat_queue_drained(&env).await;
}

/// Acme's limit is 3 poisons a minute, its cool-off 8 s: its third poison
/// suspends it (a header the client cannot read, then bodies that do not
/// decode — both count). Its valid jobs are then refused at once with
/// `tenant_suspended` (an event, no dead letter, counted), globex's run,
/// and once the cool-off is over acme is served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_poison_limit_is_refused_until_its_cooloff_ends() {
    let profiles = r#"
default_profile = "default"
[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"
[profiles.default]
deployment = "scripted"
[tenants.acme]
poison_limit = 3
poison_window_secs = 60
poison_cooloff_secs = 8
"#;
    let (env, monitor) = monitored(Some(profiles.to_string())).await;
    let mut acme_events = env.subscribe("toolfleet.chat.events.acme.>".into()).await;
    let mut dead = env.subscribe("toolfleet.deadletter.chat".into()).await;

    // Under the limit, acme is served.
    env.submit(&job_of("acme", "hello first"))
        .await
        .expect("served before");
    // One poison of each kind: headers, then two bodies that do not decode
    // (their invocation id read from the header, so they are answered).
    let mut ids = trickle(&env, "acme", 1).await;
    for schema_breaking in [false, true] {
        let id = toolfleet_protocol::client::new_invocation_id();
        let body = if schema_breaking {
            format!(r#"{{"invocationId":"{id}","messages":"no"}}"#)
        } else {
            "not json".to_string()
        };
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(toolfleet_protocol::headers::INVOCATION_ID, id.as_str());
        env.client
            .publish_with_headers(env.subjects.chat_submit("acme"), headers, body.into())
            .await
            .unwrap();
        ids.push(id);
    }
    let codes = error_codes(&mut acme_events, &ids).await;
    assert_eq!(codes[&ids[0]], "unreadable_headers", "{codes:?}");
    assert_eq!(codes[&ids[1]], "malformed_job", "{codes:?}");
    assert_eq!(codes[&ids[2]], "malformed_job", "{codes:?}");
    for _ in 0..3 {
        next_dead_letter(&mut dead).await;
    }

    // Suspended: a valid job of acme is refused at once, not run.
    let refused = job_of("acme", "hello again");
    match env.submit(&refused).await {
        Err(ClientError::Failed { code, message }) => {
            assert_eq!(code, "tenant_suspended", "{message}");
            assert!(message.contains("could not be read"), "{message}");
        }
        other => panic!("acme was served while suspended: {other:?}"),
    }
    // Globex is not.
    env.submit(&job_of("globex", "hello there"))
        .await
        .expect("globex is served");
    let text = env.metrics_text().await;
    for line in [
        "toolfleet_chat_poison_total{tenant=\"acme\"} 3",
        "toolfleet_tenant_suspensions_total{tenant=\"acme\"} 1",
        "toolfleet_chat_suspended_total{tenant=\"acme\"} 1",
        "toolfleet_chat_jobs_total{outcome=\"suspended\"} 1",
    ] {
        assert!(text.contains(line), "{line} in\n{text}");
    }

    // After the cool-off, acme is served again.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        match env.submit(&job_of("acme", "hello later")).await {
            Ok(done) => {
                assert_eq!(done.text, "Hi.");
                break;
            }
            Err(ClientError::Failed { code, .. }) if code == "tenant_suspended" => {}
            Err(e) => panic!("{e}"),
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "acme is never served again"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    // The refusals were not dead-lettered (only the three poisons were).
    let more = tokio::time::timeout(Duration::from_millis(200), dead.next()).await;
    assert!(more.is_err(), "a refusal was dead-lettered: {more:?}");
    // The suspension left nothing in Redis, and no disconnect either.
    let mut c = env.redis_conn.clone();
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("toolfleet:tenant:*")
        .query_async(&mut c)
        .await
        .unwrap();
    assert!(keys.is_empty(), "{keys:?}");
    assert_eq!(
        closed_connections(monitor, "toolfleet-orchestrator").await,
        0
    );
}

async fn next_dead_letter(dead: &mut async_nats::Subscriber) -> Value {
    let msg = tokio::time::timeout(WAIT, dead.next())
        .await
        .expect("a dead letter")
        .unwrap();
    serde_json::from_slice(&msg.payload).unwrap()
}

/// Sends one `HPUB` of `block` and `payload` over a raw connection and
/// returns what the server said until it closed the connection or
/// answered the `PING` after it.
async fn publish_raw_answer(url: &str, subject: &str, block: &[u8], payload: &[u8]) -> String {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let stream = tokio::net::TcpStream::connect(url.trim_start_matches("nats://"))
        .await
        .unwrap();
    let (read, mut write) = stream.into_split();
    let mut lines = tokio::io::BufReader::new(read).lines();
    let mut out = b"CONNECT {\"verbose\":false,\"headers\":true,\"protocol\":1}\r\n".to_vec();
    let total = block.len() + payload.len();
    out.extend_from_slice(format!("HPUB {subject} {} {total}\r\n", block.len()).as_bytes());
    out.extend_from_slice(block);
    out.extend_from_slice(payload);
    out.extend_from_slice(b"\r\nPING\r\n");
    // The server may close the connection before it has read it all.
    let _ = write.write_all(&out).await;
    let mut said = String::new();
    while let Ok(Ok(Some(line))) = tokio::time::timeout(WAIT, lines.next_line()).await {
        said.push_str(&line);
        said.push('\n');
        if line == "PONG" {
            break;
        }
    }
    said
}

/// A header block larger than the server's `max_payload` (1 MiB here) is
/// refused to its publisher by the server: it reaches no subscriber and
/// costs the orchestrator nothing. (The client's own reading of a block
/// that large, readable or not, is the patched crate's unit test
/// `hmsg_with_a_very_large_header_block_is_read`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_larger_than_the_server_allows_is_refused_to_its_publisher_only() {
    let (env, monitor) = monitored(None).await;
    let mut block = b"NATS/1.0\r\nBig: ".to_vec();
    block.extend(std::iter::repeat_n(b'x', 2 * 1024 * 1024));
    block.extend_from_slice(b"\xff\r\n\r\n");
    let job = job_of("acme", "hello big");
    let said = publish_raw_answer(
        &env.nats.url(),
        &env.subjects.chat_submit("acme"),
        &block,
        &serde_json::to_vec(&job).unwrap(),
    )
    .await;
    assert!(said.contains("Maximum Payload"), "{said}");
    env.submit(&job_of("globex", "hello there"))
        .await
        .expect("globex is served");
    support::chat_queue_drained(&env).await;
    assert_eq!(
        closed_connections(monitor, "toolfleet-orchestrator").await,
        0
    );
}

/// A poison chat job found while Redis is down cannot be claimed, so it
/// cannot yet be proved to speak for its invocation: it is given back
/// (not dead-lettered, its sender not left without an answer) and, once
/// Redis is back, its sender gets the `unreadable_headers` error and the
/// dead letter is written once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_found_while_redis_is_down_reaches_its_sender_once_redis_returns() {
    let (mut env, _) = monitored(None).await;
    let mut dead = env.subscribe("toolfleet.deadletter.chat".into()).await;
    let mut poison = toolfleet_protocol::client::question("hello poison");
    poison.invocation_id = "poison-while-redis-down".into();
    let mut events = env
        .subscribe(
            env.subjects
                .chat_events(poison.tenant(), &poison.invocation_id),
        )
        .await;
    env.redis.stop();
    support::publish_raw(
        &env.nats.url(),
        None,
        &env.subjects.chat_submit(poison.tenant()),
        POISONS[0],
        &serde_json::to_vec(&poison).unwrap(),
    )
    .await;
    // While the store is away: no dead letter, no word to the sender.
    support::assert_silent(
        &mut dead,
        Duration::from_secs(4),
        "dead-lettered while Redis was down",
    )
    .await;
    support::assert_silent(
        &mut events,
        Duration::from_millis(100),
        "told while Redis was down",
    )
    .await;
    env.redis.start_again().expect("redis-server restarts");
    let ev = support::next_json(&mut events).await;
    assert_eq!(ev["type"], "error", "{ev}");
    assert_eq!(ev["code"], "unreadable_headers", "{ev}");
    let d = support::next_json(&mut dead).await;
    assert_eq!(d["invocationId"], "poison-while-redis-down", "{d}");
    support::assert_silent(&mut dead, Duration::from_secs(2), "a second dead letter").await;
    support::chat_queue_drained(&env).await;
}
