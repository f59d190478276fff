//! The load generator behind `toolfleet bench`: operations at a fixed
//! concurrency for a count or a duration, timed one by one, summarised as
//! throughput, latency percentiles and errors. The operations are whole
//! chat jobs ([`chat_op`]) or raw tool calls through the tools stream
//! ([`ToolCaller`]); the floors they are compared with live in
//! [`crate::floor`] and run through the same [`drive`]. Figures in
//! BENCHMARKS.md come from here, never from timed assertions in tests.

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use futures::StreamExt;
use futures::future::BoxFuture;
use tokio::sync::mpsc;

use toolfleet_protocol::tools::ToolId;
use toolfleet_protocol::{
    CallContext, ChatEventBody, InvocationContext, Subjects, ToolJob, ToolStatus,
};

/// How much load: `concurrency` operations in flight until `count` have
/// started or `duration` has passed, whichever comes first.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub struct Load {
    pub concurrency: usize,
    pub count: Option<usize>,
    #[serde(serialize_with = "secs")]
    pub duration: Option<Duration>,
}

fn secs<S: serde::Serializer>(d: &Option<Duration>, s: S) -> Result<S::Ok, S::Error> {
    match d {
        Some(d) => s.serialize_some(&d.as_secs_f64()),
        None => s.serialize_none(),
    }
}

impl Load {
    /// One batch at the same concurrency: warms connections and caches.
    pub fn warm_up(&self) -> Self {
        Self {
            concurrency: self.concurrency,
            count: Some(self.concurrency.min(self.count.unwrap_or(usize::MAX))),
            duration: None,
        }
    }
}

/// What one operation ended with: how many tool calls it made (chat jobs),
/// or a short error code.
pub type Outcome = Result<u32, String>;

/// One operation, by its index.
pub type Op = Arc<dyn Fn(usize) -> BoxFuture<'static, Outcome> + Send + Sync>;

/// Latency figures of the successful operations, in milliseconds.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub max: f64,
    pub mean: f64,
}

impl Latency {
    /// The figures of `sorted` (ascending).
    pub fn of(sorted: &[f64]) -> Self {
        Self {
            p50: percentile(sorted, 50.0),
            p90: percentile(sorted, 90.0),
            p99: percentile(sorted, 99.0),
            max: sorted.last().copied().unwrap_or(0.0),
            mean: if sorted.is_empty() {
                0.0
            } else {
                sorted.iter().sum::<f64>() / sorted.len() as f64
            },
        }
    }
}

/// What a run of one kind of operation measured.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Summary {
    pub name: String,
    pub concurrency: usize,
    /// Operations started.
    pub ops: usize,
    pub ok: usize,
    pub errors: usize,
    /// Errors by code.
    pub error_codes: BTreeMap<String, usize>,
    /// Tool calls made by the operations (chat jobs; 0 otherwise).
    pub tool_calls: u64,
    pub elapsed_secs: f64,
    /// Successful operations per second.
    pub ops_per_sec: f64,
    pub latency_ms: Latency,
    /// Every successful operation's latency, ascending (for the chart).
    #[serde(skip)]
    pub sorted_ms: Vec<f64>,
}

impl Summary {
    /// Summarises `(latency ms, outcome)` pairs of a run that took
    /// `elapsed`.
    pub fn new(
        name: impl Into<String>,
        concurrency: usize,
        results: &[(f64, Outcome)],
        elapsed: Duration,
    ) -> Self {
        let mut sorted_ms: Vec<f64> = results
            .iter()
            .filter(|(_, o)| o.is_ok())
            .map(|(ms, _)| *ms)
            .collect();
        sorted_ms.sort_by(f64::total_cmp);
        let mut error_codes = BTreeMap::new();
        for (_, o) in results {
            if let Err(code) = o {
                *error_codes.entry(code.clone()).or_insert(0) += 1;
            }
        }
        let elapsed_secs = elapsed.as_secs_f64();
        Self {
            name: name.into(),
            concurrency,
            ops: results.len(),
            ok: sorted_ms.len(),
            errors: results.len() - sorted_ms.len(),
            error_codes,
            tool_calls: results
                .iter()
                .filter_map(|(_, o)| o.as_ref().ok())
                .map(|&n| u64::from(n))
                .sum(),
            elapsed_secs,
            ops_per_sec: sorted_ms.len() as f64 / elapsed_secs.max(f64::EPSILON),
            latency_ms: Latency::of(&sorted_ms),
            sorted_ms,
        }
    }
}

