//! Delivery guarantees under faults and forgeries, on real servers: an
//! invocation runs once and ends in one terminal event; its citations are
//! its own calls' and never reuse an index, whatever Redis loses; results
//! go only to the fleet's reply subjects.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::Notify;
use toolfleet_protocol::{CallContext, DEFAULT_TENANT, InvocationContext};
use toolfleet_store::NewReference;
use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput, Worker};

use crate::support::{
    Env, WAIT, assert_silent, events_until_terminal, kinds, next_json, publish_raw, set_lease,
};

/// A tool that cites one document named after its `round` argument. The
/// call of round 2 stops before it cites until the test says go (once), so
/// the test can break something in between.
#[derive(Clone)]
struct CiteRound {
    reached: Arc<Notify>,
    go: Arc<Notify>,
    waited: Arc<AtomicBool>,
}

impl CiteRound {
    fn new() -> Self {
        Self {
            reached: Arc::new(Notify::new()),
            go: Arc::new(Notify::new()),
            waited: Arc::new(AtomicBool::new(false)),
        }
    }
}

impl Tool for CiteRound {
    type Args = Value;
    async fn call(&self, ctx: &ToolCtx, args: Value) -> Result<ToolOutput, ToolError> {
        let round = args["round"].as_u64().unwrap_or(0);
        if round == 2 && !self.waited.swap(true, Ordering::SeqCst) {
            self.reached.notify_one();
            self.go.notified().await;
        }
        let refs = ctx
            .cite(vec![NewReference {
                kind: "document".into(),
                title: format!("round {round}"),
                source: Some(format!("round-{round}.md")),
                url: None,
                snippet: None,
            }])
            .await?;
        Ok(ToolOutput::text(format!(
            "[doc:{}] says round {round}",
            refs[0].index
        )))
    }
}

const CITE_ROUND: &str = r#"{
  "schemaVersion": 1,
  "id": "testing:cite_round@1.0.0",
  "implementationKey": "testing.cite_round",
  "title": "Cite a round",
  "description": "Cites one document per round.",
  "category": "testing",
  "purpose": "general",
  "selectable": true,
  "tags": [],
  "function": {
    "name": "cite_round",
    "description": "Cites one document named after the round.",
    "parameters": {
      "type": "object",
      "properties": { "round": { "type": "integer" } },
      "required": ["round"],
      "additionalProperties": false
    }
  },
  "timeoutMs": 20000,
  "delivery": "jetstream",
  "parallelSafe": true
}"#;

fn cite_round_worker(tool: CiteRound) -> Worker {
    Worker::builder("testing")
        .definition_json(CITE_ROUND)
        .tool("testing.cite_round", tool)
        .build()
        .unwrap()
}

/// Two rounds, each citing once, then an answer.
fn two_rounds() -> Value {
    json!({
        "rules": [{ "whenUserContains": ["rounds"], "steps": [
            { "toolCalls": [ { "name": "cite_round", "arguments": { "round": 1 } } ] },
            { "toolCalls": [ { "name": "cite_round", "arguments": { "round": 2 } } ] },
            { "answer": "Both rounds: [doc:1] {{tool:cite_round}}" }
        ] }]
    })
}

/// Submits a two-round job and waits until its round-2 call is held by
/// `tool`; returns the job and its event subscription.
async fn submit_until_round_two(
    env: &Env,
    tool: &CiteRound,
) -> (toolfleet_protocol::ChatJob, async_nats::Subscriber) {
    let job = toolfleet_protocol::client::question("cite two rounds please");
    let events = env.follow_and_submit(&job).await;
    tokio::time::timeout(WAIT, tool.reached.notified())
        .await
        .expect("round 2 never started");
    (job, events)
}

