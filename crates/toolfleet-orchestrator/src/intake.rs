//! Intake: one chat job from the stream to its ack.
//!
//! A job is decoded (size against the smaller of the contract's and the
//! server's limit, then schema); one that cannot be decoded, or that has
//! been delivered more than [`MAX_CHAT_ATTEMPTS`] times, is ended with an
//! `error` event (when its invocation id can be found) and a dead letter,
//! and terminated. A good job runs under its deadline — counted from the
//! stream's publish time, since the client's clock starts at submission —
//! and its cancel token, with in-progress acks so a long invocation is not
//! redelivered to another orchestrator. Whatever happens, the invocation
//! ends in exactly one terminal event, and the job is acked only after it
//! is published.
//!
//! The durable chat consumer every orchestrator shares (`chat_consumer`:
//! ack wait, deliveries) and the listener that cancels invocations on
//! their cancel subject (`listen_for_cancels`) live here too.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind, consumer::pull};
use futures::{FutureExt, StreamExt};
use tokio_util::sync::CancellationToken;
use toolfleet_protocol::{
    ChatEventBody, ChatJob, DEFAULT_TENANT, DeadLetter, DeadLetterKind, Envelope, Subjects,
    dead_letter_headers, encode, salvage_invocation_id,
};
use toolfleet_service::telemetry;
use toolfleet_store::Lease;
use tracing::{Instrument, info, warn};

use crate::orchestrator::{Finished, invoke};
use crate::{Events, Failure, Fleet, OrchestratorError};

/// Ack wait of the chat consumer: how long the jobs of an orchestrator
/// that died (crash, SIGKILL, lost host) wait before another takes them.
/// Short, because running jobs prove they are alive with in-progress acks
/// (a heartbeat, as Temporal's activity heartbeat timeout) at a third of it.
pub(crate) const CHAT_ACK_WAIT: Duration = Duration::from_secs(10);
pub(crate) const CHAT_PROGRESS_EVERY: Duration = Duration::from_secs(3);
/// How long a run's lease on its invocation lasts unless renewed: shorter
/// than the ack wait, so a crashed orchestrator's lease has lapsed by the
/// time its job is delivered again.
const LEASE_TTL: Duration = Duration::from_secs(8);
/// How often a running invocation renews its lease.
const LEASE_RENEW_EVERY: Duration = Duration::from_secs(2);

/// Deliveries of one chat job that are run (an orchestrator that dies
/// mid-way gets the job redelivered); the next one ends it with an error
/// event and a dead letter.
pub const MAX_CHAT_ATTEMPTS: u32 = 3;

/// Deliveries of the decision that resumes a parked invocation before it
/// is ended with an error (they also count the times the stores did not
/// answer, so more than a chat job's).
const MAX_RESUME_DELIVERIES: u32 = 10;

/// The streams, and the durable chat consumer every orchestrator shares.
pub(crate) async fn chat_consumer(
    js: &jetstream::Context,
    subjects: &Subjects,
) -> Result<jetstream::consumer::Consumer<pull::Config>, OrchestratorError> {
    let stream = toolfleet_protocol::streams::ensure_chat_stream(js, subjects)
        .await
        .map_err(|e| OrchestratorError::Nats(e.to_string()))?;
    toolfleet_protocol::streams::ensure_tools_stream(js, subjects)
        .await
        .map_err(|e| OrchestratorError::Nats(e.to_string()))?;
    toolfleet_protocol::streams::ensure_events_stream(js, subjects)
        .await
        .map_err(|e| OrchestratorError::Nats(e.to_string()))?;
    toolfleet_protocol::streams::ensure_history_stream(js, subjects)
        .await
        .map_err(|e| OrchestratorError::Nats(e.to_string()))?;
    toolfleet_protocol::streams::ensure_dead_letters_stream(js, subjects)
        .await
        .map_err(|e| OrchestratorError::Nats(e.to_string()))?;
    let config = pull::Config {
        durable_name: Some(subjects.chat_consumer()),
        // The stream holds chat jobs only (`<p>.chat.submit.<tenant>`): no
        // filter, so a stream moved from the untenanted subject still
        // delivers the jobs it held.
        ack_policy: jetstream::consumer::AckPolicy::Explicit,
        ack_wait: CHAT_ACK_WAIT,
        // One more than we run, so the delivery after the last
        // attempt can still end the invocation visibly.
        max_deliver: i64::from(MAX_CHAT_ATTEMPTS) + 1,
        max_ack_pending: 10_000,
        ..Default::default()
    };
    let mut consumer: jetstream::consumer::Consumer<pull::Config> = stream
        .get_or_create_consumer(&subjects.chat_consumer(), config.clone())
        .await
        .map_err(|e| OrchestratorError::Nats(format!("chat consumer: {e}")))?;
    // A consumer made by an earlier release keeps its longer ack wait:
    // bring it to this one's (an editable setting).
    let info = consumer
        .info()
        .await
        .map_err(|e| OrchestratorError::Nats(format!("chat consumer: {e}")))?;
    // One made before submit subjects named a tenant filters on the old
    // subject, and the filter of a consumer cannot be edited: make it
    // again (the jobs stay in the work queue meanwhile).
    if !info.config.filter_subject.is_empty() {
        stream
            .delete_consumer(&subjects.chat_consumer())
            .await
            .map_err(|e| OrchestratorError::Nats(format!("chat consumer: {e}")))?;
        consumer = stream
            .get_or_create_consumer(&subjects.chat_consumer(), config.clone())
            .await
            .map_err(|e| OrchestratorError::Nats(format!("chat consumer: {e}")))?;
        info!("chat consumer made again without the old subject filter");
    } else if info.config.ack_wait != CHAT_ACK_WAIT {
        match stream.create_consumer(config).await {
            Ok(updated) => consumer = updated,
            Err(e) => warn!(error = %e, ack_wait = ?info.config.ack_wait,
                "cannot shorten the chat consumer's ack wait; a crashed orchestrator's jobs wait that long"),
        }
    }
    Ok(consumer)
}