impl Summary {
    /// One summary of the rounds of one kind of operation (`parts`, at
    /// least one): their operations together, over their time together.
    pub fn merge(parts: Vec<Summary>) -> Summary {
        let mut parts = parts.into_iter();
        let mut all = parts
            .next()
            .unwrap_or_else(|| Summary::new("", 0, &[], Duration::ZERO));
        for part in parts {
            all.ops += part.ops;
            all.ok += part.ok;
            all.errors += part.errors;
            for (code, n) in part.error_codes {
                *all.error_codes.entry(code).or_insert(0) += n;
            }
            all.tool_calls += part.tool_calls;
            all.elapsed_secs += part.elapsed_secs;
            all.sorted_ms.extend(part.sorted_ms);
        }
        all.sorted_ms.sort_by(f64::total_cmp);
        all.ops_per_sec = all.ok as f64 / all.elapsed_secs.max(f64::EPSILON);
        all.latency_ms = Latency::of(&all.sorted_ms);
        all
    }
}

/// At most this many alternating rounds when the fleet is measured beside
/// its floors ([`interleave`]).
pub const ROUNDS: usize = 5;

impl Load {
    /// How many rounds `self` is driven in beside the floors: up to
    /// [`ROUNDS`], each with at least two operations per lane and a second.
    pub fn rounds(&self) -> usize {
        let by_count = self
            .count
            .map_or(ROUNDS, |c| c / (2 * self.concurrency.max(1)));
        let by_time = self.duration.map_or(ROUNDS, |d| d.as_secs() as usize);
        by_count.min(by_time).clamp(1, ROUNDS)
    }

    /// Round `i` of `rounds`: its share of the count (the remainder goes to
    /// the last) and of the duration.
    pub fn round(&self, i: usize, rounds: usize) -> Load {
        let rounds = rounds.max(1);
        Load {
            concurrency: self.concurrency,
            count: self
                .count
                .map(|c| c / rounds + if i + 1 == rounds { c % rounds } else { 0 }),
            duration: self.duration.map(|d| d / rounds as u32),
        }
    }
}

/// Drives each of `sides` (name, operation) under `load`, in `rounds`
/// alternating rounds — the first side's round, then the second's, … —
/// and returns one summary per side, in order. Sides measured this way
/// share the machine's other load alike: a ratio between them does not
/// move with a build that starts halfway through the run.
pub async fn interleave(load: &Load, sides: &[(String, Op)], rounds: usize) -> Vec<Summary> {
    let mut parts: Vec<Vec<Summary>> = sides.iter().map(|_| Vec::new()).collect();
    for round in 0..rounds.max(1) {
        let share = load.round(round, rounds);
        for ((name, op), parts) in sides.iter().zip(&mut parts) {
            parts.push(drive(name, &share, op.clone()).await);
        }
    }
    parts.into_iter().map(Summary::merge).collect()
}

/// Nearest-rank percentile of `sorted` (ascending); 0 when empty.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// Runs `op` under `load`: `concurrency` lanes, each a task of its own
/// (so the load generator can use every core), each taking the next index
/// until the count or the duration is reached.
pub async fn drive(name: &str, load: &Load, op: Op) -> Summary {
    let started = Instant::now();
    let next = Arc::new(AtomicUsize::new(0));
    let count = load.count.unwrap_or(usize::MAX);
    let lanes: Vec<_> = (0..load.concurrency.max(1))
        .map(|_| {
            let (next, op, duration) = (next.clone(), op.clone(), load.duration);
            tokio::spawn(async move {
                let mut results = Vec::new();
                loop {
                    if duration.is_some_and(|d| started.elapsed() >= d) {
                        break;
                    }
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= count {
                        break;
                    }
                    let t = Instant::now();
                    let outcome = op(i).await;
                    results.push((t.elapsed().as_secs_f64() * 1000.0, outcome));
                }
                results
            })
        })
        .collect();
    let mut results = Vec::new();
    for lane in lanes {
        match lane.await {
            Ok(r) => results.extend(r),
            Err(_) => results.push((0.0, Err("load_generator_panic".to_string()))),
        }
    }
    Summary::new(name, load.concurrency, &results, started.elapsed())
}

