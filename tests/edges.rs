//! Delivery at the edges, on real servers with TCP proxies in between: a
//! tool result sent while the orchestrator's connection is away still
//! answers its call; a run cut off from NATS and Redis longer than its
//! lease stops before a redelivery takes the invocation over, and the
//! takeover adopts the calls already made, so every tool call runs once.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::sync::Notify;
use toolfleet_testkit::proxy::Proxy;
use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput, Worker};

use crate::support::{Env, Options, WAIT, events_until_terminal, kinds, next_json};

/// A tool that takes `millis` and answers `"slow result <round>"`; it
/// notes every run (call id and round) and tells the test when one starts.
#[derive(Clone)]
struct Slow {
    millis: u64,
    runs: Arc<Mutex<Vec<(String, u64)>>>,
    started: Arc<Notify>,
}

impl Slow {
    fn new(millis: u64) -> Self {
        Self {
            millis,
            runs: Arc::default(),
            started: Arc::new(Notify::new()),
        }
    }

    fn runs(&self) -> Vec<(String, u64)> {
        self.runs.lock().unwrap().clone()
    }

    /// Waits until `n` runs have started.
    async fn started(&self, n: usize) {
        tokio::time::timeout(WAIT, async {
            while self.runs.lock().unwrap().len() < n {
                self.started.notified().await;
            }
        })
        .await
        .expect("the tool calls never started");
    }
}

impl Tool for Slow {
    type Args = Value;
    async fn call(&self, ctx: &ToolCtx, args: Value) -> Result<ToolOutput, ToolError> {
        let round = args["round"].as_u64().unwrap_or(0);
        self.runs
            .lock()
            .unwrap()
            .push((ctx.call().call_id.clone(), round));
        self.started.notify_waiters();
        tokio::time::sleep(Duration::from_millis(self.millis)).await;
        Ok(ToolOutput::text(format!("slow result {round}")))
    }
}

/// `testing:slow@1.0.0`, idempotent or not (a tool that is not keeps its
/// results in the ledger).
fn slow_worker(tool: Slow, idempotent: bool) -> Worker {
    let definition = json!({
      "schemaVersion": 1,
      "id": "testing:slow@1.0.0",
      "implementationKey": "testing.slow",
      "title": "Slow",
      "description": "Takes a while, then answers.",
      "category": "testing",
      "purpose": "general",
      "selectable": true,
      "tags": [],
      "function": {
        "name": "slow",
        "description": "Takes a while, then answers with its round.",
        "parameters": {
          "type": "object",
          "properties": { "round": { "type": "integer" } },
          "required": ["round"],
          "additionalProperties": false
        }
      },
      "timeoutMs": 20000,
      "idempotent": idempotent,
      "delivery": "jetstream",
      "parallelSafe": true
    });
    Worker::builder("testing")
        .definition_json(&definition.to_string())
        .tool("testing.slow", tool)
        .build()
        .unwrap()
}

/// One round of `slow`, or two, then an answer quoting the last result.
fn slow_script() -> Value {
    json!({
        "rules": [
            { "whenUserContains": ["two rounds"], "steps": [
                { "toolCalls": [ { "name": "slow", "arguments": { "round": 1 } } ] },
                { "toolCalls": [ { "name": "slow", "arguments": { "round": 2 } } ] },
                { "answer": "Done: {{tool:slow}}" }
            ] },
            { "whenUserContains": ["slow"], "steps": [
                { "toolCalls": [ { "name": "slow", "arguments": { "round": 1 } } ] },
                { "answer": "Done: {{tool:slow}}" }
            ] }
        ]
    })
}

/// A fleet with no orchestrator of its own (the test starts them, behind
/// proxies or not).
async fn bare_fleet() -> Env {
    Env::start_with(
        slow_script(),
        Options {
            workers: vec![],
            no_orchestrator: true,
            ..Default::default()
        },
    )
    .await
}

/// An orchestrator on `env`'s model, reaching NATS and Redis at these
/// URLs (a proxy's, or the servers' own).
async fn orchestrator(
    env: &Env,
    nats_url: String,
    redis_url: String,
) -> toolfleet_service::Runtime {
    let profiles = toolfleet_config::FleetConfig::single(
        toolfleet_llm::deployments::Deployment::new(env.model.base_url(), "toolfleet-scripted"),
    );
    let config = toolfleet_orchestrator::OrchestratorConfig::new(env.subjects.clone(), profiles);
    crate::support::start_orchestrator(nats_url, redis_url, config).await
}

/// Submits `n` jobs asking `question`; their event subscriptions.
async fn submit(env: &Env, question: &str, n: usize) -> Vec<async_nats::Subscriber> {
    let mut subs = Vec::new();
    for _ in 0..n {
        let job = toolfleet_protocol::client::question(question);
        subs.push(env.follow_and_submit(&job).await);
    }
    subs
}

