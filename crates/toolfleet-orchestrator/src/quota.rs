//! A tenant's rate limits, budgets and per-run caps, checked before every
//! model call an orchestrator makes ([`Fleet::admit_model_call`]) and fed
//! after it ([`Fleet::count_usage`]). The limits are the operator's
//! (`[tenants.<name>]`, `[tenant_defaults]`: `toolfleet_config::limits`),
//! for the tenant of the submit subject; the counts are fleet-wide, in
//! Redis (`toolfleet_store::quota`).
//!
//! - Per-run caps (`max_run_tokens`, `max_run_spend_usd`) are the
//!   invocation's own ledger: checked before each model call, a run past
//!   one ends with `run_limit_exceeded`.
//! - A request is admitted and counted in one script; a call over
//!   `requests_per_minute` or made once the minute's `tokens_per_minute`
//!   are used ends the run with `rate_limited`, and once a day's or
//!   month's spend is used, `budget_exhausted` — each with `retryAfterMs`,
//!   to the window's end.
//! - What the invocation spent (its model calls and the model calls its
//!   tools reported) is added to the tenant's counts after each model call
//!   and before the next admission, so tools' spend counts too.
//! - At `soft_limit_ratio` of a limit, a `limit_warning` event (once per
//!   limit per invocation).
//! - Redis unreachable: the call is not made (`internal_error`), so a
//!   budget is never bypassed; a count that cannot be added is logged and
//!   added with the next one.

use std::time::SystemTime;

use prometheus::{GaugeVec, IntCounterVec, Opts, Registry};
use toolfleet_config::LimitKeys;
use toolfleet_protocol::ChatEventBody;
use toolfleet_store::quota::{Admission, QuotaLimit, QuotaLimits, QuotaUsage, QuotaWindows};

use crate::failure::ChatErrorCode;
use crate::{Failure, Fleet, Invocation};

/// The limits a `limit_warning` or a refusal names, in order.
const SHARED: [QuotaLimit; 4] = [
    QuotaLimit::RequestsPerMinute,
    QuotaLimit::TokensPerMinute,
    QuotaLimit::SpendPerDay,
    QuotaLimit::SpendPerMonth,
];

/// The per-run caps' metric labels.
const RUN_TOKENS: &str = "max_run_tokens";
const RUN_SPEND: &str = "max_run_spend_usd";

/// Metrics of the tenants' limits, by `tenant` (an operator identity) and
/// `limit` (a configuration key).
#[derive(Clone)]
pub struct QuotaMetrics {
    /// `toolfleet_tenant_limit_refusals_total`: model calls refused.
    pub refusals: IntCounterVec,
    /// `toolfleet_tenant_limit_warnings_total`: `limit_warning` events.
    pub warnings: IntCounterVec,
    /// `toolfleet_tenant_limit_used_ratio`: the share of a limit used, as
    /// this process last saw it (every orchestrator sees the same count).
    pub used_ratio: GaugeVec,
}

impl QuotaMetrics {
    pub fn register(r: &Registry) -> prometheus::Result<Self> {
        let refusals = IntCounterVec::new(
            Opts::new(
                "toolfleet_tenant_limit_refusals_total",
                "Model calls refused because the tenant reached a limit (rate_limited, budget_exhausted, run_limit_exceeded), by tenant and limit.",
            ),
            &["tenant", "limit"],
        )?;
        let warnings = IntCounterVec::new(
            Opts::new(
                "toolfleet_tenant_limit_warnings_total",
                "limit_warning events: a tenant used its soft_limit_ratio of a limit, by tenant and limit.",
            ),
            &["tenant", "limit"],
        )?;
        let used_ratio = GaugeVec::new(
            Opts::new(
                "toolfleet_tenant_limit_used_ratio",
                "The share of a tenant's limit used in its current window, as last seen by this process, by tenant and limit.",
            ),
            &["tenant", "limit"],
        )?;
        r.register(Box::new(refusals.clone()))?;
        r.register(Box::new(warnings.clone()))?;
        r.register(Box::new(used_ratio.clone()))?;
        Ok(Self {
            refusals,
            warnings,
            used_ratio,
        })
    }
}

