//! [`Fleet`]: what every invocation of this process shares — the NATS and
//! Redis connections, the model clients, the live catalog, the metrics,
//! the configuration and the cancel tokens of the invocations running here.
//!
//! An [`Orchestrator`](crate::Orchestrator) reaches the rest of the fleet
//! through it: [`Fleet::call_model`] (the model, with streamed deltas and
//! usage recorded, in `rounds`), [`Fleet::tool_runner`] (tool calls, in
//! `dispatch`), and [`Fleet::publish_references`] (citations the tools
//! wrote, in `events`). Those methods live with the stage they belong to;
//! this module knows no stage.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_nats::jetstream::{self, kv};
use dashmap::DashMap;
use tokio_util::sync::CancellationToken;
use toolfleet_config::ResolvedProfile;
use toolfleet_llm::LlmClient;
use toolfleet_protocol::catalog::Catalog;
use toolfleet_protocol::{ChatJob, InvocationContext};
use toolfleet_store::CitationStore;
use tracing::info;

use crate::catalog::LiveCatalog;
use crate::failure::ChatErrorCode;
use crate::metrics::OrchestratorMetrics;
use crate::replies::Replies;
use crate::tools::gating;
use crate::tools::{Scope, ToolSnapshot, agents::AgentSource, blocking};
use crate::{Failure, PayloadLimits, Settings};

/// Invocations of each tenant waiting for an agent tool's nested job here.
#[derive(Default)]
pub(crate) struct AgentWaits(Arc<DashMap<String, u32>>);

impl AgentWaits {
    /// Counts one invocation of `tenant` waiting, until the guard drops.
    pub(crate) fn wait(&self, tenant: &str) -> AgentWait {
        *self.0.entry(tenant.to_owned()).or_insert(0) += 1;
        AgentWait {
            waits: self.0.clone(),
            tenant: tenant.to_owned(),
        }
    }

    /// How many of `tenant`'s invocations wait here.
    pub(crate) fn of(&self, tenant: &str) -> u32 {
        self.0.get(tenant).map_or(0, |n| *n)
    }
}

/// One invocation waiting for a nested job ([`AgentWaits::wait`]).
pub(crate) struct AgentWait {
    waits: Arc<DashMap<String, u32>>,
    tenant: String,
}

impl Drop for AgentWait {
    fn drop(&mut self) {
        let gone = match self.waits.get_mut(&self.tenant) {
            Some(mut n) => {
                *n = n.saturating_sub(1);
                *n == 0
            }
            None => false,
        };
        if gone {
            self.waits.remove_if(&self.tenant, |_, n| *n == 0);
        }
    }
}

/// What every invocation shares. Built once per orchestrator process.
pub struct Fleet {
    pub(crate) client: async_nats::Client,
    pub(crate) js: jetstream::Context,
    /// One client per deployment, built on first use.
    llms: DashMap<String, LlmClient>,
    pub(crate) store: CitationStore,
    pub(crate) metrics: OrchestratorMetrics,
    pub(crate) config: Settings,
    pub(crate) catalog: LiveCatalog,
    /// Cancel tokens of the invocations running here, by tenant and
    /// invocation id (ids are unique per tenant only); the number tells
    /// two runs of one invocation apart, so the end of one never removes
    /// the other's token.
    cancels: DashMap<(String, String), (u64, CancellationToken)>,
    runs: AtomicU64,
    /// Invocations waiting for an agent tool's nested job, by tenant.
    pub(crate) agent_waits: AgentWaits,
    /// The orchestrator's one reply subscription, shared by every run.
    pub(crate) replies: Arc<Replies>,
    /// In-progress acks for every chat job held here, from one ticker.
    pub(crate) heartbeat: toolfleet_service::jobs::Heartbeat,
    /// The NATS connection's reconnections, watched once for every run
    /// and pull loop (each takes its own view, `Reconnects::from_now`).
    pub(crate) reconnects: toolfleet_service::jobs::Reconnects,
    /// The agent tools of the configuration (a registry backend).
    agents: AgentSource,
    /// The registry and relevance index of the latest catalog generation,
    /// rebuilt whole when the catalog changes.
    tools: std::sync::Mutex<Option<Arc<ToolSnapshot>>>,
    /// Held while a snapshot is built.
    building: std::sync::Mutex<()>,
    /// The parked bucket (see [`approvals`](crate::approvals)).
    pub(crate) parked_bucket: kv::Store,
    /// The per-tenant tool settings the operator writes (see
    /// [`dispatch`](crate::dispatch)).
    pub(crate) settings_bucket: kv::Store,
    /// What each tenant stores, held to its caps (see [`crate::caps`]).
    pub(crate) tenant_store: crate::caps::TenantStore,
    /// The threads and idempotency buckets (see [`threads`](crate::threads)).
    pub(crate) threads: crate::threads::store::Buckets,
}

