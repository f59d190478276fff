//! The catalog and the streams against a real `nats-server` (JetStream on),
//! with stand-in workers: services-API endpoints that advertise a tool id
//! and a digest, as the worker SDK's do.
//!
//! - after a rollback the catalog offers the definition the live workers
//!   serve, not the last one written to the bucket;
//! - live workers of one tool that disagree (a rolling upgrade) get the
//!   definition most of them serve;
//! - of several live versions of a tool, only the newest is offered;
//! - a stream or bucket name held by other subjects (another fleet, an
//!   older configuration) is an error, never shared.

use std::collections::HashMap;
use std::future::Future;
use std::time::Duration;

use async_nats::jetstream;
use async_nats::service::ServiceExt;
use toolfleet_protocol::catalog::{self, Catalog};
use toolfleet_protocol::streams::{ensure_chat_stream, ensure_tools_stream};
use toolfleet_protocol::tools::{ToolDefinition, load_file};
use toolfleet_protocol::{Subjects, ToolId};

const STEP: Duration = Duration::from_secs(20);
/// How long a reading collects `INFO` answers: a collection window, not a
/// timing assertion, long enough that every stand-in answers even on a
/// loaded machine (a missed answer would change the majority tested here).
const INFO_WAIT: Duration = Duration::from_secs(2);

/// Every await in these tests is bounded.
async fn within<F: Future>(future: F) -> F::Output {
    tokio::time::timeout(STEP, future)
        .await
        .expect("test step timed out")
}

/// The harness's `nats-server` (JetStream on, free port, killed on drop).
type Nats = toolfleet_testkit::servers::NatsServer;

/// One fleet on the server: a client for readings, one for the stand-in
/// workers, and the catalog bucket.
struct Fleet {
    client: async_nats::Client,
    workers: async_nats::Client,
    subjects: Subjects,
    store: jetstream::kv::Store,
    /// Live stand-ins.
    live: Vec<(
        async_nats::service::Service,
        async_nats::service::endpoint::Endpoint,
    )>,
}

impl Fleet {
    async fn start(nats: &Nats, prefix: &str) -> Self {
        let client = within(async_nats::connect(nats.url()))
            .await
            .expect("connect");
        let workers = within(async_nats::connect(nats.url()))
            .await
            .expect("connect");
        let subjects = Subjects::new(prefix).expect("subjects");
        let store = within(catalog::bucket(&jetstream::new(workers.clone()), &subjects))
            .await
            .expect("bucket");
        Self {
            client,
            workers,
            subjects,
            store,
            live: Vec::new(),
        }
    }

    /// What a starting worker does: the definition into the bucket.
    async fn advertise(&self, definition: &ToolDefinition) -> String {
        within(catalog::advertise(&self.store, definition))
            .await
            .expect("advertise")
    }

    /// A live stand-in worker serving `definition` as `digest`.
    async fn serve(&mut self, definition: &ToolDefinition, digest: &str) {
        let service = within(
            self.workers
                .service_builder()
                .metadata(HashMap::from([
                    (
                        catalog::META_FLEET.to_string(),
                        self.subjects.prefix().to_string(),
                    ),
                    (catalog::META_WORKER.to_string(), "stand-in".to_string()),
                ]))
                .start(self.subjects.worker_service(), "0.0.0"),
        )
        .await
        .expect("service");
        let endpoint = within(
            service
                .endpoint_builder()
                .name(&definition.function.name)
                .metadata(HashMap::from([
                    (catalog::META_TOOL_ID.to_string(), definition.id.to_string()),
                    (catalog::META_DIGEST.to_string(), digest.to_string()),
                ]))
                .add(self.subjects.tool_direct(&definition.id)),
        )
        .await
        .expect("endpoint");
        // The server has its subscriptions before a reading asks.
        within(self.workers.flush()).await.expect("flush");
        self.live.push((service, endpoint));
    }

    /// Every stand-in goes away (dropping a service would leave it
    /// answering `INFO`).
    async fn stop_all(&mut self) {
        for (service, mut endpoint) in self.live.drain(..) {
            within(endpoint.stop()).await.expect("endpoint stops");
            within(service.stop()).await.expect("service stops");
        }
        within(self.workers.flush()).await.expect("flush");
    }

