//! The fleet `toolfleet bench` measures, in one of two shapes:
//!
//! - **in-process** (the default): the orchestrator (chat mode) and the
//!   workers run as tasks of the bench's own process, as `toolfleet up`
//!   runs them; the scripted model too unless `--model-process`.
//! - **processes** (`--processes`): the scripted model
//!   (`toolfleet scripted-model`), the orchestrator (the
//!   `toolfleet-orchestrator` binary beside this one) and `--workers` worker
//!   processes (`toolfleet bench-worker`) each run on their own, configured
//!   by `TOOLFLEET_*` variables as `docker-compose.yml` runs them, so that
//!   the orchestrator's own memory can be read from `/proc/<pid>/status`
//!   and worker processes can be added to see how a pool scales.
//!
//! Every worker, in either shape, also serves `bench:sleep@1.0.0`, a tool
//! that waits the milliseconds it is asked for: a stand-in for a tool's own
//! work when measuring how a pool scales.
//!
//! When the tool under test is an LLM tool ([`Shape::llm_tools`]), the
//! scripted model runs in tool mode too and the workers also run the LLM
//! tools family against it (one deployment, as the demo's orchestrator
//! has); worker processes are told the model through
//! [`ENV_BENCH_MODEL_URL`] and its neighbours. Otherwise that family is
//! left out: in chat mode its tools would be offered to the model with
//! every request and change what the chat figures measure.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use anyhow::Context;
use serde::Deserialize;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use toolfleet_config::FleetConfig;
use toolfleet_llm::deployments::{Deployment, EnvSource};
use toolfleet_local::fleet::FleetSpec;
use toolfleet_orchestrator::OrchestratorConfig;
use toolfleet_worker::{Tool, ToolCtx, ToolError, ToolOutput, Worker, WorkerError};

use crate::bench::Memory;
use crate::families::IndexArgs;
use crate::local::{LocalArgs, LocalServers};

/// The id of the bench's own tool.
pub const SLEEP_TOOL: &str = "bench:sleep@1.0.0";

/// The model's base URL (including `/v1`) for the LLM tools family of a
/// `toolfleet bench-worker` process; unset: that family is not started.
/// The bench's own variables (not `TOOLFLEET_LLM_*`), so that a model an
/// operator's shell points at never reaches a bench worker.
pub const ENV_BENCH_MODEL_URL: &str = "TOOLFLEET_BENCH_MODEL_URL";
/// The model name for [`ENV_BENCH_MODEL_URL`].
pub const ENV_BENCH_MODEL: &str = "TOOLFLEET_BENCH_MODEL";
/// The first-token timeout for [`ENV_BENCH_MODEL_URL`], in ms (default:
/// the client's).
pub const ENV_BENCH_MODEL_FIRST_TOKEN_TIMEOUT_MS: &str =
    "TOOLFLEET_BENCH_MODEL_FIRST_TOKEN_TIMEOUT_MS";

const SLEEP_DEFINITION: &str = r#"{
  "schemaVersion": 1,
  "id": "bench:sleep@1.0.0",
  "implementationKey": "bench.sleep",
  "title": "Sleep (benchmark stand-in)",
  "description": "Waits the given number of milliseconds, then answers: a stand-in for a tool's own work in toolfleet bench --mode tool.",
  "category": "utility",
  "selectable": false,
  "function": {
    "name": "bench_sleep",
    "description": "Wait ms milliseconds, then answer.",
    "strict": false,
    "parameters": {
      "type": "object",
      "properties": { "ms": { "type": "integer", "minimum": 0, "maximum": 600000 } },
      "additionalProperties": false
    }
  },
  "timeoutMs": 660000,
  "delivery": "jetstream",
  "parallelSafe": true
}"#;

struct Sleep;

#[derive(Deserialize)]
struct SleepArgs {
    #[serde(default)]
    ms: u64,
}