/// Cancels the invocations running here whose cancel subject is published,
/// and remembers every cancel (a tombstone in the store, with its TTL) so a
/// job still queued when its cancel came is answered `cancelled` when it
/// starts instead of being run. The tombstone is written before the running
/// invocation is looked up, and a run registers before it checks the
/// tombstone, so a cancel is never missed between the two.
pub(crate) async fn listen_for_cancels(
    fleet: Arc<Fleet>,
    mut cancel_sub: async_nats::Subscriber,
    shutdown: CancellationToken,
) {
    loop {
        let msg = tokio::select! {
            _ = shutdown.cancelled() => break,
            m = cancel_sub.next() => match m { Some(m) => m, None => break },
        };
        let Some((tenant, id)) = fleet.config.subjects.parse_cancel(msg.subject.as_str()) else {
            continue;
        };
        if let Err(e) = fleet.store.mark_cancelled(id, tenant).await {
            warn!(invocation_id = id, error = %e, "cancel not remembered (the store is unavailable); only a running invocation is cancelled");
        }
        fleet.cancel(id, tenant);
        // Parked: no run holds it; a cancel decision ends it.
        crate::approvals::cancel_parked(&fleet, id, tenant).await;
    }
}

/// Whether a cancel for `id` of `tenant` came before its job started. A
/// store that cannot answer does not stop the job (logged).
async fn cancelled_before_start(
    fleet: &Fleet,
    id: &str,
    tenant: &str,
    check: &crate::context::CancelCheck,
) -> bool {
    match fleet.store.is_cancelled(id, tenant).await {
        Ok(true) => true,
        Ok(false) => {
            check.passed();
            false
        }
        Err(e) => {
            warn!(invocation_id = id, error = %e, "cannot read the cancel tombstone; running the job");
            false
        }
    }
}

/// What the stream says about one delivery.
#[derive(Debug, Clone, Copy)]
struct Delivery {
    /// 1 for the first delivery.
    attempt: u32,
    stream_sequence: u64,
    /// When the client published the job (Unix ms), if known.
    published_ms: Option<u64>,
}

impl Delivery {
    fn of(msg: &jetstream::Message) -> Self {
        match msg.info() {
            Ok(i) => Self {
                attempt: u32::try_from(i.delivered).unwrap_or(1),
                stream_sequence: i.stream_sequence,
                published_ms: u64::try_from(i.published.unix_timestamp_nanos() / 1_000_000).ok(),
            },
            Err(_) => Self {
                attempt: 1,
                stream_sequence: 0,
                published_ms: None,
            },
        }
    }
}

/// Why a job is dead-lettered instead of run.
struct Rejection<'a> {
    invocation_id: Option<String>,
    /// The tenant whose events subject hears the `error` event.
    tenant: String,
    /// Whether the sender gets an `error` event: only when this message
    /// holds the invocation's claim (an event on another job's invocation
    /// would be a second terminal event there).
    tell_sender: bool,
    /// The `error` event's code.
    event_code: &'a str,
    /// The dead letter's code.
    code: &'a str,
    error: String,
}

