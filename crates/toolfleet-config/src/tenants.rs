//! Tenants: what each tenant may use, and what the operator says about
//! each tenant. A tenant is the token of the submit subject its NATS
//! identity may publish on (`<prefix>.chat.submit.<tenant>`), never a
//! field a client writes; this is what the fleet lets it do.
//!
//! | key | type, default | meaning |
//! |---|---|---|
//! | `[tenants.<name>]` | table | one tenant's settings; `<name>` is a tenant (1-64 of `[A-Za-z0-9_-]`) |
//! | `tenants.<name>.default_profile` | profile name, the file's `default_profile` | the profile a job of this tenant runs when it names none; must exist and allow this tenant |
//! | `tenants.<name>.requests_per_minute`, `tokens_per_minute`, `spend_per_day_usd`, `spend_per_month_usd`, `soft_limit_ratio`, `max_run_tokens`, `max_run_spend_usd` | see [`crate::limits`], none | the tenant's rate limits, budgets and per-run caps |
//! | `[tenant_defaults]` | table | the same keys, for every tenant that does not set them (no `default_profile` or `trust_user` here) |
//! | `tenants.<name>.trust_user` | bool, `false` | the tenant's identity is an authenticated front door that asserts its users: a job's `user` is passed to tools as trusted (`Toolfleet-User`); otherwise tools get no user |
//! | `[tenant_defaults]` | table, the same keys | values for every tenant whose own table does not set them |
//! | `tenants.<name>.cancel_rate`, `cancel_burst`, `remembered_cancels` | see [`crate::cancels`] | how many of the tenant's cancels are written down, and remembered for jobs not started |
//! | `tenants` (in a profile, `[data_sources.<id>]`, `[sinks.<name>]`, a profile's `agent`) | list of tenant names, or `["*"]`; `["*"]` | which tenants may use it; `"*"` stands alone; a name no identity has is allowed (it matches nobody) |
//! | `tenants.<name>.poison_limit`, `poison_window_secs`, `poison_cooloff_secs` | see [`crate::poison`] | when the tenant's unreadable chat jobs suspend it, and for how long |
//! | `[tenant_defaults]` | table | the same keys as a tenant's table, for every tenant whose table lacks them (`default_profile` and `trust_user` are not read here: see the file's `default_profile`) |
//! | `[data_sources.<id>]` | table | declares a data source (the id a profile's `data_source` or a job's `dataSourceId` names, and the collection of an attached document id `<collection>:<path>`) with the `tenants` that may use it; an undeclared id is usable by every tenant (the retrieval store filters by tenant anyway) |
//!
//! What a tenant may not use is refused, never swapped for something it
//! may: a job naming an unknown profile ends with `unknown_profile`, one
//! its tenant may not use with `profile_not_allowed`, a declared data
//! source (or an attached document of one) its tenant may not use with
//! `data_source_not_allowed`. Sinks and agents are the profile's: a
//! profile's sink and data source must allow every tenant the profile
//! allows (checked at load), and an agent tool is offered only to the
//! tenants both its `agent.tenants` and its profile's `tenants` allow.
//! [`crate::access`] answers, for a loaded file, what a tenant may use.

use std::collections::BTreeSet;

use serde::{Deserialize, Deserializer};
use toolfleet_protocol::valid_tenant;

use crate::limits::{LimitKeys, Ratio, Usd};

/// The tenants that may use something (`tenants = [..]`): every tenant
/// (`["*"]`, the default) or the ones named.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TenantScope(Option<BTreeSet<String>>);

/// The entry that stands for every tenant.
pub const ANY_TENANT: &str = "*";

impl TenantScope {
    /// Every tenant (`["*"]`).
    pub fn any() -> Self {
        Self(None)
    }

    /// Only the tenants named (each a valid tenant name).
    pub fn only<I: IntoIterator<Item = S>, S: Into<String>>(tenants: I) -> Self {
        Self(Some(tenants.into_iter().map(Into::into).collect()))
    }

    /// Whether `tenant` may use it.
    pub fn allows(&self, tenant: &str) -> bool {
        match &self.0 {
            None => true,
            Some(names) => names.contains(tenant),
        }
    }

