//! Claims and leases: one invocation id runs once, by one live run.
//!
//! A delivery first **claims** the invocation for its message (its stream
//! sequence): a second message with the same id of the same tenant — a
//! client's retry, a forgery — is refused, while a redelivery of the
//! claiming message (an orchestrator died) continues, and a finished
//! run's redelivery is answered from its stored terminal event. A delivery
//! that may run then takes the run **lease**, renewed beside the run
//! ([`keep_lease`]): a redelivery while the earlier run is alive (renewing
//! its lease, its acks cut off) waits instead of running twice. A job is
//! acked only after its terminal event, with a confirmed ack ([`ack`]).
//!
//! Claims and leases are the tenant's ([`InvocationKey`]: the submit
//! subject's tenant and the job's id): the same id under another tenant is
//! another invocation, claimed apart, so one tenant's id never blocks,
//! reveals or reaches another's.

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, AckKind};
use toolfleet_store::{Claim, ClaimLease, InvocationKey, Lease};
use tracing::warn;

use crate::Fleet;
use crate::invocation::CancelCheck;

/// How long a run's lease on its invocation lasts unless renewed: shorter
/// than the ack wait, so a crashed orchestrator's lease has lapsed by the
/// time its job is delivered again.
pub(super) const LEASE_TTL: Duration = Duration::from_secs(8);
/// How often a running invocation renews its lease.
const LEASE_RENEW_EVERY: Duration = Duration::from_secs(2);

/// What the stream says about one delivery.
#[derive(Debug, Clone, Copy)]
pub(super) struct Delivery {
    /// 1 for the first delivery.
    pub(super) attempt: u32,
    pub(super) stream_sequence: u64,
    /// When the client published the job (Unix ms), if known.
    pub(super) published_ms: Option<u64>,
}

