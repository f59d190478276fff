//! A tenant's work in flight, capped fleet-wide (issue 29):
//! `max_jobs_in_flight` across every orchestrator, and
//! `max_tool_calls_in_flight` per tool pool. Real NATS and Redis, the
//! scripted model, a tool of the test's that counts its calls at once.
//! Counts are asserted, never times.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde_json::{Value, json};
use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput, Worker};

use crate::fair::Bench;
use crate::support::{self, Env, Options};

/// Two orchestrators with 8 slots each; acme may have 2 jobs in flight:
/// its 8 jobs all complete, never more than 2 at the model at once, and
/// globex's job, queued behind them, is not held by acme's cap. Without
/// the cap all 8 of acme's ran together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_jobs_in_flight_are_capped_across_orchestrators() {
    let mut bench = Bench::start(300).await;
    let config = "[tenants.acme]\nmax_jobs_in_flight = 2\n";
    let mut endings = bench.endings().await;
    bench.queue("acme", 8).await;
    bench.queue("globex", 1).await;
    bench.orchestrator(8, config).await;
    bench.orchestrator(8, config).await;
    let order = endings.next(9).await;
    let globex_at = order.iter().position(|t| t == "globex").unwrap();
    assert!(globex_at <= 2, "globex waited behind acme's cap: {order:?}");
    let arrivals: Vec<_> = bench.model.received().iter().map(|r| r.at).collect();
    let window = Duration::from_millis(250);
    // At most acme's 2 and globex's 1 at once.
    let most = arrivals
        .iter()
        .map(|s| {
            arrivals
                .iter()
                .filter(|a| **a >= *s && **a < *s + window)
                .count()
        })
        .max()
        .unwrap();
    assert!(most <= 3, "{most} calls at once: {arrivals:?}");
    let acme_only: Vec<_> = bench
        .model
        .received()
        .iter()
        .filter(|r| r.body.to_string().contains("acme interactive question"))
        .map(|r| r.at)
        .collect();
    let most_acme = acme_only
        .iter()
        .map(|s| {
            acme_only
                .iter()
                .filter(|a| **a >= *s && **a < *s + window)
                .count()
        })
        .max()
        .unwrap();
    assert!(most_acme <= 2, "{most_acme} of acme's jobs at once");
    bench.stop().await;
}

/// A tool that takes 300 ms and remembers the most calls it ran at once.
#[derive(Clone, Default)]
struct Counting {
    now: Arc<AtomicUsize>,
    most: Arc<AtomicUsize>,
}

impl Tool for Counting {
    type Args = Value;
    async fn call(&self, _ctx: &ToolCtx, _args: Value) -> Result<ToolOutput, ToolError> {
        let now = self.now.fetch_add(1, Ordering::SeqCst) + 1;
        self.most.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(300)).await;
        self.now.fetch_sub(1, Ordering::SeqCst);
        Ok(ToolOutput::text("counted"))
    }
}

/// The default tenant may have 2 tool calls in flight per pool: six chat
/// jobs at once, each calling the counting tool, all complete, and the
/// tool never runs more than 2 at once although its worker could run 16.
/// Without the cap it ran all six together.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_tool_calls_in_flight_are_capped_per_pool() {
    let env = Env::start_with(
        json!({
            "rules": [{ "whenUserContains": ["count"], "steps": [
                { "toolCalls": [ { "name": "counting", "arguments": {} } ] },
                { "answer": "{{tool:counting}}" }
            ] }]
        }),
        Options {
            workers: Vec::new(),
            profiles_toml: Some(
                "[deployments.main]\nbase_url = \"{base_url}\"\nmodel = \"toolfleet-scripted\"\n\
                 [profiles.default]\ndeployment = \"main\"\n\
                 [tenants.default]\nmax_tool_calls_in_flight = 2\n"
                    .to_owned(),
            ),
            ..Default::default()
        },
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let tool = Counting::default();
    let worker = Worker::builder("testing")
        .definition_file(support::renamed_definition(
            dir.path(),
            "testing",
            "counting",
        ))
        .tool("testing.counting", tool.clone())
        .build()
        .unwrap();
    let _running = env.start_worker(worker).await;
    // Once the orchestrator's catalog has the tool (it reads it every 2 s).
    tokio::time::timeout(support::WAIT, async {
        loop {
            let (_, outcome) = env.ask("count once").await;
            if outcome.expect("completed").text == "counted" {
                break;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    })
    .await
    .expect("the tool was never offered");
    let questions: Vec<String> = (0..6).map(|i| format!("count {i}")).collect();
    let asks = questions.iter().map(|q| env.ask(q));
    for (_, outcome) in futures::future::join_all(asks).await {
        assert_eq!(outcome.expect("completed").text, "counted");
    }
    let most = tool.most.load(Ordering::SeqCst);
    assert!(
        most <= 2,
        "{most} calls of the tenant's at once in the pool"
    );
    assert!(most >= 1);
}