    /// Whether every tenant `other` allows is allowed here too.
    pub fn covers(&self, other: &TenantScope) -> bool {
        match (&self.0, &other.0) {
            (None, _) => true,
            (Some(_), None) => false,
            (Some(mine), Some(theirs)) => theirs.is_subset(mine),
        }
    }

    /// The tenants named; `None` for every tenant.
    pub fn names(&self) -> Option<&BTreeSet<String>> {
        self.0.as_ref()
    }

    /// How it reads in a message: `["*"]` or the list.
    pub fn describe(&self) -> String {
        match &self.0 {
            None => format!("[{ANY_TENANT:?}]"),
            Some(names) => format!("{:?}", names.iter().collect::<Vec<_>>()),
        }
    }
}

impl<'de> Deserialize<'de> for TenantScope {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let list = Vec::<String>::deserialize(d)?;
        Self::from_list(list).map_err(serde::de::Error::custom)
    }
}

impl TenantScope {
    fn from_list(list: Vec<String>) -> Result<Self, String> {
        if list.is_empty() {
            return Err(
                "`tenants` must name at least one tenant, or be [\"*\"] for every tenant (the \
                 default when left out)"
                    .to_owned(),
            );
        }
        if list.iter().any(|t| t == ANY_TENANT) {
            if list.len() > 1 {
                return Err("\"*\" (every tenant) stands alone in `tenants`".to_owned());
            }
            return Ok(Self::any());
        }
        if let Some(bad) = list.iter().find(|t| !valid_tenant(t)) {
            return Err(format!(
                "{bad:?} is not a tenant name (1-64 of letters, digits, `_` and `-`) or \"*\""
            ));
        }
        Ok(Self::only(list))
    }
}

/// What the operator says about one tenant (`[tenants.<name>]`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// The profile a job of this tenant runs when it names none; the
    /// file's `default_profile` when unset.
    #[serde(default)]
    pub default_profile: Option<String>,
    /// The tenant's identity asserts its users (an authenticated front
    /// door): a job's `user` reaches tools as trusted. Off by default.
    #[serde(default)]
    pub trust_user: bool,
    /// Unreadable chat jobs within the window that suspend the tenant
    /// (0: never); see [`crate::poison`].
    #[serde(default)]
    pub poison_limit: Option<u32>,
    /// The window of the poison count, in seconds.
    #[serde(default)]
    pub poison_window_secs: Option<u64>,
    /// How long a suspension lasts, in seconds.
    #[serde(default)]
    pub poison_cooloff_secs: Option<u64>,
    /// Caps on what the tenant stores ([`crate::caps`]); `None`:
    /// `[tenant_defaults]`'s, else the fleet's.
    #[serde(default)]
    pub max_queued_jobs: Option<u64>,
    #[serde(default)]
    pub max_job_bytes: Option<u64>,
    #[serde(default)]
    pub max_stored_events: Option<u64>,
    #[serde(default)]
    pub max_parked: Option<u64>,
    #[serde(default)]
    pub max_jobs_in_flight: Option<u64>,
    #[serde(default)]
    pub max_tool_calls_in_flight: Option<u64>,
    /// Rate limits, budgets and per-run caps ([`crate::limits`]); `None`:
    /// `[tenant_defaults]`'s, else no limit.
    #[serde(default, deserialize_with = "crate::limits::positive")]
    pub requests_per_minute: Option<u32>,
    #[serde(default, deserialize_with = "crate::limits::positive")]
    pub tokens_per_minute: Option<u64>,
    #[serde(default)]
    pub spend_per_day_usd: Option<Usd>,
    #[serde(default)]
    pub spend_per_month_usd: Option<Usd>,
    #[serde(default)]
    pub soft_limit_ratio: Option<Ratio>,
    #[serde(default, deserialize_with = "crate::limits::positive")]
    pub max_run_tokens: Option<u64>,
    #[serde(default)]
    pub max_run_spend_usd: Option<Usd>,
    /// Cancels written down per second ([`crate::cancels`]).
    #[serde(default)]
    pub cancel_rate: Option<u32>,
    /// Cancels written down at once before the rate applies.
    #[serde(default)]
    pub cancel_burst: Option<u32>,
    /// Cancels of jobs not started yet remembered at once.
    #[serde(default)]
    pub remembered_cancels: Option<u32>,
    /// The tenant's share of chat dispatch (fair dispatch takes jobs from
    /// the tenants with work in weighted turns); `[tenant_defaults]`'s,
    /// else [`crate::fair::DEFAULT_WEIGHT`], when unset. See
    /// [`crate::fair`].
    #[serde(default)]
    pub weight: Option<u32>,
}