/// Whole chat jobs: ask `questions` in turn and wait for the terminal
/// event. A job slower than `slow` prints when each of its events arrived.
pub fn chat_op(
    client: async_nats::Client,
    subjects: Subjects,
    questions: Vec<String>,
    timeout: Duration,
    slow: Duration,
) -> Op {
    let questions = Arc::new(questions);
    Arc::new(move |i| {
        let (client, subjects, questions) = (client.clone(), subjects.clone(), questions.clone());
        Box::pin(async move {
            let job = toolfleet_protocol::client::question(&questions[i % questions.len().max(1)]);
            let t = Instant::now();
            let mut tools = 0;
            let mut timeline = Vec::new();
            let r = toolfleet_protocol::client::chat(&client, &subjects, &job, timeout, |e| {
                timeline.push((t.elapsed().as_millis(), ChatEventBody::name(&e.body)));
                if matches!(e.body, ChatEventBody::ToolResult { .. }) {
                    tools += 1;
                }
            })
            .await;
            // An outlier is worth its story: when each event arrived.
            if t.elapsed() > slow {
                eprintln!(
                    "slow job {} ({} ms): {timeline:?}",
                    job.invocation_id,
                    t.elapsed().as_millis()
                );
            }
            match r {
                Ok(_) => Ok(tools),
                Err(e) => Err(chat_error_code(&e)),
            }
        })
    })
}

/// A short code for a failed chat job: the `error` event's own code.
fn chat_error_code(e: &toolfleet_protocol::client::ClientError) -> String {
    use toolfleet_protocol::client::ClientError;
    match e {
        ClientError::Timeout(_) => "timeout".into(),
        ClientError::Failed { code, .. } => code.clone(),
        ClientError::Nats(_) => "nats".into(),
        ClientError::Rejected(_) => "rejected".into(),
        _ => "chat_error".into(),
    }
}

/// Replies on one inbox, routed to their waiting calls by the last token
/// of the subject: one subscription for the whole run, as an orchestrator
/// holds one per invocation. The JetStream floor uses it too, so the fleet
/// and the floor differ only in what serves the job.
#[derive(Clone)]
pub struct Replies {
    inbox: String,
    waiting: Arc<Mutex<HashMap<String, mpsc::UnboundedSender<async_nats::Message>>>>,
    _task: Arc<tokio_util::sync::DropGuard>,
}

impl Replies {
    /// Subscribes to `<inbox>.*`.
    pub async fn subscribe(client: &async_nats::Client, inbox: String) -> anyhow::Result<Self> {
        let mut sub = client.subscribe(format!("{inbox}.*")).await?;
        client.flush().await?;
        let waiting: Arc<Mutex<HashMap<String, mpsc::UnboundedSender<async_nats::Message>>>> =
            Arc::default();
        let stop = tokio_util::sync::CancellationToken::new();
        {
            let (waiting, stop) = (waiting.clone(), stop.clone());
            tokio::spawn(async move {
                loop {
                    let msg = tokio::select! {
                        _ = stop.cancelled() => break,
                        m = sub.next() => match m { Some(m) => m, None => break },
                    };
                    let key = msg
                        .subject
                        .rsplit('.')
                        .next()
                        .unwrap_or_default()
                        .to_string();
                    let tx = waiting
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .get(&key)
                        .cloned();
                    if let Some(tx) = tx {
                        let _ = tx.send(msg);
                    }
                }
            });
        }
        Ok(Self {
            inbox,
            waiting,
            _task: Arc::new(stop.drop_guard()),
        })
    }