/// `tenant`'s limits as its tool jobs carry them to the workers that call
/// models (`Toolfleet-Tenant-Limits`); `None` when it has none.
pub(crate) fn carried(fleet: &Fleet, tenant: &str) -> Option<QuotaLimits> {
    let limits = shared(&fleet.config.profiles.limits_of(tenant));
    (!limits.is_none()).then_some(limits)
}

fn shared(limits: &LimitKeys) -> QuotaLimits {
    QuotaLimits {
        requests_per_minute: limits.requests_per_minute.map_or(0, u64::from),
        tokens_per_minute: limits.tokens_per_minute.unwrap_or(0),
        spend_per_day_micros: limits.spend_per_day_usd.map_or(0, |u| u.micros()),
        spend_per_month_micros: limits.spend_per_month_usd.map_or(0, |u| u.micros()),
    }
}

/// The tenant's per-run caps tightened by the job's own `budget` (a
/// schedule's runs carry the schedule's): the smaller cap wins, so a job
/// can lower its caps, never raise them.
fn with_budget(
    mut limits: LimitKeys,
    budget: Option<toolfleet_protocol::schedule::RunBudget>,
) -> LimitKeys {
    let Some(budget) = budget else { return limits };
    if let Some(tokens) = budget.max_tokens {
        limits.max_run_tokens = Some(limits.max_run_tokens.map_or(tokens, |t| t.min(tokens)));
    }
    if let Some(usd) = budget
        .max_spend_usd
        .and_then(toolfleet_config::Usd::from_usd)
    {
        limits.max_run_spend_usd = Some(
            limits
                .max_run_spend_usd
                .map_or(usd, |u| if u.micros() <= usd.micros() { u } else { usd }),
        );
    }
    limits
}

/// What `inv` may still spend under its per-run caps (the tenant's,
/// tightened by its own `budget`), as the `budget` of a job it starts for
/// itself (an agent tool's nested job: it runs under its caller's
/// budget). `None` when it has no cap; a cap already spent leaves the
/// least a budget may be (one token, one micro-USD), as the caller's own
/// next model call would be refused.
pub(crate) fn remaining_budget(
    fleet: &Fleet,
    inv: &Invocation,
) -> Option<toolfleet_protocol::schedule::RunBudget> {
    let limits = with_budget(
        fleet.config.profiles.limits_of(inv.ctx.tenant()),
        inv.job.budget,
    );
    left_of(&limits, inv.usage.spent())
}

/// The caps of `limits` less `spent` (tokens, micro-USD), each at least
/// one; `None` without caps.
#[allow(clippy::cast_precision_loss)]
fn left_of(
    limits: &LimitKeys,
    (tokens, micros): (u64, u64),
) -> Option<toolfleet_protocol::schedule::RunBudget> {
    let budget = toolfleet_protocol::schedule::RunBudget {
        max_tokens: limits
            .max_run_tokens
            .map(|cap| cap.saturating_sub(tokens).max(1)),
        max_spend_usd: limits
            .max_run_spend_usd
            .map(|cap| cap.micros().saturating_sub(micros).max(1) as f64 / 1_000_000.0),
    };
    (budget != toolfleet_protocol::schedule::RunBudget::default()).then_some(budget)
}

/// `n` of `limit` in the limit's unit (USD for spend).
#[allow(clippy::cast_precision_loss)]
fn in_unit(limit: QuotaLimit, n: u64) -> f64 {
    match limit {
        QuotaLimit::SpendPerDay | QuotaLimit::SpendPerMonth => n as f64 / 1_000_000.0,
        _ => n as f64,
    }
}

fn new_token() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

