//! Rate limits, budgets and per-run caps of a tenant: keys of
//! `[tenants.<name>]`, with defaults for every tenant in
//! `[tenant_defaults]` (same keys). A tenant's own key wins; a key set in
//! neither table means no limit. Enforced before every model call an
//! orchestrator makes for the tenant (the conversation's, the planning
//! call's), counted fleet-wide in Redis.
//!
//! | key | type, default | meaning |
//! |---|---|---|
//! | `requests_per_minute` | integer ≥ 1, none | model calls per clock minute (UTC), across every orchestrator; the call over it ends the invocation with `rate_limited` and a `retryAfterMs` (to the next minute) |
//! | `tokens_per_minute` | integer ≥ 1, none | model tokens (prompt + completion) per clock minute; a call made once the minute's tokens reached it ends with `rate_limited` |
//! | `spend_per_day_usd` | number > 0, none | USD per UTC day, priced from `[prices]` (models without a price cost nothing); a call made once it is spent ends with `budget_exhausted` (`retryAfterMs`: to the next day) |
//! | `spend_per_month_usd` | number > 0, none | USD per UTC calendar month, likewise |
//! | `soft_limit_ratio` | number in (0, 1], `0.8` | share of a limit at which a `limit_warning` event is sent (once per limit per invocation) |
//! | `max_run_tokens` | integer ≥ 1, none | tokens one invocation's model calls may use; its next call once they are used ends it with `run_limit_exceeded` |
//! | `max_run_spend_usd` | number > 0, none | USD one invocation's model calls may cost, likewise |
//!
//! **Overshoot.** A request is counted when it is admitted, in the same
//! atomic step as the check, so `requests_per_minute` is never exceeded.
//! Tokens and spend are known only when a call ends: every call admitted
//! before the limit was reached still runs, so a minute's tokens or a
//! day's spend can exceed its limit by at most what the tenant's calls in
//! flight at that moment use — at most (orchestrators × their
//! `--max-in-flight`) calls, each at most its request's `max_tokens`.
//! A per-run cap is checked before each call of the run, so a run ends at
//! most one call past it.

use serde::{Deserialize, Deserializer};

/// The soft limit when none is configured: a warning at 80 % of a limit.
pub const DEFAULT_SOFT_LIMIT_RATIO: f64 = 0.8;

/// An amount of US dollars, held in millionths so the configuration (and
/// Redis) count exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Usd(u64);

impl Usd {
    /// `micros` millionths of a dollar.
    pub const fn from_micros(micros: u64) -> Self {
        Self(micros)
    }

    /// The amount in millionths of a dollar.
    pub const fn micros(self) -> u64 {
        self.0
    }

    /// `usd` rounded up to a millionth; `None` for a negative, NaN or
    /// infinite amount.
    pub fn from_usd(usd: f64) -> Option<Self> {
        if !usd.is_finite() || usd < 0.0 {
            return None;
        }
        let micros = (usd * 1_000_000.0).ceil();
        // Saturates above u64::MAX, an amount no bill reaches.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Some(Self(micros as u64))
    }

    /// The amount in dollars.
    #[allow(clippy::cast_precision_loss)]
    pub fn usd(self) -> f64 {
        self.0 as f64 / 1_000_000.0
    }
}

impl<'de> Deserialize<'de> for Usd {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let usd = f64::deserialize(d)?;
        match Usd::from_usd(usd) {
            Some(amount) if amount.0 > 0 => Ok(amount),
            _ => Err(serde::de::Error::custom(format!(
                "must be an amount of USD above 0, not {usd}"
            ))),
        }
    }
}

/// A share of a limit, `(0, 1]`, held in millionths.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Ratio(u32);

impl Ratio {
    /// The share as a number in `(0, 1]`.
    pub fn get(self) -> f64 {
        f64::from(self.0) / 1_000_000.0
    }
}

impl Default for Ratio {
    fn default() -> Self {
        Self(800_000)
    }
}

impl<'de> Deserialize<'de> for Ratio {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let ratio = f64::deserialize(d)?;
        if !(ratio > 0.0 && ratio <= 1.0) {
            return Err(serde::de::Error::custom(format!(
                "must be a share above 0 and at most 1 (e.g. 0.8), not {ratio}"
            )));
        }
        // In (0, 1]: at most 1_000_000.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Ok(Self((ratio * 1_000_000.0).round() as u32))
    }
}

/// A count that must be at least 1 (`requests_per_minute = 0` would stop
/// a tenant; leave the key out for no limit).
pub(crate) fn positive<'de, D: Deserializer<'de>, T>(d: D) -> Result<Option<T>, D::Error>
where
    T: Deserialize<'de> + Into<u64> + Copy,
{
    let n = T::deserialize(d)?;
    if n.into() == 0 {
        return Err(serde::de::Error::custom(
            "must be 1 or more (leave the key out for no limit)",
        ));
    }
    Ok(Some(n))
}

/// A tenant's limits: the keys above of its `[tenants.<name>]` table
/// ([`crate::TenantConfig`]'s fields of the same names), each unset one from
/// `[tenant_defaults]` ([`crate::FleetConfig::limits_of`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LimitKeys {
    pub requests_per_minute: Option<u32>,
    pub tokens_per_minute: Option<u64>,
    pub spend_per_day_usd: Option<Usd>,
    pub spend_per_month_usd: Option<Usd>,
    pub soft_limit_ratio: Option<Ratio>,
    pub max_run_tokens: Option<u64>,
    pub max_run_spend_usd: Option<Usd>,
}