/// Handles one delivery of a chat job.
pub(crate) async fn handle(fleet: &Arc<Fleet>, msg: jetstream::Message) {
    let started = Instant::now();
    let delivery = Delivery::of(&msg);
    // This delivery's run, should it get the invocation's lease.
    let holder = uuid::Uuid::new_v4().simple().to_string();
    let limit = fleet.limits().job_body();
    // The tenant is the submit subject's: whoever may publish there may act
    // as that tenant, and nobody else. A job the stream kept from before
    // subjects named a tenant runs as the one it names.
    let subject_tenant = fleet
        .config
        .subjects
        .submit_tenant(msg.subject.as_str())
        .map(str::to_string);
    let job: ChatJob = match Envelope::ChatJob.decode_within(&msg.payload, limit) {
        Ok(job) => job,
        Err(e) => {
            fleet
                .metrics
                .chat_jobs
                .with_label_values(&["malformed"])
                .inc();
            let invocation_id = salvage_invocation_id(&msg.payload, msg.headers.as_ref());
            warn!(invocation_id = ?invocation_id, error = %e, "malformed chat job");
            let tell_sender = match &invocation_id {
                Some(id) => matches!(claim(fleet, id, delivery, &holder).await, Claimed::Ours),
                None => false,
            };
            let rejection = Rejection {
                invocation_id,
                tenant: subject_tenant.unwrap_or_else(|| DEFAULT_TENANT.to_string()),
                tell_sender,
                event_code: "malformed_job",
                code: e.code(),
                error: e.to_string(),
            };
            return dead_letter(fleet, &msg, delivery, rejection).await;
        }
    };
    let mut job = job;
    let tenant = subject_tenant.unwrap_or_else(|| job.tenant().to_string());
    // Claimed before anything else: a finished run's redelivery is
    // answered whatever its delivery count. The claim is retried here,
    // with in-progress acks, rather than by redelivery (which would spend
    // the job's deliveries while Redis is away, or while the run that
    // holds the lease — alive, but cut off from NATS — still runs).
    // A live run elsewhere is waited for as long as it renews its lease,
    // up to the invocation's deadline (that run ends by then) — giving the
    // job back sooner would spend its deliveries, and after the last one
    // nobody would answer it.
    let (deadline, _) = invocation_deadline(fleet, &job, delivery, toolfleet_protocol::now_ms());
    let claimed = claim_patiently(
        fleet,
        &msg,
        &job.invocation_id,
        &owner(delivery),
        &holder,
        deadline + LEASE_TTL.as_millis() as u64,
    )
    .await;
    match claimed {
        // Parked by an earlier delivery of this job, whose ack was lost
        // (or that died before it): the invocation lives in its record
        // now. Its requests are said again; nothing reruns.
        Claimed::Ours if delivery.attempt > 1 => match fleet.parked(&job.invocation_id).await {
            Ok(Some((parked, _))) if parked.owner == owner(delivery) => {
                parked.announce_again(fleet).await;
                let _ = fleet.store.release_lease(&job.invocation_id, &holder).await;
                ack(&msg).await;
                return;
            }
            Ok(_) => {}
            Err(e) => {
                warn!(invocation_id = %job.invocation_id, error = %e, "cannot tell whether the invocation is parked; the job will be delivered again");
                let _ = fleet.store.release_lease(&job.invocation_id, &holder).await;
                let _ = msg.ack_with(AckKind::Nak(Some(CLAIM_RETRY_DELAY))).await;
                return;
            }
        },
        Claimed::Ours => {}
        Claimed::Finished => {
            // Ended before; the ack was lost (an orchestrator or NATS node
            // died in between), and the terminal event may have been lost
            // with it: publish it again, verbatim, ack, run nothing.
            match fleet.store.terminal_event(&job.invocation_id).await {
                Ok(Some(event)) => {
                    let subject = fleet
                        .config
                        .subjects
                        .chat_events(&tenant, &job.invocation_id);
                    let _ = fleet.client.publish(subject, event.into()).await;
                }
                Ok(None) => {}
                Err(e) => {
                    warn!(invocation_id = %job.invocation_id, error = %e, "cannot read the finished run's terminal event");
                }
            }
            ack(&msg).await;
            return;
        }
        Claimed::Other(owner) => {
            fleet
                .metrics
                .chat_jobs
                .with_label_values(&["duplicate"])
                .inc();
            let error = format!(
                "invocation {} already belongs to another chat job ({owner}); this one is not run",
                job.invocation_id
            );
            warn!(invocation_id = %job.invocation_id, "{error}");
            let rejection = Rejection {
                invocation_id: Some(job.invocation_id),
                tenant,
                tell_sender: false,
                event_code: "duplicate_invocation",
                code: "duplicate_invocation",
                error,
            };
            return dead_letter(fleet, &msg, delivery, rejection).await;
        }
        unclaimed @ (Claimed::Unknown(_) | Claimed::Held(_)) => {
            return give_back(&msg, &job.invocation_id, unclaimed).await;
        }
    }
    if job.tenant.as_deref().is_some_and(|named| named != tenant) {
        fleet
            .metrics
            .chat_jobs
            .with_label_values(&["malformed"])
            .inc();
        let error = format!(
            "the job names tenant {:?} but was submitted as tenant {tenant:?} (its submit subject); \
             submit it to {} under a new invocation id (this one is spent)",
            job.tenant(),
            fleet.config.subjects.chat_submit(job.tenant())
        );
        warn!(invocation_id = %job.invocation_id, "{error}");
        let rejection = Rejection {
            invocation_id: Some(job.invocation_id),
            tenant,
            tell_sender: true,
            event_code: "tenant_mismatch",
            code: "tenant_mismatch",
            error,
        };
        return dead_letter(fleet, &msg, delivery, rejection).await;
    }
    job.tenant = Some(tenant.clone());
    if delivery.attempt > MAX_CHAT_ATTEMPTS {
        fleet.metrics.chat_jobs.with_label_values(&["error"]).inc();
        let error = format!(
            "the job was delivered {} times without finishing (an orchestrator stopped while running it each time)",
            delivery.attempt
        );
        warn!(invocation_id = %job.invocation_id, "{error}");
        let rejection = Rejection {
            invocation_id: Some(job.invocation_id),
            tenant,
            tell_sender: true,
            event_code: "too_many_attempts",
            code: "too_many_attempts",
            error,
        };
        return dead_letter(fleet, &msg, delivery, rejection).await;
    }
    // The trace goes on from the submitter's `traceparent` (its header,
    // else the job's field), or starts here.
    let incoming = msg
        .headers
        .as_ref()
        .and_then(|h| h.get(toolfleet_protocol::headers::TRACEPARENT))
        .map(|v| v.as_str().to_string())
        .filter(|tp| telemetry::is_traceparent(tp))
        .or_else(|| job.traceparent.take());
    let span = chat_job_span(&job.invocation_id, &tenant, delivery.attempt);
    telemetry::set_parent(&span, incoming.as_deref());
    let traceparent = telemetry::traceparent(&span, incoming.as_deref())
        .unwrap_or_else(telemetry::new_traceparent);
    if let Some(id) = telemetry::trace_id(&traceparent) {
        span.record("trace_id", id);
    }
    job.traceparent = Some(traceparent);
    let leg = Leg::Fresh {
        agent_depth: crate::agents::depth_of(msg.headers.as_ref()),
    };
    run(fleet, msg, job, leg, delivery, holder, started)
        .instrument(span)
        .await
}

