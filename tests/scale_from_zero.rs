//! Scale from zero (issue 31): a pool declared in the orchestrator's
//! profiles file (`[pools.<name>] declared = true`) has its tools offered
//! while none of its workers is live; a call's job queues on the tool's
//! durable consumer (made by the orchestrator), where the backlog gauge
//! and KEDA's `nats-jetstream` trigger (the consumer's `num_pending`) see
//! it, and the call waits for the pool's first worker until the job's
//! deadline. An undeclared pool with no worker is answered `no_worker` at
//! once, as before. On real servers, with the scripted model.

use std::time::Duration;

use serde_json::{Value, json};
use toolfleet_orchestrator::OrchestratorConfig;
use toolfleet_orchestrator::tools::declared::DeclaredPools;

use crate::support::{self, Env, Options, WAIT, events_until_terminal, kinds, next_json};

const TOOL: &str = "system:current_datetime@1.0.0";
const CONSUMER: &str = "tool_system_current_datetime_1_0_0";

/// One profile on the scripted model; the system pool declared when
/// `declared`.
fn profiles(declared: bool) -> String {
    let pools = if declared {
        "[pools.system]\ndeclared = true\n"
    } else {
        ""
    };
    format!(
        "[deployments.scripted]\nbase_url = \"{{base_url}}\"\nmodel = \"toolfleet-scripted\"\n\
         [profiles.default]\ndeployment = \"scripted\"\n{pools}"
    )
}

