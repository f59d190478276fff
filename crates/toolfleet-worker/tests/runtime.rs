//! The worker runtime with tools of our own, against real nats-server and
//! redis-server and no orchestrator (the tests publish the calls): lifecycle
//! hooks, per-tool timeouts and handler failures, the result ledger and its
//! reads, cancels heard or missed, and calls longer than their ack wait.

// Tests are exempt from the 100-line limit: a scenario reads top to bottom.
#![allow(clippy::too_many_lines)]

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::{CallContext, Envelope, InvocationContext, Subjects, ToolResult};
use toolfleet_testkit::servers::{NatsServer, RedisServer};
use toolfleet_testkit::wait::{WAIT, next_json};
use toolfleet_worker::{
    CallInfo, Hooks, Refusal, Tool, ToolCtx, ToolError, ToolOutput, Worker, WorkerConfig,
};

/// The workspace root, where the shipped definitions live.
fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Records every hook call.
#[derive(Default)]
struct Recorder(Mutex<Vec<String>>);

impl Recorder {
    fn push(&self, s: String) {
        self.0.lock().unwrap().push(s);
    }
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.0.lock().unwrap())
    }
}

impl Hooks for Recorder {
    fn on_start(&self, call: &CallContext) {
        self.push(format!("start {}", call.call_id));
    }
    fn on_complete(&self, call: &CallContext, result: &ToolResult) {
        self.push(format!(
            "complete {} {}",
            call.call_id,
            result.status.as_str()
        ));
    }
    fn on_error(&self, call: &CallContext, error: &ToolError) {
        self.push(format!("error {} {}", call.call_id, error.code()));
    }
}

/// A policy: refuses calls at +05:00 before anything runs.
struct NoFive;

impl Hooks for NoFive {
    fn before_call(&self, info: &CallInfo<'_>) -> Result<(), Refusal> {
        if info.arguments["utcOffset"] == "+05:00" {
            return Err(Refusal::new(
                "no_five",
                "calls at +05:00 are not allowed here",
            ));
        }
        Ok(())
    }
}

/// Behaves by its `utcOffset` argument: fail, hang, panic, cite twice, or
/// succeed.
struct Moody;