/// The span of one run of an invocation (a chat job's, or a resumed
/// parked one's: `resumed` is then recorded).
fn chat_job_span(id: &str, tenant: &str, attempt: u32) -> tracing::Span {
    tracing::info_span!(
        "chat_job",
        otel.name = "invoke_agent toolfleet",
        otel.kind = "consumer",
        otel.status_code = tracing::field::Empty,
        gen_ai.operation.name = "invoke_agent",
        gen_ai.agent.name = "toolfleet",
        gen_ai.conversation.id = %id,
        invocation_id = %id,
        tenant = %tenant,
        attempt,
        resumed = tracing::field::Empty,
        trace_id = tracing::field::Empty,
        error.type = tracing::field::Empty,
    )
}

/// Claims invocation `id` for `owner` and `holder`, keeping `msg` alive
/// meanwhile: a store that cannot answer is tried again for
/// [`CLAIM_PATIENCE`], a live run elsewhere until `held_until` (Unix ms).
/// Retried here rather than by redelivery, which would spend the
/// message's deliveries while Redis is away, or while the run that holds
/// the lease — alive, but cut off from NATS — still runs.
async fn claim_patiently(
    fleet: &Fleet,
    msg: &jetstream::Message,
    id: &str,
    owner: &str,
    holder: &str,
    held_until: u64,
) -> Claimed {
    let _alive = fleet.heartbeat.hold(msg);
    let mut claimed = claim_as(fleet, id, owner, holder).await;
    let until = Instant::now() + CLAIM_PATIENCE;
    while match claimed {
        Claimed::Unknown(_) => Instant::now() < until,
        Claimed::Held(_) => toolfleet_protocol::now_ms() < held_until,
        _ => false,
    } {
        tokio::time::sleep(Duration::from_secs(1)).await;
        claimed = claim_as(fleet, id, owner, holder).await;
    }
    claimed
}

/// Gives `msg` back to be delivered again when its invocation could not be
/// claimed. A store that cannot answer: not run unclaimed (a duplicate
/// could run twice), not lost — it comes back when the store may answer.
/// A run alive elsewhere past its patience (renewing its lease, its acks
/// not reaching NATS): not a second run — it comes back, and is answered
/// from the finished run or run once the lease lapses.
async fn give_back(msg: &jetstream::Message, id: &str, claimed: Claimed) {
    let delay = match claimed {
        Claimed::Unknown(e) => {
            warn!(invocation_id = %id, error = %e, "cannot claim the invocation (the store is unavailable); its message will be delivered again");
            CLAIM_RETRY_DELAY
        }
        Claimed::Held(left) => {
            warn!(invocation_id = %id, lease_left = ?left, "another orchestrator's run of this invocation is still alive; its message will be delivered again");
            left.max(CLAIM_RETRY_DELAY)
        }
        _ => return,
    };
    let _ = msg.ack_with(AckKind::Nak(Some(delay))).await;
}

/// Where a run of an invocation starts.
enum Leg {
    /// From the chat job (its first delivery, or a redelivery).
    Fresh { agent_depth: u32 },
    /// From its parked record, every held call decided.
    Resume(Box<crate::approvals::Parked>),
}

