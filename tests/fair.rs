//! Fair dispatch (issue 29): chat jobs are taken from the tenants in
//! weighted turns, so one tenant's backlog delays only that tenant — with
//! one orchestrator or several. Real NATS and Redis, in-process
//! orchestrators, the scripted model (the stand-in for the provider).
//! Shares and orders are asserted, never times.

use std::time::Duration;

use futures::StreamExt;
use toolfleet_local::servers::{NatsServer, RedisServer};
use toolfleet_protocol::{ChatJob, Priority, Subjects};

use toolfleet_orchestrator::settings::DEFAULT_BATCH_MAX_WAIT;

use crate::support::WAIT;

/// The servers, the scripted model and a client, with no orchestrator
/// yet: a test queues jobs first, then starts orchestrators.
pub(crate) struct Bench {
    pub(crate) nats: NatsServer,
    pub(crate) redis: RedisServer,
    pub(crate) model: toolfleet_scripted::ScriptedServer,
    pub(crate) client: async_nats::Client,
    pub(crate) subjects: Subjects,
    pub(crate) runtimes: Vec<toolfleet_service::Runtime>,
}

impl Bench {
    /// The servers, and a model that answers every question after
    /// `delay_ms`.
    pub(crate) async fn start(delay_ms: u64) -> Self {
        Self::with_script(serde_json::json!({
            "firstTokenDelayMs": delay_ms,
            "default": { "steps": [ { "answer": "done" } ] }
        }))
        .await
    }

    /// The servers, and a model playing `script`.
    pub(crate) async fn with_script(script: serde_json::Value) -> Self {
        let nats = NatsServer::start().unwrap();
        let redis = RedisServer::start().unwrap();
        let model = toolfleet_scripted::ScriptedServer::start(
            "127.0.0.1:0".parse().unwrap(),
            toolfleet_scripted::Script::from_json(&script.to_string()).unwrap(),
        )
        .await
        .unwrap();
        let client = async_nats::connect(nats.url()).await.unwrap();
        let subjects = Subjects::new("toolfleet").unwrap();
        // The stream exists before any orchestrator, so jobs can queue.
        toolfleet_protocol::streams::ensure_chat_stream(
            &async_nats::jetstream::new(client.clone()),
            &subjects,
        )
        .await
        .unwrap();
        Self {
            nats,
            redis,
            model,
            client,
            subjects,
            runtimes: Vec::new(),
        }
    }

    /// Starts an orchestrator taking `max_in_flight` jobs at once, with
    /// `tenants` (TOML `[tenants.*]` tables, or more deployments and
    /// profiles) in its configuration.
    pub(crate) async fn orchestrator(&mut self, max_in_flight: usize, tenants: &str) {
        self.orchestrator_with(max_in_flight, tenants, DEFAULT_BATCH_MAX_WAIT)
            .await;
    }

    /// The same, with batch jobs waiting at most `batch_max_wait` behind
    /// interactive ones.
    async fn orchestrator_with(
        &mut self,
        max_in_flight: usize,
        tenants: &str,
        batch_max_wait: Duration,
    ) {
        let toml = format!(
            "[deployments.scripted]\nbase_url = \"{}\"\nmodel = \"toolfleet-scripted\"\n\
             [profiles.default]\ndeployment = \"scripted\"\n{tenants}",
            self.model.base_url()
        );
        let profiles = toolfleet_config::FleetConfig::from_toml(&toml, "fair test").unwrap();
        let mut config =
            toolfleet_orchestrator::OrchestratorConfig::new(self.subjects.clone(), profiles);
        config.max_in_flight = max_in_flight;
        config.batch_max_wait = batch_max_wait;
        let rt =
            crate::support::start_orchestrator(self.nats.url(), self.redis.url(), config).await;
        self.runtimes.push(rt);
    }

    /// Queues `n` interactive jobs of `tenant` (the submit returns once
    /// each is stored).
    pub(crate) async fn queue(&self, tenant: &str, n: usize) {
        self.queue_as(tenant, n, Priority::Interactive).await;
    }