    async fn discover(&self, previous: &Catalog) -> Catalog {
        within(catalog::discover(
            &self.client,
            &self.subjects,
            INFO_WAIT,
            previous,
        ))
        .await
        .expect("reading")
    }

    /// A reading from `previous` in which `workers` serve `tool`, read
    /// again a few times if not: a reading waits a fixed time for the
    /// workers' INFO answers, and on a loaded machine one can miss it (the
    /// live catalog reads again every few seconds).
    async fn discover_until(&self, previous: &Catalog, tool: &str, workers: usize) -> Catalog {
        let mut reading = self.discover(previous).await;
        for _ in 0..5 {
            if reading.get(tool).is_some_and(|e| e.workers == workers) {
                break;
            }
            reading = self.discover(previous).await;
        }
        reading
    }
}

fn shipped() -> ToolDefinition {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tool_definitions/system.current_datetime.json"
    );
    load_file(path).expect("shipped definition")
}

/// The shipped definition with another description: another digest of
/// the same tool id.
fn revised(definition: &ToolDefinition, note: &str) -> ToolDefinition {
    let mut d = definition.clone();
    d.description.push_str(note);
    d
}

/// A release wrote its definition and was rolled back: its worker is gone,
/// the worker of the earlier definition is live. The bucket's last write
/// is the rolled-back definition; the catalog offers the live one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_rollback_the_live_definition_is_offered() {
    let nats = Nats::start().expect("nats-server");
    let mut fleet = Fleet::start(&nats, "rollback").await;
    let old = shipped();
    let new = revised(&old, " (release 2)");
    let old_digest = fleet.advertise(&old).await;
    fleet.serve(&old, &old_digest).await;
    // Release 2 starts, writes its definition, and is rolled back before
    // (or after) its endpoint appears.
    let new_digest = fleet.advertise(&new).await;
    assert_ne!(new_digest, old_digest);

    let catalog = fleet
        .discover_until(&Catalog::default(), &old.id.to_string(), 1)
        .await;
    let entry = catalog.get(&old.id.to_string()).expect("the tool is live");
    assert_eq!(entry.definition().description, old.description);
    assert_eq!(entry.digest, old_digest);
    assert_eq!(catalog::digest(entry.definition()), old_digest);

    // Release 2 comes back and takes over: its definition, refetched.
    fleet.stop_all().await;
    fleet.serve(&new, &new_digest).await;
    let catalog = fleet.discover_until(&catalog, &new.id.to_string(), 1).await;
    let entry = catalog.get(&new.id.to_string()).expect("the tool is live");
    assert_eq!(entry.definition().description, new.description);
    assert_eq!(entry.digest, new_digest);
    assert_eq!(entry.workers, 1);
}

/// A rolling upgrade: live workers of one tool serve two definitions. The
/// one most of them serve is offered, whichever was written last, and the
/// choice follows the majority as it moves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_that_disagree_get_the_definition_most_of_them_serve() {
    let nats = Nats::start().expect("nats-server");
    let mut fleet = Fleet::start(&nats, "rolling").await;
    let old = shipped();
    let new = revised(&old, " (release 2)");
    let old_digest = fleet.advertise(&old).await;
    fleet.serve(&old, &old_digest).await;
    fleet.serve(&old, &old_digest).await;
    let new_digest = fleet.advertise(&new).await;
    fleet.serve(&new, &new_digest).await;

    let first = fleet
        .discover_until(&Catalog::default(), &old.id.to_string(), 3)
        .await;
    let entry = first.get(&old.id.to_string()).expect("the tool is live");
    assert_eq!(entry.definition().description, old.description);
    assert_eq!(entry.digest, old_digest);
    assert_eq!(entry.workers, 3);

    fleet.serve(&new, &new_digest).await;
    fleet.serve(&new, &new_digest).await;
    let second = fleet.discover_until(&first, &new.id.to_string(), 5).await;
    let entry = second.get(&new.id.to_string()).expect("the tool is live");
    assert_eq!(entry.definition().description, new.description);
    assert_eq!(entry.digest, new_digest);
    assert_eq!(entry.workers, 5);
    assert_eq!(second.generation, first.generation + 1);
}