impl Tool for Sleep {
    type Args = SleepArgs;
    async fn call(&self, _ctx: &ToolCtx, args: SleepArgs) -> Result<ToolOutput, ToolError> {
        // 0 answers at once (a timer would round it up to a millisecond):
        // `--tool-delay-ms 0` measures a tool that keeps a result ledger.
        if args.ms > 0 {
            tokio::time::sleep(Duration::from_millis(args.ms)).await;
        }
        Ok(ToolOutput::text(format!("slept {} ms", args.ms)))
    }
}

/// The worker serving `bench:sleep@1.0.0`.
pub fn sleep_worker() -> Result<Worker, WorkerError> {
    Worker::builder("bench")
        .definition_json(SLEEP_DEFINITION)
        .tool("bench.sleep", Sleep)
        .build()
}

/// A bench worker process's workers: every family this command ships,
/// plus the bench's own tool; the LLM tools family only when
/// [`ENV_BENCH_MODEL_URL`] names a model ([`models_from_env`]).
pub async fn bench_workers(definitions: &Path, index: &IndexArgs) -> anyhow::Result<Vec<Worker>> {
    let models = models_from_env(&toolfleet_llm::deployments::ProcessEnv)?;
    bench_workers_with(definitions, index, models.as_ref()).await
}

/// Every family this command ships, plus the bench's own tool; the LLM
/// tools family only with `models`.
pub async fn bench_workers_with(
    definitions: &Path,
    index: &IndexArgs,
    models: Option<&FleetConfig>,
) -> anyhow::Result<Vec<Worker>> {
    let mut workers = crate::families::all(&crate::families::Inputs {
        definitions,
        index,
        models,
    })
    .await?;
    workers.push(sleep_worker()?);
    Ok(workers)
}

/// The bench's model deployment, one profile on one deployment: the
/// scripted stand-in at `base_url`, answering as `model`.
pub fn bench_models(base_url: url::Url, model: &str, first_token_timeout: Duration) -> FleetConfig {
    let mut deployment = Deployment::new(base_url, model);
    deployment.first_token_timeout = first_token_timeout;
    FleetConfig::single(deployment).with_data_source("handbook")
}

/// [`bench_models`] from a worker process's environment
/// ([`ENV_BENCH_MODEL_URL`], [`ENV_BENCH_MODEL`],
/// [`ENV_BENCH_MODEL_FIRST_TOKEN_TIMEOUT_MS`]); `None` when no URL is set.
pub fn models_from_env(env: &dyn EnvSource) -> anyhow::Result<Option<FleetConfig>> {
    let Some(url) = env
        .var(ENV_BENCH_MODEL_URL)
        .filter(|u| !u.trim().is_empty())
    else {
        return Ok(None);
    };
    let url =
        url::Url::parse(url.trim()).with_context(|| format!("{ENV_BENCH_MODEL_URL}={url:?}"))?;
    let model = env
        .var(ENV_BENCH_MODEL)
        .filter(|m| !m.trim().is_empty())
        .with_context(|| format!("{ENV_BENCH_MODEL_URL} is set but {ENV_BENCH_MODEL} is not"))?;
    let first_token_timeout = match env.var(ENV_BENCH_MODEL_FIRST_TOKEN_TIMEOUT_MS) {
        Some(ms) => Duration::from_millis(
            ms.trim()
                .parse()
                .with_context(|| format!("{ENV_BENCH_MODEL_FIRST_TOKEN_TIMEOUT_MS}={ms:?}"))?,
        ),
        None => toolfleet_llm::DEFAULT_FIRST_TOKEN_TIMEOUT,
    };
    Ok(Some(bench_models(url, model.trim(), first_token_timeout)))
}

