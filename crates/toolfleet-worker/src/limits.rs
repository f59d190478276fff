//! What a tool that calls models shares with the orchestrators: the
//! tenant's rate limits and budgets ([`toolfleet_store::quota`]) and each
//! deployment's fleet-wide limits ([`toolfleet_store::provider`]), counted
//! in the same Redis.
//!
//! [`ToolCtx::shared_limits`](crate::ToolCtx::shared_limits) gives a tool
//! a [`SharedLimits`] for its call: [`SharedLimits::admit_model_call`]
//! before each model call (refused past the tenant's limits, which the
//! orchestrator sends with the job, `Toolfleet-Tenant-Limits`),
//! [`SharedLimits::record_model_usage`] after it, and
//! [`SharedLimits::provider_slot`] / [`SharedLimits::provider_pause`] for
//! the deployment.

use std::time::{Duration, SystemTime};

use toolfleet_protocol::TenantLimits;
use toolfleet_store::CitationStore;
use toolfleet_store::provider::ProviderSlot;
use toolfleet_store::quota::{Admission, QuotaLimit, QuotaWindows};

use crate::error::ToolError;

/// The shared limits of one call's tenant (see the module docs). Cheap to
/// clone; owns what it needs.
#[derive(Clone)]
pub struct SharedLimits {
    pub(crate) store: CitationStore,
    pub(crate) tenant: String,
    pub(crate) limits: Option<TenantLimits>,
    /// Names the call in the tenant's counts.
    pub(crate) token: String,
}

impl std::fmt::Debug for SharedLimits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedLimits")
            .field("tenant", &self.tenant)
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

impl SharedLimits {
    /// Admits one model call of the call's tenant under the limits its job
    /// carried; `token` names the call (the same token is counted once).
    ///
    /// # Errors
    ///
    /// `rate_limited` or `budget_exhausted` (never retried) when a limit
    /// is reached, saying which and for how long; a retryable error when
    /// the store cannot be reached (a budget is never bypassed).
    pub async fn admit_model_call(&self, token: &str) -> Result<(), ToolError> {
        let Some(limits) = self.limits.filter(|l| !l.is_none()) else {
            return Ok(());
        };
        let windows = QuotaWindows::at(SystemTime::now());
        match self
            .store
            .admit_model_call(&self.tenant, &limits, &windows, token)
            .await
        {
            Ok(Admission::Admitted(_)) => Ok(()),
            Ok(Admission::Refused {
                limit, retry_after, ..
            }) => Err(refusal(limit, retry_after)),
            // As the orchestrator: a budget is never bypassed; the job is
            // tried again.
            Err(e) => Err(ToolError::transient(format!(
                "the tenant's limits cannot be checked: {e}"
            ))),
        }
    }

    /// Adds what one model call used (`tokens`, `micros` millionths of a
    /// USD) to the tenant's windows; `token` as for the admission. (The
    /// runtime already counts what a tool reports with
    /// [`ToolCtx::record_llm_call`](crate::ToolCtx::record_llm_call): this
    /// is for spend a tool does not report.)
    pub async fn record_model_usage(&self, tokens: u64, micros: u64, token: &str) {
        if self.limits.is_none_or(|l| l.is_none()) {
            return;
        }
        let windows = QuotaWindows::at(SystemTime::now());
        if let Err(e) = self
            .store
            .record_model_usage(&self.tenant, &windows, tokens, micros, token)
            .await
        {
            tracing::warn!(tenant = %self.tenant, error = %e, "cannot count a model call's usage against the tenant's limits");
        }
    }

    /// Adds the model calls a call reported (`llm_calls` of its result) to
    /// its tenant's counts, once per call (a redelivered job adds nothing
    /// again). The worker runtime does this for every tool; a spend with
    /// no reported cost counts its tokens only.
    pub(crate) async fn count_reported(&self, calls: &[toolfleet_protocol::LlmCall]) {
        if calls.is_empty() {
            return;
        }
        let tokens = calls
            .iter()
            .map(|c| {
                c.usage
                    .total_tokens
                    .max(c.usage.prompt_tokens + c.usage.completion_tokens)
            })
            .sum();
        let micros = calls
            .iter()
            .filter_map(|c| c.cost_usd.filter(|c| c.is_finite() && *c >= 0.0))
            .map(|c| (c * 1_000_000.0).round() as u64)
            .sum();
        self.record_model_usage(tokens, micros, &self.token).await;
    }

    /// Waits for a place under `deployment`'s fleet-wide limits and takes
    /// it (given back when the slot drops).
    pub async fn provider_slot(
        &self,
        deployment: &str,
        max_concurrency: Option<u32>,
        requests_per_minute: Option<u32>,
    ) -> ProviderSlot {
        self.store
            .provider_slot(deployment, max_concurrency, requests_per_minute)
            .await
    }

    /// No call of `deployment` starts for `wait`, fleet-wide.
    pub async fn provider_pause(&self, deployment: &str, wait: Duration) {
        self.store.provider_pause(deployment, wait).await;
    }
}

/// The tool error of a refusal at `limit`.
fn refusal(limit: QuotaLimit, retry_after: Duration) -> ToolError {
    let code = if limit.is_rate() {
        "rate_limited"
    } else {
        "budget_exhausted"
    };
    ToolError::coded(
        code,
        format!(
            "the tenant's {} is reached; it renews in {} s",
            limit.as_str(),
            retry_after.as_secs().max(1)
        ),
    )
}
