//! `toolfleet bench --mode noisy`: what a noisy tenant costs a quiet one.
//!
//! One run on fresh servers (a `nats-server -js` and a `redis-server` of
//! its own, the scripted model with `--model-delay-ms`, an in-process
//! orchestrator with `--concurrency` jobs in flight). Tenant `globex` runs
//! `--count` chat jobs (4 at a time) in each phase, and its latencies are
//! reported against its phase alone:
//!
//! | phase | what acme does meanwhile |
//! |---|---|
//! | `alone` | nothing |
//! | `backlog` | 1,000 chat jobs queued just before |
//! | `poison` | 5 chat jobs a second whose headers no client can read |
//! | `cancels` | 100,000 cancels of invocations that do not exist |
//! | `alone_routed` / `slow_webhook` | globex's answers go to a webhook; acme's (200 jobs) to one that answers in 10 s |
//!
//! Then two flooding tenants with weights 2:1 (`hooli`, `initech`, 300 jobs
//! each): their shares of the first 90 jobs to end. Then the cost of
//! fairness with one tenant: the same jobs through fair dispatch and
//! through one shared FIFO (`--chat-dispatch fifo`, on a second subject
//! prefix of the same servers), in alternating rounds.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context as _;
use futures::StreamExt;
use tokio::io::AsyncWriteExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet_orchestrator::OrchestratorConfig;
use toolfleet_orchestrator::settings::ChatDispatch;
use toolfleet_protocol::{ChatJob, SinkRequest, Subjects};

use crate::bench::{Load, Op, Summary, drive, interleave, table};

/// What a run is asked for (from `toolfleet bench`'s flags).
#[derive(Debug, Clone)]
pub struct NoisyArgs {
    /// Globex's jobs per phase (`--count`, default 50).
    pub count: Option<usize>,
    /// Each orchestrator's jobs in flight (`--concurrency`).
    pub concurrency: usize,
    /// The scripted model's pause before every answer (`--model-delay-ms`).
    pub model_delay_ms: u64,
    /// How long one job may take (`--timeout-secs`).
    pub timeout_secs: u64,
    /// Print the report as JSON.
    pub json: bool,
}

/// Globex's jobs in flight at once.
const QUIET_CONCURRENCY: usize = 4;
/// Acme's queued jobs in the backlog phase.
const BACKLOG: usize = 1_000;
/// Acme's poisons a second.
const POISON_RATE: u64 = 5;
/// Acme's cancels for invocations that do not exist.
const CANCELS: usize = 100_000;
/// Acme's jobs routed to its slow webhook, and how slow it is.
const ROUTED: usize = 200;
const SLOW_WEBHOOK: Duration = Duration::from_secs(10);
/// Each flooding tenant's jobs in the weights phase, and the jobs whose
/// tenants are counted.
const FLOOD: usize = 300;
const SHARES_OF: usize = 90;
/// How long the other tenants have had no work before the one-tenant
/// comparison (fair dispatch counts a tenant active 2 s after its last
/// job waited).
const QUIET_BEFORE_ALONE: Duration = Duration::from_secs(3);

/// One phase's figures.
#[derive(Debug, serde::Serialize)]
struct Phase {
    name: &'static str,
    summary: Summary,
    /// p99 against the phase it is compared with (`alone`, or
    /// `alone_routed` for the slow webhook).
    p99_ratio: f64,
    p50_ratio: f64,
}

/// The run's report (`--json`).
#[derive(Debug, serde::Serialize)]
struct Report {
    model_delay_ms: u64,
    orchestrator_in_flight: usize,
    jobs_per_phase: usize,
    phases: Vec<Phase>,
    /// Hooli's and initech's jobs among the first `SHARES_OF` to end
    /// (weights 2 and 1), and hooli's share against its 2/3.
    weights: (usize, usize),
    weight_share_error: f64,
    fair: Summary,
    fifo: Summary,
    /// Fair against FIFO: throughput (ops/s) and p50.
    fairness_throughput_ratio: f64,
    fairness_p50_ratio: f64,
}

