//! Issue 8 behaviour end to end: the orchestrator's stages — intake (dead
//! letters of undecodable jobs), the orchestrator trait (custom
//! orchestrators chosen by a profile), tool progress events, and payload
//! limits — against the real fleet.

use std::time::Duration;

use futures::future::BoxFuture;
use futures::{FutureExt, StreamExt};
use serde_json::{Value, json};
use toolfleet_llm::ToolCall;
use toolfleet_orchestrator::context::Context;
use toolfleet_orchestrator::dispatch::new_call_id;
use toolfleet_orchestrator::{
    Answer, ContextHandler, Ending, Events, Failure, Fleet, Invocation, Orchestrator,
};
use toolfleet_protocol::{ChatEvent, ChatEventBody, Envelope, MAX_JOB_BYTES, ToolStatus};
use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput, Worker};

use crate::support::{self, Env, Options, WAIT, lighthouse_script, next_json};

/// Every event validates against the published schema and the numbering
/// has no gap.
fn assert_valid_and_numbered(events: &[ChatEvent]) {
    for (i, e) in events.iter().enumerate() {
        assert_eq!(e.seq, i as u64, "{events:?}");
        let v = serde_json::to_value(e).unwrap();
        Envelope::ChatEvent
            .validator()
            .validate(&v)
            .unwrap_or_else(|err| panic!("{v}: {err:?}"));
    }
}

fn names(events: &[ChatEvent]) -> Vec<&'static str> {
    events.iter().map(|e| e.body.name()).collect()
}

/// A chat job whose body is not JSON but whose `Nats-Msg-Id` is a valid
/// invocation id still ends visibly: an `error` event on that id, and a
/// dead letter carrying the id and the safe headers of the job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_job_with_only_a_message_id_gets_an_error_event_and_a_full_dead_letter() {
    let env = Env::start(lighthouse_script()).await;
    let js = async_nats::jetstream::new(env.client.clone());
    let mut dead = env.subscribe("toolfleet.deadletter.chat".into()).await;
    let mut events = env
        .subscribe("toolfleet.chat.events.default.msgid-7".into())
        .await;

    let mut h = async_nats::HeaderMap::new();
    h.insert("Nats-Msg-Id", "msgid-7");
    h.insert(
        "traceparent",
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    );
    h.insert("X-Api-Key", "sk-never-in-a-dead-letter");
    js.publish_with_headers("toolfleet.chat.submit.default", h, "{not json".into())
        .await
        .unwrap()
        .await
        .unwrap();

    let ev = next_json(&mut events).await;
    assert_eq!(ev["type"], "error", "{ev}");
    assert_eq!(ev["code"], "malformed_job", "{ev}");
    let d = next_json(&mut dead).await;
    assert_eq!(d["code"], "malformed_json", "{d}");
    assert_eq!(d["invocationId"], "msgid-7", "{d}");
    assert_eq!(d["headers"]["Nats-Msg-Id"], "msgid-7", "{d}");
    assert_eq!(
        d["headers"]["traceparent"], "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        "{d}"
    );
    assert!(!d.to_string().contains("sk-never"), "{d}");
    Envelope::DeadLetter
        .validator()
        .validate(&d)
        .expect("the dead letter follows its schema");

    // The id in the body wins over the headers when the body parses.
    let mut events = env
        .subscribe("toolfleet.chat.events.default.body-id-1".into())
        .await;
    let mut h = async_nats::HeaderMap::new();
    h.insert("Nats-Msg-Id", "header-id-1");
    h.insert("Toolfleet-Invocation-Id", "header-id-2");
    js.publish_with_headers(
        "toolfleet.chat.submit.default",
        h,
        json!({"invocationId": "body-id-1", "messages": 7})
            .to_string()
            .into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let ev = next_json(&mut events).await;
    assert_eq!(ev["code"], "malformed_job", "{ev}");
    let d = next_json(&mut dead).await;
    assert_eq!(d["invocationId"], "body-id-1", "{d}");
    assert_eq!(
        d["headers"]["Toolfleet-Invocation-Id"], "header-id-2",
        "{d}"
    );
}

