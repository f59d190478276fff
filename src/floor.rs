//! The floors the fleet's figures are measured against (`toolfleet bench
//! --floor`): on the same NATS server, in the same run, under the same
//! load, the bare transport a tool call rides on. On a shared machine
//! absolute numbers drift; the ratio of the fleet to these floors is the
//! result, so the bench drives the fleet and the floors in alternating
//! rounds ([`crate::bench::interleave`]): a change in the machine's other
//! load falls on both sides alike.
//!
//! - **JetStream work queue**: publish a job to a work-queue stream with
//!   the tools stream's settings (file storage, duplicate window, size and
//!   age limits) and a consumer with the tool consumers' settings, await the
//!   publish ack; a responder on a connection of its own pulls it, answers
//!   on core NATS to the reply subject named in a header, and acks it. The
//!   caller awaits the reply exactly as `--mode tool` does ([`Replies`]):
//!   one tool call's transport, with no validation, ledger or tool.
//! - **Core NATS request-reply**: a request to a queue-group responder on a
//!   connection of its own.
//! - **Direct model call** (an LLM tool under test): the model request the
//!   LLM tool makes for the same arguments — its prompt rendered per call
//!   (system and user message, no tools, the definition's temperature and
//!   token cap), sent through an [`LlmClient`] built from the same
//!   deployment as the worker's (same server, streaming setting, timeouts),
//!   the answer read as JSON when the tool's output is JSON. What a caller
//!   without the fleet would do to get the same answer: one HTTP call, no
//!   NATS, no worker, no argument or output-schema validation.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull};
use futures::StreamExt;
use serde_json::Value;
use tokio_util::sync::CancellationToken;
use toolfleet_config::FleetConfig;
use toolfleet_llm::deployments::ProcessEnv;
use toolfleet_protocol::tools::{OutputFormat, ToolDefinition, ToolId};
use toolfleet_worker_llm::LlmTool;

use crate::bench::{Load, Op, Replies, Summary, drive};

const REPLY_TO: &str = "Floor-Reply-To";
/// The tool consumers' ack wait and pending limit (worker runtime).
const ACK_WAIT: Duration = Duration::from_secs(30);
const MAX_ACK_PENDING: i64 = 10_000;
/// The most messages one of the floor responder's pull requests asks for.
const FLOOR_PULL_BATCH: usize = 1024;

/// A floor set up and ready to be driven: its name, its operation, and
/// what [`Floor::stop`] takes down.
pub struct Floor {
    pub name: &'static str,
    pub op: Op,
    /// Drive it through the fleet's warm-up before measuring: it holds
    /// connections of its own (the direct model call's HTTP pool) that the
    /// fleet's warm-up filled on the fleet's side.
    pub warm_up: bool,
    responder: Option<tokio::task::JoinHandle<()>>,
    stop: CancellationToken,
    /// The JetStream floor's own stream, deleted on stop.
    stream: Option<(jetstream::Context, String)>,
}

impl Floor {
    /// The JetStream work-queue round trip (see the module docs). Creates
    /// its own stream; the responder connects to `nats_url`.
    pub async fn jetstream(client: &async_nats::Client, nats_url: &str) -> anyhow::Result<Self> {
        let js = jetstream::new(client.clone());
        let id = uuid_token();
        let name = format!("FLOOR_{id}");
        let subject = format!("floor.{id}.jobs");
        let stream = js
            .get_or_create_stream(toolfleet_protocol::streams::work_queue_config(
                &name,
                &subject,
                2 * 3600,
            ))
            .await?;
        let consumer = stream
            .get_or_create_consumer(
                "floor",
                pull::Config {
                    durable_name: Some("floor".into()),
                    ack_policy: jetstream::consumer::AckPolicy::Explicit,
                    ack_wait: ACK_WAIT,
                    max_ack_pending: MAX_ACK_PENDING,
                    ..Default::default()
                },
            )
            .await?;
        let responder_client = toolfleet_service::args::connect_nats(
            nats_url,
            "toolfleet-floor",
            Duration::from_secs(5),
        )
        .await?;
        let stop = CancellationToken::new();
        let responder = tokio::spawn(pull_responder(consumer, responder_client, stop.clone()));
        let replies = Replies::subscribe(client, client.new_inbox()).await?;
        let op = publish_op(js.clone(), subject, replies);
        Ok(Self {
            name: "floor: jetstream work queue",
            op,
            warm_up: false,
            responder: Some(responder),
            stop,
            stream: Some((js, name)),
        })
    }