/// How the fleet is laid out.
#[derive(Debug, Clone)]
pub struct Shape {
    /// Run an orchestrator and a model (chat mode).
    pub chat: bool,
    /// Run a model and the LLM tools family against it (tool mode, an LLM
    /// tool under test).
    pub llm_tools: bool,
    /// The scripted model in a process of its own.
    pub model_process: bool,
    /// Orchestrator and workers as processes of their own.
    pub processes: bool,
    /// Worker processes (with `processes`).
    pub workers: usize,
    /// Tool jobs each worker process (or the in-process workers) runs at
    /// once.
    pub worker_concurrency: usize,
    /// Chat jobs the orchestrator runs at once.
    pub orchestrator_in_flight: usize,
    pub script: PathBuf,
    /// The scripted model's pause before every first token.
    pub model_delay: Duration,
}

enum Model {
    None,
    InProcess(toolfleet_scripted::ScriptedServer),
    Process(Proc),
}

/// A running bench fleet. [`BenchFleet::stop`] takes it down.
pub struct BenchFleet {
    pub nats_url: String,
    pub subjects: toolfleet_protocol::Subjects,
    pub client: async_nats::Client,
    /// The orchestrator's process, when it has one.
    pub orchestrator: Option<Orchestrator>,
    /// The model's process id, when it has one.
    pub model_pid: Option<u32>,
    /// When its last worker was up.
    pub started: std::time::Instant,
    /// The model deployment of the orchestrator and the LLM tools family
    /// (the scripted stand-in), when the fleet has a model.
    pub models: Option<FleetConfig>,
    servers: LocalServers,
    model: Model,
    workers: Vec<Proc>,
    shutdown: CancellationToken,
    tracker: TaskTracker,
    _work: tempfile::TempDir,
}

/// The orchestrator's process: where to read its memory and metrics.
pub struct Orchestrator {
    pub pid: u32,
    pub metrics_port: u16,
    proc: Proc,
}

impl BenchFleet {
    /// Starts the fleet in `shape` on the servers of `local` (reused or
    /// child processes), each part once it answers.
    pub async fn start(local: &LocalArgs, shape: &Shape) -> anyhow::Result<Self> {
        let servers = LocalServers::start(local)?;
        let subjects = toolfleet_protocol::Subjects::new(toolfleet_protocol::DEFAULT_PREFIX)?;
        let work = tempfile::tempdir()?;
        let index = IndexArgs::tantivy(work.path().join("index"), local.corpus.clone());
        let started = StartedModel::start(shape).await?;
        let models = started.models();
        // The LLM tools family only when its tool is under test.
        let llm_models = models.as_ref().filter(|_| shape.llm_tools);

        let shutdown = CancellationToken::new();
        let tracker = TaskTracker::new();
        let mut workers = Vec::new();
        let mut orchestrator = None;
        if shape.processes {
            let children = Children {
                servers: &servers,
                model: &started,
                shape,
            };
            for i in 0..shape.workers.max(1) {
                workers.push(
                    children
                        .worker(i, local, &index, llm_models.is_some())
                        .await?,
                );
            }
            if let Some(model_url) = started.url.as_ref().filter(|_| shape.chat) {
                orchestrator = Some(children.orchestrator(model_url).await?);
            }
        } else {
            let orchestrator_config = match models.as_ref().filter(|_| shape.chat) {
                Some(models) => {
                    let mut config = OrchestratorConfig::new(subjects.clone(), models.clone());
                    config.max_in_flight = shape.orchestrator_in_flight;
                    Some(config)
                }
                None => None,
            };
            let spec = FleetSpec {
                nats_url: servers.nats_url.clone(),
                redis_url: servers.redis_url.clone(),
                subjects: subjects.clone(),
                citation_ttl: Duration::from_secs(3600),
                orchestrator: orchestrator_config,
                workers: bench_workers_with(&local.defs.dir, &index, llm_models).await?,
                worker_concurrency: shape.worker_concurrency,
                nats_connect_wait: Duration::from_secs(10),
                nats: None,
                redis: None,
            };
            let metrics = prometheus::Registry::new();
            toolfleet_local::fleet::start(spec, &metrics, &tracker, shutdown.clone()).await?;
            eprintln!("• fleet running in this process");
        }
        let client = toolfleet_service::args::connect_nats(
            &servers.nats_url,
            "toolfleet-bench",
            Duration::from_secs(5),
        )
        .await?;
        let model_pid = match &started.model {
            Model::Process(p) => Some(p.pid()),
            _ => None,
        };
        Ok(Self {
            nats_url: servers.nats_url.clone(),
            subjects,
            client,
            orchestrator,
            model_pid,
            started: std::time::Instant::now(),
            models,
            servers,
            model: started.model,
            workers,
            shutdown,
            tracker,
            _work: work,
        })
    }