/// Resumes a parked invocation whose held calls are all decided, holding
/// the decision message `msg` that decided the last one as a run holds
/// its chat job: claimed under the chat job's claim, leased, kept alive
/// with in-progress acks, acked after its terminal event (or its next
/// park).
pub(crate) async fn resume(
    fleet: &Arc<Fleet>,
    msg: jetstream::Message,
    parked: crate::approvals::Parked,
) {
    let started = Instant::now();
    let delivery = Delivery::of(&msg);
    let holder = uuid::Uuid::new_v4().simple().to_string();
    let id = parked.job.invocation_id.clone();
    let claimed = claim_patiently(
        fleet,
        &msg,
        &id,
        &parked.owner,
        &holder,
        toolfleet_protocol::now_ms() + parked.remaining_ms + LEASE_TTL.as_millis() as u64,
    )
    .await;
    match claimed {
        Claimed::Ours => {
            // Read again under the lease: another decision's run may have
            // resumed (and parked again, or ended) while this one waited.
            let current = fleet.parked(&id).await;
            let same =
                matches!(&current, Ok(Some((p, _))) if p.park_id == parked.park_id && p.decided());
            if !same {
                let _ = fleet.store.release_lease(&id, &holder).await;
                if current.is_err() {
                    let _ = msg.ack_with(AckKind::Nak(Some(CLAIM_RETRY_DELAY))).await;
                } else {
                    ack(&msg).await;
                }
                return;
            }
        }
        Claimed::Finished | Claimed::Other(_) => {
            // Ended before (this decision's ack was lost), or the id was
            // taken by another job: nothing to resume.
            fleet.forget_parked(&id).await;
            ack(&msg).await;
            return;
        }
        unclaimed @ (Claimed::Unknown(_) | Claimed::Held(_)) => {
            return give_back(&msg, &id, unclaimed).await;
        }
    }
    let span = chat_job_span(&id, &parked.tenant, delivery.attempt);
    span.record("resumed", true);
    let traceparent = parked.job.traceparent.clone();
    telemetry::set_parent(&span, traceparent.as_deref());
    if let Some(tid) = traceparent.as_deref().and_then(telemetry::trace_id) {
        span.record("trace_id", tid);
    }
    let job = parked.job.clone();
    if delivery.attempt > MAX_RESUME_DELIVERIES {
        // Delivered that often without finishing: end it rather than try
        // forever.
        let events = Events::start_at(
            fleet.client.clone(),
            &fleet.config.subjects,
            &parked.tenant,
            &id,
            parked.next_seq,
        );
        events.finish(ChatEventBody::Error {
            code: "too_many_attempts".into(),
            message: format!(
                "the decision that resumes the invocation was delivered {} times without the invocation finishing (orchestrators stopped while running it, or the stores did not answer)",
                delivery.attempt
            ),
        });
        if let Some(terminal) = events.close().await
            && let Err(e) = fleet.store.finish(&id, &parked.owner, &terminal).await
        {
            warn!(invocation_id = %id, error = %e, "cannot mark the invocation finished");
        }
        fleet.forget_parked(&id).await;
        fleet.metrics.chat_jobs.with_label_values(&["error"]).inc();
        let _ = msg.ack_with(AckKind::Term).await;
        return;
    }
    run(
        fleet,
        msg,
        job,
        Leg::Resume(Box::new(parked)),
        delivery,
        holder,
        started,
    )
    .instrument(span)
    .await
}

/// Why [`keep_lease`] stopped a run.
enum LeaseEnd {
    /// Another run holds the lease: this one stops without a word.
    TakenOver,
    /// The invocation's cancel tombstone is there: a cancel this
    /// orchestrator did not hear (it was disconnected when it was
    /// published; another orchestrator remembered it).
    Cancelled,
}

/// Renews the run's lease for as long as it is polled (beside the run);
/// returns when another run holds it, or when the invocation's tenant
/// cancelled it (read in the same round trip). A store that cannot answer
/// does not stop the run: if only this orchestrator lost Redis, the lease
/// lapses after its TTL and a redelivery may take it over — the check
/// before the terminal event then stops this run from speaking.
async fn keep_lease(
    fleet: &Fleet,
    id: &str,
    tenant: &str,
    holder: &str,
    check: &crate::context::CancelCheck,
) -> LeaseEnd {
    loop {
        tokio::time::sleep(LEASE_RENEW_EVERY).await;
        // Boxed: this future lives beside the whole run, and the store
        // call (a few hundred bytes of state) is only briefly alive.
        match Box::pin(fleet.store.renew_lease(id, holder, tenant, LEASE_TTL)).await {
            Ok((Lease::Held, false)) => check.passed(),
            Ok((Lease::Held, true)) => {
                warn!(invocation_id = %id, "the invocation was cancelled (its tombstone is in the store; this orchestrator missed the cancel message); it stops");
                return LeaseEnd::Cancelled;
            }
            Ok((Lease::Busy { .. }, _)) => {
                warn!(invocation_id = %id, "this run's lease on the invocation was taken over (it could not renew in time); it stops");
                return LeaseEnd::TakenOver;
            }
            Err(e) => {
                warn!(invocation_id = %id, error = %e, "cannot renew the run's lease; running on");
            }
        }
    }
}

/// How long a job waits before it is delivered again when its invocation
/// cannot be claimed (the store did not answer within its retry budget).
const CLAIM_RETRY_DELAY: Duration = Duration::from_secs(5);

/// How long a delivery keeps trying to claim its invocation (sending
/// in-progress acks) before it gives the job back.
const CLAIM_PATIENCE: Duration = Duration::from_secs(30);

/// Whether a delivery may speak for its invocation.
enum Claimed {
    /// This message claimed the invocation (now or on an earlier delivery).
    Ours,
    /// This message's run already ended; only its ack was lost.
    Finished,
    /// Another message holds it: named by its stream sequence.
    Other(String),
    /// This message holds it, but another delivery's run is still alive
    /// (its lease has this long left).
    Held(Duration),
    /// The store could not say.
    Unknown(String),
}

