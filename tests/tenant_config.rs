//! Tenant-owned configuration and trust derived, never claimed (issue 28,
//! items 2 and 3), attacked as tenant `acme` would attack tenant `globex`:
//! a real `nats-server` running the shipped `ops/nats/auth.conf`, the
//! orchestrator under its own identity, a worker under the `units` role,
//! and each tenant's client under its own identity. The scripted model
//! server stands in for the provider and records what it was asked.

use std::sync::{Arc, Mutex};

use futures::StreamExt;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;
use toolfleet_local::servers::{NatsServer, RedisServer};
use toolfleet_protocol::client::{ChatOutcome, ClientError};
use toolfleet_protocol::tools::{Origin, ToolDefinition};
use toolfleet_protocol::{ChatEvent, ChatEventBody, ChatJob, Subjects, ToolStatus};
use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput, Worker};

use crate::security::{inbox_prefix, password};
use crate::support::WAIT;

/// The fleet under its role identities: the orchestrator in-process on
/// `profiles`, and optionally a `units` worker. (Shared with the other
/// attacks of one tenant on another: `cancels`.)
pub(crate) struct Secured {
    nats: NatsServer,
    pub(crate) redis: RedisServer,
    pub(crate) model: toolfleet_scripted::ScriptedServer,
    pub(crate) subjects: Subjects,
    /// The orchestrator's metrics.
    pub(crate) metrics: prometheus::Registry,
    shutdown: CancellationToken,
}

impl Drop for Secured {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

impl Secured {
    pub(crate) async fn start(script: Value, profiles: &str) -> Self {
        let nats = crate::security::Secure::start().nats;
        let redis = RedisServer::start().expect("redis-server");
        let script = toolfleet_scripted::Script::from_json(&script.to_string()).unwrap();
        let model =
            toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
                .await
                .unwrap();
        let subjects = Subjects::new("toolfleet").unwrap();
        let fleet = Self {
            nats,
            redis,
            model,
            subjects,
            metrics: prometheus::Registry::new(),
            shutdown: CancellationToken::new(),
        };
        let profiles = toolfleet_config::FleetConfig::from_toml(
            &profiles.replace("{base_url}", fleet.model.base_url().as_str()),
            "tenant test profiles",
        )
        .expect("test profiles");
        let config =
            toolfleet_orchestrator::OrchestratorConfig::new(fleet.subjects.clone(), profiles);
        let registry = &fleet.metrics;
        let metrics = toolfleet_orchestrator::metrics::OrchestratorMetrics::register(
            registry,
            toolfleet_service::metrics::dead_letters(registry).unwrap(),
        )
        .unwrap();
        let orchestrator = tokio::time::timeout(
            WAIT,
            toolfleet_orchestrator::Ready::open(
                fleet.connect("orchestrator").await,
                fleet.store().await,
                config,
                metrics,
                fleet.shutdown.clone(),
            ),
        )
        .await
        .expect("the orchestrator starts in time")
        .expect("the orchestrator starts");
        tokio::spawn(async move {
            if let Err(e) = orchestrator.run().await {
                panic!("the orchestrator stopped: {e}");
            }
        });
        fleet
    }

    pub(crate) async fn connect(&self, user: &str) -> async_nats::Client {
        tokio::time::timeout(
            WAIT,
            async_nats::ConnectOptions::with_user_and_password(user.into(), password(user))
                .custom_inbox_prefix(inbox_prefix(user))
                .connect(self.nats.url()),
        )
        .await
        .expect("connect in time")
        .expect("connect")
    }

    pub(crate) async fn store(&self) -> toolfleet_store::CitationStore {
        toolfleet_store::CitationStore::connect(
            &self.redis.url(),
            self.subjects.prefix(),
            std::time::Duration::from_secs(60),
        )
        .await
        .unwrap()
    }

    /// Starts `worker` under the `units` role.
    async fn start_units_worker(&self, worker: Worker) {
        let started = worker.start(
            self.connect("worker-units").await,
            self.store().await,
            toolfleet_worker::WorkerConfig::new(self.subjects.clone()),
            toolfleet_worker::metrics::WorkerMetrics::register_all(&prometheus::Registry::new())
                .unwrap(),
            self.shutdown.clone(),
        );
        tokio::time::timeout(WAIT, started)
            .await
            .expect("the worker starts in time")
            .expect("the worker starts");
    }

