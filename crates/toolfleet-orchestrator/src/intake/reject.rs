//! Jobs that do not run. Every reason is a [`Refusal`]; one path
//! ([`reject`]) counts it, logs it, ends the invocation with an `error`
//! event when the message may speak for it, dead-letters the job and
//! terminates it. A job whose headers the NATS client cannot read
//! ([`poison`]) is taken aside by the pull loop, which terminates it after
//! this: it gets the event and the dead letter. Both kinds of unreadable
//! job count towards their tenant's suspension ([`super::suspend`]); a
//! suspended tenant's job is refused without a dead letter.

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{self, AckKind};
use toolfleet_protocol::{
    ChatEventBody, DEFAULT_TENANT, DeadLetter, DeadLetterKind, ProtocolError, dead_letter_headers,
    salvage_invocation_id,
};
use toolfleet_store::InvocationKey;
use tracing::warn;

use super::MAX_CHAT_ATTEMPTS;
use super::claim::{Claimed, Delivery, claim, new_holder};
use super::suspend::count_poison;
use crate::failure::ChatErrorCode;
use crate::{Events, Fleet};

/// Why a chat job is not run.
pub(super) enum Refusal {
    /// It cannot be decoded (size, JSON, schema).
    Malformed(ProtocolError),
    /// Another message holds the invocation's claim (named by its owner).
    Duplicate { id: String, owner: String },
    /// The job names another tenant than its submit subject's.
    TenantMismatch {
        named: String,
        tenant: String,
        resubmit_to: String,
    },
    /// Delivered more often than it may run.
    TooManyAttempts { attempt: u32 },
    /// Its tenant is suspended for poison, for `left` yet.
    Suspended { tenant: String, left: Duration },
    /// Its tenant had its cap of queued jobs ahead of it.
    QueueFull { tenant: String, cap: u64 },
    /// Its tenant had its cap of delayed jobs waiting (`notBefore`).
    TooManyDelayed { tenant: String, cap: u64 },
}

impl Refusal {
    /// The `chat_jobs_total` outcome it counts as.
    fn outcome(&self) -> &'static str {
        match self {
            Refusal::Malformed(_) | Refusal::TenantMismatch { .. } => "malformed",
            Refusal::Duplicate { .. } => "duplicate",
            Refusal::TooManyAttempts { .. } => "error",
            Refusal::Suspended { .. } => "suspended",
            Refusal::QueueFull { .. } | Refusal::TooManyDelayed { .. } => "error",
        }
    }

    /// The tenant's cap it met (`toolfleet_tenant_cap_refusals_total`'s
    /// `cap`), if that is why.
    fn cap(&self) -> Option<&'static str> {
        match self {
            Refusal::QueueFull { .. } => Some("queued_jobs"),
            Refusal::TooManyDelayed { .. } => Some("delayed_jobs"),
            Refusal::Malformed(ProtocolError::TooLarge { limit, .. })
                if *limit < toolfleet_protocol::MAX_JOB_BYTES =>
            {
                Some("job_bytes")
            }
            _ => None,
        }
    }

    /// The `error` event's code.
    fn event_code(&self) -> ChatErrorCode {
        match self {
            Refusal::Malformed(_) => ChatErrorCode::MalformedJob,
            Refusal::Duplicate { .. } => ChatErrorCode::DuplicateInvocation,
            Refusal::TenantMismatch { .. } => ChatErrorCode::TenantMismatch,
            Refusal::TooManyAttempts { .. } => ChatErrorCode::TooManyAttempts,
            Refusal::Suspended { .. } => ChatErrorCode::TenantSuspended,
            Refusal::QueueFull { .. } | Refusal::TooManyDelayed { .. } => ChatErrorCode::QueueFull,
        }
    }

    /// The dead letter's code: the decoding error's own for a malformed
    /// job, else the event's.
    fn code(&self) -> String {
        match self {
            Refusal::Malformed(e) => e.code().to_string(),
            _ => self.event_code().to_string(),
        }
    }

    /// For people.
    fn message(&self) -> String {
        match self {
            Refusal::Malformed(e) => e.to_string(),
            Refusal::Duplicate { id, owner } => format!(
                "invocation {id} already belongs to another chat job ({owner}); this one is not run"
            ),
            Refusal::TenantMismatch {
                named,
                tenant,
                resubmit_to,
            } => format!(
                "the job names tenant {named:?} but was submitted as tenant {tenant:?} (its submit subject); \
                 submit it to {resubmit_to} under a new invocation id (this one is spent)"
            ),
            Refusal::TooManyAttempts { attempt } => format!(
                "the job was delivered {attempt} times without finishing (an orchestrator stopped while running it each time)"
            ),
            Refusal::Suspended { tenant, left } => format!(
                "tenant {tenant:?} is suspended for {}s more: too many of its chat jobs could not be read \
                 (headers or body); this job was not run, submit it again after that",
                left.as_secs().max(1)
            ),
            Refusal::QueueFull { tenant, cap } => format!(
                "tenant {tenant:?} already had {cap} chat jobs queued or running ahead of this one, \
                 its cap (max_queued_jobs); submit it again when some have finished"
            ),
            Refusal::TooManyDelayed { tenant, cap } => format!(
                "tenant {tenant:?} already has {cap} chat jobs waiting for their notBefore, the \
                 fleet's cap (--max-delayed-jobs); submit this one nearer its time, or use a schedule"
            ),
        }
    }

    /// Whether the job is dead-lettered: not for a suspended tenant's (a
    /// flood of them would flush the dead letters of everyone else; each
    /// is counted and answered).
    fn dead_letters(&self) -> bool {
        !matches!(self, Refusal::Suspended { .. })
    }
}