/// Claims the invocation for this message (its stream sequence), so that
/// one invocation id runs once however often it is submitted: a second
/// message with the same id — a resubmission under a new `Nats-Msg-Id`,
/// a forgery — is refused, while a redelivery of the claiming message
/// (an orchestrator died) continues.
///
/// A delivery that may run then takes the run lease for `holder`: a
/// redelivery while the earlier run is alive (renewing its lease, its acks
/// cut off) is [`Claimed::Held`], not a second run.
async fn claim(fleet: &Fleet, invocation_id: &str, delivery: Delivery, holder: &str) -> Claimed {
    claim_as(fleet, invocation_id, &owner(delivery), holder).await
}

/// [`claim`] under the claim owner `owner`.
async fn claim_as(fleet: &Fleet, invocation_id: &str, owner: &str, holder: &str) -> Claimed {
    match fleet.store.claim(invocation_id, owner).await {
        Ok(toolfleet_store::Claim::New | toolfleet_store::Claim::Again) => {
            match fleet.store.lease(invocation_id, holder, LEASE_TTL).await {
                Ok(Lease::Held) => Claimed::Ours,
                Ok(Lease::Busy { left, .. }) => Claimed::Held(left),
                Err(e) => Claimed::Unknown(e.to_string()),
            }
        }
        Ok(toolfleet_store::Claim::Finished) => Claimed::Finished,
        Ok(toolfleet_store::Claim::Other(owner)) => Claimed::Other(owner),
        Err(e) => Claimed::Unknown(e.to_string()),
    }
}

/// The claim owner of a delivery: its message's stream sequence.
fn owner(delivery: Delivery) -> String {
    format!("chat-seq-{}", delivery.stream_sequence)
}

/// How often a confirmed ack is tried.
const ACK_TRIES: u32 = 5;

/// Acks a finished job and waits for the server to confirm it, trying again
/// across a reconnection (a NATS node that died with the first ack). A
/// job whose ack never lands is delivered again and answered from its
/// finished claim.
async fn ack(msg: &jetstream::Message) {
    for attempt in 1..=ACK_TRIES {
        match msg.double_ack().await {
            Ok(()) => return,
            Err(e) if attempt == ACK_TRIES => {
                warn!(error = %e, "the job's ack was not confirmed; it will be delivered again and not rerun");
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(200 * u64::from(attempt))).await,
        }
    }
}