/// The webhooks: when each invocation's answer arrived.
#[derive(Clone, Default)]
struct Receiver {
    arrived: Arc<Mutex<HashMap<String, Instant>>>,
    notify: Arc<tokio::sync::Notify>,
}

impl Receiver {
    /// Serves `/fast` and `/slow` (answers after [`SLOW_WEBHOOK`]) on a
    /// free loopback port.
    async fn start(
        tracker: &TaskTracker,
        shutdown: CancellationToken,
    ) -> anyhow::Result<(String, Self)> {
        let receiver = Self::default();
        let fast = receiver.clone();
        let app = axum::Router::new()
            .route(
                "/fast",
                axum::routing::post(move |body: axum::body::Bytes| {
                    let r = fast.clone();
                    async move {
                        r.arrived_now(&body);
                        axum::http::StatusCode::NO_CONTENT
                    }
                }),
            )
            .route(
                "/slow",
                axum::routing::post(|| async {
                    tokio::time::sleep(SLOW_WEBHOOK).await;
                    axum::http::StatusCode::NO_CONTENT
                }),
            );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let url = format!("http://{}", listener.local_addr()?);
        tracker.spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(shutdown.cancelled_owned())
                .await;
        });
        Ok((url, receiver))
    }

    fn arrived_now(&self, body: &[u8]) {
        if let Ok(event) = serde_json::from_slice::<serde_json::Value>(body)
            && let Some(id) = event["invocationId"].as_str()
        {
            self.arrived
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(id.to_owned(), Instant::now());
            self.notify.notify_waiters();
        }
    }

    /// Waits until `id`'s answer reached the fast webhook.
    async fn wait_for(&self, id: &str, timeout: Duration) -> bool {
        tokio::time::timeout(timeout, async {
            loop {
                let notified = self.notify.notified();
                if self
                    .arrived
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .contains_key(id)
                {
                    return;
                }
                notified.await;
            }
        })
        .await
        .is_ok()
    }
}

/// The fleet under test: servers, model, a fair and a FIFO orchestrator.
struct Noisy {
    _nats: toolfleet_local::servers::NatsServer,
    _redis: toolfleet_local::servers::RedisServer,
    nats_url: String,
    client: async_nats::Client,
    subjects: Subjects,
    fifo_subjects: Subjects,
    webhooks: String,
    receiver: Receiver,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    timeout: Duration,
}

/// The profiles: the scripted model, weights 2:1 for the flooding pair.
fn fleet_config(model_url: &url::Url) -> anyhow::Result<toolfleet_config::FleetConfig> {
    let toml = format!(
        "[deployments.scripted]\nbase_url = \"{model_url}\"\nmodel = \"toolfleet-scripted\"\n\
         [profiles.default]\ndeployment = \"scripted\"\n\
         [tenants.hooli]\nweight = 2\n[tenants.initech]\nweight = 1\n"
    );
    Ok(toolfleet_config::FleetConfig::from_toml(&toml, "bench")?)
}