    /// `job` submitted and followed by `client` (one tenant's identity).
    async fn chat(
        &self,
        client: &async_nats::Client,
        job: &ChatJob,
    ) -> Result<ChatOutcome, ClientError> {
        tokio::time::timeout(
            WAIT,
            toolfleet_protocol::client::chat(client, &self.subjects, job, WAIT, |_| {}),
        )
        .await
        .expect("the chat ends in time")
    }

    /// Follows the events of invocation `id` of `tenant`, then publishes
    /// `body` as its chat job with `client` (acked by the stream).
    pub(crate) async fn follow_and_publish(
        &self,
        client: &async_nats::Client,
        tenant: &str,
        id: &str,
        body: Vec<u8>,
    ) -> async_nats::Subscriber {
        let events = client
            .subscribe(self.subjects.chat_events(tenant, id))
            .await
            .unwrap();
        client.flush().await.unwrap();
        let js = async_nats::jetstream::new(client.clone());
        let ack = js
            .publish(self.subjects.chat_submit(tenant), body.into())
            .await
            .expect("published");
        tokio::time::timeout(WAIT, ack)
            .await
            .expect("acked in time")
            .expect("acked");
        events
    }

    /// Publishes `body` as a chat job of `tenant` with `client`, and
    /// returns its terminal event.
    async fn raw_chat(&self, client: &async_nats::Client, tenant: &str, body: &Value) -> Value {
        let id = body["invocationId"].as_str().unwrap();
        let mut events = self
            .follow_and_publish(client, tenant, id, serde_json::to_vec(body).unwrap())
            .await;
        loop {
            let msg = tokio::time::timeout(WAIT, events.next())
                .await
                .expect("a terminal event in time")
                .expect("events");
            let event: Value = serde_json::from_slice(&msg.payload).unwrap();
            if matches!(event["type"].as_str(), Some("completed" | "error")) {
                return event;
            }
        }
    }
}

fn job_of(tenant: &str, text: &str) -> ChatJob {
    let mut job = toolfleet_protocol::client::question(text);
    job.tenant = Some(tenant.into());
    job
}

fn started(events: &[ChatEvent]) -> (Option<String>, Vec<String>) {
    events
        .iter()
        .find_map(|e| match &e.body {
            ChatEventBody::Started { profile, tools, .. } => Some((profile.clone(), tools.clone())),
            _ => None,
        })
        .expect("a started event")
}

/// What the worker saw of a call's invocation context.
#[derive(Debug, Clone, PartialEq)]
struct Seen {
    tenant: String,
    user: Option<String>,
    provider: Option<String>,
    connection: Option<String>,
    confidence: Option<f64>,
}

/// `units:convert@1.0.0` (the tool the `units` role may serve), needing a
/// provider confidence of 0.8; records the context of each call.
struct Trusted(Arc<Mutex<Vec<Seen>>>);

impl Tool for Trusted {
    type Args = Value;
    async fn call(&self, ctx: &ToolCtx, _args: Value) -> Result<ToolOutput, ToolError> {
        let inv = ctx.invocation();
        self.0.lock().unwrap().push(Seen {
            tenant: inv.tenant().to_string(),
            user: inv.user.clone(),
            provider: inv.provider.clone(),
            connection: inv.connection.clone(),
            confidence: inv.provider_confidence,
        });
        Ok(ToolOutput::text("100 cm"))
    }
}

fn trusted_worker(seen: Arc<Mutex<Vec<Seen>>>) -> Worker {
    let def = ToolDefinition::from_value(
        json!({
            "schemaVersion": 1,
            "id": "units:convert@1.0.0",
            "implementationKey": "units.convert",
            "title": "Trusted converter",
            "description": "Converts units, for trusted providers only.",
            "category": "utility",
            "minProviderConfidence": 0.8,
            "function": {
                "name": "convert_units",
                "description": "Convert a quantity between units.",
                "parameters": { "type": "object", "properties": { "value": { "type": "number" } } }
            }
        }),
        Origin::Named("trusted converter".into()),
    )
    .expect("test definition");
    Worker::builder("units")
        .definition(def)
        .tool("units.convert", Trusted(seen))
        .build()
        .expect("test worker")
}

const PROFILES: &str = r#"
[deployments.scripted]
base_url = "{base_url}"
model = "toolfleet-scripted"

[deployments.vetted]
base_url = "{base_url}"
model = "toolfleet-scripted"
confidence = 0.9
provider = "vetted-co"

[profiles.default]
deployment = "scripted"

[profiles.acme-home]
deployment = "scripted"
tenants = ["acme"]
system_prompt = "You answer for acme."

[profiles.globex-private]
deployment = "vetted"
tenants = ["globex"]
system_prompt = "GLOBEX-CANARY-PROMPT: the merger closes Friday."

[profiles.vetted-acme]
deployment = "vetted"
tenants = ["acme"]

[data_sources.globex-kb]
tenants = ["globex"]

[tenants.acme]
default_profile = "acme-home"

[tenants.globex]
trust_user = true
"#;

fn script() -> Value {
    json!({
        "rules": [{
            "whenUserContains": ["convert"],
            "steps": [
                { "toolCalls": [ { "name": "convert_units", "arguments": { "value": 1 } } ] },
                { "answer": "Converted: {{tool:convert_units}}" }
            ]
        }],
        "default": { "steps": [ { "answer": "ok" } ] }
    })
}

/// acme names globex's profile, an unknown profile, globex's data source
/// and a globex document: each is refused with its own code before the
/// model is called, and never run on another profile; acme's job naming
/// none runs acme's default profile, globex's own jobs run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_config_acme_cannot_use_globex_profiles_or_data_sources() {
    let fleet = Secured::start(script(), PROFILES).await;
    let acme = fleet.connect("client-acme").await;
    let globex = fleet.connect("client-globex").await;

