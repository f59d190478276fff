//! The poison guard at intake (issue 29): a tenant's chat jobs that cannot
//! be read (headers the client cannot parse, a body that does not decode)
//! are counted, shared by every orchestrator in Redis; a tenant whose
//! count within its window reaches its limit is suspended for its
//! cool-off, and meanwhile each of its chat jobs is refused at once with
//! `tenant_suspended` (the refusal itself is [`super::reject`]'s). The
//! limits are the operator's (`toolfleet_config::poison`). A Redis that
//! cannot answer suspends nobody: the guard fails open, and the job's
//! claim, which needs Redis too, decides what happens to it.

use std::time::Duration;

use toolfleet_store::PoisonRule;
use tracing::warn;

use crate::Fleet;

/// Counts one poison of `tenant` (the metric, and the shared count that
/// may suspend it).
pub(super) async fn count_poison(fleet: &Fleet, tenant: &str) {
    fleet.metrics.zero_tenant(tenant);
    fleet.metrics.chat_poison.with_label_values(&[tenant]).inc();
    let policy = fleet.config.profiles.poison_policy(tenant);
    let rule = PoisonRule {
        limit: policy.limit,
        window: policy.window,
        cooloff: policy.cooloff,
    };
    match fleet.store.count_poison(tenant, rule).await {
        Ok(count) if count.suspended => {
            fleet
                .metrics
                .tenant_suspensions
                .with_label_values(&[tenant])
                .inc();
            warn!(
                tenant,
                poisons = count.count,
                window_secs = policy.window.as_secs(),
                cooloff_secs = policy.cooloff.as_secs(),
                "tenant suspended: too many of its chat jobs could not be read; \
                 its chat jobs are refused (tenant_suspended) until the cool-off ends"
            );
        }
        Ok(_) => {}
        Err(e) => warn!(tenant, error = %e, "cannot count a poison chat job of the tenant"),
    }
}

/// How long `tenant` stays suspended; `None` when it is not (or Redis
/// cannot say).
pub(super) async fn suspended_for(fleet: &Fleet, tenant: &str) -> Option<Duration> {
    match fleet.store.suspended_for(tenant).await {
        Ok(left) => left,
        Err(e) => {
            warn!(tenant, error = %e, "cannot tell whether the tenant is suspended; serving it");
            None
        }
    }
}