impl Noisy {
    async fn start(args: &NoisyArgs) -> anyhow::Result<Self> {
        let nats = toolfleet_local::servers::NatsServer::start()?;
        let redis = toolfleet_local::servers::RedisServer::start()?;
        let script = serde_json::json!({
            "firstTokenDelayMs": args.model_delay_ms,
            "default": { "steps": [ { "answer": "Done." } ] }
        });
        let model = toolfleet_scripted::ScriptedServer::start(
            "127.0.0.1:0".parse()?,
            toolfleet_scripted::Script::from_json(&script.to_string())?,
        )
        .await?;
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let (webhooks, receiver) = Receiver::start(&tracker, shutdown.clone()).await?;
        let subjects = Subjects::new(toolfleet_protocol::DEFAULT_PREFIX)?;
        let fifo_subjects = Subjects::new("fifo")?;
        for (subjects, dispatch) in [
            (&subjects, ChatDispatch::Fair),
            (&fifo_subjects, ChatDispatch::Fifo),
        ] {
            let mut config =
                OrchestratorConfig::new(subjects.clone(), fleet_config(&model.base_url())?);
            config.max_in_flight = args.concurrency;
            config.chat_dispatch = dispatch;
            config.env = Arc::new(HashMap::from([(
                toolfleet_orchestrator::sinks::DEFAULT_SECRET_ENV.to_owned(),
                // A Standard Webhooks secret (the receiver does not check it).
                "whsec_dG9vbGZsZWV0IGJlbmNoIG5vaXN5IHdlYmhvb2tzISE=".to_owned(),
            )]));
            let sinks = &mut config.sinks;
            sinks.allow_http = true;
            sinks.job_exceptions = true;
            sinks.policy = toolfleet_orchestrator::sinks::sink_policy(
                Vec::new(),
                vec!["127.0.0.0/8".parse()?],
            );
            sinks.request_timeout = SLOW_WEBHOOK + Duration::from_secs(5);
            let spec = toolfleet_local::fleet::FleetSpec {
                nats_url: nats.url(),
                redis_url: redis.url(),
                subjects: subjects.clone(),
                citation_ttl: Duration::from_secs(3600),
                orchestrator: Some(config),
                workers: Vec::new(),
                worker_concurrency: 1,
                nats_connect_wait: Duration::from_secs(10),
                nats: None,
                redis: None,
            };
            toolfleet_local::fleet::start(
                spec,
                &prometheus::Registry::new(),
                &tracker,
                shutdown.clone(),
            )
            .await?;
        }
        // The model lives as long as the run.
        tracker.spawn({
            let shutdown = shutdown.clone();
            async move {
                shutdown.cancelled().await;
                drop(model);
            }
        });
        let client = async_nats::connect(nats.url()).await?;
        Ok(Self {
            nats_url: nats.url(),
            _nats: nats,
            _redis: redis,
            client,
            subjects,
            fifo_subjects,
            webhooks,
            receiver,
            shutdown,
            tracker,
            timeout: Duration::from_secs(args.timeout_secs),
        })
    }

    /// Chat jobs of `tenant` on `subjects`, each waited for (and, with a
    /// `webhook`, until its answer reached it).
    fn jobs(&self, tenant: &'static str, subjects: &Subjects, webhook: Option<&str>) -> Op {
        let (client, subjects, timeout) = (self.client.clone(), subjects.clone(), self.timeout);
        let receiver = self.receiver.clone();
        let webhook = webhook.map(|w| format!("{}{w}", self.webhooks));
        Arc::new(move |i| {
            let (client, subjects, webhook) = (client.clone(), subjects.clone(), webhook.clone());
            let receiver = receiver.clone();
            Box::pin(async move {
                let job = job(tenant, i, webhook);
                let answered =
                    toolfleet_protocol::client::chat(&client, &subjects, &job, timeout, |_| {})
                        .await;
                match answered {
                    Ok(_) if job.sink.is_none() => Ok(0),
                    Ok(_) => {
                        if receiver.wait_for(&job.invocation_id, timeout).await {
                            Ok(0)
                        } else {
                            Err("webhook_timeout".into())
                        }
                    }
                    Err(e) => Err(e.code().to_string()),
                }
            })
        })
    }

    /// Submits `n` jobs of `tenant` without waiting for them.
    async fn queue(
        &self,
        tenant: &'static str,
        n: usize,
        webhook: Option<&str>,
    ) -> anyhow::Result<()> {
        let webhook = webhook.map(|w| format!("{}{w}", self.webhooks));
        for i in 0..n {
            let job = job(tenant, i, webhook.clone());
            toolfleet_protocol::client::submit(&self.client, &self.subjects, &job).await?;
        }
        Ok(())
    }

