//! Timeouts and cancels of parked invocations: every orchestrator watches
//! the parked bucket, keeps the parked gauge, and publishes a timeout
//! decision for a record past its approval timeout; a cancel of a parked
//! invocation becomes a cancel decision. Decisions' message ids keep each
//! one.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::approval::{Decision, DecisionKind};
use toolfleet_protocol::now_ms;
use tracing::warn;

use super::Parked;
use crate::Fleet;

/// How often the parked records are checked for timeouts.
const TIMEOUT_TICK: Duration = Duration::from_secs(1);
/// How long a timeout decision that did not take effect waits before it
/// is published again.
const TIMEOUT_RETRY_MS: u64 = 30_000;
/// How long after its expiry a record is timed out: approvals accepted
/// just before the expiry are on the decisions stream by then.
const TIMEOUT_GRACE_MS: u64 = 5_000;

/// What the watcher knows of one parked record (by its key,
/// `<tenant>.<invocation id>`).
struct Watched {
    invocation_id: String,
    park_id: String,
    tenant: String,
    expires_at_ms: u64,
    /// Some call still waits (and the record is not cancelled).
    waiting: bool,
    /// When a timeout may be published (again).
    next_try_ms: u64,
}

/// Watches the parked bucket: keeps the parked gauge, and publishes a
/// timeout decision for each record past its approval timeout. Every
/// orchestrator does; the decision's message id keeps it one.
pub(crate) async fn watch_parked(fleet: Arc<Fleet>, shutdown: CancellationToken) {
    let mut known: HashMap<String, Watched> = HashMap::new();
    while !shutdown.is_cancelled() {
        let mut watch = match fleet.parked_bucket.watch_with_history(">").await {
            Ok(w) => w,
            Err(e) => {
                warn!(error = %e, "cannot watch the parked invocations; trying again");
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(Duration::from_secs(2)) => continue,
                }
            }
        };
        known.clear();
        fleet.tenant_store.parked_reset();
        fleet.metrics.tenant_parked.reset();
        let mut tick = tokio::time::interval(TIMEOUT_TICK);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return,
                entry = watch.next() => match entry {
                    Some(Ok(entry)) => {
                        let present = entry.operation == kv::Operation::Put;
                        let (tenant, parked) = fleet.tenant_store.parked_seen(&entry.key, present);
                        let parked = i64::try_from(parked).unwrap_or(i64::MAX);
                        fleet.metrics.tenant_parked.with_label_values(&[&tenant]).set(parked);
                        if entry.operation == kv::Operation::Put
                            && let Ok(p) = serde_json::from_slice::<Parked>(&entry.value)
                        {
                            known.insert(entry.key.clone(), Watched {
                                waiting: !p.decided(),
                                invocation_id: p.job.invocation_id,
                                park_id: p.park_id,
                                tenant: p.tenant,
                                expires_at_ms: p.expires_at_ms,
                                next_try_ms: 0,
                            });
                        } else {
                            known.remove(&entry.key);
                        }
                        fleet.metrics.approvals_parked.set(i64::try_from(known.len()).unwrap_or(i64::MAX));
                    }
                    Some(Err(e)) => {
                        warn!(error = %e, "the watch on the parked invocations broke; starting it again");
                        break;
                    }
                    None => break,
                },
                _ = tick.tick() => {
                    let now = now_ms();
                    for w in known.values_mut().filter(|w| w.waiting && w.expires_at_ms + TIMEOUT_GRACE_MS <= now && w.next_try_ms <= now) {
                        w.next_try_ms = now + TIMEOUT_RETRY_MS;
                        let id = &w.invocation_id;
                        let decision = Decision {
                            invocation_id: id.clone(),
                            park_id: w.park_id.clone(),
                            kind: DecisionKind::Timeout,
                            at_ms: now,
                        };
                        if let Err(e) = fleet.record_decision(&w.tenant, &decision).await {
                            warn!(invocation_id = %id, error = %e, "cannot record an approval timeout; trying again later");
                        }
                    }
                }
            }
        }
    }
}

/// A cancel of `invocation_id` of `tenant`: if it is parked, a cancel
/// decision ends it (every orchestrator hears a cancel; the decision's
/// message id keeps it one).
pub(crate) async fn cancel_parked(fleet: &Fleet, invocation_id: &str, tenant: &str) {
    let parked = match fleet.parked(tenant, invocation_id).await {
        Ok(Some((p, _))) if !p.cancelled => p,
        Ok(_) => return,
        Err(e) => {
            warn!(invocation_id, error = %e, "cannot read the parked invocations to cancel");
            return;
        }
    };
    let decision = Decision {
        invocation_id: invocation_id.to_string(),
        park_id: parked.park_id,
        kind: DecisionKind::Cancel,
        at_ms: now_ms(),
    };
    if let Err(e) = fleet.record_decision(tenant, &decision).await {
        warn!(invocation_id, error = %e, "cannot record the cancel of a parked invocation");
    }
}