/// The checks a claimed, decoded job passes before it runs, in order.
pub(super) fn check(
    fleet: &Fleet,
    named: Option<&str>,
    tenant: &str,
    delivery: Delivery,
) -> Result<(), Refusal> {
    if let Some(named) = named.filter(|named| *named != tenant) {
        return Err(Refusal::TenantMismatch {
            named: named.to_string(),
            tenant: tenant.to_string(),
            resubmit_to: fleet.config.subjects.chat_submit(named),
        });
    }
    if delivery.attempt > MAX_CHAT_ATTEMPTS {
        return Err(Refusal::TooManyAttempts {
            attempt: delivery.attempt,
        });
    }
    Ok(())
}

/// Whose job was refused, and whether the sender hears it.
pub(super) struct Refused {
    pub(super) invocation_id: Option<String>,
    /// The tenant whose events subject hears the `error` event.
    pub(super) tenant: String,
    /// Whether the sender gets an `error` event: only when this message
    /// holds the invocation's claim (an event on another job's invocation
    /// would be a second terminal event there).
    pub(super) tell_sender: bool,
    pub(super) refusal: Refusal,
}

/// Ends a chat job that will not run (see the module docs).
pub(super) async fn reject(
    fleet: &Fleet,
    msg: &jetstream::Message,
    delivery: Delivery,
    refused: Refused,
) {
    let refusal = &refused.refusal;
    fleet
        .metrics
        .chat_jobs
        .with_label_values(&[refusal.outcome()])
        .inc();
    if let Some(cap) = refusal.cap() {
        (fleet.metrics.caps_refused)
            .with_label_values(&[refused.tenant.as_str(), cap])
            .inc();
    }
    let error = refusal.message();
    let code = refusal.code();
    warn!(invocation_id = ?refused.invocation_id, code, "chat job not run: {error}");
    if let Some(id) = refused
        .invocation_id
        .as_ref()
        .filter(|_| refused.tell_sender)
    {
        tell(fleet, &refused.tenant, id, refusal.event_code(), &error).await;
    }
    if !refusal.dead_letters() {
        let _ = msg.ack_with(AckKind::Term).await;
        return;
    }
    let dead = DeadLetter {
        kind: DeadLetterKind::Chat,
        stream: fleet.config.subjects.chat_stream(),
        stream_sequence: delivery.stream_sequence,
        invocation_id: refused.invocation_id,
        call_id: None,
        tool_id: None,
        attempts: delivery.attempt,
        code,
        error,
        headers: dead_letter_headers(msg.headers.as_ref()),
        raw_headers: None,
        job: toolfleet_protocol::dead_letter_job(&msg.payload),
    };
    publish(fleet, &dead).await;
    let _ = msg.ack_with(AckKind::Term).await;
}