    /// Removes `tenant`'s jobs still queued, and waits until none of its
    /// jobs is stored (those running have ended).
    async fn purge(&self, tenant: &str) -> anyhow::Result<()> {
        let js = async_nats::jetstream::new(self.client.clone());
        let stream = js.get_stream(self.subjects.chat_stream()).await?;
        for subject in [
            self.subjects.chat_submit(tenant),
            self.subjects.chat_batch(tenant),
        ] {
            stream.purge().filter(subject).await?;
        }
        let deadline = Instant::now() + self.timeout;
        loop {
            let mut counts = stream
                .info_with_subjects(self.subjects.chat_submit(tenant))
                .await?;
            let mut stored = 0;
            while let Some(Ok((_, n))) = counts.next().await {
                stored += n;
            }
            if stored == 0 || Instant::now() > deadline {
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    async fn stop(self) {
        self.shutdown.cancel();
        self.tracker.close();
        let _ = tokio::time::timeout(Duration::from_secs(15), self.tracker.wait()).await;
    }
}

/// Chat job `i` of `tenant`, routed to `webhook` when given.
fn job(tenant: &str, i: usize, webhook: Option<String>) -> ChatJob {
    let mut job = toolfleet_protocol::client::question(&format!("{tenant} question {i}"));
    job.tenant = Some(tenant.to_owned());
    job.sink = webhook.map(|url| SinkRequest {
        webhook: Some(url),
        relay: None,
        events: None,
    });
    job
}

/// Acme's poison trickle: chat jobs whose header block no client can read
/// (a line without `:`), published raw, [`POISON_RATE`] a second until
/// `stop`.
async fn poison_trickle(
    nats_url: String,
    subject: String,
    stop: CancellationToken,
) -> anyhow::Result<u64> {
    let addr = nats_url.trim_start_matches("nats://");
    let mut conn = tokio::net::TcpStream::connect(addr).await?;
    conn.write_all(b"CONNECT {\"verbose\":false,\"pedantic\":false,\"headers\":true}\r\n")
        .await?;
    let headers = "NATS/1.0\r\nThis line has no colon\r\n\r\n";
    let payload = "{\"invocationId\":\"poison\",\"messages\":[]}";
    let mut sent = 0;
    let mut tick = tokio::time::interval(Duration::from_millis(1000 / POISON_RATE));
    while !stop.is_cancelled() {
        tokio::select! {
            () = stop.cancelled() => break,
            _ = tick.tick() => {}
        }
        let frame = format!(
            "HPUB {subject} {} {}\r\n{headers}{payload}\r\n",
            headers.len(),
            headers.len() + payload.len()
        );
        conn.write_all(frame.as_bytes()).await?;
        sent += 1;
    }
    Ok(sent)
}

/// Acme's cancel flood: [`CANCELS`] cancels of ids nobody submitted.
async fn cancel_flood(client: async_nats::Client, subjects: Subjects) -> anyhow::Result<()> {
    for i in 0..CANCELS {
        client
            .publish(
                subjects.chat_cancel("acme", &format!("nobody-{i}")),
                bytes::Bytes::new(),
            )
            .await?;
    }
    client.flush().await?;
    Ok(())
}

/// Runs the noisy-neighbour benchmark (see the module docs); exit 0 when
/// every globex job succeeded.
pub async fn run(args: &NoisyArgs) -> anyhow::Result<i32> {
    toolfleet_service::serve::raise_fd_limit();
    let jobs = args.count.unwrap_or(50);
    let fleet = Noisy::start(args).await.context("starting the fleet")?;
    let phases = attacks(&fleet, jobs).await?;

    eprintln!("• hooli (weight 2) and initech (weight 1) flood {FLOOD} jobs each");
    let weights = shares(&fleet).await?;
    fleet.purge("hooli").await?;
    fleet.purge("initech").await?;

    let (fair, fifo) = cost_of_fairness(&fleet, args.concurrency, jobs).await?;
    let (a, i) = weights;
    let report = Report {
        model_delay_ms: args.model_delay_ms,
        orchestrator_in_flight: args.concurrency,
        jobs_per_phase: jobs,
        weight_share_error: (a as f64 / (a + i).max(1) as f64 - 2.0 / 3.0).abs() / (2.0 / 3.0),
        weights,
        fairness_throughput_ratio: fair.ops_per_sec / fifo.ops_per_sec.max(f64::EPSILON),
        fairness_p50_ratio: fair.latency_ms.p50 / fifo.latency_ms.p50.max(f64::EPSILON),
        fair,
        fifo,
        phases,
    };
    fleet.stop().await;
    print(&report, args.json)?;
    let failed = report.phases.iter().any(|p| p.summary.errors > 0)
        || report.fair.errors > 0
        || report.fifo.errors > 0;
    Ok(i32::from(failed))
}

/// Globex's `jobs` alone, then beside each of acme's attacks; each phase
/// against the one it is compared with.
async fn attacks(fleet: &Noisy, jobs: usize) -> anyhow::Result<Vec<Phase>> {
    let quiet = Load {
        concurrency: QUIET_CONCURRENCY,
        count: Some(jobs),
        duration: None,
    };
    let globex = fleet.jobs("globex", &fleet.subjects, None);
    // Warm up: connections, consumers, caches.
    drive("warm-up", &quiet.warm_up(), globex.clone()).await;
    eprintln!("• alone");
    let alone = drive("alone", &quiet, globex.clone()).await;

    eprintln!("• acme queues {BACKLOG} jobs");
    fleet.queue("acme", BACKLOG, None).await?;
    let backlog = drive("backlog", &quiet, globex.clone()).await;
    fleet.purge("acme").await?;

    eprintln!("• acme sends {POISON_RATE} poisons a second");
    let stop = CancellationToken::new();
    let trickle = tokio::spawn(poison_trickle(
        fleet.nats_url.clone(),
        fleet.subjects.chat_submit("acme"),
        stop.clone(),
    ));
    let poison = drive("poison", &quiet, globex.clone()).await;
    stop.cancel();
    let poisons = trickle.await??;
    eprintln!("  ({poisons} poisons sent)");

    eprintln!("• acme floods {CANCELS} cancels");
    let flood = tokio::spawn(cancel_flood(fleet.client.clone(), fleet.subjects.clone()));
    let cancels = drive("cancels", &quiet, globex).await;
    flood.await??;

    eprintln!("• globex's answers routed to a webhook; then acme's to one that takes 10 s");
    let routed = fleet.jobs("globex", &fleet.subjects, Some("/fast"));
    let alone_routed = drive("alone_routed", &quiet, routed.clone()).await;
    fleet.queue("acme", ROUTED, Some("/slow")).await?;
    let slow_webhook = drive("slow_webhook", &quiet, routed).await;
    fleet.purge("acme").await?;

    let mut phases = Vec::new();
    for (name, summary, base) in [
        ("alone", alone.clone(), &alone),
        ("backlog", backlog, &alone),
        ("poison", poison, &alone),
        ("cancels", cancels, &alone),
        ("alone_routed", alone_routed.clone(), &alone_routed),
        ("slow_webhook", slow_webhook, &alone_routed),
    ] {
        phases.push(Phase {
            name,
            p99_ratio: summary.latency_ms.p99 / base.latency_ms.p99.max(f64::EPSILON),
            p50_ratio: summary.latency_ms.p50 / base.latency_ms.p50.max(f64::EPSILON),
            summary,
        });
    }
    Ok(phases)
}

/// One tenant's jobs through fair dispatch and through one FIFO, in
/// alternating rounds at `in_flight` (the orchestrators' slots).
async fn cost_of_fairness(
    fleet: &Noisy,
    in_flight: usize,
    jobs: usize,
) -> anyhow::Result<(Summary, Summary)> {
    eprintln!("• one tenant: fair dispatch against one FIFO, alternating rounds");
    // The other tenants quiet: none has work waiting any more.
    tokio::time::sleep(QUIET_BEFORE_ALONE).await;
    let saturating = Load {
        concurrency: in_flight,
        count: Some(jobs * 4),
        duration: None,
    };
    let sides = [
        (
            "fair".to_owned(),
            fleet.jobs("globex", &fleet.subjects, None),
        ),
        (
            "fifo".to_owned(),
            fleet.jobs("globex", &fleet.fifo_subjects, None),
        ),
    ];
    for (_, side) in &sides {
        drive("warm-up", &saturating.warm_up(), side.clone()).await;
    }
    let mut compared = interleave(&saturating, &sides, 4).await.into_iter();
    Ok((
        compared.next().context("fair")?,
        compared.next().context("fifo")?,
    ))
}

/// Hooli's and initech's jobs among the first [`SHARES_OF`] to end while
/// both flood.
async fn shares(fleet: &Noisy) -> anyhow::Result<(usize, usize)> {
    let mut endings = fleet
        .client
        .subscribe(format!("{}.chat.events.>", fleet.subjects.prefix()))
        .await?;
    fleet.client.flush().await?;
    // Interleaved, so neither is ahead in the stream.
    for i in 0..FLOOD {
        for tenant in ["hooli", "initech"] {
            let job = job(tenant, i, None);
            toolfleet_protocol::client::submit(&fleet.client, &fleet.subjects, &job).await?;
        }
    }
    let (mut acme, mut initech) = (0, 0);
    let counted = tokio::time::timeout(fleet.timeout * 4, async {
        while acme + initech < SHARES_OF {
            let Some(msg) = endings.next().await else {
                break;
            };
            let ended = serde_json::from_slice::<serde_json::Value>(&msg.payload)
                .is_ok_and(|e| e["type"] == "completed" || e["type"] == "error");
            match msg.subject.split('.').nth(3) {
                Some("hooli") if ended => acme += 1,
                Some("initech") if ended => initech += 1,
                _ => {}
            }
        }
    })
    .await;
    if counted.is_err() {
        eprintln!("  (only {} jobs ended in time)", acme + initech);
    }
    Ok((acme, initech))
}

fn print(r: &Report, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(r)?);
        return Ok(());
    }
    println!(
        "toolfleet bench --mode noisy: model delay {} ms, {} jobs in flight per orchestrator, globex {} jobs ({} at a time) per phase\n",
        r.model_delay_ms, r.orchestrator_in_flight, r.jobs_per_phase, QUIET_CONCURRENCY
    );
    let rows: Vec<&Summary> = r.phases.iter().map(|p| &p.summary).collect();
    println!("{}", table(&rows));
    for p in &r.phases {
        println!(
            "{:<14} p50 {:>5.2}×  p99 {:>5.2}×  (of {})",
            p.name,
            p.p50_ratio,
            p.p99_ratio,
            if p.name == "slow_webhook" || p.name == "alone_routed" {
                "alone_routed"
            } else {
                "alone"
            }
        );
    }
    println!(
        "\nweights 2:1 flooding: hooli {} · initech {} of the first {SHARES_OF} (hooli's share off its 2/3 by {:.1} %)",
        r.weights.0,
        r.weights.1,
        r.weight_share_error * 100.0
    );
    println!("\n{}", table(&[&r.fair, &r.fifo]));
    println!(
        "cost of fairness, one tenant: throughput {:.3}× FIFO's, p50 {:.3}× FIFO's",
        r.fairness_throughput_ratio, r.fairness_p50_ratio
    );
    Ok(())
}
