//! Intake, the first stage: a chat job from the stream to its ack.
//!
//! [`handle_holding`] takes one delivery through its steps: decode (size against
//! the smaller of the contract's and the server's limit, then schema), the
//! claim ([`claim`]), the typed checks ([`reject::check`]), the tenant's
//! suspension for poison ([`suspend`]) and its queued-jobs cap where the
//! stream cannot hold it ([`queued`]) — any refusal goes down one path,
//! [`reject::reject`]: an `error` event when the
//! message may speak for the invocation, a dead letter, `term` —, the
//! trace, then the run ([`run`]): the frame ([`frame`]) under the
//! invocation's deadline (counted from the stream's publish time, since the
//! client's clock starts at submission), its cancel token and its lease,
//! with in-progress acks so a long invocation is not redelivered to
//! another orchestrator. Whatever happens, the invocation ends in exactly
//! one terminal event, and the job is acked only after it is published.
//!
//! Decisions on parked invocations come in the same way
//! ([`decisions`]): the one that decides a turn's last held call resumes
//! the invocation as a run. Chat jobs are taken from the tenants in
//! weighted turns ([`fair`], [`turns`]) off per-tenant durable consumers
//! every orchestrator shares; those, the decisions consumer, the move
//! from the shared consumer of earlier releases ([`migrate`]) and the
//! listener that cancels invocations ([`cancels`]) live here too. [`Plugins`] is what the frame runs that a deployment
//! registers.

mod cancels;
mod claim;
mod decisions;
mod delay;
mod fair;
mod frame;
mod idempotency;
mod lanes;
mod migrate;
mod queued;
mod reject;
mod run;
mod suspend;
mod turns;

use std::collections::BTreeMap;
use std::ops::ControlFlow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind, consumer::pull};
use toolfleet_config::DEFAULT_ORCHESTRATOR;
use toolfleet_protocol::{ChatJob, Envelope, Priority, Subjects};

use crate::settings::ChatDispatch;
use toolfleet_service::telemetry;
use toolfleet_store::InvocationKey;
use tracing::{Instrument, warn};

use crate::context::ContextHandlers;
use crate::failure::ChatErrorCode;
use crate::tools::agents::depth_of;
use crate::{Agentic, Failure, Fleet, Invocation, Orchestrator, OrchestratorError};
use claim::{Claimed, Delivery, claim_patiently, give_back, new_holder, owner};
use reject::{Refusal, Refused};
use run::{Leg, Taken};

pub use cancels::CANCEL_OUTCOMES;
pub(crate) use cancels::listen_for_cancels;
pub(crate) use decisions::handle_decision;
pub use delay::DEFAULT_MAX_NOT_BEFORE;
pub(crate) use fair::{Dispatcher, Intake};
pub(crate) use reject::poison;

/// Ack wait of the chat and decisions consumers: how long the jobs of an
/// orchestrator that died (crash, SIGKILL, lost host) wait before another
/// takes them. Short, because running jobs prove they are alive with
/// in-progress acks (a heartbeat, as Temporal's activity heartbeat
/// timeout) at a third of it.
pub(crate) const CHAT_ACK_WAIT: Duration = Duration::from_secs(10);
/// How often a held job's in-progress ack is sent.
pub(crate) const CHAT_PROGRESS_EVERY: Duration = Duration::from_secs(3);

/// Deliveries of one chat job that are run (an orchestrator that dies
/// mid-way gets the job redelivered); the next one ends it with an error
/// event and a dead letter.
pub const MAX_CHAT_ATTEMPTS: u32 = 3;

/// What a deployment registers and the frame runs: orchestrators by the
/// name a profile gives ([`Agentic`] as `agentic` by default), and the
/// context stage's handlers.
#[derive(Clone)]
pub struct Plugins {
    orchestrators: BTreeMap<String, Arc<dyn Orchestrator>>,
    pub(crate) context: ContextHandlers,
}