impl Delivery {
    pub(super) fn of(msg: &jetstream::Message) -> Self {
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

/// A delivery's claim on its invocation, with the run's lease, as taken.
#[derive(Debug, Clone, Copy)]
pub(super) struct Leased {
    /// The lease was taken no earlier than this (its time counts from
    /// here: [`keep_lease`]).
    pub(super) at: Instant,
}

/// Whether a delivery may speak for its invocation.
pub(super) enum Claimed {
    /// This message claimed the invocation (now or on an earlier
    /// delivery), and its run holds the lease.
    Ours(Leased),
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
/// one invocation id of a tenant runs once however often it is submitted:
/// a second message with the same id — a client's retry, a forgery — is
/// refused, while a redelivery of the claiming message (an orchestrator
/// died) continues.
///
/// A delivery that may run then takes the run lease for `holder`: a
/// redelivery while the earlier run is alive (renewing its lease, its acks
/// cut off) is [`Claimed::Held`], not a second run.
pub(super) async fn claim(
    fleet: &Fleet,
    inv: InvocationKey<'_>,
    delivery: Delivery,
    holder: &str,
) -> Claimed {
    claim_as(fleet, inv, &owner(delivery), holder).await
}

/// [`claim`] under the claim owner `owner`.
pub(super) async fn claim_as(
    fleet: &Fleet,
    inv: InvocationKey<'_>,
    owner: &str,
    holder: &str,
) -> Claimed {
    let asked = Instant::now();
    // The claim and the lease in one round trip (one script: the keys
    // share the invocation's hash tag). Whether it was cancelled is read
    // by the run once it is registered (`cancels::cancelled_before_start`),
    // so a cancel is either read there or reaches the registered run.
    let claimed = match fleet
        .store
        .claim_and_lease(inv, owner, holder, LEASE_TTL)
        .await
    {
        Ok(claimed) => claimed,
        Err(e) => return Claimed::Unknown(e.to_string()),
    };
    match claimed {
        ClaimLease {
            lease: Some(Lease::Held),
            ..
        } => Claimed::Ours(Leased { at: asked }),
        ClaimLease {
            lease: Some(Lease::Busy { left, .. }),
            ..
        } => Claimed::Held(left),
        ClaimLease {
            claim: Claim::Finished,
            ..
        } => Claimed::Finished,
        ClaimLease {
            claim: Claim::Other(owner),
            ..
        } => Claimed::Other(owner),
        ClaimLease { claim, .. } => {
            Claimed::Unknown(format!("the store claimed ({claim:?}) but took no lease"))
        }
    }
}

/// The claim owner of a delivery: its message's stream sequence.
pub(super) fn owner(delivery: Delivery) -> String {
    format!("chat-seq-{}", delivery.stream_sequence)
}

/// Claims invocation `inv` for `owner` and `holder`, keeping `msg` alive
/// meanwhile: a store that cannot answer is tried again for
/// [`CLAIM_PATIENCE`], a live run elsewhere until `held_until` (Unix ms).
/// Retried here rather than by redelivery, which would spend the
/// message's deliveries while Redis is away, or while the run that holds
/// the lease — alive, but cut off from NATS — still runs.
pub(super) async fn claim_patiently(
    fleet: &Fleet,
    msg: &jetstream::Message,
    inv: InvocationKey<'_>,
    owner: &str,
    holder: &str,
    held_until: u64,
) -> Claimed {
    let _alive = fleet.heartbeat.hold(msg);
    let mut claimed = claim_as(fleet, inv, owner, holder).await;
    let until = Instant::now() + CLAIM_PATIENCE;
    while match claimed {
        Claimed::Unknown(_) => Instant::now() < until,
        Claimed::Held(_) => toolfleet_protocol::now_ms() < held_until,
        _ => false,
    } {
        tokio::time::sleep(Duration::from_secs(1)).await;
        claimed = claim_as(fleet, inv, owner, holder).await;
    }
    claimed
}

/// Gives `msg` back to be delivered again when its invocation could not be
/// claimed. A store that cannot answer: not run unclaimed (a duplicate
/// could run twice), not lost — it comes back when the store may answer.
/// A run alive elsewhere past its patience (renewing its lease, its acks
/// not reaching NATS): not a second run — it comes back, and is answered
/// from the finished run or run once the lease lapses.
pub(super) async fn give_back(msg: &jetstream::Message, id: &str, claimed: Claimed) {
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

/// How long a job waits before it is delivered again when its invocation
/// cannot be claimed (the store did not answer within its retry budget).
pub(super) const CLAIM_RETRY_DELAY: Duration = Duration::from_secs(5);

/// How long a delivery keeps trying to claim its invocation (sending
/// in-progress acks) before it gives the job back.
const CLAIM_PATIENCE: Duration = Duration::from_secs(30);

/// Why [`keep_lease`] stopped a run.
pub(super) enum LeaseEnd {
    /// Another run holds the lease: this one stops without a word.
    TakenOver,
    /// The invocation's cancel tombstone is there: a cancel this
    /// orchestrator did not hear (it was disconnected when it was
    /// published; another orchestrator remembered it).
    Cancelled,
    /// The lease could not be renewed and may lapse soon: the run stops
    /// without a word before another can take the invocation over.
    Lost,
}

/// How long before its lease could lapse a run that cannot renew it holds
/// its tool calls ([`CancelCheck::lease_in_doubt`]): no tool job goes out
/// until a renewal succeeds (a tool job being published at that moment
/// has this long to get out).
pub(super) const LEASE_DOUBT: Duration = Duration::from_secs(3);

/// How long before its lease could lapse a run that still cannot renew it
/// stops ([`LeaseEnd::Lost`]).
pub(super) const LEASE_STOP: Duration = Duration::from_secs(1);

/// How soon a failed renewal is tried again.
const LEASE_RETRY_EVERY: Duration = Duration::from_millis(500);

/// Renews the run's lease for as long as it is polled (beside the run);
/// returns when another run holds it, when the invocation was cancelled
/// (read in the same round trip), or when the lease may lapse.
///
/// The lease lasts [`LEASE_TTL`] from the last renewal that was asked
/// when the store held it (from `leased_at`, the claim's, at first). A
/// store that cannot answer (slow, lost, or cut off from this
/// orchestrator) does not end the run at once. [`LEASE_DOUBT`] before the
/// lease could lapse the run holds its tool calls — none starts until a
/// renewal succeeds, and one does, so a Redis failover pauses runs rather
/// than ending them. [`LEASE_STOP`] before it could lapse the run stops
/// ([`LeaseEnd::Lost`]): a redelivery may take the invocation over once
/// the lease has lapsed; it replays the run and adopts the calls already
/// made under the same call ids (their results read from the ledger), so
/// no tool call runs twice.
pub(super) async fn keep_lease(
    fleet: &Fleet,
    inv: InvocationKey<'_>,
    (holder, leased_at): (&str, Instant),
    check: &CancelCheck,
) -> LeaseEnd {
    let id = inv.invocation_id();
    let mut held_since = leased_at;
    let mut next = leased_at + LEASE_RENEW_EVERY;
    let mut in_doubt = false;
    loop {
        let doubt_at = held_since + LEASE_TTL.saturating_sub(LEASE_DOUBT);
        let stop_at = held_since + LEASE_TTL.saturating_sub(LEASE_STOP);
        let wake = if in_doubt { next } else { next.min(doubt_at) };
        tokio::time::sleep_until(wake.min(stop_at).into()).await;
        let now = Instant::now();
        if now >= stop_at {
            return lost(id, check);
        }
        if !in_doubt && now >= doubt_at {
            in_doubt = doubt(id, check);
        }
        if now < next {
            continue;
        }
        // Boxed: this future lives beside the whole run, and the store
        // call (a few hundred bytes of state) is only briefly alive.
        let mut renew = Box::pin(fleet.store.renew_lease(inv, holder, LEASE_TTL));
        // A renewal that hangs past the point of doubt puts the run in
        // doubt while it still waits.
        let renewal = loop {
            let until = if in_doubt { stop_at } else { doubt_at };
            match tokio::time::timeout_at(until.into(), &mut renew).await {
                Ok(renewal) => break Some(renewal),
                Err(_) if !in_doubt => in_doubt = doubt(id, check),
                Err(_) => break None,
            }
        };
        match renewal {
            None => return lost(id, check),
            Some(renewal) => match renewal {
                Ok((Lease::Held, false)) => {
                    check.passed();
                    held_since = now;
                    next = now + LEASE_RENEW_EVERY;
                    if in_doubt {
                        in_doubt = false;
                        check.lease_in_doubt(false);
                        tracing::info!(invocation_id = %id, "this run's lease is renewed again; its tool calls go on");
                    }
                }
                Ok((Lease::Held, true)) => {
                    warn!(invocation_id = %id, "the invocation was cancelled (its tombstone is in the store; this orchestrator missed the cancel message); it stops");
                    return LeaseEnd::Cancelled;
                }
                Ok((Lease::Busy { .. }, _)) => {
                    warn!(invocation_id = %id, "this run's lease on the invocation was taken over (it could not renew in time); it stops");
                    return LeaseEnd::TakenOver;
                }
                Err(e) => {
                    warn!(invocation_id = %id, error = %e, "cannot renew the run's lease; trying again");
                    next = Instant::now() + LEASE_RETRY_EVERY;
                }
            },
        }
    }
}

/// The run's lease is in doubt: its tool calls wait. Returns `true`.
fn doubt(id: &str, check: &CancelCheck) -> bool {
    check.lease_in_doubt(true);
    warn!(invocation_id = %id, "this run's lease could not be renewed; it starts no tool call until it is");
    true
}

/// The run stops: its lease could not be renewed in time.
fn lost(id: &str, check: &CancelCheck) -> LeaseEnd {
    check.lease_in_doubt(true);
    warn!(invocation_id = %id, "this run's lease could not be renewed and may lapse; it stops here (a redelivery takes the invocation over and adopts its calls)");
    LeaseEnd::Lost
}

/// Answers a delivery whose invocation's run already finished — its ack
/// was lost (an orchestrator or NATS node died in between), or the events
/// stream never confirmed its terminal event: publishes the stored
/// terminal event again, verbatim, through the stream (its message id
/// drops a repeat), with `msg` kept alive meanwhile; acks once the stream
/// has it, else gives `msg` back to try again. Runs nothing.
pub(super) async fn answer_finished(
    fleet: &Fleet,
    msg: &jetstream::Message,
    inv: InvocationKey<'_>,
) {
    let _alive = fleet.heartbeat.hold(msg);
    let stored = match fleet.store.terminal_event(inv).await {
        Ok(Some(event)) => {
            let subject = fleet
                .config
                .subjects
                .chat_events(inv.tenant(), inv.invocation_id());
            crate::events::publish_terminal(&fleet.client, &subject, event.into()).await
        }
        Ok(None) => true,
        Err(e) => {
            warn!(invocation_id = %inv.invocation_id(), error = %e, "cannot read the finished run's terminal event");
            false
        }
    };
    if stored {
        ack(msg).await;
    } else {
        let _ = msg.ack_with(AckKind::Nak(Some(CLAIM_RETRY_DELAY))).await;
    }
}

/// How often a confirmed ack is tried.
const ACK_TRIES: u32 = 5;

/// Acks a finished job and waits for the server to confirm it, trying again
/// across a reconnection (a NATS node that died with the first ack). A
/// job whose ack never lands is delivered again and answered from its
/// finished claim.
pub(super) async fn ack(msg: &jetstream::Message) {
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

/// A fresh lease holder: one delivery's run, should it get the lease.
pub(super) fn new_holder() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}