/// Publishes a tool job of `invocation`'s call `call_id` to `tool` through
/// JetStream, replying to a fresh fleet inbox; returns the subscription to
/// that inbox.
async fn send_tool_job(
    env: &Env,
    invocation: &str,
    call_id: &str,
    tool: &str,
    body: Value,
) -> async_nats::Subscriber {
    let inbox = env.subjects.reply_inbox();
    let replies = env.subscribe(inbox.clone()).await;
    let call = CallContext {
        invocation: InvocationContext {
            data_source_id: Some("handbook".into()),
            ..InvocationContext::new(invocation)
        },
        call_id: call_id.into(),
        tool_id: tool.parse().unwrap(),
        attempt: 1,
        reply_to: inbox,
        citation_floor: 0,
        new_call: false,
    };
    async_nats::jetstream::new(env.client.clone())
        .publish_with_headers(
            env.subjects.tool(&call.tool_id),
            call.to_headers(),
            body.to_string().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    replies
}

/// Redis restarted without persistence between two rounds of one
/// invocation loses the citation counter; round 2 must still get a new
/// index (the orchestrator sends the highest it has announced as a floor),
/// and `completed` must agree with the `references` events.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_restart_between_rounds_never_reuses_a_citation_index() {
    let mut env = Env::start(two_rounds()).await;
    let tool = CiteRound::new();
    let worker = env.start_worker(cite_round_worker(tool.clone())).await;

    let (_, mut events) = submit_until_round_two(&env, &tool).await;
    // Round 1 cited [doc:1]; Redis forgets it.
    env.redis.stop();
    env.redis.start_again().unwrap();
    tool.go.notify_one();

    let all = events_until_terminal(&mut events).await;
    let last = all.last().unwrap();
    assert_eq!(last["type"], "completed", "{all:#?}");
    let completed: Vec<(u64, String)> = last["references"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["index"].as_u64().unwrap(),
                r["title"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(
        completed,
        vec![(1, "round 1".to_string()), (2, "round 2".to_string())],
        "{all:#?}"
    );
    let announced: Vec<(u64, String)> = all
        .iter()
        .filter(|e| e["type"] == "references")
        .flat_map(|e| e["references"].as_array().unwrap().clone())
        .map(|r| {
            (
                r["index"].as_u64().unwrap(),
                r["title"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    assert_eq!(announced, completed, "events and completed agree");
    worker.stop().await;
}

/// A tool job forged with another invocation's id (anyone who can publish
/// to a tool subject can do it) writes its reference under that
/// invocation's keys, but it never reaches that invocation's `completed`:
/// an invocation's references are its own calls'.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_tool_job_cannot_add_references_to_another_invocation() {
    let env = Env::start(two_rounds()).await;
    let tool = CiteRound::new();
    let worker = env.start_worker(cite_round_worker(tool.clone())).await;

    let (job, mut events) = submit_until_round_two(&env, &tool).await;

    // The forgery: a search under the victim's invocation id.
    let mut replies = send_tool_job(
        &env,
        &job.invocation_id,
        "call_forged",
        "retrieval:search_data_sources@1.0.0",
        json!({ "arguments": { "query": "lighthouse" } }),
    )
    .await;
    let reply = next_json(&mut replies).await;
    assert_eq!(reply["status"], "ok", "{reply}");
    assert!(
        !reply["references"].as_array().unwrap().is_empty(),
        "the forged call cited something: {reply}"
    );
    tool.go.notify_one();

    let all = events_until_terminal(&mut events).await;
    let last = all.last().unwrap();
    assert_eq!(last["type"], "completed", "{all:#?}");
    let text = serde_json::to_string(&all).unwrap();
    assert!(
        !text.contains("call_forged") && !text.contains("lighthouse"),
        "a forged reference reached the invocation's events: {all:#?}"
    );
    let refs = last["references"].as_array().unwrap();
    assert_eq!(refs.len(), 2, "{refs:#?}");
    worker.stop().await;
}

/// A tool job whose reply subject is outside the fleet's reply prefix (a
/// result aimed at `chat.submit`, say) is dead-lettered without running
/// and nothing is published there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_job_replying_outside_the_fleet_is_refused() {
    let env = Env::start(json!({ "rules": [] })).await;
    let mut dead = env.subscribe("toolfleet.deadletter.tool".into()).await;
    let mut submits = env.subscribe(env.subjects.chat_submit_all()).await;
    for target in [
        env.subjects.chat_submit(DEFAULT_TENANT),
        "toolfleet.chat.events.default.someone-else".to_string(),
        "_INBOX.abc".to_string(),
        "toolfleet.reply.>".to_string(),
    ] {
        let call = CallContext {
            invocation: InvocationContext::new("aimed-1"),
            call_id: "call_1".into(),
            tool_id: "system:current_datetime@1.0.0".parse().unwrap(),
            attempt: 1,
            reply_to: target.clone(),
            citation_floor: 0,
            new_call: false,
        };
        let mut h = call.to_headers();
        h.insert("Nats-Msg-Id", target.as_str());
        async_nats::jetstream::new(env.client.clone())
            .publish_with_headers(
                env.subjects.tool(&call.tool_id),
                h,
                r#"{"arguments":{}}"#.into(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        let d = next_json(&mut dead).await;
        assert_eq!(d["code"], "bad_reply_subject", "{target}: {d}");
        assert_eq!(d["attempts"], 1);
    }
    assert_silent(
        &mut submits,
        Duration::from_millis(300),
        "something was published to chat.submit",
    )
    .await;
}

/// One invocation id runs once: the same job resubmitted under a new
/// `Nats-Msg-Id` (JetStream's de-duplication does not catch it) is
/// dead-lettered as a duplicate, and the invocation's subject carries one
/// run and one terminal event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invocation_id_is_run_once() {
    let env = Env::start(json!({
        "rules": [{ "whenUserContains": ["hello"], "steps": [ { "answer": "Hi." } ] }]
    }))
    .await;
    let job = toolfleet_protocol::client::question("hello there");
    let mut events = env
        .subscribe(env.subjects.chat_events(job.tenant(), &job.invocation_id))
        .await;
    let mut dead = env.subscribe("toolfleet.deadletter.chat".into()).await;
    let js = async_nats::jetstream::new(env.client.clone());
    for copy in 0..2 {
        let mut h = async_nats::HeaderMap::new();
        h.insert("Nats-Msg-Id", format!("copy-{copy}").as_str());
        js.publish_with_headers(
            env.subjects.chat_submit(job.tenant()),
            h,
            serde_json::to_vec(&job).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    let d = next_json(&mut dead).await;
    assert_eq!(d["code"], "duplicate_invocation", "{d}");
    assert_eq!(d["invocationId"], job.invocation_id.as_str());
    let mut terminal = 0;
    let mut started = 0;
    while let Ok(Some(msg)) = tokio::time::timeout(
        Duration::from_millis(1500),
        futures::StreamExt::next(&mut events),
    )
    .await
    {
        let ev: Value = serde_json::from_slice(&msg.payload).unwrap();
        started += usize::from(ev["type"] == "started");
        terminal += usize::from(ev["type"] == "completed" || ev["type"] == "error");
    }
    assert_eq!((started, terminal), (1, 1));
}

/// A malformed chat job that carries the id of an invocation another job
/// holds is dead-lettered without an event on that invocation's subject
/// (which would be its second terminal event).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_job_cannot_end_another_jobs_invocation() {
    let env = Env::start(json!({
        "rules": [{ "whenUserContains": ["hello"], "steps": [ { "answer": "Hi." } ] }]
    }))
    .await;
    let (job, outcome) = env.ask("hello there").await;
    outcome.expect("completed");
    let mut events = env
        .subscribe(env.subjects.chat_events(job.tenant(), &job.invocation_id))
        .await;
    let mut dead = env.subscribe("toolfleet.deadletter.chat".into()).await;
    let js = async_nats::jetstream::new(env.client.clone());
    js.publish(
        env.subjects.chat_submit(job.tenant()),
        json!({ "invocationId": job.invocation_id, "messages": "not a list" })
            .to_string()
            .into(),
    )
    .await
    .unwrap()
    .await
    .unwrap();
    let d = next_json(&mut dead).await;
    assert_eq!(d["invocationId"], job.invocation_id.as_str(), "{d}");
    assert_silent(
        &mut events,
        Duration::from_millis(500),
        "the malformed job published on the other invocation's subject",
    )
    .await;
}

/// The system worker, as its binary builds it.
async fn system_worker() -> Worker {
    toolfleet::families::some(
        &["system"],
        &toolfleet::families::Inputs {
            definitions: &crate::support::root().join("tool_definitions"),
            index: &toolfleet::families::IndexArgs::tantivy(
                std::env::temp_dir().join("unused-index"),
                crate::support::root().join("examples/corpus"),
            ),
            models: None,
        },
    )
    .await
    .unwrap()
    .remove(0)
}

/// A worker that froze (or died) holding a tool job does not cost the call:
/// the tool consumer's ack wait is a fraction of the tool's timeout, so a
/// live worker of the pool gets the job again and answers while the
/// caller still waits (the tool's timeout plus the orchestrator's slack).
/// Here the test itself is the frozen worker: it pulls the job and never
/// acks it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_workers_call_is_finished_by_another_inside_the_callers_wait() {
    let env = Env::start_with(
        json!({ "rules": [] }),
        crate::support::Options {
            workers: vec![],
            ..Default::default()
        },
    )
    .await;
    let id: toolfleet_protocol::tools::ToolId = "system:current_datetime@1.0.0".parse().unwrap();
    // A first copy makes the consumer, as a worker of the pool would.
    env.start_worker(system_worker().await).await.stop().await;
    let js = async_nats::jetstream::new(env.client.clone());
    let consumer: async_nats::jetstream::consumer::PullConsumer = js
        .get_stream(env.subjects.tools_stream())
        .await
        .unwrap()
        .get_consumer(&env.subjects.tool_consumer(&id))
        .await
        .unwrap();
    let mut frozen = consumer
        .batch()
        .max_messages(1)
        .expires(Duration::from_secs(20))
        .messages()
        .await
        .unwrap();

    let mut replies = send_tool_job(
        &env,
        "frozen-1",
        "call_1",
        &id.to_string(),
        json!({ "arguments": {} }),
    )
    .await;
    let published = tokio::time::Instant::now();
    let held = tokio::time::timeout(WAIT, futures::StreamExt::next(&mut frozen))
        .await
        .expect("the frozen worker got the job")
        .unwrap()
        .unwrap();

    // The live copy of the pool.
    let live = env.start_worker(system_worker().await).await;
    // The caller's wait for this tool: its timeout (5 s) plus the
    // orchestrator's default slack (2 s).
    let callers_wait = Duration::from_secs(7);
    let reply = tokio::time::timeout_at(
        published + callers_wait,
        futures::StreamExt::next(&mut replies),
    )
    .await
    .expect("the call was not finished inside the caller's wait")
    .unwrap();
    let reply: Value = serde_json::from_slice(&reply.payload).unwrap();
    assert_eq!(reply["status"], "ok", "{reply}");
    assert_eq!(reply["attempt"], 2, "{reply}");
    drop(held);
    live.stop().await;
}

/// A short NATS restart does not stall the fleet until its pulls expire:
/// every pull loop asks again as soon as its connection is back, so the
/// first job after the restart is answered well inside a 4 s timeout (the
/// lost pulls would hold it for up to their expiry plus slack, ~10 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_job_after_a_nats_restart_is_not_held_by_lost_pulls() {
    let mut env = Env::start(crate::support::lighthouse_script()).await;
    let (_, outcome) = env
        .ask("how do lighthouses warn ships? what time is it")
        .await;
    outcome.expect("before the restart");
    // Let every pull loop settle into a fresh pull request.
    tokio::time::sleep(Duration::from_millis(500)).await;
    env.nats.stop();
    env.nats.start_again().expect("nats-server restarts");
    let deadline = tokio::time::Instant::now() + WAIT;
    while env.client.connection_state() != async_nats::connection::State::Connected {
        assert!(tokio::time::Instant::now() < deadline, "never reconnected");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let mut job =
        toolfleet_protocol::client::question("how do lighthouses warn ships? what time is it");
    job.timeout_ms = Some(4_000);
    let outcome = env.submit(&job).await.expect("answered inside its timeout");
    assert!(!outcome.references.is_empty());
}

/// A chat job whose header value is not UTF-8 (which the released NATS
/// client took for a broken connection; the patched one delivers it
/// marked) is terminated and dead-lettered with its headers as received;
/// its sender gets an `error` event, and the jobs behind it are answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_job_with_unreadable_headers_is_dead_lettered_and_the_rest_answered() {
    let env = Env::start(json!({
        "rules": [{ "whenUserContains": ["hello"], "steps": [ { "answer": "Hi." } ] }]
    }))
    .await;
    let mut dead = env.subscribe("toolfleet.deadletter.chat".into()).await;
    let mut poison = toolfleet_protocol::client::question("hello poison");
    poison.invocation_id = "poison-chat-1".into();
    let mut poison_events = env
        .subscribe(
            env.subjects
                .chat_events(poison.tenant(), &poison.invocation_id),
        )
        .await;
    publish_raw(
        &env.nats.url(),
        None,
        &env.subjects.chat_submit(poison.tenant()),
        b"NATS/1.0\r\nToolfleet-Tenant: \xff\xfe\r\n\r\n",
        &serde_json::to_vec(&poison).unwrap(),
    )
    .await;
    // Jobs right behind it are all answered.
    let jobs: Vec<_> = (0..6)
        .map(|_| toolfleet_protocol::client::question("hello there"))
        .collect();
    let outcomes = futures::future::join_all(jobs.iter().map(|j| env.submit(j))).await;
    for o in outcomes {
        o.expect("a job behind the poison completes");
    }
    let d = next_json(&mut dead).await;
    assert_eq!(d["code"], "unreadable_headers", "{d}");
    assert_eq!(d["invocationId"], "poison-chat-1", "{d}");
    use base64::Engine as _;
    let raw = base64::engine::general_purpose::STANDARD
        .decode(d["rawHeaders"].as_str().unwrap())
        .unwrap();
    assert!(raw.windows(2).any(|w| w == [0xff, 0xfe]), "{raw:?}");
    let ev = next_json(&mut poison_events).await;
    assert_eq!(ev["type"], "error", "{ev}");
    assert_eq!(ev["code"], "unreadable_headers", "{ev}");
    // Nothing of it is left in the queue.
    crate::support::chat_queue_drained(&env).await;
}

/// The same for a tool job: the caller gets an error result on its reply
/// subject at once (not a timeout), and the tool's next job is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_job_with_unreadable_headers_gets_an_error_result_and_a_dead_letter() {
    let env = Env::start(json!({ "rules": [] })).await;
    let mut dead = env.subscribe("toolfleet.deadletter.tool".into()).await;
    let id: toolfleet_protocol::tools::ToolId = "system:current_datetime@1.0.0".parse().unwrap();
    let poisoned_inbox = env.subjects.reply_inbox();
    let mut poisoned_replies = env.subscribe(poisoned_inbox.clone()).await;
    let block = format!(
        "NATS/1.0\r\nToolfleet-Invocation-Id: poison-tool-1\r\nToolfleet-Call-Id: call_1\r\nToolfleet-Tool-Id: {id}\r\nToolfleet-Reply-To: {poisoned_inbox}\r\nToolfleet-Tenant: "
    );
    let mut block = block.into_bytes();
    block.extend_from_slice(b"\xff\xfe\r\n\r\n");
    publish_raw(
        &env.nats.url(),
        None,
        &env.subjects.tool(&id),
        &block,
        br#"{"arguments":{}}"#,
    )
    .await;
    // A good job right behind it.
    let mut replies = send_tool_job(
        &env,
        "good-1",
        "call_2",
        &id.to_string(),
        json!({ "arguments": {} }),
    )
    .await;
    let good = next_json(&mut replies).await;
    assert_eq!(good["status"], "ok", "{good}");
    let bad = next_json(&mut poisoned_replies).await;
    assert_eq!(bad["status"], "error", "{bad}");
    assert_eq!(bad["error"]["code"], "unreadable_headers", "{bad}");
    assert_eq!(bad["callId"], "call_1", "{bad}");
    let d = next_json(&mut dead).await;
    assert_eq!(d["code"], "unreadable_headers", "{d}");
    assert_eq!(d["invocationId"], "poison-tool-1", "{d}");
    assert!(d["rawHeaders"].is_string(), "{d}");
}

/// A tool job of an invocation cancelled while it was queued — even before
/// the worker that takes it started, so it never heard the cancel — is
/// answered `cancelled` without running. (A tool job comes from a running
/// invocation, so the store knows it: its claim is taken first, as the
/// orchestrator running it would have.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_job_of_a_cancelled_invocation_never_runs() {
    let env = Env::start_with(
        json!({ "rules": [] }),
        crate::support::Options {
            workers: vec![],
            ..Default::default()
        },
    )
    .await;
    let inv = toolfleet_store::InvocationKey::new(DEFAULT_TENANT, "queued-tool-1");
    env.store().await.claim(inv, "1").await.unwrap();
    env.client
        .publish(
            env.subjects.chat_cancel(DEFAULT_TENANT, "queued-tool-1"),
            "".into(),
        )
        .await
        .unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while !env
        .keys("queued-tool-1")
        .await
        .iter()
        .any(|k| k.ends_with(":cancelled"))
    {
        assert!(tokio::time::Instant::now() < deadline, "no tombstone");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let worker = env.start_worker(system_worker().await).await;
    let mut replies = send_tool_job(
        &env,
        "queued-tool-1",
        "call_1",
        "system:current_datetime@1.0.0",
        json!({ "arguments": {} }),
    )
    .await;
    let reply = next_json(&mut replies).await;
    assert_eq!(reply["status"], "error", "{reply}");
    assert_eq!(reply["error"]["code"], "cancelled", "{reply}");
    worker.stop().await;
}

/// A client that missed an invocation's terminal event — it subscribed
/// after the end, its connection broke, it restarted — reads it from the
/// events stream, and `client::chat` for an invocation that already ended
/// answers with it (the resubmission is a duplicate, nothing runs again).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_missed_terminal_event_is_read_from_the_events_stream() {
    let env = Env::start(crate::support::lighthouse_script()).await;
    let (job, outcome) = env.ask("how do lighthouses warn ships?").await;
    let outcome = outcome.expect("completed");
    let last_live = outcome.events.last().unwrap().clone();

    let stored = toolfleet_protocol::client::last_event(
        &env.client,
        &env.subjects,
        job.tenant(),
        &job.invocation_id,
    )
    .await
    .unwrap()
    .expect("the terminal event is stored");
    assert_eq!(stored, last_live);
    // The stream keeps one event per invocation: the latest.
    let js = async_nats::jetstream::new(env.client.clone());
    let mut stream = js.get_stream(env.subjects.events_stream()).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 1);
    // The history keeps every event but the deltas, each once.
    let mut history = js.get_stream(env.subjects.history_stream()).await.unwrap();
    let deltas = outcome
        .events
        .iter()
        .filter(|e| matches!(e.body, toolfleet_protocol::ChatEventBody::Delta { .. }))
        .count();
    assert!(deltas > 0);
    assert_eq!(
        history.info().await.unwrap().state.messages,
        (outcome.events.len() - deltas) as u64
    );
    // Nothing stored for an invocation that never ran, or under another
    // tenant.
    for (tenant, id) in [(job.tenant(), "never-ran"), ("globex", &job.invocation_id)] {
        let none = toolfleet_protocol::client::last_event(&env.client, &env.subjects, tenant, id)
            .await
            .unwrap();
        assert_eq!(none, None);
    }

    // Asking again for the same invocation: no event comes live (the
    // submit is a duplicate), and the stored answer is returned.
    let again = env.submit(&job).await.expect("the stored answer");
    assert_eq!(again.text, outcome.text);
    assert_eq!(again.references, outcome.references);
    assert_eq!(again.events, vec![last_live]);
    assert_eq!(env.model.stream_stats().started, 2, "the model ran again");
}