    /// The core NATS request-reply round trip to a queue-group responder.
    pub async fn request_reply(
        client: &async_nats::Client,
        nats_url: &str,
    ) -> anyhow::Result<Self> {
        let subject = format!("floor.{}.rr", uuid_token());
        let responder_client = toolfleet_service::args::connect_nats(
            nats_url,
            "toolfleet-floor",
            Duration::from_secs(5),
        )
        .await?;
        let mut sub = responder_client
            .queue_subscribe(subject.clone(), "floor".into())
            .await?;
        responder_client.flush().await?;
        let stop = CancellationToken::new();
        let responder = {
            let stop = stop.clone();
            tokio::spawn(async move {
                loop {
                    let msg = tokio::select! {
                        _ = stop.cancelled() => break,
                        m = sub.next() => match m { Some(m) => m, None => break },
                    };
                    if let Some(reply) = msg.reply {
                        let _ = responder_client.publish(reply, msg.payload).await;
                    }
                }
            })
        };
        // The responder's interest must have reached the requester's side
        // before the clock starts: one answered request says it has.
        let ready_by = tokio::time::Instant::now() + Duration::from_secs(5);
        while client
            .request(subject.clone(), bytes::Bytes::from_static(b"{}"))
            .await
            .is_err()
        {
            anyhow::ensure!(
                tokio::time::Instant::now() < ready_by,
                "the floor's responder never answered"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let client = client.clone();
        let op: Op = Arc::new(move |_| {
            let (client, subject) = (client.clone(), subject.clone());
            Box::pin(async move {
                match client
                    .request(subject, bytes::Bytes::from_static(b"{}"))
                    .await
                {
                    Ok(_) => Ok(0),
                    Err(e) => Err(format!("{:?}", e.kind()).to_ascii_lowercase()),
                }
            })
        });
        Ok(Self {
            name: "floor: core request-reply",
            op,
            warm_up: false,
            responder: Some(responder),
            stop,
            stream: None,
        })
    }

    /// The direct model call (see the module docs): the request the LLM
    /// tool `definition` (served from `definitions`) sends first for
    /// `arguments`, built by the worker's own code
    /// ([`toolfleet_worker_llm::LlmTool::first_request`]) on every call,
    /// sent to the default deployment of `models`, each call bounded by
    /// `timeout`. One call is made here: a script without an answer for
    /// the tool's prompt fails now, not as a floor of errors.
    pub async fn direct_model(
        models: &FleetConfig,
        definitions: &Path,
        definition: &ToolDefinition,
        arguments: Value,
        timeout: Duration,
    ) -> anyhow::Result<Self> {
        let direct = Arc::new(DirectCall::new(
            models,
            definitions,
            definition,
            arguments,
            timeout,
        )?);
        direct.call().await.map_err(|code| {
            anyhow::anyhow!(
                "the direct model call for {} failed ({code}): does the model's script answer \
                 this tool's prompt as the tool expects?",
                definition.id
            )
        })?;
        let op: Op = Arc::new(move |_| {
            let direct = direct.clone();
            Box::pin(async move { direct.call().await.map(|()| 0) })
        });
        Ok(Self {
            name: "floor: direct model call",
            op,
            warm_up: true,
            responder: None,
            stop: CancellationToken::new(),
            stream: None,
        })
    }

    /// The direct floor of chat jobs ([`crate::floor_chat`]): `op`
    /// answers a question with the same model calls and tool functions,
    /// without the fleet. Warmed up like the fleet (its HTTP pool).
    pub fn direct_chat(op: Op) -> Self {
        Self {
            name: "floor: direct chat",
            op,
            warm_up: true,
            responder: None,
            stop: CancellationToken::new(),
            stream: None,
        }
    }

    /// Stops the responder and deletes what the floor made.
    pub async fn stop(self) {
        self.stop.cancel();
        if let Some(responder) = self.responder {
            let _ = responder.await;
        }
        if let Some((js, name)) = self.stream {
            let _ = js.delete_stream(&name).await;
        }
    }

    /// Sets the floor up, drives it under `load` alone and takes it down.
    async fn measure(self, load: &Load) -> Summary {
        let report = drive(self.name, load, self.op.clone()).await;
        self.stop().await;
        report
    }
}

/// The JetStream work-queue floor alone under `load` (see [`Floor::jetstream`]).
pub async fn jetstream_round_trip(
    client: &async_nats::Client,
    nats_url: &str,
    load: &Load,
) -> anyhow::Result<Summary> {
    Ok(Floor::jetstream(client, nats_url)
        .await?
        .measure(load)
        .await)
}

/// The core request-reply floor alone under `load` (see
/// [`Floor::request_reply`]).
pub async fn request_reply(
    client: &async_nats::Client,
    nats_url: &str,
    load: &Load,
) -> anyhow::Result<Summary> {
    Ok(Floor::request_reply(client, nats_url)
        .await?
        .measure(load)
        .await)
}

/// The direct model call: the LLM tool (as the worker builds it, with the
/// worker's default model) whose first request is sent.
struct DirectCall {
    tool: LlmTool,
    id: ToolId,
    json: bool,
    arguments: Value,
    timeout: Duration,
}

impl DirectCall {
    fn new(
        models: &FleetConfig,
        definitions: &Path,
        definition: &ToolDefinition,
        arguments: Value,
        timeout: Duration,
    ) -> anyhow::Result<Self> {
        let models = models.models();
        let settings = toolfleet_worker_llm::Settings {
            default_model: toolfleet_worker_llm::default_model_of(&models),
            ..toolfleet_worker_llm::Settings::default()
        };
        let (tool, _) =
            toolfleet_worker_llm::llm_tool(definitions, &models, &ProcessEnv, &settings)?;
        // The variant for the model may change the format; the default
        // (first) model's is what the call expects.
        let json = definition.output_format == Some(OutputFormat::Json);
        Ok(Self {
            tool,
            id: definition.id.clone(),
            json,
            arguments,
            timeout,
        })
    }

    /// One call: `Ok` when the model answered (with JSON, for a `json`
    /// tool), else a short code.
    async fn call(&self) -> Result<(), String> {
        let (request, client) = self
            .tool
            .first_request(&self.id, &self.arguments)
            .map_err(|_| "prompt".to_string())?;
        let completion =
            tokio::time::timeout(self.timeout, client.stream_chat(&request, |_: &str| {}))
                .await
                .map_err(|_| "timeout".to_string())?
                .map_err(|e| e.code().to_string())?;
        if completion.text.trim().is_empty() {
            return Err("empty_reply".into());
        }
        if self.json {
            toolfleet_worker_llm::reply::parse_json(&completion.text)
                .map_err(|_| "not_json".to_string())?;
        }
        Ok(())
    }
}

/// The JetStream floor's responder: pulls each job, answers on core NATS
/// to the reply subject its header names, and acks it, until `stop`.
///
/// Pull requests of a bounded life, asked again as each ends: a
/// long-lived pull stream sometimes lost its request on a loaded machine
/// and left a whole floor round waiting out its timeout (30 s), which
/// flattered the fleet. The batch is larger than any load the bench puts
/// in flight, so it ends by expiring (once a second) rather than by
/// filling.
async fn pull_responder(
    consumer: jetstream::consumer::Consumer<pull::Config>,
    client: async_nats::Client,
    stop: CancellationToken,
) {
    'pulls: while !stop.is_cancelled() {
        let mut batch = match consumer
            .batch()
            .max_messages(FLOOR_PULL_BATCH)
            .expires(Duration::from_secs(1))
            .messages()
            .await
        {
            Ok(batch) => batch,
            Err(e) => {
                tracing::warn!(error = %e, "floor responder: cannot pull; asking again");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        loop {
            let msg = tokio::select! {
                _ = stop.cancelled() => break 'pulls,
                m = batch.next() => match m {
                    Some(Ok(m)) => m,
                    Some(Err(e)) => {
                        tracing::warn!(error = %e, "floor responder: pull error; asking again");
                        break;
                    }
                    None => break,
                },
            };
            if let Some(reply) = msg.headers.as_ref().and_then(|h| h.get(REPLY_TO)) {
                let _ = client.publish(reply.to_string(), msg.payload.clone()).await;
            }
            let _ = msg.ack().await;
        }
    }
}

/// The JetStream floor's operation: publish a job to `subject`, await
/// the publish ack, then the reply on `replies`, as `--mode tool` does.
fn publish_op(js: jetstream::Context, subject: String, replies: Replies) -> Op {
    Arc::new(move |i| {
        let (js, subject, replies) = (js.clone(), subject.clone(), replies.clone());
        Box::pin(async move {
            let key = format!("f{i}");
            let (reply, mut rx) = replies.expect(&key);
            let mut headers = async_nats::HeaderMap::new();
            headers.insert(REPLY_TO, reply.as_str());
            let body = bytes::Bytes::from_static(b"{\"arguments\":{}}");
            let result = async {
                let ack = js
                    .publish_with_headers(subject, headers, body)
                    .await
                    .map_err(|_| "publish".to_string())?;
                ack.await.map_err(|_| "publish_ack".to_string())?;
                tokio::time::timeout(Duration::from_secs(30), rx.recv())
                    .await
                    .map_err(|_| "timeout".to_string())?
                    .ok_or_else(|| "inbox_closed".to_string())?;
                Ok(0)
            }
            .await;
            replies.done(&key);
            result
        })
    })
}

/// A per-run token for the floor's subjects and stream.
fn uuid_token() -> String {
    toolfleet_protocol::client::new_invocation_id().replace('-', "_")
}
