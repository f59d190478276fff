//! A fleet-wide limit per deployment: every process that calls a
//! deployment's model — orchestrators and LLM-tool workers — asks one
//! shared gate before each request, so a burst queues here instead of
//! meeting the provider's 429s.
//!
//! The gate itself lives where the fleet's shared state is (Redis: see
//! `toolfleet_store::provider`); this module is what the client needs of
//! it: [`ProviderGate::admit`] waits for a slot and hands back a
//! [`GatePass`] the request holds until it ends, and
//! [`ProviderGate::pause`] tells every caller to hold off when the
//! provider answered 429 with a `Retry-After`.
//!
//! The client asks the gate before every attempt (a retry takes a slot of
//! its own) and pauses the deployment on a 429 that says how long. A gate
//! that cannot reach its store lets the call through: the limit is there to
//! spare the provider, and the provider's own 429s (retried) still bound
//! the damage.

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use futures::future::BoxFuture;

/// A deployment's fleet-wide limits (`[deployments.<name>]`
/// `max_concurrency`, `requests_per_minute`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeploymentLimits {
    /// The deployment's name in the configuration: callers sharing it
    /// share the limits.
    pub deployment: String,
    /// Requests in flight at once; `None`: no limit.
    pub max_concurrency: Option<u32>,
    /// Requests started per minute; `None`: no limit.
    pub requests_per_minute: Option<u32>,
}

/// Held by one request while it runs: its slot is given back when the
/// pass is dropped.
pub struct GatePass {
    _held: Option<Box<dyn Send + Sync>>,
    /// How long the request waited for its slot.
    pub waited: Duration,
}

impl GatePass {
    /// A pass that holds nothing (no limit, or the gate let the call
    /// through without one).
    pub fn open(waited: Duration) -> Self {
        Self {
            _held: None,
            waited,
        }
    }

    /// A pass holding `slot` (given back when it drops).
    pub fn holding(slot: impl Send + Sync + 'static, waited: Duration) -> Self {
        Self {
            _held: Some(Box::new(slot)),
            waited,
        }
    }
}

impl fmt::Debug for GatePass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GatePass")
            .field("holds_slot", &self._held.is_some())
            .field("waited", &self.waited)
            .finish()
    }
}

/// The shared gate of the deployments (see the module docs).
pub trait ProviderGate: Send + Sync {
    /// Waits until `limits` let one more request of its deployment start,
    /// then takes a slot for it. Never fails: a gate that cannot tell lets
    /// the request through. Dropping the future gives up the wait.
    fn admit<'a>(&'a self, limits: &'a DeploymentLimits) -> BoxFuture<'a, GatePass>;

    /// The provider asked for `wait` before the next request (a 429 with
    /// `Retry-After`): no caller of `deployment` starts one before then.
    fn pause<'a>(&'a self, deployment: &'a str, wait: Duration) -> BoxFuture<'a, ()>;
}

/// A gate and the limits of the deployment a client calls
/// ([`crate::LlmConfig::gate`]).
#[derive(Clone)]
pub struct Gate {
    pub gate: Arc<dyn ProviderGate>,
    pub limits: DeploymentLimits,
}

impl fmt::Debug for Gate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gate")
            .field("limits", &self.limits)
            .finish()
    }
}

impl Gate {
    /// Waits for a slot of the deployment.
    pub async fn admit(&self) -> GatePass {
        self.gate.admit(&self.limits).await
    }

    /// Pauses the deployment for `wait`.
    pub async fn pause(&self, wait: Duration) {
        self.gate.pause(&self.limits.deployment, wait).await;
    }
}
