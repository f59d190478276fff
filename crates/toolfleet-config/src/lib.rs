//! toolfleet-config: the fleet's configuration file — profiles and their
//! policies, sinks, links, agents — parsed and validated once, and resolved
//! per chat job; shared by the orchestrator and the `toolfleet` CLI.
//!
//! The same TOML file also holds the model deployments and prices: those
//! tables are the LLM client's ([`toolfleet_llm::deployments`],
//! [`toolfleet_llm::prices`]), which a process that only calls models
//! (the LLM tools worker) reads alone ([`toolfleet_llm::model_config`]).
//! This crate reads and checks the whole file.
//!
//! # Layout
//!
//! - [`file`](mod@file): [`FleetConfig`], the whole file, its load and its checks
//!   across tables; [`ConfigArgs`] builds it from the `--config` /
//!   `--llm-*` flags;
//! - [`profile`]: [`Profile`], what a chat job names;
//! - [`policy`]: the loop, scoping and retrieval policies of a profile;
//! - [`approvals`]: which calls a person must approve, and for how long a
//!   parked invocation waits;
//! - [`agents`]: profiles exposed as tools, and how deep they nest;
//! - [`sinks`]: named webhooks and relay subjects;
//! - [`tenants`]: `[tenants.<name>]`, `[data_sources.<id>]` and the
//!   `tenants = [..]` every profile, sink, agent and data source carries
//!   ([`TenantScope`]); [`access`]: what a tenant may use, asked of the
//!   loaded file, and the checks that keep it consistent;
//! - [`poison`]: how many unreadable chat jobs a tenant may send before
//!   it is suspended, and for how long ([`PoisonPolicy`]);
//! - [`caps`]: what a tenant may store (queued jobs, job size, kept
//!   events, parked invocations), per tenant and in `[tenant_defaults]`;
//! - [`limits`]: a tenant's rate limits, budgets and per-run caps
//!   (`[tenants.<name>]` keys, `[tenant_defaults]`), and the bound on
//!   their overshoot;
//! - [`cancels`]: per tenant, how many cancels are written down per second
//!   and how many of jobs not started are remembered ([`CancelLimits`]);
//! - [`fair`]: each tenant's share of chat dispatch (`weight`, with
//!   `[tenant_defaults]`);
//! - [`pools`]: worker pools declared to the orchestrator
//!   (`[pools.<name>]`), whose tools are offered while none of their
//!   workers is live (scale from zero);
//! - [`resolve`]: a job's profile, as its tenant may use it, on its first
//!   usable deployment ([`ResolvedProfile`]), with the trust that
//!   deployment carries;
//! - [`errors`]: [`ConfigError`] (the file) and [`ResolveError`] (a job).
//!
//! # Invariants
//!
//! - Depends only on the contract and the LLM client crates: never on the
//!   orchestrator, the service plumbing, the store or the worker SDK.
//! - A loaded [`FleetConfig`] is consistent (see [`file`](mod@file)); no secret is
//!   in the file, in a message or in `Debug` output.
//! - A job never runs on a profile it did not ask for (bar its tenant's
//!   default when it names none) nor on one its tenant may not use; its
//!   provider confidence, provider and connection are its deployment's.

// Tests are exempt from the 100-line limit: a scenario reads top to bottom.
#![cfg_attr(test, allow(clippy::too_many_lines))]

pub mod access;
pub mod agents;
pub mod approvals;
pub mod cancels;
pub mod caps;
pub mod errors;
pub mod fair;
pub mod file;
pub mod limits;
pub mod poison;
pub mod policy;
pub mod pools;
pub mod profile;
pub mod resolve;
pub mod sinks;
pub mod tenants;
#[cfg(test)]
mod testing;

pub use agents::AgentTool;
pub use cancels::CancelLimits;
pub use caps::TenantCaps;
pub use errors::{ConfigError, ConfigErrorKind, ResolveError};
pub use file::{ConfigArgs, FleetConfig};
pub use limits::{LimitKeys, Ratio, Usd};
pub use poison::PoisonPolicy;
pub use policy::{LoopPolicy, RagPolicy, ScopingPolicy, TruncatedPolicy};
pub use pools::PoolConfig;
pub use profile::{DEFAULT_ORCHESTRATOR, ORCHESTRATORS, Profile};
pub use resolve::{ResolvedDeployment, ResolvedProfile};
pub use sinks::SinkConfig;
pub use tenants::{CapKeys, DataSourceConfig, TenantConfig, TenantScope};
pub use toolfleet_llm::model_config::DEFAULT_PROFILE;