    /// The reply subject for `key`, and the receiver of its replies
    /// (progress, then the result) until [`Replies::done`]. Register before
    /// publishing, so no reply is missed.
    pub fn expect(&self, key: &str) -> (String, mpsc::UnboundedReceiver<async_nats::Message>) {
        let (tx, rx) = mpsc::unbounded_channel();
        self.waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(key.to_string(), tx);
        (format!("{}.{key}", self.inbox), rx)
    }

    /// Stops routing replies for `key`.
    pub fn done(&self, key: &str) {
        self.waiting
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(key);
    }
}

/// Raw tool calls through the fleet, as the orchestrator makes them: a tool
/// job on the tools stream with the call's headers (`CallContext`), a
/// reply subject under the fleet's inbox prefix, the publish ack awaited,
/// then the result awaited on the inbox. Progress replies are skipped; a
/// result that is not `ok` counts as an error with its code.
#[derive(Clone)]
pub struct ToolCaller {
    js: async_nats::jetstream::Context,
    subject: String,
    tool_id: ToolId,
    body: bytes::Bytes,
    replies: Replies,
    timeout: Duration,
    /// The invocation's data source (a retrieval tool searches it).
    data_source: Option<String>,
    /// This run's token: invocation ids are `<run>-<n>`, unique across
    /// runs and the warm-up without a random id (a `getrandom` call) per
    /// call.
    run: String,
    calls: Arc<std::sync::atomic::AtomicU64>,
}

impl ToolCaller {
    pub async fn new(
        client: &async_nats::Client,
        subjects: &Subjects,
        tool_id: ToolId,
        arguments: serde_json::Value,
        timeout: Duration,
    ) -> anyhow::Result<Self> {
        let body = serde_json::to_vec(&ToolJob {
            arguments,
            settings: None,
        })?;
        Ok(Self {
            js: async_nats::jetstream::new(client.clone()),
            subject: subjects.tool(&tool_id),
            tool_id,
            body: body.into(),
            replies: Replies::subscribe(client, subjects.reply_inbox()).await?,
            timeout,
            data_source: None,
            run: toolfleet_protocol::client::new_invocation_id(),
            calls: Arc::default(),
        })
    }

    /// Calls under invocations of `data_source` (what a retrieval tool
    /// searches).
    #[must_use]
    pub fn with_data_source(mut self, data_source: Option<String>) -> Self {
        self.data_source = data_source;
        self
    }

    /// The caller as an [`Op`] for [`drive`].
    pub fn op(self) -> Op {
        let caller = Arc::new(self);
        Arc::new(move |_| {
            let caller = caller.clone();
            Box::pin(async move { caller.call().await.map(|()| 0) })
        })
    }

    /// One call: `Ok` when its result is `ok`, else its error code.
    pub async fn call(&self) -> Result<(), String> {
        // Never an id used before: a repeated one would be answered from
        // the result ledger without running.
        let n = self.calls.fetch_add(1, Ordering::Relaxed);
        let invocation_id = format!("{}-{n}", self.run);
        let call_id = format!("call_{n}");
        let (reply_to, rx) = self.replies.expect(&call_id);
        let mut invocation = InvocationContext::new(invocation_id);
        invocation.data_source_id.clone_from(&self.data_source);
        invocation.deadline_ms =
            Some(toolfleet_protocol::now_ms() + self.timeout.as_millis() as u64);
        let call = CallContext {
            invocation,
            call_id: call_id.clone(),
            tool_id: self.tool_id.clone(),
            attempt: 1,
            reply_to,
            citation_floor: 0,
            new_call: true,
        };
        let result = async {
            let ack = self
                .js
                .publish_with_headers(self.subject.clone(), call.to_headers(), self.body.clone())
                .await
                .map_err(|_| "publish".to_string())?;
            ack.await.map_err(|_| "publish_ack".to_string())?;
            let mut rx = rx;
            let deadline = tokio::time::Instant::now() + self.timeout;
            loop {
                let msg = tokio::time::timeout_at(deadline, rx.recv())
                    .await
                    .map_err(|_| "timeout".to_string())?
                    .ok_or_else(|| "inbox_closed".to_string())?;
                match serde_json::from_slice::<ReplyHead>(&msg.payload) {
                    Ok(ReplyHead {
                        kind: "result",
                        status: Some(ToolStatus::Ok),
                        ..
                    }) => return Ok(()),
                    Ok(ReplyHead {
                        kind: "result",
                        status: Some(status),
                        error,
                    }) => {
                        return Err(error
                            .map(|e| e.code.into_owned())
                            .unwrap_or_else(|| status.as_str().to_string()));
                    }
                    // Progress: wait on for the result.
                    Ok(ReplyHead {
                        kind: "progress", ..
                    }) => {}
                    _ => return Err("malformed_reply".to_string()),
                }
            }
        }
        .await;
        self.replies.done(&call_id);
        result
    }
}