    /// Takes the fleet down: SIGTERM to its processes (they drain), the
    /// in-process parts cancelled, then the servers.
    pub async fn stop(self) {
        eprint!("• shutting down … ");
        if let Some(o) = self.orchestrator {
            o.proc.stop();
        }
        for w in self.workers {
            w.stop();
        }
        self.shutdown.cancel();
        self.tracker.close();
        let _ = tokio::time::timeout(Duration::from_secs(10), self.tracker.wait()).await;
        match self.model {
            Model::InProcess(m) => m.shutdown().await,
            Model::Process(p) => p.stop(),
            Model::None => {}
        }
        drop(self.servers);
        eprintln!("done");
    }
}

/// The fleet's model as started: none (tool mode without an LLM tool),
/// the scripted stand-in in this process, or in a process of its own.
struct StartedModel {
    model: Model,
    /// Its base URL (including `/v1`), when there is a model.
    url: Option<url::Url>,
    /// The model name the script answers as.
    name: String,
    /// The deployment's first-token timeout: a slow model must not trip
    /// it.
    first_token_timeout: Duration,
}

impl StartedModel {
    async fn start(shape: &Shape) -> anyhow::Result<Self> {
        let script = toolfleet_scripted::Script::load(&shape.script)?
            .with_first_token_delay(shape.model_delay);
        let name = script.model().to_string();
        let first_token_timeout =
            Duration::from_secs(60).max(shape.model_delay * 2 + Duration::from_secs(10));
        let (model, url) = if !shape.chat && !shape.llm_tools {
            (Model::None, None)
        } else if shape.model_process || shape.processes {
            let port = toolfleet_local::servers::free_port()?;
            let proc = Proc::spawn(
                "scripted model",
                Command::new(std::env::current_exe()?)
                    .env("TOOLFLEET_LOG", "warn")
                    .args([
                        "scripted-model",
                        "--listen",
                        &format!("127.0.0.1:{port}"),
                        "--script",
                        &shape.script.display().to_string(),
                        "--first-token-delay-ms",
                        &shape.model_delay.as_millis().to_string(),
                    ]),
            )?;
            wait_http(port, "/v1/models").await?;
            eprintln!(
                "• model: the scripted stand-in, process {} on port {port}",
                proc.pid()
            );
            (
                Model::Process(proc),
                Some(url::Url::parse(&format!("http://127.0.0.1:{port}/v1"))?),
            )
        } else {
            let m =
                toolfleet_scripted::ScriptedServer::start("127.0.0.1:0".parse()?, script).await?;
            let url = m.base_url();
            eprintln!("• model: the scripted stand-in in this process at {url}");
            (Model::InProcess(m), Some(url))
        };
        Ok(Self {
            model,
            url,
            name,
            first_token_timeout,
        })
    }

    /// The deployment of the orchestrator and the LLM tools family, when
    /// there is a model.
    fn models(&self) -> Option<FleetConfig> {
        self.url
            .as_ref()
            .map(|url| bench_models(url.clone(), &self.name, self.first_token_timeout))
    }
}

/// What the fleet's child processes (`--processes`) are started with.
struct Children<'a> {
    servers: &'a LocalServers,
    model: &'a StartedModel,
    shape: &'a Shape,
}

