//! Threads and double texting (issue 32, part 1) on real nats-server and
//! redis-server, with two orchestrators and the scripted model server
//! standing in for the provider (it records every request, so a test sees
//! the conversation each turn was sent): the thread keeps the
//! conversation so a client sends only its new message; `reject`,
//! `enqueue`, `interrupt` and `rollback`, a race of two jobs on one thread
//! across both orchestrators; a thread bounded and expiring; another
//! tenant (under the shipped `ops/nats/auth.conf` identities) neither
//! reads nor joins it; a bad thread id refused.

// Tests are exempt from the 100-line limit: a scenario reads top to bottom.
#![allow(clippy::too_many_lines)]

mod support;

use std::time::Duration;

use serde_json::{Value, json};
use toolfleet_protocol::ChatJob;
use toolfleet_protocol::thread::MultitaskStrategy;

use support::{Env, Options, WAIT, events_until_terminal, kinds, next_json};

/// Answers echo the question; `slow` questions take a while; `tool`
/// questions call the clock first, then answer slowly (so a newer job
/// can cut them short after their tool call finished).
fn script() -> Value {
    json!({
        "rules": [
            { "whenUserContains": ["tool"], "steps": [
                { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
                { "answer": "after the clock: {{user}}",
                  "fault": { "kind": "slowFirstToken", "delayMs": 6000 } } ] },
            { "whenUserContains": ["long"], "steps": [
                { "answer": "at length: {{user}}",
                  "fault": { "kind": "slowFirstToken", "delayMs": 4000 } } ] },
            { "whenUserContains": ["slow"], "steps": [
                { "answer": "slowly: {{user}}",
                  "fault": { "kind": "slowFirstToken", "delayMs": 1500 } } ] }
        ],
        "default": { "steps": [ { "answer": "noted: {{user}}" } ] }
    })
}

/// A fleet with the system worker and two orchestrators (the second on
/// its own runtime, returned to be kept alive), threads tuned by `tweak`.
async fn two_orchestrators(
    tweak: fn(&mut toolfleet_orchestrator::OrchestratorConfig),
) -> (Env, toolfleet_service::Runtime) {
    let env = Env::start_with(
        script(),
        Options {
            workers: vec!["system"],
            tweak,
            ..Options::default()
        },
    )
    .await;
    let profiles = toolfleet_config::FleetConfig::single(
        toolfleet_llm::deployments::Deployment::new(env.model.base_url(), "toolfleet-scripted")
            .with_api_key("sk-test-secret-never-logged".to_string()),
    );
    let mut config =
        toolfleet_orchestrator::OrchestratorConfig::new(env.subjects.clone(), profiles);
    tweak(&mut config);
    let second = support::start_orchestrator(env.nats.url(), env.redis.url(), config).await;
    (env, second)
}

fn no_tweak(_: &mut toolfleet_orchestrator::OrchestratorConfig) {}

/// A job of thread `thread` saying `text`, with `strategy`.
fn job(thread: &str, text: &str, strategy: Option<MultitaskStrategy>) -> ChatJob {
    let mut job = toolfleet_protocol::client::question(text);
    job.thread_id = Some(thread.into());
    job.multitask_strategy = strategy;
    job
}

/// The model requests whose last user message is `text`.
fn requests_for(env: &Env, text: &str) -> Vec<Value> {
    env.model
        .requests()
        .into_iter()
        .filter(|r| {
            r["messages"]
                .as_array()
                .and_then(|m| m.iter().rev().find(|m| m["role"] == "user"))
                .is_some_and(|m| m["content"] == text)
        })
        .collect()
}

/// The text of every message of `request`, in order (`role: content`).
fn transcript(request: &Value) -> Vec<String> {
    request["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            format!(
                "{}: {}",
                m["role"].as_str().unwrap(),
                m["content"].as_str().unwrap_or("")
            )
        })
        .collect()
}

/// Runs `job` to its end; its events.
async fn run(env: &Env, job: &ChatJob) -> Vec<Value> {
    let mut events = env.follow_and_submit(job).await;
    events_until_terminal(&mut events).await
}

/// The event of `kind` among `events`.
fn event<'a>(events: &'a [Value], kind: &str) -> &'a Value {
    events
        .iter()
        .find(|e| e["type"] == kind)
        .unwrap_or_else(|| panic!("no {kind} event in {:?}", kinds(events)))
}

