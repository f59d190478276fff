//! Caps per tenant on what it stores (issue 29, item 2), tried as tenant
//! `acme` would flood tenant `globex`: real `nats-server` and
//! `redis-server`, the orchestrator in-process, the scripted model.
//!
//! Jobs are held running by a model that answers "hold" only after ten
//! minutes (a job in the chat stream, waiting or running, counts against
//! its tenant's queued cap); nothing here is timed.

use async_nats::jetstream;
use futures::TryStreamExt;
use serde_json::{Value, json};
use toolfleet_protocol::ChatJob;
use toolfleet_protocol::client::{ClientError, QueueFull};

use crate::support::{Env, Options, WAIT, events_until_terminal};

fn script() -> Value {
    json!({
        "rules": [{
            "whenUserContains": ["hold"],
            "steps": [
                { "fault": { "kind": "slowFirstToken", "delayMs": 600000 }, "answer": "late" }
            ]
        }, {
            "whenUserContains": ["one clock"],
            "steps": [
                { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
                { "answer": "The model read: {{tool:current_datetime}}" }
            ]
        }],
        "default": { "steps": [ { "answer": "quick answer" } ] }
    })
}

fn profiles(tenants: &str) -> String {
    format!(
        r#"
[deployments.scripted]
base_url = "{{base_url}}"
model = "toolfleet-scripted"
[profiles.default]
deployment = "scripted"
require_approval = ["system:current_datetime"]
{tenants}
"#
    )
}

async fn start(tenants: &str) -> Env {
    Env::start_with(
        script(),
        Options {
            workers: vec!["system"],
            profiles_toml: Some(profiles(tenants)),
            data_source: None,
            ..Options::default()
        },
    )
    .await
}

fn job_of(tenant: &str, text: &str) -> ChatJob {
    let mut job = toolfleet_protocol::client::question(text);
    job.tenant = Some(tenant.into());
    job
}

async fn submit(env: &Env, job: &ChatJob) -> Result<(), ClientError> {
    tokio::time::timeout(
        WAIT,
        toolfleet_protocol::client::submit(&env.client, &env.subjects, job),
    )
    .await
    .expect("the publish ack in time")
}

/// `job` submitted and followed to its terminal event.
async fn terminal_of(env: &Env, job: &ChatJob) -> Value {
    let mut events = env.follow_and_submit(job).await;
    events_until_terminal(&mut events)
        .await
        .pop()
        .expect("a terminal event")
}

/// The metrics text once `line` is in it (every orchestrator's watch and
/// counters catch up; bounded by [`WAIT`]).
async fn metrics_with(env: &Env, line: &str) -> String {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let text = env.metrics_text().await;
        if text.lines().any(|l| l == line) {
            return text;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "no `{line}` in the metrics:\n{text}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn a_tenant_over_its_queued_cap_gets_the_publish_ack_refusal_while_another_submits() {
    let env = start("[tenant_defaults]\nmax_queued_jobs = 2\n").await;
    for _ in 0..2 {
        submit(&env, &job_of("acme", "hold"))
            .await
            .expect("within acme's cap");
    }
    let err = submit(&env, &job_of("acme", "hold"))
        .await
        .expect_err("acme's third job is refused at once");
    assert!(
        matches!(err, ClientError::QueueFull(QueueFull::Tenant)),
        "{err:?}"
    );
    let ended = terminal_of(&env, &job_of("globex", "quick")).await;
    assert_eq!(ended["type"], "completed", "{ended}");
}

#[tokio::test]
async fn a_tenant_with_a_lower_cap_than_the_streams_is_refused_when_its_job_is_taken() {
    let env =
        start("[tenant_defaults]\nmax_queued_jobs = 10\n[tenants.acme]\nmax_queued_jobs = 2\n")
            .await;
    for _ in 0..2 {
        submit(&env, &job_of("acme", "hold"))
            .await
            .expect("within acme's cap");
    }
    // The stream takes it (its limit is the largest cap, 10) ...
    let ended = terminal_of(&env, &job_of("acme", "quick")).await;
    // ... and the orchestrator ends it: two of acme's are ahead of it.
    assert_eq!(ended["type"], "error", "{ended}");
    assert_eq!(ended["code"], "queue_full", "{ended}");
    assert!(
        ended["message"]
            .as_str()
            .unwrap()
            .contains("max_queued_jobs"),
        "{ended}"
    );
    let ended = terminal_of(&env, &job_of("globex", "quick")).await;
    assert_eq!(ended["type"], "completed", "{ended}");
    metrics_with(
        &env,
        "toolfleet_tenant_cap_refusals_total{cap=\"queued_jobs\",tenant=\"acme\"} 1",
    )
    .await;
}

#[tokio::test]
async fn a_job_over_its_tenants_payload_cap_is_refused_and_dead_lettered() {
    let env = start("[tenants.acme]\nmax_job_bytes = 2048\n").await;
    let big = "x".repeat(3000);
    let ended = terminal_of(&env, &job_of("acme", &big)).await;
    assert_eq!(ended["type"], "error", "{ended}");
    assert_eq!(ended["code"], "malformed_job", "{ended}");
    assert!(
        ended["message"].as_str().unwrap().contains("2048"),
        "{ended}"
    );
    // The same job is globex's to send.
    let ended = terminal_of(&env, &job_of("globex", &big)).await;
    assert_eq!(ended["type"], "completed", "{ended}");
    // Nothing lost: the refused job is in the dead letters, whole (the
    // stream stores it from core NATS: waited for).
    let js = jetstream::new(env.client.clone());
    let stream = js
        .get_stream(env.subjects.dead_letters_stream())
        .await
        .unwrap();
    let subject = format!("{}.deadletter.chat", env.subjects.prefix());
    let deadline = tokio::time::Instant::now() + WAIT;
    let dead = loop {
        match stream.get_last_raw_message_by_subject(&subject).await {
            Ok(dead) => break dead,
            Err(e) => assert!(
                tokio::time::Instant::now() < deadline,
                "no dead letter: {e}"
            ),
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    };
    let dead: Value = serde_json::from_slice(&dead.payload).unwrap();
    assert_eq!(dead["code"], "too_large", "{dead}");
    assert!(dead.to_string().contains(&big), "the job is kept whole");
    metrics_with(
        &env,
        "toolfleet_tenant_cap_refusals_total{cap=\"job_bytes\",tenant=\"acme\"} 1",
    )
    .await;
}

#[tokio::test]
async fn a_tenants_flood_of_cheap_jobs_does_not_push_out_another_tenants_stored_answer() {
    let env = start("[tenants.acme]\nmax_stored_events = 5\n").await;
    // An events stream small enough for the flood to fill (the shipped
    // one is 256 MiB): what a bigger flood does to the real one.
    let js = jetstream::new(env.client.clone());
    let mut config = js
        .get_stream(env.subjects.events_stream())
        .await
        .unwrap()
        .cached_info()
        .config
        .clone();
    config.max_bytes = 64 * 1024;
    js.update_stream(config)
        .await
        .expect("events stream resized");

    let answer = job_of("globex", "quick");
    let ended = terminal_of(&env, &answer).await;
    assert_eq!(ended["type"], "completed", "{ended}");

    // acme's flood: 400 jobs that fail schema validation, each answered
    // with a stored error event (about 300 bytes: 120 KB in all).
    const FLOOD: usize = 400;
    let mut acme_events = env
        .subscribe(format!("{}.chat.events.acme.*", env.subjects.prefix()))
        .await;
    for i in 0..FLOOD {
        let body = json!({ "invocationId": format!("flood-{i}"), "messages": "not a list" });
        js.publish(env.subjects.chat_submit("acme"), body.to_string().into())
            .await
            .unwrap()
            .await
            .expect("stored");
    }
    for _ in 0..FLOOD {
        let event = crate::support::next_json(&mut acme_events).await;
        assert_eq!(event["code"], "malformed_job", "{event}");
    }

    let kept = tokio::time::timeout(
        WAIT,
        toolfleet_protocol::client::last_event(
            &env.client,
            &env.subjects,
            "globex",
            &answer.invocation_id,
        ),
    )
    .await
    .expect("the events stream answers in time")
    .expect("the events stream answers");
    let kept = kept.expect("globex's answer is still stored");
    assert!(kept.body.is_terminal(), "{kept:?}");

    // acme keeps about its cap (trims run after each stored terminal
    // event; up to one per job in flight may not have run yet).
    let events = js.get_stream(env.subjects.events_stream()).await.unwrap();
    let mut counts = events
        .info_with_subjects(env.subjects.chat_events_of("acme"))
        .await
        .unwrap();
    let mut acme = 0;
    while let Some((_, n)) = counts.try_next().await.unwrap() {
        acme += n;
    }
    assert!(acme <= 5 + 16, "acme keeps {acme} events");
}

#[tokio::test]
async fn a_park_over_its_tenants_cap_ends_with_too_many_parked_while_another_tenant_parks() {
    let env = start("[tenants.acme]\nmax_parked = 1\n").await;
    let first = job_of("acme", "one clock");
    let mut events = env.follow_and_submit(&first).await;
    loop {
        let event = crate::support::next_json(&mut events).await;
        assert_ne!(event["type"], "error", "{event}");
        if event["type"] == "approval_requested" {
            break;
        }
    }
    // Every orchestrator's watch of the bucket has seen acme's record.
    metrics_with(&env, "toolfleet_tenant_parked{tenant=\"acme\"} 1").await;

    let ended = terminal_of(&env, &job_of("acme", "one clock")).await;
    assert_eq!(ended["type"], "error", "{ended}");
    assert_eq!(ended["code"], "too_many_parked", "{ended}");
    assert!(
        ended["message"].as_str().unwrap().contains("max_parked"),
        "{ended}"
    );

    let mut events = env.follow_and_submit(&job_of("globex", "one clock")).await;
    loop {
        let event = crate::support::next_json(&mut events).await;
        assert_ne!(event["type"], "error", "globex parks: {event}");
        if event["type"] == "approval_requested" {
            break;
        }
    }
    metrics_with(
        &env,
        "toolfleet_tenant_cap_refusals_total{cap=\"parked\",tenant=\"acme\"} 1",
    )
    .await;
}
