//! Idempotency keys (issue 32, part 2) on real nats-server and
//! redis-server, with two orchestrators and the scripted model server
//! standing in for the provider (it counts the requests it gets, so a
//! test sees whether a job ran): a repeated key gets the first job's
//! answer instead of a second run — after the stream's own `Nats-Msg-Id`
//! window has passed, while the first still runs, and when the first
//! failed —; keys are per tenant; a bad key is refused and runs nothing.

// Tests are exempt from the 100-line limit: a scenario reads top to bottom.
#![allow(clippy::too_many_lines)]

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use toolfleet_protocol::ChatJob;

use support::{Env, Options, WAIT, events_until_terminal, kinds, next_json};

fn script() -> Value {
    json!({
        "rules": [
            { "whenUserContains": ["slow"], "steps": [
                { "answer": "slowly: {{user}}",
                  "fault": { "kind": "slowFirstToken", "delayMs": 2500 } } ] },
            { "whenUserContains": ["broken"], "steps": [
                { "answer": "-", "fault": { "kind": "status", "status": 400 } } ] }
        ],
        "default": { "steps": [ { "answer": "noted: {{user}}" } ] }
    })
}

/// A fleet with two orchestrators (the second returned, to be kept).
async fn two_orchestrators() -> (Env, toolfleet_service::Runtime) {
    let env = Env::start_with(
        script(),
        Options {
            workers: vec![],
            ..Options::default()
        },
    )
    .await;
    let profiles = toolfleet_config::FleetConfig::single(
        toolfleet_llm::deployments::Deployment::new(env.model.base_url(), "toolfleet-scripted")
            .with_api_key("sk-test-secret-never-logged".to_string()),
    );
    let config = toolfleet_orchestrator::OrchestratorConfig::new(env.subjects.clone(), profiles);
    let second = support::start_orchestrator(env.nats.url(), env.redis.url(), config).await;
    (env, second)
}

fn keyed(text: &str, key: &str) -> ChatJob {
    let mut job = toolfleet_protocol::client::question(text);
    job.idempotency_key = Some(key.into());
    job
}

/// Model requests whose last message says `text`.
fn asked(env: &Env, text: &str) -> usize {
    env.model
        .requests()
        .iter()
        .filter(|r| r["messages"].to_string().contains(text))
        .count()
}