    let mut job = job_of("acme", "what does globex plan?");
    job.profile = Some("globex-private".into());
    let err = fleet.chat(&acme, &job).await.expect_err("globex's profile");
    assert_eq!(err.code(), "profile_not_allowed", "{err}");
    assert!(!err.to_string().contains("GLOBEX-CANARY"), "{err}");

    let mut job = job_of("acme", "hello");
    job.profile = Some("no-such-profile".into());
    let err = fleet
        .chat(&acme, &job)
        .await
        .expect_err("an unknown profile");
    assert_eq!(err.code(), "unknown_profile", "{err}");

    let mut job = job_of("acme", "hello");
    job.data_source_id = Some("globex-kb".into());
    let err = fleet
        .chat(&acme, &job)
        .await
        .expect_err("globex's data source");
    assert_eq!(err.code(), "data_source_not_allowed", "{err}");

    let mut job = job_of("acme", "hello");
    job.attached_documents = vec!["globex-kb:secret.md".into()];
    let err = fleet
        .chat(&acme, &job)
        .await
        .expect_err("globex's document");
    assert_eq!(err.code(), "data_source_not_allowed", "{err}");

    // Nothing of that reached the model: it was never called.
    assert!(
        fleet.model.requests().is_empty(),
        "{:?}",
        fleet.model.requests()
    );

    // Naming no profile, acme runs its own default.
    let outcome = fleet
        .chat(&acme, &job_of("acme", "hello"))
        .await
        .expect("acme's default");
    assert_eq!(started(&outcome.events).0.as_deref(), Some("acme-home"));
    // globex runs its own profile, and the fleet's default when naming none.
    let mut job = job_of("globex", "hello");
    job.profile = Some("globex-private".into());
    let outcome = fleet.chat(&globex, &job).await.expect("globex's own");
    assert_eq!(
        started(&outcome.events).0.as_deref(),
        Some("globex-private")
    );
    let outcome = fleet
        .chat(&globex, &job_of("globex", "hello"))
        .await
        .expect("the fleet's default");
    assert_eq!(started(&outcome.events).0.as_deref(), Some("default"));
    // And the canary prompt went only to globex's model call.
    let canaries = fleet
        .model
        .requests()
        .iter()
        .filter(|r| r.to_string().contains("GLOBEX-CANARY"))
        .count();
    assert_eq!(canaries, 1);
}