/// What the orchestrator's start makes for the [`Fleet`] besides its
/// connections.
pub(crate) struct Parts {
    pub(crate) replies: Arc<Replies>,
    pub(crate) agents: AgentSource,
    pub(crate) parked_bucket: kv::Store,
    pub(crate) settings_bucket: kv::Store,
    pub(crate) threads: crate::threads::store::Buckets,
    pub(crate) heartbeat: toolfleet_service::jobs::Heartbeat,
    pub(crate) reconnects: toolfleet_service::jobs::Reconnects,
}

impl Fleet {
    pub(crate) fn new(
        client: async_nats::Client,
        js: jetstream::Context,
        store: CitationStore,
        metrics: OrchestratorMetrics,
        config: Settings,
        parts: Parts,
    ) -> Self {
        let Parts {
            replies,
            agents,
            parked_bucket,
            settings_bucket,
            threads,
            heartbeat,
            reconnects,
        } = parts;
        let catalog =
            LiveCatalog::new(client.clone(), config.subjects.clone(), config.catalog_wait);
        for tenant in config.profiles.tenants.keys() {
            metrics.zero_tenant(tenant);
        }
        Self {
            client,
            js,
            llms: DashMap::new(),
            store,
            metrics,
            config,
            catalog,
            cancels: DashMap::new(),
            runs: AtomicU64::new(0),
            agent_waits: AgentWaits::default(),
            replies,
            heartbeat,
            reconnects,
            agents,
            tools: std::sync::Mutex::new(None),
            building: std::sync::Mutex::new(()),
            parked_bucket,
            settings_bucket,
            tenant_store: crate::caps::TenantStore::default(),
            threads,
        }
    }

    /// The registry (agents, then the live catalog, then the declared
    /// pools' tools no live worker serves) and relevance index of
    /// the latest catalog reading: built once per catalog generation, then
    /// shared by every invocation until the catalog changes.
    pub fn tool_snapshot(&self) -> Arc<ToolSnapshot> {
        let catalog = self.catalog();
        {
            let cached = self.tools.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(snapshot) = cached.as_ref()
                && snapshot.generation == catalog.generation
            {
                return snapshot.clone();
            }
        }
        // One build at a time, outside the cache's lock: invocations that
        // come meanwhile use the snapshot before (a moment stale: dispatch
        // reads the catalog again on a miss), or wait for the first one.
        let _building = match self.building.try_lock() {
            Ok(guard) => guard,
            Err(std::sync::TryLockError::WouldBlock) => {
                if let Some(stale) = self.tools.lock().unwrap_or_else(|e| e.into_inner()).clone() {
                    return stale;
                }
                blocking(|| self.building.lock().unwrap_or_else(|e| e.into_inner()))
            }
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
        };
        if let Some(snapshot) = self
            .tools
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .filter(|s| s.generation >= catalog.generation)
        {
            return snapshot.clone();
        }
        let started = std::time::Instant::now();
        let snapshot = Arc::new(blocking(|| {
            ToolSnapshot::build(
                (&self.agents, &self.config.declared),
                &catalog,
                self.config.compat.as_deref(),
                &self.config.profiles,
            )
        }));
        self.metrics
            .observe_registry(&snapshot.registry, started.elapsed());
        *self.tools.lock().unwrap_or_else(|e| e.into_inner()) = Some(snapshot.clone());
        snapshot
    }