/// Three versions of one tool are live: the model is offered its function
/// name once, for the newest version by number; all three stay live.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn of_live_versions_only_the_newest_is_offered() {
    let nats = Nats::start().expect("nats-server");
    let mut fleet = Fleet::start(&nats, "versions").await;
    let mut ids = Vec::new();
    for version in ["1.2.0", "1.10.0", "1.9.3"] {
        let mut d = shipped();
        d.id = format!("system:current_datetime@{version}")
            .parse::<ToolId>()
            .expect("tool id");
        let digest = fleet.advertise(&d).await;
        fleet.serve(&d, &digest).await;
        ids.push(d.id.to_string());
    }
    // A reading on a loaded machine can miss an INFO answer: read until
    // all three are there (at most a few times).
    let mut catalog = fleet.discover(&Catalog::default()).await;
    for _ in 0..5 {
        if ids.iter().all(|id| catalog.is_live(id)) {
            break;
        }
        catalog = fleet.discover(&Catalog::default()).await;
    }
    let offered: Vec<String> = catalog
        .iter()
        .map(|e| e.definition().id.to_string())
        .collect();
    assert_eq!(offered, ["system:current_datetime@1.10.0"]);
    assert_eq!(
        catalog
            .by_function_name("current_datetime")
            .map(|e| e.definition().id.to_string())
            .as_deref(),
        Some("system:current_datetime@1.10.0")
    );
    for id in &ids {
        assert!(catalog.is_live(id), "{id}");
    }
}

/// Stream names already held by other subjects — here what an earlier
/// release made for the prefix `fleet_a`, whose names the prefix `fleet.a`
/// now maps to — are refused with the stream's name and subjects, and
/// left as they were.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_or_bucket_name_held_by_other_subjects_is_an_error() {
    let nats = Nats::start().expect("nats-server");
    let client = within(async_nats::connect(nats.url()))
        .await
        .expect("connect");
    let js = jetstream::new(client.clone());
    for (name, subject, max_per_subject) in [
        ("FLEET_A_CHAT", "fleet_a.chat.submit", -1),
        ("FLEET_A_TOOLS", "fleet_a.tool.>", -1),
        ("KV_FLEET_A_CATALOG", "$KV.FLEET_A_CATALOG.fleet_a.>", 1),
    ] {
        within(js.create_stream(jetstream::stream::Config {
            name: name.into(),
            subjects: vec![subject.into()],
            max_messages_per_subject: max_per_subject,
            ..Default::default()
        }))
        .await
        .expect("create a foreign stream");
    }
    let subjects = Subjects::new("fleet.a").expect("subjects");
    assert_eq!(subjects.chat_stream(), "FLEET_A_CHAT");

    let chat = within(ensure_chat_stream(&js, &subjects))
        .await
        .expect_err("FLEET_A_CHAT is another fleet's");
    let text = chat.to_string();
    assert!(
        text.contains("FLEET_A_CHAT") && text.contains("fleet_a.chat.submit"),
        "{text}"
    );
    let tools = within(ensure_tools_stream(&js, &subjects))
        .await
        .expect_err("FLEET_A_TOOLS is another fleet's");
    assert!(tools.to_string().contains("fleet_a.tool.>"), "{tools}");
    let bucket = within(catalog::bucket(&js, &subjects))
        .await
        .expect_err("KV_FLEET_A_CATALOG is another fleet's");
    assert!(
        bucket.to_string().contains("KV_FLEET_A_CATALOG"),
        "{bucket}"
    );

    for (name, subject) in [
        ("FLEET_A_CHAT", "fleet_a.chat.submit"),
        ("FLEET_A_TOOLS", "fleet_a.tool.>"),
    ] {
        let mut stream = within(js.get_stream(name)).await.expect("stream");
        let info = within(stream.info()).await.expect("info");
        assert_eq!(info.config.subjects, [subject], "{name} untouched");
    }

    // A fleet whose names are free gets its streams, and gets them again.
    let free = Subjects::new("fleet-a").expect("subjects");
    for _ in 0..2 {
        within(ensure_chat_stream(&js, &free))
            .await
            .expect("chat stream");
        within(ensure_tools_stream(&js, &free))
            .await
            .expect("tools stream");
        within(catalog::bucket(&js, &free)).await.expect("bucket");
    }
}