/// The orchestrator's connection to NATS is cut 2.5 s into 3 s tool calls
/// and refused for 2 s: the workers answer while it is away. Every call
/// is still answered with its result (read back from the ledger, or, for
/// an idempotent tool, asked again), and a tool that keeps a ledger ran
/// once per call.
async fn results_survive_a_reconnect(idempotent: bool) {
    let env = bare_fleet().await;
    let tool = Slow::new(3_000);
    let _worker = env
        .start_worker(slow_worker(tool.clone(), idempotent))
        .await;
    let proxy = Proxy::start(&format!("127.0.0.1:{}", env.nats.port()))
        .await
        .unwrap();
    let rt = orchestrator(&env, proxy.url("nats"), env.redis.url()).await;
    let mut subs = submit(&env, "something slow please", 4).await;
    tool.started(4).await;
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    proxy.partition();
    tokio::time::sleep(Duration::from_secs(2)).await;
    proxy.admit();
    for sub in &mut subs {
        let events = events_until_terminal(sub).await;
        let terminal = events.last().unwrap();
        assert_eq!(terminal["type"], "completed", "{:?}", kinds(&events));
        let answer = terminal["text"].as_str().unwrap_or_default();
        assert!(answer.contains("slow result 1"), "{terminal}");
    }
    let runs = tool.runs();
    if idempotent {
        assert!(runs.len() >= 4, "{runs:?}");
    } else {
        assert_eq!(runs.len(), 4, "a call ran twice: {runs:?}");
    }
    rt.drain(Duration::from_secs(5)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ledger_tools_result_sent_during_a_reconnect_answers_its_call() {
    results_survive_a_reconnect(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_tools_call_is_asked_again_after_a_reconnect() {
    results_survive_a_reconnect(true).await;
}

/// An orchestrator cut off from both NATS and Redis in the middle of a
/// tool call, for longer than its run lease, stops before the lease can
/// lapse; the redelivery to another orchestrator replays the run, adopts
/// the call already made (same call id: its result comes from the
/// ledger), runs the second round, and completes. Every tool call ran
/// once, and the job completed once — also after the first orchestrator
/// is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_that_cannot_renew_its_lease_stops_and_its_calls_run_once() {
    let env = bare_fleet().await;
    let tool = Slow::new(4_000);
    let _worker = env.start_worker(slow_worker(tool.clone(), false)).await;
    let to_nats = Proxy::start(&format!("127.0.0.1:{}", env.nats.port()))
        .await
        .unwrap();
    let to_redis = Proxy::start(&format!("127.0.0.1:{}", env.redis.port()))
        .await
        .unwrap();
    let first = orchestrator(&env, to_nats.url("nats"), to_redis.url("redis")).await;
    let mut subs = submit(&env, "two rounds of slow", 1).await;
    let mut events = subs.remove(0);
    tool.started(1).await;
    to_nats.partition();
    to_redis.partition();
    // The second orchestrator, reaching both servers.
    let second = orchestrator(&env, env.nats.url(), env.redis.url()).await;
    let terminal = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let event = next_json(&mut events).await;
            if event["type"] == "completed" || event["type"] == "error" {
                return event;
            }
        }
    })
    .await
    .expect("the job never ended");
    assert_eq!(terminal["type"], "completed", "{terminal}");
    assert!(
        terminal["text"]
            .as_str()
            .unwrap_or_default()
            .contains("slow result 2"),
        "{terminal}"
    );
    // The first orchestrator stopped its run (it did not wait on).
    let superseded = first
        .metrics
        .gather()
        .iter()
        .filter(|f| f.name() == "toolfleet_chat_jobs_total")
        .flat_map(|f| f.get_metric().iter())
        .filter(|m| {
            m.get_label()
                .iter()
                .any(|l| l.name() == "outcome" && l.value() == "superseded")
        })
        .map(|m| m.get_counter().get_value())
        .sum::<f64>();
    assert_eq!(superseded, 1.0, "the cut-off run stopped");
    // The first orchestrator comes back: it says nothing more.
    to_nats.admit();
    to_redis.admit();
    let quiet = tokio::time::timeout(Duration::from_secs(8), async {
        loop {
            let event = next_json(&mut events).await;
            if event["type"] == "completed" || event["type"] == "error" {
                return event;
            }
        }
    })
    .await;
    assert!(quiet.is_err(), "a second terminal event: {quiet:?}");
    let runs = tool.runs();
    let rounds: Vec<u64> = runs.iter().map(|(_, round)| *round).collect();
    assert_eq!(rounds, vec![1, 2], "every call runs once: {runs:?}");
    first.drain(Duration::from_secs(5)).await;
    second.drain(Duration::from_secs(5)).await;
}

/// With one slot (`--max-in-flight 1`), the idle pull for approval
/// decisions holds no permit: chat jobs in a row each get the slot at
/// once — each must finish inside its own 3 s timeout, which a slot held
/// by the decisions pull's 5 s wait would overrun.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_slot_is_never_held_by_the_idle_decisions_pull() {
    let env = Env::start_with(
        json!({ "rules": [{ "whenUserContains": ["hello"], "steps": [ { "answer": "Hi." } ] }] }),
        Options {
            workers: vec![],
            data_source: None,
            tweak: |c| c.max_in_flight = 1,
            ..Default::default()
        },
    )
    .await;
    for _ in 0..4 {
        let mut job = toolfleet_protocol::client::question("hello there");
        job.timeout_ms = Some(3_000);
        let outcome = env.submit(&job).await.expect("answered inside its timeout");
        assert_eq!(outcome.text, "Hi.");
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
}