    /// The tools `job` may use (see [`gating`](crate::tools::gating)), from
    /// the registry snapshot of the latest catalog reading.
    pub fn permitted_tools(
        &self,
        job: &ChatJob,
        profile: &ResolvedProfile,
        ctx: &InvocationContext,
        agent_depth: u32,
    ) -> Result<Scope, Failure> {
        let snapshot = self.tool_snapshot();
        let config = &self.config.profiles;
        // The profiles whose agent tool the job's tenant may not use.
        let agents_denied: Vec<String> = config
            .profiles
            .iter()
            .filter(|(name, p)| p.agent.is_some() && !config.agent_allows(name, job.tenant()))
            .map(|(name, _)| name.clone())
            .collect();
        let gate = gating::Gate {
            documents: !job.attached_documents.is_empty(),
            data_source: ctx.data_source_id.is_some(),
            surface: job.surface(),
            provider_confidence: ctx.provider_confidence.unwrap_or(0.0),
            agents: agent_depth < self.config.profiles.max_agent_depth,
            own_profile: &profile.name,
            tenant: ctx.tenant(),
            agents_denied: &agents_denied,
        };
        let permitted = gating::permitted(&snapshot.registry, &profile.profile, job, &gate)?;
        Ok(Scope::new(snapshot, permitted, profile.profile.scoping))
    }

    /// The configuration this orchestrator runs with.
    pub fn config(&self) -> &Settings {
        &self.config
    }

    /// The orchestrator's metrics.
    pub fn metrics(&self) -> &OrchestratorMetrics {
        &self.metrics
    }

    /// The latest catalog reading.
    pub fn catalog(&self) -> Arc<Catalog> {
        self.catalog.current()
    }

    /// The size limits jobs are held to now (the server's `max_payload`
    /// is read each time: a reconnect may reach another server).
    pub fn limits(&self) -> PayloadLimits {
        PayloadLimits::of(&self.client)
    }

    /// The client of a resolved profile's deployment, built once.
    pub(crate) fn llm_for(&self, resolved: &ResolvedProfile) -> Result<LlmClient, Failure> {
        if let Some(c) = self.llms.get(&resolved.deployment_name) {
            return Ok(c.clone());
        }
        let mut config = resolved.llm_config();
        config.gate = resolved
            .deployment
            .limits(&resolved.deployment_name)
            .map(|limits| crate::provider_gate::gate(&self.store, limits));
        let client = LlmClient::new(config).map_err(|e| {
            Failure::new(
                ChatErrorCode::BadDeployment,
                format!("deployment {:?}: {e}", resolved.deployment_name),
            )
        })?;
        self.llms
            .insert(resolved.deployment_name.clone(), client.clone());
        Ok(client)
    }

    /// Registers a run of `invocation_id`; its token is cancelled by
    /// [`cancel`](Self::cancel) until [`forget_run`](Self::forget_run).
    pub(crate) fn register_run(
        &self,
        invocation_id: &str,
        tenant: &str,
    ) -> (u64, CancellationToken) {
        let token = CancellationToken::new();
        let run = self.runs.fetch_add(1, Ordering::Relaxed);
        self.cancels.insert(
            (tenant.to_string(), invocation_id.to_string()),
            (run, token.clone()),
        );
        (run, token)
    }

    pub(crate) fn forget_run(&self, invocation_id: &str, tenant: &str, run: u64) {
        self.cancels.remove_if(
            &(tenant.to_string(), invocation_id.to_string()),
            |_, (r, _)| *r == run,
        );
    }

    /// Cancels the run of `invocation_id` of `tenant` in this process, if
    /// any (the same id under another tenant is another invocation: a
    /// cancel sent under one stops nothing of the other).
    pub(crate) fn cancel(&self, invocation_id: &str, tenant: &str) {
        if let Some(entry) = self
            .cancels
            .get(&(tenant.to_string(), invocation_id.to_string()))
        {
            info!(invocation_id, tenant, "cancel requested");
            entry.1.cancel();
        }
    }
}
