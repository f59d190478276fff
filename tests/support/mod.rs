//! Test harness: real `nats-server -js` and `redis-server` child processes
//! on free loopback ports (killed on drop), the scripted model server on
//! 127.0.0.1:0, and the fleet running in-process through the same
//! `fleet::start` the binaries call.

// Each test module uses a part of the support; the rest is dead to it.
#![allow(dead_code)]

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use toolfleet::families::IndexArgs;
use toolfleet_local::fleet::FleetSpec;
use toolfleet_local::servers::{NatsServer, RedisServer};
use toolfleet_orchestrator::OrchestratorConfig;
use toolfleet_protocol::client::{ChatOutcome, ClientError};
use toolfleet_protocol::{ChatJob, Subjects};
use toolfleet_scripted::{Script, ScriptedServer};

// The bound on every await, and the next JSON message within it: from the
// testkit, which the crates' own tests share.
pub(crate) use toolfleet_testkit::wait::{WAIT, next_json};

pub(crate) mod identities;

pub(crate) fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

pub(crate) struct Env {
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

pub(crate) struct Options {
    pub workers: Vec<&'static str>,
    pub tweak: fn(&mut OrchestratorConfig),
    /// A profiles file; `{base_url}` is replaced by the scripted server's
    /// URL. Without it: one default profile on the scripted server.
    pub profiles_toml: Option<String>,
    /// The environment the orchestrator reads API-key variables from.
    pub env: Vec<(&'static str, &'static str)>,
    /// Tool definitions directory (default: the shipped one).
    pub defs_dir: Option<PathBuf>,
    /// The data source of every profile that names none (default: the
    /// shipped corpus, `handbook`), searched through its tools only:
    /// preemptive retrieval (tested on its own) would add a search to
    /// every job.
    pub data_source: Option<&'static str>,
    /// The tenant the shipped corpus is ingested for (default `default`):
    /// retrieval finds only the asking tenant's documents.
    pub corpus_tenant: Option<&'static str>,
    /// Runs no orchestrator in-process (the test starts its own, e.g. as
    /// processes it can kill).
    pub no_orchestrator: bool,
    /// The NATS server's settings (e.g. a monitoring port).
    pub nats: toolfleet_local::servers::NatsConfig,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            workers: vec!["system", "retrieval"],
            tweak: |_| {},
            profiles_toml: None,
            env: Vec::new(),
            defs_dir: None,
            data_source: Some("handbook"),
            corpus_tenant: None,
            no_orchestrator: false,
            nats: Default::default(),
        }
    }
}

impl Env {
    pub(crate) async fn start(script: serde_json::Value) -> Env {
        Self::start_with(script, Options::default()).await
    }

    /// A fleet with no worker of its own (the test brings its own).
    pub(crate) async fn start_bare(script: serde_json::Value) -> Env {
        Self::start_only(script, &[]).await
    }