/// The caps keys of [`crate::caps`] as a `[tenants.<name>]` or
/// `[tenant_defaults]` table writes them; `None`: not set there.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CapKeys {
    pub max_queued_jobs: Option<u64>,
    pub max_job_bytes: Option<u64>,
    pub max_stored_events: Option<u64>,
    pub max_parked: Option<u64>,
    pub max_jobs_in_flight: Option<u64>,
    pub max_tool_calls_in_flight: Option<u64>,
}

impl TenantConfig {
    /// The limit keys this table sets.
    pub fn limits(&self) -> LimitKeys {
        LimitKeys {
            requests_per_minute: self.requests_per_minute,
            tokens_per_minute: self.tokens_per_minute,
            spend_per_day_usd: self.spend_per_day_usd,
            spend_per_month_usd: self.spend_per_month_usd,
            soft_limit_ratio: self.soft_limit_ratio,
            max_run_tokens: self.max_run_tokens,
            max_run_spend_usd: self.max_run_spend_usd,
        }
    }
}

/// `[tenant_defaults]` holds defaults of per-tenant keys; a tenant's
/// default profile and its trust are said per tenant only.
pub(crate) fn check_defaults(defaults: &TenantConfig) -> Result<(), (String, String)> {
    if defaults.default_profile.is_some() {
        return Err((
            "tenant_defaults.default_profile".to_owned(),
            "the default profile of every tenant is the top-level `default_profile`".to_owned(),
        ));
    }
    if defaults.trust_user {
        return Err((
            "tenant_defaults.trust_user".to_owned(),
            "whether a tenant's users are trusted is said per tenant ([tenants.<name>])".to_owned(),
        ));
    }
    Ok(())
}