impl Default for Plugins {
    fn default() -> Self {
        let mut plugins = Self {
            orchestrators: BTreeMap::new(),
            context: ContextHandlers::default(),
        };
        plugins.register_orchestrator(DEFAULT_ORCHESTRATOR, Agentic);
        plugins
    }
}

impl Plugins {
    /// Registers `orchestrator` under `name` (replacing one of that name).
    pub(crate) fn register_orchestrator(
        &mut self,
        name: impl Into<String>,
        orchestrator: impl Orchestrator,
    ) {
        self.orchestrators
            .insert(name.into(), Arc::new(orchestrator));
    }

    /// The registered orchestrator names, sorted.
    pub fn names(&self) -> Vec<&str> {
        self.orchestrators.keys().map(String::as_str).collect()
    }

    /// The orchestrator registered under `name`.
    pub fn orchestrator(&self, name: &str) -> Option<Arc<dyn Orchestrator>> {
        self.orchestrators.get(name).cloned()
    }

    /// The orchestrator the invocation's profile names.
    pub(crate) fn orchestrator_of(
        &self,
        inv: &Invocation,
    ) -> Result<Arc<dyn Orchestrator>, Failure> {
        self.orchestrator(&inv.profile.orchestrator).ok_or_else(|| {
            Failure::new(
                ChatErrorCode::InternalError,
                format!(
                    "no orchestrator is registered as {:?}",
                    inv.profile.orchestrator
                ),
            )
        })
    }
}

/// The largest chat job body taken from `tenant`'s subject: the fleet's
/// limit, or the tenant's own cap (`max_job_bytes`) when it is the
/// smaller. A bigger job is refused as any oversized one (`too_large`).
fn job_limit(fleet: &Fleet, tenant: Option<&str>) -> usize {
    match tenant {
        Some(tenant) => {
            (fleet.limits().job_body()).min(fleet.config.profiles.caps_of(tenant).max_job_bytes)
        }
        None => fleet.limits().job_body(),
    }
}

/// Handles one delivery of a chat job (see the module docs), the job
/// holding `place` (its dispatcher's in-flight permit) until its run ends
/// — given back while it waits for its thread or an idempotency key's
/// first job.
pub(crate) async fn handle_holding(
    fleet: &Arc<Fleet>,
    plugins: &Plugins,
    msg: jetstream::Message,
    place: Option<tokio::sync::OwnedSemaphorePermit>,
) {
    // Boxed: the steps before the run are brief, and their futures (the
    // claim, every refusal) are large; inline, the job's task would carry
    // their space for as long as the run waits on its model.
    let Some((taken, mut leg, span)) = Box::pin(admit(fleet, msg)).await else {
        return;
    };
    if let Leg::Fresh { place: held, .. } = &mut leg {
        *held = place;
    }
    run::run(fleet, plugins, taken, leg).instrument(span).await
}