    /// Every terminal event, from now on: the tenant of each, in the
    /// order they are published.
    pub(crate) async fn endings(&self) -> Endings {
        let sub = self
            .client
            .subscribe(format!("{}.chat.events.>", self.subjects.prefix()))
            .await
            .unwrap();
        self.client.flush().await.unwrap();
        Endings { sub }
    }

    /// Stops the orchestrators without waiting for the jobs they hold
    /// (one waiting for a later minute).
    pub(crate) fn abandon(self) {
        for rt in self.runtimes {
            rt.shutdown.cancel();
        }
    }

    pub(crate) async fn stop(self) {
        for rt in self.runtimes {
            assert!(rt.drain(Duration::from_secs(10)).await);
        }
    }
}

pub(crate) struct Endings {
    sub: async_nats::Subscriber,
}

impl Endings {
    /// The `(tenant, invocation id)` of the next `n` invocations to end,
    /// in order (each must complete).
    async fn next_ended(&mut self, n: usize) -> Vec<(String, String)> {
        let mut ended = Vec::new();
        tokio::time::timeout(WAIT * 2, async {
            while ended.len() < n {
                let msg = self.sub.next().await.expect("events");
                let event: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap();
                if event["type"] != "completed" && event["type"] != "error" {
                    continue;
                }
                assert_eq!(event["type"], "completed", "{event}");
                // `<p>.chat.events.<tenant>.<id>`
                let mut tokens = msg.subject.split('.').skip(3);
                let tenant = tokens.next().unwrap().to_string();
                ended.push((tenant, tokens.next().unwrap().to_string()));
            }
        })
        .await
        .unwrap_or_else(|_| panic!("only {} of {n} jobs ended", ended.len()));
        ended
    }

    /// The tenants of the next `n` invocations to end, in order.
    pub(crate) async fn next(&mut self, n: usize) -> Vec<String> {
        self.next_ended(n).await.into_iter().map(|e| e.0).collect()
    }

    /// The invocation ids of the next `n` invocations to end, in order.
    pub(crate) async fn next_ids(&mut self, n: usize) -> Vec<String> {
        self.next_ended(n).await.into_iter().map(|e| e.1).collect()
    }
}

fn count(tenants: &[String], tenant: &str) -> usize {
    tenants.iter().filter(|t| *t == tenant).count()
}

/// Acme queues a backlog behind a slow model; globex submits one job once
/// acme's first has ended. Globex's job ends long before acme's backlog
/// is drained (on the shared FIFO of before it ended last, behind all of
/// acme's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_backlog_does_not_delay_another_tenant() {
    let mut bench = Bench::start(200).await;
    let mut endings = bench.endings().await;
    bench.queue("acme", 24).await;
    bench.orchestrator(2, "").await;
    assert_eq!(endings.next(1).await, ["acme"]);
    bench.queue("globex", 1).await;
    let order = endings.next(23).await;
    let globex_at = order
        .iter()
        .position(|t| t == "globex")
        .expect("globex's job ended");
    // Two acme jobs run when globex's arrives; it takes the next free
    // slot but one at worst (acme may win a tie).
    assert!(
        globex_at <= 5,
        "globex's job ended after {globex_at} more of acme's: {order:?}"
    );
    assert_eq!(count(&order, "acme"), 22);
    bench.stop().await;
}

/// Two tenants flooding, weights 2:1, one job at a time: the jobs start
/// (and end) two of acme's for one of globex's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn weights_give_flooding_tenants_their_shares() {
    let mut bench = Bench::start(0).await;
    let mut endings = bench.endings().await;
    bench.queue("acme", 40).await;
    bench.queue("globex", 40).await;
    bench
        .orchestrator(
            1,
            "[tenants.acme]\nweight = 2\n[tenants.globex]\nweight = 1\n",
        )
        .await;
    let order = endings.next(30).await;
    let (acme, globex) = (count(&order, "acme"), count(&order, "globex"));
    // Exactly 20:10 with one orchestrator taking one job at a time; a
    // little slack for a tie broken the other way.
    assert!(
        (18..=22).contains(&acme) && acme + globex == 30,
        "acme {acme}, globex {globex}: {order:?}"
    );
    bench.stop().await;
}