/// A job that cannot be decoded: the sender hears it when an invocation
/// id can be read from it and this message may claim it.
pub(super) async fn malformed(
    fleet: &Fleet,
    msg: &jetstream::Message,
    delivery: Delivery,
    subject_tenant: Option<String>,
    error: ProtocolError,
) {
    let invocation_id = salvage_invocation_id(&msg.payload, msg.headers.as_ref());
    if let Some(tenant) = &subject_tenant {
        count_poison(fleet, tenant).await;
    }
    let tenant = subject_tenant.unwrap_or_else(|| DEFAULT_TENANT.to_string());
    let tell_sender = match &invocation_id {
        Some(id) => matches!(
            claim(
                fleet,
                InvocationKey::new(&tenant, id),
                delivery,
                &new_holder()
            )
            .await,
            Claimed::Ours(_)
        ),
        None => false,
    };
    let refused = Refused {
        invocation_id,
        tenant,
        tell_sender,
        refusal: Refusal::Malformed(error),
    };
    reject(fleet, msg, delivery, refused).await;
}

/// How long a poison chat job waits for the store (to claim its
/// invocation and tell its sender) before it is dead-lettered untold.
const POISON_PATIENCE: Duration = Duration::from_secs(300);

/// Ends a chat job whose headers the NATS client cannot read (taken aside
/// by the pull loop, which terminates it after this): an `error` event
/// when an invocation id can be read from it and it may speak for that
/// invocation, and a dead letter with the headers as received.
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
        "the job's headers cannot be read ({}); it was not run",
        poison.reason
    );
    let subject_tenant = fleet
        .config
        .subjects
        .lane_tenant(&poison.subject)
        .map(|(tenant, _)| tenant);
    let tenant = subject_tenant.unwrap_or(DEFAULT_TENANT);
    // Its sender is told only when the message may speak for the
    // invocation (it holds the claim): a store that cannot say yet is
    // waited for (the message kept alive meanwhile), so the sender is
    // told once the store is back.
    let tell_sender = match &invocation_id {
        Some(id) => {
            let inv = InvocationKey::new(tenant, id);
            claim_for_poison(&fleet, inv, delivery).await
        }
        None => false,
    };
    fleet
        .metrics
        .chat_jobs
        .with_label_values(&["malformed"])
        .inc();
    if let Some(tenant) = subject_tenant {
        count_poison(&fleet, tenant).await;
    }
    if let (true, Some(id)) = (tell_sender, &invocation_id) {
        tell(&fleet, tenant, id, ChatErrorCode::UnreadableHeaders, &error).await;
    }
    let dead = DeadLetter {
        kind: DeadLetterKind::Chat,
        stream: fleet.config.subjects.chat_stream(),
        stream_sequence: poison.stream_sequence,
        invocation_id,
        call_id: None,
        tool_id: None,
        attempts: 1,
        code: ChatErrorCode::UnreadableHeaders.to_string(),
        error,
        headers: Default::default(),
        raw_headers: Some(poison.raw_headers),
        job: None,
    };
    publish(&fleet, &dead).await;
}

/// Claims a poison's invocation for its message; whether it may speak for
/// it. A store that cannot answer is asked again every second for up to
/// [`POISON_PATIENCE`]; after that the poison is ended untold.
async fn claim_for_poison(fleet: &Fleet, inv: InvocationKey<'_>, delivery: Delivery) -> bool {
    let until = std::time::Instant::now() + POISON_PATIENCE;
    loop {
        match claim(fleet, inv, delivery, &new_holder()).await {
            Claimed::Ours(_) => return true,
            Claimed::Unknown(e) if std::time::Instant::now() < until => {
                warn!(invocation_id = %inv.invocation_id(), error = %e, "a chat job whose headers cannot be read waits for the store, to tell its sender");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
            _ => return false,
        }
    }
}

/// The invocation's one terminal event: an `error` with `code`.
async fn tell(fleet: &Fleet, tenant: &str, id: &str, code: ChatErrorCode, message: &str) {
    let events = Events::start(fleet.client.clone(), &fleet.config.subjects, tenant, id);
    events.finish(ChatEventBody::Error {
        code: code.to_string(),
        message: message.to_string(),
        retry_after_ms: None,
    });
    if events.close().await.is_some() {
        (fleet.tenant_store)
            .event_stored(&fleet.js, &fleet.config, tenant)
            .await;
    }
}

async fn publish(fleet: &Fleet, dead: &DeadLetter) {
    let published = toolfleet_service::dead_letters::publish(
        &fleet.client,
        &fleet.config.subjects,
        &fleet.metrics.dead_letters,
        dead,
    )
    .await;
    if let Err(e) = published {
        warn!(error = %e, "cannot publish a chat dead letter");
    }
}