/// Decodes, claims and checks one delivery; what its run needs, or `None`
/// when the delivery was settled here (refused, answered, given back).
async fn admit(fleet: &Arc<Fleet>, msg: jetstream::Message) -> Option<(Taken, Leg, tracing::Span)> {
    let started = Instant::now();
    let delivery = Delivery::of(&msg);
    // This delivery's run, should it get the invocation's lease.
    let holder = new_holder();
    // The tenant is the submit subject's: whoever may publish there may act
    // as that tenant, and nobody else. A job the stream kept from before
    // subjects named a tenant runs as the one it names.
    let (subject_tenant, lane) = match fleet.config.subjects.lane_tenant(msg.subject.as_str()) {
        Some((tenant, lane)) => (Some(tenant.to_string()), lane),
        None => (None, Priority::Interactive),
    };
    let limit = job_limit(fleet, subject_tenant.as_deref());
    let mut job: ChatJob = match Envelope::ChatJob.decode_within(&msg.payload, limit) {
        Ok(job) => job,
        Err(e) => {
            reject::malformed(fleet, &msg, delivery, subject_tenant, e).await;
            return None;
        }
    };
    // Only a tenant of the subject (an identity) can be suspended.
    let guarded = subject_tenant.is_some();
    let tenant = subject_tenant.unwrap_or_else(|| job.tenant().to_string());
    // A batch job on the interactive lane waits its turn on the batch one.
    let priority = lanes::priority_of(fleet, &job, &tenant, lane);
    if priority != lane && guarded && lanes::moved_to_batch(fleet, &msg, &tenant).await {
        return None;
    }
    job.priority = Some(priority);
    let leased = match claimed(fleet, &msg, &job, &tenant, delivery, &holder).await {
        ControlFlow::Continue(at) => at,
        ControlFlow::Break(None) => return None,
        ControlFlow::Break(Some(refusal)) => {
            let refused = Refused {
                invocation_id: Some(job.invocation_id),
                tenant,
                tell_sender: false,
                refusal,
            };
            reject::reject(fleet, &msg, delivery, refused).await;
            return None;
        }
    };
    if let Some(refusal) = refused_after_claim(fleet, &msg, &job, &tenant, guarded, delivery).await
    {
        // An idempotency key its earlier deliveries claimed goes back.
        if let Some(key) = &job.idempotency_key {
            idempotency::release(fleet, (&tenant, key, &job.invocation_id)).await;
        }
        let refused = Refused {
            invocation_id: Some(job.invocation_id),
            tenant,
            tell_sender: true,
            refusal,
        };
        reject::reject(fleet, &msg, delivery, refused).await;
        return None;
    }
    // A job that asks to start later waits for its time (delay.rs).
    if delay::held_back(fleet, &msg, &job, &tenant, &holder, delivery).await {
        return None;
    }
    job.tenant = Some(tenant.clone());
    let span = trace(&msg, &mut job, &tenant, delivery);
    let leg = Leg::Fresh {
        agent_depth: depth_of(msg.headers.as_ref()),
        inherited_approval: crate::agents::inherited_approval(msg.headers.as_ref()),
        job: Box::new(job),
        place: None,
    };
    let taken = Taken {
        msg,
        delivery,
        holder,
        started,
        leased,
    };
    Some((taken, leg, span))
}

/// What refuses a claimed job, told to its sender: a tenant it claims
/// that is not the subject's, its tenant's suspension (`guarded`: only a
/// subject's tenant, an identity, can be suspended), or, on a first
/// delivery, its tenant's cap of queued jobs.
async fn refused_after_claim(
    fleet: &Arc<Fleet>,
    msg: &jetstream::Message,
    job: &ChatJob,
    tenant: &str,
    guarded: bool,
    delivery: Delivery,
) -> Option<Refusal> {
    let suspended = if guarded {
        suspend::suspended_for(fleet, tenant).await
    } else {
        None
    };
    let checked = reject::check(fleet, job.tenant.as_deref(), tenant, delivery).and_then(|()| {
        suspended.map_or(Ok(()), |left| {
            fleet
                .metrics
                .chat_suspended
                .with_label_values(&[tenant])
                .inc();
            Err(Refusal::Suspended {
                tenant: tenant.to_string(),
                left,
            })
        })
    });
    if let Err(refusal) = checked {
        return Some(refusal);
    }
    if delivery.attempt == 1 {
        return queued::over_cap(fleet, tenant, &msg.subject, delivery.stream_sequence).await;
    }
    None
}

