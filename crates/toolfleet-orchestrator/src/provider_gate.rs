//! The deployments' fleet-wide gate ([`toolfleet_llm::gate`]) on the
//! orchestrator's Redis ([`toolfleet_store::provider`]): every model call
//! of a deployment with `max_concurrency` or `requests_per_minute` waits
//! for its place there.

use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use tokio::time::Instant;
use toolfleet_llm::gate::{DeploymentLimits, Gate, GatePass, ProviderGate};
use toolfleet_store::CitationStore;

/// The gate, on the store.
struct StoreGate(CitationStore);

impl ProviderGate for StoreGate {
    fn admit<'a>(&'a self, limits: &'a DeploymentLimits) -> BoxFuture<'a, GatePass> {
        async move {
            let started = Instant::now();
            let slot = self
                .0
                .provider_slot(
                    &limits.deployment,
                    limits.max_concurrency,
                    limits.requests_per_minute,
                )
                .await;
            GatePass::holding(slot, started.elapsed())
        }
        .boxed()
    }

    fn pause<'a>(&'a self, deployment: &'a str, wait: Duration) -> BoxFuture<'a, ()> {
        self.0.provider_pause(deployment, wait).boxed()
    }
}

/// The gate of `limits`' deployment on `store`.
pub(crate) fn gate(store: &CitationStore, limits: DeploymentLimits) -> Gate {
    Gate {
        gate: Arc::new(StoreGate(store.clone())),
        limits,
    }
}
