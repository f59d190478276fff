//! Human approval as a durable pause, end to end against real NATS and
//! Redis servers: a call that needs a person parks its invocation (the
//! chat job acked, nothing waiting in memory), and an approval, a denial,
//! a timeout or a cancel resumes it on whichever orchestrator takes the
//! decision — including orchestrators started after every one that knew
//! the invocation was killed.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use serde_json::{Value, json};
use toolfleet_protocol::{ChatEvent, ChatEventBody, ToolStatus};

use crate::support::{self, Env, Options, WAIT, lighthouse_script};

/// One deployment on the scripted server; the default profile needs a
/// person's yes before `current_datetime` runs.
fn profiles(timeout_ms: u64) -> String {
    format!(
        r#"
default_profile = "default"
[deployments.scripted]
base_url = "{{base_url}}"
model = "toolfleet-scripted"
[profiles.default]
deployment = "scripted"
require_approval = ["system:current_datetime"]
approval_timeout_ms = {timeout_ms}
"#
    )
}

/// Two clocks in one turn, then an answer quoting the last result.
fn two_clocks_script() -> Value {
    json!({
        "rules": [{
            "whenUserContains": ["two clocks"],
            "steps": [
                { "toolCalls": [
                    { "name": "current_datetime", "arguments": {} },
                    { "name": "current_datetime", "arguments": { "utcOffset": "+02:00" } }
                ] },
                { "answer": "The model read: {{tool:current_datetime}}" }
            ]
        }, {
            "whenUserContains": ["one clock"],
            "steps": [
                { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
                { "answer": "The model read: {{tool:current_datetime}}" }
            ]
        }],
        "default": { "steps": [ { "answer": "no script" } ] }
    })
}

/// Reads `sub` until `pick` returns something (every event on the way is
/// kept in `seen`).
async fn until<T>(
    sub: &mut async_nats::Subscriber,
    seen: &mut Vec<ChatEvent>,
    mut pick: impl FnMut(&ChatEvent) -> Option<T>,
) -> T {
    loop {
        let msg = tokio::time::timeout(WAIT, futures::StreamExt::next(sub))
            .await
            .expect("no event in time")
            .expect("subscription closed");
        let event: ChatEvent = serde_json::from_slice(&msg.payload).unwrap();
        let found = pick(&event);
        seen.push(event);
        if let Some(found) = found {
            return found;
        }
    }
}

fn approval_requested(e: &ChatEvent) -> Option<(String, String, Value, String)> {
    match &e.body {
        ChatEventBody::ApprovalRequested {
            call_id,
            tool,
            arguments,
            subject,
            ..
        } => Some((
            call_id.clone(),
            tool.clone(),
            arguments.clone(),
            subject.clone(),
        )),
        _ => None,
    }
}

fn terminal(e: &ChatEvent) -> Option<ChatEventBody> {
    e.body.is_terminal().then(|| e.body.clone())
}

/// Sends an approval body (raw bytes) to `subject`; the orchestrator's
/// answer as JSON.
async fn request(env: &Env, subject: String, body: Value) -> Value {
    let reply = tokio::time::timeout(WAIT, env.client.request(subject, body.to_string().into()))
        .await
        .expect("no answer in time")
        .expect("an orchestrator answers");
    serde_json::from_slice(&reply.payload).unwrap()
}

/// The messages in the chat stream (a work queue: a parked job's is gone).
async fn chat_jobs_in_stream(env: &Env) -> u64 {
    let js = async_nats::jetstream::new(env.client.clone());
    let mut stream = js.get_stream(env.subjects.chat_stream()).await.unwrap();
    stream.info().await.unwrap().state.messages
}

async fn parked_keys(env: &Env) -> Vec<String> {
    let js = async_nats::jetstream::new(env.client.clone());
    let kv = js
        .get_key_value(env.subjects.parked_bucket())
        .await
        .unwrap();
    let keys = kv.keys().await.unwrap();
    futures::StreamExt::collect::<Vec<_>>(keys)
        .await
        .into_iter()
        .map(Result::unwrap)
        .collect()
}

/// Waits (bounded) until the parked bucket holds no record: a run removes
/// its record just after its terminal event.
async fn no_parked_record(env: &Env) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let keys = parked_keys(env).await;
        if keys.is_empty() {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still parked: {keys:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn metric(text: &str, line_start: &str) -> f64 {
    text.lines()
        .find(|l| l.starts_with(line_start))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {line_start} in the metrics"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_denial_is_read_by_the_model_and_bad_approvals_change_nothing() {
    let env = Env::start_with(
        two_clocks_script(),
        Options {
            workers: vec!["system"],
            profiles_toml: Some(profiles(600_000)),
            ..Default::default()
        },
    )
    .await;
    let job = toolfleet_protocol::client::question("What do two clocks say?");
    let id = job.invocation_id.clone();
    let mut sub = env.follow_and_submit(&job).await;
    let mut seen = Vec::new();
    let first = until(&mut sub, &mut seen, approval_requested).await;
    let second = until(&mut sub, &mut seen, approval_requested).await;
    assert_eq!(first.1, "system:current_datetime@1.0.0");
    assert_eq!(second.2, json!({ "utcOffset": "+02:00" }));
    assert_eq!(first.3, env.subjects.chat_approve("default", &id));
    // Parked: the chat job is acked, no call ran, the record is kept.
    assert!(
        !seen
            .iter()
            .any(|e| matches!(e.body, ChatEventBody::ToolCall { .. })),
        "{seen:?}"
    );
    let deadline = tokio::time::Instant::now() + WAIT;
    while chat_jobs_in_stream(&env).await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the job was not acked"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(parked_keys(&env).await, vec![format!("default.{id}")]);

    // Bad approvals: a clear refusal each, and nothing changes.
    let subject = first.3.clone();
    let refused = |v: &Value, code: &str| {
        assert_eq!(v["ok"], false, "{v}");
        assert_eq!(v["code"], code, "{v}");
        assert!(v["error"].as_str().is_some_and(|e| !e.is_empty()), "{v}");
    };
    let v = request(&env, subject.clone(), json!({ "callId": first.0 })).await;
    refused(&v, "malformed_approval");
    let v = request(
        &env,
        subject.clone(),
        json!({ "callId": first.0, "decision": "approve", "by": "x" }),
    )
    .await;
    refused(&v, "malformed_approval");
    let v = request(
        &env,
        env.subjects.chat_approve("default", "no-such-invocation"),
        json!({ "callId": first.0, "decision": "approve" }),
    )
    .await;
    refused(&v, "unknown_invocation");
    // Another tenant's subject does not reach this tenant's invocation.
    let v = request(
        &env,
        env.subjects.chat_approve("globex", &id),
        json!({ "callId": first.0, "decision": "approve" }),
    )
    .await;
    refused(&v, "unknown_invocation");
    let v = request(
        &env,
        subject.clone(),
        json!({ "callId": "call_nope", "decision": "approve" }),
    )
    .await;
    refused(&v, "unknown_call");
    assert!(v["error"].as_str().unwrap().contains(&first.0), "{v}");

    // The first call approved; a second decision on it is refused.
    let v = request(
        &env,
        subject.clone(),
        json!({ "callId": first.0, "decision": "approve", "approver": "alice" }),
    )
    .await;
    assert_eq!(v, json!({ "ok": true }));
    let deadline = tokio::time::Instant::now() + WAIT;
    let v = loop {
        // Until the first decision is in the record (the stream may not
        // have delivered it yet; until then the stream's duplicate check
        // refuses it).
        let v = request(
            &env,
            subject.clone(),
            json!({ "callId": first.0, "decision": "deny" }),
        )
        .await;
        if v["code"] == "already_decided" {
            break v;
        }
        assert!(tokio::time::Instant::now() < deadline, "{v}");
    };
    refused(&v, "already_decided");
    // Nothing ran yet: the turn waits for its other call.
    assert_eq!(parked_keys(&env).await, vec![format!("default.{id}")]);

    let v = request(
        &env,
        subject.clone(),
        json!({ "callId": second.0, "decision": "deny", "reason": "the change freeze is on", "approver": "bob" }),
    )
    .await;
    assert_eq!(v, json!({ "ok": true }));
    let end = until(&mut sub, &mut seen, terminal).await;
    let ChatEventBody::Completed { text, .. } = end else {
        panic!("{end:?}");
    };
    // The model read the denial, with its reason.
    assert!(
        text.contains("a person denied this call") && text.contains("the change freeze is on"),
        "{text}"
    );
    let resolved: Vec<(String, String, Option<String>)> = seen
        .iter()
        .filter_map(|e| match &e.body {
            ChatEventBody::ApprovalResolved {
                call_id,
                decision,
                approver,
                ..
            } => Some((
                call_id.clone(),
                decision.as_str().to_string(),
                approver.clone(),
            )),
            _ => None,
        })
        .collect();
    assert_eq!(
        resolved,
        vec![
            (first.0.clone(), "approved".into(), Some("alice".into())),
            (second.0.clone(), "denied".into(), Some("bob".into())),
        ]
    );
    let results: Vec<(String, ToolStatus, Option<String>)> = seen
        .iter()
        .filter_map(|e| match &e.body {
            ChatEventBody::ToolResult {
                call_id,
                status,
                error_code,
                ..
            } => Some((call_id.clone(), *status, error_code.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        results,
        vec![
            (first.0.clone(), ToolStatus::Ok, None),
            (
                second.0.clone(),
                ToolStatus::Blocked,
                Some("approval_denied".into())
            ),
        ]
    );
    // One numbering across the pause: no gap, no repeat.
    let seqs: Vec<u64> = seen.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>(), "{seen:?}");
    // The record is gone with the invocation.
    let deadline = tokio::time::Instant::now() + WAIT;
    while !parked_keys(&env).await.is_empty() {
        assert!(tokio::time::Instant::now() < deadline, "the record stayed");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let text = env.metrics_text().await;
    assert_eq!(
        metric(&text, "toolfleet_approvals_total{outcome=\"approved\"}"),
        1.0
    );
    assert_eq!(
        metric(&text, "toolfleet_approvals_total{outcome=\"denied\"}"),
        1.0
    );
    assert_eq!(
        metric(&text, "toolfleet_approvals_total{outcome=\"timeout\"}"),
        0.0
    );
    assert_eq!(
        metric(
            &text,
            "toolfleet_approval_wait_seconds_count{outcome=\"denied\"}"
        ),
        1.0
    );
    assert!(
        metric(
            &text,
            "toolfleet_approval_requests_refused_total{code=\"malformed_approval\"}"
        ) >= 2.0
    );
    assert!(
        metric(
            &text,
            "toolfleet_approval_requests_refused_total{code=\"unknown_invocation\"}"
        ) >= 2.0
    );
    assert!(
        metric(
            &text,
            "toolfleet_approval_requests_refused_total{code=\"already_decided\"}"
        ) >= 1.0
    );
    assert_eq!(
        metric(&text, "toolfleet_chat_jobs_total{outcome=\"parked\"}"),
        1.0
    );
}

/// A fleet with the system worker whose profile holds `current_datetime`
/// for approval for `timeout_ms`, and a job calling it once, submitted.
async fn one_clock(timeout_ms: u64) -> (Env, toolfleet_protocol::ChatJob, async_nats::Subscriber) {
    let env = Env::start_with(
        two_clocks_script(),
        Options {
            workers: vec!["system"],
            profiles_toml: Some(profiles(timeout_ms)),
            ..Default::default()
        },
    )
    .await;
    let job = toolfleet_protocol::client::question("What does one clock say?");
    let sub = env.follow_and_submit(&job).await;
    (env, job, sub)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_that_never_comes_ends_the_invocation_with_approval_timeout() {
    let (env, job, mut sub) = one_clock(1_500).await;
    let mut seen = Vec::new();
    let (call, ..) = until(&mut sub, &mut seen, approval_requested).await;
    let end = until(&mut sub, &mut seen, terminal).await;
    let ChatEventBody::Error { code, message, .. } = end else {
        panic!("{end:?}");
    };
    assert_eq!(code, "approval_timeout");
    assert!(
        message.contains("system:current_datetime@1.0.0"),
        "{message}"
    );
    assert!(
        seen.iter().any(
            |e| matches!(&e.body, ChatEventBody::ApprovalResolved { call_id, decision, .. }
            if *call_id == call && decision.as_str() == "timeout")
        ),
        "{seen:?}"
    );
    // Nothing ran, and the model was asked once.
    assert!(
        !seen
            .iter()
            .any(|e| matches!(e.body, ChatEventBody::ToolCall { .. }))
    );
    assert_eq!(env.model.requests().len(), 1);
    // A late approval is refused.
    let v = request(
        &env,
        env.subjects.chat_approve("default", &job.invocation_id),
        json!({ "callId": call, "decision": "approve" }),
    )
    .await;
    assert_eq!(v["ok"], false, "{v}");
    let text = env.metrics_text().await;
    assert_eq!(
        metric(&text, "toolfleet_approvals_total{outcome=\"timeout\"}"),
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_invocation_ends_on_its_cancel() {
    let (env, job, mut sub) = one_clock(600_000).await;
    let mut seen = Vec::new();
    until(&mut sub, &mut seen, approval_requested).await;
    let (code, _, err) = support::toolfleet_at(
        &env.nats.url(),
        &["cancel", &job.invocation_id, "--wait", "20"],
    );
    assert_eq!(code, Some(0), "{err}");
    let end = until(&mut sub, &mut seen, terminal).await;
    assert!(
        matches!(&end, ChatEventBody::Error { code, .. } if code == "cancelled"),
        "{end:?}"
    );
    assert!(
        !seen
            .iter()
            .any(|e| matches!(e.body, ChatEventBody::ToolCall { .. }))
    );
}

/// [`profiles`] (600 s to decide) on the test's model, with `extra` lines
/// for the default profile, in a file of a temporary directory.
fn profiles_file(env: &Env, extra: &str) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("toolfleet.toml");
    std::fs::write(
        &config,
        profiles(600_000).replace("{base_url}", env.model.base_url().as_str()) + extra,
    )
    .unwrap();
    (dir, config)
}

/// Two orchestrator processes, once they are up (they made the streams).
async fn two_orchestrators(env: &Env, config: &std::path::Path) -> [Child; 2] {
    let both = [orchestrator(env, config), orchestrator(env, config)];
    let js = async_nats::jetstream::new(env.client.clone());
    let deadline = tokio::time::Instant::now() + WAIT;
    while js
        .get_stream(env.subjects.decisions_stream())
        .await
        .is_err()
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no orchestrator came up"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    both
}

/// An orchestrator process on the test's servers and profiles file.
fn orchestrator(env: &Env, config: &std::path::Path) -> Child {
    Command::new(support::sibling_bin("toolfleet-orchestrator"))
        .env("TOOLFLEET_NATS_URL", env.nats.url())
        .env("TOOLFLEET_REDIS_URL", env.redis.url())
        .env("TOOLFLEET_CONFIG", config)
        .env("TOOLFLEET_METRICS_ADDR", "127.0.0.1:0")
        .env("TOOLFLEET_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_approval_survives_the_restart_of_every_orchestrator() {
    let env = Env::start_with(
        lighthouse_script(),
        Options {
            workers: vec!["system", "retrieval"],
            no_orchestrator: true,
            ..Default::default()
        },
    )
    .await;
    let (_dir, config) = profiles_file(&env, "data_source = \"handbook\"\n");
    let mut first = two_orchestrators(&env, &config).await;

    let job =
        toolfleet_protocol::client::question("What time is it, and how do lighthouses warn ships?");
    let id = job.invocation_id.clone();
    let mut sub = env.follow_and_submit(&job).await;
    let mut seen = Vec::new();
    let (call, tool, ..) = until(&mut sub, &mut seen, approval_requested).await;
    assert_eq!(tool, "system:current_datetime@1.0.0");
    // The search of the same turn needed nobody: it ran before the park.
    assert!(
        seen.iter().any(
            |e| matches!(&e.body, ChatEventBody::ToolResult { tool, status: ToolStatus::Ok, .. }
            if tool.starts_with("retrieval:search_data_sources"))
        ),
        "{seen:?}"
    );
    let deadline = tokio::time::Instant::now() + WAIT;
    while chat_jobs_in_stream(&env).await > 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the job was not acked"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Every orchestrator that knew the invocation dies.
    for p in &mut first {
        p.kill().unwrap();
        p.wait().unwrap();
    }
    // With none running, an approval has nobody to answer it.
    let (code, _, err) =
        support::toolfleet_at(&env.nats.url(), &["approve", &id, &call, "--wait", "2"]);
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains("no orchestrator") || err.contains("no answer"),
        "{err}"
    );

    let mut second = [orchestrator(&env, &config), orchestrator(&env, &config)];
    let _guards: Vec<_> = second.iter_mut().map(support::KillOnDrop).collect();
    // A new orchestrator answers once it is up.
    let deadline = tokio::time::Instant::now() + WAIT;
    let out = loop {
        let out = support::toolfleet_at(
            &env.nats.url(),
            &["approve", &id, &call, "--approver", "carol"],
        );
        if out.0 == Some(0) || tokio::time::Instant::now() > deadline {
            break out;
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    };
    assert_eq!(out.0, Some(0), "{} {}", out.1, out.2);
    assert!(out.1.contains("approved"), "{}", out.1);

    let end = until(&mut sub, &mut seen, terminal).await;
    let ChatEventBody::Completed {
        text, references, ..
    } = end
    else {
        panic!("{end:?}");
    };
    // Both results reached the model: the clock and the cited search.
    assert!(
        text.starts_with("It is ") && !text.contains("Not run"),
        "{text}"
    );
    assert!(!references.is_empty(), "{text}");
    let seqs: Vec<u64> = seen.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (0..seqs.len() as u64).collect::<Vec<_>>(), "{seen:?}");
    assert_eq!(
        seen.iter()
            .filter(|e| matches!(e.body, ChatEventBody::Started { .. }))
            .count(),
        1,
        "the invocation went on; it did not start again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_after_a_held_one_wait_with_it_when_calls_run_one_at_a_time() {
    let env = Env::start_with(
        lighthouse_script(),
        Options {
            workers: vec!["system", "retrieval"],
            profiles_toml: Some(
                profiles(600_000) + "[profiles.default.policy]\nparallel_tool_calls = false\n",
            ),
            ..Default::default()
        },
    )
    .await;
    let job =
        toolfleet_protocol::client::question("What time is it, and how do lighthouses warn ships?");
    let mut sub = env.follow_and_submit(&job).await;
    let mut seen = Vec::new();
    let (call, ..) = until(&mut sub, &mut seen, approval_requested).await;
    // The search comes after the clock in the model's order: it waits.
    assert!(
        !seen
            .iter()
            .any(|e| matches!(e.body, ChatEventBody::ToolCall { .. })),
        "{seen:?}"
    );
    let v = request(
        &env,
        env.subjects.chat_approve("default", &job.invocation_id),
        json!({ "callId": call, "decision": "approve" }),
    )
    .await;
    assert_eq!(v, json!({ "ok": true }));
    let end = until(&mut sub, &mut seen, terminal).await;
    assert!(matches!(end, ChatEventBody::Completed { .. }), "{end:?}");
    // Then both ran, the clock first.
    let order: Vec<String> = seen
        .iter()
        .filter_map(|e| match &e.body {
            ChatEventBody::ToolResult { tool, status, .. } => {
                assert_eq!(*status, ToolStatus::Ok, "{tool}");
                Some(tool.clone())
            }
            _ => None,
        })
        .collect();
    assert_eq!(order.len(), 2, "{order:?}");
    assert!(order[0].starts_with("system:current_datetime"), "{order:?}");
    assert!(
        order[1].starts_with("retrieval:search_data_sources"),
        "{order:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_an_agent_tool_started_does_not_park_it_answers_blocked() {
    let script = json!({
        "rules": [{
            "whenUserContains": ["AGENT TASK"],
            "steps": [
                { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
                { "answer": "Helper read: {{tool:current_datetime}}" }
            ]
        }, {
            "whenUserContains": ["ask the helper"],
            "steps": [
                { "toolCalls": [ { "name": "helper", "arguments": { "task": "AGENT TASK: the time" } } ] },
                { "answer": "Outer: {{tool:helper}}" }
            ]
        }],
        "default": { "steps": [ { "answer": "no script" } ] }
    });
    let toml = r#"
default_profile = "default"
[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"
[profiles.default]
deployment = "scripted"
[profiles.helper]
deployment = "scripted"
require_approval = ["system:current_datetime"]
agent = { name = "helper", description = "Tells the time." }
"#;
    let env = Env::start_with(
        script,
        Options {
            workers: vec!["system"],
            profiles_toml: Some(toml.into()),
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env.ask("please ask the helper").await;
    let outcome = outcome.expect("completed");
    assert!(
        outcome.text.contains("needs a person's approval"),
        "{}",
        outcome.text
    );
    no_parked_record(&env).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resume_cut_short_by_a_crash_is_finished_by_another_orchestrator() {
    // The answer after the approval is slow the first time: every
    // orchestrator is killed while the resumed invocation waits on it.
    let script = json!({
        "rules": [{
            "whenUserContains": ["one clock"],
            "steps": [
                { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
                { "answer": "The model read: {{tool:current_datetime}}",
                  "fault": { "kind": "slowFirstToken", "delayMs": 60000, "times": 1 } }
            ]
        }],
        "default": { "steps": [ { "answer": "no script" } ] }
    });
    let env = Env::start_with(
        script,
        Options {
            workers: vec!["system"],
            no_orchestrator: true,
            ..Default::default()
        },
    )
    .await;
    let (_dir, config) = profiles_file(&env, "");
    let mut first = two_orchestrators(&env, &config).await;
    let job = toolfleet_protocol::client::question("What does one clock say?");
    let mut sub = env.follow_and_submit(&job).await;
    let mut seen = Vec::new();
    let (call, ..) = until(&mut sub, &mut seen, approval_requested).await;
    let v = request(
        &env,
        env.subjects.chat_approve("default", &job.invocation_id),
        json!({ "callId": call, "decision": "approve" }),
    )
    .await;
    assert_eq!(v, json!({ "ok": true }));
    // The resume is under way once the clock answered; the model is slow.
    until(&mut sub, &mut seen, |e| {
        matches!(e.body, ChatEventBody::ToolResult { .. }).then_some(())
    })
    .await;
    let deadline = tokio::time::Instant::now() + WAIT;
    while env.model.requests().len() < 2 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the answer was never asked for"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for p in &mut first {
        p.kill().unwrap();
        p.wait().unwrap();
    }
    // A new orchestrator takes the decision again (once its ack wait and
    // the dead run's lease lapse) and finishes the invocation.
    let mut second = orchestrator(&env, &config);
    let _guard = support::KillOnDrop(&mut second);
    let end = tokio::time::timeout(
        Duration::from_secs(60),
        until(&mut sub, &mut seen, terminal),
    )
    .await
    .expect("the invocation is finished by the new orchestrator");
    let ChatEventBody::Completed { text, .. } = end else {
        panic!("{end:?}");
    };
    assert!(text.starts_with("The model read: "), "{text}");
    assert_eq!(
        seen.iter()
            .filter(|e| matches!(e.body, ChatEventBody::Started { .. }))
            .count(),
        1,
        "it went on from the park; it did not start again"
    );
    no_parked_record(&env).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_rust_client_keeps_waiting_while_a_call_waits_for_a_person() {
    let env = Env::start_with(
        two_clocks_script(),
        Options {
            workers: vec!["system"],
            profiles_toml: Some(profiles(600_000)),
            ..Default::default()
        },
    )
    .await;
    let job = toolfleet_protocol::client::question("What does one clock say?");
    let mut sub = env
        .subscribe(env.subjects.chat_events("default", &job.invocation_id))
        .await;
    // The client's own timeout is shorter than the person takes.
    let timeout = Duration::from_secs(1);
    let asked = {
        let (client, subjects, job) = (env.client.clone(), env.subjects.clone(), job.clone());
        tokio::spawn(async move {
            toolfleet_protocol::client::chat(&client, &subjects, &job, timeout, |_| {}).await
        })
    };
    let mut seen = Vec::new();
    let (call, ..) = until(&mut sub, &mut seen, approval_requested).await;
    tokio::time::sleep(timeout * 2).await;
    let v = request(
        &env,
        env.subjects.chat_approve("default", &job.invocation_id),
        json!({ "callId": call, "decision": "approve" }),
    )
    .await;
    assert_eq!(v, json!({ "ok": true }));
    let outcome = tokio::time::timeout(WAIT, asked)
        .await
        .expect("the client returns")
        .unwrap()
        .expect("the client waited past its timeout for the approval");
    assert!(
        outcome.text.starts_with("The model read: "),
        "{}",
        outcome.text
    );
}

/// A tool whose call waits inside until the test says go (once): the test
/// can change the fleet between two rounds of one invocation.
#[derive(Clone)]
struct Gate {
    reached: std::sync::Arc<tokio::sync::Notify>,
    go: std::sync::Arc<tokio::sync::Notify>,
}

impl toolfleet_worker::Tool for Gate {
    type Args = Value;
    async fn call(
        &self,
        _ctx: &toolfleet_worker::ToolCtx,
        _args: Value,
    ) -> Result<toolfleet_worker::ToolOutput, toolfleet_worker::ToolError> {
        self.reached.notify_one();
        self.go.notified().await;
        Ok(toolfleet_worker::ToolOutput::text("the gate opened"))
    }
}

const GATE: &str = r#"{
  "schemaVersion": 1,
  "id": "testing:gate@1.0.0",
  "implementationKey": "testing.gate",
  "title": "Gate",
  "description": "Waits for the test.",
  "category": "testing",
  "purpose": "general",
  "selectable": true,
  "tags": [],
  "function": {
    "name": "gate",
    "description": "Waits for the test.",
    "parameters": { "type": "object", "properties": {}, "additionalProperties": false }
  },
  "timeoutMs": 20000,
  "delivery": "jetstream",
  "parallelSafe": true
}"#;

/// The system worker, as its binary builds it.
async fn system_worker() -> toolfleet_worker::Worker {
    toolfleet::families::some(
        &["system"],
        &toolfleet::families::Inputs {
            definitions: &support::root().join("tool_definitions"),
            index: &toolfleet::families::IndexArgs::tantivy(
                std::env::temp_dir().join("unused-index"),
                support::root().join("examples/corpus"),
            ),
            models: None,
        },
    )
    .await
    .unwrap()
    .remove(0)
}

/// Issue 28, item 5(a): a tool that needs approval (the profile's
/// `require_approval`) whose worker comes online after the invocation
/// started — neither offered nor permitted at the start — parks when the
/// model calls it. Before, the hold was decided on the start-time tool
/// list (no tool, no hold) while dispatch resolved the late tool afresh
/// and ran it unapproved.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_whose_worker_comes_online_late_and_needs_approval_parks() {
    let script = json!({
        "rules": [{ "whenUserContains": ["late clock"], "steps": [
            { "toolCalls": [ { "name": "gate", "arguments": {} } ] },
            { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
            { "answer": "The model read: {{tool:current_datetime}}" } ] }],
        "default": { "steps": [ { "answer": "no script" } ] }
    });
    let env = Env::start_with(
        script,
        Options {
            workers: Vec::new(),
            profiles_toml: Some(profiles(600_000)),
            data_source: None,
            ..Default::default()
        },
    )
    .await;
    let gate = Gate {
        reached: Default::default(),
        go: Default::default(),
    };
    let _gate = env
        .start_worker(
            toolfleet_worker::Worker::builder("testing")
                .definition_json(GATE)
                .tool("testing.gate", gate.clone())
                .build()
                .unwrap(),
        )
        .await;
    let job = toolfleet_protocol::client::question("What does the late clock say?");
    let mut sub = env.follow_and_submit(&job).await;
    tokio::time::timeout(WAIT, gate.reached.notified())
        .await
        .expect("the first round's gate call never ran");
    // The clock's worker comes online while the invocation runs.
    let _clock = env.start_worker(system_worker().await).await;
    gate.go.notify_one();
    let mut seen = Vec::new();
    let (call_id, tool, _, subject) = until(&mut sub, &mut seen, |e| {
        if let ChatEventBody::Completed { text, .. } = &e.body {
            panic!("ran without approval: {text}");
        }
        approval_requested(e)
    })
    .await;
    assert_eq!(tool, "system:current_datetime@1.0.0");
    assert!(
        !seen.iter().any(|e| matches!(&e.body,
            ChatEventBody::ToolCall { tool, .. } if tool.starts_with("system:"))),
        "{seen:?}"
    );
    let v = request(
        &env,
        subject,
        json!({ "callId": call_id, "decision": "approve" }),
    )
    .await;
    assert_eq!(v["ok"], true, "{v}");
    let end = until(&mut sub, &mut seen, terminal).await;
    let ChatEventBody::Completed { text, .. } = &end else {
        panic!("{end:?}");
    };
    assert!(text.starts_with("The model read: "), "{text}");
    assert!(!text.contains("Not run"), "{text}");
}

/// Issue 28, item 5(c): the model calls an agent tool; the nested job runs
/// the agent's profile, which holds nothing, but it inherits its caller's
/// `require_approval`: the clock the caller holds is not run in the nested
/// job (which cannot wait for a person: `blocked`, `approval_unavailable`).
/// Before, the nested job ran it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_nested_agent_job_holds_what_its_caller_holds() {
    let script = json!({
        "rules": [
            { "whenUserContains": ["AGENT TASK"], "steps": [
                { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
                { "answer": "The helper read: {{tool:current_datetime}}" } ] },
            { "whenUserContains": ["ask the helper"], "steps": [
                { "toolCalls": [ { "name": "helper", "arguments": { "task": "AGENT TASK: read the clock" } } ] },
                { "answer": "Helper: {{tool:helper}}" } ] }
        ],
        "default": { "steps": [ { "answer": "no script" } ] }
    });
    let env = Env::start_with(
        script,
        Options {
            workers: vec!["system"],
            profiles_toml: Some(
                profiles(600_000)
                    + r#"
[profiles.helper]
deployment = "scripted"
agent = { name = "helper", description = "Reads the clock." }
"#,
            ),
            data_source: None,
            ..Default::default()
        },
    )
    .await;
    // Every invocation's events, the nested job's included.
    let mut all = env
        .subscribe(env.subjects.chat_events("default", "*"))
        .await;
    let (_, outcome) = env.ask("please ask the helper").await;
    let outcome = outcome.expect("completed");
    assert!(
        outcome.text.starts_with("Helper: The helper read: Not run"),
        "{}",
        outcome.text
    );
    // The nested job's clock call: refused, never run.
    let mut seen = Vec::new();
    let result = until(&mut all, &mut seen, |e| match &e.body {
        ChatEventBody::ToolResult {
            tool,
            status,
            error_code,
            ..
        } if tool == "system:current_datetime@1.0.0" => Some((*status, error_code.clone())),
        _ => None,
    })
    .await;
    assert_eq!(
        result,
        (
            ToolStatus::Blocked,
            Some("approval_unavailable".to_string())
        )
    );
}

/// A webhook receiver on 127.0.0.1: every POST body, by path.
async fn receiver() -> (
    std::net::SocketAddr,
    std::sync::Arc<std::sync::Mutex<Vec<(String, bytes::Bytes)>>>,
) {
    let got: std::sync::Arc<std::sync::Mutex<Vec<(String, bytes::Bytes)>>> = Default::default();
    let record = {
        let got = got.clone();
        move |path: axum::extract::Path<String>, body: bytes::Bytes| {
            let got = got.clone();
            async move {
                got.lock().unwrap().push((path.0, body));
                axum::http::StatusCode::NO_CONTENT
            }
        }
    };
    let app = axum::Router::new().route("/{path}", axum::routing::post(record));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (addr, got)
}

/// Issue 28, item 7: the parked record (read from the bucket) keeps no
/// webhook URL — the job's own webhook is sealed — and the resumed
/// invocation still delivers its answer to that webhook.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_parked_record_keeps_no_webhook_url_and_the_resume_still_delivers_to_it() {
    let (addr, got) = receiver().await;
    let env = Env::start_with(
        two_clocks_script(),
        Options {
            workers: vec!["system"],
            profiles_toml: Some(profiles(600_000)),
            data_source: None,
            env: vec![(
                "TOOLFLEET_SINK_SECRET",
                "whsec_dG9vbGZsZWV0IGFwcHJvdmFscyB0ZXN0IHNlY3JldCE=",
            )],
            tweak: |config| {
                let sinks = &mut config.sinks;
                sinks.allow_http = true;
                sinks.policy = toolfleet_orchestrator::sinks::sink_policy(
                    Vec::new(),
                    vec!["127.0.0.0/8".parse().unwrap()],
                );
                sinks.job_exceptions = true;
            },
            ..Default::default()
        },
    )
    .await;
    let token = "hook-token-canary-8e2f";
    let job = toolfleet_protocol::ChatJob {
        sink: Some(toolfleet_protocol::SinkRequest {
            webhook: Some(format!("http://{addr}/{token}")),
            relay: None,
            events: None,
        }),
        ..toolfleet_protocol::client::question("What does one clock say?")
    };
    let id = job.invocation_id.clone();
    let mut sub = env.follow_and_submit(&job).await;
    let mut seen = Vec::new();
    let (call_id, _, _, subject) = until(&mut sub, &mut seen, approval_requested).await;
    let js = async_nats::jetstream::new(env.client.clone());
    let kv = js
        .get_key_value(env.subjects.parked_bucket())
        .await
        .unwrap();
    let record = kv
        .get(format!("default.{id}"))
        .await
        .unwrap()
        .expect("the parked record, under its tenant");
    let text = String::from_utf8_lossy(&record);
    assert!(!text.contains(token), "{text}");
    assert!(!text.contains(&addr.to_string()), "{text}");
    assert!(text.contains("sealedWebhook"), "{text}");
    let v = request(
        &env,
        subject,
        json!({ "callId": call_id, "decision": "approve" }),
    )
    .await;
    assert_eq!(v["ok"], true, "{v}");
    let end = until(&mut sub, &mut seen, terminal).await;
    assert!(matches!(end, ChatEventBody::Completed { .. }), "{end:?}");
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let delivered = got.lock().unwrap().clone();
        if let Some((_, body)) = delivered.iter().find(|(path, _)| path == token) {
            let event: Value = serde_json::from_slice(body).unwrap();
            assert_eq!(event["type"], "completed", "{event}");
            assert_eq!(event["invocationId"], id.as_str(), "{event}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the webhook got {delivered:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An orchestrator that parked an invocation and died before its chat
/// job's ack landed: here its NATS user may not ack chat jobs (so no ack
/// lands), and it is stopped once the approval request is out. The job is
/// delivered again after its ack wait, and the next orchestrator says the
/// same approval request again — the model is not asked again, nothing
/// runs — and the person's approval then finishes the invocation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_park_whose_ack_was_lost_says_its_requests_again_and_reruns_nothing() {
    let auth = r#"
authorization {
  users = [
    { user: "all", password: "all" }
    { user: "noack", password: "noack", permissions: {
        publish: { allow: [">"], deny: ["$JS.ACK.>"] },
        subscribe: { allow: [">"] } } }
  ]
}
no_auth_user: "all"
"#
    .to_string();
    let env = Env::start_with(
        two_clocks_script(),
        Options {
            workers: vec!["system"],
            no_orchestrator: true,
            nats: toolfleet_local::servers::NatsConfig {
                extra: Some(auth),
                ..Default::default()
            },
            ..Default::default()
        },
    )
    .await;
    let config = || {
        let profiles = toolfleet_config::FleetConfig::from_toml(
            &profiles(60_000).replace("{base_url}", env.model.base_url().as_str()),
            "test profiles",
        )
        .unwrap();
        toolfleet_orchestrator::OrchestratorConfig::new(env.subjects.clone(), profiles)
    };
    let first = support::start_orchestrator(
        format!("nats://noack:noack@127.0.0.1:{}", env.nats.port()),
        env.redis.url(),
        config(),
    )
    .await;
    let job = toolfleet_protocol::client::question("What does one clock say?");
    let mut sub = env.follow_and_submit(&job).await;
    let mut seen = Vec::new();
    let (call, tool, ..) = until(&mut sub, &mut seen, approval_requested).await;
    assert_eq!(tool, "system:current_datetime@1.0.0");
    // The park is written; the ack cannot land. The orchestrator dies.
    first.shutdown.cancel();
    first.drain(Duration::from_millis(200)).await;
    let second = support::start_orchestrator(env.nats.url(), env.redis.url(), config()).await;
    let mut again = Vec::new();
    let (repeated, ..) = until(&mut sub, &mut again, approval_requested).await;
    assert_eq!(repeated, call, "the same call's request, said again");
    assert!(
        !again
            .iter()
            .any(|e| matches!(e.body, ChatEventBody::ToolCall { .. }) || e.body.is_terminal()),
        "nothing reran: {again:?}"
    );
    assert_eq!(env.model.requests().len(), 1, "the model was asked once");
    let v = request(
        &env,
        env.subjects.chat_approve("default", &job.invocation_id),
        json!({ "callId": call, "decision": "approve" }),
    )
    .await;
    assert_eq!(v["ok"], true, "{v}");
    let end = until(&mut sub, &mut again, terminal).await;
    assert!(matches!(&end, ChatEventBody::Completed { .. }), "{end:?}");
    assert_eq!(env.model.requests().len(), 2);
    second.drain(Duration::from_secs(5)).await;
}