/// Claims the job's invocation and settles what the claim says: go on
/// (`Continue`), done here (`Break(None)`: answered from a finished or
/// parked run, or given back), or refused (`Break(Some)`: another job's).
///
/// Claimed before anything else: a finished run's redelivery is answered
/// whatever its delivery count. The claim is retried with in-progress
/// acks rather than by redelivery (which would spend the job's deliveries
/// while Redis is away, or while the run that holds the lease — alive, but
/// cut off from NATS — still runs). A live run elsewhere is waited for as
/// long as it renews its lease, up to the invocation's deadline (that run
/// ends by then) — giving the job back sooner would spend its deliveries,
/// and after the last one nobody would answer it.
async fn claimed(
    fleet: &Fleet,
    msg: &jetstream::Message,
    job: &ChatJob,
    tenant: &str,
    delivery: Delivery,
    holder: &str,
) -> ControlFlow<Option<Refusal>, claim::Leased> {
    let id = &job.invocation_id;
    // The tenant's own id: another tenant's invocation of the same id is
    // claimed apart, and this one never learns of it.
    let inv = InvocationKey::new(tenant, id);
    let (deadline, _) =
        run::invocation_deadline(fleet, job, delivery, toolfleet_protocol::now_ms());
    let held_until = deadline + claim::LEASE_TTL.as_millis() as u64;
    match claim_patiently(fleet, msg, inv, &owner(delivery), holder, held_until).await {
        // Parked by an earlier delivery of this job, whose ack was lost
        // (or that died before it): the invocation lives in its record
        // now. Its requests are said again; nothing reruns.
        Claimed::Ours(leased) if delivery.attempt > 1 => match fleet.parked(tenant, id).await {
            Ok(Some((parked, _))) if parked.owner == owner(delivery) => {
                parked.announce_again(fleet).await;
                let _ = fleet.store.release_lease(inv, holder).await;
                claim::ack(msg).await;
                ControlFlow::Break(None)
            }
            Ok(_) => ControlFlow::Continue(leased),
            Err(e) => {
                warn!(invocation_id = %id, error = %e, "cannot tell whether the invocation is parked; the job will be delivered again");
                let _ = fleet.store.release_lease(inv, holder).await;
                let _ = msg
                    .ack_with(AckKind::Nak(Some(claim::CLAIM_RETRY_DELAY)))
                    .await;
                ControlFlow::Break(None)
            }
        },
        Claimed::Ours(leased) => ControlFlow::Continue(leased),
        Claimed::Finished => {
            claim::answer_finished(fleet, msg, inv).await;
            ControlFlow::Break(None)
        }
        Claimed::Other(owner) => ControlFlow::Break(Some(Refusal::Duplicate {
            id: id.clone(),
            owner,
        })),
        unclaimed @ (Claimed::Unknown(_) | Claimed::Held(_)) => {
            give_back(msg, id, unclaimed).await;
            ControlFlow::Break(None)
        }
    }
}

/// The run's span: the trace goes on from the submitter's `traceparent`
/// (its header, else the job's field), or starts here; the job carries
/// the run's own from then on.
fn trace(
    msg: &jetstream::Message,
    job: &mut ChatJob,
    tenant: &str,
    delivery: Delivery,
) -> tracing::Span {
    let incoming = msg
        .headers
        .as_ref()
        .and_then(|h| h.get(toolfleet_protocol::headers::TRACEPARENT))
        .map(|v| v.as_str().to_string())
        .filter(|tp| telemetry::is_traceparent(tp))
        .or_else(|| job.traceparent.take());
    let span = run::chat_job_span(&job.invocation_id, tenant, delivery.attempt);
    job.traceparent = Some(telemetry::continue_trace(&span, incoming.as_deref()));
    span
}

/// Opens the streams and brings the chat stream to fair dispatch: the
/// shared chat consumer of an earlier release is removed (a work queue
/// allows per-tenant consumers only when no consumer overlaps them), and
/// jobs it left on the untenanted submit subject are queued again under
/// their tenant's. Returns the chat stream.
pub(crate) async fn chat_stream(
    js: &jetstream::Context,
    subjects: &Subjects,
    limits: toolfleet_protocol::streams::ChatLimits,
    dispatch: ChatDispatch,
) -> Result<jetstream::stream::Stream, OrchestratorError> {
    let nats = |e: toolfleet_protocol::streams::StreamError| {
        OrchestratorError::Nats(e.detail().to_string())
    };
    let stream = toolfleet_protocol::streams::ensure_chat_stream_with(js, subjects, limits)
        .await
        .map_err(nats)?;
    toolfleet_protocol::streams::ensure_tools_stream(js, subjects)
        .await
        .map_err(nats)?;
    toolfleet_protocol::streams::ensure_events_stream(js, subjects)
        .await
        .map_err(nats)?;
    toolfleet_protocol::streams::ensure_history_stream(js, subjects)
        .await
        .map_err(nats)?;
    toolfleet_protocol::streams::ensure_dead_letters_stream(js, subjects)
        .await
        .map_err(nats)?;
    match dispatch {
        ChatDispatch::Fair => {
            migrate::drop_shared_consumer(&stream, subjects).await?;
            migrate::requeue_untenanted(js, &stream, subjects).await;
        }
        ChatDispatch::Fifo => migrate::refuse_tenant_consumers(&stream, subjects).await?,
    }
    Ok(stream)
}