impl LimitKeys {
    /// These keys, each unset one taken from `defaults`.
    #[must_use]
    pub fn or(self, defaults: LimitKeys) -> LimitKeys {
        LimitKeys {
            requests_per_minute: self.requests_per_minute.or(defaults.requests_per_minute),
            tokens_per_minute: self.tokens_per_minute.or(defaults.tokens_per_minute),
            spend_per_day_usd: self.spend_per_day_usd.or(defaults.spend_per_day_usd),
            spend_per_month_usd: self.spend_per_month_usd.or(defaults.spend_per_month_usd),
            soft_limit_ratio: self.soft_limit_ratio.or(defaults.soft_limit_ratio),
            max_run_tokens: self.max_run_tokens.or(defaults.max_run_tokens),
            max_run_spend_usd: self.max_run_spend_usd.or(defaults.max_run_spend_usd),
        }
    }

    /// Whether any fleet-wide limit (counted in Redis) is set: a tenant
    /// with none costs no Redis round trip per model call.
    pub fn has_shared(&self) -> bool {
        self.requests_per_minute.is_some()
            || self.tokens_per_minute.is_some()
            || self.spend_per_day_usd.is_some()
            || self.spend_per_month_usd.is_some()
    }

    /// The soft limit, the default when unset.
    pub fn soft_ratio(&self) -> f64 {
        self.soft_limit_ratio.unwrap_or_default().get()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testing::MINIMAL as BASE;

    #[test]
    fn a_tenants_keys_win_over_the_defaults_and_unset_means_no_limit() {
        let config = crate::testing::parse(&format!(
            r"{BASE}
            [tenant_defaults]
            requests_per_minute = 60
            spend_per_day_usd = 5
            soft_limit_ratio = 0.9
            [tenants.acme]
            requests_per_minute = 2
            spend_per_month_usd = 100.5
            max_run_tokens = 1000
            max_run_spend_usd = 0.25
            "
        ))
        .expect("loads");
        let acme = config.limits_of("acme");
        assert_eq!(acme.requests_per_minute, Some(2));
        assert_eq!(acme.spend_per_day_usd, Some(Usd::from_micros(5_000_000)));
        assert_eq!(
            acme.spend_per_month_usd,
            Some(Usd::from_micros(100_500_000))
        );
        assert_eq!(acme.max_run_tokens, Some(1000));
        assert_eq!(acme.max_run_spend_usd, Some(Usd::from_micros(250_000)));
        assert!((acme.soft_ratio() - 0.9).abs() < 1e-9);
        assert!(acme.has_shared());
        let globex = config.limits_of("globex");
        assert_eq!(globex.requests_per_minute, Some(60));
        assert_eq!(globex.tokens_per_minute, None);
        assert_eq!(globex.max_run_tokens, None);
        let none = crate::testing::parse(BASE)
            .expect("loads")
            .limits_of("acme");
        assert_eq!(none, LimitKeys::default());
        assert!(!none.has_shared());
        assert!((none.soft_ratio() - DEFAULT_SOFT_LIMIT_RATIO).abs() < 1e-9);
    }

    /// Data-driven: each addition to `BASE` is refused at the given key.
    #[test]
    fn bad_limits_are_refused_at_their_key() {
        let cases: &[(&str, &str, &str)] = &[
            (
                "[tenants.acme]\nrequests_per_minute = 0",
                "tenants.acme.requests_per_minute",
                "1 or more",
            ),
            (
                "[tenant_defaults]\ntokens_per_minute = -5",
                "tenant_defaults.tokens_per_minute",
                "",
            ),
            (
                "[tenants.acme]\nspend_per_day_usd = 0",
                "tenants.acme.spend_per_day_usd",
                "above 0",
            ),
            (
                "[tenants.acme]\nspend_per_month_usd = -1.5",
                "tenants.acme.spend_per_month_usd",
                "above 0",
            ),
            (
                "[tenants.acme]\nsoft_limit_ratio = 1.5",
                "tenants.acme.soft_limit_ratio",
                "at most 1",
            ),
            (
                "[tenant_defaults]\nsoft_limit_ratio = 0",
                "tenant_defaults.soft_limit_ratio",
                "above 0",
            ),
            (
                "[tenant_defaults]\nrequest_per_minute = 5",
                "tenant_defaults.request_per_minute",
                "request_per_minute",
            ),
            (
                "[tenant_defaults]\ndefault_profile = \"default\"",
                "tenant_defaults.default_profile",
                "top-level `default_profile`",
            ),
            (
                "[tenant_defaults]\ntrust_user = true",
                "tenant_defaults.trust_user",
                "per tenant",
            ),
        ];
        for (added, key, words) in cases {
            let e = crate::testing::parse_err(&format!("{BASE}\n{added}\n"));
            assert_eq!(e.key.as_deref(), Some(*key), "{added}: {e}");
            assert!(e.to_string().contains(words), "{added}: {e}");
        }
    }

    #[test]
    fn dollars_round_up_to_a_millionth() {
        assert_eq!(Usd::from_usd(0.000_000_1), Some(Usd::from_micros(1)));
        assert_eq!(Usd::from_usd(1.5), Some(Usd::from_micros(1_500_000)));
        assert_eq!(Usd::from_usd(-1.0), None);
        assert_eq!(Usd::from_usd(f64::NAN), None);
        assert!((Usd::from_micros(2_500_000).usd() - 2.5).abs() < 1e-12);
    }
}