/// Two orchestrators, each taking its own turns from the tenants'
/// shared consumers: together they still take both tenants' jobs in turn
/// (on the shared FIFO of before, acme's whole backlog came first).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_orchestrators_together_take_tenants_in_turn() {
    let mut bench = Bench::start(20).await;
    let mut endings = bench.endings().await;
    bench.queue("acme", 30).await;
    bench.queue("globex", 30).await;
    bench.orchestrator(1, "").await;
    bench.orchestrator(1, "").await;
    let order = endings.next(20).await;
    let (acme, globex) = (count(&order, "acme"), count(&order, "globex"));
    assert!(
        (6..=14).contains(&globex) && acme + globex == 20,
        "acme {acme}, globex {globex}: {order:?}"
    );
    bench.stop().await;
}

/// A running fleet of the release before fair dispatch: one unfiltered
/// `orchestrators` consumer shared by every tenant, one job delivered by
/// it and never acked (its orchestrator was stopped for the upgrade), one
/// still queued. The first orchestrator of this release removes the
/// shared consumer (the per-tenant ones could not exist beside it) and
/// runs both jobs from the tenant's own consumer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_consumer_of_a_running_fleet_gives_way_and_loses_no_job() {
    use async_nats::jetstream::consumer::{AckPolicy, PullConsumer, pull};
    let mut bench = Bench::start(0).await;
    let js = async_nats::jetstream::new(bench.client.clone());
    let stream = js.get_stream(bench.subjects.chat_stream()).await.unwrap();
    let old: PullConsumer = stream
        .create_consumer(pull::Config {
            durable_name: Some(bench.subjects.chat_consumer()),
            ack_policy: AckPolicy::Explicit,
            ack_wait: Duration::from_secs(10),
            max_deliver: 4,
            max_ack_pending: 10_000,
            ..Default::default()
        })
        .await
        .unwrap();
    let mut endings = bench.endings().await;
    bench.queue("acme", 2).await;
    let mut taken = old.fetch().max_messages(1).messages().await.unwrap();
    let held = taken.next().await.unwrap().unwrap();
    assert_eq!(held.subject.as_str(), bench.subjects.chat_submit("acme"));

    bench.orchestrator(2, "").await;
    assert_eq!(endings.next(2).await, ["acme", "acme"]);
    assert!(
        stream
            .get_consumer::<pull::Config>(&bench.subjects.chat_consumer())
            .await
            .is_err(),
        "the shared consumer is still there"
    );
    bench.stop().await;
}

impl Bench {
    /// Queues `n` jobs of `tenant` with `priority` (the client submits
    /// batch jobs on the tenant's batch subject); returns their ids.
    pub(crate) async fn queue_as(&self, tenant: &str, n: usize, priority: Priority) -> Vec<String> {
        let mut ids = Vec::new();
        for i in 0..n {
            let mut job: ChatJob = toolfleet_protocol::client::question(&format!(
                "{tenant} {} question {i}",
                priority.as_str()
            ));
            job.tenant = Some(tenant.into());
            job.priority = Some(priority);
            toolfleet_protocol::client::submit(&self.client, &self.subjects, &job)
                .await
                .unwrap();
            ids.push(job.invocation_id);
        }
        ids
    }
}