impl Children<'_> {
    /// The environment every child has, and `extra`.
    fn env(&self, extra: Vec<(&'static str, String)>) -> Vec<(&'static str, String)> {
        let mut v = vec![
            ("TOOLFLEET_NATS_URL", self.servers.nats_url.clone()),
            ("TOOLFLEET_REDIS_URL", self.servers.redis_url.clone()),
            ("TOOLFLEET_LOG", "warn".to_string()),
        ];
        v.extend(extra);
        v
    }

    /// Worker process `i` (`toolfleet bench-worker`), once healthy; with
    /// the LLM tools family against the model when `llm_tools`.
    async fn worker(
        &self,
        i: usize,
        local: &LocalArgs,
        index: &IndexArgs,
        llm_tools: bool,
    ) -> anyhow::Result<Proc> {
        let port = toolfleet_local::servers::free_port()?;
        let mut cmd = Command::new(std::env::current_exe()?);
        cmd.args(["bench-worker", "--index-dir"])
            .arg(&index.index_dir)
            .arg("--corpus-dir")
            .arg(&index.corpus_dir)
            .arg("--tool-definitions")
            .arg(&local.defs.dir)
            .args(["--concurrency", &self.shape.worker_concurrency.to_string()])
            .envs(self.env(vec![(
                "TOOLFLEET_METRICS_ADDR",
                format!("127.0.0.1:{port}"),
            )]));
        match (llm_tools, &self.model.url) {
            (true, Some(url)) => {
                cmd.env(ENV_BENCH_MODEL_URL, url.as_str())
                    .env(ENV_BENCH_MODEL, &self.model.name)
                    .env(
                        ENV_BENCH_MODEL_FIRST_TOKEN_TIMEOUT_MS,
                        self.model.first_token_timeout.as_millis().to_string(),
                    );
            }
            _ => {
                cmd.env_remove(ENV_BENCH_MODEL_URL);
            }
        }
        let proc = Proc::spawn(&format!("worker {i}"), &mut cmd)?;
        wait_http(port, "/healthz").await?;
        eprintln!("• worker process {} ready", proc.pid());
        Ok(proc)
    }

    /// The orchestrator's process (`toolfleet-orchestrator` beside this
    /// binary) on the model at `model_url`, once healthy.
    async fn orchestrator(&self, model_url: &url::Url) -> anyhow::Result<Orchestrator> {
        let bin = sibling_bin("toolfleet-orchestrator")?;
        let port = toolfleet_local::servers::free_port()?;
        let mut cmd = Command::new(&bin);
        cmd.envs(self.env(vec![
            ("TOOLFLEET_METRICS_ADDR", format!("127.0.0.1:{port}")),
            ("TOOLFLEET_LLM_BASE_URL", model_url.to_string()),
            ("TOOLFLEET_LLM_MODEL", self.model.name.clone()),
            ("TOOLFLEET_LLM_API_KEY", "sk-bench-stand-in".into()),
            (
                "TOOLFLEET_LLM_FIRST_TOKEN_TIMEOUT_MS",
                self.model.first_token_timeout.as_millis().to_string(),
            ),
            (
                "TOOLFLEET_MAX_IN_FLIGHT",
                self.shape.orchestrator_in_flight.to_string(),
            ),
        ]));
        let proc = Proc::spawn("orchestrator", &mut cmd)?;
        wait_http(port, "/healthz").await?;
        eprintln!("• orchestrator process {} ready", proc.pid());
        Ok(Orchestrator {
            pid: proc.pid(),
            metrics_port: port,
            proc,
        })
    }
}

/// What the orchestrator's process held while the jobs waited.
#[derive(Debug, Clone, Default, serde::Serialize)]
pub struct OrchestratorMemory {
    pub pid: u32,
    /// RSS before the measured run (after the warm-up), KiB.
    pub idle_rss_kib: u64,
    /// The largest RSS sampled during the run, KiB.
    pub peak_rss_kib: u64,
    /// `VmHWM` at the end of the run, KiB.
    pub hwm_kib: u64,
    /// The most chat jobs in flight seen on its `/metrics`.
    pub max_in_flight: u64,
    /// (peak − idle) / max in flight, KiB.
    pub per_invocation_kib: f64,
}

