//! The providers an LLM tool reaches: one pooled HTTP client per deployment
//! of the fleet's configuration, built once when the worker starts, and
//! the reason a deployment cannot be used (its key is missing) when it
//! cannot.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures::FutureExt;
use futures::future::BoxFuture;
use toolfleet_llm::LlmClient;
use toolfleet_llm::deployments::EnvSource;
use toolfleet_llm::gate::{DeploymentLimits, Gate, GatePass, ProviderGate};
use toolfleet_llm::model_config::ModelConfig;
use toolfleet_llm::prices::PriceTable;
use toolfleet_worker::{SharedLimits, ToolCtx};

/// A deployment as the worker uses it.
pub(crate) struct Provider {
    /// The client, or why there is none (the key is not set).
    pub(crate) client: Result<LlmClient, String>,
    /// The deployment's fleet-wide limits (`max_concurrency`,
    /// `requests_per_minute`), shared with the orchestrators.
    pub(crate) limits: Option<DeploymentLimits>,
    /// The `service_tier` of batch jobs' calls (`batch_service_tier`).
    pub(crate) batch_tier: Option<String>,
}

/// Every deployment of the configuration, by name, and the price table.
pub struct Providers {
    by_name: BTreeMap<String, Provider>,
    pub(crate) prices: PriceTable,
}

impl std::fmt::Debug for Providers {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Providers")
            .field("names", &self.by_name.keys().collect::<Vec<_>>())
            .finish_non_exhaustive()
    }
}

impl Providers {
    /// One client per deployment of `config`, with its key from `env`. A
    /// deployment whose key is missing is kept, without a client, so a
    /// call can say which key is missing.
    ///
    /// # Errors
    ///
    /// A client that cannot be built (a key that cannot go in a header).
    pub fn new(config: &ModelConfig, env: &dyn EnvSource) -> Result<Self, String> {
        let mut by_name = BTreeMap::new();
        for (name, deployment) in &config.deployments {
            let client = match deployment.to_llm_config(env) {
                Ok(llm) => {
                    Ok(LlmClient::new(llm).map_err(|e| format!("deployment {name:?}: {e}"))?)
                }
                Err(why) => Err(why.to_string()),
            };
            by_name.insert(
                name.clone(),
                Provider {
                    client,
                    limits: deployment.limits(name),
                    batch_tier: deployment.batch_service_tier.clone(),
                },
            );
        }
        Ok(Self {
            by_name,
            prices: config.prices.clone(),
        })
    }

    pub(crate) fn get(&self, provider: &str) -> Option<&Provider> {
        self.by_name.get(provider)
    }

    /// Whether `provider` is a deployment of the configuration.
    #[must_use]
    pub fn knows(&self, provider: &str) -> bool {
        self.by_name.contains_key(provider)
    }

    /// The deployment names, for messages.
    pub fn names(&self) -> String {
        self.by_name.keys().cloned().collect::<Vec<_>>().join(", ")
    }
}

/// `provider/model` split in two; `None` when it is not of that form.
#[must_use]
pub fn split_model(id: &str) -> Option<(&str, &str)> {
    id.split_once('/')
        .filter(|(p, m)| !p.is_empty() && !m.is_empty())
}

/// A deployment's fleet-wide gate on the store of the call
/// ([`toolfleet_worker::SharedLimits`]).
struct CallGate(SharedLimits);

impl ProviderGate for CallGate {
    fn admit<'a>(&'a self, limits: &'a DeploymentLimits) -> BoxFuture<'a, GatePass> {
        async move {
            let started = std::time::Instant::now();
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

/// `client` as a call of `ctx` uses it: through its deployment's
/// fleet-wide gate when it has `limits` and the call has a shared store.
pub(crate) fn gated(
    ctx: &ToolCtx,
    client: &LlmClient,
    limits: Option<&DeploymentLimits>,
) -> LlmClient {
    match (limits, ctx.shared_limits()) {
        (Some(limits), Some(shared)) => client.with_gate(Gate {
            gate: Arc::new(CallGate(shared)),
            limits: limits.clone(),
        }),
        _ => client.clone(),
    }
}
