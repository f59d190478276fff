//! Cancels per tenant: how many cancels of a tenant the fleet works on per
//! second, and how many cancels of jobs not started yet it remembers.
//!
//! A cancel of an invocation running anywhere always stops it (each
//! orchestrator looks its own runs up in memory, at no cost). What these
//! keys bound is the rest: writing down a cancel so a job still queued, or
//! a run that missed the message, is stopped later. A tenant's cancels
//! over its rate are not written down (counted in
//! `toolfleet_cancels_total{outcome="rate_limited"}`); its remembered
//! cancels of jobs not started are at most `remembered_cancels`, the
//! oldest forgotten first, each for an hour at most.
//!
//! | key | type, default | meaning |
//! |---|---|---|
//! | `tenants.<name>.cancel_rate` | 1..=100000 per second, `100` | cancels of the tenant each orchestrator writes down per second, on average |
//! | `tenants.<name>.cancel_burst` | 1..=100000, `1000` | cancels written down at once before the rate applies |
//! | `tenants.<name>.remembered_cancels` | 1..=1000000, `10000` | cancels of jobs not started yet (no claim in the store) remembered for the tenant; the oldest goes first |
//!
//! Each key may also be set in `[tenant_defaults]`, for every tenant with
//! no value of its own.

use toolfleet_llm::config_file::key_segment;

use crate::FleetConfig;
use crate::tenants::TenantConfig;

/// Default of `cancel_rate`.
pub const DEFAULT_CANCEL_RATE: u32 = 100;
/// Default of `cancel_burst`.
pub const DEFAULT_CANCEL_BURST: u32 = 1_000;
/// Default of `remembered_cancels`.
pub const DEFAULT_REMEMBERED_CANCELS: u32 = 10_000;
/// The largest `cancel_rate` and `cancel_burst`.
pub const MAX_CANCEL_RATE: u32 = 100_000;
/// The largest `remembered_cancels`.
pub const MAX_REMEMBERED_CANCELS: u32 = 1_000_000;

/// One tenant's cancel limits, resolved (its own keys, then
/// `[tenant_defaults]`, then the built-in defaults).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CancelLimits {
    /// Cancels written down per second, on average.
    pub rate: u32,
    /// Cancels written down at once before the rate applies.
    pub burst: u32,
    /// Cancels of jobs not started yet remembered at once.
    pub remembered: u32,
}

impl Default for CancelLimits {
    fn default() -> Self {
        Self {
            rate: DEFAULT_CANCEL_RATE,
            burst: DEFAULT_CANCEL_BURST,
            remembered: DEFAULT_REMEMBERED_CANCELS,
        }
    }
}

impl FleetConfig {
    /// `tenant`'s cancel limits.
    pub fn cancel_limits(&self, tenant: &str) -> CancelLimits {
        CancelLimits {
            rate: self
                .tenant_key(tenant, |t| t.cancel_rate)
                .unwrap_or(DEFAULT_CANCEL_RATE),
            burst: self
                .tenant_key(tenant, |t| t.cancel_burst)
                .unwrap_or(DEFAULT_CANCEL_BURST),
            remembered: self
                .tenant_key(tenant, |t| t.remembered_cancels)
                .unwrap_or(DEFAULT_REMEMBERED_CANCELS),
        }
    }

    /// Every cancel key of `[tenant_defaults]` and of each
    /// `[tenants.<name>]` in range; the error names the key.
    pub(crate) fn check_cancel_limits(&self) -> Result<(), (String, String)> {
        // Who a tenant is and what it runs stay per tenant: never a
        // default for tenants the operator has not named.
        if self.tenant_defaults.default_profile.is_some() {
            return Err((
                "tenant_defaults.default_profile".to_owned(),
                "not a default for every tenant: set the file's top-level `default_profile`"
                    .to_owned(),
            ));
        }
        if self.tenant_defaults.trust_user {
            return Err((
                "tenant_defaults.trust_user".to_owned(),
                "trust is given per tenant: set it in [tenants.<name>]".to_owned(),
            ));
        }
        check_table(&self.tenant_defaults, "tenant_defaults")?;
        for (name, tenant) in &self.tenants {
            check_table(tenant, &format!("tenants.{}", key_segment(name)))?;
        }
        Ok(())
    }
}

/// One table's cancel keys in range (`at` is the table's path).
fn check_table(tenant: &TenantConfig, at: &str) -> Result<(), (String, String)> {
    let keys = [
        ("cancel_rate", tenant.cancel_rate, MAX_CANCEL_RATE),
        ("cancel_burst", tenant.cancel_burst, MAX_CANCEL_RATE),
        (
            "remembered_cancels",
            tenant.remembered_cancels,
            MAX_REMEMBERED_CANCELS,
        ),
    ];
    for (key, value, max) in keys {
        if let Some(v) = value
            && !(1..=max).contains(&v)
        {
            return Err((
                format!("{at}.{key}"),
                format!("must be between 1 and {max}, not {v}"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testing::MINIMAL as BASE;

    #[test]
    fn a_tenants_own_keys_win_then_the_defaults_table_then_the_built_in() {
        let config = crate::testing::parse(&format!(
            "{BASE}
            [tenant_defaults]
            cancel_rate = 7
            [tenants.acme]
            cancel_burst = 3
            remembered_cancels = 50
            [tenants.globex]
            cancel_rate = 9
            "
        ))
        .expect("loads");
        assert_eq!(
            config.cancel_limits("acme"),
            CancelLimits {
                rate: 7,
                burst: 3,
                remembered: 50
            }
        );
        assert_eq!(config.cancel_limits("globex").rate, 9);
        assert_eq!(
            config.cancel_limits("initech"),
            CancelLimits {
                rate: 7,
                ..CancelLimits::default()
            }
        );
    }

    #[test]
    fn out_of_range_cancel_limits_are_refused_at_their_key() {
        for (added, key) in [
            (
                "[tenants.acme]\ncancel_rate = 0",
                "tenants.acme.cancel_rate",
            ),
            (
                "[tenant_defaults]\nremembered_cancels = 0",
                "tenant_defaults.remembered_cancels",
            ),
            (
                "[tenants.acme]\ncancel_burst = 100001",
                "tenants.acme.cancel_burst",
            ),
        ] {
            let e = crate::testing::parse(&format!("{BASE}\n{added}")).unwrap_err();
            let text = e.to_string();
            assert!(text.contains(key), "{added}: {text}");
            assert!(text.contains("must be between 1 and"), "{added}: {text}");
        }
        for (added, key) in [
            (
                "[tenant_defaults]\ntrust_user = true",
                "tenant_defaults.trust_user",
            ),
            (
                "[tenant_defaults]\ndefault_profile = \"default\"",
                "tenant_defaults.default_profile",
            ),
        ] {
            let text = crate::testing::parse(&format!("{BASE}\n{added}"))
                .unwrap_err()
                .to_string();
            assert!(text.contains(key), "{added}: {text}");
        }
    }
}