/// Publishes `job` as a client that deduplicates by `Nats-Msg-Id` would
/// (the id being the key); whether the stream took it as a duplicate.
async fn publish_with_msg_id(env: &Env, job: &ChatJob, msg_id: &str) -> bool {
    let js = async_nats::jetstream::new(env.client.clone());
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Msg-Id", msg_id);
    js.publish_with_headers(
        env.subjects.chat_submit(job.tenant()),
        headers,
        serde_json::to_vec(job).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap()
    .duplicate
}

/// How long after the first job its repeat comes: longer than JetStream's
/// duplicate window (two minutes) by as much again as half of it.
const THREE_MINUTES: Duration = Duration::from_secs(180);

#[tokio::test(flavor = "multi_thread")]
async fn idempotency_a_repeat_after_the_streams_duplicate_window_gets_the_first_answer() {
    let (env, _second) = two_orchestrators().await;
    // JetStream drops a repeated Nats-Msg-Id only within the stream's
    // duplicate window (two minutes, the chat stream's default, kept here).
    // The repeat comes three minutes later, as a client's retry would: the
    // stream takes it as a new message (`duplicate: false`, asserted), so
    // only the fleet's key stands between it and a second run.
    let js = async_nats::jetstream::new(env.client.clone());
    let mut chat = js.get_stream(env.subjects.chat_stream()).await.unwrap();
    let window = chat.info().await.unwrap().config.duplicate_window;
    assert!(
        window + Duration::from_secs(30) <= THREE_MINUTES,
        "{window:?}"
    );
    let first = keyed("pay invoice 42", "invoice-42");
    let mut events = env
        .subscribe(env.subjects.chat_events("default", &first.invocation_id))
        .await;
    assert!(!publish_with_msg_id(&env, &first, "invoice-42").await);
    let first_events = events_until_terminal(&mut events).await;
    let answer = first_events.last().unwrap().clone();
    assert_eq!(answer["type"], "completed", "{first_events:?}");
    // Past the stream's window, the same message id is a new message.
    tokio::time::sleep(THREE_MINUTES).await;
    let repeat = keyed("pay invoice 42", "invoice-42");
    let mut events = env
        .subscribe(env.subjects.chat_events("default", &repeat.invocation_id))
        .await;
    assert!(
        !publish_with_msg_id(&env, &repeat, "invoice-42").await,
        "the stream's duplicate window should have passed"
    );
    let replayed = events_until_terminal(&mut events).await;
    assert_eq!(kinds(&replayed), ["duplicate", "completed"], "{replayed:?}");
    assert_eq!(replayed[0]["replayOf"], first.invocation_id.as_str());
    assert_eq!(replayed[0]["idempotencyKey"], "invoice-42");
    // The first job's answer, as the repeat's own event.
    assert_eq!(replayed[1]["text"], answer["text"]);
    assert_eq!(replayed[1]["invocationId"], repeat.invocation_id.as_str());
    // Ran once.
    assert_eq!(asked(&env, "pay invoice 42"), 1);
    // The client's own helper follows it like any job.
    let again = env
        .submit(&keyed("pay invoice 42", "invoice-42"))
        .await
        .unwrap();
    assert_eq!(again.text, answer["text"].as_str().unwrap());
    assert_eq!(asked(&env, "pay invoice 42"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn idempotency_a_repeat_of_a_running_job_waits_for_its_answer_and_runs_nothing() {
    let (env, second) = two_orchestrators().await;
    let first = keyed("slow report", "report-7");
    let mut first_events = env.follow_and_submit(&first).await;
    // The first is running (its model call takes a while) when the repeat
    // comes, through whichever orchestrator takes it.
    loop {
        if next_json(&mut first_events).await["type"] == "started" {
            break;
        }
    }
    let repeat = keyed("slow report", "report-7");
    let mut repeat_events = env.follow_and_submit(&repeat).await;
    let duplicate = next_json(&mut repeat_events).await;
    assert_eq!(duplicate["type"], "duplicate", "{duplicate}");
    assert_eq!(duplicate["replayOf"], first.invocation_id.as_str());
    let (done, replayed) = tokio::join!(
        events_until_terminal(&mut first_events),
        events_until_terminal(&mut repeat_events)
    );
    let done = done.last().unwrap();
    assert_eq!(done["type"], "completed", "{done}");
    assert_eq!(replayed.last().unwrap()["text"], done["text"]);
    assert_eq!(asked(&env, "slow report"), 1);
    let replays = support::counted(&env, &second, "toolfleet_idempotent_replays_total").await;
    assert_eq!(replays, 1.0);
}

#[tokio::test(flavor = "multi_thread")]
async fn idempotency_a_failed_first_job_is_replayed_as_the_same_failure() {
    let (env, _second) = two_orchestrators().await;
    let first = env
        .follow_and_submit(&keyed("broken request", "broken-1"))
        .await;
    let mut first = first;
    let failed = events_until_terminal(&mut first).await;
    let failed = failed.last().unwrap();
    assert_eq!(failed["type"], "error", "{failed}");
    let calls = asked(&env, "broken request");
    let mut repeat = env
        .follow_and_submit(&keyed("broken request", "broken-1"))
        .await;
    let replayed = events_until_terminal(&mut repeat).await;
    let last = replayed.last().unwrap();
    assert_eq!(last["code"], failed["code"], "{replayed:?}");
    assert_eq!(last["message"], failed["message"]);
    assert_eq!(
        asked(&env, "broken request"),
        calls,
        "the repeat ran the model"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn idempotency_keys_are_per_tenant() {
    let (env, _second) = two_orchestrators().await;
    let mut acme = keyed("tenant question", "same-key");
    acme.tenant = Some("acme".into());
    let mut globex = keyed("tenant question", "same-key");
    globex.tenant = Some("globex".into());
    let a = env.submit(&acme).await.unwrap();
    let g = env.submit(&globex).await.unwrap();
    // Both ran: globex's key is not acme's.
    assert_eq!(a.text, g.text);
    assert_eq!(asked(&env, "tenant question"), 2);
    // And each tenant's repeat is answered from its own first job.
    let mut again = keyed("tenant question", "same-key");
    again.tenant = Some("globex".into());
    let mut events = env.follow_and_submit(&again).await;
    let replayed = events_until_terminal(&mut events).await;
    assert_eq!(
        replayed[0]["replayOf"],
        globex.invocation_id.as_str(),
        "{replayed:?}"
    );
    assert_eq!(asked(&env, "tenant question"), 2);
}

#[tokio::test(flavor = "multi_thread")]
async fn idempotency_a_bad_key_is_refused_clearly_and_runs_nothing() {
    let env = Env::start_with(script(), Options::default()).await;
    for key in [
        json!("has space"),
        json!(""),
        json!("k".repeat(129)),
        json!(42),
    ] {
        let mut body =
            serde_json::to_value(toolfleet_protocol::client::question("bad key job")).unwrap();
        body["idempotencyKey"] = key.clone();
        let id = body["invocationId"].as_str().unwrap().to_owned();
        let mut events = env
            .subscribe(env.subjects.chat_events("default", &id))
            .await;
        env.client
            .publish(
                env.subjects.chat_submit("default"),
                serde_json::to_vec(&body).unwrap().into(),
            )
            .await
            .unwrap();
        let error = tokio::time::timeout(WAIT, next_json(&mut events))
            .await
            .unwrap();
        assert_eq!(error["code"], "malformed_job", "{key}: {error}");
        assert!(
            error["message"]
                .as_str()
                .unwrap()
                .contains("idempotencyKey"),
            "{error}"
        );
    }
    assert_eq!(asked(&env, "bad key job"), 0);
}

#[tokio::test(flavor = "multi_thread")]
async fn idempotency_a_first_job_refused_before_it_ran_gives_its_key_back() {
    let (env, _second) = two_orchestrators().await;
    // The thread is busy: the keyed job is refused (`thread_busy`) and
    // runs nothing. Its key must not answer every retry with that refusal
    // for the whole window: once the thread is free, a retry runs.
    let mut busy = toolfleet_protocol::client::question("slow one");
    busy.thread_id = Some("t-key".into());
    let mut running = env.follow_and_submit(&busy).await;
    loop {
        if next_json(&mut running).await["type"] == "started" {
            break;
        }
    }
    let mut first = keyed("after the busy one", "busy-1");
    first.thread_id = Some("t-key".into());
    let mut refused = env.follow_and_submit(&first).await;
    let refused = events_until_terminal(&mut refused).await;
    assert_eq!(
        refused.last().unwrap()["code"],
        "thread_busy",
        "{refused:?}"
    );
    let done = events_until_terminal(&mut running).await;
    assert_eq!(done.last().unwrap()["type"], "completed", "{done:?}");
    let mut retry = first.clone();
    retry.invocation_id = format!("{}-retry", first.invocation_id);
    let mut retried = env.follow_and_submit(&retry).await;
    let retried = events_until_terminal(&mut retried).await;
    assert!(
        !kinds(&retried).contains(&"duplicate"),
        "the retry was answered from the refused job: {retried:?}"
    );
    let last = retried.last().unwrap();
    assert_eq!(last["type"], "completed", "{retried:?}");
    assert_eq!(last["text"], "noted: after the busy one");
    // The retry that ran holds the key now: a repeat gets its answer.
    let mut again = first.clone();
    again.invocation_id = format!("{}-again", first.invocation_id);
    let replayed = env.submit(&again).await.unwrap();
    assert_eq!(replayed.text, "noted: after the busy one");
    assert_eq!(asked(&env, "after the busy one"), 1);
}

#[tokio::test(flavor = "multi_thread")]
async fn idempotency_a_repeat_with_another_body_is_refused_and_runs_nothing() {
    let (env, _second) = two_orchestrators().await;
    let first = env
        .submit(&keyed("refund order 4711", "refund-1"))
        .await
        .unwrap();
    assert_eq!(first.text, "noted: refund order 4711");
    // The same key, another question: not the first job's answer.
    let mut other = env
        .follow_and_submit(&keyed("refund order 4712", "refund-1"))
        .await;
    let other = events_until_terminal(&mut other).await;
    let last = other.last().unwrap();
    assert_eq!(last["type"], "error", "{other:?}");
    assert_eq!(last["code"], "idempotency_mismatch");
    assert!(
        last["message"].as_str().unwrap().contains("refund-1"),
        "{last}"
    );
    assert_eq!(asked(&env, "refund order 4712"), 0);
    // The same question again is still answered from the first job.
    let again = env
        .submit(&keyed("refund order 4711", "refund-1"))
        .await
        .unwrap();
    assert_eq!(again.text, first.text);
    assert_eq!(asked(&env, "refund order 4711"), 1);
}