/// A tenant's batch backlog waits for its (and every tenant's)
/// interactive jobs: an interactive job submitted behind 20 batch jobs
/// starts at the next free slot. (Before priorities every job of a tenant
/// was taken in arrival order: it ended last.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interactive_jobs_go_before_a_batch_backlog() {
    let mut bench = Bench::start(100).await;
    let mut endings = bench.endings().await;
    let batch = bench.queue_as("acme", 20, Priority::Batch).await;
    bench.orchestrator(1, "").await;
    let first = endings.next_ids(1).await;
    assert!(batch.contains(&first[0]));
    let urgent = bench.queue_as("acme", 1, Priority::Interactive).await;
    let globex = bench.queue_as("globex", 1, Priority::Interactive).await;
    let order = endings.next_ids(21).await;
    let at = |id: &String| order.iter().position(|o| o == id).expect("ended");
    // One batch job may be running when they arrive.
    assert!(at(&urgent[0]) <= 2, "acme's interactive job: {order:?}");
    assert!(at(&globex[0]) <= 2, "globex's interactive job: {order:?}");
    bench.stop().await;
}

/// Interactive jobs keep coming, yet batch jobs are taken: one at least
/// every `--batch-max-wait` (aging). Without it not one batch job would
/// end before the 40 interactive ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_jobs_never_starve_behind_interactive_ones() {
    let mut bench = Bench::start(40).await;
    let mut endings = bench.endings().await;
    let batch = bench.queue_as("acme", 5, Priority::Batch).await;
    bench.queue_as("acme", 20, Priority::Interactive).await;
    bench.queue_as("globex", 20, Priority::Interactive).await;
    bench
        .orchestrator_with(1, "", Duration::from_millis(300))
        .await;
    let order = endings.next_ids(30).await;
    let batch_done = order.iter().filter(|id| batch.contains(id)).count();
    assert!(
        batch_done >= 2,
        "{batch_done} batch jobs among the first 30 to end: {order:?}"
    );
    bench.stop().await;
}

