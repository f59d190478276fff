//! What a worker sets up before it serves, and keeps up while it does: the
//! tools stream, each tool's durable consumer (shared by every copy of the
//! worker) and services-API endpoint, the cancel subscription, and the
//! tools' definitions in the fleet's catalog bucket.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, kv};
use async_nats::service::ServiceExt;
use async_nats::service::endpoint::Endpoint;
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::tools::ToolDefinition;
use toolfleet_protocol::{Subjects, ToolId, catalog};
use tracing::warn;

use super::config::WorkerConfig;
use crate::builder::{Served, Worker, WorkerError};
use crate::service_stats::JobStats;

/// A tool's durable consumer.
pub(super) type ToolConsumer = jetstream::consumer::Consumer<pull::Config>;

/// What a worker sets up before it serves: the services-API registration,
/// the catalog bucket, and per tool its consumer and endpoint.
pub(super) struct SetUp {
    pub(super) service: async_nats::service::Service,
    pub(super) catalog: kv::Store,
    pub(super) cancels: async_nats::Subscriber,
    pub(super) tools: Vec<(Arc<Served>, ToolConsumer, Endpoint)>,
}

/// Sets up everything `worker` serves with, or nothing: a worker that
/// cannot serve one of its tools serves none.
pub(super) async fn set_up(
    worker: &Worker,
    client: &async_nats::Client,
    config: &WorkerConfig,
    job_stats: Arc<JobStats>,
) -> Result<SetUp, WorkerError> {
    let nats = |e: &dyn std::fmt::Display| WorkerError::Nats(e.to_string());
    let js = jetstream::new(client.clone());
    let stream = toolfleet_protocol::streams::ensure_tools_stream(&js, &config.subjects)
        .await
        .map_err(|e| nats(&e))?;
    let catalog = catalog::bucket(&js, &config.subjects)
        .await
        .map_err(|e| nats(&e))?;
    let cancels = client
        .subscribe(config.subjects.chat_cancel_any())
        .await
        .map_err(|e| nats(&e))?;
    let service = client
        .service_builder()
        .description(format!("toolfleet worker: {}", worker.name))
        .metadata(HashMap::from([
            (catalog::META_WORKER.to_string(), worker.name.clone()),
            (
                catalog::META_FLEET.to_string(),
                config.subjects.prefix().to_string(),
            ),
        ]))
        // Every job it ran, JetStream ones included, in each endpoint's
        // `data` (the library's own counts see only direct calls).
        .stats_handler(move |endpoint, _| job_stats.data(&endpoint))
        // The process's version (its binary's, the workspace's), as
        // `--version` and `toolfleet_build_info` say it.
        .start(
            config.subjects.worker_service(),
            toolfleet_service::build::get().version,
        )
        .await
        .map_err(|e| WorkerError::Nats(format!("services API: {e}")))?;
    let mut tools = Vec::with_capacity(worker.tools.len());
    for tool in &worker.tools {
        match set_up_tool(tool, &stream, &catalog, &service, config).await {
            Ok((consumer, endpoint)) => tools.push((tool.clone(), consumer, endpoint)),
            Err(e) => {
                // Nothing of this worker stays live.
                let _ = service.stop().await;
                return Err(e);
            }
        }
    }
    Ok(SetUp {
        service,
        catalog,
        cancels,
        tools,
    })
}