/// What the load generator reads of a [`toolfleet_protocol::ToolReply`]: its type, and a
/// result's status and error code (the rest is skipped, not built).
#[derive(serde::Deserialize)]
struct ReplyHead<'a> {
    #[serde(rename = "type", borrow)]
    kind: &'a str,
    #[serde(default)]
    status: Option<ToolStatus>,
    #[serde(default, borrow)]
    error: Option<ErrorHead<'a>>,
}

#[derive(serde::Deserialize)]
struct ErrorHead<'a> {
    #[serde(borrow)]
    code: std::borrow::Cow<'a, str>,
}

/// The fleet's figures over a floor's: above 1 the fleet is slower (p50)
/// or faster (throughput).
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Ratios {
    pub floor: String,
    pub p50: f64,
    pub p90: f64,
    pub p99: f64,
    pub throughput: f64,
}

impl Ratios {
    pub fn of(fleet: &Summary, floor: &Summary) -> Self {
        let ratio = |a: f64, b: f64| if b > 0.0 { a / b } else { 0.0 };
        Self {
            floor: floor.name.clone(),
            p50: ratio(fleet.latency_ms.p50, floor.latency_ms.p50),
            p90: ratio(fleet.latency_ms.p90, floor.latency_ms.p90),
            p99: ratio(fleet.latency_ms.p99, floor.latency_ms.p99),
            throughput: ratio(fleet.ops_per_sec, floor.ops_per_sec),
        }
    }
}

/// Resident memory of a process, from `/proc/<pid>/status` (Linux).
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize)]
pub struct Memory {
    /// `VmRSS`, KiB.
    pub rss_kib: u64,
    /// `VmHWM` (peak RSS), KiB.
    pub hwm_kib: u64,
}

impl Memory {
    /// Reads `/proc/<pid>/status` (`self` for this process).
    pub fn of(pid: &str) -> Option<Self> {
        Self::parse(&std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?)
    }

    /// The `VmRSS` and `VmHWM` lines of a status file.
    pub fn parse(status: &str) -> Option<Self> {
        let kib = |key: &str| -> Option<u64> {
            status
                .lines()
                .find(|l| l.starts_with(key))?
                .split_whitespace()
                .nth(1)?
                .parse()
                .ok()
        };
        Some(Self {
            rss_kib: kib("VmRSS:")?,
            hwm_kib: kib("VmHWM:")?,
        })
    }
}

/// The report's table: one row per run.
pub fn table(rows: &[&Summary]) -> String {
    let mut out = String::from(
        "| run | concurrency | ok | errors | ops/s | p50 ms | p90 ms | p99 ms | max ms |\n\
         |---|---:|---:|---:|---:|---:|---:|---:|---:|\n",
    );
    for s in rows {
        let l = &s.latency_ms;
        out.push_str(&format!(
            "| {} | {} | {} | {} | {:.1} | {} | {} | {} | {} |\n",
            s.name,
            s.concurrency,
            s.ok,
            s.errors,
            s.ops_per_sec,
            ms(l.p50),
            ms(l.p90),
            ms(l.p99),
            ms(l.max)
        ));
    }
    out
}

