//! Cancels: the listener that cancels invocations on their cancel subject
//! and writes cancels down (so a job still queued when its cancel came is
//! not run), and the check a run makes before it starts.
//!
//! Every orchestrator hears every cancel. A cancel of an invocation
//! running here stops it at once, in memory, whatever else happens. The
//! rest costs Redis and NATS round trips, so it is bounded per tenant:
//! each tenant's cancels are admitted at its `cancel_rate` (`cancel_burst`
//! at once; over it a cancel is not written down, counted
//! `rate_limited`), wait in the tenant's own queue (at most
//! [`QUEUE_PER_TENANT`], then `queue_full`), and are written down by
//! [`WRITERS`] tasks taking the tenants in turn — so one tenant's flood
//! delays only its own cancels, and the subscription is drained as fast
//! as messages come (never a slow consumer that drops another tenant's
//! cancel). Writing down leaves a tombstone only for an invocation the
//! store knows; a cancel of an unknown id joins the tenant's bounded set
//! of remembered cancels ([`toolfleet_store::CitationStore::remember_cancel`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use futures::StreamExt;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use toolfleet_store::{CancelNote, InvocationKey};
use tracing::warn;

use crate::Fleet;
use crate::invocation::CancelCheck;
use crate::tenant_queue::{TenantQueues, TokenBucket};

/// Cancels written down at once by this orchestrator.
pub(crate) const WRITERS: usize = 16;
/// Cancels of one tenant waiting to be written down here.
pub(crate) const QUEUE_PER_TENANT: usize = 1_000;

/// Every `outcome` of `toolfleet_cancels_total`.
pub const CANCEL_OUTCOMES: [&str; 5] = [
    "tombstone",
    "remembered",
    "rate_limited",
    "queue_full",
    "store_unavailable",
];

/// Cancels the invocations running here whose cancel subject is published,
/// and writes each cancel down (see the module). A cancel is written down
/// before the running invocations are looked up again, and a run
/// registers before it reads the store, so a cancel admitted is never
/// missed between the two.
pub(crate) async fn listen_for_cancels(
    fleet: Arc<Fleet>,
    mut cancel_sub: async_nats::Subscriber,
    shutdown: CancellationToken,
) {
    let queues: Arc<TenantQueues<String>> = Arc::new(TenantQueues::new(QUEUE_PER_TENANT));
    let mut writers: JoinSet<()> = JoinSet::new();
    for _ in 0..WRITERS {
        let (fleet, queues) = (fleet.clone(), queues.clone());
        writers.spawn(async move {
            loop {
                let (tenant, id) = queues.pop().await;
                write_down(&fleet, &tenant, &id).await;
            }
        });
    }
    let mut buckets: HashMap<String, TokenBucket> = HashMap::new();
    loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = cancel_sub.next() => match m { Some(m) => m, None => break },
        };
        let Some((tenant, id)) = fleet.config.subjects.parse_cancel(msg.subject.as_str()) else {
            continue;
        };
        // Running here: stopped now, whatever the tenant sends.
        fleet.cancel(id, tenant);
        let limits = fleet.config.profiles.cancel_limits(tenant);
        let bucket = buckets
            .entry(tenant.to_owned())
            .or_insert_with(|| TokenBucket::full(limits.burst));
        let outcome = if !bucket.take(limits.rate, limits.burst, Instant::now()) {
            "rate_limited"
        } else if queues.push(tenant, id.to_owned()).is_err() {
            "queue_full"
        } else {
            continue;
        };
        count(&fleet, tenant, outcome);
    }
    writers.abort_all();
}

/// Writes one cancel down, then cancels the invocation if it started here
/// meanwhile, and ends it if it is parked.
async fn write_down(fleet: &Fleet, tenant: &str, id: &str) {
    let inv = InvocationKey::new(tenant, id);
    let remembered = fleet.config.profiles.cancel_limits(tenant).remembered;
    let outcome = match fleet.store.remember_cancel(inv, remembered).await {
        Ok(CancelNote::Tombstone) => "tombstone",
        Ok(CancelNote::Remembered) => "remembered",
        Err(e) => {
            warn!(invocation_id = id, error = %e, "cancel not remembered (the store is unavailable); only a running invocation is cancelled");
            "store_unavailable"
        }
    };
    count(fleet, tenant, outcome);
    fleet.cancel(id, tenant);
    // Parked: no run holds it; a cancel decision ends it. A parked
    // invocation has a claim (kept for its whole wait), so an id the
    // store does not know is not parked: no bucket read for it.
    if outcome != "remembered" {
        crate::approvals::watch::cancel_parked(fleet, id, tenant).await;
    }
}

fn count(fleet: &Fleet, tenant: &str, outcome: &str) {
    fleet
        .metrics
        .cancels
        .with_label_values(&[tenant, outcome])
        .inc();
}

/// Whether a cancel for the invocation came before its job started. A
/// store that cannot answer does not stop the job (logged). Read once the
/// run is registered, so a cancel is either found here or reaches the run.
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
