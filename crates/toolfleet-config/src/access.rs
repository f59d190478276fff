//! What a tenant may use, asked of a loaded [`FleetConfig`]: its default
//! profile, whether its users are trusted, which data sources and agents it
//! may use ([`crate::tenants`] describes the keys); and the checks at load
//! that keep those answers consistent.

use toolfleet_llm::config_file::{key_segment, names};
use toolfleet_protocol::valid_tenant;

use crate::file::FleetConfig;
use crate::limits::LimitKeys;
use crate::tenants::TenantConfig;

impl FleetConfig {
    /// What the file says about `tenant` (the defaults when nothing).
    pub fn tenant(&self, tenant: &str) -> TenantConfig {
        self.tenants.get(tenant).cloned().unwrap_or_default()
    }

    /// Whether `tenant`'s jobs name their users as the fleet trusts them
    /// (`trust_user`).
    pub fn trusts_user(&self, tenant: &str) -> bool {
        self.tenants.get(tenant).is_some_and(|t| t.trust_user)
    }

    /// The profile a job of `tenant` runs when it names none: the
    /// tenant's `default_profile`, else the file's.
    pub fn default_profile_of(&self, tenant: &str) -> &str {
        self.tenants
            .get(tenant)
            .and_then(|t| t.default_profile.as_deref())
            .unwrap_or(&self.default_profile)
    }

    /// Whether `tenant` may use the data source `id`: a declared one when
    /// its `tenants` allow it, an undeclared one always.
    pub fn data_source_allows(&self, id: &str, tenant: &str) -> bool {
        self.data_sources
            .get(id)
            .is_none_or(|d| d.tenants.allows(tenant))
    }

    /// Whether the agent tool of `profile` may be offered to `tenant`:
    /// both the agent's and the profile's `tenants` allow it.
    pub fn agent_allows(&self, profile: &str, tenant: &str) -> bool {
        self.profiles.get(profile).is_some_and(|p| {
            p.tenants.allows(tenant) && p.agent.as_ref().is_some_and(|a| a.tenants.allows(tenant))
        })
    }

    /// Each `[tenants.<name>]`: a tenant name, and a default profile that
    /// exists and allows that tenant.
    pub(crate) fn check_tenants(&self) -> Result<(), (String, String)> {
        for (name, tenant) in &self.tenants {
            let at = format!("tenants.{}", key_segment(name));
            if !valid_tenant(name) {
                return Err((
                    at,
                    format!("{name:?} is not a tenant name (1-64 of letters, digits, `_` and `-`)"),
                ));
            }
            let Some(default) = &tenant.default_profile else {
                continue;
            };
            let at = format!("{at}.default_profile");
            let Some(profile) = self.profiles.get(default) else {
                return Err((
                    at,
                    format!(
                        "no profile named {default:?} (profiles: {})",
                        names(self.profiles.keys())
                    ),
                ));
            };
            if !profile.tenants.allows(name) {
                return Err((
                    at,
                    format!(
                        "profile {default:?} does not allow tenant {name:?} (its tenants: {})",
                        profile.tenants.describe()
                    ),
                ));
            }
        }
        Ok(())
    }

    /// A profile's sink and declared data source allow every tenant the
    /// profile allows: otherwise one tenant's answers would reach another's
    /// sink, or its questions another's source.
    pub(crate) fn check_data_sources(&self) -> Result<(), (String, String)> {
        for id in self.data_sources.keys() {
            if id.trim().is_empty() || id.len() > 256 || id.contains(['\r', '\n']) {
                return Err((
                    format!("data_sources.{}", key_segment(id)),
                    "a data source id is 1-256 characters without line breaks".to_owned(),
                ));
            }
        }
        for (name, profile) in &self.profiles {
            let at = format!("profiles.{}", key_segment(name));
            let sink = profile
                .sink
                .as_ref()
                .and_then(|s| Some((s, self.sinks.get(s)?)));
            if let Some((sink, config)) = sink
                && !config.tenants.covers(&profile.tenants)
            {
                return Err((
                    format!("{at}.sink"),
                    format!(
                        "sink {sink:?} allows tenants {} but the profile allows {}: every tenant \
                         of the profile must be allowed by its sink",
                        config.tenants.describe(),
                        profile.tenants.describe()
                    ),
                ));
            }
            let source = profile
                .data_source
                .as_ref()
                .and_then(|d| Some((d, self.data_sources.get(d)?)));
            if let Some((source, config)) = source
                && !config.tenants.covers(&profile.tenants)
            {
                return Err((
                    format!("{at}.data_source"),
                    format!(
                        "data source {source:?} allows tenants {} but the profile allows {}: \
                         every tenant of the profile must be allowed by its data source",
                        config.tenants.describe(),
                        profile.tenants.describe()
                    ),
                ));
            }
        }
        Ok(())
    }
}

impl FleetConfig {
    /// One per-tenant key as it applies to `tenant`: its own table's
    /// value, else `[tenant_defaults]`'s, else `None` (the caller's
    /// built-in default). Every per-tenant setting is read this way.
    pub fn tenant_key<T>(
        &self,
        tenant: &str,
        key: impl Fn(&TenantConfig) -> Option<T>,
    ) -> Option<T> {
        self.tenants
            .get(tenant)
            .and_then(&key)
            .or_else(|| key(&self.tenant_defaults))
    }

    /// `tenant`'s limits: its own keys, each unset one from
    /// `[tenant_defaults]`.
    pub fn limits_of(&self, tenant: &str) -> LimitKeys {
        let own = self
            .tenants
            .get(tenant)
            .map(TenantConfig::limits)
            .unwrap_or_default();
        own.or(self.tenant_defaults.limits())
    }
}