/// A delivery whose invocation still has a live run elsewhere — its lease
/// renewed, its acks cut off from NATS — does not run it a second time: it
/// waits, and runs once that lease lapses. A run whose lease was taken
/// over stops without an event, and the invocation still ends once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_run_elsewhere_is_not_run_twice_and_a_superseded_run_stops_silently() {
    let script = json!({
        "rules": [
            { "whenUserContains": ["slower"], "steps": [ { "fault": { "kind": "slowFirstToken", "delayMs": 6000 }, "answer": "on time" } ] },
            { "whenUserContains": ["slow"], "steps": [ { "fault": { "kind": "slowFirstToken", "delayMs": 2000 }, "answer": "on time" } ] }
        ]
    });
    let env = Env::start(script).await;
    let mut redis = env.redis_conn.clone();

    // Another run holds the lease when the job arrives: nothing runs
    // until it lapses, then the job runs once.
    let job = toolfleet_protocol::client::question("a slow question");
    set_lease(&mut redis, &job.invocation_id, "elsewhere", 3000).await;
    let mut events = env.follow_and_submit(&job).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(env.model.stream_stats().started, 0, "ran beside a live run");
    assert!(futures::FutureExt::now_or_never(futures::StreamExt::next(&mut events)).is_none());
    let all = events_until_terminal(&mut events).await;
    assert_eq!(all.last().unwrap()["type"], "completed", "{all:#?}");
    assert_eq!(kinds(&all).iter().filter(|k| **k == "started").count(), 1);

    // A running job's lease taken over (as a run that could not renew in
    // time would find it): it stops without a word; once the usurper's
    // lease lapses the redelivered job runs and ends, once.
    let job = toolfleet_protocol::client::question("a slower question");
    let mut events = env.follow_and_submit(&job).await;
    tokio::time::timeout(WAIT, env.model.wait_for_streams(|s| s.started >= 2))
        .await
        .expect("the second job reached the model");
    set_lease(&mut redis, &job.invocation_id, "usurper", 4000).await;
    tokio::time::timeout(WAIT, env.model.wait_for_streams(|s| s.dropped >= 1))
        .await
        .expect("the superseded run stopped its model call");
    let all = tokio::time::timeout(WAIT * 2, events_until_terminal(&mut events))
        .await
        .expect("the job ended");
    let seen = kinds(&all);
    assert_eq!(all.last().unwrap()["type"], "completed", "{seen:?}");
    assert_eq!(
        seen.iter().filter(|k| **k == "started").count(),
        2,
        "{seen:?}"
    );
    assert_silent(
        &mut events,
        Duration::from_millis(500),
        "a second terminal event",
    )
    .await;
}

