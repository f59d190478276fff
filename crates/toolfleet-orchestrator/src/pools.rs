//! The signals worker pools are scaled on, per tool: the backlog
//! (`num_pending` of the tool's durable consumer: jobs no worker has taken
//! yet), the jobs in flight (`num_ack_pending`), and the live workers
//! serving the tool (from the catalog). Read from the tools stream's
//! consumers, not from the workers, so a pool whose every worker is gone
//! still shows its backlog — that is when it matters (`ToolPoolEmpty`).
//!
//! Every orchestrator exports the same numbers; dashboards and alerts take
//! `max by (tool)`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::Fleet;

/// One reading: every tool consumer's backlog and jobs in flight, and the
/// live workers of each tool (also of a live tool without a consumer yet).
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