/// Samples an orchestrator's memory and chat jobs in flight until stopped.
pub struct Sampler {
    stop: CancellationToken,
    task: tokio::task::JoinHandle<()>,
    peak_rss: Arc<AtomicU64>,
    max_in_flight: Arc<AtomicU64>,
    pid: u32,
    idle_rss_kib: u64,
}

impl Sampler {
    /// Starts sampling `o` (its idle RSS is read now).
    pub fn start(o: &Orchestrator) -> Self {
        let pid = o.pid;
        let idle_rss_kib = Memory::of(&pid.to_string()).unwrap_or_default().rss_kib;
        let (stop, peak_rss, max_in_flight) = (
            CancellationToken::new(),
            Arc::new(AtomicU64::new(idle_rss_kib)),
            Arc::new(AtomicU64::new(0)),
        );
        let port = o.metrics_port;
        let task = {
            let (stop, peak_rss, max_in_flight) =
                (stop.clone(), peak_rss.clone(), max_in_flight.clone());
            tokio::spawn(async move {
                let mut tick = 0u32;
                while !stop.is_cancelled() {
                    if let Some(m) = Memory::of(&pid.to_string()) {
                        peak_rss.fetch_max(m.rss_kib, Ordering::Relaxed);
                    }
                    if tick.is_multiple_of(4)
                        && let Some(n) = scrape_gauge(port, "toolfleet_chat_jobs_in_flight").await
                    {
                        max_in_flight.fetch_max(n as u64, Ordering::Relaxed);
                    }
                    tick += 1;
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(Duration::from_millis(250)) => {}
                    }
                }
            })
        };
        Self {
            stop,
            task,
            peak_rss,
            max_in_flight,
            pid,
            idle_rss_kib,
        }
    }

    pub async fn finish(self) -> OrchestratorMemory {
        self.stop.cancel();
        let _ = self.task.await;
        let hwm_kib = Memory::of(&self.pid.to_string())
            .unwrap_or_default()
            .hwm_kib;
        let peak = self.peak_rss.load(Ordering::Relaxed);
        let in_flight = self.max_in_flight.load(Ordering::Relaxed);
        OrchestratorMemory {
            pid: self.pid,
            idle_rss_kib: self.idle_rss_kib,
            peak_rss_kib: peak,
            hwm_kib,
            max_in_flight: in_flight,
            per_invocation_kib: if in_flight > 0 {
                peak.saturating_sub(self.idle_rss_kib) as f64 / in_flight as f64
            } else {
                0.0
            },
        }
    }
}

/// A child process of the bench, stopped (SIGTERM, then SIGKILL) on drop.
struct Proc {
    name: String,
    child: Option<Child>,
}

impl Proc {
    fn spawn(name: &str, cmd: &mut Command) -> anyhow::Result<Self> {
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .with_context(|| format!("starting the {name}: {cmd:?}"))?;
        Ok(Self {
            name: name.to_string(),
            child: Some(child),
        })
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().map_or(0, Child::id)
    }

    /// SIGTERM, up to 15 s to drain, then SIGKILL.
    fn stop(mut self) {
        self.terminate(Duration::from_secs(15));
    }

    fn terminate(&mut self, grace: Duration) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let deadline = std::time::Instant::now() + grace;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        eprintln!("({} did not drain in {grace:?}; killed) ", self.name);
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.terminate(Duration::from_secs(2));
    }
}

/// A binary built beside this one (`target/release/toolfleet-orchestrator`
/// next to `target/release/toolfleet`).
fn sibling_bin(name: &str) -> anyhow::Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let path = exe.with_file_name(name);
    anyhow::ensure!(
        path.exists(),
        "{} is missing: build it beside this binary (cargo build --release -p {name})",
        path.display()
    );
    Ok(path)
}