/// Answers without calling the model: the last user message, echoed.
struct Echo;

impl Orchestrator for Echo {
    fn run<'a>(
        &'a self,
        inv: &'a mut Invocation,
        _fleet: &'a Fleet,
        events: &'a Events,
    ) -> BoxFuture<'a, Result<Ending, Failure>> {
        async move {
            let question = inv.job.messages.last().map(|m| m.content.clone());
            let Some(question) = question else {
                return Err(Failure::new("nothing_to_echo", "the job has no message"));
            };
            events.send(ChatEventBody::Delta {
                text: "echo: ".into(),
            });
            Ok(Answer {
                text: format!("echo: {question}"),
                rounds: 0,
            }
            .into())
        }
        .boxed()
    }
}

/// Runs one tool itself, with no model: what a custom orchestrator can do
/// through the fleet's public API.
struct Clock;

impl Orchestrator for Clock {
    fn run<'a>(
        &'a self,
        inv: &'a mut Invocation,
        fleet: &'a Fleet,
        events: &'a Events,
    ) -> BoxFuture<'a, Result<Ending, Failure>> {
        async move {
            let mut tools = fleet.tool_runner().await?;
            let call = ToolCall {
                id: new_call_id(),
                name: "current_datetime".into(),
                arguments: "{}".into(),
            };
            let outcome = tools.run(inv, &[call], events).await;
            match outcome.first() {
                Some(o) if o.status == ToolStatus::Ok => Ok(Answer {
                    text: format!("The clock says {}", o.content),
                    rounds: 0,
                }
                .into()),
                other => Err(Failure::new("clock_failed", format!("{other:?}"))),
            }
        }
        .boxed()
    }
}

const ORCHESTRATOR_PROFILES: &str = r#"
default_profile = "default"

[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"

[profiles.default]
deployment = "scripted"

[profiles.echo]
deployment = "scripted"
orchestrator = "echo"

[profiles.clock]
deployment = "scripted"
orchestrator = "clock"

[profiles.swarm]
deployment = "scripted"
orchestrator = "swarm"
"#;

fn started_profile(events: &[ChatEvent]) -> Option<String> {
    events.iter().find_map(|e| match &e.body {
        ChatEventBody::Started { profile, .. } => profile.clone(),
        _ => None,
    })
}

/// A profile's `orchestrator` picks a registered implementation; the frame
/// around it (started, references, completed) is the same for all; an
/// unregistered name falls back to the agentic loop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_profile_selects_a_custom_orchestrator_registered_in_the_config() {
    let env = Env::start_with(
        lighthouse_script(),
        Options {
            profiles_toml: Some(ORCHESTRATOR_PROFILES.into()),
            tweak: |c| {
                c.register_orchestrator("echo", Echo)
                    .register_orchestrator("clock", Clock);
            },
            ..Default::default()
        },
    )
    .await;

    let mut job = toolfleet_protocol::client::question("is anyone there?");
    job.profile = Some("echo".into());
    let outcome = env.submit(&job).await.expect("echo completes");
    assert_eq!(outcome.text, "echo: is anyone there?");
    assert_eq!(outcome.rounds, 0);
    assert!(outcome.llm_calls.is_empty());
    assert_eq!(started_profile(&outcome.events).as_deref(), Some("echo"));
    assert_eq!(
        names(&outcome.events),
        ["started", "delta", "completed"],
        "{:?}",
        outcome.events
    );
    assert_valid_and_numbered(&outcome.events);
    assert!(env.model.requests().is_empty(), "the model was not called");

    // A custom orchestrator runs tools through the same dispatch.
    let mut job = toolfleet_protocol::client::question("what time is it?");
    job.profile = Some("clock".into());
    let outcome = env.submit(&job).await.expect("clock completes");
    assert!(
        outcome.text.starts_with("The clock says "),
        "{}",
        outcome.text
    );
    assert_eq!(
        names(&outcome.events),
        ["started", "tool_call", "tool_result", "completed"],
        "{:?}",
        outcome.events
    );
    assert_valid_and_numbered(&outcome.events);
    assert!(env.model.requests().is_empty(), "the model was not called");

    // An orchestrator nobody registered: the agentic loop runs instead.
    let mut job = toolfleet_protocol::client::question("how do lighthouses warn ships?");
    job.profile = Some("swarm".into());
    let outcome = env.submit(&job).await.expect("falls back to agentic");
    assert_eq!(started_profile(&outcome.events).as_deref(), Some("swarm"));
    assert!(outcome.rounds >= 1);
    assert!(!env.model.requests().is_empty(), "the model was called");
}