/// The clock, then an answer quoting it; the model takes `delay_ms`
/// before it calls the tool.
fn clock_script(delay_ms: u64) -> Value {
    let mut call = json!({ "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] });
    if delay_ms > 0 {
        call["fault"] = json!({ "kind": "slowFirstToken", "delayMs": delay_ms });
    }
    json!({
        "rules": [{ "whenUserContains": ["time"], "steps": [
            call,
            { "answer": "It is {{tool:current_datetime}}" }
        ] }]
    })
}

/// The orchestrator as its binary builds it from the profiles file: the
/// declared pools' tools from the shipped definitions. Readings every
/// 200 ms, so the test waits little for the gauges.
fn as_the_binary(config: &mut OrchestratorConfig) {
    config.declared =
        DeclaredPools::load(&config.profiles, &support::root().join("tool_definitions"))
            .expect("the declared pools resolve");
    config.catalog_refresh = Duration::from_millis(200);
}

/// A fleet with no worker at all; the system pool declared or not.
async fn fleet(declared: bool, script: Value) -> Env {
    Env::start_with(
        script,
        Options {
            workers: Vec::new(),
            tweak: as_the_binary,
            profiles_toml: Some(profiles(declared)),
            data_source: None,
            ..Options::default()
        },
    )
    .await
}

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

/// The clock tool's consumer, as KEDA's trigger reads it: jobs waiting
/// (`num_pending`) and jobs taken, unanswered (`num_ack_pending`).
async fn consumer_backlog(env: &Env) -> (u64, usize) {
    let js = async_nats::jetstream::new(env.client.clone());
    let info = js
        .get_stream(env.subjects.tools_stream())
        .await
        .unwrap()
        .consumer_info(CONSUMER)
        .await
        .expect("the declared tool's consumer exists");
    (info.num_pending, info.num_ack_pending)
}

/// The clock tool's consumer's settings: what a worker would make it
/// with, whoever made it.
async fn consumer_settings(env: &Env) -> (String, Duration, i64, i64) {
    let js = async_nats::jetstream::new(env.client.clone());
    let c = js
        .get_stream(env.subjects.tools_stream())
        .await
        .unwrap()
        .consumer_info(CONSUMER)
        .await
        .unwrap()
        .config;
    (
        c.filter_subject,
        c.ack_wait,
        c.max_deliver,
        c.max_ack_pending,
    )
}

/// The value of the orchestrator's gauge `name` for the clock tool.
fn gauge(metrics: &str, name: &str) -> Option<i64> {
    let series = format!("{name}{{tool=\"{TOOL}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&series))
        .map(|v| v.trim().parse().unwrap())
}

/// Waits until the gauge `name` of the clock tool reads `value`.
async fn gauge_reads(env: &Env, name: &str, value: i64) {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let seen = gauge(&env.metrics_text().await, name);
        if seen == Some(value) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{name} of {TOOL} never read {value} (last {seen:?})"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The next event of `events` whose type is `kind`, skipping others.
async fn next_of(events: &mut async_nats::Subscriber, kind: &str) -> Value {
    loop {
        let event = next_json(events).await;
        if event["type"] == kind {
            return event;
        }
        assert!(
            event["type"] != "completed" && event["type"] != "error",
            "ended before a {kind} event: {event}"
        );
    }
}

/// A declared pool with no worker: the model is offered its tool and
/// calls it; the job queues (the consumer's `num_pending` and the fleet's
/// `toolfleet_tool_backlog` show 1, its live workers 0) and the call says
/// it waits; then the pool's first worker starts, takes the job, and the
/// chat job completes inside its deadline with the tool's result.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_pool_with_no_worker_gets_the_job_and_its_first_worker_answers_it() {
    let env = fleet(true, clock_script(0)).await;
    // Made at start, before any worker: KEDA's trigger has a consumer to
    // read, and the pool has a backlog of 0.
    assert_eq!(consumer_backlog(&env).await, (0, 0));
    let made = consumer_settings(&env).await;
    assert_eq!(made.0, "toolfleet.tool.system.current_datetime.1_0_0");
    gauge_reads(&env, "toolfleet_tool_backlog", 0).await;

    let mut job = toolfleet_protocol::client::question("What time is it?");
    job.timeout_ms = Some(60_000);
    let mut events = env.follow_and_submit(&job).await;
    let offered = next_of(&mut events, "tool_call").await;
    assert_eq!(
        offered["tool"], TOOL,
        "the declared tool is offered and called"
    );
    let waiting = next_of(&mut events, "tool_progress").await;
    assert!(
        waiting["message"]
            .as_str()
            .unwrap()
            .contains("No worker of the pool system is running yet"),
        "{waiting}"
    );

    // The job waits in the pool's queue, where the autoscaler reads it.
    let deadline = tokio::time::Instant::now() + WAIT;
    while consumer_backlog(&env).await != (1, 0) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the job never queued"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    gauge_reads(&env, "toolfleet_tool_backlog", 1).await;
    gauge_reads(&env, "toolfleet_tool_live_workers", 0).await;

    // The pool scales up from zero.
    let worker = env.start_worker(system_worker().await).await;
    let rest = events_until_terminal(&mut events).await;
    let terminal = rest.last().unwrap();
    assert_eq!(terminal["type"], "completed", "{:?}", kinds(&rest));
    let result = rest.iter().find(|e| e["type"] == "tool_result").unwrap();
    assert_eq!(result["status"], "ok", "{result}");
    let text = terminal["text"].as_str().unwrap();
    assert!(
        text.starts_with("It is ") && text.contains("20"),
        "the answer quotes the clock's result: {text}"
    );
    assert_eq!(
        consumer_backlog(&env).await,
        (0, 0),
        "the job was taken and acked"
    );
    assert_eq!(
        consumer_settings(&env).await,
        made,
        "the worker found its consumer as it would have made it"
    );
    gauge_reads(&env, "toolfleet_tool_backlog", 0).await;
    gauge_reads(&env, "toolfleet_tool_live_workers", 1).await;
    worker.stop().await;
}

/// An undeclared pool whose last worker went away between the offer and
/// the model's call is answered `no_worker` at once, as before: no job
/// goes out (the tools stream never holds one), and the model answers
/// without the tool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undeclared_pool_with_no_worker_is_answered_no_worker_at_once() {
    // The model thinks for 3 s before it calls the clock: time for the
    // worker to go and the orchestrator's catalog to notice.
    let env = fleet(false, clock_script(3_000)).await;
    let worker = env.start_worker(system_worker().await).await;
    gauge_reads(&env, "toolfleet_tool_live_workers", 1).await;

    let job = toolfleet_protocol::client::question("What time is it?");
    let mut events = env.follow_and_submit(&job).await;
    next_of(&mut events, "started").await;
    worker.stop().await;
    gauge_reads(&env, "toolfleet_tool_live_workers", 0).await;

    let rest = events_until_terminal(&mut events).await;
    let result = rest
        .iter()
        .find(|e| e["type"] == "tool_result")
        .unwrap_or_else(|| panic!("no tool_result: {:?}", kinds(&rest)));
    assert_eq!(result["errorCode"], "no_worker", "{result}");
    assert!(
        !kinds(&rest).contains(&"tool_progress"),
        "nothing waits for a worker: {:?}",
        kinds(&rest)
    );
    let terminal = rest.last().unwrap();
    assert_eq!(terminal["type"], "completed", "{terminal}");
    assert!(
        terminal["text"]
            .as_str()
            .unwrap()
            .contains("not available right now"),
        "{terminal}"
    );
    let js = async_nats::jetstream::new(env.client.clone());
    let mut stream = js.get_stream(env.subjects.tools_stream()).await.unwrap();
    let state = &stream.info().await.unwrap().state;
    assert_eq!(
        (state.messages, state.last_sequence),
        (0, 0),
        "no tool job was ever published"
    );
}

/// A declared pool whose worker never comes: the call waits in its queue
/// until just before the job's deadline, then the job ends with
/// `deadline_exceeded` naming the pool — not a hang, not `no_worker` at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_pool_whose_worker_never_comes_ends_the_job_at_its_deadline() {
    let env = fleet(true, clock_script(0)).await;
    let mut job = toolfleet_protocol::client::question("What time is it?");
    let timeout = Duration::from_secs(4);
    job.timeout_ms = Some(timeout.as_millis() as u64);
    let submitted = std::time::Instant::now();
    let mut events = env.follow_and_submit(&job).await;
    let all = events_until_terminal(&mut events).await;
    let waited = submitted.elapsed();
    assert_eq!(
        kinds(&all)
            .into_iter()
            .filter(|k| k.starts_with("tool_"))
            .collect::<Vec<_>>(),
        ["tool_call", "tool_progress", "tool_result"],
        "{all:?}"
    );
    let result = all.iter().find(|e| e["type"] == "tool_result").unwrap();
    assert_eq!(result["errorCode"], "no_worker", "{result}");
    let terminal = all.last().unwrap();
    assert_eq!(terminal["type"], "error", "{terminal}");
    assert_eq!(terminal["code"], "deadline_exceeded", "{terminal}");
    let message = terminal["message"].as_str().unwrap();
    assert!(
        message.contains("no worker of the declared pool system started before the job's deadline")
            && message.contains(TOOL),
        "{message}"
    );
    // It waited for the pool (a lower bound: the wait ends a margin before
    // the deadline, never earlier).
    assert!(
        waited >= timeout - toolfleet_orchestrator::dispatch::POOL_WAIT_MARGIN,
        "ended after {waited:?}, before the wait for the pool could end"
    );
    // The job is still queued: the first worker to come drops it, its
    // invocation's deadline past.
    assert_eq!(consumer_backlog(&env).await, (1, 0));
}