/// Runs a decoded job to its terminal event, then acks it.
#[allow(clippy::too_many_lines)]
async fn run(
    fleet: &Arc<Fleet>,
    msg: jetstream::Message,
    job: ChatJob,
    leg: Leg,
    delivery: Delivery,
    holder: String,
    started: Instant,
) {
    let metrics = &fleet.metrics;
    metrics.chat_jobs_in_flight.inc();
    let id = job.invocation_id.clone();
    let tenant = job.tenant().to_string();
    let (run, cancel) = fleet.register_run(&id, &tenant);
    let (first_seq, owner) = match &leg {
        Leg::Fresh { .. } => (0, owner(delivery)),
        Leg::Resume(p) => (p.next_seq, p.owner.clone()),
    };
    let events = Events::start_at(
        fleet.client.clone(),
        &fleet.config.subjects,
        &tenant,
        &id,
        first_seq,
    );
    let keep_alive = fleet.heartbeat.hold(&msg);

    let now = toolfleet_protocol::now_ms();
    let (deadline_ms, timeout) = match &leg {
        Leg::Fresh { .. } => invocation_deadline(fleet, &job, delivery, now),
        // The wait for a person did not count: what was left then.
        Leg::Resume(p) => (now + p.remaining_ms, Duration::from_millis(p.remaining_ms)),
    };
    let resumed = matches!(leg, Leg::Resume(_));
    let resumed_from = match &leg {
        Leg::Resume(p) => Some(p.park_id.clone()),
        Leg::Fresh { .. } => None,
    };
    let left = Duration::from_millis(deadline_ms.saturating_sub(now));
    let cancel_check = crate::context::CancelCheck::default();
    let cancelled_early = cancelled_before_start(fleet, &id, &tenant, &cancel_check).await;
    let invocation = async {
        match leg {
            Leg::Fresh { agent_depth } => {
                invoke(fleet, job, deadline_ms, agent_depth, &events, &cancel_check).await
            }
            Leg::Resume(parked) => {
                crate::approvals::resume(fleet, *parked, deadline_ms, &events, &cancel_check).await
            }
        }
    };
    let superseded = |events: Events| {
        let id = &id;
        async move {
            events.close().await;
            fleet.forget_run(id, run);
            metrics.chat_jobs.with_label_values(&["superseded"]).inc();
            metrics.chat_jobs_in_flight.dec();
        }
    };
    let outcome = tokio::select! {
        biased;
        // Cancelled while it waited in the stream: nothing runs.
        _ = std::future::ready(()), if cancelled_early => Err(Failure::new("cancelled", "the invocation was cancelled before it started")),
        // Another delivery's run took the invocation over: it speaks for
        // the invocation now; this one stops without a word. (Renewed
        // here, beside the run, rather than on a task of its own.)
        end = keep_lease(fleet, &id, &tenant, &holder, &cancel_check) => match end {
            LeaseEnd::TakenOver => {
                drop(keep_alive);
                superseded(events).await;
                return;
            }
            LeaseEnd::Cancelled => Err(Failure::new("cancelled", "the invocation was cancelled")),
        },
        // A bug must end the invocation with an error event, not leave it
        // silent.
        r = std::panic::AssertUnwindSafe(invocation).catch_unwind(), if !left.is_zero() && !cancelled_early => {
            r.unwrap_or_else(|_| Err(Failure::new("internal_error", "the orchestrator failed unexpectedly; see its log")))
        }
        _ = tokio::time::sleep(left) => Err(Failure::new("deadline_exceeded", format!("no answer within {} ms of submission", timeout.as_millis()))),
        _ = cancel.cancelled() => Err(Failure::new("cancelled", "the invocation was cancelled")),
    };
    // Only the run that holds the lease speaks for the invocation: checked
    // (and renewed, so nobody can take it over for the lease's length)
    // right before the terminal event, so a run that lost it between two
    // renewals adds no second terminal event, finish or ack.
    if let Ok(Lease::Busy { .. }) = fleet.store.lease(&id, &holder, LEASE_TTL).await {
        warn!(invocation_id = %id, "this run's lease was taken over while it ended; it stops without its terminal event");
        drop(keep_alive);
        superseded(events).await;
        return;
    }
    let outcome = match outcome {
        Ok(Finished::Parked(mut parked)) => {
            parked.owner = owner.clone();
            parked.remaining_ms = deadline_ms.saturating_sub(toolfleet_protocol::now_ms());
            let requests = parked.requests(fleet);
            parked.next_seq = events.next_seq() + requests.len() as u64;
            parked.resumed_from = resumed_from.clone();
            match fleet.keep_parked(&parked).await {
                Ok(()) => {
                    for request in requests {
                        events.send(request);
                    }
                    events.close().await;
                    // The id stays claimed for as long as it may wait.
                    let wait = parked
                        .expires_at_ms
                        .saturating_sub(toolfleet_protocol::now_ms())
                        + parked.remaining_ms
                        + 3_600_000;
                    if let Err(e) = fleet
                        .store
                        .keep_claim(&id, Duration::from_millis(wait))
                        .await
                    {
                        warn!(invocation_id = %id, error = %e, "cannot extend the parked invocation's claim past the store's TTL");
                    }
                    // A cancel that came while it parked found neither a
                    // run nor a record: end it now.
                    if cancel.is_cancelled()
                        || fleet
                            .store
                            .is_cancelled(&id, &tenant)
                            .await
                            .unwrap_or(false)
                    {
                        crate::approvals::cancel_parked(fleet, &id, &tenant).await;
                    }
                    if let Err(e) = fleet.store.release_lease(&id, &holder).await {
                        warn!(invocation_id = %id, error = %e, "cannot give up the parked run's lease; its resumption waits for it to lapse");
                    }
                    drop(keep_alive);
                    // Acked: the invocation lives in the parked bucket now.
                    ack(&msg).await;
                    fleet.forget_run(&id, run);
                    metrics.chat_jobs.with_label_values(&["parked"]).inc();
                    metrics.chat_jobs_in_flight.dec();
                    info!(
                        outcome = "parked",
                        held = parked
                            .calls
                            .iter()
                            .filter(|c| matches!(c.state, crate::approvals::CallState::Held))
                            .count(),
                        expires_at_ms = parked.expires_at_ms,
                        duration_ms = started.elapsed().as_millis() as u64,
                        "chat job parked for approval"
                    );
                    return;
                }
                Err(e) => Err(Failure::new(
                    "approval_unavailable",
                    format!("a call needs approval, but the invocation cannot be parked: {e}"),
                )),
            }
        }
        Ok(Finished::Completed(completed)) => Ok(completed),
        Err(f) => Err(f),
    };
    let (label, code) = match outcome {
        Ok(completed) => {
            events.finish(completed);
            ("completed", None)
        }
        Err(f) => {
            warn!(code = %f.code, message = %f.message, "invocation failed");
            let code = f.code.clone();
            events.finish(ChatEventBody::Error {
                code: f.code,
                message: f.message,
            });
            ("error", Some(code))
        }
    };
    let span = tracing::Span::current();
    span.record(
        "otel.status_code",
        if code.is_none() { "ok" } else { "error" },
    );
    if let Some(code) = &code {
        span.record("error.type", code.as_str());
    }
    let terminal = events.close().await;
    // The run ended: a redelivery (its ack lost) must not run it again.
    if let Some(terminal) = terminal
        && let Err(e) = fleet.store.finish(&id, &owner, &terminal).await
    {
        warn!(error = %e, "cannot mark the invocation finished; if this job's ack is lost it runs again");
    }
    if resumed {
        fleet.forget_parked(&id).await;
    }
    drop(keep_alive);
    // Ack last: only after the terminal event is out.
    ack(&msg).await;
    fleet.forget_run(&id, run);
    metrics.chat_jobs.with_label_values(&[label]).inc();
    metrics.chat_jobs_in_flight.dec();
    let took = started.elapsed();
    metrics.chat_job_duration.observe(took.as_secs_f64());
    // One line per finished job (the span carries its ids).
    info!(
        outcome = label,
        code = code.as_deref().unwrap_or(""),
        duration_ms = took.as_millis() as u64,
        "chat job finished"
    );
}