/// A deployment's own context step: adds a system note after the
/// conversation is built, naming how many tools the invocation may use.
struct HouseRules;

impl ContextHandler for HouseRules {
    fn name(&self) -> &str {
        "house_rules"
    }

    fn handle<'a>(
        &'a self,
        inv: &'a mut Invocation,
        _cx: &'a mut Context<'_>,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        let note = format!(
            "House rules: answer in one paragraph. You may use {} tools.",
            inv.scope.permitted.tools.len()
        );
        inv.messages
            .push(toolfleet_llm::Message::System { content: note });
        std::future::ready(Ok(())).boxed()
    }
}

/// A context step that refuses every job it sees.
struct Gatekeeper;

impl ContextHandler for Gatekeeper {
    fn name(&self) -> &str {
        "gatekeeper"
    }

    fn handle<'a>(
        &'a self,
        _inv: &'a mut Invocation,
        _cx: &'a mut Context<'_>,
    ) -> BoxFuture<'a, Result<(), Failure>> {
        let refused = Failure::new("not_today", "the gatekeeper says no");
        std::future::ready(Err(refused)).boxed()
    }
}

/// A third-party context handler plugs into the context stage without
/// replacing the orchestrator: one registered after the built-ins adds a
/// system note the model reads on its first call (after the permitted
/// tools are known); one that fails before `started` ends the job with
/// its own code, and the model is never called.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_third_party_context_handler_adds_a_system_note_the_model_reads() {
    let env = Env::start_with(
        lighthouse_script(),
        Options {
            tweak: |c| {
                c.register_context_handler(HouseRules);
            },
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env.ask("How do lighthouses warn ships?").await;
    let outcome = outcome.expect("the job completes");
    assert!(!outcome.text.is_empty());
    let requests = env.model.requests();
    let first = &requests[0]["messages"];
    let notes: Vec<&str> = first
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m["role"] == "system")
        .filter_map(|m| m["content"].as_str())
        .filter(|c| c.starts_with("House rules:"))
        .collect();
    assert_eq!(notes.len(), 1, "{first}");
    assert!(
        !notes[0].ends_with("use 0 tools."),
        "the note was written after the permitted tools: {}",
        notes[0]
    );

    let env = Env::start_with(
        lighthouse_script(),
        Options {
            tweak: |c| {
                c.context_handlers_mut()
                    .insert_before("started", Gatekeeper)
                    .unwrap();
            },
            ..Default::default()
        },
    )
    .await;
    let (_, outcome) = env.ask("How do lighthouses warn ships?").await;
    match outcome {
        Err(toolfleet_protocol::client::ClientError::Failed { code, message }) => {
            assert_eq!(code, "not_today");
            assert_eq!(message, "the gatekeeper says no");
        }
        other => panic!("expected the gatekeeper's error, got {other:?}"),
    }
    assert!(env.model.requests().is_empty(), "the model was not called");
}

/// Sends two progress messages, the second longer than an event carries,
/// then answers.
struct SlowClock;