/// The one chat consumer of FIFO dispatch (`--chat-dispatch fifo`):
/// unfiltered, every tenant's jobs in arrival order.
pub(crate) async fn fifo_consumer(
    stream: &jetstream::stream::Stream,
    subjects: &Subjects,
) -> Result<jetstream::consumer::PullConsumer, OrchestratorError> {
    let name = subjects.chat_consumer();
    let config = chat_consumer_config(&name, String::new());
    stream
        .get_or_create_consumer(&name, config)
        .await
        .map_err(|e| OrchestratorError::Nats(format!("chat consumer {name}: {e}")))
}

/// A chat consumer's settings (a tenant's lane, or FIFO's unfiltered
/// one when `filter_subject` is empty).
fn chat_consumer_config(name: &str, filter_subject: String) -> pull::Config {
    pull::Config {
        durable_name: Some(name.to_owned()),
        filter_subject,
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: CHAT_ACK_WAIT,
        // One more than we run, so the delivery after the last attempt can
        // still end the invocation visibly.
        max_deliver: i64::from(MAX_CHAT_ATTEMPTS) + 1,
        max_ack_pending: 10_000,
        ..Default::default()
    }
}

/// How long a tenant's chat consumer outlives its last pull.
pub(crate) const TENANT_CONSUMER_INACTIVE: Duration = Duration::from_secs(7 * 24 * 3600);

/// The durable chat consumer of `tenant`'s `priority` lane every
/// orchestrator shares (`chat-<tenant>` filtered on the tenant's submit
/// subject, `batch-<tenant>` on its batch subject), made if it does not
/// exist.
pub(crate) async fn tenant_consumer(
    stream: &jetstream::stream::Stream,
    subjects: &Subjects,
    tenant: &str,
    priority: Priority,
) -> Result<jetstream::consumer::PullConsumer, OrchestratorError> {
    let name = subjects.chat_lane_consumer(tenant, priority);
    let config = pull::Config {
        // A tenant gone for a week leaves no consumer behind (its jobs,
        // if any came after all, are taken by one made again).
        inactive_threshold: TENANT_CONSUMER_INACTIVE,
        ..chat_consumer_config(&name, subjects.chat_lane(tenant, priority))
    };
    stream
        .get_or_create_consumer(&name, config)
        .await
        .map_err(|e| OrchestratorError::Nats(format!("chat consumer {name}: {e}")))
}

/// The durable consumer of the decisions stream every orchestrator
/// shares.
pub(crate) async fn decisions_consumer(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<jetstream::consumer::PullConsumer, OrchestratorError> {
    let stream = toolfleet_protocol::streams::ensure_decisions_stream(js, subjects)
        .await
        .map_err(|e| OrchestratorError::Nats(e.to_string()))?;
    stream
        .get_or_create_consumer(
            &subjects.chat_consumer(),
            pull::Config {
                durable_name: Some(subjects.chat_consumer()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait: CHAT_ACK_WAIT,
                // A decision is never given up by the server (it would
                // leave its invocation parked for good): the resumed run
                // counts its own attempts.
                max_deliver: -1,
                max_ack_pending: 10_000,
                ..Default::default()
            },
        )
        .await
        .map_err(|e| OrchestratorError::Nats(format!("decisions consumer: {e}")))
}