/// acme claims trust (providerConfidence 1.0, a provider, a connection):
/// refused, nothing runs. On a deployment of confidence 0 the 0.8 tool is
/// never offered nor run; on one of 0.9 it is, and the worker sees the
/// deployment's confidence, provider and name. The user reaches the tool
/// only for globex, whose identity the operator trusts to assert users.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenant_config_trust_comes_from_the_deployment_never_the_job() {
    let fleet = Secured::start(script(), PROFILES).await;
    let seen = Arc::new(Mutex::new(Vec::new()));
    fleet.start_units_worker(trusted_worker(seen.clone())).await;
    let acme = fleet.connect("client-acme").await;
    let globex = fleet.connect("client-globex").await;

    // A deployment of confidence 0.9 unlocks the 0.8 tool (asked until the
    // orchestrator's catalog has read the worker's advertisement).
    let deadline = tokio::time::Instant::now() + WAIT;
    let outcome = loop {
        let mut job = job_of("acme", "please convert 1 m");
        job.profile = Some("vetted-acme".into());
        job.user = Some("bob".into());
        let outcome = fleet.chat(&acme, &job).await.expect("completes");
        let ran = outcome.events.iter().any(|e| {
            matches!(&e.body, ChatEventBody::ToolResult { tool, status: ToolStatus::Ok, .. }
                if tool.contains("units:convert"))
        });
        // Offered from the start, not only found late by dispatch.
        let offered = started(&outcome.events)
            .1
            .contains(&"units:convert@1.0.0".to_string());
        if ran && offered {
            break outcome;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the tool never ran: {:?}",
            outcome.events
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    };
    assert_eq!(outcome.text, "Converted: 100 cm");
    assert_eq!(
        seen.lock().unwrap().last().cloned(),
        Some(Seen {
            tenant: "acme".into(),
            // acme's identity is not trusted to assert its users.
            user: None,
            provider: Some("vetted-co".into()),
            connection: Some("vetted".into()),
            confidence: Some(0.9),
        })
    );

    // Claimed trust is refused, with the tool live: nothing reaches the
    // model, nothing runs.
    let (requests, calls) = (fleet.model.requests().len(), seen.lock().unwrap().len());
    for (field, claim) in [
        ("providerConfidence", json!(1.0)),
        ("provider", json!("vetted-co")),
        ("connection", json!("vetted")),
    ] {
        let mut body = serde_json::to_value(job_of("acme", "please convert 1 m")).unwrap();
        body[field] = claim;
        let end = fleet.raw_chat(&acme, "acme", &body).await;
        assert_eq!(end["type"], "error", "{end}");
        assert_eq!(end["code"], "malformed_job", "{end}");
        let message = end["message"].as_str().unwrap_or_default();
        assert!(message.contains("the fleet decides them"), "{end}");
    }
    assert_eq!(
        fleet.model.requests().len(),
        requests,
        "the model was not called"
    );
    assert_eq!(seen.lock().unwrap().len(), calls, "the tool never ran");

    // On a deployment of confidence 0 (acme's default profile) the tool is
    // not offered, and the model's call of it runs nothing.
    let calls = seen.lock().unwrap().len();
    let outcome = fleet
        .chat(&acme, &job_of("acme", "please convert 1 m"))
        .await
        .expect("completes");
    let (profile, tools) = started(&outcome.events);
    assert_eq!(profile.as_deref(), Some("acme-home"));
    assert!(!tools.iter().any(|t| t.starts_with("units:")), "{tools:?}");
    assert!(
        !outcome.events.iter().any(|e| matches!(
            &e.body,
            ChatEventBody::ToolResult {
                status: ToolStatus::Ok,
                ..
            }
        )),
        "{:?}",
        outcome.events
    );
    assert_eq!(seen.lock().unwrap().len(), calls, "the tool never ran");

    // globex's identity asserts its users: its user reaches the tool.
    let mut job = job_of("globex", "please convert 1 m");
    job.profile = Some("globex-private".into());
    job.user = Some("alice".into());
    let outcome = fleet.chat(&globex, &job).await.expect("completes");
    assert_eq!(outcome.text, "Converted: 100 cm");
    let last = seen.lock().unwrap().last().cloned().unwrap();
    assert_eq!(
        (last.tenant.as_str(), last.user.as_deref()),
        ("globex", Some("alice"))
    );
}
