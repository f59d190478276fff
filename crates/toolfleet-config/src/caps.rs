//! Caps per tenant on what it stores (issue 29): how many chat jobs it may
//! have queued, how big one may be, how many of its invocations' events
//! the fleet keeps, how many of its invocations may wait parked for
//! approval. Set per tenant in `[tenants.<name>]`, for every tenant
//! without its own in `[tenant_defaults]`, else the fleet's defaults below.
//!
//! | key (in `[tenants.<name>]` or `[tenant_defaults]`) | type, default | meaning |
//! |---|---|---|
//! | `max_queued_jobs` | 1..=1000000, [`DEFAULT_MAX_QUEUED_JOBS`] | the tenant's chat jobs in the chat stream at once (waiting or running). The stream's per-subject limit is the largest of these caps, so a submit past it is refused on its publish ack (`maximum messages per subject exceeded`; the Rust client's `queue_full`); a tenant whose cap is lower has a job taken while it already has that many ahead of it ended with `queue_full` |
//! | `max_job_bytes` | 1024..=1048576, 1048576 (the contract's `MAX_JOB_BYTES`) | the largest chat job body the tenant may submit; a bigger one ends with `malformed_job` (its dead letter's code `too_large`), naming the cap |
//! | `max_stored_events` | 1..=10000000, [`DEFAULT_MAX_STORED_EVENTS`] | how many of the tenant's invocations keep their latest event in the events stream (and 1,000 times that in history events): past it the tenant's own oldest go, never another tenant's |
//! | `max_parked` | 1..=100000, [`DEFAULT_MAX_PARKED`] | the tenant's invocations parked for approval at once; one more ends with `too_many_parked` |
//! | `max_jobs_in_flight` | 1..=100000, none | the tenant's chat jobs running at once across every orchestrator: past it, fair dispatch takes no more of its jobs until one ends (they wait in the stream, in the tenant's own queue) |
//! | `max_tool_calls_in_flight` | 1..=100000, none | the tenant's tool calls running (or queued) at once in each tool's pool, across every orchestrator: a call past it waits for one of the tenant's own to end before it is sent, so one tenant never fills a pool's queue ahead of the others |
//!
//! Values are checked at load (`tenants.<name>.<key>` or
//! `tenant_defaults.<key>` in the error).

use toolfleet_llm::config_file::key_segment;
use toolfleet_protocol::MAX_JOB_BYTES;

use crate::file::FleetConfig;
use crate::tenants::{CapKeys, TenantConfig};

/// Chat jobs a tenant may have in the chat stream when nothing says
/// otherwise.
pub const DEFAULT_MAX_QUEUED_JOBS: u64 = toolfleet_protocol::streams::DEFAULT_MAX_QUEUED_JOBS;
/// Invocations of a tenant whose latest event is kept, when nothing says
/// otherwise.
pub const DEFAULT_MAX_STORED_EVENTS: u64 = 100_000;
/// Invocations of a tenant parked at once, when nothing says otherwise.
pub const DEFAULT_MAX_PARKED: u64 = 1_000;

/// One tenant's caps, resolved (its key, else `[tenant_defaults]`'s, else
/// the fleet's default).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TenantCaps {
    pub max_queued_jobs: u64,
    pub max_job_bytes: usize,
    pub max_stored_events: u64,
    pub max_parked: u64,
    /// `None`: no cap.
    pub max_jobs_in_flight: Option<u64>,
    /// Per tool pool; `None`: no cap.
    pub max_tool_calls_in_flight: Option<u64>,
}

/// Each key's range.
const RANGES: [(&str, u64, u64); 6] = [
    ("max_queued_jobs", 1, 1_000_000),
    ("max_job_bytes", 1024, MAX_JOB_BYTES as u64),
    ("max_stored_events", 1, 10_000_000),
    ("max_parked", 1, 100_000),
    ("max_jobs_in_flight", 1, 100_000),
    ("max_tool_calls_in_flight", 1, 100_000),
];

impl CapKeys {
    fn values(&self) -> [Option<u64>; 6] {
        [
            self.max_queued_jobs,
            self.max_job_bytes,
            self.max_stored_events,
            self.max_parked,
            self.max_jobs_in_flight,
            self.max_tool_calls_in_flight,
        ]
    }

    /// Each key set is in its range; the error is `(key path, message)`.
    fn check(&self, at: &str) -> Result<(), (String, String)> {
        for ((key, min, max), value) in RANGES.iter().zip(self.values()) {
            if let Some(value) = value
                && !(*min..=*max).contains(&value)
            {
                return Err((
                    format!("{at}.{key}"),
                    format!("must be between {min} and {max}, not {value}"),
                ));
            }
        }
        Ok(())
    }
}

