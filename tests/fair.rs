//! Fair dispatch (issue 29): chat jobs are taken from the tenants in
//! weighted turns, so one tenant's backlog delays only that tenant — with
//! one orchestrator or several. Real NATS and Redis, in-process
//! orchestrators, the scripted model (the stand-in for the provider).
//! Shares and orders are asserted, never times.

use std::time::Duration;

use futures::StreamExt;
use toolfleet_local::servers::{NatsServer, RedisServer};
use toolfleet_protocol::{ChatJob, Subjects};

use crate::support::WAIT;

/// The servers, the scripted model and a client, with no orchestrator
/// yet: a test queues jobs first, then starts orchestrators.
struct Bench {
    nats: NatsServer,
    redis: RedisServer,
    model: toolfleet_scripted::ScriptedServer,
    client: async_nats::Client,
    subjects: Subjects,
    runtimes: Vec<toolfleet_service::Runtime>,
}

impl Bench {
    /// The servers, and a model that answers every question after
    /// `delay_ms`.
    async fn start(delay_ms: u64) -> Self {
        let nats = NatsServer::start().unwrap();
        let redis = RedisServer::start().unwrap();
        let script = serde_json::json!({
            "firstTokenDelayMs": delay_ms,
            "default": { "steps": [ { "answer": "done" } ] }
        });
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
    /// `tenants` (TOML `[tenants.*]` tables) in its configuration.
    async fn orchestrator(&mut self, max_in_flight: usize, tenants: &str) {
        let toml = format!(
            "[deployments.scripted]\nbase_url = \"{}\"\nmodel = \"toolfleet-scripted\"\n\
             [profiles.default]\ndeployment = \"scripted\"\n{tenants}",
            self.model.base_url()
        );
        let profiles = toolfleet_config::FleetConfig::from_toml(&toml, "fair test").unwrap();
        let mut config =
            toolfleet_orchestrator::OrchestratorConfig::new(self.subjects.clone(), profiles);
        config.max_in_flight = max_in_flight;
        let rt =
            crate::support::start_orchestrator(self.nats.url(), self.redis.url(), config).await;
        self.runtimes.push(rt);
    }

    /// Queues `n` jobs of `tenant` (the submit returns once each is
    /// stored).
    async fn queue(&self, tenant: &str, n: usize) {
        for i in 0..n {
            let mut job: ChatJob =
                toolfleet_protocol::client::question(&format!("{tenant} question {i}"));
            job.tenant = Some(tenant.into());
            toolfleet_protocol::client::submit(&self.client, &self.subjects, &job)
                .await
                .unwrap();
        }
    }

    /// Every terminal event, from now on: the tenant of each, in the
    /// order they are published.
    async fn endings(&self) -> Endings {
        let sub = self
            .client
            .subscribe(format!("{}.chat.events.>", self.subjects.prefix()))
            .await
            .unwrap();
        self.client.flush().await.unwrap();
        Endings { sub }
    }

    async fn stop(self) {
        for rt in self.runtimes {
            assert!(rt.drain(Duration::from_secs(10)).await);
        }
    }
}

struct Endings {
    sub: async_nats::Subscriber,
}

impl Endings {
    /// The tenants of the next `n` invocations to end, in order (each
    /// must complete).
    async fn next(&mut self, n: usize) -> Vec<String> {
        let mut tenants = Vec::new();
        tokio::time::timeout(WAIT * 2, async {
            while tenants.len() < n {
                let msg = self.sub.next().await.expect("events");
                let event: serde_json::Value = serde_json::from_slice(&msg.payload).unwrap();
                if event["type"] != "completed" && event["type"] != "error" {
                    continue;
                }
                assert_eq!(event["type"], "completed", "{event}");
                // `<p>.chat.events.<tenant>.<id>`
                let tenant = msg.subject.split('.').nth(3).unwrap().to_string();
                tenants.push(tenant);
            }
        })
        .await
        .unwrap_or_else(|_| panic!("only {} of {n} jobs ended", tenants.len()));
        tenants
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