/// Waits for the next event of `kind` on `events`; every event until it.
async fn until(events: &mut async_nats::Subscriber, kind: &str) -> Vec<Value> {
    let mut seen = Vec::new();
    loop {
        let e = next_json(events).await;
        let done = e["type"] == kind;
        seen.push(e);
        if done {
            return seen;
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_keep_the_conversation_so_a_client_sends_only_the_new_message() {
    let (env, _second) = two_orchestrators(no_tweak).await;
    let first = run(&env, &job("t-keep", "my name is Ada", None)).await;
    assert_eq!(event(&first, "completed")["text"], "noted: my name is Ada");
    assert_eq!(event(&first, "started")["threadId"], "t-keep");
    let second = run(&env, &job("t-keep", "what is my name?", None)).await;
    assert_eq!(second.last().unwrap()["type"], "completed", "{second:?}");
    let asked = requests_for(&env, "what is my name?");
    assert_eq!(asked.len(), 1);
    let said = transcript(&asked[0]);
    // The system prompt, the thread's turn, then the new message.
    assert_eq!(
        said[1..],
        [
            "user: my name is Ada",
            "assistant: noted: my name is Ada",
            "user: what is my name?"
        ],
        "{said:?}"
    );
    // Another thread of the tenant starts empty.
    run(&env, &job("t-other", "hello", None)).await;
    let said = transcript(&requests_for(&env, "hello")[0]);
    assert_eq!(said[1..], ["user: hello"], "{said:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_reject_a_second_job_while_one_runs_even_in_a_race_across_two_orchestrators() {
    let (env, second) = two_orchestrators(no_tweak).await;
    // Reject is the default: a job arriving while another runs ends at
    // once, and runs nothing.
    let mut running = env
        .follow_and_submit(&job("t-busy", "slow one", None))
        .await;
    until(&mut running, "started").await;
    let refused = run(&env, &job("t-busy", "second", None)).await;
    let error = event(&refused, "error");
    assert_eq!(error["code"], "thread_busy", "{refused:?}");
    // Said first as a `thread` event, so `toolfleet events --thread` shows
    // the refused job too.
    assert_eq!(kinds(&refused), ["thread", "error"], "{refused:?}");
    assert_eq!(event(&refused, "thread")["state"], "refused");
    assert_eq!(event(&refused, "thread")["threadId"], "t-busy");
    assert!(error["message"].as_str().unwrap().contains("t-busy"));
    assert!(requests_for(&env, "second").is_empty());
    let series = r#"toolfleet_thread_jobs_total{outcome="refused",strategy="reject"}"#;
    assert_eq!(support::counted(&env, &second, series).await, 1.0);
    assert_eq!(
        events_until_terminal(&mut running).await.last().unwrap()["type"],
        "completed"
    );
    // A race: two jobs of one thread published together, taken by the two
    // orchestrators; exactly one gets the thread, every time.
    for round in 0..4 {
        let thread = format!("t-race-{round}");
        let (a, b) = (
            job(&thread, &format!("slow a{round}"), None),
            job(&thread, &format!("slow b{round}"), None),
        );
        let mut ea = env
            .subscribe(env.subjects.chat_events("default", &a.invocation_id))
            .await;
        let mut eb = env
            .subscribe(env.subjects.chat_events("default", &b.invocation_id))
            .await;
        let (ra, rb) = tokio::join!(
            toolfleet_protocol::client::submit(&env.client, &env.subjects, &a),
            toolfleet_protocol::client::submit(&env.client, &env.subjects, &b),
        );
        ra.unwrap();
        rb.unwrap();
        let (ea, eb) = tokio::join!(
            events_until_terminal(&mut ea),
            events_until_terminal(&mut eb)
        );
        let ends: Vec<&str> = [&ea, &eb]
            .iter()
            .map(|e| {
                let last = e.last().unwrap();
                if last["type"] == "completed" {
                    "completed"
                } else {
                    last["code"].as_str().unwrap()
                }
            })
            .collect();
        let mut sorted = ends.clone();
        sorted.sort_unstable();
        assert_eq!(
            sorted,
            ["completed", "thread_busy"],
            "round {round}: {ea:?} {eb:?}"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_enqueue_runs_the_waiting_jobs_one_at_a_time_in_order() {
    let (env, second) = two_orchestrators(no_tweak).await;
    let enqueue = Some(MultitaskStrategy::Enqueue);
    let a_job = job("t-line", "slow first", enqueue);
    let mut a = env.follow_and_submit(&a_job).await;
    until(&mut a, "started").await;
    let b_job = job("t-line", "slow second", enqueue);
    let mut b = env.follow_and_submit(&b_job).await;
    // b waits in line before c is even submitted.
    let waited = until(&mut b, "thread").await;
    let thread = waited.last().unwrap();
    assert_eq!(thread["state"], "queued", "{thread}");
    assert_eq!(thread["strategy"], "enqueue");
    let c_job = job("t-line", "slow third", enqueue);
    let mut c = env.follow_and_submit(&c_job).await;
    let (ea, eb, ec) = tokio::join!(
        events_until_terminal(&mut a),
        events_until_terminal(&mut b),
        events_until_terminal(&mut c)
    );
    for events in [&ea, &eb, &ec] {
        assert_eq!(events.last().unwrap()["type"], "completed", "{events:?}");
    }
    // b got the thread only after a let it go: `running`, then `started`.
    let states: Vec<&str> = eb
        .iter()
        .filter(|e| e["type"] == "thread")
        .map(|e| e["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["running"], "{eb:?}");
    assert!(kinds(&ec).contains(&"thread"));
    let series = r#"toolfleet_thread_jobs_total{outcome="waited",strategy="enqueue"}"#;
    assert_eq!(support::counted(&env, &second, series).await, 2.0);
    // Each turn was sent the turns before it: one at a time, in order.
    let third = transcript(&requests_for(&env, "slow third")[0]);
    assert_eq!(
        third[1..],
        [
            "user: slow first",
            "assistant: slowly: slow first",
            "user: slow second",
            "assistant: slowly: slow second",
            "user: slow third"
        ],
        "{third:?}"
    );
    // `toolfleet events --thread` shows the thread's three jobs, and only
    // them (another thread's job is left out).
    run(&env, &job("t-elsewhere", "unrelated", None)).await;
    let (code, out, err) = support::toolfleet_at(
        &env.nats.url(),
        &["events", "--thread", "t-line", "--no-follow", "-o", "json"],
    );
    assert_eq!(code, Some(0), "{err}");
    let shown: std::collections::BTreeSet<String> = out
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["invocationId"]
                .as_str()
                .unwrap()
                .to_owned()
        })
        .collect();
    let expected: std::collections::BTreeSet<String> = [
        a_job.invocation_id,
        b_job.invocation_id,
        c_job.invocation_id,
    ]
    .into();
    assert_eq!(shown, expected, "{out}");
    let (code, _, err) = support::toolfleet_at(
        &env.nats.url(),
        &["events", "--thread", "no-such-thread", "--no-follow"],
    );
    assert_eq!(code, Some(1), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_a_profiles_strategy_applies_when_the_job_names_none() {
    let env = Env::start_with(
        script(),
        Options {
            profiles_toml: Some(
                r#"
default_profile = "default"
[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"
[profiles.default]
deployment = "scripted"
multitask_strategy = "enqueue"
"#
                .into(),
            ),
            ..Options::default()
        },
    )
    .await;
    let mut a = env
        .follow_and_submit(&job("t-profile", "slow one", None))
        .await;
    until(&mut a, "started").await;
    // No strategy of its own: the profile's (enqueue) makes it wait.
    let second = run(&env, &job("t-profile", "second", None)).await;
    assert_eq!(event(&second, "thread")["state"], "queued", "{second:?}");
    assert_eq!(event(&second, "thread")["strategy"], "enqueue");
    assert_eq!(second.last().unwrap()["type"], "completed", "{second:?}");
    // The job's own strategy wins over the profile's.
    let mut c = env
        .follow_and_submit(&job("t-profile", "slow again", None))
        .await;
    until(&mut c, "started").await;
    let refused = run(
        &env,
        &job("t-profile", "not now", Some(MultitaskStrategy::Reject)),
    )
    .await;
    assert_eq!(
        event(&refused, "error")["code"],
        "thread_busy",
        "{refused:?}"
    );
    events_until_terminal(&mut a).await;
    events_until_terminal(&mut c).await;
    // A strategy the fleet does not know stops the configuration's load.
    let bad = toolfleet_config::FleetConfig::from_toml(
        r#"
default_profile = "default"
[deployments.scripted]
base_url = "http://127.0.0.1:1/v1"
model = "toolfleet-scripted"
[profiles.default]
deployment = "scripted"
multitask_strategy = "merge"
"#,
        "bad profiles",
    )
    .unwrap_err()
    .to_string();
    assert!(bad.contains("merge"), "{bad}");
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_a_dead_orchestrators_place_lapses_and_the_line_moves_on() {
    let (env, _second) = two_orchestrators(no_tweak).await;
    // What an orchestrator that died mid-run (and whose job never came
    // back) leaves: the thread held by its job until its deadline and
    // margin, here 2.5 s from now.
    let now = u64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap();
    let record = json!({
        "active": { "invocationId": "ghost-run", "untilMs": now + 2500 },
        "messages": [ { "role": "user", "content": "said before the crash" } ],
        "turns": 1
    });
    let js = async_nats::jetstream::new(env.client.clone());
    let kv = js
        .get_key_value(env.subjects.threads_bucket())
        .await
        .unwrap();
    kv.put("default.t-ghost", record.to_string().into())
        .await
        .unwrap();
    let events = run(
        &env,
        &job(
            "t-ghost",
            "after the crash",
            Some(MultitaskStrategy::Enqueue),
        ),
    )
    .await;
    let states: Vec<(&str, &str)> = events
        .iter()
        .filter(|e| e["type"] == "thread")
        .map(|e| (e["state"].as_str().unwrap(), e["ahead"].as_str().unwrap()))
        .collect();
    assert_eq!(
        states,
        [("queued", "ghost-run"), ("running", "ghost-run")],
        "{events:?}"
    );
    assert_eq!(events.last().unwrap()["type"], "completed", "{events:?}");
    // The thread's conversation survived the crash.
    let said = transcript(&requests_for(&env, "after the crash")[0]);
    assert_eq!(
        said[1..],
        ["user: said before the crash", "user: after the crash"],
        "{said:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_toolfleet_chat_takes_a_thread_and_an_idempotency_key() {
    let (env, _second) = two_orchestrators(no_tweak).await;
    let url = env.nats.url();
    let chat = |args: &[&str]| support::toolfleet_at(&url, &[&["chat"], args].concat());
    let (code, out, err) = chat(&["--thread", "t-cli", "my name is Bo"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.contains("noted: my name is Bo"), "{out}");
    let (code, _, err) = chat(&["--thread", "t-cli", "--strategy", "enqueue", "who am I?"]);
    assert_eq!(code, Some(0), "{err}");
    let said = transcript(&requests_for(&env, "who am I?")[0]);
    assert_eq!(said[1], "user: my name is Bo", "{said:?}");
    for _ in 0..2 {
        let (code, out, err) = chat(&["--idempotency-key", "k-cli", "count me once"]);
        assert_eq!(code, Some(0), "{err}");
        assert!(out.contains("noted: count me once"), "{out}");
    }
    assert_eq!(requests_for(&env, "count me once").len(), 1);
    let (code, _, err) = chat(&["--thread", "a.b", "bad"]);
    assert_eq!(code, Some(64), "{err}");
    assert!(err.contains("--thread"), "{err}");
    let (code, _, err) = chat(&["--thread", "t-cli", "--strategy", "merge", "bad"]);
    assert_ne!(code, Some(0), "{err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_a_job_parked_for_approval_keeps_its_thread_until_it_resumes_and_ends() {
    let env = Env::start_with(
        script(),
        Options {
            workers: vec!["system"],
            profiles_toml: Some(
                r#"
default_profile = "default"
[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"
[profiles.default]
deployment = "scripted"
require_approval = ["system:current_datetime"]
approval_timeout_ms = 600000
"#
                .into(),
            ),
            ..Options::default()
        },
    )
    .await;
    let enqueue = Some(MultitaskStrategy::Enqueue);
    let mut held = env
        .follow_and_submit(&job("t-parked", "tool please", enqueue))
        .await;
    let asked = until(&mut held, "approval_requested").await;
    let request = asked.last().unwrap().clone();
    // Parked (its chat job acked): the thread is still its.
    let mut next = env
        .follow_and_submit(&job("t-parked", "after approval", enqueue))
        .await;
    assert_eq!(
        until(&mut next, "thread").await.last().unwrap()["state"],
        "queued"
    );
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert!(requests_for(&env, "after approval").is_empty());
    let reply = env
        .client
        .request(
            request["subject"].as_str().unwrap().to_owned(),
            json!({ "callId": request["callId"], "decision": "approve" })
                .to_string()
                .into(),
        )
        .await
        .unwrap();
    let reply: Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(reply["ok"], true, "{reply}");
    let (first, second) = tokio::join!(
        events_until_terminal(&mut held),
        events_until_terminal(&mut next)
    );
    assert_eq!(first.last().unwrap()["type"], "completed", "{first:?}");
    assert_eq!(second.last().unwrap()["type"], "completed", "{second:?}");
    // The resumed turn (its approved call, its answer) is in the thread.
    let said = transcript(&requests_for(&env, "after approval")[0]);
    assert_eq!(said[1], "user: tool please", "{said:?}");
    assert!(said.iter().any(|m| m.starts_with("tool: ")), "{said:?}");
    assert!(
        said.iter()
            .any(|m| m.contains("after the clock: tool please")),
        "{said:?}"
    );
}

fn one_in_flight(config: &mut toolfleet_orchestrator::OrchestratorConfig) {
    config.max_in_flight = 1;
}

fn one_in_flight_fifo(config: &mut toolfleet_orchestrator::OrchestratorConfig) {
    config.max_in_flight = 1;
    config.chat_dispatch = toolfleet_orchestrator::settings::ChatDispatch::Fifo;
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_a_waiting_job_gives_its_in_flight_place_back_while_it_waits() {
    waiting_gives_its_place_back(one_in_flight).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_a_waiting_job_gives_its_place_back_under_fifo_dispatch_too() {
    waiting_gives_its_place_back(one_in_flight_fifo).await;
}

/// Two orchestrators of one place each (`tweak`): one runs the thread's
/// long job, the other takes the job queued behind it — which must not
/// keep its place while it waits, or nothing else could run until the
/// long job ends.
async fn waiting_gives_its_place_back(tweak: fn(&mut toolfleet_orchestrator::OrchestratorConfig)) {
    let (env, _second) = two_orchestrators(tweak).await;
    let enqueue = Some(MultitaskStrategy::Enqueue);
    let long = job("t-place", "long task", enqueue);
    let mut a = env.follow_and_submit(&long).await;
    until(&mut a, "started").await;
    let mut b = env
        .follow_and_submit(&job("t-place", "queued behind", enqueue))
        .await;
    until(&mut b, "thread").await;
    let meanwhile = env
        .submit(&toolfleet_protocol::client::question("meanwhile"))
        .await
        .unwrap();
    assert_eq!(meanwhile.text, "noted: meanwhile");
    // The long job has not ended: the other job did not wait for it.
    let store = env.store().await;
    let ended = store
        .terminal_event(toolfleet_store::InvocationKey::new(
            "default",
            &long.invocation_id,
        ))
        .await
        .unwrap();
    assert!(
        ended.is_none(),
        "a job waited for the thread's long job to end"
    );
    let (ea, eb) = tokio::join!(events_until_terminal(&mut a), events_until_terminal(&mut b));
    assert_eq!(ea.last().unwrap()["type"], "completed", "{ea:?}");
    assert_eq!(eb.last().unwrap()["type"], "completed", "{eb:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_racing_jobs_that_wait_run_one_after_the_other() {
    let (env, _second) = two_orchestrators(no_tweak).await;
    for (round, strategy) in [MultitaskStrategy::Enqueue, MultitaskStrategy::Interrupt]
        .into_iter()
        .enumerate()
    {
        let thread = format!("t-waiters-{round}");
        let mut running = env
            .follow_and_submit(&job(&thread, &format!("tool first {round}"), None))
            .await;
        until(&mut running, "tool_result").await;
        // Two jobs of the same strategy at once, through both orchestrators.
        let (b, c) = (
            job(&thread, &format!("slow b{round}"), Some(strategy)),
            job(&thread, &format!("slow c{round}"), Some(strategy)),
        );
        let mut eb = env
            .subscribe(env.subjects.chat_events("default", &b.invocation_id))
            .await;
        let mut ec = env
            .subscribe(env.subjects.chat_events("default", &c.invocation_id))
            .await;
        let (rb, rc) = tokio::join!(
            toolfleet_protocol::client::submit(&env.client, &env.subjects, &b),
            toolfleet_protocol::client::submit(&env.client, &env.subjects, &c),
        );
        rb.unwrap();
        rc.unwrap();
        let (first, eb, ec) = tokio::join!(
            events_until_terminal(&mut running),
            events_until_terminal(&mut eb),
            events_until_terminal(&mut ec)
        );
        let first = first.last().unwrap();
        if strategy == MultitaskStrategy::Interrupt {
            assert_eq!(first["code"], "cancelled", "{first}");
            // The newest interrupter wins: the other ends cancelled —
            // displaced while it waited, or interrupted as it ran — and
            // only the newest completes.
            let (lb, lc) = (eb.last().unwrap(), ec.last().unwrap());
            let completed = [lb, lc].iter().filter(|e| e["type"] == "completed").count();
            let cancelled = [lb, lc].iter().filter(|e| e["code"] == "cancelled").count();
            assert_eq!((completed, cancelled), (1, 1), "{eb:?} {ec:?}");
            continue;
        }
        assert_eq!(first["type"], "completed", "{first}");
        assert_eq!(eb.last().unwrap()["type"], "completed", "{eb:?}");
        assert_eq!(ec.last().unwrap()["type"], "completed", "{ec:?}");
        // One after the other: whichever ran second was sent the other's turn.
        let said_b = transcript(&requests_for(&env, &format!("slow b{round}"))[0]);
        let said_c = transcript(&requests_for(&env, &format!("slow c{round}"))[0]);
        let b_saw_c = said_b.iter().any(|m| m.contains(&format!("slow c{round}")));
        let c_saw_b = said_c.iter().any(|m| m.contains(&format!("slow b{round}")));
        assert!(b_saw_c ^ c_saw_b, "{strategy}: {said_b:?} {said_c:?}");
    }
}

/// A job of thread `thread` that calls the clock, then answers slowly; a
/// newer job with `strategy` is submitted once the clock's result is in.
/// The older job's events, the newer's, and the newer's model request.
async fn cut_short(
    env: &Env,
    thread: &str,
    strategy: MultitaskStrategy,
) -> (Vec<Value>, Vec<Value>, Vec<String>) {
    let mut older = env
        .follow_and_submit(&job(thread, "tool please", None))
        .await;
    let mut seen = until(&mut older, "tool_result").await;
    assert_eq!(seen.last().unwrap()["status"], "ok", "{seen:?}");
    let newer_text = format!("{strategy} now");
    let newer = run(env, &job(thread, &newer_text, Some(strategy))).await;
    seen.extend(events_until_terminal(&mut older).await);
    let asked = requests_for(env, &newer_text);
    assert_eq!(asked.len(), 1);
    (seen, newer, transcript(&asked[0]))
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_interrupt_cancels_the_running_job_and_keeps_its_finished_tool_calls() {
    let (env, _second) = two_orchestrators(no_tweak).await;
    let (older, newer, said) = cut_short(&env, "t-int", MultitaskStrategy::Interrupt).await;
    let error = event(&older, "error");
    assert_eq!(error["code"], "cancelled", "{older:?}");
    assert!(
        error["message"].as_str().unwrap().contains("interrupted"),
        "{error}"
    );
    let waiting = event(&newer, "thread");
    assert_eq!(waiting["state"], "interrupting");
    assert_eq!(waiting["ahead"], older[0]["invocationId"]);
    assert_eq!(newer.last().unwrap()["type"], "completed", "{newer:?}");
    // The interrupted turn's question and its finished tool call (the
    // assistant's call, the clock's result) stay in the thread; its
    // unfinished answer does not.
    assert_eq!(said[1], "user: tool please", "{said:?}");
    assert!(said[2].starts_with("assistant: "), "{said:?}");
    assert!(said[3].starts_with("tool: "), "{said:?}");
    assert_eq!(said[4..], ["user: interrupt now"], "{said:?}");
    assert!(!said.iter().any(|m| m.contains("after the clock")));
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_rollback_cancels_the_running_job_and_forgets_its_turn() {
    let (env, _second) = two_orchestrators(no_tweak).await;
    run(&env, &job("t-roll", "remember blue", None)).await;
    let (older, newer, said) = cut_short(&env, "t-roll", MultitaskStrategy::Rollback).await;
    let error = event(&older, "error");
    assert_eq!(error["code"], "cancelled");
    assert!(
        error["message"].as_str().unwrap().contains("rolled back"),
        "{error}"
    );
    assert_eq!(newer.last().unwrap()["type"], "completed", "{newer:?}");
    // Only the turn before the rolled-back one, then the new message.
    assert_eq!(
        said[1..],
        [
            "user: remember blue",
            "assistant: noted: remember blue",
            "user: rollback now"
        ],
        "{said:?}"
    );
}

fn small_threads(config: &mut toolfleet_orchestrator::OrchestratorConfig) {
    config.threads.max_messages = 4;
    config.threads.ttl = Duration::from_secs(3);
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_are_bounded_and_forgotten_after_their_ttl() {
    let (env, _second) = two_orchestrators(small_threads).await;
    for turn in 1..=4 {
        run(&env, &job("t-small", &format!("turn {turn}"), None)).await;
    }
    // At most four messages are kept: the oldest turns went first.
    let said = transcript(&requests_for(&env, "turn 4")[0]);
    assert_eq!(
        said[1..],
        [
            "user: turn 2",
            "assistant: noted: turn 2",
            "user: turn 3",
            "assistant: noted: turn 3",
            "user: turn 4"
        ],
        "{said:?}"
    );
    // Left alone past its TTL, the thread is forgotten.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let js = async_nats::jetstream::new(env.client.clone());
        let kv = js
            .get_key_value(env.subjects.threads_bucket())
            .await
            .unwrap();
        if kv.get("default.t-small").await.unwrap().is_none() {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the thread did not expire"
        );
    }
    run(&env, &job("t-small", "after the ttl", None)).await;
    let said = transcript(&requests_for(&env, "after the ttl")[0]);
    assert_eq!(said[1..], ["user: after the ttl"], "{said:?}");
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_refuse_a_bad_thread_id_or_strategy_clearly_and_run_nothing() {
    let env = Env::start_with(script(), Options::default()).await;
    for (field, value) in [
        ("threadId", json!("a.b")),
        ("threadId", json!("")),
        ("threadId", json!("x".repeat(129))),
        ("multitaskStrategy", json!("merge")),
    ] {
        let mut body =
            serde_json::to_value(toolfleet_protocol::client::question("bad thread")).unwrap();
        body[field] = value.clone();
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
        let error = next_json(&mut events).await;
        assert_eq!(error["type"], "error", "{field}={value}: {error}");
        assert_eq!(error["code"], "malformed_job", "{error}");
        assert!(
            error["message"].as_str().unwrap().contains(field),
            "{error}"
        );
    }
    assert!(requests_for(&env, "bad thread").is_empty());
}

/// Tenants under the shipped identities: `acme` and `globex` name the
/// same thread id; each has its own thread, and neither can read the
/// threads bucket.
mod tenants {
    use super::*;
    use toolfleet_local::servers::RedisServer;

    use crate::support::identities::connect_as as connect;

    #[tokio::test(flavor = "multi_thread")]
    async fn threads_another_tenant_naming_the_same_thread_neither_reads_nor_joins_it() {
        let nats = crate::support::identities::secure_nats();
        let redis = RedisServer::start().expect("redis-server");
        let model = toolfleet_scripted::ScriptedServer::start(
            "127.0.0.1:0".parse().unwrap(),
            toolfleet_scripted::Script::from_json(&script().to_string()).unwrap(),
        )
        .await
        .unwrap();
        let subjects = toolfleet_protocol::Subjects::new("toolfleet").unwrap();
        let profiles = toolfleet_config::FleetConfig::single(
            toolfleet_llm::deployments::Deployment::new(model.base_url(), "toolfleet-scripted"),
        );
        let config = toolfleet_orchestrator::OrchestratorConfig::new(subjects.clone(), profiles);
        let registry = prometheus::Registry::new();
        let metrics = toolfleet_orchestrator::metrics::OrchestratorMetrics::register(
            &registry,
            toolfleet_service::metrics::dead_letters(&registry).unwrap(),
        )
        .unwrap();
        let store = toolfleet_store::CitationStore::connect(
            &redis.url(),
            subjects.prefix(),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
        let shutdown = tokio_util::sync::CancellationToken::new();
        let _stop = shutdown.clone().drop_guard();
        let orchestrator = tokio::time::timeout(
            WAIT,
            toolfleet_orchestrator::Ready::open(
                connect(&nats, "orchestrator").await,
                store,
                config,
                metrics,
                shutdown.clone(),
            ),
        )
        .await
        .expect("the orchestrator starts in time")
        .expect("the orchestrator starts under its identity");
        tokio::spawn(async move { orchestrator.run().await });
        let acme = connect(&nats, "client-acme").await;
        let globex = connect(&nats, "client-globex").await;
        let ask = |client: async_nats::Client, tenant: &'static str, text: &'static str| {
            let subjects = subjects.clone();
            async move {
                let mut job = job("shared-thread", text, None);
                job.tenant = Some(tenant.into());
                tokio::time::timeout(
                    WAIT,
                    toolfleet_protocol::client::chat(&client, &subjects, &job, WAIT, |_| {}),
                )
                .await
                .expect("in time")
                .expect("answered")
            }
        };
        ask(acme.clone(), "acme", "the vault code is canary-4711").await;
        let answer = ask(globex.clone(), "globex", "what is the vault code?").await;
        assert!(!format!("{answer:?}").contains("canary-4711"));
        let said = transcript(
            &model
                .requests()
                .into_iter()
                .find(|r| r.to_string().contains("what is the vault code?"))
                .unwrap(),
        );
        // globex's thread of that id is its own: empty before its question.
        assert_eq!(said[1..], ["user: what is the vault code?"], "{said:?}");
        assert!(!said.iter().any(|m| m.contains("canary")));
        // acme's own next turn still has its earlier one.
        ask(acme.clone(), "acme", "and again?").await;
        let said = transcript(
            &model
                .requests()
                .into_iter()
                .find(|r| r.to_string().contains("and again?"))
                .unwrap(),
        );
        assert_eq!(said[1], "user: the vault code is canary-4711", "{said:?}");
        // Neither tenant may read the threads bucket, whatever key it tries.
        for client in [&globex, &acme] {
            let js = async_nats::jetstream::new(client.clone());
            let read = tokio::time::timeout(Duration::from_secs(5), async {
                let kv = js.get_key_value(subjects.threads_bucket()).await?;
                kv.get("acme.shared-thread").await.map_err(Into::into)
            })
            .await;
            let leaked: Option<Result<Option<bytes::Bytes>, async_nats::Error>> = read.ok();
            assert!(
                !matches!(leaked, Some(Ok(Some(_)))),
                "a tenant read the threads bucket"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_a_failed_park_lets_the_thread_go_at_once() {
    // The tenant may park one invocation: a second job that needs an
    // approval cannot park and fails (`too_many_parked`). Its thread must
    // be free at once — not held until the approval would have expired.
    let env = Env::start_with(
        script(),
        Options {
            workers: vec!["system"],
            profiles_toml: Some(
                r#"
default_profile = "default"
[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"
[profiles.default]
deployment = "scripted"
require_approval = ["system:current_datetime"]
approval_timeout_ms = 600000
[tenant_defaults]
max_parked = 1
"#
                .into(),
            ),
            ..Options::default()
        },
    )
    .await;
    let mut parked = env
        .follow_and_submit(&job("t-park-cap-a", "tool please", None))
        .await;
    until(&mut parked, "approval_requested").await;
    let refused = run(&env, &job("t-park-cap-b", "tool again", None)).await;
    let refused = refused.last().unwrap();
    assert_eq!(refused["code"], "too_many_parked", "{refused}");
    // The thread's next job runs (its default strategy is reject: a held
    // thread would refuse it with thread_busy).
    let next = run(&env, &job("t-park-cap-b", "and now", None)).await;
    let next = next.last().unwrap();
    assert_eq!(next["type"], "completed", "{next}");
    assert_eq!(next["text"], "noted: and now");
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_a_repeat_waiting_for_its_first_job_gives_its_in_flight_place_back() {
    // Two orchestrators of one place each. The first runs the thread's
    // long job; the second takes the keyed job queued behind it (which
    // gives its place back), then a repeat of that key. The repeat must
    // not keep the place while it waits for the keyed job, or the keyed
    // job, once it has the thread, could never run: both would end at
    // their deadline.
    let (env, _second) = two_orchestrators(one_in_flight).await;
    let enqueue = Some(MultitaskStrategy::Enqueue);
    let mut a = env
        .follow_and_submit(&job("t-repeat-place", "long task", enqueue))
        .await;
    until(&mut a, "started").await;
    let mut keyed = job("t-repeat-place", "keyed behind", enqueue);
    keyed.idempotency_key = Some("repeat-place-1".into());
    keyed.timeout_ms = Some(30_000);
    let mut b = env.follow_and_submit(&keyed).await;
    assert_eq!(
        until(&mut b, "thread").await.last().unwrap()["state"],
        "queued"
    );
    let mut repeat = keyed.clone();
    repeat.invocation_id = format!("{}-again", keyed.invocation_id);
    let mut r = env.follow_and_submit(&repeat).await;
    // It names its thread, so `toolfleet events --thread` shows it.
    assert_eq!(
        until(&mut r, "duplicate").await.last().unwrap()["threadId"],
        "t-repeat-place"
    );
    let (ea, eb, er) = tokio::join!(
        events_until_terminal(&mut a),
        events_until_terminal(&mut b),
        events_until_terminal(&mut r)
    );
    assert_eq!(ea.last().unwrap()["type"], "completed", "{ea:?}");
    let eb = eb.last().unwrap();
    assert_eq!(eb["type"], "completed", "{eb}");
    let er = er.last().unwrap();
    assert_eq!(er["type"], "completed", "{er}");
    assert_eq!(er["text"], eb["text"]);
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_carry_earlier_passages_without_their_citation_numbers() {
    // A job's `[doc:N]` numbers are its own: the next job of the thread
    // numbers its references from 1 again. The first turn's search result
    // and answer cite [doc:N]; the second turn must not be sent those
    // markers (the model would repeat them, and they would be dropped or
    // name another source), but it is sent the passages.
    let env = Env::start_with(
        support::lighthouse_script(),
        Options {
            workers: vec!["system", "retrieval"],
            ..Options::default()
        },
    )
    .await;
    let first = run(
        &env,
        &job("t-cite", "how does a lighthouse warn ships?", None),
    )
    .await;
    let answered = first.last().unwrap();
    assert_eq!(answered["type"], "completed", "{first:?}");
    let searched = env
        .model
        .requests()
        .into_iter()
        .rfind(|r| r["messages"].to_string().contains("lighthouse"))
        .unwrap();
    assert!(
        transcript(&searched)[1..]
            .iter()
            .any(|m| m.contains("[doc:")),
        "the first turn's search cites nothing: {searched}"
    );
    let second = run(&env, &job("t-cite", "what else?", None)).await;
    assert_eq!(second.last().unwrap()["type"], "completed", "{second:?}");
    let sent = &requests_for(&env, "what else?")[0];
    let said = transcript(sent);
    assert!(
        said.iter().any(|m| m.starts_with("tool: ") && m.len() > 20),
        "the passages were not carried: {said:?}"
    );
    // (The profile's system prompt explains the markers: not a citation.)
    assert!(
        !said[1..].iter().any(|m| m.contains("[doc:")),
        "an earlier turn's citation number was carried: {said:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn threads_interrupting_a_parked_job_keeps_what_it_did_before_it_parked() {
    let env = Env::start_with(
        script(),
        Options {
            workers: vec!["system"],
            profiles_toml: Some(
                r#"
default_profile = "default"
[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"
[profiles.default]
deployment = "scripted"
require_approval = ["system:current_datetime"]
approval_timeout_ms = 600000
"#
                .into(),
            ),
            ..Options::default()
        },
    )
    .await;
    let mut held = env
        .follow_and_submit(&job("t-parked-cut", "tool please", None))
        .await;
    until(&mut held, "approval_requested").await;
    // A newer job interrupts the parked one: it is cancelled, and what
    // it did before it parked (its question; not the held call, which
    // never ran) stays in the thread for the newer job.
    let newer = job(
        "t-parked-cut",
        "never mind",
        Some(MultitaskStrategy::Interrupt),
    );
    let mut next = env.follow_and_submit(&newer).await;
    let cut = events_until_terminal(&mut held).await;
    let cut = cut.last().unwrap();
    assert_eq!(cut["code"], "cancelled", "{cut}");
    let done = events_until_terminal(&mut next).await;
    assert_eq!(done.last().unwrap()["type"], "completed", "{done:?}");
    let said = transcript(&requests_for(&env, "never mind")[0]);
    assert_eq!(
        said[1..],
        ["user: tool please", "user: never mind"],
        "{said:?}"
    );
}