impl TenantConfig {
    /// The caps keys of a `[tenants.<name>]` table.
    pub fn cap_keys(&self) -> CapKeys {
        CapKeys {
            max_queued_jobs: self.max_queued_jobs,
            max_job_bytes: self.max_job_bytes,
            max_stored_events: self.max_stored_events,
            max_parked: self.max_parked,
            max_jobs_in_flight: self.max_jobs_in_flight,
            max_tool_calls_in_flight: self.max_tool_calls_in_flight,
        }
    }
}

impl FleetConfig {
    /// `tenant`'s caps: its own keys, else `[tenant_defaults]`, else the
    /// fleet's defaults.
    pub fn caps_of(&self, tenant: &str) -> TenantCaps {
        TenantCaps {
            max_queued_jobs: self
                .tenant_key(tenant, |t| t.max_queued_jobs)
                .unwrap_or(DEFAULT_MAX_QUEUED_JOBS),
            max_job_bytes: self
                .tenant_key(tenant, |t| t.max_job_bytes)
                .map_or(MAX_JOB_BYTES, |b| b as usize),
            max_stored_events: self
                .tenant_key(tenant, |t| t.max_stored_events)
                .unwrap_or(DEFAULT_MAX_STORED_EVENTS),
            max_parked: self
                .tenant_key(tenant, |t| t.max_parked)
                .unwrap_or(DEFAULT_MAX_PARKED),
            max_jobs_in_flight: self.tenant_key(tenant, |t| t.max_jobs_in_flight),
            max_tool_calls_in_flight: self.tenant_key(tenant, |t| t.max_tool_calls_in_flight),
        }
    }

    /// The chat stream's per-subject limit: the largest queued-jobs cap of
    /// any tenant (a named one, or the default every other tenant has).
    /// Tenants with a lower cap are held to it when their job is taken.
    pub fn largest_queued_cap(&self) -> u64 {
        let default = self
            .tenant_defaults
            .max_queued_jobs
            .unwrap_or(DEFAULT_MAX_QUEUED_JOBS);
        self.tenants
            .keys()
            .map(|t| self.caps_of(t).max_queued_jobs)
            .fold(default, u64::max)
    }

    /// `[tenant_defaults]` and each tenant's caps are in range.
    pub(crate) fn check_caps(&self) -> Result<(), (String, String)> {
        self.tenant_defaults.cap_keys().check("tenant_defaults")?;
        for (name, tenant) in &self.tenants {
            tenant
                .cap_keys()
                .check(&format!("tenants.{}", key_segment(name)))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::testing::MINIMAL as BASE;

    #[test]
    fn a_tenant_has_its_own_cap_else_the_defaults_table_else_the_fleets() {
        let config = crate::testing::parse(&format!(
            "{BASE}\n[tenant_defaults]\nmax_queued_jobs = 50\nmax_parked = 7\n\
             [tenants.acme]\nmax_queued_jobs = 3\nmax_job_bytes = 2048\n\
             [tenants.globex]\ntrust_user = true\n"
        ))
        .expect("loads");
        let acme = config.caps_of("acme");
        assert_eq!(acme.max_queued_jobs, 3);
        assert_eq!(acme.max_job_bytes, 2048);
        assert_eq!(acme.max_parked, 7, "from [tenant_defaults]");
        assert_eq!(acme.max_stored_events, DEFAULT_MAX_STORED_EVENTS);
        let globex = config.caps_of("globex");
        assert_eq!(globex.max_queued_jobs, 50);
        assert_eq!(globex.max_job_bytes, MAX_JOB_BYTES);
        assert_eq!(config.caps_of("unlisted"), globex);
        assert_eq!(config.largest_queued_cap(), 50);
        let bigger = crate::testing::parse(&format!(
            "{BASE}\n[tenants.acme]\nmax_queued_jobs = 20000\n"
        ))
        .expect("loads");
        assert_eq!(bigger.largest_queued_cap(), 20_000);
        let none = crate::testing::parse(BASE).expect("loads");
        assert_eq!(none.largest_queued_cap(), DEFAULT_MAX_QUEUED_JOBS);
    }

    #[test]
    fn caps_out_of_range_are_refused_at_their_key() {
        for (added, key) in [
            (
                "[tenants.acme]\nmax_queued_jobs = 0",
                "tenants.acme.max_queued_jobs",
            ),
            (
                "[tenant_defaults]\nmax_job_bytes = 2000000",
                "tenant_defaults.max_job_bytes",
            ),
            (
                "[tenant_defaults]\nmax_parked = 0",
                "tenant_defaults.max_parked",
            ),
            (
                "[tenants.acme]\nmax_stored_events = 0",
                "tenants.acme.max_stored_events",
            ),
        ] {
            let e = crate::testing::parse_err(&format!("{BASE}\n{added}\n"));
            assert_eq!(e.key.as_deref(), Some(key), "{added}: {e}");
            assert!(e.to_string().contains("must be between"), "{e}");
        }
        let e = crate::testing::parse_err(&format!("{BASE}\n[tenant_defaults]\nmax_queue = 3\n"));
        assert_eq!(e.key.as_deref(), Some("tenant_defaults.max_queue"), "{e}");
    }
}