/// Redis away when a chat job arrives: the job is neither run unclaimed
/// nor lost — it waits for the claim (in-progress acks) and runs once, when
/// Redis is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_job_waits_for_redis_to_claim_it() {
    let mut env = Env::start(crate::support::lighthouse_script()).await;
    env.redis.stop();
    let job = toolfleet_protocol::client::question("how do lighthouses warn ships?");
    let mut events = env.follow_and_submit(&job).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(env.model.stream_stats().started, 0, "ran unclaimed");
    env.redis.start_again().unwrap();
    let all = tokio::time::timeout(WAIT * 2, events_until_terminal(&mut events))
        .await
        .expect("the job ran once Redis was back");
    let seen = kinds(&all);
    assert_eq!(all.last().unwrap()["type"], "completed", "{seen:?}");
    assert_eq!(seen.iter().filter(|k| **k == "started").count(), 1);
}

/// An orchestrator told to stop lets the invocations in flight finish —
/// including one waiting on a tool call, whose result still reaches it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_draining_orchestrator_still_hears_the_tools_of_its_invocations() {
    let env = Env::start(two_rounds()).await;
    let tool = CiteRound::new();
    let worker = env.start_worker(cite_round_worker(tool.clone())).await;
    let (_, mut events) = submit_until_round_two(&env, &tool).await;
    // Drain: the orchestrator takes no new job, and finishes this one.
    env.shutdown.cancel();
    tool.go.notify_one();
    let all = events_until_terminal(&mut events).await;
    let last = all.last().unwrap();
    assert_eq!(last["type"], "completed", "{all:#?}");
    let titles: Vec<&str> = last["references"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["title"].as_str().unwrap())
        .collect();
    assert_eq!(titles, ["round 1", "round 2"], "{all:#?}");
    worker.stop().await;
}