/// Milliseconds with the digits that mean something.
fn ms(v: f64) -> String {
    if v < 10.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.1}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_pick_ranks() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 51.0);
        assert_eq!(percentile(&v, 90.0), 90.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
    }

    #[test]
    fn a_summary_counts_errors_apart_from_latencies() {
        let results = vec![
            (4.0, Ok(2)),
            (1.0, Ok(1)),
            (100.0, Err("timeout".to_string())),
            (3.0, Ok(0)),
            (2.0, Err("timeout".to_string())),
            (9.0, Err("invalid_arguments".to_string())),
        ];
        let s = Summary::new("fleet", 8, &results, Duration::from_secs(2));
        assert_eq!((s.ops, s.ok, s.errors), (6, 3, 3));
        assert_eq!(s.error_codes["timeout"], 2);
        assert_eq!(s.error_codes["invalid_arguments"], 1);
        assert_eq!(s.tool_calls, 3);
        assert_eq!(s.sorted_ms, vec![1.0, 3.0, 4.0]);
        assert_eq!(s.ops_per_sec, 1.5);
        assert_eq!(s.latency_ms.p50, 3.0);
        assert_eq!(s.latency_ms.max, 4.0);
        assert!((s.latency_ms.mean - 8.0 / 3.0).abs() < 1e-9);
        let json = serde_json::to_value(&s).unwrap();
        assert!(
            json.get("sorted_ms").is_none(),
            "samples stay out of --json"
        );
        assert_eq!(json["latency_ms"]["p90"], 4.0);
    }

    #[test]
    fn ratios_divide_the_fleet_by_the_floor() {
        let fleet = Summary::new(
            "fleet",
            1,
            &[(3.0, Ok(0)), (3.0, Ok(0))],
            Duration::from_secs(1),
        );
        let floor = Summary::new(
            "floor",
            1,
            &[(2.0, Ok(0)), (2.0, Ok(0)), (2.0, Ok(0)), (2.0, Ok(0))],
            Duration::from_secs(1),
        );
        let r = Ratios::of(&fleet, &floor);
        assert_eq!((r.p50, r.throughput), (1.5, 0.5));
        let empty = Summary::new("none", 1, &[], Duration::from_secs(1));
        assert_eq!(Ratios::of(&fleet, &empty).p50, 0.0, "no division by zero");
    }

    #[test]
    fn the_table_has_a_row_per_run() {
        let s = Summary::new(
            "fleet: tool calls",
            256,
            &[(12.345, Ok(0))],
            Duration::from_secs(1),
        );
        let t = table(&[&s, &s]);
        assert_eq!(t.lines().count(), 4);
        assert!(
            t.contains("| fleet: tool calls | 256 | 1 | 0 | 1.0 | 12.3 | 12.3 | 12.3 | 12.3 |"),
            "{t}"
        );
        assert_eq!(ms(0.4567), "0.46");
    }

    #[test]
    fn memory_comes_from_proc_status() {
        let status =
            "Name:\ttoolfleet-orch\nVmPeak:\t  999 kB\nVmHWM:\t  204800 kB\nVmRSS:\t  102400 kB\n";
        assert_eq!(
            Memory::parse(status),
            Some(Memory {
                rss_kib: 102_400,
                hwm_kib: 204_800
            })
        );
        assert_eq!(Memory::parse("Name: x\n"), None);
        assert!(Memory::of("self").is_some_and(|m| m.rss_kib > 0));
    }

    #[test]
    fn a_reply_is_read_for_its_type_status_and_code() {
        let call = CallContext {
            invocation: InvocationContext::new("inv-1"),
            call_id: "c1".into(),
            tool_id: "system:current_datetime@1.0.0".parse().unwrap(),
            attempt: 1,
            reply_to: "toolfleet.reply.x.c1".into(),
            citation_floor: 0,
            new_call: false,
        };
        let result = |status, code: Option<&str>| {
            toolfleet_protocol::encode(&toolfleet_protocol::ToolReply::Result(Box::new(
                toolfleet_protocol::ToolResult {
                    invocation_id: call.invocation.invocation_id.clone(),
                    call_id: call.call_id.clone(),
                    tool_id: call.tool_id.to_string(),
                    status,
                    content: "text with \"quotes\"".into(),
                    data: Some(serde_json::json!({ "nested": { "status": "ignored" } })),
                    error: code.map(|c| toolfleet_protocol::ToolErrorBody {
                        code: c.into(),
                        message: "m".into(),
                        violations: Vec::new(),
                    }),
                    references: Vec::new(),
                    attempt: 1,
                    duration_ms: 3,
                    replayed: false,
                    llm_calls: Vec::new(),
                    warnings: Vec::new(),
                },
            )))
        };
        let ok = result(ToolStatus::Ok, None);
        let head: ReplyHead = serde_json::from_slice(&ok).unwrap();
        assert_eq!((head.kind, head.status), ("result", Some(ToolStatus::Ok)));
        assert!(head.error.is_none());
        let failed = result(ToolStatus::Error, Some("tool_failed"));
        let head: ReplyHead = serde_json::from_slice(&failed).unwrap();
        assert_eq!(head.status, Some(ToolStatus::Error));
        assert_eq!(head.error.unwrap().code, "tool_failed");
        let progress = toolfleet_protocol::encode(&toolfleet_protocol::ToolReply::Progress {
            invocation_id: "inv-1".into(),
            call_id: "c1".into(),
            message: "half way".into(),
        });
        let head: ReplyHead = serde_json::from_slice(&progress).unwrap();
        assert_eq!((head.kind, head.status), ("progress", None));
    }

    #[test]
    fn rounds_split_the_load_and_merge_back() {
        let by_count = Load {
            concurrency: 1,
            count: Some(5003),
            duration: None,
        };
        assert_eq!(by_count.rounds(), ROUNDS);
        let shares: Vec<Option<usize>> = (0..5).map(|i| by_count.round(i, 5).count).collect();
        assert_eq!(
            shares,
            [Some(1000), Some(1000), Some(1000), Some(1000), Some(1003)]
        );
        let by_time = Load {
            concurrency: 256,
            count: None,
            duration: Some(Duration::from_secs(20)),
        };
        assert_eq!(by_time.rounds(), ROUNDS);
        assert_eq!(by_time.round(2, 5).duration, Some(Duration::from_secs(4)));
        // Too few operations per lane (a burst): one round.
        let burst = Load {
            concurrency: 10_000,
            count: Some(10_000),
            duration: None,
        };
        assert_eq!(burst.rounds(), 1);
        assert_eq!(burst.round(0, 1).count, Some(10_000));

        let a = Summary::new(
            "x",
            2,
            &[(1.0, Ok(1)), (3.0, Ok(0)), (0.0, Err("t".into()))],
            Duration::from_secs(1),
        );
        let b = Summary::new(
            "x",
            2,
            &[(2.0, Ok(2)), (0.0, Err("t".into()))],
            Duration::from_secs(1),
        );
        let all = Summary::merge(vec![a, b]);
        assert_eq!((all.ops, all.ok, all.errors, all.tool_calls), (5, 3, 2, 3));
        assert_eq!(all.error_codes.get("t"), Some(&2));
        assert_eq!(all.sorted_ms, [1.0, 2.0, 3.0]);
        assert_eq!(all.elapsed_secs, 2.0);
        assert_eq!(all.ops_per_sec, 1.5);
        assert_eq!(all.latency_ms.p50, 2.0);
    }

    #[test]
    fn chat_errors_get_short_codes() {
        use toolfleet_protocol::client::ClientError;
        assert_eq!(
            chat_error_code(&ClientError::Timeout(Duration::from_secs(1))),
            "timeout"
        );
        assert_eq!(
            chat_error_code(&ClientError::Failed {
                code: "llm_connect".into(),
                message: "Too many open files".into()
            }),
            "llm_connect"
        );
    }

    #[tokio::test]
    async fn drive_stops_at_the_count() {
        let load = Load {
            concurrency: 4,
            count: Some(10),
            duration: None,
        };
        let op: Op = Arc::new(|i| {
            Box::pin(async move {
                if i % 5 == 0 {
                    Err("boom".to_string())
                } else {
                    Ok(1)
                }
            })
        });
        let s = drive("test", &load, op).await;
        assert_eq!((s.ops, s.ok, s.errors, s.tool_calls), (10, 8, 2, 8));
        assert_eq!(load.warm_up().count, Some(4));
    }
}
