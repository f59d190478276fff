//! Test harness: real `nats-server -js` and `redis-server` child processes
//! on free loopback ports (killed on drop), the scripted model server on
//! 127.0.0.1:0, and the fleet running in-process through the same
//! `fleet::start` the binaries call.

#![allow(dead_code)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet::client::{ChatOutcome, ClientError};
use toolfleet::fleet::{FleetSpec, IndexPaths, WorkerKind};
use toolfleet::local::{NatsServer, RedisServer};
use toolfleet::orchestrator::OrchestratorConfig;
use toolfleet::protocol::{ChatJob, Subjects};
use toolfleet::scripted::{Script, ScriptedServer};

/// Every await in a test is bounded by this.
pub const WAIT: Duration = Duration::from_secs(30);

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub struct Env {
    pub nats: NatsServer,
    pub redis: RedisServer,
    pub model: ScriptedServer,
    pub client: async_nats::Client,
    pub redis_conn: redis::aio::MultiplexedConnection,
    pub subjects: Subjects,
    pub metrics: prometheus::Registry,
    pub metrics_addr: std::net::SocketAddr,
    pub shutdown: CancellationToken,
    pub tracker: TaskTracker,
    _dir: tempfile::TempDir,
}

pub struct Options {
    pub workers: Vec<WorkerKind>,
    pub tweak: fn(&mut OrchestratorConfig),
    /// A profiles file; `{base_url}` is replaced by the scripted server's
    /// URL. Without it: one default profile on the scripted server.
    pub profiles_toml: Option<String>,
    /// The environment the orchestrator reads API-key variables from.
    pub env: Vec<(&'static str, &'static str)>,
    /// Tool definitions directory (default: the shipped one).
    pub defs_dir: Option<PathBuf>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            workers: vec![WorkerKind::System, WorkerKind::Retrieval],
            tweak: |_| {},
            profiles_toml: None,
            env: Vec::new(),
            defs_dir: None,
        }
    }
}

impl Env {
    pub async fn start(script: serde_json::Value) -> Env {
        Self::start_with(script, Options::default()).await
    }

    pub async fn start_with(script: serde_json::Value, options: Options) -> Env {
        let nats = NatsServer::start().expect("nats-server");
        let redis = RedisServer::start().expect("redis-server");
        let script = Script::from_json(&script.to_string()).expect("script");
        let model = ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
            .await
            .expect("scripted model");
        let dir = tempfile::tempdir().unwrap();
        let subjects = Subjects::new("toolfleet").unwrap();
        let profiles = match &options.profiles_toml {
            Some(text) => toolfleet::profiles::FleetConfig::from_toml(
                &text.replace("{base_url}", model.base_url().as_str()),
                "test profiles",
            )
            .expect("test profiles"),
            None => toolfleet::profiles::FleetConfig::single(
                toolfleet::profiles::Deployment::new(model.base_url(), "toolfleet-scripted")
                    .with_api_key("sk-test-secret-never-logged".to_string()),
            ),
        };
        let mut orchestrator = OrchestratorConfig::new(subjects.clone(), profiles);
        orchestrator.env = Arc::new(
            options
                .env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<HashMap<String, String>>(),
        );
        (options.tweak)(&mut orchestrator);
        let spec = FleetSpec {
            nats_url: nats.url(),
            redis_url: redis.url(),
            subjects: subjects.clone(),
            citation_ttl: Duration::from_secs(600),
            registry: toolfleet::fleet::load_registry(
                &options
                    .defs_dir
                    .clone()
                    .unwrap_or_else(|| root().join("tool_definitions")),
            )
            .unwrap(),
            orchestrator: Some(orchestrator),
            workers: options.workers,
            worker_concurrency: 16,
            index: Some(IndexPaths {
                index_dir: dir.path().join("index"),
                corpus_dir: root().join("examples/corpus"),
            }),
        };
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let metrics = prometheus::Registry::new();
        let metrics_addr = toolfleet::metrics::spawn(
            "127.0.0.1:0".parse().unwrap(),
            metrics.clone(),
            shutdown.clone(),
        )
        .await
        .unwrap();
        tokio::time::timeout(
            WAIT,
            toolfleet::fleet::start(spec, &metrics, &tracker, shutdown.clone()),
        )
        .await
        .expect("fleet start timed out")
        .expect("fleet start");
        let client = async_nats::connect(nats.url()).await.unwrap();
        let redis_conn = redis::Client::open(redis.url())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        Env {
            nats,
            redis,
            model,
            client,
            redis_conn,
            subjects,
            metrics,
            metrics_addr,
            shutdown,
            tracker,
            _dir: dir,
        }
    }

    pub async fn ask(&self, question: &str) -> (ChatJob, Result<ChatOutcome, ClientError>) {
        let job = toolfleet::client::question(question);
        let out = self.submit(&job).await;
        (job, out)
    }

    pub async fn submit(&self, job: &ChatJob) -> Result<ChatOutcome, ClientError> {
        tokio::time::timeout(
            WAIT,
            toolfleet::client::chat(&self.client, &self.subjects, job, WAIT, |_| {}),
        )
        .await
        .expect("chat timed out")
    }

    /// Every Redis key of an invocation.
    pub async fn keys(&self, invocation_id: &str) -> Vec<String> {
        let mut c = self.redis_conn.clone();
        let mut keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("toolfleet:{{{invocation_id}}}:*"))
            .query_async(&mut c)
            .await
            .unwrap();
        keys.sort();
        keys
    }

    pub async fn ttl(&self, key: &str) -> i64 {
        let mut c = self.redis_conn.clone();
        redis::cmd("TTL")
            .arg(key)
            .query_async(&mut c)
            .await
            .unwrap()
    }

    pub async fn metrics_text(&self) -> String {
        let url = format!("http://{}/metrics", self.metrics_addr);
        reqwest_get(&url).await
    }

    /// Subscribes (and flushes, so the subscription is live).
    pub async fn subscribe(&self, subject: String) -> async_nats::Subscriber {
        let s = self.client.subscribe(subject).await.unwrap();
        self.client.flush().await.unwrap();
        s
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

/// A plain HTTP GET over a TCP socket, so tests need no TLS setup.
pub async fn reqwest_get(url: &str) -> String {
    toolfleet::llm::install_crypto_provider();
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

pub async fn next_json(sub: &mut async_nats::Subscriber) -> serde_json::Value {
    let msg = tokio::time::timeout(WAIT, sub.next())
        .await
        .expect("no message in time")
        .expect("subscription closed");
    serde_json::from_slice(&msg.payload).unwrap()
}

/// A script for the question "What time is it, and how do lighthouses warn
/// ships?": both tools in one round, then an answer quoting both.
pub fn lighthouse_script() -> serde_json::Value {
    serde_json::json!({
        "rules": [{
            "whenUserContains": ["lighthouse"],
            "steps": [
                { "toolCalls": [
                    { "name": "current_datetime", "arguments": {} },
                    { "name": "search_documents", "arguments": { "query": "lighthouse fog signals warn ships", "limit": 3 } }
                ] },
                { "answer": "It is {{tool:current_datetime}}. Lighthouses: {{tool:search_documents}}" }
            ]
        }],
        "default": { "steps": [ { "answer": "no script" } ] }
    })
}