/// Ids are per tenant: the same invocation id under two tenants is two
/// invocations. Each runs (the second is not refused as a duplicate), each
/// answer cites its own call's reference as `[doc:1]`, and Redis keeps
/// two reference sets, one under each tenant's hash tag.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_invocation_id_under_two_tenants_is_two_invocations() {
    let env = Env::start(json!({
        "rules": [
            { "whenUserContains": ["acme cites"], "steps": [
                { "toolCalls": [ { "name": "cite_round", "arguments": { "round": 1 } } ] },
                { "answer": "Acme: {{tool:cite_round}}" } ] },
            { "whenUserContains": ["globex cites"], "steps": [
                { "toolCalls": [ { "name": "cite_round", "arguments": { "round": 7 } } ] },
                { "answer": "Globex: {{tool:cite_round}}" } ] }
        ]
    }))
    .await;
    let worker = env.start_worker(cite_round_worker(CiteRound::new())).await;
    let id = toolfleet_protocol::client::new_invocation_id();
    let mut answers = Vec::new();
    for (tenant, question) in [("acme", "acme cites"), ("globex", "globex cites")] {
        let mut job = toolfleet_protocol::client::question(question);
        job.invocation_id = id.clone();
        job.tenant = Some(tenant.into());
        let outcome = env
            .submit(&job)
            .await
            .unwrap_or_else(|e| panic!("{tenant}'s job under the shared id: {e}"));
        answers.push(outcome);
    }
    let titles = |o: &toolfleet_protocol::client::ChatOutcome| -> Vec<String> {
        o.references.iter().map(|r| r.title.clone()).collect()
    };
    assert_eq!(titles(&answers[0]), ["round 1"], "{}", answers[0].text);
    assert_eq!(titles(&answers[1]), ["round 7"], "{}", answers[1].text);
    assert!(
        answers[1].text.contains("says round 7"),
        "{}",
        answers[1].text
    );

    let mut redis = env.redis_conn.clone();
    for (tenant, title) in [("acme", "round 1"), ("globex", "round 7")] {
        let refs: std::collections::HashMap<String, String> = redis::cmd("HGETALL")
            .arg(format!("toolfleet:{{{tenant}/{id}}}:refs"))
            .query_async(&mut redis)
            .await
            .unwrap();
        assert_eq!(refs.len(), 1, "{tenant}: {refs:?}");
        let stored: Value = serde_json::from_str(&refs["[doc:1]"]).unwrap();
        assert_eq!(stored["title"], title, "{tenant}: {refs:?}");
    }
    worker.stop().await;
}