/// A profile that is batch moves its jobs to the batch lane (they were
/// submitted as interactive) and its model calls carry the deployment's
/// `batch_service_tier`; an interactive job's calls carry none, and a
/// batch job on a deployment without a batch tier sends none either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_profile_runs_in_the_batch_lane_with_the_batch_service_tier() {
    let mut bench = Bench::start(0).await;
    let mut endings = bench.endings().await;
    let extra = format!(
        "[deployments.flexible]\nbase_url = \"{}\"\nmodel = \"toolfleet-scripted\"\n\
         batch_service_tier = \"flex\"\n\
         [profiles.bulk]\ndeployment = \"flexible\"\npriority = \"batch\"\n\
         [profiles.chat]\ndeployment = \"flexible\"\n",
        bench.model.base_url()
    );
    bench.orchestrator(2, &extra).await;
    let submit = |profile: &str, text: &str, priority: Option<Priority>| {
        let mut job: ChatJob = toolfleet_protocol::client::question(text);
        job.tenant = Some("acme".into());
        job.profile = Some(profile.into());
        job.priority = priority;
        job
    };
    let jobs = [
        submit("bulk", "bulk question", None),
        submit("chat", "chat question", None),
        submit("chat", "chat batch question", Some(Priority::Batch)),
        submit("default", "untiered batch question", Some(Priority::Batch)),
    ];
    let js = async_nats::jetstream::new(bench.client.clone());
    for job in &jobs {
        // All on the interactive subject, as a client that knows nothing
        // of lanes would send them.
        js.publish(
            bench.subjects.chat_submit("acme"),
            serde_json::to_vec(job).unwrap().into(),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    }
    endings.next_ids(4).await;
    let tier_of = |text: &str| {
        let requests = bench.model.requests();
        let body = requests
            .iter()
            .find(|r| r.to_string().contains(text))
            .unwrap_or_else(|| panic!("no request for {text:?}"));
        body.get("service_tier").cloned()
    };
    assert_eq!(tier_of("bulk question"), Some(serde_json::json!("flex")));
    assert_eq!(tier_of("chat question"), None);
    assert_eq!(
        tier_of("chat batch question"),
        Some(serde_json::json!("flex"))
    );
    assert_eq!(tier_of("untiered batch question"), None);
    // Three were moved to the batch lane and taken from its consumer.
    let stream = js.get_stream(bench.subjects.chat_stream()).await.unwrap();
    let mut batch: async_nats::jetstream::consumer::PullConsumer = stream
        .get_consumer(&bench.subjects.chat_batch_consumer("acme"))
        .await
        .expect("acme's batch consumer");
    // The last job is acked just after its terminal event.
    let info = tokio::time::timeout(WAIT, async {
        loop {
            let info = batch.info().await.unwrap().clone();
            if info.num_ack_pending + info.num_pending as usize == 0 {
                return info;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("every batch job acked");
    assert!(info.delivered.stream_sequence > 0, "{info:?}");
    bench.stop().await;
}

/// `--chat-dispatch fifo`: one consumer for every tenant, in arrival
/// order (what fair dispatch replaced; kept for single-tenant fleets and
/// to measure fairness's cost): globex's job, queued behind acme's
/// backlog, ends after all of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_dispatch_takes_every_tenants_jobs_in_arrival_order() {
    let mut bench = Bench::start(0).await;
    let mut endings = bench.endings().await;
    bench.queue("acme", 10).await;
    bench.queue("globex", 1).await;
    let toml = format!(
        "[deployments.scripted]\nbase_url = \"{}\"\nmodel = \"toolfleet-scripted\"\n\
         [profiles.default]\ndeployment = \"scripted\"\n",
        bench.model.base_url()
    );
    let profiles = toolfleet_config::FleetConfig::from_toml(&toml, "fifo test").unwrap();
    let mut config =
        toolfleet_orchestrator::OrchestratorConfig::new(bench.subjects.clone(), profiles);
    config.max_in_flight = 1;
    config.chat_dispatch = toolfleet_orchestrator::settings::ChatDispatch::Fifo;
    let rt = crate::support::start_orchestrator(bench.nats.url(), bench.redis.url(), config).await;
    bench.runtimes.push(rt);
    let order = endings.next(11).await;
    assert_eq!(
        order.last().map(String::as_str),
        Some("globex"),
        "{order:?}"
    );
    bench.stop().await;
}

/// A FIFO orchestrator refuses to start on a chat stream that holds fair
/// dispatch's consumers (a work queue allows no overlapping consumers),
/// saying how to switch; nothing queued is touched.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifo_dispatch_refuses_a_stream_with_fair_consumers() {
    let mut bench = Bench::start(0).await;
    bench.orchestrator(1, "").await;
    let mut endings = bench.endings().await;
    bench.queue("acme", 1).await;
    endings.next(1).await;
    let toml = format!(
        "[deployments.scripted]\nbase_url = \"{}\"\nmodel = \"toolfleet-scripted\"\n\
         [profiles.default]\ndeployment = \"scripted\"\n",
        bench.model.base_url()
    );
    let profiles = toolfleet_config::FleetConfig::from_toml(&toml, "fifo test").unwrap();
    let mut config =
        toolfleet_orchestrator::OrchestratorConfig::new(bench.subjects.clone(), profiles);
    config.chat_dispatch = toolfleet_orchestrator::settings::ChatDispatch::Fifo;
    let client = async_nats::connect(bench.nats.url()).await.unwrap();
    let store = toolfleet_store::CitationStore::connect(
        &bench.redis.url(),
        bench.subjects.prefix(),
        Duration::from_secs(60),
    )
    .await
    .unwrap();
    let registry = prometheus::Registry::new();
    let dead_letters = toolfleet_service::metrics::dead_letters(&registry).unwrap();
    let metrics =
        toolfleet_orchestrator::metrics::OrchestratorMetrics::register(&registry, dead_letters)
            .unwrap();
    let ran = tokio::time::timeout(
        WAIT,
        toolfleet_orchestrator::run(
            client,
            store,
            config,
            metrics,
            tokio_util::sync::CancellationToken::new(),
        ),
    )
    .await
    .expect("the start answered");
    let error = ran
        .expect_err("a FIFO orchestrator beside fair consumers")
        .to_string();
    assert!(
        error.contains("chat-acme") && error.contains("--chat-dispatch fair"),
        "{error}"
    );
    bench.stop().await;
}