    /// A fleet with only these worker families.
    pub(crate) async fn start_only(script: serde_json::Value, workers: &[&'static str]) -> Env {
        Self::start_with(
            script,
            Options {
                workers: workers.to_vec(),
                ..Options::default()
            },
        )
        .await
    }

    pub(crate) async fn start_with(script: serde_json::Value, options: Options) -> Env {
        let nats = NatsServer::start_configured(options.nats.clone()).expect("nats-server");
        let redis = RedisServer::start().expect("redis-server");
        let script = Script::from_json(&script.to_string()).expect("script");
        let model = ScriptedServer::start("127.0.0.1:0".parse().unwrap(), script)
            .await
            .expect("scripted model");
        let dir = tempfile::tempdir().unwrap();
        let subjects = Subjects::new("toolfleet").unwrap();
        let profiles = match &options.profiles_toml {
            Some(text) => toolfleet_config::FleetConfig::from_toml(
                &text.replace("{base_url}", model.base_url().as_str()),
                "test profiles",
            )
            .expect("test profiles"),
            None => toolfleet_config::FleetConfig::single(
                toolfleet_llm::deployments::Deployment::new(model.base_url(), "toolfleet-scripted")
                    .with_api_key("sk-test-secret-never-logged".to_string()),
            ),
        };
        let mut profiles = profiles;
        if let Some(data_source) = options.data_source {
            for profile in profiles.profiles.values_mut() {
                if profile.data_source.is_none() {
                    profile.data_source = Some(data_source.to_owned());
                    profile.rag.prefetch = false;
                }
            }
        }
        let mut orchestrator = OrchestratorConfig::new(subjects.clone(), profiles);
        orchestrator.env = Arc::new(
            options
                .env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect::<HashMap<String, String>>(),
        );
        (options.tweak)(&mut orchestrator);
        let workers = toolfleet::families::some(
            &options.workers,
            &toolfleet::families::Inputs {
                definitions: &options
                    .defs_dir
                    .clone()
                    .unwrap_or_else(|| root().join("tool_definitions")),
                index: &IndexArgs {
                    corpus_tenant: options.corpus_tenant.unwrap_or("default").into(),
                    ..IndexArgs::tantivy(dir.path().join("index"), root().join("examples/corpus"))
                },
                models: Some(&*orchestrator.profiles),
            },
        )
        .await
        .expect("families");
        let spec = FleetSpec {
            nats_url: nats.url(),
            redis_url: redis.url(),
            subjects: subjects.clone(),
            citation_ttl: Duration::from_secs(600),
            orchestrator: (!options.no_orchestrator).then_some(orchestrator),
            workers,
            worker_concurrency: 16,
            nats_connect_wait: Duration::from_secs(10),
            nats: None,
            redis: None,
        };
        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let metrics = prometheus::Registry::new();
        let metrics_addr = toolfleet_service::metrics::spawn(
            "127.0.0.1:0".parse().unwrap(),
            metrics.clone(),
            shutdown.clone(),
        )
        .await
        .unwrap();
        tokio::time::timeout(
            WAIT,
            toolfleet_local::fleet::start(spec, &metrics, &tracker, shutdown.clone()),
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

    pub(crate) async fn ask(&self, question: &str) -> (ChatJob, Result<ChatOutcome, ClientError>) {
        let job = toolfleet_protocol::client::question(question);
        let out = self.submit(&job).await;
        (job, out)
    }

    pub(crate) async fn submit(&self, job: &ChatJob) -> Result<ChatOutcome, ClientError> {
        tokio::time::timeout(
            WAIT,
            toolfleet_protocol::client::chat(&self.client, &self.subjects, job, WAIT, |_| {}),
        )
        .await
        .expect("chat timed out")
    }

    /// Every Redis key of an invocation id, under any tenant
    /// (`toolfleet:{<tenant>/<id>}:…`).
    pub(crate) async fn keys(&self, invocation_id: &str) -> Vec<String> {
        let mut c = self.redis_conn.clone();
        let mut keys: Vec<String> = redis::cmd("KEYS")
            .arg(format!("toolfleet:{{*/{invocation_id}}}:*"))
            .query_async(&mut c)
            .await
            .unwrap();
        keys.sort();
        keys
    }

    /// The invocation's keys that tools wrote (citations, ledger): every
    /// key but the orchestrator's claim (`owner`), its run lease (`lease`)
    /// and its stored terminal event (`terminal`).
    pub(crate) async fn tool_keys(&self, invocation_id: &str) -> Vec<String> {
        let mut keys = self.keys(invocation_id).await;
        keys.retain(|k| {
            !k.ends_with(":owner") && !k.ends_with(":lease") && !k.ends_with(":terminal")
        });
        keys
    }

    /// A store on the fleet's Redis, as the fleet's processes open it.
    pub(crate) async fn store(&self) -> toolfleet_store::CitationStore {
        toolfleet_store::CitationStore::connect(
            &self.redis.url(),
            self.subjects.prefix(),
            Duration::from_secs(60),
        )
        .await
        .unwrap()
    }

    /// Waits until the fleet has written down a cancel of `invocation_id`
    /// of `tenant` (a tombstone, or a remembered cancel of an id not
    /// started yet).
    pub(crate) async fn wait_for_cancel_written(&self, tenant: &str, invocation_id: &str) {
        let store = self.store().await;
        let inv = toolfleet_store::InvocationKey::new(tenant, invocation_id);
        let deadline = tokio::time::Instant::now() + WAIT;
        while !store.is_cancelled(inv).await.unwrap() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the cancel of {tenant}/{invocation_id} was not written down"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub(crate) async fn ttl(&self, key: &str) -> i64 {
        let mut c = self.redis_conn.clone();
        redis::cmd("TTL")
            .arg(key)
            .query_async(&mut c)
            .await
            .unwrap()
    }

    pub(crate) async fn metrics_text(&self) -> String {
        let url = format!("http://{}/metrics", self.metrics_addr);
        reqwest_get(&url).await
    }

    /// Subscribes (and flushes, so the subscription is live).
    /// Subscribes to `job`'s events, then submits it: the events
    /// subscription, from the first event on.
    pub(crate) async fn follow_and_submit(&self, job: &ChatJob) -> async_nats::Subscriber {
        let events = self
            .subscribe(self.subjects.chat_events(job.tenant(), &job.invocation_id))
            .await;
        toolfleet_protocol::client::submit(&self.client, &self.subjects, job)
            .await
            .unwrap();
        events
    }

    pub(crate) async fn subscribe(&self, subject: String) -> async_nats::Subscriber {
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
pub(crate) async fn reqwest_get(url: &str) -> String {
    toolfleet_llm::install_crypto_provider();
    reqwest::get(url).await.unwrap().text().await.unwrap()
}

/// A script for the question "What time is it, and how do lighthouses warn
/// ships?": both tools in one round, then an answer quoting both.
pub(crate) fn lighthouse_script() -> serde_json::Value {
    serde_json::json!({
        "rules": [{
            "whenUserContains": ["lighthouse"],
            "steps": [
                { "toolCalls": [
                    { "name": "current_datetime", "arguments": {} },
                    { "name": "search_data_sources", "arguments": { "query": "lighthouse fog signals warn ships", "topK": 3 } }
                ] },
                { "answer": "It is {{tool:current_datetime}}. Lighthouses: {{tool:search_data_sources}}" }
            ]
        }],
        "default": { "steps": [ { "answer": "no script" } ] }
    })
}

/// Runs the `toolfleet` command against the fleet at `nats_url`: its exit
/// code, stdout and stderr.
pub(crate) fn toolfleet_at(nats_url: &str, args: &[&str]) -> (Option<i32>, String, String) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_toolfleet"))
        .args(args)
        .env("TOOLFLEET_NATS_URL", nats_url)
        .output()
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// A binary of another workspace package, built beside `toolfleet` (the
/// test command builds the whole workspace: `cargo nextest run
/// --workspace`).
/// Writes at `path` a fleet configuration with one deployment,
/// `scripted` (the scripted model at `base_url`), and one profile on it,
/// `default`.
pub(crate) fn write_scripted_config(path: &std::path::Path, base_url: &url::Url) {
    std::fs::write(
        path,
        format!(
            "[deployments.scripted]\nbase_url = \"{base_url}\"\nmodel = \"toolfleet-scripted\"\n\
             [profiles.default]\ndeployment = \"scripted\"\n"
        ),
    )
    .unwrap();
}

pub(crate) fn sibling_bin(name: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_BIN_EXE_toolfleet")).with_file_name(name);
    assert!(
        path.exists(),
        "{} is missing: build the whole workspace first (scripts/test does)",
        path.display()
    );
    path.to_string_lossy().into_owned()
}

/// Waits until the chat stream holds no message (every job acked or
/// terminated).
pub(crate) async fn chat_queue_drained(env: &Env) {
    let js = async_nats::jetstream::new(env.client.clone());
    let mut stream = js.get_stream(env.subjects.chat_stream()).await.unwrap();
    let deadline = tokio::time::Instant::now() + WAIT;
    while stream.info().await.unwrap().state.messages != 0 {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the queue keeps a message"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Kills a child process when dropped (a failed assertion must not leave
/// it running).
pub(crate) struct KillOnDrop<'a>(pub &'a mut std::process::Child);

impl Drop for KillOnDrop<'_> {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Each `tool_result` event's status and error code, in order.
pub(crate) fn result_codes(
    events: &[toolfleet_protocol::ChatEvent],
) -> Vec<(toolfleet_protocol::ToolStatus, Option<String>)> {
    events
        .iter()
        .filter_map(|e| match &e.body {
            toolfleet_protocol::ChatEventBody::ToolResult {
                status, error_code, ..
            } => Some((*status, error_code.clone())),
            _ => None,
        })
        .collect()
}

/// A worker of a test's own, serving beside the fleet of an [`Env`].
pub(crate) struct TestWorker {
    task: tokio::task::JoinHandle<Result<(), toolfleet_worker::WorkerError>>,
    shutdown: CancellationToken,
}

impl Env {
    /// Starts `worker` on this fleet's servers (its own NATS connection and
    /// metrics); returns once it takes jobs.
    pub(crate) async fn start_worker(&self, worker: toolfleet_worker::Worker) -> TestWorker {
        self.start_worker_with(
            worker,
            toolfleet_worker::WorkerConfig::new(self.subjects.clone()),
        )
        .await
    }

    /// [`Env::start_worker`] with a configuration of the test's own.
    pub(crate) async fn start_worker_with(
        &self,
        worker: toolfleet_worker::Worker,
        config: toolfleet_worker::WorkerConfig,
    ) -> TestWorker {
        let store = self.store().await;
        let shutdown = CancellationToken::new();
        let task =
            tokio::time::timeout(
                WAIT,
                worker.start(
                    async_nats::connect(self.nats.url()).await.unwrap(),
                    store,
                    config,
                    toolfleet_worker::metrics::WorkerMetrics::register_all(
                        &prometheus::Registry::new(),
                    )
                    .unwrap(),
                    shutdown.clone(),
                ),
            )
            .await
            .expect("the worker starts in time")
            .expect("the worker starts");
        TestWorker { task, shutdown }
    }
}

impl TestWorker {
    /// Stops the worker and waits for it to finish cleanly.
    pub(crate) async fn stop(self) {
        self.shutdown.cancel();
        tokio::time::timeout(WAIT, self.task)
            .await
            .expect("the worker stops in time")
            .expect("no panic")
            .expect("the worker stops cleanly");
    }
}

/// Asserts that nothing arrives on `sub` within `within`; `what` says what
/// an arrival would mean.
pub(crate) async fn assert_silent(sub: &mut async_nats::Subscriber, within: Duration, what: &str) {
    assert!(
        tokio::time::timeout(within, sub.next()).await.is_err(),
        "{what}"
    );
}

/// Every event of an invocation until its terminal one.
pub(crate) async fn events_until_terminal(
    events: &mut async_nats::Subscriber,
) -> Vec<serde_json::Value> {
    let mut out = Vec::new();
    loop {
        let ev = next_json(events).await;
        let terminal = ev["type"] == "completed" || ev["type"] == "error";
        out.push(ev);
        if terminal {
            return out;
        }
    }
}

/// The `type` of each event.
pub(crate) fn kinds(events: &[serde_json::Value]) -> Vec<&str> {
    events.iter().filter_map(|e| e["type"].as_str()).collect()
}

/// Makes the run lease of invocation `invocation_id` (of the default
/// tenant) `holder`'s for `ms`: what a live run elsewhere (or a run that
/// took this one over) leaves.
pub(crate) async fn set_lease(
    redis: &mut redis::aio::MultiplexedConnection,
    invocation_id: &str,
    holder: &str,
    ms: u64,
) {
    let () = redis::cmd("SET")
        .arg(format!("toolfleet:{{default/{invocation_id}}}:lease"))
        .arg(holder)
        .arg("PX")
        .arg(ms)
        .query_async(redis)
        .await
        .unwrap();
}

/// Publishes `payload` to `subject` with a raw header block, over a bare
/// TCP connection speaking the NATS protocol (the client library refuses
/// to send headers it could not read back), as `user` with its password
/// when given, and waits until the server has processed it.
pub(crate) async fn publish_raw(
    url: &str,
    user: Option<(&str, &str)>,
    subject: &str,
    header_block: &[u8],
    payload: &[u8],
) {
    use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
    let addr = url.trim_start_matches("nats://");
    let stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let (read, mut write) = stream.into_split();
    let mut lines = tokio::io::BufReader::new(read).lines();
    let info = lines.next_line().await.unwrap().unwrap();
    assert!(info.starts_with("INFO"), "{info}");
    let mut connect = serde_json::json!({
        "verbose": false, "pedantic": false, "headers": true, "protocol": 1,
    });
    if let Some((name, password)) = user {
        connect["user"] = name.into();
        connect["pass"] = password.into();
    }
    let mut out = format!("CONNECT {connect}\r\n").into_bytes();
    out.extend_from_slice(
        format!(
            "HPUB {subject} {} {}\r\n",
            header_block.len(),
            header_block.len() + payload.len()
        )
        .as_bytes(),
    );
    out.extend_from_slice(header_block);
    out.extend_from_slice(payload);
    out.extend_from_slice(b"\r\nPING\r\n");
    write.write_all(&out).await.unwrap();
    loop {
        let line = tokio::time::timeout(WAIT, lines.next_line())
            .await
            .unwrap()
            .unwrap()
            .unwrap();
        assert!(!line.starts_with("-ERR"), "{line}");
        if line == "PONG" {
            break;
        }
    }
}

/// Copies the definition files of `from` whose names start with `prefix`
/// (a family's, e.g. `retrieval.`) into `to`: a family's worker refuses to
/// start without every one of its tools' definitions.
pub(crate) fn copy_definitions(from: &Path, to: &Path, prefix: &str) {
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.starts_with(prefix) && name.ends_with(".json") {
            std::fs::copy(entry.path(), to.join(&name)).unwrap();
        }
    }
}

/// The retrieval family's tools, in id order.
pub(crate) const RETRIEVAL_TOOLS: [&str; 9] = [
    "entity_lookup",
    "list_documents",
    "read_document",
    "read_tabular_data",
    "retrieve_event_context",
    "retrieve_knowledge_context",
    "retrieve_profile_context",
    "search_data_sources",
    "search_documents",
];

/// A test tool's definition file in `dir`: the shipped
/// `system:current_datetime` one renamed to `<ns>:<name>@1.0.0`
/// (implementation key `<ns>.<name>`, function `<name>`), without its
/// output schema.
pub(crate) fn renamed_definition(dir: &Path, ns: &str, name: &str) -> PathBuf {
    let mut def: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tool_definitions/system.current_datetime.json"))
            .unwrap(),
    )
    .unwrap();
    let map = def.as_object_mut().unwrap();
    map.remove("$schema");
    map.remove("outputSchema");
    def["id"] = serde_json::json!(format!("{ns}:{name}@1.0.0"));
    def["implementationKey"] = serde_json::json!(format!("{ns}.{name}"));
    def["function"]["name"] = serde_json::json!(name);
    let path = dir.join(format!("{ns}.{name}.json"));
    std::fs::write(&path, def.to_string()).unwrap();
    path
}

/// Starts an orchestrator alone (no worker) with `config` on the servers
/// at `nats_url` and `redis_url`, on a runtime of its own: the test stops
/// it with `drain`.
pub(crate) async fn start_orchestrator(
    nats_url: String,
    redis_url: String,
    config: OrchestratorConfig,
) -> toolfleet_service::Runtime {
    let rt = toolfleet_service::Runtime::new();
    let spec = FleetSpec {
        nats_url,
        redis_url,
        subjects: config.subjects.clone(),
        citation_ttl: Duration::from_secs(60),
        orchestrator: Some(config),
        workers: Vec::new(),
        worker_concurrency: 1,
        nats_connect_wait: Duration::from_secs(5),
        nats: None,
        redis: None,
    };
    tokio::time::timeout(
        WAIT,
        toolfleet_local::fleet::start(spec, &rt.metrics, &rt.tracker, rt.shutdown.clone()),
    )
    .await
    .expect("orchestrator start timed out")
    .expect("orchestrator start");
    rt
}

/// The most of `arrivals` within any `window` from one of them: how many
/// requests a server was answering at once, when each takes `window`.
pub(crate) fn most_at_once(arrivals: &[std::time::Instant], window: Duration) -> usize {
    arrivals
        .iter()
        .map(|start| {
            arrivals
                .iter()
                .filter(|at| **at >= *start && **at < *start + window)
                .count()
        })
        .max()
        .unwrap_or(0)
}

/// The value of metric `series` (name and labels, as exposed) summed over
/// `env`'s orchestrator and a `second` one.
pub(crate) async fn counted(env: &Env, second: &toolfleet_service::Runtime, series: &str) -> f64 {
    let mut text = env.metrics_text().await;
    text.push_str(
        &prometheus::TextEncoder::new()
            .encode_to_string(&second.metrics.gather())
            .unwrap(),
    );
    text.lines()
        .filter_map(|l| l.strip_prefix(series))
        .filter_map(|v| v.trim().parse::<f64>().ok())
        .sum()
}