impl Fleet {
    /// Before a model call of `inv`: its run caps, then (when its tenant
    /// has any) the tenant's fleet-wide limits, counting the call. Answers
    /// the `limit_warning` events to send; a [`Failure`] when the call may
    /// not be made.
    pub(crate) async fn admit_model_call(
        &self,
        inv: &mut Invocation,
    ) -> Result<Vec<ChatEventBody>, Failure> {
        let tenant = inv.ctx.tenant().to_owned();
        let limits = self.config.profiles.limits_of(&tenant);
        self.check_run_caps(inv, &tenant, &with_budget(limits, inv.job.budget))?;
        if !limits.has_shared() {
            return Ok(Vec::new());
        }
        let mut warnings = self.count_usage(inv).await;
        let windows = QuotaWindows::at(SystemTime::now());
        let caps = shared(&limits);
        let admission = self
            .store
            .admit_model_call(&tenant, &caps, &windows, &new_token())
            .await
            .map_err(|e| {
                Failure::new(
                    ChatErrorCode::InternalError,
                    format!("the tenant's limits cannot be checked, so no model call is made: {e}"),
                )
            })?;
        match admission {
            Admission::Admitted(usage) => {
                warnings.extend(self.observe(inv, &tenant, &limits, &usage));
                Ok(warnings)
            }
            Admission::Refused {
                limit,
                usage,
                retry_after,
            } => {
                self.observe(inv, &tenant, &limits, &usage);
                self.metrics
                    .quota
                    .refusals
                    .with_label_values(&[tenant.as_str(), limit.as_str()])
                    .inc();
                let (code, what) = if limit.is_rate() {
                    (ChatErrorCode::RateLimited, "rate limit")
                } else {
                    (ChatErrorCode::BudgetExhausted, "budget")
                };
                let message = format!(
                    "the tenant's {what} {} ({}) is used up ({} used in its window); a model call \
                     is admitted again in {} s",
                    limit.as_str(),
                    in_unit(limit, limit.cap_in(&caps)),
                    in_unit(limit, usage.of(limit)),
                    retry_after.as_secs().max(1),
                );
                Err(Failure::new(code, message).with_retry_after(retry_after))
            }
        }
    }

    /// Adds what `inv` spent since it was last counted (its model calls,
    /// and those its tools reported) to its tenant's fleet-wide counts,
    /// when the tenant has fleet-wide limits; answers the `limit_warning`
    /// events to send.
    pub(crate) async fn count_usage(&self, inv: &mut Invocation) -> Vec<ChatEventBody> {
        let tenant = inv.ctx.tenant().to_owned();
        let limits = self.config.profiles.limits_of(&tenant);
        let (tokens, micros) = inv.usage.uncounted();
        if !limits.has_shared() || (tokens == 0 && micros == 0) {
            return Vec::new();
        }
        let windows = QuotaWindows::at(SystemTime::now());
        match self
            .store
            .record_model_usage(&tenant, &windows, tokens, micros, &new_token())
            .await
        {
            Ok(usage) => {
                inv.usage.counted(inv.usage.spent());
                self.observe(inv, &tenant, &limits, &usage)
            }
            Err(e) => {
                tracing::warn!(invocation_id = %inv.ctx.invocation_id, error = %e,
                    "the invocation's spend could not be added to its tenant's counts; it is added with the next");
                Vec::new()
            }
        }
    }

    /// Sets the used-ratio gauges from `usage` and answers a
    /// `limit_warning` for each limit at or past the soft ratio that this
    /// invocation was not yet warned of. A count `usage` does not carry
    /// (0: the requests after a record) is skipped.
    fn observe(
        &self,
        inv: &mut Invocation,
        tenant: &str,
        limits: &LimitKeys,
        usage: &QuotaUsage,
    ) -> Vec<ChatEventBody> {
        let caps = shared(limits);
        let soft = limits.soft_ratio();
        let mut warnings = Vec::new();
        for limit in SHARED {
            let (cap, used) = (limit.cap_in(&caps), usage.of(limit));
            if cap == 0 || used == 0 {
                continue;
            }
            #[allow(clippy::cast_precision_loss)]
            let ratio = used as f64 / cap as f64;
            let labels = [tenant, limit.as_str()];
            self.metrics
                .quota
                .used_ratio
                .with_label_values(&labels)
                .set(ratio);
            if ratio >= soft && inv.usage.warn_once(limit.as_str()) {
                self.metrics.quota.warnings.with_label_values(&labels).inc();
                warnings.push(ChatEventBody::LimitWarning {
                    limit: limit.as_str().to_owned(),
                    used: in_unit(limit, used),
                    cap: in_unit(limit, cap),
                });
            }
        }
        warnings
    }