/// The attack of issue 28, item 8, on a real `nats-server` with the shipped
/// `ops/nats/auth.conf`, each tenant under its own client identity: acme
/// submits globex's invocation id first, with the `Nats-Msg-Id` a globex
/// client of an earlier release sent (the id itself). Globex's job still
/// runs and globex gets its own answer; acme's job runs as acme's own, and
/// acme sees nothing of globex's. An id globex used first does not make
/// acme's job vanish either (which would tell acme the id exists).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_tenant_using_an_invocation_id_first_neither_blocks_nor_reaches_it() {
    use crate::security::{Secure, spawn};
    use toolfleet_protocol::client::{self, ChatOutcome};

    let secure = Secure::start();
    let redis = toolfleet_local::servers::RedisServer::start().unwrap();
    let script = toolfleet_scripted::Script::from_json(
        &json!({
            "rules": [
                { "whenUserContains": ["globex"], "steps": [
                    { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
                    { "answer": "globex-canary-4b1 at {{tool:current_datetime}}" } ] },
                { "whenUserContains": ["time"], "steps": [
                    { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
                    { "answer": "It is {{tool:current_datetime}}." } ] }
            ],
            "default": { "steps": [ { "answer": "no script" } ] }
        })
        .to_string(),
    )
    .unwrap();
    let model = toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
        .await
        .unwrap();
    let logs = tempfile::tempdir().unwrap();
    let config = logs.path().join("toolfleet.toml");
    std::fs::write(
        &config,
        format!(
            "[deployments.scripted]\nbase_url = \"{}\"\nmodel = \"toolfleet-scripted\"\n\
             api_key_env = \"TOOLFLEET_IDS_TEST_KEY\"\n[profiles.default]\ndeployment = \"scripted\"\n",
            model.base_url()
        ),
    )
    .unwrap();
    let with = |user: &str, extra| secure.process_env(user, &redis.url(), extra);
    let orchestrator = spawn(
        "toolfleet-orchestrator",
        &with(
            "orchestrator",
            vec![
                ("TOOLFLEET_CONFIG", config.display().to_string()),
                ("TOOLFLEET_IDS_TEST_KEY", "sk-ids-test".into()),
            ],
        ),
        logs.path().join("orchestrator.log"),
    );
    let _worker = spawn(
        "toolfleet-worker-system",
        &with("worker-system", vec![]),
        logs.path().join("worker-system.log"),
    );
    let subjects = toolfleet_protocol::Subjects::new("toolfleet").unwrap();
    let acme = secure.connect("client-acme").await;
    let globex = secure.connect("client-globex").await;
    let ask = |client: async_nats::Client, tenant: &'static str, id: String, text: &'static str| {
        let subjects = subjects.clone();
        async move {
            let mut job = client::question(text);
            job.invocation_id = id;
            job.tenant = Some(tenant.into());
            client::chat(&client, &subjects, &job, WAIT, |_| {}).await
        }
    };
    // The fleet is up once acme's question is answered with the time (the
    // chat stream exists once the orchestrator started; the catalog offers
    // the clock once the worker advertised it).
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let id = client::new_invocation_id();
        match ask(acme.clone(), "acme", id, "what time is it").await {
            Ok(o)
                if o.events.iter().any(|e| {
                    matches!(
                        &e.body,
                        toolfleet_protocol::ChatEventBody::ToolResult {
                            status: toolfleet_protocol::ToolStatus::Ok,
                            ..
                        }
                    )
                }) =>
            {
                break;
            }
            other => assert!(
                tokio::time::Instant::now() < deadline,
                "the fleet never answered: {other:?}\n{}",
                std::fs::read_to_string(&orchestrator.log).unwrap_or_default()
            ),
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // acme first, under globex's id, with the message id a globex client
    // sent until now.
    let id = client::new_invocation_id();
    let mut acme_events = acme
        .subscribe(subjects.chat_events("acme", &id))
        .await
        .unwrap();
    acme.flush().await.unwrap();
    let mut forged = client::question("what time is it");
    forged.invocation_id = id.clone();
    forged.tenant = Some("acme".into());
    let mut h = async_nats::HeaderMap::new();
    h.insert("Nats-Msg-Id", id.as_str());
    h.insert("Toolfleet-Invocation-Id", id.as_str());
    async_nats::jetstream::new(acme.clone())
        .publish_with_headers(
            subjects.chat_submit("acme"),
            h,
            serde_json::to_vec(&forged).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    let acme_saw = events_until_terminal(&mut acme_events).await;
    let last = acme_saw.last().unwrap();
    assert_eq!(
        last["type"], "completed",
        "acme's own job runs: {acme_saw:#?}"
    );
    assert!(
        last["text"].as_str().unwrap().starts_with("It is "),
        "{last}"
    );

    // Then globex, through the client library: its job runs, its answer is
    // its own.
    let answered: ChatOutcome = ask(globex.clone(), "globex", id.clone(), "globex: the time?")
        .await
        .unwrap_or_else(|e| {
            panic!(
                "globex's job under an id acme used first: {e}\n{}",
                std::fs::read_to_string(&orchestrator.log).unwrap_or_default()
            )
        });
    assert!(
        answered.text.starts_with("globex-canary-4b1 at "),
        "{}",
        answered.text
    );
    // acme heard nothing of it.
    assert_silent(
        &mut acme_events,
        Duration::from_millis(500),
        "an event of globex's run reached acme's subject",
    )
    .await;
    assert!(
        !serde_json::to_string(&acme_saw)
            .unwrap()
            .contains("globex-canary")
    );

    // The other way round: an id globex used first is not refused to acme
    // (a refusal would tell acme that the id exists).
    let taken = client::new_invocation_id();
    let first = ask(globex.clone(), "globex", taken.clone(), "globex: the time?")
        .await
        .expect("globex's job");
    assert!(
        first.text.starts_with("globex-canary-4b1"),
        "{}",
        first.text
    );
    let second = ask(acme.clone(), "acme", taken.clone(), "what time is it")
        .await
        .expect("acme's job under an id globex used first runs as acme's own");
    assert!(second.text.starts_with("It is "), "{}", second.text);
    assert!(
        !format!("{second:?}").contains("globex-canary"),
        "{second:?}"
    );

    // Each claim and stored answer is its tenant's own.
    let mut conn = redis::Client::open(redis.url())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    for inv in [&id, &taken] {
        for tenant in ["acme", "globex"] {
            let owner: Option<String> = redis::cmd("GET")
                .arg(format!("toolfleet:{{{tenant}/{inv}}}:owner"))
                .query_async(&mut conn)
                .await
                .unwrap();
            assert!(
                owner.is_some_and(|o| o.ends_with(":finished")),
                "{tenant}/{inv}"
            );
            let terminal: String = redis::cmd("GET")
                .arg(format!("toolfleet:{{{tenant}/{inv}}}:terminal"))
                .query_async(&mut conn)
                .await
                .unwrap();
            assert_eq!(
                terminal.contains("globex-canary"),
                tenant == "globex",
                "{terminal}"
            );
        }
    }
}
