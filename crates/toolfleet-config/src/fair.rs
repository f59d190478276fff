//! Fair share of chat dispatch: each tenant's `weight`.
//!
//! Orchestrators take chat jobs from the tenants that have work in
//! weighted turns (smooth weighted round robin), so a tenant's backlog
//! delays only that tenant: with weights 2 and 1 and both tenants
//! flooding, the first gets about two jobs started for every one of the
//! second; a tenant with no work waiting takes no turn.
//!
//! | key | type, default | meaning |
//! |---|---|---|
//! | `tenants.<name>.weight` | 1..=1000, `[tenant_defaults]`'s | the tenant's share of chat dispatch, relative to the other tenants with work waiting |
//! | `tenant_defaults.weight` | 1..=1000, `1` | the weight of a tenant with no `weight` of its own (or no table) |
//!
//! `[tenant_defaults]` takes the keys of `[tenants.<name>]` that have a
//! default; `default_profile` (the file's `default_profile` is its
//! default) and `trust_user` (never on by default: trust is granted per
//! tenant) are refused there.

use toolfleet_llm::config_file::key_segment;

use crate::FleetConfig;

/// The weight of a tenant nothing in the file gives one.
pub const DEFAULT_WEIGHT: u32 = 1;

/// The largest weight: past it, one tenant's turns would crowd out
/// everyone else's bar a few jobs an hour.
pub const MAX_WEIGHT: u32 = 1000;

impl FleetConfig {
    /// `tenant`'s share of chat dispatch: its `weight`, else
    /// `[tenant_defaults]`'s, else [`DEFAULT_WEIGHT`].
    pub fn weight_of(&self, tenant: &str) -> u32 {
        self.tenant_key(tenant, |t| t.weight)
            .unwrap_or(DEFAULT_WEIGHT)
    }

    /// Weights in range; `[tenant_defaults]` holds only keys that have a
    /// default.
    pub(crate) fn check_fair_share(&self) -> Result<(), (String, String)> {
        let weights = self
            .tenants
            .iter()
            .map(|(name, t)| (format!("tenants.{}.weight", key_segment(name)), t.weight))
            .chain([(
                "tenant_defaults.weight".to_owned(),
                self.tenant_defaults.weight,
            )]);
        for (at, weight) in weights {
            if let Some(w) = weight
                && !(1..=MAX_WEIGHT).contains(&w)
            {
                return Err((at, format!("must be 1..={MAX_WEIGHT}, got {w}")));
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::testing::{MINIMAL, parse, parse_err};

    #[test]
    fn a_weight_is_the_tenants_then_the_defaults_then_one() {
        let c = parse(MINIMAL).unwrap();
        assert_eq!(c.weight_of("acme"), 1);
        let c = parse(&format!(
            "{MINIMAL}\n[tenant_defaults]\nweight = 3\n[tenants.acme]\nweight = 2\n[tenants.globex]\ntrust_user = true\n"
        ))
        .unwrap();
        assert_eq!(c.weight_of("acme"), 2);
        assert_eq!(c.weight_of("globex"), 3);
        assert_eq!(c.weight_of("initech"), 3);
    }

    #[test]
    fn a_weight_out_of_range_or_a_default_without_one_is_refused() {
        for (extra, path) in [
            ("[tenants.acme]\nweight = 0\n", "tenants.acme.weight"),
            (
                "[tenant_defaults]\nweight = 1001\n",
                "tenant_defaults.weight",
            ),
            (
                "[tenant_defaults]\ntrust_user = true\n",
                "tenant_defaults.trust_user",
            ),
            (
                "[tenant_defaults]\ndefault_profile = \"default\"\n",
                "tenant_defaults.default_profile",
            ),
        ] {
            let e = parse_err(&format!("{MINIMAL}\n{extra}")).to_string();
            assert!(e.contains(path), "{extra}: {e}");
        }
    }
}