/// One tool's consumer and endpoint, and its entry in the catalog. The
/// definition goes into the catalog before the endpoint that makes the
/// tool live appears.
async fn set_up_tool(
    tool: &Served,
    stream: &jetstream::stream::Stream,
    catalog: &kv::Store,
    service: &async_nats::service::Service,
    config: &WorkerConfig,
) -> Result<(ToolConsumer, Endpoint), WorkerError> {
    let def = tool.definition();
    let consumer = consumer(stream, config, def).await?;
    let digest = catalog::advertise(catalog, def)
        .await
        .map_err(|e| WorkerError::Nats(e.to_string()))?;
    let delivery = serde_json::to_value(def.delivery)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default();
    let endpoint = service
        .endpoint_builder()
        .name(endpoint_name(&def.id))
        .metadata(HashMap::from([
            (catalog::META_TOOL_ID.to_string(), def.id.to_string()),
            (catalog::META_DIGEST.to_string(), digest),
            (catalog::META_DELIVERY.to_string(), delivery),
        ]))
        .add(config.subjects.tool_direct(&def.id))
        .await
        .map_err(|e| WorkerError::Nats(format!("endpoint for {}: {e}", def.id)))?;
    Ok((consumer, endpoint))
}

/// A tool's endpoint name: its id with `-` joining the parts (no namespace
/// or name holds one), so two versions of one function are two endpoints.
pub(super) fn endpoint_name(id: &ToolId) -> String {
    id.subject_token().replace('.', "-")
}

/// How often a worker writes its definitions into the catalog again: they
/// stay fresh under the bucket's age limit, and a bucket lost with a NATS
/// server that kept no storage is created and filled again.
const READVERTISE_EVERY: Duration = Duration::from_secs(60);

/// Writes `definitions` into the catalog every [`READVERTISE_EVERY`] until
/// `shutdown`.
pub(super) async fn keep_advertised(
    mut catalog: kv::Store,
    js: jetstream::Context,
    subjects: Subjects,
    definitions: Vec<ToolDefinition>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(READVERTISE_EVERY) => {}
        }
        for def in &definitions {
            if catalog::advertise(&catalog, def).await.is_ok() {
                continue;
            }
            // The bucket may be gone: look it up (or create it) once more.
            let retried = match catalog::bucket(&js, &subjects).await {
                Ok(store) => {
                    catalog = store;
                    catalog::advertise(&catalog, def).await.map(|_| ())
                }
                Err(e) => Err(e),
            };
            if let Err(e) = retried {
                warn!(tool = %def.id, error = %e, "cannot write the definition into the catalog");
            }
        }
    }
}

/// The durable consumer of one tool, shared by every copy of its worker.
async fn consumer(
    stream: &jetstream::stream::Stream,
    config: &WorkerConfig,
    def: &ToolDefinition,
) -> Result<ToolConsumer, WorkerError> {
    let name = config.subjects.tool_consumer(&def.id);
    let filter = config.subjects.tool(&def.id);
    // The settings an orchestrator makes a declared pool's consumers with
    // too (scale from zero): either may come first.
    let settings = toolfleet_protocol::streams::tool_consumer_config(
        &config.subjects,
        def,
        config.ack_wait_for(def),
        config.max_attempts,
    );
    let mut consumer: ToolConsumer = stream
        .get_or_create_consumer(&name, settings.clone())
        .await
        .map_err(|e| WorkerError::Nats(format!("consumer for {}: {e}", def.id)))?;
    // Consumer names fold `.` into `_`, so two ids can meet in one name
    // (`a:b_c` and `a_b:c`): never pull another tool's jobs.
    let info = consumer
        .info()
        .await
        .map_err(|e| WorkerError::Nats(format!("consumer {name}: {e}")))?;
    if info.config.filter_subject != filter {
        return Err(WorkerError::Config(format!(
            "the consumer {name} belongs to {}, not to {} (their ids fold to one consumer name; rename one tool)",
            info.config.filter_subject, def.id
        )));
    }
    // Made by an earlier release or with another timeout: bring its ack
    // wait to this one's (an editable setting; the copies of a pool agree
    // because they serve the same definition).
    if info.config.ack_wait != settings.ack_wait {
        match stream.create_consumer(settings.clone()).await {
            Ok(updated) => consumer = updated,
            Err(e) => warn!(consumer = %name, error = %e, ack_wait = ?info.config.ack_wait,
                "cannot update the consumer's ack wait; a frozen worker's jobs wait that long"),
        }
    }
    Ok(consumer)
}
