//! The signals worker pools are scaled on, per tool: the backlog
//! (`num_pending` of the tool's durable consumer: jobs no worker has taken
//! yet), the jobs in flight (`num_ack_pending`), and the live workers
//! serving the tool (from the catalog). Read from the tools stream's
//! consumers, not from the workers, so a pool whose every worker is gone
//! still shows its backlog — that is when it matters (`ToolPoolEmpty`).
//!
//! Every orchestrator exports the same numbers; dashboards and alerts take
//! `max by (tool)`.
//!
//! A declared pool ([`crate::tools::declared`]) may have no worker at all
//! yet, so no consumer: the orchestrator makes its tools' consumers
//! ([`ensure_consumers`]), as a worker of the pool would make them, at
//! start and again when a reading finds one missing, so its jobs queue
//! where its autoscaler (KEDA's `nats-jetstream` trigger reads a
//! consumer's pending and unacknowledged jobs) and these gauges see them.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::Subjects;
use toolfleet_protocol::streams::{TOOL_MAX_ACK_WAIT, TOOL_MAX_ATTEMPTS};
use toolfleet_protocol::tools::ToolDefinition;
use tracing::{info, warn};

use crate::tools::declared::DeclaredPools;
use crate::{Fleet, OrchestratorError};

/// Makes the durable consumer of every declared tool that has none, with
/// the settings a worker of its pool makes it with (the worker defaults:
/// a worker with other settings brings the ack wait to its own as it
/// starts). A consumer of that name already there — a worker's, or one the
/// operator made — is used as it is, if it is pinned to the tool's
/// subject.
///
/// # Errors
///
/// The tools stream or a consumer cannot be read or made (the
/// orchestrator's NATS identity needs the consumer-create permission of
/// `ops/nats/auth.conf`), or a consumer of a declared tool's name belongs
/// to another subject.
pub(crate) async fn ensure_consumers(
    js: &jetstream::Context,
    subjects: &Subjects,
    declared: &DeclaredPools,
) -> Result<(), OrchestratorError> {
    if declared.is_empty() {
        return Ok(());
    }
    let stream = js
        .get_stream(subjects.tools_stream())
        .await
        .map_err(|e| OrchestratorError::Nats(format!("the tools stream: {e}")))?;
    for tool in declared.tools() {
        ensure_consumer(&stream, subjects, &tool.definition).await?;
    }
    Ok(())
}

/// [`ensure_consumers`] for one tool.
async fn ensure_consumer(
    stream: &jetstream::stream::Stream,
    subjects: &Subjects,
    def: &ToolDefinition,
) -> Result<(), OrchestratorError> {
    let config = toolfleet_protocol::streams::tool_consumer_config(
        subjects,
        def,
        toolfleet_protocol::streams::tool_ack_wait(def, TOOL_MAX_ACK_WAIT),
        TOOL_MAX_ATTEMPTS,
    );
    let name = subjects.tool_consumer(&def.id);
    let filter = config.filter_subject.clone();
    let mut consumer = stream
        .get_or_create_consumer(&name, config)
        .await
        .map_err(|e| {
            OrchestratorError::Nats(format!(
                "the consumer {name} of the declared tool {}: {e} (the orchestrator's NATS \
                 identity makes it: it needs $JS.API.CONSUMER.INFO.{stream}.* and \
                 $JS.API.CONSUMER.CREATE.{stream}.*.{}.tool.>, as in ops/nats/auth.conf)",
                def.id,
                subjects.prefix(),
                stream = subjects.tools_stream(),
            ))
        })?;
    let found = consumer
        .info()
        .await
        .map_err(|e| OrchestratorError::Nats(format!("the consumer {name}: {e}")))?
        .config
        .filter_subject
        .clone();
    if found != filter {
        return Err(OrchestratorError::Config(format!(
            "the consumer {name} belongs to {found}, not to the declared tool {} ({filter})",
            def.id
        )));
    }
    Ok(())
}

/// One reading: every tool consumer's backlog and jobs in flight, and the
/// live workers of each tool (also of a live tool without a consumer yet,
/// and of each declared tool, whose missing consumer is made again).
async fn read(fleet: &Fleet) -> Result<BTreeMap<String, (u64, u64, usize)>, String> {
    let subjects = &fleet.config.subjects;
    let stream = fleet
        .js
        .get_stream(subjects.tools_stream())
        .await
        .map_err(|e| format!("the tools stream: {e}"))?;
    let catalog = fleet.catalog.current();
    let mut pools = BTreeMap::new();
    let mut consumers = stream.consumers();
    while let Some(info) = consumers.next().await {
        let info = info.map_err(|e| format!("listing consumers: {e}"))?;
        let Some(tool) = subjects.tool_of_subject(&info.config.filter_subject) else {
            continue;
        };
        let workers = catalog.get(&tool).map_or(0, |e| e.workers);
        pools.insert(
            tool,
            (info.num_pending, info.num_ack_pending as u64, workers),
        );
    }
    for entry in catalog.all() {
        pools
            .entry(entry.definition().id.to_string())
            .or_insert((0, 0, entry.workers));
    }
    // A declared tool's consumer gone (a stream made again, an operator's
    // `nats consumer rm`): made again, or its jobs would queue unseen.
    for tool in fleet.config.declared.tools() {
        let id = tool.definition.id.to_string();
        if pools.contains_key(&id) {
            continue;
        }
        match ensure_consumer(&stream, subjects, &tool.definition).await {
            Ok(()) => info!(tool = %id, "made the missing consumer of a declared pool's tool"),
            Err(e) => {
                warn!(tool = %id, error = %e, "cannot make the consumer of a declared pool's tool")
            }
        }
        pools.insert(id, (0, 0, 0));
    }
    Ok(pools)
}

/// Reads the pools every `every` until `shutdown`, into the gauges. A
/// tool whose consumer and workers are gone drops out of the gauges.
pub(crate) async fn watch(fleet: Arc<Fleet>, every: Duration, shutdown: CancellationToken) {
    let m = &fleet.metrics;
    loop {
        match read(&fleet).await {
            Ok(pools) => {
                for gauge in [
                    &m.tool_backlog,
                    &m.tool_jobs_pending_ack,
                    &m.tool_live_workers,
                ] {
                    gauge.reset();
                }
                for (tool, (backlog, in_flight, workers)) in pools {
                    let label = [tool.as_str()];
                    // Every tool of the fleet has its call outcomes from
                    // the first reading: the first error is an increase.
                    for status in crate::metrics::TOOL_CALL_STATUSES {
                        m.tool_calls.with_label_values(&[tool.as_str(), status]);
                    }
                    m.tool_backlog
                        .with_label_values(&label)
                        .set(i64::try_from(backlog).unwrap_or(i64::MAX));
                    m.tool_jobs_pending_ack
                        .with_label_values(&label)
                        .set(i64::try_from(in_flight).unwrap_or(i64::MAX));
                    m.tool_live_workers
                        .with_label_values(&label)
                        .set(i64::try_from(workers).unwrap_or(i64::MAX));
                }
            }
            Err(e) => warn!(error = %e, "cannot read the tool pools' backlog"),
        }
        tokio::select! {
            () = shutdown.cancelled() => return,
            () = tokio::time::sleep(every) => {}
        }
    }
}