/// The invocation's deadline (Unix ms) and its timeout: the job's own, or
/// the orchestrator's default, counted as [`deadline_ms`] does.
fn invocation_deadline(
    fleet: &Fleet,
    job: &ChatJob,
    delivery: Delivery,
    now: u64,
) -> (u64, Duration) {
    let timeout = job
        .timeout_ms
        .map(Duration::from_millis)
        .unwrap_or(fleet.config.default_timeout);
    (deadline_ms(delivery.published_ms, now, timeout), timeout)
}

/// The invocation's deadline (Unix ms): `timeout` after the job was
/// published — time queued in the stream counts — or after `now` when the
/// publish time is unknown or in the future (clock skew).
fn deadline_ms(published_ms: Option<u64>, now: u64, timeout: Duration) -> u64 {
    published_ms.unwrap_or(now).min(now) + timeout.as_millis() as u64
}

/// Ends a chat job that will not run: an `error` event when the invocation
/// id is known, a dead letter that always carries the id (when one was
/// found) and the job's safe headers, and `term`.
async fn dead_letter(
    fleet: &Fleet,
    msg: &jetstream::Message,
    delivery: Delivery,
    rejection: Rejection<'_>,
) {
    if let Some(id) = rejection
        .invocation_id
        .as_ref()
        .filter(|_| rejection.tell_sender)
    {
        let events = Events::start(
            fleet.client.clone(),
            &fleet.config.subjects,
            &rejection.tenant,
            id,
        );
        events.finish(ChatEventBody::Error {
            code: rejection.event_code.into(),
            message: rejection.error.clone(),
        });
        events.close().await;
    }
    let dead = DeadLetter {
        kind: DeadLetterKind::Chat,
        stream: fleet.config.subjects.chat_stream(),
        stream_sequence: delivery.stream_sequence,
        invocation_id: rejection.invocation_id,
        call_id: None,
        tool_id: None,
        attempts: delivery.attempt,
        code: rejection.code.to_string(),
        error: rejection.error,
        headers: dead_letter_headers(msg.headers.as_ref()),
        raw_headers: None,
        job: toolfleet_protocol::dead_letter_job(&msg.payload),
    };
    fleet
        .metrics
        .dead_letters
        .with_label_values(&["chat", ""])
        .inc();
    let _ = fleet
        .client
        .publish(
            fleet.config.subjects.dead_letter(DeadLetterKind::Chat),
            encode(&dead),
        )
        .await;
    let _ = msg.ack_with(AckKind::Term).await;
}

/// Ends a chat job whose headers the NATS client cannot read (found by the
/// pull loop's sweep and already removed from the stream): an `error`
/// event when an invocation id can be read from it and it may speak for
/// that invocation, and a dead letter with the headers as stored.
pub(crate) async fn poison(fleet: Arc<Fleet>, poison: toolfleet_service::poison::Poison) {
    use toolfleet_protocol::headers::INVOCATION_ID;
    let invocation_id = salvage_invocation_id(&poison.payload, None).or_else(|| {
        poison
            .header(INVOCATION_ID)
            .filter(|id| toolfleet_protocol::valid_invocation_id(id))
            .map(str::to_string)
    });
    let delivery = Delivery {
        attempt: 1,
        stream_sequence: poison.stream_sequence,
        published_ms: None,
    };
    let error = format!(
        "the job's headers cannot be read ({}); it was removed from the queue",
        poison.reason
    );
    fleet
        .metrics
        .chat_jobs
        .with_label_values(&["malformed"])
        .inc();
    if let Some(id) = &invocation_id
        && matches!(
            claim(
                &fleet,
                id,
                delivery,
                &uuid::Uuid::new_v4().simple().to_string()
            )
            .await,
            Claimed::Ours
        )
    {
        let tenant = fleet
            .config
            .subjects
            .submit_tenant(&poison.subject)
            .unwrap_or(DEFAULT_TENANT);
        let events = Events::start(fleet.client.clone(), &fleet.config.subjects, tenant, id);
        events.finish(ChatEventBody::Error {
            code: "unreadable_headers".into(),
            message: error.clone(),
        });
        events.close().await;
    }
    let dead = DeadLetter {
        kind: DeadLetterKind::Chat,
        stream: fleet.config.subjects.chat_stream(),
        stream_sequence: poison.stream_sequence,
        invocation_id,
        call_id: None,
        tool_id: None,
        attempts: 1,
        code: "unreadable_headers".into(),
        error,
        headers: Default::default(),
        raw_headers: Some(poison.raw_headers),
        job: None,
    };
    fleet
        .metrics
        .dead_letters
        .with_label_values(&["chat", ""])
        .inc();
    let _ = fleet
        .client
        .publish(
            fleet.config.subjects.dead_letter(DeadLetterKind::Chat),
            encode(&dead),
        )
        .await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_deadline_counts_from_publication_never_from_the_future() {
        let t = Duration::from_secs(10);
        assert_eq!(deadline_ms(Some(1_000), 5_000, t), 11_000);
        assert_eq!(deadline_ms(None, 5_000, t), 15_000);
        // A publish time ahead of our clock is not trusted.
        assert_eq!(deadline_ms(Some(9_000), 5_000, t), 15_000);
    }
}
