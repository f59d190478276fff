//! Cancels: the listener that cancels invocations on their cancel subject
//! and remembers every cancel (a tombstone in the store), and the check a
//! run makes before it starts.

use std::sync::Arc;

use futures::StreamExt;
use tokio_util::sync::CancellationToken;
use toolfleet_store::InvocationKey;
use tracing::warn;

use crate::Fleet;
use crate::invocation::CancelCheck;

/// Cancels the invocations running here whose cancel subject is published,
/// and remembers every cancel (a tombstone in the store, with its TTL) so a
/// job still queued when its cancel came is answered `cancelled` when it
/// starts instead of being run. The tombstone is written before the running
/// invocation is looked up, and a run registers before it checks the
/// tombstone, so a cancel is never missed between the two.
pub(crate) async fn listen_for_cancels(
    fleet: Arc<Fleet>,
    mut cancel_sub: async_nats::Subscriber,
    shutdown: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = cancel_sub.next() => match m { Some(m) => m, None => break },
        };
        let Some((tenant, id)) = fleet.config.subjects.parse_cancel(msg.subject.as_str()) else {
            continue;
        };
        if let Err(e) = fleet
            .store
            .mark_cancelled(InvocationKey::new(tenant, id))
            .await
        {
            warn!(invocation_id = id, error = %e, "cancel not remembered (the store is unavailable); only a running invocation is cancelled");
        }
        fleet.cancel(id, tenant);
        // Parked: no run holds it; a cancel decision ends it.
        crate::approvals::watch::cancel_parked(&fleet, id, tenant).await;
    }
}

/// Whether a cancel for the invocation came before its job started. A
/// store that cannot answer does not stop the job (logged).
pub(super) async fn cancelled_before_start(
    fleet: &Fleet,
    inv: InvocationKey<'_>,
    check: &CancelCheck,
) -> bool {
    let id = inv.invocation_id();
    match fleet.store.is_cancelled(inv).await {
        Ok(true) => true,
        Ok(false) => {
            check.passed();
            false
        }
        Err(e) => {
            warn!(invocation_id = id, error = %e, "cannot read the cancel tombstone; running the job");
            false
        }
    }
}
