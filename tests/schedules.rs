//! Scheduled chat jobs and `notBefore` (issue 32, part 4) on real
//! nats-server and redis-server, with the scripted model server standing
//! in for the provider: a schedule fires each due time once across two
//! orchestrators, a missed due time is skipped (or caught up once), a busy
//! schedule does not run twice at once, pause and rm stop it, bad cron and
//! time zones are refused, and a job waits for its `notBefore`.

// Tests are exempt from the 100-line limit: a scenario reads top to bottom.
#![allow(clippy::too_many_lines)]

mod support;

use std::collections::HashSet;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use clap::Parser;
use futures::{StreamExt, TryStreamExt};
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::schedule::{MissedPolicy, Schedule, ScheduledRun, schedules_bucket};

use support::{Env, Options, WAIT, events_until_terminal};

fn script() -> Value {
    json!({ "default": { "steps": [ { "answer": "The report is ready." } ] } })
}

fn now_secs() -> i64 {
    i64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_secs(),
    )
    .unwrap()
}

/// Runs `toolfleet schedule …` against the test's NATS server; its exit
/// code.
async fn schedule_cli(env: &Env, args: &[&str]) -> i32 {
    let url = env.nats.url();
    let mut argv = vec!["toolfleet", "schedule"];
    argv.extend_from_slice(args);
    argv.extend_from_slice(&["--nats-url", url.as_str()]);
    let cli = toolfleet::cli::Cli::try_parse_from(argv).expect("the command line parses");
    tokio::time::timeout(WAIT, toolfleet::cli::run(cli))
        .await
        .expect("the command ends in time")
        .expect("the command runs")
}

/// A job file for `schedule add`.
fn job_file(dir: &tempfile::TempDir) -> String {
    let path = dir.path().join("job.json");
    std::fs::write(
        &path,
        r#"{"messages": [{"role": "user", "content": "Write the daily report."}]}"#,
    )
    .unwrap();
    path.to_str().unwrap().to_string()
}

/// An orchestrator of its own, as another process would be: its own NATS
/// and Redis connections, its own metrics (returned).
async fn second_orchestrator(env: &Env) -> toolfleet_service::Runtime {
    let profiles = toolfleet_config::FleetConfig::single(
        toolfleet_llm::deployments::Deployment::new(env.model.base_url(), "toolfleet-scripted")
            .with_api_key("sk-test".to_string()),
    );
    let config = toolfleet_orchestrator::OrchestratorConfig::new(env.subjects.clone(), profiles);
    support::start_orchestrator(env.nats.url(), env.redis.url(), config).await
}

/// `toolfleet_schedule_runs_total{outcome}` in `registry`.
fn runs(registry: &prometheus::Registry, outcome: &str) -> u64 {
    registry
        .gather()
        .iter()
        .filter(|f| f.name() == "toolfleet_schedule_runs_total")
        .flat_map(|f| f.get_metric().iter())
        .filter(|m| m.get_label().iter().any(|l| l.value() == outcome))
        .map(|m| {
            #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
            let n = m.get_counter().get_value() as u64;
            n
        })
        .sum()
}

/// Every chat job published on `tenant`'s submit subject, as it arrives:
/// a core subscription beside the stream (what orchestrators submit).
struct Submitted {
    sub: async_nats::Subscriber,
    seen: Vec<(String, SystemTime)>,
}

impl Submitted {
    async fn watch(env: &Env, tenant: &str) -> Self {
        Self {
            sub: env.subscribe(env.subjects.chat_submit(tenant)).await,
            seen: Vec::new(),
        }
    }

    /// Collects submissions for `period`.
    async fn collect_for(&mut self, period: Duration) {
        let until = tokio::time::Instant::now() + period;
        while let Ok(Some(msg)) = tokio::time::timeout_at(until, self.sub.next()).await {
            let job: Value = serde_json::from_slice(&msg.payload).unwrap();
            let id = job["invocationId"].as_str().unwrap().to_string();
            self.seen.push((id, SystemTime::now()));
        }
    }

    /// Collects until `n` submissions were seen (at most [`WAIT`]).
    async fn until(&mut self, n: usize) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while self.seen.len() < n {
            let msg = tokio::time::timeout_at(deadline, self.sub.next())
                .await
                .unwrap_or_else(|_| panic!("only {} submissions: {:?}", self.seen.len(), self.seen))
                .unwrap();
            let job: Value = serde_json::from_slice(&msg.payload).unwrap();
            let id = job["invocationId"].as_str().unwrap().to_string();
            self.seen.push((id, SystemTime::now()));
        }
    }

    fn ids(&self) -> Vec<&str> {
        self.seen.iter().map(|(id, _)| id.as_str()).collect()
    }
}

/// What happened on `tenant`'s chat subjects, in the order the server
/// sent it (one subscription, so one order): `("submit", id)` for a job
/// published, `("end", id)` for an invocation's terminal event. Filled in
/// by a task of its own.
async fn chat_timeline(
    env: &Env,
    tenant: &str,
) -> std::sync::Arc<std::sync::Mutex<Vec<(&'static str, String)>>> {
    let mut all = env
        .subscribe(format!("{}.chat.>", env.subjects.prefix()))
        .await;
    let submit = env.subjects.chat_submit(tenant);
    let events = env.subjects.chat_events_of(tenant).replace(".*", ".");
    let timeline = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let fill = timeline.clone();
    tokio::spawn(async move {
        while let Some(msg) = all.next().await {
            let Ok(body) = serde_json::from_slice::<Value>(&msg.payload) else {
                continue;
            };
            let id = body["invocationId"]
                .as_str()
                .unwrap_or_default()
                .to_string();
            if msg.subject.as_str() == submit {
                fill.lock().unwrap().push(("submit", id));
            } else if msg.subject.as_str().starts_with(&events)
                && (body["type"] == "completed" || body["type"] == "error")
            {
                fill.lock().unwrap().push(("end", id));
            }
        }
    });
    timeline
}