/// One HTTP/1.0 GET on loopback; the status code and body.
async fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    let addr: SocketAddr = ([127, 0, 0, 1], port).into();
    let mut s = tokio::time::timeout(Duration::from_secs(2), tokio::net::TcpStream::connect(addr))
        .await
        .ok()?
        .ok()?;
    s.write_all(format!("GET {path} HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").as_bytes())
        .await
        .ok()?;
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut text))
        .await
        .ok()?
        .ok()?;
    let status = text.split_whitespace().nth(1)?.parse().ok()?;
    let body = text.split_once("\r\n\r\n").map(|(_, b)| b.to_string())?;
    Some((status, body))
}

/// Waits up to 60 s for `GET path` to answer 200.
async fn wait_http(port: u16, path: &str) -> anyhow::Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        if let Some((200, _)) = http_get(port, path).await {
            return Ok(());
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "nothing answered GET {path} on port {port} within 60 s"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A gauge's value on a `/metrics` page.
async fn scrape_gauge(port: u16, name: &str) -> Option<f64> {
    let (_, body) = http_get(port, "/metrics").await?;
    gauge(&body, name)
}

fn gauge(metrics: &str, name: &str) -> Option<f64> {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(name)?.strip_prefix(' '))?
        .trim()
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sleep_worker_builds() {
        let w = sleep_worker().expect("the bench tool's definition is valid");
        let ids: Vec<String> = w.definitions().map(|d| d.id.to_string()).collect();
        assert_eq!(ids, vec![SLEEP_TOOL.to_string()]);
    }

    #[test]
    fn a_bench_worker_reads_its_model_from_the_bench_variables_only() {
        use std::collections::BTreeMap;
        let env = |pairs: &[(&str, &str)]| -> BTreeMap<String, String> {
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect()
        };
        // No bench model: no LLM tools family, whatever TOOLFLEET_LLM_* say.
        let none = models_from_env(&env(&[(
            "TOOLFLEET_LLM_BASE_URL",
            "https://api.openai.com/v1",
        )]))
        .unwrap();
        assert!(none.is_none());
        let models = models_from_env(&env(&[
            (ENV_BENCH_MODEL_URL, "http://127.0.0.1:4321/v1"),
            (ENV_BENCH_MODEL, "toolfleet-scripted"),
            (ENV_BENCH_MODEL_FIRST_TOKEN_TIMEOUT_MS, "90000"),
        ]))
        .unwrap()
        .expect("a model");
        assert_eq!(
            toolfleet_worker_llm::default_model_of(&models.models()).as_deref(),
            Some("default/toolfleet-scripted")
        );
        let deployment = &models.deployments["default"];
        assert_eq!(deployment.base_url.as_str(), "http://127.0.0.1:4321/v1");
        assert_eq!(deployment.first_token_timeout, Duration::from_secs(90));
        let no_name = models_from_env(&env(&[(ENV_BENCH_MODEL_URL, "http://127.0.0.1:4321/v1")]));
        assert!(no_name.is_err());
        let bad_url = models_from_env(&env(&[
            (ENV_BENCH_MODEL_URL, "not a url"),
            (ENV_BENCH_MODEL, "m"),
        ]));
        assert!(bad_url.is_err());
    }

    #[test]
    fn gauges_are_read_from_the_exposition_text() {
        let text = "# HELP toolfleet_chat_jobs_in_flight x\n# TYPE toolfleet_chat_jobs_in_flight gauge\ntoolfleet_chat_jobs_in_flight 9876\ntoolfleet_chat_jobs_in_flight_other 1\n";
        assert_eq!(gauge(text, "toolfleet_chat_jobs_in_flight"), Some(9876.0));
        assert_eq!(gauge(text, "missing"), None);
    }
}