fn reference(title: &str) -> toolfleet_store::NewReference {
    toolfleet_store::NewReference {
        kind: "document".into(),
        title: title.into(),
        source: None,
        url: None,
        snippet: None,
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct MoodyArgs {
    utc_offset: Option<String>,
}

impl Tool for Moody {
    type Args = MoodyArgs;

    async fn call(&self, ctx: &ToolCtx, args: MoodyArgs) -> Result<ToolOutput, ToolError> {
        match args.utc_offset.as_deref() {
            Some("+01:00") => Err(ToolError::failed("the backend said no")),
            Some("+02:00") => {
                tokio::time::sleep(Duration::from_secs(60)).await;
                Ok(ToolOutput::default())
            }
            Some("+03:00") => {
                let empty: Vec<u8> = Vec::new();
                let i = args.utc_offset.as_deref().map_or(0, str::len);
                Ok(ToolOutput::text(empty[i].to_string()))
            }
            Some("+04:00") => {
                let a = ctx.cite(vec![reference("a1"), reference("a2")]).await?;
                let b = ctx.cite(vec![reference("b1"), reference("b2")]).await?;
                let markers: Vec<String> = a.iter().chain(&b).map(|r| r.marker()).collect();
                Ok(ToolOutput::text(markers.join(" ")))
            }
            _ => Ok(ToolOutput::text("fine")),
        }
    }
}

/// A definitions directory with the shipped current_datetime definition,
/// its timeout set to `timeout_ms`.
fn datetime_definition(timeout_ms: u64) -> tempfile::TempDir {
    datetime_definition_with(timeout_ms, false)
}

/// The shipped current_datetime definition with `timeout_ms`, declared
/// `idempotent` or not (not: a tool with effects, whose results are kept
/// in the ledger).
fn datetime_definition_with(timeout_ms: u64, idempotent: bool) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let mut def: Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tool_definitions/system.current_datetime.json"))
            .unwrap(),
    )
    .unwrap();
    def["timeoutMs"] = json!(timeout_ms);
    def["idempotent"] = json!(idempotent);
    std::fs::write(dir.path().join("t.json"), def.to_string()).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hooks_timeouts_and_failures_in_the_worker_runtime() {
    let nats = NatsServer::start().unwrap();
    let redis = RedisServer::start().unwrap();
    let client = async_nats::connect(nats.url()).await.unwrap();
    let store =
        toolfleet_store::CitationStore::connect(&redis.url(), "toolfleet", Duration::from_secs(60))
            .await
            .unwrap();
    let subjects = Subjects::new("toolfleet").unwrap();

    // The shipped current_datetime definition, with a short timeout, served
    // by our handler.
    let dir = datetime_definition(300);
    let id: toolfleet_protocol::tools::ToolId = "system:current_datetime@1.0.0".parse().unwrap();
    let hooks = Arc::new(Recorder::default());
    let worker = Worker::builder("test")
        .definitions_dir(dir.path())
        .tool("system.current_datetime", Moody)
        .hooks(NoFive)
        .hooks(hooks.clone())
        .build()
        .unwrap();

    let shutdown = CancellationToken::new();
    let worker = tokio::time::timeout(
        WAIT,
        worker.start(
            client.clone(),
            store,
            WorkerConfig::new(subjects.clone()),
            toolfleet_worker::metrics::WorkerMetrics::register_all(&prometheus::Registry::new())
                .unwrap(),
            shutdown.clone(),
        ),
    )
    .await
    .expect("the worker starts in time")
    .expect("the worker starts");

    let js = async_nats::jetstream::new(client.clone());
    let inbox = subjects.reply_inbox();
    let mut replies = client.subscribe(inbox.clone()).await.unwrap();
    client.flush().await.unwrap();
    let mut ask = async |call: &str, args: Value| -> Value {
        let ctx = CallContext {
            invocation: InvocationContext::new("hooks-1"),
            call_id: call.into(),
            tool_id: id.clone(),
            attempt: 1,
            reply_to: inbox.clone(),
            citation_floor: 0,
            new_call: false,
        };
        js.publish_with_headers(
            subjects.tool(&id),
            ctx.to_headers(),
            json!({ "arguments": args }).to_string().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
        // This call's reply: delivery is at least once, so a reply of an
        // earlier call may come again (replayed from its ledger).
        loop {
            let reply = next_json(&mut replies).await;
            Envelope::ToolReply
                .validator()
                .validate(&reply)
                .expect("replies follow the schema");
            if reply["callId"] == call {
                return reply;
            }
        }
    };

    let ok = ask("c_ok", json!({})).await;
    assert_eq!(ok["status"], "ok");
    assert_eq!(hooks.take(), vec!["start c_ok", "complete c_ok ok"]);

    let failed = ask("c_fail", json!({ "utcOffset": "+01:00" })).await;
    assert_eq!(failed["status"], "error");
    assert_eq!(failed["error"]["code"], "tool_failed");
    assert_eq!(failed["content"], "the backend said no");
    assert_eq!(
        hooks.take(),
        vec!["start c_fail", "error c_fail tool_failed"]
    );

    let slow = ask("c_slow", json!({ "utcOffset": "+02:00" })).await;
    assert_eq!(slow["status"], "timeout");
    assert!(
        slow["content"].as_str().unwrap().contains("300 ms"),
        "{slow}"
    );
    assert_eq!(hooks.take(), vec!["start c_slow", "error c_slow timeout"]);

    // A panicking handler is an error result, not a stuck job.
    let panicked = ask("c_panic", json!({ "utcOffset": "+03:00" })).await;
    assert_eq!(panicked["status"], "error");
    assert!(
        panicked["content"].as_str().unwrap().contains("panicked"),
        "{panicked}"
    );
    assert_eq!(
        hooks.take(),
        vec!["start c_panic", "error c_panic tool_failed"]
    );

    // Two cites in one job get distinct indices; the job's references are
    // all four.
    let cited = ask("c_cite", json!({ "utcOffset": "+04:00" })).await;
    assert_eq!(cited["content"], "[doc:1] [doc:2] [doc:3] [doc:4]");
    let titles: Vec<&str> = cited["references"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["title"].as_str().unwrap())
        .collect();
    assert_eq!(titles, vec!["a1", "a2", "b1", "b2"]);
    hooks.take();

    // A policy refuses before anything runs: blocked, with its reason, and
    // no start hook.
    let refused = ask("c_five", json!({ "utcOffset": "+05:00" })).await;
    assert_eq!(refused["status"], "blocked");
    assert_eq!(refused["error"]["code"], "no_five");
    assert!(hooks.take().is_empty());

    // Invalid arguments never reach the hooks or the handler.
    let invalid = ask("c_bad", json!({ "utcOffset": "soon" })).await;
    assert_eq!(invalid["error"]["code"], "invalid_arguments");
    assert_eq!(invalid["error"]["violations"][0]["path"], "/utcOffset");
    assert!(hooks.take().is_empty());

    shutdown.cancel();
    tokio::time::timeout(WAIT, worker)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
}

/// Counts its runs; sleeps the seconds in `utcOffset`'s hours (`"+05:00"`:
/// 5 s), so that one call can outlast its ack wait.
struct Counted(Arc<std::sync::atomic::AtomicUsize>);

impl Tool for Counted {
    type Args = MoodyArgs;

    async fn call(&self, _ctx: &ToolCtx, args: MoodyArgs) -> Result<ToolOutput, ToolError> {
        self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let secs: u64 = args
            .utc_offset
            .as_deref()
            .and_then(|o| o.get(1..3)?.parse().ok())
            .unwrap_or(0);
        tokio::time::sleep(Duration::from_secs(secs)).await;
        Ok(ToolOutput::text("counted"))
    }
}

/// The servers a worker needs, a client of each, and the fleet's
/// subjects: what the runtime talks to, without a fleet around it.
struct Servers {
    nats: NatsServer,
    redis: RedisServer,
    client: async_nats::Client,
    redis_conn: redis::aio::MultiplexedConnection,
    subjects: Subjects,
}

impl Servers {
    async fn start() -> Self {
        let nats = NatsServer::start().expect("nats-server");
        let redis = RedisServer::start().expect("redis-server");
        let client = async_nats::connect(nats.url()).await.unwrap();
        let redis_conn = redis::Client::open(redis.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        Self {
            nats,
            redis,
            client,
            redis_conn,
            subjects: Subjects::new("toolfleet").unwrap(),
        }
    }

    /// Every Redis key of an invocation id, under any tenant.
    async fn keys(&self, invocation_id: &str) -> Vec<String> {
        let mut keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("toolfleet:{{*/{invocation_id}}}:*"))
            .query_async(&mut self.redis_conn.clone())
            .await
            .unwrap();
        keys.sort();
        keys
    }

    /// Subscribes (and flushes, so the subscription is live).
    async fn subscribe(&self, subject: String) -> async_nats::Subscriber {
        let s = self.client.subscribe(subject).await.unwrap();
        self.client.flush().await.unwrap();
        s
    }

    /// Starts `worker` on these servers (its own NATS connection and
    /// metrics); returns once it takes jobs.
    async fn start_worker_with(&self, worker: Worker, config: WorkerConfig) -> TestWorker {
        let store = toolfleet_store::CitationStore::connect(
            &self.redis.url(),
            self.subjects.prefix(),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
        let metrics =
            toolfleet_worker::metrics::WorkerMetrics::register_all(&prometheus::Registry::new())
                .unwrap();
        let shutdown = CancellationToken::new();
        let client = async_nats::connect(self.nats.url()).await.unwrap();
        let task = tokio::time::timeout(
            WAIT,
            worker.start(client, store, config, metrics, shutdown.clone()),
        )
        .await
        .expect("the worker starts in time")
        .expect("the worker starts");
        TestWorker { task, shutdown }
    }
}

/// A worker of a test's own, serving on [`Servers`].
struct TestWorker {
    task: tokio::task::JoinHandle<Result<(), toolfleet_worker::WorkerError>>,
    shutdown: CancellationToken,
}

impl TestWorker {
    /// Stops the worker and waits for it to finish cleanly.
    async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("the worker stops in time")
            .expect("no panic")
            .expect("the worker stops cleanly");
    }
}

/// [`Counted`] serving `system:current_datetime@1.0.0` with `timeout_ms`
/// on servers of its own; its run counter, and the reply inbox.
struct CountedWorker {
    env: Servers,
    worker: TestWorker,
    id: toolfleet_protocol::tools::ToolId,
    runs: Arc<std::sync::atomic::AtomicUsize>,
    inbox: String,
    replies: async_nats::Subscriber,
    _dir: tempfile::TempDir,
}

impl CountedWorker {
    async fn start(timeout_ms: u64) -> Self {
        Self::start_with(timeout_ms, |_| {}).await
    }

    /// [`CountedWorker::start`], the worker's configuration changed by
    /// `configure`.
    async fn start_with(timeout_ms: u64, configure: impl FnOnce(&mut WorkerConfig)) -> Self {
        Self::start_from(datetime_definition(timeout_ms), configure).await
    }

    /// [`Counted`] serving the definition in `dir`.
    async fn start_from(dir: tempfile::TempDir, configure: impl FnOnce(&mut WorkerConfig)) -> Self {
        let env = Servers::start().await;
        let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let worker = Worker::builder("test")
            .definitions_dir(dir.path())
            .tool("system.current_datetime", Counted(runs.clone()))
            .build()
            .unwrap();
        let mut config = WorkerConfig::new(env.subjects.clone());
        configure(&mut config);
        let worker = env.start_worker_with(worker, config).await;
        let inbox = env.subjects.reply_inbox();
        let replies = env.subscribe(inbox.clone()).await;
        Self {
            env,
            worker,
            id: "system:current_datetime@1.0.0".parse().unwrap(),
            runs,
            inbox,
            replies,
            _dir: dir,
        }
    }

    /// Publishes call `call_id` of invocation `inv` as message `msg_id`
    /// (a new id is a re-publish JetStream does not de-duplicate), as a
    /// client that may repeat a call does.
    async fn publish(&self, inv: &str, call_id: &str, msg_id: &str, args: Value) {
        self.publish_call(inv, call_id, msg_id, args, false).await;
    }

    /// Publishes a call its publisher minted (`Toolfleet-New-Call`), as the
    /// orchestrator does.
    async fn publish_new(&self, inv: &str, call_id: &str) {
        self.publish_call(inv, call_id, &format!("{inv}.{call_id}"), json!({}), true)
            .await;
    }

    async fn publish_call(&self, inv: &str, call_id: &str, msg_id: &str, args: Value, new: bool) {
        let ctx = CallContext {
            invocation: InvocationContext::new(inv),
            call_id: call_id.into(),
            tool_id: self.id.clone(),
            attempt: 1,
            reply_to: self.inbox.clone(),
            citation_floor: 0,
            new_call: new,
        };
        let mut headers = ctx.to_headers();
        headers.insert("Nats-Msg-Id", msg_id);
        async_nats::jetstream::new(self.env.client.clone())
            .publish_with_headers(
                self.env.subjects.tool(&self.id),
                headers,
                json!({ "arguments": args }).to_string().into(),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    fn runs(&self) -> usize {
        self.runs.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// How many `MGET`s — the worker's one read of result ledger and
    /// cancel tombstone — Redis has served.
    async fn ledger_reads(&self) -> u64 {
        let info: String = redis::cmd("INFO")
            .arg("commandstats")
            .query_async(&mut self.env.redis_conn.clone())
            .await
            .unwrap();
        info.lines()
            .find_map(|l| l.strip_prefix("cmdstat_mget:calls="))
            .and_then(|rest| rest.split(',').next()?.parse().ok())
            .unwrap_or(0)
    }

    /// Waits until the tool's consumer holds no job: every delivery so far
    /// was acked.
    async fn until_all_acked(&self) {
        let js = async_nats::jetstream::new(self.env.client.clone());
        let mut consumer: async_nats::jetstream::consumer::PullConsumer = js
            .get_stream(self.env.subjects.tools_stream())
            .await
            .unwrap()
            .get_consumer(&self.env.subjects.tool_consumer(&self.id))
            .await
            .unwrap();
        tokio::time::timeout(WAIT, async {
            loop {
                let info = consumer.info().await.unwrap();
                if info.num_ack_pending == 0 && info.num_pending == 0 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the worker acks its jobs");
    }
}

/// The worker answers its caller before it writes the result ledger, and
/// acks the job only after the write: a repeat of the call sent the moment
/// the answer arrives is answered from what the first run stored (never
/// run again), and once the job is acked the result is in Redis, where a
/// later repeat finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_is_answered_before_its_ledger_write_and_acked_after_it() {
    let mut w = CountedWorker::start(5_000).await;
    w.publish("ledger-order", "call_1", "m1", json!({})).await;
    let first = next_json(&mut w.replies).await;
    assert_eq!(first["status"], "ok", "{first}");
    assert_eq!(first.get("replayed"), None, "{first}");

    // At once: the ledger write may still be on its way.
    w.publish("ledger-order", "call_1", "m2", json!({})).await;
    let again = next_json(&mut w.replies).await;
    assert_eq!(again["status"], "ok", "{again}");
    assert_eq!(again["replayed"], true, "{again}");
    assert_eq!(again["attempt"], 1, "{again}");

    // Acked means written.
    w.until_all_acked().await;
    let stored: Option<String> = redis::cmd("GET")
        .arg("toolfleet:{default/ledger-order}:result:call_1")
        .query_async(&mut w.env.redis_conn.clone())
        .await
        .unwrap();
    let stored: ToolResult = serde_json::from_str(&stored.expect("the ledger holds the result"))
        .expect("the ledger holds a tool result");
    assert_eq!(stored.status, toolfleet_protocol::ToolStatus::Ok);
    assert!(!stored.replayed);
    assert_eq!(stored.content, "counted");

    // A repeat long after: from the ledger.
    w.publish("ledger-order", "call_1", "m3", json!({})).await;
    let later = next_json(&mut w.replies).await;
    assert_eq!(later["replayed"], true, "{later}");
    assert_eq!(later["content"], "counted", "{later}");
    assert_eq!(w.runs(), 1, "the tool ran once for three deliveries");
    w.worker.stop().await;
}

/// The first delivery of a call its publisher minted (as the
/// orchestrator's are) reads nothing from Redis once the worker has heard
/// every cancel since before it was published: no result can be stored
/// yet, and a cancel would be in the worker's memory. A client's repeat of
/// the call (not marked new) still reads the ledger and is answered from
/// it, without running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_calls_first_delivery_reads_nothing_from_redis() {
    let mut w =
        CountedWorker::start_with(5_000, |c| c.cancel_hearing_margin = Duration::ZERO).await;
    let reads = w.ledger_reads().await;
    w.publish_new("fresh-1", "call_1").await;
    let first = next_json(&mut w.replies).await;
    assert_eq!(first["status"], "ok", "{first}");
    w.until_all_acked().await;
    assert_eq!(
        w.ledger_reads().await,
        reads,
        "no ledger read for a new call"
    );

    // Acked: the result is in the ledger, and a client's repeat finds it.
    w.publish("fresh-1", "call_1", "client-retry", json!({}))
        .await;
    let again = next_json(&mut w.replies).await;
    assert_eq!(again["replayed"], true, "{again}");
    assert_eq!(w.ledger_reads().await, reads + 1);
    assert_eq!(w.runs(), 1);

    // A cancel the worker heard answers a new call of its invocation
    // from memory: `cancelled`, not run, nothing read.
    w.env
        .client
        .publish(w.env.subjects.chat_cancel("default", "heard-1"), "".into())
        .await
        .unwrap();
    w.env.client.flush().await.unwrap();
    tokio::time::sleep(Duration::from_secs(1)).await;
    w.publish_new("heard-1", "call_1").await;
    let cancelled = next_json(&mut w.replies).await;
    assert_eq!(cancelled["error"]["code"], "cancelled", "{cancelled}");
    assert_eq!(w.ledger_reads().await, reads + 1);
    assert_eq!(w.runs(), 1);
    w.worker.stop().await;
}

/// A tool declared `idempotent` keeps no result ledger: its result is not
/// written to Redis, and a repeat of the call runs it again instead of
/// being answered from the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotent_tools_results_are_not_kept() {
    let mut w = CountedWorker::start_from(datetime_definition_with(5_000, true), |c| {
        c.cancel_hearing_margin = Duration::ZERO;
    })
    .await;
    w.publish_new("idem-1", "call_1").await;
    assert_eq!(next_json(&mut w.replies).await["status"], "ok");
    w.until_all_acked().await;
    assert!(
        w.env.keys("idem-1").await.is_empty(),
        "nothing of the call in Redis"
    );
    w.publish("idem-1", "call_1", "client-retry", json!({}))
        .await;
    let again = next_json(&mut w.replies).await;
    assert_eq!(again["status"], "ok", "{again}");
    assert_eq!(again.get("replayed"), None, "{again}");
    assert_eq!(w.runs(), 2, "the repeat ran again");
    w.worker.stop().await;
}

/// A worker answers for cancels from memory only once it has listened
/// long enough: a new call published within its margin of the worker's
/// start — or of a reconnect, which loses the cancels published while the
/// connection was down — reads the tombstone, here one left by a cancel
/// the worker never heard.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_the_worker_may_have_missed_is_read_from_the_store() {
    let margin = Duration::from_secs(4);
    let mut w = CountedWorker::start_with(5_000, |c| c.cancel_hearing_margin = margin).await;
    let store = toolfleet_store::CitationStore::connect(
        &w.env.redis.url(),
        w.env.subjects.prefix(),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    // Cancelled before this worker listened: only the store knows.
    store
        .mark_cancelled(toolfleet_store::InvocationKey::new("default", "missed-1"))
        .await
        .unwrap();
    let reads = w.ledger_reads().await;
    w.publish_new("missed-1", "call_1").await;
    let reply = next_json(&mut w.replies).await;
    assert_eq!(reply["error"]["code"], "cancelled", "{reply}");
    assert_eq!(w.ledger_reads().await, reads + 1);

    // Past the margin, a new call is answered without a read.
    tokio::time::sleep(margin + Duration::from_millis(200)).await;
    w.publish_new("fresh-2", "call_1").await;
    assert_eq!(next_json(&mut w.replies).await["status"], "ok");
    assert_eq!(w.ledger_reads().await, reads + 1);

    // NATS restarts: a cancel published meanwhile was lost to the worker,
    // so the store is read again for jobs published in the next margin.
    // (Killed only once the server has written the last ack's consumer
    // state: a restart that lost it, seen on a loaded machine, can leave
    // the next job's sequence counted as delivered, which is not what this
    // test is about.)
    w.until_all_acked().await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    w.env.nats.stop();
    store
        .mark_cancelled(toolfleet_store::InvocationKey::new("default", "missed-2"))
        .await
        .unwrap();
    w.env.nats.start_again().unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while w.env.client.connection_state() != async_nats::connection::State::Connected {
        assert!(tokio::time::Instant::now() < deadline, "no reconnect");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The reply subscription is on the new server once a round trip is.
    w.env.client.flush().await.unwrap();
    w.publish_new("missed-2", "call_1").await;
    let reply = next_json(&mut w.replies).await;
    assert_eq!(reply["error"]["code"], "cancelled", "{reply}");
    assert_eq!(w.ledger_reads().await, reads + 2);
    assert_eq!(w.runs(), 1, "only fresh-2 ran");
    w.worker.stop().await;
}

/// A call that runs longer than its consumer's ack wait is kept alive by
/// the worker's in-progress acks (one ticker for every job it holds): no
/// other delivery of it starts while it runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_longer_than_its_ack_wait_is_not_delivered_again() {
    // Timeout 8 s: ack wait 2 s (the minimum), in-progress acks every
    // 667 ms. The call sleeps 5 s, past two ack waits.
    let mut w = CountedWorker::start(8_000).await;
    w.publish(
        "long-1",
        "call_1",
        "long-1.call_1",
        json!({ "utcOffset": "+05:00" }),
    )
    .await;
    let reply = next_json(&mut w.replies).await;
    assert_eq!(reply["status"], "ok", "{reply}");
    assert_eq!(reply["attempt"], 1, "{reply}");
    w.until_all_acked().await;
    assert_eq!(w.runs(), 1, "the call was delivered again while it ran");
    w.worker.stop().await;
}