/// The due time in a run id of schedule `id`
/// (`sched-<id>-<due>-<nonce>`).
fn due_of(run_id: &str, id: &str) -> i64 {
    let rest = run_id
        .strip_prefix(&format!("sched-{id}-"))
        .unwrap_or_else(|| panic!("{run_id} is not a run of {id}"));
    let (due, nonce) = rest.split_once('-').expect(run_id);
    assert_eq!(nonce.len(), 32, "{run_id}: a 128-bit nonce");
    due.parse().expect(run_id)
}

/// The schedule stored under `tenant`.`id`.
async fn stored(env: &Env, tenant: &str, id: &str) -> Option<Schedule> {
    let js = async_nats::jetstream::new(env.client.clone());
    let bucket = schedules_bucket(&js, &env.subjects).await.unwrap();
    bucket
        .get(format!("{tenant}.{id}"))
        .await
        .unwrap()
        .map(|b| serde_json::from_slice(&b).unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schedules_fire_each_due_time_once_across_two_orchestrators_and_rm_stops_them() {
    let env = Env::start_with(script(), Options::default()).await;
    let b = second_orchestrator(&env).await;
    let b_metrics = b.metrics.clone();
    let _stop_b = b.shutdown.clone().drop_guard();
    let dir = tempfile::tempdir().unwrap();
    let job = job_file(&dir);
    let mut submitted = Submitted::watch(&env, "acme").await;
    // Every second, no limit on runs in flight: every due time is a run,
    // and two orchestrators race for each.
    let code = schedule_cli(
        &env,
        &[
            "add",
            "--tenant",
            "acme",
            "--id",
            "report",
            "--cron",
            "* * * * * *",
            "--job",
            &job,
            "--allow-concurrent",
        ],
    )
    .await;
    assert_eq!(code, 0);
    submitted.until(5).await;
    assert_eq!(
        schedule_cli(&env, &["rm", "--tenant", "acme", "--id", "report"]).await,
        0
    );
    // A run whose record update won just before the removal may still be
    // published; after that, nothing.
    submitted.collect_for(Duration::from_secs(2)).await;
    let after_rm = submitted.seen.len();
    submitted.collect_for(Duration::from_secs(3)).await;
    assert_eq!(
        submitted.seen.len(),
        after_rm,
        "rm stops the schedule: {:?}",
        submitted.ids()
    );

    let ids = submitted.ids();
    let distinct: HashSet<&str> = ids.iter().copied().collect();
    assert_eq!(
        distinct.len(),
        ids.len(),
        "a due time submitted twice: {ids:?}"
    );
    let dues: Vec<i64> = ids.iter().map(|id| due_of(id, "report")).collect();
    assert!(dues.windows(2).all(|w| w[0] < w[1]), "{dues:?}");
    // Both orchestrators counted exactly the runs there were, between them.
    let total = runs(&env.metrics, "submitted") + runs(&b_metrics, "submitted");
    assert_eq!(total, ids.len() as u64);
    // A run is a chat job of the schedule's tenant like any other: it is
    // answered on that tenant's events.
    let last = ids.last().unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let event =
            toolfleet_protocol::client::last_event(&env.client, &env.subjects, "acme", last)
                .await
                .unwrap();
        if let Some(e) = event.filter(|e| e.body.is_terminal()) {
            assert_eq!(e.body.name(), "completed", "{e:?}");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{last} never ended");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(stored(&env, "acme", "report").await.is_none());
}

/// A schedule record whose next due time passed an hour ago: what a fleet
/// that was down then finds.
fn overdue(id: &str, missed: MissedPolicy) -> Schedule {
    let now = now_secs();
    Schedule {
        tenant: "acme".into(),
        id: id.into(),
        // Every minute at second 0: 60 due times were missed.
        cron: "0 * * * * *".into(),
        tz: "Europe/Paris".into(),
        job: serde_json::from_value(json!({
            "invocationId": "template",
            "messages": [{"role": "user", "content": "Write the hourly report."}]
        }))
        .unwrap(),
        missed,
        max_concurrent: 1,
        budget: None,
        paused: false,
        next_due: now - 3600 - (now % 60),
        runs: Vec::new(),
        created_ms: 0,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schedules_a_missed_due_time_is_skipped_or_caught_up_once_across_two_orchestrators() {
    let env = Env::start_with(script(), Options::default()).await;
    let b = second_orchestrator(&env).await;
    let b_metrics = b.metrics.clone();
    let _stop_b = b.shutdown.clone().drop_guard();
    let mut submitted = Submitted::watch(&env, "acme").await;
    let js = async_nats::jetstream::new(env.client.clone());
    let bucket = schedules_bucket(&js, &env.subjects).await.unwrap();
    for s in [
        overdue("skipper", MissedPolicy::Skip),
        overdue("catcher", MissedPolicy::CatchUpOne),
    ] {
        bucket
            .put(s.key(), serde_json::to_vec(&s).unwrap().into())
            .await
            .unwrap();
    }
    // A record under another tenant's key than the tenant it names is
    // never fired (the key is whose it is).
    let sneaky = overdue("sneaky", MissedPolicy::CatchUpOne);
    bucket
        .put("globex.sneaky", serde_json::to_vec(&sneaky).unwrap().into())
        .await
        .unwrap();
    // Both records move on to a due time after now.
    let deadline = tokio::time::Instant::now() + WAIT;
    let (skipper, catcher) = loop {
        let skipper = stored(&env, "acme", "skipper").await.unwrap();
        let catcher = stored(&env, "acme", "catcher").await.unwrap();
        if skipper.next_due > now_secs() - 60 && catcher.next_due > now_secs() - 60 {
            break (skipper, catcher);
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{skipper:?} {catcher:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(skipper.runs.is_empty(), "skip submits nothing: {skipper:?}");
    assert_eq!(catcher.runs.len(), 1, "{catcher:?}");
    // Until the next minute's due time, exactly one run was submitted: the
    // catch-up for the latest missed due time, whichever orchestrator won.
    let quiet = u64::try_from((catcher.next_due - now_secs() - 2).clamp(0, 5)).unwrap();
    submitted.collect_for(Duration::from_secs(quiet)).await;
    let ids = submitted.ids();
    let catch_up = &catcher.runs[0].invocation_id;
    assert_eq!(
        ids.iter().filter(|id| *id == catch_up).count(),
        1,
        "{ids:?}"
    );
    assert!(
        !ids.iter().any(|id| id.starts_with("sched-skipper-")),
        "{ids:?}"
    );
    assert!(
        !ids.iter().any(|id| id.starts_with("sched-sneaky-")),
        "{ids:?}"
    );
    assert_eq!(catcher.runs[0].due % 60, 0, "a due time of the expression");
    assert!(
        catcher.runs[0].due > now_secs() - 120,
        "the latest missed one"
    );
    let both = |outcome| runs(&env.metrics, outcome) + runs(&b_metrics, outcome);
    assert_eq!(both("skipped_missed"), 1);
    assert_eq!(both("caught_up"), 1);
    assert_eq!(both("submitted"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schedules_a_busy_schedule_never_runs_twice_at_once_pause_stops_it_and_resume_goes_on() {
    // Each run takes its time (a slow first token), longer than a second.
    let script = json!({
        "firstTokenDelayMs": 2500,
        "default": { "steps": [ { "answer": "The report is ready." } ] }
    });
    let env = Env::start_with(script, Options::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let job = job_file(&dir);
    let timeline = chat_timeline(&env, "acme").await;
    let mut submitted = Submitted::watch(&env, "acme").await;
    let code = schedule_cli(
        &env,
        &[
            "add",
            "--tenant",
            "acme",
            "--id",
            "busy",
            "--cron",
            "* * * * * *",
            "--job",
            &job,
        ],
    )
    .await;
    assert_eq!(code, 0);
    submitted.until(2).await;
    assert_eq!(
        schedule_cli(&env, &["pause", "--tenant", "acme", "--id", "busy"]).await,
        0
    );
    assert!(stored(&env, "acme", "busy").await.unwrap().paused);
    submitted.collect_for(Duration::from_secs(2)).await;
    let at_pause = submitted.seen.len();
    submitted.collect_for(Duration::from_secs(3)).await;
    assert_eq!(submitted.seen.len(), at_pause, "pause stops the schedule");
    // Every run ends; none was submitted while another ran.
    let deadline = tokio::time::Instant::now() + WAIT;
    let ends = || {
        timeline
            .lock()
            .unwrap()
            .iter()
            .filter(|(k, _)| *k == "end")
            .count()
    };
    while ends() < at_pause {
        assert!(tokio::time::Instant::now() < deadline, "every run ends");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut running: Option<String> = None;
    for (kind, id) in timeline.lock().unwrap().iter() {
        match *kind {
            "submit" => {
                assert!(
                    running.is_none(),
                    "{id} was submitted while {running:?} ran"
                );
                running = Some(id.clone());
            }
            _ if running.as_deref() == Some(id.as_str()) => running = None,
            _ => {}
        }
    }
    let skipped = env
        .metrics
        .gather()
        .iter()
        .filter(|f| f.name() == "toolfleet_schedule_runs_total")
        .flat_map(|f| f.get_metric().iter())
        .filter(|m| m.get_label().iter().any(|l| l.value() == "skipped_busy"))
        .map(|m| m.get_counter().get_value())
        .sum::<f64>();
    assert!(skipped >= 1.0, "due times found it busy and were skipped");

    // Resumed, it fires again: one run, for a due time after the pause
    // (the seconds it was paused are not made up one by one).
    let before = submitted.seen.len();
    let resumed_at = now_secs();
    assert_eq!(
        schedule_cli(&env, &["resume", "--tenant", "acme", "--id", "busy"]).await,
        0
    );
    submitted.until(before + 1).await;
    let due = due_of(&submitted.seen[before].0, "busy");
    assert!(due >= resumed_at - 1, "a stale due time {due} was fired");
    assert_eq!(
        schedule_cli(&env, &["rm", "--tenant", "acme", "--id", "busy"]).await,
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schedules_bad_cron_zone_or_job_is_refused_and_nothing_is_stored() {
    let env = Env::start_with(script(), Options::default()).await;
    let dir = tempfile::tempdir().unwrap();
    let job = job_file(&dir);
    let bad_job = dir.path().join("bad.json");
    std::fs::write(&bad_job, r#"{"messages": "not a list"}"#).unwrap();
    let bad_job = bad_job.to_str().unwrap().to_string();
    for args in [
        vec!["--cron", "0 25 * * *", "--job", &job],
        vec!["--cron", "every morning", "--job", &job],
        // croner's 7th field, a year: refused.
        vec!["--cron", "0 0 9 * * * 2027", "--job", &job],
        vec![
            "--cron",
            "0 9 * * 1-5",
            "--tz",
            "Europe/Atlantis",
            "--job",
            &job,
        ],
        vec!["--cron", "0 9 * * 1-5", "--job", &bad_job],
        vec![
            "--cron",
            "0 9 * * 1-5",
            "--job",
            &job,
            "--max-spend-usd",
            "0",
        ],
    ] {
        let mut argv = vec!["add", "--tenant", "acme", "--id", "daily"];
        argv.extend_from_slice(&args);
        assert_eq!(schedule_cli(&env, &argv).await, 64, "{args:?}");
    }
    let bad_tenant = [
        "add",
        "--tenant",
        "acme.x",
        "--cron",
        "0 9 * * *",
        "--job",
        &job,
    ];
    assert_eq!(schedule_cli(&env, &bad_tenant).await, 64);
    let js = async_nats::jetstream::new(env.client.clone());
    let bucket = schedules_bucket(&js, &env.subjects).await.unwrap();
    let keys: Vec<String> = bucket.keys().await.unwrap().try_collect().await.unwrap();
    assert!(keys.is_empty(), "{keys:?}");
    // A good one is stored with its next due time in its zone; the same id
    // again is refused unless replaced.
    let good = [
        "add",
        "--tenant",
        "acme",
        "--id",
        "daily",
        "--cron",
        "0 9 * * 1-5",
        "--tz",
        "Europe/Paris",
        "--job",
        &job,
        "--missed",
        "catch-up-one",
        "--max-tokens",
        "5000",
    ];
    assert_eq!(schedule_cli(&env, &good).await, 0);
    assert_eq!(schedule_cli(&env, &good).await, 64);
    let s = stored(&env, "acme", "daily").await.unwrap();
    assert_eq!(s.missed, MissedPolicy::CatchUpOne);
    assert_eq!(s.budget.unwrap().max_tokens, Some(5000));
    assert!(s.next_due > now_secs());
    assert_eq!(schedule_cli(&env, &["ls", "--tenant", "acme"]).await, 0);
    assert_eq!(
        schedule_cli(&env, &["rm", "--tenant", "acme", "--id", "nope"]).await,
        1
    );
    // Replaced, it keeps the runs it recorded (they may still run).
    let mut with_run = s.clone();
    with_run
        .runs
        .push(ScheduledRun::new(&s, now_secs(), now_ms()));
    put(&env, &with_run).await;
    let mut replaced = good.to_vec();
    replaced[6] = "30 8 * * 1-5";
    replaced.push("--replace");
    assert_eq!(schedule_cli(&env, &replaced).await, 0);
    let after = stored(&env, "acme", "daily").await.unwrap();
    assert_eq!(after.cron, "30 8 * * 1-5");
    assert_eq!(after.runs, with_run.runs);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn not_before_delays_a_job_and_one_too_far_ahead_is_refused() {
    let env = Env::start_with(script(), Options::default()).await;
    let not_before_ms = (SystemTime::now() + Duration::from_secs(3))
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let not_before = rfc3339(not_before_ms);
    let mut job = toolfleet_protocol::client::question("Remind me later.");
    job.tenant = Some("acme".into());
    job.not_before = Some(not_before.clone());
    // Less than the wait: its time counts from its notBefore, not from its
    // submission.
    job.timeout_ms = Some(2000);
    let mut events = env.follow_and_submit(&job).await;
    // Its followers hear at once that it is scheduled ...
    let scheduled = support::next_json(&mut events).await;
    assert_eq!(scheduled["type"], "scheduled", "{scheduled}");
    assert_eq!(scheduled["seq"], 0);
    assert_eq!(scheduled["notBefore"], not_before.as_str());
    // ... and it starts no earlier than its time, numbered on from there.
    let started = support::next_json(&mut events).await;
    let started_at = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis();
    assert!(
        started_at >= not_before_ms,
        "the job started before its notBefore {not_before}: {started}"
    );
    assert_eq!(started["type"], "started", "{started}");
    assert_eq!(started["seq"], 1);
    let rest = events_until_terminal(&mut events).await;
    assert_eq!(rest.last().unwrap()["type"], "completed", "{rest:?}");

    // Thirty days ahead is more than the fleet's week.
    let far_ms = (SystemTime::now() + Duration::from_secs(30 * 24 * 3600))
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let mut far = toolfleet_protocol::client::question("Remind me next month.");
    far.tenant = Some("acme".into());
    far.not_before = Some(rfc3339(far_ms));
    let mut events = env.follow_and_submit(&far).await;
    let end = tokio::time::timeout(WAIT, events_until_terminal(&mut events))
        .await
        .expect("refused at once");
    let end = end.last().unwrap();
    assert_eq!(end["type"], "error");
    assert_eq!(end["code"], "malformed_job", "{end}");
    assert!(
        end["message"]
            .as_str()
            .unwrap()
            .contains("--max-not-before"),
        "{end}"
    );
    // Not a time at all.
    let mut bad = toolfleet_protocol::client::question("Whenever.");
    bad.not_before = Some("tomorrow morning".into());
    let mut events = env.follow_and_submit(&bad).await;
    let end = tokio::time::timeout(WAIT, events_until_terminal(&mut events))
        .await
        .expect("refused at once");
    assert!(
        end.last().unwrap()["message"]
            .as_str()
            .unwrap()
            .contains("RFC 3339"),
        "{end:?}"
    );
}

/// `ms` (unix ms) as RFC 3339 UTC.
fn rfc3339(ms: u128) -> String {
    time::OffsetDateTime::from_unix_timestamp_nanos(i128::try_from(ms).unwrap() * 1_000_000)
        .unwrap()
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap()
}

use support::identities::{connect_as, password as auth_password, secure_nats};

/// A fleet under the shipped `ops/nats/auth.conf` identities: NATS,
/// Redis, the scripted model (answering [`script`]) and an orchestrator
/// under its own role (stopped when the returned guard drops); its
/// metrics.
struct SecureFleet {
    nats: toolfleet_local::servers::NatsServer,
    _redis: toolfleet_local::servers::RedisServer,
    _model: toolfleet_scripted::ScriptedServer,
    subjects: toolfleet_protocol::Subjects,
    registry: prometheus::Registry,
    _stop: tokio_util::sync::DropGuard,
}

async fn secure_fleet(script: Value) -> SecureFleet {
    let nats = secure_nats();
    let redis = toolfleet_local::servers::RedisServer::start().expect("redis-server");
    let model = toolfleet_scripted::ScriptedServer::start(
        "127.0.0.1:0".parse().unwrap(),
        toolfleet_scripted::Script::from_json(&script.to_string()).unwrap(),
    )
    .await
    .unwrap();
    let subjects = toolfleet_protocol::Subjects::new("toolfleet").unwrap();
    // The orchestrator under its own identity.
    let profiles = toolfleet_config::FleetConfig::single(
        toolfleet_llm::deployments::Deployment::new(model.base_url(), "toolfleet-scripted")
            .with_api_key("sk-test".to_string()),
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
        "toolfleet",
        Duration::from_secs(600),
    )
    .await
    .unwrap();
    let shutdown = CancellationToken::new();
    let stop = shutdown.clone().drop_guard();
    let orchestrator = toolfleet_orchestrator::Ready::open(
        connect_as(&nats, "orchestrator").await,
        store,
        config,
        metrics,
        shutdown,
    )
    .await
    .expect("the orchestrator starts under its role");
    tokio::spawn(orchestrator.run());
    SecureFleet {
        nats,
        _redis: redis,
        _model: model,
        subjects,
        registry,
        _stop: stop,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schedules_only_the_operator_schedules_and_the_orchestrator_role_fires_them() {
    let fleet = secure_fleet(script()).await;
    let (nats, subjects, registry) = (&fleet.nats, &fleet.subjects, &fleet.registry);

    // A tenant's client cannot write (or make) the schedules bucket.
    let acme = connect_as(nats, "client-acme").await;
    let mut acme_js = async_nats::jetstream::new(acme.clone());
    // Refused requests go unanswered: do not wait the default 5 s each.
    acme_js.set_timeout(Duration::from_secs(1));
    let forged = overdue("forged", MissedPolicy::CatchUpOne);
    let wrote = tokio::time::timeout(
        Duration::from_secs(2),
        acme_js.publish(
            "$KV.TOOLFLEET_SCHEDULES.acme.forged",
            serde_json::to_vec(&forged).unwrap().into(),
        ),
    )
    .await;
    let stored_by_acme = match wrote {
        Ok(Ok(ack)) => tokio::time::timeout(Duration::from_secs(2), ack)
            .await
            .is_ok_and(|a| a.is_ok()),
        _ => false,
    };
    assert!(!stored_by_acme, "a tenant stored a schedule");
    assert!(
        schedules_bucket(&acme_js, subjects).await.is_err(),
        "a tenant opened the schedules bucket"
    );

    // The operator schedules a job for acme; the orchestrator role fires
    // it on acme's subject and it runs as acme's.
    let dir = tempfile::tempdir().unwrap();
    let job = job_file(&dir);
    let url = nats.url();
    let password = auth_password("operator");
    let argv = [
        "toolfleet",
        "schedule",
        "add",
        "--tenant",
        "acme",
        "--id",
        "nightly",
        "--cron",
        "* * * * * *",
        "--job",
        &job,
        "--nats-url",
        &url,
        "--nats-user",
        "operator",
        "--nats-password",
        &password,
        "--nats-inbox-prefix",
        "_INBOX.operator",
    ];
    let mut events = acme
        .subscribe(subjects.chat_events_of("acme"))
        .await
        .unwrap();
    acme.flush().await.unwrap();
    let cli = toolfleet::cli::Cli::try_parse_from(argv).unwrap();
    assert_eq!(toolfleet::cli::run(cli).await.unwrap(), 0);
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let msg = tokio::time::timeout_at(deadline, events.next())
            .await
            .expect("a scheduled run answers on acme's events")
            .unwrap();
        let event: Value = serde_json::from_slice(&msg.payload).unwrap();
        if event["type"] == "completed" {
            let id = event["invocationId"].as_str().unwrap();
            assert!(id.starts_with("sched-nightly-"), "{event}");
            break;
        }
        assert_ne!(event["type"], "error", "{event}");
    }
    assert!(runs(registry, "submitted") >= 1);
    // The forged record never reached the bucket.
    let operator = connect_as(nats, "operator").await;
    let bucket = schedules_bucket(&async_nats::jetstream::new(operator), subjects)
        .await
        .unwrap();
    assert!(bucket.get("acme.forged").await.unwrap().is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schedules_a_runs_budget_ends_it_where_the_tenant_has_no_cap() {
    // Two rounds: a tool call, then the answer. The tenant has no per-run
    // cap; the schedule's budget of 1 token stops the run before its
    // second model call.
    let script = json!({
        "rules": [{
            "whenUserContains": ["time"],
            "steps": [
                { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
                { "answer": "It is {{tool:current_datetime}}." }
            ]
        }],
        "default": { "steps": [ { "answer": "no script" } ] }
    });
    let env = Env::start_only(script, &["system"]).await;
    let mut unbudgeted = toolfleet_protocol::client::question("What time is it?");
    unbudgeted.tenant = Some("acme".into());
    let mut events = env.follow_and_submit(&unbudgeted).await;
    let end = tokio::time::timeout(WAIT, events_until_terminal(&mut events))
        .await
        .unwrap();
    assert_eq!(end.last().unwrap()["type"], "completed", "{end:?}");

    let dir = tempfile::tempdir().unwrap();
    let job = dir.path().join("job.json");
    std::fs::write(
        &job,
        r#"{"messages": [{"role": "user", "content": "What time is it?"}]}"#,
    )
    .unwrap();
    let mut events = env.subscribe(env.subjects.chat_events_of("acme")).await;
    let args = [
        "add",
        "--tenant",
        "acme",
        "--id",
        "clock",
        "--cron",
        "* * * * * *",
        "--job",
        job.to_str().unwrap(),
        "--max-tokens",
        "1",
    ];
    assert_eq!(schedule_cli(&env, &args).await, 0);
    let deadline = tokio::time::Instant::now() + WAIT;
    let end = loop {
        let msg = tokio::time::timeout_at(deadline, events.next())
            .await
            .expect("a run ends")
            .unwrap();
        let event: Value = serde_json::from_slice(&msg.payload).unwrap();
        if event["type"] == "completed" || event["type"] == "error" {
            break event;
        }
    };
    assert_eq!(
        schedule_cli(&env, &["rm", "--tenant", "acme", "--id", "clock"]).await,
        0
    );
    assert!(
        end["invocationId"]
            .as_str()
            .unwrap()
            .starts_with("sched-clock-"),
        "{end}"
    );
    assert_eq!(end["code"], "run_limit_exceeded", "{end}");
    assert!(
        end["message"].as_str().unwrap().contains("max_run_tokens"),
        "{end}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn not_before_a_waiting_job_can_be_cancelled() {
    let env = Env::start_with(script(), Options::default()).await;
    let at = (SystemTime::now() + Duration::from_secs(3))
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let mut job = toolfleet_protocol::client::question("Remind me in a moment.");
    job.tenant = Some("acme".into());
    job.not_before = Some(rfc3339(at));
    let mut events = env.follow_and_submit(&job).await;
    // Taken and given back to wait: its id is claimed.
    let deadline = tokio::time::Instant::now() + WAIT;
    while env.keys(&job.invocation_id).await.is_empty() {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the job was never taken"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    toolfleet_protocol::client::cancel(&env.client, &env.subjects, "acme", &job.invocation_id)
        .await
        .unwrap();
    env.wait_for_cancel_written("acme", &job.invocation_id)
        .await;
    let end = tokio::time::timeout(WAIT, events_until_terminal(&mut events))
        .await
        .expect("the cancelled job ends at its time");
    let end = end.last().unwrap();
    assert_eq!(end["type"], "error", "{end}");
    assert_eq!(end["code"], "cancelled", "{end}");
    assert!(
        env.model.received().is_empty(),
        "a cancelled job never calls the model"
    );
}

/// A record of schedule `id` of acme firing every second from the next
/// second on, its runs asking the model `message`, at most `limit` at
/// once, holding `runs` already.
fn every_second(id: &str, message: &str, limit: u32, runs: Vec<ScheduledRun>) -> Schedule {
    Schedule {
        tenant: "acme".into(),
        id: id.into(),
        cron: "* * * * * *".into(),
        tz: "UTC".into(),
        job: serde_json::from_value(json!({
            "invocationId": "template",
            "messages": [{"role": "user", "content": message}]
        }))
        .unwrap(),
        missed: MissedPolicy::Skip,
        max_concurrent: limit,
        budget: None,
        paused: false,
        next_due: now_secs() + 1,
        runs,
        created_ms: 0,
    }
}

/// Stores `schedule` in the bucket, as the operator's `add` would.
async fn put(env: &Env, schedule: &Schedule) {
    let js = async_nats::jetstream::new(env.client.clone());
    let bucket = schedules_bucket(&js, &env.subjects).await.unwrap();
    bucket
        .put(schedule.key(), serde_json::to_vec(schedule).unwrap().into())
        .await
        .unwrap();
}

/// Removes acme's schedule `id`.
async fn remove(env: &Env, id: &str) {
    assert_eq!(
        schedule_cli(env, &["rm", "--tenant", "acme", "--id", id]).await,
        0
    );
}

fn now_ms() -> u64 {
    toolfleet_protocol::now_ms()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schedules_a_run_recorded_but_never_submitted_does_not_block_the_next() {
    let env = Env::start_with(script(), Options::default()).await;
    let mut submitted = Submitted::watch(&env, "acme").await;
    // What an orchestrator that died between its record and its
    // submission leaves: a run recorded three minutes ago, never
    // acknowledged by the stream, never claimed, with no event.
    let mut schedule = every_second("orphan", "Write the daily report.", 1, Vec::new());
    let mut orphan = ScheduledRun::new(&schedule, now_secs() - 180, now_ms() - 180_000);
    orphan.accepted_ms = None;
    schedule.runs.push(orphan.clone());
    put(&env, &schedule).await;
    // The next due time fires: the orphan counts as lost, not in flight.
    submitted.until(1).await;
    remove(&env, "orphan").await;
    assert!(
        submitted.ids()[0].starts_with("sched-orphan-"),
        "{:?}",
        submitted.ids()
    );
    assert_ne!(submitted.ids()[0], orphan.invocation_id);
    assert_eq!(runs(&env.metrics, "lost"), 1);
    assert_eq!(runs(&env.metrics, "skipped_busy"), 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schedules_a_limit_of_two_keeps_every_run_in_flight() {
    // Slow runs: ten seconds before the model's first token.
    let script = json!({
        "rules": [{
            "whenUserContains": ["slow"],
            "steps": [ { "answer": "Done, slowly.", "fault": { "kind": "slowFirstToken", "delayMs": 10000 } } ]
        }],
        "default": { "steps": [ { "answer": "The report is ready." } ] }
    });
    let env = Env::start_with(script, Options::default()).await;
    // Run A: in flight (taken, its model call under way), the oldest.
    let mut a = toolfleet_protocol::client::question("A slow report.");
    a.tenant = Some("acme".into());
    let mut a_events = env.follow_and_submit(&a).await;
    let started = support::next_json(&mut a_events).await;
    assert_eq!(started["type"], "started", "{started}");
    // Run B: newer, and ended (its terminal event stored).
    let b_id = "sched-pair-1-00000000000000000000000000000000";
    let store = env.store().await;
    store
        .finish(
            toolfleet_store::InvocationKey::new("acme", b_id),
            "1",
            br#"{"type":"completed"}"#,
        )
        .await
        .unwrap();
    let recorded = |id: &str| ScheduledRun {
        invocation_id: id.to_string(),
        due: now_secs() - 5,
        submitted_ms: now_ms() - 5000,
        accepted_ms: Some(now_ms() - 5000),
    };
    let mut submitted = Submitted::watch(&env, "acme").await;
    let schedule = every_second(
        "pair",
        "Another slow report.",
        2,
        vec![recorded(&a.invocation_id), recorded(b_id)],
    );
    put(&env, &schedule).await;
    // One run fits beside A; after it, A and it are two: every due time
    // is skipped while they run (forgetting A, the oldest, would let a
    // third in).
    submitted.until(1).await;
    submitted.collect_for(Duration::from_secs(4)).await;
    let record = stored(&env, "acme", "pair").await.unwrap();
    remove(&env, "pair").await;
    assert_eq!(submitted.seen.len(), 1, "{:?}", submitted.ids());
    let kept: Vec<&str> = record
        .runs
        .iter()
        .map(|r| r.invocation_id.as_str())
        .collect();
    assert_eq!(kept, [a.invocation_id.as_str(), submitted.ids()[0]]);
    assert!(runs(&env.metrics, "skipped_busy") >= 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schedules_a_tenant_cannot_take_or_cancel_a_future_run_by_its_id() {
    let fleet = secure_fleet(json!({
        "rules": [{
            "whenUserContains": ["impostor"],
            "steps": [ { "answer": "Not the report." } ]
        }],
        "default": { "steps": [ { "answer": "The report is ready." } ] }
    }))
    .await;
    let subjects = &fleet.subjects;
    // The tenant's own client (ops/nats/auth.conf's client-acme) takes
    // the ids the next due times would have had under a predictable
    // scheme, and cancels them in advance.
    let acme = connect_as(&fleet.nats, "client-acme").await;
    let first_due = now_secs() + 4;
    for due in first_due..first_due + 6 {
        let mut impostor = toolfleet_protocol::client::question("I am the impostor.");
        impostor.tenant = Some("acme".into());
        impostor.invocation_id = format!("sched-guarded-{due}");
        let mut events = acme
            .subscribe(subjects.chat_events("acme", &impostor.invocation_id))
            .await
            .unwrap();
        acme.flush().await.unwrap();
        toolfleet_protocol::client::submit(&acme, subjects, &impostor)
            .await
            .unwrap();
        let end = events_until_terminal(&mut events).await;
        assert_eq!(end.last().unwrap()["type"], "completed", "{end:?}");
        toolfleet_protocol::client::cancel(&acme, subjects, "acme", &impostor.invocation_id)
            .await
            .unwrap();
    }
    let mut events = acme
        .subscribe(subjects.chat_events_of("acme"))
        .await
        .unwrap();
    acme.flush().await.unwrap();
    // The operator schedules the job, from the predicted due time on.
    let mut schedule = every_second("guarded", "Write the daily report.", 1, Vec::new());
    schedule.next_due = first_due;
    let operator = connect_as(&fleet.nats, "operator").await;
    let bucket = schedules_bucket(&async_nats::jetstream::new(operator), subjects)
        .await
        .unwrap();
    bucket
        .put(
            schedule.key(),
            serde_json::to_vec(&schedule).unwrap().into(),
        )
        .await
        .unwrap();
    // Its first run is the schedule's: its own answer, not cancelled.
    let deadline = tokio::time::Instant::now() + WAIT;
    let end = loop {
        let msg = tokio::time::timeout_at(deadline, events.next())
            .await
            .expect("a scheduled run ends")
            .unwrap();
        let event: Value = serde_json::from_slice(&msg.payload).unwrap();
        let id = event["invocationId"].as_str().unwrap_or_default();
        if id.starts_with("sched-guarded-")
            && (event["type"] == "completed" || event["type"] == "error")
        {
            break event;
        }
    };
    bucket.delete(schedule.key()).await.unwrap();
    let run = end["invocationId"].as_str().unwrap();
    assert!(due_of(run, "guarded") >= first_due, "{end}");
    assert_eq!(end["type"], "completed", "{end}");
    assert_eq!(end["text"], "The report is ready.", "{end}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn not_before_past_the_chat_streams_day_is_refused_and_so_is_such_a_limit() {
    let env = Env::start_with(script(), Options::default()).await;
    // 23 h 30 min: under the old week, past 23 h less the job's timeout
    // (the stream would delete the job before it ran).
    let at = (SystemTime::now() + Duration::from_secs(23 * 3600 + 1800))
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis();
    let mut job = toolfleet_protocol::client::question("Remind me tomorrow.");
    job.tenant = Some("acme".into());
    job.not_before = Some(rfc3339(at));
    let mut events = env.follow_and_submit(&job).await;
    let end = tokio::time::timeout(WAIT, events_until_terminal(&mut events))
        .await
        .expect("refused at once");
    let end = end.last().unwrap();
    assert_eq!(end["code"], "malformed_job", "{end}");
    assert!(end["message"].as_str().unwrap().contains("a day"), "{end}");
    // An orchestrator configured to let jobs wait longer does not start.
    let profiles = toolfleet_config::FleetConfig::single(
        toolfleet_llm::deployments::Deployment::new(env.model.base_url(), "toolfleet-scripted")
            .with_api_key("sk-test".to_string()),
    );
    let mut config =
        toolfleet_orchestrator::OrchestratorConfig::new(env.subjects.clone(), profiles);
    config.max_not_before = Duration::from_secs(2 * 24 * 3600);
    let registry = prometheus::Registry::new();
    let metrics = toolfleet_orchestrator::metrics::OrchestratorMetrics::register(
        &registry,
        toolfleet_service::metrics::dead_letters(&registry).unwrap(),
    )
    .unwrap();
    let opened = toolfleet_orchestrator::Ready::open(
        env.client.clone(),
        env.store().await,
        config,
        metrics,
        CancellationToken::new(),
    )
    .await;
    let Err(e) = opened else {
        panic!("an orchestrator started with a two-day --max-not-before-secs")
    };
    assert!(
        e.to_string().contains("--max-not-before-secs 172800"),
        "{e}"
    );
}

/// Profiles with an agent tool (`research`, a nested chat job).
const AGENT_PROFILES: &str = r#"
[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"

[profiles.default]
deployment = "scripted"

[profiles.researcher]
deployment = "scripted"
agent = { name = "research", description = "Researches a question." }
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_jobs_budget_reaches_the_nested_job_of_its_agent_tool() {
    // The caller asks the agent; the agent's nested job needs two model
    // calls (a tool, then its answer). The tenant has no per-run cap.
    let script = json!({ "rules": [
        { "whenUserContains": ["TIME CHECK"], "steps": [
            { "toolCalls": [ { "name": "current_datetime", "arguments": {} } ] },
            { "answer": "It is {{tool:current_datetime}}." } ] },
        { "whenUserContains": ["what time"], "steps": [
            { "toolCalls": [ { "name": "research", "arguments": { "task": "TIME CHECK now" } } ] },
            { "answer": "{{tool:research}}" } ] }
    ] });
    let env = Env::start_with(
        script,
        Options {
            workers: vec!["system"],
            profiles_toml: Some(AGENT_PROFILES.to_string()),
            ..Default::default()
        },
    )
    .await;
    let mut all = env
        .subscribe(env.subjects.chat_events("default", "*"))
        .await;
    // One token: the caller's first model call is made, and spends it.
    let mut job = toolfleet_protocol::client::question("what time is it?");
    job.budget = Some(toolfleet_protocol::schedule::RunBudget {
        max_tokens: Some(1),
        max_spend_usd: None,
    });
    toolfleet_protocol::client::submit(&env.client, &env.subjects, &job)
        .await
        .unwrap();
    // The nested job runs under what its caller had left: it ends before
    // its second model call, as the caller would.
    let deadline = tokio::time::Instant::now() + WAIT;
    let nested_end = loop {
        let msg = tokio::time::timeout_at(deadline, all.next())
            .await
            .expect("the nested job ends")
            .unwrap();
        let event: Value = serde_json::from_slice(&msg.payload).unwrap();
        let terminal = event["type"] == "completed" || event["type"] == "error";
        if terminal && event["invocationId"] != job.invocation_id.as_str() {
            break event;
        }
    };
    assert_eq!(nested_end["type"], "error", "{nested_end}");
    assert_eq!(nested_end["code"], "run_limit_exceeded", "{nested_end}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn not_before_a_tenants_waiting_jobs_are_capped() {
    let env = Env::start_with(
        script(),
        Options {
            tweak: |c| c.max_delayed_jobs = 2,
            ..Default::default()
        },
    )
    .await;
    let later = rfc3339(
        (SystemTime::now() + Duration::from_secs(60))
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    );
    let delayed = |tenant: &str| {
        let mut job = toolfleet_protocol::client::question("Remind me in a minute.");
        job.tenant = Some(tenant.into());
        job.not_before = Some(later.clone());
        job
    };
    // Two of acme's wait; the third is refused at once, saying why.
    for _ in 0..2 {
        let mut events = env.follow_and_submit(&delayed("acme")).await;
        let first = support::next_json(&mut events).await;
        assert_eq!(first["type"], "scheduled", "{first}");
    }
    let mut events = env.follow_and_submit(&delayed("acme")).await;
    let end = tokio::time::timeout(WAIT, events_until_terminal(&mut events))
        .await
        .expect("refused at once");
    let end = end.last().unwrap();
    assert_eq!(end["type"], "error", "{end}");
    assert_eq!(end["code"], "queue_full", "{end}");
    assert!(
        end["message"]
            .as_str()
            .unwrap()
            .contains("--max-delayed-jobs"),
        "{end}"
    );
    // The cap is per tenant: globex's job waits.
    let mut events = env.follow_and_submit(&delayed("globex")).await;
    let first = support::next_json(&mut events).await;
    assert_eq!(first["type"], "scheduled", "{first}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn schedules_a_run_just_recorded_still_counts_in_flight() {
    let env = Env::start_with(script(), Options::default()).await;
    let mut submitted = Submitted::watch(&env, "acme").await;
    // Recorded ten seconds ago, not acknowledged yet, nothing seen of it:
    // within the two minutes' grace, it may still be on its way.
    let mut schedule = every_second("fresh", "Write the daily report.", 1, Vec::new());
    let fresh = ScheduledRun::new(&schedule, now_secs() - 10, now_ms() - 10_000);
    schedule.runs.push(fresh.clone());
    put(&env, &schedule).await;
    submitted.collect_for(Duration::from_secs(3)).await;
    let record = stored(&env, "acme", "fresh").await.unwrap();
    remove(&env, "fresh").await;
    assert!(submitted.seen.is_empty(), "{:?}", submitted.ids());
    assert!(runs(&env.metrics, "skipped_busy") >= 1);
    assert_eq!(runs(&env.metrics, "lost"), 0);
    assert_eq!(record.runs, [fresh]);
}