impl Tool for SlowClock {
    type Args = Value;
    async fn call(&self, ctx: &ToolCtx, _args: Value) -> Result<ToolOutput, ToolError> {
        ctx.progress("reading the clock").await;
        ctx.progress("é".repeat(3000)).await;
        Ok(ToolOutput::text("12:00"))
    }
}

/// The shipped `current_datetime` definition, renamed so no shipped
/// family serves it.
fn slow_clock_definition(dir: &std::path::Path) -> std::path::PathBuf {
    support::renamed_definition(dir, "testing", "slow_clock")
}

/// A tool's `progress` messages reach the chat client as `tool_progress`
/// events, between the call's `tool_call` and `tool_result`, naming the
/// call and the tool; a long one is cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tool_progress_reaches_the_client_as_events() {
    let env = Env::start(json!({
        "rules": [{ "whenUserContains": ["clock"], "steps": [
            { "toolCalls": [ { "name": "slow_clock", "arguments": {} } ] },
            { "answer": "The slow clock says {{tool:slow_clock}}" }
        ] }]
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let worker = Worker::builder("testing")
        .definition_file(slow_clock_definition(dir.path()))
        .tool("testing.slow_clock", SlowClock)
        .build()
        .unwrap();
    let running = env.start_worker(worker).await;

    // The orchestrator's catalog may not have the new worker yet: a call
    // to it takes a fresh reading.
    let (_, outcome) = env.ask("what does the slow clock say?").await;
    let outcome = outcome.expect("completed");
    assert_eq!(outcome.text, "The slow clock says 12:00");
    assert_valid_and_numbered(&outcome.events);
    let calls: Vec<&ChatEvent> = outcome
        .events
        .iter()
        .filter(|e| {
            matches!(
                e.body,
                ChatEventBody::ToolCall { .. }
                    | ChatEventBody::ToolProgress { .. }
                    | ChatEventBody::ToolResult { .. }
            )
        })
        .collect();
    let kinds: Vec<&str> = calls.iter().map(|e| e.body.name()).collect();
    assert_eq!(
        kinds,
        ["tool_call", "tool_progress", "tool_progress", "tool_result"]
    );
    let ChatEventBody::ToolCall { call_id, .. } = &calls[0].body else {
        unreachable!()
    };
    let progress: Vec<(&str, &str, &str)> = calls[1..3]
        .iter()
        .map(|e| match &e.body {
            ChatEventBody::ToolProgress {
                call_id,
                tool,
                message,
            } => (call_id.as_str(), tool.as_str(), message.as_str()),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(
        progress[0],
        (
            call_id.as_str(),
            "testing:slow_clock@1.0.0",
            "reading the clock"
        )
    );
    let long = progress[1].2;
    assert_eq!(long.chars().count(), 1001, "cut to 1000 characters and …");
    assert!(long.ends_with("é…"));

    running.stop().await;
}

/// The server's default `max_payload` (1 MiB) is the contract's
/// `MAX_JOB_BYTES` of body alone: a tool job the contract allows but the
/// server cannot carry with its headers is answered at once with
/// `too_large` (naming the limit the model must stay under), not sent; the
/// oversized `tool_call` event is shrunk rather than lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_job_over_the_servers_limit_is_answered_too_large_without_being_sent() {
    // Job body: {"arguments":{"utcOffset":"…"}} — 30 bytes around the
    // value, so the body stays within the contract's limit.
    let value = "x".repeat(MAX_JOB_BYTES - 100);
    let env = Env::start(json!({
        "rules": [{ "whenUserContains": ["huge"], "steps": [
            { "toolCalls": [ { "name": "current_datetime", "arguments": { "utcOffset": value } } ] },
            { "answer": "Could not: {{tool:current_datetime}}" }
        ] }]
    }))
    .await;
    assert_eq!(
        env.client.server_info().max_payload,
        MAX_JOB_BYTES,
        "the test server runs with nats-server's default max_payload"
    );
    let (_, outcome) = env.ask("a huge question").await;
    let outcome = outcome.expect("the loop goes on to an answer");
    assert_valid_and_numbered(&outcome.events);
    let results = crate::support::result_codes(&outcome.events);
    assert_eq!(results, [(ToolStatus::Error, Some("too_large".into()))]);
    let shown = outcome.events.iter().find_map(|e| match &e.body {
        ChatEventBody::ToolCall { arguments, .. } => Some(arguments.clone()),
        _ => None,
    });
    assert!(
        shown
            .as_ref()
            .and_then(Value::as_str)
            .is_some_and(|s| s.contains("too large for an event")),
        "{shown:?}"
    );
    // The model is told the limit it must stay under, which is below the
    // contract's: the server's limit counts the headers too.
    let limit: usize = outcome
        .text
        .split("at most ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no limit in {:?}", outcome.text));
    assert!(limit < MAX_JOB_BYTES - 100, "{limit}");
    // The worker's counters (its "ok" series exists from its start).
    let metrics = env.metrics_text().await;
    let jobs: f64 = metrics
        .lines()
        .filter(|l| {
            l.starts_with("toolfleet_tool_jobs_total{")
                && l.contains("tool=\"system:current_datetime@1.0.0\"")
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum();
    assert_eq!(jobs, 0.0, "no job reached the worker: {metrics}");
}

/// A tool that never finishes by itself; it says when it starts and when
/// its future is dropped (the worker stopped it).
struct Stuck {
    started: std::sync::Arc<std::sync::atomic::AtomicBool>,
    stopped: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

struct SetOnDrop(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for SetOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Tool for Stuck {
    type Args = Value;
    async fn call(&self, _ctx: &ToolCtx, _args: Value) -> Result<ToolOutput, ToolError> {
        self.started
            .store(true, std::sync::atomic::Ordering::SeqCst);
        let _flag = SetOnDrop(self.stopped.clone());
        tokio::time::sleep(Duration::from_secs(3600)).await;
        Ok(ToolOutput::text("never"))
    }
}

/// Cancelling an invocation reaches the tool call it is waiting for: the
/// worker stops the tool (its future is dropped) and acks the job, instead
/// of running it to its timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_an_invocation_stops_its_running_tool() {
    let env = Env::start(json!({
        "rules": [{ "whenUserContains": ["clock"], "steps": [
            { "toolCalls": [ { "name": "slow_clock", "arguments": {} } ] },
            { "answer": "It is {{tool:slow_clock}}" }
        ] }]
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let started = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // A timeout far past the test's waits: only the cancel can stop it.
    let path = slow_clock_definition(dir.path());
    let mut def: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    def["timeoutMs"] = json!(3_600_000);
    std::fs::write(&path, def.to_string()).unwrap();
    let worker = Worker::builder("testing")
        .definition_file(path)
        .tool(
            "testing.slow_clock",
            Stuck {
                started: started.clone(),
                stopped: stopped.clone(),
            },
        )
        .build()
        .unwrap();
    let running = env.start_worker(worker).await;

    let job = toolfleet_protocol::client::question("what does the clock say?");
    let mut events = env.follow_and_submit(&job).await;
    loop {
        let ev = next_json(&mut events).await;
        assert_ne!(ev["type"], "error", "{ev}");
        if ev["type"] == "tool_call" {
            break;
        }
    }
    // Cancel once the tool is running.
    let js = async_nats::jetstream::new(env.client.clone());
    let mut consumer: async_nats::jetstream::consumer::PullConsumer = js
        .get_stream(env.subjects.tools_stream())
        .await
        .unwrap()
        .get_consumer("tool_testing_slow_clock_1_0_0")
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while !started.load(std::sync::atomic::Ordering::SeqCst) {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the worker never started the tool"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    env.client
        .publish(
            env.subjects.chat_cancel(job.tenant(), &job.invocation_id),
            "".into(),
        )
        .await
        .unwrap();
    // The worker's `cancelled` result may reach the orchestrator before its
    // own cancel does: then a tool_result comes first. Either way the
    // invocation ends in `error: cancelled`.
    let ev = loop {
        let ev = next_json(&mut events).await;
        if ev["type"] != "tool_result" {
            break ev;
        }
        assert_eq!(ev["errorCode"], "cancelled", "{ev}");
    };
    assert_eq!(ev["type"], "error", "{ev}");
    assert_eq!(ev["code"], "cancelled", "{ev}");

    // The tool was stopped and its job acked, long before its timeout.
    let deadline = tokio::time::Instant::now() + WAIT;
    while !stopped.load(std::sync::atomic::Ordering::SeqCst)
        || consumer.info().await.unwrap().num_ack_pending != 0
    {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the tool still runs, or its job is not acked"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    running.stop().await;
}

/// A chat stream and consumer left by an earlier release — the stream over
/// the untenanted `<p>.chat.submit`, the consumer filtered on it with a long
/// ack wait, a job still queued — are brought to the current layout when an
/// orchestrator starts: the stream moves to `<p>.chat.submit.*`, the shared
/// consumer is removed (fair dispatch has one per tenant), and the queued
/// job is moved to the submit subject of the tenant it names and runs as
/// that tenant, taken from its consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_chat_stream_and_consumer_are_upgraded() {
    use async_nats::jetstream::{consumer::pull, stream};
    let nats = toolfleet_local::servers::NatsServer::start().unwrap();
    let redis = toolfleet_local::servers::RedisServer::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let subjects = toolfleet_protocol::Subjects::new("toolfleet").unwrap();
    let stream = js
        .create_stream(stream::Config {
            name: subjects.chat_stream(),
            subjects: vec!["toolfleet.chat.submit".into()],
            retention: stream::RetentionPolicy::WorkQueue,
            storage: stream::StorageType::File,
            duplicate_window: Duration::from_secs(120),
            max_message_size: toolfleet_protocol::MAX_JOB_BYTES as i32 + 64 * 1024,
            max_age: Duration::from_secs(24 * 3600),
            ..Default::default()
        })
        .await
        .unwrap();
    stream
        .create_consumer(pull::Config {
            durable_name: Some(subjects.chat_consumer()),
            filter_subject: "toolfleet.chat.submit".into(),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            ack_wait: Duration::from_secs(60),
            max_deliver: 4,
            max_ack_pending: 10_000,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut queued = toolfleet_protocol::client::question("Which lighthouse is oldest?");
    queued.tenant = Some("acme".into());
    let mut events = client
        .subscribe(subjects.chat_events("acme", &queued.invocation_id))
        .await
        .unwrap();
    client.flush().await.unwrap();
    js.publish(
        "toolfleet.chat.submit",
        serde_json::to_vec(&queued).unwrap().into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();

    let model = toolfleet_scripted::ScriptedServer::start(
        "127.0.0.1:0".parse().unwrap(),
        toolfleet_scripted::Script::from_json(&lighthouse_script().to_string()).unwrap(),
    )
    .await
    .unwrap();
    let rt = support::start_orchestrator(
        nats.url(),
        redis.url(),
        toolfleet_orchestrator::OrchestratorConfig::new(
            subjects.clone(),
            toolfleet_config::FleetConfig::single(toolfleet_llm::deployments::Deployment::new(
                model.base_url(),
                "toolfleet-scripted",
            )),
        ),
    )
    .await;
    // The shared consumer is gone: fair dispatch has one per tenant.
    assert!(
        stream
            .get_consumer::<pull::Config>(&subjects.chat_consumer())
            .await
            .is_err()
    );
    let mut upgraded = js.get_stream(subjects.chat_stream()).await.unwrap();
    assert_eq!(
        upgraded.info().await.unwrap().config.subjects,
        vec![subjects.chat_submit_all(), subjects.chat_batch_all()]
    );
    // The job queued before the upgrade is answered as its own tenant's.
    let terminal = tokio::time::timeout(WAIT, async {
        loop {
            let msg = events.next().await.unwrap();
            let event: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap();
            if event["type"] == "completed" || event["type"] == "error" {
                return event;
            }
        }
    })
    .await
    .expect("the queued job was not answered");
    assert_eq!(terminal["type"], "completed", "{terminal}");
    // It was taken from its tenant's own consumer, with the short ack
    // wait (so the crash-recovery time holds on an upgraded server too).
    let mut consumer: async_nats::jetstream::consumer::PullConsumer = stream
        .get_consumer(&subjects.chat_tenant_consumer("acme"))
        .await
        .unwrap();
    let config = consumer.info().await.unwrap().config.clone();
    assert_eq!(config.ack_wait, Duration::from_secs(10));
    assert_eq!(config.filter_subject, subjects.chat_submit("acme"));
    assert!(rt.drain(Duration::from_secs(10)).await);
}

/// The Redis URL of the running test, for [`Usurped`].
static USURPED_REDIS: std::sync::OnceLock<String> = std::sync::OnceLock::new();
/// Whether [`Usurped`] has let its lease be taken once.
static USURPED_ONCE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The first time it runs, another run takes the invocation's lease over
/// just before this one ends (as a run that could not renew in time would
/// find it); then it answers at once.
struct Usurped;

impl Orchestrator for Usurped {
    fn run<'a>(
        &'a self,
        inv: &'a mut Invocation,
        _fleet: &'a Fleet,
        _events: &'a Events,
    ) -> BoxFuture<'a, Result<Ending, Failure>> {
        async move {
            if !USURPED_ONCE.swap(true, std::sync::atomic::Ordering::SeqCst) {
                let url = USURPED_REDIS.get().expect("the test's Redis");
                let mut redis = redis::Client::open(url.as_str())
                    .unwrap()
                    .get_multiplexed_async_connection()
                    .await
                    .unwrap();
                support::set_lease(&mut redis, &inv.job.invocation_id, "usurper", 3000).await;
            }
            Ok(Answer {
                text: "done".into(),
                rounds: 0,
            }
            .into())
        }
        .boxed()
    }
}

/// A run whose lease another run took over between two renewals, and that
/// then reaches its end, checks the lease before speaking: it publishes no
/// terminal event, marks nothing finished and does not ack. The job comes
/// back once the usurper's lease lapses and ends once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_lost_its_lease_before_its_end_does_not_speak() {
    let env = Env::start_with(
        lighthouse_script(),
        Options {
            profiles_toml: Some(format!(
                "{ORCHESTRATOR_PROFILES}\n[profiles.usurped]\ndeployment = \"scripted\"\norchestrator = \"usurped\"\n"
            )),
            tweak: |c| {
                c.register_orchestrator("usurped", Usurped);
            },
            ..Default::default()
        },
    )
    .await;
    USURPED_REDIS.set(env.redis.url()).unwrap();
    let mut job = toolfleet_protocol::client::question("anyone?");
    job.profile = Some("usurped".into());
    let mut events = env.follow_and_submit(&job).await;
    let all = tokio::time::timeout(WAIT * 2, support::events_until_terminal(&mut events))
        .await
        .expect("the job ended");
    assert_eq!(all.last().unwrap()["type"], "completed", "{all:#?}");
    assert_eq!(
        support::kinds(&all),
        ["started", "started", "completed"],
        "the superseded run spoke"
    );
    assert!(USURPED_ONCE.load(std::sync::atomic::Ordering::SeqCst));
    support::assert_silent(
        &mut events,
        Duration::from_millis(500),
        "a second terminal event",
    )
    .await;
}

/// The orchestrator's tool jobs are marked new calls (`Toolfleet-New-Call:
/// 1`): its call ids are its own, and its run has just read the
/// invocation's cancel tombstone — so a worker may skip the Redis read of
/// their first delivery.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orchestrators_tool_jobs_are_marked_new_calls() {
    let env = Env::start(lighthouse_script()).await;
    // A core subscription sees every job published to the tool stream.
    let mut jobs = env
        .subscribe(format!("{}.tool.>", env.subjects.prefix()))
        .await;
    let (job, outcome) = env.ask("how do lighthouses warn ships?").await;
    outcome.expect("completed");
    let published = tokio::time::timeout(WAIT, jobs.next())
        .await
        .expect("a tool job")
        .expect("the subscription is open");
    let headers = published.headers.expect("a tool job has headers");
    assert_eq!(
        headers
            .get(toolfleet_protocol::headers::INVOCATION_ID)
            .map(|v| v.as_str()),
        Some(job.invocation_id.as_str())
    );
    assert_eq!(
        headers
            .get(toolfleet_protocol::headers::NEW_CALL)
            .map(|v| v.as_str()),
        Some("1")
    );
}

/// A tool that calls a model of its own and says what it spent.
struct Spender;

impl Tool for Spender {
    type Args = Value;
    async fn call(&self, ctx: &ToolCtx, _args: Value) -> Result<ToolOutput, ToolError> {
        ctx.record_llm_call(toolfleet_protocol::LlmCall {
            model: "tiny-model".into(),
            // Whatever a tool says, its calls count as `tool`.
            purpose: "conversation".into(),
            usage: toolfleet_protocol::Usage {
                prompt_tokens: 10,
                completion_tokens: 5,
                total_tokens: 15,
                ..Default::default()
            },
            cost_usd: Some(0.25),
            attempts: 2,
        });
        Ok(ToolOutput::text("spent"))
    }
}

/// What a tool spends on models travels back with its result and is the
/// invocation's spend too: in `completed` (usage, cost, `llmCalls` with
/// purpose `tool`) and in the token and cost metrics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tools_model_spend_is_part_of_the_invocations_usage_and_cost() {
    let env = Env::start(json!({
        "rules": [{ "whenUserContains": ["spend"], "steps": [
            { "toolCalls": [ { "name": "slow_clock", "arguments": {} } ] },
            { "answer": "The tool said {{tool:slow_clock}}" }
        ] }]
    }))
    .await;
    let dir = tempfile::tempdir().unwrap();
    let worker = Worker::builder("testing")
        .definition_file(slow_clock_definition(dir.path()))
        .tool("testing.slow_clock", Spender)
        .build()
        .unwrap();
    let running = env.start_worker(worker).await;
    let (_, outcome) = env.ask("please spend something").await;
    let outcome = outcome.expect("completed");
    assert_eq!(outcome.text, "The tool said spent");
    let tool_calls: Vec<&toolfleet_protocol::LlmCall> = outcome
        .llm_calls
        .iter()
        .filter(|c| c.purpose == "tool")
        .collect();
    assert_eq!(tool_calls.len(), 1, "{:?}", outcome.llm_calls);
    assert_eq!(tool_calls[0].model, "tiny-model");
    assert_eq!(tool_calls[0].attempts, 2);
    assert_eq!(tool_calls[0].cost_usd, Some(0.25));
    let conversation: u64 = outcome
        .llm_calls
        .iter()
        .filter(|c| c.purpose == "conversation")
        .map(|c| c.usage.total_tokens)
        .sum();
    assert_eq!(outcome.usage.total_tokens, conversation + 15);
    assert!(
        outcome.cost_usd.is_some_and(|c| c >= 0.25),
        "{:?}",
        outcome.cost_usd
    );
    let metrics = env.metrics_text().await;
    assert!(
        metrics.contains(
            "toolfleet_llm_tokens_total{kind=\"prompt\",model=\"tiny-model\",purpose=\"tool\"} 10"
        ),
        "{metrics}"
    );
    assert!(
        metrics
            .contains("toolfleet_llm_cost_usd_total{model=\"tiny-model\",purpose=\"tool\"} 0.25"),
        "{metrics}"
    );
    running.stop().await;
}