    /// The invocation's own caps: a run past `max_run_tokens` or
    /// `max_run_spend_usd` makes no more model calls.
    fn check_run_caps(
        &self,
        inv: &Invocation,
        tenant: &str,
        limits: &LimitKeys,
    ) -> Result<(), Failure> {
        let (tokens, micros) = inv.usage.spent();
        let over = if let Some(cap) = limits.max_run_tokens.filter(|cap| tokens >= *cap) {
            Some((RUN_TOKENS, format!("{tokens} tokens of its {cap}")))
        } else {
            limits
                .max_run_spend_usd
                .filter(|cap| micros >= cap.micros())
                .map(|cap| {
                    (
                        RUN_SPEND,
                        format!(
                            "{} USD of its {} USD",
                            in_unit(QuotaLimit::SpendPerDay, micros),
                            cap.usd()
                        ),
                    )
                })
        };
        let Some((limit, used)) = over else {
            return Ok(());
        };
        self.metrics
            .quota
            .refusals
            .with_label_values(&[tenant, limit])
            .inc();
        Err(Failure::new(
            ChatErrorCode::RunLimitExceeded,
            format!("this invocation used {used} ({limit}); it makes no more model calls"),
        ))
    }
}

#[cfg(test)]
mod tests {
    use toolfleet_config::Usd;
    use toolfleet_protocol::schedule::RunBudget;

    use super::*;

    #[test]
    fn a_nested_job_gets_what_its_caller_has_left() {
        let mut caps = LimitKeys::default();
        assert_eq!(left_of(&caps, (500, 0)), None);
        caps.max_run_tokens = Some(1000);
        caps.max_run_spend_usd = Usd::from_usd(0.5);
        let left = left_of(&caps, (400, 100_000)).unwrap();
        assert_eq!(left.max_tokens, Some(600));
        assert!((left.max_spend_usd.unwrap() - 0.4).abs() < 1e-9);
        // Spent: the least a budget may be, still a valid one.
        let spent = left_of(&caps, (5000, 9_000_000)).unwrap();
        assert_eq!(spent.max_tokens, Some(1));
        assert!(spent.is_valid());
    }

    #[test]
    fn a_jobs_budget_only_tightens_the_tenants_run_caps() {
        let tenant = LimitKeys {
            max_run_tokens: Some(1000),
            max_run_spend_usd: Some(Usd::from_micros(500_000)),
            ..LimitKeys::default()
        };
        let budget = |tokens, usd| {
            Some(RunBudget {
                max_tokens: tokens,
                max_spend_usd: usd,
            })
        };
        assert_eq!(with_budget(tenant, None), tenant);
        // Lower: the job's wins.
        let lower = with_budget(tenant, budget(Some(10), Some(0.25)));
        assert_eq!(lower.max_run_tokens, Some(10));
        assert_eq!(lower.max_run_spend_usd, Some(Usd::from_micros(250_000)));
        // Higher: the tenant's stays.
        let higher = with_budget(tenant, budget(Some(1_000_000), Some(100.0)));
        assert_eq!(higher, tenant);
        // A tenant without caps gets the job's.
        let none = with_budget(LimitKeys::default(), budget(Some(7), None));
        assert_eq!(none.max_run_tokens, Some(7));
        assert_eq!(none.max_run_spend_usd, None);
    }
}