/// A declared data source (`[data_sources.<id>]`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DataSourceConfig {
    /// Which tenants may search it.
    #[serde(default)]
    pub tenants: TenantScope,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scope(list: &[&str]) -> Result<TenantScope, String> {
        TenantScope::from_list(list.iter().map(|s| (*s).to_owned()).collect())
    }

    #[test]
    fn a_scope_is_every_tenant_or_the_ones_named() {
        let any = scope(&["*"]).unwrap();
        assert_eq!(any, TenantScope::default());
        assert!(any.allows("acme") && any.allows("globex"));
        let acme = scope(&["acme", "initech"]).unwrap();
        assert!(acme.allows("acme") && !acme.allows("globex"));
        assert!(any.covers(&acme) && !acme.covers(&any));
        assert!(acme.covers(&TenantScope::only(["acme"])));
        assert!(!TenantScope::only(["acme"]).covers(&acme));
        for (bad, says) in [
            (&[][..], "at least one"),
            (&["*", "acme"][..], "stands alone"),
            (&["acme corp"][..], "not a tenant name"),
            (&["a.b"][..], "not a tenant name"),
        ] {
            let e = scope(bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    const BASE: &str = r#"
        [deployments.local]
        base_url = "http://127.0.0.1:11434/v1"
        model = "m"
        [profiles.default]
        deployment = "local"
    "#;

    #[test]
    fn tenant_tables_data_sources_and_scopes_load() {
        let config = crate::testing::parse(&format!(
            r#"{BASE}
            [profiles.acme]
            deployment = "local"
            tenants = ["acme"]
            data_source = "acme-kb"
            sink = "acme-hook"
            agent = {{ name = "acme_helper", description = "Helps.", tenants = ["acme"] }}
            [profiles.shared-agent]
            deployment = "local"
            agent = {{ name = "helper", description = "Helps." }}
            [sinks.acme-hook]
            relay = "acme.answers"
            tenants = ["acme", "nobody-yet"]
            [data_sources.acme-kb]
            tenants = ["acme"]
            [data_sources.handbook]
            [tenants.acme]
            default_profile = "acme"
            trust_user = true
            [tenants.not-a-client-yet]
            "#
        ))
        .expect("loads");
        assert_eq!(config.default_profile_of("acme"), "acme");
        assert_eq!(config.default_profile_of("globex"), "default");
        assert_eq!(config.tenant("globex"), TenantConfig::default());
        assert!(config.trusts_user("acme") && !config.trusts_user("globex"));
        assert!(config.data_source_allows("acme-kb", "acme"));
        assert!(!config.data_source_allows("acme-kb", "globex"));
        assert!(
            config.data_source_allows("handbook", "globex"),
            "[\"*\"] by default"
        );
        assert!(config.data_source_allows("undeclared", "globex"));
        assert!(config.agent_allows("acme", "acme"));
        assert!(!config.agent_allows("acme", "globex"));
        assert!(config.agent_allows("shared-agent", "globex"));
        assert!(!config.agent_allows("default", "acme"), "no agent");
        assert_eq!(config.profiles["default"].tenants, TenantScope::any());
        assert_eq!(
            config.sinks["acme-hook"].tenants,
            TenantScope::only(["acme", "nobody-yet"])
        );
    }

    /// Data-driven: each addition to `BASE` is refused at the given key.
    #[test]
    fn bad_tenant_configuration_is_refused_at_its_key() {
        let cases: &[(&str, &str, &str)] = &[
            // (added, expected key, words in the message)
            (
                "[tenants.acme]\ndefault_profile = \"nope\"",
                "tenants.acme.default_profile",
                "no profile named \"nope\"",
            ),
            (
                "[profiles.g]\ndeployment = \"local\"\ntenants = [\"globex\"]\n\
                 [tenants.acme]\ndefault_profile = \"g\"",
                "tenants.acme.default_profile",
                "does not allow tenant \"acme\"",
            ),
            (
                "[tenants.\"acme corp\"]",
                "tenants.\"acme corp\"",
                "not a tenant name",
            ),
            (
                "[tenants.acme]\ntrust_user = \"yes\"",
                "tenants.acme.trust_user",
                "",
            ),
            (
                "[tenants.acme]\ntrust_users = true",
                "tenants.acme.trust_users",
                "trust_users",
            ),
            (
                "[profiles.p]\ndeployment = \"local\"\ntenants = \"acme\"",
                "profiles.p.tenants",
                "",
            ),
            (
                "[profiles.p]\ndeployment = \"local\"\ntenants = [\"*\", \"acme\"]",
                "profiles.p.tenants",
                "stands alone",
            ),
            (
                "[profiles.p]\ndeployment = \"local\"\ntenants = []",
                "profiles.p.tenants",
                "at least one",
            ),
            (
                "[data_sources.kb]\ntenants = [\"acme\"]\n\
                 [profiles.p]\ndeployment = \"local\"\ndata_source = \"kb\"",
                "profiles.p.data_source",
                "every tenant of the profile",
            ),
            (
                "[sinks.s]\nrelay = \"a.b\"\ntenants = [\"acme\"]\n\
                 [profiles.p]\ndeployment = \"local\"\nsink = \"s\"\ntenants = [\"acme\", \"globex\"]",
                "profiles.p.sink",
                "every tenant of the profile",
            ),
            (
                "[data_sources.kb]\ntenant = [\"acme\"]",
                "data_sources.kb.tenant",
                "tenant",
            ),
        ];
        for (added, key, words) in cases {
            let e = crate::testing::parse_err(&format!("{BASE}\n{added}\n"));
            assert_eq!(e.key.as_deref(), Some(*key), "{added}: {e}");
            assert!(e.to_string().contains(words), "{added}: {e}");
        }
    }
}
